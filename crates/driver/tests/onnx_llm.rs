//! `npuc export`: the ONNX decoder written from a GGUF, run by onnxruntime (prompt in one call,
//! then token by token through `present.*` → `past_key_values.*`), gives the logits of npuc's
//! `exact` precision (dequantized f32) on the same tokens.

use npuc_llm::interop::WeightDtype;
use npuc_llm::{Engine, EngineOptions, Precision, Variant};
use std::path::Path;

/// A prompt of real token ids (SmolLM2/Qwen/Gemma ids alike are < 49152).
const TOKENS: [u32; 12] = [2, 504, 3060, 282, 2114, 314, 1345, 30, 216, 1001, 47, 9];
/// Tokens of the first onnxruntime call (the rest go one at a time).
const PREFILL: usize = 7;

/// Largest |logit difference| allowed. Both sides compute in f32 from the same dequantized
/// weights; they differ only in summation order (GEMM blocking over k ≤ 4864), in rope
/// angles (f64 in npuc, f32 here: ≤ 12 positions × 2⁻²⁴ relative) and in exp/tanh
/// approximations, each ~1e-6 relative per op; through up to 24 residual layers and logits of
/// magnitude ≤ 40 that stays well under 1e-2. A wrong weight, layout or mask moves logits by
/// whole units.
const MAX_ABS: f32 = 1e-2;

fn check(gguf: &Path, dtype: WeightDtype, inline_limit: usize, tol: f32) {
    let dir = tempfile::tempdir().unwrap();
    let onnx = dir.path().join("decoder.onnx");
    let s = npuc_driver::llm::export_onnx(gguf, &onnx, dtype, inline_limit).unwrap();
    assert_eq!(
        s.external_data.is_some(),
        s.weight_bytes > inline_limit,
        "external data when over the limit"
    );
    let out = dir.path().join("ort.npy");
    let ids: Vec<String> = TOKENS.iter().map(|t| t.to_string()).collect();
    let st = npuc_testsupport::python()
        .arg(npuc_testsupport::workspace_root().join("scripts/ort_decoder_logits.py"))
        .arg(&onnx)
        .arg(ids.join(","))
        .arg(PREFILL.to_string())
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success(), "onnxruntime run of {} failed", onnx.display());
    let ort = npuc_npy::read_npy(&out).unwrap();
    let ort = ort.as_slice::<f32>().unwrap().to_vec();
    let mut e = Engine::from_gguf(
        gguf,
        &EngineOptions {
            threads: 1,
            ctx: Some(64),
            precision: Precision::Exact,
            variants: vec![Variant::Ar(1), Variant::Ar(4)],
            weight_quant: Default::default(),
        },
    )
    .unwrap();
    let ours = e.forward(&TOKENS, true).unwrap();
    assert_eq!(
        ours.len(),
        ort.len(),
        "logits [tokens, vocab] on both sides"
    );
    let vocab = ours.len() / TOKENS.len();
    let mut worst = 0f32;
    for (p, (a, b)) in ours.chunks(vocab).zip(ort.chunks(vocab)).enumerate() {
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        worst = worst.max(d);
        let am = |v: &[f32]| {
            v.iter()
                .enumerate()
                .max_by(|x, y| x.1.total_cmp(y.1))
                .unwrap()
                .0
        };
        assert_eq!(am(a), am(b), "{}: argmax at position {p}", gguf.display());
    }
    eprintln!(
        "{}: max |npuc exact - onnxruntime| = {worst:e}",
        gguf.display()
    );
    assert!(
        worst <= tol,
        "{}: max |Δlogit| {worst} > {tol}",
        gguf.display()
    );
}

#[test]
fn smollm2_export_matches_exact_external_data() {
    // Limit 1 byte: every initializer of 1 KiB or more goes to the external data file.
    check(
        &npuc_testsupport::smollm2_gguf(),
        WeightDtype::F32,
        1,
        MAX_ABS,
    );
}

#[test]
fn gemma3_export_matches_exact() {
    check(
        &npuc_testsupport::gemma3_gguf(),
        WeightDtype::F32,
        npuc_driver::llm::ONNX_INLINE_LIMIT,
        MAX_ABS,
    );
}

#[test]
fn qwen25_export_f16_storage() {
    // f16 storage rounds every weight (relative 2⁻¹¹): logits move by up to a few tenths, so
    // this checks the argmax of every position and a bound 50x the f32 one.
    check(
        &npuc_testsupport::qwen25_coder_gguf(),
        WeightDtype::F16,
        npuc_driver::llm::ONNX_INLINE_LIMIT,
        50.0 * MAX_ABS,
    );
}

/// The ONNX export taken back by the recogniser: the same model (its `exact` logits equal the
/// source GGUF's to f32 rounding: the same dequantized weights, now stored as f32).
fn round_trip(gguf: &Path, dtype: WeightDtype, tol: f32) {
    let dir = tempfile::tempdir().unwrap();
    let onnx = dir.path().join("decoder.onnx");
    npuc_driver::llm::export_onnx(gguf, &onnx, dtype, npuc_driver::llm::ONNX_INLINE_LIMIT).unwrap();
    let lifted = dir.path().join("lifted.gguf");
    let findings = npuc_driver::llm::import_onnx_llm(&onnx, None, &lifted).unwrap();
    for f in &findings {
        eprintln!("{f}");
    }
    let logits = |p: &Path| {
        let mut e = Engine::from_gguf(
            p,
            &EngineOptions {
                threads: 1,
                ctx: Some(64),
                precision: Precision::Exact,
                variants: vec![Variant::Ar(1), Variant::Ar(4)],
                weight_quant: Default::default(),
            },
        )
        .unwrap();
        e.forward(&TOKENS, true).unwrap()
    };
    let (a, b) = (logits(gguf), logits(&lifted));
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("{}: max |source - lifted| = {worst:e}", gguf.display());
    assert!(
        worst <= tol,
        "{}: lifted model differs by {worst}",
        gguf.display()
    );
}

#[test]
fn smollm2_onnx_lifts_back() {
    round_trip(&npuc_testsupport::smollm2_gguf(), WeightDtype::F32, 1e-3);
}

#[test]
fn gemma3_onnx_lifts_back() {
    round_trip(&npuc_testsupport::gemma3_gguf(), WeightDtype::F32, 1e-3);
}

#[test]
fn qwen25_f16_onnx_lifts_back() {
    // f16 storage rounds the weights (relative 2⁻¹¹): the bound of the f16 onnxruntime check.
    round_trip(
        &npuc_testsupport::qwen25_coder_gguf(),
        WeightDtype::F16,
        50.0 * MAX_ABS,
    );
}
