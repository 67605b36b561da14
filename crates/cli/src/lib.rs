//! Library side of the `npuc` binary: file formats the CLI reads/writes and small applications
//! (OCR) built on the runtime. Shared with tests and xtask.

pub mod artifact;
pub mod bench;
pub mod compile;
pub mod gguf_inspect;
pub mod llm_cmd;
pub mod llm_compile;
pub mod npy;
pub mod ocr;
pub mod quantize;
pub mod quantized;
pub mod verify;

/// Registers the op packs the `npuc` binary serves on top of the core runtime: the LLM/GGML
/// kernels of `npuc-llm` and the image-codec/regex ONNX ops of `npuc-ops-ext` (idempotent).
pub fn register_ops() {
    npuc_llm::register_ops();
    npuc_ops_ext::register();
}

/// Runs the standard optimization pipeline; returns (pass name, total changes) per pass that
/// changed something.
pub fn optimize_hook(
    m: &mut npuc_ir::Model,
    disable: &[String],
    enable: &[String],
) -> anyhow::Result<Vec<(String, usize)>> {
    if let Some(e) = enable
        .iter()
        .find(|e| !npuc_passes::OPT_IN_PASSES.contains(&e.as_str()))
    {
        anyhow::bail!(
            "--enable-pass {e}: not an opt-in pass (opt-in passes: {})",
            npuc_passes::OPT_IN_PASSES.join(", ")
        );
    }
    let opts = npuc_passes::OptimizeOptions {
        disable: disable.to_vec(),
        enable: enable.to_vec(),
        ..Default::default()
    };
    let report = npuc_passes::optimize(m, &opts)?;
    Ok(report.totals())
}

use anyhow::{bail, Result};
use npuc_ir::TypeInfo;
use npuc_runtime::Value;
use std::path::Path;

/// Reads an input value from a `.npy` file or an ONNX `.pb` (TensorProto, or SequenceProto /
/// OptionalProto when the declared type says so).
pub fn read_input(path: &Path, declared: Option<&TypeInfo>) -> Result<Value> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext == "npy" {
        return Ok(Value::tensor(npy::read_npy(path)?));
    }
    if ext == "pb" {
        let v = npuc_onnx::load_value_pb(path, declared)?;
        fn conv(v: npuc_onnx::PbValue) -> Value {
            match v {
                npuc_onnx::PbValue::Tensor(t) => Value::tensor(t),
                npuc_onnx::PbValue::Sequence(s) => {
                    Value::Sequence(s.into_iter().map(conv).collect())
                }
                npuc_onnx::PbValue::Optional(o) => Value::Optional(o.map(|b| Box::new(conv(*b)))),
            }
        }
        return Ok(conv(v));
    }
    bail!(
        "'{}': input files must be .npy or .pb (TensorProto)",
        path.display()
    )
}
