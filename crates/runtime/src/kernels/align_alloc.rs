//! A global allocator that gives every large allocation a cache-line (64-byte) aligned start.
//!
//! The runtime's tensors, scratch buffers and packed weights are plain `Vec`s, and glibc's
//! `malloc` returns 16-byte aligned blocks (a large block is a mapping plus a 16-byte header).
//! A 64-byte vector load at a 64-byte multiple of such a buffer then straddles two cache lines on
//! every access: the AVX-512 depthwise conv ran ~30% slower on a 16-byte offset input than on an
//! aligned one (PP-OCRv6 det's 80x80x64 5x5 conv: 0.68-0.75 ms vs 0.50 ms). A `Vec`'s own type
//! cannot ask for more alignment than its element's, so the alignment is raised where every
//! buffer comes from: the process's allocator. Binaries opt in with
//! `#[global_allocator] static A: npuc_runtime::kernels::align_alloc::CacheAligned = CacheAligned;`
//! (the `npuc` CLI and the Python module do).
//!
//! Allocations under [`MIN_SIZE`] bytes keep the requested layout (no memory cost for the many
//! small ones), and so do those of [`MAX_SIZE`] or more; the rest are made with at least
//! [`ALIGN`]. Deallocation and reallocation use
//! the same widened layout, so the system allocator always sees matching layouts.

use std::alloc::{GlobalAlloc, Layout, System};

/// Alignment given to large allocations: one cache line, one AVX-512 vector.
pub const ALIGN: usize = 64;
/// Allocations of at least this many bytes are aligned to [`ALIGN`].
pub const MIN_SIZE: usize = 1024;
/// ... and below this many: larger blocks keep the system allocator's own path, whose `calloc`
/// hands out untouched zero pages and whose `realloc` remaps in place. Aligned, a zeroed block
/// is written with zeros and a resized one copied: exporting a 2.5 GB model peaked at 4.66 GB
/// of resident memory instead of ~3.5 GB. Activations and packed weights of vision models are
/// well below it.
pub const MAX_SIZE: usize = 16 << 20;

/// The system allocator with large blocks aligned to [`ALIGN`] (see the module docs).
pub struct CacheAligned;

/// The layout the system allocator is asked for in place of `l`.
#[inline]
fn widen(l: Layout) -> Layout {
    if (MIN_SIZE..MAX_SIZE).contains(&l.size()) && l.align() < ALIGN {
        // A size that fit `l` fits a larger power-of-two alignment too unless it overflows
        // isize once rounded up, which `from_size_align` reports; keep `l` then.
        Layout::from_size_align(l.size(), ALIGN).unwrap_or(l)
    } else {
        l
    }
}

// SAFETY: every method forwards to `System` with the widened layout; a block is always freed
// or resized with the layout (`widen` of the caller's layout) it was allocated with, because
// `widen` is a pure function of the caller's layout, which the `GlobalAlloc` contract requires
// to be the allocation's.
unsafe impl GlobalAlloc for CacheAligned {
    #[inline]
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: `widen` keeps the size (non-zero per the caller's contract) and gives a valid
        // power-of-two alignment.
        unsafe { System.alloc(widen(l)) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(widen(l)) }
    }

    #[inline]
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` was allocated by this allocator with layout `l`, i.e. by `System` with
        // `widen(l)`.
        unsafe { System.dealloc(p, widen(l)) }
    }

    #[inline]
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let old = widen(l);
        // SAFETY: the caller guarantees `new_size`, rounded up to `l.align()`, does not overflow
        // isize, so this layout is valid.
        let new = widen(unsafe { Layout::from_size_align_unchecked(new_size, l.align()) });
        if old.align() == new.align() {
            // SAFETY: `p` came from `System` with `old`; the alignment is unchanged.
            return unsafe { System.realloc(p, old, new_size) };
        }
        // Crossing MIN_SIZE or MAX_SIZE changes the alignment, which `realloc` cannot: move
        // the block.
        // SAFETY: `new` is a valid non-zero layout (new_size > 0 per the caller's contract).
        let q = unsafe { System.alloc(new) };
        if !q.is_null() {
            // SAFETY: both blocks hold at least min(old size, new size) bytes and are distinct
            // allocations; `p` came from `System` with `old` and is freed once.
            unsafe {
                std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
                System.dealloc(p, old);
            }
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_are_cache_aligned_and_keep_their_bytes_through_resizes() {
        let a = CacheAligned;
        let small = Layout::from_size_align(100, 4).unwrap();
        let large = Layout::from_size_align(4096, 4).unwrap();
        // SAFETY: non-zero layouts; each block is written within its size and freed once with
        // the layout it has at that point.
        unsafe {
            let p = a.alloc(large);
            assert!(!p.is_null());
            assert_eq!(p as usize % ALIGN, 0);
            for i in 0..4096 {
                *p.add(i) = i as u8;
            }
            // Shrink below MIN_SIZE (alignment changes: the block moves), then grow back.
            let q = a.realloc(p, large, 100);
            assert!(!q.is_null());
            assert!((0..100).all(|i| *q.add(i) == i as u8));
            let r = a.realloc(q, small, 8192);
            assert!(!r.is_null());
            assert_eq!(r as usize % ALIGN, 0);
            assert!((0..100).all(|i| *r.add(i) == i as u8));
            let big = Layout::from_size_align(8192, 4).unwrap();
            let s = a.realloc(r, big, 1 << 20);
            assert_eq!(s as usize % ALIGN, 0);
            assert!((0..100).all(|i| *s.add(i) == i as u8));
            a.dealloc(s, Layout::from_size_align(1 << 20, 4).unwrap());
            let z = a.alloc_zeroed(large);
            assert_eq!(z as usize % ALIGN, 0);
            assert!((0..4096).all(|i| *z.add(i) == 0));
            a.dealloc(z, large);
        }
    }
}
