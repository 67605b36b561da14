//! Ops that split their work across a session's threads (rows of a broadcast, outer rows of
//! a Concat or a Resize pass, output channels of ConvTranspose's col2im, runs of a transpose)
//! must give the same bits at 1 and at 2 threads: the split changes who computes a value,
//! never how. Shapes are large enough to cross every op's split threshold. ConvTranspose's
//! tiled path (kernel = stride, a detection head's 2x2 upsampling) is also checked against
//! the definition computed here. Channels-last convs that run direct split output rows.

use npuc_ir::ValueInfo;
use npuc_ir::{Attr, DType, Dim, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo};
use npuc_runtime::{Session, SessionOptions, Value};

fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn input(name: &str, shape: &[usize]) -> ValueInfo {
    ValueInfo::new(
        name,
        Some(TypeInfo::Tensor {
            dtype: Some(DType::F32),
            shape: Some(shape.iter().map(|&d| Dim::Fixed(d)).collect()),
        }),
    )
}

/// One model of `nodes` over f32 inputs `ins` (name, shape), the given outputs and
/// initializers.
fn model(
    nodes: Vec<Node>,
    ins: &[(&str, Vec<usize>)],
    outs: &[&str],
    inits: Vec<(&str, Tensor)>,
) -> Model {
    Model {
        ir_version: 8,
        opset_imports: vec![
            OpsetImport {
                domain: String::new(),
                version: 19,
            },
            OpsetImport {
                domain: "npuc".into(),
                version: 1,
            },
        ],
        graph: Graph {
            name: "g".into(),
            nodes,
            inputs: ins.iter().map(|(n, s)| input(n, s)).collect(),
            outputs: outs.iter().map(|o| ValueInfo::new(*o, None)).collect(),
            initializers: inits
                .into_iter()
                .map(|(name, tensor)| Initializer {
                    name: name.into(),
                    tensor,
                })
                .collect(),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Feeds for `ins`: input `i` drawn from `rnd` with seed `i + 7`.
fn feeds(ins: &[(&str, Vec<usize>)]) -> Vec<(String, Value)> {
    ins.iter()
        .enumerate()
        .map(|(i, (n, shape))| {
            let len = shape.iter().product();
            let t = Tensor::from_vec(shape.clone(), rnd(len, i as u64 + 7)).unwrap();
            (n.to_string(), Value::tensor(t))
        })
        .collect()
}

/// [`model`] run at `threads` on [`feeds`].
fn run(
    nodes: Vec<Node>,
    ins: &[(&str, Vec<usize>)],
    outs: &[&str],
    inits: Vec<(&str, Tensor)>,
    threads: usize,
) -> Vec<Tensor> {
    let s = Session::new(&model(nodes, ins, outs, inits), SessionOptions { threads }).unwrap();
    // Two runs: the second reuses the session's pooled buffers (stale contents).
    s.run(feeds(ins)).unwrap();
    s.run(feeds(ins))
        .unwrap()
        .into_iter()
        .map(|(_, v)| match v {
            Value::Tensor(t) => (*t).clone(),
            _ => panic!("not a tensor"),
        })
        .collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.as_slice::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Runs at 1 and 2 threads and asserts equal shapes and bits; returns the 1-thread outputs.
fn agree(
    what: &str,
    nodes: Vec<Node>,
    ins: &[(&str, Vec<usize>)],
    outs: &[&str],
    inits: Vec<(&str, Tensor)>,
) -> Vec<Tensor> {
    let one = run(nodes.clone(), ins, outs, inits.clone(), 1);
    let two = run(nodes, ins, outs, inits, 2);
    for (i, (a, b)) in one.iter().zip(&two).enumerate() {
        assert_eq!(a.shape(), b.shape(), "{what}: output {i} shape");
        assert!(
            bits(a) == bits(b),
            "{what}: output {i} differs between 1 and 2 threads"
        );
    }
    one
}

#[test]
fn broadcast_binary_ops() {
    // Channels-last scale (an SE block): x [1, 40, 40, 64] * gate [1, 1, 1, 64], with x also
    // an output (not reusable: a fresh output) and reusable (in place).
    let (x, g) = (vec![1, 40, 40, 64], vec![1, 1, 1, 64]);
    let outs = agree(
        "Mul broadcast, x kept",
        vec![
            Node::new("Relu", &["x"], &["xr"]),
            Node::new("Mul", &["xr", "g"], &["y"]),
        ],
        &[("x", x.clone()), ("g", g.clone())],
        &["y", "xr"],
        vec![],
    );
    let (y, xr) = (
        outs[0].as_slice::<f32>().unwrap(),
        outs[1].as_slice::<f32>().unwrap(),
    );
    let gv = rnd(64, 8);
    for (i, (&yv, &xv)) in y.iter().zip(xr).enumerate() {
        assert_eq!(yv.to_bits(), (xv * gv[i % 64]).to_bits(), "Mul value {i}");
    }
    agree(
        "Add broadcast, in place",
        vec![
            Node::new("Relu", &["x"], &["xr"]),
            Node::new("Add", &["g", "xr"], &["y"]),
        ],
        &[("x", x), ("g", g)],
        &["y"],
        vec![],
    );
}

#[test]
fn concat_resize_sigmoid_transpose() {
    let s = vec![1, 80, 80, 16];
    agree(
        "Concat of channels",
        vec![Node::new("Concat", &["a", "b", "c"], &["y"]).with_attr("axis", Attr::Int(3))],
        &[("a", s.clone()), ("b", s.clone()), ("c", s.clone())],
        &["y"],
        vec![],
    );
    for (mode, side, scale) in [("nearest", 20, 4f32), ("linear", 40, 2.0)] {
        agree(
            &format!("Resize {mode} x{scale}"),
            vec![Node::new("Resize", &["x", "", "sc"], &["y"])
                .with_attr("mode", Attr::String(mode.into()))],
            &[("x", vec![1, 16, side, side])],
            &["y"],
            vec![(
                "sc",
                Tensor::from_vec(vec![4], vec![1f32, 1.0, scale, scale]).unwrap(),
            )],
        );
    }
    agree(
        "Sigmoid",
        vec![Node::new("Sigmoid", &["x"], &["y"])],
        &[("x", vec![1, 1, 160, 160])],
        &["y"],
        vec![],
    );
    agree(
        "Transpose NHWC to NCHW",
        vec![Node::new("Transpose", &["x"], &["y"]).with_attr("perm", Attr::Ints(vec![0, 3, 1, 2]))],
        &[("x", s)],
        &["y"],
        vec![],
    );
}

#[test]
fn image_to_channels_last_matches_definition() {
    // An image's 3 planes interleaved into NHWC pixels (the entry transpose of every
    // channels-last model), split into pixel runs at 2 threads.
    let (c, h, w) = (3usize, 160usize, 200usize);
    let outs = agree(
        "Transpose NCHW to NHWC, 3 channels",
        vec![Node::new("Transpose", &["x"], &["y"]).with_attr("perm", Attr::Ints(vec![0, 2, 3, 1]))],
        &[("x", vec![1, c, h, w])],
        &["y"],
        vec![],
    );
    assert_eq!(outs[0].shape(), &[1, h, w, c]);
    let x = rnd(c * h * w, 7);
    let y = outs[0].as_slice::<f32>().unwrap();
    for p in 0..h * w {
        for ch in 0..c {
            assert_eq!(
                y[p * c + ch].to_bits(),
                x[ch * h * w + p].to_bits(),
                "pixel {p} channel {ch}"
            );
        }
    }
}

#[test]
fn conv_transpose_tiled_matches_definition() {
    // 2x2 stride 2 (taps tile the output) with bias: 16 output channels (a product per kernel
    // row), 1 and 3 (a narrow head: one product over all taps, 2 or 6 values a pixel copied
    // out); and a 3x3 stride 2 padded one (overlapping taps: the accumulating path) for the
    // thread check.
    let (c, h, w) = (16usize, 40usize, 40usize);
    for m in [16usize, 1, 3] {
        let wt = Tensor::from_vec(vec![c, m, 2, 2], rnd(c * m * 4, 3)).unwrap();
        let bias = rnd(m, 4);
        let outs = agree(
            &format!("ConvTranspose 2x2 s2, {m} outputs"),
            vec![Node::new("ConvTranspose", &["x", "w", "b"], &["y"])
                .with_attr("kernel_shape", Attr::Ints(vec![2, 2]))
                .with_attr("strides", Attr::Ints(vec![2, 2]))],
            &[("x", vec![1, c, h, w])],
            &["y"],
            vec![
                ("w", wt.clone()),
                ("b", Tensor::from_vec(vec![m], bias.clone()).unwrap()),
            ],
        );
        let y = outs[0].as_slice::<f32>().unwrap();
        assert_eq!(outs[0].shape(), &[1, m, 2 * h, 2 * w]);
        let x = rnd(c * h * w, 7);
        let wv = wt.as_slice::<f32>().unwrap();
        for mi in 0..m {
            for oy in 0..2 * h {
                for ox in 0..2 * w {
                    let (iy, a, ix, b) = (oy / 2, oy % 2, ox / 2, ox % 2);
                    let sum: f64 = (0..c)
                        .map(|ci| {
                            x[(ci * h + iy) * w + ix] as f64
                                * wv[((ci * m + mi) * 2 + a) * 2 + b] as f64
                        })
                        .sum();
                    let want = sum + bias[mi] as f64;
                    let got = y[(mi * 2 * h + oy) * 2 * w + ox] as f64;
                    // 16 products of values in [-1, 1] summed in f32: 1e-5 is ~100 ulps of headroom.
                    assert!(
                        (got - want).abs() <= 1e-5,
                        "({mi}, {oy}, {ox}): {got} vs {want}"
                    );
                }
            }
        }
    }
    let m = 16;
    agree(
        "ConvTranspose 3x3 s2 padded",
        vec![Node::new("ConvTranspose", &["x", "w"], &["y"])
            .with_attr("kernel_shape", Attr::Ints(vec![3, 3]))
            .with_attr("strides", Attr::Ints(vec![2, 2]))
            .with_attr("pads", Attr::Ints(vec![1, 1, 1, 1]))],
        &[("x", vec![1, c, h, w])],
        &["y"],
        vec![(
            "w",
            Tensor::from_vec(vec![c, m, 3, 3], rnd(c * m * 9, 5)).unwrap(),
        )],
    );
}

#[test]
fn direct_nhwc_convs() {
    // Channels-last KxK convs over wide rows run direct (kernel rows read in place, border
    // columns through im2col), split by output rows at 2 threads: a narrow 3x3 (16 outputs),
    // a strided 3x3 over two weight panels, an unpadded 2x2 and a 5x5 with two border columns.
    let cases: [(&str, usize, usize, usize, usize, usize); 4] = [
        ("3x3 s1 narrow", 32, 16, 3, 1, 1),
        ("3x3 s2 two panels", 24, 48, 3, 2, 1),
        ("2x2 unpadded", 16, 8, 2, 1, 0),
        ("5x5 s1", 8, 24, 5, 1, 2),
    ];
    for (i, &(what, c, m, k, s, p)) in cases.iter().enumerate() {
        let mut node = Node::new("ConvNhwc", &["x", "w", "b"], &["y"])
            .with_attr("kernel_shape", Attr::Ints(vec![k as i64; 2]))
            .with_attr("strides", Attr::Ints(vec![s as i64; 2]))
            .with_attr("pads", Attr::Ints(vec![p as i64; 4]))
            .with_attr("activation", Attr::String("Relu".into()));
        node.domain = "npuc".into();
        agree(
            what,
            vec![node],
            &[("x", vec![2, 30, 44, c])],
            &["y"],
            vec![
                (
                    "w",
                    Tensor::from_vec(vec![m, c, k, k], rnd(m * c * k * k, 11 + i as u64)).unwrap(),
                ),
                (
                    "b",
                    Tensor::from_vec(vec![m], rnd(m, 13 + i as u64)).unwrap(),
                ),
            ],
        );
    }
}

#[test]
fn concurrent_runs_of_one_two_thread_session() {
    // Several callers running one 2-thread session at once: each run keeps the pool's other
    // workers awake, and a worker waiting inside one run must not spin for another run's end
    // (two such waiters could each wait on the other). Every result equals the single-caller
    // one.
    let ins = [("x", vec![1, 40, 40, 64]), ("g", vec![1, 1, 1, 64])];
    let m = model(
        vec![
            Node::new("Relu", &["x"], &["xr"]),
            Node::new("Mul", &["xr", "g"], &["y"]),
            Node::new("Sigmoid", &["y"], &["z"]),
        ],
        &ins,
        &["z", "xr"],
        vec![],
    );
    let s = Session::new(&m, SessionOptions { threads: 2 }).unwrap();
    let run = || -> Vec<u32> {
        match &s.run(feeds(&ins)).unwrap()[0].1 {
            Value::Tensor(t) => bits(t),
            _ => panic!("not a tensor"),
        }
    };
    let want = run();
    std::thread::scope(|sc| {
        let callers: Vec<_> = (0..4)
            .map(|_| {
                sc.spawn(|| {
                    for _ in 0..25 {
                        assert!(run() == want, "a concurrent run differs");
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
    });
}
