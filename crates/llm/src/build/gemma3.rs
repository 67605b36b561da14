//! `gemma3`: embeddings scaled by sqrt(n_embd), per-head q/k RMSNorm, RMSNorm after attention
//! and after the FFN, GELU-tanh gated FFN, NEOX RoPE, and a 5 local : 1 global layer pattern as
//! in llama.cpp: layer `il` is global when `(il + 1) % 6 == 0`; local layers attend within the
//! sliding window (`gemma3.attention.sliding_window`) with rope base 10000, global layers use
//! `gemma3.rope.freq_base` (and the linear rope scaling, when present). Attention scale
//! `1/sqrt(head_dim)` (query_pre_attn_scalar = head_dim for the released sizes but 27B, which
//! llama.cpp scales by `1/sqrt(n_embd/n_head)`). The converter already stores the Gemma norm
//! weights as `1 + w`, so they are used as plain RMSNorm scales. Tied output.

use super::{common_hparams, Act, Hparams, Keys, RopeMode};
use crate::Result;
use npuc_gguf::GgufFile;

/// llama.cpp's sliding-window pattern for gemma3: every 6th layer is global.
pub const SWA_PATTERN: usize = 6;
/// Rope base of the local (sliding-window) layers (not in the GGUF; llama.cpp hard-codes it).
pub const ROPE_BASE_LOCAL: f32 = 10000.0;

/// Hyper-parameters of a `gemma3` GGUF.
pub fn hparams(g: &GgufFile) -> Result<Hparams> {
    let mut hp = common_hparams(g, "gemma3")?;
    let k = Keys { g, arch: "gemma3" };
    hp.rope_mode = RopeMode::Neox;
    hp.act = Act::GeluTanh;
    hp.qk_norm = true;
    hp.post_norms = true;
    hp.embed_scale = Some((hp.n_embd as f32).sqrt());
    hp.eps = k.f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6);
    hp.window = k.opt("attention.sliding_window")?.unwrap_or(0);
    hp.rope_base_swa = ROPE_BASE_LOCAL;
    hp.swa_layers = (0..hp.n_layers)
        .map(|il| hp.window > 0 && (il + 1) % SWA_PATTERN != 0)
        .collect();
    // llama.cpp: 27B scales by n_embd/n_head, the others by the head dim.
    hp.attn_scale = if hp.n_layers == 62 {
        1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt()
    } else {
        1.0 / (hp.head_dim as f32).sqrt()
    };
    hp.tied = g.tensor("output.weight").is_none();
    Ok(hp)
}
