//! `npuc bench --trace FILE` writes a Chrome trace (trace-event JSON, what Perfetto and
//! chrome://tracing open) with one complete event per node: checked against the format's schema
//! (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU: `ph` "X"
//! events carry `name`, `ts`, `dur`, `pid`, `tid`; `ph` "M" metadata events name a process or
//! thread in `args.name`) and for covering every node of the graph, in execution order.

use npuc_ir::{
    DType, Dim, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo,
};
use std::process::Command;

#[test]
fn bench_trace_is_a_valid_chrome_trace_covering_every_node() {
    let d = tempfile::tempdir().unwrap();
    let w = Tensor::from_vec(vec![8, 8], (0..64).map(|i| i as f32 / 64.0).collect()).unwrap();
    let nodes = vec![
        Node::new("MatMul", &["x", "w"], &["h"]),
        Node::new("Relu", &["h"], &["r"]),
        Node::new("Softmax", &["r"], &["s"]),
        Node::new("Add", &["s", "x"], &["y"]),
    ];
    let m = Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: "".into(),
            version: 17,
        }],
        graph: Graph {
            name: "t".into(),
            nodes: nodes.clone(),
            inputs: vec![ValueInfo::new(
                "x",
                Some(TypeInfo::Tensor {
                    dtype: Some(DType::F32),
                    shape: Some(vec![Dim::Fixed(2), Dim::Fixed(8)]),
                }),
            )],
            outputs: vec![ValueInfo::new("y", None)],
            initializers: vec![Initializer {
                name: "w".into(),
                tensor: w,
            }],
            ..Default::default()
        },
        ..Default::default()
    };
    let onnx = d.path().join("t.onnx");
    npuc_onnx::save_model(&m, &onnx, &Default::default()).unwrap();
    let trace = d.path().join("trace.json");
    let o = Command::new(env!("CARGO_BIN_EXE_npuc"))
        // As imported: one span per node of the model.
        .args([
            "bench",
            onnx.to_str().unwrap(),
            "--runs",
            "2",
            "--no-optimize",
            "--trace",
        ])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"]
        .as_array()
        .expect("traceEvents is an array");
    let mut spans = vec![];
    let mut named_thread = false;
    for e in events {
        let ph = e["ph"].as_str().expect("every event has a phase");
        assert!(e["pid"].is_u64() && e["tid"].is_u64(), "pid/tid: {e}");
        assert!(e["name"].is_string(), "name: {e}");
        match ph {
            "X" => {
                let (ts, dur) = (e["ts"].as_f64(), e["dur"].as_f64());
                assert!(ts.is_some_and(|t| t >= 0.0), "ts: {e}");
                assert!(dur.is_some_and(|t| t >= 0.0), "dur: {e}");
                spans.push(e);
            }
            "M" => {
                assert!(
                    e["args"]["name"].is_string(),
                    "metadata without a name: {e}"
                );
                named_thread |= e["name"] == "thread_name";
            }
            other => panic!("unexpected phase {other}: {e}"),
        }
    }
    assert!(named_thread, "the executing thread is not named");
    // One span per node, in execution order, not overlapping, with op and output shapes.
    assert_eq!(spans.len(), nodes.len(), "{events:?}");
    let mut end = 0.0;
    for (e, n) in spans.iter().zip(&nodes) {
        assert_eq!(e["name"], n.display_name().as_str());
        assert_eq!(e["args"]["op"], n.op_type.as_str());
        assert_eq!(e["args"]["outputs"][0], "f32[2, 8]", "{e}");
        let ts = e["ts"].as_f64().unwrap();
        assert!(ts >= end, "spans overlap: {e}");
        end = ts + e["dur"].as_f64().unwrap();
    }
    // LLM benchmarks do not take the flag (their token loop is not one graph run).
    let o = Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args([
            "bench",
            onnx.to_str().unwrap(),
            "--prompt-len",
            "4",
            "--trace",
        ])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--trace"));
}
