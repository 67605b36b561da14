//! Graph queries shared by the passes: who produces and who reads each value,
//! which values are constants, and fresh value names. (Edits go through
//! [`crate::GraphPatch`].)

use npuc_ir::{subgraphs, Attr, DType, Graph, Model, Node, Tensor};
use std::collections::{HashMap, HashSet};

/// Ops whose result is not a function of their inputs: never folded or deduplicated.
pub const NONDETERMINISTIC: &[&str] = &[
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "Dropout",
];

/// True for nodes a pass must treat as opaque when asking "is this a pure function of its
/// inputs": non-deterministic ops and nodes holding subgraphs (control flow).
pub fn is_pure(n: &Node) -> bool {
    let nondet = n.domain.is_empty() && NONDETERMINISTIC.contains(&n.op_type.as_str());
    let has_graph = n.attrs.iter().any(|(_, a)| !subgraphs(a).is_empty());
    !nondet && !has_graph
}

/// Producer/consumer maps of one graph (built once per pass run, invalidated by edits).
pub struct Index {
    pub producer: HashMap<String, usize>,
    pub consumers: HashMap<String, Vec<usize>>,
    pub graph_outputs: HashSet<String>,
    pub graph_inputs: HashSet<String>,
    /// Names read by subgraphs of some node (outer-scope captures).
    pub captured: HashSet<String>,
    pub inits: HashMap<String, usize>,
}

impl Index {
    pub fn new(g: &Graph) -> Index {
        let mut producer = HashMap::new();
        let mut consumers: HashMap<String, Vec<usize>> = HashMap::new();
        let mut captured = HashSet::new();
        for (i, n) in g.nodes.iter().enumerate() {
            for o in n.outputs.iter().filter(|o| !o.is_empty()) {
                producer.insert(o.clone(), i);
            }
            for inp in n.inputs.iter().filter(|s| !s.is_empty()) {
                let v = consumers.entry(inp.clone()).or_default();
                if v.last() != Some(&i) {
                    v.push(i);
                }
            }
            for (_, a) in &n.attrs {
                for sg in subgraphs(a) {
                    captured.extend(sg.free_names_vec().into_iter().map(String::from));
                }
            }
        }
        Index {
            producer,
            consumers,
            graph_outputs: g.outputs.iter().map(|o| o.name.clone()).collect(),
            graph_inputs: g.inputs.iter().map(|o| o.name.clone()).collect(),
            captured,
            inits: g
                .initializers
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
        }
    }

    /// Nodes reading `name`.
    pub fn users(&self, name: &str) -> &[usize] {
        self.consumers
            .get(name)
            .map(|v| v.as_slice())
            .unwrap_or(&[])
    }

    /// A value only this graph's nodes see: not a graph output and not captured by a subgraph,
    /// so it may be removed or renamed.
    pub fn is_internal(&self, name: &str) -> bool {
        !self.graph_outputs.contains(name) && !self.captured.contains(name)
    }

    /// The only node reading `name`, when exactly one does and the value is internal.
    pub fn sole_user(&self, name: &str) -> Option<usize> {
        match self.users(name) {
            [u] if self.is_internal(name) => Some(*u),
            _ => None,
        }
    }

    /// The node producing `name`, with its op type.
    pub fn prod<'g>(&self, g: &'g Graph, name: &str) -> Option<(usize, &'g Node)> {
        let &i = self.producer.get(name)?;
        Some((i, g.nodes.get(i)?))
    }

    /// A constant value: an initializer that cannot be overridden by a feed, or the output of
    /// a `Constant` node.
    pub fn constant<'g>(&self, g: &'g Graph, name: &str) -> Option<std::borrow::Cow<'g, Tensor>> {
        if name.is_empty() {
            return None;
        }
        if let Some(&i) = self.inits.get(name) {
            if self.graph_inputs.contains(name) {
                return None;
            }
            return g
                .initializers
                .get(i)
                .map(|t| std::borrow::Cow::Borrowed(&t.tensor));
        }
        let (_, n) = self.prod(g, name)?;
        constant_node_value(n).map(std::borrow::Cow::Owned)
    }

    pub fn is_const(&self, g: &Graph, name: &str) -> bool {
        if let Some(&_i) = self.inits.get(name) {
            return !self.graph_inputs.contains(name);
        }
        matches!(self.prod(g, name), Some((_, n)) if n.op_type == "Constant" && n.domain.is_empty())
    }

    /// Whether `name` is a constant or computed from constants only, through pure nodes (e.g. a
    /// weight stored as int8 and scaled by `Cast` + `Mul`, left unfolded because its f32 form
    /// exceeds the folding budget): the runtime computes such a value once per plan and
    /// treats it as a constant ([`npuc_runtime`]'s derived steps), so a weight's fusions apply
    /// to it too.
    pub fn is_const_derived(&self, g: &Graph, name: &str) -> bool {
        self.const_derived_memo(g, name, &mut HashMap::new())
    }

    fn const_derived_memo<'g>(
        &self,
        g: &'g Graph,
        name: &'g str,
        memo: &mut HashMap<&'g str, bool>,
    ) -> bool {
        if self.is_const(g, name) {
            return true;
        }
        if let Some(&known) = memo.get(name) {
            return known;
        }
        // Provisionally false: a (malformed) cycle through `name` then ends here.
        memo.insert(name, false);
        let derived = !self.graph_inputs.contains(name)
            && match self.prod(g, name) {
                Some((_, n)) => {
                    is_pure(n)
                        && n.inputs.iter().any(|i| !i.is_empty())
                        && n.inputs
                            .iter()
                            .filter(|i| !i.is_empty())
                            .all(|i| self.const_derived_memo(g, i, memo))
                }
                None => false,
            };
        memo.insert(name, derived);
        derived
    }

    /// A constant's value as f64s (any numeric dtype).
    pub fn const_f64(&self, g: &Graph, name: &str) -> Option<Vec<f64>> {
        self.constant(g, name)?.to_f64_vec().ok()
    }

    /// A constant scalar (or one-element tensor) as f64.
    pub fn const_scalar(&self, g: &Graph, name: &str) -> Option<f64> {
        match self.const_f64(g, name)?.as_slice() {
            [v] => Some(*v),
            _ => None,
        }
    }
}

/// The value of a `Constant` node (any of its value attributes), when it is a plain tensor.
pub fn constant_node_value(n: &Node) -> Option<Tensor> {
    if n.op_type != "Constant" || !n.domain.is_empty() {
        return None;
    }
    let (name, a) = n.attrs.first()?;
    if n.attrs.len() != 1 {
        return None;
    }
    match (name.as_str(), a) {
        ("value", Attr::Tensor(t)) => Some(t.clone()),
        ("value_float", Attr::Float(f)) => Some(Tensor::scalar(*f)),
        ("value_int", Attr::Int(i)) => Some(Tensor::scalar(*i)),
        ("value_floats", Attr::Floats(v)) => Tensor::from_vec(vec![v.len()], v.clone()).ok(),
        ("value_ints", Attr::Ints(v)) => Tensor::from_vec(vec![v.len()], v.clone()).ok(),
        _ => None,
    }
}

/// A value name not used anywhere in the graph yet, derived from `base`.
pub fn fresh_name(g: &Graph, taken: &mut HashSet<String>, base: &str) -> String {
    if taken.is_empty() {
        taken.extend(g.initializers.iter().map(|i| i.name.clone()));
        taken.extend(g.inputs.iter().map(|i| i.name.clone()));
        for n in &g.nodes {
            taken.extend(n.outputs.iter().cloned());
            taken.extend(n.inputs.iter().cloned());
        }
    }
    let mut k = 0usize;
    loop {
        let cand = format!("{base}__npuc{k}");
        if !taken.contains(&cand) {
            taken.insert(cand.clone());
            return cand;
        }
        k += 1;
    }
}

/// Opset of the default domain (1 when the model imports none).
pub fn onnx_opset(m: &Model) -> i64 {
    m.opset("").unwrap_or(1)
}

/// The domain an op should be emitted in so the runtime can run it at this model's opset:
/// the ONNX domain when the runtime has a kernel for the model's opset, otherwise `npuc`
/// (which delegates to the newest ONNX kernel of that op). `None` when neither exists.
pub fn runnable_domain(m: &Model, op: &str) -> Option<&'static str> {
    let reg = npuc_runtime::registry();
    if reg.find("", op, onnx_opset(m)).is_some() {
        Some("")
    } else if reg.find("npuc", op, 1).is_some()
        && reg.find("", op, npuc_runtime::kernel::MAX_OPSET).is_some()
    {
        Some("npuc")
    } else {
        None
    }
}

/// Float dtypes the fused kernels handle.
pub fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// `|a - b|` small relative to `b`.
pub fn approx(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * b.abs().max(1e-30)
}

/// The other input of a binary node, given one of them.
pub fn other_input<'n>(n: &'n Node, one: &str) -> Option<&'n str> {
    match (n.input(0), n.input(1)) {
        (Some(a), Some(b)) if n.inputs.len() == 2 && a == one => Some(b),
        (Some(a), Some(b)) if n.inputs.len() == 2 && b == one => Some(a),
        _ => None,
    }
}

/// True when `n` is op `op` of the default domain.
pub fn is_op(n: &Node, op: &str) -> bool {
    n.op_type == op && n.domain.is_empty()
}

/// A value's dtype and shape when inference knows both, every dimension a number.
pub(crate) fn fixed_shape(
    r: &npuc_ir::infer::InferResult,
    name: &str,
) -> Option<(DType, Vec<usize>)> {
    match r.type_of(name)? {
        npuc_ir::TypeInfo::Tensor {
            dtype: Some(d),
            shape: Some(s),
        } => {
            let dims: Option<Vec<usize>> = s
                .iter()
                .map(|d| match d {
                    npuc_ir::Dim::Fixed(n) => Some(*n),
                    _ => None,
                })
                .collect();
            Some((*d, dims?))
        }
        _ => None,
    }
}
