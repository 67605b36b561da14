//! Integer execution of quantized matrix products: `npuc.QMatMul`, the op the `quant-lower`
//! pass (npuc-passes) writes in place of `DQ(a), DQ(b) [, DQ(bias)] -> MatMul|Gemm [-> Relu|Clip]
//! [-> Q]` in ONNX QDQ graphs.
//!
//! Also `npuc.Quantize` / `npuc.Dequantize`: per-tensor f32 QuantizeLinear/DequantizeLinear
//! without the general kernels' f64 intermediates, for the Q/DQ pairs that stay in a lowered
//! graph around float ops.
//!
//! QMatMul inputs: `a, a_scale, a_zero_point, b, b_scale, b_zero_point, bias?, y_scale?, y_zero_point?,
//! table?, dq_bias?`.
//! - `a`: u8/i8/u16/i16 activations `[.., M, K]`, per-tensor scale and zero point.
//! - `b`: 8-bit or 4-bit (i8/u8/i4/u4) `[K, N]` (`[N, K]` with `trans_b = 1`) with a per-tensor
//!   or per-column (`[N]`) scale/zero point; or an 8-bit activation `[.., K, N]` (batched,
//!   broadcast like MatMul) with per-tensor parameters.
//! - `bias`: optional f32 `[N]` added to the dequantized product (the DQ of the int32 bias).
//! - `y_scale, y_zero_point`: when present the result is requantized to `y_zero_point`'s
//!   dtype (round half to even, saturating); otherwise it is f32 (fused dequantization).
//! - `table`: a fused `npuc.QLut` applied to the 8-bit requantized result (256 values, or 256
//!   per output column).
//! - `dq_bias`: f32 `[N]` (or one value): the 8-bit requantized result is dequantized with
//!   `y_scale, y_zero_point` and `dq_bias` added per column, giving f32: the lowered form of
//!   `QMatMul -> DequantizeLinear -> Add(bias)` (the bias a MatMul exporter writes as its own
//!   Add), with the same rounding as those three ops.
//! - attributes `trans_b` (int, default 0), `clip_min`/`clip_max` (floats, optional): the fused
//!   Relu/Clip, applied to the real-valued result before requantization.
//!
//! Math: `y[m, n] = sa * sb[n] * sum_k (a - za)(b - zb[n]) + bias[n]`, the sum exact in integers
//! (see [`crate::kernels::igemm`]); 16-bit activations are split into a high and a low byte
//! (`a - za = 256 * hi + lo`, both within 8-bit ranges) and the two exact sums are combined in
//! the f32 epilogue. A constant `b` is packed once per plan ([`OpCtx::cached`]).

use crate::bail;
use crate::error::{Result, RtError};
use crate::kernel::MAX_OPSET;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::kernels::igemm::{
    igemm, igemm_then, Layout, PackBuf, PackedA, PackedB, MAX_K, ROW_ALIGN,
};
use crate::kernels::qconvert::{self, Isa, QInt};
use crate::ops::matmul::MatMulPlan;
use crate::value::Value;
use npuc_ir::infer::rules::{matmul_dims, tt};
use npuc_ir::infer::{onnx_rule, NodeIn, R};
use npuc_ir::opdef::{AttrDef, OpDef, Param};
use npuc_ir::{DType, Tensor, TypeInfo};
use rayon::prelude::*;
use std::sync::Arc;

/// Registers the quantized-execution ops of domain "npuc".
pub fn register(r: &mut Registry) {
    r.define(&QMATMUL, qmatmul);
    r.define(&QUANTIZE, quantize_f32);
    r.define(&DEQUANTIZE, dequantize_f32);
    r.define(&QLUT, qlut);
    r.define(&QCONV_TRANSPOSE, qconv_transpose);
    r.define(&crate::ops::qconv::QCONV, crate::ops::qconv::qconv);
}

/// `npuc.QMatMul` (see the module docs).
pub static QMATMUL: OpDef = OpDef {
    domain: "npuc",
    name: "QMatMul",
    inputs: &[
        Param::required("a"),
        Param::required("a_scale"),
        Param::optional("a_zero_point"),
        Param::required("b"),
        Param::required("b_scale"),
        Param::optional("b_zero_point"),
        Param::optional("bias"),
        Param::optional("y_scale"),
        Param::optional("y_zero_point"),
        Param::optional("table"),
        Param::optional("dq_bias"),
    ],
    outputs: &[Param::required("y")],
    attrs: &[
        AttrDef::optional("trans_b", "int"),
        AttrDef::optional("clip_min", "float"),
        AttrDef::optional("clip_max", "float"),
    ],
    infer: infer_qmatmul,
};

/// MatMul's shape (with `b` read as `[N, K]` under `trans_b`); f32 unless requantized to
/// `y_zero_point`'s dtype without a fused dequantization.
fn infer_qmatmul(n: &NodeIn) -> R<Vec<TypeInfo>> {
    let b = match (n.shape(3), n.int_or("trans_b", 0)? != 0) {
        (Some([rows, cols]), true) => Some(vec![cols.clone(), rows.clone()]),
        (Some(s), true) => return Err(format!("trans_b needs a 2-D b, found rank {}", s.len())),
        (None, true) => None,
        (s, false) => s.map(|s| s.to_vec()),
    };
    let dims = match (n.shape(0), b) {
        (Some(a), Some(b)) => Some(matmul_dims(a, &b)?),
        _ => None,
    };
    let dt = if n.has(8) && !n.has(10) {
        n.dt(8)
    } else {
        Some(DType::F32)
    };
    Ok(vec![tt(dt, dims)])
}

/// `npuc.Quantize` (see [`quantize_f32`]): `x`'s shape, `zero_point`'s dtype.
pub static QUANTIZE: OpDef = OpDef {
    domain: "npuc",
    name: "Quantize",
    inputs: &[
        Param::required("x"),
        Param::required("scale"),
        Param::required("zero_point"),
    ],
    outputs: &[Param::required("y")],
    attrs: &[],
    infer: |n| Ok(vec![tt(n.dt(2), n.shape(0).map(|s| s.to_vec()))]),
};

/// `npuc.Dequantize` (see [`dequantize_f32`]): `x`'s shape, f32.
pub static DEQUANTIZE: OpDef = OpDef {
    domain: "npuc",
    name: "Dequantize",
    inputs: &[
        Param::required("x"),
        Param::required("scale"),
        Param::optional("zero_point"),
    ],
    outputs: &[Param::required("y")],
    attrs: &[],
    infer: |n| Ok(vec![tt(Some(DType::F32), n.shape(0).map(|s| s.to_vec()))]),
};

/// `npuc.QLut` (see [`qlut`]): `x`'s shape, the table's dtype.
pub static QLUT: OpDef = OpDef {
    domain: "npuc",
    name: "QLut",
    inputs: &[Param::required("x"), Param::required("table")],
    outputs: &[Param::required("y")],
    attrs: &[AttrDef::optional("axis", "int")],
    infer: |n| Ok(vec![tt(n.dt(1), n.shape(0).map(|s| s.to_vec()))]),
};

/// `npuc.QConvTranspose` (see [`qconv_transpose`]): ConvTranspose's shape of `x` and `w`,
/// `y_zero_point`'s dtype.
pub static QCONV_TRANSPOSE: OpDef = OpDef {
    domain: "npuc",
    name: "QConvTranspose",
    inputs: &[
        Param::required("x"),
        Param::required("x_scale"),
        Param::optional("x_zero_point"),
        Param::required("w"),
        Param::required("w_scale"),
        Param::optional("w_zero_point"),
        Param::optional("bias"),
        Param::required("y_scale"),
        Param::required("y_zero_point"),
    ],
    outputs: &[Param::required("y")],
    attrs: &[],
    infer: |n| {
        let mut conv_t = n.node.clone();
        conv_t.op_type = "ConvTranspose".into();
        conv_t.domain = String::new();
        conv_t.inputs = [0, 3]
            .iter()
            .map(|&i| n.node.input(i).unwrap_or_default().to_string())
            .collect();
        let view = n.derived(&conv_t, MAX_OPSET, &[Some(0), Some(3)]);
        let mut tys = onnx_rule(&view)?;
        if let Some(TypeInfo::Tensor { dtype, .. }) = tys.first_mut() {
            *dtype = n.dt(8);
        }
        Ok(tys)
    },
};

/// Per-thread scratch of [`qmatmul`] (i32 sums, packed activations), kept across nodes and
/// runs: fresh multi-megabyte buffers per call cost more in page faults than the product.
#[derive(Default)]
struct Scratch {
    acc: Vec<i32>,
    acc_lo: Vec<i32>,
    a16: PackBuf,
    /// The HWC copy of a transposed convolution's input.
    xt: Vec<i16>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
    /// A worker thread's gathered-tap buffer for parallel transposed-convolution chunks.
    static GATHER: std::cell::RefCell<PackBuf> = std::cell::RefCell::new(PackBuf::default());
}

/// Lengthens `v` to at least `len` (zeros) and never shortens it; callers use `v[..len]`.
fn grow(v: &mut Vec<i32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0);
    }
}

fn take_scratch() -> Scratch {
    SCRATCH
        .try_with(|s| {
            s.try_borrow_mut()
                .map(|mut s| std::mem::take(&mut *s))
                .unwrap_or_default()
        })
        .unwrap_or_default()
}

fn give_scratch(v: Scratch) {
    let _ = SCRATCH.try_with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            *s = v;
        }
    });
}

/// Elements of output at which the epilogue is split across threads.
const PAR_EPILOGUE: usize = 1 << 18;

/// A constant right-hand operand, zero-point corrected and packed once.
struct PackedWeight {
    packed: PackedB,
    /// Per-column scale (length `n`, scalar scales broadcast).
    scale: Vec<f32>,
}

pub(crate) fn f32_scalar(t: &Tensor, what: &str) -> Result<f32> {
    let v = t.to_f64_vec()?;
    if v.len() != 1 {
        bail!("{what} must be a scalar, found shape {:?}", t.shape());
    }
    Ok(v[0] as f32)
}

pub(crate) fn zp_scalar(t: Option<&Tensor>, what: &str) -> Result<i32> {
    match t {
        None => Ok(0),
        Some(t) => {
            let v = t.to_i64_vec()?;
            if v.len() != 1 {
                bail!("{what} must be a scalar, found shape {:?}", t.shape());
            }
            Ok(v[0] as i32)
        }
    }
}

/// Whether `dt` is an integer type of at most 8 bits (so `v - zp` fits [-255, 255]).
pub(crate) fn is_8bit(dt: DType) -> bool {
    matches!(dt, DType::U8 | DType::I8 | DType::U4 | DType::I4)
}

/// `(lo, hi)` of a quantized output dtype.
pub(crate) fn qrange(dt: DType) -> Result<(i32, i32)> {
    Ok(match dt {
        DType::U8 => (0, 255),
        DType::I8 => (-128, 127),
        DType::U16 => (0, 65535),
        DType::I16 => (-32768, 32767),
        other => bail!("quantized output type {other} is not supported (u8, i8, u16, i16)"),
    })
}

/// Packs a constant or per-run right-hand operand `[k, n]` (or `[n, k]` when `trans`).
fn pack_weight(
    b: &Tensor,
    b_scale: &Tensor,
    b_zp: Option<&Tensor>,
    k: usize,
    n: usize,
    trans: bool,
) -> Result<PackedWeight> {
    if !is_8bit(b.dtype()) {
        bail!(
            "the right-hand operand must be 8- or 4-bit, found {}",
            b.dtype()
        );
    }
    if b.len() != k * n {
        bail!(
            "right-hand operand has {} values, {k}x{n} expected",
            b.len()
        );
    }
    // The codes are read in place (an i64 copy was 8 bytes a weight: 1.1 GB for a 151936 x 896
    // output head, more than its packed form).
    let code: Box<dyn Fn(usize) -> i64 + '_> = match b.dtype() {
        DType::I8 | DType::I4 => {
            let v = b.as_slice::<i8>()?;
            Box::new(move |i| v[i] as i64)
        }
        _ => {
            let v = b.as_slice::<u8>()?;
            Box::new(move |i| v[i] as i64)
        }
    };
    let scale: Vec<f32> = b_scale.to_f64_vec()?.iter().map(|&s| s as f32).collect();
    let zps: Vec<i64> = match b_zp {
        Some(z) => z.to_i64_vec()?,
        None => vec![0],
    };
    let per_col = |len: usize, what: &str| -> Result<()> {
        if len != 1 && len != n {
            bail!("{what} has {len} values; per-tensor (1) or per-column ({n}) expected");
        }
        Ok(())
    };
    per_col(scale.len(), "right-hand scale")?;
    per_col(zps.len(), "right-hand zero point")?;
    if zps.iter().any(|z| !(-128..=255).contains(z)) {
        bail!("right-hand zero point is out of the 8-bit range");
    }
    let zp = |c: usize| if zps.len() == 1 { zps[0] } else { zps[c] };
    let packed = if trans {
        PackedB::pack(k, n, |r, c| (code(c * k + r) - zp(c)) as i16)
    } else {
        PackedB::pack(k, n, |r, c| (code(r * n + c) - zp(c)) as i16)
    };
    let scale = if scale.len() == 1 {
        vec![scale[0]; n]
    } else {
        scale
    };
    Ok(PackedWeight { packed, scale })
}

/// The left-hand operand packed as one or two (16-bit split) 8-bit-range matrices.
enum PackedAct {
    Single(PackedA),
    /// `a - za = 256 * hi + lo`.
    Split(PackedA, PackedA),
}

fn pack_act(
    buf: PackBuf,
    a: &Tensor,
    off: usize,
    m: usize,
    k: usize,
    za: i32,
) -> Result<PackedAct> {
    let len = m * k;
    // Under the quads layout the 8-bit codes are the kernel's unsigned operand as they are
    // (u8; i8 with the top bit flipped), the zero point (+ 128 for i8) every row's offset:
    // a byte copy instead of widening each row and scanning it for its range.
    let quads = Layout::active() == Layout::Quads;
    Ok(match a.dtype() {
        DType::U8 if quads && (0..=255).contains(&za) => {
            let s = &a.as_slice::<u8>()?[off..off + len];
            PackedAct::Single(PackedA::pack_bytes_with(buf, m, k, za, |r, row| {
                row.copy_from_slice(&s[r * k..(r + 1) * k])
            }))
        }
        DType::I8 if quads && (-128..=127).contains(&za) => {
            let s = &a.as_slice::<i8>()?[off..off + len];
            PackedAct::Single(PackedA::pack_bytes_with(buf, m, k, za + 128, |r, row| {
                for (d, &v) in row.iter_mut().zip(&s[r * k..(r + 1) * k]) {
                    *d = (v as u8) ^ 0x80;
                }
            }))
        }
        DType::U8 => {
            let s = &a.as_slice::<u8>()?[off..off + len];
            PackedAct::Single(PackedA::pack_rows_in(buf, m, k, s, |v| {
                (v as i32 - za) as i16
            }))
        }
        DType::I8 => {
            let s = &a.as_slice::<i8>()?[off..off + len];
            PackedAct::Single(PackedA::pack_rows_in(buf, m, k, s, |v| {
                (v as i32 - za) as i16
            }))
        }
        DType::U16 | DType::I16 => {
            let wide: Vec<i32> = if a.dtype() == DType::U16 {
                a.as_slice::<u16>()?[off..off + len]
                    .iter()
                    .map(|&v| v as i32 - za)
                    .collect()
            } else {
                a.as_slice::<i16>()?[off..off + len]
                    .iter()
                    .map(|&v| v as i32 - za)
                    .collect()
            };
            // Arithmetic shift: hi in [-256, 255], lo in [0, 255] for |v| <= 65535.
            let hi = PackedA::pack_rows(m, k, &wide, |v| (v >> 8) as i16);
            let lo = PackedA::pack_rows(m, k, &wide, |v| (v & 0xff) as i16);
            PackedAct::Split(hi, lo)
        }
        other => bail!("the left-hand operand must be u8, i8, u16 or i16, found {other}"),
    })
}

/// How results leave the kernel.
#[derive(Clone, Copy)]
enum OutMode {
    /// Requantize: `q = clamp(round(v / ys) + zp, lo, hi)`.
    Quant {
        inv_ys: f32,
        zp: i32,
        lo: i32,
        hi: i32,
    },
    /// f32, clamped to `[lo, hi]` (the fused activation; infinite when none).
    Float { lo: f32, hi: f32 },
}

/// Converts the integer sums of `rows` output rows into the output values (vectorized in
/// [`qconvert`]).
#[allow(clippy::too_many_arguments)]
fn epilogue_rows<T: Copy + Send + Default + 'static>(
    acc: &[i32],
    acc_lo: Option<&[i32]>,
    n: usize,
    out: &mut [T],
    row: impl Fn(&[i32], Option<&[i32]>, &mut [T]) + Sync,
    threads: usize,
) {
    let body = |(ri, orow): (usize, &mut [T])| {
        let arow = &acc[ri * n..(ri + 1) * n];
        let lrow = acc_lo.map(|l| &l[ri * n..(ri + 1) * n]);
        row(arow, lrow, orow);
    };
    if threads > 1 && out.len() >= PAR_EPILOGUE {
        out.par_chunks_mut(n).enumerate().for_each(body);
    } else {
        out.chunks_mut(n).enumerate().for_each(body);
    }
}

/// The per-row output stage for quantized output type `T`; `lut` (a fused `npuc.QLut`, only
/// for 8-bit `T`, one 256-entry table for every column) maps each requantized value. Per-column
/// tables are applied per block of rows instead ([`split_lut`], [`lut_rows`]).
fn quant_row<'a, T: QInt>(
    mult: &'a [f32],
    bias: &'a [f32],
    mode: OutMode,
    lut: Option<&'a [T]>,
) -> impl Fn(&[i32], Option<&[i32]>, &mut [T]) + Sync + 'a {
    let isa = Isa::detect();
    move |a, l, o| {
        match mode {
            OutMode::Quant { inv_ys, zp, lo, hi } => {
                qconvert::requant_row(isa, a, l, mult, bias, inv_ys, zp, (lo, hi), o)
            }
            // Float mode has f32 output only (see `qmatmul`).
            OutMode::Float { .. } => unreachable!("float epilogue with an integer output"),
        }
        if let Some(tab) = lut {
            lut_rows(o, o.len(), tab);
        }
    }
}

/// Maps the rows of `o` (`n` values each) through their columns' 256-entry tables `tab` (one
/// table for every column when it holds 256 values), in place. Index = value - `T::LO`, within
/// [0, 256) for the 8-bit types checked by `qmatmul`.
///
/// Per-column tables are visited in blocks of [`LUT_BLOCK`] columns over all rows: walking a
/// whole row touches every column's table (fc1's 1536 tables are 384 KB, beyond L1), while a
/// block's tables (8 KB) stay in L1 across the rows.
fn lut_rows<T: QInt>(o: &mut [T], n: usize, tab: &[T]) {
    let at = |t: &[T], v: T| t[(v.to_i32() - T::LO) as usize & 0xff];
    if tab.len() == 256 {
        if let Some(bytes) = T::bytes_mut(o) {
            // One table for every column: the byte lookup kernel (see `lut8`).
            let mut t8 = [0u8; 256];
            for (d, &v) in t8.iter_mut().zip(tab) {
                *d = v.to_i32() as u8;
            }
            let flip = if T::LO < 0 { 0x80 } else { 0 };
            crate::kernels::lut8::lut8(&t8, flip, bytes);
            return;
        }
        for v in o.iter_mut() {
            *v = at(tab, *v);
        }
        return;
    }
    for c0 in (0..n).step_by(LUT_BLOCK) {
        let c1 = (c0 + LUT_BLOCK).min(n);
        let tabs = &tab[c0 * 256..c1 * 256];
        for row in o.chunks_exact_mut(n) {
            for (v, t) in row[c0..c1].iter_mut().zip(tabs.chunks_exact(256)) {
                *v = at(t, *v);
            }
        }
    }
}

/// Columns per block of [`lut_rows`]: 32 tables of 256 bytes.
const LUT_BLOCK: usize = 32;

fn qmatmul(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let a = ins.tensor(0)?;
    let a_scale = f32_scalar(ins.tensor(1)?, "a_scale")?;
    let za = zp_scalar(ins.opt_tensor(2), "a_zero_point")?;
    let b = ins.tensor(3)?;
    let b_scale = ins.tensor(4)?;
    let b_zp = ins.opt_tensor(5);
    let bias = ins.opt_tensor(6);
    let y_scale = ins.opt_tensor(7);
    let y_zp = ins.opt_tensor(8);
    let trans_b = ctx.node.int_or("trans_b", 0)? != 0;
    let (za_lo, za_hi) = if is_8bit(a.dtype()) {
        (-128, 255)
    } else {
        (-32768, 65535)
    };
    if !(za_lo..=za_hi).contains(&za) {
        bail!(
            "a_zero_point {za} is out of range for {} activations",
            a.dtype()
        );
    }
    if !matches!(a.dtype(), DType::U8 | DType::I8 | DType::U16 | DType::I16) {
        bail!("a must be u8, i8, u16 or i16, found {}", a.dtype());
    }
    let b_shape: Vec<usize> = if trans_b {
        if b.rank() != 2 {
            bail!("trans_b needs a 2-D b, found shape {:?}", b.shape());
        }
        vec![b.shape()[1], b.shape()[0]]
    } else {
        b.shape().to_vec()
    };
    let plan = MatMulPlan::new(a.shape(), &b_shape)?;
    let (m, n, k) = (plan.m, plan.n, plan.k);
    if k > MAX_K {
        bail!("reduction length {k} exceeds {MAX_K}, the longest exact in i32 accumulation");
    }
    let bias: Vec<f32> = match bias {
        Some(t) => {
            let v: Vec<f32> = t.to_f64_vec()?.iter().map(|&x| x as f32).collect();
            if v.len() != n && v.len() != 1 {
                bail!("bias has {} values, {n} expected", v.len());
            }
            if v.len() == 1 {
                vec![v[0]; n]
            } else {
                v
            }
        }
        None => vec![0.0; n],
    };
    let clip_lo = ctx.node.float_or("clip_min", f32::NEG_INFINITY)?;
    let clip_hi = ctx.node.float_or("clip_max", f32::INFINITY)?;
    let (mode, out_dt) = match (y_scale, y_zp) {
        (Some(ys), Some(yz)) => {
            let ys = f32_scalar(ys, "y_scale")?;
            if !(ys > 0.0 && ys.is_finite()) {
                bail!("y_scale must be positive and finite, found {ys}");
            }
            let zp = zp_scalar(Some(yz), "y_zero_point")?;
            let (mut lo, mut hi) = qrange(yz.dtype())?;
            // The fused activation clamps the real value; quantization is monotonic, so it
            // clamps the quantized value at the quantized bounds.
            let q = |v: f32| (v / ys).round_ties_even() as f64 + zp as f64;
            if clip_lo.is_finite() {
                lo = lo.max(q(clip_lo).clamp(lo as f64, hi as f64) as i32);
            }
            if clip_hi.is_finite() {
                hi = hi.min(q(clip_hi).clamp(lo as f64, hi as f64) as i32);
            }
            (
                OutMode::Quant {
                    inv_ys: 1.0 / ys,
                    zp,
                    lo,
                    hi,
                },
                yz.dtype(),
            )
        }
        (None, None) => (
            OutMode::Float {
                lo: clip_lo,
                hi: clip_hi,
            },
            DType::F32,
        ),
        _ => bail!("y_scale and y_zero_point must both be given or both be absent"),
    };
    // A fused lookup table (input 9): same 8-bit dtype as the requantized output, 256 values
    // or 256 per output column.
    let lut = ins.opt_tensor(9);
    if let Some(l) = lut {
        if l.dtype() != out_dt || !matches!(out_dt, DType::U8 | DType::I8) {
            bail!(
                "the fused table must have the 8-bit output's dtype {out_dt}, found {}",
                l.dtype()
            );
        }
        if l.len() != 256 && l.len() != 256 * n {
            bail!(
                "the fused table holds {} values; 256 or 256 x {n} expected",
                l.len()
            );
        }
    }
    // A fused dequantization (input 10): 8-bit requantized codes, dequantized with y_scale and
    // y_zero_point, plus this bias per column, as f32.
    let dq = match ins.opt_tensor(10) {
        None => None,
        Some(t) => {
            let ys = match y_scale {
                Some(ys) if matches!(out_dt, DType::U8 | DType::I8) && lut.is_none() => {
                    f32_scalar(ys, "y_scale")?
                }
                _ => bail!(
                    "dq_bias needs an 8-bit y_scale/y_zero_point and no fused table (output {out_dt})"
                ),
            };
            let v: Vec<f32> = t.to_f64_vec()?.iter().map(|&x| x as f32).collect();
            let bias = match v.len() {
                1 => vec![v[0]; n],
                l if l == n => v,
                l => bail!("dq_bias has {l} values, {n} expected"),
            };
            Some(DqOut {
                ys,
                bias,
                code: out_dt,
            })
        }
    };
    let out_dt = if dq.is_some() { DType::F32 } else { out_dt };
    let batches = plan.out_shape.iter().product::<usize>() / (m * n).max(1);
    let const_b =
        ctx.input_is_const(3) && ctx.input_is_const(4) && (b_zp.is_none() || ctx.input_is_const(5));
    let single_b = b_shape.len() == 2;
    let weight: Option<Arc<PackedWeight>> = if const_b && single_b {
        Some(ctx.cached(|| pack_weight(b, b_scale, b_zp, k, n, trans_b))?)
    } else {
        None
    };
    if weight.is_none() && (b_scale.len() != 1 || b_zp.is_some_and(|z| z.len() != 1)) {
        bail!("a non-constant b must have per-tensor scale and zero point");
    }
    // Rows of a that share one b: the whole batch when b is a single matrix.
    let (groups, rows_per): (Vec<(usize, usize)>, usize) = if plan.fold_batch {
        (vec![(0, 0)], m * batches)
    } else {
        (plan.offsets.clone(), m)
    };
    let total = plan.out_shape.iter().product::<usize>();
    let shape = plan.out_shape.clone();
    let lut_u8 = match (lut, out_dt) {
        (Some(l), DType::U8) => Some(l.as_slice::<u8>()?),
        _ => None,
    };
    let lut_i8 = match (lut, out_dt) {
        (Some(l), DType::I8) => Some(l.as_slice::<i8>()?),
        _ => None,
    };
    let job = GroupJob {
        a,
        a_scale,
        za,
        b,
        b_scale,
        b_zp,
        weight: weight.as_deref(),
        bias: &bias,
        mode,
        k,
        n,
        rows_per,
        lut_u8,
        lut_i8,
        dq: dq.as_ref(),
    };
    // A batched product (attention's per-head matrices) runs its heads in parallel, each on
    // one thread: a head is too small to split, and splitting each one would pay a thread
    // hand-off per head. A single product splits its rows instead (inside `igemm`).
    let across = ctx.threads > 1 && groups.len() > 1;
    let inner_threads = if across { 1 } else { ctx.threads };
    let chunk = rows_per * n;
    fn run_all<T: OutElem>(
        job: &GroupJob,
        groups: &[(usize, usize)],
        total: usize,
        chunk: usize,
        across: bool,
        threads: usize,
    ) -> Result<Vec<T>> {
        let mut out = crate::buffers::zeroed::<T>(total);
        if chunk == 0 {
            return Ok(out);
        }
        if across {
            out.par_chunks_mut(chunk)
                .zip(groups.par_iter())
                .try_for_each(|(o, &g)| job.run(g, T::wrap(o), threads))?;
        } else {
            for (o, &g) in out.chunks_mut(chunk).zip(groups) {
                job.run(g, T::wrap(o), threads)?;
            }
        }
        Ok(out)
    }
    let (gs, t) = (&groups[..], inner_threads);
    let tensor = match out_dt {
        DType::F32 => Tensor::from_vec(shape, run_all::<f32>(&job, gs, total, chunk, across, t)?)?,
        DType::U8 => Tensor::from_vec(shape, run_all::<u8>(&job, gs, total, chunk, across, t)?)?,
        DType::I8 => Tensor::from_vec(shape, run_all::<i8>(&job, gs, total, chunk, across, t)?)?,
        DType::U16 => Tensor::from_vec(shape, run_all::<u16>(&job, gs, total, chunk, across, t)?)?,
        DType::I16 => Tensor::from_vec(shape, run_all::<i16>(&job, gs, total, chunk, across, t)?)?,
        other => bail!("unsupported output type {other}"),
    };
    Ok(vec![Value::tensor(tensor)])
}

/// One group's output rows, typed.
enum OutBuf<'a> {
    F32(&'a mut [f32]),
    U8(&'a mut [u8]),
    I8(&'a mut [i8]),
    U16(&'a mut [u16]),
    I16(&'a mut [i16]),
}

/// The product of packed activations and a packed weight, converted into `out` row by row
/// by `row(sums, low_sums, out_row)`, then `chunk(rows)` over each finished block of whole
/// output rows (per-column lookup tables, see [`lut_rows`]). An 8-bit operand runs one product
/// whose epilogue reads each chunk of sums while it is still in cache ([`igemm_then`]); a
/// 16-bit operand's two byte products are combined afterwards.
///
/// No clearing: `igemm` writes every sum of its output (stale values are overwritten), and
/// zero-filling megabytes per call showed up in profiles. The scratch only grows: it is
/// shared by every node on this thread, and resizing it down and up again between a small
/// and a large product would zero-fill the difference each time.
#[allow(clippy::too_many_arguments)]
fn product_into<T: Copy + Send + Default + 'static>(
    pa: &PackedAct,
    w: &PackedB,
    scratch: &mut Scratch,
    n: usize,
    out: &mut [T],
    threads: usize,
    row: impl Fn(&[i32], Option<&[i32]>, &mut [T]) + Sync,
    chunk: impl Fn(&mut [T]) + Sync,
) -> Result<()> {
    match pa {
        PackedAct::Single(a) => {
            grow(&mut scratch.acc, a.m() * n);
            let epi = |sums: &[i32], o: &mut [T]| {
                for (s, orow) in sums.chunks_exact(n).zip(o.chunks_exact_mut(n)) {
                    row(s, None, orow);
                }
                chunk(o);
            };
            igemm_then(a, w, &mut scratch.acc, out, threads, &epi)
        }
        PackedAct::Split(hi, lo) => {
            grow(&mut scratch.acc, hi.m() * n);
            grow(&mut scratch.acc_lo, lo.m() * n);
            igemm(hi, w, &mut scratch.acc, threads)?;
            igemm(lo, w, &mut scratch.acc_lo, threads)?;
            epilogue_rows(&scratch.acc, Some(&scratch.acc_lo), n, out, row, threads);
            chunk(out);
            Ok(())
        }
    }
}

/// [`product_into`] with a quantized output: requantization by `(multipliers, bias, mode)`,
/// then `lut` (a fused `npuc.QLut`, 8-bit outputs only) applied per row when it is one table,
/// or per block of rows ([`lut_rows`]) when it holds one table per column.
#[allow(clippy::too_many_arguments)]
fn quant_into<T: QInt>(
    pa: &PackedAct,
    w: &PackedB,
    scratch: &mut Scratch,
    n: usize,
    out: &mut [T],
    threads: usize,
    (mult, bias, mode): (&[f32], &[f32], OutMode),
    lut: Option<&[T]>,
) -> Result<()> {
    let (row_lut, col_lut) = split_lut(lut);
    let row = quant_row::<T>(mult, bias, mode, row_lut);
    product_into(pa, w, scratch, n, out, threads, row, |o| {
        if let Some(tab) = col_lut {
            lut_rows(o, n, tab)
        }
    })
}

/// Splits a fused lookup table into (one table applied per row as it is requantized, per-column
/// tables applied per block of rows by [`lut_rows`]).
#[allow(clippy::type_complexity)]
fn split_lut<T>(lut: Option<&[T]>) -> (Option<&[T]>, Option<&[T]>) {
    match lut {
        Some(t) if t.len() == 256 => (Some(t), None),
        other => (None, other),
    }
}

/// Output element types of [`qmatmul`].
trait OutElem: Copy + Default + Send + Sync + 'static {
    fn wrap(o: &mut [Self]) -> OutBuf<'_>;
}

macro_rules! out_elem {
    ($($t:ty => $v:ident),*) => {$(
        impl OutElem for $t {
            fn wrap(o: &mut [Self]) -> OutBuf<'_> {
                OutBuf::$v(o)
            }
        }
    )*};
}
out_elem!(f32 => F32, u8 => U8, i8 => I8, u16 => U16, i16 => I16);

/// Everything one group of a [`qmatmul`] (rows of `a` sharing one `b`) needs.
struct GroupJob<'a> {
    a: &'a Tensor,
    a_scale: f32,
    za: i32,
    b: &'a Tensor,
    b_scale: &'a Tensor,
    b_zp: Option<&'a Tensor>,
    /// The constant, pre-packed `b`; `None` when `b` is an activation (packed per group).
    weight: Option<&'a PackedWeight>,
    bias: &'a [f32],
    mode: OutMode,
    k: usize,
    n: usize,
    rows_per: usize,
    lut_u8: Option<&'a [u8]>,
    lut_i8: Option<&'a [i8]>,
    /// The fused dequantization of an 8-bit requantized result (input 10).
    dq: Option<&'a DqOut>,
}

/// `QMatMul`'s fused output dequantization: `y = (q - zp) * ys + bias[j]` for the 8-bit code
/// `q` of requantization (see the module docs).
struct DqOut {
    ys: f32,
    bias: Vec<f32>,
    /// The codes' dtype (u8 or i8, `y_zero_point`'s).
    code: DType,
}

/// Requantizes one row to `T` codes and dequantizes them into `out` with the fused bias,
/// 256 columns at a time through a stack buffer; `out[j]` equals
/// `Dequantize(requant_row(..))[j] + dq.bias[j]` (the same kernels, in the same order).
#[allow(clippy::too_many_arguments)]
fn requant_dequant_row<T: QInt>(
    isa: Isa,
    acc: &[i32],
    acc_lo: Option<&[i32]>,
    mult: &[f32],
    bias: &[f32],
    (inv_ys, zp, lo, hi): (f32, i32, i32, i32),
    dq: &DqOut,
    out: &mut [f32],
) {
    let mut codes = [T::default(); 256];
    for c0 in (0..out.len()).step_by(256) {
        let c1 = (c0 + 256).min(out.len());
        let q = &mut codes[..c1 - c0];
        let l = acc_lo.map(|l| &l[c0..c1]);
        let (a, m, b) = (&acc[c0..c1], &mult[c0..c1], &bias[c0..c1]);
        qconvert::requant_row(isa, a, l, m, b, inv_ys, zp, (lo, hi), q);
        let o = &mut out[c0..c1];
        qconvert::dequantize(isa, q, dq.ys, zp, o);
        for (v, &b) in o.iter_mut().zip(&dq.bias[c0..c1]) {
            *v += b;
        }
    }
}

impl GroupJob<'_> {
    /// The product of group `(oa, ob)` (offsets into `a` and `b`) into `out`, on this
    /// thread's scratch buffers.
    fn run(&self, (oa, ob): (usize, usize), out: OutBuf, threads: usize) -> Result<()> {
        let (k, n, rows_per) = (self.k, self.n, self.rows_per);
        let local;
        let w: &PackedWeight = match self.weight {
            Some(w) => w,
            None => {
                local = pack_batch_b(self.b, self.b_scale, self.b_zp, ob, k, n)?;
                &local
            }
        };
        let mult: Vec<f32> = w.scale.iter().map(|&s| self.a_scale * s).collect();
        let mut scratch = take_scratch();
        let packed_a = pack_act(
            std::mem::take(&mut scratch.a16),
            self.a,
            oa,
            rows_per,
            k,
            self.za,
        );
        let result = (|| {
            let packed_a = packed_a?;
            let (mult, bias, mode, t) = (&mult[..], self.bias, self.mode, threads);
            let (pa, wp, sc) = (&packed_a, &w.packed, &mut scratch);
            match out {
                OutBuf::F32(o) => {
                    let isa = Isa::detect();
                    match (mode, self.dq) {
                        (OutMode::Float { lo, hi }, None) => {
                            let row = |a: &[i32], l: Option<&[i32]>, o: &mut [f32]| {
                                qconvert::requant_row_f32(isa, a, l, mult, bias, lo, hi, o)
                            };
                            product_into(pa, wp, sc, n, o, t, row, |_| {})?
                        }
                        (OutMode::Quant { inv_ys, zp, lo, hi }, Some(dq)) => {
                            let q = (inv_ys, zp, lo, hi);
                            let row = |a: &[i32], l: Option<&[i32]>, o: &mut [f32]| match dq.code {
                                DType::I8 => {
                                    requant_dequant_row::<i8>(isa, a, l, mult, bias, q, dq, o)
                                }
                                _ => requant_dequant_row::<u8>(isa, a, l, mult, bias, q, dq, o),
                            };
                            product_into(pa, wp, sc, n, o, t, row, |_| {})?
                        }
                        _ => {
                            bail!("internal: f32 output with requantization and no dequantization")
                        }
                    }
                }
                OutBuf::U8(o) => quant_into(pa, wp, sc, n, o, t, (mult, bias, mode), self.lut_u8)?,
                OutBuf::I8(o) => quant_into(pa, wp, sc, n, o, t, (mult, bias, mode), self.lut_i8)?,
                OutBuf::U16(o) => quant_into(pa, wp, sc, n, o, t, (mult, bias, mode), None)?,
                OutBuf::I16(o) => quant_into(pa, wp, sc, n, o, t, (mult, bias, mode), None)?,
            }
            Ok(packed_a)
        })();
        let back = match result {
            Ok(PackedAct::Single(pa)) => Ok(pa.into_buffer()),
            Ok(PackedAct::Split(..)) => Ok(PackBuf::default()),
            Err(e) => Err(e),
        };
        match back {
            Ok(buf) => {
                // The packed-activation buffer goes back for the next product (a 16-bit
                // split packs into fresh buffers and returns none).
                scratch.a16 = buf;
                give_scratch(scratch);
                Ok(())
            }
            Err(e) => {
                give_scratch(scratch);
                Err(e)
            }
        }
    }
}

/// Packs batch matrix `b[off .. off + k*n]` of an activation right-hand operand.
fn pack_batch_b(
    b: &Tensor,
    b_scale: &Tensor,
    b_zp: Option<&Tensor>,
    off: usize,
    k: usize,
    n: usize,
) -> Result<PackedWeight> {
    let zb = zp_scalar(b_zp, "b_zero_point")?;
    let sb = f32_scalar(b_scale, "b_scale")?;
    let packed = match b.dtype() {
        DType::U8 => {
            let s = &b.as_slice::<u8>()?[off..off + k * n];
            PackedB::pack_rows(k, n, s, |v| (v as i32 - zb) as i16)
        }
        DType::I8 => {
            let s = &b.as_slice::<i8>()?[off..off + k * n];
            PackedB::pack_rows(k, n, s, |v| (v as i32 - zb) as i16)
        }
        other => {
            return Err(RtError::msg(format!(
                "a non-constant right-hand operand must be u8 or i8, found {other}"
            )))
        }
    };
    Ok(PackedWeight {
        packed,
        scale: vec![sb; n],
    })
}

/// `npuc.Quantize(x: f32, scale: f32 scalar, zero_point: u8|i8|u16|i16 scalar)`: ONNX
/// QuantizeLinear restricted to per-tensor f32 quantization, computed in f32 without
/// intermediate vectors (`round_half_even(x / scale) + zp`, saturated), the same value as the
/// general kernel in `ops::quant` for these types.
fn quantize_f32(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let scale = f32_scalar(ins.tensor(1)?, "y_scale")?;
    let zt = ins.tensor(2)?;
    let zp = zp_scalar(Some(zt), "y_zero_point")?;
    // Validates the output type (u8, i8, u16, i16).
    qrange(zt.dtype())?;
    let out_dt = zt.dtype();
    let x = ins.tensor(0)?;
    if x.dtype() != DType::F32 {
        bail!("npuc.Quantize takes f32 input, found {}", x.dtype());
    }
    let shape = x.shape().to_vec();
    let xs = x.as_slice::<f32>()?;
    fn fill<T: QInt>(xs: &[f32], threads: usize, scale: f32, zp: i32) -> Vec<T> {
        let isa = Isa::detect();
        let mut out = crate::buffers::zeroed::<T>(xs.len());
        if threads > 1 && xs.len() >= PAR_EPILOGUE {
            out.par_chunks_mut(1 << 13)
                .zip(xs.par_chunks(1 << 13))
                .for_each(|(o, x)| qconvert::quantize(isa, x, scale, zp, o));
        } else {
            qconvert::quantize(isa, xs, scale, zp, &mut out);
        }
        out
    }
    let t = ctx.threads;
    let out = match out_dt {
        DType::U8 => Tensor::from_vec(shape, fill::<u8>(xs, t, scale, zp))?,
        DType::I8 => Tensor::from_vec(shape, fill::<i8>(xs, t, scale, zp))?,
        DType::U16 => Tensor::from_vec(shape, fill::<u16>(xs, t, scale, zp))?,
        _ => Tensor::from_vec(shape, fill::<i16>(xs, t, scale, zp))?,
    };
    Ok(vec![Value::tensor(out)])
}

/// `npuc.Dequantize(x: u8|i8|u16|i16, scale: f32 scalar, zero_point?)`: ONNX DequantizeLinear
/// restricted to per-tensor f32 output, `(x - zp) * scale` in f32 (exact integer difference,
/// one rounding, as the general kernel).
fn dequantize_f32(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let scale = f32_scalar(ins.tensor(1)?, "x_scale")?;
    let zp = zp_scalar(ins.opt_tensor(2), "x_zero_point")?;
    fn conv<T: QInt + npuc_ir::Elem>(
        x: &Tensor,
        threads: usize,
        scale: f32,
        zp: i32,
    ) -> Result<Vec<f32>> {
        let isa = Isa::detect();
        let xs = x.as_slice::<T>()?;
        let mut out = crate::buffers::zeroed::<f32>(xs.len());
        if threads > 1 && xs.len() >= PAR_EPILOGUE {
            out.par_chunks_mut(1 << 13)
                .zip(xs.par_chunks(1 << 13))
                .for_each(|(o, x)| qconvert::dequantize(isa, x, scale, zp, o));
        } else {
            qconvert::dequantize(isa, xs, scale, zp, &mut out);
        }
        Ok(out)
    }
    let t = ctx.threads;
    let out = match x.dtype() {
        DType::U8 => conv::<u8>(x, t, scale, zp)?,
        DType::I8 => conv::<i8>(x, t, scale, zp)?,
        DType::U16 => conv::<u16>(x, t, scale, zp)?,
        DType::I16 => conv::<i16>(x, t, scale, zp)?,
        other => bail!("npuc.Dequantize takes u8, i8, u16 or i16, found {other}"),
    };
    Ok(vec![Value::tensor(Tensor::from_vec(
        x.shape().to_vec(),
        out,
    )?)])
}

/// `npuc.QLut(x: u8|i8, table: u8|i8 [256] or [C, 256])`, attribute `axis` (channel axis of
/// `x` when the table has C rows; may be negative): `y[i] = table[c(i)][x[i] - min(x's type)]`.
/// Written by `quant_lower` for elementwise float math between a DequantizeLinear and a
/// QuantizeLinear, tabulated at load time; the output has the table's dtype and `x`'s shape.
fn qlut(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let table = ins.tensor(1)?;
    let c = match table.rank() {
        1 => 1,
        2 => table.shape()[0],
        r => bail!("QLut table must be [256] or [C, 256], found rank {r}"),
    };
    if c == 0 || table.len() != c * 256 {
        bail!(
            "QLut table must hold 256 values per channel, found shape {:?}",
            table.shape()
        );
    }
    let shape = x.shape().to_vec();
    let inner = if c > 1 {
        let rank = shape.len() as i64;
        let axis = ctx.node.int_or("axis", 1)?;
        let a = if axis < 0 { axis + rank } else { axis };
        if !(0..rank).contains(&a) || shape[a as usize] != c {
            bail!(
                "QLut table has {c} channels but axis {axis} of input shape {shape:?} does not match"
            );
        }
        shape[a as usize + 1..].iter().product::<usize>()
    } else {
        x.len().max(1)
    };
    fn map<I: Copy, O: Copy + Default + 'static>(
        xs: &[I],
        tab: &[O],
        c: usize,
        inner: usize,
        idx: impl Fn(I) -> u8,
    ) -> Vec<O> {
        let mut out = crate::buffers::zeroed::<O>(xs.len());
        if c == 1 {
            let row: &[O; 256] = tab[..256].try_into().expect("256-entry table");
            for (o, &v) in out.iter_mut().zip(xs) {
                *o = row[idx(v) as usize];
            }
        } else if inner == 1 {
            // Channels are the last axis: element j of each row of C uses table row j.
            for (orow, xrow) in out.chunks_mut(c).zip(xs.chunks(c)) {
                for ((o, &v), row) in orow.iter_mut().zip(xrow).zip(tab.chunks_exact(256)) {
                    *o = row[idx(v) as usize];
                }
            }
        } else {
            for (bi, (ob, xb)) in out.chunks_mut(inner).zip(xs.chunks(inner)).enumerate() {
                let ch = bi % c;
                let row: &[O; 256] = tab[ch * 256..(ch + 1) * 256]
                    .try_into()
                    .expect("256-entry table");
                for (o, &v) in ob.iter_mut().zip(xb) {
                    *o = row[idx(v) as usize];
                }
            }
        }
        out
    }
    fn run<O: Copy + Default + npuc_ir::Elem>(
        x: &Tensor,
        tab: &[O],
        c: usize,
        inner: usize,
    ) -> Result<Vec<O>> {
        Ok(match x.dtype() {
            DType::U8 => map(x.as_slice::<u8>()?, tab, c, inner, |v| v),
            DType::I8 => map(x.as_slice::<i8>()?, tab, c, inner, |v| (v as u8) ^ 0x80),
            other => bail!("QLut input must be u8 or i8, found {other}"),
        })
    }
    let t = match table.dtype() {
        DType::U8 => Tensor::from_vec(shape, run(x, table.as_slice::<u8>()?, c, inner)?)?,
        DType::I8 => Tensor::from_vec(shape, run(x, table.as_slice::<i8>()?, c, inner)?)?,
        other => bail!("QLut table must be u8 or i8, found {other}"),
    };
    Ok(vec![Value::tensor(t)])
}

/// Geometry of a 2-D transposed convolution (group 1, dilations 1).
#[derive(Debug, Clone, Copy)]
struct ConvTGeom {
    /// Input channels, height, width.
    c: usize,
    ih: usize,
    iw: usize,
    /// Output channels, kernel height, width.
    m: usize,
    kh: usize,
    kw: usize,
    /// Output height, width.
    oh: usize,
    ow: usize,
    /// Strides and begin pads (y, x).
    s: [usize; 2],
    pb: [usize; 2],
}

/// One output phase `(py, px)` of a strided transposed convolution. The outputs
/// `(py + sy * j, px + sx * i)` receive exactly the taps `ky` with `(py + pb_y - ky) % sy == 0`
/// (and likewise in x), each read at input `(j + dy, i + dx)` with `dy = (py + pb_y - ky) / sy`,
/// so a phase is one plain product `[pixels, taps * C] x [taps * C, M]` whose sums land on
/// distinct outputs: no `kh * kw`-times larger column buffer and no scatter-add (col2im).
struct Phase {
    py: usize,
    px: usize,
    /// Output rows / columns of this phase.
    ny: usize,
    nx: usize,
    /// `(dy, dx)` input offset of each tap, in the reduction order of `w`.
    taps: Vec<(isize, isize)>,
    /// Zero-point-corrected weights `[taps * C, M]`, row `(t, ci)`.
    w: PackedB,
}

/// The phases of a transposed convolution with the weight `w[ci, co, ky, kx]` (`wv`, row-major,
/// `zp(co)` its zero point), packed once per plan.
fn conv_t_phases(g: &ConvTGeom, wv: &[i64], zp: impl Fn(usize) -> i64) -> Vec<Phase> {
    let taps_1d = |p: usize, pb: usize, k: usize, s: usize| -> Vec<(usize, isize)> {
        (0..k)
            .filter_map(|kk| {
                let d = p as isize + pb as isize - kk as isize;
                (d.rem_euclid(s as isize) == 0).then_some((kk, d.div_euclid(s as isize)))
            })
            .collect()
    };
    let count = |p: usize, o: usize, s: usize| if p < o { (o - p).div_ceil(s) } else { 0 };
    let mut out = Vec::with_capacity(g.s[0] * g.s[1]);
    for py in 0..g.s[0] {
        for px in 0..g.s[1] {
            let ty = taps_1d(py, g.pb[0], g.kh, g.s[0]);
            let tx = taps_1d(px, g.pb[1], g.kw, g.s[1]);
            let mut taps = Vec::with_capacity(ty.len() * tx.len());
            let mut kk = Vec::with_capacity(ty.len() * tx.len());
            for &(ky, dy) in &ty {
                for &(kx, dx) in &tx {
                    taps.push((dy, dx));
                    kk.push((ky, kx));
                }
            }
            let (c, m, kh, kw) = (g.c, g.m, g.kh, g.kw);
            let w = PackedB::pack(kk.len() * c, m, |r, co| {
                let (ky, kx) = kk[r / c];
                let ci = r % c;
                (wv[((ci * m + co) * kh + ky) * kw + kx] - zp(co)) as i16
            });
            out.push(Phase {
                py,
                px,
                ny: count(py, g.oh, g.s[0]),
                nx: count(px, g.ow, g.s[1]),
                taps,
                w,
            });
        }
    }
    out
}

/// One image's input of [`conv_t_products`], in HWC order (`[ih * iw, c]`), so each tap of an
/// output pixel is `c` contiguous values.
#[derive(Clone, Copy)]
enum TapInput<'a> {
    /// `x - zx` as i16 (any layout).
    Wide(&'a [i16]),
    /// The quads kernels' unsigned operand `u = x - zx + off` as bytes (raw u8 codes with
    /// `off = zx`): taps are gathered by byte copies ([`PackedA::pack_bytes_with`]), taps
    /// outside the input are `off` (a zero product term).
    Bytes(&'a [u8], i32),
}

/// Runs the phase products of one image (`xt`, see [`TapInput`]). `sink(phase, sums)`
/// receives the i32 sums `[ny * nx, M]` (row `j * nx + i`) of every phase with outputs.
fn conv_t_products(
    g: &ConvTGeom,
    phases: &[Phase],
    xt: TapInput,
    threads: usize,
    abuf: &mut PackBuf,
    col: &mut Vec<i32>,
    mut sink: impl FnMut(&Phase, &[i32]),
) -> Result<()> {
    let c = g.c;
    for ph in phases {
        let npix = ph.ny * ph.nx;
        if npix == 0 {
            continue;
        }
        let k = ph.taps.len() * c;
        // `igemm` overwrites every sum; only a tapless phase needs explicit zeros.
        grow(col, npix * g.m);
        let col = &mut col[..npix * g.m];
        if k == 0 {
            col.fill(0);
        } else {
            // Pixel rows go in chunks whose gathered taps (about 192 KB) stay in L2 for their
            // product, instead of gathering the whole phase (megabytes) first; at several
            // threads the chunks (gather and product) run in parallel.
            let rows = ((192usize << 10) / (2 * k)).max(1).div_ceil(ROW_ALIGN) * ROW_ALIGN;
            let m = g.m;
            let run = |ci: usize, cchunk: &mut [i32], buf: &mut PackBuf| -> Result<()> {
                let r0 = ci * rows;
                let nr = cchunk.len() / m;
                // The input pixel of tap `t` of phase row `r`, if inside the input.
                let src = |r: usize, t: usize| -> Option<usize> {
                    let r = r0 + r;
                    let (dy, dx) = ph.taps[t];
                    let (iy, ix) = ((r / ph.nx) as isize + dy, (r % ph.nx) as isize + dx);
                    (iy >= 0 && (iy as usize) < g.ih && ix >= 0 && (ix as usize) < g.iw)
                        .then(|| iy as usize * g.iw + ix as usize)
                };
                let a = match xt {
                    TapInput::Wide(xt) => {
                        PackedA::pack_with(std::mem::take(buf), nr, k, |r, row| {
                            for (t, dst) in row.chunks_exact_mut(c).enumerate() {
                                match src(r, t) {
                                    Some(p) => dst.copy_from_slice(&xt[p * c..(p + 1) * c]),
                                    // Outside the input: no contribution.
                                    None => dst.fill(0),
                                }
                            }
                        })
                    }
                    TapInput::Bytes(xt, off) => {
                        PackedA::pack_bytes_with(std::mem::take(buf), nr, k, off, |r, row| {
                            for (t, dst) in row.chunks_exact_mut(c).enumerate() {
                                match src(r, t) {
                                    Some(p) => dst.copy_from_slice(&xt[p * c..(p + 1) * c]),
                                    None => dst.fill(off as u8),
                                }
                            }
                        })
                    }
                };
                let r = igemm(&a, &ph.w, cchunk, 1);
                *buf = a.into_buffer();
                r
            };
            if threads > 1 && npix > rows {
                col.par_chunks_mut(rows * m)
                    .enumerate()
                    .try_for_each(|(ci, cchunk)| {
                        GATHER.with(|b| match b.try_borrow_mut() {
                            Ok(mut b) => run(ci, cchunk, &mut b),
                            Err(_) => run(ci, cchunk, &mut PackBuf::default()),
                        })
                    })?;
            } else {
                for (ci, cchunk) in col.chunks_mut(rows * m).enumerate() {
                    run(ci, cchunk, abuf)?;
                }
            }
        }
        sink(ph, col);
    }
    Ok(())
}

/// `npuc.QConvTranspose(x, x_scale, x_zero_point, w, w_scale, w_zero_point, bias?, y_scale,
/// y_zero_point)`: a 2-D ConvTranspose (group 1, dilations 1, explicit `pads`, `strides`,
/// `output_padding`) of 8-bit activations (per-tensor) and a constant 8-bit weight
/// (per-tensor or per output channel, axis 1), requantized to `y_zero_point`'s dtype. Written
/// by `quant_lower` for `DQ(x), DQ(w) [, bias] -> ConvTranspose -> Q`.
///
/// Each output phase is one exact integer product ([`conv_t_products`], [`igemm`]) of the
/// gathered input taps and the phase's weights; its rows are requantized
/// (`y = sx * sw[m] * acc + bias[m]`) and stored at the phase's output positions.
fn qconv_transpose(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    use crate::ops::conv::{pads_attr, spatial_attr};
    let x = ins.tensor(0)?;
    let sx = f32_scalar(ins.tensor(1)?, "x_scale")?;
    let zx = zp_scalar(ins.opt_tensor(2), "x_zero_point")?;
    let w = ins.tensor(3)?;
    let w_scale = ins.tensor(4)?;
    let w_zp = ins.opt_tensor(5);
    let bias = ins.opt_tensor(6);
    let ys_t = ins.tensor(7)?;
    let yz_t = ins.tensor(8)?;
    if !matches!(x.dtype(), DType::U8 | DType::I8) {
        bail!("x must be u8 or i8, found {}", x.dtype());
    }
    if !(-128..=255).contains(&zx) {
        bail!("x_zero_point {zx} is out of the 8-bit range");
    }
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != 4 || ws.len() != 4 || ws[0] != xs[1] {
        bail!("QConvTranspose needs X [N, C, H, W] and W [C, M, kh, kw], got {xs:?} and {ws:?}");
    }
    if ctx.node.int_or("group", 1)? != 1 {
        bail!("QConvTranspose supports group 1 only");
    }
    let node = ctx.node;
    let s = spatial_attr(node, "strides", 2, 1)?;
    let d = spatial_attr(node, "dilations", 2, 1)?;
    let op = spatial_attr(node, "output_padding", 2, 0)?;
    let (pb, pe) = pads_attr(node, 2)?;
    if s.contains(&0) || d.iter().any(|&v| v != 1) {
        bail!("QConvTranspose needs positive strides and dilations 1");
    }
    let (n, c, ih, iw) = (xs[0], xs[1], xs[2], xs[3]);
    let (m, kh, kw) = (ws[1], ws[2], ws[3]);
    let out_dim = |i: usize, inp: usize, k: usize| -> Result<usize> {
        (s[i] * (inp.max(1) - 1) + op[i] + k)
            .checked_sub(pb[i] + pe[i])
            .ok_or_else(|| RtError::msg("QConvTranspose pads exceed the output size"))
    };
    let (oh, ow) = (out_dim(0, ih, kh)?, out_dim(1, iw, kw)?);
    let ks = kh * kw;
    let (pin, pout) = (ih * iw, oh * ow);
    // Every output sums at most c * kh * kw products: keep that within the exact i32 bound.
    if c * ks > MAX_K {
        bail!("{c} input channels x {ks} taps exceed {MAX_K}, the longest exact i32 reduction");
    }
    let g = ConvTGeom {
        c,
        ih,
        iw,
        m,
        kh,
        kw,
        oh,
        ow,
        s: [s[0], s[1]],
        pb: [pb[0], pb[1]],
    };
    let const_w =
        ctx.input_is_const(3) && ctx.input_is_const(4) && (w_zp.is_none() || ctx.input_is_const(5));
    if !const_w {
        bail!("QConvTranspose needs a constant weight");
    }
    let packed = ctx.cached(|| {
        if !is_8bit(w.dtype()) {
            bail!("the weight must be 8- or 4-bit, found {}", w.dtype());
        }
        let wv = w.to_i64_vec()?;
        let sc: Vec<f32> = w_scale.to_f64_vec()?.iter().map(|&v| v as f32).collect();
        let zs: Vec<i64> = match w_zp {
            Some(z) => z.to_i64_vec()?,
            None => vec![0],
        };
        if (sc.len() != 1 && sc.len() != m) || (zs.len() != 1 && zs.len() != m) {
            bail!("weight scale/zero point must be per-tensor or per output channel ({m})");
        }
        if zs.iter().any(|z| !(-128..=255).contains(z)) {
            bail!("weight zero point is out of the 8-bit range");
        }
        let zp = |co: usize| if zs.len() == 1 { zs[0] } else { zs[co] };
        let phases = conv_t_phases(&g, &wv, zp);
        let scale = if sc.len() == 1 { vec![sc[0]; m] } else { sc };
        Ok(PackedConvT { phases, scale })
    })?;
    let bias: Vec<f32> = match bias {
        Some(t) => {
            let v: Vec<f32> = t.to_f64_vec()?.iter().map(|&b| b as f32).collect();
            if v.len() != m {
                bail!("bias has {} values, {m} expected", v.len());
            }
            v
        }
        None => vec![0.0; m],
    };
    let ys = f32_scalar(ys_t, "y_scale")?;
    if !(ys > 0.0 && ys.is_finite()) {
        bail!("y_scale must be positive and finite, found {ys}");
    }
    let yz = zp_scalar(Some(yz_t), "y_zero_point")?;
    let (lo, hi) = qrange(yz_t.dtype())?;
    let mult: Vec<f32> = packed.scale.iter().map(|&sw| sx * sw).collect();
    let isa = Isa::detect();
    let mut scratch = take_scratch();
    let mut col = std::mem::take(&mut scratch.acc);
    let mut abuf = std::mem::take(&mut scratch.a16);
    let total = n * m * pout;
    let mut out_u8: Vec<u8> = vec![];
    let mut out_i8: Vec<i8> = vec![];
    match yz_t.dtype() {
        DType::U8 => out_u8 = crate::buffers::zeroed(total),
        DType::I8 => out_i8 = crate::buffers::zeroed(total),
        other => bail!("QConvTranspose output must be u8 or i8, found {other}"),
    }
    let mut xt = std::mem::take(&mut scratch.xt);
    // The quads kernels read 8-bit codes as their unsigned operand directly: u8 codes with
    // offset zx, i8 codes shifted by 128 with offset zx + 128 (both within a byte for codes
    // and zero points of the input's type).
    let byte_off = match x.dtype() {
        DType::U8 => zx,
        _ => zx + 128,
    };
    let bytes = Layout::active() == Layout::Quads && (0..=255).contains(&byte_off);
    let mut xb: Vec<u8> = vec![];
    if bytes {
        xb = crate::buffers::for_overwrite(pin * c);
    } else {
        xt.resize(pin * c, 0);
    }
    let mut tmp_u8: Vec<u8> = vec![];
    let mut tmp_i8: Vec<i8> = vec![];
    for ni in 0..n {
        let xr = ni * c * pin..(ni + 1) * c * pin;
        match (x.dtype(), bytes) {
            (DType::U8, true) => to_hwc_bytes(&x.as_slice::<u8>()?[xr], c, pin, |v| v, &mut xb),
            (_, true) => to_hwc_bytes(
                &x.as_slice::<i8>()?[xr],
                c,
                pin,
                |v| (v as u8) ^ 0x80,
                &mut xb,
            ),
            (DType::U8, false) => to_hwc(&x.as_slice::<u8>()?[xr], c, pin, zx, &mut xt),
            _ => to_hwc(&x.as_slice::<i8>()?[xr], c, pin, zx, &mut xt),
        }
        let input = if bytes {
            TapInput::Bytes(&xb, byte_off)
        } else {
            TapInput::Wide(&xt)
        };
        let base = ni * m * pout;
        let sink = |ph: &Phase, sums: &[i32]| {
            // One output row of the phase at a time: its pixels' channel vectors are
            // requantized into a small pixel-major block, then written plane by plane, so
            // each channel plane receives one burst instead of one byte per pixel (writing
            // every pixel's M channels straight to M planes touched M pages per pixel).
            for (j, block) in sums.chunks_exact(ph.nx * m).enumerate() {
                let o = base + (ph.py + g.s[0] * j) * ow + ph.px;
                let rq = (&mult[..], &bias[..], 1.0 / ys, yz, (lo, hi));
                if yz_t.dtype() == DType::U8 {
                    requant_scatter(
                        isa,
                        block,
                        m,
                        rq,
                        &mut tmp_u8,
                        &mut out_u8[o..],
                        pout,
                        g.s[1],
                    );
                } else {
                    requant_scatter(
                        isa,
                        block,
                        m,
                        rq,
                        &mut tmp_i8,
                        &mut out_i8[o..],
                        pout,
                        g.s[1],
                    );
                }
            }
        };
        conv_t_products(
            &g,
            &packed.phases,
            input,
            ctx.threads,
            &mut abuf,
            &mut col,
            sink,
        )?;
    }
    crate::buffers::release(xb);
    give_scratch(Scratch {
        acc: col,
        acc_lo: scratch.acc_lo,
        a16: abuf,
        xt,
    });
    let shape = vec![n, m, oh, ow];
    let t = match yz_t.dtype() {
        DType::U8 => Tensor::from_vec(shape, out_u8)?,
        _ => Tensor::from_vec(shape, out_i8)?,
    };
    Ok(vec![Value::tensor(t)])
}

/// Requantizes the channel sums of one output row's pixels (`sums`: pixel-major, `m` per
/// pixel) into `tmp` and stores them into the NCHW output: pixel `i`, channel `co` goes to
/// `out[co * plane + i * step]` (`out` starts at the row's first pixel of the phase).
#[allow(clippy::too_many_arguments)]
fn requant_scatter<T: QInt>(
    isa: Isa,
    sums: &[i32],
    m: usize,
    (mult, bias, inv_ys, zp, range): (&[f32], &[f32], f32, i32, (i32, i32)),
    tmp: &mut Vec<T>,
    out: &mut [T],
    plane: usize,
    step: usize,
) {
    let npx = sums.len() / m;
    tmp.resize(sums.len(), T::default());
    for (srow, trow) in sums.chunks_exact(m).zip(tmp.chunks_exact_mut(m)) {
        qconvert::requant_row(isa, srow, None, mult, bias, inv_ys, zp, range, trow);
    }
    for co in 0..m {
        let dst = &mut out[co * plane..];
        for i in 0..npx {
            dst[i * step] = tmp[i * m + co];
        }
    }
}

/// The per-plan packed weights of a [`qconv_transpose`] node.
struct PackedConvT {
    phases: Vec<Phase>,
    /// Per output channel weight scale (length M).
    scale: Vec<f32>,
}

/// `x [c, pin]` (CHW) as bytes `f(x)`, transposed to HWC `[pin, c]` in `dst`.
fn to_hwc_bytes<T: Copy>(x: &[T], c: usize, pin: usize, f: impl Fn(T) -> u8, dst: &mut [u8]) {
    for (ci, plane) in x.chunks_exact(pin).take(c).enumerate() {
        for (p, &v) in plane.iter().enumerate() {
            dst[p * c + ci] = f(v);
        }
    }
}

/// `x [c, pin]` (CHW) minus its zero point, transposed to HWC `[pin, c]` in `dst`.
fn to_hwc<T: Copy + Into<i32>>(x: &[T], c: usize, pin: usize, zx: i32, dst: &mut [i16]) {
    for (ci, plane) in x.chunks_exact(pin).take(c).enumerate() {
        for (p, &v) in plane.iter().enumerate() {
            dst[p * c + ci] = (v.into() - zx) as i16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocked per-column lookups equal one lookup per value through its column's table, for
    /// column counts around the block size, and one shared table for every column.
    #[test]
    fn lut_rows_matches_per_value_lookup() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u8
        };
        for (rows, n) in [(1, 1), (3, 31), (5, 32), (4, 33), (7, 100), (2, 1536)] {
            let vals: Vec<u8> = (0..rows * n).map(|_| next()).collect();
            let per_col: Vec<u8> = (0..n * 256).map(|_| next()).collect();
            let mut got = vals.clone();
            lut_rows(&mut got, n, &per_col);
            let want: Vec<u8> = vals
                .iter()
                .enumerate()
                .map(|(i, &v)| per_col[(i % n) * 256 + v as usize])
                .collect();
            assert_eq!(got, want, "{rows}x{n} per-column");
            let shared = &per_col[..256];
            let mut got = vals.iter().map(|&v| v as i8).collect::<Vec<i8>>();
            let shared_i8: Vec<i8> = shared.iter().map(|&v| v as i8).collect();
            lut_rows(&mut got, n, &shared_i8);
            let want: Vec<i8> = vals
                .iter()
                .map(|&v| shared_i8[(v as i8 as i32 - i8::LO) as usize])
                .collect();
            assert_eq!(got, want, "{rows}x{n} shared");
        }
    }

    /// Direct i64 transposed convolution: `acc[co, oy, ox] = sum x'[ci, iy, ix] * w'[ci, co, ky, kx]`
    /// over `oy = iy * sy + ky - pby`, `ox = ix * sx + kx - pbx`.
    fn direct(g: &ConvTGeom, x: &[i16], w: &[i64]) -> Vec<i64> {
        let mut acc = vec![0i64; g.m * g.oh * g.ow];
        for ci in 0..g.c {
            for iy in 0..g.ih {
                for ix in 0..g.iw {
                    let xv = x[(ci * g.ih + iy) * g.iw + ix] as i64;
                    for co in 0..g.m {
                        for ky in 0..g.kh {
                            for kx in 0..g.kw {
                                let oy = (iy * g.s[0] + ky) as isize - g.pb[0] as isize;
                                let ox = (ix * g.s[1] + kx) as isize - g.pb[1] as isize;
                                if oy < 0 || ox < 0 || oy as usize >= g.oh || ox as usize >= g.ow {
                                    continue;
                                }
                                let wv = w[((ci * g.m + co) * g.kh + ky) * g.kw + kx];
                                acc[(co * g.oh + oy as usize) * g.ow + ox as usize] += xv * wv;
                            }
                        }
                    }
                }
            }
        }
        acc
    }

    /// The phase products cover every output exactly once and equal the direct sums, for
    /// strides 1-3, kernels 1-4, asymmetric pads and output padding (even kernels smaller than
    /// the stride, where some phases have no taps), with 1 and 2 threads, from i16 taps and (in
    /// the quads layout) from byte codes with a zero point.
    #[test]
    fn phase_products_match_direct_sums() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let (mut ran, mut chunked) = (0, 0);
        for case in 0..66 {
            // The last cases have hundreds of channels and more pixels per phase than one
            // gather chunk holds (~192 KB of taps), so the chunked path is covered too.
            let big = case >= 60;
            let (s0, s1) = (1 + next(3), 1 + next(3));
            let (kh, kw) = (1 + next(4), 1 + next(4));
            let (ih, iw) = if big {
                (10 + next(5), 10 + next(6))
            } else {
                (1 + next(5), 1 + next(6))
            };
            let (c, m) = if big {
                (300 + next(60), 1 + next(20))
            } else {
                (1 + next(9), 1 + next(20))
            };
            let (opy, opx) = (next(s0), next(s1));
            let full = |i: usize, s: usize, k: usize, op: usize| s * (i - 1) + op + k;
            let (fh, fw) = (full(ih, s0, kh, opy), full(iw, s1, kw, opx));
            let (pby, pey) = (next(kh), next(kh));
            let (pbx, pex) = (next(kw), next(kw));
            if pby + pey >= fh || pbx + pex >= fw {
                continue;
            }
            let g = ConvTGeom {
                c,
                ih,
                iw,
                m,
                kh,
                kw,
                oh: fh - pby - pey,
                ow: fw - pbx - pex,
                s: [s0, s1],
                pb: [pby, pbx],
            };
            // Extremes of zero-point-corrected 8-bit operands.
            let x: Vec<i16> = (0..c * ih * iw)
                .map(|i| {
                    if i % 5 == 0 {
                        255
                    } else {
                        next(511) as i16 - 255
                    }
                })
                .collect();
            let w: Vec<i64> = (0..c * m * kh * kw)
                .map(|i| {
                    if i % 7 == 0 {
                        -128
                    } else {
                        next(256) as i64 - 128
                    }
                })
                .collect();
            let want = direct(&g, &x, &w);
            let phases = conv_t_phases(&g, &w, |_| 0);
            let hwc = |v: &[i16]| {
                let mut t = vec![0i16; ih * iw * c];
                for ci in 0..c {
                    for p in 0..ih * iw {
                        t[p * c + ci] = v[ci * ih * iw + p];
                    }
                }
                t
            };
            let xt = hwc(&x);
            // The byte form (quads layout only): raw 8-bit codes and their zero point, the
            // corrected values `code - zx` as the reference.
            let zx = next(256) as i32;
            let codes: Vec<u8> = (0..c * ih * iw)
                .map(|i| if i % 6 == 0 { 255 } else { next(256) as u8 })
                .collect();
            let corrected: Vec<i16> = codes.iter().map(|&u| (u as i32 - zx) as i16).collect();
            let want_bytes = direct(&g, &corrected, &w);
            let xb: Vec<u8> = hwc(&codes.iter().map(|&u| u as i16).collect::<Vec<_>>())
                .iter()
                .map(|&v| v as u8)
                .collect();
            let mut inputs = vec![(TapInput::Wide(&xt), &want)];
            if Layout::active() == Layout::Quads {
                inputs.push((TapInput::Bytes(&xb, zx), &want_bytes));
            }
            for (input, want) in inputs {
                for threads in [1, 2] {
                    let mut got = vec![i64::MIN; g.m * g.oh * g.ow];
                    let (mut abuf, mut col) = (PackBuf::default(), Vec::new());
                    conv_t_products(
                        &g,
                        &phases,
                        input,
                        threads,
                        &mut abuf,
                        &mut col,
                        |ph, sums| {
                            for (r, row) in sums.chunks_exact(g.m).enumerate() {
                                let oy = ph.py + g.s[0] * (r / ph.nx);
                                let ox = ph.px + g.s[1] * (r % ph.nx);
                                for (co, &v) in row.iter().enumerate() {
                                    let slot = &mut got[(co * g.oh + oy) * g.ow + ox];
                                    assert_eq!(*slot, i64::MIN, "output written twice");
                                    *slot = v as i64;
                                }
                            }
                        },
                    )
                    .unwrap();
                    let form = if matches!(input, TapInput::Wide(_)) {
                        "i16"
                    } else {
                        "bytes"
                    };
                    assert_eq!(&got, want, "case {case} ({form}): {g:?}, {threads} threads");
                }
            }
            ran += 1;
            let kmax = phases.iter().map(|p| p.taps.len() * c).max().unwrap_or(0);
            let npix = phases.iter().map(|p| p.ny * p.nx).max().unwrap_or(0);
            if kmax > 0
                && npix > ((192usize << 10) / (2 * kmax)).max(1).div_ceil(ROW_ALIGN) * ROW_ALIGN
            {
                chunked += 1;
            }
        }
        assert!(ran >= 20, "only {ran} geometries were valid");
        assert!(
            chunked >= 2,
            "only {chunked} geometries had several gather chunks"
        );
    }
}
