//! Inference rules for onnxruntime's attention contrib ops (`com.microsoft`): `Attention`,
//! `MultiHeadAttention`, `GroupQueryAttention`, `EmbedLayerNormalization`. Shapes as their
//! kernels (`npuc_runtime::ops::contrib_attention`) produce them.

use super::ctx::{NodeIn, R};
use super::util::*;
use super::Out;
use crate::dtype::DType;
use crate::graph::Dim;

fn heads(n: &NodeIn, attr: &str) -> R<usize> {
    match n.int_attr(attr)? {
        Some(h) if h > 0 => Ok(h as usize),
        _ => Err(format!("attribute {attr} must be positive")),
    }
}

/// Dim `i` of input `k`'s shape, when the shape is known.
fn dim(n: &NodeIn, k: usize, i: usize) -> Dim {
    n.shape(k)
        .and_then(|s| s.get(i).cloned())
        .unwrap_or(Dim::Unknown)
}

fn rank_is(n: &NodeIn, k: usize, r: usize, what: &str) -> R<()> {
    match n.rank(k) {
        Some(x) if x != r => Err(format!("{what} must have rank {r}, found {x}")),
        _ => Ok(()),
    }
}

/// `Attention`: output `[B, S, V hidden]`, present `[2, B, N, P + S, head]`.
pub fn attention(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    rank_is(n, 0, 3, "input")?;
    rank_is(n, 1, 2, "weights")?;
    let nh = heads(n, "num_heads")?;
    let dt = n.dt(0);
    let (qh, vh) = match n.ints_attr("qkv_hidden_sizes")? {
        Some(&[q, _, v]) if q > 0 && v > 0 => (Dim::Fixed(q as usize), Dim::Fixed(v as usize)),
        Some(o) => {
            return Err(format!(
                "qkv_hidden_sizes {o:?} must be three positive sizes"
            ))
        }
        None => {
            let w = dim_div_exact(&dim(n, 1, 1), 3, "weights width (3 x hidden)")?;
            (w.clone(), w)
        }
    };
    let (b, s) = (dim(n, 0, 0), dim(n, 0, 1));
    let past = if n.has(4) {
        rank_is(n, 4, 5, "past")?;
        dim(n, 4, 3)
    } else {
        Dim::Fixed(0)
    };
    let head = dim_div_exact(&qh, nh, "Q hidden size / num_heads")?;
    Ok(vec![
        Out::ty(tt(dt, Some(vec![b.clone(), s.clone(), vh]))),
        Out::ty(tt(
            dt,
            Some(vec![
                Dim::Fixed(2),
                b,
                Dim::Fixed(nh),
                dim_sum(&past, &s),
                head,
            ]),
        )),
    ])
}

/// `MultiHeadAttention`: output `[B, S, Dv]`, present key/value `[B, N, P + L, H/Hv]` (packed
/// QKV `[B, S, N, 3, H]` and packed KV `[B, L, N, 2, H]` too).
pub fn multi_head_attention(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let nh = heads(n, "num_heads")?;
    let dt = n.dt(0);
    let (b, s) = (dim(n, 0, 0), dim(n, 0, 1));
    let packed_qkv = !n.has(1);
    if packed_qkv {
        rank_is(n, 0, 5, "packed QKV query")?;
    } else {
        rank_is(n, 0, 3, "query")?;
    }
    let d = if packed_qkv {
        dim_mul(&dim(n, 0, 4), &Dim::Fixed(nh))
    } else {
        dim(n, 0, 2)
    };
    let h = dim_div_exact(&d, nh, "query hidden size / num_heads")?;
    let (l, dv) = if packed_qkv {
        (s.clone(), d.clone())
    } else if !n.has(2) {
        rank_is(n, 1, 5, "packed KV key")?;
        (dim(n, 1, 1), dim_mul(&dim(n, 1, 4), &Dim::Fixed(nh)))
    } else {
        match n.rank(1) {
            Some(4) => (dim(n, 1, 2), dim_mul(&dim(n, 2, 3), &Dim::Fixed(nh))),
            Some(3) => (dim(n, 1, 1), dim(n, 2, 2)),
            Some(r) => return Err(format!("key must have rank 3 or 4, found {r}")),
            None => (Dim::Unknown, Dim::Unknown),
        }
    };
    let past = if n.has(6) {
        dim(n, 6, 2)
    } else {
        Dim::Fixed(0)
    };
    let t = dim_sum(&past, &l);
    let hv = dim_div_exact(&dv, nh, "value hidden size / num_heads")?;
    let nh = Dim::Fixed(nh);
    Ok(vec![
        Out::ty(tt(dt, Some(vec![b.clone(), s, dv]))),
        Out::ty(tt(dt, Some(vec![b.clone(), nh.clone(), t.clone(), h]))),
        Out::ty(tt(dt, Some(vec![b, nh, t, hv]))),
    ])
}

/// `GroupQueryAttention`: output `[B, S, N·H]`, present key/value `[B, Nkv, max(P, total), H]`
/// (the length known when `total_sequence_length` is a constant).
pub fn group_query_attention(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    rank_is(n, 0, 3, "query")?;
    let nq = heads(n, "num_heads")?;
    let nkv = heads(n, "kv_num_heads")?;
    let dt = n.dt(0);
    let (b, s, dq) = (dim(n, 0, 0), dim(n, 0, 1), dim(n, 0, 2));
    let h = if n.has(1) {
        dim_div_exact(&dq, nq, "query hidden size / num_heads")?
    } else {
        dim_div_exact(
            &dq,
            nq + 2 * nkv,
            "packed QKV width / (num_heads + 2 kv_num_heads)",
        )?
    };
    let past = if n.has(3) {
        dim(n, 3, 2)
    } else {
        Dim::Fixed(0)
    };
    let t = match (fx(&past), n.int_scalar(6)) {
        (Some(p), Some(total)) if total > 0 => Dim::Fixed(p.max(total as usize)),
        _ => Dim::Unknown,
    };
    let present = Some(vec![b.clone(), Dim::Fixed(nkv), t, h.clone()]);
    Ok(vec![
        Out::ty(tt(dt, Some(vec![b, s, dim_mul(&Dim::Fixed(nq), &h)]))),
        Out::ty(tt(dt, present.clone())),
        Out::ty(tt(dt, present)),
    ])
}

/// `EmbedLayerNormalization`: output and embedding sum `[B, S, hidden]`, mask index `[B]` int32.
pub fn embed_layer_normalization(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(2)?;
    rank_is(n, 0, 2, "input_ids")?;
    rank_is(n, 2, 2, "word_embedding")?;
    let dt = n.dt(2);
    let (b, s, hid) = (dim(n, 0, 0), dim(n, 0, 1), dim(n, 2, 1));
    let y = Some(vec![b.clone(), s, hid]);
    Ok(vec![
        Out::ty(tt(dt, y.clone())),
        Out::ty(tt(Some(DType::I32), Some(vec![b]))),
        Out::ty(tt(dt, y)),
    ])
}
