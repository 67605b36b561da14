use npuc_ir::IrError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RtError {
    /// A kernel's complaint, before the executor adds the node's context.
    #[error("{0}")]
    Msg(String),
    #[error("node '{node}' ({op}): {msg}")]
    Node {
        node: String,
        op: String,
        msg: String,
    },
    #[error("unsupported op{}: {}; `npuc ops` lists what is supported", if .0.len() > 1 { "s" } else { "" }, .0.join(", "))]
    Unsupported(Vec<String>),
    #[error("input '{name}': {msg}")]
    Input { name: String, msg: String },
    #[error(transparent)]
    Ir(#[from] IrError),
}

impl RtError {
    pub fn msg(s: impl Into<String>) -> RtError {
        RtError::Msg(s.into())
    }
}

pub type Result<T, E = RtError> = std::result::Result<T, E>;

/// Returns early with a kernel error message.
#[macro_export]
macro_rules! bail {
    ($($t:tt)*) => { return Err($crate::RtError::Msg(format!($($t)*))) };
}
