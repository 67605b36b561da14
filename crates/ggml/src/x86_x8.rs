//! AVX2+FMA kernels over the interleaved weight layout (`x8.rs`; scalar twin
//! `x8::x8_group_scalar`, compared bit for bit by the proptests in `tests/kernels.rs`). Only
//! called after `crate::has_avx2()` said yes.
//!
//! Lane `r` of every vector is weight row `r` of the group: a 32-byte chunk holds four quants of
//! each of the eight rows, the matching four activations are one 32-bit broadcast, and
//! `maddubs` + `madd` leave each row's partial sum in its own lane. Per block that is one load
//! per chunk, no shuffles and no horizontal sums; scales of all eight rows convert in one
//! `vcvtph2ps`.

use crate::x8::{quant_bias, X8_MAX_RX, X8_ROWS};
use crate::GgmlType;
use std::arch::x86_64::*;

/// How far ahead of the block being multiplied the weight stream is prefetched.
const PREFETCH_BYTES: usize = 2048;
const T_Q8_0: u8 = 0;
const T_Q4_0: u8 = 1;
const T_Q4_1: u8 = 2;
const T_Q5_0: u8 = 3;

/// `x8::X8Fn` on AVX2: checks the operand sizes (the kernel reads through raw pointers), then
/// runs the kernel specialised for the type and the number of activation rows.
pub(crate) fn x8_group(
    ty: GgmlType,
    groups: &[u8],
    k: usize,
    x: &[&[u8]],
    xsum: &[&[i32]],
    out: &mut [[f32; 8]],
) {
    let tsz = ty.type_size();
    let nb = k / 32;
    let gbytes = nb * X8_ROWS * tsz;
    let ng = groups.len().checked_div(gbytes).unwrap_or(0);
    let xbs = if ty == GgmlType::Q4_1 { 36 } else { 34 };
    let rx = x.len();
    // The pointer reads below rely on these sizes: a violation is a caller bug, never input.
    assert!(
        crate::x8::supports_x8(ty)
            && k.is_multiple_of(32)
            && groups.len() == ng * gbytes
            && (1..=X8_MAX_RX).contains(&rx)
            && out.len() >= ng * rx
            && x.iter().all(|r| r.len() >= nb * xbs)
            && (quant_bias(ty) == 0 || (xsum.len() >= rx && xsum.iter().all(|s| s.len() >= nb))),
        "x8 kernel operands of the wrong size"
    );
    if ng == 0 {
        return;
    }
    let g = groups.as_ptr();
    let xp: [*const u8; X8_MAX_RX] = std::array::from_fn(|r| x[r.min(rx - 1)].as_ptr());
    let sp: [*const i32; X8_MAX_RX] = std::array::from_fn(|r| {
        if quant_bias(ty) == 0 {
            std::ptr::null()
        } else {
            xsum[r.min(rx - 1)].as_ptr()
        }
    });
    macro_rules! go {
        ($t:expr) => {
            // SAFETY: AVX2/FMA/F16C confirmed by the caller's dispatch (`x8::x8_fn`); the
            // assertion above guarantees `nb` blocks in the group and in every activation row
            // (and `nb` block sums where the type reads them).
            unsafe {
                match rx {
                    1 => groups_kernel::<$t, 1>(g, ng, nb, xp, sp, out),
                    2 => groups_kernel::<$t, 2>(g, ng, nb, xp, sp, out),
                    3 => groups_kernel::<$t, 3>(g, ng, nb, xp, sp, out),
                    _ => groups_kernel::<$t, 4>(g, ng, nb, xp, sp, out),
                }
            }
        };
    }
    match ty {
        GgmlType::Q8_0 => go!(T_Q8_0),
        GgmlType::Q4_0 => go!(T_Q4_0),
        GgmlType::Q4_1 => go!(T_Q4_1),
        _ => go!(T_Q5_0),
    }
}

/// 32 bytes at `p` (unaligned).
#[inline(always)]
unsafe fn ld32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes at `p`.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// The four bytes at `p` in every 32-bit lane.
#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes at `p`.
    _mm256_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
}

/// The f16 at `p` as f32.
#[inline(always)]
unsafe fn f16_ptr(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Q5_0's regrouped high bits (`x8.rs`): bit `j` of every byte moved to bit 4.
#[inline(always)]
unsafe fn bit_j_to_4(hq: __m256i, j: usize) -> __m256i {
    match j {
        0 => _mm256_slli_epi32::<4>(hq),
        1 => _mm256_slli_epi32::<3>(hq),
        2 => _mm256_slli_epi32::<2>(hq),
        3 => _mm256_slli_epi32::<1>(hq),
        4 => hq,
        5 => _mm256_srli_epi32::<1>(hq),
        6 => _mm256_srli_epi32::<2>(hq),
        _ => _mm256_srli_epi32::<3>(hq),
    }
}

/// One nibble chunk `c` of a group-block at `gb` against the activation blocks `xb`: adds each
/// row's two maddubs results (low and high nibbles) into `s16[r]` (i16 lanes).
#[inline(always)]
unsafe fn nibble_chunk<const T: u8, const RX: usize>(
    gb: *const u8,
    q0: usize,
    hq: __m256i,
    c: usize,
    xb: &[*const u8; X8_MAX_RX],
    s16: &mut [__m256i; RX],
) {
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: chunk c (< 4) of the group-block lies at q0 + 32c .. q0 + 32c + 32 inside it.
    let w = unsafe { ld32(gb.add(q0 + 32 * c)) };
    let mut lo = _mm256_and_si256(w, m4);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), m4);
    if T == T_Q5_0 {
        let b4 = _mm256_set1_epi8(0x10);
        lo = _mm256_or_si256(lo, _mm256_and_si256(unsafe { bit_j_to_4(hq, 2 * c) }, b4));
        hi = _mm256_or_si256(
            hi,
            _mm256_and_si256(unsafe { bit_j_to_4(hq, 2 * c + 1) }, b4),
        );
    }
    let xoff = if T == T_Q4_1 { 4 } else { 2 };
    for r in 0..RX {
        // SAFETY: the activation block holds 32 quants at xoff.., and 16 + 4c + 4 <= 32.
        let (xl, xh) = unsafe {
            (
                bcast4(xb[r].add(xoff + 4 * c)),
                bcast4(xb[r].add(xoff + 16 + 4 * c)),
            )
        };
        // Unsigned quants (0..15, Q5_0 0..31) times signed activations: no sign trick needed.
        let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
        s16[r] = _mm256_add_epi16(s16[r], p);
    }
}

/// `ng` consecutive groups at `g`, group `i`'s results in `out[i * RX .. (i + 1) * RX]`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn groups_kernel<const T: u8, const RX: usize>(
    g: *const u8,
    ng: usize,
    nb: usize,
    x: [*const u8; X8_MAX_RX],
    xsum: [*const i32; X8_MAX_RX],
    out: &mut [[f32; 8]],
) {
    let tsz = [34, 18, 20, 22][T as usize];
    for (i, o) in out.chunks_exact_mut(RX).take(ng).enumerate() {
        // SAFETY: `x8_group` checked that `g` holds ng groups of nb group-blocks of 8 * tsz.
        unsafe { kernel::<T, RX>(g.add(i * nb * X8_ROWS * tsz), nb, x, xsum, o) };
    }
}

#[inline(always)]
unsafe fn kernel<const T: u8, const RX: usize>(
    g: *const u8,
    nb: usize,
    x: [*const u8; X8_MAX_RX],
    xsum: [*const i32; X8_MAX_RX],
    out: &mut [[f32; 8]],
) {
    let (tsz, q0, xbs, bias) = match T {
        T_Q8_0 => (34, 16, 34, 0),
        T_Q4_0 => (18, 16, 34, 8),
        T_Q4_1 => (20, 32, 36, 0),
        _ => (22, 48, 34, 16),
    };
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); RX];
    let mut extra = [_mm256_setzero_ps(); RX];
    for b in 0..nb {
        // SAFETY (all pointer arithmetic below): b < nb, and `x8_group` checked that the group
        // holds nb group-blocks of 8 * tsz bytes and every activation row nb blocks of xbs.
        let gb = unsafe { g.add(b * X8_ROWS * tsz) };
        // The stream PREFETCH_BYTES ahead, requested while this block computes: measured
        // 10-20% faster decode from DRAM than the hardware prefetcher alone (Gemma tg64 1T
        // 22.8/24.1 -> 25.0/29.9 tok/s; 1024-8192 bytes all similar). A prefetch never faults,
        // so running past the end of the weights is harmless.
        for off in (0..X8_ROWS * tsz).step_by(64) {
            _mm_prefetch(
                gb.wrapping_add(PREFETCH_BYTES + off) as *const i8,
                _MM_HINT_T0,
            );
        }
        let xb: [*const u8; X8_MAX_RX] = std::array::from_fn(|r| unsafe { x[r].add(b * xbs) });
        let mut tot = [_mm256_setzero_si256(); RX];
        if T == T_Q8_0 {
            for c in 0..8 {
                let w = unsafe { ld32(gb.add(q0 + 32 * c)) };
                // maddubs needs an unsigned operand: |w| with w's sign moved onto x. No pair sum
                // saturates: |w| <= 128, |x| <= 127 (the activation quantizer's range).
                let aw = _mm256_sign_epi8(w, w);
                for r in 0..RX {
                    let xv = unsafe { bcast4(xb[r].add(2 + 4 * c)) };
                    let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w));
                    tot[r] = _mm256_add_epi32(tot[r], _mm256_madd_epi16(p, ones));
                }
            }
        } else {
            let hq = if T == T_Q5_0 {
                unsafe { ld32(gb.add(16)) }
            } else {
                _mm256_setzero_si256()
            };
            // i16 partial sums: a nibble chunk adds at most 2 * 2 * 15 * 127 = 7620 per lane,
            // so all four fit (30480); Q5_0's quants reach 31 (15748 per chunk): two at a time.
            let mut s16 = [_mm256_setzero_si256(); RX];
            unsafe { nibble_chunk::<T, RX>(gb, q0, hq, 0, &xb, &mut s16) };
            unsafe { nibble_chunk::<T, RX>(gb, q0, hq, 1, &xb, &mut s16) };
            if T == T_Q5_0 {
                for r in 0..RX {
                    tot[r] = _mm256_madd_epi16(s16[r], ones);
                    s16[r] = _mm256_setzero_si256();
                }
            }
            unsafe { nibble_chunk::<T, RX>(gb, q0, hq, 2, &xb, &mut s16) };
            unsafe { nibble_chunk::<T, RX>(gb, q0, hq, 3, &xb, &mut s16) };
            for r in 0..RX {
                tot[r] = _mm256_add_epi32(tot[r], _mm256_madd_epi16(s16[r], ones));
                if bias != 0 {
                    let s = unsafe { *xsum[r].add(b) };
                    tot[r] = _mm256_sub_epi32(tot[r], _mm256_set1_epi32(bias * s));
                }
            }
        }
        // SAFETY: the group-block starts with the eight f16 scales (Q4_1: then the mins).
        let dw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(gb as *const __m128i) });
        for r in 0..RX {
            let d = _mm256_mul_ps(dw, _mm256_set1_ps(unsafe { f16_ptr(xb[r]) }));
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(tot[r]), acc[r]);
        }
        if T == T_Q4_1 {
            let mw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(gb.add(16) as *const __m128i) });
            for r in 0..RX {
                let sx = _mm256_set1_ps(unsafe { f16_ptr(xb[r].add(2)) });
                extra[r] = _mm256_fmadd_ps(mw, sx, extra[r]);
            }
        }
    }
    for r in 0..RX {
        let v = if T == T_Q4_1 {
            _mm256_add_ps(acc[r], extra[r])
        } else {
            acc[r]
        };
        // SAFETY: out has at least RX rows of 8 f32 (checked by `x8_group`).
        unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), v) };
    }
}

/// `x8::dequantize_group_scalar` on AVX2: one interleaved group (`group`, 8 rows of `k`) to
/// eight f32 rows (`out`, `8 × k`, row-major), each value computed as the plain dequantizer
/// does (`q · d`; Q4_1 `q · d + m`; Q4_0/Q5_0 after their bias), so the two agree bit for bit.
pub(crate) fn dequantize_group(ty: GgmlType, group: &[u8], k: usize, out: &mut [f32]) {
    let tsz = ty.type_size();
    let nb = k / 32;
    // The pointer reads and writes below rely on these sizes: a violation is a caller bug.
    assert!(
        crate::x8::supports_x8(ty)
            && k.is_multiple_of(32)
            && group.len() == nb * X8_ROWS * tsz
            && out.len() == X8_ROWS * k,
        "x8 group dequantization operands of the wrong size"
    );
    // SAFETY: AVX2/FMA/F16C confirmed by the caller's dispatch; sizes asserted above.
    unsafe {
        match ty {
            GgmlType::Q8_0 => dequant_kernel::<T_Q8_0>(group.as_ptr(), nb, k, out),
            GgmlType::Q4_0 => dequant_kernel::<T_Q4_0>(group.as_ptr(), nb, k, out),
            GgmlType::Q4_1 => dequant_kernel::<T_Q4_1>(group.as_ptr(), nb, k, out),
            _ => dequant_kernel::<T_Q5_0>(group.as_ptr(), nb, k, out),
        }
    }
}

/// Lanes `[r ×4, r+1 ×4]` of the eight per-row values `v` (rows `r = 2p`, `2p + 1`).
#[inline(always)]
unsafe fn pair_lanes(v: __m256, p: usize) -> __m256 {
    let (a, b) = (2 * p as i32, 2 * p as i32 + 1);
    _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(a, a, a, a, b, b, b, b))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_kernel<const T: u8>(g: *const u8, nb: usize, k: usize, out: &mut [f32]) {
    let (tsz, q0) = match T {
        T_Q8_0 => (34, 16),
        T_Q4_0 => (18, 16),
        T_Q4_1 => (20, 32),
        _ => (22, 48),
    };
    let o = out.as_mut_ptr();
    // Stores four f32 of `v`'s low half at row 2p, its high half at row 2p + 1, element `e`.
    let put = |v: __m256, p: usize, e: usize| {
        // SAFETY: rows 2p, 2p + 1 < 8 and e + 4 <= k: inside `out` (8 x k).
        unsafe {
            _mm_storeu_ps(o.add(2 * p * k + e), _mm256_castps256_ps128(v));
            _mm_storeu_ps(o.add((2 * p + 1) * k + e), _mm256_extractf128_ps::<1>(v));
        }
    };
    for b in 0..nb {
        // SAFETY (all reads below): b < nb, and the group holds nb group-blocks of 8 * tsz.
        let gb = unsafe { g.add(b * X8_ROWS * tsz) };
        let dw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(gb as *const __m128i) });
        let mw = if T == T_Q4_1 {
            _mm256_cvtph_ps(unsafe { _mm_loadu_si128(gb.add(16) as *const __m128i) })
        } else {
            _mm256_setzero_ps()
        };
        for p in 0..4 {
            let d = unsafe { pair_lanes(dw, p) };
            let m = unsafe { pair_lanes(mw, p) };
            if T == T_Q8_0 {
                for c in 0..8 {
                    let q =
                        unsafe { _mm_loadl_epi64(gb.add(q0 + 32 * c + 8 * p) as *const __m128i) };
                    let v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
                    put(v, p, 32 * b + 4 * c);
                }
                continue;
            }
            let hq = if T == T_Q5_0 {
                unsafe { _mm_loadl_epi64(gb.add(16 + 8 * p) as *const __m128i) }
            } else {
                _mm_setzero_si128()
            };
            let m4 = _mm_set1_epi8(0x0F);
            for c in 0..4 {
                let x = unsafe { _mm_loadl_epi64(gb.add(q0 + 32 * c + 8 * p) as *const __m128i) };
                let mut lo = _mm_and_si128(x, m4);
                let mut hi = _mm_and_si128(_mm_srli_epi16::<4>(x), m4);
                if T == T_Q5_0 {
                    let b4 = _mm_set1_epi8(0x10);
                    let (jl, jh) = (2 * c, 2 * c + 1);
                    let h256 = _mm256_castsi128_si256(hq);
                    let bl = _mm256_castsi256_si128(unsafe { bit_j_to_4(h256, jl) });
                    let bh = _mm256_castsi256_si128(unsafe { bit_j_to_4(h256, jh) });
                    lo = _mm_or_si128(lo, _mm_and_si128(bl, b4));
                    hi = _mm_or_si128(hi, _mm_and_si128(bh, b4));
                }
                for (h, q) in [lo, hi].into_iter().enumerate() {
                    let mut qi = _mm256_cvtepu8_epi32(q);
                    if T == T_Q4_0 {
                        qi = _mm256_sub_epi32(qi, _mm256_set1_epi32(8));
                    } else if T == T_Q5_0 {
                        qi = _mm256_sub_epi32(qi, _mm256_set1_epi32(16));
                    }
                    let mut v = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), d);
                    if T == T_Q4_1 {
                        v = _mm256_add_ps(v, m);
                    }
                    put(v, p, 32 * b + 16 * h + 4 * c);
                }
            }
        }
    }
}
