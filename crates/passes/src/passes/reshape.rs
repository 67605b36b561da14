//! Layout-op folding:
//! - `Transpose(Transpose(x, p), q)` becomes `Transpose(x, p∘q)` (`out[i] = x[p[q[i]]]`).
//! - `Reshape(Reshape(x, s1), s2)` becomes `Reshape(x, s2)` when `s2` is a constant without
//!   zeros (a 0 would copy a dim of the intermediate) — the element order is unchanged by any
//!   reshape, so only the final shape matters.
//! - `Squeeze(Unsqueeze(x, a), a)` and `Unsqueeze(Squeeze(x, a), a)` with the same explicit
//!   non-negative axes are `x` (the squeezed dims have size 1 by definition) and become an
//!   `Identity`, which identity elimination then removes.
//!
//! The inner node must be read only by the outer one (otherwise nothing is saved).

use crate::util::{is_op, Index};
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};
use npuc_ir::{Attr, Graph, Node};

pub struct ReshapeFold;

/// Axes of a Squeeze/Unsqueeze: the attribute (old opsets) or a constant second input.
fn axes(g: &Graph, ix: &Index, n: &Node) -> Option<Vec<i64>> {
    if let Ok(Some(a)) = n.attr_ints("axes") {
        return Some(a.to_vec());
    }
    let t = ix.constant(g, n.input(1)?)?;
    t.to_i64_vec().ok()
}

impl Pass for ReshapeFold {
    fn name(&self) -> &'static str {
        "layout-fold"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let g = &rw.model().graph;
        let ix = Index::new(g);
        let mut patch = GraphPatch::new();
        let mut folded = 0;
        // Nodes an earlier fold read or replaced: a chain folds one pair per run.
        let mut touched = std::collections::HashSet::new();
        for (i, n) in g.nodes.iter().enumerate() {
            let Some(x) = n.input(0) else { continue };
            let Some((pi, p)) = ix.prod(g, x) else {
                continue;
            };
            if ix.sole_user(x) != Some(i) || touched.contains(&pi) || touched.contains(&i) {
                continue;
            }
            let Some(src) = p.input(0) else { continue };
            let new = if is_op(n, "Transpose") && is_op(p, "Transpose") {
                let (Ok(Some(pp)), Ok(Some(q))) = (p.attr_ints("perm"), n.attr_ints("perm")) else {
                    continue;
                };
                if pp.len() != q.len() {
                    continue;
                }
                let comp: Option<Vec<i64>> = q
                    .iter()
                    .map(|&k| usize::try_from(k).ok().and_then(|k| pp.get(k).copied()))
                    .collect();
                let Some(comp) = comp else { continue };
                let mut t = n.clone();
                t.inputs[0] = src.to_string();
                t.attrs = vec![("perm".into(), Attr::Ints(comp))];
                t
            } else if is_op(n, "Reshape") && is_op(p, "Reshape") {
                let Some(shape) = n.input(1).and_then(|s| ix.constant(g, s)) else {
                    continue;
                };
                let Ok(sv) = shape.to_i64_vec() else { continue };
                if sv.contains(&0) {
                    continue;
                }
                let mut t = n.clone();
                t.inputs[0] = src.to_string();
                t
            } else if (is_op(n, "Squeeze") && is_op(p, "Unsqueeze"))
                || (is_op(n, "Unsqueeze") && is_op(p, "Squeeze"))
            {
                let (Some(mut a), Some(mut b)) = (axes(g, &ix, n), axes(g, &ix, p)) else {
                    continue;
                };
                a.sort_unstable();
                b.sort_unstable();
                if a != b || a.iter().any(|&v| v < 0) || a.is_empty() {
                    continue;
                }
                let mut t = Node::new("Identity", &[src], &[]);
                t.name = n.name.clone();
                t.outputs = n.outputs.clone();
                t
            } else {
                continue;
            };
            touched.insert(i);
            touched.insert(pi);
            patch.replace(i, new);
            folded += 1;
        }
        rw.apply(patch);
        Ok(PassStats::new(folded))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;

    #[test]
    fn folds_transposes_reshapes_and_squeeze_pairs() {
        let mut m = model(
            vec![
                Node::new("Transpose", &["x"], &["t1"])
                    .with_attr("perm", Attr::Ints(vec![1, 2, 0])),
                Node::new("Transpose", &["t1"], &["t2"])
                    .with_attr("perm", Attr::Ints(vec![0, 2, 1])),
                Node::new("Reshape", &["t2"], &["r1"]).with_attr("allowzero", Attr::Int(0)),
                Node::new("Reshape", &["r1", "s2"], &["r2"]),
                Node::new("Unsqueeze", &["r2", "ax"], &["u"]),
                Node::new("Squeeze", &["u", "ax"], &["y"]),
            ],
            &[("x", &[2, 3, 4])],
            &["y"],
        );
        m.graph.nodes[2].inputs.push("s1".into());
        m.graph.initializers.push(init("s1", i64s(&[2], &[6, 4])));
        m.graph
            .initializers
            .push(init("s2", i64s(&[3], &[4, -1, 2])));
        m.graph.initializers.push(init("ax", i64s(&[1], &[1])));
        let (opt, n) = check_pass(&ReshapeFold, &m, &[("x", data(&[2, 3, 4], 5))]);
        assert_eq!(n, 3);
        assert_eq!(
            opt.graph.nodes[1].attr_ints("perm").unwrap().unwrap(),
            [1, 0, 2]
        );
        assert_eq!(opt.graph.nodes[3].inputs[0], "t2");
        assert_eq!(opt.graph.nodes[5].op_type, "Identity");
    }
}
