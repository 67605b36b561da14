//! The `import` step of an ONNX LLM source (`[model] onnx = "..."`): the decoder's structure
//! found in the graph ([`npuc_llm::interop::lift`]) and written as a GGUF that every later step
//! reads as it reads a GGUF source; then its sanity check: the ONNX graph itself (npuc's
//! runtime, one call over the probe tokens with an empty cache) against the imported model's
//! `exact` graph on the same tokens. Runs before the step DAG (the pipeline's split and checks
//! need the model's shape), content-addressed like the steps: `OUT/.cache/import/<key>/`
//! holds `model.gguf` and `import.json`, keyed on the identity (path, size, times, inode) of
//! the ONNX file, its external data and the tokenizer GGUF. The key changes when any of them
//! is rewritten; a corrupt entry (a file whose sha256 no longer matches `import.json`) is
//! imported again.

use crate::cache::{sha256_file, write_synced};
use anyhow::{bail, Context, Result};
use npuc_ir::{Tensor, TypeInfo};
use npuc_runtime::{Session, SessionOptions, Value};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Largest |logit difference| between the ONNX graph and the imported model's `exact` graph.
/// Both compute in f32 from the same weights (the import copies them bit for bit); only the
/// order of summation (GEMM blocking) and rope angles (f32 tables in the ONNX graph, f64 in
/// npuc's Rope) differ, ~1e-6 relative per op, under 1e-2 after two dozen layers for logits of
/// magnitude <= 40 (measured: 7e-5 on SmolLM2). A misread weight or norm moves them by units.
pub const IMPORT_TOLERANCE: f32 = 1e-2;

/// An imported source.
#[derive(Debug)]
pub struct Imported {
    /// The GGUF the build reads.
    pub gguf: PathBuf,
    /// What the recogniser found, and the check's figures.
    pub findings: Vec<String>,
    pub max_abs: f32,
    pub top1_agree: f64,
    /// Taken from the cache (nothing ran).
    pub cached: bool,
}

fn identity(p: &Path) -> Result<String> {
    let m = std::fs::metadata(p).with_context(|| format!("'{}'", p.display()))?;
    let t = |r: std::io::Result<std::time::SystemTime>| {
        r.ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos())
    };
    #[cfg(unix)]
    let (ctime, inode) = {
        use std::os::unix::fs::MetadataExt;
        (
            m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
            format!("{}:{}", m.dev(), m.ino()),
        )
    };
    #[cfg(not(unix))]
    let (ctime, inode) = (0i128, String::new());
    let canon = p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    Ok(format!(
        "{}|{}|{}|{ctime}|{inode}",
        canon.display(),
        m.len(),
        t(m.modified())
    ))
}

/// The files the import reads: the model, its external data files, the tokenizer GGUF.
fn inputs(onnx: &Path, tokenizer: Option<&Path>) -> Vec<PathBuf> {
    let mut v = vec![onnx.to_path_buf()];
    // External data sits next to the model (`npuc export`: `<name>.data`; Optimum:
    // `<name>_data`); any present is part of the identity.
    if let Some(name) = onnx.file_name().and_then(|n| n.to_str()) {
        for ext in [format!("{name}.data"), format!("{name}_data")] {
            let p = onnx.with_file_name(ext);
            if p.is_file() {
                v.push(p);
            }
        }
    }
    v.extend(tokenizer.map(Path::to_path_buf));
    v
}

/// Imports `onnx` under `cache_root` (`OUT/.cache`), or finds it there. `dry_run`: nothing is
/// written under `cache_root`; an uncached import runs into a temporary directory that
/// `keep` holds until the caller is done with the returned path.
pub fn import(
    onnx: &Path,
    tokenizer: Option<&Path>,
    probe_text: &str,
    cache_root: &Path,
    dry_run: bool,
    keep: &mut Option<tempfile::TempDir>,
    line: &mut dyn FnMut(&str),
) -> Result<Imported> {
    let mut h = Sha256::new();
    h.update(format!("npuc-import|{}|", env!("CARGO_PKG_VERSION")));
    for p in inputs(onnx, tokenizer) {
        h.update(identity(&p)?);
        h.update("\n");
    }
    h.update(probe_text);
    let key: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let dir = cache_root.join("import").join(&key[..32]);
    if let Some(hit) = cached(&dir)? {
        line(&format!(
            "import {}: cached ({})",
            onnx.display(),
            hit.findings.first().map_or("", String::as_str)
        ));
        return Ok(hit);
    }
    line(&format!(
        "import {}: recognising the decoder ...",
        onnx.display()
    ));
    let t0 = std::time::Instant::now();
    let parent = if dry_run {
        let t = tempfile::tempdir()?;
        let p = t.path().to_path_buf();
        *keep = Some(t);
        p
    } else {
        std::fs::create_dir_all(cache_root.join("import"))?;
        cache_root.join("import")
    };
    let scratch = tempfile::Builder::new()
        .prefix(".import-")
        .tempdir_in(&parent)?;
    let gguf = scratch.path().join("model.gguf");
    let m = npuc_onnx_model(onnx)?;
    let tok = match tokenizer {
        Some(t) => {
            let g = npuc_gguf::GgufFile::open(t)
                .with_context(|| format!("model.tokenizer = '{}'", t.display()))?;
            Some(npuc_gguf::GgufMetaJson::filtered(
                &g.metadata,
                &["tokenizer."],
            ))
        }
        None => None,
    };
    let lifted = npuc_llm::interop::lift(&m, &onnx.display().to_string(), tok.as_ref())?;
    write_synced(&gguf, &lifted.to_gguf_bytes()?)?;
    let mut findings = lifted.findings;
    // The check: the ONNX graph vs the imported model's exact graph on the probe tokens.
    let probe = crate::verify::probe_tokens(&gguf, &[probe_text.to_string()])?;
    let theirs = run_onnx(&m, &probe)
        .with_context(|| format!("running {} on the probe tokens", onnx.display()))?;
    drop(m);
    let ours = {
        let mut e = npuc_llm::Engine::from_gguf(
            &gguf,
            &npuc_llm::EngineOptions {
                threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
                ctx: Some(probe.len().next_power_of_two().max(16)),
                precision: npuc_llm::Precision::Exact,
                weight_quant: Default::default(),
                variants: vec![npuc_llm::Variant::Ar(1), npuc_llm::Variant::Ar(16)],
            },
        )?;
        e.forward(&probe, true)?
    };
    if ours.len() != theirs.len() {
        bail!(
            "{}: the ONNX graph gave {} logits for {} tokens, the imported model {}",
            onnx.display(),
            theirs.len(),
            probe.len(),
            ours.len()
        );
    }
    let vocab = ours.len() / probe.len();
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |x| x.0)
    };
    let mut max_abs = 0f32;
    let mut agree = 0;
    let mut first_bad = None;
    for (p, (a, b)) in ours.chunks(vocab).zip(theirs.chunks(vocab)).enumerate() {
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        if d > IMPORT_TOLERANCE && first_bad.is_none() {
            first_bad = Some((p, d));
        }
        max_abs = max_abs.max(d);
        agree += usize::from(argmax(a) == argmax(b));
    }
    let top1 = agree as f64 / probe.len() as f64;
    if let Some((p, d)) = first_bad {
        bail!(
            "import of {}: the imported model's logits differ from the ONNX graph's by {d} at probe position {p} (tolerance {IMPORT_TOLERANCE}); the decoder was recognised as: {}",
            onnx.display(),
            findings.join("; ")
        );
    }
    findings.push(format!(
        "check: ONNX graph vs imported exact graph on {} probe tokens: max |diff| {max_abs:.3e}, top-1 {:.1}%",
        probe.len(),
        100.0 * top1
    ));
    let sha = sha256_file(&gguf)?;
    let j = serde_json::json!({
        "source": onnx.display().to_string(),
        "findings": findings,
        "probe_tokens": probe.len(),
        "max_abs": max_abs,
        "top1": top1,
        "model.gguf": { "sha256": sha, "bytes": std::fs::metadata(&gguf)?.len() },
        "seconds": t0.elapsed().as_secs_f64(),
    });
    write_synced(
        &scratch.path().join("import.json"),
        &serde_json::to_vec_pretty(&j)?,
    )?;
    let final_dir = if dry_run {
        parent.join("entry")
    } else {
        dir.clone()
    };
    let staged = scratch.keep();
    if final_dir.exists() {
        // A corrupt entry (see `cached`) is replaced.
        std::fs::remove_dir_all(&final_dir)?;
    }
    std::fs::rename(&staged, &final_dir)?;
    // Hashed just now: the stamp spares the next build re-hashing it (see `cached`).
    let gguf = final_dir.join("model.gguf");
    write_synced(&final_dir.join("verified"), identity(&gguf)?.as_bytes())?;
    for f in &findings {
        line(&format!("import: {f}"));
    }
    line(&format!(
        "import: done in {:.1} s",
        t0.elapsed().as_secs_f64()
    ));
    Ok(Imported {
        gguf,
        findings,
        max_abs,
        top1_agree: top1,
        cached: false,
    })
}

/// The entry at `dir` when complete and intact (its GGUF's sha256 as recorded).
fn cached(dir: &Path) -> Result<Option<Imported>> {
    let (gguf, json) = (dir.join("model.gguf"), dir.join("import.json"));
    let Ok(text) = std::fs::read(&json) else {
        return Ok(None);
    };
    let Ok(j) = serde_json::from_slice::<serde_json::Value>(&text) else {
        return Ok(None);
    };
    let want = j["model.gguf"]["sha256"].as_str().unwrap_or_default();
    let bytes = j["model.gguf"]["bytes"].as_u64().unwrap_or(0);
    // Size first (cheap); the hash only when the stamp beside it is older than the file.
    match std::fs::metadata(&gguf) {
        Ok(m) if m.len() == bytes => {}
        _ => return Ok(None),
    }
    let stamp = dir.join("verified");
    let fresh = std::fs::read_to_string(&stamp).ok() == Some(identity(&gguf)?);
    if !fresh {
        if sha256_file(&gguf)? != want {
            return Ok(None);
        }
        write_synced(&stamp, identity(&gguf)?.as_bytes())?;
    }
    Ok(Some(Imported {
        gguf,
        findings: j["findings"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
        max_abs: j["max_abs"].as_f64().unwrap_or(0.0) as f32,
        top1_agree: j["top1"].as_f64().unwrap_or(0.0),
        cached: true,
    }))
}

fn npuc_onnx_model(onnx: &Path) -> Result<npuc_ir::Model> {
    npuc_onnx::load_model(onnx).with_context(|| format!("model.onnx = '{}'", onnx.display()))
}

/// One call of the ONNX decoder over `probe` with an empty cache: logits `[n, vocab]`.
fn run_onnx(m: &npuc_ir::Model, probe: &[u32]) -> Result<Vec<f32>> {
    let n = probe.len();
    let mut feeds: Vec<(String, Value)> = vec![];
    let ids: Vec<i64> = probe.iter().map(|&t| t as i64).collect();
    feeds.push((
        "input_ids".into(),
        Value::tensor(Tensor::from_vec(vec![1, n], ids)?),
    ));
    feeds.push((
        "attention_mask".into(),
        Value::tensor(Tensor::from_vec(vec![1, n], vec![1i64; n])?),
    ));
    feeds.push((
        "position_ids".into(),
        Value::tensor(Tensor::from_vec(
            vec![1, n],
            (0..n as i64).collect::<Vec<_>>(),
        )?),
    ));
    for vi in &m.graph.inputs {
        if !vi.name.starts_with("past_key_values.") {
            continue;
        }
        let Some(TypeInfo::Tensor { shape: Some(s), .. }) = &vi.ty else {
            bail!("input {} has no shape", vi.name);
        };
        let dims: Vec<usize> = s
            .iter()
            .enumerate()
            .map(|(i, d)| match (i, d) {
                (0, _) => 1,
                (2, _) => 0,
                (_, npuc_ir::Dim::Fixed(v)) => *v,
                _ => 0,
            })
            .collect();
        feeds.push((
            vi.name.clone(),
            Value::tensor(Tensor::from_vec::<f32>(dims, vec![])?),
        ));
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let sess = Session::new(m, SessionOptions { threads })?;
    let out = sess.run(feeds)?;
    let logits = out
        .into_iter()
        .find(|(k, _)| k == "logits")
        .map(|(_, v)| v)
        .context("the ONNX graph has no 'logits' output")?;
    let t = logits.as_tensor().context("'logits' is not a tensor")?;
    Ok(t.as_slice::<f32>()?.to_vec())
}
