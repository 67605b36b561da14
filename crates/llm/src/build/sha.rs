//! MHA → SHA: rewrites each layer's multi-head attention into single-head attention, the form
//! NPU compilers (QNN HTP) run well: one Q projection per head, one K and one V projection
//! per KV head (grouped-query attention keeps its sharing: head `j` reads KV head
//! `j / (H / KVH)`), one KV cache tensor per KV head as an explicit graph input/output
//! (`past_key.{l}.h{g}` `[1, C, D]` / `new_key.{l}.h{g}` `[1, N, D]`, same for values), one
//! attention per head, then the heads' outputs concatenated into the output projection.
//!
//! The transform works on the graphs of the decoder builder (`npuc-llm::build`, GGUF
//! llama/qwen2/gemma3, weights as `npuc.GgmlMatMul` blocks or plain `Gemm`): per layer,
//! `npuc.CachedAttention(q, k, v, past_key.{l}, past_value.{l})` with
//! `q = Rope(RMSNorm?(Reshape(Linear(x))))`, `k` likewise, `v = Reshape(Linear(x))`, and
//! `new_key.{l} = Cast|Identity(Transpose(k))`. Anything else is refused naming the layer and
//! the node. Per-head weights are row slices of the projection matrices (a GGML row is
//! quantized on its own, so a slice is the same blocks, borrowed from the same bytes when the
//! weights are mapped); biases likewise. Each output element of a sliced product is the same
//! dot product as in the full one, so SHA graphs compute what MHA graphs do; only the order
//! in which kernels sum may differ.

use crate::{bail, LlmError, Result};
use npuc_ir::{
    Attr, Dim, Graph, Initializer, Model, Node, Tensor, TensorData, TypeInfo, ValueInfo,
};
use std::collections::{HashMap, HashSet};

/// One projection chain of an attention input: `Linear → Reshape [→ RMSNorm] [→ Rope]`.
struct Proj {
    linear: usize,
    reshape: usize,
    norm: Option<usize>,
    rope: Option<usize>,
}

impl Proj {
    fn nodes(&self) -> Vec<usize> {
        let mut v = vec![self.linear, self.reshape];
        v.extend(self.norm);
        v.extend(self.rope);
        v
    }
}

/// One attention to rewrite.
struct Site {
    layer: usize,
    attn: usize,
    q: Proj,
    k: Proj,
    v: Proj,
    /// `Transpose` and `Cast|Identity` nodes writing `new_key.{l}` / `new_value.{l}`.
    k_out: (usize, usize),
    v_out: (usize, usize),
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    tokens: usize,
}

/// Whether `m` already has single-head attention (its facts say so).
pub fn is_sha(m: &Model) -> bool {
    facts(m).is_some_and(|j| j.get("sha").and_then(|v| v.as_bool()) == Some(true))
}

fn facts(m: &Model) -> Option<serde_json::Value> {
    m.metadata(crate::engine::META_KEY)
        .and_then(|j| serde_json::from_str(j).ok())
}

/// The SHA form of `m` (see the module docs). Fails, naming the layer and node, on a graph
/// without recognisable attention.
pub fn to_sha(m: &Model) -> Result<Model> {
    let g = &m.graph;
    let name = &g.name;
    let mut producer: HashMap<&str, usize> = HashMap::new();
    let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for o in &n.outputs {
            producer.insert(o.as_str(), i);
        }
        for x in n.inputs.iter().filter(|x| !x.is_empty()) {
            consumers.entry(x.as_str()).or_default().push(i);
        }
    }
    let inits: HashMap<&str, &Tensor> = g
        .initializers
        .iter()
        .map(|i| (i.name.as_str(), &i.tensor))
        .collect();
    let mut sites = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        if n.op_type == "CachedAttention" && n.domain == "npuc" {
            sites.push(site(g, &producer, &consumers, &inits, i)?);
        }
    }
    if sites.is_empty() {
        bail!("graph '{name}': no npuc.CachedAttention node (no recognisable attention to rewrite into single-head form)");
    }
    // Every node a rewrite replaces must feed only nodes it replaces too.
    let mut removed: HashSet<usize> = HashSet::new();
    for s in &sites {
        removed.insert(s.attn);
        for p in [&s.q, &s.k, &s.v] {
            removed.extend(p.nodes());
        }
        removed.extend([s.k_out.0, s.k_out.1, s.v_out.0, s.v_out.1]);
    }
    // (The attention's own output lives on: the heads' Concat takes its name.)
    let attns: HashSet<usize> = sites.iter().map(|s| s.attn).collect();
    for &r in removed.iter().filter(|r| !attns.contains(r)) {
        let n = &g.nodes[r];
        for o in &n.outputs {
            for &c in consumers
                .get(o.as_str())
                .map(|v| v.as_slice())
                .unwrap_or(&[])
            {
                if !removed.contains(&c) {
                    bail!(
                        "graph '{name}': '{o}' (node '{}') is also read by node '{}' ({}), outside the attention; not rewritten",
                        n.name,
                        g.nodes[c].name,
                        g.nodes[c].op_type
                    );
                }
            }
        }
    }
    let mut out = m.clone();
    let mut new_inits: Vec<Initializer> = vec![];
    let mut replacement: HashMap<usize, Vec<Node>> = HashMap::new();
    for s in &sites {
        replacement.insert(s.attn, rewrite(g, &inits, s, &mut new_inits)?);
    }
    let mut nodes = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        if let Some(r) = replacement.remove(&i) {
            nodes.extend(r);
        } else if !removed.contains(&i) {
            nodes.push(n.clone());
        }
    }
    out.graph.nodes = nodes;
    // Graph inputs/outputs: each layer's cache tensors become one per KV head.
    let per_head = |vis: &[ValueInfo], prefix: &str| -> Result<Vec<ValueInfo>> {
        let mut v = vec![];
        for vi in vis {
            let site = sites.iter().find(|s| {
                vi.name == format!("{prefix}key.{}", s.layer)
                    || vi.name == format!("{prefix}value.{}", s.layer)
            });
            let Some(s) = site else {
                v.push(vi.clone());
                continue;
            };
            let (dtype, dims) = match &vi.ty {
                Some(TypeInfo::Tensor {
                    dtype,
                    shape: Some(d),
                }) if d.len() == 3 && d[0] == Dim::Fixed(s.kv_heads) => (*dtype, d.clone()),
                _ => bail!(
                    "graph '{name}': '{}' is not a [{}, slots, {}] tensor",
                    vi.name,
                    s.kv_heads,
                    s.head_dim
                ),
            };
            for h in 0..s.kv_heads {
                let mut d = dims.clone();
                d[0] = Dim::Fixed(1);
                v.push(ValueInfo {
                    name: format!("{}.h{h}", vi.name),
                    ty: Some(TypeInfo::Tensor {
                        dtype,
                        shape: Some(d),
                    }),
                    doc: vi.doc.clone(),
                });
            }
        }
        Ok(v)
    };
    out.graph.inputs = per_head(&g.inputs, "past_")?;
    out.graph.outputs = per_head(&g.outputs, "new_")?;
    // The sliced weights replace the whole ones (stored once: same names in every variant).
    let used: HashSet<&str> = out
        .graph
        .nodes
        .iter()
        .flat_map(|n| n.inputs.iter().map(|s| s.as_str()))
        .collect();
    let keep: Vec<Initializer> = out
        .graph
        .initializers
        .iter()
        .filter(|i| used.contains(i.name.as_str()))
        .cloned()
        .collect();
    let mut all = keep;
    for i in new_inits {
        if !all.iter().any(|a| a.name == i.name) {
            all.push(i);
        }
    }
    out.graph.initializers = all;
    out.graph.name = format!("{name}-sha");
    let s0 = &sites[0];
    for (k, v) in out.metadata.iter_mut() {
        if k == crate::engine::META_KEY {
            let mut j: serde_json::Value = serde_json::from_str(v)
                .map_err(|e| LlmError::msg(format!("graph '{name}': bad {k} metadata: {e}")))?;
            j["sha"] = serde_json::json!(true);
            j["n_heads"] = serde_json::json!(s0.heads);
            *v = j.to_string();
        }
    }
    Ok(out)
}

fn site(
    g: &Graph,
    producer: &HashMap<&str, usize>,
    consumers: &HashMap<&str, Vec<usize>>,
    inits: &HashMap<&str, &Tensor>,
    attn: usize,
) -> Result<Site> {
    let a = &g.nodes[attn];
    let err = |what: String| -> LlmError {
        LlmError::msg(format!(
            "graph '{}': attention node '{}': {what} (not a recognised multi-head attention pattern; SHA needs Rope(RMSNorm?(Reshape(Linear))) for q and k, Reshape(Linear) for v)",
            g.name, a.name
        ))
    };
    if a.inputs.len() < 7 {
        return Err(err(format!("has {} inputs, expected 7", a.inputs.len())));
    }
    let layer = a.inputs[3]
        .strip_prefix("past_key.")
        .and_then(|l| l.parse::<usize>().ok())
        .ok_or_else(|| err(format!("past_k is '{}', not past_key.<layer>", a.inputs[3])))?;
    if a.inputs[4] != format!("past_value.{layer}") {
        return Err(err(format!(
            "layer {layer}: past_v is '{}', expected past_value.{layer}",
            a.inputs[4]
        )));
    }
    let node_of = |v: &str, op: &str| -> Result<usize> {
        match producer.get(v) {
            Some(&i) if g.nodes[i].op_type == op => Ok(i),
            Some(&i) => Err(err(format!(
                "layer {layer}: '{v}' comes from {} node '{}', expected {op}",
                g.nodes[i].op_type, g.nodes[i].name
            ))),
            None => Err(err(format!(
                "layer {layer}: '{v}' is not computed by a node, expected {op}"
            ))),
        }
    };
    let trace = |v: &str, rope: bool| -> Result<Proj> {
        let mut v = v.to_string();
        let rope = if rope {
            let r = node_of(&v, "Rope")?;
            v = g.nodes[r].inputs[0].clone();
            Some(r)
        } else {
            None
        };
        let norm = match producer.get(v.as_str()) {
            Some(&i) if g.nodes[i].op_type == "RMSNormalization" => {
                v = g.nodes[i].inputs[0].clone();
                Some(i)
            }
            _ => None,
        };
        let reshape = node_of(&v, "Reshape")?;
        let lin_out = g.nodes[reshape].inputs[0].clone();
        let linear = match producer.get(lin_out.as_str()) {
            Some(&i) if matches!(g.nodes[i].op_type.as_str(), "GgmlMatMul" | "Gemm") => i,
            _ => {
                return Err(err(format!(
                    "layer {layer}: '{lin_out}' is not a GgmlMatMul or Gemm(transB=1) projection"
                )))
            }
        };
        if g.nodes[linear].op_type == "Gemm"
            && g.nodes[linear].attr("transB") != Some(&Attr::Int(1))
        {
            return Err(err(format!(
                "layer {layer}: Gemm '{}' without transB=1",
                g.nodes[linear].name
            )));
        }
        Ok(Proj {
            linear,
            reshape,
            norm,
            rope,
        })
    };
    let q = trace(&a.inputs[0], true)?;
    let k = trace(&a.inputs[1], true)?;
    let v = trace(&a.inputs[2], false)?;
    // [N, heads, D] from the reshape targets.
    let shape_of = |p: &Proj| -> Result<Vec<i64>> {
        let s = &g.nodes[p.reshape].inputs[1];
        match inits.get(s.as_str()).map(|t| t.to_i64_vec()) {
            Some(Ok(v)) if v.len() == 3 && v.iter().all(|&x| x > 0) => Ok(v),
            _ => Err(err(format!(
                "layer {layer}: reshape '{}' has no constant [N, heads, D] shape",
                g.nodes[p.reshape].name
            ))),
        }
    };
    let (sq, sk, sv) = (shape_of(&q)?, shape_of(&k)?, shape_of(&v)?);
    if sk != sv || sq[0] != sk[0] || sq[2] != sk[2] || sk[1] == 0 || sq[1] % sk[1] != 0 {
        return Err(err(format!(
            "layer {layer}: q {sq:?}, k {sk:?}, v {sv:?} are not [N, H, D] / [N, KVH, D] with H a multiple of KVH"
        )));
    }
    let kv_out = |val: &str, kind: &str| -> Result<(usize, usize)> {
        let want = format!("new_{kind}.{layer}");
        for &t in consumers.get(val).map(|v| v.as_slice()).unwrap_or(&[]) {
            let tn = &g.nodes[t];
            if tn.op_type != "Transpose" || tn.attr("perm") != Some(&Attr::Ints(vec![1, 0, 2])) {
                continue;
            }
            for &c in consumers
                .get(tn.outputs[0].as_str())
                .map(|v| v.as_slice())
                .unwrap_or(&[])
            {
                let cn = &g.nodes[c];
                if matches!(cn.op_type.as_str(), "Cast" | "Identity") && cn.outputs[0] == want {
                    return Ok((t, c));
                }
            }
        }
        Err(err(format!(
            "layer {layer}: no Transpose(perm [1, 0, 2]) → Cast|Identity writing '{want}'"
        )))
    };
    let k_out = kv_out(&a.inputs[1], "key")?;
    let v_out = kv_out(&a.inputs[2], "value")?;
    Ok(Site {
        layer,
        attn,
        q,
        k,
        v,
        k_out,
        v_out,
        heads: sq[1] as usize,
        kv_heads: sk[1] as usize,
        head_dim: sq[2] as usize,
        tokens: sq[0] as usize,
    })
}

/// Rows `start..start + count` of `t` (first axis): borrowed from the same bytes when `t` is,
/// copied otherwise.
pub fn slice_rows(t: &Tensor, start: usize, count: usize) -> Result<Tensor> {
    let shape = t.shape();
    let rows = shape.first().copied().unwrap_or(0);
    if start + count > rows {
        bail!("rows {start}..{} of a tensor of {rows} rows", start + count);
    }
    let row_bytes = shape[1..].iter().product::<usize>() * t.dtype().size();
    let mut s = shape.to_vec();
    s[0] = count;
    Ok(match t.data() {
        TensorData::Borrowed(b) => Tensor::from_le_bytes(
            t.dtype(),
            s,
            b.owner.clone(),
            b.offset + start * row_bytes,
            count * row_bytes,
        )?,
        _ => {
            let bytes = t.to_le_bytes()?;
            Tensor::from_le_bytes_copy(
                t.dtype(),
                s,
                &bytes[start * row_bytes..(start + count) * row_bytes],
            )?
        }
    })
}

/// A clone of `n` with its output (and name) suffixed `.h{j}` and inputs replaced.
fn per_head(n: &Node, j: usize, inputs: &[(usize, String)]) -> Node {
    let mut c = n.clone();
    c.name = format!("{}.h{j}", n.name);
    c.outputs = vec![format!("{}.h{j}", n.outputs[0])];
    for (i, v) in inputs {
        c.inputs[*i] = v.clone();
    }
    c
}

/// The nodes that replace one attention site.
fn rewrite(
    g: &Graph,
    inits: &HashMap<&str, &Tensor>,
    s: &Site,
    new_inits: &mut Vec<Initializer>,
) -> Result<Vec<Node>> {
    let (d, n) = (s.head_dim, s.tokens);
    let shape = format!("sha_shape_{n}_1_{d}");
    if !new_inits.iter().any(|i| i.name == shape) {
        new_inits.push(Initializer {
            name: shape.clone(),
            tensor: Tensor::from_vec(vec![3], vec![n as i64, 1, d as i64])?,
        });
    }
    let mut nodes = vec![];
    // One head of a projection chain; returns the head's [N, 1, D] value.
    let mut head = |p: &Proj, j: usize, nodes: &mut Vec<Node>| -> Result<String> {
        let lin = &g.nodes[p.linear];
        // Input `at` of the projection (weight or bias), rows of head `j`, as `{name}.h{j}`.
        let mut slice = |at: usize, what: &str| -> Result<Option<(usize, String)>> {
            let Some(name) = lin.inputs.get(at).filter(|b| !b.is_empty()) else {
                return Ok(None);
            };
            let t = inits.get(name.as_str()).ok_or_else(|| {
                LlmError::msg(format!(
                    "graph '{}': layer {}: projection {what} '{name}' is not a constant",
                    g.name, s.layer
                ))
            })?;
            let sliced = format!("{name}.h{j}");
            if !new_inits.iter().any(|i| i.name == sliced) {
                // A weight in the interleaved layout is stored by groups of 8 rows: a head's rows
                // are whole groups when the head dimension is a multiple of 8.
                let x8 = at == 1 && lin.attr_str("layout").ok().flatten() == Some("x8");
                let g8 = npuc_ggml::X8_ROWS;
                if x8 && !d.is_multiple_of(g8) {
                    bail!(
                        "graph '{}': layer {}: head dimension {d} is not a multiple of {g8}: the interleaved weights of '{name}' cannot be split per head (use --precision exact or parity for SHA)",
                        g.name,
                        s.layer
                    );
                }
                let (start, count) = if x8 { (j * d / g8, d / g8) } else { (j * d, d) };
                let tensor = slice_rows(t, start, count).map_err(|e| {
                    LlmError::msg(format!("graph '{}': {what} '{name}': {e}", g.name))
                })?;
                new_inits.push(Initializer {
                    name: sliced.clone(),
                    tensor,
                });
            }
            Ok(Some((at, sliced)))
        };
        let ins: Vec<(usize, String)> = [slice(1, "weight")?, slice(2, "bias")?]
            .into_iter()
            .flatten()
            .collect();
        if !ins.iter().any(|(at, _)| *at == 1) {
            bail!(
                "graph '{}': layer {}: projection '{}' has no weight",
                g.name,
                s.layer,
                lin.name
            );
        }
        let l = per_head(lin, j, &ins);
        let mut v = l.outputs[0].clone();
        nodes.push(l);
        let r = per_head(
            &g.nodes[p.reshape],
            j,
            &[(0, v.clone()), (1, shape.clone())],
        );
        v = r.outputs[0].clone();
        nodes.push(r);
        for x in [p.norm, p.rope].into_iter().flatten() {
            let c = per_head(&g.nodes[x], j, &[(0, v.clone())]);
            v = c.outputs[0].clone();
            nodes.push(c);
        }
        Ok(v)
    };
    let group = s.heads / s.kv_heads;
    let mut ks = vec![];
    let mut vs = vec![];
    for h in 0..s.kv_heads {
        ks.push(head(&s.k, h, &mut nodes)?);
        vs.push(head(&s.v, h, &mut nodes)?);
        for ((t, c), val) in [(s.k_out, &ks[h]), (s.v_out, &vs[h])] {
            let tn = per_head(&g.nodes[t], h, &[(0, val.clone())]);
            // `new_key.{l}` becomes `new_key.{l}.h{h}`.
            let cn = per_head(&g.nodes[c], h, &[(0, tn.outputs[0].clone())]);
            nodes.push(tn);
            nodes.push(cn);
        }
    }
    let a = &g.nodes[s.attn];
    let mut outs = vec![];
    for j in 0..s.heads {
        let q = head(&s.q, j, &mut nodes)?;
        let kvh = j / group;
        let an = per_head(
            a,
            j,
            &[
                (0, q),
                (1, ks[kvh].clone()),
                (2, vs[kvh].clone()),
                (3, format!("past_key.{}.h{kvh}", s.layer)),
                (4, format!("past_value.{}.h{kvh}", s.layer)),
            ],
        );
        outs.push(an.outputs[0].clone());
        nodes.push(an);
    }
    let mut cat = Node::new(
        "Concat",
        &outs.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        &[a.outputs[0].as_str()],
    )
    .with_attr("axis", Attr::Int(1));
    cat.name = a.name.clone();
    nodes.push(cat);
    Ok(nodes)
}
