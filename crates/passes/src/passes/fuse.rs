//! Fusions into the `npuc` fused ops (see `npuc_runtime::ops::fused`):
//!
//! - [`MatMulBiasFusion`]: `Add(MatMul(A, W), c)` with `W` a 2-D float weight `[K, N]` (a
//!   constant, or computed from constants only, e.g. int8 codes through `Cast` + `Mul`)
//!   and `c` a constant of `N` values along the last axis (whose rank does not exceed the
//!   product's, so broadcasting cannot change the shape) becomes `FusedMatMul(A, W, c)`.
//! - [`ActivationFusion`]: an activation reading the only output of Conv / Gemm / MatMul /
//!   FusedMatMul (and nothing else reading that output) is applied inside the product's
//!   kernel: Relu, Sigmoid, Tanh, LeakyRelu, Clip (constant bounds), HardSigmoid, HardSwish,
//!   Gelu (exact and tanh forms), and the decomposed `x * HardSigmoid(x)` (HardSwish with the
//!   HardSigmoid's alpha/beta) and `x * Sigmoid(x)` (Swish). The fused kernel computes the
//!   same function of the same product.
//! - [`BinaryActivationFusion`]: an f32 Add / Sub / Mul / Div whose output only an activation
//!   reads becomes `FusedBinary(A, B)` (attribute `op`, plus the activation attributes): each
//!   stretch of output gets the activation while it is in cache, instead of a second pass over
//!   a tensor that left it (text2tashkeel's additive attention: `Tanh(q + k)` over 32 x 32 x
//!   512 values). Not next to Q/DQ nodes, whose patterns the quantized lowering matches; run
//!   once after the fixed point of the other passes (`PassManager::add_late`).

use crate::util::{fixed_shape, is_op, Index};
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};
use npuc_ir::infer::{infer_model, InferResult};
use npuc_ir::{Attr, DType, Graph, Node, TypeInfo};
use std::collections::HashMap;

/// A matched activation: (op name, its float parameters), the nodes it replaces, and the
/// output value the fused node takes over.
type FusedActivation<'a> = ((&'a str, Vec<f32>), Vec<usize>, String);

pub struct MatMulBiasFusion;
pub struct ActivationFusion;
pub struct BinaryActivationFusion;

fn dtype_of(r: &InferResult, name: &str) -> Option<DType> {
    match r.type_of(name)? {
        TypeInfo::Tensor { dtype, .. } => *dtype,
        _ => None,
    }
}

fn rank_of(r: &InferResult, name: &str) -> Option<usize> {
    match r.type_of(name)? {
        TypeInfo::Tensor { shape: Some(s), .. } => Some(s.len()),
        _ => None,
    }
}

impl Pass for MatMulBiasFusion {
    fn name(&self) -> &'static str {
        "matmul-bias-fusion"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let m = rw.model();
        if !m.graph.nodes.iter().any(|n| is_op(n, "MatMul")) {
            return Ok(PassStats::default());
        }
        let r = infer_model(m, &HashMap::new());
        let g = &m.graph;
        let ix = Index::new(g);
        let mut patch = GraphPatch::new();
        let mut fused = 0;
        for (i, n) in g.nodes.iter().enumerate() {
            if !is_op(n, "MatMul") || n.inputs.len() != 2 || n.outputs.len() != 1 {
                continue;
            }
            let y = &n.outputs[0];
            // The weight: a constant, or computed from constants only (the runtime computes it
            // once per plan), with a 2-D float type known from inference.
            let Some(wname) = n.input(1) else { continue };
            let (w_dtype, nn) = match ix.constant(g, wname) {
                Some(w) if w.rank() == 2 => (w.dtype(), w.shape()[1]),
                Some(_) => continue,
                None if ix.is_const_derived(g, wname) => match fixed_shape(&r, wname) {
                    Some((dt, s)) if s.len() == 2 => (dt, s[1]),
                    _ => continue,
                },
                None => continue,
            };
            if !matches!(w_dtype, DType::F32 | DType::F64) {
                continue;
            }
            let Some(ui) = ix.sole_user(y) else { continue };
            let u = &g.nodes[ui];
            if !is_op(u, "Add") || u.outputs.len() != 1 {
                continue;
            }
            let Some(c) = crate::util::other_input(u, y) else {
                continue;
            };
            let Some(ct) = ix.constant(g, c) else {
                continue;
            };
            let out_rank = rank_of(&r, y);
            let rank_ok = ct.rank() <= 1 || out_rank.is_some_and(|k| ct.rank() <= k);
            if ct.dtype() != w_dtype
                || ct.len() != nn
                || ct.shape().last() != Some(&nn)
                || !rank_ok
                || dtype_of(&r, y) != Some(w_dtype)
            {
                continue;
            }
            let mut f = Node::new("FusedMatMul", &[], &[]);
            f.name = n.name.clone();
            f.domain = "npuc".into();
            f.inputs = vec![n.inputs[0].clone(), n.inputs[1].clone(), c.to_string()];
            f.outputs = u.outputs.clone();
            if patch.fuse(i, f, &[ui]) {
                fused += 1;
            }
        }
        if fused > 0 {
            patch.import_domain("npuc");
        }
        rw.apply(patch);
        Ok(PassStats::new(fused))
    }
}

/// Sets a fused op's activation attributes (`activation`, and `activation_params` when any).
fn push_activation(f: &mut Node, act: &str, params: Vec<f32>) {
    f.attrs
        .push(("activation".into(), Attr::String(act.into())));
    if !params.is_empty() {
        f.attrs
            .push(("activation_params".into(), Attr::Floats(params)));
    }
}

/// The activation an op computes, as fused-op attributes (name, params), when supported.
fn activation_of(g: &Graph, ix: &Index, u: &Node) -> Option<(&'static str, Vec<f32>)> {
    if u.domain == "npuc" && u.op_type == "Gelu" || is_op(u, "Gelu") {
        return match u.str_or("approximate", "none").ok()? {
            "none" => Some(("Gelu", vec![])),
            "tanh" => Some(("GeluTanh", vec![])),
            _ => None,
        };
    }
    if !u.domain.is_empty() || u.outputs.len() != 1 {
        return None;
    }
    Some(match u.op_type.as_str() {
        "Relu" => ("Relu", vec![]),
        "Sigmoid" => ("Sigmoid", vec![]),
        "Tanh" => ("Tanh", vec![]),
        "LeakyRelu" => ("LeakyRelu", vec![u.float_or("alpha", 0.01).ok()?]),
        "HardSigmoid" => (
            "HardSigmoid",
            vec![
                u.float_or("alpha", 0.2).ok()?,
                u.float_or("beta", 0.5).ok()?,
            ],
        ),
        "HardSwish" => ("HardSwish", vec![1.0 / 6.0, 0.5]),
        "Clip" => {
            let bound = |k: usize, attr: &str, def: f32| -> Option<f32> {
                if let Some(a) = u.attr_float(attr).ok()? {
                    return Some(a);
                }
                match u.input(k) {
                    None => Some(def),
                    Some(s) => ix.const_scalar(g, s).map(|v| v as f32),
                }
            };
            (
                "Clip",
                vec![
                    bound(1, "min", f32::NEG_INFINITY)?,
                    bound(2, "max", f32::INFINITY)?,
                ],
            )
        }
        _ => return None,
    })
}

impl Pass for ActivationFusion {
    fn name(&self) -> &'static str {
        "activation-fusion"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let base = |n: &Node| {
            (n.domain.is_empty() && ["Conv", "Gemm", "MatMul"].contains(&n.op_type.as_str()))
                || (n.domain == "npuc"
                    && n.op_type == "FusedMatMul"
                    && n.attr("activation").is_none())
        };
        let m = rw.model();
        if !m.graph.nodes.iter().any(base) {
            return Ok(PassStats::default());
        }
        let r = infer_model(m, &HashMap::new());
        let g = &m.graph;
        let ix = Index::new(g);
        let mut patch = GraphPatch::new();
        let mut fused = 0;
        for (i, n) in g.nodes.iter().enumerate() {
            if !base(n) || n.outputs.len() != 1 {
                continue;
            }
            let y = &n.outputs[0];
            let dt = dtype_of(&r, y).or_else(|| n.input(0).and_then(|a| dtype_of(&r, a)));
            if !ix.is_internal(y) || !matches!(dt, Some(DType::F32 | DType::F64)) {
                continue;
            }
            let users = ix.users(y);
            let found: Option<FusedActivation> = match users {
                [u] => {
                    let un = &g.nodes[*u];
                    if un.input(0) != Some(y.as_str()) {
                        None
                    } else {
                        activation_of(g, &ix, un).map(|a| (a, vec![*u], un.outputs[0].clone()))
                    }
                }
                [a, b] => {
                    // x * HardSigmoid(x) or x * Sigmoid(x), in either node order.
                    let (gate, mul) = if is_op(&g.nodes[*b], "Mul") {
                        (*a, *b)
                    } else {
                        (*b, *a)
                    };
                    let (gn, mn) = (&g.nodes[gate], &g.nodes[mul]);
                    let gout = gn.outputs.first().cloned().unwrap_or_default();
                    let ok = is_op(mn, "Mul")
                        && gn.input(0) == Some(y.as_str())
                        && gn.outputs.len() == 1
                        && ix.sole_user(&gout) == Some(mul)
                        && crate::util::other_input(mn, &gout) == Some(y.as_str())
                        && mn.outputs.len() == 1;
                    if !ok {
                        None
                    } else if is_op(gn, "HardSigmoid") {
                        let (Ok(al), Ok(be)) =
                            (gn.float_or("alpha", 0.2), gn.float_or("beta", 0.5))
                        else {
                            continue;
                        };
                        Some((
                            ("HardSwish", vec![al, be]),
                            vec![gate, mul],
                            mn.outputs[0].clone(),
                        ))
                    } else if is_op(gn, "Sigmoid") {
                        Some((("Swish", vec![]), vec![gate, mul], mn.outputs[0].clone()))
                    } else {
                        None
                    }
                }
                _ => None,
            };
            let Some(((act, params), gone, out)) = found else {
                continue;
            };
            let mut f = n.clone();
            f.domain = "npuc".into();
            f.op_type = match n.op_type.as_str() {
                "Conv" => "FusedConv",
                "Gemm" => "FusedGemm",
                _ => "FusedMatMul",
            }
            .into();
            push_activation(&mut f, act, params);
            f.outputs = vec![out];
            if patch.fuse(i, f, &gone) {
                fused += 1;
            }
        }
        if fused > 0 {
            patch.import_domain("npuc");
        }
        rw.apply(patch);
        Ok(PassStats::new(fused))
    }
}

impl Pass for BinaryActivationFusion {
    fn name(&self) -> &'static str {
        "binary-activation-fusion"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        const OPS: [&str; 4] = ["Add", "Sub", "Mul", "Div"];
        let base = |n: &Node| n.domain.is_empty() && OPS.contains(&n.op_type.as_str());
        let m = rw.model();
        if !m.graph.nodes.iter().any(base) {
            return Ok(PassStats::default());
        }
        let r = infer_model(m, &HashMap::new());
        let g = &m.graph;
        let ix = Index::new(g);
        let qdq = |n: &Node| is_op(n, "QuantizeLinear") || is_op(n, "DequantizeLinear");
        let mut patch = GraphPatch::new();
        let mut fused = 0;
        for (i, n) in g.nodes.iter().enumerate() {
            if !base(n) || n.inputs.len() != 2 || n.outputs.len() != 1 {
                continue;
            }
            let y = &n.outputs[0];
            if !ix.is_internal(y) || dtype_of(&r, y) != Some(DType::F32) {
                continue;
            }
            let from_dq = n
                .inputs
                .iter()
                .any(|x| ix.prod(g, x).is_some_and(|(_, p)| qdq(p)));
            let Some(ui) = ix.sole_user(y) else { continue };
            let un = &g.nodes[ui];
            if from_dq || un.input(0) != Some(y.as_str()) {
                continue;
            }
            let Some((act, params)) = activation_of(g, &ix, un) else {
                continue;
            };
            let out = &un.outputs[0];
            if ix.users(out).iter().any(|&k| qdq(&g.nodes[k])) {
                continue;
            }
            let mut f = Node::new("FusedBinary", &[], &[]);
            f.name = n.name.clone();
            f.domain = "npuc".into();
            f.inputs = n.inputs.clone();
            f.outputs = vec![out.clone()];
            f.attrs.push(("op".into(), Attr::String(n.op_type.clone())));
            push_activation(&mut f, act, params);
            if patch.fuse(i, f, &[ui]) {
                fused += 1;
            }
        }
        if fused > 0 {
            patch.import_domain("npuc");
        }
        rw.apply(patch);
        Ok(PassStats::new(fused))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;

    #[test]
    fn matmul_bias_then_gelu_and_conv_hardswish() {
        let mut m = model(
            vec![
                Node::new("MatMul", &["x", "w"], &["mm"]),
                Node::new("Add", &["b", "mm"], &["h"]),
                Node::new("Relu", &["h"], &["y"]),
                Node::new("Conv", &["img", "cw"], &["c"]),
                Node::new("HardSigmoid", &["c"], &["hs"])
                    .with_attr("alpha", Attr::Float(1.0 / 6.0)),
                Node::new("Mul", &["hs", "c"], &["z"]),
            ],
            &[("x", &[2, 3, 4]), ("img", &[1, 2, 4, 4])],
            &["y", "z"],
        );
        m.graph.initializers.push(init("w", data(&[4, 5], 1)));
        m.graph.initializers.push(init("b", data(&[5], 2)));
        m.graph
            .initializers
            .push(init("cw", data(&[3, 2, 1, 1], 3)));
        let feeds = [("x", data(&[2, 3, 4], 4)), ("img", data(&[1, 2, 4, 4], 5))];
        let (m1, n1) = check_pass(&MatMulBiasFusion, &m, &feeds);
        assert_eq!(n1, 1);
        let (m2, n2) = check_pass(&ActivationFusion, &m1, &feeds);
        assert_eq!(n2, 2);
        assert_eq!(ops(&m2), ["FusedMatMul", "FusedConv"]);
    }

    /// Binary ops whose only reader is an activation become `FusedBinary` (broadcast and
    /// equal shapes, with activation parameters); one whose output is also a graph output,
    /// one fed by a DequantizeLinear and one read by two nodes stay as they are.
    #[test]
    fn binary_then_activation() {
        let mut m = model(
            vec![
                Node::new("Add", &["q", "k"], &["s"]),
                Node::new("Tanh", &["s"], &["y"]),
                Node::new("Sub", &["y", "e"], &["d"]),
                Node::new("Clip", &["d", "lo", "hi"], &["z"]),
                Node::new("Mul", &["z", "e"], &["p"]),
                Node::new("Relu", &["p"], &["r"]),
                Node::new("DequantizeLinear", &["c8", "cs"], &["c"]),
                Node::new("Div", &["c", "r"], &["v"]),
                Node::new("Sigmoid", &["v"], &["w"]),
                Node::new("Add", &["w", "e"], &["u"]),
                Node::new("Relu", &["u"], &["u1"]),
                Node::new("Neg", &["u"], &["u2"]),
            ],
            &[
                ("q", &[1, 4, 1, 8]),
                ("k", &[1, 1, 4, 8]),
                ("e", &[1, 4, 4, 8]),
            ],
            &["z", "p", "u1", "u2"],
        );
        let c8: Vec<u8> = (0..8).map(|i| i * 29 + 3).collect();
        m.graph
            .initializers
            .push(init("c8", npuc_ir::Tensor::from_vec(vec![8], c8).unwrap()));
        m.graph.initializers.push(init("cs", f32s(&[], &[0.02])));
        m.graph.initializers.push(init("lo", f32s(&[], &[-0.5])));
        m.graph.initializers.push(init("hi", f32s(&[], &[0.25])));
        let feeds = [
            ("q", data(&[1, 4, 1, 8], 1)),
            ("k", data(&[1, 1, 4, 8], 2)),
            ("e", data(&[1, 4, 4, 8], 3)),
        ];
        let (m1, n1) = check_pass(&BinaryActivationFusion, &m, &feeds);
        assert_eq!(n1, 2);
        assert_eq!(
            ops(&m1),
            [
                "FusedBinary",
                "FusedBinary",
                "Mul",
                "Relu",
                "DequantizeLinear",
                "Div",
                "Sigmoid",
                "Add",
                "Relu",
                "Neg"
            ]
        );
        let clip = &m1.graph.nodes[1];
        assert_eq!(clip.str_or("op", "").unwrap(), "Sub");
        assert_eq!(clip.str_or("activation", "").unwrap(), "Clip");
        assert_eq!(
            clip.attr_floats("activation_params").unwrap(),
            Some(&[-0.5f32, 0.25][..])
        );
    }

    /// A weight stored as int8 and scaled at run time (`Cast` + `Mul`, as PP-OCRv6 rec's
    /// 80 x 6906 head, too large for the folding budget) still takes its bias; a weight
    /// computed from a graph input does not.
    #[test]
    fn matmul_bias_with_a_weight_derived_from_constants() {
        let q: Vec<i8> = (0..20).map(|i| (i * 37 % 255 - 127) as i8).collect();
        let mut m = model(
            vec![
                Node::new("Cast", &["wq"], &["wf"]).with_attr("to", Attr::Int(1)),
                Node::new("Mul", &["wf", "ws"], &["w"]),
                Node::new("MatMul", &["x", "w"], &["mm"]),
                Node::new("Add", &["mm", "b"], &["y"]),
                Node::new("Mul", &["wf", "x2"], &["w2"]),
                Node::new("MatMul", &["x", "w2"], &["mm2"]),
                Node::new("Add", &["mm2", "b"], &["z"]),
            ],
            &[("x", &[2, 3, 4]), ("x2", &[4, 5])],
            &["y", "z"],
        );
        m.graph.initializers.push(init(
            "wq",
            npuc_ir::Tensor::from_vec(vec![4, 5], q).unwrap(),
        ));
        m.graph.initializers.push(init("ws", data(&[5], 6)));
        m.graph.initializers.push(init("b", data(&[5], 2)));
        let feeds = [("x", data(&[2, 3, 4], 4)), ("x2", data(&[4, 5], 7))];
        let (m1, n1) = check_pass(&MatMulBiasFusion, &m, &feeds);
        assert_eq!(n1, 1);
        assert_eq!(
            ops(&m1),
            ["Cast", "Mul", "FusedMatMul", "Mul", "MatMul", "Add"]
        );
    }
}
