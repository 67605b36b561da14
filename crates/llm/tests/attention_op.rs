//! `npuc.CachedAttention` against a direct f64 implementation over explicit key/value lists:
//! GQA head mapping, keys split between the cache and this call, the causal mask, the sliding
//! window and f16 caches.

use npuc_ir::{f16, DType, Graph, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo};
use npuc_runtime::{Session, SessionOptions, Value};

/// Deterministic pseudo-random values in [-1, 1).
fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn model(window: i64, kv: DType, shapes: [&[usize]; 7]) -> Model {
    let names = ["q", "k", "v", "pk", "pv", "pos", "mask"];
    let dts = [
        DType::F32,
        DType::F32,
        DType::F32,
        kv,
        kv,
        DType::I64,
        DType::F32,
    ];
    let node = Node {
        domain: "npuc".into(),
        ..Node::new("CachedAttention", &names, &["out"])
    }
    .with_attr("scale", npuc_ir::Attr::Float(0.3))
    .with_attr("window", npuc_ir::Attr::Int(window));
    Model {
        ir_version: 10,
        opset_imports: vec![
            OpsetImport {
                domain: String::new(),
                version: 23,
            },
            OpsetImport {
                domain: "npuc".into(),
                version: 1,
            },
        ],
        graph: Graph {
            nodes: vec![node],
            inputs: names
                .iter()
                .zip(dts)
                .zip(shapes)
                .map(|((n, d), s)| ValueInfo::new(*n, Some(TypeInfo::tensor(d, s))))
                .collect(),
            outputs: vec![ValueInfo::new("out", None)],
            ..Default::default()
        },
        ..Default::default()
    }
}

/// `n` tokens: 3 takes the per-row path, 9 (18 rows per KV head) the batched one (two products).
fn check(window: i64, kv: DType, n: usize) {
    let (h, kvh, d, past) = (4usize, 2usize, 8usize, 4usize);
    let c = past + n + 3;
    let q = rnd(n * h * d, 1);
    let k = rnd(n * kvh * d, 2);
    let v = rnd(n * kvh * d, 3);
    let pk = rnd(kvh * c * d, 4);
    let pv = rnd(kvh * c * d, 5);
    let pos: Vec<i64> = (0..n as i64).map(|i| past as i64 + i).collect();
    let mut mask = vec![f32::NEG_INFINITY; n * c];
    for i in 0..n {
        mask[i * c..i * c + past + i + 1].fill(0.0);
    }
    let round = |x: f32| {
        if kv == DType::F16 {
            f16::from_f32(x).to_f32()
        } else {
            x
        }
    };
    let cache = |v: &[f32]| -> Tensor {
        if kv == DType::F16 {
            Tensor::from_vec(
                vec![kvh, c, d],
                v.iter().map(|&x| f16::from_f32(x)).collect(),
            )
            .unwrap()
        } else {
            Tensor::from_vec(vec![kvh, c, d], v.to_vec()).unwrap()
        }
    };
    let m = model(
        window,
        kv,
        [
            &[n, h, d],
            &[n, kvh, d],
            &[n, kvh, d],
            &[kvh, c, d],
            &[kvh, c, d],
            &[n],
            &[n, c],
        ],
    );
    npuc_llm::register_ops();
    let s = Session::new(&m, SessionOptions { threads: 1 }).unwrap();
    let feeds = vec![
        (
            "q".to_string(),
            Value::tensor(Tensor::from_vec(vec![n, h, d], q.clone()).unwrap()),
        ),
        (
            "k".to_string(),
            Value::tensor(Tensor::from_vec(vec![n, kvh, d], k.clone()).unwrap()),
        ),
        (
            "v".to_string(),
            Value::tensor(Tensor::from_vec(vec![n, kvh, d], v.clone()).unwrap()),
        ),
        ("pk".to_string(), Value::tensor(cache(&pk))),
        ("pv".to_string(), Value::tensor(cache(&pv))),
        (
            "pos".to_string(),
            Value::tensor(Tensor::from_vec(vec![n], pos.clone()).unwrap()),
        ),
        (
            "mask".to_string(),
            Value::tensor(Tensor::from_vec(vec![n, c], mask).unwrap()),
        ),
    ];
    let out = s.run(feeds).unwrap();
    let got = out[0]
        .1
        .as_tensor()
        .unwrap()
        .as_slice::<f32>()
        .unwrap()
        .to_vec();
    assert_eq!(got.len(), n * h * d);
    let mut worst = 0f64;
    for i in 0..n {
        for hh in 0..h {
            let g = hh / (h / kvh);
            // Visible slots: the cache's first `past`, then this call's tokens up to i.
            let mut keys: Vec<(usize, Vec<f64>, Vec<f64>)> = vec![];
            for p in 0..past {
                let o = (g * c + p) * d;
                keys.push((
                    p,
                    pk[o..o + d].iter().map(|&x| round(x) as f64).collect(),
                    pv[o..o + d].iter().map(|&x| round(x) as f64).collect(),
                ));
            }
            for j in 0..=i {
                let o = (j * kvh + g) * d;
                keys.push((
                    past + j,
                    k[o..o + d].iter().map(|&x| round(x) as f64).collect(),
                    v[o..o + d].iter().map(|&x| round(x) as f64).collect(),
                ));
            }
            if window > 0 {
                keys.retain(|(p, _, _)| (pos[i] - *p as i64) < window);
            }
            let qr: Vec<f64> = q[(i * h + hh) * d..(i * h + hh + 1) * d]
                .iter()
                .map(|&x| round(x) as f64)
                .collect();
            let sc: Vec<f64> = keys
                .iter()
                .map(|(_, kk, _)| 0.3 * kk.iter().zip(&qr).map(|(a, b)| a * b).sum::<f64>())
                .collect();
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for t in 0..d {
                let want: f64 = keys
                    .iter()
                    .zip(&e)
                    .map(|((_, _, vv), w)| w / z * vv[t])
                    .sum();
                let diff = (got[(i * h + hh) * d + t] as f64 - want).abs();
                worst = worst.max(diff);
            }
        }
    }
    // f16: the probabilities are rounded to f16 before the product with V (like ggml).
    let tol = if kv == DType::F16 { 2e-3 } else { 1e-5 };
    assert!(worst <= tol, "window {window} {kv} n {n}: max diff {worst}");
}

#[test]
fn cached_attention_matches_direct_computation() {
    for kv in [DType::F32, DType::F16] {
        for window in [0, 3] {
            for n in [3, 9] {
                check(window, kv, n);
            }
        }
    }
}
