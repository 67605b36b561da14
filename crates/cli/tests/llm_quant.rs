//! `--quantize-weights` on a real LLM (SmolLM2-135M): the perplexity cost of re-quantizing the
//! linear layers, measured against the same model unquantized (exact precision both sides, so
//! the difference is the weights' quantization alone), and the gain of calibrating it.
//!
//! Scored text: the GPL-3 text of `tests/fixtures/llm/gemma3/ppl_text.txt` (2 chunks of 256
//! tokens); calibration text: `tests/fixtures/text/sentences_en.txt` (other text, so the
//! calibration never sees what is scored).

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    npuc_testsupport::workspace_root()
}

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args(args)
        .output()
        .expect("npuc runs")
}

/// Perplexity of SmolLM2 (exact precision) with `extra` flags.
fn ppl(extra: &[&str]) -> f64 {
    let model = npuc_testsupport::smollm2_gguf();
    let text = root().join("tests/fixtures/llm/gemma3/ppl_text.txt");
    let mut args = vec![
        "perplexity",
        model.to_str().unwrap(),
        "--file",
        text.to_str().unwrap(),
        "--ctx",
        "256",
        "--chunks",
        "2",
        "--precision",
        "exact",
        "--variants",
        "ar128",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = run(&args);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "npuc {args:?} failed:\n{se}");
    let so = String::from_utf8_lossy(&out.stdout);
    let j: serde_json::Value = serde_json::from_str(so.lines().last().unwrap_or("")).unwrap();
    let p = j["ppl"].as_f64().unwrap();
    eprintln!("{extra:?}: PPL {p:.4}");
    p
}

#[test]
fn requantized_weights_cost_and_calibration_gain() {
    let calib = root().join("tests/fixtures/text/sentences_en.txt");
    let calib = calib.to_str().unwrap();
    let float = ppl(&[]);
    let int8 = ppl(&["--quantize-weights", "int8"]);
    let lpbq = ppl(&["--quantize-weights", "lpbq4"]);
    let lpbq_cal = ppl(&["--quantize-weights", "lpbq4", "--calib-text", calib]);
    let w4a16 = ppl(&[
        "--quantize-weights",
        "lpbq4",
        "--calib-text",
        calib,
        "--act-bits",
        "16",
    ]);
    // 8-bit per-channel weights (about 40 dB weight SQNR) must cost almost nothing: 2% is far
    // above their effect and far below what a wrong scale or a transposed weight would do.
    assert!(
        (int8 - float).abs() / float < 0.02,
        "int8 {int8} vs float {float}"
    );
    // 4-bit weights cost this small model real quality, but not collapse: a broken LPBQ
    // (wrong block mapping, clipped scales) sends perplexity to the hundreds.
    assert!(
        lpbq > float && lpbq < 3.0 * float,
        "lpbq4 {lpbq} vs {float}"
    );
    // The calibrated search weighs each input channel by its activations' RMS; it must
    // beat the weights-only search by at least 5% of perplexity (smaller differences are within
    // the noise of 512 scored tokens).
    assert!(
        lpbq_cal < 0.95 * lpbq,
        "calibrated lpbq4 {lpbq_cal} vs weights-only {lpbq}"
    );
    // 16-bit static activation scales (one per linear input, from the calibration text's
    // range) add little to 4-bit weights: 3% bounds it; a scale from the wrong tensor or an
    // 8-bit grid would exceed it.
    assert!(
        (w4a16 - lpbq_cal).abs() / lpbq_cal < 0.03,
        "w4a16 {w4a16} vs w4 {lpbq_cal}"
    );
}

#[test]
fn bad_weight_quantization_flags_are_refused_clearly() {
    let model = npuc_testsupport::smollm2_gguf();
    let m = model.to_str().unwrap();
    let text = root().join("tests/fixtures/text/sentences_en.txt");
    let t = text.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["--quantize-weights", "lpbq3"],
            "unknown weight quantization 'lpbq3'",
        ),
        (
            &["--quantize-weights", "int8:32"],
            "unknown weight quantization",
        ),
        // SmolLM2's projections have 576 or 1536 input channels: 100 divides neither.
        (&["--quantize-weights", "lpbq4:100"], "block size 100"),
        (
            &[
                "--quantize-weights",
                "lpbq4",
                "--calib-text",
                "/nonexistent/calib.txt",
            ],
            "/nonexistent/calib.txt",
        ),
        (
            &[
                "--quantize-weights",
                "lpbq4",
                "--calib-text",
                t,
                "--awq-alpha",
                "2",
            ],
            "--awq-alpha 2",
        ),
        (
            &[
                "--quantize-weights",
                "lpbq4",
                "--calib-text",
                t,
                "--act-bits",
                "12",
            ],
            "invalid value '12'",
        ),
        // Activation ranges come from the calibration run.
        (
            &["--quantize-weights", "lpbq4", "--act-bits", "16"],
            "--calib-text",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec!["perplexity", m, "--file", t, "--chunks", "1", "--ctx", "64"];
        args.extend_from_slice(extra);
        let out = run(&args);
        let se = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(se.contains(want), "{extra:?}: wanted {want:?} in:\n{se}");
        assert!(!se.contains("panicked"), "{extra:?} panicked:\n{se}");
    }
}
