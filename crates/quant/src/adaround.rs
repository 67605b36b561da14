//! AdaRound: learned up/down rounding of each weight of a linear layer (Nagel et al. 2020, "Up
//! or Down? Adaptive Rounding for Post-Training Quantization"), with the layer's scales kept.
//!
//! Per weight element the code is `floor(w / s) + h` with `h = clip(sigmoid(V) (ζ - γ) + γ, 0,
//! 1)` (the rectified sigmoid, ζ = 1.1, γ = -0.1), `V` started where `h` equals the fractional
//! part (nearest rounding's neighbourhood). Adam (written here) minimizes
//! `||X (W_q - W)||² / L0 + λ / n · Σ (1 - |2h - 1|^β)` over the layer's calibration input rows
//! `X`: the reconstruction term relative to its value `L0` with nearest rounding, the
//! regularizer averaged over the `n` free elements and switched on after a warm-up, with β
//! annealed from 20 to 2 so that every `h` ends at 0 or 1. The final codes are `h >= 1/2`; a layer
//! whose learned rounding does not lower the reconstruction error on the rows keeps nearest
//! rounding. Elements at the edge of the integer range (where one direction would clip) keep
//! their nearest code. The gradient is `2 Xᵀ X E` (the Gram matrix when the layer has fewer input
//! channels than twice the rows, else two products), through the runtime's GEMM; layers run in
//! parallel.
//!
//! The result is the float model with each rounded weight replaced by its dequantized value
//! `(code - zp) s`, which the quantizer maps back to exactly those codes under the same
//! encodings (overlay them, as for SeqMSE, so that a changed absolute maximum does not change
//! the scale).

use crate::qdq::{element_param, QEnc, QuantPlan};
use crate::seqmse::{linear_jobs, matmul, LinearJob, WeightRows};
use crate::{qrange, Encodings};
use anyhow::{anyhow, Result};
use npuc_ir::{Model, Tensor};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// The rectified sigmoid's stretch.
const ZETA: f64 = 1.1;
const GAMMA: f64 = -0.1;

/// AdaRound settings.
#[derive(Clone, Debug)]
pub struct AdaRoundOptions {
    /// Adam steps per layer.
    pub iterations: usize,
    /// Regularizer weight λ (relative to the normalized reconstruction error).
    pub reg: f64,
    /// Adam learning rate on `V`.
    pub lr: f64,
    /// Fraction of the steps before the regularizer is switched on.
    pub warmup: f64,
    /// β at the start and end of the annealing.
    pub beta: (f64, f64),
}

impl Default for AdaRoundOptions {
    fn default() -> Self {
        AdaRoundOptions {
            iterations: 300,
            reg: 1.0,
            lr: 0.03,
            warmup: 0.2,
            beta: (20.0, 2.0),
        }
    }
}

/// What [`round_weights`] did.
#[derive(Clone, Debug, Default)]
pub struct AdaRoundReport {
    /// Weights optimized.
    pub weights: usize,
    /// Weights that kept nearest rounding (the learned one did not lower their error).
    pub kept_nearest: usize,
    /// Elements rounded the other way than nearest.
    pub flipped: usize,
    /// Elements in the optimized weights.
    pub elements: usize,
    /// Mean over the optimized weights of the reconstruction-error reduction (dB, on the rows).
    pub mean_gain_db: f64,
}

impl AdaRoundReport {
    /// One line for the compile summary.
    pub fn summary(&self) -> String {
        format!(
            "adaround: {} weights rounded ({} kept nearest), {} of {} codes flipped, mean layer gain {:+.2} dB",
            self.weights, self.kept_nearest, self.flipped, self.elements, self.mean_gain_db
        )
    }
}

/// One layer's result: the dequantized weight (stored layout), errors with nearest and learned
/// rounding, flipped codes.
struct Rounded {
    weight: Vec<f32>,
    nearest: f64,
    learned: f64,
    flipped: usize,
}

fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

/// `||X E||²` and the gradient factor `Xᵀ X E` for `E` `[k, n]`, with `x` `[r, k]`, `xt`
/// `[k, r]` and the Gram matrix `xtx` `[k, k]` when it is cheaper.
struct Products<'a> {
    x: &'a [f32],
    xt: Vec<f32>,
    xtx: Option<Vec<f32>>,
    r: usize,
    k: usize,
    n: usize,
}

impl Products<'_> {
    fn grad(&self, e: &[f32]) -> Result<(f64, Vec<f32>)> {
        let (r, k, n) = (self.r, self.k, self.n);
        let ge = match &self.xtx {
            Some(g) => matmul(g, k, k, e.to_vec(), n)?,
            None => {
                let xe = matmul(self.x, r, k, e.to_vec(), n)?;
                matmul(&self.xt, k, r, xe, n)?
            }
        };
        // tr(Eᵀ G E) = Σ E ⊙ (G E).
        let loss = e.iter().zip(&ge).map(|(a, b)| *a as f64 * *b as f64).sum();
        Ok((loss, ge))
    }
}

/// Learns the rounding of one layer's weight.
fn round_layer(j: &LinearJob, o: &AdaRoundOptions) -> Result<Option<Rounded>> {
    let l = &j.layout;
    let (k, n) = (l.k, l.n);
    let data = j
        .tensor
        .as_slice::<f32>()
        .map_err(|e| anyhow!("adaround: weight '{}': {e}", j.weight))?;
    let e: &QEnc = &j.enc;
    let pidx = element_param(&l.shape, e);
    let (qmin, qmax) = qrange(e.dtype);
    // In [k, n] order: the float weight, the value with h = 0, the step h moves it by (0 for
    // elements held at their nearest code), the start of V.
    let mut w = vec![0f32; k * n];
    let mut down = vec![0f32; k * n];
    let mut step = vec![0f32; k * n];
    let mut v = vec![0f64; k * n];
    let mut nearest = vec![0f32; k * n];
    let mut free = 0usize;
    for kk in 0..k {
        for jj in 0..n {
            let (at, i) = (kk * n + jj, l.at(kk, jj));
            let p = pidx(i);
            let (s, zp) = (e.scale[p], e.zero_point[p]);
            w[at] = data[i];
            if !(s > 0.0 && s.is_finite()) {
                return Ok(None);
            }
            let x = data[i] / s;
            let near = ((x.round_ties_even() as i64) + zp).clamp(qmin, qmax);
            nearest[at] = (near - zp) as f32 * s;
            let f = x.floor();
            let c = f as i64 + zp;
            if c < qmin || c >= qmax {
                down[at] = nearest[at];
                continue;
            }
            free += 1;
            down[at] = (c - zp) as f32 * s;
            step[at] = s;
            // h(V) = fractional part: sigmoid(V) = (rest - γ) / (ζ - γ), inside (0.083, 0.917).
            let sg = ((x - f) as f64 - GAMMA) / (ZETA - GAMMA);
            v[at] = (sg / (1.0 - sg)).ln();
        }
    }
    let r = j.rows.len() / k;
    if free == 0 || r == 0 {
        return Ok(None);
    }
    let mut xt = vec![0f32; k * r];
    for (ri, row) in j.rows.chunks_exact(k).enumerate() {
        for (kk, x) in row.iter().enumerate() {
            xt[kk * r + ri] = *x;
        }
    }
    let xtx = (k <= 2 * r)
        .then(|| matmul(&xt, k, r, j.rows.to_vec(), k))
        .transpose()?;
    let pr = Products {
        x: j.rows,
        xt,
        xtx,
        r,
        k,
        n,
    };
    let err_of = |q: &[f32]| -> Result<f64> {
        let d: Vec<f32> = q.iter().zip(&w).map(|(a, b)| a - b).collect();
        Ok(pr.grad(&d)?.0)
    };
    let l0 = err_of(&nearest)?;
    if !(l0 > 0.0 && l0.is_finite()) {
        return Ok(None);
    }
    let (mut m1, mut m2) = (vec![0f64; k * n], vec![0f64; k * n]);
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
    let warm = (o.warmup * o.iterations as f64) as usize;
    let mut ev = vec![0f32; k * n];
    // sigmoid(V) of the forward pass, reused by the backward one.
    let mut sgv = vec![0f64; k * n];
    for t in 0..o.iterations {
        let beta = if t < warm {
            None
        } else {
            let f = (t - warm) as f64 / (o.iterations - warm).max(1) as f64;
            Some(o.beta.0 + (o.beta.1 - o.beta.0) * f)
        };
        for at in 0..k * n {
            if step[at] == 0.0 {
                ev[at] = down[at] - w[at];
                continue;
            }
            sgv[at] = sigmoid(v[at]);
            let h = (sgv[at] * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0);
            ev[at] = down[at] + (h as f32) * step[at] - w[at];
        }
        let (_, ge) = pr.grad(&ev)?;
        let (bc1, bc2) = (1.0 - b1.powi(t as i32 + 1), 1.0 - b2.powi(t as i32 + 1));
        for at in 0..k * n {
            if step[at] == 0.0 {
                continue;
            }
            let sg = sgv[at];
            let raw = sg * (ZETA - GAMMA) + GAMMA;
            // d h / d V: zero where the rectification clips.
            let dh = if (0.0..=1.0).contains(&raw) {
                sg * (1.0 - sg) * (ZETA - GAMMA)
            } else {
                0.0
            };
            let h = raw;
            let mut g = 2.0 * ge[at] as f64 * step[at] as f64 / l0;
            if let (Some(b), true) = (beta, dh > 0.0) {
                // d/dh of (1 - |2h - 1|^β), averaged over the free elements.
                let u = 2.0 * h - 1.0;
                g += o.reg / free as f64 * (-2.0 * b * u.abs().powf(b - 1.0) * u.signum());
            }
            let g = g * dh;
            m1[at] = b1 * m1[at] + (1.0 - b1) * g;
            m2[at] = b2 * m2[at] + (1.0 - b2) * g * g;
            v[at] -= o.lr * (m1[at] / bc1) / ((m2[at] / bc2).sqrt() + eps);
        }
    }
    let hard: Vec<f32> = (0..k * n)
        .map(|at| down[at] + if v[at] >= 0.0 { step[at] } else { 0.0 })
        .collect();
    let learned = err_of(&hard)?;
    let (chosen, flipped) = if learned < l0 {
        let f = hard.iter().zip(&nearest).filter(|(a, b)| a != b).count();
        (hard, f)
    } else {
        (nearest, 0)
    };
    let mut weight = data.to_vec();
    for kk in 0..k {
        for jj in 0..n {
            weight[l.at(kk, jj)] = chosen[kk * n + jj];
        }
    }
    Ok(Some(Rounded {
        weight,
        nearest: l0,
        learned,
        flipped,
    }))
}

/// Learns the rounding of the quantized MatMul/Gemm weights of `m` that have rows in `rows`,
/// under their encodings in `enc`; returns the report, the model with those weights replaced by
/// their rounded dequantized values, and the encodings they were rounded under by weight name
/// (overlay them with [`crate::seqmse::overlay`]).
pub fn round_weights(
    m: &Model,
    plan: &QuantPlan,
    rows: &WeightRows,
    enc: &Encodings,
    o: &AdaRoundOptions,
) -> Result<(AdaRoundReport, Model, BTreeMap<String, QEnc>)> {
    if o.iterations == 0 || o.lr.is_nan() || o.lr <= 0.0 || o.reg.is_nan() || o.reg < 0.0 {
        return Err(anyhow!(
            "adaround: iterations, learning rate and regularizer must be positive"
        ));
    }
    let jobs = linear_jobs(m, plan, rows, enc);
    let done: Vec<Option<Rounded>> = jobs
        .par_iter()
        .map(|j| round_layer(j, o))
        .collect::<Result<_>>()?;
    let mut rep = AdaRoundReport::default();
    let mut gains = vec![];
    let mut out = m.clone();
    let mut used = BTreeMap::new();
    for (j, r) in jobs.iter().zip(done) {
        let Some(r) = r else { continue };
        rep.weights += 1;
        rep.elements += r.weight.len();
        rep.flipped += r.flipped;
        if r.learned >= r.nearest {
            rep.kept_nearest += 1;
            gains.push(0.0);
        } else {
            gains.push(10.0 * (r.nearest / r.learned.max(1e-300)).log10());
        }
        let t = Tensor::from_vec(j.tensor.shape().to_vec(), r.weight)?;
        let init = out
            .graph
            .initializers
            .iter_mut()
            .find(|i| i.name == j.weight)
            .ok_or_else(|| anyhow!("adaround: weight '{}' is not an initializer", j.weight))?;
        init.tensor = t;
        used.insert(j.weight.clone(), j.enc.clone());
    }
    if !gains.is_empty() {
        rep.mean_gain_db = gains.iter().sum::<f64>() / gains.len() as f64;
    }
    Ok((rep, out, used))
}

#[cfg(test)]
mod tests {
    use super::*;
    use npuc_ir::DType;

    /// A tiny layer: learned rounding never does worse than nearest on the rows it learned on,
    /// and every code stays on the encoding's grid.
    #[test]
    fn learned_rounding_not_worse_than_nearest() {
        let (k, n, r) = (16, 8, 64);
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let w: Vec<f32> = (0..k * n).map(|_| rnd()).collect();
        // Correlated inputs (what makes rounding choices interact).
        let rows: Vec<f32> = (0..r)
            .flat_map(|_| {
                let base = rnd();
                (0..k).map(|_| base + 0.3 * rnd()).collect::<Vec<_>>()
            })
            .collect();
        let tensor = Tensor::from_vec(vec![k, n], w.clone()).unwrap();
        let scale: Vec<f32> = (0..n).map(|_| 1.0 / 7.0).collect();
        let enc = QEnc {
            dtype: DType::I4,
            scale: scale.clone(),
            zero_point: vec![0; n],
            axis: Some(1),
            block_size: None,
            param_shape: vec![n],
            lpbq: None,
        };
        let job = LinearJob {
            weight: "w".into(),
            tensor: &tensor,
            layout: crate::seqmse::Layout {
                shape: vec![k, n],
                k_rows: true,
                k,
                n,
            },
            enc,
            rows: &rows,
        };
        let r = round_layer(&job, &AdaRoundOptions::default())
            .unwrap()
            .unwrap();
        assert!(r.learned.min(r.nearest) <= r.nearest);
        for (q, f) in r.weight.iter().zip(&w) {
            let c = q / scale[0];
            assert!((c - c.round()).abs() < 1e-4, "{q} off the grid");
            assert!(
                (q - f).abs() <= scale[0] * 1.0001,
                "{q} more than a step from {f}"
            );
        }
        eprintln!(
            "nearest {:.4e}, learned {:.4e}, {} flipped",
            r.nearest, r.learned, r.flipped
        );
        assert!(r.learned < r.nearest, "learned rounding gained nothing");
    }
}
