//! Convolutions and pooling: Conv, ConvTranspose, the pools, and detection helpers.
//!
//! Every windowed op is normalised to three spatial dims (1-D and 2-D ops get leading dims of
//! size 1), so one set of loops serves 1-D, 2-D and 3-D. Conv lowers to im2col + `gemm` (the
//! weight `[M/group, K]` is the left operand, the column buffer `[K, out_pixels]` the right),
//! skips im2col for 1x1 stride-1 unpadded convs, and runs depthwise convs (one input channel
//! per group) directly.

mod deconv_nhwc;
pub use deconv_nhwc::runs_nhwc as conv_transpose_runs_nhwc;
mod detect;
mod nhwc;
mod pool;

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::matmul::{gemm_into, GemmFloat, Mat};
use crate::value::Value;
use npuc_ir::{DType, Node, Tensor};
use rayon::prelude::*;

pub fn register(r: &mut Registry) {
    r.add("Conv", 1, conv);
    r.add("ConvTranspose", 1, conv_transpose);
    pool::register(r);
    detect::register(r);
    nhwc::register(r);
}

/// `auto_pad = SAME_UPPER/SAME_LOWER` along one axis (Conv and pooling share it): the output
/// length `ceil(in / stride)` and the begin/end padding that yields it, the odd pixel going to
/// the end (UPPER) or the beginning (LOWER). `dk` is the dilated kernel extent.
pub(crate) fn same_auto_pad(
    in_len: usize,
    stride: usize,
    dk: usize,
    upper: bool,
) -> (usize, usize, usize) {
    let out = in_len.div_ceil(stride);
    let total = ((out.max(1) - 1) * stride + dk).saturating_sub(in_len);
    let small = total / 2;
    if upper {
        (out, small, total - small)
    } else {
        (out, total - small, small)
    }
}
/// Per-thread work below which a loop stays on the calling thread.
const PAR_MIN: usize = 1 << 15;

/// Spatial geometry of a windowed op, normalised to 3 dims (leading dims have size 1,
/// kernel 1, stride 1, no padding).
#[derive(Clone, Debug, Default)]
pub struct Geom {
    pub inp: [usize; 3],
    pub out: [usize; 3],
    pub k: [usize; 3],
    pub s: [usize; 3],
    pub d: [usize; 3],
    pub pb: [usize; 3],
    pub pe: [usize; 3],
}

impl Geom {
    pub fn in_size(&self) -> usize {
        self.inp.iter().product()
    }
    pub fn out_size(&self) -> usize {
        self.out.iter().product()
    }
    pub fn k_size(&self) -> usize {
        self.k.iter().product()
    }
}

/// Right-aligns `v` (at most 3 values) into a 3-array filled with `fill`.
pub fn to3(v: &[usize], fill: usize) -> Result<[usize; 3]> {
    if v.len() > 3 {
        bail!(
            "at most 3 spatial dimensions are supported, got {}",
            v.len()
        );
    }
    let mut a = [fill; 3];
    a[3 - v.len()..].copy_from_slice(v);
    Ok(a)
}

/// Reads an ints attribute of `nsp` non-negative values (or `def` for each when absent).
pub fn spatial_attr(node: &Node, name: &str, nsp: usize, def: usize) -> Result<Vec<usize>> {
    match node.attr_ints(name)? {
        None => Ok(vec![def; nsp]),
        Some(v) => {
            if v.len() != nsp {
                bail!("attribute '{name}' has {} values, expected {nsp}", v.len());
            }
            v.iter()
                .map(|&x| {
                    usize::try_from(x).map_err(|_| {
                        crate::RtError::msg(format!("attribute '{name}' has a negative value {x}"))
                    })
                })
                .collect()
        }
    }
}

/// Reads `pads` as (begin, end) lists of `nsp` values each.
pub fn pads_attr(node: &Node, nsp: usize) -> Result<(Vec<usize>, Vec<usize>)> {
    let p = spatial_attr_len(node, "pads", 2 * nsp)?;
    Ok((p[..nsp].to_vec(), p[nsp..].to_vec()))
}

fn spatial_attr_len(node: &Node, name: &str, len: usize) -> Result<Vec<usize>> {
    match node.attr_ints(name)? {
        None => Ok(vec![0; len]),
        Some(v) if v.len() == len => v
            .iter()
            .map(|&x| {
                usize::try_from(x).map_err(|_| {
                    crate::RtError::msg(format!("attribute '{name}' has a negative value {x}"))
                })
            })
            .collect(),
        Some(v) => bail!("attribute '{name}' has {} values, expected {len}", v.len()),
    }
}

/// Geometry of Conv-like ops (Conv, DeformConv): strides, dilations, pads / auto_pad.
pub fn conv_geom(node: &Node, in_sp: &[usize], k: &[usize]) -> Result<Geom> {
    let nsp = in_sp.len();
    if nsp == 0 || nsp != k.len() {
        bail!("input spatial dims {in_sp:?} do not match kernel {k:?}");
    }
    let s = spatial_attr(node, "strides", nsp, 1)?;
    let d = spatial_attr(node, "dilations", nsp, 1)?;
    if s.contains(&0) || d.contains(&0) {
        bail!("strides and dilations must be positive");
    }
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
                    bail!("kernel extent {dk} exceeds the padded input {padded}");
                }
                out[i] = (padded - dk) / s[i] + 1;
            }
            other => bail!("unknown auto_pad '{other}'"),
        }
    }
    Ok(Geom {
        inp: to3(in_sp, 1)?,
        out: to3(&out, 1)?,
        k: to3(k, 1)?,
        s: to3(&s, 1)?,
        d: to3(&d, 1)?,
        pb: to3(&pb, 0)?,
        pe: to3(&pe, 0)?,
    })
}

/// Range of output indices `o` in `0..o_len` for which `o * s + off` lies in `0..in_len`.
#[inline]
pub fn valid_range(o_len: usize, s: usize, off: isize, in_len: usize) -> (usize, usize) {
    let s = s as isize;
    let lo = if off >= 0 { 0 } else { (-off + s - 1) / s };
    let top = in_len as isize - 1 - off;
    let hi = if top < 0 {
        0
    } else {
        (top / s + 1).min(o_len as isize)
    };
    let lo = lo.min(hi);
    (lo as usize, hi as usize)
}

/// im2col for one group of one image, output rows `rows` only: `x` holds `c_g` channels, `col`
/// gets `c_g * k_size` rows of `rows.len() * ow` values (the output positions of those
/// (depth, height) rows, flattened as `z * oh + y`). Every value of `col` is written.
fn im2col<T: GemmFloat>(
    x: &[T],
    g: &Geom,
    rows: std::ops::Range<usize>,
    col: &mut [T],
    threads: usize,
) {
    let [ind, inh, inw] = g.inp;
    let [od, oh, ow] = g.out;
    let [_kd, kh, kw] = g.k;
    let plane = ind * inh * inw;
    let p = rows.len() * ow;
    let ks = g.k_size();
    let fill_row = |r: usize, row: &mut [T]| {
        let c = r / ks;
        let kr = r % ks;
        let (a, b, cc) = (kr / (kh * kw), (kr / kw) % kh, kr % kw);
        let xc = &x[c * plane..(c + 1) * plane];
        let off = |kk: usize, dim: usize| (kk * g.d[dim]) as isize - g.pb[dim] as isize;
        let (d_lo, d_hi) = valid_range(od, g.s[0], off(a, 0), ind);
        let (h_lo, h_hi) = valid_range(oh, g.s[1], off(b, 1), inh);
        let (w_lo, w_hi) = valid_range(ow, g.s[2], off(cc, 2), inw);
        let woff = off(cc, 2);
        for (zy, dst) in rows.clone().zip(row.chunks_exact_mut(ow)) {
            let (z, y) = (zy / oh, zy % oh);
            if z < d_lo || z >= d_hi || y < h_lo || y >= h_hi {
                dst.fill(T::zero());
                continue;
            }
            let iz = (z * g.s[0]) as isize + off(a, 0);
            let iy = (y * g.s[1]) as isize + off(b, 1);
            let src = &xc[(iz as usize * inh + iy as usize) * inw..][..inw];
            dst[..w_lo].fill(T::zero());
            dst[w_hi..].fill(T::zero());
            if w_lo >= w_hi {
                continue;
            }
            let sw = g.s[2];
            let base = (w_lo * sw) as isize + woff;
            if sw == 1 {
                let b0 = base as usize;
                dst[w_lo..w_hi].copy_from_slice(&src[b0..b0 + (w_hi - w_lo)]);
            } else {
                for (i, v) in dst[w_lo..w_hi].iter_mut().enumerate() {
                    *v = src[base as usize + i * sw];
                }
            }
        }
    };
    if p == 0 {
        return;
    }
    if threads > 1 && col.len() >= PAR_MIN * 2 {
        col.par_chunks_mut(p)
            .enumerate()
            .for_each(|(r, row)| fill_row(r, row));
    } else {
        for (r, row) in col.chunks_mut(p).enumerate() {
            fill_row(r, row);
        }
    }
}

/// Adds `w * x` over one kernel tap for a whole output plane (direct convolution).
#[inline]
fn depthwise_plane<T: GemmFloat>(xc: &[T], wc: &[T], g: &Geom, out: &mut [T]) {
    let [ind, inh, inw] = g.inp;
    let [od, oh, ow] = g.out;
    let [kd, kh, kw] = g.k;
    let _ = ind;
    for a in 0..kd {
        let offd = (a * g.d[0]) as isize - g.pb[0] as isize;
        let (d_lo, d_hi) = valid_range(od, g.s[0], offd, g.inp[0]);
        for b in 0..kh {
            let offh = (b * g.d[1]) as isize - g.pb[1] as isize;
            let (h_lo, h_hi) = valid_range(oh, g.s[1], offh, inh);
            for c in 0..kw {
                let wv = wc[(a * kh + b) * kw + c];
                let offw = (c * g.d[2]) as isize - g.pb[2] as isize;
                let (w_lo, w_hi) = valid_range(ow, g.s[2], offw, inw);
                if w_lo >= w_hi {
                    continue;
                }
                let sw = g.s[2];
                for z in d_lo..d_hi {
                    let iz = ((z * g.s[0]) as isize + offd) as usize;
                    for y in h_lo..h_hi {
                        let iy = ((y * g.s[1]) as isize + offh) as usize;
                        let src = &xc[(iz * inh + iy) * inw..][..inw];
                        let dst = &mut out[(z * oh + y) * ow..][..ow];
                        let base = ((w_lo * sw) as isize + offw) as usize;
                        if sw == 1 {
                            let n = w_hi - w_lo;
                            for (o, &v) in dst[w_lo..w_hi].iter_mut().zip(&src[base..base + n]) {
                                *o += wv * v;
                            }
                        } else {
                            for (i, o) in dst[w_lo..w_hi].iter_mut().enumerate() {
                                *o += wv * src[base + i * sw];
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Shapes and attributes of one Conv call, validated.
struct ConvArgs {
    n: usize,
    c: usize,
    m: usize,
    group: usize,
    geom: Geom,
}

fn conv_run<T: GemmFloat>(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    a: &ConvArgs,
    threads: usize,
) -> Result<Vec<T>> {
    let xv = T::load(x)?;
    let wv = T::load(w)?;
    let bv = match b {
        Some(b) => Some(T::load(b)?),
        None => None,
    };
    let g = &a.geom;
    let (c_g, m_g) = (a.c / a.group, a.m / a.group);
    let (pin, p, ks) = (g.in_size(), g.out_size(), g.k_size());
    let k = c_g * ks;
    let mut out = crate::buffers::filled(a.n * a.m * p, T::zero());
    if out.is_empty() {
        return Ok(out);
    }
    if xv.len() != a.n * a.c * pin || wv.len() != a.m * k {
        bail!("Conv operand sizes do not match their shapes");
    }
    if let Some(bv) = &bv {
        for (ch, plane) in out.chunks_mut(p).enumerate() {
            plane.fill(bv[ch % a.m]);
        }
    }
    if c_g == 1 {
        // Depthwise (and channel-multiplier) conv: K is tiny, so a direct loop beats gemm.
        let plane = |(idx, o): (usize, &mut [T])| {
            let (ni, oc) = (idx / a.m, idx % a.m);
            let ic = oc / m_g;
            let xc = &xv[(ni * a.c + ic) * pin..][..pin];
            let wc = &wv[oc * ks..][..ks];
            depthwise_plane(xc, wc, g, o);
        };
        if threads > 1 && out.len() * ks >= PAR_MIN {
            out.par_chunks_mut(p).enumerate().for_each(plane);
        } else {
            out.chunks_mut(p).enumerate().for_each(plane);
        }
        return Ok(out);
    }
    let pointwise = ks == 1 && g.s == [1; 3] && g.pb == [0; 3] && g.pe == [0; 3];
    let [od, oh, ow] = g.out;
    // The columns are built a few output rows at a time (about 1 MB of them), each chunk
    // multiplied while it is in cache: a whole image's columns (22 MB for PP-OCRv5 det's
    // 96-channel 3x3 head at 80x80) went to memory and back, a third of that model's time.
    let chunk_rows = if pointwise {
        od * oh
    } else {
        ((1usize << 18) / (k * ow).max(1)).clamp(1, od * oh)
    };
    let mut col = if pointwise {
        vec![]
    } else {
        crate::buffers::zeroed(k * chunk_rows * ow)
    };
    for ni in 0..a.n {
        for gi in 0..a.group {
            let xg = &xv[(ni * a.c + gi * c_g) * pin..][..c_g * pin];
            let wg = &wv[gi * m_g * k..][..m_g * k];
            let dst = &mut out[(ni * a.m + gi * m_g) * p..][..m_g * p];
            let mut r0 = 0;
            while r0 < od * oh {
                let r1 = (r0 + chunk_rows).min(od * oh);
                let pc = (r1 - r0) * ow;
                let rhs: &[T] = if pointwise {
                    xg
                } else {
                    im2col(xg, g, r0..r1, &mut col[..k * pc], threads);
                    &col[..k * pc]
                };
                gemm_into(
                    m_g,
                    pc,
                    k,
                    T::one(),
                    Mat::rows(wg, k),
                    Mat::rows(rhs, pc),
                    Some(T::one()),
                    &mut dst[r0 * ow..],
                    p,
                    threads,
                )?;
                r0 = r1;
            }
        }
    }
    crate::buffers::release(col);
    Ok(out)
}

/// Loads a float tensor family: runs `f32` compute for f32/f16/bf16 and f64 for f64.
macro_rules! float_dispatch {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DType::F32 | DType::F16 | DType::BF16 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            other => bail!("dtype {other} is not supported here (float types only)"),
        }
    };
}
pub(crate) use float_dispatch;

/// Conv: N-D (1-3 spatial dims) grouped, strided, dilated, padded convolution.
fn conv(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let w = ins.tensor(1)?;
    let b = ins.opt_tensor(2);
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() < 3 || ws.len() != xs.len() {
        bail!(
            "Conv needs X [N, C, ...] and W [M, C/group, ...] of equal rank, got {xs:?} and {ws:?}"
        );
    }
    if w.dtype() != x.dtype() || b.is_some_and(|b| b.dtype() != x.dtype()) {
        bail!("Conv operands must share one dtype");
    }
    let group = ctx.node.int_or("group", 1)?;
    if group < 1 {
        bail!("group must be positive");
    }
    let group = group as usize;
    let (n, c, m) = (xs[0], xs[1], ws[0]);
    if c % group != 0 || m % group != 0 || ws[1] * group != c {
        bail!("Conv channels do not match: X {xs:?}, W {ws:?}, group {group}");
    }
    if let Some(ks) = ctx.node.attr_ints("kernel_shape")? {
        if ks.len() != ws.len() - 2 || ks.iter().zip(&ws[2..]).any(|(&a, &b)| a as usize != b) {
            bail!("kernel_shape {ks:?} does not match W {ws:?}");
        }
    }
    if let Some(b) = b {
        if b.len() != m {
            bail!("Conv bias has {} values, expected {m}", b.len());
        }
    }
    if ws[2..].contains(&0) {
        bail!("Conv kernel has an empty dimension: {ws:?}");
    }
    let geom = conv_geom(ctx.node, &xs[2..], &ws[2..])?;
    let mut out_shape = vec![n, m];
    out_shape.extend_from_slice(&geom.out[3 - (xs.len() - 2)..]);
    let args = ConvArgs {
        n,
        c,
        m,
        group,
        geom,
    };
    let t = float_dispatch!(x.dtype(), T => {
        let v = conv_run::<T>(x, w, b, &args, ctx.threads)?;
        T::store(x.dtype(), out_shape, v)?
    });
    Ok(vec![Value::tensor(t)])
}

/// Adds a column buffer `[m_g * k_size, rows.len() * iw]` into output planes `[m_g, out_size]`
/// (the adjoint of im2col, used by ConvTranspose). The columns are the input positions of the
/// input rows `rows` (flattened as `z * ih + y`); every input position adds into its own output
/// positions, so blocks of rows can be added one after another in any order.
/// Whether a ConvTranspose's taps tile its output exactly: kernel equal to stride, no
/// dilation, padding or output padding (the 2x2 stride-2 upsampling of detection heads).
/// Then every output value comes from one tap of one input pixel, and col2im assigns
/// (`bias + value`) instead of accumulating into a bias-filled output.
fn taps_tile_output(g: &Geom) -> bool {
    (0..3).all(|i| {
        g.k[i] == g.s[i]
            && g.d[i] == 1
            && g.pb[i] == 0
            && g.pe[i] == 0
            && g.out[i] == g.inp[i] * g.s[i]
    })
}

/// [`col2im_add`] (or, when `tiled` ([`taps_tile_output`]), [`col2im_set`] with the group's
/// `bias`) with the output channels split across threads (each channel's plane is written
/// only from its own rows of `col`).
#[allow(clippy::too_many_arguments)]
fn col2im_par<T: GemmFloat>(
    col: &[T],
    g: &Geom,
    m_g: usize,
    rows: std::ops::Range<usize>,
    out: &mut [T],
    tiled: Option<Option<&[T]>>,
    threads: usize,
) {
    let pout = g.out_size();
    let one = |mis: std::ops::Range<usize>, part: &mut [T]| match tiled {
        Some(bias) => col2im_set(col, g, mis, rows.clone(), part, bias),
        None => col2im_add(col, g, mis, rows.clone(), part),
    };
    let work = m_g * g.k_size() * rows.len() * g.inp[2];
    if threads > 1 && m_g > 1 && pout > 0 && work >= PAR_MIN {
        let per = m_g.div_ceil(threads);
        out[..m_g * pout]
            .par_chunks_mut(per * pout)
            .enumerate()
            .for_each(|(i, part)| one(i * per..i * per + part.len() / pout, part));
    } else {
        one(0..m_g, out);
    }
}

/// The columns of output channels `mis` (input rows `rows`) written into their planes as
/// `bias + value`, for a conv whose taps tile the output ([`taps_tile_output`]): each output
/// value is written once, so the output needs no fill beforehand.
fn col2im_set<T: GemmFloat>(
    col: &[T],
    g: &Geom,
    mis: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    out: &mut [T],
    bias: Option<&[T]>,
) {
    let [_, ih, iw] = g.inp;
    let [_, oh, ow] = g.out;
    let [_, kh, kw] = g.k;
    let ks = g.k_size();
    let pin = rows.len() * iw;
    let pout = g.out_size();
    for mi in mis.clone() {
        let plane = &mut out[(mi - mis.start) * pout..][..pout];
        let bv = bias.map_or(T::zero(), |b| b[mi]);
        for kr in 0..ks {
            let (a, b, c) = (kr / (kh * kw), (kr / kw) % kh, kr % kw);
            let src_rows = &col[(mi * ks + kr) * pin..][..pin];
            for (ri, r) in rows.clone().enumerate() {
                let (z, y) = (r / ih, r % ih);
                let (oz, oy) = (z * g.k[0] + a, y * kh + b);
                let dst = &mut plane[(oz * oh + oy) * ow..][..ow];
                let src = &src_rows[ri * iw..][..iw];
                for (d, &v) in dst[c..].iter_mut().step_by(kw).zip(src) {
                    *d = v + bv;
                }
            }
        }
    }
}

/// Scatters the columns of output channels `mis` (input rows `rows`) into their planes, `out`
/// holding those channels' planes from `mis.start`.
fn col2im_add<T: GemmFloat>(
    col: &[T],
    g: &Geom,
    mis: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    out: &mut [T],
) {
    // Here `g.inp` is the (small) input grid the columns are indexed by and `g.out` the
    // output grid they scatter into: position i maps to i * s + k * d - pb.
    let [id, ih, iw] = g.inp;
    let [od, oh, ow] = g.out;
    let [_, kh, kw] = g.k;
    let ks = g.k_size();
    let pin = rows.len() * iw;
    let pout = g.out_size();
    for mi in mis.clone() {
        let plane = &mut out[(mi - mis.start) * pout..][..pout];
        for kr in 0..ks {
            let (a, b, c) = (kr / (kh * kw), (kr / kw) % kh, kr % kw);
            let row = &col[(mi * ks + kr) * pin..][..pin];
            let off = |kk: usize, dim: usize| (kk * g.d[dim]) as isize - g.pb[dim] as isize;
            let (d_lo, d_hi) = valid_range(id, g.s[0], off(a, 0), od);
            let (h_lo, h_hi) = valid_range(ih, g.s[1], off(b, 1), oh);
            let (w_lo, w_hi) = valid_range(iw, g.s[2], off(c, 2), ow);
            for (ri, r) in rows.clone().enumerate() {
                let (z, y) = (r / ih, r % ih);
                if z < d_lo || z >= d_hi || y < h_lo || y >= h_hi {
                    continue;
                }
                let oz = ((z * g.s[0]) as isize + off(a, 0)) as usize;
                let oy = ((y * g.s[1]) as isize + off(b, 1)) as usize;
                let dst = &mut plane[(oz * oh + oy) * ow..][..ow];
                let src = &row[ri * iw..][..iw];
                for (x, &v) in src.iter().enumerate().take(w_hi).skip(w_lo) {
                    let ox = ((x * g.s[2]) as isize + off(c, 2)) as usize;
                    dst[ox] += v;
                }
            }
        }
    }
}

/// ConvTranspose: the gradient of Conv (gemm into columns, then col2im), with output_padding,
/// output_shape, auto_pad, group and dilations.
fn conv_transpose(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let w = ins.tensor(1)?;
    let b = ins.opt_tensor(2);
    let node = ctx.node;
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() < 3 || ws.len() != xs.len() {
        bail!("ConvTranspose needs X [N, C, ...] and W [C, M/group, ...], got {xs:?} and {ws:?}");
    }
    if w.dtype() != x.dtype() || b.is_some_and(|b| b.dtype() != x.dtype()) {
        bail!("ConvTranspose operands must share one dtype");
    }
    let nsp = xs.len() - 2;
    let group = node.int_or("group", 1)?;
    if group < 1 {
        bail!("group must be positive");
    }
    let group = group as usize;
    let (n, c) = (xs[0], xs[1]);
    if ws[0] != c || c % group != 0 {
        bail!("ConvTranspose channels do not match: X {xs:?}, W {ws:?}, group {group}");
    }
    let m_g = ws[1];
    let m = m_g * group;
    let k = &ws[2..];
    let s = spatial_attr(node, "strides", nsp, 1)?;
    let d = spatial_attr(node, "dilations", nsp, 1)?;
    if s.contains(&0) || d.contains(&0) {
        bail!("strides and dilations must be positive");
    }
    let op = spatial_attr(node, "output_padding", nsp, 0)?;
    let auto_pad = node.str_or("auto_pad", "NOTSET")?;
    let out_attr: Option<Vec<usize>> = match node.attr_ints("output_shape")? {
        None => None,
        Some(v) => {
            let v = if v.len() == nsp + 2 { &v[2..] } else { v };
            if v.len() != nsp || v.iter().any(|&x| x < 0) {
                bail!("output_shape {v:?} does not fit {nsp} spatial dims");
            }
            Some(v.iter().map(|&x| x as usize).collect())
        }
    };
    let full = |i: usize| s[i] * (xs[i + 2].max(1) - 1) + op[i] + (k[i].max(1) - 1) * d[i] + 1;
    let (pb, pe, out): (Vec<usize>, Vec<usize>, Vec<usize>) =
        if matches!(auto_pad, "SAME_UPPER" | "SAME_LOWER") {
            let target: Vec<usize> = match &out_attr {
                Some(o) => o.clone(),
                None => (0..nsp).map(|i| xs[i + 2] * s[i]).collect(),
            };
            let mut pb = vec![0; nsp];
            let mut pe = vec![0; nsp];
            for i in 0..nsp {
                let total = full(i).saturating_sub(target[i]);
                let (small, big) = (total / 2, total - total / 2);
                (pb[i], pe[i]) = if auto_pad == "SAME_UPPER" {
                    (small, big)
                } else {
                    (big, small)
                };
            }
            (pb, pe, target)
        } else {
            let (pb, pe) = if auto_pad == "VALID" {
                (vec![0; nsp], vec![0; nsp])
            } else {
                pads_attr(node, nsp)?
            };
            let out = match &out_attr {
                Some(o) => o.clone(),
                None => (0..nsp)
                    .map(|i| {
                        full(i).checked_sub(pb[i] + pe[i]).ok_or_else(|| {
                            crate::RtError::msg("ConvTranspose pads exceed the output size")
                        })
                    })
                    .collect::<Result<_>>()?,
            };
            (pb, pe, out)
        };
    let geom = Geom {
        inp: to3(&xs[2..], 1)?,
        out: to3(&out, 1)?,
        k: to3(k, 1)?,
        s: to3(&s, 1)?,
        d: to3(&d, 1)?,
        pb: to3(&pb, 0)?,
        pe: to3(&pe, 0)?,
    };
    if let Some(b) = b {
        if b.len() != m {
            bail!("ConvTranspose bias has {} values, expected {m}", b.len());
        }
    }
    let mut out_shape = vec![n, m];
    out_shape.extend_from_slice(&out);
    /// W [C, M/group * kernel] per group transposed to row-major [M/group * kernel, C/group]:
    /// the product's left operand read contiguously, so the GEMM neither packs it into a
    /// per-call allocation nor strides through it.
    fn transposed_weight<T: GemmFloat>(wv: &[T], group: usize, c_g: usize, rows: usize) -> Vec<T> {
        let mut wt = vec![T::zero(); wv.len()];
        for gi in 0..group {
            let src = &wv[gi * c_g * rows..][..c_g * rows];
            let dst = &mut wt[gi * c_g * rows..][..c_g * rows];
            for (ci, srow) in src.chunks_exact(rows).enumerate() {
                for (r, &v) in srow.iter().enumerate() {
                    dst[r * c_g + ci] = v;
                }
            }
        }
        wt
    }
    #[allow(clippy::too_many_arguments)]
    fn run<T: GemmFloat + 'static>(
        ctx: &OpCtx,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        g: &Geom,
        (n, c, m, group): (usize, usize, usize, usize),
        threads: usize,
    ) -> Result<Vec<T>> {
        let xv = T::load(x)?;
        let (c_g, m_g) = (c / group, m / group);
        let (pin, pout, ks) = (g.in_size(), g.out_size(), g.k_size());
        let rows = m_g * ks;
        if xv.len() != n * c * pin || w.len() != c * rows {
            bail!("ConvTranspose operand sizes do not match their shapes");
        }
        // A constant weight is transposed once per plan; a computed one on every call.
        let cached;
        let fresh;
        let wt: &[T] = if ctx.input_is_const(1) {
            cached = ctx.cached(|| Ok(transposed_weight(&T::load(w)?, group, c_g, rows)))?;
            &cached
        } else {
            fresh = transposed_weight(&T::load(w)?, group, c_g, rows);
            &fresh
        };
        let tiled = taps_tile_output(g);
        let bv = b.map(T::load).transpose()?;
        let mut out = if tiled {
            // Every value is assigned by col2im_set.
            crate::buffers::for_overwrite(n * m * pout)
        } else {
            let mut out = crate::buffers::filled(n * m * pout, T::zero());
            if let Some(bv) = &bv {
                for (ch, plane) in out.chunks_mut(pout.max(1)).enumerate() {
                    plane.fill(bv[ch % m]);
                }
            }
            out
        };
        // Blocks of whole input rows whose columns (`rows` x block values) stay within
        // COL_BLOCK_VALUES, so that the product writes them into cache and col2im reads them
        // back from there (one column buffer for the whole image made both go to memory:
        // 8 MB per call for ViT-S's last upsampling).
        // At most COL_BLOCK pixels either: wider products make the `gemm` crate (below the
        // AVX-512 level) pack the weight into a fresh per-call buffer (its right-hand-side
        // packing threshold, 128 x 16 columns on x86), which would allocate on every run.
        const COL_BLOCK_VALUES: usize = 1 << 18;
        const COL_BLOCK: usize = 2048;
        let in_rows = g.inp[0] * g.inp[1];
        let iw = g.inp[2];
        let block_rows = (COL_BLOCK_VALUES / (rows * iw).max(1))
            .min(COL_BLOCK / iw.max(1))
            .clamp(1, in_rows.max(1));
        let mut col = crate::buffers::filled(rows * block_rows * iw, T::zero());
        for ni in 0..n {
            for gi in 0..group {
                let xg = &xv[(ni * c + gi * c_g) * pin..][..c_g * pin];
                let wg = &wt[gi * c_g * rows..][..c_g * rows];
                let dst = &mut out[(ni * m + gi * m_g) * pout..][..m_g * pout];
                for r0 in (0..in_rows).step_by(block_rows) {
                    let r1 = (r0 + block_rows).min(in_rows);
                    let (j0, w_cols) = (r0 * iw, (r1 - r0) * iw);
                    gemm_into(
                        rows,
                        w_cols,
                        c_g,
                        T::one(),
                        Mat::rows(wg, c_g),
                        Mat {
                            data: &xg[j0..],
                            rs: pin,
                            cs: 1,
                        },
                        None,
                        &mut col,
                        w_cols,
                        threads,
                    )?;
                    let bias = bv.as_deref().map(|b| &b[gi * m_g..][..m_g]);
                    col2im_par(&col, g, m_g, r0..r1, dst, tiled.then_some(bias), threads);
                }
            }
        }
        crate::buffers::release(col);
        Ok(out)
    }
    let t = float_dispatch!(x.dtype(), T => {
        let v = run::<T>(ctx, x, w, b, &geom, (n, c, m, group), ctx.threads)?;
        T::store(x.dtype(), out_shape, v)?
    });
    Ok(vec![Value::tensor(t)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct 2-D convolution straight from the definition.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        x: &[f32],
        w: &[f32],
        (n, c, h, wd): (usize, usize, usize, usize),
        (m, kh, kw): (usize, usize, usize),
        group: usize,
        g: &Geom,
    ) -> Vec<f32> {
        let (oh, ow) = (g.out[1], g.out[2]);
        let (c_g, m_g) = (c / group, m / group);
        let mut out = vec![0.0; n * m * oh * ow];
        for ni in 0..n {
            for oc in 0..m {
                let gi = oc / m_g;
                for y in 0..oh {
                    for xx in 0..ow {
                        let mut acc = 0.0;
                        for ic in 0..c_g {
                            for a in 0..kh {
                                for b in 0..kw {
                                    let iy = (y * g.s[1] + a * g.d[1]) as isize - g.pb[1] as isize;
                                    let ix = (xx * g.s[2] + b * g.d[2]) as isize - g.pb[2] as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                        continue;
                                    }
                                    let xi = ((ni * c + gi * c_g + ic) * h + iy as usize) * wd
                                        + ix as usize;
                                    acc += x[xi] * w[((oc * c_g + ic) * kh + a) * kw + b];
                                }
                            }
                        }
                        out[((ni * m + oc) * oh + y) * ow + xx] = acc;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn conv_paths_match_naive() {
        // (c, m, group, k, stride, dilation, pads)
        let cases = [
            (4, 6, 1, 3, 1, 1, [1, 1, 1, 1]),
            (8, 8, 8, 3, 2, 1, [1, 1, 1, 1]),
            (8, 16, 8, 3, 1, 2, [2, 0, 1, 2]),
            (6, 4, 2, 1, 1, 1, [0, 0, 0, 0]),
            (6, 4, 2, 2, 3, 1, [0, 1, 1, 0]),
            (3, 5, 1, 5, 2, 1, [2, 2, 2, 2]),
        ];
        for (ci, &(c, m, group, k, s, d, p)) in cases.iter().enumerate() {
            let (n, h, wd) = (2, 9, 7);
            let x: Vec<f32> = (0..n * c * h * wd)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let w: Vec<f32> = (0..m * (c / group) * k * k)
                .map(|i| ((i * 53 % 89) as f32 - 44.0) / 30.0)
                .collect();
            let dk = (k - 1) * d + 1;
            let oh = (h + p[0] + p[2] - dk) / s + 1;
            let ow = (wd + p[1] + p[3] - dk) / s + 1;
            let geom = Geom {
                inp: [1, h, wd],
                out: [1, oh, ow],
                k: [1, k, k],
                s: [1, s, s],
                d: [1, d, d],
                pb: [0, p[0], p[1]],
                pe: [0, p[2], p[3]],
            };
            let xt = Tensor::from_vec(vec![n, c, h, wd], x.clone()).unwrap();
            let wt = Tensor::from_vec(vec![m, c / group, k, k], w.clone()).unwrap();
            let args = ConvArgs {
                n,
                c,
                m,
                group,
                geom: geom.clone(),
            };
            for threads in [1, 4] {
                let got = conv_run::<f32>(&xt, &wt, None, &args, threads).unwrap();
                let want = naive(&x, &w, (n, c, h, wd), (m, k, k), group, &geom);
                assert_eq!(got.len(), want.len(), "case {ci}");
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                        "case {ci} at {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
