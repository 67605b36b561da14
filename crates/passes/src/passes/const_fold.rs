//! Constant folding.
//!
//! 1. A pure node (deterministic, no subgraphs) whose inputs are all constants (initializers
//!    that no feed can override, or earlier folded values) is evaluated once with the npuc
//!    runtime — a one-node model with the same opset imports — and its outputs become
//!    initializers. The result is exactly what the node would compute at run time.
//! 2. Values that static inference ([`npuc_ir::infer`]) proves constant — typically shape
//!    arithmetic such as `Shape -> Gather -> Unsqueeze -> Concat` over statically known dims —
//!    become initializers too (integer and bool values only: those are computed exactly).
//!
//! Results larger than `max_bytes` are only folded when they are no larger than the node's
//! constant inputs together, so `ConstantOfShape`/`Expand`/`Tile` never blow up the model.
//!
//! With `keep_dequantize` (the standard pipeline), a `DequantizeLinear` of a constant stays: in
//! a QDQ graph it is what marks the weight as quantized (folding it would leave float weights
//! 4x the size and nothing for the integer lowering to match). The load-time lowering folds
//! the ones that stay in float afterwards (`keep_dequantize: false`).

use crate::util::{is_pure, Index};
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};
use npuc_ir::infer::{infer_model, Known, Scalar};
use npuc_ir::{DType, Graph, Initializer, Model, Node, Tensor, TypeInfo, ValueInfo};
use npuc_runtime::{Session, SessionOptions, Value};
use std::collections::{HashMap, HashSet};

pub struct ConstFold {
    pub max_bytes: usize,
    /// Leave `DequantizeLinear` (ONNX or `com.microsoft`) of constants unfolded.
    pub keep_dequantize: bool,
}

/// Bytes of a tensor's payload (strings counted by length).
fn bytes_of(t: &Tensor) -> usize {
    if t.dtype() == DType::String {
        return t
            .as_strings()
            .map(|s| s.iter().map(|x| x.len()).sum())
            .unwrap_or(0);
    }
    t.len() * t.dtype().size().max(1)
}

/// Evaluates `n` on constant inputs with the runtime; `None` when it cannot (unsupported,
/// malformed, non-tensor outputs).
fn evaluate(m: &Model, n: &Node, inputs: &[(String, Tensor)]) -> Option<Vec<Tensor>> {
    let outs: Vec<String> = n
        .outputs
        .iter()
        .filter(|o| !o.is_empty())
        .cloned()
        .collect();
    let one = Model {
        ir_version: m.ir_version,
        opset_imports: m.opset_imports.clone(),
        graph: Graph {
            name: "fold".into(),
            nodes: vec![n.clone()],
            initializers: inputs
                .iter()
                .map(|(name, t)| Initializer {
                    name: name.clone(),
                    tensor: t.clone(),
                })
                .collect(),
            outputs: outs
                .iter()
                .map(|o| ValueInfo::new(o.clone(), None))
                .collect(),
            ..Default::default()
        },
        ..Default::default()
    };
    let s = Session::new(&one, SessionOptions { threads: 1 }).ok()?;
    let res = s.run(vec![]).ok()?;
    res.into_iter()
        .map(|(_, v)| match v {
            Value::Tensor(t) => {
                Some(std::sync::Arc::try_unwrap(t).unwrap_or_else(|t| (*t).clone()))
            }
            _ => None,
        })
        .collect()
}

/// A fully known integer/bool value as a tensor of its dtype.
fn known_tensor(k: &Known) -> Option<Tensor> {
    let ints: Option<Vec<i64>> = k
        .data
        .iter()
        .map(|s| match s {
            Scalar::Int(i) => Some(*i),
            _ => None,
        })
        .collect();
    let ints = ints?;
    let shape = k.shape.clone();
    match k.dtype {
        DType::I64 => Tensor::from_vec(shape, ints).ok(),
        DType::I32 => Tensor::from_vec(
            shape,
            ints.iter()
                .map(|&v| i32::try_from(v).ok())
                .collect::<Option<Vec<_>>>()?,
        )
        .ok(),
        DType::Bool => Tensor::from_vec(shape, ints.iter().map(|&v| v != 0).collect()).ok(),
        _ => None,
    }
}

/// A `DequantizeLinear` of the ONNX or `com.microsoft` domain.
fn is_dequantize(n: &Node) -> bool {
    n.op_type == "DequantizeLinear" && matches!(n.domain.as_str(), "" | "ai.onnx" | "com.microsoft")
}

impl ConstFold {
    fn fold_by_runtime(&self, m: &Model) -> GraphPatch {
        let mut patch = GraphPatch::new();
        let order = match m.graph.topo_order(&HashSet::new()) {
            Ok(o) => o,
            Err(_) => return patch,
        };
        let ix = Index::new(&m.graph);
        // Constants available so far (graph-input initializers are not constant).
        let mut known: HashMap<String, usize> = m
            .graph
            .initializers
            .iter()
            .enumerate()
            .filter(|(_, i)| !ix.graph_inputs.contains(&i.name))
            .map(|(k, i)| (i.name.clone(), k))
            .collect();
        let mut new_inits: Vec<Initializer> = vec![];
        let reg = npuc_runtime::registry();
        for i in order {
            let n = &m.graph.nodes[i];
            if self.keep_dequantize && is_dequantize(n) {
                continue;
            }
            if !is_pure(n)
                || n.outputs.iter().all(|o| o.is_empty())
                || n.outputs.iter().any(|o| ix.captured.contains(o))
            {
                continue;
            }
            if !n
                .inputs
                .iter()
                .all(|s| s.is_empty() || known.contains_key(s))
            {
                continue;
            }
            if reg
                .find(&n.domain, &n.op_type, m.opset(&n.domain).unwrap_or(1))
                .is_none()
            {
                continue;
            }
            let get = |name: &String| -> Option<&Tensor> {
                let &k = known.get(name)?;
                let g = &m.graph;
                if k < g.initializers.len() {
                    Some(&g.initializers[k].tensor)
                } else {
                    new_inits.get(k - g.initializers.len()).map(|i| &i.tensor)
                }
            };
            let mut ins: Vec<(String, Tensor)> = vec![];
            let mut in_bytes = 0;
            for s in n.inputs.iter().filter(|s| !s.is_empty()) {
                if ins.iter().any(|(x, _)| x == s) {
                    continue;
                }
                let Some(t) = get(s) else { continue };
                in_bytes += bytes_of(t);
                ins.push((s.clone(), t.clone()));
            }
            // A `Constant` node's input is its value attribute: turning it into an initializer
            // never grows the model. (Counted as no input, a 2.6 MB classifier weight of
            // PP-OCRv5 cls stayed a node, so its Conv repacked the weight on every run.)
            if let Some(v) = crate::util::constant_node_value(n) {
                in_bytes += bytes_of(&v);
            }
            // Results too large to keep are never computed: their size is predicted from the
            // inputs first (a Pad of 2^40 or a OneHot of depth 2^40 must not be materialized to
            // find out).
            let refs: Vec<Option<&Tensor>> = n
                .inputs
                .iter()
                .map(|s| if s.is_empty() { None } else { get(s) })
                .collect();
            let opset = m.opset(&n.domain).unwrap_or(1);
            if let Some(Ok(tys)) = npuc_ir::infer::node_output_types(n, opset, &refs) {
                let predicted = tys
                    .iter()
                    .try_fold(0u128, |acc, ty| Some(acc.saturating_add(ty.fixed_bytes()?)));
                if predicted.is_some_and(|b| b > self.max_bytes as u128 && b > in_bytes as u128) {
                    continue;
                }
            }
            let Some(outs) = evaluate(m, n, &ins) else {
                continue;
            };
            let out_bytes: usize = outs.iter().map(bytes_of).sum();
            if out_bytes > self.max_bytes && out_bytes > in_bytes {
                continue;
            }
            let names: Vec<String> = n
                .outputs
                .iter()
                .filter(|o| !o.is_empty())
                .cloned()
                .collect();
            for (name, t) in names.into_iter().zip(outs) {
                known.insert(name.clone(), m.graph.initializers.len() + new_inits.len());
                new_inits.push(Initializer { name, tensor: t });
            }
            patch.remove(i);
        }
        for i in new_inits {
            patch.add_initializer(i.name, i.tensor);
        }
        patch
    }

    fn fold_by_inference(&self, m: &Model) -> GraphPatch {
        let r = infer_model(m, &HashMap::new());
        let ix = Index::new(&m.graph);
        let mut patch = GraphPatch::new();
        for (i, n) in m.graph.nodes.iter().enumerate() {
            if !is_pure(n) || n.outputs.iter().all(|o| o.is_empty()) {
                continue;
            }
            let outs: Option<Vec<(String, Tensor)>> = n
                .outputs
                .iter()
                .filter(|o| !o.is_empty())
                .map(|o| {
                    if ix.captured.contains(o) {
                        return None;
                    }
                    let k = r.values.get(o)?;
                    // The inferred type must agree with the value (never trust a mismatch).
                    if let Some(TypeInfo::Tensor { dtype: Some(d), .. }) = r.type_of(o) {
                        if *d != k.dtype {
                            return None;
                        }
                    }
                    Some((o.clone(), known_tensor(k)?))
                })
                .collect();
            if let Some(outs) = outs {
                for (name, t) in outs {
                    patch.add_initializer(name, t);
                }
                patch.remove(i);
            }
        }
        patch
    }
}

impl Pass for ConstFold {
    fn name(&self) -> &'static str {
        "const-fold"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        // Inference sees the constants the runtime folded, so it runs on the result.
        let mut folded = 0;
        for stage in [Self::fold_by_runtime, Self::fold_by_inference] {
            let patch = stage(self, rw.model());
            folded += patch.removed();
            rw.apply(patch);
        }
        Ok(PassStats::new(folded))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;
    use npuc_ir::{Attr, Dim};

    #[test]
    fn folds_constant_chain_and_shape() {
        let mut m = model(
            vec![
                Node::new("Constant", &[], &["c"])
                    .with_attr("value", Attr::Tensor(f32s(&[3], &[1.0, 2.0, 3.0]))),
                Node::new("Transpose", &["w"], &["wt"]).with_attr("perm", Attr::Ints(vec![1, 0])),
                Node::new("MatMul", &["x", "wt"], &["a"]),
                Node::new("Shape", &["a"], &["s"]),
                Node::new("Reshape", &["a", "s"], &["b"]),
                Node::new("Add", &["b", "c"], &["y"]),
            ],
            &[("x", &[2, 2])],
            &["y"],
        );
        m.graph.initializers.push(init("w", data(&[3, 2], 7)));
        let (opt, n) = check_pass(
            &ConstFold {
                max_bytes: 1 << 20,
                keep_dequantize: true,
            },
            &m,
            &[("x", data(&[2, 2], 2))],
        );
        assert_eq!(n, 3);
        assert_eq!(ops(&opt), ["MatMul", "Reshape", "Add"]);
    }

    #[test]
    fn keeps_big_constant_of_shape_and_symbolic_shapes() {
        let mut m = model(
            vec![
                Node::new("ConstantOfShape", &["shape"], &["big"]),
                Node::new("Shape", &["x"], &["s"]),
                Node::new("ReduceSum", &["big"], &["t"]).with_attr("keepdims", Attr::Int(0)),
                Node::new("Cast", &["s"], &["sf"]).with_attr("to", Attr::Int(1)),
                Node::new("Add", &["sf", "t"], &["y"]),
            ],
            &[("x", &[2])],
            &["y"],
        );
        m.graph.inputs[0].ty = Some(TypeInfo::Tensor {
            dtype: Some(DType::F32),
            shape: Some(vec![Dim::Symbolic("n".into())]),
        });
        m.graph
            .initializers
            .push(init("shape", i64s(&[1], &[1 << 20])));
        let (opt, n) = check_pass(
            &ConstFold {
                max_bytes: 1 << 16,
                keep_dequantize: true,
            },
            &m,
            &[("x", data(&[2], 2))],
        );
        assert_eq!(n, 0);
        assert_eq!(opt.graph.nodes.len(), 5);
    }

    #[test]
    fn lifts_a_constant_node_larger_than_max_bytes() {
        // 4 KB of value with a 1 KB limit: lifting it to an initializer does not grow the model,
        // and a kernel can then treat it as a constant weight.
        let w: Vec<f32> = (0..1024).map(|i| i as f32 * 0.5).collect();
        let m = model(
            vec![
                Node::new("Constant", &[], &["w"])
                    .with_attr("value", Attr::Tensor(f32s(&[2, 512], &w))),
                Node::new("Add", &["x", "w"], &["y"]),
            ],
            &[("x", &[2, 512])],
            &["y"],
        );
        let (opt, n) = check_pass(
            &ConstFold {
                max_bytes: 1 << 10,
                keep_dequantize: true,
            },
            &m,
            &[("x", data(&[2, 512], 2))],
        );
        assert_eq!(n, 1);
        assert_eq!(ops(&opt), ["Add"]);
        assert!(opt.graph.initializers.iter().any(|i| i.name == "w"));
    }

    #[test]
    fn keeps_the_dequantize_of_a_quantized_weight() {
        let mut m = model(
            vec![
                Node::new("DequantizeLinear", &["wq", "ws", "wz"], &["w"]),
                Node::new("MatMul", &["x", "w"], &["y"]),
            ],
            &[("x", &[2, 2])],
            &["y"],
        );
        m.graph.initializers.push(init(
            "wq",
            Tensor::from_vec(vec![2, 2], vec![1i8, -2, 3, -4]).unwrap(),
        ));
        m.graph
            .initializers
            .push(init("ws", Tensor::scalar(0.5f32)));
        m.graph.initializers.push(init("wz", Tensor::scalar(0i8)));
        let feeds = [("x", data(&[2, 2], 3))];
        let (kept, n) = check_pass(
            &ConstFold {
                max_bytes: 1 << 20,
                keep_dequantize: true,
            },
            &m,
            &feeds,
        );
        assert_eq!(n, 0);
        assert_eq!(ops(&kept), ["DequantizeLinear", "MatMul"]);
        let (folded, n) = check_pass(
            &ConstFold {
                max_bytes: 1 << 20,
                keep_dequantize: false,
            },
            &m,
            &feeds,
        );
        assert_eq!(n, 1);
        assert_eq!(ops(&folded), ["MatMul"]);
    }
}
