//! Gemma 3 270M (Q4_K_M GGUF from the data cache; fails with the fetch command when absent):
//! Exact precision against transformers' float32 logits of the same weights, Parity precision
//! against llama.cpp's greedy continuations.

mod common;

use common::{argmax, fixtures, max_diff, read_npy};
use npuc_llm::{Engine, EngineOptions, Precision, Variant};
use std::path::PathBuf;

fn model() -> PathBuf {
    npuc_llm::register_ops();
    npuc_testsupport::gemma3_gguf()
}

fn opts(precision: Precision, variants: &[Variant]) -> EngineOptions {
    EngineOptions {
        threads: 2,
        ctx: Some(256),
        variants: variants.to_vec(),
        precision,
        weight_quant: Default::default(),
    }
}

/// llama.cpp's greedy references of the Gemma fixture.
fn greedy_refs() -> Vec<(Vec<u32>, Vec<u32>)> {
    common::greedy_refs("gemma3/gemma3_270m_greedy.json")
}

#[test]
fn exact_last_logits_match_transformers() {
    let path = model();
    let dir = fixtures().join("gemma3");
    let (_, ids) = read_npy(&dir.join("prompt_ids.npy"));
    let ids: Vec<u32> = ids.iter().map(|&v| v as u32).collect();
    let (_, want) = read_npy(&dir.join("logits_last.npy"));
    let mut e = Engine::from_gguf(
        &path,
        &opts(Precision::Exact, &[Variant::Ar(1), Variant::Ar(32)]),
    )
    .unwrap();
    let got = e.forward(&ids, false).unwrap();
    let d = max_diff(&got, &want);
    eprintln!(
        "gemma3 exact: max |logits_last - transformers| = {d:.3e}, argmax {} (ref {})",
        argmax(&got),
        argmax(&want)
    );
    assert!(d <= 0.01, "max abs diff {d}");
    // Token by token through ar1 gives the same logits.
    e.reset();
    let mut last = vec![];
    for &t in &ids {
        last = e.forward(&[t], false).unwrap();
    }
    let d1 = max_diff(&last, &want);
    eprintln!("gemma3 exact ar1: max diff {d1:.3e}");
    assert!(d1 <= 0.01, "ar1 max abs diff {d1}");
}

#[test]
/// Bit-identical logits with llama.cpp (AVX2 build, its defaults: flash attention, tiled K-quant
/// batch kernel) give the same greedy ids for every reference prompt.
fn parity_greedy_matches_llama_cpp() {
    common::assert_parity_greedy("gemma3", &model(), "gemma3/gemma3_270m_greedy.json");
}

#[test]
/// Fast precision (the default, free to round differently from llama.cpp): teacher-forced top-1
/// agreement with llama.cpp. llama.cpp's greedy continuation of each reference prompt is, at every
/// step, the argmax of its logits for that prefix, evaluated as llama.cpp did (the prompt as one
/// batch, then one token per call); feeding llama.cpp's ids the same way, npuc's argmax must pick
/// the same id at >= 90% of the 192 positions. The floor catches a broken fast kernel (a wrong
/// block decode or attention gives near-random ids, well under 50%), not rounding: fast rounds
/// differently by design and flips near-ties of these continuations (measured 182/192 on
/// 2026-11-27; issue 15's fidelity bar, 99% over the perplexity text, is not asserted here).
fn fast_teacher_forced_top1_agrees_with_llama_cpp() {
    let path = model();
    let refs = greedy_refs();
    let mut e = Engine::from_gguf(
        &path,
        &opts(
            Precision::Fast,
            &[Variant::Ar(1), Variant::Ar(32), Variant::Ar(128)],
        ),
    )
    .unwrap();
    let (mut same, mut total) = (0, 0);
    for (prompt, gen) in &refs {
        e.reset();
        let mut logits = e.forward(prompt, false).unwrap();
        for (t, want) in gen.iter().enumerate() {
            let got = argmax(&logits);
            if got != *want {
                eprintln!(
                    "  prompt of {} tokens, step {t}: npuc {got} llama.cpp {want}",
                    prompt.len()
                );
            }
            same += usize::from(got == *want);
            total += 1;
            if t + 1 < gen.len() {
                logits = e.forward(&[*want], false).unwrap();
            }
        }
    }
    let share = same as f64 / total as f64;
    eprintln!(
        "gemma3 fast: teacher-forced top-1 agreement with llama.cpp {same}/{total} ({:.1}%)",
        share * 100.0
    );
    assert!(share >= 0.90, "{same}/{total} positions agree");
}
