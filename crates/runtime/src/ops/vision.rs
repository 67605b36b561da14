//! Region and sampling vision ops: DeformConv, RoiAlign and MaxRoiPool.
//!
//! All three compute in the tensor's float type (f16/bf16 widened to f32, as the rest of the
//! runtime does) and store back in the input dtype.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::conv::float_dispatch;
use crate::ops::matmul::{gemm_into, GemmFloat, Mat};
use crate::value::Value;
use npuc_ir::{DType, Node, Tensor};

pub fn register(r: &mut Registry) {
    r.add("DeformConv", 19, deform_conv);
    r.add("RoiAlign", 10, roi_align);
    r.add("MaxRoiPool", 1, max_roi_pool);
}

/// Reads an ints attribute of exactly `n` values (or `n` copies of `def` when absent),
/// requiring each to be at least `min`.
fn usize_attr(node: &Node, name: &str, n: usize, def: i64, min: i64) -> Result<Vec<usize>> {
    let v: Vec<i64> = match node.attr_ints(name)? {
        Some(v) => v.to_vec(),
        None => vec![def; n],
    };
    if v.len() != n || v.iter().any(|&x| x < min) {
        bail!("attribute '{name}' must hold {n} values >= {min}, got {v:?}");
    }
    Ok(v.into_iter().map(|x| x as usize).collect())
}

/// Float tensors only (the three ops are defined for float16/float/double/bfloat16).
fn check_float(t: &Tensor, what: &str) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 => Ok(()),
        other => bail!("{what} must be a float tensor, found {other}"),
    }
}

// ---------------------------------------------------------------------------------------------
// DeformConv

/// Validated geometry of a 2-D deformable convolution.
struct DeformGeom {
    n: usize,
    c: usize,
    ih: usize,
    iw: usize,
    oc: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    group: usize,
    offset_group: usize,
    stride: [usize; 2],
    dil: [usize; 2],
    /// Top/left padding (the origin of the first window is at `-pad`).
    pad: [usize; 2],
}

/// DeformConv (opset 19): a 2-D convolution whose kernel taps are displaced by learned
/// per-position offsets and optionally scaled by a mask. Input values at fractional
/// positions are read by bilinear interpolation, zero outside the image.
///
/// Each batch item is lowered to an im2col-style matrix of sampled (and masked) values,
/// `[C * kh * kw, oh * ow]`, then multiplied by each group's weights with `gemm`.
fn deform_conv(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let w = ins.tensor(1)?;
    let off = ins.tensor(2)?;
    let b = ins.opt_tensor(3);
    let mask = ins.opt_tensor(4);
    check_float(x, "X")?;
    for (t, name) in [
        (Some(w), "W"),
        (Some(off), "offset"),
        (b, "B"),
        (mask, "mask"),
    ] {
        if let Some(t) = t {
            if t.dtype() != x.dtype() {
                bail!(
                    "{name} must have X's dtype {}, found {}",
                    x.dtype(),
                    t.dtype()
                );
            }
        }
    }
    let (xs, ws, os) = (x.shape(), w.shape(), off.shape());
    if xs.len() != 4 || ws.len() != 4 || os.len() != 4 {
        bail!(
            "DeformConv supports 2-D inputs: X [N,C,H,W], W [M,C/group,kH,kW] and offset \
             [N,2*offset_group*kH*kW,oH,oW], got {xs:?}, {ws:?} and {os:?}"
        );
    }
    let node = ctx.node;
    let group = node.int_or("group", 1)?;
    let offset_group = node.int_or("offset_group", 1)?;
    if group < 1 || offset_group < 1 {
        bail!("group ({group}) and offset_group ({offset_group}) must be positive");
    }
    let (group, offset_group) = (group as usize, offset_group as usize);
    let (n, c, ih, iw) = (xs[0], xs[1], xs[2], xs[3]);
    let oc = ws[0];
    if ws[1] * group != c || oc % group != 0 {
        bail!("W {ws:?} does not fit X {xs:?} with group {group}");
    }
    if c % offset_group != 0 {
        bail!("{c} input channels are not divisible by offset_group {offset_group}");
    }
    let ks = match node.attr("kernel_shape") {
        Some(_) => usize_attr(node, "kernel_shape", 2, 0, 1)?,
        None => ws[2..].to_vec(),
    };
    if ks[..] != ws[2..] {
        bail!(
            "kernel_shape {ks:?} differs from W's spatial shape {:?}",
            &ws[2..]
        );
    }
    let (kh, kw) = (ks[0], ks[1]);
    let stride = usize_attr(node, "strides", 2, 1, 1)?;
    let dil = usize_attr(node, "dilations", 2, 1, 1)?;
    let pads = usize_attr(node, "pads", 4, 0, 0)?;
    let mut out_sp = [0usize; 2];
    for (i, (&len, &k)) in [ih, iw].iter().zip(&ks).enumerate() {
        let span = (k - 1) * dil[i] + 1;
        let padded = len + pads[i] + pads[i + 2];
        if padded < span {
            bail!("dilated kernel extent {span} exceeds the padded input {padded}");
        }
        out_sp[i] = (padded - span) / stride[i] + 1;
    }
    let [oh, ow] = out_sp;
    if os[0] != n || os[1] != offset_group * kh * kw * 2 || os[2] != oh || os[3] != ow {
        bail!(
            "offset {os:?} must be [{n}, {}, {oh}, {ow}]",
            offset_group * kh * kw * 2
        );
    }
    if let Some(m) = mask {
        if m.shape() != [n, offset_group * kh * kw, oh, ow] {
            bail!(
                "mask {:?} must be [{n}, {}, {oh}, {ow}]",
                m.shape(),
                offset_group * kh * kw
            );
        }
    }
    if let Some(b) = b {
        if b.shape() != [oc] {
            bail!("B {:?} must be [{oc}]", b.shape());
        }
    }
    let g = DeformGeom {
        n,
        c,
        ih,
        iw,
        oc,
        kh,
        kw,
        oh,
        ow,
        group,
        offset_group,
        stride: [stride[0], stride[1]],
        dil: [dil[0], dil[1]],
        pad: [pads[0], pads[1]],
    };
    let out_shape = vec![n, oc, oh, ow];
    let t = float_dispatch!(x.dtype(), T => {
        let xv = T::load(x)?;
        let wv = T::load(w)?;
        let ov = T::load(off)?;
        let bv = b.map(T::load).transpose()?;
        let mv = mask.map(T::load).transpose()?;
        let y = deform_conv_run::<T>(&g, &xv, &wv, &ov, bv.as_deref(), mv.as_deref(), ctx.threads)?;
        T::store(x.dtype(), out_shape, y)?
    });
    Ok(vec![Value::tensor(t)])
}

/// Bilinear sample of a `h x w` plane at (y, x), reading zero outside it.
#[inline]
fn bilinear_zero<T: GemmFloat>(plane: &[T], h: usize, w: usize, y: T, x: T) -> T {
    let (y0f, x0f) = (y.floor(), x.floor());
    let (ly, lx) = (y - y0f, x - x0f);
    let (hy, hx) = (T::one() - ly, T::one() - lx);
    // Far-away or non-finite coordinates read nothing; this also keeps the casts below sane.
    let lim = T::from_f64((h.max(w) + 2) as f64);
    if !(y0f > -lim && y0f < lim && x0f > -lim && x0f < lim) {
        return T::zero();
    }
    let (y0, x0) = (y0f.to_f64() as isize, x0f.to_f64() as isize);
    let at = |yy: isize, xx: isize| -> T {
        if yy >= 0 && xx >= 0 && (yy as usize) < h && (xx as usize) < w {
            plane[yy as usize * w + xx as usize]
        } else {
            T::zero()
        }
    };
    hy * (hx * at(y0, x0) + lx * at(y0, x0 + 1))
        + ly * (hx * at(y0 + 1, x0) + lx * at(y0 + 1, x0 + 1))
}

fn deform_conv_run<T: GemmFloat>(
    g: &DeformGeom,
    x: &[T],
    w: &[T],
    off: &[T],
    bias: Option<&[T]>,
    mask: Option<&[T]>,
    threads: usize,
) -> Result<Vec<T>> {
    let kk = g.kh * g.kw;
    let ohw = g.oh * g.ow;
    let plane = g.ih * g.iw;
    let icg = g.c / g.group;
    let ocg = g.oc / g.group;
    let c_per_og = g.c / g.offset_group;
    let mut y = vec![T::zero(); g.n * g.oc * ohw];
    let mut cols = vec![T::zero(); g.c * kk * ohw];
    for bi in 0..g.n {
        let xb = &x[bi * g.c * plane..(bi + 1) * g.c * plane];
        let ob = &off[bi * g.offset_group * kk * 2 * ohw..(bi + 1) * g.offset_group * kk * 2 * ohw];
        let mb =
            mask.map(|m| &m[bi * g.offset_group * kk * ohw..(bi + 1) * g.offset_group * kk * ohw]);
        for ci in 0..g.c {
            let og = ci / c_per_og;
            let xp = &xb[ci * plane..(ci + 1) * plane];
            for ki in 0..g.kh {
                for kj in 0..g.kw {
                    let tap = og * kk + ki * g.kw + kj;
                    let dy = &ob[(tap * 2) * ohw..(tap * 2 + 1) * ohw];
                    let dx = &ob[(tap * 2 + 1) * ohw..(tap * 2 + 2) * ohw];
                    let mrow = mb.map(|m| &m[tap * ohw..(tap + 1) * ohw]);
                    let row = &mut cols[(ci * kk + ki * g.kw + kj) * ohw..][..ohw];
                    for i in 0..g.oh {
                        let base_y = (i * g.stride[0] + ki * g.dil[0]) as f64 - g.pad[0] as f64;
                        for j in 0..g.ow {
                            let base_x = (j * g.stride[1] + kj * g.dil[1]) as f64 - g.pad[1] as f64;
                            let p = i * g.ow + j;
                            let yy = T::from_f64(base_y) + dy[p];
                            let xx = T::from_f64(base_x) + dx[p];
                            let mut v = bilinear_zero(xp, g.ih, g.iw, yy, xx);
                            if let Some(m) = mrow {
                                v *= m[p];
                            }
                            row[p] = v;
                        }
                    }
                }
            }
        }
        let yb = &mut y[bi * g.oc * ohw..(bi + 1) * g.oc * ohw];
        if let Some(bias) = bias {
            for (o, chunk) in yb.chunks_mut(ohw).enumerate() {
                chunk.fill(bias[o]);
            }
        }
        for gi in 0..g.group {
            let wg = &w[gi * ocg * icg * kk..(gi + 1) * ocg * icg * kk];
            let cg = &cols[gi * icg * kk * ohw..(gi + 1) * icg * kk * ohw];
            let dst = &mut yb[gi * ocg * ohw..(gi + 1) * ocg * ohw];
            gemm_into(
                ocg,
                ohw,
                icg * kk,
                T::one(),
                Mat::rows(wg, icg * kk),
                Mat::rows(cg, ohw),
                bias.map(|_| T::one()),
                dst,
                ohw,
                threads,
            )?;
        }
    }
    Ok(y)
}

// ---------------------------------------------------------------------------------------------
// RoiAlign

/// One bilinear sample: the four neighbour offsets in a channel plane and their weights.
#[derive(Clone, Copy, Default)]
struct Tap<T> {
    pos: [usize; 4],
    w: [T; 4],
}

/// RoiAlign (opsets 10, 16): pools each region of interest to a fixed
/// `output_height x output_width` grid by averaging (or taking the max of) bilinear samples,
/// `sampling_ratio` per bin side (adaptive, `ceil(roi_size / output_size)`, when 0).
///
/// Follows the reference (and onnxruntime) exactly, including its quirks: the sample weights
/// are shared by all channels, and max mode takes the max of the four *weighted* corner values.
fn roi_align(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let rois = ins.tensor(1)?;
    let bidx = ins.tensor(2)?;
    check_float(x, "X")?;
    check_float(rois, "rois")?;
    let (xs, rs) = (x.shape(), rois.shape());
    if xs.len() != 4 || rs.len() != 2 || rs[1] != 4 {
        bail!("RoiAlign needs X [N,C,H,W] and rois [num_rois, 4], got {xs:?} and {rs:?}");
    }
    let batch: Vec<i64> = bidx.to_i64_vec()?;
    if bidx.rank() != 1 || batch.len() != rs[0] {
        bail!("batch_indices {:?} must be [{}]", bidx.shape(), rs[0]);
    }
    if let Some(&bad) = batch.iter().find(|&&b| b < 0 || b as usize >= xs[0]) {
        bail!("batch index {bad} is out of range for {} images", xs[0]);
    }
    let node = ctx.node;
    // Opset 10 had no coordinate_transformation_mode: it behaves like output_half_pixel.
    let def_ctm = if ctx.opset >= 16 {
        "half_pixel"
    } else {
        "output_half_pixel"
    };
    let half_pixel = match node.str_or("coordinate_transformation_mode", def_ctm)? {
        "half_pixel" => true,
        "output_half_pixel" => false,
        other => bail!("unsupported coordinate_transformation_mode '{other}'"),
    };
    let max_mode = match node.str_or("mode", "avg")?.to_ascii_lowercase().as_str() {
        "avg" => false,
        "max" => true,
        other => bail!("unsupported mode '{other}'"),
    };
    let out_h = node.int_or("output_height", 1)?;
    let out_w = node.int_or("output_width", 1)?;
    let sampling = node.int_or("sampling_ratio", 0)?;
    if out_h < 1 || out_w < 1 || sampling < 0 {
        bail!("output_height/output_width must be positive and sampling_ratio non-negative");
    }
    let scale = node.float_or("spatial_scale", 1.0)?;
    let p = RoiAlignParams {
        c: xs[1],
        h: xs[2],
        w: xs[3],
        ph: out_h as usize,
        pw: out_w as usize,
        sampling: sampling as usize,
        scale: scale as f64,
        half_pixel,
        max_mode,
    };
    let out_shape = vec![rs[0], xs[1], p.ph, p.pw];
    let t = float_dispatch!(x.dtype(), T => {
        let xv = T::load(x)?;
        let rv = T::load(rois)?;
        let y = roi_align_run::<T>(&p, &xv, &rv, &batch)?;
        T::store(x.dtype(), out_shape, y)?
    });
    Ok(vec![Value::tensor(t)])
}

struct RoiAlignParams {
    c: usize,
    h: usize,
    w: usize,
    ph: usize,
    pw: usize,
    sampling: usize,
    scale: f64,
    half_pixel: bool,
    max_mode: bool,
}

/// Bilinear taps for one sample point, or `None` when it lies outside `[-1, size]`.
fn roi_tap<T: GemmFloat>(h: usize, w: usize, mut y: T, mut x: T) -> Option<Tap<T>> {
    let (hf, wf) = (T::from_f64(h as f64), T::from_f64(w as f64));
    let neg1 = -T::one();
    // NaN coordinates fail every comparison below; treat them as outside too.
    if !(y >= neg1 && y <= hf && x >= neg1 && x <= wf) {
        return None;
    }
    y = y.max(T::zero());
    x = x.max(T::zero());
    let mut y_low = y.to_f64() as usize;
    let mut x_low = x.to_f64() as usize;
    let y_high;
    let x_high;
    if y_low >= h - 1 {
        y_low = h - 1;
        y_high = h - 1;
        y = T::from_f64(y_low as f64);
    } else {
        y_high = y_low + 1;
    }
    if x_low >= w - 1 {
        x_low = w - 1;
        x_high = w - 1;
        x = T::from_f64(x_low as f64);
    } else {
        x_high = x_low + 1;
    }
    let ly = y - T::from_f64(y_low as f64);
    let lx = x - T::from_f64(x_low as f64);
    let (hy, hx) = (T::one() - ly, T::one() - lx);
    Some(Tap {
        pos: [
            y_low * w + x_low,
            y_low * w + x_high,
            y_high * w + x_low,
            y_high * w + x_high,
        ],
        w: [hy * hx, hy * lx, ly * hx, ly * lx],
    })
}

fn roi_align_run<T: GemmFloat>(
    p: &RoiAlignParams,
    x: &[T],
    rois: &[T],
    batch: &[i64],
) -> Result<Vec<T>> {
    let plane = p.h * p.w;
    let bins = p.ph * p.pw;
    let mut y = vec![T::zero(); batch.len() * p.c * bins];
    if plane == 0 {
        // Every sample reads outside an empty image.
        return Ok(y);
    }
    let scale = T::from_f64(p.scale);
    let offset = T::from_f64(if p.half_pixel { 0.5 } else { 0.0 });
    let mut taps: Vec<Tap<T>> = Vec::new();
    for (r, &bi) in batch.iter().enumerate() {
        let roi = &rois[r * 4..r * 4 + 4];
        let start_w = roi[0] * scale - offset;
        let start_h = roi[1] * scale - offset;
        let end_w = roi[2] * scale - offset;
        let end_h = roi[3] * scale - offset;
        let mut roi_w = end_w - start_w;
        let mut roi_h = end_h - start_h;
        if !p.half_pixel {
            // Malformed ROIs are forced to 1x1 in the legacy mode.
            roi_w = roi_w.max(T::one());
            roi_h = roi_h.max(T::one());
        }
        let bin_h = roi_h / T::from_f64(p.ph as f64);
        let bin_w = roi_w / T::from_f64(p.pw as f64);
        let adaptive = |v: T| -> usize {
            let c = v.ceil().to_f64();
            if c.is_finite() && c > 0.0 {
                // Bounded so that a huge ROI cannot request an absurd sample count.
                (c as usize).min(1 << 16)
            } else {
                0
            }
        };
        let (gh, gw) = if p.sampling > 0 {
            (p.sampling, p.sampling)
        } else {
            (adaptive(bin_h), adaptive(bin_w))
        };
        // The samples of one ROI are kept: their count comes from attributes, so it is checked
        // against the memory budget before anything is allocated (and before gh * gw can wrap).
        let samples = (p.ph as u128) * (p.pw as u128) * (gh as u128) * (gw as u128);
        crate::limits::check_bytes(samples * std::mem::size_of::<Tap<T>>() as u128, || {
            format!(
                "{samples} bilinear samples per ROI ({} x {} bins, {gh} x {gw} per bin: \
                 output_height, output_width, sampling_ratio)",
                p.ph, p.pw
            )
        })
        .map_err(crate::RtError::Msg)?;
        let count = T::from_f64((gh * gw).max(1) as f64);
        // Sample positions and weights are shared by every channel: compute them once per ROI.
        taps.clear();
        for ph in 0..p.ph {
            for pw in 0..p.pw {
                for iy in 0..gh {
                    let yy = start_h
                        + T::from_f64(ph as f64) * bin_h
                        + T::from_f64(iy as f64 + 0.5) * bin_h / T::from_f64(gh as f64);
                    for ix in 0..gw {
                        let xx = start_w
                            + T::from_f64(pw as f64) * bin_w
                            + T::from_f64(ix as f64 + 0.5) * bin_w / T::from_f64(gw as f64);
                        taps.push(roi_tap(p.h, p.w, yy, xx).unwrap_or_default());
                    }
                }
            }
        }
        let per_bin = gh * gw;
        let base = bi as usize * p.c * plane;
        for ch in 0..p.c {
            let src = &x[base + ch * plane..base + (ch + 1) * plane];
            let out = &mut y[(r * p.c + ch) * bins..(r * p.c + ch + 1) * bins];
            for (bin, o) in out.iter_mut().enumerate() {
                let bt = &taps[bin * per_bin..(bin + 1) * per_bin];
                *o = if p.max_mode {
                    let mut acc: Option<T> = None;
                    for t in bt {
                        let v = (0..4)
                            .map(|k| t.w[k] * src[t.pos[k]])
                            .fold(T::neg_infinity(), T::max);
                        acc = Some(acc.map_or(v, |a| a.max(v)));
                    }
                    acc.unwrap_or(T::zero())
                } else {
                    let mut s = T::zero();
                    for t in bt {
                        s += t.w[0] * src[t.pos[0]]
                            + t.w[1] * src[t.pos[1]]
                            + t.w[2] * src[t.pos[2]]
                            + t.w[3] * src[t.pos[3]];
                    }
                    s / count
                };
            }
        }
    }
    Ok(y)
}

// ---------------------------------------------------------------------------------------------
// MaxRoiPool

/// MaxRoiPool (opset 1): max pooling over integer-rounded regions of interest
/// `[batch_id, x1, y1, x2, y2]` onto a `pooled_shape` grid (Fast R-CNN ROI pooling).
/// Empty bins produce 0.
fn max_roi_pool(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let rois = ins.tensor(1)?;
    check_float(x, "X")?;
    check_float(rois, "rois")?;
    let (xs, rs) = (x.shape(), rois.shape());
    if xs.len() != 4 || rs.len() != 2 || rs[1] != 5 {
        bail!("MaxRoiPool needs X [N,C,H,W] and rois [num_rois, 5], got {xs:?} and {rs:?}");
    }
    if ctx.node.attr("pooled_shape").is_none() {
        bail!("required attribute 'pooled_shape' is missing");
    }
    let pooled = usize_attr(ctx.node, "pooled_shape", 2, 0, 1)?;
    let scale = ctx.node.float_or("spatial_scale", 1.0)? as f64;
    let (n, c, h, w) = (xs[0], xs[1], xs[2], xs[3]);
    let (ph, pw) = (pooled[0], pooled[1]);
    let rv = rois.to_f64_vec()?;
    let out_shape = vec![rs[0], c, ph, pw];
    let geom = RoiPoolGeom {
        n,
        c,
        h,
        w,
        ph,
        pw,
        scale,
    };
    let t = float_dispatch!(x.dtype(), T => {
        let xv = T::load(x)?;
        let y = max_roi_pool_run::<T>(&geom, &xv, &rv)?;
        T::store(x.dtype(), out_shape, y)?
    });
    Ok(vec![Value::tensor(t)])
}

#[derive(Clone, Copy)]
struct RoiPoolGeom {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    ph: usize,
    pw: usize,
    scale: f64,
}

fn max_roi_pool_run<T: GemmFloat>(g: &RoiPoolGeom, xv: &[T], rv: &[f64]) -> Result<Vec<T>> {
    let RoiPoolGeom {
        n,
        c,
        h,
        w,
        ph,
        pw,
        scale,
    } = *g;
    let plane = h * w;
    let mut y = vec![T::zero(); rv.len() / 5 * c * ph * pw];
    for (r, roi) in rv.chunks_exact(5).enumerate() {
        let bi = roi[0];
        if !(bi >= 0.0 && (bi as usize) < n) {
            bail!("ROI {r} has batch index {bi}, out of range for {n} images");
        }
        let bi = bi as usize;
        // Coordinates are rounded half away from zero, as C's round() does.
        let q = |v: f64| -> i64 { (v * scale).round().clamp(-1e15, 1e15) as i64 };
        let (sw, sh, ew, eh) = (q(roi[1]), q(roi[2]), q(roi[3]), q(roi[4]));
        let roi_h = (eh - sh + 1).max(1) as f64;
        let roi_w = (ew - sw + 1).max(1) as f64;
        let bin_h = roi_h / ph as f64;
        let bin_w = roi_w / pw as f64;
        let span = |start: i64, i: usize, bin: f64, len: usize| -> (usize, usize) {
            let lo = (i as f64 * bin).floor() as i64 + start;
            let hi = ((i + 1) as f64 * bin).ceil() as i64 + start;
            (
                lo.clamp(0, len as i64) as usize,
                hi.clamp(0, len as i64) as usize,
            )
        };
        for ch in 0..c {
            let src = &xv[(bi * c + ch) * plane..(bi * c + ch + 1) * plane];
            let out = &mut y[(r * c + ch) * ph * pw..(r * c + ch + 1) * ph * pw];
            for i in 0..ph {
                let (h0, h1) = span(sh, i, bin_h, h);
                for j in 0..pw {
                    let (w0, w1) = span(sw, j, bin_w, w);
                    out[i * pw + j] = if h1 <= h0 || w1 <= w0 {
                        T::zero()
                    } else {
                        let mut m = T::neg_infinity();
                        for yy in h0..h1 {
                            for &v in &src[yy * w + w0..yy * w + w1] {
                                m = m.max(v);
                            }
                        }
                        m
                    };
                }
            }
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(c: usize, oc: usize, group: usize, og: usize) -> DeformGeom {
        DeformGeom {
            n: 1,
            c,
            ih: 4,
            iw: 5,
            oc,
            kh: 2,
            kw: 2,
            oh: 3,
            ow: 4,
            group,
            offset_group: og,
            stride: [1, 1],
            dil: [1, 1],
            pad: [0, 0],
        }
    }

    #[test]
    fn deform_conv_zero_offsets_is_plain_conv() {
        let g = geom(2, 4, 2, 1);
        let x: Vec<f64> = (0..2 * 20).map(|i| (i * 7 % 11) as f64 - 5.0).collect();
        let w: Vec<f64> = (0..4 * 4).map(|i| (i % 5) as f64 * 0.5 - 1.0).collect();
        let off = vec![0.0; 2 * 4 * 12];
        let y = deform_conv_run::<f64>(&g, &x, &w, &off, None, None, 1).unwrap();
        for o in 0..4 {
            let ci = o / 2; // one input channel per group
            for i in 0..3 {
                for j in 0..4 {
                    let mut acc = 0.0;
                    for a in 0..2 {
                        for b in 0..2 {
                            acc += x[ci * 20 + (i + a) * 5 + j + b] * w[o * 4 + a * 2 + b];
                        }
                    }
                    assert!((y[o * 12 + i * 4 + j] - acc).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn deform_conv_fractional_offset_interpolates_and_masks() {
        // 1x1-like check with a 2x2 kernel whose only non-zero tap is (0, 0).
        let g = geom(1, 1, 1, 1);
        let x: Vec<f32> = (0..20).map(|i| i as f32).collect();
        let w = vec![1.0, 0.0, 0.0, 0.0];
        let mut off = vec![0.0f32; 8 * 12];
        // Tap (0,0): dy = 0.5 and dx = 0.25 everywhere; x is linear so bilinear is exact.
        off[..12].fill(0.5);
        off[12..24].fill(0.25);
        let mut mask = vec![1.0f32; 4 * 12];
        mask[..12].fill(2.0);
        let y = deform_conv_run::<f32>(&g, &x, &w, &off, Some(&[1.0]), Some(&mask), 1).unwrap();
        for i in 0..3 {
            for j in 0..4 {
                let want = 1.0 + 2.0 * ((i as f32 + 0.5) * 5.0 + j as f32 + 0.25);
                assert!((y[i * 4 + j] - want).abs() < 1e-4, "{i},{j}");
            }
        }
    }

    #[test]
    fn bilinear_reads_zero_outside() {
        let plane = [1.0f32, 2.0, 3.0, 4.0];
        assert_eq!(bilinear_zero(&plane, 2, 2, -0.5, 0.0), 0.5);
        assert_eq!(bilinear_zero(&plane, 2, 2, 5.0, 0.0), 0.0);
        assert_eq!(bilinear_zero(&plane, 2, 2, f32::NAN, 0.0), 0.0);
    }

    #[test]
    fn roi_align_constant_image() {
        let p = RoiAlignParams {
            c: 1,
            h: 6,
            w: 6,
            ph: 2,
            pw: 3,
            sampling: 0,
            scale: 1.0,
            half_pixel: true,
            max_mode: false,
        };
        let x = vec![3.0f32; 36];
        let y = roi_align_run::<f32>(&p, &x, &[0.5, 1.0, 4.5, 5.0], &[0]).unwrap();
        assert!(y.iter().all(|&v| (v - 3.0).abs() < 1e-6), "{y:?}");
    }

    #[test]
    fn max_roi_pool_bins() {
        let g = RoiPoolGeom {
            n: 1,
            c: 1,
            h: 5,
            w: 5,
            ph: 2,
            pw: 2,
            scale: 1.0,
        };
        let x: Vec<f32> = (0..25).map(|i| i as f32).collect();
        // The full image splits into overlapping 3x3 bins; an ROI past the image is empty.
        let rois = [0.0, 0.0, 0.0, 4.0, 4.0, 0.0, 10.0, 10.0, 12.0, 12.0];
        let y = max_roi_pool_run::<f32>(&g, &x, &rois).unwrap();
        assert_eq!(y, vec![12.0, 14.0, 22.0, 24.0, 0.0, 0.0, 0.0, 0.0]);
        assert!(max_roi_pool_run::<f32>(&g, &x, &[1.0, 0.0, 0.0, 1.0, 1.0]).is_err());
    }
}
