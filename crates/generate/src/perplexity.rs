//! Perplexity exactly as llama.cpp's `llama-perplexity` (default mode, `--ppl-stride 0`) computes it.
//!
//! * The caller tokenizes the whole text the way llama.cpp does (`common_tokenize(text, add_special =
//!   true)`, i.e. with BOS when the model adds one) and passes the ids.
//! * At least `2 * n_ctx` tokens are required; the text is cut into `tokens.len() / n_ctx` chunks of
//!   `n_ctx` tokens (the remainder is ignored).
//! * Every chunk starts from an empty cache at position 0. When the model adds BOS, the first token of the
//!   chunk is *replaced* by BOS (llama.cpp does this for every chunk, the first one already starts with it).
//! * Only the second half is scored: the logits at positions `n_ctx/2 .. n_ctx-2` predict the tokens at
//!   `n_ctx/2 + 1 .. n_ctx - 1`, i.e. `n_ctx - 1 - n_ctx/2` predictions per chunk.
//! * Log-softmax per row: `max` in f32, `Σ exp(l - max)` of f32 exponentials accumulated in f64,
//!   `nll = -(l_tok - max - ln Σ)` in f64. PPL = `exp(mean nll)`; the uncertainty is
//!   `ppl * sqrt((E[nll²] - E[nll]²) / (count - 1))`, llama.cpp's "PPL = X +/- err".
//!
//! Memory: only the second half of a chunk needs logits, so each chunk is fed as two forward calls
//! (first half without logits, second half with all logits): `n_ctx/2 * vocab` floats instead of
//! `n_ctx * vocab` (128 MiB instead of 512 MiB for Gemma 3's 262k vocabulary at n_ctx 512).

use crate::CausalLm;
use anyhow::{bail, Context, Result};
use rayon::prelude::*;

/// Result of [`perplexity`].
#[derive(Clone, Debug, PartialEq)]
pub struct PerplexityResult {
    /// Final perplexity.
    pub ppl: f64,
    /// Its standard error (llama.cpp's `+/-` value).
    pub stderr: f64,
    /// Running perplexity after each chunk (what llama.cpp prints as `[k]value`).
    pub chunk_ppl: Vec<f64>,
    /// Number of scored tokens.
    pub count: usize,
    /// Context length used per chunk.
    pub n_ctx: usize,
    /// The model's top-1 (argmax of the logits; lowest id on ties) at every scored position, in
    /// order: what a teacher-forced agreement check compares with another engine's.
    pub top1: Vec<u32>,
}

impl PerplexityResult {
    /// llama.cpp's progress line: `[1]12.3456,[2]13.0000,...`.
    pub fn chunks_line(&self) -> String {
        self.chunk_ppl
            .iter()
            .enumerate()
            .map(|(i, p)| format!("[{}]{:.4},", i + 1, p))
            .collect()
    }

    /// llama.cpp's final line: `PPL = 13.5372 +/- 0.35626`.
    pub fn final_line(&self) -> String {
        format!("PPL = {:.4} +/- {:.5}", self.ppl, self.stderr)
    }
}

/// Index of the largest logit (the lowest on ties).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in row.iter().enumerate() {
        if l > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Negative log-likelihood of `target` under one logits row, llama.cpp's way (see the module docs).
pub fn nll(row: &[f32], target: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| (l - max).exp() as f64).sum();
    -((row[target] - max) as f64 - sum.ln())
}

/// Computes the perplexity of `tokens` (already tokenized with BOS if the model adds one) with chunks of
/// `n_ctx` tokens; `bos` is the BOS id when the model adds BOS (it replaces each chunk's first token).
/// At most `max_chunks` chunks are evaluated when given (llama.cpp's `--chunks`).
/// `on_chunk(k, running_ppl)` is called after each chunk (k from 1).
pub fn perplexity<L: CausalLm + ?Sized>(
    lm: &mut L,
    tokens: &[u32],
    n_ctx: usize,
    bos: Option<u32>,
    max_chunks: Option<usize>,
    on_chunk: &mut dyn FnMut(usize, f64),
) -> Result<PerplexityResult> {
    if n_ctx < 4 {
        bail!("perplexity: context of {n_ctx} tokens is too small (need at least 4)");
    }
    if n_ctx > lm.ctx() {
        bail!("perplexity: chunk size {n_ctx} exceeds the model context {}; load the model with --ctx {n_ctx}", lm.ctx());
    }
    if tokens.len() < 2 * n_ctx {
        bail!(
            "perplexity: need at least {} tokens for a context of {n_ctx}, the text tokenizes to only {}",
            2 * n_ctx,
            tokens.len()
        );
    }
    let vocab = lm.vocab();
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        bail!("perplexity: token {i} has id {t}, outside the vocabulary of {vocab}");
    }
    if let Some(b) = bos {
        if b as usize >= vocab {
            bail!("perplexity: BOS id {b} is outside the vocabulary of {vocab}");
        }
    }
    let n_chunk = (tokens.len() / n_ctx).min(max_chunks.unwrap_or(usize::MAX));
    if n_chunk == 0 {
        bail!("perplexity: --chunks 0 evaluates nothing");
    }
    let first = n_ctx / 2;
    let n_scored = n_ctx - 1 - first;
    let mut nll_sum = 0.0f64;
    let mut nll2_sum = 0.0f64;
    let mut count = 0usize;
    let mut chunk_ppl = Vec::with_capacity(n_chunk);
    let mut chunk = Vec::with_capacity(n_ctx);
    let mut top1 = Vec::with_capacity(n_chunk * n_scored);
    for k in 0..n_chunk {
        let start = k * n_ctx;
        chunk.clear();
        chunk.extend_from_slice(&tokens[start..start + n_ctx]);
        if let Some(b) = bos {
            chunk[0] = b;
        }
        lm.reset();
        lm.forward(&chunk[..first], false)
            .with_context(|| format!("perplexity chunk {}: first half", k + 1))?;
        let logits = lm
            .forward(&chunk[first..], true)
            .with_context(|| format!("perplexity chunk {}: second half", k + 1))?;
        let rows = n_ctx - first;
        if logits.len() != rows * vocab {
            bail!(
                "perplexity chunk {}: model returned {} logits for {rows} positions, expected {}",
                k + 1,
                logits.len(),
                rows * vocab
            );
        }
        // Row r holds the logits at position first + r, predicting chunk[first + r + 1].
        let rows: Vec<(f64, u32)> = (0..n_scored)
            .into_par_iter()
            .map(|r| {
                let row = &logits[r * vocab..(r + 1) * vocab];
                (nll(row, chunk[first + r + 1] as usize), argmax(row))
            })
            .collect();
        let (s1, s2) = rows
            .iter()
            .fold((0.0, 0.0), |a, &(v, _)| (a.0 + v, a.1 + v * v));
        top1.extend(rows.iter().map(|r| r.1));
        nll_sum += s1;
        nll2_sum += s2;
        count += n_scored;
        let running = (nll_sum / count as f64).exp();
        chunk_ppl.push(running);
        on_chunk(k + 1, running);
    }
    let mean = nll_sum / count as f64;
    let ppl = mean.exp();
    let var = nll2_sum / count as f64 - mean * mean;
    let stderr = if var > 0.0 {
        (var / (count as f64 - 1.0)).sqrt() * ppl
    } else {
        0.0
    };
    Ok(PerplexityResult {
        ppl,
        stderr,
        chunk_ppl,
        count,
        n_ctx,
        top1,
    })
}

#[cfg(test)]
mod tests {
    use super::nll;

    #[test]
    fn nll_is_negative_log_softmax() {
        // p = [1, 2, 5] / 8
        let row = [0.0f32, 2f32.ln(), 5f32.ln()];
        for (t, p) in [(0, 1.0f64 / 8.0), (1, 2.0 / 8.0), (2, 5.0 / 8.0)] {
            assert!((nll(&row, t) - (-p.ln())).abs() < 1e-6);
        }
        // shift invariance and large logits (no overflow: the max is subtracted first)
        let big: Vec<f32> = row.iter().map(|l| l + 1000.0).collect();
        assert!((nll(&big, 2) - nll(&row, 2)).abs() < 1e-4);
    }
}
