//! `npuc build`, then `npuc generate` / `npuc inspect` on the bundle it writes (SmolLM2 135M).
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
    let mut b = npuc_llm::Bundle::open(
        &out,
        &npuc_llm::BundleOptions {
            threads: 1,
            ctx: None,
            ar: vec![],
        },
    )
    .unwrap();
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
