//! Opening a model or artifact for execution: the one path `npuc run`, `npuc bench`,
//! `npuc ocr` and library users take from a file to a [`Session`].

use crate::compile::bind_inputs;
use crate::quantized::{self, Prepared};
use anyhow::{Context, Result};
use npuc_format::Artifact;
use npuc_ir::Model;
use npuc_runtime::{Session, SessionOptions};
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

/// Whether `path` starts with the artifact magic.
pub fn is_artifact(path: &Path) -> bool {
    let mut magic = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == npuc_format::MAGIC
}

/// Loads an ONNX model, or graph `graph` of an artifact (the first graph by default).
pub fn load_any(path: &Path, graph: Option<&str>) -> Result<Model> {
    if is_artifact(path) {
        let a = Artifact::open(path)?;
        return Ok(a.model(graph)?);
    }
    if let Some(g) = graph {
        anyhow::bail!("--graph {g}: '{}' is an ONNX model, which holds one graph; --graph applies to .npuc artifacts", path.display());
    }
    Ok(npuc_onnx::load_model(path)?)
}

/// How to open a model for execution.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Graph of an artifact (default: its first graph); must be `None` for ONNX models.
    pub graph: Option<String>,
    /// `name -> shape` bindings for graph inputs.
    pub input_shapes: HashMap<String, Vec<usize>>,
    /// Symbolic dimension bindings.
    pub dims: HashMap<String, usize>,
    /// Quantized models: keep the QDQ graph (QuantSim) instead of lowering to integer kernels.
    pub simulate: bool,
    /// Threads of the session.
    pub threads: usize,
    /// Float ONNX models: run `npuc compile`'s optimizer (fusions, folding, channels-last conv
    /// chains) before the session is built, as onnxruntime optimizes at session creation;
    /// `false` runs the graph as imported. Artifacts are optimized when compiled; quantized
    /// (QDQ) models go through their integer lowering instead.
    pub optimize: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            graph: None,
            input_shapes: HashMap::new(),
            dims: HashMap::new(),
            simulate: false,
            threads: SessionOptions::default().threads,
            optimize: true,
        }
    }
}

/// A model ready to run, with the graph it runs.
pub struct Opened {
    /// The graph as executed (after binding and [`quantized::prepare`]).
    pub model: Model,
    /// What preparing for execution did.
    pub prepared: Prepared,
    pub session: Session,
}

/// Loads `path` (ONNX or artifact), binds input shapes, prepares it for execution and returns
/// the executable model: the steps before [`Session::new`] in [`open`].
pub fn load_for_execution(path: &Path, opts: &OpenOptions) -> Result<(Model, Prepared)> {
    crate::register_ops();
    let artifact = is_artifact(path);
    let mut m = load_any(path, opts.graph.as_deref())?;
    bind_inputs(&mut m, &opts.input_shapes, &opts.dims)?;
    let prepared = quantized::prepare(&mut m, opts.simulate)?;
    if opts.optimize && !artifact && !prepared.quantized {
        optimize_for_execution(&mut m).with_context(|| {
            format!(
                "optimizing '{}' for execution (--no-optimize runs the graph as imported)",
                path.display()
            )
        })?;
    }
    Ok((m, prepared))
}

/// `npuc compile`'s optimization of a float ONNX model: model-local functions inlined, then
/// the standard pass pipeline (about 0.1 s for a ViT-S or a PP-OCR detector).
fn optimize_for_execution(m: &mut Model) -> Result<()> {
    if !m.functions.is_empty() {
        m.graph = npuc_runtime::exec::inline_functions(&m.graph, &m.functions)?;
        m.functions.clear();
    }
    crate::compile::optimize(m, &[], &[])?;
    Ok(())
}

/// Opens `path` (ONNX or artifact) as a [`Session`]: what `npuc run` executes.
pub fn open(path: &Path, opts: &OpenOptions) -> Result<Opened> {
    let (model, prepared) = load_for_execution(path, opts)?;
    let session = Session::new(
        &model,
        SessionOptions {
            threads: opts.threads,
        },
    )?;
    // The session serves many runs: keep weights packed (one packed copy of each f32
    // MatMul weight at the AVX-512 level).
    session.set_weight_prepacking(true);
    Ok(Opened {
        model,
        prepared,
        session,
    })
}
