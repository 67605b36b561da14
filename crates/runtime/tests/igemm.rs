//! The integer GEMM kernels (`npuc_runtime::kernels::igemm`): every kernel the host can run
//! (AVX-512 VNNI quads, AVX2 pairs) against its scalar twin and an i64 reference, in both
//! packed layouts and their mixes, on random shapes with 1 and 2 threads. Operands come in two
//! kinds: 8-bit data minus zero points (what quantized models feed; fits the quads layout) and
//! values spread over the whole corrected range [-256, 255] (wider than 256 values per row, so
//! the quads packers fall back to pairs). Integer sums are exact, so every kernel must be
//! bit-identical.

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

/// The levels this process may run, lowest first.
fn levels() -> Vec<Isa> {
    Isa::ALL
        .into_iter()
        .filter(|&l| l <= Isa::detect())
        .collect()
}

/// A recycled buffer full of stale values from a larger, unrelated packing.
fn stale_buffer(layout: Layout, m: usize, k: usize) -> PackBuf {
    let (m2, k2) = (m + 13, k + 7);
    let junk: Vec<i16> = (0..m2 * k2).map(|i| (i % 200) as i16 - 77).collect();
    PackedA::pack_rows_as(layout, PackBuf::default(), m2, k2, &junk, |v| v).into_buffer()
}

fn check(m: usize, n: usize, k: usize, a: Vec<i16>, b: Vec<i16>, threads: usize) {
    let want = reference(m, n, k, &a, &b);
    let layouts = [Layout::Pairs, Layout::Quads];
    for la in layouts {
        // Every packer of A: element-wise, row slices, a stale recycled buffer, the gather path.
        let mut pas = vec![
            PackedA::pack_with_as(la, PackBuf::default(), m, k, |r, row| {
                for (c, d) in row.iter_mut().enumerate() {
                    *d = a[r * k + c];
                }
            }),
            PackedA::pack_rows_as(la, PackBuf::default(), m, k, &a, |v| v),
            PackedA::pack_rows_as(la, stale_buffer(la, m, k), m, k, &a, |v| v),
            PackedA::pack_with_as(la, stale_buffer(la, m, k), m, k, |r, row| {
                row.copy_from_slice(&a[r * k..(r + 1) * k])
            }),
        ];
        // The byte packer (quads only), when the whole operand spans one byte: `u = a + off`
        // with one offset, as 8-bit codes with their zero point are.
        let (lo, hi) = (a.iter().copied().min(), a.iter().copied().max());
        if let (Layout::Quads, Some(lo), Some(hi)) = (la, lo, hi) {
            if hi as i32 - lo as i32 <= 255 {
                let off = -(lo as i32);
                pas.push(PackedA::pack_bytes_with(
                    stale_buffer(la, m, k),
                    m,
                    k,
                    off,
                    |r, row| {
                        for (d, &v) in row.iter_mut().zip(&a[r * k..(r + 1) * k]) {
                            *d = (v as i32 + off) as u8;
                        }
                    },
                ));
            }
        }
        for lb in layouts {
            let pbs = [
                PackedB::pack_as(lb, k, n, |r, c| b[r * n + c]),
                PackedB::pack_rows_as(lb, k, n, &b, |v| v),
            ];
            for isa in levels() {
                for (i, pa) in pas.iter().enumerate() {
                    for (j, pb) in pbs.iter().enumerate() {
                        let mut c = vec![i32::MIN; m * n];
                        igemm_with(isa, pa, pb, &mut c, threads).unwrap();
                        let got: Vec<i64> = c.iter().map(|&v| v as i64).collect();
                        assert_eq!(
                            got, want,
                            "{isa:?}, A {la:?} packer {i} ({:?}), B {lb:?} packer {j} ({:?}), {threads} threads",
                            pa.layout(), pb.layout()
                        );
                    }
                }
                // The fused epilogue sees every row exactly once, with the same sums.
                let mut c5 = vec![0i32; m * n];
                let mut seen = vec![0i64; m * n];
                let epi = |s: &[i32], o: &mut [i64]| {
                    assert_eq!(s.len(), o.len());
                    for (x, &v) in o.iter_mut().zip(s) {
                        *x += v as i64 + 1_000_000_000_000;
                    }
                };
                igemm_with_then(isa, &pas[1], &pbs[0], &mut c5, &mut seen, threads, &epi).unwrap();
                let want1: Vec<i64> = want.iter().map(|v| v + 1_000_000_000_000).collect();
                assert_eq!(
                    seen, want1,
                    "epilogue rows ({isa:?}, {la:?} x {lb:?}, {threads} threads)"
                );
            }
        }
    }
}

/// Values a zero-point-corrected operand can take, spread over [-256, 255] and biased towards
/// the extremes.
fn wide_operand() -> impl Strategy<Value = i16> {
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

/// An 8-bit value (u8 or i8 by `signed`), biased towards the extremes.
fn byte(signed: bool) -> impl Strategy<Value = i16> {
    let (lo, hi) = if signed { (-128i16, 127i16) } else { (0, 255) };
    prop_oneof![
        Just(lo),
        Just(hi),
        Just(lo + 1),
        Just(0i16.clamp(lo, hi)),
        lo..=hi
    ]
}

/// `m x k` activations and `k x n` weights as 8-bit data minus zero points: A one dtype and
/// zero point, B per-column zero points (as per-channel quantization writes them).
#[allow(clippy::type_complexity)]
fn eight_bit(m: usize, n: usize, k: usize) -> impl Strategy<Value = (Vec<i16>, Vec<i16>)> {
    (any::<bool>(), any::<bool>()).prop_flat_map(move |(sa, sb)| {
        let za = if sa { -128i16..=127 } else { 0i16..=255 };
        let zb = if sb { -128i16..=127 } else { 0i16..=255 };
        (
            proptest::collection::vec(byte(sa), m * k),
            za,
            proptest::collection::vec(byte(sb), k * n),
            proptest::collection::vec(prop_oneof![Just(0i16), zb], n),
        )
            .prop_map(move |(a, za, b, zb)| {
                let a = a.into_iter().map(|v| v - za).collect();
                let b = b
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| v - zb[i % n])
                    .collect();
                (a, b)
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn kernels_match_scalar_and_reference_wide_operands(
        (m, n, k, a, b, threads) in (1usize..20, 1usize..60, 0usize..70, 1usize..3)
            .prop_flat_map(|(m, n, k, t)| (
                Just(m), Just(n), Just(k),
                proptest::collection::vec(wide_operand(), m * k),
                proptest::collection::vec(wide_operand(), k * n),
                Just(t),
            ))
    ) {
        check(m, n, k, a, b, threads);
    }

    #[test]
    fn kernels_match_scalar_and_reference_8bit_operands(
        (m, n, k, (a, b), threads) in (1usize..26, 1usize..110, 0usize..70, 1usize..3)
            .prop_flat_map(|(m, n, k, t)| (Just(m), Just(n), Just(k), eight_bit(m, n, k), Just(t)))
    ) {
        // 8-bit data always fits the quads layout.
        let pa = PackedA::pack_rows_as(Layout::Quads, PackBuf::default(), m, k, &a, |v| v);
        let pb = PackedB::pack_rows_as(Layout::Quads, k, n, &b, |v| v);
        prop_assert_eq!(pa.layout(), Layout::Quads);
        prop_assert_eq!(pb.layout(), Layout::Quads);
        check(m, n, k, a, b, threads);
    }
}

#[test]
fn packers_follow_the_active_level() {
    let pa = PackedA::pack(3, 5, |r, c| (r * 5 + c) as i16);
    let pb = PackedB::pack(5, 2, |r, c| (r + c) as i16);
    let want = Layout::for_isa(Isa::detect());
    assert_eq!((pa.layout(), pb.layout()), (want, want));
    assert_eq!(
        want == Layout::Quads,
        Isa::detect().has_avx512() && npuc_isa::host_has("avx512vnni")
    );
}

#[test]
fn a_row_too_wide_for_quads_falls_back_to_pairs_mid_packing() {
    // Rows 0-8 fit a byte (8-bit data), row 9 spans 511 values: the gather packer has already
    // written nine quads rows and must unpack them (each row filled once) into pairs.
    let (m, n, k) = (14, 50, 9);
    let mut a: Vec<i16> = (0..m * k).map(|i| (i * 37 % 256) as i16 - 100).collect();
    a[9 * k] = -256;
    a[9 * k + 1] = 255;
    let b: Vec<i16> = (0..k * n).map(|i| (i * 101 % 256) as i16 - 128).collect();
    let mut filled = vec![0; m];
    let pa = PackedA::pack_with_as(Layout::Quads, PackBuf::default(), m, k, |r, row| {
        filled[r] += 1;
        row.copy_from_slice(&a[r * k..(r + 1) * k]);
    });
    assert_eq!(filled, vec![1; m], "every row filled exactly once");
    assert_eq!(pa.layout(), Layout::Pairs);
    let pb = PackedB::pack_as(Layout::Quads, k, n, |r, c| b[r * n + c]);
    assert_eq!(pb.layout(), Layout::Quads);
    let want = reference(m, n, k, &a, &b);
    for isa in levels() {
        let mut c = vec![0i32; m * n];
        igemm_with(isa, &pa, &pb, &mut c, 1).unwrap();
        assert_eq!(
            c.iter().map(|&v| v as i64).collect::<Vec<_>>(),
            want,
            "{isa:?}"
        );
    }
    // The buffers it returns pack the next operand correctly (in quads again).
    let a8: Vec<i16> = (0..m * k).map(|i| (i * 13 % 256) as i16 - 128).collect();
    let pa2 = PackedA::pack_rows_as(Layout::Quads, pa.into_buffer(), m, k, &a8, |v| v);
    assert_eq!(pa2.layout(), Layout::Quads);
    let mut c = vec![0i32; m * n];
    igemm_with(Isa::Scalar, &pa2, &pb, &mut c, 1).unwrap();
    let want = reference(m, n, k, &a8, &b);
    assert_eq!(c.iter().map(|&v| v as i64).collect::<Vec<_>>(), want);
    check(m, n, k, a, b, 2);
}

#[test]
fn epilogue_chunks_cover_wide_products() {
    // Wide enough that the epilogue's sums are handed over in several row chunks.
    let (m, n, k) = (61, 2900, 5);
    let a: Vec<i16> = (0..m * k).map(|i| (i * 37 % 511) as i16 - 256).collect();
    let b: Vec<i16> = (0..k * n).map(|i| (i * 101 % 511) as i16 - 255).collect();
    check(m, n, k, a.clone(), b.clone(), 1);
    check(m, n, k, a, b, 2);
    // The same shape in 8-bit data (quads).
    let a: Vec<i16> = (0..m * k).map(|i| (i * 37 % 256) as i16 - 3).collect();
    let b: Vec<i16> = (0..k * n).map(|i| (i * 101 % 256) as i16 - 128).collect();
    check(m, n, k, a, b, 2);
}

#[test]
fn extreme_values_long_reduction_stay_exact() {
    // Every term +-65025 or -65280: sums far beyond i16 and near 2^28 must not wrap.
    let (m, n, k) = (7, 17, 4001);
    check(m, n, k, vec![-255; m * k], vec![255; k * n], 2);
    check(m, n, k, vec![255; m * k], vec![255; k * n], 1);
    check(m, n, k, vec![-255; m * k], vec![-128; k * n], 1);
    check(3, 5, MAX_K, vec![-256; 3 * MAX_K], vec![255; MAX_K * 5], 1);
    // The largest 8-bit terms at the longest reduction: u8 255 x i8 -128 with zero points 0
    // and 255 (quads, with offsets), sums near -2^31.
    check(
        3,
        49,
        MAX_K,
        vec![-255; 3 * MAX_K],
        vec![255; MAX_K * 49],
        1,
    );
    check(
        9,
        49,
        MAX_K,
        vec![255; 9 * MAX_K],
        vec![-128; MAX_K * 49],
        2,
    );
}

#[test]
fn mismatched_shapes_are_errors() {
    for layout in [Layout::Pairs, Layout::Quads] {
        let pa = PackedA::pack_rows_as(layout, PackBuf::default(), 2, 3, &[1i16; 6], |v| v);
        let pb = PackedB::pack_as(layout, 4, 2, |_, _| 1);
        let mut c = vec![0; 4];
        assert!(igemm(&pa, &pb, &mut c, 1).is_err());
        let pb = PackedB::pack_as(layout, 3, 2, |_, _| 1);
        let mut small = vec![0; 3];
        assert!(igemm(&pa, &pb, &mut small, 1).is_err());
    }
}

#[test]
fn kernels_above_the_active_level_are_refused() {
    let pa = PackedA::pack(2, 3, |_, _| 1);
    let pb = PackedB::pack(3, 2, |_, _| 1);
    let mut c = vec![0; 4];
    for isa in Isa::ALL.into_iter().filter(|&l| l > Isa::detect()) {
        let e = igemm_with(isa, &pa, &pb, &mut c, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("above the active level"), "{e}");
    }
}

#[test]
fn many_row_chunks_match_reference() {
    // Packed A of 300 x 1000 spans several L2-sized row chunks (the chunked loop order),
    // with 1 and 2 threads (thread groups split mid-chunk).
    let (m, n, k) = (300, 40, 1000);
    let mut s = 1u32;
    let mut next = |span: u32| {
        s = s.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        ((s >> 16) % span) as i16
    };
    let a: Vec<i16> = (0..m * k).map(|_| next(512) - 256).collect();
    let b: Vec<i16> = (0..k * n).map(|_| next(512) - 256).collect();
    check(m, n, k, a, b, 2);
    let a: Vec<i16> = (0..m * k).map(|_| next(256) - 17).collect();
    let b: Vec<i16> = (0..k * n).map(|_| next(256) - 128).collect();
    check(m, n, k, a.clone(), b.clone(), 1);
    check(m, n, k, a, b, 2);
}

/// The tests above compare the kernels of every level up to the one this process runs at (the
/// best the host has, unless `NPUC_ISA` caps it) with their scalar twins, and the packers of
/// the active level (`packers_follow_the_active_level`). Run without `NPUC_ISA`, this test
/// re-runs the whole file in child processes at every lower level the host has (`avx2`,
/// `scalar`), so one `cargo test` exercises the dispatch at each level as production runs it.
#[test]
fn kernels_equal_twins_at_every_isa_level_the_host_has() {
    if std::env::var_os(npuc_isa::ENV).is_some() {
        return; // a child (or a run already pinned to one level): the level under test.
    }
    eprintln!(
        "this process: level {} (VNNI quads {})",
        Isa::detect().name(),
        if Isa::detect().has_avx512_vnni() {
            "on"
        } else {
            "off"
        }
    );
    let exe = std::env::current_exe().expect("the test binary's path");
    for level in Isa::ALL.into_iter().filter(|&l| l < Isa::detect()) {
        let out = std::process::Command::new(&exe)
            .env(npuc_isa::ENV, level.name())
            .args(["--skip", "kernels_equal_twins_at_every_isa_level"])
            .output()
            .expect("re-running the test binary");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "igemm tests at NPUC_ISA={} failed:\n{text}\n{}",
            level.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("test result: ok. 10 passed"),
            "NPUC_ISA={}: expected 10 tests to pass in:\n{text}",
            level.name()
        );
        eprintln!("NPUC_ISA={}: igemm tests passed", level.name());
    }
}

/// The activation packer split across threads by column panels gives the same products as
/// the one-thread packer, in both layouts, for an operand large enough to split (and one
/// column whose values span more than a byte, which sends quads to the pairs fallback).
#[test]
fn panel_parallel_packing_equals_serial() {
    let (m, n, k) = (7, 1000, 70);
    let a: Vec<i16> = (0..m * k).map(|i| (i * 37 % 256) as i16 - 100).collect();
    let mut b: Vec<i16> = (0..k * n).map(|i| (i * 101 % 256) as i16 - 128).collect();
    for wide in [false, true] {
        if wide {
            b[5 * n + 321] = 255;
            b[6 * n + 321] = -256;
        }
        for layout in [Layout::Pairs, Layout::Quads] {
            let pa = PackedA::pack_rows_as(layout, PackBuf::default(), m, k, &a, |v| v);
            let serial = PackedB::pack_rows_as(layout, k, n, &b, |v| v);
            let par = PackedB::pack_rows_par(layout, k, n, &b, |v| v, 2);
            assert_eq!(serial.layout(), par.layout(), "{layout:?} wide {wide}");
            let (mut c1, mut c2) = (vec![0i32; m * n], vec![0i32; m * n]);
            igemm(&pa, &serial, &mut c1, 1).unwrap();
            igemm(&pa, &par, &mut c2, 1).unwrap();
            assert_eq!(c1, c2, "{layout:?} wide {wide}");
            let want = reference(m, n, k, &a, &b);
            assert!(
                c1.iter().zip(&want).all(|(&c, &w)| c as i64 == w),
                "{layout:?} wide {wide}"
            );
        }
    }
}
