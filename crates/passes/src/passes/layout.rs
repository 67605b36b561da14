//! `layout-nhwc`: runs chains of convolutions channels-last.
//!
//! The CPU conv kernels prefer NHWC (`npuc.ConvNhwc`, see the runtime's `ops/conv/nhwc.rs`):
//! depthwise convs vectorise over contiguous channels, KxK im2col copies channel runs, and
//! bias + activation run on rows still in cache. This pass finds maximal connected chains of
//! layout-convertible nodes over 4-D activations and rewrites each chain that pays to NHWC,
//! inserting ONE `Transpose` per value entering the chain (NCHW to NHWC, shared by all its
//! readers) and one per value leaving it (back to NCHW, under the value's original name, so
//! readers outside the chain and graph outputs are unchanged).
//!
//! Convertible nodes:
//! - `Conv` / `npuc.FusedConv` (2-D, constant f32 weight, `group` 1 or depthwise) become
//!   `npuc.ConvNhwc` (same attributes, weight unchanged: the kernel packs it once per plan);
//! - elementwise ops (unary activations, `Add`/`Sub`/`Mul`/`Div`/`Pow`/`Max`/`Min`/`PRelu`,
//!   `Clip`, ...) whose operands are chain values or constants: numpy broadcasting commutes with
//!   permuting every operand the same way, so a constant operand of rank <= 4 is left-padded to
//!   rank 4 and permuted (scalars and all-ones shapes stay as they are);
//! - `ConvTranspose` (group 1, dilation 1, constant f32 weight) whose strides equal its kernel
//!   (no padding) or divide it (padding below the kernel: a decoder's 4x4 stride-2 upsampling)
//!   becomes `npuc.ConvTransposeNhwc`: a detector's upsampling head stays in the chain to its
//!   (one-channel) output, a segmentation decoder runs channels-last;
//! - `GlobalAveragePool` (of a chain value) becomes `npuc.GlobalAveragePoolNhwc`, and so does
//!   a `ReduceMean` over axes {2, 3} with `keepdims` (squeeze-excite blocks written that way);
//! - 2-D `MaxPool` without the indices output (of a chain value) becomes `npuc.MaxPoolNhwc`
//!   (same attributes): a detection stem's pooling no longer leaves the chain; likewise an
//!   undilated 2-D `AveragePool` becomes `npuc.AveragePoolNhwc` (a recogniser's pooling before
//!   its sequence head: the exit transpose then moves the pooled tensor, not the feature map);
//! - `Concat` of chain values, with its axis remapped;
//! - `Resize` (no `axes` attribute) of a chain value with constant `roi`/`scales`/`sizes`:
//!   those per-axis constants are permuted, and the runtime's N-D resampler scales H and W
//!   with channel rows contiguous (the FPN upsampling of detection heads stays in the chain).
//!
//! Rank 4 is established without shape inference (fused ops have none): a 2-D conv's input and
//! output are 4-D, elementwise ops of 4-D values (and constants of rank <= 4) are 4-D, and so
//! on, to a fixed point. A chain is converted only when it pays: at least [`MIN_CONVS`] convs
//! and no more boundary transposes than convs. Afterwards `Transpose` pairs cancel: an entry
//! transpose of a value that is itself `Transpose(y, [0, 3, 1, 2])` reads `y` directly, and the
//! pass manager's layout folding and identity elimination run again on the result.
//!
//! It runs once, after the fixed point of the other passes (the fusions it builds on need
//! shape inference, which `npuc.ConvNhwc` does not have).

use crate::util::{fresh_name, is_op, Index};
use crate::{GraphPatch, Pass, PassError, PassStats, Rewriter};
use npuc_ir::{Attr, DType, Model, Node, Tensor, TypeInfo};
use std::collections::{HashMap, HashSet};

/// A chain needs at least this many convs to be converted.
pub const MIN_CONVS: usize = 2;

/// NCHW -> NHWC.
const TO_NHWC: [i64; 4] = [0, 2, 3, 1];
/// NHWC -> NCHW.
const TO_NCHW: [i64; 4] = [0, 3, 1, 2];

/// Elementwise ops (default domain) whose every input broadcasts numpy-style (or is a
/// constant scalar parameter, like Clip's bounds).
const ELEMENTWISE: &[&str] = &[
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Max",
    "Min",
    "Sum",
    "Mean",
    "PRelu",
    "Relu",
    "Sigmoid",
    "HardSigmoid",
    "HardSwish",
    "LeakyRelu",
    "Tanh",
    "Erf",
    "Elu",
    "Selu",
    "Celu",
    "Softplus",
    "Softsign",
    "Abs",
    "Neg",
    "Sqrt",
    "Exp",
    "Log",
    "Reciprocal",
    "Floor",
    "Ceil",
    "Round",
    "Clip",
    "Identity",
    "Gelu",
    "Mish",
];

/// What a node becomes in NHWC.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Conv,
    Elementwise,
    Gap,
    Pool,
    Concat,
    Resize,
}

pub struct LayoutNhwc;

/// The constant f32 4-D weight of a (transposed) conv with one output and a data input, if its
/// bias (when given) is a constant f32 vector as long as weight axis `out_axis` (the output
/// channels: 0 for Conv, 1 for ConvTranspose) and there are no further inputs.
fn conv_weight<'g>(
    g: &'g npuc_ir::Graph,
    ix: &Index,
    n: &Node,
    out_axis: usize,
) -> Option<std::borrow::Cow<'g, Tensor>> {
    if n.outputs.len() != 1 || n.input(0).is_none() || n.inputs.len() > 3 {
        return None;
    }
    let w = ix.constant(g, n.input(1)?)?;
    if w.rank() != 4 || w.dtype() != DType::F32 || w.shape().contains(&0) {
        return None;
    }
    if let Some(b) = n.input(2) {
        match ix.constant(g, b) {
            Some(b) if b.dtype() == DType::F32 && b.len() == w.shape()[out_axis] => {}
            _ => return None,
        }
    }
    Some(w)
}

/// Whether a conv node can run as `npuc.ConvNhwc`.
fn conv_ok(g: &npuc_ir::Graph, ix: &Index, n: &Node) -> bool {
    let is_conv = is_op(n, "Conv") || (n.domain == "npuc" && n.op_type == "FusedConv");
    if !is_conv {
        return false;
    }
    let Some(w) = conv_weight(g, ix, n, 0) else {
        return false;
    };
    let group = match n.attr_int("group") {
        Ok(g) => g.unwrap_or(1),
        Err(_) => return false,
    };
    let (m, cg) = (w.shape()[0], w.shape()[1]);
    group == 1 || (group > 1 && cg == 1 && m as i64 == group)
}

/// Whether a ConvTranspose node can run as `npuc.ConvTransposeNhwc`: 2-D, constant f32 weight
/// `[C, M, KH, KW]` (and bias), group 1, dilation 1, and either strides equal to the kernel
/// with no padding (each input pixel writes its own output block: the upsampling heads of
/// detectors) or kernels a multiple of the strides with padding below the kernel (a decoder's
/// 4x4 stride-2 upsampling: the sub-pixel form).
fn deconv_ok(g: &npuc_ir::Graph, ix: &Index, n: &Node) -> bool {
    if !is_op(n, "ConvTranspose") {
        return false;
    }
    let Some(w) = conv_weight(g, ix, n, 1) else {
        return false;
    };
    let kernel = [w.shape()[2], w.shape()[3]];
    // The op's own rule (non-overlapping, or sub-pixel: kernels a multiple of the strides).
    npuc_runtime::ops::conv::conv_transpose_runs_nhwc(n, kernel).unwrap_or(false)
}

fn classify(g: &npuc_ir::Graph, ix: &Index, n: &Node) -> Option<Kind> {
    if n.outputs.len() != 1 || n.outputs[0].is_empty() {
        return None;
    }
    if conv_ok(g, ix, n) || deconv_ok(g, ix, n) {
        return Some(Kind::Conv);
    }
    let elementwise = (n.domain.is_empty() && ELEMENTWISE.contains(&n.op_type.as_str()))
        || (n.domain == "npuc" && ["Gelu", "FusedBinary"].contains(&n.op_type.as_str()));
    if elementwise {
        return Some(Kind::Elementwise);
    }
    if is_op(n, "GlobalAveragePool") && n.inputs.len() == 1 {
        return Some(Kind::Gap);
    }
    if is_op(n, "ReduceMean") && reduce_mean_is_gap(g, ix, n) {
        return Some(Kind::Gap);
    }
    if is_op(n, "MaxPool")
        && n.inputs.len() == 1
        && matches!(n.attr_ints("kernel_shape"), Ok(Some(k)) if k.len() == 2)
    {
        return Some(Kind::Pool);
    }
    // The NHWC average sums undilated windows only (by input rows, then columns).
    if is_op(n, "AveragePool")
        && n.inputs.len() == 1
        && matches!(n.attr_ints("kernel_shape"), Ok(Some(k)) if k.len() == 2)
        && match n.attr_ints("dilations") {
            Ok(None) => true,
            Ok(Some(d)) => d.iter().all(|&v| v == 1),
            Err(_) => false,
        }
    {
        return Some(Kind::Pool);
    }
    if is_op(n, "Concat") {
        return Some(Kind::Concat);
    }
    if is_op(n, "Resize") && resize_ok(g, ix, n) {
        return Some(Kind::Resize);
    }
    None
}

/// A `ReduceMean` over axes {2, 3} (or {-2, -1}; the attribute, or the constant second input
/// from opset 18) keeping the reduced axes: a global average pool of a 4-D value (membership
/// requires the input to be known 4-D), as squeeze-excite blocks exported from Paddle write it.
fn reduce_mean_is_gap(g: &npuc_ir::Graph, ix: &Index, n: &Node) -> bool {
    if !matches!(n.attr_int("keepdims"), Ok(None | Some(1))) || n.input(0).is_none() {
        return false;
    }
    let axes: Vec<i64> = match (n.inputs.len(), n.attr_ints("axes")) {
        (1, Ok(Some(a))) => a.to_vec(),
        (2, Ok(None)) => match ix.constant(g, &n.inputs[1]) {
            Some(t) if t.dtype() == DType::I64 && t.rank() == 1 => match t.as_slice::<i64>() {
                Ok(a) => a.to_vec(),
                Err(_) => return false,
            },
            _ => return false,
        },
        _ => return false,
    };
    let mut axes: Vec<i64> = axes.iter().map(|a| a.rem_euclid(4)).collect();
    axes.sort_unstable();
    axes == [2, 3]
}

/// A Resize whose per-axis inputs are all absent or constant 4-axis vectors (no `axes`).
fn resize_ok(g: &npuc_ir::Graph, ix: &Index, n: &Node) -> bool {
    if n.input(0).is_none() || n.inputs.len() > 4 || n.attrs.iter().any(|(k, _)| k == "axes") {
        return false;
    }
    n.inputs.iter().enumerate().skip(1).all(|(j, s)| {
        s.is_empty()
            || ix
                .constant(g, s)
                .is_some_and(|t| resize_const(j, &t).is_some())
    })
}

/// Resize input `j`'s constant (1 roi, 2 scales, 3 sizes) in NHWC axis order: `Some(None)`
/// when it stays as it is (empty), `None` when it cannot be permuted.
fn resize_const(j: usize, t: &Tensor) -> Option<Option<Tensor>> {
    if t.is_empty() {
        return Some(None);
    }
    if t.rank() != 1 {
        return None;
    }
    // roi is [starts..., ends...] over the 4 axes; scales and sizes one entry per axis.
    let halves = match (j, t.len()) {
        (1, 8) => 2,
        (2 | 3, 4) => 1,
        _ => return None,
    };
    fn permute<T: npuc_ir::Elem>(v: &[T], halves: usize) -> Vec<T> {
        (0..halves)
            .flat_map(|h| TO_NHWC.iter().map(move |&a| v[h * 4 + a as usize]))
            .collect()
    }
    let out = match t.dtype() {
        DType::F32 => Tensor::from_vec(vec![t.len()], permute(t.as_slice::<f32>().ok()?, halves)),
        DType::F64 => Tensor::from_vec(vec![t.len()], permute(t.as_slice::<f64>().ok()?, halves)),
        DType::I64 => Tensor::from_vec(vec![t.len()], permute(t.as_slice::<i64>().ok()?, halves)),
        _ => return None,
    };
    out.ok().map(Some)
}

/// A constant operand's shape left-padded to rank 4, when it broadcasts against a 4-D value.
fn padded4(t: &Tensor) -> Option<[usize; 4]> {
    if t.rank() > 4 {
        return None;
    }
    let mut s = [1usize; 4];
    s[4 - t.rank()..].copy_from_slice(t.shape());
    Some(s)
}

/// An f32 constant of padded NCHW shape `s` permuted to NHWC (`None` for other dtypes).
fn permute_const(t: &Tensor, s: [usize; 4]) -> Option<Tensor> {
    let v = t.as_slice::<f32>().ok()?;
    let [n, c, h, w] = s;
    let mut out = Vec::with_capacity(v.len());
    for ni in 0..n {
        for y in 0..h {
            for x in 0..w {
                for ci in 0..c {
                    out.push(v[((ni * c + ci) * h + y) * w + x]);
                }
            }
        }
    }
    Tensor::from_vec(vec![n, h, w, c], out).ok()
}

/// How a constant operand of an elementwise member is rewritten.
enum ConstUse {
    /// Used as it is (scalar or all-ones shape, or a non-broadcast parameter).
    Keep,
    /// Replaced by this NHWC tensor.
    Permuted(Tensor),
}

/// The constant rewrite for input `i` of elementwise node `n`, `None` when it is not
/// layout-safe.
fn const_use(n: &Node, i: usize, t: &Tensor) -> Option<ConstUse> {
    // Clip's bounds are scalars by definition.
    if is_op(n, "Clip") && i > 0 {
        return (t.len() == 1).then_some(ConstUse::Keep);
    }
    let s = padded4(t)?;
    if s.iter().filter(|&&d| d != 1).count() == 0 {
        return Some(ConstUse::Keep);
    }
    permute_const(t, s).map(ConstUse::Permuted)
}

impl Pass for LayoutNhwc {
    fn name(&self) -> &'static str {
        "layout-nhwc"
    }

    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let (changes, patch) = convert(rw.model());
        if changes > 0 {
            rw.apply(patch);
            // Transpose pairs the rewrite created around existing transposes cancel here.
            for _ in 0..4 {
                let a = super::reshape::ReshapeFold.run(rw)?.changes;
                let b = super::identity::IdentityElim.run(rw)?.changes;
                let c = super::dce::Dce.run(rw)?.changes;
                if a + b + c == 0 {
                    break;
                }
            }
        }
        Ok(PassStats::new(changes))
    }
}

/// Finds the chains and plans their rewrite; returns the number of nodes converted.
fn convert(m: &Model) -> (usize, GraphPatch) {
    let g = &m.graph;
    if !g.nodes.iter().any(|n| {
        (is_op(n, "Conv") || (n.domain == "npuc" && n.op_type == "FusedConv"))
            && n.inputs.len() >= 2
    }) {
        return (0, GraphPatch::new());
    }
    let ix = Index::new(g);
    let kinds: Vec<Option<Kind>> = g.nodes.iter().map(|n| classify(g, &ix, n)).collect();
    let is_const = |name: &str| ix.is_const(g, name);
    // Values known to be 4-D.
    let mut r4: HashSet<String> = HashSet::new();
    for vi in &g.inputs {
        if let Some(TypeInfo::Tensor { shape: Some(s), .. }) = &vi.ty {
            if s.len() == 4 && !ix.inits.contains_key(&vi.name) {
                r4.insert(vi.name.clone());
            }
        }
    }
    for (n, k) in g.nodes.iter().zip(&kinds) {
        if *k == Some(Kind::Conv) {
            r4.insert(n.inputs[0].clone());
            r4.insert(n.outputs[0].clone());
        }
    }
    // Data inputs (non-constant) of a node.
    let data = |n: &Node| -> Vec<String> {
        n.inputs
            .iter()
            .filter(|s| !s.is_empty() && !is_const(s))
            .cloned()
            .collect()
    };
    loop {
        let before = r4.len();
        for (n, k) in g.nodes.iter().zip(&kinds) {
            let Some(k) = k else { continue };
            let d = data(n);
            if d.is_empty() {
                continue;
            }
            let out = &n.outputs[0];
            match k {
                Kind::Conv => {}
                Kind::Elementwise | Kind::Concat => {
                    if d.iter().all(|v| r4.contains(v)) {
                        r4.insert(out.clone());
                    }
                    // Backwards: a 4-D result whose only non-constant operand broadcasts with
                    // constants of lower rank is 4-D itself.
                    if r4.contains(out) && d.len() == 1 && !r4.contains(&d[0]) {
                        let consts_low = n
                            .inputs
                            .iter()
                            .filter(|s| is_const(s))
                            .all(|s| ix.constant(g, s).is_some_and(|t| t.rank() < 4));
                        if consts_low || *k == Kind::Concat {
                            r4.insert(d[0].clone());
                        }
                    }
                }
                Kind::Gap => {
                    if r4.contains(&d[0]) {
                        r4.insert(out.clone());
                    }
                }
                // A 2-D pool keeps the rank.
                Kind::Pool => {
                    if r4.contains(&d[0]) {
                        r4.insert(out.clone());
                    } else if r4.contains(out) {
                        r4.insert(d[0].clone());
                    }
                }
                // Resize keeps the rank (its per-axis constants have 4 entries).
                Kind::Resize => {
                    if r4.contains(&d[0]) {
                        r4.insert(out.clone());
                    } else if r4.contains(out) {
                        r4.insert(d[0].clone());
                    }
                }
            }
        }
        if r4.len() == before {
            break;
        }
    }
    // Members: every non-constant operand and the output are 4-D, constants are layout-safe.
    let mut member = vec![false; g.nodes.len()];
    for (i, (n, k)) in g.nodes.iter().zip(&kinds).enumerate() {
        let Some(k) = k else { continue };
        let d = data(n);
        if d.is_empty() || !d.iter().all(|v| r4.contains(v)) || !r4.contains(&n.outputs[0]) {
            continue;
        }
        let ok = match k {
            Kind::Conv => true,
            Kind::Elementwise => n.inputs.iter().enumerate().all(|(j, s)| {
                s.is_empty()
                    || !is_const(s)
                    || ix
                        .constant(g, s)
                        .is_some_and(|t| const_use(n, j, &t).is_some())
            }),
            // The NHWC pool kernel is f32: its input must come from the chain itself.
            Kind::Gap | Kind::Pool => ix.producer.contains_key(&d[0]),
            Kind::Resize => d.len() == 1 && n.inputs[0] == d[0],
            Kind::Concat => {
                d.len() == n.inputs.iter().filter(|s| !s.is_empty()).count()
                    && matches!(n.attr_int("axis"), Ok(Some(a)) if (-4..4).contains(&a))
            }
        };
        member[i] = ok;
    }
    // The pool rule needs its input produced by a member; settle that after membership.
    for (i, n) in g.nodes.iter().enumerate() {
        if member[i] && matches!(kinds[i], Some(Kind::Gap | Kind::Pool)) {
            let p = ix.producer.get(&n.inputs[0]).copied();
            if !p.is_some_and(|p| member[p]) {
                member[i] = false;
            }
        }
    }
    // Connected components over member -> member edges.
    let mut parent: Vec<usize> = (0..g.nodes.len()).collect();
    fn find(p: &mut [usize], mut i: usize) -> usize {
        while p[i] != i {
            p[i] = p[p[i]];
            i = p[i];
        }
        i
    }
    for (i, n) in g.nodes.iter().enumerate() {
        if !member[i] {
            continue;
        }
        for s in &n.inputs {
            if let Some(&p) = ix.producer.get(s) {
                if member[p] {
                    let (a, b) = (find(&mut parent, p), find(&mut parent, i));
                    parent[a] = b;
                }
            }
        }
    }
    let mut comps: HashMap<usize, Vec<usize>> = HashMap::new();
    for (i, &is_member) in member.iter().enumerate() {
        if is_member {
            let r = find(&mut parent, i);
            comps.entry(r).or_default().push(i);
        }
    }
    let mut chosen: HashSet<usize> = HashSet::new();
    for nodes in comps.values() {
        let convs = nodes
            .iter()
            .filter(|&&i| kinds[i] == Some(Kind::Conv))
            .count();
        let set: HashSet<usize> = nodes.iter().copied().collect();
        // Values entering the chain (one transpose each) and leaving it (one each).
        let mut entries: HashSet<String> = HashSet::new();
        let mut exits = 0usize;
        for &i in nodes {
            let n = &g.nodes[i];
            for s in data(n) {
                if !ix.producer.get(&s).is_some_and(|p| set.contains(p)) {
                    entries.insert(s);
                }
            }
            let o = &n.outputs[0];
            if ix.graph_outputs.contains(o)
                || ix.captured.contains(o)
                || ix.users(o).iter().any(|u| !set.contains(u))
            {
                exits += 1;
            }
        }
        if convs >= MIN_CONVS && entries.len() + exits <= convs {
            chosen.extend(nodes);
        }
    }
    if chosen.is_empty() {
        return (0, GraphPatch::new());
    }
    rewrite(m, &chosen)
}

/// Plans the chosen member nodes in NHWC with boundary transposes.
fn rewrite(m: &Model, chosen: &HashSet<usize>) -> (usize, GraphPatch) {
    let g = &m.graph;
    let ix = Index::new(g);
    let mut taken = HashSet::new();
    // NHWC names of the values produced inside the chains.
    let mut nhwc: HashMap<String, String> = HashMap::new();
    let fresh = |g: &npuc_ir::Graph, taken: &mut HashSet<String>, base: &str| {
        fresh_name(g, taken, &format!("{base}_nhwc"))
    };
    for &i in chosen {
        let o = &g.nodes[i].outputs[0];
        let name = fresh(g, &mut taken, o);
        nhwc.insert(o.clone(), name);
    }
    let mut patch = GraphPatch::new();
    // Entry transposes already emitted: NCHW name -> NHWC name.
    let mut entered: HashMap<String, String> = HashMap::new();
    let mut const_names: HashMap<String, String> = HashMap::new();
    let mut converted = 0;
    for (i, n) in g.nodes.iter().enumerate() {
        if !chosen.contains(&i) {
            continue;
        }
        converted += 1;
        let mut t = n.clone();
        for (j, s) in n.inputs.iter().enumerate() {
            if s.is_empty() {
                continue;
            }
            if let Some(v) = nhwc.get(s) {
                t.inputs[j] = v.clone();
                continue;
            }
            if ix.is_const(g, s) {
                // Conv weights and biases stay; elementwise constants are permuted; a
                // ReduceMean's axes are dropped below.
                if matches!(
                    t.op_type.as_str(),
                    "Conv" | "FusedConv" | "ConvTranspose" | "ReduceMean"
                ) {
                    continue;
                }
                if is_op(n, "Resize") {
                    let Some(c) = ix.constant(g, s) else { continue };
                    if let Some(Some(p)) = resize_const(j, &c) {
                        let key = format!("{s}\u{0}resize{j}");
                        let name = match const_names.get(&key) {
                            Some(nm) => nm.clone(),
                            None => {
                                let nm = fresh(g, &mut taken, s);
                                patch.add_initializer(nm.clone(), p);
                                const_names.insert(key, nm.clone());
                                nm
                            }
                        };
                        t.inputs[j] = name;
                    }
                    continue;
                }
                let Some(c) = ix.constant(g, s) else { continue };
                if let Some(ConstUse::Permuted(p)) = const_use(n, j, &c) {
                    let name = match const_names.get(s) {
                        Some(nm) => nm.clone(),
                        None => {
                            let nm = fresh(g, &mut taken, s);
                            patch.add_initializer(nm.clone(), p);
                            const_names.insert(s.clone(), nm.clone());
                            nm
                        }
                    };
                    t.inputs[j] = name;
                }
                continue;
            }
            // A value entering the chain: one transpose, shared by all its chain readers.
            let name = match entered.get(s) {
                Some(nm) => nm.clone(),
                None => {
                    // Transpose(y, TO_NCHW) entering: read y itself.
                    let src = ix.prod(g, s).and_then(|(_, p)| {
                        (is_op(p, "Transpose")
                            && p.attr_ints("perm").ok().flatten() == Some(&TO_NCHW[..]))
                        .then(|| p.inputs[0].clone())
                    });
                    let nm = match src {
                        Some(y) => y,
                        None => {
                            let nm = fresh(g, &mut taken, s);
                            patch.insert_before(
                                i,
                                Node::new("Transpose", &[s], &[&nm])
                                    .with_attr("perm", Attr::Ints(TO_NHWC.to_vec())),
                            );
                            nm
                        }
                    };
                    entered.insert(s.clone(), nm.clone());
                    nm
                }
            };
            t.inputs[j] = name;
        }
        let o = n.outputs[0].clone();
        t.outputs[0] = nhwc[&o].clone();
        match (t.domain.as_str(), t.op_type.as_str()) {
            ("", "Conv") | ("npuc", "FusedConv") => {
                t.domain = "npuc".into();
                t.op_type = "ConvNhwc".into();
            }
            ("", "ConvTranspose") => {
                t.domain = "npuc".into();
                t.op_type = "ConvTransposeNhwc".into();
            }
            ("", "GlobalAveragePool") => {
                t.domain = "npuc".into();
                t.op_type = "GlobalAveragePoolNhwc".into();
            }
            ("", "ReduceMean") => {
                t.domain = "npuc".into();
                t.op_type = "GlobalAveragePoolNhwc".into();
                t.inputs.truncate(1);
                t.attrs.clear();
            }
            ("", "MaxPool") => {
                t.domain = "npuc".into();
                t.op_type = "MaxPoolNhwc".into();
            }
            ("", "AveragePool") => {
                t.domain = "npuc".into();
                t.op_type = "AveragePoolNhwc".into();
            }
            ("", "Concat") => {
                let a = n.attr_int("axis").ok().flatten().unwrap_or(1).rem_euclid(4);
                let na = TO_NHWC.iter().position(|&p| p == a).unwrap_or(3) as i64;
                for (k, v) in &mut t.attrs {
                    if k == "axis" {
                        *v = Attr::Int(na);
                    }
                }
            }
            _ => {}
        }
        patch.replace(i, t);
        // A value leaving the chain keeps its name, in NCHW.
        let leaves = ix.graph_outputs.contains(&o)
            || ix.captured.contains(&o)
            || ix.users(&o).iter().any(|u| !chosen.contains(u));
        if leaves {
            patch.insert_after(
                i,
                Node::new("Transpose", &[&nhwc[&o]], &[&o])
                    .with_attr("perm", Attr::Ints(TO_NCHW.to_vec())),
            );
        }
    }
    patch.import_domain("npuc");
    (converted, patch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::{data, init, model, run};

    /// Every output equals the reference's: same shape, values within 1e-4 relative (the NHWC
    /// kernels sum the same products in another order).
    fn assert_outputs_close(got: &[Tensor], want: &[Tensor], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (a, b) in got.iter().zip(want) {
            assert_eq!(a.shape(), b.shape(), "{what}");
            let (a, b) = (a.as_slice::<f32>().unwrap(), b.as_slice::<f32>().unwrap());
            for (p, q) in a.iter().zip(b) {
                assert!(
                    (p - q).abs() <= 1e-4 * (1.0 + q.abs()),
                    "{what}: {p} vs {q}"
                );
            }
        }
    }

    fn conv(x: &str, w: &str, b: &str, y: &str, group: i64) -> Node {
        Node::new("Conv", &[x, w, b], &[y])
            .with_attr("pads", Attr::Ints(vec![1, 1, 1, 1]))
            .with_attr("group", Attr::Int(group))
    }

    /// Conv -> HardSwish-ish elementwise -> depthwise conv -> SE (GAP, conv, sigmoid, Mul)
    /// -> Add residual -> MaxPool: one chain, boundary transposes only at the graph's input and
    /// outputs, outputs equal.
    #[test]
    fn chain_is_converted_and_preserves_outputs() {
        let nodes = vec![
            conv("x", "w1", "b1", "c1", 1),
            Node::new("Mul", &["c1", "s"], &["m1"]),
            Node::new("Relu", &["m1"], &["r1"]),
            conv("r1", "w2", "b2", "c2", 8),
            Node::new("GlobalAveragePool", &["c2"], &["gp"]),
            Node::new("Conv", &["gp", "w3"], &["c3"]),
            Node::new("Sigmoid", &["c3"], &["sg"]),
            Node::new("Mul", &["c2", "sg"], &["se"]),
            Node::new("Add", &["se", "r1"], &["res"]),
            Node::new("Add", &["res", "cb"], &["y0"]),
            Node::new("MaxPool", &["y0"], &["y"]).with_attr("kernel_shape", Attr::Ints(vec![2, 2])),
        ];
        let mut m = model(nodes, &[("x", &[1, 3, 10, 12])], &["y", "r1"]);
        m.graph.initializers = vec![
            init("w1", data(&[8, 3, 3, 3], 1)),
            init("b1", data(&[8], 2)),
            init("s", data(&[1], 3)),
            init("w2", data(&[8, 1, 3, 3], 4)),
            init("b2", data(&[8], 5)),
            init("w3", data(&[8, 8, 1, 1], 6)),
            init("cb", data(&[8, 1, 1], 7)),
        ];
        let x = data(&[1, 3, 10, 12], 9);
        let want = run(&m, &[("x", x.clone())]);
        let st = crate::apply_pass(&LayoutNhwc, &mut m).unwrap();
        assert_eq!(st.changes, 11, "every node converts");
        let count = |op: &str| m.graph.nodes.iter().filter(|n| n.op_type == op).count();
        assert_eq!(count("ConvNhwc"), 3);
        assert_eq!(count("GlobalAveragePoolNhwc"), 1);
        assert_eq!(count("MaxPoolNhwc"), 1);
        // x enters once; y and r1 (graph outputs) leave once each.
        assert_eq!(count("Transpose"), 3);
        let got = run(&m, &[("x", x)]);
        assert_outputs_close(&got, &want, "chain");
        // Idempotent: nothing left to convert.
        assert_eq!(crate::apply_pass(&LayoutNhwc, &mut m).unwrap().changes, 0);
    }

    /// A squeeze-excite block whose pooling is `ReduceMean(axes {2, 3}, keepdims)` (attribute
    /// at opset 17, constant input `[-1, -2]` at opset 18) stays in the chain as an NHWC global
    /// average pool: no transpose around it, outputs equal the NCHW model's. A ReduceMean over
    /// other axes (or without keepdims) is left alone.
    #[test]
    fn reduce_mean_over_spatial_axes_is_a_pool() {
        for (opset, gap) in [(17, true), (18, true), (17, false)] {
            let reduce = match (opset, gap) {
                (17, true) => Node::new("ReduceMean", &["c2"], &["gp"])
                    .with_attr("axes", Attr::Ints(vec![2, 3])),
                (18, _) => Node::new("ReduceMean", &["c2", "ax"], &["gp"])
                    .with_attr("keepdims", Attr::Int(1)),
                _ => {
                    Node::new("ReduceMean", &["c2"], &["gp"]).with_attr("axes", Attr::Ints(vec![1]))
                }
            };
            let nodes = vec![
                conv("x", "w1", "b1", "c1", 1),
                conv("c1", "w2", "b2", "c2", 8),
                reduce,
                Node::new("Sigmoid", &["gp"], &["sg"]),
                Node::new("Mul", &["c2", "sg"], &["se"]),
                conv("se", "w3", "b3", "y", 1),
            ];
            let mut m = model(nodes, &[("x", &[1, 3, 10, 12])], &["y"]);
            m.opset_imports[0].version = opset;
            m.graph.initializers = vec![
                init("w1", data(&[8, 3, 3, 3], 1)),
                init("b1", data(&[8], 2)),
                init("w2", data(&[8, 1, 3, 3], 4)),
                init("b2", data(&[8], 5)),
                init("w3", data(&[4, 8, 3, 3], 6)),
                init("b3", data(&[4], 7)),
                init("ax", Tensor::from_vec(vec![2], vec![-1i64, -2]).unwrap()),
            ];
            let x = data(&[1, 3, 10, 12], 9);
            let want = run(&m, &[("x", x.clone())]);
            crate::apply_pass(&LayoutNhwc, &mut m).unwrap();
            let count = |op: &str| m.graph.nodes.iter().filter(|n| n.op_type == op).count();
            assert_eq!(
                count("GlobalAveragePoolNhwc"),
                gap as usize,
                "opset {opset}"
            );
            assert_eq!(count("ReduceMean"), !gap as usize, "opset {opset}");
            if gap {
                // x enters once, y leaves once.
                assert_eq!(count("Transpose"), 2, "opset {opset}");
            }
            let got = run(&m, &[("x", x)]);
            assert_outputs_close(&got, &want, &format!("opset {opset}"));
        }
    }

    /// A DB-style head, Conv -> Conv -> Relu -> ConvTranspose (2x2 stride 2, bias) -> Relu ->
    /// ConvTranspose (one channel) -> Sigmoid, is one chain to the output: the deconvs become
    /// `ConvTransposeNhwc`, outputs equal. So do stride-1 padded deconvs (the sub-pixel form);
    /// dilated ones stay NCHW.
    #[test]
    fn upsampling_conv_transposes_join_the_chain() {
        for form in ["blocks", "sub-pixel", "dilated"] {
            let attrs = |n: Node| match form {
                "blocks" => n.with_attr("strides", Attr::Ints(vec![2, 2])),
                "sub-pixel" => n
                    .with_attr("strides", Attr::Ints(vec![1, 1]))
                    .with_attr("pads", Attr::Ints(vec![1, 0, 0, 1])),
                _ => n
                    .with_attr("strides", Attr::Ints(vec![2, 2]))
                    .with_attr("dilations", Attr::Ints(vec![2, 2])),
            };
            let nodes = vec![
                conv("x", "w0", "b0", "c0", 1),
                conv("c0", "w1", "b1", "c1", 1),
                Node::new("Relu", &["c1"], &["r1"]),
                attrs(Node::new("ConvTranspose", &["r1", "wt1", "bt1"], &["u1"])),
                Node::new("Relu", &["u1"], &["r2"]),
                attrs(Node::new("ConvTranspose", &["r2", "wt2"], &["u2"])),
                Node::new("Sigmoid", &["u2"], &["y"]),
            ];
            let mut m = model(nodes, &[("x", &[1, 3, 6, 7])], &["y"]);
            m.graph.initializers = vec![
                init("w0", data(&[8, 3, 3, 3], 6)),
                init("b0", data(&[8], 7)),
                init("w1", data(&[8, 8, 3, 3], 1)),
                init("b1", data(&[8], 2)),
                init("wt1", data(&[8, 4, 2, 2], 3)),
                init("bt1", data(&[4], 4)),
                init("wt2", data(&[4, 1, 2, 2], 5)),
            ];
            let x = data(&[1, 3, 6, 7], 9);
            let want = run(&m, &[("x", x.clone())]);
            crate::apply_pass(&LayoutNhwc, &mut m).unwrap();
            let count = |op: &str| m.graph.nodes.iter().filter(|n| n.op_type == op).count();
            if form == "dilated" {
                // The two convs convert; r1 leaves the chain for the NCHW deconvs.
                assert_eq!(count("ConvTransposeNhwc"), 0);
                assert_eq!(count("ConvNhwc"), 2);
            } else {
                assert_eq!(count("ConvTransposeNhwc"), 2, "{form}");
                // x enters once, y leaves once.
                assert_eq!(count("Transpose"), 2, "{form}");
            }
            let got = run(&m, &[("x", x)]);
            assert_outputs_close(&got, &want, form);
        }
    }

    /// Conv -> Resize (scales, nearest; and sizes, linear) -> Conv stays one chain: the
    /// per-axis constants are permuted and the outputs equal the NCHW model's.
    #[test]
    fn resize_joins_the_chain() {
        for (scales, sizes, mode) in [("sc", "", "nearest"), ("", "sz", "linear")] {
            let mut nodes = vec![conv("x", "w1", "b1", "c1", 1)];
            let ins: Vec<&str> = if sizes.is_empty() {
                vec!["c1", "roi", scales]
            } else {
                vec!["c1", "", "", sizes]
            };
            nodes.push(
                Node::new("Resize", &ins, &["up"]).with_attr("mode", Attr::String(mode.into())),
            );
            nodes.push(conv("up", "w2", "b2", "y", 1));
            let mut m = model(nodes, &[("x", &[1, 3, 5, 6])], &["y"]);
            m.graph.initializers = vec![
                init("w1", data(&[4, 3, 3, 3], 1)),
                init("b1", data(&[4], 2)),
                init("w2", data(&[5, 4, 3, 3], 3)),
                init("b2", data(&[5], 4)),
                init("roi", Tensor::from_vec::<f32>(vec![0], vec![]).unwrap()),
                init(
                    "sc",
                    Tensor::from_vec(vec![4], vec![1f32, 1.0, 2.0, 3.0]).unwrap(),
                ),
                init(
                    "sz",
                    Tensor::from_vec(vec![4], vec![1i64, 4, 9, 8]).unwrap(),
                ),
            ];
            let x = data(&[1, 3, 5, 6], 9);
            let want = run(&m, &[("x", x.clone())]);
            let st = crate::apply_pass(&LayoutNhwc, &mut m).unwrap();
            assert_eq!(st.changes, 3, "{mode}: both convs and the Resize convert");
            let count = |op: &str| m.graph.nodes.iter().filter(|n| n.op_type == op).count();
            assert_eq!(count("Transpose"), 2, "{mode}: one entering, one leaving");
            let got = run(&m, &[("x", x)]);
            assert_outputs_close(&got, &want, mode);
        }
    }

    /// `x [1, 3, 9, 11]` -> 3x3 conv (4 channels) -> `pool` (reading `c1`, writing `p`) -> 3x3
    /// conv (5 channels) -> `y`.
    fn conv_pool_conv(pool: Node) -> Model {
        let nodes = vec![
            conv("x", "w1", "b1", "c1", 1),
            pool,
            conv("p", "w2", "b2", "y", 1),
        ];
        let mut m = model(nodes, &[("x", &[1, 3, 9, 11])], &["y"]);
        m.graph.initializers = vec![
            init("w1", data(&[4, 3, 3, 3], 1)),
            init("b1", data(&[4], 2)),
            init("w2", data(&[5, 4, 3, 3], 3)),
            init("b2", data(&[5], 4)),
        ];
        m
    }

    /// Conv -> MaxPool -> Conv stays one chain (`npuc.MaxPoolNhwc`), with SAME padding as in a
    /// detection stem and with explicit pads, stride, dilation and ceil mode; the outputs equal
    /// the NCHW model's exactly (a max moves values, it does not round).
    #[test]
    fn max_pool_joins_the_chain() {
        let same = Node::new("MaxPool", &["c1"], &["p"])
            .with_attr("kernel_shape", Attr::Ints(vec![2, 2]))
            .with_attr("strides", Attr::Ints(vec![1, 1]))
            .with_attr("auto_pad", Attr::String("SAME_UPPER".into()));
        let padded = Node::new("MaxPool", &["c1"], &["p"])
            .with_attr("kernel_shape", Attr::Ints(vec![3, 2]))
            .with_attr("strides", Attr::Ints(vec![2, 2]))
            .with_attr("dilations", Attr::Ints(vec![1, 2]))
            .with_attr("pads", Attr::Ints(vec![1, 0, 1, 1]))
            .with_attr("ceil_mode", Attr::Int(1));
        for (label, pool) in [("same", same), ("padded", padded)] {
            let mut m = conv_pool_conv(pool);
            let x = data(&[1, 3, 9, 11], 9);
            let want = run(&m, &[("x", x.clone())]);
            let st = crate::apply_pass(&LayoutNhwc, &mut m).unwrap();
            assert_eq!(st.changes, 3, "{label}: both convs and the pool convert");
            let count = |op: &str| m.graph.nodes.iter().filter(|n| n.op_type == op).count();
            assert_eq!(count("MaxPoolNhwc"), 1, "{label}");
            assert_eq!(count("Transpose"), 2, "{label}: one entering, one leaving");
            let got = run(&m, &[("x", x)]);
            assert_outputs_close(&got, &want, label);
        }
    }

    /// Conv -> AveragePool -> Conv stays one chain (`npuc.AveragePoolNhwc`) with and without
    /// counting the pads, with stride, pads and ceil mode; the NHWC sums (input rows, then
    /// columns, as the NCHW kernel adds them) give the NCHW model's outputs. A dilated average
    /// stays NCHW.
    #[test]
    fn average_pool_joins_the_chain() {
        let pool = |include: i64| {
            Node::new("AveragePool", &["c1"], &["p"])
                .with_attr("kernel_shape", Attr::Ints(vec![3, 2]))
                .with_attr("strides", Attr::Ints(vec![2, 2]))
                .with_attr("pads", Attr::Ints(vec![1, 0, 1, 1]))
                .with_attr("ceil_mode", Attr::Int(1))
                .with_attr("count_include_pad", Attr::Int(include))
        };
        let dilated = pool(0).with_attr("dilations", Attr::Ints(vec![1, 2]));
        for (label, pool, converts) in [
            ("exclude pads", pool(0), true),
            ("include pads", pool(1), true),
            ("dilated", dilated, false),
        ] {
            let mut m = conv_pool_conv(pool);
            let x = data(&[1, 3, 9, 11], 9);
            let want = run(&m, &[("x", x.clone())]);
            crate::apply_pass(&LayoutNhwc, &mut m).unwrap();
            let count = |op: &str| m.graph.nodes.iter().filter(|n| n.op_type == op).count();
            assert_eq!(count("AveragePoolNhwc"), usize::from(converts), "{label}");
            let got = run(&m, &[("x", x)]);
            assert_outputs_close(&got, &want, label);
        }
    }

    /// A lone conv does not pay for two transposes.
    #[test]
    fn single_conv_is_left_alone() {
        let nodes = vec![
            conv("x", "w1", "b1", "c1", 1),
            Node::new("Relu", &["c1"], &["y"]),
        ];
        let mut m = model(nodes, &[("x", &[1, 3, 8, 8])], &["y"]);
        m.graph.initializers = vec![
            init("w1", data(&[4, 3, 3, 3], 1)),
            init("b1", data(&[4], 2)),
        ];
        assert_eq!(crate::apply_pass(&LayoutNhwc, &mut m).unwrap().changes, 0);
    }

    /// Grouped (non-depthwise) convs and non-constant weights break chains.
    #[test]
    fn unsupported_convs_are_boundaries() {
        let nodes = vec![
            conv("x", "w1", "b1", "c1", 1),
            conv("c1", "w2", "b2", "c2", 2),
            conv("c2", "wx", "b3", "y", 1),
        ];
        let mut m = model(
            nodes,
            &[("x", &[1, 4, 6, 6]), ("wx", &[4, 4, 3, 3])],
            &["y"],
        );
        m.graph.initializers = vec![
            init("w1", data(&[4, 4, 3, 3], 1)),
            init("b1", data(&[4], 2)),
            init("w2", data(&[4, 2, 3, 3], 3)),
            init("b2", data(&[4], 4)),
            init("b3", data(&[4], 5)),
        ];
        assert_eq!(crate::apply_pass(&LayoutNhwc, &mut m).unwrap().changes, 0);
    }

    /// Concat along channels remaps its axis; a Transpose(.., [0,3,1,2]) entering cancels.
    #[test]
    fn concat_axis_and_transpose_cancel() {
        let nodes = vec![
            Node::new("Transpose", &["xh"], &["x"]).with_attr("perm", Attr::Ints(TO_NCHW.to_vec())),
            conv("x", "w1", "b1", "c1", 1),
            conv("x", "w2", "b2", "c2", 1),
            Node::new("Concat", &["c1", "c2"], &["y"]).with_attr("axis", Attr::Int(1)),
        ];
        let mut m = model(nodes, &[("xh", &[1, 5, 7, 4])], &["y"]);
        m.graph.initializers = vec![
            init("w1", data(&[3, 4, 3, 3], 1)),
            init("b1", data(&[3], 2)),
            init("w2", data(&[2, 4, 3, 3], 3)),
            init("b2", data(&[2], 4)),
        ];
        let x = data(&[1, 5, 7, 4], 9);
        let want = run(&m, &[("xh", x.clone())]);
        assert!(crate::apply_pass(&LayoutNhwc, &mut m).unwrap().changes > 0);
        let tr: Vec<&Node> = m
            .graph
            .nodes
            .iter()
            .filter(|n| n.op_type == "Transpose")
            .collect();
        assert_eq!(tr.len(), 1, "only the exit transpose remains");
        let got = run(&m, &[("xh", x)]);
        assert_outputs_close(&got, &want, "transposed input");
    }
}
