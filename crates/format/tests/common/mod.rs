//! Shared fixtures for the artifact tests: a model touching every META feature, and a small
//! deterministic PRNG (no new dependencies).
#![allow(dead_code)]

use npuc_format::{ArtifactWriter, GraphInfo, Target};
use npuc_ir::{
    bf16, f16, Attr, DType, Dim, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo,
    ValueInfo,
};

pub fn f32_tensor(shape: Vec<usize>, seed: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37 + seed).sin()).collect();
    Tensor::from_vec(shape, v).expect("f32 tensor")
}

fn tensor_ty(dtype: DType, dims: Vec<Dim>) -> Option<TypeInfo> {
    Some(TypeInfo::Tensor {
        dtype: Some(dtype),
        shape: Some(dims),
    })
}

fn node(name: &str, op: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<(&str, Attr)>) -> Node {
    Node {
        name: name.into(),
        op_type: op.into(),
        domain: String::new(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        outputs: outputs.iter().map(|s| s.to_string()).collect(),
        attrs: attrs.into_iter().map(|(k, a)| (k.to_string(), a)).collect(),
        doc: String::new(),
    }
}

fn init(name: &str, t: Tensor) -> Initializer {
    Initializer {
        name: name.into(),
        tensor: t,
    }
}

/// Initializers of every dtype the writer stores, including sub-byte and small-float codes,
/// strings, a scalar, an empty tensor, a byte-identical duplicate and a same-bytes reshape.
pub fn all_dtype_initializers() -> Vec<Initializer> {
    let w = f32_tensor(vec![16, 16], 0.5);
    vec![
        init("w", w.clone()),
        init("w_dup", w.clone()),
        init("w_flat", w.clone().reshaped(vec![256]).expect("reshape")),
        init("b", f32_tensor(vec![16], 1.0)),
        init(
            "idx",
            Tensor::from_vec(vec![3], vec![-1i64, 0, i64::MAX]).unwrap(),
        ),
        init(
            "h",
            Tensor::from_vec(
                vec![5],
                (0..5).map(|i| f16::from_f32(i as f32 * 0.5)).collect(),
            )
            .unwrap(),
        ),
        init(
            "bf",
            Tensor::from_vec(
                vec![4],
                (0..4).map(|i| bf16::from_f32(i as f32 - 2.0)).collect(),
            )
            .unwrap(),
        ),
        init(
            "d",
            Tensor::from_vec(vec![], vec![std::f64::consts::PI]).unwrap(),
        ),
        init(
            "flag",
            Tensor::from_vec(vec![3], vec![true, false, true]).unwrap(),
        ),
        init(
            "bytes",
            Tensor::from_vec(vec![9], (0u8..9).collect()).unwrap(),
        ),
        init(
            "i8",
            Tensor::from_vec(vec![2, 2], vec![-128i8, -1, 0, 127]).unwrap(),
        ),
        init(
            "i16",
            Tensor::from_vec(vec![3], vec![-300i16, 0, 300]).unwrap(),
        ),
        init("u16", Tensor::from_vec(vec![2], vec![1u16, 65535]).unwrap()),
        init("i32", Tensor::from_vec(vec![2], vec![i32::MIN, 7]).unwrap()),
        init("u32", Tensor::from_vec(vec![1], vec![u32::MAX]).unwrap()),
        init("u64", Tensor::from_vec(vec![1], vec![u64::MAX]).unwrap()),
        init(
            "empty",
            Tensor::from_vec(vec![0, 4], Vec::<f32>::new()).unwrap(),
        ),
        init(
            "u4",
            Tensor::from_codes(DType::U4, vec![7], vec![0, 1, 2, 3, 13, 14, 15]).unwrap(),
        ),
        init(
            "i4",
            Tensor::from_codes(DType::I4, vec![5], vec![0x8, 0xf, 0, 1, 7]).unwrap(),
        ),
        init(
            "i2",
            Tensor::from_codes(DType::I2, vec![4], vec![0, 1, 2, 3]).unwrap(),
        ),
        init(
            "u2",
            Tensor::from_codes(DType::U2, vec![4], vec![3, 2, 1, 0]).unwrap(),
        ),
        init(
            "f8",
            Tensor::from_codes(DType::F8E4M3FN, vec![3], vec![0x00, 0x38, 0xfe]).unwrap(),
        ),
        init(
            "f4",
            Tensor::from_codes(DType::F4E2M1, vec![2], vec![0x1, 0xf]).unwrap(),
        ),
        init(
            "names",
            Tensor::from_strings(vec![2], vec!["alpha".into(), "βeta\n\"q\"".into()]).unwrap(),
        ),
    ]
}

/// A model exercising every META feature: symbolic/unknown dims, sequence types, every
/// attribute kind (including nested graphs with their own initializers), a custom domain,
/// metadata, and weights of every dtype.
pub fn sample_model() -> Model {
    let branch = |seed: f32| Graph {
        name: format!("branch{seed}"),
        nodes: vec![node("", "Add", &["x", "bw"], &["o"], vec![])],
        inputs: vec![],
        outputs: vec![ValueInfo::new(
            "o",
            tensor_ty(DType::F32, vec![Dim::Unknown]),
        )],
        initializers: vec![init("bw", f32_tensor(vec![16], seed))],
        value_info: vec![],
        doc: String::new(),
    };
    let nodes = vec![
        node("mm", "MatMul", &["x", "w"], &["t0"], vec![]),
        node("add", "Add", &["t0", "b"], &["t1"], vec![]),
        node(
            "if",
            "If",
            &["cond"],
            &["t2"],
            vec![
                ("then_branch", Attr::Graph(Box::new(branch(2.0)))),
                ("else_branch", Attr::Graph(Box::new(branch(3.0)))),
            ],
        ),
        node(
            "const",
            "Constant",
            &[],
            &["c"],
            vec![("value", Attr::Tensor(f32_tensor(vec![4], 9.0)))],
        ),
        node(
            "attrs",
            "Custom",
            &["t1", "", "c"],
            &["out", ""],
            vec![
                ("f", Attr::Float(1.0e-40)),
                ("negzero", Attr::Float(-0.0)),
                ("big", Attr::Float(f32::MAX)),
                ("i", Attr::Int(i64::MIN)),
                ("s", Attr::String("é \"quoted\"".into())),
                ("t", Attr::Tensor(f32_tensor(vec![16, 16], 0.5))),
                ("sp", Attr::SparseTensor(f32_tensor(vec![2], 4.0))),
                (
                    "ty",
                    Attr::Type(TypeInfo::Map {
                        key: Some(DType::I64),
                        value: Some(Box::new(TypeInfo::Optional(Some(Box::new(
                            TypeInfo::SparseTensor {
                                dtype: Some(DType::F16),
                                shape: None,
                            },
                        ))))),
                    }),
                ),
                (
                    "fs",
                    Attr::Floats(vec![f32::INFINITY, f32::NEG_INFINITY, 0.1]),
                ),
                ("is", Attr::Ints(vec![1, -2, 3])),
                ("ss", Attr::Strings(vec!["a".into(), String::new()])),
                (
                    "ts",
                    Attr::Tensors(vec![
                        f32_tensor(vec![3], 5.0),
                        Tensor::from_strings(vec![1], vec!["x".into()]).unwrap(),
                    ]),
                ),
                ("sps", Attr::SparseTensors(vec![f32_tensor(vec![1], 6.0)])),
                ("gs", Attr::Graphs(vec![branch(7.0)])),
                (
                    "tys",
                    Attr::Types(vec![
                        TypeInfo::Sequence(None),
                        TypeInfo::Sequence(Some(Box::new(TypeInfo::Tensor {
                            dtype: None,
                            shape: Some(vec![Dim::Symbolic("n".into()), Dim::Fixed(0)]),
                        }))),
                    ]),
                ),
            ],
        ),
        Node {
            domain: "com.microsoft".into(),
            ..node("", "FusedThing", &["out"], &["out2"], vec![])
        },
    ];
    Model {
        ir_version: 10,
        opset_imports: vec![
            OpsetImport {
                domain: String::new(),
                version: 17,
            },
            OpsetImport {
                domain: "com.microsoft".into(),
                version: 1,
            },
        ],
        producer_name: "npuc".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        graph: Graph {
            name: "sample".into(),
            nodes,
            inputs: vec![
                ValueInfo::new(
                    "x",
                    tensor_ty(
                        DType::F32,
                        vec![Dim::Symbolic("batch".into()), Dim::Fixed(16)],
                    ),
                ),
                ValueInfo::new("cond", tensor_ty(DType::Bool, vec![])),
                ValueInfo::new(
                    "seq",
                    Some(TypeInfo::Sequence(Some(Box::new(TypeInfo::Tensor {
                        dtype: Some(DType::F32),
                        shape: None,
                    })))),
                ),
                ValueInfo::new("untyped", None),
            ],
            outputs: vec![ValueInfo::new(
                "out2",
                tensor_ty(DType::F32, vec![Dim::Unknown, Dim::Fixed(16)]),
            )],
            initializers: all_dtype_initializers(),
            value_info: vec![],
            doc: String::new(),
        },
        metadata: vec![
            ("author".into(), "tests".into()),
            ("k".into(), String::new()),
        ],
        ..Default::default()
    }
}

/// An artifact for this machine holding `sample_model` as graph "main".
pub fn sample_writer() -> ArtifactWriter {
    let mut w = ArtifactWriter::new(Target::host(), serde_json::json!({"optimize": false}));
    w.add_source("sample.onnx", b"not really onnx");
    w.add_graph("main", &sample_model(), GraphInfo::default())
        .expect("add_graph");
    w
}

/// splitmix64: a tiny deterministic PRNG so failures reproduce from the printed seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..hi` (`hi > lo`).
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo) as u64) as usize
    }
}
