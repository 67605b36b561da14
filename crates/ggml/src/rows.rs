//! Multi-row dot products for the fast path: one weight row times up to four quantized
//! activation rows per call, so the weight blocks are loaded and unpacked once for four rows
//! (prefill) and four independent accumulator chains hide the FMA latency. Every row's result
//! is exactly what a one-row call computes, so row counts and thread splits never change a value.
//!
//! Rounding (the scalar twins here are the bit-exact references of the AVX2 kernels in `x86.rs`):
//! - 32-value blocks (Q4_0, Q4_1, Q5_0, Q8_0 with Q8_0/Q8_1 activations): the exact integer dot
//!   product of each block, FMA'd with `d_w·d_x` into one f32 sum per (weight row, activation
//!   row); Q4_1 adds `m_w·s_x` per block to a second sum, added at the end.
//! - K-quants (Q4_K, Q6_K with Q8_K activations): the exact integer dot product of each 256-value
//!   block, then one scalar FMA per block (as `dot::q4_k_q8_k` and `dot::q6_k_q8_k_tiled`).

use crate::{f16_at, GgmlType};

/// `(weight rows, activation rows, outputs)`: `out[i * x.len() + r] = w[i] · x[r]` for
/// `i < w.len() <= 8`, `r < x.len() <= 4`.
pub(crate) type RowsFn = fn(&[&[u8]], &[&[u8]], &mut [f32]);

/// The multi-row kernel for `ty` on this CPU (`scalar`: the portable twin), when there is one.
pub(crate) fn rows_fn(ty: GgmlType, scalar: bool) -> Option<RowsFn> {
    #[cfg(target_arch = "x86_64")]
    if !scalar && crate::has_avx2() {
        if let Some(f) = crate::x86::rows_fn(ty) {
            return Some(f);
        }
    }
    let _ = scalar;
    Some(match ty {
        GgmlType::Q8_0 => rows_scalar::<Q8_0>,
        GgmlType::Q4_0 => rows_scalar::<Q4_0>,
        GgmlType::Q5_0 => rows_scalar::<Q5_0>,
        GgmlType::Q4_1 => rows_scalar::<Q4_1>,
        GgmlType::Q4_K => |w, x, out| each_row(crate::dot::q4_k_q8_k_pub, w, x, out),
        GgmlType::Q6_K => |w, x, out| each_row(crate::dot::q6_k_q8_k_tiled_pub, w, x, out),
        _ => return None,
    })
}

/// Weight rows per decode tile (one activation row): eight for the 32-value-block kernels
/// (their eight-pair layout), four for the K-quants.
pub(crate) fn decode_tile_rows(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q4_1 => 8,
        _ => 4,
    }
}

fn each_row(f: fn(&[u8], &[u8]) -> f32, w: &[&[u8]], x: &[&[u8]], out: &mut [f32]) {
    for (i, wr) in w.iter().enumerate() {
        for (r, xr) in x.iter().enumerate() {
            out[i * x.len() + r] = f(wr, xr);
        }
    }
}

/// Which 32-value block type a scalar twin unpacks.
pub(crate) trait Block32 {
    /// Bytes of a weight block.
    const WB: usize;
    /// Bytes of an activation block (Q8_0: 34, Q8_1: 36).
    const XB: usize;
    /// The 32 weight values as integers.
    fn values(wb: &[u8]) -> [i32; 32];
    /// The per-block extra term (Q4_1's `m_w · s_x`), else 0.
    fn extra(_wb: &[u8], _xb: &[u8]) -> Option<f32> {
        None
    }
}

pub(crate) struct Q8_0;
pub(crate) struct Q4_0;
pub(crate) struct Q5_0;
pub(crate) struct Q4_1;

impl Block32 for Q8_0 {
    const WB: usize = 34;
    const XB: usize = 34;
    fn values(wb: &[u8]) -> [i32; 32] {
        std::array::from_fn(|i| wb[2 + i] as i8 as i32)
    }
}

impl Block32 for Q4_0 {
    const WB: usize = 18;
    const XB: usize = 34;
    fn values(wb: &[u8]) -> [i32; 32] {
        std::array::from_fn(|i| {
            let b = wb[2 + i % 16];
            (if i < 16 { b & 0x0F } else { b >> 4 }) as i32 - 8
        })
    }
}

impl Block32 for Q5_0 {
    const WB: usize = 22;
    const XB: usize = 34;
    fn values(wb: &[u8]) -> [i32; 32] {
        let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
        std::array::from_fn(|i| {
            let b = wb[6 + i % 16];
            let nib = if i < 16 { b & 0x0F } else { b >> 4 };
            (nib as i32 | (((qh >> i) & 1) as i32) << 4) - 16
        })
    }
}

impl Block32 for Q4_1 {
    const WB: usize = 20;
    const XB: usize = 36;
    fn values(wb: &[u8]) -> [i32; 32] {
        std::array::from_fn(|i| {
            let b = wb[4 + i % 16];
            (if i < 16 { b & 0x0F } else { b >> 4 }) as i32
        })
    }
    fn extra(wb: &[u8], xb: &[u8]) -> Option<f32> {
        Some(f16_at(wb, 2) * f16_at(xb, 2))
    }
}

/// Scalar twin of the AVX2 32-value-block kernels (see the module docs for the order).
fn rows_scalar<B: Block32>(w: &[&[u8]], x: &[&[u8]], out: &mut [f32]) {
    for (i, wr) in w.iter().enumerate() {
        let o = &mut out[i * x.len()..(i + 1) * x.len()];
        row_scalar::<B>(wr, x, o);
    }
}

fn row_scalar<B: Block32>(w: &[u8], x: &[&[u8]], out: &mut [f32]) {
    let xq = B::XB - 32;
    for (o, xr) in out.iter_mut().zip(x) {
        let (mut acc, mut extra) = (0f32, 0f32);
        for (wb, xb) in w.chunks_exact(B::WB).zip(xr.chunks_exact(B::XB)) {
            let q = B::values(wb);
            let isum: i32 = (0..32).map(|i| q[i] * xb[xq + i] as i8 as i32).sum();
            let d = f16_at(wb, 0) * f16_at(xb, 0);
            acc = d.mul_add(isum as f32, acc);
            if let Some(e) = B::extra(wb, xb) {
                extra += e;
            }
        }
        *o = acc + extra;
    }
}

fn check_rows(ty: GgmlType, w: &[&[u8]], x: &[&[u8]], k: usize, out: &[f32]) -> crate::Result<()> {
    let Some(vt) = crate::vec_dot_type(ty) else {
        crate::bail!("no integer dot product for ggml type {ty}");
    };
    let (wb, xb) = (crate::row_bytes(ty, k)?, crate::row_bytes(vt, k)?);
    if w.iter().any(|r| r.len() != wb)
        || x.iter().any(|r| r.len() != xb)
        || !(1..=8).contains(&w.len())
        || !(1..=4).contains(&x.len())
        || out.len() != w.len() * x.len()
    {
        crate::bail!(
            "{ty} multi-row dot of length {k}: 1..=8 weight rows of {wb} bytes, 1..=4 {vt} rows of {xb} bytes and one output per pair expected"
        );
    }
    Ok(())
}

/// `out[i * x.len() + r] = w[i] · x[r]` for tiles of up to eight weight rows by four activation
/// rows with the fastest multi-row kernel (`Ok(false)` when `ty` has none: use [`crate::vec_dot`]).
pub fn vec_dot_rows(
    ty: GgmlType,
    w: &[&[u8]],
    x: &[&[u8]],
    k: usize,
    out: &mut [f32],
) -> crate::Result<bool> {
    dot_rows_with(ty, w, x, k, out, false)
}

/// [`vec_dot_rows`] with the scalar twins (the bit-exact reference of the SIMD kernels).
pub fn vec_dot_rows_scalar(
    ty: GgmlType,
    w: &[&[u8]],
    x: &[&[u8]],
    k: usize,
    out: &mut [f32],
) -> crate::Result<bool> {
    dot_rows_with(ty, w, x, k, out, true)
}

fn dot_rows_with(
    ty: GgmlType,
    w: &[&[u8]],
    x: &[&[u8]],
    k: usize,
    out: &mut [f32],
    scalar: bool,
) -> crate::Result<bool> {
    check_rows(ty, w, x, k, out)?;
    Ok(rows_fn(ty, scalar).map(|f| f(w, x, out)).is_some())
}
