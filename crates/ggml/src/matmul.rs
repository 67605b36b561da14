//! `Y[m, n] = X[m, k] · Wᵀ` with `W` held as GGML blocks (`n` rows of `k` elements), and row
//! gathers (embedding lookup).

use crate::dot::{batch_fn, best_fn, scalar_fn, vec_dot_type, DotFn};
use crate::rows::{decode_tile_rows, rows_fn, RowsFn};
use crate::{bail, dequantize_row, quantize_activations, row_bytes, GgmlType, Result};

/// How [`matmul`] treats activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatMulMode {
    /// llama.cpp's fast path: each activation row is quantized once (Q8_0/Q8_1/Q8_K, or f16 /
    /// bf16 for float weights) and multiplied with integer dot products.
    ActQuant,
    /// Weights are dequantized (a few rows at a time) and multiplied with the f32 activations
    /// in f32.
    Exact,
    /// The fast path: activations quantized once per product like [`MatMulMode::ActQuant`],
    /// multiplied by the multi-row kernels (one weight row against four activation rows per
    /// call; the same value for a row whatever the batch). Types without a multi-row kernel
    /// take the one-row kernels.
    Fast,
}

/// Below this many weight elements (n·k) a product runs on one thread: spreading it costs more
/// (a fork-join costs microseconds) than it saves.
const PAR_MIN_WEIGHTS: usize = 1 << 18;

/// Activation rows the fast path runs against each weight tile before moving on: all of a
/// 128-token call (its quantized rows, ~120 KB for k = 896, stay in L2), so each weight row
/// is read from memory once per product.
const FAST_M_BLOCK: usize = 128;

/// From this many activation rows on, the fast path dequantizes the weights panel by panel and
/// multiplies in f32 (`gemm.rs`) instead of quantizing the activations.
const F32_GEMM_MIN_ROWS: usize = 16;

/// How many weight rows ahead of the current decode tile its rows are requested (see `prefetch`).
const PREFETCH_AHEAD: usize = 16;

/// Brings `bytes` into the caches ahead of use (a no-op without the x86 kernels).
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    crate::x86::prefetch(bytes);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Rows of W dequantized at once by the exact path: keeps the f32 tile about 128 KiB.
const EXACT_TILE_FLOATS: usize = 32 * 1024;

/// Activation rows processed together against each weight row, so a chunk of weight rows stays
/// in cache while the activations stream.
const M_BLOCK: usize = 16;

/// `y[m, n] = x[m, k] · wᵀ`, where `w` holds `n` rows of `k` elements of `ty` (raw GGUF blocks)
/// and all of `x`, `y` are row-major f32. `threads` caps the pool parallelism (1 = this
/// thread only); small products always run on one thread.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    ty: GgmlType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    mode: MatMulMode,
    threads: usize,
) -> Result<()> {
    matmul_impl(ty, w, n, k, x, m, m, y, mode, threads, false)
}

/// [`matmul`] where the first `batch_rows` rows of `x` are the real tokens of one llama.cpp
/// batch (0: every row rounds as a product of its own, like the output head llama.cpp runs
/// only for the rows whose logits it returns). llama.cpp's batch kernels round differently
/// from its single-row ones (repacked Q4_K inside 4-row groups, tiled Q6_K from 8 rows); the
/// fast path follows them per row.
#[allow(clippy::too_many_arguments)]
pub fn matmul_batch(
    ty: GgmlType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    batch_rows: usize,
    y: &mut [f32],
    mode: MatMulMode,
    threads: usize,
) -> Result<()> {
    matmul_impl(
        ty,
        w,
        n,
        k,
        x,
        m,
        batch_rows.min(m),
        y,
        mode,
        threads,
        false,
    )
}

/// [`matmul`] with the portable scalar dot kernels (reference for tests and benchmarks).
#[allow(clippy::too_many_arguments)]
pub fn matmul_scalar(
    ty: GgmlType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    mode: MatMulMode,
    threads: usize,
) -> Result<()> {
    matmul_impl(ty, w, n, k, x, m, m, y, mode, threads, true)
}

#[allow(clippy::too_many_arguments)]
fn matmul_impl(
    ty: GgmlType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    batch_rows: usize,
    y: &mut [f32],
    mode: MatMulMode,
    threads: usize,
    scalar: bool,
) -> Result<()> {
    let wrb = row_bytes(ty, k)?;
    if Some(w.len()) != n.checked_mul(wrb) {
        bail!(
            "{ty} weight of {n} rows x {k}: expected {} bytes, got {}",
            n as u128 * wrb as u128,
            w.len()
        );
    }
    if Some(x.len()) != m.checked_mul(k) {
        bail!("activations: expected {m} x {k} values, got {}", x.len());
    }
    if Some(y.len()) != m.checked_mul(n) {
        bail!("output: expected {m} x {n} values, got {}", y.len());
    }
    if !crate::can_dequantize(ty) {
        bail!("matrix products with ggml type {ty} are not supported");
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let par = threads > 1 && n * k >= PAR_MIN_WEIGHTS && n >= 2 * threads;
    let dot = vec_dot_type(ty).zip(if scalar { scalar_fn(ty) } else { best_fn(ty) });
    // Decoding (one activation row) streams the weights from memory once: the one-row SIMD
    // kernels read them as one sequential stream, which measured up to 2x faster on DRAM-resident
    // weights than tiles reading several rows side by side; tiles serve types without one.
    let one_row_simd = m == 1 && !scalar && crate::dot::has_simd_dot(ty);
    if mode == MatMulMode::Fast && m >= F32_GEMM_MIN_ROWS {
        let threads = if par { threads } else { 1 };
        return crate::gemm::f32_gemm(ty, w, wrb, n, k, x, m, y, threads, scalar);
    }
    if mode == MatMulMode::Fast && !one_row_simd {
        if let (Some(vt), Some(rf)) = (vec_dot_type(ty), rows_fn(ty, scalar)) {
            let (xq, xrb) = quantize_rows(vt, x, k, m, if par { threads } else { 1 })?;
            let xq = &xq;
            let tile = decode_tile_rows(ty);
            let rows =
                |n0: usize, out: &mut [f32]| multi_rows(rf, tile, w, wrb, n0, xq, xrb, m, out);
            run_rows(n, m, y, par, threads, rows);
            return Ok(());
        }
    }
    match (mode, dot) {
        (MatMulMode::ActQuant | MatMulMode::Fast, Some((vt, f))) => {
            let (xq, xrb) = quantize_rows(vt, x, k, m, if par { threads } else { 1 })?;
            let xq = &xq;
            let batch_rows = if mode == MatMulMode::Fast {
                0
            } else {
                batch_rows
            };
            let (fg, grouped) = batch_fn(ty, batch_rows, scalar).unwrap_or((f, 0));
            let fs = (f, fg, grouped);
            let rows = |n0: usize, out: &mut [f32]| quant_rows(fs, w, wrb, n0, xq, xrb, m, out);
            run_rows(n, m, y, par, threads, rows);
        }
        _ => {
            let f32_dot = if scalar {
                dot_f32_scalar
            } else {
                best_f32_dot()
            };
            let rows = |n0: usize, out: &mut [f32]| {
                exact_rows(ty, w, wrb, k, n0, x, m, out, f32_dot);
            };
            run_rows(n, m, y, par, threads, rows);
        }
    }
    Ok(())
}

/// `y[m, n] = x[m, k] · wᵀ` with `w` in the interleaved eight-row layout of
/// [`crate::repack_x8`] (Q8_0/Q4_0/Q4_1/Q5_0, `n` a multiple of 8): the fast path
/// ([`MatMulMode::Fast`]'s numerics: activations quantized to Q8_0/Q8_1 per row, exact integer
/// block totals; from 16 rows on the weights are dequantized and multiplied in f32).
#[allow(clippy::too_many_arguments)]
pub fn matmul_x8(
    ty: GgmlType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
) -> Result<()> {
    matmul_x8_impl(ty, w, n, k, x, m, y, threads, false)
}

/// [`matmul_x8`] with the scalar twins (reference for tests).
#[allow(clippy::too_many_arguments)]
pub fn matmul_x8_scalar(
    ty: GgmlType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
) -> Result<()> {
    matmul_x8_impl(ty, w, n, k, x, m, y, threads, true)
}

#[allow(clippy::too_many_arguments)]
fn matmul_x8_impl(
    ty: GgmlType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
    scalar: bool,
) -> Result<()> {
    use crate::x8::{X8_MAX_RX, X8_ROWS};
    if !crate::x8::supports_x8(ty) {
        bail!("{ty} has no interleaved (x8) layout");
    }
    let wrb = row_bytes(ty, k)?;
    if !n.is_multiple_of(X8_ROWS) || Some(w.len()) != n.checked_mul(wrb) {
        bail!(
            "{ty} x8 weight of {n} rows x {k}: expected a multiple of {X8_ROWS} rows and {} bytes, got {}",
            n as u128 * wrb as u128,
            w.len()
        );
    }
    if Some(x.len()) != m.checked_mul(k) {
        bail!("activations: expected {m} x {k} values, got {}", x.len());
    }
    if Some(y.len()) != m.checked_mul(n) {
        bail!("output: expected {m} x {n} values, got {}", y.len());
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let par = threads > 1 && n * k >= PAR_MIN_WEIGHTS && n >= 2 * threads;
    if m >= F32_GEMM_MIN_ROWS {
        let src = crate::gemm::Rows::QuantX8 { ty, w, wrb };
        let threads = if par { threads } else { 1 };
        return crate::gemm::gemm(src, n, k, x, m, y, threads, scalar);
    }
    let vt = if ty == GgmlType::Q4_1 {
        GgmlType::Q8_1
    } else {
        GgmlType::Q8_0
    };
    let (xq, xrb) = quantize_rows(vt, x, k, m, if par { threads } else { 1 })?;
    // Block sums of the activations, for the types whose quants carry a bias.
    let mut sums = vec![
        0i32;
        if crate::x8::quant_bias(ty) != 0 {
            m * (k / 32)
        } else {
            0
        }
    ];
    if !sums.is_empty() {
        let mut row = Vec::new();
        for (i, s) in sums.chunks_exact_mut(k / 32).enumerate() {
            crate::x8::block_sums(&xq[i * xrb..(i + 1) * xrb], xrb / (k / 32), &mut row);
            s.copy_from_slice(&row);
        }
    }
    let kernel = crate::x8::x8_fn(scalar);
    let (xq, sums) = (&xq, &sums);
    let nb = k / 32;
    let rows = |n0: usize, out: &mut [f32]| {
        let nr = out.len() / m;
        let groups = &w[n0 * wrb..(n0 + nr) * wrb];
        let ng = nr / X8_ROWS;
        if m == 1 {
            // One activation row: the chunk's outputs are the groups' results, in order.
            let (out, _) = out.as_chunks_mut::<8>();
            kernel(ty, groups, k, &[&xq[..xrb]], &[&sums[..]], out);
            return;
        }
        let mut res = vec![[0f32; 8]; ng * X8_MAX_RX];
        for r0 in (0..m).step_by(X8_MAX_RX) {
            let rx = X8_MAX_RX.min(m - r0);
            let xs: [&[u8]; X8_MAX_RX] =
                std::array::from_fn(|r| &xq[(r0 + r.min(rx - 1)) * xrb..][..xrb]);
            let ss: [&[i32]; X8_MAX_RX] = std::array::from_fn(|r| {
                if sums.is_empty() {
                    &[][..]
                } else {
                    &sums[(r0 + r.min(rx - 1)) * nb..][..nb]
                }
            });
            let ss = if sums.is_empty() { &ss[..0] } else { &ss[..rx] };
            kernel(ty, groups, k, &xs[..rx], ss, &mut res[..ng * rx]);
            for gi in 0..ng {
                for r in 0..rx {
                    for i in 0..X8_ROWS {
                        out[(gi * X8_ROWS + i) * m + r0 + r] = res[gi * rx + r][i];
                    }
                }
            }
        }
    };
    run_rows(n, m, y, par, threads, rows);
    Ok(())
}

/// The `m` rows of `x` (`k` values each) quantized to `vt`, and the bytes per quantized row.
/// Rows are quantized in parallel (blocks of [`QUANT_ROWS`]) when `threads > 1`.
fn quantize_rows(
    vt: GgmlType,
    x: &[f32],
    k: usize,
    m: usize,
    threads: usize,
) -> Result<(Vec<u8>, usize)> {
    let xrb = row_bytes(vt, k)?;
    let mut xq = vec![0u8; m * xrb];
    let quantize = |xs: &[f32], qs: &mut [u8]| -> Result<()> {
        for (xr, qr) in xs.chunks_exact(k).zip(qs.chunks_exact_mut(xrb)) {
            quantize_activations(vt, xr, qr)?;
        }
        Ok(())
    };
    let failed = std::sync::Mutex::new(None);
    crate::parallel_chunks_mut(&mut xq, QUANT_ROWS * xrb, threads, &|c, q| {
        let xs = &x[c * QUANT_ROWS * k..((c + 1) * QUANT_ROWS).min(m) * k];
        if let Err(e) = quantize(xs, q) {
            if let Ok(mut f) = failed.lock() {
                *f = Some(e);
            }
        }
    });
    if let Some(e) = failed.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok((xq, xrb))
}

/// Activation rows quantized per parallel task.
const QUANT_ROWS: usize = 8;

/// Splits the `n` output columns into chunks (over threads when `par`), lets `rows(n0, out)`
/// fill `out` (`[chunk rows][m]`, i.e. transposed) and writes the result into `y[m, n]`.
fn run_rows<F>(n: usize, m: usize, y: &mut [f32], par: bool, threads: usize, rows: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    // Chunks of whole 4-row tiles, a few per thread so uneven progress evens out.
    // Whole 8-row groups too (the interleaved layout's unit).
    let chunk = n.div_ceil(threads * 4).max(16).next_multiple_of(8);
    let threads = if par { threads } else { 1 };
    let split = |buf: &mut [f32], per_row: usize| {
        crate::parallel_chunks_mut(buf, chunk * per_row, threads, &|c, out| {
            rows(c * chunk, out)
        });
    };
    if m == 1 {
        // y is one row: a chunk of columns is contiguous, no transpose needed.
        split(y, 1);
        return;
    }
    let mut yt = vec![0f32; n * m];
    split(&mut yt, m);
    // The transpose back, by blocks of output rows (in parallel when the product was).
    let rows_per = m.div_ceil(threads * 2).max(1);
    let back = |i0: usize, ys: &mut [f32]| {
        for (di, yr) in ys.chunks_exact_mut(n).enumerate() {
            let i = i0 + di;
            for (j, v) in yr.iter_mut().enumerate() {
                *v = yt[j * m + i];
            }
        }
    };
    crate::parallel_chunks_mut(y, rows_per * n, threads, &|c, ys| back(c * rows_per, ys));
}

/// Weight rows `n0 .. n0 + out.len() / m` times every quantized activation row; `out` is
/// `[rows][m]`.
#[allow(clippy::too_many_arguments)]
fn quant_rows(
    (f, fg, grouped): (DotFn, DotFn, usize),
    w: &[u8],
    wrb: usize,
    n0: usize,
    xq: &[u8],
    xrb: usize,
    m: usize,
    out: &mut [f32],
) {
    let nr = out.len() / m;
    let wc = &w[n0 * wrb..(n0 + nr) * wrb];
    if m == 1 {
        for (o, wr) in out.iter_mut().zip(wc.chunks_exact(wrb)) {
            *o = f(wr, xq);
        }
        return;
    }
    for i0 in (0..m).step_by(M_BLOCK) {
        let i1 = (i0 + M_BLOCK).min(m);
        for (j, wr) in wc.chunks_exact(wrb).enumerate() {
            for i in i0..i1 {
                let dot = if i < grouped { fg } else { f };
                out[j * m + i] = dot(wr, &xq[i * xrb..(i + 1) * xrb]);
            }
        }
    }
}

/// The fast path for weight rows `n0 .. n0 + out.len() / m` (`out` is `[rows][m]`): tiles of
/// up to `decode_tile` weight rows x 1 activation row when decoding (m = 1: independent accumulator
/// chains, the activation block loaded once for four rows), of 2 x 4 otherwise.
#[allow(clippy::too_many_arguments)]
fn multi_rows(
    rf: RowsFn,
    decode_tile: usize,
    w: &[u8],
    wrb: usize,
    n0: usize,
    xq: &[u8],
    xrb: usize,
    m: usize,
    out: &mut [f32],
) {
    let nr = out.len() / m;
    let wrow = |j: usize| &w[(n0 + j) * wrb..(n0 + j + 1) * wrb];
    let mut res = [0f32; 32];
    let rw_max = if m == 1 { decode_tile } else { 2 };
    for i0 in (0..m).step_by(FAST_M_BLOCK) {
        let i1 = (i0 + FAST_M_BLOCK).min(m);
        let mut j = 0;
        while j < nr {
            let cw = (nr - j).min(rw_max);
            if m == 1 {
                // A later tile's weight rows, requested while this tile is computed.
                let (a, b) = (
                    (j + PREFETCH_AHEAD).min(nr),
                    (j + PREFETCH_AHEAD + cw).min(nr),
                );
                prefetch(&w[(n0 + a) * wrb..(n0 + b) * wrb]);
            }
            let ws: [&[u8]; 8] = std::array::from_fn(|a| wrow(j + a.min(cw - 1)));
            let mut i = i0;
            while i < i1 {
                let c = (i1 - i).min(4);
                let xs: [&[u8]; 4] = std::array::from_fn(|r| {
                    let row = i + r.min(c - 1);
                    &xq[row * xrb..(row + 1) * xrb]
                });
                rf(&ws[..cw], &xs[..c], &mut res[..cw * c]);
                for a in 0..cw {
                    out[(j + a) * m + i..(j + a) * m + i + c]
                        .copy_from_slice(&res[a * c..(a + 1) * c]);
                }
                i += c;
            }
            j += cw;
        }
    }
}

/// The exact path for weight rows `n0 ..`: dequantize a tile of rows, then f32 dot products.
#[allow(clippy::too_many_arguments)]
fn exact_rows(
    ty: GgmlType,
    w: &[u8],
    wrb: usize,
    k: usize,
    n0: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    dot: fn(&[f32], &[f32]) -> f32,
) {
    let nr = out.len() / m;
    let tile_rows = (EXACT_TILE_FLOATS / k).clamp(1, nr.max(1));
    let mut tile = vec![0f32; tile_rows * k];
    let mut j0 = 0;
    while j0 < nr {
        let t = tile_rows.min(nr - j0);
        let wt = &w[(n0 + j0) * wrb..(n0 + j0 + t) * wrb];
        // Lengths were validated by `matmul`, so this cannot fail.
        let _ = dequantize_row(ty, wt, &mut tile[..t * k]);
        for i0 in (0..m).step_by(M_BLOCK) {
            let i1 = (i0 + M_BLOCK).min(m);
            for jt in 0..t {
                let wr = &tile[jt * k..(jt + 1) * k];
                for i in i0..i1 {
                    out[(j0 + jt) * m + i] = dot(wr, &x[i * k..(i + 1) * k]);
                }
            }
        }
        j0 += t;
    }
}

/// f32 dot product with eight partial sums (the order the SIMD twin uses).
pub(crate) fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ac = a.chunks_exact(8);
    let bc = b.chunks_exact(8);
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (p, q) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += p[l] * q[l];
        }
    }
    let mut s = crate::dot::hsum8(&acc);
    for (p, q) in ar.iter().zip(br) {
        s += p * q;
    }
    s
}

fn best_f32_dot() -> fn(&[f32], &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        return crate::x86::dot_f32;
    }
    dot_f32_scalar
}

/// Dequantizes rows `ids` of `w` (rows of `k` elements of `ty`) into `out` (`ids.len() * k`
/// values): an embedding lookup. Errors name the first id outside `0..rows`.
pub fn gather_rows(ty: GgmlType, w: &[u8], k: usize, ids: &[i64], out: &mut [f32]) -> Result<()> {
    let wrb = row_bytes(ty, k)?;
    if wrb == 0 || !w.len().is_multiple_of(wrb) {
        bail!(
            "{ty} weight: {} bytes is not a whole number of {k}-element rows ({wrb} bytes each)",
            w.len()
        );
    }
    check_gather(w.len() / wrb, k, ids, out)?;
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
        let id = id as usize;
        dequantize_row(ty, &w[id * wrb..(id + 1) * wrb], o)?;
    }
    Ok(())
}

/// Checks a gather's output size and ids against a weight of `rows` rows of `k`.
fn check_gather(rows: usize, k: usize, ids: &[i64], out: &[f32]) -> Result<()> {
    if Some(out.len()) != ids.len().checked_mul(k) {
        bail!(
            "gather output: expected {} x {k} values, got {}",
            ids.len(),
            out.len()
        );
    }
    if let Some((pos, &id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id < 0 || id as u64 >= rows as u64)
    {
        bail!("gather: id {id} (at index {pos}) is out of range for {rows} rows");
    }
    Ok(())
}

/// [`gather_rows`] from a weight in the interleaved layout of [`crate::repack_x8`] (a tied
/// embedding stored once, for the output head's kernels): each row unpacked, then dequantized
/// exactly.
pub fn gather_rows_x8(
    ty: GgmlType,
    w: &[u8],
    k: usize,
    ids: &[i64],
    out: &mut [f32],
) -> Result<()> {
    use crate::x8::X8_ROWS;
    let wrb = row_bytes(ty, k)?;
    if !crate::x8::supports_x8(ty) || wrb == 0 || !w.len().is_multiple_of(X8_ROWS * wrb) {
        bail!(
            "{ty} x8 weight: {} bytes is not a whole number of {X8_ROWS}-row groups of {k}-element rows ({wrb} bytes each)",
            w.len()
        );
    }
    check_gather(w.len() / wrb, k, ids, out)?;
    let mut plain = vec![0u8; wrb];
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
        let (g, r) = (id as usize / X8_ROWS, id as usize % X8_ROWS);
        let group = &w[g * X8_ROWS * wrb..(g + 1) * X8_ROWS * wrb];
        crate::x8::unpack_row_x8(ty, group, r, &mut plain)?;
        dequantize_row(ty, &plain, o)?;
    }
    Ok(())
}
