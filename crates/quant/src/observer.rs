//! Streaming activation statistics and range estimators.
//!
//! One [`Observer`] per calibrated tensor keeps the exact min/max plus a signed histogram over
//! `[-R, R]` whose half range `R` doubles (merging bin pairs) whenever a sample exceeds it, so
//! memory is constant whatever the number of samples and no second pass over the data is needed.
//! The histogram depends on the order samples arrive in (the first one fixes the resolution), so
//! calibration feeds histogram observers in sample order; min/max-only observers of disjoint
//! sample sets combine exactly with [`Observer::merge`].

use anyhow::{bail, Result};

/// Histogram bins over `[-R, R]`; folded to |x| this gives the 2048 bins of the TensorRT
/// entropy calibrator.
pub const BINS: usize = 4096;

/// How an activation's clipping range is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CalibMethod {
    /// Observed min and max (QNN "tf").
    MinMax,
    /// The given two-sided percentile of the values, e.g. 99.99.
    Percentile(f64),
    /// The range minimising expected quantization MSE (clipping + rounding) on the histogram.
    Mse,
    /// The symmetric threshold minimising KL divergence (TensorRT entropy calibration).
    Entropy,
}

impl CalibMethod {
    /// Parses `minmax|percentile|mse|entropy`; `percentile` takes `p` (0 < p <= 100).
    pub fn parse(s: &str, p: f64) -> Result<CalibMethod> {
        Ok(match s {
            "minmax" | "tf" => CalibMethod::MinMax,
            "percentile" => {
                if !(p > 50.0 && p <= 100.0) {
                    bail!("--percentile must be in (50, 100], got {p}");
                }
                CalibMethod::Percentile(p)
            }
            "mse" | "enhanced" => CalibMethod::Mse,
            "entropy" | "kl" => CalibMethod::Entropy,
            _ => bail!(
                "unknown calibration method '{s}'; expected minmax, percentile, mse or entropy"
            ),
        })
    }

    /// Name as accepted by [`Self::parse`].
    pub fn name(&self) -> String {
        match self {
            CalibMethod::MinMax => "minmax".into(),
            CalibMethod::Percentile(p) => format!("percentile {p}"),
            CalibMethod::Mse => "mse".into(),
            CalibMethod::Entropy => "entropy".into(),
        }
    }
}

/// Streaming statistics of one tensor.
#[derive(Clone, Debug)]
pub struct Observer {
    /// Smallest value seen.
    pub min: f32,
    /// Largest value seen.
    pub max: f32,
    /// Values seen.
    pub count: u64,
    /// Whether the histogram is kept (not needed for min/max).
    with_hist: bool,
    half_range: f32,
    hist: Vec<u64>,
}

impl Observer {
    /// A fresh observer; `with_hist` = keep a histogram (every method but min/max needs it).
    pub fn new(with_hist: bool) -> Observer {
        Observer {
            min: f32::INFINITY,
            max: f32::NEG_INFINITY,
            count: 0,
            with_hist,
            half_range: 0.0,
            hist: if with_hist { vec![0; BINS] } else { vec![] },
        }
    }

    /// Adds a batch of values. Returns the flat index of the first NaN/Inf instead (nothing
    /// is recorded then), so callers can name the offending tensor.
    pub fn add(&mut self, xs: &[f32]) -> Result<(), usize> {
        if xs.is_empty() {
            return Ok(());
        }
        let Some((lo, hi)) = min_max_finite(xs) else {
            return Err(xs.iter().position(|x| !x.is_finite()).unwrap_or(0));
        };
        self.min = self.min.min(lo);
        self.max = self.max.max(hi);
        self.count += xs.len() as u64;
        if !self.with_hist {
            return Ok(());
        }
        let amax = lo.abs().max(hi.abs());
        if self.half_range == 0.0 {
            if amax == 0.0 {
                // All zeros: the middle bin whatever R will be.
                self.hist[BINS / 2] += xs.len() as u64;
                return Ok(());
            }
            // First non-zero batch fixes the initial resolution to its own range.
            // Values seen so far were all zero: they sit in the middle bin whatever R is.
            self.half_range = amax;
        }
        while amax > self.half_range {
            self.grow();
        }
        let r = self.half_range;
        let k = BINS as f32 / (2.0 * r);
        // Bin `trunc((x + r) * k)`, the last one also taking `x == r`.
        npuc_runtime::kernels::hist::count_bins(xs, r, k, &mut self.hist);
        Ok(())
    }

    /// Folds the min/max and count of `other` (the same tensor observed on other samples) into
    /// `self`; exact whatever the order. Histograms are not merged: they depend on the order of
    /// the samples, so histogram observers must see every sample themselves.
    pub fn merge(&mut self, other: &Observer) {
        debug_assert!(!self.with_hist && !other.with_hist);
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.count += other.count;
    }

    /// Whether this observer keeps a histogram (see [`Observer::merge`]).
    pub fn has_histogram(&self) -> bool {
        self.with_hist
    }

    /// Doubles the histogram's half range: old bins `2j, 2j+1` merge into new bin `BINS/4 + j`.
    fn grow(&mut self) {
        let mut new = vec![0u64; BINS];
        for (i, &c) in self.hist.iter().enumerate() {
            new[BINS / 4 + i / 2] += c;
        }
        self.hist = new;
        self.half_range *= 2.0;
    }

    /// Bin width and `(center, count)` of every bin.
    fn bins(&self) -> (f32, impl Iterator<Item = (f64, f64)> + '_) {
        let r = self.half_range as f64;
        let w = 2.0 * r / BINS as f64;
        (
            w as f32,
            self.hist
                .iter()
                .enumerate()
                .map(move |(i, &c)| (-r + (i as f64 + 0.5) * w, c as f64)),
        )
    }

    /// The clipping range `[lo, hi]` chosen by `method` for a quantized type with `levels`
    /// steps (255 for 8-bit) and the given symmetry.
    pub fn range(&self, method: CalibMethod, levels: u32, symmetric: bool) -> (f32, f32) {
        if self.count == 0 {
            return (0.0, 0.0);
        }
        if self.half_range == 0.0 || !self.with_hist {
            return (self.min, self.max);
        }
        match method {
            CalibMethod::MinMax => (self.min, self.max),
            CalibMethod::Percentile(p) => self.percentile(p),
            CalibMethod::Mse => self.mse(levels, symmetric),
            CalibMethod::Entropy => {
                let t = self.entropy_threshold(levels);
                (self.min.max(-t), self.max.min(t))
            }
        }
    }

    /// Two-sided percentile: the values at `(100-p)%` and `p%` of the distribution.
    fn percentile(&self, p: f64) -> (f32, f32) {
        let total = self.hist.iter().sum::<u64>() as f64;
        let lo_target = total * (1.0 - p / 100.0);
        let hi_target = total * (p / 100.0);
        let r = self.half_range as f64;
        let w = 2.0 * r / BINS as f64;
        let (mut lo, mut hi) = (self.min as f64, self.max as f64);
        let mut cum = 0.0;
        let mut lo_set = false;
        for (i, &c) in self.hist.iter().enumerate() {
            let prev = cum;
            cum += c as f64;
            if !lo_set && cum > lo_target {
                // Linear interpolation inside the bin.
                let f = if c > 0 {
                    (lo_target - prev) / c as f64
                } else {
                    0.0
                };
                lo = -r + (i as f64 + f) * w;
                lo_set = true;
            }
            if cum >= hi_target {
                let f = if c > 0 {
                    (hi_target - prev) / c as f64
                } else {
                    1.0
                };
                hi = -r + (i as f64 + f) * w;
                break;
            }
        }
        ((lo as f32).max(self.min), (hi as f32).min(self.max))
    }

    /// Grid search over shrunk ranges for the smallest expected squared error: values inside the
    /// range cost `step²/12` (uniform rounding), values outside cost their distance to the
    /// clipping bound squared. Prefix sums make each candidate O(1).
    fn mse(&self, levels: u32, symmetric: bool) -> (f32, f32) {
        let (_, it) = self.bins();
        let bins: Vec<(f64, f64)> = it.collect();
        // Prefix sums of c, c*x, c*x^2.
        let mut pc = vec![0.0f64; BINS + 1];
        let mut px = vec![0.0f64; BINS + 1];
        let mut pxx = vec![0.0f64; BINS + 1];
        for (i, &(x, c)) in bins.iter().enumerate() {
            pc[i + 1] = pc[i] + c;
            px[i + 1] = px[i] + c * x;
            pxx[i + 1] = pxx[i] + c * x * x;
        }
        let r = self.half_range as f64;
        let w = 2.0 * r / BINS as f64;
        let idx = |v: f64| -> usize { (((v + r) / w).floor().max(0.0) as usize).min(BINS) };
        let cost = |lo: f64, hi: f64| -> f64 {
            let (a, b) = (idx(lo), idx(hi).max(idx(lo)));
            // Bins fully below lo / above hi are clipped.
            let below = pxx[a] - 2.0 * lo * px[a] + lo * lo * pc[a];
            let (cb, xb, xxb) = (pc[BINS] - pc[b], px[BINS] - px[b], pxx[BINS] - pxx[b]);
            let above = xxb - 2.0 * hi * xb + hi * hi * cb;
            let step = (hi - lo) / levels as f64;
            let inside = (pc[b] - pc[a]) * step * step / 12.0;
            below + above + inside
        };
        let (min, max) = (self.min.min(0.0) as f64, self.max.max(0.0) as f64);
        let mut best = (cost(min, max), min, max);
        // Coarse grid over the shrink factors 1..0.05 of each side, then two refinements around
        // the best point at a tenth of the previous spacing each: the optimum of a heavy-tailed
        // distribution often clips under 1% of the range, far finer than any affordable
        // uniform grid (each evaluation is O(1), so 3 x 61 or 3 x 61² evaluations are cheap).
        const STEPS: i64 = 60;
        let (mut ci, mut cj) = (1.0f64, 1.0f64);
        for round in 0..3 {
            // Round 0: 1, 1-d, ..., 0.05. Later rounds: +-10 steps of d/10 around the best, i.e.
            // one step of the previous round either side.
            let d = 0.95 / STEPS as f64 / 10f64.powi(round);
            let ks: Vec<f64> = if round == 0 {
                (0..=STEPS).map(|k| -(k as f64)).collect()
            } else {
                (-10..=10).map(|k| k as f64).collect()
            };
            let (bi, bj) = (ci, cj);
            let factor = |c: f64, k: f64| (c + d * k).clamp(0.05, 1.0);
            if symmetric {
                let amax = min.abs().max(max);
                for &k in &ks {
                    let f = factor(bi, k);
                    let c = cost(-amax * f, amax * f);
                    if c < best.0 {
                        best = (c, -amax * f, amax * f);
                        (ci, cj) = (f, f);
                    }
                }
            } else {
                for &ki in &ks {
                    let fi = factor(bi, ki);
                    for &kj in &ks {
                        let fj = factor(bj, kj);
                        let c = cost(min * fi, max * fj);
                        if c < best.0 {
                            best = (c, min * fi, max * fj);
                            (ci, cj) = (fi, fj);
                        }
                    }
                }
            }
        }
        (best.1 as f32, best.2 as f32)
    }

    /// TensorRT-style entropy calibration on the |x| histogram (2048 bins): the threshold whose
    /// clipped-and-quantized distribution (`levels/2` bins) has the least KL divergence from the
    /// clipped reference.
    pub fn entropy_threshold(&self, levels: u32) -> f32 {
        let half = BINS / 2;
        let mut abs = vec![0f64; half];
        for (i, &c) in self.hist.iter().enumerate() {
            let j = if i >= half { i - half } else { half - 1 - i };
            abs[j] += c as f64;
        }
        let w = self.half_range as f64 / half as f64;
        let nq = (levels as usize).div_ceil(2).max(2);
        if nq >= half {
            // More quantization levels than bins: clipping cannot help.
            return self.half_range;
        }
        let mut best = (f64::INFINITY, half);
        let mut p = vec![0f64; half];
        let mut q = vec![0f64; half];
        for i in nq..=half {
            p[..i].copy_from_slice(&abs[..i]);
            let outliers: f64 = abs[i..].iter().sum();
            p[i - 1] += outliers;
            // Merge the i reference bins into nq levels, then spread each level back evenly
            // over its non-empty source bins.
            let per = i as f64 / nq as f64;
            for k in 0..nq {
                let s = (k as f64 * per) as usize;
                let e = if k == nq - 1 {
                    i
                } else {
                    ((k + 1) as f64 * per) as usize
                };
                let total: f64 = abs[s..e].iter().sum();
                let nz = abs[s..e].iter().filter(|&&c| c > 0.0).count();
                for j in s..e {
                    q[j] = if abs[j] > 0.0 && nz > 0 {
                        total / nz as f64
                    } else {
                        0.0
                    };
                }
            }
            let (sp, sq): (f64, f64) = (p[..i].iter().sum(), q[..i].iter().sum());
            if sp <= 0.0 || sq <= 0.0 {
                continue;
            }
            let mut kl = 0.0;
            for j in 0..i {
                if p[j] > 0.0 {
                    let pj = p[j] / sp;
                    // Empty q where p is not: smoothed, as TensorRT's implementation does.
                    let qj = (q[j] / sq).max(1e-10);
                    kl += pj * (pj / qj).ln();
                }
            }
            if kl < best.0 {
                best = (kl, i);
            }
        }
        ((best.1 as f64 + 0.5) * w).min(self.half_range as f64) as f32
    }
}

/// Min and max of `xs`, or `None` if it holds a NaN or an infinity (the runtime's kernel,
/// compiled per ISA level; -0.0 reads +0.0).
pub fn min_max_finite(xs: &[f32]) -> Option<(f32, f32)> {
    npuc_runtime::kernels::qconvert::min_max_finite(xs)
}
