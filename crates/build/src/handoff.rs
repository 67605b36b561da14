//! The QNN hand-off of a bundle, for users who take it further with the vendor SDK:
//! - `part-{i}.encodings.json` (per part, written by its `compile` step): AIMET 1.0.0 encodings
//!   (`npuc_quant::encodings`, the writer behind `npuc compile --emit-encodings`) of the part's
//!   block-quantized weights that AIMET's `(scale, integer offset)` per-block form expresses
//!   exactly: Q8_0 (8-bit, blocks of 32), Q4_0 (4-bit, blocks of 32), Q6_K (6-bit values in an
//!   8-bit container, sub-blocks of 16, scale = d x sub-scale). Other GGML types (Q4_K, Q5_K,
//!   Q4_1, ... carry a per-block minimum that is not an integer number of steps) are listed
//!   under `npuc_not_expressed` with the reason, never approximated;
//! - `genie_config.json` (per bundle, written by the `bundle` step): a GENIE `dialog` config
//!   (context size, vocabulary, BOS/EOS from the tokenizer, greedy sampler, `QnnHtp` engine with
//!   `kv-dim`, the parts in order as `ctx-bins`, RoPE parameters), plus an `npuc` object naming
//!   each part's graphs (AR, ctx) and KV tensors.

use anyhow::{bail, Result};
use npuc_ir::{DType, GgmlType, Model};
use npuc_quant::encodings::{to_json, EncodingsVersion};
use npuc_quant::qdq::{Encodings, QEnc, TensorEncoding};
use serde_json::json;

/// Per-block (scale, block size, dtype) of one row of a GGML type AIMET expresses exactly.
fn block_scales(ty: GgmlType, row: &[u8], k: usize) -> Option<(Vec<f32>, usize, DType)> {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    match ty {
        GgmlType::Q8_0 => Some((
            row.chunks_exact(34).take(k / 32).map(f16).collect(),
            32,
            DType::I8,
        )),
        GgmlType::Q4_0 => Some((
            row.chunks_exact(18).take(k / 32).map(f16).collect(),
            32,
            DType::I4,
        )),
        GgmlType::Q6_K => {
            // ql[128], qh[64], scales[16] (i8), d (f16): 16 sub-blocks of 16.
            let mut v = vec![];
            for b in row.chunks_exact(210).take(k / 256) {
                let d = f16(&b[208..210]);
                v.extend(b[192..208].iter().map(|&s| d * (s as i8) as f32));
            }
            Some((v, 16, DType::I8))
        }
        _ => None,
    }
}

/// The AIMET encodings of a part's quantized weights (`m`: one of its graphs, every graph of a
/// part holding the same weights), and the weights it cannot express.
pub fn part_encodings(m: &Model) -> Result<String> {
    let mut enc = Encodings::default();
    let mut skipped = vec![];
    for n in &m.graph.nodes {
        let (w, ty) = match (n.op_type.as_str(), n.attr("ggml_type")) {
            ("GgmlMatMul", Some(npuc_ir::Attr::String(t))) => (&n.inputs[1], t),
            ("GgmlGather", Some(npuc_ir::Attr::String(t))) => (&n.inputs[0], t),
            _ => continue,
        };
        if enc.params.contains_key(w) || skipped.iter().any(|(s, _, _): &(String, _, _)| s == w) {
            continue;
        }
        let Some(gt) = GgmlType::from_name(ty) else {
            bail!("node '{}': unknown ggml_type '{ty}'", n.name);
        };
        let Some(init) = m.graph.initializers.iter().find(|i| &i.name == w) else {
            bail!("node '{}': weight '{w}' is not an initializer", n.name);
        };
        let k = match n.attr("k") {
            Some(npuc_ir::Attr::Int(k)) if *k > 0 => *k as usize,
            _ => bail!("node '{}': no input length attribute 'k'", n.name),
        };
        let t = &init.tensor;
        if t.dtype() != DType::U8 || t.rank() != 2 {
            // Plain f32/f16 weights: nothing to encode.
            continue;
        }
        let (rows, rb) = (t.shape()[0], t.shape()[1]);
        let bytes = t.as_slice::<u8>()?;
        let mut scales = vec![];
        let mut spec = None;
        for r in 0..rows {
            match block_scales(gt, &bytes[r * rb..(r + 1) * rb], k) {
                Some((s, b, d)) => {
                    scales.extend(s);
                    spec = Some((b, d));
                }
                None => break,
            }
        }
        let Some((block, dtype)) = spec else {
            skipped.push((
                w.clone(),
                gt.name(),
                "blocks carry a minimum that is not an integer number of quantization steps (AIMET offsets are integers)",
            ));
            continue;
        };
        let per_row = k / block;
        enc.params.insert(
            w.clone(),
            TensorEncoding::Int(QEnc {
                dtype,
                zero_point: vec![0; scales.len()],
                scale: scales,
                axis: Some(1),
                block_size: Some(block),
                param_shape: vec![rows, per_row],
                lpbq: None,
            }),
        );
    }
    let args = json!({
        "source": "GGML block quantization of the GGUF weights (exact: the same grid)",
        "activation_bitwidth": null,
    });
    let text = to_json(&enc, EncodingsVersion::V1_0_0, args)?;
    let mut j: serde_json::Value = serde_json::from_str(&text)?;
    j["npuc_not_expressed"] = json!(skipped
        .iter()
        .map(|(n, t, why)| json!({"name": n, "ggml_type": t, "reason": why}))
        .collect::<Vec<_>>());
    let mut out = serde_json::to_vec_pretty(&j)?;
    out.push(b'\n');
    Ok(String::from_utf8(out)?)
}

/// What the GENIE config needs to know about the model.
pub struct GenieFacts<'a> {
    pub arch: &'a str,
    pub vocab: usize,
    pub n_embd: usize,
    pub head_dim: usize,
    pub n_kv_heads: usize,
    pub ctx: usize,
    pub bos: Option<u64>,
    pub eos: Vec<u64>,
    pub rope_theta: f32,
    pub rope_dim: usize,
    pub parts: Vec<serde_json::Value>,
    pub ar: &'a [usize],
    pub ctxs: &'a [usize],
    pub sha: bool,
}

/// `genie_config.json`.
pub fn genie_config(f: &GenieFacts) -> Result<Vec<u8>> {
    let mut context = json!({
        "version": 1,
        "size": f.ctx,
        "n-vocab": f.vocab,
        "eos-token": f.eos,
    });
    if let Some(b) = f.bos {
        context["bos-token"] = json!(b);
    }
    let j = json!({
        "dialog": {
            "version": 1,
            "type": "basic",
            "context": context,
            "sampler": {"version": 1, "seed": 42, "temp": 0.8, "top-k": 40, "top-p": 0.95, "greedy": true},
            "tokenizer": {"version": 1, "path": "tokenizer.json"},
            "engine": {
                "version": 1,
                "n-threads": 3,
                "backend": {
                    "version": 1,
                    "type": "QnnHtp",
                    "QnnHtp": {
                        "version": 1,
                        "use-mmap": true,
                        "spill-fill-bufsize": 0,
                        "mmap-budget": 0,
                        "poll": true,
                        "cpu-mask": "0xe0",
                        "kv-dim": f.head_dim,
                        "allow-async-init": false
                    },
                    "extensions": "htp_backend_ext_config.json"
                },
                "model": {
                    "version": 1,
                    "type": "binary",
                    "binary": {
                        "version": 1,
                        "ctx-bins": f.parts.iter().map(|p| p["bin"].clone()).collect::<Vec<_>>()
                    },
                    "positional-encoding": {
                        "type": "rope",
                        "rope-dim": f.rope_dim / 2,
                        "rope-theta": f.rope_theta
                    }
                }
            }
        },
        "npuc": {
            "note": "ctx-bins name the QNN context binaries a user builds from each part with the vendor SDK (one per npuc part, graphs ar{N}_c{C}); npuc runs the .npuc parts listed here itself",
            "arch": f.arch,
            "n-embd": f.n_embd,
            "kv-heads": f.n_kv_heads,
            "head-dim": f.head_dim,
            "ar": f.ar,
            "ctx": f.ctxs,
            "single-head-attention": f.sha,
            "parts": f.parts,
        }
    });
    let mut v = serde_json::to_vec_pretty(&j)?;
    v.push(b'\n');
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use npuc_ir::{Attr, Graph, Initializer, Node, Tensor};

    /// A one-node graph whose weight `w` is `rows` GGML rows of type `ty` (bytes given).
    fn graph(ty: &str, rows: usize, k: usize, bytes: Vec<u8>) -> Model {
        let rb = bytes.len() / rows;
        let node = Node::new("GgmlMatMul", &["x", "w"], &["y"])
            .with_attr("ggml_type", Attr::String(ty.into()))
            .with_attr("k", Attr::Int(k as i64));
        Model {
            graph: Graph {
                nodes: vec![node],
                initializers: vec![Initializer {
                    name: "w".into(),
                    tensor: Tensor::from_vec(vec![rows, rb], bytes).unwrap(),
                }],
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn f16(x: f32) -> [u8; 2] {
        half::f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn exact_ggml_types_give_their_block_scales_others_are_listed() {
        // Q8_0: 2 rows of one block (f16 d, 32 x i8).
        let mut b = vec![];
        for d in [0.5f32, 0.25] {
            b.extend(f16(d));
            b.extend([1u8; 32]);
        }
        let j: serde_json::Value =
            serde_json::from_str(&part_encodings(&graph("q8_0", 2, 32, b)).unwrap()).unwrap();
        let e = &j["param_encodings"][0];
        assert_eq!(e["name"], "w");
        assert_eq!(e["enc_type"], "PER_BLOCK");
        assert_eq!(e["block_size"], 32);
        assert_eq!(e["bw"], 8);
        assert_eq!(e["scale"], serde_json::json!([0.5, 0.25]));
        // Q6_K: one super-block of 256: ql[128], qh[64], 16 i8 sub-scales, f16 d.
        let mut b = vec![0u8; 192];
        b.extend((0..16).map(|i| (i as i8 - 8) as u8));
        b.extend(f16(0.125));
        let j: serde_json::Value =
            serde_json::from_str(&part_encodings(&graph("q6_K", 1, 256, b)).unwrap()).unwrap();
        let want: Vec<f32> = (0..16).map(|i| 0.125 * (i - 8) as f32).collect();
        assert_eq!(j["param_encodings"][0]["scale"], serde_json::json!(want));
        assert_eq!(j["param_encodings"][0]["block_size"], 16);
        // Q4_1 (scale and minimum per block): not expressed, with the reason.
        let j: serde_json::Value =
            serde_json::from_str(&part_encodings(&graph("q4_1", 1, 32, vec![0; 20])).unwrap())
                .unwrap();
        assert_eq!(j["param_encodings"].as_array().unwrap().len(), 0);
        assert_eq!(j["npuc_not_expressed"][0]["name"], "w");
        assert!(j["npuc_not_expressed"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("minimum"));
    }
}
