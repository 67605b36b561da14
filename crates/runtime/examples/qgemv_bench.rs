//! The int8 recurrent step (`kernels::qgemv`, DynamicQuantizeLSTM's `h · Rᵀ`) at
//! text2tashkeel's shape (k = 256 hidden, n = 4 gates x 256): the exact kernel (`gemv`) against
//! the saturating u8 x s8 one (`gemv_saturating_with`, onnxruntime's AVX2 arithmetic),
//! alternating in each round, in microseconds per step. Usage:
//! `cargo run --release -p npuc-runtime --example qgemv_bench`.

use npuc_runtime::kernels::qgemv::{gemv, gemv_saturating_with, Isa, PackedI8};
use std::time::Instant;

fn main() {
    let (k, n) = (256, 1024);
    let w: Vec<i8> = (0..k * n).map(|i| (i * 104729 % 255) as i8).collect();
    let b = PackedI8::pack_with_quads(k, n, |r, c| w[r * n + c]);
    let a: Vec<i16> = (0..b.a_len())
        .map(|i| (i * 7919 % 256) as i16 - 131)
        .collect();
    let mut out = vec![0i32; b.out_len()];
    let isa = Isa::detect();
    println!("level {}", isa.name());
    let reps = 20000;
    for round in 0..4 {
        let t = Instant::now();
        for _ in 0..reps {
            gemv(&a, &b, &mut out).unwrap();
            std::hint::black_box(&out);
        }
        let exact = t.elapsed().as_secs_f64() / reps as f64;
        let t = Instant::now();
        for _ in 0..reps {
            gemv_saturating_with(isa, &a, &b, &mut out).unwrap();
            std::hint::black_box(&out);
        }
        let sat = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "round {round} {k}x{n}: exact {:.2} us | saturating u8s8 {:.2} us ({:.2}x)",
            exact * 1e6,
            sat * 1e6,
            exact / sat
        );
    }
}
