//! `npuc.ConvTransposeNhwc(X, W[, B])`: a 2-D ONNX ConvTranspose with `X` and `Y` channels-last
//! (`[N, H, W, C]` in, `[N, OH, OW, M]` out; `W` in the ONNX layout `[C, M, KH, KW]`), made by
//! the `layout-nhwc` pass for upsampling heads and decoders (PP-OCR's DB head: 2x2 kernels at
//! stride 2; a ViT decoder's 4x4 kernels at stride 2, padding 1) so they stay in the
//! channels-last chain instead of leaving it twice.
//!
//! Two forms run, both group 1 and dilation 1:
//! - **Non-overlapping** (strides equal to the kernel, no padding or output padding): every
//!   input pixel writes its own `KH x KW` block of output pixels, and input row `y` alone makes
//!   output rows `y * KH .. y * KH + KH`: for kernel row `dy`, output row `y * KH + dy` read as a
//!   `[W, KW * M]` matrix is the product of the input row `[W, C]` and the weight's columns
//!   `(dy, dx, m)` for that `dy` (`[C, KW * M]`). No column buffer, no scatter: each product
//!   writes its output row in place, the bias added while the row is in cache.
//! - **Sub-pixel** (each kernel extent a multiple `T` of its stride; explicit padding below the
//!   kernel, output padding below the stride): output `o` (per axis) with `o + pad = q s + r`
//!   receives exactly the taps `r, r + s, .., r + (T-1) s` from inputs `q, q - 1, .., q - T + 1`.
//!   So the outputs of one residue class `(ry, rx)` are a stride-1 `T x T` convolution of the
//!   input (zero-padded by `T - 1`) with that class's taps: one output row's pixels of a class
//!   are a product `[pixels, T*T*C] x [T*T*C, M]` whose rows are `T` runs of `T*C` consecutive
//!   input values (read in place, no im2col), written at a pixel stride of `s * M`. Every
//!   multiply-add is one a direct scatter would do (none on padding taps outside the class),
//!   and no column buffer is written or read back (the NCHW kernel's GEMM + col2im).

use super::{spatial_attr, PAR_MIN};
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx};
use crate::kernels::sgemm::{self, PackedB, View};
use crate::ops::matmul::{gemm_into, Mat};
use crate::value::Value;
use npuc_ir::infer::NodeIn;
use npuc_ir::opdef::{OpDef, Param};
use npuc_ir::{DType, Node, Tensor};
use npuc_isa::Isa;
use rayon::prelude::*;

/// `npuc.ConvTransposeNhwc` (see the module docs): ConvTranspose's attributes.
pub static CONV_TRANSPOSE_NHWC: OpDef = OpDef {
    domain: "npuc",
    name: "ConvTransposeNhwc",
    inputs: &[
        Param::required("X"),
        Param::required("W"),
        Param::optional("B"),
    ],
    outputs: &[Param::required("Y")],
    attrs: &[],
    infer: |n: &NodeIn| super::nhwc::infer_nhwc_as(n, "ConvTranspose"),
};

/// Whether a ConvTranspose node (2-D) is the non-overlapping form this op runs: strides equal
/// to `kernel` (the weight's `[KH, KW]`), no padding, dilation 1, group 1, no output padding,
/// output size or auto padding. `Err` for malformed attributes.
pub fn non_overlapping(node: &Node, kernel: [usize; 2]) -> Result<bool> {
    let s = spatial_attr(node, "strides", 2, 1)?;
    let d = spatial_attr(node, "dilations", 2, 1)?;
    let op = spatial_attr(node, "output_padding", 2, 0)?;
    let pads_zero = match node.attr_ints("pads")? {
        None => true,
        Some(p) => p.iter().all(|&v| v == 0),
    };
    let kernel_attr_ok = match node.attr_ints("kernel_shape")? {
        None => true,
        Some(k) => k.len() == 2 && k[0] as usize == kernel[0] && k[1] as usize == kernel[1],
    };
    Ok(s == kernel
        && d == [1, 1]
        && op == [0, 0]
        && pads_zero
        && kernel_attr_ok
        && node.int_or("group", 1)? == 1
        && node.attr_ints("output_shape")?.is_none()
        && matches!(node.str_or("auto_pad", "NOTSET")?, "NOTSET" | "VALID"))
}

/// The weight as the products read it: one `[C, KW * M]` matrix per kernel row, columns
/// ordered `(dx, m)`; or, when those rows are narrower than [`NARROW`] values (a one-channel
/// output head), one `[C, KH * KW * M]` matrix, columns ordered `(dy, dx, m)`.
enum Packed {
    Rows(Vec<Vec<f32>>),
    Panels(Vec<PackedB>),
    NarrowRows(Vec<f32>),
    NarrowPanels(PackedB),
    /// Sub-pixel form: per residue class `(ry, rx)` (`ry * SW + rx`), `[T*T*C, M]` rows
    /// ordered `(ty, tx, c)` (see [`class_weight`]); packed, in chunks of [`chunk_cols`]
    /// output channels.
    ClassRows(Vec<Vec<f32>>),
    ClassPanels(Vec<Vec<PackedB>>),
}

/// Output rows of fewer values than this (`KW * M`) take one product over every kernel row at
/// once and copy its rows out: a product per kernel row would fill micro-kernel tiles 16
/// columns wide with 2 (PP-OCR's last deconv), and the transposed product (pixels along the
/// wide side) would pack the whole input transposed on every call.
const NARROW: usize = 16;

/// `W [C, M, KH, KW]` -> `[C, (dy, dx, m)]`: the per-row matrices of [`weight_rows`] side by side.
fn weight_all_rows(wv: &[f32], dims: (usize, usize, usize, usize)) -> Vec<f32> {
    let (c, m, kh, kw) = dims;
    let rows = weight_rows(wv, dims);
    let mut all = Vec::with_capacity(c * kh * kw * m);
    for ci in 0..c {
        for r in &rows {
            all.extend_from_slice(&r[ci * kw * m..][..kw * m]);
        }
    }
    all
}

/// `W [C, M, KH, KW]` -> per kernel row `dy`: `[C, KW * M]` with `[c][dx * M + m] = W[c, m, dy, dx]`.
fn weight_rows(wv: &[f32], (c, m, kh, kw): (usize, usize, usize, usize)) -> Vec<Vec<f32>> {
    (0..kh)
        .map(|dy| {
            let mut r = vec![0.0; c * kw * m];
            for ci in 0..c {
                for mi in 0..m {
                    for dx in 0..kw {
                        r[ci * kw * m + dx * m + mi] = wv[((ci * m + mi) * kh + dy) * kw + dx];
                    }
                }
            }
            r
        })
        .collect()
}

/// Geometry of the sub-pixel form (per axis: stride, taps per output, begin padding, output
/// size).
#[derive(Clone, Copy, Debug)]
struct SubPixel {
    s: [usize; 2],
    t: [usize; 2],
    pb: [usize; 2],
}

/// Whether a ConvTranspose node (2-D) is the sub-pixel form (see the module docs): group 1,
/// dilation 1, each kernel extent a multiple (>= 2) of its stride, explicit pads below the
/// kernel, output padding below the stride, no output shape or automatic padding. Returns the
/// geometry and the output size for input `[h, w]`; `Ok(None)` for another form, `Err` for
/// malformed attributes.
fn sub_pixel(
    node: &Node,
    kernel: [usize; 2],
    input: [usize; 2],
) -> Result<Option<(SubPixel, [usize; 2])>> {
    let s = spatial_attr(node, "strides", 2, 1)?;
    let d = spatial_attr(node, "dilations", 2, 1)?;
    let op = spatial_attr(node, "output_padding", 2, 0)?;
    let p = match node.attr_ints("pads")? {
        None => vec![0; 4],
        Some(v) if v.len() == 4 && v.iter().all(|&x| x >= 0) => {
            v.iter().map(|&x| x as usize).collect()
        }
        Some(v) => bail!("ConvTranspose pads {v:?}: expected 4 non-negative values"),
    };
    let kernel_attr_ok = match node.attr_ints("kernel_shape")? {
        None => true,
        Some(k) => k.len() == 2 && k[0] as usize == kernel[0] && k[1] as usize == kernel[1],
    };
    let axis_ok = |i: usize| {
        s[i] >= 1
            && kernel[i].is_multiple_of(s[i])
            && kernel[i] / s[i] >= 2
            && p[i] < kernel[i]
            && p[i + 2] < kernel[i]
            && op[i] < s[i]
    };
    let form = d == [1, 1]
        && axis_ok(0)
        && axis_ok(1)
        && kernel_attr_ok
        && node.int_or("group", 1)? == 1
        && node.attr_ints("output_shape")?.is_none()
        && node.str_or("auto_pad", "NOTSET")? == "NOTSET";
    if !form {
        return Ok(None);
    }
    let mut out = [0usize; 2];
    for i in 0..2 {
        let full = s[i] * input[i].saturating_sub(1) + op[i] + kernel[i];
        out[i] = full.checked_sub(p[i] + p[i + 2]).ok_or_else(|| {
            crate::RtError::msg(format!(
                "ConvTranspose pads {:?} exceed the output size {full} on axis {i}",
                [p[i], p[i + 2]]
            ))
        })?;
    }
    let geo = SubPixel {
        s: [s[0], s[1]],
        t: [kernel[0] / s[0], kernel[1] / s[1]],
        pb: [p[0], p[1]],
    };
    Ok(Some((geo, out)))
}

/// Whether a ConvTranspose node runs as `npuc.ConvTransposeNhwc` (either form; the layout
/// pass's rule, repeated here so the op refuses what it cannot run).
pub fn runs_nhwc(node: &Node, kernel: [usize; 2]) -> Result<bool> {
    Ok(non_overlapping(node, kernel)? || sub_pixel(node, kernel, [1, 1])?.is_some())
}

/// The sub-pixel form's weight for residue class `(ry, rx)`: `[T0*T1*C, M]`, row
/// `(ty * T1 + tx) * C + c` holding `W[c, :, ky, kx]` with `ky = ry + (T0-1-ty) s0` (padded input
/// row `q + ty` is input `q - (T0-1-ty)`, which meets that tap), likewise `kx`.
fn class_weight(
    wv: &[f32],
    (c, m, kh, kw): (usize, usize, usize, usize),
    g: SubPixel,
    (ry, rx): (usize, usize),
) -> Vec<f32> {
    let [t0, t1] = g.t;
    let mut out = vec![0f32; t0 * t1 * c * m];
    for ty in 0..t0 {
        let ky = ry + (t0 - 1 - ty) * g.s[0];
        for tx in 0..t1 {
            let kx = rx + (t1 - 1 - tx) * g.s[1];
            for ci in 0..c {
                let row = &mut out[((ty * t1 + tx) * c + ci) * m..][..m];
                for (mi, o) in row.iter_mut().enumerate() {
                    *o = wv[((ci * m + mi) * kh + ky) * kw + kx];
                }
            }
        }
    }
    out
}

/// The first index `q` and the count of outputs `o = q s + r - pb` inside `0..size`.
fn class_span(size: usize, s: usize, r: usize, pb: usize) -> (usize, usize) {
    let q0 = pb.saturating_sub(r).div_ceil(s);
    if size + pb < r + 1 {
        return (q0, 0);
    }
    let q1 = (size - 1 + pb - r) / s;
    (q0, (q1 + 1).saturating_sub(q0))
}

/// The sub-pixel form: see the module docs. `xv` is `[n, h, wd, c]`, the result
/// `[n, oh, ow, m]`.
#[allow(clippy::too_many_arguments)]
fn sub_pixel_run(
    ctx: &OpCtx,
    isa: Isa,
    xv: &[f32],
    wv: &[f32],
    bias: Option<&[f32]>,
    (n, h, wd, c): (usize, usize, usize, usize),
    (m, kh, kw): (usize, usize, usize),
    g: SubPixel,
    [oh, ow]: [usize; 2],
) -> Result<Vec<f32>> {
    let [t0, t1] = g.t;
    let [s0, s1] = g.s;
    if n * oh * ow * m == 0 {
        // Padding that consumes the whole output (or an empty batch or channel count).
        return Ok(vec![]);
    }
    if t0 > MAX_TAPS {
        bail!("ConvTransposeNhwc: {t0} kernel rows per output (most {MAX_TAPS})");
    }
    let classes = s0 * s1;
    let k = t0 * t1 * c;
    let chunk = chunk_cols(k, m);
    let pack = || -> Result<Packed> {
        let ws: Vec<Vec<f32>> = (0..classes)
            .map(|r| class_weight(wv, (c, m, kh, kw), g, (r / s1, r % s1)))
            .collect();
        if sgemm::available(isa) {
            let mut p = vec![];
            for w in &ws {
                let chunks = (0..m)
                    .step_by(chunk)
                    .map(|j0| {
                        let cols = chunk.min(m - j0);
                        let part: Vec<f32> = w
                            .chunks_exact(m)
                            .flat_map(|row| &row[j0..j0 + cols])
                            .copied()
                            .collect();
                        PackedB::new(k, cols, View::rows(&part, cols))
                    })
                    .collect::<Result<Vec<_>>>()?;
                p.push(chunks);
            }
            return Ok(Packed::ClassPanels(p));
        }
        Ok(Packed::ClassRows(ws))
    };
    let packed = &*packed_weight(ctx, pack)?;
    let fits = match packed {
        Packed::ClassRows(r) => r.len() == classes && r.iter().all(|r| r.len() == k * m),
        Packed::ClassPanels(p) => {
            p.len() == classes
                && p.iter().all(|ch| {
                    ch.len() == m.div_ceil(chunk)
                        && ch
                            .iter()
                            .enumerate()
                            .all(|(j, q)| q.k() == k && q.n() == chunk.min(m - j * chunk))
                })
        }
        _ => false,
    };
    if !fits {
        bail!("ConvTransposeNhwc packed weight does not match (node cache of another shape)");
    }
    // The input zero-padded by T-1 before and enough after that every class's last output
    // reads inside it: padded row q + ty is input row q + ty - (T0-1).
    let (qy_end, qx_end) = ((oh - 1 + g.pb[0]) / s0 + 1, (ow - 1 + g.pb[1]) / s1 + 1);
    let hp = (h + t0 - 1).max(qy_end + t0 - 1);
    let wp = (wd + t1 - 1).max(qx_end + t1 - 1);
    let mut padded = crate::buffers::filled(n * hp * wp * c, 0f32);
    for ni in 0..n {
        for y in 0..h {
            let src = &xv[((ni * h + y) * wd) * c..][..wd * c];
            let dst = &mut padded[((ni * hp + y + t0 - 1) * wp + t1 - 1) * c..][..wd * c];
            dst.copy_from_slice(src);
        }
    }
    let xp = &padded[..];
    let mut out = crate::buffers::for_overwrite::<f32>(n * oh * ow * m);
    let row_len = ow * m;
    // Output row `row` (image and y), class column `rx`, output channels `j0..j0 + cols` of
    // the class weight `w` (packed chunk or portable rows) into `dst` (that row).
    let class_row = |row: usize, rx: usize, j: usize, dst: &mut [f32]| -> Result<()> {
        let (ni, oy) = (row / oh, row % oh);
        let (ry, qy) = ((oy + g.pb[0]) % s0, (oy + g.pb[0]) / s0);
        let (qx0, count) = class_span(ow, s1, rx, g.pb[1]);
        if count == 0 {
            return Ok(());
        }
        let ox0 = qx0 * s1 + rx - g.pb[1];
        let j0 = j * chunk;
        let cdst = &mut dst[ox0 * m + j0..];
        // Padded input pixel (qy + ty, qx0): the first row of run ty.
        let at = |ty: usize| ((ni * hp + qy + ty) * wp + qx0) * c;
        match packed {
            Packed::ClassPanels(p) => {
                let mut runs = [sgemm::Run {
                    a: &[],
                    k0: 0,
                    kc: 0,
                }; MAX_TAPS];
                for (ty, run) in runs.iter_mut().enumerate().take(t0) {
                    *run = sgemm::Run {
                        a: &xp[at(ty)..],
                        k0: ty * t1 * c,
                        kc: t1 * c,
                    };
                }
                sgemm::sgemm_packed_runs(
                    isa,
                    count,
                    c,
                    &runs[..t0],
                    &p[ry * s1 + rx][j],
                    cdst,
                    s1 * m,
                )
            }
            Packed::ClassRows(w) => {
                // Gather the rows (portable path), then one product over every channel.
                let mut gathered = crate::buffers::for_overwrite::<f32>(count * k);
                for (px, row) in gathered.chunks_exact_mut(k).enumerate() {
                    for (ty, part) in row.chunks_exact_mut(t1 * c).enumerate() {
                        part.copy_from_slice(&xp[at(ty) + px * c..][..t1 * c]);
                    }
                }
                let done = gemm_into(
                    count,
                    m,
                    k,
                    1.0,
                    Mat::rows(&gathered, k),
                    Mat::rows(&w[ry * s1 + rx], m),
                    None,
                    cdst,
                    s1 * m,
                    1,
                );
                crate::buffers::release(gathered);
                done
            }
            _ => bail!("ConvTransposeNhwc: a non-overlapping weight in the sub-pixel path"),
        }
    };
    let chunks = match packed {
        Packed::ClassPanels(_) => m.div_ceil(chunk),
        _ => 1,
    };
    // A block of output rows: per class column and channel chunk, every row of the block, so
    // a chunk's weights (sized to stay in L2) serve all of them before the next is read.
    let block = |(b, dst): (usize, &mut [f32])| -> Result<()> {
        let row0 = b * BLOCK_ROWS;
        for rx in 0..s1 {
            for j in 0..chunks {
                for (i, rdst) in dst.chunks_exact_mut(row_len).enumerate() {
                    class_row(row0 + i, rx, j, rdst)?;
                }
            }
        }
        add_bias(dst, bias);
        Ok(())
    };
    if row_len > 0 {
        let work = n * oh * ow * m * t0 * t1 * c / (s0 * s1).max(1);
        if ctx.threads > 1 && work >= PAR_MIN * 16 && n * oh > BLOCK_ROWS {
            out.par_chunks_mut(BLOCK_ROWS * row_len)
                .enumerate()
                .try_for_each(block)?;
        } else {
            out.chunks_mut(BLOCK_ROWS * row_len)
                .enumerate()
                .try_for_each(block)?;
        }
    }
    crate::buffers::release(padded);
    Ok(out)
}

/// Adds `bias` (one value per channel, if any) to every pixel of the channels-last `dst`.
fn add_bias(dst: &mut [f32], bias: Option<&[f32]>) {
    let Some(bias) = bias.filter(|b| !b.is_empty()) else {
        return;
    };
    for px in dst.chunks_exact_mut(bias.len()) {
        for (o, &bv) in px.iter_mut().zip(bias) {
            *o += bv;
        }
    }
}

/// Output rows a sub-pixel work unit takes (its weight chunks are read once for all of them).
const BLOCK_ROWS: usize = 8;

/// Output channels per packed weight chunk of the sub-pixel form: whole 32-column panels
/// whose `k` rows stay within ~256 KB (L2 holds the chunks of every row class at once).
fn chunk_cols(k: usize, m: usize) -> usize {
    const CHUNK_BYTES: usize = 256 << 10;
    let panels = (CHUNK_BYTES / 4 / k.max(1) / sgemm::NR).max(1);
    (panels * sgemm::NR).min(m.max(1))
}

/// The weight as the products read it: made once per plan for a constant weight (the node's
/// cache), on every call for a computed one.
fn packed_weight(
    ctx: &OpCtx,
    pack: impl FnOnce() -> Result<Packed>,
) -> Result<std::sync::Arc<Packed>> {
    if ctx.input_is_const(1) {
        ctx.cached(pack)
    } else {
        Ok(std::sync::Arc::new(pack()?))
    }
}

/// Most kernel rows per output the sub-pixel path takes (runs on the stack).
const MAX_TAPS: usize = 8;

/// `npuc.ConvTransposeNhwc`: see the module docs.
pub fn conv_transpose_nhwc(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let w = ins.tensor(1)?;
    let b = ins.opt_tensor(2);
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != 4 || ws.len() != 4 {
        bail!("ConvTransposeNhwc needs X [N, H, W, C] and W [C, M, KH, KW], got {xs:?} and {ws:?}");
    }
    if x.dtype() != DType::F32
        || w.dtype() != DType::F32
        || b.is_some_and(|b| b.dtype() != DType::F32)
    {
        bail!("ConvTransposeNhwc supports f32 operands only");
    }
    let (n, h, wd, c) = (xs[0], xs[1], xs[2], xs[3]);
    let (m, kh, kw) = (ws[1], ws[2], ws[3]);
    if ws[0] != c || kh == 0 || kw == 0 {
        bail!("ConvTransposeNhwc weight {ws:?} does not fit X {xs:?} (W is [C, M, KH, KW])");
    }
    let sub = if non_overlapping(ctx.node, [kh, kw])? {
        None
    } else {
        match sub_pixel(ctx.node, [kh, kw], [h, wd])? {
            Some(sub) => Some(sub),
            None => bail!(
                "ConvTransposeNhwc runs strides equal to the kernel {:?} with no padding, or \
                 kernels a multiple (>= 2) of the strides with padding below the kernel; \
                 group 1, dilation 1 (the layout pass converts no other)",
                [kh, kw]
            ),
        }
    };
    let bias = match b {
        Some(b) if b.len() != m => {
            bail!(
                "ConvTransposeNhwc bias has {} values, expected {m}",
                b.len()
            )
        }
        Some(b) => Some(b.as_slice::<f32>()?),
        None => None,
    };
    let xv = x.as_slice::<f32>()?;
    let wv = w.as_slice::<f32>()?;
    if xv.len() != n * h * wd * c || wv.len() != c * m * kh * kw {
        bail!("ConvTransposeNhwc operand sizes do not match their shapes");
    }
    let isa = Isa::detect();
    if let Some((g, [oh, ow])) = sub {
        let out = sub_pixel_run(
            ctx,
            isa,
            xv,
            wv,
            bias,
            (n, h, wd, c),
            (m, kh, kw),
            g,
            [oh, ow],
        )?;
        return Ok(vec![Value::tensor(Tensor::from_vec(
            vec![n, oh, ow, m],
            out,
        )?)]);
    }
    let dims = (c, m, kh, kw);
    let narrow = kw * m < NARROW;
    let pack = || -> Result<Packed> {
        if narrow {
            let all = weight_all_rows(wv, dims);
            if sgemm::available(isa) {
                let taps = kh * kw * m;
                return Ok(Packed::NarrowPanels(PackedB::new(
                    c,
                    taps,
                    View::rows(&all, taps),
                )?));
            }
            return Ok(Packed::NarrowRows(all));
        }
        let rows = weight_rows(wv, dims);
        if sgemm::available(isa) {
            let panels = rows
                .iter()
                .map(|r| PackedB::new(c, kw * m, View::rows(r, kw * m)))
                .collect::<Result<_>>()?;
            return Ok(Packed::Panels(panels));
        }
        Ok(Packed::Rows(rows))
    };
    let packed = &*packed_weight(ctx, pack)?;
    let fits = match packed {
        Packed::Rows(r) => r.len() == kh && r.iter().all(|r| r.len() == c * kw * m),
        Packed::Panels(p) => p.len() == kh && p.iter().all(|p| p.k() == c && p.n() == kw * m),
        Packed::NarrowRows(r) => narrow && r.len() == c * m * kh * kw,
        Packed::NarrowPanels(p) => narrow && p.k() == c && p.n() == m * kh * kw,
        Packed::ClassRows(_) | Packed::ClassPanels(_) => false,
    };
    if !fits {
        bail!(
            "ConvTransposeNhwc packed weight does not match W {ws:?} (node cache of another shape)"
        );
    }
    let (oh, ow) = (h * kh, wd * kw);
    // Input row (image, y) writes output rows y * kh .. y * kh + kh: one contiguous block.
    let block = kh * ow * m;
    let mut out = crate::buffers::for_overwrite::<f32>(n * oh * ow * m);
    let row_in = wd * c;
    let unit = |(r, dst): (usize, &mut [f32])| -> Result<()> {
        let a = &xv[r * row_in..][..row_in];
        // One kernel row's product into output row `dy` (`orow`).
        let kernel_row = |dy: usize, orow: &mut [f32]| -> Result<()> {
            match packed {
                Packed::Panels(p) => {
                    sgemm::sgemm_packed(isa, wd, 1.0, View::rows(a, c), &p[dy], orow, kw * m, 1)?
                }
                Packed::Rows(rw) => gemm_into(
                    wd,
                    kw * m,
                    c,
                    1.0,
                    Mat::rows(a, c),
                    Mat::rows(&rw[dy], kw * m),
                    None,
                    orow,
                    kw * m,
                    1,
                )?,
                Packed::NarrowRows(_) | Packed::NarrowPanels(_) => {
                    narrow_unit(isa, a, packed, bias, (wd, c, m, kh, kw), orow)?
                }
                Packed::ClassRows(_) | Packed::ClassPanels(_) => {
                    bail!("ConvTransposeNhwc: a sub-pixel weight in the non-overlapping path")
                }
            }
            Ok(())
        };
        if matches!(packed, Packed::NarrowRows(_) | Packed::NarrowPanels(_)) {
            // All kernel rows at once (and the bias): `dst` is the whole block.
            return kernel_row(0, dst);
        }
        for (dy, orow) in dst.chunks_exact_mut(ow * m).enumerate() {
            kernel_row(dy, orow)?;
            add_bias(orow, bias);
        }
        Ok(())
    };
    if block > 0 {
        if ctx.threads > 1 && out.len() * c >= PAR_MIN && n * h > 1 {
            out.par_chunks_mut(block).enumerate().try_for_each(unit)?;
        } else {
            out.chunks_mut(block).enumerate().try_for_each(unit)?;
        }
    }
    Ok(vec![Value::tensor(Tensor::from_vec(
        vec![n, oh, ow, m],
        out,
    )?)])
}

/// One input row of a narrow deconv (see [`NARROW`]): `col[x, (dy, dx, m)] = a x w` over
/// every kernel row at once, then each pixel's `KW * M` values of kernel row `dy` copied to
/// output row `dy` with the bias. `dst` is the row's `KH` output rows.
fn narrow_unit(
    isa: Isa,
    a: &[f32],
    packed: &Packed,
    bias: Option<&[f32]>,
    (wd, c, m, kh, kw): (usize, usize, usize, usize, usize),
    dst: &mut [f32],
) -> Result<()> {
    let taps = kh * kw * m;
    let mut col = crate::buffers::for_overwrite::<f32>(taps * wd);
    match packed {
        Packed::NarrowPanels(p) => {
            sgemm::sgemm_packed(isa, wd, 1.0, View::rows(a, c), p, &mut col, taps, 1)?
        }
        Packed::NarrowRows(w) => gemm_into(
            wd,
            taps,
            c,
            1.0,
            Mat::rows(a, c),
            Mat::rows(w, taps),
            None,
            &mut col,
            taps,
            1,
        )?,
        _ => bail!("ConvTransposeNhwc: a wide weight in the narrow path"),
    }
    let run = kw * m;
    let ow = wd * kw;
    for (dy, orow) in dst.chunks_exact_mut(ow * m).enumerate().take(kh) {
        macro_rules! widths {
            ($($r:literal)*) => {
                match run {
                    $($r => scatter_pixels::<$r>(&col, taps, dy * run, bias, m, orow),)*
                    _ => bail!("ConvTransposeNhwc: narrow rows of {run} values (at most {})", NARROW - 1),
                }
            };
        }
        widths!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    }
    crate::buffers::release(col);
    Ok(())
}

/// Copies each pixel's `R` values at `off` of its `taps` in `col` to its `R` outputs in `orow`,
/// adding the bias of their channels (`j % m`). The width is a constant: a slice copy and a
/// cycled bias iterator per pixel of a few values cost several times the product itself
/// (PP-OCRv6 det's 16 -> 1 channel head, 2 values a pixel).
fn scatter_pixels<const R: usize>(
    col: &[f32],
    taps: usize,
    off: usize,
    bias: Option<&[f32]>,
    m: usize,
    orow: &mut [f32],
) {
    let pixels = col.chunks_exact(taps).zip(orow.chunks_exact_mut(R));
    match bias {
        Some(b) => {
            let b: [f32; R] = std::array::from_fn(|j| b[j % m]);
            for (px, out) in pixels {
                let src: &[f32; R] = px[off..off + R].try_into().expect("R values");
                let out: &mut [f32; R] = out.try_into().expect("R outputs");
                for j in 0..R {
                    out[j] = src[j] + b[j];
                }
            }
        }
        None => {
            for (px, out) in pixels {
                out.copy_from_slice(&px[off..off + R]);
            }
        }
    }
}
