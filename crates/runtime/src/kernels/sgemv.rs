//! f32 matrix-vector product against row-major weight rows: `dst[j] (+)= dot(a, w[j])`.
//!
//! What a recurrent cell does at every timestep with batch 1 (`h · Rᵀ`, ONNX's `R` is `[n, k]`
//! row-major, so each output is one contiguous dot product). A general GEMM packs the weight
//! on every call for a single row: on the romanizer's GRUs (R 384 x 128, 36 steps per layer)
//! the `gemm` crate's packing and dispatch took more time than the products.
//!
//! Four rows at a time, 16 lanes each, partial sums in a fixed lane order then a fixed
//! pairwise reduction: safe Rust compiled for the baseline, AVX2+FMA and AVX-512F, chosen at
//! run time. Products and sums are separate operations (Rust does not contract them), so the
//! SIMD copies are bit-identical to the scalar twin.

const L: usize = 16;
const ROWS: usize = 4;

/// `dst[j] = (dst[j] if accumulate else 0) + Σ_p a[p] * w[j * k + p]` for `j < dst.len()`,
/// `p < k`. Returns `false`, computing nothing, when `a` is shorter than `k` or `w` than
/// `dst.len() * k`.
#[must_use]
pub fn dot_rows(a: &[f32], w: &[f32], k: usize, dst: &mut [f32], accumulate: bool) -> bool {
    if a.len() < k || dst.len().checked_mul(k).is_none_or(|n| w.len() < n) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let isa = npuc_isa::Isa::detect();
        if isa.has_avx512() {
            // SAFETY: the ISA module detected AVX-512F (with AVX2 and FMA) on this CPU (capped
            // by NPUC_ISA); the body is safe Rust over slices checked above.
            unsafe { dot_rows_avx512(a, w, k, dst, accumulate) };
            return true;
        }
        if isa.has_avx2() {
            // SAFETY: the ISA module detected AVX2 and FMA on this CPU (capped by NPUC_ISA);
            // the body is safe Rust over slices checked above.
            unsafe { dot_rows_avx2(a, w, k, dst, accumulate) };
            return true;
        }
    }
    body(a, w, k, dst, accumulate);
    true
}

/// The scalar twin of the dispatched copies.
#[must_use]
pub fn dot_rows_scalar(a: &[f32], w: &[f32], k: usize, dst: &mut [f32], accumulate: bool) -> bool {
    if a.len() < k || dst.len().checked_mul(k).is_none_or(|n| w.len() < n) {
        return false;
    }
    body(a, w, k, dst, accumulate);
    true
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows_avx2(a: &[f32], w: &[f32], k: usize, dst: &mut [f32], accumulate: bool) {
    body(a, w, k, dst, accumulate)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot_rows_avx512(a: &[f32], w: &[f32], k: usize, dst: &mut [f32], accumulate: bool) {
    body(a, w, k, dst, accumulate)
}

/// Sum of 16 lanes in a fixed pairwise order.
#[inline(always)]
fn reduce(v: [f32; L]) -> f32 {
    let mut h = [0f32; 8];
    for i in 0..8 {
        h[i] = v[i] + v[i + 8];
    }
    let q = [h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

#[inline(always)]
fn body(a: &[f32], w: &[f32], k: usize, dst: &mut [f32], accumulate: bool) {
    let a = &a[..k];
    let full = k / L * L;
    let (a_main, a_tail) = a.split_at(full);
    let finish = |d: &mut f32, s: f32| *d = if accumulate { *d + s } else { s };
    let mut rows = dst.chunks_exact_mut(ROWS);
    let mut j = 0;
    // Four weight rows in lockstep over fixed 16-lane chunks (iterators and array refs, so the
    // loop has no bounds checks and vectorizes).
    let chunk = |v: &[f32]| -> [f32; L] { std::array::from_fn(|l| v[l]) };
    for d in &mut rows {
        let w0 = &w[j * k..][..k];
        let w1 = &w[(j + 1) * k..][..k];
        let w2 = &w[(j + 2) * k..][..k];
        let w3 = &w[(j + 3) * k..][..k];
        let (mut s0, mut s1, mut s2, mut s3) = ([0f32; L], [0f32; L], [0f32; L], [0f32; L]);
        for ((((av, x0), x1), x2), x3) in a_main
            .chunks_exact(L)
            .zip(w0.chunks_exact(L))
            .zip(w1.chunks_exact(L))
            .zip(w2.chunks_exact(L))
            .zip(w3.chunks_exact(L))
        {
            let (av, x0, x1, x2, x3) = (chunk(av), chunk(x0), chunk(x1), chunk(x2), chunk(x3));
            for l in 0..L {
                s0[l] += av[l] * x0[l];
                s1[l] += av[l] * x1[l];
                s2[l] += av[l] * x2[l];
                s3[l] += av[l] * x3[l];
            }
        }
        for (r, (acc, wr)) in [(s0, w0), (s1, w1), (s2, w2), (s3, w3)]
            .into_iter()
            .enumerate()
        {
            let mut s = reduce(acc);
            for (&x, &y) in a_tail.iter().zip(&wr[full..]) {
                s += x * y;
            }
            finish(&mut d[r], s);
        }
        j += ROWS;
    }
    for d in rows.into_remainder() {
        let wr = &w[j * k..][..k];
        let mut acc = [0f32; L];
        for (av, wv) in a_main.chunks_exact(L).zip(wr.chunks_exact(L)) {
            let (av, wv) = (chunk(av), chunk(wv));
            for l in 0..L {
                acc[l] += av[l] * wv[l];
            }
        }
        let mut s = reduce(acc);
        for (&x, &y) in a_tail.iter().zip(&wr[full..]) {
            s += x * y;
        }
        finish(d, s);
        j += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The dispatched copy equals the scalar twin bit for bit, and both stay within f32
        /// summation error of an f64 dot product: k <= 300 products in [-1, 1] and partial
        /// sums below ~20 in magnitude, so at most ~300 roundings of 20 * 6e-8 = 3.6e-4.
        #[test]
        fn dispatched_equals_twin_and_f64(
            n in 0usize..11, k in 0usize..300, accumulate in any::<bool>(), seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut rnd = || (super::super::xorshift(&mut s) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            let a: Vec<f32> = (0..k).map(|_| rnd()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
            let init: Vec<f32> = (0..n).map(|_| rnd()).collect();
            let (mut got, mut twin) = (init.clone(), init.clone());
            prop_assert!(dot_rows(&a, &w, k, &mut got, accumulate));
            prop_assert!(dot_rows_scalar(&a, &w, k, &mut twin, accumulate));
            for j in 0..n {
                prop_assert_eq!(got[j].to_bits(), twin[j].to_bits(), "row {}", j);
                let want = (0..k).map(|p| a[p] as f64 * w[j * k + p] as f64).sum::<f64>()
                    + if accumulate { init[j] as f64 } else { 0.0 };
                prop_assert!((got[j] as f64 - want).abs() <= 4e-4, "row {}: {} vs {}", j, got[j], want);
            }
        }
    }

    #[test]
    fn short_operands_are_refused() {
        let mut d = [0f32; 3];
        assert!(!dot_rows(&[1.0; 4], &[1.0; 11], 4, &mut d, false));
        assert!(!dot_rows(&[1.0; 3], &[1.0; 12], 4, &mut d, false));
        assert!(dot_rows(&[1.0; 4], &[1.0; 12], 4, &mut d, false));
        assert_eq!(d, [4.0; 3]);
    }
}
