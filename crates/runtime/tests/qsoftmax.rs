//! `npuc.QSoftmax` against the float path it replaces (`npuc.Dequantize -> Softmax ->
//! npuc.Quantize`, the runtime's own kernels, what a lowered QDQ graph runs otherwise) and
//! against an f64 reference, on random and adversarial rows: every element within one
//! quantization step, and the fraction of identical elements reported (and required high).

use npuc_ir::{Attr, DType, Graph, Initializer, Model, Node, OpsetImport, Tensor, ValueInfo};
use npuc_runtime::{Session, SessionOptions, Value};

/// A small deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn scalar_init(name: &str, t: Tensor) -> Initializer {
    Initializer {
        name: name.into(),
        tensor: t,
    }
}

fn zp_tensor(dt: DType, v: i32) -> Tensor {
    match dt {
        DType::U8 => Tensor::from_vec(vec![], vec![v as u8]).unwrap(),
        _ => Tensor::from_vec(vec![], vec![v as i8]).unwrap(),
    }
}

/// Quantization parameters of one case.
#[derive(Clone, Copy, Debug)]
struct Params {
    in_dt: DType,
    xs: f32,
    xzp: i32,
    out_dt: DType,
    ys: f32,
    yzp: i32,
}

/// The float graph (`opset` 13+: Softmax over `axis`; below: over the flattened tail) or the
/// fused op, reading `x` and writing `y`.
fn model(p: Params, axis: i64, opset: i64, fused: bool) -> Model {
    let inits = vec![
        scalar_init("xs", Tensor::from_vec(vec![], vec![p.xs]).unwrap()),
        scalar_init("xzp", zp_tensor(p.in_dt, p.xzp)),
        scalar_init("ys", Tensor::from_vec(vec![], vec![p.ys]).unwrap()),
        scalar_init("yzp", zp_tensor(p.out_dt, p.yzp)),
    ];
    let nodes = if fused {
        let mut n = Node::new("QSoftmax", &["x", "xs", "xzp", "ys", "yzp"], &["y"])
            .with_attr("axis", Attr::Int(axis));
        n.domain = "npuc".into();
        vec![n]
    } else {
        let mut dq = Node::new("Dequantize", &["x", "xs", "xzp"], &["xf"]);
        dq.domain = "npuc".into();
        let sm = Node::new("Softmax", &["xf"], &["p"]).with_attr("axis", Attr::Int(axis));
        let mut q = Node::new("Quantize", &["p", "ys", "yzp"], &["y"]);
        q.domain = "npuc".into();
        vec![dq, sm, q]
    };
    Model {
        ir_version: 8,
        opset_imports: vec![
            OpsetImport {
                domain: String::new(),
                version: opset,
            },
            OpsetImport {
                domain: "npuc".into(),
                version: 1,
            },
        ],
        graph: Graph {
            name: "g".into(),
            nodes,
            initializers: inits,
            inputs: vec![ValueInfo::new("x", None)],
            outputs: vec![ValueInfo::new("y", None)],
            ..Default::default()
        },
        ..Default::default()
    }
}

fn run(m: &Model, x: &Tensor, threads: usize) -> Vec<i64> {
    let s = Session::new(m, SessionOptions { threads }).unwrap();
    let out = s.run(vec![("x".into(), Value::tensor(x.clone()))]).unwrap();
    let Value::Tensor(t) = &out[0].1 else {
        panic!("tensor output expected")
    };
    assert_eq!(t.shape(), x.shape());
    t.to_i64_vec().unwrap()
}

/// The f64 reference: exact softmax of the dequantized codes, quantized half to even.
fn reference(codes: &[i64], n: usize, p: Params) -> Vec<i64> {
    let (lo, hi) = if p.out_dt == DType::U8 {
        (0, 255)
    } else {
        (-128, 127)
    };
    let mut out = vec![];
    for row in codes.chunks(n) {
        let x: Vec<f64> = row
            .iter()
            .map(|&q| (q - p.xzp as i64) as f64 * p.xs as f64)
            .collect();
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let s: f64 = e.iter().sum();
        out.extend(e.iter().map(|v| {
            let r = (v / s / p.ys as f64).round_ties_even() as i64 + p.yzp as i64;
            r.clamp(lo, hi)
        }));
    }
    out
}

fn codes_tensor(shape: Vec<usize>, codes: &[i64], dt: DType) -> Tensor {
    match dt {
        DType::U8 => Tensor::from_vec(shape, codes.iter().map(|&v| v as u8).collect()).unwrap(),
        _ => Tensor::from_vec(shape, codes.iter().map(|&v| v as i8).collect()).unwrap(),
    }
}

/// Totals over all cases: elements, identical to the float path, identical to f64.
#[derive(Default)]
struct Tally {
    total: usize,
    same_float: usize,
    same_exact: usize,
    float_vs_exact_same: usize,
}

/// Runs one case through both graphs and the f64 reference; asserts the one-step bound.
#[allow(clippy::too_many_arguments)]
fn check(
    tally: &mut Tally,
    what: &str,
    shape: Vec<usize>,
    codes: &[i64],
    p: Params,
    axis: i64,
    opset: i64,
    threads: usize,
) {
    let x = codes_tensor(shape.clone(), codes, p.in_dt);
    let got = run(&model(p, axis, opset, true), &x, threads);
    let float = run(&model(p, axis, opset, false), &x, threads);
    let rank = shape.len() as i64;
    let a = if axis < 0 { axis + rank } else { axis } as usize;
    let n: usize = if opset < 13 {
        shape[a..].iter().product()
    } else {
        assert_eq!(a + 1, shape.len(), "reference handles the last axis only");
        shape[a]
    };
    let exact = reference(codes, n, p);
    for (i, ((&g, &f), &e)) in got.iter().zip(&float).zip(&exact).enumerate() {
        assert!(
            (g - f).abs() <= 1 && (g - e).abs() <= 1,
            "{what} {p:?}: element {i} (code {}): fused {g}, float path {f}, f64 {e}",
            codes[i]
        );
    }
    tally.total += got.len();
    tally.same_float += got.iter().zip(&float).filter(|(a, b)| a == b).count();
    tally.same_exact += got.iter().zip(&exact).filter(|(a, b)| a == b).count();
    tally.float_vs_exact_same += float.iter().zip(&exact).filter(|(a, b)| a == b).count();
}

fn random_params(r: &mut Rng) -> Params {
    let in_dt = if r.below(2) == 0 {
        DType::U8
    } else {
        DType::I8
    };
    let out_dt = if r.below(3) == 0 {
        DType::I8
    } else {
        DType::U8
    };
    let xzp = if in_dt == DType::U8 {
        r.below(256) as i32
    } else {
        r.below(256) as i32 - 128
    };
    // Scales from 1e-4 (nearly flat rows) to 1 (e^-255 underflows).
    let xs = 10f32.powf(-4.0 + 4.0 * (r.below(1000) as f32 / 1000.0));
    // Output: the usual [0, 1] over 255 steps, sometimes coarser or offset.
    let (ys, yzp) = match r.below(4) {
        0 => (1.0 / 127.0, if out_dt == DType::U8 { 0 } else { -128 }),
        1 => (1.0 / 255.0 + r.below(100) as f32 * 1e-5, 10),
        _ => (1.0 / 255.0, if out_dt == DType::U8 { 0 } else { -128 }),
    };
    Params {
        in_dt,
        xs,
        xzp,
        out_dt,
        ys,
        yzp,
    }
}

fn random_codes(r: &mut Rng, len: usize, dt: DType, spread: u64) -> Vec<i64> {
    let base = r.below(256 - spread.min(255)) as i64;
    let off = if dt == DType::U8 { 0 } else { -128 };
    (0..len)
        .map(|_| base + r.below(spread + 1).min(255 - base as u64) as i64 + off)
        .collect()
}

#[test]
fn matches_float_path_within_one_step() {
    let mut r = Rng(0x9E37_79B9_7F4A_7C15);
    let mut t = Tally::default();
    // Random rows of many lengths, spreads and parameters.
    for case in 0..300 {
        let p = random_params(&mut r);
        let n = [1, 2, 3, 7, 8, 16, 17, 64, 197, 1000][case % 10];
        let rows = 1 + r.below(6) as usize;
        let spread = [0, 1, 5, 30, 120, 255][r.below(6) as usize];
        let codes = random_codes(&mut r, rows * n, p.in_dt, spread);
        check(&mut t, "random", vec![rows, n], &codes, p, -1, 17, 1);
    }
    // Adversarial rows.
    let u8p = Params {
        in_dt: DType::U8,
        xs: 0.08,
        xzp: 128,
        out_dt: DType::U8,
        ys: 1.0 / 255.0,
        yzp: 0,
    };
    for n in [1, 2, 3, 4, 5, 8, 10, 51, 85, 255, 256, 510, 4096] {
        // All equal (1/n; n = 2 puts 127.5 on a rounding boundary).
        for v in [0, 77, 255] {
            check(&mut t, "equal", vec![1, n], &vec![v; n], u8p, -1, 17, 1);
        }
        // One huge code among minimal ones, at the start, middle and end.
        for pos in [0, n / 2, n - 1] {
            let mut c = vec![0; n];
            c[pos] = 255;
            for xs in [0.001, 0.02, 0.08, 1.0] {
                check(
                    &mut t,
                    "one huge",
                    vec![1, n],
                    &c,
                    Params { xs, ..u8p },
                    -1,
                    17,
                    1,
                );
            }
        }
        // Two maxima, the rest one below (near ties between neighbours).
        let mut c = vec![200; n];
        c[0] = 201;
        c[n - 1] = 201;
        check(&mut t, "two maxima", vec![1, n], &c, u8p, -1, 17, 1);
    }
    // i8 extremes.
    let i8p = Params {
        in_dt: DType::I8,
        xs: 0.05,
        xzp: -3,
        out_dt: DType::I8,
        ys: 1.0 / 255.0,
        yzp: -128,
    };
    let c: Vec<i64> = (0..256).map(|i| i - 128).collect();
    check(&mut t, "i8 ramp", vec![2, 128], &c, i8p, -1, 17, 1);
    check(&mut t, "i8 equal", vec![3, 5], &[-128; 15], i8p, -1, 17, 1);
    // Long rows and attention-shaped tensors, one and two threads (the parallel split).
    for threads in [1, 2] {
        let p = Params {
            xs: 0.047,
            xzp: 91,
            ..u8p
        };
        let codes = random_codes(&mut r, 6 * 197 * 197, DType::U8, 255);
        check(
            &mut t,
            "attention",
            vec![1, 6, 197, 197],
            &codes,
            p,
            -1,
            17,
            threads,
        );
        let codes = random_codes(&mut r, 3 * 70_000, DType::U8, 200);
        check(
            &mut t,
            "long rows",
            vec![3, 70_000],
            &codes,
            p,
            -1,
            17,
            threads,
        );
    }
    // Opset 11: Softmax over the flattened tail from `axis`.
    for axis in [1, -2, 2] {
        let codes = random_codes(&mut r, 2 * 3 * 5, DType::U8, 255);
        let mut tt = Tally::default();
        check(&mut tt, "opset 11", vec![2, 3, 5], &codes, u8p, axis, 11, 1);
        assert_eq!(tt.same_float, tt.total, "opset 11 axis {axis}");
    }
    let frac = |k: usize| k as f64 / t.total as f64;
    eprintln!(
        "QSoftmax: {} elements; identical to the float path {:.6} ({} differ by one step), \
         to f64 {:.6}; float path identical to f64 {:.6}",
        t.total,
        frac(t.same_float),
        t.total - t.same_float,
        frac(t.same_exact),
        frac(t.float_vs_exact_same),
    );
    assert!(frac(t.same_float) >= 0.999, "too many one-step differences");
}

#[test]
fn bad_inputs_are_errors() {
    let p = Params {
        in_dt: DType::U8,
        xs: 0.1,
        xzp: 0,
        out_dt: DType::U8,
        ys: 1.0 / 255.0,
        yzp: 0,
    };
    let x = codes_tensor(vec![2, 3], &[1, 2, 3, 4, 5, 6], DType::U8);
    let err = |m: &Model, x: &Tensor| -> String {
        let s = Session::new(m, SessionOptions::default()).unwrap();
        match s.run(vec![("x".into(), Value::tensor(x.clone()))]) {
            Ok(_) => panic!("error expected"),
            Err(e) => e.to_string(),
        }
    };
    // Float input.
    let xf = Tensor::from_vec(vec![2], vec![1f32, 2.0]).unwrap();
    let e = err(&model(p, -1, 17, true), &xf);
    assert!(e.contains("u8 or i8") && e.contains("QSoftmax"), "{e}");
    // Zero, negative, non-finite scales.
    for (xs, ys) in [
        (0.0, 0.1),
        (-0.5, 0.1),
        (0.1, 0.0),
        (f32::NAN, 0.1),
        (0.1, f32::INFINITY),
    ] {
        let e = err(&model(Params { xs, ys, ..p }, -1, 17, true), &x);
        assert!(e.contains("positive and finite"), "{e}");
    }
    // Non-scalar scale, mismatched zero point, wrong zero point type, bad axis.
    let mut m = model(p, -1, 17, true);
    m.graph.initializers[0].tensor = Tensor::from_vec(vec![2], vec![0.1f32, 0.2]).unwrap();
    let e = err(&m, &x);
    assert!(e.contains("x_scale") && e.contains("scalar"), "{e}");
    let mut m = model(p, -1, 17, true);
    m.graph.initializers[1].tensor = zp_tensor(DType::I8, 0);
    let e = err(&m, &x);
    assert!(e.contains("x_zero_point"), "{e}");
    let mut m = model(p, -1, 17, true);
    m.graph.initializers[3].tensor = Tensor::from_vec(vec![], vec![0i32]).unwrap();
    let e = err(&m, &x);
    assert!(e.contains("y_zero_point") && e.contains("u8 or i8"), "{e}");
    let e = err(&model(p, 2, 17, true), &x);
    assert!(e.contains("axis"), "{e}");
}
