//! MHA → SHA (`npuc_llm::build::sha`) on the three LLMs of the data cache (Gemma 3 270M:
//! 4 heads over 1 KV head, q/k norms; SmolLM2-135M: 9 over 3, llama rope; Qwen2.5-Coder-0.5B:
//! 14 over 2, q/k/v biases): the single-head graphs give the multi-head graphs' logits and
//! greedy tokens, and their caches are one tensor per KV head.

mod common;

use common::{argmax, max_diff};
use npuc_gguf::GgufFile;
use npuc_llm::build::build_with;
use npuc_llm::build::sha;
use npuc_llm::{BuildOptions, Engine, Precision, Variant, WeightMode};
use std::path::Path;

/// Largest |SHA - MHA| allowed on any logit in exact (f32) precision. The per-head products
/// are row slices of the same matrices (each output element the same dot product), attention
/// runs per head in both forms, so the only possible difference is the order in which the
/// kernels sum (a GEMM over a slice of 64 output rows may tile K differently than over the
/// whole matrix): f32 rounding, ~1e-7 relative per sum, grown through up to 24 layers, on
/// logits of magnitude <= ~40. 1e-3 leaves a margin of ~10x over that while a wrong head
/// slice, KV-head mapping or concat order changes logits by whole units.
const EXACT_TOL: f32 = 1e-3;

/// Over 32 tokens: the prompt's first chunk runs the AR-32 graph at 32 rows (fast precision:
/// the f32 GEMM path for 16+ rows), the rest AR-1 (8-bit activation path).
const PROMPT: &str = "The capital of France is Paris, the capital of Italy is Rome, the capital of Spain is Madrid, the capital of Portugal is Lisbon, and the capital of Germany is";

fn engine(path: &Path, precision: Precision, single_head: bool) -> Engine {
    let g = GgufFile::open(path).unwrap();
    let hp = npuc_llm::build::hparams(&g).unwrap();
    let models = [1usize, 32]
        .iter()
        .map(|&n| {
            let m = build_with(
                &g,
                &hp,
                &BuildOptions {
                    tokens: n,
                    ctx: 96,
                    precision,
                    weights: WeightMode::Auto,
                    weight_quant: Default::default(),
                    repacked: Default::default(),
                },
            )
            .unwrap();
            let m = if single_head {
                let s = sha::to_sha(&m).unwrap();
                check_sha_shape(&m, &s, hp.n_layers, hp.n_kv_head, hp.n_head);
                s
            } else {
                m
            };
            (Variant::Ar(n), m)
        })
        .collect();
    Engine::from_models(models, Default::default(), 2).unwrap()
}

/// Per KV head cache inputs/outputs, per head attention nodes, no whole-layer KV left.
fn check_sha_shape(mha: &npuc_ir::Model, s: &npuc_ir::Model, layers: usize, kvh: usize, h: usize) {
    assert!(sha::is_sha(s) && !sha::is_sha(mha));
    let names: Vec<&str> = s.graph.inputs.iter().map(|i| i.name.as_str()).collect();
    for l in 0..layers {
        assert!(!names.contains(&format!("past_key.{l}").as_str()));
        for g in 0..kvh {
            assert!(
                names.contains(&format!("past_key.{l}.h{g}").as_str()),
                "{names:?}"
            );
            assert!(names.contains(&format!("past_value.{l}.h{g}").as_str()));
            assert!(s
                .graph
                .outputs
                .iter()
                .any(|o| o.name == format!("new_value.{l}.h{g}")));
        }
    }
    let count =
        |m: &npuc_ir::Model, op: &str| m.graph.nodes.iter().filter(|n| n.op_type == op).count();
    assert_eq!(count(s, "CachedAttention"), layers * h);
    assert_eq!(count(mha, "CachedAttention"), layers);
    // Same weight bytes: the slices replace the whole projections.
    let bytes = |m: &npuc_ir::Model| -> usize {
        m.graph
            .initializers
            .iter()
            .filter(|i| i.name.starts_with("blk."))
            .map(|i| i.tensor.len() * i.tensor.dtype().size())
            .sum()
    };
    assert_eq!(bytes(s), bytes(mha));
}

/// Runs the prompt (all rows' logits) and `n` greedy tokens on both forms; returns the largest
/// logit difference.
fn compare(path: &Path, precision: Precision, n: usize) -> f32 {
    let tok = npuc_tokenizer::Tokenizer::from_gguf_path(path).unwrap();
    let ids = tok.encode(PROMPT, true).unwrap();
    let mut mha = engine(path, precision, false);
    let mut sha = engine(path, precision, true);
    let a = mha.forward(&ids, true).unwrap();
    let b = sha.forward(&ids, true).unwrap();
    let mut worst = max_diff(&a, &b);
    let vocab = mha.vocab();
    let (mut ta, mut tb) = (
        vec![argmax(&a[a.len() - vocab..])],
        vec![argmax(&b[b.len() - vocab..])],
    );
    while ta.len() < n {
        let la = mha.forward(&[*ta.last().unwrap()], false).unwrap();
        let lb = sha.forward(&[*tb.last().unwrap()], false).unwrap();
        worst = worst.max(max_diff(&la, &lb));
        ta.push(argmax(&la));
        tb.push(argmax(&lb));
    }
    assert_eq!(ta, tb, "{}: greedy tokens differ", path.display());
    assert_eq!(sha.cache_copies(), 0);
    eprintln!(
        "{} {}: SHA vs MHA max |logit diff| {worst:e} over {} prompt rows + {n} greedy steps",
        path.file_name().unwrap().to_string_lossy(),
        precision.name(),
        ids.len()
    );
    worst
}

fn exact_and_fast(path: &Path) {
    npuc_llm::register_ops();
    let d = compare(path, Precision::Exact, 12);
    assert!(
        d <= EXACT_TOL,
        "exact: SHA vs MHA max |diff| {d} > {EXACT_TOL}"
    );
    // Fast precision: the same activation quantization (per product, per row) and the same
    // kernels run per head; the greedy tokens must agree (asserted in `compare`).
    compare(path, Precision::Fast, 12);
}

#[test]
fn sha_equals_mha_gemma3() {
    exact_and_fast(&npuc_testsupport::gemma3_gguf());
}

#[test]
fn sha_equals_mha_smollm2() {
    exact_and_fast(&npuc_testsupport::smollm2_gguf());
}

#[test]
fn sha_equals_mha_qwen25() {
    exact_and_fast(&npuc_testsupport::qwen25_coder_gguf());
}

#[test]
fn sha_refuses_a_graph_without_attention() {
    let m = npuc_ir::Model::default();
    let e = sha::to_sha(&m).unwrap_err().to_string();
    assert!(e.contains("no npuc.CachedAttention"), "{e}");
}

#[test]
fn row_slices_borrow_and_copy_the_same_bytes() {
    let t = npuc_ir::Tensor::from_vec(vec![4, 3], (0..12).map(|x| x as f32).collect()).unwrap();
    let s = sha::slice_rows(&t, 1, 2).unwrap();
    assert_eq!(s.shape(), &[2, 3]);
    assert_eq!(s.as_slice::<f32>().unwrap(), &[3., 4., 5., 6., 7., 8.]);
    let bytes: std::sync::Arc<dyn npuc_ir::Backing> = std::sync::Arc::new(t.to_le_bytes().unwrap());
    let b = npuc_ir::Tensor::from_le_bytes(npuc_ir::DType::F32, vec![4, 3], bytes, 0, 48).unwrap();
    let s = sha::slice_rows(&b, 2, 2).unwrap();
    assert!(s.is_borrowed());
    assert_eq!(s.as_slice::<f32>().unwrap(), &[6., 7., 8., 9., 10., 11.]);
    assert!(sha::slice_rows(&b, 3, 2).is_err());
}
