//! Test support shared by every crate's integration tests: where the data cache is, how to get
//! a file from it, and the Python interpreter of the pinned test venv.
//!
//! Tests never skip: a missing model, fixture or venv is a failure whose message says which
//! command makes it (`scripts/setup.sh` makes everything). The cache is `$NPUC_CACHE`, else
//! `~/.cache/npuc`; the Python interpreter is `$NPUC_PYTHON`, else `$NPUC_CACHE/venv/bin/python`.
#![forbid(unsafe_code)]

pub mod fuzz;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The data cache: `$NPUC_CACHE`, else `~/.cache/npuc`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("NPUC_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache/npuc")
}

/// The repository root (for committed fixtures under `tests/fixtures` and `scripts/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A committed fixture under `tests/fixtures/`; fails when it is absent (a broken checkout).
pub fn fixture(rel: &str) -> PathBuf {
    let p = workspace_root().join("tests/fixtures").join(rel);
    assert!(
        p.exists(),
        "committed test fixture {} is missing from the checkout",
        p.display()
    );
    p
}

/// `rel` inside the cache; fails with the command that makes it when it is absent.
/// `how` is that command, e.g. `scripts/fetch-data.sh gemma3-270m`.
pub fn cached(rel: &str, how: &str) -> PathBuf {
    let p = cache_dir().join(rel);
    assert!(
        p.exists(),
        "test data {} is missing: run `{how}` (or `scripts/setup.sh`, which makes all test data; \
         the cache is $NPUC_CACHE, default ~/.cache/npuc)",
        p.display()
    );
    p
}

/// A model file fetched by `scripts/fetch-data.sh NAME` into `$CACHE/models/NAME/FILE`.
pub fn model(name: &str, file: &str) -> PathBuf {
    cached(
        &format!("models/{name}/{file}"),
        &format!("scripts/fetch-data.sh {name}"),
    )
}

/// The Gemma 3 270M Q4_K_M GGUF.
pub fn gemma3_gguf() -> PathBuf {
    model("gemma3-270m", "gemma-3-270m-q4_k_m.gguf")
}

/// SmolLM2-135M-Instruct Q4_1 (arch `llama`).
pub fn smollm2_gguf() -> PathBuf {
    model("smollm2-135m", "smollm2-135m-instruct-q4_1.gguf")
}

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M (arch `qwen2`).
pub fn qwen25_coder_gguf() -> PathBuf {
    model(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    )
}

/// The ONNX backend test data (onnx 1.22.0).
pub fn onnx_suite() -> PathBuf {
    cached("suite/onnx-1.22.0/data", "scripts/fetch-data.sh suite")
}

/// The interpreter of the pinned test venv (numpy, onnx, onnxruntime, pillow, openai, tokenizers:
/// scripts/requirements-test.txt); fails when it is absent.
pub fn python_path() -> PathBuf {
    let p = std::env::var_os("NPUC_PYTHON")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("venv/bin/python"));
    assert!(
        p.is_file(),
        "the Python test venv is missing ({}): run `scripts/make-fixtures.sh` (or `scripts/setup.sh`), \
         or point $NPUC_PYTHON at a Python with scripts/requirements-test.txt installed",
        p.display()
    );
    p
}

/// A `Command` for the test venv's Python.
pub fn python() -> Command {
    Command::new(python_path())
}

/// The `.npy` files in `dir` whose names start with `prefix`, sorted (empty when `dir` is
/// missing: callers assert on the count and name the command that makes the data).
pub fn npy_files(dir: &std::path::Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name().is_some_and(|f| {
                        let f = f.to_string_lossy();
                        f.starts_with(prefix) && f.ends_with(".npy")
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
