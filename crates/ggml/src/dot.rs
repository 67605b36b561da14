//! Dot products of one weight row (GGML blocks) with one quantized activation row, with
//! integer arithmetic inside each block like ggml's CPU `ggml_vec_dot_*_q8_*`. The scalar
//! kernels here are the reference the SIMD kernels (`x86.rs`) are tested against.

use crate::dequant::{q3_k_scales, scale_min_k4, KVALUES_IQ4NL};
use crate::{bail, f16_at, row_bytes, GgmlType, Result, QK_K};

/// A dot kernel: `(weight blocks, activation blocks) -> sum`. Both slices hold the same number
/// of blocks (validated by the caller); a kernel only ever indexes inside them.
pub(crate) type DotFn = fn(&[u8], &[u8]) -> f32;

/// The type activations are quantized to for `ty`'s integer dot product (ggml's
/// `vec_dot_type`), or `None` when `ty` has no such kernel here (use the exact path).
pub fn vec_dot_type(ty: GgmlType) -> Option<GgmlType> {
    use GgmlType::*;
    Some(match ty {
        F32 => F32,
        F16 => F16,
        BF16 => BF16,
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Q8_K,
        _ => return None,
    })
}

/// The scalar kernel for `ty`.
pub(crate) fn scalar_fn(ty: GgmlType) -> Option<DotFn> {
    use GgmlType::*;
    Some(match ty {
        F32 => dot_f32,
        F16 => dot_f16,
        BF16 => dot_bf16,
        Q4_0 => q4_0_q8_0,
        Q4_1 => q4_1_q8_1,
        Q5_0 => q5_0_q8_0,
        Q5_1 => q5_1_q8_1,
        Q8_0 => q8_0_q8_0,
        IQ4_NL => iq4_nl_q8_0,
        Q2_K => q2_k_q8_k,
        Q3_K => q3_k_q8_k,
        Q4_K => q4_k_q8_k,
        Q5_K => q5_k_q8_k,
        Q6_K => q6_k_q8_k,
        _ => return None,
    })
}

/// Whether `ty` has a SIMD one-row kernel on this CPU.
pub(crate) fn has_simd_dot(ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        return crate::x86::avx2_fn(ty).is_some();
    }
    let _ = ty;
    false
}

/// The fastest kernel for `ty` on this CPU. The AVX-512 ones equal the AVX2 ones bit for bit
/// (exact integer block totals, the same f32 steps), so parity precision may take them too.
pub(crate) fn best_fn(ty: GgmlType) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx512() && ty == GgmlType::Q4_K {
        return Some(crate::x86_512::q4_k_q8_k);
    }
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        if let Some(f) = crate::x86::avx2_fn(ty) {
            return Some(f);
        }
    }
    scalar_fn(ty)
}

fn check(ty: GgmlType, w: &[u8], xq: &[u8], k: usize) -> Result<GgmlType> {
    let Some(vt) = vec_dot_type(ty) else {
        bail!("no integer dot product for ggml type {ty}");
    };
    let wb = row_bytes(ty, k)?;
    let xb = row_bytes(vt, k)?;
    if w.len() != wb || xq.len() != xb {
        bail!(
            "{ty} dot of length {k}: weight row must be {wb} bytes (got {}), {vt} activations {xb} bytes (got {})",
            w.len(),
            xq.len()
        );
    }
    Ok(vt)
}

/// Dot product of the weight row `w` (`k` elements of `ty`) with the activation row `xq`
/// (`k` elements of [`vec_dot_type`]`(ty)`), using the fastest kernel for this CPU.
pub fn vec_dot(ty: GgmlType, w: &[u8], xq: &[u8], k: usize) -> Result<f32> {
    check(ty, w, xq, k)?;
    match best_fn(ty) {
        Some(f) => Ok(f(w, xq)),
        None => bail!("no integer dot product for ggml type {ty}"),
    }
}

/// [`vec_dot`] with the portable scalar kernel (the reference for the SIMD ones).
pub fn vec_dot_scalar(ty: GgmlType, w: &[u8], xq: &[u8], k: usize) -> Result<f32> {
    check(ty, w, xq, k)?;
    match scalar_fn(ty) {
        Some(f) => Ok(f(w, xq)),
        None => bail!("no integer dot product for ggml type {ty}"),
    }
}

fn dot_f32(w: &[u8], x: &[u8]) -> f32 {
    // Eight partial sums, like a SIMD register, so the loop vectorizes.
    let mut acc = [0f32; 8];
    let wc = w.chunks_exact(32);
    let xc = x.chunks_exact(32);
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for l in 0..8 {
            let i = 4 * l;
            acc[l] += f32::from_le_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]])
                * f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        }
    }
    let mut s = hsum8(&acc);
    for (a, b) in wr.chunks_exact(4).zip(xr.chunks_exact(4)) {
        s += f32::from_le_bytes([a[0], a[1], a[2], a[3]])
            * f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    s
}

fn dot_f16(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    let wc = w.chunks_exact(16);
    let xc = x.chunks_exact(16);
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for l in 0..8 {
            acc[l] += f16_at(a, 2 * l) * f16_at(b, 2 * l);
        }
    }
    let mut s = hsum8(&acc);
    for i in (0..wr.len()).step_by(2) {
        s += f16_at(wr, i) * f16_at(xr, i);
    }
    s
}

fn bf16_at(b: &[u8], i: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[i], b[i + 1]]) as u32) << 16)
}

fn dot_bf16(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    let wc = w.chunks_exact(16);
    let xc = x.chunks_exact(16);
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for l in 0..8 {
            acc[l] += bf16_at(a, 2 * l) * bf16_at(b, 2 * l);
        }
    }
    let mut s = hsum8(&acc);
    for i in (0..wr.len()).step_by(2) {
        s += bf16_at(wr, i) * bf16_at(xr, i);
    }
    s
}

/// Sum of 8 partial sums in the order the AVX2 horizontal sum uses.
#[inline(always)]
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Σ a[i]·b[i] of two i8 slices of equal length, in i32.
#[inline(always)]
fn idot(a: &[i8], b: &[u8]) -> i32 {
    a.iter()
        .zip(b)
        .map(|(&p, &q)| p as i32 * q as i8 as i32)
        .sum()
}

/// Unpacks a 32-element nibble block (`qs[16]`: low nibbles first, then high) minus `off`.
#[inline(always)]
fn nibbles(qs: &[u8], off: i8) -> [i8; 32] {
    let mut q = [0i8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0F) as i8 - off;
        q[j + 16] = (qs[j] >> 4) as i8 - off;
    }
    q
}

/// Unpacks 32 five-bit values (`qh` u32 of high bits, `qs[16]` nibbles) minus `off`.
#[inline(always)]
fn five_bits(qh: u32, qs: &[u8], off: i8) -> [i8; 32] {
    let mut q = [0i8; 32];
    for j in 0..16 {
        q[j] = ((qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4)) as i8 - off;
        q[j + 16] = ((qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4)) as i8 - off;
    }
    q
}

fn q4_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0f32;
    for (wb, xb) in w.chunks_exact(18).zip(x.chunks_exact(34)) {
        let sumi = idot(&nibbles(&wb[2..18], 8), &xb[2..34]);
        s += sumi as f32 * (f16_at(wb, 0) * f16_at(xb, 0));
    }
    s
}

fn iq4_nl_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0f32;
    for (wb, xb) in w.chunks_exact(18).zip(x.chunks_exact(34)) {
        let mut q = [0i8; 32];
        for j in 0..16 {
            q[j] = KVALUES_IQ4NL[(wb[2 + j] & 0x0F) as usize];
            q[j + 16] = KVALUES_IQ4NL[(wb[2 + j] >> 4) as usize];
        }
        s += idot(&q, &xb[2..34]) as f32 * (f16_at(wb, 0) * f16_at(xb, 0));
    }
    s
}

/// ggml's AVX2 `ggml_vec_dot_q4_1_q8_1`: eight lanes (each the exact integer sum of four
/// neighbouring products) FMA'd with `d dy` into eight f32 sums, reduced at the end; the min
/// terms `m · s` (Q8_1's `s = dy Σ qy`) FMA'd into a scalar sum added last.
fn q4_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    // Σ (d q + m) · dy qy = d dy Σ q qy + m · (dy Σ qy).
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (wb, xb) in w.chunks_exact(20).zip(x.chunks_exact(36)) {
        let q = nibbles(&wb[4..20], 0);
        let d = f16_at(wb, 0) * f16_at(xb, 0);
        summs = f16_at(wb, 2).mul_add(f16_at(xb, 2), summs);
        for (l, a) in acc.iter_mut().enumerate() {
            let lane = idot(&q[4 * l..4 * l + 4], &xb[4 + 4 * l..8 + 4 * l]);
            *a = d.mul_add(lane as f32, *a);
        }
    }
    hsum8(&acc) + summs
}

fn q5_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0f32;
    for (wb, xb) in w.chunks_exact(22).zip(x.chunks_exact(34)) {
        let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
        let sumi = idot(&five_bits(qh, &wb[6..22], 16), &xb[2..34]);
        s += sumi as f32 * (f16_at(wb, 0) * f16_at(xb, 0));
    }
    s
}

fn q5_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0f32;
    for (wb, xb) in w.chunks_exact(24).zip(x.chunks_exact(36)) {
        let qh = u32::from_le_bytes([wb[4], wb[5], wb[6], wb[7]]);
        let sumi = idot(&five_bits(qh, &wb[8..24], 0), &xb[4..36]);
        s += sumi as f32 * (f16_at(wb, 0) * f16_at(xb, 0)) + f16_at(wb, 2) * f16_at(xb, 2);
    }
    s
}

fn q8_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0f32;
    for (wb, xb) in w.chunks_exact(34).zip(x.chunks_exact(34)) {
        let sumi: i32 = wb[2..34]
            .iter()
            .zip(&xb[2..34])
            .map(|(&a, &b)| a as i8 as i32 * b as i8 as i32)
            .sum();
        s += sumi as f32 * (f16_at(wb, 0) * f16_at(xb, 0));
    }
    s
}

/// The parts of a Q8_K block: `(d, qs, bsums)`.
#[inline(always)]
fn q8k(xb: &[u8]) -> (f32, &[u8], [i32; 16]) {
    let d = f32::from_le_bytes([xb[0], xb[1], xb[2], xb[3]]);
    let mut bs = [0i32; 16];
    for (j, b) in bs.iter_mut().enumerate() {
        let at = 4 + QK_K + 2 * j;
        *b = i16::from_le_bytes([xb[at], xb[at + 1]]) as i32;
    }
    (d, &xb[4..4 + QK_K], bs)
}

fn q2_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0f32;
    for (wb, xb) in w.chunks_exact(84).zip(x.chunks_exact(292)) {
        let (yd, q8, bsums) = q8k(xb);
        let sc = &wb[0..16];
        // Unpack the 2-bit quants in element order: group g = 16 values.
        let mut q = [0i8; QK_K];
        for n in 0..2 {
            let qs = &wb[16 + 32 * n..48 + 32 * n];
            for shift in 0..4 {
                for l in 0..32 {
                    q[128 * n + 32 * shift + l] = ((qs[l] >> (2 * shift)) & 3) as i8;
                }
            }
        }
        let mut isum = 0i32;
        let mut summs = 0i32;
        for g in 0..16 {
            isum += (sc[g] & 0x0F) as i32 * idot(&q[16 * g..16 * g + 16], &q8[16 * g..16 * g + 16]);
            summs += (sc[g] >> 4) as i32 * bsums[g];
        }
        let dall = yd * f16_at(wb, 80);
        let dmin = yd * f16_at(wb, 82);
        s += dall * isum as f32 - dmin * summs as f32;
    }
    s
}

fn q3_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0f32;
    for (wb, xb) in w.chunks_exact(110).zip(x.chunks_exact(292)) {
        let (yd, q8, _) = q8k(xb);
        let hm = &wb[0..32];
        let scales = q3_k_scales(&wb[96..108]);
        let mut q = [0i8; QK_K];
        for n in 0..2 {
            let qs = &wb[32 + 32 * n..64 + 32 * n];
            for shift in 0..4 {
                let plane = 4 * n + shift;
                for l in 0..32 {
                    let lo = ((qs[l] >> (2 * shift)) & 3) as i8;
                    let hi = if hm[l] & (1 << plane) != 0 { 0 } else { 4 };
                    q[128 * n + 32 * shift + l] = lo - hi;
                }
            }
        }
        let mut isum = 0i32;
        for g in 0..16 {
            isum += scales[g] as i32 * idot(&q[16 * g..16 * g + 16], &q8[16 * g..16 * g + 16]);
        }
        s += (f16_at(wb, 108) * yd) * isum as f32;
    }
    s
}

/// Q4_K x Q8_K as llama.cpp computes it on AVX2 machines, where it repacks Q4_K weights
/// (tensors with a multiple of 8 rows, i.e. all real ones) into 8-row interleaved blocks: per
/// block the exact integer sums, then two f32 FMA chains (scales, mins) subtracted at the end.
/// [`q4_k_q8_k`] for the multi-row twins (`rows.rs`).
pub(crate) fn q4_k_q8_k_pub(w: &[u8], x: &[u8]) -> f32 {
    q4_k_q8_k(w, x)
}

/// [`q6_k_q8_k_tiled`] for the multi-row twins (`rows.rs`).
pub(crate) fn q6_k_q8_k_tiled_pub(w: &[u8], x: &[u8]) -> f32 {
    q6_k_q8_k_tiled(w, x)
}

fn q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for (wb, xb) in w.chunks_exact(144).zip(x.chunks_exact(292)) {
        let (yd, q8, bsums) = q8k(xb);
        let sc = &wb[4..16];
        let mut isum = 0i32;
        let mut summs = 0i32;
        for j in 0..4 {
            let qs = &wb[16 + 32 * j..48 + 32 * j];
            let mut lo = [0i8; 32];
            let mut hi = [0i8; 32];
            for l in 0..32 {
                lo[l] = (qs[l] & 0x0F) as i8;
                hi[l] = (qs[l] >> 4) as i8;
            }
            let (s1, m1) = scale_min_k4(2 * j, sc);
            let (s2, m2) = scale_min_k4(2 * j + 1, sc);
            isum += s1 as i32 * idot(&lo, &q8[64 * j..64 * j + 32]);
            isum += s2 as i32 * idot(&hi, &q8[64 * j + 32..64 * j + 64]);
            summs += m1 as i32 * (bsums[4 * j] + bsums[4 * j + 1]);
            summs += m2 as i32 * (bsums[4 * j + 2] + bsums[4 * j + 3]);
        }
        let d = f16_at(wb, 0) * yd;
        let dmin = f16_at(wb, 2) * yd;
        acc = (isum as f32).mul_add(d, acc);
        acc_m = (summs as f32).mul_add(dmin, acc_m);
    }
    acc - acc_m
}

/// [`q4_k_q8_k`] for activation rows that llama.cpp's repacked Q4_K kernel handles in groups of
/// four (the first `rows - rows % 4` rows of a batch): there the two FMA chains advance once per
/// 64-value sub-block instead of once per block.
fn q4_k_q8_k_grouped(w: &[u8], x: &[u8]) -> f32 {
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for (wb, xb) in w.chunks_exact(144).zip(x.chunks_exact(292)) {
        let (yd, q8, bsums) = q8k(xb);
        let sc = &wb[4..16];
        let d = f16_at(wb, 0) * yd;
        let dmin = f16_at(wb, 2) * yd;
        for j in 0..4 {
            let qs = &wb[16 + 32 * j..48 + 32 * j];
            let mut lo = [0i8; 32];
            let mut hi = [0i8; 32];
            for l in 0..32 {
                lo[l] = (qs[l] & 0x0F) as i8;
                hi[l] = (qs[l] >> 4) as i8;
            }
            let (s1, m1) = scale_min_k4(2 * j, sc);
            let (s2, m2) = scale_min_k4(2 * j + 1, sc);
            let isum = s1 as i32 * idot(&lo, &q8[64 * j..64 * j + 32])
                + s2 as i32 * idot(&hi, &q8[64 * j + 32..64 * j + 64]);
            let summs = m1 as i32 * (bsums[4 * j] + bsums[4 * j + 1])
                + m2 as i32 * (bsums[4 * j + 2] + bsums[4 * j + 3]);
            acc = (isum as f32).mul_add(d, acc);
            acc_m = (summs as f32).mul_add(dmin, acc_m);
        }
    }
    acc - acc_m
}

/// The kernel for activation rows inside 4-row groups of a batch, where it differs from the
/// single-row one ([`best_fn`] / [`scalar_fn`]); `None` when every row uses the same kernel.
/// The dot kernel llama.cpp uses for the real rows of a batch of `batch_rows` rows when that
/// differs from its single-row kernel, with how many leading rows it covers: the repacked Q4_K
/// kernel rounds rows inside 4-row groups per 64-value sub-block; Q6_K goes through the tiled
/// K-quant kernel (ggml-cpu/tiled) from 8 rows on.
pub(crate) fn batch_fn(ty: GgmlType, batch_rows: usize, scalar: bool) -> Option<(DotFn, usize)> {
    match ty {
        GgmlType::Q4_K => grouped_fn(ty, scalar).map(|f| (f, batch_rows - batch_rows % 4)),
        GgmlType::Q6_K if batch_rows >= 8 => Some((tiled_fn(scalar), batch_rows)),
        _ => None,
    }
}

fn tiled_fn(scalar: bool) -> DotFn {
    #[cfg(target_arch = "x86_64")]
    if !scalar && crate::has_avx2() {
        return crate::x86::q6_k_q8_k_tiled;
    }
    let _ = scalar;
    q6_k_q8_k_tiled
}

/// The 6-bit quant `e` (0..32) of quarter `t` (0..4) of a Q6_K half-block: low nibbles from
/// `b1`/`b2`, two high bits from `bh`.
#[inline(always)]
fn q6_k_code(b1: &[u8], b2: &[u8], bh: &[u8], t: usize, e: usize) -> u8 {
    match t {
        0 => (b1[e] & 0x0F) | ((bh[e] & 3) << 4),
        1 => (b2[e] & 0x0F) | (((bh[e] >> 2) & 3) << 4),
        2 => (b1[e] >> 4) | (((bh[e] >> 4) & 3) << 4),
        _ => (b2[e] >> 4) | (((bh[e] >> 6) & 3) << 4),
    }
}

/// Q6_K x Q8_K as llama.cpp's tiled batch kernel rounds it: per 256-value block the exact
/// integer dot product (sub-block scales applied in integers), times the weight block's scale
/// in f32, then FMA-accumulated with the activation block's scale, blocks in order.
fn q6_k_q8_k_tiled(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (wb, xb) in w.chunks_exact(210).zip(x.chunks_exact(292)) {
        let (yd, q8, _) = q8k(xb);
        let sc = &wb[192..208];
        let mut isum = 0i32;
        for n in 0..2 {
            let (b1, b2) = (&wb[64 * n..64 * n + 32], &wb[64 * n + 32..64 * n + 64]);
            let bh = &wb[128 + 32 * n..160 + 32 * n];
            for t in 0..4 {
                let g = 8 * n + 2 * t;
                let y = &q8[128 * n + 32 * t..128 * n + 32 * t + 32];
                for e in 0..32 {
                    let q = q6_k_code(b1, b2, bh, t, e);
                    let scale = sc[g + e / 16] as i8 as i32;
                    isum += scale * (q as i32 - 32) * y[e] as i8 as i32;
                }
            }
        }
        acc = (f16_at(wb, 208) * isum as f32).mul_add(yd, acc);
    }
    acc
}

fn grouped_fn(ty: GgmlType, scalar: bool) -> Option<DotFn> {
    if ty != GgmlType::Q4_K {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    if !scalar && crate::has_avx2() {
        return Some(crate::x86::q4_k_q8_k_grouped);
    }
    let _ = scalar;
    Some(q4_k_q8_k_grouped)
}

fn q5_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut s = 0f32;
    for (wb, xb) in w.chunks_exact(176).zip(x.chunks_exact(292)) {
        let (yd, q8, bsums) = q8k(xb);
        let sc = &wb[4..16];
        let qh = &wb[16..48];
        let mut isum = 0i32;
        let mut summs = 0i32;
        for j in 0..4 {
            let qs = &wb[48 + 32 * j..80 + 32 * j];
            let mut lo = [0i8; 32];
            let mut hi = [0i8; 32];
            for l in 0..32 {
                lo[l] = ((qs[l] & 0x0F) | (((qh[l] >> (2 * j)) & 1) << 4)) as i8;
                hi[l] = ((qs[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) as i8;
            }
            let (s1, m1) = scale_min_k4(2 * j, sc);
            let (s2, m2) = scale_min_k4(2 * j + 1, sc);
            isum += s1 as i32 * idot(&lo, &q8[64 * j..64 * j + 32]);
            isum += s2 as i32 * idot(&hi, &q8[64 * j + 32..64 * j + 64]);
            summs += m1 as i32 * (bsums[4 * j] + bsums[4 * j + 1]);
            summs += m2 as i32 * (bsums[4 * j + 2] + bsums[4 * j + 3]);
        }
        let d = f16_at(wb, 0) * yd;
        let dmin = f16_at(wb, 2) * yd;
        s += d * isum as f32 - dmin * summs as f32;
    }
    s
}

/// Q6_K x Q8_K with the integer lanes and float reduction of ggml's AVX2 kernel (which
/// llama.cpp runs): unsigned 6-bit quants times q8, scaled per 16 values, summed into 8 i32
/// lanes (lane = byte / 4 of each 32-byte chunk), minus `32 * scale * bsum` per lane pair of
/// 16-value groups, then one f32 FMA per lane and block and an 8-lane horizontal sum. The
/// integer total is the same in any order; matching the lanes makes the f32 rounding equal too.
fn q6_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (wb, xb) in w.chunks_exact(210).zip(x.chunks_exact(292)) {
        let (yd, q8, bsums) = q8k(xb);
        let sc = &wb[192..208];
        let mut lanes = [0i32; 8];
        for n in 0..2 {
            let (b1, b2) = (&wb[64 * n..64 * n + 32], &wb[64 * n + 32..64 * n + 64]);
            let bh = &wb[128 + 32 * n..160 + 32 * n];
            for t in 0..4 {
                let g = 8 * n + 2 * t;
                let y = &q8[128 * n + 32 * t..128 * n + 32 * t + 32];
                for e in 0..32 {
                    let q = q6_k_code(b1, b2, bh, t, e);
                    let scale = sc[g + e / 16] as i8 as i32;
                    lanes[e / 4] += scale * q as i32 * y[e] as i8 as i32;
                }
            }
        }
        let d = yd * f16_at(wb, 208);
        for (l, a) in acc.iter_mut().enumerate() {
            let sub = bsums[2 * l] * sc[2 * l] as i8 as i32
                + bsums[2 * l + 1] * sc[2 * l + 1] as i8 as i32;
            *a = d.mul_add((lanes[l] - 32 * sub) as f32, *a);
        }
    }
    hsum8(&acc)
}
