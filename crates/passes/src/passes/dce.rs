//! Dead code elimination: removes nodes none of whose outputs is read (by a node, a subgraph
//! or as a graph output), and initializers nobody reads. Valid because every remaining op is
//! side-effect free (non-deterministic ops have no observable effect other than their output).

use crate::util::Index;
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};

pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let mut removed = 0;
        // Removing a node can make its producers dead: repeat until nothing is.
        loop {
            let g = &rw.model().graph;
            let ix = Index::new(g);
            let live = |o: &String| {
                !o.is_empty()
                    && (ix.graph_outputs.contains(o)
                        || ix.captured.contains(o)
                        || !ix.users(o).is_empty())
            };
            let mut patch = GraphPatch::new();
            for (i, n) in g.nodes.iter().enumerate() {
                if !n.outputs.iter().any(live) {
                    patch.remove(i);
                    removed += 1;
                }
            }
            if patch.is_empty() {
                break;
            }
            rw.apply(patch);
        }
        let g = &rw.model().graph;
        let ix = Index::new(g);
        let mut patch = GraphPatch::new();
        for i in &g.initializers {
            let read = !ix.users(&i.name).is_empty()
                || ix.graph_outputs.contains(&i.name)
                || ix.graph_inputs.contains(&i.name)
                || ix.captured.contains(&i.name);
            if !read {
                patch.remove_initializer(&i.name);
                removed += 1;
            }
        }
        rw.apply(patch);
        Ok(PassStats::new(removed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;
    use npuc_ir::Node;

    #[test]
    fn removes_unused_chain_keeps_outputs() {
        let mut m = model(
            vec![
                Node::new("Relu", &["x"], &["a"]),
                Node::new("Relu", &["a"], &["dead1"]),
                Node::new("Relu", &["dead1"], &["dead2"]),
                Node::new("Relu", &["a"], &["y"]),
            ],
            &[("x", &[2, 3])],
            &["y"],
        );
        m.graph
            .initializers
            .push(init("unused", f32s(&[1], &[1.0])));
        let st = crate::apply_pass(&Dce, &mut m).unwrap();
        assert_eq!(st.changes, 3);
        assert_eq!(m.graph.nodes.len(), 2);
        assert!(m.graph.initializers.is_empty());
    }
}
