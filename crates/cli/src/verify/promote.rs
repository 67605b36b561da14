//! `npuc verify --suggest`: which activation tensors to keep at 16 bits to reach a target output
//! SQNR, found without recalibration.
//!
//! Promoting activation tensor `T` replaces its QuantizeLinear/DequantizeLinear pair's scale and
//! zero point by a uint16 pair covering the same real range `[s (qmin - zp), s (qmax - zp)]`
//! (times `headroom`, which widens the range to cut clipping; 1 keeps it): new scale =
//! range / 65535, zero point = round(-lo / scale). Candidates are ranked by their local
//! quantization SQNR (the Q input against the DQ output inside the quantized model, over the
//! samples), lowest first; the shortest prefix of that ranking that reaches the target is found by
//! bisection, then every chosen tensor whose removal keeps the target is dropped (pruning). The
//! result is a small set, not a proven minimum.

use super::{canonical_name, prepare_quantized, run_named, with_outputs, Acc, Sample};
use anyhow::{anyhow, bail, Context, Result};
use npuc_ir::{DType, Initializer, Model, Tensor};
use npuc_runtime::{Session, SessionOptions};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// An activation tensor quantized by a QuantizeLinear feeding DequantizeLinear node(s).
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The float model's name for the tensor.
    pub tensor: String,
    /// The QuantizeLinear node (index into the graph's nodes).
    q_node: usize,
    /// The DequantizeLinear nodes reading its output.
    dq_nodes: Vec<usize>,
    /// The Q input (the unquantized value).
    pre: String,
    /// The first DQ output (the quantized value).
    post: String,
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

/// Activation Q/DQ pairs of at most 8 bits whose scale (and zero point) are initializers.
pub fn candidates(m: &Model) -> Vec<Candidate> {
    let g = &m.graph;
    let inits: HashSet<&str> = g.initializers.iter().map(|i| i.name.as_str()).collect();
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
            q_node: i,
            dq_nodes: dqs,
            pre: x.to_string(),
            post,
        });
    }
    v
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

/// A copy of `m` with the chosen candidates' Q/DQ pairs promoted to uint16.
pub fn promote(m: &Model, cands: &[Candidate], chosen: &[usize], headroom: f64) -> Result<Model> {
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
    for &c in chosen {
        let cand = cands
            .get(c)
            .ok_or_else(|| anyhow!("candidate {c} out of range"))?;
        let qn = &m.graph.nodes[cand.q_node];
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
        for (&sc, &z) in s.iter().zip(&zp) {
            let sc = sc as f64;
            let lo = (sc * (qmin - z)).min(0.0) * headroom;
            let hi = (sc * (qmax - z)).max(0.0) * headroom;
            let new_s = (hi - lo) / 65535.0;
            if !(new_s > 0.0 && new_s.is_finite()) {
                bail!("'{}': scale {sc} cannot be promoted", qn.display_name());
            }
            ns.push(new_s as f32);
            nz.push((-lo / new_s).round().clamp(0.0, 65535.0) as u16);
        }
        let mut fresh = |base: String| {
            let mut n = base.clone();
            let mut k = 1;
            while !names.insert(n.clone()) {
                n = format!("{base}_{k}");
                k += 1;
            }
            n
        };
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
        for &ni in std::iter::once(&cand.q_node).chain(&cand.dq_nodes) {
            let n = &mut out.graph.nodes[ni];
            n.inputs.resize(3, String::new());
            n.inputs[1] = sn.clone();
            n.inputs[2] = zn.clone();
            // An explicit 8-bit output_dtype would contradict the uint16 zero point.
            n.attrs.retain(|(k, _)| k != "output_dtype");
        }
        // Declared types of the quantized value, if any, are now stale.
        let y = out.graph.nodes[cand.q_node].outputs[0].clone();
        out.graph.value_info.retain(|vi| vi.name != y);
    }
    Ok(out)
}

/// Output SQNR (worst output) and its cosine of `q` against cached reference outputs.
struct Evaluator<'a> {
    reference_outputs: Vec<HashMap<String, std::sync::Arc<Tensor>>>,
    output_pairs: Vec<(String, String)>,
    samples: &'a [Sample],
    threads: usize,
    simulate: bool,
    evaluations: usize,
}

impl Evaluator<'_> {
    fn eval(&mut self, q: &Model) -> Result<(f64, f64)> {
        self.evaluations += 1;
        let prepared = prepare_quantized(q.clone(), self.simulate)?;
        let sess = Session::new(
            &prepared,
            SessionOptions {
                threads: self.threads,
            },
        )?;
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
    /// Threads per session.
    pub threads: usize,
    /// Passed to [`prepare_quantized`].
    pub simulate: bool,
}

/// Runs the search; returns the suggestion and the promoted model.
pub fn suggest(inp: &SuggestInput, log: &mut dyn FnMut(&str)) -> Result<(Suggestion, Model)> {
    let q = inp.quantized;
    let cands = candidates(q);
    // Local quantization noise of every candidate, from one exposed run per sample.
    let mut extra = vec![];
    for c in &cands {
        extra.push(c.pre.clone());
        extra.push(c.post.clone());
    }
    let qs = Session::new(
        &with_outputs(&prepare_quantized(q.clone(), inp.simulate)?, &extra),
        SessionOptions {
            threads: inp.threads,
        },
    )
    .context("preparing the quantized model")?;
    let mut local = vec![Acc::default(); cands.len()];
    for s in inp.samples {
        let o = run_named(&qs, s)?;
        for (c, a) in cands.iter().zip(local.iter_mut()) {
            if let (Some(x), Some(y)) = (o.get(&c.pre), o.get(&c.post)) {
                a.add(x, y);
            }
        }
    }
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (local[a].sqnr_db(), local[b].sqnr_db());
        // NaN (broken) first, then lowest SQNR.
        y.is_nan()
            .cmp(&x.is_nan())
            .then(x.total_cmp(&y))
            .then(a.cmp(&b))
    });

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
    let output_pairs = super::output_pairs(inp.reference, q)?;
    let mut ev = Evaluator {
        reference_outputs,
        output_pairs,
        samples: inp.samples,
        threads: inp.threads,
        simulate: inp.simulate,
        evaluations: 0,
    };
    let build = |set: &[usize]| promote(q, &cands, set, inp.headroom);
    let (base_db, base_cos) = ev.eval(q)?;
    log(&format!(
        "suggest: {} candidate activation tensors; output SQNR as given {} dB",
        cands.len(),
        super::fmt_db(base_db)
    ));
    let all_model = build(&order)?;
    let (all_db, all_cos) = ev.eval(&all_model)?;
    log(&format!(
        "suggest: all {} promoted: {} dB",
        cands.len(),
        super::fmt_db(all_db)
    ));
    let target = inp.target_db;
    let (chosen, db, cos, model) = if base_db >= target {
        (vec![], base_db, base_cos, q.clone())
    } else if all_db < target {
        (order.clone(), all_db, all_cos, all_model)
    } else {
        // Smallest passing prefix (bisection: `hi` always passes, `lo` never does).
        let (mut lo, mut hi) = (0usize, order.len());
        let (mut best_db, mut best_cos) = (all_db, all_cos);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let (d, c) = ev.eval(&build(&order[..mid])?)?;
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
        // Prune: the last-ranked first, as they are the least likely to matter.
        let mut i = set.len();
        while i > 0 && set.len() > 1 {
            i -= 1;
            let mut trial = set.clone();
            trial.remove(i);
            let (d, c) = ev.eval(&build(&trial)?)?;
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
    let inits: HashSet<&str> = m
        .graph
        .initializers
        .iter()
        .map(|i| i.name.as_str())
        .collect();
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

/// The overrides file `--apply` writes (the shape `npuc_quant::Overrides` reads).
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

/// Writes the overrides JSON for a suggestion atomically: one `w8a16` rule per chosen tensor.
pub fn write_overrides(path: &Path, default: &str, s: &Suggestion) -> Result<()> {
    let f = OverridesFile {
        default: default.to_string(),
        rules: s
            .tensors
            .iter()
            .map(|t| Rule {
                pattern: t.clone(),
                scheme: "w8a16".into(),
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
