//! `npuc verify` on a real model: the PP-OCRv5 recogniser quantized by onnxruntime's
//! `quantize_static` (QDQ, per-channel, MinMax) with ONE calibration sample, the deliberately
//! broken calibration, by scripts/make_ort_qdq.py. The per-layer numbers are checked against the
//! same metrics computed in numpy on onnxruntime's run of both models (the test venv's Python,
//! made by scripts/setup.sh; the tests fail, naming that command, without it or the model).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn npuc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args(args)
        .output()
        .expect("npuc runs")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The fixture directory (float.onnx, q.onnx, calib/, heldout/), made once per test binary.
fn fixture() -> &'static PathBuf {
    static F: OnceLock<PathBuf> = OnceLock::new();
    F.get_or_init(|| {
        let model = npuc_testsupport::model("ppocrv5", "ppocrv5_rec.onnx");
        let dir = std::env::temp_dir().join(format!("npuc-verify-{}", std::process::id()));
        let out = npuc_testsupport::python()
            .arg(root().join("scripts/make_ort_qdq.py"))
            .args(["make", s(&model), s(&dir), "--calib", "1", "--heldout", "4"])
            .output()
            .expect("the test venv's python runs");
        assert!(
            out.status.success(),
            "make_ort_qdq.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
}

fn verify_json(dir: &Path, q: &Path, extra: &[&str]) -> serde_json::Value {
    let (float, heldout) = (dir.join("float.onnx"), dir.join("heldout"));
    let mut args = vec![
        "verify",
        s(q),
        "--reference",
        s(&float),
        "--inputs",
        s(&heldout),
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = npuc(&args);
    assert!(
        o.status.success(),
        "npuc verify failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("verify --json prints JSON")
}

#[test]
fn per_layer_sqnr_matches_numpy_on_onnxruntime() {
    let dir = fixture();
    let j = verify_json(dir, &dir.join("q.onnx"), &[]);
    let out = npuc_testsupport::python()
        .arg(root().join("scripts/make_ort_qdq.py"))
        .args([
            "sqnr",
            s(&dir.join("float.onnx")),
            s(&dir.join("q.onnx")),
            s(&dir.join("heldout")),
        ])
        .output()
        .expect("the test venv's python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let layers = j["layers"].as_array().unwrap();
    assert!(layers.len() > 400, "only {} layers compared", layers.len());
    // onnxruntime and npuc differ by float rounding, which flips a few quantization bins deep in
    // the network: exact agreement early, a fraction of a dB late.
    let mut diffs = vec![];
    for l in layers {
        let name = l["name"].as_str().unwrap();
        let o = &r["layers"][name];
        assert!(
            o.is_object(),
            "layer '{name}' missing from the numpy reference"
        );
        match (l["sqnr_db"].as_f64(), o["sqnr_db"].as_f64()) {
            (Some(a), Some(b)) => {
                assert!((a - b).abs() < 0.5, "{name}: npuc {a} dB vs numpy {b} dB");
                diffs.push((a - b).abs());
            }
            (None, None) => {}
            (a, b) => panic!("{name}: npuc {a:?} vs numpy {b:?} (null = exact)"),
        }
        let (ca, cb) = (l["cosine"].as_f64().unwrap(), o["cosine"].as_f64().unwrap());
        // The cosine bound is the SQNR bound's counterpart: with an uncorrelated error,
        // cos = (1 + 10^(-SQNR/10))^(-1/2), whose slope is largest at low SQNR (about 0.022 per dB
        // at 5 dB), so the 0.5 dB allowance above moves a 5 dB layer's cosine by about 0.011.
        // (Measured with npuc's convolutions integer and onnxruntime's float: the deepest
        // difference is PP-OCR's attention softmax, 5.85 vs 5.51 dB, cosine 0.863 vs 0.851.)
        assert!((ca - cb).abs() < 2e-2, "{name}: cosine {ca} vs {cb}");
    }
    diffs.sort_by(f64::total_cmp);
    let median = diffs[diffs.len() / 2];
    assert!(median < 0.02, "median |npuc - numpy| = {median} dB");
    // The first layer sees identical inputs in both runtimes: equal to numerical precision.
    let first = layers[0]["name"].as_str().unwrap();
    let (a, b) = (
        layers[0]["sqnr_db"].as_f64().unwrap(),
        r["layers"][first]["sqnr_db"].as_f64().unwrap(),
    );
    assert!((a - b).abs() < 1e-6, "{first}: {a} vs {b}");
    let out_name = j["output"]["name"].as_str().unwrap();
    let (a, b) = (
        j["output"]["sqnr_db"].as_f64().unwrap(),
        r["output"][out_name]["sqnr_db"].as_f64().unwrap(),
    );
    assert!((a - b).abs() < 0.5, "output SQNR npuc {a} vs numpy {b}");
    eprintln!(
        "{} layers; median |npuc - numpy| {median:.2e} dB, max {:.3} dB; output {a:.2} dB (numpy on onnxruntime {b:.2} dB)",
        diffs.len(),
        diffs.last().unwrap()
    );
}

#[test]
fn broken_calibration_names_first_bad_layer_and_html_report() {
    let dir = fixture();
    let report = dir.join("report.html");
    let o = npuc(&[
        "verify",
        s(&dir.join("q.onnx")),
        "--reference",
        s(&dir.join("float.onnx")),
        "--inputs",
        s(&dir.join("heldout")),
        "--report",
        s(&report),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    let first = text
        .lines()
        .find(|l| l.starts_with("first bad layer: "))
        .unwrap_or_else(|| panic!("no first bad layer in:\n{text}"));
    let last = text.lines().last().unwrap();
    let rest = last
        .strip_prefix("output SQNR: ")
        .unwrap_or_else(|| panic!("last line: {last}"));
    let (db, cos) = rest.split_once(" dB, cosine: ").expect("X dB, cosine: Y");
    let db: f64 = db.parse().unwrap();
    let cos: f64 = cos.parse().unwrap();
    assert!(db < 20.0 && (0.0..=1.0).contains(&cos), "{last}");
    eprintln!("{first}\n{last}");

    let j = verify_json(dir, &dir.join("q.onnx"), &[]);
    let n = j["layers"].as_array().unwrap().len();
    let bad = j["first_bad_layer"]["name"]
        .as_str()
        .expect("a first bad layer");
    assert!(first.contains(bad), "{first} vs json {bad}");
    let html = std::fs::read_to_string(&report).expect("report written");
    assert_eq!(
        html.matches("<circle class=\"pt").count(),
        n,
        "one point per layer"
    );
    assert_eq!(html.matches("class=\"pt bad\"").count(), 1);
    assert_eq!(
        html.matches("<tr").count(),
        n + 1,
        "header + one row per layer"
    );
    assert!(html.contains("class=\"threshold\""));
    for banned in ["<script", "src=", "href=", "@import", "url("] {
        assert!(!html.contains(banned), "report references {banned}");
    }
}

#[test]
fn suggest_apply_reaches_target_on_reverification() {
    let dir = fixture();
    let base = verify_json(dir, &dir.join("q.onnx"), &[]);
    let base_db = base["output"]["sqnr_db"].as_f64().unwrap();
    let target = (base_db + 6.0).round();
    let overrides = dir.join("overrides.json");
    let promoted = dir.join("promoted.onnx");
    let t = target.to_string();
    let j = verify_json(
        dir,
        &dir.join("q.onnx"),
        &[
            "--suggest",
            "--target-sqnr",
            &t,
            "--headroom",
            "4",
            "--prune-evals",
            "4",
            "--apply",
            s(&overrides),
            "--apply-model",
            s(&promoted),
        ],
    );
    let sg = &j["suggest"];
    assert_eq!(sg["reached"], true, "{sg}");
    let chosen = sg["tensors"].as_array().unwrap();
    // A small set, found greedily by per-layer sensitivity: the prefix-bisection search it
    // replaced kept 665 of 737 tensors here; the greedy search keeps 2 (15.46 dB).
    let n_cand = sg["candidates"].as_u64().unwrap() as usize;
    assert!(
        !chosen.is_empty() && chosen.len() * 10 <= n_cand,
        "{} of {n_cand} tensors chosen",
        chosen.len()
    );
    let ov: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&overrides).unwrap()).unwrap();
    assert_eq!(ov["default"], "w8a8");
    let rules = ov["rules"].as_array().unwrap();
    assert_eq!(rules.len(), chosen.len());
    for (r, c) in rules.iter().zip(chosen) {
        assert_eq!(&r["pattern"], c);
        assert!(r["scheme"] == "w8a16" || r["scheme"] == "w16a16", "{r}");
    }
    // Re-verify the promoted model independently.
    let again = verify_json(dir, &promoted, &[]);
    let got = again["output"]["sqnr_db"].as_f64().unwrap();
    assert!(
        got >= target,
        "promoted model: {got} dB < target {target} dB"
    );
    eprintln!(
        "as given {base_db:.2} dB; target {target} dB; {} of {} tensors at 16 bits -> {got:.2} dB",
        chosen.len(),
        sg["candidates"]
    );
}

fn write_npy(p: &Path, shape: Vec<usize>, v: Vec<f32>) {
    let t = npuc_ir::Tensor::from_vec(shape, v).unwrap();
    std::fs::write(p, npuc_cli::npy::npy_bytes(&t).unwrap()).unwrap();
}

/// Bad inputs give an error naming the file or directory, never a panic. Uses the float model as
/// both reference and "quantized" model: the inputs are rejected before anything runs.
#[test]
fn bad_inputs_give_clear_errors() {
    let model = npuc_testsupport::model("ppocrv5", "ppocrv5_rec.onnx");
    let tmp = tempfile::tempdir().unwrap();
    let run = |inputs: &Path| {
        let o = npuc(&[
            "verify",
            s(&model),
            "--reference",
            s(&model),
            "--inputs",
            s(inputs),
        ]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(
            !o.status.success(),
            "accepted bad input {}",
            inputs.display()
        );
        assert!(!err.contains("panicked"), "{err}");
        err
    };
    let missing = tmp.path().join("nope");
    assert!(run(&missing).contains("nope"));
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = run(&empty);
    assert!(e.contains("no .npy samples") && e.contains("'x'"), "{e}");
    let shape = tmp.path().join("shape");
    std::fs::create_dir(&shape).unwrap();
    write_npy(
        &shape.join("x_0.npy"),
        vec![1, 4, 48, 8],
        vec![0.0; 4 * 48 * 8],
    );
    let e = run(&shape);
    assert!(
        e.contains("x_0.npy") && e.contains("[1, 4, 48, 8]") && e.contains("expects"),
        "{e}"
    );
    let nan = tmp.path().join("nan");
    std::fs::create_dir(&nan).unwrap();
    let mut v = vec![0.5f32; 3 * 48 * 8];
    v[7] = f32::NAN;
    write_npy(&nan.join("x_0.npy"), vec![1, 3, 48, 8], v);
    let e = run(&nan);
    assert!(e.contains("x_0.npy") && e.contains("NaN"), "{e}");
    let garbage = tmp.path().join("garbage");
    std::fs::create_dir(&garbage).unwrap();
    std::fs::write(garbage.join("x_0.npy"), b"not an npy file").unwrap();
    assert!(run(&garbage).contains("x_0.npy"));
}
