//! all-MiniLM-L6-v2 (sentence-transformers; BERT, 6 layers, hidden 384) as a standard ONNX encoder.
//!
//! `scripts/make_minilm_onnx.py` builds the graph (HF/optimum's BertModel export at opset 17, plus
//! mean pooling and L2 normalisation) from the fetched safetensors; `scripts/check_minilm_onnx.py`
//! checks onnxruntime's run of it against a plain-numpy forward pass of the BERT equations (max abs
//! diff <= 1e-4) and against the model's known semantics (paraphrase cosine > 0.6, unrelated < 0.3),
//! and dumps its batch (12 sentences, padded) with onnxruntime's outputs. `npuc run` on the same
//! ONNX must then give onnxruntime's outputs. Needs `scripts/fetch-data.sh minilm-l6` and the test
//! venv (`scripts/setup.sh` makes both; the test fails naming them otherwise).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The stdout of a command that must succeed (`what` names it in the failure).
fn stdout_of(what: &str, out: Output) -> String {
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{what} failed:\n{o}\n{e}");
    o.into_owned()
}

fn python_script(script: &str, args: &[&str]) -> String {
    let out = npuc_testsupport::python()
        .arg(root().join("scripts").join(script))
        .args(args)
        .output()
        .expect("the test venv's python runs");
    stdout_of(script, out)
}

fn read_f32(p: &Path) -> (Vec<usize>, Vec<f32>) {
    npuc_npy::read_f32(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn minilm_onnx_matches_numpy_onnxruntime_and_npuc() {
    let model_dir = npuc_testsupport::model("minilm-l6", "model.safetensors")
        .parent()
        .unwrap()
        .to_path_buf();
    let tmp = tempfile::tempdir().unwrap();
    let onnx = tmp.path().join("minilm.onnx");
    python_script("make_minilm_onnx.py", &[s(&model_dir), s(&onnx)]);

    let dump = tmp.path().join("dump");
    let line = python_script(
        "check_minilm_onnx.py",
        &[s(&model_dir), s(&onnx), "--dump", s(&dump)],
    );
    let j: serde_json::Value = serde_json::from_str(line.trim()).expect("one JSON line");
    eprintln!("check_minilm_onnx.py: {j}");
    assert!(j["failures"].as_array().unwrap().is_empty(), "{j}");

    let out = tmp.path().join("npuc-out");
    let mut args = vec!["run".to_string(), s(&onnx).to_string()];
    for name in ["input_ids", "attention_mask", "token_type_ids"] {
        args.push("--input".into());
        args.push(format!("{name}={}", s(&dump.join(format!("{name}.npy")))));
    }
    args.extend(["--output-dir".into(), s(&out).to_string()]);
    let o = Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args(&args)
        .output()
        .expect("npuc runs");
    stdout_of("npuc run", o);
    for (name, tol) in [("last_hidden_state", 1e-4f32), ("sentence_embedding", 1e-5)] {
        let (rs, r) = read_f32(&dump.join(format!("ort_{name}.npy")));
        let (ns, n) = read_f32(&out.join(format!("{name}.npy")));
        assert_eq!(ns, rs, "{name}: npuc shape vs onnxruntime's");
        let d = r
            .iter()
            .zip(&n)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{name}: max |npuc - onnxruntime| = {d:.3e}");
        assert!(d <= tol, "{name}: max |npuc - onnxruntime| {d} > {tol}");
    }
}
