//! Test support: the tiny-qwen2 F32 GGUF as a real causal LM with a KV cache (a plain f32 reference
//! forward pass, checked against HF transformers' logits in `e2e_tiny_qwen2.rs`), and its byte-level
//! vocabulary as `TokenText`. Independent of npuc's engine: it exists so the generation loop, chat cache
//! reuse and perplexity can be tested on a real model before/without `npuc-llm`.

#![allow(dead_code)]

use anyhow::{bail, Result};
use npuc_generate::{CausalLm, TokenText};
use npuc_gguf::GgufFile;
use std::collections::HashMap;
use std::path::PathBuf;

pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/llm")
        .join(rel)
}

/// Reads an f32 `.npy` (through `npuc-npy`); returns (shape, data).
pub fn read_npy_f32(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
    npuc_npy::read_f32(path).unwrap_or_else(|e| panic!("{e}"))
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    bq: Vec<f32>,
    wk: Vec<f32>,
    bk: Vec<f32>,
    wv: Vec<f32>,
    bv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    /// Cached K (after rope) / V per position: [pos][n_kv * head_dim].
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
}

/// The tiny-qwen2 model (F32 GGUF), f32 math, KV cache of `ctx` positions.
pub struct TinyQwen2 {
    embd: Vec<f32>,
    out_norm: Vec<f32>,
    output: Vec<f32>,
    layers: Vec<Layer>,
    n_embd: usize,
    n_ff: usize,
    n_head: usize,
    n_kv: usize,
    head_dim: usize,
    vocab: usize,
    eps: f32,
    rope_base: f32,
    ctx: usize,
    pos: usize,
}

fn f32s(g: &GgufFile, name: &str) -> Vec<f32> {
    let t = g.tensor(name).unwrap_or_else(|| panic!("tensor {name}"));
    assert_eq!(t.ggml_type, npuc_ir::GgmlType::F32, "{name}");
    g.tensor_bytes(t)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// y[r] = Σ_c w[r * cols + c] * x[c] (+ b[r]).
fn matvec(w: &[f32], x: &[f32], b: Option<&[f32]>) -> Vec<f32> {
    let cols = x.len();
    w.chunks_exact(cols)
        .enumerate()
        .map(|(r, row)| {
            row.iter().zip(x).map(|(a, b)| a * b).sum::<f32>() + b.map_or(0.0, |b| b[r])
        })
        .collect()
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * s * w).collect()
}

impl TinyQwen2 {
    pub fn load(ctx: usize) -> TinyQwen2 {
        let g = GgufFile::open(fixture("tiny-qwen2/tiny-qwen2-F32.gguf")).unwrap();
        let u = |k: &str| g.req_u64(k).unwrap() as usize;
        let n_layer = u("qwen2.block_count");
        let layers = (0..n_layer)
            .map(|l| {
                let t = |n: &str| f32s(&g, &format!("blk.{l}.{n}"));
                Layer {
                    attn_norm: t("attn_norm.weight"),
                    wq: t("attn_q.weight"),
                    bq: t("attn_q.bias"),
                    wk: t("attn_k.weight"),
                    bk: t("attn_k.bias"),
                    wv: t("attn_v.weight"),
                    bv: t("attn_v.bias"),
                    wo: t("attn_output.weight"),
                    ffn_norm: t("ffn_norm.weight"),
                    gate: t("ffn_gate.weight"),
                    up: t("ffn_up.weight"),
                    down: t("ffn_down.weight"),
                    k_cache: Vec::new(),
                    v_cache: Vec::new(),
                }
            })
            .collect();
        let n_embd = u("qwen2.embedding_length");
        let n_head = u("qwen2.attention.head_count");
        let output = f32s(&g, "output.weight");
        TinyQwen2 {
            embd: f32s(&g, "token_embd.weight"),
            out_norm: f32s(&g, "output_norm.weight"),
            vocab: output.len() / n_embd,
            output,
            layers,
            n_embd,
            n_ff: u("qwen2.feed_forward_length"),
            n_head,
            n_kv: u("qwen2.attention.head_count_kv"),
            head_dim: n_embd / n_head,
            eps: g.req_f64("qwen2.attention.layer_norm_rms_epsilon").unwrap() as f32,
            rope_base: g.req_f64("qwen2.rope.freq_base").unwrap() as f32,
            ctx: ctx.min(u("qwen2.context_length")),
            pos: 0,
        }
    }

    /// NEOX rope: rotates (x[i], x[i + d/2]) of each head by pos * base^(-2i/d).
    fn rope(&self, x: &mut [f32], pos: usize) {
        let d = self.head_dim;
        for head in x.chunks_exact_mut(d) {
            for i in 0..d / 2 {
                let theta = pos as f64 * (self.rope_base as f64).powf(-2.0 * i as f64 / d as f64);
                let (s, c) = (theta.sin() as f32, theta.cos() as f32);
                let (a, b) = (head[i], head[i + d / 2]);
                head[i] = a * c - b * s;
                head[i + d / 2] = a * s + b * c;
            }
        }
    }

    /// One token at the current position; returns its logits.
    fn step(&mut self, tok: u32) -> Vec<f32> {
        let pos = self.pos;
        let (d, hd) = (self.n_embd, self.head_dim);
        let mut x = self.embd[tok as usize * d..(tok as usize + 1) * d].to_vec();
        for li in 0..self.layers.len() {
            let h = rmsnorm(&x, &self.layers[li].attn_norm, self.eps);
            let l = &self.layers[li];
            let mut q = matvec(&l.wq, &h, Some(&l.bq));
            let mut k = matvec(&l.wk, &h, Some(&l.bk));
            let v = matvec(&l.wv, &h, Some(&l.bv));
            self.rope(&mut q, pos);
            self.rope(&mut k, pos);
            let l = &mut self.layers[li];
            l.k_cache.truncate(pos);
            l.v_cache.truncate(pos);
            l.k_cache.push(k);
            l.v_cache.push(v);
            let mut attn = vec![0.0f32; d];
            let group = self.n_head / self.n_kv;
            for hq in 0..self.n_head {
                let kvh = hq / group;
                let qh = &q[hq * hd..(hq + 1) * hd];
                let scores: Vec<f32> = (0..=pos)
                    .map(|p| {
                        let kh = &l.k_cache[p][kvh * hd..(kvh + 1) * hd];
                        qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for (p, w) in e.iter().enumerate() {
                    let vh = &l.v_cache[p][kvh * hd..(kvh + 1) * hd];
                    for (o, vv) in attn[hq * hd..(hq + 1) * hd].iter_mut().zip(vh) {
                        *o += w / z * vv;
                    }
                }
            }
            let o = matvec(&l.wo, &attn, None);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = rmsnorm(&x, &l.ffn_norm, self.eps);
            let g = matvec(&l.gate, &h, None);
            let u = matvec(&l.up, &h, None);
            let a: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            debug_assert_eq!(a.len(), self.n_ff);
            let dn = matvec(&l.down, &a, None);
            x.iter_mut().zip(&dn).for_each(|(a, b)| *a += b);
        }
        self.pos += 1;
        let h = rmsnorm(&x, &self.out_norm, self.eps);
        matvec(&self.output, &h, None)
    }
}

impl CausalLm for TinyQwen2 {
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        if self.pos + tokens.len() > self.ctx {
            bail!(
                "context overflow: {} + {} > {}",
                self.pos,
                tokens.len(),
                self.ctx
            );
        }
        let mut out = Vec::new();
        for (i, &t) in tokens.iter().enumerate() {
            let l = self.step(t);
            if all_logits || i + 1 == tokens.len() {
                out.extend(l);
            }
        }
        Ok(out)
    }
    fn position(&self) -> usize {
        self.pos
    }
    fn ctx(&self) -> usize {
        self.ctx
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn reset(&mut self) {
        self.pos = 0;
    }
    fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
    }
}

/// GPT-2's byte ↔ unicode table, unicode → byte direction.
pub fn gpt2_unicode_to_byte() -> HashMap<char, u8> {
    let mut keep: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    keep.extend(0xA1..=0xAC);
    keep.extend(0xAE..=0xFF);
    let mut map = HashMap::new();
    let mut n = 0;
    for b in 0u32..256 {
        let c = if keep.contains(&b) {
            b
        } else {
            n += 1;
            255 + n
        };
        map.insert(char::from_u32(c).unwrap(), b as u8);
    }
    map
}

/// A byte-level vocabulary read from a GGUF (control tokens decode to nothing).
pub struct ByteVocab {
    pub pieces: Vec<Vec<u8>>,
    pub texts: Vec<String>,
    pub eog: Vec<u32>,
}

impl ByteVocab {
    pub fn tiny_qwen2() -> ByteVocab {
        let g = GgufFile::open(fixture("tiny-qwen2/tiny-qwen2-F32.gguf")).unwrap();
        assert_eq!(g.req_str("tokenizer.ggml.model").unwrap(), "gpt2");
        let tokens = g
            .get("tokenizer.ggml.tokens")
            .unwrap()
            .as_str_array()
            .unwrap();
        let types = g
            .get("tokenizer.ggml.token_type")
            .unwrap()
            .as_i64_array()
            .unwrap();
        let eos = g.req_u64("tokenizer.ggml.eos_token_id").unwrap() as u32;
        let map = gpt2_unicode_to_byte();
        let pieces = tokens
            .iter()
            .zip(&types)
            .map(|(t, &ty)| {
                if ty == 3 {
                    Vec::new()
                } else {
                    t.chars().map(|c| map[&c]).collect()
                }
            })
            .collect();
        ByteVocab {
            pieces,
            texts: tokens.iter().map(|s| s.to_string()).collect(),
            eog: vec![eos],
        }
    }

    pub fn id(&self, piece: &[u8]) -> u32 {
        self.pieces.iter().position(|p| p == piece).unwrap() as u32
    }

    /// Byte-by-byte encoding (one single-byte token per byte) with `<|...|>` special tokens parsed: a
    /// valid, if not the merge-optimal, tokenization.
    pub fn encode_bytes(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        'outer: while !rest.is_empty() {
            for (id, t) in self.texts.iter().enumerate() {
                if self.pieces[id].is_empty() && !t.is_empty() && rest.starts_with(t.as_str()) {
                    out.push(id as u32);
                    rest = &rest[t.len()..];
                    continue 'outer;
                }
            }
            let c = rest.chars().next().unwrap();
            let mut buf = [0u8; 4];
            for &b in c.encode_utf8(&mut buf).as_bytes() {
                out.push(self.id(&[b]));
            }
            rest = &rest[c.len_utf8()..];
        }
        out
    }
}

impl TokenText for ByteVocab {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.pieces.get(id as usize).cloned().unwrap_or_default()
    }
    fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }
}
