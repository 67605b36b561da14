//! Kernels for the ONNX ops that need a third-party engine, kept out of `npuc-runtime` so the
//! core runtime builds without image codecs or a regex engine: `ImageDecoder` (opset 20, the
//! `image` crate) and `RegexFullMatch` (opset 20, the `regex` crate). Whoever runs arbitrary
//! ONNX models (the CLI, `cargo xtask conformance`) calls [`register`] once.

#![forbid(unsafe_code)]

mod image_decoder;
mod regex_match;

use npuc_runtime::{OpPack, Registry};

/// This crate's op pack, for [`npuc_runtime::register_pack`] or [`Registry::register_pack`].
pub const PACK: OpPack = OpPack {
    name: "npuc-ops-ext",
    register: register_kernels,
};

fn register_kernels(r: &mut Registry) {
    image_decoder::register(r);
    regex_match::register(r);
}

/// Makes `ImageDecoder` and `RegexFullMatch` visible to every session built afterwards
/// (idempotent).
pub fn register() {
    npuc_runtime::register_pack(PACK);
}
