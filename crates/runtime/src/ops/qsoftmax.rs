//! `npuc.QSoftmax`: Softmax between a per-tensor 8-bit DequantizeLinear and QuantizeLinear,
//! computed from the integer codes.
//!
//! Inputs `x (u8|i8), x_scale (f32 scalar), x_zero_point? (scalar), y_scale (f32 scalar),
//! y_zero_point? (u8|i8 scalar; u8 zero when absent, as QuantizeLinear)`; attribute `axis`
//! (default -1). The softmax runs over the contiguous rows `x.shape[axis..]` (opset < 13
//! Softmax semantics; the `quant_lower` pass writes it for opset >= 13 only when `axis` is the
//! last one, where both agree). The output has `y_zero_point`'s dtype and `x`'s shape.
//!
//! Softmax is shift invariant, so with `s = x_scale` and `qmax` the row's largest code,
//! `exp(x - max x) = exp(-s * (qmax - q))`: one of 256 values, tabulated once per plan (exactly
//! rounded, from f64). The zero point cancels and is only validated. Per row: the largest
//! code, the table lookups into a row of f32, their sum, then the float path's own final
//! steps: `p = e * (1 / sum)` and `clamp(round_half_even(p / y_scale) + y_zp)` (the division,
//! as QuantizeLinear, through [`qconvert::quantize`]). The result matches
//! `DQ -> Softmax -> Q` run in f32 on every element but those whose real value lies within a
//! few f32 ulps of a rounding boundary, and there by one step; exact ties (e.g. rows of equal
//! codes, where `e = 1` and the sum is exact) round the same way since the final steps are
//! the same operations.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::kernels::qconvert::{self, Isa, QInt};
use crate::ops::real::sum_of;
use crate::value::Value;
use npuc_ir::infer::rules::tt;
use npuc_ir::opdef::{AttrDef, OpDef, Param};
use npuc_ir::{DType, Tensor};
use rayon::prelude::*;

/// Registers `npuc.QSoftmax`.
pub fn register(r: &mut Registry) {
    r.define(&QSOFTMAX, qsoftmax);
}

/// `npuc.QSoftmax` (see the module docs): `x`'s shape, `y_zero_point`'s dtype (u8 without it).
pub static QSOFTMAX: OpDef = OpDef {
    domain: "npuc",
    name: "QSoftmax",
    inputs: &[
        Param::required("x"),
        Param::required("x_scale"),
        Param::optional("x_zero_point"),
        Param::required("y_scale"),
        Param::optional("y_zero_point"),
    ],
    outputs: &[Param::required("y")],
    attrs: &[AttrDef::optional("axis", "int")],
    infer: |n| {
        let dt = if n.has(4) { n.dt(4) } else { Some(DType::U8) };
        Ok(vec![tt(dt, n.shape(0).map(|s| s.to_vec()))])
    },
};

/// Elements at which the rows are split across threads: below it (one ViT-S attention head
/// set is ~233k) the fork/join costs more than the second core gives back.
const PAR_MIN: usize = 1 << 16;

/// `table[k] = exp(-scale * k)` for the code distance `k = qmax - q` in `0..=255`, each value
/// the correctly rounded f32 of the f64 result.
pub fn exp_table(scale: f32) -> [f32; 256] {
    let s = scale as f64;
    std::array::from_fn(|k| (-(k as f64) * s).exp() as f32)
}

/// An 8-bit code mapped to an order-preserving byte (u8 as is, i8 with its sign bit flipped),
/// so that code distances `qmax - q` are plain `u8` differences.
pub trait Code: Copy + Send + Sync + 'static {
    /// The order-preserving byte.
    fn key(self) -> u8;
}
impl Code for u8 {
    #[inline(always)]
    fn key(self) -> u8 {
        self
    }
}
impl Code for i8 {
    #[inline(always)]
    fn key(self) -> u8 {
        (self as u8) ^ 0x80
    }
}

/// Fills `probs` (the row's length) with the row's softmax probabilities: the table value of
/// each code's distance to the row's largest code, times `1 / sum`. Empty rows do nothing.
#[inline]
pub fn row_probs<I: Code>(codes: &[I], table: &[f32; 256], probs: &mut [f32]) {
    if codes.is_empty() {
        return;
    }
    // 16 independent lanes of the byte maximum vectorise.
    let mut lanes = [0u8; 16];
    let chunks = codes.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = (*l).max(v.key());
        }
    }
    let mut qmax = lanes.iter().copied().max().unwrap_or(0);
    for &v in tail {
        qmax = qmax.max(v.key());
    }
    for (p, &q) in probs.iter_mut().zip(codes) {
        // qmax >= q.key(), so the distance is in 0..=255 and the index always in bounds.
        *p = table[(qmax - q.key()) as usize];
    }
    // The same 8-lane sum and reciprocal multiply as the f32 Softmax kernel.
    let inv = 1.0 / sum_of(probs);
    for p in probs.iter_mut() {
        *p *= inv;
    }
}

/// The requantization parameters of the output.
#[derive(Clone, Copy)]
struct OutQ {
    isa: Isa,
    scale: f32,
    zp: i32,
}

/// One row: probabilities into `scratch`, then quantized into `out`.
#[inline]
fn row_into<I: Code, O: QInt>(
    codes: &[I],
    table: &[f32; 256],
    scratch: &mut [f32],
    oq: OutQ,
    out: &mut [O],
) {
    let probs = &mut scratch[..codes.len()];
    row_probs(codes, table, probs);
    qconvert::quantize(oq.isa, probs, oq.scale, oq.zp, out);
}

/// Rows of `x` into rows of `out` (different dtypes), in parallel when worthwhile.
fn run_rows<I: Code, O: QInt>(
    x: &[I],
    out: &mut [O],
    n: usize,
    table: &[f32; 256],
    oq: OutQ,
    threads: usize,
) {
    let work = |xs: &[I], os: &mut [O]| {
        let mut scratch = vec![0f32; n];
        for (c, o) in xs.chunks(n).zip(os.chunks_mut(n)) {
            row_into(c, table, &mut scratch, oq, o);
        }
    };
    let rows = x.len() / n;
    if threads > 1 && x.len() >= PAR_MIN && rows >= 2 {
        let per = rows.div_ceil(threads * 4) * n;
        x.par_chunks(per)
            .zip(out.par_chunks_mut(per))
            .for_each(|(xs, os)| work(xs, os));
    } else {
        work(x, out);
    }
}

/// Rows of `x` quantized in place (same input and output dtype), in parallel when worthwhile.
fn run_rows_inplace<T: Code + QInt>(
    x: &mut [T],
    n: usize,
    table: &[f32; 256],
    oq: OutQ,
    threads: usize,
) {
    let work = |xs: &mut [T]| {
        let mut scratch = vec![0f32; n];
        for row in xs.chunks_mut(n) {
            let probs = &mut scratch[..row.len()];
            row_probs(row, table, probs);
            qconvert::quantize(oq.isa, probs, oq.scale, oq.zp, row);
        }
    };
    let rows = x.len() / n;
    if threads > 1 && x.len() >= PAR_MIN && rows >= 2 {
        let per = rows.div_ceil(threads * 4) * n;
        x.par_chunks_mut(per).for_each(work);
    } else {
        work(x);
    }
}

/// A positive, finite f32 scalar scale.
fn scale_of(t: &Tensor, what: &str) -> Result<f32> {
    if t.dtype() != DType::F32 || t.len() != 1 {
        bail!(
            "{what} must be an f32 scalar, found {} of shape {:?}",
            t.dtype(),
            t.shape()
        );
    }
    let s = t.as_slice::<f32>()?[0];
    if !(s.is_finite() && s > 0.0) {
        bail!("{what} must be positive and finite, found {s}");
    }
    Ok(s)
}

/// A scalar zero point of an 8-bit type; `None` when absent.
fn zp_of(t: Option<&Tensor>, what: &str) -> Result<Option<(DType, i32)>> {
    let Some(t) = t else {
        return Ok(None);
    };
    if t.len() != 1 {
        bail!("{what} must be a scalar, found shape {:?}", t.shape());
    }
    let v = match t.dtype() {
        DType::U8 => t.as_slice::<u8>()?[0] as i32,
        DType::I8 => t.as_slice::<i8>()?[0] as i32,
        other => bail!("{what} must be u8 or i8, found {other}"),
    };
    Ok(Some((t.dtype(), v)))
}

fn qsoftmax(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let x_dt = ins.tensor(0)?.dtype();
    if !matches!(x_dt, DType::U8 | DType::I8) {
        bail!("QSoftmax input x must be u8 or i8, found {x_dt}");
    }
    let xs = scale_of(ins.tensor(1)?, "x_scale")?;
    if let Some((zdt, _)) = zp_of(ins.opt_tensor(2), "x_zero_point")? {
        if zdt != x_dt {
            bail!("x_zero_point has dtype {zdt} but x is {x_dt}");
        }
    }
    let ys = scale_of(
        ins.opt_tensor(3)
            .ok_or_else(|| crate::error::RtError::msg("QSoftmax needs y_scale (input 3)"))?,
        "y_scale",
    )?;
    let (out_dt, yzp) = zp_of(ins.opt_tensor(4), "y_zero_point")?.unwrap_or((DType::U8, 0));
    let shape = ins.tensor(0)?.shape().to_vec();
    let rank = shape.len() as i64;
    let axis = ctx.node.int_or("axis", -1)?;
    let a = if axis < 0 { axis + rank } else { axis };
    let n = if rank == 0 {
        1
    } else if (0..rank).contains(&a) {
        shape[a as usize..].iter().product::<usize>()
    } else {
        bail!("QSoftmax axis {axis} is out of range for input shape {shape:?}");
    };
    let table;
    let cached;
    let tab: &[f32; 256] = if ctx.input_is_const(1) {
        cached = ctx.cached(|| Ok(exp_table(xs)))?;
        &cached
    } else {
        table = exp_table(xs);
        &table
    };
    let oq = OutQ {
        isa: Isa::detect(),
        scale: ys,
        zp: yzp,
    };
    let t = ctx.threads;
    if n == 0 || shape.iter().product::<usize>() == 0 {
        let out = match out_dt {
            DType::U8 => Tensor::from_vec(shape, Vec::<u8>::new())?,
            _ => Tensor::from_vec(shape, Vec::<i8>::new())?,
        };
        return Ok(vec![Value::tensor(out)]);
    }
    let out = match (x_dt, out_dt) {
        (DType::U8, DType::U8) => {
            let mut x = ins.take_tensor(0)?;
            run_rows_inplace(x.as_mut_slice::<u8>()?, n, tab, oq, t);
            x
        }
        (DType::I8, DType::I8) => {
            let mut x = ins.take_tensor(0)?;
            run_rows_inplace(x.as_mut_slice::<i8>()?, n, tab, oq, t);
            x
        }
        (DType::U8, _) => {
            let x = ins.tensor(0)?.as_slice::<u8>()?;
            let mut o = vec![0i8; x.len()];
            run_rows(x, &mut o, n, tab, oq, t);
            Tensor::from_vec(shape, o)?
        }
        _ => {
            let x = ins.tensor(0)?.as_slice::<i8>()?;
            let mut o = vec![0u8; x.len()];
            run_rows(x, &mut o, n, tab, oq, t);
            Tensor::from_vec(shape, o)?
        }
    };
    Ok(vec![Value::tensor(out)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The float path of the runtime's own kernels, written out: DequantizeLinear, the f32
    /// Softmax row (exp_f32 of x - max, 8-lane sum, reciprocal multiply), QuantizeLinear.
    fn float_path(codes: &[u8], s: f32, zp: i32, ys: f32, yzp: i32) -> Vec<u8> {
        let mut x = vec![0f32; codes.len()];
        qconvert::dequantize(Isa::Scalar, codes, s, zp, &mut x);
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for v in x.iter_mut() {
            *v = crate::ops::norm::exp_f32(*v - m);
        }
        let inv = 1.0 / sum_of(&x);
        for v in x.iter_mut() {
            *v *= inv;
        }
        let mut out = vec![0u8; codes.len()];
        qconvert::quantize(Isa::Scalar, &x, ys, yzp, &mut out);
        out
    }

    #[test]
    fn table_is_exp_of_code_distance() {
        let t = exp_table(0.1);
        assert_eq!(t[0], 1.0);
        for (k, &v) in t.iter().enumerate() {
            let want = (-(k as f64) * 0.1f32 as f64).exp();
            assert!(
                ((v as f64) - want).abs() <= want * 1e-7,
                "{k}: {v} vs {want}"
            );
        }
    }

    #[test]
    fn equal_rows_tie_like_the_float_path() {
        // Two equal codes: p = 0.5 and 0.5 / (1/255) sits on a rounding boundary; the kernel
        // must round it as the float path does.
        let ys = 1.0 / 255.0;
        for n in 1..40 {
            let codes = vec![77u8; n];
            let mut probs = vec![0f32; n];
            row_probs(&codes, &exp_table(0.05), &mut probs);
            let mut got = vec![0u8; n];
            qconvert::quantize(Isa::Scalar, &probs, ys, 0, &mut got);
            assert_eq!(got, float_path(&codes, 0.05, 3, ys, 0), "n = {n}");
        }
    }
}
