//! [`GraphPatch`]: the one way passes edit a graph.
//!
//! A pass reads the model, plans its rewrite as a patch (nodes replaced, inserted or removed,
//! reads renamed, initializers added or removed, opset imports) and hands the patch to its
//! [`Rewriter`], which applies it. Indices in a patch always refer to the node list the patch
//! was planned against, so a pass never has to track how earlier edits shifted positions.
//! A pass whose next step depends on the result of the previous one (identity elimination,
//! the quantized lowerings) applies several patches in turn.

use crate::util::{fresh_name, Index};
use npuc_ir::{Graph, Initializer, Model, Node, OpsetImport, Tensor};
use std::collections::{HashMap, HashSet};

/// A planned rewrite of a model's main graph; see the module documentation.
#[derive(Clone, Debug, Default)]
pub struct GraphPatch {
    /// (index, node taking its place), applied in order.
    replace: Vec<(usize, Node)>,
    /// Nodes placed right before / after the node at an index (even a removed one), in the
    /// order they were added.
    before: HashMap<usize, Vec<Node>>,
    after: HashMap<usize, Vec<Node>>,
    remove: HashSet<usize>,
    /// (index, old output name, new output name; "" drops the output).
    outputs: Vec<(usize, String, String)>,
    /// Reads of the first name become reads of the second (chains are followed).
    renames: Vec<(String, String)>,
    add_inits: Vec<Initializer>,
    remove_inits: HashSet<String>,
    imports: Vec<&'static str>,
    /// A new order of the planned-against node indices (a permutation).
    order: Option<Vec<usize>>,
}

impl GraphPatch {
    pub fn new() -> GraphPatch {
        GraphPatch::default()
    }

    /// True when applying the patch would change nothing.
    pub fn is_empty(&self) -> bool {
        self.replace.is_empty()
            && self.before.is_empty()
            && self.after.is_empty()
            && self.remove.is_empty()
            && self.outputs.is_empty()
            && self.renames.is_empty()
            && self.add_inits.is_empty()
            && self.remove_inits.is_empty()
            && self.imports.is_empty()
            && self.order.is_none()
    }

    /// Puts `node` in place of the node at `index`.
    pub fn replace(&mut self, index: usize, node: Node) {
        self.replace.push((index, node));
    }

    /// Removes the node at `index`.
    pub fn remove(&mut self, index: usize) {
        self.remove.insert(index);
    }

    /// How many nodes the patch removes.
    pub fn removed(&self) -> usize {
        self.remove.len()
    }

    /// Whether the node at `index` is already replaced or removed by this patch.
    pub fn claimed(&self, index: usize) -> bool {
        self.remove.contains(&index) || self.replace.iter().any(|(i, _)| *i == index)
    }

    /// A fusion: `node` takes the place of the node at `at` and the `absorbed` nodes go away.
    /// Refused (returns false, changes nothing) when any of them is already claimed by an
    /// earlier edit of this patch, so overlapping matches never both apply.
    pub fn fuse(&mut self, at: usize, node: Node, absorbed: &[usize]) -> bool {
        if self.claimed(at) || absorbed.iter().any(|&k| self.claimed(k)) {
            return false;
        }
        self.replace(at, node);
        self.remove
            .extend(absorbed.iter().copied().filter(|&k| k != at));
        true
    }

    /// Inserts `node` right before the node at `index`.
    pub fn insert_before(&mut self, index: usize, node: Node) {
        self.before.entry(index).or_default().push(node);
    }

    /// Inserts `node` right after the node at `index`.
    pub fn insert_after(&mut self, index: usize, node: Node) {
        self.after.entry(index).or_default().push(node);
    }

    /// Every read of `old` in the graph's nodes becomes a read of `new` (not in subgraphs:
    /// callers make sure `old` is not captured).
    pub fn rename_reads(&mut self, old: &str, new: &str) {
        self.renames.push((old.to_string(), new.to_string()));
    }

    /// The node at `index` produces `new` where it produced `old` ("" drops the output).
    pub fn rename_output(&mut self, index: usize, old: &str, new: &str) {
        self.outputs.push((index, old.to_string(), new.to_string()));
    }

    /// Makes the value `from` disappear in favour of `to`, where both denote the same tensor.
    /// When `from` is a graph output its name must survive, so instead the producer of `to`
    /// is made to produce `from` (allowed only when `to` is an internal node output); the
    /// producer of `from` stops producing it (callers remove that node).
    /// Returns false (and plans nothing) when neither is possible.
    pub fn merge_value(&mut self, ix: &Index, from: &str, to: &str) -> bool {
        if from == to || ix.captured.contains(from) {
            return false;
        }
        if !ix.graph_outputs.contains(from) {
            self.rename_reads(from, to);
            return true;
        }
        let Some(&p) = ix.producer.get(to) else {
            return false;
        };
        if !ix.is_internal(to) || ix.graph_inputs.contains(to) || ix.inits.contains_key(to) {
            return false;
        }
        if let Some(&fp) = ix.producer.get(from) {
            self.rename_output(fp, from, "");
        }
        self.rename_output(p, to, from);
        self.rename_reads(to, from);
        true
    }

    /// Adds an initializer.
    pub fn add_initializer(&mut self, name: String, tensor: Tensor) {
        self.add_inits.push(Initializer { name, tensor });
    }

    /// Adds an initializer under a fresh name derived from `base` (see [`fresh_name`]) and
    /// returns the name.
    pub fn add_fresh_initializer(
        &mut self,
        g: &Graph,
        taken: &mut HashSet<String>,
        base: &str,
        tensor: Tensor,
    ) -> String {
        let name = fresh_name(g, taken, base);
        self.add_initializer(name.clone(), tensor);
        name
    }

    /// Removes every initializer named `name`.
    pub fn remove_initializer(&mut self, name: &str) {
        self.remove_inits.insert(name.to_string());
    }

    /// Makes sure the model imports `domain` (version 1) when the patch is applied.
    pub fn import_domain(&mut self, domain: &'static str) {
        if !self.imports.contains(&domain) {
            self.imports.push(domain);
        }
    }

    /// Reorders the nodes: `order` lists every node index once, in the new order.
    pub fn reorder(&mut self, order: Vec<usize>) {
        self.order = Some(order);
    }

    /// Applies the patch: replacements, output renames, read renames, then the new node list
    /// (order, insertions, removals), initializers and imports. Only [`Rewriter::apply`]
    /// calls this.
    fn apply(self, m: &mut Model) {
        let g = &mut m.graph;
        for (i, node) in self.replace {
            g.nodes[i] = node;
        }
        for (i, old, new) in self.outputs {
            for o in &mut g.nodes[i].outputs {
                if *o == old {
                    *o = new.clone();
                }
            }
        }
        if !self.renames.is_empty() {
            let map: HashMap<String, String> = self.renames.into_iter().collect();
            let resolved: HashMap<&str, &str> = map
                .iter()
                .map(|(old, new)| {
                    // Follow chains (a -> b -> c); a cycle stops after one lap.
                    let mut to = new.as_str();
                    let mut hops = 0;
                    while let Some(next) = map.get(to) {
                        to = next.as_str();
                        hops += 1;
                        if hops > map.len() {
                            break;
                        }
                    }
                    (old.as_str(), to)
                })
                .collect();
            for n in &mut g.nodes {
                for i in &mut n.inputs {
                    if let Some(to) = resolved.get(i.as_str()) {
                        *i = to.to_string();
                    }
                }
            }
        }
        let relist = self.order.is_some()
            || !self.remove.is_empty()
            || !self.before.is_empty()
            || !self.after.is_empty();
        if relist {
            let (mut before, mut after) = (self.before, self.after);
            let order = self.order.unwrap_or_else(|| (0..g.nodes.len()).collect());
            let mut slots: Vec<Option<Node>> =
                std::mem::take(&mut g.nodes).into_iter().map(Some).collect();
            for i in order {
                g.nodes.extend(before.remove(&i).unwrap_or_default());
                if let Some(n) = slots.get_mut(i).and_then(Option::take) {
                    if !self.remove.contains(&i) {
                        g.nodes.push(n);
                    }
                }
                g.nodes.extend(after.remove(&i).unwrap_or_default());
            }
        }
        if !self.remove_inits.is_empty() {
            g.initializers
                .retain(|i| !self.remove_inits.contains(&i.name));
        }
        g.initializers.extend(self.add_inits);
        for domain in self.imports {
            if m.opset(domain).is_none() {
                m.opset_imports.push(OpsetImport {
                    domain: domain.into(),
                    version: 1,
                });
            }
        }
    }
}

/// What a pass edits through: read access to the model, and [`Rewriter::apply`], the only
/// place a [`GraphPatch`] (and so any pass) changes the model. The pass manager makes one per
/// pass run and checks the model afterwards.
pub struct Rewriter<'m> {
    model: &'m mut Model,
    /// Non-empty patches applied so far.
    applied: usize,
}

impl<'m> Rewriter<'m> {
    pub(crate) fn new(model: &'m mut Model) -> Rewriter<'m> {
        Rewriter { model, applied: 0 }
    }

    /// The model as edited so far.
    pub fn model(&self) -> &Model {
        self.model
    }

    /// Applies `patch` to the model.
    pub fn apply(&mut self, patch: GraphPatch) {
        if !patch.is_empty() {
            self.applied += 1;
            patch.apply(self.model);
        }
    }

    /// Whether any patch changed the model (an unchanged model needs no new check).
    pub fn edited(&self) -> bool {
        self.applied > 0
    }
}

/// Runs a pattern fusion producing `fused_op` over the main graph, when some node is a
/// `guard_op` (the pattern cannot occur otherwise) and the runtime can run `fused_op` at the
/// model's opset (see [`crate::util::runnable_domain`]). `fusion(g, ix, i, domain)` looks for
/// the pattern around node `i` and returns the index the fused node takes, the fused node and
/// the pattern's nodes. Of overlapping matches the first wins. The `npuc` domain is imported
/// when the fused op is emitted in it. Returns the number fused.
pub fn fuse_patterns(
    rw: &mut Rewriter<'_>,
    guard_op: &str,
    fused_op: &str,
    fusion: impl Fn(&Graph, &Index, usize, &'static str) -> Option<(usize, Node, Vec<usize>)>,
) -> usize {
    let m = rw.model();
    if !m
        .graph
        .nodes
        .iter()
        .any(|n| crate::util::is_op(n, guard_op))
    {
        return 0;
    }
    let Some(domain) = crate::util::runnable_domain(m, fused_op) else {
        return 0;
    };
    let g = &m.graph;
    let ix = Index::new(g);
    let mut patch = GraphPatch::new();
    let mut fused = 0;
    for i in 0..g.nodes.len() {
        if let Some((at, node, nodes)) = fusion(g, &ix, i, domain) {
            if patch.fuse(at, node, &nodes) {
                fused += 1;
            }
        }
    }
    if fused > 0 && domain == "npuc" {
        patch.import_domain("npuc");
    }
    rw.apply(patch);
    fused
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::model;

    fn names(m: &Model) -> Vec<String> {
        m.graph
            .nodes
            .iter()
            .map(|n| format!("{}:{}", n.op_type, n.inputs.join(",")))
            .collect()
    }

    #[test]
    fn edits_refer_to_the_planned_positions() {
        let mut m = model(
            vec![
                Node::new("Relu", &["x"], &["a"]),
                Node::new("Identity", &["a"], &["b"]),
                Node::new("Neg", &["b"], &["c"]),
                Node::new("Abs", &["c"], &["y"]),
            ],
            &[("x", &[2])],
            &["y"],
        );
        let mut p = GraphPatch::new();
        assert!(p.fuse(2, Node::new("Sigmoid", &["b"], &["c"]), &[2]));
        assert!(
            !p.fuse(3, Node::new("Tanh", &["c"], &["y"]), &[2]),
            "2 is claimed"
        );
        p.remove(1);
        p.rename_reads("b", "a");
        p.insert_before(0, Node::new("Exp", &["x"], &["e"]));
        p.insert_after(1, Node::new("Log", &["e"], &["l"]));
        p.import_domain("npuc");
        Rewriter::new(&mut m).apply(p);
        assert_eq!(
            names(&m),
            ["Exp:x", "Relu:x", "Log:e", "Sigmoid:a", "Abs:c"]
        );
        assert_eq!(m.opset("npuc"), Some(1));
    }

    #[test]
    fn renames_follow_chains_and_reorder_permutes() {
        let mut m = model(
            vec![
                Node::new("Neg", &["c"], &["y"]),
                Node::new("Relu", &["x"], &["a"]),
            ],
            &[("x", &[2])],
            &["y"],
        );
        let mut p = GraphPatch::new();
        p.rename_reads("c", "b");
        p.rename_reads("b", "a");
        p.reorder(vec![1, 0]);
        Rewriter::new(&mut m).apply(p);
        assert_eq!(names(&m), ["Relu:x", "Neg:a"]);
    }
}
