//! Control flow (If, Loop, Scan) and the ai.onnx.preview.training optimizers (Adagrad, Adam,
//! Momentum).

use crate::bail;
use crate::error::{Result, RtError};
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::common::{norm_axis, norm_axis_incl};
use crate::value::Value;
use npuc_ir::{DType, Dim, Elem, Tensor, TypeInfo};

pub fn register(r: &mut Registry) {
    r.add("If", 1, if_op);
    r.add("Loop", 1, loop_op);
    r.add("Scan", 8, scan_op);
    const TRAINING: &str = "ai.onnx.preview.training";
    r.add_range(TRAINING, "Adagrad", 1, 1, adagrad);
    r.add_range(TRAINING, "Adam", 1, 1, adam);
    r.add_range(TRAINING, "Momentum", 1, 1, momentum);
}

// ---------------------------------------------------------------------------------------------
// Tensor helpers for slicing and stacking along an axis (all dtypes, strings included)
// ---------------------------------------------------------------------------------------------

/// Builds a tensor of `dtype` from a typed Vec; 4-bit types travel as their i8/u8 carriers.
fn typed_tensor<T: Elem>(dtype: DType, shape: Vec<usize>, v: Vec<T>) -> Result<Tensor> {
    let t = Tensor::from_vec(shape, v)?;
    if matches!(dtype, DType::I4 | DType::U4) {
        let shape = t.shape().to_vec();
        return Ok(Tensor::from_4bit(dtype, shape, t.to_le_bytes()?)?);
    }
    Ok(t)
}

/// `t[.., idx, ..]` along `axis`, with that axis removed.
pub fn slice_axis(t: &Tensor, axis: usize, idx: usize) -> Result<Tensor> {
    let shape = t.shape();
    if axis >= shape.len() || idx >= shape[axis] {
        bail!("index {idx} on axis {axis} is out of range for shape {shape:?}");
    }
    let outer: usize = shape[..axis].iter().product();
    let d = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out_shape = shape.to_vec();
    out_shape.remove(axis);
    fn go<T: Clone>(s: &[T], outer: usize, d: usize, inner: usize, idx: usize) -> Vec<T> {
        let mut v = Vec::with_capacity(outer * inner);
        for o in 0..outer {
            v.extend_from_slice(&s[(o * d + idx) * inner..][..inner]);
        }
        v
    }
    if t.dtype() == DType::String {
        let v = go(t.as_strings()?, outer, d, inner, idx);
        return Ok(Tensor::from_strings(out_shape, v)?);
    }
    crate::dispatch_pod!(t.dtype(), T => {
        let v = go(t.as_slice::<T>()?, outer, d, inner, idx);
        typed_tensor(t.dtype(), out_shape, v)
    })
}

/// Stacks same-shaped, same-typed tensors along a new axis `axis` (`0..=rank`).
pub fn stack(parts: &[&Tensor], axis: usize) -> Result<Tensor> {
    let Some(first) = parts.first() else {
        bail!("cannot stack zero tensors");
    };
    let shape = first.shape();
    if axis > shape.len() {
        bail!("stack axis {axis} is out of range for rank {}", shape.len());
    }
    for p in parts {
        if p.shape() != shape || p.dtype() != first.dtype() {
            bail!(
                "stacked values differ across iterations: {} {:?} vs {} {:?}",
                first.dtype(),
                shape,
                p.dtype(),
                p.shape()
            );
        }
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis..].iter().product();
    let mut out_shape = shape.to_vec();
    out_shape.insert(axis, parts.len());
    fn go<T: Clone>(srcs: &[&[T]], outer: usize, inner: usize) -> Vec<T> {
        let mut v = Vec::with_capacity(outer * inner * srcs.len());
        for o in 0..outer {
            for s in srcs {
                v.extend_from_slice(&s[o * inner..][..inner]);
            }
        }
        v
    }
    if first.dtype() == DType::String {
        let srcs = parts
            .iter()
            .map(|p| p.as_strings())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        return Ok(Tensor::from_strings(out_shape, go(&srcs, outer, inner))?);
    }
    crate::dispatch_pod!(first.dtype(), T => {
        let srcs = parts
            .iter()
            .map(|p| p.as_slice::<T>())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        typed_tensor(first.dtype(), out_shape, go(&srcs, outer, inner))
    })
}

/// An empty scan output for a loop that ran zero times: `[0]` followed by the body output's
/// declared (fixed) dims, inserted at `axis`.
fn empty_scan_output(ty: Option<&TypeInfo>, axis: i64) -> Result<Tensor> {
    let Some(TypeInfo::Tensor {
        dtype: Some(dt),
        shape,
    }) = ty
    else {
        bail!("zero iterations and the body does not declare its scan output's tensor type");
    };
    let mut dims: Vec<usize> = match shape {
        Some(s) => s
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => Ok(*n),
                _ => Err(RtError::msg(
                    "zero iterations and the body's scan output has a symbolic shape",
                )),
            })
            .collect::<Result<_>>()?,
        None => vec![],
    };
    let ax = norm_axis_incl(axis, dims.len())?;
    dims.insert(ax, 0);
    Ok(Tensor::zeros(*dt, dims))
}

fn as_tensor<'a>(v: &'a Value, what: &str) -> Result<&'a Tensor> {
    v.as_tensor()
        .ok_or_else(|| RtError::msg(format!("{what} must be a tensor, got a {}", v.kind())))
}

/// Reads a boolean condition (a one-element bool tensor).
fn cond_value(t: &Tensor) -> Result<bool> {
    if t.len() != 1 {
        bail!(
            "condition must have exactly one element, got shape {:?}",
            t.shape()
        );
    }
    Ok(match t.dtype() {
        DType::Bool => t.as_slice::<bool>()?[0],
        _ => t.to_f64_vec()?[0] != 0.0,
    })
}

// ---------------------------------------------------------------------------------------------
// If
// ---------------------------------------------------------------------------------------------

/// If (opsets 1..): runs `then_branch` or `else_branch` and returns its outputs (tensors,
/// sequences or optionals).
fn if_op(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let c = cond_value(ins.tensor(0)?)?;
    let branch = if c { "then_branch" } else { "else_branch" };
    let out = ctx.run_subgraph(branch, vec![])?;
    if out.len() < ctx.node.outputs.len() {
        bail!(
            "{branch} produced {} outputs, the node declares {}",
            out.len(),
            ctx.node.outputs.len()
        );
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Loop
// ---------------------------------------------------------------------------------------------

/// Loop (opsets 1..): runs `body` while `i < M` and `cond` hold (either may be absent; an
/// absent `cond` input means the body's condition output is ignored). Loop-carried values may be
/// tensors, sequences or optionals; scan outputs are stacked along a new axis 0.
fn loop_op(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let max_trip = match ins.opt_tensor(0) {
        Some(m) => {
            if m.len() != 1 {
                bail!("M must have one element, got shape {:?}", m.shape());
            }
            Some(m.to_i64_vec()?[0])
        }
        None => None,
    };
    let cond_given = ins.opt_tensor(1).is_some();
    let mut cond = match ins.opt_tensor(1) {
        Some(c) => cond_value(c)?,
        None => true,
    };
    let n_carried = ins.len().saturating_sub(2);
    let mut carried: Vec<Value> = Vec::with_capacity(n_carried);
    for i in 2..ins.len() {
        match ins.take_value(i) {
            Some(v) => carried.push(v),
            None => bail!("loop-carried input {} is missing", i - 2),
        }
    }
    let body = ctx
        .node
        .attr_graph("body")?
        .ok_or_else(|| RtError::msg("Loop needs a 'body' graph"))?;
    if body.inputs.len() != 2 + n_carried {
        bail!(
            "body takes {} inputs, expected 2 + {n_carried} loop-carried values",
            body.inputs.len()
        );
    }
    if body.outputs.len() < 1 + n_carried {
        bail!(
            "body returns {} outputs, expected at least 1 + {n_carried}",
            body.outputs.len()
        );
    }
    let k_scan = body.outputs.len() - 1 - n_carried;
    let mut scans: Vec<Vec<Value>> = vec![vec![]; k_scan];
    let mut it: i64 = 0;
    let limit = crate::limits::max_loop_iterations();
    // Bytes the scan outputs hold so far; stacking them at the end needs as much again.
    let mut scan_bytes: u128 = 0;
    while cond && max_trip.is_none_or(|m| it < m) {
        if it as u64 >= limit {
            bail!(
                "stopped after {limit} iterations (trip count {}, condition still true): more than \
                 the iteration limit; set NPUC_MAX_LOOP_ITERATIONS to allow more",
                max_trip.map_or("none".to_string(), |m| m.to_string())
            );
        }
        let mut inputs = Vec::with_capacity(2 + n_carried);
        inputs.push(Value::tensor(Tensor::scalar(it)));
        inputs.push(Value::tensor(Tensor::scalar(cond)));
        inputs.append(&mut carried);
        let mut out = ctx.run_subgraph("body", inputs)?;
        if out.len() != 1 + n_carried + k_scan {
            bail!(
                "body returned {} values, expected {}",
                out.len(),
                1 + n_carried + k_scan
            );
        }
        let scan_vals = out.split_off(1 + n_carried);
        carried = out.split_off(1);
        if cond_given {
            cond = cond_value(as_tensor(&out[0], "the body's condition")?)?;
        }
        for (acc, v) in scans.iter_mut().zip(scan_vals) {
            if let Some(t) = v.as_tensor() {
                scan_bytes += (t.len() * t.dtype().size().max(1)) as u128;
            }
            acc.push(v);
        }
        it += 1;
        if k_scan > 0 {
            crate::limits::check_bytes(2 * scan_bytes, || {
                format!(
                    "the scan outputs after {it} iterations (of {})",
                    max_trip.map_or("an unbounded number".to_string(), |m| m.to_string())
                )
            })
            .map_err(RtError::Msg)?;
        }
    }
    let mut results = carried;
    for (k, acc) in scans.iter().enumerate() {
        if acc.is_empty() {
            let ty = body.outputs[1 + n_carried + k].ty.as_ref();
            results.push(Value::tensor(empty_scan_output(ty, 0)?));
            continue;
        }
        let parts = acc
            .iter()
            .map(|v| as_tensor(v, "a scan output"))
            .collect::<Result<Vec<_>>>()?;
        results.push(Value::tensor(stack(&parts, 0)?));
    }
    Ok(results)
}

// ---------------------------------------------------------------------------------------------
// Scan
// ---------------------------------------------------------------------------------------------

/// Reads an optional per-input int list attribute, defaulting missing entries to 0.
fn per_input(ctx: &OpCtx, name: &str, n: usize) -> Result<Vec<i64>> {
    let mut v = ctx
        .node
        .attr_ints(name)?
        .map(|s| s.to_vec())
        .unwrap_or_default();
    if v.len() > n {
        bail!(
            "attribute '{name}' has {} entries, expected at most {n}",
            v.len()
        );
    }
    v.resize(n, 0);
    Ok(v)
}

/// Scan (opsets 8..): iterates `body` over slices of the scan inputs carrying state variables.
/// Opset 8 has a leading batch axis and optional `sequence_lens`; opset 9+ has per-input scan
/// axes and directions and per-output axes and directions.
fn scan_op(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    if ctx.opset <= 8 {
        return scan8(ctx, ins);
    }
    let m = ctx.node.int_req("num_scan_inputs")?;
    if m < 1 || m as usize > ins.len() {
        bail!("num_scan_inputs {m} does not fit {} inputs", ins.len());
    }
    let m = m as usize;
    let n_state = ins.len() - m;
    let n_out = ctx.node.outputs.len();
    if n_out < n_state {
        bail!("Scan has {n_out} outputs for {n_state} state variables");
    }
    let k_scan = n_out - n_state;
    let in_axes = per_input(ctx, "scan_input_axes", m)?;
    let in_dirs = per_input(ctx, "scan_input_directions", m)?;
    let out_axes = per_input(ctx, "scan_output_axes", k_scan)?;
    let out_dirs = per_input(ctx, "scan_output_directions", k_scan)?;
    let mut states: Vec<Value> = (0..n_state)
        .map(|i| {
            ins.value(i)
                .cloned()
                .ok_or_else(|| RtError::msg(format!("state input {i} is missing")))
        })
        .collect::<Result<_>>()?;
    let mut scan_ins = Vec::with_capacity(m);
    let mut axes = Vec::with_capacity(m);
    let mut steps: Option<usize> = None;
    for (j, &in_axis) in in_axes.iter().enumerate() {
        let t = ins.tensor(n_state + j)?;
        let ax = norm_axis(in_axis, t.rank())?;
        if t.rank() == 0 {
            bail!("scan input {j} is a scalar");
        }
        let len = t.shape()[ax];
        if steps.is_some_and(|s| s != len) {
            bail!("scan inputs have different lengths along their scan axes");
        }
        steps = Some(len);
        scan_ins.push(t);
        axes.push(ax);
    }
    let steps = steps.unwrap_or(0);
    let mut scans: Vec<Vec<Value>> = vec![Vec::with_capacity(steps); k_scan];
    for t in 0..steps {
        let mut inputs = Vec::with_capacity(n_state + m);
        inputs.append(&mut states);
        for j in 0..m {
            let idx = if in_dirs[j] == 1 { steps - 1 - t } else { t };
            inputs.push(Value::tensor(slice_axis(scan_ins[j], axes[j], idx)?));
        }
        let mut out = ctx.run_subgraph("body", inputs)?;
        if out.len() != n_state + k_scan {
            bail!(
                "body returned {} values, expected {}",
                out.len(),
                n_state + k_scan
            );
        }
        let sv = out.split_off(n_state);
        states = out;
        for (acc, v) in scans.iter_mut().zip(sv) {
            acc.push(v);
        }
    }
    let body = ctx.node.attr_graph("body")?;
    let mut results = states;
    for (k, mut acc) in scans.into_iter().enumerate() {
        if acc.is_empty() {
            let ty = body
                .and_then(|b| b.outputs.get(n_state + k))
                .and_then(|o| o.ty.as_ref());
            results.push(Value::tensor(empty_scan_output(ty, out_axes[k])?));
            continue;
        }
        if out_dirs[k] == 1 {
            acc.reverse();
        }
        let parts = acc
            .iter()
            .map(|v| as_tensor(v, "a scan output"))
            .collect::<Result<Vec<_>>>()?;
        let ax = norm_axis_incl(out_axes[k], parts[0].rank())?;
        results.push(Value::tensor(stack(&parts, ax)?));
    }
    Ok(results)
}

/// Scan opset 8: inputs are (sequence_lens?, states..., scan inputs...), each with batch axis 0;
/// scan inputs are scanned along axis 1. Scan outputs shorter than the longest sequence are
/// padded with zeros.
fn scan8(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let m = ctx.node.int_req("num_scan_inputs")?;
    if m < 1 || m as usize + 1 > ins.len() {
        bail!("num_scan_inputs {m} does not fit {} inputs", ins.len());
    }
    let m = m as usize;
    let n_state = ins.len() - 1 - m;
    let n_out = ctx.node.outputs.len();
    if n_out < n_state {
        bail!("Scan has {n_out} outputs for {n_state} state variables");
    }
    let k_scan = n_out - n_state;
    let dirs = per_input(ctx, "directions", m)?;
    let states: Vec<&Tensor> = (0..n_state)
        .map(|i| ins.tensor(1 + i))
        .collect::<Result<_>>()?;
    let scan_ins: Vec<&Tensor> = (0..m)
        .map(|j| ins.tensor(1 + n_state + j))
        .collect::<Result<_>>()?;
    let batch = scan_ins[0].shape().first().copied().unwrap_or(0);
    let max_len = scan_ins[0].shape().get(1).copied().unwrap_or(0);
    for t in scan_ins.iter() {
        if t.rank() < 2 || t.shape()[0] != batch || t.shape()[1] != max_len {
            bail!(
                "scan inputs must share [batch, sequence] leading dims, got {:?}",
                t.shape()
            );
        }
    }
    for t in states.iter() {
        if t.shape().first() != Some(&batch) {
            bail!(
                "state {:?} must have batch size {batch} on axis 0",
                t.shape()
            );
        }
    }
    let lens: Vec<usize> = match ins.opt_tensor(0) {
        Some(sl) => {
            let v = sl.to_i64_vec()?;
            if v.len() != batch || v.iter().any(|&l| l < 0 || l as usize > max_len) {
                bail!("sequence_lens {v:?} must hold {batch} lengths <= {max_len}");
            }
            v.into_iter().map(|l| l as usize).collect()
        }
        None => vec![max_len; batch],
    };
    let mut final_states: Vec<Vec<Tensor>> = vec![Vec::with_capacity(batch); n_state];
    let mut scan_outs: Vec<Vec<Tensor>> = vec![Vec::with_capacity(batch); k_scan];
    for (b, &len) in lens.iter().enumerate() {
        let mut st: Vec<Value> = states
            .iter()
            .map(|t| slice_axis(t, 0, b).map(Value::tensor))
            .collect::<Result<_>>()?;
        let seqs: Vec<Tensor> = scan_ins
            .iter()
            .map(|t| slice_axis(t, 0, b))
            .collect::<Result<_>>()?;
        let mut acc: Vec<Vec<Value>> = vec![Vec::with_capacity(max_len); k_scan];
        for t in 0..len {
            let mut inputs = Vec::with_capacity(n_state + m);
            inputs.append(&mut st);
            for (j, s) in seqs.iter().enumerate() {
                let idx = if dirs[j] == 1 { len - 1 - t } else { t };
                inputs.push(Value::tensor(slice_axis(s, 0, idx)?));
            }
            let mut out = ctx.run_subgraph("body", inputs)?;
            if out.len() != n_state + k_scan {
                bail!(
                    "body returned {} values, expected {}",
                    out.len(),
                    n_state + k_scan
                );
            }
            let sv = out.split_off(n_state);
            st = out;
            for (a, v) in acc.iter_mut().zip(sv) {
                a.push(v);
            }
        }
        for (i, v) in st.iter().enumerate() {
            final_states[i].push(as_tensor(v, "a state")?.clone());
        }
        for (k, a) in acc.iter().enumerate() {
            let mut parts: Vec<Tensor> = a
                .iter()
                .map(|v| as_tensor(v, "a scan output").cloned())
                .collect::<Result<_>>()?;
            if parts.len() < max_len {
                // The element type and shape come from this entry's outputs or, for an empty
                // sequence, from an earlier batch entry's stacked output.
                let (dt, shape) = match (parts.first(), scan_outs[k].first()) {
                    (Some(p), _) => (p.dtype(), p.shape().to_vec()),
                    (None, Some(prev)) => (prev.dtype(), prev.shape()[1..].to_vec()),
                    (None, None) => {
                        bail!("a batch entry with sequence length 0 has no scan output shape")
                    }
                };
                let pad = Tensor::zeros(dt, shape);
                parts.resize(max_len, pad);
            }
            let refs: Vec<&Tensor> = parts.iter().collect();
            scan_outs[k].push(stack(&refs, 0)?);
        }
    }
    let mut results = Vec::with_capacity(n_out);
    for group in final_states.iter().chain(scan_outs.iter()) {
        if group.is_empty() {
            bail!("Scan with batch size 0 is not supported");
        }
        let refs: Vec<&Tensor> = group.iter().collect();
        results.push(Value::tensor(stack(&refs, 0)?));
    }
    Ok(results)
}

// ---------------------------------------------------------------------------------------------
// ai.onnx.preview.training optimizers
// ---------------------------------------------------------------------------------------------

/// Reads the shared (R, T) inputs and splits the rest into `groups` equal groups of tensors.
fn optimizer_inputs(ins: &Inputs, groups: usize) -> Result<(f64, i64, Vec<&Tensor>)> {
    let r = ins.tensor(0)?;
    let t = ins.tensor(1)?;
    if r.len() != 1 || t.len() != 1 {
        bail!("R and T must be scalars");
    }
    let r = r.to_f64_vec()?[0];
    let t = t.to_i64_vec()?[0];
    let rest: Vec<&Tensor> = (2..ins.len())
        .map(|i| ins.tensor(i))
        .collect::<Result<_>>()?;
    if rest.is_empty() || !rest.len().is_multiple_of(groups) {
        bail!(
            "expected {groups} equally sized groups of tensors, got {}",
            rest.len()
        );
    }
    let n = rest.len() / groups;
    for i in 0..n {
        for g in 1..groups {
            if rest[g * n + i].shape() != rest[i].shape() {
                bail!(
                    "tensor {} of group {g} has shape {:?}, expected {:?}",
                    i,
                    rest[g * n + i].shape(),
                    rest[i].shape()
                );
            }
        }
    }
    Ok((r, t, rest))
}

/// Builds a float tensor of `like`'s dtype and shape from f64 values.
fn float_like(like: &Tensor, v: Vec<f64>) -> Result<Tensor> {
    let shape = like.shape().to_vec();
    Ok(match like.dtype() {
        DType::F32 => Tensor::from_vec(shape, v.into_iter().map(|x| x as f32).collect())?,
        DType::F64 => Tensor::from_vec(shape, v)?,
        DType::F16 => Tensor::from_vec(shape, v.into_iter().map(npuc_ir::f16::from_f64).collect())?,
        DType::BF16 => {
            Tensor::from_vec(shape, v.into_iter().map(npuc_ir::bf16::from_f64).collect())?
        }
        other => bail!("optimizer tensors must be float, got {other}"),
    })
}

/// Adagrad: `r = R / (1 + T * decay_factor)`, `g' = norm_coefficient * X + G`,
/// `H' = H + g'^2`, `X' = X - r * g' / (sqrt(H') + epsilon)`. Outputs (X'..., H'...).
fn adagrad(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let decay = ctx.node.float_or("decay_factor", 0.0)? as f64;
    let eps = ctx.node.float_or("epsilon", 0.0)? as f64;
    let norm = ctx.node.float_or("norm_coefficient", 0.0)? as f64;
    let (r, t, rest) = optimizer_inputs(&ins, 3)?;
    let n = rest.len() / 3;
    let lr = r / (1.0 + t as f64 * decay);
    let (mut xs, mut hs) = (vec![], vec![]);
    for i in 0..n {
        let (x, g, h) = (rest[i], rest[n + i], rest[2 * n + i]);
        let (xv, gv, hv) = (x.to_f64_vec()?, g.to_f64_vec()?, h.to_f64_vec()?);
        let mut xo = Vec::with_capacity(xv.len());
        let mut ho = Vec::with_capacity(xv.len());
        for j in 0..xv.len() {
            let gr = norm * xv[j] + gv[j];
            let hn = hv[j] + gr * gr;
            ho.push(hn);
            xo.push(xv[j] - lr * gr / (hn.sqrt() + eps));
        }
        xs.push(Value::tensor(float_like(x, xo)?));
        hs.push(Value::tensor(float_like(h, ho)?));
    }
    xs.extend(hs);
    Ok(xs)
}

/// Adam: first and second moments with optional bias correction (T > 0) and pre/post
/// regularization. Outputs (X'..., V'..., H'...).
fn adam(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let alpha = ctx.node.float_or("alpha", 0.9)? as f64;
    let beta = ctx.node.float_or("beta", 0.999)? as f64;
    let eps = ctx.node.float_or("epsilon", 0.0)? as f64;
    let norm = ctx.node.float_or("norm_coefficient", 0.0)? as f64;
    let norm_post = ctx.node.float_or("norm_coefficient_post", 0.0)? as f64;
    let (r, t, rest) = optimizer_inputs(&ins, 4)?;
    let n = rest.len() / 4;
    let lr = if t > 0 {
        let tf = t as f64;
        r * (1.0 - beta.powf(tf)).sqrt() / (1.0 - alpha.powf(tf))
    } else {
        r
    };
    let (mut xs, mut vs, mut hs) = (vec![], vec![], vec![]);
    for i in 0..n {
        let (x, g, v, h) = (rest[i], rest[n + i], rest[2 * n + i], rest[3 * n + i]);
        let (xv, gv, vv, hv) = (
            x.to_f64_vec()?,
            g.to_f64_vec()?,
            v.to_f64_vec()?,
            h.to_f64_vec()?,
        );
        let len = xv.len();
        let (mut xo, mut vo, mut ho) = (
            Vec::with_capacity(len),
            Vec::with_capacity(len),
            Vec::with_capacity(len),
        );
        for j in 0..len {
            let gr = norm * xv[j] + gv[j];
            let vn = alpha * vv[j] + (1.0 - alpha) * gr;
            let hn = beta * hv[j] + (1.0 - beta) * gr * gr;
            let xn = xv[j] - lr * (vn / (hn.sqrt() + eps));
            xo.push((1.0 - norm_post) * xn);
            vo.push(vn);
            ho.push(hn);
        }
        xs.push(Value::tensor(float_like(x, xo)?));
        vs.push(Value::tensor(float_like(v, vo)?));
        hs.push(Value::tensor(float_like(h, ho)?));
    }
    xs.extend(vs);
    xs.extend(hs);
    Ok(xs)
}

/// Momentum (standard or Nesterov): `V' = alpha * V + beta' * g'` with `beta' = 1` on the first
/// step (T == 0). Outputs (X'..., V'...).
fn momentum(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let node = ctx.node;
    let alpha = node
        .attr_float("alpha")?
        .ok_or_else(|| RtError::msg("Momentum needs attribute 'alpha'"))? as f64;
    let beta = node
        .attr_float("beta")?
        .ok_or_else(|| RtError::msg("Momentum needs attribute 'beta'"))? as f64;
    let norm = node
        .attr_float("norm_coefficient")?
        .ok_or_else(|| RtError::msg("Momentum needs attribute 'norm_coefficient'"))?
        as f64;
    let nesterov = match node.str_or("mode", "standard")? {
        "standard" => false,
        "nesterov" => true,
        other => bail!("unknown Momentum mode '{other}'"),
    };
    let (r, t, rest) = optimizer_inputs(&ins, 3)?;
    let n = rest.len() / 3;
    let beta_adj = if t > 0 { beta } else { 1.0 };
    let (mut xs, mut vs) = (vec![], vec![]);
    for i in 0..n {
        let (x, g, v) = (rest[i], rest[n + i], rest[2 * n + i]);
        let (xv, gv, vv) = (x.to_f64_vec()?, g.to_f64_vec()?, v.to_f64_vec()?);
        let mut xo = Vec::with_capacity(xv.len());
        let mut vo = Vec::with_capacity(xv.len());
        for j in 0..xv.len() {
            let gr = norm * xv[j] + gv[j];
            let vn = alpha * vv[j] + beta_adj * gr;
            xo.push(if nesterov {
                xv[j] - r * (gr + alpha * vn)
            } else {
                xv[j] - r * vn
            });
            vo.push(vn);
        }
        xs.push(Value::tensor(float_like(x, xo)?));
        vs.push(Value::tensor(float_like(v, vo)?));
    }
    xs.extend(vs);
    Ok(xs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_and_stack_roundtrip() {
        let t = Tensor::from_vec(vec![2, 3], vec![1i32, 2, 3, 4, 5, 6]).unwrap();
        let cols: Vec<Tensor> = (0..3).map(|i| slice_axis(&t, 1, i).unwrap()).collect();
        assert_eq!(cols[1].as_slice::<i32>().unwrap(), &[2, 5]);
        let refs: Vec<&Tensor> = cols.iter().collect();
        let back = stack(&refs, 1).unwrap();
        assert_eq!(back, t);
        let rows = stack(&refs, 0).unwrap();
        assert_eq!(rows.shape(), &[3, 2]);
        assert_eq!(rows.as_slice::<i32>().unwrap(), &[1, 4, 2, 5, 3, 6]);
    }

    #[test]
    fn stack_strings() {
        let a = Tensor::from_strings(vec![1], vec!["a".into()]).unwrap();
        let b = Tensor::from_strings(vec![1], vec!["b".into()]).unwrap();
        let s = stack(&[&a, &b], 0).unwrap();
        assert_eq!(s.shape(), &[2, 1]);
        assert_eq!(s.as_strings().unwrap(), &["a".to_string(), "b".to_string()]);
    }

    use crate::exec::{Session, SessionOptions};
    use npuc_ir::{Attr, Graph, Model, Node, OpsetImport, ValueInfo};

    fn vi(name: &str, dt: DType, shape: &[usize]) -> ValueInfo {
        ValueInfo::new(name, Some(TypeInfo::tensor(dt, shape)))
    }

    fn model(opset: i64, node: Node, inputs: Vec<ValueInfo>, outputs: Vec<ValueInfo>) -> Model {
        Model {
            ir_version: 8,
            opset_imports: vec![OpsetImport {
                domain: String::new(),
                version: opset,
            }],
            graph: Graph {
                name: "g".into(),
                nodes: vec![node],
                inputs,
                outputs,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn run(m: &Model, feeds: Vec<(&str, Tensor)>) -> Vec<Tensor> {
        let s = Session::new(m, SessionOptions::default()).unwrap();
        s.run(
            feeds
                .into_iter()
                .map(|(n, t)| (n.to_string(), Value::tensor(t)))
                .collect(),
        )
        .unwrap()
        .into_iter()
        .map(|(_, v)| v.as_tensor().unwrap().clone())
        .collect()
    }

    /// Loop whose body passes its state through and emits the iteration number as a scan output.
    fn loop_model() -> Model {
        let body = Graph {
            name: "body".into(),
            inputs: vec![
                vi("i", DType::I64, &[]),
                vi("c", DType::Bool, &[]),
                vi("x_in", DType::F32, &[2]),
            ],
            outputs: vec![
                vi("c", DType::Bool, &[]),
                vi("x_in", DType::F32, &[2]),
                vi("i", DType::I64, &[]),
            ],
            ..Default::default()
        };
        let node = Node::new("Loop", &["M", "cond", "x"], &["x_out", "iters"])
            .with_attr("body", Attr::Graph(Box::new(body)));
        model(
            13,
            node,
            vec![
                vi("M", DType::I64, &[]),
                vi("cond", DType::Bool, &[]),
                vi("x", DType::F32, &[2]),
            ],
            vec![vi("x_out", DType::F32, &[2]), vi("iters", DType::I64, &[3])],
        )
    }

    #[test]
    fn loop_counts_and_stacks() {
        let m = loop_model();
        let x = Tensor::from_vec(vec![2], vec![1f32, 2.0]).unwrap();
        let out = run(
            &m,
            vec![
                ("M", Tensor::scalar(3i64)),
                ("cond", Tensor::scalar(true)),
                ("x", x.clone()),
            ],
        );
        assert_eq!(out[0], x);
        assert_eq!(out[1].as_slice::<i64>().unwrap(), &[0, 1, 2]);
        // A false condition runs zero iterations: an empty scan output typed from the body.
        let out = run(
            &m,
            vec![
                ("M", Tensor::scalar(3i64)),
                ("cond", Tensor::scalar(false)),
                ("x", x.clone()),
            ],
        );
        assert_eq!(out[0], x);
        assert_eq!(out[1].shape(), &[0]);
    }

    /// Scan (opset 9+) whose body makes each slice the new state and emits the old state.
    fn scan_model(opset: i64, attrs: Vec<(&str, Vec<i64>)>) -> Model {
        let body = Graph {
            name: "body".into(),
            inputs: vec![vi("s", DType::F32, &[2]), vi("xe", DType::F32, &[2])],
            outputs: vec![vi("xe", DType::F32, &[2]), vi("s", DType::F32, &[2])],
            ..Default::default()
        };
        let inputs: &[&str] = if opset == 8 {
            &["", "s0", "xs"]
        } else {
            &["s0", "xs"]
        };
        let mut node = Node::new("Scan", inputs, &["s_out", "ys"])
            .with_attr("body", Attr::Graph(Box::new(body)))
            .with_attr("num_scan_inputs", Attr::Int(1));
        for (k, v) in attrs {
            node = node.with_attr(k, Attr::Ints(v));
        }
        let (s_shape, x_shape): (&[usize], &[usize]) = if opset == 8 {
            (&[1, 2], &[1, 3, 2])
        } else {
            (&[2], &[3, 2])
        };
        model(
            opset,
            node,
            vec![vi("s0", DType::F32, s_shape), vi("xs", DType::F32, x_shape)],
            vec![ValueInfo::new("s_out", None), ValueInfo::new("ys", None)],
        )
    }

    #[test]
    fn scan9_directions_and_axes() {
        let s0 = Tensor::from_vec(vec![2], vec![0f32, 0.5]).unwrap();
        let xs = Tensor::from_vec(vec![3, 2], vec![1f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let feeds = || vec![("s0", s0.clone()), ("xs", xs.clone())];
        let out = run(&scan_model(11, vec![]), feeds());
        assert_eq!(out[0].as_slice::<f32>().unwrap(), &[5.0, 6.0]);
        assert_eq!(
            out[1].as_slice::<f32>().unwrap(),
            &[0.0, 0.5, 1.0, 2.0, 3.0, 4.0]
        );
        let m = scan_model(
            11,
            vec![
                ("scan_input_directions", vec![1]),
                ("scan_output_axes", vec![-1]),
                ("scan_output_directions", vec![1]),
            ],
        );
        let out = run(&m, feeds());
        assert_eq!(out[0].as_slice::<f32>().unwrap(), &[1.0, 2.0]);
        // Emitted (in order) s0, x2, x1; reversed and stacked on the last axis.
        assert_eq!(out[1].shape(), &[2, 3]);
        assert_eq!(
            out[1].as_slice::<f32>().unwrap(),
            &[3.0, 5.0, 0.0, 4.0, 6.0, 0.5]
        );
    }

    #[test]
    fn scan8_batched() {
        let s0 = Tensor::from_vec(vec![1, 2], vec![0f32, 0.5]).unwrap();
        let xs = Tensor::from_vec(vec![1, 3, 2], vec![1f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let out = run(&scan_model(8, vec![]), vec![("s0", s0), ("xs", xs)]);
        assert_eq!(out[0].shape(), &[1, 2]);
        assert_eq!(out[0].as_slice::<f32>().unwrap(), &[5.0, 6.0]);
        assert_eq!(out[1].shape(), &[1, 3, 2]);
        assert_eq!(
            out[1].as_slice::<f32>().unwrap(),
            &[0.0, 0.5, 1.0, 2.0, 3.0, 4.0]
        );
    }

    #[test]
    fn if_picks_branch() {
        let branch = |name: &str, src: &str| Graph {
            name: name.into(),
            outputs: vec![vi(src, DType::F32, &[1])],
            ..Default::default()
        };
        let node = Node::new("If", &["c"], &["y"])
            .with_attr("then_branch", Attr::Graph(Box::new(branch("t", "a"))))
            .with_attr("else_branch", Attr::Graph(Box::new(branch("e", "b"))));
        let m = model(
            16,
            node,
            vec![
                vi("c", DType::Bool, &[]),
                vi("a", DType::F32, &[1]),
                vi("b", DType::F32, &[1]),
            ],
            vec![vi("y", DType::F32, &[1])],
        );
        let a = Tensor::from_vec(vec![1], vec![1f32]).unwrap();
        let b = Tensor::from_vec(vec![1], vec![2f32]).unwrap();
        for (c, want) in [(true, &a), (false, &b)] {
            let out = run(
                &m,
                vec![("c", Tensor::scalar(c)), ("a", a.clone()), ("b", b.clone())],
            );
            assert_eq!(&out[0], want);
        }
    }
}
