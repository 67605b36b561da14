//! GPTQ rounding (Frantar et al., 2022) of a linear weight onto a fixed grid: the input
//! channels are rounded one at a time, and each rounding's error is compensated in the channels
//! not yet rounded, in proportion to how the layer's inputs correlate (the second moment
//! `H = sum x x^T` of the inputs over calibration data). It minimizes the layer's output
//! error `||X (W - Q)^T||^2` far better than rounding to nearest when the inputs are
//! correlated, which they are in transformer layers.
//!
//! The grid (one scale per output channel and group of input channels: per-channel, or LPBQ's
//! effective block scales) is chosen beforehand and kept ("static groups"): the values land on
//! exactly the grid an encodings file records, and only the integer codes differ from rounding
//! to nearest. Columns go in order of decreasing `H[j][j]` (GPTQ's "act order"): the channels
//! with the most input energy are rounded first, while the most other channels remain to
//! absorb their error.
//!
//! The arithmetic, in the form used here: with `H = M M^T`, `M` upper triangular (the Cholesky
//! factor of `H` with rows and columns reversed), GPTQ's sequential update is equivalent to
//! `w'_j = w_j + sum_{i<j} (w_i - q_i) M[i][j] / M[j][j]` and `q_j = grid(w'_j)`, where `w` are
//! the original weights: the compensation of column `j` depends only on earlier columns'
//! rounding residuals. Columns go in blocks of [`BLOCK`]: the residuals of earlier blocks
//! enter as one matrix product per block (the runtime's GEMM), those within the block one
//! column at a time. The factorization is a blocked Cholesky in f64 (its trailing updates are
//! matrix products too).

use anyhow::{bail, Result};
use npuc_runtime::ops::matmul::{gemm_into, Mat};
use rayon::prelude::*;

/// Columns per block of the sequential rounding and of the Cholesky factorization.
const BLOCK: usize = 128;

/// A fixed quantization grid for a `rows x cols` weight: `scales[r * (cols / group) + g]` is
/// the step of row `r`'s input channels `g * group .. (g + 1) * group`; values are integers in
/// `qmin ..= qmax` times their step.
#[derive(Clone, Copy, Debug)]
pub struct Grid<'a> {
    pub scales: &'a [f32],
    /// Input channels per scale (`cols` for one scale per output channel).
    pub group: usize,
    pub qmin: f32,
    pub qmax: f32,
}

impl Grid<'_> {
    /// `x` rounded to nearest on the step `s`, clamped (the arithmetic of
    /// [`crate::lpbq::quantize_with_scales`], so the values read back through that grid give
    /// the same integers).
    #[inline]
    fn round(&self, x: f32, s: f32) -> f32 {
        (x / s).round().clamp(self.qmin, self.qmax) * s
    }
}

/// Options of [`round`].
#[derive(Clone, Copy, Debug)]
pub struct GptqOptions {
    /// Added to the diagonal of `H`, as a fraction of its mean diagonal (GPTQ's 0.01): keeps
    /// the factorization defined when calibration data does not span every input direction.
    pub damp: f64,
    /// Round columns in order of decreasing `H[j][j]`.
    pub act_order: bool,
    pub threads: usize,
}

impl Default for GptqOptions {
    fn default() -> Self {
        GptqOptions {
            damp: 0.01,
            act_order: true,
            threads: 1,
        }
    }
}

/// `w` (`rows x cols`, row-major, one row per output channel) rounded by GPTQ onto `grid`,
/// with `h` (`cols x cols`, row-major, symmetric) the inputs' second moment. `pinned` input
/// channels are rounded first, to nearest, and no other channel's error is moved into them:
/// channels whose inputs are far larger on rows `h` leaves out (an LLM's attention-sink
/// token, whose few massive activations would otherwise dominate `h`), where an error moved
/// into them would be amplified. Returns the dequantized values (each exactly an integer in
/// range times its step).
pub fn round(
    w: &[f32],
    rows: usize,
    cols: usize,
    h: &[f32],
    pinned: Option<&[bool]>,
    grid: &Grid,
    opts: &GptqOptions,
) -> Result<Vec<f32>> {
    if w.len() != rows * cols {
        bail!(
            "GPTQ: weight has {} values, expected {rows} x {cols}",
            w.len()
        );
    }
    if h.len() != cols * cols {
        bail!(
            "GPTQ: input second moment has {} values, expected {cols} x {cols}",
            h.len()
        );
    }
    if grid.group == 0 || !cols.is_multiple_of(grid.group) {
        bail!(
            "GPTQ: grid groups of {} input channels do not divide {cols}",
            grid.group
        );
    }
    let groups = cols / grid.group;
    if grid.scales.len() != rows * groups {
        bail!(
            "GPTQ: {} grid scales for {rows} rows x {groups} groups",
            grid.scales.len()
        );
    }
    if let Some(i) = grid
        .scales
        .iter()
        .position(|s| !(s.is_finite() && *s > 0.0))
    {
        bail!(
            "GPTQ: grid step of row {}, group {} is {} (must be positive and finite)",
            i / groups,
            i % groups,
            grid.scales[i]
        );
    }
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        bail!(
            "GPTQ: weight value at row {}, column {} is {}",
            i / cols,
            i % cols,
            w[i]
        );
    }
    if let Some(i) = h.iter().position(|x| !x.is_finite()) {
        bail!(
            "GPTQ: input second moment at ({}, {}) is {}",
            i / cols,
            i % cols,
            h[i]
        );
    }
    if rows == 0 || cols == 0 {
        return Ok(vec![]);
    }
    let k = cols;
    // Column order: decreasing input energy (act order) or as stored.
    let mut perm: Vec<usize> = (0..k).collect();
    if opts.act_order {
        perm.sort_by(|&a, &b| h[b * k + b].total_cmp(&h[a * k + a]));
    }
    // Pinned channels first (stable: each group keeps its order): rounded before any
    // compensation exists, so they get their nearest values.
    if let Some(p) = pinned {
        if p.len() != k {
            bail!("GPTQ: {} pinned flags for {k} input channels", p.len());
        }
        perm.sort_by_key(|&c| !p[c]);
    }
    let npin = pinned.map_or(0, |p| p.iter().filter(|&&b| b).count());
    let coef = compensation(h, k, &perm, opts)?;
    // The weight in the processing order, and the residuals `w - q` of rounded columns.
    let wp: Vec<f32> = (0..rows * k)
        .map(|i| w[(i / k) * k + perm[i % k]])
        .collect();
    let mut resid = vec![0f32; rows * k];
    let mut q = vec![0f32; rows * k];
    let mut carry = vec![0f32; rows * BLOCK];
    for j0 in (0..k).step_by(BLOCK) {
        let j1 = (j0 + BLOCK).min(k);
        let bw = j1 - j0;
        // Compensation from every earlier block: carry[r][jj] = sum_{i<j0} resid[r][i] coef[j0+jj][i].
        if j0 > 0 {
            gemm_into::<f32>(
                rows,
                bw,
                j0,
                1.0,
                Mat {
                    data: &resid,
                    rs: k,
                    cs: 1,
                },
                Mat {
                    data: &coef[j0 * k..],
                    rs: 1,
                    cs: k,
                },
                None,
                &mut carry,
                bw,
                opts.threads,
            )?;
        } else {
            carry.fill(0.0);
        }
        let (wp, coef, perm) = (&wp, &coef, &perm);
        q.par_chunks_mut(k)
            .zip(resid.par_chunks_mut(k))
            .zip(carry.par_chunks_mut(bw))
            .enumerate()
            .for_each(|(r, ((qr, rr), cr))| {
                let wr = &wp[r * k..(r + 1) * k];
                let steps = &grid.scales[r * groups..(r + 1) * groups];
                for j in j0..j1 {
                    let c = &coef[j * k + j0..j * k + j];
                    let within: f32 = rr[j0..j].iter().zip(c).map(|(d, c)| d * c).sum();
                    let target = if j < npin {
                        wr[j]
                    } else {
                        wr[j] + cr[j - j0] + within
                    };
                    let v = grid.round(target, steps[perm[j] / grid.group]);
                    qr[j] = v;
                    rr[j] = wr[j] - v;
                }
            });
    }
    let mut out = vec![0f32; rows * k];
    for (o, qr) in out.chunks_exact_mut(k).zip(q.chunks_exact(k)) {
        for (j, &v) in qr.iter().enumerate() {
            o[perm[j]] = v;
        }
    }
    Ok(out)
}

/// The compensation coefficients in the processing order `perm`: `coef[j * k + i] =
/// M[i][j] / M[j][j]` for `i < j`, where `H' = M M^T` (`H'` = `h` permuted and damped, `M`
/// upper triangular). `M` comes from the lower Cholesky factor `L` of `H'` with rows and
/// columns reversed: `M[i][j] = L[k-1-i][k-1-j]`.
fn compensation(h: &[f32], k: usize, perm: &[usize], opts: &GptqOptions) -> Result<Vec<f32>> {
    let mean_diag = (0..k).map(|j| h[j * k + j] as f64).sum::<f64>() / k as f64;
    let damp = opts.damp * if mean_diag > 0.0 { mean_diag } else { 1.0 };
    // rev[a] = the original channel at reversed processing position a.
    let rev: Vec<usize> = (0..k).map(|a| perm[k - 1 - a]).collect();
    let mut l = vec![0f64; k * k];
    l.par_chunks_mut(k).enumerate().for_each(|(a, row)| {
        let src = &h[rev[a] * k..(rev[a] + 1) * k];
        for (b, v) in row.iter_mut().enumerate().take(a + 1) {
            *v = src[rev[b]] as f64;
        }
        // A channel calibration never saw: unit variance, so it is rounded to nearest and
        // neither gives nor takes compensation.
        if row[a] <= 0.0 {
            row[a] = 1.0;
        }
        row[a] += damp;
    });
    cholesky_lower(&mut l, k, opts.threads)?;
    let mut coef = vec![0f32; k * k];
    coef.par_chunks_mut(k).enumerate().for_each(|(j, row)| {
        let b = k - 1 - j;
        let d = l[b * k + b];
        for (i, c) in row.iter_mut().enumerate().take(j) {
            *c = (l[(k - 1 - i) * k + b] / d) as f32;
        }
    });
    Ok(coef)
}

/// In-place lower Cholesky factorization of the symmetric positive definite `a` (`n x n`,
/// row-major; only the lower triangle is read, and only it is meaningful afterwards), in
/// column blocks of [`BLOCK`] whose trailing updates are matrix products.
fn cholesky_lower(a: &mut [f64], n: usize, threads: usize) -> Result<()> {
    let mut panel = Vec::new();
    for k0 in (0..n).step_by(BLOCK) {
        let k1 = (k0 + BLOCK).min(n);
        // The diagonal block.
        for j in k0..k1 {
            let d = a[j * n + j] - a[j * n + k0..j * n + j].iter().map(|x| x * x).sum::<f64>();
            if !(d > 0.0 && d.is_finite()) {
                bail!("GPTQ: the input second moment is not positive definite at column {j} (pivot {d}); more or more varied calibration data is needed");
            }
            let djj = d.sqrt();
            a[j * n + j] = djj;
            let pj = a[j * n + k0..j * n + j].to_vec();
            for i in j + 1..k1 {
                let ri = &mut a[i * n..(i + 1) * n];
                let s: f64 = ri[k0..j].iter().zip(&pj).map(|(x, y)| x * y).sum();
                ri[j] = (ri[j] - s) / djj;
            }
        }
        if k1 == n {
            break;
        }
        // The panel below it: rows k1..n, columns k0..k1.
        let diag: Vec<f64> = (k0..k1)
            .flat_map(|i| a[i * n + k0..i * n + k1].to_vec())
            .collect();
        let nb = k1 - k0;
        a[k1 * n..].par_chunks_mut(n).for_each(|ri| {
            for jj in 0..nb {
                let s: f64 = ri[k0..k0 + jj]
                    .iter()
                    .zip(&diag[jj * nb..jj * nb + jj])
                    .map(|(x, y)| x * y)
                    .sum();
                ri[k0 + jj] = (ri[k0 + jj] - s) / diag[jj * nb + jj];
            }
        });
        // Trailing update: a[k1.., k1..] -= P P^T with P the panel.
        let m = n - k1;
        panel.clear();
        for i in k1..n {
            panel.extend_from_slice(&a[i * n + k0..i * n + k1]);
        }
        gemm_into::<f64>(
            m,
            m,
            nb,
            -1.0,
            Mat::rows(&panel, nb),
            Mat::cols(&panel, nb),
            Some(1.0),
            &mut a[k1 * n + k1..],
            n,
            threads,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lpbq::tests::lcg;

    /// Correlated inputs: `x = z A` with a random mixing `A`, plus a few loud channels.
    fn inputs(n: usize, k: usize, seed: u64) -> Vec<f32> {
        let z = lcg(n * k, seed);
        let a = lcg(k * k, seed + 1);
        let mut x = vec![0f32; n * k];
        for r in 0..n {
            for j in 0..k {
                let mut s = 0f32;
                for p in 0..k {
                    s += z[r * k + p] * a[p * k + j];
                }
                x[r * k + j] = s * if j % 7 == 0 { 4.0 } else { 1.0 };
            }
        }
        x
    }

    /// A random `rows x k` weight, correlated inputs (`n x k`), their second moment, and the
    /// weight's int4 steps (one per row, absmax / 7).
    struct Case {
        rows: usize,
        k: usize,
        n: usize,
        w: Vec<f32>,
        x: Vec<f32>,
        h: Vec<f32>,
        scales: Vec<f32>,
    }

    impl Case {
        fn new(rows: usize, k: usize, n: usize, seed: u64) -> Case {
            let w = lcg(rows * k, seed);
            let x = inputs(n, k, seed + 2);
            let mut h = vec![0f32; k * k];
            for row in x.chunks_exact(k) {
                for i in 0..k {
                    for j in 0..k {
                        h[i * k + j] += row[i] * row[j];
                    }
                }
            }
            let scales = w
                .chunks_exact(k)
                .map(|r| r.iter().fold(0f32, |m, x| m.max(x.abs())) / 7.0)
                .collect();
            Case {
                rows,
                k,
                n,
                w,
                x,
                h,
                scales,
            }
        }

        fn grid(&self) -> Grid<'_> {
            Grid {
                scales: &self.scales,
                group: self.k,
                qmin: -8.0,
                qmax: 7.0,
            }
        }

        fn gptq(&self, h: &[f32], pinned: Option<&[bool]>, opts: &GptqOptions) -> Vec<f32> {
            round(&self.w, self.rows, self.k, h, pinned, &self.grid(), opts).unwrap()
        }

        /// Every value rounded to its nearest grid point.
        fn nearest(&self) -> Vec<f32> {
            let g = self.grid();
            let k = self.k;
            self.w
                .iter()
                .enumerate()
                .map(|(i, &v)| g.round(v, self.scales[i / k]))
                .collect()
        }

        /// `||X (W - Q)^T||^2` over the rows of `x`.
        fn output_error(&self, q: &[f32]) -> f64 {
            let (k, w) = (self.k, &self.w);
            let mut e = 0f64;
            for xs in self.x.chunks_exact(k).take(self.n) {
                for r in 0..self.rows {
                    let d: f64 = (0..k)
                        .map(|j| (xs[j] * (w[r * k + j] - q[r * k + j])) as f64)
                        .sum();
                    e += d * d;
                }
            }
            e
        }
    }

    #[test]
    fn cholesky_matches_definition() {
        let n = 300; // more than two blocks
        let x = lcg(n * 400, 3);
        let mut a = vec![0f64; n * n];
        for r in 0..400 {
            for i in 0..n {
                for j in 0..n {
                    a[i * n + j] += (x[r * n + i] * x[r * n + j]) as f64;
                }
            }
        }
        let orig = a.clone();
        cholesky_lower(&mut a, n, 2).unwrap();
        for i in (0..n).step_by(37) {
            for j in (0..=i).step_by(29) {
                let s: f64 = (0..=j).map(|p| a[i * n + p] * a[j * n + p]).sum();
                assert!(
                    (s - orig[i * n + j]).abs() <= 1e-9 * orig[i * n + i].abs().max(1.0),
                    "({i},{j}): {s} vs {}",
                    orig[i * n + j]
                );
            }
        }
    }

    #[test]
    fn not_positive_definite_is_an_error_naming_the_column() {
        let mut a = vec![1.0, 2.0, 2.0, 1.0];
        let e = cholesky_lower(&mut a, 2, 1).unwrap_err().to_string();
        assert!(e.contains("column 1"), "{e}");
    }

    #[test]
    fn values_lie_on_the_grid() {
        let c = Case::new(24, 64, 256, 9);
        let q = c.gptq(&c.h, None, &GptqOptions::default());
        for (i, v) in q.iter().enumerate() {
            let code = v / c.scales[i / c.k];
            assert!((code - code.round()).abs() < 1e-4 && (-8.0..=7.0).contains(&code.round()));
        }
    }

    /// The point of GPTQ: on correlated inputs its output error is well below rounding to
    /// nearest on the same grid (bar 0.7x), and with uncorrelated unit inputs (`H` = identity)
    /// it is rounding to nearest exactly.
    #[test]
    fn lower_output_error_than_nearest_on_correlated_inputs() {
        let c = Case::new(32, 192, 512, 5);
        let nearest = c.nearest();
        for act_order in [false, true] {
            let opts = GptqOptions {
                act_order,
                threads: 2,
                ..Default::default()
            };
            let q = c.gptq(&c.h, None, &opts);
            let (eg, en) = (c.output_error(&q), c.output_error(&nearest));
            assert!(eg < 0.7 * en, "act order {act_order}: {eg} vs nearest {en}");
        }
        let mut eye = vec![0f32; c.k * c.k];
        for j in 0..c.k {
            eye[j * c.k + j] = 1.0;
        }
        assert_eq!(c.gptq(&eye, None, &GptqOptions::default()), nearest);
    }

    /// Pinned channels keep their nearest values (nothing is compensated into them), and the
    /// others still beat rounding to nearest.
    #[test]
    fn pinned_channels_round_to_nearest() {
        let c = Case::new(16, 96, 384, 21);
        let pinned: Vec<bool> = (0..c.k).map(|j| j % 16 == 3).collect();
        let q = c.gptq(&c.h, Some(&pinned), &GptqOptions::default());
        let nearest = c.nearest();
        for (i, (a, b)) in q.iter().zip(&nearest).enumerate() {
            if pinned[i % c.k] {
                assert_eq!(a, b, "pinned value {i}");
            }
        }
        let (eg, en) = (c.output_error(&q), c.output_error(&nearest));
        assert!(eg < 0.8 * en, "{eg} vs nearest {en}");
        let short = &pinned[1..];
        let o = GptqOptions::default();
        assert!(round(&c.w, c.rows, c.k, &c.h, Some(short), &c.grid(), &o).is_err());
    }

    #[test]
    fn bad_shapes_and_values_are_named() {
        let w = vec![0.5f32; 8];
        let h = vec![1f32; 16];
        let s = [0.1f32, 0.1];
        let g = Grid {
            scales: &s,
            group: 4,
            qmin: -8.0,
            qmax: 7.0,
        };
        let o = GptqOptions::default();
        assert!(round(&w, 2, 4, &h[..9], None, &g, &o)
            .unwrap_err()
            .to_string()
            .contains("second moment"));
        let mut wn = w.clone();
        wn[5] = f32::NAN;
        assert!(round(&wn, 2, 4, &h, None, &g, &o)
            .unwrap_err()
            .to_string()
            .contains("row 1, column 1"));
        let g3 = Grid { group: 3, ..g };
        assert!(round(&w, 2, 4, &h, None, &g3, &o).is_err());
    }
}
