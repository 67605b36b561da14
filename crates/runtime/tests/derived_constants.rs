//! Steps whose inputs are all constants (int8 weights times a scale, as compiled PP-OCRv6 keeps
//! them) run once per session when the session keeps weights packed, and their kept outputs
//! must never change: later runs, in-place kernels and the session's own worker threads see
//! the same values. Every figure is checked against values computed here by hand.

use npuc_ir::{
    Attr, DType, Dim, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo,
};
use npuc_runtime::{Session, SessionOptions, Value};

const ROWS: usize = 3;
const COLS: usize = 4;

fn q() -> Vec<i8> {
    (0..ROWS * COLS).map(|i| (i as i8) * 7 - 40).collect()
}
const SCALE: f32 = 0.125;

/// `w = Cast(q) * scale` (derived), `y = Relu(w + x)` (the Add may write in place into one of
/// its inputs), `z = MatMul(x, Transpose(w))`.
fn model() -> Model {
    let f32_in = |name: &str| {
        ValueInfo::new(
            name,
            Some(TypeInfo::Tensor {
                dtype: Some(DType::F32),
                shape: Some(vec![Dim::Fixed(ROWS), Dim::Fixed(COLS)]),
            }),
        )
    };
    Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: 17,
        }],
        graph: Graph {
            name: "g".into(),
            nodes: vec![
                Node::new("Cast", &["q"], &["qf"]).with_attr("to", Attr::Int(1)),
                Node::new("Mul", &["qf", "s"], &["w"]),
                Node::new("Add", &["w", "x"], &["sum"]),
                Node::new("Relu", &["sum"], &["y"]),
                Node::new("Transpose", &["w"], &["wt"]).with_attr("perm", Attr::Ints(vec![1, 0])),
                Node::new("MatMul", &["x", "wt"], &["z"]),
            ],
            inputs: vec![f32_in("x")],
            outputs: vec![ValueInfo::new("y", None), ValueInfo::new("z", None)],
            initializers: vec![
                Initializer {
                    name: "q".into(),
                    tensor: Tensor::from_vec(vec![ROWS, COLS], q()).unwrap(),
                },
                Initializer {
                    name: "s".into(),
                    tensor: Tensor::scalar(SCALE),
                },
            ],
            ..Default::default()
        },
        ..Default::default()
    }
}

fn expected(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let w: Vec<f32> = q().iter().map(|&v| v as f32 * SCALE).collect();
    let y = w.iter().zip(x).map(|(a, b)| (a + b).max(0.0)).collect();
    let mut z = vec![0f32; ROWS * ROWS];
    for i in 0..ROWS {
        for j in 0..ROWS {
            z[i * ROWS + j] = (0..COLS).map(|k| x[i * COLS + k] * w[j * COLS + k]).sum();
        }
    }
    (y, z)
}

fn run(s: &Session, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let feed = Value::tensor(Tensor::from_vec(vec![ROWS, COLS], x.to_vec()).unwrap());
    let out = s.run(vec![("x".into(), feed)]).unwrap();
    let get = |i: usize| {
        out[i]
            .1
            .as_tensor()
            .unwrap()
            .as_slice::<f32>()
            .unwrap()
            .to_vec()
    };
    (get(0), get(1))
}

#[test]
fn derived_constants_are_kept_unchanged_across_runs_and_threads() {
    let m = model();
    for threads in [1, 2] {
        for prepack in [false, true] {
            let s = Session::new(&m, SessionOptions { threads }).unwrap();
            s.set_weight_prepacking(prepack);
            for round in 0..4 {
                let x: Vec<f32> = (0..ROWS * COLS)
                    .map(|i| (i as f32 - 5.0) * (round as f32 + 1.0) * 0.75)
                    .collect();
                let (y, z) = run(&s, &x);
                let (ey, ez) = expected(&x);
                // Exact: every value is a small multiple of 1/8 (sums of products of such).
                assert_eq!(
                    y, ey,
                    "y, threads {threads}, prepack {prepack}, run {round}"
                );
                assert_eq!(
                    z, ez,
                    "z, threads {threads}, prepack {prepack}, run {round}"
                );
            }
        }
    }
}
