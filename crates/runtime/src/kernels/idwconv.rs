//! Exact integer sums of a depthwise 2-D convolution plane: the kernel behind `npuc.QConv`'s
//! depthwise case (`group == channels`, one filter per channel).
//!
//! `out[oy * ow + ox] = sum_{ky, kx} taps[ky * kw + kx] * X[oy * sh + ky * dh][ox * sw + kx * dw]`
//!
//! over one zero-padded plane `X` whose values are already zero-point corrected (so the padding,
//! the real value 0, is the integer 0). The plane is stored column-phase split for the width
//! stride: row `r` holds `sw` phases of `pwq` values, phase `q` the columns `q, q + sw, ..`, so
//! every tap reads a contiguous run of inputs (`X[r][c]` is at `(r * sw + c % sw) * pwq + c / sw`).
//!
//! The arithmetic is f32 on integer values: operands lie in [-255, 255] (8-bit codes minus zero
//! points), every product is an integer of magnitude <= 65025 and every partial sum of at most
//! [`MAX_TAPS`] of them stays below 2^24, so each f32 operation is exact and the result is the
//! exact integer sum, identical at every level. f32 fused multiply-adds are what the CPU has
//! most of (two 16-lane FMAs per cycle with AVX-512) while i32 multiplies (`vpmulld`) cost
//! several times more; a depthwise filter of `kh * kw` weights is too small for a matrix
//! product to pay. The same body is compiled for the baseline target (the scalar twin), AVX2+FMA
//! and AVX-512, dispatched at run time.

use crate::kernels::qconvert::QInt;
use npuc_isa::Isa;

/// The most taps whose f32 sums are proven exact: floor(2^24 / (255 * 255)) = 258.
pub const MAX_TAPS: usize = 258;

/// Geometry of one depthwise plane: kernel, strides and dilations (height, width) and the
/// output size. The input plane is already padded and phase-split (see the module docs).
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

/// Values per phase row that hold every column the geometry reads: `ceil(cols_needed / sw)`.
pub fn phase_width(g: &DwGeom) -> usize {
    cols_needed(g).div_ceil(g.sw.max(1))
}

/// The index of padded-plane value (row `r`, column `c`) in the phase-split layout.
#[inline]
pub fn phase_index(g: &DwGeom, pwq: usize, r: usize, c: usize) -> usize {
    (r * g.sw + c % g.sw) * pwq + c / g.sw
}

/// Values the kernel may read past the end of the plane (a block of output columns is computed
/// [`LANES`] at a time; the lanes past the row's end read whatever follows and are never
/// stored). Callers allocate planes of [`plane_len`] values.
pub const SLACK: usize = LANES;

/// Values of a padded, phase-split plane for `g` with `pwq` values per phase row, including
/// the [`SLACK`] the kernel may read beyond the last row.
pub fn plane_len(g: &DwGeom, pwq: usize) -> usize {
    rows_needed(g) * g.sw * pwq + SLACK
}

/// Sums of one plane (see the module docs) at the process-wide level. `x` is the phase-split
/// padded plane with `pwq` values per phase row ([`phase_width`] or more), [`plane_len`]
/// values long.
///
/// # Panics
/// If `x` is shorter than [`plane_len`] or `out` than `oh * ow`, `taps` holds fewer than
/// `kh * kw` values, the kernel has more than [`MAX_TAPS`] taps or a stride is 0: callers size
/// and check them from the geometry.
pub fn dw_plane(x: &[f32], pwq: usize, taps: &[f32], g: &DwGeom, out: &mut [i32]) {
    dw_plane_with(Isa::detect(), x, pwq, taps, g, out)
}

/// [`dw_plane`] at an explicit level (tests compare the levels).
pub fn dw_plane_with(isa: Isa, x: &[f32], pwq: usize, taps: &[f32], g: &DwGeom, out: &mut [i32]) {
    assert!(g.sw > 0 && g.sh > 0 && g.kh * g.kw <= MAX_TAPS);
    assert!(
        pwq >= phase_width(g),
        "padded plane narrower than the kernel reads"
    );
    assert!(
        x.len() >= plane_len(g, pwq),
        "padded plane shorter than the kernel reads"
    );
    assert!(taps.len() >= g.kh * g.kw && out.len() >= g.oh * g.ow);
    #[cfg(target_arch = "x86_64")]
    {
        if isa.has_avx512() && Isa::detect().has_avx512() {
            // SAFETY: AVX-512 detected on this CPU (npuc's avx512 level includes FMA); the
            // body is safe Rust over slices whose sizes were asserted above.
            unsafe { dw_plane_avx512(x, pwq, taps, g, out) };
            return;
        }
        if isa.has_avx2() && Isa::detect().has_avx2() {
            // SAFETY: AVX2 and FMA (npuc's avx2 level) detected; safe Rust body, sizes asserted.
            unsafe { dw_plane_avx2(x, pwq, taps, g, out) };
            return;
        }
    }
    let _ = isa;
    dw_plane_scalar(x, pwq, taps, g, out)
}

/// Fills the padded, phase-split plane `plane` ([`plane_len`] values, `pwq` per phase row)
/// of one input channel `src` (`ih x iw` codes, row-major) for geometry `g` with the leading
/// padding `(pt, pl)`: padded value (r, c) is `src[r - pt][c - pl] - zx` where that exists, 0
/// elsewhere (the padding is the real value 0). At the process-wide level.
///
/// # Panics
/// If `src` holds fewer than `ih * iw` values or `plane` fewer than [`plane_len`].
pub fn fill_plane<X: QInt>(
    src: &[X],
    dims: (usize, usize),
    pads: (usize, usize),
    zx: i32,
    g: &DwGeom,
    pwq: usize,
    plane: &mut [f32],
) {
    fill_plane_with(Isa::detect(), src, dims, pads, zx, g, pwq, plane)
}

/// [`fill_plane`] at an explicit level (tests compare the levels).
#[allow(clippy::too_many_arguments)]
pub fn fill_plane_with<X: QInt>(
    isa: Isa,
    src: &[X],
    dims: (usize, usize),
    pads: (usize, usize),
    zx: i32,
    g: &DwGeom,
    pwq: usize,
    plane: &mut [f32],
) {
    assert!(src.len() >= dims.0 * dims.1 && plane.len() >= plane_len(g, pwq) && g.sw > 0);
    #[cfg(target_arch = "x86_64")]
    {
        if isa.has_avx512() && Isa::detect().has_avx512() {
            // SAFETY: AVX-512 detected on this CPU; the body is safe Rust.
            unsafe { fill_plane_avx512(src, dims, pads, zx, g, pwq, plane) };
            return;
        }
        if isa.has_avx2() && Isa::detect().has_avx2() {
            // SAFETY: AVX2 detected on this CPU; the body is safe Rust.
            unsafe { fill_plane_avx2(src, dims, pads, zx, g, pwq, plane) };
            return;
        }
    }
    let _ = isa;
    fill_plane_body(src, dims, pads, zx, g, pwq, plane)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn fill_plane_avx512<X: QInt>(
    src: &[X],
    dims: (usize, usize),
    pads: (usize, usize),
    zx: i32,
    g: &DwGeom,
    pwq: usize,
    plane: &mut [f32],
) {
    fill_plane_body(src, dims, pads, zx, g, pwq, plane)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fill_plane_avx2<X: QInt>(
    src: &[X],
    dims: (usize, usize),
    pads: (usize, usize),
    zx: i32,
    g: &DwGeom,
    pwq: usize,
    plane: &mut [f32],
) {
    fill_plane_body(src, dims, pads, zx, g, pwq, plane)
}

/// The body of [`fill_plane`] (every level; the scalar twin at the baseline). Column ranges
/// per phase are computed once per row, so the copy is a strided (for `sw == 1` contiguous)
/// conversion loop with no division per value.
#[inline(always)]
fn fill_plane_body<X: QInt>(
    src: &[X],
    (ih, iw): (usize, usize),
    (pt, pl): (usize, usize),
    zx: i32,
    g: &DwGeom,
    pwq: usize,
    plane: &mut [f32],
) {
    let (sw, pw) = (g.sw, cols_needed(g));
    // Padded columns with an input value: lo..hi.
    let (lo, hi) = (pl.min(pw), (pl + iw).min(pw));
    let conv = |v: &X| (v.to_i32() - zx) as f32;
    for (py, row) in plane[..rows_needed(g) * sw * pwq]
        .chunks_exact_mut(sw * pwq)
        .enumerate()
    {
        let iy = py as isize - pt as isize;
        if iy < 0 || iy >= ih as isize {
            row.fill(0.0);
            continue;
        }
        let srow = &src[iy as usize * iw..(iy as usize + 1) * iw];
        for (q, dst) in row.chunks_exact_mut(pwq).enumerate() {
            // Phase q's j-th value is padded column q + j * sw: the valid j are j0..j1.
            let j1 = if hi > q { (hi - q).div_ceil(sw) } else { 0 }.min(pwq);
            let j0 = lo.saturating_sub(q).div_ceil(sw).min(j1);
            dst[..j0].fill(0.0);
            dst[j1..].fill(0.0);
            if j0 == j1 {
                continue;
            }
            let first = q + j0 * sw - pl;
            if sw == 1 {
                for (d, v) in dst[j0..j1].iter_mut().zip(&srow[first..]) {
                    *d = conv(v);
                }
            } else {
                for (d, v) in dst[j0..j1].iter_mut().zip(srow[first..].iter().step_by(sw)) {
                    *d = conv(v);
                }
            }
        }
    }
}

/// Output columns per accumulator vector.
const LANES: usize = 16;

/// The most accumulator vectors of one block (a row of up to 128 output columns in one pass).
const MAX_VECS: usize = 8;

/// `B` vectors of [`LANES`] output columns whose tap `t` reads `x[base + offs[t]..]` (fixed-size
/// arrays, so the accumulators stay in registers across all taps); the first `len` are stored.
#[inline(always)]
fn dw_block<const B: usize>(
    x: &[f32],
    base: usize,
    offs: &[usize],
    taps: &[f32],
    len: usize,
    out: &mut [i32],
) {
    let mut acc = [[0f32; LANES]; B];
    for (&o, &t) in offs.iter().zip(taps) {
        let src = &x[base + o..base + o + B * LANES];
        for (a, v) in acc.iter_mut().zip(src.chunks_exact(LANES)) {
            for (a, &v) in a.iter_mut().zip(v) {
                *a = v.mul_add(t, *a);
            }
        }
    }
    // The sums are exact integers of magnitude <= 2^24 for the operands the module docs
    // state; the clamp keeps any other input (and NaN, which `max` drops) inside i32 too.
    for (o, &a) in out[..len].iter_mut().zip(acc.as_flattened()) {
        // Not `clamp`: it keeps NaN, which the conversion below must never see.
        #[allow(clippy::manual_clamp)]
        let a = a.max(-16_777_216.0).min(16_777_216.0);
        // SAFETY: `a` is finite and within i32's range after the clamp (`to_int_unchecked`'s
        // requirement); unlike `as i32` it vectorizes to one truncating conversion.
        *o = unsafe { a.to_int_unchecked::<i32>() };
    }
}

/// The body shared by every level (safe Rust; bounds are checked by the slicing).
#[inline(always)]
fn dw_plane_body(x: &[f32], pwq: usize, taps: &[f32], g: &DwGeom, out: &mut [i32]) {
    let (ow, ntaps) = (g.ow, g.kh * g.kw);
    // Where each tap reads, relative to its output row's first input row (no division in the
    // loops).
    let mut offs = [0usize; MAX_TAPS];
    for ky in 0..g.kh {
        for kx in 0..g.kw {
            let c = kx * g.dw;
            offs[ky * g.kw + kx] = (ky * g.dh * g.sw + c % g.sw) * pwq + c / g.sw;
        }
    }
    let (offs, taps) = (&offs[..ntaps], &taps[..ntaps]);
    // A row's vectors in near-equal blocks of at most MAX_VECS (10 vectors: 5 + 5, not 8 + 2).
    let vecs = ow.div_ceil(LANES);
    let per = vecs.div_ceil(vecs.div_ceil(MAX_VECS).max(1)).max(1);
    for oy in 0..g.oh {
        let row = oy * g.sh * g.sw * pwq;
        let orow = &mut out[oy * ow..(oy + 1) * ow];
        let mut v0 = 0;
        while v0 < vecs {
            let nv = per.min(vecs - v0);
            let ox0 = v0 * LANES;
            let len = (nv * LANES).min(ow - ox0);
            let (base, o) = (row + ox0, &mut orow[ox0..]);
            match nv {
                8 => dw_block::<8>(x, base, offs, taps, len, o),
                7 => dw_block::<7>(x, base, offs, taps, len, o),
                6 => dw_block::<6>(x, base, offs, taps, len, o),
                5 => dw_block::<5>(x, base, offs, taps, len, o),
                4 => dw_block::<4>(x, base, offs, taps, len, o),
                3 => dw_block::<3>(x, base, offs, taps, len, o),
                2 => dw_block::<2>(x, base, offs, taps, len, o),
                _ => dw_block::<1>(x, base, offs, taps, len, o),
            }
            v0 += nv;
        }
    }
}

/// The scalar twin (baseline target).
pub fn dw_plane_scalar(x: &[f32], pwq: usize, taps: &[f32], g: &DwGeom, out: &mut [i32]) {
    dw_plane_body(x, pwq, taps, g, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dw_plane_avx2(x: &[f32], pwq: usize, taps: &[f32], g: &DwGeom, out: &mut [i32]) {
    dw_plane_body(x, pwq, taps, g, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn dw_plane_avx512(x: &[f32], pwq: usize, taps: &[f32], g: &DwGeom, out: &mut [i32]) {
    dw_plane_body(x, pwq, taps, g, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::xorshift;

    /// The sum by definition, one output at a time, from the plain (not phase-split) plane.
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
            // Case 0: 256 taps at the extremes, partial sums up to 256 * 65025 < 2^24.
            let kh = if case == 0 {
                16
            } else {
                1 + (xorshift(&mut s) % 5) as usize
            };
            let kw = if case == 0 {
                16
            } else {
                1 + (xorshift(&mut s) % 5) as usize
            };
            let sh = 1 + (xorshift(&mut s) % 2) as usize;
            let sw = 1 + (xorshift(&mut s) % 3) as usize;
            let dh = 1 + (xorshift(&mut s) % 2) as usize;
            let dw = 1 + (xorshift(&mut s) % 2) as usize;
            let oh = 1 + (xorshift(&mut s) % 6) as usize;
            let ow = 1 + (xorshift(&mut s) % 150) as usize;
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
            let val = |s: &mut u64| -> i16 {
                if extreme {
                    if xorshift(s).is_multiple_of(2) {
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
            // The phase-split f32 plane the kernel reads (padding beyond `pw` stays 0).
            let pwq = phase_width(&g).max(pw.div_ceil(sw)) + (case % 2);
            let mut xs = vec![0f32; plane_len(&g, pwq)];
            for r in 0..rows {
                for c in 0..pw {
                    xs[phase_index(&g, pwq, r, c)] = x[r * pw + c] as f32;
                }
            }
            let tf: Vec<f32> = taps.iter().map(|&t| t as f32).collect();
            let mut got = vec![7i32; oh * ow];
            dw_plane_scalar(&xs, pwq, &tf, &g, &mut got);
            assert_eq!(got, want, "scalar, case {case}: {g:?} pw {pw}");
            for isa in Isa::ALL.into_iter().filter(|&l| l <= Isa::detect()) {
                let mut got = vec![7i32; oh * ow];
                dw_plane_with(isa, &xs, pwq, &tf, &g, &mut got);
                assert_eq!(got, want, "{}, case {case}: {g:?} pw {pw}", isa.name());
            }
        }
    }

    /// Operands outside the contract (NaN, infinities, sums past 2^24) give clamped values at
    /// every level, the same at each, never undefined conversions.
    #[test]
    fn out_of_contract_operands_are_clamped() {
        let g = DwGeom {
            kh: 1,
            kw: 1,
            sh: 1,
            sw: 1,
            dh: 1,
            dw: 1,
            oh: 1,
            ow: 20,
        };
        let pwq = phase_width(&g);
        let mut x = vec![0f32; plane_len(&g, pwq)];
        x[0] = f32::NAN;
        x[2] = f32::INFINITY;
        x[4] = -1e30;
        x[6] = 1e9;
        let taps = [1.0f32];
        let mut want = vec![0i32; 20];
        dw_plane_scalar(&x, pwq, &taps, &g, &mut want);
        assert_eq!(
            want[..8],
            [-16_777_216, 0, 16_777_216, 0, -16_777_216, 0, 16_777_216, 0]
        );
        for isa in Isa::ALL.into_iter().filter(|&l| l <= Isa::detect()) {
            let mut got = vec![7i32; 20];
            dw_plane_with(isa, &x, pwq, &taps, &g, &mut got);
            assert_eq!(got, want, "{}", isa.name());
        }
    }

    /// The plane fill equals the definition (padded value (r, c) = input (r - pt, c - pl) minus
    /// the zero point, else 0, at its phase-split index) at every level, u8 and i8 codes.
    #[test]
    fn fill_plane_matches_definition_at_every_level() {
        let mut s = 0xf111_u64;
        for case in 0..200 {
            let r = |s: &mut u64, n: u64| (xorshift(s) % n) as usize;
            let g = DwGeom {
                kh: 1 + r(&mut s, 5),
                kw: 1 + r(&mut s, 5),
                sh: 1 + r(&mut s, 2),
                sw: 1 + r(&mut s, 3),
                dh: 1 + r(&mut s, 2),
                dw: 1 + r(&mut s, 2),
                oh: 1 + r(&mut s, 5),
                ow: 1 + r(&mut s, 40),
            };
            let (ih, iw) = (1 + r(&mut s, 12), 1 + r(&mut s, 50));
            let (pt, pl) = (r(&mut s, 3), r(&mut s, 3));
            let zx = r(&mut s, 256) as i32;
            let src: Vec<u8> = (0..ih * iw).map(|_| xorshift(&mut s) as u8).collect();
            let pwq = phase_width(&g) + case % 2;
            // The definition over the codes' integer values, minus the zero point.
            let define = |vals: &[i32], zp: i32| {
                let mut w = vec![0f32; plane_len(&g, pwq)];
                for row in 0..rows_needed(&g) {
                    for c in 0..cols_needed(&g) {
                        let (iy, ix) = (row as isize - pt as isize, c as isize - pl as isize);
                        if iy >= 0 && ix >= 0 && (iy as usize) < ih && (ix as usize) < iw {
                            w[phase_index(&g, pwq, row, c)] =
                                (vals[iy as usize * iw + ix as usize] - zp) as f32;
                        }
                    }
                }
                w
            };
            let signed: Vec<i8> = src.iter().map(|&v| v as i8).collect();
            let want = define(&src.iter().map(|&v| v as i32).collect::<Vec<_>>(), zx);
            let want_i8 = define(
                &signed.iter().map(|&v| v as i32).collect::<Vec<_>>(),
                zx - 128,
            );
            for isa in Isa::ALL.into_iter().filter(|&l| l <= Isa::detect()) {
                let mut got = vec![7f32; plane_len(&g, pwq)];
                fill_plane_with(isa, &src, (ih, iw), (pt, pl), zx, &g, pwq, &mut got);
                let n = rows_needed(&g) * g.sw * pwq;
                assert_eq!(got[..n], want[..n], "u8 {}, case {case}: {g:?}", isa.name());
                let mut got = vec![7f32; plane_len(&g, pwq)];
                fill_plane_with(
                    isa,
                    &signed,
                    (ih, iw),
                    (pt, pl),
                    zx - 128,
                    &g,
                    pwq,
                    &mut got,
                );
                assert_eq!(
                    got[..n],
                    want_i8[..n],
                    "i8 {}, case {case}: {g:?}",
                    isa.name()
                );
            }
        }
    }
}
