//! Shape and data-movement kernels: Constant, Identity, Reshape, Transpose, Concat, Split,
//! Slice, Squeeze/Unsqueeze, Flatten, Expand, Tile, Shape, Size, ConstantOfShape, Range,
//! OneHot, DepthToSpace/SpaceToDepth, Trilu, Pad, CenterCropPad and EyeLike.
//!
//! Data-movement kernels work for every dtype (including bool and string) through the
//! [`Movable`] trait and the [`dispatch_any!`] macro. Shape-only ops (Reshape, Squeeze,
//! Unsqueeze, Flatten, Identity) take their input by value and only rewrite the shape, so they
//! are zero-copy when they hold the last reference to the buffer.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::common::{broadcast_shapes, norm_axis, norm_axis_incl, strides};
use crate::value::Value;
use npuc_ir::{bf16, f16, DType, Tensor};

/// An element type that data-movement kernels can copy: every typed tensor storage,
/// strings included. `view` borrows a tensor's elements, `build` makes a tensor of `dtype`
/// (which matters for the 4-bit types, stored unpacked as `i8`/`u8`).
pub trait Movable: Clone + Default + Send + Sync + 'static {
    fn view(t: &Tensor) -> Result<&[Self]>;
    fn build(dtype: DType, shape: Vec<usize>, v: Vec<Self>) -> Result<Tensor>;
    /// An output buffer of `len` values that the caller overwrites entirely (plain data types
    /// skip zeroing it: see `buffers::for_overwrite`).
    fn out_buffer(len: usize) -> Vec<Self> {
        crate::buffers::filled(len, Self::default())
    }
    /// `dst[3 r + c] = [p0, p1, p2][c][r]` by a vector kernel where the type has one (f32:
    /// `kernels::interleave`); `false` leaves `dst` to the generic copy.
    fn interleave3(_p0: &[Self], _p1: &[Self], _p2: &[Self], _dst: &mut [Self]) -> bool {
        false
    }
    /// `dst` = `src` (equal lengths): plain data types copy short runs at a fixed width.
    fn copy_run(dst: &mut [Self], src: &[Self]) {
        dst.clone_from_slice(src)
    }
}

macro_rules! movable_pod {
    ($($t:ty $(=> $interleave3:path)?),*) => {$(
        impl Movable for $t {
            $(
            fn interleave3(p0: &[Self], p1: &[Self], p2: &[Self], dst: &mut [Self]) -> bool {
                $interleave3(p0, p1, p2, dst)
            }
            )?
            fn view(t: &Tensor) -> Result<&[Self]> {
                Ok(t.as_slice::<$t>()?)
            }
            fn build(_dtype: DType, shape: Vec<usize>, v: Vec<Self>) -> Result<Tensor> {
                Ok(Tensor::from_vec(shape, v)?)
            }
            fn out_buffer(len: usize) -> Vec<Self> {
                crate::buffers::for_overwrite(len)
            }
            #[inline(always)]
            fn copy_run(dst: &mut [Self], src: &[Self]) {
                crate::ops::common::copy_run(dst, src)
            }
        }
    )*};
}
movable_pod!(f32 => crate::kernels::interleave::interleave3, f64, f16, bf16, i16, u16, i32, u32, i64, u64, bool);

impl Movable for i8 {
    fn view(t: &Tensor) -> Result<&[Self]> {
        Ok(t.as_slice::<i8>()?)
    }
    fn build(dtype: DType, shape: Vec<usize>, v: Vec<Self>) -> Result<Tensor> {
        if dtype != DType::I8 {
            return Ok(Tensor::from_codes(
                dtype,
                shape,
                v.into_iter().map(|x| x as u8).collect(),
            )?);
        }
        Ok(Tensor::from_vec(shape, v)?)
    }
}

impl Movable for u8 {
    fn view(t: &Tensor) -> Result<&[Self]> {
        Ok(t.as_slice::<u8>()?)
    }
    fn build(dtype: DType, shape: Vec<usize>, v: Vec<Self>) -> Result<Tensor> {
        if dtype != DType::U8 {
            // Sub-byte integers and small floats keep their dtype.
            return Ok(Tensor::from_codes(dtype, shape, v)?);
        }
        Ok(Tensor::from_vec(shape, v)?)
    }
}

impl Movable for String {
    fn view(t: &Tensor) -> Result<&[Self]> {
        Ok(t.as_strings()?)
    }
    fn build(_dtype: DType, shape: Vec<usize>, v: Vec<Self>) -> Result<Tensor> {
        Ok(Tensor::from_strings(shape, v)?)
    }
}

/// Dispatches on any dtype, binding `$T` to its [`Movable`] element type (4-bit types bind
/// their unpacked byte type). The enclosing function must return `Result<_, RtError>`.
macro_rules! dispatch_any {
    ($dt:expr, $T:ident => $body:expr) => {{
        use npuc_ir::DType as __D;
        match $dt {
            __D::String => {
                type $T = String;
                $body
            }
            __D::Bool => {
                type $T = bool;
                $body
            }
            __D::I4 | __D::I2 => {
                type $T = i8;
                $body
            }
            __D::U4
            | __D::U2
            | __D::F8E4M3FN
            | __D::F8E4M3FNUZ
            | __D::F8E5M2
            | __D::F8E5M2FNUZ
            | __D::F8E8M0
            | __D::F4E2M1 => {
                type $T = u8;
                $body
            }
            _ => $crate::dispatch_numeric!($dt, $T => $body),
        }
    }};
}
#[allow(unused_imports)] // used by sibling modules
pub(crate) use dispatch_any;

/// The first element of `t` as `T` (None when empty).
pub fn first_elem<T: Movable>(t: &Tensor) -> Result<Option<T>> {
    Ok(T::view(t)?.first().cloned())
}

/// Resolves an axis of a tensor that must have rank >= 1 (unlike [`norm_axis`], a scalar is
/// rejected, so the result always indexes the shape).
pub fn real_axis(axis: i64, rank: usize) -> Result<usize> {
    if rank == 0 {
        bail!("axis {axis} given for a scalar input");
    }
    norm_axis(axis, rank)
}

/// Element count of a shape built from untrusted values, failing on overflow.
pub fn checked_numel(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|&n| n <= isize::MAX as usize / 16)
        .ok_or_else(|| crate::RtError::msg(format!("shape {shape:?} is too large")))
}

/// Converts a non-negative i64 (from a shape tensor or attribute) to a dimension.
pub fn to_dim(v: i64, what: &str) -> Result<usize> {
    if v < 0 {
        bail!("{what} must be non-negative, got {v}");
    }
    Ok(v as usize)
}

/// Builds a tensor of `dtype` from f64 values (used for small generated tensors: EyeLike,
/// Range, attribute values). Strings are rejected.
pub fn tensor_from_f64(dtype: DType, shape: Vec<usize>, v: Vec<f64>) -> Result<Tensor> {
    macro_rules! mk {
        ($t:ty, $f:expr) => {
            Tensor::from_vec::<$t>(shape, v.into_iter().map($f).collect())?
        };
    }
    Ok(match dtype {
        DType::F32 => mk!(f32, |x| x as f32),
        DType::F64 => mk!(f64, |x| x),
        DType::F16 => mk!(f16, f16::from_f64),
        DType::BF16 => mk!(bf16, bf16::from_f64),
        DType::I8 => mk!(i8, |x| x as i8),
        DType::U8 => mk!(u8, |x| x as u8),
        DType::I16 => mk!(i16, |x| x as i16),
        DType::U16 => mk!(u16, |x| x as u16),
        DType::I32 => mk!(i32, |x| x as i32),
        DType::U32 => mk!(u32, |x| x as u32),
        DType::I64 => mk!(i64, |x| x as i64),
        DType::U64 => mk!(u64, |x| x as u64),
        DType::Bool => mk!(bool, |x| x != 0.0),
        DType::I4 | DType::U4 | DType::I2 | DType::U2 => Tensor::from_codes(
            dtype,
            shape,
            v.into_iter().map(|x| x as i64 as u8).collect(),
        )?,
        d if d.is_small_float() => Tensor::from_codes(
            dtype,
            shape,
            v.into_iter()
                .map(|x| npuc_ir::lowp::from_f32(d, x as f32, true).unwrap_or(0))
                .collect(),
        )?,
        DType::String => bail!("cannot build a string tensor from numbers"),
        d => bail!("cannot build a {d} tensor from numbers"),
    })
}

/// Calls `f` with the source offset of every index of `shape` (row-major), where moving one
/// step along dim `d` moves the offset by `strides[d]`.
fn for_each_offset(shape: &[usize], strides: &[isize], base: isize, mut f: impl FnMut(isize)) {
    let n: usize = shape.iter().product();
    let rank = shape.len();
    let mut idx = vec![0usize; rank];
    let mut off = base;
    for _ in 0..n {
        f(off);
        for d in (0..rank).rev() {
            idx[d] += 1;
            off += strides[d];
            if idx[d] < shape[d] {
                break;
            }
            off -= strides[d] * shape[d] as isize;
            idx[d] = 0;
        }
    }
}

/// Copies the strided view of `src` starting at `base` with the given output `shape` and
/// per-dimension source `strides` (which may be 0 for broadcasts or negative for reversed
/// slices) into a new row-major vector.
///
/// Dims of size 1 are dropped and adjacent dims that are contiguous in the source are merged
/// first, so the common cases become a few long `memcpy`s (slices, transposes that keep the
/// last axis) or a cache-blocked 2-D transpose (transposes that swap the last two axes).
pub fn strided_copy<T: Movable>(
    src: &[T],
    base: usize,
    shape: &[usize],
    strides: &[isize],
) -> Result<Vec<T>> {
    strided_copy_mt(src, base, shape, strides, 1)
}

/// Outputs smaller than this many elements are copied on one thread (with the session's
/// workers kept awake a split costs a few microseconds; 64K values are ~20 us of copying).
const PAR_MIN: usize = 1 << 16;

/// [`strided_copy`] that splits large copies across up to `threads` rayon tasks along the
/// outermost (merged) dimension.
pub fn strided_copy_mt<T: Movable>(
    src: &[T],
    base: usize,
    shape: &[usize],
    strides: &[isize],
    threads: usize,
) -> Result<Vec<T>> {
    use rayon::prelude::*;
    if shape.len() != strides.len() {
        bail!(
            "strided view has {} dims but {} strides",
            shape.len(),
            strides.len()
        );
    }
    let total = checked_numel(shape)?;
    if total == 0 {
        return Ok(vec![]);
    }
    // Drop unit dims, then merge dims that are contiguous with their inner neighbour.
    let mut dims: Vec<(usize, isize)> = Vec::with_capacity(shape.len());
    for (&n, &s) in shape.iter().zip(strides) {
        if n == 1 {
            continue;
        }
        if let Some(last) = dims.last_mut() {
            if last.1 == s * n as isize {
                last.0 *= n;
                last.1 = s;
                continue;
            }
        }
        dims.push((n, s));
    }
    // Validate that every offset the view touches lies inside `src`.
    let (mut lo, mut hi) = (base as isize, base as isize);
    for &(n, s) in &dims {
        let span = s * (n as isize - 1);
        if span < 0 {
            lo += span;
        } else {
            hi += span;
        }
    }
    if lo < 0 || hi as usize >= src.len() {
        bail!(
            "strided view [{lo}, {hi}] is outside a buffer of {} elements",
            src.len()
        );
    }
    // Every output value is written below (the strided copy covers the whole shape).
    let mut out = T::out_buffer(total);
    let Some(&(n0, s0)) = dims.first() else {
        out[0] = src[base].clone();
        return Ok(out);
    };
    let tasks = threads.min(n0);
    if tasks > 1 && total >= PAR_MIN {
        let per = n0.div_ceil(tasks);
        let rest = total / n0;
        out.par_chunks_mut(per * rest)
            .enumerate()
            .for_each(|(i, chunk)| {
                let mut d = dims.clone();
                d[0].0 = chunk.len() / rest;
                let b = base as isize + (i * per) as isize * s0;
                fill_strided(src, b, &d, chunk);
            });
    } else {
        fill_strided(src, base as isize, &dims, &mut out);
    }
    Ok(out)
}

/// Fills `out` (row-major over `dims` sizes) from `src` at `base` + Σ index·stride.
/// The caller has checked that every offset is inside `src`.
fn fill_strided<T: Movable>(src: &[T], base: isize, dims: &[(usize, isize)], out: &mut [T]) {
    let Some(&(inner, inner_stride)) = dims.last() else {
        return;
    };
    let k = dims.len() - 1;
    let outer_shape: Vec<usize> = dims[..k].iter().map(|d| d.0).collect();
    let outer_strides: Vec<isize> = dims[..k].iter().map(|d| d.1).collect();
    match inner_stride {
        1 => {
            let mut rows = out.chunks_mut(inner);
            for_each_offset(&outer_shape, &outer_strides, base, |o| {
                if let Some(row) = rows.next() {
                    let o = o as usize;
                    row.clone_from_slice(&src[o..o + inner]);
                }
            })
        }
        0 => {
            let mut rows = out.chunks_mut(inner);
            for_each_offset(&outer_shape, &outer_strides, base, |o| {
                if let Some(row) = rows.next() {
                    row.fill(src[o as usize].clone());
                }
            })
        }
        s if k >= 1 && dims[k - 1].1 == 1 => {
            // The last two output dims are a transposed pair: copy tiles so that both the
            // reads and the writes stay within a few cache lines.
            const TILE: usize = 32;
            let rows = dims[k - 1].0;
            let cols = inner;
            let mut blocks = out.chunks_mut(rows * cols);
            for_each_offset(&outer_shape[..k - 1], &outer_strides[..k - 1], base, |o| {
                let Some(dst) = blocks.next() else { return };
                // Three planes into pixels (an RGB image to channels-last).
                if cols == 3 {
                    let plane = |c: isize| &src[(o + c * s) as usize..][..rows];
                    if T::interleave3(plane(0), plane(1), plane(2), dst) {
                        return;
                    }
                }
                for r0 in (0..rows).step_by(TILE) {
                    for c0 in (0..cols).step_by(TILE) {
                        for r in r0..(r0 + TILE).min(rows) {
                            let row = &mut dst[r * cols + c0..r * cols + (c0 + TILE).min(cols)];
                            let first = o + r as isize + c0 as isize * s;
                            for (c, d) in row.iter_mut().enumerate() {
                                *d = src[(first + c as isize * s) as usize].clone();
                            }
                        }
                    }
                }
            });
        }
        s => {
            let mut rows = out.chunks_mut(inner);
            for_each_offset(&outer_shape, &outer_strides, base, |o| {
                if let Some(row) = rows.next() {
                    for (j, d) in row.iter_mut().enumerate() {
                        *d = src[(o + j as isize * s) as usize].clone();
                    }
                }
            })
        }
    }
}

/// [`strided_copy`] over a whole tensor, producing a tensor of the same dtype.
pub fn strided_tensor(
    t: &Tensor,
    base: usize,
    shape: Vec<usize>,
    strides: &[isize],
    threads: usize,
) -> Result<Tensor> {
    dispatch_any!(t.dtype(), T => {
        let v = strided_copy_mt(T::view(t)?, base, &shape, strides, threads)?;
        T::build(t.dtype(), shape, v)
    })
}

fn isize_strides(shape: &[usize]) -> Vec<isize> {
    strides(shape).into_iter().map(|s| s as isize).collect()
}

/// Transposes `t` by `perm` (output dim i is input dim perm[i]).
pub fn transpose_tensor(t: &Tensor, perm: &[usize], threads: usize) -> Result<Tensor> {
    let st = isize_strides(t.shape());
    let shape: Vec<usize> = perm.iter().map(|&p| t.shape()[p]).collect();
    let s: Vec<isize> = perm.iter().map(|&p| st[p]).collect();
    strided_tensor(t, 0, shape, &s, threads)
}

fn tensor_input_ints(ins: &Inputs, i: usize) -> Result<Option<Vec<i64>>> {
    Ok(match ins.opt_tensor(i) {
        Some(t) => Some(t.to_i64_vec()?),
        None => None,
    })
}

// ---------------------------------------------------------------------------------------------
// Constant, Identity

/// Constant: the tensor held by whichever `value*` attribute is set.
fn constant(ctx: &OpCtx, _ins: Inputs) -> Result<Vec<Value>> {
    let n = ctx.node;
    let t = if let Some(t) = n.attr_tensor("value")? {
        t.clone()
    } else if let Some(t) = n.attr_tensor("sparse_value")? {
        // Sparse tensors are densified on import.
        t.clone()
    } else if let Some(f) = n.attr_float("value_float")? {
        Tensor::scalar(f)
    } else if let Some(v) = n.attr_floats("value_floats")? {
        Tensor::from_vec(vec![v.len()], v.to_vec())?
    } else if let Some(i) = n.attr_int("value_int")? {
        Tensor::scalar(i)
    } else if let Some(v) = n.attr_ints("value_ints")? {
        Tensor::from_vec(vec![v.len()], v.to_vec())?
    } else if let Some(s) = n.attr_str("value_string")? {
        Tensor::from_strings(vec![], vec![s.to_string()])?
    } else if let Some(v) = n.attr_strings("value_strings")? {
        Tensor::from_strings(vec![v.len()], v.to_vec())?
    } else {
        bail!("Constant has none of the value attributes");
    };
    Ok(vec![Value::tensor(t)])
}

/// Identity: passes its input through (tensor, sequence or optional) without copying.
fn identity(_ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    match ins.take_value(0) {
        Some(v) => Ok(vec![v]),
        None => bail!("Identity needs an input"),
    }
}

// ---------------------------------------------------------------------------------------------
// Reshape, Flatten, Squeeze, Unsqueeze (zero-copy)

/// Resolves a Reshape target against the input shape: 0 copies the input dim (unless
/// `allowzero`), -1 is inferred from the element count.
pub fn reshape_target(input: &[usize], target: &[i64], allowzero: bool) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &d) in target.iter().enumerate() {
        match d {
            -1 => {
                if infer.is_some() {
                    bail!("reshape target {target:?} has more than one -1");
                }
                infer = Some(i);
                out.push(1);
            }
            0 if !allowzero => match input.get(i) {
                Some(&n) => out.push(n),
                None => bail!(
                    "reshape target {target:?} copies dim {i} of a rank-{} input",
                    input.len()
                ),
            },
            d if d < 0 => bail!("reshape target {target:?} has an invalid dim {d}"),
            d => out.push(d as usize),
        }
    }
    let total: usize = input.iter().product();
    if let Some(i) = infer {
        let known = checked_numel(&out)?;
        if known == 0 || !total.is_multiple_of(known) {
            bail!("cannot reshape {input:?} to {target:?}");
        }
        out[i] = total / known;
    }
    if checked_numel(&out)? != total {
        bail!("cannot reshape {input:?} ({total} elements) to {target:?}");
    }
    Ok(out)
}

/// Reshape (opset 1 `shape` attribute, opset 5+ shape input, opset 14 `allowzero`).
fn reshape(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let target = match tensor_input_ints(&ins, 1)? {
        Some(v) => v,
        None => match ctx.node.attr_ints("shape")? {
            Some(v) => v.to_vec(),
            None => bail!("Reshape needs a shape input"),
        },
    };
    let allowzero = ctx.node.int_or("allowzero", 0)? != 0;
    let t = ins.take_tensor(0)?;
    let shape = reshape_target(t.shape(), &target, allowzero)?;
    Ok(vec![Value::tensor(t.reshaped(shape)?)])
}

/// Flatten: to 2-D at `axis` (negative allowed since opset 11).
fn flatten(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.take_tensor(0)?;
    let rank = t.rank() as i64;
    let axis = ctx.node.int_or("axis", 1)?;
    let axis = if axis < 0 { axis + rank } else { axis };
    if !(0..=rank).contains(&axis) {
        bail!("Flatten axis is out of range for rank {rank}");
    }
    let axis = axis as usize;
    let a: usize = t.shape()[..axis].iter().product();
    let b: usize = t.shape()[axis..].iter().product();
    Ok(vec![Value::tensor(t.reshaped(vec![a, b])?)])
}

/// Squeeze: removes the given unit axes (attribute before opset 13, input after), or all
/// unit axes when none are given.
fn squeeze(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let axes = match ctx.node.attr_ints("axes")? {
        Some(a) => Some(a.to_vec()),
        None => tensor_input_ints(&ins, 1)?,
    };
    let t = ins.take_tensor(0)?;
    let rank = t.rank();
    let shape: Vec<usize> = match axes {
        None => t.shape().iter().copied().filter(|&d| d != 1).collect(),
        Some(axes) => {
            let mut drop = vec![false; rank];
            for a in axes {
                let a = real_axis(a, rank)?;
                if t.shape()[a] != 1 {
                    bail!("cannot squeeze axis {a} of size {}", t.shape()[a]);
                }
                drop[a] = true;
            }
            t.shape()
                .iter()
                .zip(&drop)
                .filter(|(_, &d)| !d)
                .map(|(&n, _)| n)
                .collect()
        }
    };
    Ok(vec![Value::tensor(t.reshaped(shape)?)])
}

/// Unsqueeze: inserts unit axes at the given output positions (attribute before opset 13).
fn unsqueeze(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let axes = match ctx.node.attr_ints("axes")? {
        Some(a) => a.to_vec(),
        None => match tensor_input_ints(&ins, 1)? {
            Some(a) => a,
            None => bail!("Unsqueeze needs axes"),
        },
    };
    let t = ins.take_tensor(0)?;
    let out_rank = t.rank() + axes.len();
    let mut is_new = vec![false; out_rank];
    for &a in &axes {
        let a = real_axis(a, out_rank)?;
        if is_new[a] {
            bail!("Unsqueeze axes {axes:?} repeat an axis");
        }
        is_new[a] = true;
    }
    let mut src = t.shape().iter();
    let shape: Vec<usize> = is_new
        .iter()
        .map(|&new| {
            if new {
                1
            } else {
                src.next().copied().unwrap_or(1)
            }
        })
        .collect();
    Ok(vec![Value::tensor(t.reshaped(shape)?)])
}

// ---------------------------------------------------------------------------------------------
// Shape, Size

/// Shape: the input's dims as a 1-D i64 tensor, optionally sliced by `start`/`end` (opset 15).
fn shape_op(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let dims: Vec<i64> = match ins.value(0) {
        Some(Value::Tensor(t)) => t.shape().iter().map(|&d| d as i64).collect(),
        _ => bail!("Shape needs a tensor input"),
    };
    let r = dims.len() as i64;
    let clamp = |v: i64| if v < 0 { (v + r).max(0) } else { v.min(r) };
    let start = clamp(ctx.node.int_or("start", 0)?) as usize;
    let end = match ctx.node.attr_int("end")? {
        Some(e) => clamp(e) as usize,
        None => r as usize,
    };
    let v = if start < end {
        dims[start..end].to_vec()
    } else {
        vec![]
    };
    Ok(vec![Value::tensor(Tensor::from_vec(vec![v.len()], v)?)])
}

/// Size: the element count as an i64 scalar.
fn size_op(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = ins.tensor(0)?.len() as i64;
    Ok(vec![Value::tensor(Tensor::scalar(n))])
}

// ---------------------------------------------------------------------------------------------
// Transpose, Concat, Split, Slice

/// Transpose by `perm` (default: reverse the axes).
fn transpose(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let rank = ins.tensor(0)?.rank();
    let perm: Vec<usize> = match ctx.node.attr_ints("perm")? {
        Some(p) => {
            if p.len() != rank {
                bail!("perm {p:?} does not match input rank {rank}");
            }
            let mut seen = vec![false; rank];
            let mut out = Vec::with_capacity(rank);
            for &a in p {
                let a = real_axis(a, rank)?;
                if seen[a] {
                    bail!("perm {p:?} is not a permutation");
                }
                seen[a] = true;
                out.push(a);
            }
            out
        }
        None => (0..rank).rev().collect(),
    };
    // An identity permutation (after ignoring unit dims) is a pure reshape.
    let t = ins.tensor(0)?;
    let moved: Vec<usize> = perm
        .iter()
        .copied()
        .filter(|&p| t.shape()[p] != 1)
        .collect();
    if moved.windows(2).all(|w| w[0] < w[1]) {
        let shape: Vec<usize> = perm.iter().map(|&p| t.shape()[p]).collect();
        let t = ins.take_tensor(0)?;
        return Ok(vec![Value::tensor(t.reshaped(shape)?)]);
    }
    Ok(vec![Value::tensor(transpose_tensor(
        t,
        &perm,
        ctx.threads,
    )?)])
}

fn concat_typed<T: Movable>(
    ts: &[&Tensor],
    axis: usize,
    shape: Vec<usize>,
    threads: usize,
) -> Result<Tensor> {
    use rayon::prelude::*;
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let srcs: Vec<(&[T], usize)> = ts
        .iter()
        .map(|t| Ok((T::view(t)?, t.shape()[axis] * inner)))
        .collect::<Result<_>>()?;
    // One output row: every input's chunk of that outer index, in order.
    let row: usize = srcs.iter().map(|s| s.1).sum();
    let total = outer * row;
    if total == 0 {
        return T::build(ts[0].dtype(), shape, vec![]);
    }
    // Every value is written below (the rows cover the output).
    let mut out = T::out_buffer(total);
    // Compiled at the CPU's level: a fixed-size run is one or two vector moves, not four
    // to sixteen 16-byte ones.
    let fill = |o0: usize, part: &mut [T]| {
        crate::kernels::fmap::vectorized(ConcatRows {
            srcs: &srcs,
            row,
            o0,
            part,
        })
    };
    // A channels-last Concat (PP-OCRv6's detector head: 4 x 16 channels per pixel) is many
    // short rows: split them across threads rather than copy on one.
    if threads > 1 && outer > 1 && total >= PAR_MIN {
        let per = outer.div_ceil(threads);
        out.par_chunks_mut(per * row)
            .enumerate()
            .for_each(|(i, part)| fill(i * per, part));
    } else {
        fill(0, &mut out);
    }
    T::build(ts[0].dtype(), shape, out)
}

/// Output rows `o0..` of a Concat (`part` holds whole rows of `row` values): each input's
/// chunk of the row, in order.
struct ConcatRows<'a, T> {
    srcs: &'a [(&'a [T], usize)],
    row: usize,
    o0: usize,
    part: &'a mut [T],
}

impl<T: Movable> crate::kernels::fmap::LevelBody for ConcatRows<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        concat_rows(self.srcs, self.row, self.o0, self.part)
    }
}

/// [`ConcatRows`]'s loop, its slices as (no-alias) parameters.
#[inline(always)]
fn concat_rows<T: Movable>(srcs: &[(&[T], usize)], row: usize, o0: usize, part: &mut [T]) {
    for (i, dst) in part.chunks_exact_mut(row).enumerate() {
        let o = o0 + i;
        let mut at = 0;
        for &(s, chunk) in srcs {
            T::copy_run(&mut dst[at..at + chunk], &s[o * chunk..][..chunk]);
            at += chunk;
        }
    }
}

/// Concatenates tensors of equal rank and dtype along `axis`.
pub fn concat_tensors(ts: &[&Tensor], axis: i64) -> Result<Tensor> {
    concat_tensors_mt(ts, axis, 1)
}

/// [`concat_tensors`] with the copies split across up to `threads` threads when large.
pub fn concat_tensors_mt(ts: &[&Tensor], axis: i64, threads: usize) -> Result<Tensor> {
    let Some(first) = ts.first() else {
        bail!("Concat needs at least one input");
    };
    let rank = first.rank();
    let axis = real_axis(axis, rank)?;
    let mut shape = first.shape().to_vec();
    shape[axis] = 0;
    for t in ts {
        if t.dtype() != first.dtype() || t.rank() != rank {
            bail!(
                "Concat inputs differ in dtype or rank: {:?} vs {:?}",
                first,
                t
            );
        }
        for (d, (&a, &b)) in t.shape().iter().zip(&shape).enumerate() {
            if d != axis && a != b {
                bail!(
                    "Concat inputs have shapes {:?} and {:?}",
                    first.shape(),
                    t.shape()
                );
            }
        }
        shape[axis] += t.shape()[axis];
    }
    dispatch_any!(first.dtype(), T => concat_typed::<T>(ts, axis, shape, threads))
}

/// Concat along `axis`.
fn concat(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let ts = ins.tensors()?;
    let axis = ctx.node.int_or("axis", 1)?;
    Ok(vec![Value::tensor(concat_tensors_mt(
        &ts,
        axis,
        ctx.threads,
    )?)])
}

/// Splits `t` along `axis` into consecutive pieces of the given lengths.
pub fn split_tensor(t: &Tensor, axis: usize, lens: &[usize]) -> Result<Vec<Tensor>> {
    let dim = t.shape()[axis];
    if lens.iter().sum::<usize>() != dim {
        bail!("split lengths {lens:?} do not add up to dim {dim}");
    }
    let outer: usize = t.shape()[..axis].iter().product();
    let inner: usize = t.shape()[axis + 1..].iter().product();
    dispatch_any!(t.dtype(), T => {
        let src = T::view(t)?;
        let mut start = 0;
        lens.iter()
            .map(|&len| {
                let mut out: Vec<T> = Vec::with_capacity(outer * len * inner);
                for o in 0..outer {
                    let b = (o * dim + start) * inner;
                    out.extend_from_slice(&src[b..b + len * inner]);
                }
                start += len;
                let mut shape = t.shape().to_vec();
                shape[axis] = len;
                T::build(t.dtype(), shape, out)
            })
            .collect::<Result<Vec<_>>>()
    })
}

/// Split: lengths from the `split` attribute (before opset 13) or input, else equal parts
/// (`num_outputs` since opset 18, where the last part may be smaller).
fn split(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let axis = real_axis(ctx.node.int_or("axis", 0)?, t.rank())?;
    let dim = t.shape()[axis];
    let given = match ctx.node.attr_ints("split")? {
        Some(s) => Some(s.to_vec()),
        None => tensor_input_ints(&ins, 1)?,
    };
    let lens: Vec<usize> = match given {
        Some(s) => {
            if s.len() != ctx.node.outputs.len() {
                bail!(
                    "'split' gives {} lengths {s:?} for {} outputs: one length per output is needed",
                    s.len(),
                    ctx.node.outputs.len()
                );
            }
            s.iter()
                .map(|&v| to_dim(v, "split length"))
                .collect::<Result<_>>()?
        }
        None => {
            let n = match ctx.node.attr_int("num_outputs")? {
                Some(n) => to_dim(n, "num_outputs")?,
                None => ctx.node.outputs.len(),
            };
            if n == 0 {
                bail!("Split into zero outputs");
            }
            if n != ctx.node.outputs.len() {
                // The spec's rule; also what keeps a huge num_outputs from sizing the split.
                bail!(
                    "num_outputs is {n} but the node has {} outputs: they must be equal",
                    ctx.node.outputs.len()
                );
            }
            if ctx.node.attr_int("num_outputs")?.is_some() {
                let chunk = dim.div_ceil(n);
                (0..n)
                    .map(|i| chunk.min(dim.saturating_sub(i * chunk)))
                    .collect()
            } else {
                if dim % n != 0 {
                    bail!("dim {dim} cannot be split evenly into {n} outputs");
                }
                vec![dim / n; n]
            }
        }
    };
    Ok(split_tensor(t, axis, &lens)?
        .into_iter()
        .map(Value::tensor)
        .collect())
}

/// Resolves one Slice axis: returns (start, step, count) in input coordinates.
pub fn slice_axis(dim: usize, start: i64, end: i64, step: i64) -> Result<(usize, i64, usize)> {
    if step == 0 {
        bail!("Slice step cannot be 0");
    }
    if dim == 0 {
        return Ok((0, step, 0));
    }
    let d = dim as i64;
    let fix = |v: i64| if v < 0 { v.saturating_add(d) } else { v };
    let (s, e) = (fix(start), fix(end));
    let (s, e) = if step > 0 {
        (s.clamp(0, d), e.clamp(0, d))
    } else {
        (s.clamp(0, (d - 1).max(0)), e.clamp(-1, d - 1))
    };
    let count = if step > 0 {
        if e > s {
            ((e - s) as u64).div_ceil(step as u64) as usize
        } else {
            0
        }
    } else if s > e {
        ((s - e) as u64).div_ceil(step.unsigned_abs()) as usize
    } else {
        0
    };
    Ok((if count == 0 { 0 } else { s as usize }, step, count))
}

/// Slice: attributes before opset 10, inputs (with optional axes and steps) after.
fn slice(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let rank = t.rank();
    let (starts, ends, axes, steps) = if let Some(s) = ctx.node.attr_ints("starts")? {
        (
            s.to_vec(),
            ctx.node.ints_req("ends")?.to_vec(),
            ctx.node.attr_ints("axes")?.map(|a| a.to_vec()),
            None,
        )
    } else {
        let req = |i: usize, name: &str| -> Result<Vec<i64>> {
            match tensor_input_ints(&ins, i)? {
                Some(v) => Ok(v),
                None => bail!("Slice needs a '{name}' input"),
            }
        };
        (
            req(1, "starts")?,
            req(2, "ends")?,
            tensor_input_ints(&ins, 3)?,
            tensor_input_ints(&ins, 4)?,
        )
    };
    let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        bail!("Slice starts/ends/axes/steps differ in length");
    }
    let in_st = isize_strides(t.shape());
    let mut shape = t.shape().to_vec();
    let mut st = in_st.clone();
    let mut base = 0usize;
    let mut seen = vec![false; rank];
    for i in 0..starts.len() {
        let a = real_axis(axes[i], rank)?;
        if seen[a] {
            bail!("Slice axes {axes:?} repeat an axis");
        }
        seen[a] = true;
        let (s, step, count) = slice_axis(t.shape()[a], starts[i], ends[i], steps[i])?;
        shape[a] = count;
        st[a] = in_st[a] * step as isize;
        base += s * in_st[a] as usize;
    }
    if shape.iter().product::<usize>() == 0 {
        return Ok(vec![Value::tensor(dispatch_any!(t.dtype(), T => {
            T::build(t.dtype(), shape, vec![])?
        }))]);
    }
    Ok(vec![Value::tensor(strided_tensor(
        t,
        base,
        shape,
        &st,
        ctx.threads,
    )?)])
}

// ---------------------------------------------------------------------------------------------
// Expand, Tile

/// Expand: broadcasts the input to the (bidirectionally broadcast) shape input.
fn expand(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let target: Vec<usize> = ins
        .tensor(1)?
        .to_i64_vec()?
        .into_iter()
        .map(|d| to_dim(d, "Expand shape dim"))
        .collect::<Result<_>>()?;
    let t = ins.tensor(0)?;
    let shape = broadcast_shapes(t.shape(), &target)?;
    checked_numel(&shape)?;
    if shape == t.shape() {
        return Ok(vec![Value::tensor(ins.take_tensor(0)?)]);
    }
    let off = shape.len() - t.rank();
    let st = isize_strides(t.shape());
    let bst: Vec<isize> = (0..shape.len())
        .map(|i| {
            if i < off || t.shape()[i - off] == 1 {
                0
            } else {
                st[i - off]
            }
        })
        .collect();
    Ok(vec![Value::tensor(strided_tensor(
        t,
        0,
        shape,
        &bst,
        ctx.threads,
    )?)])
}

/// Tile: repeats the input `repeats[d]` times along each dim.
fn tile(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let reps = ins.tensor(1)?.to_i64_vec()?;
    if reps.len() != t.rank() {
        bail!("Tile repeats {reps:?} do not match input rank {}", t.rank());
    }
    // View the output as [r0, d0, r1, d1, ...] with stride 0 on the repeat dims.
    let st = isize_strides(t.shape());
    let mut vshape = Vec::with_capacity(2 * t.rank());
    let mut vst = Vec::with_capacity(2 * t.rank());
    let mut out_shape = Vec::with_capacity(t.rank());
    for (d, &r) in reps.iter().enumerate() {
        let r = to_dim(r, "Tile repeat")?;
        vshape.extend([r, t.shape()[d]]);
        vst.extend([0, st[d]]);
        out_shape.push(r * t.shape()[d]);
    }
    checked_numel(&vshape)?;
    if out_shape.iter().product::<usize>() == 0 {
        return Ok(vec![Value::tensor(dispatch_any!(t.dtype(), T => {
            T::build(t.dtype(), out_shape, vec![])?
        }))]);
    }
    let out = strided_tensor(t, 0, vshape, &vst, ctx.threads)?;
    Ok(vec![Value::tensor(out.reshaped(out_shape)?)])
}

// ---------------------------------------------------------------------------------------------
// ConstantOfShape, Range, OneHot, EyeLike

/// ConstantOfShape: a tensor of the given shape filled with the one-element `value`
/// attribute (default f32 zero).
fn constant_of_shape(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let shape: Vec<usize> = ins
        .tensor(0)?
        .to_i64_vec()?
        .into_iter()
        .map(|d| to_dim(d, "ConstantOfShape dim"))
        .collect::<Result<_>>()?;
    let n = checked_numel(&shape)?;
    let value = match ctx.node.attr_tensor("value")? {
        Some(v) => v.clone(),
        None => Tensor::scalar(0f32),
    };
    let out = dispatch_any!(value.dtype(), T => {
        let Some(x) = first_elem::<T>(&value)? else {
            bail!("ConstantOfShape value is empty");
        };
        T::build(value.dtype(), shape, vec![x; n])?
    });
    Ok(vec![Value::tensor(out)])
}

/// Range: `start, start+delta, ...` up to (excluding) `limit`.
fn range(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let (s, l, d) = (ins.tensor(0)?, ins.tensor(1)?, ins.tensor(2)?);
    let dt = s.dtype();
    if l.dtype() != dt || d.dtype() != dt {
        bail!("Range inputs must share a dtype");
    }
    let first = |t: &Tensor| -> Result<f64> {
        match t.to_f64_vec()?.first() {
            Some(&x) => Ok(x),
            None => bail!("Range inputs must be scalars"),
        }
    };
    if dt.is_float() {
        let (start, limit, delta) = (first(s)?, first(l)?, first(d)?);
        if delta == 0.0 {
            bail!("Range delta cannot be 0");
        }
        let n = ((limit - start) / delta).ceil().max(0.0);
        if !n.is_finite() || n > (isize::MAX as usize / 16) as f64 {
            bail!("Range of {n} elements is too large");
        }
        let n = n as usize;
        let v: Vec<f64> = (0..n).map(|i| start + i as f64 * delta).collect();
        return Ok(vec![Value::tensor(tensor_from_f64(dt, vec![n], v)?)]);
    }
    let one = |t: &Tensor| -> Result<i64> {
        match t.to_i64_vec()?.first() {
            Some(&x) => Ok(x),
            None => bail!("Range inputs must be scalars"),
        }
    };
    let (start, limit, delta) = (one(s)?, one(l)?, one(d)?);
    if delta == 0 {
        bail!("Range delta cannot be 0");
    }
    let span = limit as i128 - start as i128;
    let n = if (span > 0) == (delta > 0) && span != 0 {
        ((span.abs() + delta.unsigned_abs() as i128 - 1) / delta.unsigned_abs() as i128) as usize
    } else {
        0
    };
    checked_numel(&[n])?;
    let v: Vec<i64> = (0..n as i64).map(|i| start + i * delta).collect();
    let out = match dt {
        DType::I64 => Tensor::from_vec(vec![n], v)?,
        _ => tensor_from_f64(dt, vec![n], v.into_iter().map(|x| x as f64).collect())?,
    };
    Ok(vec![Value::tensor(out)])
}

/// OneHot: inserts a `depth` axis at `axis`; `values` = [off, on].
fn one_hot(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let idx = ins.tensor(0)?;
    let depth = match ins.tensor(1)?.to_f64_vec()?.first() {
        Some(&d) if d >= 1.0 => d as usize,
        _ => bail!("OneHot depth must be a positive scalar"),
    };
    let values = ins.tensor(2)?;
    if values.len() != 2 {
        bail!("OneHot values must have two elements");
    }
    let axis = norm_axis_incl(ctx.node.int_or("axis", -1)?, idx.rank())?;
    let ids: Vec<i64> = idx.to_f64_vec()?.into_iter().map(|x| x as i64).collect();
    let outer: usize = idx.shape()[..axis].iter().product();
    let inner: usize = idx.shape()[axis..].iter().product();
    let mut shape = idx.shape().to_vec();
    shape.insert(axis, depth);
    checked_numel(&shape)?;
    let out = dispatch_any!(values.dtype(), T => {
        let v = one_hot_fill(T::view(values)?, &ids, outer, depth, inner);
        T::build(values.dtype(), shape, v)?
    });
    Ok(vec![Value::tensor(out)])
}

fn one_hot_fill<T: Movable>(
    v: &[T],
    ids: &[i64],
    outer: usize,
    depth: usize,
    inner: usize,
) -> Vec<T> {
    let (off, on) = (&v[0], &v[1]);
    let mut out = vec![off.clone(); outer * depth * inner];
    for o in 0..outer {
        for i in 0..inner {
            let mut k = ids[o * inner + i];
            if k < 0 {
                k += depth as i64;
            }
            if (0..depth as i64).contains(&k) {
                out[(o * depth + k as usize) * inner + i] = on.clone();
            }
        }
    }
    out
}

/// EyeLike: a 2-D tensor with ones on diagonal `k`, of the input's shape and the `dtype`
/// attribute's (or the input's) type.
fn eye_like(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    if t.rank() != 2 {
        bail!("EyeLike needs a 2-D input");
    }
    let dt = match ctx.node.attr_int("dtype")? {
        Some(c) => match DType::from_onnx_code(c as i32) {
            Some(d) => d,
            None => bail!("unknown dtype code {c}"),
        },
        None => t.dtype(),
    };
    let (r, c) = (t.shape()[0], t.shape()[1]);
    let k = ctx.node.int_or("k", 0)?;
    let mut v = vec![0f64; r * c];
    for i in 0..r {
        let j = i as i64 + k;
        if (0..c as i64).contains(&j) {
            v[i * c + j as usize] = 1.0;
        }
    }
    Ok(vec![Value::tensor(tensor_from_f64(dt, vec![r, c], v)?)])
}

// ---------------------------------------------------------------------------------------------
// DepthToSpace, SpaceToDepth, Trilu

/// DepthToSpace (DCR or CRD mode): moves channel blocks into spatial blocks.
fn depth_to_space(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let b = to_dim(ctx.node.int_req("blocksize")?, "blocksize")?;
    let &[n, c, h, w] = t.shape() else {
        bail!("DepthToSpace needs a 4-D input");
    };
    if b == 0 || c % (b * b) != 0 {
        bail!("channels {c} are not divisible by blocksize² ({b}²)");
    }
    let c2 = c / (b * b);
    let crd = ctx.node.str_or("mode", "DCR")? == "CRD";
    let (view, perm): (Vec<usize>, [usize; 6]) = if crd {
        (vec![n, c2, b, b, h, w], [0, 1, 4, 2, 5, 3])
    } else {
        (vec![n, b, b, c2, h, w], [0, 3, 4, 1, 5, 2])
    };
    let st = isize_strides(&view);
    let shape: Vec<usize> = perm.iter().map(|&p| view[p]).collect();
    let s: Vec<isize> = perm.iter().map(|&p| st[p]).collect();
    let out = strided_tensor(t, 0, shape, &s, ctx.threads)?.reshaped(vec![n, c2, h * b, w * b])?;
    Ok(vec![Value::tensor(out)])
}

/// SpaceToDepth: moves spatial blocks into channels.
fn space_to_depth(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let b = to_dim(ctx.node.int_req("blocksize")?, "blocksize")?;
    let &[n, c, h, w] = t.shape() else {
        bail!("SpaceToDepth needs a 4-D input");
    };
    if b == 0 || h % b != 0 || w % b != 0 {
        bail!("spatial dims {h}x{w} are not divisible by blocksize {b}");
    }
    let view = [n, c, h / b, b, w / b, b];
    let perm = [0, 3, 5, 1, 2, 4];
    let st = isize_strides(&view);
    let shape: Vec<usize> = perm.iter().map(|&p| view[p]).collect();
    let s: Vec<isize> = perm.iter().map(|&p| st[p]).collect();
    let out =
        strided_tensor(t, 0, shape, &s, ctx.threads)?.reshaped(vec![n, c * b * b, h / b, w / b])?;
    Ok(vec![Value::tensor(out)])
}

/// Trilu: keeps the upper (j - i >= k) or lower (j - i <= k) triangle of the last two dims.
fn trilu(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let k = match ins.opt_tensor(1) {
        Some(t) => match t.to_i64_vec()?.first() {
            Some(&k) => k,
            None => bail!("Trilu k must be a scalar"),
        },
        None => 0,
    };
    let upper = ctx.node.int_or("upper", 1)? != 0;
    let t = ins.take_tensor(0)?;
    if t.rank() < 2 {
        bail!("Trilu needs a rank >= 2 input");
    }
    let (r, c) = (t.shape()[t.rank() - 2], t.shape()[t.rank() - 1]);
    let dt = t.dtype();
    let shape = t.shape().to_vec();
    let out = dispatch_any!(dt, T => {
        let mut v: Vec<T> = T::view(&t)?.to_vec();
        zero_outside(&mut v, r, c, |i, j| {
            let d = j as i64 - i as i64;
            if upper { d >= k } else { d <= k }
        });
        T::build(dt, shape, v)?
    });
    Ok(vec![Value::tensor(out)])
}

fn zero_outside<T: Default>(v: &mut [T], r: usize, c: usize, keep: impl Fn(usize, usize) -> bool) {
    if r * c == 0 {
        return;
    }
    for m in v.chunks_mut(r * c) {
        for i in 0..r {
            for j in 0..c {
                if !keep(i, j) {
                    m[i * c + j] = T::default();
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Pad, CenterCropPad

/// Where an output coordinate along one axis reads from: an input index, or the fill value.
type AxisMap = Vec<Option<usize>>;

/// Copies `src` into the output described by one index map per axis (`None` = fill).
fn gather_by_maps<T: Movable>(src: &[T], in_shape: &[usize], maps: &[AxisMap], fill: &T) -> Vec<T> {
    let out_shape: Vec<usize> = maps.iter().map(|m| m.len()).collect();
    let total: usize = out_shape.iter().product();
    let mut out = Vec::with_capacity(total);
    if total == 0 {
        return out;
    }
    let rank = out_shape.len();
    if rank == 0 {
        out.push(src[0].clone());
        return out;
    }
    let st = strides(in_shape);
    let inner = &maps[rank - 1];
    let outer_shape = &out_shape[..rank - 1];
    let n_outer: usize = outer_shape.iter().product();
    let mut idx = vec![0usize; rank - 1];
    for _ in 0..n_outer {
        let mut base = Some(0usize);
        for d in 0..rank - 1 {
            base = match (base, maps[d][idx[d]]) {
                (Some(b), Some(i)) => Some(b + i * st[d]),
                _ => None,
            };
        }
        match base {
            None => out.extend(std::iter::repeat_n(fill.clone(), inner.len())),
            Some(b) => out.extend(inner.iter().map(|m| match m {
                Some(i) => src[b + i].clone(),
                None => fill.clone(),
            })),
        }
        for d in (0..rank - 1).rev() {
            idx[d] += 1;
            if idx[d] < outer_shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// The index map of one padded axis: crop negative pads first, then pad by `mode`.
fn pad_axis_map(dim: usize, begin: i64, end: i64, mode: &str) -> Result<AxisMap> {
    let lo = (-begin).max(0) as usize;
    let cut_hi = (-end).max(0) as usize;
    if lo + cut_hi > dim {
        bail!("negative pads ({begin}, {end}) remove more than dim {dim}");
    }
    let n = dim - lo - cut_hi;
    let (pb, pe) = (begin.max(0) as usize, end.max(0) as usize);
    if n == 0 && mode != "constant" && pb + pe > 0 {
        bail!("cannot {mode}-pad an empty axis");
    }
    (0..n + pb + pe)
        .map(|i| {
            let c = i as i64 - pb as i64;
            let nn = n as i64;
            let mapped = if (0..nn).contains(&c) {
                Some(c)
            } else {
                match mode {
                    "constant" => None,
                    "edge" => Some(c.clamp(0, nn - 1)),
                    "wrap" => Some(c.rem_euclid(nn)),
                    "reflect" => {
                        if nn == 1 {
                            Some(0)
                        } else {
                            let p = 2 * (nn - 1);
                            let m = c.rem_euclid(p);
                            Some(if m >= nn { p - m } else { m })
                        }
                    }
                    other => bail!("unknown Pad mode '{other}'"),
                }
            };
            Ok(mapped.map(|c| c as usize + lo))
        })
        .collect()
}

/// Pad (constant / reflect / edge / wrap): attributes before opset 11, inputs after
/// (`axes` input since opset 18). Negative pads crop.
fn pad(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let rank = t.rank();
    let mode = ctx.node.str_or("mode", "constant")?;
    let attr_pads = match ctx.node.attr_ints("pads")? {
        Some(p) => Some(p),
        None => ctx.node.attr_ints("paddings")?,
    };
    let (pads, axes) = match attr_pads {
        Some(p) => (p.to_vec(), None),
        None => (ins.tensor(1)?.to_i64_vec()?, tensor_input_ints(&ins, 3)?),
    };
    let axes: Vec<usize> = match axes {
        Some(a) => a
            .into_iter()
            .map(|a| real_axis(a, rank))
            .collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };
    if pads.len() != 2 * axes.len() {
        bail!("Pad has {} pads for {} axes", pads.len(), axes.len());
    }
    let mut per_axis = vec![(0i64, 0i64); rank];
    for (i, &a) in axes.iter().enumerate() {
        per_axis[a] = (pads[i], pads[i + axes.len()]);
    }
    let maps: Vec<AxisMap> = per_axis
        .iter()
        .zip(t.shape())
        .map(|(&(b, e), &d)| pad_axis_map(d, b, e, mode))
        .collect::<Result<_>>()?;
    let out_shape: Vec<usize> = maps.iter().map(|m| m.len()).collect();
    checked_numel(&out_shape)?;
    let out = dispatch_any!(t.dtype(), T => {
        let fill: T = if let Some(v) = ctx.node.attr_float("value")? {
            let f = tensor_from_f64(t.dtype(), vec![], vec![v as f64])?;
            first_elem::<T>(&f)?.unwrap_or_default()
        } else {
            match ins.opt_tensor(2) {
                Some(c) if c.dtype() == t.dtype() => first_elem::<T>(c)?.unwrap_or_default(),
                Some(c) => bail!("Pad constant_value is {}, data is {}", c.dtype(), t.dtype()),
                None => T::default(),
            }
        };
        let v = gather_by_maps(T::view(t)?, t.shape(), &maps, &fill);
        T::build(t.dtype(), out_shape, v)?
    });
    Ok(vec![Value::tensor(out)])
}

/// CenterCropPad: centre-crops or zero-pads each listed axis to the target length.
fn center_crop_pad(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let rank = t.rank();
    let target = ins.tensor(1)?.to_i64_vec()?;
    let axes: Vec<usize> = match ctx.node.attr_ints("axes")? {
        Some(a) => a
            .iter()
            .map(|&a| real_axis(a, rank))
            .collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };
    if target.len() != axes.len() {
        bail!(
            "CenterCropPad shape has {} dims for {} axes",
            target.len(),
            axes.len()
        );
    }
    let mut maps: Vec<AxisMap> = t
        .shape()
        .iter()
        .map(|&d| (0..d).map(Some).collect())
        .collect();
    for (&a, &s) in axes.iter().zip(&target) {
        let s = to_dim(s, "CenterCropPad target")?;
        let d = t.shape()[a];
        maps[a] = if s <= d {
            let start = (d - s) / 2;
            (start..start + s).map(Some).collect()
        } else {
            let before = (s - d) / 2;
            (0..s)
                .map(|i| i.checked_sub(before).filter(|&c| c < d))
                .collect()
        };
    }
    let out_shape: Vec<usize> = maps.iter().map(|m| m.len()).collect();
    let out = dispatch_any!(t.dtype(), T => {
        let v = gather_by_maps(T::view(t)?, t.shape(), &maps, &T::default());
        T::build(t.dtype(), out_shape, v)?
    });
    Ok(vec![Value::tensor(out)])
}

pub fn register(r: &mut Registry) {
    r.add("Constant", 1, constant);
    r.add("Identity", 1, identity);
    r.add("Reshape", 1, reshape);
    r.add("Flatten", 1, flatten);
    r.add("Squeeze", 1, squeeze);
    r.add("Unsqueeze", 1, unsqueeze);
    r.add("Shape", 1, shape_op);
    r.add("Size", 1, size_op);
    r.add("Transpose", 1, transpose);
    r.add("Concat", 1, concat);
    r.add("Split", 1, split);
    r.add("Slice", 1, slice);
    r.add("Expand", 8, expand);
    r.add("Tile", 1, tile);
    r.add("ConstantOfShape", 9, constant_of_shape);
    r.add("Range", 11, range);
    r.add("OneHot", 9, one_hot);
    r.add("EyeLike", 9, eye_like);
    r.add("DepthToSpace", 1, depth_to_space);
    r.add("SpaceToDepth", 1, space_to_depth);
    r.add("Trilu", 14, trilu);
    r.add("Pad", 1, pad);
    r.add("CenterCropPad", 18, center_crop_pad);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Element-by-element reference for `strided_copy`.
    fn naive(src: &[i32], base: usize, shape: &[usize], st: &[isize]) -> Vec<i32> {
        let mut out = vec![];
        for_each_offset(shape, st, base as isize, |o| out.push(src[o as usize]));
        out
    }

    #[test]
    fn strided_copy_matches_naive_for_transposes() {
        let shapes: [&[usize]; 4] = [&[2, 3, 4], &[1, 197, 6, 64], &[3, 1, 5, 2, 7], &[40, 33]];
        let mut seed = 7u64;
        for shape in shapes {
            let n: usize = shape.iter().product();
            let src: Vec<i32> = (0..n as i32).collect();
            let st = isize_strides(shape);
            let r = shape.len();
            for _ in 0..12 {
                let mut perm: Vec<usize> = (0..r).collect();
                for i in (1..r).rev() {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    perm.swap(i, (seed >> 33) as usize % (i + 1));
                }
                let oshape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
                let ost: Vec<isize> = perm.iter().map(|&p| st[p]).collect();
                let want = naive(&src, 0, &oshape, &ost);
                for threads in [1, 4] {
                    let got = strided_copy_mt(&src, 0, &oshape, &ost, threads).unwrap();
                    assert_eq!(got, want, "shape {shape:?} perm {perm:?}");
                }
            }
        }
    }

    /// NCHW -> NHWC of three-channel f32 images (the vector interleave) equals the generic
    /// copy of the same offsets as i32, with a batch, odd sizes and a thread split.
    #[test]
    fn three_plane_transposes_match_naive() {
        for shape in [[1usize, 3, 7, 9], [2, 3, 20, 33], [1, 3, 1, 5]] {
            let n: usize = shape.iter().product();
            let src: Vec<i32> = (0..n as i32).collect();
            let srcf: Vec<f32> = src.iter().map(|&v| v as f32).collect();
            let st = isize_strides(&shape);
            let perm = [0usize, 2, 3, 1];
            let oshape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
            let ost: Vec<isize> = perm.iter().map(|&p| st[p]).collect();
            let want: Vec<f32> = naive(&src, 0, &oshape, &ost)
                .into_iter()
                .map(|v| v as f32)
                .collect();
            for threads in [1, 2] {
                let got = strided_copy_mt(&srcf, 0, &oshape, &ost, threads).unwrap();
                assert_eq!(got, want, "shape {shape:?}");
            }
        }
    }

    #[test]
    fn slice_axis_clamps_like_numpy() {
        assert_eq!(slice_axis(10, 0, i64::MAX, 1).unwrap(), (0, 1, 10));
        assert_eq!(slice_axis(10, -1, i64::MIN, -1).unwrap(), (9, -1, 10));
        assert_eq!(slice_axis(10, 20, 0, -3).unwrap(), (9, -3, 3));
        assert_eq!(slice_axis(10, 5, 5, 1).unwrap().2, 0);
        assert_eq!(slice_axis(0, 0, -1, -1).unwrap().2, 0);
        assert!(slice_axis(3, 0, 1, 0).is_err());
    }

    #[test]
    fn reversed_slice_and_out_of_range_view() {
        let src: Vec<i32> = (0..12).collect();
        // [3, 4] reversed along both axes.
        let got = strided_copy(&src, 11, &[3, 4], &[-4, -1]).unwrap();
        assert_eq!(got, (0..12).rev().collect::<Vec<_>>());
        assert!(strided_copy(&src, 0, &[3, 5], &[4, 1]).is_err());
    }

    #[test]
    fn reshape_target_rules() {
        assert_eq!(
            reshape_target(&[2, 3, 4], &[0, -1], false).unwrap(),
            vec![2, 12]
        );
        assert_eq!(reshape_target(&[0, 3], &[3, 0], true).unwrap(), vec![3, 0]);
        assert!(reshape_target(&[2, 3], &[-1, -1], false).is_err());
        assert!(reshape_target(&[2, 3], &[i64::MAX, 4], false).is_err());
    }
}
