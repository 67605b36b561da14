//! ONNX compile (`npuc compile`): import, bind shapes, inline functions, verify, optimize,
//! plan memory, serialize into one `.npuc` artifact holding every input model as a named graph.

use crate::Progress;
use anyhow::{anyhow, bail, Context, Result};
use npuc_format::{ArtifactWriter, GraphInfo, Target};
use npuc_ir::{Dim, Model, TypeInfo};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Debug, Default)]
pub struct CompileOptions {
    /// `name -> shape` bindings for graph inputs.
    pub input_shapes: HashMap<String, Vec<usize>>,
    /// Symbolic dimension bindings.
    pub dims: HashMap<String, usize>,
    pub target: Option<String>,
    pub optimize: bool,
    /// Optimization passes to skip (by name, as `--print-passes` shows them).
    pub disable_passes: Vec<String>,
    /// Opt-in passes to run (`--enable-pass`).
    pub enable_passes: Vec<String>,
}

/// What compiling one graph did.
#[derive(Debug)]
pub struct GraphSummary {
    pub name: String,
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub arena_bytes: u64,
    /// (pass, total changes) per pass that changed something, in first-run order.
    pub pass_log: Vec<(String, usize)>,
    /// Every pass run that changed something, with node counts and op-type deltas
    /// (what `--print-passes` prints).
    pub pass_records: Vec<npuc_passes::PassRecord>,
}

/// What [`compile`] did.
#[derive(Debug)]
pub struct CompileSummary {
    pub graphs: Vec<GraphSummary>,
    pub weight_bytes_unique: u64,
    pub weight_bytes_referenced: u64,
    pub file_bytes: u64,
    pub seconds: f64,
}

impl CompileSummary {
    /// The one-line summary `npuc compile` ends with: graphs, nodes before/after optimization,
    /// weight bytes (unique vs referenced), arena size (largest graph), file size, time taken.
    pub fn line(&self, out: &Path) -> String {
        let before: usize = self.graphs.iter().map(|g| g.nodes_before).sum();
        let after: usize = self.graphs.iter().map(|g| g.nodes_after).sum();
        let arena = self.graphs.iter().map(|g| g.arena_bytes).max().unwrap_or(0);
        format!(
            "compiled {} graph{} into {} ({:.2} MB): nodes {before} -> {after}, weights {:.2} MB unique / {:.2} MB referenced, arena {:.2} MB, {:.2} s",
            self.graphs.len(),
            if self.graphs.len() == 1 { "" } else { "s" },
            out.display(),
            self.file_bytes as f64 / 1e6,
            self.weight_bytes_unique as f64 / 1e6,
            self.weight_bytes_referenced as f64 / 1e6,
            arena as f64 / 1e6,
            self.seconds
        )
    }
}

/// Step timing over a [`Progress`]: each finished step's line gets its duration appended.
pub(crate) struct Steps<'a> {
    progress: &'a mut dyn Progress,
    step_start: Instant,
}

impl<'a> Steps<'a> {
    pub(crate) fn new(progress: &'a mut dyn Progress) -> Steps<'a> {
        Steps {
            progress,
            step_start: Instant::now(),
        }
    }

    /// Starts a step; `msg` says what it does.
    pub(crate) fn start(&mut self, msg: &str) {
        self.step_start = Instant::now();
        self.progress.start(msg);
    }

    /// Updates the live message of the current step.
    pub(crate) fn update(&mut self, msg: &dyn Fn() -> String) {
        self.progress.update(msg);
    }

    /// Ends the current step with a line (its duration appended).
    pub(crate) fn done(&mut self, msg: &str) {
        let ms = self.step_start.elapsed().as_secs_f64() * 1e3;
        self.progress.done(&format!("{msg} ({ms:.0} ms)"));
    }

    /// A message outside the step lines (warnings).
    pub(crate) fn note(&mut self, msg: &str) {
        self.progress.note(msg);
    }
}

/// Checks `--disable-pass`/`--enable-pass` names: every disabled pass must exist, every enabled
/// one must be opt-in.
pub fn check_pass_names(disable: &[String], enable: &[String]) -> Result<()> {
    if let Some(e) = enable
        .iter()
        .find(|e| !npuc_passes::OPT_IN_PASSES.contains(&e.as_str()))
    {
        bail!(
            "--enable-pass {e}: not an opt-in pass (opt-in passes: {})",
            npuc_passes::OPT_IN_PASSES.join(", ")
        );
    }
    let known = npuc_passes::PassManager::standard(&Default::default()).pass_names();
    if let Some(d) = disable
        .iter()
        .find(|d| !known.contains(&d.as_str()) && !npuc_passes::OPT_IN_PASSES.contains(&d.as_str()))
    {
        bail!(
            "--disable-pass {d}: no such pass (passes: {})",
            known.join(", ")
        );
    }
    Ok(())
}

/// Runs the standard pass pipeline (with `disable`/`enable`), reporting each pass to
/// `observe`.
pub fn optimize_observed(
    m: &mut Model,
    disable: &[String],
    enable: &[String],
    observe: &mut dyn FnMut(npuc_passes::PassEvent),
) -> Result<npuc_passes::OptimizeReport> {
    check_pass_names(disable, enable)?;
    let opts = npuc_passes::OptimizeOptions {
        disable: disable.to_vec(),
        enable: enable.to_vec(),
        ..Default::default()
    };
    let pm = npuc_passes::PassManager::standard(&opts);
    Ok(pm.run_observed(m, observe)?)
}

/// Runs the standard optimization pipeline (what `npuc compile` runs); returns (pass name,
/// total changes) per pass that changed something.
pub fn optimize(
    m: &mut Model,
    disable: &[String],
    enable: &[String],
) -> Result<Vec<(String, usize)>> {
    Ok(optimize_observed(m, disable, enable, &mut |_| {})?.totals())
}

/// Input-shape bindings (`name -> shape`) and symbolic-dimension bindings (`sym -> size`).
pub type Bindings = (HashMap<String, Vec<usize>>, HashMap<String, usize>);

pub fn parse_bindings(input_shape: &[String], dim: &[String]) -> Result<Bindings> {
    let mut shapes = HashMap::new();
    for s in input_shape {
        let (n, v) = s
            .split_once('=')
            .ok_or_else(|| anyhow!("--input-shape expects NAME=SHAPE, got '{s}'"))?;
        let shape = npuc_ir::parse_shape(v).map_err(|e| anyhow!(e))?;
        // A shape whose element count (or byte size) does not fit in memory's address range
        // is refused here, not as an allocator abort later.
        if shape
            .iter()
            .try_fold(8usize, |acc, &d| acc.checked_mul(d))
            .is_none_or(|bytes| bytes > isize::MAX as usize)
        {
            bail!("--input-shape {n}={v}: {shape:?} has more elements than can be addressed");
        }
        if shapes.insert(n.to_string(), shape).is_some() {
            bail!("--input-shape {n} is given twice; give each input once");
        }
    }
    let mut dims = HashMap::new();
    for s in dim {
        let (n, v) = s
            .split_once('=')
            .ok_or_else(|| anyhow!("--dim expects SYM=N, got '{s}'"))?;
        let size = v
            .parse::<usize>()
            .map_err(|_| anyhow!("--dim {n}: '{v}' is not a number"))?;
        if dims.insert(n.to_string(), size).is_some() {
            bail!("--dim {n} is given twice; give each dimension once");
        }
    }
    Ok((shapes, dims))
}

/// Applies user bindings to a model's declared input types; errors name unknown inputs.
pub fn bind_inputs(
    m: &mut Model,
    shapes: &HashMap<String, Vec<usize>>,
    dims: &HashMap<String, usize>,
) -> Result<()> {
    for name in shapes.keys() {
        if !m.graph.inputs.iter().any(|i| &i.name == name) {
            bail!(
                "--input-shape: the model has no input '{name}'; its inputs are: {}",
                m.graph
                    .inputs
                    .iter()
                    .map(|i| i.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    for vi in &mut m.graph.inputs {
        if let Some(TypeInfo::Tensor { shape, .. }) = &mut vi.ty {
            if let Some(s) = shapes.get(&vi.name) {
                if let Some(old) = shape {
                    if old.len() != s.len() {
                        bail!(
                            "--input-shape {}: rank {} given, the model declares rank {}",
                            vi.name,
                            s.len(),
                            old.len()
                        );
                    }
                    for (i, (o, &n)) in old.iter().zip(s).enumerate() {
                        if let Dim::Fixed(f) = o {
                            if *f != n {
                                bail!("--input-shape {}: dimension {i} is fixed to {f} by the model, {n} given", vi.name);
                            }
                        }
                    }
                }
                *shape = Some(s.iter().map(|&d| Dim::Fixed(d)).collect());
            } else if let Some(old) = shape {
                for d in old.iter_mut() {
                    if let Dim::Symbolic(sym) = d {
                        if let Some(&n) = dims.get(sym) {
                            *d = Dim::Fixed(n);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Peak bytes of intermediate tensors alive at once, executing nodes in order and freeing each
/// value after its last reader (the executor's policy). Values of unknown size count as 0;
/// their names are returned for the caller to report.
pub fn plan_arena(m: &Model, types: &HashMap<String, TypeInfo>) -> (u64, Vec<String>) {
    let g = &m.graph;
    let Ok(order) = g.topo_order(&HashSet::new()) else {
        return (0, vec![]);
    };
    let keep: HashSet<&str> = g
        .inputs
        .iter()
        .map(|v| v.name.as_str())
        .chain(g.initializers.iter().map(|i| i.name.as_str()))
        .collect();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (step, &ni) in order.iter().enumerate() {
        for i in &g.nodes[ni].inputs {
            last.insert(i.as_str(), step);
        }
    }
    let outputs: HashSet<&str> = g.outputs.iter().map(|o| o.name.as_str()).collect();
    let size = |name: &str| -> Option<u64> {
        match types.get(name)? {
            TypeInfo::Tensor {
                dtype: Some(d),
                shape: Some(s),
            } => {
                let mut n: u64 = d.size() as u64;
                for dim in s {
                    match dim {
                        Dim::Fixed(x) => n = n.checked_mul(*x as u64)?,
                        _ => return None,
                    }
                }
                Some(n.next_multiple_of(64))
            }
            _ => None,
        }
    };
    let (mut live, mut peak, mut unknown) = (0u64, 0u64, vec![]);
    let mut frees: HashMap<usize, Vec<u64>> = HashMap::new();
    for (step, &ni) in order.iter().enumerate() {
        for o in g.nodes[ni].outputs.iter().filter(|o| !o.is_empty()) {
            match size(o) {
                Some(b) => {
                    live += b;
                    let end = if outputs.contains(o.as_str()) {
                        usize::MAX
                    } else {
                        last.get(o.as_str()).copied().unwrap_or(step)
                    };
                    frees.entry(end).or_default().push(b);
                }
                None => unknown.push(o.clone()),
            }
        }
        peak = peak.max(live);
        if let Some(fs) = frees.remove(&step) {
            live -= fs.iter().sum::<u64>();
        }
    }
    let _ = keep;
    (peak, unknown)
}

/// Whether a type is a tensor of known dtype and fully fixed shape.
fn is_static(t: &TypeInfo) -> bool {
    matches!(t, TypeInfo::Tensor { dtype: Some(_), shape: Some(s) } if s.iter().all(|d| matches!(d, Dim::Fixed(_))))
}

/// Imports an ONNX model for compiling: load, bind input shapes, inline model-local functions,
/// verify the graph, and refuse unsupported ops (every offending node named) now rather than
/// at run time.
pub fn load_verified(path: &Path, opts: &CompileOptions) -> Result<Model> {
    crate::register_ops();
    let mut m = npuc_onnx::load_model(path)?;
    bind_inputs(&mut m, &opts.input_shapes, &opts.dims)?;
    m.graph = npuc_runtime::exec::inline_functions(&m.graph, &m.functions)?;
    m.functions.clear();
    let problems = m.graph.verify(&HashSet::new());
    if !problems.is_empty() {
        bail!(
            "'{}' is not a valid graph:\n  {}",
            path.display(),
            problems
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }
    npuc_runtime::Plan::for_model(&m).map_err(|e| anyhow!("'{}': {e}", path.display()))?;
    check_runnable(&m).map_err(|e| anyhow!("'{}': {e}", path.display()))?;
    Ok(m)
}

/// The checks `run` makes before a node runs, made for the whole graph before compiling, so
/// that no artifact is written for a graph that cannot run: every node's inputs agree with its
/// op (static inference finds no problem) and no value's static size exceeds the memory budget.
pub fn check_runnable(m: &Model) -> Result<()> {
    let r = npuc_ir::infer::infer_model(m, &HashMap::new());
    if let Some(p) = r.problems.first() {
        let more = if r.problems.len() > 1 {
            format!(" (and {} more problems)", r.problems.len() - 1)
        } else {
            String::new()
        };
        bail!("the graph cannot run: {p}{more}");
    }
    let mut sized: Vec<(&String, &TypeInfo)> = r.types.iter().collect();
    sized.sort_by(|a, b| a.0.cmp(b.0));
    for (name, ty) in sized {
        let Some(bytes) = ty.fixed_bytes() else {
            continue;
        };
        npuc_runtime::limits::check_bytes(bytes, || format!("value '{name}' ({})", ty.describe()))
            .map_err(|e| anyhow!(e))?;
    }
    Ok(())
}

/// The artifact's source entry for `path`: its file name and bytes.
pub(crate) fn add_source(w: &mut ArtifactWriter, path: &Path) -> Result<usize> {
    // Hashed in chunks: a model of GBs (inline weights) is not read into memory once more.
    w.add_source_file(
        &path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
        path,
    )
    .with_context(|| format!("reading {}", path.display()))?;
    Ok(w.meta().sources.last().map_or(0, |s| s.bytes as usize))
}

/// The target `opts` names (this machine by default).
pub(crate) fn target_of(name: &Option<String>) -> Result<Target> {
    Ok(match name {
        Some(t) => Target::parse(t)?,
        None => Target::host(),
    })
}

/// Compiles models into one artifact at `out` (written atomically), reporting each step to
/// `progress`.
pub fn compile(
    models: &[(String, PathBuf)],
    opts: &CompileOptions,
    out: &Path,
    progress: &mut dyn Progress,
) -> Result<CompileSummary> {
    let t0 = Instant::now();
    let mut steps = Steps::new(progress);
    let (w, mut summary) = compile_graphs(models, opts, &mut steps)?;
    steps.start(&format!("writing {}", out.display()));
    summary.file_bytes = w.write(out)?;
    steps.done(&format!(
        "wrote {} ({:.2} MB)",
        out.display(),
        summary.file_bytes as f64 / 1e6
    ));
    summary.seconds = t0.elapsed().as_secs_f64();
    Ok(summary)
}

/// [`compile`] into memory: the artifact's bytes instead of a file (for loading it back in
/// the same process, as `cargo xtask conformance --compiled` does).
pub fn compile_to_bytes(
    models: &[(String, PathBuf)],
    opts: &CompileOptions,
    progress: &mut dyn Progress,
) -> Result<(Vec<u8>, CompileSummary)> {
    let t0 = Instant::now();
    let mut steps = Steps::new(progress);
    let (w, mut summary) = compile_graphs(models, opts, &mut steps)?;
    let bytes = w.to_bytes()?;
    summary.file_bytes = bytes.len() as u64;
    summary.seconds = t0.elapsed().as_secs_f64();
    Ok((bytes, summary))
}

/// Every step of [`compile`] before writing: each model imported, optimized, planned and
/// added to the artifact writer as a graph.
fn compile_graphs(
    models: &[(String, PathBuf)],
    opts: &CompileOptions,
    progress: &mut Steps,
) -> Result<(ArtifactWriter, CompileSummary)> {
    let target = target_of(&opts.target)?;
    let options = serde_json::json!({
        "input_shapes": opts.input_shapes.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "dims": opts.dims.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "optimize": opts.optimize,
        "disable_passes": opts.disable_passes,
        "enable_passes": opts.enable_passes,
        "target": target.name,
    });
    let mut w = ArtifactWriter::new(target, options);
    let mut graphs = vec![];
    let mut referenced = 0u64;
    for (name, path) in models {
        progress.start(&format!("[{name}] importing {}", path.display()));
        let size = add_source(&mut w, path)?;
        let mut m = load_verified(path, opts)?;
        let nodes_before = m.graph.nodes.len();
        progress.done(&format!(
            "[{name}] imported {} ({:.2} MB, {nodes_before} nodes, verified)",
            path.display(),
            size as f64 / 1e6
        ));
        // Types of the graph as imported: fused `npuc` ops have no shape inference, but a
        // fusion's output keeps the name (and type) of the pattern's last output.
        let mut types = npuc_ir::infer::infer_model(&m, &HashMap::new()).types;
        let (pass_log, pass_records) = if opts.optimize {
            progress.start(&format!("[{name}] optimizing {nodes_before} nodes"));
            let report = {
                let mut nodes = nodes_before;
                optimize_observed(
                    &mut m,
                    &opts.disable_passes,
                    &opts.enable_passes,
                    &mut |ev| {
                        match ev {
                        npuc_passes::PassEvent::Start {
                            pass,
                            iteration,
                            index,
                            count,
                        } => progress.update(&|| {
                            format!(
                                "[{name}] optimizing: iteration {iteration}, pass {}/{count} {pass}, {nodes_before} -> {nodes} nodes",
                                (index + 1).min(count)
                            )
                        }),
                        npuc_passes::PassEvent::Changed(r) => nodes = r.nodes_after,
                    }
                    },
                )?
            };
            progress.done(&format!(
                "[{name}] optimized: {} -> {} nodes, {} pass runs changed the graph, {} iteration{}",
                report.nodes_before,
                report.nodes_after,
                report.records.len(),
                report.iterations,
                if report.iterations == 1 { "" } else { "s" }
            ));
            (report.totals(), report.records)
        } else {
            (vec![], vec![])
        };
        let nodes_after = m.graph.nodes.len();
        progress.start(&format!("[{name}] planning memory"));
        if opts.optimize {
            for (k, t) in npuc_ir::infer::infer_model(&m, &HashMap::new()).types {
                if is_static(&t) || !types.get(&k).is_some_and(is_static) {
                    types.insert(k, t);
                }
            }
        }
        let (arena_bytes, unknown) = plan_arena(&m, &types);
        if !unknown.is_empty() {
            progress.note(&format!(
                "[{name}] {} intermediate values have dynamic or unknown shapes (e.g. {}); bind inputs with --input-shape/--dim for a static arena",
                unknown.len(),
                unknown.iter().take(3).map(|u| format!("'{u}'")).collect::<Vec<_>>().join(", ")
            ));
        }
        progress.done(&format!(
            "[{name}] planned memory: arena {:.2} MB",
            arena_bytes as f64 / 1e6
        ));
        let graph_referenced = m
            .graph
            .initializers
            .iter()
            .map(|i| (i.tensor.len() * i.tensor.dtype().size()) as u64)
            .sum::<u64>();
        referenced += graph_referenced;
        progress.start(&format!(
            "[{name}] serializing {} weights ({:.2} MB), de-duplicating",
            m.graph.initializers.len(),
            graph_referenced as f64 / 1e6
        ));
        let unique_before: u64 = w.meta().weights.iter().map(|wd| wd.len).sum();
        w.add_graph(
            name,
            &m,
            GraphInfo {
                nodes_before,
                nodes_after,
                arena_bytes,
                source: path.display().to_string(),
            },
        )?;
        let unique_after: u64 = w.meta().weights.iter().map(|wd| wd.len).sum();
        progress.done(&format!(
            "[{name}] serialized: {:.2} MB of weights new, {:.2} MB shared with earlier graphs",
            (unique_after - unique_before) as f64 / 1e6,
            graph_referenced.saturating_sub(unique_after - unique_before) as f64 / 1e6
        ));
        graphs.push(GraphSummary {
            name: name.clone(),
            nodes_before,
            nodes_after,
            arena_bytes,
            pass_log,
            pass_records,
        });
    }
    let unique: u64 = w.meta().weights.iter().map(|wd| wd.len).sum();
    Ok((
        w,
        CompileSummary {
            graphs,
            weight_bytes_unique: unique,
            weight_bytes_referenced: referenced,
            file_bytes: 0,
            seconds: 0.0,
        },
    ))
}
