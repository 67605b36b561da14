//! Exact integer sums of a depthwise 2-D convolution plane: the kernel behind `npuc.QConv`'s
//! depthwise case (`group == channels`, one filter per channel).
//!
//! `out[oy * ow + ox] = sum_{ky, kx} taps[ky * kw + kx] * x[(oy * sh + ky * dh) * pw + ox * sw + kx * dw]`
//!
//! over one zero-padded plane `x` of `pw` columns, whose values are already zero-point corrected
//! (so the padding, the real value 0, is the integer 0). Operands lie in [-255, 255] (8-bit codes
//! minus zero points); a sum has at most `kh * kw` terms of magnitude <= 65025, exact in i32 for
//! any kernel up to 33025 taps (callers check [`MAX_TAPS`]).
//!
//! A depthwise filter has only `kh * kw` weights, too few for a matrix product to pay: the
//! loop runs over output columns instead (for unit stride a contiguous i16 row times a broadcast
//! tap, accumulated in i32: what the compiler vectorizes to widening multiply-adds at each
//! level). The same body is compiled for the baseline target (the scalar twin), AVX2 and
//! AVX-512 (BW), dispatched at run time; integer arithmetic makes every variant bit-identical.

use npuc_isa::Isa;

/// The most taps whose i32 sum is proven exact: floor((2^31 - 1) / (255 * 255)).
pub const MAX_TAPS: usize = 33025;

/// Geometry of one depthwise plane: kernel, strides and dilations (height, width) and the
/// output size. The input plane is already padded; its column count is passed separately.
#[derive(Debug, Clone, Copy)]
pub struct DwGeom {
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub dh: usize,
    pub dw: usize,
    pub oh: usize,
    pub ow: usize,
}

/// The rows of the padded plane this geometry reads: `(oh - 1) * sh + (kh - 1) * dh + 1`.
pub fn rows_needed(g: &DwGeom) -> usize {
    (g.oh.max(1) - 1) * g.sh + (g.kh.max(1) - 1) * g.dh + 1
}

/// The columns of the padded plane this geometry reads: `(ow - 1) * sw + (kw - 1) * dw + 1`.
pub fn cols_needed(g: &DwGeom) -> usize {
    (g.ow.max(1) - 1) * g.sw + (g.kw.max(1) - 1) * g.dw + 1
}

/// Sums of one plane (see the module docs) at the process-wide level.
///
/// # Panics
/// If `x` (rows of `pw` columns) or `out` (`oh * ow`) is smaller than the geometry reads or
/// writes, or `taps` holds fewer than `kh * kw` values: callers size them from the geometry.
pub fn dw_plane(x: &[i16], pw: usize, taps: &[i16], g: &DwGeom, out: &mut [i32]) {
    dw_plane_with(Isa::detect(), x, pw, taps, g, out)
}

/// [`dw_plane`] at an explicit level (tests compare the levels).
pub fn dw_plane_with(isa: Isa, x: &[i16], pw: usize, taps: &[i16], g: &DwGeom, out: &mut [i32]) {
    assert!(
        pw >= cols_needed(g),
        "padded plane narrower than the kernel reads"
    );
    assert!(
        x.len() >= (rows_needed(g) - 1) * pw + cols_needed(g),
        "padded plane shorter than the kernel reads"
    );
    assert!(taps.len() >= g.kh * g.kw && out.len() >= g.oh * g.ow);
    #[cfg(target_arch = "x86_64")]
    {
        if isa.has_avx512() && Isa::detect().has_avx512() {
            // SAFETY: AVX-512 (F/BW, part of npuc's avx512 level) detected on this CPU; the
            // body is safe Rust over slices whose sizes were asserted above.
            unsafe { dw_plane_avx512(x, pw, taps, g, out) };
            return;
        }
        if isa.has_avx2() && Isa::detect().has_avx2() {
            // SAFETY: AVX2 detected on this CPU; safe Rust body, sizes asserted above.
            unsafe { dw_plane_avx2(x, pw, taps, g, out) };
            return;
        }
    }
    let _ = isa;
    dw_plane_scalar(x, pw, taps, g, out)
}

/// The body shared by every level (safe Rust; bounds are checked by the slicing).
#[inline(always)]
fn dw_plane_body(x: &[i16], pw: usize, taps: &[i16], g: &DwGeom, out: &mut [i32]) {
    let ow = g.ow;
    for oy in 0..g.oh {
        let acc = &mut out[oy * ow..(oy + 1) * ow];
        acc.fill(0);
        for ky in 0..g.kh {
            let row = &x[(oy * g.sh + ky * g.dh) * pw..];
            for kx in 0..g.kw {
                let t = taps[ky * g.kw + kx] as i32;
                let off = kx * g.dw;
                if g.sw == 1 {
                    for (a, &v) in acc.iter_mut().zip(&row[off..off + ow]) {
                        *a += t * v as i32;
                    }
                } else {
                    for (a, &v) in acc.iter_mut().zip(row[off..].iter().step_by(g.sw)) {
                        *a += t * v as i32;
                    }
                }
            }
        }
    }
}

/// The scalar twin (baseline target).
pub fn dw_plane_scalar(x: &[i16], pw: usize, taps: &[i16], g: &DwGeom, out: &mut [i32]) {
    dw_plane_body(x, pw, taps, g, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dw_plane_avx2(x: &[i16], pw: usize, taps: &[i16], g: &DwGeom, out: &mut [i32]) {
    dw_plane_body(x, pw, taps, g, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn dw_plane_avx512(x: &[i16], pw: usize, taps: &[i16], g: &DwGeom, out: &mut [i32]) {
    dw_plane_body(x, pw, taps, g, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::xorshift;

    /// The sum by definition, one output at a time.
    fn reference(x: &[i16], pw: usize, taps: &[i16], g: &DwGeom) -> Vec<i32> {
        let mut out = vec![0i32; g.oh * g.ow];
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let mut s = 0i64;
                for ky in 0..g.kh {
                    for kx in 0..g.kw {
                        let v = x[(oy * g.sh + ky * g.dh) * pw + ox * g.sw + kx * g.dw];
                        s += taps[ky * g.kw + kx] as i64 * v as i64;
                    }
                }
                out[oy * g.ow + ox] = s as i32;
            }
        }
        out
    }

    /// Every level equals the definition on random planes over kernel sizes, strides,
    /// dilations and widths around the vector lengths, with operands at the 8-bit extremes.
    #[test]
    fn dw_plane_matches_definition_at_every_level() {
        let mut s = 0x5eed_u64;
        for case in 0..300 {
            let kh = 1 + (xorshift(&mut s) % 5) as usize;
            let kw = 1 + (xorshift(&mut s) % 5) as usize;
            let sh = 1 + (xorshift(&mut s) % 2) as usize;
            let sw = 1 + (xorshift(&mut s) % 3) as usize;
            let dh = 1 + (xorshift(&mut s) % 2) as usize;
            let dw = 1 + (xorshift(&mut s) % 2) as usize;
            let oh = 1 + (xorshift(&mut s) % 6) as usize;
            let ow = 1 + (xorshift(&mut s) % 70) as usize;
            let g = DwGeom {
                kh,
                kw,
                sh,
                sw,
                dh,
                dw,
                oh,
                ow,
            };
            let pw = cols_needed(&g) + (xorshift(&mut s) % 3) as usize;
            let rows = rows_needed(&g);
            let extreme = case % 7 == 0;
            let mut val = |s: &mut u64| -> i16 {
                if extreme {
                    if xorshift(s) % 2 == 0 {
                        255
                    } else {
                        -255
                    }
                } else {
                    (xorshift(s) % 511) as i16 - 255
                }
            };
            let x: Vec<i16> = (0..rows * pw).map(|_| val(&mut s)).collect();
            let taps: Vec<i16> = (0..kh * kw).map(|_| val(&mut s)).collect();
            let want = reference(&x, pw, &taps, &g);
            let mut got = vec![7i32; oh * ow];
            dw_plane_scalar(&x, pw, &taps, &g, &mut got);
            assert_eq!(got, want, "scalar, case {case}: {g:?} pw {pw}");
            for isa in Isa::ALL.into_iter().filter(|&l| l <= Isa::detect()) {
                let mut got = vec![7i32; oh * ow];
                dw_plane_with(isa, &x, pw, &taps, &g, &mut got);
                assert_eq!(got, want, "{}, case {case}: {g:?} pw {pw}", isa.name());
            }
        }
    }
}
