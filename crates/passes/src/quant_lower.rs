//! `quant-lower`: rewrites quantized matrix products of ONNX QDQ graphs into integer ops.
//!
//! Pattern (ONNX Runtime's QDQ form, what `quantize_static(quant_format=QDQ)` writes):
//!
//! ```text
//! DQ(x_q, sx, zx) ─┐
//! DQ(w_q, sw, zw) ─┼─► MatMul | Gemm ─► [Relu | Clip] ─► [Q(sy, zy)] ─► y
//! [DQ(b_i32, sb)] ─┘   (Gemm only)
//! ```
//!
//! becomes one `npuc.QMatMul(x_q, sx, zx, w_q, sw, zw, bias, sy, zy)` (see
//! `npuc_runtime::ops::qlinear`) computing the product exactly in integers, with the
//! activation and the requantization fused; without a trailing Q the op dequantizes to f32.
//! `w` may be a constant weight (per-tensor, or per-column along the output-channel axis) or
//! another quantized activation with per-tensor parameters (attention's `Q K^T` and `P V`).
//!
//! Everything else keeps its Q/DQ nodes and runs in float ("simulate"). The results agree with
//! running the QDQ graph in float to within one quantization step of the output (the integer
//! sum is exact; only the float rounding of the simulated product differs).
//!
//! This pass is not part of the default pipeline (`optimize` keeps QDQ graphs as written, and
//! artifacts store them that way); [`lower_quantized`] applies it when a graph is loaded to run.

use crate::passes::dce::Dce;
use crate::util::{import_npuc, is_op, Index};
use crate::{Pass, PassError, PassStats};
use npuc_ir::{Attr, DType, Graph, Model, Node};
use std::collections::HashSet;

/// The `quant-lower` pass.
pub struct QuantLower;

/// Lowers every matching quantized product of `model`'s main graph to `npuc.QMatMul` and
/// removes the Q/DQ nodes nothing reads any more. Returns the number of products lowered.
pub fn lower_quantized(model: &mut Model) -> Result<usize, PassError> {
    let (products, qdq) = QuantLower.lower(model)?;
    if products + qdq > 0 {
        Dce.run(model)?;
    }
    Ok(products)
}

/// Whether the model holds any QuantizeLinear/DequantizeLinear node (a QDQ graph).
pub fn has_qdq(model: &Model) -> bool {
    model.graph.nodes.iter().any(|n| {
        (n.domain.is_empty() || n.domain == "com.microsoft")
            && matches!(n.op_type.as_str(), "QuantizeLinear" | "DequantizeLinear")
    })
}

/// A matched DequantizeLinear feeding the product.
struct Dq {
    q: String,
    scale: String,
    zp: String,
}

fn attr_int(n: &Node, name: &str, default: i64) -> i64 {
    match n.attr(name) {
        Some(Attr::Int(i)) => *i,
        _ => default,
    }
}

fn attr_float(n: &Node, name: &str, default: f32) -> f32 {
    match n.attr(name) {
        Some(Attr::Float(f)) => *f,
        _ => default,
    }
}

impl QuantLower {
    /// The DQ producing `name` when it is a plain (not blocked) f32 dequantization with
    /// constant parameters; its scale must be per-tensor unless `per_axis` allows an axis.
    fn dq(&self, g: &Graph, ix: &Index, name: &str, per_axis: Option<(usize, i64)>) -> Option<Dq> {
        let (_, n) = ix.prod(g, name)?;
        if !is_op(n, "DequantizeLinear") || n.outputs.len() != 1 {
            return None;
        }
        if attr_int(n, "block_size", 0) != 0 {
            return None;
        }
        let q = n.input(0)?.to_string();
        let scale = n.input(1)?.to_string();
        let zp = n.input(2).unwrap_or("").to_string();
        let st = ix.constant(g, &scale)?;
        if st.dtype() != DType::F32 {
            return None;
        }
        if !zp.is_empty() && !ix.is_const(g, &zp) {
            return None;
        }
        if st.len() != 1 {
            let (rank, want_axis) = per_axis?;
            let axis = attr_int(n, "axis", 1);
            let axis = if axis < 0 { axis + rank as i64 } else { axis };
            if st.rank() != 1 || axis != want_axis {
                return None;
            }
        }
        Some(Dq { q, scale, zp })
    }

    /// Integer dtype of a DQ's quantized input: the zero point's, else the constant's.
    fn qtype(&self, g: &Graph, ix: &Index, d: &Dq) -> Option<DType> {
        if !d.zp.is_empty() {
            return ix.constant(g, &d.zp).map(|t| t.dtype());
        }
        ix.constant(g, &d.q).map(|t| t.dtype())
    }
}

/// A fusion decided while scanning (applied after the scan so indices stay valid).
struct Edit {
    product: usize,
    remove: Vec<usize>,
    node: Node,
}

impl Pass for QuantLower {
    fn name(&self) -> &'static str {
        "quant-lower"
    }

    fn run(&self, m: &mut Model) -> Result<PassStats, PassError> {
        let (products, qdq) = self.lower(m)?;
        Ok(PassStats::new(products + qdq))
    }
}

impl QuantLower {
    /// Lowers products, then switches the remaining per-tensor f32 Q/DQ nodes to the
    /// runtime's direct f32 kernels (`npuc.Quantize`/`npuc.Dequantize`, same results).
    /// Returns (products lowered, Q/DQ nodes switched).
    fn lower(&self, m: &mut Model) -> Result<(usize, usize), PassError> {
        if !has_qdq(m) {
            return Ok((0, 0));
        }
        let products = self.lower_products(m)?;
        let g = &m.graph;
        let ix = Index::new(g);
        let mut switch = vec![];
        for (i, n) in g.nodes.iter().enumerate() {
            let q = is_op(n, "QuantizeLinear");
            if !(q || is_op(n, "DequantizeLinear"))
                || n.outputs.len() != 1
                || n.attrs
                    .iter()
                    .any(|(a, _)| a == "block_size" || a == "output_dtype")
            {
                continue;
            }
            let scale_ok = n
                .input(1)
                .and_then(|s| ix.constant(g, s))
                .is_some_and(|t| t.len() == 1 && t.dtype() == DType::F32);
            let zp = n.input(2).unwrap_or("");
            let small_int = |t: &npuc_ir::Tensor| {
                matches!(t.dtype(), DType::U8 | DType::I8 | DType::U16 | DType::I16)
            };
            let zp_ok = if zp.is_empty() {
                // Without a zero point the input's type is known only for constants.
                !q && n
                    .input(0)
                    .and_then(|x| ix.constant(g, x))
                    .is_some_and(|t| small_int(&t))
            } else {
                ix.constant(g, zp)
                    .is_some_and(|t| t.len() == 1 && small_int(&t))
            };
            if scale_ok && zp_ok {
                switch.push((i, q));
            }
        }
        let squares: Vec<usize> = g
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| {
                is_op(n, "Pow")
                    && n.inputs.len() == 2
                    && n.input(1).and_then(|e| ix.constant(g, e)).is_some_and(|t| {
                        t.dtype() == DType::F32
                            && t.len() == 1
                            && t.to_f64_vec().is_ok_and(|v| v[0] == 2.0)
                    })
            })
            .map(|(i, _)| i)
            .collect();
        if !switch.is_empty() {
            import_npuc(m);
        }
        // `Pow(x, 2)` (decomposed LayerNorm's variance, between Q/DQ pairs that keep the
        // layernorm fusion from matching) becomes `Mul(x, x)`: the correctly rounded square,
        // without a libm `powf` per element.
        for &i in &squares {
            let n = &mut m.graph.nodes[i];
            n.op_type = "Mul".into();
            n.inputs[1] = n.inputs[0].clone();
        }
        for &(i, q) in &switch {
            let n = &mut m.graph.nodes[i];
            n.domain = "npuc".into();
            n.op_type = if q { "Quantize" } else { "Dequantize" }.into();
            n.attrs.retain(|(a, _)| a != "axis" && a != "saturate");
        }
        Ok((products, switch.len() + squares.len()))
    }

    fn lower_products(&self, m: &mut Model) -> Result<usize, PassError> {
        let g = &m.graph;
        let ix = Index::new(g);
        let mut edits: Vec<Edit> = vec![];
        let mut used: HashSet<usize> = HashSet::new();
        for (pi, p) in g.nodes.iter().enumerate() {
            let gemm = is_op(p, "Gemm");
            if !(is_op(p, "MatMul") || gemm) || p.outputs.len() != 1 {
                continue;
            }
            let trans_b = gemm && attr_int(p, "transB", 0) != 0;
            if gemm
                && (attr_int(p, "transA", 0) != 0
                    || attr_float(p, "alpha", 1.0) != 1.0
                    || attr_float(p, "beta", 1.0) != 1.0)
            {
                continue;
            }
            let (Some(xn), Some(wn)) = (p.input(0), p.input(1)) else {
                continue;
            };
            let Some(x) = self.dq(g, &ix, xn, None) else {
                continue;
            };
            let Some(xt) = self.qtype(g, &ix, &x) else {
                continue;
            };
            if !matches!(xt, DType::U8 | DType::I8 | DType::U16 | DType::I16) {
                continue;
            }
            // A constant weight may be per-column: axis 1 of [K, N], axis 0 of Gemm's [N, K]^T.
            let w_const = ix
                .prod(g, wn)
                .and_then(|(_, d)| d.input(0))
                .is_some_and(|q| ix.is_const(g, q));
            let axis = if trans_b { 0 } else { 1 };
            let Some(w) = self.dq(g, &ix, wn, w_const.then_some((2, axis))) else {
                continue;
            };
            let Some(wt) = self.qtype(g, &ix, &w) else {
                continue;
            };
            if w_const {
                let Some(wq) = ix.constant(g, &w.q) else {
                    continue;
                };
                if wq.rank() != 2
                    || !matches!(wq.dtype(), DType::U8 | DType::I8 | DType::U4 | DType::I4)
                {
                    continue;
                }
            } else if !matches!(wt, DType::U8 | DType::I8) || gemm {
                continue;
            }
            // Gemm's bias: any float tensor of N values (typically DQ of an int32 constant).
            let bias = if gemm {
                p.input(2).unwrap_or("").to_string()
            } else {
                String::new()
            };
            if !bias.is_empty() {
                let n_out =
                    ix.constant(g, &w.q)
                        .map(|t| if trans_b { t.shape()[0] } else { t.shape()[1] });
                let bias_len = match ix.prod(g, &bias) {
                    Some((_, d)) if is_op(d, "DequantizeLinear") => {
                        d.input(0).and_then(|b| ix.constant(g, b)).map(|t| t.len())
                    }
                    _ => ix.constant(g, &bias).map(|t| t.len()),
                };
                if bias_len.is_none() || bias_len != n_out {
                    continue;
                }
            }
            // The consumer chain: [Relu | Clip] then [Q], each the only reader of its input.
            let mut out = p.outputs[0].clone();
            let mut remove = vec![];
            let mut clip: (Option<f32>, Option<f32>) = (None, None);
            if let Some(ui) = ix.sole_user(&out) {
                let u = &g.nodes[ui];
                let act = if is_op(u, "Relu") {
                    Some((Some(0.0), None))
                } else if is_op(u, "Clip") {
                    let bound = |i: usize| -> Option<Option<f32>> {
                        match u.input(i) {
                            None | Some("") => Some(None),
                            Some(name) => ix.const_scalar(g, name).map(|v| Some(v as f32)),
                        }
                    };
                    // Opset < 11 Clip keeps its bounds in attributes.
                    if u.inputs.len() == 1 && (u.attr("min").is_some() || u.attr("max").is_some()) {
                        Some((
                            u.attr("min").map(|_| attr_float(u, "min", f32::MIN)),
                            u.attr("max").map(|_| attr_float(u, "max", f32::MAX)),
                        ))
                    } else {
                        match (bound(1), bound(2)) {
                            (Some(lo), Some(hi)) => Some((lo, hi)),
                            _ => None,
                        }
                    }
                } else {
                    None
                };
                if let Some(a) = act {
                    if u.outputs.len() == 1 && !used.contains(&ui) {
                        clip = a;
                        remove.push(ui);
                        out = u.outputs[0].clone();
                    }
                }
            }
            let mut ys = String::new();
            let mut yz = String::new();
            if let Some(qi) = ix.sole_user(&out) {
                let q = &g.nodes[qi];
                if is_op(q, "QuantizeLinear")
                    && q.outputs.len() == 1
                    && attr_int(q, "block_size", 0) == 0
                    && !used.contains(&qi)
                {
                    let s = q.input(1).unwrap_or("");
                    let z = q.input(2).unwrap_or("");
                    let ok = ix
                        .constant(g, s)
                        .is_some_and(|t| t.len() == 1 && t.dtype() == DType::F32)
                        && ix.constant(g, z).is_some_and(|t| {
                            t.len() == 1
                                && matches!(
                                    t.dtype(),
                                    DType::U8 | DType::I8 | DType::U16 | DType::I16
                                )
                        });
                    if ok {
                        ys = s.to_string();
                        yz = z.to_string();
                        remove.push(qi);
                        out = q.outputs[0].clone();
                    }
                }
            }
            let mut node = Node::new(
                "QMatMul",
                &[
                    &x.q, &x.scale, &x.zp, &w.q, &w.scale, &w.zp, &bias, &ys, &yz,
                ],
                &[&out],
            );
            node.domain = "npuc".into();
            node.name = if p.name.is_empty() {
                String::new()
            } else {
                format!("{}_quant", p.name)
            };
            if trans_b {
                node = node.with_attr("trans_b", Attr::Int(1));
            }
            if let Some(lo) = clip.0 {
                node = node.with_attr("clip_min", Attr::Float(lo));
            }
            if let Some(hi) = clip.1 {
                node = node.with_attr("clip_max", Attr::Float(hi));
            }
            used.insert(pi);
            used.extend(remove.iter().copied());
            edits.push(Edit {
                product: pi,
                remove,
                node,
            });
        }
        if edits.is_empty() {
            return Ok(0);
        }
        let n = edits.len();
        import_npuc(m);
        let g = &mut m.graph;
        let mut dead = HashSet::new();
        for e in edits {
            g.nodes[e.product] = e.node;
            dead.extend(e.remove);
        }
        crate::util::remove_nodes(g, &dead);
        Ok(n)
    }
}
