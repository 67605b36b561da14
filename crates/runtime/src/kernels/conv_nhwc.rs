//! Channels-last (NHWC) depthwise convolution, one output row at a time.
//!
//! In NHWC the channels of one pixel are contiguous, so a depthwise convolution is, per output
//! pixel, a sum over the kernel taps of `x[pixel + tap][c] * w[tap][c]` with `c` running over
//! contiguous memory in both operands: sixteen lanes of channels per vector and no gathering.
//! (In NCHW the same op walks short spatial rows per channel and per tap, which is what made it
//! a fifth of the PP-OCR recogniser's time.)
//!
//! [`dw_row`] computes one output row. The pixels whose taps all fall inside the image (the
//! interior, nearly all of a row) go four at a time: four accumulators of 16 channels stay in
//! registers across the taps, each tap's weights loaded once for the four. Border pixels skip
//! their padding taps one pixel at a time. Why per row and not per pixel: the per-pixel kernel
//! rebuilt and bounds-checked a tap list and made a call per pixel, which cost ~270 cycles per
//! 16-channel 3x3 pixel (18 vector FMAs) on PP-OCRv5's classifier.
//!
//! The interior runs on AVX-512F or AVX2+FMA intrinsics chosen at run time (eight pixels'
//! accumulators in registers, one fused multiply-add per tap and vector, channel tails masked);
//! the borders and the scalar twin are safe Rust. The SIMD paths sum the taps in the twin's
//! order and differ from it only by FMA's single rounding per step. (A safe-Rust interior over
//! 16-lane arrays vectorized too, but its bounds checks and address arithmetic left it at ~6
//! cycles per vector multiply-add.)

use std::ops::Range;

/// Channels per vector block.
const L: usize = 16;
/// Interior pixels computed together by the scalar twin.
const P: usize = 4;

/// A depthwise convolution's geometry over one image: input `h x wd x c` (NHWC, batch
/// excluded), kernel `kh x kw`, strides, dilations and leading pads (trailing pads only shorten
/// the output, which `ow` records).
#[derive(Clone, Copy, Debug)]
pub struct DwGeom {
    pub h: usize,
    pub wd: usize,
    pub c: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: [usize; 2],
    pub dilation: [usize; 2],
    pub pad: [usize; 2],
    pub ow: usize,
}

impl DwGeom {
    /// The output columns whose horizontal taps all fall inside the input: `lo..hi`.
    fn interior(&self) -> (usize, usize) {
        let [_, sx] = self.stride;
        let [_, dx] = self.dilation;
        let [_, px] = self.pad;
        let lo = px.div_ceil(sx.max(1)).min(self.ow);
        let span = (self.kw - 1) * dx;
        // ox * sx + span - px <= wd - 1
        let hi = match (self.wd + px).checked_sub(span + 1) {
            Some(v) => (v / sx.max(1) + 1).min(self.ow),
            None => 0,
        };
        (lo, hi.max(lo))
    }

    fn valid(&self) -> bool {
        self.c > 0
            && self.kh > 0
            && self.kw > 0
            && self.stride.iter().all(|&s| s > 0)
            && self.dilation.iter().all(|&d| d > 0)
    }
}

/// Output row `oy` of a depthwise convolution: `out[ox][c] = bias[c] + sum over valid taps of
/// x[iy][ix][c] * w[ky][kx][c]` (`out` is `ow * c` values, `x` the image's `h * wd * c`, `w`
/// the taps' `kh * kw * c`, `bias` `c` values when present).
///
/// Returns `false`, computing nothing, when the slices do not have those sizes (a caller bug,
/// reported as an error there); never panics on them.
#[must_use]
pub fn dw_row(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    oy: usize,
) -> bool {
    dw_row_cols(out, x, w, bias, g, oy, 0..g.ow)
}

/// Output columns `cols` of row `oy` (as [`dw_row`]; `out` holds those `cols.len() * c`
/// values): threads split a row this way when an image has fewer rows than threads need.
#[must_use]
pub fn dw_row_cols(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    oy: usize,
    cols: Range<usize>,
) -> bool {
    if !sizes_fit(out, x, w, bias, g, &cols) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let isa = npuc_isa::Isa::detect();
        if isa.has_avx512() {
            // SAFETY: the ISA module detected AVX-512F (with AVX2 and FMA) on this CPU (capped
            // by NPUC_ISA); the body is safe Rust over slices whose sizes were checked above.
            unsafe { dw_row_avx512(out, x, w, bias, g, oy, cols) };
            return true;
        }
        if isa.has_avx2() {
            // SAFETY: the ISA module detected AVX2 and FMA on this CPU (capped by NPUC_ISA);
            // the body is safe Rust over slices whose sizes were checked above.
            unsafe { dw_row_avx2(out, x, w, bias, g, oy, cols) };
            return true;
        }
    }
    dw_row_body(out, x, w, bias, g, oy, cols);
    true
}

fn sizes_fit(
    out: &[f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    cols: &Range<usize>,
) -> bool {
    g.valid()
        && cols.start <= cols.end
        && cols.end <= g.ow
        && out.len() == cols.len() * g.c
        && x.len() == g.h * g.wd * g.c
        && w.len() == g.kh * g.kw * g.c
        && bias.is_none_or(|b| b.len() == g.c)
}

/// The scalar twin of the dispatched copies (baseline target).
#[must_use]
pub fn dw_row_scalar(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    oy: usize,
    cols: Range<usize>,
) -> bool {
    if !sizes_fit(out, x, w, bias, g, &cols) {
        return false;
    }
    dw_row_body(out, x, w, bias, g, oy, cols);
    true
}

/// Which interior micro-kernel a SIMD copy of the row loop uses.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Simd {
    Avx2,
    Avx512,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dw_row_avx2(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    oy: usize,
    cols: Range<usize>,
) {
    // SAFETY: the caller checked the slice sizes against `g` and detected AVX2+FMA.
    unsafe { dw_row_simd(out, x, w, bias, g, oy, cols, Simd::Avx2) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dw_row_avx512(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    oy: usize,
    cols: Range<usize>,
) {
    // SAFETY: the caller checked the slice sizes against `g` and detected AVX-512F.
    unsafe { dw_row_simd(out, x, w, bias, g, oy, cols, Simd::Avx512) }
}

/// The row with the interior in SIMD blocks of 8, then 4, then 1 pixels, the borders in the
/// scalar body's per-pixel loop.
///
/// # Safety
/// `sizes_fit(out, x, w, bias, g)` holds, and the CPU has the features `simd` names.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dw_row_simd(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    oy: usize,
    cols: Range<usize>,
    simd: Simd,
) {
    let (lo, hi) = g.interior();
    let c = g.c;
    let o0 = cols.start;
    for ox in (o0..lo.min(cols.end)).chain(hi.max(o0)..cols.end) {
        match simd {
            // SAFETY: ox is an output column inside `cols` (sizes checked by the caller) and
            // the CPU has AVX-512F.
            Simd::Avx512 => unsafe { edge_pixel_avx512(out, x, w, bias, g, oy, ox, o0) },
            Simd::Avx2 => single_pixel(&mut out[(ox - o0) * c..][..c], x, w, bias, g, oy, ox),
        }
    }
    // The interior within `cols`.
    let (lo, hi) = (lo.max(o0), hi.min(cols.end));
    let mut rows = [(0usize, 0usize); 64];
    let mut nrows = 0;
    for (ky, iy) in rows_in(g, oy) {
        if nrows == rows.len() {
            // Kernels taller than 64 rows: the interior goes through the scalar body too.
            for ox in lo..hi {
                single_pixel(&mut out[(ox - o0) * c..][..c], x, w, bias, g, oy, ox);
            }
            return;
        }
        rows[nrows] = (ky, iy);
        nrows += 1;
    }
    let rows = &rows[..nrows];
    let mut ox = lo;
    if matches!(simd, Simd::Avx512) && g.stride[1] == 1 && g.dilation[1] == 1 {
        // SAFETY (both calls): as the blocks' below; stride and dilation 1 as required.
        match g.kw {
            3 => {
                while ox + SLIDE <= hi {
                    unsafe { sliding_block_avx512::<3, SLIDE>(out, x, w, bias, g, rows, ox, o0) };
                    ox += SLIDE;
                }
            }
            5 => {
                while ox + SLIDE <= hi {
                    unsafe { sliding_block_avx512::<5, SLIDE>(out, x, w, bias, g, rows, ox, o0) };
                    ox += SLIDE;
                }
            }
            _ => {}
        }
    }
    if matches!(simd, Simd::Avx2) && g.stride[1] == 1 && g.dilation[1] == 1 {
        // SAFETY (both calls): as the blocks' below; stride and dilation 1 as required.
        match g.kw {
            3 => {
                while ox + SLIDE <= hi {
                    unsafe { sliding_block_avx2::<3, SLIDE>(out, x, w, bias, g, rows, ox, o0) };
                    ox += SLIDE;
                }
            }
            5 => {
                while ox + SLIDE <= hi {
                    unsafe { sliding_block_avx2::<5, SLIDE>(out, x, w, bias, g, rows, ox, o0) };
                    ox += SLIDE;
                }
            }
            _ => {}
        }
    }
    // SAFETY (all three calls): lo <= ox and ox + P <= hi, so every pixel's taps lie inside
    // the image (`interior`), the rows are inside it (`rows_in`), and the sizes fit (caller).
    while ox + 8 <= hi {
        unsafe { interior_block::<8>(out, x, w, bias, g, rows, ox, o0, simd) };
        ox += 8;
    }
    if ox + 4 <= hi {
        unsafe { interior_block::<4>(out, x, w, bias, g, rows, ox, o0, simd) };
        ox += 4;
    }
    while ox < hi {
        unsafe { interior_block::<1>(out, x, w, bias, g, rows, ox, o0, simd) };
        ox += 1;
    }
}

/// One output pixel with padding taps skipped (a row's border pixels), AVX-512: per channel
/// block the sum stays in a register across the taps. The portable [`single_pixel`] adds into
/// the output slice tap by tap (a load and a store per vector and tap), and the few border
/// pixels of each row took as long as a quarter of its interior.
///
/// # Safety
/// `sizes_fit(out, x, w, bias, g, cols)` with `cols.start == o0 <= ox < cols.end`; the CPU
/// has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn edge_pixel_avx512(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    oy: usize,
    ox: usize,
    o0: usize,
) {
    use std::arch::x86_64::*;
    let c = g.c;
    let [_, sx] = g.stride;
    let [_, dx] = g.dilation;
    let [_, px] = g.pad;
    let row_len = g.wd * c;
    let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
    let mask = |c0: usize| -> __mmask16 {
        let lanes = (c - c0).min(16);
        if lanes == 16 {
            0xffff
        } else {
            (1u16 << lanes) - 1
        }
    };
    // EDGE_BLOCKS channel blocks at a time: independent sums, so the multiply-adds of a tap
    // overlap instead of waiting on one chain's latency tap after tap.
    let mut c0 = 0;
    while c0 < c {
        let nb = (c - c0).div_ceil(16).min(EDGE_BLOCKS);
        let m: [__mmask16; EDGE_BLOCKS] = std::array::from_fn(|b| mask((c0 + 16 * b).min(c - 1)));
        // SAFETY: loads and stores masked to the channels of blocks c0 + 16 b < c (b < nb):
        // taps ky < kh, kx < kw inside `w`, input pixels (iy, ix) with iy < h (`rows_in`) and
        // ix < wd (checked), and output pixel ox - o0 inside `out` (contract).
        unsafe {
            let mut acc = [_mm512_setzero_ps(); EDGE_BLOCKS];
            if let Some(b) = bias {
                for (j, a) in acc.iter_mut().enumerate().take(nb) {
                    *a = _mm512_maskz_loadu_ps(m[j], b.as_ptr().add(c0 + 16 * j));
                }
            }
            for (ky, iy) in rows_in(g, oy) {
                for kx in 0..g.kw {
                    let Some(ix) = (ox * sx + kx * dx).checked_sub(px) else {
                        continue;
                    };
                    if ix >= g.wd {
                        continue;
                    }
                    let xt = xp.add(iy * row_len + ix * c + c0);
                    let wt = wp.add((ky * g.kw + kx) * c + c0);
                    for (j, a) in acc.iter_mut().enumerate().take(nb) {
                        let xv = _mm512_maskz_loadu_ps(m[j], xt.add(16 * j));
                        let wv = _mm512_maskz_loadu_ps(m[j], wt.add(16 * j));
                        *a = _mm512_fmadd_ps(xv, wv, *a);
                    }
                }
            }
            for (j, a) in acc.iter().enumerate().take(nb) {
                _mm512_mask_storeu_ps(op.add((ox - o0) * c + c0 + 16 * j), m[j], *a);
            }
        }
        c0 += 16 * nb;
    }
}

/// Channel blocks [`edge_pixel_avx512`] sums at once.
const EDGE_BLOCKS: usize = 4;

/// Output pixels per block of [`sliding_block_avx512`].
const SLIDE: usize = 8;

/// Output pixels `ox .. ox + N` (all interior) of a stride-1, dilation-1 row with a `KW`-wide
/// kernel, AVX-512: per channel block and kernel row, the `KW` weight vectors stay in registers
/// and each of the `N + KW - 1` input pixels the block reads is loaded once and multiplied into
/// every output it reaches. [`interior_block`] loads an input vector per tap and output, more
/// loads than multiply-adds, which left the depthwise convs load-bound at a quarter of the FMA
/// rate. Each output still sums its taps in the twin's order (kernel rows, then columns).
///
/// # Safety
/// As [`interior_block`], with `g.stride[1] == 1`, `g.dilation[1] == 1`, `g.kw == KW`, and the
/// CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn sliding_block_avx512<const KW: usize, const N: usize>(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    rows: &[(usize, usize)],
    ox: usize,
    o0: usize,
) {
    use std::arch::x86_64::*;
    let c = g.c;
    let [_, px] = g.pad;
    let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
    let row_len = g.wd * c;
    let mut c0 = 0;
    while c0 < c {
        let lanes = (c - c0).min(16);
        let m: __mmask16 = if lanes == 16 {
            0xffff
        } else {
            (1u16 << lanes) - 1
        };
        // SAFETY: every load and store is masked to `lanes` channels from channel c0 < c of
        // a tap inside `w` (ky < kh, kx < KW), of input pixels ox - px .. ox - px + N + KW - 1
        // of row iy (inside the row: the block's pixels are interior, stride and dilation 1),
        // or of output pixels ox - o0 .. ox - o0 + N inside `out` (contract).
        unsafe {
            let init = match bias {
                Some(b) => _mm512_maskz_loadu_ps(m, b.as_ptr().add(c0)),
                None => _mm512_setzero_ps(),
            };
            let mut acc = [init; N];
            for &(ky, iy) in rows {
                let wrow = wp.add(ky * KW * c + c0);
                let wv: [__m512; KW] =
                    std::array::from_fn(|kx| _mm512_maskz_loadu_ps(m, wrow.add(kx * c)));
                let xrow = xp.add(iy * row_len + (ox - px) * c + c0);
                for j in 0..N + KW - 1 {
                    let xv = _mm512_maskz_loadu_ps(m, xrow.add(j * c));
                    // Input pixel j is tap kx of output j - kx; kx ascending per output.
                    for (kx, wk) in wv.iter().enumerate() {
                        if j >= kx && j - kx < N {
                            acc[j - kx] = _mm512_fmadd_ps(xv, *wk, acc[j - kx]);
                        }
                    }
                }
            }
            for (p, a) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(op.add((ox - o0 + p) * c + c0), m, *a);
            }
        }
        c0 += 16;
    }
}

/// Output pixels `ox .. ox + N` (all interior) over every channel: `N` accumulators of one
/// channel block in registers across the taps; `out` starts at output column `o0`.
///
/// # Safety
/// `sizes_fit(out, x, w, bias, g, cols)` with `cols.start == o0 <= ox`, `ox + N <= cols.end`;
/// `g.interior().0 <= ox`, `ox + N <= g.interior().1`; each
/// `(ky, iy)` in `rows` has `ky < g.kh`, `iy < g.h`; the CPU has the features `simd` names.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn interior_block<const N: usize>(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    rows: &[(usize, usize)],
    ox: usize,
    o0: usize,
    simd: Simd,
) {
    use std::arch::x86_64::*;
    let c = g.c;
    let [_, sx] = g.stride;
    let [_, dx] = g.dilation;
    let [_, px] = g.pad;
    let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
    let bp = bias.map(|b| b.as_ptr());
    let row_len = g.wd * c;
    let pix_step = sx * c;
    // Input offset of pixel `ox`'s tap `kx` in its row (>= 0 since `ox` is interior).
    let x0 = (ox * sx) * c;
    match simd {
        Simd::Avx512 => {
            let mut c0 = 0;
            while c0 < c {
                let lanes = (c - c0).min(16);
                let m: __mmask16 = if lanes == 16 {
                    0xffff
                } else {
                    (1u16 << lanes) - 1
                };
                // SAFETY: every load and store below is masked to `lanes` channels starting at
                // channel c0 < c of a pixel inside `x`/`out` and a tap inside `w`, per the
                // contract (interior pixels, rows inside the image, sizes checked).
                unsafe {
                    let init = match bp {
                        Some(b) => _mm512_maskz_loadu_ps(m, b.add(c0)),
                        None => _mm512_setzero_ps(),
                    };
                    let mut acc = [init; N];
                    for &(ky, iy) in rows {
                        let wrow = wp.add(ky * g.kw * c + c0);
                        // Pixel ox, tap 0: (ox * sx - px) in columns.
                        let xrow = xp.add(iy * row_len + x0 + c0 - px * c);
                        for kx in 0..g.kw {
                            let wv = _mm512_maskz_loadu_ps(m, wrow.add(kx * c));
                            let xt = xrow.add(kx * dx * c);
                            for (p, a) in acc.iter_mut().enumerate() {
                                let xv = _mm512_maskz_loadu_ps(m, xt.add(p * pix_step));
                                *a = _mm512_fmadd_ps(xv, wv, *a);
                            }
                        }
                    }
                    for (p, a) in acc.iter().enumerate() {
                        _mm512_mask_storeu_ps(op.add((ox - o0 + p) * c + c0), m, *a);
                    }
                }
                c0 += 16;
            }
        }
        Simd::Avx2 => {
            let mut c0 = 0;
            while c0 + 8 <= c {
                // SAFETY: as above, with unmasked 8-channel blocks inside c.
                unsafe {
                    let init = match bp {
                        Some(b) => _mm256_loadu_ps(b.add(c0)),
                        None => _mm256_setzero_ps(),
                    };
                    let mut acc = [init; N];
                    for &(ky, iy) in rows {
                        let wrow = wp.add(ky * g.kw * c + c0);
                        let xrow = xp.add(iy * row_len + x0 + c0 - px * c);
                        for kx in 0..g.kw {
                            let wv = _mm256_loadu_ps(wrow.add(kx * c));
                            let xt = xrow.add(kx * dx * c);
                            for (p, a) in acc.iter_mut().enumerate() {
                                let xv = _mm256_loadu_ps(xt.add(p * pix_step));
                                *a = _mm256_fmadd_ps(xv, wv, *a);
                            }
                        }
                    }
                    for (p, a) in acc.iter().enumerate() {
                        _mm256_storeu_ps(op.add((ox - o0 + p) * c + c0), *a);
                    }
                }
                c0 += 8;
            }
            channel_tail::<N>(out, x, w, bias, g, rows, ox, o0, c0);
        }
    }
}

/// Channels `c0..` (fewer than 8) of output pixels `ox .. ox + N` (interior): the AVX2 blocks'
/// sums with scalar FMAs, in the same order.
#[allow(clippy::too_many_arguments)]
fn channel_tail<const N: usize>(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    rows: &[(usize, usize)],
    ox: usize,
    o0: usize,
    c0: usize,
) {
    let c = g.c;
    if c0 >= c {
        return;
    }
    let [_, sx] = g.stride;
    let [_, dx] = g.dilation;
    let [_, px] = g.pad;
    let row_len = g.wd * c;
    for p in 0..N {
        let o = &mut out[(ox - o0 + p) * c + c0..][..c - c0];
        match bias {
            Some(b) => o.copy_from_slice(&b[c0..]),
            None => o.fill(0.0),
        }
        for &(ky, iy) in rows {
            for kx in 0..g.kw {
                let xo = iy * row_len + ((ox + p) * sx + kx * dx - px) * c + c0;
                let wo = (ky * g.kw + kx) * c + c0;
                for (j, a) in o.iter_mut().enumerate() {
                    *a = x[xo + j].mul_add(w[wo + j], *a);
                }
            }
        }
    }
}

/// [`sliding_block_avx512`] at AVX2: blocks of 8 channels (`KW` weight vectors and `N`
/// accumulators: at most 14 of the 16 registers), the channel tail through
/// [`channel_tail`]. Each output sums its taps in the twin's order. [`interior_block`]'s load
/// per tap and output made PP-OCRv5 cls's depthwise convs 13% of its run at AVX2.
///
/// # Safety
/// As [`sliding_block_avx512`], with AVX2 and FMA in place of AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn sliding_block_avx2<const KW: usize, const N: usize>(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    rows: &[(usize, usize)],
    ox: usize,
    o0: usize,
) {
    use std::arch::x86_64::*;
    let c = g.c;
    let [_, px] = g.pad;
    let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
    let row_len = g.wd * c;
    let mut c0 = 0;
    while c0 + 8 <= c {
        // SAFETY: every load and store covers channels c0..c0 + 8 <= c of a tap inside `w`
        // (ky < kh, kx < KW), of input pixels ox - px .. ox - px + N + KW - 1 of row iy
        // (inside the row: the block's pixels are interior, stride and dilation 1), or of
        // output pixels ox - o0 .. ox - o0 + N inside `out` (contract).
        unsafe {
            let init = match bias {
                Some(b) => _mm256_loadu_ps(b.as_ptr().add(c0)),
                None => _mm256_setzero_ps(),
            };
            let mut acc = [init; N];
            for &(ky, iy) in rows {
                let wrow = wp.add(ky * KW * c + c0);
                let wv: [__m256; KW] = std::array::from_fn(|kx| _mm256_loadu_ps(wrow.add(kx * c)));
                let xrow = xp.add(iy * row_len + (ox - px) * c + c0);
                for j in 0..N + KW - 1 {
                    let xv = _mm256_loadu_ps(xrow.add(j * c));
                    // Input pixel j is tap kx of output j - kx; kx ascending per output.
                    for (kx, wk) in wv.iter().enumerate() {
                        if j >= kx && j - kx < N {
                            acc[j - kx] = _mm256_fmadd_ps(xv, *wk, acc[j - kx]);
                        }
                    }
                }
            }
            for (p, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(op.add((ox - o0 + p) * c + c0), *a);
            }
        }
        c0 += 8;
    }
    channel_tail::<N>(out, x, w, bias, g, rows, ox, o0, c0);
}

/// One output pixel, padding taps skipped (borders, and the scalar body's remainder).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn single_pixel(
    acc: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    oy: usize,
    ox: usize,
) {
    let c = g.c;
    let [_, sx] = g.stride;
    let [_, dx] = g.dilation;
    let [_, px] = g.pad;
    let row_len = g.wd * c;
    match bias {
        Some(b) => acc.copy_from_slice(b),
        None => acc.fill(0.0),
    }
    for (ky, iy) in rows_in(g, oy) {
        let xrow = &x[iy * row_len..][..row_len];
        for kx in 0..g.kw {
            let Some(ix) = (ox * sx + kx * dx).checked_sub(px) else {
                continue;
            };
            if ix >= g.wd {
                continue;
            }
            let xs = &xrow[ix * c..][..c];
            let ws = &w[(ky * g.kw + kx) * c..][..c];
            for ((a, &xv), &wv) in acc.iter_mut().zip(xs).zip(ws) {
                *a += xv * wv;
            }
        }
    }
}

/// The kernel rows `ky` whose input row lies inside the image, with that input row.
#[inline(always)]
fn rows_in(g: &DwGeom, oy: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    (0..g.kh).filter_map(move |ky| {
        let iy = (oy * g.stride[0] + ky * g.dilation[0]).checked_sub(g.pad[0])?;
        (iy < g.h).then_some((ky, iy))
    })
}

#[inline(always)]
fn dw_row_body(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    g: &DwGeom,
    oy: usize,
    cols: Range<usize>,
) {
    let c = g.c;
    let o0 = cols.start;
    let (lo, hi) = g.interior();
    let (lo, hi) = (lo.max(o0), hi.min(cols.end).max(lo.max(o0)));
    let [_, sx] = g.stride;
    let [_, dx] = g.dilation;
    let [_, px] = g.pad;
    let row_len = g.wd * c;
    let mut ox = o0;
    while ox < cols.end {
        if ox < lo || ox >= hi || ox + P > hi {
            single_pixel(&mut out[(ox - o0) * c..][..c], x, w, bias, g, oy, ox);
            ox += 1;
            continue;
        }
        // Interior: P pixels, all taps valid, channel blocks of L then a tail.
        let block = &mut out[(ox - o0) * c..][..P * c];
        let mut c0 = 0;
        while c0 + L <= c {
            let mut acc = [[0f32; L]; P];
            if let Some(b) = bias {
                let b: &[f32; L] = b[c0..c0 + L].try_into().unwrap_or(&[0.0; L]);
                acc.iter_mut().for_each(|a| *a = *b);
            }
            for (ky, iy) in rows_in(g, oy) {
                let xrow = &x[iy * row_len..][..row_len];
                for kx in 0..g.kw {
                    let wb: &[f32; L] = w[(ky * g.kw + kx) * c + c0..][..L]
                        .try_into()
                        .unwrap_or(&[0.0; L]);
                    for (p, a) in acc.iter_mut().enumerate() {
                        let ix = (ox + p) * sx + kx * dx - px;
                        let xb: &[f32; L] =
                            xrow[ix * c + c0..][..L].try_into().unwrap_or(&[0.0; L]);
                        for l in 0..L {
                            a[l] += xb[l] * wb[l];
                        }
                    }
                }
            }
            for (p, a) in acc.iter().enumerate() {
                block[p * c + c0..][..L].copy_from_slice(a);
            }
            c0 += L;
        }
        if c0 < c {
            let t = c - c0;
            for p in 0..P {
                let acc = &mut block[p * c + c0..][..t];
                match bias {
                    Some(b) => acc.copy_from_slice(&b[c0..]),
                    None => acc.fill(0.0),
                }
                for (ky, iy) in rows_in(g, oy) {
                    let xrow = &x[iy * row_len..][..row_len];
                    for kx in 0..g.kw {
                        let ix = (ox + p) * sx + kx * dx - px;
                        let xs = &xrow[ix * c + c0..][..t];
                        let ws = &w[(ky * g.kw + kx) * c + c0..][..t];
                        for ((a, &xv), &wv) in acc.iter_mut().zip(xs).zip(ws) {
                            *a += xv * wv;
                        }
                    }
                }
            }
        }
        ox += P;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Straightforward depthwise conv of one row, summing the taps in the kernel's order.
    fn reference(x: &[f32], w: &[f32], bias: Option<&[f32]>, g: &DwGeom, oy: usize) -> Vec<f32> {
        let mut out = vec![0f32; g.ow * g.c];
        for ox in 0..g.ow {
            for ch in 0..g.c {
                let mut a = bias.map_or(0.0, |b| b[ch]);
                for ky in 0..g.kh {
                    for kx in 0..g.kw {
                        let iy =
                            (oy * g.stride[0] + ky * g.dilation[0]) as isize - g.pad[0] as isize;
                        let ix =
                            (ox * g.stride[1] + kx * g.dilation[1]) as isize - g.pad[1] as isize;
                        if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.wd as isize {
                            continue;
                        }
                        let (iy, ix) = (iy as usize, ix as usize);
                        a += x[(iy * g.wd + ix) * g.c + ch] * w[(ky * g.kw + kx) * g.c + ch];
                    }
                }
                out[ox * g.c + ch] = a;
            }
        }
        out
    }

    fn geom_strategy() -> impl Strategy<Value = (DwGeom, usize, bool, u64)> {
        (
            1usize..40,
            (1usize..5, 1usize..6),
            (1usize..3, 1usize..3),
            (1usize..3, 1usize..3),
            (0usize..3, 0usize..3),
            (1usize..6, 1usize..20),
            any::<bool>(),
            any::<u64>(),
        )
            .prop_filter_map(
                "kernel larger than the padded input",
                |(c, (kh, kw), (sy, sx), (dy, dx), (py, px), (h, wd), bias, seed)| {
                    let span_x = (kw - 1) * dx + 1;
                    let span_y = (kh - 1) * dy + 1;
                    if wd + 2 * px < span_x || h + 2 * py < span_y {
                        return None;
                    }
                    let ow = (wd + 2 * px - span_x) / sx + 1;
                    let oh = (h + 2 * py - span_y) / sy + 1;
                    let g = DwGeom {
                        h,
                        wd,
                        c,
                        kh,
                        kw,
                        stride: [sy, sx],
                        dilation: [dy, dx],
                        pad: [py, px],
                        ow,
                    };
                    Some((g, (seed as usize) % oh, bias, seed))
                },
            )
    }

    proptest! {
        /// The scalar twin is bit-identical to a plain per-tap loop, and the dispatched copy
        /// (AVX-512 or AVX2 on this machine, per NPUC_ISA) matches it up to FMA rounding (at
        /// most 25 taps of products in [-1, 1]: 1e-5 relative is ~80 f32 ulps of headroom),
        /// over strides, dilations, pads, channel counts with and without a vector tail, and
        /// rows with borders.
        #[test]
        fn simd_matches_scalar_and_reference((g, oy, with_bias, seed) in geom_strategy()) {
            let mut s = seed | 1;
            let mut rnd = || (super::super::xorshift(&mut s) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            let x: Vec<f32> = (0..g.h * g.wd * g.c).map(|_| rnd()).collect();
            let w: Vec<f32> = (0..g.kh * g.kw * g.c).map(|_| rnd()).collect();
            let b: Vec<f32> = (0..g.c).map(|_| rnd()).collect();
            let bias = with_bias.then_some(b.as_slice());
            let mut got = vec![f32::NAN; g.ow * g.c];
            prop_assert!(dw_row(&mut got, &x, &w, bias, &g, oy));
            let mut twin = vec![f32::NAN; g.ow * g.c];
            prop_assert!(dw_row_scalar(&mut twin, &x, &w, bias, &g, oy, 0..g.ow));
            let want = reference(&x, &w, bias, &g, oy);
            for i in 0..got.len() {
                prop_assert_eq!(twin[i].to_bits(), want[i].to_bits(), "value {} vs reference", i);
                let (a, b) = (got[i], twin[i]);
                prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "value {}: {} vs {}", i, a, b);
            }
            // The row computed in two column ranges (as threads split it), dispatched and
            // scalar, gives the same bits as in one piece.
            let cut = (seed as usize >> 8) % (g.ow + 1);
            let (mut left, mut right) = (vec![f32::NAN; cut * g.c], vec![f32::NAN; (g.ow - cut) * g.c]);
            prop_assert!(dw_row_cols(&mut left, &x, &w, bias, &g, oy, 0..cut));
            prop_assert!(dw_row_cols(&mut right, &x, &w, bias, &g, oy, cut..g.ow));
            let split: Vec<u32> = left.iter().chain(&right).map(|v| v.to_bits()).collect();
            prop_assert_eq!(split, got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            prop_assert!(dw_row_scalar(&mut left, &x, &w, bias, &g, oy, 0..cut));
            prop_assert!(dw_row_scalar(&mut right, &x, &w, bias, &g, oy, cut..g.ow));
            let split: Vec<u32> = left.iter().chain(&right).map(|v| v.to_bits()).collect();
            prop_assert_eq!(split, twin.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn mismatched_sizes_are_refused() {
        let g = DwGeom {
            h: 3,
            wd: 4,
            c: 2,
            kh: 3,
            kw: 3,
            stride: [1, 1],
            dilation: [1, 1],
            pad: [1, 1],
            ow: 4,
        };
        let (x, w) = (vec![1f32; 24], vec![1f32; 18]);
        let mut out = vec![0f32; 8];
        assert!(!dw_row(&mut out, &x[1..], &w, None, &g, 0));
        assert!(!dw_row(&mut out, &x, &w[1..], None, &g, 0));
        assert!(!dw_row(&mut out[1..], &x, &w, None, &g, 0));
        assert!(!dw_row(&mut out, &x, &w, Some(&[1.0]), &g, 0));
        assert!(!dw_row_cols(&mut out, &x, &w, None, &g, 0, 1..5));
        assert!(!dw_row_cols(&mut out, &x, &w, None, &g, 0, 1..4));
        assert!(!dw_row(
            &mut out,
            &x,
            &w,
            None,
            &DwGeom {
                stride: [0, 1],
                ..g
            },
            0
        ));
        assert!(dw_row(&mut out, &x, &w, None, &g, 1));
        // Middle row, column 1: all nine taps of ones on each channel.
        assert_eq!(out[2..4], [9.0, 9.0]);
        // Column 0: the left column of taps is padding.
        assert_eq!(out[..2], [6.0, 6.0]);
    }
}
