//! LLM compile (`npuc compile MODEL.gguf --variants ar1,ar32,ar128,full --ctx 1024
//! [--precision fast|parity|exact]`) through [`npuc_llm::compile`]: one graph per AR variant in one
//! artifact, the GGUF weights stored once, model facts and tokenizer metadata in the graphs'
//! metadata.

use crate::compile::{CompileSummary, GraphSummary};
use crate::Progress;
use anyhow::Result;
pub use npuc_llm::compile::LlmCompileOptions;
use std::path::Path;

/// True for models the LLM compiler handles (GGUF, by magic bytes).
pub use npuc_gguf::is_gguf;

/// Compiles a GGUF model into the artifact `out` (written atomically).
pub fn compile_gguf(
    path: &Path,
    opts: &LlmCompileOptions,
    out: &Path,
    progress: &mut dyn Progress,
) -> Result<CompileSummary> {
    let s = npuc_llm::compile::compile_gguf(path, opts, out, |m| progress.note(m))?;
    Ok(CompileSummary {
        graphs: s
            .graphs
            .into_iter()
            .map(|(name, nodes)| GraphSummary {
                name,
                nodes_before: nodes,
                nodes_after: nodes,
                arena_bytes: 0,
                pass_log: vec![],
                pass_records: vec![],
            })
            .collect(),
        weight_bytes_unique: s.weight_bytes_unique,
        weight_bytes_referenced: s.weight_bytes_referenced,
        file_bytes: s.file_bytes,
        seconds: s.seconds,
    })
}

/// What [`export_onnx`] wrote.
#[derive(Debug, Clone)]
pub struct OnnxExportSummary {
    pub nodes: usize,
    pub initializers: usize,
    /// Bytes of all initializers.
    pub weight_bytes: usize,
    /// The external data file (`None`: everything inline in the `.onnx`).
    pub external_data: Option<std::path::PathBuf>,
    pub seconds: f64,
}

/// Above this many weight bytes the export writes the initializers to `<model>.onnx.data`
/// (protobuf messages stop at 2 GiB; the margin leaves room for the graph itself).
pub const ONNX_INLINE_LIMIT: usize = 1 << 30;

/// `npuc export MODEL.gguf -o model.onnx`: the GGUF decoder as a standard ONNX decoder (see
/// [`npuc_llm::interop::export`]), written atomically; external data when large.
/// `inline_limit`: weight bytes above which initializers go to external data
/// ([`ONNX_INLINE_LIMIT`] for the CLI).
pub fn export_onnx(
    gguf: &Path,
    out: &Path,
    dtype: npuc_llm::interop::WeightDtype,
    inline_limit: usize,
) -> Result<OnnxExportSummary> {
    let t0 = std::time::Instant::now();
    if out.extension().and_then(|e| e.to_str()) != Some("onnx") {
        anyhow::bail!(
            "{}: the output of `npuc export` is an ONNX file: give it a .onnx name",
            out.display()
        );
    }
    let g = npuc_gguf::GgufFile::open(gguf)?;
    let m = npuc_llm::interop::export_decoder(&g, dtype)?;
    let weight_bytes: usize = m
        .graph
        .initializers
        .iter()
        .map(|i| i.tensor.len() * i.tensor.dtype().size().max(1))
        .sum();
    let external = weight_bytes > inline_limit;
    let opts = npuc_onnx::ExportOptions {
        external_threshold: external.then_some(1024),
    };
    npuc_onnx::save_model(&m, out, &opts)?;
    Ok(OnnxExportSummary {
        nodes: m.graph.nodes.len(),
        initializers: m.graph.initializers.len(),
        weight_bytes,
        external_data: external.then(|| {
            let mut p = out.as_os_str().to_owned();
            p.push(".data");
            p.into()
        }),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Takes an ONNX LLM decoder (the `npuc export` / Optimum layout) back into the builders' form
/// and writes it as a GGUF at `out` (atomically); `tokenizer`: a GGUF whose tokenizer to use
/// when the ONNX file carries none. Returns what was recognised.
pub fn import_onnx_llm(onnx: &Path, tokenizer: Option<&Path>, out: &Path) -> Result<Vec<String>> {
    let m = npuc_onnx::load_model(onnx)?;
    let tok = match tokenizer {
        Some(t) => {
            let g = npuc_gguf::GgufFile::open(t)?;
            Some(npuc_gguf::GgufMetaJson::filtered(
                &g.metadata,
                &["tokenizer."],
            ))
        }
        None => None,
    };
    let lifted = npuc_llm::interop::lift(&m, &onnx.display().to_string(), tok.as_ref())?;
    let bytes = lifted.to_gguf_bytes()?;
    let findings = lifted.findings;
    drop(m);
    npuc_onnx::export::write_atomic(out, &bytes)?;
    Ok(findings)
}
