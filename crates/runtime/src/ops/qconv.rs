//! `npuc.QConv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, bias?, y_scale, y_zero_point)`:
//! a 2-D convolution of 8-bit activations (per-tensor scale and zero point) and a constant 8-bit
//! weight (per-tensor or per output channel), requantized to `y_zero_point`'s 8-bit dtype.
//! Written by `quant_lower` (npuc-passes) for `DQ(x), DQ(w) [, bias] -> Conv -> Q`, the form
//! onnxruntime's `quantize_static` gives every convolution of a CNN.
//!
//! `y[m, p] = q(sx * sw[m] * sum_k (x - zx)(w - zw[m]) + bias[m])` with the sum exact in i32 and
//! `q(v) = clamp(round_half_even(v / sy) + zy)`: the integer form of the QDQ graph, which runs
//! its convolution in f32 over the dequantized values (equal to one output step, the float
//! rounding of that product being the only difference).
//!
//! Two kernels:
//! - group 1: one exact integer product per image, `W'[M x K] * cols[K x P]` ([`igemm_then`],
//!   VNNI `vpdpbusd` where the CPU has it) with `K = C * kh * kw` and `P` output pixels; the
//!   columns are the input itself for a 1x1 stride-1 unpadded convolution, else an im2col of
//!   the zero-point-corrected input (padding is the real value 0, i.e. the integer 0). The
//!   weight is the left operand so the sums come out channel-major: the NCHW output rows, each
//!   requantized with its channel's scale while still in cache.
//! - depthwise (`group == C`, `M` a multiple of `C`): per channel a direct sum over the taps
//!   ([`idwconv`]); a filter of `kh * kw` weights is too small for a matrix product to pay.
//!
//! `table` (optional): a fused `npuc.QLut` of the output's dtype, one 256-entry table for every
//! channel (`[256]`) or one per output channel (`[M, 256]`), applied to each requantized code
//! (`table[code - lowest code]`): the elementwise region after a convolution (its bias Add, an
//! activation) that `quant_lower` turns into a lookup, run while the plane is in cache.
//!
//! Attributes: Conv's `strides`, `pads`, `dilations`, `auto_pad`, `group`.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, MAX_OPSET};
use crate::kernels::idwconv::{self, DwGeom};
use crate::kernels::igemm::{igemm_then, Layout, PackedA, PackedB, MAX_K};
use crate::kernels::lut8;
use crate::kernels::qconvert::{self, Isa, QInt};
use crate::ops::conv::{conv_geom, valid_range, Geom};
use crate::ops::qlinear::{f32_scalar, is_8bit, qrange, zp_scalar};
use crate::value::Value;
use npuc_ir::infer::onnx_rule;
use npuc_ir::opdef::{AttrDef, OpDef, Param};
use npuc_ir::{DType, Tensor, TypeInfo};
use rayon::prelude::*;

/// `npuc.QConv` (see the module docs): Conv's shape of `x` and `w`, `y_zero_point`'s dtype.
pub static QCONV: OpDef = OpDef {
    domain: "npuc",
    name: "QConv",
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
        Param::optional("table"),
    ],
    outputs: &[Param::required("y")],
    attrs: &[
        AttrDef::optional("strides", "ints"),
        AttrDef::optional("pads", "ints"),
        AttrDef::optional("dilations", "ints"),
        AttrDef::optional("auto_pad", "string"),
        AttrDef::optional("group", "int"),
        AttrDef::optional("kernel_shape", "ints"),
    ],
    infer: |n| {
        let mut conv = n.node.clone();
        conv.op_type = "Conv".into();
        conv.domain = String::new();
        conv.inputs = [0, 3]
            .iter()
            .map(|&i| n.node.input(i).unwrap_or_default().to_string())
            .collect();
        let view = n.derived(&conv, MAX_OPSET, &[Some(0), Some(3)]);
        let mut tys = onnx_rule(&view)?;
        if let Some(TypeInfo::Tensor { dtype, .. }) = tys.first_mut() {
            *dtype = n.dt(8);
        }
        Ok(tys)
    },
};

/// Output pixels per parallel task of the depthwise kernel (below this, one thread).
const DW_PAR_WORK: usize = 1 << 16;

/// A node's weight, zero-point corrected and laid out once per plan.
struct QConvWeight {
    body: WeightBody,
    /// Per output channel weight scale (length M).
    scale: Vec<f32>,
}

enum WeightBody {
    /// Group 1: `W'[M x C*kh*kw]` packed as the left operand of the integer product.
    Dense(PackedA),
    /// Depthwise: per output channel its `kh * kw` corrected taps.
    Depthwise(Vec<f32>),
}

/// `npuc.QConv` (see the module docs).
pub fn qconv(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let sx = f32_scalar(ins.tensor(1)?, "x_scale")?;
    let zx = zp_scalar(ins.opt_tensor(2), "x_zero_point")?;
    let w = ins.tensor(3)?;
    let w_scale = ins.tensor(4)?;
    let w_zp = ins.opt_tensor(5);
    let y_dtype = ins.tensor(8)?.dtype();
    if !matches!(x.dtype(), DType::U8 | DType::I8) {
        bail!("QConv: x must be u8 or i8, found {}", x.dtype());
    }
    if !(-128..=255).contains(&zx) {
        bail!("QConv: x_zero_point {zx} is out of the 8-bit range");
    }
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != 4 || ws.len() != 4 {
        bail!("QConv needs 2-D images: X [N, C, H, W] and W [M, C/group, kh, kw], got {xs:?} and {ws:?}");
    }
    let (n, c, m) = (xs[0], xs[1], ws[0]);
    let group = ctx.node.int_or("group", 1)?;
    let depthwise = group != 1 && group as usize == c && ws[1] == 1 && m % c.max(1) == 0;
    if !(depthwise || group == 1 && ws[1] == c) {
        bail!(
            "QConv supports group 1 and depthwise (group = channels) convolutions; got group {group} \
             with X {xs:?} and W {ws:?}"
        );
    }
    let geom = conv_geom(ctx.node, &xs[2..], &ws[2..])?;
    let taps = ws[2] * ws[3];
    let k = if depthwise { taps } else { c * taps };
    if depthwise && taps > idwconv::MAX_TAPS || !depthwise && k > MAX_K {
        bail!("QConv: a reduction over {k} values exceeds the longest exact i32 sum");
    }
    let const_w =
        ctx.input_is_const(3) && ctx.input_is_const(4) && (w_zp.is_none() || ctx.input_is_const(5));
    if !const_w {
        bail!("QConv needs a constant weight");
    }
    // The output stage depends on the scales, zero points, bias and table only: built once
    // per plan with the weight when they are all constants (the usual case), else per run.
    let rq_inputs = [1, 2, 6, 7, 8, 9];
    let rq_const = rq_inputs
        .iter()
        .all(|&i| ins.opt_tensor(i).is_none() || ctx.input_is_const(i));
    let plan = ctx.cached(|| {
        let weight = pack_weight(w, w_scale, w_zp, m, k, depthwise)?;
        let rq = if rq_const {
            Some(requant(&ins, sx, m, &weight.scale)?)
        } else {
            None
        };
        Ok(QConvPlan { weight, rq })
    })?;
    let per_run;
    let rq = match &plan.rq {
        Some(rq) => rq,
        None => {
            per_run = requant(&ins, sx, m, &plan.weight.scale)?;
            &per_run
        }
    };
    let job = Job {
        geom: &geom,
        n,
        c,
        m,
        zx,
        threads: ctx.threads.max(1),
        weight: &plan.weight.body,
        rq,
    };
    let shape = vec![n, m, geom.out[1], geom.out[2]];
    let t = match (x.dtype(), y_dtype) {
        (DType::U8, DType::U8) => Tensor::from_vec(shape, job.run::<u8, u8>(x.as_slice()?)?)?,
        (DType::U8, DType::I8) => Tensor::from_vec(shape, job.run::<u8, i8>(x.as_slice()?)?)?,
        (DType::I8, DType::U8) => Tensor::from_vec(shape, job.run::<i8, u8>(x.as_slice()?)?)?,
        (DType::I8, DType::I8) => Tensor::from_vec(shape, job.run::<i8, i8>(x.as_slice()?)?)?,
        (_, other) => bail!("QConv output must be u8 or i8, found {other}"),
    };
    Ok(vec![Value::tensor(t)])
}

/// The node's constant data, built on its first run (see [`OpCtx::cached`]).
struct QConvPlan {
    weight: QConvWeight,
    /// The output stage when every input it reads is a constant.
    rq: Option<Requant>,
}

/// The output stage from inputs 6 (bias), 7 and 8 (`y_scale`, `y_zero_point`) and 9 (table),
/// with `mult[m] = sx * w_scale[m]`.
fn requant(ins: &Inputs, sx: f32, m: usize, w_scale: &[f32]) -> Result<Requant> {
    let bias: Vec<f32> = match ins.opt_tensor(6) {
        Some(t) => {
            let v: Vec<f32> = t.to_f64_vec()?.iter().map(|&b| b as f32).collect();
            if v.len() != m {
                bail!("QConv: bias has {} values, {m} expected", v.len());
            }
            v
        }
        None => vec![0.0; m],
    };
    let (ys_t, yz_t) = (ins.tensor(7)?, ins.tensor(8)?);
    let ys = f32_scalar(ys_t, "y_scale")?;
    if !(ys > 0.0 && ys.is_finite()) {
        bail!("QConv: y_scale must be positive and finite, found {ys}");
    }
    let yz = zp_scalar(Some(yz_t), "y_zero_point")?;
    let range = qrange(yz_t.dtype())?;
    let table = match ins.opt_tensor(9) {
        None => None,
        Some(t) => {
            if t.dtype() != yz_t.dtype() || !(t.len() == 256 || t.len() == 256 * m) {
                bail!(
                    "QConv: the table must be {} with 256 or {m} x 256 values, found {} {:?}",
                    yz_t.dtype(),
                    t.dtype(),
                    t.shape()
                );
            }
            // As bytes (the 8-bit codes' bits), one 256-entry table per row.
            let v: Vec<u8> = t.to_i64_vec()?.iter().map(|&v| v as u8).collect();
            Some(
                v.chunks_exact(256)
                    .map(|r| <[u8; 256]>::try_from(r).expect("256-value rows"))
                    .collect(),
            )
        }
    };
    Ok(Requant {
        mult: w_scale.iter().map(|&sw| sx * sw).collect(),
        bias,
        inv_ys: 1.0 / ys,
        zp: yz,
        range,
        table,
    })
}

fn pack_weight(
    w: &Tensor,
    w_scale: &Tensor,
    w_zp: Option<&Tensor>,
    m: usize,
    k: usize,
    depthwise: bool,
) -> Result<QConvWeight> {
    if !is_8bit(w.dtype()) || matches!(w.dtype(), DType::U4 | DType::I4) {
        bail!("QConv: the weight must be u8 or i8, found {}", w.dtype());
    }
    if w.len() != m * k {
        bail!("QConv: the weight has {} values, {m}x{k} expected", w.len());
    }
    let wv = w.to_i64_vec()?;
    let sc: Vec<f32> = w_scale.to_f64_vec()?.iter().map(|&v| v as f32).collect();
    let zs: Vec<i64> = match w_zp {
        Some(z) => z.to_i64_vec()?,
        None => vec![0],
    };
    if (sc.len() != 1 && sc.len() != m) || (zs.len() != 1 && zs.len() != m) {
        bail!("QConv: weight scale/zero point must be per-tensor or per output channel ({m})");
    }
    if zs.iter().any(|z| !(-128..=255).contains(z)) {
        bail!("QConv: weight zero point is out of the 8-bit range");
    }
    let zp = |co: usize| if zs.len() == 1 { zs[0] } else { zs[co] };
    let corrected = |i: usize| (wv[i] - zp(i / k.max(1))) as i16;
    let body = if depthwise {
        WeightBody::Depthwise((0..m * k).map(|i| corrected(i) as f32).collect())
    } else {
        WeightBody::Dense(PackedA::pack(m, k, |r, col| corrected(r * k + col)))
    };
    let scale = if sc.len() == 1 { vec![sc[0]; m] } else { sc };
    Ok(QConvWeight { body, scale })
}

/// The output stage: `q = clamp(round_half_even((acc * mult[m] + bias[m]) * inv_ys) + zp)`.
struct Requant {
    mult: Vec<f32>,
    bias: Vec<f32>,
    inv_ys: f32,
    zp: i32,
    range: (i32, i32),
    /// The fused lookup (see the module docs) as the output codes' bytes: one table, or one
    /// per channel.
    table: Option<Vec<[u8; 256]>>,
}

impl Requant {
    /// Requantizes output channel `co`'s sums (one NCHW plane, or part of one) into `out`.
    fn plane<T: QInt>(&self, isa: Isa, co: usize, sums: &[i32], out: &mut [T]) {
        // `requant_row` takes per-column parameters; a plane has one channel's throughout.
        let mult = [self.mult[co]; 256];
        let bias = [self.bias[co]; 256];
        for (s, o) in sums.chunks(256).zip(out.chunks_mut(256)) {
            qconvert::requant_row(
                isa,
                s,
                None,
                &mult,
                &bias,
                self.inv_ys,
                self.zp,
                self.range,
                o,
            );
        }
        if let Some(tab) = &self.table {
            let row = if tab.len() == 1 { &tab[0] } else { &tab[co] };
            // i8 codes index their table from the lowest code: `code + 128`, the byte with
            // its top bit flipped.
            let flip = if T::LO < 0 { 0x80 } else { 0 };
            let bytes = T::bytes_mut(out).expect("QConv writes 8-bit codes");
            lut8::lut8(row, flip, bytes);
        }
    }
}

/// Everything one QConv run needs.
struct Job<'a> {
    geom: &'a Geom,
    n: usize,
    c: usize,
    m: usize,
    zx: i32,
    threads: usize,
    weight: &'a WeightBody,
    rq: &'a Requant,
}

impl Job<'_> {
    fn run<X: QInt, T: QInt>(&self, x: &[X]) -> Result<Vec<T>> {
        let g = self.geom;
        let (pin, pout) = (g.inp[1] * g.inp[2], g.out[1] * g.out[2]);
        // Every output value is written (each channel's plane by its requantization).
        let mut out: Vec<T> = crate::buffers::for_overwrite(self.n * self.m * pout);
        if out.is_empty() {
            return Ok(out);
        }
        if self.c * pin == 0 {
            bail!(
                "QConv: the input has no values per image (shape [N, {}, {}, {}])",
                self.c,
                g.inp[1],
                g.inp[2]
            );
        }
        for (xi, oi) in x
            .chunks_exact(self.c * pin)
            .zip(out.chunks_exact_mut(self.m * pout))
        {
            match self.weight {
                WeightBody::Dense(a) => self.dense(a, xi, oi)?,
                WeightBody::Depthwise(taps) => self.depthwise(taps, xi, oi),
            }
        }
        Ok(out)
    }

    /// Group 1, one image: `out[M x P]` from the integer product of the packed weight and
    /// the image's columns.
    fn dense<X: QInt, T: QInt>(&self, a: &PackedA, x: &[X], out: &mut [T]) -> Result<()> {
        let g = self.geom;
        let (c, zx) = (self.c, self.zx);
        let pout = g.out[1] * g.out[2];
        let [_, kh, kw] = g.k;
        let k = c * kh * kw;
        let pointwise =
            kh == 1 && kw == 1 && g.s[1..] == [1, 1] && g.pb[1..] == [0, 0] && g.pe[1..] == [0, 0];
        let b = if pointwise {
            PackedB::pack_rows_par(
                Layout::active(),
                k,
                pout,
                x,
                |v: X| (v.to_i32() - zx) as i16,
                self.threads,
            )
        } else {
            // `im2col` writes every value.
            let mut col: Vec<i16> = crate::buffers::for_overwrite(k * pout);
            im2col(x, g, c, zx, &mut col);
            let b = PackedB::pack_rows_par(Layout::active(), k, pout, &col, |v| v, self.threads);
            crate::buffers::release(col);
            b
        };
        // The product overwrites every sum; the buffer goes back to the pool after.
        let mut sums: Vec<i32> = crate::buffers::for_overwrite(self.m * pout);
        let isa = Isa::detect();
        let base = out.as_ptr() as usize;
        let rq = self.rq;
        // `igemm_then` hands over whole output rows (channels) in order; a chunk's first
        // channel is its offset from the start of the image's output.
        let epi = |s: &[i32], o: &mut [T]| {
            let co0 = (o.as_ptr() as usize - base) / std::mem::size_of::<T>() / pout;
            for (j, (sr, or)) in s
                .chunks_exact(pout)
                .zip(o.chunks_exact_mut(pout))
                .enumerate()
            {
                rq.plane(isa, co0 + j, sr, or);
            }
        };
        let done = igemm_then(a, &b, &mut sums, out, self.threads, &epi);
        crate::buffers::release(sums);
        done
    }

    /// Depthwise, one image: every output channel from its input channel's padded plane.
    fn depthwise<X: QInt, T: QInt>(&self, taps: &[f32], x: &[X], out: &mut [T]) {
        let g = self.geom;
        let (ih, iw) = (g.inp[1], g.inp[2]);
        let (oh, ow) = (g.out[1], g.out[2]);
        let [_, kh, kw] = g.k;
        let dg = DwGeom {
            kh,
            kw,
            sh: g.s[1],
            sw: g.s[2],
            dh: g.d[1],
            dw: g.d[2],
            oh,
            ow,
        };
        // The padded plane: the rows and columns the kernel reads (the end padding may be
        // larger than what it reaches, or cut rows the strides never reach), phase-split for
        // the width stride (see `idwconv`).
        let pwq = idwconv::phase_width(&dg);
        let (pt, pl) = (g.pb[1], g.pb[2]);
        let mult = self.m / self.c;
        let pout = oh * ow;
        let ntaps = kh * kw;
        let isa = Isa::detect();
        let run = |co0: usize, o: &mut [T]| {
            let mut plane = vec![0f32; idwconv::plane_len(&dg, pwq)];
            let mut sums = vec![0i32; pout];
            let mut filled = usize::MAX;
            for (j, oc) in o.chunks_exact_mut(pout).enumerate() {
                let co = co0 + j;
                let ci = co / mult;
                if ci != filled {
                    let src = &x[ci * ih * iw..(ci + 1) * ih * iw];
                    idwconv::fill_plane(src, (ih, iw), (pt, pl), self.zx, &dg, pwq, &mut plane);
                    filled = ci;
                }
                idwconv::dw_plane(
                    &plane,
                    pwq,
                    &taps[co * ntaps..(co + 1) * ntaps],
                    &dg,
                    &mut sums,
                );
                self.rq.plane(isa, co, &sums, oc);
            }
        };
        let work = self.m * pout * ntaps;
        if self.threads > 1 && work >= DW_PAR_WORK && self.m > 1 {
            let per = self.m.div_ceil(self.threads);
            out.par_chunks_mut(per * pout)
                .enumerate()
                .for_each(|(i, o)| run(i * per, o));
        } else {
            run(0, out);
        }
    }
}

/// im2col of one image for a group-1 convolution: `col[K x P]`, row `(ci * kh + ky) * kw + kx`
/// holding, for every output pixel, the zero-point-corrected input value under that tap (0
/// where the tap falls on padding).
fn im2col<X: QInt>(x: &[X], g: &Geom, c: usize, zx: i32, col: &mut [i16]) {
    let (ih, iw) = (g.inp[1], g.inp[2]);
    let (oh, ow) = (g.out[1], g.out[2]);
    let [_, kh, kw] = g.k;
    let (sh, sw, dh, dw) = (g.s[1], g.s[2], g.d[1], g.d[2]);
    let (pt, pl) = (g.pb[1] as isize, g.pb[2] as isize);
    let pout = oh * ow;
    let mut rows = col.chunks_exact_mut(pout);
    for ci in 0..c {
        let plane = &x[ci * ih * iw..(ci + 1) * ih * iw];
        for ky in 0..kh {
            for kx in 0..kw {
                let Some(dst) = rows.next() else { return };
                let xoff = (kx * dw) as isize - pl;
                let (lo, hi) = valid_range(ow, sw, xoff, iw);
                for (oy, drow) in dst.chunks_exact_mut(ow).enumerate() {
                    let iy = (oy * sh + ky * dh) as isize - pt;
                    if iy < 0 || iy >= ih as isize || lo >= hi {
                        drow.fill(0);
                        continue;
                    }
                    let srow = &plane[iy as usize * iw..(iy as usize + 1) * iw];
                    drow[..lo].fill(0);
                    for (ox, d) in drow[lo..hi].iter_mut().enumerate() {
                        let ix = ((lo + ox) * sw) as isize + xoff;
                        *d = (srow[ix as usize].to_i32() - zx) as i16;
                    }
                    drow[hi..].fill(0);
                }
            }
        }
    }
}
