//! Sequence and optional kernels: SequenceConstruct/Empty/At/Insert/Erase/Length,
//! SplitToSequence, ConcatFromSequence, SequenceMap, Optional, OptionalHasElement and
//! OptionalGetElement. Sequences are `Value::Sequence`, optionals `Value::Optional`.

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::common::norm_axis_incl;
use crate::ops::shape::{concat_tensors, real_axis, split_tensor, to_dim};
use crate::value::Value;
use npuc_ir::Tensor;

/// Takes input `i` as a sequence (an optional holding a sequence is unwrapped).
fn take_seq(ins: &mut Inputs, i: usize) -> Result<Vec<Value>> {
    match ins.take_value(i) {
        Some(Value::Sequence(s)) => Ok(s),
        Some(Value::Optional(Some(b))) => match *b {
            Value::Sequence(s) => Ok(s),
            v => bail!(
                "input {i} should be a sequence, found an optional {}",
                v.kind()
            ),
        },
        Some(v) => bail!("input {i} should be a sequence, found a {}", v.kind()),
        None => bail!("required input {i} is missing"),
    }
}

fn seq_ref(ins: &Inputs, i: usize) -> Result<&[Value]> {
    match ins.value(i) {
        Some(Value::Sequence(s)) => Ok(s),
        Some(v) => bail!("input {i} should be a sequence, found a {}", v.kind()),
        None => bail!("required input {i} is missing"),
    }
}

/// A scalar integer position input, if present.
fn position(ins: &Inputs, i: usize) -> Result<Option<i64>> {
    match ins.opt_tensor(i) {
        Some(t) => match t.to_i64_vec()?.as_slice() {
            [p] => Ok(Some(*p)),
            _ => bail!("position must be a scalar"),
        },
        None => Ok(None),
    }
}

/// Resolves `pos` in `[-len, len)` (or `[-len, len]` when `end_ok`).
fn resolve_pos(pos: i64, len: usize, end_ok: bool) -> Result<usize> {
    let n = len as i64;
    let p = if pos < 0 { pos + n } else { pos };
    let hi = if end_ok { n } else { n - 1 };
    if p < 0 || p > hi {
        bail!("position {pos} is out of range for a sequence of length {len}");
    }
    Ok(p as usize)
}

/// SequenceConstruct: a sequence of the input tensors.
fn sequence_construct(_ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let items = (0..ins.len())
        .map(|i| match ins.take_value(i) {
            Some(v @ Value::Tensor(_)) => Ok(v),
            Some(v) => bail!("SequenceConstruct input {i} is a {}", v.kind()),
            None => bail!("SequenceConstruct input {i} is missing"),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(vec![Value::Sequence(items)])
}

/// SequenceEmpty: an empty sequence (its `dtype` only matters for typing).
fn sequence_empty(_ctx: &OpCtx, _ins: Inputs) -> Result<Vec<Value>> {
    Ok(vec![Value::Sequence(vec![])])
}

/// SequenceAt: the element at `position` (negative counts from the back).
fn sequence_at(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let s = seq_ref(&ins, 0)?;
    let Some(p) = position(&ins, 1)? else {
        bail!("SequenceAt needs a position");
    };
    let p = resolve_pos(p, s.len(), false)?;
    Ok(vec![s[p].clone()])
}

/// SequenceInsert: inserts a tensor at `position` (default: the end).
fn sequence_insert(_ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let p = position(&ins, 2)?;
    let t = match ins.take_value(1) {
        Some(v @ Value::Tensor(_)) => v,
        _ => bail!("SequenceInsert needs a tensor to insert"),
    };
    let mut s = take_seq(&mut ins, 0)?;
    let p = match p {
        Some(p) => resolve_pos(p, s.len(), true)?,
        None => s.len(),
    };
    s.insert(p, t);
    Ok(vec![Value::Sequence(s)])
}

/// SequenceErase: removes the element at `position` (default: the last).
fn sequence_erase(_ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let p = position(&ins, 1)?;
    let mut s = take_seq(&mut ins, 0)?;
    if s.is_empty() {
        bail!("SequenceErase on an empty sequence");
    }
    let p = resolve_pos(p.unwrap_or(-1), s.len(), false)?;
    s.remove(p);
    Ok(vec![Value::Sequence(s)])
}

/// SequenceLength: the number of elements as an i64 scalar.
fn sequence_length(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = seq_ref(&ins, 0)?.len() as i64;
    Ok(vec![Value::tensor(Tensor::scalar(n))])
}

/// SplitToSequence: splits a tensor along `axis` into a sequence, by the `split` input
/// (a chunk size or a list of lengths), or into unit slices (squeezed unless `keepdims`).
fn split_to_sequence(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let t = ins.tensor(0)?;
    let axis = real_axis(ctx.node.int_or("axis", 0)?, t.rank())?;
    let dim = t.shape()[axis];
    let (lens, squeeze) = match ins.opt_tensor(1) {
        Some(s) if s.rank() == 0 => {
            let chunk = match s.to_i64_vec()?.first() {
                Some(&c) if c > 0 => c as usize,
                _ => bail!("split chunk size must be positive"),
            };
            let n = dim.div_ceil(chunk);
            let lens = (0..n).map(|i| chunk.min(dim - i * chunk)).collect();
            (lens, false)
        }
        Some(s) => (
            s.to_i64_vec()?
                .into_iter()
                .map(|v| to_dim(v, "split length"))
                .collect::<Result<Vec<_>>>()?,
            false,
        ),
        None => (vec![1; dim], ctx.node.int_or("keepdims", 1)? == 0),
    };
    let parts = split_tensor(t, axis, &lens)?;
    let items = parts
        .into_iter()
        .map(|p| {
            if squeeze {
                let mut shape = p.shape().to_vec();
                shape.remove(axis);
                Ok(Value::tensor(p.reshaped(shape)?))
            } else {
                Ok(Value::tensor(p))
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(vec![Value::Sequence(items)])
}

/// ConcatFromSequence: concatenates the tensors of a sequence along `axis`, or stacks them
/// along a new axis when `new_axis` is 1.
fn concat_from_sequence(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let s = seq_ref(&ins, 0)?;
    let ts: Vec<&Tensor> = s
        .iter()
        .map(|v| match v {
            Value::Tensor(t) => Ok(&**t),
            v => bail!("ConcatFromSequence element is a {}", v.kind()),
        })
        .collect::<Result<_>>()?;
    let Some(first) = ts.first() else {
        bail!("ConcatFromSequence on an empty sequence");
    };
    let axis = ctx.node.int_req("axis")?;
    if ctx.node.int_or("new_axis", 0)? == 0 {
        return Ok(vec![Value::tensor(concat_tensors(&ts, axis)?)]);
    }
    // Stack: give every element a unit dim at `axis`, then concatenate along it.
    let a = norm_axis_incl(axis, first.rank())?;
    let expanded = ts
        .iter()
        .map(|t| {
            let mut shape = t.shape().to_vec();
            shape.insert(a.min(shape.len()), 1);
            Ok((*t).clone().reshaped(shape)?)
        })
        .collect::<Result<Vec<Tensor>>>()?;
    let refs: Vec<&Tensor> = expanded.iter().collect();
    Ok(vec![Value::tensor(concat_tensors(&refs, a as i64)?)])
}

/// SequenceMap: runs the `body` graph once per element of the input sequence; additional
/// inputs are either sequences (indexed alongside) or tensors (passed to every iteration).
/// Each body output is collected into an output sequence.
fn sequence_map(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let n = seq_ref(&ins, 0)?.len();
    for i in 1..ins.len() {
        if let Some(Value::Sequence(s)) = ins.value(i) {
            if s.len() != n {
                bail!(
                    "SequenceMap input {i} has {} elements, expected {n}",
                    s.len()
                );
            }
        }
    }
    let n_out = ctx.node.outputs.len();
    let mut outs: Vec<Vec<Value>> = vec![Vec::with_capacity(n); n_out];
    for k in 0..n {
        let args = (0..ins.len())
            .map(|i| match ins.value(i) {
                Some(Value::Sequence(s)) => Ok(s[k].clone()),
                Some(v) => Ok(v.clone()),
                None => bail!("SequenceMap input {i} is missing"),
            })
            .collect::<Result<Vec<_>>>()?;
        let res = ctx.run_subgraph("body", args)?;
        if res.len() < n_out {
            bail!(
                "SequenceMap body produced {} outputs, expected {n_out}",
                res.len()
            );
        }
        for (o, v) in outs.iter_mut().zip(res) {
            o.push(v);
        }
    }
    Ok(outs.into_iter().map(Value::Sequence).collect())
}

/// Optional: wraps its input, or makes an empty optional when there is none.
fn optional(_ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    Ok(vec![Value::Optional(ins.take_value(0).map(Box::new))])
}

/// OptionalHasElement: whether the optional input holds a value (a plain tensor or
/// sequence counts as present, a missing input as absent).
fn optional_has_element(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let has = match ins.value(0) {
        None | Some(Value::Optional(None)) => false,
        Some(_) => true,
    };
    Ok(vec![Value::tensor(Tensor::scalar(has))])
}

/// OptionalGetElement: the value held by an optional (plain values pass through).
fn optional_get_element(_ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    match ins.take_value(0) {
        Some(Value::Optional(Some(v))) => Ok(vec![*v]),
        Some(Value::Optional(None)) => bail!("OptionalGetElement on an empty optional"),
        Some(v) => Ok(vec![v]),
        None => bail!("OptionalGetElement needs an input"),
    }
}

pub fn register(r: &mut Registry) {
    r.add("SequenceConstruct", 11, sequence_construct);
    r.add("SequenceEmpty", 11, sequence_empty);
    r.add("SequenceAt", 11, sequence_at);
    r.add("SequenceInsert", 11, sequence_insert);
    r.add("SequenceErase", 11, sequence_erase);
    r.add("SequenceLength", 11, sequence_length);
    r.add("SplitToSequence", 11, split_to_sequence);
    r.add("ConcatFromSequence", 11, concat_from_sequence);
    r.add("SequenceMap", 17, sequence_map);
    r.add("Optional", 15, optional);
    r.add("OptionalHasElement", 15, optional_has_element);
    r.add("OptionalGetElement", 15, optional_get_element);
}
