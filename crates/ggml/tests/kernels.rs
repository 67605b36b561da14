//! Kernel properties: SIMD dot products equal their scalar twins (integer parts exactly, f32
//! sums to ~1e-6), integer dot products equal f64 dot products of the dequantized operands,
//! the reference quantizers match gguf-py bit for bit, and matmul's modes and thread counts
//! agree.

mod common;

use common::{read_npy_f32, root};
use npuc_ggml::*;
use proptest::prelude::*;

/// Types with a `vec_dot` and where their f16 scale fields live (byte offsets in a block).
fn scale_fields(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL => &[0],
        Q4_1 | Q5_1 => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q4_K | Q5_K => &[0, 2],
        Q6_K => &[208],
        _ => &[],
    }
}

const DOT_TYPES: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::IQ4_NL,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
];

/// A random but well-formed weight row of `nb` blocks: random quant bytes, finite scales.
fn weight_row(ty: GgmlType, nb: usize, seed: &[u8], scales: &[f32]) -> (usize, Vec<u8>) {
    let k = nb * ty.block_size();
    let rb = ty.row_bytes(k).unwrap();
    let mut w: Vec<u8> = (0..rb)
        .map(|i| seed[i % seed.len()].wrapping_mul(31).wrapping_add(i as u8))
        .collect();
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let vals: Vec<f32> = (0..k).map(|i| scales[i % scales.len()] * 100.0).collect();
            quantize_row(ty, &vals, &mut w).unwrap();
        }
        _ => {
            let ts = ty.type_size();
            for (b, blk) in w.chunks_exact_mut(ts).enumerate() {
                for (f, &at) in scale_fields(ty).iter().enumerate() {
                    let v = scales[(b * 2 + f) % scales.len()];
                    blk[at..at + 2]
                        .copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
                }
                if ty == GgmlType::Q8_0 {
                    // ggml's quantizers never produce -128 (its AVX2 kernel would saturate on it).
                    for q in &mut blk[2..] {
                        if *q == 0x80 {
                            *q = 0x81;
                        }
                    }
                }
            }
        }
    }
    (k, w)
}

/// `n` weight rows: `w0` and byte-rotated copies of its blocks with the scale fields kept.
fn rotated_rows(ty: GgmlType, w0: &[u8], n: usize) -> Vec<u8> {
    let ts = ty.type_size();
    let mut w = Vec::new();
    for i in 0..n {
        let mut v = w0.to_vec();
        for blk in v.chunks_exact_mut(ts) {
            let keep: Vec<(usize, [u8; 2])> = scale_fields(ty)
                .iter()
                .map(|&a| (a, [blk[a], blk[a + 1]]))
                .collect();
            blk.rotate_left(i % ts);
            for (a, b) in keep {
                blk[a..a + 2].copy_from_slice(&b);
            }
        }
        w.extend_from_slice(&v);
    }
    w
}

fn f64_dot(a: &[f32], b: &[f32]) -> (f64, f64) {
    let s = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let m = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 * y as f64).abs())
        .sum();
    (s, m)
}

fn all_types() -> Vec<GgmlType> {
    let mut v = DOT_TYPES.to_vec();
    v.push(GgmlType::Q6_K);
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn simd_equals_scalar_and_dequantized_reference(
        ti in 0usize..14,
        nb in 1usize..5,
        seed in prop::collection::vec(any::<u8>(), 1..64),
        scales in prop::collection::vec(-0.05f32..0.05, 1..16),
        x in prop::collection::vec(-4.0f32..4.0, 1..64),
    ) {
        let ty = all_types()[ti];
        let nb = if ty.block_size() == 1 { nb * 37 } else { nb };
        let (k, w) = weight_row(ty, nb, &seed, &scales);
        let xs: Vec<f32> = (0..k).map(|i| x[i % x.len()] * (1.0 + (i % 7) as f32 * 0.1)).collect();
        let vt = vec_dot_type(ty).unwrap();
        let mut xq = vec![0u8; vt.row_bytes(k).unwrap()];
        quantize_row(vt, &xs, &mut xq).unwrap();
        let fast = vec_dot(ty, &w, &xq, k).unwrap();
        let slow = vec_dot_scalar(ty, &w, &xq, k).unwrap();
        let mut wd = vec![0f32; k];
        dequantize_row(ty, &w, &mut wd).unwrap();
        let mut xd = vec![0f32; k];
        dequantize_row(vt, &xq, &mut xd).unwrap();
        let (want, mut mag) = f64_dot(&wd, &xd);
        if vt == GgmlType::Q8_1 {
            // Q4_1/Q5_1 use Q8_1's `s = f16(d · Σq)` for the min term, exactly like ggml: allow
            // its f16 rounding (2^-11 relative) on top.
            let ts = ty.type_size();
            mag += w.chunks_exact(ts).zip(xq.chunks_exact(36)).map(|(a, b)| {
                let m = half::f16::from_le_bytes([a[2], a[3]]).to_f64();
                let s = half::f16::from_le_bytes([b[2], b[3]]).to_f64();
                (m * s).abs() * 1e-3 / 4e-6
            }).sum::<f64>();
        }
        prop_assert!((fast as f64 - slow as f64).abs() <= 2e-6 * mag + 1e-30,
            "{ty}: simd {fast} scalar {slow} (magnitude {mag})");
        prop_assert!((slow as f64 - want).abs() <= 4e-6 * mag + 1e-30,
            "{ty}: scalar {slow} vs f64 reference {want} (magnitude {mag})");
    }

    #[test]
    fn matmul_modes_threads_and_scalar_agree(
        ti in 0usize..14,
        n in 1usize..40,
        m in 1usize..20,
        seed in prop::collection::vec(any::<u8>(), 1..64),
        scales in prop::collection::vec(-0.05f32..0.05, 1..16),
    ) {
        let ty = all_types()[ti];
        let nb = if ty.block_size() == 1 { 64 } else { 1 };
        let (k, _) = weight_row(ty, nb, &seed, &scales);
        let mut w = Vec::new();
        for r in 0..n {
            let s: Vec<u8> = seed.iter().map(|b| b.wrapping_add(r as u8)).collect();
            w.extend(weight_row(ty, nb, &s, &scales).1);
        }
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0).collect();
        let mut wd = vec![0f32; n * k];
        dequantize_row(ty, &w, &mut wd).unwrap();
        let mut y = [vec![0f32; m * n], vec![0f32; m * n], vec![0f32; m * n], vec![0f32; m * n]];
        matmul(ty, &w, n, k, &x, m, &mut y[0], MatMulMode::ActQuant, 1).unwrap();
        matmul(ty, &w, n, k, &x, m, &mut y[1], MatMulMode::ActQuant, 2).unwrap();
        matmul_scalar(ty, &w, n, k, &x, m, &mut y[2], MatMulMode::ActQuant, 1).unwrap();
        matmul(ty, &w, n, k, &x, m, &mut y[3], MatMulMode::Exact, 2).unwrap();
        prop_assert_eq!(&y[0], &y[1]);
        if ty == GgmlType::Q6_K && m >= 8 {
            // Batches of >= 8 rows take the tiled rounding, whose integer part is order-free:
            // the AVX2 kernel equals its scalar twin bit for bit.
            prop_assert_eq!(&y[0], &y[2]);
        }
        for i in 0..m {
            for j in 0..n {
                let (want, mag) = f64_dot(&x[i * k..(i + 1) * k], &wd[j * k..(j + 1) * k]);
                let e = y[3][i * n + j] as f64;
                prop_assert!((e - want).abs() <= 2e-6 * mag + 1e-30, "{ty} exact [{i},{j}] {e} vs {want}");
                let (a, s) = (y[0][i * n + j] as f64, y[2][i * n + j] as f64);
                prop_assert!((a - s).abs() <= 2e-6 * mag + 1e-30, "{ty} simd/scalar [{i},{j}] {a} vs {s}");
                // Activation quantization error: ≤ half a step of 127 levels per block.
                prop_assert!((a - want).abs() <= 2e-2 * mag + 1e-6, "{ty} act_quant [{i},{j}] {a} vs {want}");
            }
        }
    }
}

#[test]
fn reference_quantizers_match_gguf_py() {
    let dir = root().join("tests/fixtures/llm/dequant");
    let (shape, x) = read_npy_f32(&dir.join("quant_input.npy"));
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ] {
        let (_, want) = read_npy_f32(&dir.join(format!("quant_roundtrip_{ty}.npy")));
        let mut q = vec![0u8; shape[0] * ty.row_bytes(shape[1]).unwrap()];
        quantize_row(ty, &x, &mut q).unwrap();
        let mut got = vec![0f32; x.len()];
        dequantize_row(ty, &q, &mut got).unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{ty} element {i}: ours {a}, gguf-py {b}"
            );
        }
    }
}

#[test]
fn q8_k_quantizer_follows_ggml() {
    // iscale = -127/max: the largest-magnitude value maps to -127 (sign flipped then d < 0 when
    // max > 0), bsums are the sums of 16 quants, and zero blocks are all zero.
    let mut x: Vec<f32> = (0..512).map(|i| ((i as f32) * 0.731).sin()).collect();
    x[3] = 2.0;
    for v in &mut x[256..] {
        *v = 0.0;
    }
    let mut q = vec![0u8; 2 * 292];
    quantize_row_q8_K(&x, &mut q).unwrap();
    let d = f32::from_le_bytes([q[0], q[1], q[2], q[3]]);
    assert_eq!(d, 1.0 / (-127.0f32 / 2.0));
    assert_eq!(q[4 + 3] as i8, -127);
    for j in 0..16 {
        let s: i32 = q[4 + 16 * j..4 + 16 * j + 16]
            .iter()
            .map(|&v| v as i8 as i32)
            .sum();
        assert_eq!(
            i16::from_le_bytes([q[260 + 2 * j], q[261 + 2 * j]]) as i32,
            s
        );
    }
    assert!(q[292..].iter().all(|&b| b == 0));
    let mut back = vec![0f32; 512];
    dequantize_row(GgmlType::Q8_K, &q, &mut back).unwrap();
    for (a, b) in back.iter().zip(&x) {
        assert!((a - b).abs() <= 2.0 / 127.0 * 0.5 + 1e-6, "{a} vs {b}");
    }
}

#[test]
fn bad_lengths_are_errors() {
    let mut out = vec![0f32; 48];
    let e = dequantize_row(GgmlType::Q4_0, &[0u8; 18], &mut out).unwrap_err();
    assert!(
        e.to_string()
            .contains("not a multiple of the block size 32"),
        "{e}"
    );
    let mut out = vec![0f32; 64];
    let e = dequantize_row(GgmlType::Q4_0, &[0u8; 35], &mut out).unwrap_err();
    assert!(e.to_string().contains("need 36 bytes, got 35"), "{e}");
    let e = vec_dot(GgmlType::Q4_K, &[0u8; 144], &[0u8; 291], 256).unwrap_err();
    assert!(
        e.to_string()
            .contains("Q8_K activations 292 bytes (got 291)"),
        "{e}"
    );
    let mut y = vec![0f32; 2];
    let e = matmul(
        GgmlType::Q8_0,
        &[0u8; 34],
        2,
        32,
        &[0f32; 32],
        1,
        &mut y,
        MatMulMode::ActQuant,
        1,
    )
    .unwrap_err();
    assert!(e.to_string().contains("expected 68 bytes, got 34"), "{e}");
    let e = gather_rows(GgmlType::Q8_0, &[0u8; 68], 32, &[1, 2], &mut [0f32; 64]).unwrap_err();
    assert!(
        e.to_string()
            .contains("id 2 (at index 1) is out of range for 2 rows"),
        "{e}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The attention vector kernels (AVX2 when the CPU has it) equal their scalar twins bit for
    /// bit, for any length (tails included).
    #[test]
    fn attention_vector_kernels_equal_scalar_twins(
        d in 1usize..80,
        t in 0usize..11,
        vals in prop::collection::vec(-1000f32..1000.0, 1..64),
    ) {
        let v = |i: usize| vals[i % vals.len()] * (1.0 + (i % 7) as f32 * 0.13);
        let rows: Vec<f32> = (0..t * d).map(v).collect();
        let q: Vec<f32> = (0..d).map(|i| v(i + 3) / 100.0).collect();
        let p: Vec<f32> = (0..t).map(|i| v(i + 5).abs() / 1000.0).collect();
        let (mut a, mut b) = (vec![0f32; t], vec![0f32; t]);
        dot_rows(&rows, &q, &mut a);
        dot_rows_scalar(&rows, &q, &mut b);
        prop_assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        let (mut a, mut b) = (vec![1f32; d], vec![2f32; d]);
        weighted_sum(&p, &rows, &mut a);
        weighted_sum_scalar(&p, &rows, &mut b);
        prop_assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        let (mut a, mut b) = (vec![0f32; rows.len()], vec![0f32; rows.len()]);
        round_f16_row(&rows, &mut a);
        round_f16_row_scalar(&rows, &mut b);
        prop_assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        let bits: Vec<u16> = rows.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
        let (mut a, mut b) = (vec![0f32; bits.len()], vec![0f32; bits.len()]);
        f16_to_f32_row(&bits, &mut a);
        f16_to_f32_row_scalar(&bits, &mut b);
        prop_assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        // And the dot products are dot products (f64 reference, relative to the magnitudes).
        let mut s = vec![0f32; t];
        dot_rows_scalar(&rows, &q, &mut s);
        for (ti, got) in s.iter().enumerate() {
            let (want, mag) = f64_dot(&rows[ti * d..(ti + 1) * d], &q);
            prop_assert!((*got as f64 - want).abs() <= 1e-5 * mag + 1e-30, "{} vs {}", got, want);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// The multi-row kernels of the fast path: SIMD equals the scalar twin bit for bit, a row's
    /// value does not depend on how many rows share the call, and it is the dot product (f64
    /// reference of the dequantized operands).
    #[test]
    fn multi_row_kernels_equal_scalar_twins(
        ti in 0usize..6,
        nb in 1usize..4,
        rows in 1usize..5,
        wrows in 1usize..9,
        seed in prop::collection::vec(any::<u8>(), 1..64),
        scales in prop::collection::vec(-0.05f32..0.05, 1..16),
        x in prop::collection::vec(-4.0f32..4.0, 1..64),
    ) {
        use GgmlType::*;
        let ty = [Q8_0, Q4_0, Q5_0, Q4_1, Q4_K, Q6_K][ti];
        let (k, w) = weight_row(ty, nb, &seed, &scales);
        let vt = vec_dot_type(ty).unwrap();
        let xq: Vec<Vec<u8>> = (0..rows).map(|r| {
            let xs: Vec<f32> = (0..k).map(|i| x[(i + 7 * r) % x.len()] * (1.0 + (i % 7) as f32 * 0.1)).collect();
            let mut q = vec![0u8; vt.row_bytes(k).unwrap()];
            quantize_row(vt, &xs, &mut q).unwrap();
            q
        }).collect();
        let xs: Vec<&[u8]> = xq.iter().map(|v| v.as_slice()).collect();
        // A tile of `wrows` weight rows: the row itself and byte-rotated copies (scales kept).
        let wv: Vec<Vec<u8>> = (0..wrows).map(|i| {
            let mut v = w.clone();
            let ts = ty.type_size();
            for blk in v.chunks_exact_mut(ts) {
                let keep: Vec<(usize, [u8; 2])> = scale_fields(ty).iter().map(|&a| (a, [blk[a], blk[a + 1]])).collect();
                blk.rotate_left(i % ts);
                for (a, b) in keep { blk[a..a + 2].copy_from_slice(&b); }
            }
            v
        }).collect();
        let ws: Vec<&[u8]> = wv.iter().map(|v| v.as_slice()).collect();
        let (mut simd, mut twin) = (vec![0f32; wrows * rows], vec![0f32; wrows * rows]);
        prop_assert!(vec_dot_rows(ty, &ws, &xs, k, &mut simd).unwrap());
        prop_assert!(vec_dot_rows_scalar(ty, &ws, &xs, k, &mut twin).unwrap());
        prop_assert_eq!(simd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            twin.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{}", ty);
        for r in 0..rows {
            let mut one = [0f32];
            vec_dot_rows(ty, &ws[..1], &xs[r..r + 1], k, &mut one).unwrap();
            prop_assert_eq!(one[0].to_bits(), simd[r].to_bits(), "{} row {} alone", ty, r);
            let reference = vec_dot_scalar(ty, &w, xs[r], k).unwrap();
            let mut wd = vec![0f32; k];
            dequantize_row(ty, &w, &mut wd).unwrap();
            let mut xd = vec![0f32; k];
            dequantize_row(vt, xs[r], &mut xd).unwrap();
            let (_, mag) = f64_dot(&wd, &xd);
            // Q4_1's min term uses Q8_1's f16 `s` in both kernels: same as the one-row kernel.
            prop_assert!((simd[r] as f64 - reference as f64).abs() <= 4e-6 * mag + 1e-30,
                "{}: multi-row {} vs one-row scalar {} (magnitude {})", ty, simd[r], reference, mag);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The dequantizers (AVX2 block kernels where a type has one, the scalar body compiled with
    /// AVX2 otherwise) equal their scalar twins bit for bit.
    #[test]
    fn dequantizers_equal_scalar_twins(
        ti in 0usize..DOT_TYPES.len() + 1,
        nb in 1usize..4,
        seed in prop::collection::vec(any::<u8>(), 1..64),
        scales in prop::collection::vec(-0.05f32..0.05, 1..16),
    ) {
        let ty = all_types()[ti];
        let (k, w) = weight_row(ty, nb, &seed, &scales);
        let (mut simd, mut twin) = (vec![f32::NAN; k], vec![0f32; k]);
        dequantize_row(ty, &w, &mut simd).unwrap();
        dequantize_row_scalar(ty, &w, &mut twin).unwrap();
        prop_assert_eq!(simd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            twin.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{}", ty);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The fast path's f32 products for batches (weights dequantized panel by panel, 6 x 16
    /// micro-kernel; on AVX-512 two 16-row groups per call, an odd last group alone): SIMD
    /// (AVX2 dequantization + micro-kernel) equals the scalar twins bit for bit at 1 and 2
    /// threads, over partial panels, partial row groups (1 to 4 groups) and several k-slices,
    /// and equals the f64 product of the dequantized weights and the f32 activations.
    #[test]
    fn f32_gemm_equals_scalar_twin(
        ti in 0usize..7,
        nb in 1usize..13,
        n in 1usize..40,
        m in 16usize..50,
        seed in prop::collection::vec(any::<u8>(), 1..64),
        scales in prop::collection::vec(-0.05f32..0.05, 1..16),
        x in prop::collection::vec(-4.0f32..4.0, 1..64),
    ) {
        use GgmlType::*;
        let ty = [Q8_0, Q4_0, Q5_0, Q4_1, Q4_K, Q6_K, Q5_K][ti];
        let nb = if ty.block_size() == 256 { 1 + nb % 3 } else { nb };
        let (k, w0) = weight_row(ty, nb, &seed, &scales);
        let w = rotated_rows(ty, &w0, n);
        let xs: Vec<f32> = (0..m * k).map(|i| x[(i * 7 + i / k) % x.len()] * (1.0 + (i % 5) as f32 * 0.1)).collect();
        let mut twin = vec![0f32; m * n];
        matmul_scalar(ty, &w, n, k, &xs, m, &mut twin, MatMulMode::Fast, 1).unwrap();
        for threads in [1, 2] {
            let mut simd = vec![f32::NAN; m * n];
            matmul(ty, &w, n, k, &xs, m, &mut simd, MatMulMode::Fast, threads).unwrap();
            prop_assert_eq!(simd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                twin.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{} threads {}", ty, threads);
        }
        let mut wd = vec![0f32; n * k];
        dequantize_row_scalar(ty, &w, &mut wd).unwrap();
        for i in 0..m {
            for j in 0..n {
                let (want, mag) = f64_dot(&xs[i * k..(i + 1) * k], &wd[j * k..(j + 1) * k]);
                let got = twin[i * n + j] as f64;
                // f32 FMA chain over k <= 3072 terms: relative error well under 1e-5 of the magnitude.
                prop_assert!((got - want).abs() <= 1e-5 * mag + 1e-30, "{} [{},{}]: {} vs {}", ty, i, j, got, want);
            }
        }
    }
}

/// The kernels' pool runs every task exactly once per job, job after job (warm and after its
/// workers parked), with nested jobs running inline.
#[test]
fn pool_runs_every_task_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    for round in 0..2000 {
        let tasks = 1 + round % 37;
        let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
        parallel_for(tasks, 2, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
            if round % 100 == 0 {
                // A nested job runs on the calling thread.
                let inner = AtomicUsize::new(0);
                parallel_for(3, 2, &|_| {
                    inner.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(inner.load(Ordering::Relaxed), 3);
            }
        });
        assert!(
            hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
            "round {round}"
        );
        if round == 1000 {
            // Let the workers go through yield and park.
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// The activation quantizers compiled for AVX2 write the same bytes as the baseline build.
    #[test]
    fn activation_quantizers_equal_scalar_twins(
        ti in 0usize..3,
        nb in 1usize..3,
        x in prop::collection::vec(-100.0f32..100.0, 1..64),
        scale in prop::sample::select(vec![0.0f32, 1e-6, 1.0, 37.5]),
    ) {
        let vt = [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K][ti];
        let k = nb * 256;
        let xs: Vec<f32> = (0..k).map(|i| x[i % x.len()] * scale * (1.0 + (i % 5) as f32 * 0.25)).collect();
        let rb = vt.row_bytes(k).unwrap();
        let (mut a, mut b) = (vec![0u8; rb], vec![0u8; rb]);
        quantize_activations(vt, &xs, &mut a).unwrap();
        quantize_activations_scalar(vt, &xs, &mut b).unwrap();
        prop_assert_eq!(a, b, "{}", vt);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// The interleaved (x8) layout's products: repacking then multiplying gives, for every
    /// (row, activation row), the value of the plain layout's quantized dot product up to f32
    /// summation order; the AVX2 kernels equal their scalar twins bit for bit at 1 and 2 threads
    /// for 1 to 15 activation rows (1-4-row kernel calls, partial last call) and in the f32 GEMM
    /// range (16+ rows, rows unpacked then dequantized: equal to the plain layout's GEMM bit
    /// for bit).
    #[test]
    fn x8_products_equal_scalar_twins_and_plain_layout(
        ti in 0usize..4,
        nb in 1usize..9,
        groups in 1usize..5,
        m in prop_oneof![1usize..16, 16usize..20],
        seed in prop::collection::vec(any::<u8>(), 1..64),
        scales in prop::collection::vec(-0.05f32..0.05, 1..16),
        x in prop::collection::vec(-4.0f32..4.0, 1..64),
    ) {
        use GgmlType::*;
        let ty = [Q8_0, Q4_0, Q4_1, Q5_0][ti];
        let (k, w0) = weight_row(ty, nb, &seed, &scales);
        let n = 8 * groups;
        let w = rotated_rows(ty, &w0, n);
        let wp = repack_x8(ty, &w, n, k).unwrap();
        let xs: Vec<f32> = (0..m * k).map(|i| x[(i * 7 + i / k) % x.len()] * (1.0 + (i % 5) as f32 * 0.1)).collect();
        let mut twin = vec![0f32; m * n];
        matmul_x8_scalar(ty, &wp, n, k, &xs, m, &mut twin, 1).unwrap();
        for threads in [1, 2] {
            let mut simd = vec![f32::NAN; m * n];
            matmul_x8(ty, &wp, n, k, &xs, m, &mut simd, threads).unwrap();
            prop_assert_eq!(simd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                twin.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{} m {} threads {}", ty, m, threads);
        }
        let mut plain = vec![0f32; m * n];
        matmul_scalar(ty, &w, n, k, &xs, m, &mut plain, MatMulMode::Fast, 1).unwrap();
        if m >= 16 {
            // The same dequantized weights through the same f32 GEMM.
            prop_assert_eq!(plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                twin.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{} m {}", ty, m);
        } else {
            // Same quantized activations and exact integer block totals; only the f32 sums of
            // the per-block terms differ in order (<= 8 blocks of |d_w d_x total| each): 1e-5 of
            // the row's magnitude covers f32 rounding of a few dozen additions (2^-24 each).
            let vt = vec_dot_type(ty).unwrap();
            let mut wd = vec![0f32; n * k];
            dequantize_row_scalar(ty, &w, &mut wd).unwrap();
            for i in 0..m {
                let mut xq = vec![0u8; vt.row_bytes(k).unwrap()];
                quantize_row(vt, &xs[i * k..(i + 1) * k], &mut xq).unwrap();
                let mut xd = vec![0f32; k];
                dequantize_row(vt, &xq, &mut xd).unwrap();
                for j in 0..n {
                    let (_, mut mag) = f64_dot(&xd, &wd[j * k..(j + 1) * k]);
                    if ty == Q4_1 {
                        // The min term uses Q8_1's f16-rounded s = d·Σq (as ggml's kernels do).
                        mag += xq.chunks_exact(36).map(|b| (half::f16::from_le_bytes([b[2], b[3]]).to_f64()).abs() * 0.05).sum::<f64>();
                    }
                    let (a, b) = (twin[i * n + j] as f64, plain[i * n + j] as f64);
                    prop_assert!((a - b).abs() <= 1e-5 * mag + 1e-30, "{} [{},{}]: x8 {} vs plain {}", ty, i, j, a, b);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The one-row Q4_1 kernel mirrors ggml's AVX2 `ggml_vec_dot_q4_1_q8_1` (eight lane sums,
    /// min terms in a scalar sum added last), which parity precision relies on: the AVX2 kernel
    /// and its scalar twin agree bit for bit.
    #[test]
    fn q4_1_simd_equals_scalar_bit_for_bit(
        nb in 1usize..12,
        seed in prop::collection::vec(any::<u8>(), 1..64),
        scales in prop::collection::vec(-0.05f32..0.05, 1..16),
        x in prop::collection::vec(-4.0f32..4.0, 1..64),
    ) {
        let (k, w) = weight_row(GgmlType::Q4_1, nb, &seed, &scales);
        let xs: Vec<f32> = (0..k).map(|i| x[i % x.len()] * (1.0 + (i % 5) as f32 * 0.3)).collect();
        let mut xq = vec![0u8; GgmlType::Q8_1.row_bytes(k).unwrap()];
        quantize_row(GgmlType::Q8_1, &xs, &mut xq).unwrap();
        let fast = vec_dot(GgmlType::Q4_1, &w, &xq, k).unwrap();
        let slow = vec_dot_scalar(GgmlType::Q4_1, &w, &xq, k).unwrap();
        prop_assert_eq!(fast.to_bits(), slow.to_bits(), "simd {} scalar {}", fast, slow);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The one-row Q4_K kernel (AVX-512 VNNI or AVX2) equals its scalar twin bit for bit: exact
    /// integer block totals, then the same two f32 FMA chains. Parity precision relies on it.
    #[test]
    fn q4_k_simd_equals_scalar_bit_for_bit(
        nb in 1usize..6,
        seed in prop::collection::vec(any::<u8>(), 1..64),
        scales in prop::collection::vec(-0.05f32..0.05, 1..16),
        x in prop::collection::vec(-4.0f32..4.0, 1..64),
    ) {
        let (k, w) = weight_row(GgmlType::Q4_K, nb, &seed, &scales);
        let xs: Vec<f32> = (0..k).map(|i| x[i % x.len()] * (1.0 + (i % 5) as f32 * 0.3)).collect();
        let mut xq = vec![0u8; GgmlType::Q8_K.row_bytes(k).unwrap()];
        quantize_row_q8_K(&xs, &mut xq).unwrap();
        let fast = vec_dot(GgmlType::Q4_K, &w, &xq, k).unwrap();
        let slow = vec_dot_scalar(GgmlType::Q4_K, &w, &xq, k).unwrap();
        prop_assert_eq!(fast.to_bits(), slow.to_bits(), "simd {} scalar {}", fast, slow);
    }
}

/// The proptests above compare the kernels of the level this process runs at (the best the
/// host has, unless `NPUC_ISA` caps it) with their scalar twins. Run without `NPUC_ISA`, this
/// test re-runs them in child processes at every lower level the host has (`avx2`, `scalar`),
/// so one `cargo test` exercises the AVX-512, AVX2 and scalar paths alike. It also checks the
/// AVX-512 gate: the VNNI kernels run exactly when the level allows `avx512` and the CPU has
/// AVX-512 VNNI.
#[test]
fn kernels_equal_twins_at_every_isa_level_the_host_has() {
    use npuc_isa::Isa;
    assert_eq!(
        has_avx512(),
        Isa::detect().has_avx512() && npuc_isa::host_has("avx512vnni") && has_avx2()
    );
    if std::env::var_os(npuc_isa::ENV).is_some() || std::env::var_os("NPUC_GGML_SCALAR").is_some() {
        return; // a child (or a run already pinned to one level): the level under test.
    }
    eprintln!(
        "this process: level {} (AVX-512 VNNI kernels {})",
        Isa::detect().name(),
        if has_avx512() { "on" } else { "off" }
    );
    let exe = std::env::current_exe().expect("the test binary's path");
    let tests = [
        "simd_equals_scalar_and_dequantized_reference",
        "matmul_modes_threads_and_scalar_agree",
        "multi_row_kernels_equal_scalar_twins",
        "dequantizers_equal_scalar_twins",
        "f32_gemm_equals_scalar_twin",
        "x8_products_equal_scalar_twins_and_plain_layout",
        "q4_1_simd_equals_scalar_bit_for_bit",
        "q4_k_simd_equals_scalar_bit_for_bit",
        "attention_vector_kernels_equal_scalar_twins",
        "activation_quantizers_equal_scalar_twins",
    ];
    for level in Isa::ALL.into_iter().filter(|&l| l < Isa::detect()) {
        let mut cmd = std::process::Command::new(&exe);
        cmd.env(npuc_isa::ENV, level.name()).arg("--exact");
        cmd.args(tests);
        let out = cmd.output().expect("re-running the test binary");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "kernel tests at NPUC_ISA={} failed:\n{text}\n{}",
            level.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        let want = format!("test result: ok. {} passed", tests.len());
        assert!(
            text.contains(&want),
            "NPUC_ISA={}: expected '{want}' in:\n{text}",
            level.name()
        );
        eprintln!(
            "NPUC_ISA={}: {} kernel tests passed",
            level.name(),
            tests.len()
        );
    }
}
