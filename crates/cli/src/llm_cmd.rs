//! LLM subcommands: `npuc generate`, `npuc chat`, `npuc perplexity` and `npuc bench` for GGUF / LLM
//! artifacts. Argument structs are clap `Args` so `main.rs` only adds one variant per command.
//!
//! The loaded model ([`Model`]: an `npuc_llm::Engine` or `Bundle`) implements npuc-generate's
//! `CausalLm`; the tokenizer (`npuc_tokenizer::Tokenizer`) is adapted to `TokenText` /
//! `ChatTemplate` by the thin wrapper [`Tok`].

use crate::flags::Given;
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use npuc_generate::chat::{ChatMessage, ChatSession, ChatTemplate};
use npuc_generate::{
    generate, generate_continue, perplexity, CausalLm, GenOutput, SamplerParams, TokenText,
};
use npuc_llm::{
    Bundle, BundleOptions, Engine, EngineOptions, LlmEncodings, Precision, Variant, WeightQuant,
    WeightQuantOptions, WeightRounding,
};
use npuc_tokenizer::Tokenizer;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A loaded LLM: one engine over a GGUF or an LLM artifact, or a split bundle directory
/// (`npuc build`), whose parts run in sequence.
// One per process, never moved in a loop: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Model {
    Engine(Engine),
    Bundle(Bundle),
}

impl Model {
    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        match self {
            Model::Engine(e) => e.vocab(),
            Model::Bundle(b) => b.vocab(),
        }
    }
    /// Weight bytes one decode step reads.
    pub fn decode_weight_bytes(&self) -> u64 {
        match self {
            Model::Engine(e) => e.decode_weight_bytes(),
            Model::Bundle(b) => b.decode_weight_bytes(),
        }
    }
}

impl CausalLm for Model {
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        Ok(match self {
            Model::Engine(e) => e.forward(tokens, all_logits)?,
            Model::Bundle(b) => b.forward(tokens, all_logits)?,
        })
    }
    fn position(&self) -> usize {
        match self {
            Model::Engine(e) => e.position(),
            Model::Bundle(b) => b.position(),
        }
    }
    fn ctx(&self) -> usize {
        match self {
            Model::Engine(e) => e.ctx(),
            Model::Bundle(b) => b.ctx(),
        }
    }
    fn vocab(&self) -> usize {
        Model::vocab(self)
    }
    fn reset(&mut self) {
        match self {
            Model::Engine(e) => e.reset(),
            Model::Bundle(b) => b.reset(),
        }
    }
    fn truncate(&mut self, pos: usize) {
        match self {
            Model::Engine(e) => e.truncate(pos),
            Model::Bundle(b) => b.truncate(pos),
        }
    }
}

/// `TokenText` + `ChatTemplate` view of the tokenizer.
pub struct Tok<'a>(pub &'a Tokenizer);

impl TokenText for Tok<'_> {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.0.token_bytes(id)
    }
    fn is_eog(&self, id: u32) -> bool {
        self.0.is_eog(id)
    }
}

impl ChatTemplate for Tok<'_> {
    fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let msgs: Vec<npuc_tokenizer::ChatMessage> = messages
            .iter()
            .map(|m| npuc_tokenizer::ChatMessage::new(m.role.clone(), m.content.clone()))
            .collect();
        Ok(self.0.apply_chat_template(&msgs, add_generation_prompt)?)
    }

    /// Like llama.cpp: when the template already writes the BOS text, it is parsed as the BOS token and
    /// no second BOS is added; otherwise BOS is added when the model asks for it.
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let bos_text = self
            .0
            .bos()
            .and_then(|b| self.0.token_text(b))
            .unwrap_or("");
        let has_bos = !bos_text.is_empty() && text.starts_with(bos_text);
        Ok(self.0.encode(text, !has_bos)?)
    }
}

/// Numerical path of the engine.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PrecisionArg {
    /// Built for speed (the default): prompts through f32 products over weights dequantized
    /// panel by panel, token steps through Q8 activations and integer kernels, f16 KV cache,
    /// vectorized attention; rounds differently from llama.cpp.
    Fast,
    /// llama.cpp's AVX2 CPU arithmetic op by op (logits bit-identical to it; a test instrument).
    Parity,
    /// Dequantized weights, f32 activations and KV cache.
    Exact,
}

/// Options shared by every LLM command: model, threads, context, precision.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A `.gguf` model or an LLM `.npuc` artifact.
    pub model: PathBuf,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Context length in tokens (default: the model's or the artifact's).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// `fast` (llama.cpp-like integer paths) or `exact` (f32).
    #[arg(long, value_enum, default_value = "fast")]
    pub precision: PrecisionArg,
    /// Chat template (a file path, or the template text itself) replacing the model's.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Graph variants to build (GGUF) or use (artifact), e.g. `ar1,ar32,ar128` (default: ar1,ar32,ar128).
    #[arg(long)]
    pub variants: Option<String>,
    /// Re-quantize the linear layers' weights (GGUF only) from their f32 values, as an NPU
    /// deployment would: `lpbq4[:BLOCK]` (int4 blocks of BLOCK input channels, default 64, with
    /// 4-bit block scales over a per-channel scale: QAIRT's LLM default), `lpbq8[:BLOCK]`,
    /// `int8` / `int4` (one scale per output channel), `gguf` (the file's own blocks, the
    /// default). The quantized weights run dequantized; with `--precision exact` the rest of
    /// the model is f32, so perplexity shows the quantization's cost alone.
    #[arg(long, value_name = "SCHEME")]
    pub quantize_weights: Option<String>,
    /// Calibration text for `--quantize-weights`: the unquantized model is run over it first
    /// and each linear layer's input statistics weight the quantizer's error (expected output
    /// error instead of the weights' own). Use text other than what you evaluate on.
    #[arg(long, value_name = "FILE", requires = "quantize_weights")]
    pub calib_text: Option<PathBuf>,
    /// Activation-aware weight scaling (AWQ-style) before `--quantize-weights`, exponent ALPHA
    /// in [0, 1] (0.5 is AWQ's usual choice): input channels with large calibration activations
    /// get a finer grid; the inverse scale folds into the producing norm or projection.
    #[arg(long, value_name = "ALPHA", requires = "calib_text")]
    pub awq_alpha: Option<f32>,
    /// Quantize the linear layers' inputs to BITS (16 or 8; one static symmetric scale per
    /// input from the calibration text's range), e.g. `--quantize-weights lpbq4 --act-bits 16`
    /// for w4a16 as QAIRT deploys LLMs.
    #[arg(long, value_name = "BITS", requires = "calib_text", value_parser = ["8", "16"])]
    pub act_bits: Option<String>,
    /// The output head's scheme when it should differ from `--quantize-weights` (e.g. `int8`:
    /// deployments often keep the head at 8 bits, its error lands directly on the logits).
    #[arg(long, value_name = "SCHEME", requires = "quantize_weights")]
    pub quantize_head: Option<String>,
    /// How `--quantize-weights` rounds values onto its grid: `nearest` (the default) or
    /// `gptq` (GPTQ: input channels rounded one at a time in order of decreasing activation
    /// energy, each rounding's error compensated in the channels not yet rounded through the
    /// calibration inputs' correlations; same grid, other integers). Needs `--calib-text`;
    /// its rounding choices are not in an encodings file, so not with `--export-encodings`.
    #[arg(long, value_name = "nearest|gptq", requires = "calib_text", value_parser = ["nearest", "gptq"])]
    pub weight_rounding: Option<String>,
    /// Write the re-quantized weights' grids (and the linear inputs' scales with
    /// `--act-bits`) as AIMET encodings 1.0.0 JSON: `LPBQ` / `PER_CHANNEL` entries named by the
    /// GGUF weight names in their `[out, in]` layout, activations as `<weight>.input`.
    #[arg(long, value_name = "FILE")]
    pub export_encodings: Option<PathBuf>,
    /// Re-quantize with the grids of an encodings file (as `--export-encodings` writes it)
    /// instead of choosing them: the same deployment again, no calibration text needed.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with_all = ["quantize_weights", "calib_text", "awq_alpha", "act_bits", "quantize_head", "weight_rounding"]
    )]
    pub encodings: Option<PathBuf>,
}

/// Sampling options (llama.cpp's names and defaults, except the seed: fixed 0 for reproducibility).
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 40)]
    pub top_k: i32,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0 = off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Locally typical sampling (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub typical_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the penalties look back over (-1 = all, 0 = off).
    #[arg(long, default_value_t = 64, allow_hyphen_values = true)]
    pub repeat_last_n: i32,
    /// Presence penalty.
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Frequency penalty.
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// RNG seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop strings (repeatable); removed from the output.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    /// The sampler parameters these flags give.
    pub fn params(&self) -> SamplerParams {
        SamplerParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            typical_p: self.typical_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            min_keep: 0,
            seed: self.seed,
        }
    }
}

/// `npuc generate`.
#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Prompt text.
    #[arg(long, conflicts_with = "prompt_tokens")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids (used verbatim: no BOS is added).
    #[arg(long, value_delimiter = ',')]
    pub prompt_tokens: Option<Vec<u32>>,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Wrap the prompt as a user message in the chat template.
    #[arg(long)]
    pub chat: bool,
    /// Do not add BOS when tokenizing the prompt.
    #[arg(long)]
    pub no_bos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// With `--max-tokens 0`: write the last prompt position's logits (f32 [vocab]) to this `.npy`.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    /// Embeddings fed ahead of the prompt (f32 `.npy`, `[rows, n_embd]` or `[1, rows, n_embd]`,
    /// e.g. a vision component's output): bundles built with `split.embedder = true`.
    #[arg(long, value_name = "FILE.npy")]
    pub prefix_embeddings: Option<PathBuf>,
}

/// `npuc chat`.
#[derive(Args, Debug, Clone)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// System message.
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
}

/// `npuc perplexity`.
#[derive(Args, Debug, Clone)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Evaluate at most this many chunks.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Another engine's top-1 ids at the scored positions (`.npy`, 1-D integers, e.g. made by
    /// `scripts/llamacpp/make_top1_refs.py` with llama.cpp): prints the share of positions where
    /// npuc's argmax is the same (teacher-forced top-1 agreement).
    #[arg(long)]
    pub top1_ref: Option<PathBuf>,
    /// Print one JSON object at the end.
    #[arg(long)]
    pub json: bool,
}

/// `npuc bench` for LLMs.
#[derive(Args, Debug, Clone)]
pub struct LlmBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens of the prefill test (pp).
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Generated tokens of the decode test (tg).
    #[arg(long, default_value_t = 64)]
    pub gen: usize,
    /// Repetitions (median reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Whether `path` is an LLM artifact rather than a GGUF model (by extension, as [`load`]
/// decides).
fn is_llm_artifact(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "npuc")
}

/// Rejects `--precision` for artifacts and bundles: their numerics were fixed when they were
/// compiled.
pub fn check_precision(model: &Path, given: &Given) -> Result<()> {
    if npuc_llm::bundle::is_bundle(model) {
        given.reject(
            &["precision"],
            "a bundle's precision per part was fixed by its pipeline file (`npuc build`)",
        )?;
    }
    if is_llm_artifact(model) {
        given.reject(
            &["precision"],
            "an LLM artifact's precision was fixed by `npuc compile --precision`",
        )?;
    }
    if npuc_llm::bundle::is_bundle(model) || is_llm_artifact(model) {
        given.reject(
            &[
                "quantize_weights",
                "calib_text",
                "awq_alpha",
                "act_bits",
                "quantize_head",
                "weight_rounding",
                "export_encodings",
                "encodings",
            ],
            "an artifact's or bundle's weights were fixed when it was compiled; give the GGUF",
        )?;
    }
    Ok(())
}

/// Rejects the model flags the chosen model would ignore.
pub fn check_model_flags(m: &ModelArgs, given: &Given) -> Result<()> {
    check_precision(&m.model, given)
}

/// Sampling flags, by clap id.
pub const SAMPLING_FLAGS: &[&str] = &[
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
];

/// Rejects the `npuc generate` flags that the chosen mode would ignore.
pub fn check_generate_flags(a: &GenerateArgs, given: &Given) -> Result<()> {
    check_model_flags(&a.model, given)?;
    if a.prompt_tokens.is_some() {
        given.reject(
            &["chat", "no_bos"],
            "--prompt-tokens are used verbatim (no template, no BOS added)",
        )?;
    }
    if !a.chat {
        given.reject(
            &["chat_template"],
            "applies only with --chat (the prompt is used as given)",
        )?;
    }
    if a.logits_out.is_some() {
        let mut ids = SAMPLING_FLAGS.to_vec();
        ids.push("json");
        given.reject(
            &ids,
            "--logits-out writes the prompt's logits without sampling or generating",
        )?;
    }
    Ok(())
}

/// Loads the model (engine or bundle) and the tokenizer for `args.model`.
/// `file` tokenized with the GGUF `model`'s tokenizer (no special tokens).
fn calibration_tokens(model: &Path, file: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading the calibration text '{}'", file.display()))?;
    let g = npuc_gguf::GgufFile::open(model)
        .with_context(|| format!("loading '{}'", model.display()))?;
    let meta = npuc_llm::GgufMetaJson::filtered(&g.metadata, npuc_llm::engine::TOKENIZER_PREFIXES);
    let tok = Tokenizer::from_metadata_named(&model.display().to_string(), &meta.entries)?;
    let ids = tok.encode(&text, false)?;
    if ids.is_empty() {
        bail!("the calibration text '{}' is empty", file.display());
    }
    Ok(ids)
}

pub fn load(args: &ModelArgs) -> Result<(Model, Tokenizer)> {
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    let path = &args.model;
    if path.is_dir() {
        if !npuc_llm::bundle::is_bundle(path) {
            bail!(
                "'{}' is a directory without {} (a bundle is made by `npuc build PIPELINE.toml -o DIR`)",
                path.display(),
                npuc_llm::bundle::MANIFEST
            );
        }
        let mut ar = vec![];
        if let Some(v) = &args.variants {
            for v in Variant::parse_list(v)? {
                match v {
                    Variant::Ar(n) => ar.push(n),
                    Variant::Full => bail!("--variants full: bundles hold AR variants only"),
                }
            }
        }
        let bundle = Bundle::open(
            path,
            &BundleOptions {
                threads,
                ctx: args.ctx,
                ar,
            },
        )
        .with_context(|| format!("loading bundle '{}'", path.display()))?;
        let mut bundle = bundle;
        let meta = bundle.take_metadata();
        let tok = tokenizer_for(
            Tokenizer::from_metadata_named(&path.display().to_string(), &meta.entries),
            args,
            bundle.vocab(),
        )?;
        drop(meta);
        return Ok((Model::Bundle(bundle), tok));
    }
    let mut opts = EngineOptions {
        threads,
        ctx: args.ctx,
        precision: match args.precision {
            PrecisionArg::Fast => Precision::Fast,
            PrecisionArg::Parity => Precision::Parity,
            PrecisionArg::Exact => Precision::Exact,
        },
        weight_quant: WeightQuantOptions {
            scheme: match &args.quantize_weights {
                Some(s) => WeightQuant::parse(s)?,
                None => WeightQuant::Gguf,
            },
            calib_tokens: match &args.calib_text {
                Some(f) => calibration_tokens(path, f)?,
                None => vec![],
            },
            act_bits: args
                .act_bits
                .as_deref()
                .map(|b| if b == "8" { 8 } else { 16 }),
            head: args
                .quantize_head
                .as_deref()
                .map(WeightQuant::parse)
                .transpose()?,
            awq_alpha: match args.awq_alpha {
                Some(a) if !(0.0..=1.0).contains(&a) => {
                    bail!("--awq-alpha {a}: expected a value in [0, 1]")
                }
                a => a,
            },
            rounding: match args.weight_rounding.as_deref() {
                Some(r) => WeightRounding::parse(r)?,
                None => WeightRounding::Nearest,
            },
            ..Default::default()
        },
        ..Default::default()
    };
    if let Some(v) = &args.variants {
        opts.variants = Variant::parse_list(v)?;
    }
    let given_encodings = match &args.encodings {
        Some(f) => Some(read_llm_encodings(f, &mut opts.weight_quant)?),
        None => None,
    };
    if args.export_encodings.is_some() {
        if opts.weight_quant.scheme == WeightQuant::Gguf {
            bail!("--export-encodings: give --quantize-weights (or --encodings): the GGUF's own blocks have no AIMET encoding");
        }
        if opts.weight_quant.rounding == WeightRounding::Gptq {
            bail!("--export-encodings with --weight-rounding gptq: an encodings file records the grids, not GPTQ's rounding choices, so a converter reading it would round to nearest; drop one of them");
        }
        if opts.weight_quant.awq_alpha.is_some() {
            bail!("--export-encodings with --awq-alpha: AWQ-scaled weights have no encoding to export (the scales are not folded into the graph); drop one of them");
        }
    }
    if args.export_encodings.is_some() || given_encodings.is_some() {
        opts.weight_quant.record = Some(Default::default());
    }
    let is_artifact = is_llm_artifact(path);
    let mut engine = if is_artifact {
        Engine::from_artifact(path, &opts)
    } else {
        Engine::from_gguf(path, &opts)
    }
    .with_context(|| format!("loading '{}'", path.display()))?;
    // The tokenizer from the metadata the engine read (the GGUF's tokenizer keys, or the
    // artifact's copy of them), not from a second parse of the file; then only its own tables stay.
    if let Some(rec) = &opts.weight_quant.record {
        let mut made = rec
            .lock()
            .map(|r| r.clone())
            .map_err(|_| anyhow::anyhow!("the encodings recorder was poisoned"))?;
        if let Some((file, given)) = &given_encodings {
            let unused: Vec<&String> = given
                .weights
                .keys()
                .filter(|n| !made.weights.contains_key(*n))
                .chain(
                    given
                        .inputs
                        .keys()
                        .filter(|n| !made.inputs.contains_key(*n)),
                )
                .collect();
            if !unused.is_empty() {
                bail!(
                    "{}: {} entries name products this model does not quantize (e.g. '{}'); the encodings were made for another model",
                    file.display(),
                    unused.len(),
                    unused[0]
                );
            }
            made.quantizer_args = given.quantizer_args.clone();
        } else {
            made.quantizer_args = quantizer_args(&opts.weight_quant, args);
        }
        if let Some(out) = &args.export_encodings {
            let text = made.to_json()?;
            npuc_onnx::export::write_atomic(out, text.as_bytes())
                .with_context(|| format!("writing encodings '{}'", out.display()))?;
            eprintln!(
                "encodings: {} weights, {} inputs -> {}",
                made.weights.len(),
                made.inputs.len(),
                out.display()
            );
        }
    }
    let meta = engine.take_metadata();
    let tok = Tokenizer::from_metadata_named(&path.display().to_string(), &meta.entries);
    drop(meta);
    let tok = tokenizer_for(tok, args, engine.vocab())?;
    Ok((Model::Engine(engine), tok))
}

/// Reads `--encodings FILE` and sets the build's schemes from it (one scheme for the body, the
/// head's own when it differs, the activation bits).
fn read_llm_encodings(
    file: &Path,
    wq: &mut WeightQuantOptions,
) -> Result<(PathBuf, std::sync::Arc<LlmEncodings>)> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading encodings '{}'", file.display()))?;
    let enc = LlmEncodings::from_json(&text, &file.display().to_string())?;
    // The head is `output.weight`, or the tied embedding where the model has no separate head.
    let head = if enc.weights.contains_key("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    let (scheme, head_scheme, act_bits) = enc
        .schemes(head)
        .with_context(|| format!("encodings '{}'", file.display()))?;
    wq.scheme = scheme;
    wq.head = head_scheme;
    wq.act_bits = act_bits;
    let enc = std::sync::Arc::new(enc);
    wq.encodings = Some(enc.clone());
    Ok((file.to_path_buf(), enc))
}

/// The `quantizer_args` an exported encodings file records (informational: AIMET's keys for
/// the bit widths, npuc's for the scheme names and calibration).
fn quantizer_args(wq: &WeightQuantOptions, args: &ModelArgs) -> serde_json::Value {
    let bits = |s: WeightQuant| match s {
        WeightQuant::Lpbq { bits, .. } | WeightQuant::PerChannel { bits } => bits,
        WeightQuant::Gguf => 0,
    };
    let mut j = serde_json::json!({
        "dtype": "int",
        "is_symmetric": true,
        "param_bitwidth": bits(wq.scheme),
        "per_channel_quantization": true,
        "npuc_weights": wq.scheme.name(),
        "npuc_head": wq.head.unwrap_or(wq.scheme).name(),
    });
    if let Some(b) = wq.act_bits {
        j["activation_bitwidth"] = serde_json::json!(b);
    }
    if let Some(f) = &args.calib_text {
        j["npuc_calibration_text"] = serde_json::json!(f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default());
    }
    j
}

/// The tokenizer with `--chat-template` applied, checked against the model's vocabulary.
fn tokenizer_for(
    tok: npuc_tokenizer::Result<Tokenizer>,
    args: &ModelArgs,
    vocab: usize,
) -> Result<Tokenizer> {
    let path = &args.model;
    let mut tok = tok.with_context(|| format!("tokenizer of '{}'", path.display()))?;
    if let Some(t) = &args.chat_template {
        let text = if Path::new(t).is_file() {
            std::fs::read_to_string(t).with_context(|| format!("reading chat template '{t}'"))?
        } else {
            t.clone()
        };
        tok.set_chat_template(Some(text));
    }
    if tok.vocab_size() > vocab {
        bail!(
            "'{}': the tokenizer has {} tokens but the model's output has {vocab} logits",
            path.display(),
            tok.vocab_size(),
        );
    }
    Ok(tok)
}

/// What `npuc generate --json` prints about a generation.
pub fn json_out(out: &GenOutput, prompt: &[u32]) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": prompt,
        "tokens": out.tokens,
        "text": out.text,
        "prefill_tokens_per_s": out.prefill_tokens_per_s,
        "decode_tokens_per_s": out.decode_tokens_per_s,
        "stopped": out.stopped.as_str(),
    })
}

/// The prompt's token ids as `npuc generate` feeds them: `--prompt-tokens` verbatim, or
/// `--prompt` tokenized (wrapped in the chat template with `--chat`; BOS unless `--no-bos`).
pub fn prompt_ids(a: &GenerateArgs, tok: &Tokenizer) -> Result<Vec<u32>> {
    let prompt: Vec<u32> = match (&a.prompt, &a.prompt_tokens) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) if a.chat => {
            let t = Tok(tok);
            let rendered = t.render(&[ChatMessage::new("user", text.clone())], true)?;
            if a.no_bos {
                tok.encode(&rendered, false)?
            } else {
                t.encode(&rendered)?
            }
        }
        (Some(text), None) => tok.encode(text, !a.no_bos)?,
        (None, None) => bail!("give --prompt TEXT or --prompt-tokens IDS"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty (no tokens); give a non-empty --prompt or drop --no-bos");
    }
    Ok(prompt)
}

/// `npuc generate`: streams text to stdout, speeds to stderr (or one JSON object with `--json`).
pub fn generate_cmd(a: &GenerateArgs) -> Result<()> {
    let (mut engine, tok) = load(&a.model)?;
    let prompt = prompt_ids(a, &tok)?;
    // Prefix embeddings: fed first; the prompt's tokens continue after them.
    let prefix_rows = match &a.prefix_embeddings {
        Some(path) => prefix_embeddings(&mut engine, path)?,
        None => 0,
    };
    if let Some(path) = &a.logits_out {
        if a.max_tokens != 0 {
            bail!("--logits-out writes the prompt's last logits and needs --max-tokens 0");
        }
        let t0 = Instant::now();
        let logits = engine.forward(&prompt, false)?;
        let secs = t0.elapsed().as_secs_f64();
        let t = npuc_ir::Tensor::from_vec(vec![logits.len()], logits)?;
        let bytes = crate::npy::npy_bytes(&t).map_err(anyhow::Error::msg)?;
        npuc_onnx::export::write_atomic(path, &bytes)
            .with_context(|| format!("writing '{}'", path.display()))?;
        eprintln!(
            "prefill: {} tokens, {:.1} tokens/s; logits → {}",
            prompt.len(),
            prompt.len() as f64 / secs,
            path.display()
        );
        return Ok(());
    }
    let params = a.sampling.params();
    let lm = &mut engine;
    let stdout = std::io::stdout();
    let json = a.json;
    let mut on_text = |s: &str| {
        if !json {
            let mut o = stdout.lock();
            let _ = o.write_all(s.as_bytes());
            let _ = o.flush();
        }
    };
    let out = if prefix_rows > 0 {
        // The cache holds the prefix's positions; placeholders stand for them in the token
        // history (only the repetition penalties read it).
        let mut tokens = vec![0u32; prefix_rows];
        tokens.extend_from_slice(&prompt);
        generate_continue(
            &mut *lm,
            &Tok(&tok),
            &tokens,
            &params,
            a.max_tokens,
            &a.sampling.stop,
            &mut on_text,
        )?
    } else {
        generate(
            &mut *lm,
            &Tok(&tok),
            &prompt,
            &params,
            a.max_tokens,
            &a.sampling.stop,
            &mut on_text,
        )?
    };
    for w in &out.warnings {
        eprintln!("warning: {w}");
    }
    if json {
        println!("{}", json_out(&out, &prompt));
    } else {
        println!();
        eprintln!(
            "prefill: {} tokens, {:.1} tokens/s; decode: {} tokens, {:.1} tokens/s; stopped: {}",
            out.prompt_tokens,
            out.prefill_tokens_per_s,
            out.tokens.len(),
            out.decode_tokens_per_s,
            out.stopped.as_str()
        );
    }
    Ok(())
}

/// Feeds the embeddings in `path` to a bundle with an embedder; returns the number of rows.
fn prefix_embeddings(model: &mut Model, path: &Path) -> Result<usize> {
    let Model::Bundle(b) = model else {
        bail!("--prefix-embeddings needs a bundle built with split.embedder = true (npuc build), not a single model");
    };
    let t = crate::npy::read_npy(path)
        .with_context(|| format!("--prefix-embeddings '{}'", path.display()))?;
    let e = b.manifest().n_embd;
    let shape = t.shape().to_vec();
    let rows = match shape.as_slice() {
        [r, d] | [1, r, d] if *d == e => *r,
        _ => bail!(
            "--prefix-embeddings '{}': shape {shape:?}, expected [rows, {e}] or [1, rows, {e}] (n_embd of the bundle)",
            path.display()
        ),
    };
    if t.dtype() != npuc_ir::DType::F32 {
        bail!(
            "--prefix-embeddings '{}': {} values, expected float32",
            path.display(),
            t.dtype().name()
        );
    }
    if rows == 0 {
        bail!("--prefix-embeddings '{}' has no rows", path.display());
    }
    b.forward_embeddings(t.as_slice::<f32>()?, false)?;
    Ok(rows)
}

/// `npuc chat`: reads user messages from stdin, one per line; `/reset` clears, `/exit` quits.
pub fn chat_cmd(a: &ChatArgs) -> Result<()> {
    let (mut engine, tok) = load(&a.model)?;
    if tok.chat_template().is_none() {
        bail!(
            "'{}' has no chat template; give one with --chat-template",
            a.model.model.display()
        );
    }
    let params = a.sampling.params();
    let mut session = ChatSession::new(a.system.as_deref());
    let lm = &mut engine;
    let t = Tok(&tok);
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    eprintln!("chat: /reset clears the conversation, /exit quits");
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                session.reset(&mut *lm);
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        let mut on_text = |s: &str| {
            let mut o = stdout.lock();
            let _ = o.write_all(s.as_bytes());
            let _ = o.flush();
        };
        match session.turn(
            &mut *lm,
            &t,
            &t,
            line,
            &params,
            a.max_tokens,
            &a.sampling.stop,
            &mut on_text,
        ) {
            Ok(r) => {
                println!();
                eprintln!(
                    "[{} cached + {} new prompt tokens, {:.1} tokens/s prefill; {} tokens, {:.1} tokens/s decode]",
                    r.reused_tokens,
                    r.fed_tokens,
                    r.gen.prefill_tokens_per_s,
                    r.gen.tokens.len(),
                    r.gen.decode_tokens_per_s
                );
            }
            Err(e) => eprintln!("error: {e:#}"),
        }
    }
    Ok(())
}

/// `npuc perplexity`: llama.cpp's `llama-perplexity` method (see npuc_generate::perplexity).
pub fn perplexity_cmd(a: &PerplexityArgs) -> Result<()> {
    let n_ctx = a.model.ctx.unwrap_or(512);
    let mut margs = a.model.clone();
    margs.ctx = Some(n_ctx);
    // The reference first: a missing or malformed file is reported before minutes of work.
    let top1_ref = a.top1_ref.as_deref().map(read_top1_ref).transpose()?;
    let (mut engine, tok) = load(&margs)?;
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading '{}'", a.file.display()))?;
    let t0 = Instant::now();
    // llama.cpp: common_tokenize(text, add_special = true, parse_special = false)
    let tokens = tok.encode_with(&text, true, false)?;
    eprintln!(
        "perplexity: {} tokens ({:.2} s to tokenize), n_ctx {n_ctx}",
        tokens.len(),
        t0.elapsed().as_secs_f64()
    );
    let bos = if tok.add_bos() { tok.bos() } else { None };
    let t0 = Instant::now();
    let lm = &mut engine;
    let r = perplexity(&mut *lm, &tokens, n_ctx, bos, a.chunks, &mut |k, p| {
        eprint!("[{k}]{p:.4},");
        let _ = std::io::stderr().flush();
    })?;
    eprintln!();
    let secs = t0.elapsed().as_secs_f64();
    let n_chunks = r.chunk_ppl.len();
    let agreement = match (&top1_ref, &a.top1_ref) {
        (Some(want), Some(path)) => {
            if want.len() < r.top1.len() {
                bail!(
                    "{}: {} top-1 ids, but {n_chunks} chunks of {n_ctx} score {} positions (make it with the same text, --ctx and --chunks)",
                    path.display(),
                    want.len(),
                    r.top1.len()
                );
            }
            let same = r.top1.iter().zip(want).filter(|(a, b)| a == b).count();
            Some((same, r.top1.len()))
        }
        _ => None,
    };
    if a.json {
        let mut j = serde_json::json!({
            "ppl": r.ppl, "stderr": r.stderr, "ctx": n_ctx, "chunks": n_chunks, "scored_tokens": r.count,
            "chunk_ppl": r.chunk_ppl, "seconds": secs,
        });
        if let Some((same, total)) = agreement {
            j["top1_agree"] = serde_json::json!(same);
            j["top1_positions"] = serde_json::json!(total);
        }
        println!("{j}");
    } else {
        println!("{}", r.final_line());
        if let Some((same, total)) = agreement {
            println!(
                "top-1 agreement with the reference: {same}/{total} ({:.2}%)",
                100.0 * same as f64 / total.max(1) as f64
            );
        }
        eprintln!(
            "{n_chunks} chunks in {secs:.1} s ({:.1} tokens/s)",
            (n_chunks * n_ctx) as f64 / secs
        );
    }
    Ok(())
}

/// A 1-D integer `.npy` of token ids (`--top1-ref`).
fn read_top1_ref(path: &Path) -> Result<Vec<u32>> {
    let t = crate::npy::read_npy(path)?;
    if t.shape().len() != 1 {
        bail!(
            "{}: top-1 ids must be a 1-D array, got shape {:?}",
            path.display(),
            t.shape()
        );
    }
    let vals = t
        .to_f64_vec()
        .with_context(|| format!("{}: top-1 ids", path.display()))?;
    vals.iter()
        .enumerate()
        .map(|(i, &v)| {
            if v < 0.0 || v.fract() != 0.0 || v > u32::MAX as f64 {
                bail!("{}: entry {i} ({v}) is not a token id", path.display());
            }
            Ok(v as u32)
        })
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `npuc bench` for LLMs: prefill (pp) and decode (tg) tokens/s like llama-bench, and peak RSS.
pub fn bench_cmd(a: &LlmBenchArgs) -> Result<()> {
    if a.runs == 0 || a.prompt_len == 0 {
        bail!("--runs and --prompt-len must be at least 1");
    }
    // Like llama-bench, the KV cache holds the prompt and the generated tokens (at least the
    // largest AR variant) unless --ctx says otherwise; artifacts keep their compiled context,
    // bundles pick among theirs per call.
    let mut margs = a.model.clone();
    if margs.ctx.is_none() && !is_llm_artifact(&margs.model) && !margs.model.is_dir() {
        let largest = match &margs.variants {
            Some(v) => Variant::parse_list(v)?
                .iter()
                .filter_map(|v| match v {
                    Variant::Ar(n) => Some(*n),
                    _ => None,
                })
                .max()
                .unwrap_or(1),
            None => 128,
        };
        margs.ctx = Some((a.prompt_len + a.gen).max(largest));
    }
    let t0 = Instant::now();
    let (mut engine, tok) = load(&margs)?;
    let load_s = t0.elapsed().as_secs_f64();
    let vocab = tok.vocab_size().min(engine.vocab()) as u64;
    // Deterministic pseudo-random tokens (llama-bench also uses random tokens), BOS first if the model adds it.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % vocab) as u32
    };
    let mut prompt: Vec<u32> = (0..a.prompt_len).map(|_| next()).collect();
    if let (true, Some(b)) = (tok.add_bos(), tok.bos()) {
        prompt[0] = b;
    }
    let gen_tokens: Vec<u32> = (0..a.gen).map(|_| next()).collect();
    let weight_bytes = engine.decode_weight_bytes();
    let lm = &mut engine;
    if a.prompt_len + a.gen > lm.ctx() {
        bail!(
            "--prompt-len {} + --gen {} exceed the context of {}; raise --ctx",
            a.prompt_len,
            a.gen,
            lm.ctx()
        );
    }
    // warm-up (first-touch of weights, thread pool start)
    lm.reset();
    lm.forward(&prompt[..prompt.len().min(8)], false)?;
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..a.runs {
        lm.reset();
        let t = Instant::now();
        lm.forward(&prompt, false)?;
        pp.push(a.prompt_len as f64 / t.elapsed().as_secs_f64());
        if a.gen > 0 {
            lm.reset();
            lm.forward(&prompt[..1], false)?;
            let t = Instant::now();
            for &g in &gen_tokens {
                lm.forward(&[g], false)?;
            }
            tg.push(a.gen as f64 / t.elapsed().as_secs_f64());
        }
    }
    let pp = median(&mut pp);
    let tg = if tg.is_empty() { 0.0 } else { median(&mut tg) };
    let rss = crate::bench::peak_rss_bytes();
    // Decode is bound by reading the weights once per token: the roofline is read bandwidth
    // (measured now, with the same threads) / weight bytes per token.
    let bw = if a.gen > 0 {
        crate::bench::read_bandwidth(
            a.model
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        )
    } else {
        None
    };
    let roofline = bw.map(|b| b / weight_bytes.max(1) as f64);
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": a.model.model.display().to_string(), "threads": a.model.threads, "load_s": load_s,
                "prompt_len": a.prompt_len, "gen": a.gen, "runs": a.runs,
                "prefill_tokens_per_s": pp, "decode_tokens_per_s": tg, "peak_rss_bytes": rss,
                "weight_bytes_per_token": weight_bytes, "read_bandwidth_bytes_per_s": bw,
                "decode_roofline_tokens_per_s": roofline,
                "roofline_share": roofline.map(|r| tg / r),
            })
        );
    } else {
        println!("load: {load_s:.2} s");
        println!("pp{}: {pp:.1} tokens/s", a.prompt_len);
        if a.gen > 0 {
            println!("tg{}: {tg:.1} tokens/s", a.gen);
            match (bw, roofline) {
                (Some(b), Some(r)) => println!(
                    "decode reads {:.1} MB of weights per token; read bandwidth {:.1} GB/s: roofline {r:.1} tokens/s, {:.0}% reached",
                    weight_bytes as f64 / 1e6,
                    b / 1e9,
                    100.0 * tg / r
                ),
                _ => println!(
                    "decode reads {:.1} MB of weights per token",
                    weight_bytes as f64 / 1e6
                ),
            }
        }
        if let Some(r) = rss {
            println!("peak RSS: {:.1} MB", r as f64 / 1e6);
        }
    }
    Ok(())
}
