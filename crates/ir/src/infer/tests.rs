//! Unit tests of inference on hand-built graphs: symbolic dims, constant propagation, problems
//! and uncovered ops.

use super::*;
use crate::dtype::DType;
use crate::graph::{Attr, Initializer, ValueInfo};

fn sym(s: &str) -> Dim {
    Dim::Symbolic(s.into())
}

fn input(name: &str, dtype: DType, dims: Vec<Dim>) -> ValueInfo {
    ValueInfo::new(
        name,
        Some(TypeInfo::Tensor {
            dtype: Some(dtype),
            shape: Some(dims),
        }),
    )
}

fn init_i64(name: &str, v: Vec<i64>) -> Initializer {
    Initializer {
        name: name.into(),
        tensor: Tensor::from_vec(vec![v.len()], v).unwrap(),
    }
}

fn opset(v: i64) -> Vec<OpsetImport> {
    vec![OpsetImport {
        domain: String::new(),
        version: v,
    }]
}

fn shape_of(r: &InferResult, name: &str) -> Option<Vec<Dim>> {
    match r.type_of(name)? {
        TypeInfo::Tensor { shape, .. } => shape.clone(),
        _ => None,
    }
}

#[test]
fn symbolic_batch_flows_through_shape_arithmetic() {
    // x: [batch, 3, 4] -> Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])) = [batch, 12]
    let g = Graph {
        inputs: vec![input(
            "x",
            DType::F32,
            vec![sym("batch"), Dim::Fixed(3), Dim::Fixed(4)],
        )],
        initializers: vec![
            init_i64("minus1", vec![-1]),
            init_i64("zero_axis", vec![0]),
            Initializer {
                name: "idx0".into(),
                tensor: Tensor::scalar(0i64),
            },
        ],
        nodes: vec![
            Node::new("Shape", &["x"], &["s"]),
            Node::new("Gather", &["s", "idx0"], &["b"]),
            Node::new("Unsqueeze", &["b", "zero_axis"], &["b1"]),
            Node::new("Concat", &["b1", "minus1"], &["target"]).with_attr("axis", Attr::Int(0)),
            Node::new("Reshape", &["x", "target"], &["y"]),
            Node::new("Add", &["y", "one"], &["z"]),
        ],
        ..Default::default()
    };
    let mut g = g;
    g.initializers.push(Initializer {
        name: "one".into(),
        tensor: Tensor::from_vec(vec![1, 1], vec![1.0f32]).unwrap(),
    });
    let r = infer_graph(&g, &opset(17), &HashMap::new());
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(shape_of(&r, "y"), Some(vec![sym("batch"), Dim::Fixed(12)]));
    assert_eq!(shape_of(&r, "z"), Some(vec![sym("batch"), Dim::Fixed(12)]));
    // Binding the input to a fixed shape makes everything fixed.
    let bound = HashMap::from([("x".to_string(), TypeInfo::tensor(DType::F32, &[2, 3, 4]))]);
    let r = infer_graph(&g, &opset(17), &bound);
    assert_eq!(
        r.type_of("z"),
        Some(&TypeInfo::tensor(DType::F32, &[2, 12]))
    );
    assert_eq!(
        r.values.get("target").and_then(|k| k.as_ints()),
        Some(vec![2, -1])
    );
}

#[test]
fn matmul_inner_mismatch_names_the_node() {
    let mut mm = Node::new("MatMul", &["a", "b"], &["c"]);
    mm.name = "x".into();
    let g = Graph {
        inputs: vec![
            input("a", DType::F32, vec![Dim::Fixed(8), Dim::Fixed(64)]),
            input("b", DType::F32, vec![Dim::Fixed(32), Dim::Fixed(16)]),
        ],
        nodes: vec![mm, Node::new("Relu", &["c"], &["d"])],
        ..Default::default()
    };
    let r = infer_graph(&g, &opset(17), &HashMap::new());
    assert_eq!(r.problems.len(), 1);
    assert_eq!(
        r.problems[0].to_string(),
        "node 'x' (MatMul): inner dimensions 64 and 32 do not match"
    );
    // Inference carries on with an unknown type.
    assert_eq!(r.type_of("d"), Some(&unknown()));
}

#[test]
fn broadcasting_keeps_symbols_and_never_guesses() {
    let g = Graph {
        inputs: vec![
            input(
                "a",
                DType::F32,
                vec![sym("batch"), Dim::Fixed(1), Dim::Unknown],
            ),
            input(
                "b",
                DType::F32,
                vec![Dim::Fixed(1), Dim::Fixed(5), sym("n")],
            ),
        ],
        nodes: vec![Node::new("Mul", &["a", "b"], &["c"])],
        ..Default::default()
    };
    let r = infer_graph(&g, &opset(17), &HashMap::new());
    // `?` against `n` could be either (one of them may be 1): unknown.
    assert_eq!(
        shape_of(&r, "c"),
        Some(vec![sym("batch"), Dim::Fixed(5), Dim::Unknown])
    );
}

#[test]
fn uncovered_ops_are_listed_not_errors() {
    let mut n = Node::new("FancyOp", &["a"], &["b"]);
    n.domain = "com.example".into();
    let g = Graph {
        inputs: vec![input("a", DType::F32, vec![Dim::Fixed(2)])],
        nodes: vec![n, Node::new("Shape", &["b"], &["s"])],
        ..Default::default()
    };
    let r = infer_graph(&g, &opset(17), &HashMap::new());
    assert!(r.problems.is_empty());
    assert_eq!(r.not_inferred.len(), 1);
    assert_eq!(r.not_inferred[0].op, "FancyOp");
    assert_eq!(r.type_of("b"), Some(&unknown()));
    assert_eq!(
        r.type_of("s"),
        Some(&TypeInfo::Tensor {
            dtype: Some(DType::I64),
            shape: Some(vec![Dim::Unknown])
        })
    );
}

#[test]
fn constant_of_shape_and_conv_resolve_from_folded_shapes() {
    // ConstantOfShape(Shape(x)[2:]) * 2 -> sizes for Resize; then a strided Conv.
    let g = Graph {
        inputs: vec![input(
            "x",
            DType::F32,
            vec![Dim::Fixed(1), Dim::Fixed(3), Dim::Fixed(10), Dim::Fixed(12)],
        )],
        initializers: vec![
            init_i64("two", vec![2]),
            init_i64("nc", vec![1, 3]),
            Initializer {
                name: "w".into(),
                tensor: Tensor::zeros(DType::F32, vec![8, 3, 3, 3]),
            },
        ],
        nodes: vec![
            Node::new("Shape", &["x"], &["s"]).with_attr("start", Attr::Int(2)),
            Node::new("Mul", &["s", "two"], &["hw2"]),
            Node::new("Concat", &["nc", "hw2"], &["sizes"]).with_attr("axis", Attr::Int(0)),
            Node::new("Resize", &["x", "", "", "sizes"], &["up"]),
            Node::new("Conv", &["up", "w"], &["c"])
                .with_attr("strides", Attr::Ints(vec![2, 2]))
                .with_attr("pads", Attr::Ints(vec![1, 1, 1, 1])),
            Node::new("ConstantOfShape", &["hw2"], &["zeros"]),
        ],
        ..Default::default()
    };
    let r = infer_graph(&g, &opset(18), &HashMap::new());
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(
        r.type_of("up"),
        Some(&TypeInfo::tensor(DType::F32, &[1, 3, 20, 24]))
    );
    assert_eq!(
        r.type_of("c"),
        Some(&TypeInfo::tensor(DType::F32, &[1, 8, 10, 12]))
    );
    assert_eq!(
        r.type_of("zeros"),
        Some(&TypeInfo::tensor(DType::F32, &[20, 24]))
    );
}

#[test]
fn malformed_nodes_report_problems() {
    let g = Graph {
        inputs: vec![input("a", DType::F32, vec![Dim::Fixed(2), Dim::Fixed(3)])],
        nodes: vec![
            Node::new("Transpose", &["a"], &["t"]).with_attr("perm", Attr::Ints(vec![0, 5])),
            Node::new("Concat", &["a", "a"], &["c"]),
            Node::new("Softmax", &[], &["s"]),
            Node::new("Squeeze", &["a"], &["q"]).with_attr("axes", Attr::Ints(vec![1])),
        ],
        ..Default::default()
    };
    let r = infer_graph(&g, &opset(11), &HashMap::new());
    let msgs: Vec<String> = r.problems.iter().map(|p| p.to_string()).collect();
    assert_eq!(msgs.len(), 4, "{msgs:?}");
    assert!(msgs[0].contains("axis 5 is out of range"), "{msgs:?}");
    assert!(msgs[1].contains("'axis' is missing"), "{msgs:?}");
    assert!(msgs[2].contains("input 0 is missing"), "{msgs:?}");
    assert!(
        msgs[3].contains("cannot squeeze axis 1 of size 3"),
        "{msgs:?}"
    );
}
