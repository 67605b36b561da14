//! Signal processing and linear algebra: `DFT`, `STFT` and `Det`.
//!
//! Transforms are computed in f64 with an iterative radix-2 FFT for power-of-two lengths,
//! Bluestein's algorithm (on top of that FFT) for other long lengths, and a direct DFT for short
//! ones.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::common::norm_axis;
use crate::ops::norm::f64_to_tensor;
use crate::value::Value;
use std::f64::consts::PI;

pub fn register(r: &mut Registry) {
    r.add("DFT", 17, dft);
    r.add("STFT", 17, stft);
    r.add("Det", 11, det);
}

/// A complex number as (re, im).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct C64 {
    pub re: f64,
    pub im: f64,
}

impl C64 {
    fn new(re: f64, im: f64) -> C64 {
        C64 { re, im }
    }
    fn mul(self, o: C64) -> C64 {
        C64::new(
            self.re * o.re - self.im * o.im,
            self.re * o.im + self.im * o.re,
        )
    }
    fn add(self, o: C64) -> C64 {
        C64::new(self.re + o.re, self.im + o.im)
    }
    fn sub(self, o: C64) -> C64 {
        C64::new(self.re - o.re, self.im - o.im)
    }
    fn conj(self) -> C64 {
        C64::new(self.re, -self.im)
    }
    /// `exp(i * theta)`.
    fn cis(theta: f64) -> C64 {
        C64::new(theta.cos(), theta.sin())
    }
}

/// In-place iterative radix-2 FFT (`data.len()` must be a power of two). `inverse` flips the
/// twiddle sign; no normalisation.
fn fft_pow2(data: &mut [C64], inverse: bool) {
    let n = data.len();
    if n <= 1 {
        return;
    }
    // Bit-reversal permutation.
    let mut j = 0usize;
    for i in 1..n {
        let mut bit = n >> 1;
        while j & bit != 0 {
            j ^= bit;
            bit >>= 1;
        }
        j |= bit;
        if i < j {
            data.swap(i, j);
        }
    }
    let sign = if inverse { 1.0 } else { -1.0 };
    let mut len = 2;
    while len <= n {
        let w_len = C64::cis(sign * 2.0 * PI / len as f64);
        for chunk in data.chunks_exact_mut(len) {
            let (lo, hi) = chunk.split_at_mut(len / 2);
            let mut w = C64::new(1.0, 0.0);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let t = b.mul(w);
                *b = a.sub(t);
                *a = a.add(t);
                w = w.mul(w_len);
            }
        }
        len <<= 1;
    }
}

/// Unnormalised DFT of any length: `X[k] = sum x[t] exp(-+2 pi i k t / n)`.
pub fn dft_any(x: &[C64], inverse: bool) -> Vec<C64> {
    let n = x.len();
    if n.is_power_of_two() {
        let mut v = x.to_vec();
        fft_pow2(&mut v, inverse);
        return v;
    }
    let sign = if inverse { 1.0 } else { -1.0 };
    if n <= 64 {
        return (0..n)
            .map(|k| {
                x.iter().enumerate().fold(C64::default(), |acc, (t, &v)| {
                    // Reduce k*t mod n first so the angle stays accurate.
                    let ang = sign * 2.0 * PI * ((k * t) % n) as f64 / n as f64;
                    acc.add(v.mul(C64::cis(ang)))
                })
            })
            .collect();
    }
    // Bluestein: a DFT of length n as a convolution of length m >= 2n - 1 (power of two).
    let m = (2 * n - 1).next_power_of_two();
    let chirp: Vec<C64> = (0..n)
        .map(|k| {
            let kk = (k as u128 * k as u128 % (2 * n as u128)) as f64;
            C64::cis(sign * PI * kk / n as f64)
        })
        .collect();
    let mut a = vec![C64::default(); m];
    for (i, (&v, &c)) in x.iter().zip(&chirp).enumerate() {
        a[i] = v.mul(c);
    }
    let mut b = vec![C64::default(); m];
    b[0] = chirp[0].conj();
    for k in 1..n {
        b[k] = chirp[k].conj();
        b[m - k] = chirp[k].conj();
    }
    fft_pow2(&mut a, false);
    fft_pow2(&mut b, false);
    for (ai, &bi) in a.iter_mut().zip(&b) {
        *ai = ai.mul(bi);
    }
    fft_pow2(&mut a, true);
    let inv_m = 1.0 / m as f64;
    (0..n)
        .map(|k| {
            let v = C64::new(a[k].re * inv_m, a[k].im * inv_m);
            v.mul(chirp[k])
        })
        .collect()
}

/// `DFT`: forward or inverse discrete Fourier transform along `axis` of a real (`[..., 1]`) or
/// complex (`[..., 2]`) signal; `dft_length` pads or truncates, `onesided` keeps the
/// non-redundant half (forward) or takes a one-sided spectrum to a real signal (inverse).
/// `axis` is an attribute (default 1) before opset 20 and an input (default -2) from 20.
fn dft(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let shape = x.shape().to_vec();
    let rank = shape.len();
    if rank < 2 {
        bail!("DFT input must have rank >= 2, got {:?}", shape);
    }
    let comp = shape[rank - 1];
    if comp != 1 && comp != 2 {
        bail!("DFT input's last dimension must be 1 or 2, got {comp}");
    }
    let axis = if ctx.opset >= 20 {
        let a = match ins.opt_tensor(2) {
            Some(t) => *t
                .to_i64_vec()?
                .first()
                .ok_or_else(|| crate::RtError::msg("axis input is empty"))?,
            None => -2,
        };
        norm_axis(a, rank)?
    } else {
        norm_axis(ctx.node.int_or("axis", 1)?, rank)?
    };
    if axis == rank - 1 {
        bail!("DFT axis cannot be the last (complex) dimension");
    }
    let inverse = ctx.node.int_or("inverse", 0)? != 0;
    let onesided = ctx.node.int_or("onesided", 0)? != 0;
    let in_len = shape[axis];
    let n = match ins.opt_tensor(1).filter(|t| !t.is_empty()) {
        Some(t) => {
            let v = *t
                .to_i64_vec()?
                .first()
                .ok_or_else(|| crate::RtError::msg("dft_length is empty"))?;
            if v <= 0 {
                bail!("dft_length must be positive, got {v}");
            }
            v as usize
        }
        None if inverse && onesided => 2 * in_len.saturating_sub(1),
        None => in_len,
    };
    if n == 0 {
        bail!("DFT length is zero");
    }
    let (out_len, out_comp) = match (inverse, onesided) {
        (false, true) => (n / 2 + 1, 2),
        (true, true) => (n, 1),
        _ => (n, 2),
    };
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..rank - 1].iter().product();
    let xv = x.to_f64_vec()?;
    let mut out = vec![0f64; outer * out_len * inner * out_comp];
    let mut line = vec![C64::default(); n];
    for o in 0..outer {
        for i in 0..inner {
            line.fill(C64::default());
            let at = |k: usize| ((o * in_len + k) * inner + i) * comp;
            if inverse && onesided {
                // Rebuild the Hermitian full spectrum from bins 0..=n/2.
                for k in 0..=(n / 2) {
                    if k >= in_len {
                        break;
                    }
                    let p = at(k);
                    let mut v = C64::new(xv[p], if comp == 2 { xv[p + 1] } else { 0.0 });
                    if k == 0 || (n % 2 == 0 && k == n / 2) {
                        v.im = 0.0;
                    }
                    line[k] = v;
                    if k != 0 && n - k != k {
                        line[n - k] = v.conj();
                    }
                }
            } else {
                for (k, slot) in line.iter_mut().enumerate().take(in_len.min(n)) {
                    let p = at(k);
                    *slot = C64::new(xv[p], if comp == 2 { xv[p + 1] } else { 0.0 });
                }
            }
            let res = dft_any(&line, inverse);
            let scale = if inverse { 1.0 / n as f64 } else { 1.0 };
            for (k, v) in res.iter().take(out_len).enumerate() {
                let q = ((o * out_len + k) * inner + i) * out_comp;
                out[q] = v.re * scale;
                if out_comp == 2 {
                    out[q + 1] = v.im * scale;
                }
            }
        }
    }
    let mut out_shape = shape.clone();
    out_shape[axis] = out_len;
    out_shape[rank - 1] = out_comp;
    Ok(vec![Value::tensor(f64_to_tensor(
        x.dtype(),
        out_shape,
        out,
    )?)])
}

/// `STFT`: short-time Fourier transform of `[batch, length, 1|2]` signals into
/// `[batch, frames, bins, 2]`, with an optional window and `onesided` (default 1) output.
fn stft(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let shape = x.shape().to_vec();
    if shape.len() != 3 || !(shape[2] == 1 || shape[2] == 2) {
        bail!("STFT signal must be [batch, length, 1|2], got {:?}", shape);
    }
    let (batch, len, comp) = (shape[0], shape[1], shape[2]);
    let step = *ins
        .tensor(1)?
        .to_i64_vec()?
        .first()
        .ok_or_else(|| crate::RtError::msg("frame_step is empty"))?;
    if step <= 0 {
        bail!("frame_step must be positive, got {step}");
    }
    let step = step as usize;
    let window = match ins.opt_tensor(2).filter(|t| !t.is_empty()) {
        Some(w) => Some(w.to_f64_vec()?),
        None => None,
    };
    let frame_len = match ins.opt_tensor(3).filter(|t| !t.is_empty()) {
        Some(t) => {
            let v = *t
                .to_i64_vec()?
                .first()
                .ok_or_else(|| crate::RtError::msg("frame_length is empty"))?;
            if v <= 0 {
                bail!("frame_length must be positive, got {v}");
            }
            v as usize
        }
        None => match &window {
            Some(w) => w.len(),
            None => bail!("STFT needs a window or a frame_length"),
        },
    };
    if let Some(w) = &window {
        if w.len() != frame_len {
            bail!(
                "window has {} entries, frame_length is {frame_len}",
                w.len()
            );
        }
    }
    if frame_len > len {
        bail!("frame_length {frame_len} exceeds the signal length {len}");
    }
    let onesided = ctx.node.int_or("onesided", 1)? != 0;
    if onesided && comp == 2 {
        bail!("onesided STFT requires a real signal");
    }
    let frames = 1 + (len - frame_len) / step;
    let bins = if onesided {
        frame_len / 2 + 1
    } else {
        frame_len
    };
    let xv = x.to_f64_vec()?;
    let mut out = vec![0f64; batch * frames * bins * 2];
    let mut line = vec![C64::default(); frame_len];
    for b in 0..batch {
        for f in 0..frames {
            for (t, slot) in line.iter_mut().enumerate() {
                let p = (b * len + f * step + t) * comp;
                let w = window.as_ref().map_or(1.0, |w| w[t]);
                *slot = C64::new(xv[p] * w, if comp == 2 { xv[p + 1] * w } else { 0.0 });
            }
            let res = dft_any(&line, false);
            for (k, v) in res.iter().take(bins).enumerate() {
                let q = ((b * frames + f) * bins + k) * 2;
                out[q] = v.re;
                out[q + 1] = v.im;
            }
        }
    }
    Ok(vec![Value::tensor(f64_to_tensor(
        x.dtype(),
        vec![batch, frames, bins, 2],
        out,
    )?)])
}

/// `Det`: determinant of each trailing `[M, M]` matrix (LU with partial pivoting).
fn det(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let shape = x.shape().to_vec();
    let r = shape.len();
    if r < 2 || shape[r - 1] != shape[r - 2] {
        bail!("Det expects [..., M, M], got {:?}", shape);
    }
    let m = shape[r - 1];
    let v = x.to_f64_vec()?;
    let mut out = vec![];
    let mut a = vec![0f64; m * m];
    for mat in v.chunks_exact((m * m).max(1)) {
        if m == 0 {
            out.push(1.0);
            continue;
        }
        a.copy_from_slice(mat);
        let mut d = 1.0;
        for col in 0..m {
            let piv = (col..m)
                .max_by(|&i, &j| a[i * m + col].abs().total_cmp(&a[j * m + col].abs()))
                .unwrap_or(col);
            if a[piv * m + col] == 0.0 {
                d = 0.0;
                break;
            }
            if piv != col {
                for k in 0..m {
                    a.swap(piv * m + k, col * m + k);
                }
                d = -d;
            }
            let p = a[col * m + col];
            d *= p;
            for row in col + 1..m {
                let f = a[row * m + col] / p;
                if f != 0.0 {
                    for k in col..m {
                        a[row * m + k] -= f * a[col * m + k];
                    }
                }
            }
        }
        out.push(d);
    }
    Ok(vec![Value::tensor(f64_to_tensor(
        x.dtype(),
        shape[..r - 2].to_vec(),
        out,
    )?)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fft_paths_agree() {
        for n in [8usize, 12, 100, 128] {
            let x: Vec<C64> = (0..n)
                .map(|i| C64::new((i as f64 * 0.37).sin(), (i as f64 * 0.11).cos()))
                .collect();
            let fast = dft_any(&x, false);
            for (k, f) in fast.iter().enumerate() {
                let direct = x.iter().enumerate().fold(C64::default(), |acc, (t, &v)| {
                    acc.add(v.mul(C64::cis(-2.0 * PI * (k * t) as f64 / n as f64)))
                });
                assert!((f.re - direct.re).abs() < 1e-8 && (f.im - direct.im).abs() < 1e-8);
            }
        }
    }
}
