//! Bad input gets a clear error naming the node, tensor or input — never a panic.

use npuc_ir::{DType, Dim, Graph, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo};
use npuc_runtime::{RtError, Session, SessionOptions, Value};

fn input(name: &str, dims: Vec<Dim>) -> ValueInfo {
    ValueInfo::new(
        name,
        Some(TypeInfo::Tensor {
            dtype: Some(DType::F32),
            shape: Some(dims),
        }),
    )
}

fn model(nodes: Vec<Node>, inputs: Vec<ValueInfo>, outputs: &[&str]) -> Model {
    Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: 17,
        }],
        graph: Graph {
            name: "g".into(),
            nodes,
            inputs,
            outputs: outputs.iter().map(|o| ValueInfo::new(*o, None)).collect(),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn named(mut n: Node, name: &str) -> Node {
    n.name = name.into();
    n
}

fn f32s(shape: Vec<usize>) -> Value {
    let n = shape.iter().product();
    Value::tensor(Tensor::from_vec(shape, vec![1.0f32; n]).unwrap())
}

#[test]
fn cycle_is_reported_with_node_names() {
    let m = model(
        vec![
            named(Node::new("Add", &["x", "b"], &["a"]), "first"),
            named(Node::new("Relu", &["a"], &["b"]), "second"),
        ],
        vec![input("x", vec![Dim::Fixed(2)])],
        &["b"],
    );
    let e = Session::new(&m, SessionOptions::default())
        .err()
        .expect("cycle rejected")
        .to_string();
    assert!(
        e.contains("cycle") && e.contains("'first'") && e.contains("'second'"),
        "{e}"
    );
}

#[test]
fn undefined_input_is_named() {
    let m = model(
        vec![named(Node::new("Add", &["x", "ghost"], &["y"]), "adder")],
        vec![input("x", vec![Dim::Fixed(2)])],
        &["y"],
    );
    let e = Session::new(&m, SessionOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("'adder'") && e.contains("'ghost'"), "{e}");
}

#[test]
fn unsupported_op_lists_node_and_op() {
    let mut n = named(Node::new("FancyOp", &["x"], &["y"]), "mystery");
    n.domain = "com.example".into();
    let m = model(vec![n], vec![input("x", vec![Dim::Fixed(2)])], &["y"]);
    match Session::new(&m, SessionOptions::default()) {
        Err(RtError::Unsupported(list)) => {
            assert!(
                list[0].contains("com.example.FancyOp opset 1") && list[0].contains("'mystery'"),
                "{list:?}"
            )
        }
        other => panic!("expected Unsupported, got {:?}", other.err()),
    }
}

#[test]
fn wrong_input_dtype_shape_and_name() {
    let m = model(
        vec![Node::new("Relu", &["x"], &["y"])],
        vec![input(
            "x",
            vec![Dim::Symbolic("batch".into()), Dim::Fixed(3)],
        )],
        &["y"],
    );
    let s = Session::new(&m, SessionOptions::default()).unwrap();
    assert!(s.run(vec![("x".into(), f32s(vec![4, 3]))]).is_ok());
    let e = s
        .run(vec![("x".into(), f32s(vec![4, 5]))])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'x'") && e.contains("dimension 1 must be 3"),
        "{e}"
    );
    let e = s
        .run(vec![("x".into(), f32s(vec![3]))])
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank"), "{e}");
    let ints = Value::tensor(Tensor::from_vec(vec![1, 3], vec![1i64, 2, 3]).unwrap());
    let e = s.run(vec![("x".into(), ints)]).unwrap_err().to_string();
    assert!(e.contains("expected dtype f32, got i64"), "{e}");
    let e = s
        .run(vec![("nope".into(), f32s(vec![1, 3]))])
        .unwrap_err()
        .to_string();
    assert!(e.contains("'nope'") && e.contains("no such input"), "{e}");
    let e = s.run(vec![]).unwrap_err().to_string();
    assert!(e.contains("no value was given"), "{e}");
}

#[test]
fn kernel_errors_name_the_node() {
    let m = model(
        vec![named(Node::new("Add", &["x", "z"], &["y"]), "bad_add")],
        vec![
            input("x", vec![Dim::Unknown]),
            input("z", vec![Dim::Unknown]),
        ],
        &["y"],
    );
    let s = Session::new(&m, SessionOptions::default()).unwrap();
    let e = s
        .run(vec![
            ("x".into(), f32s(vec![3])),
            ("z".into(), f32s(vec![4])),
        ])
        .unwrap_err()
        .to_string();
    assert!(e.contains("'bad_add'") && e.contains("Add"), "{e}");
}

/// Found by the fuzzer (`onnx-graph-suite`): Split with `num_outputs = 2^40` and two outputs
/// sized its list of lengths from the attribute and aborted the process allocating 8 TB.
#[test]
fn split_num_outputs_other_than_the_outputs_is_an_error() {
    for n in [1i64 << 40, 3, 1] {
        let mut m = model(
            vec![named(
                Node::new("Split", &["x"], &["a", "b"])
                    .with_attr("num_outputs", npuc_ir::Attr::Int(n)),
                "split",
            )],
            vec![input("x", vec![Dim::Fixed(4)])],
            &["a", "b"],
        );
        m.opset_imports[0].version = 18;
        let s = Session::new(&m, SessionOptions::default()).unwrap();
        let e = s
            .run(vec![("x".into(), f32s(vec![4]))])
            .expect_err("refused")
            .to_string();
        assert!(
            e.contains("num_outputs") && e.contains(&n.to_string()) && e.contains("'split'"),
            "{e}"
        );
    }
    // num_outputs equal to the outputs still splits (the last part may be smaller).
    let mut m = model(
        vec![
            Node::new("Split", &["x"], &["a", "b"]).with_attr("num_outputs", npuc_ir::Attr::Int(2))
        ],
        vec![input("x", vec![Dim::Fixed(3)])],
        &["a", "b"],
    );
    m.opset_imports[0].version = 18;
    let out = Session::new(&m, SessionOptions::default())
        .unwrap()
        .run(vec![("x".into(), f32s(vec![3]))])
        .unwrap();
    let shapes: Vec<Vec<usize>> = out
        .iter()
        .map(|(_, v)| v.as_tensor().unwrap().shape().to_vec())
        .collect();
    assert_eq!(shapes, vec![vec![2], vec![1]]);
}

/// Found by the fuzzer (`onnx-graph-suite`): RoiAlign kept `output_height x output_width x
/// sampling_ratio^2` samples per ROI without a check, so a large `sampling_ratio` aborted the
/// process (6 GB asked under a 6 GB address-space limit; OOM-killed without one).
#[test]
fn roi_align_sample_count_is_checked_against_the_memory_budget() {
    let mut m = model(
        vec![named(
            Node::new("RoiAlign", &["x", "rois", "idx"], &["y"])
                .with_attr("sampling_ratio", npuc_ir::Attr::Int(1 << 20)),
            "roi",
        )],
        vec![
            input(
                "x",
                vec![Dim::Fixed(1), Dim::Fixed(1), Dim::Fixed(4), Dim::Fixed(4)],
            ),
            input("rois", vec![Dim::Fixed(1), Dim::Fixed(4)]),
            ValueInfo::new(
                "idx",
                Some(TypeInfo::Tensor {
                    dtype: Some(DType::I64),
                    shape: Some(vec![Dim::Fixed(1)]),
                }),
            ),
        ],
        &["y"],
    );
    m.opset_imports[0].version = 16;
    let s = Session::new(&m, SessionOptions::default()).unwrap();
    let feeds = || {
        vec![
            ("x".to_string(), f32s(vec![1, 1, 4, 4])),
            (
                "rois".to_string(),
                Value::tensor(Tensor::from_vec(vec![1, 4], vec![0f32, 0.0, 3.0, 3.0]).unwrap()),
            ),
            (
                "idx".to_string(),
                Value::tensor(Tensor::from_vec(vec![1], vec![0i64]).unwrap()),
            ),
        ]
    };
    let t = std::time::Instant::now();
    let e = s.run(feeds()).expect_err("refused").to_string();
    assert!(
        e.contains("'roi'") && e.contains("sampling_ratio") && e.contains("memory budget"),
        "{e}"
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    // A sensible ratio runs: all ones in, ones out.
    m.graph.nodes[0].attrs = vec![("sampling_ratio".into(), npuc_ir::Attr::Int(2))];
    let out = Session::new(&m, SessionOptions::default())
        .unwrap()
        .run(feeds())
        .unwrap();
    let y = out[0]
        .1
        .as_tensor()
        .unwrap()
        .as_slice::<f32>()
        .unwrap()
        .to_vec();
    assert_eq!(y, vec![1.0]);
}
