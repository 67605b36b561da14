//! Quantizers: the activation quantizers llama.cpp applies before its integer dot products
//! (Q8_0, Q8_1, Q8_K, and f16/bf16 for float weights) and ggml's reference weight quantizers
//! for the simple block types (used to write test models).

use crate::{bail, put_f16, row_bytes, GgmlType, Result, QK_K};

/// `roundf`: round half away from zero (what ggml's Q8_0/Q8_1 reference quantizers use).
#[inline(always)]
fn roundf(v: f32) -> i32 {
    v.round() as i32
}

/// ggml's `nearest_int` (the 1.5·2²³ trick): round half to even, for |v| < 2²².
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// ggml's `GGML_FP32_TO_BF16`: round to nearest even, NaN kept quiet.
#[inline(always)]
pub(crate) fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u as u64 + (0x7fff + ((u >> 16) & 1) as u64)) >> 16) as u16
}

fn check(ty: GgmlType, x: &[f32], out: &[u8]) -> Result<()> {
    let need = row_bytes(ty, x.len())?;
    if out.len() != need {
        bail!(
            "{ty}: quantizing {} values needs {need} output bytes, got {}",
            x.len(),
            out.len()
        );
    }
    Ok(())
}

/// Quantizes `x` to Q8_0 exactly like ggml's `quantize_row_q8_0_ref`: per block of 32,
/// `d = amax / 127` (stored as f16), `q = roundf(x * (1 / d))`.
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) -> Result<()> {
    check(GgmlType::Q8_0, x, out)?;
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(ob, 0, d);
        for (o, v) in ob[2..].iter_mut().zip(xb) {
            *o = roundf(v * id) as i8 as u8;
        }
    }
    Ok(())
}

/// Quantizes `x` to Q8_1 exactly like ggml's `quantize_row_q8_1_ref`: Q8_0 plus
/// `s = f16(sum(q) * d)`.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [u8]) -> Result<()> {
    check(GgmlType::Q8_1, x, out)?;
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(36)) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(ob, 0, d);
        let mut sum = 0i32;
        for (o, v) in ob[4..].iter_mut().zip(xb) {
            let q = roundf(v * id);
            sum += q;
            *o = q as i8 as u8;
        }
        put_f16(ob, 2, sum as f32 * d);
    }
    Ok(())
}

/// Quantizes `x` to Q8_K exactly like ggml's `quantize_row_q8_K_ref`: per block of 256,
/// `iscale = -127 / max` (max = the value of largest magnitude), `q = min(127,
/// nearest_int(iscale * x))`, f32 `d = 1 / iscale`, and the 16 sums of 16 quants.
#[allow(non_snake_case)]
#[inline(always)]
pub fn quantize_row_q8_K(x: &[f32], out: &mut [u8]) -> Result<()> {
    check(GgmlType::Q8_K, x, out)?;
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(292)) {
        let mut max = 0f32;
        let mut amax = 0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            ob.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (o, &v) in ob[4..4 + QK_K].iter_mut().zip(xb) {
            *o = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        for j in 0..QK_K / 16 {
            let s: i32 = ob[4 + 16 * j..4 + 16 * j + 16]
                .iter()
                .map(|&q| q as i8 as i32)
                .sum();
            let at = 4 + QK_K + 2 * j;
            ob[at..at + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
        ob[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
    Ok(())
}

/// Quantizes one or more rows `x` into `out` (whole blocks of `ty`) with ggml's reference
/// quantizer. Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q8_K.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    check(ty, x, out)?;
    match ty {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => quantize_row_q8_0(x, out)?,
        GgmlType::Q8_1 => quantize_row_q8_1(x, out)?,
        GgmlType::Q8_K => quantize_row_q8_K(x, out)?,
        GgmlType::Q4_0 | GgmlType::Q5_0 => {
            let five = ty == GgmlType::Q5_0;
            let ts = ty.type_size();
            for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(ts)) {
                // The value of largest magnitude maps to -8 (-16): the sign is kept so the
                // asymmetric range [-8, 7] is used on the side that needs it.
                let mut amax = 0f32;
                let mut max = 0f32;
                for &v in xb {
                    if amax < v.abs() {
                        amax = v.abs();
                        max = v;
                    }
                }
                let (levels, top) = if five { (-16.0, 31) } else { (-8.0, 15) };
                let d = max / levels;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(ob, 0, d);
                let off = -levels + 0.5;
                let qs_at = if five { 6 } else { 2 };
                let mut qh = 0u32;
                for j in 0..16 {
                    let q0 = ((xb[j] * id + off) as i32).min(top) as u32;
                    let q1 = ((xb[j + 16] * id + off) as i32).min(top) as u32;
                    ob[qs_at + j] = ((q0 & 0x0F) | ((q1 & 0x0F) << 4)) as u8;
                    qh |= ((q0 & 0x10) >> 4) << j;
                    qh |= ((q1 & 0x10) >> 4) << (j + 16);
                }
                if five {
                    ob[2..6].copy_from_slice(&qh.to_le_bytes());
                }
            }
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let five = ty == GgmlType::Q5_1;
            let ts = ty.type_size();
            for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(ts)) {
                let mut min = f32::MAX;
                let mut max = -f32::MAX;
                for &v in xb {
                    if v < min {
                        min = v;
                    }
                    if v > max {
                        max = v;
                    }
                }
                let (levels, top) = if five { (31.0, 31) } else { (15.0, 15) };
                let d = (max - min) / levels;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(ob, 0, d);
                put_f16(ob, 2, min);
                let qs_at = if five { 8 } else { 4 };
                let mut qh = 0u32;
                for j in 0..16 {
                    let q0 = (((xb[j] - min) * id + 0.5) as i32).min(top) as u32;
                    let q1 = (((xb[j + 16] - min) * id + 0.5) as i32).min(top) as u32;
                    ob[qs_at + j] = ((q0 & 0x0F) | ((q1 & 0x0F) << 4)) as u8;
                    qh |= ((q0 & 0x10) >> 4) << j;
                    qh |= ((q1 & 0x10) >> 4) << (j + 16);
                }
                if five {
                    ob[4..8].copy_from_slice(&qh.to_le_bytes());
                }
            }
        }
        _ => bail!("quantization to ggml type {ty} is not supported"),
    }
    Ok(())
}

/// Quantizes one activation row `x` to `vec_ty` (the type [`crate::vec_dot_type`] names) into
/// `out`.
///
/// Q8_0/Q8_1 follow ggml's x86 SIMD quantizers, which llama.cpp runs for activations on AVX2
/// machines: `id = 127 / amax` and round-half-to-even, where the reference C code uses
/// `id = 1 / (amax / 127)` and `roundf`. The two differ on a few values per row; matching the
/// path llama.cpp really takes keeps near-tie greedy tokens identical. Q8_K has no x86-specific
/// quantizer in ggml (it uses the reference) and F16 is a plain conversion.
pub fn quantize_activations(vec_ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        return crate::x86::quantize_activations(vec_ty, x, out);
    }
    quantize_activations_body(vec_ty, x, out)
}

/// [`quantize_activations`] compiled for the baseline CPU (the reference of its AVX2 twin).
pub fn quantize_activations_scalar(vec_ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    quantize_activations_body(vec_ty, x, out)
}

/// The body of [`quantize_activations`], inlined into its AVX2 twin (`x86.rs`) so the same
/// code compiles with SSE4.1 rounding instructions and AVX2 vectors (the same IEEE operations,
/// so the same bytes) instead of libm calls per value.
#[inline(always)]
pub(crate) fn quantize_activations_body(vec_ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    match vec_ty {
        GgmlType::Q8_0 => {
            check(GgmlType::Q8_0, x, out)?;
            for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                put_f16(ob, 0, amax / 127.0);
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                for (o, v) in ob[2..].iter_mut().zip(xb) {
                    *o = nearest_int(v * id) as i8 as u8;
                }
            }
            Ok(())
        }
        GgmlType::Q8_1 => {
            check(GgmlType::Q8_1, x, out)?;
            for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(36)) {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                put_f16(ob, 0, d);
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                let mut sum = 0i32;
                for (o, v) in ob[4..].iter_mut().zip(xb) {
                    let q = nearest_int(v * id);
                    sum += q;
                    *o = q as i8 as u8;
                }
                put_f16(ob, 2, d * sum as f32);
            }
            Ok(())
        }
        GgmlType::Q8_K => quantize_row_q8_K(x, out),
        _ => quantize_row(vec_ty, x, out),
    }
}
