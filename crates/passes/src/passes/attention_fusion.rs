//! Attention fusion: the scaled-dot-product pattern exporters emit,
//! `MatMul(Q·s1, Kᵀ·s2) [·s | /c] [+ mask] -> Softmax(last axis) -> MatMul(·, V)`,
//! where `Kᵀ` comes from a rank-4 Transpose that swaps the last two axes of K's layout, becomes
//! one `Attention(Q, K, V[, mask], scale = s1·s2·s)` (ONNX opset 23, or the `npuc` domain op for
//! older models). K is recovered by a Transpose of the same source with the last two entries of
//! the permutation exchanged, so no data moves that the pattern did not already move.
//!
//! ONNX Attention computes `softmax(Q·Kᵀ·scale + mask)·V` over `[B, H, S, D]` operands, which is
//! exactly the pattern's arithmetic; the scale is folded from scalar constants only. Every
//! intermediate must be read only inside the pattern.

use crate::util::{is_op, runnable_domain, Index};
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};
use npuc_ir::{Attr, Graph, Model, Node};
use std::collections::HashSet;

pub struct AttentionFusion;

/// Follows an optional `Mul`-by-scalar-constant: returns (source, factor, mul node index).
fn strip_scale(g: &Graph, ix: &Index, name: &str) -> (String, f64, Option<usize>) {
    if let Some((i, n)) = ix.prod(g, name) {
        if is_op(n, "Mul") && ix.sole_user(name).is_some() && ix.is_internal(name) {
            for (a, b) in [(0, 1), (1, 0)] {
                if let (Some(x), Some(c)) = (n.input(a), n.input(b)) {
                    if let Some(s) = ix.const_scalar(g, c) {
                        if !ix.is_const(g, x) {
                            return (x.to_string(), s, Some(i));
                        }
                    }
                }
            }
        }
    }
    (name.to_string(), 1.0, None)
}

struct Match {
    q: String,
    /// The rank-4 Transpose source of Kᵀ and the permutation that yields K from it.
    k_src: String,
    k_perm: Vec<i64>,
    v: String,
    mask: Option<String>,
    scale: f64,
    out: String,
    /// Node indices: the first MatMul (reused for the new K Transpose), the final MatMul
    /// (reused for Attention), and the rest to delete.
    qk: usize,
    pv: usize,
    dead: Vec<usize>,
}

fn softmax_last(m: &Model, n: &Node) -> bool {
    if !is_op(n, "Softmax") {
        return false;
    }
    let opset = crate::util::onnx_opset(m);
    match n.int_or("axis", if opset >= 13 { -1 } else { 1 }) {
        // Rank 4 scores: -1 and 3 are the last axis; before opset 13, Softmax flattens from
        // `axis` on, which is the same as the last axis only when axis is the last one.
        Ok(a) => a == -1 || a == 3,
        Err(_) => false,
    }
}

fn matches(m: &Model, ix: &Index, si: usize) -> Option<Match> {
    let g = &m.graph;
    let sm = &g.nodes[si];
    if !softmax_last(m, sm) {
        return None;
    }
    let p = sm.outputs.first()?;
    let pv = ix.sole_user(p)?;
    let pvn = &g.nodes[pv];
    if !is_op(pvn, "MatMul") || pvn.input(0)? != p.as_str() || !ix.is_internal(p) {
        return None;
    }
    let v = pvn.input(1)?.to_string();
    let mut dead = vec![si];
    let mut scale = 1.0;
    // Walk back from the Softmax input: [Add mask] <- [Mul s | Div c] <- MatMul.
    let mut cur = sm.input(0)?.to_string();
    let mut mask = None;
    if let Some((ai, a)) = ix.prod(g, &cur) {
        if is_op(a, "Add") && ix.sole_user(&cur) == Some(si) && ix.is_internal(&cur) {
            // The mask is the operand not produced by the (scaled) Q·Kᵀ chain.
            let (x, y) = (a.input(0)?, a.input(1)?);
            let from_chain = |t: &str| {
                ix.prod(g, t)
                    .is_some_and(|(_, n)| is_op(n, "MatMul") || is_op(n, "Mul") || is_op(n, "Div"))
            };
            let (s, mk) = if from_chain(x) && !from_chain(y) {
                (x, y)
            } else if from_chain(y) && !from_chain(x) {
                (y, x)
            } else {
                return None;
            };
            mask = Some(mk.to_string());
            dead.push(ai);
            cur = s.to_string();
        }
    }
    if let Some((di, d)) = ix.prod(g, &cur) {
        if (is_op(d, "Mul") || is_op(d, "Div"))
            && ix.sole_user(&cur).is_some()
            && ix.is_internal(&cur)
        {
            let (x, c) = (d.input(0)?, d.input(1)?);
            let k = if is_op(d, "Mul") {
                match (ix.const_scalar(g, c), ix.const_scalar(g, x)) {
                    (Some(s), _) => Some((x, s)),
                    (None, Some(s)) => Some((c, s)),
                    _ => None,
                }
            } else {
                ix.const_scalar(g, c)
                    .filter(|s| *s != 0.0)
                    .map(|s| (x, 1.0 / s))
            };
            if let Some((src, s)) = k {
                scale *= s;
                dead.push(di);
                cur = src.to_string();
            }
        }
    }
    let (qk, qkn) = ix.prod(g, &cur)?;
    if !is_op(qkn, "MatMul") || ix.sole_user(&cur).is_none() || !ix.is_internal(&cur) {
        return None;
    }
    let (q, s1, qm) = strip_scale(g, ix, qkn.input(0)?);
    let (kt, s2, km) = strip_scale(g, ix, qkn.input(1)?);
    scale *= s1 * s2;
    dead.extend(qm);
    dead.extend(km);
    // Kᵀ must come from a rank-4 Transpose; K = the same source with the last two axes of the
    // permutation exchanged.
    let (_, tn) = ix.prod(g, &kt)?;
    if !is_op(tn, "Transpose") {
        return None;
    }
    let perm = tn.attr_ints("perm").ok()??.to_vec();
    if perm.len() != 4 {
        return None;
    }
    let k_perm = vec![perm[0], perm[1], perm[3], perm[2]];
    // Q and V must be rank 4 too: require them to come from rank-4 Transposes (what exporters
    // emit after splitting heads), the only case where the shapes are known without inference.
    let rank4 = |t: &str| {
        ix.prod(g, t).is_some_and(|(_, n)| {
            is_op(n, "Transpose") && matches!(n.attr_ints("perm"), Ok(Some(p)) if p.len() == 4)
        })
    };
    if !rank4(&q) || !rank4(&v) {
        return None;
    }
    if !scale.is_finite() || scale == 0.0 {
        return None;
    }
    Some(Match {
        q,
        k_src: tn.input(0)?.to_string(),
        k_perm,
        v,
        mask,
        scale,
        out: pvn.outputs.first()?.clone(),
        qk,
        pv,
        dead,
    })
}

impl Pass for AttentionFusion {
    fn name(&self) -> &'static str {
        "attention-fusion"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let m = rw.model();
        if !m.graph.nodes.iter().any(|n| is_op(n, "Softmax")) {
            return Ok(PassStats::default());
        }
        let Some(domain) = runnable_domain(m, "Attention") else {
            return Ok(PassStats::default());
        };
        let g = &m.graph;
        let ix = Index::new(g);
        let mut names: HashSet<String> = g
            .nodes
            .iter()
            .flat_map(|n| n.outputs.iter().cloned())
            .chain(g.initializers.iter().map(|i| i.name.clone()))
            .chain(g.inputs.iter().map(|i| i.name.clone()))
            .collect();
        let mut patch = GraphPatch::new();
        let mut fused = 0;
        for (i, n) in g.nodes.iter().enumerate() {
            if !is_op(n, "Softmax") {
                continue;
            }
            let Some(mt) = matches(m, &ix, i) else {
                continue;
            };
            let all: Vec<usize> = mt.dead.iter().copied().chain([mt.qk, mt.pv]).collect();
            if all.iter().any(|&k| patch.claimed(k)) {
                continue;
            }
            // The first product becomes K's Transpose, the last one the Attention node.
            let base = g.nodes[mt.pv].name.clone();
            let k_name = crate::util::fresh_name(g, &mut names, &format!("{}_k", mt.out));
            let mut kt = Node::new("Transpose", &[&mt.k_src], &[&k_name])
                .with_attr("perm", Attr::Ints(mt.k_perm.clone()));
            kt.name = format!("{base}/k_transpose");
            let ins: Vec<&str> = match &mt.mask {
                Some(mk) => vec![&mt.q, &k_name, &mt.v, mk],
                None => vec![&mt.q, &k_name, &mt.v],
            };
            let mut at = Node::new("Attention", &ins, &[&mt.out])
                .with_attr("scale", Attr::Float(mt.scale as f32));
            at.domain = domain.into();
            at.name = base;
            patch.replace(mt.qk, kt);
            patch.fuse(mt.pv, at, &mt.dead);
            fused += 1;
        }
        if fused > 0 && domain == "npuc" {
            patch.import_domain("npuc");
        }
        rw.apply(patch);
        Ok(PassStats::new(fused))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;

    fn tr(x: &str, y: &str, perm: &[i64]) -> Node {
        Node::new("Transpose", &[x], &[y]).with_attr("perm", Attr::Ints(perm.to_vec()))
    }

    /// ViT-style: heads split by Transpose, both operands pre-scaled, Kᵀ by perm [0,2,3,1].
    #[test]
    fn fuses_vit_style_attention() {
        let mut m = model(
            vec![
                tr("q", "qt", &[0, 2, 1, 3]),
                tr("k", "kt", &[0, 2, 3, 1]),
                tr("v", "vt", &[0, 2, 1, 3]),
                Node::new("Mul", &["qt", "s"], &["qs"]),
                Node::new("Mul", &["kt", "s"], &["ks"]),
                Node::new("MatMul", &["qs", "ks"], &["sc"]),
                Node::new("Softmax", &["sc"], &["p"]).with_attr("axis", Attr::Int(-1)),
                Node::new("MatMul", &["p", "vt"], &["y"]),
            ],
            &[
                ("q", &[2, 5, 3, 4]),
                ("k", &[2, 5, 3, 4]),
                ("v", &[2, 5, 3, 4]),
            ],
            &["y"],
        );
        m.opset_imports[0].version = 14;
        m.graph.initializers.push(init("s", f32s(&[], &[0.5])));
        let feeds = [
            ("q", data(&[2, 5, 3, 4], 1)),
            ("k", data(&[2, 5, 3, 4], 2)),
            ("v", data(&[2, 5, 3, 4], 3)),
        ];
        let (opt, n) = check_pass(&AttentionFusion, &m, &feeds);
        assert_eq!(n, 1);
        assert!(
            ops(&opt).contains(&"Attention".to_string()),
            "{:?}",
            ops(&opt)
        );
        assert!(!ops(&opt).contains(&"Softmax".to_string()));
    }

    /// BERT-style: Div by sqrt(d) after the product, an additive mask, opset 23 (ONNX domain).
    #[test]
    fn fuses_scaled_masked_attention() {
        let mut m = model(
            vec![
                tr("q", "qt", &[0, 2, 1, 3]),
                tr("k", "kt", &[0, 2, 3, 1]),
                tr("v", "vt", &[0, 2, 1, 3]),
                Node::new("MatMul", &["qt", "kt"], &["sc"]),
                Node::new("Div", &["sc", "c"], &["sd"]),
                Node::new("Add", &["sd", "mask"], &["sm"]),
                Node::new("Softmax", &["sm"], &["p"]).with_attr("axis", Attr::Int(3)),
                Node::new("MatMul", &["p", "vt"], &["y"]),
            ],
            &[
                ("q", &[1, 6, 2, 8]),
                ("k", &[1, 6, 2, 8]),
                ("v", &[1, 6, 2, 8]),
                ("mask", &[1, 1, 1, 6]),
            ],
            &["y"],
        );
        m.opset_imports[0].version = 23;
        m.graph.initializers.push(init("c", f32s(&[], &[2.0])));
        let feeds = [
            ("q", data(&[1, 6, 2, 8], 4)),
            ("k", data(&[1, 6, 2, 8], 5)),
            ("v", data(&[1, 6, 2, 8], 6)),
            ("mask", data(&[1, 1, 1, 6], 7)),
        ];
        let (opt, n) = check_pass(&AttentionFusion, &m, &feeds);
        assert_eq!(n, 1);
        let at = opt
            .graph
            .nodes
            .iter()
            .find(|n| n.op_type == "Attention")
            .unwrap();
        assert_eq!(at.domain, "");
        assert_eq!(at.inputs.len(), 4);
    }

    /// A Softmax whose scores are also a graph output is left alone.
    #[test]
    fn leaves_shared_scores() {
        let mut m = model(
            vec![
                tr("q", "qt", &[0, 2, 1, 3]),
                tr("k", "kt", &[0, 2, 3, 1]),
                tr("v", "vt", &[0, 2, 1, 3]),
                Node::new("MatMul", &["qt", "kt"], &["sc"]),
                Node::new("Softmax", &["sc"], &["p"]).with_attr("axis", Attr::Int(-1)),
                Node::new("MatMul", &["p", "vt"], &["y"]),
            ],
            &[
                ("q", &[1, 2, 2, 4]),
                ("k", &[1, 2, 2, 4]),
                ("v", &[1, 2, 2, 4]),
            ],
            &["y", "sc"],
        );
        m.opset_imports[0].version = 17;
        let feeds = [
            ("q", data(&[1, 2, 2, 4], 1)),
            ("k", data(&[1, 2, 2, 4], 2)),
            ("v", data(&[1, 2, 2, 4], 3)),
        ];
        let (_, n) = check_pass(&AttentionFusion, &m, &feeds);
        assert_eq!(n, 0);
    }
}
