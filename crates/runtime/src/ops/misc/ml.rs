//! `ai.onnx.ml` ops: Binarizer, ArrayFeatureExtractor, LabelEncoder, TreeEnsemble.

use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry, MAX_OPSET};
use crate::ops::elementwise::{cast_tensor, Arith};
use crate::value::Value;
use crate::{bail, dispatch_numeric, dispatch_pod};
use npuc_ir::{DType, Tensor};
use std::collections::HashMap;

const ML: &str = "ai.onnx.ml";

/// Binarizer: 1 where x > threshold, else 0 (same dtype as x).
fn binarizer(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let th = ctx.node.float_or("threshold", 0.0)? as f64;
    let mut x = ins.take_tensor(0)?;
    dispatch_numeric!(x.dtype(), T => {
        let (one, zero) = (T::from_f64(1.0), T::zero());
        for v in x.as_mut_slice::<T>()? {
            *v = if v.to_f64() > th { one } else { zero };
        }
    });
    Ok(vec![Value::tensor(x)])
}

/// ArrayFeatureExtractor: selects `indices` along the last axis of X. A 1-D X gives a
/// `[1, k]` result (as onnxruntime does); otherwise the shape is `X.shape[..-1] + [k]`.
fn array_feature_extractor(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let idx = ins.tensor(1)?.to_i64_vec()?;
    let Some(&last) = x.shape().last() else {
        bail!("X must have at least one dimension");
    };
    let k = idx.len();
    let cols: Vec<usize> = idx
        .iter()
        .map(|&i| {
            if i < 0 || i as usize >= last {
                bail!("index {i} is out of range for a last dimension of {last}");
            }
            Ok(i as usize)
        })
        .collect::<Result<_>>()?;
    let rows = x.len().checked_div(last).unwrap_or(0);
    let shape = if x.rank() == 1 {
        vec![1, k]
    } else {
        let mut s = x.shape()[..x.rank() - 1].to_vec();
        s.push(k);
        s
    };
    let t = if x.dtype() == DType::String {
        let v = x.as_strings()?;
        let out = (0..rows)
            .flat_map(|r| cols.iter().map(move |&c| v[r * last + c].clone()))
            .collect();
        Tensor::from_strings(shape, out)?
    } else {
        dispatch_pod!(x.dtype(), T => {
            let v = x.as_slice::<T>()?;
            let out: Vec<T> = (0..rows)
                .flat_map(|r| cols.iter().map(move |&c| v[r * last + c]))
                .collect();
            Tensor::from_vec(shape, out)?
        })
    };
    Ok(vec![Value::tensor(t)])
}

/// A lookup key: strings, integers, or floats by their f64 bits (with −0 folded into +0).
#[derive(Hash, PartialEq, Eq, Clone)]
enum Key {
    S(String),
    I(i64),
    F(u64),
}

fn float_key(v: f64) -> Key {
    Key::F(if v == 0.0 { 0 } else { v.to_bits() })
}

/// The elements of a tensor as keys.
fn keys_of(t: &Tensor) -> Result<Vec<Key>> {
    Ok(match t.dtype() {
        DType::String => t.as_strings()?.iter().cloned().map(Key::S).collect(),
        d if d.is_float() => t.to_f64_vec()?.into_iter().map(float_key).collect(),
        _ => t.to_i64_vec()?.into_iter().map(Key::I).collect(),
    })
}

/// LabelEncoder: maps each element through the `keys_*` → `values_*` table (attributes
/// `*_strings`, `*_int64s`, `*_floats`, or since opset 4 `*_tensor`), using the matching
/// `default_*` for missing keys.
fn label_encoder(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = ctx.node;
    let x = ins.tensor(0)?;
    let keys: Vec<Key> = if let Some(k) = n.attr_strings("keys_strings")? {
        k.iter().cloned().map(Key::S).collect()
    } else if let Some(k) = n.attr_ints("keys_int64s")? {
        k.iter().map(|&v| Key::I(v)).collect()
    } else if let Some(k) = n.attr_floats("keys_floats")? {
        k.iter().map(|&v| float_key(v as f64)).collect()
    } else if let Some(k) = n.attr_tensor("keys_tensor")? {
        keys_of(k)?
    } else {
        bail!("LabelEncoder has no keys attribute");
    };
    // Values as a tensor plus the default (as a one-element tensor of the same dtype).
    let (values, default): (Tensor, Tensor) = if let Some(v) = n.attr_strings("values_strings")? {
        let d = n.str_or("default_string", "_Unused")?.to_string();
        (
            Tensor::from_strings(vec![v.len()], v.to_vec())?,
            Tensor::from_strings(vec![1], vec![d])?,
        )
    } else if let Some(v) = n.attr_ints("values_int64s")? {
        let d = n.int_or("default_int64", -1)?;
        (
            Tensor::from_vec(vec![v.len()], v.to_vec())?,
            Tensor::from_vec(vec![1], vec![d])?,
        )
    } else if let Some(v) = n.attr_floats("values_floats")? {
        let d = n.float_or("default_float", -0.0)?;
        (
            Tensor::from_vec(vec![v.len()], v.to_vec())?,
            Tensor::from_vec(vec![1], vec![d])?,
        )
    } else if let Some(v) = n.attr_tensor("values_tensor")? {
        let d = match n.attr_tensor("default_tensor")? {
            Some(d) => d.clone(),
            None => match v.dtype() {
                DType::String => Tensor::from_strings(vec![1], vec!["_Unused".into()])?,
                dt if dt.is_float() => cast_tensor(&Tensor::scalar(-0.0f32), dt)?,
                dt => cast_tensor(&Tensor::scalar(-1i64), dt)?,
            },
        };
        if d.dtype() != v.dtype() || d.len() != 1 {
            bail!("default_tensor must be one value of the values' dtype");
        }
        (v.clone(), d)
    } else {
        bail!("LabelEncoder has no values attribute");
    };
    if keys.len() != values.len() {
        bail!(
            "LabelEncoder has {} keys but {} values",
            keys.len(),
            values.len()
        );
    }
    // A repeated key keeps its last value, as in the reference's Python dict.
    let mut table: HashMap<Key, usize> = HashMap::with_capacity(keys.len());
    for (i, k) in keys.into_iter().enumerate() {
        table.insert(k, i);
    }
    let pick: Vec<Option<usize>> = keys_of(x)?.iter().map(|k| table.get(k).copied()).collect();
    let shape = x.shape().to_vec();
    let t = if values.dtype() == DType::String {
        let (v, d) = (values.as_strings()?, &default.as_strings()?[0]);
        let out = pick
            .iter()
            .map(|p| p.map_or_else(|| d.clone(), |i| v[i].clone()))
            .collect();
        Tensor::from_strings(shape, out)?
    } else {
        dispatch_pod!(values.dtype(), T => {
            let (v, d) = (values.as_slice::<T>()?, default.as_slice::<T>()?[0]);
            let out: Vec<T> = pick.iter().map(|p| p.map_or(d, |i| v[i])).collect();
            Tensor::from_vec(shape, out)?
        })
    };
    Ok(vec![Value::tensor(t)])
}

/// A decision node of a [`Forest`]; children are node indices or leaf indices.
struct Split {
    mode: i64,
    feature: usize,
    value: f64,
    /// Set members for mode MEMBER.
    members: Vec<f64>,
    missing_true: bool,
    child: [(bool, usize); 2],
}

/// TreeEnsemble (ai.onnx.ml opset 5): sums (or averages, min/max) leaf weights per target
/// over all trees, then applies `post_transform`.
fn tree_ensemble(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = ctx.node;
    let x = ins.tensor(0)?;
    if x.rank() != 2 {
        bail!("TreeEnsemble input must be 2-D, got shape {:?}", x.shape());
    }
    let (rows, feats) = (x.shape()[0], x.shape()[1]);
    let xv = x.to_f64_vec()?;
    let tensor_vals = |name: &str| -> Result<Vec<f64>> {
        match n.attr_tensor(name)? {
            Some(t) => Ok(t.to_f64_vec()?),
            None => bail!("required attribute '{name}' is missing"),
        }
    };
    let splits = tensor_vals("nodes_splits")?;
    let weights = tensor_vals("leaf_weights")?;
    let features = n.ints_req("nodes_featureids")?;
    // nodes_modes is a uint8 tensor attribute in opset 5 (accept plain ints too).
    let modes: Vec<i64> = match n.attr("nodes_modes") {
        Some(npuc_ir::Attr::Tensor(t)) => t.to_i64_vec()?,
        _ => n.ints_req("nodes_modes")?.to_vec(),
    };
    let true_ids = n.ints_req("nodes_truenodeids")?;
    let false_ids = n.ints_req("nodes_falsenodeids")?;
    let true_leafs = n.ints_req("nodes_trueleafs")?;
    let false_leafs = n.ints_req("nodes_falseleafs")?;
    let targets = n.ints_req("leaf_targetids")?;
    let roots = n.ints_req("tree_roots")?;
    let missing = n
        .attr_ints("nodes_missing_value_tracks_true")?
        .unwrap_or(&[]);
    let n_targets = n.int_req("n_targets")?;
    let aggregate = n.int_or("aggregate_function", 1)?;
    let post = n.int_or("post_transform", 0)?;
    let members = match n.attr_tensor("membership_values")? {
        Some(t) => t.to_f64_vec()?,
        None => vec![],
    };
    let nn = splits.len();
    if [features.len(), modes.len(), true_ids.len(), false_ids.len()]
        .iter()
        .chain([true_leafs.len(), false_leafs.len()].iter())
        .any(|&l| l != nn)
    {
        bail!("TreeEnsemble node attributes have different lengths");
    }
    if targets.len() != weights.len() {
        bail!("leaf_targetids and leaf_weights have different lengths");
    }
    if n_targets <= 0 || targets.iter().any(|&t| t < 0 || t >= n_targets) {
        bail!("leaf target ids must lie in [0, n_targets={n_targets})");
    }
    let child = |id: i64, leaf: i64| -> Result<(bool, usize)> {
        let lim = if leaf != 0 { weights.len() } else { nn };
        if id < 0 || id as usize >= lim {
            bail!("tree child index {id} is out of range");
        }
        Ok((leaf != 0, id as usize))
    };
    // Membership sets are listed in node order, each terminated by NaN.
    let mut member_sets = members.split(|v| v.is_nan());
    let mut nodes = Vec::with_capacity(nn);
    for i in 0..nn {
        if features[i] < 0 || features[i] as usize >= feats {
            bail!(
                "feature id {} is out of range for {feats} features",
                features[i]
            );
        }
        if !(0..=6).contains(&modes[i]) {
            bail!("unknown node mode {}", modes[i]);
        }
        let set = if modes[i] == 6 {
            match member_sets.next() {
                Some(s) => s.to_vec(),
                None => bail!("membership_values has no set for node {i}"),
            }
        } else {
            vec![]
        };
        nodes.push(Split {
            mode: modes[i],
            feature: features[i] as usize,
            value: splits[i],
            members: set,
            missing_true: missing.get(i).is_some_and(|&m| m != 0),
            child: [
                child(true_ids[i], true_leafs[i])?,
                child(false_ids[i], false_leafs[i])?,
            ],
        });
    }
    // A root whose both branches are the same leaf is a lone leaf.
    let starts: Vec<(bool, usize)> = roots
        .iter()
        .map(|&r| {
            if r < 0 || r as usize >= nn {
                bail!("tree root {r} is out of range");
            }
            let nd = &nodes[r as usize];
            Ok(
                if nd.child[0].0 && nd.child[1].0 && nd.child[0] == nd.child[1] {
                    nd.child[0]
                } else {
                    (false, r as usize)
                },
            )
        })
        .collect::<Result<_>>()?;
    let nt = n_targets as usize;
    let init = match aggregate {
        0 | 1 => 0.0,
        2 => f64::MAX,
        3 => f64::MIN,
        other => bail!("unknown aggregate_function {other}"),
    };
    let mut out = vec![init; rows * nt];
    for r in 0..rows {
        let row = &xv[r * feats..(r + 1) * feats];
        for &start in &starts {
            let mut cur = start;
            // Each step moves to a child; more steps than nodes means a cycle.
            let mut steps = 0;
            while !cur.0 {
                steps += 1;
                if steps > nn {
                    bail!("tree structure contains a cycle");
                }
                let nd = &nodes[cur.1];
                let v = row[nd.feature];
                let hit = match nd.mode {
                    0 => v <= nd.value,
                    1 => v < nd.value,
                    2 => v >= nd.value,
                    3 => v > nd.value,
                    4 => v == nd.value,
                    5 => v != nd.value,
                    _ => nd.members.contains(&v),
                } || (nd.missing_true && v.is_nan());
                cur = nd.child[if hit { 0 } else { 1 }];
            }
            let (w, t) = (weights[cur.1], targets[cur.1] as usize);
            let slot = &mut out[r * nt + t];
            *slot = match aggregate {
                0 => *slot + w / starts.len() as f64,
                1 => *slot + w,
                2 => slot.min(w),
                _ => slot.max(w),
            };
        }
        let row = &mut out[r * nt..(r + 1) * nt];
        match post {
            0 => {}
            1 | 3 => {
                // SOFTMAX; SOFTMAX_ZERO leaves zeros out of the normalisation.
                let zero_aware = post == 3;
                let m = row.iter().fold(f64::MIN, |a, &b| a.max(b));
                let mut s = 0.0;
                for v in row.iter_mut() {
                    if !(zero_aware && *v == 0.0) {
                        *v = (*v - m).exp();
                        s += *v;
                    }
                }
                for v in row.iter_mut() {
                    if !(zero_aware && *v == 0.0) {
                        *v /= s;
                    }
                }
            }
            2 => row.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
            other => bail!("post_transform {other} is not supported"),
        }
    }
    let t = Tensor::from_vec(vec![rows, nt], out)?;
    Ok(vec![Value::tensor(cast_tensor(&t, x.dtype())?)])
}

pub fn register(r: &mut Registry) {
    r.add_range(ML, "Binarizer", 1, MAX_OPSET, binarizer);
    r.add_range(
        ML,
        "ArrayFeatureExtractor",
        1,
        MAX_OPSET,
        array_feature_extractor,
    );
    r.add_range(ML, "LabelEncoder", 2, MAX_OPSET, label_encoder);
    r.add_range(ML, "TreeEnsemble", 5, MAX_OPSET, tree_ensemble);
}
