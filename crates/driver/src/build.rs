//! `npuc build PIPELINE.toml`: the LLM build pipeline of [`npuc_build`] (a DAG of cached,
//! content-addressed steps from a GGUF to a bundle of split part artifacts), reporting through
//! a [`Progress`].

use crate::Progress;
use anyhow::Result;
pub use npuc_build::{BuildReport, BuildRequest, Pipeline, Status, StepReport};
use std::path::Path;

/// Reads and checks the pipeline file (before any step runs), then builds it.
pub fn build_pipeline(
    file: &Path,
    req: &BuildRequest,
    progress: &mut dyn Progress,
) -> Result<BuildReport> {
    let mut line = |l: &str| progress.note(l);
    let (p, _import_guard) = npuc_build::load_pipeline(file, req, &mut line)?;
    npuc_build::build(&p, req, &mut line)
}
