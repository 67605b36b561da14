//! Ops of the `npuc` domain for decoder-only language models (built by `npuc-llm`):
//!
//! - `Rope(x [N, heads, D], positions i64 [N][, freq_factors f32 [dims/2]])`: rotary position
//!   embedding, attrs `mode` ("normal": rotate adjacent pairs `(x[2i], x[2i+1])`, the layout of
//!   GGUF `llama` q/k; "neox": rotate `(x[i], x[i + dims/2])`), `base` (float), `dims` (int,
//!   rotated leading features, default D). Angle of pair i at position p:
//!   `p * base^(-2i/dims) / freq_factors[i]` (llama3 scaling is carried by the factors).
//!   With `ggml=1` the angles and rotations are rounded as ggml's CPU rope rounds them.
//! - `CachedAttention(q [N, H, D], k_new [N, KVH, D], v_new [N, KVH, D], past_k [KVH, C, D],
//!   past_v [KVH, C, D], positions i64 [N], mask f32 [N, C]) -> out f32 [N, H*D]`: attention of
//!   this call's N tokens over a KV cache of C slots. Slot p's key is `k_new[j]` when
//!   `positions[j] == p`, else `past_k[p]` (same for values), so the host only writes the new
//!   K/V into its cache after the run. `mask` is additive (0 / -inf); attr `window` (0 = none)
//!   additionally hides slots p with `positions[i] - p >= window` (sliding-window layers), attr
//!   `scale` multiplies q·k. Query head h reads KV head `h / (H / KVH)` (GQA). With f16 caches
//!   q and the new keys/values are rounded to f16 and the softmax probabilities are rounded to
//!   f16 before the product with V. With `ggml=1` the op computes what ggml's AVX2 CPU flash
//!   attention computes (llama.cpp's default): an online softmax over the slots in order with
//!   an f16 value accumulator; `prescale=1` means q was already multiplied by the scale.
//!
//! Decode calls (N = 1) only visit the slots the mask leaves visible up to the last visible
//! one, so their cost grows with the filled part of the cache, not with C; the cache is read in
//! place (never copied).

use npuc_ir::infer::rules::{dim_mul, tt};
use npuc_ir::infer::{NodeIn, R};
use npuc_ir::opdef::{AttrDef, OpDef, Param};
use npuc_ir::{f16, DType, Tensor, TypeInfo};
use npuc_runtime::bail;
use npuc_runtime::Result;
use npuc_runtime::Value;
use npuc_runtime::{Inputs, OpCtx, Registry};
use rayon::prelude::*;

/// Registers `npuc.Rope`, `npuc.CachedAttention`, `npuc.GeluF16` and `npuc.SiluGgml`.
pub fn register(r: &mut Registry) {
    r.define(&ROPE, rope);
    r.define(&CACHED_ATTENTION, cached_attention);
    r.define(&GELU_F16, gelu_f16);
    r.define(&SILU_GGML, silu_ggml);
}

/// `npuc.Rope` (see the module docs): the output has `x`'s type.
pub static ROPE: OpDef = OpDef {
    domain: "npuc",
    name: "Rope",
    inputs: &[
        Param::required("x"),
        Param::required("positions"),
        Param::optional("freq_factors"),
    ],
    outputs: &[Param::required("y")],
    attrs: &[
        AttrDef::optional("mode", "string"),
        AttrDef::optional("base", "float"),
        AttrDef::optional("dims", "int"),
        AttrDef::optional("ggml", "int"),
    ],
    infer: same_as_x,
};

/// `npuc.CachedAttention` (see the module docs): `out f32 [N, H*D]`.
pub static CACHED_ATTENTION: OpDef = OpDef {
    domain: "npuc",
    name: "CachedAttention",
    inputs: &[
        Param::required("q"),
        Param::required("k_new"),
        Param::required("v_new"),
        Param::required("past_k"),
        Param::required("past_v"),
        Param::required("positions"),
        Param::required("mask"),
    ],
    outputs: &[Param::required("out")],
    attrs: &[
        AttrDef::optional("scale", "float"),
        AttrDef::optional("window", "int"),
        AttrDef::optional("ggml", "int"),
        AttrDef::optional("prescale", "int"),
    ],
    infer: infer_attention,
};

fn infer_attention(n: &NodeIn) -> R<Vec<TypeInfo>> {
    let dims = match n.shape(0) {
        Some([t, h, d]) => Some(vec![t.clone(), dim_mul(h, d)]),
        Some(s) => return Err(format!("q must be [N, H, D], got rank {}", s.len())),
        None => None,
    };
    Ok(vec![tt(Some(DType::F32), dims)])
}

/// `npuc.GeluF16(x f32) -> f32`: tanh-approximated GELU through ggml's f16 table (see
/// [`gelu_f16_scalar`]).
pub static GELU_F16: OpDef = OpDef {
    domain: "npuc",
    name: "GeluF16",
    inputs: &[Param::required("x")],
    outputs: &[Param::required("y")],
    attrs: &[],
    infer: same_as_x,
};

fn same_as_x(n: &NodeIn) -> R<Vec<TypeInfo>> {
    Ok(vec![tt(Some(DType::F32), n.shape(0).map(|s| s.to_vec()))])
}

/// GELU (tanh form) as ggml's CPU backend evaluates it (`GGML_GELU_FP16`): a table indexed by
/// the f16-rounded input holding f16-rounded outputs of the f32 formula, with the input
/// clamped to 0 below -10 and passed through above 10.
fn gelu_f16_scalar(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const GELU_COEF_A: f32 = 0.044715;
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    let v = r16(x);
    // ggml's table is built by C compiled with FP contraction, which fuses `1 + a*x*x`.
    let inner = (GELU_COEF_A * v).mul_add(v, 1.0);
    r16(0.5 * v * (1.0 + (SQRT_2_OVER_PI * v * inner).tanh()))
}

/// `npuc.GeluF16(x f32) -> f32`: see [`gelu_f16_scalar`]. The 65,536-entry table is built once.
fn gelu_f16(_ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| gelu_f16_scalar(f16::from_bits(b).to_f32()))
            .collect()
    });
    let mut x = ins.take_tensor(0)?;
    if x.dtype() != DType::F32 {
        bail!("x must be f32, got {}", x.dtype());
    }
    for v in x.as_mut_slice::<f32>()? {
        *v = if *v <= -10.0 {
            0.0
        } else if *v >= 10.0 {
            *v
        } else {
            table[f16::from_f32(*v).to_bits() as usize]
        };
    }
    Ok(vec![Value::tensor(x)])
}

/// `npuc.SiluGgml(x f32 [.., n]) -> f32`: SiLU as ggml's AVX2 CPU backend evaluates it in
/// `ggml_vec_swiglu_f32` (the llama/qwen2 FFN): `x / (1 + e)` with `e` from its vector
/// `ggml_v_expf(-x)` for each full group of eight values of a row, and libm's `expf` for the
/// row's last `n % 8` values.
pub static SILU_GGML: OpDef = OpDef {
    domain: "npuc",
    name: "SiluGgml",
    inputs: &[Param::required("x")],
    outputs: &[Param::required("y")],
    attrs: &[],
    infer: same_as_x,
};

/// One lane of ggml's `ggml_v_expf` (AVX2 + FMA form; `f32::mul_add` is the lane's fused
/// multiply-add, so the result is bit-identical).
fn ggml_v_expf(x: f32) -> f32 {
    let c = |b: u32| f32::from_bits(b);
    let r = c(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    // _mm256_fnmadd_ps(a, b, c) = c - a * b, fused.
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)));
    let j = j.mul_add(u, c(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return k.mul_add(j, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// `npuc.SiluGgml`: see [`SILU_GGML`].
fn silu_ggml(_ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let mut x = ins.take_tensor(0)?;
    if x.dtype() != DType::F32 {
        bail!("x must be f32, got {}", x.dtype());
    }
    let n = x.shape().last().copied().unwrap_or(1).max(1);
    for row in x.as_mut_slice::<f32>()?.chunks_mut(n) {
        let full = row.len() / 8 * 8;
        let (vec, tail) = row.split_at_mut(full);
        for v in vec {
            *v /= 1.0 + ggml_v_expf(0.0 - *v);
        }
        for v in tail {
            *v /= 1.0 + (-*v).exp();
        }
    }
    Ok(vec![Value::tensor(x)])
}

/// Rotation angles (cos, sin) of `half` pairs at `pos`, computed in f64 so that both
/// transformers' and ggml's f32 formulas are matched to well below f32 rounding of the result.
fn rope_angles(pos: i64, base: f64, dims: usize, factors: Option<&[f32]>, cs: &mut [(f32, f32)]) {
    for (i, c) in cs.iter_mut().enumerate() {
        let mut theta = pos as f64 * base.powf(-2.0 * i as f64 / dims as f64);
        if let Some(f) = factors {
            theta /= f[i] as f64;
        }
        *c = (theta.cos() as f32, theta.sin() as f32);
    }
}

/// The last angle table this thread computed: its key (positions, base bits, dims, factors) and
/// `(cos, sin)` of each position's `dims / 2` pairs.
type AngleTable = (
    Vec<i64>,
    u64,
    usize,
    Option<Vec<f32>>,
    std::rc::Rc<Vec<(f32, f32)>>,
);

thread_local! {
    static ANGLES: std::cell::RefCell<Option<AngleTable>> = const { std::cell::RefCell::new(None) };
}

/// [`rope_angles`] of every position in `pos`, `[pos.len()][dims / 2]`, from this thread's memo
/// when the last call asked for the same table.
fn angle_table(
    pos: &[i64],
    base: f64,
    dims: usize,
    factors: Option<&[f32]>,
) -> std::rc::Rc<Vec<(f32, f32)>> {
    ANGLES.with(|memo| {
        let mut memo = memo.borrow_mut();
        if let Some((p, b, d, f, table)) = memo.as_ref() {
            if p == pos && *b == base.to_bits() && *d == dims && f.as_deref() == factors {
                return table.clone();
            }
        }
        let half = dims / 2;
        let mut table = vec![(0f32, 0f32); pos.len() * half];
        for (cs, &p) in table.chunks_exact_mut(half.max(1)).zip(pos) {
            rope_angles(p, base, dims, factors, cs);
        }
        let table = std::rc::Rc::new(table);
        *memo = Some((
            pos.to_vec(),
            base.to_bits(),
            dims,
            factors.map(|f| f.to_vec()),
            table.clone(),
        ));
        table
    })
}

/// Rotation angles as ggml's CPU rope computes them (attr `ggml=1`, the fast path that mirrors
/// llama.cpp): `theta_scale = powf(base, -2/dims)` and the angle of pair i advanced by one f32
/// multiplication per pair, `cosf`/`sinf` of `theta / factor` in f32.
fn rope_angles_ggml(
    pos: i64,
    base: f32,
    dims: usize,
    factors: Option<&[f32]>,
    cs: &mut [(f32, f32)],
) {
    let theta_scale = base.powf(-2.0 / dims as f32);
    let mut theta = pos as f32;
    for (i, c) in cs.iter_mut().enumerate() {
        let t = match factors {
            Some(f) => theta / f[i],
            None => theta,
        };
        *c = (t.cos(), t.sin());
        theta *= theta_scale;
    }
}

fn rope(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let mode = ctx.node.str_or("mode", "neox")?.to_string();
    let neox = match mode.as_str() {
        "neox" => true,
        "normal" => false,
        m => bail!("unknown rope mode '{m}' (expected normal or neox)"),
    };
    let base = ctx.node.float_or("base", 10000.0)? as f64;
    let pos = ins.tensor(1)?.to_i64_vec()?;
    let factors = match ins.opt_tensor(2) {
        Some(t) => Some(t.as_slice::<f32>()?.to_vec()),
        None => None,
    };
    let mut x = ins.take_tensor(0)?;
    if x.dtype() != DType::F32 {
        bail!("x must be f32, got {}", x.dtype());
    }
    let [n, heads, d] = *x.shape() else {
        bail!("x must be [N, heads, D], got {:?}", x.shape());
    };
    let dims = ctx.node.int_or("dims", d as i64)?;
    if dims <= 0 || dims as usize > d || dims % 2 != 0 {
        bail!("dims {dims} must be even, positive and at most the head size {d}");
    }
    let dims = dims as usize;
    let half = dims / 2;
    if pos.len() != n {
        bail!("positions has {} entries for {n} tokens", pos.len());
    }
    if let Some(f) = &factors {
        if f.len() != half {
            bail!(
                "freq_factors has {} entries, expected dims/2 = {half}",
                f.len()
            );
        }
        if f.iter()
            .any(|&v| v.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater))
        {
            bail!("freq_factors must be positive");
        }
    }
    let ggml = ctx.node.int_or("ggml", 0)? != 0;
    let xs = x.as_mut_slice::<f32>()?;
    let mut cs = vec![(0f32, 0f32); half];
    // Every layer's q and k rotate by the same angles: the table of this call's positions is
    // computed once and reused while the positions and parameters stay the same.
    let table = if ggml {
        std::rc::Rc::new(Vec::new())
    } else {
        angle_table(&pos, base, dims, factors.as_deref())
    };
    for (t, &p) in pos.iter().enumerate() {
        if ggml {
            rope_angles_ggml(p, base as f32, dims, factors.as_deref(), &mut cs);
            for h in 0..heads {
                let row = &mut xs[(t * heads + h) * d..(t * heads + h + 1) * d];
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = if neox {
                        (i, i + half)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (x0, x1) = (row[a], row[b]);
                    // ggml's C is compiled with FP contraction: each output is one FMA
                    // over the other product.
                    row[a] = x0.mul_add(c, -(x1 * s));
                    row[b] = x0.mul_add(s, x1 * c);
                }
            }
            continue;
        }
        let cs = &table[t * half..(t + 1) * half];
        for h in 0..heads {
            let row = &mut xs[(t * heads + h) * d..(t * heads + h + 1) * d];
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = if neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (row[a], row[b]);
                row[a] = x0 * c - x1 * s;
                row[b] = x0 * s + x1 * c;
            }
        }
    }
    Ok(vec![Value::tensor(x)])
}

/// A cache (past keys or values) as f32 or f16 rows.
enum Cache<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl<'a> Cache<'a> {
    fn of(t: &'a Tensor) -> Result<Cache<'a>> {
        Ok(match t.dtype() {
            DType::F32 => Cache::F32(t.as_slice::<f32>()?),
            DType::F16 => Cache::F16(t.as_slice::<f16>()?),
            d => bail!("KV cache must be f32 or f16, got {d}"),
        })
    }
}

/// `a · b` in the order of ggml's AVX2 `ggml_vec_dot_f16` / `ggml_vec_dot_f32` (the dot
/// product of its flash-attention loop): four 8-lane FMA accumulators over 32-element steps
/// (element `i` goes to accumulator `(i % 32) / 8`, lane `i % 8`), reduced as its
/// `GGML_F32x8_REDUCE` does (accumulators pairwise, then the two 128-bit halves, then two
/// horizontal adds), the remainder added in f64.
#[inline]
fn dot_ggml(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    let n = a.len() / 32 * 32;
    for (x, y) in a[..n].chunks_exact(32).zip(b[..n].chunks_exact(32)) {
        for (j, acc) in acc.iter_mut().enumerate() {
            for (l, s) in acc.iter_mut().enumerate() {
                *s = x[8 * j + l].mul_add(y[8 * j + l], *s);
            }
        }
    }
    let mut x0 = [0f32; 8];
    for l in 0..8 {
        let x02 = acc[0][l] + acc[2][l];
        let x13 = acc[1][l] + acc[3][l];
        x0[l] = x02 + x13;
    }
    let t0 = [x0[0] + x0[4], x0[1] + x0[5], x0[2] + x0[6], x0[3] + x0[7]];
    let mut sum = ((t0[0] + t0[1]) + (t0[2] + t0[3])) as f64;
    for (x, y) in a[n..].iter().zip(&b[n..]) {
        sum += (x * y) as f64;
    }
    sum as f32
}

/// Rounds through f16 (what storing into an f16 cache does).
#[inline]
fn r16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Per-task buffers of [`cached_attention`]: scores (or, in ggml mode, one converted value
/// row), the f16-rounded query, and one converted key row.
type Scratch = (Vec<f32>, Vec<f32>, Vec<f32>);

fn cached_attention(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let q = ins.tensor(0)?;
    let kn = ins.tensor(1)?;
    let vn = ins.tensor(2)?;
    let pk = ins.tensor(3)?;
    let pv = ins.tensor(4)?;
    let positions = ins.tensor(5)?.to_i64_vec()?;
    let mask_t = ins.tensor(6)?;
    let scale = ctx.node.float_or("scale", 0.0)?;
    let window = ctx.node.int_or("window", 0)?;
    // `ggml=1`: ggml's CPU flash attention on AVX2 (llama.cpp's default; exact parity for the
    // rows it runs through its one-row path, i.e. calls of fewer than 64 tokens);
    // `prescale=1`: q is multiplied by `scale` before the dot products (and rounded to f16
    // after it), as llama.cpp's gemma3 graph scales Q instead of the scores.
    let ggml = ctx.node.int_or("ggml", 0)? != 0;
    let prescale = ctx.node.int_or("prescale", 0)? != 0;
    let [n, h, d] = *q.shape() else {
        bail!("q must be [N, H, D], got {:?}", q.shape());
    };
    let [n2, kvh, d2] = *kn.shape() else {
        bail!("k_new must be [N, KVH, D], got {:?}", kn.shape());
    };
    if n2 != n || d2 != d || vn.shape() != kn.shape() {
        bail!(
            "k_new {:?} / v_new {:?} do not match q {:?}",
            kn.shape(),
            vn.shape(),
            q.shape()
        );
    }
    if kvh == 0 || h % kvh != 0 {
        bail!("{h} query heads are not a multiple of {kvh} KV heads");
    }
    let [kvh2, c, d3] = *pk.shape() else {
        bail!("past_k must be [KVH, C, D], got {:?}", pk.shape());
    };
    if kvh2 != kvh || d3 != d || pv.shape() != pk.shape() || pv.dtype() != pk.dtype() {
        bail!(
            "past_k {:?} {} / past_v {:?} {} do not match [KVH={kvh}, C, D={d}]",
            pk.shape(),
            pk.dtype(),
            pv.shape(),
            pv.dtype()
        );
    }
    if positions.len() != n {
        bail!("positions has {} entries for {n} tokens", positions.len());
    }
    if mask_t.shape() != [n, c] {
        bail!("mask must be [N={n}, C={c}], got {:?}", mask_t.shape());
    }
    let mask = mask_t.as_slice::<f32>()?;
    let (qs, kns, vns) = (
        q.as_slice::<f32>()?,
        kn.as_slice::<f32>()?,
        vn.as_slice::<f32>()?,
    );
    let (pk, pv) = (Cache::of(pk)?, Cache::of(pv)?);
    let half = matches!(pk, Cache::F16(_));
    // Which of this call's tokens writes each slot (the last one wins, like the host's write).
    let mut src = vec![u32::MAX; c];
    for (j, &p) in positions.iter().enumerate() {
        if p < 0 || p as usize >= c {
            bail!("position {p} of token {j} is outside the cache of {c} slots");
        }
        src[p as usize] = j as u32;
    }
    let scale = if scale == 0.0 {
        1.0 / (d as f32).sqrt()
    } else {
        scale
    };
    let group = h / kvh;
    if !ggml {
        let mut out = vec![0f32; n * h * d];
        let a = AttnArgs {
            n,
            h,
            kvh,
            d,
            c,
            qs,
            kns,
            vns,
            pk: &pk,
            pv: &pv,
            src: &src,
            positions: &positions,
            mask,
            scale,
            window,
            half,
            threads: ctx.threads,
        };
        attention_f32(&a, &mut out)?;
        return Ok(vec![Value::tensor(Tensor::from_vec(vec![n, h * d], out)?)]);
    }
    let mut out = vec![0f32; n * h * d];
    // One task per (token, head): a disjoint D-slice of the output.
    let task = |(idx, o): (usize, &mut [f32]), scratch: &mut Scratch| {
        let (i, hh) = (idx / h, idx % h);
        let g = hh / group;
        let (scores, qrow, row) = scratch;
        let mrow = &mask[i * c..(i + 1) * c];
        // Slots past the last visible one are never read.
        let end = mrow
            .iter()
            .rposition(|m| *m != f32::NEG_INFINITY)
            .map_or(0, |p| p + 1);
        qrow.clear();
        qrow.extend_from_slice(&qs[(i * h + hh) * d..(i * h + hh + 1) * d]);
        if prescale {
            qrow.iter_mut().for_each(|v| *v *= scale);
        }
        if half {
            qrow.iter_mut().for_each(|v| *v = r16(*v));
        }
        row.resize(d, 0.0);
        // ggml's CPU flash attention (what llama.cpp runs by default), one query row at a
        // time: slots in order, masked ones skipped; an online softmax with libm `expf`
        // (Rust's f32::exp calls the same function); the value accumulator rescaled when
        // the maximum grows and kept in the cache's precision (f16: rounded after every
        // FMA), the sum updated with one FMA; one f32 reciprocal at the end.
        let key = |p: usize, row: &mut Vec<f32>| {
            if src[p] != u32::MAX {
                let j = src[p] as usize;
                let k = &kns[(j * kvh + g) * d..(j * kvh + g + 1) * d];
                row.clear();
                row.extend(k.iter().map(|&v| if half { r16(v) } else { v }));
            } else {
                let off = (g * c + p) * d;
                row.clear();
                match pk {
                    Cache::F32(s) => row.extend_from_slice(&s[off..off + d]),
                    Cache::F16(s) => row.extend(s[off..off + d].iter().map(|v| v.to_f32())),
                }
            }
        };
        let round = |v: f32| if half { r16(v) } else { v };
        let mut vrow = std::mem::take(scores);
        let (mut big_s, mut big_m) = (0f32, f32::NEG_INFINITY);
        o.iter_mut().for_each(|v| *v = 0.0);
        for (p, &m) in mrow[..end].iter().enumerate() {
            if m == f32::NEG_INFINITY || (window > 0 && positions[i] - p as i64 >= window) {
                continue;
            }
            key(p, row);
            let mut sc = dot_ggml(row, qrow);
            if !prescale {
                sc *= scale;
            }
            sc += m;
            let (mut ms, mut vs) = (1f32, 1f32);
            if sc > big_m {
                let old = big_m;
                big_m = sc;
                ms = (old - big_m).exp();
                o.iter_mut().for_each(|v| *v = round(*v * ms));
            } else {
                vs = (sc - big_m).exp();
            }
            vrow.clear();
            if src[p] != u32::MAX {
                let j = src[p] as usize;
                let v = &vns[(j * kvh + g) * d..(j * kvh + g + 1) * d];
                vrow.extend(v.iter().map(|&x| round(x)));
            } else {
                let off = (g * c + p) * d;
                match pv {
                    Cache::F32(s) => vrow.extend_from_slice(&s[off..off + d]),
                    Cache::F16(s) => vrow.extend(s[off..off + d].iter().map(|v| v.to_f32())),
                }
            }
            for (acc, &x) in o.iter_mut().zip(vrow.iter()) {
                *acc = round(x.mul_add(vs, *acc));
            }
            big_s = big_s.mul_add(ms, vs);
        }
        let inv = if big_s == 0.0 { 0.0 } else { 1.0 / big_s };
        o.iter_mut().for_each(|v| *v *= inv);
        *scores = vrow;
    };
    let work = n * h * d * mask.len().max(1) / n.max(1);
    if ctx.threads > 1 && n * h > 1 && work > 1 << 16 {
        out.par_chunks_mut(d)
            .enumerate()
            .for_each_init(Scratch::default, |s, t| task(t, s));
    } else {
        let mut s = Scratch::default();
        for t in out.chunks_mut(d).enumerate() {
            task(t, &mut s);
        }
    }
    Ok(vec![Value::tensor(Tensor::from_vec(vec![n, h * d], out)?)])
}

/// The inputs of [`attention_f32`], validated by [`cached_attention`].
struct AttnArgs<'a> {
    n: usize,
    h: usize,
    kvh: usize,
    d: usize,
    c: usize,
    qs: &'a [f32],
    kns: &'a [f32],
    vns: &'a [f32],
    pk: &'a Cache<'a>,
    pv: &'a Cache<'a>,
    /// Which of this call's tokens writes each slot (`u32::MAX`: the cache's entry).
    src: &'a [u32],
    positions: &'a [i64],
    mask: &'a [f32],
    scale: f32,
    window: i64,
    /// f16 caches: this call's keys and values are rounded to f16, as the cache will hold them.
    half: bool,
    threads: usize,
}

/// Attention with f32 arithmetic through `npuc-ggml`'s vector kernels (AVX2 when the CPU has
/// it): the visible keys and values of each KV head are converted to f32 once per call (not
/// once per query head and token), then each (token, head) computes all its scores with one
/// `dot_rows`, a softmax (f64 sum, one reciprocal) and one `weighted_sum` of the value rows.
fn attention_f32(a: &AttnArgs, out: &mut [f32]) -> Result<()> {
    let (n, h, kvh, d, c) = (a.n, a.h, a.kvh, a.d, a.c);
    // Visible range of each row: the mask's first and last visible slot (window included).
    let span = |i: usize| -> (usize, usize) {
        let mrow = &a.mask[i * c..(i + 1) * c];
        let end = mrow
            .iter()
            .rposition(|m| *m != f32::NEG_INFINITY)
            .map_or(0, |p| p + 1);
        let mut lo = mrow[..end]
            .iter()
            .position(|m| *m != f32::NEG_INFINITY)
            .unwrap_or(end);
        if a.window > 0 {
            let first = a.positions[i] - a.window + 1;
            lo = lo.max(first.clamp(0, end as i64) as usize);
        }
        (lo, end)
    };
    let spans: Vec<(usize, usize)> = (0..n).map(span).collect();
    let end_max = spans.iter().map(|s| s.1).max().unwrap_or(0);
    // f32 keys and values [KVH, end_max, D].
    let mut kf = vec![0f32; kvh * end_max * d];
    let mut vf = vec![0f32; kvh * end_max * d];
    let fill = |dst: &mut [f32], new: &[f32], cache: &Cache, g: usize| {
        for (p, row) in dst.chunks_exact_mut(d).enumerate() {
            if a.src[p] != u32::MAX {
                let j = a.src[p] as usize;
                let nr = &new[(j * kvh + g) * d..(j * kvh + g + 1) * d];
                if a.half {
                    npuc_ggml::round_f16_row(nr, row);
                } else {
                    row.copy_from_slice(nr);
                }
            } else {
                let off = (g * c + p) * d;
                match cache {
                    Cache::F32(s) => row.copy_from_slice(&s[off..off + d]),
                    Cache::F16(s) => {
                        npuc_ggml::f16_to_f32_row(bytemuck::cast_slice(&s[off..off + d]), row)
                    }
                }
            }
        }
    };
    if end_max > 0 {
        for g in 0..kvh {
            let r = g * end_max * d..(g + 1) * end_max * d;
            fill(&mut kf[r.clone()], a.kns, a.pk, g);
            fill(&mut vf[r], a.vns, a.pv, g);
        }
    }
    let group = h / kvh;
    if n * group >= BATCHED_ATTENTION_ROWS && end_max > 0 {
        return attention_batched(a, &spans, end_max, &kf, &vf, out);
    }
    let task = |(idx, o): (usize, &mut [f32]), scores: &mut Vec<f32>| {
        let (i, hh) = (idx / h, idx % h);
        let g = hh / group;
        let (lo, end) = spans[i];
        o.iter_mut().for_each(|v| *v = 0.0);
        if lo >= end {
            return; // nothing visible (cannot happen with a well-formed mask)
        }
        let q = &a.qs[(i * h + hh) * d..(i * h + hh + 1) * d];
        let keys = &kf[(g * end_max + lo) * d..(g * end_max + end) * d];
        let vals = &vf[(g * end_max + lo) * d..(g * end_max + end) * d];
        scores.resize(end - lo, 0.0);
        npuc_ggml::dot_rows(keys, q, scores);
        let mrow = &a.mask[i * c + lo..i * c + end];
        let mut maxv = f32::NEG_INFINITY;
        for (s, &m) in scores.iter_mut().zip(mrow) {
            // `prescale` (q scaled before the product) is the same scores up to rounding.
            *s = *s * a.scale + m;
            maxv = maxv.max(*s);
        }
        if maxv == f32::NEG_INFINITY {
            return;
        }
        softmax_from_max(scores, maxv);
        npuc_ggml::weighted_sum(scores, vals, o);
    };
    let work = n * h * d * end_max;
    // A few (token, head) pairs per task, on the kernels' warm pool (one thread for small calls).
    let threads = if n * h > 1 && work > 1 << 16 {
        a.threads
    } else {
        1
    };
    let per = (n * h).div_ceil(threads * 4).max(1);
    npuc_ggml::parallel_chunks_mut(out, per * d, threads, &|c, o| {
        let mut s = Vec::new();
        for (k, od) in o.chunks_mut(d).enumerate() {
            task((c * per + k, od), &mut s);
        }
    });
    Ok(())
}

fn ggml_err(e: npuc_ggml::Error) -> npuc_runtime::RtError {
    npuc_runtime::RtError::msg(e.to_string())
}

/// Scores (masked ones -inf, `maxv` their maximum, finite) to probabilities in place: f64 sum,
/// one reciprocal.
fn softmax_from_max(scores: &mut [f32], maxv: f32) {
    let mut sum = 0f64;
    for s in scores.iter_mut() {
        let e = if *s == f32::NEG_INFINITY {
            0.0
        } else {
            (*s - maxv).exp()
        };
        *s = e;
        sum += e as f64;
    }
    let inv = (1.0 / sum) as f32;
    scores.iter_mut().for_each(|s| *s *= inv);
}

/// From this many (token, head) rows per KV head on, attention runs as two f32 matrix products
/// per KV head (scores, then values) on `npuc-ggml`'s GEMM instead of one vector product per row.
const BATCHED_ATTENTION_ROWS: usize = 16;

/// [`attention_f32`] for prefill: per KV head, the query rows of its heads (all tokens) times the
/// visible keys as one product `S = Q · Kᵀ`, the masked softmax of each row, then `O = P · V`
/// (values transposed once). Keys outside a row's visible range get probability 0.
fn attention_batched(
    a: &AttnArgs,
    spans: &[(usize, usize)],
    end_max: usize,
    kf: &[f32],
    vf: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let lo_min = spans.iter().map(|s| s.0).min().unwrap_or(0).min(end_max);
    let len = end_max - lo_min;
    out.iter_mut().for_each(|v| *v = 0.0);
    if len == 0 {
        return Ok(());
    }
    // This thread's reusable buffers: no megabyte allocation and zeroing per call. (An error
    // below drops them; the next call starts with empty ones.)
    let mut bufs = ATTN_BUFS.take();
    let [qg, scores, vt, og] = &mut bufs;
    let (n, h, kvh, d, c) = (a.n, a.h, a.kvh, a.d, a.c);
    let group = h / kvh;
    let m = n * group;
    let threads = a.threads.max(1);
    qg.resize(m * d, 0.0);
    scores.resize(m * len, 0.0);
    vt.resize(d * len, 0.0);
    og.resize(m * d, 0.0);
    for g in 0..kvh {
        // Row r = i * group + j is token i, head g * group + j.
        for (r, dst) in qg.chunks_exact_mut(d).enumerate() {
            let (i, hh) = (r / group, g * group + r % group);
            dst.copy_from_slice(&a.qs[(i * h + hh) * d..(i * h + hh + 1) * d]);
        }
        let keys = &kf[(g * end_max + lo_min) * d..(g * end_max + end_max) * d];
        let vals = &vf[(g * end_max + lo_min) * d..(g * end_max + end_max) * d];
        npuc_ggml::matmul_f32(keys, len, d, qg, m, scores, threads).map_err(ggml_err)?;
        // Masked softmax per row, in place: probabilities, 0 outside the row's visible keys.
        let rows_per = m.div_ceil(threads * 4).max(1);
        npuc_ggml::parallel_chunks_mut(scores, rows_per * len, threads, &|t, rows| {
            for (dr, row) in rows.chunks_exact_mut(len).enumerate() {
                let i = (t * rows_per + dr) / group;
                let (lo, end) = spans[i];
                let mrow = &a.mask[i * c..(i + 1) * c];
                let mut maxv = f32::NEG_INFINITY;
                for (t, s) in row.iter_mut().enumerate() {
                    let p = lo_min + t;
                    *s = if p < lo || p >= end {
                        f32::NEG_INFINITY
                    } else {
                        *s * a.scale + mrow[p]
                    };
                    maxv = maxv.max(*s);
                }
                if maxv == f32::NEG_INFINITY {
                    row.iter_mut().for_each(|s| *s = 0.0);
                    continue;
                }
                softmax_from_max(row, maxv);
            }
        });
        for (t, vr) in vals.chunks_exact(d).enumerate() {
            for (dd, &v) in vr.iter().enumerate() {
                vt[dd * len + t] = v;
            }
        }
        npuc_ggml::matmul_f32(vt, d, len, scores, m, og, threads).map_err(ggml_err)?;
        for (r, src) in og.chunks_exact(d).enumerate() {
            let (i, hh) = (r / group, g * group + r % group);
            out[(i * h + hh) * d..(i * h + hh + 1) * d].copy_from_slice(src);
        }
    }
    ATTN_BUFS.set(bufs);
    Ok(())
}

thread_local! {
    /// Buffers of [`attention_batched`] on this thread: query rows, scores, transposed values,
    /// outputs (grown, never shrunk).
    static ATTN_BUFS: std::cell::Cell<[Vec<f32>; 4]> = const {
        std::cell::Cell::new([Vec::new(), Vec::new(), Vec::new(), Vec::new()])
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive attention over an explicit key/value list, the reference for the op.
    #[allow(dead_code)]
    fn naive(q: &[f32], keys: &[Vec<f32>], vals: &[Vec<f32>], scale: f32) -> Vec<f32> {
        let s: Vec<f32> = keys
            .iter()
            .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale)
            .collect();
        let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s.iter().map(|v| (v - m).exp()).collect();
        let z: f32 = e.iter().sum();
        let mut o = vec![0f32; q.len()];
        for (w, v) in e.iter().zip(vals) {
            for (a, b) in o.iter_mut().zip(v) {
                *a += w / z * b;
            }
        }
        o
    }

    #[test]
    fn dot_ggml_matches_naive() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let r: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot_ggml(&a, &b) - r).abs() < 1e-5);
    }

    #[test]
    fn rope_angles_match_formula() {
        let mut cs = vec![(0f32, 0f32); 4];
        rope_angles(3, 10000.0, 8, Some(&[1.0, 2.0, 1.0, 1.0]), &mut cs);
        let th1 = 3.0 * 10000f64.powf(-2.0 / 8.0) / 2.0;
        assert!((cs[1].0 as f64 - th1.cos()).abs() < 1e-7);
        assert!((cs[0].1 as f64 - 3f64.sin()).abs() < 1e-7);
    }
}
