//! GGUF → IR: hyper-parameters (per architecture: [`llama`], [`qwen2`], [`gemma3`]) and the
//! shared decoder-graph builder.
//!
//! One graph per variant: N new tokens per call over a cache of C slots. Weights keep their
//! GGUF tensor names as initializer names in every variant, so an artifact stores them once and
//! in-memory engines share the same (zero-copy, mmap-backed) tensors. In `fast` precision the
//! products' weights of the 32-value block types are repacked into the interleaved eight-row
//! layout of the decode kernels (`{name}.x8`, made once per [`RepackCache`] and shared by the
//! variants; read from the file, not the mapping, so the plain bytes never become resident).

pub mod encodings;
pub mod gemma3;
pub mod llama;
pub mod qwen2;
pub mod sha;
pub mod split;

use crate::{bail, ops, LlmError, Result};
pub use encodings::{ActEncoding, LlmEncodings, WeightEncoding};
use npuc_gguf::{GgufFile, TensorInfo};
use npuc_ir::opdef::NodeBuilder;
use npuc_ir::{
    Attr, DType, GgmlType, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo,
    ValueInfo,
};

/// Architectures with a builder.
pub const SUPPORTED: &[&str] = &["llama", "qwen2", "gemma3"];

/// Numerics of a build.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// The default, built for speed: products of 16+ rows (prompts) in f32 over weights
    /// dequantized panel by panel, fewer rows (token steps) with activations quantized to 8 bits
    /// and integer dot products (one-row and multi-row kernels), f16 KV cache, attention in f32
    /// (two GEMMs per KV head for prompts, vector kernels for token steps). Free to round differently from llama.cpp;
    /// its quality is measured (perplexity and top-1 agreement against llama.cpp).
    #[default]
    Fast,
    /// llama.cpp's AVX2 CPU numerics op by op (a test instrument: logits bit-identical to
    /// llama.cpp's): its batch grouping of K-quant products, its flash attention's f16 value
    /// accumulator, its rope recurrence and GELU table.
    Parity,
    /// f32 everywhere: dequantized weights times f32 activations, f32 KV cache.
    Exact,
}

impl Precision {
    /// Parses `fast` / `parity` / `exact`.
    pub fn parse(s: &str) -> Result<Precision> {
        match s {
            "fast" => Ok(Precision::Fast),
            "parity" => Ok(Precision::Parity),
            "exact" => Ok(Precision::Exact),
            _ => bail!("unknown precision '{s}' (expected fast, parity or exact)"),
        }
    }
    /// The KV cache element type.
    pub fn kv_dtype(self) -> DType {
        match self {
            Precision::Fast | Precision::Parity => DType::F16,
            Precision::Exact => DType::F32,
        }
    }
    /// `fast` / `parity` / `exact`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fast => "fast",
            Precision::Parity => "parity",
            Precision::Exact => "exact",
        }
    }
    /// Whether quantized products quantize their activations (fast and parity).
    pub fn act_quant(self) -> bool {
        self != Precision::Exact
    }
}

/// Weight re-quantization of the linear layers (attention and FFN projections, the output
/// head) at build time, from the GGUF's weights dequantized to f32: what an NPU toolchain
/// deploys (QAIRT's LLM default is LPBQ int4), measured on CPU. The quantized weights enter
/// the graph dequantized (f32 `[N, K]`, the exact values `q * scale`), so a build in `exact`
/// precision isolates the quantization's effect (perplexity against the same model unquantized).
/// Embedding lookups keep the GGUF's own blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightQuant {
    /// The GGUF's own blocks (no re-quantization).
    #[default]
    Gguf,
    /// LPBQ ([`npuc_quant::lpbq`]): `bits`-bit blocks of `block` input channels, 4-bit block
    /// scales over a per-channel float scale.
    Lpbq { bits: u8, block: usize },
    /// Symmetric `bits`-bit, one scale per output channel (absmax / qmax).
    PerChannel { bits: u8 },
}

impl WeightQuant {
    /// Parses `gguf`, `lpbq4[:BLOCK]` (default block 64), `lpbq8[:BLOCK]`, `int8`, `int4`.
    pub fn parse(s: &str) -> Result<WeightQuant> {
        let bad = || {
            LlmError::msg(format!(
                "unknown weight quantization '{s}' (expected gguf, lpbq4[:BLOCK], lpbq8[:BLOCK], int8 or int4)"
            ))
        };
        let (head, block) = match s.split_once(':') {
            Some((h, b)) => (h, Some(b.parse::<usize>().map_err(|_| bad())?)),
            None => (s, None),
        };
        let q = match head {
            "gguf" => WeightQuant::Gguf,
            "lpbq4" | "lpbq8" => WeightQuant::Lpbq {
                bits: if head == "lpbq4" { 4 } else { 8 },
                block: block.unwrap_or(64),
            },
            "int8" => WeightQuant::PerChannel { bits: 8 },
            "int4" => WeightQuant::PerChannel { bits: 4 },
            _ => return Err(bad()),
        };
        if block.is_some() && !matches!(q, WeightQuant::Lpbq { .. }) || block == Some(0) {
            return Err(bad());
        }
        Ok(q)
    }

    /// The name [`WeightQuant::parse`] reads back.
    pub fn name(self) -> String {
        match self {
            WeightQuant::Gguf => "gguf".into(),
            WeightQuant::Lpbq { bits, block } => format!("lpbq{bits}:{block}"),
            WeightQuant::PerChannel { bits } => format!("int{bits}"),
        }
    }

    /// `w` (`rows x cols`, one row per output channel) quantized: its grid and the values
    /// dequantized. `importance`: per input channel weights of the error (see
    /// [`WeightQuantOptions`]). `Gguf` has no grid and is refused.
    pub fn quantize(
        self,
        w: &[f32],
        rows: usize,
        cols: usize,
        importance: Option<&[f32]>,
    ) -> Result<(Vec<f32>, WeightEncoding)> {
        let enc = match self {
            WeightQuant::Gguf => bail!("the GGUF's own blocks have no re-quantization grid"),
            WeightQuant::Lpbq { bits, block } => {
                let q =
                    npuc_quant::lpbq::quantize_weighted(w, rows, cols, block, bits, 4, importance)
                        .map_err(|e| LlmError::msg(e.to_string()))?;
                let values = q.dequantize();
                return Ok((
                    values,
                    WeightEncoding::Lpbq {
                        bw: bits,
                        block,
                        compressed_bw: q.compressed_bw,
                        int_scales: q.int_scales,
                        channel_scales: q.channel_scales,
                    },
                ));
            }
            // absmax / qmax per row, round to nearest (the importance has no choice to make).
            WeightQuant::PerChannel { bits } => {
                let qmax = ((1i32 << (bits - 1)) - 1) as f32;
                WeightEncoding::PerChannel {
                    bw: bits,
                    scales: w
                        .chunks_exact(cols)
                        .map(|row| {
                            let s = row.iter().fold(0f32, |m, x| m.max(x.abs())) / qmax;
                            if s > 0.0 {
                                s
                            } else {
                                1.0
                            }
                        })
                        .collect(),
                }
            }
        };
        let values = enc.fake_quantize(w, rows, cols)?;
        Ok((values, enc))
    }
}

/// How re-quantized weights are rounded onto their grid.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightRounding {
    /// Each value to its nearest grid point.
    #[default]
    Nearest,
    /// GPTQ ([`npuc_quant::gptq`]): channel by channel, each rounding's error compensated in
    /// the channels not yet rounded, through the calibration inputs' second moment; the grid
    /// is the one nearest rounding would use. Needs calibration text.
    Gptq,
}

impl WeightRounding {
    /// Parses `nearest` or `gptq`.
    pub fn parse(s: &str) -> Result<WeightRounding> {
        match s {
            "nearest" => Ok(WeightRounding::Nearest),
            "gptq" => Ok(WeightRounding::Gptq),
            _ => Err(LlmError::msg(format!(
                "unknown weight rounding '{s}' (expected nearest or gptq)"
            ))),
        }
    }
}

/// Weight re-quantization of a build: the scheme and, when calibrated, each linear weight's
/// per-input-channel importance.
#[derive(Clone, Debug, Default)]
pub struct WeightQuantOptions {
    pub scheme: WeightQuant,
    /// Token ids of calibration text: when given with a re-quantizing scheme, the engine first
    /// runs the unquantized model (exact precision) over them and measures each linear input's
    /// per-channel RMS, which then weights the quantizer's error (the expected error of
    /// each layer's output instead of its weights' own error). Empty: weights alone decide.
    pub calib_tokens: Vec<u32>,
    /// Weight name -> per-input-channel importance (filled by the engine from the calibration run).
    pub importance: Option<std::sync::Arc<std::collections::HashMap<String, Vec<f32>>>>,
    /// Expose every linear layer's input as a graph output (the calibration run's graphs); the
    /// graph's `npuc.llm` facts map `linear_inputs` {weight name: value name}.
    pub observe: bool,
    /// Activation-aware scaling (AWQ-style) with this exponent, calibrated builds only: each
    /// input channel `j` of a weight is multiplied by `s_j = rms(x_j)^alpha` (normalized
    /// to geometric mean 1) before quantization and divided by it after, so the channels whose
    /// activations are large get a finer grid. Deployed, `1/s` folds exactly into the producer
    /// of the input (the RMSNorm gamma before q/k/v, gate/up and the head; the `up` rows before
    /// `down`); it depends only on the input's statistics, so every weight reading one input
    /// gets the same `s`. Not applied to the attention output projection, whose producer (the
    /// value projection, shared by the heads of a KV group) cannot take a per-head scale.
    pub awq_alpha: Option<f32>,
    /// Quantize every linear layer's input to this many bits (8 or 16; symmetric, one static
    /// scale per input from the calibration run's absolute maximum), as an NPU's integer
    /// activations would be: `QuantizeLinear -> DequantizeLinear` before the product.
    pub act_bits: Option<u8>,
    /// Weight name -> absolute maximum of its input over the calibration run.
    pub act_absmax: Option<std::sync::Arc<std::collections::HashMap<String, f32>>>,
    /// The output head's scheme when it differs from the other linear layers' (deployments
    /// often keep it at 8 bits: its error lands directly on the logits).
    pub head: Option<WeightQuant>,
    /// Grids to use instead of choosing them (an encodings file read back, `--encodings`):
    /// every re-quantized weight must have one, and each product input its scale when
    /// activations are quantized.
    pub encodings: Option<std::sync::Arc<LlmEncodings>>,
    /// Where the grids chosen (or applied) are recorded, for `--export-encodings`.
    pub record: Option<std::sync::Arc<std::sync::Mutex<LlmEncodings>>>,
    /// How values are rounded onto the chosen grids.
    pub rounding: WeightRounding,
    /// Weight name -> its input's second moment over the calibration run (filled by the
    /// engine for [`WeightRounding::Gptq`]).
    pub second_moments:
        Option<std::sync::Arc<std::collections::HashMap<String, std::sync::Arc<InputMoment>>>>,
}

/// A linear input's statistics for GPTQ rounding ([`npuc_quant::gptq::round`]).
#[derive(Clone, Debug, Default)]
pub struct InputMoment {
    /// `sum x x^T` over every calibration row (`k x k`), the attention sink included: its
    /// keys and values are read by every later position, and leaving it out let GPTQ move
    /// error into the channels where its activations are massive (SmolLM2 perplexity 3071).
    pub h: Vec<f32>,
}

/// How weights enter the graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightMode {
    /// `Ggml` (this crate registers the GGML kernels with the runtime).
    #[default]
    Auto,
    /// F32/F16 weights as f32 initializers used by ONNX `Gemm(transB=1)` / `Gather`
    /// (quantized files are refused).
    Plain,
    /// Every weight as stored in the GGUF (u8 blocks, zero-copy), through `npuc.GgmlMatMul` /
    /// `npuc.GgmlGather`.
    Ggml,
}

impl WeightMode {
    fn resolve(self) -> WeightMode {
        match self {
            // The GGML kernels are this crate's own op pack (registered by `build_with`).
            WeightMode::Auto => WeightMode::Ggml,
            m => m,
        }
    }
}

/// A graph variant: `ar{N}` (N tokens per call) or `full` (N = ctx).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// N new tokens per call.
    Ar(usize),
    /// The whole context in one call.
    Full,
}

impl Variant {
    /// Parses `ar{N}` (N >= 1) or `full`.
    pub fn parse(s: &str) -> Result<Variant> {
        if s == "full" {
            return Ok(Variant::Full);
        }
        match s.strip_prefix("ar").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) if n >= 1 => Ok(Variant::Ar(n)),
            _ => {
                bail!("unknown variant '{s}' (expected ar<N> with N >= 1, e.g. ar1, ar32, or full)")
            }
        }
    }
    /// Parses a comma-separated list.
    pub fn parse_list(s: &str) -> Result<Vec<Variant>> {
        s.split(',').map(|v| Variant::parse(v.trim())).collect()
    }
    /// The graph name (`ar32`, `full`).
    pub fn name(self) -> String {
        match self {
            Variant::Ar(n) => format!("ar{n}"),
            Variant::Full => "full".into(),
        }
    }
    /// Tokens per call with a context of `ctx`.
    pub fn tokens(self, ctx: usize) -> usize {
        match self {
            Variant::Ar(n) => n,
            Variant::Full => ctx,
        }
    }
}

/// Weights already repacked (`{name}.x8` -> tensor), shared by the variants built with clones of
/// one [`BuildOptions`] so each weight is repacked and held once.
#[derive(Clone, Default)]
pub struct RepackCache {
    tensors: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, Tensor>>>,
    /// Shapes without bytes: see [`RepackCache::layout_only`].
    layout_only: bool,
}

impl RepackCache {
    /// A cache whose interleaved weights have their dtype and shape but not their bytes: each
    /// is a fresh anonymous mapping never written (zero pages, not resident), so a graph built
    /// with it costs no repack and no memory for those weights. Only for graphs that are
    /// inspected, never run (`npuc build`'s graph steps check each graph's structure; the
    /// compile step repacks, once per part).
    pub fn layout_only() -> RepackCache {
        RepackCache {
            tensors: Default::default(),
            layout_only: true,
        }
    }
}

impl std::fmt::Debug for RepackCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.tensors.lock().map(|m| m.len()).unwrap_or(0);
        let what = if self.layout_only {
            ", layout only"
        } else {
            ""
        };
        write!(f, "RepackCache({n} tensors{what})")
    }
}

/// What to build.
#[derive(Clone, Debug)]
pub struct BuildOptions {
    /// Tokens per call (N).
    pub tokens: usize,
    /// Cache slots (C).
    pub ctx: usize,
    pub precision: Precision,
    pub weights: WeightMode,
    /// Re-quantization of the linear layers' weights (default: none).
    pub weight_quant: WeightQuantOptions,
    /// Repacked weights shared between builds (a fresh default repacks for this build only).
    pub repacked: RepackCache,
}

/// The FFN activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// `silu(gate) * up` (llama, qwen2).
    Silu,
    /// `gelu_tanh(gate) * up` (gemma3).
    GeluTanh,
}

/// Rotary embedding flavour (see `npuc.Rope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Adjacent pairs (GGUF `llama`, q/k rows permuted by the converter).
    Normal,
    /// Halves (qwen2, gemma3).
    Neox,
}

/// Everything the builder needs to know about one model.
#[derive(Clone, Debug)]
pub struct Hparams {
    /// `general.architecture`.
    pub arch: String,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub vocab: usize,
    /// Training context (`{arch}.context_length`), the default `ctx`.
    pub ctx_train: usize,
    pub eps: f32,
    pub rope_mode: RopeMode,
    /// Rotated features per head.
    pub rope_dims: usize,
    /// Rope base of global layers.
    pub rope_base: f32,
    /// Rope base of sliding-window layers.
    pub rope_base_swa: f32,
    /// Linear rope scaling factor of global layers (1 = none).
    pub rope_linear: f32,
    /// Sliding window of local layers (0 = none).
    pub window: usize,
    /// Per layer: uses the sliding window (and `rope_base_swa`).
    pub swa_layers: Vec<bool>,
    pub attn_scale: f32,
    /// Embeddings are multiplied by this after the lookup (gemma: sqrt(n_embd)).
    pub embed_scale: Option<f32>,
    pub act: Act,
    /// q/k/v biases (qwen2).
    pub qkv_bias: bool,
    /// Per-head q/k RMSNorm (gemma3).
    pub qk_norm: bool,
    /// RMSNorm after attention and after the FFN, before the residual add (gemma3).
    pub post_norms: bool,
    /// `rope_freqs.weight` present (llama3 scaling): divides the angles.
    pub rope_freqs: bool,
    /// No `output.weight`: the LM head is `token_embd.weight`.
    pub tied: bool,
}

/// Architecture-independent GGUF key reading.
pub(crate) struct Keys<'a> {
    pub g: &'a GgufFile,
    pub arch: &'a str,
}

impl Keys<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    /// Required positive integer `{arch}.k`.
    pub fn req(&self, k: &str) -> Result<usize> {
        let key = self.key(k);
        let v = match self.g.get(&key) {
            None => {
                return Err(self
                    .g
                    .meta_err(
                        &key,
                        format!("missing (required by the {} builder)", self.arch),
                    )
                    .into())
            }
            Some(v) => v,
        };
        match v.as_u64() {
            Some(n) if n > 0 && n < (1 << 31) => Ok(n as usize),
            _ => Err(self
                .g
                .meta_err(&key, format!("expected a positive integer, found {v:?}"))
                .into()),
        }
    }
    /// Optional positive integer `{arch}.k`.
    pub fn opt(&self, k: &str) -> Result<Option<usize>> {
        if self.g.get(&self.key(k)).is_none() {
            return Ok(None);
        }
        self.req(k).map(Some)
    }
    /// Optional float `{arch}.k`.
    pub fn f(&self, k: &str) -> Result<Option<f32>> {
        let key = self.key(k);
        match self.g.get(&key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x as f32)),
                _ => Err(self
                    .g
                    .meta_err(&key, format!("expected a number, found {v:?}"))
                    .into()),
            },
        }
    }
    /// Optional string `{arch}.k`.
    pub fn s(&self, k: &str) -> Option<&str> {
        self.g.get(&self.key(k)).and_then(|v| v.as_str())
    }
}

/// Hyper-parameters common to the three architectures (each arch module adjusts them).
pub(crate) fn common_hparams(g: &GgufFile, arch: &str) -> Result<Hparams> {
    let k = Keys { g, arch };
    let n_layers = k.req("block_count")?;
    let n_embd = k.req("embedding_length")?;
    let n_ff = k.req("feed_forward_length")?;
    let n_head = k.req("attention.head_count")?;
    let n_kv_head = k.opt("attention.head_count_kv")?.unwrap_or(n_head);
    if n_head % n_kv_head != 0 {
        bail!(
            "{}: {arch}.attention.head_count {n_head} is not a multiple of {arch}.attention.head_count_kv {n_kv_head}",
            g.name
        );
    }
    let head_dim = match k.opt("attention.key_length")? {
        Some(d) => d,
        None => {
            if n_embd % n_head != 0 {
                bail!(
                    "{}: {arch}.embedding_length {n_embd} is not a multiple of {arch}.attention.head_count {n_head} (and no {arch}.attention.key_length)",
                    g.name
                );
            }
            n_embd / n_head
        }
    };
    if let Some(vd) = k.opt("attention.value_length")? {
        if vd != head_dim {
            bail!("{}: {arch}.attention.value_length {vd} differs from key_length {head_dim} (not supported)", g.name);
        }
    }
    let emb = g
        .tensor("token_embd.weight")
        .ok_or_else(|| missing(g, "token_embd.weight", arch))?;
    let vocab = match k.opt("vocab_size")? {
        Some(v) => v,
        None => match g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            Some(a) => a.len(),
            None => emb.rows() as usize,
        },
    };
    let rope_dims = k.opt("rope.dimension_count")?.unwrap_or(head_dim);
    if rope_dims > head_dim || rope_dims % 2 != 0 {
        bail!(
            "{}: {arch}.rope.dimension_count {rope_dims} must be even and <= head dim {head_dim}",
            g.name
        );
    }
    let rope_base = k.f("rope.freq_base")?.unwrap_or(10000.0);
    let rope_linear = match k.s("rope.scaling.type") {
        None | Some("none") => 1.0,
        Some("linear") => k.f("rope.scaling.factor")?.unwrap_or(1.0),
        // llama3/yarn scaling of llama is carried by rope_freqs.weight (convert_hf_to_gguf).
        Some("llama3") if g.tensor("rope_freqs.weight").is_some() => 1.0,
        Some(t) => bail!("{}: {arch}.rope.scaling.type '{t}' is not supported (none, linear, llama3 with rope_freqs.weight)", g.name),
    };
    if rope_linear <= 0.0 {
        bail!("{}: {arch}.rope.scaling.factor must be positive", g.name);
    }
    let eps = k.f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5);
    Ok(Hparams {
        arch: arch.to_string(),
        n_layers,
        n_embd,
        n_ff,
        n_head,
        n_kv_head,
        head_dim,
        vocab,
        ctx_train: k.opt("context_length")?.unwrap_or(2048),
        eps,
        rope_mode: RopeMode::Neox,
        rope_dims,
        rope_base,
        rope_base_swa: rope_base,
        rope_linear,
        window: 0,
        swa_layers: vec![false; n_layers],
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        embed_scale: None,
        act: Act::Silu,
        qkv_bias: false,
        qk_norm: false,
        post_norms: false,
        rope_freqs: g.tensor("rope_freqs.weight").is_some(),
        tied: g.tensor("output.weight").is_none(),
    })
}

pub(crate) fn missing(g: &GgufFile, t: &str, arch: &str) -> LlmError {
    g.tensor_err(t, format!("missing (required by the {arch} builder)"))
        .into()
}

/// Reads and validates the hyper-parameters of `g`.
pub fn hparams(g: &GgufFile) -> Result<Hparams> {
    let arch = g.architecture()?;
    match arch {
        "llama" => llama::hparams(g),
        "qwen2" => qwen2::hparams(g),
        "gemma3" => gemma3::hparams(g),
        a => bail!(
            "{}: architecture '{a}' is not supported (supported: {})",
            g.name,
            SUPPORTED.join(", ")
        ),
    }
}

/// Builds the graph of one variant.
pub fn build(g: &GgufFile, opts: &BuildOptions) -> Result<Model> {
    let hp = hparams(g)?;
    build_with(g, &hp, opts)
}

/// Builds the graph of one variant from already-read hyper-parameters.
pub fn build_with(g: &GgufFile, hp: &Hparams, opts: &BuildOptions) -> Result<Model> {
    build_layers(g, hp, opts, None)
}

/// Builds the graph of one variant: the whole model (`part` = `None`), or one part of a split
/// model (its layers only; hidden state in/out at the cuts, see [`split`]).
pub(crate) fn build_layers(
    g: &GgufFile,
    hp: &Hparams,
    opts: &BuildOptions,
    part: Option<&split::PartSpec>,
) -> Result<Model> {
    // Sessions over the graph need this crate's kernels (GgmlMatMul, Rope, CachedAttention...).
    crate::ops::register();
    if opts.tokens == 0 || opts.ctx == 0 || opts.tokens > opts.ctx {
        bail!(
            "a variant of {} tokens per call does not fit a context of {}",
            opts.tokens,
            opts.ctx
        );
    }
    let mut b = Builder {
        g,
        hp,
        opts,
        mode: opts.weights.resolve(),
        nodes: vec![],
        inits: vec![],
        n: 0,
        linear_inputs: vec![],
    };
    let whole = split::PartSpec::whole(hp.n_layers);
    let part = part.unwrap_or(&whole);
    if part.layers.end > hp.n_layers || (part.layers.is_empty() && !part.is_embedder()) {
        bail!(
            "part {} asks for layers {}..{} of a model with {} layers",
            part.index + 1,
            part.layers.start,
            part.layers.end,
            hp.n_layers
        );
    }
    b.decoder(part)?;
    let (n, c) = (opts.tokens, opts.ctx);
    let (kvh, d) = (hp.n_kv_head, hp.head_dim);
    let kv = opts.precision.kv_dtype();
    let first_input = if part.has_embedding() {
        ValueInfo::new("input_ids", Some(TypeInfo::tensor(DType::I64, &[n])))
    } else {
        ValueInfo::new(
            split::HIDDEN_IN,
            Some(TypeInfo::tensor(DType::F32, &[n, hp.n_embd])),
        )
    };
    let mut inputs = vec![
        first_input,
        ValueInfo::new("positions", Some(TypeInfo::tensor(DType::I64, &[n]))),
        ValueInfo::new("attn_mask", Some(TypeInfo::tensor(DType::F32, &[n, c]))),
    ];
    if opts.precision.act_quant()
        && b.nodes
            .iter()
            .any(|nd| nd.inputs.iter().any(|i| i == "token_count"))
    {
        inputs.push(ValueInfo::new(
            "token_count",
            Some(TypeInfo::tensor(DType::I64, &[1])),
        ));
    }
    if b.nodes
        .iter()
        .any(|nd| nd.inputs.iter().any(|i| i == "logits_from"))
    {
        // The first row whose logits are computed (earlier rows are zero).
        inputs.push(ValueInfo::new(
            "logits_from",
            Some(TypeInfo::tensor(DType::I64, &[1])),
        ));
    }
    let mut outputs = vec![if part.has_head() {
        ValueInfo::new("logits", Some(TypeInfo::tensor(DType::F32, &[n, hp.vocab])))
    } else {
        ValueInfo::new(
            split::HIDDEN_OUT,
            Some(TypeInfo::tensor(DType::F32, &[n, hp.n_embd])),
        )
    }];
    for l in part.layers.clone() {
        for kind in ["key", "value"] {
            inputs.push(ValueInfo::new(
                format!("past_{kind}.{l}"),
                Some(TypeInfo::tensor(kv, &[kvh, c, d])),
            ));
            outputs.push(ValueInfo::new(
                format!("new_{kind}.{l}"),
                Some(TypeInfo::tensor(kv, &[kvh, n, d])),
            ));
        }
    }
    let mut facts = serde_json::json!({
        "arch": hp.arch, "ctx": c, "tokens": n, "n_layers": hp.n_layers,
        "n_kv_heads": kvh, "head_dim": d, "vocab": hp.vocab,
        "kv_dtype": kv.name(), "precision": opts.precision.name(),
    });
    if opts.weight_quant.observe {
        let mut map = serde_json::Map::new();
        for (w, x) in &b.linear_inputs {
            if !outputs.iter().any(|o| &o.name == x) {
                outputs.push(ValueInfo::new(x.clone(), None));
            }
            map.insert(w.clone(), serde_json::json!(x));
        }
        facts["linear_inputs"] = serde_json::Value::Object(map);
    }
    let name = if part.is_whole(hp.n_layers) {
        format!("{}-n{n}-c{c}", hp.arch)
    } else {
        // A part's facts: which layers (and so which KV caches) it holds, and its place.
        facts["part"] = serde_json::json!(part.index);
        facts["parts"] = serde_json::json!(part.count);
        facts["layer_start"] = serde_json::json!(part.layers.start);
        facts["layer_end"] = serde_json::json!(part.layers.end);
        facts["n_embd"] = serde_json::json!(hp.n_embd);
        format!(
            "{}-part{}of{}-n{n}-c{c}",
            hp.arch,
            part.index + 1,
            part.count
        )
    };
    let graph = Graph {
        name,
        nodes: b.nodes,
        inputs,
        outputs,
        initializers: b.inits,
        ..Default::default()
    };
    Ok(Model {
        ir_version: 10,
        opset_imports: vec![
            OpsetImport {
                domain: String::new(),
                version: 23,
            },
            OpsetImport {
                domain: "npuc".into(),
                version: 1,
            },
        ],
        producer_name: "npuc-llm".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        graph,
        metadata: vec![("npuc.llm".into(), facts.to_string())],
        ..Default::default()
    })
}

struct Builder<'a> {
    g: &'a GgufFile,
    hp: &'a Hparams,
    opts: &'a BuildOptions,
    mode: WeightMode,
    nodes: Vec<Node>,
    inits: Vec<Initializer>,
    /// Counter for fresh value names.
    n: usize,
    /// (weight name, input value name) of every linear layer, for calibration graphs.
    linear_inputs: Vec<(String, String)>,
}

impl Builder<'_> {
    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.g
            .tensor(name)
            .ok_or_else(|| missing(self.g, name, &self.hp.arch))
    }

    /// Checks a tensor's row-major shape.
    fn expect_shape(&self, name: &str, shape: &[usize]) -> Result<&TensorInfo> {
        let t = self.info(name)?;
        if t.shape() != shape {
            return Err(self
                .g
                .tensor_err(
                    name,
                    format!(
                        "has shape {:?}, expected {:?} from the {} hyper-parameters",
                        t.shape(),
                        shape,
                        self.hp.arch
                    ),
                )
                .into());
        }
        Ok(t)
    }

    fn has_init(&self, name: &str) -> bool {
        self.inits.iter().any(|i| i.name == name)
    }

    /// A tensor as stored (typed when F32/F16/BF16, u8 `[rows, row_bytes]` blocks otherwise),
    /// zero-copy over the file's mapping when aligned.
    fn raw_tensor(&self, t: &TensorInfo) -> Result<Tensor> {
        let (off, len) = self.g.tensor_range(t);
        let shape = t.shape();
        let dt = match t.ggml_type {
            GgmlType::F32 => DType::F32,
            GgmlType::F16 => DType::F16,
            GgmlType::BF16 => DType::BF16,
            ty => {
                let rb = ty.row_bytes(t.row_len() as usize).ok_or_else(|| {
                    self.g.tensor_err(
                        &t.name,
                        format!(
                            "row of {} elements is not a whole number of {} blocks",
                            t.row_len(),
                            ty.name()
                        ),
                    )
                })?;
                return Ok(Tensor::from_le_bytes(
                    DType::U8,
                    vec![t.rows() as usize, rb],
                    self.g.backing(),
                    off,
                    len,
                )?);
            }
        };
        Ok(Tensor::from_le_bytes(
            dt,
            shape,
            self.g.backing(),
            off,
            len,
        )?)
    }

    /// Whether a product's weight takes the interleaved layout: the fast path's decode kernels
    /// read the 32-value block types eight rows at a time.
    fn x8_eligible(&self, t: &TensorInfo) -> bool {
        self.mode == WeightMode::Ggml
            && self.opts.precision == Precision::Fast
            && npuc_ggml::supports_x8(t.ggml_type)
            && t.rows().is_multiple_of(npuc_ggml::X8_ROWS as u64)
    }

    /// A weight of a 32-value block type in the interleaved layout (`u8 [rows / 8, 8 ×
    /// row_bytes]`), from the shared cache or repacked now from the file, a few hundred groups
    /// at a time (read with `pread`: the plain bytes never become resident in this process).
    fn repacked_tensor(&self, t: &TensorInfo, key: &str) -> Result<Tensor> {
        let cache = &self.opts.repacked.tensors;
        if let Some(hit) = cache.lock().ok().and_then(|c| c.get(key).cloned()) {
            return Ok(hit);
        }
        let (off, len) = self.g.tensor_range(t);
        let ty = t.ggml_type;
        let (k, n) = (t.row_len() as usize, t.rows() as usize);
        let rb = npuc_ggml::row_bytes(ty, k).map_err(|e| self.g.tensor_err(&t.name, e.0))?;
        let group = npuc_ggml::X8_ROWS * rb;
        if !n.is_multiple_of(npuc_ggml::X8_ROWS) || len != n * rb {
            bail!(
                "{}: tensor '{}' ({n} rows of {rb} bytes, {len} bytes) cannot be interleaved by {} rows",
                self.g.name,
                t.name,
                npuc_ggml::X8_ROWS
            );
        }
        if self.opts.repacked.layout_only {
            let zeros = crate::anon::zeroed(len, false).map_err(|e| {
                self.g
                    .tensor_err(&t.name, format!("{len} bytes of layout: {e}"))
            })?;
            let owner = crate::anon::seal(zeros).map_err(|e| {
                self.g
                    .tensor_err(&t.name, format!("{len} bytes of layout: {e}"))
            })?;
            return Ok(Tensor::from_le_bytes(
                DType::U8,
                vec![n / npuc_ggml::X8_ROWS, group],
                owner,
                0,
                len,
            )?);
        }
        // Streamed in full every token: anonymous memory on huge pages (see `anon::zeroed`).
        let mut out = crate::anon::zeroed(len, true).map_err(|e| {
            self.g
                .tensor_err(&t.name, format!("{len} bytes for its x8 copy: {e}"))
        })?;
        let per_read = ((1 << 20) / group).max(1) * group;
        // 1 MB pieces read and repacked on every core (a 178 MB output head took ~0.4 s on one).
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let failed = std::sync::Mutex::new(None);
        npuc_ggml::parallel_chunks_mut(&mut out[..], per_read, threads, &|i, dst| {
            let mut src = vec![0u8; dst.len()];
            let done = self.g.read_at(off + i * per_read, &mut src).and_then(|()| {
                for (s, d) in src.chunks_exact(group).zip(dst.chunks_exact_mut(group)) {
                    npuc_ggml::repack_group_x8(ty, s, d, k)
                        .map_err(|e| self.g.tensor_err(&t.name, e.0))?;
                }
                Ok(())
            });
            if let (Err(e), Ok(mut f)) = (done, failed.lock()) {
                f.get_or_insert(e);
            }
        });
        if let Some(e) = failed.into_inner().ok().flatten() {
            return Err(e.into());
        }
        // Borrowed from a shared buffer, so the variants' clones share the bytes.
        let owner = crate::anon::seal(out).map_err(|e| {
            self.g
                .tensor_err(&t.name, format!("sealing its x8 copy: {e}"))
        })?;
        let tensor = Tensor::from_le_bytes(
            DType::U8,
            vec![n / npuc_ggml::X8_ROWS, group],
            owner,
            0,
            len,
        )?;
        if let Ok(mut c) = cache.lock() {
            c.insert(key.to_string(), tensor.clone());
        }
        Ok(tensor)
    }

    /// A linear weight re-quantized by [`BuildOptions::weight_quant`] (f32 `[N, K]`, the
    /// quantized values times their scales), from the shared cache or made now: the GGUF rows
    /// dequantized to f32, then quantized as the option says.
    fn requantized_tensor(&self, t: &TensorInfo, key: &str, scheme: WeightQuant) -> Result<Tensor> {
        let cache = &self.opts.repacked.tensors;
        if let Some(hit) = cache.lock().ok().and_then(|c| c.get(key).cloned()) {
            return Ok(hit);
        }
        let (rows, cols) = (t.rows() as usize, t.row_len() as usize);
        let w: Vec<f32> = match t.ggml_type {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                self.f32_tensor(t)?.into_vec::<f32>()?
            }
            ty => {
                let bytes = self.raw_tensor(t)?.to_le_bytes()?;
                let rb = bytes.len() / rows.max(1);
                let mut w = vec![0f32; rows * cols];
                for (src, dst) in bytes.chunks_exact(rb).zip(w.chunks_exact_mut(cols)) {
                    npuc_ggml::dequantize_row(ty, src, dst)
                        .map_err(|e| self.g.tensor_err(&t.name, e.0))?;
                }
                w
            }
        };
        let wq = &self.opts.weight_quant;
        let importance = wq
            .importance
            .as_ref()
            .and_then(|m| m.get(&t.name))
            .map(|v| v.as_slice());
        let awq = wq
            .awq_alpha
            .filter(|_| !t.name.contains("attn_output"))
            .zip(importance);
        let terr = |e: String| self.g.tensor_err(&t.name, e);
        let given = match &wq.encodings {
            Some(file) => Some(file.weights.get(&t.name).ok_or_else(|| {
                terr("the encodings have no entry for this weight; they were made for another model (or without this layer quantized)".into())
            })?),
            None => None,
        };
        let (q, enc) = match (given, awq) {
            (Some(enc), _) => {
                if enc.scheme() != scheme {
                    return Err(terr(format!(
                        "its encoding is {}, but this build quantizes it as {}",
                        enc.scheme().name(),
                        scheme.name()
                    ))
                    .into());
                }
                let q = enc
                    .fake_quantize(&w, rows, cols)
                    .map_err(|e| terr(e.to_string()))?;
                (q, Some(enc.clone()))
            }
            (None, Some((alpha, imp))) => {
                let s = awq_scales(imp, alpha);
                let scaled: Vec<f32> = w
                    .chunks_exact(cols)
                    .flat_map(|row| row.iter().zip(&s).map(|(x, s)| x * s))
                    .collect();
                // The error of a scaled column counts 1/s^2 as much in the original units.
                let imp_s: Vec<f32> = imp.iter().zip(&s).map(|(m, s)| m / (s * s)).collect();
                let (q, _) = scheme
                    .quantize(&scaled, rows, cols, Some(&imp_s))
                    .map_err(|e| terr(e.to_string()))?;
                // The grid belongs to the scaled weight: without the scales folded into the
                // producers it describes nothing a converter could use, so it is not recorded.
                let q = q
                    .chunks_exact(cols)
                    .flat_map(|row| row.iter().zip(&s).map(|(x, s)| x / s))
                    .collect::<Vec<f32>>();
                (q, None)
            }
            (None, None) => {
                let (q, enc) = scheme
                    .quantize(&w, rows, cols, importance)
                    .map_err(|e| terr(e.to_string()))?;
                let moment = wq
                    .second_moments
                    .as_ref()
                    .and_then(|m| m.get(&t.name))
                    .filter(|_| wq.rounding == WeightRounding::Gptq);
                match moment {
                    Some(m) => {
                        let q = gptq_values(&w, rows, cols, m, &enc).map_err(terr)?;
                        (q, Some(enc))
                    }
                    None => (q, Some(enc)),
                }
            }
        };
        if let Some(rec) = &wq.record {
            let Some(enc) = enc else {
                return Err(terr(
                    "AWQ-scaled weights have no encoding to export (the scales are not folded into the graph); drop --awq-alpha to export encodings".into(),
                )
                .into());
            };
            if let Ok(mut r) = rec.lock() {
                r.weights.insert(t.name.clone(), enc);
            }
        }
        let tensor = Tensor::from_vec(vec![rows, cols], q)?;
        if let Ok(mut c) = cache.lock() {
            c.insert(key.to_string(), tensor.clone());
        }
        Ok(tensor)
    }

    /// `x` through a symmetric `act_bits` quantize-dequantize with the static scale of the
    /// linear `weight`'s input ([`WeightQuantOptions::act_bits`]); `None` when not asked for
    /// or no range was measured. One pair per input value (q/k/v, gate/up share theirs).
    fn act_fake_quant(&mut self, weight: &str, x: &str) -> Result<Option<String>> {
        let wq = &self.opts.weight_quant;
        let Some(bits) = wq.act_bits else {
            return Ok(None);
        };
        let (zp, qmax) = match bits {
            8 => (Tensor::scalar(0i8), 127f32),
            16 => (Tensor::scalar(0i16), 32767f32),
            b => bail!("activation bits {b} unsupported (8 or 16)"),
        };
        let scale = match (&wq.encodings, wq.act_absmax.as_ref()) {
            (Some(file), _) => match file.inputs.get(weight) {
                Some(a) if a.bits == bits => a.scale,
                Some(a) => bail!(
                    "the encodings give the input of '{weight}' {} bits, this build quantizes inputs to {bits}",
                    a.bits
                ),
                None => bail!(
                    "the encodings have no entry '{weight}{}' (the input of that product)",
                    encodings::INPUT_SUFFIX
                ),
            },
            (None, Some(ranges)) => match ranges.get(weight) {
                Some(&absmax) if absmax > 0.0 => absmax / qmax,
                Some(_) => 1.0,
                None => return Ok(None),
            },
            (None, None) => return Ok(None),
        };
        if let Some(rec) = &wq.record {
            if let Ok(mut r) = rec.lock() {
                r.inputs
                    .insert(weight.to_string(), ActEncoding { bits, scale });
            }
        }
        let out = format!("{x}.a{bits}");
        if self.nodes.iter().any(|n| n.outputs.first() == Some(&out)) {
            return Ok(Some(out));
        }
        let (sn, zn) = (
            format!("{x}.a{bits}.scale"),
            format!("{x}.a{bits}.zero_point"),
        );
        self.inits.push(Initializer {
            name: sn.clone(),
            tensor: Tensor::scalar(scale),
        });
        self.inits.push(Initializer {
            name: zn.clone(),
            tensor: zp,
        });
        let q = format!("{x}.a{bits}.q");
        self.push("QuantizeLinear", "", &[x, &sn, &zn], &q, vec![]);
        self.push("DequantizeLinear", "", &[&q, &sn, &zn], &out, vec![]);
        Ok(Some(out))
    }

    /// A tensor as f32 (zero-copy for F32; F16/BF16 widened; quantized types refused).
    fn f32_tensor(&self, t: &TensorInfo) -> Result<Tensor> {
        let raw = self.raw_tensor(t)?;
        match raw.dtype() {
            DType::F32 => Ok(raw),
            DType::F16 | DType::BF16 => {
                let v: Vec<f32> = raw.to_f64_vec()?.into_iter().map(|x| x as f32).collect();
                Ok(Tensor::from_vec(raw.shape().to_vec(), v)?)
            }
            _ => Err(self
                .g
                .tensor_err(
                    &t.name,
                    format!(
                        "is {}: quantized weights need the npuc.GgmlMatMul/GgmlGather ops (weights mode ggml)",
                        t.ggml_type.name()
                    ),
                )
                .into()),
        }
    }

    /// Adds `name` as an f32 initializer (1-D parameters: norms, biases, rope factors).
    fn param(&mut self, name: &str, len: usize) -> Result<String> {
        if !self.has_init(name) {
            let t = self.expect_shape(name, &[len])?;
            let tensor = self.f32_tensor(t)?;
            self.inits.push(Initializer {
                name: name.into(),
                tensor,
            });
        }
        Ok(name.into())
    }

    fn fresh(&mut self, what: &str) -> String {
        self.n += 1;
        format!("{what}_{}", self.n)
    }

    fn push(
        &mut self,
        op: &str,
        domain: &str,
        ins: &[&str],
        out: &str,
        attrs: Vec<(&str, Attr)>,
    ) -> String {
        let mut nd = Node::new(op, ins, &[out]);
        nd.name = out.to_string();
        nd.domain = domain.into();
        for (k, a) in attrs {
            nd = nd.with_attr(k, a);
        }
        self.nodes.push(nd);
        out.to_string()
    }

    /// Adds a node of an `npuc` op built from its definition; returns its output.
    /// A one-input, one-output `npuc` op (`x` -> `y`) on `x`; `what` names its output.
    fn unary(
        &mut self,
        def: &'static npuc_ir::opdef::OpDef,
        what: &str,
        x: &str,
    ) -> Result<String> {
        let out = self.fresh(what);
        let node = def.node(&out).input("x", x).output("y", &out);
        self.push_node(node)
    }

    fn push_node(&mut self, node: NodeBuilder) -> Result<String> {
        let nd = node.build()?;
        let out = nd.outputs[0].clone();
        self.nodes.push(nd);
        Ok(out)
    }

    fn op(&mut self, op: &str, ins: &[&str], attrs: Vec<(&str, Attr)>) -> String {
        let out = self.fresh(&op.to_lowercase());
        self.push(op, "", ins, &out, attrs)
    }

    fn const_i64(&mut self, vals: &[i64]) -> String {
        let name = format!(
            "const_i64_{}",
            vals.iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join("_")
        );
        if !self.has_init(&name) {
            let t = Tensor::from_vec(vec![vals.len()], vals.to_vec()).expect("length matches");
            self.inits.push(Initializer {
                name: name.clone(),
                tensor: t,
            });
        }
        name
    }

    fn const_f32(&mut self, name: &str, v: f32) -> String {
        if !self.has_init(name) {
            self.inits.push(Initializer {
                name: name.into(),
                tensor: Tensor::scalar(v),
            });
        }
        name.into()
    }

    fn rms(&mut self, x: &str, w: &str, len: usize) -> Result<String> {
        let w = self.param(w, len)?;
        let eps = self.hp.eps;
        Ok(self.op(
            "RMSNormalization",
            &[x, &w],
            vec![("axis", Attr::Int(-1)), ("epsilon", Attr::Float(eps))],
        ))
    }

    /// `x [M, k] · Wᵀ (+ bias)` with W = `name` of `n_out` rows of `k`.
    fn linear(
        &mut self,
        x: &str,
        name: &str,
        bias: Option<&str>,
        n_out: usize,
        k: usize,
    ) -> Result<String> {
        self.linear_rows(x, name, bias, n_out, k, false)
    }

    /// [`Builder::linear`]; `head`: the output head, which computes only the rows from the
    /// graph input `logits_from` on (the rows whose logits the caller wants: the last token's
    /// when generating), and rounds each row as a product of its own (llama.cpp runs its head
    /// only for the rows whose logits it returns).
    fn linear_rows(
        &mut self,
        x: &str,
        name: &str,
        bias: Option<&str>,
        n_out: usize,
        k: usize,
        head: bool,
    ) -> Result<String> {
        let t = self.expect_shape(name, &[n_out, k])?.clone();
        self.linear_inputs.push((name.to_string(), x.to_string()));
        let fq;
        let x = match self.act_fake_quant(name, x)? {
            Some(q) => {
                fq = q;
                fq.as_str()
            }
            None => x,
        };
        let bias = match bias {
            Some(b) => Some(self.param(b, n_out)?),
            None => None,
        };
        let wq = match (head, self.opts.weight_quant.head) {
            (true, Some(h)) if self.opts.weight_quant.scheme != WeightQuant::Gguf => h,
            _ => self.opts.weight_quant.scheme,
        };
        let requant = wq != WeightQuant::Gguf && self.mode == WeightMode::Ggml;
        let x8 = !requant && self.x8_eligible(&t);
        let wname = if x8 {
            format!("{name}.x8")
        } else if requant {
            format!("{name}.{}", wq.name())
        } else {
            name.to_string()
        };
        if !self.has_init(&wname) {
            let tensor = match self.mode {
                WeightMode::Ggml if requant => self.requantized_tensor(&t, &wname, wq)?,
                WeightMode::Ggml if x8 => self.repacked_tensor(&t, &wname)?,
                WeightMode::Ggml => self.raw_tensor(&t)?,
                _ => self.f32_tensor(&t)?,
            };
            self.inits.push(Initializer {
                name: wname.clone(),
                tensor,
            });
        }
        let name = wname.as_str();
        let act_quant = self.opts.precision.act_quant();
        let parity = self.opts.precision == Precision::Parity;
        let out = self.fresh("linear");
        Ok(match self.mode {
            WeightMode::Ggml => {
                // Real-token count: padding rows are skipped (and, for parity, llama.cpp's
                // batch grouping kept).
                let token_count = act_quant.then_some("token_count");
                let node = ops::ggml::GGML_MATMUL
                    .node(&out)
                    .input("x", x)
                    .input("w", name)
                    .opt_input("bias", bias)
                    .opt_input("token_count", token_count)
                    .opt_input("row_start", (head && act_quant).then_some("logits_from"))
                    .output("y", &out)
                    .attr(
                        "ggml_type",
                        Attr::String(if requant {
                            GgmlType::F32.name().into()
                        } else {
                            t.ggml_type.name().into()
                        }),
                    )
                    .attr("k", Attr::Int(k as i64))
                    .attr(
                        "act_quant",
                        Attr::Int(match self.opts.precision {
                            Precision::Exact => 0,
                            Precision::Parity => 1,
                            Precision::Fast => 2,
                        }),
                    )
                    .attr("batch", Attr::Int(i64::from(parity && !head)));
                let node = if x8 {
                    node.attr("layout", Attr::String("x8".into()))
                } else {
                    node
                };
                self.push_node(node)?
            }
            _ => {
                let mut ins = vec![x, name];
                if let Some(b) = &bias {
                    ins.push(b);
                }
                self.push("Gemm", "", &ins, &out, vec![("transB", Attr::Int(1))])
            }
        })
    }

    /// The token embedding table, its shape checked against the vocabulary and width.
    fn embedding_table(&self) -> Result<TensorInfo> {
        let (v, e) = (self.hp.vocab, self.hp.n_embd);
        let t = self.info("token_embd.weight")?.clone();
        if t.shape().get(1) != Some(&e) || (t.rows() as usize) < v {
            return Err(self
                .g
                .tensor_err(
                    "token_embd.weight",
                    format!("has shape {:?}, expected [>= {v}, {e}]", t.shape()),
                )
                .into());
        }
        Ok(t)
    }

    fn embed(&mut self) -> Result<String> {
        let e = self.hp.n_embd;
        let t = self.embedding_table()?;
        // A tied embedding is also the output head: stored once, in the head's layout (an
        // untied one stays in the mapping, where a lookup touches only its rows' pages).
        let x8 = self.hp.tied && self.x8_eligible(&t);
        let name = if x8 {
            "token_embd.weight.x8"
        } else {
            "token_embd.weight"
        };
        if !self.has_init(name) {
            let tensor = match self.mode {
                WeightMode::Ggml if x8 => self.repacked_tensor(&t, name)?,
                WeightMode::Ggml => self.raw_tensor(&t)?,
                _ => self.f32_tensor(&t)?,
            };
            self.inits.push(Initializer {
                name: name.into(),
                tensor,
            });
        }
        Ok(match self.mode {
            WeightMode::Ggml => {
                let out = self.fresh("embed");
                let node = ops::ggml::GGML_GATHER
                    .node(&out)
                    .input("w", name)
                    .input("ids", "input_ids")
                    .output("y", &out)
                    .attr("ggml_type", Attr::String(t.ggml_type.name().into()))
                    .attr("k", Attr::Int(e as i64));
                let node = if x8 {
                    node.attr("layout", Attr::String("x8".into()))
                } else {
                    node
                };
                self.push_node(node)?
            }
            _ => self.op("Gather", &[name, "input_ids"], vec![("axis", Attr::Int(0))]),
        })
    }

    /// The f16 copy of the embedding table `t` (`[v, e]`), shared through the repack cache
    /// like the x8 weights (one conversion for all of a part's graphs); layout only: its shape
    /// over never-written pages.
    fn f16_table(&self, t: &TensorInfo, key: &str, v: usize, e: usize) -> Result<Tensor> {
        let cache = &self.opts.repacked.tensors;
        if let Some(hit) = cache.lock().ok().and_then(|c| c.get(key).cloned()) {
            return Ok(hit);
        }
        let len = v * e * 2;
        let what = |err: String| {
            self.g
                .tensor_err(&t.name, format!("{len} bytes of f16 table: {err}"))
        };
        let mut out = crate::anon::zeroed(len, false).map_err(|err| what(err.to_string()))?;
        if !self.opts.repacked.layout_only {
            let (off, bytes) = self.g.tensor_range(t);
            let backing = self.g.backing();
            let src = &backing.bytes()[off..off + bytes];
            let row_bytes = bytes / t.rows() as usize;
            let mut row = vec![0f32; e];
            for (r, dst) in out[..].chunks_exact_mut(2 * e).enumerate() {
                npuc_ggml::dequantize_row(
                    t.ggml_type,
                    &src[r * row_bytes..(r + 1) * row_bytes],
                    &mut row,
                )
                .map_err(|err| self.g.tensor_err(&t.name, err.to_string()))?;
                for (x, d) in row.iter().zip(dst.chunks_exact_mut(2)) {
                    d.copy_from_slice(&half::f16::from_f32(*x).to_le_bytes());
                }
            }
        }
        let owner = crate::anon::seal(out).map_err(|err| what(err.to_string()))?;
        let tensor = Tensor::from_le_bytes(DType::F16, vec![v, e], owner, 0, len)?;
        if !self.opts.repacked.layout_only {
            if let Ok(mut c) = cache.lock() {
                c.insert(key.to_string(), tensor.clone());
            }
        }
        Ok(tensor)
    }

    /// The token lookup of an f16 embedder ([`split::PartSpec::embedder_f16`]): the table's
    /// rows dequantized from the GGUF's blocks (bit-exact, as `npuc.GgmlGather` does) and
    /// rounded to f16 once, at build time; `Gather` then `Cast` to f32 at run time.
    fn embed_f16(&mut self) -> Result<String> {
        let (v, e) = (self.hp.vocab, self.hp.n_embd);
        let t = self.embedding_table()?;
        let name = "token_embd.weight.f16";
        if !self.has_init(name) {
            let tensor = self.f16_table(&t, name, v, e)?;
            self.inits.push(Initializer {
                name: name.into(),
                tensor,
            });
        }
        let rows = self.op("Gather", &[name, "input_ids"], vec![("axis", Attr::Int(0))]);
        Ok(self.op(
            "Cast",
            &[&rows],
            vec![("to", Attr::Int(DType::F32.onnx_code() as i64))],
        ))
    }

    /// The decoder layers of `part`: from the token embedding (first part) or the hidden-state
    /// input, to the logits (last part) or the hidden-state output.
    fn decoder(&mut self, part: &split::PartSpec) -> Result<()> {
        let hp = self.hp;
        let (n, e) = (self.opts.tokens, hp.n_embd);
        let (h, kvh, d) = (hp.n_head, hp.n_kv_head, hp.head_dim);
        let mut x = if part.has_embedding() {
            let mut x = if part.is_embedder() && part.embedder_f16 {
                self.embed_f16()?
            } else {
                self.embed()?
            };
            if let Some(s) = hp.embed_scale {
                let c = self.const_f32("embed_scale", s);
                x = self.op("Mul", &[&x, &c], vec![]);
            }
            x
        } else {
            split::HIDDEN_IN.to_string()
        };
        let freqs = if hp.rope_freqs {
            Some(self.param("rope_freqs.weight", hp.rope_dims / 2)?)
        } else {
            None
        };
        // Linear rope scaling of global layers as constant factors (angles / factor).
        let linear = if hp.rope_linear != 1.0 && freqs.is_none() {
            let name = "rope_linear_factors".to_string();
            if !self.has_init(&name) {
                let t = Tensor::from_vec(
                    vec![hp.rope_dims / 2],
                    vec![hp.rope_linear; hp.rope_dims / 2],
                )?;
                self.inits.push(Initializer {
                    name: name.clone(),
                    tensor: t,
                });
            }
            Some(name)
        } else {
            None
        };
        let shape_q = self.const_i64(&[n as i64, h as i64, d as i64]);
        let shape_kv = self.const_i64(&[n as i64, kvh as i64, d as i64]);
        let mode = match hp.rope_mode {
            RopeMode::Normal => "normal",
            RopeMode::Neox => "neox",
        };
        for l in part.layers.clone() {
            let p = |s: &str| format!("blk.{l}.{s}");
            let swa = hp.swa_layers[l];
            let hn = self.rms(&x, &p("attn_norm.weight"), e)?;
            let (bq, bk, bv) = if hp.qkv_bias {
                (
                    Some(p("attn_q.bias")),
                    Some(p("attn_k.bias")),
                    Some(p("attn_v.bias")),
                )
            } else {
                (None, None, None)
            };
            let q = self.linear(&hn, &p("attn_q.weight"), bq.as_deref(), h * d, e)?;
            let k = self.linear(&hn, &p("attn_k.weight"), bk.as_deref(), kvh * d, e)?;
            let v = self.linear(&hn, &p("attn_v.weight"), bv.as_deref(), kvh * d, e)?;
            let mut q = self.op("Reshape", &[&q, &shape_q], vec![]);
            let mut k = self.op("Reshape", &[&k, &shape_kv], vec![]);
            let v = self.op("Reshape", &[&v, &shape_kv], vec![]);
            if hp.qk_norm {
                q = self.rms(&q, &p("attn_q_norm.weight"), d)?;
                k = self.rms(&k, &p("attn_k_norm.weight"), d)?;
            }
            let base = if swa { hp.rope_base_swa } else { hp.rope_base };
            let factors = if swa {
                None
            } else {
                freqs.clone().or(linear.clone())
            };
            let parity = self.opts.precision == Precision::Parity;
            let ggml_rope = i64::from(parity);
            let rope = |x: &str, out: &str| {
                ops::transformer::ROPE
                    .node(out)
                    .input("x", x)
                    .input("positions", "positions")
                    .opt_input("freq_factors", factors.as_deref())
                    .output("y", out)
                    .attr("mode", Attr::String(mode.into()))
                    .attr("base", Attr::Float(base))
                    .attr("dims", Attr::Int(hp.rope_dims as i64))
                    .attr("ggml", Attr::Int(ggml_rope))
            };
            let qr = self.fresh("rope_q");
            let q = self.push_node(rope(&q, &qr))?;
            let kr = self.fresh("rope_k");
            let k = self.push_node(rope(&k, &kr))?;
            // This call's K/V in the cache layout [KVH, N, D] and dtype.
            for (src, kind) in [(&k, "key"), (&v, "value")] {
                let t = self.op(
                    "Transpose",
                    &[src],
                    vec![("perm", Attr::Ints(vec![1, 0, 2]))],
                );
                let out = format!("new_{kind}.{l}");
                if self.opts.precision.kv_dtype() == DType::F16 {
                    self.push("Cast", "", &[&t], &out, vec![("to", Attr::Int(10))]);
                } else {
                    self.push("Identity", "", &[&t], &out, vec![]);
                }
            }
            let pk = format!("past_key.{l}");
            let pv = format!("past_value.{l}");
            let att = self.fresh("attn");
            let window = if swa { hp.window as i64 } else { 0 };
            let a = self.push_node(
                ops::transformer::CACHED_ATTENTION
                    .node(&att)
                    .input("q", &q)
                    .input("k_new", &k)
                    .input("v_new", &v)
                    .input("past_k", &pk)
                    .input("past_v", &pv)
                    .input("positions", "positions")
                    .input("mask", "attn_mask")
                    .output("out", &att)
                    .attr("scale", Attr::Float(hp.attn_scale))
                    .attr("window", Attr::Int(window))
                    .attr("ggml", Attr::Int(i64::from(parity)))
                    .attr(
                        "prescale",
                        Attr::Int(i64::from(parity && hp.arch == "gemma3")),
                    ),
            )?;
            let mut o = self.linear(&a, &p("attn_output.weight"), None, e, h * d)?;
            if hp.post_norms {
                o = self.rms(&o, &p("post_attention_norm.weight"), e)?;
            }
            x = self.op("Add", &[&x, &o], vec![]);
            let hn = self.rms(&x, &p("ffn_norm.weight"), e)?;
            let gate = self.linear(&hn, &p("ffn_gate.weight"), None, hp.n_ff, e)?;
            let up = self.linear(&hn, &p("ffn_up.weight"), None, hp.n_ff, e)?;
            let act = match hp.act {
                Act::Silu if self.opts.precision == Precision::Parity => {
                    // ggml's vector SiLU (its own expf), as llama.cpp's swiglu evaluates it.
                    self.unary(&ops::transformer::SILU_GGML, "silu_ggml", &gate)?
                }
                Act::Silu => {
                    let s = self.op("Sigmoid", &[&gate], vec![]);
                    self.op("Mul", &[&gate, &s], vec![])
                }
                Act::GeluTanh if self.opts.precision.act_quant() => {
                    // ggml's CPU GELU is a table over f16 inputs holding f16 outputs
                    // (GGML_GELU_FP16); npuc.GeluF16 evaluates it the same way.
                    self.unary(&ops::transformer::GELU_F16, "gelu_f16", &gate)?
                }
                Act::GeluTanh => self.op(
                    "Gelu",
                    &[&gate],
                    vec![("approximate", Attr::String("tanh".into()))],
                ),
            };
            let m = self.op("Mul", &[&act, &up], vec![]);
            let mut dn = self.linear(&m, &p("ffn_down.weight"), None, e, hp.n_ff)?;
            if hp.post_norms {
                dn = self.rms(&dn, &p("post_ffw_norm.weight"), e)?;
            }
            // Named, so checks can compare each layer's residual stream (and the hidden state
            // at a part cut) across graphs.
            x = self.push("Add", "", &[&x, &dn], &format!("residual.{l}"), vec![]);
        }
        if !part.has_head() {
            self.push("Identity", "", &[&x], split::HIDDEN_OUT, vec![]);
            return Ok(());
        }
        let xn = self.rms(&x, "output_norm.weight", e)?;
        let head = if hp.tied {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let (vocab, rows) = (hp.vocab, self.info(head)?.rows() as usize);
        if rows != vocab {
            return Err(self
                .g
                .tensor_err(
                    head,
                    format!("has {rows} rows, expected the vocabulary size {vocab}"),
                )
                .into());
        }
        let logits = self.linear_rows(&xn, head, None, vocab, e, true)?;
        self.push("Identity", "", &[&logits], "logits", vec![]);
        Ok(())
    }
}

/// `w` rounded by GPTQ onto the grid of `enc` (the grid nearest rounding chose), with `m`
/// its input's statistics.
fn gptq_values(
    w: &[f32],
    rows: usize,
    cols: usize,
    m: &InputMoment,
    enc: &WeightEncoding,
) -> std::result::Result<Vec<f32>, String> {
    let (scales, group, bw) = match enc {
        WeightEncoding::Lpbq {
            bw,
            block,
            int_scales,
            channel_scales,
            ..
        } => {
            let nb = cols / block;
            let s: Vec<f32> = (0..rows * nb)
                .map(|i| channel_scales[i / nb] * int_scales[i] as f32)
                .collect();
            (s, *block, *bw)
        }
        WeightEncoding::PerChannel { bw, scales } => (scales.clone(), cols, *bw),
    };
    let grid = npuc_quant::gptq::Grid {
        scales: &scales,
        group,
        qmin: -((1i32 << (bw - 1)) as f32),
        qmax: ((1i32 << (bw - 1)) - 1) as f32,
    };
    let opts = npuc_quant::gptq::GptqOptions {
        threads: rayon::current_num_threads(),
        ..Default::default()
    };
    npuc_quant::gptq::round(w, rows, cols, &m.h, None, &grid, &opts).map_err(|e| e.to_string())
}

/// AWQ-style per-input-channel scales `rms^alpha`, normalized to geometric mean 1 (see
/// [`WeightQuantOptions::awq_alpha`]); channels that never fired get the smallest scale seen.
fn awq_scales(rms: &[f32], alpha: f32) -> Vec<f32> {
    let floor = rms
        .iter()
        .copied()
        .filter(|&m| m > 0.0)
        .fold(f32::INFINITY, f32::min);
    let floor = if floor.is_finite() { floor } else { 1.0 };
    let logs: Vec<f64> = rms
        .iter()
        .map(|&m| (m.max(floor) as f64).ln() * alpha as f64)
        .collect();
    let mean = logs.iter().sum::<f64>() / logs.len().max(1) as f64;
    logs.iter().map(|l| (l - mean).exp() as f32).collect()
}
