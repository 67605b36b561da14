//! A stable-toolchain mutation fuzzer (no libFuzzer, no nightly): deterministic mutations of
//! real files, each case run under `catch_unwind` (library targets) or as a child process with
//! a wall-clock bound (CLI targets), for a time budget per target.
//!
//! - Every case has its own seed, derived from the run's base seed, the target and the case
//!   number; a failure prints the target, that seed, the path of the input that failed (written
//!   under `$TMPDIR/npuc-fuzz-failures/`) and `NPUC_FUZZ_SEED=… NPUC_FUZZ_CASE=N`, which replays
//!   exactly that case. A crash that ends the process (an allocator abort) leaves the case in
//!   flight in `$TMPDIR/npuc-fuzz-failures/TARGET-SEED.inflight`.
//! - `NPUC_FUZZ_SECONDS` is the budget per target (default [`DEFAULT_SECONDS`]): raise it for a
//!   long local run (`NPUC_FUZZ_SECONDS=600 cargo test --release -p npuc-cli --test fuzz`).
//! - `NPUC_FUZZ_SEED` sets the base seed (default: fixed, so CI runs are reproducible).
//! - `NPUC_FUZZ_CASE=N` runs case N only (a replay).
//!
//! A failure is a panic (library targets) or, for the CLI, an exit by a signal (an abort, e.g.
//! "memory allocation of N bytes failed"), exit code 101 or "panicked at" in stderr, or a run
//! past the bound: [`check_exit`]. A clean error is fine: that is what hostile input must give.

use std::io::Read;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Seconds per target when `NPUC_FUZZ_SECONDS` is not set: CI runs every target this long.
pub const DEFAULT_SECONDS: f64 = 3.0;

/// Base seed when `NPUC_FUZZ_SEED` is not set.
pub const DEFAULT_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// xorshift64*: small, deterministic, good enough to pick mutations.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        // Never the all-zero state (a fixed point of xorshift).
        Rng(seed ^ 0x2545_f491_4f6c_dd1d | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
    /// True with probability `1/n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// The seed of case `i` of a run with base seed `base` for target `target`.
pub fn case_seed(base: u64, target: &str, i: u64) -> u64 {
    // FNV-1a of the target name, so targets explore different sequences.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in target.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    let mut r = Rng::new(base ^ h ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    r.next_u64()
}

fn env_f64(name: &str) -> Option<f64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => v.parse().ok(),
    }
}

/// The budget per target: `NPUC_FUZZ_SECONDS`, else [`DEFAULT_SECONDS`].
pub fn budget() -> Duration {
    Duration::from_secs_f64(
        env_f64("NPUC_FUZZ_SECONDS")
            .unwrap_or(DEFAULT_SECONDS)
            .max(0.0),
    )
}

/// Numbers that break size arithmetic, written in the widths loaders read.
pub const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    16,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    1 << 40,
    1 << 62,
    i64::MAX as u64,
    1 << 63,
    u64::MAX,
    u64::MAX - 1,
];

/// One random mutation of `b` inside `region` (byte offsets; clamped to `b`): bit flips,
/// overwritten bytes, interesting integers (u8/u16/u32/u64, little-endian), a deleted,
/// duplicated or inserted chunk, or truncation. `grow` allows mutations that change the length.
pub fn mutate_bytes(rng: &mut Rng, b: &mut Vec<u8>, region: std::ops::Range<usize>, grow: bool) {
    let end = region.end.min(b.len());
    let start = region.start.min(end);
    if end == start {
        b.extend((0..1 + rng.below(16)).map(|_| rng.next_u64() as u8));
        return;
    }
    let at = |rng: &mut Rng| start + rng.below(end - start);
    let kinds = if grow { 9 } else { 5 };
    match rng.below(kinds) {
        0 => {
            for _ in 0..1 + rng.below(4) {
                let i = at(rng);
                b[i] ^= 1 << rng.below(8);
            }
        }
        1 => {
            let i = at(rng);
            let r = rng.next_u64() as u8;
            b[i] = *rng.pick(&[0u8, 0xff, 0x7f, 0x80, 1, r]);
        }
        2..=3 => {
            let v = *rng.pick(INTERESTING);
            let v = if rng.one_in(4) { v.wrapping_neg() } else { v };
            let w = *rng.pick(&[1usize, 2, 4, 8]);
            let i = at(rng);
            let n = w.min(end - i);
            b[i..i + n].copy_from_slice(&v.to_le_bytes()[..n]);
        }
        4 => {
            // Copy a chunk over another place (a value from elsewhere in the file).
            let (i, j) = (at(rng), at(rng));
            let n = (1 + rng.below(32)).min(end - i).min(end - j);
            let chunk = b[i..i + n].to_vec();
            b[j..j + n].copy_from_slice(&chunk);
        }
        5 => b.truncate(at(rng)),
        6 => {
            let i = at(rng);
            let n = (1 + rng.below(64)).min(end - i);
            b.drain(i..i + n);
        }
        7 => {
            let i = at(rng);
            let n = (1 + rng.below(64)).min(end - i);
            let chunk = b[i..i + n].to_vec();
            let j = at(rng);
            b.splice(j..j, chunk);
        }
        _ => {
            let i = at(rng);
            let n = 1 + rng.below(16);
            let junk: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            b.splice(i..i, junk);
        }
    }
}

/// Values that text formats (TOML, JSON, flags) get wrong: sizes past any machine, signs,
/// non-numbers, empty and odd strings.
pub const HOSTILE_VALUES: &[&str] = &[
    "0",
    "-1",
    "1",
    "2",
    "255",
    "65536",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "-9223372036854775808",
    "1e9",
    "1e309",
    "-1e309",
    "NaN",
    "nan",
    "inf",
    "-inf",
    "0.5",
    "-0.0",
    "1e-45",
    "\"\"",
    "\"x\"",
    "[]",
    "[0]",
    "[-1, 0]",
    "[1e30]",
    "{}",
    "null",
    "true",
    "\"../../../../etc/passwd\"",
    "\"/dev/null\"",
    "\"\\u0000\"",
    "\"ü✓\"",
];

/// One random mutation of text `s` (TOML, JSON): a number or quoted string replaced by a
/// hostile value, a line deleted or duplicated, characters deleted/inserted, truncation.
pub fn mutate_text(rng: &mut Rng, s: &str) -> String {
    let mut out = s.to_string();
    match rng.below(7) {
        0 | 1 => {
            // Replace a token: a run of digits/letters/quotes around a random char.
            let b = out.as_bytes();
            if b.is_empty() {
                return (*rng.pick(HOSTILE_VALUES)).to_string();
            }
            let i = rng.below(b.len());
            let tok = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'_' | b'+');
            let (mut lo, mut hi) = (i, i);
            if b[i] == b'"' {
                hi = i + 1;
                while hi < b.len() && b[hi] != b'"' {
                    hi += 1;
                }
                hi = (hi + 1).min(b.len());
            } else {
                while lo > 0 && tok(b[lo - 1]) {
                    lo -= 1;
                }
                while hi < b.len() && tok(b[hi]) {
                    hi += 1;
                }
            }
            if lo < hi && out.is_char_boundary(lo) && out.is_char_boundary(hi) {
                let v = *rng.pick(HOSTILE_VALUES);
                out.replace_range(lo..hi, v);
            }
        }
        2 => {
            let lines: Vec<&str> = out.lines().collect();
            if !lines.is_empty() {
                let k = rng.below(lines.len());
                let mut l: Vec<&str> = lines.clone();
                if rng.one_in(2) {
                    l.remove(k);
                } else {
                    l.insert(k, lines[k]);
                }
                out = l.join("\n");
            }
        }
        3 => {
            let mut b = out.into_bytes();
            let len = b.len();
            mutate_bytes(rng, &mut b, 0..len, true);
            out = String::from_utf8_lossy(&b).into_owned();
        }
        4 => {
            let i = rng.below(out.len() + 1);
            if out.is_char_boundary(i) {
                let ins = *rng.pick(&[
                    "[", "]", "{", "}", "\"", ",", "=", "\n", "[[x]]\n", ":", "\\",
                ]);
                out.insert_str(i, ins);
            }
        }
        5 => {
            let i = rng.below(out.len() + 1);
            if out.is_char_boundary(i) {
                out.truncate(i);
            }
        }
        _ => {
            // Two mutations.
            let once = mutate_text(rng, &out);
            out = mutate_text(rng, &once);
        }
    }
    out
}

/// What one case of a target did, for the summary line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The input was accepted (and exercised further).
    Accepted,
    /// The input was refused with an error.
    Rejected,
}

/// One case: the mutated input (saved when the case fails) and what else running it needs.
pub struct Case<T> {
    /// The bytes the case ran on (a file's content, or the command line for CLI targets).
    pub input: Vec<u8>,
    /// File extension of the saved reproducer.
    pub ext: &'static str,
    /// Anything else the run needs (a parsed model, the argument vector).
    pub data: T,
}

/// A fuzz target's summary.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub cases: u64,
    pub accepted: u64,
    pub rejected: u64,
    pub seconds: f64,
    /// One line per failing case: target, seed, reproducer, message.
    pub failures: Vec<String>,
}

impl Stats {
    /// Fails (panics) when any case failed, listing each with its seed and reproducer.
    pub fn assert_clean(&self, target: &str) {
        assert!(
            self.failures.is_empty(),
            "fuzz target {target}: {} of {} cases failed:\n{}",
            self.failures.len(),
            self.cases,
            self.failures.join("\n")
        );
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic".into()
    }
}

/// Where failing inputs are written: `$TMPDIR/npuc-fuzz-failures/TARGET-SEED.EXT`.
pub fn failure_path(target: &str, seed: u64, ext: &str) -> PathBuf {
    std::env::temp_dir()
        .join("npuc-fuzz-failures")
        .join(format!("{target}-{seed:016x}.{ext}"))
}

/// Runs target `target` for [`budget`] (at least `min_cases` cases): `make(rng, i)` builds
/// case `i` from a fresh [`Rng`] seeded with [`case_seed`]; `run(&case)` executes it, returning
/// `Ok(verdict)` or `Err(message)` for a failure that is not a panic (a CLI abort or hang).
/// A panic inside `run` is caught and recorded as a failure. Prints one summary line.
pub fn fuzz<T>(
    target: &str,
    min_cases: u64,
    make: impl FnMut(&mut Rng, u64) -> Case<T>,
    run: impl FnMut(&Case<T>) -> Result<Verdict, String>,
) -> Stats {
    fuzz_for(target, min_cases, budget(), make, run)
}

/// [`fuzz`] with an explicit time budget.
pub fn fuzz_for<T>(
    target: &str,
    min_cases: u64,
    budget: Duration,
    mut make: impl FnMut(&mut Rng, u64) -> Case<T>,
    mut run: impl FnMut(&Case<T>) -> Result<Verdict, String>,
) -> Stats {
    let base = env_u64("NPUC_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
    // `NPUC_FUZZ_CASE=N`: replay case N only.
    let only = env_u64("NPUC_FUZZ_CASE");
    let t0 = Instant::now();
    let mut st = Stats::default();
    // A crash that kills the process (an allocator abort) cannot be caught: the case in
    // flight is recorded here first, and the file removed when the target ends.
    let inflight = failure_path(target, base, "inflight");
    let _ = std::fs::create_dir_all(inflight.parent().unwrap());
    let mut i = only.unwrap_or(0);
    while (only.is_some() && st.cases == 0)
        || (only.is_none() && (st.cases < min_cases || t0.elapsed() < budget))
    {
        let seed = case_seed(base, target, i);
        let mut rng = Rng::new(seed);
        let case = make(&mut rng, i);
        let _ = std::fs::write(
            &inflight,
            format!(
                "fuzz target {target}: case {i} (seed {seed:#018x}) was running; replay: \
                 NPUC_FUZZ_SEED={base:#x} NPUC_FUZZ_CASE={i}\n"
            ),
        );
        st.cases += 1;
        i += 1;
        let r = catch_unwind(AssertUnwindSafe(|| run(&case)));
        let failure = match r {
            Ok(Ok(Verdict::Accepted)) => {
                st.accepted += 1;
                None
            }
            Ok(Ok(Verdict::Rejected)) => {
                st.rejected += 1;
                None
            }
            Ok(Err(msg)) => Some(msg),
            Err(p) => Some(format!("panic: {}", panic_message(&*p))),
        };
        if let Some(msg) = failure {
            let path = failure_path(target, seed, case.ext);
            let saved = std::fs::create_dir_all(path.parent().unwrap())
                .and_then(|_| std::fs::write(&path, &case.input))
                .map(|_| path.display().to_string())
                .unwrap_or_else(|e| format!("(not saved: {e})"));
            st.failures.push(format!(
                "  case {} seed {seed:#018x}: {msg}\n    input: {saved}\n    replay: NPUC_FUZZ_SEED={base:#x} NPUC_FUZZ_CASE={}",
                i - 1,
                i - 1
            ));
        }
    }
    let _ = std::fs::remove_file(&inflight);
    st.seconds = t0.elapsed().as_secs_f64();
    eprintln!(
        "fuzz {target}: {} cases in {:.1} s ({} accepted, {} rejected, {} failed; base seed {base:#x})",
        st.cases,
        st.seconds,
        st.accepted,
        st.rejected,
        st.failures.len()
    );
    st
}

/// A child process's outcome under a wall-clock bound.
#[derive(Debug)]
pub struct Bounded {
    /// `None` when it was killed at the bound.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// Runs `cmd` (stdin empty, stdout/stderr captured) and kills it after `limit`.
pub fn run_bounded(mut cmd: Command, limit: Duration) -> std::io::Result<Bounded> {
    let t0 = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                // Keep the first 1 MiB: enough to read the error, bounded however chatty.
                let _ = r.by_ref().take(1 << 20).read_to_end(&mut v);
                let _ = std::io::copy(&mut r, &mut std::io::sink());
            }
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if t0.elapsed() >= limit {
            // Only this child, which this function started.
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Ok(Bounded {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        elapsed: t0.elapsed(),
    })
}

/// Judges a CLI run: exit code 0, 1 or 2 without a panic message is fine (`Accepted` for 0);
/// a signal (abort), code 101, any other code, "panicked at", an allocator abort message or
/// a run past the bound is a failure, described with the command line.
pub fn check_exit(b: &Bounded, argv: &str, limit: Duration) -> Result<Verdict, String> {
    let tail = |s: &str| {
        let t: String = s.chars().rev().take(600).collect();
        t.chars().rev().collect::<String>()
    };
    let bad = |what: String| {
        Err(format!(
            "{what}\n    command: {argv}\n    stderr: {}",
            tail(&b.stderr)
        ))
    };
    let Some(st) = b.status else {
        return bad(format!("still running after {limit:?} (a hang?), killed"));
    };
    if b.stderr.contains("panicked at") {
        return bad("panicked".into());
    }
    if b.stderr.contains("memory allocation of") {
        return bad("allocator abort".into());
    }
    match st.code() {
        Some(0) => Ok(Verdict::Accepted),
        Some(1) | Some(2) => Ok(Verdict::Rejected),
        Some(c) => bad(format!("exit code {c}")),
        None => {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                bad(format!("killed by signal {:?}", st.signal()))
            }
            #[cfg(not(unix))]
            bad("killed".into())
        }
    }
}

/// Quotes a command line for a reproducer: `npuc 'a b' c`.
pub fn shell_line(program: &Path, args: &[String]) -> String {
    let q = |s: &str| {
        if !s.is_empty()
            && s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-_./=:,+@".contains(&c))
        {
            s.to_string()
        } else {
            format!("'{}'", s.replace('\'', "'\\''"))
        }
    };
    std::iter::once(program.display().to_string())
        .chain(args.iter().map(|a| q(a)))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_and_case_seeds_are_deterministic() {
        let a: Vec<u64> = (0..4).map(|i| case_seed(1, "t", i)).collect();
        let b: Vec<u64> = (0..4).map(|i| case_seed(1, "t", i)).collect();
        assert_eq!(a, b);
        assert_ne!(case_seed(1, "t", 0), case_seed(1, "u", 0));
        assert_ne!(a[0], a[1]);
    }

    #[test]
    fn mutations_stay_in_their_region_when_not_growing() {
        let mut r = Rng::new(7);
        for _ in 0..2000 {
            let mut b = vec![0u8; 64];
            mutate_bytes(&mut r, &mut b, 8..16, false);
            assert_eq!(b.len(), 64);
            assert!(b[..8].iter().chain(&b[16..]).all(|&x| x == 0));
        }
    }

    #[test]
    fn a_panicking_case_is_a_failure_with_its_seed() {
        let st = fuzz_for(
            "selftest",
            64,
            Duration::ZERO,
            |r, _| Case {
                input: r.next_u64().to_le_bytes().to_vec(),
                ext: "bin",
                data: (),
            },
            |c| {
                if c.input[0] % 2 == 0 {
                    panic!("even")
                }
                Ok(Verdict::Rejected)
            },
        );
        // The failing inputs it saved are this test's own: remove them.
        for f in std::fs::read_dir(failure_path("selftest", 0, "x").parent().unwrap())
            .into_iter()
            .flatten()
            .flatten()
        {
            if f.file_name().to_string_lossy().starts_with("selftest-") {
                let _ = std::fs::remove_file(f.path());
            }
        }
        assert!(st.cases >= 64);
        assert!(!st.failures.is_empty() && st.failures.len() < 64);
        assert!(st
            .failures
            .iter()
            .all(|f| f.contains("seed 0x") && f.contains("even")));
    }

    #[test]
    fn hangs_and_signals_are_failures() {
        let limit = Duration::from_millis(200);
        let mut c = Command::new("sleep");
        c.arg("5");
        let b = run_bounded(c, limit).unwrap();
        assert!(b.status.is_none());
        assert!(check_exit(&b, "sleep 5", limit)
            .unwrap_err()
            .contains("hang"));
        let mut c = Command::new("sh");
        c.args(["-c", "kill -ABRT $$"]);
        let b = run_bounded(c, Duration::from_secs(5)).unwrap();
        assert!(check_exit(&b, "abort", limit)
            .unwrap_err()
            .contains("signal"));
        let mut c = Command::new("sh");
        c.args(["-c", "echo 'error: no' >&2; exit 2"]);
        let b = run_bounded(c, Duration::from_secs(5)).unwrap();
        assert_eq!(check_exit(&b, "x", limit), Ok(Verdict::Rejected));
    }
}
