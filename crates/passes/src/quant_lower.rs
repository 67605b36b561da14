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
use crate::util::{is_op, Index};
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};
use npuc_ir::opdef::NodeBuilder;
use npuc_ir::{Attr, DType, Graph, Model, Node};
use npuc_runtime::kernels::idwconv;
use npuc_runtime::ops::blockmm::{self, BLOCK_MATMUL};
use npuc_runtime::ops::qconv::QCONV;
use npuc_runtime::ops::qlinear::{QCONV_TRANSPOSE, QLUT, QMATMUL};
use npuc_runtime::ops::qsoftmax::QSOFTMAX;
use std::collections::HashSet;

/// The `quant-lower` pass.
pub struct QuantLower;

/// Lowers every matching quantized product of `model`'s main graph to `npuc.QMatMul` and
/// removes the Q/DQ nodes nothing reads any more. Returns the number of products lowered.
pub fn lower_quantized(model: &mut Model) -> Result<usize, PassError> {
    lower_with(model, true)
}

/// [`lower_quantized`] without the lookup-table regions: every float op between a
/// DequantizeLinear and a QuantizeLinear stays, so each layer's output still exists under its
/// name (what `npuc verify` compares layer by layer).
pub fn lower_quantized_keep_layers(model: &mut Model) -> Result<usize, PassError> {
    lower_with(model, false)
}

/// A lowered node from its op definition; a contract violation is this pass's error.
fn built(node: NodeBuilder) -> Result<Node, PassError> {
    node.build().map_err(|e| PassError::Graph {
        pass: "quant-lower".into(),
        msg: e.to_string(),
    })
}

fn lower_with(model: &mut Model, luts: bool) -> Result<usize, PassError> {
    // Makes the `npuc` op definitions known to inference (see `crate::optimize`).
    npuc_runtime::registry();
    let name = QuantLower.name();
    crate::run_verified(name, model, crate::verify_by_default(), |rw| {
        let (products, qdq) = QuantLower.lower(rw, luts)?;
        if products + qdq > 0 {
            Dce.run(rw)?;
        }
        Ok(products)
    })
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

/// Applies the lowerings planned in `patch` (`count` of them; the npuc domain is imported
/// when there is any) and returns `count`.
fn apply_lowered(rw: &mut Rewriter<'_>, mut patch: GraphPatch, count: usize) -> usize {
    if count > 0 {
        patch.import_domain("npuc");
        rw.apply(patch);
    }
    count
}

impl Pass for QuantLower {
    fn name(&self) -> &'static str {
        "quant-lower"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let (products, qdq) = self.lower(rw, true)?;
        Ok(PassStats::new(products + qdq))
    }
}

impl QuantLower {
    /// Lowers products, then switches the remaining per-tensor f32 Q/DQ nodes to the
    /// runtime's direct f32 kernels (`npuc.Quantize`/`npuc.Dequantize`, same results).
    /// Returns (products lowered, Q/DQ nodes switched).
    fn lower(&self, rw: &mut Rewriter<'_>, luts: bool) -> Result<(usize, usize), PassError> {
        if !has_qdq(rw.model()) {
            return Ok((0, 0));
        }
        let products = self.lower_products(rw)?
            + self.lower_conv(rw)?
            + self.lower_conv_transpose(rw)?
            + self.lower_block_products(rw)?;
        // Lookup regions need their constants as constants: the DQ of a constant bias or
        // scale (and Q -> DQ of constant operands) fold first. The weights of lowered
        // products are dead by now and removed before folding, so they never expand to f32.
        Dce.run(rw)?;
        crate::passes::const_fold::ConstFold {
            max_bytes: 64 << 20,
            keep_dequantize: false,
        }
        .run(rw)?;
        let luts = if luts {
            self.lower_luts(rw)? + self.lower_softmax(rw)? + self.fuse_dequant_bias(rw)
        } else {
            0
        };
        let g = &rw.model().graph;
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
        let mut patch = GraphPatch::new();
        if !switch.is_empty() {
            patch.import_domain("npuc");
        }
        // `Pow(x, 2)` (decomposed LayerNorm's variance, between Q/DQ pairs that keep the
        // layernorm fusion from matching) becomes `Mul(x, x)`: the correctly rounded square,
        // without a libm `powf` per element.
        for &i in &squares {
            let mut n = g.nodes[i].clone();
            n.op_type = "Mul".into();
            n.inputs[1] = n.inputs[0].clone();
            patch.replace(i, n);
        }
        for &(i, q) in &switch {
            let mut n = g.nodes[i].clone();
            n.domain = "npuc".into();
            n.op_type = if q { "Quantize" } else { "Dequantize" }.into();
            n.attrs.retain(|(a, _)| a != "axis" && a != "saturate");
            patch.replace(i, n);
        }
        let switched = switch.len() + squares.len();
        rw.apply(patch);
        Ok((products, luts + switched))
    }

    fn lower_products(&self, rw: &mut Rewriter<'_>) -> Result<usize, PassError> {
        let g = &rw.model().graph;
        let ix = Index::new(g);
        let mut patch = GraphPatch::new();
        let mut lowered = 0;
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
                    if u.outputs.len() == 1 && !patch.claimed(ui) {
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
                    && !patch.claimed(qi)
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
            let name = if p.name.is_empty() {
                String::new()
            } else {
                format!("{}_quant", p.name)
            };
            let mut node = QMATMUL
                .node(name)
                .input("a", &x.q)
                .input("a_scale", &x.scale)
                .input("a_zero_point", &x.zp)
                .input("b", &w.q)
                .input("b_scale", &w.scale)
                .input("b_zero_point", &w.zp)
                .input("bias", &bias)
                .input("y_scale", &ys)
                .input("y_zero_point", &yz)
                .output("y", &out);
            if trans_b {
                node = node.attr("trans_b", Attr::Int(1));
            }
            if let Some(lo) = clip.0 {
                node = node.attr("clip_min", Attr::Float(lo));
            }
            if let Some(hi) = clip.1 {
                node = node.attr("clip_max", Attr::Float(hi));
            }
            if patch.fuse(pi, built(node)?, &remove) {
                lowered += 1;
            }
        }
        Ok(apply_lowered(rw, patch, lowered))
    }
}

/// Set to `0` to fold blocked 4-bit weights to f32 instead of running `npuc.BlockMatMul`.
pub const BLOCK_MATMUL_ENV: &str = "NPUC_BLOCK_MATMUL";

impl QuantLower {
    /// `DequantizeLinear(int4/uint4 W [K, N], f32 scale [K/B, N] blocked on axis 0[, zero
    /// point]) -> MatMul(X, W)` (and `Gemm(X, W[, C])` without transposes, alpha = beta = 1, a
    /// constant f32 bias of N values) into `npuc.BlockMatMul`, whose weight stays packed (two
    /// codes a byte plus the block parameters) instead of being folded into an f32 `W`
    /// (w4a16 per-block / LPBQ). One packing per DQ, shared by every product reading it.
    ///
    /// Left to the fold into an f32 weight (not covered by the kernel): int8/uint8 and other
    /// blocked weight types, blocks along N (a Gemm's `transB` weight, axis 1), K not a whole
    /// number of blocks, a transposed or scaled Gemm or one with another bias, non-constant
    /// weights or parameters, a DQ with `output_dtype`.
    ///
    /// `NPUC_BLOCK_MATMUL=0` in the environment turns the lowering off (the fold path), for
    /// A/B measurements and the tests that compare both paths.
    fn lower_block_products(&self, rw: &mut Rewriter<'_>) -> Result<usize, PassError> {
        if std::env::var(BLOCK_MATMUL_ENV).is_ok_and(|v| v.trim() == "0") {
            return Ok(0);
        }
        let g = &rw.model().graph;
        let ix = Index::new(g);
        let mut patch = GraphPatch::new();
        let mut taken = HashSet::new();
        let mut packed: std::collections::HashMap<String, Option<(String, String, usize)>> =
            Default::default();
        let mut lowered = 0;
        for (pi, p) in g.nodes.iter().enumerate() {
            let gemm = is_op(p, "Gemm");
            if !(is_op(p, "MatMul") || gemm) || p.outputs.len() != 1 {
                continue;
            }
            if gemm
                && (attr_int(p, "transA", 0) != 0
                    || attr_int(p, "transB", 0) != 0
                    || attr_float(p, "alpha", 1.0) != 1.0
                    || attr_float(p, "beta", 1.0) != 1.0)
            {
                continue;
            }
            let (Some(xn), Some(wn)) = (p.input(0), p.input(1)) else {
                continue;
            };
            if !packed.contains_key(wn) {
                let made = ix.prod(g, wn).and_then(|(_, d)| {
                    if !is_op(d, "DequantizeLinear")
                        || d.outputs.len() != 1
                        || d.attr("output_dtype").is_some()
                    {
                        return None;
                    }
                    let block = attr_int(d, "block_size", 0);
                    let axis = attr_int(d, "axis", 1);
                    if block <= 0 || !(axis == 0 || axis == -2) {
                        return None;
                    }
                    let q = ix.constant(g, d.input(0)?)?;
                    let scale = ix.constant(g, d.input(1)?)?;
                    let zp = match d.input(2) {
                        None | Some("") => None,
                        Some(z) => Some(ix.constant(g, z)?),
                    };
                    let n = *q.shape().get(1)?;
                    let (b, center) =
                        blockmm::pack_weight(&q, &scale, zp.as_deref(), block as usize)?;
                    let b = patch.add_fresh_initializer(g, &mut taken, &format!("{wn}_q4"), b);
                    let c =
                        patch.add_fresh_initializer(g, &mut taken, &format!("{wn}_center"), center);
                    Some((b, c, n))
                });
                packed.insert(wn.to_string(), made);
            }
            let Some(Some((b, center, n))) = packed.get(wn) else {
                continue;
            };
            let Some(scale) = ix.prod(g, wn).and_then(|(_, d)| d.input(1)) else {
                continue;
            };
            let bias = if gemm { p.input(2).unwrap_or("") } else { "" };
            if !bias.is_empty()
                && !ix
                    .constant(g, bias)
                    .is_some_and(|t| t.dtype() == DType::F32 && t.len() == *n)
            {
                continue;
            }
            let name = if p.name.is_empty() {
                String::new()
            } else {
                format!("{}_block", p.name)
            };
            let node = BLOCK_MATMUL
                .node(name)
                .input("a", xn)
                .input("b", b)
                .input("b_scale", scale)
                .input("b_center", center)
                .input("bias", bias)
                .output("y", &p.outputs[0])
                .attr(
                    "block_size",
                    Attr::Int(
                        ix.prod(g, wn)
                            .map_or(0, |(_, d)| attr_int(d, "block_size", 0)),
                    ),
                )
                .attr("n", Attr::Int(*n as i64));
            if patch.fuse(pi, built(node)?, &[]) {
                lowered += 1;
            }
        }
        Ok(apply_lowered(rw, patch, lowered))
    }
}

// ---------------------------------------------------------------------------------------------
// Lookup regions: elementwise float math between a DequantizeLinear and a QuantizeLinear.
//
// QDQ graphs (ORT's `quantize_static`) wrap every float op in Q/DQ pairs: a bias Add, a layer
// scale Mul, the ops of an Erf-GELU, BatchNormalization after a convolution, each reads the
// dequantized 8-bit output of its producer and is quantized again. When a connected set of
// elementwise ops reads only one 8-bit tensor `t` (through one DQ) and constants, and leaves
// through one 8-bit QuantizeLinear, its output is a function of each element of `t` and (for
// per-channel constants) its channel: at most 256 values per channel. The region is evaluated
// once, at load, on all 256 inputs with the runtime's own kernels (so the table holds exactly
// what the QDQ graph computes), and becomes one `npuc.QLut(t, table)`: a byte lookup per
// element instead of a dequantize, float ops and a quantize, each a pass over memory.
//
// Layout-only ops (Reshape, Transpose, Squeeze, Unsqueeze, Flatten) commute with elementwise
// math, so `DQ -> Reshape -> Q` is first rewritten to `Reshape(t) -> DQ -> Q`, which a region
// then absorbs (an identity table when both sides use the same parameters disappears).

/// Ops a lookup region may hold: elementwise in their region input (other inputs constant).
const LUT_OPS: &[&str] = &[
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Erf",
    "Sqrt",
    "Relu",
    "Sigmoid",
    "Tanh",
    "Neg",
    "Abs",
    "Exp",
    "Log",
    "Reciprocal",
    "Pow",
    "Clip",
    "LeakyRelu",
    "HardSigmoid",
    "HardSwish",
    "Gelu",
    "Softplus",
    "Identity",
    "Floor",
    "Ceil",
    "Round",
    "Max",
    "Min",
    "Elu",
    "Selu",
    "QuantizeLinear",
    "DequantizeLinear",
    "BatchNormalization",
];

/// Layout ops a DequantizeLinear is moved past (they move bytes, not values).
const LAYOUT_OPS: &[&str] = &["Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"];

/// Name of the synthetic input a region is evaluated on.
const LUT_X: &str = "__npuc_lut_x";

/// A per-tensor, 8-bit Q/DQ with constant parameters: (scale, zero point, 8-bit dtype).
fn qdq_8bit(g: &Graph, ix: &Index, n: &Node) -> Option<DType> {
    if n.outputs.len() != 1
        || n.attrs
            .iter()
            .any(|(a, _)| a == "block_size" || a == "output_dtype")
    {
        return None;
    }
    let s = ix.constant(g, n.input(1)?)?;
    if s.len() != 1 || s.dtype() != DType::F32 {
        return None;
    }
    let z = ix.constant(g, n.input(2)?)?;
    if z.len() != 1 || !matches!(z.dtype(), DType::U8 | DType::I8) {
        return None;
    }
    Some(z.dtype())
}

/// A found region: its nodes (graph indices), the 8-bit source, the exit value, the table.
struct LutRegion {
    nodes: Vec<usize>,
    start: usize,
    source: String,
    exit: String,
    /// `[C, 256]` (or `[256]`) table of the exit's dtype, and the channel axis when C > 1.
    table: npuc_ir::Tensor,
    axis: Option<i64>,
    identity: bool,
}

/// The channel layout of a region's constants: none, per-channel along axis `-ae` of the
/// broadcast (constants shaped `[C, 1, ..]` of rank `ae`), or BatchNormalization's axis 1.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Chan {
    None,
    FromEnd(usize, usize),
    Axis1(usize),
}

fn merge_chan(a: Chan, b: Chan) -> Option<Chan> {
    match (a, b) {
        (Chan::None, x) | (x, Chan::None) => Some(x),
        (x, y) if x == y => Some(x),
        _ => None,
    }
}

impl QuantLower {
    /// Grows the lookup region starting at DequantizeLinear `di` and evaluates its table.
    fn lut_region(
        &self,
        m: &Model,
        ix: &Index,
        di: usize,
        used: &HashSet<usize>,
    ) -> Option<LutRegion> {
        let g = &m.graph;
        let d = &g.nodes[di];
        if !is_op(d, "DequantizeLinear") {
            return None;
        }
        let src_dt = qdq_8bit(g, ix, d)?;
        let source = d.input(0)?.to_string();
        if ix.is_const(g, &source) || ix.captured.contains(&source) {
            return None;
        }
        let mut nodes: HashSet<usize> = HashSet::from([di]);
        let mut vals: HashSet<String> = HashSet::from([d.outputs[0].clone()]);
        let mut chan = Chan::None;
        let mut changed = true;
        while changed {
            changed = false;
            let cur: Vec<String> = vals.iter().cloned().collect();
            for v in cur {
                for &ui in ix.users(&v) {
                    if nodes.contains(&ui) || used.contains(&ui) {
                        continue;
                    }
                    let u = &g.nodes[ui];
                    if !u.domain.is_empty()
                        || !LUT_OPS.contains(&u.op_type.as_str())
                        || u.outputs.len() != 1
                        || u.outputs[0].is_empty()
                    {
                        continue;
                    }
                    let Some(c) = self.lut_node_ok(g, ix, u, &vals) else {
                        continue;
                    };
                    let Some(c) = merge_chan(chan, c) else {
                        continue;
                    };
                    chan = c;
                    nodes.insert(ui);
                    vals.insert(u.outputs[0].clone());
                    changed = true;
                }
            }
        }
        // Exactly one value leaves the region, made by an 8-bit QuantizeLinear. A region that
        // grew past its last Q (e.g. into the DQ feeding a LayerNorm) gives those nodes back:
        // a node whose float output escapes leaves the region with everything after it.
        let exit = loop {
            let exits: Vec<String> = vals
                .iter()
                .filter(|v| !ix.is_internal(v) || ix.users(v).iter().any(|u| !nodes.contains(u)))
                .cloned()
                .collect();
            let bad: Vec<usize> = exits
                .iter()
                .filter_map(|v| ix.prod(g, v).map(|(i, _)| i))
                .filter(|&i| !is_op(&g.nodes[i], "QuantizeLinear"))
                .collect();
            if bad.is_empty() {
                let [exit] = exits.as_slice() else {
                    return None;
                };
                break exit.clone();
            }
            if bad.contains(&di) {
                return None;
            }
            let mut drop: HashSet<usize> = bad.into_iter().collect();
            loop {
                let gone: HashSet<&str> = drop
                    .iter()
                    .flat_map(|&i| g.nodes[i].outputs.iter().map(|o| o.as_str()))
                    .collect();
                let more: Vec<usize> = nodes
                    .iter()
                    .copied()
                    .filter(|i| {
                        !drop.contains(i)
                            && g.nodes[*i].inputs.iter().any(|x| gone.contains(x.as_str()))
                    })
                    .collect();
                if more.is_empty() {
                    break;
                }
                drop.extend(more);
            }
            if drop.contains(&di) {
                return None;
            }
            nodes.retain(|i| !drop.contains(i));
            vals = nodes
                .iter()
                .map(|&i| g.nodes[i].outputs[0].clone())
                .collect();
        };
        // The channel layout of what is left.
        let mut chan = Chan::None;
        for &i in &nodes {
            if i != di {
                chan = merge_chan(chan, self.lut_node_ok(g, ix, &g.nodes[i], &vals)?)?;
            }
        }
        let exit = &exit;
        let (qi, q) = ix.prod(g, exit)?;
        if !nodes.contains(&qi) || !is_op(q, "QuantizeLinear") {
            return None;
        }
        let out_dt = qdq_8bit(g, ix, q)?;
        // Evaluate on every 8-bit value (per channel).
        let (c, shape, axis) = match chan {
            Chan::None => (1, vec![256], None),
            Chan::FromEnd(ae, c) => {
                let mut s = vec![256, c];
                s.extend(std::iter::repeat_n(1, ae - 1));
                (c, s, Some(-(ae as i64)))
            }
            Chan::Axis1(c) => (c, vec![256, c], Some(1)),
        };
        let vals_of = |i: usize| i / c;
        let x = match src_dt {
            DType::U8 => npuc_ir::Tensor::from_vec(
                shape,
                (0..256 * c).map(|i| vals_of(i) as u8).collect::<Vec<u8>>(),
            ),
            _ => npuc_ir::Tensor::from_vec(
                shape,
                (0..256 * c)
                    .map(|i| (vals_of(i) as i32 - 128) as i8)
                    .collect::<Vec<i8>>(),
            ),
        }
        .ok()?;
        let mut order: Vec<usize> = nodes.iter().copied().collect();
        order.sort_unstable();
        let mut mini_nodes = vec![];
        let mut inits = vec![npuc_ir::Initializer {
            name: LUT_X.into(),
            tensor: x,
        }];
        let mut seen = HashSet::new();
        for &i in &order {
            let mut n = g.nodes[i].clone();
            for inp in n.inputs.iter_mut() {
                if inp.is_empty() || vals.contains(inp.as_str()) {
                    continue;
                }
                if i == di && *inp == source {
                    *inp = LUT_X.into();
                    continue;
                }
                if seen.insert(inp.clone()) {
                    inits.push(npuc_ir::Initializer {
                        name: inp.clone(),
                        tensor: ix.constant(g, inp)?.into_owned(),
                    });
                }
            }
            mini_nodes.push(n);
        }
        let mini = Model {
            ir_version: m.ir_version,
            opset_imports: m.opset_imports.clone(),
            graph: Graph {
                name: "lut".into(),
                nodes: mini_nodes,
                initializers: inits,
                outputs: vec![npuc_ir::ValueInfo::new(exit.to_string(), None)],
                ..Default::default()
            },
            ..Default::default()
        };
        let s =
            npuc_runtime::Session::new(&mini, npuc_runtime::SessionOptions { threads: 1 }).ok()?;
        let out = s.run(vec![]).ok()?;
        let npuc_runtime::Value::Tensor(t) = &out.first()?.1 else {
            return None;
        };
        if t.dtype() != out_dt || t.len() != 256 * c {
            return None;
        }
        // out[v * C + ch] -> table[ch * 256 + v]
        let raw: Vec<i64> = t.to_i64_vec().ok()?;
        let tab: Vec<i64> = (0..256 * c).map(|i| raw[(i % 256) * c + i / 256]).collect();
        let identity = c == 1
            && out_dt == src_dt
            && tab.iter().enumerate().all(|(v, &y)| {
                y == if src_dt == DType::U8 {
                    v as i64
                } else {
                    v as i64 - 128
                }
            });
        let tshape = if c == 1 { vec![256] } else { vec![c, 256] };
        let table = match out_dt {
            DType::U8 => {
                npuc_ir::Tensor::from_vec(tshape, tab.iter().map(|&v| v as u8).collect::<Vec<u8>>())
            }
            _ => {
                npuc_ir::Tensor::from_vec(tshape, tab.iter().map(|&v| v as i8).collect::<Vec<i8>>())
            }
        }
        .ok()?;
        Some(LutRegion {
            nodes: order,
            start: di,
            source,
            exit: exit.to_string(),
            table,
            axis,
            identity,
        })
    }

    /// Whether `u` may join a region whose values are `vals`: every other input constant and
    /// of a supported shape. Returns the channel layout its constants imply.
    fn lut_node_ok(&self, g: &Graph, ix: &Index, u: &Node, vals: &HashSet<String>) -> Option<Chan> {
        let in_region = |s: &str| vals.contains(s);
        let op = u.op_type.as_str();
        if !u.inputs.iter().any(|i| in_region(i)) {
            return None;
        }
        match op {
            "QuantizeLinear" | "DequantizeLinear" => {
                qdq_8bit(g, ix, u)?;
                return (in_region(u.input(0)?)
                    && !in_region(u.input(1)?)
                    && !in_region(u.input(2)?))
                .then_some(Chan::None);
            }
            "BatchNormalization" => {
                if !in_region(u.input(0)?) || u.inputs.len() != 5 {
                    return None;
                }
                if let Some(Attr::Int(t)) = u.attr("training_mode") {
                    if *t != 0 {
                        return None;
                    }
                }
                let mut c = None;
                for p in &u.inputs[1..] {
                    let t = ix.constant(g, p)?;
                    if t.rank() != 1 || c.is_some_and(|c| c != t.len()) {
                        return None;
                    }
                    c = Some(t.len());
                }
                return Some(Chan::Axis1(c?));
            }
            "Pow" if !in_region(u.input(0)?) => return None,
            _ => {}
        }
        let mut chan = Chan::None;
        for inp in u.inputs.iter().filter(|i| !i.is_empty() && !in_region(i)) {
            let t = ix.constant(g, inp)?;
            let c = if t.len() == 1 {
                if t.rank() > 1 {
                    return None;
                }
                Chan::None
            } else {
                // [1, .., 1, C, 1, .., 1]: per-channel along axis -rank of the broadcast
                // once the leading ones are dropped (a convolution's bias reshaped to
                // [1, C, 1, 1] is channel axis -3 of any NCHW tensor).
                let s = t.shape();
                let lead = s.iter().take_while(|&&d| d == 1).count();
                let s = &s[lead.min(s.len() - 1)..];
                if s[1..].iter().any(|&d| d != 1) {
                    return None;
                }
                Chan::FromEnd(s.len(), s[0])
            };
            chan = merge_chan(chan, c)?;
        }
        Some(chan)
    }

    /// Moves per-tensor 8-bit DequantizeLinear nodes below the layout op that is their only
    /// reader. Returns how many moved.
    fn sink_dq(&self, rw: &mut Rewriter<'_>) -> usize {
        let g = &rw.model().graph;
        let ix = Index::new(g);
        let mut swaps = vec![];
        for (di, d) in g.nodes.iter().enumerate() {
            if !is_op(d, "DequantizeLinear") || qdq_8bit(g, &ix, d).is_none() {
                continue;
            }
            let Some(li) = ix.sole_user(&d.outputs[0]) else {
                continue;
            };
            let l = &g.nodes[li];
            if !l.domain.is_empty()
                || !LAYOUT_OPS.contains(&l.op_type.as_str())
                || l.outputs.len() != 1
                || l.input(0) != Some(d.outputs[0].as_str())
                || l.inputs[1..].iter().any(|i| i == &d.outputs[0])
            {
                continue;
            }
            swaps.push((di, li));
        }
        let mut taken = HashSet::new();
        let mut patch = GraphPatch::new();
        let n = swaps.len();
        for (di, li) in swaps {
            let (mut d, mut l) = (g.nodes[di].clone(), g.nodes[li].clone());
            let t = d.inputs[0].clone();
            let mid = crate::util::fresh_name(g, &mut taken, &format!("{t}_layout"));
            d.outputs[0] = std::mem::replace(&mut l.outputs[0], mid.clone());
            l.inputs[0] = t;
            d.inputs[0] = mid;
            // The DQ now reads the layout op's output: it takes the layout op's place and the
            // layout op takes the DQ's.
            patch.replace(di, l);
            patch.replace(li, d);
        }
        rw.apply(patch);
        n
    }

    /// Sinks DequantizeLinear nodes past layout ops and replaces lookup regions with
    /// `npuc.QLut` (identity regions disappear). Returns the number of regions replaced.
    fn lower_luts(&self, rw: &mut Rewriter<'_>) -> Result<usize, PassError> {
        let mut total = 0;
        for _ in 0..8 {
            let sunk = self.sink_dq(rw);
            let m = rw.model();
            let g = &m.graph;
            let ix = Index::new(g);
            let mut used = HashSet::new();
            let mut regions = vec![];
            for (di, d) in g.nodes.iter().enumerate() {
                if used.contains(&di) || !is_op(d, "DequantizeLinear") {
                    continue;
                }
                if let Some(r) = self.lut_region(m, &ix, di, &used) {
                    used.extend(r.nodes.iter().copied());
                    regions.push(r);
                }
            }
            if regions.is_empty() && sunk == 0 {
                break;
            }
            total += regions.len();
            if regions.is_empty() {
                continue;
            }
            let mut patch = GraphPatch::new();
            patch.import_domain("npuc");
            let mut taken = HashSet::new();
            for r in regions {
                for &i in r.nodes.iter().filter(|&&i| i != r.start) {
                    patch.remove(i);
                }
                if r.identity && !ix.graph_outputs.contains(&r.exit) {
                    patch.remove(r.start);
                    patch.rename_reads(&r.exit, &r.source);
                    continue;
                }
                let tname = patch.add_fresh_initializer(g, &mut taken, "lut_table", r.table);
                let mut node = QLUT
                    .node(format!("{}_lut", g.nodes[r.start].name))
                    .input("x", &r.source)
                    .input("table", &tname)
                    .output("y", &r.exit);
                if let Some(a) = r.axis {
                    node = node.attr("axis", Attr::Int(a));
                }
                patch.replace(r.start, built(node)?);
            }
            rw.apply(patch);
        }
        // A table right after an integer product with 8-bit output, per output column (the
        // last axis) or for all values, runs in the product's epilogue (input 9).
        {
            let g = &rw.model().graph;
            let ix = Index::new(g);
            let mut patch = GraphPatch::new();
            for (li, l) in g.nodes.iter().enumerate() {
                if !(l.domain == "npuc" && l.op_type == "QLut") {
                    continue;
                }
                let per_col = l.attr("axis").is_some();
                let (Some(x), Some(tab)) = (l.input(0), l.input(1)) else {
                    continue;
                };
                let Some((pi, p)) = ix.prod(g, x) else {
                    continue;
                };
                let conv = p.domain == "npuc" && p.op_type == "QConv";
                if !(p.domain == "npuc" && p.op_type == "QMatMul" || conv)
                    || p.inputs.len() != 9
                    || ix.sole_user(x) != Some(li)
                {
                    continue;
                }
                // QMatMul: per output column (the last axis). QConv: per output channel (axis
                // 1 of its NCHW output, -3 from the end).
                let axis = attr_int(l, "axis", 0);
                if per_col && !(conv && (axis == 1 || axis == -3) || !conv && axis == -1) {
                    continue;
                }
                let (Some(zt), Some(tt)) = (ix.constant(g, &p.inputs[8]), ix.constant(g, tab))
                else {
                    continue;
                };
                if zt.dtype() != tt.dtype() {
                    continue;
                }
                if per_col {
                    // One table row per output column of a constant [K, N] (or [N, K]) weight,
                    // or per output channel of a constant [M, C, kh, kw] convolution weight.
                    let Some(w) = ix.constant(g, &p.inputs[3]) else {
                        continue;
                    };
                    let (rank, cols) = if conv {
                        (4, 0)
                    } else if attr_int(p, "trans_b", 0) != 0 {
                        (2, 0)
                    } else {
                        (2, 1)
                    };
                    if w.rank() != rank || tt.rank() != 2 || tt.shape()[0] != w.shape()[cols] {
                        continue;
                    }
                }
                let mut fused = p.clone();
                fused.inputs.push(tab.to_string());
                fused.outputs[0] = l.outputs[0].clone();
                patch.fuse(pi, fused, &[li]);
            }
            rw.apply(patch);
        }
        // Sinking swapped node positions; keep the list topologically ordered.
        if let Ok(order) = rw.model().graph.topo_order(&HashSet::new()) {
            let mut patch = GraphPatch::new();
            patch.reorder(order);
            rw.apply(patch);
        }
        Ok(total)
    }
}

impl QuantLower {
    /// `QMatMul (8-bit output, constant [K, N] weight, no table) -> DequantizeLinear (the same
    /// scale and zero point) -> Add(constant f32 [N] or one value)`, the bias a MatMul exporter
    /// writes as its own Add, becomes one `QMatMul` with `dq_bias` (input 10) and f32 output:
    /// the epilogue dequantizes each requantized code and adds the bias with the same rounding
    /// as the two ops, without the u8 tensor and two more passes over it. Only in the
    /// `luts` lowering: `npuc verify` compares the product's quantized output as a layer.
    /// Returns the number fused.
    fn fuse_dequant_bias(&self, rw: &mut Rewriter<'_>) -> usize {
        let g = &rw.model().graph;
        let ix = Index::new(g);
        let same = |a: &str, b: &str| match (ix.constant(g, a), ix.constant(g, b)) {
            (Some(x), Some(y)) => {
                x.len() == 1
                    && x.dtype() == y.dtype()
                    && x.shape() == y.shape()
                    && x.to_f64_vec().ok() == y.to_f64_vec().ok()
            }
            _ => false,
        };
        let mut patch = GraphPatch::new();
        let mut fused = 0;
        for (pi, p) in g.nodes.iter().enumerate() {
            if !(p.domain == "npuc" && p.op_type == "QMatMul") || p.inputs.len() != 9 {
                continue;
            }
            let Some(w) = ix.constant(g, &p.inputs[3]) else {
                continue;
            };
            let n = if attr_int(p, "trans_b", 0) != 0 { 0 } else { 1 };
            if w.rank() != 2 {
                continue;
            }
            let n = w.shape()[n];
            let Some(zt) = ix.constant(g, &p.inputs[8]) else {
                continue;
            };
            if !matches!(zt.dtype(), DType::U8 | DType::I8) {
                continue;
            }
            let y = &p.outputs[0];
            let Some(di) = ix.sole_user(y) else { continue };
            let d = &g.nodes[di];
            if !is_op(d, "DequantizeLinear")
                || d.input(0) != Some(y.as_str())
                || d.inputs.len() != 3
                || d.attrs
                    .iter()
                    .any(|(a, _)| a == "block_size" || a == "output_dtype")
                || !same(&d.inputs[1], &p.inputs[7])
                || !same(&d.inputs[2], &p.inputs[8])
            {
                continue;
            }
            let dy = &d.outputs[0];
            let Some(ai) = ix.sole_user(dy) else { continue };
            let a = &g.nodes[ai];
            if !is_op(a, "Add") || a.inputs.len() != 2 || a.inputs[0] == a.inputs[1] {
                continue;
            }
            let Some(b) = crate::util::other_input(a, dy) else {
                continue;
            };
            let bias_ok = ix.constant(g, b).is_some_and(|t| {
                t.dtype() == DType::F32 && t.rank() <= 1 && (t.len() == n || t.len() == 1)
            });
            if bias_ok {
                let mut with_bias = p.clone();
                with_bias.inputs.push(String::new());
                with_bias.inputs.push(b.to_string());
                with_bias.outputs[0] = a.outputs[0].clone();
                if patch.fuse(pi, with_bias, &[di, ai]) {
                    fused += 1;
                }
            }
        }
        rw.apply(patch);
        fused
    }

    /// Rewrites `DQ(x: 8-bit per-tensor), DQ(w: constant 8-bit, per-tensor or per output
    /// channel) [, bias] -> Conv -> Q(8-bit per-tensor)` into `npuc.QConv` (see
    /// `npuc_runtime::ops::qconv`): 2-D convolutions of group 1 or depthwise (group = input
    /// channels, one input channel per filter). Other groupings, 1-D/3-D convolutions and
    /// convolutions without a Q after them keep running in float. Returns the number lowered.
    fn lower_conv(&self, rw: &mut Rewriter<'_>) -> Result<usize, PassError> {
        let g = &rw.model().graph;
        let ix = Index::new(g);
        let mut patch = GraphPatch::new();
        let mut lowered = 0;
        for (pi, p) in g.nodes.iter().enumerate() {
            if !is_op(p, "Conv") || p.outputs.len() != 1 {
                continue;
            }
            let (Some(xn), Some(wn)) = (p.input(0), p.input(1)) else {
                continue;
            };
            let Some(x) = self.dq(g, &ix, xn, None) else {
                continue;
            };
            if !matches!(self.qtype(g, &ix, &x), Some(DType::U8 | DType::I8)) {
                continue;
            }
            let Some(w) = self.dq(g, &ix, wn, Some((4, 0))) else {
                continue;
            };
            let Some(wq) = ix.constant(g, &w.q) else {
                continue;
            };
            if wq.rank() != 4 || !matches!(wq.dtype(), DType::U8 | DType::I8) {
                continue;
            }
            let group = attr_int(p, "group", 1);
            let taps = wq.shape()[2] * wq.shape()[3];
            if group != 1 && (wq.shape()[1] != 1 || taps > idwconv::MAX_TAPS) {
                continue;
            }
            if matches!(p.attr("kernel_shape"), Some(Attr::Ints(k)) if k.len() != 2) {
                continue;
            }
            let bias = p.input(2).unwrap_or("").to_string();
            let Some(qi) = ix.sole_user(&p.outputs[0]) else {
                continue;
            };
            let q = &g.nodes[qi];
            if !is_op(q, "QuantizeLinear") || qdq_8bit(g, &ix, q).is_none() || patch.claimed(qi) {
                continue;
            }
            let (ys, yz) = (q.inputs[1].clone(), q.inputs[2].clone());
            let mut node = QCONV
                .node(format!("{}_quant", p.name))
                .input("x", &x.q)
                .input("x_scale", &x.scale)
                .input("x_zero_point", &x.zp)
                .input("w", &w.q)
                .input("w_scale", &w.scale)
                .input("w_zero_point", &w.zp)
                .input("bias", &bias)
                .input("y_scale", &ys)
                .input("y_zero_point", &yz)
                .output("y", &q.outputs[0]);
            for a in [
                "strides",
                "pads",
                "dilations",
                "auto_pad",
                "group",
                "kernel_shape",
            ] {
                if let Some(v) = p.attr(a) {
                    node = node.attr(a, v.clone());
                }
            }
            if patch.fuse(pi, built(node)?, &[qi]) {
                lowered += 1;
            }
        }
        Ok(apply_lowered(rw, patch, lowered))
    }

    /// `DQ(x), DQ(w) [, bias] -> ConvTranspose -> Q` (2-D, group 1, dilations 1, explicit
    /// pads) into `npuc.QConvTranspose`. Returns the number lowered.
    fn lower_conv_transpose(&self, rw: &mut Rewriter<'_>) -> Result<usize, PassError> {
        let g = &rw.model().graph;
        let ix = Index::new(g);
        let mut patch = GraphPatch::new();
        let mut lowered = 0;
        for (pi, p) in g.nodes.iter().enumerate() {
            if !is_op(p, "ConvTranspose") || p.outputs.len() != 1 {
                continue;
            }
            let ints = |a: &str| match p.attr(a) {
                Some(Attr::Ints(v)) => Some(v.clone()),
                _ => None,
            };
            if attr_int(p, "group", 1) != 1
                || ints("dilations").is_some_and(|d| d.iter().any(|&v| v != 1))
                || p.attr("output_shape").is_some()
                || matches!(p.attr("auto_pad"), Some(Attr::String(s)) if s != "NOTSET")
            {
                continue;
            }
            let (Some(xn), Some(wn)) = (p.input(0), p.input(1)) else {
                continue;
            };
            let Some(x) = self.dq(g, &ix, xn, None) else {
                continue;
            };
            if !matches!(self.qtype(g, &ix, &x), Some(DType::U8 | DType::I8)) {
                continue;
            }
            let Some(w) = self.dq(g, &ix, wn, Some((4, 1))) else {
                continue;
            };
            let Some(wq) = ix.constant(g, &w.q) else {
                continue;
            };
            if wq.rank() != 4 || !matches!(wq.dtype(), DType::U8 | DType::I8) {
                continue;
            }
            if ints("kernel_shape").is_some_and(|k| k.len() != 2) {
                continue;
            }
            let bias = p.input(2).unwrap_or("").to_string();
            let Some(qi) = ix.sole_user(&p.outputs[0]) else {
                continue;
            };
            let q = &g.nodes[qi];
            if !is_op(q, "QuantizeLinear") || qdq_8bit(g, &ix, q).is_none() {
                continue;
            }
            let (ys, yz) = (q.inputs[1].clone(), q.inputs[2].clone());
            let mut node = QCONV_TRANSPOSE
                .node(format!("{}_quant", p.name))
                .input("x", &x.q)
                .input("x_scale", &x.scale)
                .input("x_zero_point", &x.zp)
                .input("w", &w.q)
                .input("w_scale", &w.scale)
                .input("w_zero_point", &w.zp)
                .input("bias", &bias)
                .input("y_scale", &ys)
                .input("y_zero_point", &yz)
                .output("y", &q.outputs[0]);
            for a in ["strides", "pads", "output_padding"] {
                if let Some(v) = p.attr(a) {
                    node = node.attr(a, v.clone());
                }
            }
            if patch.fuse(pi, built(node)?, &[qi]) {
                lowered += 1;
            }
        }
        Ok(apply_lowered(rw, patch, lowered))
    }
}

// ---------------------------------------------------------------------------------------------
// Quantized Softmax: `DQ(x: 8-bit per-tensor) -> Softmax -> Q(8-bit per-tensor)`.
//
// Attention's probabilities: the scores come out of an integer product as 8-bit codes, are
// dequantized, go through an f32 Softmax and are quantized again. `npuc.QSoftmax` (see
// `npuc_runtime::ops::qsoftmax`) computes the same from the codes with a 256-entry exp table
// (softmax is shift invariant, so `exp(x - max)` depends only on the code distance to the
// row's maximum): three passes over f32 memory and a libm-style exp per element become byte
// reads and table lookups. Runs after the lookup regions, so a DequantizeLinear already moved
// past a Reshape/Transpose is seen next to its Softmax. Not applied when layer outputs must be
// kept (`lower_quantized_keep_layers`): the probabilities are a layer `npuc verify` compares.

/// The rank of `name` when the graph declares its shape (value_info, inputs or outputs).
fn declared_rank(g: &Graph, name: &str) -> Option<usize> {
    g.value_info
        .iter()
        .chain(&g.inputs)
        .chain(&g.outputs)
        .find(|v| v.name == name)
        .and_then(|v| v.dims())
        .map(|d| d.len())
}

impl QuantLower {
    /// Rewrites `DQ -> Softmax -> Q` chains (8-bit per-tensor parameters, the DQ and Softmax
    /// outputs read only by the next node of the chain) into `npuc.QSoftmax`. Opset >= 13
    /// Softmax is lowered only along the last axis (the kernel works on contiguous rows);
    /// opset < 13 Softmax (over the input flattened at `axis`) always is, with its `axis`.
    /// Returns the number lowered.
    fn lower_softmax(&self, rw: &mut Rewriter<'_>) -> Result<usize, PassError> {
        let opset = crate::util::onnx_opset(rw.model());
        let g = &rw.model().graph;
        let ix = Index::new(g);
        let mut patch = GraphPatch::new();
        let mut lowered = 0;
        for (si, s) in g.nodes.iter().enumerate() {
            if !is_op(s, "Softmax") || s.inputs.len() != 1 || s.outputs.len() != 1 {
                continue;
            }
            let (xf, pf) = (&s.inputs[0], &s.outputs[0]);
            let Some((di, d)) = ix.prod(g, xf) else {
                continue;
            };
            if !is_op(d, "DequantizeLinear")
                || qdq_8bit(g, &ix, d).is_none()
                || ix.sole_user(xf) != Some(si)
                || d.input(0).is_none_or(|x| x.is_empty() || ix.is_const(g, x))
            {
                continue;
            }
            let axis = if opset >= 13 {
                let axis = attr_int(s, "axis", -1);
                let rank = [xf.as_str(), pf.as_str(), d.inputs[0].as_str()]
                    .iter()
                    .find_map(|v| declared_rank(g, v));
                let last = axis == -1 || rank.is_some_and(|r| r >= 1 && axis == r as i64 - 1);
                if !last {
                    continue;
                }
                axis
            } else {
                attr_int(s, "axis", 1)
            };
            let Some(qi) = ix.sole_user(pf) else {
                continue;
            };
            let q = &g.nodes[qi];
            if !is_op(q, "QuantizeLinear")
                || q.input(0) != Some(pf.as_str())
                || qdq_8bit(g, &ix, q).is_none()
            {
                continue;
            }
            let name = if s.name.is_empty() {
                String::new()
            } else {
                format!("{}_quant", s.name)
            };
            let node = QSOFTMAX
                .node(name)
                .input("x", &d.inputs[0])
                .input("x_scale", &d.inputs[1])
                .input("x_zero_point", &d.inputs[2])
                .input("y_scale", &q.inputs[1])
                .input("y_zero_point", &q.inputs[2])
                .output("y", &q.outputs[0])
                .attr("axis", Attr::Int(axis));
            if patch.fuse(si, built(node)?, &[di, qi]) {
                lowered += 1;
            }
        }
        Ok(apply_lowered(rw, patch, lowered))
    }
}
