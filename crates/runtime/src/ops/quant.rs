//! Quantization kernels: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger,
//! QLinearMatMul, ConvInteger and QLinearConv.
//!
//! Integer arithmetic is exact (i32 accumulation, wrapping as int32 does); rounding follows the
//! ONNX reference (round half to even). Float intermediates reproduce numpy's type promotion so
//! that results match the reference implementation bit for bit.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::common::{broadcast_index_map, broadcast_shapes, norm_axis};
use crate::value::Value;
use npuc_ir::{bf16, f16, DType, Tensor};

pub fn register(r: &mut Registry) {
    r.add("QuantizeLinear", 10, quantize_linear);
    r.add("DequantizeLinear", 10, dequantize_linear);
    // onnxruntime's contrib versions (what QDQ models for its QNN EP use for 16-bit types
    // before opset 21): same arithmetic, per tensor or per `axis`.
    r.add_range(
        "com.microsoft",
        "QuantizeLinear",
        1,
        crate::kernel::MAX_OPSET,
        quantize_linear,
    );
    r.add_range(
        "com.microsoft",
        "DequantizeLinear",
        1,
        crate::kernel::MAX_OPSET,
        dequantize_linear,
    );
    r.add("DynamicQuantizeLinear", 11, dynamic_quantize_linear);
    r.add("MatMulInteger", 10, matmul_integer);
    r.add("QLinearMatMul", 10, qlinear_matmul);
    r.add("ConvInteger", 10, conv_integer);
    r.add("QLinearConv", 10, qlinear_conv);
}

// ---------------------------------------------------------------------------------------------
// Scale / zero-point layout
// ---------------------------------------------------------------------------------------------

/// How a scale (or zero point) maps onto the elements of the quantized tensor, seen as
/// `[outer, d, inner]` around the quantization axis.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum QLayout {
    /// One value for the whole tensor.
    PerTensor,
    /// One value per index along the axis.
    PerAxis,
    /// Blocks of `block` consecutive indices along the axis share a value; the parameter tensor
    /// has the input's shape with `nblocks` on the axis.
    Blocked { block: usize, nblocks: usize },
}

/// The quantized tensor seen around its axis, plus how parameters are laid out.
#[derive(Clone, Copy, Debug)]
pub struct QGeom {
    pub outer: usize,
    pub d: usize,
    pub inner: usize,
    pub layout: QLayout,
}

impl QGeom {
    /// Validates a parameter tensor's shape against `x_shape` (ONNX per-tensor, per-axis and
    /// blocked quantization) and returns the geometry.
    pub fn new(x_shape: &[usize], p_shape: &[usize], axis: i64, block_size: i64) -> Result<QGeom> {
        let p_len: usize = p_shape.iter().product();
        if p_len == 1 && (block_size <= 0 || p_shape.len() <= 1) {
            let n: usize = x_shape.iter().product();
            return Ok(QGeom {
                outer: 1,
                d: n,
                inner: 1,
                layout: QLayout::PerTensor,
            });
        }
        if x_shape.is_empty() {
            bail!("a scalar input needs a scalar scale, got shape {p_shape:?}");
        }
        let ax = norm_axis(axis, x_shape.len())?;
        let outer: usize = x_shape[..ax].iter().product();
        let d = x_shape[ax];
        let inner: usize = x_shape[ax + 1..].iter().product();
        if block_size <= 0 {
            if p_shape.len() != 1 || p_shape[0] != d {
                bail!(
                    "per-axis scale must be 1-D with {d} elements (axis {ax} of {x_shape:?}), got shape {p_shape:?}"
                );
            }
            return Ok(QGeom {
                outer,
                d,
                inner,
                layout: QLayout::PerAxis,
            });
        }
        let block = block_size as usize;
        let nblocks = d.div_ceil(block);
        let ok = p_shape.len() == x_shape.len()
            && p_shape
                .iter()
                .zip(x_shape)
                .enumerate()
                .all(|(i, (&p, &x))| if i == ax { p == nblocks } else { p == x });
        if !ok {
            bail!(
                "blocked quantization with block_size {block} on axis {ax} of {x_shape:?} needs a scale of the same shape with {nblocks} on the axis, got {p_shape:?}"
            );
        }
        Ok(QGeom {
            outer,
            d,
            inner,
            layout: QLayout::Blocked { block, nblocks },
        })
    }

    /// Calls `f(x_offset, p_offset, p_step, len)` for each contiguous run of `len` elements
    /// starting at `x_offset`, whose parameter index is `p_offset + j * p_step`.
    fn for_runs(&self, mut f: impl FnMut(usize, usize, usize, usize)) {
        match self.layout {
            QLayout::PerTensor => f(0, 0, 0, self.outer * self.d * self.inner),
            QLayout::PerAxis => {
                for o in 0..self.outer {
                    for a in 0..self.d {
                        f((o * self.d + a) * self.inner, a, 0, self.inner);
                    }
                }
            }
            QLayout::Blocked { block, nblocks } => {
                for o in 0..self.outer {
                    for a in 0..self.d {
                        let p = (o * nblocks + a / block) * self.inner;
                        f((o * self.d + a) * self.inner, p, 1, self.inner);
                    }
                }
            }
        }
    }
}

/// The float type a quotient or product is rounded to (numpy's promotion of the operands).
#[derive(Clone, Copy, PartialEq, Debug)]
enum FloatPrec {
    F16,
    BF16,
    F32,
    F64,
}

impl FloatPrec {
    fn of(dt: DType) -> Option<FloatPrec> {
        match dt {
            DType::F16 => Some(FloatPrec::F16),
            DType::BF16 => Some(FloatPrec::BF16),
            DType::F32 => Some(FloatPrec::F32),
            DType::F64 => Some(FloatPrec::F64),
            _ => None,
        }
    }
    /// Numpy's result type of an arithmetic op on `a` and `b`.
    fn promote(a: DType, b: DType) -> FloatPrec {
        match (FloatPrec::of(a), FloatPrec::of(b)) {
            (Some(x), Some(y)) if x == y => x,
            (Some(FloatPrec::F64), _) | (_, Some(FloatPrec::F64)) => FloatPrec::F64,
            // An int32 (or wider) operand with a float promotes to f64 in numpy.
            (None, _) | (_, None) => FloatPrec::F64,
            _ => FloatPrec::F32,
        }
    }
    /// Rounds an exactly (or f64-) computed value to this precision (f16/bf16 via f32, as the
    /// half-precision ufunc loops compute in f32).
    #[inline]
    fn round(self, v: f64) -> f64 {
        match self {
            FloatPrec::F16 => f16::from_f32(v as f32).to_f64(),
            FloatPrec::BF16 => bf16::from_f32(v as f32).to_f64(),
            FloatPrec::F32 => v as f32 as f64,
            FloatPrec::F64 => v,
        }
    }
}

/// Reads any numeric tensor as f64 (exact for every float type and for integers up to 2^53).
fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_f64_vec()?)
}

/// Builds a float tensor of `dtype` from f64 values, rounding through f32 for the half types.
fn float_tensor(dtype: DType, shape: Vec<usize>, v: &[f64]) -> Result<Tensor> {
    Ok(match dtype {
        DType::F32 => Tensor::from_vec(shape, v.iter().map(|&x| x as f32).collect())?,
        DType::F64 => Tensor::from_vec(shape, v.to_vec())?,
        DType::F16 => {
            Tensor::from_vec(shape, v.iter().map(|&x| f16::from_f32(x as f32)).collect())?
        }
        DType::BF16 => {
            Tensor::from_vec(shape, v.iter().map(|&x| bf16::from_f32(x as f32)).collect())?
        }
        other => bail!("output type {other} is not a float type"),
    })
}

/// Inclusive integer range of a quantized dtype.
fn qrange(dt: DType) -> Result<(i64, i64)> {
    Ok(match dt {
        DType::U8 => (0, 255),
        DType::I8 => (-128, 127),
        DType::U16 => (0, 65535),
        DType::I16 => (-32768, 32767),
        DType::U4 => (0, 15),
        DType::I4 => (-8, 7),
        DType::U2 => (0, 3),
        DType::I2 => (-2, 1),
        DType::I32 => (i32::MIN as i64, i32::MAX as i64),
        other => bail!("{other} is not a supported quantized type"),
    })
}

/// Builds an integer tensor of quantized dtype `dt` from values already clamped to its range.
fn int_tensor(dt: DType, shape: Vec<usize>, v: Vec<i32>) -> Result<Tensor> {
    Ok(match dt {
        DType::U8 => Tensor::from_vec(shape, v.into_iter().map(|x| x as u8).collect())?,
        DType::I8 => Tensor::from_vec(shape, v.into_iter().map(|x| x as i8).collect())?,
        DType::U16 => Tensor::from_vec(shape, v.into_iter().map(|x| x as u16).collect())?,
        DType::I16 => Tensor::from_vec(shape, v.into_iter().map(|x| x as i16).collect())?,
        DType::I32 => Tensor::from_vec(shape, v)?,
        // `from_4bit` takes the low nibble and sign-extends it for I4.
        DType::U4 | DType::I4 | DType::U2 | DType::I2 => {
            Tensor::from_codes(dt, shape, v.into_iter().map(|x| (x & 0xF) as u8).collect())?
        }
        other => bail!("{other} is not a supported quantized type"),
    })
}

/// Rounds half to even and clamps to `[lo, hi]` (NaN maps to 0, like the saturating cast).
#[inline]
fn round_clamp(v: f64, lo: i64, hi: i64) -> i64 {
    let r = v.round_ties_even();
    if r.is_nan() {
        0
    } else {
        (r.clamp(lo as f64, hi as f64)) as i64
    }
}

// ---------------------------------------------------------------------------------------------
// QuantizeLinear / DequantizeLinear / DynamicQuantizeLinear
// ---------------------------------------------------------------------------------------------

/// QuantizeLinear (opsets 10..25): `y = saturate(round_half_even(x / y_scale) + y_zero_point)`,
/// per tensor, per axis (13+) or blocked (21+), to u8/i8/u16/i16/u4/i4.
fn quantize_linear(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let scale = ins.tensor(1)?;
    let zp = ins.opt_tensor(2);
    let n = ctx.node;
    let axis = n.int_or("axis", 1)?;
    let block_size = n.int_or("block_size", 0)?;
    let out_attr = n.int_or("output_dtype", 0)?;
    let out_dt = match (zp, out_attr) {
        (Some(z), 0) => z.dtype(),
        (Some(z), code) => {
            if DType::from_onnx_code(code as i32) != Some(z.dtype()) {
                bail!(
                    "output_dtype {code} does not match the zero point's type {}",
                    z.dtype()
                );
            }
            z.dtype()
        }
        (None, 0) => DType::U8,
        (None, code) => DType::from_onnx_code(code as i32)
            .ok_or_else(|| crate::RtError::msg(format!("unsupported output_dtype {code}")))?,
    };
    if out_dt.is_small_float() {
        return quantize_small_float(ctx, x, scale, zp, out_dt, axis, block_size);
    }
    let (lo, hi) = qrange(out_dt)?;
    if out_dt == DType::I32 {
        bail!("i32 is not a quantized output type of QuantizeLinear");
    }
    if !(x.dtype().is_float() || x.dtype() == DType::I32) {
        bail!(
            "QuantizeLinear input must be a float or i32 tensor, got {}",
            x.dtype()
        );
    }
    if !scale.dtype().is_float() {
        bail!("y_scale must be a float tensor, got {}", scale.dtype());
    }
    let geom = QGeom::new(x.shape(), scale.shape(), axis, block_size)?;
    if let Some(z) = zp {
        if z.shape() != scale.shape() && !(z.len() == 1 && scale.len() == 1) {
            bail!(
                "zero point shape {:?} differs from scale shape {:?}",
                z.shape(),
                scale.shape()
            );
        }
    }
    // The precision of the division: the `precision` attribute (opset 23+) or numpy promotion.
    let explicit = match n.int_or("precision", 0)? {
        0 => None,
        code => Some(
            DType::from_onnx_code(code as i32)
                .and_then(FloatPrec::of)
                .ok_or_else(|| crate::RtError::msg(format!("unsupported precision {code}")))?,
        ),
    };
    let prec = explicit.unwrap_or(FloatPrec::promote(x.dtype(), scale.dtype()));
    let pre_round = |v: f64| match explicit {
        Some(p) => p.round(v),
        None => v,
    };
    let xs = f64s(x)?;
    let ss = f64s(scale)?;
    let zs: Vec<i64> = match zp {
        Some(z) => z.to_i64_vec()?,
        None => vec![0; ss.len()],
    };
    if zs.len() != ss.len() {
        bail!("zero point has {} elements, scale {}", zs.len(), ss.len());
    }
    // With an explicit precision both operands are first cast to it.
    let ss: Vec<f64> = ss.into_iter().map(pre_round).collect();
    let mut out = vec![0i32; xs.len()];
    geom.for_runs(|xo, po, step, len| {
        for j in 0..len {
            let p = po + j * step;
            let q = prec.round(pre_round(xs[xo + j]) / ss[p]);
            // Like the reference: rint, add the zero point in integers, then clip.
            let r = q.round_ties_even();
            let r = if r.is_nan() {
                0
            } else {
                r.clamp(i64::MIN as f64 / 2.0, i64::MAX as f64 / 2.0) as i64
            };
            out[xo + j] = (r + zs[p]).clamp(lo, hi) as i32;
        }
    });
    Ok(vec![Value::tensor(int_tensor(
        out_dt,
        x.shape().to_vec(),
        out,
    )?)])
}

/// QuantizeLinear to a float8/float4 type: `y = cast(x / y_scale + zero_point)` with
/// round-to-nearest-even and the `saturate` attribute (default on) deciding overflow.
fn quantize_small_float(
    ctx: &OpCtx,
    x: &Tensor,
    scale: &Tensor,
    zp: Option<&Tensor>,
    out_dt: DType,
    axis: i64,
    block_size: i64,
) -> Result<Vec<Value>> {
    let saturate = ctx.node.int_or("saturate", 1)? != 0;
    let geom = QGeom::new(x.shape(), scale.shape(), axis, block_size)?;
    let xs = f64s(x)?;
    let ss = f64s(scale)?;
    let zs: Vec<f64> = match zp {
        Some(z) => f64s(z)?,
        None => vec![0.0; ss.len()],
    };
    if zs.len() != ss.len() {
        bail!("zero point has {} elements, scale {}", zs.len(), ss.len());
    }
    let mut out = vec![0u8; xs.len()];
    geom.for_runs(|xo, po, step, len| {
        for j in 0..len {
            let p = po + j * step;
            let v = (xs[xo + j] as f32 / ss[p] as f32) + zs[p] as f32;
            out[xo + j] = npuc_ir::lowp::from_f32(out_dt, v, saturate).unwrap_or(0);
        }
    });
    Ok(vec![Value::tensor(Tensor::from_codes(
        out_dt,
        x.shape().to_vec(),
        out,
    )?)])
}

/// DequantizeLinear (opsets 10..25): `y = (x - x_zero_point) * x_scale`, per tensor, per axis
/// or blocked; output type is the scale's (or `output_dtype`, opset 23+).
fn dequantize_linear(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let scale = ins.tensor(1)?;
    let zp = ins.opt_tensor(2);
    let n = ctx.node;
    let axis = n.int_or("axis", 1)?;
    let block_size = n.int_or("block_size", 0)?;
    if !x.dtype().is_int() && !x.dtype().is_small_float() {
        bail!(
            "DequantizeLinear input must be an integer or 8/4-bit float tensor, got {}",
            x.dtype()
        );
    }
    if !scale.dtype().is_float() {
        bail!("x_scale must be a float tensor, got {}", scale.dtype());
    }
    let out_dt = match n.int_or("output_dtype", 0)? {
        0 => scale.dtype(),
        code => DType::from_onnx_code(code as i32)
            .filter(|d| d.is_float())
            .ok_or_else(|| crate::RtError::msg(format!("unsupported output_dtype {code}")))?,
    };
    let geom = QGeom::new(x.shape(), scale.shape(), axis, block_size)?;
    if let Some(z) = zp {
        if z.dtype() != x.dtype() {
            bail!(
                "zero point type {} differs from input type {}",
                z.dtype(),
                x.dtype()
            );
        }
        if z.len() != scale.len() {
            bail!(
                "zero point shape {:?} differs from scale shape {:?}",
                z.shape(),
                scale.shape()
            );
        }
    }
    // numpy: x.astype(f32) - zp, then * scale. For i32 inputs the cast to f32 rounds and the
    // subtraction promotes to f64; for narrower types everything is exact.
    let wide = matches!(x.dtype(), DType::I32 | DType::U32 | DType::I64 | DType::U64);
    let mut xs = f64s(x)?;
    if wide {
        for v in xs.iter_mut() {
            *v = *v as f32 as f64;
        }
    }
    let ss = f64s(scale)?;
    let zs: Vec<f64> = match zp {
        Some(z) => f64s(z)?,
        None => vec![0.0; ss.len()],
    };
    // The product is rounded to f32 first (numpy computes in f32 or f64 and then casts).
    let mut out = vec![0f64; xs.len()];
    geom.for_runs(|xo, po, step, len| {
        for j in 0..len {
            let p = po + j * step;
            out[xo + j] = ((xs[xo + j] - zs[p]) * ss[p]) as f32 as f64;
        }
    });
    let out = float_tensor(out_dt, x.shape().to_vec(), &out)?;
    Ok(vec![Value::tensor(out)])
}

/// DynamicQuantizeLinear (opset 11): u8 quantization with scale and zero point computed from
/// the input's range (extended to include 0).
fn dynamic_quantize_linear(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    if x.dtype() != DType::F32 {
        bail!("DynamicQuantizeLinear expects f32 input, got {}", x.dtype());
    }
    let xs = x.as_slice::<f32>()?;
    let (q, scale, zp) = if ctx.threads > 1 && xs.len() >= DQL_PAR_MIN {
        dynamic_quantize_u8_par(xs, ctx.threads)
    } else {
        dynamic_quantize_u8(xs)
    };
    Ok(vec![
        Value::tensor(Tensor::from_vec(x.shape().to_vec(), q)?),
        Value::tensor(Tensor::scalar(scale)),
        Value::tensor(Tensor::scalar(zp)),
    ])
}

/// Computes DynamicQuantizeLinear's (scale, zero point) for `xs`, all in f32 like the
/// reference.
pub fn dynamic_qparams_u8(xs: &[f32]) -> (f32, u8) {
    // The range extended to 0, NaN ignored (vectorized at the CPU's level).
    let (mx, mn) = crate::kernels::qconvert::range_with_zero(xs);
    qparams_from_range_u8(mx, mn)
}

/// DynamicQuantizeLinear's (scale, zero point) from the input's range extended to 0.
fn qparams_from_range_u8(mx: f32, mn: f32) -> (f32, u8) {
    let range = if mx == mn { 1.0 } else { mx - mn };
    let scale = range / 255.0;
    let initial_zp = 0.0 - mn / scale;
    let zp = initial_zp.clamp(0.0, 255.0).round_ties_even();
    (scale, zp as u8)
}

/// DynamicQuantizeLinear on a slice: (quantized, scale, zero point).
pub fn dynamic_quantize_u8(xs: &[f32]) -> (Vec<u8>, f32, u8) {
    let (scale, zp) = dynamic_qparams_u8(xs);
    // Every value is written by `quantize_u8`.
    let mut q = crate::buffers::for_overwrite::<u8>(xs.len());
    quantize_u8(xs, scale, zp, &mut q);
    (q, scale, zp)
}

/// Values from which DynamicQuantizeLinear splits its two passes across threads (text2tashkeel's
/// attention scores, 32 x 32 x 512, took 0.21 ms on one thread).
const DQL_PAR_MIN: usize = 1 << 16;

/// [`dynamic_quantize_u8`] with both passes split across `threads`: the range of each part
/// (each extended to 0, NaN ignored) combined by min and max is the range of the whole, so the
/// scale, zero point and codes are the same.
fn dynamic_quantize_u8_par(xs: &[f32], threads: usize) -> (Vec<u8>, f32, u8) {
    use rayon::prelude::*;
    let per = xs.len().div_ceil(threads.max(1)).max(1);
    let (mx, mn) = xs
        .par_chunks(per)
        .map(crate::kernels::qconvert::range_with_zero)
        .reduce(|| (0.0, 0.0), |(a, b), (c, d)| (a.max(c), b.min(d)));
    let (scale, zp) = qparams_from_range_u8(mx, mn);
    // Every value is written by `quantize_u8`.
    let mut q = crate::buffers::for_overwrite::<u8>(xs.len());
    q.par_chunks_mut(per)
        .zip(xs.par_chunks(per))
        .for_each(|(q, x)| quantize_u8(x, scale, zp, q));
    (q, scale, zp)
}

/// `q[i] = clamp(round_ties_even(xs[i] / scale) + zp, 0, 255)`, the u8 quantization of
/// DynamicQuantizeLinear, through the vectorized QuantizeLinear kernel (`round_ties_even`
/// itself is a libm call per element on the baseline x86-64 target).
pub fn quantize_u8(xs: &[f32], scale: f32, zp: u8, q: &mut [u8]) {
    crate::kernels::qconvert::quantize(npuc_isa::Isa::detect(), xs, scale, zp as i32, q);
}

// ---------------------------------------------------------------------------------------------
// Integer matrix products
// ---------------------------------------------------------------------------------------------

pub use crate::kernels::imm::igemm;

/// Converts an 8-bit (or other integer) tensor to i32 with its zero point subtracted. `zp` is a
/// scalar, or broadcastable to `x` after reshaping a 1-D `zp` to `vec_shape` (the per-row or
/// per-column shape the op defines for vectors).
fn sub_zero_point(
    x: &Tensor,
    zp: Option<&Tensor>,
    vec_shape: impl Fn(usize) -> Vec<usize>,
) -> Result<Vec<i32>> {
    if !matches!(x.dtype(), DType::U8 | DType::I8 | DType::U16 | DType::I16) {
        bail!("expected an 8- or 16-bit integer input, got {}", x.dtype());
    }
    let xv: Vec<i32> = x.to_i64_vec()?.into_iter().map(|v| v as i32).collect();
    let Some(z) = zp else { return Ok(xv) };
    if z.dtype() != x.dtype() {
        bail!(
            "zero point type {} differs from input type {}",
            z.dtype(),
            x.dtype()
        );
    }
    let zv: Vec<i32> = z.to_i64_vec()?.into_iter().map(|v| v as i32).collect();
    if zv.len() == 1 {
        let z0 = zv[0];
        return Ok(xv.into_iter().map(|v| v - z0).collect());
    }
    let zshape = if z.rank() == 1 {
        vec_shape(zv.len())
    } else {
        z.shape().to_vec()
    };
    if zshape.iter().product::<usize>() != zv.len()
        || zshape.len() > x.rank()
        || broadcast_shapes(&zshape, x.shape())? != x.shape()
    {
        bail!(
            "zero point of shape {:?} does not fit input of shape {:?}",
            z.shape(),
            x.shape()
        );
    }
    let map = broadcast_index_map(&zshape, x.shape());
    Ok(xv.into_iter().zip(map).map(|(v, i)| v - zv[i]).collect())
}

/// Numpy-semantics batched integer matmul of `a` (`[..., M, K]` or `[K]`) and `b` (`[..., K, N]`
/// or `[K]`), returning the i32 result and its shape.
pub fn int_matmul(
    a: &[i32],
    a_shape: &[usize],
    b: &[i32],
    b_shape: &[usize],
) -> Result<(Vec<i32>, Vec<usize>)> {
    if a_shape.is_empty() || b_shape.is_empty() {
        bail!("matmul operands must have rank >= 1, got {a_shape:?} and {b_shape:?}");
    }
    let a2: Vec<usize> = if a_shape.len() == 1 {
        vec![1, a_shape[0]]
    } else {
        a_shape.to_vec()
    };
    let b2: Vec<usize> = if b_shape.len() == 1 {
        vec![b_shape[0], 1]
    } else {
        b_shape.to_vec()
    };
    let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let (kb, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
    if k != kb {
        bail!("matmul inner dimensions differ: {a_shape:?} x {b_shape:?}");
    }
    let ab = &a2[..a2.len() - 2];
    let bb = &b2[..b2.len() - 2];
    let batch = broadcast_shapes(ab, bb)?;
    let nb: usize = batch.iter().product();
    let amap = broadcast_index_map(ab, &batch);
    let bmap = broadcast_index_map(bb, &batch);
    let mut out = vec![0i32; nb * m * n];
    for bi in 0..nb {
        let ai = amap[bi] * m * k;
        let bj = bmap[bi] * k * n;
        igemm(
            m,
            k,
            n,
            &a[ai..ai + m * k],
            &b[bj..bj + k * n],
            &mut out[bi * m * n..(bi + 1) * m * n],
        );
    }
    let mut shape = batch;
    if a_shape.len() > 1 {
        shape.push(m);
    }
    if b_shape.len() > 1 {
        shape.push(n);
    }
    Ok((out, shape))
}

/// The zero-point vector shapes for MatMulInteger-style ops: per row of A (`[M, 1]`) and per
/// column of B (`[N]`).
fn a_vec_shape(len: usize) -> Vec<usize> {
    vec![len, 1]
}
fn b_vec_shape(len: usize) -> Vec<usize> {
    vec![len]
}

/// MatMulInteger (opset 10): `(A - a_zero_point) · (B - b_zero_point)` accumulated in int32.
fn matmul_integer(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let a = ins.tensor(0)?;
    let b = ins.tensor(1)?;
    if let Some(out) = matmul_integer_packed(ctx, &ins, a, b)? {
        return Ok(out);
    }
    let av = sub_zero_point(a, ins.opt_tensor(2), a_vec_shape)?;
    let bv = sub_zero_point(b, ins.opt_tensor(3), b_vec_shape)?;
    let (out, shape) = int_matmul(&av, a.shape(), &bv, b.shape())?;
    Ok(vec![Value::tensor(Tensor::from_vec(shape, out)?)])
}

/// MatMulInteger in the shape dynamic quantization writes (a constant 2-D 8-bit B, an 8-bit A
/// `[..., M, K]` with a scalar zero point) through the packed exact kernel of
/// [`crate::kernels::igemm`], B corrected and packed once per plan. `None` for any other form
/// (the general path handles it).
fn matmul_integer_packed(
    ctx: &OpCtx,
    ins: &Inputs,
    a: &Tensor,
    b: &Tensor,
) -> Result<Option<Vec<Value>>> {
    use crate::kernels::igemm::{igemm as igemm_packed, PackedA, PackedB, MAX_K};
    let is8 = |t: &Tensor| matches!(t.dtype(), DType::U8 | DType::I8);
    let b_zp_const = ins.opt_tensor(3).is_none() || ctx.input_is_const(3);
    if !is8(a) || !is8(b) || a.rank() < 2 || b.rank() != 2 || !ctx.input_is_const(1) || !b_zp_const
    {
        return Ok(None);
    }
    let a_zp = match ins.opt_tensor(2) {
        None => 0,
        Some(z) if z.len() == 1 && z.dtype() == a.dtype() => z.to_i64_vec()?[0] as i16,
        Some(_) => return Ok(None),
    };
    let (k, n) = (b.shape()[0], b.shape()[1]);
    if a.shape()[a.rank() - 1] != k || k == 0 || k > MAX_K {
        return Ok(None);
    }
    let m = a.len() / k;
    let packed = ctx.cached(|| {
        let bv = sub_zero_point(b, ins.opt_tensor(3), b_vec_shape)?;
        Ok(if n < NARROW_N {
            let cols: Vec<Vec<i32>> = (0..n)
                .map(|c| (0..k).map(|r| bv[r * n + c]).collect())
                .collect();
            let fits_i8 = bv.iter().all(|&v| (-128..=127).contains(&v));
            let bytes = fits_i8.then(|| {
                let b: Vec<Vec<i8>> = cols
                    .iter()
                    .map(|c| c.iter().map(|&v| v as i8).collect())
                    .collect();
                let sums = cols.iter().map(|c| c.iter().sum()).collect();
                (b, sums)
            });
            PackedMatB::Columns { cols, bytes }
        } else {
            // 8-bit values minus 8-bit zero points: within [-255, 255], exact in i16.
            PackedMatB::Panels(PackedB::pack(k, n, |r, c| bv[r * n + c] as i16))
        })
    })?;
    // Every sum is written by either product.
    let mut out = crate::buffers::for_overwrite::<i32>(m * n);
    match &*packed {
        PackedMatB::Panels(pb) => {
            let pa = match a.dtype() {
                DType::U8 => PackedA::pack_rows(m, k, a.as_slice::<u8>()?, |v| v as i16 - a_zp),
                _ => PackedA::pack_rows(m, k, a.as_slice::<i8>()?, |v| v as i16 - a_zp),
            };
            igemm_packed(&pa, pb, &mut out, ctx.threads)?;
        }
        PackedMatB::Columns {
            bytes: Some((cols, sums)),
            ..
        } if a.dtype() == DType::U8 => {
            byte_dot_columns(a.as_slice::<u8>()?, a_zp, cols, sums, &mut out)
        }
        PackedMatB::Columns { cols, .. } => match a.dtype() {
            DType::U8 => dot_columns(a.as_slice::<u8>()?, a_zp, cols, &mut out),
            _ => dot_columns(a.as_slice::<i8>()?, a_zp, cols, &mut out),
        },
    }
    let mut shape = a.shape().to_vec();
    *shape.last_mut().expect("rank >= 2") = n;
    Ok(Some(vec![Value::tensor(Tensor::from_vec(shape, out)?)]))
}

/// Below this many columns, B's panels would be mostly padding (16 columns each): the
/// product runs as dot products of A's rows with B's columns instead (attention scores
/// `[.., 512] x [512, 1]` in text2tashkeel).
const NARROW_N: usize = 8;

/// A constant MatMulInteger B, zero points subtracted, in the layout its product wants.
enum PackedMatB {
    Panels(crate::kernels::igemm::PackedB),
    /// Columns of a narrow B, each `k` values; when every value fits i8, also as bytes with
    /// each column's sum (for the VNNI byte product of a u8 A).
    Columns {
        cols: Vec<Vec<i32>>,
        bytes: Option<(Vec<Vec<i8>>, Vec<i32>)>,
    },
}

/// `out[i, c] = Σ_p (a[i, p] - zp) · col_c[p]` for the rows of `a` (row length `k` =
/// `col.len()`); exact in i32 (8-bit operands minus zero points, `k` within `MAX_K`).
fn dot_columns<T: Copy + Into<i32>>(a: &[T], zp: i16, cols: &[Vec<i32>], out: &mut [i32]) {
    // A B with no columns has no sums to write.
    let Some(k) = cols.first().map(Vec::len) else {
        return;
    };
    let n = cols.len();
    for (row, o) in a.chunks_exact(k).zip(out.chunks_exact_mut(n)) {
        for (d, col) in o.iter_mut().zip(cols) {
            *d = crate::kernels::imm::dot(row, zp as i32, col);
        }
    }
}

/// [`dot_columns`] for a u8 `a` and byte columns: `Σ_p a[i, p] · col[p] - zp · Σ col`, the
/// same wrapping i32 value as `Σ_p (a[i, p] - zp) · col[p]`.
fn byte_dot_columns(a: &[u8], zp: i16, cols: &[Vec<i8>], sums: &[i32], out: &mut [i32]) {
    let Some(k) = cols.first().map(Vec::len) else {
        return;
    };
    let n = cols.len();
    for (row, o) in a.chunks_exact(k).zip(out.chunks_exact_mut(n)) {
        for ((d, col), &sum) in o.iter_mut().zip(cols).zip(sums) {
            *d = crate::kernels::imm::dot_u8_i8(row, col)
                .wrapping_sub((zp as i32).wrapping_mul(sum));
        }
    }
}

/// Scalar value of a scale tensor with one element.
fn scalar_f64(t: &Tensor, what: &str) -> Result<f64> {
    if t.len() != 1 {
        bail!("{what} must have one element, got shape {:?}", t.shape());
    }
    Ok(f64s(t)?[0])
}

/// QLinearMatMul (opsets 10, 21): integer matmul of zero-point-shifted inputs, requantized with
/// `a_scale * b_scale / y_scale` and `y_zero_point`.
fn qlinear_matmul(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let a = ins.tensor(0)?;
    let a_scale = ins.tensor(1)?;
    let b = ins.tensor(3)?;
    let b_scale = ins.tensor(4)?;
    let y_scale = ins.tensor(6)?;
    let y_zp = ins.opt_tensor(7);
    let av = sub_zero_point(a, ins.opt_tensor(2), a_vec_shape)?;
    let bv = sub_zero_point(b, ins.opt_tensor(5), b_vec_shape)?;
    let (c, shape) = int_matmul(&av, a.shape(), &bv, b.shape())?;
    // The multiplier is computed in the scales' type; `int32 * float` then promotes to f64.
    let sdt = a_scale.dtype();
    let prec = FloatPrec::of(sdt)
        .ok_or_else(|| crate::RtError::msg(format!("scale must be float, got {sdt}")))?;
    let (sa, sb, sy) = (
        scalar_f64(a_scale, "a_scale")?,
        scalar_f64(b_scale, "b_scale")?,
        scalar_f64(y_scale, "y_scale")?,
    );
    let mult = prec.round(prec.round(sa * sb) / sy);
    let out_dt = y_zp.map(|z| z.dtype()).unwrap_or(a.dtype());
    let (lo, hi) = qrange(out_dt)?;
    let zy = match y_zp {
        Some(z) => scalar_f64(z, "y_zero_point")?,
        None => 0.0,
    };
    let out: Vec<i32> = c
        .iter()
        .map(|&v| round_clamp(v as f64 * mult + zy, lo, hi) as i32)
        .collect();
    Ok(vec![Value::tensor(int_tensor(out_dt, shape, out)?)])
}

// ---------------------------------------------------------------------------------------------
// Integer convolution
// ---------------------------------------------------------------------------------------------

/// Convolution geometry resolved from a node's attributes.
struct ConvGeom {
    n: usize,
    c: usize,
    m: usize,
    group: usize,
    in_sp: Vec<usize>,
    k_sp: Vec<usize>,
    out_sp: Vec<usize>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
    /// Leading pads per spatial axis.
    pads: Vec<usize>,
}

impl ConvGeom {
    fn new(ctx: &OpCtx, x_shape: &[usize], w_shape: &[usize]) -> Result<ConvGeom> {
        let node = ctx.node;
        if x_shape.len() < 3 || w_shape.len() != x_shape.len() {
            bail!("conv input {x_shape:?} and weight {w_shape:?} must have the same rank >= 3");
        }
        let nsp = x_shape.len() - 2;
        let group = node.int_or("group", 1)?;
        if group < 1 {
            bail!("group must be >= 1, got {group}");
        }
        let group = group as usize;
        let (n, c) = (x_shape[0], x_shape[1]);
        let m = w_shape[0];
        if !m.is_multiple_of(group) || w_shape[1] * group != c {
            bail!("weight {w_shape:?} does not match input channels {c} with group {group}");
        }
        let in_sp = x_shape[2..].to_vec();
        let k_sp = w_shape[2..].to_vec();
        if let Some(ks) = node.attr_ints("kernel_shape")? {
            if ks.len() != nsp || ks.iter().zip(&k_sp).any(|(&a, &b)| a != b as i64) {
                bail!("kernel_shape {ks:?} does not match weight shape {w_shape:?}");
            }
        }
        let pos = |name: &str| -> Result<Vec<usize>> {
            match node.attr_ints(name)? {
                None => Ok(vec![1; nsp]),
                Some(v) if v.len() == nsp && v.iter().all(|&x| x >= 1) => {
                    Ok(v.iter().map(|&x| x as usize).collect())
                }
                Some(v) => bail!("{name} {v:?} must hold {nsp} positive values"),
            }
        };
        let strides = pos("strides")?;
        let dilations = pos("dilations")?;
        let auto_pad = node.str_or("auto_pad", "NOTSET")?;
        let mut pads = vec![0usize; nsp];
        let mut out_sp = vec![0usize; nsp];
        let explicit: Vec<usize> = match node.attr_ints("pads")? {
            None => vec![0; 2 * nsp],
            Some(p) if p.len() == 2 * nsp && p.iter().all(|&x| x >= 0) => {
                p.iter().map(|&x| x as usize).collect()
            }
            Some(p) => bail!("pads {p:?} must hold {} non-negative values", 2 * nsp),
        };
        for i in 0..nsp {
            let ek = (k_sp[i] - 1) * dilations[i] + 1;
            match auto_pad {
                "NOTSET" | "" => {
                    let total = in_sp[i] + explicit[i] + explicit[i + nsp];
                    if total < ek {
                        bail!("kernel larger than padded input on spatial axis {i}");
                    }
                    pads[i] = explicit[i];
                    out_sp[i] = (total - ek) / strides[i] + 1;
                }
                "VALID" => {
                    if in_sp[i] < ek {
                        bail!("kernel larger than input on spatial axis {i}");
                    }
                    out_sp[i] = (in_sp[i] - ek) / strides[i] + 1;
                }
                "SAME_UPPER" | "SAME_LOWER" => {
                    let o = in_sp[i].div_ceil(strides[i]);
                    let need = ((o.saturating_sub(1)) * strides[i] + ek).saturating_sub(in_sp[i]);
                    pads[i] = if auto_pad == "SAME_UPPER" {
                        need / 2
                    } else {
                        need - need / 2
                    };
                    out_sp[i] = o;
                }
                other => bail!("unknown auto_pad '{other}'"),
            }
        }
        Ok(ConvGeom {
            n,
            c,
            m,
            group,
            in_sp,
            k_sp,
            out_sp,
            strides,
            dilations,
            pads,
        })
    }

    fn out_shape(&self) -> Vec<usize> {
        let mut s = vec![self.n, self.m];
        s.extend(&self.out_sp);
        s
    }
}

/// Integer convolution by im2col + [`igemm`]: `x` is `[N, C, spatial...]`, `w` is
/// `[M, C/group, kernel...]`, both with zero points already subtracted (padding is 0).
fn int_conv(g: &ConvGeom, x: &[i32], w: &[i32]) -> Vec<i32> {
    let nsp = g.in_sp.len();
    let cg = g.c / g.group;
    let mg = g.m / g.group;
    let kprod: usize = g.k_sp.iter().product();
    let oprod: usize = g.out_sp.iter().product();
    let iprod: usize = g.in_sp.iter().product();
    let rows = cg * kprod;
    let mut col = vec![0i32; rows * oprod];
    let mut out = vec![0i32; g.n * g.m * oprod];
    // Per kernel offset and output position, the input spatial index (or None when in padding),
    // computed once and shared by all channels, groups and batches.
    let mut taps: Vec<Option<usize>> = vec![None; kprod * oprod];
    let mut kidx = vec![0usize; nsp];
    for kp in 0..kprod {
        let mut rem = kp;
        for d in (0..nsp).rev() {
            kidx[d] = rem % g.k_sp[d];
            rem /= g.k_sp[d];
        }
        for op in 0..oprod {
            let mut rem = op;
            let mut flat = 0usize;
            let mut stride = 1usize;
            let mut inside = true;
            for d in (0..nsp).rev() {
                let o = rem % g.out_sp[d];
                rem /= g.out_sp[d];
                let pos =
                    (o * g.strides[d] + kidx[d] * g.dilations[d]) as isize - g.pads[d] as isize;
                if pos < 0 || pos as usize >= g.in_sp[d] {
                    inside = false;
                    break;
                }
                flat += pos as usize * stride;
                stride *= g.in_sp[d];
            }
            taps[kp * oprod + op] = if inside { Some(flat) } else { None };
        }
    }
    for b in 0..g.n {
        for gi in 0..g.group {
            for ci in 0..cg {
                let xc = &x[(b * g.c + gi * cg + ci) * iprod..][..iprod];
                for kp in 0..kprod {
                    let dst = &mut col[(ci * kprod + kp) * oprod..][..oprod];
                    let t = &taps[kp * oprod..(kp + 1) * oprod];
                    for (d, tap) in dst.iter_mut().zip(t) {
                        *d = tap.map_or(0, |i| xc[i]);
                    }
                }
            }
            let wg = &w[gi * mg * rows..(gi + 1) * mg * rows];
            let og = &mut out[(b * g.m + gi * mg) * oprod..][..mg * oprod];
            igemm(mg, rows, oprod, wg, &col, og);
        }
    }
    out
}

/// The per-output-channel zero-point shape of a conv weight (`[M, 1, 1, ...]`).
fn w_vec_shape(rank: usize) -> impl Fn(usize) -> Vec<usize> {
    move |len| {
        let mut s = vec![1; rank];
        s[0] = len;
        s
    }
}

/// ConvInteger (opset 10): convolution of zero-point-shifted u8/i8 tensors with i32 output.
fn conv_integer(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let w = ins.tensor(1)?;
    let g = ConvGeom::new(ctx, x.shape(), w.shape())?;
    let xv = sub_zero_point(x, ins.opt_tensor(2), |l| vec![l])?;
    let wv = sub_zero_point(w, ins.opt_tensor(3), w_vec_shape(w.rank()))?;
    let out = int_conv(&g, &xv, &wv);
    Ok(vec![Value::tensor(Tensor::from_vec(g.out_shape(), out)?)])
}

/// QLinearConv (opset 10): integer convolution plus optional i32 bias, requantized with
/// `x_scale * w_scale / y_scale` (w_scale per tensor or per output channel) and `y_zero_point`.
fn qlinear_conv(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let x_scale = ins.tensor(1)?;
    let w = ins.tensor(3)?;
    let w_scale = ins.tensor(4)?;
    let y_scale = ins.tensor(6)?;
    let y_zp = ins.opt_tensor(7);
    let bias = ins.opt_tensor(8);
    let g = ConvGeom::new(ctx, x.shape(), w.shape())?;
    let xv = sub_zero_point(x, ins.opt_tensor(2), |l| vec![l])?;
    let wv = sub_zero_point(w, ins.opt_tensor(5), w_vec_shape(w.rank()))?;
    let mut acc = int_conv(&g, &xv, &wv);
    let oprod: usize = g.out_sp.iter().product();
    if let Some(bt) = bias {
        if bt.dtype() != DType::I32 || bt.len() != g.m {
            bail!(
                "bias must be i32 with {} elements, got {} {:?}",
                g.m,
                bt.dtype(),
                bt.shape()
            );
        }
        let bv = bt.as_slice::<i32>()?;
        for (i, chunk) in acc.chunks_mut(oprod.max(1)).enumerate() {
            let bb = bv[i % g.m];
            for v in chunk {
                *v = v.wrapping_add(bb);
            }
        }
    }
    let prec = FloatPrec::of(x_scale.dtype())
        .ok_or_else(|| crate::RtError::msg("x_scale must be a float tensor"))?;
    let sx = scalar_f64(x_scale, "x_scale")?;
    let sy = scalar_f64(y_scale, "y_scale")?;
    let ws = f64s(w_scale)?;
    if ws.len() != 1 && ws.len() != g.m {
        bail!("w_scale must have 1 or {} elements, got {}", g.m, ws.len());
    }
    let mults: Vec<f64> = ws
        .iter()
        .map(|&s| prec.round(prec.round(sx * s) / sy))
        .collect();
    let out_dt = y_zp.map(|z| z.dtype()).unwrap_or(x.dtype());
    let (lo, hi) = qrange(out_dt)?;
    let zy = match y_zp {
        Some(z) => scalar_f64(z, "y_zero_point")?,
        None => 0.0,
    };
    let mut out = vec![0i32; acc.len()];
    for (i, (dst, src)) in out
        .chunks_mut(oprod.max(1))
        .zip(acc.chunks(oprod.max(1)))
        .enumerate()
    {
        let mult = mults[if mults.len() == 1 { 0 } else { i % g.m }];
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = round_clamp(v as f64 * mult + zy, lo, hi) as i32;
        }
    }
    Ok(vec![Value::tensor(int_tensor(out_dt, g.out_shape(), out)?)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threaded DynamicQuantizeLinear gives the serial one's scale, zero point and codes,
    /// with NaN and the extremes in different parts, for all-positive and mixed inputs.
    #[test]
    fn threaded_dynamic_quantize_equals_serial() {
        for (n, shift) in [(DQL_PAR_MIN + 13, 0.0f32), (3 * DQL_PAR_MIN + 1, 3.0)] {
            let mut xs: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 10_007) as f32 / 1000.0 - 5.0 + shift)
                .collect();
            xs[17] = f32::NAN;
            xs[n - 3] = 9.5 + shift;
            xs[n / 2] = -7.25 + shift;
            let want = dynamic_quantize_u8(&xs);
            for threads in [2, 3] {
                let got = dynamic_quantize_u8_par(&xs, threads);
                assert_eq!((got.1.to_bits(), got.2), (want.1.to_bits(), want.2));
                assert!(got.0 == want.0, "codes differ at {threads} threads");
            }
        }
    }

    #[test]
    fn narrow_column_products_without_columns_write_nothing() {
        // MatMulInteger with B [k, 0]: no columns, no sums (indexing the first column panicked).
        let mut out: Vec<i32> = vec![];
        dot_columns(&[1u8, 2, 3], 0, &[], &mut out);
        byte_dot_columns(&[1u8, 2, 3], 0, &[], &[], &mut out);
        assert!(out.is_empty());
        // One column: the byte product equals the definition, zero point included.
        let (a, col) = ([200u8, 3, 255, 0], [-128i8, 127, 5, -1]);
        let want: i32 = a
            .iter()
            .zip(&col)
            .map(|(&x, &y)| (x as i32 - 7) * y as i32)
            .sum();
        let mut got = [0i32];
        byte_dot_columns(
            &a,
            7,
            &[col.to_vec()],
            &[col.iter().map(|&v| v as i32).sum()],
            &mut got,
        );
        assert_eq!(got[0], want);
    }

    #[test]
    fn igemm_small() {
        // [1 2; 3 4] · [5 6; 7 8] = [19 22; 43 50]
        let mut c = vec![0; 4];
        igemm(2, 2, 2, &[1, 2, 3, 4], &[5, 6, 7, 8], &mut c);
        assert_eq!(c, vec![19, 22, 43, 50]);
    }

    #[test]
    fn dynamic_qparams() {
        let (q, s, z) = dynamic_quantize_u8(&[0.0, 2.0, -3.0, -2.5, -3.5, 4.0]);
        // range [-3.5, 4] -> scale 7.5/255, zp = rint(3.5 / scale) = 119
        assert!((s - 7.5 / 255.0).abs() < 1e-9);
        assert_eq!(z, 119);
        assert_eq!(q[0], 119);
        assert_eq!(q[5], 255);
        assert_eq!(q[4], 0);
    }

    #[test]
    fn blocked_geometry() {
        let g = QGeom::new(&[3, 4], &[3, 2], 1, 2).unwrap();
        assert_eq!(
            g.layout,
            QLayout::Blocked {
                block: 2,
                nblocks: 2
            }
        );
        let mut runs = vec![];
        g.for_runs(|xo, po, step, len| runs.push((xo, po, step, len)));
        assert_eq!(runs[3], (3, 1, 1, 1));
        assert!(QGeom::new(&[3, 4], &[3, 3], 1, 2).is_err());
    }

    #[test]
    fn round_half_even() {
        assert_eq!(round_clamp(2.5, 0, 255), 2);
        assert_eq!(round_clamp(3.5, 0, 255), 4);
        assert_eq!(round_clamp(-0.5, -128, 127), 0);
        assert_eq!(round_clamp(300.0, 0, 255), 255);
    }
}
