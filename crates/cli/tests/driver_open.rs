//! Opening an artifact through the driver library runs what `npuc run` runs: small w8a8 QDQ
//! models compiled into artifacts give bit-identical outputs through `npuc_driver::open` and
//! through the `npuc run` binary (which writes them as .npy).

use npuc_ir::Tensor;
use npuc_runtime::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/quant")
        .join(name)
}

/// The `npuc run` output file name of an output (as `run` sanitizes it).
fn npy_name(output: &str) -> String {
    let s: String = output
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{s}.npy")
}

/// Same dtype, shape and bytes.
fn assert_bit_equal(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (g, w) = (
        npuc_cli::npy::npy_bytes(got).unwrap(),
        npuc_cli::npy::npy_bytes(want).unwrap(),
    );
    assert!(g == w, "{what}: values differ");
}

#[test]
fn driver_open_matches_npuc_run_bit_for_bit() {
    // Products lowered without optimizing (each case runs unoptimized first); the optimized
    // artifact must lower as many.
    let mut lowered_unoptimized = 0;
    for (case, optimize) in ["mlp_w8a8", "gemm_w8a8", "attention_w8a8"]
        .into_iter()
        .flat_map(|c| [(c, false), (c, true)])
    {
        let dir = fixture(case);
        let tmp = tempfile::tempdir().unwrap();
        let artifact = tmp.path().join(format!("{case}.npuc"));
        // Both `npuc compile` (optimized: the optimizer keeps the DequantizeLinear of quantized
        // weights) and `npuc compile --no-optimize`.
        npuc_driver::compile(
            &[(case.to_string(), dir.join("model.onnx"))],
            &npuc_driver::CompileOptions {
                optimize,
                ..Default::default()
            },
            &artifact,
            &mut |_: &str| {},
        )
        .unwrap_or_else(|e| panic!("{case}: compile: {e:#}"));
        let case = format!("{case} (optimize: {optimize})");
        let case = case.as_str();

        let opened = npuc_driver::open(&artifact, &npuc_driver::OpenOptions::default())
            .unwrap_or_else(|e| panic!("{case}: open: {e:#}"));
        // The integer path is what is compared: the artifact keeps the QDQ graph and opening
        // it lowers the quantized products.
        assert!(opened.prepared.quantized, "{case}: has Q/DQ nodes");
        assert!(opened.prepared.lowered > 0, "{case}: products lowered");
        if optimize {
            assert_eq!(
                opened.prepared.lowered, lowered_unoptimized,
                "{case}: the optimized artifact lowers as many products as the unoptimized one"
            );
        } else {
            lowered_unoptimized = opened.prepared.lowered;
        }
        let input = opened.session.inputs()[0].name.clone();
        let input_file = dir.join("input_0.npy");
        let x = npuc_cli::npy::read_npy(&input_file).unwrap();
        let outs = opened
            .session
            .run(vec![(input.clone(), Value::tensor(x))])
            .unwrap_or_else(|e| panic!("{case}: run: {e:#}"));
        assert!(!outs.is_empty(), "{case}: outputs");

        let out_dir = tmp.path().join("out");
        let o = Command::new(env!("CARGO_BIN_EXE_npuc"))
            .arg("run")
            .arg(&artifact)
            .arg("-i")
            .arg(format!("{input}={}", input_file.display()))
            .arg("-o")
            .arg(&out_dir)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{case}: npuc run failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        for (name, v) in &outs {
            let got = v.as_tensor().expect("tensor output");
            let want = npuc_cli::npy::read_npy(&out_dir.join(npy_name(name))).unwrap();
            assert_bit_equal(got, &want, &format!("{case}: output '{name}'"));
        }
    }
}
