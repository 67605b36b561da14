//! Losses: `NegativeLogLikelihoodLoss` and `SoftmaxCrossEntropyLoss` (reduction none / sum /
//! mean, optional class weights, `ignore_index`, optional `log_prob` output).

use super::f64_to_tensor;
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::value::Value;
use npuc_ir::Tensor;

pub fn register(r: &mut Registry) {
    r.add("NegativeLogLikelihoodLoss", 12, nll_loss);
    r.add("SoftmaxCrossEntropyLoss", 12, softmax_cross_entropy);
}

/// `NegativeLogLikelihoodLoss`: `-input[n, target[n, d...], d...] * weight[target]`, reduced.
fn nll_loss(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let v = x.to_f64_vec()?;
    let loss = nll(ctx, &ins, x, &v)?;
    Ok(vec![Value::tensor(loss)])
}

/// `SoftmaxCrossEntropyLoss`: `NegativeLogLikelihoodLoss` of `LogSoftmax(scores, axis=1)`;
/// the second output (when requested) is that log-probability tensor.
fn softmax_cross_entropy(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let shape = x.shape();
    if shape.len() < 2 {
        bail!("scores must have rank >= 2, got {:?}", shape);
    }
    let (n, c) = (shape[0], shape[1]);
    let d: usize = shape[2..].iter().product();
    let mut lp = x.to_f64_vec()?;
    // Log-softmax over the class axis of each [C, D] block, one class row at a time.
    let mut m = vec![0f64; d];
    let mut s = vec![0f64; d];
    for blk in lp.chunks_mut((c * d).max(1)).take(n) {
        m.fill(f64::NEG_INFINITY);
        s.fill(0.0);
        for row in blk.chunks(d.max(1)) {
            for (mj, &v) in m.iter_mut().zip(row) {
                *mj = mj.max(v);
            }
        }
        for row in blk.chunks(d.max(1)) {
            for ((sj, &mj), &v) in s.iter_mut().zip(&m).zip(row) {
                *sj += (v - mj).exp();
            }
        }
        for row in blk.chunks_mut(d.max(1)) {
            for ((v, &mj), &sj) in row.iter_mut().zip(&m).zip(&s) {
                *v = *v - mj - sj.ln();
            }
        }
    }
    let loss = nll(ctx, &ins, x, &lp)?;
    let log_prob = f64_to_tensor(x.dtype(), shape.to_vec(), lp)?;
    Ok(vec![Value::tensor(loss), Value::tensor(log_prob)])
}

/// The shared NLL computation over log-probabilities `lp` laid out as `x` (`[N, C, D...]`).
fn nll(ctx: &OpCtx, ins: &Inputs, x: &Tensor, lp: &[f64]) -> Result<Tensor> {
    let shape = x.shape();
    if shape.len() < 2 {
        bail!("input must have rank >= 2, got {:?}", shape);
    }
    let (n, c) = (shape[0], shape[1]);
    let d: usize = shape[2..].iter().product();
    let target = ins.tensor(1)?;
    let mut tshape = vec![n];
    tshape.extend_from_slice(&shape[2..]);
    if target.shape() != tshape.as_slice() {
        bail!(
            "target has shape {:?}, expected {:?}",
            target.shape(),
            tshape
        );
    }
    let t = target.to_i64_vec()?;
    let weight = match ins.opt_tensor(2) {
        Some(w) => {
            let w = w.to_f64_vec()?;
            if w.len() != c {
                bail!("weight has {} entries for {c} classes", w.len());
            }
            Some(w)
        }
        None => None,
    };
    let ignore = ctx.node.attr_int("ignore_index")?;
    let reduction = ctx.node.str_or("reduction", "mean")?;
    let mut loss = vec![0f64; n * d];
    let mut wsum = 0f64;
    for b in 0..n {
        for j in 0..d {
            let k = b * d + j;
            let cls = t[k];
            if Some(cls) == ignore {
                continue;
            }
            if cls < 0 || cls as usize >= c {
                bail!("target value {cls} is out of range for {c} classes");
            }
            let w = weight.as_ref().map_or(1.0, |w| w[cls as usize]);
            loss[k] = -lp[(b * c + cls as usize) * d + j] * w;
            wsum += w;
        }
    }
    match reduction {
        "none" => f64_to_tensor(x.dtype(), tshape, loss),
        "sum" => f64_to_tensor(x.dtype(), vec![], vec![loss.iter().sum()]),
        "mean" => f64_to_tensor(x.dtype(), vec![], vec![loss.iter().sum::<f64>() / wsum]),
        r => bail!("unsupported reduction '{r}'"),
    }
}
