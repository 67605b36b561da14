//! The `npuc`-domain kernels of LLM graphs: `GgmlMatMul`/`GgmlGather` over GGUF block-quantized
//! weights (backed by `npuc-ggml`) and `Rope`/`CachedAttention`/`GeluF16`/`SiluGgml`. They live
//! here, not in the core runtime, and reach sessions as the [`PACK`] op pack: whatever builds
//! sessions for LLM graphs calls [`register`] first (the builders, [`crate::Engine`] and the
//! artifact loader do).

pub mod ggml;
pub mod transformer;

use npuc_runtime::{OpPack, Registry};

/// The LLM op pack, for [`npuc_runtime::register_pack`] or [`Registry::register_pack`].
pub const PACK: OpPack = OpPack {
    name: "npuc-llm",
    register: register_kernels,
};

fn register_kernels(r: &mut Registry) {
    ggml::register(r);
    transformer::register(r);
}

/// Makes the LLM ops visible to every session built afterwards (idempotent, cheap).
pub fn register() {
    npuc_runtime::register_pack(PACK);
}
