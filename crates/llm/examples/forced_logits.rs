//! Logits of a forced continuation, for numeric comparison with another engine:
//! `forced_logits MODEL.gguf fast|exact PROMPT_IDS FORCED_IDS OUT.f32 [THREADS]` runs the prompt
//! (comma-separated ids) in one call, then each forced id one token at a time (as greedy
//! generation does), and writes the last-position logits after the prompt and after each forced
//! token as raw little-endian f32, `(1 + forced) x vocab`.

use npuc_llm::{Engine, EngineOptions, Precision, Variant};
use std::io::Write;
use std::path::Path;

fn ids(s: &str) -> Vec<u32> {
    s.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            t.trim()
                .parse()
                .expect("token ids are comma-separated integers")
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 6 {
        eprintln!(
            "usage: forced_logits MODEL.gguf fast|exact PROMPT_IDS FORCED_IDS OUT.f32 [THREADS]"
        );
        std::process::exit(2);
    }
    let precision = match a[2].as_str() {
        "fast" => Precision::Fast,
        "parity" => Precision::Parity,
        "exact" => Precision::Exact,
        p => return Err(format!("precision '{p}' is not fast, parity or exact").into()),
    };
    let threads = a.get(6).map_or(Ok(2), |t| t.parse())?;
    let opts = EngineOptions {
        threads,
        ctx: Some(256),
        variants: vec![Variant::Ar(1), Variant::Ar(32), Variant::Ar(128)],
        precision,
        weight_quant: Default::default(),
    };
    let mut e = Engine::from_gguf(Path::new(&a[1]), &opts)?;
    let mut out = std::io::BufWriter::new(std::fs::File::create(&a[5])?);
    let mut put = |l: &[f32]| -> std::io::Result<()> {
        for v in l {
            out.write_all(&v.to_le_bytes())?;
        }
        Ok(())
    };
    put(&e.forward(&ids(&a[3]), false)?)?;
    for t in ids(&a[4]) {
        put(&e.forward(&[t], false)?)?;
    }
    Ok(())
}
