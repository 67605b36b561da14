//! Element-wise f32 maps (`Erf`, `Sigmoid`, `Div` by a constant, ...) compiled per ISA level.
//!
//! The op kernels write their float maps once as a closure. Called from ordinary code that
//! closure compiles for the baseline target (SSE2, 4 lanes); here the same loop is
//! instantiated inside `#[target_feature]` functions, so a branch-free closure vectorizes to
//! 16 lanes (AVX-512) or 8 (AVX2). The arithmetic is the closure's own, value by value, in the
//! same order (Rust does not contract `a * b + c` into an FMA), so every level gives the same
//! bits; the baseline loop is the scalar twin.

use npuc_isa::Isa;

/// `v[i] = f(v[i])`.
pub fn map_in_place<F: Fn(f32) -> f32>(v: &mut [f32], f: &F) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = Isa::detect();
        if isa.has_avx512() {
            // SAFETY: AVX-512 F/BW was detected on this CPU (capped by NPUC_ISA); the body
            // is safe Rust.
            return unsafe { in_place_avx512(v, f) };
        }
        if isa.has_avx2() {
            // SAFETY: AVX2 and FMA were detected on this CPU (capped by NPUC_ISA); safe body.
            return unsafe { in_place_avx2(v, f) };
        }
    }
    map_in_place_scalar(v, f)
}

/// `dst[i] = f(src[i])` over the shorter of the two.
pub fn map_into<F: Fn(f32) -> f32>(src: &[f32], dst: &mut [f32], f: &F) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = Isa::detect();
        if isa.has_avx512() {
            // SAFETY: as in `map_in_place`.
            return unsafe { into_avx512(src, dst, f) };
        }
        if isa.has_avx2() {
            // SAFETY: as in `map_in_place`.
            return unsafe { into_avx2(src, dst, f) };
        }
    }
    map_into_scalar(src, dst, f)
}

/// A body of plain Rust for [`vectorized`]. Its `run` must be `#[inline(always)]` (so must
/// whatever it calls that should share the level): a closure cannot be used instead, because
/// its body is a function of its own that LLVM does not inline when it is large, and it then
/// compiles for the baseline target. `run` should hand its slices to an `#[inline(always)]`
/// function as parameters: a `&mut` slice read from a struct field carries no no-alias
/// guarantee, so LLVM reloads every captured value after each store (a scalar operand's `Mul`
/// became a scalar loop, 5x slower), while a `&mut` parameter is no-alias.
pub trait LevelBody {
    type Output;
    fn run(self) -> Self::Output;
}

/// Runs `body` inside a `#[target_feature]` function of the CPU's level (capped by
/// `NPUC_ISA`), so the plain loops the body inlines (a recurrent cell's gate math, a rescaling
/// of integer sums) compile to 16 (AVX-512) or 8 (AVX2) lanes instead of the baseline's 4.
/// The arithmetic is the body's own, in its order (Rust does not contract `a * b + c` into an
/// FMA), so the result is the same as `body.run()`'s, the scalar twin, at every level. What
/// the body calls without inlining keeps its own compilation.
#[inline(always)]
pub fn vectorized<B: LevelBody>(body: B) -> B::Output {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = Isa::detect();
        if isa.has_avx512() {
            // SAFETY: AVX-512 F/BW was detected on this CPU (capped by NPUC_ISA); the body
            // is safe Rust.
            return unsafe { run_avx512(body) };
        }
        if isa.has_avx2() {
            // SAFETY: AVX2 and FMA were detected on this CPU (capped by NPUC_ISA); safe body.
            return unsafe { run_avx2(body) };
        }
    }
    body.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
unsafe fn run_avx512<B: LevelBody>(body: B) -> B::Output {
    body.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<B: LevelBody>(body: B) -> B::Output {
    body.run()
}

/// [`map_in_place`] for any element type (a binary op with one scalar operand), compiled at
/// the CPU's level through [`vectorized`].
pub fn map_in_place_any<T: Copy, F: Fn(T) -> T>(v: &mut [T], f: &F) {
    vectorized(MapInPlace { v, f })
}

struct MapInPlace<'a, T, F> {
    v: &'a mut [T],
    f: &'a F,
}

impl<T: Copy, F: Fn(T) -> T> LevelBody for MapInPlace<'_, T, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        map_in_place_scalar_any(self.v, self.f)
    }
}

#[inline(always)]
fn map_in_place_scalar_any<T: Copy, F: Fn(T) -> T>(v: &mut [T], f: &F) {
    for x in v {
        *x = f(*x);
    }
}

/// `v[i] = f(v[i], w[i])` over the shorter of the two, compiled at the CPU's level like
/// [`map_in_place`] (the binary element-wise ops' equal-shape case).
pub fn zip_in_place<T: Copy, F: Fn(T, T) -> T>(v: &mut [T], w: &[T], f: &F) {
    vectorized(ZipInPlace { v, w, f })
}

struct ZipInPlace<'a, T, F> {
    v: &'a mut [T],
    w: &'a [T],
    f: &'a F,
}

impl<T: Copy, F: Fn(T, T) -> T> LevelBody for ZipInPlace<'_, T, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        zip_in_place_scalar(self.v, self.w, self.f)
    }
}

#[inline(always)]
fn zip_in_place_scalar<T: Copy, F: Fn(T, T) -> T>(v: &mut [T], w: &[T], f: &F) {
    for (x, &y) in v.iter_mut().zip(w) {
        *x = f(*x, y);
    }
}

/// The scalar twin (baseline target) of [`map_in_place`].
#[inline(always)]
pub fn map_in_place_scalar<F: Fn(f32) -> f32>(v: &mut [f32], f: &F) {
    for x in v {
        *x = f(*x);
    }
}

/// Values per chunk of [`via_copy`]: 1 KiB on the stack, in L1 with its destination.
pub const VIA_COPY_CHUNK: usize = 256;

/// Runs `body(old, v)` over `v` in chunks, `old` a copy of the chunk's values that the
/// optimizer cannot see through: the in-place map becomes a map from one buffer into another.
///
/// Why: a map that keeps some values as they were (`if c { x } else { f(x) }`, a running max)
/// stores, in place, a select between the loaded value and a new one, and LLVM folds that
/// into a masked store of the new value (`vmaskmovps`) at the AVX2 level. On AMD Zen a
/// masked store is microcoded, about ten times a plain store: the text2tashkeel BiLSTM's
/// Tanh op (524288 values, AVX2, 1 thread) went from 0.45 to 0.35 ms through this alone. From
/// a copy the select's operand is no longer the stored-to memory, so it is a blend and a
/// store. The copy is an L1-resident memcpy of the chunk.
#[inline(always)]
pub fn via_copy(v: &mut [f32], mut body: impl FnMut(&[f32], &mut [f32])) {
    let mut buf = [0f32; VIA_COPY_CHUNK];
    for chunk in v.chunks_mut(VIA_COPY_CHUNK) {
        let old = &mut buf[..chunk.len()];
        old.copy_from_slice(chunk);
        body(std::hint::black_box(old), chunk);
    }
}

/// The scalar twin (baseline target) of [`map_into`].
#[inline(always)]
pub fn map_into_scalar<F: Fn(f32) -> f32>(src: &[f32], dst: &mut [f32], f: &F) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f(s);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
unsafe fn in_place_avx512<F: Fn(f32) -> f32>(v: &mut [f32], f: &F) {
    map_in_place_scalar(v, f)
}

/// At AVX2 through [`via_copy`], so closures that keep some values compile to blends, not
/// masked stores (the same operations, so the same bits as the twin).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn in_place_avx2<F: Fn(f32) -> f32>(v: &mut [f32], f: &F) {
    via_copy(v, |old, dst| map_into_scalar(old, dst, f))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
unsafe fn into_avx512<F: Fn(f32) -> f32>(src: &[f32], dst: &mut [f32], f: &F) {
    map_into_scalar(src, dst, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn into_avx2<F: Fn(f32) -> f32>(src: &[f32], dst: &mut [f32], f: &F) {
    map_into_scalar(src, dst, f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check<F: Fn(f32) -> f32>(x: &[f32], f: F) -> Result<(), TestCaseError> {
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (mut a, mut b) = (x.to_vec(), x.to_vec());
        map_in_place(&mut a, &f);
        map_in_place_scalar(&mut b, &f);
        prop_assert_eq!(bits(&a), bits(&b));
        let mut c = vec![0f32; x.len()];
        map_into(x, &mut c, &f);
        prop_assert_eq!(bits(&c), bits(&b));
        Ok(())
    }

    proptest! {
        /// The kinds of map the unary ops hand over: a rational erf (clamp, division), a
        /// logistic through `exp` (a call), and a plain polynomial; bit for bit.
        #[test]
        fn maps_match_scalar_twin(x in prop::collection::vec(prop_oneof![-50.0f32..50.0, Just(f32::NAN), Just(-0.0f32), Just(f32::INFINITY)], 0..100)) {
            check(&x, |x: f32| {
                let x = x.clamp(-4.0, 4.0);
                let x2 = x * x;
                x * (x2 * -2.7e-10 + 2.8e-8) / (x2 * -1.4e-5 + -2.1e-4)
            })?;
            check(&x, |x: f32| 1.0 / (1.0 + (-x).exp()))?;
            check(&x, |x: f32| x * x * 0.5 - x / 3.0 + 1.0)?;
        }
    }

    /// A recurrent step's kind of element-wise work, as a level body: integer sums rescaled,
    /// gate pre-activations summed with a peephole term, clipped, a cell update.
    struct CellLike<'a> {
        acc: &'a [i32],
        x: &'a [f32],
        c: &'a mut [f32],
        scale: f32,
    }

    impl LevelBody for CellLike<'_> {
        type Output = Vec<f32>;
        #[inline(always)]
        fn run(self) -> Vec<f32> {
            let n = self.c.len();
            let mut g: Vec<f32> = self.acc.iter().map(|&v| v as f32 * self.scale).collect();
            for ((g, &x), &c) in g.iter_mut().zip(self.x).zip(self.c.iter()) {
                *g = (*g + x + 0.25 * c).clamp(-3.0, 3.0);
            }
            for j in 0..n {
                let f = 1.0 / (1.0 + g[j].abs());
                self.c[j] = f * self.c[j] + (1.0 - f) * g[n + j];
            }
            g
        }
    }

    proptest! {
        /// [`vectorized`] at the host's level (and, through the kernel re-run, at each lower
        /// one) gives the bits of the body run directly.
        #[test]
        fn vectorized_body_matches_scalar_twin(
            v in prop::collection::vec((any::<i32>(), -8.0f32..8.0, -2.0f32..2.0), 1..300),
            scale in prop_oneof![Just(1e-6f32), 1e-9f32..1e-3],
        ) {
            let n = v.len();
            let acc: Vec<i32> = v.iter().chain(&v).map(|t| t.0).collect();
            let x: Vec<f32> = v.iter().chain(&v).map(|t| t.1).collect();
            let c0: Vec<f32> = v.iter().map(|t| t.2).collect();
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let (mut c1, mut c2) = (c0.clone(), c0);
            let g1 = vectorized(CellLike { acc: &acc, x: &x, c: &mut c1, scale });
            let g2 = CellLike { acc: &acc, x: &x, c: &mut c2, scale }.run();
            prop_assert_eq!(bits(&g1), bits(&g2));
            prop_assert_eq!(bits(&c1), bits(&c2));
            prop_assert_eq!(g1.len(), 2 * n);
        }
    }
}
