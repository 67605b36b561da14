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
                // In 2 KB pieces: glibc's `rep movsb` copy of larger blocks runs ~20x slower on
                // Zen 3 when the destination sits 16 bytes (mod 4096) after the source, as two
                // consecutive heap buffers of page-multiple size do; it measured more than the
                // activations themselves.
                for (d, s) in v.chunks_mut(512).zip(src.chunks(512)) {
                    d.copy_from_slice(s);
                }
                f(&mut v);
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / (reps * n) as f64;
            println!("round {round} {name:18} {ns:.3} ns/value");
        }
    }
}
