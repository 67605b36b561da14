//! onnxruntime attention contrib ops: attribute values and input combinations npuc does not
//! cover are refused with an error naming the node and what is unsupported (never a panic,
//! never a silently different result).

use npuc_ir::{Attr, Graph, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo};
use npuc_runtime::{Session, SessionOptions, Value};

fn f32s(shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(
        shape.to_vec(),
        (0..n).map(|i| (i % 7) as f32 * 0.1).collect(),
    )
    .unwrap()
}

fn i32s(shape: &[usize], v: Vec<i32>) -> Tensor {
    Tensor::from_vec(shape.to_vec(), v).unwrap()
}

/// Runs one `com.microsoft` node named "under_test" on `feeds` (positional, `None` = absent)
/// and returns the error it gives.
fn refusal(
    op: &str,
    attrs: Vec<(&str, Attr)>,
    feeds: Vec<Option<Tensor>>,
    outs: &[&str],
) -> String {
    let names: Vec<String> = feeds
        .iter()
        .enumerate()
        .map(|(i, f)| {
            if f.is_some() {
                format!("in{i}")
            } else {
                String::new()
            }
        })
        .collect();
    let ins: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut n = Node::new(op, &ins, outs);
    n.name = "under_test".into();
    n.domain = "com.microsoft".into();
    for (k, a) in attrs {
        n = n.with_attr(k, a);
    }
    let inputs = feeds
        .iter()
        .zip(&names)
        .filter_map(|(f, name)| {
            f.as_ref().map(|t| {
                ValueInfo::new(
                    name,
                    Some(TypeInfo::Tensor {
                        dtype: Some(t.dtype()),
                        shape: None,
                    }),
                )
            })
        })
        .collect();
    let m = Model {
        ir_version: 8,
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
        graph: Graph {
            name: "g".into(),
            nodes: vec![n],
            inputs,
            outputs: outs
                .iter()
                .filter(|o| !o.is_empty())
                .map(|o| ValueInfo::new(*o, None))
                .collect(),
            ..Default::default()
        },
        ..Default::default()
    };
    let run = || -> Result<(), String> {
        let s = Session::new(&m, SessionOptions { threads: 1 }).map_err(|e| e.to_string())?;
        let feeds = feeds
            .into_iter()
            .zip(&names)
            .filter_map(|(f, name)| f.map(|t| (name.clone(), Value::tensor(t))))
            .collect();
        s.run(feeds).map(|_| ()).map_err(|e| e.to_string())
    };
    run().expect_err("refused")
}

fn assert_names(e: &str, what: &str) {
    assert!(e.contains("under_test") && e.contains(what), "{e}");
}

#[test]
fn attention_refusals() {
    let x = || Some(f32s(&[1, 2, 8]));
    let w = || Some(f32s(&[8, 24]));
    let heads = || ("num_heads", Attr::Int(2));
    let e = refusal(
        "Attention",
        vec![heads(), ("do_rotary", Attr::Int(1))],
        vec![x(), w()],
        &["y"],
    );
    assert_names(&e, "do_rotary = 1 is not supported");
    let mask4 = Some(i32s(&[1, 1, 2, 2], vec![1; 4]));
    let e = refusal(
        "Attention",
        vec![heads()],
        vec![x(), w(), None, mask4],
        &["y"],
    );
    assert_names(&e, "mask [1, 1, 2, 2] is not supported");
    let e = refusal(
        "Attention",
        vec![heads()],
        vec![x(), w(), None, Some(f32s(&[1, 2]))],
        &["y"],
    );
    assert_names(&e, "onnxruntime requires int32");
    let e = refusal(
        "Attention",
        vec![heads(), ("qkv_hidden_sizes", Attr::Ints(vec![8, 4, 12]))],
        vec![x(), w()],
        &["y"],
    );
    assert_names(&e, "must be equal Q/K");
}

#[test]
fn multi_head_attention_refusals() {
    let heads = || ("num_heads", Attr::Int(2));
    let e = refusal(
        "MultiHeadAttention",
        vec![heads()],
        vec![Some(f32s(&[1, 2, 2, 3, 4])), None, None, Some(f32s(&[24]))],
        &["y"],
    );
    assert_names(&e, "bias with packed QKV / packed KV is not supported");
    let e = refusal(
        "MultiHeadAttention",
        vec![heads()],
        vec![Some(f32s(&[1, 2, 2, 2, 4]))],
        &["y"],
    );
    assert_names(
        &e,
        "packed QKV query [1, 2, 2, 2, 4] must be [batch, seq, 2, 3, head_size]",
    );
    let q = || Some(f32s(&[1, 2, 8]));
    let e = refusal(
        "MultiHeadAttention",
        vec![heads()],
        vec![
            q(),
            q(),
            q(),
            None,
            None,
            None,
            None,
            None,
            None,
            Some(i32s(&[1, 1], vec![0])),
        ],
        &["y"],
    );
    assert_names(&e, "cache_indirection) is not supported");
    let e = refusal(
        "MultiHeadAttention",
        vec![heads()],
        vec![q(), q(), q(), None, Some(i32s(&[5], vec![2; 5]))],
        &["y"],
    );
    assert_names(&e, "key_padding_mask [5]");
    let e = refusal(
        "MultiHeadAttention",
        vec![heads(), ("unidirectional", Attr::Int(1))],
        vec![q(), Some(f32s(&[1, 3, 8])), Some(f32s(&[1, 3, 8]))],
        &["y"],
    );
    assert_names(
        &e,
        "unidirectional with a key length 3 other than the query length 2",
    );
}

#[test]
fn group_query_attention_refusals() {
    let attrs = |extra: Option<(&'static str, Attr)>| {
        let mut a = vec![("num_heads", Attr::Int(2)), ("kv_num_heads", Attr::Int(1))];
        a.extend(extra);
        a
    };
    let feeds = || {
        vec![
            Some(f32s(&[1, 2, 8])),
            Some(f32s(&[1, 2, 4])),
            Some(f32s(&[1, 2, 4])),
            None,
            None,
            Some(i32s(&[1], vec![1])),
            Some(i32s(&[], vec![2])),
        ]
    };
    let e = refusal(
        "GroupQueryAttention",
        attrs(Some(("smooth_softmax", Attr::Int(1)))),
        feeds(),
        &["y"],
    );
    assert_names(&e, "smooth_softmax = 1 is not supported");
    let mut f = feeds();
    f.extend([
        None,
        None,
        Some(Tensor::from_vec(vec![1, 2], vec![0i64, 1]).unwrap()),
    ]);
    let e = refusal("GroupQueryAttention", attrs(None), f, &["y"]);
    assert_names(&e, "position_ids) is not supported");
    let mut f = feeds();
    f[5] = Some(i32s(&[1], vec![9]));
    let e = refusal("GroupQueryAttention", attrs(None), f, &["y"]);
    assert_names(&e, "seqlens_k[0] = 9 does not fit");
    let e = refusal(
        "GroupQueryAttention",
        attrs(Some(("do_rotary", Attr::Int(1)))),
        feeds(),
        &["y"],
    );
    assert_names(&e, "do_rotary needs cos_cache and sin_cache");
}

#[test]
fn embed_layer_normalization_refusals() {
    let feeds = |id: i32| {
        vec![
            Some(i32s(&[1, 2], vec![0, id])),
            None,
            Some(f32s(&[4, 8])),
            Some(f32s(&[4, 8])),
            None,
            Some(f32s(&[8])),
            Some(f32s(&[8])),
        ]
    };
    let e = refusal("EmbedLayerNormalization", vec![], feeds(4), &["y"]);
    assert_names(&e, "input id 4 is outside the table's 4 rows");
    let e = refusal(
        "EmbedLayerNormalization",
        vec![("mask_index_type", Attr::Int(0))],
        feeds(1),
        &["y"],
    );
    assert_names(&e, "mask_index_type = 0 is not supported");
}
