//! The float types kernels compute in ([`Real`]: f32 and f64) and the slice reductions
//! several kernel families share (norm, reduce, qsoftmax). A leaf module: it depends on no
//! other kernel module, so families can share it without depending on each other.

use npuc_ir::Elem;

/// The float types kernels compute in.
pub trait Real:
    num_traits::Float + Elem + Send + Sync + std::iter::Sum + std::fmt::Debug + 'static
{
    /// Conversion from f64 (lossy for f32, as intended).
    fn of(v: f64) -> Self;
    fn f64(self) -> f64;
    /// `exp`, through a branch-free polynomial for f32 so that loops over it vectorise.
    fn fast_exp(self) -> Self;
}
impl Real for f32 {
    #[inline(always)]
    fn of(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn fast_exp(self) -> Self {
        crate::ops::elementwise::exp_f32(self)
    }
}
impl Real for f64 {
    #[inline(always)]
    fn of(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn fast_exp(self) -> Self {
        self.exp()
    }
}

/// Maximum of a slice (8 independent lanes so the loop vectorises); -inf when empty.
#[inline]
pub fn max_of<F: Real>(s: &[F]) -> F {
    let mut lanes = [F::neg_infinity(); 8];
    let chunks = s.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = if v > *l { v } else { *l };
        }
    }
    let mut m = lanes
        .iter()
        .fold(F::neg_infinity(), |a, &b| if b > a { b } else { a });
    for &v in tail {
        if v > m {
            m = v;
        }
    }
    m
}

/// Sum of a slice with 8 independent accumulators (vectorises; also a little more accurate
/// than a single running sum).
#[inline]
pub fn sum_of<F: Real>(s: &[F]) -> F {
    let mut lanes = [F::zero(); 8];
    let chunks = s.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = *l + v;
        }
    }
    lanes.iter().fold(F::zero(), |a, &b| a + b) + tail.iter().fold(F::zero(), |a, &b| a + b)
}
