//! `qwen2`: the llama block with q/k/v biases and NEOX RoPE on unpermuted q/k.

use super::{common_hparams, Hparams, RopeMode};
use crate::Result;
use npuc_gguf::GgufFile;

/// Hyper-parameters of a `qwen2` GGUF.
pub fn hparams(g: &GgufFile) -> Result<Hparams> {
    let mut hp = common_hparams(g, "qwen2")?;
    hp.rope_mode = RopeMode::Neox;
    hp.qkv_bias = true;
    Ok(hp)
}
