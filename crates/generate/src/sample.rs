//! Token sampling with llama.cpp's semantics and default chain order.
//!
//! The chain is the one `common_sampler` builds by default:
//! `penalties → top_k → typical → top_p → min_p → temperature → dist`.
//! Each stage follows the corresponding `llama_sampler_*` stage:
//!
//! * **penalties** (over the last `repeat_last_n` tokens of the history; `-1` = all of it, `0` = off):
//!   a token seen `c > 0` times gets `logit / repeat_penalty` if its logit is `> 0`, else
//!   `logit * repeat_penalty`, then `logit -= c * frequency_penalty + presence_penalty`.
//! * **top_k** (`<= 0` = off): keep the `k` highest logits (partial selection, then only those are sorted).
//! * **typical** (`>= 1` = off): locally typical sampling: order by `|−ln p − H|`, keep until the
//!   cumulative probability exceeds `p`.
//! * **top_p** (`>= 1` = off): softmax over the current candidates, keep the smallest prefix (by
//!   descending logit) whose cumulative probability is `>= p`.
//! * **min_p** (`<= 0` = off): keep candidates with `p_i >= min_p * p_max`, i.e.
//!   `logit >= max_logit + ln(min_p)`.
//! * **temperature**: `logit / T`; `T <= 0` selects the argmax (greedy, ties → lowest id) and no random
//!   number is drawn.
//! * **dist**: softmax over what is left, one draw from a `ChaCha8Rng` seeded with `seed` (reproducible
//!   across platforms and versions; the draws differ from llama.cpp's `mt19937`, the distributions do not).
//!
//! `min_keep` is llama.cpp's parameter (default 0 there); every stage keeps at least `max(min_keep, 1)`
//! candidates. (llama.cpp's typical stage computes `min_keep - 1` on an unsigned value, which makes it keep
//! everything when `min_keep == 0`; we use the intended `i + 1 >= max(min_keep, 1)` instead.)
//!
//! Probabilities are normalised and accumulated in f64 (llama.cpp uses f32), so the candidate sets do
//! not depend on summation order; this only matters for thresholds that fall within f32 rounding.
//!
//! Ties in logits are broken by the lower token id everywhere, so a sampler run is deterministic for a
//! given seed regardless of sort algorithm details.

use anyhow::{bail, Result};
use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Ordering;
use std::collections::HashMap;

/// Sampling parameters; defaults are llama.cpp's `common_params_sampling` defaults (seed fixed to 0
/// here instead of "random" so runs are reproducible unless the caller picks a seed).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    /// Softmax temperature; `<= 0` means greedy argmax.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; `<= 0` disables.
    pub top_k: i32,
    /// Nucleus threshold; `>= 1` disables.
    pub top_p: f32,
    /// Minimum probability relative to the most likely token; `<= 0` disables.
    pub min_p: f32,
    /// Locally typical sampling threshold; `>= 1` disables.
    pub typical_p: f32,
    /// Repetition penalty (1 = off).
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the penalties look at; `-1` = the whole history, `0` = off.
    pub repeat_last_n: i32,
    /// Subtracted once from the logit of every token present in the penalty window.
    pub presence_penalty: f32,
    /// Subtracted `count` times from the logit of every token in the penalty window.
    pub frequency_penalty: f32,
    /// Minimum number of candidates each truncation stage keeps (at least 1).
    pub min_keep: usize,
    /// Seed of the ChaCha8 generator used by the final draw.
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            min_keep: 0,
            seed: 0,
        }
    }
}

impl SamplerParams {
    /// Greedy decoding (temperature 0), everything else at its default.
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Rejects values that have no meaning (NaN, negative penalties) with a message naming the field.
    pub fn validate(&self) -> Result<()> {
        let finite = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("typical_p", self.typical_p),
            ("repeat_penalty", self.repeat_penalty),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ];
        for (name, v) in finite {
            if !v.is_finite() {
                bail!("sampler parameter {name} must be a finite number, got {v}");
            }
        }
        if self.repeat_penalty <= 0.0 {
            bail!(
                "sampler parameter repeat_penalty must be > 0, got {}",
                self.repeat_penalty
            );
        }
        if self.repeat_last_n < -1 {
            bail!(
                "sampler parameter repeat_last_n must be >= -1, got {}",
                self.repeat_last_n
            );
        }
        Ok(())
    }
}

/// One candidate token: id and its current (possibly transformed) logit; `p` is filled by softmax stages.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Token id.
    pub id: u32,
    /// Current logit.
    pub logit: f32,
    /// Probability from the most recent softmax stage (0 until one ran).
    pub p: f32,
}

/// Descending logit, ties → lower id first. NaN logits sort last.
fn by_logit_desc(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or_else(|| a.logit.is_nan().cmp(&b.logit.is_nan()))
        .then(a.id.cmp(&b.id))
}

/// The sampler chain; owns its RNG and scratch buffers (no per-call allocation after the first call).
pub struct Sampler {
    params: SamplerParams,
    rng: ChaCha8Rng,
    cands: Vec<Candidate>,
    /// Whether `cands` is currently sorted by [`by_logit_desc`].
    sorted: bool,
    counts: HashMap<u32, u32>,
    scratch: Vec<(f32, usize)>,
}

impl Sampler {
    /// A sampler with the given parameters; fails on invalid parameters.
    pub fn new(params: SamplerParams) -> Result<Sampler> {
        params.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Ok(Sampler {
            params,
            rng,
            cands: Vec::new(),
            sorted: false,
            counts: HashMap::new(),
            scratch: Vec::new(),
        })
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// Restarts the random stream from the seed.
    pub fn reset(&mut self) {
        self.rng = ChaCha8Rng::seed_from_u64(self.params.seed);
    }

    /// Picks the next token from `logits` (one row, `[vocab]`) given the token `history` (prompt and
    /// generated tokens, oldest first). `logits` is modified in place by the penalty stage.
    /// Returns an error when `logits` is empty or holds no usable value.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> Result<u32> {
        if let Some(id) = self.prepare(logits, history)? {
            return Ok(id);
        }
        self.dist()
    }

    /// Runs penalties → top_k → typical → top_p → min_p → temperature on `logits` and returns the
    /// surviving candidates with their final probabilities (descending logit order), i.e. the exact
    /// distribution the final draw uses. For `temperature <= 0` that is the argmax alone with p = 1.
    pub fn distribution(&mut self, logits: &mut [f32], history: &[u32]) -> Result<Vec<Candidate>> {
        if let Some(id) = self.prepare(logits, history)? {
            return Ok(vec![Candidate {
                id,
                logit: logits[id as usize],
                p: 1.0,
            }]);
        }
        self.softmax();
        Ok(self.cands.clone())
    }

    /// Everything up to the final draw: `Some(id)` for greedy decoding, otherwise `None` with the
    /// surviving, temperature-scaled candidates in `self.cands`.
    fn prepare(&mut self, logits: &mut [f32], history: &[u32]) -> Result<Option<u32>> {
        if logits.is_empty() {
            bail!("sampler: empty logits row");
        }
        if logits.len() > u32::MAX as usize {
            bail!(
                "sampler: vocabulary of {} entries does not fit u32 token ids",
                logits.len()
            );
        }
        self.apply_penalties(logits, history);
        if self.params.temperature <= 0.0 {
            return greedy(logits).map(Some);
        }
        self.cands.clear();
        self.cands
            .extend(logits.iter().enumerate().map(|(i, &l)| Candidate {
                id: i as u32,
                logit: l,
                p: 0.0,
            }));
        self.sorted = false;
        self.truncate_chain();
        let t = self.params.temperature;
        for c in self.cands.iter_mut() {
            c.logit /= t;
        }
        Ok(None)
    }

    fn truncate_chain(&mut self) {
        self.top_k();
        self.typical();
        self.top_p();
        self.min_p();
    }

    fn min_keep(&self) -> usize {
        self.params.min_keep.max(1)
    }

    /// Repetition / frequency / presence penalties over the last `repeat_last_n` tokens of `history`.
    fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        if p.repeat_last_n == 0
            || (p.repeat_penalty == 1.0 && p.frequency_penalty == 0.0 && p.presence_penalty == 0.0)
        {
            return;
        }
        let n = if p.repeat_last_n < 0 {
            history.len()
        } else {
            (p.repeat_last_n as usize).min(history.len())
        };
        self.counts.clear();
        for &t in &history[history.len() - n..] {
            *self.counts.entry(t).or_insert(0) += 1;
        }
        for (&tok, &count) in &self.counts {
            // Ids outside the vocabulary cannot be penalised; skipping them is safe (llama.cpp only ever
            // visits candidates, so it ignores them the same way).
            let Some(l) = logits.get_mut(tok as usize) else {
                continue;
            };
            if *l <= 0.0 {
                *l *= p.repeat_penalty;
            } else {
                *l /= p.repeat_penalty;
            }
            *l -= count as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }

    /// Sorts the candidates (descending logit, ties by id) if they are not already.
    fn sort(&mut self) {
        if !self.sorted {
            self.cands.sort_unstable_by(by_logit_desc);
            self.sorted = true;
        }
    }

    /// Keeps the `top_k` best candidates: O(n) selection, then only the `k` survivors are sorted.
    fn top_k(&mut self) {
        let k = self.params.top_k;
        if k <= 0 {
            return;
        }
        let k = (k as usize).max(self.min_keep());
        if k < self.cands.len() {
            self.cands.select_nth_unstable_by(k - 1, by_logit_desc);
            self.cands.truncate(k);
        }
        self.sort();
    }

    /// Softmax over the current candidates; sorts them first.
    fn softmax(&mut self) {
        self.sort();
        let max = self.cands[0].logit;
        normalise(&mut self.cands, max);
    }

    /// Locally typical sampling.
    fn typical(&mut self) {
        let p = self.params.typical_p;
        if p >= 1.0 {
            return;
        }
        self.softmax();
        let entropy: f32 = self
            .cands
            .iter()
            .filter(|c| c.p > 0.0)
            .map(|c| -c.p * c.p.ln())
            .sum();
        self.scratch.clear();
        self.scratch.extend(
            self.cands
                .iter()
                .enumerate()
                .map(|(i, c)| ((-c.p.ln() - entropy).abs(), i)),
        );
        // Stable order for equal scores: candidate order (descending logit, then id).
        self.scratch.sort_by(|a, b| {
            a.0.partial_cmp(&b.0)
                .unwrap_or(Ordering::Equal)
                .then(a.1.cmp(&b.1))
        });
        let min_keep = self.min_keep();
        let mut cum = 0.0f64;
        let mut last = self.scratch.len();
        for (i, &(_, idx)) in self.scratch.iter().enumerate() {
            cum += self.cands[idx].p as f64;
            if cum > p as f64 && i + 1 >= min_keep {
                last = i + 1;
                break;
            }
        }
        let kept: Vec<Candidate> = self.scratch[..last]
            .iter()
            .map(|&(_, idx)| self.cands[idx])
            .collect();
        self.cands.clear();
        self.cands.extend(kept);
        self.sorted = false;
    }

    /// Nucleus (top-p) truncation. Without a preceding top-k the candidate set may be the whole vocabulary;
    /// instead of sorting all of it, the best `m` candidates are selected and sorted, growing `m` only when
    /// their cumulative probability does not reach `p` yet (the exact same set as a full sort).
    fn top_p(&mut self) {
        let p = self.params.top_p;
        if p >= 1.0 {
            return;
        }
        let min_keep = self.min_keep();
        if !self.sorted {
            // Softmax denominators over all candidates, without sorting.
            let max = self
                .cands
                .iter()
                .map(|c| c.logit)
                .fold(f32::NEG_INFINITY, f32::max);
            normalise(&mut self.cands, max);
            let n = self.cands.len();
            let mut m = 256.max(min_keep);
            while m < n {
                self.cands.select_nth_unstable_by(m - 1, by_logit_desc);
                self.cands[..m].sort_unstable_by(by_logit_desc);
                let mut cum = 0.0f64;
                let mut found = None;
                for (i, c) in self.cands[..m].iter().enumerate() {
                    cum += c.p as f64;
                    if cum >= p as f64 && i + 1 >= min_keep {
                        found = Some(i + 1);
                        break;
                    }
                }
                if let Some(last) = found {
                    self.cands.truncate(last);
                    self.sorted = true;
                    return;
                }
                m = m.saturating_mul(4);
            }
        }
        self.softmax();
        let mut cum = 0.0f64;
        let mut last = self.cands.len();
        for (i, c) in self.cands.iter().enumerate() {
            cum += c.p as f64;
            if cum >= p as f64 && i + 1 >= min_keep {
                last = i + 1;
                break;
            }
        }
        self.cands.truncate(last);
    }

    /// Min-p truncation: keep `logit >= max_logit + ln(min_p)`.
    fn min_p(&mut self) {
        let p = self.params.min_p;
        if p <= 0.0 || self.cands.is_empty() {
            return;
        }
        self.sort();
        let min_logit = self.cands[0].logit + p.ln();
        let min_keep = self.min_keep();
        let mut i = 1;
        while i < self.cands.len() {
            if self.cands[i].logit < min_logit && i >= min_keep {
                break;
            }
            i += 1;
        }
        self.cands.truncate(i);
    }

    /// Softmax and one draw.
    fn dist(&mut self) -> Result<u32> {
        self.softmax();
        if !self.cands[0].logit.is_finite() {
            bail!("sampler: no finite logit among the candidates");
        }
        // 53 random bits → uniform in [0, 1).
        let u = (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let total: f64 = self.cands.iter().map(|c| c.p as f64).sum();
        let target = u * total;
        let mut cum = 0.0f64;
        for c in &self.cands {
            cum += c.p as f64;
            if target < cum {
                return Ok(c.id);
            }
        }
        // Rounding can leave `target` just above the final cumulative sum: take the last positive one.
        Ok(self
            .cands
            .iter()
            .rev()
            .find(|c| c.p > 0.0)
            .unwrap_or(&self.cands[0])
            .id)
    }
}

/// Sets `p` of every candidate to its softmax probability given the maximum logit `max`. The sum is
/// accumulated in f64, so the probabilities do not depend on the candidates' order.
fn normalise(cands: &mut [Candidate], max: f32) {
    let mut sum = 0.0f64;
    for c in cands.iter_mut() {
        c.p = (c.logit - max).exp();
        sum += c.p as f64;
    }
    for c in cands.iter_mut() {
        c.p = (c.p as f64 / sum) as f32;
    }
}

/// Argmax with ties resolved to the lowest id; NaN logits are never chosen.
pub fn greedy(logits: &[f32]) -> Result<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if l <= b => {}
            _ => best = Some((i, l)),
        }
    }
    match best {
        Some((i, _)) => Ok(i as u32),
        None => bail!("sampler: all {} logits are NaN", logits.len()),
    }
}
