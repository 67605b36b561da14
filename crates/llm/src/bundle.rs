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
use crate::engine::{weight_bytes_per_step, TOKENIZER_KEY};
use crate::kv::{
    self, check_fits, input_ids, kv_slots, logit_rows, outputs_by_name, Chunked, KvCaches, KvSlot,
    StepInputs,
};
use crate::{bail, GgufMetaJson, LlmError, Result};
use npuc_ir::DType;
use npuc_runtime::{Session, SessionOptions, Value};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

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
    /// Single-head attention graphs: KV caches per KV head (`past_key.{l}.h{g}` `[1, C, D]`)
    /// instead of per layer (`past_key.{l}` `[KVH, C, D]`).
    #[serde(default)]
    pub sha: bool,
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
    /// The ONNX decoder the GGUF was imported from (`[model] onnx = ...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imported_from: Option<String>,
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
    sessions: BTreeMap<(usize, usize), Session>,
    /// The caches of its layers at the current context (per layer, or per KV head of single-head
    /// graphs).
    caches: KvCaches,
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
            // Part 1 of several may be an embedder (no layers; `split.embedder`).
            let embedder = i == 0 && count > 1 && layers.is_empty();
            if layers.start != expect_start || (layers.is_empty() && !embedder) {
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
            let mut slots: Option<Vec<KvSlot>> = None;
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
                    // An embedder has no attention either way.
                    if !embedder && crate::build::sha::is_sha(&m) != manifest.sha {
                        bail!(
                            "{}: graph {name} has {} attention, the manifest says sha = {}",
                            path.display(),
                            if manifest.sha {
                                "multi-head"
                            } else {
                                "single-head"
                            },
                            manifest.sha
                        );
                    }
                    let sl = kv_slots(&m.graph.inputs, &layers).map_err(|e| {
                        LlmError::msg(format!("{}: graph {name}: {e}", path.display()))
                    })?;
                    if slots.as_ref().is_some_and(|s| *s != sl) {
                        bail!(
                            "{}: graph {name} has other KV cache inputs than the part's other graphs",
                            path.display()
                        );
                    }
                    slots = Some(sl);
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
            let (Some(f), Some(slots)) = (facts, slots) else {
                bail!("{}: no graphs selected", path.display());
            };
            decode_weight_bytes += part_step_bytes;
            parts.push(PartRun {
                layers,
                first: i == 0,
                last: i + 1 == count,
                sessions,
                caches: KvCaches::new(slots, f.kv, f.head_dim, ctxs[0]),
            });
        }
        if expect_start != manifest.n_layers {
            bail!(
                "{}: the parts end at layer {expect_start}, the model has {} layers",
                dir.join(MANIFEST).display(),
                manifest.n_layers
            );
        }
        let max_ctx = *ctxs.last().expect("non-empty");
        let need = parts.iter().try_fold(0u128, |acc, p| {
            KvCaches::bytes_at(&p.caches.slots, p.caches.kv, p.caches.head_dim, max_ctx)
                .and_then(|b| acc.checked_add(b))
        });
        check_fits(
            need,
            &format!("the KV caches of a {max_ctx}-slot context"),
            "use a smaller --ctx",
        )?;
        let mut b = Bundle {
            dir: dir.to_path_buf(),
            manifest,
            parts,
            ctxs,
            ars,
            cur_ctx: 0,
            position: 0,
            meta: meta.unwrap_or_default(),
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
        self.parts.iter().map(|p| p.caches.copies).sum()
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
            p.caches.reset_to(c);
        }
        self.cur_ctx = ctx_idx;
    }

    /// Appends `tokens` and returns the last token's logits `[vocab]`, or every token's when
    /// `all_logits` (the [`crate::Engine::forward`] contract).
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        kv::forward(self, tokens, all_logits)
    }
}

impl Chunked for Bundle {
    fn ctx(&self) -> usize {
        Bundle::ctx(self)
    }
    fn vocab(&self) -> usize {
        self.manifest.vocab
    }
    fn position(&self) -> usize {
        self.position
    }
    fn ctx_advice(&self) -> &'static str {
        "add a larger ctx to the pipeline"
    }

    /// Tokens per call for the next chunk of `remaining` tokens: the smallest variant that
    /// holds them all, else the largest that fits the context (the Engine's choice, so a
    /// bundle batches a prompt as the unsplit model does).
    fn pick(&self, remaining: usize, _all_logits: bool) -> Result<(usize, usize)> {
        let room = |n: usize| self.position + n <= Bundle::ctx(self);
        if let Some(&n) = self
            .ars
            .iter()
            .filter(|&&n| n >= remaining && room(n))
            .min()
        {
            return Ok((n, n));
        }
        if let Some(&n) = self.ars.iter().filter(|&&n| room(n)).max() {
            return Ok((n, n));
        }
        bail!(
            "no AR variant can take {remaining} tokens at position {} of {} (variants: {:?}); add ar1 to the pipeline",
            self.position,
            Bundle::ctx(self),
            self.ars
        )
    }

    /// Runs the parts over one chunk of `toks` padded to `n`, updates the caches and the
    /// position, and returns the logits of rows `from..toks.len()`.
    fn run_chunk(&mut self, n: usize, toks: &[u32], from: usize) -> Result<Vec<f32>> {
        self.run_chunk_from(n, ChunkInput::Ids(toks), from)
    }
}

/// What a chunk starts from.
enum ChunkInput<'a> {
    /// Token ids, looked up by the first part.
    Ids(&'a [u32]),
    /// Embeddings `[count, n_embd]` for the first decoder part (the embedder is skipped).
    Embeddings(&'a [f32]),
}

impl Bundle {
    /// Whether part 1 is an embedder (token embedding only; `split.embedder`): the decoder
    /// parts then take embeddings, and [`Bundle::forward_embeddings`] can feed others.
    pub fn has_embedder(&self) -> bool {
        self.parts.len() > 1 && self.parts[0].layers.is_empty()
    }

    /// The embedder's output for `tokens`: `[tokens.len(), n_embd]` (what the decoder parts
    /// take; [`Bundle::forward_embeddings`] of these rows equals [`Bundle::forward`] of the
    /// tokens). Leaves the position and caches alone.
    pub fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if !self.has_embedder() {
            bail!("this bundle has no embedder part (build it with split.embedder = true)");
        }
        let vocab = self.manifest.vocab;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {t} is outside the vocabulary of {vocab}");
        }
        let ctx = self.ctxs[self.cur_ctx];
        let e = self.manifest.n_embd;
        let mut out = Vec::with_capacity(tokens.len() * e);
        for chunk in tokens.chunks(self.ars[0].min(ctx)) {
            let count = chunk.len();
            // The smallest variant that holds the chunk (the embedder reads no position).
            let n = *self
                .ars
                .iter()
                .filter(|&&n| n >= count)
                .min()
                .unwrap_or(&self.ars[0]);
            let step = StepInputs::new(0, n, count, ctx, count)?;
            let part = &self.parts[0];
            let sess = &part.sessions[&(n, ctx)];
            let feeds = step.feeds(sess.inputs(), ("input_ids", input_ids(chunk, n)?));
            let mut outs = outputs_by_name(sess.run(feeds)?)?;
            let Some(h) = outs.remove(HIDDEN_OUT) else {
                bail!("the embedder has no '{HIDDEN_OUT}' output");
            };
            out.extend_from_slice(&h.as_slice::<f32>()?[..count * e]);
        }
        Ok(out)
    }

    /// Appends embeddings `rows` (`[count, n_embd]` f32, e.g. another component's output, or
    /// [`Bundle::embed`]'s) at the current position, and returns the last row's logits
    /// `[vocab]`, or every row's when `all_logits`. Needs an embedder part.
    pub fn forward_embeddings(&mut self, rows: &[f32], all_logits: bool) -> Result<Vec<f32>> {
        if !self.has_embedder() {
            bail!("this bundle has no embedder part, so its first part takes token ids, not embeddings (build it with split.embedder = true)");
        }
        let e = self.manifest.n_embd;
        if rows.is_empty() || !rows.len().is_multiple_of(e) {
            bail!(
                "embeddings of {} values are not whole rows of n_embd = {e}",
                rows.len()
            );
        }
        let total = rows.len() / e;
        if self.position + total > Bundle::ctx(self) {
            bail!(
                "{total} embeddings + {} earlier positions exceed the context of {}",
                self.position,
                Bundle::ctx(self)
            );
        }
        let vocab = self.manifest.vocab;
        let mut out = Vec::with_capacity(if all_logits { total * vocab } else { vocab });
        let mut done = 0;
        while done < total {
            let rest = total - done;
            let (n, _) = Chunked::pick(self, rest, all_logits)?;
            let count = n.min(rest);
            let from = if all_logits {
                0
            } else if count == rest {
                count - 1
            } else {
                count
            };
            let chunk = &rows[done * e..(done + count) * e];
            out.extend_from_slice(&self.run_chunk_from(n, ChunkInput::Embeddings(chunk), from)?);
            done += count;
        }
        Ok(out)
    }

    /// Runs the parts over one chunk (token ids, or embeddings past the embedder) padded to
    /// `n`, updates the caches and the position, and returns the logits of rows
    /// `from..count`.
    fn run_chunk_from(&mut self, n: usize, input: ChunkInput, from: usize) -> Result<Vec<f32>> {
        let pos = self.position;
        let count = match input {
            ChunkInput::Ids(t) => t.len(),
            ChunkInput::Embeddings(r) => r.len() / self.manifest.n_embd,
        };
        // The smallest context that holds this (padded) chunk, never smaller than the caches'.
        let ci = (self.cur_ctx..self.ctxs.len())
            .find(|&i| pos + n <= self.ctxs[i])
            .ok_or_else(|| {
                LlmError::msg(format!(
                    "internal: ar{n} at position {pos} overflows the context of {}",
                    Bundle::ctx(self)
                ))
            })?;
        if ci != self.cur_ctx {
            let c = self.ctxs[ci];
            for p in &mut self.parts {
                p.caches.grow(c)?;
            }
            self.cur_ctx = ci;
        }
        let ctx = self.ctxs[ci];
        // Inputs shared by every part (the Engine's padding and mask conventions).
        let step = StepInputs::new(pos, n, count, ctx, from)?;
        let e = self.manifest.n_embd;
        let (mut carry, skip) = match input {
            ChunkInput::Ids(toks) => (input_ids(toks, n)?, 0),
            ChunkInput::Embeddings(rows) => {
                let mut padded = rows.to_vec();
                padded.resize(n * e, 0.0);
                (
                    Value::tensor(npuc_ir::Tensor::from_vec(vec![n, e], padded)?),
                    1,
                )
            }
        };
        let mut logits = None;
        for (pi, part) in self.parts.iter_mut().enumerate().skip(skip) {
            let sess = &part.sessions[&(n, ctx)];
            let first_input = if part.first { "input_ids" } else { HIDDEN_IN };
            let mut feeds = step.feeds(sess.inputs(), (first_input, carry.clone()));
            part.caches.feed(&mut feeds);
            let what = || {
                format!(
                    "part {} (layers {}..{}), ar{n} ctx {ctx}",
                    pi + 1,
                    part.layers.start,
                    part.layers.end
                )
            };
            let outs = sess
                .run(feeds)
                .map_err(|e| LlmError::msg(format!("{}: {e}", what())))?;
            let mut outs = outputs_by_name(outs)?;
            part.caches
                .store(&mut outs, n, count, pos)
                .map_err(|e| LlmError::msg(format!("{}: {e}", what())))?;
            if part.last {
                logits = outs.remove("logits");
            } else {
                let Some(h) = outs.remove(HIDDEN_OUT) else {
                    bail!("part {}: the graph has no '{HIDDEN_OUT}' output", pi + 1);
                };
                carry = Value::Tensor(h);
            }
        }
        let Some(logits) = logits else {
            bail!("the last part has no 'logits' output");
        };
        self.position += count;
        logit_rows(&logits, from, count, self.manifest.vocab)
    }
}

/// What a part graph's `npuc.llm` metadata says about it.
struct PartFacts {
    layers: Range<usize>,
    kv: DType,
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
            head_dim: u("head_dim")?,
        })
    }
}
