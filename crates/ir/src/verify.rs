//! The full model check run between optimizer passes.
//!
//! [`Graph::verify`] checks what every graph must satisfy to be executed at all (unique
//! producers, defined inputs, no cycles, defined outputs, recursively through subgraphs).
//! [`verify_model`] adds what a rewrite must preserve on top of that:
//! - every name is defined once: no node output is also a graph input or an initializer, and
//!   no initializer or graph input is listed twice;
//! - the node list is in topological order (each node after the producers of what it reads,
//!   subgraph captures included), as ONNX requires of a stored graph;
//! - types agree: an initializer has the dtype its graph-input declaration gives, and a value
//!   whose dtype the graph declares (graph outputs, `value_info`) has that dtype where
//!   [`crate::infer`] can derive it;
//! - every node meets its op's contract, as far as the caller's [`OpContracts`] knows it.

use crate::dtype::DType;
use crate::graph::{subgraphs, Graph, Model, Node, TypeInfo};
use crate::infer::{infer_model, InferResult};
use crate::IrError;
use std::collections::{HashMap, HashSet};

/// Per-op input/attribute contracts (typically from an op registry): the hook through which
/// [`verify_model`] checks each node beyond graph structure.
pub trait OpContracts {
    /// Checks `node` against its op's contract; `types` holds the inferred type of every value
    /// inference could derive. `Err` describes the violation (the verifier names the node).
    fn check(&self, node: &Node, types: &InferResult) -> Result<(), String>;
}

/// No op contracts: only graph-level checks.
pub struct NoContracts;

impl OpContracts for NoContracts {
    fn check(&self, _node: &Node, _types: &InferResult) -> Result<(), String> {
        Ok(())
    }
}

fn tensor_dtype(t: &TypeInfo) -> Option<DType> {
    match t {
        TypeInfo::Tensor { dtype, .. } => *dtype,
        _ => None,
    }
}

/// Checks `m`'s main graph with [`Graph::verify`] and the checks listed in the module
/// documentation. Returns every problem found, each naming its node or value.
pub fn verify_model(m: &Model, contracts: &dyn OpContracts) -> Vec<IrError> {
    let g = &m.graph;
    let mut errs = g.verify(&HashSet::new());
    let structure_ok = errs.is_empty();
    errs.extend(names_defined_once(g));
    if structure_ok {
        // Order is only meaningful once every read is defined and the graph is acyclic.
        errs.extend(list_order(g));
    }
    let types = infer_model(m, &HashMap::new());
    errs.extend(declared_types(g, &types));
    for n in &g.nodes {
        if let Err(msg) = contracts.check(n, &types) {
            errs.push(n.error(msg));
        }
    }
    errs
}

fn graph_err(g: &Graph, msg: String) -> IrError {
    IrError::Graph {
        graph: g.name.clone(),
        msg,
    }
}

/// Node outputs that shadow a graph input or initializer, and names listed twice among the
/// initializers or among the graph inputs. (A graph input that is also an initializer is
/// allowed: ONNX IR < 4 lists initializers as inputs.)
fn names_defined_once(g: &Graph) -> Vec<IrError> {
    let mut errs = vec![];
    let mut inits: HashSet<&str> = HashSet::new();
    for i in &g.initializers {
        if !inits.insert(i.name.as_str()) {
            errs.push(graph_err(
                g,
                format!("initializer '{}' is defined more than once", i.name),
            ));
        }
    }
    let mut inputs: HashSet<&str> = HashSet::new();
    for v in &g.inputs {
        if !inputs.insert(v.name.as_str()) {
            errs.push(graph_err(
                g,
                format!("graph input '{}' is listed more than once", v.name),
            ));
        }
    }
    for n in &g.nodes {
        for o in n.outputs.iter().filter(|o| !o.is_empty()) {
            if inputs.contains(o.as_str()) {
                errs.push(n.error(format!("output '{o}' is also a graph input")));
            } else if inits.contains(o.as_str()) {
                errs.push(n.error(format!("output '{o}' is also an initializer")));
            }
        }
    }
    errs
}

/// Nodes that read a value before (in list order) the node producing it.
fn list_order(g: &Graph) -> Vec<IrError> {
    let producer: HashMap<&str, usize> = g
        .nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| {
            n.outputs
                .iter()
                .filter(|o| !o.is_empty())
                .map(move |o| (o.as_str(), i))
        })
        .collect();
    let mut errs = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        let mut reads: Vec<&str> = n
            .inputs
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| s.as_str())
            .collect();
        for (_, a) in &n.attrs {
            for sg in subgraphs(a) {
                reads.extend(sg.free_names_vec());
            }
        }
        for r in reads {
            if let Some(&p) = producer.get(r) {
                if p > i {
                    errs.push(n.error(format!(
                        "reads '{r}' before node '{}' produces it (the node list is not in topological order)",
                        g.nodes[p].display_name()
                    )));
                }
            }
        }
    }
    errs
}

/// Declared dtypes that disagree with the initializer of the same name or with inference.
fn declared_types(g: &Graph, types: &InferResult) -> Vec<IrError> {
    let mut errs = vec![];
    let inits: HashMap<&str, DType> = g
        .initializers
        .iter()
        .map(|i| (i.name.as_str(), i.tensor.dtype()))
        .collect();
    for v in &g.inputs {
        if let (Some(want), Some(&got)) = (v.dtype(), inits.get(v.name.as_str())) {
            if want != got {
                errs.push(graph_err(
                    g,
                    format!(
                        "initializer '{}' is {got} but the graph input of that name is declared {want}",
                        v.name
                    ),
                ));
            }
        }
    }
    let producer: HashMap<&str, &Node> = g
        .nodes
        .iter()
        .flat_map(|n| {
            n.outputs
                .iter()
                .filter(|o| !o.is_empty())
                .map(move |o| (o.as_str(), n))
        })
        .collect();
    for v in g.outputs.iter().chain(&g.value_info) {
        let Some(want) = v.dtype() else { continue };
        let Some(got) = types.type_of(&v.name).and_then(tensor_dtype) else {
            continue;
        };
        if want != got {
            let msg = format!("value '{}' is declared {want} but computes {got}", v.name);
            errs.push(match producer.get(v.name.as_str()) {
                Some(n) => n.error(msg),
                None => graph_err(g, msg),
            });
        }
    }
    errs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Initializer, OpsetImport, ValueInfo};
    use crate::tensor::Tensor;

    fn model(nodes: Vec<Node>, outputs: Vec<ValueInfo>) -> Model {
        Model {
            opset_imports: vec![OpsetImport {
                domain: String::new(),
                version: 17,
            }],
            graph: Graph {
                name: "g".into(),
                nodes,
                inputs: vec![ValueInfo::new(
                    "x",
                    Some(TypeInfo::tensor(DType::F32, &[2])),
                )],
                outputs,
                initializers: vec![Initializer {
                    name: "w".into(),
                    tensor: Tensor::from_vec(vec![2], vec![1.0f32, 2.0]).unwrap(),
                }],
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn messages(m: &Model) -> Vec<String> {
        verify_model(m, &NoContracts)
            .iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn a_valid_graph_has_no_problems() {
        let m = model(
            vec![
                Node::new("Add", &["x", "w"], &["a"]),
                Node::new("Relu", &["a"], &["y"]),
            ],
            vec![ValueInfo::new(
                "y",
                Some(TypeInfo::tensor(DType::F32, &[2])),
            )],
        );
        assert_eq!(messages(&m), Vec::<String>::new());
    }

    #[test]
    fn reports_order_shadowing_and_types() {
        let m = model(
            vec![
                Node::new("Relu", &["a"], &["y"]),
                Node::new("Add", &["x", "w"], &["a"]),
                Node::new("Neg", &["x"], &["w"]),
            ],
            vec![ValueInfo::new(
                "y",
                Some(TypeInfo::tensor(DType::I64, &[2])),
            )],
        );
        let got = messages(&m);
        // 'w' is produced twice (the initializer and Neg) only by name, so the structure
        // check passes but the shadowing one does not; the order check names Relu.
        assert!(
            got.iter()
                .any(|e| e.contains("Neg") && e.contains("output 'w' is also an initializer")),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|e| e.contains("Relu") && e.contains("reads 'a' before node")),
            "{got:?}"
        );
        assert!(
            got.iter()
                .any(|e| e.contains("value 'y' is declared i64 but computes f32")),
            "{got:?}"
        );
    }

    #[test]
    fn contracts_are_consulted_per_node() {
        struct NoRelu;
        impl OpContracts for NoRelu {
            fn check(&self, node: &Node, _types: &InferResult) -> Result<(), String> {
                if node.op_type == "Relu" {
                    Err("Relu is not allowed here".into())
                } else {
                    Ok(())
                }
            }
        }
        let m = model(vec![Node::new("Relu", &["x"], &["y"])], vec![]);
        let got: Vec<String> = verify_model(&m, &NoRelu)
            .iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(got, ["node 'Relu->y' (Relu): Relu is not allowed here"]);
    }
}
