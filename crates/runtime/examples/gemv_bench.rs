//! One-row products (a batch-1 recurrence's `h · Rᵀ`) at the GRU/LSTM shapes of the real
//! models, in GB/s of weights streamed: `kernels::sgemv::dot_rows` over R's rows against
//! `kernels::sgemm::sgemm_packed` with m = 1 over R packed in panels, alternating in each
//! round. Usage: `cargo run --release -p npuc-runtime --example gemv_bench`.

use npuc_runtime::kernels::{sgemm, sgemv};
use std::time::Instant;

fn main() {
    // (name, n = gates * hidden, k = hidden)
    let shapes = [
        ("gru128", 384, 128),
        ("lstm64", 256, 64),
        ("lstm256", 1024, 256),
    ];
    let isa = npuc_isa::Isa::detect();
    for round in 0..3 {
        for &(name, n, k) in &shapes {
            let a: Vec<f32> = (0..k).map(|i| (i % 97) as f32 * 0.01 - 0.4).collect();
            let r: Vec<f32> = (0..n * k).map(|i| (i % 89) as f32 * 0.01 - 0.4).collect();
            let mut c = vec![0f32; n];
            let reps = 20000;
            let t = Instant::now();
            for _ in 0..reps {
                assert!(sgemv::dot_rows(&a, &r, k, &mut c, false));
                std::hint::black_box(&c);
            }
            let d = t.elapsed().as_secs_f64() / reps as f64;
            let view = sgemm::View {
                data: &r,
                rs: 1,
                cs: k,
            };
            let pb = sgemm::PackedB::new(k, n, view).unwrap();
            let t = Instant::now();
            for _ in 0..reps {
                sgemm::sgemm_packed(isa, 1, 1.0, sgemm::View::rows(&a, k), &pb, &mut c, n, 1)
                    .unwrap();
                std::hint::black_box(&c);
            }
            let p = t.elapsed().as_secs_f64() / reps as f64;
            let gb = (n * k * 4) as f64 / 1e9;
            println!(
                "round {round} {name:8} {n}x{k}: dot_rows {:.2} us {:.1} GB/s | packed panels {:.2} us {:.1} GB/s",
                d * 1e6,
                gb / d,
                p * 1e6,
                gb / p
            );
        }
    }
}
