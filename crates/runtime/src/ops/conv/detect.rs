//! Detection and image-layout helpers: Col2Im and NonMaxSuppression.

use super::{col2im_add, float_dispatch, to3, Geom};
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::matmul::GemmFloat;
use crate::value::Value;
use npuc_ir::{DType, Node, Tensor};

pub fn register(r: &mut Registry) {
    r.add("Col2Im", 18, col2im);
    r.add("NonMaxSuppression", 10, non_max_suppression);
}

fn ints_attr(node: &Node, name: &str, n: usize, def: i64) -> Result<Vec<usize>> {
    let v: Vec<i64> = match node.attr_ints(name)? {
        Some(v) => v.to_vec(),
        None => vec![def; n],
    };
    if v.len() != n || v.iter().any(|&x| x < 0) {
        bail!("attribute '{name}' must hold {n} non-negative values, got {v:?}");
    }
    Ok(v.into_iter().map(|x| x as usize).collect())
}

/// Col2Im: sums sliding blocks `[N, C * prod(block), L]` back into images `[N, C, *image]`.
fn col2im(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let img: Vec<i64> = ins.tensor(1)?.to_i64_vec()?;
    let blk: Vec<i64> = ins.tensor(2)?.to_i64_vec()?;
    let nsp = img.len();
    if nsp == 0 || blk.len() != nsp || img.iter().chain(&blk).any(|&v| v <= 0) {
        bail!("image_shape {img:?} and block_shape {blk:?} must be positive and equally long");
    }
    let img: Vec<usize> = img.iter().map(|&v| v as usize).collect();
    let blk: Vec<usize> = blk.iter().map(|&v| v as usize).collect();
    let node = ctx.node;
    let s = ints_attr(node, "strides", nsp, 1)?;
    let d = ints_attr(node, "dilations", nsp, 1)?;
    let p = ints_attr(node, "pads", 2 * nsp, 0)?;
    if s.contains(&0) || d.contains(&0) {
        bail!("strides and dilations must be positive");
    }
    let xs = x.shape();
    let ks: usize = blk.iter().product();
    if xs.len() != 3 || xs[1] % ks != 0 {
        bail!("input {xs:?} must be [N, C * {ks}, L]");
    }
    let (n, c) = (xs[0], xs[1] / ks);
    let mut grid = vec![0; nsp];
    for i in 0..nsp {
        let dk = (blk[i] - 1) * d[i] + 1;
        let padded = img[i] + p[i] + p[nsp + i];
        if padded < dk {
            bail!("block extent {dk} exceeds the padded image {padded}");
        }
        grid[i] = (padded - dk) / s[i] + 1;
    }
    if grid.iter().product::<usize>() != xs[2] {
        bail!("input has {} blocks, the geometry gives {grid:?}", xs[2]);
    }
    let g = Geom {
        inp: to3(&grid, 1)?,
        out: to3(&img, 1)?,
        k: to3(&blk, 1)?,
        s: to3(&s, 1)?,
        d: to3(&d, 1)?,
        pb: to3(&p[..nsp], 0)?,
        pe: to3(&p[nsp..], 0)?,
    };
    let mut shape = vec![n, c];
    shape.extend_from_slice(&img);
    let t = float_dispatch!(x.dtype(), T => {
        let xv = T::load(x)?;
        let pout = g.out_size();
        let per = c * ks * xs[2];
        let mut out = vec![<T as num_traits::Zero>::zero(); n * c * pout];
        for ni in 0..n {
            col2im_add(&xv[ni * per..(ni + 1) * per], &g, 0..c, 0..g.inp[0] * g.inp[1], &mut out[ni * c * pout..(ni + 1) * c * pout]);
        }
        T::store(x.dtype(), shape, out)?
    });
    Ok(vec![Value::tensor(t)])
}

/// A box as (x_min, y_min, x_max, y_max).
fn corners(b: &[f64], center: bool) -> [f64; 4] {
    if center {
        let (hw, hh) = (b[2] / 2.0, b[3] / 2.0);
        [b[0] - hw, b[1] - hh, b[0] + hw, b[1] + hh]
    } else {
        [
            b[1].min(b[3]),
            b[0].min(b[2]),
            b[1].max(b[3]),
            b[0].max(b[2]),
        ]
    }
}

/// Whether IoU(a, b) exceeds `thr` (degenerate boxes never suppress).
fn suppresses(a: &[f64; 4], b: &[f64; 4], thr: f64) -> bool {
    let (ix0, ix1) = (a[0].max(b[0]), a[2].min(b[2]));
    let (iy0, iy1) = (a[1].max(b[1]), a[3].min(b[3]));
    if ix1 <= ix0 || iy1 <= iy0 {
        return false;
    }
    let inter = (ix1 - ix0) * (iy1 - iy0);
    let a1 = (a[2] - a[0]) * (a[3] - a[1]);
    let a2 = (b[2] - b[0]) * (b[3] - b[1]);
    let union = a1 + a2 - inter;
    if inter <= 0.0 || a1 <= 0.0 || a2 <= 0.0 || union <= 0.0 {
        return false;
    }
    inter / union > thr
}

/// NonMaxSuppression: greedy per (batch, class) selection by descending score (ties by lower
/// box index), dropping boxes whose IoU with a kept box exceeds the threshold.
fn non_max_suppression(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let boxes = ins.tensor(0)?;
    let scores = ins.tensor(1)?;
    let (bs, ss) = (boxes.shape(), scores.shape());
    if bs.len() != 3 || bs[2] != 4 || ss.len() != 3 || ss[0] != bs[0] || ss[2] != bs[1] {
        bail!("boxes must be [B, N, 4] and scores [B, C, N], got {bs:?} and {ss:?}");
    }
    let scalar = |i: usize| -> Result<Option<f64>> {
        match ins.opt_tensor(i) {
            Some(t) if !t.is_empty() => Ok(Some(t.to_f64_vec()?[0])),
            _ => Ok(None),
        }
    };
    let max_out = scalar(2)?.unwrap_or(0.0).max(0.0) as usize;
    let iou = scalar(3)?.unwrap_or(0.0);
    let score_thr = scalar(4)?;
    let center = ctx.node.int_or("center_point_box", 0)? != 0;
    let (nb, nboxes, nc) = (bs[0], bs[1], ss[1]);
    let bv = boxes.to_f64_vec()?;
    let sv = scores.to_f64_vec()?;
    let mut sel: Vec<i64> = vec![];
    let mut cand: Vec<usize> = Vec::with_capacity(nboxes);
    let mut kept: Vec<[f64; 4]> = vec![];
    for b in 0..nb {
        let bx: Vec<[f64; 4]> = (0..nboxes)
            .map(|i| corners(&bv[(b * nboxes + i) * 4..][..4], center))
            .collect();
        for c in 0..nc {
            let sc = &sv[(b * nc + c) * nboxes..][..nboxes];
            cand.clear();
            cand.extend((0..nboxes).filter(|&i| score_thr.is_none_or(|t| sc[i] > t)));
            // Stable sort keeps lower indices first among equal scores.
            cand.sort_by(|&i, &j| {
                sc[j]
                    .partial_cmp(&sc[i])
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
            kept.clear();
            for &i in &cand {
                if kept.len() >= max_out {
                    break;
                }
                if kept.iter().all(|k| !suppresses(k, &bx[i], iou)) {
                    kept.push(bx[i]);
                    sel.extend_from_slice(&[b as i64, c as i64, i as i64]);
                }
            }
        }
    }
    let n = sel.len() / 3;
    Ok(vec![Value::tensor(Tensor::from_vec(vec![n, 3], sel)?)])
}
