//! Fused ops of the `npuc` domain, produced by the optimizer (`npuc-passes`):
//!
//! - `FusedConv`, `FusedGemm`: the ONNX op (same inputs and attributes) followed by an
//!   activation applied in place on its output (`activation` string attribute, parameters in
//!   `activation_params`).
//! - `FusedMatMul(A, B[, bias])`: ONNX MatMul, plus a bias broadcast along the last axis,
//!   plus an activation, all in one pass over the output.
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
    let t = match matmul_const_b(ctx, a, b)? {
        Some(t) => t,
        None => matmul_tensors(a, b, ctx.threads)?,
    };
    Ok(vec![Value::tensor(epilogue(t, bias, act)?)])
}

#[cfg(test)]
mod tests {
    use super::*;

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
