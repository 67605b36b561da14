//! Three planes interleaved into pixels: `dst[3 r + c] = plane_c[r]`, the NCHW -> NHWC
//! transpose of an RGB image (the entry of every channels-last vision model).
//!
//! The generic tiled transpose moves one value per iteration with its index arithmetic, about a
//! cycle a value; with three planes its inner rows are three values long, so the tiling does not
//! help. At AVX-512 each 16 pixels take three loads, six permutes and three stores; at AVX2 each
//! 8 pixels three loads, nine in-register permutes, six blends and three stores.

/// `dst[3 r + c] = [p0, p1, p2][c][r]` for every `r < p0.len()`; `false` (nothing written) when
/// the planes differ in length or `dst` is not three times as long, so a caller can fall back
/// to its generic copy instead of failing.
pub fn interleave3(p0: &[f32], p1: &[f32], p2: &[f32], dst: &mut [f32]) -> bool {
    let rows = p0.len();
    if p1.len() != rows || p2.len() != rows || dst.len() != 3 * rows {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if npuc_isa::Isa::detect().has_avx512() {
        // SAFETY: the ISA module detected AVX-512F on this CPU (capped by NPUC_ISA); the
        // lengths were checked above.
        unsafe { interleave3_avx512(p0, p1, p2, dst) };
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    if npuc_isa::Isa::detect().has_avx2() {
        // SAFETY: the ISA module detected AVX2 on this CPU (capped by NPUC_ISA); the lengths
        // were checked above.
        unsafe { interleave3_avx2(p0, p1, p2, dst) };
        return true;
    }
    interleave3_scalar(p0, p1, p2, dst);
    true
}

/// The scalar twin of [`interleave3`] (same preconditions).
pub fn interleave3_scalar(p0: &[f32], p1: &[f32], p2: &[f32], dst: &mut [f32]) {
    for (((px, &a), &b), &c) in dst.chunks_exact_mut(3).zip(p0).zip(p1).zip(p2) {
        px[0] = a;
        px[1] = b;
        px[2] = c;
    }
}

/// Permute indices for output vector `k` (values `16 k .. 16 k + 16` of a 48-value group):
/// lanes from planes 0 and 1 index `permutex2var(p0, p1)` (plane 1 offset by 16), lanes from
/// plane 2 are set in the mask and index `p2`.
const fn lanes(k: usize) -> ([i32; 16], [i32; 16], u16) {
    let mut ab = [0i32; 16];
    let mut c = [0i32; 16];
    let mut mask = 0u16;
    let mut j = 0;
    while j < 16 {
        let f = 16 * k + j;
        let (pixel, channel) = ((f / 3) as i32, f % 3);
        match channel {
            0 => ab[j] = pixel,
            1 => ab[j] = 16 + pixel,
            _ => {
                c[j] = pixel;
                mask |= 1 << j;
            }
        }
        j += 1;
    }
    (ab, c, mask)
}

const LANES: [([i32; 16], [i32; 16], u16); 3] = [lanes(0), lanes(1), lanes(2)];

/// # Safety
/// AVX-512 F; the lengths as [`interleave3`] checks them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn interleave3_avx512(p0: &[f32], p1: &[f32], p2: &[f32], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let rows = p0.len();
    let whole = rows / 16 * 16;
    // SAFETY (loads of the constant tables): 16 i32 each.
    let idx = LANES.map(|(ab, c, mask)| unsafe {
        (
            _mm512_loadu_si512(ab.as_ptr().cast()),
            _mm512_loadu_si512(c.as_ptr().cast()),
            mask,
        )
    });
    let mut r = 0;
    while r < whole {
        // SAFETY: r + 16 <= rows, so each plane has 16 values at r and dst 48 at 3 r.
        unsafe {
            let a = _mm512_loadu_ps(p0.as_ptr().add(r));
            let b = _mm512_loadu_ps(p1.as_ptr().add(r));
            let c = _mm512_loadu_ps(p2.as_ptr().add(r));
            for (k, &(ab, ci, mask)) in idx.iter().enumerate() {
                let v = _mm512_permutex2var_ps(a, ab, b);
                let v = _mm512_mask_permutexvar_ps(v, mask, ci, c);
                _mm512_storeu_ps(dst.as_mut_ptr().add(3 * r + 16 * k), v);
            }
        }
        r += 16;
    }
    interleave3_scalar(
        &p0[whole..],
        &p1[whole..],
        &p2[whole..],
        &mut dst[3 * whole..],
    );
}

/// AVX2 output vector `k` (values `8 k .. 8 k + 8` of a 24-value group): the pixel each lane
/// takes (the same index into whichever plane), and the lanes of planes 1 and 2 (all bits set).
const fn lanes8(k: usize) -> ([i32; 8], [i32; 8], [i32; 8]) {
    let mut idx = [0i32; 8];
    let mut from1 = [0i32; 8];
    let mut from2 = [0i32; 8];
    let mut j = 0;
    while j < 8 {
        let f = 8 * k + j;
        idx[j] = (f / 3) as i32;
        match f % 3 {
            1 => from1[j] = -1,
            2 => from2[j] = -1,
            _ => {}
        }
        j += 1;
    }
    (idx, from1, from2)
}

const LANES8: [([i32; 8], [i32; 8], [i32; 8]); 3] = [lanes8(0), lanes8(1), lanes8(2)];

/// # Safety
/// AVX2; the lengths as [`interleave3`] checks them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn interleave3_avx2(p0: &[f32], p1: &[f32], p2: &[f32], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let rows = p0.len();
    let whole = rows / 8 * 8;
    // SAFETY (loads of the constant tables): 8 i32 each.
    let lanes = LANES8.map(|(idx, from1, from2)| unsafe {
        (
            _mm256_loadu_si256(idx.as_ptr().cast()),
            _mm256_castsi256_ps(_mm256_loadu_si256(from1.as_ptr().cast())),
            _mm256_castsi256_ps(_mm256_loadu_si256(from2.as_ptr().cast())),
        )
    });
    let mut r = 0;
    while r < whole {
        // SAFETY: r + 8 <= rows, so each plane has 8 values at r and dst 24 at 3 r.
        unsafe {
            let a = _mm256_loadu_ps(p0.as_ptr().add(r));
            let b = _mm256_loadu_ps(p1.as_ptr().add(r));
            let c = _mm256_loadu_ps(p2.as_ptr().add(r));
            for (k, &(idx, from1, from2)) in lanes.iter().enumerate() {
                let v = _mm256_permutevar8x32_ps(a, idx);
                let v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(b, idx), from1);
                let v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(c, idx), from2);
                _mm256_storeu_ps(dst.as_mut_ptr().add(3 * r + 8 * k), v);
            }
        }
        r += 8;
    }
    interleave3_scalar(
        &p0[whole..],
        &p1[whole..],
        &p2[whole..],
        &mut dst[3 * whole..],
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length up to a few vectors (with tails), distinct values so a misplaced lane shows.
    #[test]
    fn interleave3_equals_scalar_twin() {
        for rows in [0usize, 1, 5, 15, 16, 17, 31, 32, 47, 100] {
            let p: Vec<Vec<f32>> = (0..3)
                .map(|c| (0..rows).map(|r| (1000 * c + r) as f32).collect())
                .collect();
            let mut fast = vec![f32::NAN; 3 * rows];
            let mut twin = vec![f32::NAN; 3 * rows];
            assert!(interleave3(&p[0], &p[1], &p[2], &mut fast));
            interleave3_scalar(&p[0], &p[1], &p[2], &mut twin);
            assert_eq!(fast, twin, "{rows} rows");
            for r in 0..rows {
                for c in 0..3 {
                    assert_eq!(twin[3 * r + c], (1000 * c + r) as f32);
                }
            }
        }
    }

    /// Mismatched lengths are refused with nothing written (the caller copies generically).
    #[test]
    fn interleave3_refuses_mismatched_lengths() {
        let (a, b) = (vec![1f32; 4], vec![2f32; 5]);
        let mut dst = vec![0f32; 12];
        assert!(!interleave3(&a, &a, &b, &mut dst));
        assert!(!interleave3(&a, &a, &a, &mut dst[..11]));
        assert!(dst.iter().all(|&v| v == 0.0));
    }
}
