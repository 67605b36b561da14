//! ONNX LLM decoder → the builders' GGUF form: finds the decoder's structure in the graph itself
//! (no op names or node names are trusted) and writes its weights under GGUF tensor names with
//! the architecture's GGUF metadata, so every later step (`npuc build`'s variants, split, SHA,
//! compile) treats an ONNX source as it treats a GGUF one.
//!
//! What is recognised (the layout `npuc export`, transformers and Optimum write: see
//! [`super::export`]): graph inputs `past_key_values.{l}.key|value` `[batch, kv_heads, past,
//! head_dim]` (the layers and KV geometry); the token embedding (a `Gather` of `input_ids` from a
//! constant `[vocab, hidden]`, optionally scaled); per layer, from each KV input's `Concat`
//! back to the key/value projection (a `MatMul` with a constant `[hidden, n]`, `Cast` of an f16
//! constant allowed), with bias, per-head RMSNorm and rotary embedding (`rotate_half` form; its
//! inverse frequencies give the rope base) on the way; the query projection as the third
//! product of the same normalized input; RMSNorms as `Pow/ReduceMean/Add(eps)/Sqrt/Reciprocal
//! or Div/Mul(w)` or a single `RMSNormalization`/`SimplifiedLayerNormalization` node; the
//! attention scale, the mask's sliding window (`Sub(position, window)`), the output projection,
//! optional norms after attention and after the FFN, the gated FFN (SiLU as `x·Sigmoid(x)`,
//! GELU-tanh as `Tanh` or `Gelu(approximate=tanh)`/`FastGelu`), the final norm and the output
//! head (its own constant, or the transposed embedding: tied). The architecture follows from what
//! was found (q/k/v biases: qwen2; q/k norms, post norms, GELU, scaled embedding: gemma3; else
//! llama, whose q/k rows are permuted back into llama.cpp's adjacent-pair order). Anything else
//! is refused naming the layer and the node where the walk stopped.

use super::export::{past_name, CONFIG_KEY, TOKENIZER_KEY};
use crate::build::gemma3::{ROPE_BASE_LOCAL, SWA_PATTERN};
use crate::{bail, LlmError, Result};
use npuc_gguf::{GgufMetaJson, MetaValue};
use npuc_ir::{DType, Dim, GgmlType, Graph, Model, Node, Tensor, TypeInfo};
use std::collections::{HashMap, HashSet, VecDeque};

/// A model taken out of an ONNX decoder: GGUF metadata and tensors (GGUF names and row order).
pub struct Lifted {
    pub arch: String,
    pub metadata: Vec<(String, MetaValue)>,
    /// `(name, type, GGML dims (innermost first), little-endian bytes)`.
    pub tensors: Vec<(String, GgmlType, Vec<u64>, Vec<u8>)>,
    /// One line per finding (what was recognised where), for the build's report.
    pub findings: Vec<String>,
}

impl Lifted {
    /// The GGUF file bytes.
    pub fn to_gguf_bytes(&self) -> Result<Vec<u8>> {
        let ts: Vec<npuc_gguf::write::WriteTensor> = self
            .tensors
            .iter()
            .map(|(name, ty, dims, data)| npuc_gguf::write::WriteTensor {
                name: name.clone(),
                ggml_type: *ty,
                dims: dims.clone(),
                data,
            })
            .collect();
        Ok(npuc_gguf::write::to_bytes(&self.metadata, &ts)?)
    }
}

/// A constant operand: an initializer, a `Constant` node, or either through `Cast`
/// (f16-stored weights widened at run time).
#[derive(Clone)]
struct Const<'a> {
    name: String,
    tensor: std::borrow::Cow<'a, Tensor>,
}

struct Idx<'a> {
    g: &'a Graph,
    producer: HashMap<&'a str, usize>,
    consumers: HashMap<&'a str, Vec<usize>>,
    inits: HashMap<&'a str, &'a Tensor>,
    file: &'a str,
}

impl<'a> Idx<'a> {
    fn new(g: &'a Graph, file: &'a str) -> Idx<'a> {
        let mut producer = HashMap::new();
        let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, n) in g.nodes.iter().enumerate() {
            for o in &n.outputs {
                producer.insert(o.as_str(), i);
            }
            for x in n.inputs.iter().filter(|x| !x.is_empty()) {
                consumers.entry(x.as_str()).or_default().push(i);
            }
        }
        let inits = g
            .initializers
            .iter()
            .map(|i| (i.name.as_str(), &i.tensor))
            .collect();
        Idx {
            g,
            producer,
            consumers,
            inits,
            file,
        }
    }

    fn prod(&self, v: &str) -> Option<(usize, &'a Node)> {
        self.producer.get(v).map(|&i| (i, &self.g.nodes[i]))
    }

    fn cons(&self, v: &str) -> Vec<(usize, &'a Node)> {
        self.consumers
            .get(v)
            .map(|c| c.iter().map(|&i| (i, &self.g.nodes[i])).collect())
            .unwrap_or_default()
    }

    fn constant(&self, v: &str) -> Option<Const<'a>> {
        if let Some(t) = self.inits.get(v) {
            return Some(Const {
                name: v.to_string(),
                tensor: std::borrow::Cow::Borrowed(*t),
            });
        }
        let (_, n) = self.prod(v)?;
        match n.op_type.as_str() {
            "Constant" => n.attr_tensor("value").ok().flatten().map(|t| Const {
                name: v.to_string(),
                tensor: std::borrow::Cow::Owned(t.clone()),
            }),
            "Cast" | "Identity" => self.constant(&n.inputs[0]),
            _ => None,
        }
    }

    fn scalar(&self, v: &str) -> Option<f64> {
        let c = self.constant(v)?;
        (c.tensor.len() == 1)
            .then(|| c.tensor.to_f64_vec().ok()?.first().copied())
            .flatten()
    }

    /// The constant `B` of a `MatMul` (`[k, n]`), or the transpose of a constant `[n, k]`
    /// (`transposed`).
    fn mm_weight(&self, n: &Node) -> Option<(Const<'a>, bool)> {
        if n.op_type != "MatMul" || n.inputs.len() != 2 {
            return None;
        }
        if let Some(c) = self.constant(&n.inputs[1]) {
            return (c.tensor.rank() == 2).then_some((c, false));
        }
        let (_, t) = self.prod(&n.inputs[1])?;
        if t.op_type == "Transpose"
            && t.attr_ints("perm")
                .ok()
                .flatten()
                .is_some_and(|p| p == [1, 0])
        {
            let c = self.constant(&t.inputs[0])?;
            return (c.tensor.rank() == 2).then_some((c, true));
        }
        None
    }

    /// Nodes reachable backwards from `v` (through non-constant inputs), not expanding past
    /// nodes for which `stop` holds (they are returned in the second list) or `limit` nodes.
    fn back(
        &self,
        v: &str,
        limit: usize,
        stop: &dyn Fn(&Node) -> bool,
    ) -> (Vec<usize>, Vec<usize>) {
        self.walk(v, limit, stop, false)
    }

    /// Nodes reachable forwards from `v`, not expanding past `stop` nodes (returned second).
    fn fwd(&self, v: &str, limit: usize, stop: &dyn Fn(&Node) -> bool) -> (Vec<usize>, Vec<usize>) {
        self.walk(v, limit, stop, true)
    }

    /// Breadth-first over values from `v`: a value's producer (backwards) or consumers
    /// (forwards), then a node's non-constant inputs or its outputs.
    fn walk(
        &self,
        v: &str,
        limit: usize,
        stop: &dyn Fn(&Node) -> bool,
        forward: bool,
    ) -> (Vec<usize>, Vec<usize>) {
        let mut seen = HashSet::new();
        let (mut inner, mut stops) = (vec![], vec![]);
        let mut q: VecDeque<String> = VecDeque::from([v.to_string()]);
        while let Some(x) = q.pop_front() {
            let next = if forward {
                self.cons(&x)
            } else {
                self.prod(&x).into_iter().collect()
            };
            for (i, n) in next {
                if !seen.insert(i) || seen.len() > limit {
                    continue;
                }
                if stop(n) {
                    stops.push(i);
                    continue;
                }
                inner.push(i);
                if forward {
                    q.extend(n.outputs.iter().cloned());
                } else {
                    q.extend(
                        n.inputs
                            .iter()
                            .filter(|x| !x.is_empty() && self.constant(x).is_none())
                            .cloned(),
                    );
                }
            }
        }
        (inner, stops)
    }

    fn err(
        &self,
        layer: Option<usize>,
        node: Option<&Node>,
        msg: impl std::fmt::Display,
    ) -> LlmError {
        let at = match (layer, node) {
            (Some(l), Some(n)) => format!(" (layer {l}, node '{}' {})", n.name, n.op_type),
            (Some(l), None) => format!(" (layer {l})"),
            (None, Some(n)) => format!(" (node '{}' {})", n.name, n.op_type),
            (None, None) => String::new(),
        };
        LlmError::Msg(format!("{}: {msg}{at}", self.file))
    }

    /// An RMSNorm whose output is `v`: its scale constant, epsilon and input.
    fn rms_at(&self, v: &str) -> Option<Rms<'a>> {
        let (_, n) = self.prod(v)?;
        if matches!(
            n.op_type.as_str(),
            "RMSNormalization" | "SimplifiedLayerNormalization"
        ) {
            let w = self.constant(n.inputs.get(1)?)?;
            let eps = n.attr_float("epsilon").ok().flatten().unwrap_or(1e-5) as f64;
            return Some(Rms {
                weight: w,
                eps,
                input: n.inputs[0].clone(),
            });
        }
        if n.op_type != "Mul" || n.inputs.len() != 2 {
            return None;
        }
        let (w, a) = match (self.constant(&n.inputs[0]), self.constant(&n.inputs[1])) {
            (None, Some(w)) => (w, &n.inputs[0]),
            (Some(w), None) => (w, &n.inputs[1]),
            _ => return None,
        };
        if w.tensor.shape().iter().rev().skip(1).any(|&d| d != 1) {
            return None;
        }
        let (_, na) = self.prod(a)?;
        if !matches!(na.op_type.as_str(), "Mul" | "Div") || na.inputs.len() != 2 {
            return None;
        }
        for (xi, ri) in [(0, 1), (1, 0)] {
            if na.op_type == "Div" && xi == 1 {
                continue;
            }
            let (x, r) = (&na.inputs[xi], &na.inputs[ri]);
            let (inner, _) = self.back(r, 12, &|m| m.outputs.iter().any(|o| o == x));
            let squares = |m: &Node| {
                (m.op_type == "Pow" && &m.inputs[0] == x)
                    || (m.op_type == "Mul" && &m.inputs[0] == x && &m.inputs[1] == x)
            };
            let mean = inner.iter().any(|&i| {
                let m = &self.g.nodes[i];
                m.op_type == "ReduceMean"
                    && self.prod(&m.inputs[0]).is_some_and(|(_, s)| squares(s))
            });
            if !mean {
                continue;
            }
            let eps = inner.iter().find_map(|&i| {
                let m = &self.g.nodes[i];
                (m.op_type == "Add")
                    .then(|| m.inputs.iter().find_map(|x| self.scalar(x)))
                    .flatten()
            })?;
            return Some(Rms {
                weight: w,
                eps,
                input: x.clone(),
            });
        }
        None
    }
}

struct Rms<'a> {
    weight: Const<'a>,
    eps: f64,
    input: String,
}

/// One projection: its weight and optional bias.
struct Proj<'a> {
    node: usize,
    w: Const<'a>,
    transposed: bool,
    bias: Option<Const<'a>>,
}

impl<'a> Proj<'a> {
    /// `n_out` of the product.
    fn n_out(&self) -> usize {
        let s = self.w.tensor.shape();
        if self.transposed {
            s[0]
        } else {
            s[1]
        }
    }
    fn k(&self) -> usize {
        let s = self.w.tensor.shape();
        if self.transposed {
            s[1]
        } else {
            s[0]
        }
    }
}

fn proj_of<'a>(ix: &Idx<'a>, node: usize) -> Option<Proj<'a>> {
    let n = &ix.g.nodes[node];
    let (w, transposed) = ix.mm_weight(n)?;
    // A bias: an `Add` of a 1-D constant right after the product.
    let bias = ix.cons(&n.outputs[0]).into_iter().find_map(|(_, a)| {
        (a.op_type == "Add")
            .then(|| a.inputs.iter().find_map(|x| ix.constant(x)))
            .flatten()
            .filter(|c| c.tensor.rank() == 1)
    });
    Some(Proj {
        node,
        w,
        transposed,
        bias,
    })
}

/// What one layer was found to hold.
struct Layer<'a> {
    attn_norm: Rms<'a>,
    q: Proj<'a>,
    k: Proj<'a>,
    v: Proj<'a>,
    q_norm: Option<Const<'a>>,
    k_norm: Option<Const<'a>>,
    inv_freq: Vec<f32>,
    scale: f64,
    window: usize,
    o: Proj<'a>,
    post_attn: Option<Rms<'a>>,
    ffn_norm: Rms<'a>,
    gate: Proj<'a>,
    up: Proj<'a>,
    down: Proj<'a>,
    post_ffn: Option<Rms<'a>>,
    gelu: bool,
    out: String,
}

/// Takes the decoder `m` (loaded from `file`) apart (see the module docs). `tokenizer`: GGUF
/// tokenizer metadata to use when the model carries none (`npuc export` stores it).
pub fn lift(m: &Model, file: &str, tokenizer: Option<&GgufMetaJson>) -> Result<Lifted> {
    let g = &m.graph;
    let ix = Idx::new(g, file);
    let mut findings = vec![];
    // Layers and KV geometry from the cache inputs.
    let mut n_layers = 0;
    while g
        .inputs
        .iter()
        .any(|i| i.name == past_name(n_layers, "key"))
    {
        n_layers += 1;
    }
    if n_layers == 0 {
        return Err(ix.err(None, None, "no graph input past_key_values.0.key: not an LLM decoder with an explicit KV cache (inputs input_ids, attention_mask, position_ids, past_key_values.{l}.key|value, as `npuc export` and Optimum write them)"));
    }
    let kv_dims = |l: usize| -> Result<(usize, usize)> {
        let vi = g
            .inputs
            .iter()
            .find(|i| i.name == past_name(l, "key"))
            .expect("found above");
        match &vi.ty {
            Some(TypeInfo::Tensor { shape: Some(s), .. }) if s.len() == 4 => match (&s[1], &s[3]) {
                (Dim::Fixed(h), Dim::Fixed(d)) => Ok((*h, *d)),
                _ => Err(ix.err(
                    Some(l),
                    None,
                    "past_key_values key input needs fixed kv_heads and head_dim (dims 1 and 3)",
                )),
            },
            _ => Err(ix.err(
                Some(l),
                None,
                "past_key_values key input is not a 4-D tensor [batch, kv_heads, past, head_dim]",
            )),
        }
    };
    let (kvh, d) = kv_dims(0)?;
    for l in 1..n_layers {
        if kv_dims(l)? != (kvh, d) {
            return Err(ix.err(Some(l), None, "KV geometry differs from layer 0"));
        }
    }
    // Token embedding.
    let (gi, gather) = ix
        .cons("input_ids")
        .into_iter()
        .find(|(_, n)| {
            n.op_type == "Gather" && n.inputs.get(1).map(String::as_str) == Some("input_ids")
        })
        .ok_or_else(|| ix.err(None, None, "no Gather of input_ids (the token embedding)"))?;
    let emb = ix
        .constant(&gather.inputs[0])
        .filter(|c| c.tensor.rank() == 2)
        .ok_or_else(|| {
            ix.err(
                None,
                Some(gather),
                "the embedding lookup does not read a constant [vocab, hidden] table",
            )
        })?;
    let (vocab, e) = (emb.tensor.shape()[0], emb.tensor.shape()[1]);
    let _ = gi;
    let mut x = gather.outputs[0].clone();
    let mut embed_scale = None;
    if let [(_, mul)] = ix.cons(&x).as_slice() {
        if mul.op_type == "Mul" {
            if let Some(s) = mul.inputs.iter().find_map(|i| ix.scalar(i)) {
                embed_scale = Some(s);
                x = mul.outputs[0].clone();
            }
        }
    }
    findings.push(format!(
        "embedding {} [{vocab}, {e}]{}; {n_layers} layers with KV caches of {kvh} heads x {d}",
        emb.name,
        embed_scale
            .map(|s| format!(" scaled by {s}"))
            .unwrap_or_default()
    ));
    let mut layers = vec![];
    for l in 0..n_layers {
        let layer = find_layer(&ix, l, &x, e, kvh, d)?;
        x = layer.out.clone();
        layers.push(layer);
    }
    // Final norm and head.
    let head_out = g
        .outputs
        .iter()
        .find(|o| o.name == "logits")
        .ok_or_else(|| ix.err(None, None, "no graph output 'logits'"))?;
    let (_, stops) = ix.back(&head_out.name, 8, &|n| ix.mm_weight(n).is_some());
    let head_node = *stops.first().ok_or_else(|| {
        ix.err(
            None,
            None,
            "'logits' is not computed by a MatMul with a constant weight (the output head)",
        )
    })?;
    let head = proj_of(&ix, head_node).expect("a weighted MatMul");
    let final_norm = ix
        .rms_at(&g.nodes[head_node].inputs[0])
        .filter(|r| r.input == x)
        .ok_or_else(|| {
            ix.err(
                None,
                Some(&g.nodes[head_node]),
                "the output head's input is not an RMSNorm of the last layer's output",
            )
        })?;
    let tied = head.transposed && head.w.name == emb.name;
    if head.n_out() != vocab || head.k() != e {
        return Err(ix.err(
            None,
            Some(&g.nodes[head_node]),
            format!(
                "output head is [{} -> {}], expected [{e} -> {vocab}]",
                head.k(),
                head.n_out()
            ),
        ));
    }
    // Architecture from what was found.
    let l0 = &layers[0];
    let h = l0.q.n_out() / d;
    let bias = l0.q.bias.is_some() && l0.k.bias.is_some() && l0.v.bias.is_some();
    let qk_norm = l0.q_norm.is_some() && l0.k_norm.is_some();
    let post = l0.post_attn.is_some() && l0.post_ffn.is_some();
    let arch = match (bias, qk_norm, post, l0.gelu, embed_scale.is_some()) {
        (true, false, false, false, false) => "qwen2",
        (false, true, true, true, true) => "gemma3",
        (false, false, false, false, false) => "llama",
        _ => bail!(
            "{file}: the decoder's blocks (q/k/v biases {bias}, q/k norms {qk_norm}, post norms {post}, GELU {}, scaled embedding {}) match none of llama, qwen2, gemma3",
            l0.gelu,
            embed_scale.is_some()
        ),
    };
    let f = l0.gate.n_out();
    for (l, ly) in layers.iter().enumerate() {
        let same = ly.q.n_out() == h * d
            && ly.gate.n_out() == f
            && (ly.q.bias.is_some() == bias)
            && (ly.q_norm.is_some() == qk_norm)
            && (ly.post_attn.is_some() == post)
            && ly.gelu == l0.gelu;
        if !same {
            return Err(ix.err(
                Some(l),
                Some(&g.nodes[ly.q.node]),
                "layer differs in shape or structure from layer 0",
            ));
        }
    }
    // Epsilon: one for every norm (the builders take one).
    let eps = final_norm.eps;
    for (l, ly) in layers.iter().enumerate() {
        let all = [
            Some(&ly.attn_norm),
            Some(&ly.ffn_norm),
            ly.post_attn.as_ref(),
            ly.post_ffn.as_ref(),
        ];
        if let Some(r) = all
            .into_iter()
            .flatten()
            .find(|r| (r.eps - eps).abs() > 1e-3 * eps.abs())
        {
            return Err(ix.err(
                Some(l),
                None,
                format!(
                    "RMSNorm epsilon {} differs from the final norm's {eps}",
                    r.eps
                ),
            ));
        }
    }
    // Rope bases: global layers share one; gemma3's local layers use llama.cpp's fixed base.
    let base_of = |l: usize, inv: &[f32]| -> Result<f64> {
        if inv.len() != d / 2 || inv.len() < 2 {
            return Err(ix.err(
                Some(l),
                None,
                format!(
                    "rotary inverse frequencies have {} values, expected {}",
                    inv.len(),
                    d / 2
                ),
            ));
        }
        // Least squares on ln inv_i = -(2i/d) ln base, then the nearest integer when it fits
        // as well (bases are integers in practice; the f32 table alone leaves ~1e-6 of noise).
        let (mut num, mut den) = (0f64, 0f64);
        for (i, &v) in inv.iter().enumerate() {
            let t = 2.0 * i as f64 / d as f64;
            num -= t * (v as f64).ln();
            den += t * t;
        }
        let fit = (num / den).exp();
        let worst = |b: f64| {
            inv.iter()
                .enumerate()
                .map(|(i, &v)| {
                    let want = b.powf(-2.0 * i as f64 / d as f64);
                    ((v as f64) - want).abs() / want
                })
                .fold(0f64, f64::max)
        };
        let base = if worst(fit.round()) <= worst(fit).max(1e-6) {
            fit.round()
        } else {
            fit
        };
        for (i, &v) in inv.iter().enumerate() {
            let want = base.powf(-2.0 * i as f64 / d as f64);
            if ((v as f64) - want).abs() > 1e-4 * want {
                return Err(ix.err(Some(l), None, format!("rotary frequency {i} is {v}, not base^(-2i/d) = {want} for base {base} (scaled rope is not supported)")));
            }
        }
        Ok(base)
    };
    let window = layers.iter().map(|ly| ly.window).max().unwrap_or(0);
    let swa: Vec<bool> = layers.iter().map(|ly| ly.window > 0).collect();
    if layers.iter().any(|ly| ly.window > 0 && ly.window != window) {
        bail!("{file}: layers use different sliding windows (not supported)");
    }
    let mut global_base = None;
    for (l, ly) in layers.iter().enumerate() {
        let b = base_of(l, &ly.inv_freq)?;
        if swa[l] {
            if (b - ROPE_BASE_LOCAL as f64).abs() > 1e-3 * b {
                return Err(ix.err(Some(l), None, format!("sliding-window layer with rope base {b} (llama.cpp's gemma3 uses {ROPE_BASE_LOCAL})")));
            }
        } else {
            match global_base {
                None => global_base = Some(b),
                Some(g0) if (b - g0).abs() > 1e-3 * g0 => {
                    return Err(ix.err(
                        Some(l),
                        None,
                        format!("rope base {b} differs from an earlier global layer's {g0}"),
                    ))
                }
                _ => {}
            }
        }
    }
    let rope_base = global_base.unwrap_or(ROPE_BASE_LOCAL as f64);
    if window > 0 {
        let pattern: Vec<bool> = (0..n_layers)
            .map(|il| (il + 1) % SWA_PATTERN != 0)
            .collect();
        if arch != "gemma3" || swa != pattern {
            bail!("{file}: sliding-window layers {:?} do not follow gemma3's pattern (every {SWA_PATTERN}th layer global)", swa.iter().enumerate().filter(|(_, s)| **s).map(|(i, _)| i).collect::<Vec<_>>());
        }
    }
    // The builders' attention scale must be the graph's.
    let want_scale = if arch == "gemma3" && n_layers == 62 {
        1.0 / ((e / h) as f64).sqrt()
    } else {
        1.0 / (d as f64).sqrt()
    };
    for (l, ly) in layers.iter().enumerate() {
        if (ly.scale - want_scale).abs() > 1e-4 * want_scale {
            return Err(ix.err(
                Some(l),
                None,
                format!(
                    "attention scale {} (the {arch} builder uses {want_scale})",
                    ly.scale
                ),
            ));
        }
    }
    if let Some(s) = embed_scale {
        if (s - (e as f64).sqrt()).abs() > 1e-3 * s {
            bail!(
                "{file}: embedding scale {s} is not sqrt(hidden) = {}",
                (e as f64).sqrt()
            );
        }
    }
    findings.push(format!(
        "architecture {arch}: {h} heads, {kvh} KV heads, head dim {d}, FFN {f} ({}), eps {eps}, rope base {rope_base}{}{}, {} head",
        if l0.gelu { "GELU-tanh" } else { "SiLU" },
        if window > 0 { format!(", sliding window {window} on {} layers", swa.iter().filter(|s| **s).count()) } else { String::new() },
        if bias { ", q/k/v biases" } else { "" },
        if tied { "tied" } else { "separate" },
    ));
    // Metadata.
    let config: Option<serde_json::Value> = m
        .metadata(CONFIG_KEY)
        .and_then(|s| serde_json::from_str(s).ok());
    let ctx_train = config
        .as_ref()
        .and_then(|c| c.get("max_position_embeddings"))
        .and_then(|v| v.as_u64())
        .unwrap_or(4096);
    let a = |k: &str| format!("{arch}.{k}");
    let mut meta: Vec<(String, MetaValue)> = vec![
        (
            "general.architecture".into(),
            MetaValue::String(arch.into()),
        ),
        (a("block_count"), MetaValue::U32(n_layers as u32)),
        (a("context_length"), MetaValue::U32(ctx_train as u32)),
        (a("embedding_length"), MetaValue::U32(e as u32)),
        (a("feed_forward_length"), MetaValue::U32(f as u32)),
        (a("attention.head_count"), MetaValue::U32(h as u32)),
        (a("attention.head_count_kv"), MetaValue::U32(kvh as u32)),
        (a("attention.key_length"), MetaValue::U32(d as u32)),
        (a("attention.value_length"), MetaValue::U32(d as u32)),
        (
            a("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(eps as f32),
        ),
        (a("rope.freq_base"), MetaValue::F32(rope_base as f32)),
        (a("vocab_size"), MetaValue::U32(vocab as u32)),
    ];
    if window > 0 {
        meta.push((a("attention.sliding_window"), MetaValue::U32(window as u32)));
    }
    let stored: Option<GgufMetaJson> = match m.metadata(TOKENIZER_KEY) {
        Some(j) => Some(GgufMetaJson::from_json(&serde_json::from_str(j).map_err(
            |e| LlmError::Msg(format!("{file}: metadata {TOKENIZER_KEY}: {e}")),
        )?)?),
        None => None,
    };
    let tok = tokenizer.or(stored.as_ref()).ok_or_else(|| {
        LlmError::Msg(format!("{file}: the model carries no tokenizer (metadata {TOKENIZER_KEY}); give one: model.tokenizer = \"a GGUF of the same model\""))
    })?;
    let mut has_tokens = false;
    for (k, v) in &tok.entries {
        if k.starts_with("tokenizer.") {
            has_tokens |= k == "tokenizer.ggml.tokens";
            meta.push((k.clone(), v.clone()));
        }
    }
    if !has_tokens {
        bail!("{file}: the tokenizer metadata has no tokenizer.ggml.tokens");
    }
    // Tensors.
    let mut tensors = vec![];
    let permute = (arch == "llama").then_some(());
    let mut put_matrix = |name: String, p: &Proj, heads: Option<usize>| -> Result<()> {
        tensors.push(matrix_tensor(&ix, name, &p.w, p.transposed, heads)?);
        Ok(())
    };
    put_matrix(
        "token_embd.weight".into(),
        &Proj {
            node: gi,
            w: emb.clone(),
            transposed: true,
            bias: None,
        },
        None,
    )?;
    if !tied {
        put_matrix("output.weight".into(), &head, None)?;
    }
    let mut vectors: Vec<(String, Const)> =
        vec![("output_norm.weight".into(), final_norm.weight.clone())];
    for (l, ly) in layers.iter().enumerate() {
        let p = |s: &str| format!("blk.{l}.{s}");
        put_matrix(p("attn_q.weight"), &ly.q, permute.map(|_| h))?;
        put_matrix(p("attn_k.weight"), &ly.k, permute.map(|_| kvh))?;
        put_matrix(p("attn_v.weight"), &ly.v, None)?;
        put_matrix(p("attn_output.weight"), &ly.o, None)?;
        put_matrix(p("ffn_gate.weight"), &ly.gate, None)?;
        put_matrix(p("ffn_up.weight"), &ly.up, None)?;
        put_matrix(p("ffn_down.weight"), &ly.down, None)?;
        vectors.push((p("attn_norm.weight"), ly.attn_norm.weight.clone()));
        vectors.push((p("ffn_norm.weight"), ly.ffn_norm.weight.clone()));
        if bias {
            for (s, pr) in [
                ("attn_q.bias", &ly.q),
                ("attn_k.bias", &ly.k),
                ("attn_v.bias", &ly.v),
            ] {
                vectors.push((p(s), pr.bias.clone().expect("checked")));
            }
        }
        if qk_norm {
            vectors.push((p("attn_q_norm.weight"), ly.q_norm.clone().expect("checked")));
            vectors.push((p("attn_k_norm.weight"), ly.k_norm.clone().expect("checked")));
        }
        if post {
            vectors.push((
                p("post_attention_norm.weight"),
                ly.post_attn.as_ref().expect("checked").weight.clone(),
            ));
            vectors.push((
                p("post_ffw_norm.weight"),
                ly.post_ffn.as_ref().expect("checked").weight.clone(),
            ));
        }
    }
    for (name, c) in vectors {
        let v: Vec<f32> = c
            .tensor
            .to_f64_vec()?
            .into_iter()
            .map(|x| x as f32)
            .collect();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        tensors.push((name, GgmlType::F32, vec![v.len() as u64], bytes));
    }
    Ok(Lifted {
        arch: arch.into(),
        metadata: meta,
        tensors,
        findings,
    })
}

/// A projection constant as a GGUF matrix `[n_out rows of k]` (F32, or F16 when stored so);
/// `heads`: q/k rows of a llama model, permuted into llama.cpp's adjacent-pair rope order.
fn matrix_tensor(
    ix: &Idx,
    name: String,
    c: &Const,
    transposed: bool,
    heads: Option<usize>,
) -> Result<(String, GgmlType, Vec<u64>, Vec<u8>)> {
    let t = &c.tensor;
    let s = t.shape();
    // GGUF rows are output channels: [n_out, k].
    let (n_out, k) = if transposed {
        (s[0], s[1])
    } else {
        (s[1], s[0])
    };
    let (ty, esize) = match t.dtype() {
        DType::F32 => (GgmlType::F32, 4),
        DType::F16 => (GgmlType::F16, 2),
        dt => {
            return Err(LlmError::Msg(format!(
                "{}: weight '{}' is {}, expected float32 or float16",
                ix.file,
                c.name,
                dt.name()
            )))
        }
    };
    let raw = t.to_le_bytes()?;
    // GGUF row r comes from source output channel src(r).
    let src = |r: usize| -> usize {
        match heads {
            None => r,
            Some(hn) => {
                let d = n_out / hn;
                let (h, i) = (r / d, r % d);
                // llama.cpp row 2j + t holds transformers row t * d/2 + j.
                let (j, tt) = (i / 2, i % 2);
                h * d + tt * (d / 2) + j
            }
        }
    };
    let mut out = vec![0u8; raw.len()];
    for r in 0..n_out {
        let sr = src(r);
        let dst = &mut out[r * k * esize..(r + 1) * k * esize];
        if transposed {
            dst.copy_from_slice(&raw[sr * k * esize..(sr + 1) * k * esize]);
        } else {
            for i in 0..k {
                let from = (i * n_out + sr) * esize;
                dst[i * esize..(i + 1) * esize].copy_from_slice(&raw[from..from + esize]);
            }
        }
    }
    Ok((name, ty, vec![k as u64, n_out as u64], out))
}

/// The 1-D constants of `numel` values multiplied into `nodes` (norm scales).
fn mul_vector<'a>(ix: &Idx<'a>, nodes: &[usize], numel: usize) -> Option<Const<'a>> {
    nodes.iter().find_map(|&i| {
        let n = &ix.g.nodes[i];
        (n.op_type == "Mul")
            .then(|| n.inputs.iter().find_map(|x| ix.constant(x)))
            .flatten()
            .filter(|c| c.tensor.len() == numel && c.tensor.dtype().is_float())
    })
}

fn find_layer<'a>(
    ix: &Idx<'a>,
    l: usize,
    x: &str,
    e: usize,
    kvh: usize,
    d: usize,
) -> Result<Layer<'a>> {
    let g = ix.g;
    let weighted = |n: &Node| ix.mm_weight(n).is_some();
    // Key and value: from each cache input's Concat back to its projection.
    let side = |kind: &str| -> Result<(Proj<'a>, Vec<usize>, String)> {
        let past = past_name(l, kind);
        let (_, cat) = ix
            .cons(&past)
            .into_iter()
            .find(|(_, n)| n.op_type == "Concat")
            .ok_or_else(|| {
                ix.err(
                    Some(l),
                    None,
                    format!("{past} is not concatenated with this call's {kind}s"),
                )
            })?;
        let new = cat
            .inputs
            .iter()
            .find(|i| **i != past)
            .ok_or_else(|| ix.err(Some(l), Some(cat), "Concat without a new part"))?;
        // Shape nodes only feed reshapes: not followed (they lead back into earlier layers).
        let (inner, stops) = ix.back(new, 400, &|n| weighted(n) || n.op_type == "Shape");
        let stops: Vec<usize> = stops
            .into_iter()
            .filter(|&i| weighted(&g.nodes[i]))
            .collect();
        let node = match stops.as_slice() {
            [one] => *one,
            _ => {
                return Err(ix.err(
                    Some(l),
                    Some(cat),
                    format!(
                        "the new {kind}s come from {} weighted products, expected one projection",
                        stops.len()
                    ),
                ))
            }
        };
        let p = proj_of(ix, node).expect("weighted");
        if p.n_out() != kvh * d || p.k() != e {
            return Err(ix.err(
                Some(l),
                Some(&g.nodes[node]),
                format!(
                    "{kind} projection is [{} -> {}], expected [{e} -> {}]",
                    p.k(),
                    p.n_out(),
                    kvh * d
                ),
            ));
        }
        Ok((p, inner, cat.outputs[0].clone()))
    };
    let (k, k_nodes, present_k) = side("key")?;
    let (v, _, present_v) = side("value")?;
    let hn = g.nodes[k.node].inputs[0].clone();
    if g.nodes[v.node].inputs[0] != hn {
        return Err(ix.err(
            Some(l),
            Some(&g.nodes[v.node]),
            "key and value projections read different inputs",
        ));
    }
    let attn_norm = ix.rms_at(&hn).filter(|r| r.input == x).ok_or_else(|| {
        ix.err(
            Some(l),
            Some(&g.nodes[k.node]),
            "the key projection's input is not an RMSNorm of the layer input",
        )
    })?;
    let q_node = ix
        .cons(&hn)
        .into_iter()
        .find(|(i, n)| *i != k.node && *i != v.node && weighted(n))
        .map(|(i, _)| i)
        .ok_or_else(|| {
            ix.err(
                Some(l),
                Some(&g.nodes[k.node]),
                "no third (query) projection of the normalized input",
            )
        })?;
    let q = proj_of(ix, q_node).expect("weighted");
    if !q.n_out().is_multiple_of(d) || !(q.n_out() / d).is_multiple_of(kvh) || q.k() != e {
        return Err(ix.err(
            Some(l),
            Some(&g.nodes[q_node]),
            format!(
                "query projection [{} -> {}] is not a multiple of {kvh} KV heads x {d}",
                q.k(),
                q.n_out()
            ),
        ));
    }
    // Query side: forward to the scores' Softmax.
    let (q_nodes, softmax) = ix.fwd(&g.nodes[q_node].outputs[0], 400, &|n| {
        n.op_type == "Softmax"
    });
    let sm = *softmax.first().ok_or_else(|| {
        ix.err(
            Some(l),
            Some(&g.nodes[q_node]),
            "the query does not reach a Softmax (attention scores)",
        )
    })?;
    let k_norm = mul_vector(ix, &k_nodes, d);
    let q_norm = mul_vector(ix, &q_nodes, d);
    // Attention scale: scalar Mul (or Div) constants between query and softmax.
    let mut scale = 1.0;
    let mut window = 0;
    let from_query: HashSet<&str> = q_nodes
        .iter()
        .flat_map(|&i| g.nodes[i].outputs.iter().map(String::as_str))
        .chain([g.nodes[q_node].outputs[0].as_str()])
        .collect();
    for &i in &q_nodes {
        let n = &g.nodes[i];
        let c = n.inputs.iter().find_map(|x| ix.scalar(x));
        match (n.op_type.as_str(), c) {
            ("Mul", Some(c)) if c.abs() < 1.0 => scale *= c,
            ("Div", Some(c)) if c > 1.0 => scale /= c,
            ("Add", None) => {
                // The mask: a sliding window shows as position - window.
                for m in n.inputs.iter().filter(|m| !from_query.contains(m.as_str())) {
                    let (anc, _) = ix.back(m, 64, &|_| false);
                    for &a in &anc {
                        let s = &g.nodes[a];
                        if s.op_type == "Sub" {
                            if let Some(w) = s.inputs.get(1).and_then(|y| ix.scalar(y)) {
                                if w >= 1.0 {
                                    window = w as usize;
                                }
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    // Rope: rotate_half (Neg of a half) and the inverse frequencies (a decreasing constant).
    if !k_nodes.iter().any(|&i| g.nodes[i].op_type == "Neg") {
        return Err(ix.err(
            Some(l),
            Some(&g.nodes[k.node]),
            "no rotary embedding in rotate_half form (Slice/Neg/Concat) on the keys",
        ));
    }
    // The inverse frequencies: a decreasing positive constant of d/2 values read on the key
    // side (the cos/sin tables are computed from position_ids on the way to the rotation).
    let mut inv_freq = vec![];
    'found: for &i in &k_nodes {
        for inp in &g.nodes[i].inputs {
            if let Some(c) = ix.constant(inp) {
                if c.tensor.len() == d / 2 && c.tensor.dtype().is_float() {
                    let v: Vec<f32> = c
                        .tensor
                        .to_f64_vec()?
                        .into_iter()
                        .map(|x| x as f32)
                        .collect();
                    if v[0] > 0.0 && v.windows(2).all(|w| w[1] < w[0]) {
                        inv_freq = v;
                        break 'found;
                    }
                }
            }
        }
    }
    if inv_freq.is_empty() {
        return Err(ix.err(
            Some(l),
            Some(&g.nodes[k.node]),
            format!(
                "no rotary inverse frequencies ({} decreasing values) feed the keys' rotation",
                d / 2
            ),
        ));
    }
    // Output projection: forward from the values to the first weighted product.
    let (_, o_stop) = ix.fwd(&present_v, 200, &weighted);
    let o_node = *o_stop.first().ok_or_else(|| {
        ix.err(
            Some(l),
            None,
            "the attention output reaches no output projection",
        )
    })?;
    let o = proj_of(ix, o_node).expect("weighted");
    if o.n_out() != e || o.k() != q.n_out() {
        return Err(ix.err(
            Some(l),
            Some(&g.nodes[o_node]),
            format!(
                "output projection [{} -> {}], expected [{} -> {e}]",
                o.k(),
                o.n_out(),
                q.n_out()
            ),
        ));
    }
    let _ = (present_k, sm);
    // Residual: the Add of the layer input and (a norm of) the attention output.
    let residual = |input: &str, from: &str| -> Result<(String, Option<Rms<'a>>)> {
        let (_, a) = ix
            .cons(input)
            .into_iter()
            .find(|(_, n)| n.op_type == "Add" && n.inputs.iter().all(|i| ix.constant(i).is_none()))
            .ok_or_else(|| ix.err(Some(l), None, format!("no residual Add of '{input}'")))?;
        let other = a
            .inputs
            .iter()
            .find(|i| *i != input)
            .cloned()
            .unwrap_or_default();
        let post = if other == from {
            None
        } else {
            Some(ix.rms_at(&other).filter(|r| r.input == from).ok_or_else(|| {
                ix.err(Some(l), Some(a), format!("the residual adds '{other}', neither the branch output '{from}' nor an RMSNorm of it"))
            })?)
        };
        Ok((a.outputs[0].clone(), post))
    };
    let o_out = g.nodes[o_node].outputs[0].clone();
    let (h1, post_attn) = residual(x, &o_out)?;
    // FFN: two products of the normalized residual (gate, up), then the down projection.
    let (_, ffn_stops) = ix.fwd(&h1, 100, &weighted);
    let firsts: Vec<usize> = ffn_stops
        .into_iter()
        .filter(|&i| {
            ix.rms_at(&g.nodes[i].inputs[0])
                .is_some_and(|r| r.input == h1)
        })
        .collect();
    let [a_node, b_node] = firsts.as_slice() else {
        return Err(ix.err(
            Some(l),
            None,
            format!(
                "expected two FFN products (gate, up) of the normalized residual, found {}",
                firsts.len()
            ),
        ));
    };
    let ffn_norm = ix.rms_at(&g.nodes[*a_node].inputs[0]).expect("filtered");
    // The product joining the branches; the branch through a nonlinearity is the gate.
    let (a_fwd, a_stops) = ix.fwd(&g.nodes[*a_node].outputs[0], 30, &weighted);
    let (b_fwd, _) = ix.fwd(&g.nodes[*b_node].outputs[0], 30, &weighted);
    let down_node = *a_stops.first().ok_or_else(|| {
        ix.err(
            Some(l),
            Some(&g.nodes[*a_node]),
            "the FFN reaches no down projection",
        )
    })?;
    let join = a_fwd
        .iter()
        .find(|i| b_fwd.contains(i) && g.nodes[**i].op_type == "Mul")
        .copied()
        .ok_or_else(|| {
            ix.err(
                Some(l),
                Some(&g.nodes[*a_node]),
                "the two FFN branches are not multiplied",
            )
        })?;
    let direct = |n: usize| g.nodes[join].inputs.contains(&g.nodes[n].outputs[0]);
    let (gate_node, up_node) = match (direct(*a_node), direct(*b_node)) {
        (false, true) => (*a_node, *b_node),
        (true, false) => (*b_node, *a_node),
        _ => {
            return Err(ix.err(
                Some(l),
                Some(&g.nodes[join]),
                "cannot tell the FFN gate (through an activation) from up",
            ))
        }
    };
    let (act_nodes, _) = ix.back(
        &g.nodes[join]
            .inputs
            .iter()
            .find(|i| **i != g.nodes[up_node].outputs[0])
            .cloned()
            .unwrap_or_default(),
        40,
        &|n| {
            n.outputs
                .iter()
                .any(|o| *o == g.nodes[gate_node].outputs[0])
        },
    );
    let ops: HashSet<&str> = act_nodes
        .iter()
        .map(|&i| g.nodes[i].op_type.as_str())
        .collect();
    let approximate = |i: usize| {
        g.nodes[i]
            .attr_str("approximate")
            .ok()
            .flatten()
            .map(str::to_string)
    };
    let gelu = if ops.contains("Sigmoid") {
        false
    } else if ops.contains("Tanh")
        || ops.contains("FastGelu")
        || act_nodes
            .iter()
            .any(|&i| g.nodes[i].op_type == "Gelu" && approximate(i).as_deref() == Some("tanh"))
    {
        true
    } else {
        return Err(ix.err(
            Some(l),
            Some(&g.nodes[gate_node]),
            format!(
                "FFN activation {:?} is neither SiLU (x·Sigmoid) nor GELU-tanh",
                ops
            ),
        ));
    };
    let down = proj_of(ix, down_node).expect("weighted");
    let gate = proj_of(ix, gate_node).expect("weighted");
    let up = proj_of(ix, up_node).expect("weighted");
    if gate.n_out() != up.n_out() || down.k() != gate.n_out() || down.n_out() != e {
        return Err(ix.err(
            Some(l),
            Some(&g.nodes[down_node]),
            "FFN projection shapes do not chain",
        ));
    }
    let d_out = g.nodes[down_node].outputs[0].clone();
    let (out, post_ffn) = residual(&h1, &d_out)?;
    Ok(Layer {
        attn_norm,
        q,
        k,
        v,
        q_norm,
        k_norm,
        inv_freq,
        scale,
        window,
        o,
        post_attn,
        ffn_norm,
        gate,
        up,
        down,
        post_ffn,
        gelu,
        out,
    })
}
