//! The KV-cache engine: one runtime session per graph variant, a host-owned cache per layer,
//! and the current position.
//!
//! Each call feeds the caches (`Arc<Tensor>`, shared with the session for the duration of the
//! run, never copied), then writes the call's `new_key.{l}` / `new_value.{l}` into them in place
//! at the call's positions.

use crate::build::{self, BuildOptions, Precision, Variant, WeightMode};
use crate::{bail, LlmError, Result};
use npuc_gguf::GgufFile;
use npuc_gguf::GgufMetaJson;
use npuc_ir::{f16, DType, Model, Tensor};
use npuc_runtime::{Session, SessionOptions, Value};
use std::path::Path;
use std::sync::Arc;

/// Metadata key (per graph) holding the model facts the engine needs.
pub const META_KEY: &str = "npuc.llm";
/// Metadata key (first graph of an artifact) holding the tokenizer's GGUF metadata as JSON.
pub const TOKENIZER_KEY: &str = "npuc.llm.tokenizer";
/// GGUF key prefixes kept for the tokenizer.
pub const TOKENIZER_PREFIXES: &[&str] = &["tokenizer.", "general.architecture"];

/// How to build or load an [`Engine`].
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Kernel threads.
    pub threads: usize,
    /// Cache slots; default: the model's training context, at most 4096 (GGUF), or the
    /// compiled context (artifacts; a different value is an error).
    pub ctx: Option<usize>,
    /// Variants to build (GGUF) or use (artifact: empty or the default list = all it holds).
    pub variants: Vec<Variant>,
    /// Numerics (GGUF only; an artifact's precision was fixed at compile time).
    pub precision: Precision,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            ctx: None,
            // Prompts in chunks of up to 128 rows: each weight is dequantized once per chunk,
            // so longer chunks amortize it (512 measured slower: its packed activations leave L2).
            variants: vec![Variant::Ar(1), Variant::Ar(32), Variant::Ar(128)],
            precision: Precision::Fast,
        }
    }
}

/// Facts about the model that the host side needs (also stored in artifacts).
#[derive(Clone, Debug, PartialEq)]
struct Shape {
    arch: String,
    ctx: usize,
    n_layers: usize,
    kvh: usize,
    head_dim: usize,
    vocab: usize,
    kv: DType,
}

/// A decoder LLM ready to run token by token or in chunks.
pub struct Engine {
    sessions: Vec<(Variant, usize, Session)>,
    /// `2 * n_layers` caches: key of layer l at `2l`, value at `2l + 1`.
    caches: Vec<Arc<Tensor>>,
    shape: Shape,
    position: usize,
    meta: GgufMetaJson,
    /// Times a cache had to be copied because a reference outlived a run (should stay 0).
    cache_copies: usize,
    /// Weight bytes one decode step reads (every product's weights; one row of each gather).
    decode_weight_bytes: u64,
}

impl Engine {
    /// Builds the variant graphs of a GGUF model in memory (weights stay in the file mapping).
    pub fn from_gguf(path: &Path, opts: &EngineOptions) -> Result<Engine> {
        let g = GgufFile::open(path)?;
        let models = build_variants(&g, opts, WeightMode::Auto)?;
        let meta = GgufMetaJson::filtered(&g.metadata, TOKENIZER_PREFIXES);
        Engine::from_models(models, meta, opts.threads)
    }

    /// Loads the variant graphs of a compiled `.npuc` artifact.
    pub fn from_artifact(path: &Path, opts: &EngineOptions) -> Result<Engine> {
        let art = npuc_format::Artifact::open(path)?;
        let names: Vec<String> = art.graph_names().iter().map(|s| s.to_string()).collect();
        let mut models = vec![];
        let mut meta = None;
        // The default list (or an empty one) means "whatever was compiled".
        let wanted: &[Variant] = if opts.variants == EngineOptions::default().variants {
            &[]
        } else {
            &opts.variants
        };
        for name in &names {
            let Ok(v) = Variant::parse(name) else {
                continue;
            };
            if !wanted.is_empty() && !wanted.contains(&v) {
                continue;
            }
            let m = art.model(Some(name))?;
            if let Some(j) = m.metadata(TOKENIZER_KEY) {
                let j: serde_json::Value = serde_json::from_str(j).map_err(|e| {
                    LlmError::msg(format!(
                        "{}: graph '{name}': bad {TOKENIZER_KEY} JSON: {e}",
                        path.display()
                    ))
                })?;
                meta = Some(GgufMetaJson::from_json(&j)?);
            }
            models.push((v, m));
        }
        for v in wanted {
            if !models.iter().any(|(m, _)| m == v) {
                bail!(
                    "{}: has no graph '{}' (it holds: {})",
                    path.display(),
                    v.name(),
                    names.join(", ")
                );
            }
        }
        if models.is_empty() {
            bail!(
                "{}: holds no LLM variant graphs (ar<N>/full); it holds: {}",
                path.display(),
                names.join(", ")
            );
        }
        let e = Engine::from_models(models, meta.unwrap_or_default(), opts.threads)?;
        if let Some(c) = opts.ctx {
            if c != e.ctx() {
                bail!(
                    "{}: compiled for a context of {}, {c} was asked; recompile with --ctx {c}",
                    path.display(),
                    e.ctx()
                );
            }
        }
        Ok(e)
    }

    /// An engine over already-built variant graphs (all of one model and context).
    pub fn from_models(
        models: Vec<(Variant, Model)>,
        meta: GgufMetaJson,
        threads: usize,
    ) -> Result<Engine> {
        crate::ops::register();
        let mut shape: Option<Shape> = None;
        let mut sessions = vec![];
        let decode_weight_bytes = models
            .iter()
            .map(|(_, m)| weight_bytes_per_step(m))
            .max()
            .unwrap_or(0);
        for (v, m) in models {
            let s = shape_of(&m)?;
            if let Some(prev) = &shape {
                if *prev != s {
                    bail!(
                        "variant {} was built for another model or context ({s:?} vs {prev:?})",
                        v.name()
                    );
                }
            }
            let n = v.tokens(s.ctx);
            shape = Some(s);
            let sess = Session::new(
                &m,
                SessionOptions {
                    threads: threads.max(1),
                },
            )?;
            // The run-time buffer pool would keep each variant's large one-shot buffers (an
            // ar128 call's [128, vocab] logits alone are ~134 MB for Gemma) alive between calls:
            // +730 MB peak RSS in `npuc bench` for nothing, as the KV caches are already reused.
            sess.set_buffer_reuse(false);
            sessions.push((v, n, sess));
        }
        let Some(shape) = shape else {
            bail!("no variants to build (give at least one, e.g. ar1)");
        };
        // Largest first: the variant choice walks this list.
        sessions.sort_by_key(|(_, n, _)| std::cmp::Reverse(*n));
        check_cache_fits(&shape)?;
        let caches = (0..2 * shape.n_layers)
            .map(|_| {
                Arc::new(Tensor::zeros(
                    shape.kv,
                    vec![shape.kvh, shape.ctx, shape.head_dim],
                ))
            })
            .collect();
        Ok(Engine {
            sessions,
            caches,
            shape,
            position: 0,
            meta,
            cache_copies: 0,
            decode_weight_bytes,
        })
    }

    /// Cache slots.
    pub fn ctx(&self) -> usize {
        self.shape.ctx
    }
    /// Weight bytes one decode step reads from memory: all the weights of the matrix products
    /// (the output head included) and one row of each embedding gather. Decode speed cannot
    /// exceed read bandwidth / this.
    pub fn decode_weight_bytes(&self) -> u64 {
        self.decode_weight_bytes
    }
    /// Vocabulary size (length of a logits row).
    pub fn vocab(&self) -> usize {
        self.shape.vocab
    }
    /// Tokens in the cache (the position of the next token).
    pub fn position(&self) -> usize {
        self.position
    }
    /// `general.architecture` of the model.
    pub fn arch(&self) -> &str {
        &self.shape.arch
    }
    /// The variants this engine runs, largest first.
    pub fn variants(&self) -> Vec<Variant> {
        self.sessions.iter().map(|(v, _, _)| *v).collect()
    }
    /// Times a KV cache had to be copied instead of updated in place (0 unless something
    /// kept a reference to a cache past a run).
    pub fn cache_copies(&self) -> usize {
        self.cache_copies
    }
    /// The tokenizer's GGUF metadata.
    pub fn metadata(&self) -> &GgufMetaJson {
        &self.meta
    }

    /// Hands the tokenizer's GGUF metadata over (the engine itself never reads it), so a caller
    /// that builds its tokenizer from it holds one copy, not three (a 262k-token vocabulary is
    /// tens of MB): [`Engine::metadata`] is empty afterwards.
    pub fn take_metadata(&mut self) -> GgufMetaJson {
        std::mem::take(&mut self.meta)
    }
    /// Position 0 (the cache contents become invisible).
    pub fn reset(&mut self) {
        self.position = 0;
    }
    /// Drops cache entries at `pos` and after (chat regeneration); no-op past the position.
    pub fn truncate(&mut self, pos: usize) {
        self.position = self.position.min(pos);
    }

    /// Appends `tokens` at the current position (largest `ar-N` with N <= remaining tokens,
    /// then smaller ones; `full` only for a whole-context `all_logits` call from position 0,
    /// e.g. perplexity) and returns the logits of the last token `[vocab]`, or of every token
    /// (`[tokens.len() * vocab]`) when `all_logits`.
    pub fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            bail!("forward needs at least one token");
        }
        let (ctx, vocab) = (self.ctx(), self.vocab());
        if self.position + tokens.len() > ctx {
            bail!(
                "prompt of {} tokens + {} generated exceeds the context of {ctx}; compile with a larger --ctx",
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
            let idx = self.pick(rest.len(), all_logits)?;
            let n = self.sessions[idx].1;
            let count = n.min(rest.len());
            // Only the last chunk's last row is wanted unless every row is.
            let want = if all_logits {
                Rows::All
            } else if count == rest.len() {
                Rows::Last
            } else {
                Rows::None
            };
            let logits = self.run_chunk(idx, &rest[..count], want)?;
            out.extend_from_slice(&logits);
            rest = &rest[count..];
        }
        Ok(out)
    }

    /// The session for the next chunk of `remaining` tokens.
    fn pick(&self, remaining: usize, all_logits: bool) -> Result<usize> {
        let pos = self.position;
        // `full` (padded) for a whole-sequence scoring call from the start.
        if all_logits && pos == 0 {
            let largest_ar = self
                .sessions
                .iter()
                .filter(|(v, _, _)| matches!(v, Variant::Ar(_)))
                .map(|(_, n, _)| *n)
                .max()
                .unwrap_or(0);
            if remaining > largest_ar {
                if let Some(i) = self
                    .sessions
                    .iter()
                    .position(|(v, _, _)| *v == Variant::Full)
                {
                    return Ok(i);
                }
            }
        }
        let ars = || {
            self.sessions
                .iter()
                .enumerate()
                .filter(|(_, (v, _, _))| matches!(v, Variant::Ar(_)))
        };
        let room = |n: usize| pos + n <= self.ctx();
        let largest = ars()
            .filter(|(_, (_, n, _))| room(*n))
            .max_by_key(|(_, (_, n, _))| *n);
        // The rest in one call when a variant holds it (the smallest such, padded): llama.cpp
        // evaluates a prompt as one batch, and padding rows cost little (the weight products
        // skip them). Longer rests take the largest variant first.
        if let Some((i, _)) = ars()
            .filter(|(_, (_, n, _))| *n >= remaining && room(*n))
            .min_by_key(|(_, (_, n, _))| *n)
        {
            return Ok(i);
        }
        if let Some((i, _)) = largest {
            return Ok(i);
        }
        if let Some(i) = self
            .sessions
            .iter()
            .position(|(v, _, _)| *v == Variant::Full)
        {
            if pos == 0 {
                return Ok(i);
            }
        }
        bail!(
            "no variant can take {remaining} tokens at position {pos} (variants: {}); compile with ar1",
            self.variants().iter().map(|v| v.name()).collect::<Vec<_>>().join(", ")
        )
    }

    /// Runs session `idx` on `toks` (padded to its N), updates the caches and the position,
    /// and returns the logits of the rows `want` asks for (`All`: `[toks.len(), vocab]`,
    /// `Last`: `[vocab]`, `None`: empty; graphs without `logits_from` compute them all anyway).
    fn run_chunk(&mut self, idx: usize, toks: &[u32], want: Rows) -> Result<Vec<f32>> {
        let (ctx, pos) = (self.ctx(), self.position);
        let n = self.sessions[idx].1;
        let count = toks.len();
        // Padding rows take the slots after the real ones; nothing reads them (their mask row
        // shows only their own slot, real rows never see them) and the host does not keep them.
        let positions: Vec<i64> = (0..n).map(|i| (pos + i) as i64).collect();
        if pos + n > ctx {
            bail!(
                "internal: variant of {n} tokens at position {pos} overflows the context of {ctx}"
            );
        }
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
        let mut feeds = vec![
            (
                "input_ids".to_string(),
                Value::tensor(Tensor::from_vec(vec![n], ids)?),
            ),
            (
                "positions".to_string(),
                Value::tensor(Tensor::from_vec(vec![n], positions)?),
            ),
            (
                "attn_mask".to_string(),
                Value::tensor(Tensor::from_vec(vec![n, ctx], mask)?),
            ),
        ];
        // Graphs built since the fast path follows llama.cpp's batching take the count of real
        // (unpadded) tokens; older artifacts do not have the input.
        if self.sessions[idx]
            .2
            .inputs()
            .iter()
            .any(|i| i.name == "token_count")
        {
            feeds.push((
                "token_count".to_string(),
                Value::tensor(Tensor::from_vec(vec![1], vec![count as i64])?),
            ));
        }
        // Graphs whose output head computes only the wanted rows take the first one.
        let from = match want {
            Rows::All => 0,
            Rows::Last => count - 1,
            Rows::None => count,
        };
        if self.sessions[idx]
            .2
            .inputs()
            .iter()
            .any(|i| i.name == "logits_from")
        {
            feeds.push((
                "logits_from".to_string(),
                Value::tensor(Tensor::from_vec(vec![1], vec![from as i64])?),
            ));
        }
        for l in 0..self.shape.n_layers {
            feeds.push((
                format!("past_key.{l}"),
                Value::Tensor(self.caches[2 * l].clone()),
            ));
            feeds.push((
                format!("past_value.{l}"),
                Value::Tensor(self.caches[2 * l + 1].clone()),
            ));
        }
        let outs = self.sessions[idx].2.run(feeds)?;
        let mut logits = None;
        let mut news: Vec<Option<Arc<Tensor>>> = vec![None; 2 * self.shape.n_layers];
        for (name, v) in outs {
            let Value::Tensor(t) = v else {
                bail!("output '{name}' is not a tensor");
            };
            if name == "logits" {
                logits = Some(t);
            } else if let Some((kind, l)) = name.split_once('.') {
                let l: usize = l
                    .parse()
                    .map_err(|_| LlmError::msg(format!("unexpected output '{name}'")))?;
                let slot = match kind {
                    "new_key" => 2 * l,
                    "new_value" => 2 * l + 1,
                    _ => bail!("unexpected output '{name}'"),
                };
                if slot < news.len() {
                    news[slot] = Some(t);
                }
            }
        }
        let (kvh, d) = (self.shape.kvh, self.shape.head_dim);
        for (slot, new) in news.into_iter().enumerate() {
            let Some(new) = new else {
                bail!("the graph did not produce the KV output for cache {slot}");
            };
            if new.shape() != [kvh, n, d] || new.dtype() != self.shape.kv {
                bail!(
                    "KV output {slot} is {:?} {}, expected [{kvh}, {n}, {d}] {}",
                    new.shape(),
                    new.dtype(),
                    self.shape.kv
                );
            }
            let cache = match Arc::get_mut(&mut self.caches[slot]) {
                Some(c) => c,
                None => {
                    self.cache_copies += 1;
                    Arc::make_mut(&mut self.caches[slot])
                }
            };
            match self.shape.kv {
                DType::F16 => write_kv::<f16>(cache, &new, count, pos, ctx)?,
                _ => write_kv::<f32>(cache, &new, count, pos, ctx)?,
            }
        }
        let Some(logits) = logits else {
            bail!("the graph has no 'logits' output");
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

/// Refuses a KV cache larger than the memory the system has available, before allocating it,
/// saying how much it needs.
fn check_cache_fits(s: &Shape) -> Result<()> {
    let need = [2, s.n_layers, s.kvh, s.ctx, s.head_dim, s.kv.size()]
        .iter()
        .try_fold(1u128, |a, &b| a.checked_mul(b as u128));
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u128>().ok())
            .map(|kb| kb * 1024)
    });
    match (need, available) {
        (None, _) => bail!(
            "a KV cache of {} slots ({} layers) is too large to address; lower --ctx",
            s.ctx,
            s.n_layers
        ),
        (Some(n), Some(a)) if n > a => bail!(
            "the KV cache of {} slots needs {:.2} GB ({} layers x K and V x {} KV heads x {} x {} {}), but only {:.2} GB of memory is available; lower --ctx",
            s.ctx,
            n as f64 / 1e9,
            s.n_layers,
            s.kvh,
            s.ctx,
            s.head_dim,
            s.kv,
            a as f64 / 1e9
        ),
        _ => Ok(()),
    }
}

/// Which logits rows a chunk returns.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rows {
    All,
    Last,
    None,
}

/// Weight bytes a step of `m` reads (see [`Engine::decode_weight_bytes`]; also used by
/// [`crate::bundle`]).
pub(crate) fn weight_bytes_per_step(m: &Model) -> u64 {
    let g = &m.graph;
    let size = |name: &str| {
        g.initializers.iter().find(|i| i.name == name).map(|i| {
            let t = &i.tensor;
            let bytes = (t.len() * t.dtype().size()) as u64;
            (bytes, t.shape().first().copied().unwrap_or(1))
        })
    };
    g.nodes
        .iter()
        .map(
            |n| match (n.op_type.as_str(), n.inputs.first(), n.inputs.get(1)) {
                ("GgmlMatMul" | "Gemm" | "MatMul", _, Some(w)) => size(w).map_or(0, |(b, _)| b),
                ("GgmlGather" | "Gather", Some(w), _) => {
                    size(w).map_or(0, |(b, rows)| b / rows.max(1) as u64)
                }
                _ => 0,
            },
        )
        .sum()
}

/// Writes rows `0..count` of `new [KVH, N, D]` into `cache [KVH, C, D]` at slots `pos..`
/// (also used by [`crate::bundle`]).
pub(crate) fn write_kv<T: npuc_ir::Elem + Copy>(
    cache: &mut Tensor,
    new: &Tensor,
    count: usize,
    pos: usize,
    ctx: usize,
) -> Result<()> {
    let (kvh, n, d) = (new.shape()[0], new.shape()[1], new.shape()[2]);
    let src = new.as_slice::<T>()?;
    let dst = cache.as_mut_slice::<T>()?;
    for g in 0..kvh {
        let s = &src[g * n * d..(g * n + count) * d];
        dst[(g * ctx + pos) * d..(g * ctx + pos + count) * d].copy_from_slice(s);
    }
    Ok(())
}

/// Reads the `npuc.llm` facts of a variant graph.
fn shape_of(m: &Model) -> Result<Shape> {
    let Some(j) = m.metadata(META_KEY) else {
        bail!(
            "graph '{}' has no {META_KEY} metadata (not built by npuc-llm)",
            m.graph.name
        );
    };
    let j: serde_json::Value = serde_json::from_str(j)
        .map_err(|e| LlmError::msg(format!("bad {META_KEY} metadata: {e}")))?;
    let u = |k: &str| -> Result<usize> {
        j.get(k)
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| LlmError::msg(format!("{META_KEY} metadata lacks '{k}'")))
    };
    let kv = match j.get("kv_dtype").and_then(|v| v.as_str()) {
        Some("float16") | Some("f16") => DType::F16,
        Some("float32") | Some("f32") | Some("float") => DType::F32,
        other => bail!("{META_KEY}: unsupported kv_dtype {other:?}"),
    };
    Ok(Shape {
        arch: j
            .get("arch")
            .and_then(|v| v.as_str())
            .unwrap_or("?")
            .to_string(),
        ctx: u("ctx")?,
        n_layers: u("n_layers")?,
        kvh: u("n_kv_heads")?,
        head_dim: u("head_dim")?,
        vocab: u("vocab")?,
        kv,
    })
}

/// Builds one graph per requested variant (deduplicated), with the options' context/precision.
pub fn build_variants(
    g: &GgufFile,
    opts: &EngineOptions,
    weights: WeightMode,
) -> Result<Vec<(Variant, Model)>> {
    let hp = build::hparams(g)?;
    let ctx = opts.ctx.unwrap_or(hp.ctx_train.min(4096));
    let mut vs = opts.variants.clone();
    vs.dedup();
    if vs.is_empty() {
        bail!("no variants to build (give at least one, e.g. ar1)");
    }
    let mut out = vec![];
    // The variants share one repacked copy of each weight.
    let repacked = build::RepackCache::default();
    for v in vs {
        if out.iter().any(|(o, _)| *o == v) {
            continue;
        }
        let tokens = v.tokens(ctx);
        if tokens > ctx {
            bail!(
                "variant {} needs {tokens} tokens per call, more than the context of {ctx}",
                v.name()
            );
        }
        let m = build::build_with(
            g,
            &hp,
            &BuildOptions {
                tokens,
                ctx,
                precision: opts.precision,
                weights,
                repacked: repacked.clone(),
            },
        )?;
        out.push((v, m));
    }
    Ok(out)
}
