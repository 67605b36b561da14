//! Throughput of the exact integer product (`kernels::igemm`) at the ViT-S shapes, in GMAC/s
//! (one thread), with the weights packed once and the activations packed per call as
//! `npuc.QMatMul` does; each layout the host can run (AVX2 `vpmaddwd` pairs, AVX-512 VNNI
//! quads) in turn within each round. Usage:
//! `cargo run --release -p npuc-runtime --example igemm_bench [-- --cold]`.

use npuc_runtime::kernels::igemm::{igemm, Isa, Layout, PackBuf, PackedA, PackedB};
use std::time::Instant;

fn main() {
    let shapes = [
        ("fc1", 197, 384, 1536),
        ("fc2", 197, 1536, 384),
        ("qkv", 197, 384, 384),
        ("attn", 197, 64, 197),
        // The transposed convolutions' phase products (output pixels x taps*channels x M).
        ("upconv1", 196, 1536, 256),
        ("upconv2", 784, 1024, 128),
        ("upconv3", 3136, 512, 64),
        // text2tashkeel's LSTM input projections (32 timesteps x input x 4 gates * 256).
        ("lstm_in", 32, 512, 1024),
    ];
    let cold = std::env::args().any(|a| a == "--cold");
    let mut layouts = vec![Layout::Pairs];
    if Layout::active() == Layout::Quads {
        layouts.push(Layout::Quads);
    }
    println!("level {}", Isa::detect().name());
    for round in 0..3 {
        for &(name, m, k, n) in &shapes {
            for &layout in &layouts {
                let a: Vec<u8> = (0..m * k).map(|i| (i * 7919 % 256) as u8).collect();
                let w: Vec<i8> = (0..k * n).map(|i| (i * 104729 % 255) as i8).collect();
                // --cold: rotate through enough distinct weights (> L3) that each product reads
                // its weight from memory, as in a model whose layers each have their own weights.
                let copies = if cold {
                    (64 << 20) / (k * n * 2) + 1
                } else {
                    1
                };
                let pbs: Vec<PackedB> = (0..copies)
                    .map(|_| PackedB::pack_as(layout, k, n, |r, c| w[r * n + c] as i16))
                    .collect();
                let mut c = vec![0i32; m * n];
                let reps = 20;
                let mut buf = PackBuf::default();
                let t = Instant::now();
                for rep in 0..reps {
                    let pb = &pbs[rep % copies];
                    let pa = PackedA::pack_rows_as(layout, buf, m, k, &a, |v| v as i16 - 128);
                    igemm(&pa, pb, &mut c, 1).unwrap();
                    buf = pa.into_buffer();
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                println!(
                    "round {round} {name:8} {m}x{k}x{n} {layout:?}: {:.3} ms, {:.1} GMAC/s",
                    s * 1e3,
                    (m * k * n) as f64 / s / 1e9
                );
            }
        }
    }
}
