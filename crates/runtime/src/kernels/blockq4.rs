//! 4-bit block-quantized weights kept packed (two values per byte) and dequantized a column
//! panel at a time, for `npuc.BlockMatMul` (`ops::blockmm`).
//!
//! Layout: a `k x n` weight is stored row-major with `n.div_ceil(2)` bytes per row; column `c`
//! of row `r` is the low nibble of byte `r * row_bytes + c / 2` for even `c`, the high nibble
//! for odd `c`. Each nibble `u` is an unsigned code (int4 codes are stored as `q + 8`), and the
//! weight is `(u - center) * scale` with `center` and `scale` f32 values per (block of
//! `block` rows, column), `[k / block, n]` row-major. `u - center` is a difference of small
//! integers, exact in f32, so the result is the same f32 ONNX `DequantizeLinear` computes from
//! `(q - zero_point) * scale`: the AVX2 path and its scalar twin are bit-identical (no FMA).
//! The AVX2 path also serves the AVX-512 level (the panel is a small share of the product).

pub use npuc_isa::Isa;

/// Bytes of one packed row of `n` columns.
pub fn row_bytes(n: usize) -> usize {
    n.div_ceil(2)
}

/// Packs `k x n` unsigned 4-bit codes (`code(r, c)` in `0..16`) into the layout above.
pub fn pack(k: usize, n: usize, code: impl Fn(usize, usize) -> u8) -> Vec<u8> {
    let rb = row_bytes(n);
    let mut out = vec![0u8; k * rb];
    for r in 0..k {
        for c in 0..n {
            out[r * rb + c / 2] |= (code(r, c) & 15) << (4 * (c % 2));
        }
    }
    out
}

/// The operands of one dequantization: packed codes and per-block parameters of a `k x n`
/// weight (`block` rows per block, `k` a multiple of it).
#[derive(Clone, Copy)]
pub struct Packed<'a> {
    pub codes: &'a [u8],
    pub scale: &'a [f32],
    pub center: &'a [f32],
    pub k: usize,
    pub n: usize,
    pub block: usize,
}

impl Packed<'_> {
    /// Whether the slices hold a whole `k x n` weight.
    pub fn valid(&self) -> bool {
        self.block > 0
            && self.k.is_multiple_of(self.block)
            && self.codes.len() >= self.k * row_bytes(self.n)
            && self.scale.len() >= (self.k / self.block) * self.n
            && self.center.len() >= (self.k / self.block) * self.n
    }
}

/// Writes columns `n0 .. n0 + nc` of every row into `out` (`k x nc`, row-major). `n0` must be
/// even and the panel inside the weight; returns false (writing nothing) otherwise.
pub fn dequant_panel(isa: Isa, w: &Packed, n0: usize, nc: usize, out: &mut [f32]) -> bool {
    if !w.valid() || !n0.is_multiple_of(2) || n0 + nc > w.n || out.len() < w.k * nc {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && Isa::detect().has_avx2() {
        // SAFETY: AVX2 is available (checked); `valid` and the checks above bound every read
        // (`x86::panel` reads whole 16-column groups only inside `n0 .. n0 + nc`, i.e. bytes
        // up to `(n0 + nc) / 2` of a row, within `row_bytes(n)`) and every write
        // (`out[..k * nc]`).
        unsafe { x86::panel(w, n0, nc, out) };
        return true;
    }
    let _ = isa;
    panel_scalar(w, n0, nc, 0, out);
    true
}

/// Scalar twin: columns `n0 + j0 .. n0 + nc` of the panel (`j0` lets the AVX2 path finish a
/// ragged tail with the same code).
fn panel_scalar(w: &Packed, n0: usize, nc: usize, j0: usize, out: &mut [f32]) {
    let rb = row_bytes(w.n);
    for r in 0..w.k {
        let p = (r / w.block) * w.n;
        let row = &w.codes[r * rb..(r + 1) * rb];
        for j in j0..nc {
            let c = n0 + j;
            let u = (row[c / 2] >> (4 * (c % 2))) & 15;
            out[r * nc + j] = (u as f32 - w.center[p + c]) * w.scale[p + c];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{panel_scalar, row_bytes, Packed};
    use std::arch::x86_64::*;

    /// AVX2 panel: 16 columns (8 bytes) per step, the rest of the row by the scalar code.
    ///
    /// # Safety
    /// AVX2 must be available, `w.valid()`, `n0` even, `n0 + nc <= w.n`, `out.len() >= w.k * nc`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn panel(w: &Packed, n0: usize, nc: usize, out: &mut [f32]) {
        let rb = row_bytes(w.n);
        let groups = nc / 16;
        let mask = _mm_set1_epi8(15);
        for r in 0..w.k {
            let p = (r / w.block) * w.n + n0;
            let src = w.codes.as_ptr().add(r * rb + n0 / 2);
            let dst = out.as_mut_ptr().add(r * nc);
            for g in 0..groups {
                // 8 bytes = 16 codes, low nibble first: interleave lows and highs.
                let b = _mm_loadl_epi64(src.add(8 * g) as *const __m128i);
                let lo = _mm_and_si128(b, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
                let u = _mm_unpacklo_epi8(lo, hi);
                let u0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u));
                let u1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(u, 8)));
                let j = 16 * g;
                let c0 = _mm256_loadu_ps(w.center.as_ptr().add(p + j));
                let c1 = _mm256_loadu_ps(w.center.as_ptr().add(p + j + 8));
                let s0 = _mm256_loadu_ps(w.scale.as_ptr().add(p + j));
                let s1 = _mm256_loadu_ps(w.scale.as_ptr().add(p + j + 8));
                _mm256_storeu_ps(dst.add(j), _mm256_mul_ps(_mm256_sub_ps(u0, c0), s0));
                _mm256_storeu_ps(dst.add(j + 8), _mm256_mul_ps(_mm256_sub_ps(u1, c1), s1));
            }
        }
        if groups * 16 < nc {
            panel_scalar(w, n0, nc, groups * 16, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::xorshift;
    use proptest::prelude::*;

    fn weight(seed: u64, k: usize, n: usize, block: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let mut s = seed | 1;
        let codes: Vec<u8> = (0..k * n).map(|_| (xorshift(&mut s) % 16) as u8).collect();
        let packed = pack(k, n, |r, c| codes[r * n + c]);
        let nb = k / block * n;
        let scale = (0..nb)
            .map(|_| (xorshift(&mut s) % 1000) as f32 * 1e-4 + 1e-5)
            .collect();
        let center = (0..nb)
            .map(|_| (xorshift(&mut s) % 31) as f32 - 7.0)
            .collect();
        (packed, scale, center)
    }

    proptest! {
        /// AVX2 equals the scalar twin bit for bit, and both equal the unpacked formula.
        #[test]
        fn panel_simd_matches_scalar(
            kb in 1usize..5, bi in 0usize..4, n in 1usize..70, start in 0usize..40,
            width in 1usize..70, seed in any::<u64>(),
        ) {
            let block = [16, 32, 64, 128][bi];
            let k = kb * block;
            let (codes, scale, center) = weight(seed, k, n, block);
            let w = Packed { codes: &codes, scale: &scale, center: &center, k, n, block };
            let n0 = (start.min(n - 1)) & !1;
            let nc = width.min(n - n0);
            let mut a = vec![f32::NAN; k * nc];
            let mut b = vec![f32::NAN; k * nc];
            prop_assert!(dequant_panel(Isa::Scalar, &w, n0, nc, &mut a));
            prop_assert!(dequant_panel(Isa::detect(), &w, n0, nc, &mut b));
            for r in 0..k {
                for j in 0..nc {
                    let c = n0 + j;
                    let u = (codes[r * row_bytes(n) + c / 2] >> (4 * (c % 2))) & 15;
                    let p = (r / block) * n + c;
                    let want = (u as f32 - center[p]) * scale[p];
                    prop_assert_eq!(a[r * nc + j].to_bits(), want.to_bits());
                    prop_assert_eq!(b[r * nc + j].to_bits(), want.to_bits());
                }
            }
        }
    }

    #[test]
    fn refuses_bad_panels() {
        let (codes, scale, center) = weight(3, 32, 10, 16);
        let w = Packed {
            codes: &codes,
            scale: &scale,
            center: &center,
            k: 32,
            n: 10,
            block: 16,
        };
        let mut out = vec![0f32; 32 * 10];
        assert!(
            !dequant_panel(Isa::detect(), &w, 1, 4, &mut out),
            "odd start"
        );
        assert!(
            !dequant_panel(Isa::detect(), &w, 8, 4, &mut out),
            "past the end"
        );
        let short = Packed { k: 48, ..w };
        assert!(
            !dequant_panel(Isa::detect(), &short, 0, 4, &mut out),
            "k not whole blocks"
        );
    }
}
