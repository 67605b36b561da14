//! `npuc.BlockMatMul`: `y = a · W (+ bias)` with `W` a constant 4-bit block-quantized weight
//! kept packed (`kernels::blockq4`: two codes per byte plus f32 block scales and centers),
//! which `npuc_passes::quant_lower` writes in place of `DequantizeLinear(int4/uint4 W,
//! blocked scale[, zero point]) -> MatMul/Gemm` (w4a16 per-block and LPBQ artifacts).
//!
//! Choice: the activations of those graphs are 16-bit (or float), so an integer dot product
//! would need 16 x 4-bit products with a dequantization per block per output anyway; the
//! kernel instead dequantizes `W` a column panel at a time (exactly the f32 values
//! `DequantizeLinear` gives) into a per-thread buffer of at most [`PANEL_BYTES`] and multiplies
//! it with the runtime's f32 GEMM (`ops::matmul::gemm_into`, the one plain MatMul uses), the
//! product landing directly in its columns of `y`. Memory is the packed weight (half a byte a
//! value) plus one panel per thread instead of 4 bytes a value; each run dequantizes `W` once
//! per row chunk (one chunk per thread), `k * n` conversions next to `m * k * n` multiply-adds.

use super::matmul::{gemm_into, Mat};
use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::kernels::blockq4::{self, Isa, Packed};
use crate::value::Value;
use npuc_ir::infer::rules::tt;
use npuc_ir::opdef::{AttrDef, OpDef, Param};
use npuc_ir::{DType, Dim, Tensor};
use rayon::prelude::*;
use std::cell::RefCell;

pub fn register(r: &mut Registry) {
    r.define(&BLOCK_MATMUL, block_matmul);
}

/// Largest dequantized panel (f32 values `k x nc`): about a core's L2, so the GEMM packs it
/// from cache, and wide enough that each product packs its activations only a few times.
pub const PANEL_BYTES: usize = 1 << 20;

/// Products smaller than this many multiply-adds run on one thread.
const PAR_WORK: usize = 1 << 20;

/// `npuc.BlockMatMul(a, b, b_scale, b_center[, bias])`, attributes `block_size` and `n`: `b` is
/// `[k, n.div_ceil(2)]` u8 (the `blockq4` layout), `b_scale` and `b_center` `[k / block_size,
/// n]` f32, `bias` `[n]` f32; `y` is `a`'s shape with the last dimension `n`, f32.
pub static BLOCK_MATMUL: OpDef = OpDef {
    domain: "npuc",
    name: "BlockMatMul",
    inputs: &[
        Param::required("a"),
        Param::required("b"),
        Param::required("b_scale"),
        Param::required("b_center"),
        Param::optional("bias"),
    ],
    outputs: &[Param::required("y")],
    attrs: &[
        AttrDef::required("block_size", "int"),
        AttrDef::required("n", "int"),
    ],
    infer: |n| {
        let cols = n.int_req("n")?;
        let dims = n.shape(0).map(|s| {
            let mut d = s.to_vec();
            if let Some(last) = d.last_mut() {
                *last = Dim::Fixed(cols.max(0) as usize);
            }
            d
        });
        Ok(vec![tt(Some(DType::F32), dims)])
    },
};

thread_local! {
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Columns per panel: a multiple of 16 (the AVX2 step) with `k * nc * 4 <= PANEL_BYTES` when
/// possible, at most `n`.
fn panel_cols(k: usize, n: usize) -> usize {
    let nc = (PANEL_BYTES / 4 / k.max(1)) & !15;
    nc.max(16).min(n)
}

/// `y[rows x n] = x[rows x k] · W` for the rows of one chunk, panel by panel.
fn rows_product(isa: Isa, w: &Packed, x: &[f32], rows: usize, y: &mut [f32]) -> Result<()> {
    let (k, n) = (w.k, w.n);
    let nc = panel_cols(k, n);
    PANEL.with(|cell| -> Result<()> {
        let mut panel = cell.borrow_mut();
        if panel.len() < k * nc {
            panel.resize(k * nc, 0.0);
        }
        let mut n0 = 0;
        while n0 < n {
            let w_cols = nc.min(n - n0);
            if !blockq4::dequant_panel(isa, w, n0, w_cols, &mut panel[..k * w_cols]) {
                bail!("BlockMatMul: packed weight smaller than {k}x{n}");
            }
            gemm_into(
                rows,
                w_cols,
                k,
                1.0f32,
                Mat::rows(x, k),
                Mat::rows(&panel[..k * w_cols], w_cols),
                None,
                &mut y[n0..],
                n,
                1,
            )?;
            n0 += w_cols;
        }
        Ok(())
    })
}

fn f32_input<'a>(t: &'a Tensor, what: &str) -> Result<&'a [f32]> {
    if t.dtype() != DType::F32 {
        bail!("BlockMatMul: {what} must be f32, found {}", t.dtype());
    }
    Ok(t.as_slice::<f32>()?)
}

fn block_matmul(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let a = ins.tensor(0)?;
    let b = ins.tensor(1)?;
    let block = ctx.node.int_req("block_size")?;
    let n = ctx.node.int_req("n")?;
    if block <= 0 || n <= 0 {
        bail!("BlockMatMul: block_size {block} and n {n} must be positive");
    }
    let (block, n) = (block as usize, n as usize);
    let x = f32_input(a, "a")?;
    let Some((&k, lead)) = a.shape().split_last() else {
        bail!("BlockMatMul: a must have at least one dimension");
    };
    if b.dtype() != DType::U8 || b.shape() != [k, blockq4::row_bytes(n)] {
        bail!(
            "BlockMatMul: b must be u8 [{k}, {}] (packed {k}x{n}), found {} {:?}",
            blockq4::row_bytes(n),
            b.dtype(),
            b.shape()
        );
    }
    if !k.is_multiple_of(block) {
        bail!("BlockMatMul: k {k} is not a multiple of block_size {block}");
    }
    let params = [k / block, n];
    let scale = f32_input(ins.tensor(2)?, "b_scale")?;
    let center = f32_input(ins.tensor(3)?, "b_center")?;
    for (t, what) in [(ins.tensor(2)?, "b_scale"), (ins.tensor(3)?, "b_center")] {
        if t.shape() != params {
            bail!(
                "BlockMatMul: {what} must be {params:?}, found {:?}",
                t.shape()
            );
        }
    }
    let bias = match ins.opt_tensor(4) {
        Some(t) if t.len() == n => Some(f32_input(t, "bias")?),
        Some(t) => bail!("BlockMatMul: bias has {} values, {n} expected", t.len()),
        None => None,
    };
    let w = Packed {
        codes: b.as_slice::<u8>()?,
        scale,
        center,
        k,
        n,
        block,
    };
    let rows: usize = lead.iter().product();
    let mut out_shape = lead.to_vec();
    out_shape.push(n);
    let mut y = crate::buffers::filled(rows * n, 0f32);
    let isa = Isa::detect();
    if rows > 0 {
        let threads = ctx.threads.max(1);
        if threads > 1 && rows >= 2 * threads && rows * k * n >= PAR_WORK {
            let per = rows.div_ceil(threads);
            y.par_chunks_mut(per * n)
                .zip(x.par_chunks(per * k))
                .try_for_each(|(yc, xc)| rows_product(isa, &w, xc, yc.len() / n, yc))?;
        } else {
            rows_product(isa, &w, x, rows, &mut y)?;
        }
        if let Some(bias) = bias {
            for row in y.chunks_mut(n) {
                for (v, b) in row.iter_mut().zip(bias) {
                    *v += b;
                }
            }
        }
    }
    Ok(vec![Value::tensor(Tensor::from_vec(out_shape, y)?)])
}

/// Packs a constant 4-bit block-quantized `[k, n]` weight for [`BLOCK_MATMUL`]: `q` int4 or
/// uint4 `[k, n]`, `scale` f32 `[k / block, n]`, `zero_point` (same dtype as `q`, same shape
/// as `scale`) optional. Returns `(b, b_center)`, or `None` for anything else.
pub fn pack_weight(
    q: &Tensor,
    scale: &Tensor,
    zero_point: Option<&Tensor>,
    block: usize,
) -> Option<(Tensor, Tensor)> {
    let &[k, n] = q.shape() else {
        return None;
    };
    if block == 0 || !k.is_multiple_of(block) || scale.shape() != [k / block, n] {
        return None;
    }
    if scale.dtype() != DType::F32 || zero_point.is_some_and(|z| z.dtype() != q.dtype()) {
        return None;
    }
    if zero_point.is_some_and(|z| z.shape() != scale.shape()) {
        return None;
    }
    // Codes as unsigned nibbles: int4 shifted by 8 (the center shifts with it).
    let (codes, shift): (Vec<u8>, i32) = match q.dtype() {
        DType::I4 => (
            q.as_slice::<i8>()
                .ok()?
                .iter()
                .map(|&v| (v as i32 + 8) as u8)
                .collect(),
            8,
        ),
        DType::U4 => (q.as_slice::<u8>().ok()?.to_vec(), 0),
        _ => return None,
    };
    let zp: Vec<i32> = match zero_point {
        None => vec![0; scale.len()],
        Some(z) if z.dtype() == DType::I4 => {
            z.as_slice::<i8>().ok()?.iter().map(|&v| v as i32).collect()
        }
        Some(z) => z.as_slice::<u8>().ok()?.iter().map(|&v| v as i32).collect(),
    };
    let packed = blockq4::pack(k, n, |r, c| codes[r * n + c]);
    let center: Vec<f32> = zp.iter().map(|&z| (z + shift) as f32).collect();
    Some((
        Tensor::from_vec(vec![k, blockq4::row_bytes(n)], packed).ok()?,
        Tensor::from_vec(vec![k / block, n], center).ok()?,
    ))
}
