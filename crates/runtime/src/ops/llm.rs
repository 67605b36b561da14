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
//!   the op mirrors ggml's CPU path: q and the new keys/values are rounded to f16, the softmax
//!   probabilities are rounded to f16 before the product with V, sums are f32.
//!
//! Decode calls (N = 1) only visit the slots the mask leaves visible up to the last visible
//! one, so their cost grows with the filled part of the cache, not with C; the cache is read in
//! place (never copied).

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::value::Value;
use npuc_ir::{f16, DType, Tensor};
use rayon::prelude::*;

/// Registers `npuc.Rope` and `npuc.CachedAttention`.
pub fn register(r: &mut Registry) {
    r.add_range("npuc", "Rope", 1, 1, rope);
    r.add_range("npuc", "CachedAttention", 1, 1, cached_attention);
    r.add_range("npuc", "GeluF16", 1, 1, gelu_f16);
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
        rope_angles(p, base, dims, factors.as_deref(), &mut cs);
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

/// `a · b` with 8 independent accumulators (vectorises; f32 sums like ggml's CPU dot).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((a, &xv), &yv) in acc.iter_mut().zip(x).zip(y) {
            *a = xv.mul_add(yv, *a);
        }
    }
    let mut s = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        s = x.mul_add(*y, s);
    }
    hsum8(&acc) + s
}

/// Horizontal sum of 8 lanes in the order of an AVX `extract + movehl + movehdup` reduction
/// (what ggml's tinyBLAS does after its FMA loop): `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline]
fn hsum8(a: &[f32; 8]) -> f32 {
    let t = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// `out += w * v`.
#[inline]
fn axpy(out: &mut [f32], w: f32, v: &[f32]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o = w.mul_add(x, *o);
    }
}

/// `exp(x)` as ggml's AVX2 softmax evaluates it (its vectorised `ggml_v_expf`): a rounding
/// to the nearest multiple of ln 2 (`n`), a two-part Cody-Waite reduction and a degree-5
/// polynomial, scaled by `2^n` built in the exponent bits; large `|n|` are split into two
/// factors so that the result underflows/overflows like the C code. Every step is one f32
/// operation or FMA in the same order, so the result is bit-identical.
fn ggml_expf(x: f32) -> f32 {
    let shifter = f32::from_bits(0x4b40_0000); // 1.5 * 2^23
    let log2e = f32::from_bits(0x3fb8_aa3b);
    let ln2_hi = f32::from_bits(0x3f31_7200);
    let ln2_lo = f32::from_bits(0x35bf_be8e);
    let c = [
        f32::from_bits(0x3f7f_fff6), // ~1
        f32::from_bits(0x3eff_fedb), // ~1/2
        f32::from_bits(0x3e2a_af33), // ~1/6
        f32::from_bits(0x3d2b_9f17), // ~1/24
        f32::from_bits(0x3c07_2010), // ~1/120
    ];
    let z = x.mul_add(log2e, shifter);
    let n = z - shifter;
    let b = (-n).mul_add(ln2_lo, (-n).mul_add(ln2_hi, x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = c[4]
        .mul_add(b, c[3])
        .mul_add(u, c[2].mul_add(b, c[1]))
        .mul_add(u, c[0] * b);
    // A NaN `n` compares false in C and takes this branch too.
    if n.abs().partial_cmp(&126.0) != Some(std::cmp::Ordering::Greater) {
        return j.mul_add(k, k);
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

/// Sums 64 lane accumulators (8 vectors of 8, vector j holding elements `8j..8j+8` of every
/// 64-element step) like ggml's AVX2 `ggml_vec_dot_f16`: vectors pairwise (j + 4, j + 2,
/// j + 1), then the 8 lanes.
#[inline]
fn reduce64(acc: &mut [f32; 64]) -> f32 {
    for half in [32, 16, 8] {
        for i in 0..half {
            acc[i] += acc[i + half];
        }
    }
    let mut l = [0f32; 8];
    l.copy_from_slice(&acc[..8]);
    hsum8(&l)
}

/// `a · b` in the order of ggml's AVX2 `ggml_vec_dot_f16` (what a single-token f16 product
/// runs): 64 FMA accumulators over 64-element steps, the remainder summed in f64.
#[inline]
fn dot_vd(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 64];
    let n = a.len() / 64 * 64;
    for (x, y) in a[..n].chunks_exact(64).zip(b[..n].chunks_exact(64)) {
        for ((s, &xv), &yv) in acc.iter_mut().zip(x).zip(y) {
            *s = xv.mul_add(yv, *s);
        }
    }
    let mut sum = reduce64(&mut acc) as f64;
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

/// Per-task buffers of [`cached_attention`]: scores, the f16-rounded query, one converted key
/// row, and the lane accumulators of the f16 value product.
type Scratch = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<[f32; 64]>);

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
    // `ggml=1`: softmax exps and sums as ggml's AVX2 code computes them (llama.cpp parity);
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
    let mut out = vec![0f32; n * h * d];
    // One task per (token, head): a disjoint D-slice of the output.
    let task = |(idx, o): (usize, &mut [f32]), scratch: &mut Scratch| {
        let (i, hh) = (idx / h, idx % h);
        let g = hh / group;
        let (scores, qrow, row, lanes) = scratch;
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
        scores.clear();
        scores.resize(end, f32::NEG_INFINITY);
        let pi = positions[i];
        let mut maxv = f32::NEG_INFINITY;
        for (p, &m) in mrow[..end].iter().enumerate() {
            if m == f32::NEG_INFINITY || (window > 0 && pi - p as i64 >= window) {
                continue;
            }
            let kr: &[f32] = if src[p] != u32::MAX {
                let j = src[p] as usize;
                let k = &kns[(j * kvh + g) * d..(j * kvh + g + 1) * d];
                if half {
                    row.iter_mut().zip(k).for_each(|(r, v)| *r = r16(*v));
                    row
                } else {
                    k
                }
            } else {
                let off = (g * c + p) * d;
                match pk {
                    Cache::F32(s) => &s[off..off + d],
                    Cache::F16(s) => {
                        row.iter_mut()
                            .zip(&s[off..off + d])
                            .for_each(|(r, v)| *r = v.to_f32());
                        row
                    }
                }
            };
            // ggml multiplies a single token with its vec_dot, a batch with tinyBLAS.
            let qk = if half && n == 1 {
                dot_vd(qrow, kr)
            } else {
                dot(qrow, kr)
            };
            let sc = if prescale { qk + m } else { qk * scale + m };
            scores[p] = sc;
            maxv = maxv.max(sc);
        }
        o.iter_mut().for_each(|v| *v = 0.0);
        if maxv == f32::NEG_INFINITY {
            return; // nothing visible (cannot happen with a well-formed mask)
        }
        // Sum in f64 and one f32 reciprocal, as ggml's soft_max does; in ggml mode also its
        // exp and its per-8-slot f32 partial sums.
        let mut sum = 0f64;
        if ggml {
            for chunk in scores.chunks_mut(8) {
                let mut part = [0f32; 8];
                for (s, p) in chunk.iter_mut().zip(part.iter_mut()) {
                    *s = if *s == f32::NEG_INFINITY {
                        0.0
                    } else {
                        ggml_expf(*s - maxv)
                    };
                    *p = *s;
                }
                sum += hsum8(&part) as f64;
            }
        } else {
            for s in scores.iter_mut() {
                let e = if *s == f32::NEG_INFINITY {
                    0.0
                } else {
                    (*s - maxv).exp()
                };
                *s = e;
                sum += e as f64;
            }
        }
        let inv = (1.0 / sum) as f32;
        if half {
            // ggml multiplies f16 probabilities with the (transposed) f16 value cache with one
            // 8-lane FMA accumulator per output, lane = slot % 8, then a horizontal sum.
            // A single token goes through ggml's vec_dot instead: 64 lanes, lane = slot % 64.
            let width = if n == 1 { 64 } else { 8 };
            lanes.clear();
            lanes.resize(d, [0f32; 64]);
            for (p, &e) in scores.iter().enumerate() {
                if e == 0.0 {
                    continue;
                }
                let w = r16(e * inv);
                let lane = p % width;
                if src[p] != u32::MAX {
                    let j = src[p] as usize;
                    let v = &vns[(j * kvh + g) * d..(j * kvh + g + 1) * d];
                    for (acc, &x) in lanes.iter_mut().zip(v) {
                        acc[lane] = w.mul_add(r16(x), acc[lane]);
                    }
                } else if let Cache::F16(s) = pv {
                    let off = (g * c + p) * d;
                    for (acc, x) in lanes.iter_mut().zip(&s[off..off + d]) {
                        acc[lane] = w.mul_add(x.to_f32(), acc[lane]);
                    }
                }
            }
            for (ov, acc) in o.iter_mut().zip(lanes.iter_mut()) {
                *ov = if width == 64 {
                    reduce64(acc)
                } else {
                    let mut l = [0f32; 8];
                    l.copy_from_slice(&acc[..8]);
                    hsum8(&l)
                };
            }
            return;
        }
        for (p, &e) in scores.iter().enumerate() {
            if e == 0.0 {
                continue;
            }
            let w = if half { r16(e * inv) } else { e * inv };
            if src[p] != u32::MAX {
                let j = src[p] as usize;
                let v = &vns[(j * kvh + g) * d..(j * kvh + g + 1) * d];
                if half {
                    for (ov, &x) in o.iter_mut().zip(v) {
                        *ov = w.mul_add(r16(x), *ov);
                    }
                } else {
                    axpy(o, w, v);
                }
            } else {
                let off = (g * c + p) * d;
                match pv {
                    Cache::F32(s) => axpy(o, w, &s[off..off + d]),
                    Cache::F16(s) => {
                        for (ov, x) in o.iter_mut().zip(&s[off..off + d]) {
                            *ov = w.mul_add(x.to_f32(), *ov);
                        }
                    }
                }
            }
        }
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
    fn ggml_expf_is_close_to_exp() {
        for i in -2000..=200 {
            let x = i as f32 * 0.05;
            let (got, want) = (ggml_expf(x), (x as f64).exp());
            assert!(
                ((got as f64 - want) / want).abs() < 4e-7 || (want < 1e-37 && got < 1e-37),
                "exp({x}) = {got}, want {want}"
            );
        }
        assert_eq!(ggml_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(ggml_expf(0.0), 1.0);
    }

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let r: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - r).abs() < 1e-5);
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
