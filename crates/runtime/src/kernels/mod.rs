//! Low-level compute kernels shared by op implementations: SIMD micro-kernels with scalar
//! twins, selected at run time by CPU feature detection.

pub mod act;
pub mod blockq4;
pub mod conv_nhwc;
pub mod igemm;
pub mod imm;
pub mod qconvert;
pub mod qgemv;

/// One xorshift64 step: the kernels' property tests draw their operands from it.
#[cfg(test)]
pub(crate) fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}
