//! `npuc.GgmlMatMul` / `npuc.GgmlGather`: results against f64 products of the dequantized
//! weights (dequantization itself is checked bit-for-bit against gguf-py in npuc-ggml), and
//! malformed attributes / bytes give clear errors, never panics.

use npuc_ggml::{dequantize_row, quantize_row, GgmlType};
use npuc_ir::ValueInfo;
use npuc_ir::{Attr, Graph, Model, Node, OpsetImport, Tensor};
use npuc_runtime::{Session, SessionOptions, Value};
use proptest::prelude::*;

fn model(node: Node, inputs: &[&str]) -> Model {
    Model {
        ir_version: 8,
        opset_imports: vec![
            OpsetImport {
                domain: String::new(),
                version: 17,
            },
            OpsetImport {
                domain: "npuc".into(),
                version: 1,
            },
        ],
        graph: Graph {
            name: "g".into(),
            nodes: vec![node],
            inputs: inputs.iter().map(|n| ValueInfo::new(*n, None)).collect(),
            outputs: vec![ValueInfo::new("y", None)],
            ..Default::default()
        },
        ..Default::default()
    }
}

fn matmul_node(ty: &str, k: i64, act_quant: i64, bias: bool) -> Node {
    let ins: &[&str] = if bias { &["x", "w", "b"] } else { &["x", "w"] };
    let mut n = Node::new("GgmlMatMul", ins, &["y"])
        .with_attr("ggml_type", Attr::String(ty.into()))
        .with_attr("k", Attr::Int(k))
        .with_attr("act_quant", Attr::Int(act_quant));
    n.domain = "npuc".into();
    n.name = "mm".into();
    n
}

fn gather_node(ty: &str, k: i64) -> Node {
    let mut n = Node::new("GgmlGather", &["w", "ids"], &["y"])
        .with_attr("ggml_type", Attr::String(ty.into()))
        .with_attr("k", Attr::Int(k));
    n.domain = "npuc".into();
    n.name = "emb".into();
    n
}

fn t(v: Tensor) -> Value {
    Value::tensor(v)
}

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
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

fn run(m: &Model, feeds: Vec<(&str, Value)>, threads: usize) -> Result<Tensor, String> {
    npuc_llm::register_ops();
    let s = Session::new(m, SessionOptions { threads }).map_err(|e| e.to_string())?;
    let out = s
        .run(feeds.into_iter().map(|(n, v)| (n.to_string(), v)).collect())
        .map_err(|e| e.to_string())?;
    Ok(out[0].1.as_tensor().unwrap().clone())
}

#[test]
fn matmul_matches_dequantized_reference() {
    let (n, k, rows) = (48usize, 256usize, 3usize);
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::F16,
    ] {
        let wf = values(n * k, 7);
        let rb = ty.row_bytes(k).unwrap();
        let mut wq = vec![0u8; n * rb];
        quantize_row(ty, &wf, &mut wq).unwrap();
        let mut wd = vec![0f32; n * k];
        dequantize_row(ty, &wq, &mut wd).unwrap();
        let x = values(rows * k, 11);
        let bias = values(n, 13);
        for (act_quant, tol) in [(0, 1e-5), (1, 2e-2)] {
            for threads in [1, 2] {
                let m = model(
                    matmul_node(ty.name(), k as i64, act_quant, true),
                    &["x", "w", "b"],
                );
                let y = run(
                    &m,
                    vec![
                        (
                            "x",
                            t(Tensor::from_vec(vec![1, rows, k], x.clone()).unwrap()),
                        ),
                        ("w", t(Tensor::from_vec(vec![n, rb], wq.clone()).unwrap())),
                        ("b", t(Tensor::from_vec(vec![n], bias.clone()).unwrap())),
                    ],
                    threads,
                )
                .unwrap();
                assert_eq!(y.shape(), &[1, rows, n]);
                let y = y.as_slice::<f32>().unwrap();
                for i in 0..rows {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|l| x[i * k + l] as f64 * wd[j * k + l] as f64)
                            .sum::<f64>()
                            + bias[j] as f64;
                        let scale: f64 = (0..k)
                            .map(|l| (x[i * k + l] * wd[j * k + l]).abs() as f64)
                            .sum();
                        let got = y[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= tol * scale + 1e-6,
                            "{ty} act_quant={act_quant} [{i},{j}]: {got} vs {want} (scale {scale})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn gather_returns_dequantized_rows() {
    let (n, k) = (10usize, 64usize);
    let ty = GgmlType::Q8_0;
    let rb = ty.row_bytes(k).unwrap();
    let mut wq = vec![0u8; n * rb];
    quantize_row(ty, &values(n * k, 3), &mut wq).unwrap();
    let mut wd = vec![0f32; n * k];
    dequantize_row(ty, &wq, &mut wd).unwrap();
    let m = model(gather_node("Q8_0", k as i64), &["w", "ids"]);
    let y = run(
        &m,
        vec![
            ("w", t(Tensor::from_vec(vec![n, rb], wq).unwrap())),
            (
                "ids",
                t(Tensor::from_vec(vec![2, 2], vec![9i64, 0, 3, 3]).unwrap()),
            ),
        ],
        1,
    )
    .unwrap();
    assert_eq!(y.shape(), &[2, 2, k]);
    let y = y.as_slice::<f32>().unwrap();
    for (r, id) in [9usize, 0, 3, 3].into_iter().enumerate() {
        assert_eq!(&y[r * k..(r + 1) * k], &wd[id * k..(id + 1) * k]);
    }
}

fn err_of(node: Node, inputs: &[&str], feeds: Vec<(&str, Value)>) -> String {
    run(&model(node, inputs), feeds, 1).expect_err("must fail")
}

#[test]
fn malformed_inputs_give_clear_errors() {
    let k = 64;
    let rb = GgmlType::Q8_0.row_bytes(k).unwrap();
    let w = || t(Tensor::from_vec(vec![4, rb], vec![0u8; 4 * rb]).unwrap());
    let x = || t(Tensor::from_vec(vec![1, k], vec![0.5f32; k]).unwrap());
    let e = err_of(
        matmul_node("Q9_9", k as i64, 1, false),
        &["x", "w"],
        vec![("x", x()), ("w", w())],
    );
    assert!(
        e.contains("unknown ggml_type 'Q9_9'") && e.contains("mm"),
        "{e}"
    );
    let e = err_of(
        matmul_node("Q8_0", 48, 1, false),
        &["x", "w"],
        vec![("x", x()), ("w", w())],
    );
    assert!(e.contains("k = 48") && e.contains("block size 32"), "{e}");
    let e = err_of(
        matmul_node("Q8_0", 96, 1, false),
        &["x", "w"],
        vec![("x", x()), ("w", w())],
    );
    assert!(e.contains("must be 102 wide, got 68"), "{e}");
    let short = t(Tensor::from_vec(vec![4, rb - 1], vec![0u8; 4 * (rb - 1)]).unwrap());
    let e = err_of(
        matmul_node("Q8_0", k as i64, 0, false),
        &["x", "w"],
        vec![("x", x()), ("w", short)],
    );
    assert!(e.contains("wide"), "{e}");
    let e = err_of(
        matmul_node("Q8_0", k as i64, 3, false),
        &["x", "w"],
        vec![("x", x()), ("w", w())],
    );
    assert!(e.contains("act_quant must be 0, 1 or 2"), "{e}");
    let xbad = t(Tensor::from_vec(vec![1, 32], vec![0.5f32; 32]).unwrap());
    let e = err_of(
        matmul_node("Q8_0", k as i64, 1, false),
        &["x", "w"],
        vec![("x", xbad), ("w", w())],
    );
    assert!(e.contains("last dimension must be k = 64"), "{e}");
    let e = err_of(
        gather_node("Q8_0", k as i64),
        &["w", "ids"],
        vec![
            ("w", w()),
            (
                "ids",
                t(Tensor::from_vec(vec![3], vec![0i64, 7, 1]).unwrap()),
            ),
        ],
    );
    assert!(
        e.contains("id 7") && e.contains("4 rows") && e.contains("emb"),
        "{e}"
    );
    let e = err_of(
        gather_node("Q8_0", k as i64),
        &["w", "ids"],
        vec![
            ("w", w()),
            ("ids", t(Tensor::from_vec(vec![1], vec![-1i64]).unwrap())),
        ],
    );
    assert!(e.contains("id -1"), "{e}");
    let e = err_of(
        gather_node("IQ2_XXS", 256),
        &["w", "ids"],
        vec![
            ("w", w()),
            ("ids", t(Tensor::from_vec(vec![1], vec![0i64]).unwrap())),
        ],
    );
    assert!(e.contains("IQ2_XXS") && e.contains("not supported"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// Any attribute values and weight shapes: an error or a result, never a panic.
    #[test]
    fn fuzz_never_panics(
        ty in prop::sample::select(vec!["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "F32", "BF16", "IQ4_NL", "Q8_K", "x"]),
        k in -40i64..600,
        rows in 0usize..5,
        width in 0usize..300,
        xlen in 0usize..600,
        act in -1i64..3,
        id in -3i64..8,
        bytes in prop::collection::vec(any::<u8>(), 0..2000),
    ) {
        let mut wb = bytes.clone();
        wb.resize(rows * width, 0x7b);
        let w = Tensor::from_vec(vec![rows, width], wb).unwrap();
        let x = Tensor::from_vec(vec![xlen], vec![0.25f32; xlen]).unwrap();
        let _ = run(&model(matmul_node(ty, k, act, false), &["x", "w"]),
            vec![("x", t(x)), ("w", t(w.clone()))], 1);
        let ids = Tensor::from_vec(vec![2], vec![0i64, id]).unwrap();
        let _ = run(&model(gather_node(ty, k), &["w", "ids"]), vec![("w", t(w)), ("ids", t(ids))], 1);
        let wf = Tensor::from_vec(vec![rows, width], vec![1.0f32; rows * width]).unwrap();
        let x = Tensor::from_vec(vec![xlen], vec![0.25f32; xlen]).unwrap();
        let _ = run(&model(matmul_node(ty, k, act, false), &["x", "w"]), vec![("x", t(x)), ("w", t(wf))], 1);
    }
}
