//! `RotaryEmbedding` (opset 23).

use super::{downcast, upcast, Real};
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::value::Value;
use npuc_ir::Elem;

pub fn register(r: &mut Registry) {
    r.add("RotaryEmbedding", 23, rotary_embedding);
}

/// `RotaryEmbedding`: rotates the first `rotary_embedding_dim` features of every head by the
/// cached cos/sin of its position. Input is `[B, H, S, D]` or `[B, S, H*D]` (`num_heads`);
/// caches are `[max_pos, rd/2]` indexed by `position_ids` (`[B, S]`), or `[B, S, rd/2]`.
/// `interleaved` pairs features (0,1), (2,3)...; otherwise (i, i + rd/2).
fn rotary_embedding(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x0 = ins.tensor(0)?;
    let dt = x0.dtype();
    let x = upcast(x0)?;
    let cos = upcast(ins.tensor(1)?)?;
    let sin = upcast(ins.tensor(2)?)?;
    let pos = match ins.opt_tensor(3) {
        Some(p) => Some(p.to_i64_vec()?),
        None => None,
    };
    let interleaved = ctx.node.int_or("interleaved", 0)? != 0;
    let rd_attr = ctx.node.int_or("rotary_embedding_dim", 0)?;
    let num_heads = ctx.node.int_or("num_heads", 0)?;
    let shape = x.shape().to_vec();
    // (batch, seq, heads, head_size) and the strides of seq and head in the input layout.
    let (b, s, h, hd, s_stride, h_stride) = match *shape.as_slice() {
        [b, h, s, d] => (b, s, h, d, d, s * d),
        [b, s, hidden] => {
            if num_heads <= 0 || hidden % num_heads as usize != 0 {
                bail!("num_heads {num_heads} must be positive and divide hidden size {hidden}");
            }
            let h = num_heads as usize;
            (b, s, h, hidden / h, hidden, hidden / h)
        }
        _ => bail!("input must be 3-D or 4-D, got {:?}", shape),
    };
    let rd = if rd_attr == 0 { hd } else { rd_attr as usize };
    if rd > hd || rd % 2 != 0 {
        bail!("rotary_embedding_dim {rd} must be even and at most the head size {hd}");
    }
    let half = rd / 2;
    if cos.shape() != sin.shape() || cos.shape().last() != Some(&half) {
        bail!(
            "cos/sin caches {:?}/{:?} must match and end in rotary_embedding_dim/2 = {half}",
            cos.shape(),
            sin.shape()
        );
    }
    let rows = cos.len() / half.max(1);
    // Cache row of (batch, seq).
    let cache_row = |bi: usize, si: usize| -> Result<usize> {
        match &pos {
            Some(p) => {
                let v = *p
                    .get(bi * s + si)
                    .ok_or_else(|| crate::RtError::msg("position_ids must have shape [B, S]"))?;
                if v < 0 || v as usize >= rows {
                    bail!("position id {v} is out of range for a cache of {rows} rows");
                }
                Ok(v as usize)
            }
            None => {
                if rows != b * s {
                    bail!("without position_ids the caches must be [B, S, rd/2]");
                }
                Ok(bi * s + si)
            }
        }
    };
    let y = crate::dispatch_real!(x.dtype(), F => {
        if cos.dtype() != F::DTYPE || sin.dtype() != F::DTYPE {
            bail!("caches must have the input's dtype");
        }
        let xv = x.as_slice::<F>()?;
        let (cv, sv) = (cos.as_slice::<F>()?, sin.as_slice::<F>()?);
        let mut out = xv.to_vec();
        let batch_stride = xv.len() / b.max(1);
        for bi in 0..b {
            for si in 0..s {
                let r = cache_row(bi, si)?;
                let (c, sn) = (&cv[r * half..(r + 1) * half], &sv[r * half..(r + 1) * half]);
                for hi in 0..h {
                    let off = bi * batch_stride + si * s_stride + hi * h_stride;
                    let src = &xv[off..off + rd];
                    let dst = &mut out[off..off + rd];
                    rotate::<F>(src, dst, c, sn, interleaved);
                }
            }
        }
        npuc_ir::Tensor::from_vec(shape, out)?
    });
    Ok(vec![Value::tensor(downcast(y, dt)?)])
}

#[inline]
fn rotate<F: Real>(src: &[F], dst: &mut [F], cos: &[F], sin: &[F], interleaved: bool) {
    let half = cos.len();
    for i in 0..half {
        let (i1, i2) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (x1, x2) = (src[i1], src[i2]);
        dst[i1] = cos[i] * x1 - sin[i] * x2;
        dst[i2] = sin[i] * x1 + cos[i] * x2;
    }
}
