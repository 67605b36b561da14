//! Helpers for building small models in unit tests and comparing them before/after a pass.

use npuc_ir::{DType, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo};
use npuc_runtime::{Session, SessionOptions, Value};

pub fn f32s(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::from_vec(shape.to_vec(), v.to_vec()).unwrap()
}

pub fn i64s(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::from_vec(shape.to_vec(), v.to_vec()).unwrap()
}

pub fn init(name: &str, t: Tensor) -> Initializer {
    Initializer {
        name: name.into(),
        tensor: t,
    }
}

/// A model (opset 17) with f32 inputs of fixed shapes and untyped outputs.
pub fn model(nodes: Vec<Node>, inputs: &[(&str, &[usize])], outputs: &[&str]) -> Model {
    Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: 17,
        }],
        graph: Graph {
            name: "g".into(),
            nodes,
            inputs: inputs
                .iter()
                .map(|(n, s)| ValueInfo::new(*n, Some(TypeInfo::tensor(DType::F32, s))))
                .collect(),
            outputs: outputs.iter().map(|n| ValueInfo::new(*n, None)).collect(),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Deterministic pseudo-random f32 data in [-2, 2).
pub fn data(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 4000) as f32 / 1000.0 - 2.0
        })
        .collect();
    f32s(shape, &v)
}

pub fn run(m: &Model, feeds: &[(&str, Tensor)]) -> Vec<Tensor> {
    let s = Session::new(m, SessionOptions::default()).unwrap();
    s.run(
        feeds
            .iter()
            .map(|(n, t)| (n.to_string(), Value::tensor(t.clone())))
            .collect(),
    )
    .unwrap()
    .into_iter()
    .map(|(_, v)| v.as_tensor().unwrap().clone())
    .collect()
}

/// Asserts two runs agree within the conformance tolerance.
pub fn assert_close(a: &[Tensor], b: &[Tensor]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.shape(), y.shape());
        let (xv, yv) = (x.to_f64_vec().unwrap(), y.to_f64_vec().unwrap());
        for (p, q) in xv.iter().zip(&yv) {
            assert!((p - q).abs() <= 1e-7 + 1e-4 * q.abs(), "{p} vs {q}");
        }
    }
}

/// Runs `pass` on `m` and checks the outputs are preserved on the given feeds; returns the
/// optimized model and the change count.
pub fn check_pass(pass: &dyn crate::Pass, m: &Model, feeds: &[(&str, Tensor)]) -> (Model, usize) {
    let before = run(m, feeds);
    let mut opt = m.clone();
    let st = crate::apply_pass(pass, &mut opt).unwrap();
    let after = run(&opt, feeds);
    assert_close(&before, &after);
    (opt, st.changes)
}

pub fn ops(m: &Model) -> Vec<String> {
    m.graph.nodes.iter().map(|n| n.op_type.clone()).collect()
}
