//! Histogram counting for calibration observers: `counts[bin(x)] += 1` over a batch of values.
//!
//! One scattered increment per value is the cost of a histogram observer. Two things make it
//! slow done plainly: the float-to-index conversion (a saturating `as` cast compiles to scalar
//! compares per value) and the increment chain (a peaked distribution sends consecutive values
//! to the same bin, so each increment waits for the previous one's store). Here the indices of
//! 64 values are computed at a time by a branch-free loop compiled per ISA level, and the
//! increments go round-robin to four sub-histograms that are summed at the end.

use npuc_isa::Isa;

/// Values per index block.
const BLOCK: usize = 64;
/// Values counted into the u32 sub-histograms before they are folded into `counts`.
const FOLD_EVERY: usize = 1 << 30;

/// `counts[clamp(trunc((x + offset) * scale), 0, counts.len() - 1)] += 1` for every `x`
/// (NaN counts in bin 0). Same counts at every ISA level as [`count_bins_scalar`].
pub fn count_bins(xs: &[f32], offset: f32, scale: f32, counts: &mut [u64]) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = Isa::detect();
        if isa.has_avx512() {
            // SAFETY: AVX-512 F/BW was detected on this CPU (capped by NPUC_ISA); the body
            // is the safe-Rust `count_bins_with` (its one unsafe block has its own contract).
            return unsafe { count_avx512(xs, offset, scale, counts) };
        }
        if isa.has_avx2() {
            // SAFETY: AVX2 was detected on this CPU (capped by NPUC_ISA); same body.
            return unsafe { count_avx2(xs, offset, scale, counts) };
        }
    }
    count_bins_scalar(xs, offset, scale, counts)
}

/// The scalar twin (baseline target) of [`count_bins`].
pub fn count_bins_scalar(xs: &[f32], offset: f32, scale: f32, counts: &mut [u64]) {
    count_bins_with(xs, offset, scale, counts)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn count_avx512(xs: &[f32], offset: f32, scale: f32, counts: &mut [u64]) {
    count_bins_with(xs, offset, scale, counts)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn count_avx2(xs: &[f32], offset: f32, scale: f32, counts: &mut [u64]) {
    count_bins_with(xs, offset, scale, counts)
}

#[inline(always)]
fn count_bins_with(xs: &[f32], offset: f32, scale: f32, counts: &mut [u64]) {
    let n = counts.len();
    if n == 0 || xs.is_empty() {
        return;
    }
    let top = (n - 1) as f32;
    let mut sub = vec![0u32; 4 * n];
    let mut idx = [0u32; BLOCK];
    for part in xs.chunks(FOLD_EVERY) {
        for block in part.chunks(BLOCK) {
            for (d, &x) in idx.iter_mut().zip(block) {
                // `max` maps NaN to 0, so `t` is finite and within [0, n - 1].
                let t = ((x + offset) * scale).max(0.0).min(top);
                // SAFETY: `t` is finite, non-negative and at most `n - 1` < 2^32 (a slice
                // length of u64 counts), so it truncates to a representable u32.
                *d = unsafe { t.to_int_unchecked::<u32>() };
            }
            let idx = &idx[..block.len()];
            let mut quads = idx.chunks_exact(4);
            for q in &mut quads {
                sub[q[0] as usize] += 1;
                sub[n + q[1] as usize] += 1;
                sub[2 * n + q[2] as usize] += 1;
                sub[3 * n + q[3] as usize] += 1;
            }
            for &i in quads.remainder() {
                sub[i as usize] += 1;
            }
        }
        for (i, c) in counts.iter_mut().enumerate() {
            *c += (sub[i] + sub[n + i] + sub[2 * n + i] + sub[3 * n + i]) as u64;
        }
        sub.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition: one value at a time, the saturating cast.
    fn reference(xs: &[f32], offset: f32, scale: f32, n: usize) -> Vec<u64> {
        let mut c = vec![0u64; n];
        for &x in xs {
            let i = ((x + offset) * scale) as usize;
            c[i.min(n - 1)] += 1;
        }
        c
    }

    proptest! {
        #[test]
        fn counts_match_definition(
            xs in prop::collection::vec(prop_oneof![-3.0f32..3.0, Just(0.0f32), Just(2.0f32), Just(f32::NAN), Just(-1e30f32), Just(1e30f32)], 0..300),
            n in 1usize..600,
            r in 0.5f32..4.0,
        ) {
            let scale = n as f32 / (2.0 * r);
            let want = reference(&xs, r, scale, n);
            let mut got = vec![0u64; n];
            count_bins(&xs, r, scale, &mut got);
            prop_assert_eq!(&got, &want);
            let mut twin = vec![0u64; n];
            count_bins_scalar(&xs, r, scale, &mut twin);
            prop_assert_eq!(&twin, &want);
        }
    }
}
