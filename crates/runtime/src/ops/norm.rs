//! Normalisation-style kernels: `Softmax`, `LogSoftmax`, `Hardmax`, `BatchNormalization`,
//! `InstanceNormalization`, `LayerNormalization`, `GroupNormalization`, `RMSNormalization`,
//! `LRN`, `MeanVarianceNormalization` and `LpNormalization`. Submodules hold the losses, the
//! rotary embedding and the resampling ops (`Resize`, `Upsample`, `GridSample`, `AffineGrid`).
//!
//! Float kernels are written once over [`Real`] (f32/f64); f16/bf16 inputs are widened to f32,
//! computed, and narrowed back (the specs' `stash_type` is f32 for those anyway).

mod loss;
mod resample;
mod rotary;

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::common::{broadcast_index_map, broadcast_shapes, norm_axis};
use crate::value::Value;
use npuc_ir::{bf16, f16, DType, Elem, Tensor};
use num_traits::{One, Zero};
use rayon::prelude::*;
use std::borrow::Cow;

pub fn register(r: &mut Registry) {
    r.add("Softmax", 1, softmax);
    r.add("LogSoftmax", 1, log_softmax);
    r.add("Hardmax", 1, hardmax);
    r.add("BatchNormalization", 1, batch_norm);
    r.add("InstanceNormalization", 1, instance_norm);
    r.add("LayerNormalization", 17, layer_norm);
    r.add("GroupNormalization", 18, group_norm);
    r.add("RMSNormalization", 23, rms_norm);
    r.add("LRN", 1, lrn);
    r.add("MeanVarianceNormalization", 9, mean_variance_norm);
    r.add("LpNormalization", 1, lp_norm);
    loss::register(r);
    resample::register(r);
    rotary::register(r);
}

// ---------------------------------------------------------------------------------------------
// Float helpers shared by the kernels of this family (public for reuse elsewhere).

pub use crate::ops::real::{max_of, sum_of, Real};

/// The shared vectorizable f32 `exp` (one implementation for the whole runtime).
pub use crate::ops::elementwise::exp_f32;

/// Binds `$F` to f32 or f64 from a dtype (after [`upcast`]); other dtypes are an error.
#[macro_export]
macro_rules! dispatch_real {
    ($dt:expr, $F:ident => $body:expr) => {{
        match $dt {
            npuc_ir::DType::F32 => {
                type $F = f32;
                $body
            }
            npuc_ir::DType::F64 => {
                type $F = f64;
                $body
            }
            other => $crate::bail!("dtype {other} is not supported here (float types only)"),
        }
    }};
}

/// f16/bf16 tensors widened to f32 (other dtypes are passed through without a copy).
pub fn upcast(t: &Tensor) -> Result<Cow<'_, Tensor>> {
    Ok(match t.dtype() {
        DType::F16 => Cow::Owned(Tensor::from_vec(
            t.shape().to_vec(),
            t.as_slice::<f16>()?.iter().map(|v| v.to_f32()).collect(),
        )?),
        DType::BF16 => Cow::Owned(Tensor::from_vec(
            t.shape().to_vec(),
            t.as_slice::<bf16>()?.iter().map(|v| v.to_f32()).collect(),
        )?),
        _ => Cow::Borrowed(t),
    })
}

/// Like [`upcast`] but by value (for in-place kernels).
pub fn upcast_owned(t: Tensor) -> Result<Tensor> {
    Ok(match t.dtype() {
        DType::F16 | DType::BF16 => upcast(&t)?.into_owned(),
        _ => t,
    })
}

/// Narrows an f32 result back to `dt` when the op's input was f16/bf16.
pub fn downcast(t: Tensor, dt: DType) -> Result<Tensor> {
    Ok(match dt {
        DType::F16 => Tensor::from_vec(
            t.shape().to_vec(),
            t.as_slice::<f32>()?
                .iter()
                .map(|&v| f16::from_f32(v))
                .collect(),
        )?,
        DType::BF16 => Tensor::from_vec(
            t.shape().to_vec(),
            t.as_slice::<f32>()?
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect(),
        )?,
        _ => t,
    })
}

/// Builds a float tensor of dtype `dt` from f64 values (for kernels off the hot path).
pub fn f64_to_tensor(dt: DType, shape: Vec<usize>, v: Vec<f64>) -> Result<Tensor> {
    Ok(match dt {
        DType::F32 => Tensor::from_vec(shape, v.into_iter().map(|x| x as f32).collect())?,
        DType::F64 => Tensor::from_vec(shape, v)?,
        DType::F16 => Tensor::from_vec(shape, v.into_iter().map(f16::from_f64).collect())?,
        DType::BF16 => Tensor::from_vec(shape, v.into_iter().map(bf16::from_f64).collect())?,
        other => bail!("expected a float tensor, found {other}"),
    })
}

/// Minimum elements before a kernel splits its rows across rayon workers: a ViT's 257x384
/// LayerNorm (99K values) ran slower on two threads than on one (1.93 vs 1.45 ms per 25 nodes).
const PAR_MIN: usize = 1 << 18;

/// Runs `f` over consecutive `row`-sized chunks of `data`, in parallel when worthwhile.
fn for_rows<F: Send>(
    data: &mut [F],
    row: usize,
    threads: usize,
    f: impl Fn(usize, &mut [F]) + Sync,
) {
    if row == 0 {
        return;
    }
    if threads > 1 && data.len() >= PAR_MIN {
        data.par_chunks_mut(row)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    } else {
        data.chunks_mut(row).enumerate().for_each(|(i, c)| f(i, c));
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax / LogSoftmax / Hardmax

#[derive(Clone, Copy, PartialEq, Eq)]
enum SoftKind {
    Softmax,
    LogSoftmax,
    Hardmax,
}

/// `Softmax`: `exp(x - max) / sum(exp(x - max))` along `axis` (opset < 13: over the input
/// coerced to 2-D at `axis`).
fn softmax(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    soft_node(ctx, ins, SoftKind::Softmax)
}
/// `LogSoftmax`: `x - max - log(sum(exp(x - max)))` along `axis`.
fn log_softmax(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    soft_node(ctx, ins, SoftKind::LogSoftmax)
}
/// `Hardmax`: one-hot of the first maximum along `axis`.
fn hardmax(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    soft_node(ctx, ins, SoftKind::Hardmax)
}

fn soft_node(ctx: &OpCtx, mut ins: Inputs, kind: SoftKind) -> Result<Vec<Value>> {
    let x = ins.take_tensor(0)?;
    let dt = x.dtype();
    let mut x = upcast_owned(x)?;
    let shape = x.shape().to_vec();
    let rank = shape.len();
    // Opset < 13 flattens to [prod(shape[..axis]), prod(shape[axis..])]; opset 13 works along
    // a single axis: [outer, n, inner].
    let (n, inner) = if rank == 0 {
        (1, 1)
    } else if ctx.opset < 13 {
        let axis = norm_axis(ctx.node.int_or("axis", 1)?, rank)?;
        (shape[axis..].iter().product::<usize>(), 1)
    } else {
        let axis = norm_axis(ctx.node.int_or("axis", -1)?, rank)?;
        (shape[axis], shape[axis + 1..].iter().product::<usize>())
    };
    let threads = ctx.threads;
    if x.dtype() == DType::F32 && inner == 1 && kind == SoftKind::Softmax {
        // The AVX2 build of the same loop where the CPU has it (bit-identical to soft_row).
        let data = x.as_mut_slice::<f32>()?;
        for_rows(data, n, threads, |_, row| {
            crate::kernels::act::softmax_row(row)
        });
        return Ok(vec![Value::tensor(downcast(x, dt)?)]);
    }
    dispatch_real!(x.dtype(), F => {
        let data = x.as_mut_slice::<F>()?;
        let block = n * inner;
        if inner == 1 {
            for_rows(data, block, threads, |_, row| soft_row(row, kind));
        } else {
            for_rows(data, block, threads, |_, b| soft_strided(b, n, inner, kind));
        }
    });
    Ok(vec![Value::tensor(downcast(x, dt)?)])
}

/// Softmax-family op over one contiguous row, in place.
#[inline]
fn soft_row<F: Real>(row: &mut [F], kind: SoftKind) {
    if row.is_empty() {
        return;
    }
    match kind {
        SoftKind::Softmax => {
            let m = max_of(row);
            for v in row.iter_mut() {
                *v = (*v - m).fast_exp();
            }
            let inv = F::one() / sum_of(row);
            for v in row.iter_mut() {
                *v = *v * inv;
            }
        }
        SoftKind::LogSoftmax => {
            let m = max_of(row);
            let mut s = F::zero();
            for c in row.chunks(256) {
                let mut buf = [F::zero(); 256];
                for (b, &v) in buf.iter_mut().zip(c) {
                    *b = (v - m).fast_exp();
                }
                s = s + sum_of(&buf[..c.len()]);
            }
            let off = m + s.ln();
            for v in row.iter_mut() {
                *v = *v - off;
            }
        }
        SoftKind::Hardmax => {
            let mut m = F::neg_infinity();
            let mut arg = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > m {
                    m = v;
                    arg = i;
                }
            }
            row.fill(F::zero());
            row[arg] = F::one();
        }
    }
}

/// Softmax-family op over the middle axis of an `[n, inner]` block, in place. Works row by
/// row over `inner`-long vectors so that reads stay contiguous.
fn soft_strided<F: Real>(b: &mut [F], n: usize, inner: usize, kind: SoftKind) {
    if n == 0 {
        return;
    }
    let mut m = b[..inner].to_vec();
    let mut arg = vec![0usize; inner];
    for k in 1..n {
        let row = &b[k * inner..(k + 1) * inner];
        for ((mj, aj), &v) in m.iter_mut().zip(arg.iter_mut()).zip(row) {
            if v > *mj {
                *mj = v;
                *aj = k;
            }
        }
    }
    match kind {
        SoftKind::Hardmax => {
            b.fill(F::zero());
            for (j, &k) in arg.iter().enumerate() {
                b[k * inner + j] = F::one();
            }
        }
        SoftKind::Softmax => {
            let mut s = vec![F::zero(); inner];
            for row in b.chunks_exact_mut(inner) {
                for ((v, &mj), sj) in row.iter_mut().zip(&m).zip(s.iter_mut()) {
                    *v = (*v - mj).fast_exp();
                    *sj = *sj + *v;
                }
            }
            for sj in s.iter_mut() {
                *sj = F::one() / *sj;
            }
            for row in b.chunks_exact_mut(inner) {
                for (v, &sj) in row.iter_mut().zip(&s) {
                    *v = *v * sj;
                }
            }
        }
        SoftKind::LogSoftmax => {
            let mut s = vec![F::zero(); inner];
            for row in b.chunks_exact(inner) {
                for ((&v, &mj), sj) in row.iter().zip(&m).zip(s.iter_mut()) {
                    *sj = *sj + (v - mj).fast_exp();
                }
            }
            for (sj, &mj) in s.iter_mut().zip(&m) {
                *sj = mj + sj.ln();
            }
            for row in b.chunks_exact_mut(inner) {
                for (v, &off) in row.iter_mut().zip(&s) {
                    *v = *v - off;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Layer / RMS normalisation

/// Expands a scale/bias tensor to the `norm_shape` it is (unidirectionally) broadcast over,
/// returning it flat; no copy when it already has that many elements.
fn expand_param<'a, F: Real>(p: &'a Tensor, norm_shape: &[usize]) -> Result<Cow<'a, [F]>> {
    let data = p.as_slice::<F>()?;
    let n: usize = norm_shape.iter().product();
    if data.len() == n && p.rank() <= norm_shape.len() {
        return Ok(Cow::Borrowed(data));
    }
    let shape = p.shape();
    if shape.len() > norm_shape.len() || broadcast_shapes(shape, norm_shape)? != norm_shape {
        bail!(
            "parameter of shape {:?} cannot be broadcast to the normalised shape {:?}",
            shape,
            norm_shape
        );
    }
    let idx = broadcast_index_map(shape, norm_shape);
    Ok(Cow::Owned(idx.into_iter().map(|i| data[i]).collect()))
}

/// `LayerNormalization`: per row over axes `axis..`, `(x - mean) / sqrt(var + eps) * scale +
/// bias`; optional outputs `Mean` and `InvStdDev` (shape `x.shape[..axis] + [1, ...]`).
fn layer_norm(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let eps = ctx.node.float_or("epsilon", 1e-5)? as f64;
    let x = ins.take_tensor(0)?;
    let dt = x.dtype();
    let mut x = upcast_owned(x)?;
    let scale = upcast(ins.tensor(1)?)?;
    let bias = match ins.opt_tensor(2) {
        Some(b) => Some(upcast(b)?),
        None => None,
    };
    let shape = x.shape().to_vec();
    let rank = shape.len();
    let axis = norm_axis(ctx.node.int_or("axis", -1)?, rank)?;
    let cols: usize = shape[axis..].iter().product();
    let rows: usize = shape[..axis].iter().product();
    let mut stat_shape = shape[..axis].to_vec();
    stat_shape.resize(rank, 1);
    let threads = ctx.threads;
    let (mean_t, inv_t) = dispatch_real!(x.dtype(), F => {
        if scale.dtype() != F::DTYPE || bias.as_ref().is_some_and(|b| b.dtype() != F::DTYPE) {
            bail!("Scale and B must have the input's dtype");
        }
        let w = expand_param::<F>(&scale, &shape[axis..])?;
        let b = match &bias {
            Some(b) => Some(expand_param::<F>(b, &shape[axis..])?),
            None => None,
        };
        let mut means = vec![F::zero(); rows];
        let mut invs = vec![F::zero(); rows];
        let data = x.as_mut_slice::<F>()?;
        let eps = F::of(eps);
        let b = b.as_deref();
        let stats: Vec<(F, F)> = if threads > 1 && data.len() >= PAR_MIN {
            data.par_chunks_mut(cols)
                .map(|row| layer_norm_row(row, &w, b, eps))
                .collect()
        } else {
            data.chunks_mut(cols)
                .map(|row| layer_norm_row(row, &w, b, eps))
                .collect()
        };
        for (i, (m, s)) in stats.into_iter().enumerate() {
            means[i] = m;
            invs[i] = s;
        }
        (
            Tensor::from_vec(stat_shape.clone(), means)?,
            Tensor::from_vec(stat_shape, invs)?,
        )
    });
    Ok(vec![
        Value::tensor(downcast(x, dt)?),
        Value::tensor(downcast(mean_t, dt)?),
        Value::tensor(downcast(inv_t, dt)?),
    ])
}

/// Normalises one row in place; returns (mean, 1/std).
#[inline]
fn layer_norm_row<F: Real>(row: &mut [F], w: &[F], b: Option<&[F]>, eps: F) -> (F, F) {
    let n = F::of(row.len() as f64);
    let mean = sum_of(row) / n;
    let var = sum_sq_dev(row, mean) / n;
    let inv = F::one() / (var + eps).sqrt();
    match b {
        Some(b) => {
            for ((v, &wi), &bi) in row.iter_mut().zip(w).zip(b) {
                *v = (*v - mean) * inv * wi + bi;
            }
        }
        None => {
            for (v, &wi) in row.iter_mut().zip(w) {
                *v = (*v - mean) * inv * wi;
            }
        }
    }
    (mean, inv)
}

/// `sum((x - c)^2)` with 8 independent accumulators.
#[inline]
fn sum_sq_dev<F: Real>(s: &[F], c: F) -> F {
    let mut lanes = [F::zero(); 8];
    let chunks = s.chunks_exact(8);
    let tail = chunks.remainder();
    for ch in chunks {
        for (l, &v) in lanes.iter_mut().zip(ch) {
            let d = v - c;
            *l = *l + d * d;
        }
    }
    let t = tail.iter().fold(F::zero(), |a, &v| a + (v - c) * (v - c));
    lanes.iter().fold(F::zero(), |a, &b| a + b) + t
}

/// `RMSNormalization`: per row over axes `axis..`, `x / sqrt(mean(x^2) + eps) * scale`.
fn rms_norm(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let eps = ctx.node.float_or("epsilon", 1e-5)? as f64;
    let x = ins.take_tensor(0)?;
    let dt = x.dtype();
    let mut x = upcast_owned(x)?;
    let scale = upcast(ins.tensor(1)?)?;
    let shape = x.shape().to_vec();
    let axis = norm_axis(ctx.node.int_or("axis", -1)?, shape.len())?;
    let cols: usize = shape[axis..].iter().product();
    let threads = ctx.threads;
    dispatch_real!(x.dtype(), F => {
        if scale.dtype() != F::DTYPE {
            bail!("Scale must have the input's dtype");
        }
        let w = expand_param::<F>(&scale, &shape[axis..])?;
        let eps = F::of(eps);
        let data = x.as_mut_slice::<F>()?;
        for_rows(data, cols, threads, |_, row| {
            // Squares summed in f64, the mean rounded once to F, as ggml's CPU RMS norm
            // does: llama.cpp-parity of GGUF models depends on matching it bit for bit.
            let ss: f64 = row.iter().map(|&v| (v * v).f64()).sum();
            let ms = F::of(ss / row.len() as f64);
            let inv = F::one() / (ms + eps).sqrt();
            for (v, &wi) in row.iter_mut().zip(w.iter()) {
                *v = *v * inv * wi;
            }
        });
    });
    Ok(vec![Value::tensor(downcast(x, dt)?)])
}

// ---------------------------------------------------------------------------------------------
// Batch / instance / group normalisation

/// Reads a per-channel (or per-element) parameter as `Vec<F>`, checking its length.
fn param_vec<F: Real>(t: &Tensor, want: &[usize], what: &str) -> Result<Vec<F>> {
    let t = upcast(t)?;
    let v = t.as_slice::<F>()?;
    if !want.contains(&v.len()) {
        bail!("{what} has {} elements, expected {:?}", v.len(), want);
    }
    Ok(v.to_vec())
}

/// `BatchNormalization`: inference uses the running `mean`/`var`; with `training_mode=1`
/// (opset 14+) the batch statistics are used and the updated running statistics returned.
/// Opset < 9 `spatial=0` (per-element parameters) is supported.
fn batch_norm(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let eps = ctx.node.float_or("epsilon", 1e-5)? as f64;
    let momentum = ctx.node.float_or("momentum", 0.9)? as f64;
    let training = ctx.opset >= 14 && ctx.node.int_or("training_mode", 0)? != 0;
    if ctx.opset < 14 && ctx.node.outputs.iter().skip(1).any(|o| !o.is_empty()) {
        bail!("BatchNormalization training outputs are only supported from opset 14");
    }
    let x = ins.take_tensor(0)?;
    let dt = x.dtype();
    let mut x = upcast_owned(x)?;
    let shape = x.shape().to_vec();
    if shape.len() < 2 {
        bail!(
            "BatchNormalization expects an input of rank >= 2, got {:?}",
            shape
        );
    }
    let (n, c) = (shape[0], shape[1]);
    let sp: usize = shape[2..].iter().product();
    let mut outs = vec![];
    dispatch_real!(x.dtype(), F => {
        let want = [c, c * sp];
        let s = param_vec::<F>(ins.tensor(1)?, &want, "scale")?;
        let b = param_vec::<F>(ins.tensor(2)?, &want, "B")?;
        let mut mean = param_vec::<F>(ins.tensor(3)?, &want, "input_mean")?;
        let mut var = param_vec::<F>(ins.tensor(4)?, &want, "input_var")?;
        if [b.len(), mean.len(), var.len()].iter().any(|&l| l != s.len()) {
            bail!("scale, B, mean and var must have the same number of elements");
        }
        let per_elem = s.len() != c;
        let data = x.as_mut_slice::<F>()?;
        let mut running = None;
        if training {
            // Batch statistics per channel, over N and the spatial axes.
            let cnt = (n * sp) as f64;
            let mut bm = vec![0f64; c];
            let mut bv = vec![0f64; c];
            for (i, blk) in data.chunks(sp.max(1)).enumerate() {
                bm[i % c] += blk.iter().map(|v| v.f64()).sum::<f64>();
            }
            bm.iter_mut().for_each(|m| *m /= cnt);
            for (i, blk) in data.chunks(sp.max(1)).enumerate() {
                let m = bm[i % c];
                bv[i % c] += blk.iter().map(|v| (v.f64() - m).powi(2)).sum::<f64>();
            }
            bv.iter_mut().for_each(|v| *v /= cnt);
            let rm: Vec<F> = mean.iter().zip(&bm).map(|(&r, &m)| F::of(r.f64() * momentum + m * (1.0 - momentum))).collect();
            let rv: Vec<F> = var.iter().zip(&bv).map(|(&r, &v)| F::of(r.f64() * momentum + v * (1.0 - momentum))).collect();
            running = Some((rm, rv));
            mean = bm.into_iter().map(F::of).collect();
            var = bv.into_iter().map(F::of).collect();
        }
        // y = x * a + k with a = s / sqrt(var + eps), k = b - mean * a.
        let a: Vec<F> = s.iter().zip(&var).map(|(&s, &v)| s / (v + F::of(eps)).sqrt()).collect();
        let k: Vec<F> = b.iter().zip(&mean).zip(&a).map(|((&b, &m), &a)| b - m * a).collect();
        if per_elem {
            for img in data.chunks_mut(c * sp) {
                for ((v, &a), &k) in img.iter_mut().zip(&a).zip(&k) {
                    *v = *v * a + k;
                }
            }
        } else {
            for_rows(data, sp, ctx.threads, |i, blk| {
                let (a, k) = (a[i % c], k[i % c]);
                for v in blk.iter_mut() {
                    *v = *v * a + k;
                }
            });
        }
        if let Some((rm, rv)) = running {
            outs.push(Tensor::from_vec(vec![rm.len()], rm)?);
            outs.push(Tensor::from_vec(vec![rv.len()], rv)?);
        }
    });
    let mut res = vec![Value::tensor(downcast(x, dt)?)];
    for t in outs {
        res.push(Value::tensor(downcast(t, dt)?));
    }
    Ok(res)
}

/// Normalises each contiguous block of `data` (length `blk`) by its own mean and variance;
/// `affine(i, j)` gives (scale, bias) for block `i`, element `j`.
fn normalize_blocks<F: Real>(
    data: &mut [F],
    blk: usize,
    eps: f64,
    threads: usize,
    affine: impl Fn(usize, usize) -> (F, F) + Sync,
) {
    for_rows(data, blk, threads, |i, b| {
        let n = b.len() as f64;
        // Accumulate the statistics in f64: blocks can be large (whole feature maps).
        let mean = b.iter().map(|v| v.f64()).sum::<f64>() / n;
        let var = b.iter().map(|v| (v.f64() - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        let (mean, inv) = (F::of(mean), F::of(inv));
        for (j, v) in b.iter_mut().enumerate() {
            let (s, k) = affine(i, j);
            *v = (*v - mean) * inv * s + k;
        }
    });
}

/// `InstanceNormalization`: per (batch, channel) over the spatial axes, then per-channel
/// scale and bias.
fn instance_norm(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let eps = ctx.node.float_or("epsilon", 1e-5)? as f64;
    let x = ins.take_tensor(0)?;
    let dt = x.dtype();
    let mut x = upcast_owned(x)?;
    let shape = x.shape().to_vec();
    if shape.len() < 2 {
        bail!(
            "InstanceNormalization expects an input of rank >= 2, got {:?}",
            shape
        );
    }
    let c = shape[1];
    let sp: usize = shape[2..].iter().product();
    dispatch_real!(x.dtype(), F => {
        let s = param_vec::<F>(ins.tensor(1)?, &[c], "scale")?;
        let b = param_vec::<F>(ins.tensor(2)?, &[c], "B")?;
        let data = x.as_mut_slice::<F>()?;
        normalize_blocks(data, sp, eps, ctx.threads, |i, _| (s[i % c], b[i % c]));
    });
    Ok(vec![Value::tensor(downcast(x, dt)?)])
}

/// `GroupNormalization`: per (batch, group) over the group's channels and the spatial axes.
/// Opset 18 takes per-group scale/bias, opset 21 per-channel ones.
fn group_norm(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let eps = ctx.node.float_or("epsilon", 1e-5)? as f64;
    let g = ctx.node.int_req("num_groups")?;
    let x = ins.take_tensor(0)?;
    let dt = x.dtype();
    let mut x = upcast_owned(x)?;
    let shape = x.shape().to_vec();
    if shape.len() < 2 {
        bail!(
            "GroupNormalization expects an input of rank >= 2, got {:?}",
            shape
        );
    }
    let c = shape[1];
    if g <= 0 || c % g as usize != 0 {
        bail!("num_groups {g} must be positive and divide the {c} channels");
    }
    let g = g as usize;
    let cpg = c / g;
    let sp: usize = shape[2..].iter().product();
    dispatch_real!(x.dtype(), F => {
        let want: &[usize] = if ctx.opset >= 21 { &[c] } else { &[g] };
        let s = param_vec::<F>(ins.tensor(1)?, want, "scale")?;
        let b = param_vec::<F>(ins.tensor(2)?, want, "bias")?;
        let per_channel = s.len() == c;
        let data = x.as_mut_slice::<F>()?;
        normalize_blocks(data, cpg * sp, eps, ctx.threads, |i, j| {
            let grp = i % g;
            let p = if per_channel { grp * cpg + j / sp.max(1) } else { grp };
            (s[p], b[p])
        });
    });
    Ok(vec![Value::tensor(downcast(x, dt)?)])
}

// ---------------------------------------------------------------------------------------------
// LRN, MVN, LpNormalization

/// `LRN`: `x / (bias + alpha / size * sum of squares over a window of channels) ^ beta`.
fn lrn(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let alpha = ctx.node.float_or("alpha", 1e-4)? as f64;
    let beta = ctx.node.float_or("beta", 0.75)? as f64;
    let bias = ctx.node.float_or("bias", 1.0)? as f64;
    let size = ctx.node.int_req("size")?;
    if size <= 0 {
        bail!("size must be positive, got {size}");
    }
    let x = ins.tensor(0)?;
    let shape = x.shape().to_vec();
    if shape.len() < 3 {
        bail!("LRN expects an input of rank >= 3, got {:?}", shape);
    }
    let (n, c) = (shape[0], shape[1]);
    let sp: usize = shape[2..].iter().product();
    let lo = ((size - 1) / 2) as usize;
    let hi = ((size - 1) as usize).div_ceil(2);
    let v = x.to_f64_vec()?;
    let mut out = vec![0f64; v.len()];
    let mut sq = vec![0f64; sp];
    for b in 0..n {
        let img = &v[b * c * sp..(b + 1) * c * sp];
        for ch in 0..c {
            sq.fill(0.0);
            for k in ch.saturating_sub(lo)..(ch + hi + 1).min(c) {
                for (s, &xv) in sq.iter_mut().zip(&img[k * sp..(k + 1) * sp]) {
                    *s += xv * xv;
                }
            }
            let o = &mut out[(b * c + ch) * sp..(b * c + ch + 1) * sp];
            for ((o, &s), &xv) in o.iter_mut().zip(&sq).zip(&img[ch * sp..(ch + 1) * sp]) {
                *o = xv / (bias + alpha / size as f64 * s).powf(beta);
            }
        }
    }
    Ok(vec![Value::tensor(f64_to_tensor(x.dtype(), shape, out)?)])
}

/// `MeanVarianceNormalization`: `(x - mean) / (sqrt(var) + 1e-9)` over `axes`
/// (default `[0, 2, 3]`), as the spec's function body computes it.
fn mean_variance_norm(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    use crate::ops::reduce::{reduce, ReduceKind};
    let axes = ctx
        .node
        .attr_ints("axes")?
        .map(|a| a.to_vec())
        .unwrap_or_else(|| vec![0, 2, 3]);
    let x = ins.tensor(0)?;
    let x64 = Tensor::from_vec(x.shape().to_vec(), x.to_f64_vec()?)?;
    let mean = reduce(&x64, &axes, true, ReduceKind::Mean)?;
    let sq: Vec<f64> = x64.as_slice::<f64>()?.iter().map(|v| v * v).collect();
    let msq = reduce(
        &Tensor::from_vec(x.shape().to_vec(), sq)?,
        &axes,
        true,
        ReduceKind::Mean,
    )?;
    let idx = broadcast_index_map(mean.shape(), x.shape());
    let (m, q) = (mean.as_slice::<f64>()?, msq.as_slice::<f64>()?);
    let out: Vec<f64> = x64
        .as_slice::<f64>()?
        .iter()
        .zip(&idx)
        .map(|(&v, &i)| (v - m[i]) / ((q[i] - m[i] * m[i]).sqrt() + 1e-9))
        .collect();
    Ok(vec![Value::tensor(f64_to_tensor(
        x.dtype(),
        x.shape().to_vec(),
        out,
    )?)])
}

/// `LpNormalization`: `x / ||x||_p` along `axis` (p = 1 or 2); zero where the norm is zero.
fn lp_norm(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let p = ctx.node.int_or("p", 2)?;
    if p != 1 && p != 2 {
        bail!("p must be 1 or 2, got {p}");
    }
    let x = ins.tensor(0)?;
    let shape = x.shape().to_vec();
    if shape.is_empty() {
        bail!("LpNormalization expects an input of rank >= 1");
    }
    let axis = norm_axis(ctx.node.int_or("axis", -1)?, shape.len())?;
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let mut v = x.to_f64_vec()?;
    let mut norm = vec![0f64; inner];
    for blk in v.chunks_mut((n * inner).max(1)) {
        norm.fill(0.0);
        for row in blk.chunks(inner.max(1)) {
            for (s, &xv) in norm.iter_mut().zip(row) {
                *s += if p == 1 { xv.abs() } else { xv * xv };
            }
        }
        if p == 2 {
            norm.iter_mut().for_each(|s| *s = s.sqrt());
        }
        for row in blk.chunks_mut(inner.max(1)) {
            for (xv, &s) in row.iter_mut().zip(&norm) {
                *xv = if s == 0.0 { 0.0 } else { *xv / s };
            }
        }
    }
    Ok(vec![Value::tensor(f64_to_tensor(x.dtype(), shape, v)?)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_is_accurate() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp_f32(x), x.exp());
            assert!((a - b).abs() <= b * 4e-7, "exp({x}) = {a}, expected {b}");
            x += 0.0137;
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(-1000.0) < 1e-37);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn softmax_row_sums_to_one() {
        let mut row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin() * 30.0).collect();
        soft_row(&mut row, SoftKind::Softmax);
        let s: f32 = row.iter().sum();
        assert!((s - 1.0).abs() < 1e-5);
        assert_eq!(max_of(&[1.0f32, 5.0, -2.0]), 5.0);
        assert_eq!(sum_of(&[1.0f32; 19]), 19.0);
    }
}
