//! npuc's graph IR: dtypes, tensors (owned or borrowed from a mapping), graphs of named nodes
//! and values, attributes, symbolic shapes and a verifier. This crate does no I/O.
#![forbid(unsafe_code)]

pub mod dtype;
pub mod error;
pub mod ggml;
pub mod graph;
pub mod infer;
pub mod lowp;
pub mod numel;
pub mod opdef;
pub mod tensor;
pub mod verify;

pub use dtype::DType;
pub use error::IrError;
pub use ggml::GgmlType;
pub use graph::*;
pub use half::{bf16, f16};
pub use tensor::{checked_numel, numel, Backing, Borrowed, Elem, Tensor, TensorData};
pub use verify::{verify_model, NoContracts, OpContracts};
