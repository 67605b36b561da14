//! Malformed models give errors that name the architecture, key or tensor involved.

mod common;

use common::fixtures;
use npuc_gguf::write::{to_bytes, WriteTensor};
use npuc_gguf::{GgufFile, MetaValue};
use npuc_llm::{build, BuildOptions, Precision, WeightMode};

/// The tiny qwen2 F32 file with `edit` applied to its metadata and tensor list.
fn variant(edit: impl Fn(&mut Vec<(String, MetaValue)>, &mut Vec<String>)) -> GgufFile {
    let g = GgufFile::open(fixtures().join("tiny-qwen2/tiny-qwen2-F32.gguf")).unwrap();
    let mut meta = g.metadata.clone();
    let mut keep: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
    edit(&mut meta, &mut keep);
    let tensors: Vec<WriteTensor> = g
        .tensors
        .iter()
        .filter(|t| keep.contains(&t.name))
        .map(|t| WriteTensor {
            name: t.name.clone(),
            ggml_type: t.ggml_type,
            dims: t.dims.clone(),
            data: g.tensor_bytes(t),
        })
        .collect();
    GgufFile::from_bytes("edited.gguf", to_bytes(&meta, &tensors).unwrap()).unwrap()
}

fn err(g: &GgufFile) -> String {
    let o = BuildOptions {
        tokens: 1,
        ctx: 16,
        precision: Precision::Exact,
        weights: WeightMode::Auto,
        weight_quant: Default::default(),
        repacked: Default::default(),
    };
    build(g, &o).expect_err("the build must fail").to_string()
}

fn set(meta: &mut [(String, MetaValue)], key: &str, v: MetaValue) {
    meta.iter_mut().find(|(k, _)| k == key).unwrap().1 = v;
}

#[test]
fn unknown_architecture() {
    let g = variant(|m, _| set(m, "general.architecture", MetaValue::String("mamba".into())));
    let e = err(&g);
    assert!(
        e.contains("architecture 'mamba' is not supported (supported: llama, qwen2, gemma3)"),
        "{e}"
    );
}

#[test]
fn head_counts_that_do_not_divide() {
    let g = variant(|m, _| set(m, "qwen2.attention.head_count_kv", MetaValue::U32(3)));
    let e = err(&g);
    assert!(
        e.contains("head_count 4 is not a multiple of qwen2.attention.head_count_kv 3"),
        "{e}"
    );
}

#[test]
fn missing_tensor() {
    let g = variant(|_, t| t.retain(|n| n != "blk.1.ffn_up.weight"));
    let e = err(&g);
    assert!(
        e.contains("blk.1.ffn_up.weight") && e.contains("missing (required by the qwen2 builder)"),
        "{e}"
    );
}

#[test]
fn wrong_tensor_shape() {
    // 8 heads of key_length 64 claimed: q would need 512 rows.
    let g = variant(|m, _| set(m, "qwen2.attention.head_count", MetaValue::U32(8)));
    let e = err(&g);
    assert!(
        e.contains("'blk.0.attn_q.weight': has shape [256, 256], expected [512, 256]"),
        "{e}"
    );
}

#[test]
fn missing_key() {
    let g = variant(|m, _| m.retain(|(k, _)| k != "qwen2.block_count"));
    let e = err(&g);
    assert!(
        e.contains("qwen2.block_count") && e.contains("missing"),
        "{e}"
    );
}

/// A context whose KV cache cannot fit in memory is refused before anything is allocated, with
/// the size it needs.
#[test]
fn context_larger_than_memory_is_refused() {
    let path = fixtures().join("tiny-qwen2/tiny-qwen2-F32.gguf");
    for ctx in [1usize << 40, usize::MAX / 2] {
        let opts = npuc_llm::EngineOptions {
            threads: 1,
            ctx: Some(ctx),
            variants: vec![npuc_llm::Variant::Ar(1)],
            precision: Precision::Exact,
            weight_quant: Default::default(),
        };
        let e = match npuc_llm::Engine::from_gguf(&path, &opts) {
            Ok(_) => panic!("a context of {ctx} slots must be refused"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("lower --ctx") && (e.contains("GB") || e.contains("too large")),
            "{e}"
        );
    }
}
