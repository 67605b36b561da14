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
        // GPTQ's second moments come from the calibration run too.
        (
            &["--quantize-weights", "lpbq4", "--weight-rounding", "gptq"],
            "--calib-text",
        ),
        (
            &[
                "--quantize-weights",
                "lpbq4",
                "--calib-text",
                t,
                "--weight-rounding",
                "best",
            ],
            "invalid value 'best'",
        ),
        // An encodings file records grids, not GPTQ's integers.
        (
            &[
                "--quantize-weights",
                "lpbq4",
                "--calib-text",
                t,
                "--weight-rounding",
                "gptq",
                "--export-encodings",
                "/tmp/npuc-never-written.json",
            ],
            "--weight-rounding gptq",
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

/// `--export-encodings` writes the grids the search chose as AIMET 1.0.0 JSON; `--encodings`
/// applies them back without calibration text. The same grids must give the same model (the
/// perplexity, computed in f32 from identical weights, is equal to the last bit) and the
/// re-export the same bytes.
#[test]
fn llm_encodings_round_trip_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let calib = root().join("tests/fixtures/text/sentences_en.txt");
    let (a, b) = (dir.join("a.json"), dir.join("b.json"));
    let chosen = ppl(&[
        "--quantize-weights",
        "lpbq4:32",
        "--quantize-head",
        "int8",
        "--calib-text",
        calib.to_str().unwrap(),
        "--act-bits",
        "16",
        "--export-encodings",
        a.to_str().unwrap(),
    ]);
    let applied = ppl(&[
        "--encodings",
        a.to_str().unwrap(),
        "--export-encodings",
        b.to_str().unwrap(),
    ]);
    assert_eq!(chosen, applied, "the same grids gave another model");
    let (ta, tb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert!(ta == tb, "re-exported encodings differ from the file read");
    // What the file says, checked against SmolLM2's shapes (30 layers of 7 products, the
    // tied embedding as head: 49152 x 576) and LPBQ's rules.
    let j: serde_json::Value = serde_json::from_slice(&ta).unwrap();
    assert_eq!(j["version"], "1.0.0");
    let params = j["param_encodings"].as_array().unwrap();
    assert_eq!(params.len(), 30 * 7 + 1);
    for p in params {
        let name = p["name"].as_str().unwrap();
        let scales = p["scale"].as_array().unwrap().len();
        if name == "token_embd.weight" {
            assert_eq!(p["enc_type"], "PER_CHANNEL");
            assert_eq!((p["bw"].as_u64(), scales), (Some(8), 49152));
            continue;
        }
        assert_eq!(p["enc_type"], "LPBQ", "{name}");
        assert_eq!(
            (
                p["bw"].as_u64(),
                p["block_size"].as_u64(),
                p["compressed_bw"].as_u64()
            ),
            (Some(4), Some(32), Some(4)),
            "{name}"
        );
        let k: Vec<u64> = p["per_block_int_scale"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let cols = if name.contains("ffn_down") { 1536 } else { 576 };
        assert_eq!(k.len(), scales * cols / 32, "{name}");
        assert!(k.iter().all(|&k| (1..=16).contains(&k)), "{name}");
        // The widest block of each output channel defines the channel scale (ideal k = 16); the
        // search may lower it to 60% of that (9), never further.
        for row in k.chunks(cols / 32) {
            assert!(row.iter().max().is_some_and(|&m| m >= 9), "{name}: {row:?}");
        }
    }
    let acts = j["activation_encodings"].as_array().unwrap();
    assert_eq!(acts.len(), 30 * 7 + 1);
    assert!(acts.iter().all(|a| a["bw"] == 16 && a["is_sym"] == true));

    // Bad files: another model's names, flags that contradict the file.
    let text = String::from_utf8(ta).unwrap();
    let other = dir.join("other.json");
    std::fs::write(
        &other,
        text.replace("blk.3.attn_q.weight", "blk.99.attn_q.weight"),
    )
    .unwrap();
    let model = npuc_testsupport::smollm2_gguf();
    let out = run(&[
        "perplexity",
        model.to_str().unwrap(),
        "--file",
        calib.to_str().unwrap(),
        "--ctx",
        "64",
        "--chunks",
        "1",
        "--encodings",
        other.to_str().unwrap(),
    ]);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && se.contains("blk.3.attn_q.weight") && se.contains("encodings"),
        "{se}"
    );
    let out = run(&[
        "perplexity",
        model.to_str().unwrap(),
        "--file",
        calib.to_str().unwrap(),
        "--encodings",
        a.to_str().unwrap(),
        "--quantize-weights",
        "int8",
    ]);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && se.contains("--quantize-weights") && se.contains("--encodings"),
        "{se}"
    );
}
