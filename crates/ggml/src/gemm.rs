//! Prefill products in f32: `Y[m, n] = X[m, k] · Wᵀ` for many activation rows, with the weight
//! rows dequantized six at a time (each weight once per product) and multiplied by a
//! register-blocked micro-kernel (6 weight rows x 16 activation rows, the activations packed
//! once per product). Once a product has a few dozen rows, dequantizing each weight once costs less
//! than quantizing activations and reducing integer blocks per pair: the f32 FMA pipeline is
//! the fastest arithmetic this CPU has for it (llama.cpp takes the same road for Q6_K batches),
//! and the activations keep their f32 precision.

use crate::{GgmlType, Result};

/// Weight rows per micro-kernel call: 6 x 2 accumulators + 2 activation vectors + 1 broadcast
/// fill the 16 AVX2 registers.
pub(crate) const MR: usize = 6;
/// Activation rows per micro-kernel call (two 8-lane vectors): activations are packed once per
/// product as `[k][16]` groups, so the weights are dequantized row by row, contiguous, with no
/// transposition.
pub(crate) const NR: usize = 16;

/// `out[r * NR + i] = Σ_kk w[r * ldw + kk] · xp[kk * NR + i]` for `r < rows <= MR`, `i < NR`,
/// `kk < k`: each sum one chain of fused multiply-adds in `kk` order (so the SIMD kernel and its
/// scalar twin agree bit for bit).
pub(crate) type MicroFn =
    fn(w: &[f32], ldw: usize, rows: usize, xp: &[f32], k: usize, out: &mut [f32; MR * NR]);

/// The scalar twin of the micro-kernel (the reference the SIMD one is tested against).
pub(crate) fn micro_scalar(
    w: &[f32],
    ldw: usize,
    rows: usize,
    xp: &[f32],
    k: usize,
    out: &mut [f32; MR * NR],
) {
    for r in 0..rows {
        for i in 0..NR {
            let mut acc = 0f32;
            for kk in 0..k {
                acc = w[r * ldw + kk].mul_add(xp[kk * NR + i], acc);
            }
            out[r * NR + i] = acc;
        }
    }
}

/// Weight rows per call of a wide micro-kernel (two 6-row panels dequantized together).
pub(crate) const WIDE_MR: usize = 2 * MR;

/// A wider micro-kernel (AVX-512): up to [`WIDE_MR`] weight rows times `groups` (1 or 2) packed
/// activation groups (`xp` holds group 0's `[k][NR]`, then group 1's):
/// `out[g * WIDE_MR * NR + r * NR + i]` is what [`micro_scalar`] gives for weight row `r` and
/// group `g`'s row `i`, bit for bit (each output the same fused multiply-add chain in `kk` order).
pub(crate) type WideFn = fn(
    w: &[f32],
    ldw: usize,
    rows: usize,
    xp: &[f32],
    k: usize,
    groups: usize,
    out: &mut [f32; 2 * WIDE_MR * NR],
);

/// The micro-kernels and dequantizer of this CPU (or the scalar twins): the 6 x 16 kernel, the
/// wide one where the CPU has it (AVX-512), and the row dequantizer.
pub(crate) fn kernels(scalar: bool) -> (MicroFn, Option<WideFn>, crate::dequant::DequantFn) {
    #[cfg(target_arch = "x86_64")]
    if !scalar && crate::has_avx2() {
        let wide = if crate::has_avx512() {
            Some(crate::x86_512::gemm_micro_wide as WideFn)
        } else {
            None
        };
        return (crate::x86::gemm_micro, wide, crate::x86::dequantize_row);
    }
    let _ = scalar;
    (micro_scalar, None, crate::dequant::dequantize_row_scalar)
}

/// `y`'s rows as a place every task writes its own columns of.
struct Out {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: tasks write disjoint column ranges of `y` (see `f32_gemm`), so sharing the pointer
// across the pool's threads never makes two threads touch the same element.
unsafe impl Sync for Out {}

/// Where the weight rows of a product come from.
#[derive(Clone, Copy)]
pub(crate) enum Rows<'a> {
    /// `n` rows of GGML blocks of `ty`, `wrb` bytes each: dequantized six at a time.
    Quant {
        ty: GgmlType,
        w: &'a [u8],
        wrb: usize,
    },
    /// `n` rows in the interleaved layout (`x8.rs`): each row unpacked to plain blocks, then
    /// dequantized.
    QuantX8 {
        ty: GgmlType,
        w: &'a [u8],
        wrb: usize,
    },
    /// `n` rows of `k` f32 values, read in place.
    F32(&'a [f32]),
}

/// `y[m, n] = x[m, k] · wᵀ` with `w` holding `n` rows of `k` values of `ty` (`wrb` bytes each);
/// groups of weight rows spread over `threads`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn f32_gemm(
    ty: GgmlType,
    w: &[u8],
    wrb: usize,
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
    scalar: bool,
) -> Result<()> {
    debug_assert!(w.len() == n * wrb);
    gemm(Rows::Quant { ty, w, wrb }, n, k, x, m, y, threads, scalar)
}

/// `y[m, n] = x[m, k] · wᵀ` for weight rows from `src`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    src: Rows,
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
    scalar: bool,
) -> Result<()> {
    debug_assert!(x.len() == m * k && y.len() == m * n);
    if let Rows::F32(w) = src {
        debug_assert!(w.len() == n * k);
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (micro, wide, dequant) = kernels(scalar);
    let dequant_group = crate::x8::dequant_group_fn(scalar);
    // Activations as [m / 16][k][16] (zero rows past m): the micro-kernel's vector operand, in
    // this thread's reusable buffer (no megabyte allocation and zeroing per product).
    let groups = m.div_ceil(NR);
    PACKED.with(|cell| {
        let mut xp = cell.take();
        xp.resize(groups * k * NR, 0.0);
        crate::parallel_chunks_mut(&mut xp, k * NR, threads, &|g, dst| {
            let rows = NR.min(m - g * NR);
            // By slices of PACK_K columns, so the slice of `dst` the rows are scattered into
            // (PACK_K lines of 64 bytes) stays in L1 while all 16 rows write to it: row by
            // row over the whole k (57 KB at k = 896) evicted each line before the next row
            // wrote its lane (3.6% of Qwen2.5's pp128 time under perf).
            for k0 in (0..k).step_by(PACK_K) {
                let k1 = (k0 + PACK_K).min(k);
                for i in 0..rows {
                    let row = &x[(g * NR + i) * k + k0..(g * NR + i) * k + k1];
                    for (kk, &v) in row.iter().enumerate() {
                        dst[(k0 + kk) * NR + i] = v;
                    }
                }
            }
            if rows < NR {
                for kk in 0..k {
                    dst[kk * NR + rows..(kk + 1) * NR].fill(0.0);
                }
            }
        });
        let r = products(
            src,
            n,
            k,
            &xp,
            m,
            y,
            threads,
            (micro, wide, dequant, dequant_group),
        );
        cell.replace(xp);
        r
    })
}

/// Columns of a 16-row activation group packed per slice (`gemm`): 64 x 64 bytes of packed
/// output, a twelfth of L1.
const PACK_K: usize = 64;

thread_local! {
    /// Packed activations of the products this thread starts (grown, never shrunk).
    static PACKED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    /// Dequantized weight rows of the tasks this thread runs.
    static WROWS: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The products of [`gemm`] over packed activations `xp`: groups of `MR` weight rows per task.
#[allow(clippy::too_many_arguments)]
fn products(
    src: Rows,
    n: usize,
    k: usize,
    xp: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
    (micro, wide, dequant, dequant_group): (
        MicroFn,
        Option<WideFn>,
        crate::dequant::DequantFn,
        crate::x8::DequantGroupFn,
    ),
) -> Result<()> {
    let groups = m.div_ceil(NR);
    // Weight rows dequantized together: one wide kernel call's, or one 6 x 16 call's.
    let pr = if wide.is_some() { WIDE_MR } else { MR };
    let panels = n.div_ceil(pr);
    // A few tasks per thread so uneven progress evens out; one when running alone.
    let per_task = if threads > 1 {
        panels.div_ceil(threads * 4).max(1)
    } else {
        panels
    };
    let tasks = panels.div_ceil(per_task);
    let out = Out {
        ptr: y.as_mut_ptr(),
        len: y.len(),
    };
    // Borrowed whole (not its fields, which closures would capture one by one).
    let out = &out;
    let failed = std::sync::Mutex::new(None);
    let task = |t: usize| {
        let p0 = t * per_task * pr;
        let p1 = ((t + 1) * per_task * pr).min(n);
        let run = |wd: &mut Vec<f32>| -> Result<()> {
            // Interleaved weights: whole 8-row groups dequantized at once into a two-group ring
            // (a panel of 6 or 12 rows starting at a multiple of its size spans at most two),
            // the panel's rows copied out of it.
            const G: usize = crate::x8::X8_ROWS;
            let mut ring = Vec::new();
            let mut loaded = [usize::MAX; 2];
            match src {
                Rows::Quant { .. } => wd.resize(pr * k, 0.0),
                Rows::QuantX8 { .. } => {
                    wd.resize(pr * k, 0.0);
                    ring.resize(2 * G * k, 0f32);
                }
                Rows::F32(_) => {}
            }
            let mut tile = [0f32; 2 * WIDE_MR * NR];
            for p in (p0..p1).step_by(pr) {
                let rows = pr.min(p1 - p);
                let wrows: &[f32] = match src {
                    Rows::Quant { ty, w, wrb } => {
                        for r in 0..rows {
                            dequant(
                                ty,
                                &w[(p + r) * wrb..(p + r + 1) * wrb],
                                &mut wd[r * k..(r + 1) * k],
                            )?;
                        }
                        &wd[..]
                    }
                    Rows::QuantX8 { ty, w, wrb } => {
                        for r in 0..rows {
                            let (g, i) = ((p + r) / G, (p + r) % G);
                            let slot = g % 2;
                            if loaded[slot] != g {
                                let group = &w[g * G * wrb..(g + 1) * G * wrb];
                                let dst = &mut ring[slot * G * k..(slot + 1) * G * k];
                                dequant_group(ty, group, k, dst);
                                loaded[slot] = g;
                            }
                            let at = (slot * G + i) * k;
                            wd[r * k..(r + 1) * k].copy_from_slice(&ring[at..at + k]);
                        }
                        &wd[..]
                    }
                    Rows::F32(w) => &w[p * k..(p + rows) * k],
                };
                let mut g = 0;
                while g < groups {
                    // The wide kernel takes two groups per call (an odd last one alone); its
                    // outputs for group g + h sit at h * WIDE_MR * NR, the 6 x 16 kernel's at 0.
                    let (span, stride) = match wide {
                        Some(f) => {
                            let span = 2.min(groups - g);
                            f(
                                wrows,
                                k,
                                rows,
                                &xp[g * k * NR..(g + span) * k * NR],
                                k,
                                span,
                                &mut tile,
                            );
                            (span, WIDE_MR * NR)
                        }
                        None => {
                            let one: &mut [f32; MR * NR] = (&mut tile[..MR * NR])
                                .try_into()
                                .expect("a tile holds at least one 6 x 16 call's outputs");
                            micro(wrows, k, rows, &xp[g * k * NR..(g + 1) * k * NR], k, one);
                            (1, 0)
                        }
                    };
                    for h in 0..span {
                        let gg = g + h;
                        for i in 0..NR.min(m - gg * NR) {
                            let at = (gg * NR + i) * n + p;
                            debug_assert!(at + rows <= out.len);
                            // SAFETY: row gg * 16 + i < m and columns p .. p + rows <= p1 <= n
                            // lie inside `y` (m x n); this task alone owns columns p0 .. p1.
                            let dst =
                                unsafe { std::slice::from_raw_parts_mut(out.ptr.add(at), rows) };
                            for (r, d) in dst.iter_mut().enumerate() {
                                *d = tile[h * stride + r * NR + i];
                            }
                        }
                    }
                    g += span;
                }
            }
            Ok(())
        };
        let mut wd = WROWS.take();
        let r = run(&mut wd);
        WROWS.set(wd);
        if let Err(e) = r {
            if let Ok(mut f) = failed.lock() {
                *f = Some(e);
            }
        }
    };
    crate::parallel_for(tasks, threads, &task);
    match failed.into_inner().ok().flatten() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// `y[m, n] = x[m, k] · wᵀ` for f32 operands (`w`: `n` rows of `k`), row-major, on up to
/// `threads` threads of the kernels' pool: the fast path's f32 GEMM (6 x 16 register tiles,
/// activations packed once). Each output is one chain of fused multiply-adds in `k` order, the
/// same whatever the CPU or thread count.
pub fn matmul_f32(
    w: &[f32],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
) -> Result<()> {
    matmul_f32_with(w, n, k, x, m, y, threads, false)
}

/// [`matmul_f32`] with the scalar micro-kernel (its reference in tests).
pub fn matmul_f32_scalar(
    w: &[f32],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
) -> Result<()> {
    matmul_f32_with(w, n, k, x, m, y, threads, true)
}

#[allow(clippy::too_many_arguments)]
fn matmul_f32_with(
    w: &[f32],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
    scalar: bool,
) -> Result<()> {
    if Some(w.len()) != n.checked_mul(k)
        || Some(x.len()) != m.checked_mul(k)
        || Some(y.len()) != m.checked_mul(n)
    {
        crate::bail!(
            "f32 product {m}x{k} by ({n}x{k})ᵀ: got {} weights, {} activations, {} outputs",
            w.len(),
            x.len(),
            y.len()
        );
    }
    gemm(Rows::F32(w), n, k, x, m, y, threads.max(1), scalar)
}
