//! npuc's CPU runtime: op kernels behind a registry, plans and an executor.

pub mod buffers;
pub mod compare;
pub mod error;
pub mod exec;
pub mod kernel;
pub mod kernels;
pub mod limits;
pub mod ops;
pub mod value;

pub use error::{Result, RtError};
pub use exec::{Plan, Session, SessionOptions};
pub use kernel::{register_pack, registry, Inputs, KernelFn, OpCtx, OpPack, Registry};
pub use value::Value;
