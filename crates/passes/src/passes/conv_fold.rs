//! Folding per-channel affine ops into a preceding `Conv` with constant f32 weights:
//! - `BatchNormalization` (inference form): `y = (conv(x) - mean) * s + B` with
//!   `s = scale / sqrt(var + eps)` equals a conv with weights `W * s[m]` and bias
//!   `(b - mean) * s + B`.
//! - `Mul` by a constant that is per output channel (shape `[M,1..]`, `[1,M,1..]` or a scalar)
//!   scales weights and bias; `Add` of such a constant adds to the bias.
//!
//! All three also fold into a group-1 `ConvTranspose` (`W [C, M, k...]`: output channel `m`'s
//! weights are `W[:, m]`): a detector head's upsampling bias, a decoder's BatchNormalization.
//!
//! Exact up to float rounding (the conv computes the same affine map of its inputs). The conv
//! output must be read only by the folded op, and the fold is skipped whenever a shape, dtype
//! or constant is not what the rule needs.

use crate::util::{is_op, other_input, Index};
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};
use npuc_ir::{DType, Graph, Node, Tensor};
use std::collections::HashSet;

pub struct ConvBnFold;
pub struct ConvAffineFold;

/// Weights (as f32 vec with shape) and bias of a Conv whose W (and B) are f32 constants; of a
/// group-1 ConvTranspose (`W [C, M, k...]`, M output channels) too.
fn conv_params(g: &Graph, ix: &Index, c: &Node) -> Option<(Vec<usize>, Vec<f32>, Vec<f32>)> {
    let w = ix.constant(g, c.input(1)?)?;
    if w.dtype() != DType::F32 || w.rank() < 3 {
        return None;
    }
    let m = if is_op(c, "ConvTranspose") {
        if !matches!(c.attr_int("group"), Ok(None | Some(1))) {
            return None;
        }
        w.shape()[1]
    } else {
        w.shape()[0]
    };
    let b = match c.input(2) {
        Some(b) => {
            let b = ix.constant(g, b)?;
            if b.dtype() != DType::F32 || b.len() != m {
                return None;
            }
            b.as_slice::<f32>().ok()?.to_vec()
        }
        None => vec![0.0; m],
    };
    Some((w.shape().to_vec(), w.as_slice::<f32>().ok()?.to_vec(), b))
}

/// Per-output-channel values of a constant that broadcasts against a conv output
/// `[N, M, spatial...]` of rank `rank` without changing its shape.
fn per_channel(t: &Tensor, m: usize, rank: usize) -> Option<Vec<f64>> {
    let v = t.to_f64_vec().ok()?;
    let s = t.shape();
    if t.len() == 1 && s.len() <= rank {
        return Some(vec![v[0]; m]);
    }
    // Right-align the constant's shape against [N, M, sp...]: only the channel dim may be > 1.
    if s.len() > rank || s.len() < rank - 1 {
        return None;
    }
    let off = rank - s.len();
    for (i, &d) in s.iter().enumerate() {
        let axis = i + off;
        if axis == 1 {
            if d != m {
                return None;
            }
        } else if d != 1 {
            return None;
        }
    }
    Some(v)
}

/// Plans conv `ci` with new weights and bias (fresh initializers) producing `out`; false when
/// the tensors cannot be built.
fn rewrite(
    g: &Graph,
    patch: &mut GraphPatch,
    taken: &mut HashSet<String>,
    ci: usize,
    (wshape, w, b): (Vec<usize>, Vec<f32>, Vec<f32>),
    out: String,
) -> bool {
    let (Ok(wt), Ok(bt)) = (
        Tensor::from_vec(wshape, w),
        Tensor::from_vec(vec![b.len()], b),
    ) else {
        return false;
    };
    let base = &g.nodes[ci].outputs[0];
    let wn = patch.add_fresh_initializer(g, taken, &format!("{base}_w"), wt);
    let bn = patch.add_fresh_initializer(g, taken, &format!("{base}_b"), bt);
    let mut c = g.nodes[ci].clone();
    c.inputs = vec![c.inputs[0].clone(), wn, bn];
    c.outputs = vec![out];
    patch.replace(ci, c);
    true
}

fn run_fold(rw: &mut Rewriter<'_>, bn: bool) -> usize {
    let g = &rw.model().graph;
    let ix = Index::new(g);
    let mut taken = HashSet::new();
    let mut dead = HashSet::new();
    let mut plans = vec![];
    for (ci, c) in g.nodes.iter().enumerate() {
        let deconv = is_op(c, "ConvTranspose");
        if !(is_op(c, "Conv") || deconv) || c.outputs.len() != 1 {
            continue;
        }
        let y = &c.outputs[0];
        let Some(ui) = ix.sole_user(y) else { continue };
        let u = &g.nodes[ui];
        if dead.contains(&ui) {
            continue;
        }
        let Some((ws, mut w, mut b)) = conv_params(g, &ix, c) else {
            continue;
        };
        let mch = b.len();
        let per = w.len() / mch.max(1);
        let rank = ws.len();
        // Output channel `ch`'s weights times `k`: a Conv's `W [M, ...]` holds them in one
        // block, a (group-1) ConvTranspose's `W [C, M, k...]` in one kernel block per input
        // channel.
        let kernel: usize = ws[2..].iter().product();
        let scale_out = |w: &mut [f32], ch: usize, k: f64| {
            // (first block, blocks, stride between blocks, block length)
            let (first, blocks, stride, len) = if deconv {
                (ch * kernel, ws[0], mch * kernel, kernel)
            } else {
                (ch * per, 1, 0, per)
            };
            for bi in 0..blocks {
                for v in &mut w[first + bi * stride..][..len] {
                    *v = (*v as f64 * k) as f32;
                }
            }
        };
        if bn {
            if !is_op(u, "BatchNormalization")
                || u.input(0) != Some(y.as_str())
                || u.outputs.iter().skip(1).any(|o| !o.is_empty())
                || u.int_or("training_mode", 0).unwrap_or(1) != 0
            {
                continue;
            }
            let p: Option<Vec<Vec<f64>>> = (1..5)
                .map(|k| {
                    let t = ix.constant(g, u.input(k)?)?;
                    let v = t.to_f64_vec().ok()?;
                    (v.len() == mch).then_some(v)
                })
                .collect();
            let Some(p) = p else { continue };
            let Ok(eps) = u.float_or("epsilon", 1e-5) else {
                continue;
            };
            for ch in 0..mch {
                let s = p[0][ch] / (p[3][ch] + eps as f64).sqrt();
                scale_out(&mut w, ch, s);
                b[ch] = ((b[ch] as f64 - p[2][ch]) * s + p[1][ch]) as f32;
            }
        } else {
            let is_mul = is_op(u, "Mul");
            if !(is_mul || is_op(u, "Add")) {
                continue;
            }
            let Some(other) = other_input(u, y) else {
                continue;
            };
            let Some(k) = ix.constant(g, other) else {
                continue;
            };
            if k.dtype() != DType::F32 {
                continue;
            }
            let Some(k) = per_channel(&k, mch, rank) else {
                continue;
            };
            for ch in 0..mch {
                if is_mul {
                    scale_out(&mut w, ch, k[ch]);
                    b[ch] = (b[ch] as f64 * k[ch]) as f32;
                } else {
                    b[ch] = (b[ch] as f64 + k[ch]) as f32;
                }
            }
        }
        let Some(out) = u.outputs.first().cloned() else {
            continue;
        };
        dead.insert(ui);
        plans.push((ci, ui, ws, w, b, out));
    }
    let mut patch = GraphPatch::new();
    let mut n = 0;
    for (ci, ui, ws, w, b, out) in plans {
        if rewrite(g, &mut patch, &mut taken, ci, (ws, w, b), out) {
            patch.remove(ui);
            n += 1;
        }
    }
    rw.apply(patch);
    n
}

impl Pass for ConvBnFold {
    fn name(&self) -> &'static str {
        "conv-bn-fold"
    }
    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        Ok(PassStats::new(run_fold(rw, true)))
    }
}

impl Pass for ConvAffineFold {
    fn name(&self) -> &'static str {
        "conv-affine-fold"
    }
    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        Ok(PassStats::new(run_fold(rw, false)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;
    use npuc_ir::Attr;

    #[test]
    fn folds_bn_then_mul_add() {
        let mut m = model(
            vec![
                Node::new("Conv", &["x", "w"], &["c"])
                    .with_attr("pads", Attr::Ints(vec![1, 1, 1, 1])),
                Node::new("BatchNormalization", &["c", "s", "bb", "mu", "var"], &["n"]),
                Node::new("Mul", &["k", "n"], &["p"]),
                Node::new("Add", &["p", "a"], &["y"]),
            ],
            &[("x", &[1, 2, 5, 5])],
            &["y"],
        );
        let gi = &mut m.graph.initializers;
        gi.push(init("w", data(&[3, 2, 3, 3], 1)));
        gi.push(init("s", f32s(&[3], &[1.0, 0.5, 2.0])));
        gi.push(init("bb", f32s(&[3], &[0.1, 0.2, 0.3])));
        gi.push(init("mu", f32s(&[3], &[0.0, -1.0, 1.0])));
        gi.push(init("var", f32s(&[3], &[1.0, 4.0, 0.25])));
        gi.push(init("k", f32s(&[1, 3, 1, 1], &[2.0, -1.0, 0.5])));
        gi.push(init("a", f32s(&[1], &[0.75])));
        let feeds = [("x", data(&[1, 2, 5, 5], 9))];
        let (m1, n1) = check_pass(&ConvBnFold, &m, &feeds);
        assert_eq!(n1, 1);
        let (m2, n2) = check_pass(&ConvAffineFold, &m1, &feeds);
        assert_eq!(n2, 1);
        let (m3, n3) = check_pass(&ConvAffineFold, &m2, &feeds);
        assert_eq!(n3, 1);
        assert_eq!(ops(&m3), ["Conv"]);
        assert_eq!(m3.graph.nodes[0].outputs, ["y"]);
    }

    /// BatchNormalization, a per-channel Add and a per-channel Mul after a group-1 ConvTranspose
    /// (with or without a bias; a decoder's 4x4 stride-2 upsampling) fold into its weight and
    /// bias (output channel m is `W[:, m]`), outputs equal.
    #[test]
    fn folds_affine_ops_into_conv_transpose() {
        for bias in [false, true] {
            let ins: &[&str] = if bias { &["x", "w", "b"] } else { &["x", "w"] };
            let mut m = model(
                vec![
                    Node::new("ConvTranspose", ins, &["c"])
                        .with_attr("strides", Attr::Ints(vec![2, 2]))
                        .with_attr("pads", Attr::Ints(vec![1, 1, 1, 1])),
                    Node::new("BatchNormalization", &["c", "s", "bb", "mu", "var"], &["n"]),
                    Node::new("Add", &["n", "a"], &["d"]),
                    Node::new("Mul", &["d", "k"], &["y"]),
                ],
                &[("x", &[1, 2, 4, 5])],
                &["y"],
            );
            let gi = &mut m.graph.initializers;
            gi.push(init("w", data(&[2, 3, 4, 4], 1)));
            gi.push(init("b", f32s(&[3], &[0.5, -0.5, 1.0])));
            gi.push(init("s", f32s(&[3], &[1.0, 0.5, 2.0])));
            gi.push(init("bb", f32s(&[3], &[0.1, 0.2, 0.3])));
            gi.push(init("mu", f32s(&[3], &[0.0, -1.0, 1.0])));
            gi.push(init("var", f32s(&[3], &[1.0, 4.0, 0.25])));
            gi.push(init("a", f32s(&[1, 3, 1, 1], &[0.1, 0.2, 0.3])));
            gi.push(init("k", f32s(&[1, 3, 1, 1], &[2.0, -1.0, 0.5])));
            let feeds = [("x", data(&[1, 2, 4, 5], 9))];
            let (m1, n1) = check_pass(&ConvBnFold, &m, &feeds);
            assert_eq!(n1, 1, "bias {bias}");
            let (m2, n2) = check_pass(&ConvAffineFold, &m1, &feeds);
            assert_eq!(n2, 1, "bias {bias}");
            let (m3, n3) = check_pass(&ConvAffineFold, &m2, &feeds);
            assert_eq!(n3, 1, "bias {bias}");
            assert_eq!(ops(&m3), ["ConvTranspose"]);
        }
    }
}
