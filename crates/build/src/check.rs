//! The `check` step: the bundle against the unsplit model on the pipeline's test prompts, and
//! the sanity table of the `verify:*` steps (all in `check.json`).

use crate::cache::{Cache, Record};
#[cfg(not(unix))]
use crate::link_into;
use crate::verify::argmax;
use crate::{part_file, Pipeline};
use anyhow::{bail, Context, Result};
use npuc_llm::bundle::MANIFEST;
use npuc_llm::{Bundle, BundleOptions, Engine, EngineOptions, Precision, Variant};
use std::path::Path;

/// Greedy decoding: the first logits row (the prompt's last token) and the tokens.
fn greedy(
    mut forward: impl FnMut(&[u32]) -> Result<Vec<f32>>,
    prompt: &[u32],
    n: usize,
) -> Result<(Vec<f32>, Vec<u32>)> {
    let first = forward(prompt)?;
    let mut toks = vec![argmax(&first) as u32];
    while toks.len() < n {
        let row = forward(&[*toks.last().expect("non-empty")])?;
        toks.push(argmax(&row) as u32);
    }
    Ok((first, toks))
}

/// Makes `dest` name the file `src` without touching `src`'s metadata (a symbolic link; a
/// hard link where there are none).
fn refer_to(src: &Path, dest: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let abs = std::path::absolute(src)
            .with_context(|| format!("the absolute path of '{}'", src.display()))?;
        std::os::unix::fs::symlink(&abs, dest)
            .with_context(|| format!("linking '{}' to '{}'", dest.display(), abs.display()))
    }
    #[cfg(not(unix))]
    {
        link_into(src, dest).map(|_| ())
    }
}

/// Runs the check and writes `out` (JSON); returns the summary line.
pub(crate) fn run(
    p: &Pipeline,
    cache: &Cache,
    bundle: &Record,
    parts: &[Record],
    verifies: &[Record],
    out: &Path,
) -> Result<String> {
    let mut sanity = vec![];
    for rec in verifies {
        let path = cache.entry_dir("verify", &rec.key).join("verify.json");
        let f: crate::verify::CheckFile = serde_json::from_slice(
            &std::fs::read(&path).with_context(|| format!("reading '{}'", path.display()))?,
        )
        .with_context(|| format!("parsing '{}'", path.display()))?;
        sanity.extend(f.rows);
    }
    let sanity_line = format!("{} sanity check(s) within tolerance", sanity.len());
    if p.test_prompts.is_empty() {
        let j = serde_json::json!({
            "sanity": sanity,
            "sanity_table": crate::verify::table(&sanity),
            "prompts": [],
        });
        crate::cache::write_synced(out, &serde_json::to_vec_pretty(&j)?)?;
        return Ok(format!("{sanity_line}; no test prompts"));
    }
    // The bundle as `npuc generate` sees it: a directory of its files (symbolic links: a
    // hard link would change the entries' ctime, and so make the next run re-hash them).
    let dir = cache.scratch()?;
    for (i, rec) in parts.iter().enumerate() {
        let src = cache.entry_dir("compile", &rec.key).join("part.npuc");
        refer_to(&src, &dir.path().join(part_file(i)))?;
    }
    refer_to(
        &cache.entry_dir("bundle", &bundle.key).join(MANIFEST),
        &dir.path().join(MANIFEST),
    )?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut b = Bundle::open(
        dir.path(),
        &BundleOptions {
            threads,
            ctx: None,
            ar: vec![],
        },
    )?;
    let tok = npuc_tokenizer::Tokenizer::from_metadata(&b.metadata().entries)
        .context("the bundle's tokenizer")?;
    // The unsplit model in the same precision, when the parts share one.
    let precision: Option<Precision> = p.uniform_precision();
    // The bundle on every prompt first, then (with the bundle closed) the unsplit model: one
    // of them in memory at a time.
    let mut runs = vec![];
    for prompt in &p.test_prompts {
        let ids = tok.encode(prompt, true)?;
        if ids.len() + p.test_max_tokens > b.ctx() {
            bail!(
                "test prompt {prompt:?}: {} tokens + test.max_tokens {} exceed the largest ctx {}",
                ids.len(),
                p.test_max_tokens,
                b.ctx()
            );
        }
        b.reset();
        let (bl, bt) = greedy(|t| Ok(b.forward(t, false)?), &ids, p.test_max_tokens)?;
        runs.push((ids, bl, bt));
    }
    let ctx = b.ctx();
    drop(b);
    let mut engine = match precision {
        Some(precision) => Some(Engine::from_gguf(
            &p.gguf,
            &EngineOptions {
                threads,
                ctx: Some(ctx),
                variants: p.ar.iter().map(|&n| Variant::Ar(n)).collect(),
                precision,
                weight_quant: Default::default(),
            },
        )?),
        None => None,
    };
    let mut results = vec![];
    let mut worst = 0f32;
    let f16_embedder = p.parts[0].0.is_embedder() && p.parts[0].0.embedder_f16;
    for (prompt, (ids, bl, bt)) in p.test_prompts.iter().zip(runs) {
        let text = String::from_utf8_lossy(
            &bt.iter()
                .flat_map(|&t| tok.token_bytes(t))
                .collect::<Vec<u8>>(),
        )
        .into_owned();
        let mut r = serde_json::json!({
            "prompt": prompt, "prompt_tokens": ids, "tokens": bt, "text": text,
        });
        if let Some(e) = engine.as_mut() {
            e.reset();
            let (el, et) = greedy(|t| Ok(e.forward(t, false)?), &ids, p.test_max_tokens)?;
            let max_abs = bl
                .iter()
                .zip(&el)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let dot: f64 = bl
                .iter()
                .zip(&el)
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum();
            let na: f64 = bl.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
            let nb: f64 = el.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
            let agree = bt.iter().zip(&et).filter(|(a, b)| a == b).count();
            let cosine = dot / (na * nb).max(f64::MIN_POSITIVE);
            worst = worst.max(max_abs);
            r["unsplit_tokens"] = serde_json::json!(et);
            r["first_logits_max_abs_diff"] = serde_json::json!(max_abs);
            r["first_logits_cosine"] = serde_json::json!(cosine);
            r["top1_agreement"] = serde_json::json!(agree as f64 / bt.len() as f64);
            let diverge = bt.iter().zip(&et).position(|(a, b)| a != b);
            if f16_embedder {
                // The f16 table is not the unsplit model's lookup bit for bit: greedy runs may
                // part after a near-tie, so the bar is the prompt's logits (cosine as the
                // variant check's) and the first token.
                r["f16_embedder"] = serde_json::json!(true);
                r["tokens_diverge_at"] = serde_json::json!(diverge);
                if cosine < 0.98 || diverge == Some(0) {
                    bail!(
                        "test prompt {prompt:?}: with the f16 embedder the prompt's logits have cosine {cosine:.6} (>= 0.98 expected) and the first greedy token is {} against the unsplit model's {}",
                        bt[0],
                        et[0]
                    );
                }
            } else if let Some(k) = diverge {
                bail!(
                    "test prompt {prompt:?}: the bundle's greedy token {k} is {} but the unsplit model's is {} (same precision; the split changed the numerics)",
                    bt[k],
                    et[k]
                );
            }
        }
        results.push(r);
    }
    let j = serde_json::json!({
        "precision": precision.map(|p| p.name()),
        "compared_with_unsplit": precision.is_some(),
        "max_tokens": p.test_max_tokens,
        "prompts": results,
        "sanity": sanity,
        "sanity_table": crate::verify::table(&sanity),
    });
    crate::cache::write_synced(out, &serde_json::to_vec_pretty(&j)?)?;
    Ok(match precision {
        Some(_) => format!(
            "{sanity_line}; {} prompt(s) x {} tokens = unsplit model, first logits max |diff| {worst:.3e}",
            p.test_prompts.len(),
            p.test_max_tokens
        ),
        None => format!(
            "{sanity_line}; {} prompt(s) x {} tokens generated (mixed precision: no unsplit reference)",
            p.test_prompts.len(),
            p.test_max_tokens
        ),
    })
}
