//! `quant-lower`'s fused output dequantization: `QMatMul -> DequantizeLinear -> Add(bias)`
//! (a MatMul exporter's separate bias Add after a quantized product) becomes one `QMatMul`
//! with `dq_bias` whose f32 output is bit-identical to the three ops (the lowering that keeps
//! layers, run as the reference), and the cases it must leave alone stay as they are.

use npuc_ir::{DType, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo};
use npuc_ir::{Elem, ValueInfo};
use npuc_passes::quant_lower::{lower_quantized, lower_quantized_keep_layers};
use npuc_runtime::{Session, SessionOptions, Value};

const K: usize = 40;
const N: usize = 300;

fn init(name: &str, t: Tensor) -> Initializer {
    Initializer {
        name: name.into(),
        tensor: t,
    }
}

fn scalar<T: Elem>(v: T) -> Tensor {
    Tensor::from_vec(vec![], vec![v]).unwrap()
}

/// xorshift values in [0, 1).
fn unit(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 100_000) as f32 / 100_000.0
        })
        .collect()
}

/// How the test graph is wired.
#[derive(Clone, Copy)]
struct Case {
    signed: bool,
    /// The bias as one value instead of N.
    scalar_bias: bool,
    /// The output DequantizeLinear's scale differs from the product's Q (must not fuse).
    other_scale: bool,
    /// The DequantizeLinear's output is also a graph output (must not fuse).
    dq_escapes: bool,
    /// The bias is a second input rather than a constant (must not fuse).
    bias_input: bool,
}

const BASE: Case = Case {
    signed: false,
    scalar_bias: false,
    other_scale: false,
    dq_escapes: false,
    bias_input: false,
};

/// `x -> Q -> DQ -> MatMul(DQ(w)) -> Q -> DQ -> Add(bias) -> y`, x `[2, 7, K]`, w `[K, N]`.
fn qdq_model(c: Case) -> Model {
    let (zx, zy) = if c.signed {
        (scalar(-3i8), scalar(5i8))
    } else {
        (scalar(118u8), scalar(131u8))
    };
    let w: Vec<i8> = unit(11, K * N)
        .iter()
        .map(|v| (v * 254.0 - 127.0) as i8)
        .collect();
    let bias_t = if c.scalar_bias {
        Tensor::from_vec(vec![1], vec![0.3141f32]).unwrap()
    } else {
        Tensor::from_vec(vec![N], unit(12, N).iter().map(|v| v * 4.0 - 2.0).collect()).unwrap()
    };
    let sy_dq = if c.other_scale { 0.0312f32 } else { 0.0311f32 };
    let nodes = vec![
        Node::new("QuantizeLinear", &["x", "sx", "zx"], &["xq"]),
        Node::new("DequantizeLinear", &["xq", "sx", "zx"], &["xd"]),
        Node::new("DequantizeLinear", &["wq", "sw"], &["wd"]),
        Node::new("MatMul", &["xd", "wd"], &["p"]),
        Node::new("QuantizeLinear", &["p", "sy", "zy"], &["pq"]),
        Node::new("DequantizeLinear", &["pq", "sy_dq", "zy"], &["pd"]),
        Node::new("Add", &["pd", "bias"], &["y"]),
    ];
    let mut outputs = vec![ValueInfo::new("y", None)];
    if c.dq_escapes {
        outputs.push(ValueInfo::new("pd", None));
    }
    let mut inputs = vec![ValueInfo::new(
        "x",
        Some(TypeInfo::tensor(DType::F32, &[2, 7, K])),
    )];
    let mut initializers = vec![
        init("sx", scalar(0.0173f32)),
        init("zx", zx),
        init("wq", Tensor::from_vec(vec![K, N], w).unwrap()),
        init("sw", scalar(0.0042f32)),
        init("sy", scalar(0.0311f32)),
        init("sy_dq", scalar(sy_dq)),
        init("zy", zy),
    ];
    if c.bias_input {
        inputs.push(ValueInfo::new(
            "bias",
            Some(TypeInfo::tensor(DType::F32, bias_t.shape())),
        ));
    } else {
        initializers.push(init("bias", bias_t));
    }
    Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: 17,
        }],
        graph: Graph {
            name: "g".into(),
            nodes,
            initializers,
            inputs,
            outputs,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn run(m: &Model, x: &Tensor, bias: Option<&Tensor>, threads: usize) -> Vec<Vec<f32>> {
    let s = Session::new(m, SessionOptions { threads }).expect("session");
    let mut feeds = vec![("x".to_string(), Value::tensor(x.clone()))];
    if let Some(b) = bias {
        feeds.push(("bias".into(), Value::tensor(b.clone())));
    }
    s.run(feeds)
        .expect("run")
        .into_iter()
        .map(|(_, v)| v.as_tensor().unwrap().as_slice::<f32>().unwrap().to_vec())
        .collect()
}

fn count(m: &Model, op: &str) -> usize {
    m.graph.nodes.iter().filter(|n| n.op_type == op).count()
}

/// Lowers `c`'s graph both ways, checks whether the product absorbed the DQ and Add, and
/// compares the outputs bit for bit (1 and 2 threads, three inputs). Returns the values
/// compared.
fn check(c: Case, want_fused: bool) -> usize {
    let m = qdq_model(c);
    let mut fused = m.clone();
    lower_quantized(&mut fused).expect("lowering");
    let mut layers = m.clone();
    lower_quantized_keep_layers(&mut layers).expect("lowering (layers kept)");
    assert_eq!(count(&fused, "QMatMul"), 1, "{:#?}", fused.graph.nodes);
    assert_eq!(count(&layers, "QMatMul"), 1);
    assert_eq!(
        count(&fused, "Add"),
        !want_fused as usize,
        "{:#?}",
        fused.graph.nodes
    );
    assert_eq!(
        count(&layers, "Add"),
        1,
        "the layer-keeping lowering never fuses"
    );
    let q = fused.graph.nodes.iter().find(|n| n.op_type == "QMatMul");
    assert_eq!(q.unwrap().inputs.len(), if want_fused { 11 } else { 9 });
    let bias = c
        .bias_input
        .then(|| Tensor::from_vec(vec![N], unit(13, N).iter().map(|v| v - 0.5).collect()).unwrap());
    let mut compared = 0;
    for seed in 1..4 {
        let xs: Vec<f32> = unit(seed, 2 * 7 * K)
            .iter()
            .map(|v| v * 5.0 - 2.5)
            .collect();
        let x = Tensor::from_vec(vec![2, 7, K], xs).unwrap();
        let want = run(&layers, &x, bias.as_ref(), 1);
        for threads in [1, 2] {
            let got = run(&fused, &x, bias.as_ref(), threads);
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g.len(), w.len());
                for (i, (a, b)) in g.iter().zip(w).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "value {i}: {a} vs {b}");
                }
                compared += g.len();
            }
        }
    }
    compared
}

#[test]
fn fuses_dequantize_and_bias_bit_exactly() {
    let mut total = 0;
    for c in [
        BASE,
        Case {
            signed: true,
            ..BASE
        },
        Case {
            scalar_bias: true,
            ..BASE
        },
    ] {
        total += check(c, true);
    }
    // 3 cases x 3 inputs x 2 thread counts x 2*7*N values.
    assert_eq!(total, 3 * 3 * 2 * 2 * 7 * N);
}

#[test]
fn leaves_other_patterns_alone() {
    for c in [
        Case {
            other_scale: true,
            ..BASE
        },
        Case {
            dq_escapes: true,
            ..BASE
        },
        Case {
            bias_input: true,
            ..BASE
        },
    ] {
        check(c, false);
    }
}

/// The op rejects a `dq_bias` without an 8-bit requantized output with a clear error.
#[test]
fn rejects_dq_bias_without_requantization() {
    let mut m = qdq_model(BASE);
    lower_quantized(&mut m).expect("lowering");
    let q = m
        .graph
        .nodes
        .iter_mut()
        .find(|n| n.op_type == "QMatMul")
        .unwrap();
    // Drop y_scale / y_zero_point: a float-output product cannot take dq_bias.
    q.inputs[7] = String::new();
    q.inputs[8] = String::new();
    let x = Tensor::from_vec(vec![2, 7, K], unit(1, 2 * 7 * K)).unwrap();
    let s = Session::new(&m, SessionOptions { threads: 1 }).expect("session");
    let err = s
        .run(vec![("x".into(), Value::tensor(x))])
        .expect_err("dq_bias without y_scale must fail");
    assert!(err.to_string().contains("dq_bias"), "{err}");
}
