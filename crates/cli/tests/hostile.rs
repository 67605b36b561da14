//! Hostile and mistaken input, one test per case of the robustness review (issue 19): each gives a
//! clear error (exit code 1 or 2, a message naming the node, flag or tensor and the size) within
//! seconds, never a panic, an allocator abort or a hang. The models are crafted here with the IR
//! (each is the smallest graph showing its case); the sizes are ones no machine holds (2^40
//! elements and more) or are judged against an explicit `--max-memory`, so the outcome does not
//! depend on the machine's free memory.

use npuc_ir::{
    Attr, DType, Dim, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Longest any case may take: "within seconds" with room for a loaded CI machine.
const MAX_SECONDS: u64 = 30;

fn npuc(args: &[&str], env: &[(&str, &str)]) -> (Output, Duration) {
    let t = Instant::now();
    let mut c = Command::new(env!("CARGO_BIN_EXE_npuc"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (o, t.elapsed())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs `args`; expects a clean failure (exit code 1 or 2, no panic, no signal) within
/// [`MAX_SECONDS`] whose stderr contains every string of `needles`. Returns stderr.
fn refused(args: &[&str], env: &[(&str, &str)], needles: &[&str]) -> String {
    let (o, took) = npuc(args, env);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let code = o.status.code();
    assert!(
        matches!(code, Some(1) | Some(2)),
        "{args:?}: expected exit code 1 or 2, got {:?} (a panic is 101, an abort has no code); stderr: {err}",
        code
    );
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(
        took < Duration::from_secs(MAX_SECONDS),
        "{args:?} took {took:?}"
    );
    for n in needles {
        assert!(err.contains(n), "{args:?}: stderr lacks '{n}': {err}");
    }
    err
}

fn f32_input(name: &str, dims: &[usize]) -> ValueInfo {
    ValueInfo::new(
        name,
        Some(TypeInfo::Tensor {
            dtype: Some(DType::F32),
            shape: Some(dims.iter().map(|&d| Dim::Fixed(d)).collect()),
        }),
    )
}

fn init(name: &str, t: Tensor) -> Initializer {
    Initializer {
        name: name.into(),
        tensor: t,
    }
}

fn write(
    dir: &Path,
    file: &str,
    nodes: Vec<Node>,
    inputs: Vec<ValueInfo>,
    outputs: &[&str],
    initializers: Vec<Initializer>,
) -> PathBuf {
    let m = Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: "".into(),
            version: 17,
        }],
        producer_name: "npuc-test".into(),
        graph: Graph {
            name: file.into(),
            nodes,
            inputs,
            outputs: outputs.iter().map(|o| ValueInfo::new(*o, None)).collect(),
            initializers,
            ..Default::default()
        },
        ..Default::default()
    };
    let p = dir.join(file);
    npuc_onnx::save_model(&m, &p, &Default::default()).unwrap();
    p
}

fn ints(v: &[i64]) -> Tensor {
    Tensor::from_vec(vec![v.len()], v.to_vec()).unwrap()
}

#[test]
fn lstm_with_zero_hidden_units_is_refused_not_a_panic() {
    let d = tempfile::tempdir().unwrap();
    let w = Tensor::from_vec(vec![1, 0, 3], Vec::<f32>::new()).unwrap();
    let r = Tensor::from_vec(vec![1, 0, 0], Vec::<f32>::new()).unwrap();
    let m = write(
        d.path(),
        "lstm0.onnx",
        vec![Node::new("LSTM", &["x", "W", "R"], &["y"]).with_attr("hidden_size", Attr::Int(0))],
        vec![f32_input("x", &[2, 1, 3])],
        &["y"],
        vec![init("W", w), init("R", r)],
    );
    refused(
        &["bench", s(&m), "--runs", "1"],
        &[],
        &["LSTM", "hidden size is 0"],
    );
}

#[test]
fn outputs_larger_than_memory_are_refused_before_allocating() {
    let d = tempfile::tempdir().unwrap();
    let x4 = || vec![f32_input("x", &[1, 1, 4, 4])];
    let ones33 = || {
        init(
            "w",
            Tensor::from_vec(vec![1, 1, 3, 3], vec![1f32; 9]).unwrap(),
        )
    };
    let cases: Vec<(PathBuf, &str)> = vec![
        (
            write(
                d.path(),
                "convt.onnx",
                vec![Node::new("ConvTranspose", &["x", "w"], &["y"])
                    .with_attr("strides", Attr::Ints(vec![(1 << 30) + 1, 1]))
                    .with_attr("output_padding", Attr::Ints(vec![1 << 30, 0]))],
                x4(),
                &["y"],
                vec![ones33()],
            ),
            "ConvTranspose",
        ),
        (
            write(
                d.path(),
                "conv.onnx",
                vec![Node::new("Conv", &["x", "w"], &["y"])
                    .with_attr("pads", Attr::Ints(vec![0, 1 << 40, 0, 0]))],
                x4(),
                &["y"],
                vec![ones33()],
            ),
            "Conv",
        ),
        (
            write(
                d.path(),
                "pad.onnx",
                vec![Node::new("Pad", &["x", "p"], &["y"])],
                vec![f32_input("x", &[1, 4])],
                &["y"],
                vec![init("p", ints(&[0, 0, 0, 1 << 40]))],
            ),
            "Pad",
        ),
        (
            write(
                d.path(),
                "onehot.onnx",
                vec![Node::new("OneHot", &["i", "depth", "v"], &["y"])],
                vec![ValueInfo::new(
                    "i",
                    Some(TypeInfo::Tensor {
                        dtype: Some(DType::I64),
                        shape: Some(vec![Dim::Fixed(4)]),
                    }),
                )],
                &["y"],
                vec![
                    init("depth", Tensor::scalar(1i64 << 40)),
                    init("v", Tensor::from_vec(vec![2], vec![0f32, 1.0]).unwrap()),
                ],
            ),
            "OneHot",
        ),
        (
            write(
                d.path(),
                "resize.onnx",
                vec![Node::new("Resize", &["x", "", "scales"], &["y"])
                    .with_attr("mode", Attr::String("nearest".into()))],
                x4(),
                &["y"],
                vec![init(
                    "scales",
                    Tensor::from_vec(vec![4], vec![1f32, 1.0, 1e9, 1e9]).unwrap(),
                )],
            ),
            "Resize",
        ),
    ];
    for (m, op) in &cases {
        // The output is over a terabyte: refused whatever the machine's memory.
        for cmd in ["bench", "compile"] {
            let out = d.path().join("out.npuc");
            let args: Vec<&str> = if cmd == "bench" {
                vec!["bench", s(m), "--runs", "1"]
            } else {
                vec!["compile", s(m), "-o", s(&out)]
            };
            let err = refused(&args, &[], &["needs ", "more than the memory budget"]);
            if cmd == "bench" {
                assert!(
                    err.contains(op),
                    "{op}: the error does not name the node: {err}"
                );
            }
            assert!(!out.exists(), "compile wrote an artifact for {op}");
        }
        // Inspecting (which folds constants and infers shapes) never materializes it.
        let (o, took) = npuc(&["inspect", s(m)], &[]);
        assert!(
            o.status.code().is_some() && took < Duration::from_secs(MAX_SECONDS),
            "inspect {op}: {:?} after {took:?}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn huge_generated_inputs_and_budgets_name_the_flag_and_size() {
    let d = tempfile::tempdir().unwrap();
    let m = write(
        d.path(),
        "relu.onnx",
        vec![Node::new("Relu", &["x"], &["y"])],
        vec![ValueInfo::new(
            "x",
            Some(TypeInfo::Tensor {
                dtype: Some(DType::F32),
                shape: Some(vec![Dim::Symbolic("n".into())]),
            }),
        )],
        &["y"],
        vec![],
    );
    refused(
        &[
            "bench",
            s(&m),
            "--input-shape",
            "x=100000000000",
            "--runs",
            "1",
        ],
        &[],
        &["input 'x'", "400000000000 bytes", "memory budget"],
    );
    // An explicit budget is the one applied, and named.
    refused(
        &[
            "bench",
            s(&m),
            "--input-shape",
            "x=100000000",
            "--runs",
            "1",
            "--max-memory",
            "64M",
        ],
        &[],
        &["400000000 bytes", "--max-memory"],
    );
    refused(
        &["bench", s(&m), "--max-memory", "lots"],
        &[],
        &["--max-memory", "'lots' is not a size"],
    );
}

/// `Loop(M, cond, ...)` whose body passes the condition through unchanged and returns
/// `carried + 1` and, when `scan` is set, a 1 MiB constant as a scan output.
fn loop_model(dir: &Path, file: &str, trips: i64, scan: bool) -> PathBuf {
    let mut body_nodes = vec![
        Node::new("Identity", &["c_in"], &["c_out"]),
        Node::new("Add", &["v_in", "one"], &["v_out"]),
    ];
    let mut body_outputs = vec![ValueInfo::new("c_out", None), ValueInfo::new("v_out", None)];
    if scan {
        body_nodes.push(Node::new("Constant", &[], &["s"]).with_attr(
            "value",
            Attr::Tensor(Tensor::from_vec(vec![512, 512], vec![1f32; 512 * 512]).unwrap()),
        ));
        body_outputs.push(ValueInfo::new("s", None));
    }
    let scalar = |name: &str, dt: DType| {
        ValueInfo::new(
            name,
            Some(TypeInfo::Tensor {
                dtype: Some(dt),
                shape: Some(vec![]),
            }),
        )
    };
    let body = Graph {
        name: "body".into(),
        nodes: body_nodes,
        inputs: vec![
            scalar("i", DType::I64),
            scalar("c_in", DType::Bool),
            f32_input("v_in", &[1]),
        ],
        outputs: body_outputs,
        initializers: vec![init("one", Tensor::from_vec(vec![1], vec![1f32]).unwrap())],
        ..Default::default()
    };
    let outs: &[&str] = if scan { &["v", "scan"] } else { &["v"] };
    write(
        dir,
        file,
        vec![Node::new("Loop", &["M", "cond", "x"], outs)
            .with_attr("body", Attr::Graph(Box::new(body)))],
        vec![f32_input("x", &[1])],
        outs,
        vec![
            init("M", Tensor::scalar(trips)),
            init("cond", Tensor::scalar(true)),
        ],
    )
}

#[test]
fn a_loop_that_never_ends_is_stopped_with_the_limit_named() {
    let d = tempfile::tempdir().unwrap();
    let m = loop_model(d.path(), "loop.onnx", 1 << 62, false);
    // The default limit (10^6 iterations of this body) ends within seconds.
    let err = refused(
        &["bench", s(&m), "--runs", "1"],
        &[],
        &["Loop", "NPUC_MAX_LOOP_ITERATIONS"],
    );
    assert!(err.contains("stopped after 1000000 iterations"), "{err}");
    // A lower limit from the environment is the one applied.
    let err = refused(
        &["bench", s(&m), "--runs", "1"],
        &[("NPUC_MAX_LOOP_ITERATIONS", "1000")],
        &["stopped after 1000 iterations"],
    );
    assert!(err.contains(&format!("trip count {}", 1i64 << 62)), "{err}");
    // A loop within the limit runs: 50 iterations add 50.
    let ok = loop_model(d.path(), "loop50.onnx", 50, false);
    let x = d.path().join("x.npy");
    std::fs::write(
        &x,
        npuc_cli::npy::npy_bytes(&Tensor::from_vec(vec![1], vec![0f32]).unwrap()).unwrap(),
    )
    .unwrap();
    let (o, _) = npuc(&["run", s(&ok), "--input", &format!("x={}", s(&x))], &[]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("50"),
        "{out} {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_loop_whose_scan_output_outgrows_the_budget_is_stopped() {
    let d = tempfile::tempdir().unwrap();
    // 10^5 iterations of a 1 MiB scan output: 100 GB stacked; the budget is 256 MiB.
    let m = loop_model(d.path(), "loopscan.onnx", 100_000, true);
    refused(
        &["bench", s(&m), "--runs", "1", "--max-memory", "256M"],
        &[],
        &["Loop", "the scan outputs after", "--max-memory"],
    );
}

#[test]
fn malformed_nodes_are_refused_by_run_and_compile_alike() {
    let d = tempfile::tempdir().unwrap();
    let perm = write(
        d.path(),
        "perm.onnx",
        vec![Node::new("Transpose", &["x"], &["y"]).with_attr("perm", Attr::Ints(vec![0, 0]))],
        vec![f32_input("x", &[2, 3])],
        &["y"],
        vec![],
    );
    let split = write(
        d.path(),
        "split.onnx",
        vec![Node::new("Split", &["x", "s"], &["a", "b"])],
        vec![f32_input("x", &[6])],
        &["a", "b"],
        vec![init("s", ints(&[2, 2, 2]))],
    );
    for (m, needle) in [(&perm, "Transpose"), (&split, "Split")] {
        refused(&["bench", s(m), "--runs", "1"], &[], &[needle]);
        let out = d.path().join("out.npuc");
        refused(
            &["compile", s(m), "-o", s(&out)],
            &[],
            &["cannot run", needle],
        );
        assert!(!out.exists(), "compile wrote an artifact for {}", s(m));
    }
}

#[test]
fn inspect_reports_an_invalid_graph_as_invalid() {
    let d = tempfile::tempdir().unwrap();
    let undefined = write(
        d.path(),
        "undef.onnx",
        vec![Node::new("Relu", &["nope"], &["y"])],
        vec![f32_input("x", &[2])],
        &["y"],
        vec![],
    );
    let mismatch = write(
        d.path(),
        "mm.onnx",
        vec![Node::new("MatMul", &["x", "w"], &["y"])],
        vec![f32_input("x", &[2, 3])],
        &["y"],
        vec![init(
            "w",
            Tensor::from_vec(vec![4, 5], vec![1f32; 20]).unwrap(),
        )],
    );
    let cycle = write(
        d.path(),
        "cycle.onnx",
        vec![
            Node::new("Add", &["x", "b"], &["a"]),
            Node::new("Relu", &["a"], &["b"]),
        ],
        vec![f32_input("x", &[2])],
        &["b"],
        vec![],
    );
    for (m, needle) in [
        (&undefined, "nope"),
        (&mismatch, "MatMul"),
        (&cycle, "cycle"),
    ] {
        let (o, _) = npuc(&["inspect", s(m)], &[]);
        let out = String::from_utf8_lossy(&o.stdout);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{}: {out} {err}", s(m));
        let first = out.lines().next().unwrap_or("");
        assert!(
            first.starts_with("INVALID"),
            "{}: the reason is not first: {out}",
            s(m)
        );
        assert!(
            (first.to_lowercase() + &err.to_lowercase()).contains(&needle.to_lowercase()),
            "{}: no '{needle}' in: {first} / {err}",
            s(m)
        );
        // What could be read is still printed.
        assert!(out.contains("nodes "), "{out}");
        let (o, _) = npuc(&["inspect", s(m), "--json"], &[]);
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(o.status.code(), Some(1));
        assert_eq!(j["valid"], false);
        assert!(!j["problems"].as_array().unwrap().is_empty());
    }
}

#[test]
fn a_flipped_bit_in_an_artifacts_weights_is_an_error_naming_the_tensor() {
    let d = tempfile::tempdir().unwrap();
    let w: Vec<f32> = (0..64 * 64).map(|i| (i % 17) as f32 / 17.0).collect();
    let m = write(
        d.path(),
        "mm.onnx",
        vec![Node::new("MatMul", &["x", "w"], &["y"])],
        vec![f32_input("x", &[1, 64])],
        &["y"],
        vec![init("w", Tensor::from_vec(vec![64, 64], w).unwrap())],
    );
    let art = d.path().join("mm.npuc");
    let (o, _) = npuc(&["compile", s(&m), "-o", s(&art)], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (o, _) = npuc(&["bench", s(&art), "--runs", "1"], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Flip one bit in the middle of the weight's bytes (found by its pattern: 1/17 as f32).
    let mut bytes = std::fs::read(&art).unwrap();
    let needle = (1f32 / 17.0).to_le_bytes();
    let at = bytes
        .windows(4)
        .position(|w| w == needle)
        .expect("the weight's bytes are in the artifact");
    bytes[at + 2] ^= 0x10;
    std::fs::write(&art, &bytes).unwrap();
    refused(
        &["bench", s(&art), "--runs", "1"],
        &[],
        &["corrupt", "checksum", "/w", "--trust"],
    );
    // `--trust` skips the check (and runs on the corrupt weights).
    let (o, _) = npuc(&["bench", s(&art), "--runs", "1", "--trust"], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_killed_writers_temp_file_is_removed_by_the_next_write() {
    let d = tempfile::tempdir().unwrap();
    let m = write(
        d.path(),
        "relu.onnx",
        vec![Node::new("Relu", &["x"], &["y"])],
        vec![f32_input("x", &[4])],
        &["y"],
        vec![],
    );
    // What a compile killed with SIGKILL leaves: `.NAME.tmp-PID-RANDOM` of a dead process.
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = d.path().join(format!(".out.npuc.tmp-{dead}-abc123"));
    std::fs::write(&stale, b"half an artifact").unwrap();
    let out = d.path().join("out.npuc");
    let (o, _) = npuc(&["compile", s(&m), "-o", s(&out)], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.exists());
    assert!(
        !stale.exists(),
        "the dead writer's temp file is still there"
    );
}

/// Writes `t` as `.npy` at `dir/name`.
fn npy(dir: &Path, name: &str, t: &Tensor) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, npuc_cli::npy::npy_bytes(t).unwrap()).unwrap();
    p
}

#[test]
fn lstm_with_zero_hidden_units_is_refused_by_inspect_and_run_too() {
    let d = tempfile::tempdir().unwrap();
    let w = Tensor::from_vec(vec![1, 0, 3], Vec::<f32>::new()).unwrap();
    let r = Tensor::from_vec(vec![1, 0, 0], Vec::<f32>::new()).unwrap();
    let m = write(
        d.path(),
        "lstm0.onnx",
        vec![Node::new("LSTM", &["x", "W", "R"], &["y"]).with_attr("hidden_size", Attr::Int(0))],
        vec![f32_input("x", &[2, 1, 3])],
        &["y"],
        vec![init("W", w), init("R", r)],
    );
    let x = npy(
        d.path(),
        "x.npy",
        &Tensor::from_vec(vec![2, 1, 3], vec![0.5f32; 6]).unwrap(),
    );
    refused(
        &["run", s(&m), "--input", &format!("x={}", s(&x))],
        &[],
        &["LSTM", "hidden size is 0"],
    );
    // inspect reports the graph as invalid (exit 1, the reason first), not "all supported";
    // compile refuses it.
    let (o, took) = npuc(&["inspect", s(&m)], &[]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(took < Duration::from_secs(MAX_SECONDS));
    assert!(
        out.starts_with("INVALID") && out.contains("hidden size is 0"),
        "{out}"
    );
    let art = d.path().join("lstm0.npuc");
    refused(
        &["compile", s(&m), "-o", s(&art)],
        &[],
        &["cannot run", "hidden size is 0"],
    );
    assert!(!art.exists());
}

#[test]
fn a_loop_that_never_ends_is_stopped_in_run_and_inspect_ends() {
    let d = tempfile::tempdir().unwrap();
    let m = loop_model(d.path(), "loop.onnx", 1 << 62, false);
    let x = npy(
        d.path(),
        "x.npy",
        &Tensor::from_vec(vec![1], vec![0f32]).unwrap(),
    );
    refused(
        &["run", s(&m), "--input", &format!("x={}", s(&x))],
        &[("NPUC_MAX_LOOP_ITERATIONS", "1000")],
        &[
            "Loop",
            "stopped after 1000 iterations",
            "NPUC_MAX_LOOP_ITERATIONS",
        ],
    );
    // inspect (static inference and constant folding) does not run the loop: it ends.
    let (o, took) = npuc(&["inspect", s(&m)], &[]);
    assert!(
        matches!(o.status.code(), Some(0..=2)) && took < Duration::from_secs(MAX_SECONDS),
        "inspect: {:?} after {took:?}: {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn the_same_input_given_twice_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = write(
        d.path(),
        "relu.onnx",
        vec![Node::new("Relu", &["x"], &["y"])],
        vec![f32_input("x", &[4])],
        &["y"],
        vec![],
    );
    let x = npy(
        d.path(),
        "x.npy",
        &Tensor::from_vec(vec![4], vec![1f32; 4]).unwrap(),
    );
    let arg = format!("x={}", s(&x));
    for cmd in ["run", "bench"] {
        refused(
            &[cmd, s(&m), "-i", &arg, "--input", &arg],
            &[],
            &["--input x is given twice"],
        );
    }
}

#[test]
fn a_context_no_machine_holds_is_refused_naming_the_flag_and_size() {
    let gguf = npuc_testsupport::smollm2_gguf();
    let err = refused(
        &[
            "generate",
            s(&gguf),
            "--prompt",
            "Hi",
            "--max-tokens",
            "1",
            "--ctx",
            "4294967295",
        ],
        &[],
        &["--ctx"],
    );
    assert!(
        err.contains("bytes") || err.contains("memory") || err.contains("GB"),
        "the error does not give the size: {err}"
    );
}

/// The section of kind `kind` of an artifact: (offset, length).
fn section(b: &[u8], kind: u32) -> (usize, usize) {
    let le64 = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap()) as usize;
    let n = u32::from_le_bytes(b[16..20].try_into().unwrap()) as usize;
    let table = le64(24);
    (0..n)
        .map(|i| table + i * npuc_format::SECTION_ENTRY_LEN)
        .find(|&e| u32::from_le_bytes(b[e..e + 4].try_into().unwrap()) == kind)
        .map(|e| (le64(e + 8), le64(e + 16)))
        .expect("the artifact has the section")
}

#[test]
fn every_one_of_54_weight_bit_flips_is_caught() {
    // The review found 51 of 54 flips unnoticed; each must now be an error naming a tensor.
    let d = tempfile::tempdir().unwrap();
    let w: Vec<f32> = (0..64 * 64).map(|i| (i % 17) as f32 / 17.0).collect();
    let b: Vec<f32> = (0..64).map(|i| i as f32 + 0.25).collect();
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (wb, bb) = (bytes(&w), bytes(&b));
    let m = write(
        d.path(),
        "mm.onnx",
        vec![
            Node::new("MatMul", &["x", "w"], &["h"]),
            Node::new("Add", &["h", "b"], &["y"]),
        ],
        vec![f32_input("x", &[1, 64])],
        &["y"],
        vec![
            init("w", Tensor::from_vec(vec![64, 64], w).unwrap()),
            init("b", Tensor::from_vec(vec![64], b).unwrap()),
        ],
    );
    let art = d.path().join("mm.npuc");
    // Unoptimized, so the weights are stored as given and can be found by their bytes.
    let (o, _) = npuc(&["compile", s(&m), "-o", s(&art), "--no-optimize"], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let orig = std::fs::read(&art).unwrap();
    let (off, len) = section(&orig, npuc_format::SECTION_WEIGHTS);
    let find = |t: &[u8]| {
        off + orig[off..off + len]
            .windows(t.len())
            .position(|x| x == t)
            .expect("the weight's bytes are in the weights section")
    };
    let (w_at, b_at) = (find(&wb), find(&bb));
    // 48 flips across w, 6 across b.
    let spots: Vec<usize> = (0..48)
        .map(|k| w_at + k * (wb.len() - 1) / 47)
        .chain((0..6).map(|k| b_at + k * (bb.len() - 1) / 5))
        .collect();
    let bad = d.path().join("bad.npuc");
    for (k, &at) in spots.iter().enumerate() {
        // One bit each, in different bit positions.
        let mut b = orig.clone();
        b[at] ^= 1 << (k % 8);
        std::fs::write(&bad, &b).unwrap();
        let tensor = if at >= b_at && at < b_at + bb.len() {
            "/b"
        } else {
            "/w"
        };
        refused(
            &["bench", s(&bad), "--runs", "1"],
            &[],
            &["corrupt", "checksum", tensor],
        );
    }
    assert_eq!(spots.len(), 54);
}
