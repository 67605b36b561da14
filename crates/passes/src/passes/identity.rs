//! Identity elimination: removes nodes whose output equals their first input —
//! `Identity`, `Dropout` in inference (no training-mode input, mask unused), `Cast` to the
//! input's own dtype, `Reshape` to the input's own static shape, `Transpose` with the identity
//! permutation, and (rank-preserving) `Expand` whose target is the input's own static shape.
//! Readers of the output are redirected to the input; when the output is a graph output its
//! name is kept by renaming the input's producer instead.

use crate::util::fixed_shape;
use crate::util::{is_op, Index};
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};
use npuc_ir::infer::{infer_model, InferResult};
use npuc_ir::{Node, TypeInfo};
use std::collections::HashMap;

pub struct IdentityElim;

fn dtype_of(r: &InferResult, name: &str) -> Option<npuc_ir::DType> {
    match r.type_of(name)? {
        TypeInfo::Tensor { dtype, .. } => *dtype,
        _ => None,
    }
}

/// Whether `n` passes its first input through unchanged.
fn is_identity(n: &Node, ix: &Index, g: &npuc_ir::Graph, r: &InferResult) -> bool {
    let (Some(x), Some(y)) = (n.input(0), n.outputs.first()) else {
        return false;
    };
    if y.is_empty() || !n.domain.is_empty() {
        return false;
    }
    match n.op_type.as_str() {
        "Identity" => n.inputs.len() == 1 && n.outputs.len() == 1,
        "Dropout" => {
            let mask_unused = n
                .outputs
                .get(1)
                .is_none_or(|o| o.is_empty() || (ix.is_internal(o) && ix.users(o).is_empty()));
            let training = match n.input(2) {
                None => false,
                Some(t) => match ix.const_scalar(g, t) {
                    Some(v) => v != 0.0,
                    None => true,
                },
            };
            let test_attr = n.attr_int("is_test").ok().flatten().unwrap_or(1) != 0;
            mask_unused && !training && test_attr
        }
        "Cast" => {
            let to = n.attr_int("to").ok().flatten();
            let src = dtype_of(r, x);
            match (to, src) {
                (Some(to), Some(src)) => {
                    npuc_ir::DType::from_onnx_code(to as i32) == Some(src) && n.outputs.len() == 1
                }
                _ => false,
            }
        }
        "Reshape" | "Expand" => match (fixed_shape(r, x), fixed_shape(r, y)) {
            (Some(a), Some(b)) => a == b && n.outputs.len() == 1,
            _ => false,
        },
        "Transpose" => match n.attr_ints("perm") {
            Ok(Some(p)) => p.iter().enumerate().all(|(i, &v)| v == i as i64),
            Ok(None) => fixed_shape(r, x).is_some_and(|(_, s)| s.len() <= 1),
            Err(_) => false,
        },
        _ => false,
    }
}

impl Pass for IdentityElim {
    fn name(&self) -> &'static str {
        "identity-elim"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let m = rw.model();
        let needs_types = m.graph.nodes.iter().any(|n| {
            ["Cast", "Reshape", "Expand", "Transpose"].contains(&n.op_type.as_str())
                && n.domain.is_empty()
        });
        let r = if needs_types {
            infer_model(m, &HashMap::new())
        } else {
            InferResult::default()
        };
        let mut i = 0;
        let mut changes = 0;
        // One merge per patch: a merge renames values, so the next match is looked for in
        // the graph (and index) it leaves (identities are few).
        'scan: loop {
            let g = &rw.model().graph;
            let ix = Index::new(g);
            let mut patch = GraphPatch::new();
            while i < g.nodes.len() {
                let n = &g.nodes[i];
                if is_identity(n, &ix, g, &r) {
                    let (x, y) = (&n.inputs[0], &n.outputs[0]);
                    if is_op(n, "Dropout") && n.outputs.get(1).is_some_and(|o| !o.is_empty()) {
                        // The mask is unused; drop it so the merge does not see two outputs.
                        let mut single = n.clone();
                        single.outputs.truncate(1);
                        patch.replace(i, single);
                    }
                    if patch.merge_value(&ix, y, x) {
                        patch.remove(i);
                        rw.apply(patch);
                        changes += 1;
                        continue 'scan;
                    }
                }
                i += 1;
            }
            rw.apply(patch);
            break;
        }
        Ok(PassStats::new(changes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;
    use npuc_ir::Attr;

    #[test]
    fn removes_identities_and_keeps_output_names() {
        let m = model(
            vec![
                Node::new("Relu", &["x"], &["a"]),
                Node::new("Identity", &["a"], &["b"]),
                Node::new("Transpose", &["b"], &["c"]).with_attr("perm", Attr::Ints(vec![0, 1])),
                Node::new("Cast", &["c"], &["d"]).with_attr("to", Attr::Int(1)),
                Node::new("Dropout", &["d"], &["y"]),
            ],
            &[("x", &[2, 3])],
            &["y"],
        );
        let (opt, n) = check_pass(&IdentityElim, &m, &[("x", data(&[2, 3], 1))]);
        assert_eq!(n, 4);
        assert_eq!(ops(&opt), ["Relu"]);
        assert_eq!(opt.graph.nodes[0].outputs, ["y"]);
    }

    #[test]
    fn keeps_input_passthrough_to_output() {
        // y = Identity(x) with x a graph input: cannot rename a graph input, keep the node.
        let m = model(
            vec![Node::new("Identity", &["x"], &["y"])],
            &[("x", &[2])],
            &["y"],
        );
        let (opt, n) = check_pass(&IdentityElim, &m, &[("x", data(&[2], 1))]);
        assert_eq!(n, 0);
        assert_eq!(ops(&opt), ["Identity"]);
    }
}
