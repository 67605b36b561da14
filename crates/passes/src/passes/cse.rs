//! Common subexpression elimination: two pure nodes with the same op, domain, attributes and
//! inputs compute the same outputs, so the later one's readers are redirected to the earlier
//! one. Non-deterministic ops and nodes with subgraphs are never merged.

use crate::util::{is_pure, Index};
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};
use std::collections::{HashMap, HashSet};

pub struct Cse;

impl Pass for Cse {
    fn name(&self) -> &'static str {
        "cse"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let g = &rw.model().graph;
        let order = match g.topo_order(&HashSet::new()) {
            Ok(o) => o,
            Err(_) => return Ok(PassStats::default()),
        };
        let ix = Index::new(g);
        // Key: op, domain and inputs; attributes are compared exactly within a bucket.
        let mut seen: HashMap<(String, String, Vec<String>), Vec<usize>> = HashMap::new();
        let mut merges: Vec<(usize, usize)> = vec![];
        for &i in &order {
            let n = &g.nodes[i];
            if !is_pure(n) || n.outputs.iter().all(|o| o.is_empty()) {
                continue;
            }
            let key = (n.op_type.clone(), n.domain.clone(), n.inputs.clone());
            let bucket = seen.entry(key).or_default();
            let twin = bucket.iter().copied().find(|&j| {
                let o = &g.nodes[j];
                o.attrs == n.attrs && o.outputs.len() == n.outputs.len()
            });
            match twin {
                Some(j) => merges.push((i, j)),
                None => bucket.push(i),
            }
        }
        let mut patch = GraphPatch::new();
        let mut merged = 0;
        for (i, j) in merges {
            let outs = g.nodes[i].outputs.iter().zip(&g.nodes[j].outputs);
            // Only merge when every output can be redirected (none is a graph output or
            // captured, and the twin produces each one the node produces).
            let ok = outs
                .clone()
                .all(|(a, b)| a.is_empty() || (!b.is_empty() && ix.is_internal(a)));
            if !ok {
                continue;
            }
            for (a, b) in outs {
                if !a.is_empty() {
                    patch.merge_value(&ix, a, b);
                }
            }
            patch.remove(i);
            merged += 1;
        }
        rw.apply(patch);
        Ok(PassStats::new(merged))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;
    use npuc_ir::{Attr, Node};

    #[test]
    fn merges_duplicates_only_with_equal_attrs() {
        let m = model(
            vec![
                Node::new("Softmax", &["x"], &["a"]).with_attr("axis", Attr::Int(1)),
                Node::new("Softmax", &["x"], &["b"]).with_attr("axis", Attr::Int(1)),
                Node::new("Softmax", &["x"], &["c"]).with_attr("axis", Attr::Int(0)),
                Node::new("Add", &["a", "b"], &["d"]),
                Node::new("Add", &["d", "c"], &["y"]),
            ],
            &[("x", &[2, 3])],
            &["y"],
        );
        let (opt, n) = check_pass(&Cse, &m, &[("x", data(&[2, 3], 3))]);
        assert_eq!(n, 1);
        assert_eq!(opt.graph.nodes.len(), 4);
        assert_eq!(opt.graph.nodes[2].inputs, ["a", "a"]);
    }
}
