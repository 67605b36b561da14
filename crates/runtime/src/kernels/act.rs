//! f32 activation (GELU, tanh, sigmoid, swish) and softmax loops compiled twice: for the baseline x86-64 target (SSE2) and
//! with AVX2+FMA enabled, the copy picked at run time from [`npuc_isa::Isa::detect`] (so
//! `NPUC_ISA=scalar` forces the baseline one).
//!
//! The loops are plain branch-free Rust (the runtime's polynomial `exp_f32`, selects instead of
//! branches), which LLVM vectorizes 4 lanes wide in the baseline build and 8 lanes wide in the
//! AVX2 build. Neither uses `mul_add` and LLVM does not contract `a * b + c` on its own, so both
//! builds perform the same IEEE operations in the same order: the AVX2 copy is bit-identical to
//! its scalar twin (tested). GELU, tanh and softmax are the exceptions: they fuse their
//! polynomials (`mul_add`, exactly rounded on every level; GELU and tanh are rational forms
//! without exp, softmax rows use a fused exp). GELU, tanh, sigmoid, swish and softmax have
//! hand-interleaved vector copies at AVX2 and AVX-512 ([`interleaved`]: one generic loop over
//! `__m256` / `__m512`, several vectors a step, the one-value functions' operations in order),
//! bit-identical to the twins like the compiled copies. GELU in f32 used to go through f64 and
//! libm's `exp`, a fifth of a ViT-S run, then through an erfc with an exp (twice the operations
//! of the rational form).

use crate::kernels::fmap::map_into_scalar;
use crate::ops::elementwise::exp_f32;
use crate::ops::real::{max_of, sum_of};

/// |x| beyond which [`gelu_f32`] takes `erf(x / sqrt 2)` as +-1: 4 sqrt 2, where erf is
/// within 1.6e-8 of 1 (under f32's spacing there).
const GELU_CLAMP: f32 = 5.656_854;
/// Numerator of [`gelu_f32`]'s `erf(x / sqrt 2) = x P(x^2) / Q(x^2)`, coefficients of
/// s^5 .. s^0 (s = x^2). A rational form fitted on [0, 4 sqrt 2] (iteratively reweighted least
/// squares towards the minimax error: 2.2e-8 in exact arithmetic; evaluated in f32 with fused
/// multiply-adds the erf's absolute error stays below 4e-7).
const GELU_P: [f32; 6] = [
    4.363_784_4e-8,
    1.272_984_1e-5,
    3.538_817_7e-4,
    9.451_842e-3,
    6.938_504e-2,
    7.978_844e-1,
];
/// Denominator coefficients, of s^5 .. s^0.
const GELU_Q: [f32; 6] = [
    1.171_278_1e-6,
    7.602_36e-5,
    1.930_57e-3,
    2.911_926_8e-2,
    2.536_268_2e-1,
    1.0,
];

/// [`exp_f32`] with its products and sums fused (`mul_add`): softmax's copy, about half the
/// vector operations of the unfused one. The fused multiply-add is exactly rounded on every
/// level (the instruction, or libm's `fmaf` in the baseline build), so the vector copies in
/// `interleaved` (`softmax_row_avx2`, `softmax_row_avx512`) give these bits too.
#[inline(always)]
fn exp_fma_f32(x: f32) -> f32 {
    use crate::ops::elementwise::exp_consts::*;
    let xc = x.clamp(LO, HI);
    let t = xc.mul_add(LOG2E, MAGIC);
    let n = t - MAGIC;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, xc));
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let e = (p * r).mul_add(r, r) + 1.0;
    crate::ops::elementwise::exp_finish(x, e, ni)
}

/// GELU `x/2 * (1 + erf(x / sqrt 2))` in f32, branch-free: erf as the rational form
/// `x P(x^2) / Q(x^2)` on x clamped to [`GELU_CLAMP`], then limited to [-1, 1], and
/// `x/2 + x/2 * erf` in one fused multiply-add. The erf is accurate in absolute terms (below
/// 4e-7), not relative to `1 + erf` in the negative tail: GELU of x below about -4 is a few
/// 1e-7 |x| off its tiny true value (it was exact to 2e-5 relative there with an erfc and an
/// exp, at twice the cost: the products after a GELU add such values to ones near 1). Below
/// `-GELU_CLAMP` the result is -0 (also for -inf, where `x/2 (1 + erf)` would be NaN).
#[inline(always)]
pub fn gelu_f32(x: f32) -> f32 {
    let e = odd_rational_unit(x, GELU_CLAMP, &GELU_P, &GELU_Q);
    let half = 0.5 * x;
    let g = half.mul_add(e, half);
    if x < -GELU_CLAMP {
        -0.0
    } else {
        g
    }
}

/// Clamp of [`tanh_f32`]'s argument: at 9, tanh is 1 in f32 and the rational form gives 1.
const TANH_CLAMP: f32 = 9.0;
/// Below this |x|, tanh(x) is x in f32 (the first dropped term, x^3/3, is under half an ulp).
const TANH_TINY: f32 = 0.0004;
/// [`tanh_f32`]'s numerator coefficients, of x^13, x^11, ..., x^1 (the odd minimax rational
/// form Eigen's and MLAS's float tanh use).
const TANH_P: [f32; 7] = [
    -2.760_768_5e-16,
    2.000_188e-13,
    -8.604_672e-11,
    5.122_297e-8,
    1.485_722_4e-5,
    6.372_619_3e-4,
    4.893_524_6e-3,
];
/// Denominator coefficients, of x^6, x^4, x^2, x^0.
const TANH_Q: [f32; 4] = [1.198_258_4e-6, 1.185_347_1e-4, 2.268_434_6e-3, 4.893_525e-3];

/// `v` limited to `[lo, hi]`, NaN kept: the scalar form of `min(hi, max(lo, v))` with the
/// vector instructions' operand order (they return the second operand when one is NaN).
/// Written as the two selects in sequence, each `maxps`/`minps`'s own pattern, so the compiled
/// loops use one instruction per bound: the nested form (both compares on `v`) compiled to
/// compares and blends, and tanh and GELU ran 1.4x slower at AVX2.
#[inline(always)]
fn clamp_keep_nan(v: f32, lo: f32, hi: f32) -> f32 {
    let t = if v < lo { lo } else { v };
    if t > hi {
        hi
    } else {
        t
    }
}

/// The odd rational form of [`tanh_f32`] and of [`gelu_f32`]'s erf: `xc P(xc²) / Q(xc²)` with
/// `xc` = x clamped to ±`clamp`, limited to [-1, 1] (NaN kept). `p` and `q` hold the
/// coefficients from the highest power of `xc²` down, each polynomial one chain of fused
/// multiply-adds ([`odd_rational_unit16xn`] does the same operations on vectors).
#[inline(always)]
fn odd_rational_unit(x: f32, clamp: f32, p: &[f32], q: &[f32]) -> f32 {
    let xc = clamp_keep_nan(x, -clamp, clamp);
    let s = xc * xc;
    let mut pv = p[0];
    for &c in &p[1..] {
        pv = pv.mul_add(s, c);
    }
    let mut qv = q[0];
    for &c in &q[1..] {
        qv = qv.mul_add(s, c);
    }
    clamp_keep_nan(xc * pv / qv, -1.0, 1.0)
}

/// `tanh(x)` in f32, branch-free: a rational minimax form `x·P(x²) / Q(x²)` on x clamped to
/// ±[`TANH_CLAMP`], the quotient limited to ±1 (the form overshoots by up to 2 ulp near 8.5),
/// x itself below [`TANH_TINY`]. One division and ten fused multiply-adds, no exp: 3x faster
/// than the exp form at AVX-512. Relative error 2.8e-7 over |x| < 12 (f32 simulation). NaN
/// stays NaN. Every level uses the same fused operations in the same order, so the
/// dispatched loops equal this function bit for bit.
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    let r = odd_rational_unit(x, TANH_CLAMP, &TANH_P, &TANH_Q);
    if x.abs() < TANH_TINY {
        x
    } else {
        r
    }
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid_f32(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// Softmax of one row in place: `exp(x - max) / sum`, the exp with fused multiply-adds
/// ([`exp_fma_f32`]: about half the vector operations of the unfused one; PP-OCRv6 rec's
/// 40 x 6906 softmax was 1.3x onnxruntime's with the unfused one).
#[inline(always)]
fn softmax_body(row: &mut [f32]) {
    if row.is_empty() {
        return;
    }
    let m = max_of(row);
    for v in row.iter_mut() {
        *v = exp_fma_f32(*v - m);
    }
    let inv = 1.0 / sum_of(row);
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// An elementwise loop, its scalar twin (`$scalar`, public so tests compare against it), the
/// AVX2 and AVX-512 copies and the dispatcher `$name`. The compiled copies are the same safe
/// Rust compiled 8 and 16 lanes wide: the same IEEE operations in the same order (no
/// contraction), so they equal the scalar twin bit for bit; or, given as `avx2: path, avx512:
/// path`, hand-written copies (the interleaved vector loops below).
macro_rules! twin_loop {
    // Both vector copies written by hand (unsafe; `$avx2` needs AVX2 and FMA, `$avx512`
    // AVX-512 F): the dispatcher calls them.
    ($(#[$doc:meta])* $name:ident, $scalar:ident, avx2: $avx2:path, avx512: $custom:path, |$v:ident| $body:expr) => {
        $(#[$doc])*
        pub fn $name($v: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            {
                let isa = npuc_isa::Isa::detect();
                if isa.has_avx512() {
                    // SAFETY: the ISA module detected AVX-512F on this CPU (capped by NPUC_ISA).
                    unsafe { $custom($v) };
                    return;
                }
                if isa.has_avx2() {
                    // SAFETY: the ISA module detected AVX2 and FMA on this CPU (capped by
                    // NPUC_ISA).
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
    };
    ($(#[$doc:meta])* $name:ident, $scalar:ident, $avx2:ident, $avx512:ident, |$v:ident| $body:expr) => {
        twin_loop!($(#[$doc])* $name, $scalar, avx2: $avx2, avx512: $avx512, |$v| $body);

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
    /// Exact GELU over a slice, in place: [`gelu_f32`] on every value (at AVX2 and AVX-512 on
    /// interleaved vectors, [`interleaved`]); every level gives the scalar twin's bits.
    gelu,
    gelu_scalar,
    avx2: interleaved::gelu_avx2,
    avx512: interleaved::gelu_avx512,
    |v| v.iter_mut().for_each(|x| *x = gelu_f32(*x))
);
twin_loop!(
    /// Sigmoid over a slice, in place.
    sigmoid,
    sigmoid_scalar,
    avx2: interleaved::sigmoid_avx2,
    avx512: interleaved::sigmoid_avx512,
    |v| v.iter_mut().for_each(|x| *x = sigmoid_f32(*x))
);
twin_loop!(
    /// Swish (`x * sigmoid(x)`, computed as `x / (1 + e^-x)`) over a slice, in place.
    swish,
    swish_scalar,
    avx2: interleaved::swish_avx2,
    avx512: interleaved::swish_avx512,
    |v| v.iter_mut().for_each(|x| *x = swish_f32(*x))
);
twin_loop!(
    /// Tanh over a slice, in place.
    tanh,
    tanh_scalar,
    avx2: interleaved::tanh_avx2,
    avx512: interleaved::tanh_avx512,
    |v| crate::kernels::fmap::via_copy(v, |old, v| map_into_scalar(old, v, &tanh_f32))
);
twin_loop!(
    /// Softmax of one contiguous row, in place.
    softmax_row,
    softmax_row_scalar,
    avx2: interleaved::softmax_row_avx2,
    avx512: interleaved::softmax_row_avx512,
    |v| softmax_body(v)
);

/// `x / (1 + e^-x)`: swish's one-value form.
#[inline(always)]
fn swish_f32(x: f32) -> f32 {
    x / (1.0 + exp_f32(-x))
}

/// The exp-, division- and rational-form activations on several vectors at once: each is a
/// 20-45-deep chain of dependent operations, so one vector per loop iteration (what the
/// compiler's vectorization of the one-value functions gives) leaves the multiply-add units
/// waiting on latency: at AVX2 on Zen 3, sigmoid ran 2.5 ns a value that way, barely ahead of
/// the 4-lane baseline build (3.5). The loops are written once, generic over the vector type
/// ([`Lanes`]: `__m256` with AVX2 + FMA, `__m512` with AVX-512 F), and perform the one-value
/// functions' IEEE operations in the same order (fused exactly where those fuse), so every
/// level gives the scalar twin's bits (the tests below compare them).
#[cfg(target_arch = "x86_64")]
mod interleaved {
    use super::*;
    use crate::ops::elementwise::exp_consts as k;
    use std::arch::x86_64::*;

    /// Vectors carried through each step together at AVX-512 (32 registers).
    const N512: usize = 4;
    /// The same at AVX2 (16 registers): 2 and 4 measured within noise of each other on Zen 3, 1
    /// slower.
    const N256: usize = 2;

    /// The f32 vector operations the loops are written in.
    ///
    /// # Safety
    /// Every method needs the CPU features of its implementation (AVX2 + FMA for `__m256`,
    /// AVX-512 F for `__m512`); they are only called from functions that enable them.
    pub(super) trait Lanes: Copy {
        /// f32 lanes of one vector.
        const WIDTH: usize;
        unsafe fn splat(c: f32) -> Self;
        /// `WIDTH` values from `p` (unaligned).
        unsafe fn load(p: *const f32) -> Self;
        /// `WIDTH` values to `p` (unaligned).
        unsafe fn store(self, p: *mut f32);
        unsafe fn add(self, b: Self) -> Self;
        unsafe fn sub(self, b: Self) -> Self;
        unsafe fn mul(self, b: Self) -> Self;
        unsafe fn div(self, b: Self) -> Self;
        /// `self * b + c`, rounded once.
        unsafe fn fmadd(self, b: Self, c: Self) -> Self;
        /// `c - self * b`, rounded once.
        unsafe fn fnmadd(self, b: Self, c: Self) -> Self;
        /// `min(self, b)`: `b` when either is NaN (the instruction's operand order).
        unsafe fn min(self, b: Self) -> Self;
        /// `max(self, b)`: `b` when either is NaN.
        unsafe fn max(self, b: Self) -> Self;
        /// The sign bit cleared.
        unsafe fn abs(self) -> Self;
        /// The sign bit flipped (scalar negation).
        unsafe fn neg(self) -> Self;
        /// `t` where `self < b` (ordered: false for NaN), else `f`.
        unsafe fn select_lt(self, b: Self, t: Self, f: Self) -> Self;
        /// `t` where `self > b` (ordered), else `f`.
        unsafe fn select_gt(self, b: Self, t: Self, f: Self) -> Self;
        /// [`exp_finish`]'s scale factors `2^n1` and `2^n2` from `t` (`exp`'s rounded
        /// `x log2 e + MAGIC`): `ni = bits(t) - 0x4B40_0000`, `n1 = ni >> 1`, `n2 = ni - n1`.
        unsafe fn exp2_halves(t: Self) -> (Self, Self);
    }

    impl Lanes for __m256 {
        const WIDTH: usize = 8;
        #[inline(always)]
        unsafe fn splat(c: f32) -> Self {
            // SAFETY (every method of this impl): AVX2 and FMA, the trait's contract; loads
            // and stores read/write the 8 values the caller's pointer covers.
            unsafe { _mm256_set1_ps(c) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { _mm256_storeu_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            unsafe { _mm256_add_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            unsafe { _mm256_sub_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            unsafe { _mm256_mul_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn div(self, b: Self) -> Self {
            unsafe { _mm256_div_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn fmadd(self, b: Self, c: Self) -> Self {
            unsafe { _mm256_fmadd_ps(self, b, c) }
        }
        #[inline(always)]
        unsafe fn fnmadd(self, b: Self, c: Self) -> Self {
            unsafe { _mm256_fnmadd_ps(self, b, c) }
        }
        #[inline(always)]
        unsafe fn min(self, b: Self) -> Self {
            unsafe { _mm256_min_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            unsafe { _mm256_max_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn abs(self) -> Self {
            unsafe {
                _mm256_castsi256_ps(_mm256_and_si256(
                    _mm256_castps_si256(self),
                    _mm256_set1_epi32(i32::MAX),
                ))
            }
        }
        #[inline(always)]
        unsafe fn neg(self) -> Self {
            unsafe {
                _mm256_castsi256_ps(_mm256_xor_si256(
                    _mm256_castps_si256(self),
                    _mm256_set1_epi32(i32::MIN),
                ))
            }
        }
        #[inline(always)]
        unsafe fn select_lt(self, b: Self, t: Self, f: Self) -> Self {
            unsafe { _mm256_blendv_ps(f, t, _mm256_cmp_ps::<_CMP_LT_OQ>(self, b)) }
        }
        #[inline(always)]
        unsafe fn select_gt(self, b: Self, t: Self, f: Self) -> Self {
            unsafe { _mm256_blendv_ps(f, t, _mm256_cmp_ps::<_CMP_GT_OQ>(self, b)) }
        }
        #[inline(always)]
        unsafe fn exp2_halves(t: Self) -> (Self, Self) {
            unsafe {
                let ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B40_0000));
                let n1 = _mm256_srai_epi32::<1>(ni);
                let n2 = _mm256_sub_epi32(ni, n1);
                let bias = _mm256_set1_epi32(127);
                let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n1, bias)));
                let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n2, bias)));
                (s1, s2)
            }
        }
    }

    impl Lanes for __m512 {
        const WIDTH: usize = 16;
        #[inline(always)]
        unsafe fn splat(c: f32) -> Self {
            // SAFETY (every method of this impl): AVX-512 F, the trait's contract; loads and
            // stores read/write the 16 values the caller's pointer covers.
            unsafe { _mm512_set1_ps(c) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { _mm512_storeu_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            unsafe { _mm512_add_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            unsafe { _mm512_sub_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            unsafe { _mm512_mul_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn div(self, b: Self) -> Self {
            unsafe { _mm512_div_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn fmadd(self, b: Self, c: Self) -> Self {
            unsafe { _mm512_fmadd_ps(self, b, c) }
        }
        #[inline(always)]
        unsafe fn fnmadd(self, b: Self, c: Self) -> Self {
            unsafe { _mm512_fnmadd_ps(self, b, c) }
        }
        #[inline(always)]
        unsafe fn min(self, b: Self) -> Self {
            unsafe { _mm512_min_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            unsafe { _mm512_max_ps(self, b) }
        }
        #[inline(always)]
        unsafe fn abs(self) -> Self {
            unsafe { _mm512_abs_ps(self) }
        }
        #[inline(always)]
        unsafe fn neg(self) -> Self {
            unsafe {
                _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_castps_si512(self),
                    _mm512_set1_epi32(i32::MIN),
                ))
            }
        }
        #[inline(always)]
        unsafe fn select_lt(self, b: Self, t: Self, f: Self) -> Self {
            unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(self, b), f, t) }
        }
        #[inline(always)]
        unsafe fn select_gt(self, b: Self, t: Self, f: Self) -> Self {
            unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(self, b), f, t) }
        }
        #[inline(always)]
        unsafe fn exp2_halves(t: Self) -> (Self, Self) {
            unsafe {
                let ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B40_0000));
                let n1 = _mm512_srai_epi32::<1>(ni);
                let n2 = _mm512_sub_epi32(ni, n1);
                let bias = _mm512_set1_epi32(127);
                let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n1, bias)));
                let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n2, bias)));
                (s1, s2)
            }
        }
    }

    /// `f` over whole blocks of `N` vectors of `v` (loaded, mapped, stored) and `scalar` over
    /// the rest.
    ///
    /// # Safety
    /// The CPU features of `V` ([`Lanes`]).
    #[inline(always)]
    unsafe fn map_n<V: Lanes, const N: usize>(
        v: &mut [f32],
        f: impl Fn([V; N]) -> [V; N],
        scalar: impl Fn(f32) -> f32,
    ) {
        let mut blocks = v.chunks_exact_mut(V::WIDTH * N);
        for block in &mut blocks {
            // SAFETY: the block holds N * WIDTH values, vector i the i-th WIDTH of them; the
            // features as the contract.
            unsafe {
                let mut x = [V::splat(0.0); N];
                for (i, xi) in x.iter_mut().enumerate() {
                    *xi = V::load(block.as_ptr().add(V::WIDTH * i));
                }
                let y = f(x);
                for (i, yi) in y.iter().enumerate() {
                    yi.store(block.as_mut_ptr().add(V::WIDTH * i));
                }
            }
        }
        for x in blocks.into_remainder() {
            *x = scalar(*x);
        }
    }

    // The vector forms below use indexed loops over `[V; N]`, not closures: a closure is
    // compiled without the entry point's CPU features, and where LLVM keeps it out of line its
    // intrinsics become calls (`array::from_fn` and `map` did that here: 10x slower).

    /// `a * b + c`, fused (`FUSED`) or rounded twice, as the scalar copy does it.
    ///
    /// # Safety
    /// The CPU features of `V`.
    #[inline(always)]
    unsafe fn madd<V: Lanes, const FUSED: bool>(a: V, b: V, c: V) -> V {
        // SAFETY: the features as the contract.
        unsafe {
            if FUSED {
                a.fmadd(b, c)
            } else {
                a.mul(b).add(c)
            }
        }
    }

    /// `min(hi, max(lo, v))`: `clamp`, returning `v` when it is NaN (the second operand).
    ///
    /// # Safety
    /// The CPU features of `V`.
    #[inline(always)]
    unsafe fn limit<V: Lanes>(v: V, lo: f32, hi: f32) -> V {
        // SAFETY: the features as the contract.
        unsafe { V::splat(hi).min(V::splat(lo).max(v)) }
    }

    /// [`exp_fma_f32`] (`FUSED`) or [`exp_f32`] (products and sums rounded apart) on `N`
    /// vectors, operation for operation.
    ///
    /// # Safety
    /// The CPU features of `V`.
    #[inline(always)]
    unsafe fn exp_n<V: Lanes, const N: usize, const FUSED: bool>(x: [V; N]) -> [V; N] {
        // SAFETY: the features as the contract; no memory is touched.
        unsafe {
            let (mut t, mut r) = ([V::splat(0.0); N], [V::splat(0.0); N]);
            for i in 0..N {
                let xc = limit(x[i], k::LO, k::HI);
                t[i] = madd::<V, FUSED>(xc, V::splat(k::LOG2E), V::splat(k::MAGIC));
                let n = t[i].sub(V::splat(k::MAGIC));
                r[i] = if FUSED {
                    n.fnmadd(V::splat(k::LN2_LO), n.fnmadd(V::splat(k::LN2_HI), xc))
                } else {
                    xc.sub(n.mul(V::splat(k::LN2_HI)))
                        .sub(n.mul(V::splat(k::LN2_LO)))
                };
            }
            let mut p = [V::splat(k::P[0]); N];
            for &c in &k::P[1..] {
                for i in 0..N {
                    p[i] = madd::<V, FUSED>(p[i], r[i], V::splat(c));
                }
            }
            let mut y = [V::splat(0.0); N];
            for i in 0..N {
                let e = madd::<V, FUSED>(p[i].mul(r[i]), r[i], r[i]).add(V::splat(1.0));
                let (s1, s2) = V::exp2_halves(t[i]);
                let v = e.mul(s1).mul(s2);
                // Below LO: 0; above HI: infinity; NaN compares false both ways and passes.
                let v = x[i].select_lt(V::splat(k::LO), V::splat(0.0), v);
                y[i] = x[i].select_gt(V::splat(k::HI), V::splat(f32::INFINITY), v);
            }
            y
        }
    }

    /// [`odd_rational_unit`] on `N` vectors, operation for operation.
    ///
    /// # Safety
    /// The CPU features of `V`.
    #[inline(always)]
    unsafe fn odd_rational_unit_n<V: Lanes, const N: usize>(
        x: [V; N],
        clamp: f32,
        p: &[f32],
        q: &[f32],
    ) -> [V; N] {
        // SAFETY: the features as the contract; no memory is touched.
        unsafe {
            let (mut xc, mut s) = ([V::splat(0.0); N], [V::splat(0.0); N]);
            for i in 0..N {
                xc[i] = limit(x[i], -clamp, clamp);
                s[i] = xc[i].mul(xc[i]);
            }
            let mut pv = [V::splat(p[0]); N];
            for &c in &p[1..] {
                for i in 0..N {
                    pv[i] = pv[i].fmadd(s[i], V::splat(c));
                }
            }
            let mut qv = [V::splat(q[0]); N];
            for &c in &q[1..] {
                for i in 0..N {
                    qv[i] = qv[i].fmadd(s[i], V::splat(c));
                }
            }
            for i in 0..N {
                xc[i] = limit(xc[i].mul(pv[i]).div(qv[i]), -1.0, 1.0);
            }
            xc
        }
    }

    /// [`gelu_f32`] on `N` vectors.
    ///
    /// # Safety
    /// The CPU features of `V`.
    #[inline(always)]
    unsafe fn gelu_n<V: Lanes, const N: usize>(x: [V; N]) -> [V; N] {
        // SAFETY: the features as the contract.
        unsafe {
            let mut e = odd_rational_unit_n(x, GELU_CLAMP, &GELU_P, &GELU_Q);
            for i in 0..N {
                let half = V::splat(0.5).mul(x[i]);
                let g = half.fmadd(e[i], half);
                e[i] = x[i].select_lt(V::splat(-GELU_CLAMP), V::splat(-0.0), g);
            }
            e
        }
    }

    /// [`sigmoid_f32`] on `N` vectors.
    ///
    /// # Safety
    /// The CPU features of `V`.
    #[inline(always)]
    unsafe fn sigmoid_n<V: Lanes, const N: usize>(mut x: [V; N]) -> [V; N] {
        // SAFETY: the features as the contract.
        unsafe {
            for xi in &mut x {
                *xi = xi.neg();
            }
            let mut e = exp_n::<V, N, false>(x);
            for ei in &mut e {
                *ei = V::splat(1.0).div(V::splat(1.0).add(*ei));
            }
            e
        }
    }

    /// [`swish_f32`] on `N` vectors.
    ///
    /// # Safety
    /// The CPU features of `V`.
    #[inline(always)]
    unsafe fn swish_n<V: Lanes, const N: usize>(x: [V; N]) -> [V; N] {
        // SAFETY: the features as the contract.
        unsafe {
            let mut nx = x;
            for v in &mut nx {
                *v = v.neg();
            }
            let mut e = exp_n::<V, N, false>(nx);
            for i in 0..N {
                e[i] = x[i].div(V::splat(1.0).add(e[i]));
            }
            e
        }
    }

    /// [`tanh_f32`] on `N` vectors.
    ///
    /// # Safety
    /// The CPU features of `V`.
    #[inline(always)]
    unsafe fn tanh_n<V: Lanes, const N: usize>(x: [V; N]) -> [V; N] {
        // SAFETY: the features as the contract.
        unsafe {
            let mut r = odd_rational_unit_n(x, TANH_CLAMP, &TANH_P, &TANH_Q);
            for i in 0..N {
                r[i] = x[i].abs().select_lt(V::splat(TANH_TINY), x[i], r[i]);
            }
            r
        }
    }

    /// `exp(x - m)` on `N` vectors, fused as [`exp_fma_f32`].
    ///
    /// # Safety
    /// The CPU features of `V`.
    #[inline(always)]
    unsafe fn exp_shifted_n<V: Lanes, const N: usize>(mut x: [V; N], m: f32) -> [V; N] {
        // SAFETY: the features as the contract.
        unsafe {
            for xi in &mut x {
                *xi = xi.sub(V::splat(m));
            }
            exp_n::<V, N, true>(x)
        }
    }

    /// The dispatched entry points of the mapped activations: `$vector` on interleaved
    /// vectors, `$one` on the remainder, at each level.
    macro_rules! entries {
        ($($avx2:ident, $avx512:ident: $vector:ident, $one:ident;)*) => {$(
            /// # Safety
            /// AVX2 and FMA.
            #[target_feature(enable = "avx2,fma")]
            pub(super) unsafe fn $avx2(v: &mut [f32]) {
                // SAFETY: AVX2 and FMA, the features of `__m256`.
                unsafe { map_n::<__m256, N256>(v, |x| $vector(x), $one) }
            }
            /// # Safety
            /// AVX-512 F.
            #[target_feature(enable = "avx512f")]
            pub(super) unsafe fn $avx512(v: &mut [f32]) {
                // SAFETY: AVX-512 F, the features of `__m512`.
                unsafe { map_n::<__m512, N512>(v, |x| $vector(x), $one) }
            }
        )*};
    }

    entries! {
        gelu_avx2, gelu_avx512: gelu_n, gelu_f32;
        sigmoid_avx2, sigmoid_avx512: sigmoid_n, sigmoid_f32;
        swish_avx2, swish_avx512: swish_n, swish_f32;
        tanh_avx2, tanh_avx512: tanh_n, tanh_f32;
    }

    /// [`softmax_body`] with the exps on interleaved vectors (the max and sum as it takes
    /// them), at each level.
    macro_rules! softmax_entries {
        ($($entry:ident: $features:literal, $v:ty, $n:expr;)*) => {$(
            /// # Safety
            /// The CPU features named.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $entry(row: &mut [f32]) {
                if row.is_empty() {
                    return;
                }
                let m = max_of(row);
                // SAFETY: the features `$v` needs, enabled here.
                unsafe {
                    map_n::<$v, { $n }>(row, |x| exp_shifted_n(x, m), |x| exp_fma_f32(x - m))
                };
                let inv = 1.0 / sum_of(row);
                for v in row.iter_mut() {
                    *v *= inv;
                }
            }
        )*};
    }

    softmax_entries! {
        softmax_row_avx2: "avx2,fma", __m256, N256;
        softmax_row_avx512: "avx512f", __m512, N512;
    }
}

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

/// Values per block of [`max_taps_into`]: every tap's run of a block is folded while the
/// block's running maximum sits in L1.
const MAX_TAPS_BLOCK: usize = 256;

/// Taps whose slices [`max_taps_into`] holds at once (a 4x4 window; larger ones fold in groups).
const MAX_TAPS_GROUP: usize = 16;

/// `dst[i]` = the maximum over taps `t < taps` of `tap(t)[i]` that skips NaN taps (a NaN
/// running maximum takes the next value, a NaN value never wins; equal values and signed zeros
/// keep the earlier tap), and 0 where every tap is NaN: a max pool's outputs whose windows lie
/// inside the input, each tap a slice at least `dst.len()` long. One pass over each tap per
/// block of [`MAX_TAPS_BLOCK`] values, nothing copied in between (a running maximum kept in
/// the output row and a NaN pass after it read the row back per tap: PP-OCRv6 det's 2x2
/// stride-1 pool took 5x onnxruntime's time). The taps' slices are taken once per call, up to
/// [`MAX_TAPS_GROUP`] at a time (per 64-value block, the tap closure's index arithmetic and
/// the blocks' setup cost more than the selects: that pool 0.48 ms against onnxruntime's 0.12). The scalar twin is [`max_taps_into_scalar`];
/// the AVX2 and AVX-512 copies are the same compare-and-select, bit-identical (it only
/// selects). `taps` = 0 writes zeros.
pub fn max_taps_into<'a>(dst: &mut [f32], taps: usize, tap: impl Fn(usize) -> &'a [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = npuc_isa::Isa::detect();
        if isa.has_avx512() {
            // SAFETY: the ISA module detected AVX-512F on this CPU (capped by NPUC_ISA); the
            // body is safe Rust over the slices.
            unsafe { max_taps_into_avx512(dst, taps, tap) };
            return;
        }
        if isa.has_avx2() {
            // SAFETY: as above, AVX2 and FMA.
            unsafe { max_taps_into_avx2(dst, taps, tap) };
            return;
        }
    }
    max_taps_into_scalar(dst, taps, tap)
}

/// The scalar twin of [`max_taps_into`].
#[inline(always)]
pub fn max_taps_into_scalar<'a>(dst: &mut [f32], taps: usize, tap: impl Fn(usize) -> &'a [f32]) {
    let n = dst.len();
    if n == 0 {
        return;
    }
    if taps == 0 {
        dst.fill(0.0);
        return;
    }
    let mut g0 = 0;
    while g0 < taps {
        let g1 = (g0 + MAX_TAPS_GROUP).min(taps);
        let mut srcs: [&[f32]; MAX_TAPS_GROUP] = [&[]; MAX_TAPS_GROUP];
        for (s, t) in srcs.iter_mut().zip(g0..g1) {
            *s = &tap(t)[..n];
        }
        max_taps_group(dst, &srcs[..g1 - g0], g0 > 0, g1 == taps);
        g0 = g1;
    }
}

/// Folds `srcs` (each `dst.len()` long) into running maxima, block by block: starting from
/// `dst` when `resume` (the maxima of earlier taps), from `srcs[0]` otherwise (what a NaN start
/// takes); `finish` writes 0 where the maximum is NaN. The first select reads `srcs[0]` in
/// place and the last one writes `dst`: a 2x2 window is three passes, nothing copied.
#[inline(always)]
fn max_taps_group(dst: &mut [f32], srcs: &[&[f32]], resume: bool, finish: bool) {
    let n = dst.len();
    // The running maximum moves between two blocks (read one, write the other): selected
    // in place, the select becomes a masked store at AVX2, slow on AMD cores.
    let (mut a, mut b) = ([0f32; MAX_TAPS_BLOCK], [0f32; MAX_TAPS_BLOCK]);
    let rest = if resume { srcs } else { &srcs[1..] };
    let mut i0 = 0;
    while i0 < n {
        let len = MAX_TAPS_BLOCK.min(n - i0);
        let d = &mut dst[i0..i0 + len];
        let (mut cur, mut next) = (&mut a[..len], &mut b[..len]);
        if rest.is_empty() {
            // One tap, no earlier maxima.
            max_select_into(d, &srcs[0][i0..i0 + len], None, finish);
        } else if resume {
            cur.copy_from_slice(d);
        }
        for (j, src) in rest.iter().enumerate() {
            let v = &src[i0..i0 + len];
            let m: &[f32] = if j == 0 && !resume {
                &srcs[0][i0..i0 + len]
            } else {
                cur
            };
            if j + 1 == rest.len() {
                max_select_into(d, m, Some(v), finish);
            } else {
                max_select_into(next, m, Some(v), false);
                std::mem::swap(&mut cur, &mut next);
            }
        }
        i0 += len;
    }
}

/// `out[i]` = `v[i]` where it wins over the running maximum `m[i]` (larger, or `m[i]` NaN),
/// else `m[i]` (`m` as is without `v`); with `finish`, 0 where that is NaN. `out` is neither
/// `m` nor `v`.
#[inline(always)]
fn max_select_into(out: &mut [f32], m: &[f32], v: Option<&[f32]>, finish: bool) {
    #[inline(always)]
    fn pick(m: f32, v: f32) -> f32 {
        #[allow(clippy::eq_op)] // `m != m`: the running maximum is NaN
        let take = v > m || m != m;
        if take {
            v
        } else {
            m
        }
    }
    #[inline(always)]
    fn zero_nan(x: f32) -> f32 {
        #[allow(clippy::eq_op)] // `x != x`: every tap was NaN
        let none = x != x;
        if none {
            0.0
        } else {
            x
        }
    }
    match (v, finish) {
        (Some(v), false) => {
            for ((o, &m), &v) in out.iter_mut().zip(m).zip(v) {
                *o = pick(m, v);
            }
        }
        (Some(v), true) => {
            for ((o, &m), &v) in out.iter_mut().zip(m).zip(v) {
                *o = zero_nan(pick(m, v));
            }
        }
        (None, false) => out.copy_from_slice(m),
        (None, true) => {
            for (o, &m) in out.iter_mut().zip(m) {
                *o = zero_nan(m);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn max_taps_into_avx2<'a>(dst: &mut [f32], taps: usize, tap: impl Fn(usize) -> &'a [f32]) {
    max_taps_into_scalar(dst, taps, tap)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn max_taps_into_avx512<'a>(dst: &mut [f32], taps: usize, tap: impl Fn(usize) -> &'a [f32]) {
    max_taps_into_scalar(dst, taps, tap)
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
    |v, a, _unused| crate::kernels::fmap::via_copy(v, |old, v| map_into_scalar(old, v, &|x: f32| if x < 0.0 {
        a * x
    } else {
        x
    }))
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

    /// The interleaved AVX-512 loops (blocks of 64 values) against the scalar twins: a sweep
    /// through both tails (exp's argument below its lower clamp from |x| ~ 13.2), signed
    /// zeros, infinities, NaN and huge values, several blocks long with a remainder.
    #[test]
    fn gelu_blocks_equal_scalar_twin_on_special_values() {
        let mut v: Vec<f32> = (0..300).map(|i| -15.0 + i as f32 * 0.1003).collect();
        v.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e30,
            -1e30,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            13.2,
            -13.2,
        ]);
        let (mut a, mut b) = (v.clone(), v.clone());
        gelu(&mut a);
        gelu_scalar(&mut b);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x.to_bits(), y.to_bits(), "gelu({}): {x} vs {y}", v[i]);
        }
        assert!(a[304].is_nan() && a[300] == 0.0 && a[302] == f32::INFINITY);
        // The hand-interleaved sigmoid, swish, tanh (blocks of 64 with a remainder) on the
        // same values: equal to the scalar twin and to the one-value function.
        type Pair = (&'static str, fn(&mut [f32]), fn(&mut [f32]), fn(f32) -> f32);
        let pairs: [Pair; 3] = [
            ("sigmoid", sigmoid, sigmoid_scalar, sigmoid_f32),
            ("swish", swish, swish_scalar, |x| x / (1.0 + exp_f32(-x))),
            ("tanh", tanh, tanh_scalar, tanh_f32),
        ];
        for (name, fast, twin, one) in pairs {
            let (mut a, mut b) = (v.clone(), v.clone());
            fast(&mut a);
            twin(&mut b);
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                let z = one(v[i]);
                assert_eq!(x.to_bits(), y.to_bits(), "{name}({}): {x} vs {y}", v[i]);
                assert_eq!(x.to_bits(), z.to_bits(), "{name}({}): {x} vs {z}", v[i]);
            }
        }
        // Softmax over rows of several blocks with a remainder, large and tiny values.
        for len in [1usize, 63, 64, 65, 200] {
            let row: Vec<f32> = (0..len)
                .map(|i| v[(i * 7) % v.len()])
                .map(|x| {
                    if x.is_finite() {
                        x.clamp(-90.0, 90.0)
                    } else {
                        0.0
                    }
                })
                .collect();
            let (mut a, mut b) = (row.clone(), row.clone());
            softmax_row(&mut a);
            softmax_row_scalar(&mut b);
            assert_eq!(bits(&a), bits(&b), "softmax of {len}");
        }
    }

    #[test]
    fn gelu_f32_matches_the_f64_definition() {
        let mut x = -14.0f32;
        while x < 14.0 {
            let (got, want) = (gelu_f32(x) as f64, gelu_ref(x));
            // The contract: Phi(x) = (1 + erf(x / sqrt 2)) / 2 to within 2^-22 absolute (four
            // units of f32's spacing below 1), so GELU = x Phi(x) within 2^-22 |x|, plus the
            // result's own rounding (2^-24 relative).
            let bound = (2f64.powi(-22) * x.abs() as f64) + 2f64.powi(-24) * want.abs();
            assert!(
                (got - want).abs() <= bound,
                "gelu({x}) = {got}, want {want} (error {:.3e}, bound {bound:.3e})",
                (got - want).abs()
            );
            x += 0.000731;
        }
        assert_eq!(gelu_f32(0.0), 0.0);
        assert_eq!(gelu_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu_f32(f32::NEG_INFINITY), 0.0);
        assert!(gelu_f32(f32::NAN).is_nan());
        // Signs: GELU of a negative value is never positive, of a positive one never above it.
        for i in 1..20000 {
            let x = i as f32 * 0.001;
            assert!(gelu_f32(-x) <= 0.0 && gelu_f32(x) <= x, "gelu(+-{x})");
        }
    }

    #[test]
    fn tanh_f32_matches_libm() {
        let mut x = -12.0f32;
        while x < 12.0 {
            let (got, want) = (tanh_f32(x) as f64, (x as f64).tanh());
            // 3e-7 relative: the rational form's minimax error plus its f32 rounding (2.8e-7
            // in an f32 simulation, near x = 0.0157).
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

        /// The max pool's select loop equals its twin bit for bit, and follows the pool's
        /// rule (a NaN running maximum takes the next value, a NaN value never wins; equal
        /// values and signed zeros keep the first), with NaN and signed zeros in the data.
        #[test]
        fn max_taps_equal_scalar_twin_and_definition(
            picks in proptest::collection::vec((0u8..6, -5.0f32..5.0), 0..700),
            // Past MAX_TAPS_GROUP: groups after the first resume from the output.
            taps in prop_oneof![0usize..5, 15usize..40],
        ) {
            let special = |k: u8, x: f32| match k {
                0 => f32::NAN,
                1 => 0.0,
                2 => -0.0,
                _ => x,
            };
            // Tap t reads the data from offset t (the shifted rows of a pool window).
            let data: Vec<f32> = picks.iter().map(|p| special(p.0, p.1)).collect();
            let n = data.len().saturating_sub(taps);
            let tap = |t: usize| &data[t..];
            let (mut a, mut b) = (vec![7.0f32; n], vec![7.0f32; n]);
            max_taps_into(&mut a, taps, tap);
            max_taps_into_scalar(&mut b, taps, tap);
            prop_assert_eq!(bits(&a), bits(&b), "max_taps_into");
            for (i, &got) in a.iter().enumerate() {
                let mut m = f32::NAN;
                for t in 0..taps {
                    let v = data[t + i];
                    if v > m || m.is_nan() {
                        m = v;
                    }
                }
                let want = if m.is_nan() { 0.0 } else { m };
                prop_assert_eq!(got.to_bits(), want.to_bits(), "value {}", i);
            }
            prop_assert!(a.iter().all(|x| !x.is_nan()));
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
