//! Reductions: `ReduceSum`, `ReduceMean`, `ReduceMax`, `ReduceMin`, `ReduceProd`, `ReduceL1`,
//! `ReduceL2`, `ReduceLogSum`, `ReduceLogSumExp`, `ReduceSumSquare`, and `ArgMax`/`ArgMin`.
//!
//! Every reduction runs in one pass over the input in memory order: the shape is first collapsed
//! into runs of adjacent reduced / kept axes, so the innermost loop is either a contiguous fold
//! into one accumulator (reducing trailing axes) or a contiguous element-wise combine into a row
//! of accumulators (reducing leading axes).

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::common::norm_axis;
use crate::value::Value;
use npuc_ir::{bf16, f16, DType, Elem, Tensor};

pub fn register(r: &mut Registry) {
    r.add("ReduceSum", 1, reduce_sum);
    r.add("ReduceMean", 1, reduce_mean);
    r.add("ReduceMax", 1, reduce_max);
    r.add("ReduceMin", 1, reduce_min);
    r.add("ReduceProd", 1, reduce_prod);
    r.add("ReduceL1", 1, reduce_l1);
    r.add("ReduceL2", 1, reduce_l2);
    r.add("ReduceLogSum", 1, reduce_log_sum);
    r.add("ReduceLogSumExp", 1, reduce_log_sum_exp);
    r.add("ReduceSumSquare", 1, reduce_sum_square);
    r.add("ArgMax", 1, arg_max);
    r.add("ArgMin", 1, arg_min);
}

/// Which reduction a `Reduce*` node computes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
    L1,
    L2,
    LogSum,
    LogSumExp,
    SumSquare,
}

impl ReduceKind {
    /// First opset in which the op takes `axes` as an input instead of an attribute.
    fn axes_input_since(self) -> i64 {
        if self == ReduceKind::Sum {
            13
        } else {
            18
        }
    }
}

/// `ReduceSum`: sum over `axes`.
fn reduce_sum(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::Sum)
}
/// `ReduceMean`: arithmetic mean over `axes`.
fn reduce_mean(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::Mean)
}
/// `ReduceMax`: maximum over `axes` (bool: logical or).
fn reduce_max(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::Max)
}
/// `ReduceMin`: minimum over `axes` (bool: logical and).
fn reduce_min(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::Min)
}
/// `ReduceProd`: product over `axes`.
fn reduce_prod(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::Prod)
}
/// `ReduceL1`: sum of absolute values over `axes`.
fn reduce_l1(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::L1)
}
/// `ReduceL2`: square root of the sum of squares over `axes`.
fn reduce_l2(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::L2)
}
/// `ReduceLogSum`: natural log of the sum over `axes`.
fn reduce_log_sum(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::LogSum)
}
/// `ReduceLogSumExp`: `log(sum(exp(x)))` over `axes`, computed stably around the maximum.
fn reduce_log_sum_exp(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::LogSumExp)
}
/// `ReduceSumSquare`: sum of squares over `axes`.
fn reduce_sum_square(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    reduce_node(ctx, ins, ReduceKind::SumSquare)
}

/// Shared driver: reads `axes` (attribute or input depending on the opset), `keepdims` and
/// `noop_with_empty_axes`, then reduces.
fn reduce_node(ctx: &OpCtx, mut ins: Inputs, kind: ReduceKind) -> Result<Vec<Value>> {
    let keepdims = ctx.node.int_or("keepdims", 1)? != 0;
    let axes: Vec<i64> = if ctx.opset >= kind.axes_input_since() {
        match ins.opt_tensor(1) {
            Some(t) => t.to_i64_vec()?,
            None => vec![],
        }
    } else {
        ctx.node
            .attr_ints("axes")?
            .map(|a| a.to_vec())
            .unwrap_or_default()
    };
    let noop =
        ctx.opset >= kind.axes_input_since() && ctx.node.int_or("noop_with_empty_axes", 0)? != 0;
    if axes.is_empty() && noop {
        // The spec makes an empty axes list with this flag an identity.
        return Ok(vec![Value::tensor(ins.take_tensor(0)?)]);
    }
    let x = ins.tensor(0)?;
    Ok(vec![Value::tensor(reduce(x, &axes, keepdims, kind)?)])
}

/// Reduces `x` over `axes` (all axes when empty). Public so that other kernels (and graph
/// passes) can reuse it.
pub fn reduce(x: &Tensor, axes: &[i64], keepdims: bool, kind: ReduceKind) -> Result<Tensor> {
    let rank = x.rank();
    let mut mask = vec![axes.is_empty(); rank];
    for &a in axes {
        let a = norm_axis(a, rank)?;
        mask[a] = true;
    }
    let out_shape: Vec<usize> = x
        .shape()
        .iter()
        .zip(&mask)
        .filter_map(|(&d, &m)| match (m, keepdims) {
            (true, true) => Some(1),
            (true, false) => None,
            (false, _) => Some(d),
        })
        .collect();
    let plan = ReducePlan::new(x.shape(), &mask);
    // Fast path for the common "sum / mean over trailing axes" of f32 (decomposed layer
    // norms): each output is a contiguous row summed with independent lanes.
    let trailing = matches!(plan.dims.as_slice(), [(_, true)] | [(_, false), (_, true)]);
    if x.dtype() == DType::F32
        && trailing
        && matches!(kind, ReduceKind::Sum | ReduceKind::Mean)
        && plan.count > 0
    {
        let data = x.as_slice::<f32>()?;
        let div = if kind == ReduceKind::Mean {
            plan.count as f32
        } else {
            1.0
        };
        let out: Vec<f32> = data
            .chunks_exact(plan.count)
            .map(|row| crate::ops::real::sum_of(row) / div)
            .collect();
        return Ok(Tensor::from_vec(out_shape, out)?);
    }
    if x.dtype() == DType::Bool {
        let data = x.as_slice::<bool>()?;
        let (init, f): (bool, fn(bool, bool) -> bool) = match kind {
            ReduceKind::Max => (false, |a, b| a | b),
            ReduceKind::Min => (true, |a, b| a & b),
            _ => bail!("{kind:?} does not support bool inputs"),
        };
        let mut out = vec![init; plan.out_len];
        plan.run(data, &mut out, |a, b, _| f(a, b));
        return Ok(Tensor::from_vec(out_shape, out)?);
    }
    let out = match x.dtype() {
        DType::F32 => reduce_typed::<f32>(x, &plan, kind)?,
        DType::F64 => reduce_typed::<f64>(x, &plan, kind)?,
        DType::F16 => reduce_typed::<f16>(x, &plan, kind)?,
        DType::BF16 => reduce_typed::<bf16>(x, &plan, kind)?,
        DType::I8 => reduce_typed::<i8>(x, &plan, kind)?,
        DType::U8 => reduce_typed::<u8>(x, &plan, kind)?,
        DType::I16 => reduce_typed::<i16>(x, &plan, kind)?,
        DType::U16 => reduce_typed::<u16>(x, &plan, kind)?,
        DType::I32 => reduce_typed::<i32>(x, &plan, kind)?,
        DType::U32 => reduce_typed::<u32>(x, &plan, kind)?,
        DType::I64 => reduce_typed::<i64>(x, &plan, kind)?,
        DType::U64 => reduce_typed::<u64>(x, &plan, kind)?,
        other => bail!("{kind:?} does not support {other} inputs"),
    };
    Ok(out.reshaped(out_shape)?)
}

/// The input shape collapsed into runs of adjacent reduced / kept axes, plus the output layout.
struct ReducePlan {
    /// (extent, reduced?) per collapsed run; size-1 axes are dropped.
    dims: Vec<(usize, bool)>,
    /// Output stride of each collapsed run (0 for reduced runs).
    out_strides: Vec<usize>,
    out_len: usize,
    in_len: usize,
    /// Elements folded into each output value.
    count: usize,
}

impl ReducePlan {
    fn new(shape: &[usize], mask: &[bool]) -> ReducePlan {
        let mut dims: Vec<(usize, bool)> = vec![];
        for (&d, &m) in shape.iter().zip(mask) {
            if d == 1 {
                continue;
            }
            match dims.last_mut() {
                Some(last) if last.1 == m => last.0 *= d,
                _ => dims.push((d, m)),
            }
        }
        let mut out_strides = vec![0; dims.len()];
        let mut s = 1;
        for (i, &(d, m)) in dims.iter().enumerate().rev() {
            if !m {
                out_strides[i] = s;
                s *= d;
            }
        }
        let in_len: usize = shape.iter().product();
        let count: usize = shape
            .iter()
            .zip(mask)
            .filter(|(_, &m)| m)
            .map(|(&d, _)| d)
            .product();
        let out_len: usize = shape
            .iter()
            .zip(mask)
            .filter(|(_, &m)| !m)
            .map(|(&d, _)| d)
            .product();
        ReducePlan {
            dims,
            out_strides,
            out_len,
            in_len,
            count,
        }
    }

    /// Folds every input element into its output slot with `f(acc, x, out_index)`, reading the
    /// input in memory order. `out` must be pre-filled with the reduction's identity.
    #[inline]
    fn run<T: Copy, A: Copy>(&self, x: &[T], out: &mut [A], f: impl Fn(A, T, usize) -> A) {
        if self.in_len == 0 || out.is_empty() {
            return;
        }
        let Some(&(inner, inner_reduced)) = self.dims.last() else {
            // Every axis has extent 1: one element in, one out.
            out[0] = f(out[0], x[0], 0);
            return;
        };
        let outer_dims = &self.dims[..self.dims.len() - 1];
        let mut counter = vec![0usize; outer_dims.len()];
        let mut o = 0usize;
        for chunk in x.chunks_exact(inner) {
            if inner_reduced {
                let mut acc = out[o];
                for &v in chunk {
                    acc = f(acc, v, o);
                }
                out[o] = acc;
            } else {
                for (j, (a, &v)) in out[o..o + inner].iter_mut().zip(chunk).enumerate() {
                    *a = f(*a, v, o + j);
                }
            }
            // Advance the odometer over the outer runs.
            for d in (0..outer_dims.len()).rev() {
                counter[d] += 1;
                o += self.out_strides[d];
                if counter[d] < outer_dims[d].0 {
                    break;
                }
                o -= self.out_strides[d] * counter[d];
                counter[d] = 0;
            }
        }
    }
}

/// Element types the numeric reductions support, with the accumulator they use.
pub trait ReduceElem: Elem {
    /// Accumulator: f32 for f32/f16/bf16, f64 for f64, i64/u64 for integers.
    type Acc: Accum;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(a: Self::Acc) -> Self;
    /// Value of an empty max (`-inf` or the type's minimum).
    fn lowest() -> Self;
    /// Value of an empty min.
    fn highest() -> Self;
}

/// Arithmetic on accumulators.
pub trait Accum: Copy + PartialOrd {
    const ZERO: Self;
    const ONE: Self;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn abs(self) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    /// `self / n` (integer division for integer accumulators, as numpy's cast does).
    fn div_count(self, n: usize) -> Self;
}

macro_rules! accum_float {
    ($t:ty) => {
        impl Accum for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                self - o
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
accum_float!(f32);
accum_float!(f64);

macro_rules! accum_int {
    ($t:ty) => {
        impl Accum for $t {
            const ZERO: Self = 0;
            const ONE: Self = 1;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                #[allow(unused_comparisons)]
                if self < 0 {
                    (0 as $t).wrapping_sub(self)
                } else {
                    self
                }
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                if n == 0 {
                    0
                } else {
                    self / n as $t
                }
            }
        }
    };
}
accum_int!(i64);
accum_int!(u64);

macro_rules! relem_float {
    ($t:ty, $a:ty, $to:expr, $from:expr) => {
        impl ReduceElem for $t {
            type Acc = $a;
            #[inline(always)]
            fn to_acc(self) -> $a {
                $to(self)
            }
            #[inline(always)]
            fn from_acc(a: $a) -> Self {
                $from(a)
            }
            fn lowest() -> Self {
                <$t>::NEG_INFINITY
            }
            fn highest() -> Self {
                <$t>::INFINITY
            }
        }
    };
}
relem_float!(f32, f32, |x| x, |a| a);
relem_float!(f64, f64, |x| x, |a| a);
relem_float!(f16, f32, f16::to_f32, f16::from_f32);
relem_float!(bf16, f32, bf16::to_f32, bf16::from_f32);

macro_rules! relem_int {
    ($t:ty, $a:ty) => {
        impl ReduceElem for $t {
            type Acc = $a;
            #[inline(always)]
            fn to_acc(self) -> $a {
                self as $a
            }
            #[inline(always)]
            fn from_acc(a: $a) -> Self {
                a as $t
            }
            fn lowest() -> Self {
                <$t>::MIN
            }
            fn highest() -> Self {
                <$t>::MAX
            }
        }
    };
}
relem_int!(i8, i64);
relem_int!(i16, i64);
relem_int!(i32, i64);
relem_int!(i64, i64);
relem_int!(u8, u64);
relem_int!(u16, u64);
relem_int!(u32, u64);
relem_int!(u64, u64);

fn reduce_typed<T: ReduceElem>(x: &Tensor, plan: &ReducePlan, kind: ReduceKind) -> Result<Tensor> {
    let data = x.as_slice::<T>()?;
    let n = plan.out_len;
    let out: Vec<T> = match kind {
        ReduceKind::Max | ReduceKind::Min => {
            let max = kind == ReduceKind::Max;
            let init = if max { T::lowest() } else { T::highest() };
            let mut acc = vec![init.to_acc(); n];
            if max {
                plan.run(data, &mut acc, |a, v: T, _| {
                    let v = v.to_acc();
                    if v > a {
                        v
                    } else {
                        a
                    }
                });
            } else {
                plan.run(data, &mut acc, |a, v: T, _| {
                    let v = v.to_acc();
                    if v < a {
                        v
                    } else {
                        a
                    }
                });
            }
            acc.into_iter().map(T::from_acc).collect()
        }
        ReduceKind::Prod => {
            let mut acc = vec![T::Acc::ONE; n];
            plan.run(data, &mut acc, |a, v: T, _| a.mul(v.to_acc()));
            acc.into_iter().map(T::from_acc).collect()
        }
        ReduceKind::LogSumExp => {
            // Subtract each slot's maximum before exponentiating so large inputs don't overflow.
            let mut mx = vec![f64::NEG_INFINITY; n];
            plan.run(data, &mut mx, |a, v: T, _| {
                let v = v.to_acc().to_f64();
                if v > a && v.is_finite() {
                    v
                } else {
                    a
                }
            });
            for m in mx.iter_mut() {
                if !m.is_finite() {
                    *m = 0.0;
                }
            }
            let mut acc = vec![T::Acc::ZERO; n];
            plan.run(data, &mut acc, |a, v: T, o| {
                a.add(T::Acc::from_f64((v.to_acc().to_f64() - mx[o]).exp()))
            });
            acc.into_iter()
                .zip(&mx)
                .map(|(a, &m)| T::from_acc(T::Acc::from_f64(a.to_f64().ln() + m)))
                .collect()
        }
        _ => {
            let mut acc = vec![T::Acc::ZERO; n];
            match kind {
                ReduceKind::L1 => plan.run(data, &mut acc, |a, v: T, _| a.add(v.to_acc().abs())),
                ReduceKind::L2 | ReduceKind::SumSquare => plan.run(data, &mut acc, |a, v: T, _| {
                    let v = v.to_acc();
                    a.add(v.mul(v))
                }),
                _ => plan.run(data, &mut acc, |a, v: T, _| a.add(v.to_acc())),
            }
            let count = plan.count;
            acc.into_iter()
                .map(|a| {
                    T::from_acc(match kind {
                        ReduceKind::Mean => {
                            if count == 0 {
                                T::Acc::from_f64(f64::NAN)
                            } else {
                                a.div_count(count)
                            }
                        }
                        ReduceKind::L2 => T::Acc::from_f64(a.to_f64().sqrt()),
                        ReduceKind::LogSum => T::Acc::from_f64(a.to_f64().ln()),
                        _ => a,
                    })
                })
                .collect()
        }
    };
    Ok(Tensor::from_vec(vec![n], out)?)
}

/// `ArgMax`: index of the largest element along `axis` (first or, with `select_last_index`,
/// last occurrence); int64 output.
fn arg_max(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    arg_node(ctx, ins, true)
}

/// `ArgMin`: index of the smallest element along `axis`; int64 output.
fn arg_min(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    arg_node(ctx, ins, false)
}

fn arg_node(ctx: &OpCtx, ins: Inputs, max: bool) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let axis = norm_axis(ctx.node.int_or("axis", 0)?, x.rank())?;
    let keepdims = ctx.node.int_or("keepdims", 1)? != 0;
    let last = ctx.node.int_or("select_last_index", 0)? != 0;
    let shape = x.shape();
    if shape.is_empty() {
        return Ok(vec![Value::tensor(Tensor::scalar(0i64))]);
    }
    let n = shape[axis];
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    if n == 0 && outer * inner > 0 {
        bail!("cannot take an arg-reduction over an empty axis");
    }
    let mut out_shape = shape.to_vec();
    if keepdims {
        out_shape[axis] = 1;
    } else {
        out_shape.remove(axis);
    }
    let out = if x.dtype() == DType::Bool {
        arg_typed(x.as_slice::<bool>()?, outer, n, inner, max, last)
    } else {
        crate::dispatch_numeric!(x.dtype(), T => {
            arg_typed(x.as_slice::<T>()?, outer, n, inner, max, last)
        })
    };
    Ok(vec![Value::tensor(Tensor::from_vec(out_shape, out)?)])
}

/// Arg-reduction over the middle axis of an `[outer, n, inner]` view. The running best row is
/// compared element-wise so that the reads stay contiguous.
fn arg_typed<T: PartialOrd + Copy>(
    x: &[T],
    outer: usize,
    n: usize,
    inner: usize,
    max: bool,
    last: bool,
) -> Vec<i64> {
    let mut out = vec![0i64; outer * inner];
    if n == 0 || inner == 0 {
        return out;
    }
    let mut best: Vec<T> = Vec::with_capacity(inner);
    for o in 0..outer {
        let base = o * n * inner;
        best.clear();
        best.extend_from_slice(&x[base..base + inner]);
        let idx = &mut out[o * inner..(o + 1) * inner];
        for k in 1..n {
            let row = &x[base + k * inner..base + (k + 1) * inner];
            for ((b, i), &v) in best.iter_mut().zip(idx.iter_mut()).zip(row) {
                let better = match (max, last) {
                    (true, false) => v > *b,
                    (true, true) => v >= *b,
                    (false, false) => v < *b,
                    (false, true) => v <= *b,
                };
                if better {
                    *b = v;
                    *i = k as i64;
                }
            }
        }
    }
    out
}
