//! Unary math and activation kernels. Float kernels are written once as a closure body that is
//! instantiated for f32 and f64 (f16/bf16 compute through f32), and run in place when the input
//! buffer may be reused.

use super::{binary_same, reusable, same_dtype, Arith, PAR_MIN, PAR_MIN_MATH};
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::kernels::fmap;
use crate::value::Value;
use crate::{bail, dispatch_numeric};
use npuc_ir::{bf16, f16, DType, Elem, Tensor};
use rayon::prelude::*;

/// Maps `v` in place with `f`, split across threads when large.
fn map_in_place<T: Copy + Send + Sync>(v: &mut [T], threads: usize, f: impl Fn(T) -> T + Sync) {
    if threads > 1 && v.len() >= PAR_MIN {
        let chunk = v.len().div_ceil(threads);
        v.par_chunks_mut(chunk).for_each(|c| {
            for x in c {
                *x = f(*x);
            }
        });
    } else {
        for x in v {
            *x = f(*x);
        }
    }
}

/// [`unary_same`] for f32 with the map compiled per ISA level ([`fmap`]: the closure
/// vectorizes at the CPU's width instead of the baseline's).
fn unary_f32(ins: &mut Inputs, threads: usize, f: impl Fn(f32) -> f32 + Sync) -> Result<Tensor> {
    let par = |v: &mut [f32]| {
        if threads > 1 && v.len() >= PAR_MIN {
            let chunk = v.len().div_ceil(threads);
            v.par_chunks_mut(chunk)
                .for_each(|c| fmap::map_in_place(c, &f));
        } else {
            fmap::map_in_place(v, &f);
        }
    };
    if reusable(ins, 0) {
        let mut t = ins.take_tensor(0)?;
        par(t.as_mut_slice::<f32>()?);
        return Ok(t);
    }
    let x = ins.tensor(0)?;
    let src = x.as_slice::<f32>()?;
    let mut out = crate::buffers::for_overwrite::<f32>(src.len());
    if threads > 1 && src.len() >= PAR_MIN {
        let chunk = src.len().div_ceil(threads);
        out.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(o, s)| fmap::map_into(s, o, &f));
    } else {
        fmap::map_into(src, &mut out, &f);
    }
    Ok(Tensor::from_vec(x.shape().to_vec(), out)?)
}

/// Applies a same-type map to input 0: in place when the buffer may be reused, else into a
/// fresh buffer.
pub fn unary_same<T: Elem>(
    ins: &mut Inputs,
    threads: usize,
    f: impl Fn(T) -> T + Sync,
) -> Result<Tensor> {
    if reusable(ins, 0) {
        let mut t = ins.take_tensor(0)?;
        map_in_place(t.as_mut_slice::<T>()?, threads, f);
        return Ok(t);
    }
    let x = ins.tensor(0)?;
    let src = x.as_slice::<T>()?;
    let out: Vec<T> = if threads > 1 && src.len() >= PAR_MIN {
        let mut out = crate::buffers::take(src.len());
        out.extend_from_slice(src);
        map_in_place(&mut out, threads, f);
        out
    } else {
        let mut out = crate::buffers::take(src.len());
        out.extend(src.iter().map(|&v| f(v)));
        out
    };
    Ok(Tensor::from_vec(x.shape().to_vec(), out)?)
}

/// A float-only unary op given as an f32 and an f64 function; f16/bf16 compute through f32.
pub fn unary_float(
    ctx: &OpCtx,
    mut ins: Inputs,
    f32f: impl Fn(f32) -> f32 + Sync,
    f64f: impl Fn(f64) -> f64 + Sync,
) -> Result<Vec<Value>> {
    let t = match ins.tensor(0)?.dtype() {
        DType::F32 => unary_f32(&mut ins, ctx.threads, f32f)?,
        DType::F64 => unary_same::<f64>(&mut ins, ctx.threads, f64f)?,
        DType::F16 => {
            unary_same::<f16>(&mut ins, ctx.threads, |x| f16::from_f32(f32f(x.to_f32())))?
        }
        DType::BF16 => {
            unary_same::<bf16>(&mut ins, ctx.threads, |x| bf16::from_f32(f32f(x.to_f32())))?
        }
        other => bail!("{} needs a float input, got {other}", ctx.node.op_type),
    };
    Ok(vec![Value::tensor(t)])
}

/// Instantiates one closure body for f32 and f64. Parameters listed in brackets are f64
/// values converted to the element type before the loop.
macro_rules! float_map {
    ($ctx:expr, $ins:expr, [$($p:ident),*], |$x:ident| $body:expr) => {{
        unary_float(
            $ctx,
            $ins,
            {
                $(let $p = $p as f32;)*
                move |$x: f32| -> f32 { $body }
            },
            {
                $(let $p = $p as f64;)*
                move |$x: f64| -> f64 { $body }
            },
        )
    }};
}

/// The error function, for f32 and f64.
pub trait Erf: Copy {
    fn error_fn(self) -> Self;
}

impl Erf for f32 {
    /// Rational approximation (as in Eigen/XLA) on [-4, 4], where erf already rounds to ±1
    /// in f32 outside; branch-free and without `mul_add` (a libm call unless the target has
    /// FMA) so loops over it vectorize. Max error about 2 ulp.
    #[inline(always)]
    fn error_fn(self) -> f32 {
        let x = self.clamp(-4.0, 4.0);
        let x2 = x * x;
        let mut p = x2 * -2.726_142_3e-10 + 2.770_681_4e-8;
        p = x2 * p + -2.101_024e-6;
        p = x2 * p + -5.692_506_4e-5;
        p = x2 * p + -7.349_906_3e-4;
        p = x2 * p + -2.954_600_5e-3;
        p = x2 * p + -1.609_603_3e-2;
        let mut q = x2 * -1.456_607_2e-5 + -2.133_740_6e-4;
        q = x2 * q + -1.682_827e-3;
        q = x2 * q + -7.373_329_3e-3;
        q = x2 * q + -1.426_474e-2;
        x * p / q
    }
}

impl Erf for f64 {
    /// erf via erfc's Chebyshev fit (Numerical Recipes `erfcc` refined with W. J. Cody's
    /// rational approximations for |x| < 0.5), relative error below 1e-15 near 0 and 1.2e-7
    /// elsewhere.
    // The coefficients are quoted as published.
    #[allow(clippy::excessive_precision)]
    fn error_fn(self) -> f64 {
        let x = self;
        if x.is_nan() {
            return x;
        }
        let ax = x.abs();
        if ax < 0.5 {
            // Cody's rational approximation for erf on [0, 0.5].
            const P: [f64; 5] = [
                3.209_377_589_138_469_4e3,
                3.774_852_376_853_020_2e2,
                1.138_641_541_510_501_6e2,
                3.161_123_743_870_565_6,
                1.857_777_061_846_031_5e-1,
            ];
            const Q: [f64; 5] = [
                2.844_236_833_439_170_6e3,
                1.282_616_526_077_372_3e3,
                2.440_246_379_344_441_7e2,
                2.360_129_095_234_412_1e1,
                1.0,
            ];
            let z = x * x;
            let num = P[0] + z * (P[1] + z * (P[2] + z * (P[3] + z * P[4])));
            let den = Q[0] + z * (Q[1] + z * (Q[2] + z * (Q[3] + z * Q[4])));
            return x * num / den;
        }
        let t = 1.0 / (1.0 + 0.5 * ax);
        let poly = -ax * ax - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77))))))));
        let erfc = t * poly.exp();
        if x >= 0.0 {
            1.0 - erfc
        } else {
            erfc - 1.0
        }
    }
}

/// e^x, for f32 through a vectorizable polynomial ([`exp_f32`]) and for f64 through libm.
pub trait FastExp: Copy {
    fn fexp(self) -> Self;
}

impl FastExp for f32 {
    #[inline(always)]
    fn fexp(self) -> f32 {
        exp_f32(self)
    }
}

impl FastExp for f64 {
    #[inline(always)]
    fn fexp(self) -> f64 {
        self.exp()
    }
}

/// [`exp_f32`]'s constants (SIMD copies of it repeat its operations with these).
pub mod exp_consts {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    /// 1.5 * 2^23: adding it rounds to an integer.
    pub const MAGIC: f32 = 12_582_912.0;
    /// ln(f32::MAX)
    pub const HI: f32 = 88.722_84;
    /// ln(f32::MIN_POSITIVE)
    pub const LO: f32 = -87.336_55;
    /// The polynomial in the reduced argument, highest degree first.
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
}

/// e^x in f32 (Cephes `expf` polynomial, about 1 ulp), branch-free so that loops over it
/// vectorize with plain SSE2: round-to-nearest via the 1.5·2^23 trick, Cody–Waite range
/// reduction, and the 2^n scale applied as two factors so that n = 128 does not overflow.
/// Results below `f32::MIN_POSITIVE` flush to zero.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    use exp_consts::*;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = P[0];
    for c in &P[1..] {
        p = p * r + c;
    }
    let e = p * r * r + r + 1.0;
    exp_finish(x, e, ni)
}

/// The end of [`exp_f32`] and its fused copy: `e * 2^ni` (as two factors, so that `ni = 128`
/// does not overflow), flushed to zero below `LO` and infinite above `HI` (by `x`, the
/// unclamped argument; NaN passes through the arithmetic since both comparisons are false).
#[inline(always)]
pub fn exp_finish(x: f32, e: f32, ni: i32) -> f32 {
    use exp_consts::{HI, LO};
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    let y = e * s1 * s2;
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        y
    }
}

fn erf<F: Erf>(x: F) -> F {
    x.error_fn()
}

/// ln(1 + e^x) without overflow for large x.
fn softplus32(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}
fn softplus64(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

macro_rules! simple_float {
    ($(#[$m:meta])* $name:ident, |$x:ident| $body:expr) => {
        $(#[$m])*
        fn $name(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
            float_map!(ctx, ins, [], |$x| $body)
        }
    };
}

simple_float!(
    /// Sqrt: square root.
    sqrt, |x| x.sqrt()
);
simple_float!(
    /// Exp: e^x.
    exp, |x| x.fexp()
);
simple_float!(
    /// Log: natural logarithm.
    log, |x| x.ln()
);
simple_float!(
    /// Reciprocal: 1/x.
    reciprocal, |x| 1.0 / x
);
simple_float!(
    /// Ceil: round toward +inf.
    ceil, |x| x.ceil()
);
simple_float!(
    /// Floor: round toward -inf.
    floor, |x| x.floor()
);
simple_float!(
    /// Round: round half to even.
    round, |x| x.round_ties_even()
);
simple_float!(
    /// Erf: the error function.
    erf_op, |x| erf(x)
);
simple_float!(
    /// Sin.
    sin, |x| x.sin()
);
simple_float!(
    /// Cos.
    cos, |x| x.cos()
);
simple_float!(
    /// Tan.
    tan, |x| x.tan()
);
simple_float!(
    /// Asin.
    asin, |x| x.asin()
);
simple_float!(
    /// Acos.
    acos, |x| x.acos()
);
simple_float!(
    /// Atan.
    atan, |x| x.atan()
);
simple_float!(
    /// Sinh.
    sinh, |x| x.sinh()
);
simple_float!(
    /// Cosh.
    cosh, |x| x.cosh()
);
simple_float!(
    /// Asinh.
    asinh, |x| x.asinh()
);
simple_float!(
    /// Acosh.
    acosh, |x| x.acosh()
);
simple_float!(
    /// Atanh.
    atanh, |x| x.atanh()
);
/// Tanh: f32 through the dispatched slice kernel `act::tanh` (AVX2 where the CPU has it; the
/// same values as `tanh_f32` per element), f64 through libm.
fn tanh(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    use crate::kernels::act;
    unary_f32_kernel(ctx, ins, act::tanh, act::tanh_f32, |x| x.tanh())
}

/// A float unary op whose f32 form is a slice kernel chosen at run time (`kernels::act`); the
/// other float types go through [`unary_float`] with the scalar functions.
fn unary_f32_kernel(
    ctx: &OpCtx,
    mut ins: Inputs,
    kernel: fn(&mut [f32]),
    f32f: impl Fn(f32) -> f32 + Sync,
    f64f: impl Fn(f64) -> f64 + Sync,
) -> Result<Vec<Value>> {
    if ins.tensor(0)?.dtype() != DType::F32 {
        return unary_float(ctx, ins, f32f, f64f);
    }
    let mut t = if reusable(&ins, 0) {
        ins.take_tensor(0)?
    } else {
        let x = ins.tensor(0)?;
        let mut out = crate::buffers::take(x.len());
        out.extend_from_slice(x.as_slice::<f32>()?);
        Tensor::from_vec(x.shape().to_vec(), out)?
    };
    let v = t.as_mut_slice::<f32>()?;
    if ctx.threads > 1 && v.len() >= PAR_MIN_MATH {
        let chunk = v.len().div_ceil(ctx.threads);
        v.par_chunks_mut(chunk).for_each(kernel);
    } else {
        kernel(v);
    }
    Ok(vec![Value::tensor(t)])
}
/// Sigmoid: 1 / (1 + e^-x); f32 through the dispatched slice kernel `act::sigmoid` (the
/// fused activations' kernel: 16 lanes at AVX-512), f64 through the scalar body.
fn sigmoid(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    use crate::kernels::act;
    unary_f32_kernel(ctx, ins, act::sigmoid, act::sigmoid_f32, |x| {
        1.0 / (1.0 + (-x).fexp())
    })
}
simple_float!(
    /// Softsign: x / (1 + |x|).
    softsign, |x| x / (1.0 + x.abs())
);
simple_float!(
    /// HardSwish: x * clamp(x/6 + 1/2, 0, 1).
    hard_swish, |x| x * (x / 6.0 + 0.5).clamp(0.0, 1.0)
);

/// Softplus: ln(1 + e^x).
fn softplus(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    unary_float(ctx, ins, softplus32, softplus64)
}

/// Mish: x * tanh(softplus(x)).
fn mish(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    unary_float(
        ctx,
        ins,
        |x| x * softplus32(x).tanh(),
        |x| x * softplus64(x).tanh(),
    )
}

/// Gelu: x·Φ(x) exactly (`approximate="none"`) or with the tanh approximation.
fn gelu(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    match ctx.node.str_or("approximate", "none")? {
        "none" => {
            let r = std::f64::consts::FRAC_1_SQRT_2;
            float_map!(ctx, ins, [r], |x| 0.5 * x * (1.0 + erf(x * r)))
        }
        "tanh" => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            // 0.5·x·(1 + tanh(u)) = x·sigmoid(2u): one exp instead of a tanh.
            float_map!(ctx, ins, [c], |x| x
                / (1.0 + (-2.0 * c * (x + 0.044715 * x * x * x)).fexp()))
        }
        other => bail!("Gelu approximate='{other}' is not one of none, tanh"),
    }
}

/// Elu: x if x > 0 else alpha·(e^x − 1).
fn elu(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let alpha = ctx.node.float_or("alpha", 1.0)? as f64;
    float_map!(ctx, ins, [alpha], |x| if x > 0.0 {
        x
    } else {
        alpha * (x.exp() - 1.0)
    })
}

/// Celu: max(0, x) + min(0, alpha·(e^(x/alpha) − 1)).
fn celu(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let alpha = ctx.node.float_or("alpha", 1.0)? as f64;
    float_map!(ctx, ins, [alpha], |x| x.max(0.0)
        + (alpha * ((x / alpha).exp() - 1.0)).min(0.0))
}

/// Selu: gamma·(x if x > 0 else alpha·e^x − alpha).
fn selu(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let alpha = ctx.node.float_or("alpha", 1.673_263_2)? as f64;
    let gamma = ctx.node.float_or("gamma", 1.050_701)? as f64;
    float_map!(ctx, ins, [alpha, gamma], |x| gamma
        * if x > 0.0 { x } else { alpha * x.exp() - alpha })
}

/// LeakyRelu: x if x > 0 else alpha·x.
fn leaky_relu(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let alpha = ctx.node.float_or("alpha", 0.01)? as f64;
    float_map!(ctx, ins, [alpha], |x| if x > 0.0 { x } else { alpha * x })
}

/// ThresholdedRelu: x if x > alpha else 0.
fn thresholded_relu(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let alpha = ctx.node.float_or("alpha", 1.0)? as f64;
    float_map!(ctx, ins, [alpha], |x| if x > alpha { x } else { 0.0 })
}

/// HardSigmoid: clamp(alpha·x + beta, 0, 1).
fn hard_sigmoid(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let alpha = ctx.node.float_or("alpha", 0.2)? as f64;
    let beta = ctx.node.float_or("beta", 0.5)? as f64;
    float_map!(ctx, ins, [alpha, beta], |x| (alpha * x + beta)
        .clamp(0.0, 1.0))
}

/// Swish: x·sigmoid(alpha·x).
fn swish(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let alpha = ctx.node.float_or("alpha", 1.0)? as f64;
    float_map!(ctx, ins, [alpha], |x| x / (1.0 + (-alpha * x).fexp()))
}

/// Shrink: x + bias if x < −lambd, x − bias if x > lambd, else 0 (all numeric types).
fn shrink(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let bias = ctx.node.float_or("bias", 0.0)? as f64;
    let lambd = ctx.node.float_or("lambd", 0.5)? as f64;
    let dt = ins.tensor(0)?.dtype();
    let t = dispatch_numeric!(dt, T => unary_same::<T>(&mut ins, ctx.threads, |v: T| {
        let x = v.to_f64();
        T::from_f64(if x < -lambd {
            x + bias
        } else if x > lambd {
            x - bias
        } else {
            0.0
        })
    })?);
    Ok(vec![Value::tensor(t)])
}

macro_rules! numeric_unary {
    ($(#[$m:meta])* $name:ident, $f:expr) => {
        $(#[$m])*
        fn $name(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
            let dt = ins.tensor(0)?.dtype();
            let t = dispatch_numeric!(dt, T => unary_same::<T>(&mut ins, ctx.threads, $f)?);
            Ok(vec![Value::tensor(t)])
        }
    };
}

numeric_unary!(
    /// Abs: |x| (integers wrap at the minimum value, like numpy).
    abs, <T as Arith>::abs
);
numeric_unary!(
    /// Neg: −x.
    neg, <T as Arith>::neg
);
numeric_unary!(
    /// Sign: −1, 0 or 1 (NaN stays NaN).
    sign, <T as Arith>::sign
);
numeric_unary!(
    /// Relu: max(x, 0); NaN stays NaN.
    relu, |x: T| if x < T::zero() { T::zero() } else { x }
);

/// PRelu: x if x > 0 else slope·x, with `slope` broadcast to `X` (unidirectionally). A 1-D
/// slope that does not broadcast is matched against the one dimension of `X` of its length,
/// as old opsets allowed.
fn prelu(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let dt = same_dtype(&ins)?;
    let xs = ins.tensor(0)?.shape().to_vec();
    let ss = ins.tensor(1)?.shape().to_vec();
    if super::Bcast::new(&[&xs, &ss])
        .map(|p| p.out_shape)
        .ok()
        .as_deref()
        != Some(&xs[..])
    {
        let fixed = match ss.as_slice() {
            [d] if xs.iter().filter(|&&x| x == *d).count() == 1 => xs
                .iter()
                .map(|&x| if x == *d { x } else { 1 })
                .collect::<Vec<_>>(),
            _ => bail!("slope shape {ss:?} does not broadcast to input shape {xs:?}"),
        };
        let s = ins.take_tensor(1)?.reshaped(fixed)?;
        ins = Inputs::new(vec![ins.take_value(0), Some(Value::tensor(s))]);
    }
    let t = dispatch_numeric!(dt, T => binary_same::<T>(&mut ins, ctx.threads, |x: T, s: T| {
        if x > T::zero() { x } else { T::mul(x, s) }
    })?);
    Ok(vec![Value::tensor(t)])
}

/// IsNaN: true where x is NaN.
fn is_nan(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let out: Vec<bool> = match x.dtype() {
        DType::F32 => x.as_slice::<f32>()?.iter().map(|v| v.is_nan()).collect(),
        DType::F64 => x.as_slice::<f64>()?.iter().map(|v| v.is_nan()).collect(),
        DType::F16 => x.as_slice::<f16>()?.iter().map(|v| v.is_nan()).collect(),
        DType::BF16 => x.as_slice::<bf16>()?.iter().map(|v| v.is_nan()).collect(),
        other => bail!("IsNaN needs a float input, got {other}"),
    };
    Ok(vec![Value::tensor(Tensor::from_vec(
        x.shape().to_vec(),
        out,
    )?)])
}

/// IsInf: true where x is +inf (`detect_positive`) or −inf (`detect_negative`).
fn is_inf(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let pos = ctx.node.int_or("detect_positive", 1)? != 0;
    let neg = ctx.node.int_or("detect_negative", 1)? != 0;
    let x = ins.tensor(0)?;
    let test = |v: f64| v.is_infinite() && (if v > 0.0 { pos } else { neg });
    let out: Vec<bool> = match x.dtype() {
        DType::F32 => x
            .as_slice::<f32>()?
            .iter()
            .map(|&v| test(v as f64))
            .collect(),
        DType::F64 => x.as_slice::<f64>()?.iter().map(|&v| test(v)).collect(),
        DType::F16 | DType::BF16 => x.to_f64_vec()?.into_iter().map(test).collect(),
        other => bail!("IsInf needs a float input, got {other}"),
    };
    Ok(vec![Value::tensor(Tensor::from_vec(
        x.shape().to_vec(),
        out,
    )?)])
}

/// The Mersenne Twister (MT19937) as numpy's legacy `np.random.seed(int)` initialises it, so
/// that a `seed` attribute reproduces the masks numpy-based references draw.
struct Mt19937 {
    mt: [u32; 624],
    i: usize,
}

impl Mt19937 {
    fn new(seed: u32) -> Mt19937 {
        let mut mt = [0u32; 624];
        mt[0] = seed;
        for i in 1..624 {
            mt[i] = 1_812_433_253u32
                .wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { mt, i: 624 }
    }

    fn next_u32(&mut self) -> u32 {
        if self.i >= 624 {
            for k in 0..624 {
                let y = (self.mt[k] & 0x8000_0000) | (self.mt[(k + 1) % 624] & 0x7fff_ffff);
                let mag = if y & 1 == 1 { 0x9908_b0df } else { 0 };
                self.mt[k] = self.mt[(k + 397) % 624] ^ (y >> 1) ^ mag;
            }
            self.i = 0;
        }
        let mut y = self.mt[self.i];
        self.i += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// A uniform double in [0, 1) from 53 random bits (numpy's `random_sample`).
    fn next_f64(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) / 9_007_199_254_740_992.0
    }
}

/// Dropout: identity at inference (the optional mask output is all true). In training mode
/// (opset 12+ `training_mode` input) with a ratio above 0, elements are zeroed at random with
/// probability `ratio` (seeded by the `seed` attribute) and the rest scaled by 1/(1−ratio).
fn dropout(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let (ratio, training) = if ctx.opset >= 12 {
        let ratio = match ins.opt_tensor(1) {
            Some(r) => r.to_f64_vec()?.first().copied().unwrap_or(0.5),
            None => 0.5,
        };
        let training = match ins.opt_tensor(2) {
            Some(t) => t.as_slice::<bool>()?.first().copied().unwrap_or(false),
            None => false,
        };
        (ratio, training)
    } else {
        // Before opset 7 `is_test=0` meant training; 7..11 Dropout is identity at inference
        // and had no way to request training.
        let training = ctx.opset < 7 && ctx.node.int_or("is_test", 0)? == 0;
        (ctx.node.float_or("ratio", 0.5)? as f64, training)
    };
    let want_mask = ctx.node.outputs.len() > 1 && !ctx.node.outputs[1].is_empty();
    let x = ins.take_tensor(0)?;
    let shape = x.shape().to_vec();
    if !training || ratio == 0.0 {
        let mut out = vec![Value::tensor(x)];
        if want_mask {
            out.push(Value::tensor(Tensor::from_vec(
                shape.clone(),
                vec![true; shape.iter().product()],
            )?));
        }
        return Ok(out);
    }
    if !(0.0..1.0).contains(&ratio) {
        bail!("Dropout ratio {ratio} must lie in [0, 1)");
    }
    let mut rng = Mt19937::new(ctx.node.int_or("seed", 0)? as u32);
    let mask: Vec<bool> = (0..x.len()).map(|_| rng.next_f64() >= ratio).collect();
    let scale = 1.0 / (1.0 - ratio);
    let mut y = x;
    let dt = y.dtype();
    if !dt.is_float() {
        bail!("Dropout needs a float input, got {dt}");
    }
    dispatch_numeric!(dt, T => {
        for (v, &m) in y.as_mut_slice::<T>()?.iter_mut().zip(&mask) {
            *v = T::from_f64(if m { v.to_f64() * scale } else { 0.0 });
        }
    });
    let mut out = vec![Value::tensor(y)];
    if want_mask {
        out.push(Value::tensor(Tensor::from_vec(shape, mask)?));
    }
    Ok(out)
}

pub fn register(r: &mut Registry) {
    r.add("Abs", 1, abs);
    r.add("Neg", 1, neg);
    r.add("Sign", 9, sign);
    r.add("Reciprocal", 1, reciprocal);
    r.add("Sqrt", 1, sqrt);
    r.add("Exp", 1, exp);
    r.add("Log", 1, log);
    r.add("Ceil", 1, ceil);
    r.add("Floor", 1, floor);
    r.add("Round", 11, round);
    r.add("Erf", 9, erf_op);
    r.add("Sin", 7, sin);
    r.add("Cos", 7, cos);
    r.add("Tan", 7, tan);
    r.add("Asin", 7, asin);
    r.add("Acos", 7, acos);
    r.add("Atan", 7, atan);
    r.add("Sinh", 9, sinh);
    r.add("Cosh", 9, cosh);
    r.add("Asinh", 9, asinh);
    r.add("Acosh", 9, acosh);
    r.add("Atanh", 9, atanh);
    r.add("Relu", 1, relu);
    r.add("LeakyRelu", 1, leaky_relu);
    r.add("PRelu", 1, prelu);
    r.add("Elu", 1, elu);
    r.add("Selu", 1, selu);
    r.add("Celu", 12, celu);
    r.add("Sigmoid", 1, sigmoid);
    r.add("HardSigmoid", 1, hard_sigmoid);
    r.add("HardSwish", 14, hard_swish);
    r.add("Tanh", 1, tanh);
    r.add("Softplus", 1, softplus);
    r.add("Softsign", 1, softsign);
    r.add("ThresholdedRelu", 10, thresholded_relu);
    r.add("Mish", 18, mish);
    r.add("Gelu", 20, gelu);
    r.add("Swish", 24, swish);
    r.add("Shrink", 9, shrink);
    r.add("IsNaN", 9, is_nan);
    r.add("IsInf", 10, is_inf);
    r.add("Dropout", 1, dropout);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_accuracy() {
        // Reference values of erf.
        let cases = [
            (0.0, 0.0),
            (0.1, 0.112_462_916_018_284_9),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.5, 0.999_999_256_901_627_7),
            (-1.5, -0.966_105_146_475_310_7),
        ];
        for (x, want) in cases {
            let x: f64 = x;
            assert!((erf(x) - want).abs() < 2e-7, "erf64({x})");
            assert!(
                ((x as f32).error_fn() as f64 - want).abs() < 1e-6,
                "erf32({x})"
            );
        }
        assert!(f32::NAN.error_fn().is_nan());
        assert!(f64::NAN.error_fn().is_nan());
        assert_eq!(10f32.error_fn(), 1.0);
    }

    #[test]
    fn mt19937_matches_numpy() {
        // np.random.seed(0); np.random.uniform(0, 1, 2)
        let mut r = Mt19937::new(0);
        assert!((r.next_f64() - 0.548_813_503_927_324_8).abs() < 1e-16);
        let v = r.next_f64();
        assert!((v - 0.715_189_366_372_419_5).abs() < 1e-15, "{v}");
    }

    #[test]
    fn fast_exp_accuracy() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0173;
        }
        assert!(worst < 3e-7, "max relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(88.72).is_finite());
    }

    #[test]
    fn softplus_is_stable() {
        assert_eq!(softplus32(1000.0), 1000.0);
        assert!((softplus64(0.0) - std::f64::consts::LN_2).abs() < 1e-15);
    }
}
