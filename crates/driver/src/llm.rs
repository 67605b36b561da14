//! LLM compile (`npuc compile MODEL.gguf --variants ar1,ar32,ar128,full --ctx 1024
//! [--precision fast|parity|exact]`) through [`npuc_llm::compile`]: one graph per AR variant in one
//! artifact, the GGUF weights stored once, model facts and tokenizer metadata in the graphs'
//! metadata.

use crate::compile::{CompileSummary, GraphSummary};
use crate::Progress;
use anyhow::Result;
pub use npuc_llm::compile::LlmCompileOptions;
use std::path::Path;

/// True for models the LLM compiler handles (GGUF, by magic bytes).
pub use npuc_gguf::is_gguf;

/// Compiles a GGUF model into the artifact `out` (written atomically).
pub fn compile_gguf(
    path: &Path,
    opts: &LlmCompileOptions,
    out: &Path,
    progress: &mut dyn Progress,
) -> Result<CompileSummary> {
    let s = npuc_llm::compile::compile_gguf(path, opts, out, |m| progress.note(m))?;
    Ok(CompileSummary {
        graphs: s
            .graphs
            .into_iter()
            .map(|(name, nodes)| GraphSummary {
                name,
                nodes_before: nodes,
                nodes_after: nodes,
                arena_bytes: 0,
                pass_log: vec![],
                pass_records: vec![],
            })
            .collect(),
        weight_bytes_unique: s.weight_bytes_unique,
        weight_bytes_referenced: s.weight_bytes_referenced,
        file_bytes: s.file_bytes,
        seconds: s.seconds,
    })
}
