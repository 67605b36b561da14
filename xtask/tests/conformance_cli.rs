//! The `xtask` binary as scripts/test.sh runs it. This test also makes `cargo test --workspace`
//! build the binary with the workspace's feature set, so test.sh runs it directly instead of
//! `cargo xtask`, whose single-package build resolved features differently and recompiled about
//! forty crates (4m38s of a CI run).

use std::process::Command;

fn xtask() -> Command {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
}

/// The Relu node tests of the official ONNX suite pass, counted in the JSON summary.
#[test]
fn conformance_runs_one_op_from_the_suite() {
    let suite = npuc_testsupport::cached("suite/onnx-1.22.0/data", "scripts/setup.sh");
    let out = xtask()
        .args(["conformance", "--suite"])
        .arg(&suite)
        .args(["--op", "Relu", "--json"])
        .output()
        .expect("run xtask");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "xtask conformance --op Relu failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON summary");
    let passed = v["passed"].as_u64().unwrap();
    assert!(passed >= 1, "no Relu test passed: {stdout}");
    assert_eq!(v["failed"].as_u64(), Some(0), "{stdout}");
}

/// An unknown task prints the usage and exits with status 2.
#[test]
fn unknown_task_prints_usage() {
    let out = xtask().arg("no-such-task").output().expect("run xtask");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage: cargo xtask conformance"));
}

/// An option-looking word is not taken for the output path of `synth-model` (`--help` used to
/// write a model into a file named `--help`).
#[test]
fn synth_model_refuses_an_option_as_output_path() {
    let d = tempfile::tempdir().unwrap();
    let out = xtask()
        .current_dir(d.path())
        .args(["synth-model", "--help"])
        .output()
        .expect("run xtask");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unexpected argument '--help'"));
    assert!(!d.path().join("--help").exists());
}
