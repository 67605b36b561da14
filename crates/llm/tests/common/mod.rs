//! Shared test helpers: fixture paths and the reference arrays (`.npy`,
//! through `npuc-npy`).

#![allow(dead_code)]

use std::path::PathBuf;

/// `tests/fixtures/llm` of the repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llm")
}

/// Reads a `.npy` array (any numeric dtype, converted) as (shape, f32 values).
pub fn read_npy(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
    let t = npuc_npy::read_npy(path).unwrap_or_else(|e| panic!("{e}"));
    let vals = t
        .to_f64_vec()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .map(|v| v as f32)
        .collect();
    (t.shape().to_vec(), vals)
}

/// Max |a - b|.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// llama.cpp's greedy references in `tests/fixtures/llm/REL` (made by
/// `scripts/llamacpp/make_greedy_refs.py`): (prompt ids with BOS as llama.cpp feeds them,
/// generated ids) per prompt.
pub fn greedy_refs(rel: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    let path = fixtures().join(rel);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (a committed fixture)", path.display()));
    let refs: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    refs["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["prompt_ids_bos"]), ids(&p["gen_ids"])))
        .collect()
}

/// Greedy continuation of `prompt` for `n` tokens.
pub fn greedy(e: &mut npuc_llm::Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    e.reset();
    let mut logits = e.forward(prompt, false).unwrap();
    let mut out = vec![];
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        if out.len() == n {
            break;
        }
        logits = e.forward(&[t], false).unwrap();
    }
    out
}

/// Parity precision reproduces llama.cpp's greedy ids for every reference prompt of `rel`
/// (prints the first difference of each prompt that differs); `name` labels the output.
pub fn assert_parity_greedy(name: &str, model: &std::path::Path, rel: &str) {
    use npuc_llm::{Engine, EngineOptions, Precision, Variant};
    npuc_llm::register_ops();
    let refs = greedy_refs(rel);
    let opts = EngineOptions {
        threads: 2,
        ctx: Some(256),
        variants: vec![Variant::Ar(1), Variant::Ar(32), Variant::Ar(128)],
        precision: Precision::Parity,
        weight_quant: Default::default(),
    };
    let mut e = Engine::from_gguf(model, &opts).unwrap();
    let (mut same, mut total, mut prompts_ok) = (0, 0, 0);
    let n_prompts = refs.len();
    for (prompt, want) in refs {
        let t0 = std::time::Instant::now();
        let got = greedy(&mut e, &prompt, want.len());
        let secs = t0.elapsed().as_secs_f64();
        eprintln!(
            "  {} prompt + {} generated tokens in {secs:.2} s (2 threads)",
            prompt.len(),
            want.len()
        );
        let prefix = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        if prefix < want.len() {
            eprintln!(
                "  first difference at step {prefix}: npuc {:?} llama.cpp {:?}",
                &got[prefix..(prefix + 4).min(got.len())],
                &want[prefix..(prefix + 4).min(want.len())]
            );
        }
        eprintln!(
            "prompt of {} tokens: {prefix}/{} greedy tokens identical to llama.cpp",
            prompt.len(),
            want.len()
        );
        same += prefix;
        total += want.len();
        prompts_ok += usize::from(prefix == want.len());
    }
    eprintln!("{name} parity: {same}/{total} tokens, {prompts_ok}/{n_prompts} prompts identical");
    assert_eq!(prompts_ok, n_prompts, "{same}/{total} tokens match");
}
