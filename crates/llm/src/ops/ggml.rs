//! GGML block-quantized weights (domain `npuc`, backed by `npuc-ggml`):
//!
//! - `GgmlMatMul(X f32 [..., K], W[, bias f32 [N]][, token_count i64 [1]]) -> Y f32 [..., N]`,
//!   `Y = X · Wᵀ`; with `token_count` only that many leading rows are computed (the rest, the
//!   padding of a static-shape AR-n graph, are zero) and they round as one llama.cpp batch; with
//!   `row_start` (i64 [1]) the rows before it are zero too (an output head computing only the
//!   rows whose logits are wanted). `W` holds
//!   N rows of K elements: a u8 `[N, row_bytes]` tensor of raw GGUF blocks, or (for the plain
//!   types) an f32/f16/bf16 `[N, K]` tensor. Attributes: `ggml_type` (GgmlType name), `k`
//!   (logical row length), `act_quant` (1, the default: activations quantized like llama.cpp
//!   and its integer dot products; 2: the fast path, activations quantized the same way and
//!   multiplied by multi-row kernels; 0: exact, dequantized weights and f32 math), `batch` (1, the
//!   default: the real rows round as one llama.cpp batch; 0: each row as a product of its own),
//!   `layout` (`"x8"`: `W` is `u8 [N / 8, 8 × row_bytes]` in the interleaved eight-row layout of
//!   `npuc_ggml::repack_x8`, multiplied by its kernels; needs `act_quant` 2).
//! - `GgmlGather(W, ids i64/i32 [...]) -> f32 [..., K]`: rows of `W` dequantized exactly
//!   (embedding lookup). Attributes `ggml_type`, `k`, `layout` (`"x8"`: a tied embedding stored
//!   once in the output head's interleaved layout).

use npuc_ggml::{GgmlType, MatMulMode};
use npuc_ir::infer::rules::tt;
use npuc_ir::infer::{NodeIn, R};
use npuc_ir::opdef::{AttrDef, OpDef, Param};
use npuc_ir::{DType, Dim, Node, Tensor, TypeInfo};
use npuc_runtime::bail;
use npuc_runtime::Result;
use npuc_runtime::Value;
use npuc_runtime::{Inputs, OpCtx, Registry};

pub fn register(r: &mut Registry) {
    r.define(&GGML_MATMUL, ggml_matmul);
    r.define(&GGML_GATHER, ggml_gather);
}

/// `npuc.GgmlMatMul` (see the module docs).
pub static GGML_MATMUL: OpDef = OpDef {
    domain: "npuc",
    name: "GgmlMatMul",
    inputs: &[
        Param::required("x"),
        Param::required("w"),
        Param::optional("bias"),
        Param::optional("token_count"),
        Param::optional("row_start"),
    ],
    outputs: &[Param::required("y")],
    attrs: &[
        AttrDef::required("ggml_type", "string"),
        AttrDef::required("k", "int"),
        AttrDef::optional("act_quant", "int"),
        AttrDef::optional("batch", "int"),
        AttrDef::optional("layout", "string"),
    ],
    infer: infer_matmul,
};

/// `Y f32 [..., N]` for `X [..., K]` and `W` of N rows.
fn infer_matmul(n: &NodeIn) -> R<Vec<TypeInfo>> {
    let x8 = n.node.attr_str("layout").ok().flatten() == Some("x8");
    let dims = match (n.shape(0), n.shape(1)) {
        (Some(x), Some(w)) if !x.is_empty() && !w.is_empty() => {
            let mut d = x[..x.len() - 1].to_vec();
            d.push(match (&w[0], x8) {
                (Dim::Fixed(g), true) => Dim::Fixed(g * npuc_ggml::X8_ROWS),
                (_, true) => return Ok(vec![tt(Some(DType::F32), None)]),
                (r, false) => r.clone(),
            });
            Some(d)
        }
        _ => None,
    };
    Ok(vec![tt(Some(DType::F32), dims)])
}

/// `npuc.GgmlGather` (see the module docs).
pub static GGML_GATHER: OpDef = OpDef {
    domain: "npuc",
    name: "GgmlGather",
    inputs: &[Param::required("w"), Param::required("ids")],
    outputs: &[Param::required("y")],
    attrs: &[
        AttrDef::required("ggml_type", "string"),
        AttrDef::required("k", "int"),
        AttrDef::optional("layout", "string"),
    ],
    infer: infer_gather,
};

/// `f32 [..ids, k]`.
fn infer_gather(n: &NodeIn) -> R<Vec<TypeInfo>> {
    let k = n.int_req("k")?;
    let dims = n.shape(1).map(|ids| {
        let mut d = ids.to_vec();
        d.push(Dim::Fixed(k.max(0) as usize));
        d
    });
    Ok(vec![tt(Some(DType::F32), dims)])
}

/// The `ggml_type` and `k` attributes, validated.
fn type_and_k(n: &Node) -> Result<(GgmlType, usize)> {
    let Some(name) = n.attr_str("ggml_type")? else {
        bail!("missing attribute ggml_type");
    };
    let Some(ty) = GgmlType::from_name(name) else {
        bail!("unknown ggml_type '{name}'");
    };
    if !npuc_ggml::can_dequantize(ty) {
        bail!("ggml_type {ty} is not supported by the CPU kernels");
    }
    let Some(k) = n.attr_int("k")? else {
        bail!("missing attribute k");
    };
    if k <= 0 {
        bail!("attribute k must be positive, got {k}");
    }
    let k = k as usize;
    if ty.row_bytes(k).is_none() {
        bail!(
            "k = {k} is not a multiple of the {ty} block size {}",
            ty.block_size()
        );
    }
    Ok((ty, k))
}

/// The weight's raw bytes and its row count, checked against `ty` and `k`.
fn weight_bytes(w: &Tensor, ty: GgmlType, k: usize) -> Result<(&[u8], usize)> {
    let rb = npuc_ggml::row_bytes(ty, k).map_err(|e| npuc_runtime::RtError::msg(e.to_string()))?;
    let s = w.shape();
    if s.len() != 2 {
        bail!("weight must be 2-D [rows, row_bytes or k], got shape {s:?}");
    }
    let (bytes, width): (&[u8], usize) = match (w.dtype(), ty) {
        (DType::U8, _) => (w.as_slice::<u8>()?, rb),
        (DType::F32, GgmlType::F32) => (bytemuck::cast_slice(w.as_slice::<f32>()?), k),
        (DType::F16, GgmlType::F16) => (bytemuck::cast_slice(w.as_slice::<half::f16>()?), k),
        (DType::BF16, GgmlType::BF16) => (bytemuck::cast_slice(w.as_slice::<half::bf16>()?), k),
        (d, _) => bail!("weight of dtype {d:?} cannot hold ggml_type {ty} (expected u8 blocks)"),
    };
    if s[1] != width {
        bail!(
            "weight shape {s:?}: rows of {k} {ty} elements must be {width} wide, got {}",
            s[1]
        );
    }
    if bytes.len() != s[0] * rb {
        bail!(
            "weight holds {} bytes, expected {} ({} rows of {rb})",
            bytes.len(),
            s[0] * rb,
            s[0]
        );
    }
    Ok((bytes, s[0]))
}

/// An interleaved weight's raw bytes (`u8 [N / 8, 8 × row_bytes]`) and its row count N.
fn weight_bytes_x8(w: &Tensor, ty: GgmlType, k: usize) -> Result<(&[u8], usize)> {
    let rb = npuc_ggml::row_bytes(ty, k).map_err(|e| npuc_runtime::RtError::msg(e.to_string()))?;
    let g = npuc_ggml::X8_ROWS;
    if !npuc_ggml::supports_x8(ty) {
        bail!("ggml_type {ty} has no x8 layout (Q8_0, Q4_0, Q4_1 and Q5_0 have)");
    }
    let s = w.shape();
    if w.dtype() != DType::U8 || s.len() != 2 || s[1] != g * rb {
        bail!(
            "x8 weight must be u8 [rows / {g}, {}] ({g} rows of {k} {ty} elements), got {:?} {s:?}",
            g * rb,
            w.dtype()
        );
    }
    Ok((w.as_slice::<u8>()?, s[0] * g))
}

fn ggml_matmul(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let node = ctx.node;
    let (ty, k) = type_and_k(node)?;
    let mode = match node.int_or("act_quant", 1)? {
        0 => MatMulMode::Exact,
        1 => MatMulMode::ActQuant,
        2 => MatMulMode::Fast,
        v => bail!("attribute act_quant must be 0, 1 or 2, got {v}"),
    };
    let x8 = match node.attr_str("layout")? {
        None => false,
        Some("x8") if mode == MatMulMode::Fast => true,
        Some("x8") => bail!("layout x8 needs act_quant 2 (the fast path)"),
        Some(l) => bail!("unknown layout '{l}' (expected x8)"),
    };
    let x = ins.tensor(0)?;
    let (w, n) = if x8 {
        weight_bytes_x8(ins.tensor(1)?, ty, k)?
    } else {
        weight_bytes(ins.tensor(1)?, ty, k)?
    };
    if x.dtype() != DType::F32 {
        bail!("X must be f32, got {:?}", x.dtype());
    }
    let xs = x.shape();
    if xs.last() != Some(&k) {
        bail!("X shape {xs:?}: last dimension must be k = {k}");
    }
    let xv = x.as_slice::<f32>()?;
    let m = xv.len() / k;
    // Optional input 3: how many leading rows are real tokens; the rest (static-shape padding)
    // are left zero, and the real ones keep llama.cpp's batch rounding.
    let rows = match ins.opt_tensor(3) {
        Some(t) => {
            let v = t.to_i64_vec()?;
            match v.as_slice() {
                [c] if *c >= 0 && *c as usize <= m => *c as usize,
                _ => bail!("token_count must be one integer in 0..={m}, got {v:?}"),
            }
        }
        None => m,
    };
    // Optional input 4: the first row computed (an output head skipping the rows whose logits
    // nobody reads).
    let start = match ins.opt_tensor(4) {
        Some(t) => {
            let v = t.to_i64_vec()?;
            match v.as_slice() {
                [s] if *s >= 0 => (*s as usize).min(rows),
                _ => bail!("row_start must be one non-negative integer, got {v:?}"),
            }
        }
        None => 0,
    };
    // `batch=0`: every row rounds as a product of its own (llama.cpp's output head).
    let batch_rows = match node.int_or("batch", 1)? {
        0 => 0,
        1 => rows - start,
        v => bail!("attribute batch must be 0 or 1, got {v}"),
    };
    // Zeroed pages: rows nobody computes are never touched. When most rows are skipped (an
    // output head over a long padded call: 25 MB of which one row is written for SmolLM2's
    // ar128 head) they come from an anonymous mapping, returned to the OS when the output is
    // dropped; from the heap, glibc keeps such a block resident once its mmap threshold has
    // grown past it (measured: `npuc bench smollm2 --prompt-len 512` peak RSS 166 MB, 144 MB
    // with the threshold pinned).
    let sparse = (rows - start) * 2 < m && m * n * 4 >= SPARSE_OUTPUT_MIN_BYTES;
    let mut anon = if sparse {
        Some(
            crate::anon::zeroed(m * n * 4, false)
                .map_err(|e| npuc_runtime::RtError::msg(format!("output of {m} x {n} f32: {e}")))?,
        )
    } else {
        None
    };
    let mut heap = if sparse { vec![] } else { vec![0f32; m * n] };
    let y: &mut [f32] = match &mut anon {
        Some(a) => bytemuck::cast_slice_mut(&mut a[..]),
        None => &mut heap,
    };
    let (xin, yout) = (&xv[start * k..rows * k], &mut y[start * n..rows * n]);
    if x8 {
        npuc_ggml::matmul_x8(ty, w, n, k, xin, rows - start, yout, ctx.threads)
    } else {
        npuc_ggml::matmul_batch(
            ty,
            w,
            n,
            k,
            xin,
            rows - start,
            batch_rows,
            yout,
            mode,
            ctx.threads,
        )
    }
    .map_err(|e| npuc_runtime::RtError::msg(e.to_string()))?;
    if let Some(b) = ins.opt_tensor(2) {
        if b.dtype() != DType::F32 || b.len() != n {
            bail!(
                "bias must be f32 [{n}], got {:?} {:?}",
                b.dtype(),
                b.shape()
            );
        }
        let bv = b.as_slice::<f32>()?;
        for row in y[start * n..rows * n].chunks_exact_mut(n) {
            for (v, b) in row.iter_mut().zip(bv) {
                *v += b;
            }
        }
    }
    let mut shape = xs.to_vec();
    *shape.last_mut().expect("X has a last dimension") = n;
    let t = match anon {
        Some(a) => {
            let a = crate::anon::seal(a)
                .map_err(|e| npuc_runtime::RtError::msg(format!("output mapping: {e}")))?;
            Tensor::from_le_bytes(DType::F32, shape, a, 0, m * n * 4)?
        }
        None => Tensor::from_vec(shape, heap)?,
    };
    Ok(vec![Value::tensor(t)])
}

/// Outputs from this size on, with most rows skipped, live in an anonymous mapping.
const SPARSE_OUTPUT_MIN_BYTES: usize = 4 << 20;

fn ggml_gather(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let (ty, k) = type_and_k(ctx.node)?;
    let x8 = match ctx.node.attr_str("layout")? {
        None => false,
        Some("x8") => true,
        Some(l) => bail!("unknown layout '{l}' (expected x8)"),
    };
    let (w, _) = if x8 {
        weight_bytes_x8(ins.tensor(0)?, ty, k)?
    } else {
        weight_bytes(ins.tensor(0)?, ty, k)?
    };
    let ids_t = ins.tensor(1)?;
    let ids: Vec<i64> = match ids_t.dtype() {
        DType::I64 => ids_t.as_slice::<i64>()?.to_vec(),
        DType::I32 => ids_t.as_slice::<i32>()?.iter().map(|&v| v as i64).collect(),
        d => bail!("ids must be i64 or i32, got {d:?}"),
    };
    let mut out = vec![0f32; ids.len() * k];
    if x8 {
        npuc_ggml::gather_rows_x8(ty, w, k, &ids, &mut out)
    } else {
        npuc_ggml::gather_rows(ty, w, k, &ids, &mut out)
    }
    .map_err(|e| npuc_runtime::RtError::msg(e.to_string()))?;
    let mut shape = ids_t.shape().to_vec();
    shape.push(k);
    Ok(vec![Value::tensor(Tensor::from_vec(shape, out)?)])
}
