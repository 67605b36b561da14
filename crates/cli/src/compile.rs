//! `npuc compile`: import, bind shapes, inline functions, verify, optimize, plan memory,
//! serialize into one `.npuc` artifact holding every input model as a named graph.

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

#[derive(Debug)]
pub struct GraphSummary {
    pub name: String,
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub arena_bytes: u64,
    pub pass_log: Vec<(String, usize)>,
}

#[derive(Debug)]
pub struct CompileSummary {
    pub graphs: Vec<GraphSummary>,
    pub weight_bytes_unique: u64,
    pub weight_bytes_referenced: u64,
    pub file_bytes: u64,
    pub seconds: f64,
}

/// Input-shape bindings (`name -> shape`) and symbolic-dimension bindings (`sym -> size`).
pub type Bindings = (HashMap<String, Vec<usize>>, HashMap<String, usize>);

pub fn parse_bindings(input_shape: &[String], dim: &[String]) -> Result<Bindings> {
    let mut shapes = HashMap::new();
    for s in input_shape {
        let (n, v) = s
            .split_once('=')
            .ok_or_else(|| anyhow!("--input-shape expects NAME=SHAPE, got '{s}'"))?;
        shapes.insert(
            n.to_string(),
            npuc_ir::parse_shape(v).map_err(|e| anyhow!(e))?,
        );
    }
    let mut dims = HashMap::new();
    for s in dim {
        let (n, v) = s
            .split_once('=')
            .ok_or_else(|| anyhow!("--dim expects SYM=N, got '{s}'"))?;
        dims.insert(
            n.to_string(),
            v.parse::<usize>()
                .map_err(|_| anyhow!("--dim {n}: '{v}' is not a number"))?,
        );
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
/// value after its last reader (the executor's policy). Values of unknown size count as 0 and
/// are reported by the caller.
pub fn plan_arena(m: &Model, types: &HashMap<String, TypeInfo>) -> (u64, usize) {
    let g = &m.graph;
    let Ok(order) = g.topo_order(&HashSet::new()) else {
        return (0, 0);
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
    let (mut live, mut peak, mut unknown) = (0u64, 0u64, 0usize);
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
                None => unknown += 1,
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

fn count_nodes(m: &Model) -> usize {
    m.graph.nodes.len()
}

/// Compiles models into one artifact at `out` (written atomically).
pub fn compile(
    models: &[(String, PathBuf)],
    opts: &CompileOptions,
    out: &Path,
    mut log: impl FnMut(&str),
) -> Result<CompileSummary> {
    let t0 = Instant::now();
    let target = match &opts.target {
        Some(t) => Target::parse(t)?,
        None => Target::host(),
    };
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
        log(&format!("[{name}] importing {}", path.display()));
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        w.add_source(
            &path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
            &bytes,
        );
        drop(bytes);
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
        // Refuse unsupported ops now, with every offending node named, rather than at run time.
        npuc_runtime::Plan::for_model(&m).map_err(|e| anyhow!("'{}': {e}", path.display()))?;
        let nodes_before = count_nodes(&m);
        let pass_log = if opts.optimize {
            log(&format!("[{name}] optimizing {nodes_before} nodes"));
            crate::optimize_hook(&mut m, &opts.disable_passes, &opts.enable_passes)?
        } else {
            vec![]
        };
        let nodes_after = count_nodes(&m);
        let bound: HashMap<String, TypeInfo> = m
            .graph
            .inputs
            .iter()
            .filter_map(|v| v.ty.clone().map(|t| (v.name.clone(), t)))
            .collect();
        let inferred = npuc_ir::infer::infer_model(&m, &bound);
        let (arena_bytes, unknown) = plan_arena(&m, &inferred.types);
        if unknown > 0 {
            log(&format!("[{name}] {unknown} intermediate values have dynamic shapes; bind inputs with --input-shape/--dim for a static arena"));
        }
        referenced += m
            .graph
            .initializers
            .iter()
            .map(|i| (i.tensor.len() * i.tensor.dtype().size()) as u64)
            .sum::<u64>();
        log(&format!("[{name}] serializing"));
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
        graphs.push(GraphSummary {
            name: name.clone(),
            nodes_before,
            nodes_after,
            arena_bytes,
            pass_log,
        });
    }
    let unique: u64 = w.meta().weights.iter().map(|wd| wd.len).sum();
    let file_bytes = w.write(out)?;
    Ok(CompileSummary {
        graphs,
        weight_bytes_unique: unique,
        weight_bytes_referenced: referenced,
        file_bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
