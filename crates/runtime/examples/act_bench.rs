//! Activation throughput (ns per value) over an L2-resident buffer: each dispatched kernel
//! and GELU's scalar twin, three rounds. Usage:
//! `cargo run --release -p npuc-runtime --example act_bench`.

use npuc_runtime::kernels::act;
use std::time::Instant;

/// An in-place activation over a slice.
type Kernel = fn(&mut [f32]);

fn main() {
    let n = 1 << 15;
    let src: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 2001) as f32 / 250.0 - 4.0)
        .collect();
    let kernels: [(&str, Kernel); 7] = [
        ("gelu", act::gelu),
        ("gelu scalar twin", act::gelu_scalar),
        ("tanh", act::tanh),
        ("sigmoid", act::sigmoid),
        ("sigmoid scalar twin", act::sigmoid_scalar),
        ("swish", act::swish),
        ("softmax rows of 1000", |v| {
            v.chunks_mut(1000).for_each(act::softmax_row)
        }),
    ];
    for round in 0..3 {
        for (name, f) in kernels {
            let mut v = src.clone();
            let reps = 200;
            let t = Instant::now();
            for _ in 0..reps {
                v.copy_from_slice(&src);
                f(&mut v);
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / (reps * n) as f64;
            println!("round {round} {name:18} {ns:.3} ns/value");
        }
    }
}
