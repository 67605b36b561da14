//! Plans (a graph lowered to slots and kernel calls) and their execution.

use crate::buffers::{Pool, PoolGuard};
use crate::error::{Result, RtError};
use crate::kernel::{registry, Inputs, KernelFn, OpCtx, StepHost};
use crate::value::Value;
use npuc_ir::{
    subgraphs, Attr, DType, Dim, Function, Graph, Model, Node, Tensor, TypeInfo, ValueInfo,
};
use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

struct Step {
    node: Node,
    kernel: KernelFn,
    opset: i64,
    inputs: Vec<Option<usize>>,
    outputs: Vec<Option<usize>>,
    /// Slots whose last reader is this node: released before the kernel runs so that it can
    /// take their buffers.
    free_before: Vec<usize>,
    /// Slots captured by this node's subgraphs whose last reader is this node.
    free_after: Vec<usize>,
    subplans: Vec<(String, Arc<Plan>)>,
    /// Per input: whether it is a graph constant (an initializer no feed can override), so a
    /// kernel may derive data from it once per plan (see [`OpCtx::cached`]).
    const_inputs: Vec<bool>,
    /// What the kernel derived from its constant inputs (e.g. prepacked weights), built on
    /// the first run and shared by later runs of this plan.
    cache: OnceLock<Arc<dyn Any + Send + Sync>>,
    /// Whether the outputs' sizes are checked against the memory budget before the kernel runs
    /// (ops whose outputs can be larger than their inputs; see [`output_sizes_bounded`]).
    check_sizes: bool,
    /// Whether every input is a constant or derived from constants only (a deterministic op
    /// without subgraphs): the outputs are the same on every run. Compiled graphs keep such
    /// steps where folding would grow the artifact (int8 weights times a scale in PP-OCRv6).
    derived: bool,
    /// A derived step's outputs, kept from the first run of a session that keeps weights packed
    /// (within [`DERIVED_BUDGET`]): later runs skip the step, and the kernels reading them
    /// see constant inputs, so they cache their packed weights too.
    derived_out: OnceLock<Vec<Value>>,
}

/// Bytes of derived constants ([`Step::derived_out`]) a plan keeps: the weights of small
/// compiled models expanded from int8 fit; an LLM's dequantized weights do not, and those steps
/// keep running each time rather than holding gigabytes.
const DERIVED_BUDGET: usize = 256 << 20;

/// Ops whose outputs differ between runs with equal inputs: never treated as derived constants.
fn nondeterministic(n: &Node) -> bool {
    n.op_type.starts_with("Random")
        || matches!(n.op_type.as_str(), "Multinomial" | "Bernoulli" | "Dropout")
}

fn value_bytes(v: &Value) -> usize {
    match v {
        Value::Tensor(t) => t.len() * t.dtype().size(),
        Value::Sequence(vs) => vs.iter().map(value_bytes).sum(),
        Value::Optional(o) => o.as_deref().map_or(0, value_bytes),
    }
}

/// A callback seeing each value a step produces, by name (see [`Session::run_observed`]).
type Observe<'a> = &'a mut (dyn FnMut(&str, &Value) + Send);

/// Called after each step with its index, start time, wall time and outputs (see
/// [`Session::run_timed`]).
pub type StepTimer<'a> = &'a mut (dyn FnMut(usize, Instant, std::time::Duration, &[Value]) + Send);

/// A graph ready to run: values mapped to slots, kernels resolved, lifetimes computed.
pub struct Plan {
    name: String,
    slot_of: HashMap<String, usize>,
    n_slots: usize,
    inputs: Vec<(ValueInfo, usize)>,
    outputs: Vec<(String, usize)>,
    consts: Vec<(usize, Value)>,
    outer_refs: Vec<(String, usize)>,
    steps: Vec<Step>,
    /// Intermediate buffers freed by earlier runs, reused by kernels of later ones (see
    /// [`crate::buffers`]).
    pool: Mutex<Pool>,
    /// The slot table of the previous run, kept (empty) so that a run does not allocate one.
    slot_scratch: Mutex<Vec<Option<Value>>>,
    /// Whether runs reuse pooled buffers (on unless `NPUC_BUFFER_POOL=0` or
    /// [`Session::set_buffer_reuse`] turned it off; for comparisons).
    reuse: AtomicBool,
    /// Whether kernels keep constant weights in their packed layout across runs (a second copy
    /// of those weights; see [`Session::set_weight_prepacking`]). Off by default.
    prepack: AtomicBool,
    /// Bytes held by the steps' [`Step::derived_out`] (at most [`DERIVED_BUDGET`]).
    derived_bytes: AtomicUsize,
}

/// The values of a running graph, visible to subgraphs run by its nodes.
pub struct Frame<'a> {
    plan: &'a Plan,
    slots: &'a [Option<Value>],
    parent: Option<&'a Frame<'a>>,
}

impl Frame<'_> {
    fn lookup(&self, name: &str) -> Option<Value> {
        if let Some(&s) = self.plan.slot_of.get(name) {
            if let Some(v) = &self.slots[s] {
                return Some(v.clone());
            }
        }
        self.parent.and_then(|p| p.lookup(name))
    }
}

impl StepHost for Frame<'_> {
    fn run_subgraph(
        &self,
        node_index: usize,
        attr: &str,
        inputs: Vec<Value>,
        threads: usize,
    ) -> Result<Vec<Value>> {
        let sub = self
            .plan
            .subplan(node_index, attr)
            .ok_or_else(|| RtError::msg(format!("attribute '{attr}' holds no graph")))?;
        sub.run_with_outer(inputs, Some(self), threads)
    }
    fn subgraph_input_count(&self, node_index: usize, attr: &str) -> Option<usize> {
        self.plan.subplan(node_index, attr).map(|p| p.input_count())
    }
    fn input_is_const(&self, node_index: usize, input: usize) -> bool {
        self.plan.input_is_const(node_index, input)
    }
    fn step_cache(&self, node_index: usize) -> &OnceLock<Arc<dyn Any + Send + Sync>> {
        self.plan.step_cache(node_index)
    }
    fn prepack_weights(&self) -> bool {
        self.plan.prepack.load(Ordering::Relaxed)
    }
}

#[derive(Clone)]
pub struct OpsetMap(pub HashMap<String, i64>);

impl OpsetMap {
    pub fn from_model(m: &Model) -> OpsetMap {
        OpsetMap(
            m.opset_imports
                .iter()
                .map(|o| (npuc_ir::normalize_domain(&o.domain).to_string(), o.version))
                .collect(),
        )
    }
    fn get(&self, domain: &str) -> i64 {
        self.0.get(domain).copied().unwrap_or(match domain {
            // Microsoft contrib ops are versioned 1 whatever the model says.
            "com.microsoft" => 1,
            _ => 1,
        })
    }
}

impl Plan {
    /// Builds a plan for a model's main graph, inlining model-local functions.
    pub fn for_model(m: &Model) -> Result<Plan> {
        let opsets = OpsetMap::from_model(m);
        let g = inline_functions(&m.graph, &m.functions)?;
        Plan::new(&g, &opsets, &HashSet::new(), &m.functions)
    }

    pub fn new(
        g: &Graph,
        opsets: &OpsetMap,
        outer: &HashSet<String>,
        functions: &[Function],
    ) -> Result<Plan> {
        let order = g.topo_order(outer)?;
        let reg = registry();
        let mut unsupported: Vec<(String, String)> = vec![];
        let mut slot_of: HashMap<String, usize> = HashMap::new();
        let slot = |name: &str, slot_of: &mut HashMap<String, usize>| -> usize {
            let n = slot_of.len();
            *slot_of.entry(name.to_string()).or_insert(n)
        };
        let mut consts = vec![];
        for init in &g.initializers {
            let s = slot(&init.name, &mut slot_of);
            consts.push((s, Value::tensor(init.tensor.clone())));
        }
        let inits = g.initializer_names();
        let mut inputs = vec![];
        for vi in &g.inputs {
            let s = slot(&vi.name, &mut slot_of);
            // Inputs that are also initializers (IR < 4) may be overridden by a feed.
            inputs.push((vi.clone(), s));
        }
        let _ = &inits;
        let mut outer_refs = vec![];
        for name in g.free_names_vec() {
            if !slot_of.contains_key(name) {
                let s = slot(name, &mut slot_of);
                outer_refs.push((name.to_string(), s));
            }
        }
        let mut steps = vec![];
        for &ni in &order {
            let n = &g.nodes[ni];
            for o in n.outputs.iter().filter(|o| !o.is_empty()) {
                slot(o, &mut slot_of);
            }
        }
        // Which slots each node's subgraphs capture.
        let mut scope_names: HashSet<String> = outer.clone();
        scope_names.extend(slot_of.keys().cloned());
        for &ni in &order {
            let n = &g.nodes[ni];
            let opset = opsets.get(&n.domain);
            let kernel = match reg.find(&n.domain, &n.op_type, opset) {
                Some(e) => e.kernel,
                None => {
                    let dom = if n.domain.is_empty() {
                        String::new()
                    } else {
                        format!("{}.", n.domain)
                    };
                    unsupported.push((
                        format!("{dom}{} opset {opset}", n.op_type),
                        n.display_name(),
                    ));
                    continue;
                }
            };
            let mut subplans = vec![];
            for (aname, a) in &n.attrs {
                if let Attr::Graph(sg) = a {
                    let sg = inline_functions(sg, functions)?;
                    subplans.push((
                        aname.clone(),
                        Arc::new(Plan::new(&sg, opsets, &scope_names, functions)?),
                    ));
                }
            }
            steps.push(Step {
                node: n.clone(),
                kernel,
                opset,
                inputs: n
                    .inputs
                    .iter()
                    .map(|i| {
                        if i.is_empty() {
                            None
                        } else {
                            slot_of.get(i).copied()
                        }
                    })
                    .collect(),
                outputs: n
                    .outputs
                    .iter()
                    .map(|o| {
                        if o.is_empty() {
                            None
                        } else {
                            slot_of.get(o).copied()
                        }
                    })
                    .collect(),
                free_before: vec![],
                free_after: vec![],
                subplans,
                const_inputs: vec![],
                cache: OnceLock::new(),
                check_sizes: !output_sizes_bounded(&n.domain, &n.op_type),
                derived: false,
                derived_out: OnceLock::new(),
            });
        }
        if !unsupported.is_empty() {
            // One line per op, with a count and the first nodes, so large models stay readable.
            let mut grouped: Vec<(String, Vec<String>)> = vec![];
            for (op, node) in unsupported {
                match grouped.iter_mut().find(|(o, _)| *o == op) {
                    Some((_, nodes)) => nodes.push(node),
                    None => grouped.push((op, vec![node])),
                }
            }
            return Err(RtError::Unsupported(
                grouped
                    .into_iter()
                    .map(|(op, nodes)| {
                        let shown: Vec<String> =
                            nodes.iter().take(3).map(|n| format!("'{n}'")).collect();
                        let more = if nodes.len() > 3 {
                            format!(" and {} more", nodes.len() - 3)
                        } else {
                            String::new()
                        };
                        format!(
                            "{op} ({} node{}: {}{more})",
                            nodes.len(),
                            if nodes.len() == 1 { "" } else { "s" },
                            shown.join(", ")
                        )
                    })
                    .collect(),
            ));
        }
        let outputs: Vec<(String, usize)> = g
            .outputs
            .iter()
            .map(|o| (o.name.clone(), slot_of[&o.name]))
            .collect();
        // Constant inputs: initializers that are not also graph inputs (those may be fed).
        let fed: HashSet<usize> = inputs.iter().map(|i| i.1).collect();
        // Outputs of derived steps (deterministic, every input constant) are constants too.
        let mut const_slots: HashSet<usize> = consts
            .iter()
            .map(|c| c.0)
            .filter(|s| !fed.contains(s))
            .collect();
        for st in &mut steps {
            st.const_inputs = st
                .inputs
                .iter()
                .map(|s| s.is_some_and(|s| const_slots.contains(&s)))
                .collect();
            st.derived = st.subplans.is_empty()
                && !nondeterministic(&st.node)
                && (st.inputs.iter().any(Option::is_some) || st.node.op_type == "Constant")
                && st
                    .inputs
                    .iter()
                    .all(|s| s.is_none_or(|s| const_slots.contains(&s)));
            if st.derived {
                const_slots.extend(st.outputs.iter().flatten());
            }
        }
        // Lifetimes: the last step reading each slot frees it, unless it is kept (constant,
        // graph input or output).
        let mut keep: HashSet<usize> = outputs.iter().map(|o| o.1).collect();
        keep.extend(consts.iter().map(|c| c.0));
        let mut last_use: HashMap<usize, (usize, bool)> = HashMap::new();
        for (si, st) in steps.iter().enumerate() {
            for s in st.inputs.iter().flatten() {
                last_use.insert(*s, (si, false));
            }
            for (_, a) in &st.node.attrs {
                for sg in subgraphs(a) {
                    for f in sg.free_names_vec() {
                        if let Some(&s) = slot_of.get(f) {
                            last_use.insert(s, (si, true));
                        }
                    }
                }
            }
        }
        for (s, (si, captured)) in last_use {
            if keep.contains(&s) {
                continue;
            }
            if captured {
                steps[si].free_after.push(s);
            } else {
                steps[si].free_before.push(s);
            }
        }
        Ok(Plan {
            name: g.name.clone(),
            n_slots: slot_of.len(),
            slot_of,
            inputs,
            outputs,
            consts,
            outer_refs,
            steps,
            pool: Mutex::new(Pool::default()),
            slot_scratch: Mutex::new(Vec::new()),
            reuse: AtomicBool::new(std::env::var("NPUC_BUFFER_POOL").map_or(true, |v| v != "0")),
            prepack: AtomicBool::new(false),
            derived_bytes: AtomicUsize::new(0),
        })
    }

    /// Keeps a derived step's outputs for later runs while the plan's budget allows.
    fn keep_derived(&self, st: &Step, out: &[Value]) {
        let bytes: usize = out.iter().map(value_bytes).sum();
        let held = self.derived_bytes.fetch_add(bytes, Ordering::Relaxed);
        if held + bytes > DERIVED_BUDGET || st.derived_out.set(out.to_vec()).is_err() {
            self.derived_bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Buffers and bytes held by this plan's pool of intermediate buffers (what steady-state
    /// runs reuse instead of allocating).
    pub fn pool_stats(&self) -> (usize, usize) {
        let p = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        (p.len(), p.bytes())
    }

    pub fn input_count(&self) -> usize {
        self.inputs.len()
    }

    /// Whether input `input` of step `node_index` is a constant of this plan.
    pub(crate) fn input_is_const(&self, node_index: usize, input: usize) -> bool {
        self.steps[node_index]
            .const_inputs
            .get(input)
            .copied()
            .unwrap_or(false)
    }

    /// The per-step cache slot (see [`OpCtx::cached`]).
    pub(crate) fn step_cache(&self, node_index: usize) -> &OnceLock<Arc<dyn Any + Send + Sync>> {
        &self.steps[node_index].cache
    }

    pub(crate) fn subplan(&self, node_index: usize, attr: &str) -> Option<&Arc<Plan>> {
        self.steps[node_index]
            .subplans
            .iter()
            .find(|(n, _)| n == attr)
            .map(|(_, p)| p)
    }

    /// Runs with inputs given in graph-input order (initializer-backed inputs may be omitted
    /// by passing fewer values only when they come last).
    pub fn run_with_outer(
        &self,
        inputs: Vec<Value>,
        outer: Option<&Frame>,
        threads: usize,
    ) -> Result<Vec<Value>> {
        self.run_slots(
            inputs.into_iter().map(Some).collect(),
            outer,
            threads,
            None,
            None,
        )
    }

    /// Runs the steps; `observe` (if any) sees every value a step produces, named, right after
    /// the step, before a later step can take its buffer. `timer` (if any) is told each step's
    /// start and wall time (kernel call included, slot bookkeeping not) and its outputs.
    fn run_slots(
        &self,
        inputs: Vec<Option<Value>>,
        outer: Option<&Frame>,
        threads: usize,
        mut observe: Option<Observe>,
        mut timer: Option<StepTimer>,
    ) -> Result<Vec<Value>> {
        let _pool = PoolGuard::install(&self.pool, self.reuse.load(Ordering::Relaxed));
        // The previous run's (emptied) slot table when no concurrent run holds it.
        let mut slots: Vec<Option<Value>> = self
            .slot_scratch
            .try_lock()
            .map(|mut g| std::mem::take(&mut *g))
            .unwrap_or_default();
        slots.clear();
        slots.resize(self.n_slots, None);
        for (s, v) in &self.consts {
            slots[*s] = Some(v.clone());
        }
        for ((_, s), v) in self.inputs.iter().zip(inputs) {
            if v.is_some() {
                slots[*s] = v;
            }
        }
        for (name, s) in &self.outer_refs {
            slots[*s] = outer.and_then(|f| f.lookup(name));
        }
        for (si, st) in self.steps.iter().enumerate() {
            let vals: Vec<Option<Value>> = st
                .inputs
                .iter()
                .map(|s| s.and_then(|s| slots[s].clone()))
                .collect();
            for &s in &st.free_before {
                slots[s] = None;
            }
            if st.check_sizes {
                check_output_sizes(st, &vals)?;
            }
            let started = timer.as_ref().map(|_| Instant::now());
            let kept = if st.derived {
                st.derived_out.get().cloned()
            } else {
                None
            };
            let out = if let Some(out) = kept {
                out
            } else {
                let frame = Frame {
                    plan: self,
                    slots: &slots,
                    parent: outer,
                };
                let ctx = OpCtx {
                    node: &st.node,
                    opset: st.opset,
                    threads,
                    host: &frame,
                    node_index: si,
                };
                let out =
                    (st.kernel)(&ctx, Inputs::new(vals)).map_err(|e| with_node(e, &st.node))?;
                if st.derived && self.prepack.load(Ordering::Relaxed) {
                    self.keep_derived(st, &out);
                }
                out
            };
            if let (Some(t), Some(f)) = (started, timer.as_mut()) {
                f(si, t, t.elapsed(), &out);
            }
            for &s in &st.free_after {
                if let Some(v) = slots[s].take() {
                    crate::buffers::recycle(v);
                }
            }
            if out.len() < st.outputs.iter().filter(|o| o.is_some()).count() {
                return Err(with_node(
                    RtError::msg(format!(
                        "kernel produced {} outputs, the node declares {}",
                        out.len(),
                        st.outputs.len()
                    )),
                    &st.node,
                ));
            }
            if let Some(f) = observe.as_mut() {
                for (name, v) in st.node.outputs.iter().zip(&out) {
                    if !name.is_empty() {
                        f(name, v);
                    }
                }
            }
            for (o, v) in st.outputs.iter().zip(out) {
                if let Some(o) = o {
                    slots[*o] = Some(v);
                }
            }
        }
        let outs = self
            .outputs
            .iter()
            .map(|(name, s)| {
                slots[*s].clone().ok_or_else(|| {
                    RtError::msg(format!(
                        "graph '{}' output '{name}' was not computed",
                        self.name
                    ))
                })
            })
            .collect();
        // Values nobody read (unused optional outputs, graph inputs) go back to the pool;
        // outputs and constants are still held elsewhere and are not.
        for v in slots.drain(..).flatten() {
            crate::buffers::recycle(v);
        }
        if let Ok(mut g) = self.slot_scratch.try_lock() {
            *g = slots;
        }
        outs
    }
}

/// Ops whose outputs never take more memory than a small multiple of their inputs' (shape
/// preserving, shrinking or reordering): their sizes are not checked before they run. Every other
/// op (broadcasting, padding, resizing, expanding, one-hot, products) is.
fn output_sizes_bounded(domain: &str, op: &str) -> bool {
    // `npuc` ops are made by npuc's own compiler and LLM builder from graphs whose sizes were
    // checked when they were compiled (and the LLM's token steps run thousands of them).
    domain == "npuc"
        || domain.is_empty()
            && matches!(
                op,
                "Abs"
                    | "Acos"
                    | "Acosh"
                    | "Asin"
                    | "Asinh"
                    | "Atan"
                    | "Atanh"
                    | "BatchNormalization"
                    | "Cast"
                    | "CastLike"
                    | "Ceil"
                    | "Celu"
                    | "Clip"
                    | "Cos"
                    | "Cosh"
                    | "DequantizeLinear"
                    | "Dropout"
                    | "Elu"
                    | "Erf"
                    | "Exp"
                    | "Flatten"
                    | "Floor"
                    | "Gelu"
                    | "HardSigmoid"
                    | "HardSwish"
                    | "Hardmax"
                    | "Identity"
                    | "InstanceNormalization"
                    | "IsInf"
                    | "IsNaN"
                    | "LayerNormalization"
                    | "LeakyRelu"
                    | "Log"
                    | "LogSoftmax"
                    | "Mish"
                    | "Neg"
                    | "Not"
                    | "QuantizeLinear"
                    | "Reciprocal"
                    | "Relu"
                    | "Reshape"
                    | "Round"
                    | "Selu"
                    | "Shape"
                    | "Sigmoid"
                    | "Sign"
                    | "Sin"
                    | "Sinh"
                    | "Size"
                    | "Slice"
                    | "Softmax"
                    | "Softplus"
                    | "Softsign"
                    | "Sqrt"
                    | "Squeeze"
                    | "Tan"
                    | "Tanh"
                    | "ThresholdedRelu"
                    | "Transpose"
                    | "Unsqueeze"
                    | "ReduceMean"
                    | "ReduceSum"
                    | "ReduceMax"
                    | "ReduceMin"
                    | "ReduceProd"
                    | "ReduceL1"
                    | "ReduceL2"
                    | "ReduceLogSum"
                    | "ReduceLogSumExp"
                    | "ReduceSumSquare"
                    | "ArgMax"
                    | "ArgMin"
                    | "GlobalAveragePool"
                    | "GlobalMaxPool"
            )
}

/// Refuses to run a step whose outputs (inferred from its actual inputs) would exceed the
/// memory budget, naming the output and its shape.
fn check_output_sizes(st: &Step, vals: &[Option<Value>]) -> Result<()> {
    let ins: Vec<Option<&Tensor>> = vals
        .iter()
        .map(|v| v.as_ref().and_then(|v| v.as_tensor()))
        .collect();
    let Some(Ok(tys)) = npuc_ir::infer::node_output_types(&st.node, st.opset, &ins) else {
        // No rule, or the rule found a problem: the kernel checks its inputs itself.
        return Ok(());
    };
    for (ty, name) in tys.iter().zip(&st.node.outputs) {
        let Some(bytes) = ty.fixed_bytes() else {
            continue;
        };
        crate::limits::check_bytes(bytes, || format!("output '{name}' ({})", ty.describe()))
            .map_err(|m| with_node(RtError::Msg(m), &st.node))?;
    }
    Ok(())
}

fn with_node(e: RtError, n: &Node) -> RtError {
    match e {
        RtError::Msg(msg) => RtError::Node {
            node: n.display_name(),
            op: n.op_type.clone(),
            msg,
        },
        RtError::Ir(npuc_ir::IrError::Node { .. }) => e,
        RtError::Ir(ir) => RtError::Node {
            node: n.display_name(),
            op: n.op_type.clone(),
            msg: ir.to_string(),
        },
        other => other,
    }
}

/// Expands calls to model-local functions into their bodies (recursively), renaming the
/// function's internal values so that they cannot collide with the caller's.
pub fn inline_functions(g: &Graph, functions: &[Function]) -> Result<Graph> {
    if functions.is_empty() {
        return Ok(g.clone());
    }
    let mut out = g.clone();
    out.nodes.clear();
    let mut counter = 0usize;
    for n in &g.nodes {
        expand_node(n, functions, &mut out.nodes, &mut counter, 0)?;
    }
    Ok(out)
}

fn expand_node(
    n: &Node,
    functions: &[Function],
    out: &mut Vec<Node>,
    counter: &mut usize,
    depth: usize,
) -> Result<()> {
    let f = functions
        .iter()
        .find(|f| f.name == n.op_type && npuc_ir::normalize_domain(&f.domain) == n.domain);
    let Some(f) = f else {
        out.push(n.clone());
        return Ok(());
    };
    if depth > 32 {
        return Err(RtError::msg(format!(
            "function '{}' calls itself recursively",
            f.name
        )));
    }
    *counter += 1;
    let prefix = format!("__{}_{}_", f.name, counter);
    let mut rename: HashMap<&str, String> = HashMap::new();
    for (i, formal) in f.inputs.iter().enumerate() {
        rename.insert(formal, n.inputs.get(i).cloned().unwrap_or_default());
    }
    for (i, formal) in f.outputs.iter().enumerate() {
        rename.insert(formal, n.outputs.get(i).cloned().unwrap_or_default());
    }
    let map = |name: &String, rename: &HashMap<&str, String>| -> String {
        if name.is_empty() {
            return String::new();
        }
        rename
            .get(name.as_str())
            .cloned()
            .unwrap_or_else(|| format!("{prefix}{name}"))
    };
    for body in &f.nodes {
        let mut b = body.clone();
        b.inputs = b.inputs.iter().map(|i| map(i, &rename)).collect();
        b.outputs = b.outputs.iter().map(|o| map(o, &rename)).collect();
        if !b.name.is_empty() {
            b.name = format!("{prefix}{}", b.name);
        }
        let mut attrs = vec![];
        for (name, a) in b.attrs {
            match a {
                Attr::Ref(r) => {
                    if let Some(v) = n.attr(&r) {
                        attrs.push((name, v.clone()));
                    } else if let Some((_, d)) = f.attribute_defaults.iter().find(|(k, _)| *k == r)
                    {
                        attrs.push((name, d.clone()));
                    }
                }
                other => attrs.push((name, other)),
            }
        }
        b.attrs = attrs;
        expand_node(&b, functions, out, counter, depth + 1)?;
    }
    Ok(())
}

/// Options for a [`Session`].
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub threads: usize,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions { threads: 1 }
    }
}

/// A model ready to run.
pub struct Session {
    plan: Plan,
    inputs: Vec<ValueInfo>,
    outputs: Vec<ValueInfo>,
    opts: SessionOptions,
    /// The session's own workers (`opts.threads` of them, made at the first run), on which a
    /// multi-threaded run executes its steps; see [`Session::workers`].
    workers: OnceLock<Option<Workers>>,
    /// Whether runs flush subnormal floats to zero ([`crate::kernels::fpenv`]).
    flush_denormals: AtomicBool,
}

impl Session {
    pub fn new(m: &Model, opts: SessionOptions) -> Result<Session> {
        let plan = Plan::for_model(m)?;
        let inits = m.graph.initializer_names();
        Ok(Session {
            plan,
            inputs: m
                .graph
                .inputs
                .iter()
                .filter(|i| !inits.contains(i.name.as_str()))
                .cloned()
                .collect(),
            outputs: m.graph.outputs.clone(),
            opts,
            workers: OnceLock::new(),
            flush_denormals: AtomicBool::new(crate::kernels::fpenv::flush_by_default()),
        })
    }

    /// The pool a run with more than one thread executes on: `opts.threads` workers of this
    /// session's own. Why not the process-wide pool: a kernel's parallel loop started from the
    /// caller's thread is injected into that pool while the caller sleeps on a latch, so every
    /// parallel op paid two thread wake-ups (and the pool had as many workers as cores, not
    /// `--threads`). Running the whole step loop on worker 0 of a pool sized to `--threads`
    /// makes each kernel's split a fork-join inside the pool: worker 0 runs its share and takes
    /// back any share no idle worker stole, so a sleeping worker never delays an op, and an
    /// idle worker spins briefly before it sleeps. `NPUC_SESSION_POOL=0` falls back to the
    /// process-wide pool (for comparisons). `None` when single-threaded or when the pool
    /// cannot be made (then the caller's thread runs the steps, as with one thread).
    fn workers(&self) -> Option<&Workers> {
        self.workers
            .get_or_init(|| {
                if self.opts.threads <= 1
                    || std::env::var("NPUC_SESSION_POOL").is_ok_and(|v| v == "0")
                {
                    return None;
                }
                let flush = self.flush_denormals.load(Ordering::Relaxed);
                rayon::ThreadPoolBuilder::new()
                    .num_threads(self.opts.threads)
                    .start_handler(move |_| {
                        if flush {
                            crate::kernels::fpenv::flush_on_this_thread();
                        }
                    })
                    .thread_name(|i| format!("npuc-worker-{i}"))
                    // The caller's main thread has 8 MiB; the steps now run here.
                    .stack_size(8 << 20)
                    .build()
                    .ok()
                    .map(|pool| Workers {
                        pool,
                        awake: Arc::new(Awake::new(self.opts.threads)),
                    })
            })
            .as_ref()
    }

    /// Graph inputs the caller must feed (initializer-backed inputs excluded).
    pub fn inputs(&self) -> &[ValueInfo] {
        &self.inputs
    }
    /// Buffers and bytes the session keeps for reuse by later runs.
    pub fn pool_stats(&self) -> (usize, usize) {
        self.plan.pool_stats()
    }
    /// Turns reuse of intermediate buffers across runs on (the default) or off (every kernel
    /// output is a fresh allocation; for comparisons). Turning it off empties the pool.
    pub fn set_buffer_reuse(&self, on: bool) {
        self.plan.reuse.store(on, Ordering::Relaxed);
        if !on {
            *self.plan.pool.lock().unwrap_or_else(|e| e.into_inner()) = Pool::default();
        }
    }
    /// Lets kernels keep constant weights packed for their micro-kernels across runs (the f32
    /// MatMul/FusedMatMul weights at the AVX-512 level), which saves packing them on every run
    /// at the cost of a packed copy of each such weight for the session's lifetime. Meant for
    /// sessions that serve many runs (`npuc run`, `bench`, `serve`); off by default, so that the
    /// short-lived sessions of calibration and verification over large models hold one copy.
    pub fn set_weight_prepacking(&self, on: bool) {
        self.plan.prepack.store(on, Ordering::Relaxed);
    }
    /// Runs flush subnormal f32 values to zero by default (see [`crate::kernels::fpenv`]: a
    /// subnormal costs ~100 cycles per operation on x86); `false` keeps them, as
    /// `NPUC_DENORMALS=keep` does. Set it before the first run: a multi-threaded session's
    /// workers take the setting when they start.
    pub fn set_flush_denormals(&self, on: bool) {
        self.flush_denormals.store(on, Ordering::Relaxed);
    }
    pub fn outputs(&self) -> &[ValueInfo] {
        &self.outputs
    }

    /// Runs with named feeds; returns outputs in graph order. Checks feeds against the declared
    /// input types (dtype, rank, fixed dims, consistent symbolic dims).
    pub fn run(&self, feeds: Vec<(String, Value)>) -> Result<Vec<(String, Value)>> {
        self.run_inner(feeds, None, None)
    }

    /// Like [`Session::run`], and calls `observe(name, value)` for every value a node produces,
    /// in execution order, as soon as it is produced (graph inputs and initializers are not
    /// reported). Intermediate values need not be graph outputs, so their buffers are still
    /// freed and reused: this is how calibration watches every activation at the cost of a
    /// plain run.
    pub fn run_observed(
        &self,
        feeds: Vec<(String, Value)>,
        observe: &mut (dyn FnMut(&str, &Value) + Send),
    ) -> Result<Vec<(String, Value)>> {
        self.run_inner(feeds, Some(observe), None)
    }

    /// The nodes in execution order (the order of [`Session::run_profiled`]'s timings).
    pub fn steps(&self) -> impl Iterator<Item = &Node> {
        self.plan.steps.iter().map(|s| &s.node)
    }

    /// Like [`Session::run`], and adds each step's wall time in nanoseconds to
    /// `step_nanos[i]` (`i` in [`Session::steps`] order; the slice must have one entry per
    /// step). A node running a subgraph (If, Loop, Scan) counts the subgraph's time as its own.
    pub fn run_profiled(
        &self,
        feeds: Vec<(String, Value)>,
        step_nanos: &mut [u64],
    ) -> Result<Vec<(String, Value)>> {
        if step_nanos.len() != self.plan.steps.len() {
            return Err(RtError::msg(format!(
                "run_profiled: {} timing slots for {} steps",
                step_nanos.len(),
                self.plan.steps.len()
            )));
        }
        self.run_inner(
            feeds,
            None,
            Some(&mut |i, _, d, _| step_nanos[i] += d.as_nanos() as u64),
        )
    }

    /// Like [`Session::run`], and calls `timer(i, start, wall time, outputs)` after each step
    /// (`i` in [`Session::steps`] order; a node running a subgraph counts the subgraph's time as
    /// its own): what `npuc bench --trace` turns into a Chrome trace.
    pub fn run_timed(
        &self,
        feeds: Vec<(String, Value)>,
        timer: StepTimer,
    ) -> Result<Vec<(String, Value)>> {
        self.run_inner(feeds, None, Some(timer))
    }

    fn run_inner(
        &self,
        feeds: Vec<(String, Value)>,
        observe: Option<Observe>,
        timer: Option<StepTimer>,
    ) -> Result<Vec<(String, Value)>> {
        let mut by_name: HashMap<String, Value> = HashMap::new();
        for (n, v) in feeds {
            if !self.plan.inputs.iter().any(|(vi, _)| vi.name == n) {
                return Err(RtError::Input {
                    name: n.clone(),
                    msg: format!(
                        "the model has no such input; its inputs are: {}",
                        self.inputs
                            .iter()
                            .map(|i| i.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
            by_name.insert(n, v);
        }
        let mut syms: HashMap<String, usize> = HashMap::new();
        let mut ordered = vec![];
        for (vi, _) in &self.plan.inputs {
            match by_name.remove(&vi.name) {
                Some(v) => {
                    check_input(vi, &v, &mut syms)?;
                    ordered.push(Some(v));
                }
                None => {
                    let is_init = self
                        .plan
                        .consts
                        .iter()
                        .any(|(s, _)| self.plan.slot_of.get(&vi.name) == Some(s));
                    if !is_init {
                        return Err(RtError::Input {
                            name: vi.name.clone(),
                            msg: format!(
                                "no value was given for this input ({}); pass it with --input {}=FILE",
                                vi.ty.as_ref().map(|t| t.describe()).unwrap_or_default(),
                                vi.name
                            ),
                        });
                    }
                    ordered.push(None);
                }
            }
        }
        let threads = self.opts.threads;
        let flush = self.flush_denormals.load(Ordering::Relaxed);
        let run = move || {
            let _env = flush.then(crate::kernels::fpenv::FlushDenormals::new);
            self.plan.run_slots(ordered, None, threads, observe, timer)
        };
        let outs = match self.workers() {
            Some(w) if keep_workers_awake() => {
                let _active = w.awake.begin(&w.pool);
                w.pool.install(|| {
                    let _running = Running::enter();
                    run()
                })?
            }
            Some(w) => w.pool.install(run)?,
            None => run()?,
        };
        Ok(self
            .outputs
            .iter()
            .map(|o| o.name.clone())
            .zip(outs)
            .collect())
    }
}

/// Idle checks a kept-awake worker makes during a run with only `pause` between them (each
/// ~0.1-0.2 us) before it also gives its CPU back to the OS scheduler (`yield`) between
/// checks: spin briefly, then yield.
const AWAKE_SPIN_ROUNDS: u32 = 2000;

/// How long (microseconds) kept-awake workers stay in their loop after a run ends, yielding
/// their CPU between checks, so that the next run of a loop of runs (a benchmark, a video
/// stream, a server under load) starts without waking a sleeping thread. `NPUC_LINGER_US`
/// overrides it; 0 lets the workers sleep as soon as a run ends.
const LINGER_US: u64 = 2000;

fn linger_us() -> u64 {
    static US: OnceLock<u64> = OnceLock::new();
    *US.get_or_init(|| {
        std::env::var("NPUC_LINGER_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(LINGER_US)
    })
}

/// Whether multi-threaded runs keep their idle workers awake ([`Awake`]); `NPUC_KEEP_AWAKE=0`
/// lets them sleep between ops (for comparisons).
fn keep_workers_awake() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("NPUC_KEEP_AWAKE").map_or(true, |v| v != "0"))
}

/// A multi-threaded session's own pool and what its kept-awake workers watch.
struct Workers {
    pool: rayon::ThreadPool,
    awake: Arc<Awake>,
}

/// Keeps a session's idle workers awake during its runs and for [`linger_us`] after each.
///
/// Why: a rayon worker that finds no work spins for a few microseconds and then sleeps; on
/// this class of VM a sleeping vCPU takes longer to wake than half of a typical parallel op
/// (measured: PP-OCRv5 cls pointwise convs of ~0.3 ms ran no faster at 2 threads), so the
/// worker running the steps finished its share, found the other half not yet stolen and ran
/// it too. A kept-awake worker steals a fork-join half within a microsecond (onnxruntime's
/// pool spins the same way). Keeping them through the gap between runs also saves the two
/// wake-ups each run otherwise starts with (the worker that takes the steps, then the
/// others): measured 0.08-0.24 ms a run on the romanizer encoder at 2 threads (kernels
/// 0.31-0.34 ms).
struct Awake {
    /// Runs of this session in progress.
    active: AtomicUsize,
    /// Workers now in [`keep_awake`]'s loop.
    keepers: AtomicUsize,
    /// When the last run ended, in microseconds after `epoch`.
    last_end_us: AtomicU64,
    epoch: Instant,
    threads: usize,
}

impl Awake {
    fn new(threads: usize) -> Awake {
        Awake {
            active: AtomicUsize::new(0),
            keepers: AtomicUsize::new(0),
            last_end_us: AtomicU64::new(0),
            epoch: Instant::now(),
            threads,
        }
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Marks a run as started (until the guard drops) and sends every worker not already in
    /// its keep-awake loop into it.
    fn begin<'a>(self: &'a Arc<Self>, pool: &rayon::ThreadPool) -> ActiveRun<'a> {
        // `active` before `keepers`: a keeper about to leave re-reads `active` after
        // leaving, so either it stays or this run sees it gone and sends a new one (a second
        // copy on a thread already keeping returns at once).
        self.active.fetch_add(1, Ordering::SeqCst);
        if self.keepers.load(Ordering::SeqCst) < self.threads {
            let awake = Arc::clone(self);
            pool.spawn_broadcast(move |_| keep_awake(&awake));
        }
        ActiveRun(self)
    }
}

/// A run in progress; dropping it (also on unwinding) records the run's end.
struct ActiveRun<'a>(&'a Awake);

impl Drop for ActiveRun<'_> {
    fn drop(&mut self) {
        self.0.last_end_us.store(self.0.now_us(), Ordering::SeqCst);
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

thread_local! {
    /// Whether this thread is running a session's steps.
    static RUNNING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether this thread is in [`keep_awake`]'s loop.
    static KEEPING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as running steps until dropped (also on unwinding); restores what was
/// there (a worker waiting inside one run's step may pick up another run's steps).
struct Running(bool);

impl Running {
    fn enter() -> Running {
        Running(RUNNING.with(|r| r.replace(true)))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let was = self.0;
        RUNNING.with(|r| r.set(was));
    }
}

/// The loop of a kept-awake worker: runs any job it can find in the pool (a run's steps, the
/// fork-join halves of its kernels), spinning briefly while a run is going on and yielding its
/// CPU otherwise, until no run has been going on for [`linger_us`].
fn keep_awake(awake: &Awake) {
    // A copy reached on a thread running steps (while it waits inside a kernel's join: the
    // steps would stall behind this loop) or on a thread already in this loop returns at once.
    if RUNNING.with(|r| r.get()) || KEEPING.with(|k| k.replace(true)) {
        return;
    }
    awake.keepers.fetch_add(1, Ordering::SeqCst);
    let linger = linger_us();
    let mut idle = 0u32;
    loop {
        let running = awake.active.load(Ordering::SeqCst) > 0;
        if !running
            && awake
                .now_us()
                .saturating_sub(awake.last_end_us.load(Ordering::SeqCst))
                >= linger
        {
            awake.keepers.fetch_sub(1, Ordering::SeqCst);
            if awake.active.load(Ordering::SeqCst) == 0 {
                break;
            }
            awake.keepers.fetch_add(1, Ordering::SeqCst);
        }
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle = 0,
            _ if running && idle < AWAKE_SPIN_ROUNDS => {
                idle += 1;
                for _ in 0..16 {
                    std::hint::spin_loop();
                }
            }
            _ => std::thread::yield_now(),
        }
    }
    KEEPING.with(|k| k.set(false));
}

fn check_input(vi: &ValueInfo, v: &Value, syms: &mut HashMap<String, usize>) -> Result<()> {
    let err = |msg: String| RtError::Input {
        name: vi.name.clone(),
        msg,
    };
    let (Some(TypeInfo::Tensor { dtype, shape }), Value::Tensor(t)) = (&vi.ty, v) else {
        return Ok(());
    };
    if let Some(d) = dtype {
        if *d != t.dtype() && !(t.dtype() == DType::String && *d == DType::String) {
            return Err(err(format!(
                "expected dtype {d}, got {} (convert the input file)",
                t.dtype()
            )));
        }
    }
    if let Some(dims) = shape {
        if dims.len() != t.rank() {
            return Err(err(format!(
                "expected rank {} ({}), got shape {:?}",
                dims.len(),
                vi.ty.as_ref().map(|t| t.describe()).unwrap_or_default(),
                t.shape()
            )));
        }
        for (i, (d, &n)) in dims.iter().zip(t.shape()).enumerate() {
            match d {
                Dim::Fixed(f) if *f != n => {
                    return Err(err(format!(
                        "dimension {i} must be {f}, got {n} (shape {:?})",
                        t.shape()
                    )))
                }
                Dim::Symbolic(s) => {
                    if let Some(&prev) = syms.get(s) {
                        if prev != n {
                            return Err(err(format!(
                                "dimension {i} ('{s}') is {n} but another input bound '{s}' to {prev}"
                            )));
                        }
                    } else {
                        syms.insert(s.clone(), n);
                    }
                }
                _ => {}
            }
        }
    }
    Ok(())
}
