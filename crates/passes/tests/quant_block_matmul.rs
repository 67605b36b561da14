//! `quant-lower`'s packed 4-bit block products: `DequantizeLinear(int4/uint4 W, blocked
//! scale[, zero point]) -> MatMul` (and the Gemm form with a bias) becomes one
//! `npuc.BlockMatMul` whose weight stays packed. The reference is the graph as written, run by
//! the runtime's ONNX `DequantizeLinear` and `MatMul`/`Gemm` kernels (what the fold computed):
//! the dequantized weights are the same f32 values, so the outputs may differ only by the
//! summation order of the f32 products, bounded by `K * eps * sum_k |x_k w_k|` per output.

use npuc_ir::ValueInfo;
use npuc_ir::{Attr, DType, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo};
use npuc_passes::quant_lower::lower_quantized;
use npuc_runtime::{Session, SessionOptions, Value};
use proptest::prelude::*;

fn init(name: &str, t: Tensor) -> Initializer {
    Initializer {
        name: name.into(),
        tensor: t,
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() % 100_000) as f32 / 100_000.0
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    m: usize,
    k: usize,
    n: usize,
    block: usize,
    wtype: DType,
    zero_point: bool,
    /// Gemm(x, W, bias) instead of MatMul(x, W).
    gemm: bool,
    /// Gemm with transB (blocks along N after the transpose): must stay on the fold path.
    trans_b: bool,
}

/// `x [2, m, k] (or [m, k] for Gemm) -> op(x, DQ(wq, sw[, zw])) -> y`.
fn model(c: Case, seed: u64) -> Model {
    let mut r = Rng(seed | 1);
    let (rows, cols) = if c.trans_b { (c.n, c.k) } else { (c.k, c.n) };
    let (prow, pcol) = if c.trans_b {
        (c.n, c.k / c.block)
    } else {
        (c.k / c.block, c.n)
    };
    // Random codes of the weight type, `shape`.
    let codes = |r: &mut Rng, shape: Vec<usize>| -> Tensor {
        let len = shape.iter().product();
        let v: Vec<u8> = (0..len).map(|_| r.next() as u8).collect();
        match c.wtype {
            DType::I4 | DType::U4 => Tensor::from_codes(c.wtype, shape, v).unwrap(),
            _ => Tensor::from_vec(shape, v.into_iter().map(|b| b as i8).collect()).unwrap(),
        }
    };
    let wq = codes(&mut r, vec![rows, cols]);
    let sw: Vec<f32> = (0..prow * pcol).map(|_| r.unit() * 0.05 + 0.001).collect();
    let mut dq_in = vec!["wq", "sw"];
    let mut inits = vec![
        init("wq", wq),
        init("sw", Tensor::from_vec(vec![prow, pcol], sw).unwrap()),
    ];
    if c.zero_point {
        inits.push(init("zw", codes(&mut r, vec![prow, pcol])));
        dq_in.push("zw");
    }
    let mut dq = Node::new("DequantizeLinear", &dq_in, &["wd"]);
    dq.attrs
        .push(("block_size".into(), Attr::Int(c.block as i64)));
    dq.attrs
        .push(("axis".into(), Attr::Int(if c.trans_b { 1 } else { 0 })));
    let (op, x_shape) = if c.gemm {
        let bias: Vec<f32> = (0..c.n).map(|_| r.unit() - 0.5).collect();
        inits.push(init("bias", Tensor::from_vec(vec![c.n], bias).unwrap()));
        let mut g = Node::new("Gemm", &["x", "wd", "bias"], &["y"]);
        if c.trans_b {
            g.attrs.push(("transB".into(), Attr::Int(1)));
        }
        (g, vec![c.m, c.k])
    } else {
        (Node::new("MatMul", &["x", "wd"], &["y"]), vec![2, c.m, c.k])
    };
    Model {
        ir_version: 10,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: 21,
        }],
        graph: Graph {
            name: "g".into(),
            nodes: vec![dq, op],
            initializers: inits,
            inputs: vec![ValueInfo::new(
                "x",
                Some(TypeInfo::tensor(DType::F32, &x_shape)),
            )],
            outputs: vec![ValueInfo::new("y", None)],
            ..Default::default()
        },
        ..Default::default()
    }
}

fn x_for(c: Case, seed: u64) -> Tensor {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let shape = if c.gemm {
        vec![c.m, c.k]
    } else {
        vec![2, c.m, c.k]
    };
    let len = shape.iter().product();
    Tensor::from_vec(shape, (0..len).map(|_| r.unit() * 4.0 - 2.0).collect()).unwrap()
}

fn run(m: &Model, x: &Tensor, threads: usize) -> Vec<f32> {
    let s = Session::new(m, SessionOptions { threads }).expect("session");
    let out = s
        .run(vec![("x".to_string(), Value::tensor(x.clone()))])
        .expect("run");
    out[0]
        .1
        .as_tensor()
        .unwrap()
        .as_slice::<f32>()
        .unwrap()
        .to_vec()
}

fn count(m: &Model, op: &str) -> usize {
    m.graph.nodes.iter().filter(|n| n.op_type == op).count()
}

/// Lowers `c`, checks whether it became a BlockMatMul, and compares with the unlowered graph
/// within the f32 summation bound (1 and 2 threads).
fn check(c: Case, seed: u64, want_block: bool) {
    let m = model(c, seed);
    let mut lowered = m.clone();
    lower_quantized(&mut lowered).expect("lowering");
    assert_eq!(
        count(&lowered, "BlockMatMul"),
        want_block as usize,
        "{c:?}: {:#?}",
        lowered.graph.nodes
    );
    if want_block {
        assert_eq!(
            count(&lowered, "DequantizeLinear"),
            0,
            "{c:?}: weight not packed"
        );
        let packed = lowered
            .graph
            .initializers
            .iter()
            .map(|i| i.tensor.len() * i.tensor.dtype().size())
            .sum::<usize>();
        let plain = c.k * c.n * 4;
        // Under 1 KB of f32 weight (e.g. one column of 32) the per-block scales and the
        // per-column parts of the packed layout outweigh the codes (48 bytes against 128 at
        // k = 32, n = 1, block 16); the DequantizeLinear check above covers those.
        assert!(
            plain < 1024 || packed * 3 < plain,
            "{c:?}: {packed} bytes of weights vs f32 {plain}"
        );
    }
    let x = x_for(c, seed);
    let want = run(&m, &x, 1);
    // |x| <= 2, |w| <= codes' span * 0.051 (a code minus a zero point): a bound on
    // sum_k |x_k w_k|.
    let span = if c.wtype == DType::I8 { 255.0 } else { 15.0 };
    let abs_sum = c.k as f32 * 2.0 * span * 0.051;
    let tol = c.k as f32 * f32::EPSILON * abs_sum;
    for threads in [1, 2] {
        let got = run(&lowered, &x, threads);
        assert_eq!(got.len(), want.len());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= tol,
                "{c:?} threads {threads} value {i}: {a} vs {b} (tolerance {tol})"
            );
        }
    }
}

const BASE: Case = Case {
    m: 7,
    k: 128,
    n: 37,
    block: 32,
    wtype: DType::I4,
    zero_point: false,
    gemm: false,
    trans_b: false,
};

#[test]
fn lowers_int4_and_uint4_matmul_and_gemm() {
    for wtype in [DType::I4, DType::U4] {
        for zero_point in [false, true] {
            for gemm in [false, true] {
                let c = Case {
                    wtype,
                    zero_point,
                    gemm,
                    ..BASE
                };
                check(c, 5, true);
            }
        }
    }
    // Wide enough for several panels and the two-thread row split.
    check(
        Case {
            m: 197,
            k: 384,
            n: 1537,
            block: 64,
            ..BASE
        },
        9,
        true,
    );
}

#[test]
fn leaves_uncovered_forms_to_the_fold() {
    // int8 blocked weights, and a transposed Gemm weight (blocks along its second axis).
    check(
        Case {
            wtype: DType::I8,
            ..BASE
        },
        3,
        false,
    );
    check(
        Case {
            gemm: true,
            trans_b: true,
            ..BASE
        },
        4,
        false,
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Random shapes: K a multiple of the block, odd M and N included, every block size the
    /// quantizer writes, with and without zero points.
    #[test]
    fn random_shapes_match_the_fold(
        m in 1usize..20, kb in 1usize..5, bi in 0usize..4, n in 1usize..100,
        signed in any::<bool>(), zero_point in any::<bool>(), gemm in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let block = [16, 32, 64, 128][bi];
        let c = Case {
            m, k: kb * block, n, block,
            wtype: if signed { DType::I4 } else { DType::U4 },
            zero_point, gemm, trans_b: false,
        };
        check(c, seed, true);
    }
}
