//! `npuc compile MODEL.gguf`: AR variants in one artifact with the weights stored once, and an
//! engine over the artifact that computes exactly what the in-memory GGUF engine computes.

use npuc_llm::compile::{compile_gguf, LlmCompileOptions};
use npuc_llm::engine::TOKENIZER_PREFIXES;
use npuc_llm::{Engine, EngineOptions, GgufMetaJson, Precision, Variant};
use std::path::PathBuf;

const SEQ: [u32; 24] = [
    5, 42, 79, 116, 153, 190, 227, 264, 301, 338, 375, 412, 449, 486, 11, 48, 85, 122, 159, 196,
    233, 270, 307, 344,
];

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/llm")
        .join(rel)
}

/// A fresh path in the temp directory (removed when the test ends).
fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("npuc-llm-{}-{name}", std::process::id()))
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn tiny_artifact_equals_gguf_engine() {
    let gguf = fixture("tiny-llama3/tiny-llama3-F32.gguf");
    let out = tmp("tiny.npuc");
    let variants = vec![Variant::Ar(1), Variant::Ar(8), Variant::Full];
    let opts = LlmCompileOptions {
        variants: variants.clone(),
        ctx: Some(32),
        precision: Precision::Exact,
        target: None,
    };
    let s = compile_gguf(&gguf, &opts, &out, |_| {}).unwrap();
    assert_eq!(s.graphs.len(), 3);
    // Three graphs reference the weights, the artifact stores them once.
    let g = npuc_gguf::GgufFile::open(&gguf).unwrap();
    let tensor_bytes: u64 = g.tensors.iter().map(|t| t.nbytes).sum();
    assert!(s.weight_bytes_referenced >= 3 * s.weight_bytes_unique - 3 * 4096);
    assert!(
        s.weight_bytes_unique <= tensor_bytes + 4096,
        "{} > {tensor_bytes}",
        s.weight_bytes_unique
    );

    let eo = EngineOptions {
        threads: 1,
        ctx: Some(32),
        variants,
        precision: Precision::Exact,
        weight_quant: Default::default(),
    };
    let mut a = Engine::from_artifact(
        &out,
        &EngineOptions {
            variants: vec![],
            ..eo.clone()
        },
    )
    .unwrap();
    let mut b = Engine::from_gguf(&gguf, &eo).unwrap();
    assert_eq!((a.ctx(), a.vocab()), (32, 512));
    assert_eq!(
        a.metadata(),
        &GgufMetaJson::filtered(&g.metadata, TOKENIZER_PREFIXES)
    );
    assert!(a.metadata().get("tokenizer.ggml.tokens").is_some());
    // Prefill of 24 (ar8 x 3) then decode; and `full` for a whole-sequence scoring call.
    let la = a.forward(&SEQ, true).unwrap();
    let lb = b.forward(&SEQ, true).unwrap();
    assert_eq!(la, lb);
    for _ in 0..4 {
        let (ta, tb) = (argmax(&la[la.len() - 512..]), argmax(&lb[lb.len() - 512..]));
        assert_eq!(ta, tb);
        assert_eq!(
            a.forward(&[ta], false).unwrap(),
            b.forward(&[tb], false).unwrap()
        );
    }
    // Wrong context for a compiled artifact: a clear error.
    let err = Engine::from_artifact(
        &out,
        &EngineOptions {
            ctx: Some(64),
            ..eo
        },
    )
    .err()
    .unwrap();
    assert!(
        err.to_string().contains("compiled for a context of 32"),
        "{err}"
    );
    std::fs::remove_file(&out).unwrap();
}

#[test]
fn gemma3_artifact_same_tokens_as_gguf() {
    npuc_llm::register_ops();
    let gguf = npuc_testsupport::gemma3_gguf();
    let out = tmp("gemma.npuc");
    let variants = vec![Variant::Ar(1), Variant::Ar(32), Variant::Ar(128)];
    let opts = LlmCompileOptions {
        variants: variants.clone(),
        ctx: Some(256),
        precision: Precision::Fast,
        target: None,
    };
    let s = compile_gguf(&gguf, &opts, &out, |_| {}).unwrap();
    eprintln!(
        "gemma3 artifact: {:.1} MB, weights {:.1} MB unique / {:.1} MB referenced, {:.2} s",
        s.file_bytes as f64 / 1e6,
        s.weight_bytes_unique as f64 / 1e6,
        s.weight_bytes_referenced as f64 / 1e6,
        s.seconds
    );
    assert!(s.weight_bytes_unique < 260_000_000);
    let eo = EngineOptions {
        threads: 2,
        ctx: Some(256),
        variants,
        precision: Precision::Fast,
        weight_quant: Default::default(),
    };
    let prompt = [2u32, 818, 5279, 529, 7001, 563];
    let mut toks = vec![];
    for e in [
        Engine::from_gguf(&gguf, &eo).unwrap(),
        Engine::from_artifact(&out, &eo).unwrap(),
    ] {
        let mut e = e;
        let mut l = e.forward(&prompt, false).unwrap();
        let mut t = vec![];
        for _ in 0..16 {
            let x = argmax(&l);
            t.push(x);
            l = e.forward(&[x], false).unwrap();
        }
        toks.push(t);
    }
    assert_eq!(toks[0], toks[1]);
    std::fs::remove_file(&out).unwrap();
}
