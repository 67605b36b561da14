//! Reuse of intermediate buffers across and within runs: the run-time side of the compile-time
//! memory plan.
//!
//! The compiler plans a liveness-based arena (each intermediate lives from the node that makes
//! it to its last reader). At run time the executor follows the same policy: it frees every
//! slot after its last reader. Instead of returning those buffers to the allocator, a freed
//! `f32` tensor that nobody else holds goes into the plan's [`Pool`], and kernels take their
//! output buffers from it ([`take`], [`zeroed`]). The pool therefore converges to the planned
//! arena: a set of buffers as large as the peak of live intermediates, kept by the plan and
//! reused by every later run, so that steady-state runs do not allocate them.
//!
//! The pool of the running plan is installed in a thread-local for the duration of a run (the
//! executor runs every node on one thread; kernels allocate their outputs on it), so kernels and
//! their helpers need no extra parameter, and code that runs outside a plan (tests, passes) just
//! allocates. Everything here is safe Rust: buffers change hands as `Vec`s.

use crate::value::Value;
use npuc_ir::{Tensor, TensorData};
use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::sync::{Arc, Mutex};

/// Buffers smaller than this many elements are not pooled: the allocator serves them fast.
const MIN_POOLED: usize = 256;
/// At most this many buffers are kept (the smallest go first when more come back).
const MAX_BUFFERS: usize = 4096;

/// Free buffers of one element type, sorted by capacity.
struct Shelf<T> {
    bufs: Vec<Vec<T>>,
}

impl<T> Default for Shelf<T> {
    fn default() -> Self {
        Shelf { bufs: Vec::new() }
    }
}

impl<T> Shelf<T> {
    fn bytes(&self) -> usize {
        self.bufs
            .iter()
            .map(|b| b.capacity() * std::mem::size_of::<T>())
            .sum()
    }

    /// The smallest buffer of capacity >= `len`, when it is not wastefully large (at most
    /// twice `len` plus a page), with the values it held (callers empty or overwrite them).
    fn take(&mut self, len: usize) -> Option<Vec<T>> {
        let i = self.bufs.partition_point(|b| b.capacity() < len);
        let b = self.bufs.get(i)?;
        if b.capacity() > len.saturating_mul(2) + 1024 {
            return None;
        }
        Some(self.bufs.remove(i))
    }

    fn give(&mut self, v: Vec<T>) {
        if v.capacity() < MIN_POOLED {
            return;
        }
        let i = self.bufs.partition_point(|b| b.capacity() < v.capacity());
        self.bufs.insert(i, v);
        if self.bufs.len() > MAX_BUFFERS {
            self.bufs.remove(0);
        }
    }
}

/// Free buffers by element type: `f32` (float graphs), the 8-bit types quantized graphs
/// pass between their integer kernels and the `i32` sums of their integer products.
#[derive(Default)]
pub struct Pool {
    f32s: Shelf<f32>,
    u8s: Shelf<u8>,
    i8s: Shelf<i8>,
    i32s: Shelf<i32>,
}

impl Pool {
    /// Number of buffers held.
    pub fn len(&self) -> usize {
        self.f32s.bufs.len() + self.u8s.bufs.len() + self.i8s.bufs.len() + self.i32s.bufs.len()
    }

    /// Whether the pool holds no buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.f32s.bytes() + self.u8s.bytes() + self.i8s.bytes() + self.i32s.bytes()
    }

    /// The shelf for element type `T`, when `T` is pooled.
    fn shelf<T: 'static>(&mut self) -> Option<&mut Shelf<T>> {
        let any: &mut dyn Any = if TypeId::of::<T>() == TypeId::of::<f32>() {
            &mut self.f32s
        } else if TypeId::of::<T>() == TypeId::of::<u8>() {
            &mut self.u8s
        } else if TypeId::of::<T>() == TypeId::of::<i8>() {
            &mut self.i8s
        } else if TypeId::of::<T>() == TypeId::of::<i32>() {
            &mut self.i32s
        } else {
            return None;
        };
        any.downcast_mut::<Shelf<T>>()
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Pool>> = const { RefCell::new(None) };
}

/// Installs a plan's pool on this thread for the duration of a run; gives it back to the plan
/// (and restores whatever pool was installed before, for nested subgraph runs) when dropped,
/// on success and on error alike.
pub(crate) struct PoolGuard<'a> {
    home: Option<&'a Mutex<Pool>>,
    prev: Option<Pool>,
}

impl<'a> PoolGuard<'a> {
    /// Takes the pool out of `home` and installs it. When another run of the same plan holds
    /// it (concurrent runs on several threads), this run allocates as usual.
    /// With `enabled` false nothing is pooled (every buffer is a fresh allocation).
    pub(crate) fn install(home: &'a Mutex<Pool>, enabled: bool) -> PoolGuard<'a> {
        let (home, pool) = match home.try_lock() {
            Ok(mut g) if enabled => (Some(home), Some(std::mem::take(&mut *g))),
            _ => (None, None),
        };
        let prev = CURRENT.with(|c| c.replace(pool));
        PoolGuard { home, prev }
    }
}

impl Drop for PoolGuard<'_> {
    fn drop(&mut self) {
        let mine = CURRENT.with(|c| c.replace(self.prev.take()));
        if let (Some(home), Some(pool)) = (self.home, mine) {
            *home.lock().unwrap_or_else(|e| e.into_inner()) = pool;
        }
    }
}

/// An empty `Vec<T>` with capacity for at least `len` elements: a buffer from the running
/// plan's pool when one fits (`f32`, `u8`, `i8` and `i32` are pooled), otherwise a fresh allocation.
/// Kernels use it for output buffers they fill by `push`/`extend`.
pub fn take<T: 'static>(len: usize) -> Vec<T> {
    let mut v = pooled::<T>(len).unwrap_or_else(|| Vec::with_capacity(len));
    v.clear();
    v
}

/// A pooled buffer of capacity >= `len` with the values it last held, if the running plan's
/// pool has one.
fn pooled<T: 'static>(len: usize) -> Option<Vec<T>> {
    if len < MIN_POOLED {
        return None;
    }
    // `try_with`: during thread teardown there is no pool, only the allocator.
    CURRENT
        .try_with(|c| {
            c.try_borrow_mut()
                .ok()
                .and_then(|mut p| p.as_mut()?.shelf::<T>()?.take(len))
        })
        .ok()
        .flatten()
}

/// A `Vec<T>` of `len` values with unspecified contents (what a pooled buffer last held, or
/// zeros), from the pool like [`take`]. For output buffers a kernel overwrites entirely:
/// zeroing them first cost a memory pass per output (5% of a conv-heavy run). Safe: every
/// value is an initialized `T`, only stale.
pub fn for_overwrite<T: Copy + Default + 'static>(len: usize) -> Vec<T> {
    let mut v = pooled::<T>(len).unwrap_or_default();
    if v.len() >= len {
        v.truncate(len);
    } else {
        v.resize(len, T::default());
    }
    v
}

/// A `Vec<T>` of `len` default (zero) values, from the pool like [`take`]. Kernels use it
/// for output buffers they write by index.
pub fn zeroed<T: Copy + Default + 'static>(len: usize) -> Vec<T> {
    let mut v = take::<T>(len);
    v.resize(len, T::default());
    v
}

/// A `Vec<T>` of `len` copies of `value`, from the pool like [`take`]. Kernels use it for
/// output buffers they write by index.
pub fn filled<T: Clone + 'static>(len: usize, value: T) -> Vec<T> {
    let mut v = take::<T>(len);
    v.resize(len, value);
    v
}

/// Gives a kernel's scratch buffer back to the running plan's pool (pooled element types
/// only; others are dropped), so the next node or run reuses it.
pub fn release<T: 'static>(v: Vec<T>) {
    if v.capacity() < MIN_POOLED {
        return;
    }
    let _ = CURRENT.try_with(|c| {
        if let Ok(mut p) = c.try_borrow_mut() {
            if let Some(shelf) = p.as_mut().and_then(|p| p.shelf::<T>()) {
                shelf.give(v);
            }
        }
    });
}

/// A copy of `t` whose data the caller owns; `f32` data goes into a pooled buffer.
pub fn copy_tensor(t: &Tensor) -> Tensor {
    if let Ok(s) = t.as_slice::<f32>() {
        let mut v = take::<f32>(s.len());
        v.extend_from_slice(s);
        if let Ok(c) = Tensor::from_vec(t.shape().to_vec(), v) {
            return c;
        }
    }
    t.clone()
}

/// Returns the buffer of a value nobody else holds to the running plan's pool (owned `f32`,
/// `u8` and `i8` tensors; borrowed weights, shared values and other types are just dropped).
pub(crate) fn recycle(v: Value) {
    let Value::Tensor(t) = v else { return };
    let Ok(t) = Arc::try_unwrap(t) else { return };
    match t.data() {
        TensorData::F32(_) => recycle_as::<f32>(t),
        TensorData::U8(_) => recycle_as::<u8>(t),
        TensorData::I8(_) => recycle_as::<i8>(t),
        TensorData::I32(_) => recycle_as::<i32>(t),
        _ => {}
    }
}

fn recycle_as<T: npuc_ir::Elem + 'static>(t: Tensor) {
    if let Ok(v) = t.into_vec::<T>() {
        release(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_outside_a_run_allocates() {
        let v = take::<f32>(1000);
        assert!(v.capacity() >= 1000 && v.is_empty());
        let z = zeroed::<i64>(10);
        assert_eq!(z, vec![0i64; 10]);
    }

    #[test]
    fn buffers_for_overwrite_reuse_pooled_ones() {
        let home = Mutex::new(Pool::default());
        let _g = PoolGuard::install(&home, true);
        let v = vec![2f32; 4096];
        let ptr = v.as_ptr();
        release(v);
        // Same buffer, length as asked; a longer request than its last length pads with zeros.
        let w = for_overwrite::<f32>(3000);
        assert_eq!((w.as_ptr(), w.len()), (ptr, 3000));
        release(w);
        let w = for_overwrite::<f32>(4000);
        assert_eq!(w.len(), 4000);
        assert!(w[..3000].iter().all(|&x| x == 2.0) && w[3000..].iter().all(|&x| x == 0.0));
        // `take` and `zeroed` still hand out empty and zeroed buffers.
        release(w);
        assert!(take::<f32>(4000).is_empty());
        assert_eq!(for_overwrite::<f32>(10), vec![0f32; 10]);
    }

    #[test]
    fn pooled_buffers_are_reused_and_restored() {
        let home = Mutex::new(Pool::default());
        let ptr;
        {
            let _g = PoolGuard::install(&home, true);
            let v = zeroed::<f32>(4096);
            ptr = v.as_ptr();
            recycle(Value::tensor(Tensor::from_vec(vec![4096], v).unwrap()));
            // A smaller request fits the same buffer; a much smaller one does not.
            assert!(take::<f32>(100).capacity() < 4096);
            let again = zeroed::<f32>(3000);
            assert_eq!(again.as_ptr(), ptr);
            assert!(again.iter().all(|&x| x == 0.0));
            recycle(Value::tensor(Tensor::from_vec(vec![3000], again).unwrap()));
            // A shared value is not recycled.
            let shared = Value::tensor(Tensor::from_vec(vec![2048], vec![1f32; 2048]).unwrap());
            recycle(shared.clone());
            assert!(shared.as_tensor().unwrap().as_slice::<f32>().unwrap()[0] == 1.0);
        }
        // The guard gave the pool back to its plan.
        let p = home.lock().unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p.f32s.bufs[0].as_ptr(), ptr);
        drop(p);
        // Nested installs restore the outer pool.
        let inner = Mutex::new(Pool::default());
        let _g = PoolGuard::install(&home, true);
        {
            let _h = PoolGuard::install(&inner, true);
            let other = take::<f32>(4096);
            assert!(other.as_ptr() != ptr);
        }
        let again = take::<f32>(4096);
        assert_eq!(again.as_ptr(), ptr);
    }
}
