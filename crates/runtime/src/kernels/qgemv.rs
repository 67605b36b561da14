//! Exact integer matrix-vector product for the recurrent step of DynamicQuantizeLSTM:
//! `out[n] (i32) = a[k] · B[k x n]`, with `a` the zero-point-corrected quantized hidden state
//! (i16, within [-255, 255]) and `B` constant int8 weights (zero point already subtracted,
//! within [-128, 127]), packed once.
//!
//! The recurrent weights are re-read at every timestep, so they are stored as i8 (half the
//! bytes of the i16 panels of `kernels::igemm`: a 256 x 1024 matrix is 256 KiB and stays in a
//! 512 KiB L2 while the step loop runs) and widened to i16 in registers (`vpmovsxbw`) right
//! before `vpmaddwd`. Every term is at most 255 * 128 = 32640 in magnitude, so an i32 sum of
//! `k <= MAX_K` terms is exact, and the AVX2 kernel equals its scalar twin bit for bit.
//!
//! Layout: columns in panels of [`NRV`]; a panel holds, for each pair of rows `(2p, 2p + 1)`,
//! its `NRV` columns' two values interleaved (the `vpmaddwd` operand order). `k` and `n` are
//! padded with zeros to whole pairs and panels, so padded lanes contribute nothing.

use crate::bail;
use crate::error::Result;
pub use npuc_isa::Isa;

/// Columns of a panel: four AVX2 registers of eight i32 sums.
pub const NRV: usize = 32;
/// The longest reduction whose i32 accumulation is proven exact: floor((2^31 - 1) / 32640).
pub const MAX_K: usize = 65793;

/// Constant int8 weights `k x n`, packed for [`gemv`].
#[derive(Debug, Clone)]
pub struct PackedI8 {
    k: usize,
    pairs: usize,
    panels: usize,
    data: Vec<i8>,
}

impl PackedI8 {
    /// Packs `B[k x n]` where element (r, c) is `get(r, c)`.
    pub fn pack(k: usize, n: usize, get: impl Fn(usize, usize) -> i8) -> PackedI8 {
        let pairs = k.div_ceil(2);
        let panels = n.div_ceil(NRV);
        let mut data = vec![0i8; panels * pairs * 2 * NRV];
        for r in 0..k {
            let (p, h) = (r / 2, r % 2);
            for c in 0..n {
                let (pn, j) = (c / NRV, c % NRV);
                data[(pn * pairs + p) * 2 * NRV + 2 * j + h] = get(r, c);
            }
        }
        PackedI8 {
            k,
            pairs,
            panels,
            data,
        }
    }
    /// Length [`gemv`] wants for `a`: `k` rounded up to a whole pair (the pad is zero).
    pub fn a_len(&self) -> usize {
        2 * self.pairs
    }
    /// Length [`gemv`] wants for `out`: `n` rounded up to a whole panel.
    pub fn out_len(&self) -> usize {
        self.panels * NRV
    }
}

/// `out = a · B`, exact in i32. `a` holds [`PackedI8::a_len`] values (the pad past `k` must be
/// zero) within [-255, 255]; `out` holds [`PackedI8::out_len`] values (the columns past `n` come
/// out zero).
pub fn gemv(a: &[i16], b: &PackedI8, out: &mut [i32]) -> Result<()> {
    gemv_with(Isa::detect(), a, b, out)
}

/// [`gemv`] with an explicit kernel choice (tests compare the kernels).
pub fn gemv_with(isa: Isa, a: &[i16], b: &PackedI8, out: &mut [i32]) -> Result<()> {
    if a.len() != b.a_len() || out.len() != b.out_len() {
        bail!(
            "integer matrix-vector product: operand of {} and output of {} values, {} and {} expected",
            a.len(),
            out.len(),
            b.a_len(),
            b.out_len()
        );
    }
    if b.k > MAX_K {
        bail!(
            "integer matrix-vector product: reduction length {} exceeds {MAX_K}, the exact i32 bound",
            b.k
        );
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        if !Isa::detect().has_avx2() {
            bail!("integer matrix-vector product: AVX2 kernel requested on a CPU without avx2");
        }
        // SAFETY: AVX2 is present (checked above); the lengths of `a` (2 * pairs), `out`
        // (panels * NRV) and `b.data` (panels * pairs * 2 * NRV, by construction) are what
        // the kernel reads and writes.
        unsafe { gemv_avx2(a, b, out) };
        return Ok(());
    }
    let _ = isa;
    gemv_scalar(a, b, out);
    Ok(())
}

/// Scalar twin of [`gemv_avx2`].
fn gemv_scalar(a: &[i16], b: &PackedI8, out: &mut [i32]) {
    let plen = b.pairs * 2 * NRV;
    for (pn, o) in out.chunks_exact_mut(NRV).enumerate() {
        let mut acc = [0i32; NRV];
        let panel = &b.data[pn * plen..(pn + 1) * plen];
        for (p, w) in panel.chunks_exact(2 * NRV).enumerate() {
            let (a0, a1) = (a[2 * p] as i32, a[2 * p + 1] as i32);
            for (j, s) in acc.iter_mut().enumerate() {
                *s = s.wrapping_add(a0 * w[2 * j] as i32 + a1 * w[2 * j + 1] as i32);
            }
        }
        o.copy_from_slice(&acc);
    }
}

/// Per panel and row pair: one broadcast of the `a` pair, four 16-byte loads widened to i16
/// (`vpmovsxbw`), four `vpmaddwd` + `vpaddd` into four accumulators of eight columns.
///
/// # Safety
/// The CPU must support avx2; `a.len() == 2 * b.pairs`, `out.len() == b.panels * NRV` and
/// `b.data.len() == b.panels * b.pairs * 2 * NRV`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gemv_avx2(a: &[i16], b: &PackedI8, out: &mut [i32]) {
    use std::arch::x86_64::*;
    assert!(
        a.len() == 2 * b.pairs
            && out.len() == b.panels * NRV
            && b.data.len() == b.panels * b.pairs * 2 * NRV
    );
    let plen = b.pairs * 2 * NRV;
    let ap = a.as_ptr();
    for pn in 0..b.panels {
        let wp = b.data[pn * plen..].as_ptr();
        let mut acc = [_mm256_setzero_si256(); 4];
        for p in 0..b.pairs {
            // SAFETY: p < pairs, so a[2p..2p + 2] and this panel's 64 bytes of pair p lie
            // inside the slices (asserted lengths); all loads are unaligned.
            unsafe {
                let av = _mm256_set1_epi32((ap.add(2 * p) as *const i32).read_unaligned());
                let w = wp.add(p * 2 * NRV);
                for (q, s) in acc.iter_mut().enumerate() {
                    let wq = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.add(16 * q) as *const __m128i));
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(av, wq));
                }
            }
        }
        for (q, s) in acc.iter().enumerate() {
            // SAFETY: out holds panels * NRV values; this panel's 32 lie at pn * NRV.
            unsafe {
                _mm256_storeu_si256(out.as_mut_ptr().add(pn * NRV + 8 * q) as *mut __m256i, *s)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The dispatched product equals the scalar twin and the plain definition, at sizes
        /// covering odd `k` and partial panels, with operands at the ends of their ranges.
        #[test]
        fn dispatched_equals_scalar_twin_and_definition(
            k in 1usize..70,
            n in 1usize..80,
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut rnd = || super::super::xorshift(&mut s);
            let w: Vec<i8> = (0..k * n).map(|_| rnd() as i8).collect();
            let b = PackedI8::pack(k, n, |r, c| w[r * n + c]);
            let mut a: Vec<i16> = (0..b.a_len())
                .map(|i| if i % 7 == 0 { -255 } else { (rnd() % 511) as i16 - 255 })
                .collect();
            a[k..].fill(0);
            let mut got = vec![7i32; b.out_len()];
            let mut twin = vec![0i32; b.out_len()];
            gemv(&a, &b, &mut got).unwrap();
            gemv_with(Isa::Scalar, &a, &b, &mut twin).unwrap();
            prop_assert_eq!(&got, &twin);
            for c in 0..b.out_len() {
                let want: i32 = if c < n {
                    (0..k).map(|r| a[r] as i32 * w[r * n + c] as i32).sum()
                } else {
                    0
                };
                prop_assert_eq!(got[c], want);
            }
        }
    }

    #[test]
    fn wrong_lengths_are_refused() {
        let b = PackedI8::pack(3, 5, |_, _| 1);
        let err = gemv(&[0; 3], &b, &mut [0; NRV]).unwrap_err();
        assert!(err.to_string().contains("operand of 3"), "{err}");
    }
}
