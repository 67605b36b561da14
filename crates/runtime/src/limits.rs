//! Resource limits: how much memory one tensor may take and how many iterations a loop may run,
//! checked *before* the work starts, so that a hostile or mistaken model (a pad of 2^40, a
//! OneHot depth of 2^40, a Loop whose trip count is 2^62) gets an error naming the node and the
//! size instead of an allocator abort or a hang.
//!
//! The memory budget is the process's `--max-memory` when one was set ([`set_max_memory`]), else
//! the `NPUC_MAX_MEMORY` environment variable, else the memory the kernel reports available
//! (`MemAvailable`). Sizes under [`CHEAP_BYTES`] pass without reading anything, so the check
//! costs nothing on the sizes real models use.

use std::sync::atomic::{AtomicU64, Ordering};

/// Requests up to this size pass without looking up the budget.
pub const CHEAP_BYTES: u128 = 256 << 20;

/// Loop iterations allowed before a run is stopped (a Loop with a trip count of 2^62 and a
/// condition that stays true would otherwise never end; a few seconds of trivial bodies; real
/// models loop over sequence lengths or decoding steps, thousands). `NPUC_MAX_LOOP_ITERATIONS`
/// overrides.
pub const DEFAULT_MAX_LOOP_ITERATIONS: u64 = 1_000_000;

/// 0: not set (environment, then available memory).
static MAX_MEMORY: AtomicU64 = AtomicU64::new(0);

/// Sets the memory budget for this process (`None`: back to the default).
pub fn set_max_memory(bytes: Option<u64>) {
    MAX_MEMORY.store(bytes.unwrap_or(0), Ordering::Relaxed);
}

/// The memory budget in bytes and where it comes from.
pub fn memory_budget() -> (u64, &'static str) {
    let set = MAX_MEMORY.load(Ordering::Relaxed);
    if set > 0 {
        return (set, "--max-memory");
    }
    if let Some(b) = std::env::var("NPUC_MAX_MEMORY")
        .ok()
        .and_then(|v| parse_bytes(&v).ok())
    {
        return (b, "NPUC_MAX_MEMORY");
    }
    match available_memory() {
        Some(b) => (b, "available memory"),
        // No /proc (not Linux): only what no machine can hold is refused.
        None => (u64::MAX, "address space"),
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn available_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Parses a size: plain bytes or with a `K`/`M`/`G`/`T` suffix (powers of 1024, optional `B`/`iB`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let digits = lower.trim_end_matches("ib").trim_end_matches('b');
    let (num, shift) = match digits.chars().last() {
        Some('k') => (&digits[..digits.len() - 1], 10),
        Some('m') => (&digits[..digits.len() - 1], 20),
        Some('g') => (&digits[..digits.len() - 1], 30),
        Some('t') => (&digits[..digits.len() - 1], 40),
        _ => (digits, 0),
    };
    let bad = || format!("'{s}' is not a size (examples: 512M, 8G, 1073741824)");
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    if !v.is_finite() || v <= 0.0 {
        return Err(bad());
    }
    let b = v * (1u64 << shift) as f64;
    if b >= u64::MAX as f64 {
        return Err(format!("'{s}' is larger than the address space"));
    }
    Ok(b as u64)
}

/// A size for messages: `12.3 GB (13207024435 bytes)`.
pub fn human_bytes(b: u128) -> String {
    let gb = b as f64 / 1e9;
    if gb >= 0.1 {
        format!("{gb:.1} GB ({b} bytes)")
    } else {
        format!("{:.1} MB ({b} bytes)", b as f64 / 1e6)
    }
}

/// Refuses `bytes` for `what` when it exceeds the memory budget, with a message that names what,
/// the size and the budget, and says how to raise it.
pub fn check_bytes(bytes: u128, what: impl FnOnce() -> String) -> Result<(), String> {
    if bytes <= CHEAP_BYTES {
        return Ok(());
    }
    let (budget, source) = memory_budget();
    if bytes <= budget as u128 {
        return Ok(());
    }
    Err(format!(
        "{} needs {}, more than the memory budget of {} ({source}); \
         check the model's shapes and attributes, or raise the budget with --max-memory",
        what(),
        human_bytes(bytes),
        human_bytes(budget as u128)
    ))
}

/// Loop iterations allowed (`NPUC_MAX_LOOP_ITERATIONS`, else the default).
pub fn max_loop_iterations() -> u64 {
    std::env::var("NPUC_MAX_LOOP_ITERATIONS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(DEFAULT_MAX_LOOP_ITERATIONS)
}

/// Memory at a step boundary, for finding where a long pipeline's peak comes from: with
/// `NPUC_MEM_TRACE` set, prints `npuc mem: STEP: rss .. MB (anon .., file ..), peak since the
/// last mark .. MB, peak so far .. MB` to stderr (resident now, `VmRSS` split into anonymous
/// memory and mapped file pages, and the high-water mark `VmHWM`, which it then resets through
/// `/proc/self/clear_refs` so that the next mark reports its own step's peak). The reset also
/// hides the earlier peaks from tools that read the process's high-water mark at exit (GNU
/// `time`): with the variable set, "peak so far" of the last mark is the process's peak.
/// Without the variable (or without `/proc`) it does nothing.
pub fn trace_memory(step: &str) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    static MAX_KB: AtomicU64 = AtomicU64::new(0);
    if !*ON.get_or_init(|| std::env::var_os("NPUC_MEM_TRACE").is_some()) {
        return;
    }
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return;
    };
    let kb = |key: &str| -> u64 {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    };
    let hwm = kb("VmHWM:");
    let max = MAX_KB.fetch_max(hwm, Ordering::Relaxed).max(hwm);
    eprintln!(
        "npuc mem: {step}: rss {} MB (anon {}, file {}), peak since the last mark {} MB, peak so far {} MB",
        kb("VmRSS:") / 1024,
        kb("RssAnon:") / 1024,
        kb("RssFile:") / 1024,
        hwm / 1024,
        max / 1024
    );
    // "5" resets the peak RSS to the current RSS (Linux 4.0+); failure only loses the reset.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("512M").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("8G").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("2tb").unwrap(), 2 << 40);
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("-3G").is_err());
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }

    #[test]
    fn small_sizes_pass_and_huge_ones_name_what_and_how_much() {
        assert!(check_bytes(1 << 20, || unreachable!()).is_ok());
        let e = check_bytes(1 << 70, || "output 'y'".into()).unwrap_err();
        assert!(e.starts_with("output 'y' needs "), "{e}");
        assert!(e.contains("1180591620717411303424 bytes"), "{e}");
        assert!(e.contains("--max-memory"), "{e}");
    }
}
