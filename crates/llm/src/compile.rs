//! The LLM artifact compiler behind `npuc compile MODEL.gguf --variants ar1,ar32,ar128,full --ctx 1024 [--precision fast|parity|exact]`:
//! one graph per AR variant in one artifact, the GGUF weights stored once (every variant uses
//! the same initializer names and bytes, which the artifact writer deduplicates), plus the
//! model facts (`npuc.llm`, per graph) and the tokenizer's GGUF metadata as JSON
//! (`npuc.llm.tokenizer`, first graph) so that the artifact can generate without the GGUF.

use crate::engine::{build_variants, TOKENIZER_KEY, TOKENIZER_PREFIXES};
use crate::{EngineOptions, GgufMetaJson, LlmError, Precision, Result, Variant, WeightMode};
use npuc_format::{ArtifactWriter, GraphInfo, Target};
use std::path::Path;
use std::time::Instant;

/// What `npuc compile` was asked for a GGUF input.
#[derive(Clone, Debug)]
pub struct LlmCompileOptions {
    /// Variants, e.g. `ar1,ar32,ar128,full`.
    pub variants: Vec<Variant>,
    /// Cache slots (default: the model's training context, at most 4096).
    pub ctx: Option<usize>,
    pub precision: Precision,
    /// Target descriptor name (default: this machine).
    pub target: Option<String>,
}

impl Default for LlmCompileOptions {
    fn default() -> Self {
        LlmCompileOptions {
            variants: vec![Variant::Ar(1), Variant::Ar(32), Variant::Ar(128)],
            ctx: None,
            precision: Precision::Fast,
            target: None,
        }
    }
}

/// What was written.
#[derive(Clone, Debug)]
pub struct LlmCompileSummary {
    /// Graph names and node counts.
    pub graphs: Vec<(String, usize)>,
    /// Bytes of weights stored in the artifact.
    pub weight_bytes_unique: u64,
    /// Bytes of weights the graphs reference (counting shared ones once per graph).
    pub weight_bytes_referenced: u64,
    pub file_bytes: u64,
    pub seconds: f64,
}

/// Compiles a GGUF model into the artifact `out` (written atomically).
pub fn compile_gguf(
    path: &Path,
    opts: &LlmCompileOptions,
    out: &Path,
    mut log: impl FnMut(&str),
) -> Result<LlmCompileSummary> {
    let t0 = Instant::now();
    let target = match &opts.target {
        Some(t) => Target::parse(t)?,
        None => Target::host(),
    };
    let g = npuc_gguf::GgufFile::open(path)?;
    let eopts = EngineOptions {
        threads: 1,
        ctx: opts.ctx,
        variants: opts.variants.clone(),
        precision: opts.precision,
        weight_quant: Default::default(),
    };
    log(&format!(
        "[{}] building {} for {}",
        path.display(),
        opts.variants
            .iter()
            .map(|v| v.name())
            .collect::<Vec<_>>()
            .join(", "),
        g.architecture().unwrap_or("?")
    ));
    let models = build_variants(&g, &eopts, WeightMode::Auto)?;
    let options = serde_json::json!({
        "llm": true,
        "variants": opts.variants.iter().map(|v| v.name()).collect::<Vec<_>>(),
        "ctx": opts.ctx,
        "precision": opts.precision.name(),
        "target": target.name,
    });
    let mut w = ArtifactWriter::new(target, options);
    w.add_source(
        &path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
        g.backing().bytes(),
    );
    let tok = GgufMetaJson::filtered(&g.metadata, TOKENIZER_PREFIXES);
    let mut graphs = vec![];
    let mut referenced = 0u64;
    for (i, (v, mut m)) in models.into_iter().enumerate() {
        if i == 0 {
            m.metadata
                .push((TOKENIZER_KEY.into(), tok.to_json().to_string()));
        }
        // Refuse unsupported ops now (e.g. a quantized file without the ggml kernels).
        npuc_runtime::Plan::for_model(&m).map_err(|e| {
            LlmError::msg(format!("'{}' variant {}: {e}", path.display(), v.name()))
        })?;
        let nodes = m.graph.nodes.len();
        referenced += m
            .graph
            .initializers
            .iter()
            .map(|i| (i.tensor.len() * i.tensor.dtype().size()) as u64)
            .sum::<u64>();
        log(&format!("[{}] serializing {nodes} nodes", v.name()));
        w.add_graph(
            &v.name(),
            &m,
            GraphInfo {
                nodes_before: nodes,
                nodes_after: nodes,
                arena_bytes: 0,
                source: path.display().to_string(),
            },
        )?;
        graphs.push((v.name(), nodes));
    }
    let unique: u64 = w.meta().weights.iter().map(|wd| wd.len).sum();
    let file_bytes = w.write(out)?;
    Ok(LlmCompileSummary {
        graphs,
        weight_bytes_unique: unique,
        weight_bytes_referenced: referenced,
        file_bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// One part of a split model, as written by [`compile_part`].
#[derive(Clone, Debug)]
pub struct PartCompileSummary {
    /// Graph names (`ar{N}_c{C}`) and node counts.
    pub graphs: Vec<(String, usize)>,
    /// Bytes of weights stored in the part's artifact (each weight once).
    pub weight_bytes: u64,
    pub file_bytes: u64,
}

/// Compiles one part of a split model (see [`crate::build::split`]) into the artifact `out`
/// (written atomically): one graph per `(tokens, ctx)` pair, named `ar{N}_c{C}`, the part's
/// weights stored once (with `sha`, in single-head attention form: per-head weight slices);
/// the first part also carries the tokenizer's GGUF metadata.
/// Deterministic: the same inputs give the same bytes. `check` sees each graph as built, before
/// the tokenizer metadata is attached (a caller's consistency check; an `Err` message aborts,
/// naming the graph).
pub fn compile_part(
    g: &npuc_gguf::GgufFile,
    part: &crate::build::split::PartSpec,
    graphs: &[(usize, usize)],
    precision: Precision,
    sha: bool,
    out: &Path,
    check: &mut dyn FnMut(&str, &npuc_ir::Model) -> std::result::Result<(), String>,
) -> Result<PartCompileSummary> {
    use crate::build::split;
    let hp = crate::build::hparams(g)?;
    if graphs.is_empty() {
        return Err(LlmError::msg(format!(
            "part {}: no graphs to compile (give at least one AR variant and context)",
            part.index + 1
        )));
    }
    let options = serde_json::json!({
        "llm": true,
        "part": part.index,
        "parts": part.count,
        "layers": [part.layers.start, part.layers.end],
        "graphs": graphs.iter().map(|&(n, c)| split::graph_name(n, c)).collect::<Vec<_>>(),
        "precision": precision.name(),
        "sha": sha,
    });
    // The host's target: these graphs run on the CPU kernels of this build.
    let mut w = ArtifactWriter::new(Target::host(), options);
    // The file name only: a bundle's bytes do not depend on where the GGUF lives.
    let source = Path::new(&g.name)
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Hashed from the file (not the mapping: the part needs only its own weights resident).
    if Path::new(&g.name).is_file() {
        w.add_source_file(&source, Path::new(&g.name))?;
    } else {
        w.add_source(&source, g.backing().bytes());
    }
    let mut names = vec![];
    // One repacked copy of each weight for all the part's graphs.
    let repacked = crate::build::RepackCache::default();
    for (i, &(tokens, ctx)) in graphs.iter().enumerate() {
        let name = split::graph_name(tokens, ctx);
        let mut m = split::build_part_shared(g, &hp, part, tokens, ctx, precision, sha, &repacked)?;
        check(&name, &m).map_err(|e| {
            LlmError::msg(format!(
                "{}: part {} graph {name}: {e}",
                g.name,
                part.index + 1
            ))
        })?;
        if i == 0 && part.has_embedding() {
            let tok = GgufMetaJson::filtered(&g.metadata, TOKENIZER_PREFIXES);
            m.metadata
                .push((TOKENIZER_KEY.into(), tok.to_json().to_string()));
        }
        npuc_runtime::Plan::for_model(&m).map_err(|e| {
            LlmError::msg(format!(
                "{}: part {} graph {name}: {e}",
                g.name,
                part.index + 1
            ))
        })?;
        let nodes = m.graph.nodes.len();
        w.add_graph(
            &name,
            &m,
            GraphInfo {
                nodes_before: nodes,
                nodes_after: nodes,
                arena_bytes: 0,
                source: source.clone(),
            },
        )?;
        names.push((name, nodes));
    }
    // The writer holds its own copy of every weight now: the repacked ones go before it
    // writes (peak memory: one copy of the part's weights, not two).
    drop(repacked);
    let weight_bytes: u64 = w.meta().weights.iter().map(|wd| wd.len).sum();
    let file_bytes = w.write(out)?;
    Ok(PartCompileSummary {
        graphs: names,
        weight_bytes,
        file_bytes,
    })
}
