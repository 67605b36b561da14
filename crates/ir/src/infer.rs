//! Static dtype and shape inference.
//!
//! Exported models often declare wrong or missing output shapes, so npuc computes them itself:
//! [`infer_graph`] walks a graph in topological order and derives the [`TypeInfo`] of every
//! value from its producer's semantics. Small integer tensors (shape vectors, axes, scalars) are
//! propagated as [`Known`] values so that `Shape -> Gather -> Concat -> Reshape` chains resolve
//! to fixed dims. Symbolic dims flow through where the semantics allow; anything that cannot be
//! derived stays [`Dim::Unknown`] — inference never guesses.
//!
//! Problems (a MatMul whose inner dims disagree, an out-of-range axis) are collected, each
//! naming its node; inference never panics and carries on with unknown types after a problem.
//! Ops without a rule are listed in [`InferResult::not_inferred`]; their outputs are unknown.

mod contrib;
mod control;
mod ctx;
mod nn;
mod ops;
mod util;
pub mod value;

pub use ctx::{NodeIn, R};

/// Shape helpers for the inference rules of op definitions ([`crate::opdef`]).
pub mod rules {
    pub use super::ops::matmul_dims;
    pub use super::util::{axis, bcast, dim_div_exact, dim_mul, dim_prod, tt};
}
pub use value::{Known, Scalar};

use crate::graph::{Dim, Function, Graph, Model, Node, OpsetImport, TypeInfo};
use crate::tensor::Tensor;
use crate::IrError;
use std::collections::{HashMap, HashSet};

/// What inference found out about a graph.
#[derive(Clone, Debug, Default)]
pub struct InferResult {
    /// The inferred type of every value of the graph: its inputs, initializers and every node
    /// output (values of subgraphs are not included).
    pub types: HashMap<String, TypeInfo>,
    /// Values known statically (constants and folded shape computations), excluding
    /// initializers, which the graph already holds.
    pub values: HashMap<String, Known>,
    /// Malformed nodes, each error naming its node and op.
    pub problems: Vec<IrError>,
    /// Nodes whose op has no inference rule (their outputs are unknown). Not an error.
    pub not_inferred: Vec<NotInferred>,
}

/// A node whose op inference does not cover.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotInferred {
    pub node: String,
    pub op: String,
    pub domain: String,
}

impl InferResult {
    /// The inferred type of a value.
    pub fn type_of(&self, name: &str) -> Option<&TypeInfo> {
        self.types.get(name)
    }

    /// True when the type is a tensor with a known dtype and only fixed dims.
    pub fn is_complete(ty: &TypeInfo) -> bool {
        match ty {
            TypeInfo::Tensor {
                dtype: Some(_),
                shape: Some(s),
            } => s.iter().all(|d| matches!(d, Dim::Fixed(_))),
            _ => false,
        }
    }
}

/// Infers every value of `g`. `opsets` are the model's opset imports (a domain missing from it
/// is taken at the newest version inference knows); `input_types` overrides the declared types
/// of graph inputs (bind them to concrete shapes to get concrete outputs).
pub fn infer_graph(
    g: &Graph,
    opsets: &[OpsetImport],
    input_types: &HashMap<String, TypeInfo>,
) -> InferResult {
    let cx = Cx::new(opsets, &[]);
    infer_top(&cx, g, input_types)
}

/// [`infer_graph`] on a model's main graph, with its opset imports and model-local functions
/// (a call to a local function is inferred through the function body).
pub fn infer_model(m: &Model, input_types: &HashMap<String, TypeInfo>) -> InferResult {
    let cx = Cx::new(&m.opset_imports, &m.functions);
    infer_top(&cx, &m.graph, input_types)
}

fn infer_top(cx: &Cx, g: &Graph, input_types: &HashMap<String, TypeInfo>) -> InferResult {
    let mut report = Report::default();
    let bind: Vec<Binding> = g
        .inputs
        .iter()
        .map(|vi| Binding {
            name: vi.name.clone(),
            ty: input_types
                .get(&vi.name)
                .cloned()
                .or_else(|| vi.ty.clone())
                .unwrap_or_else(unknown),
            val: None,
        })
        .collect();
    let scope = run_graph(cx, g, None, bind, &mut report, 0);
    let mut types = scope.types;
    for init in &g.initializers {
        types
            .entry(init.name.clone())
            .or_insert_with(|| tensor_type(&init.tensor));
    }
    InferResult {
        types,
        values: scope.values,
        problems: report.problems,
        not_inferred: report.not_inferred,
    }
}

/// The output types of `n` under the ONNX default-domain rule of [`NodeIn::op`]: how an op
/// definition whose shapes follow an ONNX op's infers (see [`NodeIn::as_onnx`]).
pub fn onnx_rule(n: &NodeIn) -> R<Vec<TypeInfo>> {
    match ops::default_domain(n) {
        Some(r) => r.map(|outs| outs.into_iter().map(|o| o.ty).collect()),
        None => Err(format!("no ONNX inference rule for {}", n.op())),
    }
}

/// The output types of one node whose inputs are the given tensors (their types, and the values
/// of small ones, as the rules read shapes, pads, scales or depths from them): what a runtime
/// checks before it runs a node, e.g. how much memory the outputs will take. `None` when no rule
/// here covers the op (control flow, model-local functions, ops without a rule).
pub fn node_output_types(
    node: &Node,
    opset: i64,
    inputs: &[Option<&Tensor>],
) -> Option<R<Vec<TypeInfo>>> {
    if node.domain.is_empty() && matches!(node.op_type.as_str(), "If" | "Loop" | "Scan") {
        return None;
    }
    /// Inputs up to this many elements also give their values (shape-like operands).
    const VALUE_MAX: usize = 64;
    let tys = inputs.iter().map(|t| t.map(tensor_type)).collect();
    let vals = inputs
        .iter()
        .map(|t| {
            t.filter(|t| t.len() <= VALUE_MAX)
                .and_then(Known::from_tensor)
        })
        .collect();
    let ni = ctx::NodeIn::from_parts(node, opset, tys, vals);
    match ops::infer(&ni) {
        Outcome::Done(outs) => Some(Ok(outs.into_iter().map(|o| o.ty).collect())),
        Outcome::Failed(e) => Some(Err(e)),
        Outcome::NotCovered => None,
    }
}

/// The fully unknown type.
pub(crate) fn unknown() -> TypeInfo {
    TypeInfo::Tensor {
        dtype: None,
        shape: None,
    }
}

pub(crate) fn tensor_type(t: &Tensor) -> TypeInfo {
    TypeInfo::tensor(t.dtype(), t.shape())
}

/// Settings shared by a whole inference run.
pub(crate) struct Cx<'m> {
    opsets: HashMap<String, i64>,
    functions: &'m [Function],
}

/// The opset assumed for a domain the model does not import (the newest inference knows).
const DEFAULT_OPSET: i64 = 25;

impl<'m> Cx<'m> {
    fn new(opsets: &[OpsetImport], functions: &'m [Function]) -> Cx<'m> {
        Cx {
            opsets: opsets
                .iter()
                .map(|o| {
                    (
                        crate::graph::normalize_domain(&o.domain).to_string(),
                        o.version,
                    )
                })
                .collect(),
            functions,
        }
    }

    fn opset(&self, domain: &str) -> i64 {
        self.opsets
            .get(crate::graph::normalize_domain(domain))
            .copied()
            .unwrap_or(DEFAULT_OPSET)
    }

    fn function(&self, n: &Node) -> Option<&'m Function> {
        self.functions
            .iter()
            .find(|f| f.name == n.op_type && f.domain == n.domain)
    }
}

#[derive(Default)]
pub(crate) struct Report {
    problems: Vec<IrError>,
    not_inferred: Vec<NotInferred>,
}

/// A value bound at a graph's entry (a graph input, a function parameter, a loop variable).
pub(crate) struct Binding {
    name: String,
    ty: TypeInfo,
    val: Option<Known>,
}

/// Types and values visible while inferring one graph; subgraphs see their parents' scopes.
pub(crate) struct Scope<'a> {
    types: HashMap<String, TypeInfo>,
    values: HashMap<String, Known>,
    inits: HashMap<&'a str, &'a Tensor>,
    parent: Option<&'a Scope<'a>>,
}

impl<'a> Scope<'a> {
    pub(crate) fn ty(&self, name: &str) -> Option<TypeInfo> {
        if let Some(t) = self.types.get(name) {
            return Some(t.clone());
        }
        if let Some(t) = self.inits.get(name) {
            return Some(tensor_type(t));
        }
        self.parent.and_then(|p| p.ty(name))
    }

    pub(crate) fn val(&self, name: &str) -> Option<Known> {
        if let Some(v) = self.values.get(name) {
            return Some(v.clone());
        }
        // A local definition without a known value shadows the parent's.
        if self.types.contains_key(name) {
            return None;
        }
        if let Some(t) = self.inits.get(name) {
            return Known::from_tensor(t);
        }
        self.parent.and_then(|p| p.val(name))
    }

    fn names(&self, out: &mut HashSet<String>) {
        out.extend(self.types.keys().cloned());
        out.extend(self.inits.keys().map(|s| s.to_string()));
        if let Some(p) = self.parent {
            p.names(out);
        }
    }
}

/// One output of a node: its type and, when computable, its value.
pub(crate) struct Out {
    pub ty: TypeInfo,
    pub val: Option<Known>,
}

impl Out {
    pub fn ty(ty: TypeInfo) -> Out {
        Out { ty, val: None }
    }
    /// An output with a known value; its type follows from the value.
    pub fn known(k: Known) -> Out {
        Out {
            ty: TypeInfo::tensor(k.dtype, &k.shape),
            val: Some(k),
        }
    }
}

/// How a node's inference ended.
pub(crate) enum Outcome {
    Done(Vec<Out>),
    Failed(String),
    NotCovered,
}

/// Nesting limit for subgraphs and function calls, so that a self-recursive function or a
/// pathologically deep model cannot exhaust the stack.
const MAX_DEPTH: usize = 32;

pub(crate) fn run_graph<'a>(
    cx: &Cx,
    g: &'a Graph,
    parent: Option<&'a Scope<'a>>,
    bind: Vec<Binding>,
    report: &mut Report,
    depth: usize,
) -> Scope<'a> {
    let mut scope = Scope {
        types: HashMap::new(),
        values: HashMap::new(),
        inits: g
            .initializers
            .iter()
            .map(|i| (i.name.as_str(), &i.tensor))
            .collect(),
        parent,
    };
    for b in bind {
        // An initializer listed as an input (IR < 4) keeps its value unless a binding overrides.
        if let Some(v) = b.val {
            scope.values.insert(b.name.clone(), v);
        }
        if scope.inits.contains_key(b.name.as_str()) && !scope.values.contains_key(&b.name) {
            continue;
        }
        scope.types.insert(b.name, b.ty);
    }
    let mut outer = HashSet::new();
    if let Some(p) = parent {
        p.names(&mut outer);
    }
    let order = match g.topo_order(&outer) {
        Ok(o) => o,
        Err(e) => {
            report.problems.push(e);
            (0..g.nodes.len()).collect()
        }
    };
    for idx in order {
        let n = &g.nodes[idx];
        let outcome = if depth >= MAX_DEPTH {
            Outcome::Failed("subgraphs or function calls are nested too deeply".into())
        } else {
            infer_node(cx, n, &scope, report, depth)
        };
        let outs = match outcome {
            Outcome::Done(o) => o,
            Outcome::Failed(msg) => {
                report.problems.push(n.error(msg));
                vec![]
            }
            Outcome::NotCovered => {
                report.not_inferred.push(NotInferred {
                    node: n.display_name(),
                    op: n.op_type.clone(),
                    domain: n.domain.clone(),
                });
                vec![]
            }
        };
        let mut outs = outs.into_iter();
        for name in &n.outputs {
            let o = outs.next();
            if name.is_empty() {
                continue;
            }
            match o {
                Some(Out { ty, val }) => {
                    if let Some(v) = val {
                        scope.values.insert(name.clone(), v);
                    } else {
                        scope.values.remove(name);
                    }
                    scope.types.insert(name.clone(), ty);
                }
                None => {
                    scope.values.remove(name);
                    scope.types.insert(name.clone(), unknown());
                }
            }
        }
    }
    scope
}

fn infer_node(cx: &Cx, n: &Node, scope: &Scope, report: &mut Report, depth: usize) -> Outcome {
    let opset = cx.opset(&n.domain);
    if n.domain.is_empty() {
        match n.op_type.as_str() {
            "If" => return control::infer_if(cx, n, scope, report, depth),
            "Loop" => return control::infer_loop(cx, n, scope, report, depth),
            "Scan" => return control::infer_scan(cx, n, scope, report, depth, opset),
            _ => {}
        }
    }
    if let Some(f) = cx.function(n) {
        return control::infer_function(cx, n, f, scope, report, depth);
    }
    let ni = ctx::NodeIn::new(n, scope, opset);
    ops::infer(&ni)
}

#[cfg(test)]
mod tests;
