//! Static shape inference covers every value of the LLM graphs: the `npuc` ops the builders write
//! (GgmlMatMul, GgmlGather, Rope, CachedAttention) carry inference rules in their definitions.

mod common;

use common::fixtures;
use npuc_ir::infer::{infer_model, InferResult};
use npuc_ir::{Attr, DType, Dim, Graph, Model, Node, OpsetImport, TypeInfo, ValueInfo};
use npuc_llm::{build, BuildOptions, Precision, WeightMode};
use std::collections::HashMap;

fn check_all_static(m: &Model, what: &str) {
    let r = infer_model(m, &HashMap::new());
    assert!(r.problems.is_empty(), "{what}: {:?}", r.problems);
    assert!(r.not_inferred.is_empty(), "{what}: {:?}", r.not_inferred);
    for n in &m.graph.nodes {
        for o in &n.outputs {
            let t = r.type_of(o);
            assert!(
                t.is_some_and(InferResult::is_complete),
                "{what}: value '{o}' of {}.{} has type {t:?}",
                n.domain,
                n.op_type
            );
        }
    }
    // The graph outputs' inferred types are what the builder declares.
    for o in &m.graph.outputs {
        if let Some(TypeInfo::Tensor {
            shape: Some(want), ..
        }) = &o.ty
        {
            let Some(TypeInfo::Tensor {
                shape: Some(got), ..
            }) = r.type_of(&o.name)
            else {
                panic!("{what}: output '{}' has no inferred shape", o.name);
            };
            assert_eq!(got, want, "{what}: output '{}'", o.name);
        }
    }
}

#[test]
fn every_value_of_built_llm_graphs_has_a_static_shape() {
    for (model, ty) in [
        ("tiny-llama3", "Q4_K"),
        ("tiny-qwen2", "Q8_0"),
        ("tiny-llama3", "F32"),
    ] {
        let path = fixtures().join(model).join(format!("{model}-{ty}.gguf"));
        let g = npuc_gguf::GgufFile::open(&path).unwrap();
        for precision in [Precision::Fast, Precision::Exact] {
            for tokens in [1, 4] {
                let opts = BuildOptions {
                    tokens,
                    ctx: 16,
                    precision,
                    weights: WeightMode::Auto,
                    weight_quant: Default::default(),
                    repacked: Default::default(),
                };
                let m = build(&g, &opts).unwrap();
                let ops: Vec<&str> = m
                    .graph
                    .nodes
                    .iter()
                    .filter(|n| n.domain == "npuc")
                    .map(|n| n.op_type.as_str())
                    .collect();
                for op in ["GgmlMatMul", "GgmlGather", "Rope", "CachedAttention"] {
                    assert!(ops.contains(&op), "{model} {ty}: no {op} in the graph");
                }
                check_all_static(&m, &format!("{model}-{ty} {precision:?} ar{tokens}"));
            }
        }
    }
}

#[test]
fn gelu_f16_keeps_its_input_shape() {
    npuc_llm::register_ops();
    let x = ValueInfo::new("x", Some(TypeInfo::tensor(DType::F32, &[3, 5])));
    let mut n = Node::new("GeluF16", &["x"], &["y"]).with_attr("unused", Attr::Int(0));
    n.domain = "npuc".into();
    let m = Model {
        opset_imports: vec![OpsetImport {
            domain: "npuc".into(),
            version: 1,
        }],
        graph: Graph {
            nodes: vec![n],
            inputs: vec![x],
            outputs: vec![ValueInfo::new("y", None)],
            ..Default::default()
        },
        ..Default::default()
    };
    let r = infer_model(&m, &HashMap::new());
    assert_eq!(
        r.type_of("y"),
        Some(&TypeInfo::Tensor {
            dtype: Some(DType::F32),
            shape: Some(vec![Dim::Fixed(3), Dim::Fixed(5)]),
        })
    );
}
