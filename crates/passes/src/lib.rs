//! Graph optimization passes and the pass manager.
//!
//! Every pass rewrites a [`Model`] in place and reports how many rewrites it made. The
//! [`PassManager`] runs a pipeline of passes repeatedly until none of them changes anything
//! (bounded by [`OptimizeOptions::max_iterations`]), so that one pass can expose work for
//! another (constant folding exposes identities, identity removal exposes fusions, ...).
//!
//! Passes are conservative: a pattern they do not fully understand (unknown ranks, non-constant
//! parameters, values read by several nodes, graph outputs in the middle of a pattern, subgraph
//! captures) is left alone. Graph output names are always preserved.
//!
//! A pass never edits the model directly: it plans its rewrite as a [`GraphPatch`] and applies
//! it through the [`Rewriter`] it is given. With verification on (debug builds, this crate's
//! tests, `NPUC_VERIFY_PASSES=1`, or [`PassManager::verify_each`]), the pass manager checks the
//! model with [`npuc_ir::verify_model`] after every pass and names the pass that broke it.
#![forbid(unsafe_code)]

pub mod passes;
pub mod patch;
pub mod quant_lower;
pub mod util;

pub use patch::{GraphPatch, Rewriter};
pub use quant_lower::lower_quantized;

use npuc_ir::opdef::RegisteredOps;
use npuc_ir::{Model, OpContracts};
use std::collections::HashSet;
use std::time::Instant;

/// What a pass changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassStats {
    /// Number of rewrites (nodes removed, fused or replaced).
    pub changes: usize,
}

impl PassStats {
    pub fn new(changes: usize) -> PassStats {
        PassStats { changes }
    }
}

/// Errors of the optimizer. Passes skip what they do not understand, so an error means the
/// model itself is malformed (or a rewrite broke an invariant), and it names the node.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("pass '{pass}': node '{node}': {msg}")]
    Node {
        pass: String,
        node: String,
        msg: String,
    },
    #[error("pass '{pass}': {msg}")]
    Graph { pass: String, msg: String },
    /// The verifier found problems after the pass that were not there before it.
    #[error("pass '{pass}' left an invalid graph: {}", problems.join("; "))]
    Invalid { pass: String, problems: Vec<String> },
}

/// A graph rewrite.
pub trait Pass {
    /// A short stable name (shown by `--print-passes`).
    fn name(&self) -> &'static str;
    /// Rewrites `rw.model()` by applying [`GraphPatch`]es through `rw`; returns how much
    /// changed (0 = nothing to do).
    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError>;
}

/// Whether passes are verified when nothing says otherwise: in debug builds, in this crate's
/// own tests, and when the environment sets `NPUC_VERIFY_PASSES` (to anything but `0`), which
/// is how `--release` test runs turn it on.
pub fn verify_by_default() -> bool {
    cfg!(debug_assertions)
        || cfg!(test)
        || std::env::var("NPUC_VERIFY_PASSES").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Checks models between passes: the problems [`npuc_ir::verify_model`] finds that were not
/// already present in the model the optimizer was given (a malformed input is not a pass's
/// fault; what a pass adds to it is).
pub struct PassVerifier<'c> {
    contracts: &'c dyn OpContracts,
    baseline: HashSet<String>,
}

impl<'c> PassVerifier<'c> {
    /// Records the problems `model` already has.
    pub fn new(model: &Model, contracts: &'c dyn OpContracts) -> PassVerifier<'c> {
        let baseline = npuc_ir::verify_model(model, contracts)
            .iter()
            .map(|e| e.to_string())
            .collect();
        PassVerifier {
            contracts,
            baseline,
        }
    }

    /// Checks `model` after `pass` ran: an error naming the pass and every new problem.
    pub fn check(&self, pass: &str, model: &Model) -> Result<(), PassError> {
        let problems: Vec<String> = npuc_ir::verify_model(model, self.contracts)
            .iter()
            .map(|e| e.to_string())
            .filter(|e| !self.baseline.contains(e))
            .collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(PassError::Invalid {
                pass: pass.to_string(),
                problems,
            })
        }
    }
}

/// Runs one pass on `model` outside a pipeline, verified when [`verify_by_default`] says so.
pub fn apply_pass(pass: &dyn Pass, model: &mut Model) -> Result<PassStats, PassError> {
    run_verified(pass.name(), model, verify_by_default(), |rw| pass.run(rw))
}

/// Runs `f` as the pass `name` on `model`, then (when `verify`) checks that it left a valid
/// graph.
pub(crate) fn run_verified<T>(
    name: &str,
    model: &mut Model,
    verify: bool,
    f: impl FnOnce(&mut Rewriter<'_>) -> Result<T, PassError>,
) -> Result<T, PassError> {
    let verifier = verify.then(|| PassVerifier::new(model, &RegisteredOps));
    let mut rw = Rewriter::new(model);
    let out = f(&mut rw)?;
    let edited = rw.edited();
    if let Some(v) = verifier.filter(|_| edited) {
        v.check(name, model)?;
    }
    Ok(out)
}

/// Options of [`optimize`].
#[derive(Clone, Debug)]
pub struct OptimizeOptions {
    /// Upper bound on pipeline repetitions while looking for a fixed point.
    pub max_iterations: usize,
    /// Constant folding never creates a tensor larger than this (in bytes) unless it is no
    /// larger than the folded node's constant inputs together (weight transforms stay folded,
    /// `ConstantOfShape`/`Expand`/`Tile` blow-ups stay ops).
    pub max_fold_bytes: usize,
    /// Enables the fusions that produce `npuc`-domain ops (FusedConv/FusedGemm/FusedMatMul).
    pub fuse: bool,
    /// Names of passes to skip.
    pub disable: Vec<String>,
    /// Names of opt-in passes to run (see [`OPT_IN_PASSES`]).
    pub enable: Vec<String>,
}

/// Passes that are correct but not run by default because they do not pay off everywhere:
/// `attention-fusion` (the fused Attention kernel measured ~10% slower than MatMul + Softmax +
/// MatMul on ViT-S on this machine).
pub const OPT_IN_PASSES: &[&str] = &["attention-fusion"];

impl Default for OptimizeOptions {
    fn default() -> Self {
        OptimizeOptions {
            max_iterations: 8,
            max_fold_bytes: 1 << 20,
            fuse: true,
            disable: vec![],
            enable: vec![],
        }
    }
}

/// One pass run that changed something: what it did to the graph.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassRecord {
    /// The pass name (as `--disable-pass` takes it).
    pub pass: String,
    /// Pipeline iteration (1-based) it ran in.
    pub iteration: usize,
    /// Rewrites the pass reported.
    pub changes: usize,
    /// Node count before and after the pass.
    pub nodes_before: usize,
    pub nodes_after: usize,
    /// Per op type (`domain::Op` for non-default domains): how many nodes of it the pass
    /// added (positive) or removed (negative); ops whose count did not change are left out.
    pub ops_delta: Vec<(String, i64)>,
}

impl std::fmt::Display for PassRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (iteration {}): {} change{}, nodes {} -> {}",
            self.pass,
            self.iteration,
            self.changes,
            if self.changes == 1 { "" } else { "s" },
            self.nodes_before,
            self.nodes_after
        )?;
        if !self.ops_delta.is_empty() {
            let parts: Vec<String> = self
                .ops_delta
                .iter()
                .map(|(op, d)| format!("{d:+} {op}"))
                .collect();
            write!(f, " [{}]", parts.join(", "))?;
        }
        Ok(())
    }
}

/// What the pass manager is doing, for progress display.
#[derive(Clone, Copy, Debug)]
pub enum PassEvent<'a> {
    /// `pass` starts in pipeline iteration `iteration` (1-based); `index` of `count` passes.
    Start {
        pass: &'a str,
        iteration: usize,
        index: usize,
        count: usize,
    },
    /// A pass run changed the graph.
    Changed(&'a PassRecord),
}

/// Op-type histogram of the top-level graph (what `--print-passes` reports deltas of).
fn op_histogram(model: &Model) -> std::collections::BTreeMap<String, i64> {
    let mut h = std::collections::BTreeMap::new();
    for n in &model.graph.nodes {
        let key = if n.domain.is_empty() {
            n.op_type.clone()
        } else {
            format!("{}::{}", n.domain, n.op_type)
        };
        *h.entry(key).or_insert(0) += 1;
    }
    h
}

fn ops_delta(
    before: &std::collections::BTreeMap<String, i64>,
    after: &std::collections::BTreeMap<String, i64>,
) -> Vec<(String, i64)> {
    let mut out = vec![];
    for k in before
        .keys()
        .chain(after.keys().filter(|k| !before.contains_key(*k)))
    {
        let d = after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0);
        if d != 0 {
            out.push((k.clone(), d));
        }
    }
    // Removals first, then additions, each by size: the pattern a fusion consumed reads
    // before what it produced.
    out.sort_by_key(|(k, d)| (d.signum(), -d.abs(), k.clone()));
    out
}

/// What [`optimize`] did.
#[derive(Clone, Debug, Default)]
pub struct OptimizeReport {
    /// (pass name, changes) for every pass run that changed something, in order.
    pub passes: Vec<(String, usize)>,
    /// The same runs with their effect on the graph (node counts, op-type deltas).
    pub records: Vec<PassRecord>,
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub iterations: usize,
    pub millis: u128,
}

impl OptimizeReport {
    /// Total changes per pass name, summed over iterations, in first-run order.
    pub fn totals(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = vec![];
        for (n, c) in &self.passes {
            match out.iter_mut().find(|(m, _)| m == n) {
                Some(e) => e.1 += c,
                None => out.push((n.clone(), *c)),
            }
        }
        out
    }
}

impl std::fmt::Display for OptimizeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (n, c) in self.totals() {
            writeln!(f, "  {n:<24} {c}")?;
        }
        write!(
            f,
            "nodes: {} -> {} ({} iterations, {} ms)",
            self.nodes_before, self.nodes_after, self.iterations, self.millis
        )
    }
}

/// Runs a pipeline of passes to a fixed point.
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
    /// Passes run once after the fixed point (lowerings the other passes cannot see through,
    /// e.g. `layout-nhwc`).
    late: Vec<Box<dyn Pass>>,
    max_iterations: usize,
    /// Check the model after every pass (see [`verify_by_default`]).
    verify: bool,
    /// Op contracts the checks apply (default: every registered `OpDef`, [`RegisteredOps`]).
    contracts: Box<dyn OpContracts>,
}

impl PassManager {
    pub fn new(max_iterations: usize) -> PassManager {
        PassManager {
            passes: vec![],
            late: vec![],
            max_iterations: max_iterations.max(1),
            verify: verify_by_default(),
            contracts: Box::new(RegisteredOps),
        }
    }

    /// Turns checking the model after every pass on or off (default: [`verify_by_default`]).
    pub fn verify_each(mut self, on: bool) -> PassManager {
        self.verify = on;
        self
    }

    /// The op contracts the between-pass checks apply to every node.
    pub fn with_contracts(mut self, contracts: Box<dyn OpContracts>) -> PassManager {
        self.contracts = contracts;
        self
    }

    pub fn add(&mut self, p: Box<dyn Pass>) {
        self.passes.push(p);
    }

    /// Adds a pass that runs once after the fixed point of the others.
    pub fn add_late(&mut self, p: Box<dyn Pass>) {
        self.late.push(p);
    }

    /// The standard pipeline for `opts`.
    pub fn standard(opts: &OptimizeOptions) -> PassManager {
        use passes::*;
        let mut pm = PassManager::new(opts.max_iterations);
        let mut all: Vec<Box<dyn Pass>> = vec![
            Box::new(const_fold::ConstFold {
                max_bytes: opts.max_fold_bytes,
                keep_dequantize: true,
            }),
            Box::new(identity::IdentityElim),
            Box::new(reshape::ReshapeFold),
            Box::new(cse::Cse),
            Box::new(dce::Dce),
            Box::new(conv_fold::ConvBnFold),
            Box::new(conv_fold::ConvAffineFold),
            Box::new(gelu::GeluFusion),
            Box::new(norm_fusion::LayerNormFusion),
            Box::new(norm_fusion::RmsNormFusion),
        ];
        if opts.enable.iter().any(|e| e == "attention-fusion") {
            all.push(Box::new(attention_fusion::AttentionFusion));
        }
        if opts.fuse {
            all.push(Box::new(fuse::MatMulBiasFusion));
            all.push(Box::new(fuse::ActivationFusion));
        }
        for p in all {
            if !opts.disable.iter().any(|d| d == p.name()) {
                pm.add(p);
            }
        }
        // After the fixed point: a binary op with an activation is the last fusion its nodes
        // can take, and folding a conv's affine Mul/Add or a MatMul's bias comes first.
        if opts.fuse && !opts.disable.iter().any(|d| d == "binary-activation-fusion") {
            pm.add_late(Box::new(fuse::BinaryActivationFusion));
        }
        let layout_on = !OPT_IN_PASSES.contains(&"layout-nhwc")
            || opts.enable.iter().any(|e| e == "layout-nhwc");
        if opts.fuse && layout_on && !opts.disable.iter().any(|d| d == "layout-nhwc") {
            pm.add_late(Box::new(layout::LayoutNhwc));
        }
        pm
    }

    /// Names of the passes in pipeline order.
    pub fn pass_names(&self) -> Vec<&'static str> {
        self.passes
            .iter()
            .chain(&self.late)
            .map(|p| p.name())
            .collect()
    }

    /// Runs the pipeline until no pass changes anything (or the iteration bound is hit),
    /// then a final dead-code sweep.
    pub fn run(&self, model: &mut Model) -> Result<OptimizeReport, PassError> {
        self.run_observed(model, &mut |_| {})
    }

    /// [`PassManager::run`], telling `observe` when each pass starts and what each pass run
    /// that changed something did (for progress bars and `--print-passes`).
    pub fn run_observed(
        &self,
        model: &mut Model,
        observe: &mut dyn FnMut(PassEvent),
    ) -> Result<OptimizeReport, PassError> {
        let t0 = Instant::now();
        let mut report = OptimizeReport {
            nodes_before: model.graph.nodes.len(),
            ..Default::default()
        };
        let dce = passes::dce::Dce;
        let count = self.passes.len();
        let mut hist = op_histogram(model);
        let verifier = self
            .verify
            .then(|| PassVerifier::new(model, self.contracts.as_ref()));
        let mut run_one = |p: &dyn Pass,
                           it: usize,
                           index: usize,
                           model: &mut Model,
                           report: &mut OptimizeReport|
         -> Result<usize, PassError> {
            observe(PassEvent::Start {
                pass: p.name(),
                iteration: it,
                index,
                count,
            });
            let nodes_before = model.graph.nodes.len();
            let mut rw = Rewriter::new(model);
            let st = p.run(&mut rw)?;
            let edited = rw.edited();
            if let Some(v) = verifier.as_ref().filter(|_| edited) {
                v.check(p.name(), model)?;
            }
            if st.changes > 0 {
                let after = op_histogram(model);
                let rec = PassRecord {
                    pass: p.name().to_string(),
                    iteration: it,
                    changes: st.changes,
                    nodes_before,
                    nodes_after: model.graph.nodes.len(),
                    ops_delta: ops_delta(&hist, &after),
                };
                hist = after;
                observe(PassEvent::Changed(&rec));
                report.passes.push((rec.pass.clone(), rec.changes));
                report.records.push(rec);
            }
            Ok(st.changes)
        };
        for it in 0..self.max_iterations {
            report.iterations = it + 1;
            let mut changed = 0;
            for (i, p) in self.passes.iter().enumerate() {
                changed += run_one(p.as_ref(), it + 1, i, model, &mut report)?;
            }
            if changed == 0 {
                break;
            }
        }
        let last = report.iterations;
        for (i, p) in self.late.iter().enumerate() {
            run_one(p.as_ref(), last, count + i, model, &mut report)?;
        }
        run_one(&dce, last, count, model, &mut report)?;
        report.nodes_after = model.graph.nodes.len();
        report.millis = t0.elapsed().as_millis();
        Ok(report)
    }
}

/// Passes that exist by name but are not part of the standard pipeline (they change how a
/// graph executes, not only its form): `quant-lower`.
pub fn pass_by_name(name: &str) -> Option<Box<dyn Pass>> {
    match name {
        "quant-lower" => Some(Box::new(quant_lower::QuantLower)),
        _ => None,
    }
}

/// Optimizes `model` in place with the standard pipeline.
pub fn optimize(model: &mut Model, opts: &OptimizeOptions) -> Result<OptimizeReport, PassError> {
    // Building the kernel registry makes the `npuc` op definitions known to inference, so the
    // passes see the same shapes whatever ran before them in this process.
    npuc_runtime::registry();
    PassManager::standard(opts).run(model)
}
