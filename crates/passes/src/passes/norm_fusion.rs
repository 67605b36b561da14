//! LayerNormalization fusion from the decomposed exporter form
//! `d = x - ReduceMean(x); y = d / Sqrt(ReduceMean(Pow(d, 2)) + eps) * gamma + beta`
//! (the square also as `Mul(d, d)`)
//! (reductions over the last axis with keepdims, gamma/beta constants of one row), into one
//! `LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)` (the ONNX op at opset 17+, the
//! `npuc` domain op for older models). The fused op computes the same mean and biased
//! variance over the same axis. Every intermediate must be read only inside the pattern.

use crate::patch::fuse_patterns;
use crate::util::{is_op, other_input, Index};
use crate::{Pass, PassError, PassStats, Rewriter};
use npuc_ir::{Attr, Graph, Node};

pub struct LayerNormFusion;

/// A ReduceMean over the last axis only, keeping dims.
fn mean_last(g: &Graph, ix: &Index, n: &Node) -> bool {
    if !is_op(n, "ReduceMean") || n.int_or("keepdims", 1).ok() != Some(1) {
        return false;
    }
    let axes = match n.attr_ints("axes") {
        Ok(Some(a)) => a.to_vec(),
        Ok(None) => match n.input(1).and_then(|a| ix.constant(g, a)) {
            Some(t) => t.to_i64_vec().unwrap_or_default(),
            None => return false,
        },
        Err(_) => return false,
    };
    axes == [-1]
}

/// Matches around the Sub node `si`: returns (x, gamma, beta, eps, output, removed nodes).
#[allow(clippy::type_complexity)]
fn matches(
    g: &Graph,
    ix: &Index,
    si: usize,
) -> Option<(String, String, String, f32, String, Vec<usize>)> {
    let s = &g.nodes[si];
    let (x, mu) = (s.input(0)?, s.input(1)?);
    let (mi, mn) = ix.prod(g, mu)?;
    if !mean_last(g, ix, mn) || mn.input(0)? != x || ix.sole_user(mu)? != si {
        return None;
    }
    let d = s.outputs.first()?;
    if !ix.is_internal(d) {
        return None;
    }
    let users = ix.users(d);
    if users.len() != 2 {
        return None;
    }
    // The square is `Pow(d, 2)`, or `Mul(d, d)` (how the quantized lowering rewrites it).
    let is_square = |n: &Node| {
        if n.input(0) != Some(d.as_str()) {
            return false;
        }
        if is_op(n, "Mul") {
            return n.input(1) == Some(d.as_str());
        }
        is_op(n, "Pow") && n.input(1).and_then(|e| ix.const_scalar(g, e)) == Some(2.0)
    };
    let (pi, qi) = if is_square(&g.nodes[users[0]]) {
        (users[0], users[1])
    } else {
        (users[1], users[0])
    };
    let (p, q) = (&g.nodes[pi], &g.nodes[qi]);
    if !is_square(p) {
        return None;
    }
    let vi = ix.sole_user(p.outputs.first()?)?;
    let v = &g.nodes[vi];
    if !mean_last(g, ix, v) {
        return None;
    }
    let vo = v.outputs.first()?;
    let ai = ix.sole_user(vo)?;
    let a = &g.nodes[ai];
    if !is_op(a, "Add") {
        return None;
    }
    let eps = ix.const_scalar(g, other_input(a, vo)?)?;
    let ri = ix.sole_user(a.outputs.first()?)?;
    let r = &g.nodes[ri];
    if !is_op(r, "Sqrt") || ix.sole_user(r.outputs.first()?)? != qi {
        return None;
    }
    if !is_op(q, "Div") || q.input(0)? != d || q.input(1)? != r.outputs.first()?.as_str() {
        return None;
    }
    let qo = q.outputs.first()?;
    let gi = ix.sole_user(qo)?;
    let gm = &g.nodes[gi];
    if !is_op(gm, "Mul") {
        return None;
    }
    let gamma = other_input(gm, qo)?;
    let go = gm.outputs.first()?;
    let bi = ix.sole_user(go)?;
    let bn = &g.nodes[bi];
    if !is_op(bn, "Add") {
        return None;
    }
    let beta = other_input(bn, go)?;
    let (gt, bt) = (ix.constant(g, gamma)?, ix.constant(g, beta)?);
    // One row of parameters: rank 1 (or leading 1s), same length, more than one element so
    // that the broadcast is along the normalized axis exactly.
    let row = |t: &npuc_ir::Tensor| t.len() > 1 && t.shape().last() == Some(&t.len());
    if !row(&gt) || !row(&bt) || gt.len() != bt.len() || gt.rank() > 1 || bt.rank() > 1 {
        return None;
    }
    Some((
        x.to_string(),
        gamma.to_string(),
        beta.to_string(),
        eps as f32,
        bn.outputs.first()?.clone(),
        vec![mi, si, pi, vi, ai, ri, qi, gi, bi],
    ))
}

impl Pass for LayerNormFusion {
    fn name(&self) -> &'static str {
        "layernorm-fusion"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let fused = fuse_patterns(
            rw,
            "ReduceMean",
            "LayerNormalization",
            |g, ix, i, domain| {
                let n = &g.nodes[i];
                if !is_op(n, "Sub") {
                    return None;
                }
                let (x, gamma, beta, eps, out, nodes) = matches(g, ix, i)?;
                let mut f = Node::new("LayerNormalization", &[&x, &gamma, &beta], &[&out])
                    .with_attr("axis", Attr::Int(-1))
                    .with_attr("epsilon", Attr::Float(eps));
                f.domain = domain.into();
                f.name = n.name.clone();
                Some((i, f, nodes))
            },
        );
        Ok(PassStats::new(fused))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;
    use npuc_ir::Model;

    /// The exporter's decomposed LayerNorm over the last axis of `x[2, 3, 8]`, its square
    /// written as `square(d, p)`.
    fn decomposed(square: Node) -> Model {
        let mut m = model(
            vec![
                Node::new("ReduceMean", &["x"], &["mu"]).with_attr("axes", Attr::Ints(vec![-1])),
                Node::new("Sub", &["x", "mu"], &["d"]),
                square,
                Node::new("ReduceMean", &["p"], &["v"]).with_attr("axes", Attr::Ints(vec![-1])),
                Node::new("Add", &["v", "eps"], &["ve"]),
                Node::new("Sqrt", &["ve"], &["s"]),
                Node::new("Div", &["d", "s"], &["n"]),
                Node::new("Mul", &["n", "gamma"], &["gn"]),
                Node::new("Add", &["gn", "beta"], &["y"]),
            ],
            &[("x", &[2, 3, 8])],
            &["y"],
        );
        m.opset_imports[0].version = 14;
        let gi = &mut m.graph.initializers;
        gi.push(init("two", f32s(&[], &[2.0])));
        gi.push(init("eps", f32s(&[], &[1e-5])));
        gi.push(init("gamma", data(&[8], 1)));
        gi.push(init("beta", data(&[8], 2)));
        gi.push(init("other", data(&[8], 4)));
        m
    }

    /// The square as `Pow(d, 2)` (the exporter) or `Mul(d, d)` (the quantized lowering); a
    /// `Mul` of two different values is not a square and stays as it is.
    #[test]
    fn fuses_decomposed_layernorm() {
        for square in [
            Node::new("Pow", &["d", "two"], &["p"]),
            Node::new("Mul", &["d", "d"], &["p"]),
        ] {
            let m = decomposed(square);
            let (opt, n) = check_pass(&LayerNormFusion, &m, &[("x", data(&[2, 3, 8], 3))]);
            assert_eq!(n, 1);
            assert_eq!(ops(&opt), ["LayerNormalization"]);
            assert_eq!(opt.graph.nodes[0].domain, "npuc");
        }
        // (Its "variance" can be negative, so only the rewrite count is checked.)
        let mut other = decomposed(Node::new("Mul", &["d", "other"], &["p"]));
        assert_eq!(
            crate::apply_pass(&LayerNormFusion, &mut other)
                .unwrap()
                .changes,
            0
        );
    }
}

/// RMSNormalization fusion from the decomposed form
/// `y = x / Sqrt(ReduceMean(Pow(x, 2)) + eps) * gamma` (also `x * Reciprocal(Sqrt(..))`,
/// `Mul(x, x)` for the square, and gamma on either side of the last Mul), reductions over the
/// last axis with keepdims, into `RMSNormalization(x, gamma, axis=-1, epsilon=eps)` (ONNX
/// opset 23, or the `npuc` domain op for older models).
pub struct RmsNormFusion;

/// Matches around the square node `pi` (Pow(x, 2) or Mul(x, x)): returns
/// (x, gamma, eps, output, removed nodes).
#[allow(clippy::type_complexity)]
fn rms_matches(
    g: &Graph,
    ix: &Index,
    pi: usize,
) -> Option<(String, String, f32, String, Vec<usize>)> {
    let p = &g.nodes[pi];
    let x = p.input(0)?;
    let square = (is_op(p, "Pow") && ix.const_scalar(g, p.input(1)?)? == 2.0)
        || (is_op(p, "Mul") && p.input(1)? == x);
    if !square {
        return None;
    }
    let po = p.outputs.first()?;
    let vi = ix.sole_user(po)?;
    let v = &g.nodes[vi];
    if !mean_last(g, ix, v) || !ix.is_internal(po) {
        return None;
    }
    let vo = v.outputs.first()?;
    let ai = ix.sole_user(vo)?;
    let a = &g.nodes[ai];
    if !is_op(a, "Add") || !ix.is_internal(vo) {
        return None;
    }
    let eps = ix.const_scalar(g, other_input(a, vo)?)?;
    let ao = a.outputs.first()?;
    let ri = ix.sole_user(ao)?;
    let r = &g.nodes[ri];
    if !is_op(r, "Sqrt") || !ix.is_internal(ao) {
        return None;
    }
    let ro = r.outputs.first()?;
    let ni = ix.sole_user(ro)?;
    let n = &g.nodes[ni];
    if !ix.is_internal(ro) {
        return None;
    }
    // x / sqrt(..)  or  x * reciprocal(sqrt(..)).
    let mut nodes = vec![pi, vi, ai, ri, ni];
    let normed = if is_op(n, "Div") && n.input(0)? == x && n.input(1)? == ro.as_str() {
        n.outputs.first()?
    } else if is_op(n, "Reciprocal") {
        let no = n.outputs.first()?;
        let mi = ix.sole_user(no)?;
        let mn = &g.nodes[mi];
        if !is_op(mn, "Mul") || other_input(mn, no)? != x || !ix.is_internal(no) {
            return None;
        }
        nodes.push(mi);
        mn.outputs.first()?
    } else {
        return None;
    };
    if !ix.is_internal(normed) {
        return None;
    }
    let gi = ix.sole_user(normed)?;
    let gm = &g.nodes[gi];
    if !is_op(gm, "Mul") {
        return None;
    }
    let gamma = other_input(gm, normed)?;
    let gt = ix.constant(g, gamma)?;
    if gt.len() < 2 || gt.rank() > 1 || !gt.dtype().is_float() {
        return None;
    }
    nodes.push(gi);
    Some((
        x.to_string(),
        gamma.to_string(),
        eps as f32,
        gm.outputs.first()?.clone(),
        nodes,
    ))
}

impl Pass for RmsNormFusion {
    fn name(&self) -> &'static str {
        "rmsnorm-fusion"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let fused = fuse_patterns(rw, "ReduceMean", "RMSNormalization", |g, ix, i, domain| {
            let n = &g.nodes[i];
            if !is_op(n, "Pow") && !is_op(n, "Mul") {
                return None;
            }
            let (x, gamma, eps, out, nodes) = rms_matches(g, ix, i)?;
            // The fused node takes the place of the last node of the pattern (the gamma Mul),
            // where x and gamma are both available.
            let last = *nodes.last()?;
            let mut f = Node::new("RMSNormalization", &[&x, &gamma], &[&out])
                .with_attr("axis", Attr::Int(-1))
                .with_attr("epsilon", Attr::Float(eps));
            f.domain = domain.into();
            f.name = g.nodes[last].name.clone();
            Some((last, f, nodes))
        });
        Ok(PassStats::new(fused))
    }
}

#[cfg(test)]
mod rms_tests {
    use super::*;
    use crate::passes::testutil::*;

    #[test]
    fn fuses_decomposed_rmsnorm_both_forms() {
        for reciprocal in [false, true] {
            let mut nodes = vec![
                Node::new("Pow", &["x", "two"], &["p"]),
                Node::new("ReduceMean", &["p"], &["v"]).with_attr("axes", Attr::Ints(vec![-1])),
                Node::new("Add", &["v", "eps"], &["ve"]),
                Node::new("Sqrt", &["ve"], &["s"]),
            ];
            if reciprocal {
                nodes.push(Node::new("Reciprocal", &["s"], &["r"]));
                nodes.push(Node::new("Mul", &["x", "r"], &["n"]));
            } else {
                nodes.push(Node::new("Div", &["x", "s"], &["n"]));
            }
            nodes.push(Node::new("Mul", &["gamma", "n"], &["y"]));
            let mut m = model(nodes, &[("x", &[2, 3, 8])], &["y"]);
            m.opset_imports[0].version = 14;
            let gi = &mut m.graph.initializers;
            gi.push(init("two", f32s(&[], &[2.0])));
            gi.push(init("eps", f32s(&[], &[1e-6])));
            gi.push(init("gamma", data(&[8], 1)));
            let (opt, n) = check_pass(&RmsNormFusion, &m, &[("x", data(&[2, 3, 8], 3))]);
            assert_eq!(n, 1);
            assert_eq!(ops(&opt), ["RMSNormalization"]);
        }
    }

    #[test]
    fn keeps_a_pattern_whose_intermediate_is_an_output() {
        let mut m = model(
            vec![
                Node::new("Mul", &["x", "x"], &["p"]),
                Node::new("ReduceMean", &["p"], &["v"]).with_attr("axes", Attr::Ints(vec![-1])),
                Node::new("Add", &["v", "eps"], &["ve"]),
                Node::new("Sqrt", &["ve"], &["s"]),
                Node::new("Div", &["x", "s"], &["n"]),
                Node::new("Mul", &["n", "gamma"], &["y"]),
            ],
            &[("x", &[4, 8])],
            &["y", "v"],
        );
        let gi = &mut m.graph.initializers;
        gi.push(init("eps", f32s(&[], &[1e-6])));
        gi.push(init("gamma", data(&[8], 1)));
        let (_, n) = check_pass(&RmsNormFusion, &m, &[("x", data(&[4, 8], 3))]);
        assert_eq!(n, 0);
    }
}
