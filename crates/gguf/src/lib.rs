//! GGUF frontend: reads GGUF v2/v3 files (metadata of every value type, tensor infos, alignment)
//! over an mmap, hands out zero-copy tensor bytes, and writes GGUF files.
//!
//! Every length and offset read from the file is checked against the bytes that are really there
//! before it is used, so a truncated or corrupted file gives a [`GgufError`] naming the offset,
//! key or tensor, never a panic or a huge allocation.

mod meta_json;
mod read;
mod value;
pub mod write;

pub use meta_json::{GgufMetaJson, MetaJsonError};
pub use read::{GgufFile, TensorInfo};
pub use value::{MetaValue, ValueType};

use std::path::PathBuf;
use thiserror::Error;

/// The default `general.alignment` of tensor data.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// `GGUF` in little-endian byte order.
pub const MAGIC: [u8; 4] = *b"GGUF";

/// Whether `path` is to be read as a GGUF model: its first four bytes are [`MAGIC`], or it is
/// named `*.gguf` (then a file with other bytes, or a missing one, gets the GGUF loader's error
/// naming the file and the magic it found, not an ONNX parse error).
pub fn is_gguf(path: &std::path::Path) -> bool {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok_and(|()| magic == MAGIC)
}

#[derive(Debug, Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: not a GGUF file (magic {found:02x?}, expected \"GGUF\")")]
    BadMagic { file: String, found: [u8; 4] },
    #[error("{file}: GGUF version {version} is not supported (npuc reads versions 2 and 3){hint}")]
    Version {
        file: String,
        version: u32,
        hint: &'static str,
    },
    #[error("{file}: truncated at byte offset {offset}: {what} needs {need} more bytes, the file has {have}")]
    Truncated {
        file: String,
        offset: u64,
        what: String,
        need: u64,
        have: u64,
    },
    #[error("{file}: at byte offset {offset}: {msg}")]
    Malformed {
        file: String,
        offset: u64,
        msg: String,
    },
    #[error("{file}: tensor '{tensor}': {msg}")]
    Tensor {
        file: String,
        tensor: String,
        msg: String,
    },
    #[error("{file}: metadata key '{key}': {msg}")]
    Meta {
        file: String,
        key: String,
        msg: String,
    },
}

pub type Result<T> = std::result::Result<T, GgufError>;
