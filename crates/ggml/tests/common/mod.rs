//! Test helpers: the workspace root and the f32 `.npy` reference files.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The workspace root (two levels above this crate).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Reads an f32 `.npy` file (through `npuc-npy`): `(shape, values)`.
pub fn read_npy_f32(path: &Path) -> (Vec<usize>, Vec<f32>) {
    npuc_npy::read_f32(path).unwrap_or_else(|e| panic!("{e}"))
}
