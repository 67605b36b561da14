//! `npuc compile`: ONNX models, one ONNX model with `--quantize`, or one `.gguf` LLM into a
//! `.npuc` artifact. Parses the flags, rejects those the chosen mode would ignore, calls the
//! driver and prints its summary.

use crate::flags::Given;
use crate::progress::TermProgress;
use anyhow::{anyhow, bail, Result};
use npuc_driver::compile::{parse_bindings, CompileOptions};
use npuc_driver::llm::LlmCompileOptions;
use npuc_driver::quantize::{QuantizeArgs, CALIBRATION_FLAGS, IMAGE_FLAGS};
use npuc_driver::Progress;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, clap::Args)]
pub struct CompileArgs {
    /// Models (ONNX); each becomes a graph named after its file stem, or use --name.
    pub models: Vec<PathBuf>,
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// `GRAPH=MODEL`: add MODEL under the graph name GRAPH (repeatable).
    #[arg(long = "name", value_name = "GRAPH=MODEL")]
    pub named: Vec<String>,
    #[arg(long = "input-shape", value_name = "NAME=SHAPE")]
    pub input_shape: Vec<String>,
    #[arg(long = "dim", value_name = "SYM=N")]
    pub dim: Vec<String>,
    /// Target descriptor: cpu-x86_64, cpu-x86_64-avx2, cpu-aarch64 (default: this machine).
    #[arg(long)]
    pub target: Option<String>,
    /// Skip graph optimizations.
    #[arg(long = "no-optimize")]
    pub no_optimize: bool,
    /// Print what each optimization pass changed.
    #[arg(long = "print-passes")]
    pub print_passes: bool,
    /// Skip an optimization pass by name (repeatable).
    #[arg(long = "disable-pass", value_name = "PASS")]
    pub disable_pass: Vec<String>,
    /// Run an opt-in optimization pass (repeatable): attention-fusion.
    #[arg(long = "enable-pass", value_name = "PASS")]
    pub enable_pass: Vec<String>,
    /// GGUF input: graph variants, e.g. ar1,ar32,ar128,full.
    #[arg(long, default_value = "ar1,ar32,ar128")]
    pub variants: String,
    /// GGUF input: context length (KV cache slots); default: the model's, at most 4096.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// GGUF input: fast (llama.cpp numerics, f16 KV) or exact (f32).
    #[arg(long, default_value = "fast")]
    pub precision: String,
    #[command(flatten)]
    pub quant: QuantizeArgs,
}

/// Flags of the ONNX pipeline (bindings, passes, graph names), by clap id.
const ONNX_FLAGS: &[&str] = &[
    "named",
    "input_shape",
    "dim",
    "no_optimize",
    "print_passes",
    "disable_pass",
    "enable_pass",
];
/// Flags of the GGUF pipeline, by clap id.
const GGUF_FLAGS: &[&str] = &["variants", "ctx", "precision"];
/// Flags that configure optimization, by clap id.
const PASS_FLAGS: &[&str] = &["print_passes", "disable_pass", "enable_pass"];

/// Every quantization flag (`--quantize` and the flags it enables), by clap id.
fn quant_flags() -> Vec<&'static str> {
    let mut v = vec![
        "scheme",
        "encodings",
        "emit_qdq",
        "emit_encodings",
        "encodings_version",
    ];
    v.extend(CALIBRATION_FLAGS);
    v
}

/// What `npuc compile` made: the driver's summary for the mode chosen.
#[derive(Debug)]
pub enum Compiled {
    /// ONNX models into one artifact.
    Graphs(npuc_driver::CompileSummary),
    /// One ONNX model quantized (its graph name and the quantizer's summary).
    Quantized {
        name: String,
        summary: npuc_driver::quantize::QuantSummary,
    },
    /// A `.gguf` LLM, one graph per variant.
    Gguf(npuc_driver::CompileSummary),
}

impl Compiled {
    /// The lines `npuc compile` prints (the last one is the summary line); `print_passes` adds
    /// what each optimization pass changed.
    pub fn lines(&self, output: &Path, print_passes: bool) -> Vec<String> {
        let mut out = vec![];
        match self {
            Compiled::Graphs(s) => {
                for g in &s.graphs {
                    if print_passes {
                        out.push(format!("[{}] passes:", g.name));
                        out.extend(g.pass_records.iter().map(|r| format!("  {r}")));
                    }
                    out.push(format!(
                        "graph {:<20} nodes {} -> {}, arena {:.2} MB",
                        g.name,
                        g.nodes_before,
                        g.nodes_after,
                        g.arena_bytes as f64 / 1e6
                    ));
                }
                out.push(s.line(output));
            }
            Compiled::Quantized { name, summary: s } => {
                if print_passes {
                    out.push(format!("[{name}] passes:"));
                    out.extend(s.pass_records.iter().map(|r| format!("  {r}")));
                }
                out.push(format!(
                    "quantized {} activations + {} params, scheme {}, method {}, {} samples; wrote {} ({:.2} MB) in {:.2} s",
                    s.activations,
                    s.params,
                    s.scheme,
                    s.method,
                    s.samples,
                    output.display(),
                    s.file_bytes as f64 / 1e6,
                    s.seconds
                ));
            }
            Compiled::Gguf(s) => {
                for g in &s.graphs {
                    out.push(format!("graph {:<8} nodes {}", g.name, g.nodes_after));
                }
                out.push(format!(
                    "compiled {} graphs into {} ({:.2} MB): weights {:.2} MB unique / {:.2} MB referenced, {:.2} s",
                    s.graphs.len(),
                    output.display(),
                    s.file_bytes as f64 / 1e6,
                    s.weight_bytes_unique as f64 / 1e6,
                    s.weight_bytes_referenced as f64 / 1e6,
                    s.seconds
                ));
            }
        }
        out
    }
}

/// Runs `npuc compile` and prints its summary; `given` says which flags were given on the
/// command line.
pub fn cmd(a: &CompileArgs, given: &Given) -> Result<()> {
    let bar = a.quant.scheme.is_some() && !a.quant.no_progress;
    let c = compile(a, given, &mut TermProgress::new(bar))?;
    for l in c.lines(&a.output, a.print_passes) {
        println!("{l}");
    }
    Ok(())
}

/// `npuc compile` without printing (the Python package's `npuc.compile` runs this too): checks
/// the flags against the mode (ONNX, quantized ONNX, GGUF), runs the driver's pipeline and
/// returns its summary.
pub fn compile(a: &CompileArgs, given: &Given, progress: &mut dyn Progress) -> Result<Compiled> {
    let gguf = a.models.iter().any(|m| npuc_driver::llm::is_gguf(m));
    if gguf {
        if a.models.len() != 1 {
            bail!(
                "a .gguf model compiles on its own into its artifact ({} models given)",
                a.models.len()
            );
        }
        let mut ids: Vec<&str> = ONNX_FLAGS.to_vec();
        ids.extend(quant_flags());
        given.reject(
            &ids,
            "not supported when compiling a .gguf model (it takes --variants, --ctx, --precision and --target)",
        )?;
        let opts = LlmCompileOptions {
            variants: npuc_llm::Variant::parse_list(&a.variants)?,
            ctx: a.ctx,
            precision: npuc_llm::Precision::parse(&a.precision)?,
            target: a.target.clone(),
        };
        let s = npuc_driver::llm::compile_gguf(&a.models[0], &opts, &a.output, progress)?;
        return Ok(Compiled::Gguf(s));
    }
    given.reject(GGUF_FLAGS, "applies to .gguf models only")?;
    if a.no_optimize {
        given.reject(PASS_FLAGS, "no optimization passes run with --no-optimize")?;
    }
    let list = graph_list(&a.models, &a.named)?;
    let (input_shapes, dims) = parse_bindings(&a.input_shape, &a.dim)?;
    let opts = CompileOptions {
        input_shapes,
        dims,
        target: a.target.clone(),
        optimize: !a.no_optimize,
        disable_passes: a.disable_pass.clone(),
        enable_passes: a.enable_pass.clone(),
    };
    if a.quant.scheme.is_some() {
        check_quant_flags(&a.quant, given)?;
        if list.len() != 1 {
            bail!(
                "--quantize takes exactly one model ({} given); quantize each model separately",
                list.len()
            );
        }
        let (name, path) = &list[0];
        let summary = npuc_driver::quantize::compile_quantized(
            name, path, &opts, &a.quant, &a.output, progress,
        )?;
        return Ok(Compiled::Quantized {
            name: name.clone(),
            summary,
        });
    }
    given.reject(&quant_flags(), "applies only with --quantize")?;
    if list.is_empty() {
        bail!("no models given: npuc compile MODEL.onnx -o OUT.npuc");
    }
    Ok(Compiled::Graphs(npuc_driver::compile(
        &list, &opts, &a.output, progress,
    )?))
}

/// `(graph name, model)`: each model under its file stem, then the `--name GRAPH=MODEL` ones.
fn graph_list(models: &[PathBuf], named: &[String]) -> Result<Vec<(String, PathBuf)>> {
    let mut list: Vec<(String, PathBuf)> = models
        .iter()
        .map(|m| {
            (
                m.file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "graph".into()),
                m.clone(),
            )
        })
        .collect();
    for n in named {
        let (g, p) = n
            .split_once('=')
            .ok_or_else(|| anyhow!("--name expects GRAPH=MODEL, got '{n}'"))?;
        list.push((g.to_string(), PathBuf::from(p)));
    }
    Ok(list)
}

/// Rejects quantization flags that the chosen quantization would ignore.
fn check_quant_flags(q: &QuantizeArgs, given: &Given) -> Result<()> {
    if q.encodings.is_some() {
        given.reject(
            CALIBRATION_FLAGS,
            "calibration flags have no effect with --encodings (the encodings give every range)",
        )?;
    }
    if q.image_size.is_none() {
        given.reject(
            IMAGE_FLAGS,
            "image preprocessing applies only with --image-size",
        )?;
    }
    if q.emit_encodings.is_none() {
        given.reject(&["encodings_version"], "applies only with --emit-encodings")?;
    }
    if q.calib_method != "percentile" {
        given.reject(
            &["percentile"],
            "applies only with --calib-method percentile",
        )?;
    }
    if q.granularity != "per-block" && q.granularity != "lpbq" {
        given.reject(
            &["block_size"],
            "applies only with --granularity per-block or lpbq",
        )?;
    }
    if q.granularity != "lpbq" {
        given.reject(&["compressed_bw"], "applies only with --granularity lpbq")?;
    }
    Ok(())
}
