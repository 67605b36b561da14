//! onnxruntime's attention contrib ops (`com.microsoft`), float32, computed as its CPU kernels
//! compute them (the core is the ONNX `Attention` kernel's, `matmul::attention::run`):
//!
//! - `Attention(input, weights[, bias][, mask_index][, past][, attention_bias])`: BERT-style
//!   self-attention with packed Q/K/V weights (`qkv_hidden_sizes` for unequal parts).
//! - `MultiHeadAttention(query, key, value[, bias][, key_padding_mask][, attention_bias]
//!   [, past_key, past_value])`: separate Q/K/V `[B, S, D]`, K/V already `[B, N, L, H]`, or
//!   packed QKV `[B, S, N, 3, H]` / KV `[B, L, N, 2, H]` (without bias).
//! - `GroupQueryAttention(query[, key, value], past_key, past_value, seqlens_k,
//!   total_sequence_length[, cos_cache, sin_cache][, , attention_bias])`: GenAI's decoder
//!   attention (BNSH KV cache, per-batch lengths, rotary, local window, softcap, packed QKV).
//! - `EmbedLayerNormalization`: word + position (+ segment) embeddings, layer-normalized, and
//!   the mask's per-batch count of ones.
//!
//! Masks as onnxruntime builds them (`PrepareMask`): a masked key adds `mask_filter_value`
//! (default -10000) to the score, a key after the query (`unidirectional`) the lowest f32; a
//! `mask_index` is 1-D `[B]` (keys from the value on are masked) or `[2B]` (also keys before
//! the second half's start), 2-D `[B, T]` or 3-D `[B, S, T]` of 0/1. GroupQueryAttention
//! leaves keys outside `(pos - local_window_size, pos]` (the window holds `local_window_size`
//! keys, the query's own included) and beyond `seqlens_k[b]` out of the softmax. What the CPU
//! kernels refuse or npuc does not cover (other dtypes, 4-D masks,
//! bias with packed MHA inputs, shared past/present buffers, rotary in Attention, beam-search cache
//! indirection, smooth softmax, head sinks, QK outputs) is refused with the node named.

use super::contrib::rotate;
use super::matmul::attention::{run, Dims, Mask, Opts};
use super::matmul::{gemm_into, Mat};
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::value::Value;
use npuc_ir::{DType, Node, Tensor};

pub fn register(r: &mut Registry) {
    r.add_range("com.microsoft", "Attention", 1, 1, attention);
    r.add_range(
        "com.microsoft",
        "MultiHeadAttention",
        1,
        1,
        multi_head_attention,
    );
    r.add_range(
        "com.microsoft",
        "GroupQueryAttention",
        1,
        1,
        group_query_attention,
    );
    r.add_range(
        "com.microsoft",
        "EmbedLayerNormalization",
        1,
        1,
        embed_layer_normalization,
    );
}

/// A float32 input's data, or an error naming it.
fn f32_in<'a>(t: &'a Tensor, what: &str) -> Result<&'a [f32]> {
    if t.dtype() != DType::F32 {
        bail!("{what} is {}, only float32 is supported", t.dtype().name());
    }
    Ok(t.as_slice::<f32>()?)
}

/// An int32 input's values (int32 as onnxruntime requires).
fn i32_in(t: &Tensor, what: &str) -> Result<Vec<i64>> {
    if t.dtype() != DType::I32 {
        bail!("{what} is {}, onnxruntime requires int32", t.dtype().name());
    }
    Ok(t.to_i64_vec()?)
}

/// Refuses integer attributes whose value is not the default.
fn refuse_attrs(n: &Node, attrs: &[(&str, i64)]) -> Result<()> {
    for &(a, default) in attrs {
        let v = n.int_or(a, default)?;
        if v != default {
            bail!("attribute {a} = {v} is not supported");
        }
    }
    Ok(())
}

/// Refuses inputs given at positions where npuc has no support.
fn refuse_inputs(ins: &Inputs, which: &[(usize, &str)]) -> Result<()> {
    for &(i, what) in which {
        if ins.opt_tensor(i).is_some() {
            bail!("input {i} ({what}) is not supported");
        }
    }
    Ok(())
}

/// `[B, S, N, H]` (row-major) to `[B, N, S, H]`; with the middle dims named the other way
/// round, `[B, N, S, H]` back to `[B, S, N·H]`.
fn bsnh_to_bnsh(x: &[f32], b: usize, s: usize, n: usize, h: usize) -> Vec<f32> {
    let mut out = vec![0f32; b * s * n * h];
    for bi in 0..b {
        for si in 0..s {
            for ni in 0..n {
                let src = &x[((bi * s + si) * n + ni) * h..][..h];
                out[((bi * n + ni) * s + si) * h..][..h].copy_from_slice(src);
            }
        }
    }
    out
}

/// Concatenates `[B, N, P, H]` and `[B, N, L, H]` along the sequence.
fn concat_seq(past: &[f32], new: &[f32], bn: usize, p: usize, l: usize, h: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(bn * (p + l) * h);
    for i in 0..bn {
        out.extend_from_slice(&past[i * p * h..][..p * h]);
        out.extend_from_slice(&new[i * l * h..][..l * h]);
    }
    out
}

/// The `[B, S, T]` additive mask of onnxruntime's `PrepareMask` (Attention and
/// MultiHeadAttention), or `None` when nothing is masked.
fn prepare_mask(
    mask: Option<&Tensor>,
    causal: bool,
    filter: f32,
    b: usize,
    s: usize,
    past: usize,
    t: usize,
) -> Result<Option<Vec<f32>>> {
    if mask.is_none() && !(causal && s > 1) {
        return Ok(None);
    }
    let mut m = vec![0f32; b * s * t];
    if let Some(mt) = mask {
        let v = i32_in(mt, "mask")?;
        match *mt.shape() {
            [n] if n == b || n == 2 * b => {
                for bi in 0..b {
                    let end = v[bi].max(0) as usize;
                    let start = if n == 2 * b {
                        (v[b + bi].max(0) as usize).min(t)
                    } else {
                        0
                    };
                    for si in 0..s {
                        let row = &mut m[(bi * s + si) * t..][..t];
                        for (j, x) in row.iter_mut().enumerate() {
                            if j >= end || j < start {
                                *x = filter;
                            }
                        }
                    }
                }
            }
            [mb, mt_] if mb == b && mt_ == t => {
                for bi in 0..b {
                    for si in 0..s {
                        for j in 0..t {
                            if v[bi * t + j] <= 0 {
                                m[(bi * s + si) * t + j] = filter;
                            }
                        }
                    }
                }
            }
            [mb, ms, mt_] if mb == b && ms == s && mt_ == t => {
                for (x, &k) in m.iter_mut().zip(&v) {
                    if k <= 0 {
                        *x = filter;
                    }
                }
            }
            ref other => bail!(
                "mask {other:?} is not supported: expected [{b}] or [{}] (key lengths, starts), [{b}, {t}] or [{b}, {s}, {t}] (0/1)",
                2 * b
            ),
        }
    }
    if causal {
        for bi in 0..b {
            for si in 0..s {
                for j in past + si + 1..t {
                    m[(bi * s + si) * t + j] = f32::MIN;
                }
            }
        }
    }
    Ok(Some(m))
}

/// `base` (`[B, S, T]`, or zeros) plus `attention_bias` (`[B|1, N|1, S, T]`) as a mask for
/// `run`.
fn combine_mask(
    base: Option<Vec<f32>>,
    bias: Option<&Tensor>,
    b: usize,
    n: usize,
    s: usize,
    t: usize,
) -> Result<Option<Mask<f32>>> {
    let Some(bias) = bias else {
        return Ok(base.map(|data| Mask {
            data,
            st: [s * t, 0, t, 1],
        }));
    };
    let bv = f32_in(bias, "attention_bias")?;
    let (bb, bn) = match *bias.shape() {
        [bb, bn, bs, bt] if (bb == b || bb == 1) && (bn == n || bn == 1) && bs == s && bt == t => {
            (bb, bn)
        }
        ref other => {
            bail!("attention_bias {other:?} is not [{b} or 1, {n} or 1, {s}, {t}]")
        }
    };
    let mut data = vec![0f32; b * bn * s * t];
    for bi in 0..b {
        for hi in 0..bn {
            for r in 0..s * t {
                let add = bv[((bi % bb) * bn + hi) * s * t + r];
                let m = base.as_ref().map_or(0.0, |m| m[bi * s * t + r]);
                data[(bi * bn + hi) * s * t + r] = m + add;
            }
        }
    }
    Ok(Some(Mask {
        data,
        st: [bn * s * t, if bn == 1 { 0 } else { s * t }, t, 1],
    }))
}

/// Scaled dot-product attention over Q `[B, N, S, H]`, K/V `[B, Nkv, T, H/Hv]`; Y as
/// `[B, S, N·Hv]`.
#[allow(clippy::too_many_arguments)]
fn sdpa(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&Mask<f32>>,
    (b, n, nkv, s, t, h, hv): (usize, usize, usize, usize, usize, usize, usize),
    scale: f64,
    softcap: f64,
    threads: usize,
) -> Result<Vec<f32>> {
    let dims = Dims {
        b,
        hq: n,
        hkv: nkv,
        sq: s,
        skv: t,
        past: 0,
        d: h,
        dv: hv,
    };
    let opts = Opts {
        scale,
        softcap,
        causal: false,
        mode: 0,
        want_qk: false,
    };
    let (y, _) = run::<f32>(q, k, v, mask, None, &dims, &opts, threads)?;
    Ok(bsnh_to_bnsh(&y, b, n, s, hv))
}

/// `Attention`/`MultiHeadAttention`'s core: Q `[B, N, S, H]`, K/V `[B, N, P + L, H/Hv]`
/// (past included), the node's mask (`unidirectional`, `mask_filter_value`) and attention
/// bias; Y `[B, S, N·Hv]`.
fn masked_attention(
    ctx: &OpCtx,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (mask, bias): (Option<&Tensor>, Option<&Tensor>),
    (b, heads, s, p, h, hv): (usize, usize, usize, usize, usize, usize),
) -> Result<Tensor> {
    let n = ctx.node;
    let t = k.len() / (b * heads * h).max(1);
    let causal = n.int_or("unidirectional", 0)? != 0;
    let filter = n.float_or("mask_filter_value", -10000.0)?;
    let base = prepare_mask(mask, causal, filter, b, s, p, t)?;
    let mask = combine_mask(base, bias, b, heads, s, t)?;
    let y = sdpa(
        q,
        k,
        v,
        mask.as_ref(),
        (b, heads, heads, s, t, h, hv),
        scale_of(n, h)?,
        0.0,
        ctx.threads,
    )?;
    Ok(Tensor::from_vec(vec![b, s, heads * hv], y)?)
}

/// The `scale` attribute, 0 (absent) meaning `1 / sqrt(head_size)`.
fn scale_of(n: &Node, head: usize) -> Result<f64> {
    let s = n.float_or("scale", 0.0)?;
    Ok(if s == 0.0 {
        1.0 / (head as f64).sqrt()
    } else {
        f64::from(s)
    })
}

fn num_heads(n: &Node, attr: &str) -> Result<usize> {
    match n.attr_int(attr)? {
        Some(h) if h > 0 => Ok(h as usize),
        _ => bail!("attribute {attr} must be positive"),
    }
}

/// Only the outputs the node names, as values in position.
fn outputs(n: &Node, vals: Vec<Option<Tensor>>) -> Result<Vec<Value>> {
    let mut out = vec![];
    for (i, v) in vals.into_iter().enumerate() {
        let named = n.outputs.get(i).is_some_and(|o| !o.is_empty());
        if i >= n.outputs.len() {
            break;
        }
        out.push(match (named, v) {
            (true, Some(t)) => Value::tensor(t),
            (true, None) => bail!("output {i} cannot be produced"),
            // A placeholder in the position of an output the node does not name.
            (false, _) => Value::tensor(Tensor::from_vec(vec![0], Vec::<f32>::new())?),
        });
    }
    Ok(out)
}

/// `Attention`: Q/K/V = input · weights + bias, split by `qkv_hidden_sizes`.
fn attention(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = ctx.node;
    refuse_attrs(n, &[("do_rotary", 0), ("past_present_share_buffer", 0)])?;
    refuse_inputs(&ins, &[(6, "past_sequence_length")])?;
    if n.outputs.len() > 2 {
        bail!("outputs beyond present are not supported");
    }
    let heads = num_heads(n, "num_heads")?;
    let x = ins.tensor(0)?;
    let w = ins.tensor(1)?;
    let (xv, wv) = (f32_in(x, "input")?, f32_in(w, "weights")?);
    let (b, s, din) = match *x.shape() {
        [b, s, d] => (b, s, d),
        ref o => bail!("input must be [batch, seq, hidden], got {o:?}"),
    };
    let wcols = match *w.shape() {
        [r, c] if r == din => c,
        ref o => bail!("weights {o:?} must be [{din}, qkv hidden]"),
    };
    let (qh, kh, vh) = match n.attr_ints("qkv_hidden_sizes")? {
        Some(&[q, k, v]) if q > 0 && k > 0 && v > 0 => (q as usize, k as usize, v as usize),
        Some(o) => bail!("qkv_hidden_sizes {o:?} must be three positive sizes"),
        None if wcols % 3 == 0 => (wcols / 3, wcols / 3, wcols / 3),
        None => bail!("weights width {wcols} is not 3 x hidden"),
    };
    if qh + kh + vh != wcols {
        bail!(
            "qkv_hidden_sizes sum {} differs from the weights width {wcols}",
            qh + kh + vh
        );
    }
    if qh != kh || qh % heads != 0 || vh % heads != 0 {
        bail!("Q/K hidden sizes {qh}/{kh} and V hidden size {vh} must be equal Q/K and multiples of num_heads {heads}");
    }
    let (hd, hdv) = (qh / heads, vh / heads);
    let bias = match ins.opt_tensor(2) {
        Some(t) => {
            if t.shape() != [wcols] {
                bail!("bias {:?} must be [{wcols}]", t.shape());
            }
            Some(f32_in(t, "bias")?)
        }
        None => None,
    };
    // Projections [B·S, part] = input · weights[:, off..off + part] + bias[off..].
    let project = |off: usize, part: usize| -> Result<Vec<f32>> {
        let mut out = vec![0f32; b * s * part];
        if let Some(bv) = bias {
            for row in out.chunks_exact_mut(part) {
                row.copy_from_slice(&bv[off..off + part]);
            }
        }
        gemm_into(
            b * s,
            part,
            din,
            1.0,
            Mat::rows(xv, din),
            Mat {
                data: &wv[off..],
                rs: wcols,
                cs: 1,
            },
            Some(1.0),
            &mut out,
            part,
            ctx.threads,
        )?;
        Ok(out)
    };
    let q = bsnh_to_bnsh(&project(0, qh)?, b, s, heads, hd);
    let mut k = bsnh_to_bnsh(&project(qh, kh)?, b, s, heads, hd);
    let mut v = bsnh_to_bnsh(&project(qh + kh, vh)?, b, s, heads, hdv);
    let mut p = 0;
    if let Some(past) = ins.opt_tensor(4) {
        let pv = f32_in(past, "past")?;
        match *past.shape() {
            [2, pb, pn, pp, ph] if pb == b && pn == heads && ph == hd && hd == hdv => p = pp,
            ref o => bail!("past {o:?} must be [2, {b}, {heads}, past_seq, {hd}] (and V's head size equal K's)"),
        }
        let half = b * heads * p * hd;
        k = concat_seq(&pv[..half], &k, b * heads, p, s, hd);
        v = concat_seq(&pv[half..], &v, b * heads, p, s, hd);
    }
    let t = p + s;
    let y = masked_attention(
        ctx,
        (&q, &k, &v),
        (ins.opt_tensor(3), ins.opt_tensor(5)),
        (b, heads, s, p, hd, hdv),
    )?;
    let present = if n.outputs.get(1).is_some_and(|o| !o.is_empty()) {
        if hd != hdv {
            bail!("present needs equal K and V head sizes");
        }
        let mut kv = k;
        kv.extend_from_slice(&v);
        Some(Tensor::from_vec(vec![2, b, heads, t, hd], kv)?)
    } else {
        None
    };
    outputs(n, vec![Some(y), present])
}

/// A packed `[B, S, N, parts, H]` input as `parts` tensors `[B, S, N·H]`.
fn unpack(t: &Tensor, parts: usize, heads: usize, what: &str) -> Result<Vec<Tensor>> {
    let (b, s, h) = match *t.shape() {
        [b, s, nh, p, h] if nh == heads && p == parts => (b, s, h),
        ref o => bail!("{what} {o:?} must be [batch, seq, {heads}, {parts}, head_size]"),
    };
    let x = f32_in(t, what)?;
    let mut outs = vec![Vec::with_capacity(b * s * heads * h); parts];
    for group in x.chunks_exact((parts * h).max(1)) {
        for (j, o) in outs.iter_mut().enumerate() {
            o.extend_from_slice(&group[j * h..(j + 1) * h]);
        }
    }
    outs.into_iter()
        .map(|v| Ok(Tensor::from_vec(vec![b, s, heads * h], v)?))
        .collect()
}

/// `MultiHeadAttention`: separate Q `[B, S, D]`, K/V `[B, L, D]` (bias added, past
/// concatenated) or K/V `[B, N, L, H]` (used as they are); packed QKV or KV split first.
fn multi_head_attention(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = ctx.node;
    refuse_inputs(
        &ins,
        &[(8, "past_sequence_length"), (9, "cache_indirection")],
    )?;
    if n.outputs.len() > 3 {
        bail!("the qk output is not supported");
    }
    let heads = num_heads(n, "num_heads")?;
    // Packed QKV `[B, S, N, 3, H]` or packed KV `[B, L, N, 2, H]`: split into `[B, S, N·H]`.
    let unpacked: Vec<Tensor>;
    let (q, k, v) = match (ins.opt_tensor(1), ins.opt_tensor(2)) {
        (Some(k), Some(v)) => (ins.tensor(0)?, k, v),
        (k, None) => {
            if ins.opt_tensor(3).is_some() {
                bail!("bias with packed QKV / packed KV is not supported");
            }
            unpacked = match k {
                None => unpack(ins.tensor(0)?, 3, heads, "packed QKV query")?,
                Some(k) => {
                    let mut kv = unpack(k, 2, heads, "packed KV key")?;
                    kv.insert(0, ins.tensor(0)?.clone());
                    kv
                }
            };
            (&unpacked[0], &unpacked[1], &unpacked[2])
        }
        (None, Some(_)) => bail!("value without key is not supported"),
    };
    let (qv, kv, vv) = (f32_in(q, "query")?, f32_in(k, "key")?, f32_in(v, "value")?);
    let (b, s, d) = match *q.shape() {
        [b, s, d] if d % heads == 0 => (b, s, d),
        ref o => bail!("query {o:?} must be [batch, seq, num_heads x head_size]"),
    };
    let h = d / heads;
    let bnsh_kv = k.rank() == 4;
    let (l, dv) = match (k.shape(), v.shape()) {
        (&[kb, kl, kd], &[vb, vl, vd]) if kb == b && vb == b && kl == vl && kd == d => {
            if vd % heads != 0 {
                bail!("value hidden size {vd} is not a multiple of num_heads {heads}");
            }
            (kl, vd)
        }
        (&[kb, kn, kl, kh], &[vb, vn, vl, vh])
            if kb == b && vb == b && kn == heads && vn == heads && kl == vl && kh == h =>
        {
            (kl, vh * heads)
        }
        (ks, vs) => bail!("key {ks:?} / value {vs:?} must be [{b}, L, {d}] / [{b}, L, Dv] or [{b}, {heads}, L, {h}] / [{b}, {heads}, L, Hv] for query {:?}", q.shape()),
    };
    let hv = dv / heads;
    let bias = match ins.opt_tensor(3) {
        Some(t) => {
            if t.shape() != [2 * d + dv] {
                bail!("bias {:?} must be [{}]", t.shape(), 2 * d + dv);
            }
            Some(f32_in(t, "bias")?)
        }
        None => None,
    };
    let add = |x: &[f32], off: usize, width: usize| -> Vec<f32> {
        let mut x = x.to_vec();
        if let Some(bv) = bias {
            for row in x.chunks_exact_mut(width) {
                for (a, &c) in row.iter_mut().zip(&bv[off..off + width]) {
                    *a += c;
                }
            }
        }
        x
    };
    let qb = bsnh_to_bnsh(&add(qv, 0, d), b, s, heads, h);
    let (mut kb, mut vb) = if bnsh_kv {
        (kv.to_vec(), vv.to_vec())
    } else {
        (
            bsnh_to_bnsh(&add(kv, d, d), b, l, heads, h),
            bsnh_to_bnsh(&add(vv, 2 * d, dv), b, l, heads, hv),
        )
    };
    let mut p = 0;
    match (ins.opt_tensor(6), ins.opt_tensor(7)) {
        (None, None) => {}
        (Some(pk), Some(pv)) => {
            if bnsh_kv {
                bail!("past_key/past_value with key/value already [B, N, L, H] are not supported");
            }
            match (pk.shape(), pv.shape()) {
                (&[kb_, kn, kp, kh], &[vb_, vn, vp, vh])
                    if kb_ == b && vb_ == b && kn == heads && vn == heads && kp == vp && kh == h && vh == hv =>
                {
                    p = kp
                }
                (ks, vs) => bail!("past_key {ks:?} / past_value {vs:?} must be [{b}, {heads}, P, {h}] / [{b}, {heads}, P, {hv}]"),
            }
            kb = concat_seq(f32_in(pk, "past_key")?, &kb, b * heads, p, l, h);
            vb = concat_seq(f32_in(pv, "past_value")?, &vb, b * heads, p, l, hv);
        }
        _ => bail!("past_key and past_value must be given together"),
    }
    let t = p + l;
    if l != s && n.int_or("unidirectional", 0)? != 0 {
        // onnxruntime's CPU kernel lays its causal mask out for key length = query length.
        bail!(
            "unidirectional with a key length {l} other than the query length {s} is not supported"
        );
    }
    let kpm = ins.opt_tensor(4);
    if let Some(m) = kpm {
        if m.rank() == 1 && m.shape()[0] != b {
            bail!("key_padding_mask {:?}: only [batch] key lengths, [batch, total] or [batch, seq, total] are supported", m.shape());
        }
    }
    let y = masked_attention(
        ctx,
        (&qb, &kb, &vb),
        (kpm, ins.opt_tensor(5)),
        (b, heads, s, p, h, hv),
    )?;
    let pk = Tensor::from_vec(vec![b, heads, t, h], kb)?;
    let pv = Tensor::from_vec(vec![b, heads, t, hv], vb)?;
    outputs(n, vec![Some(y), Some(pk), Some(pv)])
}

/// `GroupQueryAttention`: per batch `b`, `seqlens_k[b] + 1` keys in all; a first prompt
/// (`S == total_sequence_length`) has no past, otherwise the new tokens follow
/// `seqlens_k[b] + 1 - S` cached ones. The present cache is `[B, Nkv, max(P, total), H]`: the
/// past's first tokens, then the new ones, zeros after.
fn group_query_attention(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = ctx.node;
    refuse_attrs(n, &[("smooth_softmax", 0), ("qk_output", 0)])?;
    refuse_inputs(&ins, &[(9, "position_ids"), (11, "head_sink")])?;
    if n.outputs.len() > 3 {
        bail!("the output_qk output is not supported");
    }
    let nq = num_heads(n, "num_heads")?;
    let nkv = num_heads(n, "kv_num_heads")?;
    if nq % nkv != 0 {
        bail!("num_heads {nq} is not a multiple of kv_num_heads {nkv}");
    }
    let q = ins.tensor(0)?;
    let qv = f32_in(q, "query")?;
    let (b, s, dq) = match *q.shape() {
        [b, s, d] => (b, s, d),
        ref o => bail!("query {o:?} must be [batch, seq, hidden]"),
    };
    // New Q, K, V as [B, S, heads, H].
    let (h, qn, kn, vn) = match (ins.opt_tensor(1), ins.opt_tensor(2)) {
        (None, None) => {
            let parts = nq + 2 * nkv;
            if dq % parts != 0 {
                bail!("packed QKV width {dq} is not (num_heads + 2 kv_num_heads) x head_size");
            }
            let h = dq / parts;
            let (mut qn, mut kn, mut vn) = (vec![], vec![], vec![]);
            for tok in qv.chunks_exact(dq) {
                qn.extend_from_slice(&tok[..nq * h]);
                kn.extend_from_slice(&tok[nq * h..(nq + nkv) * h]);
                vn.extend_from_slice(&tok[(nq + nkv) * h..]);
            }
            (h, qn, kn, vn)
        }
        (Some(k), Some(v)) => {
            if dq % nq != 0 {
                bail!("query width {dq} is not a multiple of num_heads {nq}");
            }
            let h = dq / nq;
            for (t, what) in [(k, "key"), (v, "value")] {
                if t.shape() != [b, s, nkv * h] {
                    bail!("{what} {:?} must be [{b}, {s}, {}]", t.shape(), nkv * h);
                }
            }
            (
                h,
                qv.to_vec(),
                f32_in(k, "key")?.to_vec(),
                f32_in(v, "value")?.to_vec(),
            )
        }
        _ => bail!("key and value must be given together"),
    };
    let (mut qn, mut kn) = (qn, kn);
    let p = match (ins.opt_tensor(3), ins.opt_tensor(4)) {
        (Some(pk), Some(pv)) => {
            let want = |p: usize| [b, nkv, p, h];
            if pk.rank() != 4 || pk.shape() != want(pk.shape()[2]) || pv.shape() != pk.shape() {
                bail!(
                    "past_key {:?} / past_value {:?} must both be [{b}, {nkv}, P, {h}]",
                    pk.shape(),
                    pv.shape()
                );
            }
            Some((
                pk.shape()[2],
                f32_in(pk, "past_key")?,
                f32_in(pv, "past_value")?,
            ))
        }
        (None, None) => None,
        _ => bail!("past_key and past_value must be given together"),
    };
    let plen = p.as_ref().map_or(0, |x| x.0);
    let seqlens = i32_in(ins.tensor(5)?, "seqlens_k")?;
    if seqlens.len() != b {
        bail!("seqlens_k has {} values, expected batch {b}", seqlens.len());
    }
    let total = match i32_in(ins.tensor(6)?, "total_sequence_length")?[..] {
        [t] if t > 0 => t as usize,
        ref o => bail!("total_sequence_length {o:?} must be one positive value"),
    };
    let first_prompt = s == total;
    let tlen = plen.max(total);
    // Per batch: (past tokens kept, keys in all).
    let mut lens = Vec::with_capacity(b);
    for (bi, &sl) in seqlens.iter().enumerate() {
        let all = sl + 1;
        let past = if first_prompt { 0 } else { all - s as i64 };
        if sl < 0 || all as usize > tlen || past < 0 || past as usize > plen {
            bail!("seqlens_k[{bi}] = {sl} does not fit {s} new tokens, past {plen}, total {total}");
        }
        lens.push((past as usize, all as usize));
    }
    if n.int_or("do_rotary", 0)? != 0 {
        let (cos, sin) = match (ins.opt_tensor(7), ins.opt_tensor(8)) {
            (Some(c), Some(sn)) if c.rank() == 2 && c.shape() == sn.shape() => (c, sn),
            _ => bail!(
                "do_rotary needs cos_cache and sin_cache, both [max_position, rotary_dim / 2]"
            ),
        };
        let (maxp, half) = (cos.shape()[0], cos.shape()[1]);
        if 2 * half > h {
            bail!("rotary dim {} exceeds head size {h}", 2 * half);
        }
        let (cs, ss) = (f32_in(cos, "cos_cache")?, f32_in(sin, "sin_cache")?);
        let il = n.int_or("rotary_interleaved", 0)? != 0;
        for (bi, &(past, _)) in lens.iter().enumerate() {
            for si in 0..s {
                let pos = past + si;
                if pos >= maxp {
                    bail!("position {pos} is outside the caches' {maxp} positions");
                }
                let (c, sn) = (&cs[pos * half..][..half], &ss[pos * half..][..half]);
                let tok = bi * s + si;
                for x in qn[tok * nq * h..][..nq * h].chunks_exact_mut(h) {
                    rotate(x, c, sn, il);
                }
                for x in kn[tok * nkv * h..][..nkv * h].chunks_exact_mut(h) {
                    rotate(x, c, sn, il);
                }
            }
        }
    } else if ins.opt_tensor(7).is_some() || ins.opt_tensor(8).is_some() {
        bail!("cos_cache/sin_cache given without do_rotary = 1");
    }
    // Present caches [B, Nkv, T, H]: past tokens, then the new ones.
    let mut pk = vec![0f32; b * nkv * tlen * h];
    let mut pv = vec![0f32; b * nkv * tlen * h];
    for (bi, &(past, _)) in lens.iter().enumerate() {
        for hi in 0..nkv {
            let dst = (bi * nkv + hi) * tlen * h;
            if let Some((_, pkd, pvd)) = &p {
                let src = (bi * nkv + hi) * plen * h;
                pk[dst..][..past * h].copy_from_slice(&pkd[src..][..past * h]);
                pv[dst..][..past * h].copy_from_slice(&pvd[src..][..past * h]);
            }
            for si in 0..s.min(tlen - past) {
                let src = ((bi * s + si) * nkv + hi) * h;
                let at = dst + (past + si) * h;
                pk[at..at + h].copy_from_slice(&kn[src..src + h]);
                pv[at..at + h].copy_from_slice(&vn[src..src + h]);
            }
        }
    }
    // Visible keys of query `si` in batch `bi`: causal, within the window, within the batch's
    // length.
    let window = n.int_or("local_window_size", -1)?;
    let mut base = vec![f32::NEG_INFINITY; b * s * tlen];
    let mut empty = vec![false; b * s];
    for (bi, &(past, all)) in lens.iter().enumerate() {
        for si in 0..s {
            let pos = past + si;
            let lo = if window > 0 {
                (pos + 1).saturating_sub(window as usize)
            } else {
                0
            };
            let hi = (pos + 1).min(all);
            if lo >= hi {
                empty[bi * s + si] = true;
                continue;
            }
            base[(bi * s + si) * tlen + lo..(bi * s + si) * tlen + hi].fill(0.0);
        }
    }
    let bias = ins.opt_tensor(10);
    if let Some(t) = bias {
        if t.rank() == 4 && t.shape()[3] != tlen {
            bail!(
                "attention_bias {:?}: its last dim must be the present length {tlen}",
                t.shape()
            );
        }
    }
    let mask = combine_mask(Some(base), bias, b, nq, s, tlen)?;
    let softcap = f64::from(n.float_or("softcap", 0.0)?);
    let qb = bsnh_to_bnsh(&qn, b, s, nq, h);
    let mut y = sdpa(
        &qb,
        &pk,
        &pv,
        mask.as_ref(),
        (b, nq, nkv, s, tlen, h, h),
        scale_of(n, h)?,
        softcap,
        ctx.threads,
    )?;
    // A query with no visible key (right padding past a first prompt's length): zeros.
    for (row, &e) in y.chunks_exact_mut(nq * h).zip(&empty) {
        if e {
            row.fill(0.0);
        }
    }
    outputs(
        n,
        vec![
            Some(Tensor::from_vec(vec![b, s, nq * h], y)?),
            Some(Tensor::from_vec(vec![b, nkv, tlen, h], pk)?),
            Some(Tensor::from_vec(vec![b, nkv, tlen, h], pv)?),
        ],
    )
}

/// `EmbedLayerNormalization`: `LayerNorm(word[ids] + position[pos] (+ segment[seg]))`,
/// positions `0..S` or `position_ids` (`[B, S]` or `[1, S]`); `mask_index[b]` counts the ones
/// of the mask's row (0 without a mask); `embedding_sum` is the sum before normalizing.
fn embed_layer_normalization(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = ctx.node;
    refuse_attrs(n, &[("mask_index_type", 1)])?;
    let ids_t = ins.tensor(0)?;
    let (b, s) = match *ids_t.shape() {
        [b, s] => (b, s),
        ref o => bail!("input_ids {o:?} must be [batch, seq]"),
    };
    let ids = i32_in(ids_t, "input_ids")?;
    let word = ins.tensor(2)?;
    let pos = ins.tensor(3)?;
    let hid = match *word.shape() {
        [_, h] => h,
        ref o => bail!("word_embedding {o:?} must be [vocab, hidden]"),
    };
    let table = |t: &Tensor, what: &str| -> Result<(usize, Vec<f32>)> {
        match *t.shape() {
            [r, h] if h == hid => Ok((r, f32_in(t, what)?.to_vec())),
            ref o => bail!("{what} {o:?} must be [rows, {hid}]"),
        }
    };
    let (nword, wv) = table(word, "word_embedding")?;
    let (npos, pv) = table(pos, "position_embedding")?;
    let seg = match (ins.opt_tensor(1), ins.opt_tensor(4)) {
        (Some(ids), Some(emb)) => {
            if ids.shape() != [b, s] {
                bail!("segment_ids {:?} must be [{b}, {s}]", ids.shape());
            }
            Some((
                i32_in(ids, "segment_ids")?,
                table(emb, "segment_embedding")?,
            ))
        }
        (None, None) => None,
        _ => bail!("segment_ids and segment_embedding must be given together"),
    };
    let vec_in = |i: usize, what: &str| -> Result<Option<Vec<f32>>> {
        match ins.opt_tensor(i) {
            None => Ok(None),
            Some(t) if t.shape() == [hid] => Ok(Some(f32_in(t, what)?.to_vec())),
            Some(t) => bail!("{what} {:?} must be [{hid}]", t.shape()),
        }
    };
    let gamma =
        vec_in(5, "gamma")?.ok_or_else(|| crate::error::RtError::msg("gamma is missing"))?;
    let beta = vec_in(6, "beta")?;
    let pids = match ins.opt_tensor(8) {
        None => None,
        Some(t) if t.shape() == [b, s] || t.shape() == [1, s] => {
            Some((t.shape()[0] == 1, t.to_i64_vec()?))
        }
        Some(t) => bail!(
            "position_ids {:?} must be [{b}, {s}] or [1, {s}]",
            t.shape()
        ),
    };
    let eps = n.float_or("epsilon", 1e-12)?;
    let row = |what: &str, idx: i64, rows: usize| -> Result<usize> {
        if idx < 0 || idx as usize >= rows {
            bail!("{what} {idx} is outside the table's {rows} rows");
        }
        Ok(idx as usize)
    };
    let mut y = vec![0f32; b * s * hid];
    let mut sum = vec![0f32; b * s * hid];
    for tok in 0..b * s {
        let wi = row("input id", ids[tok], nword)?;
        let pidx = match &pids {
            None => (tok % s) as i64,
            Some((true, p)) => p[tok % s],
            Some((false, p)) => p[tok],
        };
        let pi = row("position", pidx, npos)?;
        let e = &mut sum[tok * hid..][..hid];
        for (j, x) in e.iter_mut().enumerate() {
            *x = wv[wi * hid + j] + pv[pi * hid + j];
        }
        if let Some((sids, (nseg, sv))) = &seg {
            let si = row("segment id", sids[tok], *nseg)?;
            for (j, x) in e.iter_mut().enumerate() {
                *x += sv[si * hid + j];
            }
        }
        let mean = e.iter().sum::<f32>() / hid as f32;
        let var = e.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / hid as f32;
        let denom = (var + eps).sqrt();
        let o = &mut y[tok * hid..][..hid];
        for j in 0..hid {
            o[j] = (e[j] - mean) / denom * gamma[j] + beta.as_ref().map_or(0.0, |bt| bt[j]);
        }
    }
    let mask_index = match ins.opt_tensor(7) {
        Some(m) => {
            if m.shape() != [b, s] {
                bail!("mask {:?} must be [{b}, {s}]", m.shape());
            }
            let mv = i32_in(m, "mask")?;
            (0..b)
                .map(|bi| mv[bi * s..(bi + 1) * s].iter().filter(|&&v| v == 1).count() as i32)
                .collect()
        }
        None => vec![0i32; b],
    };
    outputs(
        n,
        vec![
            Some(Tensor::from_vec(vec![b, s, hid], y)?),
            Some(Tensor::from_vec(vec![b], mask_index)?),
            Some(Tensor::from_vec(vec![b, s, hid], sum)?),
        ],
    )
}
