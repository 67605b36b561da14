//! Outlier migration (SmoothQuant): the smoothed float model computes the same function, the
//! scale lands where it should (folded into a LayerNorm, a decomposed LayerNorm's affine, or an
//! explicit Mul when the activation has other readers), and w8a8 gets measurably closer to float
//! on activations with outlier channels.

use npuc_ir::{
    Attr, DType, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo,
};
use npuc_quant::qdq::Sample;
use npuc_quant::smooth::smooth;
use npuc_quant::*;
use npuc_runtime::{Session, SessionOptions, Value};

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

fn init(name: &str, shape: Vec<usize>, v: Vec<f32>) -> Initializer {
    Initializer {
        name: name.into(),
        tensor: Tensor::from_vec(shape, v).unwrap(),
    }
}

fn named(mut n: Node, name: &str) -> Node {
    n.name = name.into();
    n
}

const ROWS: usize = 16;
const K: usize = 32;

/// LayerNorm gamma with two outlier channels (x40, x25): what transformer LayerNorms look like.
fn gamma() -> Vec<f32> {
    (0..K)
        .map(|i| match i {
            3 => 40.0,
            17 => -25.0,
            _ => 0.5 + 0.5 * rand_vec(1, 50 + i as u64)[0].abs(),
        })
        .collect()
}

/// x[16,32] -> norm -> h -> {MatMul W1[32,24] -> y1, MatMul W2[32,8] -> y2}. `decomposed`
/// writes the norm as `Mul gamma -> Add beta` after a LayerNormalization without affine;
/// `h_out` also makes `h` a graph output (a second reader).
fn model(decomposed: bool, h_out: bool) -> Model {
    let mut nodes = vec![];
    let mut inits = vec![
        init(
            "w1",
            vec![K, 24],
            rand_vec(K * 24, 1).iter().map(|v| v * 0.2).collect(),
        ),
        init(
            "w2",
            vec![K, 8],
            rand_vec(K * 8, 2).iter().map(|v| v * 0.2).collect(),
        ),
        init(
            "beta",
            vec![K],
            rand_vec(K, 3).iter().map(|v| v * 0.1).collect(),
        ),
        init("gamma", vec![K], gamma()),
    ];
    if decomposed {
        inits.push(init("one", vec![K], vec![1.0; K]));
        nodes.push(named(
            Node::new("LayerNormalization", &["x", "one"], &["n"]).with_attr("axis", Attr::Int(-1)),
            "/ln/norm",
        ));
        nodes.push(named(Node::new("Mul", &["n", "gamma"], &["ng"]), "/ln/Mul"));
        nodes.push(named(Node::new("Add", &["ng", "beta"], &["h"]), "/ln/Add"));
    } else {
        nodes.push(named(
            Node::new("LayerNormalization", &["x", "gamma", "beta"], &["h"])
                .with_attr("axis", Attr::Int(-1)),
            "/ln/LayerNormalization",
        ));
    }
    nodes.push(named(
        Node::new("MatMul", &["h", "w1"], &["y1"]),
        "/q/MatMul",
    ));
    nodes.push(named(
        Node::new("MatMul", &["h", "w2"], &["y2"]),
        "/k/MatMul",
    ));
    let mut outputs = vec![
        ValueInfo::new("y1", Some(TypeInfo::tensor(DType::F32, &[ROWS, 24]))),
        ValueInfo::new("y2", Some(TypeInfo::tensor(DType::F32, &[ROWS, 8]))),
    ];
    if h_out {
        outputs.push(ValueInfo::new(
            "h",
            Some(TypeInfo::tensor(DType::F32, &[ROWS, K])),
        ));
    }
    Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: "".into(),
            version: 17,
        }],
        graph: Graph {
            name: "smooth".into(),
            nodes,
            inputs: vec![ValueInfo::new(
                "x",
                Some(TypeInfo::tensor(DType::F32, &[ROWS, K])),
            )],
            outputs,
            initializers: inits,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn sample(i: u64) -> Sample {
    Sample {
        label: format!("s{i}"),
        feeds: vec![(
            "x".into(),
            Tensor::from_vec(vec![ROWS, K], rand_vec(ROWS * K, 100 + i)).unwrap(),
        )],
    }
}

fn outputs(m: &Model, x: &Tensor) -> Vec<(String, Vec<f32>)> {
    let s = Session::new(m, SessionOptions::default()).unwrap();
    s.run(vec![("x".into(), Value::tensor(x.clone()))])
        .unwrap()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                v.as_tensor().unwrap().as_slice::<f32>().unwrap().to_vec(),
            )
        })
        .collect()
}

fn sqnr(r: &[f32], q: &[f32]) -> f64 {
    let s: f64 = r.iter().map(|x| (*x as f64).powi(2)).sum();
    let n: f64 = r
        .iter()
        .zip(q)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    10.0 * (s / n).log10()
}

/// w8a8 minmax of `m` calibrated on 8 samples; output SQNR (y1 and y2 together) on 4 others.
fn w8a8_sqnr(m: &Model, float: &Model) -> f64 {
    let opts = QuantOptions::default();
    let p = plan(m, &opts).unwrap();
    let obs = calibrate(m, &p, opts.method, 1, (0..8).map(|i| Ok(sample(i))), |_| {}).unwrap();
    let enc = encodings_from_ranges(m, &p, &obs, opts.method).unwrap();
    let q = apply(m, &enc).unwrap();
    let (mut r, mut o) = (vec![], vec![]);
    for i in 50..54 {
        let x = &sample(i).feeds[0].1;
        for ((n, a), (_, b)) in outputs(float, x).into_iter().zip(outputs(&q, x)) {
            if n != "h" {
                r.extend(a);
                o.extend(b);
            }
        }
    }
    sqnr(&r, &o)
}

fn smoothed(m: &Model) -> (Model, SmoothReport) {
    let p = plan(m, &QuantOptions::default()).unwrap();
    let o = SmoothOptions::default();
    let st = LinearStats::collect(m, &p, &o, (0..8).map(|i| Ok(sample(i)))).unwrap();
    smooth(m, &p, &o, &st).unwrap()
}

/// Same function: every output within 1e-4 relative of the original (only f32 rounding of the
/// scale and its inverse differs, ~1e-7 per product, over a 32-term dot product).
fn assert_same_function(a: &Model, b: &Model) {
    for i in 60..63 {
        let x = &sample(i).feeds[0].1;
        for ((n, u), (_, v)) in outputs(a, x).into_iter().zip(outputs(b, x)) {
            let scale = u.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = u
                .iter()
                .zip(&v)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(
                err <= 1e-4 * scale,
                "output {n}: max error {err} vs magnitude {scale}"
            );
        }
    }
}

#[test]
fn folds_into_layernorm_and_gains() {
    let m = model(false, false);
    let (s, rep) = smoothed(&m);
    assert_eq!(rep.groups.len(), 1, "{rep:?}");
    let g = &rep.groups[0];
    assert!(
        g.alpha.is_some(),
        "outlier channels were not smoothed: {rep:?}"
    );
    assert!(g.folded.starts_with("LayerNormalization"), "{}", g.folded);
    assert_eq!(g.consumers.len(), 2);
    // No explicit Mul: the graph keeps its node count.
    assert_eq!(s.graph.nodes.len(), m.graph.nodes.len());
    assert_same_function(&m, &s);
    let before = w8a8_sqnr(&m, &m);
    let after = w8a8_sqnr(&s, &m);
    // 40x outlier channels cost the other channels ~5 bits of an 8-bit range; moving them into
    // the per-channel weights must win back at least 3 dB (half the error power).
    assert!(
        after >= before + 3.0,
        "w8a8 SQNR {before:.2} dB -> {after:.2} dB"
    );
    assert!(g.sqnr_after > g.sqnr_before + 3.0, "{g:?}");
}

#[test]
fn folds_into_decomposed_layernorm_affine() {
    let m = model(true, false);
    let (s, rep) = smoothed(&m);
    let g = &rep.groups[0];
    assert!(g.alpha.is_some(), "{rep:?}");
    assert!(g.folded.contains("norm affine"), "{}", g.folded);
    assert_eq!(s.graph.nodes.len(), m.graph.nodes.len());
    assert_same_function(&m, &s);
}

#[test]
fn second_reader_gets_an_explicit_scale() {
    let m = model(false, true);
    let (s, rep) = smoothed(&m);
    let g = &rep.groups[0];
    assert!(g.alpha.is_some(), "{rep:?}");
    assert_eq!(g.folded, "explicit Mul");
    assert_eq!(s.graph.nodes.len(), m.graph.nodes.len() + 1);
    // `h` (a graph output) is untouched; y1/y2 the same function.
    assert_same_function(&m, &s);
    let before = w8a8_sqnr(&m, &m);
    let after = w8a8_sqnr(&s, &m);
    assert!(
        after >= before + 3.0,
        "w8a8 SQNR {before:.2} dB -> {after:.2} dB"
    );
}

#[test]
fn no_outliers_means_no_change() {
    // Gamma all ones: nothing to migrate; a tenth of a dB is the bar for touching the graph.
    let mut m = model(false, false);
    for i in &mut m.graph.initializers {
        if i.name == "gamma" {
            i.tensor = Tensor::from_vec(vec![K], vec![1.0f32; K]).unwrap();
        }
    }
    let (s, rep) = smoothed(&m);
    if rep.groups[0].alpha.is_none() {
        assert_eq!(s, m);
    } else {
        assert!(rep.groups[0].sqnr_after > rep.groups[0].sqnr_before + 0.1);
    }
}
