//! npuc LLM support: GGUF decoder architectures (llama, qwen2, gemma3) built into static-shape
//! IR graphs (one per AR-n variant, sharing one set of weights), and an [`Engine`] that runs
//! them over a host-owned KV cache.
//!
//! Graph conventions (shared with the generation and compile code, see
//! `docs`/llm-interface): inputs `input_ids` i64 [N], `positions` i64 [N], `attn_mask` f32
//! [N, C] (additive 0 / -inf), `past_key.{l}` / `past_value.{l}` [KVH, C, D]; outputs `logits`
//! f32 [N, vocab], `new_key.{l}` / `new_value.{l}` [KVH, N, D] which the host writes into its
//! cache at `positions` after each call.

mod anon;
pub mod build;
pub mod bundle;
pub mod compile;
pub mod engine;
pub mod interop;
pub mod kv;
pub mod ops;

pub use build::{
    build, BuildOptions, Hparams, InputMoment, LlmEncodings, Precision, Variant, WeightMode,
    WeightQuant, WeightQuantOptions, WeightRounding,
};
pub use bundle::{Bundle, BundleOptions};
pub use engine::{Engine, EngineOptions};
pub use npuc_gguf::GgufMetaJson;
pub use ops::register as register_ops;

use thiserror::Error;

/// Errors of this crate; every message names the file, tensor, key or limit involved.
#[derive(Debug, Error)]
pub enum LlmError {
    #[error(transparent)]
    Gguf(#[from] npuc_gguf::GgufError),
    #[error(transparent)]
    MetaJson(#[from] npuc_gguf::MetaJsonError),
    #[error(transparent)]
    Ir(#[from] npuc_ir::IrError),
    #[error(transparent)]
    Runtime(#[from] npuc_runtime::RtError),
    #[error(transparent)]
    Format(#[from] npuc_format::FormatError),
    #[error("{0}")]
    Msg(String),
}

impl LlmError {
    /// A plain message error.
    pub fn msg(s: impl Into<String>) -> LlmError {
        LlmError::Msg(s.into())
    }
}

/// Result with [`LlmError`].
pub type Result<T, E = LlmError> = std::result::Result<T, E>;

/// Returns early with an [`LlmError::Msg`].
macro_rules! bail {
    ($($t:tt)*) => { return Err($crate::LlmError::Msg(format!($($t)*))) };
}
pub(crate) use bail;
