//! `npuc inspect MODEL.gguf`: architecture, key hyper-parameters, tensor counts and bytes by
//! GGML type; with `--json` the full metadata (long arrays summarised) and the tensor table.

use anyhow::{Context, Result};
use npuc_gguf::{GgufFile, MetaValue};
use serde_json::{json, Map, Value as Json};
use std::collections::BTreeMap;
use std::path::Path;

/// Arrays longer than this are shown as a summary (type, length, first items).
const ARRAY_SHOWN: usize = 16;

fn meta_json(v: &MetaValue) -> Json {
    match v {
        MetaValue::Array(t, items) if items.len() > ARRAY_SHOWN => json!({
            "array": format!("{t:?}"),
            "len": items.len(),
            "first": &items[..8],
        }),
        other => serde_json::to_value(other).unwrap_or(Json::Null),
    }
}

/// Short text form of a metadata value (strings truncated, arrays summarised).
fn meta_text(v: &MetaValue) -> String {
    match v {
        MetaValue::String(s) if s.chars().count() > 60 => {
            format!(
                "{:?}… ({} chars)",
                s.chars().take(60).collect::<String>(),
                s.chars().count()
            )
        }
        MetaValue::String(s) => format!("{s:?}"),
        MetaValue::Array(t, items) => format!("[{t:?} x {}]", items.len()),
        other => meta_json(other).to_string(),
    }
}

/// Hyper-parameter keys shown in the text summary (`{arch}.` is prefixed).
const HPARAMS: &[&str] = &[
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "vocab_size",
];

/// Prints the summary (or JSON with `json`) of the GGUF file at `path`.
pub fn inspect(path: &Path, json: bool) -> Result<()> {
    let g = GgufFile::open(path).with_context(|| format!("reading {}", path.display()))?;
    let arch = g.architecture().unwrap_or("?").to_string();
    let mut by_type: BTreeMap<String, (usize, u64, u64)> = BTreeMap::new();
    let (mut total_bytes, mut params) = (0u64, 0u64);
    for t in &g.tensors {
        let e = by_type.entry(t.ggml_type.name().to_string()).or_default();
        e.0 += 1;
        e.1 += t.nbytes;
        e.2 += t.numel();
        total_bytes += t.nbytes;
        params += t.numel();
    }
    let vocab = g
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .map(|a| a.len());
    if json {
        let mut meta = Map::new();
        for (k, v) in &g.metadata {
            meta.insert(k.clone(), meta_json(v));
        }
        let tensors: Vec<Json> = g
            .tensors
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "type": t.ggml_type.name(),
                    "shape": t.shape(),
                    "offset": t.offset,
                    "nbytes": t.nbytes,
                })
            })
            .collect();
        let types: Map<String, Json> = by_type
            .iter()
            .map(|(k, (n, b, p))| (k.clone(), json!({"tensors": n, "bytes": b, "params": p})))
            .collect();
        let out = json!({
            "file": path.display().to_string(),
            "format": "gguf",
            "version": g.version,
            "alignment": g.alignment,
            "architecture": arch,
            "vocab_size": vocab,
            "tensor_count": g.tensors.len(),
            "params": params,
            "total_bytes": total_bytes,
            "types": types,
            "metadata": meta,
            "tensors": tensors,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("{}: GGUF v{}", path.display(), g.version);
    println!("architecture: {arch}");
    for key in [
        "general.name",
        "general.file_type",
        "general.quantization_version",
    ] {
        if let Some(v) = g.get(key) {
            println!("{key}: {}", meta_text(v));
        }
    }
    println!("hyper-parameters:");
    for k in HPARAMS {
        let key = format!("{arch}.{k}");
        if let Some(v) = g.get(&key) {
            println!("  {key}: {}", meta_text(v));
        }
    }
    if let Some(v) = vocab {
        println!("  vocab (tokenizer.ggml.tokens): {v}");
    }
    if let Some(m) = g.get("tokenizer.ggml.model") {
        println!("  tokenizer.ggml.model: {}", meta_text(m));
    }
    println!(
        "metadata: {} keys; tensors: {}, {params} parameters, {total_bytes} bytes ({:.1} MiB)",
        g.metadata.len(),
        g.tensors.len(),
        total_bytes as f64 / (1024.0 * 1024.0)
    );
    println!("by type:");
    for (ty, (n, b, p)) in &by_type {
        println!(
            "  {ty:8} {n:5} tensors {p:12} params {b:12} bytes ({:.2} bits/weight)",
            *b as f64 * 8.0 / (*p).max(1) as f64
        );
    }
    Ok(())
}
