//! Byte table lookups: `data[i] = table[data[i] ^ flip]` over 8-bit codes (an 8-bit
//! quantized activation through a 256-entry table: the lookups `npuc.QLut` and fused
//! `npuc.QConv` tables run). `flip` is 0x80 for i8 codes (their table index is `code + 128`)
//! and 0 for u8.
//!
//! With AVX-512 VBMI a 64-byte vector looks up 128 entries per `vpermi2b` (`permutex2var`):
//! two of them cover the table's halves and bit 7 of each index picks between them.
//! Otherwise one lookup per byte (the scalar twin, every level).

use npuc_isa::Isa;

/// `data[i] = table[(data[i] ^ flip) as usize]` at the process-wide level.
pub fn lut8(table: &[u8; 256], flip: u8, data: &mut [u8]) {
    lut8_with(Isa::detect(), table, flip, data)
}

/// [`lut8`] at an explicit level (tests compare the levels).
pub fn lut8_with(isa: Isa, table: &[u8; 256], flip: u8, data: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() && Isa::detect().has_avx512() && vbmi() {
        // SAFETY: AVX-512 F/BW and VBMI detected on this CPU; the kernel reads and writes
        // `data` within its length (masked tail) and `table`'s 256 bytes.
        unsafe { lut8_vbmi(table, flip, data) };
        return;
    }
    let _ = isa;
    lut8_scalar(table, flip, data)
}

/// Whether the CPU has AVX-512 VBMI (byte permutes), detected once.
#[cfg(target_arch = "x86_64")]
fn vbmi() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512vbmi"))
}

/// The scalar twin.
pub fn lut8_scalar(table: &[u8; 256], flip: u8, data: &mut [u8]) {
    for v in data {
        *v = table[(*v ^ flip) as usize];
    }
}

/// # Safety
/// AVX-512 F, BW and VBMI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn lut8_vbmi(table: &[u8; 256], flip: u8, data: &mut [u8]) {
    use std::arch::x86_64::*;
    let t = table.as_ptr();
    // SAFETY: the four 64-byte loads read table[0..256]; every data access below is either a
    // full 64-byte block inside `data` or masked to its remaining length.
    unsafe {
        let (t0, t1, t2, t3) = (
            _mm512_loadu_si512(t as *const _),
            _mm512_loadu_si512(t.add(64) as *const _),
            _mm512_loadu_si512(t.add(128) as *const _),
            _mm512_loadu_si512(t.add(192) as *const _),
        );
        let vflip = _mm512_set1_epi8(flip as i8);
        let look = |v: __m512i| {
            let i = _mm512_xor_si512(v, vflip);
            // Indices 0..127 from t0:t1, 128..255 from t2:t3 (permutex2var uses 7 bits).
            let lo = _mm512_permutex2var_epi8(t0, i, t1);
            let hi = _mm512_permutex2var_epi8(t2, i, t3);
            _mm512_mask_blend_epi8(_mm512_movepi8_mask(i), lo, hi)
        };
        let p = data.as_mut_ptr();
        let n = data.len();
        let mut j = 0;
        while j + 64 <= n {
            let v = _mm512_loadu_si512(p.add(j) as *const _);
            _mm512_storeu_si512(p.add(j) as *mut _, look(v));
            j += 64;
        }
        if j < n {
            let m: __mmask64 = (1u64 << (n - j)) - 1;
            let v = _mm512_maskz_loadu_epi8(m, p.add(j) as *const i8);
            _mm512_mask_storeu_epi8(p.add(j) as *mut i8, m, look(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::xorshift;

    /// Every level equals the scalar twin for both flips over lengths around the vector width.
    #[test]
    fn lut8_levels_equal_scalar_twin() {
        let mut s = 0x1u64 << 40 | 77;
        let mut table = [0u8; 256];
        for t in table.iter_mut() {
            *t = xorshift(&mut s) as u8;
        }
        for len in [0usize, 1, 5, 63, 64, 65, 127, 128, 200, 1000] {
            let data: Vec<u8> = (0..len).map(|_| xorshift(&mut s) as u8).collect();
            for flip in [0u8, 0x80] {
                let want: Vec<u8> = data.iter().map(|&v| table[(v ^ flip) as usize]).collect();
                let mut got = data.clone();
                lut8_scalar(&table, flip, &mut got);
                assert_eq!(got, want, "scalar, len {len} flip {flip}");
                for isa in Isa::ALL.into_iter().filter(|&l| l <= Isa::detect()) {
                    let mut got = data.clone();
                    lut8_with(isa, &table, flip, &mut got);
                    assert_eq!(got, want, "{}, len {len} flip {flip}", isa.name());
                }
            }
        }
    }
}
