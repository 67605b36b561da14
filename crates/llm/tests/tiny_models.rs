//! The synthetic llama / llama-spm / qwen2 GGUFs against transformers' logits of the same
//! (dequantized) weights: all 24 positions, through ar1 token by token and through one padded
//! ar32 call (the two must agree: that checks the KV cache), and greedy continuations of the F32
//! files against refs.json.

mod common;

use common::{argmax, fixtures, max_diff, read_npy};
use npuc_llm::{Engine, EngineOptions, Precision, Variant};

const SEQ: [u32; 24] = [
    5, 42, 79, 116, 153, 190, 227, 264, 301, 338, 375, 412, 449, 486, 11, 48, 85, 122, 159, 196,
    233, 270, 307, 344,
];
const MODELS: [&str; 3] = ["tiny-llama3", "tiny-llama-spm", "tiny-qwen2"];

fn opts(variants: &[Variant], ctx: usize) -> EngineOptions {
    EngineOptions {
        threads: 2,
        ctx: Some(ctx),
        variants: variants.to_vec(),
        precision: Precision::Exact,
        weight_quant: Default::default(),
    }
}

/// Every GGUF of every model: logits of all positions within 1e-3 of `logits/<TYPE>.npy`.
#[test]
fn logits_match_transformers_all_files() {
    let mut checked = 0;
    for model in MODELS {
        let dir = fixtures().join(model);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
            .collect();
        files.sort();
        for path in files {
            let stem = path.file_stem().unwrap().to_str().unwrap();
            let ty = stem.rsplit('-').next().unwrap();
            let (shape, want) = read_npy(&dir.join(format!("logits/{ty}.npy")));
            assert_eq!(shape, vec![24, 512]);
            // ar1, token by token.
            let mut e1 = Engine::from_gguf(&path, &opts(&[Variant::Ar(1)], 64)).unwrap();
            let mut step = vec![];
            for &t in &SEQ {
                step.extend(e1.forward(&[t], false).unwrap());
            }
            assert_eq!(e1.position(), 24);
            assert_eq!(
                e1.cache_copies(),
                0,
                "the KV cache must be updated in place"
            );
            // One ar32 call (24 real tokens + 8 padding rows).
            let mut e32 = Engine::from_gguf(&path, &opts(&[Variant::Ar(32)], 64)).unwrap();
            let all = e32.forward(&SEQ, true).unwrap();
            let d1 = max_diff(&step, &want);
            let d32 = max_diff(&all, &want);
            let dd = max_diff(&step, &all);
            eprintln!("{stem}: max|ar1 - ref| {d1:.2e}, max|ar32 - ref| {d32:.2e}, max|ar1 - ar32| {dd:.2e}");
            assert!(d1 <= 1e-3, "{stem}: ar1 logits differ by {d1}");
            assert!(d32 <= 1e-3, "{stem}: ar32 logits differ by {d32}");
            checked += 1;
        }
    }
    assert!(checked >= 3);
}

/// Greedy 16-token continuation of SEQ on the F32 files equals refs.json (the references'
/// smallest top1-top2 margin along these continuations is 0.058, far above our error).
#[test]
fn greedy_continuation_f32() {
    for model in MODELS {
        let dir = fixtures().join(model);
        let refs: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("refs.json")).unwrap()).unwrap();
        let want: Vec<u32> = refs["gguf"]["F32"]["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let path = dir.join(format!("{model}-F32.gguf"));
        let mut e = Engine::from_gguf(&path, &opts(&[Variant::Ar(1), Variant::Ar(8)], 64)).unwrap();
        let mut logits = e.forward(&SEQ, false).unwrap();
        let mut got = vec![];
        for _ in 0..want.len() {
            let t = argmax(&logits);
            got.push(t);
            logits = e.forward(&[t], false).unwrap();
        }
        assert_eq!(got, want, "{model}");
        // truncate + regenerate gives the same continuation again.
        e.truncate(SEQ.len());
        assert!(e.forward(&[], false).is_err());
        let logits = e.forward(&[got[0]], false).unwrap();
        assert_eq!(argmax(&logits), got[1], "{model}: after truncate");
    }
}

/// Context overflow gives the documented error.
#[test]
fn context_overflow_is_a_clear_error() {
    let path = fixtures().join("tiny-qwen2/tiny-qwen2-F32.gguf");
    let mut e = Engine::from_gguf(&path, &opts(&[Variant::Ar(1), Variant::Ar(8)], 16)).unwrap();
    e.forward(&SEQ[..10], false).unwrap();
    let err = e.forward(&SEQ[..7], false).unwrap_err().to_string();
    assert!(
        err.contains("prompt of 7 tokens + 10 generated exceeds the context of 16"),
        "{err}"
    );
    assert_eq!(e.position(), 10);
}

/// Fast precision (f16 KV cache, f16-rounded q and probabilities) on the F32 files: close to
/// the f32 reference (the f16 rounding moves logits by ~4e-3), ar1 and ar32 agree up to f16
/// rounding flips caused by the last-bit differences of M=1 and M=32 products (~6e-4).
#[test]
fn fast_precision_f16_cache_close_to_reference() {
    for model in MODELS {
        let dir = fixtures().join(model);
        let path = dir.join(format!("{model}-F32.gguf"));
        let (_, want) = read_npy(&dir.join("logits/F32.npy"));
        let fast = |v: Variant| EngineOptions {
            precision: Precision::Fast,
            ..opts(&[v], 64)
        };
        let mut e1 = Engine::from_gguf(&path, &fast(Variant::Ar(1))).unwrap();
        let mut step = vec![];
        for &t in &SEQ {
            step.extend(e1.forward(&[t], false).unwrap());
        }
        let mut e32 = Engine::from_gguf(&path, &fast(Variant::Ar(32))).unwrap();
        let all = e32.forward(&SEQ, true).unwrap();
        let (d1, dd) = (max_diff(&step, &want), max_diff(&step, &all));
        eprintln!("{model} fast: max|ar1 - ref| {d1:.2e}, max|ar1 - ar32| {dd:.2e}");
        assert!(d1 < 0.05 && d1 > 0.0, "{model}: {d1}");
        assert!(dd < 5e-3, "{model}: {dd}");
    }
}
