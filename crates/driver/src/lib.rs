//! npuc's pipelines as a library. Everything that turns a model file into an artifact or a
//! running [`npuc_runtime::Session`] lives here, so the `npuc` binary, `cargo xtask
//! conformance --compiled` and other front ends run the same steps:
//!
//! - [`compile::compile`]: ONNX models → `.npuc` artifact (load, bind shapes, inline functions,
//!   verify, optimize, infer types, plan the arena, serialize);
//! - [`quantize::compile_quantized`]: one ONNX model → quantized (QDQ) artifact;
//! - [`llm::compile_gguf`]: a GGUF LLM → artifact with one graph per AR variant;
//! - [`build::build_pipeline`]: a pipeline file → a bundle of split part artifacts (cached steps);
//! - [`quantized::prepare`]: what a model goes through before execution (quantized lowering
//!   and cleanup);
//! - [`session::open`]: a model or artifact → a `Session`, exactly as `npuc run` runs it.
//!
//! The library prints nothing: progress and messages go to a [`Progress`].

pub mod build;
pub mod compile;
pub mod components;
pub mod llm;
pub mod quantize;
pub mod quantized;
pub mod session;
pub mod synth;
pub mod verify;

pub use compile::{compile, CompileOptions, CompileSummary};

/// Registers the op packs npuc serves on top of the core runtime: the LLM/GGML kernels of
/// `npuc-llm` and the image-codec/regex ONNX ops of `npuc-ops-ext` (idempotent). The driver's
/// entry points that load a model call it, so a library user runs what `npuc run` runs.
pub fn register_ops() {
    npuc_llm::register_ops();
    npuc_ops_ext::register();
}
pub use session::{load_any, open, OpenOptions, Opened};

/// Where a pipeline reports what it does. Step lines (`done`) end with the step's duration;
/// `start`/`update` are for live displays (spinners) and may be ignored.
///
/// Any `FnMut(&str)` is a `Progress` that receives the step lines and notes.
pub trait Progress {
    /// A step begins; `msg` says what it does.
    fn start(&mut self, _msg: &str) {}
    /// The live state of the current step changed (e.g. which pass runs now). Called often:
    /// `msg` builds the text only when it is wanted.
    fn update(&mut self, _msg: &dyn Fn() -> String) {}
    /// The current step ended; `line` says what it did and how long it took.
    fn done(&mut self, line: &str);
    /// A message outside the step lines: a warning, a file written, timings.
    fn note(&mut self, msg: &str);
    /// Calibration progress: `done` of `total` samples observed.
    fn calibrated(&mut self, _done: usize, _total: usize) {}
    /// Calibration ended (a live display can go away).
    fn calibration_done(&mut self) {}
}

impl<F: FnMut(&str)> Progress for F {
    fn done(&mut self, line: &str) {
        self(line)
    }
    fn note(&mut self, msg: &str) {
        self(msg)
    }
}
