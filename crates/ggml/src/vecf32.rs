//! f32 vector kernels for attention over a KV cache: f16 row conversion, dot products of many
//! rows with one query, and probability-weighted sums of value rows. Each dispatches once per
//! call to the AVX2+FMA+F16C twin in `x86.rs` when the CPU has it (and `NPUC_ISA` allows it);
//! the scalar versions here are the references the proptests compare bit for bit.

/// f16 bits to f32, `dst[i] = f32(src[i])` (exact).
pub fn f16_to_f32_row(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        return crate::x86::f16_to_f32_row(src, dst);
    }
    f16_to_f32_row_scalar(src, dst)
}

/// Scalar twin of [`f16_to_f32_row`].
pub fn f16_to_f32_row_scalar(src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_bits(s).to_f32();
    }
}

/// Rounds every value to the nearest f16 (ties to even) and back: what storing into an f16
/// KV cache does.
pub fn round_f16_row(src: &[f32], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        return crate::x86::round_f16_row(src, dst);
    }
    round_f16_row_scalar(src, dst)
}

/// Scalar twin of [`round_f16_row`].
pub fn round_f16_row_scalar(src: &[f32], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(s).to_f32();
    }
}

/// `out[t] = rows[t] · q` for the `out.len()` rows of `q.len()` values in `rows`: per row
/// eight FMA lanes over 8-value steps, reduced ((0+4)+(2+6))+((1+5)+(3+7)), the tail added
/// with plain multiply-adds.
pub fn dot_rows(rows: &[f32], q: &[f32], out: &mut [f32]) {
    assert!(
        rows.len() >= out.len() * q.len(),
        "dot_rows: rows too short"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        return crate::x86::dot_rows(rows, q, out);
    }
    dot_rows_scalar(rows, q, out)
}

/// Scalar twin of [`dot_rows`].
pub fn dot_rows_scalar(rows: &[f32], q: &[f32], out: &mut [f32]) {
    let d = q.len();
    for (t, o) in out.iter_mut().enumerate() {
        let r = &rows[t * d..(t + 1) * d];
        let mut acc = [0f32; 8];
        let full = d / 8 * 8;
        for (a, b) in r[..full].chunks_exact(8).zip(q[..full].chunks_exact(8)) {
            for l in 0..8 {
                acc[l] = a[l].mul_add(b[l], acc[l]);
            }
        }
        let mut s = crate::dot::hsum8(&acc);
        for i in full..d {
            s += r[i] * q[i];
        }
        *o = s;
    }
}

/// `out[j] = Σ_t p[t] · rows[t][j]` over the `p.len()` rows of `out.len()` values, accumulated
/// with one FMA per term in row order (the previous contents of `out` are overwritten).
pub fn weighted_sum(p: &[f32], rows: &[f32], out: &mut [f32]) {
    assert!(
        rows.len() >= p.len() * out.len(),
        "weighted_sum: rows too short"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        return crate::x86::weighted_sum(p, rows, out);
    }
    weighted_sum_scalar(p, rows, out)
}

/// Scalar twin of [`weighted_sum`].
pub fn weighted_sum_scalar(p: &[f32], rows: &[f32], out: &mut [f32]) {
    let d = out.len();
    for (j, o) in out.iter_mut().enumerate() {
        let mut acc = 0f32;
        for (t, &w) in p.iter().enumerate() {
            acc = w.mul_add(rows[t * d + j], acc);
        }
        *o = acc;
    }
}
