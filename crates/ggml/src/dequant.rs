//! Dequantization of GGML blocks to f32, following ggml's reference `dequantize_row_*`
//! operation by operation (so results are bit-identical to ggml and gguf-py).

use crate::{bail, f16_at, row_bytes, GgmlType, Result, QK_K};

/// The IQ4_NL code book (`kvalues_iq4nl` of ggml-common.h).
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// A dequantizer: [`dequantize_row`] or one of its twins.
pub(crate) type DequantFn = fn(GgmlType, &[u8], &mut [f32]) -> Result<()>;

/// Dequantizes `bytes` (whole blocks of `ty`, e.g. one or more GGUF rows) into `out`, whose
/// length is the number of logical elements. Errors when `out.len()` is not a whole number of
/// blocks, when `bytes` has the wrong length for it, or when `ty` is not supported.
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        return crate::x86::dequantize_row(ty, bytes, out);
    }
    dequantize_body(ty, bytes, out)
}

/// [`dequantize_row`] compiled for the baseline CPU: the reference its AVX2-compiled twin is
/// tested against (the same operations in the same order, so the same values).
pub fn dequantize_row_scalar(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    dequantize_body(ty, bytes, out)
}

/// The body of [`dequantize_row`], inlined into its AVX2 twin (`x86.rs`) so the same block
/// loops compile to vector code (prefill dequantizes every weight once per product).
#[inline(always)]
pub(crate) fn dequantize_body(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let need = row_bytes(ty, out.len())?;
    if bytes.len() != need {
        bail!(
            "{ty}: {} elements need {need} bytes, got {}",
            out.len(),
            bytes.len()
        );
    }
    macro_rules! blocks {
        ($f:ident) => {
            for (blk, o) in bytes
                .chunks_exact(ty.type_size())
                .zip(out.chunks_exact_mut(ty.block_size()))
            {
                $f(blk, o);
            }
        };
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        GgmlType::Q4_0 => blocks!(q4_0),
        GgmlType::Q4_1 => blocks!(q4_1),
        GgmlType::Q5_0 => blocks!(q5_0),
        GgmlType::Q5_1 => blocks!(q5_1),
        GgmlType::Q8_0 => blocks!(q8_0),
        GgmlType::Q8_1 => blocks!(q8_1),
        GgmlType::Q2_K => blocks!(q2_k),
        GgmlType::Q3_K => blocks!(q3_k),
        GgmlType::Q4_K => blocks!(q4_k),
        GgmlType::Q5_K => blocks!(q5_k),
        GgmlType::Q6_K => blocks!(q6_k),
        GgmlType::Q8_K => blocks!(q8_k),
        GgmlType::IQ4_NL => blocks!(iq4_nl),
        _ => bail!("dequantization of ggml type {ty} is not supported"),
    }
    Ok(())
}

// block_q4_0 { f16 d; u8 qs[16]; }: low nibbles are elements 0..16, high nibbles 16..32.
#[inline(always)]
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        let x0 = (qs[j] & 0x0F) as i32 - 8;
        let x1 = (qs[j] >> 4) as i32 - 8;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

// block_q4_1 { f16 d; f16 m; u8 qs[16]; }
#[inline(always)]
fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

// block_q5_0 { f16 d; u8 qh[4]; u8 qs[16]; }: bit j of qh is the 5th bit of element j.
#[inline(always)]
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = ((qs[j] as u32 & 0x0F) | xh0) as i32 - 16;
        let x1 = ((qs[j] as u32 >> 4) | xh1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

// block_q5_1 { f16 d; f16 m; u8 qh[4]; u8 qs[16]; }
#[inline(always)]
fn q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = (qs[j] as u32 & 0x0F) | xh0;
        let x1 = (qs[j] as u32 >> 4) | xh1;
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

// block_q8_0 { f16 d; i8 qs[32]; }
#[inline(always)]
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = b[2 + j] as i8 as f32 * d;
    }
}

// block_q8_1 { f16 d; f16 s; i8 qs[32]; }
#[inline(always)]
fn q8_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = b[4 + j] as i8 as f32 * d;
    }
}

// block_q2_K { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin; }: 16 groups of 16, 4-bit scale and
// 4-bit min per group, 2-bit quants; each 32-byte half of qs holds 4 bit planes of 128 values.
#[inline(always)]
fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let d = f16_at(b, 80);
    let min = f16_at(b, 82);
    let mut is = 0;
    let mut yi = 0;
    for n in 0..2 {
        let q = &b[16 + 32 * n..16 + 32 * n + 32];
        let mut shift = 0;
        for _ in 0..4 {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = min * (sc >> 4) as f32;
                for l in 0..16 {
                    y[yi] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                    yi += 1;
                }
            }
            shift += 2;
        }
    }
}

/// Unpacks the 12 bytes of Q3_K's 6-bit scales into 16 signed scales (already minus 32).
#[inline(always)]
pub(crate) fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0x0F } else { s[j - 8] >> 4 };
        let high = (s[8 + (j % 4)] >> (2 * (j / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

// block_q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d; }: 2 low bits in qs (layout of
// Q2_K), the high bit in hmask (bit plane per 32 values); a cleared high bit means -4.
#[inline(always)]
fn q3_k(b: &[u8], y: &mut [f32]) {
    let hm = &b[0..32];
    let d_all = f16_at(b, 108);
    let scales = q3_k_scales(&b[96..108]);
    let mut is = 0;
    let mut yi = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &b[32 + 32 * n..32 + 32 * n + 32];
        let mut shift = 0;
        for _ in 0..4 {
            for half in 0..2 {
                let dl = d_all * scales[is] as f32;
                is += 1;
                for l in 0..16 {
                    let i = l + 16 * half;
                    let lo = ((q[i] >> shift) & 3) as i8;
                    let v = lo - if hm[i] & m != 0 { 0 } else { 4 };
                    y[yi] = dl * v as f32;
                    yi += 1;
                }
            }
            shift += 2;
            m <<= 1;
        }
    }
}

/// Scale and min of sub-block `j` (0..8) from the 12 packed bytes of Q4_K/Q5_K
/// (`get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

// block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }: 8 sub-blocks of 32; each 32 bytes
// of qs hold two sub-blocks (low nibbles, then high nibbles).
#[inline(always)]
fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let sc = &b[4..16];
    for j in 0..QK_K / 64 {
        let q = &b[16 + 32 * j..16 + 32 * j + 32];
        let (s1, m1) = scale_min_k4(2 * j, sc);
        let (s2, m2) = scale_min_k4(2 * j + 1, sc);
        let d1 = d * s1 as f32;
        let m1 = min * m1 as f32;
        let d2 = d * s2 as f32;
        let m2 = min * m2 as f32;
        let yo = &mut y[64 * j..64 * j + 64];
        for l in 0..32 {
            yo[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            yo[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

// block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }: Q4_K plus a 5th bit,
// bit plane 2j / 2j+1 of qh for sub-blocks 2j / 2j+1.
#[inline(always)]
fn q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let sc = &b[4..16];
    let qh = &b[16..48];
    for j in 0..QK_K / 64 {
        let ql = &b[48 + 32 * j..48 + 32 * j + 32];
        let (s1, m1) = scale_min_k4(2 * j, sc);
        let (s2, m2) = scale_min_k4(2 * j + 1, sc);
        let d1 = d * s1 as f32;
        let m1 = min * m1 as f32;
        let d2 = d * s2 as f32;
        let m2 = min * m2 as f32;
        let u1 = 1u8 << (2 * j);
        let u2 = 2u8 << (2 * j);
        let yo = &mut y[64 * j..64 * j + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            yo[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            yo[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

// block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }: per 128 values, ql holds 64
// bytes (low nibbles: values 0..32 and 32..64; high nibbles: 64..96, 96..128), qh 32 bytes with
// 2 bits for each of the four quarters.
#[inline(always)]
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let yo = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            yo[l] = d * sc[is] as i8 as f32 * q1 as f32;
            yo[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            yo[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            yo[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
    }
}

// block_q8_K { f32 d; i8 qs[256]; i16 bsums[16]; }
#[inline(always)]
fn q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for j in 0..QK_K {
        y[j] = d * b[4 + j] as i8 as f32;
    }
}

// block_iq4_nl { f16 d; u8 qs[16]; }: 4-bit indices into a non-linear code book.
#[inline(always)]
fn iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * KVALUES_IQ4NL[(qs[j] & 0x0F) as usize] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
    }
}
