//! LPBQ ("low-power blockwise quantization", QAIRT's default LLM weight encoding): a linear
//! layer's weight is cut into blocks of `block` input channels per output channel; each block
//! has its own symmetric integer grid (`bw` bits, values `-2^(bw-1) ..= 2^(bw-1)-1`), but its
//! scale is not a free float: it is an unsigned integer `k` of `compressed_bw` bits
//! (`1 ..= 2^compressed_bw`) times one float scale per output channel. Hardware keeps one float
//! per channel and small integers per block (AIMET encodings 1.0.0: `enc_type: "LPBQ"`,
//! `per_block_int_scale`, `scale`, `compressed_bw`, `block_size`).
//!
//! How the numbers are chosen here: each block's ideal scale is `absmax / qmax`; the channel
//! scale is the largest ideal block scale divided by `2^compressed_bw`, so the widest block gets
//! `k = 2^compressed_bw` and loses nothing; every other block tries the integers around
//! `ideal / channel_scale` (one below the floor to one above the ceiling, clamped to the valid
//! range) and keeps the one whose round-to-nearest reconstruction of that block has the least
//! squared error. Rounding `k` up never clips, rounding it down can clip the block's extreme
//! value but refines the grid for the rest; the error decides, block by block.
//!
//! This module is pure arithmetic on one matrix: the ONNX quantizer (QDQ graphs, encodings) and
//! the LLM weight path (GGUF-built graphs) both call it, so both produce the same integers.

use anyhow::{bail, Result};
use rayon::prelude::*;

/// One LPBQ-quantized weight matrix, output channel major.
#[derive(Clone, Debug, PartialEq)]
pub struct LpbqWeight {
    /// Output channels (rows).
    pub rows: usize,
    /// Input channels per row (columns); a multiple of `block`.
    pub cols: usize,
    /// Input channels per block.
    pub block: usize,
    /// Bits of each weight value (4: values -8..=7).
    pub bw: u8,
    /// Bits of each per-block integer scale (4: values 1..=16).
    pub compressed_bw: u8,
    /// Quantized values, `rows x cols`, row-major.
    pub values: Vec<i8>,
    /// Per-block integer scales, `rows x (cols / block)`, row-major.
    pub int_scales: Vec<u16>,
    /// Per-output-channel float scale.
    pub channel_scales: Vec<f32>,
}

impl LpbqWeight {
    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / self.block
    }

    /// The effective scale of block `b` of row `r` (`channel_scale * k`, one f32 product: the
    /// value every consumer of these numbers must use).
    pub fn block_scale(&self, r: usize, b: usize) -> f32 {
        self.channel_scales[r] * self.int_scales[r * self.blocks_per_row() + b] as f32
    }

    /// All effective block scales, `rows x blocks_per_row`.
    pub fn block_scales(&self) -> Vec<f32> {
        let nb = self.blocks_per_row();
        (0..self.rows * nb)
            .map(|i| self.block_scale(i / nb, i % nb))
            .collect()
    }

    /// The dequantized matrix, `rows x cols`.
    pub fn dequantize(&self) -> Vec<f32> {
        let nb = self.blocks_per_row();
        let mut out = vec![0f32; self.rows * self.cols];
        for (i, o) in out.iter_mut().enumerate() {
            let (r, c) = (i / self.cols, i % self.cols);
            *o = self.values[i] as f32 * self.block_scale(r, c / self.block);
            debug_assert!(c / self.block < nb);
        }
        out
    }
}

/// Quantizes `w` (`rows x cols`, row-major, one row per output channel) as LPBQ.
///
/// Errors name the problem: `cols` not a multiple of `block`, unsupported bit widths, a
/// non-finite weight (with its row and column).
pub fn quantize(
    w: &[f32],
    rows: usize,
    cols: usize,
    block: usize,
    bw: u8,
    compressed_bw: u8,
) -> Result<LpbqWeight> {
    quantize_weighted(w, rows, cols, block, bw, compressed_bw, None)
}

/// [`quantize`] with the block-scale search weighting each input channel's squared error by
/// `importance[c]` (e.g. the mean square of that input channel's activations on calibration
/// data: then the search minimizes the expected error of the layer's output, diagonal
/// approximation of `||X (Q(W) - W)||^2`, instead of the weight's own error).
pub fn quantize_weighted(
    w: &[f32],
    rows: usize,
    cols: usize,
    block: usize,
    bw: u8,
    compressed_bw: u8,
    importance: Option<&[f32]>,
) -> Result<LpbqWeight> {
    if let Some(imp) = importance {
        if imp.len() != cols {
            bail!(
                "LPBQ: {} importance values for {cols} input channels",
                imp.len()
            );
        }
        if let Some(i) = imp.iter().position(|x| !x.is_finite() || *x < 0.0) {
            bail!(
                "LPBQ: importance of input channel {i} is {} (must be finite and >= 0)",
                imp[i]
            );
        }
    }
    if w.len() != rows * cols {
        bail!(
            "LPBQ: weight has {} values, expected {rows} x {cols}",
            w.len()
        );
    }
    if block == 0 || !cols.is_multiple_of(block) {
        bail!("LPBQ: block size {block} does not divide the {cols} input channels");
    }
    if !(2..=8).contains(&bw) {
        bail!("LPBQ: weight bit width {bw} unsupported (2..=8)");
    }
    if !(1..=15).contains(&compressed_bw) {
        bail!("LPBQ: compressed bit width {compressed_bw} unsupported (1..=15)");
    }
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        bail!(
            "LPBQ: weight value at row {}, column {} is {} (not finite)",
            i / cols,
            i % cols,
            w[i]
        );
    }
    let nb = cols / block;
    let qmax = ((1i32 << (bw - 1)) - 1) as f32;
    let qmin = -(1i32 << (bw - 1)) as f32;
    let kmax = 1u32 << compressed_bw;
    let mut int_scales = vec![0u16; rows * nb];
    let mut channel_scales = vec![0f32; rows];
    int_scales
        .par_chunks_mut(nb)
        .zip(channel_scales.par_iter_mut())
        .enumerate()
        .for_each(|(r, (ks, cs))| {
            let row = &w[r * cols..(r + 1) * cols];
            let ideal: Vec<f32> = row
                .chunks(block)
                .map(|b| b.iter().fold(0f32, |m, x| m.max(x.abs())) / qmax)
                .collect();
            let widest = ideal.iter().fold(0f32, |m, &s| m.max(s));
            if widest == 0.0 {
                // An all-zero row: any positive scale reconstructs it; 1 keeps the encodings valid.
                *cs = 1.0;
                ks.fill(1);
                return;
            }
            let c = widest / kmax as f32;
            *cs = c;
            for (bi, (blk, &s)) in row.chunks(block).zip(&ideal).enumerate() {
                let t = s / c;
                // Down to 60% of the ideal scale: clipping the extremes of a block can pay when
                // its grid then fits the bulk of its values (the error decides).
                let hi = (t.ceil() as i64 + 1).clamp(1, kmax as i64) as u32;
                // At most 16 candidates (wide integer scales would make the search quadratic).
                let lo = ((t * 0.6).floor() as i64).clamp(1, kmax as i64) as u32;
                let lo = lo.max(hi.saturating_sub(16)).max(1);
                let mut best = (f64::INFINITY, hi);
                for k in lo..=hi {
                    let sc = c * k as f32;
                    let imp = importance.map(|m| &m[bi * block..(bi + 1) * block]);
                    let err: f64 = blk
                        .iter()
                        .enumerate()
                        .map(|(j, &x)| {
                            let q = (x / sc).round().clamp(qmin, qmax);
                            let d = (q * sc - x) as f64;
                            d * d * imp.map_or(1.0, |m| m[j] as f64)
                        })
                        .sum();
                    if err < best.0 {
                        best = (err, k);
                    }
                }
                ks[bi] = best.1 as u16;
            }
        });
    // The values: every weight rounded on the chosen grid (the one rounding rule, shared with
    // grids read back from encodings).
    quantize_with_scales(
        w,
        rows,
        cols,
        block,
        bw,
        compressed_bw,
        int_scales,
        channel_scales,
    )
}

/// `w` quantized on a given LPBQ grid (the scales an encodings file records): every value
/// rounded to the nearest step of its block's scale `channel_scales[r] * int_scales[r][b]`, the
/// same arithmetic [`quantize_weighted`] uses for the scales it chooses, so its own scales give
/// back its own values.
#[allow(clippy::too_many_arguments)]
pub fn quantize_with_scales(
    w: &[f32],
    rows: usize,
    cols: usize,
    block: usize,
    bw: u8,
    compressed_bw: u8,
    int_scales: Vec<u16>,
    channel_scales: Vec<f32>,
) -> Result<LpbqWeight> {
    if w.len() != rows * cols {
        bail!(
            "LPBQ: weight has {} values, expected {rows} x {cols}",
            w.len()
        );
    }
    if block == 0 || !cols.is_multiple_of(block) {
        bail!("LPBQ: block size {block} does not divide the {cols} input channels");
    }
    if !(2..=8).contains(&bw) || !(1..=15).contains(&compressed_bw) {
        bail!("LPBQ: bit widths {bw}/{compressed_bw} unsupported (2..=8 / 1..=15)");
    }
    let nb = cols / block;
    if int_scales.len() != rows * nb || channel_scales.len() != rows {
        bail!(
            "LPBQ: {} block scales and {} channel scales for {rows} x {cols} in blocks of {block} (need {} and {rows})",
            int_scales.len(),
            channel_scales.len(),
            rows * nb
        );
    }
    let kmax = 1u32 << compressed_bw;
    if let Some(p) = int_scales
        .iter()
        .position(|&k| k == 0 || u32::from(k) > kmax)
    {
        bail!(
            "LPBQ: integer block scale {} (row {}, block {}) outside 1..={kmax}",
            int_scales[p],
            p / nb,
            p % nb
        );
    }
    if let Some(r) = channel_scales
        .iter()
        .position(|s| !(s.is_finite() && *s > 0.0))
    {
        bail!(
            "LPBQ: channel scale of row {r} is {} (must be positive and finite)",
            channel_scales[r]
        );
    }
    let qmax = ((1i32 << (bw - 1)) - 1) as f32;
    let qmin = -(1i32 << (bw - 1)) as f32;
    let mut values = vec![0i8; rows * cols];
    values
        .par_chunks_mut(cols)
        .enumerate()
        .for_each(|(r, vals)| {
            let row = &w[r * cols..(r + 1) * cols];
            for (bi, (v, x)) in vals.chunks_mut(block).zip(row.chunks(block)).enumerate() {
                let sc = channel_scales[r] * int_scales[r * nb + bi] as f32;
                for (v, &x) in v.iter_mut().zip(x) {
                    *v = (x / sc).round().clamp(qmin, qmax) as i8;
                }
            }
        });
    Ok(LpbqWeight {
        rows,
        cols,
        block,
        bw,
        compressed_bw,
        values,
        int_scales,
        channel_scales,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [-0.5, 0.5) (also used by the GPTQ tests).
    pub(crate) fn lcg(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn own_scales_give_back_own_values() {
        let (rows, cols) = (24, 128);
        let w = lcg(rows * cols, 7);
        let q = quantize_weighted(&w, rows, cols, 32, 4, 4, None).unwrap();
        let again = quantize_with_scales(
            &w,
            rows,
            cols,
            32,
            4,
            4,
            q.int_scales.clone(),
            q.channel_scales.clone(),
        )
        .unwrap();
        assert_eq!(again, q);
        let mut bad = q.int_scales.clone();
        bad[5] = 17;
        let e = quantize_with_scales(&w, rows, cols, 32, 4, 4, bad, q.channel_scales.clone())
            .unwrap_err()
            .to_string();
        assert!(e.contains("17") && e.contains("row 1, block 1"), "{e}");
    }

    fn sqnr(a: &[f32], b: &[f32]) -> f64 {
        let s: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum();
        let e: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| ((x - y) as f64).powi(2))
            .sum();
        10.0 * (s / e).log10()
    }

    #[test]
    fn values_and_scales_stay_in_their_ranges() {
        let (rows, cols) = (16, 256);
        let mut w = lcg(rows * cols, 7);
        // One outlier block per row: its k must be the maximum, the others smaller.
        for r in 0..rows {
            w[r * cols + 3] = 8.0;
        }
        let q = quantize(&w, rows, cols, 64, 4, 4).unwrap();
        assert!(q.values.iter().all(|&v| (-8..=7).contains(&v)));
        assert!(q.int_scales.iter().all(|&k| (1..=16).contains(&k)));
        for r in 0..rows {
            assert_eq!(
                q.int_scales[r * 4],
                16,
                "row {r}: the widest block takes k = 2^cbw"
            );
            assert!(q.int_scales[r * 4 + 1] < 16);
        }
    }

    #[test]
    fn close_to_per_block_far_above_per_channel() {
        // Rows whose blocks differ in magnitude: per-channel int4 wastes its grid on the small
        // blocks, per-block float scales do not; LPBQ's 4-bit block scales must stay close to
        // the latter.
        let (rows, cols, block) = (32, 512, 32);
        let mut w = lcg(rows * cols, 11);
        for (i, x) in w.iter_mut().enumerate() {
            *x *= 1.0 + ((i % cols) / block) as f32 * 0.7;
        }
        let lp = quantize(&w, rows, cols, block, 4, 4).unwrap().dequantize();
        // Per-block float scales (absmax / 7, the plain per-block encoding).
        let pb: Vec<f32> = w
            .chunks(block)
            .flat_map(|b| {
                let s = b.iter().fold(0f32, |m, x| m.max(x.abs())) / 7.0;
                b.iter().map(move |&x| (x / s).round().clamp(-8.0, 7.0) * s)
            })
            .collect();
        let pc = quantize(&w, rows, cols, cols, 4, 1).unwrap().dequantize();
        let (s_lp, s_pb, s_pc) = (sqnr(&w, &lp), sqnr(&w, &pb), sqnr(&w, &pc));
        // 4-bit block scales cost little against free float block scales (the error-chosen k
        // may even win: it can trade a clipped extreme for a finer grid); 0.5 dB is a bound a
        // coarse or mis-scaled k (e.g. truncation instead of search) would exceed.
        assert!(s_lp > s_pb - 0.5, "per-block {s_pb} vs LPBQ {s_lp}");
        // The per-channel grid wastes its range on the small blocks; 1 dB is a floor that a
        // broken int-scale search (e.g. always k = 2^cbw) would not clear.
        assert!(s_lp > s_pc + 1.0, "LPBQ {s_lp} vs per-channel {s_pc}");
    }

    #[test]
    fn zero_rows_and_bad_input() {
        let w = vec![0f32; 2 * 64];
        let q = quantize(&w, 2, 64, 32, 4, 4).unwrap();
        assert!(q.dequantize().iter().all(|&x| x == 0.0));
        let e = quantize(&w, 2, 64, 48, 4, 4).unwrap_err().to_string();
        assert!(e.contains("48"), "{e}");
        let mut w = w;
        w[70] = f32::NAN;
        let e = quantize(&w, 2, 64, 32, 4, 4).unwrap_err().to_string();
        assert!(e.contains("row 1, column 6"), "{e}");
    }
}
