//! AVX-512 (F, BW, VL + VNNI) kernels of the fast path, chosen at run time over the AVX2 ones
//! (`x86.rs`, `x86_x8.rs`) when [`crate::has_avx512()`] says the CPU has them and `NPUC_ISA`
//! allows the `avx512` level. Each computes exactly what its scalar twin computes, in the same
//! order, lane by lane, so the proptests in `tests/kernels.rs` compare them bit for bit:
//!
//! - [`gemm_micro_wide`]: the f32 GEMM micro-kernel (twin `gemm::micro_scalar`, run per
//!   6-row half and per activation group) over 12 weight rows and two packed 16-row activation
//!   groups at once: one 16-lane vector per group, 24 accumulators, so each activation load
//!   feeds 12 fused multiply-adds and each weight broadcast two (the AVX2 kernel: 6 x 16 with
//!   8-lane vectors). Each output stays one chain of fused multiply-adds in `kk` order.
//! - [`x8_group`]: the interleaved-layout products (twin `x8::x8_group_scalar`) over two
//!   8-row groups at once (16 rows in the 16 lanes of one register), with `vpdpbusd` summing
//!   four u8 x i8 products per lane straight into i32 (the AVX2 kernel: `maddubs` into i16,
//!   `madd`, `add`). The integer block totals are exact either way; the per-block f32 steps are
//!   the twin's.
//!
//! Only called after `crate::has_avx512()` said yes (which also implies AVX2, FMA and F16C).

use crate::gemm::{NR, WIDE_MR};
use crate::x8::{quant_bias, X8_MAX_RX, X8_ROWS};
use crate::GgmlType;
use std::arch::x86_64::*;

/// `gemm::WideFn` on AVX-512: `out[g * WIDE_MR * NR + r * NR + i]` = weight row `r` (`rows` of
/// them, `ldw` apart) · packed activation group `g` (`xp[g * k * NR ..]`, `g < groups <= 2`)
/// row `i`.
pub(crate) fn gemm_micro_wide(
    w: &[f32],
    ldw: usize,
    rows: usize,
    xp: &[f32],
    k: usize,
    groups: usize,
    out: &mut [f32; 2 * WIDE_MR * NR],
) {
    assert!(
        rows <= WIDE_MR
            && (1..=2).contains(&groups)
            && xp.len() >= groups * k * NR
            && (rows == 0 || w.len() >= (rows - 1) * ldw + k)
    );
    macro_rules! go {
        ($($r:literal)*) => {
            match (rows, groups) {
                $(
                    // SAFETY: `has_avx512()` confirmed AVX-512 F before this kernel was chosen
                    // (`gemm::kernels`); the assert above keeps every read inside `w` and `xp`.
                    ($r, 1) => unsafe { gemm_wide_avx512::<$r, 1>(w, ldw, xp, k, out) },
                    ($r, _) => unsafe { gemm_wide_avx512::<$r, 2>(w, ldw, xp, k, out) },
                )*
                _ => {}
            }
        };
    }
    go!(1 2 3 4 5 6 7 8 9 10 11 12);
}

/// R weight rows x G 16-row activation groups: R * G accumulators (24 of the 32 registers at
/// 12 x 2), so each 16-lane activation load feeds R fused multiply-adds and each weight
/// broadcast G: per `kk` 2 loads + 12 broadcasts for 24 FMAs, which keeps the activation
/// stream from L2 (k x 2 x 64 bytes per call) under the FMA rate (a 6 x 2 tile measured only
/// 1.3x the AVX2 kernel).
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn gemm_wide_avx512<const R: usize, const G: usize>(
    w: &[f32],
    ldw: usize,
    xp: &[f32],
    k: usize,
    out: &mut [f32; 2 * WIDE_MR * NR],
) {
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    let wp = w.as_ptr();
    // SAFETY: group g < G starts g * k * NR floats in (`gemm_micro_wide` checked G k NR).
    let xg: [*const f32; G] = std::array::from_fn(|g| unsafe { xp.as_ptr().add(g * k * NR) });
    for kk in 0..k {
        // SAFETY: kk < k: 16 floats at kk * NR of each group and w[r * ldw + kk] (r < R) are
        // inside the slices (checked by `gemm_micro_wide`).
        unsafe {
            let xv: [__m512; G] = std::array::from_fn(|g| _mm512_loadu_ps(xg[g].add(kk * NR)));
            for r in 0..R {
                let wv = _mm512_set1_ps(*wp.add(r * ldw + kk));
                for g in 0..G {
                    acc[r][g] = _mm512_fmadd_ps(wv, xv[g], acc[r][g]);
                }
            }
        }
    }
    for r in 0..R {
        for g in 0..G {
            // SAFETY: r < R <= WIDE_MR, g < G <= 2: 16 floats at g * WIDE_MR * NR + r * NR
            // lie inside `out`.
            unsafe {
                _mm512_storeu_ps(out.as_mut_ptr().add(g * WIDE_MR * NR + r * NR), acc[r][g]);
            }
        }
    }
}

/// How far ahead of the group-blocks being multiplied each weight stream is prefetched (as
/// the AVX2 kernel: 1-8 KiB measured alike there).
const PREFETCH_BYTES: usize = 2048;
const T_Q8_0: u8 = 0;
const T_Q4_0: u8 = 1;
const T_Q4_1: u8 = 2;
const T_Q5_0: u8 = 3;

/// `x8::X8Fn` on AVX-512 VNNI: checks the operand sizes (the kernel reads through raw
/// pointers), then runs pairs of groups through the 16-lane kernel and an odd last group
/// through the AVX2 one (both equal the scalar twin bit for bit).
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
    let pairs = ng / 2;
    if pairs > 0 {
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
                // SAFETY: AVX-512 F/BW/VL/VNNI confirmed by the caller's dispatch
                // (`x8::x8_fn`); the assertion above guarantees `nb` blocks in each of the
                // 2 * pairs groups and in every activation row (and `nb` block sums where the
                // type reads them).
                unsafe {
                    match rx {
                        1 => pairs_kernel::<$t, 1>(g, pairs, nb, xp, sp, out),
                        2 => pairs_kernel::<$t, 2>(g, pairs, nb, xp, sp, out),
                        3 => pairs_kernel::<$t, 3>(g, pairs, nb, xp, sp, out),
                        _ => pairs_kernel::<$t, 4>(g, pairs, nb, xp, sp, out),
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
    if ng % 2 == 1 {
        let last = ng - 1;
        crate::x86_x8::x8_group(
            ty,
            &groups[last * gbytes..],
            k,
            x,
            xsum,
            &mut out[last * rx..ng * rx],
        );
    }
}

/// `pairs` pairs of consecutive groups at `g`; group `i`'s results in `out[i * RX .. (i + 1) * RX]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pairs_kernel<const T: u8, const RX: usize>(
    g: *const u8,
    pairs: usize,
    nb: usize,
    x: [*const u8; X8_MAX_RX],
    xsum: [*const i32; X8_MAX_RX],
    out: &mut [[f32; 8]],
) {
    let tsz = [34, 18, 20, 22][T as usize];
    let gbytes = nb * X8_ROWS * tsz;
    for (i, o) in out.chunks_exact_mut(2 * RX).take(pairs).enumerate() {
        // SAFETY: `x8_group` checked that `g` holds 2 * pairs groups of `gbytes`.
        unsafe { pair::<T, RX>(g.add(2 * i * gbytes), gbytes, nb, x, xsum, o) };
    }
}

/// 32 bytes at `a` in the low half, 32 at `b` in the high half.
#[inline(always)]
unsafe fn ld2x32(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 32 readable bytes at `a` and at `b`.
    unsafe {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(a as *const __m256i)),
            _mm256_loadu_si256(b as *const __m256i),
        )
    }
}

/// The 8 f16 at `a` then the 8 at `b`, as 16 f32.
#[inline(always)]
unsafe fn f16x2x8(a: *const u8, b: *const u8) -> __m512 {
    // SAFETY: the caller guarantees 16 readable bytes at `a` and at `b`.
    unsafe {
        _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(a as *const __m128i)),
            _mm_loadu_si128(b as *const __m128i),
        ))
    }
}

/// The four bytes at `p` in every 32-bit lane.
#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 4 readable bytes at `p`.
    _mm512_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
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
unsafe fn bit_j_to_4(hq: __m512i, j: usize) -> __m512i {
    match j {
        0 => _mm512_slli_epi32::<4>(hq),
        1 => _mm512_slli_epi32::<3>(hq),
        2 => _mm512_slli_epi32::<2>(hq),
        3 => _mm512_slli_epi32::<1>(hq),
        4 => hq,
        5 => _mm512_srli_epi32::<1>(hq),
        6 => _mm512_srli_epi32::<2>(hq),
        _ => _mm512_srli_epi32::<3>(hq),
    }
}

/// Groups `a` (lanes 0..8) and `a + gbytes` (lanes 8..16) against the RX activation rows:
/// `out[r]` gets group a's results, `out[RX + r]` group b's.
#[inline(always)]
unsafe fn pair<const T: u8, const RX: usize>(
    a: *const u8,
    gbytes: usize,
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
    let m4 = _mm512_set1_epi8(0x0F);
    let b4 = _mm512_set1_epi8(0x10);
    let mut acc = [_mm512_setzero_ps(); RX];
    let mut extra = [_mm512_setzero_ps(); RX];
    for blk in 0..nb {
        // SAFETY (all pointer arithmetic below): blk < nb, and `x8_group` checked that both
        // groups hold nb group-blocks of 8 * tsz bytes and every activation row nb blocks of
        // xbs (and nb block sums where read).
        let ga = unsafe { a.add(blk * X8_ROWS * tsz) };
        let gb = unsafe { ga.add(gbytes) };
        // Both streams PREFETCH_BYTES ahead (a prefetch never faults, so running past the end
        // of the weights is harmless).
        for off in (0..X8_ROWS * tsz).step_by(64) {
            _mm_prefetch(
                ga.wrapping_add(PREFETCH_BYTES + off) as *const i8,
                _MM_HINT_T0,
            );
            _mm_prefetch(
                gb.wrapping_add(PREFETCH_BYTES + off) as *const i8,
                _MM_HINT_T0,
            );
        }
        let xb: [*const u8; X8_MAX_RX] = std::array::from_fn(|r| unsafe { x[r].add(blk * xbs) });
        let mut tot = [_mm512_setzero_si512(); RX];
        if T == T_Q8_0 {
            let zero = _mm512_setzero_si512();
            for c in 0..8 {
                let w = unsafe { ld2x32(ga.add(q0 + 32 * c), gb.add(q0 + 32 * c)) };
                // vpdpbusd needs an unsigned operand: |w| (-128 becomes 128 as u8) with w's
                // sign moved onto x (|x| <= 127, the activation quantizer's range, so the
                // negation never wraps). Totals are exact in i32 (32 products <= 128 * 127).
                let aw = _mm512_abs_epi8(w);
                let neg = _mm512_movepi8_mask(w);
                for r in 0..RX {
                    let xv = unsafe { bcast4(xb[r].add(2 + 4 * c)) };
                    let xs = _mm512_mask_sub_epi8(xv, neg, zero, xv);
                    tot[r] = _mm512_dpbusd_epi32(tot[r], aw, xs);
                }
            }
        } else {
            let hq = if T == T_Q5_0 {
                unsafe { ld2x32(ga.add(16), gb.add(16)) }
            } else {
                _mm512_setzero_si512()
            };
            let xoff = if T == T_Q4_1 { 4 } else { 2 };
            for c in 0..4 {
                let w = unsafe { ld2x32(ga.add(q0 + 32 * c), gb.add(q0 + 32 * c)) };
                let mut lo = _mm512_and_si512(w, m4);
                let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), m4);
                if T == T_Q5_0 {
                    lo =
                        _mm512_or_si512(lo, _mm512_and_si512(unsafe { bit_j_to_4(hq, 2 * c) }, b4));
                    hi = _mm512_or_si512(
                        hi,
                        _mm512_and_si512(unsafe { bit_j_to_4(hq, 2 * c + 1) }, b4),
                    );
                }
                for r in 0..RX {
                    // SAFETY: the activation block holds 32 quants at xoff.., 16 + 4c + 4 <= 32.
                    let (xl, xh) = unsafe {
                        (
                            bcast4(xb[r].add(xoff + 4 * c)),
                            bcast4(xb[r].add(xoff + 16 + 4 * c)),
                        )
                    };
                    // Unsigned quants (0..15, Q5_0 0..31) times signed activations, four
                    // products per lane summed into i32: exact.
                    tot[r] = _mm512_dpbusd_epi32(tot[r], lo, xl);
                    tot[r] = _mm512_dpbusd_epi32(tot[r], hi, xh);
                }
            }
            if bias != 0 {
                for r in 0..RX {
                    let s = unsafe { *xsum[r].add(blk) };
                    tot[r] = _mm512_sub_epi32(tot[r], _mm512_set1_epi32(bias * s));
                }
            }
        }
        // SAFETY: each group-block starts with its eight f16 scales (Q4_1: then the mins).
        let dw = unsafe { f16x2x8(ga, gb) };
        for r in 0..RX {
            let d = _mm512_mul_ps(dw, _mm512_set1_ps(unsafe { f16_ptr(xb[r]) }));
            acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(tot[r]), acc[r]);
        }
        if T == T_Q4_1 {
            let mw = unsafe { f16x2x8(ga.add(16), gb.add(16)) };
            for r in 0..RX {
                let sx = _mm512_set1_ps(unsafe { f16_ptr(xb[r].add(2)) });
                extra[r] = _mm512_fmadd_ps(mw, sx, extra[r]);
            }
        }
    }
    for r in 0..RX {
        let v = if T == T_Q4_1 {
            _mm512_add_ps(acc[r], extra[r])
        } else {
            acc[r]
        };
        // SAFETY: `out` holds 2 * RX rows of 8 f32 (`pairs_kernel` hands out 2 RX chunks).
        unsafe {
            _mm256_storeu_ps(out[r].as_mut_ptr(), _mm512_castps512_ps256(v));
            _mm256_storeu_ps(
                out[RX + r].as_mut_ptr(),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
            );
        }
    }
}

/// Q4_K x Q8_K, one weight row (twin `dot::q4_k_q8_k`, which the AVX2 kernel also equals bit
/// for bit): per 256-value block the exact integer totals (`vpdpbusd` over two 32-value
/// sub-blocks per register, times their 6-bit scales), then the twin's two f32 FMA chains
/// (scales, mins) subtracted at the end.
pub(crate) fn q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only handed out by `dot::best_fn` after `has_avx512()` confirmed AVX-512
    // F/BW/VL/VNNI (and AVX2, FMA, F16C); the kernel indexes through bounds-checked slices.
    unsafe { q4_k_q8_k_avx512(w, x) }
}

/// 32 bytes at `b[i..]` in the low half, 32 at `b[j..]` in the high half (bounds-checked).
#[inline(always)]
unsafe fn ld2x32_at(b: &[u8], i: usize, j: usize) -> __m512i {
    let (s, t) = (&b[i..i + 32], &b[j..j + 32]);
    // SAFETY: `s` and `t` are 32 readable bytes each.
    unsafe { ld2x32(s.as_ptr(), t.as_ptr()) }
}

/// `a` in lanes 0..8, `b` in lanes 8..16.
#[inline(always)]
unsafe fn set2x8(a: i32, b: i32) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi32(a)),
        _mm256_set1_epi32(b),
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_k_q8_k_avx512(w: &[u8], x: &[u8]) -> f32 {
    let m4 = _mm512_set1_epi8(0x0F);
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for (wb, xb) in w.chunks_exact(144).zip(x.chunks_exact(292)) {
        // The weight stream 2 KiB ahead, as the AVX2 kernel (never faults past the end).
        let ahead = wb.as_ptr().wrapping_add(2048);
        for off in (0..wb.len()).step_by(64) {
            _mm_prefetch(ahead.wrapping_add(off) as *const i8, _MM_HINT_T0);
        }
        let yd = f32::from_le_bytes([xb[0], xb[1], xb[2], xb[3]]);
        let mut sc = [0i32; 8];
        let mut summs = 0i32;
        for j in 0..8 {
            let (s, m) = crate::dequant::scale_min_k4(j, &wb[4..16]);
            sc[j] = s as i32;
            let at = 4 + crate::QK_K + 4 * j;
            let b0 = i16::from_le_bytes([xb[at], xb[at + 1]]) as i32;
            let b1 = i16::from_le_bytes([xb[at + 2], xb[at + 3]]) as i32;
            summs += m as i32 * (b0 + b1);
        }
        let mut sumi = _mm512_setzero_si512();
        for jj in 0..2 {
            // Bytes 0..32 hold sub-blocks 4jj (low nibbles) and 4jj + 1 (high), bytes 32..64
            // sub-blocks 4jj + 2 and 4jj + 3; sub-block s meets activations 32 s ..
            let q = unsafe { ld2x32_at(wb, 16 + 64 * jj, 48 + 64 * jj) };
            let lo = _mm512_and_si512(q, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
            let a = 4 + 128 * jj;
            let (xl, xh) = unsafe { (ld2x32_at(xb, a, a + 64), ld2x32_at(xb, a + 32, a + 96)) };
            // Nibbles (0..15) times q8: per lane 4 products, exact in i32; times the 6-bit
            // sub-block scale (<= 63 * 32 * 15 * 128 per sub-block): exact.
            let pl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl);
            let ph = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, xh);
            let sl = unsafe { set2x8(sc[4 * jj], sc[4 * jj + 2]) };
            let sh = unsafe { set2x8(sc[4 * jj + 1], sc[4 * jj + 3]) };
            sumi = _mm512_add_epi32(
                sumi,
                _mm512_add_epi32(_mm512_mullo_epi32(pl, sl), _mm512_mullo_epi32(ph, sh)),
            );
        }
        let isum = _mm512_reduce_add_epi32(sumi);
        let d = crate::f16_at(wb, 0) * yd;
        let dmin = crate::f16_at(wb, 2) * yd;
        acc = (isum as f32).mul_add(d, acc);
        acc_m = (summs as f32).mul_add(dmin, acc_m);
    }
    acc - acc_m
}
