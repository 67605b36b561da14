//! `npuc bench`: load time, first-run and steady-state latency, peak RSS.

use crate::compile::{bind_inputs, parse_bindings};
use anyhow::{anyhow, bail, Result};
use npuc_ir::{DType, Dim, Tensor, TypeInfo};
use npuc_runtime::{Session, SessionOptions, Value};
use std::path::Path;
use std::time::Instant;

/// Peak resident set size of this process (VmHWM), when the OS reports it.
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
) -> Result<()> {
    let t0 = Instant::now();
    let mut m = crate::artifact::load_any(path, graph)?;
    let (shapes, dims) = parse_bindings(input_shape, dim)?;
    bind_inputs(&mut m, &shapes, &dims)?;
    crate::quantized::prepare(&mut m, simulate)?;
    let sess = Session::new(&m, SessionOptions { threads })?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
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
    for s in inputs {
        let (n, _) = s
            .split_once('=')
            .ok_or_else(|| anyhow!("--input expects NAME=FILE, got '{s}'"))?;
        if !sess.inputs().iter().any(|i| i.name == n) {
            bail!("--input {n}: the model has no such input");
        }
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
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let (min, max) = (times[0], times[times.len() - 1]);
    let rss = peak_rss_bytes();
    if json {
        println!(
            "{}",
            serde_json::json!({
                "load_ms": load_ms, "first_run_ms": first_run_ms, "median_ms": median,
                "min_ms": min, "max_ms": max, "peak_rss_bytes": rss, "threads": threads, "runs": times.len(),
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
    }
    Ok(())
}
