//! The integer GEMM kernels (`npuc_runtime::kernels::igemm`): the AVX2 micro-kernel against
//! its scalar twin and an i64 reference, on random shapes and values biased to the extremes of
//! zero-point-corrected 8-bit operands ([-256, 255]), with 1 and 2 threads.

use npuc_runtime::kernels::igemm::*;
use proptest::prelude::*;

/// Plain i64 reference of the zero-point-corrected product.
fn reference(m: usize, n: usize, k: usize, a: &[i16], b: &[i16]) -> Vec<i64> {
    let mut c = vec![0i64; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| a[i * k + p] as i64 * b[p * n + j] as i64)
                .sum();
        }
    }
    c
}

fn check(m: usize, n: usize, k: usize, a: Vec<i16>, b: Vec<i16>, threads: usize) {
    let pa = PackedA::pack(m, k, |r, c| a[r * k + c]);
    let pa2 = PackedA::pack_rows(m, k, &a, |v| v);
    let pb = PackedB::pack(k, n, |r, c| b[r * n + c]);
    let want = reference(m, n, k, &a, &b);
    let mut cs = vec![0i32; m * n];
    igemm_with(Isa::Scalar, &pa, &pb, &mut cs, threads).unwrap();
    assert_eq!(cs.iter().map(|&v| v as i64).collect::<Vec<_>>(), want);
    let mut c2 = vec![0i32; m * n];
    igemm_with(Isa::Scalar, &pa2, &pb, &mut c2, threads).unwrap();
    assert_eq!(c2, cs, "pack_rows and pack disagree");
    // A recycled buffer full of stale values must pack exactly like a fresh one (padding
    // rows and the odd-k pad column are rewritten, not assumed zero).
    let stale = vec![-77i16; (m + 13) * (k + 3)];
    let pa3 = PackedA::pack_rows_in(stale, m, k, &a, |v| v);
    let mut c4 = vec![0i32; m * n];
    igemm_with(Isa::Scalar, &pa3, &pb, &mut c4, threads).unwrap();
    assert_eq!(c4, cs, "pack_rows_in on a stale buffer disagrees");
    let pb2 = PackedB::pack_rows(k, n, &b, |v| v);
    let mut c3 = vec![0i32; m * n];
    igemm_with(Isa::Scalar, &pa, &pb2, &mut c3, threads).unwrap();
    assert_eq!(c3, cs, "PackedB::pack_rows and pack disagree");
    // The fused epilogue sees every row exactly once, with the same sums.
    for isa in [Isa::Scalar, Isa::detect()] {
        let mut c5 = vec![0i32; m * n];
        let mut seen = vec![0i64; m * n];
        let epi = |s: &[i32], o: &mut [i64]| {
            assert_eq!(s.len(), o.len());
            for (x, &v) in o.iter_mut().zip(s) {
                *x += v as i64 + 1_000_000_000_000;
            }
        };
        igemm_with_then(isa, &pa, &pb, &mut c5, &mut seen, threads, &epi).unwrap();
        let want1: Vec<i64> = want.iter().map(|v| v + 1_000_000_000_000).collect();
        assert_eq!(seen, want1, "epilogue rows ({isa:?}, {threads} threads)");
    }
    if Isa::detect().has_avx2() {
        let mut cv = vec![0i32; m * n];
        igemm_with(Isa::Avx2, &pa, &pb, &mut cv, threads).unwrap();
        assert_eq!(cv, cs);
    }
}

/// Values a zero-point-corrected 8-bit operand can take, biased towards the extremes.
fn operand() -> impl Strategy<Value = i16> {
    prop_oneof![
        Just(-256i16),
        Just(-255i16),
        Just(255i16),
        Just(-128i16),
        Just(127i16),
        Just(0i16),
        -256i16..=255
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn avx2_matches_scalar_and_reference(
        (m, n, k, a, b, threads) in (1usize..20, 1usize..40, 0usize..70, 1usize..3)
            .prop_flat_map(|(m, n, k, t)| (
                Just(m), Just(n), Just(k),
                proptest::collection::vec(operand(), m * k),
                proptest::collection::vec(operand(), k * n),
                Just(t),
            ))
    ) {
        check(m, n, k, a, b, threads);
    }
}

#[test]
fn epilogue_chunks_cover_wide_products() {
    // Wide enough that the epilogue's sums are handed over in several row chunks.
    let (m, n, k) = (61, 2900, 5);
    let a: Vec<i16> = (0..m * k).map(|i| (i * 37 % 511) as i16 - 256).collect();
    let b: Vec<i16> = (0..k * n).map(|i| (i * 101 % 511) as i16 - 255).collect();
    check(m, n, k, a.clone(), b.clone(), 1);
    check(m, n, k, a, b, 2);
}

#[test]
fn extreme_values_long_reduction_stay_exact() {
    // Every term +-65025 or -65280: sums far beyond i16 and near 2^28 must not wrap.
    let (m, n, k) = (7, 17, 4001);
    check(m, n, k, vec![-255; m * k], vec![255; k * n], 2);
    check(m, n, k, vec![255; m * k], vec![255; k * n], 1);
    check(3, 5, MAX_K, vec![-256; 3 * MAX_K], vec![255; MAX_K * 5], 1);
}

#[test]
fn mismatched_shapes_are_errors() {
    let pa = PackedA::pack(2, 3, |_, _| 1);
    let pb = PackedB::pack(4, 2, |_, _| 1);
    let mut c = vec![0; 4];
    assert!(igemm(&pa, &pb, &mut c, 1).is_err());
    let pb = PackedB::pack(3, 2, |_, _| 1);
    let mut small = vec![0; 3];
    assert!(igemm(&pa, &pb, &mut small, 1).is_err());
}

#[test]
fn many_row_chunks_match_reference() {
    // Packed A of 300 x 1000 i16 spans several L2-sized row chunks (the chunked loop order),
    // with 1 and 2 threads (thread groups split mid-chunk).
    let (m, n, k) = (300, 40, 1000);
    let mut s = 1u32;
    let mut next = || {
        s = s.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        ((s >> 16) % 512) as i16 - 256
    };
    let a: Vec<i16> = (0..m * k).map(|_| next()).collect();
    let b: Vec<i16> = (0..k * n).map(|_| next()).collect();
    check(m, n, k, a.clone(), b.clone(), 1);
    check(m, n, k, a, b, 2);
}
