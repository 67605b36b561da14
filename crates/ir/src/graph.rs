//! Models, graphs, nodes, attributes and value types.
//!
//! Values are named by strings as in ONNX; an empty input name marks an omitted optional input.
//! Executors and passes build index maps over these names once, not per node.

use crate::dtype::DType;
use crate::error::IrError;
use crate::tensor::Tensor;
use std::collections::{HashMap, HashSet};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Fixed(usize),
    Symbolic(String),
    Unknown,
}

impl std::fmt::Display for Dim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Symbolic(s) => f.write_str(s),
            Dim::Unknown => f.write_str("?"),
        }
    }
}

/// The type of a value: a tensor, or a sequence/optional/map of them (ONNX `TypeProto`).
#[derive(Clone, Debug, PartialEq)]
pub enum TypeInfo {
    Tensor {
        dtype: Option<DType>,
        /// `None` when the rank is unknown.
        shape: Option<Vec<Dim>>,
    },
    SparseTensor {
        dtype: Option<DType>,
        shape: Option<Vec<Dim>>,
    },
    Sequence(Option<Box<TypeInfo>>),
    Optional(Option<Box<TypeInfo>>),
    Map {
        key: Option<DType>,
        value: Option<Box<TypeInfo>>,
    },
}

impl TypeInfo {
    /// Bytes of a tensor of this type when its dtype and every dimension are known (saturating,
    /// so a hostile shape cannot wrap): what memory checks compare against a budget.
    pub fn fixed_bytes(&self) -> Option<u128> {
        let TypeInfo::Tensor {
            dtype: Some(dt),
            shape: Some(dims),
        } = self
        else {
            return None;
        };
        dims.iter()
            .try_fold(dt.size().max(1) as u128, |b, d| match d {
                Dim::Fixed(n) => Some(b.saturating_mul(*n as u128)),
                _ => None,
            })
    }

    pub fn tensor(dtype: DType, shape: &[usize]) -> TypeInfo {
        TypeInfo::Tensor {
            dtype: Some(dtype),
            shape: Some(shape.iter().map(|&d| Dim::Fixed(d)).collect()),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            TypeInfo::Tensor { dtype, shape } | TypeInfo::SparseTensor { dtype, shape } => {
                let d = dtype.map(|d| d.name().to_string()).unwrap_or("?".into());
                match shape {
                    Some(s) => format!(
                        "{d}[{}]",
                        s.iter()
                            .map(|d| d.to_string())
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                    None => format!("{d}[*]"),
                }
            }
            TypeInfo::Sequence(t) => format!(
                "seq<{}>",
                t.as_ref().map(|t| t.describe()).unwrap_or("?".into())
            ),
            TypeInfo::Optional(t) => format!(
                "optional<{}>",
                t.as_ref().map(|t| t.describe()).unwrap_or("?".into())
            ),
            TypeInfo::Map { key, value } => format!(
                "map<{},{}>",
                key.map(|d| d.name()).unwrap_or("?"),
                value.as_ref().map(|t| t.describe()).unwrap_or("?".into())
            ),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ValueInfo {
    pub name: String,
    pub ty: Option<TypeInfo>,
    pub doc: String,
}

impl ValueInfo {
    pub fn new(name: impl Into<String>, ty: Option<TypeInfo>) -> ValueInfo {
        ValueInfo {
            name: name.into(),
            ty,
            doc: String::new(),
        }
    }
    pub fn dtype(&self) -> Option<DType> {
        match &self.ty {
            Some(TypeInfo::Tensor { dtype, .. }) => *dtype,
            _ => None,
        }
    }
    pub fn dims(&self) -> Option<&[Dim]> {
        match &self.ty {
            Some(TypeInfo::Tensor { shape: Some(s), .. }) => Some(s),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Float(f32),
    Int(i64),
    String(String),
    Tensor(Tensor),
    Graph(Box<Graph>),
    SparseTensor(Tensor),
    Type(TypeInfo),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
    Strings(Vec<String>),
    Tensors(Vec<Tensor>),
    Graphs(Vec<Graph>),
    SparseTensors(Vec<Tensor>),
    Types(Vec<TypeInfo>),
    /// Inside a function body: takes the value of the calling node's attribute of this name.
    Ref(String),
}

impl Attr {
    pub fn kind(&self) -> &'static str {
        match self {
            Attr::Float(_) => "float",
            Attr::Int(_) => "int",
            Attr::String(_) => "string",
            Attr::Tensor(_) => "tensor",
            Attr::Graph(_) => "graph",
            Attr::SparseTensor(_) => "sparse_tensor",
            Attr::Type(_) => "type",
            Attr::Floats(_) => "floats",
            Attr::Ints(_) => "ints",
            Attr::Strings(_) => "strings",
            Attr::Tensors(_) => "tensors",
            Attr::Graphs(_) => "graphs",
            Attr::SparseTensors(_) => "sparse_tensors",
            Attr::Types(_) => "types",
            Attr::Ref(_) => "ref",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub name: String,
    pub op_type: String,
    /// "" for the default ONNX domain ("ai.onnx" is normalised to "").
    pub domain: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    pub attrs: Vec<(String, Attr)>,
    pub doc: String,
}

impl Node {
    pub fn new(op_type: &str, inputs: &[&str], outputs: &[&str]) -> Node {
        Node {
            name: String::new(),
            op_type: op_type.into(),
            domain: String::new(),
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            outputs: outputs.iter().map(|s| s.to_string()).collect(),
            attrs: vec![],
            doc: String::new(),
        }
    }

    pub fn with_attr(mut self, name: &str, a: Attr) -> Node {
        self.attrs.push((name.into(), a));
        self
    }

    /// A name for messages: the node's name, or its op and first output when unnamed.
    pub fn display_name(&self) -> String {
        if self.name.is_empty() {
            format!(
                "{}->{}",
                self.op_type,
                self.outputs.first().map(|s| s.as_str()).unwrap_or("")
            )
        } else {
            self.name.clone()
        }
    }

    pub fn error(&self, msg: impl Into<String>) -> IrError {
        IrError::Node {
            node: self.display_name(),
            op: self.op_type.clone(),
            msg: msg.into(),
        }
    }

    pub fn attr(&self, name: &str) -> Option<&Attr> {
        self.attrs.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }

    fn typed<'a, T>(
        &'a self,
        name: &str,
        want: &str,
        f: impl Fn(&'a Attr) -> Option<T>,
    ) -> Result<Option<T>, IrError> {
        match self.attr(name) {
            None => Ok(None),
            Some(a) => f(a).map(Some).ok_or_else(|| {
                self.error(format!(
                    "attribute '{name}' should be {want}, found {}",
                    a.kind()
                ))
            }),
        }
    }

    pub fn attr_int(&self, name: &str) -> Result<Option<i64>, IrError> {
        self.typed(name, "int", |a| match a {
            Attr::Int(i) => Some(*i),
            _ => None,
        })
    }
    pub fn attr_float(&self, name: &str) -> Result<Option<f32>, IrError> {
        self.typed(name, "float", |a| match a {
            Attr::Float(f) => Some(*f),
            Attr::Int(i) => Some(*i as f32),
            _ => None,
        })
    }
    pub fn attr_str(&self, name: &str) -> Result<Option<&str>, IrError> {
        self.typed(name, "string", |a| match a {
            Attr::String(s) => Some(s.as_str()),
            _ => None,
        })
    }
    pub fn attr_ints(&self, name: &str) -> Result<Option<&[i64]>, IrError> {
        self.typed(name, "ints", |a| match a {
            Attr::Ints(v) => Some(v.as_slice()),
            _ => None,
        })
    }
    pub fn attr_floats(&self, name: &str) -> Result<Option<&[f32]>, IrError> {
        self.typed(name, "floats", |a| match a {
            Attr::Floats(v) => Some(v.as_slice()),
            _ => None,
        })
    }
    pub fn attr_strings(&self, name: &str) -> Result<Option<&[String]>, IrError> {
        self.typed(name, "strings", |a| match a {
            Attr::Strings(v) => Some(v.as_slice()),
            _ => None,
        })
    }
    pub fn attr_tensor(&self, name: &str) -> Result<Option<&Tensor>, IrError> {
        self.typed(name, "tensor", |a| match a {
            Attr::Tensor(t) | Attr::SparseTensor(t) => Some(t),
            _ => None,
        })
    }
    pub fn attr_graph(&self, name: &str) -> Result<Option<&Graph>, IrError> {
        self.typed(name, "graph", |a| match a {
            Attr::Graph(g) => Some(&**g),
            _ => None,
        })
    }

    /// Int attribute with a default.
    pub fn int_or(&self, name: &str, default: i64) -> Result<i64, IrError> {
        Ok(self.attr_int(name)?.unwrap_or(default))
    }
    pub fn float_or(&self, name: &str, default: f32) -> Result<f32, IrError> {
        Ok(self.attr_float(name)?.unwrap_or(default))
    }
    pub fn str_or<'a>(&'a self, name: &str, default: &'a str) -> Result<&'a str, IrError> {
        Ok(self.attr_str(name)?.unwrap_or(default))
    }
    /// Required int attribute.
    pub fn int_req(&self, name: &str) -> Result<i64, IrError> {
        self.attr_int(name)?
            .ok_or_else(|| self.error(format!("required attribute '{name}' is missing")))
    }
    pub fn ints_req(&self, name: &str) -> Result<&[i64], IrError> {
        self.attr_ints(name)?
            .ok_or_else(|| self.error(format!("required attribute '{name}' is missing")))
    }

    /// The input at `i`, or `None` when absent or given as "" (omitted optional input).
    pub fn input(&self, i: usize) -> Option<&str> {
        self.inputs
            .get(i)
            .map(|s| s.as_str())
            .filter(|s| !s.is_empty())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Initializer {
    pub name: String,
    pub tensor: Tensor,
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    pub inputs: Vec<ValueInfo>,
    pub outputs: Vec<ValueInfo>,
    pub initializers: Vec<Initializer>,
    /// Declared types of intermediate values (informational: never trusted for execution).
    pub value_info: Vec<ValueInfo>,
    pub doc: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpsetImport {
    pub domain: String,
    pub version: i64,
}

/// A model-local function (ONNX `FunctionProto`): expanded at the call site.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    pub name: String,
    pub domain: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    pub attributes: Vec<String>,
    pub attribute_defaults: Vec<(String, Attr)>,
    pub nodes: Vec<Node>,
    pub opset_imports: Vec<OpsetImport>,
    pub doc: String,
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Model {
    pub ir_version: i64,
    pub opset_imports: Vec<OpsetImport>,
    pub producer_name: String,
    pub producer_version: String,
    pub domain: String,
    pub model_version: i64,
    pub doc: String,
    pub graph: Graph,
    pub metadata: Vec<(String, String)>,
    pub functions: Vec<Function>,
}

impl Model {
    /// Opset version imported for a domain ("" and "ai.onnx" are the same domain).
    pub fn opset(&self, domain: &str) -> Option<i64> {
        let d = normalize_domain(domain);
        self.opset_imports
            .iter()
            .find(|o| normalize_domain(&o.domain) == d)
            .map(|o| o.version)
    }

    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

pub fn normalize_domain(d: &str) -> &str {
    if d == "ai.onnx" {
        ""
    } else {
        d
    }
}

impl Graph {
    pub fn initializer(&self, name: &str) -> Option<&Tensor> {
        self.initializers
            .iter()
            .find(|i| i.name == name)
            .map(|i| &i.tensor)
    }

    /// Moves every owned initializer behind a reference count ([`crate::Tensor::into_shared`]),
    /// so that cloning the graph or building a session over it does not copy the weights.
    pub fn share_initializers(&mut self) {
        for i in &mut self.initializers {
            let t = std::mem::replace(&mut i.tensor, crate::Tensor::scalar(0u8));
            i.tensor = t.into_shared();
        }
    }

    /// The names of the graph's initializers.
    pub fn initializer_names(&self) -> HashSet<&str> {
        self.initializers.iter().map(|i| i.name.as_str()).collect()
    }

    /// Graph inputs that are not also initializers (ONNX IR < 4 lists initializers as inputs too).
    pub fn real_inputs(&self) -> Vec<&ValueInfo> {
        let inits = self.initializer_names();
        self.inputs
            .iter()
            .filter(|i| !inits.contains(i.name.as_str()))
            .collect()
    }

    fn err(&self, msg: impl Into<String>) -> IrError {
        IrError::Graph {
            graph: self.name.clone(),
            msg: msg.into(),
        }
    }

    /// Node indices in an order where every node runs after the producers of its inputs.
    /// `outer` names values visible from an enclosing graph (for subgraphs).
    pub fn topo_order(&self, outer: &HashSet<String>) -> Result<Vec<usize>, IrError> {
        let mut producer: HashMap<&str, usize> = HashMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            for o in n.outputs.iter().filter(|o| !o.is_empty()) {
                if producer.insert(o.as_str(), i).is_some() {
                    return Err(n.error(format!("output '{o}' is produced by more than one node")));
                }
            }
        }
        let mut available: HashSet<&str> = self.inputs.iter().map(|v| v.name.as_str()).collect();
        available.extend(self.initializers.iter().map(|i| i.name.as_str()));
        // Inputs that come from nodes: count them; others must be available already.
        let mut pending = vec![0usize; self.nodes.len()];
        let mut users: Vec<Vec<usize>> = vec![vec![]; self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            let mut deps: Vec<&str> = n
                .inputs
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| s.as_str())
                .collect();
            for (_, a) in &n.attrs {
                for g in subgraphs(a) {
                    deps.extend(g.free_names_vec());
                }
            }
            deps.sort();
            deps.dedup();
            for name in deps {
                if available.contains(name) {
                    continue;
                }
                match producer.get(name) {
                    Some(&p) => {
                        pending[i] += 1;
                        users[p].push(i);
                    }
                    None => {
                        if !outer.contains(name) {
                            return Err(n.error(format!(
                                "input '{name}' is not a graph input, an initializer or any node's output"
                            )));
                        }
                    }
                }
            }
        }
        // Kahn's algorithm, preferring file order.
        let mut ready: std::collections::BTreeSet<usize> =
            (0..self.nodes.len()).filter(|&i| pending[i] == 0).collect();
        let mut order = Vec::with_capacity(self.nodes.len());
        while let Some(&i) = ready.iter().next() {
            ready.remove(&i);
            order.push(i);
            for &u in &users[i] {
                pending[u] -= 1;
                if pending[u] == 0 {
                    ready.insert(u);
                }
            }
        }
        if order.len() != self.nodes.len() {
            let stuck: Vec<String> = (0..self.nodes.len())
                .filter(|&i| pending[i] > 0)
                .take(5)
                .map(|i| format!("'{}'", self.nodes[i].display_name()))
                .collect();
            return Err(self.err(format!(
                "the graph has a cycle through nodes {}",
                stuck.join(", ")
            )));
        }
        Ok(order)
    }

    /// Names a graph reads that it does not define itself (outer-scope captures of a subgraph).
    pub fn free_names_vec(&self) -> Vec<&str> {
        let mut defined: HashSet<&str> = self.inputs.iter().map(|v| v.name.as_str()).collect();
        defined.extend(self.initializers.iter().map(|i| i.name.as_str()));
        for n in &self.nodes {
            defined.extend(n.outputs.iter().map(|s| s.as_str()));
        }
        let mut free = vec![];
        for n in &self.nodes {
            for i in n.inputs.iter().filter(|s| !s.is_empty()) {
                if !defined.contains(i.as_str()) {
                    free.push(i.as_str());
                }
            }
            for (_, a) in &n.attrs {
                for g in subgraphs(a) {
                    for f in g.free_names_vec() {
                        if !defined.contains(f) {
                            free.push(f);
                        }
                    }
                }
            }
        }
        for o in &self.outputs {
            if !defined.contains(o.name.as_str()) {
                free.push(o.name.as_str());
            }
        }
        free.sort();
        free.dedup();
        free
    }

    /// Checks structure: unique producers, defined inputs, acyclicity, defined outputs, and the
    /// same for every subgraph. Reports all problems found, each naming its node.
    pub fn verify(&self, outer: &HashSet<String>) -> Vec<IrError> {
        let mut errs = vec![];
        let mut names: HashSet<String> = outer.clone();
        names.extend(self.inputs.iter().map(|v| v.name.clone()));
        names.extend(self.initializers.iter().map(|i| i.name.clone()));
        for n in &self.nodes {
            if n.op_type.is_empty() {
                errs.push(n.error("node has no op_type"));
            }
            names.extend(n.outputs.iter().filter(|o| !o.is_empty()).cloned());
        }
        if let Err(e) = self.topo_order(outer) {
            errs.push(e);
        }
        for o in &self.outputs {
            if !names.contains(&o.name) {
                errs.push(self.err(format!("graph output '{}' is never produced", o.name)));
            }
        }
        for n in &self.nodes {
            for (_, a) in &n.attrs {
                for g in subgraphs(a) {
                    errs.extend(g.verify(&names));
                }
            }
        }
        errs
    }
}

/// The graphs held by an attribute (If branches, Loop/Scan bodies).
pub fn subgraphs(a: &Attr) -> Vec<&Graph> {
    match a {
        Attr::Graph(g) => vec![&**g],
        Attr::Graphs(gs) => gs.iter().collect(),
        _ => vec![],
    }
}

/// Parses `1x3x224x224` (or `1,3,224,224`) into dims.
pub fn parse_shape(s: &str) -> Result<Vec<usize>, String> {
    if s.is_empty() {
        return Ok(vec![]);
    }
    s.split(['x', ','])
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .map_err(|_| format!("'{d}' in shape '{s}' is not a non-negative integer"))
        })
        .collect()
}
