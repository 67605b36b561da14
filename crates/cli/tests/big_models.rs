//! Models over 2 GB (issue 18, item 5): ONNX with external data through import, optimization,
//! calibration, quantization and compile, with the compile's peak RSS (GNU `time -v`) held to
//! 1.5x the model's weight bytes, and the `--emit-qdq` export (external data) run by
//! onnxruntime against npuc's own run of the artifact.
//!
//! - Qwen2.5-Coder-0.5B: `npuc export --dtype f32` (external data), then calibrated w4a16
//!   per-block on windows of English text tokenized with the model's tokenizer.
//! - A SYNTHETIC ViT-H/14-shaped encoder (`npuc_driver::synth`, deterministic random weights,
//!   2.53 GB of f32), calibrated w8a8 on the repo's photos.
//!
//! Large files live in a `big-*` temp directory, removed at the end (also on failure).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The memory bound of the issue: peak RSS of a compile <= 1.5x the model's weight bytes.
const RSS_FACTOR: f64 = 1.5;

/// Tokens per calibration sample of the decoder (a prefill with an empty KV cache).
const SEQ: usize = 64;
/// Calibration samples (`--calib-method auto` holds out every fourth, so 12 calibrate and 4
/// choose the range method).
const CALIB_SAMPLES: usize = 16;

fn big_tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("big-")
        .tempdir_in(std::env::temp_dir())
        .unwrap()
}

/// Runs `npuc ARGS` under GNU `time -v`; returns stdout, stderr and the peak RSS in bytes.
fn npuc_timed(args: &[&str]) -> (String, String, u64, f64) {
    let time = Path::new("/usr/bin/time");
    assert!(
        time.is_file(),
        "/usr/bin/time (GNU time) is missing: run `scripts/setup.sh` (apt package `time`)"
    );
    let t0 = std::time::Instant::now();
    let out = Command::new(time)
        .arg("-v")
        .arg(env!("CARGO_BIN_EXE_npuc"))
        .args(args)
        .output()
        .expect("npuc runs");
    let secs = t0.elapsed().as_secs_f64();
    let so = String::from_utf8_lossy(&out.stdout).to_string();
    let se = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "npuc {args:?} failed:\n{se}");
    let kb: u64 = se
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("Maximum resident set size (kbytes): ")
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("no peak RSS in GNU time's report:\n{se}"));
    (so, se, kb * 1024, secs)
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .len()
}

/// Sum of the ONNX model's initializer bytes (what the memory bound is relative to).
fn weight_bytes(onnx: &Path) -> u64 {
    let m = npuc_onnx::load_model(onnx).unwrap();
    m.graph
        .initializers
        .iter()
        .map(|i| (i.tensor.len() * i.tensor.dtype().size()) as u64)
        .sum()
}

fn save_npy(path: &Path, t: &npuc_ir::Tensor) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, npuc_npy::npy_bytes(t).unwrap()).unwrap();
}

/// One decoder sample: `SEQ` token ids as a prefill with an empty KV cache, each input in
/// `dir/<input>/<idx>.npy` (the calibration layout) or `dir/<input>.npy` when `idx` is None.
fn decoder_sample(
    dir: &Path,
    idx: Option<usize>,
    ids: &[u32],
    kv: &[(String, usize, usize)],
) -> Vec<(String, PathBuf)> {
    let n = ids.len();
    let path = |name: &str| match idx {
        Some(i) => dir.join(name).join(format!("{i:03}.npy")),
        None => dir.join(format!("{name}.npy")),
    };
    let mut feeds = vec![];
    let mut put = |name: &str, t: npuc_ir::Tensor| {
        let p = path(name);
        save_npy(&p, &t);
        feeds.push((name.to_string(), p));
    };
    put(
        "input_ids",
        npuc_ir::Tensor::from_vec(vec![1, n], ids.iter().map(|&t| t as i64).collect()).unwrap(),
    );
    put(
        "attention_mask",
        npuc_ir::Tensor::from_vec(vec![1, n], vec![1i64; n]).unwrap(),
    );
    put(
        "position_ids",
        npuc_ir::Tensor::from_vec(vec![1, n], (0..n as i64).collect()).unwrap(),
    );
    for (name, heads, d) in kv {
        put(
            name,
            npuc_ir::Tensor::from_vec(vec![1, *heads, 0, *d], Vec::<f32>::new()).unwrap(),
        );
    }
    feeds
}

/// The decoder's `past_key_values.*` inputs with their (kv heads, head dim).
fn kv_inputs(onnx: &Path) -> Vec<(String, usize, usize)> {
    let m = npuc_onnx::load_model(onnx).unwrap();
    m.graph
        .inputs
        .iter()
        .filter(|v| v.name.starts_with("past_key_values."))
        .map(|v| {
            let Some(npuc_ir::TypeInfo::Tensor {
                shape: Some(dims), ..
            }) = &v.ty
            else {
                panic!("{}: no shape", v.name)
            };
            let fixed = |d: &npuc_ir::Dim| match d {
                npuc_ir::Dim::Fixed(n) => *n,
                other => panic!("{}: dim {other:?} is not fixed", v.name),
            };
            (v.name.clone(), fixed(&dims[1]), fixed(&dims[3]))
        })
        .collect()
}

/// Qwen2.5-Coder-0.5B, f32 ONNX (external data) -> calibrated w4a16 per-block with the QDQ
/// export; peak RSS within the bound; onnxruntime runs the export (external data) and its
/// logits agree with the artifact's.
#[test]
fn qwen25_f32_onnx_w4a16_per_block() {
    let gguf = npuc_testsupport::qwen25_coder_gguf();
    let tmp = big_tmp();
    let dir = tmp.path();
    let onnx = dir.join("qwen.onnx");
    let (so, _, export_rss, export_s) = npuc_timed(&[
        "export",
        gguf.to_str().unwrap(),
        "-o",
        onnx.to_str().unwrap(),
        "--dtype",
        "f32",
    ]);
    let data = dir.join("qwen.onnx.data");
    assert!(
        data.is_file(),
        "the f32 export keeps its weights in external data: {so}"
    );
    let weights = weight_bytes(&onnx);
    eprintln!(
        "export: {export_s:.1} s, peak RSS {:.2} GB; qwen.onnx {} bytes, qwen.onnx.data {} bytes; weights {:.3} GB",
        export_rss as f64 / 1e9,
        file_len(&onnx),
        file_len(&data),
        weights as f64 / 1e9
    );
    // The export holds the dequantized weights once (plus the mapped GGUF), never a second
    // buffer of the data file.
    assert!(
        (export_rss as f64) < RSS_FACTOR * weights as f64,
        "export peak RSS {export_rss} over {RSS_FACTOR} x {weights}"
    );

    // Calibration and held-out samples: windows of SEQ tokens of English text.
    let tok = npuc_tokenizer::Tokenizer::from_gguf_path(&gguf).unwrap();
    let text = std::fs::read_to_string(npuc_testsupport::fixture("text/sentences_en.txt")).unwrap();
    let ids = tok.encode(&text, false).unwrap();
    assert!(
        ids.len() >= (CALIB_SAMPLES + 1) * SEQ,
        "{} tokens of text for {} windows of {SEQ}",
        ids.len(),
        CALIB_SAMPLES + 1
    );
    let kv = kv_inputs(&onnx);
    let calib = dir.join("calib");
    for i in 0..CALIB_SAMPLES {
        decoder_sample(&calib, Some(i), &ids[i * SEQ..(i + 1) * SEQ], &kv);
    }
    let held = dir.join("held");
    let held_feeds = decoder_sample(
        &held,
        None,
        &ids[CALIB_SAMPLES * SEQ..(CALIB_SAMPLES + 1) * SEQ],
        &kv,
    );

    let art = dir.join("qwen_w4a16.npuc");
    let qdq = dir.join("qwen_w4a16_qdq.onnx");
    let seq = SEQ.to_string();
    let (_, se, rss, secs) = npuc_timed(&[
        "compile",
        onnx.to_str().unwrap(),
        "--dim",
        "batch_size=1",
        "--dim",
        &format!("sequence_length={seq}"),
        "--dim",
        &format!("total_sequence_length={seq}"),
        "--dim",
        "past_sequence_length=0",
        "--quantize",
        "w4a16",
        "--granularity",
        "per-block",
        "--calib",
        calib.to_str().unwrap(),
        "--emit-qdq",
        qdq.to_str().unwrap(),
        "--no-progress",
        "-o",
        art.to_str().unwrap(),
    ]);
    eprintln!(
        "compile w4a16 per-block: {secs:.1} s, peak RSS {:.3} GB = {:.2} x the weights; artifact {} bytes; QDQ {} + {} bytes\n{se}",
        rss as f64 / 1e9,
        rss as f64 / weights as f64,
        file_len(&art),
        file_len(&qdq),
        file_len(&dir.join("qwen_w4a16_qdq.onnx.data")),
    );
    assert!(
        (rss as f64) <= RSS_FACTOR * weights as f64,
        "compile peak RSS {rss} bytes over {RSS_FACTOR} x the {weights} weight bytes"
    );
    assert!(
        dir.join("qwen_w4a16_qdq.onnx.data").is_file(),
        "the QDQ export of a model with external data has external data"
    );

    // npuc's run of the artifact on the held-out window, then onnxruntime's of the export.
    let outdir = dir.join("npuc_out");
    let mut args: Vec<String> = vec!["run".into(), art.to_str().unwrap().into()];
    for (name, p) in &held_feeds {
        args.push("--input".into());
        args.push(format!("{name}={}", p.display()));
    }
    args.push("--output-dir".into());
    args.push(outdir.to_str().unwrap().into());
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    npuc_timed(&a);
    let out = npuc_testsupport::python()
        .arg(npuc_testsupport::workspace_root().join("scripts/qdq_ort_logits.py"))
        .arg(&qdq)
        .arg(&held)
        .arg("logits")
        .arg(outdir.join("logits.npy"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "onnxruntime on {}: {}",
        qdq.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("onnxruntime vs npuc on the QDQ export: {r}");
    check_logits(&r);
}

/// How close onnxruntime's run of the QDQ export must come to npuc's run of the artifact.
/// Both quantize every activation to 16 bits with the same encodings; they differ where a value
/// lands within float rounding of a quantization tie (onnxruntime computes DequantizeLinear ->
/// float op -> QuantizeLinear, npuc integer kernels), one 16-bit step there, which 24 layers
/// carry on to the logits.
fn check_logits(r: &serde_json::Value) {
    let rel = r["max_rel_diff"].as_f64().unwrap();
    let sqnr = r["sqnr_db"].as_f64().unwrap();
    let agree = r["argmax_agree"].as_f64().unwrap();
    assert!(rel <= MAX_REL_DIFF, "max |diff| / max |logit| = {rel}");
    assert!(sqnr >= MIN_SQNR_DB, "SQNR {sqnr} dB");
    assert!(agree >= MIN_ARGMAX_AGREE, "argmax agreement {agree}");
}

const MAX_REL_DIFF: f64 = 0.05;
const MIN_SQNR_DB: f64 = 30.0;
const MIN_ARGMAX_AGREE: f64 = 0.95;

/// The synthetic ViT-H/14 (2.53 GB of f32 in external data) compiles with calibrated w8a8
/// within the memory bound.
#[test]
fn synthetic_vit_h_w8a8() {
    let tmp = big_tmp();
    let dir = tmp.path();
    let onnx = dir.join("vit_h_synthetic.onnx");
    let weights =
        npuc_driver::synth::write_vit(npuc_driver::synth::VitShape::VIT_H, &onnx).unwrap() as u64;
    assert!(weights > 1 << 31, "over the 2 GiB protobuf limit");
    assert!(dir.join("vit_h_synthetic.onnx.data").is_file());
    let photos = npuc_testsupport::cached(
        "quant-data/vit/calib",
        "scripts/make-fixtures.sh (scripts/make_calib_data.py)",
    );
    // 8 real photos.
    let calib = dir.join("calib");
    std::fs::create_dir_all(&calib).unwrap();
    let files = npuc_testsupport::npy_files(&photos, "input_image_");
    assert!(
        files.len() >= 8,
        "{} photos in {}",
        files.len(),
        photos.display()
    );
    for f in &files[..8] {
        std::fs::copy(f, calib.join(f.file_name().unwrap())).unwrap();
    }
    let art = dir.join("vit_h_w8a8.npuc");
    // Min-max ranges without outlier migration, to keep the test's time down: the default
    // recipe (SmoothQuant search + held-out method choice) measured 1.95 GB max RSS (0.77x) on
    // this model in 274 s, against 86-117 s here (ARCHITECTURE.md "Models over 2 GB").
    let (_, se, rss, secs) = npuc_timed(&[
        "compile",
        onnx.to_str().unwrap(),
        "--quantize",
        "w8a8",
        "--smooth",
        "off",
        "--calib-method",
        "minmax",
        "--calib",
        calib.to_str().unwrap(),
        "--no-progress",
        "-o",
        art.to_str().unwrap(),
    ]);
    eprintln!(
        "synthetic ViT-H w8a8: {secs:.1} s, peak RSS {:.3} GB = {:.2} x the {:.3} GB of weights; artifact {} bytes\n{se}",
        rss as f64 / 1e9,
        rss as f64 / weights as f64,
        weights as f64 / 1e9,
        file_len(&art)
    );
    assert!(
        (rss as f64) <= RSS_FACTOR * weights as f64,
        "compile peak RSS {rss} bytes over {RSS_FACTOR} x the {weights} weight bytes"
    );
}

/// External data missing or cut short: `npuc compile --quantize` stops at load, before any
/// calibration, naming the tensor and the data file (a small synthetic ViT; the check is the
/// same at any size).
#[test]
fn missing_or_short_external_data_is_named_before_calibration() {
    let tmp = big_tmp();
    let dir = tmp.path();
    let onnx = dir.join("vit_small.onnx");
    let shape = npuc_driver::synth::VitShape {
        layers: 2,
        width: 64,
        heads: 4,
        mlp: 256,
        image: 224,
        patch: 14,
    };
    npuc_driver::synth::write_vit(shape, &onnx).unwrap();
    let data = dir.join("vit_small.onnx.data");
    let photos = npuc_testsupport::cached(
        "quant-data/vit/calib",
        "scripts/make-fixtures.sh (scripts/make_calib_data.py)",
    );
    let compile = || {
        let out = Command::new(env!("CARGO_BIN_EXE_npuc"))
            .args(["compile", onnx.to_str().unwrap(), "--quantize", "w8a8"])
            .arg("--calib")
            .arg(&photos)
            .arg("-o")
            .arg(dir.join("out.npuc"))
            .output()
            .unwrap();
        assert!(!out.status.success(), "compile must fail");
        assert!(!dir.join("out.npuc").exists(), "no artifact written");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    // Cut inside the last tensor: the error names it and the file.
    let len = file_len(&data);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let e = compile();
    assert!(
        e.contains("vit_small.onnx.data") && e.contains("truncated") && e.contains("tensor '"),
        "{e}"
    );
    assert!(!e.contains("calibrat"), "stopped before calibration: {e}");
    std::fs::remove_file(&data).unwrap();
    let e = compile();
    assert!(
        e.contains("vit_small.onnx.data") && e.contains("tensor '") && !e.contains("panicked"),
        "{e}"
    );
}
