//! f32 matrix product with an AVX-512 micro-kernel: `c[m x n] = a[m x k] * b[k x n]`, both
//! operands row-major with unit column stride (any row strides), `c` overwritten.
//!
//! The runtime's f32 products go through the `gemm` crate (`ops::matmul::gemm_into`), whose
//! AVX-512 kernels are behind a feature this workspace does not enable (so it runs its AVX2+FMA
//! kernels on an AVX-512 host). This kernel is the candidate replacement, measured against it
//! by `examples/sgemm_bench.rs` and not yet wired in (to be switched on once it wins on whole
//! models, not only per shape). It reads `b` in place (no packing: a panel of [`NR`] columns is
//! `k` rows of 128 bytes, which stay in L1/L2 while the row blocks of `a` pass) and keeps a
//! [`MR`] x [`NR`] tile in 24 of the 32 vector registers: per `k` step two 16-lane loads of
//! `b`, 12 broadcasts of `a` and 24 fused multiply-adds.
//!
//! Every output is one chain of fused multiply-adds in `k` order starting from zero, so the
//! scalar twin ([`sgemm_scalar`], `f32::mul_add`) gives the same bits; the property tests
//! compare them. (It differs from the `gemm` crate in the last bits: another summation order.)

use crate::bail;
use crate::error::Result;
use npuc_isa::Isa;
use rayon::prelude::*;

/// Rows of a micro-tile.
pub const MR: usize = 12;
/// Columns of a micro-tile (two 16-lane registers).
pub const NR: usize = 32;
/// Products with at least this many multiply-adds are split across threads.
const PAR_WORK: usize = 1 << 17;
/// Bytes of `a` per row chunk: the chunk stays in L2 while every column panel passes it.
const A_CHUNK_BYTES: usize = 256 << 10;
/// Reduction steps per pass: a panel of `b` (`KC` rows of 128 bytes, 32 KB) stays in L1 while
/// the row blocks of a chunk pass it; later passes continue each output's chain from `c`.
/// (Without it, a 1536-long reduction ran slower than the `gemm` crate.)
const KC: usize = 256;

/// Whether [`sgemm`] runs its AVX-512 kernel at `isa` (else callers keep their own path).
pub fn available(isa: Isa) -> bool {
    isa.has_avx512()
}

/// A row-major operand view: row `i` starts at `data[i * ld]`, unit column stride.
#[derive(Clone, Copy)]
pub struct RowMajor<'a> {
    pub data: &'a [f32],
    pub ld: usize,
}

fn check(
    m: usize,
    n: usize,
    k: usize,
    a: RowMajor,
    b: RowMajor,
    c: &[f32],
    ldc: usize,
) -> Result<()> {
    let fits = |v: &RowMajor, rows: usize, cols: usize| {
        rows == 0 || cols == 0 || (v.ld >= cols && (rows - 1) * v.ld + cols <= v.data.len())
    };
    if !fits(&a, m, k)
        || !fits(&b, k, n)
        || (m > 0 && n > 0 && (ldc < n || (m - 1) * ldc + n > c.len()))
    {
        bail!("f32 product operands are smaller than their shapes ({m}x{k} by {k}x{n})");
    }
    Ok(())
}

/// `c[m x n]` (row stride `ldc`) = `a * b` with the kernel of `isa`: the AVX-512 one when
/// [`available`], else the scalar twin.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    a: RowMajor,
    b: RowMajor,
    c: &mut [f32],
    ldc: usize,
    threads: usize,
) -> Result<()> {
    check(m, n, k, a, b, c, ldc)?;
    if isa > Isa::detect() {
        bail!(
            "f32 product: {} kernels requested above the active level {}",
            isa.name(),
            Isa::detect().name()
        );
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        for row in c.chunks_mut(ldc).take(m) {
            row[..n].fill(0.0);
        }
        return Ok(());
    }
    if !available(isa) {
        sgemm_scalar(m, n, k, a, b, c, ldc);
        return Ok(());
    }
    let blocks = m.div_ceil(MR);
    let groups = if threads > 1 && m * n * k >= PAR_WORK {
        threads.min(blocks)
    } else {
        1
    };
    let per = blocks.div_ceil(groups) * MR;
    let run = |r0: usize, rows: usize, cg: &mut [f32]| {
        let chunk = ((A_CHUNK_BYTES / (4 * KC.min(k).max(1))) / MR).max(1) * MR;
        let mut c0 = 0;
        while c0 < rows {
            let c1 = (c0 + chunk).min(rows);
            let mut k0 = 0;
            loop {
                let kc = KC.min(k - k0);
                for p0 in (0..n).step_by(NR) {
                    let cols = NR.min(n - p0);
                    let mut i = c0;
                    while i < c1 {
                        let r = MR.min(c1 - i);
                        let ao = (r0 + i) * a.ld + k0;
                        // SAFETY: `available(isa)` and `isa <= Isa::detect()` mean the CPU has
                        // AVX-512 F; `check` proved rows r0+i .. r0+i+r of `a` (k values each,
                        // of which k0..k0+kc are read), rows k0..k0+kc of `b` at columns
                        // p0..p0+cols and rows i..i+r of `cg` (a window of `c` starting at row
                        // r0) at those columns lie inside the slices.
                        unsafe {
                            tile(
                                r,
                                kc,
                                &a.data[ao..],
                                a.ld,
                                &b.data[k0 * b.ld + p0..],
                                b.ld,
                                &mut cg[i * ldc + p0..],
                                ldc,
                                cols,
                                k0 > 0,
                            )
                        }
                        i += r;
                    }
                }
                k0 += kc;
                if k0 >= k {
                    break;
                }
            }
            c0 = c1;
        }
    };
    if groups > 1 {
        let c = &mut c[..(m - 1) * ldc + n];
        // Row groups of `per` rows own disjoint row ranges of `c` (the last may be short).
        let mut parts: Vec<(usize, &mut [f32])> = Vec::with_capacity(groups);
        let mut rest = c;
        let mut r0 = 0;
        while r0 < m {
            let rows = per.min(m - r0);
            let take = if r0 + rows < m {
                rows * ldc
            } else {
                rest.len()
            };
            let (head, tail) = rest.split_at_mut(take);
            parts.push((r0, head));
            rest = tail;
            r0 += rows;
        }
        parts
            .into_par_iter()
            .for_each(|(r0, cg)| run(r0, per.min(m - r0), cg));
    } else {
        run(0, m, c);
    }
    Ok(())
}

/// The scalar twin: each output one `mul_add` chain in `k` order from zero.
pub fn sgemm_scalar(
    m: usize,
    n: usize,
    k: usize,
    a: RowMajor,
    b: RowMajor,
    c: &mut [f32],
    ldc: usize,
) {
    for i in 0..m {
        let arow = &a.data[i * a.ld..i * a.ld + k];
        for j in 0..n {
            let mut acc = 0f32;
            for (kk, &x) in arow.iter().enumerate() {
                acc = x.mul_add(b.data[kk * b.ld + j], acc);
            }
            c[i * ldc + j] = acc;
        }
    }
}

/// Dispatches the `rows`-row tile (1..=MR); `cont`: continue the chains from `c` (a later
/// reduction pass) instead of from zero.
///
/// # Safety
/// AVX-512 F; `a` holds `rows` rows of `k` values at stride `lda`, `b` `k` rows of `cols`
/// (<= NR) values at stride `ldb`, `c` `rows` rows of `cols` at stride `ldc`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    rows: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    cols: usize,
    cont: bool,
) {
    assert!(
        (1..=MR).contains(&rows)
            && (1..=NR).contains(&cols)
            && (k == 0 || b.len() >= (k - 1) * ldb + cols)
            && a.len() >= (rows - 1) * lda + k
            && c.len() >= (rows - 1) * ldc + cols,
        "sgemm tile operands too short"
    );
    macro_rules! go {
        ($($r:literal)*) => {
            match rows {
                // SAFETY: AVX-512 F per this function's contract; the assert above bounds
                // every access of the kernel.
                $($r => unsafe { tile_avx512::<$r>(k, a.as_ptr(), lda, b.as_ptr(), ldb, c.as_mut_ptr(), ldc, cols, cont) },)*
                _ => unreachable!(),
            }
        };
    }
    go!(1 2 3 4 5 6 7 8 9 10 11 12);
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    rows: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    cols: usize,
    cont: bool,
) {
    for i in 0..rows {
        for j in 0..cols {
            let mut acc = if cont { c[i * ldc + j] } else { 0.0 };
            for kk in 0..k {
                acc = a[i * lda + kk].mul_add(b[kk * ldb + j], acc);
            }
            c[i * ldc + j] = acc;
        }
    }
}

/// R rows x 32 columns: 2R accumulators (from zero, or from `c` when `cont`); columns beyond
/// `cols` are masked off (loads read nothing there, stores write nothing).
///
/// # Safety
/// AVX-512 F; pointers valid as [`tile`] states.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx512<const R: usize>(
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    cont: bool,
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
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    if cont {
        for (r, accr) in acc.iter_mut().enumerate() {
            // SAFETY: row r < R of `c` holds `cols` values at r * ldc (masked loads).
            unsafe {
                accr[0] = _mm512_maskz_loadu_ps(m0, c.add(r * ldc));
                accr[1] = _mm512_maskz_loadu_ps(m1, c.add(r * ldc + 16));
            }
        }
    }
    for kk in 0..k {
        // SAFETY: row kk < k of `b` holds `cols` values at kk * ldb (masked loads touch only
        // those) and a[r * lda + kk] (r < R) is inside `a` (the caller's contract).
        unsafe {
            let bp = b.add(kk * ldb);
            let b0 = _mm512_maskz_loadu_ps(m0, bp);
            let b1 = _mm512_maskz_loadu_ps(m1, bp.add(16));
            for (r, accr) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(r * lda + kk));
                accr[0] = _mm512_fmadd_ps(av, b0, accr[0]);
                accr[1] = _mm512_fmadd_ps(av, b1, accr[1]);
            }
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        // SAFETY: row r < R of `c` holds `cols` values at r * ldc (masked stores).
        unsafe {
            _mm512_mask_storeu_ps(c.add(r * ldc), m0, accr[0]);
            _mm512_mask_storeu_ps(c.add(r * ldc + 16), m1, accr[1]);
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
            m in 1usize..30, n in 1usize..80, k in prop_oneof![0usize..90, 250usize..600], pad in 0usize..3,
            threads in 1usize..3, seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut val = || (xorshift(&mut s) % 2001) as f32 / 1000.0 - 1.0;
            let (lda, ldb, ldc) = (k + pad, n + pad, n + 2 * pad);
            let a: Vec<f32> = (0..m * lda).map(|_| val()).collect();
            let b: Vec<f32> = (0..k.max(1) * ldb).map(|_| val()).collect();
            let (ra, rb) = (RowMajor { data: &a, ld: lda }, RowMajor { data: &b, ld: ldb });
            let mut want = vec![f32::NAN; m * ldc];
            sgemm_scalar(m, n, k, ra, rb, &mut want, ldc);
            let mut got = vec![f32::NAN; m * ldc];
            sgemm(Isa::detect(), m, n, k, ra, rb, &mut got, ldc, threads).unwrap();
            for i in 0..m {
                for j in 0..ldc {
                    let (g, w) = (got[i * ldc + j], want[i * ldc + j]);
                    prop_assert_eq!(g.to_bits(), w.to_bits(), "({}, {}): {} vs {}", i, j, g, w);
                }
            }
        }
    }

    #[test]
    fn short_operands_are_refused() {
        let a = [1f32; 6];
        let b = [1f32; 5];
        let mut c = [0f32; 4];
        let (ra, rb) = (RowMajor { data: &a, ld: 3 }, RowMajor { data: &b, ld: 2 });
        assert!(sgemm(Isa::detect(), 2, 2, 3, ra, rb, &mut c, 2, 1).is_err());
    }
}
