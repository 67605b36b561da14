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
    tmp: Vec<Candidate>,
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
            tmp: Vec::new(),
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
        let n = logits.len();
        let k = self.params.top_k;
        self.sorted = false;
        if k > 0 && (k as usize).max(self.min_keep()) < n {
            self.select_top_k(logits, (k as usize).max(self.min_keep()));
        } else {
            self.cands.clear();
            self.cands
                .extend(logits.iter().enumerate().map(|(i, &l)| Candidate {
                    id: i as u32,
                    logit: l,
                    p: 0.0,
                }));
        }
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

    /// The top-k stage: [`Sampler::prepare`] already selected the candidates, the stage only sorts them
    /// (later stages expect llama.cpp's sorted order after top-k).
    fn top_k(&mut self) {
        if self.params.top_k > 0 {
            self.sort();
        }
    }

    /// Collects the `k` best logits (ties → lower id) without materialising the whole vocabulary: one
    /// pass that keeps a buffer of at most `2k` candidates above a running threshold and prunes it to
    /// `k` by selection when full. NaN and -inf logits never become candidates (their probability is 0).
    fn select_top_k(&mut self, logits: &[f32], k: usize) {
        let cands = &mut self.cands;
        cands.clear();
        let mut thr = f32::NEG_INFINITY;
        for (i, &l) in logits.iter().enumerate() {
            // Later ids lose ties, so an equal logit never displaces a buffered candidate.
            if l > thr {
                cands.push(Candidate {
                    id: i as u32,
                    logit: l,
                    p: 0.0,
                });
                if cands.len() == 2 * k {
                    cands.select_nth_unstable_by(k - 1, by_logit_desc);
                    cands.truncate(k);
                    thr = cands.iter().map(|c| c.logit).fold(f32::INFINITY, f32::min);
                }
            }
        }
        if cands.len() > k {
            cands.select_nth_unstable_by(k - 1, by_logit_desc);
            cands.truncate(k);
        }
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

    /// Nucleus (top-p) truncation. On an unsorted candidate set (no top-k before it) a full sort is
    /// avoided: probabilities are binned by `max_logit - logit` into [`TOP_P_BINS`] bins, the bin where
    /// the cumulative mass reaches `p` is found, and only that bin is sorted. Every token in a higher bin
    /// has a larger logit than every token in that bin, so the kept set is exactly the sorted prefix
    /// llama.cpp keeps.
    fn top_p(&mut self) {
        let p = self.params.top_p;
        if p >= 1.0 {
            return;
        }
        let min_keep = self.min_keep();
        if self.sorted || min_keep > 1 {
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
            return;
        }
        let max = max_logit(&self.cands);
        normalise(&mut self.cands, max);
        let scale = TOP_P_BINS as f32 / TOP_P_RANGE;
        let bin = |l: f32| -> usize {
            let d = (max - l) * scale;
            // NaN and very small logits go to the last bin.
            if d < (TOP_P_BINS - 1) as f32 {
                d as usize
            } else {
                TOP_P_BINS - 1
            }
        };
        let mut mass = [0.0f64; TOP_P_BINS];
        for c in &self.cands {
            mass[bin(c.logit)] += c.p as f64;
        }
        let mut above = 0.0f64;
        let mut cut_bin = None;
        for (b, &m) in mass.iter().enumerate() {
            if above + m >= p as f64 {
                cut_bin = Some(b);
                break;
            }
            above += m;
        }
        let Some(cb) = cut_bin else {
            return; // the cumulative mass never reaches p (rounding): keep everything, like llama.cpp
        };
        self.tmp.clear();
        self.tmp
            .extend(self.cands.iter().filter(|c| bin(c.logit) == cb).copied());
        self.tmp.sort_unstable_by(by_logit_desc);
        let mut cum = above;
        let mut keep_in_bin = self.tmp.len();
        for (i, c) in self.tmp.iter().enumerate() {
            cum += c.p as f64;
            if cum >= p as f64 {
                keep_in_bin = i + 1;
                break;
            }
        }
        self.tmp.truncate(keep_in_bin);
        self.cands.retain(|c| bin(c.logit) < cb);
        self.cands.extend_from_slice(&self.tmp);
        self.sorted = false;
    }

    /// Min-p truncation: keep `logit >= max_logit + ln(min_p)`.
    fn min_p(&mut self) {
        let p = self.params.min_p;
        if p <= 0.0 || self.cands.is_empty() {
            return;
        }
        let min_keep = self.min_keep();
        if !self.sorted {
            let min_logit = max_logit(&self.cands) + p.ln();
            let n = self.cands.iter().filter(|c| c.logit >= min_logit).count();
            if n >= min_keep {
                self.cands.retain(|c| c.logit >= min_logit);
                return;
            }
        }
        self.sort();
        let min_logit = self.cands[0].logit + p.ln();
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
    /// The draw walks the candidates in their current order (sorted or not: no sort is needed for it).
    fn dist(&mut self) -> Result<u32> {
        if self.cands.is_empty() {
            bail!("sampler: no finite logit among the candidates");
        }
        let max = max_logit(&self.cands);
        if !max.is_finite() {
            bail!("sampler: no finite logit among the candidates");
        }
        normalise(&mut self.cands, max);
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

/// Bins of the top-p histogram.
const TOP_P_BINS: usize = 1024;
/// Logit range (below the maximum) the top-p bins cover; below it p < e^-32 relative to the top token.
const TOP_P_RANGE: f32 = 32.0;

fn max_logit(cands: &[Candidate]) -> f32 {
    cands
        .iter()
        .map(|c| c.logit)
        .fold(f32::NEG_INFINITY, f32::max)
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
    let mut best = 0usize;
    let mut best_l = f32::NEG_INFINITY;
    // Strict `>`: the first (lowest) id wins ties, NaN never compares greater.
    for (i, &l) in logits.iter().enumerate() {
        if l > best_l {
            best = i;
            best_l = l;
        }
    }
    if best_l == f32::NEG_INFINITY {
        // every logit is -inf or NaN: the first -inf one, if any
        return match logits.iter().position(|&l| l == f32::NEG_INFINITY) {
            Some(i) => Ok(i as u32),
            None => bail!("sampler: all {} logits are NaN", logits.len()),
        };
    }
    Ok(best as u32)
}
