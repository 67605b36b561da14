//! `npuc bench`: load time, first-run and steady-state latency, peak RSS.

use anyhow::{anyhow, bail, Result};
use npuc_driver::compile::parse_bindings;
use npuc_driver::OpenOptions;
use npuc_ir::{DType, Dim, Tensor, TypeInfo};
use npuc_runtime::{Session, Value};
use std::path::Path;
use std::time::Instant;

/// Peak resident set size of this process (VmHWM), when the OS reports it.
/// Environment variable that makes the `npuc` binary run [`bandwidth_probe`] and exit.
pub const BANDWIDTH_PROBE_ENV: &str = "NPUC_BANDWIDTH_PROBE_THREADS";

/// Read bandwidth (bytes/s) with `threads` threads over a 256 MiB buffer: the best of five
/// passes, each thread summing its own contiguous part.
pub fn bandwidth_probe(threads: usize) -> f64 {
    let threads = threads.max(1);
    let words: usize = 256 << 17; // 256 MiB of u64
    let buf: Vec<u64> = (0..words as u64).collect();
    let part = words.div_ceil(threads);
    let mut best = 0f64;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(part)
                .map(|c| {
                    s.spawn(move || {
                        // Eight independent sums so the loop is bound by loads, not by adds.
                        let mut acc = [0u64; 8];
                        for ch in c.chunks_exact(8) {
                            for (a, v) in acc.iter_mut().zip(ch) {
                                *a = a.wrapping_add(*v);
                            }
                        }
                        acc.iter().fold(0u64, |x, y| x.wrapping_add(*y))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

/// [`bandwidth_probe`] in a child `npuc` process (its buffer stays out of this process's RSS);
/// `None` when the child cannot run.
pub fn read_bandwidth(threads: usize) -> Option<f64> {
    let exe = std::env::current_exe().ok()?;
    let out = std::process::Command::new(exe)
        .env(BANDWIDTH_PROBE_ENV, threads.to_string())
        .output()
        .ok()?;
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Deterministic input data: floats uniform in [0, 1) from a fixed seed, integers 0, bools false.
fn synth_input(name: &str, ty: &Option<TypeInfo>) -> Result<Tensor> {
    let Some(TypeInfo::Tensor {
        dtype: Some(dt),
        shape: Some(dims),
    }) = ty
    else {
        bail!("input '{name}' has no declared tensor type; give it with --input {name}=FILE");
    };
    let mut shape = vec![];
    for (i, d) in dims.iter().enumerate() {
        match d {
            Dim::Fixed(n) => shape.push(*n),
            _ => bail!("input '{name}' dimension {i} is '{d}': bind it with --input-shape {name}=... or --dim"),
        }
    }
    let bytes = shape.iter().fold(dt.size().max(1) as u128, |b, &d| {
        b.saturating_mul(d as u128)
    });
    npuc_runtime::limits::check_bytes(bytes, || {
        format!("the generated input '{name}' ({dt}{shape:?})")
    })
    .map_err(|e| anyhow::anyhow!(e))?;
    let n: usize = shape.iter().product();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    Ok(match dt {
        DType::F32 => Tensor::from_vec(shape, (0..n).map(|_| next()).collect())?,
        DType::F16 => Tensor::from_vec(
            shape,
            (0..n).map(|_| npuc_ir::f16::from_f32(next())).collect(),
        )?,
        DType::F64 => Tensor::from_vec(shape, (0..n).map(|_| next() as f64).collect())?,
        d => Tensor::zeros(*d, shape),
    })
}

#[allow(clippy::too_many_arguments)]
pub fn bench(
    path: &Path,
    graph: Option<&str>,
    inputs: &[String],
    input_shape: &[String],
    dim: &[String],
    threads: usize,
    runs: usize,
    json: bool,
    simulate: bool,
    profile: bool,
    trace: Option<&Path>,
    optimize: bool,
) -> Result<()> {
    let t0 = Instant::now();
    let (input_shapes, dims) = parse_bindings(input_shape, dim)?;
    let opened = npuc_driver::open(
        path,
        &OpenOptions {
            graph: graph.map(String::from),
            input_shapes,
            dims,
            simulate,
            threads,
            optimize,
        },
    )?;
    crate::check_simulate(path, simulate, &opened)?;
    let sess = opened.session;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    // Every --input names an input of the model, once (as `npuc run` checks).
    let mut named: Vec<&str> = vec![];
    for s in inputs {
        let (n, _) = s
            .split_once('=')
            .ok_or_else(|| anyhow!("--input expects NAME=FILE, got '{s}'"))?;
        if !sess.inputs().iter().any(|i| i.name == n) {
            bail!("--input {n}: the model has no such input");
        }
        if named.contains(&n) {
            bail!("--input {n} is given twice; give each input once");
        }
        named.push(n);
    }
    let mut feeds = vec![];
    for vi in sess.inputs() {
        let given = inputs
            .iter()
            .find_map(|s| s.split_once('=').filter(|(n, _)| *n == vi.name));
        let v = match given {
            Some((_, file)) => crate::read_input(Path::new(file), vi.ty.as_ref())?,
            None => Value::tensor(synth_input(&vi.name, &vi.ty)?),
        };
        feeds.push((vi.name.clone(), v));
    }
    let t1 = Instant::now();
    sess.run(feeds.clone())?;
    let first_run_ms = t1.elapsed().as_secs_f64() * 1e3;
    let mut times = vec![];
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        sess.run(feeds.clone())?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    // In run order, for `--json` (warm-up trends, outliers).
    let run_ms = times.clone();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let (min, max) = (times[0], times[times.len() - 1]);
    let rss = peak_rss_bytes();
    let profile = if profile {
        Some(profile_runs(&sess, &feeds, runs.max(1))?)
    } else {
        None
    };
    if let Some(file) = trace {
        let doc = trace_run(&sess, &feeds, path, threads)?;
        let bytes = serde_json::to_vec(&doc)?;
        npuc_format::persist_atomic(file, &bytes)
            .map_err(|e| anyhow!("writing the trace '{}': {e}", file.display()))?;
        if !json {
            println!(
                "trace        {} ({} nodes)",
                file.display(),
                sess.steps().count()
            );
        }
    }
    if json {
        println!(
            "{}",
            serde_json::json!({
                "load_ms": load_ms, "first_run_ms": first_run_ms, "median_ms": median,
                "min_ms": min, "max_ms": max, "peak_rss_bytes": rss, "threads": threads, "runs": times.len(),
                "run_ms": run_ms,
                "profile": profile.as_ref().map(Profile::to_json),
            })
        );
    } else {
        println!("model        {}", path.display());
        println!("load         {load_ms:.2} ms");
        println!("first run    {first_run_ms:.2} ms");
        println!("steady state median {median:.2} ms (min {min:.2}, max {max:.2}; {} runs, {threads} thread{})", times.len(), if threads == 1 { "" } else { "s" });
        if let Some(r) = rss {
            println!("peak RSS     {:.1} MB", r as f64 / 1e6);
        }
        if let Some(p) = &profile {
            p.print();
        }
    }
    Ok(())
}

/// One run as a Chrome trace (the trace-event format Perfetto and chrome://tracing open): a
/// complete event (`ph: X`) per node on the thread that ran the graph, timestamps in
/// microseconds from the run's start, the op as category, output shapes and dtypes as args.
/// Kernels may use the thread pool inside a node's span; the span is the node's wall time.
pub fn trace_run(
    sess: &npuc_runtime::Session,
    feeds: &[(String, Value)],
    model: &Path,
    threads: usize,
) -> Result<serde_json::Value> {
    let nodes: Vec<&npuc_ir::Node> = sess.steps().collect();
    let mut events = vec![
        serde_json::json!({"name": "process_name", "ph": "M", "pid": 1, "tid": 1,
            "args": {"name": format!("npuc {}", model.display())}}),
        serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 1,
            "args": {"name": "graph executor"}}),
    ];
    let t0 = Instant::now();
    let mut spans = vec![];
    sess.run_timed(feeds.to_vec(), &mut |i, start, took, outs| {
        let shapes: Vec<String> = outs
            .iter()
            .map(|v| match v.as_tensor() {
                Some(t) => format!("{}{:?}", t.dtype(), t.shape()),
                None => v.kind().to_string(),
            })
            .collect();
        let since = start.saturating_duration_since(t0);
        spans.push((i, since, took, shapes));
    })?;
    for (i, since, took, shapes) in spans {
        let n = nodes[i];
        let op = if n.domain.is_empty() {
            n.op_type.clone()
        } else {
            format!("{}.{}", n.domain, n.op_type)
        };
        events.push(serde_json::json!({
            "name": n.display_name(), "cat": op, "ph": "X", "pid": 1, "tid": 1,
            "ts": since.as_secs_f64() * 1e6, "dur": took.as_secs_f64() * 1e6,
            "args": {"op": op, "step": i, "outputs": shapes, "threads": threads},
        }));
    }
    Ok(serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}))
}

/// Per-node wall time over profiled runs (separate from the timed runs, whose figures stay
/// free of the timer overhead).
pub struct Profile {
    runs: usize,
    /// (node name, op type, total nanoseconds over all runs), in execution order.
    nodes: Vec<(String, String, u64)>,
}

fn profile_runs(sess: &Session, feeds: &[(String, Value)], runs: usize) -> Result<Profile> {
    let mut nanos = vec![0u64; sess.steps().count()];
    for _ in 0..runs {
        sess.run_profiled(feeds.to_vec(), &mut nanos)?;
    }
    Ok(Profile {
        runs,
        nodes: sess
            .steps()
            .zip(nanos)
            .map(|(n, t)| (n.display_name(), n.op_type.clone(), t))
            .collect(),
    })
}

impl Profile {
    /// (op type, nodes, total ns) sorted by time, largest first.
    fn by_op(&self) -> Vec<(String, usize, u64)> {
        let mut m: std::collections::BTreeMap<&str, (usize, u64)> = Default::default();
        for (_, op, t) in &self.nodes {
            let e = m.entry(op).or_default();
            e.0 += 1;
            e.1 += t;
        }
        let mut v: Vec<_> = m
            .into_iter()
            .map(|(k, (n, t))| (k.to_string(), n, t))
            .collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        v
    }

    fn total(&self) -> u64 {
        self.nodes.iter().map(|n| n.2).sum()
    }

    fn per_run_ms(&self, ns: u64) -> f64 {
        ns as f64 / 1e6 / self.runs as f64
    }

    fn print(&self) {
        let total = self.total().max(1);
        println!(
            "profile      {:.2} ms per run in kernels ({} runs)",
            self.per_run_ms(total),
            self.runs
        );
        println!("  {:<28} {:>6} {:>10} {:>6}", "op", "nodes", "ms/run", "%");
        for (op, n, t) in self.by_op() {
            println!(
                "  {op:<28} {n:>6} {:>10.3} {:>5.1}%",
                self.per_run_ms(t),
                100.0 * t as f64 / total as f64
            );
        }
        let mut top: Vec<_> = self.nodes.iter().collect();
        top.sort_by_key(|n| std::cmp::Reverse(n.2));
        println!("  slowest nodes:");
        for (name, op, t) in top.into_iter().take(10) {
            println!("    {:>9.3} ms  {op:<20} {name}", self.per_run_ms(*t));
        }
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "runs": self.runs,
            "kernel_ms": self.per_run_ms(self.total()),
            "ops": self.by_op().iter().map(|(op, n, t)| serde_json::json!({
                "op": op, "nodes": n, "ms": self.per_run_ms(*t),
            })).collect::<Vec<_>>(),
            "nodes": self.nodes.iter().map(|(name, op, t)| serde_json::json!({
                "name": name, "op": op, "ms": self.per_run_ms(*t),
            })).collect::<Vec<_>>(),
        })
    }
}
