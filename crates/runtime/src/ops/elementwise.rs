//! Elementwise ops: numpy-broadcasting binary arithmetic, unary math, activations,
//! comparisons and logic, casts, Where/Clip and the variadic Sum/Mean/Max/Min.
//!
//! The core is [`Bcast`], a broadcast plan that merges adjacent dimensions so that kernels run
//! over long contiguous rows (inner stride 0 or 1), and [`binary_same`], which writes into the
//! buffer of an input it may take (same shape as the output, last reader) instead of allocating.

mod cast;
mod logic;
mod unary;

/// The vectorizable f32 `exp` shared by every kernel that needs one (softmax, sigmoid, ...).
pub use unary::{exp_consts, exp_f32, exp_finish};

pub use cast::cast_tensor;

use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::kernels::fmap;
use crate::ops::common::{broadcast_all, broadcast_strides};
use crate::value::Value;
use crate::{bail, dispatch_numeric};
use npuc_ir::{bf16, f16, numel, DType, Elem, Tensor};
use rayon::prelude::*;

/// Below this many elements a kernel runs on the calling thread: splitting costs more. (With
/// the session's workers kept awake a split costs a few microseconds; 64K values of a cheap
/// op are ~20 us.)
pub(crate) const PAR_MIN: usize = 1 << 16;
/// The same for kernels of a few nanoseconds per value (exp, tanh, erf: sigmoid, GELU).
pub(crate) const PAR_MIN_MATH: usize = 1 << 14;

/// A broadcast of several input shapes to one output shape. Output dimensions of size 1 are
/// dropped and adjacent dimensions merged wherever every input walks them contiguously (or
/// broadcasts both), so the innermost remaining dimension is as long as possible and every
/// input's stride along it is 0 (broadcast) or 1 (contiguous).
pub struct Bcast {
    /// The broadcast output shape (not merged).
    pub out_shape: Vec<usize>,
    dims: Vec<usize>,
    /// `strides[k][d]`: element stride of input `k` along merged dimension `d`.
    strides: Vec<Vec<usize>>,
}

impl Bcast {
    /// Plans the broadcast of `shapes`; fails when they are not broadcast-compatible.
    pub fn new(shapes: &[&[usize]]) -> Result<Bcast> {
        let out = broadcast_all(shapes)?;
        let full: Vec<Vec<usize>> = shapes.iter().map(|s| broadcast_strides(s, &out)).collect();
        let mut dims: Vec<usize> = Vec::with_capacity(out.len());
        let mut strides: Vec<Vec<usize>> = vec![Vec::with_capacity(out.len()); shapes.len()];
        for (d, &n) in out.iter().enumerate() {
            if n == 1 {
                continue;
            }
            // Merge with the previous kept dimension when, for every input, stepping the
            // previous dimension once equals stepping this one `n` times.
            let mergeable = !dims.is_empty()
                && full
                    .iter()
                    .zip(&strides)
                    .all(|(f, s)| s.last() == Some(&(f[d] * n)));
            if mergeable {
                if let Some(last) = dims.last_mut() {
                    *last *= n;
                }
                for (f, s) in full.iter().zip(strides.iter_mut()) {
                    if let Some(l) = s.last_mut() {
                        *l = f[d];
                    }
                }
            } else {
                dims.push(n);
                for (f, s) in full.iter().zip(strides.iter_mut()) {
                    s.push(f[d]);
                }
            }
        }
        if dims.is_empty() {
            dims.push(1);
            for s in strides.iter_mut() {
                s.push(0);
            }
        }
        Ok(Bcast {
            out_shape: out,
            dims,
            strides,
        })
    }

    /// Number of output elements.
    pub fn len(&self) -> usize {
        numel(&self.out_shape)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether input `k` gives every output row the same contiguous row (its first `inner`
    /// values): a per-channel constant over a channels-last tensor (`[1, 1, 1, C]` against
    /// `[1, H, W, C]`), whose rows are too short for the per-row walk of
    /// [`Bcast::for_each_row`] to pay.
    pub fn repeats_one_row(&self, k: usize) -> bool {
        let r = self.dims.len();
        let s = &self.strides[k];
        s[r - 1] == 1 && s[..r - 1].iter().all(|&v| v == 0)
    }

    /// Whether input `k` covers the output contiguously (its shape is the output's).
    pub fn is_contiguous(&self, k: usize) -> bool {
        let mut want = 1;
        for (&n, &st) in self.dims.iter().zip(&self.strides[k]).rev() {
            if st != want && n > 1 {
                return false;
            }
            want *= n;
        }
        true
    }

    /// Contiguous output rows and their length: the output is `rows x inner` values.
    pub fn rows_inner(&self) -> (usize, usize) {
        if self.is_empty() {
            return (0, 0);
        }
        let r = self.dims.len();
        (self.dims[..r - 1].iter().product(), self.dims[r - 1])
    }

    /// Calls `f(offsets, out_offset, len, inner_strides)` once per contiguous output row:
    /// `offsets[k]` is where input `k`'s row starts and `inner_strides[k]` is 0 or 1.
    pub fn for_each_row(&self, f: impl FnMut(&[usize], usize, usize, &[usize])) {
        let (rows, _) = self.rows_inner();
        self.for_each_row_in(0..rows, f);
    }

    /// [`Bcast::for_each_row`] over output rows `rows` only (threads take a range each).
    /// Inlined, so the loops of a caller compiled at the CPU's level include `f`'s.
    #[inline(always)]
    pub fn for_each_row_in(
        &self,
        rows: std::ops::Range<usize>,
        mut f: impl FnMut(&[usize], usize, usize, &[usize]),
    ) {
        if self.is_empty() || rows.is_empty() {
            return;
        }
        let r = self.dims.len();
        let inner = self.dims[r - 1];
        let inner_st: Vec<usize> = self.strides.iter().map(|s| s[r - 1]).collect();
        // The multi-index of row `rows.start` (last outer dimension fastest) and the inputs'
        // offsets there.
        let mut counter = vec![0usize; r - 1];
        let mut rest = rows.start;
        for d in (0..r - 1).rev() {
            counter[d] = rest % self.dims[d];
            rest /= self.dims[d];
        }
        let mut offs: Vec<usize> = self
            .strides
            .iter()
            .map(|s| counter.iter().zip(s).map(|(c, st)| c * st).sum())
            .collect();
        for row in rows {
            f(&offs, row * inner, inner, &inner_st);
            for d in (0..r - 1).rev() {
                counter[d] += 1;
                for (o, s) in offs.iter_mut().zip(&self.strides) {
                    *o += s[d];
                }
                if counter[d] < self.dims[d] {
                    break;
                }
                for (o, s) in offs.iter_mut().zip(&self.strides) {
                    *o -= s[d] * self.dims[d];
                }
                counter[d] = 0;
            }
        }
    }
}

/// `out[i] = f(a[..], b[..])` over a two-input broadcast plan.
pub fn binary_into<A: Copy, B: Copy, O>(
    plan: &Bcast,
    a: &[A],
    b: &[B],
    out: &mut [O],
    f: impl Fn(A, B) -> O,
) {
    let (rows, _) = plan.rows_inner();
    binary_rows(plan, 0..rows, a, b, out, f);
}

/// [`binary_into`] over the plan's output rows `rows` only, `out` holding just those rows;
/// compiled at the CPU's level ([`fmap::vectorized`]: the row loops run 16 or 8 lanes wide).
fn binary_rows<A: Copy, B: Copy, O>(
    plan: &Bcast,
    rows: std::ops::Range<usize>,
    a: &[A],
    b: &[B],
    out: &mut [O],
    f: impl Fn(A, B) -> O,
) {
    fmap::vectorized(BinaryRows {
        plan,
        rows,
        a,
        b,
        out,
        f,
    })
}

/// [`binary_rows`]'s operands as a [`fmap::LevelBody`].
struct BinaryRows<'a, A, B, O, F> {
    plan: &'a Bcast,
    rows: std::ops::Range<usize>,
    a: &'a [A],
    b: &'a [B],
    out: &'a mut [O],
    f: F,
}

impl<A: Copy, B: Copy, O, F: Fn(A, B) -> O> fmap::LevelBody for BinaryRows<'_, A, B, O, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        binary_rows_body(self.plan, self.rows, self.a, self.b, self.out, self.f)
    }
}

/// [`BinaryRows`]'s loops, the slices as (no-alias) parameters (see [`fmap::LevelBody`]).
#[inline(always)]
fn binary_rows_body<A: Copy, B: Copy, O>(
    plan: &Bcast,
    rows: std::ops::Range<usize>,
    a: &[A],
    b: &[B],
    out: &mut [O],
    f: impl Fn(A, B) -> O,
) {
    let inner = plan.rows_inner().1;
    let base = rows.start * inner;
    // One input the same short row for every output row, the other contiguous: plain loops.
    for (row_input, full) in [(1usize, 0usize), (0, 1)] {
        if inner == 0 || !plan.repeats_one_row(row_input) || !plan.is_contiguous(full) {
            continue;
        }
        let span = base..base + out.len();
        for (i, o) in out.chunks_exact_mut(inner).enumerate() {
            let at = span.start + i * inner;
            if row_input == 1 {
                for ((v, &x), &y) in o.iter_mut().zip(&a[at..at + inner]).zip(&b[..inner]) {
                    *v = f(x, y);
                }
            } else {
                for ((v, &x), &y) in o.iter_mut().zip(&a[..inner]).zip(&b[at..at + inner]) {
                    *v = f(x, y);
                }
            }
        }
        return;
    }
    plan.for_each_row_in(rows, |offs, oo, n, st| {
        binary_span(offs, st, 0, a, b, &mut out[oo - base..oo - base + n], &f);
    });
}

/// Broadcasting binary map with any input and output element types (always allocates).
pub fn binary_map<A: Elem, B: Elem, O: Elem>(
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(A, B) -> O,
) -> Result<Tensor> {
    let plan = Bcast::new(&[a.shape(), b.shape()])?;
    let (xa, xb) = (a.as_slice::<A>()?, b.as_slice::<B>()?);
    let out: Vec<O> = if a.shape() == b.shape() {
        let mut out = crate::buffers::take(xa.len());
        out.extend(xa.iter().zip(xb).map(|(&x, &y)| f(x, y)));
        out
    } else {
        // `binary_into` writes every output value.
        let mut out = crate::buffers::for_overwrite::<O>(plan.len());
        binary_into(&plan, xa, xb, &mut out, f);
        out
    };
    Ok(Tensor::from_vec(plan.out_shape, out)?)
}

/// Whether input `i` may be taken and overwritten: this node is its last reader (the only
/// reference) and its data is owned, not borrowed from a mapped file.
pub fn reusable(ins: &Inputs, i: usize) -> bool {
    match ins.value(i) {
        Some(Value::Tensor(t)) => std::sync::Arc::strong_count(t) == 1 && !t.is_borrowed(),
        _ => false,
    }
}

/// One stretch of a broadcast output row: `out[j] = f(a[ia + sa j], b[ib + sb j])`, with the
/// row's input offsets `offs` and inner strides `st` (0 or 1) as [`Bcast::for_each_row_in`]
/// gives them, starting `c0` values into the row.
#[inline(always)]
pub(crate) fn binary_span<A: Copy, B: Copy, O>(
    offs: &[usize],
    st: &[usize],
    c0: usize,
    a: &[A],
    b: &[B],
    out: &mut [O],
    f: impl Fn(A, B) -> O,
) {
    let n = out.len();
    let (ia, ib) = (offs[0] + st[0] * c0, offs[1] + st[1] * c0);
    match (st[0], st[1]) {
        (0, 0) => {
            let (x, y) = (a[ia], b[ib]);
            for v in out {
                *v = f(x, y);
            }
        }
        (0, _) => {
            let x = a[ia];
            for (v, &y) in out.iter_mut().zip(&b[ib..ib + n]) {
                *v = f(x, y);
            }
        }
        (_, 0) => {
            let y = b[ib];
            for (v, &x) in out.iter_mut().zip(&a[ia..ia + n]) {
                *v = f(x, y);
            }
        }
        _ => {
            for ((v, &x), &y) in out.iter_mut().zip(&a[ia..ia + n]).zip(&b[ib..ib + n]) {
                *v = f(x, y);
            }
        }
    }
}

/// `v[i] = f(v[i], y)` for a contiguous slice, split across threads when large.
fn apply_scalar<T: Copy + Send + Sync>(
    v: &mut [T],
    y: T,
    threads: usize,
    f: impl Fn(T, T) -> T + Sync,
) {
    if threads > 1 && v.len() >= PAR_MIN {
        let chunk = v.len().div_ceil(threads);
        v.par_chunks_mut(chunk)
            .for_each(|c| fmap::map_in_place_any(c, &|x| f(x, y)));
    } else {
        fmap::map_in_place_any(v, &|x| f(x, y));
    }
}

/// `v[i] = f(v[i], w[i])` over equal-length slices, split across threads when large.
fn apply_zip<T: Copy + Send + Sync>(
    v: &mut [T],
    w: &[T],
    threads: usize,
    f: impl Fn(T, T) -> T + Sync,
) {
    if threads > 1 && v.len() >= PAR_MIN {
        let chunk = v.len().div_ceil(threads);
        v.par_chunks_mut(chunk)
            .zip(w.par_chunks(chunk))
            .for_each(|(c, d)| fmap::zip_in_place(c, d, &f));
    } else {
        fmap::zip_in_place(v, w, &f);
    }
}

/// Broadcasting binary op whose inputs and output share the element type `T`. Writes in place
/// into input 0 or 1 when that input already has the output's shape and may be reused.
pub fn binary_same<T: Elem>(
    ins: &mut Inputs,
    threads: usize,
    f: impl Fn(T, T) -> T + Sync + Copy,
) -> Result<Tensor> {
    let (sa, sb) = (
        ins.tensor(0)?.shape().to_vec(),
        ins.tensor(1)?.shape().to_vec(),
    );
    let plan = Bcast::new(&[&sa, &sb])?;
    // In place into `a` (out = f(a, b)) or into `b` (out = f(a, b) with arguments kept in order).
    for (keep, other) in [(0usize, 1usize), (1, 0)] {
        let kshape = if keep == 0 { &sa } else { &sb };
        if *kshape != plan.out_shape || !reusable(ins, keep) {
            continue;
        }
        let mut t = ins.take_tensor(keep)?;
        let o = ins.tensor(other)?.as_slice::<T>()?;
        let v = t.as_mut_slice::<T>()?;
        let g = move |x: T, y: T| if keep == 0 { f(x, y) } else { f(y, x) };
        if o.len() == 1 {
            apply_scalar(v, o[0], threads, g);
        } else if o.len() == v.len() {
            apply_zip(v, o, threads, g);
        } else {
            // The kept input is contiguous over the output, so its inner stride is 1.
            let inner = plan.rows_inner().1;
            let repeat = inner > 0 && plan.repeats_one_row(other);
            let rows_of = |v: &mut [T], rows: std::ops::Range<usize>, base: usize| {
                if repeat {
                    // The same row of `other` for every output row (a channels-last scale).
                    let orow = &o[..inner];
                    for row in v.chunks_exact_mut(inner) {
                        for (x, &y) in row.iter_mut().zip(orow) {
                            *x = g(*x, y);
                        }
                    }
                    return;
                }
                plan.for_each_row_in(rows, |offs, oo, n, st| {
                    let row = &mut v[oo - base..oo - base + n];
                    let io = offs[other];
                    if st[other] == 0 {
                        let y = o[io];
                        for x in row {
                            *x = g(*x, y);
                        }
                    } else {
                        for (x, &y) in row.iter_mut().zip(&o[io..io + n]) {
                            *x = g(*x, y);
                        }
                    }
                })
            };
            let (rows, inner) = plan.rows_inner();
            if threads > 1 && v.len() >= PAR_MIN && rows >= threads && inner > 0 {
                // A channels-last scale (an SE block's `x * gate[C]`) is one short row per
                // pixel: split the rows.
                let per = rows.div_ceil(threads);
                v.par_chunks_mut(per * inner)
                    .enumerate()
                    .for_each(|(i, part)| {
                        let r0 = i * per;
                        rows_of(part, r0..r0 + part.len() / inner, r0 * inner)
                    });
            } else {
                rows_of(v, 0..rows, 0);
            }
        }
        return Ok(t);
    }
    let (a, b) = (ins.tensor(0)?, ins.tensor(1)?);
    let (xa, xb) = (a.as_slice::<T>()?, b.as_slice::<T>()?);
    if sa == sb && threads > 1 && xa.len() >= PAR_MIN {
        let mut out = crate::buffers::take(xa.len());
        out.extend_from_slice(xa);
        apply_zip(&mut out, xb, threads, f);
        return Ok(Tensor::from_vec(plan.out_shape, out)?);
    }
    let (rows, inner) = plan.rows_inner();
    if sa != sb && threads > 1 && plan.len() >= PAR_MIN && rows >= threads && inner > 0 {
        // A broadcast whose inputs are both still needed (an SE block's `x * gate` when `x`
        // also feeds the residual): rows split across threads into a fresh output.
        let mut out = crate::buffers::for_overwrite::<T>(plan.len());
        let per = rows.div_ceil(threads);
        out.par_chunks_mut(per * inner)
            .enumerate()
            .for_each(|(i, part)| {
                let r0 = i * per;
                binary_rows(&plan, r0..r0 + part.len() / inner, xa, xb, part, f)
            });
        return Ok(Tensor::from_vec(plan.out_shape, out)?);
    }
    binary_map(a, b, f)
}

/// Numeric element types with the arithmetic ONNX defines on them. Integer ops wrap like
/// numpy's fixed-width integers; division by zero gives 0 instead of trapping.
pub trait Arith: Elem + PartialOrd {
    fn add(a: Self, b: Self) -> Self;
    fn sub(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn div(a: Self, b: Self) -> Self;
    /// Remainder with the sign of the divisor (Python `%`; Mod with fmod=0).
    fn modulo(a: Self, b: Self) -> Self;
    /// Remainder with the sign of the dividend (C `fmod`; Mod with fmod=1).
    fn fmod(a: Self, b: Self) -> Self;
    /// NaN-propagating maximum and minimum (numpy `maximum`/`minimum`).
    fn max(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn abs(a: Self) -> Self;
    fn neg(a: Self) -> Self;
    fn sign(a: Self) -> Self;
    fn zero() -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    /// Exact integer power for integer types (exponent given in the same type).
    fn pow(a: Self, b: Self) -> Self;
}

macro_rules! arith_int {
    ($t:ty, signed) => {
        arith_int!(@impl $t,
            |a: $t| a.wrapping_abs(),
            |a: $t| a.wrapping_neg(),
            |a: $t| a.signum(),
            |a: $t, b: $t| {
                let r = a.wrapping_rem(b);
                if r != 0 && ((r < 0) != (b < 0)) { r.wrapping_add(b) } else { r }
            },
            |a: $t, b: $t| {
                if b >= 0 {
                    a.wrapping_pow(u32::try_from(b).unwrap_or(u32::MAX))
                } else if a == 1 {
                    1
                } else if a == -1 {
                    if b % 2 == 0 { 1 } else { -1 }
                } else {
                    0
                }
            });
    };
    ($t:ty, unsigned) => {
        arith_int!(@impl $t,
            |a: $t| a,
            |a: $t| a.wrapping_neg(),
            |a: $t| (a > 0) as $t,
            |a: $t, b: $t| a % b,
            |a: $t, b: $t| a.wrapping_pow(u32::try_from(b).unwrap_or(u32::MAX)));
    };
    (@impl $t:ty, $abs:expr, $neg:expr, $sign:expr, $modulo:expr, $pow:expr) => {
        impl Arith for $t {
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t { a.wrapping_add(b) }
            #[inline(always)]
            fn sub(a: $t, b: $t) -> $t { a.wrapping_sub(b) }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t { a.wrapping_mul(b) }
            #[inline(always)]
            fn div(a: $t, b: $t) -> $t { if b == 0 { 0 } else { a.wrapping_div(b) } }
            #[inline(always)]
            fn modulo(a: $t, b: $t) -> $t { if b == 0 { 0 } else { ($modulo)(a, b) } }
            #[inline(always)]
            fn fmod(a: $t, b: $t) -> $t { if b == 0 { 0 } else { a.wrapping_rem(b) } }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t { if a > b { a } else { b } }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t { if a < b { a } else { b } }
            #[inline(always)]
            fn abs(a: $t) -> $t { ($abs)(a) }
            #[inline(always)]
            fn neg(a: $t) -> $t { ($neg)(a) }
            #[inline(always)]
            fn sign(a: $t) -> $t { ($sign)(a) }
            #[inline(always)]
            fn zero() -> $t { 0 }
            #[inline(always)]
            fn to_f64(self) -> f64 { self as f64 }
            #[inline(always)]
            fn from_f64(v: f64) -> $t { v as $t }
            #[inline(always)]
            fn pow(a: $t, b: $t) -> $t { ($pow)(a, b) }
        }
    };
}

arith_int!(i8, signed);
arith_int!(i16, signed);
arith_int!(i32, signed);
arith_int!(i64, signed);
arith_int!(u8, unsigned);
arith_int!(u16, unsigned);
arith_int!(u32, unsigned);
arith_int!(u64, unsigned);

macro_rules! arith_float {
    ($t:ty, $w:ty, $to:expr, $from:expr) => {
        impl Arith for $t {
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                $from($to(a) + $to(b))
            }
            #[inline(always)]
            fn sub(a: $t, b: $t) -> $t {
                $from($to(a) - $to(b))
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                $from($to(a) * $to(b))
            }
            #[inline(always)]
            fn div(a: $t, b: $t) -> $t {
                $from($to(a) / $to(b))
            }
            #[inline(always)]
            fn modulo(a: $t, b: $t) -> $t {
                let (x, y): ($w, $w) = ($to(a), $to(b));
                let r = x % y;
                $from(if r != 0.0 && ((r < 0.0) != (y < 0.0)) {
                    r + y
                } else {
                    r
                })
            }
            #[inline(always)]
            fn fmod(a: $t, b: $t) -> $t {
                $from($to(a) % $to(b))
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                if a > b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                if a < b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
            #[inline(always)]
            fn abs(a: $t) -> $t {
                $from($to(a).abs())
            }
            #[inline(always)]
            fn neg(a: $t) -> $t {
                -a
            }
            #[inline(always)]
            fn sign(a: $t) -> $t {
                let x: $w = $to(a);
                $from(if x > 0.0 {
                    1.0
                } else if x < 0.0 {
                    -1.0
                } else {
                    x
                })
            }
            #[inline(always)]
            fn zero() -> $t {
                $from(0.0)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                $to(self) as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> $t {
                $from(v as $w)
            }
            #[inline(always)]
            fn pow(a: $t, b: $t) -> $t {
                $from($to(a).powf($to(b)))
            }
        }
    };
}

arith_float!(f32, f32, |x: f32| x, |x: f32| x);
arith_float!(f64, f64, |x: f64| x, |x: f64| x);
arith_float!(f16, f32, |x: f16| x.to_f32(), f16::from_f32);
arith_float!(bf16, f32, |x: bf16| x.to_f32(), bf16::from_f32);

/// Requires inputs `0..n` to share one dtype (type constraint `T` of most binary ops).
pub(crate) fn same_dtype(ins: &Inputs) -> Result<DType> {
    let ts = ins.tensors()?;
    let Some(first) = ts.first() else {
        bail!("expected at least one input")
    };
    let dt = first.dtype();
    for t in &ts[1..] {
        if t.dtype() != dt {
            bail!("inputs have different dtypes: {} and {}", dt, t.dtype());
        }
    }
    Ok(dt)
}

/// Before opset 7, binary ops broadcast only with `broadcast=1`, and an `axis` attribute
/// placed B's dimensions at that axis of A. Rewrites B's shape so numpy broadcasting gives
/// the same result.
fn legacy_broadcast(ctx: &OpCtx, ins: &mut Inputs) -> Result<()> {
    if ctx.opset >= 7 || ctx.node.int_or("broadcast", 0)? == 0 {
        return Ok(());
    }
    let Some(axis) = ctx.node.attr_int("axis")? else {
        return Ok(());
    };
    let ra = ins.tensor(0)?.rank();
    let sb = ins.tensor(1)?.shape().to_vec();
    let axis = crate::ops::common::norm_axis(axis, ra)?;
    if axis + sb.len() > ra {
        bail!("B of shape {sb:?} does not fit A's rank {ra} at axis {axis}");
    }
    let mut shape = vec![1; axis];
    shape.extend(&sb);
    shape.resize(ra, 1);
    let b = ins.take_tensor(1)?.reshaped(shape)?;
    let a = ins.take_value(0);
    *ins = Inputs::new(vec![a, Some(Value::tensor(b))]);
    Ok(())
}

macro_rules! arith_kernel {
    ($(#[$m:meta])* $name:ident, $method:ident) => {
        $(#[$m])*
        fn $name(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
            legacy_broadcast(ctx, &mut ins)?;
            let dt = same_dtype(&ins)?;
            let t = dispatch_numeric!(dt, T => binary_same::<T>(&mut ins, ctx.threads, <T as Arith>::$method)?);
            Ok(vec![Value::tensor(t)])
        }
    };
}

arith_kernel!(
    /// Add: `A + B` with numpy broadcasting.
    add, add
);
arith_kernel!(
    /// Sub: `A - B` with numpy broadcasting.
    sub, sub
);
arith_kernel!(
    /// Mul: `A * B` with numpy broadcasting.
    mul, mul
);
arith_kernel!(
    /// Div: `A / B`; integer division truncates toward zero.
    div, div
);

/// Mod: remainder; `fmod=1` takes the dividend's sign (C fmod), `fmod=0` the divisor's
/// (Python %). Like the reference, float inputs always use fmod and then map NaN to 0 and
/// infinities to the largest finite values when `fmod=0`.
fn modulo(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let fm = ctx.node.int_or("fmod", 0)?;
    let dt = same_dtype(&ins)?;
    let t = if dt.is_float() {
        dispatch_numeric!(dt, T => {
            let mut t = binary_same::<T>(&mut ins, ctx.threads, <T as Arith>::fmod)?;
            if fm != 1 {
                for v in t.as_mut_slice::<T>()? {
                    let x = v.to_f64();
                    if x.is_nan() {
                        *v = T::zero();
                    } else if x.is_infinite() {
                        // nan_to_num maps infinities to the type's largest finite values.
                        *v = T::from_f64(if x > 0.0 { float_max(dt) } else { -float_max(dt) });
                    }
                }
            }
            t
        })
    } else if fm == 1 {
        dispatch_numeric!(dt, T => binary_same::<T>(&mut ins, ctx.threads, <T as Arith>::fmod)?)
    } else {
        dispatch_numeric!(dt, T => binary_same::<T>(&mut ins, ctx.threads, <T as Arith>::modulo)?)
    };
    Ok(vec![Value::tensor(t)])
}

fn float_max(dt: DType) -> f64 {
    match dt {
        DType::F16 => f16::MAX.to_f64(),
        DType::BF16 => bf16::MAX.to_f64(),
        DType::F32 => f32::MAX as f64,
        _ => f64::MAX,
    }
}

/// Pow: `X ^ Y`, output typed like `X`. Same-dtype inputs compute in that type (exact integer
/// powers); mixed dtypes compute in f64 and convert to `X`'s type like numpy's `astype`.
fn pow(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let (da, db) = (ins.tensor(0)?.dtype(), ins.tensor(1)?.dtype());
    // x^2 with a scalar exponent (the variance in exporters' decomposed LayerNorm): one
    // multiply instead of a libm powf per element, as onnxruntime does; x * x is the correctly
    // rounded square. Other dtypes and exponents take the general path.
    if da == DType::F32 && db == DType::F32 {
        let e = ins.tensor(1)?;
        // A one-element exponent of rank <= the base's broadcasts to the base's shape.
        if e.len() == 1 && e.rank() <= ins.tensor(0)?.rank() && e.as_slice::<f32>()?[0] == 2.0 {
            let t = unary::unary_same::<f32>(&mut ins, ctx.threads, |x| x * x)?;
            return Ok(vec![Value::tensor(t)]);
        }
    }
    let t = if da == db {
        dispatch_numeric!(da, T => binary_same::<T>(&mut ins, ctx.threads, <T as Arith>::pow)?)
    } else {
        let a = ins.tensor(0)?;
        let b = ins.tensor(1)?;
        let bf = b.to_f64_vec()?;
        let bt = Tensor::from_vec(b.shape().to_vec(), bf)?;
        dispatch_numeric!(da, T => binary_map::<T, f64, T>(a, &bt, |x, y| {
            T::from_f64(x.to_f64().powf(y))
        })?)
    };
    Ok(vec![Value::tensor(t)])
}

/// Folds the variadic inputs of Sum/Max/Min/Mean pairwise with broadcasting.
fn variadic<T: Elem>(ins: &Inputs, f: impl Fn(T, T) -> T + Copy) -> Result<Tensor> {
    let ts = ins.tensors()?;
    let Some(first) = ts.first() else {
        bail!("expected at least one input")
    };
    let mut acc = (*first).clone();
    for t in &ts[1..] {
        acc = binary_map::<T, T, T>(&acc, t, f)?;
    }
    Ok(acc)
}

macro_rules! variadic_kernel {
    ($(#[$m:meta])* $name:ident, $method:ident) => {
        $(#[$m])*
        fn $name(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
            let dt = same_dtype(&ins)?;
            let t = if ins.len() == 2 {
                dispatch_numeric!(dt, T => binary_same::<T>(&mut ins, ctx.threads, <T as Arith>::$method)?)
            } else {
                dispatch_numeric!(dt, T => variadic::<T>(&ins, <T as Arith>::$method)?)
            };
            Ok(vec![Value::tensor(t)])
        }
    };
}

variadic_kernel!(
    /// Sum: elementwise sum of all inputs, broadcast together.
    sum, add
);
variadic_kernel!(
    /// Max: elementwise NaN-propagating maximum of all inputs, broadcast together.
    max, max
);
variadic_kernel!(
    /// Min: elementwise NaN-propagating minimum of all inputs, broadcast together.
    min, min
);

/// Mean: elementwise sum of all inputs divided by their count.
fn mean(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let dt = same_dtype(&ins)?;
    let n = ins.tensors()?.len();
    let t = dispatch_numeric!(dt, T => {
        let mut t = variadic::<T>(&ins, <T as Arith>::add)?;
        let div = T::from_f64(n as f64);
        for v in t.as_mut_slice::<T>()? {
            *v = T::div(*v, div);
        }
        t
    });
    Ok(vec![Value::tensor(t)])
}

/// Clip: `min(max(x, lo), hi)`; bounds are attributes before opset 11 and optional scalar
/// inputs from 11 on. When `lo > hi` every element becomes `hi`, as with numpy's `clip`.
fn clip(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let dt = ins.tensor(0)?.dtype();
    let bound = |i: usize, attr: &str| -> Result<Option<f64>> {
        if ctx.opset < 11 {
            return Ok(ctx.node.attr_float(attr)?.map(|v| v as f64));
        }
        match ins.opt_tensor(i) {
            None => Ok(None),
            Some(t) => {
                if t.len() != 1 {
                    bail!(
                        "Clip bound '{attr}' must be a scalar, got shape {:?}",
                        t.shape()
                    );
                }
                if t.dtype() != dt {
                    bail!(
                        "Clip bound '{attr}' has dtype {}, input has {}",
                        t.dtype(),
                        dt
                    );
                }
                Ok(t.to_f64_vec()?.first().copied())
            }
        }
    };
    let lo = bound(1, "min")?;
    let hi = bound(2, "max")?;
    let mut x = ins.take_tensor(0)?;
    dispatch_numeric!(dt, T => {
        // Bounds convert exactly: they are scalars of the input's own dtype (or f32 attrs).
        let lo = lo.map(T::from_f64);
        let hi = hi.map(T::from_f64);
        let v = x.as_mut_slice::<T>()?;
        if let Some(lo) = lo {
            for e in v.iter_mut() {
                if *e < lo {
                    *e = lo;
                }
            }
        }
        if let Some(hi) = hi {
            for e in v.iter_mut() {
                if *e > hi {
                    *e = hi;
                }
            }
        }
    });
    Ok(vec![Value::tensor(x)])
}

pub fn register(r: &mut Registry) {
    r.add("Add", 1, add);
    r.add("Sub", 1, sub);
    r.add("Mul", 1, mul);
    r.add("Div", 1, div);
    r.add("Mod", 10, modulo);
    r.add("Pow", 1, pow);
    r.add("Sum", 1, sum);
    r.add("Max", 1, max);
    r.add("Min", 1, min);
    r.add("Mean", 1, mean);
    r.add("Clip", 1, clip);
    unary::register(r);
    logic::register(r);
    cast::register(r);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(shapes: &[&[usize]]) -> Vec<(Vec<usize>, usize, usize, Vec<usize>)> {
        let p = Bcast::new(shapes).unwrap();
        let mut v = vec![];
        p.for_each_row(|o, oo, n, st| v.push((o.to_vec(), oo, n, st.to_vec())));
        v
    }

    /// A row repeated over every output row (either operand), a per-channel constant over a
    /// channels-last tensor, and a broadcast that is neither: `binary_map` equals the
    /// element-by-element definition (subtraction, so swapped operands would show).
    #[test]
    fn repeated_rows_match_the_definition() {
        let cases: [(&[usize], &[usize]); 4] = [
            (&[2, 3, 4], &[4]),
            (&[4], &[2, 3, 4]),
            (&[1, 3, 5, 16], &[1, 1, 1, 16]),
            (&[2, 3, 4], &[2, 1, 4]),
        ];
        for (sa, sb) in cases {
            let na: usize = sa.iter().product();
            let nb: usize = sb.iter().product();
            let a = Tensor::from_vec(
                sa.to_vec(),
                (0..na).map(|i| i as f32 * 1.5).collect::<Vec<_>>(),
            )
            .unwrap();
            let b = Tensor::from_vec(
                sb.to_vec(),
                (0..nb).map(|i| i as f32 * 0.25 - 3.0).collect::<Vec<_>>(),
            )
            .unwrap();
            let plan = Bcast::new(&[sa, sb]).unwrap();
            let got = binary_map(&a, &b, |x: f32, y: f32| x - y).unwrap();
            let out = plan.out_shape.clone();
            let (ea, eb) = (broadcast_strides(sa, &out), broadcast_strides(sb, &out));
            let (xa, xb) = (a.as_slice::<f32>().unwrap(), b.as_slice::<f32>().unwrap());
            let g = got.as_slice::<f32>().unwrap();
            assert_eq!(g.len(), plan.len());
            for (i, &v) in g.iter().enumerate() {
                // Multi-index of output element i, then each input's offset.
                let (mut rest, mut oa, mut ob) = (i, 0, 0);
                for d in (0..out.len()).rev() {
                    let c = rest % out[d];
                    rest /= out[d];
                    oa += c * ea[d];
                    ob += c * eb[d];
                }
                assert_eq!(v, xa[oa] - xb[ob], "{sa:?} - {sb:?} at {i}");
            }
        }
    }

    #[test]
    fn bcast_merges_contiguous_dims() {
        // Same shapes collapse to one row.
        assert_eq!(
            rows(&[&[2, 3, 4], &[2, 3, 4]]),
            vec![(vec![0, 0], 0, 24, vec![1, 1])]
        );
        // Per-channel bias over NCHW: rows of H*W with the bias broadcast.
        let r = rows(&[&[2, 3, 2, 2], &[3, 1, 1]]);
        assert_eq!(r.len(), 6);
        assert_eq!(r[4], (vec![16, 1], 16, 4, vec![1, 0]));
        // Scalar output.
        assert_eq!(rows(&[&[], &[1]]), vec![(vec![0, 0], 0, 1, vec![0, 0])]);
        // Empty output: no rows.
        assert!(rows(&[&[0, 3], &[3]]).is_empty());
    }

    #[test]
    fn binary_matches_naive_broadcast() {
        let a = Tensor::from_vec(vec![2, 1, 3], (0..6).map(|x| x as f32).collect()).unwrap();
        let b = Tensor::from_vec(vec![4, 1], (0..4).map(|x| 10.0 * x as f32).collect()).unwrap();
        let t = binary_map::<f32, f32, f32>(&a, &b, |x, y| x + y).unwrap();
        assert_eq!(t.shape(), &[2, 4, 3]);
        let v = t.as_slice::<f32>().unwrap();
        for i in 0..2 {
            for j in 0..4 {
                for k in 0..3 {
                    assert_eq!(v[i * 12 + j * 3 + k], (i * 3 + k) as f32 + 10.0 * j as f32);
                }
            }
        }
    }

    #[test]
    fn integer_semantics() {
        assert_eq!(<i32 as Arith>::div(-7, 2), -3);
        assert_eq!(<i32 as Arith>::div(7, 0), 0);
        assert_eq!(<i32 as Arith>::modulo(-7, 3), 2);
        assert_eq!(<i32 as Arith>::modulo(7, -3), -2);
        assert_eq!(<i32 as Arith>::fmod(-7, 3), -1);
        assert_eq!(<i64 as Arith>::pow(3, 4), 81);
        assert_eq!(<i64 as Arith>::pow(2, -1), 0);
        assert!(<f32 as Arith>::max(f32::NAN, 1.0).is_nan());
        assert!(<f32 as Arith>::max(1.0, f32::NAN).is_nan());
    }
}
