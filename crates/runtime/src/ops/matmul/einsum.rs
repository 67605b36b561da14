//! Einsum: general Einstein summation (explicit or implicit output, ellipsis broadcasting,
//! repeated labels / diagonals). Two-operand contractions without diagonals or broadcasting
//! lower to a transpose + batched gemm; everything else runs a strided summation loop.

use super::{gemm_into, GemmFloat, Mat};
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx};
use crate::ops::conv::float_dispatch;
use crate::value::Value;
use npuc_ir::{DType, Tensor};

/// Label ids: letters map to 0..52, ellipsis dims to 52 + i.
const ELL: usize = 52;

fn letter(c: char) -> Result<usize> {
    Ok(match c {
        'a'..='z' => c as usize - 'a' as usize,
        'A'..='Z' => 26 + c as usize - 'A' as usize,
        _ => bail!("invalid Einsum label '{c}'"),
    })
}

/// Parses one term into labels, expanding `...` to `ell_rank` ellipsis labels (right-aligned
/// against `max_ell`).
fn parse_term(t: &str, rank: Option<usize>, max_ell: usize) -> Result<(Vec<usize>, usize)> {
    let letters = t.chars().filter(|c| c.is_ascii_alphabetic()).count();
    let has_ell = t.contains("...");
    let ell_rank = match (has_ell, rank) {
        (true, Some(r)) => r.checked_sub(letters).ok_or_else(|| {
            crate::RtError::msg(format!("term '{t}' has more labels than rank {r}"))
        })?,
        (true, None) => max_ell,
        (false, Some(r)) if r != letters => bail!("term '{t}' does not match rank {r}"),
        _ => 0,
    };
    let mut out = vec![];
    let mut rest = t;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("...") {
            out.extend((max_ell - ell_rank..max_ell).map(|i| ELL + i));
            rest = r;
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(letter(c)?);
            rest = &rest[c.len_utf8()..];
        }
    }
    Ok((out, ell_rank))
}

/// Einsum over float tensors.
pub fn einsum(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let eq: String = ctx
        .node
        .str_or("equation", "")?
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let ts = ins.tensors()?;
    if ts.is_empty() {
        bail!("Einsum needs at least one input");
    }
    let dt = ts[0].dtype();
    if ts.iter().any(|t| t.dtype() != dt) {
        bail!("Einsum inputs must share one dtype");
    }
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (eq.as_str(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != ts.len() {
        bail!(
            "equation '{eq}' has {} terms for {} inputs",
            terms.len(),
            ts.len()
        );
    }
    // Ellipsis ranks, then labels per operand.
    let mut max_ell = 0;
    for (t, x) in terms.iter().zip(&ts) {
        if t.contains("...") {
            let letters = t.chars().filter(|c| c.is_ascii_alphabetic()).count();
            max_ell = max_ell.max(x.rank().saturating_sub(letters));
        }
    }
    let mut dims = [0usize; ELL + 16];
    let mut seen = [false; ELL + 16];
    if max_ell > 16 {
        bail!("ellipsis covers too many dims");
    }
    let mut labels = vec![];
    let mut count = [0usize; ELL + 16];
    for (t, x) in terms.iter().zip(&ts) {
        let (l, _) = parse_term(t, Some(x.rank()), max_ell)?;
        for (&lab, &d) in l.iter().zip(x.shape()) {
            count[lab] += 1;
            if !seen[lab] || dims[lab] == 1 {
                dims[lab] = d;
            } else if d != dims[lab] && d != 1 {
                bail!("label size mismatch in '{eq}': {d} vs {}", dims[lab]);
            }
            seen[lab] = true;
        }
        labels.push(l);
    }
    let out_labels: Vec<usize> = match rhs {
        Some(r) => {
            let (l, _) = parse_term(r, None, max_ell)?;
            if l.iter().any(|&x| !seen[x]) {
                bail!("output labels of '{eq}' do not appear in the inputs");
            }
            l
        }
        None => {
            let mut l: Vec<usize> = (ELL..ELL + max_ell).filter(|&x| seen[x]).collect();
            l.extend((0..ELL).filter(|&x| count[x] == 1));
            l
        }
    };
    let sum_labels: Vec<usize> = (0..ELL + 16)
        .filter(|&x| seen[x] && !out_labels.contains(&x))
        .collect();
    let out_shape: Vec<usize> = out_labels.iter().map(|&l| dims[l]).collect();
    let t = float_dispatch!(dt, T => {
        let data: Vec<std::borrow::Cow<[T]>> = ts.iter().map(|t| T::load(t)).collect::<Result<_>>()?;
        let all: Vec<usize> = out_labels.iter().chain(&sum_labels).copied().collect();
        // Per operand, the stride of each label in `all` (summed over repeated axes, 0 when
        // broadcast).
        let mut st = vec![vec![0usize; all.len()]; ts.len()];
        for (oi, (l, x)) in labels.iter().zip(&ts).enumerate() {
            let xs = crate::ops::common::strides(x.shape());
            for (ax, &lab) in l.iter().enumerate() {
                if x.shape()[ax] == 1 && dims[lab] != 1 {
                    continue;
                }
                if let Some(p) = all.iter().position(|&a| a == lab) {
                    st[oi][p] += xs[ax];
                }
            }
        }
        let v = match try_gemm::<T>(&data, &labels, &ts, &out_labels, &sum_labels, &dims, ctx.threads)? {
            Some(v) => v,
            None => contract::<T>(&data, &st, &all, &dims, out_labels.len()),
        };
        T::store(dt, out_shape, v)?
    });
    Ok(vec![Value::tensor(t)])
}

/// Strided summation: odometer over output labels then summed labels.
fn contract<T: GemmFloat>(
    data: &[std::borrow::Cow<[T]>],
    st: &[Vec<usize>],
    all: &[usize],
    dims: &[usize],
    n_out: usize,
) -> Vec<T> {
    let sizes: Vec<usize> = all.iter().map(|&l| dims[l]).collect();
    let out_n: usize = sizes[..n_out].iter().product();
    let sum_n: usize = sizes[n_out..].iter().product();
    let mut out = vec![T::zero(); out_n];
    if sum_n == 0 {
        return out;
    }
    let nops = data.len();
    let mut idx = vec![0usize; all.len()];
    let mut off = vec![0usize; nops];
    for o in out.iter_mut() {
        let mut acc = T::zero();
        for _ in 0..sum_n {
            let mut p = T::one();
            for (d, &of) in data.iter().zip(&off) {
                p *= d[of];
            }
            acc += p;
            // Advance the summed labels.
            for ax in (n_out..all.len()).rev() {
                idx[ax] += 1;
                for k in 0..nops {
                    off[k] += st[k][ax];
                }
                if idx[ax] < sizes[ax] {
                    break;
                }
                for k in 0..nops {
                    off[k] -= st[k][ax] * sizes[ax];
                }
                idx[ax] = 0;
            }
        }
        *o = acc;
        for ax in (0..n_out).rev() {
            idx[ax] += 1;
            for k in 0..nops {
                off[k] += st[k][ax];
            }
            if idx[ax] < sizes[ax] {
                break;
            }
            for k in 0..nops {
                off[k] -= st[k][ax] * sizes[ax];
            }
            idx[ax] = 0;
        }
    }
    out
}

/// Two operands, no repeated labels within an operand, no size-1 broadcasting, every label in
/// both operands or the output: batch (in a, b, out) x m (a, out) x n (b, out) x k (a, b).
#[allow(clippy::too_many_arguments)]
fn try_gemm<T: GemmFloat>(
    data: &[std::borrow::Cow<[T]>],
    labels: &[Vec<usize>],
    ts: &[&Tensor],
    out: &[usize],
    sum: &[usize],
    dims: &[usize],
    threads: usize,
) -> Result<Option<Vec<T>>> {
    if data.len() != 2 {
        return Ok(None);
    }
    let (la, lb) = (&labels[0], &labels[1]);
    let uniq = |l: &Vec<usize>| l.iter().enumerate().all(|(i, x)| !l[..i].contains(x));
    if !uniq(la) || !uniq(lb) {
        return Ok(None);
    }
    for (l, t) in [(la, ts[0]), (lb, ts[1])] {
        if l.iter().zip(t.shape()).any(|(&x, &d)| d != dims[x]) {
            return Ok(None);
        }
    }
    let batch: Vec<usize> = out
        .iter()
        .copied()
        .filter(|x| la.contains(x) && lb.contains(x))
        .collect();
    let m: Vec<usize> = out
        .iter()
        .copied()
        .filter(|x| la.contains(x) && !lb.contains(x))
        .collect();
    let n: Vec<usize> = out
        .iter()
        .copied()
        .filter(|x| !la.contains(x) && lb.contains(x))
        .collect();
    let k: Vec<usize> = sum
        .iter()
        .copied()
        .filter(|x| la.contains(x) && lb.contains(x))
        .collect();
    if k.len() != sum.len() {
        return Ok(None);
    }
    let size = |v: &[usize]| v.iter().map(|&x| dims[x]).product::<usize>();
    let (nb, nm, nn, nk) = (size(&batch), size(&m), size(&n), size(&k));
    let pa: Vec<usize> = batch.iter().chain(&m).chain(&k).copied().collect();
    let pb: Vec<usize> = batch.iter().chain(&k).chain(&n).copied().collect();
    let a = permute(&data[0], la, ts[0].shape(), &pa);
    let b = permute(&data[1], lb, ts[1].shape(), &pb);
    let mut prod = vec![T::zero(); nb * nm * nn];
    for bi in 0..nb {
        gemm_into(
            nm,
            nn,
            nk,
            T::one(),
            Mat::rows(&a[bi * nm * nk..], nk),
            Mat::rows(&b[bi * nk * nn..], nn),
            None,
            &mut prod[bi * nm * nn..(bi + 1) * nm * nn],
            nn,
            threads,
        )?;
    }
    // prod is laid out as batch, m, n; permute to the requested output order.
    let lp: Vec<usize> = batch.iter().chain(&m).chain(&n).copied().collect();
    let sp: Vec<usize> = lp.iter().map(|&x| dims[x]).collect();
    Ok(Some(permute(&prod, &lp, &sp, out)))
}

/// Transposes `x` (labels `from`, shape `shape`) into label order `to` (same label set).
fn permute<T: GemmFloat>(x: &[T], from: &[usize], shape: &[usize], to: &[usize]) -> Vec<T> {
    let st = crate::ops::common::strides(shape);
    let tst: Vec<usize> = to
        .iter()
        .map(|l| from.iter().position(|f| f == l).map_or(0, |p| st[p]))
        .collect();
    let tsh: Vec<usize> = to
        .iter()
        .map(|l| from.iter().position(|f| f == l).map_or(1, |p| shape[p]))
        .collect();
    let n: usize = tsh.iter().product();
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; to.len()];
    let mut off = 0usize;
    for _ in 0..n {
        out.push(x[off]);
        for d in (0..to.len()).rev() {
            idx[d] += 1;
            off += tst[d];
            if idx[d] < tsh[d] {
                break;
            }
            off -= tst[d] * tsh[d];
            idx[d] = 0;
        }
    }
    out
}
