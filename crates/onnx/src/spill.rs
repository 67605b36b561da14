//! Weights computed at compile time (SmoothQuant's rescaled copies, folded constants) moved from
//! memory into a mapped temporary file, so that a large model's compile can give their pages
//! back once each is used ([`npuc_ir::Tensor::release_resident`]), as it does for the weights
//! mapped from the model's own files. Without it a 2.5 GB model holds its rescaled weights
//! resident from smoothing to the end, next to the quantized candidates the method choice runs.

use crate::import::MmapBacking;
use npuc_ir::{Graph, Tensor, TensorData};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// Offsets in the spill file are multiples of this (any element type's alignment; a cache line).
const ALIGN: usize = 64;

/// Moves every initializer of `g` whose values are in memory (owned, or shared behind a
/// reference count) and at least `min_bytes` long into one unlinked temporary file in `dir`
/// (the system's temporary directory when `None`), mapped read-only: the tensors keep their
/// names, dtypes, shapes and values and borrow the mapping. The file has no name and goes
/// with the last tensor borrowing it, also on a crash. Returns the bytes moved. Sub-byte,
/// boolean and string tensors stay where they are.
pub fn spill_initializers(
    g: &mut Graph,
    dir: Option<&Path>,
    min_bytes: usize,
) -> std::io::Result<usize> {
    let movable = |t: &Tensor| {
        !t.is_releasable()
            && t.dtype().storage() == t.dtype()
            && t.dtype() != npuc_ir::DType::String
            && t.dtype() != npuc_ir::DType::Bool
            && t.len() * t.dtype().size() >= min_bytes.max(1)
    };
    let picked: Vec<usize> = (0..g.initializers.len())
        .filter(|&i| movable(&g.initializers[i].tensor))
        .collect();
    if picked.is_empty() {
        return Ok(0);
    }
    let file = match dir {
        Some(d) => tempfile::tempfile_in(d)?,
        None => tempfile::tempfile()?,
    };
    let mut w = std::io::BufWriter::with_capacity(1 << 20, &file);
    let mut at = 0usize;
    let mut windows = Vec::with_capacity(picked.len());
    for &i in &picked {
        let t = &g.initializers[i].tensor;
        let bytes = t.le_bytes().map_err(|e| {
            std::io::Error::other(format!("initializer '{}': {e}", g.initializers[i].name))
        })?;
        let pad = at.next_multiple_of(ALIGN) - at;
        w.write_all(&[0u8; ALIGN][..pad])?;
        at += pad;
        w.write_all(&bytes)?;
        windows.push((i, at, bytes.len()));
        at += bytes.len();
    }
    w.flush()?;
    drop(w);
    // SAFETY: the file is this process's own unlinked temporary file (no other process can
    // open it by name) and nothing writes it after this point, so the mapping's bytes never
    // change while mapped.
    let map = Arc::new(MmapBacking(unsafe { memmap2::Mmap::map(&file) }?));
    let mut moved = 0;
    for (i, off, len) in windows {
        let init = &mut g.initializers[i];
        let t = Tensor::from_le_bytes(
            init.tensor.dtype(),
            init.tensor.shape().to_vec(),
            map.clone(),
            off,
            len,
        )
        .map_err(|e| std::io::Error::other(format!("initializer '{}': {e}", init.name)))?;
        debug_assert!(matches!(t.data(), TensorData::Borrowed(_)));
        // The in-memory copy (unless another clone shares it) goes with the old tensor here.
        // Written, not yet read back: the pages are in the page cache, not this process.
        t.release_resident();
        init.tensor = t;
        moved += len;
    }
    Ok(moved)
}
