//! Exact integer matrix-vector product for the recurrent step of DynamicQuantizeLSTM:
//! `out[n] (i32) = a[k] · B[k x n]`, with `a` the zero-point-corrected quantized hidden state
//! (i16, within [-255, 255]) and `B` constant int8 weights (zero point already subtracted,
//! within [-128, 127]), packed once.
//!
//! The recurrent weights are re-read at every timestep, so they are stored as i8 (half the
//! bytes of the i16 panels of `kernels::igemm`: a 256 x 1024 matrix is 256 KiB and stays in a
//! 512 KiB L2 while the step loop runs) and widened to i16 in registers (`vpmovsxbw`) right
//! before `vpmaddwd`. Every term is at most 255 * 128 = 32640 in magnitude, so an i32 sum of
//! `k <= MAX_K` terms is exact, and the AVX2 kernel equals its scalar twin bit for bit.
//!
//! Layout: columns in panels of [`NRV`]; a panel holds, for each pair of rows `(2p, 2p + 1)`,
//! its `NRV` columns' two values interleaved (the `vpmaddwd` operand order). `k` and `n` are
//! padded with zeros to whole pairs and panels, so padded lanes contribute nothing.
//!
//! Where the process runs at the AVX-512 VNNI level the weights are also packed in quads
//! (panels of [`NRQ`] columns, each column's four consecutive rows adjacent: the `vpdpbusd`
//! operand order), and a step shifts `a` to unsigned bytes `u = a + off` (`off = -min(a)`,
//! which fits whenever `a` spans at most 256 values, as a quantized state minus its zero point
//! always does): `Σ a·b = Σ u·b - off · Σ b`, with each column's `Σ b` stored at packing. Four
//! products per lane per instruction instead of two, no widening shuffles, and every step is
//! wrapping i32 arithmetic whose final value fits i32: bit-identical to the pairs kernels.
//!
//! [`gemv_fast`] (what the LSTM recurrence calls) runs, at the AVX2 level without VNNI,
//! onnxruntime's own AVX2 u8 x s8 arithmetic on the same quads (`vpmaddubsw`: each pair sum
//! `u0 b0 + u1 b1` saturates to i16, then `vpmaddwd` with ones adds a column's two pairs into
//! i32): three vector operations per 32 multiply-adds instead of the exact kernel's six, whose
//! `vpmovsxbw` widening bounds it (256 x 1024, one step: 4.5-5.7 -> 3.3-3.8 us on an AVX2 Zen host,
//! `examples/qgemv_bench.rs`).
//! Pair sums reach 2 * 255 * 128 = 65280, so it is inexact where both values of a pair are
//! large and alike in sign: on text2tashkeel's BiLSTM test input 29 of 62.9 M pair sums
//! (`scripts/u8s8_saturation.py`, with `u` the u8 code as onnxruntime forms it; here `u` is
//! shifted to start at 0, which only lowers the values). Its effect on the outputs
//! (`scripts/u8s8_quality.py`: the test input and 20 random sequences per model, against
//! onnxruntime on the same AVX2 host): BiLSTM logits at most 0.405 from onnxruntime's (exact
//! kernel: 0.466), argmax agreement 99.70% of 672 positions (exact: 99.40%); rawi the same as
//! exact (0.189, 99.40%). `NPUC_INT8_EXACT=1` keeps the exact kernels everywhere; levels with
//! VNNI are exact anyway (`vpdpbusd` does not saturate).

use crate::bail;
use crate::error::Result;
pub use npuc_isa::Isa;

/// Columns of a panel: four AVX2 registers of eight i32 sums.
pub const NRV: usize = 32;
/// The longest reduction whose i32 accumulation is proven exact: floor((2^31 - 1) / 32640).
pub const MAX_K: usize = 65793;

/// Columns of a quads panel: four AVX-512 registers of sixteen i32 sums.
pub const NRQ: usize = 64;

/// Constant int8 weights `k x n`, packed for [`gemv`].
#[derive(Debug, Clone)]
pub struct PackedI8 {
    k: usize,
    pairs: usize,
    panels: usize,
    data: Vec<i8>,
    /// The quads copy, built where AVX-512 VNNI runs.
    quads: Option<Quads>,
}

/// Weights in quads of rows for `vpdpbusd`: panel `pn`, quad `q`, column `j` of the panel,
/// row `4q + h` at `(pn * nq + q) * NRQ * 4 + 4 * j + h`; zeros past `k` and `n`.
#[derive(Debug, Clone)]
struct Quads {
    nq: usize,
    panels: usize,
    data: Vec<i8>,
    /// Per column (`panels * NRQ`, zeros past `n`): the sum of its `k` weights.
    colsum: Vec<i32>,
}

impl Quads {
    fn pack(k: usize, n: usize, get: &impl Fn(usize, usize) -> i8) -> Quads {
        let nq = k.div_ceil(4);
        let panels = n.div_ceil(NRQ);
        let mut data = vec![0i8; panels * nq * NRQ * 4];
        let mut colsum = vec![0i32; panels * NRQ];
        for r in 0..k {
            let (q, h) = (r / 4, r % 4);
            for (c, sum) in colsum[..n].iter_mut().enumerate() {
                let (pn, j) = (c / NRQ, c % NRQ);
                let v = get(r, c);
                data[(pn * nq + q) * NRQ * 4 + 4 * j + h] = v;
                *sum += v as i32;
            }
        }
        Quads {
            nq,
            panels,
            data,
            colsum,
        }
    }
}

impl PackedI8 {
    /// [`PackedI8::pack`] with the quads built whatever the level (tests of the saturating
    /// kernels at every level).
    pub fn pack_with_quads(k: usize, n: usize, get: impl Fn(usize, usize) -> i8) -> PackedI8 {
        let mut b = Self::pack(k, n, &get);
        if b.quads.is_none() {
            b.quads = Some(Quads::pack(k, n, &get));
        }
        b
    }

    /// Packs `B[k x n]` where element (r, c) is `get(r, c)`.
    pub fn pack(k: usize, n: usize, get: impl Fn(usize, usize) -> i8) -> PackedI8 {
        let pairs = k.div_ceil(2);
        let panels = n.div_ceil(NRV);
        let mut data = vec![0i8; panels * pairs * 2 * NRV];
        for r in 0..k {
            let (p, h) = (r / 2, r % 2);
            for c in 0..n {
                let (pn, j) = (c / NRV, c % NRV);
                data[(pn * pairs + p) * 2 * NRV + 2 * j + h] = get(r, c);
            }
        }
        let isa = Isa::detect();
        let quads = (isa.has_avx512_vnni() || (isa.has_avx2() && saturating_allowed()))
            .then(|| Quads::pack(k, n, &get));
        PackedI8 {
            k,
            pairs,
            panels,
            data,
            quads,
        }
    }
    /// Length [`gemv`] wants for `a`: `k` rounded up to a whole pair (the pad is zero).
    pub fn a_len(&self) -> usize {
        2 * self.pairs
    }
    /// Length [`gemv`] wants for `out`: `n` rounded up to a whole panel.
    pub fn out_len(&self) -> usize {
        self.panels * NRV
    }
}

/// `out = a · B`, exact in i32. `a` holds [`PackedI8::a_len`] values (the pad past `k` must be
/// zero) within [-255, 255]; `out` holds [`PackedI8::out_len`] values (the columns past `n` come
/// out zero).
pub fn gemv(a: &[i16], b: &PackedI8, out: &mut [i32]) -> Result<()> {
    gemv_with(Isa::detect(), a, b, out)
}

/// Whether [`gemv_fast`] may saturate (not with `NPUC_INT8_EXACT=1`; read once).
pub fn saturating_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("NPUC_INT8_EXACT").map_or(true, |v| v != "1"))
}

/// `out ≈ a · B` in onnxruntime's AVX2 u8 x s8 arithmetic where that is the fastest kernel
/// (the AVX2 level without VNNI, unless [`saturating_allowed`] says no), exact [`gemv`]
/// elsewhere. Same operand contract as [`gemv`].
pub fn gemv_fast(a: &[i16], b: &PackedI8, out: &mut [i32]) -> Result<()> {
    let isa = Isa::detect();
    if isa.has_avx2() && !isa.has_avx512_vnni() && saturating_allowed() {
        gemv_saturating_with(isa, a, b, out)
    } else {
        gemv_with(isa, a, b, out)
    }
}

/// [`gemv_fast`] with the operand given as unsigned codes and their zero point,
/// `a[i] = u[i] - zp` for `i < k` (`u` holds at least `k` codes; any past `k` are ignored), as
/// DynamicQuantizeLinear writes a hidden state. The quads kernels take codes as they are (`Σ
/// (u - zp)·b = Σ u·b - zp·Σ b`), so where they run (VNNI, or AVX2's saturating arithmetic)
/// no i16 row is built; elsewhere `a` is formed in `scratch`. Same values as [`gemv_fast`]
/// on `a`, bit for bit, at every level.
pub fn gemv_codes_fast(
    u: &[u8],
    zp: u8,
    b: &PackedI8,
    out: &mut [i32],
    scratch: &mut Vec<i16>,
) -> Result<()> {
    if u.len() < b.k || out.len() != b.out_len() {
        bail!(
            "integer matrix-vector product: {} codes and output of {} values, at least {} and {} expected",
            u.len(),
            out.len(),
            b.k,
            b.out_len()
        );
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(qd) = &b.quads {
        let (isa, uk) = (Isa::detect(), &u[..b.k]);
        if isa.has_avx512_vnni() && b.k <= MAX_K {
            // The exact product: any offset gives the same sums, so the codes go in as they
            // are (the row is copied only to pad it to whole quads).
            let run = |row: &[u8], out: &mut [i32]| {
                // SAFETY: AVX-512 F/BW/VNNI were detected on this CPU (capped by NPUC_ISA);
                // `row` holds 4 * nq bytes, `qd.data` panels * nq * NRQ * 4 and `qd.colsum`
                // panels * NRQ (by construction); the kernel stores at most `out.len()` values.
                unsafe { gemv_vnni(row, qd, zp as i32, out) }
            };
            if u.len() >= 4 * qd.nq {
                run(&u[..4 * qd.nq], out);
            } else {
                U8_ROW.with(|r| {
                    let mut r = r.borrow_mut();
                    r.clear();
                    r.extend_from_slice(uk);
                    r.resize(4 * qd.nq, 0);
                    run(&r, out);
                });
            }
            return Ok(());
        }
        if isa.has_avx2() && saturating_allowed() && b.k <= MAX_K {
            // Shifted to start at 0 as `gemv_saturating_with` does (fewer saturating pair
            // sums): u - min(u) with the offset zp - min(u) is the same `a`.
            let lo = uk.iter().copied().min().unwrap_or(0);
            U8_ROW.with(|r| {
                let mut r = r.borrow_mut();
                r.clear();
                r.extend(uk.iter().map(|&v| v - lo));
                r.resize(4 * qd.nq, 0);
                // SAFETY: AVX2 was detected on this CPU (capped by NPUC_ISA); `r` holds
                // 4 * nq bytes, `qd.data` panels * nq * NRQ * 4 and `qd.colsum` panels * NRQ
                // (by construction), and `out` holds `b.out_len()` <= panels * NRQ values.
                unsafe { gemv_avx2_sat(&r, qd, zp as i32 - lo as i32, out) };
            });
            return Ok(());
        }
    }
    scratch.clear();
    scratch.extend(u[..b.k].iter().map(|&v| v as i16 - zp as i16));
    scratch.resize(b.a_len(), 0);
    gemv_fast(scratch, b, out)
}

/// The saturating u8 x s8 product (see the module docs) with an explicit kernel choice:
/// AVX2 or its scalar twin, bit for bit the same; needs the quads (the exact product where
/// they were not built or `a` spans more than 256 values).
pub fn gemv_saturating_with(isa: Isa, a: &[i16], b: &PackedI8, out: &mut [i32]) -> Result<()> {
    check_operands(a, b, out)?;
    let Some(qd) = &b.quads else {
        return gemv_with(isa, a, b, out);
    };
    let ak = &a[..b.k];
    let (lo, hi) = ak
        .iter()
        .fold((i16::MAX, i16::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    if !ak.is_empty() && (hi as i32 - lo as i32) > 255 {
        return gemv_with(isa, a, b, out);
    }
    let off = if ak.is_empty() { 0 } else { -(lo as i32) };
    U8_ROW.with(|u| {
        let mut u = u.borrow_mut();
        u.clear();
        u.extend(ak.iter().map(|&v| (v as i32 + off) as u8));
        u.resize(4 * qd.nq, 0);
        #[cfg(target_arch = "x86_64")]
        if isa.has_avx2() && Isa::detect().has_avx2() {
            // SAFETY: AVX2 is present (checked); `u` holds 4 * nq bytes, `qd.data`
            // panels * nq * NRQ * 4 and `qd.colsum` panels * NRQ (by construction), and
            // `out` holds `b.out_len()` <= panels * NRQ values (checked above).
            unsafe { gemv_avx2_sat(&u, qd, off, out) };
            return;
        }
        gemv_sat_scalar(&u, qd, off, out);
    });
    Ok(())
}

fn check_operands(a: &[i16], b: &PackedI8, out: &[i32]) -> Result<()> {
    if a.len() != b.a_len() || out.len() != b.out_len() {
        bail!(
            "integer matrix-vector product: operand of {} and output of {} values, {} and {} expected",
            a.len(),
            out.len(),
            b.a_len(),
            b.out_len()
        );
    }
    if b.k > MAX_K {
        bail!(
            "integer matrix-vector product: reduction length {} exceeds {MAX_K}, the exact i32 bound",
            b.k
        );
    }
    Ok(())
}

/// [`gemv`] with an explicit kernel choice (tests compare the kernels).
pub fn gemv_with(isa: Isa, a: &[i16], b: &PackedI8, out: &mut [i32]) -> Result<()> {
    check_operands(a, b, out)?;
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512_vnni() && Isa::detect().has_avx512_vnni() {
        if let Some(qd) = &b.quads {
            let a = &a[..b.k];
            let (lo, hi) = a
                .iter()
                .fold((i16::MAX, i16::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            if a.is_empty() || (hi as i32 - lo as i32) <= 255 {
                let off = if a.is_empty() { 0 } else { -(lo as i32) };
                U8_ROW.with(|u| {
                    let mut u = u.borrow_mut();
                    u.clear();
                    u.extend(a.iter().map(|&v| (v as i32 + off) as u8));
                    u.resize(4 * qd.nq, 0);
                    // SAFETY: AVX-512 F/BW/VNNI are present (checked above); `u` holds
                    // 4 * nq bytes, `qd.data` panels * nq * NRQ * 4 and `qd.colsum`
                    // panels * NRQ (by construction); the kernel stores at most `out.len()`
                    // values.
                    unsafe { gemv_vnni(&u, qd, off, out) };
                });
                return Ok(());
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        if !Isa::detect().has_avx2() {
            bail!("integer matrix-vector product: AVX2 kernel requested on a CPU without avx2");
        }
        // SAFETY: AVX2 is present (checked above); the lengths of `a` (2 * pairs), `out`
        // (panels * NRV) and `b.data` (panels * pairs * 2 * NRV, by construction) are what
        // the kernel reads and writes.
        unsafe { gemv_avx2(a, b, out) };
        return Ok(());
    }
    let _ = isa;
    gemv_scalar(a, b, out);
    Ok(())
}

thread_local! {
    /// One step's `a` as unsigned bytes for [`gemv_vnni`] (reused: a step allocates nothing).
    static U8_ROW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Per panel of [`NRQ`] columns: one broadcast of four `u` bytes per quad, four `vpdpbusd`
/// into accumulators of sixteen columns, even and odd quads in separate accumulators (eight
/// independent chains); then `- off * colsum`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `u.len() == 4 * q.nq`,
/// `q.data.len() == q.panels * q.nq * NRQ * 4`, `q.colsum.len() == q.panels * NRQ`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn gemv_vnni(u: &[u8], q: &Quads, off: i32, out: &mut [i32]) {
    use std::arch::x86_64::*;
    assert!(
        u.len() == 4 * q.nq
            && q.data.len() == q.panels * q.nq * NRQ * 4
            && q.colsum.len() == q.panels * NRQ
    );
    let plen = q.nq * NRQ * 4;
    let up = u.as_ptr();
    let offv = _mm512_set1_epi32(off);
    for pn in 0..q.panels {
        let lo = pn * NRQ;
        if lo >= out.len() {
            break;
        }
        let wp = q.data[pn * plen..].as_ptr();
        let mut even = [_mm512_setzero_si512(); 4];
        let mut odd = [_mm512_setzero_si512(); 4];
        let mut qi = 0;
        // SAFETY (both loops): quad qi < nq, so u[4qi..4qi + 4] and this panel's 256 bytes
        // of quad qi lie inside the slices (asserted lengths); loads are unaligned.
        while qi + 1 < q.nq {
            unsafe {
                let a0 = _mm512_set1_epi32((up.add(4 * qi) as *const i32).read_unaligned());
                let a1 = _mm512_set1_epi32((up.add(4 * qi + 4) as *const i32).read_unaligned());
                let w0 = wp.add(qi * NRQ * 4);
                let w1 = w0.add(NRQ * 4);
                for j in 0..4 {
                    let b0 = _mm512_loadu_si512(w0.add(64 * j) as *const _);
                    let b1 = _mm512_loadu_si512(w1.add(64 * j) as *const _);
                    even[j] = _mm512_dpbusd_epi32(even[j], a0, b0);
                    odd[j] = _mm512_dpbusd_epi32(odd[j], a1, b1);
                }
            }
            qi += 2;
        }
        if qi < q.nq {
            unsafe {
                let a0 = _mm512_set1_epi32((up.add(4 * qi) as *const i32).read_unaligned());
                let w0 = wp.add(qi * NRQ * 4);
                for (j, e) in even.iter_mut().enumerate() {
                    *e =
                        _mm512_dpbusd_epi32(*e, a0, _mm512_loadu_si512(w0.add(64 * j) as *const _));
                }
            }
        }
        for j in 0..4 {
            let c = lo + 16 * j;
            if c >= out.len() {
                break;
            }
            let n = (out.len() - c).min(16);
            let mask: __mmask16 = if n == 16 {
                0xffff
            } else {
                (1u32 << n) as u16 - 1
            };
            // SAFETY: colsum holds panels * NRQ values, so the 16 at c are inside; the masked
            // store writes the n <= out.len() - c values from c.
            unsafe {
                let cs = _mm512_loadu_si512(q.colsum.as_ptr().add(c) as *const _);
                let v = _mm512_add_epi32(even[j], odd[j]);
                let v = _mm512_sub_epi32(v, _mm512_mullo_epi32(offv, cs));
                _mm512_mask_storeu_epi32(out.as_mut_ptr().add(c) as *mut _, mask, v);
            }
        }
    }
}

/// Scalar twin of [`gemv_avx2`] and [`gemv_vnni`].
fn gemv_scalar(a: &[i16], b: &PackedI8, out: &mut [i32]) {
    let plen = b.pairs * 2 * NRV;
    for (pn, o) in out.chunks_exact_mut(NRV).enumerate() {
        let mut acc = [0i32; NRV];
        let panel = &b.data[pn * plen..(pn + 1) * plen];
        for (p, w) in panel.chunks_exact(2 * NRV).enumerate() {
            let (a0, a1) = (a[2 * p] as i32, a[2 * p + 1] as i32);
            for (j, s) in acc.iter_mut().enumerate() {
                *s = s.wrapping_add(a0 * w[2 * j] as i32 + a1 * w[2 * j + 1] as i32);
            }
        }
        o.copy_from_slice(&acc);
    }
}

/// Per panel and row pair: one broadcast of the `a` pair, four 16-byte loads widened to i16
/// (`vpmovsxbw`), four `vpmaddwd` + `vpaddd` into four accumulators of eight columns.
///
/// # Safety
/// The CPU must support avx2; `a.len() == 2 * b.pairs`, `out.len() == b.panels * NRV` and
/// `b.data.len() == b.panels * b.pairs * 2 * NRV`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gemv_avx2(a: &[i16], b: &PackedI8, out: &mut [i32]) {
    use std::arch::x86_64::*;
    assert!(
        a.len() == 2 * b.pairs
            && out.len() == b.panels * NRV
            && b.data.len() == b.panels * b.pairs * 2 * NRV
    );
    let plen = b.pairs * 2 * NRV;
    let ap = a.as_ptr();
    for pn in 0..b.panels {
        let wp = b.data[pn * plen..].as_ptr();
        let mut acc = [_mm256_setzero_si256(); 4];
        for p in 0..b.pairs {
            // SAFETY: p < pairs, so a[2p..2p + 2] and this panel's 64 bytes of pair p lie
            // inside the slices (asserted lengths); all loads are unaligned.
            unsafe {
                let av = _mm256_set1_epi32((ap.add(2 * p) as *const i32).read_unaligned());
                let w = wp.add(p * 2 * NRV);
                for (q, s) in acc.iter_mut().enumerate() {
                    let wq = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.add(16 * q) as *const __m128i));
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(av, wq));
                }
            }
        }
        for (q, s) in acc.iter().enumerate() {
            // SAFETY: out holds panels * NRV values; this panel's 32 lie at pn * NRV.
            unsafe {
                _mm256_storeu_si256(out.as_mut_ptr().add(pn * NRV + 8 * q) as *mut __m256i, *s)
            };
        }
    }
}

/// Scalar twin of [`gemv_avx2_sat`]: onnxruntime's AVX2 u8 x s8 arithmetic. Per column and quad
/// of rows, the two pair sums `u0 b0 + u1 b1` and `u2 b2 + u3 b3` are each saturated to i16
/// (`vpmaddubsw`), then added in i32 (`vpmaddwd` with ones); then `- off * colsum`.
fn gemv_sat_scalar(u: &[u8], q: &Quads, off: i32, out: &mut [i32]) {
    let plen = q.nq * NRQ * 4;
    let sat = |v: i32| v.clamp(i16::MIN as i32, i16::MAX as i32);
    for (c, o) in out.iter_mut().enumerate() {
        let (pn, j) = (c / NRQ, c % NRQ);
        let panel = &q.data[pn * plen..(pn + 1) * plen];
        let mut acc = 0i32;
        for qi in 0..q.nq {
            let w = &panel[qi * NRQ * 4 + 4 * j..qi * NRQ * 4 + 4 * j + 4];
            let x = &u[4 * qi..4 * qi + 4];
            let p0 = sat(x[0] as i32 * w[0] as i32 + x[1] as i32 * w[1] as i32);
            let p1 = sat(x[2] as i32 * w[2] as i32 + x[3] as i32 * w[3] as i32);
            acc = acc.wrapping_add(p0 + p1);
        }
        *o = acc.wrapping_sub(off.wrapping_mul(q.colsum[c]));
    }
}

/// Per panel of [`NRQ`] columns and quad of rows: one broadcast of four `u` bytes, eight
/// 32-byte weight loads, eight `vpmaddubsw` (u8 x i8 pairs, saturating to i16) + `vpmaddwd`
/// with ones (the two pairs of each column into i32) + `vpaddd`: 32 multiply-adds per three
/// vector operations instead of six for the exact kernel's widening. Then `- off * colsum`.
///
/// # Safety
/// The CPU must support AVX2; `u.len() == 4 * q.nq`,
/// `q.data.len() == q.panels * q.nq * NRQ * 4`, `q.colsum.len() == q.panels * NRQ`,
/// `out.len() <= q.panels * NRQ`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gemv_avx2_sat(u: &[u8], q: &Quads, off: i32, out: &mut [i32]) {
    use std::arch::x86_64::*;
    assert!(
        u.len() == 4 * q.nq
            && q.data.len() == q.panels * q.nq * NRQ * 4
            && q.colsum.len() == q.panels * NRQ
            && out.len() <= q.panels * NRQ
    );
    let plen = q.nq * NRQ * 4;
    let up = u.as_ptr();
    let ones = _mm256_set1_epi16(1);
    let offv = _mm256_set1_epi32(off);
    let mut tmp = [0i32; 8];
    for pn in 0..q.panels {
        let lo = pn * NRQ;
        if lo >= out.len() {
            break;
        }
        let wp = q.data[pn * plen..].as_ptr();
        let mut acc = [_mm256_setzero_si256(); 8];
        for qi in 0..q.nq {
            // SAFETY: qi < nq, so u[4qi..4qi + 4] and this panel's 256 bytes of quad qi lie
            // inside the slices (asserted lengths); loads are unaligned.
            unsafe {
                let a = _mm256_set1_epi32((up.add(4 * qi) as *const i32).read_unaligned());
                let w = wp.add(qi * NRQ * 4);
                for (j, s) in acc.iter_mut().enumerate() {
                    let b = _mm256_loadu_si256(w.add(32 * j) as *const __m256i);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones);
                    *s = _mm256_add_epi32(*s, p);
                }
            }
        }
        for (j, s) in acc.iter().enumerate() {
            let c = lo + 8 * j;
            if c >= out.len() {
                break;
            }
            let n = (out.len() - c).min(8);
            // SAFETY: colsum holds panels * NRQ values, so the 8 at c are inside.
            let v = unsafe {
                let cs = _mm256_loadu_si256(q.colsum.as_ptr().add(c) as *const __m256i);
                _mm256_sub_epi32(*s, _mm256_mullo_epi32(offv, cs))
            };
            if n == 8 {
                // SAFETY: out holds c + 8 values here.
                unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(c) as *mut __m256i, v) };
            } else {
                // SAFETY: tmp holds 8 values.
                unsafe { _mm256_storeu_si256(tmp.as_mut_ptr() as *mut __m256i, v) };
                out[c..c + n].copy_from_slice(&tmp[..n]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The dispatched product equals the scalar twin and the plain definition, at sizes
        /// covering odd `k` and partial panels, with operands at the ends of their ranges.
        #[test]
        fn dispatched_equals_scalar_twin_and_definition(
            k in prop_oneof![1usize..70, 250usize..300],
            n in prop_oneof![1usize..80, 120usize..300],
            zp in prop_oneof![Just(None), (0i16..=255).prop_map(Some)],
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut rnd = || super::super::xorshift(&mut s);
            let w: Vec<i8> = (0..k * n).map(|_| rnd() as i8).collect();
            let b = PackedI8::pack(k, n, |r, c| w[r * n + c]);
            // A quantized state minus its zero point (what DynamicQuantizeLSTM passes: the
            // quads kernel's case), or anything in [-255, 255] (the pairs fallback).
            let mut a: Vec<i16> = (0..b.a_len())
                .map(|i| match zp {
                    Some(z) => if i % 7 == 0 { 255 - z } else { (rnd() % 256) as i16 - z },
                    None => if i % 7 == 0 { -255 } else { (rnd() % 511) as i16 - 255 },
                })
                .collect();
            a[k..].fill(0);
            let mut got = vec![7i32; b.out_len()];
            let mut twin = vec![0i32; b.out_len()];
            gemv(&a, &b, &mut got).unwrap();
            gemv_with(Isa::Scalar, &a, &b, &mut twin).unwrap();
            prop_assert_eq!(&got, &twin);
            // The AVX2 pairs kernel where the host runs the quads one.
            if Isa::detect().has_avx512_vnni() {
                let mut pairs = vec![7i32; b.out_len()];
                gemv_with(Isa::Avx2, &a, &b, &mut pairs).unwrap();
                prop_assert_eq!(&pairs, &twin);
            }
            for c in 0..b.out_len() {
                let want: i32 = if c < n {
                    (0..k).map(|r| a[r] as i32 * w[r * n + c] as i32).sum()
                } else {
                    0
                };
                prop_assert_eq!(got[c], want);
            }
        }
    }

    /// The saturating product's definition: per column and quad, each pair sum of `u = a - min(a)`
    /// clamped to i16, then `+ min(a) * Σ b`.
    fn saturating_definition(a: &[i16], k: usize, n: usize, w: &[i8], c: usize) -> i32 {
        if c >= n {
            return 0;
        }
        let lo = a[..k].iter().copied().min().unwrap_or(0) as i32;
        let (mut acc, mut sum) = (0i32, 0i32);
        for r in (0..k).step_by(2) {
            let t = |r: usize| {
                if r < k {
                    (a[r] as i32 - lo) * w[r * n + c] as i32
                } else {
                    0
                }
            };
            acc += (t(r) + t(r + 1)).clamp(-32768, 32767);
        }
        for r in 0..k {
            sum += w[r * n + c] as i32;
        }
        acc + lo * sum
    }

    proptest! {
        /// The saturating product's AVX2 kernel equals its scalar twin and the definition
        /// (saturation included) at every level the host has, and equals the exact product
        /// whenever no pair can saturate (|w| <= 64: 2 * 255 * 64 < 32768).
        #[test]
        fn saturating_kernels_equal_twin_and_definition(
            k in prop_oneof![1usize..70, 250usize..300],
            n in prop_oneof![1usize..80, 120usize..300],
            zp in 0i16..=255,
            small in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut rnd = || super::super::xorshift(&mut s);
            let w: Vec<i8> = (0..k * n)
                .map(|i| match (small, i % 5) {
                    (true, _) => (rnd() % 129) as i8 - 64,
                    (false, 0) => 127,
                    (false, 1) => -128,
                    _ => rnd() as i8,
                })
                .collect();
            let b = PackedI8::pack_with_quads(k, n, |r, c| w[r * n + c]);
            let mut a: Vec<i16> = (0..b.a_len())
                .map(|i| match i % 3 {
                    0 => 255 - zp,
                    1 => -zp,
                    _ => (rnd() % 256) as i16 - zp,
                })
                .collect();
            a[k..].fill(0);
            let mut twin = vec![7i32; b.out_len()];
            gemv_saturating_with(Isa::Scalar, &a, &b, &mut twin).unwrap();
            for (c, &v) in twin.iter().enumerate() {
                prop_assert_eq!(v, saturating_definition(&a, k, n, &w, c), "column {}", c);
            }
            for isa in Isa::ALL.into_iter().filter(|&l| l <= Isa::detect()) {
                let mut got = vec![7i32; b.out_len()];
                gemv_saturating_with(isa, &a, &b, &mut got).unwrap();
                prop_assert_eq!(&got, &twin, "{:?}", isa);
            }
            let mut fast = vec![7i32; b.out_len()];
            gemv_fast(&a, &b, &mut fast).unwrap();
            if small {
                let mut exact = vec![7i32; b.out_len()];
                gemv(&a, &b, &mut exact).unwrap();
                prop_assert_eq!(&twin, &exact);
                prop_assert_eq!(&fast, &exact);
            }
        }
    }

    proptest! {
        /// The codes entry gives [`gemv_fast`]'s values on `a = u - zp` at the host's level
        /// (run again at each lower level by the kernel re-run), with codes at both ends and
        /// extra codes past `k` ignored; weights packed as the recurrence packs them.
        #[test]
        fn codes_entry_equals_gemv_fast(
            k in prop_oneof![1usize..70, 250usize..300],
            n in prop_oneof![1usize..80, 120usize..300],
            zp in any::<u8>(),
            extra in 0usize..9,
            seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut rnd = || super::super::xorshift(&mut s);
            let w: Vec<i8> = (0..k * n).map(|_| rnd() as i8).collect();
            let b = PackedI8::pack(k, n, |r, c| w[r * n + c]);
            let u: Vec<u8> = (0..k + extra)
                .map(|i| match i % 5 {
                    0 => 255,
                    1 => 0,
                    _ => rnd() as u8,
                })
                .collect();
            let mut a: Vec<i16> = u[..k].iter().map(|&v| v as i16 - zp as i16).collect();
            a.resize(b.a_len(), 0);
            let mut want = vec![7i32; b.out_len()];
            gemv_fast(&a, &b, &mut want).unwrap();
            let (mut got, mut scratch) = (vec![5i32; b.out_len()], vec![3i16; 2]);
            gemv_codes_fast(&u, zp, &b, &mut got, &mut scratch).unwrap();
            prop_assert_eq!(&got, &want);
        }
    }

    /// Large codes against large weights of one sign saturate each pair at i16's ends, as
    /// onnxruntime's AVX2 kernel does; the exact product does not.
    #[test]
    fn saturation_clamps_each_pair() {
        let (k, n) = (8, 3);
        let w = [127i8, -128, 5];
        let b = PackedI8::pack_with_quads(k, n, |_, c| w[c]);
        // min(a) = 0 at row 0, so u = a; rows 0..2 form the first pair.
        let a: Vec<i16> = (0..b.a_len())
            .map(|r| if r == 0 { 0 } else { 255 })
            .collect();
        let mut got = vec![0i32; b.out_len()];
        gemv_saturating_with(Isa::Scalar, &a, &b, &mut got).unwrap();
        // Pairs: (0, 255) then three (255, 255).
        assert_eq!(got[0], 255 * 127 + 3 * 32767);
        assert_eq!(got[1], -(255 * 128) + 3 * -32768);
        assert_eq!(got[2], 7 * 255 * 5);
        let mut exact = vec![0i32; b.out_len()];
        gemv(&a, &b, &mut exact).unwrap();
        assert_eq!(exact[0], 7 * 255 * 127);
    }

    #[test]
    fn wrong_lengths_are_refused() {
        let b = PackedI8::pack(3, 5, |_, _| 1);
        let err = gemv(&[0; 3], &b, &mut [0; NRV]).unwrap_err();
        assert!(err.to_string().contains("operand of 3"), "{err}");
        let err = gemv_codes_fast(&[0; 2], 0, &b, &mut [0; NRV], &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("2 codes"), "{err}");
    }
}
