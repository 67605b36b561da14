//! Times one sampling step on a Gemma-sized (262,144) vocabulary for several sampler settings.
//! `cargo run --release -p npuc-generate --example sample_speed`

use npuc_generate::{Sampler, SamplerParams};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let n = 262_144;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let logits: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // logit-like spread: mostly small, a few large
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 12.0
        })
        .collect();
    let history: Vec<u32> = (0..256).map(|i| (i * 977) % n as u32).collect();
    let settings = [
        ("greedy", SamplerParams::greedy()),
        (
            "llama.cpp defaults (k40 p0.95 min_p0.05 T0.8)",
            SamplerParams::default(),
        ),
        (
            "top_k 0, top_p 0.95",
            SamplerParams {
                top_k: 0,
                min_p: 0.0,
                ..Default::default()
            },
        ),
        (
            "top_k 0, top_p 1, min_p 0 (full softmax)",
            SamplerParams {
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                ..Default::default()
            },
        ),
        (
            "defaults + repeat_penalty 1.1",
            SamplerParams {
                repeat_penalty: 1.1,
                ..Default::default()
            },
        ),
        (
            "typical 0.9, top_k 0",
            SamplerParams {
                top_k: 0,
                typical_p: 0.9,
                ..Default::default()
            },
        ),
    ];
    for (name, p) in settings {
        let mut s = Sampler::new(p)?;
        let mut buf = logits.clone();
        let runs = 20;
        let t = Instant::now();
        for _ in 0..runs {
            buf.copy_from_slice(&logits);
            std::hint::black_box(s.sample(&mut buf, &history)?);
        }
        println!(
            "{name:50} {:8.3} ms/token",
            t.elapsed().as_secs_f64() * 1e3 / runs as f64
        );
    }
    Ok(())
}
