//! Recurrent "linear attention" blocks: LinearAttention (linear / gated / delta / gated-delta
//! state updates) and CausalConvWithState (the depthwise causal conv that precedes them).
//! Both compute in f32, as the reference does.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::value::Value;
use npuc_ir::{bf16, f16, DType, Tensor};

pub fn register(r: &mut Registry) {
    r.add("LinearAttention", 1, linear_attention);
    r.add("CausalConvWithState", 1, causal_conv_with_state);
}

/// Any float tensor widened to f32.
fn load_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(match t.dtype() {
        DType::F32 => t.as_slice::<f32>()?.to_vec(),
        DType::F16 | DType::BF16 | DType::F64 => {
            t.to_f64_vec()?.into_iter().map(|x| x as f32).collect()
        }
        other => bail!("expected a float tensor, found {other}"),
    })
}

/// Stores f32 results as `dtype`.
fn store_f32(dtype: DType, shape: Vec<usize>, v: Vec<f32>) -> Result<Tensor> {
    Ok(match dtype {
        DType::F32 => Tensor::from_vec(shape, v)?,
        DType::F64 => Tensor::from_vec(shape, v.into_iter().map(|x| x as f64).collect())?,
        DType::F16 => Tensor::from_vec(shape, v.into_iter().map(f16::from_f32).collect())?,
        DType::BF16 => Tensor::from_vec(shape, v.into_iter().map(bf16::from_f32).collect())?,
        other => bail!("cannot store float results as {other}"),
    })
}

/// LinearAttention: per time step, `S = S * exp(g)` (gated), `v = beta * (v - S^T k)` (delta),
/// `S += k v^T`, `o = scale * q S`, with GQA sharing of the kv-head state.
fn linear_attention(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let node = ctx.node;
    let q = ins.tensor(0)?;
    let k = ins.tensor(1)?;
    let v = ins.tensor(2)?;
    let past = ins.opt_tensor(3);
    let decay = ins.opt_tensor(4);
    let beta = ins.opt_tensor(5);
    let rule = node.str_or("update_rule", "gated_delta")?;
    let (gating, delta) = match rule {
        "linear" => (false, false),
        "gated" => (true, false),
        "delta" => (false, true),
        "gated_delta" => (true, true),
        other => bail!("unknown update_rule '{other}'"),
    };
    if gating != decay.is_some() {
        bail!(
            "update_rule '{rule}' {} the decay input",
            if gating { "requires" } else { "forbids" }
        );
    }
    if delta != beta.is_some() {
        bail!(
            "update_rule '{rule}' {} the beta input",
            if delta { "requires" } else { "forbids" }
        );
    }
    let hq = node.int_req("q_num_heads")?;
    let hkv = node.int_req("kv_num_heads")?;
    if hq <= 0 || hkv <= 0 || hq % hkv != 0 {
        bail!("q_num_heads {hq} must be a positive multiple of kv_num_heads {hkv}");
    }
    let (hq, hkv) = (hq as usize, hkv as usize);
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.len() != 3 || ks.len() != 3 || vs.len() != 3 {
        bail!("query, key and value must be rank 3 (B, T, H*D)");
    }
    let (b, t) = (qs[0], qs[1]);
    if ks[0] != b || vs[0] != b || ks[1] != t || vs[1] != t {
        bail!("query {qs:?}, key {ks:?} and value {vs:?} disagree in batch or length");
    }
    if qs[2] % hq != 0 || vs[2] % hkv != 0 || ks[2] != hkv * (qs[2] / hq) {
        bail!("hidden sizes do not split into heads: query {qs:?}, key {ks:?}, value {vs:?}");
    }
    let (dk, dv) = (qs[2] / hq, vs[2] / hkv);
    let group = hq / hkv;
    let qv = load_f32(q)?;
    let kv = load_f32(k)?;
    let vv = load_f32(v)?;
    // Decay per (b, t, kv head, dk) with a 0 stride over dk when given per head.
    let (dvals, d_per_dim) = match decay {
        Some(dt) => {
            let s = dt.shape();
            if s.len() != 3 || s[0] != b || s[1] != t {
                bail!("decay must be (B, T, H) or (B, T, H*dk), got {s:?}");
            }
            let per_dim = if s[2] == hkv {
                false
            } else if s[2] == hkv * dk {
                true
            } else {
                bail!("decay last dim {} must be {hkv} or {}", s[2], hkv * dk);
            };
            (load_f32(dt)?, per_dim)
        }
        None => (vec![], false),
    };
    let (bvals, b_last) = match beta {
        Some(bt) => {
            let s = bt.shape();
            if s.len() != 3 || s[0] != b || s[1] != t || (s[2] != hkv && s[2] != 1) {
                bail!("beta must be (B, T, {hkv}) or (B, T, 1), got {s:?}");
            }
            (load_f32(bt)?, s[2])
        }
        None => (vec![], 1),
    };
    let mut state = match past {
        Some(p) => {
            if p.shape() != [b, hkv, dk, dv] {
                bail!(
                    "past_state {:?} should be [{b}, {hkv}, {dk}, {dv}]",
                    p.shape()
                );
            }
            load_f32(p)?
        }
        None => vec![0.0f32; b * hkv * dk * dv],
    };
    let scale = match node.attr_float("scale")? {
        Some(s) if s != 0.0 => s,
        _ => 1.0 / (dk as f32).sqrt(),
    };
    let mut out = vec![0.0f32; b * t * hq * dv];
    let mut vt = vec![0.0f32; dv];
    let mut ret = vec![0.0f32; dv];
    for bi in 0..b {
        for ti in 0..t {
            let row = bi * t + ti;
            for h in 0..hkv {
                let st = &mut state[(bi * hkv + h) * dk * dv..][..dk * dv];
                let kt = &kv[(row * hkv + h) * dk..][..dk];
                vt.copy_from_slice(&vv[(row * hkv + h) * dv..][..dv]);
                if gating {
                    for i in 0..dk {
                        let g = if d_per_dim {
                            dvals[(row * hkv + h) * dk + i]
                        } else {
                            dvals[row * hkv + h]
                        };
                        let e = g.exp();
                        st[i * dv..(i + 1) * dv].iter_mut().for_each(|x| *x *= e);
                    }
                }
                if delta {
                    let bta = bvals[row * b_last + if b_last == 1 { 0 } else { h }];
                    // retrieved[m] = sum_d S[d, m] k[d]
                    ret.fill(0.0);
                    for (i, &kd) in kt.iter().enumerate() {
                        for (r, &s) in ret.iter_mut().zip(&st[i * dv..(i + 1) * dv]) {
                            *r += s * kd;
                        }
                    }
                    for (x, r) in vt.iter_mut().zip(&ret) {
                        *x = bta * (*x - r);
                    }
                }
                for (i, &kd) in kt.iter().enumerate() {
                    for (s, &x) in st[i * dv..(i + 1) * dv].iter_mut().zip(&vt) {
                        *s += kd * x;
                    }
                }
                for g in 0..group {
                    let qh = h * group + g;
                    let qt = &qv[(row * hq + qh) * dk..][..dk];
                    let o = &mut out[(row * hq + qh) * dv..][..dv];
                    for (i, &qd) in qt.iter().enumerate() {
                        for (y, &s) in o.iter_mut().zip(&st[i * dv..(i + 1) * dv]) {
                            *y += qd * s;
                        }
                    }
                    o.iter_mut().for_each(|y| *y *= scale);
                }
            }
        }
    }
    let state_dt = past.map_or(q.dtype(), |p| p.dtype());
    Ok(vec![
        Value::tensor(store_f32(q.dtype(), vec![b, t, hq * dv], out)?),
        Value::tensor(store_f32(state_dt, vec![b, hkv, dk, dv], state)?),
    ])
}

/// CausalConvWithState: depthwise 1-D conv over `[past_state, input]` (zeros when no state),
/// optional SiLU, and the last `k - 1` padded steps as the new state.
fn causal_conv_with_state(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let w = ins.tensor(1)?;
    let bias = ins.opt_tensor(2);
    let past = ins.opt_tensor(3);
    let act = ctx.node.str_or("activation", "none")?;
    let silu = match act {
        "none" => false,
        "silu" | "swish" => true,
        other => bail!("unknown activation '{other}'"),
    };
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != 3 || ws.len() != 3 || ws[0] != xs[1] || ws[1] != 1 || ws[2] == 0 {
        bail!("input must be (B, C, L) and weight (C, 1, k); got {xs:?} and {ws:?}");
    }
    let (b, c, l, k) = (xs[0], xs[1], xs[2], ws[2]);
    let xv = load_f32(x)?;
    let wv = load_f32(w)?;
    let bv = match bias {
        Some(t) if t.len() == c => load_f32(t)?,
        Some(t) => bail!("bias has {} values, expected {c}", t.len()),
        None => vec![0.0; c],
    };
    let pl = l + k - 1;
    let mut padded = vec![0.0f32; b * c * pl];
    if let Some(p) = past {
        if p.shape() != [b, c, k - 1] {
            bail!("past_state {:?} should be [{b}, {c}, {}]", p.shape(), k - 1);
        }
        let pv = load_f32(p)?;
        for bc in 0..b * c {
            padded[bc * pl..bc * pl + k - 1].copy_from_slice(&pv[bc * (k - 1)..(bc + 1) * (k - 1)]);
        }
    }
    for bc in 0..b * c {
        padded[bc * pl + k - 1..(bc + 1) * pl].copy_from_slice(&xv[bc * l..(bc + 1) * l]);
    }
    let mut out = vec![0.0f32; b * c * l];
    let mut state = vec![0.0f32; b * c * (k - 1)];
    for bc in 0..b * c {
        let ch = bc % c;
        let src = &padded[bc * pl..(bc + 1) * pl];
        let wk = &wv[ch * k..(ch + 1) * k];
        for (i, o) in out[bc * l..(bc + 1) * l].iter_mut().enumerate() {
            let mut acc = bv[ch];
            for (j, &wj) in wk.iter().enumerate() {
                acc += wj * src[i + j];
            }
            *o = if silu {
                acc / (1.0 + (-acc).exp())
            } else {
                acc
            };
        }
        state[bc * (k - 1)..(bc + 1) * (k - 1)].copy_from_slice(&src[pl - (k - 1)..]);
    }
    Ok(vec![
        Value::tensor(store_f32(x.dtype(), vec![b, c, l], out)?),
        Value::tensor(store_f32(x.dtype(), vec![b, c, k - 1], state)?),
    ])
}
