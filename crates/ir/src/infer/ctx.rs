//! The view of one node that inference rules work on: its inputs' types and known values and
//! typed attribute access with messages suitable for problem reports.

use super::value::Known;
use super::Scope;
use crate::dtype::DType;
use crate::graph::{Attr, Dim, Node, TypeInfo};
use crate::tensor::Tensor;

/// A rule's result: the message of an `Err` becomes a problem naming the node.
pub type R<T> = Result<T, String>;

pub struct NodeIn<'a> {
    pub node: &'a Node,
    pub opset: i64,
    /// The op whose rule applies: the node's own, or the ONNX op an `npuc` op is a variant of
    /// (see [`NodeIn::as_onnx`]).
    op: &'a str,
    tys: Vec<Option<TypeInfo>>,
    vals: Vec<Option<Known>>,
}

impl<'a> NodeIn<'a> {
    pub(crate) fn new(node: &'a Node, scope: &Scope, opset: i64) -> NodeIn<'a> {
        let tys = node
            .inputs
            .iter()
            .map(|s| if s.is_empty() { None } else { scope.ty(s) })
            .collect();
        let vals = node
            .inputs
            .iter()
            .map(|s| if s.is_empty() { None } else { scope.val(s) })
            .collect();
        NodeIn::from_parts(node, opset, tys, vals)
    }

    /// A view of `node` with the given input types and known values.
    pub(crate) fn from_parts(
        node: &'a Node,
        opset: i64,
        tys: Vec<Option<TypeInfo>>,
        vals: Vec<Option<Known>>,
    ) -> NodeIn<'a> {
        NodeIn {
            node,
            opset,
            op: &node.op_type,
            tys,
            vals,
        }
    }

    /// The same node seen as ONNX op `op` at `opset`, for an op definition whose shapes follow
    /// an ONNX op's (a fused or relaid-out variant with the same inputs).
    pub fn as_onnx(&self, op: &'a str, opset: i64) -> NodeIn<'a> {
        NodeIn {
            node: self.node,
            opset,
            op,
            tys: self.tys.clone(),
            vals: self.vals.clone(),
        }
    }

    /// A view of `node` (built by an op definition's rule: the ONNX op whose shapes the op
    /// follows, with its own input list) at `opset`, whose input `i` has the type and value of
    /// this node's input `from[i]` (`None`: absent).
    pub fn derived<'b>(&self, node: &'b Node, opset: i64, from: &[Option<usize>]) -> NodeIn<'b> {
        let pick = |i: &Option<usize>| i.and_then(|i| self.tys.get(i).cloned().flatten());
        NodeIn {
            node,
            opset,
            op: &node.op_type,
            tys: from.iter().map(pick).collect(),
            vals: from
                .iter()
                .map(|i| i.and_then(|i| self.vals.get(i).cloned().flatten()))
                .collect(),
        }
    }

    /// Replaces the type of input `i` (a relaid-out view); its known value is dropped.
    pub fn set_input_type(&mut self, i: usize, ty: TypeInfo) {
        if i >= self.tys.len() {
            self.tys.resize(i + 1, None);
            self.vals.resize(i + 1, None);
        }
        self.tys[i] = Some(ty);
        self.vals[i] = None;
    }

    pub fn op(&self) -> &str {
        self.op
    }

    /// Number of inputs, counting omitted optional ones in the middle.
    pub fn n_in(&self) -> usize {
        self.node.inputs.len()
    }
    pub fn n_out(&self) -> usize {
        self.node.outputs.len()
    }

    /// Whether input `i` is given (present and not the empty name).
    pub fn has(&self, i: usize) -> bool {
        self.node.input(i).is_some()
    }

    pub fn ty(&self, i: usize) -> Option<&TypeInfo> {
        self.tys.get(i).and_then(|t| t.as_ref())
    }

    /// The dtype of tensor input `i`, when known.
    pub fn dt(&self, i: usize) -> Option<DType> {
        match self.ty(i)? {
            TypeInfo::Tensor { dtype, .. } => *dtype,
            _ => None,
        }
    }

    /// The shape of tensor input `i`, when its rank is known.
    pub fn shape(&self, i: usize) -> Option<&[Dim]> {
        match self.ty(i)? {
            TypeInfo::Tensor { shape, .. } => shape.as_deref(),
            _ => None,
        }
    }

    pub fn rank(&self, i: usize) -> Option<usize> {
        self.shape(i).map(|s| s.len())
    }

    /// Input `i`'s shape; an error when the input is required but missing.
    pub fn need(&self, i: usize) -> R<()> {
        if self.has(i) {
            Ok(())
        } else {
            Err(format!("required input {i} is missing"))
        }
    }

    /// The known value of input `i`.
    pub fn val(&self, i: usize) -> Option<&Known> {
        self.vals.get(i).and_then(|v| v.as_ref())
    }

    /// Input `i` as fully known integers.
    pub fn ints(&self, i: usize) -> Option<Vec<i64>> {
        self.val(i)?.as_ints()
    }

    /// Input `i` as one known integer.
    pub fn int_scalar(&self, i: usize) -> Option<i64> {
        self.val(i)?.single()?.as_i64()
    }

    // ---- attributes -------------------------------------------------------------------

    fn attr_err(e: crate::IrError) -> String {
        match e {
            crate::IrError::Node { msg, .. } => msg,
            other => other.to_string(),
        }
    }

    pub fn has_attr(&self, name: &str) -> bool {
        self.node.attr(name).is_some()
    }
    pub fn int_attr(&self, name: &str) -> R<Option<i64>> {
        self.node.attr_int(name).map_err(Self::attr_err)
    }
    pub fn int_or(&self, name: &str, d: i64) -> R<i64> {
        Ok(self.int_attr(name)?.unwrap_or(d))
    }
    pub fn float_attr(&self, name: &str) -> R<Option<f32>> {
        self.node.attr_float(name).map_err(Self::attr_err)
    }
    pub fn str_or(&self, name: &str, d: &'a str) -> R<&'a str> {
        Ok(self
            .node
            .attr_str(name)
            .map_err(Self::attr_err)?
            .unwrap_or(d))
    }
    pub fn ints_attr(&self, name: &str) -> R<Option<&'a [i64]>> {
        self.node.attr_ints(name).map_err(Self::attr_err)
    }
    pub fn floats_attr(&self, name: &str) -> R<Option<&'a [f32]>> {
        self.node.attr_floats(name).map_err(Self::attr_err)
    }
    pub fn tensor_attr(&self, name: &str) -> R<Option<&'a Tensor>> {
        self.node.attr_tensor(name).map_err(Self::attr_err)
    }
    pub fn attr(&self, name: &str) -> Option<&'a Attr> {
        self.node.attr(name)
    }
    pub fn int_req(&self, name: &str) -> R<i64> {
        self.int_attr(name)?
            .ok_or_else(|| format!("required attribute '{name}' is missing"))
    }

    /// A dtype attribute (`to`, `dtype`, `output_dtype`): `Ok(None)` when absent, and an
    /// unknown dtype (one npuc has no enum for) when the code is not one of ours.
    pub fn dtype_attr(&self, name: &str) -> R<Option<Option<DType>>> {
        Ok(self
            .int_attr(name)?
            .map(|c| i32::try_from(c).ok().and_then(DType::from_onnx_code)))
    }
}
