//! `npuc compile --target-sqnr DB --max-16bit-fraction F`: the tensors to keep at 16 bits to
//! reach a target output SQNR with at most a given number of the 8-bit activations promoted.
//!
//! Each candidate's share of the output noise is measured both ways: the gain when it alone is
//! promoted in the all-8-bit model, and the loss when it alone is left at 8 bits in the model
//! with every candidate at 16. Quantization noise from separate quantizers adds up at the output
//! close to linearly in power (10^(-SQNR/10), relative to the signal), so each measurement is a
//! noise share; a candidate's share is the larger of the two (they differ where promotions
//! interact: how much of a tensor's noise reaches the output depends on what the layers after it
//! add). Weights are promoted first: a 16-bit weight changes no activation buffer, so it does not
//! count against the activation budget (it costs weight bytes). Activations follow in order of
//! share, as many as the budget allows; when that reaches the target, the fewest activations of
//! that order that still do are found (bisection), then the weights with the smallest share per
//! element are dropped while the target holds (bisection, then one at a time), then single
//! activations (last-ranked first) within `prune_evals` while the SQNR stays [`PRUNE_MARGIN_DB`]
//! above the target. When the ranked prefix misses, a
//! measured greedy pass adds activations in the same order keeping only those that raise the
//! SQNR; when that misses too, the number of activations that would reach the target (every weight
//! at 16 bits) is found by bisection and reported. The result is a small passing set, not a
//! proven minimum.

use super::promote::{candidates, local_noise, promote, Candidate, Evaluator, Kind};

/// Single promotions are dropped only while the SQNR stays this far above the target. Each drop
/// is chosen by the same held-out samples that measure the result, so pruning to the bare
/// target selects the set those few samples happen to favour: on all-MiniLM-L6-v2 (8 search
/// samples) a set pruned to 20.02 dB measured 19.53 dB on 8 other sentences. 0.25 dB is about
/// the spread of the 8-sample estimate there between runs that differ only in float rounding.
const PRUNE_MARGIN_DB: f64 = 0.25;
use super::promote::{SuggestInput, Suggestion};
use super::Acc;
use anyhow::Result;
use npuc_ir::Model;

/// Inputs of [`suggest_within_budget`].
pub struct BudgetInput<'a> {
    /// The search inputs (`sensitivity_evals` is unused: every candidate is measured).
    pub suggest: SuggestInput<'a>,
    /// Most activations that may go to 16 bits.
    pub max_acts: usize,
}

/// One candidate's measured effect on the output SQNR.
#[derive(Clone, Debug)]
pub struct Sensitivity {
    /// The tensor.
    pub tensor: String,
    /// Output SQNR gain (dB) when it alone is promoted in the all-8-bit model.
    pub promote_alone_gain_db: f64,
    /// Output SQNR loss (dB) when it alone stays 8-bit in the all-16-bit model.
    pub demote_alone_loss_db: f64,
}

/// What the budgeted search found.
pub struct BudgetResult {
    /// The chosen tensors, SQNR reached, and so on (`reached`: within the budget).
    pub suggestion: Suggestion,
    /// The model with the chosen tensors promoted.
    pub model: Model,
    /// The model with only the chosen weights promoted (the latency split).
    pub weights_model: Model,
    /// The budget.
    pub max_acts: usize,
    /// When the budget does not reach the target: (activations, SQNR dB) of the fewest
    /// activations in share order that, with every weight at 16 bits, reach it.
    pub needed: Option<(usize, f64)>,
    /// Sensitivity of each chosen tensor, same order as `suggestion.tensors`.
    pub chosen: Vec<Sensitivity>,
}

/// Noise power relative to the signal of an output SQNR; a NaN SQNR (broken output) is
/// unbounded noise.
fn noise(db: f64) -> f64 {
    if db.is_nan() {
        f64::INFINITY
    } else {
        10f64.powf(-db / 10.0)
    }
}

/// Runs the search; see the module documentation.
pub fn suggest_within_budget(inp: &BudgetInput, log: &mut dyn FnMut(&str)) -> Result<BudgetResult> {
    let si = &inp.suggest;
    let q = si.quantized;
    let cands = candidates(q, si.reference);
    let local = local_noise(si, &cands)?;
    let mut ev = Evaluator::new(si)?;
    let build = |set: &[usize]| promote(q, &cands, set, si.headroom, si.ranges);
    let target = si.target_db;
    let every: Vec<usize> = (0..cands.len()).collect();
    let (base_db, base_cos) = ev.eval(q.clone())?;
    let (all_db, all_cos) = ev.eval(build(&every)?)?;
    log(&format!(
        "target search: {} candidates; {} dB as calibrated, {} dB with all at 16 bits",
        cands.len(),
        super::fmt_db(base_db),
        super::fmt_db(all_db)
    ));
    let mut out = Outcome {
        cands: &cands,
        local: &local,
        base_db,
        all_db,
        target,
        max_acts: inp.max_acts,
        sens: vec![],
    };
    if base_db >= target {
        return out.finish(vec![], (base_db, base_cos), None, &ev, &build);
    }
    // Sensitivity both ways, as noise shares.
    let (nb, na) = (noise(base_db), noise(all_db));
    let mut share = vec![0f64; cands.len()];
    // Evaluation 2c: candidate c alone at 16 bits; 2c + 1: all but c.
    let both = ev.eval_each(2 * cands.len(), &|i| {
        let c = i / 2;
        if i % 2 == 0 {
            build(&[c])
        } else {
            let rest: Vec<usize> = every.iter().copied().filter(|&x| x != c).collect();
            build(&rest)
        }
    })?;
    for c in 0..cands.len() {
        let ((p, _), (d, _)) = (both[2 * c], both[2 * c + 1]);
        // An all-8-bit model with unbounded noise says nothing about a single promotion.
        let gain = if nb.is_finite() {
            (nb - noise(p)).max(0.0)
        } else {
            0.0
        };
        let loss = (noise(d) - na).max(0.0);
        share[c] = gain.max(loss);
        out.sens.push(Sensitivity {
            tensor: cands[c].tensor.clone(),
            promote_alone_gain_db: p - base_db,
            demote_alone_loss_db: all_db - d,
        });
    }
    let by_share = |v: &mut Vec<usize>, per: &dyn Fn(usize) -> f64| {
        // Largest first; ties: the lower local SQNR first.
        v.sort_by(|&a, &b| {
            per(b)
                .total_cmp(&per(a))
                .then(local[a].sqnr_db().total_cmp(&local[b].sqnr_db()))
                .then(a.cmp(&b))
        });
    };
    let mut acts: Vec<usize> = every
        .iter()
        .copied()
        .filter(|&c| cands[c].is_activation())
        .collect();
    let mut weights: Vec<usize> = every
        .iter()
        .copied()
        .filter(|&c| !cands[c].is_activation())
        .collect();
    by_share(&mut acts, &|c| share[c]);
    by_share(&mut weights, &|c| share[c]);
    log(&format!(
        "target search: sensitivities measured ({} evaluations); largest noise shares: {}",
        ev.evaluations,
        top(&share, 5)
            .iter()
            .map(|&c| format!("{} {:.2e}", cands[c].tensor, share[c]))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let b = inp.max_acts.min(acts.len());
    let set_of =
        |ws: &[usize], a: &[usize]| -> Vec<usize> { ws.iter().chain(a).copied().collect() };
    let eval_set =
        |ev: &mut Evaluator, log: &mut dyn FnMut(&str), set: &[usize]| -> Result<(f64, f64)> {
            let r = ev.eval(build(set)?)?;
            log(&format!(
                "target search: {} weights + {} activations -> {} dB",
                set.iter().filter(|&&c| !cands[c].is_activation()).count(),
                set.iter().filter(|&&c| cands[c].is_activation()).count(),
                super::fmt_db(r.0)
            ));
            Ok(r)
        };
    // A passing activation set within the budget, with every weight promoted.
    let mut passing: Option<(Vec<usize>, (f64, f64))> = None;
    let full = eval_set(&mut ev, log, &set_of(&weights, &acts[..b]))?;
    let mut best = (set_of(&weights, &acts[..b]), full);
    if full.0 >= target {
        // The fewest activations of the ranking (bisection: `hi` passes, `lo` does not).
        let w_only = eval_set(&mut ev, log, &weights)?;
        if w_only.0 >= target {
            passing = Some((vec![], w_only));
        } else {
            let (mut lo, mut hi, mut at_hi) = (0usize, b, full);
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                let r = eval_set(&mut ev, log, &set_of(&weights, &acts[..mid]))?;
                if r.0 >= target {
                    (hi, at_hi) = (mid, r);
                } else {
                    lo = mid;
                }
            }
            passing = Some((acts[..hi].to_vec(), at_hi));
        }
    } else {
        // Measured greedy: keep an activation only when it raises the SQNR.
        let mut cur = (vec![], eval_set(&mut ev, log, &weights)?);
        for &c in &acts {
            if cur.0.len() >= b || cur.1 .0 >= target {
                break;
            }
            let mut trial = cur.0.clone();
            trial.push(c);
            let r = ev.eval(build(&set_of(&weights, &trial))?)?;
            if r.0 > cur.1 .0 {
                cur = (trial, r);
            }
        }
        log(&format!(
            "target search: greedy within the budget: {} activations -> {} dB",
            cur.0.len(),
            super::fmt_db(cur.1 .0)
        ));
        if cur.1 .0 >= target {
            passing = Some(cur);
        } else if cur.1 .0 > best.1 .0 {
            best = (set_of(&weights, &cur.0), cur.1);
        }
    }
    let Some((chosen_acts, at)) = passing else {
        if all_db.is_nan() || all_db < target {
            return out.finish(best.0, best.1, None, &ev, &build);
        }
        // What would reach it: the fewest activations of the ranking, every weight at 16 bits
        // (all of them pass: that is every candidate).
        let (mut lo, mut hi, mut at_hi) = (b, acts.len(), (all_db, all_cos));
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let r = eval_set(&mut ev, log, &set_of(&weights, &acts[..mid]))?;
            if r.0 >= target {
                (hi, at_hi) = (mid, r);
            } else {
                lo = mid;
            }
        }
        return out.finish(best.0, best.1, Some((hi, at_hi.0)), &ev, &build);
    };
    // Weights with the least share per element go first (a 16-bit weight costs a byte per
    // element more): drop the longest such run that keeps the target.
    let mut wasc = weights.clone();
    let elems = |c: usize| match &cands[c].kind {
        Kind::Weight { float, .. } => float.len().max(1) as f64,
        Kind::Act { .. } => 1.0,
    };
    by_share(&mut wasc, &|c| share[c] / elems(c));
    wasc.reverse();
    let mut at = at;
    let none = eval_set(&mut ev, log, &chosen_acts)?;
    let cut = if none.0 >= target {
        at = none;
        wasc.len()
    } else {
        let (mut lo, mut hi) = (0usize, wasc.len());
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let r = eval_set(&mut ev, log, &set_of(&wasc[mid..], &chosen_acts))?;
            if r.0 >= target {
                (lo, at) = (mid, r);
            } else {
                hi = mid;
            }
        }
        lo
    };
    let mut set = set_of(&wasc[cut..], &chosen_acts);
    // One at a time: activations last-ranked first, then weights least share per element first.
    let mut order: Vec<usize> = chosen_acts.iter().rev().copied().collect();
    order.extend(wasc[cut..].iter().copied());
    let mut budget = si.prune_evals;
    for c in order {
        if budget == 0 || set.len() <= 1 {
            break;
        }
        budget -= 1;
        let trial: Vec<usize> = set.iter().copied().filter(|&x| x != c).collect();
        let r = ev.eval(build(&trial)?)?;
        if r.0 >= target + PRUNE_MARGIN_DB {
            log(&format!(
                "target search: dropped {} ({} dB without it)",
                cands[c].tensor,
                super::fmt_db(r.0)
            ));
            set = trial;
            at = r;
        }
    }
    out.finish(set, at, None, &ev, &build)
}

/// The `n` candidates with the largest share, activations and weights together.
fn top(share: &[f64], n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..share.len()).collect();
    v.sort_by(|&a, &b| share[b].total_cmp(&share[a]));
    v.truncate(n);
    v
}

/// What every exit of the search needs to build its result.
struct Outcome<'c> {
    cands: &'c [Candidate],
    local: &'c [Acc],
    base_db: f64,
    all_db: f64,
    target: f64,
    max_acts: usize,
    sens: Vec<Sensitivity>,
}

impl Outcome<'_> {
    fn finish(
        self,
        set: Vec<usize>,
        (db, cos): (f64, f64),
        needed: Option<(usize, f64)>,
        ev: &Evaluator,
        build: &dyn Fn(&[usize]) -> Result<Model>,
    ) -> Result<BudgetResult> {
        let cands = self.cands;
        let acts = set.iter().filter(|&&c| cands[c].is_activation()).count();
        let weights: Vec<usize> = set
            .iter()
            .copied()
            .filter(|&c| !cands[c].is_activation())
            .collect();
        let chosen = set
            .iter()
            .map(|&c| {
                self.sens.get(c).cloned().unwrap_or(Sensitivity {
                    tensor: cands[c].tensor.clone(),
                    promote_alone_gain_db: f64::NAN,
                    demote_alone_loss_db: f64::NAN,
                })
            })
            .collect();
        Ok(BudgetResult {
            suggestion: Suggestion {
                tensors: set.iter().map(|&c| cands[c].tensor.clone()).collect(),
                schemes: set.iter().map(|&c| cands[c].scheme().to_string()).collect(),
                local_sqnr_db: set.iter().map(|&c| self.local[c].sqnr_db()).collect(),
                sqnr_db: db,
                cosine: cos,
                baseline_db: self.base_db,
                all_promoted_db: self.all_db,
                candidates: cands.len(),
                reached: db >= self.target && acts <= self.max_acts,
                target_db: self.target,
                evaluations: ev.evaluations,
            },
            model: build(&set)?,
            weights_model: build(&weights)?,
            max_acts: self.max_acts,
            needed,
            chosen,
        })
    }
}
