//! `npuc verify --suggest`: which tensors to keep at 16 bits to reach a target output SQNR, found
//! without recalibration.
//!
//! Promoting activation tensor `T` replaces its QuantizeLinear/DequantizeLinear pair's scale and
//! zero point by a uint16 pair covering the same real range `[s (qmin - zp), s (qmax - zp)]`
//! (times `headroom`, which widens the range to cut clipping; 1 keeps it): new scale =
//! range / 65535, zero point = -lo / scale rounded half to even (the quantizer's
//! `act_scale_zp`). Promoting a weight requantizes the float
//! model's weight to int16, symmetric, per the same axis, with the quantizer's scales and
//! rounding (requantizing the dequantized 8-bit
//! weight would keep its error). Candidates are ranked by their local
//! quantization SQNR (the Q input against the DQ output inside the quantized model, over the
//! samples), lowest first; the worst `sensitivity_evals` of them are then measured one at a time
//! (output SQNR with only that tensor promoted: per-layer sensitivity) and moved to the front,
//! most helpful first, and added greedily in that order (kept only when the output SQNR rises)
//! until the target is reached. When they do not reach it, the shortest prefix of the whole
//! order that does is found by bisection, then chosen tensors whose removal keeps the target
//! are dropped (pruning, last-ranked first, within an evaluation budget). The result is a small
//! set, not a proven minimum.

use super::{canonical_name, run_named, with_outputs, Acc, Sample};
use anyhow::{anyhow, bail, Context, Result};
use npuc_ir::{DType, Initializer, Model, Tensor};
use npuc_runtime::{Session, SessionOptions};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// A tensor that can be kept at 16 bits.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The float model's name for the tensor.
    pub tensor: String,
    pub(super) kind: Kind,
}

#[derive(Clone, Debug)]
pub(super) enum Kind {
    /// An activation quantized by a QuantizeLinear feeding DequantizeLinear node(s).
    Act {
        /// The QuantizeLinear node (index into the graph's nodes).
        q_node: usize,
        /// The DequantizeLinear nodes reading its output.
        dq_nodes: Vec<usize>,
        /// The Q input (the unquantized value).
        pre: String,
        /// The first DQ output (the quantized value).
        post: String,
    },
    /// A weight initializer read by a DequantizeLinear node. Promotion requantizes the float
    /// model's weight (requantizing the 8-bit values would keep their error).
    Weight {
        /// The DequantizeLinear node.
        dq_node: usize,
        /// The float model's weight.
        float: Tensor,
        /// Its int16 quantization (values, scale, zero point), made on the first promotion:
        /// a search builds hundreds of models, most with every weight promoted.
        w16: Box<std::sync::OnceLock<(Tensor, Tensor, Tensor)>>,
    },
}

impl Candidate {
    /// Whether the candidate is an activation (else a weight).
    pub fn is_activation(&self) -> bool {
        matches!(self.kind, Kind::Act { .. })
    }

    /// `w8a16` for an activation (16-bit activation), `w16a16` for a weight (16-bit weight).
    pub fn scheme(&self) -> &'static str {
        match self.kind {
            Kind::Act { .. } => "w8a16",
            Kind::Weight { .. } => "w16a16",
        }
    }
}

fn qrange(dt: DType) -> Option<(f64, f64)> {
    Some(match dt {
        DType::U8 => (0.0, 255.0),
        DType::I8 => (-128.0, 127.0),
        DType::U4 => (0.0, 15.0),
        DType::I4 => (-8.0, 7.0),
        _ => return None,
    })
}

fn is_q(n: &npuc_ir::Node) -> bool {
    n.op_type == "QuantizeLinear" && matches!(n.domain.as_str(), "" | "ai.onnx")
}

fn is_dq(n: &npuc_ir::Node) -> bool {
    n.op_type == "DequantizeLinear" && matches!(n.domain.as_str(), "" | "ai.onnx")
}

/// The quantized dtype of a Q node: its zero point's, else uint8 (the ONNX default).
fn q_dtype(m: &Model, n: &npuc_ir::Node) -> Option<DType> {
    match n.input(2) {
        Some(z) => m.graph.initializer(z).map(|t| t.dtype()),
        None => Some(DType::U8),
    }
}

/// Activation Q/DQ pairs of at most 8 bits whose scale (and zero point) are initializers, then
/// weights of at most 8 bits whose float value the reference model holds under the same name.
pub fn candidates(m: &Model, reference: &Model) -> Vec<Candidate> {
    let g = &m.graph;
    let inits = g.initializer_names();
    let mut readers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if let Some(x) = n.input(0) {
            readers.entry(x).or_default().push(i);
        }
    }
    let mut v = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        if !is_q(n) || n.block_size_set() {
            continue;
        }
        let (Some(x), Some(s), Some(y)) = (n.input(0), n.input(1), n.outputs.first()) else {
            continue;
        };
        if inits.contains(x) || !inits.contains(s) {
            continue;
        }
        if g.initializer(s).map(|t| t.dtype()) != Some(DType::F32) {
            continue;
        }
        if q_dtype(m, n).and_then(qrange).is_none() {
            continue;
        }
        let dqs: Vec<usize> = readers
            .get(y.as_str())
            .map(|r| r.iter().copied().filter(|&j| is_dq(&g.nodes[j])).collect())
            .unwrap_or_default();
        // Every reader of the quantized value must be a DQ, or promotion would change what an
        // integer consumer sees.
        let all = readers.get(y.as_str()).map(|r| r.len()).unwrap_or(0);
        if dqs.is_empty() || dqs.len() != all {
            continue;
        }
        let post = match g.nodes[dqs[0]].outputs.first() {
            Some(p) if !p.is_empty() => p.clone(),
            _ => continue,
        };
        v.push(Candidate {
            tensor: canonical_name(&post).to_string(),
            kind: Kind::Act {
                q_node: i,
                dq_nodes: dqs,
                pre: x.to_string(),
                post,
            },
        });
    }
    for (i, n) in g.nodes.iter().enumerate() {
        if !is_dq(n) || n.block_size_set() {
            continue;
        }
        let (Some(w), Some(s), Some(y)) = (n.input(0), n.input(1), n.outputs.first()) else {
            continue;
        };
        let Some(wq) = g.initializer(w) else { continue };
        if qrange(wq.dtype()).is_none() || g.initializer(s).is_none() {
            continue;
        }
        let name = canonical_name(y);
        let Some(f) = reference.graph.initializer(name) else {
            continue;
        };
        if f.shape() != wq.shape() || !f.dtype().is_float() {
            continue;
        }
        v.push(Candidate {
            tensor: name.to_string(),
            kind: Kind::Weight {
                dq_node: i,
                float: f.clone(),
                w16: Box::default(),
            },
        });
    }
    v
}

/// Dequantizes `q` (per tensor or per `axis`) to f64.
fn dequantize(q: &Tensor, scale: &[f64], zp: &[f64], axis: i64) -> Result<Vec<f64>> {
    let v = q.to_f64_vec()?;
    if scale.len() == 1 {
        let z = zp.first().copied().unwrap_or(0.0);
        return Ok(v.iter().map(|x| (x - z) * scale[0]).collect());
    }
    let (ax, inner) = axis_geometry(q.shape(), axis, scale.len())?;
    let _ = ax;
    Ok(v.iter()
        .enumerate()
        .map(|(i, x)| {
            let c = (i / inner) % scale.len();
            (x - zp.get(c).copied().unwrap_or(0.0)) * scale[c]
        })
        .collect())
}

/// (axis, elements after the axis) for per-axis parameters of length `n`.
fn axis_geometry(shape: &[usize], axis: i64, n: usize) -> Result<(usize, usize)> {
    let r = shape.len() as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r || shape[a as usize] != n {
        bail!("per-axis parameters of length {n} do not fit axis {axis} of shape {shape:?}");
    }
    Ok((a as usize, shape[a as usize + 1..].iter().product()))
}

/// Local SQNR of a weight candidate: the float weight against its dequantized value.
fn weight_local(m: &Model, dq: &npuc_ir::Node, float: &Tensor) -> Result<Acc> {
    let g = &m.graph;
    let q = g
        .initializer(dq.input(0).unwrap_or_default())
        .ok_or_else(|| anyhow!("weight of '{}' is not an initializer", dq.display_name()))?;
    let s = g
        .initializer(dq.input(1).unwrap_or_default())
        .ok_or_else(|| anyhow!("scale of '{}' is not an initializer", dq.display_name()))?
        .to_f64_vec()?;
    let z = match dq.input(2).filter(|z| !z.is_empty()) {
        Some(z) => g
            .initializer(z)
            .ok_or_else(|| {
                anyhow!(
                    "zero point of '{}' is not an initializer",
                    dq.display_name()
                )
            })?
            .to_f64_vec()?,
        None => vec![0.0; s.len()],
    };
    let d = dequantize(q, &s, &z, dq.int_or("axis", 1)?)?;
    let mut a = Acc::default();
    a.add_f64(&float.to_f64_vec()?, &d);
    Ok(a)
}

/// Requantizes a float weight to int16, symmetric, per the same axis as `scale_len` says,
/// the way the quantizer quantizes weights (its scales and half-to-even rounding).
fn weight_i16(
    float: &Tensor,
    axis: i64,
    scale_len: usize,
    name: &str,
) -> Result<(Tensor, Tensor, Tensor)> {
    let axis = if scale_len == 1 {
        None
    } else {
        axis_geometry(float.shape(), axis, scale_len)?;
        Some(if axis < 0 {
            axis + float.rank() as i64
        } else {
            axis
        } as usize)
    };
    crate::quantize::quantize_weight_symmetric(float, DType::I16, axis, name)
}

trait BlockSize {
    fn block_size_set(&self) -> bool;
}

impl BlockSize for npuc_ir::Node {
    /// Blocked quantization is a weight scheme; activation promotion leaves it alone.
    fn block_size_set(&self) -> bool {
        self.int_or("block_size", 0).unwrap_or(0) != 0
    }
}

/// A copy of `m` with the chosen candidates promoted to 16 bits.
pub fn promote(
    m: &Model,
    cands: &[Candidate],
    chosen: &[usize],
    headroom: f64,
    ranges: Option<&HashMap<String, (f32, f32)>>,
) -> Result<Model> {
    if !(headroom.is_finite() && headroom >= 1.0) {
        bail!("--headroom must be a number >= 1, got {headroom}");
    }
    let mut out = m.clone();
    let mut names: HashSet<String> = out
        .graph
        .initializers
        .iter()
        .map(|i| i.name.clone())
        .collect();
    let mut fresh = |base: String| {
        let mut n = base.clone();
        let mut k = 1;
        while !names.insert(n.clone()) {
            n = format!("{base}_{k}");
            k += 1;
        }
        n
    };
    for &c in chosen {
        let cand = cands
            .get(c)
            .ok_or_else(|| anyhow!("candidate {c} out of range"))?;
        let (q_node, dq_nodes) = match &cand.kind {
            Kind::Act {
                q_node, dq_nodes, ..
            } => (*q_node, dq_nodes.clone()),
            Kind::Weight {
                dq_node,
                float,
                w16,
            } => {
                let dq = &m.graph.nodes[*dq_node];
                let (q, s, z) = match w16.get() {
                    Some(done) => done.clone(),
                    None => {
                        let slen = m
                            .graph
                            .initializer(dq.input(1).unwrap_or_default())
                            .map(|t| t.len())
                            .unwrap_or(1);
                        let made = weight_i16(float, dq.int_or("axis", 1)?, slen, &cand.tensor)
                            .with_context(|| format!("weight '{}'", cand.tensor))?;
                        w16.get_or_init(|| made).clone()
                    }
                };
                let qn = fresh(format!("{}_w16", cand.tensor));
                let sn = fresh(format!("{}_w16_scale", cand.tensor));
                let zn = fresh(format!("{}_w16_zero_point", cand.tensor));
                for (name, t) in [(&qn, q), (&sn, s), (&zn, z)] {
                    out.graph.initializers.push(Initializer {
                        name: name.clone(),
                        tensor: t,
                    });
                }
                let n = &mut out.graph.nodes[*dq_node];
                n.inputs.resize(3, String::new());
                n.inputs[0] = qn;
                n.inputs[1] = sn;
                n.inputs[2] = zn;
                continue;
            }
        };
        let qn = &m.graph.nodes[q_node];
        let s_name = qn.input(1).unwrap_or_default();
        let scale = m.graph.initializer(s_name).ok_or_else(|| {
            anyhow!(
                "scale '{s_name}' of '{}' is not an initializer",
                qn.display_name()
            )
        })?;
        let s = scale.as_slice::<f32>()?;
        let dt = q_dtype(m, qn).unwrap_or(DType::U8);
        let (qmin, qmax) = qrange(dt).ok_or_else(|| anyhow!("{dt} cannot be promoted"))?;
        let zp: Vec<f64> = match qn.input(2) {
            Some(z) => m
                .graph
                .initializer(z)
                .ok_or_else(|| anyhow!("zero point '{z}' is not an initializer"))?
                .to_f64_vec()?,
            None => vec![0.0; s.len()],
        };
        if zp.len() != s.len() {
            bail!(
                "'{}': scale has {} values but zero point {}",
                qn.display_name(),
                s.len(),
                zp.len()
            );
        }
        let mut ns = Vec::with_capacity(s.len());
        let mut nz = Vec::with_capacity(s.len());
        // Re-calibrated: the tensor's whole observed range (16 bits hold what an 8-bit clip
        // such as a percentile cut off), when the caller has it.
        let observed = ranges
            .and_then(|r| r.get(&cand.tensor))
            .filter(|_| s.len() == 1)
            .filter(|(lo, hi)| lo.is_finite() && hi.is_finite());
        for (&sc, &z) in s.iter().zip(&zp) {
            let sc = sc as f64;
            let (lo, hi) = match observed {
                Some(&(lo, hi)) => (
                    (lo as f64).min(0.0) * headroom,
                    (hi as f64).max(0.0) * headroom,
                ),
                None => (
                    (sc * (qmin - z)).min(0.0) * headroom,
                    (sc * (qmax - z)).max(0.0) * headroom,
                ),
            };
            let range_s = (hi - lo) as f32 / 65535.0;
            if !(range_s > 0.0 && range_s.is_finite()) {
                bail!("'{}': scale {sc} cannot be promoted", qn.display_name());
            }
            // The quantizer's uint16 encoding of the range (its scale and rounding).
            let (new_s, new_z) = crate::quantize::act_scale_zp(lo as f32, hi as f32, DType::U16);
            ns.push(new_s);
            nz.push(new_z as u16);
        }
        let sn = fresh(format!("{}_a16_scale", cand.tensor));
        let zn = fresh(format!("{}_a16_zero_point", cand.tensor));
        out.graph.initializers.push(Initializer {
            name: sn.clone(),
            tensor: Tensor::from_vec(scale.shape().to_vec(), ns)?,
        });
        out.graph.initializers.push(Initializer {
            name: zn.clone(),
            tensor: Tensor::from_vec(scale.shape().to_vec(), nz)?,
        });
        for &ni in std::iter::once(&q_node).chain(&dq_nodes) {
            let n = &mut out.graph.nodes[ni];
            n.inputs.resize(3, String::new());
            n.inputs[1] = sn.clone();
            n.inputs[2] = zn.clone();
            // An explicit 8-bit output_dtype would contradict the uint16 zero point.
            n.attrs.retain(|(k, _)| k != "output_dtype");
        }
        // Declared types of the quantized value, if any, are now stale.
        let y = out.graph.nodes[q_node].outputs[0].clone();
        out.graph.value_info.retain(|vi| vi.name != y);
    }
    Ok(out)
}

/// Weight bytes below which several evaluations may run at once: each lane holds the model's
/// prepared copy (lowered weights, packed panels) besides the candidate being built.
const PARALLEL_EVAL_MAX_BYTES: usize = 512 << 20;

/// How many evaluations may run at once for `q`: the cores, or one for a large model.
fn parallel_lanes(q: &Model) -> usize {
    let bytes: usize = q
        .graph
        .initializers
        .iter()
        .map(|i| i.tensor.len() * i.tensor.dtype().size())
        .sum();
    if bytes > PARALLEL_EVAL_MAX_BYTES {
        return 1;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// One evaluation's result (output SQNR, cosine) with its index.
type Indexed = (usize, Result<(f64, f64)>);

/// Output SQNR (worst output) and its cosine of `q` against cached reference outputs.
pub(super) struct Evaluator<'a> {
    reference_outputs: Vec<HashMap<String, std::sync::Arc<Tensor>>>,
    output_pairs: Vec<(String, String)>,
    samples: &'a [Sample],
    threads: usize,
    simulate: bool,
    /// Most evaluations [`Self::eval_each`] runs at once (memory: each holds a prepared copy).
    max_lanes: usize,
    pub(super) evaluations: usize,
}

impl<'a> Evaluator<'a> {
    /// Runs the reference model once on every sample and keeps its outputs.
    pub(super) fn new(inp: &SuggestInput<'a>) -> Result<Evaluator<'a>> {
        let rs = Session::new(
            inp.reference,
            SessionOptions {
                threads: inp.threads,
            },
        )?;
        let mut reference_outputs = vec![];
        for s in inp.samples {
            reference_outputs.push(run_named(&rs, s)?);
        }
        Ok(Evaluator {
            reference_outputs,
            output_pairs: super::output_pairs(inp.reference, inp.quantized)?,
            samples: inp.samples,
            threads: inp.threads,
            simulate: inp.simulate,
            max_lanes: parallel_lanes(inp.quantized),
            evaluations: 0,
        })
    }

    /// Output SQNR (worst output) and cosine of the quantized model `q` on the samples.
    pub(super) fn eval(&mut self, q: Model) -> Result<(f64, f64)> {
        self.evaluations += 1;
        self.measure(q, self.threads)
    }

    /// [`Self::eval`] of `count` models, model `i` built by `build(i)`, results in order. With
    /// more than one thread and a model of moderate size, several are built and run at once,
    /// each single-threaded: preparing a model (lowering, packing weights) runs on one core
    /// and small models gain little from a second thread, so one evaluation at a time left a
    /// core mostly idle (all-MiniLM-L6-v2 `--target-sqnr`: 327 evaluations, ~0.6 s each at 2
    /// threads, about 40% of it preparation). The results are the same either way (kernels
    /// give the same values at any thread count).
    pub(super) fn eval_each(
        &mut self,
        count: usize,
        build: &(dyn Fn(usize) -> Result<Model> + Sync),
    ) -> Result<Vec<(f64, f64)>> {
        self.evaluations += count;
        let lanes = self.threads.min(count).min(self.max_lanes);
        if lanes <= 1 {
            return (0..count)
                .map(|i| self.measure(build(i)?, self.threads))
                .collect();
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let this = &*self;
        let results: Vec<Vec<Indexed>> = std::thread::scope(|s| {
            let lanes: Vec<_> = (0..lanes)
                .map(|_| {
                    s.spawn(|| {
                        let mut mine = vec![];
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if i >= count {
                                break;
                            }
                            let r = build(i).and_then(|m| this.measure(m, 1));
                            let failed = r.is_err();
                            mine.push((i, r));
                            if failed {
                                // Stop handing out work: the first error is reported.
                                next.store(count, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                        mine
                    })
                })
                .collect();
            lanes
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        let mut out: Vec<Option<Result<(f64, f64)>>> = (0..count).map(|_| None).collect();
        for (i, r) in results.into_iter().flatten() {
            out[i] = Some(r);
        }
        out.into_iter()
            .enumerate()
            .map(|(i, r)| r.unwrap_or_else(|| Err(anyhow!("evaluation {i} was not run"))))
            .collect()
    }

    /// One evaluation on `threads` threads.
    fn measure(&self, mut q: Model, threads: usize) -> Result<(f64, f64)> {
        // Outputs only: the graph `npuc run` executes (what `npuc verify` reports as output SQNR).
        crate::quantized::prepare(&mut q, self.simulate)?;
        let prepared = q;
        let sess = Session::new(&prepared, SessionOptions { threads })?;
        let mut acc = vec![Acc::default(); self.output_pairs.len()];
        for (s, r) in self.samples.iter().zip(&self.reference_outputs) {
            let o = run_named(&sess, s)?;
            for (k, (rn, qn)) in self.output_pairs.iter().enumerate() {
                match (r.get(rn), o.get(qn)) {
                    (Some(a), Some(b)) if acc[k].add(a, b) => {}
                    _ => bail!("output '{rn}' cannot be compared with '{qn}'"),
                }
            }
        }
        let worst = acc
            .iter()
            .min_by(|a, b| a.sqnr_db().total_cmp(&b.sqnr_db()))
            .ok_or_else(|| anyhow!("the model has no outputs"))?;
        Ok((worst.sqnr_db(), worst.cosine()))
    }
}

/// What `--suggest` found.
#[derive(Clone, Debug, Serialize)]
pub struct Suggestion {
    /// Tensors to keep at 16 bits, in ranking order.
    pub tensors: Vec<String>,
    /// The scheme of each (`w8a16`: activation, `w16a16`: weight).
    pub schemes: Vec<String>,
    /// Output SQNR (dB) with them promoted.
    pub sqnr_db: f64,
    /// Output cosine with them promoted.
    pub cosine: f64,
    /// Output SQNR of the model as given.
    pub baseline_db: f64,
    /// Output SQNR with every candidate promoted.
    pub all_promoted_db: f64,
    /// Candidates considered.
    pub candidates: usize,
    /// Whether `sqnr_db >= target`.
    pub reached: bool,
    /// The target.
    pub target_db: f64,
    /// Model evaluations the search took.
    pub evaluations: usize,
    /// Local SQNR (dB) of each chosen tensor, same order as `tensors`.
    pub local_sqnr_db: Vec<f64>,
}

/// Inputs of [`suggest`].
pub struct SuggestInput<'a> {
    /// The float model.
    pub reference: &'a Model,
    /// The quantized model (unprepared QDQ graph).
    pub quantized: &'a Model,
    /// Held-out samples.
    pub samples: &'a [Sample],
    /// Target output SQNR in dB.
    pub target_db: f64,
    /// Range multiplier for promoted tensors (1 = same real range).
    pub headroom: f64,
    /// Observed (min, max) of activations by tensor name: promoted activations take this whole
    /// range (re-calibration) instead of the 8-bit pair's; `None` keeps the pair's range.
    pub ranges: Option<&'a HashMap<String, (f32, f32)>>,
    /// Threads per session.
    pub threads: usize,
    /// Passed to [`crate::quantized::prepare`] (and [`super::prepare_quantized`]).
    pub simulate: bool,
    /// Most model evaluations spent pruning the chosen set.
    pub prune_evals: usize,
    /// Candidates (the worst by local SQNR) measured one at a time for their effect on the
    /// output SQNR.
    pub sensitivity_evals: usize,
}

/// Local quantization noise of every candidate (the value before quantization against after):
/// weights statically, activations from one exposed run of the QDQ graph per sample.
pub(super) fn local_noise(inp: &SuggestInput, cands: &[Candidate]) -> Result<Vec<Acc>> {
    let q = inp.quantized;
    let mut extra = vec![];
    for c in cands {
        if let Kind::Act { pre, post, .. } = &c.kind {
            extra.push(pre.clone());
            extra.push(post.clone());
        }
    }
    let qs = Session::new(
        // Ranking reads every Q/DQ pair's input and output, which the integer lowering fuses
        // away: rank on the QDQ graph itself (QuantSim), which is what the pairs describe.
        &with_outputs(q, &extra),
        SessionOptions {
            threads: inp.threads,
        },
    )
    .context("preparing the quantized model")?;
    let mut local = vec![Acc::default(); cands.len()];
    for (c, a) in cands.iter().zip(local.iter_mut()) {
        if let Kind::Weight { dq_node, float, .. } = &c.kind {
            *a = weight_local(q, &q.graph.nodes[*dq_node], float)?;
        }
    }
    for s in inp.samples {
        let o = run_named(&qs, s)?;
        for (c, a) in cands.iter().zip(local.iter_mut()) {
            if let Kind::Act { pre, post, .. } = &c.kind {
                if let (Some(x), Some(y)) = (o.get(pre), o.get(post)) {
                    a.add(x, y);
                }
            }
        }
    }
    Ok(local)
}

/// Runs the search; returns the suggestion and the promoted model.
pub fn suggest(inp: &SuggestInput, log: &mut dyn FnMut(&str)) -> Result<(Suggestion, Model)> {
    let q = inp.quantized;
    let cands = candidates(q, inp.reference);
    let local = local_noise(inp, &cands)?;
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (local[a].sqnr_db(), local[b].sqnr_db());
        // NaN (broken) first, then lowest SQNR.
        y.is_nan()
            .cmp(&x.is_nan())
            .then(x.total_cmp(&y))
            .then(a.cmp(&b))
    });

    let mut ev = Evaluator::new(inp)?;
    let build = |set: &[usize]| promote(q, &cands, set, inp.headroom, inp.ranges);
    let (base_db, base_cos) = ev.eval(q.clone())?;
    log(&format!(
        "suggest: {} candidate tensors; output SQNR as given {} dB",
        cands.len(),
        super::fmt_db(base_db)
    ));
    let all_model = build(&order)?;
    let (all_db, all_cos) = ev.eval(all_model.clone())?;
    log(&format!(
        "suggest: all {} promoted: {} dB",
        cands.len(),
        super::fmt_db(all_db)
    ));
    let target = inp.target_db;
    // Per-layer sensitivity: the output SQNR with only that tensor at 16 bits, for the worst
    // `sensitivity_evals` by local SQNR (local noise says little about how much of it reaches
    // the output). Those go first, most helpful first; the rest keep their local ranking. The
    // prefix search below then adds tensors greedily in this order.
    let mut greedy: Option<(Vec<usize>, f64, f64)> = None;
    if base_db < target && all_db >= target {
        let k = inp.sensitivity_evals.min(order.len());
        let alone = ev.eval_each(k, &|i| build(&[order[i]]))?;
        let mut sens: Vec<(f64, usize)> = alone
            .iter()
            .zip(&order[..k])
            .map(|(&(d, _), &c)| (if d.is_nan() { f64::NEG_INFINITY } else { d }, c))
            .collect();
        // Stable: ties keep the local ranking.
        sens.sort_by(|a, b| b.0.total_cmp(&a.0));
        if let Some((d, c)) = sens.first() {
            log(&format!(
                "suggest: sensitivity of {k} tensors measured; best alone: {} ({} dB)",
                cands[*c].tensor,
                super::fmt_db(*d)
            ));
        }
        let rest: Vec<usize> = order[k..].to_vec();
        order = sens.into_iter().map(|(_, c)| c).chain(rest).collect();
        // Greedy forward selection in that order: keep a tensor only when it raises the output
        // SQNR, stop at the target. Promotions interact (a wider range here changes what the
        // next layer sees), so the prefix of a ranking is not monotonic in SQNR; this is.
        let (mut set, mut cur) = (vec![], (base_db, base_cos));
        for &c in &order[..k] {
            let mut trial = set.clone();
            trial.push(c);
            let (d, cs) = ev.eval(build(&trial)?)?;
            if d > cur.0 {
                set = trial;
                cur = (d, cs);
                log(&format!(
                    "suggest: + {} -> {} dB",
                    cands[c].tensor,
                    super::fmt_db(d)
                ));
            }
            if cur.0 >= target {
                greedy = Some((set, cur.0, cur.1));
                break;
            }
        }
    }
    let (chosen, db, cos, model) = if base_db >= target {
        (vec![], base_db, base_cos, q.clone())
    } else if let Some((set, d, c)) = greedy {
        let model = build(&set)?;
        (set, d, c, model)
    } else if all_db < target {
        (order.clone(), all_db, all_cos, all_model)
    } else {
        // Smallest passing prefix (bisection: `hi` always passes, `lo` never does).
        let (mut lo, mut hi) = (0usize, order.len());
        let (mut best_db, mut best_cos) = (all_db, all_cos);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let (d, c) = ev.eval(build(&order[..mid])?)?;
            log(&format!("suggest: {mid} promoted: {} dB", super::fmt_db(d)));
            if d >= target {
                hi = mid;
                best_db = d;
                best_cos = c;
            } else {
                lo = mid;
            }
        }
        let mut set: Vec<usize> = order[..hi].to_vec();
        // Prune: the last-ranked first, as they are the least likely to matter; at most
        // `prune_evals` trials, since each runs the model on every sample.
        let mut i = set.len();
        let mut budget = inp.prune_evals;
        while i > 0 && set.len() > 1 && budget > 0 {
            i -= 1;
            budget -= 1;
            let mut trial = set.clone();
            trial.remove(i);
            let (d, c) = ev.eval(build(&trial)?)?;
            if d >= target {
                log(&format!(
                    "suggest: dropped {} ({} dB without it)",
                    cands[set[i]].tensor,
                    super::fmt_db(d)
                ));
                set = trial;
                best_db = d;
                best_cos = c;
            }
        }
        let model = build(&set)?;
        (set, best_db, best_cos, model)
    };
    Ok((
        Suggestion {
            tensors: chosen.iter().map(|&i| cands[i].tensor.clone()).collect(),
            schemes: chosen
                .iter()
                .map(|&i| cands[i].scheme().to_string())
                .collect(),
            local_sqnr_db: chosen.iter().map(|&i| local[i].sqnr_db()).collect(),
            sqnr_db: db,
            cosine: cos,
            baseline_db: base_db,
            all_promoted_db: all_db,
            candidates: cands.len(),
            reached: db >= target,
            target_db: target,
            evaluations: ev.evaluations,
        },
        model,
    ))
}

/// The scheme of a QDQ model as `w<bits>a<bits>`, from its weight and activation zero points;
/// `None` when it cannot tell (no Q/DQ nodes).
pub fn model_scheme(m: &Model) -> Option<String> {
    let inits = m.graph.initializer_names();
    let bits = |dt: DType| match dt {
        DType::U8 | DType::I8 => Some(8),
        DType::U16 | DType::I16 => Some(16),
        DType::U4 | DType::I4 => Some(4),
        _ => None,
    };
    let mut w: HashMap<u32, usize> = HashMap::new();
    let mut a: HashMap<u32, usize> = HashMap::new();
    for n in &m.graph.nodes {
        if is_dq(n) {
            if let Some(x) = n.input(0).filter(|x| inits.contains(x)) {
                if let Some(b) = m.graph.initializer(x).and_then(|t| bits(t.dtype())) {
                    *w.entry(b).or_default() += 1;
                }
            }
        } else if is_q(n) && n.input(0).is_some_and(|x| !inits.contains(x)) {
            if let Some(b) = q_dtype(m, n).and_then(bits) {
                *a.entry(b).or_default() += 1;
            }
        }
    }
    let most = |h: &HashMap<u32, usize>| h.iter().max_by_key(|(b, c)| (**c, **b)).map(|(b, _)| *b);
    match (most(&w), most(&a)) {
        (Some(wb), Some(ab)) => Some(format!("w{wb}a{ab}")),
        (Some(wb), None) => Some(format!("w{wb}")),
        _ => None,
    }
}

/// The overrides file `--apply` writes (the shape the quantizer's `Overrides` reads).
#[derive(Serialize)]
struct OverridesFile {
    default: String,
    rules: Vec<Rule>,
}

#[derive(Serialize)]
struct Rule {
    pattern: String,
    scheme: String,
}

/// Writes the overrides JSON for a suggestion atomically: one rule per chosen tensor, `w8a16`
/// for an activation, `w16a16` for a weight.
pub fn write_overrides(path: &Path, default: &str, s: &Suggestion) -> Result<()> {
    let f = OverridesFile {
        default: default.to_string(),
        rules: s
            .tensors
            .iter()
            .zip(&s.schemes)
            .map(|(t, sc)| Rule {
                pattern: t.clone(),
                scheme: sc.clone(),
            })
            .collect(),
    };
    let mut bytes = serde_json::to_vec_pretty(&f)?;
    bytes.push(b'\n');
    npuc_onnx::export::write_atomic(path, &bytes)
        .with_context(|| format!("writing '{}'", path.display()))?;
    Ok(())
}

/// Writes the promoted model as ONNX (atomically).
pub fn write_model(path: &Path, m: &Model) -> Result<()> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("onnx") => {
            npuc_onnx::save_model(m, path, &npuc_onnx::ExportOptions::default())
                .with_context(|| format!("writing '{}'", path.display()))?;
            Ok(())
        }
        _ => bail!(
            "--apply-model '{}': write a .onnx model (compile it with `npuc compile` for a .npuc artifact)",
            path.display()
        ),
    }
}
