//! `quant-lower`'s Softmax step: `DQ -> Softmax -> Q` becomes `npuc.QSoftmax` exactly where
//! the kernel computes the same thing, and the lowered graph's outputs stay within one output
//! quantization step of the QDQ graph run as written (ONNX Q/DQ kernels, f32 Softmax).

use npuc_ir::ValueInfo;
use npuc_ir::{Attr, DType, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo};
use npuc_passes::quant_lower::{lower_quantized, lower_quantized_keep_layers};
use npuc_runtime::{Session, SessionOptions, Value};

/// Output step of the final DequantizeLinear (the probabilities' scale).
const PSTEP: f32 = 1.0 / 255.0;

fn init(name: &str, t: Tensor) -> Initializer {
    Initializer {
        name: name.into(),
        tensor: t,
    }
}

fn scalar<T: npuc_ir::Elem>(v: T) -> Tensor {
    Tensor::from_vec(vec![], vec![v]).unwrap()
}

/// How the test graph is wired.
#[derive(Clone, Copy)]
struct Case {
    opset: i64,
    /// The Softmax `axis` attribute (None: the opset's default).
    axis: Option<i64>,
    signed: bool,
    /// A Transpose of the last two axes between the DQ and the Softmax.
    transpose: bool,
    /// The DQ's output is also a graph output (so the chain must stay).
    dq_escapes: bool,
    /// Declare the Softmax input's shape in value_info.
    declare: bool,
}

const BASE: Case = Case {
    opset: 17,
    axis: Some(-1),
    signed: false,
    transpose: false,
    dq_escapes: false,
    declare: false,
};

/// `x -> Mul(k) -> Q -> DQ [-> Transpose] -> Softmax -> Q -> DQ -> y`, x of shape `shape`.
fn qdq_model(c: Case, shape: &[usize]) -> Model {
    let (zx, zy) = if c.signed {
        (scalar(-7i8), scalar(-128i8))
    } else {
        (scalar(121u8), scalar(0u8))
    };
    let mut nodes = vec![
        Node::new("Mul", &["x", "k"], &["xs"]),
        Node::new("QuantizeLinear", &["xs", "sx", "zx"], &["xq"]),
        Node::new("DequantizeLinear", &["xq", "sx", "zx"], &["xd"]),
    ];
    let mut sin = "xd".to_string();
    if c.transpose {
        let r = shape.len() as i64;
        let mut perm: Vec<i64> = (0..r).collect();
        perm.swap(r as usize - 1, r as usize - 2);
        nodes.push(Node::new("Transpose", &["xd"], &["xt"]).with_attr("perm", Attr::Ints(perm)));
        sin = "xt".into();
    }
    let mut sm = Node::new("Softmax", &[&sin], &["p"]);
    sm.name = "attn_softmax".into();
    if let Some(a) = c.axis {
        sm = sm.with_attr("axis", Attr::Int(a));
    }
    nodes.push(sm);
    nodes.push(Node::new("QuantizeLinear", &["p", "sy", "zy"], &["pq"]));
    nodes.push(Node::new("DequantizeLinear", &["pq", "sy", "zy"], &["y"]));
    let mut outputs = vec![ValueInfo::new("y", None)];
    if c.dq_escapes {
        outputs.push(ValueInfo::new("xd", None));
    }
    let mut value_info = vec![];
    if c.declare {
        let mut s = shape.to_vec();
        if c.transpose {
            let r = s.len();
            s.swap(r - 1, r - 2);
        }
        value_info.push(ValueInfo::new(&sin, Some(TypeInfo::tensor(DType::F32, &s))));
    }
    Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: c.opset,
        }],
        graph: Graph {
            name: "g".into(),
            nodes,
            initializers: vec![
                init("k", scalar(3.0f32)),
                // 8-bit codes spanning about [-6, 6]: e^-12 between the extremes.
                init("sx", scalar(0.047f32)),
                init("zx", zx),
                init("sy", scalar(PSTEP)),
                init("zy", zy),
            ],
            inputs: vec![ValueInfo::new(
                "x",
                Some(TypeInfo::tensor(DType::F32, shape)),
            )],
            outputs,
            value_info,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Deterministic data in [-2, 2).
fn data(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 4000) as f32 / 1000.0 - 2.0
        })
        .collect();
    Tensor::from_vec(shape.to_vec(), v).unwrap()
}

fn run(m: &Model, x: &Tensor, threads: usize) -> Vec<Vec<f64>> {
    let s = Session::new(m, SessionOptions { threads }).expect("session");
    s.run(vec![("x".into(), Value::tensor(x.clone()))])
        .expect("run")
        .into_iter()
        .map(|(_, v)| v.as_tensor().unwrap().to_f64_vec().unwrap())
        .collect()
}

fn count(m: &Model, op: &str) -> usize {
    m.graph.nodes.iter().filter(|n| n.op_type == op).count()
}

/// Lowers `c`'s graph, checks whether the Softmax became `npuc.QSoftmax`, and compares the
/// outputs with the unlowered graph's (one and two threads). Returns (elements, identical).
fn check(c: Case, shape: &[usize], want_fused: bool) -> (usize, usize) {
    let m = qdq_model(c, shape);
    let mut low = m.clone();
    lower_quantized(&mut low).expect("lowering");
    assert_eq!(
        count(&low, "QSoftmax"),
        want_fused as usize,
        "QSoftmax nodes after lowering"
    );
    assert_eq!(
        count(&low, "Softmax"),
        !want_fused as usize,
        "Softmax nodes"
    );
    if want_fused {
        let q = low
            .graph
            .nodes
            .iter()
            .find(|n| n.op_type == "QSoftmax")
            .unwrap();
        assert_eq!(q.domain, "npuc");
        assert_eq!(q.name, "attn_softmax_quant");
        // The chain's DQ and Q are gone: the only DequantizeLinear left is the output's.
        let dq = low
            .graph
            .nodes
            .iter()
            .filter(|n| n.op_type.ends_with("Dequantize") || n.op_type == "DequantizeLinear")
            .count();
        assert_eq!(dq, 1, "{:#?}", low.graph.nodes);
    }
    let mut same = 0;
    let mut total = 0;
    for seed in 1..4 {
        let x = data(shape, seed);
        let want = run(&m, &x, 1);
        for threads in [1, 2] {
            let got = run(&low, &x, threads);
            assert_eq!(got.len(), want.len());
            for (g, w) in got[0].iter().zip(&want[0]) {
                let steps = (g - w).abs() / PSTEP as f64;
                assert!(steps <= 1.0 + 1e-3, "{steps} steps: {g} vs {w}");
            }
            total += got[0].len();
            same += got[0].iter().zip(&want[0]).filter(|(a, b)| a == b).count();
        }
    }
    (total, same)
}

#[test]
fn lowers_last_axis_softmax_and_matches_float() {
    let mut t = (0, 0);
    let mut add = |r: (usize, usize)| {
        t.0 += r.0;
        t.1 += r.1;
    };
    // Attention-shaped, u8 and i8, the default axis of opset 13+.
    add(check(BASE, &[1, 6, 50, 197], true));
    add(check(
        Case {
            signed: true,
            axis: None,
            ..BASE
        },
        &[2, 3, 40, 64],
        true,
    ));
    // A non-negative last axis, known from value_info.
    add(check(
        Case {
            axis: Some(3),
            declare: true,
            ..BASE
        },
        &[1, 2, 8, 30],
        true,
    ));
    // DQ -> Transpose -> Softmax: the DQ moves past the Transpose first.
    add(check(
        Case {
            transpose: true,
            ..BASE
        },
        &[1, 2, 30, 20],
        true,
    ));
    // Opset 11: Softmax over the input flattened at `axis` (default 1): contiguous rows.
    for axis in [None, Some(2), Some(-1)] {
        add(check(
            Case {
                opset: 11,
                axis,
                ..BASE
            },
            &[2, 3, 4, 25],
            true,
        ));
    }
    eprintln!(
        "lowered vs unlowered: {} of {} probabilities identical ({:.5}), all within one step",
        t.1,
        t.0,
        t.1 as f64 / t.0 as f64
    );
    assert!(t.1 as f64 >= 0.999 * t.0 as f64);
}

#[test]
fn keeps_softmax_it_cannot_lower() {
    // Opset 13+ along a middle axis: strided rows, not the kernel's layout.
    check(
        Case {
            axis: Some(1),
            declare: true,
            ..BASE
        },
        &[2, 5, 7],
        false,
    );
    // A non-negative axis whose rank is unknown: can't prove it is the last.
    check(
        Case {
            axis: Some(2),
            ..BASE
        },
        &[2, 5, 7],
        false,
    );
    // The dequantized scores are read elsewhere too.
    check(
        Case {
            dq_escapes: true,
            ..BASE
        },
        &[2, 5, 7],
        false,
    );
    // Layer outputs kept for `npuc verify`: the probabilities stay a float layer.
    let mut m = qdq_model(BASE, &[2, 5, 7]);
    lower_quantized_keep_layers(&mut m).unwrap();
    assert_eq!(count(&m, "QSoftmax"), 0);
    assert_eq!(count(&m, "Softmax"), 1);
}
