//! Tokenizes a text file with a GGUF model's tokenizer and reports timings.
//! Usage: `cargo run --release -p npuc-tokenizer --example tokenize -- MODEL.gguf TEXT_FILE [--ids]`

use npuc_tokenizer::Tokenizer;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        return Err("usage: tokenize MODEL.gguf TEXT_FILE [--ids]".into());
    }
    let t0 = Instant::now();
    let gguf = npuc_gguf::GgufFile::open(&args[1])?;
    let t1 = Instant::now();
    let tok = Tokenizer::from_gguf(&gguf)?;
    let t2 = Instant::now();
    let text = std::fs::read_to_string(&args[2])?;
    let mut best = f64::MAX;
    let mut ids = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        ids = tok.encode(&text, true)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let t = Instant::now();
    let plain = tok.encode_with(&text, true, false)?;
    let no_special = t.elapsed().as_secs_f64();
    // Round trip without BOS: after a BOS llama.cpp's detokenizer keeps the SPM prefix space.
    let no_bos = tok.encode(&text, false)?;
    let t = Instant::now();
    let back = tok.decode(&no_bos);
    let dec = t.elapsed().as_secs_f64();
    println!(
        "gguf open {:.1} ms, tokenizer build {:.1} ms; {} bytes -> {} tokens: encode {:.1} ms (best of 5, {:.2} MB/s), parse_special=false {:.1} ms ({} tokens), decode {:.1} ms, round trip {}",
        (t1 - t0).as_secs_f64() * 1e3,
        (t2 - t1).as_secs_f64() * 1e3,
        text.len(),
        ids.len(),
        best * 1e3,
        text.len() as f64 / best / 1e6,
        no_special * 1e3,
        plain.len(),
        dec * 1e3,
        if back == text { "exact" } else { "DIFFERS" }
    );
    if args.iter().any(|a| a == "--ids") {
        println!("{ids:?}");
    }
    Ok(())
}
