//! AVX2+FMA kernels (x86_64). Each has a scalar twin in `dot.rs` / `matmul.rs`; the proptests in
//! `tests/kernels.rs` compare them. Only called after `crate::has_avx2()` said yes.

use crate::dequant::scale_min_k4;
/// A row dot product over raw blocks: the function-pointer type `dot` dispatches through, spelled
/// out here (identical type) so that this module depends on no other kernel module.
type DotFn = fn(&[u8], &[u8]) -> f32;
use crate::gemm::{MR, NR};
use crate::{GgmlType, QK_K};
use std::arch::x86_64::*;

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

/// The AVX2 kernel for `ty`, when there is one.
pub(crate) fn avx2_fn(ty: GgmlType) -> Option<DotFn> {
    Some(match ty {
        GgmlType::F16 => f16_f16,
        GgmlType::Q4_0 => q4_0_q8_0,
        GgmlType::Q4_1 => q4_1_q8_1,
        GgmlType::Q5_0 => q5_0_q8_0,
        GgmlType::Q8_0 => q8_0_q8_0,
        GgmlType::Q4_K => q4_k_q8_k,
        GgmlType::Q6_K => q6_k_q8_k,
        _ => return None,
    })
}

/// Loads 32 bytes at `b[at..at + 32]`; the slice index is the bounds check.
#[inline(always)]
unsafe fn load32(b: &[u8], at: usize) -> __m256i {
    let s = &b[at..at + 32];
    // SAFETY: `s` is exactly 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(s.as_ptr() as *const __m256i) }
}

/// Loads 16 bytes at `b[at..at + 16]`.
#[inline(always)]
unsafe fn load16(b: &[u8], at: usize) -> __m128i {
    let s = &b[at..at + 16];
    // SAFETY: `s` is exactly 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(s.as_ptr() as *const __m128i) }
}

/// Σ of signed i8 products, pairwise, as 8 f32 lanes (each lane the sum of 4 products).
#[inline(always)]
unsafe fn mul_sum_i8_pairs_float(x: __m256i, y: __m256i) -> __m256 {
    // maddubs needs one unsigned operand: |x| times y with x's sign moved onto y.
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    let dot = _mm256_maddubs_epi16(ax, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)))
}

/// The 16 nibbles of `qs[16]` as 32 bytes: low nibbles (elements 0..16) then high (16..32).
#[inline(always)]
unsafe fn nibbles(b: &[u8], at: usize) -> __m256i {
    let t = load16(b, at);
    let both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// Expands the 32 bits of `x` to 32 bytes: 0xFF where the bit is set, 0 elsewhere.
#[inline(always)]
unsafe fn bytes_from_bits_32(x: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
    let bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit), _mm256_set1_epi64x(-1))
}

fn q8_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { q8_0_q8_0_avx2(w, x) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_q8_0_avx2(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (wb, xb) in w.chunks_exact(34).zip(x.chunks_exact(34)) {
        let d = _mm256_set1_ps(f16c(wb, 0) * f16c(xb, 0));
        let q = mul_sum_i8_pairs_float(load32(wb, 2), load32(xb, 2));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum(acc)
}

fn q4_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { q4_0_q8_0_avx2(w, x) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_q8_0_avx2(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let off = _mm256_set1_epi8(8);
    for (wb, xb) in w.chunks_exact(18).zip(x.chunks_exact(34)) {
        let d = _mm256_set1_ps(f16c(wb, 0) * f16c(xb, 0));
        let qw = _mm256_sub_epi8(nibbles(wb, 2), off);
        let q = mul_sum_i8_pairs_float(qw, load32(xb, 2));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum(acc)
}

fn q4_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { q4_1_q8_1_avx2(w, x) }
}

/// ggml's AVX2 `ggml_vec_dot_q4_1_q8_1` (scalar twin: `dot::q4_1_q8_1`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_q8_1_avx2(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0f32;
    for (wb, xb) in w.chunks_exact(20).zip(x.chunks_exact(36)) {
        summs = f16c(wb, 2).mul_add(f16c(xb, 2), summs);
        let d = _mm256_set1_ps(f16c(wb, 0) * f16c(xb, 0));
        // Unsigned nibbles: the sign trick of `mul_sum_i8_pairs_float` leaves them unchanged.
        let q = mul_sum_i8_pairs_float(nibbles(wb, 4), load32(xb, 4));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum(acc) + summs
}

fn q5_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { q5_0_q8_0_avx2(w, x) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_q8_0_avx2(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (wb, xb) in w.chunks_exact(22).zip(x.chunks_exact(34)) {
        let d = _mm256_set1_ps(f16c(wb, 0) * f16c(xb, 0));
        let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
        // q - 16 = nibble when the 5th bit is set, nibble | 0xF0 (nibble - 16) when not.
        let hi = _mm256_andnot_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0xF0u8 as i8));
        let qw = _mm256_or_si256(nibbles(wb, 6), hi);
        let q = mul_sum_i8_pairs_float(qw, load32(xb, 2));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum(acc)
}

/// The parts of a Q8_K block: `d` and the 16 bsums as one register.
#[inline(always)]
unsafe fn q8k_d_bsums(xb: &[u8]) -> (f32, __m256i) {
    let d = f32::from_le_bytes([xb[0], xb[1], xb[2], xb[3]]);
    (d, load32(xb, 4 + QK_K))
}

fn q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { q4_k_q8_k_avx2::<false>(w, x) }
}

/// Twin of `dot::q4_k_q8_k_grouped` (rows in 4-row groups of a batch).
pub(crate) fn q4_k_q8_k_grouped(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only handed out by `dot::grouped_fn` after `has_avx2()` confirmed AVX2, FMA, F16C.
    unsafe { q4_k_q8_k_avx2::<true>(w, x) }
}

/// Exact integer sum of 8 i32 lanes.
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
    let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b10_11_00_01));
    _mm_cvtsi128_si32(s4)
}

/// `GROUPED`: FMA per 64-value sub-block (llama.cpp's 4-row repacked kernel) instead of per block.
/// Requests the weight stream 2 KiB past the start of `block` (the block's own size of it):
/// the one-row K-quant kernels read rows back to back, and the hardware prefetcher alone left
/// decode short of the bandwidth (see `x86_x8`'s measurement). Never faults past the end.
#[inline(always)]
unsafe fn stream_ahead(block: &[u8]) {
    let p = block.as_ptr().wrapping_add(2048);
    for off in (0..block.len()).step_by(64) {
        _mm_prefetch(p.wrapping_add(off) as *const i8, _MM_HINT_T0);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_q8_k_avx2<const GROUPED: bool>(w: &[u8], x: &[u8]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for (wb, xb) in w.chunks_exact(144).zip(x.chunks_exact(292)) {
        stream_ahead(wb);
        let (yd, bsums) = q8k_d_bsums(xb);
        let d = f16c(wb, 0) * yd;
        let dmin = f16c(wb, 2) * yd;
        let mut sc = [0i16; 8];
        let mut mn = [0i16; 8];
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, &wb[4..16]);
            sc[j] = s as i16;
            mn[j] = m as i16;
        }
        // Σ_j min_j · (bsum of its 32 values): pair up the 16 bsums, then one madd.
        let pairs = _mm_hadd_epi16(
            _mm256_castsi256_si128(bsums),
            _mm256_extracti128_si256(bsums, 1),
        );
        // SAFETY: `mn` is 8 i16 = 16 readable bytes.
        let mins = unsafe { _mm_loadu_si128(mn.as_ptr() as *const __m128i) };
        let pm = _mm_madd_epi16(mins, pairs);
        let pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0b01_00_11_10));
        let pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0b10_11_00_01));
        let summs = _mm_cvtsi128_si32(pm);
        let mut bs = [0i32; 16];
        for (j, b) in bs.iter_mut().enumerate() {
            let at = 4 + QK_K + 2 * j;
            *b = i16::from_le_bytes([xb[at], xb[at + 1]]) as i32;
        }
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let q4 = load32(wb, 16 + 32 * j);
            let q4l = _mm256_and_si256(q4, m4);
            let q4h = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            let pl = _mm256_maddubs_epi16(q4l, load32(xb, 4 + 64 * j));
            let ph = _mm256_maddubs_epi16(q4h, load32(xb, 4 + 64 * j + 32));
            let pl = _mm256_madd_epi16(_mm256_set1_epi16(sc[2 * j]), pl);
            let ph = _mm256_madd_epi16(_mm256_set1_epi16(sc[2 * j + 1]), ph);
            if GROUPED {
                let isum = hsum_i32(_mm256_add_epi32(pl, ph));
                let sm = mn[2 * j] as i32 * (bs[4 * j] + bs[4 * j + 1])
                    + mn[2 * j + 1] as i32 * (bs[4 * j + 2] + bs[4 * j + 3]);
                acc = (isum as f32).mul_add(d, acc);
                acc_m = (sm as f32).mul_add(dmin, acc_m);
            } else {
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
        }
        if !GROUPED {
            // Exact integer total of the block, then the two FMA chains of the scalar twin.
            acc = (hsum_i32(sumi) as f32).mul_add(d, acc);
            acc_m = (summs as f32).mul_add(dmin, acc_m);
        }
    }
    acc - acc_m
}

fn q6_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { q6_k_q8_k_avx2::<false>(w, x) }
}

/// Twin of `dot::q6_k_q8_k_tiled` (rows of batches of >= 8: llama.cpp's tiled kernel rounding).
pub(crate) fn q6_k_q8_k_tiled(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only handed out by `dot::batch_fn` after `has_avx2()` confirmed AVX2, FMA, F16C.
    unsafe { q6_k_q8_k_avx2::<true>(w, x) }
}

/// The 6-bit quants (0..63) of half-block `n` of a Q6_K block, as four 32-byte quarters.
#[inline(always)]
unsafe fn q6_k_quants(wb: &[u8], n: usize) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(0x03);
    let b1 = load32(wb, 64 * n);
    let b2 = load32(wb, 64 * n + 32);
    let bh = load32(wb, 128 + 32 * n);
    let h0 = _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4);
    let h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 2), m3), 4);
    let h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 4), m3), 4);
    let h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 6), m3), 4);
    [
        _mm256_or_si256(_mm256_and_si256(b1, m4), h0),
        _mm256_or_si256(_mm256_and_si256(b2, m4), h1),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), h2),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), h3),
    ]
}

/// `TILED`: per block the exact integer total times the weight scale, FMA'd with the
/// activation scale in one scalar chain (the integer part is order-free, so this equals the
/// scalar twin bit for bit) instead of eight f32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_q8_k_avx2<const TILED: bool>(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut acc_tiled = 0f32;
    for (wb, xb) in w.chunks_exact(210).zip(x.chunks_exact(292)) {
        stream_ahead(wb);
        let (yd, bsums) = q8k_d_bsums(xb);
        let d = yd * f16c(wb, 208);
        let sc = &wb[192..208];
        // SAFETY: `sc` is 16 readable bytes.
        let scales = unsafe { _mm_loadu_si128(sc.as_ptr() as *const __m128i) };
        // 32 * (scale * bsum) summed per pair of 16-value groups: the -32 offset of the quants.
        let offset = _mm256_slli_epi32(_mm256_madd_epi16(bsums, _mm256_cvtepi8_epi16(scales)), 5);
        let mut sumi = _mm256_setzero_si256();
        for n in 0..2 {
            let q = q6_k_quants(wb, n);
            for (t, &qt) in q.iter().enumerate() {
                // Unsigned quants (0..63) times q8: |pair sums| <= 2*63*128, no saturation.
                let p = _mm256_maddubs_epi16(qt, load32(xb, 4 + 128 * n + 32 * t));
                let g = 8 * n + 2 * t;
                let s = _mm256_set_m128i(
                    _mm_set1_epi16(sc[g + 1] as i8 as i16),
                    _mm_set1_epi16(sc[g] as i8 as i16),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(s, p));
            }
        }
        let sumi = _mm256_sub_epi32(sumi, offset);
        if TILED {
            let isum = hsum_i32(sumi);
            acc_tiled = (f16c(wb, 208) * isum as f32).mul_add(yd, acc_tiled);
        } else {
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        }
    }
    if TILED {
        acc_tiled
    } else {
        hsum(acc)
    }
}

fn f16_f16(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { f16_f16_avx2(w, x) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_f16_avx2(w: &[u8], x: &[u8]) -> f32 {
    let n = w.len().min(x.len()) / 2;
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let a = _mm256_cvtph_ps(load16(w, 2 * i));
        let b = _mm256_cvtph_ps(load16(x, 2 * i));
        acc = _mm256_fmadd_ps(a, b, acc);
        i += 8;
    }
    let mut s = hsum(acc);
    while i < n {
        s += f16c(w, 2 * i) * f16c(x, 2 * i);
        i += 1;
    }
    s
}

/// f16 → f32 (twin of `vecf32::f16_to_f32_row_scalar`).
pub(crate) fn f16_to_f32_row(src: &[u16], dst: &mut [f32]) {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { f16_to_f32_row_avx2(src, dst) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_to_f32_row_avx2(src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n <= both lengths: 8 u16 read from src[i..], 8 f32 written to dst[i..].
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    while i < n {
        dst[i] = half::f16::from_bits(src[i]).to_f32();
        i += 1;
    }
}

/// f32 → nearest f16 → f32 (twin of `vecf32::round_f16_row_scalar`).
pub(crate) fn round_f16_row(src: &[f32], dst: &mut [f32]) {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { round_f16_row_avx2(src, dst) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn round_f16_row_avx2(src: &[f32], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n <= both lengths: 8 f32 read from src[i..] and written to dst[i..].
        unsafe {
            let v = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    while i < n {
        dst[i] = half::f16::from_f32(src[i]).to_f32();
        i += 1;
    }
}

/// One row's dot product with `q` in the lane order of `vecf32::dot_rows_scalar`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_row_avx2(r: &[f32], q: &[f32]) -> f32 {
    let d = q.len().min(r.len());
    let full = d / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 <= full <= d <= both lengths.
        unsafe {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(r.as_ptr().add(i)),
                _mm256_loadu_ps(q.as_ptr().add(i)),
                acc,
            );
        }
        i += 8;
    }
    let mut s = hsum(acc);
    for i in full..d {
        s += r[i] * q[i];
    }
    s
}

/// `out[t] = rows[t] · q` (twin of `vecf32::dot_rows_scalar`).
pub(crate) fn dot_rows(rows: &[f32], q: &[f32], out: &mut [f32]) {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2 and FMA.
    unsafe { dot_rows_avx2(rows, q, out) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows_avx2(rows: &[f32], q: &[f32], out: &mut [f32]) {
    let d = q.len();
    let t_n = out.len().min(rows.len().checked_div(d).unwrap_or(0));
    let full = d / 8 * 8;
    let mut t = 0;
    // Four rows at a time: four independent FMA chains hide the FMA latency; each row's
    // result is the single-row order.
    while t + 4 <= t_n && full == d {
        let base = rows.as_ptr();
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let mut i = 0;
        while i < d {
            // SAFETY: rows t..t+4 end at (t + 4) * d <= t_n * d <= rows.len(); i + 8 <= d = q.len().
            unsafe {
                let qv = _mm256_loadu_ps(q.as_ptr().add(i));
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(base.add(t * d + i)), qv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(base.add((t + 1) * d + i)), qv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(base.add((t + 2) * d + i)), qv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(base.add((t + 3) * d + i)), qv, a3);
            }
            i += 8;
        }
        out[t] = hsum(a0);
        out[t + 1] = hsum(a1);
        out[t + 2] = hsum(a2);
        out[t + 3] = hsum(a3);
        t += 4;
    }
    while t < t_n {
        out[t] = dot_row_avx2(&rows[t * d..(t + 1) * d], q);
        t += 1;
    }
}

/// `out[j] = Σ_t p[t] · rows[t][j]` (twin of `vecf32::weighted_sum_scalar`).
pub(crate) fn weighted_sum(p: &[f32], rows: &[f32], out: &mut [f32]) {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2 and FMA.
    unsafe { weighted_sum_avx2(p, rows, out) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_sum_avx2(p: &[f32], rows: &[f32], out: &mut [f32]) {
    let d = out.len();
    let t_n = p.len().min(rows.len().checked_div(d).unwrap_or(0));
    let base = rows.as_ptr();
    let mut j = 0;
    // 32 outputs (four registers) per pass over the rows.
    while j + 32 <= d {
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        for (t, &w) in p[..t_n].iter().enumerate() {
            let wv = _mm256_set1_ps(w);
            // SAFETY: t < t_n so row t ends at (t + 1) * d <= rows.len(); j + 32 <= d.
            unsafe {
                let r = base.add(t * d + j);
                a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(r), a0);
                a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(r.add(8)), a1);
                a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(r.add(16)), a2);
                a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(r.add(24)), a3);
            }
        }
        // SAFETY: j + 32 <= d = out.len().
        unsafe {
            let o = out.as_mut_ptr().add(j);
            _mm256_storeu_ps(o, a0);
            _mm256_storeu_ps(o.add(8), a1);
            _mm256_storeu_ps(o.add(16), a2);
            _mm256_storeu_ps(o.add(24), a3);
        }
        j += 32;
    }
    while j + 8 <= d {
        let mut a = _mm256_setzero_ps();
        for (t, &w) in p[..t_n].iter().enumerate() {
            // SAFETY: row t ends at (t + 1) * d <= rows.len(); j + 8 <= d.
            unsafe {
                a = _mm256_fmadd_ps(_mm256_set1_ps(w), _mm256_loadu_ps(base.add(t * d + j)), a);
            }
        }
        // SAFETY: j + 8 <= d = out.len().
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(j), a) };
        j += 8;
    }
    while j < d {
        let mut acc = 0f32;
        for (t, &w) in p[..t_n].iter().enumerate() {
            acc = w.mul_add(rows[t * d + j], acc);
        }
        out[j] = acc;
        j += 1;
    }
}

// ---- Multi-row kernels (twins: `rows.rs`): tiles of up to 4 weight rows x 4 activation rows. ----

/// `(weight rows, activation rows, outputs [weight row][activation row])`, as `rows::RowsFn`.
type RowsFn = fn(&[&[u8]], &[&[u8]], &mut [f32]);

const T_Q8_0: u8 = 0;
const T_Q4_0: u8 = 1;
const T_Q5_0: u8 = 2;
const T_Q4_1: u8 = 3;

/// The multi-row AVX2 kernel for `ty`, when there is one.
pub(crate) fn rows_fn(ty: GgmlType) -> Option<RowsFn> {
    Some(match ty {
        GgmlType::Q8_0 => rows_q8_0,
        GgmlType::Q4_0 => rows_q4_0,
        GgmlType::Q5_0 => rows_q5_0,
        GgmlType::Q4_1 => rows_q4_1,
        GgmlType::Q4_K => rows_q4_k,
        GgmlType::Q6_K => rows_q6_k,
        _ => return None,
    })
}

/// Calls `$f::<RW, RX>` with the weight and activation rows as arrays (1..=4 each).
macro_rules! by_tile {
    ($f:ident $(::<$t:ident>)?, $w:expr, $x:expr, $out:expr) => {{
        let (w, x, out): (&[&[u8]], &[&[u8]], &mut [f32]) = ($w, $x, $out);
        macro_rules! rx {
            ($rw:literal, $wa:expr) => {
                match x.len() {
                    1 => $f::<$($t,)? $rw, 1>($wa, [x[0]], out),
                    2 => $f::<$($t,)? $rw, 2>($wa, [x[0], x[1]], out),
                    3 => $f::<$($t,)? $rw, 3>($wa, [x[0], x[1], x[2]], out),
                    _ => $f::<$($t,)? $rw, 4>($wa, [x[0], x[1], x[2], x[3]], out),
                }
            };
        }
        if !x.is_empty() {
            // SAFETY: only handed out by `rows::rows_fn` after `has_avx2()` confirmed AVX2, FMA
            // and F16C; the kernels check the row lengths they read.
            unsafe {
                match w.len() {
                    0 => {}
                    1 => rx!(1, [w[0]]),
                    2 => rx!(2, [w[0], w[1]]),
                    3 => rx!(3, [w[0], w[1], w[2]]),
                    _ => rx!(4, [w[0], w[1], w[2], w[3]]),
                }
            }
        }
    }};
}

fn rows_q8_0(w: &[&[u8]], x: &[&[u8]], out: &mut [f32]) {
    tile32::<T_Q8_0>(w, x, out)
}
fn rows_q4_0(w: &[&[u8]], x: &[&[u8]], out: &mut [f32]) {
    tile32::<T_Q4_0>(w, x, out)
}
fn rows_q5_0(w: &[&[u8]], x: &[&[u8]], out: &mut [f32]) {
    tile32::<T_Q5_0>(w, x, out)
}
fn rows_q4_1(w: &[&[u8]], x: &[&[u8]], out: &mut [f32]) {
    tile32::<T_Q4_1>(w, x, out)
}
fn rows_q4_k(w: &[&[u8]], x: &[&[u8]], out: &mut [f32]) {
    let nx = x.len();
    for (c, wc) in w.chunks(4).enumerate() {
        by_tile!(
            tile_q4_k_avx2,
            wc,
            x,
            &mut out[c * 4 * nx..(c * 4 + wc.len()) * nx]
        )
    }
}
fn rows_q6_k(w: &[&[u8]], x: &[&[u8]], out: &mut [f32]) {
    let nx = x.len();
    for (c, wc) in w.chunks(4).enumerate() {
        by_tile!(
            tile_q6_k_avx2,
            wc,
            x,
            &mut out[c * 4 * nx..(c * 4 + wc.len()) * nx]
        )
    }
}

/// Blocks in a tile: the fewest whole blocks any of its rows holds (rows of one product all
/// hold the same number).
fn tile_blocks(w: &[&[u8]], wbs: usize, x: &[&[u8]], xbs: usize) -> usize {
    let nw = w.iter().map(|r| r.len() / wbs).min().unwrap_or(0);
    let nx = x.iter().map(|r| r.len() / xbs).min().unwrap_or(0);
    nw.min(nx)
}

/// The f16 at `b[at..at + 2]` as f32 with one F16C conversion (same value as `f16_at`).
#[inline(always)]
unsafe fn f16c(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// 32 bytes at `p` (unaligned).
#[inline(always)]
unsafe fn ld32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes at `p`.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// A tile of 32-value-block products, padded to one of the two 8-pair layouts the kernel has:
/// 8 weight rows x 1 activation row (decode) or 2 x 4 (prefill); padding repeats the last row
/// and its results are dropped.
fn tile32<const T: u8>(w: &[&[u8]], x: &[&[u8]], out: &mut [f32]) {
    let (nw, nx) = (w.len(), x.len());
    if nw == 0 || nx == 0 {
        return;
    }
    let mut res = [0f32; 8];
    // SAFETY (both calls): only handed out by `rows::rows_fn` after `has_avx2()` confirmed AVX2,
    // FMA and F16C; the kernel checks the row lengths it reads.
    if nx == 1 {
        for (c, wc) in w.chunks(8).enumerate() {
            let ws: [&[u8]; 8] = std::array::from_fn(|i| wc[i.min(wc.len() - 1)]);
            unsafe { tile32_pairs8::<T, 8, 1>(ws, [x[0]], &mut res) };
            out[c * 8..c * 8 + wc.len()].copy_from_slice(&res[..wc.len()]);
        }
        return;
    }
    for (c, wc) in w.chunks(2).enumerate() {
        let ws: [&[u8]; 2] = std::array::from_fn(|i| wc[i.min(wc.len() - 1)]);
        for (xc_i, xc) in x.chunks(4).enumerate() {
            let xs: [&[u8]; 4] = std::array::from_fn(|r| xc[r.min(xc.len() - 1)]);
            unsafe { tile32_pairs8::<T, 2, 4>(ws, xs, &mut res) };
            for (i, _) in wc.iter().enumerate() {
                for (r, _) in xc.iter().enumerate() {
                    out[(c * 2 + i) * nx + xc_i * 4 + r] = res[i * 4 + r];
                }
            }
        }
    }
}

/// Sums the eight i32 lanes of each of the eight vectors: lane `p` of the result is the total
/// of `v[p]` (exact integer arithmetic, any order).
#[inline(always)]
unsafe fn sum_lanes8(v: &[__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    let q0 = _mm256_hadd_epi32(h01, h23);
    let q1 = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256(q0, q1, 0x20),
        _mm256_permute2x128_si256(q0, q1, 0x31),
    )
}

/// Sets 16-bit lane `i` (0..8) of `v` to `bits`.
#[inline(always)]
unsafe fn insert_u16(v: __m128i, i: usize, bits: i32) -> __m128i {
    match i {
        0 => _mm_insert_epi16(v, bits, 0),
        1 => _mm_insert_epi16(v, bits, 1),
        2 => _mm_insert_epi16(v, bits, 2),
        3 => _mm_insert_epi16(v, bits, 3),
        4 => _mm_insert_epi16(v, bits, 4),
        5 => _mm_insert_epi16(v, bits, 5),
        6 => _mm_insert_epi16(v, bits, 6),
        _ => _mm_insert_epi16(v, bits, 7),
    }
}

/// The eight products `a[p / RX] * b[p % RX]` of a pair layout (`RW * RX = 8`; `a` holds the RW
/// weight-side values, `b`'s low lanes the RX activation-side ones), each one f32 multiply.
#[inline(always)]
unsafe fn pair_products<const RW: usize, const RX: usize>(a: __m256, b: __m128) -> __m256 {
    if RX == 1 {
        // 8 x 1: weight row p times the one activation row.
        _mm256_mul_ps(a, _mm256_set1_ps(_mm_cvtss_f32(b)))
    } else {
        // 2 x 4: [a0 * b0..b3, a1 * b0..b3].
        let a0 = _mm_set1_ps(_mm256_cvtss_f32(a));
        let a1 = _mm_shuffle_ps(
            _mm256_castps256_ps128(a),
            _mm256_castps256_ps128(a),
            0b01_01_01_01,
        );
        _mm256_mul_ps(_mm256_set_m128(a1, a0), _mm256_set_m128(b, b))
    }
}

/// 32-value blocks (`T`: Q8_0, Q4_0, Q5_0 with Q8_0 activations; Q4_1 with Q8_1), eight
/// (weight row, activation row) pairs at once, pair `p` = (`p / RX`, `p % RX`), `RW * RX = 8`:
/// per block each weight row is unpacked once and each activation row loaded once; each pair's
/// exact integer block total (sign trick + maddubs + madd, then one horizontal reduction for all
/// eight pairs) is FMA'd with `d_w · d_x` into lane `p` of one f32 accumulator; Q4_1 adds
/// `m_w · s_x` per block into a second one. The scalar twin is `rows::row_scalar`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile32_pairs8<const T: u8, const RW: usize, const RX: usize>(
    w: [&[u8]; RW],
    x: [&[u8]; RX],
    out: &mut [f32; 8],
) {
    let (wbs, xbs) = match T {
        T_Q8_0 => (34, 34),
        T_Q4_0 => (18, 34),
        T_Q5_0 => (22, 34),
        _ => (20, 36),
    };
    let nb = tile_blocks(&w, wbs, &x, xbs);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    let mut extra = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY (all pointer reads below): b < nb, so block b of every row lies inside its
        // slice (`tile_blocks`), and each read stays inside its block.
        // Activation blocks: quants, and the f16 scales (Q4_1: and sums) gathered into one
        // register for a single conversion.
        let mut xq = [_mm256_setzero_si256(); RX];
        let mut dxh = _mm_setzero_si128();
        let mut sxh = _mm_setzero_si128();
        for r in 0..RX {
            let xb = unsafe { x[r].as_ptr().add(b * xbs) };
            xq[r] = unsafe { ld32(xb.add(xbs - 32)) };
            let (d16, s16) = unsafe {
                (
                    (xb as *const u16).read_unaligned() as i32,
                    (xb.add(2) as *const u16).read_unaligned() as i32,
                )
            };
            dxh = insert_u16(dxh, r, d16);
            if T == T_Q4_1 {
                sxh = insert_u16(sxh, r, s16);
            }
        }
        let dx = _mm_cvtph_ps(dxh);
        let sx = _mm_cvtph_ps(sxh);
        let mut lanes = [_mm256_setzero_si256(); 8];
        let mut dwh = _mm_setzero_si128();
        let mut mwh = _mm_setzero_si128();
        for i in 0..RW {
            let wb = unsafe { w[i].as_ptr().add(b * wbs) };
            let (d16, m16) = unsafe {
                (
                    (wb as *const u16).read_unaligned() as i32,
                    (wb.add(2) as *const u16).read_unaligned() as i32,
                )
            };
            dwh = insert_u16(dwh, i, d16);
            if T == T_Q4_1 {
                mwh = insert_u16(mwh, i, m16);
            }
            let qw = match T {
                T_Q8_0 => unsafe { ld32(wb.add(2)) },
                T_Q4_0 => {
                    let t = unsafe { _mm_loadu_si128(wb.add(2) as *const __m128i) };
                    let n = _mm256_and_si256(
                        _mm256_set_m128i(_mm_srli_epi16(t, 4), t),
                        _mm256_set1_epi8(0x0F),
                    );
                    _mm256_sub_epi8(n, _mm256_set1_epi8(8))
                }
                T_Q5_0 => {
                    let qh = unsafe { (wb.add(2) as *const u32).read_unaligned() };
                    let t = unsafe { _mm_loadu_si128(wb.add(6) as *const __m128i) };
                    let n = _mm256_and_si256(
                        _mm256_set_m128i(_mm_srli_epi16(t, 4), t),
                        _mm256_set1_epi8(0x0F),
                    );
                    let hi =
                        _mm256_andnot_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0xF0u8 as i8));
                    _mm256_or_si256(n, hi)
                }
                _ => {
                    let t = unsafe { _mm_loadu_si128(wb.add(4) as *const __m128i) };
                    _mm256_and_si256(
                        _mm256_set_m128i(_mm_srli_epi16(t, 4), t),
                        _mm256_set1_epi8(0x0F),
                    )
                }
            };
            // maddubs needs an unsigned operand: |w| with w's sign moved onto x (Q4_1's quants
            // are unsigned already). No pair sum saturates: |w| <= 128, |x| <= 127.
            let aw = if T == T_Q4_1 {
                qw
            } else {
                _mm256_sign_epi8(qw, qw)
            };
            for r in 0..RX {
                let y = if T == T_Q4_1 {
                    xq[r]
                } else {
                    _mm256_sign_epi8(xq[r], qw)
                };
                lanes[i * RX + r] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, y), ones);
            }
        }
        let sums = _mm256_cvtepi32_ps(sum_lanes8(&lanes));
        // Pair p's scale d_w[p / RX] * d_x[p % RX] (and Q4_1's m_w * s_x) as one vector.
        let dw = _mm256_cvtph_ps(dwh);
        let d = pair_products::<RW, RX>(dw, dx);
        acc = _mm256_fmadd_ps(d, sums, acc);
        if T == T_Q4_1 {
            let mw = _mm256_cvtph_ps(mwh);
            extra = _mm256_add_ps(extra, pair_products::<RW, RX>(mw, sx));
        }
    }
    // SAFETY: `out` is 8 writable f32.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, extra)) };
}

/// Q4_K x Q8_K tiles: each weight row's scales and unpacked 64-value sub-blocks are shared by
/// the activation rows; each pair's block total is an exact integer, FMA'd once per block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q4_k_avx2<const RW: usize, const RX: usize>(
    w: [&[u8]; RW],
    x: [&[u8]; RX],
    out: &mut [f32],
) {
    let m4 = _mm256_set1_epi8(0x0F);
    let nb = tile_blocks(&w, 144, &x, 292);
    let mut acc = [[0f32; RX]; RW];
    let mut acc_m = [[0f32; RX]; RW];
    for b in 0..nb {
        for i in 0..RW {
            let wb = &w[i][b * 144..(b + 1) * 144];
            let mut sc = [0i16; 8];
            let mut mn = [0i16; 8];
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, &wb[4..16]);
                sc[j] = s as i16;
                mn[j] = m as i16;
            }
            // SAFETY: `mn` is 8 i16 = 16 readable bytes.
            let mins = unsafe { _mm_loadu_si128(mn.as_ptr() as *const __m128i) };
            let mut sumi = [_mm256_setzero_si256(); RX];
            for j in 0..4 {
                let q4 = load32(wb, 16 + 32 * j);
                let q4l = _mm256_and_si256(q4, m4);
                let q4h = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
                let (s1, s2) = (
                    _mm256_set1_epi16(sc[2 * j]),
                    _mm256_set1_epi16(sc[2 * j + 1]),
                );
                for r in 0..RX {
                    // SAFETY: b < nb: block b of row r is inside it (`tile_blocks`), and
                    // 4 + 64 * j + 64 <= 292.
                    let xq = unsafe { x[r].as_ptr().add(b * 292 + 4 + 64 * j) };
                    let pl = _mm256_maddubs_epi16(q4l, unsafe { ld32(xq) });
                    let ph = _mm256_maddubs_epi16(q4h, unsafe { ld32(xq.add(32)) });
                    let p = _mm256_add_epi32(_mm256_madd_epi16(s1, pl), _mm256_madd_epi16(s2, ph));
                    sumi[r] = _mm256_add_epi32(sumi[r], p);
                }
            }
            let (dw, dminw) = (f16c(wb, 0), f16c(wb, 2));
            for r in 0..RX {
                let xb = &x[r][b * 292..(b + 1) * 292];
                let (yd, bsums) = q8k_d_bsums(xb);
                let pairs = _mm_hadd_epi16(
                    _mm256_castsi256_si128(bsums),
                    _mm256_extracti128_si256(bsums, 1),
                );
                let pm = _mm_madd_epi16(mins, pairs);
                let pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0b01_00_11_10));
                let pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0b10_11_00_01));
                let summs = _mm_cvtsi128_si32(pm);
                acc[i][r] = (hsum_i32(sumi[r]) as f32).mul_add(dw * yd, acc[i][r]);
                acc_m[i][r] = (summs as f32).mul_add(dminw * yd, acc_m[i][r]);
            }
        }
    }
    for i in 0..RW {
        for r in 0..RX {
            out[i * RX + r] = acc[i][r] - acc_m[i][r];
        }
    }
}

/// Q6_K x Q8_K tiles: each weight row's 6-bit quants are unpacked once per half-block for the
/// activation rows; each pair's block total is an exact integer (the -32 offset through the
/// activation block sums), times the weight scale, FMA'd with the activation scale per block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q6_k_avx2<const RW: usize, const RX: usize>(
    w: [&[u8]; RW],
    x: [&[u8]; RX],
    out: &mut [f32],
) {
    let nb = tile_blocks(&w, 210, &x, 292);
    let mut acc = [[0f32; RX]; RW];
    for b in 0..nb {
        for i in 0..RW {
            let wb = &w[i][b * 210..(b + 1) * 210];
            let sc = &wb[192..208];
            // SAFETY: `sc` is 16 readable bytes.
            let scales = unsafe { _mm_loadu_si128(sc.as_ptr() as *const __m128i) };
            let scales16 = _mm256_cvtepi8_epi16(scales);
            let mut sumi = [_mm256_setzero_si256(); RX];
            for n in 0..2 {
                let q = q6_k_quants(wb, n);
                for (t, &qt) in q.iter().enumerate() {
                    let g = 8 * n + 2 * t;
                    let s = _mm256_set_m128i(
                        _mm_set1_epi16(sc[g + 1] as i8 as i16),
                        _mm_set1_epi16(sc[g] as i8 as i16),
                    );
                    for r in 0..RX {
                        // SAFETY: b < nb: block b of row r is inside it (`tile_blocks`), and
                        // 4 + 128 * n + 32 * t + 32 <= 292.
                        let xq = unsafe { ld32(x[r].as_ptr().add(b * 292 + 4 + 128 * n + 32 * t)) };
                        // Unsigned quants (0..63) times q8: |pair sums| <= 2*63*128, no saturation.
                        let p = _mm256_maddubs_epi16(qt, xq);
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s, p));
                    }
                }
            }
            let dw = f16c(wb, 208);
            for r in 0..RX {
                let xb = &x[r][b * 292..(b + 1) * 292];
                let (yd, bsums) = q8k_d_bsums(xb);
                let offset = _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 5);
                let isum = hsum_i32(_mm256_sub_epi32(sumi[r], offset));
                acc[i][r] = (dw * isum as f32).mul_add(yd, acc[i][r]);
            }
        }
    }
    for i in 0..RW {
        for r in 0..RX {
            out[i * RX + r] = acc[i][r];
        }
    }
}

/// Asks the CPU to bring `bytes` into the caches (one prefetch per 64-byte line): the fast path's
/// decode tiles read four weight rows side by side, short streams the hardware prefetcher does
/// not follow, so the next tile is requested while this one is computed.
pub(crate) fn prefetch(bytes: &[u8]) {
    let mut off = 0;
    while off < bytes.len() {
        // SAFETY: prefetching is a hint that never faults; the address is inside `bytes`.
        unsafe { _mm_prefetch(bytes.as_ptr().add(off) as *const i8, _MM_HINT_T0) };
        off += 64;
    }
}

/// `quantize::quantize_activations` compiled for AVX2 (twin: the same body compiled without).
pub(crate) fn quantize_activations(
    vec_ty: GgmlType,
    x: &[f32],
    out: &mut [u8],
) -> crate::Result<()> {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { quantize_activations_avx2(vec_ty, x, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_activations_avx2(
    vec_ty: GgmlType,
    x: &[f32],
    out: &mut [u8],
) -> crate::Result<()> {
    crate::quantize::quantize_activations_body(vec_ty, x, out)
}

/// `dequant::dequantize_row` compiled for AVX2 (twin: the same body compiled without).
pub(crate) fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> crate::Result<()> {
    // SAFETY: only reachable when `has_avx2()` confirmed AVX2, FMA and F16C.
    unsafe { dequantize_row_avx2(ty, bytes, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_row_avx2(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> crate::Result<()> {
    type BlockFn = unsafe fn(&[u8], &mut [f32]);
    let f: BlockFn = match ty {
        GgmlType::Q8_0 => dq_q8_0,
        GgmlType::Q4_0 => dq_q4_0,
        GgmlType::Q5_0 => dq_q5_0,
        GgmlType::Q4_1 => dq_q4_1,
        GgmlType::Q4_K => dq_q4_k,
        GgmlType::Q6_K => dq_q6_k,
        // The other types: the scalar body, compiled with AVX2 here.
        _ => return crate::dequant::dequantize_body(ty, bytes, out),
    };
    let need = crate::row_bytes(ty, out.len())?;
    if bytes.len() != need {
        crate::bail!(
            "{ty}: {} elements need {need} bytes, got {}",
            out.len(),
            bytes.len()
        );
    }
    for (blk, o) in bytes
        .chunks_exact(ty.type_size())
        .zip(out.chunks_exact_mut(ty.block_size()))
    {
        // SAFETY: AVX2/F16C are enabled here; `blk` is one whole block and `o` its values.
        unsafe { f(blk, o) };
    }
    Ok(())
}

/// `out[0..16] = f(v[i] as f32)` for the 16 signed bytes of `v`, eight lanes at a time.
#[inline(always)]
unsafe fn put16(out: &mut [f32], v: __m128i, f: impl Fn(__m256) -> __m256) {
    assert!(out.len() >= 16);
    let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
    // SAFETY: 16 floats fit in `out` (asserted).
    unsafe {
        _mm256_storeu_ps(out.as_mut_ptr(), f(lo));
        _mm256_storeu_ps(out.as_mut_ptr().add(8), f(hi));
    }
}

/// `out[0..16] = (v[i] as f32) * s` (one rounding, like the twins' `x as f32 * d`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn put16_mul(out: &mut [f32], v: __m128i, s: __m256) {
    // SAFETY: AVX2 is enabled here.
    unsafe { put16(out, v, |q| _mm256_mul_ps(q, s)) }
}

/// `out[0..16] = (v[i] as f32) * d + m` (Q4_1: a product then a sum, never fused, like the twin).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn put16_mul_add(out: &mut [f32], v: __m128i, d: __m256, m: __m256) {
    // SAFETY: AVX2 is enabled here.
    unsafe { put16(out, v, |q| _mm256_add_ps(_mm256_mul_ps(q, d), m)) }
}

/// `out[0..16] = d * (v[i] as f32) - m` (Q4_K: a product then a difference, like the twin).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn put16_mul_sub(out: &mut [f32], v: __m128i, d: __m256, m: __m256) {
    // SAFETY: AVX2 is enabled here.
    unsafe { put16(out, v, |q| _mm256_sub_ps(_mm256_mul_ps(d, q), m)) }
}

/// Low and high nibbles of 16 bytes, as two vectors of 16 bytes (0..15 each).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_halves(q: __m128i) -> (__m128i, __m128i) {
    let m4 = _mm_set1_epi8(0x0F);
    (
        _mm_and_si128(q, m4),
        _mm_and_si128(_mm_srli_epi16(q, 4), m4),
    )
}

// Block dequantizers: the same f32 operations as `dequant.rs`'s twins, eight values per vector.

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dq_q8_0(b: &[u8], y: &mut [f32]) {
    let d = _mm256_set1_ps(f16c(b, 0));
    for h in 0..2 {
        // SAFETY: a Q8_0 block is 34 bytes: quants at 2..34.
        unsafe { put16_mul(&mut y[16 * h..], load16(b, 2 + 16 * h), d) };
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dq_q4_0(b: &[u8], y: &mut [f32]) {
    let d = _mm256_set1_ps(f16c(b, 0));
    // SAFETY: a Q4_0 block is 18 bytes: quants at 2..18.
    let (lo, hi) = unsafe { nibble_halves(load16(b, 2)) };
    let eight = _mm_set1_epi8(8);
    // SAFETY: 32 values in `y`.
    unsafe {
        put16_mul(&mut y[..16], _mm_sub_epi8(lo, eight), d);
        put16_mul(&mut y[16..], _mm_sub_epi8(hi, eight), d);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dq_q5_0(b: &[u8], y: &mut [f32]) {
    let d = _mm256_set1_ps(f16c(b, 0));
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    // Byte j of the 32: 0x10 when bit j of qh is set.
    let high = _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
    // SAFETY: a Q5_0 block is 22 bytes: quants at 6..22.
    let (lo, hi) = unsafe { nibble_halves(load16(b, 6)) };
    let sixteen = _mm_set1_epi8(16);
    let v0 = _mm_sub_epi8(_mm_or_si128(lo, _mm256_castsi256_si128(high)), sixteen);
    let v1 = _mm_sub_epi8(_mm_or_si128(hi, _mm256_extracti128_si256(high, 1)), sixteen);
    // SAFETY: 32 values in `y`.
    unsafe {
        put16_mul(&mut y[..16], v0, d);
        put16_mul(&mut y[16..], v1, d);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dq_q4_1(b: &[u8], y: &mut [f32]) {
    let d = _mm256_set1_ps(f16c(b, 0));
    let m = _mm256_set1_ps(f16c(b, 2));
    // SAFETY: a Q4_1 block is 20 bytes: quants at 4..20.
    let (lo, hi) = unsafe { nibble_halves(load16(b, 4)) };
    // SAFETY: 32 values in `y`.
    unsafe {
        put16_mul_add(&mut y[..16], lo, d, m);
        put16_mul_add(&mut y[16..], hi, d, m);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dq_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16c(b, 0);
    let min = f16c(b, 2);
    let sc = &b[4..16];
    for j in 0..QK_K / 64 {
        let (s1, m1) = scale_min_k4(2 * j, sc);
        let (s2, m2) = scale_min_k4(2 * j + 1, sc);
        let (d1, m1) = (
            _mm256_set1_ps(d * s1 as f32),
            _mm256_set1_ps(min * m1 as f32),
        );
        let (d2, m2) = (
            _mm256_set1_ps(d * s2 as f32),
            _mm256_set1_ps(min * m2 as f32),
        );
        for h in 0..2 {
            // SAFETY: a Q4_K block is 144 bytes: quants at 16..144.
            let (lo, hi) = unsafe { nibble_halves(load16(b, 16 + 32 * j + 16 * h)) };
            // SAFETY: 256 values in `y`.
            unsafe {
                put16_mul_sub(&mut y[64 * j + 16 * h..], lo, d1, m1);
                put16_mul_sub(&mut y[64 * j + 32 + 16 * h..], hi, d2, m2);
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dq_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16c(b, 208);
    let (m4, m3, off) = (_mm_set1_epi8(0x0F), _mm_set1_epi8(3), _mm_set1_epi8(32));
    for n in 0..2 {
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        for h in 0..2 {
            // Values l = 16h .. 16h + 16 of the four 32-value groups of this half.
            // SAFETY: a Q6_K block is 210 bytes: ql at 0..128, qh at 128..192.
            let (qa, qb, qh) = unsafe {
                (
                    load16(b, 64 * n + 16 * h),
                    load16(b, 64 * n + 32 + 16 * h),
                    load16(b, 128 + 32 * n + 16 * h),
                )
            };
            let hb = |shift: i32| -> __m128i {
                // ((qh >> shift) & 3) << 4, per byte (16-bit shifts, then masks).
                let v = match shift {
                    0 => qh,
                    2 => _mm_srli_epi16(qh, 2),
                    4 => _mm_srli_epi16(qh, 4),
                    _ => _mm_srli_epi16(qh, 6),
                };
                _mm_slli_epi16(_mm_and_si128(v, m3), 4)
            };
            let q = [
                _mm_or_si128(_mm_and_si128(qa, m4), hb(0)),
                _mm_or_si128(_mm_and_si128(qb, m4), hb(2)),
                _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qa, 4), m4), hb(4)),
                _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qb, 4), m4), hb(6)),
            ];
            for (t, &qt) in q.iter().enumerate() {
                let s = _mm256_set1_ps(d * sc[h + 2 * t] as i8 as f32);
                // SAFETY: 256 values in `y`.
                unsafe {
                    put16_mul(
                        &mut y[128 * n + 32 * t + 16 * h..],
                        _mm_sub_epi8(qt, off),
                        s,
                    )
                };
            }
        }
    }
}

/// The f32 GEMM micro-kernel (`gemm::MicroFn`; twin `gemm::micro_scalar`): up to 6 weight rows
/// x 16 packed activation rows, two 8-lane accumulators per weight row, one FMA chain per output
/// in `kk` order like the twin.
pub(crate) fn gemm_micro(
    w: &[f32],
    ldw: usize,
    rows: usize,
    xp: &[f32],
    k: usize,
    out: &mut [f32; MR * NR],
) {
    assert!(rows <= MR && xp.len() >= k * NR && (rows == 0 || w.len() >= (rows - 1) * ldw + k));
    // SAFETY: `has_avx2()` confirmed AVX2+FMA before this kernel was chosen (`gemm::kernels`);
    // the assert above keeps every read inside `w` and `xp`.
    unsafe {
        match rows {
            1 => gemm_micro_avx2::<1>(w, ldw, xp, k, out),
            2 => gemm_micro_avx2::<2>(w, ldw, xp, k, out),
            3 => gemm_micro_avx2::<3>(w, ldw, xp, k, out),
            4 => gemm_micro_avx2::<4>(w, ldw, xp, k, out),
            5 => gemm_micro_avx2::<5>(w, ldw, xp, k, out),
            6 => gemm_micro_avx2::<6>(w, ldw, xp, k, out),
            _ => {}
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_micro_avx2<const R: usize>(
    w: &[f32],
    ldw: usize,
    xp: &[f32],
    k: usize,
    out: &mut [f32; MR * NR],
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let (wp, xpp) = (w.as_ptr(), xp.as_ptr());
    for kk in 0..k {
        // SAFETY: kk < k: xp[kk * NR .. kk * NR + 16] and w[r * ldw + kk] (r < R) are inside the
        // slices (checked by `gemm_micro`).
        unsafe {
            let x0 = _mm256_loadu_ps(xpp.add(kk * NR));
            let x1 = _mm256_loadu_ps(xpp.add(kk * NR + 8));
            for r in 0..R {
                let wv = _mm256_broadcast_ss(&*wp.add(r * ldw + kk));
                acc[r][0] = _mm256_fmadd_ps(wv, x0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(wv, x1, acc[r][1]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: r < R <= MR: 16 floats at r * NR lie inside `out`.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * NR), acc[r][0]);
            _mm256_storeu_ps(out.as_mut_ptr().add(r * NR + 8), acc[r][1]);
        }
    }
}
