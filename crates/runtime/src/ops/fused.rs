//! Fused ops of the `npuc` domain, produced by the optimizer (`npuc-passes`):
//!
//! - `FusedConv`, `FusedGemm`: the ONNX op (same inputs and attributes) followed by an
//!   activation applied in place on its output (`activation` string attribute, parameters in
//!   `activation_params`).
//! - `FusedMatMul(A, B[, bias])`: ONNX MatMul, plus a bias broadcast along the last axis,
//!   plus an activation, all in one pass over the output.
//! - `FusedBinary(A, B)`: ONNX Add / Sub / Mul / Div (attribute `op`) over f32, then an
//!   activation on each stretch of the output right after it is computed.
//! - `LayerNormalization`, `RMSNormalization`, `Gelu`, `Attention`: the ONNX ops at the
//!   newest opset npuc implements, for models whose own opset predates them (the optimizer
//!   fuses decomposed forms into these).
//!
//! The products themselves run the plain ONNX kernels, so a fused op costs exactly the plain
//! op plus a cheap, cache-friendly epilogue instead of a separate node with its own output
//! buffer.

use crate::bail;
use crate::error::Result;
use crate::kernel::{registry, Inputs, OpCtx, Registry, MAX_OPSET};
use crate::ops::elementwise::binary_span;
use crate::ops::matmul::{matmul_const_b, matmul_tensors};
use crate::value::Value;
use npuc_ir::infer::onnx_rule;
use npuc_ir::opdef::{AttrDef, OpDef, Param};
use npuc_ir::{DType, Node, Tensor};
use std::sync::Arc;

pub fn register(r: &mut Registry) {
    r.define(&FUSED_CONV, fused_conv);
    r.define(&FUSED_GEMM, fused_gemm);
    r.define(&FUSED_MATMUL, fused_matmul);
    r.define(&FUSED_BINARY, fused_binary);
    r.define(&LAYER_NORMALIZATION, |c, i| {
        delegate(c, i, "LayerNormalization")
    });
    r.define(&RMS_NORMALIZATION, |c, i| {
        delegate(c, i, "RMSNormalization")
    });
    r.define(&GELU, |c, i| delegate(c, i, "Gelu"));
    r.define(&ATTENTION, |c, i| delegate(c, i, "Attention"));
}

/// The fused-activation attributes shared by `FusedConv`, `FusedGemm`, `FusedMatMul` and
/// `ConvNhwc` (the ONNX op's own attributes are not listed: they are the ONNX op's).
pub const ACTIVATION_ATTRS: &[AttrDef] = &[
    AttrDef::optional("activation", "string"),
    AttrDef::optional("activation_params", "floats"),
];

/// An `npuc` op whose shapes are those of ONNX op `op` over the same inputs.
macro_rules! onnx_variant {
    ($name:literal, $onnx:literal, $inputs:expr, $outputs:expr, $attrs:expr) => {
        OpDef {
            domain: "npuc",
            name: $name,
            inputs: $inputs,
            outputs: $outputs,
            attrs: $attrs,
            infer: |n| onnx_rule(&n.as_onnx($onnx, MAX_OPSET)),
        }
    };
}

const ONE_OUTPUT: &[Param] = &[Param::required("Y")];

/// `npuc.FusedConv`: ONNX Conv plus an activation.
pub static FUSED_CONV: OpDef = onnx_variant!(
    "FusedConv",
    "Conv",
    &[
        Param::required("X"),
        Param::required("W"),
        Param::optional("B")
    ],
    ONE_OUTPUT,
    ACTIVATION_ATTRS
);

/// `npuc.FusedGemm`: ONNX Gemm plus an activation.
pub static FUSED_GEMM: OpDef = onnx_variant!(
    "FusedGemm",
    "Gemm",
    &[
        Param::required("A"),
        Param::required("B"),
        Param::optional("C")
    ],
    ONE_OUTPUT,
    ACTIVATION_ATTRS
);

/// `npuc.FusedMatMul`: ONNX MatMul plus a bias along the last axis plus an activation.
pub static FUSED_MATMUL: OpDef = onnx_variant!(
    "FusedMatMul",
    "MatMul",
    &[
        Param::required("A"),
        Param::required("B"),
        Param::optional("bias")
    ],
    ONE_OUTPUT,
    ACTIVATION_ATTRS
);

/// `npuc.FusedBinary`: ONNX Add, Sub, Mul or Div (`op`, numpy broadcasting; the shapes are
/// Add's for all four) plus an activation.
pub static FUSED_BINARY: OpDef = onnx_variant!(
    "FusedBinary",
    "Add",
    &[Param::required("A"), Param::required("B")],
    ONE_OUTPUT,
    &[
        AttrDef::required("op", "string"),
        AttrDef::optional("activation", "string"),
        AttrDef::optional("activation_params", "floats"),
    ]
);

/// `npuc.LayerNormalization`: the ONNX op at the newest opset.
pub static LAYER_NORMALIZATION: OpDef = onnx_variant!(
    "LayerNormalization",
    "LayerNormalization",
    &[
        Param::required("X"),
        Param::required("Scale"),
        Param::optional("B")
    ],
    &[
        Param::required("Y"),
        Param::optional("Mean"),
        Param::optional("InvStdDev")
    ],
    &[]
);

/// `npuc.RMSNormalization`: the ONNX op at the newest opset.
pub static RMS_NORMALIZATION: OpDef = onnx_variant!(
    "RMSNormalization",
    "RMSNormalization",
    &[Param::required("X"), Param::required("scale")],
    ONE_OUTPUT,
    &[]
);

/// `npuc.Gelu`: the ONNX op at the newest opset.
pub static GELU: OpDef = onnx_variant!("Gelu", "Gelu", &[Param::required("X")], ONE_OUTPUT, &[]);

/// `npuc.Attention`: the ONNX op at the newest opset.
pub static ATTENTION: OpDef = onnx_variant!(
    "Attention",
    "Attention",
    &[
        Param::required("Q"),
        Param::required("K"),
        Param::required("V"),
        Param::optional("attn_mask"),
        Param::optional("past_key"),
        Param::optional("past_value"),
        Param::optional("nonpad_kv_seqlen")
    ],
    &[
        Param::required("Y"),
        Param::optional("present_key"),
        Param::optional("present_value"),
        Param::optional("qk_matmul_output")
    ],
    &[]
);

/// Names of the ONNX ops the `npuc`-domain versions above delegate to.
pub const DELEGATED: &[&str] = &[
    "LayerNormalization",
    "RMSNormalization",
    "Gelu",
    "Attention",
];

/// Runs the newest default-domain kernel of `op` on this node.
fn delegate(ctx: &OpCtx, ins: Inputs, op: &str) -> Result<Vec<Value>> {
    let Some(e) = registry().find("", op, MAX_OPSET) else {
        bail!("no kernel for {op} (needed by npuc.{op})");
    };
    let inner = OpCtx {
        node: ctx.node,
        opset: MAX_OPSET,
        threads: ctx.threads,
        host: ctx.host,
        node_index: ctx.node_index,
    };
    (e.kernel)(&inner, ins)
}

/// An activation applied elementwise after a product.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    None,
    Relu,
    Sigmoid,
    Tanh,
    LeakyRelu(f32),
    Clip(f32, f32),
    HardSigmoid(f32, f32),
    /// `x * max(0, min(1, alpha * x + beta))` (ONNX HardSwish is alpha = 1/6, beta = 0.5).
    HardSwish(f32, f32),
    /// `x * sigmoid(x)`.
    Swish,
    /// Exact (erf) GELU.
    Gelu,
    /// tanh-approximated GELU.
    GeluTanh,
}

impl Act {
    /// Parses the `activation` / `activation_params` attributes of a fused node.
    pub fn from_node(n: &Node) -> Result<Act> {
        let name = n.str_or("activation", "")?;
        let p = n.attr_floats("activation_params")?.unwrap_or(&[]);
        let need = |k: usize| -> Result<()> {
            if p.len() != k {
                bail!(
                    "activation {name} needs {k} activation_params, got {}",
                    p.len()
                );
            }
            Ok(())
        };
        Ok(match name {
            "" => Act::None,
            "Relu" => Act::Relu,
            "Sigmoid" => Act::Sigmoid,
            "Tanh" => Act::Tanh,
            "Swish" => Act::Swish,
            "Gelu" => Act::Gelu,
            "GeluTanh" => Act::GeluTanh,
            "LeakyRelu" => {
                need(1)?;
                Act::LeakyRelu(p[0])
            }
            "Clip" => {
                need(2)?;
                Act::Clip(p[0], p[1])
            }
            "HardSigmoid" => {
                need(2)?;
                Act::HardSigmoid(p[0], p[1])
            }
            "HardSwish" => {
                need(2)?;
                Act::HardSwish(p[0], p[1])
            }
            other => bail!("unknown fused activation '{other}'"),
        })
    }

    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Act::None => x,
            Act::Relu => x.max(0.0),
            Act::Sigmoid => sigmoid(x),
            Act::Tanh => x.tanh(),
            Act::LeakyRelu(a) => {
                if x < 0.0 {
                    a * x
                } else {
                    x
                }
            }
            Act::Clip(lo, hi) => x.max(lo).min(hi),
            Act::HardSigmoid(a, b) => (a * x + b).clamp(0.0, 1.0),
            Act::HardSwish(a, b) => x * (a * x + b).clamp(0.0, 1.0),
            Act::Swish => x * sigmoid(x),
            Act::Gelu => gelu(x as f64) as f32,
            Act::GeluTanh => {
                let x64 = x as f64;
                let c = (2.0 / std::f64::consts::PI).sqrt();
                (0.5 * x64 * (1.0 + (c * (x64 + 0.044715 * x64 * x64 * x64)).tanh())) as f32
            }
        }
    }

    #[inline]
    pub fn apply64(self, x: f64) -> f64 {
        match self {
            Act::None => x,
            Act::Relu => x.max(0.0),
            Act::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Act::Tanh => x.tanh(),
            Act::LeakyRelu(a) => {
                if x < 0.0 {
                    a as f64 * x
                } else {
                    x
                }
            }
            Act::Clip(lo, hi) => x.max(lo as f64).min(hi as f64),
            Act::HardSigmoid(a, b) => (a as f64 * x + b as f64).clamp(0.0, 1.0),
            Act::HardSwish(a, b) => x * (a as f64 * x + b as f64).clamp(0.0, 1.0),
            Act::Swish => x / (1.0 + (-x).exp()),
            Act::Gelu => gelu(x),
            Act::GeluTanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
            }
        }
    }
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `erfc(x)` for x >= 0 with relative error below 1.2e-7 everywhere (Chebyshev fit, Numerical
/// Recipes `erfcc`): relative accuracy in the tail keeps GELU of large negative inputs exact
/// to f32 precision.
#[inline]
fn erfc_pos(z: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.5 * z);
    t * (-z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
        .exp()
}

/// Exact GELU `x/2 * (1 + erf(x / sqrt 2))`, written with erfc so neither tail cancels.
#[inline]
pub fn gelu(x: f64) -> f64 {
    let z = x * std::f64::consts::FRAC_1_SQRT_2;
    if z >= 0.0 {
        0.5 * x * (2.0 - erfc_pos(z))
    } else {
        0.5 * x * erfc_pos(-z)
    }
}

/// Applies `act` to every element. The match is outside the loops so each arm is a tight loop
/// the compiler vectorizes (a per-element match on the enum costs 30% of a whole model).
pub(crate) fn apply_f32(act: Act, v: &mut [f32]) {
    match act {
        Act::None => {}
        Act::Relu => crate::kernels::act::relu(v),
        Act::Clip(lo, hi) => crate::kernels::act::clip(v, lo, hi),
        Act::HardSigmoid(a, b) => crate::kernels::act::hard_sigmoid(v, a, b),
        Act::HardSwish(a, b) => crate::kernels::act::hard_swish(v, a, b),
        Act::LeakyRelu(a) => crate::kernels::act::leaky_relu(v, a, 0.0),
        Act::Sigmoid => crate::kernels::act::sigmoid(v),
        Act::Swish => crate::kernels::act::swish(v),
        Act::Gelu => crate::kernels::act::gelu(v),
        Act::Tanh => crate::kernels::act::tanh(v),
        other => v.iter_mut().for_each(|x| *x = other.apply(*x)),
    }
}

/// Applies `bias` (broadcast along the last axis, `None` for no bias) and `act` in place.
pub fn epilogue(mut t: Tensor, bias: Option<&Tensor>, act: Act) -> Result<Tensor> {
    if bias.is_none() && act == Act::None {
        return Ok(t);
    }
    let n = match bias {
        Some(b) => {
            let n = b.len();
            if t.rank() == 0 || t.shape().last() != Some(&n) {
                bail!(
                    "bias of {n} values does not match the output shape {:?}",
                    t.shape()
                );
            }
            n
        }
        None => t.len().max(1),
    };
    match t.dtype() {
        DType::F32 => {
            let bv = match bias {
                Some(b) => Some(crate::ops::matmul::GemmFloat::load(b)?),
                None => None,
            };
            let v = t.as_mut_slice::<f32>()?;
            if let Some(bv) = &bv {
                let bv: &[f32] = bv;
                for row in v.chunks_mut(n) {
                    for (x, &b) in row.iter_mut().zip(bv) {
                        *x += b;
                    }
                }
            }
            apply_f32(act, v);
            Ok(t)
        }
        DType::F64 | DType::F16 | DType::BF16 => {
            let dt = t.dtype();
            let mut v = t.to_f64_vec()?;
            let bv = match bias {
                Some(b) => Some(b.to_f64_vec()?),
                None => None,
            };
            for row in v.chunks_mut(n) {
                for (j, x) in row.iter_mut().enumerate() {
                    let b = bv.as_ref().map_or(0.0, |bv| bv[j]);
                    *x = act.apply64(*x + b);
                }
            }
            crate::ops::norm::f64_to_tensor(dt, t.shape().to_vec(), v)
        }
        other => bail!("fused activations support float outputs only, got {other}"),
    }
}

/// Runs the default-domain kernel `op` on this node's inputs, then the epilogue.
fn product_then_act(ctx: &OpCtx, ins: Inputs, op: &str) -> Result<Vec<Value>> {
    let act = Act::from_node(ctx.node)?;
    let Some(e) = registry().find("", op, MAX_OPSET) else {
        bail!("no kernel for {op}");
    };
    let mut out = (e.kernel)(ctx, ins)?;
    let Some(first) = out.first_mut() else {
        bail!("{op} produced no output");
    };
    let Value::Tensor(t) = std::mem::replace(first, Value::Optional(None)) else {
        bail!("{op} produced no tensor");
    };
    let t = Arc::try_unwrap(t).unwrap_or_else(|t| (*t).clone());
    out[0] = Value::tensor(epilogue(t, None, act)?);
    Ok(out)
}

/// `FusedConv`: Conv (all its attributes) then the activation.
fn fused_conv(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    product_then_act(ctx, ins, "Conv")
}

/// `FusedGemm`: Gemm (all its attributes) then the activation.
fn fused_gemm(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    product_then_act(ctx, ins, "Gemm")
}

/// `FusedMatMul(A, B[, bias])`: numpy matmul, plus bias along the last axis, then the
/// activation.
fn fused_matmul(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let act = Act::from_node(ctx.node)?;
    let a = ins.tensor(0)?;
    let b = ins.tensor(1)?;
    let bias = ins.opt_tensor(2);
    if let Some(bias) = bias {
        if bias.dtype() != a.dtype() {
            bail!(
                "FusedMatMul bias dtype {} differs from {}",
                bias.dtype(),
                a.dtype()
            );
        }
    }
    // A bias of the product's column count and the activation run inside the prepacked
    // product, on each stretch of output while it is in cache and on the thread that made it;
    // otherwise (and on the other paths) after it, over the whole output.
    let n_out = b.shape().last().copied().unwrap_or(0);
    let bias_f32 = match bias {
        Some(t) if t.dtype() == DType::F32 && t.len() == n_out => Some(t.as_slice::<f32>()?),
        Some(_) => None,
        None => Some(&[][..]),
    };
    if let (Some(bv), true) = (bias_f32, bias.is_some() || act != Act::None) {
        let finish = |mut s: crate::kernels::sgemm::Stretch| {
            let j0 = s.j0;
            s.for_each_row(|v| {
                if !bv.is_empty() {
                    for (x, &c) in v.iter_mut().zip(&bv[j0..]) {
                        *x += c;
                    }
                }
                apply_f32(act, v);
            });
        };
        if let Some(t) = matmul_const_b(ctx, a, b, Some(&finish))? {
            return Ok(vec![Value::tensor(t)]);
        }
    }
    let t = match matmul_const_b(ctx, a, b, None)? {
        Some(t) => t,
        None => matmul_tensors(a, b, ctx.threads)?,
    };
    Ok(vec![Value::tensor(epilogue(t, bias, act)?)])
}

/// Values per stretch of a [`fused_binary`] output: the binary op's results are still in L1
/// when the activation reads them.
const BINARY_STRETCH: usize = 1024;

/// `FusedBinary(A, B)`: the binary op over the broadcast, the activation applied per stretch
/// of [`BINARY_STRETCH`] output values (the same values as the two ops one after the other);
/// output rows split across threads when large.
fn fused_binary(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let act = Act::from_node(ctx.node)?;
    let (a, b) = (ins.tensor(0)?, ins.tensor(1)?);
    if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        bail!(
            "FusedBinary takes f32 inputs, got {} and {}",
            a.dtype(),
            b.dtype()
        );
    }
    let op = ctx.node.str_or("op", "")?;
    let plan = crate::ops::elementwise::Bcast::new(&[a.shape(), b.shape()])?;
    let (xa, xb) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    // Every value is written below.
    let mut out = crate::buffers::for_overwrite::<f32>(plan.len());
    fn go(
        plan: &crate::ops::elementwise::Bcast,
        xa: &[f32],
        xb: &[f32],
        out: &mut [f32],
        act: Act,
        threads: usize,
        f: impl Fn(f32, f32) -> f32 + Copy + Sync,
    ) {
        let (rows, inner) = plan.rows_inner();
        if rows == 0 || inner == 0 {
            return;
        }
        // Rows r0.. of the output into `part` (which starts at row r0).
        let rows_into = |part: &mut [f32], r0: usize| {
            let r1 = r0 + part.len() / inner;
            plan.for_each_row_in(r0..r1, |offs, oo, n, st| {
                let row = &mut part[oo - r0 * inner..oo - r0 * inner + n];
                for (j, o) in row.chunks_mut(BINARY_STRETCH).enumerate() {
                    binary_span(offs, st, j * BINARY_STRETCH, xa, xb, o, f);
                    apply_f32(act, o);
                }
            });
        };
        let par = threads > 1 && plan.len() >= crate::ops::elementwise::PAR_MIN;
        if par && rows >= threads {
            use rayon::prelude::*;
            let per = rows.div_ceil(threads);
            out.par_chunks_mut(per * inner)
                .enumerate()
                .for_each(|(i, part)| rows_into(part, i * per));
        } else if par && rows == 1 {
            // One long row (equal shapes): stretches split across threads.
            use rayon::prelude::*;
            let per = inner.div_ceil(threads).div_ceil(BINARY_STRETCH) * BINARY_STRETCH;
            out.par_chunks_mut(per).enumerate().for_each(|(i, part)| {
                plan.for_each_row_in(0..1, |offs, _, _, st| {
                    for (j, o) in part.chunks_mut(BINARY_STRETCH).enumerate() {
                        binary_span(offs, st, i * per + j * BINARY_STRETCH, xa, xb, o, f);
                        apply_f32(act, o);
                    }
                });
            });
        } else {
            rows_into(out, 0);
        }
    }
    let th = ctx.threads;
    match op {
        "Add" => go(&plan, xa, xb, &mut out, act, th, |x, y| x + y),
        "Sub" => go(&plan, xa, xb, &mut out, act, th, |x, y| x - y),
        "Mul" => go(&plan, xa, xb, &mut out, act, th, |x, y| x * y),
        "Div" => go(&plan, xa, xb, &mut out, act, th, |x, y| x / y),
        other => bail!("FusedBinary: unknown op '{other}' (expected Add, Sub, Mul or Div)"),
    }
    Ok(vec![Value::tensor(Tensor::from_vec(plan.out_shape, out)?)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `nodes` (inputs `a`, `b`; output `y`; opsets default 17 and npuc 1).
    fn run_ab(nodes: Vec<Node>, a: &Tensor, b: &Tensor, threads: usize) -> Tensor {
        use npuc_ir::{Graph, Model, OpsetImport, ValueInfo};
        let m = Model {
            ir_version: 8,
            opset_imports: vec![
                OpsetImport {
                    domain: String::new(),
                    version: 17,
                },
                OpsetImport {
                    domain: "npuc".into(),
                    version: 1,
                },
            ],
            graph: Graph {
                name: "g".into(),
                nodes,
                inputs: vec![ValueInfo::new("a", None), ValueInfo::new("b", None)],
                outputs: vec![ValueInfo::new("y", None)],
                ..Default::default()
            },
            ..Default::default()
        };
        let s = crate::Session::new(&m, crate::SessionOptions { threads }).unwrap();
        let feeds = vec![
            ("a".to_string(), Value::tensor(a.clone())),
            ("b".to_string(), Value::tensor(b.clone())),
        ];
        s.run(feeds).unwrap()[0].1.as_tensor().unwrap().clone()
    }

    /// `FusedBinary` gives the bits of the binary op then the activation as two nodes, for
    /// broadcasts whose rows are shorter and longer than a stretch, equal shapes (one long
    /// row, split across threads) and a scalar operand, at 1 and 2 threads.
    #[test]
    fn fused_binary_equals_the_two_ops() {
        let val = |n: usize, seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 7919 + seed * 104_729) % 4001) as f32 / 1000.0 - 2.0)
                .collect()
        };
        let t = |s: &[usize], seed| Tensor::from_vec(s.to_vec(), val(s.iter().product(), seed));
        let cases: [(&[usize], &[usize], &str, &str); 5] = [
            (&[1, 32, 1, 512], &[1, 1, 32, 512], "Add", "Tanh"),
            (&[3, 1, 1500], &[1, 50, 1500], "Sub", "Sigmoid"),
            (&[70_001], &[70_001], "Mul", "Relu"),
            (&[40, 33], &[], "Div", "LeakyRelu"),
            (&[2, 300, 1], &[2, 1, 260], "Add", "Clip"),
        ];
        for (ci, (sa, sb, op, act)) in cases.into_iter().enumerate() {
            let (a, b) = (t(sa, 1).unwrap(), t(sb, 2).unwrap());
            let params: Vec<f32> = match act {
                "Clip" => vec![-0.5, 1.25],
                "LeakyRelu" => vec![0.01],
                _ => vec![],
            };
            let act_node = Node::new(act, &["s"], &["y"]);
            let mut fused = Node::new("FusedBinary", &["a", "b"], &["y"])
                .with_attr("op", npuc_ir::Attr::String(op.into()))
                .with_attr("activation", npuc_ir::Attr::String(act.into()));
            fused.domain = "npuc".into();
            if !params.is_empty() {
                fused = fused.with_attr("activation_params", npuc_ir::Attr::Floats(params));
            }
            for threads in [1, 2] {
                let want = if act == "Clip" {
                    // Clip with constant bounds, as the optimizer fuses it (bounds as inputs).
                    let s = run_ab(vec![Node::new(op, &["a", "b"], &["y"])], &a, &b, threads);
                    let v: Vec<f32> = s
                        .as_slice::<f32>()
                        .unwrap()
                        .iter()
                        .map(|x| x.clamp(-0.5, 1.25))
                        .collect();
                    Tensor::from_vec(s.shape().to_vec(), v).unwrap()
                } else {
                    run_ab(
                        vec![Node::new(op, &["a", "b"], &["s"]), act_node.clone()],
                        &a,
                        &b,
                        threads,
                    )
                };
                let got = run_ab(vec![fused.clone()], &a, &b, threads);
                assert_eq!(got.shape(), want.shape(), "case {ci}");
                let (g, w) = (
                    got.as_slice::<f32>().unwrap(),
                    want.as_slice::<f32>().unwrap(),
                );
                for (i, (x, y)) in g.iter().zip(w).enumerate() {
                    // The same bits, but for the sign of a zero: the fused activations' Relu
                    // is max(x, 0) (+0 for -0), the Relu op keeps -0.
                    assert!(
                        x.to_bits() == y.to_bits() || (*x == 0.0 && *y == 0.0),
                        "case {ci} threads {threads} at {i}: {x} vs {y}"
                    );
                }
            }
        }
    }

    #[test]
    fn gelu_matches_reference_values() {
        // Reference values from the erf definition (computed in high precision).
        for (x, want) in [
            (0.0, 0.0),
            (1.0, 0.841_344_746_068_542_9),
            (-1.0, -0.158_655_253_931_457_05),
            (3.0, 2.995_950_323_318_310_4),
            (-5.0, -1.433_257_456_611_479_7e-6),
        ] {
            let got = gelu(x);
            assert!(
                // erfcc's relative error bound is 1.2e-7; GELU's tail inherits it (x2 margin).
                (got - want).abs() <= 3e-7 * want.abs().max(1e-12),
                "gelu({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn epilogue_bias_and_act() {
        let t = Tensor::from_vec(vec![2, 2], vec![1.0f32, -2.0, 3.0, -4.0]).unwrap();
        let b = Tensor::from_vec(vec![2], vec![0.5f32, 1.0]).unwrap();
        let out = epilogue(t, Some(&b), Act::Relu).unwrap();
        assert_eq!(out.as_slice::<f32>().unwrap(), &[1.5, 0.0, 3.5, 0.0]);
        assert!(epilogue(out, Some(&Tensor::scalar(1.0f32)), Act::None).is_err());
    }
}
