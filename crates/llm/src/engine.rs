//! The KV-cache engine: one runtime session per graph variant, a host-owned cache per layer,
//! and the current position.
//!
//! Each call feeds the caches (`Arc<Tensor>`, shared with the session for the duration of the
//! run, never copied), then writes the call's `new_key.{l}` / `new_value.{l}` into them in place
//! at the call's positions.

use crate::build::{
    self, BuildOptions, InputMoment, Precision, Variant, WeightMode, WeightQuant,
    WeightQuantOptions, WeightRounding,
};
use crate::kv::{
    self, check_fits, input_ids, kv_slots, logit_rows, outputs_by_name, Chunked, KvCaches,
    StepInputs,
};
use crate::{bail, LlmError, Result};
use npuc_gguf::GgufFile;
use npuc_gguf::GgufMetaJson;
use npuc_ir::{DType, Model, Tensor};
use npuc_runtime::ops::matmul::{gemm_into, Mat};
use npuc_runtime::{Session, SessionOptions};
use std::collections::HashMap;
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
    /// Re-quantization of the linear layers' weights (GGUF only).
    pub weight_quant: WeightQuantOptions,
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
            weight_quant: WeightQuantOptions::default(),
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
    /// Shared by the engines [`Engine::fork`] makes: a session runs concurrently from several
    /// threads, and its weights (the mapping, repacked x8 copies) exist once.
    sessions: Arc<Vec<(Variant, usize, Session)>>,
    /// The caches every variant reads (`past_key.{l}`... or, single-head graphs, per head).
    caches: KvCaches,
    shape: Shape,
    position: usize,
    meta: GgufMetaJson,
    /// Weight bytes one decode step reads (every product's weights; one row of each gather).
    decode_weight_bytes: u64,
    /// Statistics of the linear layers' inputs (calibration engines only).
    observer: Option<LinearInputObserver>,
}

impl Engine {
    /// Builds the variant graphs of a GGUF model in memory (weights stay in the file mapping).
    pub fn from_gguf(path: &Path, opts: &EngineOptions) -> Result<Engine> {
        let g = GgufFile::open(path)?;
        let wq = &opts.weight_quant;
        let calibrated;
        let opts = if wq.scheme != WeightQuant::Gguf
            && !wq.calib_tokens.is_empty()
            && wq.importance.is_none()
        {
            let mut o = opts.clone();
            let stats = linear_input_stats(&g, opts)?;
            o.weight_quant.importance = Some(Arc::new(stats.importance));
            o.weight_quant.act_absmax = Some(Arc::new(stats.absmax));
            if o.weight_quant.rounding == WeightRounding::Gptq {
                o.weight_quant.second_moments = Some(Arc::new(stats.second_moments));
            }
            calibrated = o;
            &calibrated
        } else {
            opts
        };
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
            // Every graph carries the tokenizer's metadata; one copy is parsed (the vocabulary
            // is hundreds of thousands of entries).
            if let Some(j) = m.metadata(TOKENIZER_KEY).filter(|_| meta.is_none()) {
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
        let mut slots = None;
        let mut sessions = vec![];
        let decode_weight_bytes = models
            .iter()
            .map(|(_, m)| weight_bytes_per_step(m))
            .max()
            .unwrap_or(0);
        for (v, m) in models {
            let s = shape_of(&m)?;
            let sl = kv_slots(&m.graph.inputs, &(0..s.n_layers))
                .map_err(|e| LlmError::msg(format!("variant {}: {e}", v.name())))?;
            if let (Some(prev), Some(prev_slots)) = (&shape, &slots) {
                if *prev != s || *prev_slots != sl {
                    bail!(
                        "variant {} was built for another model, context or cache layout ({s:?} vs {prev:?})",
                        v.name()
                    );
                }
            }
            let n = v.tokens(s.ctx);
            shape = Some(s);
            slots = Some(sl);
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
        let (Some(shape), Some(slots)) = (shape, slots) else {
            bail!("no variants to build (give at least one, e.g. ar1)");
        };
        // Largest first: the variant choice walks this list.
        sessions.sort_by_key(|(_, n, _)| std::cmp::Reverse(*n));
        check_fits(
            KvCaches::bytes_at(&slots, shape.kv, shape.head_dim, shape.ctx),
            &format!(
                "the KV cache of {} slots ({} layers x K and V x {} KV heads x {} x {} {})",
                shape.ctx, shape.n_layers, shape.kvh, shape.ctx, shape.head_dim, shape.kv
            ),
            "lower --ctx",
        )?;
        let caches = KvCaches::new(slots, shape.kv, shape.head_dim, shape.ctx);
        Ok(Engine {
            sessions: Arc::new(sessions),
            caches,
            shape,
            position: 0,
            meta,
            decode_weight_bytes,
            observer: None,
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
        self.caches.copies
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
    /// Another engine over the same variant graphs and weights (nothing is copied or rebuilt)
    /// with its own empty KV cache at position 0, e.g. one per concurrent request of a server.
    /// The tokenizer metadata is not carried over.
    pub fn fork(&self) -> Engine {
        Engine {
            sessions: self.sessions.clone(),
            caches: KvCaches::new(
                self.caches.slots.clone(),
                self.caches.kv,
                self.shape.head_dim,
                self.shape.ctx,
            ),
            shape: self.shape.clone(),
            position: 0,
            meta: GgufMetaJson::default(),
            decode_weight_bytes: self.decode_weight_bytes,
            observer: None,
        }
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
        kv::forward(self, tokens, all_logits)
    }
}

impl Chunked for Engine {
    fn ctx(&self) -> usize {
        self.shape.ctx
    }
    fn vocab(&self) -> usize {
        self.shape.vocab
    }
    fn position(&self) -> usize {
        self.position
    }
    fn ctx_advice(&self) -> &'static str {
        "compile with a larger --ctx"
    }

    /// The session for the next chunk of `remaining` tokens.
    fn pick(&self, remaining: usize, all_logits: bool) -> Result<(usize, usize)> {
        let i = self.pick_index(remaining, all_logits)?;
        Ok((i, self.sessions[i].1))
    }

    /// Runs session `idx` on `toks` (padded to its N), updates the caches and the position,
    /// and returns the logits of rows `from..toks.len()` (graphs without `logits_from` compute
    /// them all anyway).
    fn run_chunk(&mut self, idx: usize, toks: &[u32], from: usize) -> Result<Vec<f32>> {
        let (ctx, pos) = (self.shape.ctx, self.position);
        let (n, count) = (self.sessions[idx].1, toks.len());
        let step = StepInputs::new(pos, n, count, ctx, from)?;
        let sess = &self.sessions[idx].2;
        let mut feeds = step.feeds(sess.inputs(), ("input_ids", input_ids(toks, n)?));
        self.caches.feed(&mut feeds);
        let mut outs = outputs_by_name(sess.run(feeds)?)?;
        self.caches.store(&mut outs, n, count, pos)?;
        if let Some(obs) = &mut self.observer {
            // The first token of a sequence is an attention sink: its hidden state carries
            // activations orders of magnitude above every other position in a few channels,
            // which would dominate each channel's mean square; its row is left out.
            obs.add(&outs, usize::from(pos == 0), count)?;
        }
        let Some(logits) = outs.remove("logits") else {
            bail!("the graph has no 'logits' output");
        };
        self.position += count;
        logit_rows(&logits, from, count, self.shape.vocab)
    }
}

impl Engine {
    /// The session for the next chunk of `remaining` tokens.
    fn pick_index(&self, remaining: usize, all_logits: bool) -> Result<usize> {
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
        let room = |n: usize| pos + n <= self.shape.ctx;
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
                weight_quant: opts.weight_quant.clone(),
                repacked: repacked.clone(),
            },
        )?;
        out.push((v, m));
    }
    Ok(out)
}

/// Per-channel sums of squares of every linear layer's input over the real rows of each call.
struct LinearInputObserver {
    /// Weight name -> input value name.
    inputs: Vec<(String, String)>,
    /// Input value name -> (sum of squares per channel, rows seen, absolute maximum).
    sums: HashMap<String, (Vec<f64>, usize, f32)>,
    /// Input value name -> second moment `sum x x^T` over every row (sink included: its
    /// keys and values are read by every later position, so its products' error counts),
    /// when GPTQ rounding asks for it ([`WeightRounding::Gptq`]).
    second_moments: Option<HashMap<String, Vec<f32>>>,
    threads: usize,
}

impl LinearInputObserver {
    /// Adds every observed input's rows `..rows` to its range, rows `skip..rows` to its mean square.
    fn add(&mut self, outs: &HashMap<String, Arc<Tensor>>, skip: usize, rows: usize) -> Result<()> {
        // Weights that read one input (q/k/v, gate/up) share its statistics: each input once.
        let mut seen = std::collections::HashSet::new();
        for (_, x) in &self.inputs {
            if !seen.insert(x.as_str()) {
                continue;
            }
            let Some(t) = outs.get(x) else {
                bail!("calibration graph lacks the linear input '{x}' among its outputs");
            };
            let k = *t.shape().last().unwrap_or(&0);
            let v = t.as_slice::<f32>()?;
            if k == 0 || v.len() < rows * k {
                bail!(
                    "linear input '{x}' has {} values, expected {rows} rows",
                    v.len()
                );
            }
            let (sum, n, absmax) = self
                .sums
                .entry(x.clone())
                .or_insert_with(|| (vec![0f64; k], 0, 0.0));
            // The range covers every row (a static activation scale must hold the sink too).
            *absmax = v[..rows * k].iter().fold(*absmax, |m, a| m.max(a.abs()));
            for row in v[skip.min(rows) * k..rows * k].chunks_exact(k) {
                for (s, &a) in sum.iter_mut().zip(row) {
                    *s += (a as f64) * (a as f64);
                }
            }
            *n += rows - skip.min(rows);
            if let Some(moments) = &mut self.second_moments {
                let h = moments
                    .entry(x.clone())
                    .or_insert_with(|| vec![0f32; k * k]);
                // h += X^T X over all the chunk's rows (X: rows x k, row-major).
                gemm_into::<f32>(
                    k,
                    k,
                    rows,
                    1.0,
                    Mat::cols(&v[..rows * k], k),
                    Mat::rows(&v[..rows * k], k),
                    Some(1.0),
                    h,
                    k,
                    self.threads,
                )
                .map_err(|e| LlmError::msg(format!("second moment of '{x}': {e}")))?;
            }
        }
        Ok(())
    }
}

/// Context of the calibration run's chunks.
const CALIB_CTX: usize = 512;

/// Statistics of every linear weight's input over the calibration run, by weight name.
struct LinearInputStats {
    /// Per-channel RMS (the importance its re-quantization weighs the error with).
    importance: HashMap<String, Vec<f32>>,
    /// Absolute maximum.
    absmax: HashMap<String, f32>,
    /// GPTQ's statistics, shared by the weights reading one input; only for GPTQ rounding.
    second_moments: HashMap<String, Arc<InputMoment>>,
}

/// Runs the model unquantized (exact precision) over `opts.weight_quant.calib_tokens`, in
/// chunks of [`CALIB_CTX`] tokens each from an empty cache, and returns the statistics of each
/// linear layer's input.
fn linear_input_stats(g: &GgufFile, opts: &EngineOptions) -> Result<LinearInputStats> {
    let hp = build::hparams(g)?;
    let ctx = CALIB_CTX.min(hp.ctx_train.max(1));
    let copts = EngineOptions {
        threads: opts.threads,
        ctx: Some(ctx),
        variants: vec![Variant::Ar(ctx.min(128))],
        precision: Precision::Exact,
        weight_quant: WeightQuantOptions {
            observe: true,
            ..Default::default()
        },
    };
    let models = build_variants(g, &copts, WeightMode::Auto)?;
    let facts: serde_json::Value = models
        .first()
        .and_then(|(_, m)| m.metadata(META_KEY))
        .and_then(|j| serde_json::from_str(j).ok())
        .unwrap_or_default();
    let inputs: Vec<(String, String)> = facts
        .get("linear_inputs")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.iter()
                .filter_map(|(w, x)| Some((w.clone(), x.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    if inputs.is_empty() {
        bail!("the calibration graph records no linear inputs");
    }
    let mut e = Engine::from_models(models, GgufMetaJson::default(), opts.threads)?;
    let gptq = opts.weight_quant.rounding == WeightRounding::Gptq;
    e.observer = Some(LinearInputObserver {
        inputs: inputs.clone(),
        sums: HashMap::new(),
        second_moments: gptq.then(HashMap::new),
        threads: opts.threads,
    });
    for chunk in opts.weight_quant.calib_tokens.chunks(ctx) {
        e.reset();
        e.forward(chunk, false)?;
    }
    let mut obs = e.observer.take().expect("set above");
    let (mut importance, mut absmax) = (HashMap::new(), HashMap::new());
    let mut second_moments = HashMap::new();
    let shared: HashMap<String, Arc<InputMoment>> = obs
        .second_moments
        .take()
        .unwrap_or_default()
        .into_iter()
        .map(|(x, h)| (x, Arc::new(InputMoment { h })))
        .collect();
    for (w, x) in inputs {
        let Some((sum, n, amax)) = obs.sums.get(&x) else {
            continue;
        };
        let n = (*n).max(1) as f64;
        // The root of the mean square (the channel's RMS), not the mean square itself: the
        // latter is the diagonal of the layer's output-error form, but on SmolLM2 and Qwen2.5
        // (exact-precision perplexity, lpbq4) the RMS weighted search scored better (SmolLM2
        // 20.44 vs 22.72, Qwen 7.28 vs 7.56 at ctx 256 x 2 chunks): a few outlier channels'
        // mean squares swamp every other weight of their blocks.
        importance.insert(
            w.clone(),
            sum.iter().map(|s| (s / n).sqrt() as f32).collect(),
        );
        if let Some(h) = shared.get(&x) {
            second_moments.insert(w.clone(), h.clone());
        }
        absmax.insert(w, *amax);
    }
    Ok(LinearInputStats {
        importance,
        absmax,
        second_moments,
    })
}
