//! The plain i32 matrix product of the general integer ops (MatMulInteger, ConvInteger) and
//! the dot product of a narrow MatMulInteger, compiled twice: for the baseline target, where SSE2 has
//! no 32-bit lane multiply and the loop runs mostly scalar, and with AVX2 (`vpmulld`, 8 lanes),
//! picked at run time by `npuc-isa`. Integer wrapping arithmetic is exact, so the two copies give
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
    }
}
