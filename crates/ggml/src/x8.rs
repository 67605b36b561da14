//! The interleaved weight layout ("x8") for the 32-value block types (Q8_0, Q4_0, Q4_1, Q5_0):
//! eight weight rows stored block by block, so a decode kernel reads one contiguous stream and
//! produces eight rows' dot products in the eight lanes of one register, with no horizontal
//! reduction and no per-row scale shuffling.
//!
//! Rows are taken in groups of [`X8_ROWS`]; group `g` holds, for each block `b` of the row, one
//! *group-block* of `8 × type_size` bytes (the same size as the eight plain blocks):
//!
//! | bytes | Q8_0 | Q4_0 | Q4_1 | Q5_0 |
//! |---|---|---|---|---|
//! | `0..16` | `d[8]` f16 | `d[8]` f16 | `d[8]` f16 | `d[8]` f16 |
//! | then | | | `m[8]` f16 (16) | `qh'[8]` u32 (32) |
//! | then | 8 chunks of 32 | 4 chunks of 32 | 4 chunks of 32 | 4 chunks of 32 |
//!
//! Chunk `c` holds bytes `4c .. 4c + 4` of every row's quants, row `r` at `4r`: the low nibbles
//! of a nibble chunk are elements `4c .. 4c + 4` and the high nibbles `16 + 4c ..` (ggml's order),
//! so each 4-byte lane meets the same four activations, one broadcast.
//!
//! Q5_0's fifth bits are regrouped per row (`qh'`): bit `j` of byte `i` is the fifth bit of
//! element `16·(j & 1) + 4·(j >> 1) + i`, i.e. of chunk `j >> 1`, half `j & 1`, lane byte `i`:
//! one shift and one mask put a chunk-half's bits at bit 4 of every byte.
//!
//! The layout is made once (when a model is loaded or compiled, [`repack_x8`]) and is what the
//! fast decode kernels read; [`unpack_row_x8`] gives a row back in plain blocks (prefill's
//! dequantizing GEMM, tests).

use crate::{bail, f16_at, GgmlType, Result};

/// Rows interleaved per group.
pub const X8_ROWS: usize = 8;

/// Activation rows one kernel call multiplies (each with its own accumulators).
pub(crate) const X8_MAX_RX: usize = 4;

/// Whether `ty` has the interleaved layout and its kernels.
pub fn supports_x8(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0
    )
}

/// `(header bytes per plain block, quant bytes per plain block)`.
fn parts(ty: GgmlType) -> (usize, usize) {
    match ty {
        GgmlType::Q8_0 => (2, 32),
        GgmlType::Q4_0 => (2, 16),
        GgmlType::Q4_1 => (4, 16),
        _ => (6, 16), // Q5_0
    }
}

/// Offset of the quant chunks inside a group-block.
pub(crate) fn quant_offset(ty: GgmlType) -> usize {
    parts(ty).0 * X8_ROWS
}

/// Bit `j` of byte `i` of Q5_0's regrouped high bits: the element whose fifth bit it holds.
fn q5_element(i: usize, j: usize) -> usize {
    16 * (j & 1) + 4 * (j >> 1) + i
}

/// Q5_0's fifth bits `qh` (bit e = element e) regrouped as `qh'` (see the module docs; the
/// bit-by-bit inverse is in [`unpack_row_x8`], which the round-trip test checks this against).
fn regroup_q5(qh: u32) -> u32 {
    // Bits at 0, 4, 8, 12 moved to 0, 2, 4, 6.
    let spread = |x: u32| {
        let s = (x | (x >> 2)) & 0x0F0F;
        (s | (s >> 4)) & 0xFF
    };
    let mut v = 0u32;
    for i in 0..4 {
        // Byte i: elements i + 4c (c = 0..3, even bits) and 16 + i + 4c (odd bits).
        let t = (qh >> i) & 0x1111_1111;
        v |= (spread(t & 0xFFFF) | (spread(t >> 16) << 1)) << (8 * i);
    }
    v
}

fn check(ty: GgmlType, len: usize, n: usize, k: usize) -> Result<usize> {
    if !supports_x8(ty) {
        bail!("{ty} has no interleaved (x8) layout");
    }
    if !n.is_multiple_of(X8_ROWS) {
        bail!("x8 layout: {n} rows is not a multiple of {X8_ROWS}");
    }
    let rb = crate::row_bytes(ty, k)?;
    if Some(len) != n.checked_mul(rb) {
        bail!(
            "{ty} weight of {n} rows x {k}: expected {} bytes, got {len}",
            n as u128 * rb as u128
        );
    }
    Ok(rb)
}

/// Interleaves `X8_ROWS` plain rows (`src`, `8 × row_bytes`) into one group (`dst`, same size).
pub fn repack_group_x8(ty: GgmlType, src: &[u8], dst: &mut [u8], k: usize) -> Result<()> {
    let rb = check(ty, src.len(), X8_ROWS, k)?;
    if dst.len() != src.len() {
        bail!(
            "x8 repack: output of {} bytes for {} input bytes",
            dst.len(),
            src.len()
        );
    }
    let tsz = ty.type_size();
    let (hb, qb) = parts(ty);
    let q0 = quant_offset(ty);
    for b in 0..k / 32 {
        let gb = &mut dst[b * X8_ROWS * tsz..(b + 1) * X8_ROWS * tsz];
        for r in 0..X8_ROWS {
            let blk = &src[r * rb + b * tsz..r * rb + (b + 1) * tsz];
            gb[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
            match ty {
                GgmlType::Q4_1 => gb[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk[2..4]),
                GgmlType::Q5_0 => {
                    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                    gb[16 + 4 * r..16 + 4 * r + 4].copy_from_slice(&regroup_q5(qh).to_le_bytes());
                }
                _ => {}
            }
            let q = &blk[hb..hb + qb];
            for c in 0..qb / 4 {
                let at = q0 + 32 * c + 4 * r;
                gb[at..at + 4].copy_from_slice(&q[4 * c..4 * c + 4]);
            }
        }
    }
    Ok(())
}

/// `n` plain rows of `k` elements of `ty` in the interleaved layout (`n` a multiple of 8).
pub fn repack_x8(ty: GgmlType, w: &[u8], n: usize, k: usize) -> Result<Vec<u8>> {
    let rb = check(ty, w.len(), n, k)?;
    let mut out = vec![0u8; w.len()];
    for (src, dst) in w
        .chunks_exact(X8_ROWS * rb)
        .zip(out.chunks_exact_mut(X8_ROWS * rb))
    {
        repack_group_x8(ty, src, dst, k)?;
    }
    Ok(out)
}

/// Row `r` (0..8) of one interleaved group (`group`, `8 × row_bytes`) as plain blocks (`out`,
/// `row_bytes`).
pub fn unpack_row_x8(ty: GgmlType, group: &[u8], r: usize, out: &mut [u8]) -> Result<()> {
    if !supports_x8(ty) || r >= X8_ROWS || group.len() != X8_ROWS * out.len() {
        bail!(
            "x8 unpack of {ty} row {r}: group of {} bytes, row of {}",
            group.len(),
            out.len()
        );
    }
    let tsz = ty.type_size();
    let (hb, qb) = parts(ty);
    let q0 = quant_offset(ty);
    for (b, blk) in out.chunks_exact_mut(tsz).enumerate() {
        let gb = &group[b * X8_ROWS * tsz..(b + 1) * X8_ROWS * tsz];
        blk[0..2].copy_from_slice(&gb[2 * r..2 * r + 2]);
        match ty {
            GgmlType::Q4_1 => blk[2..4].copy_from_slice(&gb[16 + 2 * r..16 + 2 * r + 2]),
            GgmlType::Q5_0 => {
                let v =
                    u32::from_le_bytes(gb[16 + 4 * r..16 + 4 * r + 4].try_into().unwrap_or([0; 4]));
                let mut qh = 0u32;
                for i in 0..4 {
                    for j in 0..8 {
                        qh |= ((v >> (8 * i + j)) & 1) << q5_element(i, j);
                    }
                }
                blk[2..6].copy_from_slice(&qh.to_le_bytes());
            }
            _ => {}
        }
        for c in 0..qb / 4 {
            let at = q0 + 32 * c + 4 * r;
            blk[hb + 4 * c..hb + 4 * c + 4].copy_from_slice(&gb[at..at + 4]);
        }
    }
    Ok(())
}

/// The offset subtracted from unsigned quants (Q4_0: 8, Q5_0: 16; none for Q8_0 and Q4_1).
pub(crate) fn quant_bias(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        _ => 0,
    }
}

/// Consecutive interleaved groups (`groups`, rows of `k`) against `x.len()` (≤ 4) quantized
/// activation rows (Q8_0 blocks, Q8_1 for Q4_1): `out[g * rx + r][i]` = row `i` of group `g` ·
/// activation row `r`. `xsum[r][b]` is the sum of activation row `r`'s block `b` quants (used by
/// Q4_0/Q5_0's bias).
///
/// Per block and row the integer total is exact; then `acc = fma(d_w · d_x, total, acc)` (Q4_1
/// also `extra = fma(m_w, s_x, extra)`, added at the end): the SIMD kernel does the same f32
/// operations in the same order, lane by lane, so the two agree bit for bit.
pub(crate) type X8Fn =
    fn(ty: GgmlType, groups: &[u8], k: usize, x: &[&[u8]], xsum: &[&[i32]], out: &mut [[f32; 8]]);

/// The scalar twin of the interleaved kernels.
pub(crate) fn x8_group_scalar(
    ty: GgmlType,
    groups: &[u8],
    k: usize,
    x: &[&[u8]],
    xsum: &[&[i32]],
    out: &mut [[f32; 8]],
) {
    let gbytes = (k / 32) * X8_ROWS * ty.type_size();
    for (group, o) in groups
        .chunks_exact(gbytes.max(1))
        .zip(out.chunks_exact_mut(x.len()))
    {
        one_group_scalar(ty, group, x, xsum, o);
    }
}

fn one_group_scalar(
    ty: GgmlType,
    group: &[u8],
    x: &[&[u8]],
    xsum: &[&[i32]],
    out: &mut [[f32; 8]],
) {
    let tsz = ty.type_size();
    let xbs = if ty == GgmlType::Q4_1 { 36 } else { 34 };
    let q0 = quant_offset(ty);
    let bias = quant_bias(ty);
    let nb = group.len() / (X8_ROWS * tsz);
    for (r, xr) in x.iter().enumerate() {
        let mut acc = [0f32; 8];
        let mut extra = [0f32; 8];
        for b in 0..nb {
            let gb = &group[b * X8_ROWS * tsz..(b + 1) * X8_ROWS * tsz];
            let xb = &xr[b * xbs..(b + 1) * xbs];
            let xq = &xb[xbs - 32..];
            let dx = f16_at(xb, 0);
            for i in 0..X8_ROWS {
                let mut total = 0i32;
                match ty {
                    GgmlType::Q8_0 => {
                        for c in 0..8 {
                            for t in 0..4 {
                                let w = gb[q0 + 32 * c + 4 * i + t] as i8 as i32;
                                total += w * xq[4 * c + t] as i8 as i32;
                            }
                        }
                    }
                    _ => {
                        let hi5 = if ty == GgmlType::Q5_0 {
                            u32::from_le_bytes([
                                gb[16 + 4 * i],
                                gb[17 + 4 * i],
                                gb[18 + 4 * i],
                                gb[19 + 4 * i],
                            ])
                        } else {
                            0
                        };
                        for c in 0..4 {
                            for t in 0..4 {
                                let byte = gb[q0 + 32 * c + 4 * i + t];
                                for h in 0..2 {
                                    let mut q = ((byte >> (4 * h)) & 0x0F) as i32;
                                    q |= (((hi5 >> (8 * t + 2 * c + h)) & 1) << 4) as i32;
                                    total += q * xq[16 * h + 4 * c + t] as i8 as i32;
                                }
                            }
                        }
                        if bias != 0 {
                            total -= bias * xsum[r][b];
                        }
                    }
                }
                let d = f16_at(gb, 2 * i) * dx;
                acc[i] = d.mul_add(total as f32, acc[i]);
                if ty == GgmlType::Q4_1 {
                    extra[i] = f16_at(gb, 16 + 2 * i).mul_add(f16_at(xb, 2), extra[i]);
                }
            }
        }
        for i in 0..X8_ROWS {
            out[r][i] = if ty == GgmlType::Q4_1 {
                acc[i] + extra[i]
            } else {
                acc[i]
            };
        }
    }
}

/// The interleaved kernel of this CPU (or the scalar twin).
pub(crate) fn x8_fn(scalar: bool) -> X8Fn {
    #[cfg(target_arch = "x86_64")]
    if !scalar && crate::has_avx512() {
        return crate::x86_512::x8_group;
    }
    #[cfg(target_arch = "x86_64")]
    if !scalar && crate::has_avx2() {
        return crate::x86_x8::x8_group;
    }
    let _ = scalar;
    x8_group_scalar
}

/// One interleaved group (`group`, 8 rows of `k`) dequantized to eight f32 rows (`out`, `8 × k`,
/// row-major): the dequantizer of prefill's f32 GEMM over this layout.
pub(crate) type DequantGroupFn = fn(GgmlType, &[u8], usize, &mut [f32]);

/// The scalar twin: each row unpacked to plain blocks, then the plain scalar dequantizer (so
/// the layout changes no value).
pub(crate) fn dequantize_group_scalar(ty: GgmlType, group: &[u8], k: usize, out: &mut [f32]) {
    let rb = group.len() / X8_ROWS;
    let mut plain = vec![0u8; rb];
    for (r, row) in out.chunks_exact_mut(k).enumerate() {
        // Sizes come from a validated product: an error here is a caller bug.
        let ok = unpack_row_x8(ty, group, r, &mut plain).is_ok()
            && crate::dequantize_row_scalar(ty, &plain, row).is_ok();
        assert!(ok, "x8 group dequantization of {ty}: bad sizes");
    }
}

/// The group dequantizer of this CPU (or the scalar twin).
pub(crate) fn dequant_group_fn(scalar: bool) -> DequantGroupFn {
    #[cfg(target_arch = "x86_64")]
    if !scalar && crate::has_avx2() {
        return crate::x86_x8::dequantize_group;
    }
    let _ = scalar;
    dequantize_group_scalar
}

/// Sums of each 32-quant block of a quantized activation row (`xbs`-byte blocks, quants last).
pub(crate) fn block_sums(xq: &[u8], xbs: usize, out: &mut Vec<i32>) {
    out.clear();
    out.extend(
        xq.chunks_exact(xbs)
            .map(|b| b[xbs - 32..].iter().map(|&q| q as i8 as i32).sum::<i32>()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repack_then_unpack_is_identity() {
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
        ] {
            let k = 96;
            let rb = ty.row_bytes(k).unwrap();
            let w: Vec<u8> = (0..16 * rb).map(|i| (i * 131 + 7) as u8).collect();
            let p = repack_x8(ty, &w, 16, k).unwrap();
            assert_ne!(p, w, "{ty}: the layout must actually move bytes");
            let mut row = vec![0u8; rb];
            for n in 0..16 {
                let g = n / 8;
                unpack_row_x8(ty, &p[g * 8 * rb..(g + 1) * 8 * rb], n % 8, &mut row).unwrap();
                assert_eq!(row, w[n * rb..(n + 1) * rb], "{ty} row {n}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(repack_x8(GgmlType::Q8_0, &[0; 34 * 4], 4, 32).is_err());
        assert!(repack_x8(GgmlType::Q4_K, &[0; 144 * 8], 8, 256).is_err());
        assert!(repack_x8(GgmlType::Q8_0, &[0; 34 * 8 - 1], 8, 32).is_err());
    }
}
