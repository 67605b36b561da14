//! Indexing kernels: Gather, GatherElements, GatherND, Scatter/ScatterElements/ScatterND,
//! TensorScatter, CumSum/CumProd, NonZero, TopK, Unique, ReverseSequence and Compress.
//!
//! Index arithmetic is done once on plain offsets (validated against the data shape), then
//! the element copy runs per dtype through [`Movable`], so every dtype is supported.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::common::strides;
use crate::ops::shape::{dispatch_any, real_axis, strided_copy, Movable};
use crate::value::Value;
use npuc_ir::{bf16, f16, DType, Tensor};
use std::cmp::Ordering;

/// Arithmetic used by reductions (scatter reductions, CumSum/CumProd). Integer arithmetic
/// wraps, as it does in the reference's fixed-width numpy types.
pub trait Arith: Movable + Copy + PartialOrd {
    const ZERO: Self;
    const ONE: Self;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
}

macro_rules! arith_int {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            const ZERO: Self = 0;
            const ONE: Self = 1;
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
        }
    )*};
}
arith_int!(i8, u8, i16, u16, i32, u32, i64, u64);

macro_rules! arith_float {
    ($($t:ty: $z:expr, $o:expr),*) => {$(
        impl Arith for $t {
            const ZERO: Self = $z;
            const ONE: Self = $o;
            fn add(self, o: Self) -> Self { self + o }
            fn mul(self, o: Self) -> Self { self * o }
        }
    )*};
}
arith_float!(f32: 0.0, 1.0, f64: 0.0, 1.0, f16: f16::ZERO, f16::ONE, bf16: bf16::ZERO, bf16::ONE);

/// Total order for sorting: NaN sorts after every number and equal to itself.
pub fn cmp_nan<T: PartialOrd>(a: &T, b: &T) -> Ordering {
    #[allow(clippy::eq_op)] // x != x detects NaN for any PartialOrd float type
    let nan = |x: &T| x != x;
    a.partial_cmp(b).unwrap_or_else(|| nan(a).cmp(&nan(b)))
}

/// Normalises possibly negative indices against `dim`, rejecting out-of-range ones.
fn norm_indices(t: &Tensor, dim: usize) -> Result<Vec<usize>> {
    t.to_i64_vec()?
        .into_iter()
        .map(|i| {
            let j = if i < 0 { i + dim as i64 } else { i };
            if j < 0 || j >= dim as i64 {
                bail!("index {i} is out of bounds for a dim of size {dim}");
            }
            Ok(j as usize)
        })
        .collect()
}

fn empty_like(dtype: DType, shape: Vec<usize>) -> Result<Tensor> {
    dispatch_any!(dtype, T => T::build(dtype, shape, vec![]))
}

/// Copies elements of `src` at the given offsets into a new tensor of `shape`.
fn take_offsets(t: &Tensor, offsets: &[usize], shape: Vec<usize>) -> Result<Tensor> {
    dispatch_any!(t.dtype(), T => {
        let src = T::view(t)?;
        let v: Vec<T> = take_at(src, offsets);
        T::build(t.dtype(), shape, v)
    })
}

/// `src[offsets[i]]` for every i.
pub fn take_at<T: Movable>(src: &[T], offsets: &[usize]) -> Vec<T> {
    offsets.iter().map(|&o| src[o].clone()).collect()
}

/// `dst[targets[i]] = vals[i]` for every i (later writes win).
fn put_at<T: Movable>(dst: &mut [T], targets: &[usize], vals: &[T]) {
    for (&o, u) in targets.iter().zip(vals) {
        dst[o] = u.clone();
    }
}

/// Calls `f(linear index, multi-index)` for every index of `shape` in row-major order.
fn for_each_index(shape: &[usize], mut f: impl FnMut(usize, &[usize]) -> Result<()>) -> Result<()> {
    let n: usize = shape.iter().product();
    let mut idx = vec![0usize; shape.len()];
    for i in 0..n {
        f(i, &idx)?;
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Gather family

fn gather_typed<T: Movable>(
    t: &Tensor,
    idx: &[usize],
    outer: usize,
    dim: usize,
    inner: usize,
    shape: Vec<usize>,
) -> Result<Tensor> {
    let src = T::view(t)?;
    let mut out: Vec<T> = crate::buffers::take(outer * idx.len() * inner);
    for o in 0..outer {
        for &i in idx {
            let b = (o * dim + i) * inner;
            out.extend_from_slice(&src[b..b + inner]);
        }
    }
    T::build(t.dtype(), shape, out)
}

/// Gather: `data[..., indices, ...]` along `axis`, copying contiguous inner blocks.
fn gather(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let it = ins.tensor(1)?;
    let axis = real_axis(ctx.node.int_or("axis", 0)?, t.rank())?;
    let dim = t.shape()[axis];
    let idx = norm_indices(it, dim)?;
    let outer: usize = t.shape()[..axis].iter().product();
    let inner: usize = t.shape()[axis + 1..].iter().product();
    let mut shape = t.shape()[..axis].to_vec();
    shape.extend_from_slice(it.shape());
    shape.extend_from_slice(&t.shape()[axis + 1..]);
    let out = dispatch_any!(t.dtype(), T => gather_typed::<T>(t, &idx, outer, dim, inner, shape)?);
    Ok(vec![Value::tensor(out)])
}

/// Offsets into `data` addressed by an element-wise index tensor along `axis` (shared by
/// GatherElements and ScatterElements): position p of `indices` maps to `data[p with
/// p[axis] replaced by indices[p]]`.
fn element_offsets(data_shape: &[usize], it: &Tensor, axis: usize) -> Result<Vec<usize>> {
    let ishape = it.shape();
    if ishape.len() != data_shape.len() {
        bail!(
            "indices rank {} differs from data rank {}",
            ishape.len(),
            data_shape.len()
        );
    }
    for (d, (&i, &n)) in ishape.iter().zip(data_shape).enumerate() {
        if d != axis && i > n {
            bail!("indices shape {ishape:?} exceeds data shape {data_shape:?}");
        }
    }
    let idx = norm_indices(it, data_shape[axis])?;
    let st = strides(data_shape);
    let mut out = Vec::with_capacity(idx.len());
    for_each_index(ishape, |i, p| {
        let off: usize = p
            .iter()
            .enumerate()
            .map(|(d, &x)| if d == axis { idx[i] } else { x } * st[d])
            .sum();
        out.push(off);
        Ok(())
    })?;
    Ok(out)
}

/// GatherElements: `out[p] = data[p with p[axis] = indices[p]]`.
fn gather_elements(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let it = ins.tensor(1)?;
    let axis = real_axis(ctx.node.int_or("axis", 0)?, t.rank())?;
    let offs = element_offsets(t.shape(), it, axis)?;
    Ok(vec![Value::tensor(take_offsets(
        t,
        &offs,
        it.shape().to_vec(),
    )?)])
}

/// For ScatterND/GatherND: the start offset in `data` of each index tuple (the last dim of
/// `indices`), with `batch_dims` leading dims shared by data and indices. Returns the offsets
/// and the size of the slice each tuple addresses.
fn nd_offsets(data_shape: &[usize], it: &Tensor, batch_dims: usize) -> Result<(Vec<usize>, usize)> {
    let ishape = it.shape();
    let Some(&k) = ishape.last() else {
        bail!("indices must have rank >= 1");
    };
    let b = batch_dims;
    if b >= ishape.len() || b + k > data_shape.len() {
        bail!(
            "indices shape {ishape:?} with batch_dims {b} does not fit data shape {data_shape:?}"
        );
    }
    if data_shape[..b] != ishape[..b] {
        bail!("batch dims of data {data_shape:?} and indices {ishape:?} differ");
    }
    let raw = it.to_i64_vec()?;
    let st = strides(data_shape);
    let slice: usize = data_shape[b + k..].iter().product();
    let batch_stride: usize = data_shape[b..].iter().product();
    let per_batch: usize = ishape[b..ishape.len() - 1].iter().product();
    let mut out = Vec::with_capacity(raw.len() / k.max(1));
    let n_tuples: usize = ishape[..ishape.len() - 1].iter().product();
    for t in 0..n_tuples {
        let batch = t.checked_div(per_batch).unwrap_or(0);
        let mut off = batch * batch_stride;
        for (j, &v) in raw[t * k..(t + 1) * k].iter().enumerate() {
            let dim = data_shape[b + j];
            let v2 = if v < 0 { v + dim as i64 } else { v };
            if v2 < 0 || v2 >= dim as i64 {
                bail!("index {v} is out of bounds for a dim of size {dim}");
            }
            off += v2 as usize * st[b + j];
        }
        out.push(off);
    }
    Ok((out, slice))
}

/// GatherND (with `batch_dims`).
fn gather_nd(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let it = ins.tensor(1)?;
    let b = ctx.node.int_or("batch_dims", 0)?.max(0) as usize;
    let (starts, slice) = nd_offsets(t.shape(), it, b)?;
    let k = it.shape()[it.rank() - 1];
    let mut shape = it.shape()[..it.rank() - 1].to_vec();
    shape.extend_from_slice(&t.shape()[b + k..]);
    let out = dispatch_any!(t.dtype(), T => {
        let src = T::view(t)?;
        let mut v: Vec<T> = Vec::with_capacity(starts.len() * slice);
        for &s in &starts {
            v.extend_from_slice(&src[s..s + slice]);
        }
        T::build(t.dtype(), shape, v)?
    });
    Ok(vec![Value::tensor(out)])
}

// ---------------------------------------------------------------------------------------------
// Scatter family

/// How scattered updates combine with the existing value.
#[derive(Clone, Copy, PartialEq)]
enum Reduction {
    None,
    Add,
    Mul,
    Max,
    Min,
}

fn reduction(ctx: &OpCtx) -> Result<Reduction> {
    Ok(match ctx.node.str_or("reduction", "none")? {
        "none" => Reduction::None,
        "add" => Reduction::Add,
        "mul" => Reduction::Mul,
        "max" => Reduction::Max,
        "min" => Reduction::Min,
        other => bail!("unknown reduction '{other}'"),
    })
}

fn scatter_reduce<T: Arith>(out: &mut [T], targets: &[usize], upd: &[T], r: Reduction) {
    for (&o, &u) in targets.iter().zip(upd) {
        let cur = out[o];
        out[o] = match r {
            Reduction::None => u,
            Reduction::Add => cur.add(u),
            Reduction::Mul => cur.mul(u),
            Reduction::Max => {
                if cmp_nan(&u, &cur) == Ordering::Greater {
                    u
                } else {
                    cur
                }
            }
            Reduction::Min => {
                if cmp_nan(&u, &cur) == Ordering::Less {
                    u
                } else {
                    cur
                }
            }
        };
    }
}

/// Writes `updates[i]` into a copy of `data` at `targets[i]`, combining by `r`.
fn scatter_apply(
    data: Tensor,
    targets: &[usize],
    updates: &Tensor,
    r: Reduction,
) -> Result<Tensor> {
    if updates.dtype() != data.dtype() {
        bail!("updates are {}, data is {}", updates.dtype(), data.dtype());
    }
    if targets.len() != updates.len() {
        bail!(
            "{} updates for {} target positions",
            updates.len(),
            targets.len()
        );
    }
    let dt = data.dtype();
    let shape = data.shape().to_vec();
    if r == Reduction::None {
        return dispatch_any!(dt, T => {
            let mut v: Vec<T> = T::view(&data)?.to_vec();
            put_at(&mut v, targets, T::view(updates)?);
            T::build(dt, shape, v)
        });
    }
    crate::dispatch_numeric!(dt, T => {
        let mut v: Vec<T> = T::view(&data)?.to_vec();
        scatter_reduce(&mut v, targets, T::view(updates)?, r);
        T::build(dt, shape, v)
    })
}

/// ScatterElements (and the deprecated Scatter): element-wise scatter along `axis`.
fn scatter_elements(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let r = reduction(ctx)?;
    let (targets, upd) = {
        let t = ins.tensor(0)?;
        let it = ins.tensor(1)?;
        let upd = ins.tensor(2)?;
        if upd.shape() != it.shape() {
            bail!(
                "updates shape {:?} differs from indices shape {:?}",
                upd.shape(),
                it.shape()
            );
        }
        let axis = real_axis(ctx.node.int_or("axis", 0)?, t.rank())?;
        (element_offsets(t.shape(), it, axis)?, upd.clone())
    };
    let data = ins.take_tensor(0)?;
    Ok(vec![Value::tensor(scatter_apply(data, &targets, &upd, r)?)])
}

/// ScatterND: writes update slices at index tuples (with an optional reduction).
fn scatter_nd(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let r = reduction(ctx)?;
    let (targets, upd) = {
        let t = ins.tensor(0)?;
        let it = ins.tensor(1)?;
        let upd = ins.tensor(2)?;
        let (starts, slice) = nd_offsets(t.shape(), it, 0)?;
        let k = it.shape()[it.rank() - 1];
        let mut want = it.shape()[..it.rank() - 1].to_vec();
        want.extend_from_slice(&t.shape()[k..]);
        if upd.shape() != want.as_slice() {
            bail!("updates shape {:?}, expected {want:?}", upd.shape());
        }
        let targets: Vec<usize> = starts.iter().flat_map(|&s| s..s + slice).collect();
        (targets, upd.clone())
    };
    let data = ins.take_tensor(0)?;
    Ok(vec![Value::tensor(scatter_apply(data, &targets, &upd, r)?)])
}

/// TensorScatter: writes `update` into a cache tensor along `axis` (default -2) at per-batch
/// positions `write_indices` (`linear`, or `circular` wrapping modulo the cache length).
fn tensor_scatter(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let circular = match ctx.node.str_or("mode", "linear")? {
        "linear" => false,
        "circular" => true,
        other => bail!("unknown TensorScatter mode '{other}'"),
    };
    let (targets, upd) = {
        let cache = ins.tensor(0)?;
        let upd = ins.tensor(1)?;
        let rank = cache.rank();
        let axis = real_axis(ctx.node.int_or("axis", -2)?, rank)?;
        if axis == 0 || upd.rank() != rank {
            bail!("TensorScatter needs equal ranks and a non-batch axis");
        }
        for d in 0..rank {
            if d != axis && upd.shape()[d] != cache.shape()[d] {
                bail!(
                    "update shape {:?} does not match cache shape {:?}",
                    upd.shape(),
                    cache.shape()
                );
            }
        }
        let max_len = cache.shape()[axis];
        let batch = cache.shape()[0];
        let starts = match ins.opt_tensor(2) {
            Some(w) => w.to_i64_vec()?,
            None => vec![0; batch],
        };
        if starts.len() != batch {
            bail!(
                "write_indices has {} entries for batch {batch}",
                starts.len()
            );
        }
        let st = strides(cache.shape());
        let mut targets = Vec::with_capacity(upd.len());
        for_each_index(upd.shape(), |_, p| {
            let mut pos = starts[p[0]] + p[axis] as i64;
            if circular && max_len > 0 {
                pos = pos.rem_euclid(max_len as i64);
            }
            if pos < 0 || pos >= max_len as i64 {
                bail!("write position {pos} is outside a cache of length {max_len}");
            }
            let off: usize = p
                .iter()
                .enumerate()
                .map(|(d, &x)| if d == axis { pos as usize } else { x } * st[d])
                .sum();
            targets.push(off);
            Ok(())
        })?;
        (targets, upd.clone())
    };
    let data = ins.take_tensor(0)?;
    Ok(vec![Value::tensor(scatter_apply(
        data,
        &targets,
        &upd,
        Reduction::None,
    )?)])
}

// ---------------------------------------------------------------------------------------------
// CumSum, CumProd

fn cumulate<T: Arith>(
    src: &[T],
    outer: usize,
    dim: usize,
    inner: usize,
    exclusive: bool,
    reverse: bool,
    prod: bool,
) -> Vec<T> {
    let mut out = vec![T::ZERO; src.len()];
    let ident = if prod { T::ONE } else { T::ZERO };
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = ident;
            for s in 0..dim {
                let k = if reverse { dim - 1 - s } else { s };
                let p = (o * dim + k) * inner + i;
                let x = src[p];
                if exclusive {
                    out[p] = acc;
                }
                acc = if prod { acc.mul(x) } else { acc.add(x) };
                if !exclusive {
                    out[p] = acc;
                }
            }
        }
    }
    out
}

fn cum_op(ctx: &OpCtx, ins: Inputs, prod: bool) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let axis = match ins.tensor(1)?.to_i64_vec()?.first() {
        Some(&a) => real_axis(a, t.rank())?,
        None => bail!("axis must be a scalar"),
    };
    let exclusive = ctx.node.int_or("exclusive", 0)? != 0;
    let reverse = ctx.node.int_or("reverse", 0)? != 0;
    let outer: usize = t.shape()[..axis].iter().product();
    let dim = t.shape()[axis];
    let inner: usize = t.shape()[axis + 1..].iter().product();
    let out = crate::dispatch_numeric!(t.dtype(), T => {
        let v = cumulate(T::view(t)?, outer, dim, inner, exclusive, reverse, prod);
        T::build(t.dtype(), t.shape().to_vec(), v)?
    });
    Ok(vec![Value::tensor(out)])
}

/// CumSum along the `axis` input (`exclusive`, `reverse`).
fn cumsum(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    cum_op(ctx, ins, false)
}

/// CumProd along the `axis` input (`exclusive`, `reverse`).
fn cumprod(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    cum_op(ctx, ins, true)
}

// ---------------------------------------------------------------------------------------------
// NonZero, TopK, Unique

/// NonZero: indices of non-zero elements as a `[rank, count]` i64 tensor.
fn non_zero(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let nz: Vec<bool> = if t.dtype() == DType::String {
        t.as_strings()?.iter().map(|s| !s.is_empty()).collect()
    } else {
        crate::dispatch_pod!(t.dtype(), T => {
            let z = T::default();
            T::view(t)?.iter().map(|x| *x != z).collect()
        })
    };
    // A scalar behaves as a 1-element vector, as in numpy.
    let shape: Vec<usize> = if t.rank() == 0 {
        vec![1]
    } else {
        t.shape().to_vec()
    };
    let rank = shape.len();
    let st = strides(&shape);
    let hits: Vec<usize> = nz
        .iter()
        .enumerate()
        .filter(|(_, &b)| b)
        .map(|(i, _)| i)
        .collect();
    let mut out = vec![0i64; rank * hits.len()];
    for (j, &h) in hits.iter().enumerate() {
        for d in 0..rank {
            out[d * hits.len() + j] = ((h / st[d]) % shape[d]) as i64;
        }
    }
    Ok(vec![Value::tensor(Tensor::from_vec(
        vec![rank, hits.len()],
        out,
    )?)])
}

#[allow(clippy::too_many_arguments)]
fn topk_typed<T: Movable + PartialOrd>(
    t: &Tensor,
    k: usize,
    outer: usize,
    dim: usize,
    inner: usize,
    largest: bool,
    shape: Vec<usize>,
) -> Result<(Tensor, Tensor)> {
    let src = T::view(t)?;
    let n_out = outer * k * inner;
    let mut vals: Vec<T> = vec![T::default(); n_out];
    let mut idxs = vec![0i64; n_out];
    let mut lane: Vec<usize> = Vec::with_capacity(dim);
    // Ties keep the lower index first, matching the reference's stable sort.
    let order = |a: &usize, b: &usize, lane_base: usize| -> Ordering {
        let (x, y) = (&src[lane_base + a * inner], &src[lane_base + b * inner]);
        let c = cmp_nan(x, y);
        let c = if largest { c.reverse() } else { c };
        c.then(a.cmp(b))
    };
    for o in 0..outer {
        for i in 0..inner {
            let base = o * dim * inner + i;
            lane.clear();
            lane.extend(0..dim);
            if k < dim {
                lane.select_nth_unstable_by(k, |a, b| order(a, b, base));
                lane.truncate(k);
            }
            lane.sort_unstable_by(|a, b| order(a, b, base));
            for (j, &e) in lane.iter().take(k).enumerate() {
                let p = (o * k + j) * inner + i;
                vals[p] = src[base + e * inner].clone();
                idxs[p] = e as i64;
            }
        }
    }
    Ok((
        T::build(t.dtype(), shape.clone(), vals)?,
        Tensor::from_vec(shape, idxs)?,
    ))
}

/// TopK: the k largest (or smallest) values along `axis` and their indices, sorted.
fn topk(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let k = match ins.opt_tensor(1) {
        Some(kt) => match kt.to_i64_vec()?.first() {
            Some(&k) => k,
            None => bail!("K must hold one value"),
        },
        None => ctx.node.int_req("k")?,
    };
    if t.rank() == 0 {
        bail!("TopK needs a tensor of rank >= 1");
    }
    let axis = real_axis(ctx.node.int_or("axis", -1)?, t.rank())?;
    let dim = t.shape()[axis];
    if k < 0 || k as usize > dim {
        bail!("k = {k} is outside [0, {dim}]");
    }
    let k = k as usize;
    let largest = ctx.node.int_or("largest", 1)? != 0;
    let outer: usize = t.shape()[..axis].iter().product();
    let inner: usize = t.shape()[axis + 1..].iter().product();
    let mut shape = t.shape().to_vec();
    shape[axis] = k;
    let (v, i) = crate::dispatch_numeric!(t.dtype(), T => {
        topk_typed::<T>(t, k, outer, dim, inner, largest, shape)?
    });
    Ok(vec![Value::tensor(v), Value::tensor(i)])
}

/// Unique over rows of `rows` (n rows of `len` elements): returns, in output order, the first
/// occurrence of each distinct row, the inverse map and the counts.
fn unique_rows<T: PartialOrd>(
    rows: &[T],
    n: usize,
    len: usize,
    sorted: bool,
) -> (Vec<usize>, Vec<i64>, Vec<i64>) {
    let row = |i: usize| &rows[i * len..(i + 1) * len];
    let cmp_rows = |a: usize, b: usize| -> Ordering {
        row(a)
            .iter()
            .zip(row(b))
            .map(|(x, y)| cmp_nan(x, y))
            .find(|c| *c != Ordering::Equal)
            .unwrap_or(Ordering::Equal)
    };
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| cmp_rows(a, b).then(a.cmp(&b)));
    // Group equal rows; each group's first member is its first occurrence.
    let mut firsts = vec![];
    let mut group_of = vec![0usize; n];
    let mut counts = vec![];
    for (pos, &i) in order.iter().enumerate() {
        if pos == 0 || cmp_rows(order[pos - 1], i) != Ordering::Equal {
            firsts.push(i);
            counts.push(0i64);
        }
        group_of[i] = firsts.len() - 1;
        if let Some(c) = counts.last_mut() {
            *c += 1;
        }
    }
    // Output order: sorted groups, or by first occurrence.
    let mut groups: Vec<usize> = (0..firsts.len()).collect();
    if !sorted {
        groups.sort_by_key(|&g| firsts[g]);
    }
    let mut rank_of = vec![0usize; groups.len()];
    for (r, &g) in groups.iter().enumerate() {
        rank_of[g] = r;
    }
    let out_first: Vec<usize> = groups.iter().map(|&g| firsts[g]).collect();
    let out_counts: Vec<i64> = groups.iter().map(|&g| counts[g]).collect();
    let inverse: Vec<i64> = group_of.iter().map(|&g| rank_of[g] as i64).collect();
    (out_first, inverse, out_counts)
}

fn unique_typed<T: Movable + PartialOrd>(
    t: &Tensor,
    axis: Option<usize>,
    sorted: bool,
) -> Result<[Tensor; 4]> {
    let src = T::view(t)?;
    // Move the unique axis to the front so that each slice is one contiguous row.
    let (n, outer, inner) = match axis {
        None => (t.len(), 1, 1),
        Some(a) => (
            t.shape()[a],
            t.shape()[..a].iter().product::<usize>(),
            t.shape()[a + 1..].iter().product::<usize>(),
        ),
    };
    let len = outer * inner;
    let rows: Vec<T> = if axis.is_none() || outer == 1 {
        src.to_vec()
    } else {
        let st = [inner as isize, (n * inner) as isize, 1];
        strided_copy(src, 0, &[n, outer, inner], &st)?
    };
    let (firsts, inverse, counts) = unique_rows(&rows, n, len, sorted);
    let u = firsts.len();
    let mut y_rows: Vec<T> = Vec::with_capacity(u * len);
    for &f in &firsts {
        y_rows.extend_from_slice(&rows[f * len..(f + 1) * len]);
    }
    let y = match axis {
        None => T::build(t.dtype(), vec![u], y_rows)?,
        Some(a) => {
            let mut shape = t.shape().to_vec();
            shape[a] = u;
            let v = if outer == 1 {
                y_rows
            } else {
                let st = [inner as isize, (outer * inner) as isize, 1];
                strided_copy(&y_rows, 0, &[outer, u, inner], &st)?
            };
            T::build(t.dtype(), shape, v)?
        }
    };
    let firsts: Vec<i64> = firsts.into_iter().map(|f| f as i64).collect();
    Ok([
        y,
        Tensor::from_vec(vec![u], firsts)?,
        Tensor::from_vec(vec![inverse.len()], inverse)?,
        Tensor::from_vec(vec![u], counts)?,
    ])
}

/// Unique: distinct elements (or slices along `axis`), sorted or in first-occurrence order,
/// with first indices, inverse indices and counts.
fn unique(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let axis = match ctx.node.attr_int("axis")? {
        Some(a) => Some(real_axis(a, t.rank())?),
        None => None,
    };
    let sorted = ctx.node.int_or("sorted", 1)? != 0;
    let outs = dispatch_any!(t.dtype(), T => unique_typed::<T>(t, axis, sorted)?);
    Ok(outs.into_iter().map(Value::tensor).collect())
}

// ---------------------------------------------------------------------------------------------
// ReverseSequence, Compress

/// ReverseSequence: reverses the first `sequence_lens[b]` steps along `time_axis` of each
/// batch entry `b` along `batch_axis`.
fn reverse_sequence(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let lens = ins.tensor(1)?.to_i64_vec()?;
    let rank = t.rank();
    let ba = real_axis(ctx.node.int_or("batch_axis", 1)?, rank)?;
    let ta = real_axis(ctx.node.int_or("time_axis", 0)?, rank)?;
    if ba == ta || rank < 2 {
        bail!("batch_axis and time_axis must be distinct axes of a rank >= 2 input");
    }
    let (batch, time) = (t.shape()[ba], t.shape()[ta]);
    if lens.len() != batch {
        bail!("sequence_lens has {} entries for batch {batch}", lens.len());
    }
    let st = strides(t.shape());
    let mut offs = Vec::with_capacity(t.len());
    for_each_index(t.shape(), |i, p| {
        let l = lens[p[ba]].clamp(0, time as i64) as usize;
        let tt = p[ta];
        offs.push(if tt < l {
            i + (l - 1 - tt) * st[ta] - tt * st[ta]
        } else {
            i
        });
        Ok(())
    })?;
    Ok(vec![Value::tensor(take_offsets(
        t,
        &offs,
        t.shape().to_vec(),
    )?)])
}

/// Compress: keeps the slices along `axis` (or elements of the flattened input) where
/// `condition` is true.
fn compress(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let cond: Vec<bool> = ins
        .tensor(1)?
        .to_f64_vec()?
        .iter()
        .map(|&c| c != 0.0)
        .collect();
    let (shape, outer, dim, inner, axis) = match ctx.node.attr_int("axis")? {
        Some(a) => {
            let a = real_axis(a, t.rank())?;
            let s = t.shape();
            (
                s.to_vec(),
                s[..a].iter().product::<usize>(),
                s[a],
                s[a + 1..].iter().product::<usize>(),
                a,
            )
        }
        None => (vec![t.len()], 1, t.len(), 1, 0),
    };
    if cond.len() > dim {
        bail!("condition has {} entries for a dim of {dim}", cond.len());
    }
    let keep: Vec<usize> = cond
        .iter()
        .enumerate()
        .filter(|(_, &c)| c)
        .map(|(i, _)| i)
        .collect();
    let mut out_shape = shape;
    out_shape[axis] = keep.len();
    if out_shape.iter().product::<usize>() == 0 {
        return Ok(vec![Value::tensor(empty_like(t.dtype(), out_shape)?)]);
    }
    let out =
        dispatch_any!(t.dtype(), T => gather_typed::<T>(t, &keep, outer, dim, inner, out_shape)?);
    Ok(vec![Value::tensor(out)])
}

pub fn register(r: &mut Registry) {
    r.add("Gather", 1, gather);
    r.add("GatherElements", 11, gather_elements);
    r.add("GatherND", 11, gather_nd);
    r.add("Scatter", 9, scatter_elements);
    r.add("ScatterElements", 11, scatter_elements);
    r.add("ScatterND", 11, scatter_nd);
    r.add("TensorScatter", 24, tensor_scatter);
    r.add("CumSum", 11, cumsum);
    r.add("CumProd", 26, cumprod);
    r.add("NonZero", 9, non_zero);
    r.add("TopK", 1, topk);
    r.add("Unique", 11, unique);
    r.add("ReverseSequence", 10, reverse_sequence);
    r.add("Compress", 9, compress);
}
