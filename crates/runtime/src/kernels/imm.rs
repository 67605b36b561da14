//! The plain i32 matrix product of the general integer ops (MatMulInteger, ConvInteger) and
//! the dot product of a narrow MatMulInteger, compiled twice: for the baseline target, where SSE2 has
//! no 32-bit lane multiply and the loop runs mostly scalar, and with AVX2 (`vpmulld`, 8 lanes),
//! picked at run time by `npuc-isa`; and the unsigned-by-signed byte dot product with AVX-512
//! VNNI. Integer wrapping arithmetic is exact, so the two copies give
//! identical results (tested).

/// `c[m×n] += a[m×k] · b[k×n]` in wrapping i32 arithmetic, row-major, with a contiguous inner
/// loop over `n` that the compiler vectorizes.
pub fn igemm(m: usize, k: usize, n: usize, a: &[i32], b: &[i32], c: &mut [i32]) {
    debug_assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    #[cfg(target_arch = "x86_64")]
    if npuc_isa::Isa::detect().has_avx2() {
        // SAFETY: AVX2 was detected on this CPU (capped by NPUC_ISA); the body is safe Rust.
        unsafe { igemm_avx2(m, k, n, a, b, c) };
        return;
    }
    igemm_scalar(m, k, n, a, b, c)
}

#[inline(always)]
fn igemm_body(m: usize, k: usize, n: usize, a: &[i32], b: &[i32], c: &mut [i32]) {
    for i in 0..m {
        let crow = &mut c[i * n..(i + 1) * n];
        let arow = &a[i * k..(i + 1) * k];
        for (p, &av) in arow.iter().enumerate() {
            if av == 0 {
                continue;
            }
            let brow = &b[p * n..(p + 1) * n];
            for (cv, &bv) in crow.iter_mut().zip(brow) {
                *cv = cv.wrapping_add(av.wrapping_mul(bv));
            }
        }
    }
}

/// The scalar twin (baseline target) of [`igemm`].
pub fn igemm_scalar(m: usize, k: usize, n: usize, a: &[i32], b: &[i32], c: &mut [i32]) {
    igemm_body(m, k, n, a, b, c)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn igemm_avx2(m: usize, k: usize, n: usize, a: &[i32], b: &[i32], c: &mut [i32]) {
    igemm_body(m, k, n, a, b, c)
}

/// `Σ_p (a[p] - zp) · b[p]` in wrapping i32 arithmetic over 8-bit `a` (u8 or i8) and i32
/// `b`: one row-by-column product of a narrow integer matmul, 8 lanes wide with AVX2.
pub fn dot<T: Copy + Into<i32>>(a: &[T], zp: i32, b: &[i32]) -> i32 {
    #[cfg(target_arch = "x86_64")]
    if npuc_isa::Isa::detect().has_avx2() {
        // SAFETY: AVX2 was detected on this CPU (capped by NPUC_ISA); the body is safe Rust.
        return unsafe { dot_avx2(a, zp, b) };
    }
    dot_scalar(a, zp, b)
}

/// Eight independent lane sums so the loop vectorizes (wrapping sums are exact in any order).
#[inline(always)]
fn dot_body<T: Copy + Into<i32>>(a: &[T], zp: i32, b: &[i32]) -> i32 {
    let mut lanes = [0i32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: i32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .fold(0, |s, (&x, &y)| {
            s.wrapping_add((x.into() - zp).wrapping_mul(y))
        });
    for (x8, y8) in ac.zip(bc) {
        for ((l, &x), &y) in lanes.iter_mut().zip(x8).zip(y8) {
            *l = l.wrapping_add((x.into() - zp).wrapping_mul(y));
        }
    }
    lanes.iter().fold(tail, |s, &l| s.wrapping_add(l))
}

/// The scalar twin (baseline target) of [`dot`].
pub fn dot_scalar<T: Copy + Into<i32>>(a: &[T], zp: i32, b: &[i32]) -> i32 {
    dot_body(a, zp, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2<T: Copy + Into<i32>>(a: &[T], zp: i32, b: &[i32]) -> i32 {
    dot_body(a, zp, b)
}

/// `Σ_p a[p] · b[p]` over unsigned bytes `a` and signed bytes `b` (equal lengths), in
/// wrapping i32 arithmetic: a narrow MatMulInteger's row-by-column product when its constant
/// column fits i8 (the zero-point term is subtracted by the caller as `zp · Σ b`). With
/// AVX-512 VNNI one `vpdpbusd` takes 64 products; otherwise the scalar twin.
pub fn dot_u8_i8(a: &[u8], b: &[i8]) -> i32 {
    assert_eq!(a.len(), b.len(), "dot_u8_i8 operands differ in length");
    #[cfg(target_arch = "x86_64")]
    if npuc_isa::Isa::detect().has_avx512_vnni() {
        // SAFETY: AVX-512 F/BW/VNNI were detected on this CPU (capped by NPUC_ISA); the
        // lengths are equal (asserted).
        return unsafe { dot_u8_i8_vnni(a, b) };
    }
    dot_u8_i8_scalar(a, b)
}

/// The scalar twin of [`dot_u8_i8`].
pub fn dot_u8_i8_scalar(a: &[u8], b: &[i8]) -> i32 {
    a.iter()
        .zip(b)
        .fold(0i32, |s, (&x, &y)| s.wrapping_add(x as i32 * y as i32))
}

/// [`dot_u8_i8`] with `vpdpbusd`: two independent accumulators over 128-byte steps, then a
/// masked load for the tail. Each instruction adds four products (each within ±32640) to a
/// lane without saturation, so the lane sums wrap exactly as the scalar twin's sum does.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `a.len() == b.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dot_u8_i8_vnni(a: &[u8], b: &[i8]) -> i32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm512_setzero_si512();
    let mut acc1 = _mm512_setzero_si512();
    let mut i = 0;
    // SAFETY (all loads): i + 128 <= n, i + 64 <= n, or the mask covers only the n - i < 64
    // bytes left, so every byte read lies inside both slices (equal lengths).
    while i + 128 <= n {
        unsafe {
            let x0 = _mm512_loadu_si512(ap.add(i) as *const _);
            let y0 = _mm512_loadu_si512(bp.add(i) as *const _);
            let x1 = _mm512_loadu_si512(ap.add(i + 64) as *const _);
            let y1 = _mm512_loadu_si512(bp.add(i + 64) as *const _);
            acc0 = _mm512_dpbusd_epi32(acc0, x0, y0);
            acc1 = _mm512_dpbusd_epi32(acc1, x1, y1);
        }
        i += 128;
    }
    if i + 64 <= n {
        unsafe {
            let x0 = _mm512_loadu_si512(ap.add(i) as *const _);
            let y0 = _mm512_loadu_si512(bp.add(i) as *const _);
            acc0 = _mm512_dpbusd_epi32(acc0, x0, y0);
        }
        i += 64;
    }
    if i < n {
        let mask: __mmask64 = (1u64 << (n - i)) - 1;
        unsafe {
            let x0 = _mm512_maskz_loadu_epi8(mask, ap.add(i) as *const i8);
            let y0 = _mm512_maskz_loadu_epi8(mask, bp.add(i));
            acc1 = _mm512_dpbusd_epi32(acc1, x0, y0);
        }
    }
    _mm512_reduce_add_epi32(_mm512_add_epi32(acc0, acc1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The dispatched product (AVX2 on a host that has it) equals the scalar twin exactly,
        /// wrapping included, at sizes covering the vector tails.
        #[test]
        fn dispatched_equals_scalar_twin(
            m in 1usize..6,
            k in 1usize..9,
            n in 1usize..40,
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut rnd = || super::super::xorshift(&mut s) as i32;
            let a: Vec<i32> = (0..m * k).map(|i| if i % 5 == 0 { 0 } else { rnd() }).collect();
            let b: Vec<i32> = (0..k * n).map(|_| rnd()).collect();
            let c0: Vec<i32> = (0..m * n).map(|_| rnd()).collect();
            let (mut got, mut want) = (c0.clone(), c0);
            igemm(m, k, n, &a, &b, &mut got);
            igemm_scalar(m, k, n, &a, &b, &mut want);
            prop_assert_eq!(got, want);
        }

        /// The dispatched dot product equals its scalar twin and the definition, for u8 and
        /// i8 rows at lengths covering the 8-lane tail.
        #[test]
        fn dot_equals_scalar_twin(k in 0usize..70, zp in 0i32..256, seed in any::<u64>()) {
            let mut s = seed | 1;
            let mut rnd = || super::super::xorshift(&mut s);
            let au: Vec<u8> = (0..k).map(|_| rnd() as u8).collect();
            let ai: Vec<i8> = au.iter().map(|&v| v as i8).collect();
            let b: Vec<i32> = (0..k).map(|_| (rnd() % 511) as i32 - 255).collect();
            let want_u: i32 = au.iter().zip(&b).map(|(&x, &y)| (x as i32 - zp) * y).sum();
            prop_assert_eq!(dot(&au, zp, &b), want_u);
            prop_assert_eq!(dot_scalar(&au, zp, &b), want_u);
            let zi = zp - 128;
            let want_i: i32 = ai.iter().zip(&b).map(|(&x, &y)| (x as i32 - zi) * y).sum();
            prop_assert_eq!(dot(&ai, zi, &b), want_i);
            prop_assert_eq!(dot_scalar(&ai, zi, &b), want_i);
        }

        /// The VNNI byte dot product (where the CPU has it) equals its scalar twin and the
        /// definition, at lengths covering the 128- and 64-byte steps and the masked tail,
        /// with extreme bytes (255 x -128) that exercise the lane sums.
        #[test]
        fn dot_u8_i8_equals_scalar_twin(k in 0usize..400, extreme in any::<bool>(), seed in any::<u64>()) {
            let mut s = seed | 1;
            let mut rnd = || super::super::xorshift(&mut s);
            let a: Vec<u8> = (0..k).map(|_| if extreme { 255 } else { rnd() as u8 }).collect();
            let b: Vec<i8> = (0..k).map(|_| if extreme { -128 } else { rnd() as i8 }).collect();
            let want: i32 = a.iter().zip(&b).map(|(&x, &y)| x as i32 * y as i32).sum();
            prop_assert_eq!(dot_u8_i8(&a, &b), want);
            prop_assert_eq!(dot_u8_i8_scalar(&a, &b), want);
        }
    }
}
