//! onnxruntime's contrib ops (`com.microsoft`), as optimized and GenAI exports use them,
//! rewritten at import into exact equivalents npuc runs: standard ops, or `npuc` ops that are
//! the ONNX op at its newest opset whatever the model's opset (`npuc.LayerNormalization`,
//! `npuc.RMSNormalization`, `npuc.Gelu`). Each rewrite computes what onnxruntime's kernel does
//! (same formula; tested against onnxruntime on graphs that use each op):
//!
//! | contrib op | rewrite |
//! |---|---|
//! | `FastGelu(X[, bias])` | `npuc.Gelu(X + bias, approximate = tanh)` |
//! | `BiasGelu(A, B)`, `Gelu(X)` | `npuc.Gelu(A + B)` (erf form) |
//! | `QuickGelu(X; alpha = 1.702)` | `X · Sigmoid(alpha · X)` |
//! | `SkipLayerNormalization(x, skip, gamma[, beta][, bias]; epsilon)` | `s = x + skip (+ bias)`; `npuc.LayerNormalization(s, gamma, beta; axis = -1)` → output, mean, inv_std_var; `s` → `input_skip_bias_sum` |
//! | `SkipSimplifiedLayerNormalization(x, skip, gamma[, bias]; epsilon)` | `s` as above; `npuc.RMSNormalization(s, gamma; axis = -1)`; `s` → `input_skip_bias_sum` |
//! | `SimplifiedLayerNormalization(X, scale; axis, epsilon)` (ONNX domain in onnxruntime) | `npuc.RMSNormalization(X, scale; axis)` |
//! | `FusedMatMul(A, B; alpha, transA, transB)` | `alpha · MatMul(A', B')`, `'` swapping the last two axes (rank from the graph's types) |
//! | `MatMulNBits(A, B, scales[, zero_points][, g_idx][, bias]; K, N, bits, block_size)` | `MatMul(A, W) (+ bias)`, `W` the constant weight dequantized to f32 `[K, N]` (2/4/8 bits) |
//!
//! An output these rewrites cannot produce (the RMS norms' `inv_std_var`, `mean`) or an
//! attribute they do not cover (`transBatchA/B`) is refused naming the node.
//!
//! These stay as they are and run on runtime kernels (`npuc_runtime::ops::contrib` and
//! `contrib_attention`, float32, onnxruntime's CPU semantics; shape inference in
//! `npuc_ir::infer`, so `npuc compile` plans them):
//!
//! | contrib op | kernel |
//! |---|---|
//! | `RotaryEmbedding(input, position_ids, cos_cache, sin_cache)` | rotary embedding, 3-D or 4-D input, interleaved or half-split, partial rotary dim |
//! | `Attention(input, weights[, bias][, mask_index][, past][, attention_bias])` | `Q/K/V = input · weights + bias` split by `qkv_hidden_sizes`; mask_index 1-D `[B]`/`[2B]`, 2-D, 3-D; `unidirectional`, `mask_filter_value`, `scale`; `past` `[2, B, N, P, H]` → `present` |
//! | `MultiHeadAttention(query, key, value[, bias][, key_padding_mask][, attention_bias][, past_key, past_value])` | K/V `[B, L, D]` (bias added, past concatenated → present_key/value) or `[B, N, L, H]`, or packed QKV `[B, S, N, 3, H]` / KV `[B, L, N, 2, H]` (split first); masks as Attention; `unidirectional`, `scale` |
//! | `GroupQueryAttention(query[, key, value], past_key, past_value, seqlens_k, total_sequence_length[, cos_cache, sin_cache][, , attention_bias])` | BNSH cache, per-batch lengths from `seqlens_k`, present `[B, Nkv, max(P, total), H]`; `do_rotary` (+ `rotary_interleaved`), `local_window_size`, `softcap`, `scale`, packed QKV when key/value are absent |
//! | `EmbedLayerNormalization(input_ids[, segment_ids], word, position[, segment], gamma[, beta][, mask][, position_ids])` | `LayerNorm(word[id] + position[pos] (+ segment[seg]))` → output; mask_index = ones per mask row; embedding_sum |
//!
//! Refused, naming the node: bias with packed MHA inputs, `past_sequence_length` / shared
//! buffers, 4-D masks, `do_rotary` in Attention,
//! `cache_indirection`, GQA `smooth_softmax`, `head_sink`, `position_ids`, QK outputs,
//! `mask_index_type` other than 1, non-float32 data.

use npuc_ir::{Attr, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo};
use std::collections::HashMap;

/// Rewrites the contrib ops of `m`'s main graph (see the module docs); returns how many.
pub fn decompose(m: &mut Model) -> Result<usize, String> {
    let contrib = |n: &Node| {
        (n.domain == "com.microsoft"
            && matches!(
                n.op_type.as_str(),
                "FastGelu"
                    | "BiasGelu"
                    | "Gelu"
                    | "QuickGelu"
                    | "SkipLayerNormalization"
                    | "SkipSimplifiedLayerNormalization"
                    | "SimplifiedLayerNormalization"
                    | "FusedMatMul"
                    | "MatMulNBits"
            ))
            || (n.domain.is_empty() && n.op_type == "SimplifiedLayerNormalization")
    };
    if !m.graph.nodes.iter().any(contrib) {
        return Ok(0);
    }
    let ranks = ranks(&m.graph);
    let consts: HashMap<String, Tensor> = m
        .graph
        .initializers
        .iter()
        .map(|i| (i.name.clone(), i.tensor.clone()))
        .collect();
    let mut out: Vec<Node> = Vec::with_capacity(m.graph.nodes.len());
    let mut inits: Vec<Initializer> = vec![];
    let mut count = 0;
    let nodes = std::mem::take(&mut m.graph.nodes);
    for n in nodes {
        if !contrib(&n) {
            out.push(n);
            continue;
        }
        count += 1;
        let mut rw = Rewrite {
            base: if n.name.is_empty() {
                format!(
                    "{}_contrib{count}",
                    n.outputs.first().cloned().unwrap_or_default()
                )
            } else {
                n.name.clone()
            },
            nodes: vec![],
            inits: &mut inits,
            k: 0,
        };
        rw.node(&n, &ranks, &consts)?;
        out.extend(rw.nodes);
    }
    m.graph.nodes = out;
    m.graph.initializers.extend(inits);
    if !m.opset_imports.iter().any(|o| o.domain == "npuc") {
        m.opset_imports.push(OpsetImport {
            domain: "npuc".into(),
            version: 1,
        });
    }
    Ok(count)
}

/// Ranks of the values whose types the graph declares.
fn ranks(g: &Graph) -> HashMap<String, usize> {
    let mut r = HashMap::new();
    for vi in g.inputs.iter().chain(&g.outputs).chain(&g.value_info) {
        if let Some(TypeInfo::Tensor { shape: Some(s), .. }) = &vi.ty {
            r.insert(vi.name.clone(), s.len());
        }
    }
    for i in &g.initializers {
        r.insert(i.name.clone(), i.tensor.rank());
    }
    r
}

struct Rewrite<'a> {
    base: String,
    nodes: Vec<Node>,
    inits: &'a mut Vec<Initializer>,
    k: usize,
}

impl Rewrite<'_> {
    fn fresh(&mut self, what: &str) -> String {
        self.k += 1;
        format!("{}/{what}_{}", self.base, self.k)
    }

    fn push(
        &mut self,
        op: &str,
        domain: &str,
        ins: &[&str],
        outs: &[&str],
        attrs: Vec<(&str, Attr)>,
    ) {
        let mut n = Node::new(op, ins, outs);
        n.name = format!("{}/{op}_{}", self.base, self.nodes.len());
        n.domain = domain.into();
        for (k, a) in attrs {
            n = n.with_attr(k, a);
        }
        self.nodes.push(n);
    }

    fn op(&mut self, op: &str, ins: &[&str], attrs: Vec<(&str, Attr)>) -> String {
        let out = self.fresh(&op.to_lowercase());
        self.push(op, "", ins, &[&out], attrs);
        out
    }

    fn scalar(&mut self, v: f32) -> String {
        let name = self.fresh("const");
        self.inits.push(Initializer {
            name: name.clone(),
            tensor: Tensor::scalar(v),
        });
        name
    }

    fn node(
        &mut self,
        n: &Node,
        ranks: &HashMap<String, usize>,
        consts: &HashMap<String, Tensor>,
    ) -> Result<(), String> {
        let err = |msg: String| format!("node '{}' ({}::{}): {msg}", n.name, n.domain, n.op_type);
        let input = |i: usize| n.inputs.get(i).filter(|s| !s.is_empty()).cloned();
        let output = |i: usize| n.outputs.get(i).filter(|s| !s.is_empty()).cloned();
        let req_in = |i: usize| input(i).ok_or_else(|| err(format!("input {i} is missing")));
        let y = output(0).ok_or_else(|| err("has no output".into()))?;
        let eps =
            |default: f32| -> f32 { n.attr_float("epsilon").ok().flatten().unwrap_or(default) };
        match n.op_type.as_str() {
            "FastGelu" | "BiasGelu" | "Gelu" => {
                let mut x = req_in(0)?;
                if let Some(b) = input(1) {
                    x = self.op("Add", &[&x, &b], vec![]);
                }
                let mut attrs = vec![];
                if n.op_type == "FastGelu" {
                    attrs.push(("approximate", Attr::String("tanh".into())));
                }
                self.push("Gelu", "npuc", &[&x], &[&y], attrs);
            }
            "QuickGelu" => {
                let x = req_in(0)?;
                let alpha = n.attr_float("alpha").ok().flatten().unwrap_or(1.702);
                let a = self.scalar(alpha);
                let ax = self.op("Mul", &[&x, &a], vec![]);
                let s = self.op("Sigmoid", &[&ax], vec![]);
                self.push("Mul", "", &[&x, &s], &[&y], vec![]);
            }
            "SkipLayerNormalization" | "SkipSimplifiedLayerNormalization" => {
                let simplified = n.op_type == "SkipSimplifiedLayerNormalization";
                let (x, skip, gamma) = (req_in(0)?, req_in(1)?, req_in(2)?);
                let (beta, bias) = if simplified {
                    (None, input(3))
                } else {
                    (input(3), input(4))
                };
                let mut s = self.op("Add", &[&x, &skip], vec![]);
                if let Some(b) = bias {
                    s = self.op("Add", &[&s, &b], vec![]);
                }
                let e = eps(1e-12);
                let attrs = vec![("axis", Attr::Int(-1)), ("epsilon", Attr::Float(e))];
                if simplified {
                    if output(1).is_some() || output(2).is_some() {
                        return Err(err(
                            "its mean / inv_std_var outputs are used: not supported".into(),
                        ));
                    }
                    self.push("RMSNormalization", "npuc", &[&s, &gamma], &[&y], attrs);
                } else {
                    let mut outs = vec![
                        y.clone(),
                        output(1).unwrap_or_default(),
                        output(2).unwrap_or_default(),
                    ];
                    while outs.last().is_some_and(|o| o.is_empty()) {
                        outs.pop();
                    }
                    let outs: Vec<&str> = outs.iter().map(String::as_str).collect();
                    let ins: Vec<&str> = match &beta {
                        Some(b) => vec![&s, &gamma, b],
                        None => vec![&s, &gamma],
                    };
                    self.push("LayerNormalization", "npuc", &ins, &outs, attrs);
                }
                if let Some(sum) = output(3) {
                    self.push("Identity", "", &[&s], &[&sum], vec![]);
                }
            }
            "SimplifiedLayerNormalization" => {
                if output(1).is_some() {
                    return Err(err("its inv_std_var output is used: not supported".into()));
                }
                let axis = n.attr_int("axis").ok().flatten().unwrap_or(-1);
                self.push(
                    "RMSNormalization",
                    "npuc",
                    &[&req_in(0)?, &req_in(1)?],
                    &[&y],
                    vec![
                        ("axis", Attr::Int(axis)),
                        ("epsilon", Attr::Float(eps(1e-5))),
                    ],
                );
            }
            "FusedMatMul" => {
                for a in ["transBatchA", "transBatchB"] {
                    if n.attr_int(a).ok().flatten().unwrap_or(0) != 0 {
                        return Err(err(format!("{a} = 1 is not supported")));
                    }
                }
                let mut ab = [req_in(0)?, req_in(1)?];
                for (v, attr) in ab.iter_mut().zip(["transA", "transB"]) {
                    if n.attr_int(attr).ok().flatten().unwrap_or(0) == 0 {
                        continue;
                    }
                    let r = *ranks.get(v.as_str()).ok_or_else(|| {
                        err(format!(
                            "{attr} = 1 needs the rank of '{v}', which the graph does not declare"
                        ))
                    })?;
                    if r < 2 {
                        return Err(err(format!("{attr} = 1 on '{v}' of rank {r}")));
                    }
                    let mut perm: Vec<i64> = (0..r as i64).collect();
                    perm.swap(r - 2, r - 1);
                    *v = self.op("Transpose", &[v], vec![("perm", Attr::Ints(perm))]);
                }
                let alpha = n.attr_float("alpha").ok().flatten().unwrap_or(1.0);
                if alpha == 1.0 {
                    self.push("MatMul", "", &[&ab[0], &ab[1]], &[&y], vec![]);
                } else {
                    let p = self.op("MatMul", &[&ab[0], &ab[1]], vec![]);
                    let a = self.scalar(alpha);
                    self.push("Mul", "", &[&p, &a], &[&y], vec![]);
                }
            }
            "MatMulNBits" => {
                let a = req_in(0)?;
                let c = |i: usize, what: &str| -> Result<Option<&Tensor>, String> {
                    match input(i) {
                        None => Ok(None),
                        Some(v) => consts.get(&v).map(Some).ok_or_else(|| {
                            err(format!("{what} '{v}' is not a constant (only constant weights are supported)"))
                        }),
                    }
                };
                let b = c(1, "B")?.ok_or_else(|| err("input B is missing".into()))?;
                let scales =
                    c(2, "scales")?.ok_or_else(|| err("input scales is missing".into()))?;
                let zp = c(3, "zero_points")?;
                if input(4).is_some() {
                    return Err(err("g_idx (act-order) is not supported".into()));
                }
                let attr = |k: &str| n.attr_int(k).ok().flatten();
                let (kk, nn) = match (attr("K"), attr("N")) {
                    (Some(k), Some(nn)) if k > 0 && nn > 0 => (k as usize, nn as usize),
                    _ => return Err(err("attributes K and N must be positive".into())),
                };
                let bits = attr("bits").unwrap_or(4) as usize;
                let bs = attr("block_size").unwrap_or(0) as usize;
                let w = dequantize_nbits(b, scales, zp, kk, nn, bits, bs).map_err(err)?;
                let name = self.fresh("weight");
                self.inits.push(Initializer {
                    name: name.clone(),
                    tensor: Tensor::from_vec(vec![kk, nn], w).map_err(|e| err(e.to_string()))?,
                });
                match input(5) {
                    None => self.push("MatMul", "", &[&a, &name], &[&y], vec![]),
                    Some(bias) => {
                        let p = self.op("MatMul", &[&a, &name], vec![]);
                        self.push("Add", "", &[&p, &bias], &[&y], vec![]);
                    }
                }
            }
            other => return Err(err(format!("internal: no rewrite for {other}"))),
        }
        Ok(())
    }
}

/// `MatMulNBits`' weight as f32 `[K, N]` (the `B` operand of `MatMul`): element `k` of column
/// `n` is `(q - zero_point) · scale` of its block; `q` packed `bits` at a time, low bits first,
/// in `B [N, blocks, block_size · bits / 8]`; zero points packed the same way per column
/// (uint8), or given as floats, default `2^(bits-1)`.
fn dequantize_nbits(
    b: &Tensor,
    scales: &Tensor,
    zp: Option<&Tensor>,
    k: usize,
    n: usize,
    bits: usize,
    bs: usize,
) -> Result<Vec<f32>, String> {
    if !matches!(bits, 2 | 4 | 8) {
        return Err(format!("bits = {bits} is not supported (2, 4, 8)"));
    }
    if bs < 16 || !bs.is_power_of_two() {
        return Err(format!("block_size = {bs} must be a power of two >= 16"));
    }
    let blocks = k.div_ceil(bs);
    let blob = bs * bits / 8;
    let q = b.to_le_bytes().map_err(|e| e.to_string())?;
    if b.dtype() != npuc_ir::DType::U8 || q.len() != n * blocks * blob {
        return Err(format!(
            "B is {} {:?}, expected uint8 [{n}, {blocks}, {blob}]",
            b.dtype().name(),
            b.shape()
        ));
    }
    let sc: Vec<f64> = scales.to_f64_vec().map_err(|e| e.to_string())?;
    if sc.len() != n * blocks {
        return Err(format!(
            "scales has {} values, expected N x blocks = {}",
            sc.len(),
            n * blocks
        ));
    }
    let mask = (1u32 << bits) - 1;
    let field = |bytes: &[u8], i: usize| -> u32 {
        let bit = i * bits;
        (u32::from(bytes[bit / 8]) >> (bit % 8)) & mask
    };
    let zps: Vec<f64> = match zp {
        None => vec![f64::from(1u32 << (bits - 1)); n * blocks],
        Some(z) if z.dtype() == npuc_ir::DType::U8 => {
            let zb = z.to_le_bytes().map_err(|e| e.to_string())?;
            let per_col = (blocks * bits).div_ceil(8);
            if zb.len() != n * per_col {
                return Err(format!(
                    "zero_points has {} bytes, expected {}",
                    zb.len(),
                    n * per_col
                ));
            }
            (0..n * blocks)
                .map(|i| f64::from(field(&zb[(i / blocks) * per_col..][..per_col], i % blocks)))
                .collect()
        }
        Some(z) => {
            let v = z.to_f64_vec().map_err(|e| e.to_string())?;
            if v.len() != n * blocks {
                return Err(format!(
                    "zero_points has {} values, expected {}",
                    v.len(),
                    n * blocks
                ));
            }
            v
        }
    };
    let mut w = vec![0f32; k * n];
    for col in 0..n {
        for blk in 0..blocks {
            let bytes = &q[(col * blocks + blk) * blob..][..blob];
            let (s, z) = (
                sc[col * blocks + blk] as f32,
                zps[col * blocks + blk] as f32,
            );
            for i in 0..bs {
                let kk = blk * bs + i;
                if kk >= k {
                    break;
                }
                w[kk * n + col] = (field(bytes, i) as f32 - z) * s;
            }
        }
    }
    Ok(w)
}
