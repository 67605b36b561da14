use crate::dtype::DType;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum IrError {
    #[error("shape {shape:?} holds {} elements but {len} were given", crate::numel::checked_numel(shape).map_or("more than 2^64".to_string(), |n| n.to_string()))]
    ShapeData { shape: Vec<usize>, len: usize },
    #[error("shape {shape:?} has more elements than this machine can address (the product of its dimensions overflows)")]
    ShapeOverflow { shape: Vec<usize> },
    #[error("{dtype} tensor of shape {shape:?} needs {expected} bytes, found {found}")]
    ByteLength {
        dtype: DType,
        shape: Vec<usize>,
        expected: usize,
        found: usize,
    },
    #[error("expected a {expected} tensor, found {found}")]
    DTypeMismatch { expected: DType, found: DType },
    #[error(
        "data range offset {offset} + length {len} lies past the end of the {total}-byte buffer"
    )]
    DataOutOfRange {
        offset: usize,
        len: usize,
        total: usize,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error("node '{node}' ({op}): {msg}")]
    Node {
        node: String,
        op: String,
        msg: String,
    },
    #[error("graph '{graph}': {msg}")]
    Graph { graph: String, msg: String },
}
