//! Library side of the `npuc` binary: file formats the CLI reads/writes and small applications
//! (OCR) built on the runtime. Shared with tests and xtask.

pub mod npy;
pub mod ocr;
