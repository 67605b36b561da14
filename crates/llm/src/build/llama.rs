//! `llama` (Llama 2/3 and relatives): RMSNorm, GQA, SwiGLU, "normal" RoPE on the q/k rows as
//! convert_hf_to_gguf permuted them (adjacent pairs), `rope_freqs.weight` (llama3 scaling) as
//! angle divisors, tied embeddings when the file has no `output.weight`.

use super::{common_hparams, Hparams, RopeMode};
use crate::Result;
use npuc_gguf::GgufFile;

/// Hyper-parameters of a `llama` GGUF.
pub fn hparams(g: &GgufFile) -> Result<Hparams> {
    let mut hp = common_hparams(g, "llama")?;
    hp.rope_mode = RopeMode::Normal;
    Ok(hp)
}
