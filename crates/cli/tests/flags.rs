//! Every flag either acts or is rejected with a message naming it: flags that the chosen mode
//! of a command would ignore (GGUF vs ONNX compile, quantization flags without `--quantize`,
//! calibration flags with `--encodings`, ...) fail before any work, and `--print-passes` acts
//! in a quantized compile.

use npuc_ir::{
    DType, Dim, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo,
};
use std::path::{Path, PathBuf};
use std::process::Command;

fn npuc(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args(args)
        .output()
        .unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs `args`, expects failure, returns stderr.
fn fails(args: &[&str]) -> String {
    let o = npuc(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{args:?} should fail; stderr: {err}");
    err
}

/// Runs `args`, expects success, returns stdout.
fn ok(args: &[&str]) -> String {
    let o = npuc(args);
    assert!(
        o.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `x[batch, 4] -> Identity -> MatMul(w[4, 3]) -> Relu -> y`, with `batch` fixed to 1 or
/// symbolic.
fn write_model(dir: &Path, symbolic_batch: bool) -> PathBuf {
    let batch = if symbolic_batch {
        Dim::Symbolic("batch".into())
    } else {
        Dim::Fixed(1)
    };
    let w: Vec<f32> = (0..12).map(|i| (i as f32 - 5.5) / 6.0).collect();
    let g = Graph {
        name: "m".into(),
        nodes: vec![
            Node::new("Identity", &["x"], &["xi"]),
            Node::new("MatMul", &["xi", "w"], &["h"]),
            Node::new("Relu", &["h"], &["y"]),
        ],
        inputs: vec![ValueInfo::new(
            "x",
            Some(TypeInfo::Tensor {
                dtype: Some(DType::F32),
                shape: Some(vec![batch, Dim::Fixed(4)]),
            }),
        )],
        outputs: vec![ValueInfo::new("y", None)],
        initializers: vec![Initializer {
            name: "w".into(),
            tensor: Tensor::from_vec(vec![4, 3], w).unwrap(),
        }],
        ..Default::default()
    };
    let m = Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: "".into(),
            version: 13,
        }],
        producer_name: "npuc-test".into(),
        graph: g,
        ..Default::default()
    };
    let p = dir.join(if symbolic_batch { "dyn.onnx" } else { "m.onnx" });
    npuc_onnx::save_model(&m, &p, &Default::default()).unwrap();
    p
}

/// Four calibration samples for input `x` of shape [1, 4].
fn calib_dir(dir: &Path) -> PathBuf {
    let d = dir.join("calib");
    std::fs::create_dir_all(&d).unwrap();
    for i in 0..4 {
        let v: Vec<f32> = (0..4).map(|j| ((i * 4 + j) as f32 - 7.0) / 4.0).collect();
        let t = Tensor::from_vec(vec![1, 4], v).unwrap();
        std::fs::write(
            d.join(format!("x_{i:03}.npy")),
            npuc_cli::npy::npy_bytes(&t).unwrap(),
        )
        .unwrap();
    }
    d
}

/// The error names every flag in `flags`.
fn names(err: &str, flags: &[&str]) {
    for f in flags {
        assert!(err.contains(f), "error does not name {f}: {err}");
    }
}

#[test]
fn gguf_compile_rejects_the_flags_it_would_ignore() {
    // The flags are checked before the model is read: the file need not exist.
    for extra in [
        &["--quantize", "w8a8"][..],
        &["--input-shape", "x=1x4"],
        &["--disable-pass", "cse"],
        &["--dim", "batch=1"],
        &["--enable-pass", "attention-fusion"],
        &["--print-passes"],
        &["--no-optimize"],
        &["--name", "g=m.onnx"],
        &["--calib", "calib"],
    ] {
        let mut args = vec!["compile", "model.gguf", "-o", "out.npuc"];
        args.extend(extra);
        let err = fails(&args);
        names(&err, &[extra[0], ".gguf"]);
    }
    let err = fails(&[
        "compile",
        "model.gguf",
        "-o",
        "out.npuc",
        "--quantize",
        "w8a8",
        "--input-shape",
        "x=1",
        "--disable-pass",
        "cse",
    ]);
    names(&err, &["--quantize", "--input-shape", "--disable-pass"]);
}

#[test]
fn onnx_compile_rejects_gguf_and_quantization_flags() {
    let t = tempfile::tempdir().unwrap();
    let model = write_model(t.path(), false);
    let out = t.path().join("m.npuc");
    for extra in [
        &["--variants", "ar1"][..],
        &["--ctx", "64"],
        &["--precision", "exact"],
    ] {
        let mut args = vec!["compile", s(&model), "-o", s(&out)];
        args.extend(extra);
        let err = fails(&args);
        names(&err, &[extra[0], ".gguf"]);
    }
    let calib = calib_dir(t.path());
    let err = fails(&["compile", s(&model), "-o", s(&out), "--calib", s(&calib)]);
    names(&err, &["--calib", "--quantize"]);
    let err = fails(&[
        "compile",
        s(&model),
        "-o",
        s(&out),
        "--no-optimize",
        "--disable-pass",
        "cse",
        "--print-passes",
    ]);
    names(&err, &["--disable-pass", "--print-passes", "--no-optimize"]);
    assert!(!out.exists(), "nothing is written on a rejected flag");
}

#[test]
fn quantized_compile_prints_passes_and_rejects_ignored_flags() {
    let t = tempfile::tempdir().unwrap();
    let model = write_model(t.path(), false);
    let calib = calib_dir(t.path());
    let out = t.path().join("q.npuc");
    let base = [
        "compile",
        s(&model),
        "-o",
        s(&out),
        "--quantize",
        "w8a8",
        "--no-progress",
    ];
    // --print-passes acts: the standard-ONNX optimization removed the Identity.
    let mut args = base.to_vec();
    args.extend(["--calib", s(&calib), "--print-passes"]);
    let stdout = ok(&args);
    assert!(stdout.contains("[m] passes:"), "{stdout}");
    assert!(
        stdout.contains("identity-elim (iteration 1)"),
        "the Identity removal is listed: {stdout}"
    );
    // Without --print-passes the records are not printed.
    let mut args = base.to_vec();
    args.extend(["--calib", s(&calib)]);
    assert!(!ok(&args).contains("passes:"));

    let enc = t.path().join("enc.json");
    let mut args = base.to_vec();
    args.extend(["--calib", s(&calib), "--emit-encodings", s(&enc)]);
    ok(&args);
    for (extra, flag) in [
        // Calibration flags with --encodings.
        (
            vec!["--encodings", s(&enc), "--calib", s(&calib)],
            "--calib",
        ),
        (
            vec!["--encodings", s(&enc), "--calib-method", "mse"],
            "--calib-method",
        ),
        // Flags that apply only with another flag.
        (
            vec!["--calib", s(&calib), "--percentile", "99.9"],
            "--percentile",
        ),
        (
            vec!["--calib", s(&calib), "--block-size", "16"],
            "--block-size",
        ),
        (
            vec![
                "--calib",
                s(&calib),
                "--granularity",
                "per-block",
                "--compressed-bw",
                "4",
            ],
            "--compressed-bw",
        ),
        (vec!["--calib", s(&calib), "--mean", "0.5"], "--mean"),
        (
            vec!["--calib", s(&calib), "--encodings-version", "1.0.0"],
            "--encodings-version",
        ),
        // Opt-in passes produce npuc-domain ops, which a QDQ graph must not hold.
        (
            vec!["--calib", s(&calib), "--enable-pass", "attention-fusion"],
            "--enable-pass",
        ),
        // A pass name that does not exist was silently ignored before.
        (
            vec!["--calib", s(&calib), "--disable-pass", "no-such-pass"],
            "--disable-pass",
        ),
    ] {
        let mut args = base.to_vec();
        args.extend(extra.iter().copied());
        names(&fails(&args), &[flag]);
    }
}

#[test]
fn inspect_rejects_flags_per_model_kind() {
    let t = tempfile::tempdir().unwrap();
    let model = write_model(t.path(), false);
    let err = fails(&["inspect", s(&model), "--verify"]);
    names(&err, &["--verify"]);
    let art = t.path().join("m.npuc");
    ok(&["compile", s(&model), "-o", s(&art)]);
    let err = fails(&["inspect", s(&art), "--input-shape", "x=1x4"]);
    names(&err, &["--input-shape"]);
    let err = fails(&["inspect", "model.gguf", "--dim", "batch=1"]);
    names(&err, &["--dim", ".gguf"]);
}

/// `inspect` gets output shapes from static inference: with the batch bound the output shape
/// is known; unbound, the note says which input to bind.
#[test]
fn inspect_infers_output_shapes_statically() {
    let t = tempfile::tempdir().unwrap();
    let model = write_model(t.path(), false);
    let out = ok(&["inspect", s(&model)]);
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("y "))
        .unwrap_or_else(|| panic!("no output line: {out}"));
    assert!(line.contains("f32[1, 3]  (declared"), "{line}");
    let dynamic = write_model(t.path(), true);
    let out = ok(&["inspect", s(&dynamic)]);
    assert!(out.contains("declared ? (not verified)"), "{out}");
    assert!(
        out.contains("no static shape for output 'y': input 'x' has unbound dims"),
        "{out}"
    );
    let out = ok(&["inspect", s(&dynamic), "--input-shape", "x=2x4"]);
    assert!(out.contains("f32[2, 3]  (declared"), "{out}");
    let j: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", s(&dynamic), "--dim", "batch=5", "--json"])).unwrap();
    assert_eq!(j["outputs"][0]["inferred"], "f32[5, 3]");
}

#[test]
fn run_and_bench_reject_flags_of_another_mode() {
    let t = tempfile::tempdir().unwrap();
    let model = write_model(t.path(), false);
    let err = fails(&["run", s(&model), "--simulate"]);
    names(&err, &["--simulate"]);
    let err = fails(&["bench", s(&model), "--runs", "1", "--simulate"]);
    names(&err, &["--simulate"]);
    let err = fails(&["bench", s(&model), "--gen", "8"]);
    names(&err, &["--gen"]);
    let err = fails(&["bench", s(&model), "--runs", "1", "--precision", "exact"]);
    names(&err, &["--precision"]);
    let err = fails(&["bench", "model.gguf", "--profile"]);
    names(&err, &["--profile", "LLM"]);
    let err = fails(&[
        "bench",
        s(&model),
        "--prompt-len",
        "4",
        "--input-shape",
        "x=1x4",
    ]);
    names(&err, &["--input-shape", "LLM"]);
}

#[test]
fn llm_commands_reject_flags_they_would_ignore() {
    // Checked before the model is loaded: the files need not exist.
    let err = fails(&["generate", "m.gguf", "--prompt-tokens", "1,2", "--chat"]);
    names(&err, &["--chat", "--prompt-tokens"]);
    let err = fails(&[
        "generate",
        "m.gguf",
        "--prompt",
        "hi",
        "--chat-template",
        "{{x}}",
    ]);
    names(&err, &["--chat-template", "--chat"]);
    let err = fails(&[
        "generate",
        "m.gguf",
        "--prompt-tokens",
        "1",
        "--max-tokens",
        "0",
        "--logits-out",
        "l.npy",
        "--temperature",
        "0",
    ]);
    names(&err, &["--temperature", "--logits-out"]);
    let err = fails(&[
        "generate",
        "m.npuc",
        "--prompt",
        "hi",
        "--precision",
        "exact",
    ]);
    names(&err, &["--precision"]);
    let err = fails(&[
        "perplexity",
        "m.gguf",
        "--file",
        "t.txt",
        "--chat-template",
        "x",
    ]);
    names(&err, &["--chat-template"]);
}

#[test]
fn verify_rejects_suggest_flags_without_suggest() {
    let err = fails(&[
        "verify",
        "q.onnx",
        "--reference",
        "f.onnx",
        "--inputs",
        "d",
        "--headroom",
        "2",
    ]);
    names(&err, &["--headroom", "--suggest"]);
}

/// Inputs that used to panic, abort or be silently accepted get a clear error naming them.
#[test]
fn bad_bindings_threads_and_paths_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let m = write_model(tmp.path(), true);
    // A dimension past the address range (was: capacity-overflow panic).
    let e = fails(&[
        "inspect",
        s(&m),
        "--input-shape",
        "x=1x3x48x18446744073709551615",
    ]);
    assert!(
        e.contains("x=1x3x48x18446744073709551615") && e.contains("addressed"),
        "{e}"
    );
    // The same input or dimension bound twice.
    let e = fails(&[
        "inspect",
        s(&m),
        "--input-shape",
        "x=1x4",
        "--input-shape",
        "x=2x4",
    ]);
    assert!(e.contains("--input-shape x is given twice"), "{e}");
    let e = fails(&["inspect", s(&m), "--dim", "batch=1", "--dim", "batch=2"]);
    assert!(e.contains("--dim batch is given twice"), "{e}");
    // --threads 0 (was accepted by run and bench; by verify until the CLI fuzzer found it).
    for cmd in ["run", "bench"] {
        let e = fails(&[cmd, s(&m), "--threads", "0"]);
        assert!(e.contains("--threads") && e.contains("'0'"), "{cmd}: {e}");
    }
    let e = fails(&[
        "verify",
        s(&m),
        "--reference",
        s(&m),
        "--inputs",
        s(tmp.path()),
        "--threads",
        "0",
    ]);
    assert!(e.contains("--threads") && e.contains("'0'"), "verify: {e}");
    // A directory as the model: one clear sentence (was "No such device" twice).
    let e = fails(&["run", s(tmp.path())]);
    assert!(
        e.contains("is a directory") && !e.contains("os error 19"),
        "{e}"
    );
}
