//! Exact integer matrix products for quantized operators: `C[m x n] (i32) = A'[m x k] * B'[k x n]`
//! where `A' = a - za` and `B' = b - zb[col]` are the zero-point-corrected operands.
//!
//! Both operands are widened to i16 *after* subtracting their zero points: an 8-bit value minus
//! an 8-bit zero point lies in [-255, 255], so it fits i16 exactly and no row/column-sum
//! correction is needed afterwards. Products are accumulated with `vpmaddwd` (pairs of i16
//! products summed into i32), which cannot saturate: |pair| <= 2 * 255 * 255 = 130050.
//! `vpmaddubsw` (u8 x i8 -> saturating i16 pairs) is deliberately not used: 2 * 255 * 127 >
//! 32767, so it is inexact without VNNI. The exact variants do not pay off either (measured on
//! Zen 4 with AVX2 only): `vpmaddwd` already does 16 multiply-adds per multiply-port
//! instruction (twice an 8-lane FMA), while a `vpmaddubsw` product (32) must still be widened
//! to i32 — by a second `vpmaddwd` with ones (16 per multiply-port op again) or by shifts and
//! i16 adds (6 vector ops per 32 products against 4 here) — and the sign trick needed for
//! exactness (`|a - 128|` against `b * sign(a - 128)`, since `vpsignb` cannot negate -128)
//! costs a further op per product vector (`vpsignb`/`vpabsb` also issue on the multiply ports).
//! A prototype of the shift-widened u8 kernel ran at the speed of this one.
//!
//! Overflow bound: operands lie in [-256, 255] (8-bit values minus zero points, or the high
//! byte of a split 16-bit value), so every term is at most 256 * 255 = 65280 in magnitude and
//! an i32 sum of `k` terms is exact for `k <= MAX_K` = floor((2^31 - 1) / 65280) = 32896.
//! Callers check [`MAX_K`]; 16-bit operands are split into a high and a low byte by the caller
//! (see `ops::qlinear`), which keeps the bound per half.
//!
//! Layouts: `A` is packed row-major with `k` padded to an even `kp2 = 2 * pairs` (zeros), rows
//! padded to a multiple of [`MR`]; `B` is packed in panels of [`NR`] columns, each panel holding
//! for every k pair the `NR` columns' two values interleaved (the `vpmaddwd` operand order).
//! Padding is zero, so padded lanes contribute nothing.

use crate::bail;
use crate::error::Result;
use rayon::prelude::*;

/// Rows of a micro-tile.
pub const MR: usize = 6;
/// Columns of a micro-tile (two AVX2 registers of eight i32 lanes).
pub const NR: usize = 16;
/// The longest reduction whose i32 accumulation is proven exact (see the module docs).
pub const MAX_K: usize = 32896;
/// Products with at least this many multiply-adds are split across threads.
const PAR_WORK: usize = 1 << 17;
/// Packed-A bytes per row-block chunk (a part of L2 on current x86 cores).
const A_CHUNK_BYTES: usize = 192 << 10;
/// Sum bytes per row-block chunk when an epilogue reads them back ([`igemm_then`]).
const C_CHUNK_BYTES: usize = 256 << 10;

/// A packed, zero-point-corrected right-hand operand (`k x n`), built once per constant weight.
#[derive(Debug, Clone)]
pub struct PackedB {
    k: usize,
    n: usize,
    pairs: usize,
    panels: usize,
    data: Vec<i16>,
}

impl PackedB {
    /// Packs `B[k x n]` where element (r, c) is `get(r, c)` (already zero-point corrected and
    /// within [-32768, 32767]; the exactness bound assumes [-255, 255], checked by callers).
    pub fn pack(k: usize, n: usize, get: impl Fn(usize, usize) -> i16) -> PackedB {
        let pairs = k.div_ceil(2);
        let panels = n.div_ceil(NR);
        let mut data = vec![0i16; panels * pairs * 2 * NR];
        for pn in 0..panels {
            let base = pn * pairs * 2 * NR;
            let c0 = pn * NR;
            let cols = NR.min(n - c0);
            for r in 0..k {
                let (p, h) = (r / 2, r % 2);
                let row = &mut data[base + p * 2 * NR..base + (p + 1) * 2 * NR];
                for j in 0..cols {
                    row[2 * j + h] = get(r, c0 + j);
                }
            }
        }
        PackedB {
            k,
            n,
            pairs,
            panels,
            data,
        }
    }
    /// Packs a contiguous row-major `k x n` slice through a per-element conversion: the fast
    /// path of [`PackedB::pack`] for per-run (activation) operands, reading rows contiguously
    /// and writing each k pair's interleaved panel rows in order.
    pub fn pack_rows<T: Copy>(k: usize, n: usize, src: &[T], f: impl Fn(T) -> i16) -> PackedB {
        let pairs = k.div_ceil(2);
        let panels = n.div_ceil(NR);
        let mut data = vec![0i16; panels * pairs * 2 * NR];
        assert!(src.len() >= k * n, "packed operand source too short");
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
        PackedB {
            k,
            n,
            pairs,
            panels,
            data,
        }
    }
    /// Reduction length.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Number of columns.
    pub fn n(&self) -> usize {
        self.n
    }
}

/// A packed, zero-point-corrected left-hand operand (`m x k`), built per run.
#[derive(Debug, Clone)]
pub struct PackedA {
    m: usize,
    k: usize,
    kp2: usize,
    data: Vec<i16>,
}

impl PackedA {
    /// Packs `A[m x k]` where element (r, c) is `get(r, c)`.
    pub fn pack(m: usize, k: usize, get: impl Fn(usize, usize) -> i16) -> PackedA {
        let kp2 = k.div_ceil(2) * 2;
        let rows = m.div_ceil(MR) * MR;
        let mut data = vec![0i16; rows * kp2];
        for r in 0..m {
            let row = &mut data[r * kp2..r * kp2 + k];
            for (c, d) in row.iter_mut().enumerate() {
                *d = get(r, c);
            }
        }
        PackedA { m, k, kp2, data }
    }
    /// Packs a contiguous row-major `m x k` slice through a per-element conversion; the fast
    /// path of [`PackedA::pack`] for the common activation layout.
    pub fn pack_rows<T: Copy>(m: usize, k: usize, src: &[T], f: impl Fn(T) -> i16) -> PackedA {
        Self::pack_rows_in(Vec::new(), m, k, src, f)
    }
    /// [`PackedA::pack_rows`] into a recycled buffer (its capacity is reused, so per-run
    /// packing does not allocate and fault in fresh pages; see [`PackedA::into_buffer`]).
    pub fn pack_rows_in<T: Copy>(
        data: Vec<i16>,
        m: usize,
        k: usize,
        src: &[T],
        f: impl Fn(T) -> i16,
    ) -> PackedA {
        assert!(src.len() >= m * k, "packed operand source too short");
        let mut s = src.chunks_exact(k.max(1));
        // Every slot is written below (values, then zero padding), so the recycled buffer is
        // not cleared first: that would write the whole operand twice.
        Self::pack_with(data, m, k, |_, dst| {
            if let Some(row) = s.next() {
                for (d, &v) in dst.iter_mut().zip(row) {
                    *d = f(v);
                }
            }
        })
    }
    /// Packs `m` rows of `k` values into a recycled buffer, each row written in place by
    /// `fill(r, row)`: the gather path for operands that are not one contiguous matrix (e.g.
    /// the taps of a transposed convolution), without an intermediate copy. `row` holds
    /// exactly `k` slots with stale contents, and `fill` must write every one of them (the
    /// buffer is not cleared first: that would write the whole operand twice); the padding
    /// slots are zeroed here.
    pub fn pack_with(
        mut data: Vec<i16>,
        m: usize,
        k: usize,
        mut fill: impl FnMut(usize, &mut [i16]),
    ) -> PackedA {
        let kp2 = k.div_ceil(2) * 2;
        let rows = m.div_ceil(MR) * MR;
        data.resize(rows * kp2, 0);
        if kp2 > 0 {
            for (r, row) in data.chunks_exact_mut(kp2).enumerate() {
                if r < m {
                    fill(r, &mut row[..k]);
                    row[k..].fill(0);
                } else {
                    row.fill(0);
                }
            }
        }
        PackedA { m, k, kp2, data }
    }
    /// The packed buffer, for reuse by a later [`PackedA::pack_rows_in`].
    pub fn into_buffer(self) -> Vec<i16> {
        self.data
    }
    /// Number of rows.
    pub fn m(&self) -> usize {
        self.m
    }
}

/// Which micro-kernel runs: the process-wide level (`npuc_isa`), or an explicit one in tests.
/// The AVX2 `vpmaddwd` tile also serves the AVX-512 level (no wider tile yet).
pub use npuc_isa::Isa;

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
    if isa.has_avx2() && !Isa::detect().has_avx2() {
        bail!("integer product: AVX2 kernel requested on a CPU without avx2");
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let blocks = m.div_ceil(MR);
    let c = &mut c[..m * n];
    // One group of row blocks per thread. Within a group, B panels are the outer loop: a panel
    // (k x NR i16) stays in L1/L2 while the group's rows of A stream past it; A's group is
    // reused across panels from L2. (Row blocks outer would stream all of B once per block.)
    let groups = if threads > 1 && m * n * k >= PAR_WORK {
        threads.min(blocks)
    } else {
        1
    };
    let blocks_per = blocks.div_ceil(groups);
    let run_chunk =
        |cb0: usize, cb1: usize, b0: usize, cgrp: &mut [i32], tile: &mut [i32; MR * NR]| {
            for pn in 0..b.panels {
                let bpan = &b.data[pn * b.pairs * 2 * NR..(pn + 1) * b.pairs * 2 * NR];
                let c0 = pn * NR;
                let cols = NR.min(n - c0);
                for bi in cb0..cb1 {
                    let rows = MR.min(m - bi * MR);
                    let ablk = &a.data[bi * MR * a.kp2..(bi + 1) * MR * a.kp2];
                    let r0 = (bi - b0) * MR;
                    // A full tile is stored straight into C (row stride n); an edge tile goes
                    // through the local buffer and only its valid part is copied.
                    let direct = rows == MR && cols == NR;
                    let (dst, ldt): (&mut [i32], usize) = if direct {
                        (&mut cgrp[r0 * n + c0..(r0 + MR - 1) * n + c0 + NR], n)
                    } else {
                        (&mut tile[..], NR)
                    };
                    match isa {
                        Isa::Scalar => tile_scalar(b.pairs, ablk, a.kp2, bpan, dst, ldt),
                        Isa::Avx2 | Isa::Avx512 => {
                            #[cfg(target_arch = "x86_64")]
                            // SAFETY: avx2 support was checked above (`Isa::detect`); `ablk` holds
                            // MR rows of `kp2 = 2 * pairs` values and `bpan` holds
                            // `pairs * 2 * NR` values, exactly what the kernel reads; `dst`
                            // holds (MR - 1) * ldt + NR slots (a full tile of C, or `tile`).
                            unsafe {
                                tile_avx2(b.pairs, ablk, a.kp2, bpan, dst, ldt)
                            }
                            #[cfg(not(target_arch = "x86_64"))]
                            tile_scalar(b.pairs, ablk, a.kp2, bpan, dst, ldt)
                        }
                    }
                    if !direct {
                        for r in 0..rows {
                            let d = &mut cgrp[(r0 + r) * n + c0..(r0 + r) * n + c0 + cols];
                            for (x, &v) in d.iter_mut().zip(&tile[r * NR..r * NR + cols]) {
                                *x = v;
                            }
                        }
                    }
                }
            }
        };
    let epi = out.as_ref().map(|(_, f)| *f);
    // Row blocks go in chunks whose packed A (about `A_CHUNK_BYTES`) stays in L2 while
    // every B panel passes: B streams once per chunk instead of A once per panel. With an
    // epilogue, a chunk's sums (about `C_CHUNK_BYTES`) also stay in L2 until it reads them.
    let mut chunk = (A_CHUNK_BYTES / (MR * a.kp2 * 2).max(1)).max(1);
    if epi.is_some() {
        chunk = chunk.min((C_CHUNK_BYTES / (MR * n * 4)).max(1));
    }
    let run_group = |gi: usize, cgrp: &mut [i32], mut ogrp: Option<&mut [T]>| {
        let b0 = gi * blocks_per;
        let b1 = ((gi + 1) * blocks_per).min(blocks);
        let rows = cgrp.len() / n;
        let mut tile = [0i32; MR * NR];
        let mut cb0 = b0;
        while cb0 < b1 {
            let cb1 = (cb0 + chunk).min(b1);
            run_chunk(cb0, cb1, b0, cgrp, &mut tile);
            if let (Some(o), Some(f)) = (ogrp.as_deref_mut(), epi) {
                let (r0, r1) = ((cb0 - b0) * MR, ((cb1 - b0) * MR).min(rows));
                f(&cgrp[r0 * n..r1 * n], &mut o[r0 * n..r1 * n]);
            }
            cb0 = cb1;
        }
    };
    let gsize = blocks_per * MR * n;
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
    Ok(())
}

/// Scalar twin of [`tile_avx2`]: one MR x NR tile from packed operands, written to `out`
/// with row stride `ldt` (`out` holds at least `(MR - 1) * ldt + NR` values).
fn tile_scalar(pairs: usize, a: &[i16], lda: usize, b: &[i16], out: &mut [i32], ldt: usize) {
    let mut tile = [0i32; MR * NR];
    for p in 0..pairs {
        let bp = &b[p * 2 * NR..(p + 1) * 2 * NR];
        for r in 0..MR {
            let a0 = a[r * lda + 2 * p] as i32;
            let a1 = a[r * lda + 2 * p + 1] as i32;
            let t = &mut tile[r * NR..(r + 1) * NR];
            for (j, d) in t.iter_mut().enumerate() {
                *d = d.wrapping_add(a0 * bp[2 * j] as i32 + a1 * bp[2 * j + 1] as i32);
            }
        }
    }
    for r in 0..MR {
        out[r * ldt..r * ldt + NR].copy_from_slice(&tile[r * NR..(r + 1) * NR]);
    }
}

/// One MR x NR tile with AVX2: per k pair, two B loads, MR broadcasts of an (a0, a1) pair and
/// 2 * MR `vpmaddwd` + `vpaddd`.
///
/// The tile is written to `out` with row stride `ldt`: straight into C for a full tile.
///
/// # Safety
/// The CPU must support avx2; `a` must hold `MR` rows of stride `lda >= 2 * pairs`, `b` at
/// least `pairs * 2 * NR` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tile_avx2(pairs: usize, a: &[i16], lda: usize, b: &[i16], out: &mut [i32], ldt: usize) {
    use std::arch::x86_64::*;
    debug_assert!(a.len() >= (MR - 1) * lda + 2 * pairs && b.len() >= pairs * 2 * NR);
    assert!(
        out.len() >= (MR - 1) * ldt + NR,
        "igemm tile output too short"
    );
    let mut acc = [_mm256_setzero_si256(); 2 * MR];
    let ap = a.as_ptr();
    let bp = b.as_ptr();
    for p in 0..pairs {
        // SAFETY: p < pairs, so b[p*32 .. p*32+32] and a[r*lda + 2p .. +2] are in bounds
        // (caller contract); unaligned loads are used throughout.
        unsafe {
            let b0 = _mm256_loadu_si256(bp.add(p * 2 * NR) as *const __m256i);
            let b1 = _mm256_loadu_si256(bp.add(p * 2 * NR + NR) as *const __m256i);
            for r in 0..MR {
                let pair = (ap.add(r * lda + 2 * p) as *const i32).read_unaligned();
                let av = _mm256_set1_epi32(pair);
                acc[2 * r] = _mm256_add_epi32(acc[2 * r], _mm256_madd_epi16(av, b0));
                acc[2 * r + 1] = _mm256_add_epi32(acc[2 * r + 1], _mm256_madd_epi16(av, b1));
            }
        }
    }
    let tp = out.as_mut_ptr();
    for r in 0..MR {
        // SAFETY: `out` holds (MR - 1) * ldt + NR slots (asserted above); row r occupies
        // [r * ldt, r * ldt + 16).
        unsafe {
            _mm256_storeu_si256(tp.add(r * ldt) as *mut __m256i, acc[2 * r]);
            _mm256_storeu_si256(tp.add(r * ldt + 8) as *mut __m256i, acc[2 * r + 1]);
        }
    }
}
