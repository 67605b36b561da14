//! QDQ ONNX export following onnxruntime's QNN execution provider conventions: unsigned
//! activations (uint8/uint16), symmetric int weights, per-channel only on Conv/ConvTranspose
//! weights (other weights per tensor), int32 bias, and `com.microsoft` QuantizeLinear /
//! DequantizeLinear where the model's opset is too old for the standard op (16-/4-bit or blocked
//! below opset 21, per-axis below 13). The model's default opset is never raised, since that
//! would silently change the meaning of other ops (e.g. ReduceMean's `axes` at 18).

use crate::qdq::{
    apply, bias_encoding, weight_encoding, BiasSpec, Encodings, QEnc, TensorEncoding, WeightSpec,
};
use anyhow::{anyhow, Result};
use npuc_ir::{DType, Model, OpsetImport};

/// Converts `enc` (made for the float model `m`) to QNN-EP conventions and applies it.
pub fn qnn_qdq(m: &Model, enc: &Encodings) -> Result<Model> {
    let mut out = apply(m, &qnn_encodings(m, enc)?)?;
    qnn_domains(&mut out);
    Ok(out)
}

/// `enc` in the form the QNN-EP export writes: unsigned activations (a signed symmetric grid
/// shifted to the mid-range zero point: the same real values), weights per tensor except
/// Conv/ConvTranspose (per output channel), no blocks, and int32 biases recomputed for the new
/// weight scales. Idempotent, so encodings written after the conversion read back (and
/// convert) to the same quantization.
///
/// `npuc compile --emit-qdq` quantizes the artifact itself with these encodings, so the model
/// npuc runs and the one it exports are the same quantization ("what you export is what you
/// run"): comparing the export in onnxruntime with the artifact then measures the runtimes, not
/// two quantizations (ViT-S w8a8, 32 held-out images, vs onnxruntime running the export
/// unoptimized: cosine 0.99895 with the artifact's per-channel MatMul weights, 0.99983 with
/// these).
pub fn qnn_encodings(m: &Model, enc: &Encodings) -> Result<Encodings> {
    let mut e = enc.clone();
    let g = &m.graph;
    // Activations: signed symmetric -> unsigned with the mid-range zero point (same grid).
    for te in e.activations.values_mut() {
        if let TensorEncoding::Int(q) = te {
            let shift = match q.dtype {
                DType::I8 => Some((DType::U8, 128)),
                DType::I16 => Some((DType::U16, 32768)),
                _ => None,
            };
            if let Some((d, s)) = shift {
                q.dtype = d;
                for z in q.zero_point.iter_mut() {
                    *z += s;
                }
            }
        }
    }
    // Weights: per-channel only for Conv/ConvTranspose.
    let mut biases = vec![];
    for n in &g.nodes {
        let Some(w) = n.input(1) else { continue };
        let Some(TensorEncoding::Int(q)) = e.params.get(w).cloned() else {
            continue;
        };
        let wt = g
            .initializer(w)
            .ok_or_else(|| anyhow!("no initializer '{w}'"))?;
        let conv = n.op_type == "Conv" || n.op_type == "ConvTranspose";
        let want_axis = if conv {
            crate::qdq::weight_axes(n, wt.rank()).map(|a| a.0)
        } else {
            None
        };
        if q.scale.len() > 1 && (q.axis != want_axis || q.block_size.is_some())
            || q.scale.len() == 1 && q.block_size.is_some()
        {
            let spec = WeightSpec {
                dtype: q.dtype,
                axis: want_axis,
                block: None,
                lpbq: None,
            };
            e.params.insert(
                w.to_string(),
                TensorEncoding::Int(weight_encoding(wt, &spec, w)?),
            );
        }
        if let (Some(b), Some(x)) = (n.input(2), n.input(0)) {
            if e.params.contains_key(b) {
                biases.push((
                    b.to_string(),
                    BiasSpec {
                        input: x.to_string(),
                        weight: w.to_string(),
                    },
                ));
            }
        }
    }
    for (b, spec) in biases {
        match bias_encoding(g, &e, &b, &spec)? {
            Some(q) => {
                e.params.insert(b, TensorEncoding::Int(q));
            }
            None => {
                e.params.remove(&b);
            }
        }
    }
    Ok(e)
}

/// Moves QuantizeLinear/DequantizeLinear nodes the model's default opset cannot express (16-/4-bit
/// or blocked below opset 21, per-axis below 13) to the `com.microsoft` domain, importing it.
pub fn qnn_domains(out: &mut Model) {
    let opset = out.opset("").unwrap_or(1);
    let inits: std::collections::HashMap<String, DType> = out
        .graph
        .initializers
        .iter()
        .map(|i| (i.name.clone(), i.tensor.dtype()))
        .collect();
    let mut contrib = false;
    for n in out.graph.nodes.iter_mut() {
        if n.op_type != "QuantizeLinear" && n.op_type != "DequantizeLinear" {
            continue;
        }
        let d = n
            .input(2)
            .and_then(|z| inits.get(z))
            .copied()
            .unwrap_or(DType::U8);
        let needs21 = matches!(d, DType::I16 | DType::U16 | DType::I4 | DType::U4)
            || n.attr("block_size").is_some();
        let needs13 = n.attr("axis").is_some();
        if (needs21 && opset < 21) || (needs13 && opset < 13) {
            n.domain = "com.microsoft".into();
            contrib = true;
        }
    }
    if contrib && out.opset("com.microsoft").is_none() {
        out.opset_imports.push(OpsetImport {
            domain: "com.microsoft".into(),
            version: 1,
        });
    }
}

/// The QNN-EP form of one encoding, for tests and `inspect`.
pub fn is_qnn_weight(q: &QEnc) -> bool {
    q.block_size.is_none()
        && matches!(
            q.dtype,
            DType::I8 | DType::U8 | DType::I16 | DType::U16 | DType::I4 | DType::U4 | DType::I32
        )
}
