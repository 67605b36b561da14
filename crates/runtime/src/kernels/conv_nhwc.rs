//! Channels-last (NHWC) depthwise convolution micro-kernel.
//!
//! In NHWC the channels of one pixel are contiguous, so a depthwise convolution is, per output
//! pixel, a sum over the kernel taps of `x[pixel + tap][c] * w[tap][c]` with `c` running over
//! contiguous memory in both operands: eight AVX2 lanes of channels per register and no
//! gathering. (In NCHW the same op walks short spatial rows per channel and per tap, which is
//! what made it a fifth of the PP-OCR recogniser's time.)
//!
//! [`dw_pixel`] accumulates one output pixel; callers pass the valid taps (padding taps are
//! left out) as `(x offset, w offset)` pairs. The AVX2+FMA path and the scalar twin compute the
//! same sums in the same tap order; they differ only by FMA's single rounding per step.

/// Taps handled by one call; callers with larger kernels split their tap list.
pub const MAX_TAPS: usize = 64;

/// `acc[c] += sum over (xo, wo) in taps of x[xo + c] * w[wo + c]` for `c in 0..acc.len()`.
///
/// Panics never: every tap is bounds-checked against `x` and `w` before any SIMD load, and an
/// out-of-range tap is skipped by returning `false` (a caller bug, reported as an error there).
#[must_use]
pub fn dw_pixel(acc: &mut [f32], taps: &[(usize, usize)], x: &[f32], w: &[f32]) -> bool {
    let c = acc.len();
    if taps
        .iter()
        .any(|&(xo, wo)| xo.checked_add(c).is_none_or(|e| e > x.len()) || wo + c > w.len())
    {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: avx2 and fma were detected at run time; every tap was checked above so
            // that x[xo .. xo + c] and w[wo .. wo + c] are in bounds.
            unsafe { dw_pixel_avx2(acc, taps, x, w) };
            return true;
        }
    }
    dw_pixel_scalar(acc, taps, x, w);
    true
}

/// Whether the AVX2+FMA path may run (cached by the standard library's detection).
#[cfg(target_arch = "x86_64")]
#[inline]
fn has_avx2_fma() -> bool {
    npuc_isa::Isa::detect().has_avx2()
}

/// The scalar twin of [`dw_pixel_avx2`]: same taps, same order, one channel at a time.
pub fn dw_pixel_scalar(acc: &mut [f32], taps: &[(usize, usize)], x: &[f32], w: &[f32]) {
    let c = acc.len();
    for &(xo, wo) in taps {
        for ((a, &xv), &wv) in acc.iter_mut().zip(&x[xo..xo + c]).zip(&w[wo..wo + c]) {
            *a += xv * wv;
        }
    }
}

/// AVX2+FMA depthwise pixel: blocks of 32 channels kept in four registers across all taps,
/// then blocks of 8, then a scalar tail.
///
/// # Safety
/// The CPU must support avx2 and fma, and for every `(xo, wo)` in `taps`,
/// `xo + acc.len() <= x.len()` and `wo + acc.len() <= w.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dw_pixel_avx2(acc: &mut [f32], taps: &[(usize, usize)], x: &[f32], w: &[f32]) {
    use std::arch::x86_64::*;
    let c = acc.len();
    let (xp, wp, ap) = (x.as_ptr(), w.as_ptr(), acc.as_mut_ptr());
    let mut c0 = 0;
    while c0 + 32 <= c {
        // SAFETY: c0 + 32 <= c = acc.len(), and per the contract x[xo + c0 .. xo + c0 + 32]
        // and w[wo + c0 .. wo + c0 + 32] are in bounds for every tap.
        unsafe {
            let mut a0 = _mm256_loadu_ps(ap.add(c0));
            let mut a1 = _mm256_loadu_ps(ap.add(c0 + 8));
            let mut a2 = _mm256_loadu_ps(ap.add(c0 + 16));
            let mut a3 = _mm256_loadu_ps(ap.add(c0 + 24));
            for &(xo, wo) in taps {
                let (xs, ws) = (xp.add(xo + c0), wp.add(wo + c0));
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xs), _mm256_loadu_ps(ws), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xs.add(8)), _mm256_loadu_ps(ws.add(8)), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xs.add(16)), _mm256_loadu_ps(ws.add(16)), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xs.add(24)), _mm256_loadu_ps(ws.add(24)), a3);
            }
            _mm256_storeu_ps(ap.add(c0), a0);
            _mm256_storeu_ps(ap.add(c0 + 8), a1);
            _mm256_storeu_ps(ap.add(c0 + 16), a2);
            _mm256_storeu_ps(ap.add(c0 + 24), a3);
        }
        c0 += 32;
    }
    while c0 + 8 <= c {
        // SAFETY: c0 + 8 <= c, and the contract bounds every tap's 8-lane loads as above.
        unsafe {
            let mut a0 = _mm256_loadu_ps(ap.add(c0));
            for &(xo, wo) in taps {
                a0 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(xp.add(xo + c0)),
                    _mm256_loadu_ps(wp.add(wo + c0)),
                    a0,
                );
            }
            _mm256_storeu_ps(ap.add(c0), a0);
        }
        c0 += 8;
    }
    if c0 < c {
        for &(xo, wo) in taps {
            for j in c0..c {
                acc[j] = x[xo + j].mul_add(w[wo + j], acc[j]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The dispatched kernel (AVX2+FMA on this machine) matches the scalar twin up to
        /// FMA rounding, for channel counts hitting every block size and tail.
        #[test]
        fn simd_matches_scalar(
            c in 1usize..80,
            ntaps in 1usize..12,
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut rnd = || (super::super::xorshift(&mut s) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            let x: Vec<f32> = (0..c * 16).map(|_| rnd()).collect();
            let w: Vec<f32> = (0..c * ntaps).map(|_| rnd()).collect();
            let bias: Vec<f32> = (0..c).map(|_| rnd()).collect();
            let taps: Vec<(usize, usize)> =
                (0..ntaps).map(|t| ((t * 7 % 16) * c, t * c)).collect();
            let mut want = bias.clone();
            dw_pixel_scalar(&mut want, &taps, &x, &w);
            let mut got = bias.clone();
            prop_assert!(dw_pixel(&mut got, &taps, &x, &w));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "channel {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn out_of_range_taps_are_refused() {
        let mut acc = vec![0f32; 8];
        let x = vec![1f32; 16];
        let w = vec![1f32; 8];
        assert!(!dw_pixel(&mut acc, &[(9, 0)], &x, &w));
        assert!(!dw_pixel(&mut acc, &[(0, 1)], &x, &w));
        assert!(!dw_pixel(&mut acc, &[(usize::MAX, 0)], &x, &w));
        assert!(dw_pixel(&mut acc, &[(8, 0), (0, 0)], &x, &w));
        assert_eq!(acc, vec![2f32; 8]);
    }
}
