//! Dead code elimination: removes nodes none of whose outputs is read (by a node, a subgraph
//! or as a graph output), and initializers nobody reads. Valid because every remaining op is
//! side-effect free (non-deterministic ops have no observable effect other than their output).

use crate::util::Index;
use crate::{Pass, PassError, PassStats};
use npuc_ir::Model;
use std::collections::HashSet;

pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn run(&self, m: &mut Model) -> Result<PassStats, PassError> {
        let g = &mut m.graph;
        let mut removed = 0;
        loop {
            let ix = Index::new(g);
            let live = |o: &String| {
                !o.is_empty()
                    && (ix.graph_outputs.contains(o)
                        || ix.captured.contains(o)
                        || !ix.users(o).is_empty())
            };
            let dead: HashSet<usize> = g
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| !n.outputs.iter().any(live))
                .map(|(i, _)| i)
                .collect();
            if dead.is_empty() {
                break;
            }
            removed += dead.len();
            crate::util::remove_nodes(g, &dead);
        }
        let ix = Index::new(g);
        let before = g.initializers.len();
        g.initializers.retain(|i| {
            !ix.users(&i.name).is_empty()
                || ix.graph_outputs.contains(&i.name)
                || ix.graph_inputs.contains(&i.name)
                || ix.captured.contains(&i.name)
        });
        removed += before - g.initializers.len();
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
        let st = Dce.run(&mut m).unwrap();
        assert_eq!(st.changes, 3);
        assert_eq!(m.graph.nodes.len(), 2);
        assert!(m.graph.initializers.is_empty());
    }
}
