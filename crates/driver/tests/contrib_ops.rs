//! onnxruntime contrib ops (`com.microsoft`) as optimized and GenAI exports use them: npuc's
//! import rewrites each into an exact equivalent (`npuc_onnx::contrib`), or a runtime kernel
//! runs it (RotaryEmbedding, Attention, MultiHeadAttention, GroupQueryAttention,
//! EmbedLayerNormalization: `npuc_runtime::ops::contrib*`); on one small graph per op and
//! attribute or input combination (made and run by onnxruntime,
//! `scripts/contrib_op_refs.py`), npuc's outputs equal onnxruntime's, run as imported and
//! after `npuc compile` (optimized, serialized, loaded back).

use npuc_runtime::{Session, SessionOptions, Value};
use std::path::Path;

/// Per element: |npuc − onnxruntime| ≤ ABS + REL·|onnxruntime|. Both evaluate the same f32
/// formulas; they differ in the tanh/erf/exp/rsqrt implementations (onnxruntime's MLAS
/// polynomials vs npuc's, each within a few f32 ulps, ~1e-6 relative) and in summation order
/// (normalizations over 8 values, products over 5, attention dot products over 16 and
/// softmax sums over up to 7 keys). Inputs are O(1); a wrong formula, epsilon, axis, mask,
/// position or operand order is off by 1e-2 or more. Integer outputs (mask_index) must be
/// equal.
const ABS: f32 = 1e-5;
const REL: f32 = 1e-5;

#[test]
fn contrib_ops_match_onnxruntime() {
    let dir = tempfile::tempdir().unwrap();
    let st = npuc_testsupport::python()
        .arg(npuc_testsupport::workspace_root().join("scripts/contrib_op_refs.py"))
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(st.success(), "scripts/contrib_op_refs.py failed");
    let mut cases: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    cases.sort();
    assert_eq!(cases.len(), 45, "{cases:?}");
    for case in &cases {
        check(case);
    }
}

fn check(case: &Path) {
    let name = case.file_name().unwrap().to_string_lossy().into_owned();
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(case.join("meta.json")).unwrap()).unwrap();
    let m = npuc_onnx::load_model(&case.join("model.onnx")).unwrap();
    assert!(
        m.graph.nodes.iter().all(|n| n.domain != "com.microsoft"
            || matches!(
                n.op_type.as_str(),
                "RotaryEmbedding"
                    | "Attention"
                    | "MultiHeadAttention"
                    | "GroupQueryAttention"
                    | "EmbedLayerNormalization"
            )),
        "{name}: a contrib op without a kernel left after import"
    );
    let feeds: Vec<(String, Value)> = meta["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let t = npuc_npy::read_npy(&case.join(format!("in_{i}.npy"))).unwrap();
            (n.as_str().unwrap().to_string(), Value::tensor(t))
        })
        .collect();
    let sess = Session::new(&m, SessionOptions { threads: 1 }).unwrap();
    compare(&name, case, &meta, sess.run(feeds.clone()).unwrap());
    // The compile path: import, verify, optimize, plan, serialize, load back.
    let opts = npuc_driver::CompileOptions {
        optimize: true,
        ..Default::default()
    };
    let (bytes, _) = npuc_driver::compile::compile_to_bytes(
        &[("main".to_string(), case.join("model.onnx"))],
        &opts,
        &mut |_: &str| {},
    )
    .unwrap_or_else(|e| panic!("{name}: compile: {e:#}"));
    let a = npuc_format::Artifact::from_bytes(&case.join("model.npuc"), bytes).unwrap();
    let cm = a.model(Some("main")).unwrap();
    let sess = Session::new(&cm, SessionOptions { threads: 2 }).unwrap();
    compare(
        &format!("{name} (compiled)"),
        case,
        &meta,
        sess.run(feeds).unwrap(),
    );
}

fn compare(name: &str, case: &Path, meta: &serde_json::Value, outs: Vec<(String, Value)>) {
    for (i, want_name) in meta["outputs"].as_array().unwrap().iter().enumerate() {
        let want_name = want_name.as_str().unwrap();
        let (_, got) = outs
            .iter()
            .find(|(n, _)| n == want_name)
            .unwrap_or_else(|| panic!("{name}: no output {want_name}"));
        let got = got.as_tensor().unwrap();
        let (shape, want) = npuc_npy::read_f32(&case.join(format!("out_{i}.npy"))).unwrap();
        assert_eq!(got.shape(), shape.as_slice(), "{name}: {want_name} shape");
        let is_int = !got.dtype().is_float();
        let got: Vec<f32> = got
            .to_f64_vec()
            .unwrap()
            .iter()
            .map(|&v| v as f32)
            .collect();
        if is_int {
            assert_eq!(got, want, "{name}: {want_name} differs from onnxruntime");
            continue;
        }
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() / (ABS + REL * w.abs()))
            .fold(0f32, f32::max);
        eprintln!("{name}/{want_name}: worst |diff| / bound = {worst:.3}");
        assert!(worst <= 1.0, "{name}: {want_name} differs from onnxruntime");
    }
}
