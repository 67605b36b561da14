//! Micro-benchmark of `npuc_ggml::matmul` on Gemma 3 270M shapes:
//! `cargo run --release -p npuc-ggml --example bench_matmul [-- --quick] [--decode] [--type Q8_0]`.
//!
//! For each weight type, shape (n x k), batch m (1 = decode, 128 = prefill) and thread count,
//! prints the fastest time per call of the fast path (multi-row kernels), its weight bandwidth
//! (GB/s) and GFLOP/s (2·m·n·k / time), and the time of llama.cpp's kernels (parity path,
//! `MatMulMode::ActQuant`) for the ratio.

use npuc_ggml::{matmul, matmul_x8, repack_x8, supports_x8, GgmlType, MatMulMode, X8_ROWS};
use std::time::Instant;

/// Random-looking but well-formed blocks: f16 scale fields set to small finite values.
fn weights(ty: GgmlType, n: usize, k: usize) -> Vec<u8> {
    let rb = ty.row_bytes(k).unwrap();
    let mut s = 0x9e3779b97f4a7c15u64;
    let mut w: Vec<u8> = (0..n * rb)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    let fields: &[usize] = match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q4_1 => &[0, 2],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::F16 => {
            for c in w.chunks_exact_mut(2) {
                let v = half::f16::from_f32((c[0] as f32 - 128.0) / 1024.0);
                c.copy_from_slice(&v.to_bits().to_le_bytes());
            }
            &[]
        }
        _ => &[],
    };
    if !fields.is_empty() {
        for blk in w.chunks_exact_mut(ty.type_size()) {
            for &at in fields {
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
            }
        }
    }
    w
}

#[allow(clippy::too_many_arguments)]
fn time(
    ty: GgmlType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    threads: usize,
    mode: Option<MatMulMode>,
) -> f64 {
    let mut y = vec![0f32; m * n];
    let work = (m * n * k) as f64;
    let iters = ((2e8 / work) as usize).clamp(1, 200);
    let mut ts = Vec::new();
    for _ in 0..iters.max(3) {
        let t = Instant::now();
        match mode {
            Some(mode) => matmul(ty, w, n, k, x, m, &mut y, mode, threads).unwrap(),
            // The interleaved layout (`w` already repacked).
            None => matmul_x8(ty, w, n, k, x, m, &mut y, threads).unwrap(),
        }
        ts.push(t.elapsed().as_secs_f64());
    }
    // The fastest call: the estimate least disturbed by other work on a shared machine.
    ts.iter().copied().fold(f64::INFINITY, f64::min)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // `--type NAME`: only that weight type.
    let only: Option<String> = std::env::args().skip_while(|a| a != "--type").nth(1);
    // `--decode`: only m = 1 (the token-step products).
    let decode_only = std::env::args().any(|a| a == "--decode");
    let shapes: &[(usize, usize)] = &[
        (1024, 640),
        (256, 640),
        (2048, 640),
        (640, 1024),
        (640, 2048),
        (4864, 896),
        (896, 4864),
        (262144, 640),
        (151936, 896),
    ];
    let types = [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::F16,
    ];
    println!("type  n x k         m    thr  ms/call    GB/s   GFLOP/s  parity_ms  parity/fast");
    for ty in types {
        if only.as_deref().is_some_and(|o| o != ty.name()) {
            continue;
        }
        for &(n, k) in shapes {
            if ty.row_bytes(k).is_none() {
                println!(
                    "{:5} {n}x{k}: k not a multiple of {}",
                    ty.name(),
                    ty.block_size()
                );
                continue;
            }
            if quick && n > 100_000 {
                continue;
            }
            let w = weights(ty, n, k);
            let wx8 = (supports_x8(ty) && n.is_multiple_of(X8_ROWS))
                .then(|| repack_x8(ty, &w, n, k).unwrap());
            for m in [1usize, 128] {
                if (n > 100_000 || decode_only) && m == 128 {
                    continue; // 43 GFLOP per call: the decode case is the one that matters.
                }
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                for threads in [1usize, 2] {
                    let run = |mode| time(ty, &w, n, k, &x, m, threads, Some(mode));
                    let t = run(MatMulMode::Fast);
                    let ts = run(MatMulMode::ActQuant);
                    if let Some(wx) = &wx8 {
                        let tx = time(ty, wx, n, k, &x, m, threads, None);
                        println!(
                            "{:5} {:>6}x{:<5} {m:>4} {threads:>4} {:>8.3} {:>7.2} {:>8.2}  x8 layout, {:.2}x the fast path",
                            ty.name(),
                            n,
                            k,
                            tx * 1e3,
                            w.len() as f64 / tx / 1e9,
                            2.0 * (m * n * k) as f64 / tx / 1e9,
                            t / tx
                        );
                    }
                    println!(
                        "{:5} {:>6}x{:<5} {m:>4} {threads:>4} {:>8.3} {:>7.2} {:>8.2} {:>10.3} {:>8.2}x",
                        ty.name(),
                        n,
                        k,
                        t * 1e3,
                        w.len() as f64 / t / 1e9,
                        2.0 * (m * n * k) as f64 / t / 1e9,
                        ts * 1e3,
                        ts / t
                    );
                }
            }
        }
    }
}
