//! GGUF decoder → a standard ONNX decoder, laid out as Hugging Face Optimum / transformers
//! exports are (what QAIRT users start from): inputs `input_ids` i64 `[batch, seq]`,
//! `attention_mask` i64 `[batch, past + seq]`, `position_ids` i64 `[batch, seq]`,
//! `past_key_values.{l}.key|value` f32 `[batch, kv_heads, past, head_dim]`; outputs `logits` f32
//! `[batch, seq, vocab]` and `present.{l}.key|value` `[batch, kv_heads, past + seq, head_dim]`
//! (the past concatenated with this call's keys/values). Opset 17, standard ops only:
//! RMSNorm as `Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul`, rotary embedding as transformers'
//! `rotate_half` (q/k rows of `llama` GGUFs un-permuted back to the Hugging Face order),
//! grouped-query attention by grouping the query heads (`[b, kv_heads, group, seq, d]` against
//! `[b, kv_heads, 1, d, t]`: no repeated K/V), the causal / sliding-window mask built from
//! `position_ids` and `attention_mask`, GELU-tanh and SiLU spelled out.
//!
//! Weights are the GGUF's dequantized to f32 (`--dtype f16`: stored as f16, widened by a `Cast`),
//! so onnxruntime's logits match npuc's `exact` precision. The model carries its
//! hyper-parameters (`npuc.llm.config`, transformers' `config.json` names) and the GGUF's
//! tokenizer metadata (`npuc.gguf.tokenizer`), so `npuc build` can take the file back as an LLM
//! source ([`super::lift`]).

use crate::build::{hparams, Act, Hparams, RopeMode};
use crate::{bail, Result};
use npuc_gguf::{GgufFile, GgufMetaJson};
use npuc_ir::{
    Attr, DType, Dim, GgmlType, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo,
    ValueInfo,
};
use std::collections::HashMap;

/// Metadata key of the hyper-parameters (a JSON object with transformers' config names).
pub const CONFIG_KEY: &str = "npuc.llm.config";
/// Metadata key of the GGUF tokenizer metadata ([`GgufMetaJson`] form).
pub const TOKENIZER_KEY: &str = "npuc.gguf.tokenizer";
/// The ONNX opset the export targets (onnxruntime has run it since 1.13).
pub const OPSET: i64 = 17;

/// How the weight matrices are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    /// Stored as f16 and widened to f32 by a `Cast` (half the file; compute stays f32).
    F16,
}

impl WeightDtype {
    pub fn parse(s: &str) -> Result<WeightDtype> {
        match s {
            "f32" => Ok(WeightDtype::F32),
            "f16" => Ok(WeightDtype::F16),
            o => bail!("--dtype '{o}' is not supported (f32, f16)"),
        }
    }
}

/// The ONNX decoder of `g` (see the module docs).
pub fn export_decoder(g: &GgufFile, dtype: WeightDtype) -> Result<Model> {
    let hp = hparams(g)?;
    if hp.rope_dims != hp.head_dim {
        bail!(
            "{}: rotary embedding over {} of {} head features (partial rope) is not supported by the ONNX export",
            g.name,
            hp.rope_dims,
            hp.head_dim
        );
    }
    let mut b = Export {
        g,
        hp: &hp,
        dtype,
        nodes: vec![],
        inits: vec![],
        n: 0,
        cached: HashMap::new(),
    };
    b.decoder()?;
    let (kvh, d) = (hp.n_kv_head, hp.head_dim);
    let sym = |s: &str| Dim::Symbolic(s.into());
    let ty = |dt: DType, dims: Vec<Dim>| {
        Some(TypeInfo::Tensor {
            dtype: Some(dt),
            shape: Some(dims),
        })
    };
    let (batch, seq, total, past) = (
        "batch_size",
        "sequence_length",
        "total_sequence_length",
        "past_sequence_length",
    );
    let mut inputs = vec![
        ValueInfo::new("input_ids", ty(DType::I64, vec![sym(batch), sym(seq)])),
        ValueInfo::new(
            "attention_mask",
            ty(DType::I64, vec![sym(batch), sym(total)]),
        ),
        ValueInfo::new("position_ids", ty(DType::I64, vec![sym(batch), sym(seq)])),
    ];
    let mut outputs = vec![ValueInfo::new(
        "logits",
        ty(DType::F32, vec![sym(batch), sym(seq), Dim::Fixed(hp.vocab)]),
    )];
    for l in 0..hp.n_layers {
        for kind in ["key", "value"] {
            inputs.push(ValueInfo::new(
                past_name(l, kind),
                ty(
                    DType::F32,
                    vec![sym(batch), Dim::Fixed(kvh), sym(past), Dim::Fixed(d)],
                ),
            ));
            outputs.push(ValueInfo::new(
                present_name(l, kind),
                ty(
                    DType::F32,
                    vec![sym(batch), Dim::Fixed(kvh), sym(total), Dim::Fixed(d)],
                ),
            ));
        }
    }
    let tokenizer = GgufMetaJson::filtered(&g.metadata, &["tokenizer.", "general."]);
    Ok(Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: OPSET,
        }],
        producer_name: "npuc".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        graph: Graph {
            name: format!("{}-decoder", hp.arch),
            nodes: b.nodes,
            inputs,
            outputs,
            initializers: b.inits,
            ..Default::default()
        },
        metadata: vec![
            (CONFIG_KEY.into(), config_json(&hp).to_string()),
            (TOKENIZER_KEY.into(), tokenizer.to_json().to_string()),
        ],
        ..Default::default()
    })
}

/// `past_key_values.{l}.{kind}`.
pub fn past_name(l: usize, kind: &str) -> String {
    format!("past_key_values.{l}.{kind}")
}

/// `present.{l}.{kind}`.
pub fn present_name(l: usize, kind: &str) -> String {
    format!("present.{l}.{kind}")
}

/// The hyper-parameters under transformers' `config.json` names (plus what a GGUF adds).
fn config_json(hp: &Hparams) -> serde_json::Value {
    let model_type = match hp.arch.as_str() {
        "gemma3" => "gemma3_text",
        a => a,
    };
    serde_json::json!({
        "model_type": model_type,
        "gguf_architecture": hp.arch,
        "hidden_size": hp.n_embd,
        "intermediate_size": hp.n_ff,
        "num_hidden_layers": hp.n_layers,
        "num_attention_heads": hp.n_head,
        "num_key_value_heads": hp.n_kv_head,
        "head_dim": hp.head_dim,
        "vocab_size": hp.vocab,
        "max_position_embeddings": hp.ctx_train,
        "rms_norm_eps": hp.eps,
        "rope_theta": hp.rope_base,
        "rope_local_base_freq": hp.rope_base_swa,
        "sliding_window": (hp.window > 0).then_some(hp.window),
        "layer_types": hp.swa_layers.iter()
            .map(|&s| if s { "sliding_attention" } else { "full_attention" })
            .collect::<Vec<_>>(),
        "tie_word_embeddings": hp.tied,
        "hidden_act": match hp.act { Act::Silu => "silu", Act::GeluTanh => "gelu_pytorch_tanh" },
    })
}

struct Export<'a> {
    g: &'a GgufFile,
    hp: &'a Hparams,
    dtype: WeightDtype,
    nodes: Vec<Node>,
    inits: Vec<Initializer>,
    n: usize,
    /// Values built once and shared by the layers (rope tables, masks), by a key.
    cached: HashMap<String, (String, String)>,
}

impl Export<'_> {
    fn named(&mut self, op: &str, ins: &[&str], out: &str, attrs: Vec<(&str, Attr)>) -> String {
        let mut nd = Node::new(op, ins, &[out]);
        nd.name = format!("{out}/{op}");
        for (k, a) in attrs {
            nd = nd.with_attr(k, a);
        }
        self.nodes.push(nd);
        out.to_string()
    }

    fn op(&mut self, op: &str, ins: &[&str], attrs: Vec<(&str, Attr)>) -> String {
        self.n += 1;
        let out = format!("{}_{}", op.to_lowercase(), self.n);
        self.named(op, ins, &out, attrs)
    }

    fn init(&mut self, name: &str, t: Tensor) -> String {
        if !self.inits.iter().any(|i| i.name == name) {
            self.inits.push(Initializer {
                name: name.into(),
                tensor: t,
            });
        }
        name.into()
    }

    fn i64s(&mut self, vals: &[i64]) -> String {
        let name = format!(
            "const.i64.{}",
            vals.iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join("_")
        );
        let t = Tensor::from_vec(vec![vals.len()], vals.to_vec()).expect("length matches");
        self.init(&name, t)
    }

    fn scalar_f32(&mut self, name: &str, v: f32) -> String {
        self.init(name, Tensor::scalar(v))
    }

    /// GGUF tensor `name` as f32 rows (`[rows, row_len]`, row-major), any block type.
    fn rows_f32(&self, name: &str) -> Result<(Vec<f32>, usize, usize)> {
        let t = self
            .g
            .tensor(name)
            .ok_or_else(|| crate::build::missing(self.g, name, &self.hp.arch))?;
        let (rows, k) = (t.rows() as usize, t.row_len() as usize);
        let bytes = self.g.tensor_bytes(t);
        let rb = t
            .ggml_type
            .row_bytes(k)
            .ok_or_else(|| self.g.tensor_err(name, "rows are not whole blocks"))?;
        if bytes.len() != rows * rb {
            return Err(self
                .g
                .tensor_err(
                    name,
                    format!("{} bytes for {rows} rows of {rb}", bytes.len()),
                )
                .into());
        }
        let mut out = vec![0f32; rows * k];
        if t.ggml_type == GgmlType::F32 {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        } else {
            for (src, dst) in bytes.chunks_exact(rb).zip(out.chunks_exact_mut(k)) {
                npuc_ggml::dequantize_row(t.ggml_type, src, dst)
                    .map_err(|e| self.g.tensor_err(name, e.0))?;
            }
        }
        Ok((out, rows, k))
    }

    /// A 1-D parameter (norm scale, bias) of `len` values, f32.
    fn param(&mut self, name: &str, len: usize) -> Result<String> {
        if self.inits.iter().any(|i| i.name == name) {
            return Ok(name.into());
        }
        let (v, rows, k) = self.rows_f32(name)?;
        if rows * k != len {
            return Err(self
                .g
                .tensor_err(name, format!("has {} values, expected {len}", rows * k))
                .into());
        }
        Ok(self.init(name, Tensor::from_vec(vec![len], v)?))
    }

    /// A stored matrix in this export's weight dtype, widened to f32 when stored as f16.
    fn stored(&mut self, name: &str, shape: Vec<usize>, v: Vec<f32>) -> Result<String> {
        Ok(match self.dtype {
            WeightDtype::F32 => self.init(name, Tensor::from_vec(shape, v)?),
            WeightDtype::F16 => {
                let h: Vec<half::f16> = v.into_iter().map(half::f16::from_f32).collect();
                let stored = self.init(name, Tensor::from_vec(shape, h)?);
                let out = format!("{name}.f32");
                self.named("Cast", &[&stored], &out, vec![("to", Attr::Int(1))])
            }
        })
    }

    /// GGUF weight `name` (`[n_out, k]`) as the `B` operand of `MatMul` (`[k, n_out]`);
    /// `unpermute_heads`: rows of a `llama` q/k projection, put back in transformers' order
    /// (convert_hf_to_gguf interleaves each head's two halves for llama.cpp's adjacent-pair rope).
    fn matrix(
        &mut self,
        name: &str,
        n_out: usize,
        k: usize,
        unpermute_heads: Option<usize>,
    ) -> Result<String> {
        let (w, rows, cols) = self.rows_f32(name)?;
        if (rows, cols) != (n_out, k) {
            return Err(self
                .g
                .tensor_err(
                    name,
                    format!("has shape [{rows}, {cols}], expected [{n_out}, {k}]"),
                )
                .into());
        }
        // Source row of each output column.
        let src_row: Vec<usize> = match unpermute_heads {
            None => (0..n_out).collect(),
            Some(heads) => {
                let d = n_out / heads;
                (0..n_out)
                    .map(|r| {
                        let (h, i) = (r / d, r % d);
                        // transformers row i = t * d/2 + j sits at GGUF row 2j + t.
                        let (t, j) = (i / (d / 2), i % (d / 2));
                        h * d + 2 * j + t
                    })
                    .collect()
            }
        };
        let mut out = vec![0f32; k * n_out];
        // Blocked transpose: 64 columns of the output at a time stay in cache.
        for c0 in (0..n_out).step_by(64) {
            let c1 = (c0 + 64).min(n_out);
            for (c, &r) in src_row.iter().enumerate().take(c1).skip(c0) {
                let row = &w[r * k..(r + 1) * k];
                for (i, &x) in row.iter().enumerate() {
                    out[i * n_out + c] = x;
                }
            }
        }
        self.stored(&format!("{name}.T"), vec![k, n_out], out)
    }

    fn linear(&mut self, x: &str, w: &str, bias: Option<&str>) -> String {
        let y = self.op("MatMul", &[x, w], vec![]);
        match bias {
            Some(b) => self.op("Add", &[&y, b], vec![]),
            None => y,
        }
    }

    /// transformers' RMSNorm: `w * x / sqrt(mean(x²) + eps)` over the last axis.
    fn rms(&mut self, x: &str, w: &str, len: usize) -> Result<String> {
        let w = self.param(w, len)?;
        let two = self.scalar_f32("const.two", 2.0);
        let eps = self.scalar_f32("const.rms_eps", self.hp.eps);
        let sq = self.op("Pow", &[x, &two], vec![]);
        let mean = self.op(
            "ReduceMean",
            &[&sq],
            vec![("axes", Attr::Ints(vec![-1])), ("keepdims", Attr::Int(1))],
        );
        let var = self.op("Add", &[&mean, &eps], vec![]);
        let sd = self.op("Sqrt", &[&var], vec![]);
        let inv = self.op("Reciprocal", &[&sd], vec![]);
        let xn = self.op("Mul", &[x, &inv], vec![]);
        Ok(self.op("Mul", &[&xn, &w], vec![]))
    }

    /// `cos`, `sin` `[batch, 1, seq, d]` for one rope base (and optional per-pair divisors).
    fn rope_tables(&mut self, tag: &str, base: f32, factors: Option<Vec<f32>>) -> (String, String) {
        if let Some(t) = self.cached.get(tag) {
            return t.clone();
        }
        let d = self.hp.head_dim;
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| {
                let f = (base as f64).powf(-2.0 * i as f64 / d as f64);
                let div = factors.as_ref().map_or(1.0, |v| v[i] as f64);
                (f / div) as f32
            })
            .collect();
        let inv = self.init(
            &format!("rope.{tag}.inv_freq"),
            Tensor::from_vec(vec![d / 2], inv).expect("length matches"),
        );
        let pos = self.op("Cast", &["position_ids"], vec![("to", Attr::Int(1))]);
        let ax2 = self.i64s(&[2]);
        let pos = self.op("Unsqueeze", &[&pos, &ax2], vec![]);
        let freqs = self.op("Mul", &[&pos, &inv], vec![]);
        let emb = self.op("Concat", &[&freqs, &freqs], vec![("axis", Attr::Int(-1))]);
        let ax1 = self.i64s(&[1]);
        let cos = self.op("Cos", &[&emb], vec![]);
        let cos = self.op("Unsqueeze", &[&cos, &ax1], vec![]);
        let sin = self.op("Sin", &[&emb], vec![]);
        let sin = self.op("Unsqueeze", &[&sin, &ax1], vec![]);
        self.cached.insert(tag.into(), (cos.clone(), sin.clone()));
        (cos, sin)
    }

    /// `x * cos + rotate_half(x) * sin` on `[batch, heads, seq, d]`.
    fn rope(&mut self, x: &str, cos: &str, sin: &str) -> String {
        let d = self.hp.head_dim as i64;
        let (z, half, end, last) = (
            self.i64s(&[0]),
            self.i64s(&[d / 2]),
            self.i64s(&[d]),
            self.i64s(&[-1]),
        );
        let x1 = self.op("Slice", &[x, &z, &half, &last], vec![]);
        let x2 = self.op("Slice", &[x, &half, &end, &last], vec![]);
        let nx2 = self.op("Neg", &[&x2], vec![]);
        let rot = self.op("Concat", &[&nx2, &x1], vec![("axis", Attr::Int(-1))]);
        let a = self.op("Mul", &[x, cos], vec![]);
        let b = self.op("Mul", &[&rot, sin], vec![]);
        self.op("Add", &[&a, &b], vec![])
    }

    /// Additive mask `[batch, 1, 1, seq, total]`: key slot `j` is visible to a query at
    /// position `p` when `j <= p`, `attention_mask[j] = 1` and (sliding window) `j > p - window`.
    fn mask(&mut self, window: usize) -> String {
        let tag = format!("mask.w{window}");
        if let Some((m, _)) = self.cached.get(&tag) {
            return m.clone();
        }
        let shape = self.op("Shape", &["attention_mask"], vec![]);
        let one = self.init("const.i64.one", Tensor::scalar(1i64));
        let zero = self.init("const.i64.zero", Tensor::scalar(0i64));
        let total = self.op("Gather", &[&shape, &one], vec![("axis", Attr::Int(0))]);
        let kpos = self.op("Range", &[&zero, &total, &one], vec![]);
        let ax2 = self.i64s(&[2]);
        let qpos = self.op("Unsqueeze", &["position_ids", &ax2], vec![]);
        let mut allowed = self.op("LessOrEqual", &[&kpos, &qpos], vec![]);
        let ax1 = self.i64s(&[1]);
        let am = self.op("Unsqueeze", &["attention_mask", &ax1], vec![]);
        let am = self.op("Cast", &[&am], vec![("to", Attr::Int(9))]);
        allowed = self.op("And", &[&allowed, &am], vec![]);
        if window > 0 {
            let w = self.init(
                &format!("const.window.{window}"),
                Tensor::scalar(window as i64),
            );
            let lowest = self.op("Sub", &[&qpos, &w], vec![]);
            let inside = self.op("Greater", &[&kpos, &lowest], vec![]);
            allowed = self.op("And", &[&allowed, &inside], vec![]);
        }
        let zero_f = self.scalar_f32("const.zero", 0.0);
        let neg = self.scalar_f32("const.masked", f32::MIN);
        let add = self.op("Where", &[&allowed, &zero_f, &neg], vec![]);
        let ax12 = self.i64s(&[1, 2]);
        let m = self.op("Unsqueeze", &[&add, &ax12], vec![]);
        self.cached.insert(tag, (m.clone(), String::new()));
        m
    }

    fn decoder(&mut self) -> Result<()> {
        let hp = self.hp;
        let (e, h, kvh, d, f) = (hp.n_embd, hp.n_head, hp.n_kv_head, hp.head_dim, hp.n_ff);
        let group = h / kvh;
        // The embedding, also the output head when tied (transposed by a node: stored once).
        let (emb, rows, cols) = self.rows_f32("token_embd.weight")?;
        if cols != e || rows < hp.vocab {
            return Err(self
                .g
                .tensor_err(
                    "token_embd.weight",
                    format!(
                        "has shape [{rows}, {cols}], expected [>= {}, {e}]",
                        hp.vocab
                    ),
                )
                .into());
        }
        let emb = self.stored("token_embd.weight", vec![rows, cols], emb)?;
        let mut x = self.op("Gather", &[&emb, "input_ids"], vec![("axis", Attr::Int(0))]);
        if let Some(s) = hp.embed_scale {
            let c = self.scalar_f32("const.embed_scale", s);
            x = self.op("Mul", &[&x, &c], vec![]);
        }
        let freqs = if hp.rope_freqs {
            let (v, _, _) = self.rows_f32("rope_freqs.weight")?;
            if v.len() != d / 2 {
                return Err(self
                    .g
                    .tensor_err(
                        "rope_freqs.weight",
                        format!("has {} values, expected {}", v.len(), d / 2),
                    )
                    .into());
            }
            Some(v)
        } else if hp.rope_linear != 1.0 {
            Some(vec![hp.rope_linear; d / 2])
        } else {
            None
        };
        let shape_heads = self.i64s(&[0, 0, h as i64, d as i64]);
        let shape_kv_heads = self.i64s(&[0, 0, kvh as i64, d as i64]);
        let shape_grouped = self.i64s(&[0, kvh as i64, group as i64, -1, d as i64]);
        let shape_merged = self.i64s(&[0, h as i64, -1, d as i64]);
        let shape_out = self.i64s(&[0, 0, (h * d) as i64]);
        let ax2 = self.i64s(&[2]);
        let scale = self.scalar_f32("const.attn_scale", hp.attn_scale);
        let unpermute = hp.rope_mode == RopeMode::Normal;
        for l in 0..hp.n_layers {
            let p = |s: &str| format!("blk.{l}.{s}");
            let swa = hp.swa_layers[l];
            let hn = self.rms(&x, &p("attn_norm.weight"), e)?;
            let (bq, bk, bv) = if hp.qkv_bias {
                (
                    Some(self.param(&p("attn_q.bias"), h * d)?),
                    Some(self.param(&p("attn_k.bias"), kvh * d)?),
                    Some(self.param(&p("attn_v.bias"), kvh * d)?),
                )
            } else {
                (None, None, None)
            };
            if unpermute && hp.qkv_bias {
                bail!("{}: q/k biases with llama's permuted rope rows are not supported by the ONNX export", self.g.name);
            }
            let wq = self.matrix(&p("attn_q.weight"), h * d, e, unpermute.then_some(h))?;
            let wk = self.matrix(&p("attn_k.weight"), kvh * d, e, unpermute.then_some(kvh))?;
            let wv = self.matrix(&p("attn_v.weight"), kvh * d, e, None)?;
            let q = self.linear(&hn, &wq, bq.as_deref());
            let k = self.linear(&hn, &wk, bk.as_deref());
            let v = self.linear(&hn, &wv, bv.as_deref());
            let perm = Attr::Ints(vec![0, 2, 1, 3]);
            let q = self.op("Reshape", &[&q, &shape_heads], vec![]);
            let mut q = self.op("Transpose", &[&q], vec![("perm", perm.clone())]);
            let k = self.op("Reshape", &[&k, &shape_kv_heads], vec![]);
            let mut k = self.op("Transpose", &[&k], vec![("perm", perm.clone())]);
            let v = self.op("Reshape", &[&v, &shape_kv_heads], vec![]);
            let v = self.op("Transpose", &[&v], vec![("perm", perm.clone())]);
            if hp.qk_norm {
                q = self.rms(&q, &p("attn_q_norm.weight"), d)?;
                k = self.rms(&k, &p("attn_k_norm.weight"), d)?;
            }
            let (cos, sin) = if swa {
                self.rope_tables("local", hp.rope_base_swa, None)
            } else {
                self.rope_tables("global", hp.rope_base, freqs.clone())
            };
            let q = self.rope(&q, &cos, &sin);
            let k = self.rope(&k, &cos, &sin);
            let pk = past_name(l, "key");
            let pv = past_name(l, "value");
            let k_all = self.named(
                "Concat",
                &[&pk, &k],
                &present_name(l, "key"),
                vec![("axis", Attr::Int(2))],
            );
            let v_all = self.named(
                "Concat",
                &[&pv, &v],
                &present_name(l, "value"),
                vec![("axis", Attr::Int(2))],
            );
            let qg = self.op("Reshape", &[&q, &shape_grouped], vec![]);
            let kg = self.op("Unsqueeze", &[&k_all, &ax2], vec![]);
            let kt = self.op(
                "Transpose",
                &[&kg],
                vec![("perm", Attr::Ints(vec![0, 1, 2, 4, 3]))],
            );
            let s = self.op("MatMul", &[&qg, &kt], vec![]);
            let s = self.op("Mul", &[&s, &scale], vec![]);
            let window = if swa { hp.window } else { 0 };
            let m = self.mask(window);
            let s = self.op("Add", &[&s, &m], vec![]);
            let pr = self.op("Softmax", &[&s], vec![("axis", Attr::Int(-1))]);
            let vg = self.op("Unsqueeze", &[&v_all, &ax2], vec![]);
            let a = self.op("MatMul", &[&pr, &vg], vec![]);
            let a = self.op("Reshape", &[&a, &shape_merged], vec![]);
            let a = self.op("Transpose", &[&a], vec![("perm", perm)]);
            let a = self.op("Reshape", &[&a, &shape_out], vec![]);
            let wo = self.matrix(&p("attn_output.weight"), e, h * d, None)?;
            let mut o = self.linear(&a, &wo, None);
            if hp.post_norms {
                o = self.rms(&o, &p("post_attention_norm.weight"), e)?;
            }
            x = self.op("Add", &[&x, &o], vec![]);
            let hn = self.rms(&x, &p("ffn_norm.weight"), e)?;
            let wg = self.matrix(&p("ffn_gate.weight"), f, e, None)?;
            let wu = self.matrix(&p("ffn_up.weight"), f, e, None)?;
            let gate = self.linear(&hn, &wg, None);
            let up = self.linear(&hn, &wu, None);
            let act = match hp.act {
                Act::Silu => {
                    let s = self.op("Sigmoid", &[&gate], vec![]);
                    self.op("Mul", &[&gate, &s], vec![])
                }
                Act::GeluTanh => self.gelu_tanh(&gate),
            };
            let m = self.op("Mul", &[&act, &up], vec![]);
            let wd = self.matrix(&p("ffn_down.weight"), e, f, None)?;
            let mut dn = self.linear(&m, &wd, None);
            if hp.post_norms {
                dn = self.rms(&dn, &p("post_ffw_norm.weight"), e)?;
            }
            x = self.op("Add", &[&x, &dn], vec![]);
        }
        let xn = self.rms(&x, "output_norm.weight", e)?;
        let head = if hp.tied {
            if rows != hp.vocab {
                return Err(self
                    .g
                    .tensor_err(
                        "token_embd.weight",
                        format!("has {rows} rows, expected the vocabulary size {}", hp.vocab),
                    )
                    .into());
            }
            self.op("Transpose", &[&emb], vec![("perm", Attr::Ints(vec![1, 0]))])
        } else {
            self.matrix("output.weight", hp.vocab, e, None)?
        };
        let logits = self.op("MatMul", &[&xn, &head], vec![]);
        self.named("Identity", &[&logits], "logits", vec![]);
        Ok(())
    }

    /// `0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))`, as transformers' `gelu_pytorch_tanh`.
    fn gelu_tanh(&mut self, x: &str) -> String {
        let c0 = self.scalar_f32("const.gelu.c", 0.797_884_6);
        let c1 = self.scalar_f32("const.gelu.cube", 0.044_715);
        let half = self.scalar_f32("const.half", 0.5);
        let one = self.scalar_f32("const.one", 1.0);
        let three = self.scalar_f32("const.three", 3.0);
        let x3 = self.op("Pow", &[x, &three], vec![]);
        let t = self.op("Mul", &[&x3, &c1], vec![]);
        let t = self.op("Add", &[x, &t], vec![]);
        let t = self.op("Mul", &[&t, &c0], vec![]);
        let t = self.op("Tanh", &[&t], vec![]);
        let t = self.op("Add", &[&t, &one], vec![]);
        let t = self.op("Mul", &[x, &t], vec![]);
        self.op("Mul", &[&t, &half], vec![])
    }
}
