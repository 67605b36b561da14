//! Runs the ONNX backend test data (onnx 1.22.0 wheel: node, light, pytorch-converted,
//! pytorch-operator, simple) through npuc and compares outputs with the shipped references.
//! A test is skipped only when one of its ops is absent from `npuc ops`.
//!
//! `--compiled` runs every test the way a deployed model runs: compiled into a `.npuc` artifact
//! (functions inlined, serialized, reloaded with weights borrowed from the artifact's bytes),
//! then executed, so the artifact format is checked against the whole suite.

use anyhow::{anyhow, bail, Context, Result};
use npuc_format::Artifact;
use npuc_ir::{DType, Model, Tensor, TypeInfo};
use npuc_onnx::PbValue;
use npuc_runtime::{registry, Session, SessionOptions, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};

struct Case {
    suite: String,
    name: String,
    model: PathBuf,
    /// Test data directories (node-style) or, for `light`, the single output file.
    data: Vec<PathBuf>,
    light_output: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

struct Opts {
    suite: Option<PathBuf>,
    op: Option<String>,
    test: Option<String>,
    json: bool,
    verbose: bool,
    compiled: bool,
}

pub fn main(args: &[String]) -> Result<()> {
    let mut o = Opts {
        suite: None,
        op: None,
        test: None,
        json: false,
        verbose: false,
        compiled: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--suite" => {
                o.suite = Some(PathBuf::from(
                    it.next()
                        .ok_or_else(|| anyhow!("--suite needs a directory"))?,
                ))
            }
            "--op" => {
                o.op = Some(
                    it.next()
                        .ok_or_else(|| anyhow!("--op needs a name"))?
                        .clone(),
                )
            }
            "--test" => {
                o.test = Some(
                    it.next()
                        .ok_or_else(|| anyhow!("--test needs a name"))?
                        .clone(),
                )
            }
            "--json" => o.json = true,
            "--verbose" | "-v" => o.verbose = true,
            "--compiled" => o.compiled = true,
            other => bail!("unknown option '{other}'"),
        }
    }
    let root = match &o.suite {
        Some(s) => s.clone(),
        None => {
            let d = crate::cache_dir().join("suite/onnx-1.22.0/data");
            if !d.join("node").is_dir() {
                eprintln!(
                    "fetching the onnx 1.22.0 backend test data into {}",
                    d.display()
                );
                let st = std::process::Command::new("bash")
                    .arg(crate::repo_root().join("scripts/fetch-data.sh"))
                    .arg("suite")
                    .status()?;
                if !st.success() {
                    bail!("could not fetch the suite; pass --suite DIR");
                }
            }
            d
        }
    };
    let cases = collect(&root)?;
    if cases.is_empty() {
        bail!("no tests found under {}", root.display());
    }
    let known = load_known_failures()?;
    // Silence panic messages from kernels; they are reported as failures.
    std::panic::set_hook(Box::new(|_| {}));

    let mut results: Vec<(Case, Vec<String>, Outcome)> = vec![];
    for c in cases {
        if let Some(t) = &o.test {
            if !c.name.contains(t.as_str()) {
                continue;
            }
        }
        let model = match npuc_onnx::load_model(&c.model) {
            Ok(m) => m,
            Err(e) => {
                results.push((c, vec![], Outcome::Fail(format!("load: {e}"))));
                continue;
            }
        };
        let ops = ops_of(&model);
        if let Some(op) = &o.op {
            if !ops.iter().any(|x| x == op) {
                continue;
            }
        }
        let missing: Vec<&String> = ops.iter().filter(|op| !has_op(op)).collect();
        let outcome = if !missing.is_empty() {
            Outcome::Skip(format!(
                "unsupported: {}",
                missing
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        } else {
            let case = || -> Result<()> {
                if o.compiled {
                    let compiled = compile_in_process(&c.model, &c.name).context("compile")?;
                    run_case(&c, &compiled)
                } else {
                    run_case(&c, &model)
                }
            };
            match std::panic::catch_unwind(AssertUnwindSafe(case)) {
                Ok(Ok(())) => Outcome::Pass,
                Ok(Err(e)) => Outcome::Fail(format!("{e:#}")),
                Err(p) => Outcome::Fail(format!(
                    "PANIC: {}",
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                )),
            }
        };
        if o.verbose && !o.json {
            match &outcome {
                Outcome::Fail(m) => println!("FAIL {}/{}: {m}", c.suite, c.name),
                Outcome::Pass => println!("ok   {}/{}", c.suite, c.name),
                Outcome::Skip(m) => println!("skip {}/{}: {m}", c.suite, c.name),
            }
        }
        results.push((c, ops, outcome));
    }

    // Per-op table (node tests attribute to every op they contain).
    let mut per_op: BTreeMap<String, (usize, usize, usize)> = BTreeMap::new();
    for (_, ops, out) in &results {
        for op in ops {
            let e = per_op.entry(op.clone()).or_default();
            match out {
                Outcome::Pass => e.0 += 1,
                Outcome::Fail(_) => e.1 += 1,
                Outcome::Skip(_) => e.2 += 1,
            }
        }
    }
    let passed = results.iter().filter(|r| r.2 == Outcome::Pass).count();
    let failed = results
        .iter()
        .filter(|r| matches!(r.2, Outcome::Fail(_)))
        .count();
    let skipped = results
        .iter()
        .filter(|r| matches!(r.2, Outcome::Skip(_)))
        .count();
    let unexpected: Vec<&(Case, Vec<String>, Outcome)> = results
        .iter()
        .filter(|r| matches!(r.2, Outcome::Fail(_)) && !known.contains_key(&r.0.name))
        .collect();
    let fixed: Vec<&String> = known
        .keys()
        .filter(|k| {
            results
                .iter()
                .any(|r| &r.0.name == *k && r.2 == Outcome::Pass)
        })
        .collect();

    if o.json {
        let tests: Vec<serde_json::Value> = results
            .iter()
            .map(|(c, ops, out)| {
                let (status, msg) = match out {
                    Outcome::Pass => ("pass", String::new()),
                    Outcome::Fail(m) => ("fail", m.clone()),
                    Outcome::Skip(m) => ("skip", m.clone()),
                };
                serde_json::json!({"suite": c.suite, "name": c.name, "ops": ops, "status": status,
                    "message": msg, "known_failure": known.get(&c.name)})
            })
            .collect();
        let ops: serde_json::Map<String, serde_json::Value> = per_op
            .iter()
            .map(|(k, (p, f, s))| {
                (
                    k.clone(),
                    serde_json::json!({"passed": p, "failed": f, "skipped": s}),
                )
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "passed": passed, "failed": failed, "skipped": skipped, "ops": ops, "tests": tests
            }))?
        );
    } else {
        println!("{:<34} {:>6} {:>6} {:>6}", "op", "pass", "fail", "skip");
        for (op, (p, f, s)) in &per_op {
            println!("{op:<34} {p:>6} {f:>6} {s:>6}");
        }
        let mut by_suite: BTreeMap<&str, (usize, usize, usize)> = BTreeMap::new();
        for (c, _, out) in &results {
            let e = by_suite.entry(&c.suite).or_default();
            match out {
                Outcome::Pass => e.0 += 1,
                Outcome::Fail(_) => e.1 += 1,
                Outcome::Skip(_) => e.2 += 1,
            }
        }
        println!();
        for (s, (p, f, k)) in by_suite {
            println!("suite {s:<20} {p} passed, {f} failed, {k} skipped");
        }
        if !unexpected.is_empty() {
            println!("\nfailures not in conformance/known-failures.txt:");
            for (c, _, out) in &unexpected {
                if let Outcome::Fail(m) = out {
                    let m: String = m.chars().take(300).collect();
                    println!("  {}/{}: {m}", c.suite, c.name);
                }
            }
        }
        if !fixed.is_empty() {
            println!("\nknown failures that now pass (remove them from the list):");
            for f in &fixed {
                println!("  {f}");
            }
        }
        println!("{passed} passed, {failed} failed, {skipped} skipped");
    }
    if !unexpected.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

/// What `npuc compile` followed by loading the artifact does to a model: the driver's compile
/// pipeline (import, verify, inline, optimize, serialize; host target, one graph "main") into
/// memory, parsed back, returning the graph as the runtime will see it (numeric weights
/// borrowed from the artifact's bytes).
fn compile_in_process(model: &Path, name: &str) -> Result<Model> {
    let opts = npuc_driver::CompileOptions {
        optimize: true,
        ..Default::default()
    };
    let (bytes, _) = npuc_driver::compile::compile_to_bytes(
        &[("main".to_string(), model.to_path_buf())],
        &opts,
        &mut |_: &str| {},
    )?;
    let a = Artifact::from_bytes(Path::new(&format!("{name}.npuc")), bytes)?;
    Ok(a.model(Some("main"))?)
}

fn load_known_failures() -> Result<HashMap<String, String>> {
    let p = crate::repo_root().join("conformance/known-failures.txt");
    let mut m = HashMap::new();
    if let Ok(text) = std::fs::read_to_string(&p) {
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, reason) = line.split_once('#').unwrap_or((line, ""));
            m.insert(name.trim().to_string(), reason.trim().to_string());
        }
    }
    Ok(m)
}

fn has_op(qualified: &str) -> bool {
    let (domain, op) = qualified.rsplit_once("::").unwrap_or(("", qualified));
    registry().has(domain, op)
}

/// Distinct ops (with domain prefix `domain::` when not the default domain) in a model,
/// including subgraphs; calls to model-local functions count as their bodies' ops.
fn ops_of(m: &Model) -> Vec<String> {
    let mut set = BTreeSet::new();
    fn walk(g: &npuc_ir::Graph, m: &Model, set: &mut BTreeSet<String>) {
        for n in &g.nodes {
            walk_node(n, m, set, 0);
        }
    }
    fn walk_node(n: &npuc_ir::Node, m: &Model, set: &mut BTreeSet<String>, depth: usize) {
        if let Some(f) = m
            .functions
            .iter()
            .find(|f| f.name == n.op_type && npuc_ir::normalize_domain(&f.domain) == n.domain)
        {
            if depth < 16 {
                for b in &f.nodes {
                    walk_node(b, m, set, depth + 1);
                }
            }
            return;
        }
        set.insert(if n.domain.is_empty() {
            n.op_type.clone()
        } else {
            format!("{}::{}", n.domain, n.op_type)
        });
        for (_, a) in &n.attrs {
            for sg in npuc_ir::subgraphs(a) {
                walk(sg, m, set);
            }
        }
    }
    walk(&m.graph, m, &mut set);
    set.into_iter().collect()
}

fn collect(root: &Path) -> Result<Vec<Case>> {
    let mut cases = vec![];
    for suite in ["node", "pytorch-converted", "pytorch-operator", "simple"] {
        let dir = root.join(suite);
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut names: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        names.sort();
        for d in names {
            let model = d.join("model.onnx");
            if !model.is_file() {
                continue;
            }
            let mut data: Vec<PathBuf> = std::fs::read_dir(&d)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.is_dir()
                        && p.file_name()
                            .and_then(|f| f.to_str())
                            .is_some_and(|f| f.starts_with("test_data_set"))
                })
                .collect();
            data.sort();
            cases.push(Case {
                suite: suite.into(),
                name: d.file_name().unwrap().to_string_lossy().into_owned(),
                model,
                data,
                light_output: None,
            });
        }
    }
    if let Ok(rd) = std::fs::read_dir(root.join("light")) {
        let mut names: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        names.sort();
        for p in names {
            let f = p.file_name().unwrap().to_string_lossy().into_owned();
            if let Some(stem) = f.strip_suffix(".onnx") {
                let out = root.join("light").join(format!("{stem}_output_0.pb"));
                cases.push(Case {
                    suite: "light".into(),
                    name: stem.into(),
                    model: p.clone(),
                    data: vec![],
                    light_output: Some(out),
                });
            }
        }
    }
    Ok(cases)
}

fn to_value(v: PbValue) -> Value {
    match v {
        PbValue::Tensor(t) => Value::tensor(t),
        PbValue::Sequence(s) => Value::Sequence(s.into_iter().map(to_value).collect()),
        PbValue::Optional(o) => Value::Optional(o.map(|b| Box::new(to_value(*b)))),
    }
}

fn numbered(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let f = p.file_name()?.to_str()?.to_string();
            let n = f.strip_prefix(prefix)?.strip_suffix(".pb")?.parse().ok()?;
            Some((n, p))
        })
        .collect();
    v.sort();
    v.into_iter().map(|x| x.1).collect()
}

fn run_case(c: &Case, m: &Model) -> Result<()> {
    let sess = Session::new(m, SessionOptions::default()).map_err(|e| anyhow!("{e}"))?;
    let inputs: Vec<npuc_ir::ValueInfo> = sess.inputs().to_vec();
    if let Some(out) = &c.light_output {
        // The onnx runner feeds arange(n).reshape(shape)/n as float32, unknown dims -> 1.
        let mut feeds = vec![];
        for vi in &inputs {
            let dims: Vec<usize> = vi
                .dims()
                .map(|d| {
                    d.iter()
                        .map(|d| {
                            if let npuc_ir::Dim::Fixed(n) = d {
                                *n
                            } else {
                                1
                            }
                        })
                        .collect()
                })
                .unwrap_or_default();
            let n: usize = dims.iter().product();
            let data: Vec<f32> = (0..n).map(|i| i as f32 / n as f32).collect();
            feeds.push((
                vi.name.clone(),
                Value::tensor(Tensor::from_vec(dims, data)?),
            ));
        }
        let got = sess.run(feeds).map_err(|e| anyhow!("{e}"))?;
        let want = npuc_onnx::load_value_pb(out, None)?;
        return compare(&got[0].1, &to_value(want));
    }
    if c.data.is_empty() {
        bail!("no test data sets");
    }
    for ds in &c.data {
        let in_files = numbered(ds, "input_");
        let out_files = numbered(ds, "output_");
        // Inputs are given for the graph inputs in order (optional trailing ones may be absent).
        let all_inputs: Vec<&npuc_ir::ValueInfo> = m.graph.inputs.iter().collect();
        let mut feeds = vec![];
        for (i, f) in in_files.iter().enumerate() {
            let vi = all_inputs
                .get(i)
                .ok_or_else(|| anyhow!("more input files than graph inputs"))?;
            let v = npuc_onnx::load_value_pb(f, vi.ty.as_ref())?;
            feeds.push((vi.name.clone(), to_value(v)));
        }
        let got = sess.run(feeds).map_err(|e| anyhow!("{e}"))?;
        if got.len() != out_files.len() {
            bail!(
                "model produced {} outputs, reference has {}",
                got.len(),
                out_files.len()
            );
        }
        for ((name, v), f) in got.iter().zip(&out_files) {
            let decl = m
                .graph
                .outputs
                .iter()
                .find(|o| &o.name == name)
                .and_then(|o| o.ty.as_ref());
            let want = npuc_onnx::load_value_pb(f, decl)?;
            compare(v, &to_value(want)).with_context(|| format!("output '{name}'"))?;
        }
    }
    Ok(())
}

fn compare(got: &Value, want: &Value) -> Result<()> {
    match (got, want) {
        (Value::Tensor(g), Value::Tensor(w)) => compare_tensors(g, w),
        (Value::Sequence(g), Value::Sequence(w)) => {
            if g.len() != w.len() {
                bail!("sequence length {} vs expected {}", g.len(), w.len());
            }
            for (a, b) in g.iter().zip(w) {
                compare(a, b)?;
            }
            Ok(())
        }
        (Value::Optional(g), Value::Optional(w)) => match (g, w) {
            (None, None) => Ok(()),
            (Some(a), Some(b)) => compare(a, b),
            _ => bail!("optional presence differs"),
        },
        // An optional holding a value compares equal to the plain value.
        (Value::Optional(Some(a)), b) => compare(a, b),
        (a, Value::Optional(Some(b))) => compare(a, b),
        (a, b) => bail!("got a {}, expected a {}", a.kind(), b.kind()),
    }
}

fn compare_tensors(g: &Tensor, w: &Tensor) -> Result<()> {
    if g.shape() != w.shape() {
        bail!("shape {:?}, expected {:?}", g.shape(), w.shape());
    }
    if g.dtype() != w.dtype() {
        bail!("dtype {}, expected {}", g.dtype(), w.dtype());
    }
    if w.dtype() == DType::String {
        if g.as_strings()? != w.as_strings()? {
            bail!(
                "strings differ: {:?} vs {:?}",
                g.as_strings()?,
                w.as_strings()?
            );
        }
        return Ok(());
    }
    let a = g.to_f64_vec()?;
    let b = w.to_f64_vec()?;
    let (rtol, atol) = if w.dtype().is_float() {
        (1e-3, 1e-7)
    } else {
        (0.0, 0.0)
    };
    // f16/bf16 results get the tolerance of their precision.
    let (rtol, atol) = match w.dtype() {
        DType::F16 => (4e-3, 1e-3),
        DType::BF16 => (2e-2, 1e-2),
        _ => (rtol, atol),
    };
    let mut worst = (0usize, 0.0f64);
    let mut bad = 0usize;
    for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
        let ok = if x.is_nan() || y.is_nan() {
            x.is_nan() && y.is_nan()
        } else if x.is_infinite() || y.is_infinite() {
            x == y
        } else {
            (x - y).abs() <= atol + rtol * y.abs()
        };
        if !ok {
            bad += 1;
            let d = (x - y).abs();
            if d > worst.1 || worst.1.is_nan() || bad == 1 {
                worst = (i, d);
            }
        }
    }
    if bad > 0 {
        let i = worst.0;
        bail!(
            "{bad} of {} values differ; worst at {i}: got {} expected {}",
            a.len(),
            a[i],
            b[i]
        );
    }
    let _ = TypeInfo::Sequence(None);
    Ok(())
}
