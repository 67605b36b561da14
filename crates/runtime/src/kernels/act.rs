//! f32 activation (GELU, tanh, sigmoid, swish) and softmax loops compiled twice: for the baseline x86-64 target (SSE2) and
//! with AVX2+FMA enabled, the copy picked at run time from [`npuc_isa::Isa::detect`] (so
//! `NPUC_ISA=scalar` forces the baseline one).
//!
//! The loops are plain branch-free Rust (the runtime's polynomial `exp_f32`, selects instead of
//! branches), which LLVM vectorizes 4 lanes wide in the baseline build and 8 lanes wide in the
//! AVX2 build. Neither uses `mul_add` and LLVM does not contract `a * b + c` on its own, so both
//! builds perform the same IEEE operations in the same order: the AVX2 copy is bit-identical to
//! its scalar twin (tested). Exact GELU in f32 used to go through f64 and libm's `exp`, a fifth
//! of a ViT-S run.

use crate::ops::elementwise::exp_f32;
use crate::ops::real::{max_of, sum_of};

/// `erfc(z)` for `z >= 0` (Numerical Recipes `erfcc`, relative error below 1.2e-7 in exact
/// arithmetic) evaluated in f32: the relative error of the result stays near 1e-6 in the tail
/// where it is dominated by the f32 rounding of `-z * z` in the exponent.
#[inline(always)]
fn erfc_pos_f32(z: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.5 * z);
    let p = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_9 + t * (-0.822_152_2 + t * 0.170_872_77))))))));
    t * exp_f32(p - z * z)
}

/// Exact GELU `x/2 * (1 + erf(x / sqrt 2))` in f32, written with erfc so neither tail cancels.
#[inline(always)]
pub fn gelu_f32(x: f32) -> f32 {
    let e = erfc_pos_f32((x * std::f32::consts::FRAC_1_SQRT_2).abs());
    let half = 0.5 * x;
    if x >= 0.0 {
        half * (2.0 - e)
    } else {
        half * e
    }
}

/// `tanh(x)` in f32, branch-free (Cephes `tanhf`): an odd polynomial below 0.625, where
/// `1 - 2 / (e^2|x| + 1)` would cancel, and that form above it (with |x| clamped at 10, where
/// tanh is 1 in f32); relative error 1.3e-7 measured over |x| < 12. NaN stays NaN.
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let small =
        ((((-5.704_988_7e-3 * z + 2.063_909e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z
            - 3.333_328e-1)
            * z
            * x
            + x;
    let big = 1.0 - 2.0 / (exp_f32(2.0 * a.clamp(0.0, 10.0)) + 1.0);
    let big = if x < 0.0 { -big } else { big };
    if a < 0.625 {
        small
    } else {
        big
    }
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid_f32(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// Softmax of one row in place: `exp(x - max) / sum`.
#[inline(always)]
fn softmax_body(row: &mut [f32]) {
    if row.is_empty() {
        return;
    }
    let m = max_of(row);
    for v in row.iter_mut() {
        *v = exp_f32(*v - m);
    }
    let inv = 1.0 / sum_of(row);
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// An elementwise loop, its scalar twin (`$scalar`, public so tests compare against it), the
/// AVX2 and AVX-512 copies and the dispatcher `$name`. The AVX-512 copy is the same safe Rust
/// compiled 16 lanes wide: the same IEEE operations in the same order (no contraction), so it
/// too equals the scalar twin bit for bit.
macro_rules! twin_loop {
    ($(#[$doc:meta])* $name:ident, $scalar:ident, $avx2:ident, $avx512:ident, |$v:ident| $body:expr) => {
        $(#[$doc])*
        pub fn $name($v: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            {
                let isa = npuc_isa::Isa::detect();
                if isa.has_avx512() {
                    // SAFETY: the ISA module detected AVX-512F (with AVX2 and FMA) on this CPU
                    // (capped by NPUC_ISA); the body is safe Rust over the slice.
                    unsafe { $avx512($v) };
                    return;
                }
                if isa.has_avx2() {
                    // SAFETY: the ISA module detected AVX2 and FMA on this CPU (capped by
                    // NPUC_ISA); the body is safe Rust over the slice.
                    unsafe { $avx2($v) };
                    return;
                }
            }
            $scalar($v)
        }

        /// The scalar twin (baseline target) of the dispatched loop.
        pub fn $scalar($v: &mut [f32]) {
            $body
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $avx2($v: &mut [f32]) {
            $body
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn $avx512($v: &mut [f32]) {
            $body
        }
    };
}

twin_loop!(
    /// Exact GELU over a slice, in place.
    gelu,
    gelu_scalar,
    gelu_avx2,
    gelu_avx512,
    |v| v.iter_mut().for_each(|x| *x = gelu_f32(*x))
);
twin_loop!(
    /// Sigmoid over a slice, in place.
    sigmoid,
    sigmoid_scalar,
    sigmoid_avx2,
    sigmoid_avx512,
    |v| v.iter_mut().for_each(|x| *x = sigmoid_f32(*x))
);
twin_loop!(
    /// Swish (`x * sigmoid(x)`, computed as `x / (1 + e^-x)`) over a slice, in place.
    swish,
    swish_scalar,
    swish_avx2,
    swish_avx512,
    |v| v.iter_mut().for_each(|x| *x /= 1.0 + exp_f32(-*x))
);
twin_loop!(
    /// Tanh over a slice, in place.
    tanh,
    tanh_scalar,
    tanh_avx2,
    tanh_avx512,
    |v| v.iter_mut().for_each(|x| *x = tanh_f32(*x))
);
twin_loop!(
    /// Softmax of one contiguous row, in place.
    softmax_row,
    softmax_row_scalar,
    softmax_row_avx2,
    softmax_row_avx512,
    |v| softmax_body(v)
);

/// [`twin_loop!`] for loops with two `f32` parameters (clip bounds, hard-sigmoid slope and
/// offset): the parameters are passed through to all three copies.
macro_rules! twin_loop2 {
    ($(#[$doc:meta])* $name:ident, $scalar:ident, $avx2:ident, $avx512:ident, |$v:ident, $a:ident, $b:ident| $body:expr) => {
        $(#[$doc])*
        pub fn $name($v: &mut [f32], $a: f32, $b: f32) {
            #[cfg(target_arch = "x86_64")]
            {
                let isa = npuc_isa::Isa::detect();
                if isa.has_avx512() {
                    // SAFETY: the ISA module detected AVX-512F (with AVX2 and FMA) on this CPU
                    // (capped by NPUC_ISA); the body is safe Rust over the slice.
                    unsafe { $avx512($v, $a, $b) };
                    return;
                }
                if isa.has_avx2() {
                    // SAFETY: the ISA module detected AVX2 and FMA on this CPU (capped by
                    // NPUC_ISA); the body is safe Rust over the slice.
                    unsafe { $avx2($v, $a, $b) };
                    return;
                }
            }
            $scalar($v, $a, $b)
        }

        /// The scalar twin (baseline target) of the dispatched loop.
        pub fn $scalar($v: &mut [f32], $a: f32, $b: f32) {
            $body
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $avx2($v: &mut [f32], $a: f32, $b: f32) {
            $body
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn $avx512($v: &mut [f32], $a: f32, $b: f32) {
            $body
        }
    };
}

twin_loop!(
    /// ReLU over a slice, in place.
    relu,
    relu_scalar,
    relu_avx2,
    relu_avx512,
    |v| v.iter_mut().for_each(|x| *x = x.max(0.0))
);
twin_loop2!(
    /// Clip to `[lo, hi]` over a slice, in place (`max` then `min`, as the scalar op did).
    clip,
    clip_scalar,
    clip_avx2,
    clip_avx512,
    |v, lo, hi| v.iter_mut().for_each(|x| *x = x.max(lo).min(hi))
);
twin_loop2!(
    /// HardSigmoid `max(0, min(1, a * x + b))` over a slice, in place.
    hard_sigmoid,
    hard_sigmoid_scalar,
    hard_sigmoid_avx2,
    hard_sigmoid_avx512,
    |v, a, b| v.iter_mut().for_each(|x| *x = (a * *x + b).clamp(0.0, 1.0))
);
twin_loop2!(
    /// HardSwish `x * max(0, min(1, a * x + b))` over a slice, in place.
    hard_swish,
    hard_swish_scalar,
    hard_swish_avx2,
    hard_swish_avx512,
    |v, a, b| v.iter_mut().for_each(|x| *x *= (a * *x + b).clamp(0.0, 1.0))
);
twin_loop2!(
    /// LeakyRelu `x < 0 ? a * x : x` over a slice, in place (`_unused` keeps the two-parameter
    /// shape).
    leaky_relu,
    leaky_relu_scalar,
    leaky_relu_avx2,
    leaky_relu_avx512,
    |v, a, _unused| v.iter_mut().for_each(|x| *x = if *x < 0.0 { a * *x } else { *x })
);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// GELU from the erf definition in f64 with libm's `erfc`-free series: the runtime's f64
    /// GELU (`ops::fused::gelu`, relative error below 3e-7 against high-precision values).
    fn gelu_ref(x: f32) -> f64 {
        crate::ops::fused::gelu(x as f64)
    }

    #[test]
    fn gelu_f32_matches_the_f64_definition() {
        let mut x = -14.0f32;
        while x < 14.0 {
            let (got, want) = (gelu_f32(x) as f64, gelu_ref(x));
            // 2e-5 relative: the exponent -z^2 (up to -98 here) is rounded to f32, whose
            // spacing near 82 is 7.6e-6 relative to e^-z^2; measured 1.74e-5 at x = -12.8 and
            // 3.9e-6 for |x| < 6. The absolute floor covers values below f32's normal range.
            assert!(
                (got - want).abs() <= 2e-5 * want.abs() + 1e-37,
                "gelu({x}) = {got}, want {want}"
            );
            x += 0.00731;
        }
        assert_eq!(gelu_f32(0.0), 0.0);
        assert_eq!(gelu_f32(f32::INFINITY), f32::INFINITY);
        assert!(gelu_f32(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_f32_matches_libm() {
        let mut x = -12.0f32;
        while x < 12.0 {
            let (got, want) = (tanh_f32(x) as f64, (x as f64).tanh());
            // 3e-7 relative: Cephes tanhf's polynomial (1.3e-7 measured) plus exp_f32's 4e-7
            // scaled by 2/(e^2|x|+1) <= 0.45 on the exponential branch.
            assert!(
                (got - want).abs() <= 3e-7 * want.abs(),
                "tanh({x}) = {got}, want {want}"
            );
            x += 0.000_937;
        }
        assert_eq!(tanh_f32(0.0), 0.0);
        assert_eq!(tanh_f32(30.0), 1.0);
        assert_eq!(tanh_f32(f32::NEG_INFINITY), -1.0);
        assert!(tanh_f32(f32::NAN).is_nan());
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    proptest! {
        /// The dispatched loops (AVX2 on a host that has it) equal their scalar twins bit for
        /// bit, at lengths covering the vector tails.
        #[test]
        fn dispatched_loops_equal_scalar_twins(
            v in proptest::collection::vec(-30.0f32..30.0, 0..70),
        ) {
            type Pair = (fn(&mut [f32]), fn(&mut [f32]));
            let pairs: [Pair; 5] = [
                (gelu, gelu_scalar),
                (tanh, tanh_scalar),
                (sigmoid, sigmoid_scalar),
                (swish, swish_scalar),
                (softmax_row, softmax_row_scalar),
            ];
            for (i, (fast, twin)) in pairs.into_iter().enumerate() {
                let (mut a, mut b) = (v.clone(), v.clone());
                fast(&mut a);
                twin(&mut b);
                prop_assert_eq!(bits(&a), bits(&b), "loop {}", i);
            }
            type Pair2 = (fn(&mut [f32], f32, f32), fn(&mut [f32], f32, f32));
            let pairs2: [Pair2; 4] = [
                (clip, clip_scalar),
                (hard_sigmoid, hard_sigmoid_scalar),
                (hard_swish, hard_swish_scalar),
                (leaky_relu, leaky_relu_scalar),
            ];
            for (i, (fast, twin)) in pairs2.into_iter().enumerate() {
                let (mut a, mut b) = (v.clone(), v.clone());
                fast(&mut a, 0.2, 0.5);
                twin(&mut b, 0.2, 0.5);
                prop_assert_eq!(bits(&a), bits(&b), "two-parameter loop {}", i);
            }
            let (mut a, mut b) = (v.clone(), v.clone());
            relu(&mut a);
            relu_scalar(&mut b);
            prop_assert_eq!(bits(&a), bits(&b), "relu");
        }
    }

    #[test]
    fn softmax_row_sums_to_one() {
        let mut row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin() * 30.0).collect();
        softmax_row(&mut row);
        let s: f32 = row.iter().sum();
        assert!((s - 1.0).abs() < 1e-5);
    }
}
