//! The plain i32 matrix product of the integer ops (MatMulInteger, ConvInteger,
//! DynamicQuantizeLSTM's projections), compiled twice: for the baseline target, where SSE2 has
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
    }
}
