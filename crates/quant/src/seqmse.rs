//! SeqMSE-style weight clipping: the scale of each weight quantization parameter (a column of a
//! per-channel weight, a block of a blocked one, or the whole tensor) is chosen among
//! `absmax * r` for the ratios in [`RATIOS`], minimizing the layer's output error
//! `|| X (Q(W) - W) ||^2` on calibration rows of the layer's input, instead of the plain
//! `absmax / qmax` that never clips. Clipping a few large weights buys a finer step for all the
//! others; how much is worth it depends on the data the layer sees, which is what this measures.
//! Blocks of one column are chosen independently (their errors add up through the rows; the
//! cross terms are ignored), which is what AIMET's and QNN's SeqMSE do per block too.

use crate::qdq::{bias_encoding, fake_quantize, QEnc, QuantPlan, TensorEncoding};
use crate::Encodings;
use anyhow::{anyhow, Result};
use npuc_ir::{DType, Model, Tensor};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};

/// Candidate clip ratios (of the absolute maximum of each parameter group).
pub const RATIOS: [f32; 12] = [
    1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.5,
];

/// Calibration rows of a linear's input, keyed by the linear's weight name: input channels `k`
/// and `rows * k` values.
pub type WeightRows = HashMap<String, (usize, Vec<f32>)>;

/// What [`refine`] did.
#[derive(Clone, Debug, Default)]
pub struct SeqMseReport {
    /// Weights searched.
    pub weights: usize,
    /// Parameters (columns/blocks) whose scale was clipped below the absolute maximum.
    pub clipped: usize,
    /// Parameters in all.
    pub params: usize,
    /// Output-error reduction summed over the searched layers (dB, on the calibration rows).
    pub mean_gain_db: f64,
}

impl SeqMseReport {
    /// One line for the compile summary.
    pub fn summary(&self) -> String {
        format!(
            "seqmse: {} weights searched, {} of {} scales clipped, mean layer gain {:+.2} dB",
            self.weights, self.clipped, self.params, self.mean_gain_db
        )
    }
}

/// The layout of a linear's weight relative to its input.
pub(crate) struct Layout {
    /// Stored shape.
    pub(crate) shape: Vec<usize>,
    /// `[K, N]` (MatMul, Gemm transB=0) or `[N, K]` (Gemm transB=1).
    pub(crate) k_rows: bool,
    pub(crate) k: usize,
    pub(crate) n: usize,
}

impl Layout {
    /// Flat stored index of element `(kk, j)`.
    pub(crate) fn at(&self, kk: usize, j: usize) -> usize {
        if self.k_rows {
            kk * self.n + j
        } else {
            j * self.k + kk
        }
    }
}

/// `a [m, k] x b [k, n]` through the runtime's GEMM.
pub(crate) fn matmul(a: &[f32], m: usize, k: usize, b: Vec<f32>, n: usize) -> Result<Vec<f32>> {
    let at = Tensor::from_vec(vec![m, k], a.to_vec())?;
    let bt = Tensor::from_vec(vec![k, n], b)?;
    let y = npuc_runtime::ops::matmul::matmul_tensors(&at, &bt, 1)
        .map_err(|e| anyhow!("seqmse: {e}"))?;
    Ok(y.as_slice::<f32>().map_err(|e| anyhow!("{e}"))?.to_vec())
}

/// Which parameter of the encoding element `(kk, j)` uses, and the number of parameters;
/// `None` for layouts the search does not handle (per-row of a `[K, N]` weight).
type ParamOf = Box<dyn Fn(usize, usize) -> usize + Sync>;

fn param_of(e: &QEnc, l: &Layout) -> Option<ParamOf> {
    let out_axis = if l.k_rows { 1 } else { 0 };
    let n = l.n;
    match (e.axis, e.block_size) {
        (None, _) => Some(Box::new(|_, _| 0)),
        (Some(a), None) if a == out_axis => Some(Box::new(|_, j| j)),
        (Some(a), Some(b)) if a != out_axis => {
            let nb = l.k.div_ceil(b);
            if l.k_rows {
                Some(Box::new(move |kk, j| (kk / b) * n + j))
            } else {
                Some(Box::new(move |kk, j| j * nb + kk / b))
            }
        }
        _ => None,
    }
}

/// A searched encoding with the output error before and after.
type Searched = (QEnc, f64, f64);

/// Chooses the clip ratio of every parameter of one weight; returns the new encoding and the
/// output error before and after.
fn search(w: &Tensor, l: &Layout, e: &QEnc, x: &[f32]) -> Result<Option<Searched>> {
    let Some(param) = param_of(e, l) else {
        return Ok(None);
    };
    let data = w.as_slice::<f32>().map_err(|err| anyhow!("{err}"))?;
    let rows = x.len() / l.k;
    let np = e.scale.len();
    // Split K into the blocks whose errors are scored separately (one block for per-channel
    // and per-tensor weights).
    let kb = e.block_size.unwrap_or(l.k);
    let nblocks = l.k.div_ceil(kb);
    // err[r][p]: squared output error attributed to parameter p with ratio r.
    let errs: Vec<Vec<f64>> = RATIOS
        .par_iter()
        .map(|&r| -> Result<Vec<f64>> {
            let mut er = e.clone();
            er.scale.iter_mut().for_each(|s| *s *= r);
            let q = fake_quantize(data, &l.shape, &er);
            let mut err = vec![0f64; np];
            for bi in 0..nblocks {
                let (k0, k1) = (bi * kb, ((bi + 1) * kb).min(l.k));
                let kk = k1 - k0;
                let xb: Vec<f32> = x
                    .chunks_exact(l.k)
                    .flat_map(|row| row[k0..k1].iter().copied())
                    .collect();
                let mut d = vec![0f32; kk * l.n];
                for a in 0..kk {
                    for j in 0..l.n {
                        let i = l.at(k0 + a, j);
                        d[a * l.n + j] = q[i] - data[i];
                    }
                }
                let y = matmul(&xb, rows, kk, d, l.n)?;
                for row in y.chunks_exact(l.n) {
                    for (j, v) in row.iter().enumerate() {
                        err[param(k0, j)] += (*v as f64) * (*v as f64);
                    }
                }
            }
            Ok(err)
        })
        .collect::<Result<_>>()?;
    let mut out = e.clone();
    let (mut before, mut after) = (0f64, 0f64);
    for (p, (s_out, s_in)) in out.scale.iter_mut().zip(&e.scale).enumerate() {
        let (best, v) = errs
            .iter()
            .map(|er| er[p])
            .enumerate()
            .fold((0, f64::INFINITY), |b, c| if c.1 < b.1 { c } else { b });
        *s_out = s_in * RATIOS[best];
        before += errs[0][p];
        after += v;
    }
    Ok(Some((out, before, after)))
}

/// Searches the weight encodings of the quantized MatMul/Gemm layers of `m` that have rows in
/// `rows`, starting from the plain ones in `enc`; returns the report and the refined encodings
/// by weight name (apply them with [`overlay`]).
pub fn search_weights(
    m: &Model,
    plan: &QuantPlan,
    rows: &WeightRows,
    enc: &Encodings,
) -> Result<(SeqMseReport, BTreeMap<String, QEnc>)> {
    let jobs = linear_jobs(m, plan, rows, enc);
    let found: Vec<(String, Option<Searched>)> = jobs
        .par_iter()
        .map(|j| {
            Ok((
                j.weight.clone(),
                search(j.tensor, &j.layout, &j.enc, j.rows)?,
            ))
        })
        .collect::<Result<_>>()?;
    let mut rep = SeqMseReport::default();
    let mut gains = vec![];
    let mut refined = BTreeMap::new();
    for ((w, f), job) in found.into_iter().zip(&jobs) {
        let old = &job.enc;
        let Some((e, before, after)) = f else {
            continue;
        };
        rep.weights += 1;
        rep.params += e.scale.len();
        rep.clipped += e
            .scale
            .iter()
            .zip(&old.scale)
            .filter(|(a, b)| a < b)
            .count();
        if before > 0.0 && after > 0.0 {
            gains.push(10.0 * (before / after).log10());
        }
        refined.insert(w, e);
    }
    if !gains.is_empty() {
        rep.mean_gain_db = gains.iter().sum::<f64>() / gains.len() as f64;
    }
    Ok((rep, refined))
}

/// A quantized 2-D MatMul/Gemm weight with calibration rows of its input.
pub(crate) struct LinearJob<'a> {
    pub(crate) weight: String,
    pub(crate) tensor: &'a Tensor,
    pub(crate) layout: Layout,
    pub(crate) enc: QEnc,
    /// `rows * k` input values.
    pub(crate) rows: &'a [f32],
}

/// The quantized MatMul/Gemm layers of `m` with f32 2-D weights that have rows in `rows` and an
/// integer encoding in `enc` (LPBQ weights left out: their block scales are integers over a
/// channel scale, which clipping one block would leave).
pub(crate) fn linear_jobs<'a>(
    m: &'a Model,
    plan: &QuantPlan,
    rows: &'a WeightRows,
    enc: &Encodings,
) -> Vec<LinearJob<'a>> {
    let g = &m.graph;
    let mut jobs = vec![];
    for n in &g.nodes {
        if !(n.domain.is_empty() && (n.op_type == "MatMul" || n.op_type == "Gemm")) {
            continue;
        }
        let Some(w) = n.input(1) else { continue };
        let (Some((k, x)), Some(TensorEncoding::Int(e)), Some(wt)) =
            (rows.get(w), enc.params.get(w), g.initializer(w))
        else {
            continue;
        };
        if wt.dtype() != DType::F32
            || wt.rank() != 2
            || !plan.weights.contains_key(w)
            || e.lpbq.is_some()
        {
            continue;
        }
        let k_rows = !(n.op_type == "Gemm" && n.int_or("transB", 0).unwrap_or(0) != 0);
        let (kk, nn) = if k_rows {
            (wt.shape()[0], wt.shape()[1])
        } else {
            (wt.shape()[1], wt.shape()[0])
        };
        if kk != *k || x.is_empty() || jobs.iter().any(|j: &LinearJob| j.weight == w) {
            continue;
        }
        jobs.push(LinearJob {
            weight: w.to_string(),
            tensor: wt,
            layout: Layout {
                shape: wt.shape().to_vec(),
                k_rows,
                k: kk,
                n: nn,
            },
            enc: e.clone(),
            rows: x,
        });
    }
    jobs
}

/// Puts refined weight encodings into `enc` and re-derives the biases that depend on them.
pub fn overlay(
    m: &Model,
    plan: &QuantPlan,
    enc: &mut Encodings,
    refined: &BTreeMap<String, QEnc>,
) -> Result<()> {
    if refined.is_empty() {
        return Ok(());
    }
    for (w, e) in refined {
        if enc.params.contains_key(w) {
            enc.params.insert(w.clone(), TensorEncoding::Int(e.clone()));
        }
    }
    for (name, b) in &plan.biases {
        if refined.contains_key(&b.weight) {
            if let Some(e) = bias_encoding(&m.graph, enc, name, b)? {
                enc.params.insert(name.clone(), TensorEncoding::Int(e));
            }
        }
    }
    Ok(())
}
