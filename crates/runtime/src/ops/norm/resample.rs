//! Resampling: `Resize` (opsets 10-19+), `Upsample`, `GridSample` and `AffineGrid`.
//!
//! `Resize` is separable: each resized axis is one pass over the data that computes every
//! output position from a precomputed list of taps (source index, weight). Passes along an
//! inner-most axis gather scalars; passes along outer axes combine whole contiguous rows, so the
//! inner loops stay contiguous either way.

use super::{downcast, f64_to_tensor, upcast, Real};
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::common::norm_axis;
use crate::value::Value;
use npuc_ir::{DType, Tensor};

pub fn register(r: &mut Registry) {
    r.add("Resize", 10, resize);
    r.add("Upsample", 7, upsample);
    r.add("GridSample", 16, grid_sample);
    r.add("AffineGrid", 20, affine_grid);
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Nearest,
    Linear,
    Cubic,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Coord {
    HalfPixel,
    HalfPixelSymmetric,
    PytorchHalfPixel,
    AlignCorners,
    Asymmetric,
    TfCropAndResize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Nearest {
    RoundPreferFloor,
    RoundPreferCeil,
    Floor,
    Ceil,
    /// Opset < 11 `Resize` and `Upsample`: floor when upsampling, ceil when downsampling.
    Legacy,
}

/// Everything that decides how one axis is resampled.
struct ResizeCfg {
    mode: Mode,
    coord: Coord,
    nearest: Nearest,
    cubic_a: f64,
    exclude_outside: bool,
    extrapolation: f64,
    antialias: bool,
}

/// `Resize`: nearest / linear / cubic resampling with every coordinate transformation mode,
/// scales or sizes (with `axes` and `keep_aspect_ratio_policy`), antialiasing and
/// `tf_crop_and_resize` regions of interest.
fn resize(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let node = ctx.node;
    let x = ins.tensor(0)?;
    let rank = x.rank();
    let present = |i: usize| ins.opt_tensor(i).filter(|t| !t.is_empty());
    let (roi, scales, sizes) = if ctx.opset < 11 {
        (None, present(1), None)
    } else {
        (present(1), present(2), present(3))
    };
    let legacy = ctx.opset < 11;
    let mode = match node.str_or("mode", "nearest")? {
        "nearest" => Mode::Nearest,
        "linear" | "bilinear" | "trilinear" => Mode::Linear,
        "cubic" | "bicubic" if !legacy => Mode::Cubic,
        m => bail!("unsupported Resize mode '{m}'"),
    };
    let coord = if legacy {
        Coord::Asymmetric
    } else {
        match node.str_or("coordinate_transformation_mode", "half_pixel")? {
            "half_pixel" => Coord::HalfPixel,
            "half_pixel_symmetric" => Coord::HalfPixelSymmetric,
            "pytorch_half_pixel" => Coord::PytorchHalfPixel,
            "align_corners" => Coord::AlignCorners,
            "asymmetric" => Coord::Asymmetric,
            "tf_crop_and_resize" => Coord::TfCropAndResize,
            // Deprecated in opset 13; it is half_pixel for the sampling grid.
            "tf_half_pixel_for_nn" => Coord::HalfPixel,
            m => bail!("unsupported coordinate_transformation_mode '{m}'"),
        }
    };
    let nearest = if legacy {
        Nearest::Legacy
    } else {
        match node.str_or("nearest_mode", "round_prefer_floor")? {
            "round_prefer_floor" => Nearest::RoundPreferFloor,
            "round_prefer_ceil" => Nearest::RoundPreferCeil,
            "floor" => Nearest::Floor,
            "ceil" => Nearest::Ceil,
            m => bail!("unsupported nearest_mode '{m}'"),
        }
    };
    let cfg = ResizeCfg {
        mode,
        coord,
        nearest,
        cubic_a: node.float_or("cubic_coeff_a", -0.75)? as f64,
        exclude_outside: node.int_or("exclude_outside", 0)? != 0,
        extrapolation: node.float_or("extrapolation_value", 0.0)? as f64,
        antialias: ctx.opset >= 18 && node.int_or("antialias", 0)? != 0,
    };
    if cfg.antialias && mode == Mode::Nearest {
        bail!("antialias is not supported with mode 'nearest'");
    }
    let axes: Vec<usize> = match node.attr_ints("axes")? {
        Some(a) if ctx.opset >= 18 => {
            let v = a
                .iter()
                .map(|&a| norm_axis(a, rank))
                .collect::<Result<Vec<_>>>()?;
            let mut seen = vec![false; rank];
            for &a in &v {
                if std::mem::replace(&mut seen[a], true) {
                    bail!("axes contains axis {a} twice");
                }
            }
            v
        }
        _ => (0..rank).collect(),
    };
    let policy = if ctx.opset >= 18 {
        node.str_or("keep_aspect_ratio_policy", "stretch")?
    } else {
        "stretch"
    };
    let scales = match scales {
        Some(s) => Some(s.to_f64_vec()?),
        None => None,
    };
    let sizes = match sizes {
        Some(s) => Some(s.to_i64_vec()?),
        None => None,
    };
    let roi = match roi {
        Some(r) => Some(r.to_f64_vec()?),
        None => None,
    };
    resize_impl(x, &axes, scales, sizes, roi, policy, &cfg, ctx.threads)
        .map(|t| vec![Value::tensor(t)])
}

/// `Upsample` (deprecated): nearest or (bi)linear with asymmetric coordinates; scales come
/// from an attribute (opset 7) or an input (opset 9).
fn upsample(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let scales: Vec<f64> = if ctx.opset >= 9 {
        ins.tensor(1)?.to_f64_vec()?
    } else {
        ctx.node
            .attr_floats("scales")?
            .ok_or_else(|| crate::RtError::msg("Upsample needs a 'scales' attribute"))?
            .iter()
            .map(|&s| s as f64)
            .collect()
    };
    let mode = match ctx.node.str_or("mode", "nearest")? {
        "nearest" => Mode::Nearest,
        "linear" | "bilinear" | "trilinear" => Mode::Linear,
        m => bail!("unsupported Upsample mode '{m}'"),
    };
    let cfg = ResizeCfg {
        mode,
        coord: Coord::Asymmetric,
        nearest: Nearest::Legacy,
        cubic_a: -0.75,
        exclude_outside: false,
        extrapolation: 0.0,
        antialias: false,
    };
    let axes: Vec<usize> = (0..x.rank()).collect();
    resize_impl(
        x,
        &axes,
        Some(scales),
        None,
        None,
        "stretch",
        &cfg,
        ctx.threads,
    )
    .map(|t| vec![Value::tensor(t)])
}

/// Resolves output sizes and per-axis scale factors, then resamples axis by axis.
#[allow(clippy::too_many_arguments)]
fn resize_impl(
    x: &Tensor,
    axes: &[usize],
    scales: Option<Vec<f64>>,
    sizes: Option<Vec<i64>>,
    roi: Option<Vec<f64>>,
    policy: &str,
    cfg: &ResizeCfg,
    threads: usize,
) -> Result<Tensor> {
    let shape = x.shape().to_vec();
    let rank = shape.len();
    let mut scale_f = vec![1.0f64; rank];
    let mut out_shape = shape.clone();
    match (&scales, &sizes) {
        (_, Some(sz)) => {
            if sz.len() != axes.len() {
                bail!("sizes has {} entries for {} axes", sz.len(), axes.len());
            }
            for (&a, &s) in axes.iter().zip(sz) {
                if s < 0 {
                    bail!("sizes must be non-negative, got {s}");
                }
                out_shape[a] = s as usize;
                scale_f[a] = if shape[a] == 0 {
                    1.0
                } else {
                    s as f64 / shape[a] as f64
                };
            }
            if policy != "stretch" {
                let it = axes.iter().map(|&a| scale_f[a]);
                let s = match policy {
                    "not_larger" => it.fold(f64::INFINITY, f64::min),
                    "not_smaller" => it.fold(f64::NEG_INFINITY, f64::max),
                    p => bail!("unsupported keep_aspect_ratio_policy '{p}'"),
                };
                for &a in axes {
                    scale_f[a] = s;
                    out_shape[a] = (s * shape[a] as f64 + 0.5) as usize;
                }
            }
        }
        (Some(sc), None) => {
            if sc.len() != axes.len() {
                bail!("scales has {} entries for {} axes", sc.len(), axes.len());
            }
            for (&a, &s) in axes.iter().zip(sc) {
                if s.is_nan() || s <= 0.0 || s.is_infinite() {
                    bail!("scales must be positive, got {s}");
                }
                scale_f[a] = s;
                out_shape[a] = (s * shape[a] as f64).floor() as usize;
            }
        }
        (None, None) => bail!("Resize needs either scales or sizes"),
    }
    // roi in full-rank [starts..., ends...] form.
    let roi_full: Option<Vec<f64>> = match roi {
        Some(r) if cfg.coord == Coord::TfCropAndResize => {
            let n = axes.len();
            if r.len() != 2 * n {
                bail!("roi has {} entries, expected {}", r.len(), 2 * n);
            }
            let mut full = vec![0.0; 2 * rank];
            full[rank..].fill(1.0);
            for (i, &a) in axes.iter().enumerate() {
                full[a] = r[i];
                full[rank + a] = r[n + i];
            }
            Some(full)
        }
        None if cfg.coord == Coord::TfCropAndResize => {
            bail!("coordinate_transformation_mode tf_crop_and_resize needs roi")
        }
        _ => None,
    };
    let dt = x.dtype();
    if out_shape.iter().product::<usize>() == 0 {
        return Ok(Tensor::zeros(dt, out_shape));
    }
    if shape.iter().product::<usize>() == 0 {
        bail!(
            "cannot resize an empty input {:?} to {:?}",
            shape,
            out_shape
        );
    }
    match dt {
        DType::F32 | DType::F16 | DType::BF16 => {
            let xf = upcast(x)?;
            let v = resample_axes::<f32>(
                xf.as_slice::<f32>()?,
                &shape,
                &out_shape,
                &scale_f,
                roi_full.as_deref(),
                axes,
                cfg,
                threads,
            );
            downcast(Tensor::from_vec(out_shape, v)?, dt)
        }
        DType::F64 => {
            let v = resample_axes::<f64>(
                x.as_slice::<f64>()?,
                &shape,
                &out_shape,
                &scale_f,
                roi_full.as_deref(),
                axes,
                cfg,
                threads,
            );
            Ok(Tensor::from_vec(out_shape, v)?)
        }
        _ if dt.is_int() => {
            let xv = x.to_f64_vec()?;
            let v = resample_axes::<f64>(
                &xv,
                &shape,
                &out_shape,
                &scale_f,
                roi_full.as_deref(),
                axes,
                cfg,
                threads,
            );
            int_from_f64(dt, out_shape, &v)
        }
        other => bail!("Resize does not support {other} inputs"),
    }
}

/// Rounds (half to even, as numpy does) and saturates f64 values into an integer tensor.
fn int_from_f64(dt: DType, shape: Vec<usize>, v: &[f64]) -> Result<Tensor> {
    macro_rules! conv {
        ($t:ty) => {
            Tensor::from_vec(
                shape,
                v.iter()
                    .map(|&x| {
                        x.round_ties_even()
                            .clamp(<$t>::MIN as f64, <$t>::MAX as f64) as $t
                    })
                    .collect::<Vec<$t>>(),
            )?
        };
    }
    Ok(match dt {
        DType::I8 => conv!(i8),
        DType::U8 => conv!(u8),
        DType::I16 => conv!(i16),
        DType::U16 => conv!(u16),
        DType::I32 => conv!(i32),
        DType::U32 => conv!(u32),
        DType::I64 => conv!(i64),
        DType::U64 => conv!(u64),
        other => bail!("cannot resize {other} tensors"),
    })
}

/// Taps of one resized axis: `n` (index, weight) pairs per output position.
struct Taps<F> {
    n: usize,
    idx: Vec<usize>,
    w: Vec<F>,
    /// Output positions that fall outside a `tf_crop_and_resize` region.
    extrapolated: Vec<bool>,
}

fn cubic_coeffs(r: f64, a: f64) -> [f64; 4] {
    [
        ((a * (r + 1.0) - 5.0 * a) * (r + 1.0) + 8.0 * a) * (r + 1.0) - 4.0 * a,
        ((a + 2.0) * r - (a + 3.0)) * r * r + 1.0,
        ((a + 2.0) * (1.0 - r) - (a + 3.0)) * (1.0 - r) * (1.0 - r) + 1.0,
        ((a * ((1.0 - r) + 1.0) - 5.0 * a) * ((1.0 - r) + 1.0) + 8.0 * a) * ((1.0 - r) + 1.0)
            - 4.0 * a,
    ]
}

/// Computes the taps of one axis (input extent `in_w`, output extent `out_w`).
fn axis_taps<F: Real>(
    in_w: usize,
    out_w: usize,
    scale: f64,
    roi: Option<(f64, f64)>,
    cfg: &ResizeCfg,
) -> Taps<F> {
    let in_f = in_w as f64;
    let out_f = scale * in_f;
    // Number of taps: the coefficient functions of the reference define the footprint.
    let aa_scale = scale.min(1.0);
    let (n, start) = match cfg.mode {
        Mode::Nearest => (1usize, 0i64),
        Mode::Linear if cfg.antialias => {
            let s = (-1.0 / aa_scale).floor() as i64 + 1;
            ((2 - 2 * s) as usize, s)
        }
        Mode::Linear => (2, 0),
        Mode::Cubic if cfg.antialias => {
            let s = (-2.0 / aa_scale).floor() as i64 + 1;
            ((2 - 2 * s) as usize, s)
        }
        Mode::Cubic => (4, -1),
    };
    let mut taps = Taps {
        n,
        idx: Vec::with_capacity(out_w * n),
        w: Vec::with_capacity(out_w * n),
        extrapolated: vec![false; out_w],
    };
    let mut coeffs = vec![0f64; n];
    let last = in_w as i64 - 1;
    for y in 0..out_w {
        let yf = y as f64;
        let xo = match cfg.coord {
            Coord::AlignCorners => {
                if out_f == 1.0 {
                    0.0
                } else {
                    yf * (in_f - 1.0) / (out_f - 1.0)
                }
            }
            Coord::Asymmetric => yf / scale,
            Coord::TfCropAndResize => {
                let (r0, r1) = roi.unwrap_or((0.0, 1.0));
                let v = if out_f == 1.0 {
                    (r1 - r0) * (in_f - 1.0) / 2.0
                } else {
                    yf * (r1 - r0) * (in_f - 1.0) / (out_f - 1.0)
                };
                v + r0 * (in_f - 1.0)
            }
            Coord::PytorchHalfPixel => {
                if out_f == 1.0 {
                    -0.5
                } else {
                    (yf + 0.5) / scale - 0.5
                }
            }
            Coord::HalfPixel => (yf + 0.5) / scale - 0.5,
            Coord::HalfPixelSymmetric => {
                let adjustment = out_w as f64 / out_f;
                let offset = in_f / 2.0 * (1.0 - adjustment);
                offset + (yf + 0.5) / scale - 0.5
            }
        };
        if cfg.coord == Coord::TfCropAndResize && (xo < 0.0 || xo > in_f - 1.0) {
            taps.extrapolated[y] = true;
        }
        if cfg.mode == Mode::Nearest {
            let fl = xo.floor();
            let r = xo - fl;
            let pick = if r == 0.0 {
                fl
            } else {
                match cfg.nearest {
                    Nearest::RoundPreferFloor if r <= 0.5 => fl,
                    Nearest::RoundPreferCeil if r < 0.5 => fl,
                    Nearest::RoundPreferFloor | Nearest::RoundPreferCeil => fl + 1.0,
                    Nearest::Floor => fl,
                    Nearest::Ceil => fl + 1.0,
                    Nearest::Legacy if scale < 1.0 => fl + 1.0,
                    Nearest::Legacy => fl,
                }
            };
            taps.idx.push((pick as i64).clamp(0, last) as usize);
            taps.w.push(F::one());
            continue;
        }
        // As in the reference: an integral coordinate is treated as ratio 1 from the point
        // below it, so the taps are centred consistently.
        let (base, ratio) = if xo == xo.floor() {
            (xo as i64 - 1, 1.0)
        } else {
            (xo.floor() as i64, xo - xo.floor())
        };
        match (cfg.mode, cfg.antialias) {
            (Mode::Linear, false) => {
                coeffs[0] = 1.0 - ratio;
                coeffs[1] = ratio;
            }
            (Mode::Cubic, false) => coeffs.copy_from_slice(&cubic_coeffs(ratio, cfg.cubic_a)),
            (Mode::Linear, true) => {
                for (k, c) in coeffs.iter_mut().enumerate() {
                    let arg = ((start + k as i64) as f64 - ratio) * aa_scale;
                    *c = (1.0 - arg.abs()).clamp(0.0, 1.0);
                }
                normalize(&mut coeffs);
            }
            (Mode::Cubic, true) => {
                let a = cfg.cubic_a;
                for (k, c) in coeffs.iter_mut().enumerate() {
                    let x = (aa_scale * ((start + k as i64) as f64 - ratio)).abs();
                    let (x2, x3) = (x * x, x * x * x);
                    *c = if x <= 1.0 {
                        (a + 2.0) * x3 - (a + 3.0) * x2 + 1.0
                    } else if x < 2.0 {
                        a * x3 - 5.0 * a * x2 + 8.0 * a * x - 4.0 * a
                    } else {
                        0.0
                    };
                }
                normalize(&mut coeffs);
            }
            (Mode::Nearest, _) => unreachable!("handled above"),
        }
        let first = base + start;
        if cfg.exclude_outside {
            for (k, c) in coeffs.iter_mut().enumerate() {
                let i = first + k as i64;
                if i < 0 || i > last {
                    *c = 0.0;
                }
            }
            normalize(&mut coeffs);
        }
        for (k, &c) in coeffs.iter().enumerate() {
            taps.idx.push((first + k as i64).clamp(0, last) as usize);
            taps.w.push(F::of(c));
        }
    }
    taps
}

/// Scales `c` to sum to one (left alone when the sum is zero).
fn normalize(c: &mut [f64]) {
    let s: f64 = c.iter().sum();
    if s != 0.0 {
        c.iter_mut().for_each(|v| *v /= s);
    }
}

/// Resamples every axis in `axes` order whose size, scale or roi changes it.
#[allow(clippy::too_many_arguments)]
fn resample_axes<F: Real + Send + Sync>(
    x: &[F],
    in_shape: &[usize],
    out_shape: &[usize],
    scales: &[f64],
    roi: Option<&[f64]>,
    axes: &[usize],
    cfg: &ResizeCfg,
    threads: usize,
) -> Vec<F> {
    let rank = in_shape.len();
    let mut cur_shape = in_shape.to_vec();
    let mut cur: Option<Vec<F>> = None;
    for &a in axes {
        let axis_roi = roi.map(|r| (r[a], r[a + rank]));
        let trivial_roi =
            axis_roi.is_none_or(|(s, e)| (s - 0.0).abs() < 1e-9 && (e - 1.0).abs() < 1e-9);
        if (scales[a] - 1.0).abs() < 1e-9 && out_shape[a] == cur_shape[a] && trivial_roi {
            continue;
        }
        let taps = axis_taps::<F>(cur_shape[a], out_shape[a], scales[a], axis_roi, cfg);
        let src: &[F] = cur.as_deref().unwrap_or(x);
        let outer: usize = cur_shape[..a].iter().product();
        let inner: usize = cur_shape[a + 1..].iter().product();
        let next = resample_pass(
            src,
            outer,
            cur_shape[a],
            inner,
            &taps,
            F::of(cfg.extrapolation),
            threads,
        );
        cur_shape[a] = out_shape[a];
        // The previous pass's result was only this pass's input: back to the pool.
        if let Some(prev) = cur.replace(next) {
            crate::buffers::release(prev);
        }
    }
    cur.unwrap_or_else(|| x.to_vec())
}

/// Outputs from which a resampling pass splits its outer rows across threads.
const RESAMPLE_PAR_MIN: usize = 1 << 16;

/// One axis: `[outer, in_w, inner]` -> `[outer, out_w, inner]`, the outer rows split across
/// `threads` when large.
fn resample_pass<F: Real + Send + Sync>(
    src: &[F],
    outer: usize,
    in_w: usize,
    inner: usize,
    taps: &Taps<F>,
    extrapolation: F,
    threads: usize,
) -> Vec<F> {
    use rayon::prelude::*;
    let out_w = taps.extrapolated.len();
    // Every value is written below (each output position is a gather, a sum or the
    // extrapolation value).
    let mut dst = crate::buffers::for_overwrite(outer * out_w * inner);
    let plane = out_w * inner;
    if threads > 1 && outer > 1 && dst.len() >= RESAMPLE_PAR_MIN && plane > 0 {
        let per = outer.div_ceil(threads);
        dst.par_chunks_mut(per * plane)
            .enumerate()
            .for_each(|(i, part)| {
                for (j, d) in part.chunks_exact_mut(plane).enumerate() {
                    let o = i * per + j;
                    resample_row(
                        &src[o * in_w * inner..][..in_w * inner],
                        d,
                        inner,
                        taps,
                        extrapolation,
                    );
                }
            });
    } else {
        for o in 0..outer {
            let s = &src[o * in_w * inner..(o + 1) * in_w * inner];
            let d = &mut dst[o * out_w * inner..(o + 1) * out_w * inner];
            resample_row(s, d, inner, taps, extrapolation);
        }
    }
    dst
}

/// One outer row of [`resample_pass`]: `s` is `[in_w, inner]`, `d` `[out_w, inner]`.
fn resample_row<F: Real>(s: &[F], d: &mut [F], inner: usize, taps: &Taps<F>, extrapolation: F) {
    let n = taps.n;
    if inner == 1 && n == 1 {
        // Nearest: a plain gather.
        for (y, dv) in d.iter_mut().enumerate() {
            *dv = if taps.extrapolated[y] {
                extrapolation
            } else {
                s[taps.idx[y]]
            };
        }
        return;
    }
    if inner == 1 {
        for (y, dv) in d.iter_mut().enumerate() {
            *dv = if taps.extrapolated[y] {
                extrapolation
            } else {
                let (ix, w) = (&taps.idx[y * n..(y + 1) * n], &taps.w[y * n..(y + 1) * n]);
                ix.iter()
                    .zip(w)
                    .fold(F::zero(), |acc, (&i, &w)| acc + s[i] * w)
            };
        }
        return;
    }
    for (y, drow) in d.chunks_exact_mut(inner).enumerate() {
        if taps.extrapolated[y] {
            drow.fill(extrapolation);
            continue;
        }
        let (ix, w) = (&taps.idx[y * n..(y + 1) * n], &taps.w[y * n..(y + 1) * n]);
        if n == 1 {
            crate::ops::common::copy_run(drow, &s[ix[0] * inner..(ix[0] + 1) * inner]);
            continue;
        }
        let w0 = w[0];
        for (dv, &sv) in drow.iter_mut().zip(&s[ix[0] * inner..(ix[0] + 1) * inner]) {
            *dv = sv * w0;
        }
        for (&i, &wk) in ix.iter().zip(w).skip(1) {
            for (dv, &sv) in drow.iter_mut().zip(&s[i * inner..(i + 1) * inner]) {
                *dv = *dv + sv * wk;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GridSample / AffineGrid

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pad {
    Zeros,
    Border,
    Reflection,
}

/// Reflects `x` into `[lo, hi]` by bouncing off the borders.
fn reflect(x: f64, lo: f64, hi: f64) -> f64 {
    let rng = hi - lo;
    if rng <= 0.0 {
        return lo;
    }
    if x < lo {
        let dx = lo - x;
        let n = (dx / rng) as i64;
        let r = dx - n as f64 * rng;
        if n % 2 == 0 {
            lo + r
        } else {
            hi - r
        }
    } else if x > hi {
        let dx = x - hi;
        let n = (dx / rng) as i64;
        let r = dx - n as f64 * rng;
        if n % 2 == 0 {
            hi - r
        } else {
            lo + r
        }
    } else {
        x
    }
}

/// `GridSample`: samples `X` (`[N, C, D1..Dr]`) at the normalised coordinates of `grid`
/// (`[N, O1..Or, r]`, last entry = innermost axis) with nearest, (bi/tri)linear or (bi)cubic
/// interpolation and zeros / border / reflection padding; 2-D and 3-D.
fn grid_sample(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let grid = ins.tensor(1)?;
    let mode = match ctx.node.str_or(
        "mode",
        if ctx.opset >= 20 {
            "linear"
        } else {
            "bilinear"
        },
    )? {
        "nearest" => Mode::Nearest,
        "linear" | "bilinear" => Mode::Linear,
        "cubic" | "bicubic" => Mode::Cubic,
        m => bail!("unsupported GridSample mode '{m}'"),
    };
    let pad = match ctx.node.str_or("padding_mode", "zeros")? {
        "zeros" => Pad::Zeros,
        "border" => Pad::Border,
        "reflection" => Pad::Reflection,
        m => bail!("unsupported padding_mode '{m}'"),
    };
    let align = ctx.node.int_or("align_corners", 0)? != 0;
    let xs = x.shape().to_vec();
    let gs = grid.shape().to_vec();
    if xs.len() < 3 || gs.len() != xs.len() || gs[0] != xs[0] || gs[gs.len() - 1] != xs.len() - 2 {
        bail!("GridSample: X {:?} and grid {:?} do not match", xs, gs);
    }
    let r = xs.len() - 2;
    let (n, c) = (xs[0], xs[1]);
    let dims = &xs[2..];
    let pts: usize = gs[1..gs.len() - 1].iter().product();
    let sp: usize = dims.iter().product();
    let mut out_shape = vec![n, c];
    out_shape.extend_from_slice(&gs[1..gs.len() - 1]);
    let xv = x.to_f64_vec()?;
    let gv = grid.to_f64_vec()?;
    let mut out = vec![0f64; n * c * pts];
    let dstrides = crate::ops::common::strides(dims);
    let (lo, hi): (Vec<f64>, Vec<f64>) = dims
        .iter()
        .map(|&d| {
            if align {
                (0.0, d as f64 - 1.0)
            } else {
                (-0.5, d as f64 - 0.5)
            }
        })
        .unzip();
    // Per-point taps as (flat spatial offset or None for a zero pad, weight).
    let taps_per_dim: usize = match mode {
        Mode::Nearest => 1,
        Mode::Linear => 2,
        Mode::Cubic => 4,
    };
    let mut dim_taps: Vec<Vec<(Option<usize>, f64)>> = vec![Vec::with_capacity(4); r];
    let mut taps: Vec<(usize, f64)> = Vec::with_capacity(taps_per_dim.pow(r as u32));
    let mut coords = vec![0f64; r];
    // Index along one dim with padding applied: None contributes zero.
    let pixel = |i: i64, d: usize| -> Option<usize> {
        let len = dims[d] as i64;
        match pad {
            Pad::Zeros => (0..len).contains(&i).then_some(i as usize),
            Pad::Border => Some(i.clamp(0, len - 1) as usize),
            Pad::Reflection => {
                Some((reflect(i as f64, lo[d], hi[d]) as i64).clamp(0, len - 1) as usize)
            }
        }
    };
    for b in 0..n {
        for p in 0..pts {
            let g = &gv[(b * pts + p) * r..(b * pts + p + 1) * r];
            for d in 0..r {
                // The grid lists coordinates innermost axis first.
                let nv = g[r - 1 - d];
                let len = dims[d] as f64;
                let mut v = if align {
                    (nv + 1.0) / 2.0 * (len - 1.0)
                } else {
                    ((nv + 1.0) * len - 1.0) / 2.0
                };
                if mode == Mode::Nearest {
                    v = v.round_ties_even();
                }
                if v < lo[d] || v > hi[d] {
                    match pad {
                        Pad::Border => v = v.clamp(0.0, len - 1.0),
                        Pad::Reflection => v = reflect(v, lo[d], hi[d]),
                        Pad::Zeros => {}
                    }
                }
                coords[d] = v;
            }
            for d in 0..r {
                let v = coords[d];
                let t = &mut dim_taps[d];
                t.clear();
                match mode {
                    Mode::Nearest => t.push((pixel(v as i64, d), 1.0)),
                    Mode::Linear => {
                        let x0 = v.floor();
                        let f = v - x0;
                        t.push((pixel(x0 as i64, d), 1.0 - f));
                        t.push((pixel(x0 as i64 + 1, d), f));
                    }
                    Mode::Cubic => {
                        let x0 = v.floor();
                        let cf = cubic_coeffs(v - x0, -0.75);
                        for (k, &w) in cf.iter().enumerate() {
                            t.push((pixel(x0 as i64 - 1 + k as i64, d), w));
                        }
                    }
                }
            }
            // Cartesian product of the per-dim taps.
            taps.clear();
            taps.push((0, 1.0));
            for (d, t) in dim_taps.iter().enumerate() {
                let prev = std::mem::take(&mut taps);
                for &(off, w) in &prev {
                    for &(i, wd) in t {
                        if let Some(i) = i {
                            taps.push((off + i * dstrides[d], w * wd));
                        }
                    }
                }
            }
            for ch in 0..c {
                let img = &xv[(b * c + ch) * sp..(b * c + ch + 1) * sp];
                out[(b * c + ch) * pts + p] = taps.iter().map(|&(o, w)| img[o] * w).sum();
            }
        }
    }
    Ok(vec![Value::tensor(f64_to_tensor(
        x.dtype(),
        out_shape,
        out,
    )?)])
}

/// `AffineGrid`: the sampling grid (`[N, H, W, 2]` or `[N, D, H, W, 3]`) obtained by applying
/// `theta` (`[N, 2, 3]` / `[N, 3, 4]`) to the normalised output coordinates.
fn affine_grid(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let theta = ins.tensor(0)?;
    let size = ins.tensor(1)?.to_i64_vec()?;
    let align = ctx.node.int_or("align_corners", 0)? != 0;
    if size.len() != 4 && size.len() != 5 {
        bail!("size must have 4 or 5 entries, got {:?}", size);
    }
    if size.iter().any(|&s| s < 0) {
        bail!("size must be non-negative, got {:?}", size);
    }
    let r = size.len() - 2;
    let n = size[0] as usize;
    let spatial: Vec<usize> = size[2..].iter().map(|&s| s as usize).collect();
    if theta.shape() != [n, r, r + 1] {
        bail!(
            "theta has shape {:?}, expected [{n}, {r}, {}]",
            theta.shape(),
            r + 1
        );
    }
    let th = theta.to_f64_vec()?;
    // Normalised coordinate of index i along an axis of length len.
    let base = |i: usize, len: usize| -> f64 {
        if align {
            if len <= 1 {
                -1.0
            } else {
                -1.0 + 2.0 * i as f64 / (len - 1) as f64
            }
        } else {
            -1.0 + (2 * i + 1) as f64 / len as f64
        }
    };
    let pts: usize = spatial.iter().product();
    let mut out = Vec::with_capacity(n * pts * r);
    let st = crate::ops::common::strides(&spatial);
    let mut h = vec![0f64; r + 1];
    for b in 0..n {
        let t = &th[b * r * (r + 1)..(b + 1) * r * (r + 1)];
        for p in 0..pts {
            // Homogeneous point: innermost axis first (x, y[, z]), then 1.
            for d in 0..r {
                let i = (p / st[d]) % spatial[d];
                h[r - 1 - d] = base(i, spatial[d]);
            }
            h[r] = 1.0;
            for row in t.chunks_exact(r + 1) {
                out.push(row.iter().zip(&h).map(|(a, b)| a * b).sum::<f64>());
            }
        }
    }
    let mut shape = vec![n];
    shape.extend_from_slice(&spatial);
    shape.push(r);
    Ok(vec![Value::tensor(f64_to_tensor(
        theta.dtype(),
        shape,
        out,
    )?)])
}
