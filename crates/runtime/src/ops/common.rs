//! Helpers shared by kernels: axes, broadcasting, strides, dtype dispatch.

use crate::error::{Result, RtError};
use npuc_ir::Tensor;

/// Resolves a possibly negative axis against `rank` (`rank` itself allowed when `inclusive`).
pub fn norm_axis(axis: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r.max(1) && !(r == 0 && a == 0) {
        return Err(RtError::msg(format!(
            "axis {axis} is out of range for rank {rank}"
        )));
    }
    Ok(a as usize)
}

/// Like [`norm_axis`] but allows `axis == rank` (insert positions).
pub fn norm_axis_incl(axis: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r + 1 } else { axis };
    if a < 0 || a > r {
        return Err(RtError::msg(format!(
            "axis {axis} is out of range for rank {rank}"
        )));
    }
    Ok(a as usize)
}

/// Numpy-style multidirectional broadcast of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if da == db {
            da
        } else if da == 1 {
            db
        } else if db == 1 {
            da
        } else {
            return Err(RtError::msg(format!(
                "shapes {a:?} and {b:?} cannot be broadcast together"
            )));
        };
    }
    Ok(out)
}

pub fn broadcast_all(shapes: &[&[usize]]) -> Result<Vec<usize>> {
    let mut out: Vec<usize> = vec![];
    for s in shapes {
        out = broadcast_shapes(&out, s)?;
    }
    Ok(out)
}

/// Row-major strides.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Strides of `shape` broadcast to `out` (0 where a dim is broadcast).
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let st = strides(shape);
    let off = out.len() - shape.len();
    (0..out.len())
        .map(|i| {
            if i < off || shape[i - off] == 1 && out[i] != 1 {
                0
            } else {
                st[i - off]
            }
        })
        .collect()
}

/// For each output element index (row-major over `out`), the index into an input with the
/// given broadcast strides. Allocates one Vec; use for gathers that are not on a hot path.
pub fn broadcast_index_map(in_shape: &[usize], out: &[usize]) -> Vec<usize> {
    let bs = broadcast_strides(in_shape, out);
    let n: usize = out.iter().product();
    let mut idx = vec![0usize; n];
    let rank = out.len();
    let mut counter = vec![0usize; rank];
    let mut cur = 0usize;
    for slot in idx.iter_mut() {
        *slot = cur;
        for d in (0..rank).rev() {
            counter[d] += 1;
            cur += bs[d];
            if counter[d] < out[d] {
                break;
            }
            cur -= bs[d] * counter[d];
            counter[d] = 0;
        }
    }
    idx
}

/// Reads a 1-D integer tensor (shapes, axes, pads).
pub fn ints(t: &Tensor) -> Result<Vec<i64>> {
    Ok(t.to_i64_vec()?)
}

/// Dispatches on a tensor's dtype, binding `$T` to the element type, for all numeric dtypes.
/// Usage: `dispatch_numeric!(t.dtype(), T => { ... })`; the fallback arm returns an error.
#[macro_export]
macro_rules! dispatch_numeric {
    ($dt:expr, $T:ident => $body:expr) => {{
        use npuc_ir::DType as __D;
        match $dt {
            __D::F32 => {
                type $T = f32;
                $body
            }
            __D::F64 => {
                type $T = f64;
                $body
            }
            __D::F16 => {
                type $T = npuc_ir::f16;
                $body
            }
            __D::BF16 => {
                type $T = npuc_ir::bf16;
                $body
            }
            __D::I8 => {
                type $T = i8;
                $body
            }
            __D::U8 => {
                type $T = u8;
                $body
            }
            __D::I16 => {
                type $T = i16;
                $body
            }
            __D::U16 => {
                type $T = u16;
                $body
            }
            __D::I32 => {
                type $T = i32;
                $body
            }
            __D::U32 => {
                type $T = u32;
                $body
            }
            __D::I64 => {
                type $T = i64;
                $body
            }
            __D::U64 => {
                type $T = u64;
                $body
            }
            other => {
                return Err($crate::RtError::msg(format!(
                    "dtype {other} is not supported here"
                )))
            }
        }
    }};
}

/// Like [`dispatch_numeric!`] plus bool (types with a typed Vec: for data movement ops).
/// Strings are handled separately by data movement kernels.
#[macro_export]
macro_rules! dispatch_pod {
    ($dt:expr, $T:ident => $body:expr) => {{
        use npuc_ir::DType as __D;
        match $dt {
            __D::Bool => { type $T = bool; $body }
            __D::I4 => { type $T = i8; $body }
            __D::U4 => { type $T = u8; $body }
            _ => $crate::dispatch_numeric!($dt, $T => $body),
        }
    }};
}

/// `dst` = `src` (equal lengths) for plain data: runs of 8, 16, 32 or 64 values as fixed-size
/// copies (inline vector moves), others through `copy_from_slice`. A channels-last Concat or
/// nearest Resize copies one short run per pixel (PP-OCRv6 det: 16 channels, 77k runs per
/// Concat call), where a `memcpy` call per run cost more than the bytes it moved.
#[inline(always)]
pub fn copy_run<T: Copy>(dst: &mut [T], src: &[T]) {
    #[inline(always)]
    fn fixed<T: Copy, const N: usize>(dst: &mut [T], src: &[T]) {
        let s: &[T; N] = src.try_into().expect("N source values");
        let d: &mut [T; N] = dst.try_into().expect("N destination values");
        *d = *s;
    }
    match src.len() {
        8 => fixed::<T, 8>(dst, src),
        16 => fixed::<T, 16>(dst, src),
        32 => fixed::<T, 32>(dst, src),
        64 => fixed::<T, 64>(dst, src),
        _ => dst.copy_from_slice(src),
    }
}
