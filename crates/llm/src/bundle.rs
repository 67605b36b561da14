//! A split model (a *bundle*, written by `npuc build`): a directory holding `bundle.json` and
//! one `.npuc` artifact per part, each with graphs for every (AR variant, context) pair.
//!
//! [`Bundle`] runs the parts in sequence for each call: part 1 turns tokens into the hidden
//! state, the middle parts carry it on, the last part returns logits. Each part owns the KV
//! caches of its own layers, updated in place. Per call it picks the AR variant (as
//! [`crate::Engine`] does) and the smallest compiled context that holds the sequence so far:
//! short sequences run the cheaper small-context graphs, and when a sequence outgrows a
//! context the caches move once into the next larger one.

use crate::build::split::{self, HIDDEN_IN, HIDDEN_OUT};
use crate::engine::{weight_bytes_per_step, write_kv, TOKENIZER_KEY};
use crate::{bail, GgufMetaJson, LlmError, Result};
use npuc_ir::{f16, DType, Tensor};
use npuc_runtime::{Session, SessionOptions, Value};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The manifest file of a bundle directory.
pub const MANIFEST: &str = "bundle.json";
/// `format` value of [`BundleManifest`].
pub const FORMAT: &str = "npuc-bundle";
/// Manifest version this build reads and writes.
pub const VERSION: u32 = 1;

/// `bundle.json`: what the parts are and how they connect.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BundleManifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// The npuc version that built it.
    pub npuc_version: String,
    /// `general.architecture`.
    pub arch: String,
    pub n_layers: usize,
    pub n_embd: usize,
    pub vocab: usize,
    /// Tokens per call of the graphs (every part has each).
    pub ar: Vec<usize>,
    /// Context lengths of the graphs (every part has each).
    pub ctx: Vec<usize>,
    /// The weight budget per part, when the pipeline gave one.
    pub max_part_bytes: Option<u64>,
    pub source: SourceRecord,
    pub parts: Vec<PartRecord>,
    /// Prompts the pipeline declared for checks.
    #[serde(default)]
    pub test_prompts: Vec<String>,
}

/// The model a bundle was built from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SourceRecord {
    /// File name of the GGUF.
    pub file: String,
    pub bytes: u64,
    /// sha256 of the GGUF's bytes (hex).
    pub sha256: String,
}

/// One part of a bundle.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PartRecord {
    /// Artifact file name inside the bundle directory.
    pub file: String,
    /// First layer and one past the last.
    pub layers: [usize; 2],
    /// `fast` / `parity` / `exact`.
    pub precision: String,
    /// Weight bytes stored in the artifact.
    pub weight_bytes: u64,
    pub file_bytes: u64,
    /// sha256 of the artifact file (hex).
    pub sha256: String,
}

impl BundleManifest {
    /// Reads `dir/bundle.json`.
    pub fn read(dir: &Path) -> Result<BundleManifest> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            LlmError::msg(format!(
                "{}: {e} (a bundle directory is made by `npuc build PIPELINE.toml -o DIR`)",
                path.display()
            ))
        })?;
        let m: BundleManifest = serde_json::from_str(&text)
            .map_err(|e| LlmError::msg(format!("{}: {e}", path.display())))?;
        if m.format != FORMAT || m.version != VERSION {
            bail!(
                "{}: format '{}' version {}, this npuc reads '{FORMAT}' version {VERSION}; rebuild it with `npuc build`",
                path.display(),
                m.format,
                m.version
            );
        }
        Ok(m)
    }
}

/// Whether `path` is a bundle directory.
pub fn is_bundle(path: &Path) -> bool {
    path.is_dir() && path.join(MANIFEST).is_file()
}

/// How to open a [`Bundle`].
#[derive(Clone, Debug)]
pub struct BundleOptions {
    /// Kernel threads.
    pub threads: usize,
    /// Largest context to use (one the bundle was built for); default: its largest.
    pub ctx: Option<usize>,
    /// AR variants (tokens per call) to use; empty: all the bundle has.
    pub ar: Vec<usize>,
}

/// One loaded part: sessions per (tokens, ctx) and its layers' caches.
struct PartRun {
    layers: Range<usize>,
    first: bool,
    last: bool,
    kv: DType,
    kvh: usize,
    head_dim: usize,
    sessions: BTreeMap<(usize, usize), Session>,
    /// `2 * layers.len()` caches at the current context: key of layer `layers.start + i` at
    /// `2i`, value at `2i + 1`.
    caches: Vec<Arc<Tensor>>,
}

/// A split model ready to run (see the module docs).
pub struct Bundle {
    dir: PathBuf,
    manifest: BundleManifest,
    parts: Vec<PartRun>,
    /// Contexts in use, ascending.
    ctxs: Vec<usize>,
    /// AR variants in use, descending.
    ars: Vec<usize>,
    /// Index into `ctxs` of the caches' current size.
    cur_ctx: usize,
    position: usize,
    meta: GgufMetaJson,
    /// Times a cache had to be copied because a reference outlived a run (should stay 0).
    cache_copies: usize,
    /// Weight bytes one decode step reads, all parts together.
    decode_weight_bytes: u64,
}

impl Bundle {
    /// Opens the bundle directory `dir` (the parts' artifacts are checked as every artifact
    /// is on load; `npuc inspect DIR` also checks their sha256 against the manifest).
    pub fn open(dir: &Path, opts: &BundleOptions) -> Result<Bundle> {
        crate::ops::register();
        let manifest = BundleManifest::read(dir)?;
        let mut ctxs = manifest.ctx.clone();
        ctxs.sort_unstable();
        ctxs.dedup();
        if let Some(c) = opts.ctx {
            if !ctxs.contains(&c) {
                bail!(
                    "{}: built for contexts {:?}, {c} was asked; add it to the pipeline's ctx list and rebuild",
                    dir.display(),
                    ctxs
                );
            }
            ctxs.retain(|&x| x <= c);
        }
        let mut ars = manifest.ar.clone();
        if !opts.ar.is_empty() {
            for a in &opts.ar {
                if !ars.contains(a) {
                    bail!(
                        "{}: has no ar{a} graphs (it holds ar {:?}); add it to the pipeline's ar list and rebuild",
                        dir.display(),
                        manifest.ar
                    );
                }
            }
            ars = opts.ar.clone();
        }
        ars.sort_unstable_by(|a, b| b.cmp(a));
        ars.dedup();
        if manifest.parts.is_empty() {
            bail!("{}: the manifest lists no parts", dir.display());
        }
        let mut parts = vec![];
        let mut meta = None;
        let mut decode_weight_bytes = 0;
        let count = manifest.parts.len();
        let mut expect_start = 0;
        for (i, rec) in manifest.parts.iter().enumerate() {
            let path = dir.join(&rec.file);
            let layers = rec.layers[0]..rec.layers[1];
            if layers.start != expect_start || layers.is_empty() {
                bail!(
                    "{}: part {} holds layers {}..{}, expected to start at layer {expect_start}",
                    dir.join(MANIFEST).display(),
                    i + 1,
                    layers.start,
                    layers.end
                );
            }
            expect_start = layers.end;
            let art = npuc_format::Artifact::open(&path)?;
            let mut sessions = BTreeMap::new();
            let mut facts = None;
            let mut part_step_bytes = 0;
            for &a in &ars {
                for &c in &ctxs {
                    let name = split::graph_name(a, c);
                    let m = art.model(Some(&name)).map_err(|e| {
                        LlmError::msg(format!(
                            "{}: graph {name}: {e} (the manifest lists ar{a} and ctx {c})",
                            path.display()
                        ))
                    })?;
                    if let Some(j) = m.metadata(TOKENIZER_KEY) {
                        let j: serde_json::Value = serde_json::from_str(j).map_err(|e| {
                            LlmError::msg(format!(
                                "{}: graph '{name}': bad {TOKENIZER_KEY} JSON: {e}",
                                path.display()
                            ))
                        })?;
                        meta = Some(GgufMetaJson::from_json(&j)?);
                    }
                    let f = PartFacts::of(&m, &path, &name)?;
                    if f.layers != layers {
                        bail!(
                            "{}: graph {name} holds layers {}..{}, the manifest says {}..{}",
                            path.display(),
                            f.layers.start,
                            f.layers.end,
                            layers.start,
                            layers.end
                        );
                    }
                    facts = Some(f);
                    part_step_bytes = part_step_bytes.max(weight_bytes_per_step(&m));
                    let sess = Session::new(
                        &m,
                        SessionOptions {
                            threads: opts.threads.max(1),
                        },
                    )?;
                    // As in the Engine: one-shot large buffers are not worth keeping per graph.
                    sess.set_buffer_reuse(false);
                    sessions.insert((a, c), sess);
                }
            }
            let Some(f) = facts else {
                bail!("{}: no graphs selected", path.display());
            };
            decode_weight_bytes += part_step_bytes;
            parts.push(PartRun {
                layers,
                first: i == 0,
                last: i + 1 == count,
                kv: f.kv,
                kvh: f.kvh,
                head_dim: f.head_dim,
                sessions,
                caches: vec![],
            });
        }
        if expect_start != manifest.n_layers {
            bail!(
                "{}: the parts end at layer {expect_start}, the model has {} layers",
                dir.join(MANIFEST).display(),
                manifest.n_layers
            );
        }
        check_caches_fit(&parts, *ctxs.last().expect("non-empty"))?;
        let mut b = Bundle {
            dir: dir.to_path_buf(),
            manifest,
            parts,
            ctxs,
            ars,
            cur_ctx: 0,
            position: 0,
            meta: meta.unwrap_or_default(),
            cache_copies: 0,
            decode_weight_bytes,
        };
        b.alloc_caches(0);
        Ok(b)
    }

    /// The manifest.
    pub fn manifest(&self) -> &BundleManifest {
        &self.manifest
    }
    /// The bundle directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The largest context in use (the sequence limit).
    pub fn ctx(&self) -> usize {
        *self.ctxs.last().expect("non-empty")
    }
    /// The context the caches have now.
    pub fn current_ctx(&self) -> usize {
        self.ctxs[self.cur_ctx]
    }
    pub fn vocab(&self) -> usize {
        self.manifest.vocab
    }
    pub fn position(&self) -> usize {
        self.position
    }
    /// Weight bytes one decode step reads from memory, all parts together (as
    /// [`crate::Engine::decode_weight_bytes`]).
    pub fn decode_weight_bytes(&self) -> u64 {
        self.decode_weight_bytes
    }
    /// Times a KV cache had to be copied instead of updated in place.
    pub fn cache_copies(&self) -> usize {
        self.cache_copies
    }
    /// The tokenizer's GGUF metadata (stored in part 1).
    pub fn metadata(&self) -> &GgufMetaJson {
        &self.meta
    }
    /// Hands the tokenizer's GGUF metadata over (as [`crate::Engine::take_metadata`]):
    /// [`Bundle::metadata`] is empty afterwards.
    pub fn take_metadata(&mut self) -> GgufMetaJson {
        std::mem::take(&mut self.meta)
    }
    /// Position 0; the caches go back to the smallest context.
    pub fn reset(&mut self) {
        self.position = 0;
        if self.cur_ctx != 0 {
            self.alloc_caches(0);
        }
    }
    /// Drops cache entries at `pos` and after.
    pub fn truncate(&mut self, pos: usize) {
        self.position = self.position.min(pos);
    }

    fn alloc_caches(&mut self, ctx_idx: usize) {
        let c = self.ctxs[ctx_idx];
        for p in &mut self.parts {
            p.caches = (0..2 * p.layers.len())
                .map(|_| Arc::new(Tensor::zeros(p.kv, vec![p.kvh, c, p.head_dim])))
                .collect();
        }
        self.cur_ctx = ctx_idx;
    }

    /// Moves the caches into the context `ctx_idx` (larger), keeping their contents.
    fn grow_caches(&mut self, ctx_idx: usize) -> Result<()> {
        let (old, new) = (self.ctxs[self.cur_ctx], self.ctxs[ctx_idx]);
        for p in &mut self.parts {
            for cache in &mut p.caches {
                let mut grown = Tensor::zeros(p.kv, vec![p.kvh, new, p.head_dim]);
                match p.kv {
                    DType::F16 => copy_slots::<f16>(cache, &mut grown, old, new, p.head_dim)?,
                    _ => copy_slots::<f32>(cache, &mut grown, old, new, p.head_dim)?,
                }
                *cache = Arc::new(grown);
            }
        }
        self.cur_ctx = ctx_idx;
        Ok(())
    }

    /// Appends `tokens` and returns the last token's logits `[vocab]`, or every token's when
    /// `all_logits` (the [`crate::Engine::forward`] contract).
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            bail!("forward needs at least one token");
        }
        let (ctx, vocab) = (self.ctx(), self.vocab());
        if self.position + tokens.len() > ctx {
            bail!(
                "prompt of {} tokens + {} cached exceeds the bundle's largest context of {ctx}; add a larger ctx to the pipeline",
                tokens.len(),
                self.position
            );
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {t} is outside the vocabulary of {vocab}");
        }
        let mut out = Vec::with_capacity(if all_logits {
            tokens.len() * vocab
        } else {
            vocab
        });
        let mut rest = tokens;
        while !rest.is_empty() {
            let n = self.pick(rest.len())?;
            let count = n.min(rest.len());
            let from = if all_logits {
                0
            } else if count == rest.len() {
                count - 1
            } else {
                count
            };
            let logits = self.run_chunk(n, &rest[..count], from)?;
            out.extend_from_slice(&logits);
            rest = &rest[count..];
        }
        Ok(out)
    }

    /// Tokens per call for the next chunk of `remaining` tokens: the smallest variant that
    /// holds them all, else the largest that fits the context (the Engine's choice, so a
    /// bundle batches a prompt as the unsplit model does).
    fn pick(&self, remaining: usize) -> Result<usize> {
        let room = |n: usize| self.position + n <= self.ctx();
        if let Some(&n) = self
            .ars
            .iter()
            .filter(|&&n| n >= remaining && room(n))
            .min()
        {
            return Ok(n);
        }
        if let Some(&n) = self.ars.iter().filter(|&&n| room(n)).max() {
            return Ok(n);
        }
        bail!(
            "no AR variant can take {remaining} tokens at position {} of {} (variants: {:?}); add ar1 to the pipeline",
            self.position,
            self.ctx(),
            self.ars
        )
    }

    /// Runs the parts over one chunk of `toks` padded to `n`, updates the caches and the
    /// position, and returns the logits of rows `from..toks.len()`.
    fn run_chunk(&mut self, n: usize, toks: &[u32], from: usize) -> Result<Vec<f32>> {
        let pos = self.position;
        let count = toks.len();
        // The smallest context that holds this (padded) chunk, never smaller than the caches'.
        let ci = (self.cur_ctx..self.ctxs.len())
            .find(|&i| pos + n <= self.ctxs[i])
            .ok_or_else(|| {
                LlmError::msg(format!(
                    "internal: ar{n} at position {pos} overflows the context of {}",
                    self.ctx()
                ))
            })?;
        if ci != self.cur_ctx {
            self.grow_caches(ci)?;
        }
        let ctx = self.ctxs[ci];
        // Inputs shared by every part (the Engine's padding and mask conventions).
        let positions: Vec<i64> = (0..n).map(|i| (pos + i) as i64).collect();
        let mut ids: Vec<i64> = toks.iter().map(|&t| t as i64).collect();
        ids.resize(n, 0);
        let mut mask = vec![f32::NEG_INFINITY; n * ctx];
        for i in 0..n {
            let row = &mut mask[i * ctx..(i + 1) * ctx];
            if i < count {
                row[..=pos + i].fill(0.0);
            } else {
                row[pos + i] = 0.0;
            }
        }
        let positions = Value::tensor(Tensor::from_vec(vec![n], positions)?);
        let mask = Value::tensor(Tensor::from_vec(vec![n, ctx], mask)?);
        let token_count = Value::tensor(Tensor::from_vec(vec![1], vec![count as i64])?);
        let logits_from = Value::tensor(Tensor::from_vec(vec![1], vec![from as i64])?);
        let mut carry = Value::tensor(Tensor::from_vec(vec![n], ids)?);
        let mut logits = None;
        let n_parts = self.parts.len();
        for pi in 0..n_parts {
            let part = &mut self.parts[pi];
            let sess = &part.sessions[&(n, ctx)];
            let has = |name: &str| sess.inputs().iter().any(|i| i.name == name);
            let first_input = if part.first { "input_ids" } else { HIDDEN_IN };
            let mut feeds = vec![
                (first_input.to_string(), carry.clone()),
                ("positions".to_string(), positions.clone()),
                ("attn_mask".to_string(), mask.clone()),
            ];
            if has("token_count") {
                feeds.push(("token_count".into(), token_count.clone()));
            }
            if part.last && has("logits_from") {
                feeds.push(("logits_from".into(), logits_from.clone()));
            }
            for (i, l) in part.layers.clone().enumerate() {
                feeds.push((
                    format!("past_key.{l}"),
                    Value::Tensor(part.caches[2 * i].clone()),
                ));
                feeds.push((
                    format!("past_value.{l}"),
                    Value::Tensor(part.caches[2 * i + 1].clone()),
                ));
            }
            let outs = sess.run(feeds).map_err(|e| {
                LlmError::msg(format!(
                    "part {} (layers {}..{}), ar{n} ctx {ctx}: {e}",
                    pi + 1,
                    part.layers.start,
                    part.layers.end
                ))
            })?;
            let mut news: Vec<Option<Arc<Tensor>>> = vec![None; part.caches.len()];
            let mut next = None;
            for (name, v) in outs {
                let Value::Tensor(t) = v else {
                    bail!("part {}: output '{name}' is not a tensor", pi + 1);
                };
                if name == "logits" {
                    logits = Some(t);
                } else if name == HIDDEN_OUT {
                    next = Some(t);
                } else if let Some((kind, l)) = name.split_once('.') {
                    let l: usize = l.parse().map_err(|_| {
                        LlmError::msg(format!("part {}: unexpected output '{name}'", pi + 1))
                    })?;
                    if !part.layers.contains(&l) {
                        bail!(
                            "part {}: output '{name}' is outside its layers {}..{}",
                            pi + 1,
                            part.layers.start,
                            part.layers.end
                        );
                    }
                    let slot = 2 * (l - part.layers.start)
                        + match kind {
                            "new_key" => 0,
                            "new_value" => 1,
                            _ => bail!("part {}: unexpected output '{name}'", pi + 1),
                        };
                    news[slot] = Some(t);
                }
            }
            let (kvh, d) = (part.kvh, part.head_dim);
            for (slot, new) in news.into_iter().enumerate() {
                let l = part.layers.start + slot / 2;
                let Some(new) = new else {
                    bail!("part {}: no KV output for layer {l}", pi + 1);
                };
                if new.shape() != [kvh, n, d] || new.dtype() != part.kv {
                    bail!(
                        "part {}: KV output of layer {l} is {:?} {}, expected [{kvh}, {n}, {d}] {}",
                        pi + 1,
                        new.shape(),
                        new.dtype(),
                        part.kv
                    );
                }
                let cache = match Arc::get_mut(&mut part.caches[slot]) {
                    Some(c) => c,
                    None => {
                        self.cache_copies += 1;
                        Arc::make_mut(&mut part.caches[slot])
                    }
                };
                match part.kv {
                    DType::F16 => write_kv::<f16>(cache, &new, count, pos, ctx)?,
                    _ => write_kv::<f32>(cache, &new, count, pos, ctx)?,
                }
            }
            if !part.last {
                let Some(h) = next else {
                    bail!("part {}: the graph has no '{HIDDEN_OUT}' output", pi + 1);
                };
                carry = Value::Tensor(h);
            }
        }
        let Some(logits) = logits else {
            bail!("the last part has no 'logits' output");
        };
        self.position += count;
        let vocab = self.vocab();
        let rows = logits.as_slice::<f32>()?;
        if rows.len() < count * vocab {
            bail!(
                "logits hold {} values, expected at least {count} x {vocab}",
                rows.len()
            );
        }
        Ok(rows[from * vocab..count * vocab].to_vec())
    }
}

/// What a part graph's `npuc.llm` metadata says about it.
struct PartFacts {
    layers: Range<usize>,
    kv: DType,
    kvh: usize,
    head_dim: usize,
}

impl PartFacts {
    fn of(m: &npuc_ir::Model, path: &Path, name: &str) -> Result<PartFacts> {
        let err = |what: &str| {
            LlmError::msg(format!(
                "{}: graph {name}: {what} (not a part built by `npuc build`)",
                path.display()
            ))
        };
        let j = m
            .metadata(crate::engine::META_KEY)
            .ok_or_else(|| err("no npuc.llm metadata"))?;
        let j: serde_json::Value =
            serde_json::from_str(j).map_err(|e| err(&format!("bad npuc.llm metadata: {e}")))?;
        let u = |k: &str| {
            j.get(k)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| err(&format!("npuc.llm lacks '{k}'")))
        };
        let (start, end) = match (u("layer_start"), u("layer_end")) {
            (Ok(s), Ok(e)) => (s, e),
            // An unsplit graph holds every layer.
            _ => (0, u("n_layers")?),
        };
        let kv = match j.get("kv_dtype").and_then(|v| v.as_str()) {
            Some("float16") | Some("f16") => DType::F16,
            Some("float32") | Some("f32") | Some("float") => DType::F32,
            other => return Err(err(&format!("unsupported kv_dtype {other:?}"))),
        };
        Ok(PartFacts {
            layers: start..end,
            kv,
            kvh: u("n_kv_heads")?,
            head_dim: u("head_dim")?,
        })
    }
}

/// Copies the `old` slots of `src [KVH, old, D]` into `dst [KVH, new, D]`.
fn copy_slots<T: npuc_ir::Elem + Copy>(
    src: &Tensor,
    dst: &mut Tensor,
    old: usize,
    new: usize,
    d: usize,
) -> Result<()> {
    let kvh = src.shape()[0];
    let s = src.as_slice::<T>()?;
    let t = dst.as_mut_slice::<T>()?;
    for g in 0..kvh {
        t[g * new * d..(g * new + old) * d].copy_from_slice(&s[g * old * d..(g + 1) * old * d]);
    }
    Ok(())
}

/// Refuses caches (all parts, at the largest context) larger than the available memory.
fn check_caches_fit(parts: &[PartRun], ctx: usize) -> Result<()> {
    let need: u128 = parts
        .iter()
        .map(|p| {
            [2, p.layers.len(), p.kvh, ctx, p.head_dim, p.kv.size()]
                .iter()
                .fold(1u128, |a, &b| a.saturating_mul(b as u128))
        })
        .sum();
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u128>().ok())
            .map(|kb| kb * 1024)
    });
    if let Some(a) = available {
        if need > a {
            bail!(
                "the KV caches of a {ctx}-slot context need {:.2} GB, but only {:.2} GB of memory is available; use a smaller --ctx",
                need as f64 / 1e9,
                a as f64 / 1e9
            );
        }
    }
    Ok(())
}
