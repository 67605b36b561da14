//! Pooling: MaxPool (with indices), AveragePool, LpPool, the global pools and MaxUnpool.

use super::{
    float_dispatch, pads_attr, same_auto_pad, spatial_attr, to3, valid_range, Geom, PAR_MIN,
};
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::matmul::GemmFloat;
use crate::value::Value;
use npuc_ir::{bf16, f16, DType, Elem, Node, Tensor};
use rayon::prelude::*;

pub fn register(r: &mut Registry) {
    r.add("MaxPool", 1, max_pool);
    r.add("AveragePool", 1, average_pool);
    r.add("LpPool", 1, lp_pool);
    r.add("GlobalAveragePool", 1, global_average_pool);
    r.add("GlobalMaxPool", 1, global_max_pool);
    r.add("GlobalLpPool", 1, global_lp_pool);
    r.add("MaxUnpool", 9, max_unpool);
    r.define(&MAX_POOL_NHWC, max_pool_nhwc);
    r.define(&AVERAGE_POOL_NHWC, average_pool_nhwc);
}

/// `npuc.MaxPoolNhwc(X [N, H, W, C]) -> Y [N, OH, OW, C]`: 2-D MaxPool (MaxPool's attributes,
/// no indices output) of a channels-last f32 tensor, produced by the `layout-nhwc` pass so a
/// stem's pooling stays in the NHWC chain (each tap a contiguous run of `C` channels).
pub static MAX_POOL_NHWC: npuc_ir::opdef::OpDef = npuc_ir::opdef::OpDef {
    domain: "npuc",
    name: "MaxPoolNhwc",
    inputs: &[npuc_ir::opdef::Param::required("X")],
    outputs: &[npuc_ir::opdef::Param::required("Y")],
    attrs: &[],
    infer: infer_max_pool_nhwc,
};

/// MaxPool's rule on the NCHW view of `X`, its result read back as NHWC.
fn infer_max_pool_nhwc(n: &npuc_ir::infer::NodeIn) -> npuc_ir::infer::R<Vec<npuc_ir::TypeInfo>> {
    super::nhwc::infer_nhwc_as(n, "MaxPool")
}

/// `npuc.AveragePoolNhwc(X [N, H, W, C]) -> Y [N, OH, OW, C]`: 2-D AveragePool without
/// dilation (AveragePool's attributes) of a channels-last f32 tensor, produced by the
/// `layout-nhwc` pass so a pooling between convs (or before a recogniser's head) stays in the
/// NHWC chain.
pub static AVERAGE_POOL_NHWC: npuc_ir::opdef::OpDef = npuc_ir::opdef::OpDef {
    domain: "npuc",
    name: "AveragePoolNhwc",
    inputs: &[npuc_ir::opdef::Param::required("X")],
    outputs: &[npuc_ir::opdef::Param::required("Y")],
    attrs: &[],
    infer: infer_average_pool_nhwc,
};

/// AveragePool's rule on the NCHW view of `X`, its result read back as NHWC.
fn infer_average_pool_nhwc(
    n: &npuc_ir::infer::NodeIn,
) -> npuc_ir::infer::R<Vec<npuc_ir::TypeInfo>> {
    super::nhwc::infer_nhwc_as(n, "AveragePool")
}

/// `npuc.AveragePoolNhwc`: per output row, the window's input rows summed into column sums
/// (one contiguous add per row over `W * C` values), then per output pixel its window's
/// columns' channel vectors added and divided by the tap count; the same additions in the same
/// order as the NCHW kernel's undilated path ([`sum_pool_run`]), so the same values.
fn average_pool_nhwc(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let xs = x.shape();
    if xs.len() != 4 || x.dtype() != DType::F32 {
        bail!(
            "AveragePoolNhwc needs an f32 X [N, H, W, C], got {} {xs:?}",
            x.dtype()
        );
    }
    let (n, h, w, c) = (xs[0], xs[1], xs[2], xs[3]);
    let g = pool_geom(ctx.node, &[h, w])?;
    if g.d[1] != 1 || g.d[2] != 1 {
        bail!(
            "AveragePoolNhwc sums undilated windows only, got dilations {:?}",
            &g.d[1..]
        );
    }
    let include_pad = ctx.node.int_or("count_include_pad", 0)? != 0;
    let [_, oh, ow] = g.out;
    let (padded_h, padded_w) = (h + g.pb[1] + g.pe[1], w + g.pb[2] + g.pe[2]);
    let xv = x.as_slice::<f32>()?;
    let img = h * w * c;
    // Every output value is written below.
    let out = crate::buffers::for_overwrite::<f32>(n * oh * ow * c);
    let row = |(r, orow): (usize, &mut [f32])| {
        let (ni, oy) = (r / oh.max(1), r % oh.max(1));
        let xi = &xv[ni * img..][..img];
        let sy = (oy * g.s[1]) as isize - g.pb[1] as isize;
        let (b0, b1) = taps(sy, g.k[1], 1, h);
        let nb = taps((oy * g.s[1]) as isize, g.k[1], 1, padded_h);
        // Per-thread column sums, reused across rows and calls (no allocation per row).
        let mut colsum = COLUMN_SUMS.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
        colsum.clear();
        colsum.resize(w * c, 0.0);
        for b in b0..b1 {
            let py = (sy + b as isize) as usize;
            for (s, &v) in colsum.iter_mut().zip(&xi[py * w * c..][..w * c]) {
                *s += v;
            }
        }
        for (ox, o) in orow.chunks_exact_mut(c).enumerate() {
            let sx = (ox * g.s[2]) as isize - g.pb[2] as isize;
            let (c0, c1) = taps(sx, g.k[2], 1, w);
            o.fill(0.0);
            for t in c0..c1 {
                let px = (sx + t as isize) as usize;
                for (a, &v) in o.iter_mut().zip(&colsum[px * c..][..c]) {
                    *a += v;
                }
            }
            let cnt = if include_pad {
                let nc = taps((ox * g.s[2]) as isize, g.k[2], 1, padded_w);
                (nb.1 - nb.0) * (nc.1 - nc.0)
            } else {
                (b1 - b0) * (c1 - c0)
            } as f32;
            o.iter_mut().for_each(|a| *a /= cnt);
        }
        COLUMN_SUMS.with(|cell| *cell.borrow_mut() = colsum);
    };
    nhwc_rows_out(ctx, &g, [n, oh, ow, c], out, row)
}

thread_local! {
    /// [`average_pool_nhwc`]'s column sums, kept per thread (taken out while in use).
    static COLUMN_SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `row(r, out_row)` over the output rows of an NHWC pool (`shape` `[N, OH, OW, C]`, `out`
/// its values), split across threads when the work pays, and wraps `out` as the result.
fn nhwc_rows_out(
    ctx: &OpCtx,
    g: &Geom,
    shape: [usize; 4],
    mut out: Vec<f32>,
    row: impl Fn((usize, &mut [f32])) + Sync + Send,
) -> Result<Vec<Value>> {
    let [n, oh, ow, c] = shape;
    let row_len = ow * c;
    if row_len > 0 {
        if ctx.threads > 1 && out.len() * g.k_size() >= PAR_MIN && n * oh > 1 {
            out.par_chunks_mut(row_len).enumerate().for_each(row);
        } else {
            out.chunks_mut(row_len).enumerate().for_each(row);
        }
    }
    Ok(vec![Value::tensor(Tensor::from_vec(shape.to_vec(), out)?)])
}

/// `npuc.MaxPoolNhwc`: per output pixel, the running maximum of its taps' channel vectors
/// (contiguous, vectorized), with MaxPool's NaN rule ([`max_keep_number`]; a window whose
/// taps are all NaN, or that has no tap inside the input, gives 0 as [`max_pool_run`] does).
fn max_pool_nhwc(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let xs = x.shape();
    if xs.len() != 4 || x.dtype() != DType::F32 {
        bail!(
            "MaxPoolNhwc needs an f32 X [N, H, W, C], got {} {xs:?}",
            x.dtype()
        );
    }
    let (n, h, w, c) = (xs[0], xs[1], xs[2], xs[3]);
    let g = pool_geom(ctx.node, &[h, w])?;
    let [_, oh, ow] = g.out;
    let xv = x.as_slice::<f32>()?;
    let img = h * w * c;
    // Every output value is written below.
    let out = crate::buffers::for_overwrite::<f32>(n * oh * ow * c);
    if c > 0 {
        let row = |(r, orow): (usize, &mut [f32])| {
            let (ni, oy) = (r / oh.max(1), r % oh.max(1));
            let xi = &xv[ni * img..][..img];
            let sy = (oy * g.s[1]) as isize - g.pb[1] as isize;
            let (b0, b1) = taps(sy, g.k[1], g.d[1], h);
            let (kw, sw, dw, pw) = (g.k[2], g.s[2], g.d[2], g.pb[2] as isize);
            // Stride 1: the outputs x0..x1 whose whole window lies inside the row read, per
            // tap, one contiguous run of pixels: a long vectorized max per tap.
            let span = (kw - 1) * dw;
            let (x0, x1) = if sw == 1 && span < w && b0 < b1 {
                valid_range(ow, 1, -pw, w - span)
            } else {
                (0, 0)
            };
            if x0 < x1 {
                let inner = &mut orow[x0 * c..x1 * c];
                let len = inner.len();
                // Tap (b, t) of kernel row b0 + b: pixels from x0 - pw + t dw of its input row.
                let tap = |i: usize| {
                    let (b, t) = (b0 + i / kw, i % kw);
                    let py = (sy + (b * g.d[1]) as isize) as usize;
                    let px = (x0 as isize - pw + (t * dw) as isize) as usize;
                    &xi[(py * w + px) * c..][..len]
                };
                // All-NaN windows give 0, as the plane kernels do.
                crate::kernels::act::max_taps_into(inner, (b1 - b0) * kw, tap);
            }
            for (ox, o) in orow.chunks_exact_mut(c).enumerate() {
                if (x0..x1).contains(&ox) {
                    continue;
                }
                let sx = (ox * g.s[2]) as isize - g.pb[2] as isize;
                let (c0, c1) = taps(sx, g.k[2], g.d[2], w);
                let mut first = true;
                for b in b0..b1 {
                    let py = (sy + (b * g.d[1]) as isize) as usize;
                    for t in c0..c1 {
                        let px = (sx + (t * g.d[2]) as isize) as usize;
                        let v = &xi[(py * w + px) * c..][..c];
                        if first {
                            o.copy_from_slice(v);
                            first = false;
                        } else {
                            for (m, &v) in o.iter_mut().zip(v) {
                                *m = max_keep_number(*m, v);
                            }
                        }
                    }
                }
                if first {
                    o.fill(0.0);
                } else {
                    // All-NaN windows give 0, as the plane kernels do.
                    #[allow(clippy::eq_op)]
                    o.iter_mut()
                        .for_each(|m| *m = if *m != *m { 0.0 } else { *m });
                }
            }
        };
        return nhwc_rows_out(ctx, &g, [n, oh, ow, c], out, row);
    }
    Ok(vec![Value::tensor(Tensor::from_vec(
        vec![n, oh, ow, c],
        out,
    )?)])
}

/// Pool geometry: kernel_shape (required), strides, dilations, pads / auto_pad, ceil_mode.
fn pool_geom(node: &Node, in_sp: &[usize]) -> Result<Geom> {
    let nsp = in_sp.len();
    if nsp == 0 {
        bail!("pooling needs at least one spatial dimension");
    }
    let k = spatial_attr(node, "kernel_shape", nsp, 0)?;
    if node.attr_ints("kernel_shape")?.is_none() || k.contains(&0) {
        bail!("kernel_shape is required and must be positive");
    }
    let s = spatial_attr(node, "strides", nsp, 1)?;
    let d = spatial_attr(node, "dilations", nsp, 1)?;
    if s.contains(&0) || d.contains(&0) {
        bail!("strides and dilations must be positive");
    }
    let ceil = node.int_or("ceil_mode", 0)? != 0;
    let auto_pad = node.str_or("auto_pad", "NOTSET")?;
    let (mut pb, mut pe) = pads_attr(node, nsp)?;
    let mut out = vec![0; nsp];
    for i in 0..nsp {
        let dk = (k[i] - 1) * d[i] + 1;
        match auto_pad {
            "SAME_UPPER" | "SAME_LOWER" => {
                (out[i], pb[i], pe[i]) =
                    same_auto_pad(in_sp[i], s[i], dk, auto_pad == "SAME_UPPER");
            }
            "VALID" | "NOTSET" | "" => {
                if auto_pad == "VALID" {
                    pb[i] = 0;
                    pe[i] = 0;
                }
                let padded = in_sp[i] + pb[i] + pe[i];
                if padded < dk {
                    bail!("pooling window {dk} exceeds the padded input {padded}");
                }
                let span = padded - dk;
                out[i] = if ceil {
                    let mut o = span.div_ceil(s[i]) + 1;
                    // The last window must start inside the input or its leading pad.
                    if (o - 1) * s[i] >= in_sp[i] + pb[i] {
                        o -= 1;
                    }
                    o
                } else {
                    span / s[i] + 1
                };
            }
            other => bail!("unknown auto_pad '{other}'"),
        }
    }
    Ok(Geom {
        inp: to3(in_sp, 1)?,
        out: to3(&out, 1)?,
        k: to3(&k, 1)?,
        s: to3(&s, 1)?,
        d: to3(&d, 1)?,
        pb: to3(&pb, 0)?,
        pe: to3(&pe, 0)?,
    })
}

/// Kernel taps of one window along one dim: the tap range `lo..hi` landing inside the input,
/// given the window's first input coordinate `start`.
#[inline]
fn taps(start: isize, k: usize, d: usize, len: usize) -> (usize, usize) {
    if d == 1 {
        // `valid_range` without its divisions (a few per output: most of a small average
        // pool's time, e.g. PP-OCRv6 rec's 3x2 pool over 160 x 3 x 80 took 0.14 ms).
        let top = len as isize - 1 - start;
        let hi = if top < 0 {
            0
        } else {
            (top + 1).min(k as isize)
        };
        let lo = if start >= 0 { 0 } else { -start }.min(hi);
        return (lo as usize, hi as usize);
    }
    valid_range(k, d, start, len)
}

/// Calls `f(plane_index, out_plane)` for every (n, c) plane, in parallel when worthwhile.
fn for_planes<T: Send>(
    out: &mut [T],
    p: usize,
    work: usize,
    threads: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    if p == 0 {
        return;
    }
    if threads > 1 && work >= PAR_MIN {
        out.par_chunks_mut(p).enumerate().for_each(|(i, o)| f(i, o));
    } else {
        out.chunks_mut(p).enumerate().for_each(|(i, o)| f(i, o));
    }
}

/// Max pooling of `nc` planes; returns values and flat argmax indices (row-major, or
/// column-major over the spatial dims when `col_major`).
fn max_pool_run<T: Elem + PartialOrd>(
    x: &[T],
    nc: usize,
    g: &Geom,
    col_major: bool,
    want_idx: bool,
    threads: usize,
) -> (Vec<T>, Vec<i64>) {
    let pin = g.in_size();
    let pout = g.out_size();
    let [id, ih, iw] = g.inp;
    let [od, oh, ow] = g.out;
    let mut y = crate::buffers::zeroed::<T>(nc * pout);
    let mut idx = vec![-1i64; if want_idx { nc * pout } else { 0 }];
    let run = |plane: usize, yo: &mut [T], io: Option<&mut [i64]>| {
        let xc = &x[plane * pin..(plane + 1) * pin];
        let mut io = io;
        for z in 0..od {
            let sz = (z * g.s[0]) as isize - g.pb[0] as isize;
            let (a0, a1) = taps(sz, g.k[0], g.d[0], id);
            for yy in 0..oh {
                let sy = (yy * g.s[1]) as isize - g.pb[1] as isize;
                let (b0, b1) = taps(sy, g.k[1], g.d[1], ih);
                for xx in 0..ow {
                    let sx = (xx * g.s[2]) as isize - g.pb[2] as isize;
                    let (c0, c1) = taps(sx, g.k[2], g.d[2], iw);
                    let mut best: Option<(T, usize, usize, usize)> = None;
                    for a in a0..a1 {
                        let pz = (sz + (a * g.d[0]) as isize) as usize;
                        for b in b0..b1 {
                            let py = (sy + (b * g.d[1]) as isize) as usize;
                            let row = &xc[(pz * ih + py) * iw..][..iw];
                            for c in c0..c1 {
                                let px = (sx + (c * g.d[2]) as isize) as usize;
                                let v = row[px];
                                // `v == v` skips NaN: NaN never wins, as in the reference.
                                #[allow(clippy::eq_op)]
                                let keep = v == v && best.is_none_or(|(bv, ..)| v > bv);
                                if keep {
                                    best = Some((v, pz, py, px));
                                }
                            }
                        }
                    }
                    let o = (z * oh + yy) * ow + xx;
                    if let Some((v, pz, py, px)) = best {
                        yo[o] = v;
                        if let Some(io) = io.as_deref_mut() {
                            let flat = if col_major {
                                pz + py * id + px * id * ih
                            } else {
                                (pz * ih + py) * iw + px
                            };
                            io[o] = (plane * pin + flat) as i64;
                        }
                    }
                }
            }
        }
    };
    if !want_idx && id == 1 && od == 1 {
        // 1-D and 2-D windows without indices (the common case): row-wise, vectorizable.
        for_planes(
            &mut y,
            pout,
            nc * pout * g.k_size(),
            threads,
            |plane, yo| max_pool_plane_2d(&x[plane * pin..(plane + 1) * pin], yo, g),
        );
    } else if want_idx {
        for (plane, (yo, io)) in y
            .chunks_mut(pout.max(1))
            .zip(idx.chunks_mut(pout.max(1)))
            .enumerate()
        {
            run(plane, yo, Some(io));
        }
    } else {
        for_planes(
            &mut y,
            pout,
            nc * pout * g.k_size(),
            threads,
            |plane, yo| run(plane, yo, None),
        );
    }
    (y, idx)
}

/// The running maximum of MaxPool: `v` replaces `m` when larger, or when `m` is NaN, so NaN
/// never wins over a number (as in the reference) and survives only where every tap is NaN.
#[inline(always)]
fn max_keep_number<T: PartialOrd + Copy>(m: T, v: T) -> T {
    #[allow(clippy::eq_op)] // `m != m`: m is NaN
    if v > m || m != m {
        v
    } else {
        m
    }
}

/// One plane of a 2-D (or 1-D) max pool without indices: the same values as
/// [`max_pool_run`]'s general loop (windows with no valid tap, or only NaN taps, give
/// `T::default()`). Per output row, each tap row updates the whole row of maxima at once,
/// a loop over contiguous inputs at stride 1 that the compiler vectorizes.
fn max_pool_plane_2d<T: Elem + PartialOrd>(xc: &[T], yo: &mut [T], g: &Geom) {
    let [_, ih, iw] = g.inp;
    let [_, oh, ow] = g.out;
    let (kw, sw, dw, pw) = (g.k[2], g.s[2], g.d[2], g.pb[2] as isize);
    // Outputs whose whole window lies inside the row: x0..x1.
    let span = (kw - 1) * dw;
    let (x0, x1) = if span < iw {
        valid_range(ow, sw, -pw, iw - span)
    } else {
        (0, 0)
    };
    for (yy, yrow) in yo.chunks_mut(ow).enumerate().take(oh) {
        let sy = (yy * g.s[1]) as isize - g.pb[1] as isize;
        let (b0, b1) = taps(sy, g.k[1], g.d[1], ih);
        if b0 == b1 {
            yrow.fill(T::default());
            continue;
        }
        let row_of = |b: usize| {
            let py = (sy + (b * g.d[1]) as isize) as usize;
            &xc[py * iw..(py + 1) * iw]
        };
        // Interior outputs: every tap of every valid row.
        let inner = &mut yrow[x0..x1];
        let interior_rows = if inner.is_empty() { b0..b0 } else { b0..b1 };
        for (t, b) in interior_rows.enumerate() {
            let row = row_of(b);
            for c in 0..kw {
                let first = x0 as isize * sw as isize - pw + (c * dw) as isize;
                let first = first as usize;
                if sw == 1 {
                    let src = &row[first..first + inner.len()];
                    if t == 0 && c == 0 {
                        inner.copy_from_slice(src);
                    } else {
                        for (m, &v) in inner.iter_mut().zip(src) {
                            *m = max_keep_number(*m, v);
                        }
                    }
                } else {
                    for (j, m) in inner.iter_mut().enumerate() {
                        let v = row[first + j * sw];
                        *m = if t == 0 && c == 0 {
                            v
                        } else {
                            max_keep_number(*m, v)
                        };
                    }
                }
            }
        }
        // Edge outputs: only the taps inside the row.
        for xx in (0..x0).chain(x1..ow) {
            let sx = (xx * sw) as isize - pw;
            let (c0, c1) = taps(sx, kw, dw, iw);
            let mut m = None;
            for b in b0..b1 {
                let row = row_of(b);
                for c in c0..c1 {
                    let v = row[(sx + (c * dw) as isize) as usize];
                    m = Some(m.map_or(v, |m| max_keep_number(m, v)));
                }
            }
            yrow[xx] = m.unwrap_or_default();
        }
        #[allow(clippy::eq_op)] // `v != v`: v is NaN
        for v in yrow.iter_mut() {
            if *v != *v {
                *v = T::default();
            }
        }
    }
}

fn nc_geom(x: &Tensor, node: &Node) -> Result<(usize, Geom, Vec<usize>)> {
    let xs = x.shape();
    if xs.len() < 3 {
        bail!("pooling needs X of rank >= 3, got {xs:?}");
    }
    let g = pool_geom(node, &xs[2..])?;
    let mut out_shape = xs[..2].to_vec();
    out_shape.extend_from_slice(&g.out[3 - (xs.len() - 2)..]);
    Ok((xs[0] * xs[1], g, out_shape))
}

/// MaxPool: max over each window (NaN ignored), optional Indices output.
fn max_pool(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let (nc, g, out_shape) = nc_geom(x, ctx.node)?;
    let col_major = ctx.node.int_or("storage_order", 0)? != 0;
    let want_idx = ctx.node.outputs.len() > 1 && !ctx.node.outputs[1].is_empty();
    fn go<T: Elem + PartialOrd>(
        x: &Tensor,
        nc: usize,
        g: &Geom,
        cm: bool,
        wi: bool,
        th: usize,
        shape: &[usize],
    ) -> Result<Vec<Value>> {
        let (y, i) = max_pool_run(x.as_slice::<T>()?, nc, g, cm, wi, th);
        let mut v = vec![Value::tensor(Tensor::from_vec(shape.to_vec(), y)?)];
        if wi {
            v.push(Value::tensor(Tensor::from_vec(shape.to_vec(), i)?));
        }
        Ok(v)
    }
    let a = (x, nc, &g, col_major, want_idx, ctx.threads, &out_shape[..]);
    match x.dtype() {
        DType::F32 => go::<f32>(a.0, a.1, a.2, a.3, a.4, a.5, a.6),
        DType::F64 => go::<f64>(a.0, a.1, a.2, a.3, a.4, a.5, a.6),
        DType::F16 => go::<f16>(a.0, a.1, a.2, a.3, a.4, a.5, a.6),
        DType::BF16 => go::<bf16>(a.0, a.1, a.2, a.3, a.4, a.5, a.6),
        DType::I8 => go::<i8>(a.0, a.1, a.2, a.3, a.4, a.5, a.6),
        DType::U8 => go::<u8>(a.0, a.1, a.2, a.3, a.4, a.5, a.6),
        other => bail!("MaxPool does not support {other}"),
    }
}

/// Window reductions that accumulate a sum: average (`p == 0`) or Lp norm.
fn sum_pool_run<T: GemmFloat + 'static>(
    x: &[T],
    nc: usize,
    g: &Geom,
    include_pad: bool,
    p: i64,
    threads: usize,
) -> Vec<T> {
    let pin = g.in_size();
    let pout = g.out_size();
    let [id, ih, iw] = g.inp;
    let [od, oh, ow] = g.out;
    let mut y = crate::buffers::filled(nc * pout, T::zero());
    // Taps inside input + both pads (count_include_pad counts these; the ceil-mode overhang
    // beyond the end pad never counts).
    let padded = [
        id + g.pb[0] + g.pe[0],
        ih + g.pb[1] + g.pe[1],
        iw + g.pb[2] + g.pe[2],
    ];
    if p == 0 && g.d == [1, 1, 1] && id == 1 && od == 1 && g.pb[0] == 0 && g.pe[0] == 0 {
        // A 2-D (or 1-D) average without dilation: per output row, the window's input rows are
        // summed into column sums first (one vectorized add per row over the width), then each
        // output adds its window's column sums: no per-tap index arithmetic (PP-OCRv6 rec's
        // 3x2 pool over 160 x 3 x 80 spent most of its time there). The sums associate by
        // column instead of by row: the same values up to f32 rounding.
        let run2d = |plane: usize, yo: &mut [T]| {
            let xc = &x[plane * pin..(plane + 1) * pin];
            let mut colsum = vec![T::zero(); iw];
            for yy in 0..oh {
                let sy = (yy * g.s[1]) as isize - g.pb[1] as isize;
                let (b0, b1) = taps(sy, g.k[1], 1, ih);
                let nb = taps((yy * g.s[1]) as isize, g.k[1], 1, padded[1]);
                colsum.fill(T::zero());
                for b in b0..b1 {
                    let py = (sy + b as isize) as usize;
                    for (s, &v) in colsum.iter_mut().zip(&xc[py * iw..][..iw]) {
                        *s += v;
                    }
                }
                for (xx, o) in yo[yy * ow..(yy + 1) * ow].iter_mut().enumerate() {
                    let sx = (xx * g.s[2]) as isize - g.pb[2] as isize;
                    let (c0, c1) = taps(sx, g.k[2], 1, iw);
                    let mut acc = T::zero();
                    for c in c0..c1 {
                        acc += colsum[(sx + c as isize) as usize];
                    }
                    let cnt = if include_pad {
                        let nc_ = taps((xx * g.s[2]) as isize, g.k[2], 1, padded[2]);
                        (nb.1 - nb.0) * (nc_.1 - nc_.0)
                    } else {
                        (b1 - b0) * (c1 - c0)
                    };
                    *o = acc / T::from_f64(cnt as f64);
                }
            }
        };
        for_planes(&mut y, pout, nc * pout * g.k_size(), threads, run2d);
        return y;
    }
    let pf = T::from_f64(p as f64);
    let inv_p = T::from_f64(1.0 / p.max(1) as f64);
    let run = |plane: usize, yo: &mut [T]| {
        let xc = &x[plane * pin..(plane + 1) * pin];
        for z in 0..od {
            let sz = (z * g.s[0]) as isize - g.pb[0] as isize;
            let (a0, a1) = taps(sz, g.k[0], g.d[0], id);
            let na = taps((z * g.s[0]) as isize, g.k[0], g.d[0], padded[0]);
            for yy in 0..oh {
                let sy = (yy * g.s[1]) as isize - g.pb[1] as isize;
                let (b0, b1) = taps(sy, g.k[1], g.d[1], ih);
                let nb = taps((yy * g.s[1]) as isize, g.k[1], g.d[1], padded[1]);
                for xx in 0..ow {
                    let sx = (xx * g.s[2]) as isize - g.pb[2] as isize;
                    let (c0, c1) = taps(sx, g.k[2], g.d[2], iw);
                    let mut acc = T::zero();
                    for a in a0..a1 {
                        let pz = (sz + (a * g.d[0]) as isize) as usize;
                        for b in b0..b1 {
                            let py = (sy + (b * g.d[1]) as isize) as usize;
                            let row = &xc[(pz * ih + py) * iw..][..iw];
                            for c in c0..c1 {
                                let v = row[(sx + (c * g.d[2]) as isize) as usize];
                                acc += match p {
                                    0 => v,
                                    1 => v.abs(),
                                    2 => v * v,
                                    _ => v.abs().powf(pf),
                                };
                            }
                        }
                    }
                    let o = (z * oh + yy) * ow + xx;
                    yo[o] = if p == 0 {
                        let cnt = if include_pad {
                            let nc_ = taps((xx * g.s[2]) as isize, g.k[2], g.d[2], padded[2]);
                            (na.1 - na.0) * (nb.1 - nb.0) * (nc_.1 - nc_.0)
                        } else {
                            (a1 - a0) * (b1 - b0) * (c1 - c0)
                        };
                        acc / T::from_f64(cnt as f64)
                    } else {
                        match p {
                            1 => acc,
                            2 => acc.sqrt(),
                            _ => acc.powf(inv_p),
                        }
                    };
                }
            }
        }
    };
    for_planes(&mut y, pout, nc * pout * g.k_size(), threads, run);
    y
}

/// AveragePool: window mean, counting pads when `count_include_pad`.
fn average_pool(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let (nc, g, out_shape) = nc_geom(x, ctx.node)?;
    let inc = ctx.node.int_or("count_include_pad", 0)? != 0;
    let t = float_dispatch!(x.dtype(), T => {
        let y = sum_pool_run::<T>(&T::load(x)?, nc, &g, inc, 0, ctx.threads);
        T::store(x.dtype(), out_shape, y)?
    });
    Ok(vec![Value::tensor(t)])
}

/// LpPool: `(sum |x|^p)^(1/p)` over each window.
fn lp_pool(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let (nc, g, out_shape) = nc_geom(x, ctx.node)?;
    let p = ctx.node.int_or("p", 2)?;
    if p < 1 {
        bail!("LpPool p must be >= 1, got {p}");
    }
    let t = float_dispatch!(x.dtype(), T => {
        let y = sum_pool_run::<T>(&T::load(x)?, nc, &g, false, p, ctx.threads);
        T::store(x.dtype(), out_shape, y)?
    });
    Ok(vec![Value::tensor(t)])
}

/// Shape helpers for the global pools: (planes, plane size, output shape).
fn global_dims(x: &Tensor) -> Result<(usize, usize, Vec<usize>)> {
    let xs = x.shape();
    if xs.len() < 2 {
        bail!("global pooling needs X of rank >= 2, got {xs:?}");
    }
    let mut out = xs[..2].to_vec();
    out.resize(xs.len(), 1);
    Ok((xs[0] * xs[1], xs[2..].iter().product(), out))
}

/// GlobalAveragePool: mean over all spatial dims.
fn global_average_pool(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let (nc, p, shape) = global_dims(x)?;
    let t = float_dispatch!(x.dtype(), T => {
        let xv = T::load(x)?;
        let inv = T::from_f64(1.0 / p as f64);
        let y: Vec<T> = (0..nc)
            .map(|i| xv[i * p..(i + 1) * p].iter().copied().sum::<T>() * inv)
            .collect();
        T::store(x.dtype(), shape, y)?
    });
    Ok(vec![Value::tensor(t)])
}

/// GlobalLpPool: Lp norm over all spatial dims.
fn global_lp_pool(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let (nc, p, shape) = global_dims(x)?;
    let pw = ctx.node.int_or("p", 2)?;
    if pw < 1 {
        bail!("GlobalLpPool p must be >= 1, got {pw}");
    }
    let t = float_dispatch!(x.dtype(), T => {
        let xv = T::load(x)?;
        let (pf, inv) = (T::from_f64(pw as f64), T::from_f64(1.0 / pw as f64));
        let y: Vec<T> = (0..nc)
            .map(|i| {
                xv[i * p..(i + 1) * p]
                    .iter()
                    .map(|v| v.abs().powf(pf))
                    .sum::<T>()
                    .powf(inv)
            })
            .collect();
        T::store(x.dtype(), shape, y)?
    });
    Ok(vec![Value::tensor(t)])
}

/// GlobalMaxPool: max over all spatial dims.
fn global_max_pool(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let (nc, p, shape) = global_dims(x)?;
    if p == 0 {
        bail!("GlobalMaxPool over an empty spatial extent");
    }
    let t = float_dispatch!(x.dtype(), T => {
        let xv = T::load(x)?;
        let y: Vec<T> = (0..nc)
            .map(|i| xv[i * p..(i + 1) * p].iter().copied().fold(<T as num_traits::Float>::neg_infinity(), |a, b| if b > a || b.is_nan() { b } else { a }))
            .collect();
        T::store(x.dtype(), shape, y)?
    });
    Ok(vec![Value::tensor(t)])
}

/// MaxUnpool: scatters X into a zero tensor at the flat positions given by I.
fn max_unpool(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let ind = ins.tensor(1)?;
    let xs = x.shape();
    if xs.len() < 3 || ind.shape() != xs {
        bail!("MaxUnpool needs X of rank >= 3 and I of the same shape");
    }
    let nsp = xs.len() - 2;
    let node = ctx.node;
    let k = spatial_attr(node, "kernel_shape", nsp, 0)?;
    if k.contains(&0) {
        bail!("kernel_shape is required and must be positive");
    }
    let s = spatial_attr(node, "strides", nsp, 1)?;
    let (pb, pe) = pads_attr(node, nsp)?;
    // Indices address the inferred (unpadded) output; an explicit output_shape only pads it.
    let mut inferred = xs[..2].to_vec();
    for i in 0..nsp {
        let full = (xs[i + 2].max(1) - 1) * s[i] + k[i];
        inferred.push(
            full.checked_sub(pb[i] + pe[i])
                .ok_or_else(|| crate::RtError::msg("MaxUnpool pads exceed the output size"))?,
        );
    }
    let out_shape: Vec<usize> = match ins.opt_tensor(2) {
        Some(os) => {
            let v = os.to_i64_vec()?;
            if v.len() != xs.len() || v.iter().zip(&inferred).any(|(&d, &i)| d < i as i64) {
                bail!("MaxUnpool output_shape {v:?} is smaller than the inferred {inferred:?}");
            }
            v.iter().map(|&d| d as usize).collect()
        }
        None => inferred.clone(),
    };
    let total: usize = inferred.iter().product();
    let iv = ind.to_i64_vec()?;
    let t = crate::dispatch_numeric!(x.dtype(), T => {
        let xv = x.as_slice::<T>()?;
        let mut y = vec![T::default(); total];
        for (&i, &v) in iv.iter().zip(xv) {
            let Some(slot) = usize::try_from(i).ok().and_then(|i| y.get_mut(i)) else {
                bail!("MaxUnpool index {i} is out of range for {total} outputs");
            };
            *slot = v;
        }
        if out_shape != inferred {
            y = pad_corner(&y, &inferred, &out_shape);
        }
        Tensor::from_vec(out_shape, y)?
    });
    Ok(vec![Value::tensor(t)])
}

/// Copies `src` (shape `from`) into the leading corner of a zero tensor of shape `to`
/// (every dim of `to` at least that of `from`).
fn pad_corner<T: Copy + Default>(src: &[T], from: &[usize], to: &[usize]) -> Vec<T> {
    let mut out = vec![T::default(); to.iter().product()];
    let r = from.len();
    let last = from[r - 1];
    if last == 0 || src.is_empty() {
        return out;
    }
    let ost = crate::ops::common::strides(to);
    let mut idx = vec![0usize; r - 1];
    for row in src.chunks(last) {
        let off: usize = idx.iter().zip(&ost).map(|(i, s)| i * s).sum();
        out[off..off + last].copy_from_slice(row);
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            if idx[d] < from[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn two_d_average_equals_the_window_mean() {
        // The column-sum path of `sum_pool_run` against a direct f64 mean, over kernels,
        // strides and pads (end pads beyond the input, windows partly or wholly in padding),
        // with and without count_include_pad.
        let (h, w) = (5usize, 7usize);
        let x: Vec<f32> = (0..2 * h * w)
            .map(|i| ((i * 37) % 23) as f32 - 11.0)
            .collect();
        for (kh, kw, sh, sw, ph, pw) in [
            (3, 2, 3, 2, 0, 0),
            (2, 2, 1, 1, 1, 0),
            (3, 3, 2, 2, 1, 1),
            (1, 4, 1, 3, 0, 2),
        ] {
            let oh = (h + 2 * ph - kh) / sh + 1;
            let ow = (w + 2 * pw - kw) / sw + 1;
            let g = Geom {
                inp: [1, h, w],
                out: [1, oh, ow],
                k: [1, kh, kw],
                s: [1, sh, sw],
                d: [1, 1, 1],
                pb: [0, ph, pw],
                pe: [0, ph, pw],
            };
            for include_pad in [false, true] {
                let y = sum_pool_run::<f32>(&x, 2, &g, include_pad, 0, 1);
                for plane in 0..2 {
                    for oy in 0..oh {
                        for ox in 0..ow {
                            let (mut sum, mut n, mut padded) = (0f64, 0usize, 0usize);
                            for a in 0..kh {
                                for b in 0..kw {
                                    let (iy, ix) = (
                                        (oy * sh + a) as isize - ph as isize,
                                        (ox * sw + b) as isize - pw as isize,
                                    );
                                    padded += 1;
                                    if (0..h as isize).contains(&iy)
                                        && (0..w as isize).contains(&ix)
                                    {
                                        sum +=
                                            x[plane * h * w + iy as usize * w + ix as usize] as f64;
                                        n += 1;
                                    }
                                }
                            }
                            let want = sum / if include_pad { padded } else { n } as f64;
                            let got = y[plane * oh * ow + oy * ow + ox] as f64;
                            assert!(
                                (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                                "k {kh}x{kw} s {sh}x{sw} p {ph},{pw} pad {include_pad}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn taps_without_dilation_equal_valid_range() {
        for len in 0..9usize {
            for k in 0..7usize {
                for start in -9isize..12 {
                    assert_eq!(
                        taps(start, k, 1, len),
                        valid_range(k, 1, start, len),
                        "start {start}, k {k}, len {len}"
                    );
                }
            }
        }
    }

    proptest! {
        /// The row-wise 2-D path gives the values of the general per-window loop (run here by
        /// asking for indices), NaN and empty windows included, for strides, dilations and
        /// pads that leave edge windows partly outside the input.
        #[test]
        fn row_wise_max_pool_matches_general_loop(
            ih in 1usize..7, iw in 1usize..12,
            kh in 1usize..4, kw in 1usize..4,
            sh in 1usize..3, sw in 1usize..4,
            dh in 1usize..3, dw in 1usize..3,
            ph in 0usize..3, pw in 0usize..3,
            seed in any::<u64>(),
        ) {
            let out_len = |i: usize, k: usize, s: usize, d: usize, p: usize| {
                (i + 2 * p).checked_sub((k - 1) * d + 1).map(|span| span / s + 1)
            };
            let (Some(oh), Some(ow)) = (out_len(ih, kh, sh, dh, ph), out_len(iw, kw, sw, dw, pw))
            else {
                return Ok(());
            };
            let g = Geom {
                inp: [1, ih, iw],
                out: [1, oh, ow],
                k: [1, kh, kw],
                s: [1, sh, sw],
                d: [1, dh, dw],
                pb: [0, ph, pw],
                pe: [0, ph, pw],
            };
            let mut st = seed | 1;
            let x: Vec<f32> = (0..2 * ih * iw)
                .map(|_| match crate::kernels::xorshift(&mut st) % 8 {
                    0 => f32::NAN,
                    1 => -0.0,
                    v => v as f32 - 4.0,
                })
                .collect();
            let (fast, _) = max_pool_run(&x, 2, &g, false, false, 1);
            let (general, _) = max_pool_run(&x, 2, &g, false, true, 1);
            prop_assert_eq!(
                fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                general.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}
