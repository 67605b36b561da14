//! Attention (ai.onnx opset 23/24): scaled dot-product attention with GQA, masks, causal
//! masking, softcap, KV cache (past/present) and the optional QK output.

use super::{gemm_into, GemmFloat, Mat};
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::conv::float_dispatch;
use crate::value::Value;
use npuc_ir::{DType, Tensor};
use num_traits::{Float, One};
use rayon::prelude::*;

pub fn register(r: &mut Registry) {
    r.add("Attention", 23, attention);
    r.add_range(
        "ai.onnx.preview",
        "FlexAttention",
        1,
        crate::kernel::MAX_OPSET,
        flex_attention,
    );
}

/// Shapes of one Attention call, in 4-D `[batch, heads, seq, head_size]` terms.
pub(crate) struct Dims {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub sq: usize,
    /// Total key/value length (past + new).
    pub skv: usize,
    pub past: usize,
    pub d: usize,
    pub dv: usize,
}

/// Reads Q/K/V (3-D `[B, S, H*D]` or 4-D `[B, H, S, D]`) as 4-D buffers.
fn to_4d<T: GemmFloat>(t: &Tensor, heads: usize) -> Result<(Vec<T>, [usize; 4])> {
    let s = t.shape();
    let v = T::load(t)?.into_owned();
    match s.len() {
        4 => Ok((v, [s[0], s[1], s[2], s[3]])),
        3 => {
            if heads == 0 || !s[2].is_multiple_of(heads) {
                bail!("hidden size {} is not divisible by {heads} heads", s[2]);
            }
            let (b, sl, d) = (s[0], s[1], s[2] / heads);
            let mut out = vec![T::zero(); v.len()];
            for bi in 0..b {
                for si in 0..sl {
                    for h in 0..heads {
                        let src = &v[((bi * sl + si) * heads + h) * d..][..d];
                        out[((bi * heads + h) * sl + si) * d..][..d].copy_from_slice(src);
                    }
                }
            }
            Ok((out, [b, heads, sl, d]))
        }
        r => bail!("Attention inputs must be 3-D or 4-D, got rank {r}"),
    }
}

/// Concatenates a cache `[B, H, P, D]` with new `[B, H, S, D]` along the sequence axis.
fn concat_seq<T: Copy>(
    past: &[T],
    new: &[T],
    b: usize,
    h: usize,
    p: usize,
    s: usize,
    d: usize,
) -> Vec<T> {
    let mut out = Vec::with_capacity(b * h * (p + s) * d);
    for bh in 0..b * h {
        out.extend_from_slice(&past[bh * p * d..(bh + 1) * p * d]);
        out.extend_from_slice(&new[bh * s * d..(bh + 1) * s * d]);
    }
    out
}

/// The additive mask broadcast to `[B, Hq, Sq, Skv]`: data plus 4-D broadcast strides (the
/// last one 1).
pub(crate) struct Mask<T> {
    pub data: Vec<T>,
    pub st: [usize; 4],
}

fn load_mask<T: GemmFloat>(m: &Tensor, dims: &Dims) -> Result<Mask<T>> {
    let ms = m.shape();
    if ms.is_empty() || ms.len() > 4 {
        bail!("attn_mask must have rank 1..4, got {ms:?}");
    }
    let mj = ms[ms.len() - 1];
    if mj > dims.skv {
        bail!(
            "attn_mask last dim {mj} exceeds the key length {}",
            dims.skv
        );
    }
    let mut sh = [1usize; 4];
    sh[4 - ms.len()..].copy_from_slice(ms);
    let want = [dims.b, dims.hq, dims.sq, dims.skv];
    for i in 0..3 {
        if sh[i] != 1 && sh[i] != want[i] {
            bail!("attn_mask {ms:?} does not broadcast to {want:?}");
        }
    }
    // Additive form, padded with -inf up to the full key length.
    let neg = T::neg_infinity();
    let vals: Vec<T> = if m.dtype() == DType::Bool {
        m.as_slice::<bool>()?
            .iter()
            .map(|&b| if b { T::zero() } else { neg })
            .collect()
    } else {
        T::load(m)?.into_owned()
    };
    let rows = vals.len().checked_div(mj).unwrap_or(0);
    let mut data = vec![neg; rows * dims.skv];
    for r in 0..rows {
        data[r * dims.skv..r * dims.skv + mj].copy_from_slice(&vals[r * mj..(r + 1) * mj]);
    }
    let full = [sh[0], sh[1], sh[2], dims.skv];
    let mut st = [0usize; 4];
    let mut acc = 1;
    for i in (0..4).rev() {
        st[i] = if full[i] == 1 && i < 3 { 0 } else { acc };
        acc *= full[i];
    }
    Ok(Mask { data, st })
}

pub(crate) struct Opts {
    pub scale: f64,
    pub softcap: f64,
    pub causal: bool,
    pub mode: i64,
    pub want_qk: bool,
}

/// `softmax(softcap(scale · Q Kᵀ) + mask [+ causal]) V` per head: Q `[B, Hq, Sq, D]`, K/V
/// `[B, Hkv, Skv, D/Dv]` (query head `h` reads kv head `h / (Hq / Hkv)`); returns Y
/// `[B, Hq, Sq, Dv]` and, when asked, the QK values of `mode`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<T: GemmFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&Mask<T>>,
    nonpad: Option<&[i64]>,
    dm: &Dims,
    o: &Opts,
    threads: usize,
) -> Result<(Vec<T>, Vec<T>)> {
    let Dims {
        b,
        hq,
        hkv,
        sq,
        skv,
        past,
        d,
        dv,
    } = *dm;
    let reps = hq / hkv;
    let mut y = vec![T::zero(); b * hq * sq * dv];
    let mut qk = vec![T::zero(); if o.want_qk { b * hq * sq * skv } else { 0 }];
    let scale = T::from_f64(o.scale);
    let cap = T::from_f64(o.softcap);
    let neg = T::neg_infinity();
    let head = |bh: usize, yo: &mut [T], qko: Option<&mut [T]>| -> Result<()> {
        let (bi, h) = (bh / hq, bh % hq);
        let kvh = bi * hkv + h / reps;
        let qm = &q[bh * sq * d..][..sq * d];
        let km = &k[kvh * skv * d..][..skv * d];
        let vm = &v[kvh * skv * dv..][..skv * dv];
        let mut s = vec![T::zero(); sq * skv];
        // Kᵀ laid out row-major once per head: the GEMM streams a contiguous right-hand side
        // (a strided one measured ~6% slower on ViT-S attention).
        let mut kt = vec![T::zero(); d * skv];
        for (j, krow) in km.chunks_exact(d).enumerate() {
            for (c, &x) in krow.iter().enumerate() {
                kt[c * skv + j] = x;
            }
        }
        gemm_into(
            sq,
            skv,
            d,
            scale,
            Mat::rows(qm, d),
            Mat::rows(&kt, skv),
            None,
            &mut s,
            skv,
            1,
        )?;
        let mut qko = qko;
        let limit = nonpad.map(|np| np[bi.min(np.len() - 1)].max(0) as usize);
        for i in 0..sq {
            let row = &mut s[i * skv..(i + 1) * skv];
            if o.softcap > 0.0 {
                for x in row.iter_mut() {
                    *x = (*x / cap).tanh() * cap;
                }
            }
            if let (Some(qo), 0 | 1) = (qko.as_deref_mut(), o.mode) {
                qo[i * skv..(i + 1) * skv].copy_from_slice(row);
            }
            if let Some(m) = mask {
                let base = bi * m.st[0] + h * m.st[1] + i * m.st[2];
                for (j, x) in row.iter_mut().enumerate() {
                    *x += m.data[base + j];
                }
            }
            if o.causal {
                for x in row.iter_mut().skip(i + past + 1) {
                    *x += neg;
                }
            }
            if let Some(lim) = limit {
                for x in row.iter_mut().skip(lim) {
                    *x += neg;
                }
            }
            if let (Some(qo), 2) = (qko.as_deref_mut(), o.mode) {
                qo[i * skv..(i + 1) * skv].copy_from_slice(row);
            }
            // Softmax exactly as the reference: a fully masked row gives NaN.
            let mx = row
                .iter()
                .copied()
                .fold(neg, |a, x| if x > a { x } else { a });
            let mut sum = T::zero();
            for x in row.iter_mut() {
                *x = (*x - mx).fast_exp();
                sum += *x;
            }
            let inv = T::one() / sum;
            for x in row.iter_mut() {
                *x *= inv;
            }
            if let (Some(qo), 3) = (qko.as_deref_mut(), o.mode) {
                qo[i * skv..(i + 1) * skv].copy_from_slice(row);
            }
        }
        gemm_into(
            sq,
            dv,
            skv,
            T::one(),
            Mat::rows(&s, skv),
            Mat::rows(vm, dv),
            None,
            yo,
            dv,
            1,
        )
    };
    let n = b * hq;
    let yc = (sq * dv).max(1);
    let qc = (sq * skv).max(1);
    if o.want_qk {
        let it = y.chunks_mut(yc).zip(qk.chunks_mut(qc)).enumerate();
        if threads > 1 && n > 1 {
            it.par_bridge()
                .try_for_each(|(bh, (yo, qo))| head(bh, yo, Some(qo)))?;
        } else {
            for (bh, (yo, qo)) in it {
                head(bh, yo, Some(qo))?;
            }
        }
    } else if threads > 1 && n > 1 {
        y.par_chunks_mut(yc)
            .enumerate()
            .try_for_each(|(bh, yo)| head(bh, yo, None))?;
    } else {
        for (bh, yo) in y.chunks_mut(yc).enumerate() {
            head(bh, yo, None)?;
        }
    }
    Ok((y, qk))
}

/// Attention: `softmax(softcap(Q K^T * scale) + bias) V` per head, with GQA head sharing.
fn attention(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let node = ctx.node;
    let q = ins.tensor(0)?;
    let k = ins.tensor(1)?;
    let v = ins.tensor(2)?;
    let mask = ins.opt_tensor(3);
    let past_k = ins.opt_tensor(4);
    let past_v = ins.opt_tensor(5);
    let nonpad = match ins.opt_tensor(6) {
        Some(t) => Some(t.to_i64_vec()?),
        None => None,
    };
    if q.rank() != k.rank() || q.rank() != v.rank() {
        bail!("Q, K and V must have the same rank");
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("Q, K and V must share one dtype");
    }
    let qh = node.int_or("q_num_heads", 0)?.max(0) as usize;
    let kvh = node.int_or("kv_num_heads", 0)?.max(0) as usize;
    if q.rank() == 3 && (qh == 0 || kvh == 0) {
        bail!("3-D Attention inputs need q_num_heads and kv_num_heads");
    }
    let causal = node.int_or("is_causal", 0)? != 0;
    let softcap = node.float_or("softcap", 0.0)? as f64;
    let mode = node.int_or("qk_matmul_output_mode", 0)?;
    if !(0..=3).contains(&mode) {
        bail!("qk_matmul_output_mode must be 0..3, got {mode}");
    }
    let nout = node.outputs.len();
    let three_d = q.rank() == 3;
    let dt = q.dtype();
    let outs = float_dispatch!(dt, T => {
        let (qv, qs) = to_4d::<T>(q, qh)?;
        let (kv, ks) = to_4d::<T>(k, kvh)?;
        let (vv, vs) = to_4d::<T>(v, kvh)?;
        if ks[0] != qs[0] || vs[0] != qs[0] || ks[3] != qs[3] || ks[1] != vs[1] || ks[2] != vs[2] {
            bail!("Attention shapes do not agree: Q {qs:?}, K {ks:?}, V {vs:?}");
        }
        let (b, hq, sq, d) = (qs[0], qs[1], qs[2], qs[3]);
        let (hkv, snew, dv) = (ks[1], ks[2], vs[3]);
        if hkv == 0 || hq % hkv != 0 {
            bail!("q heads {hq} are not a multiple of kv heads {hkv}");
        }
        let (kall, vall, past) = match (past_k, past_v) {
            (Some(pk), Some(pv)) => {
                let (ps, pvs) = (pk.shape(), pv.shape());
                if ps.len() != 4 || pvs.len() != 4 || ps[0] != b || ps[1] != hkv || ps[3] != d
                    || pvs[0] != b || pvs[1] != hkv || pvs[2] != ps[2] || pvs[3] != dv
                {
                    bail!("past_key {ps:?} / past_value {pvs:?} do not match K/V");
                }
                let p = ps[2];
                (
                    concat_seq(&T::load(pk)?, &kv, b, hkv, p, snew, d),
                    concat_seq(&T::load(pv)?, &vv, b, hkv, p, snew, dv),
                    p,
                )
            }
            (None, None) => (kv, vv, 0),
            _ => bail!("past_key and past_value must be given together"),
        };
        let dims = Dims { b, hq, hkv, sq, skv: past + snew, past, d, dv };
        let m = match mask {
            Some(m) => Some(load_mask::<T>(m, &dims)?),
            None => None,
        };
        if let Some(np) = &nonpad {
            if np.len() != b {
                bail!("nonpad_kv_seqlen has {} values, expected {b}", np.len());
            }
        }
        let scale = match node.attr_float("scale")? {
            Some(s) => s as f64,
            None => 1.0 / (d as f64).sqrt(),
        };
        let opts = Opts { scale, softcap, causal, mode, want_qk: nout > 3 };
        let (y, qk) = run::<T>(&qv, &kall, &vall, m.as_ref(), nonpad.as_deref(), &dims, &opts, ctx.threads)?;
        let y = if three_d {
            let mut t = vec![<T as num_traits::Zero>::zero(); y.len()];
            for bi in 0..b {
                for h in 0..hq {
                    for i in 0..sq {
                        let src = &y[((bi * hq + h) * sq + i) * dv..][..dv];
                        t[((bi * sq + i) * hq + h) * dv..][..dv].copy_from_slice(src);
                    }
                }
            }
            T::store(dt, vec![b, sq, hq * dv], t)?
        } else {
            T::store(dt, vec![b, hq, sq, dv], y)?
        };
        let mut outs = vec![Value::tensor(y)];
        if nout > 1 {
            outs.push(Value::tensor(T::store(dt, vec![b, hkv, past + snew, d], kall)?));
        }
        if nout > 2 {
            outs.push(Value::tensor(T::store(dt, vec![b, hkv, past + snew, dv], vall)?));
        }
        if nout > 3 {
            outs.push(Value::tensor(T::store(dt, vec![b, hq, sq, past + snew], qk)?));
        }
        outs
    });
    Ok(outs)
}

/// Applies an optional single-input, single-output graph attribute (`score_mod`/`prob_mod`)
/// to a `[B, H, L, S]` tensor.
fn apply_mod<T: GemmFloat>(ctx: &OpCtx, attr: &str, v: Vec<T>, shape: &[usize]) -> Result<Vec<T>> {
    if ctx.node.attr_graph(attr)?.is_none() {
        return Ok(v);
    }
    let t = Tensor::from_vec(shape.to_vec(), v)?;
    let outs = ctx.run_subgraph(attr, vec![Value::tensor(t)])?;
    let Some(Value::Tensor(r)) = outs.into_iter().next() else {
        bail!("graph attribute '{attr}' must produce one tensor");
    };
    if r.shape() != shape {
        bail!(
            "'{attr}' changed the score shape {shape:?} to {:?}",
            r.shape()
        );
    }
    Ok(T::load(&r)?.into_owned())
}

/// FlexAttention (ai.onnx.preview): `softmax(score_mod(Q K^T * scale))`, then `prob_mod`, times
/// V, with GQA head sharing. f16/bf16 compute in f32 as the reference does.
fn flex_attention(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let q = ins.tensor(0)?;
    let k = ins.tensor(1)?;
    let v = ins.tensor(2)?;
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        bail!("FlexAttention needs 4-D Q, K and V");
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("Q, K and V must share one dtype");
    }
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let (b, hq, l, e) = (qs[0], qs[1], qs[2], qs[3]);
    let (hkv, s, ev) = (ks[1], ks[2], vs[3]);
    if ks[0] != b || vs[0] != b || ks[3] != e || vs[1] != hkv || vs[2] != s {
        bail!("FlexAttention shapes do not agree: Q {qs:?}, K {ks:?}, V {vs:?}");
    }
    if hkv == 0 || hq % hkv != 0 {
        bail!("q heads {hq} are not a multiple of kv heads {hkv}");
    }
    let reps = hq / hkv;
    let scale = match ctx.node.attr_float("scale")? {
        Some(x) => x as f64,
        None => 1.0 / (e as f64).sqrt(),
    };
    let dt = q.dtype();
    let t = float_dispatch!(dt, T => {
        let (qv, kv, vv) = (T::load(q)?, T::load(k)?, T::load(v)?);
        let sshape = [b, hq, l, s];
        let mut sc = vec![<T as num_traits::Zero>::zero(); b * hq * l * s];
        for bh in 0..b * hq {
            let kvh = (bh / hq) * hkv + (bh % hq) / reps;
            gemm_into(
                l, s, e, T::from_f64(scale),
                Mat::rows(&qv[bh * l * e..][..l * e], e),
                Mat::cols(&kv[kvh * s * e..][..s * e], e),
                None, &mut sc[bh * l * s..][..l * s], s, ctx.threads,
            )?;
        }
        let mut sc = apply_mod::<T>(ctx, "score_mod", sc, &sshape)?;
        for row in sc.chunks_mut(s.max(1)) {
            let mx = row.iter().copied().fold(T::neg_infinity(), |a, x| if x > a { x } else { a });
            let mut sum = <T as num_traits::Zero>::zero();
            for x in row.iter_mut() {
                *x = (*x - mx).exp();
                sum += *x;
            }
            for x in row.iter_mut() {
                *x /= sum;
            }
        }
        let p = apply_mod::<T>(ctx, "prob_mod", sc, &sshape)?;
        let mut y = vec![<T as num_traits::Zero>::zero(); b * hq * l * ev];
        for bh in 0..b * hq {
            let kvh = (bh / hq) * hkv + (bh % hq) / reps;
            gemm_into(
                l, ev, s, T::one(),
                Mat::rows(&p[bh * l * s..][..l * s], s),
                Mat::rows(&vv[kvh * s * ev..][..s * ev], ev),
                None, &mut y[bh * l * ev..][..l * ev], ev, ctx.threads,
            )?;
        }
        T::store(dt, vec![b, hq, l, ev], y)?
    });
    Ok(vec![Value::tensor(t)])
}
