//! A small thread pool for the matrix products of one token step: its workers spin briefly on an
//! atomic between jobs (a product every few tens of microseconds while decoding), then yield, then
//! park, so a job starts in well under a microsecond when they are warm instead of the tens of
//! microseconds a sleeping pool needs to wake (on two vCPUs that overhead alone would eat the
//! second thread's gain). The caller runs tasks too; tasks are claimed one at a time.
//!
//! Protocol: a job is published under a mutex with a new epoch; the claim counter holds
//! `(epoch << 32) | next task`, so a worker that read an old job can never claim a task of a
//! newer one; the poster returns only after every task of its job ran, so the borrowed task
//! function outlives every call of it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it starts yielding, and yields before it parks.
const SPIN: Duration = Duration::from_micros(300);
const YIELD: Duration = Duration::from_millis(5);

type Task<'a> = &'a (dyn Fn(usize) + Sync);

#[derive(Clone, Copy)]
struct Job {
    /// The task function, lifetime erased: only called for a task claimed under `epoch`, and
    /// the poster waits for all of those.
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    /// Workers with an index below this take part.
    workers: usize,
    epoch: u32,
}

// SAFETY: the pointer is only dereferenced for a task claimed in its own epoch (see the module
// docs), while the posting thread keeps the function alive.
unsafe impl Send for Job {}

struct Shared {
    job: Mutex<Job>,
    epoch: AtomicU64,
    /// `(epoch << 32) | next task index`.
    claim: AtomicU64,
    done: AtomicUsize,
    sleeping: Mutex<Vec<Thread>>,
    parked: AtomicUsize,
    busy: AtomicBool,
}

/// The process-wide pool: `available_parallelism() - 1` workers, started on first use.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    workers: usize,
}

static POOL: OnceLock<Pool> = OnceLock::new();

fn noop(_: usize) {}

pub(crate) fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get()) - 1;
        let shared = Arc::new(Shared {
            job: Mutex::new(Job {
                f: &noop as &(dyn Fn(usize) + Sync),
                tasks: 0,
                workers: 0,
                epoch: 0,
            }),
            epoch: AtomicU64::new(0),
            claim: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            sleeping: Mutex::new(Vec::new()),
            parked: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
        });
        let mut started = 0;
        for w in 0..n {
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("npuc-ggml-{w}"))
                .spawn(move || worker(&s, w));
            if spawned.is_ok() {
                started += 1;
            }
        }
        Pool {
            shared,
            workers: started,
        }
    })
}

/// Claims and runs tasks of `job` until none is left (or a newer job replaced it).
fn run_tasks(s: &Shared, job: Job) {
    let tag = (job.epoch as u64) << 32;
    let mut cur = s.claim.load(Ordering::Acquire);
    loop {
        if cur & !0xffff_ffff != tag || (cur & 0xffff_ffff) as usize >= job.tasks {
            return;
        }
        match s
            .claim
            .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: task `cur` of this epoch was claimed, so its job is not finished and
                // the poster is still waiting, keeping the function alive.
                let f = unsafe { &*job.f };
                f((cur & 0xffff_ffff) as usize);
                s.done.fetch_add(1, Ordering::AcqRel);
                cur = s.claim.load(Ordering::Acquire);
            }
            Err(now) => cur = now,
        }
    }
}

fn worker(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let idle = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen {
            spins = spins.wrapping_add(1);
            // The clock is read once per 256 spins (reading it costs more than a spin).
            if !spins.is_multiple_of(256) {
                std::hint::spin_loop();
                continue;
            }
            let waited = idle.elapsed();
            if waited < SPIN {
                std::hint::spin_loop();
            } else if waited < YIELD {
                std::thread::yield_now();
            } else {
                if let Ok(mut v) = s.sleeping.lock() {
                    v.push(std::thread::current());
                }
                s.parked.fetch_add(1, Ordering::AcqRel);
                // Re-checked after registering, so a job posted in between is not slept through.
                if s.epoch.load(Ordering::Acquire) == seen {
                    std::thread::park_timeout(Duration::from_millis(50));
                }
                s.parked.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let job = match s.job.lock() {
            Ok(j) => *j,
            Err(_) => return,
        };
        seen = job.epoch as u64;
        if index < job.workers {
            run_tasks(s, job);
        }
    }
}

impl Pool {
    /// Runs `f(0) .. f(tasks - 1)` on this thread and up to `threads - 1` workers and returns
    /// when all are done; on this thread alone when another job is running (nested use).
    pub(crate) fn run(&self, tasks: usize, threads: usize, f: Task) {
        let helpers = threads.saturating_sub(1).min(self.workers);
        if helpers == 0 || tasks <= 1 || self.shared.busy.swap(true, Ordering::Acquire) {
            (0..tasks).for_each(f);
            return;
        }
        let s = &*self.shared;
        let epoch = (s.epoch.load(Ordering::Acquire) as u32).wrapping_add(1);
        // SAFETY: only the lifetime is erased; this function returns only after every task of
        // this epoch ran (`done == tasks`), and no call of `f` can start after that.
        let erased: Task<'static> = unsafe { std::mem::transmute::<Task, Task<'static>>(f) };
        let job = Job {
            f: erased,
            tasks,
            workers: helpers,
            epoch,
        };
        match s.job.lock() {
            Ok(mut j) => *j = job,
            Err(_) => {
                s.busy.store(false, Ordering::Release);
                (0..tasks).for_each(f);
                return;
            }
        }
        s.done.store(0, Ordering::Release);
        s.claim.store((epoch as u64) << 32, Ordering::Release);
        s.epoch.store(epoch as u64, Ordering::Release);
        if s.parked.load(Ordering::Acquire) > 0 {
            if let Ok(mut v) = s.sleeping.lock() {
                for t in v.drain(..) {
                    t.unpark();
                }
            }
        }
        run_tasks(s, job);
        while s.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        s.busy.store(false, Ordering::Release);
    }
}
