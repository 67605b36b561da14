//! Low-level compute kernels shared by op implementations: SIMD micro-kernels with scalar
//! twins, selected at run time by CPU feature detection.

pub mod act;
pub mod conv_nhwc;
pub mod igemm;
pub mod imm;
pub mod qconvert;
