//! ONNX LLM interchange: the standard ONNX decoder a GGUF exports to ([`export`]), and the
//! recogniser that takes such a decoder back into the builders' weights ([`lift`]).

pub mod export;

pub use export::{export_decoder, WeightDtype};
pub mod lift;

pub use lift::{lift, Lifted};
