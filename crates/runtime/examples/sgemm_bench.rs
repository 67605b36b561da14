//! f32 product throughput at the ViT-S and PP-OCR shapes, in GFLOP/s: the `gemm` crate (what
//! `ops::matmul::gemm_into` calls below AVX-512) against `kernels::sgemm` (AVX-512), with `b`
//! packed per call and packed once beforehand (a constant weight), alternating in each round.
//! Usage: `cargo run --release -p npuc-runtime --example sgemm_bench [THREADS [SHAPE | MxKxN]]`.

use npuc_runtime::kernels::sgemm::{self, PackedB, View};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|t| t.parse().ok())
        .unwrap_or(1);
    let shapes = [
        ("qkv", 257, 384, 1152),
        ("proj", 257, 384, 384),
        ("fc1", 257, 384, 1536),
        ("fc2", 257, 1536, 384),
        ("attn_qk", 257, 64, 257),
        ("attn_v", 257, 257, 64),
        // Conv as weights x im2col columns: M = out channels, K = C*kh*kw, N = pixels.
        ("conv_a", 32, 144, 3136),
        ("conv_b", 96, 864, 784),
        ("rec_mix", 40, 480, 120),
        ("v6_pw", 240, 160, 320),
        ("v6_head", 40, 80, 6906),
        // ViT-S decoder ConvTranspose blocks: W^T [M*16, C] x X block [C, pixels].
        ("deconv1", 4096, 384, 64),
        ("deconv2", 2048, 256, 128),
        ("deconv3", 1024, 128, 256),
        ("cls_c0", 3200, 27, 16),
        ("cls_pw", 400, 256, 256),
        ("cls_c30", 240, 512, 512),
        ("v6_c82", 6400, 576, 16),
        ("v6_c1", 25600, 64, 8),
    ];
    let isa = npuc_isa::Isa::detect();
    println!(
        "level {} (own kernel {})",
        isa.name(),
        sgemm::available(isa)
    );
    let only = std::env::args().nth(2);
    // `MxKxN` runs that shape alone.
    let custom: Vec<usize> = only
        .as_deref()
        .map(|o| o.split('x').filter_map(|d| d.parse().ok()).collect())
        .unwrap_or_default();
    let shapes: Vec<(&str, usize, usize, usize)> = if let [m, k, n] = custom[..] {
        vec![("custom", m, k, n)]
    } else {
        shapes.to_vec()
    };
    let only = only.filter(|_| custom.len() != 3);
    for round in 0..3 {
        for &(name, m, k, n) in &shapes {
            if only.as_deref().is_some_and(|o| o != name) {
                continue;
            }
            let a: Vec<f32> = (0..m * k).map(|i| (i % 97) as f32 * 0.01 - 0.4).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i % 89) as f32 * 0.01 - 0.4).collect();
            let mut c = vec![0f32; m * n];
            let reps = (2e9 / (2.0 * (m * k * n) as f64)).clamp(5.0, 200.0) as usize;
            let flop = 2.0 * (m * k * n) as f64;
            let t = Instant::now();
            for _ in 0..reps {
                // SAFETY: a is m x k, b is k x n and c is m x n, all row-major and contiguous.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        a.as_ptr(),
                        1,
                        k as isize,
                        b.as_ptr(),
                        1,
                        n as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        if threads > 1 {
                            gemm::Parallelism::Rayon(threads)
                        } else {
                            gemm::Parallelism::None
                        },
                    )
                }
            }
            let g = t.elapsed().as_secs_f64() / reps as f64;
            let t = Instant::now();
            for _ in 0..reps {
                sgemm::sgemm(
                    isa,
                    m,
                    n,
                    k,
                    1.0,
                    View::rows(&a, k),
                    View::rows(&b, n),
                    &mut c,
                    n,
                    threads,
                )
                .unwrap();
            }
            let o = t.elapsed().as_secs_f64() / reps as f64;
            let packed = PackedB::new(k, n, View::rows(&b, n)).unwrap();
            let t = Instant::now();
            for _ in 0..reps {
                sgemm::sgemm_packed(isa, m, 1.0, View::rows(&a, k), &packed, &mut c, n, threads)
                    .unwrap();
            }
            let p = t.elapsed().as_secs_f64() / reps as f64;
            // Cold weights, as in a whole model: 24 packed copies of b cycled (far more than L2
            // holds), a fresh output each product.
            let cold: Vec<PackedB> = (0..24)
                .map(|_| PackedB::new(k, n, View::rows(&b, n)).unwrap())
                .collect();
            let t = Instant::now();
            for r in 0..reps {
                let mut c = vec![0f32; m * n];
                sgemm::sgemm_packed(
                    isa,
                    m,
                    1.0,
                    View::rows(&a, k),
                    &cold[r % 24],
                    &mut c,
                    n,
                    threads,
                )
                .unwrap();
                std::hint::black_box(&c);
            }
            let q = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "round {round} {name:8} cold weights + fresh output {:.3} ms {:.1} GFLOP/s",
                q * 1e3,
                flop / q / 1e9
            );
            println!(
                "round {round} {name:8} {m}x{k}x{n}: gemm crate {:.3} ms {:.1} GFLOP/s | own {:.3} ms {:.1} GFLOP/s ({:.2}x) | own prepacked {:.3} ms {:.1} GFLOP/s ({:.2}x)",
                g * 1e3,
                flop / g / 1e9,
                o * 1e3,
                flop / o / 1e9,
                o / g,
                p * 1e3,
                flop / p / 1e9,
                p / g
            );
        }
    }
}
