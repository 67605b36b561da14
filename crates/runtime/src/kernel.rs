//! The kernel interface: what an op implementation receives and returns, and the registry
//! that maps (domain, op, opset) to kernels.

use crate::error::{Result, RtError};
use crate::exec::{Frame, Plan};
use crate::value::Value;
use npuc_ir::{Node, Tensor};
use std::any::Any;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

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
    pub(crate) plan: &'a Plan,
    pub(crate) node_index: usize,
    pub(crate) frame: &'a Frame<'a>,
}

impl OpCtx<'_> {
    /// Runs the subgraph held by attribute `attr` with the given inputs (in the subgraph's input
    /// order); values of enclosing graphs are visible to it.
    pub fn run_subgraph(&self, attr: &str, inputs: Vec<Value>) -> Result<Vec<Value>> {
        let sub = self
            .plan
            .subplan(self.node_index, attr)
            .ok_or_else(|| RtError::msg(format!("attribute '{attr}' holds no graph")))?;
        sub.run_with_outer(inputs, Some(self.frame), self.threads)
    }
    /// Whether input `i` is a constant of the running graph (an initializer that no feed can
    /// replace): data derived only from constant inputs may be cached with [`OpCtx::cached`].
    pub fn input_is_const(&self, i: usize) -> bool {
        self.plan.input_is_const(self.node_index, i)
    }

    /// Data this node derives from its constant inputs (prepacked weights, requantization
    /// multipliers), built by `init` on the first run and shared by every later run of the
    /// same plan. `init` must depend only on inputs for which [`OpCtx::input_is_const`] holds
    /// and on attributes; a cached value of another type is an error, not a panic.
    pub fn cached<T: Any + Send + Sync>(&self, init: impl FnOnce() -> Result<T>) -> Result<Arc<T>> {
        let cell = self.plan.step_cache(self.node_index);
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
        self.plan
            .subplan(self.node_index, attr)
            .map(|p| p.input_count())
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

#[derive(Default)]
pub struct Registry {
    ops: BTreeMap<(String, String), Vec<OpEntry>>,
}

/// The newest default-domain opset npuc knows (onnx 1.22.0 defines opset 23... tests go to 27 for
/// some ops; kernels register the ranges they implement).
pub const MAX_OPSET: i64 = 27;

impl Registry {
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

pub fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| {
        let mut r = Registry::default();
        crate::ops::register_all(&mut r);
        r
    })
}
