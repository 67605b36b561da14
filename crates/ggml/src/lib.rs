//! GGML block-quantized tensor kernels (no I/O).
//!
//! The block layouts are exactly those of ggml's `ggml-common.h`, so raw GGUF tensor bytes can
//! be used in place (zero-copy from an mmap):
//!
//! - [`dequantize_row`]: any supported type to f32, bit-identical to ggml's reference
//!   `dequantize_row_*` and gguf-py's `gguf.quants.dequantize` (same f16 → f32 conversion and
//!   the same order of f32 operations).
//! - [`quantize_row_q8_0`], [`quantize_row_q8_1`], [`quantize_row_q8_K`]: the activation
//!   quantizers llama.cpp uses before its integer dot products; plus reference weight
//!   quantizers ([`quantize_row`]) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, used to write test files.
//! - [`vec_dot`]: one weight row times one quantized activation row with integer
//!   arithmetic like ggml's CPU `ggml_vec_dot_*` (AVX2+FMA when the CPU has it, a scalar twin
//!   otherwise), never dequantizing the weights.
//! - [`matmul`]: `Y[m,n] = X[m,k] · Wᵀ` in either [`MatMulMode::ActQuant`] (llama.cpp's fast
//!   path) or [`MatMulMode::Exact`] (dequantized weights in cache-sized row tiles, f32 math);
//!   and [`gather_rows`] (embedding lookup).
//! - [`repack_x8`] / [`matmul_x8`]: the interleaved eight-row layout of the 32-value block types
//!   (made once at load or compile time) and the fast path's products over it.

// Kernels index several parallel arrays with one counter, mirroring ggml's block layouts.
#![allow(clippy::needless_range_loop)]

mod dequant;
mod dot;
mod gemm;
mod matmul;
mod pool;
mod quantize;
mod rows;
mod vecf32;
mod x8;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;
#[cfg(target_arch = "x86_64")]
mod x86_x8;

use std::fmt;

pub use npuc_ir::GgmlType;

pub use dequant::{dequantize_row, dequantize_row_scalar};
pub use dot::{vec_dot, vec_dot_scalar, vec_dot_type};
pub use gemm::{matmul_f32, matmul_f32_scalar};
pub use matmul::{
    gather_rows, gather_rows_x8, matmul, matmul_batch, matmul_scalar, matmul_x8, matmul_x8_scalar,
    MatMulMode,
};
pub use quantize::{
    quantize_activations, quantize_activations_scalar, quantize_row, quantize_row_q8_0,
    quantize_row_q8_1, quantize_row_q8_K,
};
pub use rows::{vec_dot_rows, vec_dot_rows_scalar};
pub use vecf32::{
    dot_rows, dot_rows_scalar, f16_to_f32_row, f16_to_f32_row_scalar, round_f16_row,
    round_f16_row_scalar, weighted_sum, weighted_sum_scalar,
};
pub use x8::{repack_group_x8, repack_x8, supports_x8, unpack_row_x8, X8_ROWS};

/// Runs `f(0) .. f(tasks - 1)` on this thread and up to `threads - 1` warm workers of the
/// kernels' spin-then-park pool (the one the matrix products use), returning when all are done.
pub fn parallel_for(tasks: usize, threads: usize, f: &(dyn Fn(usize) + Sync)) {
    pool::pool().run(tasks, threads, f)
}

/// Runs `f(c, piece)` for every `chunk`-sized piece `c` of `buf` on this thread and up to
/// `threads - 1` workers of the kernels' pool (this thread alone when `threads <= 1`).
pub fn parallel_chunks_mut<T: Send>(
    buf: &mut [T],
    chunk: usize,
    threads: usize,
    f: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    let chunk = chunk.max(1);
    if threads <= 1 || buf.len() <= chunk {
        for (c, piece) in buf.chunks_mut(chunk).enumerate() {
            f(c, piece);
        }
        return;
    }
    // One lock per piece (never contended: each task takes its own) hands out disjoint `&mut`s.
    let pieces: Vec<std::sync::Mutex<&mut [T]>> =
        buf.chunks_mut(chunk).map(std::sync::Mutex::new).collect();
    pool::pool().run(pieces.len(), threads, &|c| {
        if let Ok(mut piece) = pieces[c].lock() {
            f(c, &mut piece);
        }
    });
}

/// Elements per block of the K-quants.
pub use npuc_ir::ggml::QK_K;

/// An error from a kernel: always a clear message naming what was wrong (type, lengths).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// Result of this crate's functions.
pub type Result<T> = std::result::Result<T, Error>;

macro_rules! bail {
    ($($t:tt)*) => { return Err($crate::Error(format!($($t)*))) };
}
pub(crate) use bail;

/// Bytes of a row of `k` elements of `ty`, or a clear error when `k` is not a whole number of
/// blocks.
pub fn row_bytes(ty: GgmlType, k: usize) -> Result<usize> {
    match ty.row_bytes(k) {
        Some(b) => Ok(b),
        None => bail!(
            "{ty}: row length {k} is not a multiple of the block size {}",
            ty.block_size()
        ),
    }
}

/// Whether [`dequantize_row`] supports `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_1
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
            | IQ4_NL
    )
}

/// Reads the little-endian f16 at `b[i..i + 2]` as f32 (exact conversion, like ggml's
/// `GGML_FP16_TO_FP32`).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Writes `v` rounded to f16 (round to nearest even, like `GGML_FP32_TO_FP16`) at `b[i..i + 2]`.
#[inline(always)]
pub(crate) fn put_f16(b: &mut [u8], i: usize, v: f32) {
    b[i..i + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

/// Whether the AVX2+FMA+F16C kernels may run: the process-wide level (`npuc_isa`, which
/// `NPUC_ISA=scalar` caps; `NPUC_GGML_SCALAR` is the older spelling of that for these kernels).
#[inline]
pub fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var_os("NPUC_GGML_SCALAR").is_none() && npuc_isa::Isa::detect().has_avx2()
    })
}

/// Whether the AVX-512 kernels (`x86_512.rs`) may run: the process-wide level allows `avx512`
/// (AVX-512 F/BW/DQ/VL on top of AVX2; `NPUC_ISA=avx2` or `scalar` caps it) and the CPU also
/// has AVX-512 VNNI (`vpdpbusd`), which the integer kernels use. Older hosts keep the AVX2 ones.
#[inline]
pub fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        has_avx2() && npuc_isa::Isa::detect().has_avx512() && npuc_isa::host_has("avx512vnni")
    })
}
