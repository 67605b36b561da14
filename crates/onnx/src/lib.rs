//! ONNX frontend: reads `ModelProto` files into [`npuc_ir::Model`] (initializers borrowed from
//! the mmapped file or from external data files, never copied when aligned) and writes IR models
//! back to ONNX.

pub mod contrib;
pub mod export;
pub mod import;
pub mod spill;

/// Generated protobuf types (onnx-ml.proto and onnx-data.proto of onnx 1.22.0).
#[allow(clippy::all, missing_docs)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/onnx.rs"));
}

pub use export::{save_model, save_tensor_pb, to_model_proto, ExportOptions};
pub use import::{load_model, load_model_bytes, load_value_pb, tensor_from_proto, PbValue};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    // The reason is part of the message, not a chained source (printed once, not twice).
    #[error("cannot read '{path}': {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("'{path}' is not a valid ONNX protobuf ({detail}); is the file truncated or of another format?")]
    Decode { path: PathBuf, detail: String },
    #[error("'{path}': tensor '{tensor}': {msg}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    #[error("'{path}': {msg}")]
    Model { path: PathBuf, msg: String },
    #[error(transparent)]
    Ir(#[from] npuc_ir::IrError),
}
