//! GELU fusion: the exporters' exact-erf form `x * 0.5 * (1 + erf(x / sqrt(2)))` — with the
//! division written as `x * (1/sqrt 2)` and the three-way product in any association
//! (`(x*a)*0.5`, `(a*0.5)*x`, `(x*0.5)*a`) — becomes one `Gelu` node (ONNX opset 20, or the
//! `npuc` domain op for older models). Constants must match to float precision and every
//! intermediate value must be read only inside the pattern.

use crate::patch::fuse_patterns;
use crate::util::{is_op, other_input, Index};
use crate::{Pass, PassError, PassStats, Rewriter};
use npuc_ir::{Graph, Node};

pub struct GeluFusion;

fn const_is(g: &Graph, ix: &Index, name: &str, want: f64) -> bool {
    ix.const_scalar(g, name)
        .is_some_and(|v| (v - want).abs() <= 1e-6 * want.abs())
}

/// Matches the pattern around Erf node `ei`; returns (x, output, nodes to remove).
fn matches(g: &Graph, ix: &Index, ei: usize) -> Option<(String, String, Vec<usize>)> {
    let e = &g.nodes[ei];
    let u = e.input(0)?;
    let (di, d) = ix.prod(g, u)?;
    if ix.sole_user(u)? != ei {
        return None;
    }
    let x = if is_op(d, "Div") && const_is(g, ix, d.input(1)?, std::f64::consts::SQRT_2) {
        d.input(0)?
    } else if is_op(d, "Mul") {
        let (a, b) = (d.input(0)?, d.input(1)?);
        if const_is(g, ix, b, std::f64::consts::FRAC_1_SQRT_2) {
            a
        } else if const_is(g, ix, a, std::f64::consts::FRAC_1_SQRT_2) {
            b
        } else {
            return None;
        }
    } else {
        return None;
    };
    let eo = e.outputs.first()?;
    let ai = ix.sole_user(eo)?;
    let a = &g.nodes[ai];
    if !is_op(a, "Add") || !const_is(g, ix, other_input(a, eo)?, 1.0) {
        return None;
    }
    let ao = a.outputs.first()?;
    let m1i = ix.sole_user(ao)?;
    let m1 = &g.nodes[m1i];
    if !is_op(m1, "Mul") {
        return None;
    }
    let o = other_input(m1, ao)?;
    let m1o = m1.outputs.first()?;
    let mut nodes = vec![di, ei, ai, m1i];
    let out = if o == x {
        let m2i = ix.sole_user(m1o)?;
        let m2 = &g.nodes[m2i];
        if !is_op(m2, "Mul") || !const_is(g, ix, other_input(m2, m1o)?, 0.5) {
            return None;
        }
        nodes.push(m2i);
        m2.outputs.first()?.clone()
    } else if const_is(g, ix, o, 0.5) {
        let m2i = ix.sole_user(m1o)?;
        let m2 = &g.nodes[m2i];
        if !is_op(m2, "Mul") || other_input(m2, m1o)? != x {
            return None;
        }
        nodes.push(m2i);
        m2.outputs.first()?.clone()
    } else {
        let (hi, h) = ix.prod(g, o)?;
        if !is_op(h, "Mul")
            || ix.sole_user(o)? != m1i
            || other_input(h, x).is_none_or(|c| !const_is(g, ix, c, 0.5))
        {
            return None;
        }
        nodes.push(hi);
        m1o.clone()
    };
    Some((x.to_string(), out, nodes))
}

impl Pass for GeluFusion {
    fn name(&self) -> &'static str {
        "gelu-fusion"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let fused = fuse_patterns(rw, "Erf", "Gelu", |g, ix, i, domain| {
            let n = &g.nodes[i];
            if !is_op(n, "Erf") {
                return None;
            }
            let (x, out, nodes) = matches(g, ix, i)?;
            let mut f = Node::new("Gelu", &[x.as_str()], &[out.as_str()]);
            f.domain = domain.into();
            f.name = n.name.clone();
            Some((i, f, nodes))
        });
        Ok(PassStats::new(fused))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;

    #[test]
    fn fuses_erf_gelu_orderings() {
        let mut m = model(
            vec![
                // (x * a) * 0.5
                Node::new("Div", &["x", "s2"], &["d"]),
                Node::new("Erf", &["d"], &["e"]),
                Node::new("Add", &["e", "one"], &["a"]),
                Node::new("Mul", &["x", "a"], &["p"]),
                Node::new("Mul", &["p", "half"], &["y"]),
                // (x * 0.5) * a, with x * (1/sqrt2)
                Node::new("Mul", &["x", "r2"], &["d2"]),
                Node::new("Erf", &["d2"], &["e2"]),
                Node::new("Add", &["one", "e2"], &["a2"]),
                Node::new("Mul", &["x", "half"], &["h2"]),
                Node::new("Mul", &["h2", "a2"], &["z"]),
            ],
            &[("x", &[2, 8])],
            &["y", "z"],
        );
        let gi = &mut m.graph.initializers;
        gi.push(init("s2", f32s(&[], &[std::f32::consts::SQRT_2])));
        gi.push(init("r2", f32s(&[], &[std::f32::consts::FRAC_1_SQRT_2])));
        gi.push(init("one", f32s(&[], &[1.0])));
        gi.push(init("half", f32s(&[], &[0.5])));
        if npuc_runtime::registry().find("", "Gelu", 20).is_none() {
            // Gelu's kernel comes with the elementwise family; without it the pass must not fire.
            let mut opt = m.clone();
            assert_eq!(crate::apply_pass(&GeluFusion, &mut opt).unwrap().changes, 0);
            return;
        }
        let (opt, n) = check_pass(&GeluFusion, &m, &[("x", data(&[2, 8], 11))]);
        assert_eq!(n, 2);
        assert_eq!(ops(&opt), ["Gelu", "Gelu"]);
    }
}
