//! Vectorized conversions between f32 and 8/16-bit quantized integers: per-tensor
//! QuantizeLinear / DequantizeLinear and the requantizing epilogue of the integer matrix
//! product. Every AVX2 routine has a scalar twin computing bit-identical results (same f32
//! operations in the same order, no FMA contraction), compared by proptests.
//!
//! Rounding is half to even in both paths: the scalar path adds and subtracts 1.5 * 2^23
//! (exact for |v| < 2^22, which the clamp to the 16-bit range guarantees), the AVX2 path uses
//! `vroundps` with round-to-nearest-even. Values are clamped in f32 before rounding, at
//! integer bounds, so clamping before or after rounding gives the same integer.

/// Which implementation runs: the process-wide level (`npuc_isa`), or an explicit one in tests.
/// The AVX2 paths also serve the AVX-512 level.
pub use npuc_isa::Isa;

/// The quantized integer types: u8, i8, u16, i16.
pub trait QInt: Copy + Send + Sync + Default + 'static {
    /// Smallest value.
    const LO: i32;
    /// Largest value.
    const HI: i32;
    /// Converts an integer already within `[LO, HI]`.
    fn from_i32(v: i32) -> Self;
    /// Widens to i32.
    fn to_i32(self) -> i32;
    /// The values as their bytes, for the 8-bit types (`None` for wider ones).
    fn bytes_mut(s: &mut [Self]) -> Option<&mut [u8]>;
    /// Which packing the AVX2 stores/loads use.
    #[doc(hidden)]
    const KIND: Kind;
}

/// Element kinds of [`QInt`] (selects the AVX2 pack/unpack instructions).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    U8,
    I8,
    U16,
    I16,
}

macro_rules! qint {
    ($t:ty, $k:ident) => {
        impl QInt for $t {
            const LO: i32 = <$t>::MIN as i32;
            const HI: i32 = <$t>::MAX as i32;
            const KIND: Kind = Kind::$k;
            #[inline(always)]
            fn from_i32(v: i32) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_i32(self) -> i32 {
                self as i32
            }
            #[inline(always)]
            fn bytes_mut(s: &mut [Self]) -> Option<&mut [u8]> {
                (std::mem::size_of::<$t>() == 1).then(|| bytemuck::cast_slice_mut(s))
            }
        }
    };
}
qint!(u8, U8);
qint!(i8, I8);
qint!(u16, U16);
qint!(i16, I16);

/// Round half to even of a value with |v| < 2^22 using two f32 adds (ties go to even because
/// the sum's rounding does).
#[inline(always)]
fn round_even_small(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// `out[i] = clamp(round_half_even(x[i] / scale) + zp)` (ONNX QuantizeLinear, per tensor). The
/// division (not a reciprocal multiply) keeps results identical to QuantizeLinear; a NaN input
/// maps to the lower bound as in the scalar `f32::max`.
pub fn quantize<T: QInt>(isa: Isa, x: &[f32], scale: f32, zp: i32, out: &mut [T]) {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    let (flo, fhi) = ((T::LO - zp) as f32, (T::HI - zp) as f32);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && Isa::detect().has_avx2() {
        // SAFETY: avx2 is available (checked); the kernel reads/writes only `x[..n]`,
        // `out[..n]` in whole groups of 8 and returns how many it processed.
        done = unsafe { avx2::quantize(x, scale, zp, flo, fhi, out) };
    }
    let _ = isa;
    let zf = zp as f32;
    for (o, &v) in out[done..].iter_mut().zip(&x[done..]) {
        *o = T::from_i32((round_even_small((v / scale).max(flo).min(fhi)) + zf) as i32);
    }
}

/// The range of `x` extended to 0, NaN ignored: `(max(0, x...), min(0, x...))`, what
/// DynamicQuantizeLinear derives its scale from. `L` independent lanes so the loop vectorizes
/// (`f32::max` in a running fold does not); the result does not depend on `L` (the lanes only
/// replace a value by a strictly larger/smaller one, so every zero they hold is the initial +0).
#[inline(always)]
fn range_lanes<const L: usize>(x: &[f32]) -> (f32, f32) {
    let (mut hi, mut lo) = ([0f32; L], [0f32; L]);
    let chunks = x.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for ((h, l), &v) in hi.iter_mut().zip(lo.iter_mut()).zip(c) {
            *h = if v > *h { v } else { *h };
            *l = if v < *l { v } else { *l };
        }
    }
    let (mut mx, mut mn) = (0f32, 0f32);
    for &v in hi.iter().chain(tail) {
        mx = if v > mx { v } else { mx };
    }
    for &v in lo.iter().chain(tail) {
        mn = if v < mn { v } else { mn };
    }
    (mx, mn)
}

/// [`range_lanes`] dispatched: 16 lanes compiled for AVX-512, 8 for AVX2, the scalar twin
/// [`range_with_zero_scalar`] otherwise (all give the same pair).
pub fn range_with_zero(x: &[f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = Isa::detect();
        if isa.has_avx512() {
            // SAFETY: AVX-512 F was detected on this CPU (capped by NPUC_ISA); the body is
            // safe Rust.
            return unsafe { range_avx512(x) };
        }
        if isa.has_avx2() {
            // SAFETY: AVX2 was detected on this CPU (capped by NPUC_ISA); safe Rust body.
            return unsafe { range_avx2(x) };
        }
    }
    range_with_zero_scalar(x)
}

/// The scalar twin (baseline target) of [`range_with_zero`].
pub fn range_with_zero_scalar(x: &[f32]) -> (f32, f32) {
    range_lanes::<8>(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn range_avx512(x: &[f32]) -> (f32, f32) {
    range_lanes::<32>(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn range_avx2(x: &[f32]) -> (f32, f32) {
    range_lanes::<16>(x)
}

/// Min and max of `x` over `L` independent lanes, or `None` if it holds a NaN or an infinity
/// (calibration observers). Compare-select updates vectorize to `minps`/`maxps`; `v * 0` is NaN
/// exactly for NaN/Inf, so one more lane sum detects them without a branch. The pair is
/// returned with `+ 0.0` added, so a -0.0 extreme reads +0.0 whatever lane saw it first and
/// every lane count gives the same pair.
#[inline(always)]
fn min_max_lanes<const L: usize>(x: &[f32]) -> Option<(f32, f32)> {
    let (mut lo, mut hi, mut bad) = ([f32::INFINITY; L], [f32::NEG_INFINITY; L], [0f32; L]);
    let chunks = x.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..L {
            let v = c[j];
            lo[j] = if v < lo[j] { v } else { lo[j] };
            hi[j] = if v > hi[j] { v } else { hi[j] };
            bad[j] += v * 0.0;
        }
    }
    for &v in tail {
        lo[0] = if v < lo[0] { v } else { lo[0] };
        hi[0] = if v > hi[0] { v } else { hi[0] };
        bad[0] += v * 0.0;
    }
    if bad.iter().any(|b| b.is_nan()) {
        return None;
    }
    let mn = lo
        .iter()
        .fold(f32::INFINITY, |a, &b| if b < a { b } else { a });
    let mx = hi
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    Some((mn + 0.0, mx + 0.0))
}

/// [`min_max_lanes`] dispatched: 32 lanes compiled for AVX-512, 16 for AVX2, the scalar twin
/// [`min_max_finite_scalar`] otherwise (all give the same result).
pub fn min_max_finite(x: &[f32]) -> Option<(f32, f32)> {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = Isa::detect();
        if isa.has_avx512() {
            // SAFETY: AVX-512 F was detected on this CPU (capped by NPUC_ISA); the body is
            // safe Rust.
            return unsafe { min_max_avx512(x) };
        }
        if isa.has_avx2() {
            // SAFETY: AVX2 was detected on this CPU (capped by NPUC_ISA); safe Rust body.
            return unsafe { min_max_avx2(x) };
        }
    }
    min_max_finite_scalar(x)
}

/// The scalar twin (baseline target) of [`min_max_finite`].
pub fn min_max_finite_scalar(x: &[f32]) -> Option<(f32, f32)> {
    min_max_lanes::<8>(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn min_max_avx512(x: &[f32]) -> Option<(f32, f32)> {
    min_max_lanes::<32>(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn min_max_avx2(x: &[f32]) -> Option<(f32, f32)> {
    min_max_lanes::<16>(x)
}

/// `out[i] = (x[i] - zp) as f32 * scale` (ONNX DequantizeLinear, per tensor, f32 output).
pub fn dequantize<T: QInt>(isa: Isa, x: &[T], scale: f32, zp: i32, out: &mut [f32]) {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && Isa::detect().has_avx2() {
        // SAFETY: as in `quantize`.
        done = unsafe { avx2::dequantize(x, scale, zp, out) };
    }
    let _ = isa;
    for (o, &v) in out[done..].iter_mut().zip(&x[done..]) {
        *o = (v.to_i32() - zp) as f32 * scale;
    }
}

/// The output stage of an integer product row: `s = acc[j]` (or `256 * acc[j] + acc_lo[j]`
/// for split 16-bit operands), `v = (s * mult[j] + bias[j])`, then either requantized
/// (`Some(inv_ys, zp, lo, hi)`: `clamp(round_half_even(v * inv_ys) + zp, lo, hi)`) or, for
/// [`requant_row_f32`], clamped to the fused activation's range.
#[allow(clippy::too_many_arguments)]
pub fn requant_row<T: QInt>(
    isa: Isa,
    acc: &[i32],
    acc_lo: Option<&[i32]>,
    mult: &[f32],
    bias: &[f32],
    inv_ys: f32,
    zp: i32,
    (lo, hi): (i32, i32),
    out: &mut [T],
) {
    let n = out.len();
    assert!(acc.len() >= n && mult.len() >= n && bias.len() >= n);
    assert!(acc_lo.is_none_or(|l| l.len() >= n));
    let (flo, fhi) = ((lo - zp) as f32, (hi - zp) as f32);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() && Isa::detect().has_avx512() {
        // SAFETY: avx512 F/BW checked; all slices hold at least `n` values (asserted above).
        done = unsafe { avx512::requant(acc, acc_lo, mult, bias, inv_ys, zp, flo, fhi, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if done < n && isa.has_avx2() && Isa::detect().has_avx2() {
        let (a, l) = (&acc[done..], acc_lo.map(|l| &l[done..]));
        let (m, b) = (&mult[done..], &bias[done..]);
        // SAFETY: avx2 checked; all slices hold at least `n - done` values from `done`.
        done += unsafe { avx2::requant(a, l, m, b, inv_ys, zp, flo, fhi, &mut out[done..]) };
    }
    let _ = isa;
    let zf = zp as f32;
    for j in done..n {
        let s = match acc_lo {
            None => acc[j] as f32,
            Some(l) => acc[j] as f32 * 256.0 + l[j] as f32,
        };
        let v = (s * mult[j] + bias[j]) * inv_ys;
        out[j] = T::from_i32((round_even_small(v.max(flo).min(fhi)) + zf) as i32);
    }
}

/// [`requant_row`] with f32 output: `out[j] = clamp(s * mult[j] + bias[j], lo, hi)`.
#[allow(clippy::too_many_arguments)]
pub fn requant_row_f32(
    isa: Isa,
    acc: &[i32],
    acc_lo: Option<&[i32]>,
    mult: &[f32],
    bias: &[f32],
    lo: f32,
    hi: f32,
    out: &mut [f32],
) {
    let n = out.len();
    assert!(acc.len() >= n && mult.len() >= n && bias.len() >= n);
    assert!(acc_lo.is_none_or(|l| l.len() >= n));
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && Isa::detect().has_avx2() {
        // SAFETY: avx2 checked; all slices hold at least `n` values (asserted above).
        done = unsafe { avx2::requant_f32(acc, acc_lo, mult, bias, lo, hi, out) };
    }
    let _ = isa;
    for j in done..n {
        let s = match acc_lo {
            None => acc[j] as f32,
            Some(l) => acc[j] as f32 * 256.0 + l[j] as f32,
        };
        out[j] = (s * mult[j] + bias[j]).max(lo).min(hi);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Kind, QInt};
    use std::arch::x86_64::*;

    /// Stores 8 i32 lanes (each within `T`'s range) as 8 `T` at `p`.
    ///
    /// # Safety
    /// avx2; `p` valid for 8 writes of `T`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store8<T: QInt>(p: *mut T, v: __m256i) {
        // SAFETY: caller contract (8 writable `T` at `p`); unaligned stores.
        unsafe {
            match T::KIND {
                Kind::U8 | Kind::I8 => {
                    // i32 -> i16 -> 8-bit within each 128-bit lane (values are in range, so
                    // the saturating packs are exact), then gather lane 0's and lane 1's
                    // four bytes into the low 64 bits.
                    let w = if T::KIND == Kind::U8 {
                        _mm256_packus_epi16(_mm256_packs_epi32(v, v), _mm256_setzero_si256())
                    } else {
                        _mm256_packs_epi16(_mm256_packs_epi32(v, v), _mm256_setzero_si256())
                    };
                    let g =
                        _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
                    _mm_storel_epi64(p as *mut __m128i, _mm256_castsi256_si128(g));
                }
                Kind::U16 | Kind::I16 => {
                    let w = if T::KIND == Kind::U16 {
                        _mm256_packus_epi32(v, v)
                    } else {
                        _mm256_packs_epi32(v, v)
                    };
                    // 64-bit blocks [lo4, lo4, hi4, hi4] -> [lo4, hi4, ..].
                    let g = _mm256_permute4x64_epi64::<0b1000>(w);
                    _mm_storeu_si128(p as *mut __m128i, _mm256_castsi256_si128(g));
                }
            }
        }
    }

    /// Loads 8 `T` at `p` widened to i32 lanes.
    ///
    /// # Safety
    /// avx2; `p` valid for 8 reads of `T`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8<T: QInt>(p: *const T) -> __m256i {
        // SAFETY: caller contract (8 readable `T` at `p`); unaligned loads of exactly 8 or 16
        // bytes.
        unsafe {
            match T::KIND {
                Kind::U8 => _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)),
                Kind::I8 => _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)),
                Kind::U16 => _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)),
                Kind::I16 => _mm256_cvtepi16_epi32(_mm_loadu_si128(p as *const __m128i)),
            }
        }
    }

    /// Rounds half to even, clamps to `[flo, fhi]` first (max with the value first, so a NaN
    /// becomes `flo` like the scalar `f32::max`), adds `zp` and converts to i32 (exact).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn finish(v: __m256, flo: __m256, fhi: __m256, zf: __m256) -> __m256i {
        // `maxps(a, b)` returns b when a is NaN.
        let c = _mm256_min_ps(_mm256_max_ps(v, flo), fhi);
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(c);
        _mm256_cvtps_epi32(_mm256_add_ps(r, zf))
    }

    /// # Safety
    /// avx2; `out.len() >= x.len()`. Returns the number of elements done (a multiple of 8).
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize<T: QInt>(
        x: &[f32],
        scale: f32,
        zp: i32,
        flo: f32,
        fhi: f32,
        out: &mut [T],
    ) -> usize {
        let n = x.len() / 8 * 8;
        let (vs, vlo, vhi, vz) = (
            _mm256_set1_ps(scale),
            _mm256_set1_ps(flo),
            _mm256_set1_ps(fhi),
            _mm256_set1_ps(zp as f32),
        );
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= x.len() <= out.len().
            unsafe {
                let v = _mm256_div_ps(_mm256_loadu_ps(xp.add(i)), vs);
                store8(op.add(i), finish(v, vlo, vhi, vz));
            }
        }
        n
    }

    /// # Safety
    /// avx2; `out.len() >= x.len()`. Returns the number of elements done (a multiple of 8).
    #[target_feature(enable = "avx2")]
    pub unsafe fn dequantize<T: QInt>(x: &[T], scale: f32, zp: i32, out: &mut [f32]) -> usize {
        let n = x.len() / 8 * 8;
        let (vs, vz) = (_mm256_set1_ps(scale), _mm256_set1_epi32(zp));
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= x.len() <= out.len().
            unsafe {
                let v = _mm256_sub_epi32(load8(xp.add(i)), vz);
                _mm256_storeu_ps(op.add(i), _mm256_mul_ps(_mm256_cvtepi32_ps(v), vs));
            }
        }
        n
    }

    /// `s * mult + bias` for 8 lanes at `j` (the split form when `lo` is given).
    ///
    /// # Safety
    /// avx2; every slice holds at least `j + 8` values.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn affine(
        acc: &[i32],
        lo: Option<&[i32]>,
        mult: &[f32],
        bias: &[f32],
        j: usize,
    ) -> __m256 {
        // SAFETY: caller contract.
        unsafe {
            let a = _mm256_cvtepi32_ps(_mm256_loadu_si256(acc.as_ptr().add(j) as *const __m256i));
            let s = match lo {
                None => a,
                Some(l) => _mm256_add_ps(
                    _mm256_mul_ps(a, _mm256_set1_ps(256.0)),
                    _mm256_cvtepi32_ps(_mm256_loadu_si256(l.as_ptr().add(j) as *const __m256i)),
                ),
            };
            _mm256_add_ps(
                _mm256_mul_ps(s, _mm256_loadu_ps(mult.as_ptr().add(j))),
                _mm256_loadu_ps(bias.as_ptr().add(j)),
            )
        }
    }

    /// # Safety
    /// avx2; `acc`, `acc_lo`, `mult`, `bias` hold at least `out.len()` values. Returns the
    /// number done (a multiple of 8).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2")]
    pub unsafe fn requant<T: QInt>(
        acc: &[i32],
        acc_lo: Option<&[i32]>,
        mult: &[f32],
        bias: &[f32],
        inv_ys: f32,
        zp: i32,
        flo: f32,
        fhi: f32,
        out: &mut [T],
    ) -> usize {
        let n = out.len() / 8 * 8;
        let (vi, vlo, vhi, vz) = (
            _mm256_set1_ps(inv_ys),
            _mm256_set1_ps(flo),
            _mm256_set1_ps(fhi),
            _mm256_set1_ps(zp as f32),
        );
        let op = out.as_mut_ptr();
        for j in (0..n).step_by(8) {
            // SAFETY: j + 8 <= n <= every slice's length (caller contract).
            unsafe {
                let v = _mm256_mul_ps(affine(acc, acc_lo, mult, bias, j), vi);
                store8(op.add(j), finish(v, vlo, vhi, vz));
            }
        }
        n
    }

    /// # Safety
    /// As [`requant`].
    #[target_feature(enable = "avx2")]
    pub unsafe fn requant_f32(
        acc: &[i32],
        acc_lo: Option<&[i32]>,
        mult: &[f32],
        bias: &[f32],
        lo: f32,
        hi: f32,
        out: &mut [f32],
    ) -> usize {
        let n = out.len() / 8 * 8;
        let (vlo, vhi) = (_mm256_set1_ps(lo), _mm256_set1_ps(hi));
        let op = out.as_mut_ptr();
        for j in (0..n).step_by(8) {
            // SAFETY: j + 8 <= n <= every slice's length (caller contract).
            unsafe {
                let v = affine(acc, acc_lo, mult, bias, j);
                // Same operand order as the scalar `v.max(lo).min(hi)`.
                _mm256_storeu_ps(op.add(j), _mm256_min_ps(_mm256_max_ps(v, vlo), vhi));
            }
        }
        n
    }
}

/// 16-lane form of [`avx2::requant`]: the same operations per lane (multiply, add, multiply,
/// clamp with the value first, round half to even, add the zero point), so the same codes.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Kind, QInt};
    use std::arch::x86_64::*;

    /// # Safety
    /// avx512 F/BW; `acc`, `acc_lo`, `mult`, `bias` hold at least `out.len()` values. Returns
    /// the number of elements done (a multiple of 16).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn requant<T: QInt>(
        acc: &[i32],
        acc_lo: Option<&[i32]>,
        mult: &[f32],
        bias: &[f32],
        inv_ys: f32,
        zp: i32,
        flo: f32,
        fhi: f32,
        out: &mut [T],
    ) -> usize {
        let n = out.len() / 16 * 16;
        let (vi, vlo, vhi, vz) = (
            _mm512_set1_ps(inv_ys),
            _mm512_set1_ps(flo),
            _mm512_set1_ps(fhi),
            _mm512_set1_ps(zp as f32),
        );
        let op = out.as_mut_ptr();
        for j in (0..n).step_by(16) {
            // SAFETY: j + 16 <= n <= every slice's length (caller contract); unaligned loads
            // and stores of exactly 16 lanes.
            unsafe {
                let a = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc.as_ptr().add(j) as *const _));
                let s = match acc_lo {
                    None => a,
                    Some(l) => _mm512_add_ps(
                        _mm512_mul_ps(a, _mm512_set1_ps(256.0)),
                        _mm512_cvtepi32_ps(_mm512_loadu_si512(l.as_ptr().add(j) as *const _)),
                    ),
                };
                let v = _mm512_add_ps(
                    _mm512_mul_ps(s, _mm512_loadu_ps(mult.as_ptr().add(j))),
                    _mm512_loadu_ps(bias.as_ptr().add(j)),
                );
                let v = _mm512_mul_ps(v, vi);
                // `max(v, lo)` returns lo when v is NaN (as the scalar `f32::max`).
                let c = _mm512_min_ps(_mm512_max_ps(v, vlo), vhi);
                let r =
                    _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(c);
                let q = _mm512_cvtps_epi32(_mm512_add_ps(r, vz));
                // The codes lie in T's range: the narrowing conversions are exact.
                match T::KIND {
                    Kind::U8 | Kind::I8 => {
                        _mm_storeu_si128(op.add(j) as *mut __m128i, _mm512_cvtepi32_epi8(q))
                    }
                    Kind::U16 | Kind::I16 => {
                        _mm256_storeu_si256(op.add(j) as *mut __m256i, _mm512_cvtepi32_epi16(q))
                    }
                }
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn both_quantize<T: QInt + PartialEq + std::fmt::Debug>(x: &[f32], scale: f32, zp: i32) {
        let mut a = vec![T::default(); x.len()];
        let mut b = vec![T::default(); x.len()];
        quantize(Isa::Scalar, x, scale, zp, &mut a);
        quantize(Isa::detect(), x, scale, zp, &mut b);
        assert_eq!(a, b);
        // The scalar twin is QuantizeLinear: round half to even of the quotient, saturated.
        for (q, &v) in a.iter().zip(x) {
            let r = if v.is_nan() {
                T::LO
            } else {
                ((v / scale).round_ties_even() as f64 + zp as f64).clamp(T::LO as f64, T::HI as f64)
                    as i32
            };
            assert_eq!(q.to_i32(), r, "x {v} scale {scale} zp {zp}");
        }
    }

    fn both_dequantize<T: QInt>(x: &[T], scale: f32, zp: i32) {
        let mut a = vec![0f32; x.len()];
        let mut b = vec![0f32; x.len()];
        dequantize(Isa::Scalar, x, scale, zp, &mut a);
        dequantize(Isa::detect(), x, scale, zp, &mut b);
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        for (o, q) in a.iter().zip(x) {
            assert_eq!(*o, ((q.to_i32() - zp) as f64 * scale as f64) as f32);
        }
    }

    fn values() -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(
            prop_oneof![
                -300.0f32..300.0,
                // Exact ties of the quotient (x = (k + 0.5) * scale with scale 0.5).
                (-200i32..200).prop_map(|k| k as f32 * 0.5 + 0.25),
                Just(f32::NAN),
                Just(f32::INFINITY),
                Just(f32::NEG_INFINITY),
                -1e6f32..1e6,
            ],
            0..70,
        )
    }

    proptest! {
        #[test]
        fn range_matches_scalar_twin(x in values(), negzero in any::<bool>()) {
            let mut x = x;
            if negzero && !x.is_empty() {
                x[0] = -0.0;
            }
            let want = x.iter().filter(|v| !v.is_nan()).fold((0f32, 0f32), |(h, l), &v| (h.max(v), l.min(v)));
            let got = range_with_zero(&x);
            prop_assert_eq!(got, range_with_zero_scalar(&x));
            prop_assert_eq!(got, want);
        }

        #[test]
        fn min_max_matches_scalar_twin(x in values(), special in 0usize..4, at in any::<prop::sample::Index>()) {
            let mut x = x;
            if !x.is_empty() {
                let i = at.index(x.len());
                x[i] = [-0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY][special];
            }
            let want = if x.iter().all(|v| v.is_finite()) && !x.is_empty() {
                let lo = x.iter().fold(f32::INFINITY, |a, &b| a.min(b)) + 0.0;
                let hi = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) + 0.0;
                Some((lo, hi))
            } else if x.is_empty() {
                Some((f32::INFINITY, f32::NEG_INFINITY))
            } else {
                None
            };
            let got = min_max_finite(&x);
            let scalar = min_max_finite_scalar(&x);
            prop_assert_eq!(format!("{got:?}"), format!("{scalar:?}"));
            prop_assert_eq!(format!("{got:?}"), format!("{want:?}"));
        }

        #[test]
        fn quantize_matches_scalar(x in values(), scale in prop_oneof![Just(0.5f32), 0.001f32..3.0], zp8 in 0i32..256, zps in -128i32..128, zp16 in 0i32..65536) {
            both_quantize::<u8>(&x, scale, zp8);
            both_quantize::<i8>(&x, scale, zps);
            both_quantize::<u16>(&x, scale, zp16);
            both_quantize::<i16>(&x, scale, zp16 - 32768);
        }

        #[test]
        fn dequantize_matches_scalar(x in prop::collection::vec(any::<u16>(), 0..70), scale in 0.0001f32..10.0, zp8 in 0i32..256, zp16 in 0i32..65536) {
            let u8s: Vec<u8> = x.iter().map(|&v| v as u8).collect();
            let i8s: Vec<i8> = x.iter().map(|&v| v as i8).collect();
            let i16s: Vec<i16> = x.iter().map(|&v| v as i16).collect();
            both_dequantize(&u8s, scale, zp8);
            both_dequantize(&i8s, scale, zp8 - 128);
            both_dequantize(&x, scale, zp16);
            both_dequantize(&i16s, scale, zp16 - 32768);
        }

        #[test]
        fn requant_matches_scalar(
            acc in prop::collection::vec(-5_000_000i32..5_000_000, 0..50),
            split in any::<bool>(),
            ys in 0.001f32..10.0,
            zp in 0i32..256,
            clip in any::<bool>(),
        ) {
            let n = acc.len();
            let lo_part: Vec<i32> = acc.iter().map(|v| v.rem_euclid(256)).collect();
            let hi_part: Vec<i32> = acc.iter().map(|v| v / 4096).collect();
            let mult: Vec<f32> = (0..n).map(|j| 1e-4 * (j as f32 + 1.0)).collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.37 - 3.0).collect();
            let (a, l) = if split { (&hi_part[..], Some(&lo_part[..])) } else { (&acc[..], None) };
            let range = if clip { (zp.min(200), 250) } else { (0, 255) };
            let mut q1 = vec![0u8; n];
            let mut q2 = vec![0u8; n];
            requant_row(Isa::Scalar, a, l, &mult, &bias, 1.0 / ys, zp, range, &mut q1);
            requant_row(Isa::detect(), a, l, &mult, &bias, 1.0 / ys, zp, range, &mut q2);
            prop_assert_eq!(&q1, &q2);
            let mut i1 = vec![0i16; n];
            let mut i2 = vec![0i16; n];
            requant_row(Isa::Scalar, a, l, &mult, &bias, 1.0 / ys, zp - 128, (-32768, 32767), &mut i1);
            requant_row(Isa::detect(), a, l, &mult, &bias, 1.0 / ys, zp - 128, (-32768, 32767), &mut i2);
            prop_assert_eq!(&i1, &i2);
            let (flo, fhi) = if clip { (0.0, 6.0) } else { (f32::NEG_INFINITY, f32::INFINITY) };
            let mut f1 = vec![0f32; n];
            let mut f2 = vec![0f32; n];
            requant_row_f32(Isa::Scalar, a, l, &mult, &bias, flo, fhi, &mut f1);
            requant_row_f32(Isa::detect(), a, l, &mult, &bias, flo, fhi, &mut f2);
            prop_assert_eq!(f1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), f2.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            // Against an independent f64 formula (within the f32 rounding of the epilogue).
            for j in 0..n {
                let s = match l { None => a[j] as f64, Some(l) => a[j] as f64 * 256.0 + l[j] as f64 };
                let v = s * mult[j] as f64 + bias[j] as f64;
                let want = (v / ys as f64).round() + zp as f64;
                let want = want.clamp(range.0 as f64, range.1 as f64);
                prop_assert!((q1[j] as f64 - want).abs() <= 1.0, "j {} got {} want {}", j, q1[j], want);
            }
        }
    }
}
