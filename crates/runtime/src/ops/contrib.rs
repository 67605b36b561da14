//! onnxruntime contrib ops (`com.microsoft`) that need a kernel of their own (the others are
//! rewritten into standard ops at import, `npuc_onnx::contrib`):
//!
//! - `RotaryEmbedding(input, position_ids, cos_cache, sin_cache)`: rotary position embedding as
//!   GenAI exports apply it to queries and keys. `input` is `[batch, seq, heads * head_size]`
//!   (then `num_heads` or the cache width gives the head size) or `[batch, heads, seq,
//!   head_size]`; `position_ids` `[batch, seq]`, or `[1]` (an offset: positions offset + s);
//!   caches `[max_position, rotary_dim / 2]`. The first `rotary_dim` features of each head
//!   rotate as pairs `(i, i + rotary_dim/2)`, or `(2i, 2i + 1)` with `interleaved`; the rest are
//!   copied. Float32, as onnxruntime: `x1·cos − x2·sin`, `x2·cos + x1·sin`.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::value::Value;
use npuc_ir::{DType, Tensor};

pub fn register(r: &mut Registry) {
    r.add_range("com.microsoft", "RotaryEmbedding", 1, 1, rotary_embedding);
    super::contrib_attention::register(r);
}

fn rotary_embedding(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = ctx.node;
    let x = ins.tensor(0)?;
    let pos = ins.tensor(1)?;
    let (cos, sin) = (ins.tensor(2)?, ins.tensor(3)?);
    for (t, what) in [(x, "input"), (cos, "cos_cache"), (sin, "sin_cache")] {
        if t.dtype() != DType::F32 {
            bail!("{what} is {}, only float32 is supported", t.dtype().name());
        }
    }
    let interleaved = n.int_or("interleaved", 0)? != 0;
    let num_heads = n.int_or("num_heads", 0)?;
    let rot_attr = n.int_or("rotary_embedding_dim", 0)?;
    if n.float_or("scale", 1.0)? != 1.0 {
        bail!("scale other than 1 is not supported");
    }
    if n.int_or("is_packed_batching", 0)? != 0 {
        bail!("is_packed_batching is not supported");
    }
    if cos.rank() != 2 || cos.shape() != sin.shape() {
        bail!(
            "cos_cache {:?} and sin_cache {:?} must both be [max_position, rotary_dim / 2]",
            cos.shape(),
            sin.shape()
        );
    }
    let (max_pos, half) = (cos.shape()[0], cos.shape()[1]);
    let s = x.shape();
    // (batch, heads, seq, head) and the element strides of heads and seq.
    let (b, h, sq, d, head_stride, seq_stride) = match *s {
        [b, nh, sq, d] => (b, nh, sq, d, sq * d, d),
        [b, sq, hidden] => {
            let nh = if num_heads > 0 {
                num_heads as usize
            } else if half > 0 && hidden % (2 * half) == 0 {
                hidden / (2 * half)
            } else {
                bail!("a 3-D input needs num_heads (hidden {hidden}, cache width {half})");
            };
            if hidden % nh != 0 {
                bail!("hidden size {hidden} is not a multiple of num_heads {nh}");
            }
            let d = hidden / nh;
            (b, nh, sq, d, d, hidden)
        }
        _ => {
            bail!("input must be [batch, seq, hidden] or [batch, heads, seq, head_size], got {s:?}")
        }
    };
    let rd = if rot_attr > 0 { rot_attr as usize } else { d };
    if rd > d || rd % 2 != 0 || rd / 2 != half {
        bail!("rotary_dim {rd} (head size {d}) does not match the caches' width {half} (rotary_dim / 2)");
    }
    let p = pos.to_i64_vec()?;
    let position = |bi: usize, si: usize| -> Result<usize> {
        let v = match pos.shape() {
            [1] => p[0] + si as i64,
            [pb, ps] if *pb == b && *ps == sq => p[bi * sq + si],
            other => bail!("position_ids must be [batch, seq] = [{b}, {sq}] or [1], got {other:?}"),
        };
        if v < 0 || v as usize >= max_pos {
            bail!("position {v} is outside the caches' {max_pos} positions");
        }
        Ok(v as usize)
    };
    let (xs, cs, ss) = (
        x.as_slice::<f32>()?,
        cos.as_slice::<f32>()?,
        sin.as_slice::<f32>()?,
    );
    let mut out = xs.to_vec();
    let batch_stride = h * sq * d;
    for bi in 0..b {
        for si in 0..sq {
            let pidx = position(bi, si)?;
            let (c, sn) = (&cs[pidx * half..][..half], &ss[pidx * half..][..half]);
            for hi in 0..h {
                let base = bi * batch_stride + hi * head_stride + si * seq_stride;
                rotate(&mut out[base..base + d], c, sn, interleaved);
            }
        }
    }
    Ok(vec![Value::tensor(Tensor::from_vec(s.to_vec(), out)?)])
}

/// Rotates the first `2 · cos.len()` features of `x` (one head at one position): pairs
/// `(i, i + half)`, or `(2i, 2i + 1)` when `interleaved`; `x1·cos − x2·sin`, `x2·cos + x1·sin`.
pub(crate) fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (x1, x2) = (x[a], x[b]);
        x[a] = x1 * cos[i] - x2 * sin[i];
        x[b] = x2 * cos[i] + x1 * sin[i];
    }
}
