//! Library side of the `npuc` binary: its commands (argument handling and output; the
//! pipelines they run live in `npuc-driver`), file formats the CLI reads/writes and small
//! applications (OCR) built on the runtime. Shared with tests.
#![forbid(unsafe_code)]

pub mod artifact;
pub mod bench;
pub mod build_cmd;
pub mod compile_cmd;
pub mod flags;
pub mod gguf_inspect;
pub mod llm_cmd;
pub use npuc_npy as npy;
pub mod ocr;
pub mod progress;
pub mod serve_cmd;
pub mod verify;

/// Registers the op packs the `npuc` binary serves on top of the core runtime: the LLM/GGML
/// kernels of `npuc-llm` and the image-codec/regex ONNX ops of `npuc-ops-ext` (idempotent).
pub fn register_ops() {
    npuc_driver::register_ops();
}

use anyhow::{bail, Result};
use npuc_ir::TypeInfo;
use npuc_runtime::Value;
use std::path::Path;

/// `--simulate` acts only on quantized models: fails naming it when `opened` holds no Q/DQ
/// nodes (it would run the float model unchanged).
pub fn check_simulate(path: &Path, simulate: bool, opened: &npuc_driver::Opened) -> Result<()> {
    if simulate && !opened.prepared.quantized {
        bail!(
            "--simulate: '{}' holds no QuantizeLinear/DequantizeLinear nodes, so there is nothing to simulate",
            path.display()
        );
    }
    Ok(())
}

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
