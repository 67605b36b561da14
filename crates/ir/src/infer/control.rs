//! Ops with subgraphs (If, Loop, Scan) and calls of model-local functions: their bodies are
//! inferred in a child scope that sees the caller's values.

use super::ctx::NodeIn;
use super::util::{axis, merge_type, tt};
use super::{run_graph, unknown, Binding, Cx, Known, Out, Outcome, Report, Scope};
use crate::dtype::DType;
use crate::graph::{Attr, Dim, Function, Graph, Node, TypeInfo, ValueInfo};

fn graph_attr<'a>(n: &'a Node, name: &str) -> Result<&'a Graph, String> {
    n.attr_graph(name)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("required attribute '{name}' is missing"))
}

/// Types (and values) of a subgraph's outputs after inferring it.
fn outputs_of(sc: &Scope, g: &Graph) -> Vec<(TypeInfo, Option<Known>)> {
    g.outputs
        .iter()
        .map(|o| (sc.ty(&o.name).unwrap_or_else(unknown), sc.val(&o.name)))
        .collect()
}

pub(crate) fn infer_if(
    cx: &Cx,
    n: &Node,
    scope: &Scope,
    report: &mut Report,
    depth: usize,
) -> Outcome {
    let (then_g, else_g) = match (graph_attr(n, "then_branch"), graph_attr(n, "else_branch")) {
        (Ok(t), Ok(e)) => (t, e),
        (Err(m), _) | (_, Err(m)) => return Outcome::Failed(m),
    };
    if then_g.outputs.len() != else_g.outputs.len() {
        return Outcome::Failed(format!(
            "branches have {} and {} outputs",
            then_g.outputs.len(),
            else_g.outputs.len()
        ));
    }
    let cond = n
        .input(0)
        .and_then(|c| scope.val(c))
        .and_then(|k| k.single().and_then(|s| s.as_i64()));
    let run = |g: &Graph, report: &mut Report| {
        let sc = run_graph(cx, g, Some(scope), vec![], report, depth + 1);
        outputs_of(&sc, g)
    };
    // A constant condition selects one branch; otherwise the output is what both agree on.
    let outs = match cond {
        Some(c) => run(if c != 0 { then_g } else { else_g }, report)
            .into_iter()
            .map(|(ty, val)| Out { ty, val })
            .collect(),
        None => {
            let t = run(then_g, report);
            let e = run(else_g, report);
            t.iter()
                .zip(&e)
                .map(|((a, _), (b, _))| Out::ty(merge_type(a, b)))
                .collect()
        }
    };
    Outcome::Done(outs)
}

/// Runs a body whose loop-carried inputs may change type between iterations: starts from the
/// initial types and widens them with what the body produces until they are stable, so that a
/// tensor growing per iteration ends up with an unknown dim instead of its first-iteration size.
/// `fixed_inputs` are the per-iteration inputs that do not carry (iteration number, slices);
/// `carried` are the initial loop-carried types. Returns the body's outputs of the final run.
/// The inputs of a loop or scan body: per-iteration inputs before and after the carried ones.
struct BodyIo<'t> {
    before: &'t [TypeInfo],
    carried: Vec<TypeInfo>,
    after: &'t [TypeInfo],
    /// Index of the first carried value among the body outputs.
    out_offset: usize,
}

fn run_body(
    cx: &Cx,
    body: &Graph,
    scope: &Scope,
    report: &mut Report,
    depth: usize,
    io: BodyIo,
) -> (Vec<TypeInfo>, Vec<TypeInfo>) {
    let BodyIo {
        before: fixed_before,
        carried,
        after: fixed_after,
        out_offset: carried_out_offset,
    } = io;
    let mut carried = carried;
    for attempt in 0..4 {
        let types: Vec<TypeInfo> = fixed_before
            .iter()
            .cloned()
            .chain(carried.iter().cloned())
            .chain(fixed_after.iter().cloned())
            .collect();
        let bind = body
            .inputs
            .iter()
            .zip(types)
            .map(|(vi, ty)| Binding {
                name: vi.name.clone(),
                ty,
                val: None,
            })
            .collect();
        let mut scratch = Report::default();
        let sc = run_graph(cx, body, Some(scope), bind, &mut scratch, depth + 1);
        let outs: Vec<TypeInfo> = outputs_of(&sc, body).into_iter().map(|(t, _)| t).collect();
        let widened: Vec<TypeInfo> = carried
            .iter()
            .enumerate()
            .map(|(i, c)| match outs.get(carried_out_offset + i) {
                Some(o) => merge_type(c, o),
                None => unknown(),
            })
            .collect();
        if widened == carried || attempt == 3 {
            report.problems.extend(scratch.problems);
            report.not_inferred.extend(scratch.not_inferred);
            return (widened, outs);
        }
        carried = widened;
    }
    (carried, vec![])
}

pub(crate) fn infer_loop(
    cx: &Cx,
    n: &Node,
    scope: &Scope,
    report: &mut Report,
    depth: usize,
) -> Outcome {
    let body = match graph_attr(n, "body") {
        Ok(b) => b,
        Err(m) => return Outcome::Failed(m),
    };
    let n_carried = n.inputs.len().saturating_sub(2);
    if body.inputs.len() != n_carried + 2 || body.outputs.len() < n_carried + 1 {
        return Outcome::Failed(format!(
            "body has {} inputs and {} outputs for {n_carried} loop-carried values",
            body.inputs.len(),
            body.outputs.len()
        ));
    }
    let initial: Vec<TypeInfo> = (0..n_carried)
        .map(|i| {
            n.input(2 + i)
                .and_then(|s| scope.ty(s))
                .unwrap_or_else(unknown)
        })
        .collect();
    let scalar = |d: DType| tt(Some(d), Some(vec![]));
    let (carried, outs) = run_body(
        cx,
        body,
        scope,
        report,
        depth,
        BodyIo {
            before: &[scalar(DType::I64), scalar(DType::Bool)],
            carried: initial,
            after: &[],
            out_offset: 1,
        },
    );
    // With no condition input the loop runs exactly M times (the body's condition is ignored).
    let trips = match (n.input(0), n.input(1)) {
        (Some(m), None) => scope
            .val(m)
            .and_then(|k| k.single().and_then(|s| s.as_i64()))
            .and_then(|v| usize::try_from(v).ok())
            .map_or(Dim::Unknown, Dim::Fixed),
        _ => Dim::Unknown,
    };
    let mut result: Vec<Out> = carried.into_iter().map(Out::ty).collect();
    for o in outs.iter().skip(1 + n_carried) {
        result.push(Out::ty(stack(o, 0, trips.clone())));
    }
    Outcome::Done(result)
}

/// The type of per-iteration values `t` stacked along a new axis `at` of length `len`.
fn stack(t: &TypeInfo, at: usize, len: Dim) -> TypeInfo {
    match t {
        TypeInfo::Tensor {
            dtype,
            shape: Some(s),
        } if at <= s.len() => {
            let mut d = s.clone();
            d.insert(at, len);
            tt(*dtype, Some(d))
        }
        TypeInfo::Tensor { dtype, .. } => tt(*dtype, None),
        _ => unknown(),
    }
}

pub(crate) fn infer_scan(
    cx: &Cx,
    n: &Node,
    scope: &Scope,
    report: &mut Report,
    depth: usize,
    opset: i64,
) -> Outcome {
    match scan(cx, n, scope, report, depth, opset) {
        Ok(o) => Outcome::Done(o),
        Err(m) => Outcome::Failed(m),
    }
}

fn scan(
    cx: &Cx,
    n: &Node,
    scope: &Scope,
    report: &mut Report,
    depth: usize,
    opset: i64,
) -> Result<Vec<Out>, String> {
    let body = graph_attr(n, "body")?;
    let ni = NodeIn::new(n, scope, opset);
    let m =
        usize::try_from(ni.int_req("num_scan_inputs")?).map_err(|_| "negative num_scan_inputs")?;
    // Opset 8 has a leading sequence_lens input and a batch axis on everything.
    let first = usize::from(opset < 9);
    let n_states = n
        .inputs
        .len()
        .checked_sub(first + m)
        .ok_or("fewer inputs than num_scan_inputs")?;
    let k = body
        .outputs
        .len()
        .checked_sub(n_states)
        .ok_or("body has fewer outputs than state variables")?;
    if body.inputs.len() != n_states + m {
        return Err(format!(
            "body has {} inputs for {n_states} states and {m} scan inputs",
            body.inputs.len()
        ));
    }
    let in_axes = ni.ints_attr("scan_input_axes")?.map(|v| v.to_vec());
    let out_axes = ni.ints_attr("scan_output_axes")?.map(|v| v.to_vec());
    let strip = |t: TypeInfo, ax: &[usize]| -> TypeInfo {
        match t {
            TypeInfo::Tensor {
                dtype,
                shape: Some(s),
            } if ax.iter().all(|&a| a < s.len()) => {
                let d = s
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !ax.contains(i))
                    .map(|(_, d)| d.clone())
                    .collect();
                tt(dtype, Some(d))
            }
            TypeInfo::Tensor { dtype, .. } => tt(dtype, None),
            _ => unknown(),
        }
    };
    let ty_in = |i: usize| ni.ty(i).cloned().unwrap_or_else(unknown);
    let mut seq_len = Dim::Unknown;
    let mut batch = Dim::Unknown;
    let mut slices = vec![];
    for j in 0..m {
        let i = first + n_states + j;
        let ax = if opset < 9 {
            1
        } else {
            let a = in_axes
                .as_ref()
                .and_then(|v| v.get(j).copied())
                .unwrap_or(0);
            match ni.rank(i) {
                Some(r) => axis(a, r)?,
                None => 0,
            }
        };
        if j == 0 {
            seq_len = ni
                .shape(i)
                .and_then(|s| s.get(ax).cloned())
                .unwrap_or(Dim::Unknown);
            batch = ni
                .shape(i)
                .and_then(|s| s.first().cloned())
                .unwrap_or(Dim::Unknown);
        }
        let removed: Vec<usize> = if opset < 9 { vec![0, 1] } else { vec![ax] };
        slices.push(strip(ty_in(i), &removed));
    }
    let states: Vec<TypeInfo> = (0..n_states)
        .map(|j| {
            let t = ty_in(first + j);
            if opset < 9 {
                strip(t, &[0])
            } else {
                t
            }
        })
        .collect();
    let (states, outs) = run_body(
        cx,
        body,
        scope,
        report,
        depth,
        BodyIo {
            before: &[],
            carried: states,
            after: &slices,
            out_offset: 0,
        },
    );
    let mut result: Vec<Out> = states
        .into_iter()
        .map(|t| {
            Out::ty(if opset < 9 {
                stack(&t, 0, batch.clone())
            } else {
                t
            })
        })
        .collect();
    for (j, o) in outs.iter().skip(n_states).take(k).enumerate() {
        let t = if opset < 9 {
            stack(&stack(o, 0, seq_len.clone()), 0, batch.clone())
        } else {
            let r = match o {
                TypeInfo::Tensor { shape: Some(s), .. } => Some(s.len() + 1),
                _ => None,
            };
            let a = out_axes
                .as_ref()
                .and_then(|v| v.get(j).copied())
                .unwrap_or(0);
            match r {
                Some(r) => stack(o, axis(a, r)?, seq_len.clone()),
                None => stack(o, 0, seq_len.clone()),
            }
        };
        result.push(Out::ty(t));
    }
    Ok(result)
}

/// Substitutes the caller's attributes for `Attr::Ref`s in a function body.
fn instantiate(n: &Node, f: &Function) -> Vec<Node> {
    f.nodes
        .iter()
        .map(|bn| {
            let mut bn = bn.clone();
            bn.attrs = bn
                .attrs
                .into_iter()
                .filter_map(|(name, a)| match a {
                    Attr::Ref(r) => n
                        .attr(&r)
                        .or_else(|| {
                            f.attribute_defaults
                                .iter()
                                .find(|(k, _)| *k == r)
                                .map(|(_, v)| v)
                        })
                        .map(|v| (name, v.clone())),
                    other => Some((name, other)),
                })
                .collect();
            bn
        })
        .collect()
}

pub(crate) fn infer_function(
    cx: &Cx,
    n: &Node,
    f: &Function,
    scope: &Scope,
    report: &mut Report,
    depth: usize,
) -> Outcome {
    let g = Graph {
        name: f.name.clone(),
        nodes: instantiate(n, f),
        inputs: f
            .inputs
            .iter()
            .map(|s| ValueInfo::new(s.clone(), None))
            .collect(),
        outputs: f
            .outputs
            .iter()
            .map(|s| ValueInfo::new(s.clone(), None))
            .collect(),
        ..Default::default()
    };
    let bind = f
        .inputs
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let caller = n.input(i);
            Binding {
                name: name.clone(),
                ty: caller.and_then(|c| scope.ty(c)).unwrap_or_else(unknown),
                val: caller.and_then(|c| scope.val(c)),
            }
        })
        .collect();
    let fcx = if f.opset_imports.is_empty() {
        Cx {
            opsets: cx.opsets.clone(),
            functions: cx.functions,
        }
    } else {
        let mut c = Cx::new(&f.opset_imports, cx.functions);
        for (d, v) in &cx.opsets {
            c.opsets.entry(d.clone()).or_insert(*v);
        }
        c
    };
    let sc = run_graph(&fcx, &g, None, bind, report, depth + 1);
    Outcome::Done(
        outputs_of(&sc, &g)
            .into_iter()
            .map(|(ty, val)| Out { ty, val })
            .collect(),
    )
}
