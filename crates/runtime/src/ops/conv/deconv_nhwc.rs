//! `npuc.ConvTransposeNhwc(X, W[, B])`: a 2-D ONNX ConvTranspose with `X` and `Y` channels-last
//! (`[N, H, W, C]` in, `[N, OH, OW, M]` out; `W` in the ONNX layout `[C, M, KH, KW]`), made by
//! the `layout-nhwc` pass for the upsampling heads of detectors (PP-OCR's DB head: 2x2 kernels
//! at stride 2) so they stay in the channels-last chain instead of leaving it twice.
//!
//! Only the non-overlapping form is supported: strides equal to the kernel, no padding,
//! dilation 1, group 1, no output padding. Then every input pixel writes its own
//! `KH x KW` block of output pixels, and input row `y` alone makes output rows
//! `y * KH .. y * KH + KH`: for kernel row `dy`, output row `y * KH + dy` read as a
//! `[W, KW * M]` matrix is the product of the input row `[W, C]` and the weight's columns
//! `(dy, dx, m)` for that `dy` (`[C, KW * M]`). No column buffer, no scatter: each product
//! writes its output row in place, the bias added while the row is in cache.

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
    if !non_overlapping(ctx.node, [kh, kw])? {
        bail!(
            "ConvTransposeNhwc runs only strides equal to the kernel {:?} with no padding, \
             dilation, group or output padding (the layout pass converts no other)",
            [kh, kw]
        );
    }
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
    let cached;
    let fresh;
    let packed: &Packed = if ctx.input_is_const(1) {
        cached = ctx.cached(pack)?;
        &cached
    } else {
        fresh = pack()?;
        &fresh
    };
    let fits = match packed {
        Packed::Rows(r) => r.len() == kh && r.iter().all(|r| r.len() == c * kw * m),
        Packed::Panels(p) => p.len() == kh && p.iter().all(|p| p.k() == c && p.n() == kw * m),
        Packed::NarrowRows(r) => narrow && r.len() == c * m * kh * kw,
        Packed::NarrowPanels(p) => narrow && p.k() == c && p.n() == m * kh * kw,
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
            }
            Ok(())
        };
        if matches!(packed, Packed::NarrowRows(_) | Packed::NarrowPanels(_)) {
            // All kernel rows at once (and the bias): `dst` is the whole block.
            return kernel_row(0, dst);
        }
        for (dy, orow) in dst.chunks_exact_mut(ow * m).enumerate() {
            kernel_row(dy, orow)?;
            if let Some(bias) = bias {
                for px in orow.chunks_exact_mut(m) {
                    for (o, &bv) in px.iter_mut().zip(bias) {
                        *o += bv;
                    }
                }
            }
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
        Packed::Rows(_) | Packed::Panels(_) => {
            bail!("ConvTransposeNhwc: a wide weight in the narrow path")
        }
    }
    let run = kw * m;
    let ow = wd * kw;
    for (dy, orow) in dst.chunks_exact_mut(ow * m).enumerate().take(kh) {
        for (px, out) in col.chunks_exact(taps).zip(orow.chunks_exact_mut(run)) {
            out.copy_from_slice(&px[dy * run..][..run]);
            if let Some(b) = bias {
                for (o, &bv) in out.iter_mut().zip(b.iter().cycle()) {
                    *o += bv;
                }
            }
        }
    }
    crate::buffers::release(col);
    Ok(())
}
