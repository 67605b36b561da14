//! f32 matrix product with AVX-512 and AVX2 micro-kernels: `c[m x n] = scale * a[m x k] * b[k x n]`,
//! operands given as strided views (any row and column strides), `c` row-major and
//! overwritten.
//!
//! The `gemm` crate, which the runtime used for every f32 product, keeps its AVX-512 kernels
//! behind a nightly-only feature, so on stable Rust it runs AVX2+FMA kernels on AVX-512 hosts.
//! `ops::matmul::gemm_into` sends f32 products here when the active level has AVX-512 (and
//! keeps the `gemm` crate at the AVX2 and scalar levels, [`preferred_for_matmul`], except for
//! products of few rows with a weight packed once per plan, [`prepacked_preferred`]); the
//! convolutions and recurrences come here at AVX2 too, where each tile runs as AVX2 sub-tiles
//! of 6 rows x 16 columns (`tile_split_avx2`) over the same packed layout.
//!
//! Layout, after the usual BLIS scheme:
//! - `b` is packed into panels of [`NR`] columns, each `k` rows of [`NR`] contiguous values
//!   ([`PackedB`]): a constant weight is packed once per plan (the callers cache it), any other
//!   operand per call. Read in place, a row-major `b` whose row stride is a multiple of 512
//!   bytes (384 or 1536 columns) maps a panel's rows onto a few L1 sets, and the reduction of
//!   ViT-S's fc2 (k = 1536) ran at half speed from those conflict misses.
//! - A row-major `a` is read in place: the micro-kernel broadcasts from [`MR`] row streams
//!   (packing it per call, 12 rows x [`KC`] steps at a time, cost more than it saved at the
//!   ViT-S and PP-OCR shapes). Other strides (a transposed operand) are packed that way.
//! - The micro-kernel keeps an [`MR`] x [`NR`] tile in 24 of the 32 vector registers: per `k`
//!   step two 16-lane loads of `b`, 12 broadcasts of `a` and 24 fused multiply-adds. A panel
//!   block of `b` (`KC` x `NR`, 32 KB) stays in L1 while the row blocks of `a` pass it.
//! - Threads split the column panels or the row blocks, whichever divides more evenly.
//!
//! Every output is one chain of fused multiply-adds in `k` order starting from zero, times
//! `scale` at the end, so the scalar twin ([`sgemm_scalar`], `f32::mul_add`) gives the same
//! bits; the property tests compare them. (It differs from the `gemm` crate in the last bits:
//! another summation order.)

use crate::bail;
use crate::error::Result;
use npuc_isa::Isa;
use rayon::prelude::*;
use std::cell::RefCell;

/// Rows of a micro-tile.
pub const MR: usize = 12;
/// Columns of a micro-tile and of a packed panel of `b` (two 16-lane registers).
pub const NR: usize = 32;
/// Rows of a narrow micro-tile: products with at most 16 columns (convs with 8 or 16 output
/// channels over many pixels) keep one 16-lane accumulator per row, so a wide tile's second
/// register, all masked off, does not cost half the multiply-adds.
const MR_NARROW: usize = 24;
/// Products with at least this many multiply-adds are split across threads.
const PAR_WORK: usize = 1 << 17;
/// Reduction steps per pass: a panel block of `b` (`KC` rows of 128 bytes, 32 KB) stays in L1
/// while the row blocks of `a` pass it; later passes continue each output's chain from `c`.
const KC: usize = 256;
/// [`KC`] at the AVX2 level, whose sub-tiles read one 16-column half of each panel row: a
/// half-panel block's lines lie 128 bytes apart, so they fill only every other L1 set, and at
/// 256 steps (16 KB in half the sets of a 32 KB L1) they were evicted between row tiles.
const KC_AVX2: usize = 128;
/// Rows of `a` packed per block (`MC` x `KC` values, 240 KB, stay in L2 while every panel of
/// `b` passes them).
const MC: usize = 20 * MR;
/// Most rows of an in-place `a` per block (`MC_IN_PLACE` x `KC` values, 512 KB of L2). Every
/// block streams all of `b` once: ViT-S's 257 rows in blocks of 240 and 17 read fc2's 2.4 MB
/// weight twice from beyond L2, the second time for 17 rows. Blocks are near-equal in height.
const MC_IN_PLACE: usize = 512;
/// Below this many rows, a row-major `b` is read in place rather than packed per call: packing
/// costs as much memory traffic as the product itself when `m` is small.
const PACK_B_MIN_ROWS: usize = 2 * MR;

/// Whether [`sgemm`] runs its own kernels at `isa` (AVX-512, or AVX2 sub-tiles; else callers
/// keep their own path).
pub fn available(isa: Isa) -> bool {
    isa.has_avx2()
}

/// Whether plain matrix products (MatMul, Gemm) should run here rather than in the `gemm`
/// crate: at the AVX-512 level. At AVX2 the `gemm` crate's kernel, with both operands packed,
/// measured 6-15% faster at ViT-S's product shapes than these 6 x 16 sub-tiles even with `b`
/// prepacked (`examples/sgemm_bench`, Zen 3); convolutions still come here at AVX2, where the
/// direct (im2col-free) runs and the narrow tiles win.
pub fn preferred_for_matmul(isa: Isa) -> bool {
    isa.has_avx512()
}

/// At most this many rows, a product with a constant, prepacked `b` runs here at AVX2 too
/// ([`prepacked_preferred`]).
pub const AVX2_PREPACKED_MAX_ROWS: usize = 64;

/// Whether a product of `rows` rows with a constant `b` packed once per plan should run here:
/// always at AVX-512; at AVX2 when `rows` is at most [`AVX2_PREPACKED_MAX_ROWS`]. Few rows
/// amortize the `gemm` crate's per-call packing of `b` badly (it reads the whole weight from
/// memory and writes it again for each call): `examples/sgemm_bench` on Zen 3, 1 thread,
/// prepacked here vs the `gemm` crate: 40x80x6906 (PP-OCRv6 rec head) 0.54 vs 0.63 ms,
/// 32x120x18385 3.7 vs 5.1, 16x512x512 0.16 vs 0.22. From 96 rows the gain was within this
/// host's noise (96x256x1024 0.73 vs 0.77, 128x384x1152 2.09 vs 2.17) and from 240 rows the
/// `gemm` crate's kernel is 4-8% ahead; a product moved here also rounds differently (another
/// summation order), which moved the MiniLM `--target-sqnr 20` search (seq 128) below its
/// target, so rows above 64 stay with the crate.
pub fn prepacked_preferred(isa: Isa, rows: usize) -> bool {
    isa.has_avx512() || (available(isa) && rows <= AVX2_PREPACKED_MAX_ROWS)
}

/// A strided operand view: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    /// Row-major with row stride `ld` (unit column stride).
    pub fn rows(data: &'a [f32], ld: usize) -> Self {
        View {
            data,
            rs: ld,
            cs: 1,
        }
    }
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
    #[inline(always)]
    fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.rs + j * self.cs]
    }
}

/// `b` (`k x n`) packed into panels of [`NR`] columns: panel `p` holds rows `0..k` of columns
/// `p*NR .. p*NR+NR`, [`NR`] values per row (zeros past column `n`), at `p * k * NR`.
pub struct PackedB {
    k: usize,
    n: usize,
    data: Vec<f32>,
}

impl PackedB {
    /// Packs the `k x n` view `b` (single-threaded; see [`PackedB::new_par`]).
    pub fn new(k: usize, n: usize, b: View) -> Result<PackedB> {
        Self::new_par(k, n, b, 1)
    }

    /// Packs the `k x n` view `b`, panels spread over `threads`.
    pub fn new_par(k: usize, n: usize, b: View, threads: usize) -> Result<PackedB> {
        if !b.fits(k, n) {
            bail!("f32 product: right operand is smaller than {k}x{n}");
        }
        let mut data = vec![0f32; n.div_ceil(NR) * k * NR];
        pack_b_into(k, n, b, &mut data, threads);
        Ok(PackedB { k, n, data })
    }

    pub fn k(&self) -> usize {
        self.k
    }
    pub fn n(&self) -> usize {
        self.n
    }
    /// Element `(kk, j)` of the packed matrix (`None` outside `k x n`).
    pub fn at(&self, kk: usize, j: usize) -> Option<f32> {
        (kk < self.k && j < self.n).then(|| PackedView(self).at(kk, j))
    }
}

/// Packs `b` into `dst` (`n.div_ceil(NR) * k * NR` values; columns past `n` are zeroed).
/// Each thread takes a run of whole panels and walks `b` row by row, so reads are contiguous
/// runs of a row and writes whole 128-byte panel rows.
fn pack_b_into(k: usize, n: usize, b: View, dst: &mut [f32], threads: usize) {
    let panel = k * NR;
    let panels = n.div_ceil(NR);
    if panel == 0 || panels == 0 {
        return;
    }
    let one = |(g, out): (usize, &mut [f32]), per: usize| {
        let p0 = g * per;
        let count = out.len() / panel;
        for kk in 0..k {
            for q in 0..count {
                let j0 = (p0 + q) * NR;
                let cols = NR.min(n - j0);
                let row = &mut out[q * panel + kk * NR..][..NR];
                if b.cs == 1 {
                    let s = kk * b.rs + j0;
                    row[..cols].copy_from_slice(&b.data[s..s + cols]);
                } else {
                    for (j, v) in row[..cols].iter_mut().enumerate() {
                        *v = b.at(kk, j0 + j);
                    }
                }
                row[cols..].fill(0.0);
            }
        }
    };
    if threads > 1 && panels > 1 && k * n >= PAR_WORK / 8 {
        let per = panels.div_ceil(threads);
        dst.par_chunks_mut(per * panel)
            .enumerate()
            .for_each(|x| one(x, per));
    } else {
        one((0, dst), panels);
    }
}

thread_local! {
    /// Per-thread packing buffers, reused across calls (taken out while in use, so a nested
    /// call on the same thread, e.g. from rayon work-stealing, just allocates its own).
    static SCRATCH_A: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static SCRATCH_B: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn take_scratch(cell: &'static std::thread::LocalKey<RefCell<Vec<f32>>>, len: usize) -> Vec<f32> {
    let mut v = cell.with(|c| std::mem::take(&mut *c.borrow_mut()));
    v.resize(len.max(v.len()), 0.0);
    v
}

fn give_scratch(cell: &'static std::thread::LocalKey<RefCell<Vec<f32>>>, v: Vec<f32>) {
    cell.with(|c| {
        let mut c = c.borrow_mut();
        if c.capacity() < v.capacity() {
            *c = v;
        }
    });
}

#[allow(clippy::too_many_arguments)]
fn check(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    a: View,
    b: Option<View>,
    c: &[f32],
    ldc: usize,
) -> Result<()> {
    if !a.fits(m, k)
        || b.is_some_and(|b| !b.fits(k, n))
        || (m > 0 && n > 0 && (ldc < n || (m - 1) * ldc + n > c.len()))
    {
        bail!("f32 product operands are smaller than their shapes ({m}x{k} by {k}x{n})");
    }
    if isa > Isa::detect() {
        bail!(
            "f32 product: {} kernels requested above the active level {}",
            isa.name(),
            Isa::detect().name()
        );
    }
    Ok(())
}

/// `c[m x n]` (row stride `ldc`) = `scale * a * b` with the kernel of `isa`: the AVX-512 one
/// when [`available`], else the scalar twin. `b` is packed per call (unless `m` is small and
/// `b` row-major).
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    scale: f32,
    a: View,
    b: View,
    c: &mut [f32],
    ldc: usize,
    threads: usize,
) -> Result<()> {
    check(isa, m, n, k, a, Some(b), c, ldc)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 || !available(isa) {
        sgemm_scalar(m, n, k, scale, a, b, c, ldc);
        return Ok(());
    }
    let threads = if m * n * k >= PAR_WORK { threads } else { 1 };
    if b.cs == 1 && m < PACK_B_MIN_ROWS {
        run(isa, m, n, k, scale, a, BSrc::Rows(b), c, ldc, threads, None);
        return Ok(());
    }
    let len = n.div_ceil(NR) * k * NR;
    let mut buf = take_scratch(&SCRATCH_B, len);
    pack_b_into(k, n, b, &mut buf[..len], threads);
    run(
        isa,
        m,
        n,
        k,
        scale,
        a,
        BSrc::Packed(&buf[..len]),
        c,
        ldc,
        threads,
        None,
    );
    give_scratch(&SCRATCH_B, buf);
    Ok(())
}

/// Work done on each finished block of the output while it is still in cache (a bias, an
/// activation): called once for every output value, after the value's last multiply-add and
/// `scale`, with blocks of whole tiles (one call per column panel of a row range, not per row:
/// a narrow product such as a 32-column panel over 40 rows would otherwise pay a dynamic call
/// per 32 values). On the thread that computed the block, so a product's epilogue is split
/// like the product.
pub type Finish<'a> = &'a (dyn Fn(Stretch) + Sync);

/// A finished block of the output for a [`Finish`]: `rows` rows of `cols` values, `ldc` apart,
/// the first at column `j0` of the product. Only the block's own values are reachable: the
/// values between its rows may belong to another thread's block.
pub struct Stretch<'a> {
    /// First column of the block in the product.
    pub j0: usize,
    ptr: *mut f32,
    rows: usize,
    cols: usize,
    ldc: usize,
    _rows: std::marker::PhantomData<&'a mut [f32]>,
}

impl<'a> Stretch<'a> {
    /// Rows of `cols` values `ldc` apart in `data` (from its start).
    pub fn new(data: &'a mut [f32], j0: usize, cols: usize, ldc: usize) -> Stretch<'a> {
        let rows = if cols == 0 || data.len() < cols {
            0
        } else {
            (data.len() - cols) / ldc.max(1) + 1
        };
        Stretch {
            j0,
            ptr: data.as_mut_ptr(),
            rows,
            cols,
            ldc: ldc.max(1),
            _rows: std::marker::PhantomData,
        }
    }

    /// The block's rows, `cols` values each, one at a time.
    pub fn for_each_row(&mut self, mut f: impl FnMut(&mut [f32])) {
        for r in 0..self.rows {
            // SAFETY: row r's `cols` values lie inside the block ([`Stretch::new`] derived
            // `rows` from a slice that holds them; `block` from bounds it asserted), which this
            // `Stretch` borrows mutably; one row slice exists at a time.
            f(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r * self.ldc), self.cols) });
        }
    }
}

/// [`sgemm`] with `b` packed beforehand (a constant weight, packed once per plan).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_packed(
    isa: Isa,
    m: usize,
    scale: f32,
    a: View,
    b: &PackedB,
    c: &mut [f32],
    ldc: usize,
    threads: usize,
) -> Result<()> {
    sgemm_packed_then(isa, m, scale, a, b, c, ldc, threads, None)
}

/// [`sgemm_packed`], then `finish` on every finished stretch of `c` ([`Finish`]).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_packed_then(
    isa: Isa,
    m: usize,
    scale: f32,
    a: View,
    b: &PackedB,
    c: &mut [f32],
    ldc: usize,
    threads: usize,
    finish: Option<Finish>,
) -> Result<()> {
    let (n, k) = (b.n, b.k);
    // Applied to whole rows on the paths that do not run the blocked product.
    let finish_rows = |c: &mut [f32]| {
        if let (Some(f), true) = (finish, m > 0) {
            f(Stretch::new(&mut c[..(m - 1) * ldc + n], 0, n, ldc));
        }
    };
    check(isa, m, n, k, a, None, c, ldc)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 || !available(isa) {
        let bv = PackedView(b);
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for kk in 0..k {
                    acc = a.at(i, kk).mul_add(bv.at(kk, j), acc);
                }
                c[i * ldc + j] = acc * scale;
            }
        }
        finish_rows(c);
        return Ok(());
    }
    let threads = if m * n * k >= PAR_WORK { threads } else { 1 };
    if m == 1 && a.cs == 1 && threads == 1 {
        gemv_packed(isa, k, &a.data[..k], b, c, scale);
        finish_rows(c);
        return Ok(());
    }
    run(
        isa,
        m,
        n,
        k,
        scale,
        a,
        BSrc::Packed(&b.data),
        c,
        ldc,
        threads,
        finish,
    );
    Ok(())
}

/// One reduction run of [`sgemm_packed_runs`]: rows `k0..k0 + kc` of the packed `b` against
/// `kc` consecutive values of every row of `a` (row `i`'s at `a[i * ars..]`).
#[derive(Clone, Copy, Debug)]
pub struct Run<'a> {
    pub a: &'a [f32],
    pub k0: usize,
    pub kc: usize,
}

/// `c[m x n] = sum over runs of a_run[m x kc] * b[k0..k0 + kc, :]`, single-threaded: each
/// output one FMA chain over the runs in order (from zero; no runs give zeros), as
/// [`sgemm_packed`] computes it when the runs are consecutive column ranges of one `a`.
///
/// A direct convolution's product: with an NHWC input, one kernel row's taps of a row of
/// output pixels are `kw * c` consecutive values per pixel, pixels `stride * c` apart, so each
/// kernel row is one run read in place (no im2col copy).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_packed_runs(
    isa: Isa,
    m: usize,
    ars: usize,
    runs: &[Run],
    b: &PackedB,
    c: &mut [f32],
    ldc: usize,
) -> Result<()> {
    let n = b.n;
    for run in runs {
        let fits = run.k0 + run.kc <= b.k
            && (m == 0 || run.kc == 0 || run.a.len() >= (m - 1) * ars + run.kc);
        if !fits {
            bail!(
                "f32 run product: run of {} steps from {} does not fit {m} rows at stride {ars} \
                 ({} values) and {} weight rows",
                run.kc,
                run.k0,
                run.a.len(),
                b.k
            );
        }
    }
    check(isa, m, n, 0, View::rows(&[], 0), None, c, ldc)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if !available(isa) {
        let bv = PackedView(b);
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for run in runs {
                    for kk in 0..run.kc {
                        acc = run.a[i * ars + kk].mul_add(bv.at(run.k0 + kk, j), acc);
                    }
                }
                c[i * ldc + j] = acc;
            }
        }
        return Ok(());
    }
    for p in 0..n.div_ceil(NR) {
        let j0 = p * NR;
        let cols = NR.min(n - j0);
        let narrow = cols <= 16;
        // Rows in tiles of near-equal height (a row of 78 pixels: 4 narrow tiles of 19-20, not
        // 3 of 24 and one of 6).
        let tiles = m.div_ceil(if narrow { MR_NARROW } else { MR });
        let mut i = 0;
        for t in 0..tiles {
            let r = (m - i) / (tiles - t);
            let at = i * ldc + j0;
            assert!(
                at + (r - 1) * ldc + cols <= c.len(),
                "sgemm output tile outside the output"
            );
            // Runs in groups of SEGS on the stack (no allocation per tile); later groups
            // continue the chains from `c`.
            let groups = runs.len().div_ceil(SEGS).max(1);
            for g in 0..groups {
                let group = &runs[(g * SEGS).min(runs.len())..((g + 1) * SEGS).min(runs.len())];
                let mut parts: [(&[f32], &[f32], usize); SEGS] = [(&[], &[], 0); SEGS];
                for (part, run) in parts.iter_mut().zip(group) {
                    *part = (
                        &run.a[i * ars..],
                        &b.data[p * b.k * NR + run.k0 * NR..][..run.kc * NR],
                        run.kc,
                    );
                }
                // SAFETY: the level has AVX2 (`available`); `tile` checks every run's
                // reads; the assert keeps rows i..i+r, columns j0..j0+cols inside `c`,
                // borrowed mutably here.
                unsafe {
                    tile(
                        isa,
                        narrow,
                        r,
                        &parts[..group.len()],
                        (ars, 1),
                        NR,
                        c.as_mut_ptr().add(at),
                        ldc,
                        cols,
                        g > 0,
                        1.0,
                    )
                };
            }
            i += r;
        }
    }
    Ok(())
}

/// Panels one row's product keeps in flight: 2 accumulators each, so 8 independent FMA
/// chains hide the multiply-add latency (a single 1 x 32 tile has 2 and waits on them).
const GEMV_PANELS: usize = 4;

/// `c[0..n] = scale * a · b` for one row (a batch-1 recurrence's `h · Rᵀ`): groups of
/// [`GEMV_PANELS`] panels walked together, every output the same `k`-ordered FMA chain as
/// the tiles compute.
fn gemv_packed(isa: Isa, k: usize, a: &[f32], b: &PackedB, c: &mut [f32], scale: f32) {
    let n = b.n;
    assert!(a.len() >= k && c.len() >= n && b.data.len() >= n.div_ceil(NR) * k * NR);
    let panels = n.div_ceil(NR);
    type Panels = unsafe fn(usize, usize, *const f32, *const f32, usize, *mut f32, usize, f32);
    #[cfg(target_arch = "x86_64")]
    let (group, kernel): (usize, Panels) = if isa.has_avx512() {
        (GEMV_PANELS, gemv_panels_avx512)
    } else {
        (GEMV_PANELS_AVX2, gemv_panels_avx2)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (group, kernel): (usize, Panels) = {
        let _ = isa;
        (GEMV_PANELS, gemv_panels_avx512)
    };
    for p in (0..panels).step_by(group) {
        let g = group.min(panels - p);
        let cols = (n - p * NR).min(g * NR);
        // SAFETY: `sgemm_packed` runs this only at a level with AVX2 and FMA (`available`),
        // and the AVX-512 kernel only where the level has AVX-512 (chosen above); the assert
        // above keeps panels p..p+g (k * NR values each) inside `b.data`, `a[..k]` inside `a`,
        // and the `cols` outputs from p * NR inside `c`.
        unsafe {
            kernel(
                g,
                k,
                a.as_ptr(),
                b.data.as_ptr().add(p * k * NR),
                k * NR,
                c.as_mut_ptr().add(p * NR),
                cols,
                scale,
            )
        };
    }
}

/// `g <= GEMV_PANELS` consecutive panels (stride `ps`) times one row `a[..k]`, the first
/// `cols` of their `g * NR` columns stored at `c`.
///
/// # Safety
/// AVX-512 F; `b` holds `g` panels of `k * NR` values at stride `ps`, `a` `k` values, `c`
/// `cols` writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_panels_avx512(
    g: usize,
    k: usize,
    a: *const f32,
    b: *const f32,
    ps: usize,
    c: *mut f32,
    cols: usize,
    scale: f32,
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 2 * GEMV_PANELS];
    for kk in 0..k {
        // SAFETY: a[kk] (kk < k) and row kk of each of the g panels (NR values at
        // q * ps + kk * NR) are inside the operands (the contract).
        unsafe {
            let av = _mm512_set1_ps(*a.add(kk));
            for q in 0..g {
                let bp = b.add(q * ps + kk * NR);
                acc[2 * q] = _mm512_fmadd_ps(av, _mm512_loadu_ps(bp), acc[2 * q]);
                acc[2 * q + 1] = _mm512_fmadd_ps(av, _mm512_loadu_ps(bp.add(16)), acc[2 * q + 1]);
            }
        }
    }
    let sv = _mm512_set1_ps(scale);
    for (v, accv) in acc.iter().enumerate().take(2 * g) {
        let lo = v * 16;
        if lo >= cols {
            break;
        }
        let mask: __mmask16 = if cols - lo >= 16 {
            0xffff
        } else {
            (1u32 << (cols - lo)) as u16 - 1
        };
        let out = if scale != 1.0 {
            _mm512_mul_ps(*accv, sv)
        } else {
            *accv
        };
        // SAFETY: outputs lo..lo + popcount(mask) are among the `cols` writable values.
        unsafe { _mm512_mask_storeu_ps(c.add(lo), mask, out) };
    }
}

/// Panels [`gemv_panels_avx2`] walks together: 4 accumulators each, 8 FMA chains in 8 of the
/// 16 registers.
const GEMV_PANELS_AVX2: usize = 2;

/// [`gemv_panels_avx512`] with 8-lane registers: `g <= GEMV_PANELS_AVX2` panels.
///
/// # Safety
/// AVX2 and FMA; `b` holds `g` panels of `k * NR` values at stride `ps`, `a` `k` values, `c`
/// `cols` writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_panels_avx2(
    g: usize,
    k: usize,
    a: *const f32,
    b: *const f32,
    ps: usize,
    c: *mut f32,
    cols: usize,
    scale: f32,
) {
    use std::arch::x86_64::*;
    const V: usize = NR / 8;
    let mut acc = [_mm256_setzero_ps(); V * GEMV_PANELS_AVX2];
    for kk in 0..k {
        // SAFETY: a[kk] (kk < k) and row kk of each of the g panels (NR values at
        // q * ps + kk * NR) are inside the operands (the contract).
        unsafe {
            let av = _mm256_broadcast_ss(&*a.add(kk));
            for q in 0..g {
                let bp = b.add(q * ps + kk * NR);
                for v in 0..V {
                    acc[V * q + v] =
                        _mm256_fmadd_ps(av, _mm256_loadu_ps(bp.add(8 * v)), acc[V * q + v]);
                }
            }
        }
    }
    let mut out = [0f32; NR * GEMV_PANELS_AVX2];
    let sv = _mm256_set1_ps(scale);
    for (v, accv) in acc.iter().enumerate().take(V * g) {
        let x = if scale != 1.0 {
            _mm256_mul_ps(*accv, sv)
        } else {
            *accv
        };
        // SAFETY: v < V * GEMV_PANELS_AVX2, so the 8 values at 8 v lie inside `out`.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * v), x) };
    }
    // SAFETY: `cols` <= g * NR values, writable per the contract; `out` is a local.
    unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), c, cols) };
}

/// The non-x86 build never reaches [`gemv_panels_avx512`] (sgemm runs only at the AVX-512
/// level); this keeps the call site compiling.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_panels_avx512(
    g: usize,
    k: usize,
    a: *const f32,
    b: *const f32,
    ps: usize,
    c: *mut f32,
    cols: usize,
    scale: f32,
) {
    for j in 0..cols {
        let (q, col) = (j / NR, j % NR);
        let mut acc = 0f32;
        for kk in 0..k {
            // SAFETY: as the x86 kernel's contract.
            acc = unsafe { (*a.add(kk)).mul_add(*b.add(q * ps + kk * NR + col), acc) };
        }
        // SAFETY: j < cols, writable per the contract.
        unsafe { *c.add(j) = acc * scale };
    }
    let _ = g;
}

/// Reads a [`PackedB`] back by (row, column), for the scalar path.
struct PackedView<'a>(&'a PackedB);

impl PackedView<'_> {
    fn at(&self, kk: usize, j: usize) -> f32 {
        let b = self.0;
        b.data[(j / NR) * b.k * NR + kk * NR + j % NR]
    }
}

/// Where the micro-kernel reads `b`: packed panels, or a row-major view in place.
#[derive(Clone, Copy)]
enum BSrc<'a> {
    Packed(&'a [f32]),
    Rows(View<'a>),
}

/// The output matrix as a raw pointer, so that threads can write disjoint column panels of
/// the same rows (no `&mut` slices of it exist while they run).
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    len: usize,
    ldc: usize,
}
// SAFETY: `run` hands every thread a disjoint set of (row, column) tiles of the one buffer it
// borrows mutably for the whole call; nothing else reads or writes it meanwhile.
unsafe impl Send for Out {}
// SAFETY: as above: shared between threads only to write disjoint tiles.
unsafe impl Sync for Out {}

/// The blocked product over all of `c`, split across `threads` (bounds already checked).
#[allow(clippy::too_many_arguments)]
fn run(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    scale: f32,
    a: View,
    b: BSrc,
    c: &mut [f32],
    ldc: usize,
    threads: usize,
    finish: Option<Finish>,
) {
    let blocks = m.div_ceil(MR);
    let panels = n.div_ceil(NR);
    let out = Out {
        ptr: c.as_mut_ptr(),
        len: c.len(),
        ldc,
    };
    let t = threads.max(1).min(blocks.max(panels));
    if t <= 1 {
        block(isa, 0..m, 0..panels, n, k, scale, a, b, out, finish);
        return;
    }
    // Split whichever of row blocks and column panels divides more evenly over `t` threads
    // (the critical path is the largest share); ties go to columns, whose shares read
    // disjoint parts of `b`.
    let share = |units: usize| units.div_ceil(t) as f64 / units as f64;
    if share(panels) <= share(blocks) || blocks < t {
        let per = panels.div_ceil(t);
        (0..panels.div_ceil(per)).into_par_iter().for_each(|g| {
            block(
                isa,
                0..m,
                g * per..((g + 1) * per).min(panels),
                n,
                k,
                scale,
                a,
                b,
                out,
                finish,
            );
        });
    } else {
        let per = blocks.div_ceil(t) * MR;
        (0..m.div_ceil(per)).into_par_iter().for_each(|g| {
            block(
                isa,
                g * per..((g + 1) * per).min(m),
                0..panels,
                n,
                k,
                scale,
                a,
                b,
                out,
                finish,
            );
        });
    }
}

/// Rows `rows` and column panels `panels` of `c` (no other call running at the same time
/// writes them).
#[allow(clippy::too_many_arguments)]
fn block(
    isa: Isa,
    rows: std::ops::Range<usize>,
    panels: std::ops::Range<usize>,
    n: usize,
    k: usize,
    scale: f32,
    a: View,
    b: BSrc,
    c: Out,
    finish: Option<Finish>,
) {
    let in_place = a.cs == 1;
    let mut apack = if in_place {
        Vec::new()
    } else {
        take_scratch(&SCRATCH_A, MC.div_ceil(MR) * MR * KC)
    };
    let mc = if in_place {
        let len = rows.len();
        len.div_ceil(len.div_ceil(MC_IN_PLACE).max(1))
    } else {
        MC
    };
    let mut c0 = rows.start;
    while c0 < rows.end {
        let c1 = (c0 + mc).min(rows.end);
        let mut k0 = 0;
        while k0 < k {
            let kc = if isa.has_avx512() { KC } else { KC_AVX2 }.min(k - k0);
            // A row-major `a` is read in place (12 row streams; packing it cost more than it
            // saved); other strides are packed.
            if !in_place {
                pack_a(a, c0..c1, k0, kc, &mut apack);
            }
            let last = k0 + kc == k;
            for p in panels.clone() {
                let j0 = p * NR;
                let cols = NR.min(n - j0);
                let (bp, ldb) = match b {
                    BSrc::Packed(d) => (&d[p * k * NR + k0 * NR..][..kc * NR], NR),
                    BSrc::Rows(v) => (&v.data[k0 * v.rs + j0..], v.rs),
                };
                // Row-major `a` in place and one register of columns: narrow tiles.
                let narrow = cols <= 16 && in_place;
                let step = if narrow { MR_NARROW } else { MR };
                // Narrow tiles over an in-place `a` have near-equal heights, wide ones are MR
                // rows but for the last one or two ([`in_place_height`]); packed micro-panels
                // are MR rows each.
                let tiles = (c1 - c0).div_ceil(step);
                let (mut i, mut t) = (c0, 0);
                while i < c1 {
                    let r = if !in_place {
                        step.min(c1 - i)
                    } else if narrow {
                        (c1 - i) / (tiles - t).max(1)
                    } else {
                        in_place_height(c1 - i)
                    };
                    t += 1;
                    let (ap, ars, acs) = if in_place {
                        (&a.data[i * a.rs + k0..], a.rs, 1)
                    } else {
                        (&apack[(i - c0) * kc..][..kc * MR], 1, MR)
                    };
                    let at = i * c.ldc + j0;
                    assert!(
                        at + (r - 1) * c.ldc + cols <= c.len,
                        "sgemm output tile outside the output"
                    );
                    // SAFETY: `run`'s callers checked the level (AVX-512 F); `tile` checks the
                    // run's reads (in place, `check` proved rows i..i+r of `a` at steps
                    // k0..k0+kc and rows k0..k0+kc of `b` at columns j0..j0+cols lie inside
                    // them); the assert above keeps the tile's rows i..i+r, columns
                    // j0..j0+cols inside `c`, which only this call writes.
                    unsafe {
                        tile(
                            isa,
                            narrow,
                            r,
                            &[(ap, bp, kc)],
                            (ars, acs),
                            ldb,
                            c.ptr.add(at),
                            c.ldc,
                            cols,
                            k0 > 0,
                            if last { scale } else { 1.0 },
                        )
                    }
                    i += r;
                }
                if let (true, Some(f)) = (last, finish) {
                    assert!(
                        (c1 - 1) * c.ldc + j0 + cols <= c.len,
                        "sgemm finished block outside the output"
                    );
                    // The rows c0..c1, columns j0..j0+cols, inside `c` by the assert: this call
                    // alone writes them (see `Out`) and the tiles above are done with them.
                    f(Stretch {
                        j0,
                        // SAFETY: in bounds by the assert.
                        ptr: unsafe { c.ptr.add(c0 * c.ldc + j0) },
                        rows: c1 - c0,
                        cols,
                        ldc: c.ldc,
                        _rows: std::marker::PhantomData,
                    });
                }
            }
            k0 += kc;
        }
        c0 = c1;
    }
    give_scratch(&SCRATCH_A, apack);
}

/// Height of the next wide tile over an in-place `a` with `left` rows to go: [`MR`] (the
/// most accumulators) while that leaves either nothing or a last tile of 8 or more rows;
/// otherwise the last 13..23 rows split into two near-equal tiles (40 rows: 12, 12, 8, 8, not
/// a last tile of 4 whose 8 accumulator chains wait on the multiply-add latency).
fn in_place_height(left: usize) -> usize {
    // Between MR and 2 MR rows the remainder is 1..MR-1.
    if left <= MR || left >= 2 * MR || left - MR >= 8 {
        left.min(MR)
    } else {
        left / 2
    }
}

/// Packs rows `rows` x steps `k0..k0+kc` of `a`: micro-panel `q` (rows `q*MR..`) at
/// `q * kc * MR`, step `kk`'s [`MR`] values contiguous (rows past the end are left as they
/// were: the kernel computes them but never stores them).
fn pack_a(a: View, rows: std::ops::Range<usize>, k0: usize, kc: usize, dst: &mut [f32]) {
    for (q, i0) in rows.clone().step_by(MR).enumerate() {
        let r = MR.min(rows.end - i0);
        let panel = &mut dst[q * kc * MR..][..kc * MR];
        for ri in 0..r {
            let row = i0 + ri;
            if a.cs == 1 {
                let src = &a.data[row * a.rs + k0..][..kc];
                for (kk, &v) in src.iter().enumerate() {
                    panel[kk * MR + ri] = v;
                }
            } else {
                for kk in 0..kc {
                    panel[kk * MR + ri] = a.at(row, k0 + kk);
                }
            }
        }
    }
}

/// The scalar twin: each output one `mul_add` chain in `k` order from zero, times `scale`.
#[allow(clippy::too_many_arguments)]
pub fn sgemm_scalar(
    m: usize,
    n: usize,
    k: usize,
    scale: f32,
    a: View,
    b: View,
    c: &mut [f32],
    ldc: usize,
) {
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for kk in 0..k {
                acc = a.at(i, kk).mul_add(b.at(kk, j), acc);
            }
            c[i * ldc + j] = acc * scale;
        }
    }
}

/// One reduction run of a micro-tile: `k` steps of `a` (row `r`, step `kk` at
/// `a + r * ars + kk * acs`) against `k` rows of `b` (`cols` values each, at stride `ldb`).
#[derive(Clone, Copy)]
struct Seg {
    a: *const f32,
    b: *const f32,
    k: usize,
}

/// Reduction runs one kernel call takes (a tile with more chains them through `c`).
const SEGS: usize = 8;

/// A tile's reduction run after checking its bounds: `a` must hold `rows` rows of `k` steps at
/// strides `(ars, acs)`, `b` `k` rows of `cols` values at stride `ldb`.
fn seg(
    (a, b, k): (&[f32], &[f32], usize),
    rows: usize,
    (ars, acs): (usize, usize),
    ldb: usize,
    cols: usize,
) -> Seg {
    assert!(
        k == 0 || (b.len() >= (k - 1) * ldb + cols && a.len() > (rows - 1) * ars + (k - 1) * acs),
        "sgemm tile operands too short"
    );
    Seg {
        a: a.as_ptr(),
        b: b.as_ptr(),
        k,
    }
}

/// One micro-tile of `rows` rows and `cols` columns: every output one FMA chain over the
/// reduction runs `runs` (`(a, b, k)` each, bounds checked here) in order, starting from zero
/// or, with `cont`, from `c` (a later reduction pass); `scale` multiplies the results as they
/// are stored. `narrow` tiles take up to [`MR_NARROW`] rows of at most 16 columns (one
/// accumulator per row), wide ones up to [`MR`] rows of at most [`NR`] columns.
///
/// # Safety
/// The level `isa` (AVX-512 F, or AVX2 and FMA, on x86-64); `c` points at `rows` writable rows of `cols` values at stride `ldc`
/// that nothing else accesses meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    isa: Isa,
    narrow: bool,
    rows: usize,
    runs: &[(&[f32], &[f32], usize)],
    strides: (usize, usize),
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    cont: bool,
    scale: f32,
) {
    let (max_rows, max_cols) = if narrow { (MR_NARROW, 16) } else { (MR, NR) };
    assert!(
        (1..=max_rows).contains(&rows) && (1..=max_cols).contains(&cols),
        "sgemm tile shape out of range"
    );
    let groups = runs.len().div_ceil(SEGS).max(1);
    for g in 0..groups {
        let group = &runs[(g * SEGS).min(runs.len())..((g + 1) * SEGS).min(runs.len())];
        let mut segs = [Seg {
            a: std::ptr::null(),
            b: std::ptr::null(),
            k: 0,
        }; SEGS];
        for (s, &run) in segs.iter_mut().zip(group) {
            *s = seg(run, rows, strides, ldb, cols);
        }
        let segs = &segs[..group.len()];
        let scale = if g + 1 == groups { scale } else { 1.0 };
        // SAFETY: every run's reads were checked by `seg`; `c` as this function's contract.
        unsafe {
            tile_kernel(
                isa,
                narrow,
                rows,
                segs,
                strides,
                ldb,
                c,
                ldc,
                cols,
                cont || g > 0,
                scale,
            )
        }
    }
}

/// Dispatches [`tile`]'s checked runs to the kernel for its row count.
///
/// # Safety
/// As [`tile`], with every run's reads inside its operands.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_kernel(
    isa: Isa,
    narrow: bool,
    rows: usize,
    segs: &[Seg],
    (ars, acs): (usize, usize),
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    cont: bool,
    scale: f32,
) {
    macro_rules! go {
        ($kernel:ident: $($r:literal)*) => {
            match rows {
                // SAFETY: AVX-512 F and the runs' bounds per this function's contract.
                $($r => unsafe { $kernel::<$r>(segs, ars, acs, ldb, c, ldc, cols, cont, scale) },)*
                _ => unreachable!(),
            }
        };
    }
    if !isa.has_avx512() {
        // SAFETY: `tile` runs only at a level with AVX2 and FMA ([`available`]); the runs'
        // bounds and `c` per this function's contract.
        unsafe { tile_split_avx2(rows, segs, (ars, acs), ldb, c, ldc, cols, cont, scale) };
    } else if narrow {
        go!(tile_narrow_avx512: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24);
    } else {
        go!(tile_avx512: 1 2 3 4 5 6 7 8 9 10 11 12);
    }
}

/// Rows of an AVX2 sub-tile of 16 columns: 2 accumulators a row, 12 of the 16 registers.
const MR_AVX2: usize = 6;
/// Rows of an AVX2 sub-tile of at most 8 columns: 1 accumulator a row.
const MR_AVX2_HALF: usize = 12;

/// An AVX2 (16-register) tile of any shape [`tile`] takes, as sub-tiles: each 16-column half
/// of the columns on its own (a 32-column panel row is two 64-byte lines, and a half-panel
/// block of `b`, `KC` lines, stays in L1 while the sub-tiles of its rows pass), rows in
/// near-equal chunks of at most [`MR_AVX2`] ([`MR_AVX2_HALF`] when the half has 8 columns or
/// fewer). Every output is the same `k`-ordered FMA chain as at the other levels.
///
/// # Safety
/// AVX2 and FMA; runs and `c` valid as [`tile`] states.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_split_avx2(
    rows: usize,
    segs: &[Seg],
    (ars, acs): (usize, usize),
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    cont: bool,
    scale: f32,
) {
    for h in 0..cols.div_ceil(16) {
        let hc = (cols - 16 * h).min(16);
        // Constant divisors and u32 quotients: a narrow tile's whole product can be a few
        // hundred FMAs, so the split's own arithmetic shows (it and the sub-run arrays it
        // used to build took 5-8% of PP-OCRv6 det).
        let rows32 = rows as u32;
        let chunks = if hc <= 8 {
            rows32.div_ceil(MR_AVX2_HALF as u32)
        } else {
            rows32.div_ceil(MR_AVX2 as u32)
        };
        let mut i = 0u32;
        for t in 0..chunks {
            let r = ((rows32 - i) / (chunks - t)) as usize;
            // SAFETY: rows i..i + r and columns 16 h..16 h + hc of the tile, inside `c` and the
            // runs' operands by the contract (the kernel offsets each run's `a` by i rows and
            // its `b` by 16 h columns); AVX2 and FMA as the contract.
            unsafe {
                let (a_off, b_off) = (i as usize * ars, 16 * h);
                let ct = c.add(i as usize * ldc + 16 * h);
                macro_rules! go {
                    ($w:literal: $($r:literal)*) => {
                        match r {
                            $($r => tile_avx2::<$r, $w>(segs, (a_off, b_off), ars, acs, ldb, ct, ldc, hc, cont, scale),)*
                            _ => unreachable!("AVX2 sub-tiles have 1..=12 rows"),
                        }
                    };
                }
                if hc <= 8 {
                    go!(1: 1 2 3 4 5 6 7 8 9 10 11 12)
                } else {
                    go!(2: 1 2 3 4 5 6)
                }
            }
            i += r as u32;
        }
    }
}

/// Lane masks of the first `cols` (0..=16) columns over two 8-lane registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lane_masks(cols: usize) -> [std::arch::x86_64::__m256i; 2] {
    use std::arch::x86_64::*;
    let n = _mm256_set1_epi32(cols as i32);
    let lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    [_mm256_cmpgt_epi32(n, lo), _mm256_cmpgt_epi32(n, hi)]
}

/// R rows x `cols` (<= 8 W) columns in W 8-lane accumulators a row (from zero, or from `c`
/// when `cont`): per step W loads of the `b` row (masked when `cols` < 8 W, so nothing past
/// the columns is read) and a broadcast of each row's `a` value from memory. The same FMA
/// chains as the scalar twin.
///
/// # Safety
/// AVX2 and FMA; every run's `a` holds, from `a_off`, `R` rows of `k` steps at strides (`ars`,
/// `acs`), its `b`, from `b_off`, `k` rows of `cols` values `ldb` apart; `c` `R` writable rows of `cols` values `ldc`
/// apart, accessed by nothing else meanwhile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx2<const R: usize, const W: usize>(
    segs: &[Seg],
    (a_off, b_off): (usize, usize),
    ars: usize,
    acs: usize,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    cont: bool,
    scale: f32,
) {
    use std::arch::x86_64::*;
    let full = cols == 8 * W;
    let masks = lane_masks(cols);
    let mut acc = [[_mm256_setzero_ps(); W]; R];
    if cont {
        for (r, accr) in acc.iter_mut().enumerate() {
            for (w, v) in accr.iter_mut().enumerate() {
                // SAFETY: row r < R of `c` holds `cols` values at r * ldc; the masked load
                // reads only those.
                *v = unsafe { _mm256_maskload_ps(c.add(r * ldc + 8 * w), masks[w]) };
            }
        }
    }
    for s in segs {
        let rows: [*const f32; R] = std::array::from_fn(|r| s.a.wrapping_add(a_off + r * ars));
        let mut b = s.b.wrapping_add(b_off);
        let mut off = 0;
        // SAFETY (both loops): step kk < k of row r < R is a[a_off + r * ars + kk * acs],
        // inside the run's `a`; row kk of `b` holds `cols` values at b_off + kk * ldb, read in
        // full only when `cols` is the whole width, else through the lane masks (the
        // contract).
        if full {
            let mut kk = 0;
            if acs == 1 && R <= MR_AVX2 {
                // Four steps an iteration at constant offsets from the row bases (one address
                // update per four steps rather than per step); 12-row tiles, whose row bases
                // alone take 12 registers, keep the single-step loop (this one spilled).
                while kk + 4 <= s.k {
                    unsafe {
                        for u in 0..4 {
                            let bp = b.wrapping_add(u * ldb);
                            let bv: [__m256; W] =
                                std::array::from_fn(|w| _mm256_loadu_ps(bp.add(8 * w)));
                            for (row, accr) in rows.iter().zip(acc.iter_mut()) {
                                let av = _mm256_broadcast_ss(&*row.add(off + u));
                                for (v, bw) in accr.iter_mut().zip(bv) {
                                    *v = _mm256_fmadd_ps(av, bw, *v);
                                }
                            }
                        }
                        b = b.wrapping_add(4 * ldb);
                    }
                    off += 4;
                    kk += 4;
                }
            }
            for _ in kk..s.k {
                unsafe {
                    let bv: [__m256; W] = std::array::from_fn(|w| _mm256_loadu_ps(b.add(8 * w)));
                    for (row, accr) in rows.iter().zip(acc.iter_mut()) {
                        let av = _mm256_broadcast_ss(&*row.add(off));
                        for (v, bw) in accr.iter_mut().zip(bv) {
                            *v = _mm256_fmadd_ps(av, bw, *v);
                        }
                    }
                    b = b.wrapping_add(ldb);
                }
                off += acs;
            }
        } else {
            for _ in 0..s.k {
                unsafe {
                    let bv: [__m256; W] =
                        std::array::from_fn(|w| _mm256_maskload_ps(b.add(8 * w), masks[w]));
                    for (row, accr) in rows.iter().zip(acc.iter_mut()) {
                        let av = _mm256_broadcast_ss(&*row.add(off));
                        for (v, bw) in accr.iter_mut().zip(bv) {
                            *v = _mm256_fmadd_ps(av, bw, *v);
                        }
                    }
                    b = b.wrapping_add(ldb);
                }
                off += acs;
            }
        }
    }
    let sv = _mm256_set1_ps(scale);
    for (r, accr) in acc.iter().enumerate() {
        for (w, v) in accr.iter().enumerate() {
            let v = if scale != 1.0 {
                _mm256_mul_ps(*v, sv)
            } else {
                *v
            };
            // SAFETY: row r < R of `c` holds `cols` writable values at r * ldc; the masked
            // store writes only those.
            unsafe {
                let p = c.add(r * ldc + 8 * w);
                if full {
                    _mm256_storeu_ps(p, v)
                } else {
                    _mm256_maskstore_ps(p, masks[w], v)
                }
            }
        }
    }
}

/// The portable kernel (other architectures): the same FMA chains, one output at a time.
///
/// # Safety
/// As [`tile`], with every run's reads inside its operands.
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_kernel(
    _isa: Isa,
    _narrow: bool,
    rows: usize,
    segs: &[Seg],
    (ars, acs): (usize, usize),
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    cont: bool,
    scale: f32,
) {
    for i in 0..rows {
        for j in 0..cols {
            // SAFETY: `c` holds `rows` rows of `cols` values at stride `ldc`, and every run
            // `rows` rows of `k` steps (the contract).
            unsafe {
                let cij = &mut *c.add(i * ldc + j);
                let mut acc = if cont { *cij } else { 0.0 };
                for s in segs {
                    for kk in 0..s.k {
                        acc = (*s.a.add(i * ars + kk * acs)).mul_add(*s.b.add(kk * ldb + j), acc);
                    }
                }
                *cij = acc * scale;
            }
        }
    }
}

/// R rows x 16 columns: R accumulators, columns beyond `cols` masked off; each output the
/// same FMA chain as the wide kernel's (so the results are identical).
///
/// # Safety
/// AVX-512 F; runs and `c` valid as [`tile`] states.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_narrow_avx512<const R: usize>(
    segs: &[Seg],
    ars: usize,
    acs: usize,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    cont: bool,
    scale: f32,
) {
    use std::arch::x86_64::*;
    let m0: __mmask16 = if cols >= 16 {
        0xffff
    } else {
        (1u32 << cols) as u16 - 1
    };
    // MR_NARROW accumulators whatever R: the assembly loop names all of them (registers
    // zmm0..zmm23); only the first R are loaded, computed and stored.
    let mut acc = [_mm512_setzero_ps(); MR_NARROW];
    if cont {
        for (r, accr) in acc.iter_mut().enumerate().take(R) {
            // SAFETY: row r < R of `c` holds `cols` values at r * ldc (masked load).
            unsafe { *accr = _mm512_maskz_loadu_ps(m0, c.add(r * ldc)) };
        }
    }
    for s in segs {
        if acs == 1 && ldb == NR {
            // SAFETY: R <= MR_NARROW rows of the run's `a` hold `k` contiguous steps at stride
            // `ars` and its `b` `k` rows of at least `cols` values NR apart (checked by `seg`).
            unsafe { narrow_in_place::<R>(s, ars, m0, &mut acc) };
            continue;
        }
        for kk in 0..s.k {
            // SAFETY: row kk < k of the run's `b` holds `cols` values at kk * ldb (masked load)
            // and a[r * ars + kk * acs] (r < R) is inside the run's `a` (checked by `seg`).
            unsafe {
                let b0 = _mm512_maskz_loadu_ps(m0, s.b.add(kk * ldb));
                let ap = s.a.add(kk * acs);
                for (r, accr) in acc.iter_mut().enumerate().take(R) {
                    *accr = _mm512_fmadd_ps(_mm512_set1_ps(*ap.add(r * ars)), b0, *accr);
                }
            }
        }
    }
    let sv = _mm512_set1_ps(scale);
    for (r, accr) in acc.iter().enumerate().take(R) {
        let v = if scale != 1.0 {
            _mm512_mul_ps(*accr, sv)
        } else {
            *accr
        };
        // SAFETY: row r < R of `c` holds `cols` values at r * ldc (masked store).
        unsafe { _mm512_mask_storeu_ps(c.add(r * ldc), m0, v) };
    }
}

/// [`narrow_in_place`]'s row `r` at step offset `k` (0..3 within an iteration): one
/// multiply-add into `zmm{r}` of the panel row in `zmm24` and `a[r][k]` broadcast from memory,
/// row `r` addressed as base `{a<r/4>}` plus 0, 1, 2 or 3 row strides.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
macro_rules! nrow {
    (@ $base:literal, $idx:literal, $r:literal, $k:literal) => {
        concat!("vfmadd231ps zmm", $r, ", zmm24, dword ptr [", $base, $idx, " + ", $k, "*4]{{1to16}}\n")
    };
    (0, $k:literal) => { nrow!(@ "{a0}", "", "0", $k) };
    (1, $k:literal) => { nrow!(@ "{a0}", " + {s}", "1", $k) };
    (2, $k:literal) => { nrow!(@ "{a0}", " + 2*{s}", "2", $k) };
    (3, $k:literal) => { nrow!(@ "{a0}", " + {s3}", "3", $k) };
    (4, $k:literal) => { nrow!(@ "{a1}", "", "4", $k) };
    (5, $k:literal) => { nrow!(@ "{a1}", " + {s}", "5", $k) };
    (6, $k:literal) => { nrow!(@ "{a1}", " + 2*{s}", "6", $k) };
    (7, $k:literal) => { nrow!(@ "{a1}", " + {s3}", "7", $k) };
    (8, $k:literal) => { nrow!(@ "{a2}", "", "8", $k) };
    (9, $k:literal) => { nrow!(@ "{a2}", " + {s}", "9", $k) };
    (10, $k:literal) => { nrow!(@ "{a2}", " + 2*{s}", "10", $k) };
    (11, $k:literal) => { nrow!(@ "{a2}", " + {s3}", "11", $k) };
    (12, $k:literal) => { nrow!(@ "{a3}", "", "12", $k) };
    (13, $k:literal) => { nrow!(@ "{a3}", " + {s}", "13", $k) };
    (14, $k:literal) => { nrow!(@ "{a3}", " + 2*{s}", "14", $k) };
    (15, $k:literal) => { nrow!(@ "{a3}", " + {s3}", "15", $k) };
    (16, $k:literal) => { nrow!(@ "{a4}", "", "16", $k) };
    (17, $k:literal) => { nrow!(@ "{a4}", " + {s}", "17", $k) };
    (18, $k:literal) => { nrow!(@ "{a4}", " + 2*{s}", "18", $k) };
    (19, $k:literal) => { nrow!(@ "{a4}", " + {s3}", "19", $k) };
    (20, $k:literal) => { nrow!(@ "{a5}", "", "20", $k) };
    (21, $k:literal) => { nrow!(@ "{a5}", " + {s}", "21", $k) };
    (22, $k:literal) => { nrow!(@ "{a5}", " + 2*{s}", "22", $k) };
    (23, $k:literal) => { nrow!(@ "{a5}", " + {s3}", "23", $k) };
}

/// One step of [`narrow_in_place`] at offset `k` over rows `$r`: the panel row's masked load,
/// then a multiply-add per row.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
macro_rules! nstep {
    ($k:literal; $($r:tt)*) => {
        concat!("vmovups zmm24{{{m}}}{{z}}, [{b} + ", $k, "*128]\n", $(nrow!($r, $k)),*)
    };
}

/// The reduction loop of [`narrow_in_place`] over rows `$r` (0..R-1): four steps an
/// iteration at constant offsets, then single steps.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
macro_rules! narrow_loop {
    ($acc:ident, $a:expr, $s:expr, $b:expr, $k:expr, $m:expr; $($r:tt)*) => {
        core::arch::asm!(
            "lea {s3}, [{s} + 2*{s}]",
            "lea {a1}, [{a0} + 4*{s}]",
            "lea {a2}, [{a1} + 4*{s}]",
            "lea {a3}, [{a2} + 4*{s}]",
            "lea {a4}, [{a3} + 4*{s}]",
            "lea {a5}, [{a4} + 4*{s}]",
            "test {k4}, {k4}",
            "jz 3f",
            "2:",
            nstep!("0"; $($r)*),
            nstep!("1"; $($r)*),
            nstep!("2"; $($r)*),
            nstep!("3"; $($r)*),
            "add {a0}, 16",
            "add {a1}, 16",
            "add {a2}, 16",
            "add {a3}, 16",
            "add {a4}, 16",
            "add {a5}, 16",
            "add {b}, 512",
            "dec {k4}",
            "jnz 2b",
            "3:",
            "test {k1}, {k1}",
            "jz 5f",
            "4:",
            nstep!("0"; $($r)*),
            "add {a0}, 4",
            "add {a1}, 4",
            "add {a2}, 4",
            "add {a3}, 4",
            "add {a4}, 4",
            "add {a5}, 4",
            "add {b}, 128",
            "dec {k1}",
            "jnz 4b",
            "5:",
            a0 = inout(reg) $a => _,
            s = in(reg) $s,
            b = inout(reg) $b => _,
            k4 = inout(reg) $k / 4 => _,
            k1 = inout(reg) $k % 4 => _,
            m = in(kreg) $m,
            s3 = out(reg) _,
            a1 = out(reg) _,
            a2 = out(reg) _,
            a3 = out(reg) _,
            a4 = out(reg) _,
            a5 = out(reg) _,
            inout("zmm0") $acc[0],
            inout("zmm1") $acc[1],
            inout("zmm2") $acc[2],
            inout("zmm3") $acc[3],
            inout("zmm4") $acc[4],
            inout("zmm5") $acc[5],
            inout("zmm6") $acc[6],
            inout("zmm7") $acc[7],
            inout("zmm8") $acc[8],
            inout("zmm9") $acc[9],
            inout("zmm10") $acc[10],
            inout("zmm11") $acc[11],
            inout("zmm12") $acc[12],
            inout("zmm13") $acc[13],
            inout("zmm14") $acc[14],
            inout("zmm15") $acc[15],
            inout("zmm16") $acc[16],
            inout("zmm17") $acc[17],
            inout("zmm18") $acc[18],
            inout("zmm19") $acc[19],
            inout("zmm20") $acc[20],
            inout("zmm21") $acc[21],
            inout("zmm22") $acc[22],
            inout("zmm23") $acc[23],
            out("zmm24") _,
            options(nostack, readonly),
        )
    };
}

/// A narrow tile's reduction run over a row-major `a` (rows `ars` values apart, steps
/// contiguous) and a packed panel of `b` (rows [`NR`] values apart, `m0` masking the tile's
/// columns), in assembly: the compiled loop chained the 24 rows' addresses through one
/// register, a serial add per row and step (18 cycles a step for 24 multiply-adds that need
/// 12). Here rows are six base registers plus 0..3 row strides, advanced once per four steps;
/// each multiply-add broadcasts its `a` value from memory. The same multiply-adds in the same
/// order as [`tile_narrow_avx512`]'s loop, so the same bits.
///
/// # Safety
/// AVX-512 F; `s.a` holds `R <= MR_NARROW` rows of `s.k` steps at stride `ars`, `s.b` `s.k`
/// rows of the columns `m0` selects, [`NR`] values apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn narrow_in_place<const R: usize>(
    s: &Seg,
    ars: usize,
    m0: std::arch::x86_64::__mmask16,
    acc: &mut [std::arch::x86_64::__m512; MR_NARROW],
) {
    let (a, b, k, sb) = (s.a, s.b, s.k, ars * 4);
    // SAFETY: the loop reads a[r * ars + kk] (r < R, kk < k) and the masked columns of
    // b[kk * NR ..] (kk < k) only, and writes no memory (only the accumulator registers). Row
    // bases past row R - 1 are computed but never dereferenced.
    unsafe {
        match R {
            1 => narrow_loop!(acc, a, sb, b, k, m0; 0),
            2 => narrow_loop!(acc, a, sb, b, k, m0; 0 1),
            3 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2),
            4 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3),
            5 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4),
            6 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5),
            7 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6),
            8 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7),
            9 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8),
            10 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9),
            11 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10),
            12 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11),
            13 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12),
            14 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13),
            15 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14),
            16 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15),
            17 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16),
            18 => narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17),
            19 => {
                narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18)
            }
            20 => {
                narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19)
            }
            21 => {
                narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20)
            }
            22 => {
                narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21)
            }
            23 => {
                narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22)
            }
            24 => {
                narrow_loop!(acc, a, sb, b, k, m0; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23)
            }
            _ => unreachable!("narrow tiles have 1..=MR_NARROW rows"),
        }
    }
}

/// R rows x 32 columns: 2R accumulators (from zero, or from `c` when `cont`); columns beyond
/// `cols` are masked off (loads read nothing there, stores write nothing).
///
/// # Safety
/// AVX-512 F; runs and `c` valid as [`tile`] states.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx512<const R: usize>(
    segs: &[Seg],
    ars: usize,
    acs: usize,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    cont: bool,
    scale: f32,
) {
    use std::arch::x86_64::*;
    let m0: __mmask16 = if cols >= 16 {
        0xffff
    } else {
        (1u32 << cols) as u16 - 1
    };
    let m1: __mmask16 = if cols >= 32 {
        0xffff
    } else if cols > 16 {
        (1u32 << (cols - 16)) as u16 - 1
    } else {
        0
    };
    // MR pairs of accumulators whatever R: the assembly loop names all of them (registers
    // zmm0..zmm23); only the first R are loaded, computed and stored.
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    if cont {
        for (r, accr) in acc.iter_mut().enumerate().take(R) {
            // SAFETY: row r < R of `c` holds `cols` values at r * ldc (masked loads).
            unsafe {
                accr[0] = _mm512_maskz_loadu_ps(m0, c.add(r * ldc));
                accr[1] = _mm512_maskz_loadu_ps(m1, c.add(r * ldc + 16));
            }
        }
    }
    for s in segs {
        if acs == 1 && ldb == NR {
            // SAFETY: R <= MR rows of the run's `a` hold `k` contiguous steps at stride `ars`
            // and its `b` `k` rows of at least `cols` values NR apart (checked by `seg`).
            unsafe { wide_in_place::<R>(s, ars, (m0, m1), &mut acc) };
            continue;
        }
        for kk in 0..s.k {
            // SAFETY: row kk < k of the run's `b` holds `cols` values at kk * ldb (masked loads
            // touch only those) and a[r * ars + kk * acs] (r < R) is inside the run's `a`
            // (checked by `seg`).
            unsafe {
                let bp = s.b.add(kk * ldb);
                let b0 = _mm512_maskz_loadu_ps(m0, bp);
                let b1 = _mm512_maskz_loadu_ps(m1, bp.add(16));
                let ap = s.a.add(kk * acs);
                for (r, accr) in acc.iter_mut().enumerate().take(R) {
                    let av = _mm512_set1_ps(*ap.add(r * ars));
                    accr[0] = _mm512_fmadd_ps(av, b0, accr[0]);
                    accr[1] = _mm512_fmadd_ps(av, b1, accr[1]);
                }
            }
        }
    }
    let sv = _mm512_set1_ps(scale);
    for (r, accr) in acc.iter().enumerate().take(R) {
        let (v0, v1) = if scale != 1.0 {
            (_mm512_mul_ps(accr[0], sv), _mm512_mul_ps(accr[1], sv))
        } else {
            (accr[0], accr[1])
        };
        // SAFETY: row r < R of `c` holds `cols` values at r * ldc (masked stores).
        unsafe {
            _mm512_mask_storeu_ps(c.add(r * ldc), m0, v0);
            _mm512_mask_storeu_ps(c.add(r * ldc + 16), m1, v1);
        }
    }
}

/// [`wide_in_place`]'s row `r` at step offset `k` (0..3 within an iteration): broadcast
/// `a[r][k]` from row base `{a<3 (r/3)>}` plus 0, 1 or 2 row strides into a register rotating
/// over `zmm26..zmm29`, then the two multiply-adds into `zmm{2r}`, `zmm{2r+1}` with the panel
/// row in `zmm24`, `zmm25`.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
macro_rules! wrow {
    (@ $base:literal, $idx:literal, $bc:literal, $c0:literal, $c1:literal, $k:literal) => {
        concat!(
            "vbroadcastss zmm", $bc, ", dword ptr [", $base, $idx, " + ", $k, "*4]\n",
            "vfmadd231ps zmm", $c0, ", zmm", $bc, ", zmm24\n",
            "vfmadd231ps zmm", $c1, ", zmm", $bc, ", zmm25\n",
        )
    };
    (0, $k:literal) => { wrow!(@ "{a0}", "", "26", "0", "1", $k) };
    (1, $k:literal) => { wrow!(@ "{a0}", " + {s}", "27", "2", "3", $k) };
    (2, $k:literal) => { wrow!(@ "{a0}", " + 2*{s}", "28", "4", "5", $k) };
    (3, $k:literal) => { wrow!(@ "{a3}", "", "29", "6", "7", $k) };
    (4, $k:literal) => { wrow!(@ "{a3}", " + {s}", "26", "8", "9", $k) };
    (5, $k:literal) => { wrow!(@ "{a3}", " + 2*{s}", "27", "10", "11", $k) };
    (6, $k:literal) => { wrow!(@ "{a6}", "", "28", "12", "13", $k) };
    (7, $k:literal) => { wrow!(@ "{a6}", " + {s}", "29", "14", "15", $k) };
    (8, $k:literal) => { wrow!(@ "{a6}", " + 2*{s}", "26", "16", "17", $k) };
    (9, $k:literal) => { wrow!(@ "{a9}", "", "27", "18", "19", $k) };
    (10, $k:literal) => { wrow!(@ "{a9}", " + {s}", "28", "20", "21", $k) };
    (11, $k:literal) => { wrow!(@ "{a9}", " + 2*{s}", "29", "22", "23", $k) };
}

/// One step of [`wide_in_place`] at offset `k` over rows `$r`: the panel row's two masked
/// loads, then each row's broadcast and multiply-adds.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
macro_rules! wstep {
    ($k:literal; $($r:tt)*) => {
        concat!(
            "vmovups zmm24{{{m0}}}{{z}}, [{b} + ", $k, "*128]\n",
            "vmovups zmm25{{{m1}}}{{z}}, [{b} + ", $k, "*128 + 64]\n",
            $(wrow!($r, $k)),*
        )
    };
}

/// The reduction loop of [`wide_in_place`] over rows `$r` (0..R-1): four steps an iteration
/// at constant offsets, then single steps.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
macro_rules! wide_loop {
    ($acc:ident, $a:expr, $s:expr, $b:expr, $k:expr, $m0:expr, $m1:expr; $($r:tt)*) => {
        core::arch::asm!(
            "lea {a3}, [{a0} + 2*{s}]",
            "add {a3}, {s}",
            "lea {a6}, [{a3} + 2*{s}]",
            "add {a6}, {s}",
            "lea {a9}, [{a6} + 2*{s}]",
            "add {a9}, {s}",
            "test {k4}, {k4}",
            "jz 3f",
            "2:",
            wstep!("0"; $($r)*),
            wstep!("1"; $($r)*),
            wstep!("2"; $($r)*),
            wstep!("3"; $($r)*),
            "add {a0}, 16",
            "add {a3}, 16",
            "add {a6}, 16",
            "add {a9}, 16",
            "add {b}, 512",
            "dec {k4}",
            "jnz 2b",
            "3:",
            "test {k1}, {k1}",
            "jz 5f",
            "4:",
            wstep!("0"; $($r)*),
            "add {a0}, 4",
            "add {a3}, 4",
            "add {a6}, 4",
            "add {a9}, 4",
            "add {b}, 128",
            "dec {k1}",
            "jnz 4b",
            "5:",
            a0 = inout(reg) $a => _,
            s = in(reg) $s,
            b = inout(reg) $b => _,
            k4 = inout(reg) $k / 4 => _,
            k1 = inout(reg) $k % 4 => _,
            m0 = in(kreg) $m0,
            m1 = in(kreg) $m1,
            a3 = out(reg) _,
            a6 = out(reg) _,
            a9 = out(reg) _,
            inout("zmm0") $acc[0][0],
            inout("zmm1") $acc[0][1],
            inout("zmm2") $acc[1][0],
            inout("zmm3") $acc[1][1],
            inout("zmm4") $acc[2][0],
            inout("zmm5") $acc[2][1],
            inout("zmm6") $acc[3][0],
            inout("zmm7") $acc[3][1],
            inout("zmm8") $acc[4][0],
            inout("zmm9") $acc[4][1],
            inout("zmm10") $acc[5][0],
            inout("zmm11") $acc[5][1],
            inout("zmm12") $acc[6][0],
            inout("zmm13") $acc[6][1],
            inout("zmm14") $acc[7][0],
            inout("zmm15") $acc[7][1],
            inout("zmm16") $acc[8][0],
            inout("zmm17") $acc[8][1],
            inout("zmm18") $acc[9][0],
            inout("zmm19") $acc[9][1],
            inout("zmm20") $acc[10][0],
            inout("zmm21") $acc[10][1],
            inout("zmm22") $acc[11][0],
            inout("zmm23") $acc[11][1],
            out("zmm24") _,
            out("zmm25") _,
            out("zmm26") _,
            out("zmm27") _,
            out("zmm28") _,
            out("zmm29") _,
            options(nostack, readonly),
        )
    };
}

/// A wide tile's reduction run over a row-major `a` (rows `ars` values apart, steps
/// contiguous) and a packed panel of `b` (`m0`, `m1` masking the tile's columns), in assembly:
/// the compiled loop spent an address computation per row and step (ports the multiply-adds
/// need), while here each row is a base register plus `ars` times 0, 1 or 2 (a base per three
/// rows), advanced once per four steps. The same multiply-adds in the same order as
/// [`tile_avx512`]'s loop, so the same bits.
///
/// # Safety
/// AVX-512 F; `s.a` holds `R <= MR` rows of `s.k` steps at stride `ars`, `s.b` `s.k` rows of
/// the columns `m0`, `m1` select, [`NR`] values apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
#[rustfmt::skip]
unsafe fn wide_in_place<const R: usize>(
    s: &Seg,
    ars: usize,
    (m0, m1): (std::arch::x86_64::__mmask16, std::arch::x86_64::__mmask16),
    acc: &mut [[std::arch::x86_64::__m512; 2]; MR],
) {
    let (a, b, k, sb) = (s.a, s.b, s.k, ars * 4);
    // SAFETY: the loop reads a[r * ars + kk] (r < R, kk < k) and the masked columns of
    // b[kk * NR ..] (kk < k) only, and writes no memory (only the accumulator registers). Row
    // bases past row R - 1 are computed but never dereferenced.
    unsafe {
        match R {
            1 => wide_loop!(acc, a, sb, b, k, m0, m1; 0),
            2 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1),
            3 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2),
            4 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2 3),
            5 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2 3 4),
            6 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2 3 4 5),
            7 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2 3 4 5 6),
            8 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2 3 4 5 6 7),
            9 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2 3 4 5 6 7 8),
            10 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2 3 4 5 6 7 8 9),
            11 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2 3 4 5 6 7 8 9 10),
            12 => wide_loop!(acc, a, sb, b, k, m0, m1; 0 1 2 3 4 5 6 7 8 9 10 11),
            _ => unreachable!("wide tiles have 1..=MR rows"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::xorshift;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn dispatched_equals_scalar_twin(
            m in prop_oneof![1usize..30, 250usize..270], n in 1usize..80,
            k in prop_oneof![0usize..90, 250usize..600], pad in 0usize..3,
            trans_a in any::<bool>(), trans_b in any::<bool>(), packed in any::<bool>(),
            finish in any::<bool>(), scale in prop_oneof![Just(1f32), -2f32..2f32],
            threads in 1usize..4, seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut val = || (xorshift(&mut s) % 2001) as f32 / 1000.0 - 1.0;
            let ldc = n + 2 * pad;
            // Row-major (or, transposed, column-major) operands with padded strides.
            let view = |rows: usize, cols: usize, t: bool| -> (usize, usize) {
                if t { (1, rows + pad) } else { (cols + pad, 1) }
            };
            let a: Vec<f32> = (0..(m + pad) * (k + pad)).map(|_| val()).collect();
            let b: Vec<f32> = (0..(k.max(1) + pad) * (n + pad)).map(|_| val()).collect();
            let (ars, acs) = view(m, k, trans_a);
            let (brs, bcs) = view(k, n, trans_b);
            let va = View { data: &a, rs: ars, cs: acs };
            let vb = View { data: &b, rs: brs, cs: bcs };
            let mut want = vec![f32::NAN; m * ldc];
            sgemm_scalar(m, n, k, scale, va, vb, &mut want, ldc);
            let mut got = vec![f32::NAN; m * ldc];
            if packed && finish {
                // A per-column bias then a doubling, as a fused epilogue: each value must be
                // finished exactly once, after its product.
                let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 3.0).collect();
                let f = |mut s: Stretch| {
                    let j0 = s.j0;
                    s.for_each_row(|v| {
                        for (x, &c) in v.iter_mut().zip(&bias[j0..]) {
                            *x = (*x + c) * 2.0;
                        }
                    });
                };
                let pb = PackedB::new_par(k, n, vb, threads).unwrap();
                sgemm_packed_then(Isa::detect(), m, scale, va, &pb, &mut got, ldc, threads, Some(&f))
                    .unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let w = &mut want[i * ldc + j];
                        *w = (*w + bias[j]) * 2.0;
                    }
                }
            } else if packed {
                let pb = PackedB::new_par(k, n, vb, threads).unwrap();
                sgemm_packed(Isa::detect(), m, scale, va, &pb, &mut got, ldc, threads).unwrap();
            } else {
                sgemm(Isa::detect(), m, n, k, scale, va, vb, &mut got, ldc, threads).unwrap();
            }
            for i in 0..m {
                for j in 0..ldc {
                    let (g, w) = (got[i * ldc + j], want[i * ldc + j]);
                    prop_assert_eq!(g.to_bits(), w.to_bits(), "({}, {}): {} vs {}", i, j, g, w);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// One row against packed panels (the batch-1 recurrence path, several panel groups).
        #[test]
        fn one_row_packed_equals_scalar_twin(
            n in 1usize..420, k in 0usize..300, scale in prop_oneof![Just(1f32), -2f32..2f32],
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut val = || (xorshift(&mut s) % 2001) as f32 / 1000.0 - 1.0;
            let a: Vec<f32> = (0..k).map(|_| val()).collect();
            let b: Vec<f32> = (0..k * n).map(|_| val()).collect();
            let (va, vb) = (View::rows(&a, k), View::rows(&b, n));
            let mut want = vec![f32::NAN; n + 1];
            sgemm_scalar(1, n, k, scale, va, vb, &mut want, n);
            let mut got = vec![f32::NAN; n + 1];
            let pb = PackedB::new(k, n, vb).unwrap();
            sgemm_packed(Isa::detect(), 1, scale, va, &pb, &mut got, n, 1).unwrap();
            for j in 0..=n {
                prop_assert_eq!(got[j].to_bits(), want[j].to_bits(), "column {}", j);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Products over reduction runs (a direct conv's kernel rows): the dispatched kernel
        /// equals the scalar twin bit for bit, including more runs than one kernel call takes,
        /// and consecutive runs of one `a` equal the plain packed product.
        #[test]
        fn runs_equal_scalar_twin(
            m in 1usize..60, n in 1usize..70, kw in 1usize..40, runs in 0usize..11,
            ars_pad in 0usize..5, seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut val = || (xorshift(&mut s) % 2001) as f32 / 1000.0 - 1.0;
            let k = kw * runs.max(1);
            let b: Vec<f32> = (0..k * n).map(|_| val()).collect();
            let pb = PackedB::new(k, n, View::rows(&b, n)).unwrap();
            // Run q reads kw values per row at stride ars from its own offset into one buffer.
            let ars = kw * runs.max(1) + ars_pad;
            let a: Vec<f32> = (0..m * ars + k).map(|_| val()).collect();
            let list: Vec<Run> = (0..runs)
                .map(|q| Run { a: &a[q * kw..], k0: q * kw, kc: kw })
                .collect();
            let ldc = n + 3;
            let mut want = vec![f32::NAN; m * ldc];
            sgemm_packed_runs(Isa::Scalar, m, ars, &list, &pb, &mut want, ldc).unwrap();
            let mut got = vec![f32::NAN; m * ldc];
            sgemm_packed_runs(Isa::detect(), m, ars, &list, &pb, &mut got, ldc).unwrap();
            for i in 0..m * ldc {
                prop_assert_eq!(got[i].to_bits(), want[i].to_bits(), "value {}", i);
            }
            if runs > 0 {
                let mut whole = vec![f32::NAN; m * ldc];
                sgemm_packed(Isa::detect(), m, 1.0, View::rows(&a, ars), &pb, &mut whole, ldc, 1)
                    .unwrap();
                for i in 0..m * ldc {
                    prop_assert_eq!(got[i].to_bits(), whole[i].to_bits(), "value {}", i);
                }
            } else {
                prop_assert!((0..m).all(|i| got[i * ldc..i * ldc + n].iter().all(|&v| v == 0.0)));
            }
        }
    }

    /// Every tile height (narrow: one tile of `m` rows, 1..=MR_NARROW; wide: one or two of
    /// 1..=MR) with full and masked column counts, at step counts around the assembly loops'
    /// four-step unrolling: the dispatched kernel equals the scalar twin bit for bit.
    #[test]
    fn every_tile_height_equals_scalar_twin() {
        let mut s = 7u64;
        let mut val = || (xorshift(&mut s) % 2001) as f32 / 1000.0 - 1.0;
        for m in 1..=MR_NARROW {
            for n in [1, 8, 15, 16, 17, 31, 32, 40] {
                for k in [1, 3, 4, 9, 64] {
                    let b: Vec<f32> = (0..k * n).map(|_| val()).collect();
                    let pb = PackedB::new(k, n, View::rows(&b, n)).unwrap();
                    let ars = k + 5;
                    let a: Vec<f32> = (0..m * ars).map(|_| val()).collect();
                    let list = [Run {
                        a: &a,
                        k0: 0,
                        kc: k,
                    }];
                    let mut want = vec![f32::NAN; m * n];
                    sgemm_packed_runs(Isa::Scalar, m, ars, &list, &pb, &mut want, n).unwrap();
                    let mut got = vec![f32::NAN; m * n];
                    sgemm_packed_runs(Isa::detect(), m, ars, &list, &pb, &mut got, n).unwrap();
                    for i in 0..m * n {
                        assert_eq!(
                            got[i].to_bits(),
                            want[i].to_bits(),
                            "m {m} n {n} k {k} at {i}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn runs_that_overreach_are_refused() {
        let b = [1f32; 12];
        let pb = PackedB::new(4, 3, View::rows(&b, 3)).unwrap();
        let a = [1f32; 12];
        let mut c = [0f32; 9];
        let run = |k0, kc| Run { a: &a, k0, kc };
        assert!(sgemm_packed_runs(Isa::detect(), 3, 4, &[run(0, 4)], &pb, &mut c, 3).is_ok());
        // Rows past `a`, steps past `b`, an output too small.
        assert!(sgemm_packed_runs(Isa::detect(), 3, 5, &[run(0, 4)], &pb, &mut c, 3).is_err());
        assert!(sgemm_packed_runs(Isa::detect(), 3, 4, &[run(2, 3)], &pb, &mut c, 3).is_err());
        assert!(sgemm_packed_runs(Isa::detect(), 3, 4, &[run(0, 4)], &pb, &mut c[..8], 3).is_err());
    }

    #[test]
    fn short_operands_are_refused() {
        let a = [1f32; 6];
        let b = [1f32; 5];
        let mut c = [0f32; 4];
        let (ra, rb) = (View::rows(&a, 3), View::rows(&b, 2));
        assert!(sgemm(Isa::detect(), 2, 2, 3, 1.0, ra, rb, &mut c, 2, 1).is_err());
        assert!(PackedB::new(3, 2, rb).is_err());
        let pb = PackedB::new(3, 2, View::rows(&[1f32; 6], 2)).unwrap();
        assert!(sgemm_packed(Isa::detect(), 2, 1.0, ra, &pb, &mut c[..3], 2, 1).is_err());
    }
}
