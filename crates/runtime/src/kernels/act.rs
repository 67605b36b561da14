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
//! without exp, softmax rows use a fused exp) and have hand-interleaved AVX-512 copies,
//! [`gelu_avx512`], `tanh16` and `softmax_row16`.
//! Sigmoid and swish have hand-interleaved AVX-512 copies as well (`sigmoid16`, ...: four
//! vectors a step, the unfused exp's operations), bit-identical to the
//! twins like the compiled copies. GELU in f32 used to go through f64 and libm's `exp`, a fifth
//! of a ViT-S run, then through an erfc with an exp (twice the operations of the rational form).

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
/// level (the instruction, or libm's `fmaf` in the baseline build), so the vector copy in
/// `softmax_row16` gives these bits too.
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
/// AVX2 and AVX-512 copies and the dispatcher `$name`. The AVX-512 copy is the same safe Rust
/// compiled 16 lanes wide: the same IEEE operations in the same order (no contraction), so it
/// too equals the scalar twin bit for bit; or, given as `avx512: path`, a hand-written copy.
macro_rules! twin_loop {
    // The AVX-512 copy written by hand (`$custom`, unsafe, AVX-512 F): the dispatcher calls it.
    ($(#[$doc:meta])* $name:ident, $scalar:ident, $avx2:ident, avx512: $custom:path, |$v:ident| $body:expr) => {
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
    };
    ($(#[$doc:meta])* $name:ident, $scalar:ident, $avx2:ident, $avx512:ident, |$v:ident| $body:expr) => {
        twin_loop!($(#[$doc])* $name, $scalar, $avx2, avx512: $avx512, |$v| $body);

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn $avx512($v: &mut [f32]) {
            $body
        }
    };
}

/// Exact GELU over a slice, in place: [`gelu_f32`] on every value, at AVX-512 by
/// [`gelu_avx512`]'s interleaved vectors, at AVX2 by the compiler's vectorization of the same
/// Rust; every level gives the scalar twin's bits.
pub fn gelu(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = npuc_isa::Isa::detect();
        if isa.has_avx512() {
            // SAFETY: the ISA module detected AVX-512F on this CPU (capped by NPUC_ISA).
            unsafe { gelu_avx512(v) };
            return;
        }
        if isa.has_avx2() {
            // SAFETY: the ISA module detected AVX2 and FMA on this CPU (capped by NPUC_ISA).
            unsafe { gelu_avx2(v) };
            return;
        }
    }
    gelu_scalar(v)
}

/// The scalar twin (baseline target) of [`gelu`].
pub fn gelu_scalar(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x = gelu_f32(*x))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_avx2(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x = gelu_f32(*x))
}

/// [`gelu_f32`] on 16-lane vectors, [`EXP_LANES`] of them interleaved step by step: a GELU is
/// a ~45-deep chain of dependent multiplies and adds, and one vector per loop iteration (the
/// compiler's vectorization) left the multiply-add units waiting on latency. The same IEEE
/// operations in the same order as [`gelu_f32`] and [`exp_fma_f32`] (fused where they fuse),
/// so the results equal the scalar twin's bits.
///
/// # Safety
/// AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_avx512(v: &mut [f32]) {
    use std::arch::x86_64::*;
    let set = |c: f32| _mm512_set1_ps(c);
    // SAFETY: AVX-512 F, as this function requires.
    unsafe { map16xn(v, |x| gelu16xn(x, set), gelu_f32) }
}

/// The body of [`gelu_avx512`] on `N` vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn gelu16xn<const N: usize>(
    x: [std::arch::x86_64::__m512; N],
    set: impl Fn(f32) -> std::arch::x86_64::__m512,
) -> [std::arch::x86_64::__m512; N] {
    use std::arch::x86_64::*;
    let each = |f: &dyn Fn(usize) -> __m512| -> [__m512; N] { std::array::from_fn(f) };
    let e = odd_rational_unit16xn(x, GELU_CLAMP, &GELU_P, &GELU_Q, &set);
    each(&|i| {
        let half = _mm512_mul_ps(set(0.5), x[i]);
        let g = _mm512_fmadd_ps(half, e[i], half);
        let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x[i], set(-GELU_CLAMP));
        _mm512_mask_blend_ps(below, g, set(-0.0))
    })
}

/// [`odd_rational_unit`] on `N` 16-lane vectors, operation for operation.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn odd_rational_unit16xn<const N: usize>(
    x: [std::arch::x86_64::__m512; N],
    clamp: f32,
    p: &[f32],
    q: &[f32],
    set: &impl Fn(f32) -> std::arch::x86_64::__m512,
) -> [std::arch::x86_64::__m512; N] {
    use std::arch::x86_64::*;
    let each = |f: &dyn Fn(usize) -> __m512| -> [__m512; N] { std::array::from_fn(f) };
    // clamp_keep_nan: min(hi, max(lo, v)) returns v when it is NaN (the second operand).
    let limit = |v: __m512, lo: f32, hi: f32| _mm512_min_ps(set(hi), _mm512_max_ps(set(lo), v));
    let xc = each(&|i| limit(x[i], -clamp, clamp));
    let s = each(&|i| _mm512_mul_ps(xc[i], xc[i]));
    let mut pv = [set(p[0]); N];
    for &c in &p[1..] {
        pv = each(&|i| _mm512_fmadd_ps(pv[i], s[i], set(c)));
    }
    let mut qv = [set(q[0]); N];
    for &c in &q[1..] {
        qv = each(&|i| _mm512_fmadd_ps(qv[i], s[i], set(c)));
    }
    each(&|i| limit(_mm512_div_ps(_mm512_mul_ps(xc[i], pv[i]), qv[i]), -1.0, 1.0))
}

/// [`exp_fma_f32`] (`FUSED`) or [`exp_f32`] (products and sums rounded apart) on `N` 16-lane
/// vectors, operation for operation.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn exp16xn<const N: usize, const FUSED: bool>(
    x: [std::arch::x86_64::__m512; N],
    set: &impl Fn(f32) -> std::arch::x86_64::__m512,
) -> [std::arch::x86_64::__m512; N] {
    use crate::ops::elementwise::exp_consts as k;
    use std::arch::x86_64::*;
    let each = |f: &dyn Fn(usize) -> __m512| -> [__m512; N] { std::array::from_fn(f) };
    // max(LO, x) then min(HI, .) is `clamp`, and returns x when it is NaN (the second operand).
    // a * b + c, fused or rounded twice as the scalar copy does it.
    let madd = |a: __m512, b: __m512, c: __m512| {
        if FUSED {
            _mm512_fmadd_ps(a, b, c)
        } else {
            _mm512_add_ps(_mm512_mul_ps(a, b), c)
        }
    };
    let xc = each(&|i| _mm512_min_ps(set(k::HI), _mm512_max_ps(set(k::LO), x[i])));
    let t = each(&|i| madd(xc[i], set(k::LOG2E), set(k::MAGIC)));
    let n = each(&|i| _mm512_sub_ps(t[i], set(k::MAGIC)));
    let r = each(&|i| {
        if FUSED {
            let r = _mm512_fnmadd_ps(n[i], set(k::LN2_HI), xc[i]);
            _mm512_fnmadd_ps(n[i], set(k::LN2_LO), r)
        } else {
            let r = _mm512_sub_ps(xc[i], _mm512_mul_ps(n[i], set(k::LN2_HI)));
            _mm512_sub_ps(r, _mm512_mul_ps(n[i], set(k::LN2_LO)))
        }
    });
    let mut p = [set(k::P[0]); N];
    for &c in &k::P[1..] {
        p = each(&|i| madd(p[i], r[i], set(c)));
    }
    each(&|i| {
        let e = madd(_mm512_mul_ps(p[i], r[i]), r[i], r[i]);
        let e = _mm512_add_ps(e, set(1.0));
        let ni = _mm512_sub_epi32(_mm512_castps_si512(t[i]), _mm512_set1_epi32(0x4B40_0000));
        let n1 = _mm512_srai_epi32::<1>(ni);
        let n2 = _mm512_sub_epi32(ni, n1);
        let bias = _mm512_set1_epi32(127);
        let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n1, bias)));
        let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n2, bias)));
        let y = _mm512_mul_ps(_mm512_mul_ps(e, s1), s2);
        // Below LO: 0; above HI: infinity; NaN compares false both ways and passes through.
        let lo = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x[i], set(k::LO));
        let hi = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x[i], set(k::HI));
        let y = _mm512_mask_blend_ps(lo, y, _mm512_setzero_ps());
        _mm512_mask_blend_ps(hi, y, set(f32::INFINITY))
    })
}
/// Vectors the hand-written AVX-512 loops below carry through each step together (an exp is a
/// ~20-deep chain of dependent operations: one vector per loop iteration, the compiler's
/// vectorization, waits on latency; sigmoid measured ~1.0 ns a value that way).
const EXP_LANES: usize = 4;

/// `f` over whole blocks of `16 * EXP_LANES` values of `v` (loaded, mapped, stored) and
/// `scalar` over the rest.
///
/// # Safety
/// AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn map16xn(
    v: &mut [f32],
    f: impl Fn([std::arch::x86_64::__m512; EXP_LANES]) -> [std::arch::x86_64::__m512; EXP_LANES],
    scalar: impl Fn(f32) -> f32,
) {
    use std::arch::x86_64::*;
    let mut blocks = v.chunks_exact_mut(16 * EXP_LANES);
    for block in &mut blocks {
        let mut x = [_mm512_setzero_ps(); EXP_LANES];
        for (i, xi) in x.iter_mut().enumerate() {
            // SAFETY: the block holds 16 * EXP_LANES values.
            *xi = unsafe { _mm512_loadu_ps(block.as_ptr().add(16 * i)) };
        }
        let y = f(x);
        for (i, yi) in y.iter().enumerate() {
            // SAFETY: as the loads.
            unsafe { _mm512_storeu_ps(block.as_mut_ptr().add(16 * i), *yi) };
        }
    }
    for x in blocks.into_remainder() {
        *x = scalar(*x);
    }
}

/// `-x` on each vector (sign bit flipped, as scalar negation does).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn neg16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(x),
        _mm512_set1_epi32(i32::MIN),
    ))
}

/// [`sigmoid`] at AVX-512: [`sigmoid_f32`]'s operations on interleaved vectors.
///
/// # Safety
/// AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sigmoid16(v: &mut [f32]) {
    use std::arch::x86_64::*;
    let set = |c: f32| _mm512_set1_ps(c);
    let f = |x: [__m512; EXP_LANES]| {
        let e = exp16xn::<EXP_LANES, false>(x.map(|x| neg16(x)), &set);
        e.map(|e| _mm512_div_ps(set(1.0), _mm512_add_ps(set(1.0), e)))
    };
    // SAFETY: AVX-512 F, as this function requires.
    unsafe { map16xn(v, f, sigmoid_f32) }
}

/// [`swish`] at AVX-512: `x / (1 + e^-x)` on interleaved vectors.
///
/// # Safety
/// AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn swish16(v: &mut [f32]) {
    use std::arch::x86_64::*;
    let set = |c: f32| _mm512_set1_ps(c);
    let f = |x: [__m512; EXP_LANES]| {
        let e = exp16xn::<EXP_LANES, false>(x.map(|x| neg16(x)), &set);
        std::array::from_fn(|i| _mm512_div_ps(x[i], _mm512_add_ps(set(1.0), e[i])))
    };
    // SAFETY: AVX-512 F, as this function requires.
    unsafe { map16xn(v, f, |x| x / (1.0 + exp_f32(-x))) }
}

/// [`tanh`] at AVX-512: [`tanh_f32`]'s fused operations on interleaved vectors.
///
/// # Safety
/// AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tanh16(v: &mut [f32]) {
    use std::arch::x86_64::*;
    let set = |c: f32| _mm512_set1_ps(c);
    let f = |x: [__m512; EXP_LANES]| {
        let each = |f: &dyn Fn(usize) -> __m512| -> [__m512; EXP_LANES] { std::array::from_fn(f) };
        let r = odd_rational_unit16xn(x, TANH_CLAMP, &TANH_P, &TANH_Q, &set);
        each(&|i| {
            let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(x[i]), set(TANH_TINY));
            _mm512_mask_blend_ps(tiny, r[i], x[i])
        })
    };
    // SAFETY: AVX-512 F, as this function requires.
    unsafe { map16xn(v, f, tanh_f32) }
}

/// [`softmax_row`] at AVX-512: the max and sum as [`softmax_body`] takes them, the exps on
/// interleaved vectors.
///
/// # Safety
/// AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_row16(row: &mut [f32]) {
    use std::arch::x86_64::*;
    if row.is_empty() {
        return;
    }
    let set = |c: f32| _mm512_set1_ps(c);
    let m = max_of(row);
    let f = |x: [__m512; EXP_LANES]| {
        exp16xn::<EXP_LANES, true>(x.map(|x| _mm512_sub_ps(x, set(m))), &set)
    };
    // SAFETY: AVX-512 F, as this function requires.
    unsafe { map16xn(row, f, |x| exp_fma_f32(x - m)) };
    let inv = 1.0 / sum_of(row);
    for v in row.iter_mut() {
        *v *= inv;
    }
}

twin_loop!(
    /// Sigmoid over a slice, in place.
    sigmoid,
    sigmoid_scalar,
    sigmoid_avx2,
    avx512: sigmoid16,
    |v| v.iter_mut().for_each(|x| *x = sigmoid_f32(*x))
);
twin_loop!(
    /// Swish (`x * sigmoid(x)`, computed as `x / (1 + e^-x)`) over a slice, in place.
    swish,
    swish_scalar,
    swish_avx2,
    avx512: swish16,
    |v| v.iter_mut().for_each(|x| *x /= 1.0 + exp_f32(-*x))
);
twin_loop!(
    /// Tanh over a slice, in place.
    tanh,
    tanh_scalar,
    tanh_avx2,
    avx512: tanh16,
    |v| crate::kernels::fmap::via_copy(v, |old, v| map_into_scalar(old, v, &tanh_f32))
);
twin_loop!(
    /// Softmax of one contiguous row, in place.
    softmax_row,
    softmax_row_scalar,
    softmax_row_avx2,
    avx512: softmax_row16,
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

/// Values per block of [`max_taps_into`]: every tap's run of a block is folded while the
/// block's running maximum sits in registers / L1.
const MAX_TAPS_BLOCK: usize = 64;

/// `dst[i]` = the maximum over taps `t < taps` of `tap(t)[i]` that skips NaN taps (a NaN
/// running maximum takes the next value, a NaN value never wins; equal values and signed zeros
/// keep the earlier tap), and 0 where every tap is NaN: a max pool's outputs whose windows lie
/// inside the input, each tap a slice at least `dst.len()` long. One pass over each tap per
/// block of [`MAX_TAPS_BLOCK`] values, nothing copied in between (a running maximum kept in
/// the output row and a NaN pass after it read the row back per tap: PP-OCRv6 det's 2x2
/// stride-1 pool took 5x onnxruntime's time). The scalar twin is [`max_taps_into_scalar`];
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
    let mut i0 = 0;
    while i0 < n {
        let len = MAX_TAPS_BLOCK.min(n - i0);
        // The running maximum moves between two blocks (read one, write the other): selected
        // in place, the select becomes a masked store at AVX2, slow on AMD cores.
        let (mut a, mut b) = ([f32::NAN; MAX_TAPS_BLOCK], [0f32; MAX_TAPS_BLOCK]);
        let (mut cur, mut next) = (&mut a, &mut b);
        for t in 0..taps {
            let src = &tap(t)[i0..i0 + len];
            for ((o, &m), &v) in next[..len].iter_mut().zip(&cur[..len]).zip(src) {
                #[allow(clippy::eq_op)] // `m != m`: the running maximum is NaN
                let take = v > m || m != m;
                *o = if take { v } else { m };
            }
            std::mem::swap(&mut cur, &mut next);
        }
        for (d, &m) in dst[i0..i0 + len].iter_mut().zip(&cur[..len]) {
            #[allow(clippy::eq_op)] // `m != m`: every tap was NaN
            let none = m != m;
            *d = if none { 0.0 } else { m };
        }
        i0 += len;
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
            picks in proptest::collection::vec((0u8..6, -5.0f32..5.0), 0..400),
            taps in 0usize..5,
        ) {
            let special = |k: u8, x: f32| match k {
                0 => f32::NAN,
                1 => 0.0,
                2 => -0.0,
                _ => x,
            };
            // Tap t reads the data from offset t (the shifted rows of a pool window).
            let data: Vec<f32> = picks.iter().map(|p| special(p.0, p.1)).collect();
            let n = data.len().saturating_sub(4);
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
