//! Channels-last (NHWC) convolutions, produced by the `layout-nhwc` pass of `npuc-passes`:
//!
//! - `npuc.ConvNhwc(X, W[, B])`: ONNX Conv (2-D; `group` 1 or depthwise) with `X` and `Y` in
//!   NHWC (`[N, H, W, C]` in, `[N, OH, OW, M]` out); `W` stays in the ONNX layout
//!   `[M, C/group, KH, KW]` and is re-packed once per plan (cached) into the layout the kernels
//!   read. Conv's attributes plus the fused-activation attributes of `npuc.FusedConv`
//!   (`activation`, `activation_params`); bias and activation are applied while the output
//!   rows are still in cache.
//! - `npuc.GlobalAveragePoolNhwc(X)`: GlobalAveragePool of an NHWC tensor (`[N, 1, 1, C]`).
//! - `npuc.ConvTransposeNhwc(X, W[, B])`: see [`super::deconv_nhwc`].
//!
//! Why NHWC pays on a CPU: a 1x1 conv is a plain GEMM `[N*H*W, C] x [C, M]` (as in NCHW), a
//! KxK conv's im2col copies contiguous runs of `C` channels instead of single pixels, and a
//! depthwise conv vectorises over channels with contiguous loads (see
//! [`crate::kernels::conv_nhwc`]) instead of walking short spatial rows per channel.

use super::{conv_geom, Geom, PAR_MIN};
use crate::bail;
use crate::error::Result;
use crate::kernel::MAX_OPSET;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::kernels::conv_nhwc::{dw_row, dw_row_cols, DwGeom};
use crate::kernels::sgemm::{self, PackedB, View};
use crate::ops::fused::ACTIVATION_ATTRS;
use crate::ops::fused::{apply_f32, Act};
use crate::ops::matmul::{gemm_into, Mat};
use crate::value::Value;
use npuc_ir::infer::rules::tt;
use npuc_ir::infer::{onnx_rule, NodeIn, R};
use npuc_ir::opdef::{OpDef, Param};
use npuc_ir::{DType, Dim, Tensor, TypeInfo};
use npuc_isa::Isa;
use rayon::prelude::*;

pub fn register(r: &mut Registry) {
    r.define(&CONV_NHWC, conv_nhwc);
    r.define(&GLOBAL_AVERAGE_POOL_NHWC, gap_nhwc);
    r.define(
        &super::deconv_nhwc::CONV_TRANSPOSE_NHWC,
        super::deconv_nhwc::conv_transpose_nhwc,
    );
}

/// `npuc.ConvNhwc` (see the module docs): Conv's attributes plus the fused activation.
pub static CONV_NHWC: OpDef = OpDef {
    domain: "npuc",
    name: "ConvNhwc",
    inputs: &[
        Param::required("X"),
        Param::required("W"),
        Param::optional("B"),
    ],
    outputs: &[Param::required("Y")],
    attrs: ACTIVATION_ATTRS,
    infer: infer_conv_nhwc,
};

/// Conv's rule on the NCHW view of `X`, its result read back as NHWC.
fn infer_conv_nhwc(n: &NodeIn) -> R<Vec<TypeInfo>> {
    infer_nhwc_as(n, "Conv")
}

/// The ONNX rule of `op` (at the newest opset) applied to the NCHW view of an NHWC `X`, its
/// first result read back as NHWC: the shape rule of every `npuc.*Nhwc` op.
pub(super) fn infer_nhwc_as(n: &NodeIn, op: &str) -> R<Vec<TypeInfo>> {
    let mut onnx = n.as_onnx(op, MAX_OPSET);
    if let Some(TypeInfo::Tensor {
        dtype,
        shape: Some(s),
    }) = n.ty(0)
    {
        let [b, h, w, c] = s.as_slice() else {
            return Err(format!("X must be 4-D NHWC, got rank {}", s.len()));
        };
        let nchw = vec![b.clone(), c.clone(), h.clone(), w.clone()];
        onnx.set_input_type(0, tt(*dtype, Some(nchw)));
    }
    let mut tys = onnx_rule(&onnx)?;
    tys.truncate(1);
    if let Some(TypeInfo::Tensor { shape: Some(s), .. }) = tys.first_mut() {
        if let [b, m, oh, ow] = s.as_slice() {
            *s = vec![b.clone(), oh.clone(), ow.clone(), m.clone()];
        }
    }
    Ok(tys)
}

/// `npuc.GlobalAveragePoolNhwc(X [N, H, W, C]) -> [N, 1, 1, C]`.
pub static GLOBAL_AVERAGE_POOL_NHWC: OpDef = OpDef {
    domain: "npuc",
    name: "GlobalAveragePoolNhwc",
    inputs: &[Param::required("X")],
    outputs: &[Param::required("Y")],
    attrs: &[],
    infer: |n| {
        let dims = n.shape(0).map(|s| {
            s.iter()
                .enumerate()
                .map(|(i, d)| {
                    if i == 0 || i + 1 == s.len() {
                        d.clone()
                    } else {
                        Dim::Fixed(1)
                    }
                })
                .collect()
        });
        Ok(vec![tt(n.dt(0), dims)])
    },
};

/// A constant weight re-packed once per plan for the NHWC kernels.
enum Packed {
    /// `[KH*KW, M]` (depthwise) or `[KH*KW*C, M]` with rows ordered (tap, input channel), the
    /// order the NHWC im2col writes its columns in.
    Rows(Vec<f32>),
    /// That `[KH*KW*C, M]` matrix in the AVX-512 product's column panels (group 1 at the
    /// AVX-512 level): packing it on every call cost 3% of a PP-OCRv6 rec run.
    Panels(PackedB),
}

/// Re-packs an ONNX conv weight `[m, cg, kh*kw]` into `[(tap, c), m]` (`cg` = 1 for
/// depthwise gives `[tap, m]`) into `out` (cleared first).
fn pack_weight(w: &[f32], m: usize, cg: usize, taps: usize, out: &mut Vec<f32>) {
    out.clear();
    out.resize(taps * cg * m, 0.0);
    for oc in 0..m {
        for c in 0..cg {
            let src = &w[(oc * cg + c) * taps..][..taps];
            for (t, &v) in src.iter().enumerate() {
                out[(t * cg + c) * m + oc] = v;
            }
        }
    }
}

/// The weight as the kernels read it this call.
#[derive(Clone, Copy)]
enum Weight<'a> {
    Rows(&'a [f32]),
    Panels(&'a PackedB),
}

/// Output values from which [`bias_act_par`] splits the epilogue across threads (an exact
/// GELU costs ~2.5 ns a value, so 32K values are ~80 us of work).
const PAR_EPILOGUE: usize = 1 << 15;

/// [`bias_act`] over rows of `m` values, split by rows across `threads` when large: after a
/// threaded product, an epilogue on one thread was a quarter of a PP-OCRv6 rec run at 2 threads.
fn bias_act_par(out: &mut [f32], bias: Option<&[f32]>, m: usize, act: Act, threads: usize) {
    let rows = out.len() / m.max(1);
    if threads > 1 && out.len() >= PAR_EPILOGUE && rows > 1 && (bias.is_some() || act != Act::None)
    {
        let per = rows.div_ceil(threads) * m;
        out.par_chunks_mut(per)
            .for_each(|part| bias_act(part, bias, m, act));
    } else {
        bias_act(out, bias, m, act);
    }
}

/// Values [`bias_act`] adds the bias to before it applies the activation to them: a few KB,
/// so that the activation reads them back from L1 (over a whole 64 KB block the two passes
/// each went through L2).
const BIAS_ACT_SPAN: usize = 1024;

/// Adds the bias to every row of `m` values and applies the activation.
fn bias_act(out: &mut [f32], bias: Option<&[f32]>, m: usize, act: Act) {
    let Some(b) = bias else {
        apply_f32(act, out);
        return;
    };
    let rows = (BIAS_ACT_SPAN / m.max(1)).max(1);
    for span in out.chunks_mut(rows * m.max(1)) {
        crate::kernels::fmap::vectorized(AddBias { span, bias: b, m });
        apply_f32(act, span);
    }
}

/// `span[r * m + j] += bias[j]`, compiled at the CPU's level (16 or 8 lanes, not SSE2's 4).
struct AddBias<'a> {
    span: &'a mut [f32],
    bias: &'a [f32],
    m: usize,
}

impl crate::kernels::fmap::LevelBody for AddBias<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        add_bias_rows(self.span, self.bias, self.m)
    }
}

/// [`AddBias`]'s loop, its slices as (no-alias) parameters.
#[inline(always)]
fn add_bias_rows(span: &mut [f32], bias: &[f32], m: usize) {
    for row in span.chunks_exact_mut(m) {
        for (o, &bv) in row.iter_mut().zip(bias) {
            *o += bv;
        }
    }
}

/// `npuc.ConvNhwc`: see the module docs.
fn conv_nhwc(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let w = ins.tensor(1)?;
    let b = ins.opt_tensor(2);
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != 4 || ws.len() != 4 {
        bail!("ConvNhwc needs X [N, H, W, C] and W [M, C/group, KH, KW], got {xs:?} and {ws:?}");
    }
    if x.dtype() != DType::F32
        || w.dtype() != DType::F32
        || b.is_some_and(|b| b.dtype() != DType::F32)
    {
        bail!("ConvNhwc supports f32 operands only");
    }
    let group = ctx.node.int_or("group", 1)?;
    let (n, h, wd, c) = (xs[0], xs[1], xs[2], xs[3]);
    let (m, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
    let depthwise = group > 1 && group as usize == c && m == c && cg == 1;
    if !(group == 1 && cg == c || depthwise) {
        bail!(
            "ConvNhwc supports group 1 and depthwise (group = C = M) convs, got X {xs:?}, W {ws:?}, group {group}"
        );
    }
    if kh == 0 || kw == 0 {
        bail!("ConvNhwc kernel has an empty dimension: {ws:?}");
    }
    let bias = match b {
        Some(b) if b.len() != m => bail!("ConvNhwc bias has {} values, expected {m}", b.len()),
        Some(b) => Some(b.as_slice::<f32>()?),
        None => None,
    };
    let act = Act::from_node(ctx.node)?;
    let g = conv_geom(ctx.node, &[h, wd], &[kh, kw])?;
    let (oh, ow) = (g.out[1], g.out[2]);
    let xv = x.as_slice::<f32>()?;
    let wv = w.as_slice::<f32>()?;
    if xv.len() != n * h * wd * c || wv.len() != m * cg * kh * kw {
        bail!("ConvNhwc operand sizes do not match their shapes");
    }
    let taps = kh * kw;
    // Constant weights are packed once per plan; a fed weight is packed per call into scratch.
    let isa = Isa::detect();
    let cached;
    let mut scratch = vec![];
    let wp: Weight = if ctx.input_is_const(1) {
        cached = ctx.cached(|| {
            let mut v = vec![];
            pack_weight(wv, m, cg, taps, &mut v);
            if !depthwise && sgemm::available(isa) {
                let k = taps * cg;
                return Ok(Packed::Panels(PackedB::new(k, m, View::rows(&v, m))?));
            }
            Ok(Packed::Rows(v))
        })?;
        match &*cached {
            Packed::Rows(v) => Weight::Rows(v),
            Packed::Panels(p) => Weight::Panels(p),
        }
    } else {
        scratch = crate::buffers::take::<f32>(taps * cg * m);
        pack_weight(wv, m, cg, taps, &mut scratch);
        Weight::Rows(&scratch)
    };
    let fits = match wp {
        Weight::Rows(v) => v.len() == taps * cg * m,
        Weight::Panels(p) => p.k() == taps * cg && p.n() == m,
    };
    if !fits {
        bail!("ConvNhwc packed weight does not match W {ws:?} (node cache of another shape)");
    }
    // Both paths write every output value (GEMM rows, depthwise rows).
    let mut out = crate::buffers::for_overwrite::<f32>(n * oh * ow * m);
    if !out.is_empty() {
        match (depthwise, wp) {
            (true, Weight::Rows(wp)) => {
                depthwise_run(xv, wp, bias, &g, (n, c), act, &mut out, ctx.threads)?
            }
            (false, wp) => gemm_run(xv, wp, bias, &g, (n, c, m), act, &mut out, ctx.threads)?,
            (true, Weight::Panels(_)) => {
                bail!("ConvNhwc depthwise weight cached as panels (node cache of another kind)")
            }
        }
    }
    crate::buffers::release(scratch);
    Ok(vec![Value::tensor(Tensor::from_vec(
        vec![n, oh, ow, m],
        out,
    )?)])
}

/// Depthwise conv, one output row (`ow * c` values) at a time; rows run in parallel.
#[allow(clippy::too_many_arguments)]
fn depthwise_run(
    xv: &[f32],
    wp: &[f32],
    bias: Option<&[f32]>,
    g: &Geom,
    (n, c): (usize, usize),
    act: Act,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    let [_, h, wd] = g.inp;
    let [_, oh, ow] = g.out;
    let [_, kh, kw] = g.k;
    let img = h * wd * c;
    let dg = DwGeom {
        h,
        wd,
        c,
        kh,
        kw,
        stride: [g.s[1], g.s[2]],
        dilation: [g.d[1], g.d[2]],
        pad: [g.pb[1], g.pb[2]],
        ow,
    };
    let row = |(r, orow): (usize, &mut [f32])| -> bool {
        let (ni, oy) = (r / oh, r % oh);
        let ok = dw_row(orow, &xv[ni * img..][..img], wp, bias, &dg, oy);
        apply_f32(act, orow);
        ok
    };
    let row_len = ow * c;
    let rows = n * oh;
    let ok = if threads > 1 && out.len() * kh * kw >= PAR_MIN && rows * ow > 1 {
        // Late layers have a few rows of many channels (PP-OCR's classifier: 3 to 5 rows of
        // 256-512): rows alone split 2 + 1 over two threads, and border rows have fewer valid
        // taps. Such rows are cut into `threads` column runs each, and the units ordered run
        // by run, so that rayon's halving gives each thread the same columns of every row.
        let cuts = if rows >= 4 * threads {
            1
        } else {
            threads.min(ow)
        };
        if cuts == 1 {
            out.par_chunks_mut(row_len)
                .enumerate()
                .map(row)
                .reduce(|| true, |a, b| a && b)
        } else {
            let seg = ow.div_ceil(cuts);
            let mut units: Vec<(usize, usize, &mut [f32])> = Vec::with_capacity(rows * cuts);
            for (r, orow) in out.chunks_mut(row_len).enumerate() {
                for (j, part) in orow.chunks_mut(seg * c).enumerate() {
                    units.push((j, r, part));
                }
            }
            units.sort_unstable_by_key(|u| (u.0, u.1));
            units
                .into_par_iter()
                .map(|(j, r, part)| {
                    let (ni, oy) = (r / oh, r % oh);
                    let cols = j * seg..j * seg + part.len() / c;
                    let ok = dw_row_cols(part, &xv[ni * img..][..img], wp, bias, &dg, oy, cols);
                    apply_f32(act, part);
                    ok
                })
                .reduce(|| true, |a, b| a && b)
        }
    } else {
        // Every row runs (no short-circuit): a failed row only marks the result.
        out.chunks_mut(row_len)
            .enumerate()
            .map(row)
            .filter(|ok| !ok)
            .count()
            == 0
    };
    if !ok {
        bail!("ConvNhwc depthwise tap outside its operands (geometry inconsistent with shapes)");
    }
    Ok(())
}

/// Multiply-adds from which a group-1 conv is split across threads.
const PAR_WORK: usize = 1 << 17;

/// Pointwise and KxK convs (group 1): NHWC im2col (contiguous runs of `c` channels per tap)
/// in chunks of output pixels, each chunk one GEMM `[rows, K] x [K, M]` straight into the
/// output rows, then bias and activation on the chunk while it is in cache. A 1x1 stride-1
/// unpadded conv reads the input rows directly (no im2col).
///
/// Threads: when the pixels outweigh the output channels (the activations are the larger
/// operand) or the conv needs im2col, each thread takes a contiguous run of output pixels and
/// does its own im2col, product and epilogue: one fork-join per conv, every stage parallel
/// and each thread reading only its share of the activations. Otherwise (few pixels, many
/// channels: late layers) the product splits its weight panels across the threads.
#[allow(clippy::too_many_arguments)]
fn gemm_run(
    xv: &[f32],
    wp: Weight,
    bias: Option<&[f32]>,
    g: &Geom,
    (n, c, m): (usize, usize, usize),
    act: Act,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    let [_, oh, ow] = g.out;
    let [_, kh, kw] = g.k;
    let k = kh * kw * c;
    let total = n * oh * ow;
    if let (Some(cols), Weight::Panels(panels)) = (direct_columns(g, wp), wp) {
        let rows = n * oh;
        let row_len = ow * m;
        if threads <= 1 || total * k * m < PAR_WORK || rows < 2 {
            return direct_rows(xv, panels, bias, g, (c, m), act, cols, 0..rows, out);
        }
        let per = rows.div_ceil(threads);
        return out
            .par_chunks_mut(per * row_len)
            .enumerate()
            .try_for_each(|(i, part)| {
                let r0 = i * per;
                let r1 = r0 + part.len() / row_len;
                direct_rows(xv, panels, bias, g, (c, m), act, cols, r0..r1, part)
            });
    }
    let pointwise = reads_rows_in_place(g);
    let by_pixels = threads > 1
        && total * k * m >= PAR_WORK
        && total >= 2 * threads * sgemm::MR
        && (!pointwise || total >= m);
    if !by_pixels {
        return gemm_rows(xv, wp, bias, g, (c, m), act, 0..total, out, threads);
    }
    // Runs of whole micro-tiles, one per thread.
    let per = total.div_ceil(threads).div_ceil(sgemm::MR) * sgemm::MR;
    out.par_chunks_mut(per * m)
        .enumerate()
        .try_for_each(|(i, part)| {
            let r0 = i * per;
            gemm_rows(
                xv,
                wp,
                bias,
                g,
                (c, m),
                act,
                r0..r0 + part.len() / m,
                part,
                1,
            )
        })
}

/// Writes output pixel `p`'s im2col row (`kh * kw * c` values in (tap, channel) order, zeros
/// for taps in the padding) into `dst`.
fn im2col_pixel(xv: &[f32], g: &Geom, c: usize, p: usize, dst: &mut [f32]) {
    let [_, h, wd] = g.inp;
    let [_, oh, ow] = g.out;
    let [_, kh, kw] = g.k;
    let (ni, rem) = (p / (oh * ow), p % (oh * ow));
    let (oy, ox) = (rem / ow, rem % ow);
    for a in 0..kh {
        let iy = (oy * g.s[1] + a * g.d[1]) as isize - g.pb[1] as isize;
        let d = &mut dst[a * kw * c..][..kw * c];
        if iy < 0 || iy >= h as isize {
            d.fill(0.0);
            continue;
        }
        let row = &xv[(ni * h + iy as usize) * wd * c..][..wd * c];
        let x0 = (ox * g.s[2]) as isize - g.pb[2] as isize;
        if g.d[2] == 1 && x0 >= 0 && x0 as usize + kw <= wd {
            // The row's taps are kw neighbouring pixels: one copy of kw * c values
            // (per-tap copies of a few channels were libc calls of 12 bytes).
            d.copy_from_slice(&row[x0 as usize * c..][..kw * c]);
            continue;
        }
        for bb in 0..kw {
            let d = &mut d[bb * c..][..c];
            let ix = x0 + (bb * g.d[2]) as isize;
            if ix < 0 || ix >= wd as isize {
                d.fill(0.0);
            } else {
                d.copy_from_slice(&row[ix as usize * c..][..c]);
            }
        }
    }
}

/// Kernel rows a direct conv takes (their runs sit in one stack array).
const DIRECT_MAX_KH: usize = 16;

/// Interior output pixels a row needs for the direct path: fewer fill the micro-tiles too
/// poorly (late layers' short rows are better served by im2col tiles spanning rows).
const DIRECT_MIN_INTERIOR: usize = 16;

/// The interior output columns `lo..hi` of a group-1 conv that runs direct (every horizontal
/// tap inside the input row), or `None` when it runs through im2col: direct needs the AVX-512
/// product's packed panels, a kernel row's taps contiguous in NHWC (no horizontal dilation),
/// and rows with at least [`DIRECT_MIN_INTERIOR`] interior pixels. A plain 1x1 stride-1 conv
/// already reads its input rows in place.
fn direct_columns(g: &Geom, wp: Weight) -> Option<(usize, usize)> {
    let [_, _, wd] = g.inp;
    let [_, _, ow] = g.out;
    let [_, kh, kw] = g.k;
    let (s, pl) = (g.s[2], g.pb[2]);
    if !matches!(wp, Weight::Panels(_))
        || reads_rows_in_place(g)
        || g.d[2] != 1
        || kh > DIRECT_MAX_KH
        || wd + pl < kw
    {
        return None;
    }
    let lo = pl.div_ceil(s);
    let hi = ow.min((wd + pl - kw) / s + 1);
    (hi >= lo + DIRECT_MIN_INTERIOR).then_some((lo, hi))
}

/// Output rows `rows` (of `n * oh`) of a direct conv into `out` (their `ow * m` values each):
/// each row's interior pixels `lo..hi` are one product over its valid kernel rows, each a run
/// of `kw * c` values per pixel read in place from the input; the few border pixels per row go
/// through im2col, a column of a block of rows at a time; bias and activation then run on the
/// block while it is in cache. Each output is the same (tap, channel)-ordered FMA chain
/// whichever rows a thread takes.
#[allow(clippy::too_many_arguments)]
fn direct_rows(
    xv: &[f32],
    wp: &PackedB,
    bias: Option<&[f32]>,
    g: &Geom,
    (c, m): (usize, usize),
    act: Act,
    (lo, hi): (usize, usize),
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let [_, h, wd] = g.inp;
    let [_, oh, ow] = g.out;
    let [_, kh, kw] = g.k;
    let k = kh * kw * c;
    let row_len = ow * m;
    let isa = Isa::detect();
    // Rows per block: about 64 KB of output, so that the epilogue finds it in cache.
    let block = ((1usize << 14) / row_len.max(1)).clamp(1, 16);
    let borders = lo + (ow - hi);
    let mut col = if borders > 0 {
        COLUMNS.with(|cell| std::mem::take(&mut *cell.borrow_mut()))
    } else {
        vec![]
    };
    if borders > 0 {
        col.resize(col.len().max(block * k), 0.0);
    }
    let mut r0 = rows.start;
    while r0 < rows.end {
        let nr = block.min(rows.end - r0);
        let dst = &mut out[(r0 - rows.start) * row_len..][..nr * row_len];
        for (i, orow) in dst.chunks_exact_mut(row_len).enumerate() {
            let (ni, oy) = ((r0 + i) / oh, (r0 + i) % oh);
            let mut runs = [sgemm::Run {
                a: &[],
                k0: 0,
                kc: 0,
            }; DIRECT_MAX_KH];
            let mut used = 0;
            for a in 0..kh {
                let iy = (oy * g.s[1] + a * g.d[1]) as isize - g.pb[1] as isize;
                if iy < 0 || iy >= h as isize {
                    continue;
                }
                let x0 = lo * g.s[2] - g.pb[2];
                runs[used] = sgemm::Run {
                    a: &xv[((ni * h + iy as usize) * wd + x0) * c..],
                    k0: a * kw * c,
                    kc: kw * c,
                };
                used += 1;
            }
            sgemm::sgemm_packed_runs(
                isa,
                hi - lo,
                g.s[2] * c,
                &runs[..used],
                wp,
                &mut orow[lo * m..],
                m,
            )?;
        }
        for j in (0..lo).chain(hi..ow) {
            for (i, dst) in col[..nr * k].chunks_exact_mut(k).enumerate() {
                im2col_pixel(xv, g, c, (r0 + i) * ow + j, dst);
            }
            sgemm::sgemm_packed(
                isa,
                nr,
                1.0,
                View::rows(&col[..nr * k], k),
                wp,
                &mut dst[j * m..],
                row_len,
                1,
            )?;
        }
        bias_act(dst, bias, m, act);
        r0 += nr;
    }
    if borders > 0 {
        COLUMNS.with(|cell| {
            let mut cell = cell.borrow_mut();
            if cell.capacity() < col.capacity() {
                *cell = col;
            }
        });
    }
    Ok(())
}

/// A 1x1 stride-1 unpadded conv: the GEMM reads the input rows in place (no im2col).
fn reads_rows_in_place(g: &Geom) -> bool {
    g.k[1] * g.k[2] == 1 && g.s == [1; 3] && g.pb == [0; 3] && g.pe == [0; 3]
}

/// Output pixels `pixels` of [`gemm_run`]'s conv into `out` (their `pixels.len() * m` values).
#[allow(clippy::too_many_arguments)]
fn gemm_rows(
    xv: &[f32],
    wp: Weight,
    bias: Option<&[f32]>,
    g: &Geom,
    (c, m): (usize, usize),
    act: Act,
    pixels: std::ops::Range<usize>,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    let [_, kh, kw] = g.k;
    let k = kh * kw * c;
    let total = pixels.len();
    let pointwise = reads_rows_in_place(g);
    if pointwise && m == 1 && k <= ONE_CHANNEL_MAX_K {
        // One output channel (a segmentation or detection head's last 1x1 conv): a dot
        // product per pixel; the GEMM would fill 16-column tiles with one column.
        let mut wcol = [0f32; ONE_CHANNEL_MAX_K];
        for (kk, v) in wcol[..k].iter_mut().enumerate() {
            *v = match wp {
                Weight::Rows(w) => w[kk],
                Weight::Panels(p) => p
                    .at(kk, 0)
                    .ok_or_else(|| crate::RtError::msg("ConvNhwc packed weight is not k x 1"))?,
            };
        }
        let lhs = &xv[pixels.start * c..][..total * c];
        if !crate::kernels::sgemv::dot_rows(&wcol[..k], lhs, k, &mut out[..total], false) {
            bail!("ConvNhwc: {total} pixels of {k} values do not fit the input");
        }
        bias_act_par(&mut out[..total], bias, 1, act, threads);
        return Ok(());
    }
    // About 1 MB of columns per chunk: large enough for efficient (and threaded) GEMMs,
    // small enough that the chunk's output is still in cache for the epilogue. On one thread
    // (a thread's share of a split, or a small conv) with a weight of at most 256 KB, also at
    // most ~256 KB of output: a pointwise conv over few input channels otherwise took every
    // pixel at once, and its epilogue read megabytes back from L3 (PP-OCRv6 det's 160x160
    // stage). Larger weights keep the longer chunks: every chunk streams the whole weight.
    let mut chunk = (1usize << 18) / k.max(1);
    if threads <= 1 && k * m <= SMALL_WEIGHT {
        chunk = chunk.min((1 << 16) / m.max(1));
    }
    let chunk = chunk.clamp(16, total.max(16));
    // Every chunk writes each of its rows' k values (copies or zero padding) before use.
    // Per-thread, reused across calls: the worker threads of a split have no run's pool.
    let mut col = if pointwise {
        vec![]
    } else {
        let mut v = COLUMNS.with(|c| std::mem::take(&mut *c.borrow_mut()));
        v.resize(v.len().max(chunk.min(total) * k), 0.0);
        v
    };
    let mut r0 = 0;
    while r0 < total {
        let rows = chunk.min(total - r0);
        let lhs: &[f32] = if pointwise {
            &xv[(pixels.start + r0) * c..][..rows * c]
        } else {
            for (i, dst) in col[..rows * k].chunks_exact_mut(k).enumerate() {
                im2col_pixel(xv, g, c, pixels.start + r0 + i, dst);
            }
            &col[..rows * k]
        };
        let dst = &mut out[r0 * m..][..rows * m];
        match wp {
            Weight::Rows(wp) => gemm_into(
                rows,
                m,
                k,
                1.0,
                Mat::rows(lhs, k),
                Mat::rows(wp, m),
                None,
                dst,
                m,
                threads,
            )?,
            Weight::Panels(wp) => sgemm::sgemm_packed(
                Isa::detect(),
                rows,
                1.0,
                View::rows(lhs, k),
                wp,
                dst,
                m,
                threads,
            )?,
        }
        bias_act_par(dst, bias, m, act, threads);
        r0 += rows;
    }
    COLUMNS.with(|c| {
        let mut c = c.borrow_mut();
        if c.capacity() < col.capacity() {
            *c = col;
        }
    });
    Ok(())
}

/// Values of a conv weight small enough that [`gemm_rows`] splits its pixels into chunks of at
/// most ~256 KB of output (re-reading the weight per chunk costs less than the epilogue's
/// trip to L3).
const SMALL_WEIGHT: usize = 1 << 16;

/// Most input channels of the one-output-channel pointwise path (its weight column sits in a
/// stack array).
const ONE_CHANNEL_MAX_K: usize = 1024;

thread_local! {
    /// im2col columns of [`gemm_rows`], kept per thread (taken out while in use).
    static COLUMNS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `npuc.GlobalAveragePoolNhwc`: `[N, H, W, C]` to `[N, 1, 1, C]` (channel vectors summed
/// pixel by pixel: contiguous adds).
fn gap_nhwc(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let xs = x.shape();
    if xs.len() != 4 || x.dtype() != DType::F32 {
        bail!(
            "GlobalAveragePoolNhwc needs an f32 X [N, H, W, C], got {} {xs:?}",
            x.dtype()
        );
    }
    let (n, hw, c) = (xs[0], xs[1] * xs[2], xs[3]);
    let xv = x.as_slice::<f32>()?;
    let mut out = crate::buffers::zeroed::<f32>(n * c);
    if c > 0 && hw > 0 {
        for (img, o) in xv.chunks_exact(hw * c).zip(out.chunks_exact_mut(c)) {
            // A chain through memory per channel (each pixel adds to the same sums): wider
            // vectors did not help (0.13 -> 0.17 ms over PP-OCRv6 det's 13 pools at AVX-512).
            for px in img.chunks_exact(c) {
                for (a, &v) in o.iter_mut().zip(px) {
                    *a += v;
                }
            }
            let inv = 1.0 / hw as f32;
            o.iter_mut().for_each(|a| *a *= inv);
        }
    }
    Ok(vec![Value::tensor(Tensor::from_vec(
        vec![n, 1, 1, c],
        out,
    )?)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Session, SessionOptions};
    use npuc_ir::{Attr, Graph, Initializer, Model, Node, OpsetImport, ValueInfo};

    fn npuc(mut n: Node) -> Node {
        n.domain = "npuc".into();
        n
    }

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn nchw_to_nhwc(v: &[f32], [n, c, h, w]: [usize; 4]) -> Vec<f32> {
        let mut o = vec![0.0; v.len()];
        for ni in 0..n {
            for ci in 0..c {
                for y in 0..h {
                    for x in 0..w {
                        o[((ni * h + y) * w + x) * c + ci] = v[((ni * c + ci) * h + y) * w + x];
                    }
                }
            }
        }
        o
    }

    /// A model (opsets: default 17, npuc 1) of `nodes` with input `x`, output `y` and
    /// the given initializers.
    fn model(nodes: Vec<Node>, inits: Vec<(&str, Tensor)>) -> Model {
        Model {
            ir_version: 8,
            opset_imports: vec![
                OpsetImport {
                    domain: String::new(),
                    version: 17,
                },
                OpsetImport {
                    domain: "npuc".into(),
                    version: 1,
                },
            ],
            graph: Graph {
                name: "g".into(),
                nodes,
                inputs: vec![ValueInfo::new("x", None)],
                outputs: vec![ValueInfo::new("y", None)],
                initializers: inits
                    .into_iter()
                    .map(|(n, t)| Initializer {
                        name: n.into(),
                        tensor: t,
                    })
                    .collect(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// Runs one node on `x` with constant `w`/`b` and returns its output tensor.
    fn run_node(node: Node, x: Tensor, w: Tensor, b: Tensor, threads: usize) -> Tensor {
        let m = model(vec![node], vec![("w", w), ("b", b)]);
        let s = Session::new(&m, SessionOptions { threads }).unwrap();
        let out = s.run(vec![("x".into(), Value::tensor(x))]).unwrap();
        out[0].1.as_tensor().unwrap().clone()
    }

    /// The NCHW op `node` on `x` (`shape`), its output shape (NCHW) and values transposed to NHWC.
    fn nchw_reference(
        node: Node,
        x: &[f32],
        shape: [usize; 4],
        w: &Tensor,
        b: &Tensor,
    ) -> (Vec<usize>, Vec<f32>) {
        let x = Tensor::from_vec(shape.to_vec(), x.to_vec()).unwrap();
        let y = run_node(node, x, w.clone(), b.clone(), 1);
        let ys = y.shape().to_vec();
        let nhwc = nchw_to_nhwc(y.as_slice::<f32>().unwrap(), [ys[0], ys[1], ys[2], ys[3]]);
        (ys, nhwc)
    }

    /// The NHWC op `node()` on `x` (given NCHW as `shape`, transposed here) at 1 and 2 threads
    /// against the NCHW reference `(ws, want)` (`nchw_reference`), within 1e-4 relative.
    fn check_nhwc(
        node: impl Fn() -> Node,
        x: &[f32],
        [n, c, h, wd]: [usize; 4],
        (w, b): (&Tensor, &Tensor),
        (ws, want): (&[usize], &[f32]),
        ci: usize,
    ) {
        for threads in [1, 2] {
            let xn = nchw_to_nhwc(x, [n, c, h, wd]);
            let x = Tensor::from_vec(vec![n, h, wd, c], xn).unwrap();
            let got = run_node(node(), x, w.clone(), b.clone(), threads);
            assert_eq!(got.shape(), &[ws[0], ws[2], ws[3], ws[1]], "case {ci}");
            for (i, (a, b)) in got.as_slice::<f32>().unwrap().iter().zip(want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "case {ci} threads {threads} at {i}: {a} vs {b}"
                );
            }
        }
    }

    /// ConvNhwc (pointwise, strided 1x1, KxK padded/dilated, depthwise; with bias and an
    /// activation) equals ONNX Conv + Relu computed by the NCHW kernel, transposed.
    #[test]
    fn matches_nchw_conv() {
        // (c, m, group, k, stride, dilation, pads)
        let cases = [
            (16, 24, 1, 1, 1, 1, [0, 0, 0, 0]),
            // One output channel: a dot product per pixel.
            (64, 1, 1, 1, 1, 1, [0, 0, 0, 0]),
            (16, 24, 1, 1, 2, 1, [0, 0, 0, 0]),
            (5, 7, 1, 3, 1, 1, [1, 1, 1, 1]),
            (3, 16, 1, 3, 2, 1, [1, 0, 0, 1]),
            (8, 4, 1, 3, 1, 2, [2, 2, 2, 2]),
            (40, 40, 40, 3, 1, 1, [1, 1, 1, 1]),
            (37, 37, 37, 5, 2, 1, [2, 2, 2, 2]),
            (64, 64, 64, 3, 2, 2, [0, 1, 2, 0]),
            // Large enough for two threads to split the pixels (KxK with im2col, pointwise).
            (32, 48, 1, 3, 1, 1, [1, 1, 1, 1]),
            (64, 32, 1, 1, 1, 1, [0, 0, 0, 0]),
            // Depthwise with 6 output rows over two images: rows cut into column runs.
            (96, 96, 96, 5, 4, 1, [2, 2, 2, 2]),
        ];
        // Wide rows, run direct (kernel rows read in place, border columns through im2col):
        // narrow and two-panel outputs, stride 2 with uneven pads, no borders, a 1x1 stride-2
        // conv, more kernel rows than one micro-kernel call takes.
        let direct = [
            (8, 16, 1, 3, 1, 1, [1, 1, 1, 1]),
            (3, 40, 1, 3, 2, 1, [1, 0, 0, 1]),
            (6, 8, 1, 2, 1, 1, [0, 0, 0, 0]),
            (16, 24, 1, 1, 2, 1, [0, 0, 0, 0]),
            (2, 8, 1, 9, 1, 1, [4, 4, 4, 4]),
        ];
        let sized = cases
            .iter()
            .map(|&case| (case, (11, 9)))
            .chain(direct.iter().map(|&case| (case, (12, 41))));
        for (ci, ((c, m, group, k, s, d, p), (h, wd))) in sized.enumerate() {
            let n = 2;
            let x = rnd(n * c * h * wd, 3 + ci as u64);
            let w = rnd(m * (c / group) * k * k, 5 + ci as u64);
            let b = rnd(m, 7 + ci as u64);
            let attrs = |node: Node| {
                node.with_attr("group", Attr::Int(group as i64))
                    .with_attr("strides", Attr::Ints(vec![s as i64; 2]))
                    .with_attr("dilations", Attr::Ints(vec![d as i64; 2]))
                    .with_attr("pads", Attr::Ints(p.iter().map(|&v| v as i64).collect()))
                    .with_attr("activation", Attr::String("Relu".into()))
            };
            let wt = Tensor::from_vec(vec![m, c / group, k, k], w).unwrap();
            let bt = Tensor::from_vec(vec![m], b).unwrap();
            let conv = attrs(npuc(Node::new("FusedConv", &["x", "w", "b"], &["y"])));
            let (ws, want) = nchw_reference(conv, &x, [n, c, h, wd], &wt, &bt);
            let node = || attrs(npuc(Node::new("ConvNhwc", &["x", "w", "b"], &["y"])));
            check_nhwc(node, &x, [n, c, h, wd], (&wt, &bt), (&ws, &want), ci);
        }
    }

    /// ConvTransposeNhwc equals ONNX ConvTranspose (the NCHW kernel), transposed: 2x2 stride 2
    /// (PP-OCR's head), 3x2 stride (3, 2) with a bias, one output channel, two images; narrow
    /// (`KW * M` < 16, the transposed product) and wide outputs; at 1 and 2 threads.
    /// Overlapping strides are refused with the reason.
    #[test]
    fn conv_transpose_nhwc_matches_nchw() {
        // (n, c, h, w, m, kh, kw, bias)
        let cases = [
            (1, 4, 5, 7, 3, 2, 2, false),
            (2, 5, 3, 4, 8, 3, 2, true),
            (1, 16, 6, 40, 1, 2, 2, true),
            (2, 16, 20, 24, 16, 2, 2, true),
        ];
        for (ci, &(n, c, h, wd, m, kh, kw, bias)) in cases.iter().enumerate() {
            let x = rnd(n * c * h * wd, 11 + ci as u64);
            let wt =
                Tensor::from_vec(vec![c, m, kh, kw], rnd(c * m * kh * kw, 13 + ci as u64)).unwrap();
            let bt = Tensor::from_vec(vec![m], rnd(m, 17 + ci as u64)).unwrap();
            let ins: &[&str] = if bias { &["x", "w", "b"] } else { &["x", "w"] };
            let strides = Attr::Ints(vec![kh as i64, kw as i64]);
            let deconv =
                Node::new("ConvTranspose", ins, &["y"]).with_attr("strides", strides.clone());
            let (ws, want) = nchw_reference(deconv, &x, [n, c, h, wd], &wt, &bt);
            assert_eq!(ws, [n, m, h * kh, wd * kw], "case {ci}");
            let node = || {
                npuc(Node::new("ConvTransposeNhwc", ins, &["y"]))
                    .with_attr("strides", strides.clone())
            };
            check_nhwc(node, &x, [n, c, h, wd], (&wt, &bt), (&ws, &want), ci);
        }
        // Stride 2 with a 3x3 kernel (not a multiple): refused, naming the rule.
        let node = npuc(Node::new("ConvTransposeNhwc", &["x", "w"], &["y"]))
            .with_attr("strides", Attr::Ints(vec![2, 2]));
        let m = model(
            vec![node],
            vec![(
                "w",
                Tensor::from_vec(vec![2, 2, 3, 3], vec![0f32; 36]).unwrap(),
            )],
        );
        let s = Session::new(&m, SessionOptions { threads: 1 }).unwrap();
        let x = Tensor::from_vec(vec![1, 3, 3, 2], vec![0f32; 18]).unwrap();
        let e = s.run(vec![("x".into(), Value::tensor(x))]).unwrap_err();
        assert!(e.to_string().contains("strides equal to the kernel"), "{e}");
    }

    /// The sub-pixel form (kernels a multiple of the strides) against the NCHW ConvTranspose:
    /// a ViT decoder's 4x4 stride 2 pad 1, asymmetric pads, output padding, unequal strides,
    /// stride 1 (a full convolution), a one-channel output; at 1 and 2 threads.
    #[test]
    fn conv_transpose_nhwc_sub_pixel_matches_nchw() {
        // (n, c, h, w, m, [kh, kw], strides, pads [b0, b1, e0, e1], output_padding)
        type Case = (
            usize,
            usize,
            usize,
            usize,
            usize,
            [usize; 2],
            [i64; 2],
            [i64; 4],
            [i64; 2],
        );
        let cases: [Case; 8] = [
            (1, 8, 5, 6, 4, [4, 4], [2, 2], [1, 1, 1, 1], [0, 0]),
            (2, 5, 4, 3, 7, [4, 4], [2, 2], [0, 2, 3, 1], [1, 0]),
            (1, 6, 3, 5, 3, [6, 4], [3, 2], [2, 1, 0, 3], [2, 1]),
            (1, 3, 4, 4, 2, [2, 3], [1, 1], [0, 1, 1, 0], [0, 0]),
            (1, 16, 8, 9, 1, [4, 4], [2, 2], [1, 1, 1, 1], [0, 0]),
            (1, 32, 7, 10, 40, [4, 4], [2, 2], [1, 1, 1, 1], [1, 1]),
            (1, 4, 3, 3, 5, [4, 4], [2, 2], [3, 3, 3, 3], [0, 0]),
            // Padding that leaves no output row.
            (1, 4, 1, 3, 2, [4, 4], [2, 2], [2, 1, 2, 1], [0, 0]),
        ];
        for (ci, &(n, c, h, wd, m, [kh, kw], st, pads, op)) in cases.iter().enumerate() {
            let x = rnd(n * c * h * wd, 31 + ci as u64);
            let wt =
                Tensor::from_vec(vec![c, m, kh, kw], rnd(c * m * kh * kw, 37 + ci as u64)).unwrap();
            let bt = Tensor::from_vec(vec![m], rnd(m, 41 + ci as u64)).unwrap();
            let attrs = |nd: Node| {
                nd.with_attr("strides", Attr::Ints(st.to_vec()))
                    .with_attr("pads", Attr::Ints(pads.to_vec()))
                    .with_attr("output_padding", Attr::Ints(op.to_vec()))
            };
            let ins: &[&str] = &["x", "w", "b"];
            let (ws, want) = nchw_reference(
                attrs(Node::new("ConvTranspose", ins, &["y"])),
                &x,
                [n, c, h, wd],
                &wt,
                &bt,
            );
            let node = || attrs(npuc(Node::new("ConvTransposeNhwc", ins, &["y"])));
            check_nhwc(node, &x, [n, c, h, wd], (&wt, &bt), (&ws, &want), ci);
        }
    }

    #[test]
    fn bad_operands_are_errors() {
        let x = Tensor::from_vec(vec![1, 4, 4, 6], vec![0f32; 96]).unwrap();
        // Grouped (not depthwise) convs are not supported in NHWC.
        let w = Tensor::from_vec(vec![6, 3, 1, 1], vec![0f32; 18]).unwrap();
        let node =
            npuc(Node::new("ConvNhwc", &["x", "w"], &["y"])).with_attr("group", Attr::Int(2));
        let m = model(vec![node], vec![("w", w)]);
        let s = Session::new(&m, SessionOptions { threads: 1 }).unwrap();
        let e = s.run(vec![("x".into(), Value::tensor(x))]).unwrap_err();
        assert!(e.to_string().contains("depthwise"), "{e}");
    }
}
