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

/// Rewrites each blocked weight `DequantizeLinear` (`block_size`, opset 21) of a model whose
/// default opset is below 21 into the same arithmetic in ops its opset has, since neither
/// the standard op before 21 nor onnxruntime's `com.microsoft` DequantizeLinear takes
/// `block_size`: the codes dequantized per tensor with scale 1 (exact integers in f32; the
/// codes stay 4-/8-bit in the file), reshaped so each block is an axis of its own, minus the
/// zero points (when any is non-zero) and times the block scales broadcast over the block,
/// reshaped back. `(q - zp) * s` in f32 either way: the same values as the blocked op.
/// Blocks must divide their axis (ragged last blocks are left as they are). Returns how many
/// were rewritten and the initializers (block scales, zero points) no node reads any more,
/// removed from the model.
pub fn expand_blocked_weights(out: &mut Model) -> Result<(usize, Vec<npuc_ir::Initializer>)> {
    use npuc_ir::{Attr, Initializer, Node, Tensor};
    if out.opset("").unwrap_or(1) >= 21 {
        return Ok((0, vec![]));
    }
    let g = &mut out.graph;
    let mut new_inits: Vec<Initializer> = vec![];
    let mut rewritten = 0;
    let mut replaced: Vec<String> = vec![];
    let mut nodes = Vec::with_capacity(g.nodes.len());
    for n in std::mem::take(&mut g.nodes) {
        let block = match n.attr("block_size") {
            Some(Attr::Int(b)) if n.op_type == "DequantizeLinear" && *b > 0 => *b as usize,
            _ => {
                nodes.push(n);
                continue;
            }
        };
        let (Some(qn), Some(sn)) = (n.input(0), n.input(1)) else {
            nodes.push(n);
            continue;
        };
        let (Some(q), Some(sc)) = (g.initializer(qn), g.initializer(sn)) else {
            nodes.push(n);
            continue;
        };
        let shape = q.shape().to_vec();
        let rank = shape.len() as i64;
        let axis = match n.attr("axis") {
            Some(Attr::Int(a)) => *a,
            _ => 1,
        };
        let axis = if axis < 0 { axis + rank } else { axis };
        if axis < 0 || axis >= rank || shape[axis as usize] % block != 0 {
            nodes.push(n);
            continue;
        }
        let a = axis as usize;
        let zp = n
            .input(2)
            .filter(|z| !z.is_empty())
            .and_then(|z| g.initializer(z));
        let zp_vals = match zp {
            Some(z) => Some(z.to_f64_vec()?),
            None => None,
        };
        let qdt = q.dtype();
        let out_name = n.outputs[0].clone();
        let base = format!("{out_name}_blocks");
        // [.., d_a / B, B, ..] for the codes, [.., d_a / B, 1, ..] for the parameters.
        let mut split: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        split[a] = (shape[a] / block) as i64;
        split.insert(a + 1, block as i64);
        let mut pshape: Vec<usize> = split.iter().map(|&d| d as usize).collect();
        pshape[a + 1] = 1;
        let scale = Tensor::from_vec(
            pshape.clone(),
            sc.as_slice::<f32>()
                .map_err(|e| anyhow!("block scales '{sn}': {e}"))?
                .to_vec(),
        )?;
        let names = |s: &str| format!("{base}_{s}");
        new_inits.push(Initializer {
            name: names("unit_scale"),
            tensor: Tensor::scalar(1.0f32),
        });
        new_inits.push(Initializer {
            name: names("zero"),
            tensor: crate::qdq::int_tensor(qdt, vec![], &[0])?,
        });
        new_inits.push(Initializer {
            name: names("split_shape"),
            tensor: Tensor::from_vec(vec![split.len()], split)?,
        });
        new_inits.push(Initializer {
            name: names("shape"),
            tensor: Tensor::from_vec(vec![shape.len()], shape.iter().map(|&d| d as i64).collect())?,
        });
        new_inits.push(Initializer {
            name: names("scale"),
            tensor: scale,
        });
        let node = |op: &str, ins: &[&str], o: &str| {
            let mut nd = Node::new(op, ins, &[o]);
            nd.name = format!("{o}/{op}");
            nd
        };
        nodes.push(node(
            "DequantizeLinear",
            &[qn, &names("unit_scale"), &names("zero")],
            &names("codes"),
        ));
        nodes.push(node(
            "Reshape",
            &[&names("codes"), &names("split_shape")],
            &names("split"),
        ));
        let mut x = names("split");
        if let Some(z) = zp_vals.filter(|z| z.iter().any(|&v| v != 0.0)) {
            new_inits.push(Initializer {
                name: names("zero_points"),
                tensor: Tensor::from_vec(pshape, z.iter().map(|&v| v as f32).collect())?,
            });
            nodes.push(node(
                "Sub",
                &[&x, &names("zero_points")],
                &names("centered"),
            ));
            x = names("centered");
        }
        nodes.push(node("Mul", &[&x, &names("scale")], &names("scaled")));
        nodes.push(node(
            "Reshape",
            &[&names("scaled"), &names("shape")],
            &out_name,
        ));
        replaced.extend(n.inputs[1..].iter().filter(|i| !i.is_empty()).cloned());
        rewritten += 1;
    }
    g.nodes = nodes;
    g.initializers.extend(new_inits);
    // The block scales and zero points the rewritten nodes read, unless something else does.
    let used: std::collections::HashSet<&str> = g
        .nodes
        .iter()
        .flat_map(|n| n.inputs.iter().map(String::as_str))
        .chain(g.outputs.iter().map(|o| o.name.as_str()))
        .collect();
    let unused: std::collections::HashSet<String> = replaced
        .into_iter()
        .filter(|r| !used.contains(r.as_str()))
        .collect();
    let (gone, kept): (Vec<Initializer>, Vec<Initializer>) = std::mem::take(&mut g.initializers)
        .into_iter()
        .partition(|i| unused.contains(&i.name));
    g.initializers = kept;
    Ok((rewritten, gone))
}

/// The QNN-EP form of one encoding, for tests and `inspect`.
pub fn is_qnn_weight(q: &QEnc) -> bool {
    q.block_size.is_none()
        && matches!(
            q.dtype,
            DType::I8 | DType::U8 | DType::I16 | DType::U16 | DType::I4 | DType::U4 | DType::I32
        )
}
