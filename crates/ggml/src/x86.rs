//! AVX2+FMA kernels (x86_64). Each has a scalar twin in `dot.rs` / `matmul.rs`; the proptests in
//! `tests/kernels.rs` compare them. Only called after `crate::has_avx2()` said yes.

use crate::dot::DotFn;
use crate::GgmlType;
use std::arch::x86_64::*;

/// The AVX2 kernel for `ty`, when there is one.
pub(crate) fn avx2_fn(ty: GgmlType) -> Option<DotFn> {
    let _ = ty;
    None
}

/// Horizontal sum of 8 f32 lanes in the order ((0+4)+(2+6))+((1+5)+(3+7)).
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// f32 dot product (twin of `matmul::dot_f32_scalar`).
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2 and FMA.
    unsafe { dot_f32_avx2(a, b) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n <= both lengths, so both 8-float loads are in bounds.
        let (p, q) = unsafe {
            (
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
            )
        };
        acc = _mm256_fmadd_ps(p, q, acc);
        i += 8;
    }
    let mut s = hsum(acc);
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}
