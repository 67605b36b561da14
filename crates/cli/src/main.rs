//! `npuc`: inspect, run and (soon) compile models. Argument parsing and output formatting only;
//! the work happens in the library crates.

#![forbid(unsafe_code)]

use anyhow::{anyhow, bail, Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use npuc_cli::flags::Given;
use npuc_cli::{npy, ocr};
use npuc_driver::compile::{bind_inputs, parse_bindings};
use npuc_driver::OpenOptions;
use npuc_ir::{Attr, DType, Dim, Model, Tensor, TypeInfo};
use npuc_runtime::{registry, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Large buffers start on a cache line, so the AVX-512 kernels' vector loads never straddle two
/// (see `npuc_runtime::kernels::align_alloc`).
#[global_allocator]
static ALLOC: npuc_runtime::kernels::align_alloc::CacheAligned =
    npuc_runtime::kernels::align_alloc::CacheAligned;

#[derive(Parser)]
#[command(
    name = "npuc",
    version,
    about = "Compile, inspect and run ONNX models on CPU"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Memory budget for any one tensor or loop output whose size comes from the model, a flag or
    /// shape arithmetic, e.g. `8G` (default: the memory available): larger ones are refused,
    /// naming the node and the size, before anything is allocated
    #[arg(long = "max-memory", global = true, value_name = "SIZE")]
    max_memory: Option<String>,
    /// Open `.npuc` artifacts without checking their weights' checksums (faster load of large
    /// artifacts; a corrupt file then gives wrong outputs instead of an error)
    #[arg(long, global = true)]
    trust: bool,
}

#[derive(Subcommand)]
// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
enum Cmd {
    /// Show a model's inputs/outputs, ops, parameters and which nodes npuc supports.
    Inspect {
        model: PathBuf,
        #[arg(long)]
        json: bool,
        /// Bind an input's shape, e.g. `x=1x3x224x224` (repeatable).
        #[arg(long = "input-shape", value_name = "NAME=SHAPE")]
        input_shape: Vec<String>,
        /// Bind a symbolic dimension, e.g. `batch=1` (repeatable).
        #[arg(long = "dim", value_name = "SYM=N")]
        dim: Vec<String>,
        /// For artifacts: also verify every weight checksum.
        #[arg(long)]
        verify: bool,
    },
    /// Run a model on inputs from .npy or TensorProto .pb files; write outputs as .npy.
    /// A component bundle's vision component: `npuc run BUNDLE --component NAME --image IMG`.
    Run {
        model: PathBuf,
        /// `NAME=FILE` (repeatable); FILE is .npy or an ONNX TensorProto .pb.
        #[arg(long = "input", short = 'i', value_name = "NAME=FILE")]
        inputs: Vec<String>,
        /// Where outputs go as `NAME.npy`; with `--component`, a `.npy` path names the file of
        /// a component's single output.
        #[arg(long = "output-dir", short = 'o')]
        output_dir: Option<PathBuf>,
        /// A component of a component bundle (built from a pipeline with `[components]`).
        #[arg(long, value_name = "NAME", requires = "image")]
        component: Option<String>,
        /// With `--component`: the image, preprocessed as the bundle's manifest records.
        #[arg(long, value_name = "IMG", requires = "component")]
        image: Option<PathBuf>,
        #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        threads: usize,
        /// Graph of an artifact to run.
        #[arg(long)]
        graph: Option<String>,
        /// Quantized models: run the QDQ graph in float with quantize-dequantize at every
        /// quantized tensor (QuantSim) instead of the integer kernels.
        #[arg(long)]
        simulate: bool,
        /// Float ONNX models: run the graph as imported, without `npuc compile`'s optimizer
        /// (which runs by default, as onnxruntime optimizes at session creation).
        #[arg(long)]
        no_optimize: bool,
    },
    /// Compile models into one pre-compiled, weight-shared, mmap-able .npuc artifact.
    Compile(npuc_cli::compile_cmd::CompileArgs),
    /// Time loading and running a model or artifact.
    Bench {
        model: PathBuf,
        #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        threads: usize,
        #[arg(long, default_value_t = 10)]
        runs: usize,
        #[arg(long)]
        json: bool,
        /// Quantized models: QuantSim (float math with quantize-dequantize) instead of the
        /// integer kernels.
        #[arg(long)]
        simulate: bool,
        /// Float ONNX models: run the graph as imported, without `npuc compile`'s optimizer
        /// (which runs by default, as onnxruntime optimizes at session creation).
        #[arg(long)]
        no_optimize: bool,
        /// Time every node over `--runs` extra runs and print the time per op type and the
        /// slowest nodes (with `--json`: a `profile` object).
        #[arg(long)]
        profile: bool,
        /// Write a Chrome trace (trace-event JSON; open it in Perfetto or chrome://tracing) of
        /// one more run: a span per node with its op and output shapes.
        #[arg(long, value_name = "FILE")]
        trace: Option<PathBuf>,
        /// Graph of an artifact to run.
        #[arg(long)]
        graph: Option<String>,
        /// `NAME=FILE` inputs; inputs not given are filled with deterministic pseudo-random data.
        #[arg(long = "input", short = 'i', value_name = "NAME=FILE")]
        inputs: Vec<String>,
        #[arg(long = "input-shape", value_name = "NAME=SHAPE")]
        input_shape: Vec<String>,
        #[arg(long = "dim", value_name = "SYM=N")]
        dim: Vec<String>,
        /// LLMs (`.gguf`, or `.npuc` with this flag): prompt tokens of the prefill test.
        #[arg(long)]
        prompt_len: Option<usize>,
        /// LLMs: generated tokens of the decode test.
        #[arg(long, default_value_t = 64)]
        gen: usize,
        /// LLMs: context length.
        #[arg(long)]
        ctx: Option<usize>,
        /// LLMs: `fast` (default), `parity` (llama.cpp's arithmetic) or `exact` (f32).
        #[arg(long, value_enum, default_value = "fast")]
        precision: npuc_cli::llm_cmd::PrecisionArg,
        /// LLMs: graph variants, e.g. `ar1,ar32`.
        #[arg(long)]
        variants: Option<String>,
    },
    /// Build an LLM bundle from a pipeline file (TOML): split parts, graphs per AR x context,
    /// cached steps (a second run does nothing).
    Build(npuc_cli::build_cmd::BuildArgs),
    /// Export a GGUF decoder as a standard ONNX decoder (input_ids, attention_mask,
    /// position_ids, past_key_values.* -> logits, present.*), as transformers/Optimum exports
    /// are laid out; onnxruntime runs it; `npuc build` takes it back as an LLM source.
    Export {
        model: PathBuf,
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
        /// Weight storage: f32, or f16 (half the file; widened to f32 by Cast nodes).
        #[arg(long, default_value = "f32")]
        dtype: String,
    },
    /// Generate text with an LLM (`.gguf`, LLM `.npuc` or a bundle directory from `npuc
    /// build`): streams to stdout, speeds to stderr.
    Generate(npuc_cli::llm_cmd::GenerateArgs),
    /// Interactive chat with an LLM; keeps the KV cache between turns (`/reset`, `/exit`).
    Chat(npuc_cli::llm_cmd::ChatArgs),
    /// Perplexity of a text file, llama.cpp's `llama-perplexity` method.
    Perplexity(npuc_cli::llm_cmd::PerplexityArgs),
    /// Serve an LLM over HTTP with an OpenAI-compatible API (`/v1/chat/completions`,
    /// `/v1/completions`, `/v1/models`, `/health`, `/metrics`).
    Serve(npuc_cli::serve_cmd::ServeArgs),
    /// List supported ops with their opset ranges.
    Ops {
        #[arg(long)]
        json: bool,
    },
    /// Recognise a line of text in a PNG image with a PaddleOCR recogniser model.
    Ocr {
        image: PathBuf,
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        threads: usize,
        /// Timed repetitions of the inference (median reported).
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
    /// Per-layer accuracy of a quantized model against its float reference (SQNR, cosine, max
    /// abs error), an HTML report, and which tensors to keep at 16 bits.
    Verify(npuc_cli::verify::VerifyArgs),
}

fn export_cmd(model: &std::path::Path, out: &std::path::Path, dtype: &str) -> anyhow::Result<()> {
    if !npuc_driver::llm::is_gguf(model) {
        anyhow::bail!(
            "{}: `npuc export` takes a GGUF decoder (llama, qwen2, gemma3)",
            model.display()
        );
    }
    let dtype = npuc_llm::interop::WeightDtype::parse(dtype)?;
    let s = npuc_driver::llm::export_onnx(model, out, dtype, npuc_driver::llm::ONNX_INLINE_LIMIT)?;
    println!(
        "wrote {} ({} nodes, {} initializers, {:.1} MB of weights{}) in {:.1} s",
        out.display(),
        s.nodes,
        s.initializers,
        s.weight_bytes as f64 / 1e6,
        s.external_data
            .as_ref()
            .map(|p| format!(", external data in {}", p.display()))
            .unwrap_or_default(),
        s.seconds
    );
    Ok(())
}

fn main() {
    // `npuc bench` measures read bandwidth in a child process of its own (so the probe's buffer
    // never counts in the benchmark's peak RSS): see `npuc_cli::bench::read_bandwidth`.
    if let Some(t) = std::env::var_os(npuc_cli::bench::BANDWIDTH_PROBE_ENV) {
        let threads = t.to_str().and_then(|s| s.parse().ok()).unwrap_or(1);
        println!("{}", npuc_cli::bench::bandwidth_probe(threads));
        return;
    }
    let command = Cli::command();
    let matches = command.clone().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let (sub_name, sub_matches) = matches.subcommand().expect("clap requires a subcommand");
    let sub_cmd = command
        .find_subcommand(sub_name)
        .expect("the parsed subcommand is defined");
    let given = Given {
        cmd: sub_cmd,
        matches: sub_matches,
    };
    npuc_cli::register_ops();
    if let Some(m) = &cli.max_memory {
        match npuc_runtime::limits::parse_bytes(m) {
            Ok(b) => npuc_runtime::limits::set_max_memory(Some(b)),
            Err(e) => {
                eprintln!("error: --max-memory: {e}");
                std::process::exit(2);
            }
        }
    }
    if cli.trust {
        npuc_format::set_verify_weights_on_open(false);
    }
    let r = match cli.cmd {
        Cmd::Inspect {
            model,
            json,
            input_shape,
            dim,
            verify,
        } => {
            let r = if npuc_llm::bundle::is_bundle(&model) {
                given
                    .reject(
                        &["input_shape", "dim"],
                        "a bundle's shapes were fixed by its pipeline file",
                    )
                    .and_then(|_| npuc_cli::build_cmd::inspect_bundle(&model, json, verify))
            } else if npuc_driver::session::is_artifact(&model) {
                given
                    .reject(
                        &["input_shape", "dim"],
                        "an artifact's input shapes were bound when it was compiled",
                    )
                    .and_then(|_| npuc_cli::artifact::inspect(&model, json, verify))
            } else if npuc_driver::llm::is_gguf(&model) {
                given
                    .reject(
                        &["input_shape", "dim", "verify"],
                        "not supported when inspecting a .gguf model",
                    )
                    .and_then(|_| npuc_cli::gguf_inspect::inspect(&model, json))
            } else {
                given
                    .reject(&["verify"], "checks the weights of .npuc artifacts only")
                    .and_then(|_| inspect(&model, json, &input_shape, &dim))
            };
            r.and_then(|_| {
                // Quantized-tensor report: ONNX models and artifacts only.
                if json || npuc_driver::llm::is_gguf(&model) || npuc_llm::bundle::is_bundle(&model)
                {
                    Ok(())
                } else {
                    print_quant_report(&model)
                }
            })
        }
        Cmd::Run {
            model,
            output_dir,
            threads,
            component: Some(component),
            image: Some(image),
            ..
        } => given
            .reject(
                &["inputs", "graph", "simulate", "no_optimize"],
                "--component runs the component's artifact on --image (its input comes from the image)",
            )
            .and_then(|_| {
                run_component(&model, &component, &image, output_dir.as_deref(), threads)
            }),
        Cmd::Run {
            model,
            inputs,
            output_dir,
            threads,
            graph,
            simulate,
            no_optimize,
            ..
        } => run(
            &model,
            graph.as_deref(),
            &inputs,
            output_dir.as_deref(),
            threads,
            simulate,
            !no_optimize,
        ),
        Cmd::Compile(a) => npuc_cli::compile_cmd::cmd(&a, &given),
        Cmd::Bench {
            model,
            threads,
            runs,
            json,
            prompt_len,
            gen,
            ctx,
            precision,
            variants,
            ..
        } if prompt_len.is_some()
            || model.extension().is_some_and(|e| e == "gguf")
            || npuc_llm::bundle::is_bundle(&model) =>
        {
            given
                .reject(
                    &[
                        "graph",
                        "inputs",
                        "input_shape",
                        "dim",
                        "simulate",
                        "profile",
                        "trace",
                        "no_optimize",
                    ],
                    "not supported when benchmarking an LLM (.gguf, or --prompt-len)",
                )
                .and_then(|_| npuc_cli::llm_cmd::check_precision(&model, &given))
                .and_then(|_| {
                    npuc_cli::llm_cmd::bench_cmd(&npuc_cli::llm_cmd::LlmBenchArgs {
                        model: npuc_cli::llm_cmd::ModelArgs {
                            model,
                            threads: Some(threads),
                            ctx,
                            precision,
                            chat_template: None,
                            variants,
                            quantize_weights: None,
                            calib_text: None,
                            awq_alpha: None,
                            act_bits: None,
                            quantize_head: None,
                            weight_rounding: None,
                            export_encodings: None,
                            encodings: None,
                        },
                        prompt_len: prompt_len.unwrap_or(128),
                        gen,
                        runs: runs.min(10),
                        json,
                    })
                })
        }
        Cmd::Bench {
            model,
            threads,
            runs,
            json,
            graph,
            inputs,
            input_shape,
            dim,
            simulate,
            profile,
            trace,
            no_optimize,
            ..
        } => given
            .reject(
                &["gen", "ctx", "precision", "variants"],
                "applies to LLMs only (.gguf, or an LLM .npuc with --prompt-len)",
            )
            .and_then(|_| {
                npuc_cli::bench::bench(
                    &model,
                    graph.as_deref(),
                    &inputs,
                    &input_shape,
                    &dim,
                    threads,
                    runs,
                    json,
                    simulate,
                    profile,
                    trace.as_deref(),
                    !no_optimize,
                )
            }),
        Cmd::Build(a) => npuc_cli::build_cmd::cmd(&a),
        Cmd::Export {
            model,
            output,
            dtype,
        } => export_cmd(&model, &output, &dtype),
        Cmd::Generate(a) => npuc_cli::llm_cmd::check_generate_flags(&a, &given)
            .and_then(|_| npuc_cli::llm_cmd::generate_cmd(&a)),
        Cmd::Chat(a) => npuc_cli::llm_cmd::check_model_flags(&a.model, &given)
            .and_then(|_| npuc_cli::llm_cmd::chat_cmd(&a)),
        Cmd::Serve(a) => npuc_cli::llm_cmd::check_model_flags(&a.model, &given)
            .and_then(|_| npuc_cli::serve_cmd::serve_cmd(&a)),
        Cmd::Perplexity(a) => npuc_cli::llm_cmd::check_model_flags(&a.model, &given)
            .and_then(|_| {
                given.reject(
                    &["chat_template"],
                    "perplexity scores the text as given, without a chat template",
                )
            })
            .and_then(|_| npuc_cli::llm_cmd::perplexity_cmd(&a)),
        Cmd::Ops { json } => ops(json),
        Cmd::Ocr {
            image,
            model,
            threads,
            runs,
        } => ocr_cmd(&image, &model, threads, runs),
        Cmd::Verify(a) => {
            let r = if a.suggest {
                Ok(())
            } else {
                given.reject(
                    &[
                        "target_sqnr",
                        "headroom",
                        "prune_evals",
                        "sensitivity_evals",
                    ],
                    "applies only with --suggest",
                )
            };
            r.and_then(|_| npuc_cli::verify::cmd(&a))
        }
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn load(path: &Path) -> Result<Model> {
    Ok(npuc_onnx::load_model(path)?)
}

fn op_key(domain: &str, op: &str) -> String {
    if domain.is_empty() {
        op.to_string()
    } else {
        format!("{domain}::{op}")
    }
}

fn describe(ty: &Option<TypeInfo>) -> String {
    ty.as_ref()
        .map(|t| t.describe())
        .unwrap_or_else(|| "?".into())
}

fn inspect(path: &Path, json: bool, input_shape: &[String], dim: &[String]) -> Result<()> {
    let mut m = load(path)?;
    let (shapes, dims) = parse_bindings(input_shape, dim)?;
    bind_inputs(&mut m, &shapes, &dims)?;
    let reg = registry();
    let mut hist: BTreeMap<String, usize> = BTreeMap::new();
    let mut unsupported: Vec<(String, String)> = vec![];
    let mut n_nodes = 0usize;
    fn walk(g: &npuc_ir::Graph, f: &mut dyn FnMut(&npuc_ir::Node)) {
        for n in &g.nodes {
            f(n);
            for (_, a) in &n.attrs {
                for sg in npuc_ir::subgraphs(a) {
                    walk(sg, f);
                }
            }
        }
    }
    let opset_of = |d: &str| m.opset(d).unwrap_or(1);
    walk(&m.graph, &mut |n| {
        n_nodes += 1;
        *hist.entry(op_key(&n.domain, &n.op_type)).or_default() += 1;
        let is_fn = m.functions.iter().any(|f| f.name == n.op_type);
        if !is_fn
            && reg
                .find(&n.domain, &n.op_type, opset_of(&n.domain))
                .is_none()
        {
            unsupported.push((n.display_name(), op_key(&n.domain, &n.op_type)));
        }
    });
    let mut params = 0usize;
    let mut bytes = 0usize;
    for i in &m.graph.initializers {
        params += i.tensor.len();
        bytes += i.tensor.len() * i.tensor.dtype().size().max(1);
    }
    // Constant nodes hold weights too (PP-LCNet stores them that way).
    walk(&m.graph, &mut |n| {
        if n.op_type == "Constant" {
            if let Some(Attr::Tensor(t)) = n.attr("value") {
                params += t.len();
                bytes += t.len() * t.dtype().size().max(1);
            }
        }
    });
    // Output shapes by static inference (declared output shapes are often wrong, so they are
    // never reported as fact).
    let inits: std::collections::HashSet<&str> = m
        .graph
        .initializers
        .iter()
        .map(|i| i.name.as_str())
        .collect();
    let real_inputs: Vec<&npuc_ir::ValueInfo> = m
        .graph
        .inputs
        .iter()
        .filter(|i| !inits.contains(i.name.as_str()))
        .collect();
    let r = npuc_ir::infer::infer_model(&m, &HashMap::new());
    let (inferred, infer_note) = infer_outputs(&m, &r, &real_inputs);
    // A malformed graph (an undefined input, a cycle, a node whose inputs contradict its op)
    // cannot run: `inspect` says so first and fails, after printing what it could read.
    let problems: Vec<String> = r.problems.iter().map(|p| p.to_string()).collect();
    let invalid = || -> Result<()> {
        let more = if problems.len() > 1 {
            format!(" (and {} more problems)", problems.len() - 1)
        } else {
            String::new()
        };
        bail!(
            "'{}' is not a valid model: {}{more}",
            path.display(),
            problems[0]
        )
    };
    if json {
        let j = serde_json::json!({
            "path": path.display().to_string(),
            "ir_version": m.ir_version,
            "producer": {"name": m.producer_name, "version": m.producer_version},
            "opsets": m.opset_imports.iter().map(|o| serde_json::json!({"domain": o.domain, "version": o.version})).collect::<Vec<_>>(),
            "inputs": real_inputs.iter().map(|i| serde_json::json!({"name": i.name, "type": describe(&i.ty)})).collect::<Vec<_>>(),
            "outputs": m.graph.outputs.iter().map(|o| serde_json::json!({
                "name": o.name, "declared": describe(&o.ty),
                "inferred": inferred.iter().find(|x| x.0 == o.name).map(|x| x.1.clone()),
            })).collect::<Vec<_>>(),
            "nodes": n_nodes,
            "op_histogram": hist,
            "parameters": params,
            "parameter_bytes": bytes,
            "unsupported": unsupported.iter().map(|(n, o)| serde_json::json!({"node": n, "op": o})).collect::<Vec<_>>(),
            "supported": unsupported.is_empty(),
            "valid": problems.is_empty(),
            "problems": problems,
            "metadata": m.metadata.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.chars().take(200).collect()))).collect::<serde_json::Map<_,_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
        if !problems.is_empty() {
            return invalid();
        }
        return Ok(());
    }
    if !problems.is_empty() {
        println!("INVALID   {}", problems[0]);
        for p in problems.iter().skip(1).take(9) {
            println!("          {p}");
        }
    }
    println!("model     {}", path.display());
    println!(
        "producer  {} {} (ir_version {})",
        m.producer_name, m.producer_version, m.ir_version
    );
    println!(
        "opsets    {}",
        m.opset_imports
            .iter()
            .map(|o| format!(
                "{}={}",
                if o.domain.is_empty() {
                    "ai.onnx"
                } else {
                    &o.domain
                },
                o.version
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("inputs");
    for i in &real_inputs {
        println!("  {:<24} {}", i.name, describe(&i.ty));
    }
    println!("outputs");
    for o in &m.graph.outputs {
        let inf = inferred.iter().find(|x| x.0 == o.name).map(|x| x.1.clone());
        match inf {
            Some(s) => println!("  {:<24} {}  (declared {})", o.name, s, describe(&o.ty)),
            None => println!(
                "  {:<24} declared {} (not verified)",
                o.name,
                describe(&o.ty)
            ),
        }
    }
    if !infer_note.is_empty() {
        println!("  note: {infer_note}");
    }
    println!("parameters {} ({:.2} MB)", params, bytes as f64 / 1e6);
    println!("nodes     {n_nodes}");
    for (op, c) in &hist {
        let mark = if unsupported.iter().any(|u| &u.1 == op) {
            "  UNSUPPORTED"
        } else {
            ""
        };
        println!("  {op:<28} {c:>6}{mark}");
    }
    if unsupported.is_empty() {
        println!("support   all {n_nodes} nodes supported");
    } else {
        println!(
            "support   {} of {n_nodes} nodes unsupported:",
            unsupported.len()
        );
        for (n, o) in unsupported.iter().take(40) {
            println!("  node '{n}': op {o} is not supported");
        }
        if unsupported.len() > 40 {
            println!(
                "  ... and {} more (--json lists all)",
                unsupported.len() - 40
            );
        }
    }
    if !problems.is_empty() {
        return invalid();
    }
    Ok(())
}

/// `(output, "dtype[shape]")` for every graph output whose shape static inference fixes, and
/// a note saying why the others have none (empty when every output has one).
fn infer_outputs(
    m: &Model,
    r: &npuc_ir::infer::InferResult,
    real_inputs: &[&npuc_ir::ValueInfo],
) -> (Vec<(String, String)>, String) {
    let mut inferred = vec![];
    let mut missing = vec![];
    for o in &m.graph.outputs {
        match r.types.get(&o.name) {
            Some(TypeInfo::Tensor {
                dtype: Some(dt),
                shape: Some(dims),
            }) if dims.iter().all(|d| matches!(d, Dim::Fixed(_))) => {
                let shape: Vec<usize> = dims
                    .iter()
                    .map(|d| if let Dim::Fixed(n) = d { *n } else { 0 })
                    .collect();
                inferred.push((o.name.clone(), format!("{dt}{shape:?}")));
            }
            _ => missing.push(format!("'{}'", o.name)),
        }
    }
    if missing.is_empty() {
        return (inferred, String::new());
    }
    let unbound = real_inputs
        .iter()
        .find(|vi| !matches!(vi.dims(), Some(d) if d.iter().all(|d| matches!(d, Dim::Fixed(_)))));
    let why = if let Some(vi) = unbound {
        format!(
            "input '{}' has unbound dims; bind them with --input-shape/--dim to infer output shapes",
            vi.name
        )
    } else if let Some(p) = r.problems.first() {
        format!("static shape inference found a problem: {p}")
    } else if let Some(n) = r.not_inferred.first() {
        format!(
            "static shape inference has no rule for op {} (node '{}'{})",
            op_key(&n.domain, &n.op),
            n.node,
            if r.not_inferred.len() > 1 {
                format!(" and {} more nodes", r.not_inferred.len() - 1)
            } else {
                String::new()
            }
        )
    } else {
        "static shape inference leaves them data-dependent".to_string()
    };
    (
        inferred,
        format!("no static shape for output {}: {why}", missing.join(", ")),
    )
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn stats(t: &Tensor) -> String {
    match t.to_f64_vec() {
        Ok(v) if !v.is_empty() => {
            let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
            let max = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            format!("min {min:.6} max {max:.6} mean {mean:.6}")
        }
        Ok(_) => "empty".into(),
        Err(_) => format!("{} values", t.len()),
    }
}

fn run(
    path: &Path,
    graph: Option<&str>,
    inputs: &[String],
    out_dir: Option<&Path>,
    threads: usize,
    simulate: bool,
    optimize: bool,
) -> Result<()> {
    let t0 = Instant::now();
    let opened = npuc_driver::open(
        path,
        &OpenOptions {
            graph: graph.map(String::from),
            simulate,
            threads,
            optimize,
            ..Default::default()
        },
    )?;
    npuc_cli::check_simulate(path, simulate, &opened)?;
    let sess = opened.session;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut feeds = vec![];
    for s in inputs {
        let (name, file) = s
            .split_once('=')
            .ok_or_else(|| anyhow!("--input expects NAME=FILE, got '{s}'"))?;
        if feeds.iter().any(|(n, _)| n == name) {
            bail!("--input {name} is given twice; give each input once");
        }
        let decl = sess
            .inputs()
            .iter()
            .find(|i| i.name == name)
            .and_then(|i| i.ty.as_ref());
        let v = npuc_cli::read_input(Path::new(file), decl)
            .with_context(|| format!("input '{name}'"))?;
        feeds.push((name.to_string(), v));
    }
    let t1 = Instant::now();
    let outs = sess.run(feeds)?;
    let run_ms = t1.elapsed().as_secs_f64() * 1e3;
    if let Some(d) = out_dir {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    for (name, v) in &outs {
        match v {
            Value::Tensor(t) => {
                println!("{name}: {} {:?} {}", t.dtype(), t.shape(), stats(t));
                if let Some(d) = out_dir {
                    let p = d.join(format!("{}.npy", sanitize(name)));
                    let bytes = npy::npy_bytes(t).map_err(|e| anyhow!("output '{name}': {e}"))?;
                    npuc_onnx::export::write_atomic(&p, &bytes)?;
                }
            }
            other => println!("{name}: {} (not written)", other.kind()),
        }
    }
    eprintln!(
        "session {load_ms:.1} ms, run {run_ms:.1} ms ({threads} thread{})",
        if threads == 1 { "" } else { "s" }
    );
    Ok(())
}

/// `npuc run BUNDLE --component NAME --image IMG [-o OUT]`: prints each output; `-o X.npy`
/// writes a single output to that file, `-o DIR` each output as `DIR/NAME.npy`.
fn run_component(
    bundle: &Path,
    component: &str,
    image: &Path,
    out: Option<&Path>,
    threads: usize,
) -> Result<()> {
    let t0 = Instant::now();
    let outs = npuc_driver::components::run_image(bundle, component, image, threads)?;
    let npy_file = out.filter(|o| o.extension().is_some_and(|e| e == "npy"));
    if let Some(f) = npy_file.filter(|_| outs.len() != 1) {
        bail!(
            "-o {}: component '{component}' has {} outputs; give a directory",
            f.display(),
            outs.len()
        );
    }
    if let Some(d) = out.filter(|_| npy_file.is_none()) {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    for (name, t) in &outs {
        println!("{name}: {} {:?} {}", t.dtype(), t.shape(), stats(t));
        let dest = match (npy_file, out) {
            (Some(f), _) => Some(f.to_path_buf()),
            (None, Some(d)) => Some(d.join(format!("{}.npy", sanitize(name)))),
            (None, None) => None,
        };
        if let Some(p) = dest {
            let bytes = npy::npy_bytes(t).map_err(|e| anyhow!("output '{name}': {e}"))?;
            npuc_onnx::export::write_atomic(&p, &bytes)?;
            eprintln!("wrote {}", p.display());
        }
    }
    eprintln!(
        "component {component}: {:.1} ms (load, preprocess, run)",
        t0.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

/// Prints the quantized tensors of a model or artifact, if it holds any.
fn print_quant_report(path: &Path) -> Result<()> {
    let m = npuc_driver::load_any(path, None)?;
    let lines = npuc_driver::quantize::quant_report(&m)?;
    if !lines.is_empty() {
        println!("quantized tensors ({}):", lines.len());
        for l in lines {
            println!("{l}");
        }
    }
    Ok(())
}

fn ops(json: bool) -> Result<()> {
    let mut rows: Vec<(String, i64, i64)> = registry()
        .entries()
        .map(|e| (op_key(e.domain, e.name), e.since, e.until))
        .collect();
    rows.sort();
    if json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|(n, s, u)| serde_json::json!({"op": n, "since": s, "until": u}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for (n, s, u) in &rows {
            println!("{n:<40} opset {s}-{u}");
        }
        println!("{} ops", rows.len());
    }
    Ok(())
}

fn ocr_cmd(image: &Path, model: &Path, threads: usize, runs: usize) -> Result<()> {
    let t0 = Instant::now();
    let opened = npuc_driver::open(
        model,
        &OpenOptions {
            threads,
            ..Default::default()
        },
    )?;
    let chars = ocr::dictionary(&opened.model).ok_or_else(|| {
        anyhow!(
            "'{}' has no 'character' metadata: is it a PaddleOCR recogniser?",
            model.display()
        )
    })?;
    let sess = opened.session;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t1 = Instant::now();
    let img = image::open(image)
        .with_context(|| format!("reading image '{}'", image.display()))?
        .to_rgb8();
    let (w, h) = img.dimensions();
    let x = ocr::rec_input(img.as_raw(), w as usize, h as usize, 48, 320);
    let pre_ms = t1.elapsed().as_secs_f64() * 1e3;
    let input = sess
        .inputs()
        .first()
        .ok_or_else(|| anyhow!("the model has no inputs"))?
        .name
        .clone();
    if let Some(dt) = sess.inputs()[0].dtype() {
        if dt != DType::F32 {
            bail!("recogniser input '{input}' is {dt}, expected f32");
        }
    }
    let mut times = vec![];
    let mut out = None;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let o = sess.run(vec![(input.clone(), Value::tensor(x.clone()))])?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        out = Some(o);
    }
    times.sort_by(f64::total_cmp);
    let out = out.expect("at least one run");
    let probs = out[0]
        .1
        .as_tensor()
        .ok_or_else(|| anyhow!("recogniser output is not a tensor"))?;
    let (text, conf) = ocr::ctc_decode(probs, &chars).map_err(|e| anyhow!(e))?;
    println!("text: {text}");
    println!("confidence: {conf:.4}");
    println!(
        "timings: load+plan {load_ms:.1} ms, preprocess {pre_ms:.2} ms, inference median {:.2} ms (min {:.2}, {} runs, {threads} thread{})",
        times[times.len() / 2],
        times[0],
        times.len(),
        if threads == 1 { "" } else { "s" }
    );
    Ok(())
}
