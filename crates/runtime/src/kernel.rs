//! The kernel interface: what an op implementation receives and returns, and the registry
//! that maps (domain, op, opset) to kernels.

use crate::error::{Result, RtError};
use crate::value::Value;
use npuc_ir::opdef::OpDef;
use npuc_ir::{Node, Tensor};
use std::any::Any;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};

/// A node's inputs. Absent optional inputs are `None`. Values are owned by this struct, so a
/// kernel may take a tensor and reuse its buffer when it holds the only reference.
pub struct Inputs {
    pub(crate) vals: Vec<Option<Value>>,
}

impl Drop for Inputs {
    /// Inputs the kernel neither took nor shares with a live slot were freed by the executor
    /// before the kernel ran (their last reader): their buffers go back to the plan's pool.
    fn drop(&mut self) {
        for v in self.vals.drain(..).flatten() {
            crate::buffers::recycle(v);
        }
    }
}

impl Inputs {
    pub fn new(vals: Vec<Option<Value>>) -> Inputs {
        Inputs { vals }
    }
    pub fn len(&self) -> usize {
        self.vals.len()
    }
    pub fn is_empty(&self) -> bool {
        self.vals.is_empty()
    }
    pub fn value(&self, i: usize) -> Option<&Value> {
        self.vals.get(i).and_then(|v| v.as_ref())
    }
    pub fn take_value(&mut self, i: usize) -> Option<Value> {
        self.vals.get_mut(i).and_then(|v| v.take())
    }
    /// Required tensor input `i`.
    pub fn tensor(&self, i: usize) -> Result<&Tensor> {
        match self.value(i) {
            Some(Value::Tensor(t)) => Ok(t),
            Some(v) => Err(RtError::msg(format!(
                "input {i} should be a tensor, found a {}",
                v.kind()
            ))),
            None => Err(RtError::msg(format!("required input {i} is missing"))),
        }
    }
    /// Optional tensor input `i` (`None` when absent or empty-named).
    pub fn opt_tensor(&self, i: usize) -> Option<&Tensor> {
        self.value(i).and_then(|v| v.as_tensor())
    }
    /// Takes tensor input `i` by value; copies only when another reader still holds it.
    pub fn take_tensor(&mut self, i: usize) -> Result<Tensor> {
        match self.take_value(i) {
            Some(Value::Tensor(t)) => {
                Ok(Arc::try_unwrap(t).unwrap_or_else(|t| crate::buffers::copy_tensor(&t)))
            }
            Some(v) => Err(RtError::msg(format!(
                "input {i} should be a tensor, found a {}",
                v.kind()
            ))),
            None => Err(RtError::msg(format!("required input {i} is missing"))),
        }
    }
    /// All present tensor inputs (for variadic ops such as Concat/Sum).
    pub fn tensors(&self) -> Result<Vec<&Tensor>> {
        (0..self.len())
            .filter(|&i| self.value(i).is_some())
            .map(|i| self.tensor(i))
            .collect()
    }
}

/// What a kernel knows about where it runs.
pub struct OpCtx<'a> {
    pub node: &'a Node,
    /// Opset version of the node's domain imported by the model.
    pub opset: i64,
    pub threads: usize,
    pub(crate) host: &'a dyn StepHost,
    pub(crate) node_index: usize,
}

/// What a running kernel may ask of the executor that runs it: its subgraphs, which of its
/// inputs are constant, its per-node cache. A trait (implemented by the executor's `Frame`) so
/// that this kernel interface does not depend on the executor module.
pub(crate) trait StepHost: Sync {
    fn run_subgraph(
        &self,
        node_index: usize,
        attr: &str,
        inputs: Vec<Value>,
        threads: usize,
    ) -> Result<Vec<Value>>;
    fn subgraph_input_count(&self, node_index: usize, attr: &str) -> Option<usize>;
    fn input_is_const(&self, node_index: usize, input: usize) -> bool;
    fn step_cache(&self, node_index: usize) -> &OnceLock<Arc<dyn Any + Send + Sync>>;
    fn prepack_weights(&self) -> bool;
}

impl OpCtx<'_> {
    /// Runs the subgraph held by attribute `attr` with the given inputs (in the subgraph's input
    /// order); values of enclosing graphs are visible to it.
    pub fn run_subgraph(&self, attr: &str, inputs: Vec<Value>) -> Result<Vec<Value>> {
        self.host
            .run_subgraph(self.node_index, attr, inputs, self.threads)
    }
    /// Whether input `i` is a constant of the running graph (an initializer that no feed can
    /// replace): data derived only from constant inputs may be cached with [`OpCtx::cached`].
    pub fn input_is_const(&self, i: usize) -> bool {
        self.host.input_is_const(self.node_index, i)
    }
    /// Whether the session keeps constant weights packed across runs
    /// ([`crate::Session::set_weight_prepacking`]): a kernel may then cache a packed copy of
    /// a constant input with [`OpCtx::cached`]; otherwise it packs per call into scratch.
    pub fn prepack_weights(&self) -> bool {
        self.host.prepack_weights()
    }

    /// Data this node derives from its constant inputs (prepacked weights, requantization
    /// multipliers), built by `init` on the first run and shared by every later run of the
    /// same plan. `init` must depend only on inputs for which [`OpCtx::input_is_const`] holds
    /// and on attributes; a cached value of another type is an error, not a panic.
    pub fn cached<T: Any + Send + Sync>(&self, init: impl FnOnce() -> Result<T>) -> Result<Arc<T>> {
        let cell = self.host.step_cache(self.node_index);
        let any = match cell.get() {
            Some(v) => v.clone(),
            None => {
                let v: Arc<dyn Any + Send + Sync> = Arc::new(init()?);
                // Two threads may race to build it; either result is the same, keep the first.
                let _ = cell.set(v.clone());
                cell.get().cloned().unwrap_or(v)
            }
        };
        any.downcast::<T>()
            .map_err(|_| RtError::msg("node cache holds data of another type"))
    }
    /// Number of inputs the subgraph at `attr` declares.
    pub fn subgraph_input_count(&self, attr: &str) -> Option<usize> {
        self.host.subgraph_input_count(self.node_index, attr)
    }
}

pub type KernelFn = fn(&OpCtx, Inputs) -> Result<Vec<Value>>;

#[derive(Clone)]
pub struct OpEntry {
    pub domain: &'static str,
    pub name: &'static str,
    /// Opset versions of the domain this kernel implements.
    pub since: i64,
    pub until: i64,
    pub kernel: KernelFn,
}

/// The kernels npuc can run, keyed by (domain, op) with the opset range each implements.
///
/// The core runtime registers the ONNX ops and the `npuc` ops of optimized and quantized
/// graphs ([`Registry::with_defaults`]). Ops that need other crates (the LLM/GGML ops of
/// `npuc-llm`, the ONNX ops backed by image codecs or a regex engine in `npuc-ops-ext`) come
/// as [`OpPack`]s that their crate hands to [`register_pack`]; sessions then see them.
#[derive(Clone, Default)]
pub struct Registry {
    ops: BTreeMap<(String, String), Vec<OpEntry>>,
    packs: Vec<&'static str>,
}

/// A named group of kernels that a crate outside the runtime registers (see [`register_pack`]).
#[derive(Clone, Copy, Debug)]
pub struct OpPack {
    /// Names the pack in listings and makes registration idempotent.
    pub name: &'static str,
    pub register: fn(&mut Registry),
}

/// The newest default-domain opset npuc knows (onnx 1.22.0 defines opset 23... tests go to 27 for
/// some ops; kernels register the ranges they implement).
pub const MAX_OPSET: i64 = 27;

impl Registry {
    /// The kernels of the core runtime (ONNX ops and the `npuc` ops of optimized and quantized
    /// graphs), without any pack.
    pub fn with_defaults() -> Registry {
        let mut r = Registry::default();
        crate::ops::register_all(&mut r);
        r
    }
    /// Adds a pack's kernels; a pack already added (same name) is not added twice.
    pub fn register_pack(&mut self, pack: OpPack) {
        if self.packs.contains(&pack.name) {
            return;
        }
        self.packs.push(pack.name);
        (pack.register)(self);
    }
    /// Names of the packs added, in registration order.
    pub fn packs(&self) -> &[&'static str] {
        &self.packs
    }
    /// Registers an op defined by npuc (opset 1 of its domain) with its kernel, and makes its
    /// definition (inputs, attributes, shape inference) known to `npuc_ir::infer`.
    pub fn define(&mut self, def: &'static OpDef, kernel: KernelFn) {
        npuc_ir::opdef::register(&[def]);
        self.add_range(def.domain, def.name, 1, 1, kernel);
    }
    /// Registers a kernel for ops of the default domain for opsets `since..=MAX_OPSET`.
    pub fn add(&mut self, name: &'static str, since: i64, kernel: KernelFn) {
        self.add_range("", name, since, MAX_OPSET, kernel);
    }
    pub fn add_range(
        &mut self,
        domain: &'static str,
        name: &'static str,
        since: i64,
        until: i64,
        kernel: KernelFn,
    ) {
        self.ops
            .entry((domain.to_string(), name.to_string()))
            .or_default()
            .push(OpEntry {
                domain,
                name,
                since,
                until,
                kernel,
            });
    }
    pub fn find(&self, domain: &str, name: &str, opset: i64) -> Option<&OpEntry> {
        self.ops
            .get(&(domain.to_string(), name.to_string()))?
            .iter()
            .find(|e| opset >= e.since && opset <= e.until)
    }
    pub fn has(&self, domain: &str, name: &str) -> bool {
        self.ops
            .contains_key(&(domain.to_string(), name.to_string()))
    }
    pub fn entries(&self) -> impl Iterator<Item = &OpEntry> {
        self.ops.values().flatten()
    }
}

/// The registry sessions and passes use: the core kernels plus every pack registered so far.
/// A [`register_pack`] call replaces it; a plan keeps the registry it was built with.
static CURRENT: RwLock<Option<&'static Registry>> = RwLock::new(None);

pub fn registry() -> &'static Registry {
    if let Some(r) = *CURRENT.read().unwrap_or_else(|e| e.into_inner()) {
        return r;
    }
    let mut w = CURRENT.write().unwrap_or_else(|e| e.into_inner());
    // Another thread may have initialized it between the two locks.
    match *w {
        Some(r) => r,
        None => {
            let r: &'static Registry = Box::leak(Box::new(Registry::with_defaults()));
            *w = Some(r);
            r
        }
    }
}

/// Makes a pack's kernels visible to every session built afterwards (and to constant folding).
/// Registering the same pack again does nothing, so every entry point that needs a pack may
/// call this. Each new pack leaks one copy of the registry (a plan may still hold the previous
/// one): packs are registered a few times per process, not per session.
pub fn register_pack(pack: OpPack) {
    let current = registry();
    if current.packs.contains(&pack.name) {
        return;
    }
    let mut w = CURRENT.write().unwrap_or_else(|e| e.into_inner());
    let current: &Registry = w.unwrap_or(current);
    if current.packs.contains(&pack.name) {
        return;
    }
    let mut next = current.clone();
    next.register_pack(pack);
    *w = Some(Box::leak(Box::new(next)));
}
