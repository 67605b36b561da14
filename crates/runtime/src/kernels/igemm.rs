//! Exact integer matrix products for quantized operators: `C[m x n] (i32) = A'[m x k] * B'[k x n]`
//! where `A' = a - za` and `B' = b - zb[col]` are the zero-point-corrected operands.
//!
//! Callers hand over corrected values (i16, see the bound below); the packers lay them out for
//! one of two kernel families ([`Layout`]), chosen from the process-wide level (`npuc_isa`):
//!
//! - [`Layout::Pairs`] (scalar, AVX2): both operands widened to i16 *after* subtracting their
//!   zero points, products accumulated with `vpmaddwd` (pairs of i16 products summed into i32),
//!   which cannot saturate: |pair| <= 2 * 256 * 255. `vpmaddubsw` (u8 x i8 -> saturating i16
//!   pairs) is deliberately not used: 2 * 255 * 127 > 32767, so it is inexact without VNNI, and
//!   its exact variants did not pay off (measured on Zen 4 with AVX2 only: `vpmaddwd` already does
//!   16 multiply-adds per multiply-port instruction, while a `vpmaddubsw` product must still be
//!   widened to i32 and needs a sign trick for exactness; a prototype ran at this one's speed).
//! - [`Layout::Quads`] (AVX-512 VNNI, `vpdpbusd`: four u8 x i8 products summed straight into
//!   each i32 lane, 64 multiply-adds per instruction, no intermediate saturation). `vpdpbusd`
//!   needs one unsigned and one signed byte operand, so each A row is stored as
//!   `u = a' + oa[row]` (u8) and each B column as `s = b' + ob[col]` (i8), the offsets chosen
//!   per row/column at packing time so the values fit (an 8-bit operand minus its zero point
//!   spans at most 256 values, so it always fits). The kernel then corrects each sum:
//!   `sum a' b' = sum u s - ob[col] * sum_k u - oa[row] * sum_k b'`, with the row sums of `u`
//!   stored with A and the column sums of `b'` with B. Every step is wrapping i32 arithmetic,
//!   so the result is the exact sum modulo 2^32, i.e. the exact sum whenever that fits i32 (the
//!   bound below): bit-identical to the pairs kernels, which the property tests check. A row or
//!   column whose values span more than 256 (which 8-bit data never does, but the API allows,
//!   e.g. the high byte of a split 16-bit activation) makes that operand fall back to pairs,
//!   and a pairs/quads mix runs the pairs kernels (B's pairs form built once, on demand).
//!
//! Overflow bound: operands lie in [-256, 255] (8-bit values minus zero points, or the high
//! byte of a split 16-bit value), so every term is at most 256 * 255 = 65280 in magnitude and
//! an i32 sum of `k` terms is exact for `k <= MAX_K` = floor((2^31 - 1) / 65280) = 32896.
//! Callers check [`MAX_K`]; 16-bit operands are split into a high and a low byte by the caller
//! (see `ops::qlinear`), which keeps the bound per half.
//!
//! Pairs layouts: `A` row-major with `k` padded to an even `kp2 = 2 * pairs` (zeros), rows
//! padded to a multiple of [`MR`]; `B` in panels of [`NR`] columns, each panel holding for every
//! k pair the `NR` columns' two values interleaved (the `vpmaddwd` operand order).
//! Quads layouts: `A` row-major u8 with `k` padded to `kp4 = 4 * quads`, rows padded to
//! [`MRQ`]; `B` in panels of [`NRQ`] columns, for every k quad the columns' four i8 values
//! adjacent (the `vpdpbusd` operand order). Padding is zero (offsets too), so padded lanes
//! contribute nothing.

use crate::bail;
use crate::error::Result;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Rows of a pairs micro-tile.
pub const MR: usize = 6;
/// Columns of a pairs micro-tile (two AVX2 registers of eight i32 lanes).
pub const NR: usize = 16;
/// Rows of a quads (`vpdpbusd`) micro-tile.
pub const MRQ: usize = 8;
/// Columns of a quads micro-tile (three AVX-512 registers of sixteen i32 lanes): 24
/// accumulators, so each 64-byte B load feeds 8 `vpdpbusd` and each A broadcast 3.
pub const NRQ: usize = 48;
/// A row count that is a whole number of tiles in every layout (callers that cut the rows of
/// one product into chunks use multiples of it).
pub const ROW_ALIGN: usize = 24;
/// The longest reduction whose i32 accumulation is proven exact (see the module docs).
pub const MAX_K: usize = 32896;
/// Products with at least this many multiply-adds are split across threads.
const PAR_WORK: usize = 1 << 17;
/// Packed-A bytes per row-block chunk (a part of L2 on current x86 cores).
const A_CHUNK_BYTES: usize = 192 << 10;
/// Sum bytes per row-block chunk when an epilogue reads them back ([`igemm_then`]).
const C_CHUNK_BYTES: usize = 256 << 10;
/// The largest micro-tile, for the edge-tile buffer.
const TILE_MAX: usize = if MR * NR > MRQ * NRQ {
    MR * NR
} else {
    MRQ * NRQ
};

/// Which micro-kernel runs: the process-wide level (`npuc_isa`), or an explicit one in tests.
pub use npuc_isa::Isa;

/// How a packed operand is laid out, i.e. which kernel family reads it (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// i16 values, `k` in pairs: the scalar and AVX2 `vpmaddwd` kernels.
    Pairs,
    /// u8 rows / i8 columns with offsets, `k` in quads: the AVX-512 VNNI `vpdpbusd` kernel.
    Quads,
}

impl Layout {
    /// The layout whose kernel runs fastest at `isa`: quads where AVX-512 VNNI may run.
    pub fn for_isa(isa: Isa) -> Layout {
        if isa.has_avx512_vnni() {
            Layout::Quads
        } else {
            Layout::Pairs
        }
    }

    /// The layout of the process-wide level ([`Isa::detect`]); what the plain packers use.
    pub fn active() -> Layout {
        Layout::for_isa(Isa::detect())
    }
}

/// A packed, zero-point-corrected right-hand operand (`k x n`), built once per constant weight.
#[derive(Debug, Clone)]
pub struct PackedB {
    k: usize,
    n: usize,
    body: BBody,
}

#[derive(Debug, Clone)]
enum BBody {
    Pairs(PairsB),
    Quads(QuadsB),
}

#[derive(Debug, Clone)]
struct PairsB {
    pairs: usize,
    panels: usize,
    data: PairsData,
}

/// The values of a pairs-layout B. Constant weights whose corrected values all fit i8 (8-bit
/// weights with a zero point of 0, or 128 for u8) are stored as i8 and widened in registers:
/// half the bytes streamed per product (a text2tashkeel LSTM input projection is 512 KiB
/// instead of 1 MiB, one core's whole L2), same arithmetic.
#[derive(Debug, Clone)]
enum PairsData {
    Wide(Vec<i16>),
    Narrow(Vec<i8>),
}

/// A value type a pairs panel can hold: widened to i16 by the kernels.
trait PanelElem: Copy + Default + Into<i32> + Send + Sync {
    /// True for i8 (the AVX2 kernel sign-extends 16 bytes per 16 lanes).
    const NARROW: bool;
    fn from_i16(v: i16) -> Self;
}
impl PanelElem for i16 {
    const NARROW: bool = false;
    fn from_i16(v: i16) -> Self {
        v
    }
}
impl PanelElem for i8 {
    const NARROW: bool = true;
    fn from_i16(v: i16) -> Self {
        v as i8
    }
}

#[derive(Debug, Clone)]
struct QuadsB {
    quads: usize,
    panels: usize,
    /// `s = b' + off[col]`, panel-major (see the module docs).
    data: Vec<i8>,
    /// Per column (padded to whole panels, zero in the padding): the offset `ob`.
    off: Vec<i32>,
    /// Per column: the sum over `k` of the corrected values `b'`.
    colsum: Vec<i32>,
    /// The pairs form, built on first use by a pairs-layout A.
    pairs: OnceLock<PairsB>,
}

impl PairsB {
    /// Packs a constant operand: i8 panels when every value fits (see [`PairsData`]).
    fn pack(k: usize, n: usize, get: impl Fn(usize, usize) -> i16) -> PairsB {
        let narrow = (0..k).all(|r| (0..n).all(|c| i8::try_from(get(r, c)).is_ok()));
        let data = if narrow {
            PairsData::Narrow(Self::fill(k, n, &get))
        } else {
            PairsData::Wide(Self::fill(k, n, &get))
        };
        PairsB {
            pairs: k.div_ceil(2),
            panels: n.div_ceil(NR),
            data,
        }
    }

    /// The panels of [`PairsB::pack`] as `T` values.
    fn fill<T: PanelElem>(k: usize, n: usize, get: &impl Fn(usize, usize) -> i16) -> Vec<T> {
        let pairs = k.div_ceil(2);
        let panels = n.div_ceil(NR);
        let mut data = vec![T::default(); panels * pairs * 2 * NR];
        for pn in 0..panels {
            let base = pn * pairs * 2 * NR;
            let c0 = pn * NR;
            let cols = NR.min(n - c0);
            for r in 0..k {
                let (p, h) = (r / 2, r % 2);
                let row = &mut data[base + p * 2 * NR..base + (p + 1) * 2 * NR];
                for j in 0..cols {
                    row[2 * j + h] = T::from_i16(get(r, c0 + j));
                }
            }
        }
        data
    }

    fn pack_rows<T: Copy>(k: usize, n: usize, src: &[T], f: impl Fn(T) -> i16) -> PairsB {
        let pairs = k.div_ceil(2);
        let panels = n.div_ceil(NR);
        let mut data = vec![0i16; panels * pairs * 2 * NR];
        for p in 0..pairs {
            for h in 0..2 {
                let r = 2 * p + h;
                if r >= k {
                    break;
                }
                let row = &src[r * n..(r + 1) * n];
                for (pn, chunk) in row.chunks(NR).enumerate() {
                    let base = pn * pairs * 2 * NR + p * 2 * NR;
                    let dst = &mut data[base..base + 2 * NR];
                    for (j, &v) in chunk.iter().enumerate() {
                        dst[2 * j + h] = f(v);
                    }
                }
            }
        }
        PairsB {
            pairs,
            panels,
            data: PairsData::Wide(data),
        }
    }
}

/// The i8 offset for values in `[lo, hi]` (a span of at most 256): none when they already fit.
fn b_offset(lo: i32, hi: i32) -> i32 {
    if lo >= -128 && hi <= 127 {
        0
    } else {
        -128 - lo
    }
}

impl QuadsB {
    /// `None` when some column spans more than 256 values.
    fn pack(k: usize, n: usize, get: &impl Fn(usize, usize) -> i16) -> Option<QuadsB> {
        let quads = k.div_ceil(4);
        let panels = n.div_ceil(NRQ);
        let mut off = vec![0i32; panels * NRQ];
        let mut colsum = vec![0i32; panels * NRQ];
        for c in 0..n {
            let (mut lo, mut hi, mut sum) = (i32::MAX, i32::MIN, 0i32);
            for r in 0..k {
                let v = get(r, c) as i32;
                lo = lo.min(v);
                hi = hi.max(v);
                sum = sum.wrapping_add(v);
            }
            if k > 0 && hi - lo > 255 {
                return None;
            }
            off[c] = if k > 0 { b_offset(lo, hi) } else { 0 };
            colsum[c] = sum;
        }
        let mut data = vec![0i8; panels * quads * NRQ * 4];
        for pn in 0..panels {
            let base = pn * quads * NRQ * 4;
            let c0 = pn * NRQ;
            for j in 0..NRQ.min(n - c0) {
                let o = off[c0 + j];
                for r in 0..k {
                    data[base + (r / 4) * NRQ * 4 + j * 4 + r % 4] =
                        (get(r, c0 + j) as i32 + o) as i8;
                }
            }
        }
        Some(QuadsB {
            quads,
            panels,
            data,
            off,
            colsum,
            pairs: OnceLock::new(),
        })
    }

    /// [`QuadsB::pack`] from a contiguous row-major `k x n` slice (per-run activations: the
    /// packing is on every run's path). Compiled for the widest level the CPU has (safe Rust
    /// body; the per-column passes vectorize over columns, the quad interleave over 4 rows).
    fn pack_rows<T: Copy + Sync>(
        k: usize,
        n: usize,
        src: &[T],
        f: &(impl Fn(T) -> i16 + Sync),
        threads: usize,
    ) -> Option<QuadsB> {
        assert!(src.len() >= k * n, "packed operand source too short");
        let quads = k.div_ceil(4);
        let panels = n.div_ceil(NRQ);
        let mut data = vec![0i8; panels * quads * NRQ * 4];
        let mut off = vec![0i32; panels * NRQ];
        let mut colsum = vec![0i32; panels * NRQ];
        // Panels are independent (their columns' statistics and their own slab of `data`).
        let slab = (quads * NRQ * 4).max(1);
        let one = |(pn, ((d, o), c)): PanelJob| quads_pack_panel(k, n, src, f, pn, d, o, c);
        let fits = if threads > 1 && panels > 1 && k * n >= PACK_PAR_MIN {
            data.par_chunks_mut(slab)
                .zip(off.par_chunks_mut(NRQ))
                .zip(colsum.par_chunks_mut(NRQ))
                .enumerate()
                .all(one)
        } else {
            data.chunks_mut(slab)
                .zip(off.chunks_mut(NRQ))
                .zip(colsum.chunks_mut(NRQ))
                .enumerate()
                .all(one)
        };
        fits.then_some(QuadsB {
            quads,
            panels,
            data,
            off,
            colsum,
            pairs: OnceLock::new(),
        })
    }

    /// The corrected value (r, c).
    fn get(&self, r: usize, c: usize) -> i16 {
        let (pn, j) = (c / NRQ, c % NRQ);
        let s = self.data[pn * self.quads * NRQ * 4 + (r / 4) * NRQ * 4 + j * 4 + r % 4];
        (s as i32 - self.off[c]) as i16
    }
}

/// One panel of [`QuadsB::pack_rows`]: its index, slab of quads, offsets and column sums.
type PanelJob<'a> = (usize, ((&'a mut [i8], &'a mut [i32]), &'a mut [i32]));

/// Values of a per-run activation operand from which its packing is split across threads.
const PACK_PAR_MIN: usize = 1 << 16;

/// Packs column panel `pn` of [`QuadsB::pack_rows`]: its columns' offsets and sums into `off`
/// and `colsum` (NRQ each), its quads into `slab`; false when a column spans more than 256
/// values. Compiled for the widest level the CPU has (safe Rust body).
#[allow(clippy::too_many_arguments)]
fn quads_pack_panel<T: Copy>(
    k: usize,
    n: usize,
    src: &[T],
    f: &impl Fn(T) -> i16,
    pn: usize,
    slab: &mut [i8],
    off: &mut [i32],
    colsum: &mut [i32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = Isa::detect();
        if isa.has_avx512() {
            // SAFETY: AVX-512 F/BW detected on this CPU; the body is safe Rust.
            return unsafe { quads_pack_panel_avx512(k, n, src, f, pn, slab, off, colsum) };
        }
        if isa.has_avx2() {
            // SAFETY: AVX2 detected on this CPU; the body is safe Rust.
            return unsafe { quads_pack_panel_avx2(k, n, src, f, pn, slab, off, colsum) };
        }
    }
    quads_pack_panel_body(k, n, src, f, pn, slab, off, colsum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::too_many_arguments)]
unsafe fn quads_pack_panel_avx512<T: Copy>(
    k: usize,
    n: usize,
    src: &[T],
    f: &impl Fn(T) -> i16,
    pn: usize,
    slab: &mut [i8],
    off: &mut [i32],
    colsum: &mut [i32],
) -> bool {
    quads_pack_panel_body(k, n, src, f, pn, slab, off, colsum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn quads_pack_panel_avx2<T: Copy>(
    k: usize,
    n: usize,
    src: &[T],
    f: &impl Fn(T) -> i16,
    pn: usize,
    slab: &mut [i8],
    off: &mut [i32],
    colsum: &mut [i32],
) -> bool {
    quads_pack_panel_body(k, n, src, f, pn, slab, off, colsum)
}

/// The body of [`quads_pack_panel`] (every level).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn quads_pack_panel_body<T: Copy>(
    k: usize,
    n: usize,
    src: &[T],
    f: &impl Fn(T) -> i16,
    pn: usize,
    slab: &mut [i8],
    off: &mut [i32],
    colsum: &mut [i32],
) -> bool {
    let c0 = pn * NRQ;
    let w = NRQ.min(n - c0);
    let row = |r: usize| &src[r * n + c0..r * n + c0 + w];
    let (mut lo, mut hi) = ([i32::MAX; NRQ], [i32::MIN; NRQ]);
    for r in 0..k {
        let it = row(r).iter().zip(&mut lo[..w]).zip(&mut hi[..w]);
        for (((&v, lo), hi), sum) in it.zip(&mut colsum[..w]) {
            let v = f(v) as i32;
            *lo = (*lo).min(v);
            *hi = (*hi).max(v);
            *sum = sum.wrapping_add(v);
        }
    }
    if k > 0 {
        for j in 0..w {
            if hi[j] - lo[j] > 255 {
                return false;
            }
            off[j] = b_offset(lo[j], hi[j]);
        }
    }
    // Quad q holds, per column, rows 4q..4q+4 as 4 consecutive bytes (rows past k stay 0).
    let put = |v: T, o: i32| (f(v) as i32 + o) as i8;
    let offs = &off[..w];
    for q in 0..k.div_ceil(4) {
        let r0 = 4 * q;
        let dst = &mut slab[q * NRQ * 4..][..w * 4];
        if r0 + 4 <= k {
            let (a, b, c, d) = (row(r0), row(r0 + 1), row(r0 + 2), row(r0 + 3));
            for (j, (o, &off)) in dst.chunks_exact_mut(4).zip(offs).enumerate() {
                o[0] = put(a[j], off);
                o[1] = put(b[j], off);
                o[2] = put(c[j], off);
                o[3] = put(d[j], off);
            }
        } else {
            for t in 0..k - r0 {
                for (j, (&v, &off)) in row(r0 + t).iter().zip(offs).enumerate() {
                    dst[j * 4 + t] = put(v, off);
                }
            }
        }
    }
    true
}

impl PackedB {
    /// Packs `B[k x n]` where element (r, c) is `get(r, c)` (already zero-point corrected and
    /// within [-32768, 32767]; the exactness bound assumes [-256, 255], checked by callers), in
    /// the active layout ([`Layout::active`]).
    pub fn pack(k: usize, n: usize, get: impl Fn(usize, usize) -> i16) -> PackedB {
        Self::pack_as(Layout::active(), k, n, get)
    }

    /// [`PackedB::pack`] in a given layout (pairs when a column does not fit quads).
    pub fn pack_as(
        layout: Layout,
        k: usize,
        n: usize,
        get: impl Fn(usize, usize) -> i16,
    ) -> PackedB {
        let body = match layout {
            Layout::Quads => QuadsB::pack(k, n, &get).map(BBody::Quads),
            Layout::Pairs => None,
        };
        let body = body.unwrap_or_else(|| BBody::Pairs(PairsB::pack(k, n, get)));
        PackedB { k, n, body }
    }

    /// Packs a contiguous row-major `k x n` slice through a per-element conversion: the fast
    /// path of [`PackedB::pack`] for per-run (activation) operands, reading rows contiguously.
    pub fn pack_rows<T: Copy + Sync>(
        k: usize,
        n: usize,
        src: &[T],
        f: impl Fn(T) -> i16 + Sync,
    ) -> PackedB {
        Self::pack_rows_par(Layout::active(), k, n, src, f, 1)
    }

    /// [`PackedB::pack_rows`] in a given layout (pairs when a column does not fit quads).
    pub fn pack_rows_as<T: Copy + Sync>(
        layout: Layout,
        k: usize,
        n: usize,
        src: &[T],
        f: impl Fn(T) -> i16 + Sync,
    ) -> PackedB {
        Self::pack_rows_par(layout, k, n, src, f, 1)
    }

    /// [`PackedB::pack_rows_as`] split by column panels across up to `threads` threads (large
    /// operands only; the result is the same).
    pub fn pack_rows_par<T: Copy + Sync>(
        layout: Layout,
        k: usize,
        n: usize,
        src: &[T],
        f: impl Fn(T) -> i16 + Sync,
        threads: usize,
    ) -> PackedB {
        assert!(src.len() >= k * n, "packed operand source too short");
        let body = match layout {
            Layout::Quads => QuadsB::pack_rows(k, n, src, &f, threads).map(BBody::Quads),
            Layout::Pairs => None,
        };
        let body = body.unwrap_or_else(|| BBody::Pairs(PairsB::pack_rows(k, n, src, f)));
        PackedB { k, n, body }
    }

    /// Reduction length.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Number of columns.
    pub fn n(&self) -> usize {
        self.n
    }
    /// The layout the operand was packed in.
    pub fn layout(&self) -> Layout {
        match self.body {
            BBody::Pairs(_) => Layout::Pairs,
            BBody::Quads(_) => Layout::Quads,
        }
    }

    /// The pairs form (built once from the quads one when first needed).
    fn pairs(&self) -> &PairsB {
        match &self.body {
            BBody::Pairs(p) => p,
            BBody::Quads(q) => q
                .pairs
                .get_or_init(|| PairsB::pack(self.k, self.n, |r, c| q.get(r, c))),
        }
    }
}

/// Reusable storage of a [`PackedA`] (see [`PackedA::into_buffer`]): per-run packing then
/// neither allocates nor faults in fresh pages.
#[derive(Debug, Default)]
pub struct PackBuf {
    pairs: Vec<i16>,
    quads: Vec<u8>,
    /// Quads: per padded row the offset `oa`, then per padded row the sum of `u`.
    rows: Vec<i32>,
    /// One row of corrected values (the quads form of [`PackedA::pack_with`]).
    row: Vec<i16>,
}

/// A packed, zero-point-corrected left-hand operand (`m x k`), built per run.
#[derive(Debug)]
pub struct PackedA {
    m: usize,
    k: usize,
    layout: Layout,
    /// Padded row length: `kp2` (pairs) or `kp4` (quads).
    kp: usize,
    /// Padded rows (quads; the pairs form's padding is implied by `MR`).
    rows: usize,
    buf: PackBuf,
}

impl PackedA {
    /// Packs `A[m x k]` where element (r, c) is `get(r, c)`, in the active layout.
    pub fn pack(m: usize, k: usize, get: impl Fn(usize, usize) -> i16) -> PackedA {
        Self::pack_with(PackBuf::default(), m, k, |r, row| {
            for (c, d) in row.iter_mut().enumerate() {
                *d = get(r, c);
            }
        })
    }

    /// Packs a contiguous row-major `m x k` slice through a per-element conversion; the fast
    /// path of [`PackedA::pack`] for the common activation layout.
    pub fn pack_rows<T: Copy>(m: usize, k: usize, src: &[T], f: impl Fn(T) -> i16) -> PackedA {
        Self::pack_rows_in(PackBuf::default(), m, k, src, f)
    }

    /// [`PackedA::pack_rows`] into a recycled buffer (see [`PackedA::into_buffer`]).
    pub fn pack_rows_in<T: Copy>(
        buf: PackBuf,
        m: usize,
        k: usize,
        src: &[T],
        f: impl Fn(T) -> i16,
    ) -> PackedA {
        Self::pack_rows_as(Layout::active(), buf, m, k, src, f)
    }

    /// [`PackedA::pack_rows_in`] in a given layout (pairs when a row does not fit quads).
    pub fn pack_rows_as<T: Copy>(
        layout: Layout,
        buf: PackBuf,
        m: usize,
        k: usize,
        src: &[T],
        f: impl Fn(T) -> i16,
    ) -> PackedA {
        assert!(src.len() >= m * k, "packed operand source too short");
        let src = &src[..m * k];
        let buf = match layout {
            Layout::Quads => match Self::quads_rows(buf, m, k, src, &f) {
                Ok(a) => return a,
                Err(buf) => buf,
            },
            Layout::Pairs => buf,
        };
        let mut s = src.chunks_exact(k.max(1));
        // Every slot is written below (values, then zero padding), so the recycled buffer is
        // not cleared first: that would write the whole operand twice.
        Self::pairs_with(buf, m, k, |_, dst| {
            if let Some(row) = s.next() {
                for (d, &v) in dst.iter_mut().zip(row) {
                    *d = f(v);
                }
            }
        })
    }

    /// The quads form of [`PackedA::pack_rows_as`]; gives the buffer back when a row spans
    /// more than 256 values.
    fn quads_rows<T: Copy>(
        mut buf: PackBuf,
        m: usize,
        k: usize,
        src: &[T],
        f: &impl Fn(T) -> i16,
    ) -> std::result::Result<PackedA, PackBuf> {
        let kp4 = k.div_ceil(4) * 4;
        let rows = m.div_ceil(MRQ) * MRQ;
        buf.quads.resize(rows * kp4, 0);
        buf.rows.resize(2 * rows, 0);
        let (offs, sums) = buf.rows.split_at_mut(rows);
        for r in 0..rows {
            let dst = &mut buf.quads[r * kp4..(r + 1) * kp4];
            if r >= m || k == 0 {
                dst.fill(0);
                offs[r] = 0;
                sums[r] = 0;
                continue;
            }
            let row = &src[r * k..(r + 1) * k];
            let (mut lo, mut hi) = (i16::MAX, i16::MIN);
            for &v in row {
                let v = f(v);
                lo = lo.min(v);
                hi = hi.max(v);
            }
            if hi as i32 - lo as i32 > 255 {
                return Err(buf);
            }
            let off = -(lo as i32);
            let mut sum = 0i32;
            for (d, &v) in dst.iter_mut().zip(row) {
                let u = f(v) as i32 + off;
                *d = u as u8;
                sum = sum.wrapping_add(u);
            }
            dst[k..].fill(0);
            offs[r] = off;
            sums[r] = sum;
        }
        Ok(PackedA {
            m,
            k,
            layout: Layout::Quads,
            kp: kp4,
            rows,
            buf,
        })
    }

    /// Packs `m` rows of `k` values into a recycled buffer, each row written in place by
    /// `fill(r, row)`: the gather path for operands that are not one contiguous matrix (e.g.
    /// the taps of a transposed convolution), without an intermediate copy. `row` holds
    /// exactly `k` slots with stale contents, and `fill` must write every one of them (the
    /// buffer is not cleared first: that would write the whole operand twice); the padding
    /// slots are zeroed here. Each row is filled exactly once.
    pub fn pack_with(
        buf: PackBuf,
        m: usize,
        k: usize,
        fill: impl FnMut(usize, &mut [i16]),
    ) -> PackedA {
        Self::pack_with_as(Layout::active(), buf, m, k, fill)
    }

    /// [`PackedA::pack_with`] in a given layout (pairs when a row does not fit quads).
    pub fn pack_with_as(
        layout: Layout,
        buf: PackBuf,
        m: usize,
        k: usize,
        mut fill: impl FnMut(usize, &mut [i16]),
    ) -> PackedA {
        match layout {
            Layout::Pairs => Self::pairs_with(buf, m, k, fill),
            Layout::Quads => {
                let mut buf = buf;
                let kp4 = k.div_ceil(4) * 4;
                let rows = m.div_ceil(MRQ) * MRQ;
                buf.quads.resize(rows * kp4, 0);
                buf.rows.resize(2 * rows, 0);
                buf.row.resize(k, 0);
                let mut row = std::mem::take(&mut buf.row);
                for r in 0..rows {
                    if r >= m || k == 0 {
                        buf.quads[r * kp4..(r + 1) * kp4].fill(0);
                        buf.rows[r] = 0;
                        buf.rows[rows + r] = 0;
                        continue;
                    }
                    fill(r, &mut row);
                    let lo = row.iter().copied().min().unwrap_or(0);
                    let hi = row.iter().copied().max().unwrap_or(0);
                    if hi as i32 - lo as i32 > 255 {
                        // This row does not fit: the rows packed so far are unpacked into the
                        // pairs form (no row is filled twice), then the rest is packed so.
                        let done = PackedA {
                            m,
                            k,
                            layout: Layout::Quads,
                            kp: kp4,
                            rows,
                            buf,
                        };
                        let mut a = Self::pairs_with(PackBuf::default(), m, k, |i, d| {
                            if i < r {
                                done.unpack_row(i, d)
                            } else if i == r {
                                d.copy_from_slice(&row)
                            } else {
                                fill(i, d)
                            }
                        });
                        // The quads buffers go back to the caller with the pairs one.
                        let mut back = done.buf;
                        back.pairs = std::mem::take(&mut a.buf.pairs);
                        back.row = row;
                        a.buf = back;
                        return a;
                    }
                    let off = -(lo as i32);
                    let mut sum = 0i32;
                    let dst = &mut buf.quads[r * kp4..(r + 1) * kp4];
                    for (d, &v) in dst.iter_mut().zip(&row) {
                        let u = v as i32 + off;
                        *d = u as u8;
                        sum = sum.wrapping_add(u);
                    }
                    dst[k..].fill(0);
                    buf.rows[r] = off;
                    buf.rows[rows + r] = sum;
                }
                buf.row = row;
                PackedA {
                    m,
                    k,
                    layout: Layout::Quads,
                    kp: kp4,
                    rows,
                    buf,
                }
            }
        }
    }

    /// Packs `m` rows of `k` values in the quads layout from bytes that are already the
    /// kernel's unsigned operand: `fill(r, row)` writes every one of the row's `k` slots with
    /// `u = a' + off` (so `a' = u - off`; e.g. raw u8 codes with `off` their zero point), and
    /// the per-row offsets are all `off`. A gather of 8-bit activations then copies bytes
    /// instead of widening them to i16 and scanning each row for its range. Only when the
    /// active layout is [`Layout::Quads`] (callers take [`PackedA::pack_with`] otherwise).
    pub fn pack_bytes_with(
        mut buf: PackBuf,
        m: usize,
        k: usize,
        off: i32,
        mut fill: impl FnMut(usize, &mut [u8]),
    ) -> PackedA {
        let kp4 = k.div_ceil(4) * 4;
        let rows = m.div_ceil(MRQ) * MRQ;
        buf.quads.resize(rows * kp4, 0);
        buf.rows.resize(2 * rows, 0);
        for r in 0..rows {
            let dst = &mut buf.quads[r * kp4..(r + 1) * kp4];
            if r >= m || k == 0 {
                dst.fill(0);
                buf.rows[r] = 0;
                buf.rows[rows + r] = 0;
                continue;
            }
            fill(r, &mut dst[..k]);
            dst[k..].fill(0);
            buf.rows[r] = off;
            buf.rows[rows + r] = byte_sum(&dst[..k]);
        }
        PackedA {
            m,
            k,
            layout: Layout::Quads,
            kp: kp4,
            rows,
            buf,
        }
    }

    /// The pairs form: `fill` writes each of the `m` rows once; padding is zeroed here.
    fn pairs_with(
        mut buf: PackBuf,
        m: usize,
        k: usize,
        mut fill: impl FnMut(usize, &mut [i16]),
    ) -> PackedA {
        let kp2 = k.div_ceil(2) * 2;
        let rows = m.div_ceil(MR) * MR;
        buf.pairs.resize(rows * kp2, 0);
        if kp2 > 0 {
            for (r, row) in buf.pairs.chunks_exact_mut(kp2).enumerate() {
                if r < m {
                    fill(r, &mut row[..k]);
                    row[k..].fill(0);
                } else {
                    row.fill(0);
                }
            }
        }
        PackedA {
            m,
            k,
            layout: Layout::Pairs,
            kp: kp2,
            rows,
            buf,
        }
    }

    /// Row `r`'s corrected values (quads form).
    fn unpack_row(&self, r: usize, dst: &mut [i16]) {
        let off = self.buf.rows[r];
        let src = &self.buf.quads[r * self.kp..r * self.kp + self.k];
        for (d, &u) in dst.iter_mut().zip(src) {
            *d = (u as i32 - off) as i16;
        }
    }

    /// The pairs form of a quads operand (a copy; only when B could not be packed as quads).
    fn to_pairs(&self) -> PackedA {
        Self::pairs_with(PackBuf::default(), self.m, self.k, |r, d| {
            self.unpack_row(r, d)
        })
    }

    /// The packed buffers, for reuse by a later packing.
    pub fn into_buffer(self) -> PackBuf {
        self.buf
    }
    /// Number of rows.
    pub fn m(&self) -> usize {
        self.m
    }
    /// The layout the operand was packed in.
    pub fn layout(&self) -> Layout {
        self.layout
    }
}

/// The sum of a row of unsigned operand bytes (exact: at most `MAX_K` * 255 < 2^31 for the
/// lengths the products accept; wrapping like the rest of the quads arithmetic beyond).
fn byte_sum(v: &[u8]) -> i32 {
    // Blocks of 2^16 bytes sum exactly in u32 lanes the compiler vectorizes.
    v.chunks(1 << 16)
        .map(|c| c.iter().map(|&b| b as u32).sum::<u32>() as i32)
        .fold(0i32, |a, b| a.wrapping_add(b))
}

/// `c[m x n]` (row stride `n`) = `a * b`, exact in i32 for `k <= MAX_K`.
pub fn igemm(a: &PackedA, b: &PackedB, c: &mut [i32], threads: usize) -> Result<()> {
    igemm_with(Isa::detect(), a, b, c, threads)
}

/// [`igemm`] with an explicit kernel choice (tests compare the kernels).
pub fn igemm_with(isa: Isa, a: &PackedA, b: &PackedB, c: &mut [i32], threads: usize) -> Result<()> {
    igemm_core::<u8, fn(&[i32], &mut [u8])>(isa, a, b, c, None, threads)
}

/// [`igemm`] followed by an epilogue over the finished sums: `epi(sums, out_rows)` receives
/// consecutive whole rows of `c` (row stride `n`) and the same rows of `out` (also stride
/// `n`), each row exactly once, while those sums are still in cache. The rows are handed
/// over in L2-sized chunks by the thread that computed them, so at several threads the
/// epilogue runs in parallel with no extra hand-off.
pub fn igemm_then<T: Send, F: Fn(&[i32], &mut [T]) + Sync>(
    a: &PackedA,
    b: &PackedB,
    c: &mut [i32],
    out: &mut [T],
    threads: usize,
    epi: &F,
) -> Result<()> {
    igemm_with_then(Isa::detect(), a, b, c, out, threads, epi)
}

/// [`igemm_then`] with an explicit kernel choice.
pub fn igemm_with_then<T: Send, F: Fn(&[i32], &mut [T]) + Sync>(
    isa: Isa,
    a: &PackedA,
    b: &PackedB,
    c: &mut [i32],
    out: &mut [T],
    threads: usize,
    epi: &F,
) -> Result<()> {
    if out.len() < a.m * b.n {
        bail!(
            "integer product: epilogue output holds {} values, {}x{} needed",
            out.len(),
            a.m,
            b.n
        );
    }
    igemm_core(isa, a, b, c, Some((out, epi)), threads)
}

fn igemm_core<T: Send, F: Fn(&[i32], &mut [T]) + Sync>(
    isa: Isa,
    a: &PackedA,
    b: &PackedB,
    c: &mut [i32],
    out: Option<(&mut [T], &F)>,
    threads: usize,
) -> Result<()> {
    let (m, n, k) = (a.m, b.n, b.k);
    if a.k != k {
        bail!("integer product: A has {} columns, B has {k} rows", a.k);
    }
    if k > MAX_K {
        bail!("integer product: reduction length {k} exceeds {MAX_K}, the exact i32 bound");
    }
    if c.len() < m * n {
        bail!(
            "integer product: output holds {} values, {m}x{n} needed",
            c.len()
        );
    }
    if isa > Isa::detect() {
        bail!(
            "integer product: {} kernels requested above the active level {}",
            isa.name(),
            Isa::detect().name()
        );
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let c = &mut c[..m * n];
    let shape = Shape { m, n, threads };
    match (&a.layout, &b.body) {
        (Layout::Quads, BBody::Quads(q)) => {
            let vnni = isa.has_avx512_vnni();
            let (kp4, rows) = (a.kp, a.rows);
            let (ad, ar) = (&a.buf.quads[..], &a.buf.rows[..]);
            let tile = |bi: usize, pn: usize, _rows: usize, dst: &mut [i32], ldt: usize| {
                let ablk = &ad[bi * MRQ * kp4..(bi + 1) * MRQ * kp4];
                let aoff = &ar[bi * MRQ..(bi + 1) * MRQ];
                let asum = &ar[rows + bi * MRQ..rows + (bi + 1) * MRQ];
                let bpan = &q.data[pn * q.quads * NRQ * 4..(pn + 1) * q.quads * NRQ * 4];
                let boff = &q.off[pn * NRQ..(pn + 1) * NRQ];
                let bsum = &q.colsum[pn * NRQ..(pn + 1) * NRQ];
                let t = QuadsTile {
                    quads: q.quads,
                    a: ablk,
                    lda: kp4,
                    aoff,
                    asum,
                    b: bpan,
                    boff,
                    bsum,
                };
                if vnni {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `vnni` means the level allows AVX-512 and the CPU has AVX-512 F,
                    // BW and VNNI (`Isa::has_avx512_vnni`, and `isa <= Isa::detect()` was checked
                    // above); the slices hold exactly one tile's operands (MRQ rows of `kp4`
                    // bytes, `quads * NRQ * 4` bytes of B, MRQ/NRQ offsets and sums) and `dst`
                    // holds (MRQ - 1) * ldt + NRQ slots (a full tile of C, or the edge buffer),
                    // which `tile_vnni` asserts before reading or writing.
                    unsafe {
                        tile_vnni(&t, dst, ldt)
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    tile_quads_scalar(&t, dst, ldt)
                } else {
                    tile_quads_scalar(&t, dst, ldt)
                }
            };
            drive::<MRQ, NRQ, T, F, _>(shape, q.panels, kp4, c, out, &tile);
        }
        (Layout::Quads, BBody::Pairs(_)) => {
            let ap = a.to_pairs();
            return igemm_core(isa, &ap, b, c, out, threads);
        }
        (Layout::Pairs, _) => {
            let p = b.pairs();
            match &p.data {
                PairsData::Wide(d) => run_pairs(isa, shape, a, p, d, c, out),
                PairsData::Narrow(d) => run_pairs(isa, shape, a, p, d, c, out),
            }
        }
    }
    Ok(())
}

/// The pairs-layout product over B panels of `E` values.
fn run_pairs<E: PanelElem, T: Send, F: Fn(&[i32], &mut [T]) + Sync>(
    isa: Isa,
    shape: Shape,
    a: &PackedA,
    p: &PairsB,
    data: &[E],
    c: &mut [i32],
    out: Option<(&mut [T], &F)>,
) {
    let kp2 = a.kp;
    let ad = &a.buf.pairs[..];
    let simd = isa.has_avx2();
    let tile = |bi: usize, pn: usize, rows: usize, dst: &mut [i32], ldt: usize| {
        let ablk = &ad[bi * MR * kp2..(bi + 1) * MR * kp2];
        let bpan = &data[pn * p.pairs * 2 * NR..(pn + 1) * p.pairs * 2 * NR];
        if simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: avx2 support was checked by the caller (`isa <= Isa::detect()`); `ablk`
            // holds MR >= R rows of `kp2 = 2 * pairs` values and `bpan` holds `pairs * 2 * NR`
            // values, exactly what the kernel reads; `dst` holds (MR - 1) * ldt + NR >= (R - 1)
            // * ldt + NR slots (a full tile of C, or the edge buffer).
            unsafe {
                // An edge block of fewer rows runs a kernel of that height: the rows past
                // `rows` are padding, and computing them cost a text2tashkeel LSTM's 32-row
                // input projection 36 rows' time.
                match rows {
                    1 => tile_avx2::<E, 1>(p.pairs, ablk, kp2, bpan, dst, ldt),
                    2 => tile_avx2::<E, 2>(p.pairs, ablk, kp2, bpan, dst, ldt),
                    3 => tile_avx2::<E, 3>(p.pairs, ablk, kp2, bpan, dst, ldt),
                    4 => tile_avx2::<E, 4>(p.pairs, ablk, kp2, bpan, dst, ldt),
                    5 => tile_avx2::<E, 5>(p.pairs, ablk, kp2, bpan, dst, ldt),
                    _ => tile_avx2::<E, MR>(p.pairs, ablk, kp2, bpan, dst, ldt),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            tile_scalar(p.pairs, ablk, kp2, bpan, dst, ldt)
        } else {
            tile_scalar(p.pairs, ablk, kp2, bpan, dst, ldt)
        }
    };
    drive::<MR, NR, T, F, _>(shape, p.panels, kp2 * 2, c, out, &tile);
}

#[derive(Clone, Copy)]
struct Shape {
    m: usize,
    n: usize,
    threads: usize,
}

/// Runs `tile(row_block, panel, rows, dst, ldt)` over every TM x TN tile of `c` (and the
/// epilogue over finished row chunks), split into one group of row blocks per thread.
/// `rows` is the block's row count inside `c`: TM, except at a shorter last block, where a tile
/// may compute just those rows. `a_row_bytes` sizes the L2 chunks.
fn drive<const TM: usize, const TN: usize, T: Send, F, K>(
    Shape { m, n, threads }: Shape,
    panels: usize,
    a_row_bytes: usize,
    c: &mut [i32],
    out: Option<(&mut [T], &F)>,
    tile: &K,
) where
    F: Fn(&[i32], &mut [T]) + Sync,
    K: Fn(usize, usize, usize, &mut [i32], usize) + Sync,
{
    let blocks = m.div_ceil(TM);
    let k_work = a_row_bytes.max(1);
    // One group of row blocks per thread. Within a group, B panels are the outer loop: a panel
    // stays in L1/L2 while the group's rows of A stream past it; A's group is reused across
    // panels from L2. (Row blocks outer would stream all of B once per block.)
    let groups = if threads > 1 && m * n * k_work >= PAR_WORK {
        threads.min(blocks)
    } else {
        1
    };
    let blocks_per = blocks.div_ceil(groups);
    let run_chunk = |cb0: usize, cb1: usize, b0: usize, cgrp: &mut [i32], buf: &mut [i32]| {
        for pn in 0..panels {
            let c0 = pn * TN;
            let cols = TN.min(n - c0);
            for bi in cb0..cb1 {
                let rows = TM.min(m - bi * TM);
                let r0 = (bi - b0) * TM;
                // A full tile is stored straight into C (row stride n); an edge tile goes
                // through the local buffer and only its valid part is copied.
                let direct = rows == TM && cols == TN;
                if direct {
                    tile(
                        bi,
                        pn,
                        rows,
                        &mut cgrp[r0 * n + c0..(r0 + TM - 1) * n + c0 + TN],
                        n,
                    );
                } else {
                    tile(bi, pn, rows, &mut buf[..TM * TN], TN);
                    for r in 0..rows {
                        let d = &mut cgrp[(r0 + r) * n + c0..(r0 + r) * n + c0 + cols];
                        d.copy_from_slice(&buf[r * TN..r * TN + cols]);
                    }
                }
            }
        }
    };
    let epi = out.as_ref().map(|(_, f)| *f);
    // Row blocks go in chunks whose packed A (about `A_CHUNK_BYTES`) stays in L2 while
    // every B panel passes: B streams once per chunk instead of A once per panel. With an
    // epilogue, a chunk's sums (about `C_CHUNK_BYTES`) also stay in L2 until it reads them.
    let mut chunk = (A_CHUNK_BYTES / (TM * a_row_bytes).max(1)).max(1);
    if epi.is_some() {
        chunk = chunk.min((C_CHUNK_BYTES / (TM * n * 4)).max(1));
    }
    let run_group = |gi: usize, cgrp: &mut [i32], mut ogrp: Option<&mut [T]>| {
        let b0 = gi * blocks_per;
        let b1 = ((gi + 1) * blocks_per).min(blocks);
        let rows = cgrp.len() / n;
        let mut buf = [0i32; TILE_MAX];
        let mut cb0 = b0;
        while cb0 < b1 {
            let cb1 = (cb0 + chunk).min(b1);
            run_chunk(cb0, cb1, b0, cgrp, &mut buf);
            if let (Some(o), Some(f)) = (ogrp.as_deref_mut(), epi) {
                let (r0, r1) = ((cb0 - b0) * TM, ((cb1 - b0) * TM).min(rows));
                f(&cgrp[r0 * n..r1 * n], &mut o[r0 * n..r1 * n]);
            }
            cb0 = cb1;
        }
    };
    let gsize = blocks_per * TM * n;
    match out {
        Some((o, _)) => {
            let o = &mut o[..m * n];
            if groups > 1 {
                c.par_chunks_mut(gsize)
                    .zip(o.par_chunks_mut(gsize))
                    .enumerate()
                    .for_each(|(gi, (cgrp, ogrp))| run_group(gi, cgrp, Some(ogrp)));
            } else {
                run_group(0, c, Some(o));
            }
        }
        None => {
            if groups > 1 {
                c.par_chunks_mut(gsize)
                    .enumerate()
                    .for_each(|(gi, cgrp)| run_group(gi, cgrp, None));
            } else {
                run_group(0, c, None);
            }
        }
    }
}

/// Scalar twin of [`tile_avx2`]: one MR x NR tile from packed operands, written to `out`
/// with row stride `ldt` (`out` holds at least `(MR - 1) * ldt + NR` values).
fn tile_scalar<E: PanelElem>(
    pairs: usize,
    a: &[i16],
    lda: usize,
    b: &[E],
    out: &mut [i32],
    ldt: usize,
) {
    let mut tile = [0i32; MR * NR];
    for p in 0..pairs {
        let bp = &b[p * 2 * NR..(p + 1) * 2 * NR];
        for r in 0..MR {
            let a0 = a[r * lda + 2 * p] as i32;
            let a1 = a[r * lda + 2 * p + 1] as i32;
            let t = &mut tile[r * NR..(r + 1) * NR];
            for (j, d) in t.iter_mut().enumerate() {
                let (b0, b1): (i32, i32) = (bp[2 * j].into(), bp[2 * j + 1].into());
                *d = d.wrapping_add(a0 * b0 + a1 * b1);
            }
        }
    }
    for r in 0..MR {
        out[r * ldt..r * ldt + NR].copy_from_slice(&tile[r * NR..(r + 1) * NR]);
    }
}

/// One R x NR tile (R <= MR: MR for every block but a shorter last one) with AVX2: per k pair,
/// two B loads (i8 panels: two 16-byte loads sign-extended with `vpmovsxbw`), R broadcasts of
/// an (a0, a1) pair and 2 * R `vpmaddwd` + `vpaddd`. The rows are those of [`tile_scalar`]'s
/// first R, bit for bit.
///
/// The tile is written to `out` with row stride `ldt`: straight into C for a full tile.
///
/// # Safety
/// The CPU must support avx2; `a` must hold `R` rows of stride `lda >= 2 * pairs`, `b` at
/// least `pairs * 2 * NR` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tile_avx2<E: PanelElem, const R: usize>(
    pairs: usize,
    a: &[i16],
    lda: usize,
    b: &[E],
    out: &mut [i32],
    ldt: usize,
) {
    use std::arch::x86_64::*;
    debug_assert!(R <= MR && a.len() >= (R - 1) * lda + 2 * pairs && b.len() >= pairs * 2 * NR);
    assert!(
        out.len() >= (R - 1) * ldt + NR,
        "igemm tile output too short"
    );
    let mut acc = [[_mm256_setzero_si256(); 2]; R];
    let ap = a.as_ptr();
    let bp = b.as_ptr();
    for p in 0..pairs {
        // SAFETY: p < pairs, so b[p*32 .. p*32+32] and a[r*lda + 2p .. +2] are in bounds
        // (caller contract); unaligned loads are used throughout.
        unsafe {
            let (b0, b1) = if E::NARROW {
                let q = bp.add(p * 2 * NR) as *const __m128i;
                (
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(q)),
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(1))),
                )
            } else {
                (
                    _mm256_loadu_si256(bp.add(p * 2 * NR) as *const __m256i),
                    _mm256_loadu_si256(bp.add(p * 2 * NR + NR) as *const __m256i),
                )
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                let pair = (ap.add(r * lda + 2 * p) as *const i32).read_unaligned();
                let av = _mm256_set1_epi32(pair);
                acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(av, b0));
                acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(av, b1));
            }
        }
    }
    let tp = out.as_mut_ptr();
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: `out` holds (R - 1) * ldt + NR slots (asserted above); row r occupies
        // [r * ldt, r * ldt + 16).
        unsafe {
            _mm256_storeu_si256(tp.add(r * ldt) as *mut __m256i, acc[0]);
            _mm256_storeu_si256(tp.add(r * ldt + 8) as *mut __m256i, acc[1]);
        }
    }
}

/// One quads tile's operands: MRQ rows of u8 `a` (stride `lda`, their offsets and sums of
/// `u`) and one B panel (`quads * NRQ * 4` i8, its NRQ column offsets and sums of `b'`).
struct QuadsTile<'a> {
    quads: usize,
    a: &'a [u8],
    lda: usize,
    aoff: &'a [i32],
    asum: &'a [i32],
    b: &'a [i8],
    boff: &'a [i32],
    bsum: &'a [i32],
}

/// Scalar twin of [`tile_vnni`], in the same wrapping i32 arithmetic: the u8 x i8 products
/// summed over `k`, then the offset corrections (see the module docs).
fn tile_quads_scalar(t: &QuadsTile, out: &mut [i32], ldt: usize) {
    let mut tile = [0i32; MRQ * NRQ];
    for q in 0..t.quads {
        let bq = &t.b[q * NRQ * 4..(q + 1) * NRQ * 4];
        for r in 0..MRQ {
            let aq = &t.a[r * t.lda + 4 * q..r * t.lda + 4 * q + 4];
            let row = &mut tile[r * NRQ..(r + 1) * NRQ];
            for (j, d) in row.iter_mut().enumerate() {
                let dot: i32 = (0..4)
                    .map(|i| aq[i] as i32 * bq[4 * j + i] as i32)
                    .sum::<i32>();
                *d = d.wrapping_add(dot);
            }
        }
    }
    for r in 0..MRQ {
        for j in 0..NRQ {
            out[r * ldt + j] = tile[r * NRQ + j]
                .wrapping_sub(t.boff[j].wrapping_mul(t.asum[r]))
                .wrapping_sub(t.bsum[j].wrapping_mul(t.aoff[r]));
        }
    }
}

/// One MRQ x NRQ tile with AVX-512 VNNI: per k quad, three 64-byte B loads, MRQ broadcasts of
/// four A bytes and 3 * MRQ `vpdpbusd` (24 accumulators); then the offset corrections with
/// `vpmulld`/`vpsubd` (wrapping, as the twin).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI. The slice lengths are asserted.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_vnni(t: &QuadsTile, out: &mut [i32], ldt: usize) {
    use std::arch::x86_64::*;
    const V: usize = NRQ / 16;
    assert!(
        t.a.len() >= (MRQ - 1) * t.lda + 4 * t.quads
            && t.b.len() >= t.quads * NRQ * 4
            && t.aoff.len() >= MRQ
            && t.asum.len() >= MRQ
            && t.boff.len() >= NRQ
            && t.bsum.len() >= NRQ
            && out.len() >= (MRQ - 1) * ldt + NRQ,
        "igemm quads tile operands too short"
    );
    let mut acc = [[_mm512_setzero_si512(); V]; MRQ];
    let ap = t.a.as_ptr();
    let bp = t.b.as_ptr();
    for q in 0..t.quads {
        // SAFETY: q < quads, so the NRQ * 4 bytes of B at q * NRQ * 4 and the 4 bytes of each
        // row r < MRQ at r * lda + 4q lie inside the slices (asserted above); loads are
        // unaligned.
        unsafe {
            let bv: [__m512i; V] = std::array::from_fn(|j| {
                _mm512_loadu_si512(bp.add(q * NRQ * 4 + j * 64) as *const _)
            });
            for (r, accr) in acc.iter_mut().enumerate() {
                let quad = (ap.add(r * t.lda + 4 * q) as *const i32).read_unaligned();
                let av = _mm512_set1_epi32(quad);
                for (a, &b) in accr.iter_mut().zip(&bv) {
                    *a = _mm512_dpbusd_epi32(*a, av, b);
                }
            }
        }
    }
    let op = out.as_mut_ptr();
    // SAFETY: boff/bsum hold NRQ values and `out` (MRQ - 1) * ldt + NRQ (asserted above); row
    // r's NRQ sums are stored at r * ldt.
    unsafe {
        let bo: [__m512i; V] =
            std::array::from_fn(|j| _mm512_loadu_si512(t.boff.as_ptr().add(16 * j) as *const _));
        let bs: [__m512i; V] =
            std::array::from_fn(|j| _mm512_loadu_si512(t.bsum.as_ptr().add(16 * j) as *const _));
        for (r, accr) in acc.iter().enumerate() {
            let s = _mm512_set1_epi32(t.asum[r]);
            let o = _mm512_set1_epi32(t.aoff[r]);
            for j in 0..V {
                let v = _mm512_sub_epi32(accr[j], _mm512_mullo_epi32(bo[j], s));
                let v = _mm512_sub_epi32(v, _mm512_mullo_epi32(bs[j], o));
                _mm512_storeu_si512(op.add(r * ldt + 16 * j) as *mut _, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Constant weights that fit i8 are stored narrow, others wide; both multiply alike (the
    /// products themselves are compared with the definition in `tests/igemm.rs`).
    #[test]
    fn constant_panels_are_narrow_exactly_when_every_value_fits_i8() {
        let narrow = PairsB::pack(5, 3, |r, c| (r as i16 * 60 - 126).min(127) - c as i16);
        assert!(matches!(narrow.data, PairsData::Narrow(_)));
        let wide = PairsB::pack(5, 3, |r, c| if r == 4 && c == 2 { 128 } else { -3 });
        assert!(matches!(wide.data, PairsData::Wide(_)));
        let a = PackedA::pack_with_as(Layout::Pairs, PackBuf::default(), 2, 5, |r, row| {
            for (c, d) in row.iter_mut().enumerate() {
                *d = (r * 5 + c) as i16 - 255;
            }
        });
        for (pb, get) in [
            (
                narrow,
                &(|r: usize, c: usize| (r as i16 * 60 - 126).min(127) - c as i16)
                    as &dyn Fn(usize, usize) -> i16,
            ),
            (wide, &|r: usize, c: usize| {
                if r == 4 && c == 2 {
                    128
                } else {
                    -3
                }
            }),
        ] {
            let pb = PackedB {
                k: 5,
                n: 3,
                body: BBody::Pairs(pb),
            };
            for isa in [Isa::Scalar, Isa::detect()] {
                let mut c = vec![0i32; 6];
                igemm_with(isa, &a, &pb, &mut c, 1).unwrap();
                for (i, &v) in c.iter().enumerate() {
                    let (r, col) = (i / 3, i % 3);
                    let want: i32 = (0..5)
                        .map(|p| ((r * 5 + p) as i32 - 255) * get(p, col) as i32)
                        .sum();
                    assert_eq!(v, want, "{isa:?} ({r}, {col})");
                }
            }
        }
    }
}
