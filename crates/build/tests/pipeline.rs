//! `npuc build` on a real model (SmolLM2 135M, Q4_1): a split bundle generates what the unsplit
//! model does, the cache makes a second run free and a killed run resumable, corrupt entries
//! are rebuilt, bad pipeline files are refused before any step runs.
//!
//! Run in release: `cargo test -p npuc-build --release --test pipeline`.

use npuc_build::{build, BuildReport, BuildRequest, Pipeline, Status};
use npuc_llm::{Bundle, BundleOptions, Engine, EngineOptions, Precision, Variant};
use std::path::{Path, PathBuf};

fn smollm2() -> PathBuf {
    npuc_testsupport::smollm2_gguf()
}

/// Writes a pipeline file for SmolLM2 into `dir` with the given `[graphs]`/`[split]` body.
fn pipeline(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    let text = format!("[model]\ngguf = \"{}\"\n{body}", smollm2().display());
    std::fs::write(&p, text).unwrap();
    p
}

fn run(file: &Path, out: &Path, force: &[&str]) -> BuildReport {
    let p = Pipeline::load(file).unwrap();
    let req = BuildRequest {
        out_dir: out.to_path_buf(),
        jobs: 2,
        dry_run: false,
        force: force.iter().map(|s| s.to_string()).collect(),
        verify_cache: false,
    };
    build(&p, &req, &mut |l| eprintln!("{l}")).unwrap()
}

/// Every file of a bundle directory (not the cache), with its bytes.
fn bundle_bytes(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy tokens: the prompt in one forward call, then one token per call.
fn greedy(mut forward: impl FnMut(&[u32]) -> Vec<f32>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut out = vec![argmax(&forward(prompt))];
    while out.len() < n {
        let t = *out.last().unwrap();
        out.push(argmax(&forward(&[t])));
    }
    out
}

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
];

/// A 2-part bundle gives the unsplit model's greedy tokens, in each precision; with two
/// contexts the caches grow from the small one to the large one mid-sequence.
fn same_tokens_as_unsplit(precision: Precision, ctx_list: &str, engine_ctx: usize, n: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let body = format!(
        "[graphs]\nar = [1, 32]\nctx = {ctx_list}\n[split]\nparts = 2\nprecision = \"{}\"\n",
        precision.name()
    );
    let file = pipeline(tmp.path(), "p.toml", &body);
    let out = tmp.path().join("out");
    run(&file, &out, &[]);
    assert_bundle_gives_unsplit_tokens(&out, precision, engine_ctx, n);
}

/// The bundle in `out` generates the unsplit GGUF's greedy tokens (`n` per prompt, same
/// precision) on [`PROMPTS`], its caches updated in place.
fn assert_bundle_gives_unsplit_tokens(
    out: &Path,
    precision: Precision,
    engine_ctx: usize,
    n: usize,
) {
    let tok = npuc_tokenizer::Tokenizer::from_gguf_path(smollm2()).unwrap();
    let mut bundle = Bundle::open(
        out,
        &BundleOptions {
            threads: 2,
            ctx: None,
            ar: vec![],
        },
    )
    .unwrap();
    let mut engine = Engine::from_gguf(
        &smollm2(),
        &EngineOptions {
            threads: 2,
            ctx: Some(engine_ctx),
            variants: vec![Variant::Ar(1), Variant::Ar(32)],
            precision,
            weight_quant: Default::default(),
        },
    )
    .unwrap();
    for prompt in PROMPTS {
        let ids = tok.encode(prompt, true).unwrap();
        bundle.reset();
        engine.reset();
        let b = greedy(|t| bundle.forward(t, false).unwrap(), &ids, n);
        let e = greedy(|t| engine.forward(t, false).unwrap(), &ids, n);
        assert_eq!(b, e, "{} precision, prompt {prompt:?}", precision.name());
    }
    assert_eq!(bundle.cache_copies(), 0);
}

#[test]
fn two_parts_generate_the_unsplit_tokens_fast() {
    same_tokens_as_unsplit(Precision::Fast, "[256]", 256, 24);
}

#[test]
fn two_parts_generate_the_unsplit_tokens_exact() {
    same_tokens_as_unsplit(Precision::Exact, "[256]", 256, 12);
}

#[test]
fn two_contexts_grow_the_caches_and_keep_the_tokens() {
    // The longest prompt is ~20 tokens: prefill runs at ctx 32, decode moves to ctx 256.
    same_tokens_as_unsplit(Precision::Fast, "[32, 256]", 256, 24);
}

#[test]
fn second_run_does_no_work_and_one_option_reruns_only_its_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let body = "[graphs]\nar = [1, 32]\nctx = [256]\n[split]\nparts = 2\n";
    let file = pipeline(tmp.path(), "p.toml", body);
    let out = tmp.path().join("out");
    let first = run(&file, &out, &[]);
    assert_eq!(first.ran(), first.steps.len());
    let bytes = bundle_bytes(&out);

    let second = run(&file, &out, &[]);
    assert_eq!(second.ran(), 0, "{}", second.table());
    assert!(second.seconds < 1.0, "cached run took {} s", second.seconds);
    assert_eq!(bundle_bytes(&out), bytes);

    // Part 2 in exact precision: only part 2's graphs, its compile and the bundle run.
    let body2 = "[graphs]\nar = [1, 32]\nctx = [256]\n[split]\nparts = 2\npart_precision = [\"fast\", \"exact\"]\n";
    let file2 = pipeline(tmp.path(), "p.toml", body2);
    let third = run(&file2, &out, &[]);
    for s in &third.steps {
        // Part 2's graphs and artifact, what is made of them, and the checks that involve
        // part 2's precision (the split check is gone: the parts differ in precision).
        let expect_ran = s.id.starts_with("graph:p2")
            || [
                "compile:p2",
                "bundle",
                "verify:variant",
                "verify:compile:p2",
                "check",
            ]
            .contains(&s.id.as_str());
        assert_eq!(s.status.ran(), expect_ran, "{}", third.table());
    }
    assert!(!third.steps.iter().any(|s| s.id == "verify:split"));
    // --force reruns the named step; its output is the same, so nothing after it reruns.
    let forced = run(&file2, &out, &["compile:p1"]);
    for s in &forced.steps {
        assert_eq!(
            s.status == Status::Forced,
            s.id == "compile:p1",
            "{}",
            forced.table()
        );
        assert_eq!(s.status.ran(), s.id == "compile:p1", "{}", forced.table());
    }
}

#[test]
fn corrupted_cache_entry_is_rebuilt_not_used() {
    let tmp = tempfile::tempdir().unwrap();
    let body = "[graphs]\nar = [1]\nctx = [128]\n[split]\nparts = 2\n";
    let file = pipeline(tmp.path(), "p.toml", body);
    let out = tmp.path().join("out");
    run(&file, &out, &[]);
    let good = bundle_bytes(&out);
    // Part 1's cached artifact, damaged in place like a disk error (the output directory's
    // hard link sees it too): one byte flipped in the middle (same size, so only its hash can
    // tell), then cut short.
    type Damage = fn(&mut Vec<u8>);
    let damages: [(&str, Damage); 2] = [
        ("flipped byte", |b| {
            let mid = b.len() / 2;
            b[mid] ^= 0x55;
        }),
        ("truncated", |b| b.truncate(b.len() - 4096)),
    ];
    for (what, damage) in damages {
        let compile_dir = out.join(".cache/compile");
        let mut damaged = 0;
        for e in std::fs::read_dir(&compile_dir).unwrap() {
            let p = e.unwrap().path().join("part.npuc");
            let rec: serde_json::Value =
                serde_json::from_slice(&std::fs::read(p.with_file_name("record.json")).unwrap())
                    .unwrap();
            if rec["step"] == "compile:p1" {
                let mut b = std::fs::read(&p).unwrap();
                damage(&mut b);
                std::fs::write(&p, &b).unwrap();
                damaged += 1;
            }
        }
        assert_eq!(damaged, 1);
        let r = run(&file, &out, &[]);
        for s in &r.steps {
            let rebuilt = matches!(s.status, Status::Rebuilt(_));
            assert_eq!(rebuilt, s.id == "compile:p1", "{what}\n{}", r.table());
        }
        assert_eq!(bundle_bytes(&out), good, "{what}");
    }
}

/// The child side of the kill test: builds the pipeline named by the environment.
#[test]
fn child_build_for_kill_test() {
    let (Ok(file), Ok(out)) = (
        std::env::var("NPUC_KILL_TEST_PIPELINE"),
        std::env::var("NPUC_KILL_TEST_OUT"),
    ) else {
        return; // Only meaningful when spawned by `killed_build_resumes_byte_identical`.
    };
    run(Path::new(&file), Path::new(&out), &[]);
}

#[test]
fn killed_build_resumes_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let body = "[graphs]\nar = [1, 32]\nctx = [128, 256]\n[split]\nparts = 3\n";
    let file = pipeline(tmp.path(), "p.toml", body);
    let reference = tmp.path().join("reference");
    run(&file, &reference, &[]);
    let want = bundle_bytes(&reference);
    let exe = std::env::current_exe().unwrap();
    // Kill the build at several moments, each time resuming the same output directory.
    let out = tmp.path().join("out");
    let mut killed_mid_build = 0;
    for delay_ms in [30u64, 120, 250, 400, 700] {
        let mut child = std::process::Command::new(&exe)
            .args([
                "--exact",
                "child_build_for_kill_test",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("NPUC_KILL_TEST_PIPELINE", &file)
            .env("NPUC_KILL_TEST_OUT", &out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        // SIGKILL (std's `kill` on Unix): no cleanup runs in the child.
        let finished = child.try_wait().unwrap().is_some();
        child.kill().unwrap();
        child.wait().unwrap();
        if !finished {
            killed_mid_build += 1;
        }
        // Each kill leaves the cache consistent: resuming finishes the same bundle.
        let r = run(&file, &out, &[]);
        assert_eq!(
            bundle_bytes(&out),
            want,
            "after a kill at {delay_ms} ms\n{}",
            r.table()
        );
        // Start over for the next kill, except the cache of earlier steps.
        for f in ["bundle.json", "part-1.npuc", "part-2.npuc", "part-3.npuc"] {
            let _ = std::fs::remove_file(out.join(f));
        }
        let _ = std::fs::remove_dir_all(out.join(".cache/compile"));
        let _ = std::fs::remove_dir_all(out.join(".cache/bundle"));
    }
    assert!(
        killed_mid_build >= 1,
        "every child finished before its kill"
    );
}

fn load_err(body: &str) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let file = pipeline(tmp.path(), "bad.toml", body);
    let e = Pipeline::load(&file).expect_err("a bad pipeline file must be refused");
    format!("{e:#}")
}

#[test]
fn bad_pipeline_files_are_refused_naming_the_key() {
    let e = load_err("[graphs]\nar = [1]\nctx = [128]\nbogus = 3\n");
    assert!(e.contains("bogus"), "{e}");
    let e = load_err("[graphs]\nar = [1]\nctx = [128]\n[split]\nparts = 31\n");
    assert!(
        e.contains("split.parts = 31") && e.contains("30 layers"),
        "{e}"
    );
    let e = load_err("[graphs]\nar = [1]\nctx = [128]\n[split]\nmax_part_bytes = 1000\n");
    assert!(
        e.contains("split.max_part_bytes = 1000") && e.contains("layer 0"),
        "{e}"
    );
    let e = load_err("[graphs]\nar = [1, 256]\nctx = [128, 512]\n");
    assert!(
        e.contains("graphs.ar = 256") && e.contains("graphs.ctx = 128"),
        "{e}"
    );
    let e = load_err(
        "[graphs]\nar = [1]\nctx = [128]\n[split]\nparts = 2\npart_precision = [\"fast\"]\n",
    );
    assert!(e.contains("split.part_precision"), "{e}");
    let e = load_err("[graphs]\nar = [1]\nctx = [128]\n[split]\nprecision = \"quick\"\n");
    assert!(e.contains("split.precision = \"quick\""), "{e}");
    let e = load_err(
        "[graphs]\nar = [1]\nctx = [128]\n[split]\nembedder = true\nembedder_dtype = \"int3\"\n",
    );
    assert!(e.contains("split.embedder_dtype = \"int3\""), "{e}");
    let e = load_err("[graphs]\nar = [1]\nctx = [128]\n[split]\nembedder_dtype = \"f16\"\n");
    assert!(
        e.contains("split.embedder_dtype applies only with split.embedder = true"),
        "{e}"
    );
    // A missing model names the key and the resolved path.
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("m.toml");
    std::fs::write(
        &f,
        "[model]\ngguf = \"nope.gguf\"\n[graphs]\nar = [1]\nctx = [8]\n",
    )
    .unwrap();
    let e = format!("{:#}", Pipeline::load(&f).unwrap_err());
    assert!(e.contains("model.gguf") && e.contains("nope.gguf"), "{e}");
}

#[test]
fn budget_split_reports_parts_within_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let file = pipeline(
        tmp.path(),
        "b.toml",
        "[graphs]\nar = [1]\nctx = [64]\n[split]\nmax_part_bytes = 50_000_000\n",
    );
    let p = Pipeline::load(&file).unwrap();
    assert!(p.parts.len() >= 3, "{:?}", p.parts);
    for b in &p.part_bytes {
        assert!(*b <= 50_000_000, "{:?}", p.part_bytes);
    }
    assert_eq!(p.parts[0].0.layers.start, 0);
    assert_eq!(p.parts.last().unwrap().0.layers.end, 30);
}

#[test]
fn check_step_compares_the_bundle_with_the_unsplit_model() {
    let tmp = tempfile::tempdir().unwrap();
    let body = "[graphs]\nar = [1, 32]\nctx = [128]\n[split]\nparts = 3\n[test]\nprompts = [\"The capital of France is\", \"1, 2, 3,\"]\nmax_tokens = 8\n";
    let file = pipeline(tmp.path(), "p.toml", body);
    let out = tmp.path().join("out");
    let r = run(&file, &out, &[]);
    assert!(r
        .steps
        .iter()
        .any(|s| s.id == "check" && s.status == Status::Ran));
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("check.json")).unwrap()).unwrap();
    assert_eq!(j["compared_with_unsplit"], true);
    let prompts = j["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 2);
    for p in prompts {
        assert_eq!(p["tokens"], p["unsplit_tokens"], "{p}");
        assert_eq!(p["tokens"].as_array().unwrap().len(), 8);
        assert_eq!(p["top1_agreement"], 1.0);
    }
    // Mixed precision: generated, nothing to compare with.
    let body = body.replace(
        "parts = 3",
        "parts = 3\npart_precision = [\"fast\", \"exact\", \"fast\"]",
    );
    let file = pipeline(tmp.path(), "p.toml", &body);
    run(&file, &out, &[]);
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("check.json")).unwrap()).unwrap();
    assert_eq!(j["compared_with_unsplit"], false);
    assert_eq!(j["prompts"][0]["tokens"].as_array().unwrap().len(), 8);
}

#[test]
fn sha_bundle_generates_the_multi_head_tokens_and_checks_each_step() {
    let tmp = tempfile::tempdir().unwrap();
    let body = "[graphs]\nar = [1, 32]\nctx = [64, 256]\nsha = true\n[split]\nparts = 2\n[test]\nprompts = [\"The capital of France is\"]\nmax_tokens = 8\n";
    let file = pipeline(tmp.path(), "p.toml", body);
    let out = tmp.path().join("out");
    let r = run(&file, &out, &[]);
    // Every transform step was checked, on every probe graph, within tolerance.
    for stage in ["variant", "split", "sha", "compile"] {
        assert!(
            r.sanity.iter().any(|c| c.step == stage && c.pass),
            "{}",
            r.sanity_table()
        );
    }
    assert!(r.sanity.iter().all(|c| c.pass), "{}", r.sanity_table());
    // SHA (and split, compile) are bit-identical to their input on this model.
    for c in r.sanity.iter().filter(|c| c.step != "variant") {
        assert_eq!(c.max_abs, 0.0, "{}", r.sanity_table());
    }
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("check.json")).unwrap()).unwrap();
    assert_eq!(j["sanity"].as_array().unwrap().len(), r.sanity.len());
    let m = npuc_llm::bundle::BundleManifest::read(&out).unwrap();
    assert!(m.sha);
    // Per-head KV tensors: SmolLM2 has 3 KV heads.
    let art = npuc_format::Artifact::open(&out.join("part-2.npuc")).unwrap();
    let g = art.model(Some("ar1_c64")).unwrap();
    let kv: Vec<&str> = g
        .graph
        .inputs
        .iter()
        .map(|i| i.name.as_str())
        .filter(|n| n.starts_with("past_"))
        .collect();
    assert_eq!(kv.len(), 15 * 2 * 3, "{kv:?}");
    assert!(kv.contains(&"past_value.29.h2"), "{kv:?}");
    // The bundle generates the unsplit multi-head model's tokens (across a context growth).
    assert_bundle_gives_unsplit_tokens(&out, Precision::Fast, 256, 56);
    // The QNN hand-off: a GENIE config naming the parts in order, encodings per part.
    let genie: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("genie_config.json")).unwrap()).unwrap();
    let bins = genie["dialog"]["engine"]["model"]["binary"]["ctx-bins"]
        .as_array()
        .unwrap();
    assert_eq!(bins.len(), 2);
    assert_eq!(genie["dialog"]["context"]["size"], 256);
    assert_eq!(genie["dialog"]["engine"]["backend"]["QnnHtp"]["kv-dim"], 64);
    for i in 1..=2 {
        let e: serde_json::Value = serde_json::from_slice(
            &std::fs::read(out.join(format!("part-{i}.encodings.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(e["version"], "1.0.0");
    }
}

#[test]
fn a_second_build_into_the_same_out_dir_fails_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let body = "[graphs]\nar = [1]\nctx = [64]\n";
    let file = pipeline(tmp.path(), "p.toml", body);
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    // Another build holds the directory's lock (as a running `npuc build` does).
    let held = std::fs::File::create(out.join(npuc_build::LOCK_FILE)).unwrap();
    held.try_lock().unwrap();
    let p = Pipeline::load(&file).unwrap();
    let req = BuildRequest {
        out_dir: out.clone(),
        jobs: 1,
        dry_run: false,
        force: vec![],
        verify_cache: false,
    };
    let e = format!("{:#}", build(&p, &req, &mut |_| {}).unwrap_err());
    assert!(e.contains("in use by another `npuc build`"), "{e}");
    assert!(
        !out.join(".cache").exists(),
        "the refused build touched the cache"
    );
    // Released (as when that build ends or dies): this one runs.
    drop(held);
    let r = build(&p, &req, &mut |_| {}).unwrap();
    assert_eq!(r.ran(), r.steps.len());
}

/// An ONNX source (SmolLM2 exported by `npuc export`'s exporter): imported, checked against
/// the ONNX graph, then split in two with single-head attention; the bundle generates the
/// imported unsplit model's tokens, which are the source GGUF's `exact` tokens (the import
/// keeps the dequantized weights bit for bit); a second run does nothing, the import included.
#[test]
fn onnx_source_is_imported_split_and_sha_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let onnx = tmp.path().join("smollm2.onnx");
    let g = npuc_gguf::GgufFile::open(smollm2()).unwrap();
    let m = npuc_llm::interop::export_decoder(&g, npuc_llm::interop::WeightDtype::F32).unwrap();
    npuc_onnx::save_model(&m, &onnx, &npuc_onnx::ExportOptions::default()).unwrap();
    drop((m, g));
    let file = tmp.path().join("p.toml");
    std::fs::write(
        &file,
        format!(
            "[model]\nonnx = \"{}\"\n[graphs]\nar = [1, 32]\nctx = [64]\nsha = true\n[split]\nparts = 2\nprecision = \"exact\"\n[test]\nprompts = [\"The capital of France is\"]\nmax_tokens = 8\n",
            onnx.display()
        ),
    )
    .unwrap();
    let out = tmp.path().join("out");
    let req = BuildRequest {
        out_dir: out.clone(),
        jobs: 2,
        dry_run: false,
        force: vec![],
        verify_cache: false,
    };
    let mut lines = vec![];
    let (p, _guard) =
        npuc_build::load_pipeline(&file, &req, &mut |l| lines.push(l.to_string())).unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("architecture llama") && l.contains("9 heads")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("check: ONNX graph vs imported")),
        "{lines:?}"
    );
    let r = build(&p, &req, &mut |l| eprintln!("{l}")).unwrap();
    for stage in ["variant", "split", "sha", "compile"] {
        assert!(
            r.sanity.iter().any(|c| c.step == stage && c.pass),
            "{}",
            r.sanity_table()
        );
    }
    assert!(r.sanity.iter().all(|c| c.pass), "{}", r.sanity_table());
    let man = npuc_llm::bundle::BundleManifest::read(&out).unwrap();
    assert_eq!(man.source.imported_from.as_deref(), Some("smollm2.onnx"));
    assert!(man.sha);
    // The bundle's greedy tokens are the source GGUF's exact ones.
    assert_bundle_gives_unsplit_tokens(&out, Precision::Exact, 64, 12);
    // Second run: the import and every step come from the cache.
    let mut lines = vec![];
    let (p, _guard) =
        npuc_build::load_pipeline(&file, &req, &mut |l| lines.push(l.to_string())).unwrap();
    assert!(lines.iter().any(|l| l.contains(": cached")), "{lines:?}");
    let r = build(&p, &req, &mut |l| eprintln!("{l}")).unwrap();
    assert!(r.steps.iter().all(|s| s.status == Status::Cached));
}

#[test]
fn onnx_sources_without_a_decoder_or_with_two_models_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // Both sources: refused naming the keys.
    let f = tmp.path().join("both.toml");
    std::fs::write(
        &f,
        format!(
            "[model]\ngguf = \"{}\"\nonnx = \"{}\"\n[graphs]\nar = [1]\nctx = [8]\n",
            smollm2().display(),
            smollm2().display()
        ),
    )
    .unwrap();
    let e = format!("{:#}", Pipeline::model_source(&f).unwrap_err());
    assert!(e.contains("model.gguf or model.onnx"), "{e}");
    // An ONNX model that is not a decoder with a KV cache: the import names what is missing.
    let onnx = tmp.path().join("mlp.onnx");
    let mut gr = npuc_ir::Graph {
        name: "mlp".into(),
        ..Default::default()
    };
    gr.inputs.push(npuc_ir::ValueInfo::new(
        "x",
        Some(npuc_ir::TypeInfo::tensor(npuc_ir::DType::F32, &[1, 4])),
    ));
    gr.outputs.push(npuc_ir::ValueInfo::new(
        "y",
        Some(npuc_ir::TypeInfo::tensor(npuc_ir::DType::F32, &[1, 4])),
    ));
    gr.nodes.push(npuc_ir::Node::new("Relu", &["x"], &["y"]));
    let m = npuc_ir::Model {
        ir_version: 8,
        opset_imports: vec![npuc_ir::OpsetImport {
            domain: String::new(),
            version: 17,
        }],
        graph: gr,
        ..Default::default()
    };
    npuc_onnx::save_model(&m, &onnx, &npuc_onnx::ExportOptions::default()).unwrap();
    let f = tmp.path().join("mlp.toml");
    std::fs::write(
        &f,
        format!(
            "[model]\nonnx = \"{}\"\n[graphs]\nar = [1]\nctx = [8]\n",
            onnx.display()
        ),
    )
    .unwrap();
    let req = BuildRequest {
        out_dir: tmp.path().join("out"),
        jobs: 1,
        dry_run: false,
        force: vec![],
        verify_cache: false,
    };
    let e = format!(
        "{:#}",
        npuc_build::load_pipeline(&f, &req, &mut |_| {}).unwrap_err()
    );
    assert!(
        e.contains("mlp.onnx") && e.contains("past_key_values.0.key"),
        "{e}"
    );
}

/// The VLM layout: the token embedding as a part of its own (the embedder), the decoder parts
/// taking embeddings. Feeding the embedder's output through the embeddings entry gives the
/// token ids' logits bit for bit (also as a prefix followed by tokens), and the bundle
/// generates the unsplit model's tokens.
#[test]
fn embedder_part_feeds_decoder_parts_that_take_embeddings() {
    let tmp = tempfile::tempdir().unwrap();
    let body = "[graphs]\nar = [1, 32]\nctx = [64]\nsha = true\n[split]\nparts = 2\nembedder = true\n[test]\nprompts = [\"The capital of France is\"]\nmax_tokens = 8\n";
    let file = pipeline(tmp.path(), "p.toml", body);
    let out = tmp.path().join("out");
    let r = run(&file, &out, &[]);
    assert!(r.sanity.iter().all(|c| c.pass), "{}", r.sanity_table());
    let m = npuc_llm::bundle::BundleManifest::read(&out).unwrap();
    let layers: Vec<[usize; 2]> = m.parts.iter().map(|p| p.layers).collect();
    assert_eq!(layers, vec![[0, 0], [0, 15], [15, 30]]);
    let tok = npuc_tokenizer::Tokenizer::from_gguf_path(smollm2()).unwrap();
    let mut b = Bundle::open(
        &out,
        &BundleOptions {
            threads: 2,
            ctx: None,
            ar: vec![],
        },
    )
    .unwrap();
    assert!(b.has_embedder());
    let ids = tok.encode(PROMPTS[2], true).unwrap();
    let by_ids = b.forward(&ids, true).unwrap();
    b.reset();
    let rows = b.embed(&ids).unwrap();
    assert_eq!(rows.len(), ids.len() * m.n_embd);
    let by_rows = b.forward_embeddings(&rows, true).unwrap();
    assert!(by_ids == by_rows, "embeddings in = token ids in");
    // A prefix of embeddings, then the rest as tokens = the same split of token ids.
    let k = 5;
    b.reset();
    b.forward(&ids[..k], false).unwrap();
    let want = b.forward(&ids[k..], false).unwrap();
    b.reset();
    b.forward_embeddings(&rows[..k * m.n_embd], false).unwrap();
    let got = b.forward(&ids[k..], false).unwrap();
    assert!(want == got, "prefix embeddings then tokens = tokens");
    assert_bundle_gives_unsplit_tokens(&out, Precision::Fast, 64, 16);
    // A bundle without an embedder refuses embeddings, saying how to get one.
    let tmp2 = tempfile::tempdir().unwrap();
    let file2 = pipeline(
        tmp2.path(),
        "p.toml",
        "[graphs]\nar = [1]\nctx = [16]\n[split]\nparts = 2\n",
    );
    let out2 = tmp2.path().join("out");
    run(&file2, &out2, &[]);
    let mut b2 = Bundle::open(
        &out2,
        &BundleOptions {
            threads: 1,
            ctx: None,
            ar: vec![],
        },
    )
    .unwrap();
    let e = b2
        .forward_embeddings(&rows[..m.n_embd], false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("split.embedder = true"), "{e}");
}

/// The pre-flight report flags a part over the target's limits and proposes a split that fits.
#[test]
fn preflight_flags_an_over_budget_part_and_proposes_a_split() {
    let tmp = tempfile::tempdir().unwrap();
    // SmolLM2's ~94 MiB of weights in one part, against a 70 MB graph limit.
    let file = pipeline(
        tmp.path(),
        "p.toml",
        "[graphs]\nar = [1]\nctx = [64]\n[target]\nmax_graph_bytes = 70_000_000\n",
    );
    let p = Pipeline::load(&file).unwrap();
    let lines = npuc_build::preflight(&p);
    assert!(lines[0].contains("OVER"), "{lines:?}");
    let proposal = lines.last().unwrap();
    assert!(proposal.contains("split.parts = 2"), "{lines:?}");
    // Following the proposal: every part fits.
    let file = pipeline(
        tmp.path(),
        "p2.toml",
        "[graphs]\nar = [1]\nctx = [64]\n[split]\nparts = 2\n[target]\nmax_graph_bytes = 70_000_000\n",
    );
    let lines = npuc_build::preflight(&Pipeline::load(&file).unwrap());
    assert!(lines.iter().all(|l| !l.contains("OVER")), "{lines:?}");
    // Unknown target keys are refused by name.
    let e = load_err("[graphs]\nar = [1]\nctx = [64]\n[target]\nmax_graph_byte = 1\n");
    assert!(e.contains("max_graph_byte"), "{e}");
}
