//! SmoothQuant-style outlier migration, run before calibration.
//!
//! Transformer activations carry a few channels whose magnitude is 10-100x the rest (LayerNorm
//! outputs, FFN intermediates); a per-tensor 8-bit range sized for them leaves the other
//! channels a handful of levels. For a linear `y = X W` the identity
//! `y = (X diag(1/s)) (diag(s) W)` moves that spread from the activation into the weight, where
//! per-channel quantization absorbs it. `s_k = a_k^α / w_k^(1-α)` with `a_k` the activation's
//! and `w_k` the weights' largest magnitude in input channel `k` (Xiao et al., SmoothQuant).
//!
//! A *group* is one activation `X` and every quantized MatMul/Gemm that reads it as its
//! data input with a float weight initializer (Q/K/V share a LayerNorm output). Per group,
//! α is chosen on calibration rows: each candidate (and "leave it alone") is scored by the
//! quantize-dequantize error of the group's outputs, `X'` quantized per tensor in the planned
//! activation type with the range the channel extremes give and `W'` quantized with the
//! planned weight encoding; the best one wins, so a group is only changed where it measurably
//! helps. `1/s` is then folded into `X`'s producer when that is exact and `X` feeds nothing
//! else (LayerNormalization scale/bias, a decomposed LayerNorm's `Mul gamma -> Add beta`,
//! an RMSNorm-style `Mul gamma`, a previous MatMul's columns and bias); otherwise an explicit
//! `Mul` by `1/s` feeds the group's linears.

use crate::act_scale_zp;
use crate::qdq::{fake_quantize, weight_encoding, QEnc, QuantPlan, Sample, WeightSpec};
use anyhow::{anyhow, bail, Result};
use npuc_ir::{DType, Graph, Initializer, Model, Node, Tensor};
use npuc_runtime::{Session, SessionOptions, Value};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};

/// Candidate α values of the per-group search (SmoothQuant's paper uses 0.5 for most models and
/// up to 0.75-0.85 for those with the strongest outliers).
pub const ALPHAS: &[f32] = &[0.3, 0.4, 0.5, 0.6, 0.7, 0.8];

/// How smoothing runs.
#[derive(Clone, Debug)]
pub struct SmoothOptions {
    /// One α for every group (still only applied where it lowers the group's error); `None`:
    /// the best of [`ALPHAS`] per group.
    pub alpha: Option<f32>,
    /// Calibration samples used for the channel statistics (the first ones).
    pub max_samples: usize,
    /// Activation rows kept per group for scoring candidates.
    pub rows: usize,
    /// Threads of the statistics runs.
    pub threads: usize,
}

impl Default for SmoothOptions {
    fn default() -> Self {
        SmoothOptions {
            alpha: None,
            max_samples: 16,
            rows: 256,
            threads: 1,
        }
    }
}

/// Where the input-channel axis `K` is in a consumer's weight.
#[derive(Clone, Copy, Debug, PartialEq)]
enum KAxis {
    /// `[K, N]`: MatMul, Gemm with `transB = 0`.
    Rows,
    /// `[N, K]`: Gemm with `transB = 1`.
    Cols,
}

#[derive(Clone, Debug)]
struct Consumer {
    node: usize,
    weight: String,
    k_axis: KAxis,
}

/// One activation and the quantized linears reading it.
#[derive(Clone, Debug)]
struct Group {
    input: String,
    consumers: Vec<Consumer>,
    act_dtype: DType,
    k: usize,
    /// Every reader of `input` is in the group (and it is no graph output): `1/s` may change
    /// `input` itself.
    exclusive: bool,
}

/// What smoothing did to one group.
#[derive(Clone, Debug)]
pub struct GroupReport {
    /// The activation.
    pub input: String,
    /// Names of the linears reading it.
    pub consumers: Vec<String>,
    /// Input channels.
    pub channels: usize,
    /// The α applied; `None` when leaving the group alone scored best.
    pub alpha: Option<f32>,
    /// Output SQNR (dB) of the group's quantize-dequantized linears on the scoring rows,
    /// unsmoothed.
    pub sqnr_before: f64,
    /// The same with the chosen α (equal to `sqnr_before` when left alone).
    pub sqnr_after: f64,
    /// Where `1/s` went: the producer it was folded into, or "explicit Mul".
    pub folded: String,
}

/// Per-channel smoothing scales by activation name (see [`apply_scales`]).
pub type Scales = BTreeMap<String, Vec<f32>>;

/// What [`smooth`] did.
#[derive(Clone, Debug, Default)]
pub struct SmoothReport {
    /// One entry per candidate group, in graph order.
    pub groups: Vec<GroupReport>,
    /// Calibration samples the statistics came from.
    pub samples: usize,
    /// The scales applied (what [`apply_scales`] needs to redo the rewrite).
    pub scales: Scales,
}

impl SmoothReport {
    /// Groups that were changed.
    pub fn applied(&self) -> usize {
        self.groups.iter().filter(|g| g.alpha.is_some()).count()
    }

    /// One line for the compile summary.
    pub fn summary(&self) -> String {
        let applied: Vec<&GroupReport> = self.groups.iter().filter(|g| g.alpha.is_some()).collect();
        let explicit = applied
            .iter()
            .filter(|g| g.folded == "explicit Mul")
            .count();
        let gain: Vec<f64> = applied
            .iter()
            .map(|g| g.sqnr_after - g.sqnr_before)
            .collect();
        let mean_gain = if gain.is_empty() {
            0.0
        } else {
            gain.iter().sum::<f64>() / gain.len() as f64
        };
        format!(
            "smoothing: {} of {} linear inputs smoothed ({} folded into their producer, {} explicit Mul), mean layer gain {:+.1} dB, statistics from {} samples",
            applied.len(),
            self.groups.len(),
            applied.len() - explicit,
            explicit,
            mean_gain,
            self.samples
        )
    }
}

fn init_map(g: &Graph) -> HashMap<&str, usize> {
    g.initializers
        .iter()
        .enumerate()
        .map(|(i, x)| (x.name.as_str(), i))
        .collect()
}

/// How many node inputs (and graph outputs) read each name.
fn use_counts(g: &Graph) -> HashMap<String, usize> {
    let mut u: HashMap<String, usize> = HashMap::new();
    for n in &g.nodes {
        for i in n.inputs.iter().filter(|s| !s.is_empty()) {
            *u.entry(i.clone()).or_default() += 1;
        }
    }
    for o in &g.outputs {
        *u.entry(o.name.clone()).or_default() += 1;
    }
    u
}

/// Elements of `t` when it broadcasts along the last axis only (`[K]` or `[1, .., 1, K]`).
fn last_axis_vector(t: &Tensor, k: usize) -> bool {
    let s = t.shape();
    t.dtype() == DType::F32 && s.last() == Some(&k) && s[..s.len() - 1].iter().all(|&d| d == 1)
}

/// The groups of `m`. With a plan: the linears whose weights it quantizes (their data input's
/// planned type in `act_dtype`, F32 when it stays float). Without: every MatMul/Gemm with a float weight initializer
/// of its own, by structure alone ([`apply_scales`]; a float linear's weight may be rescaled
/// too, which keeps the function).
fn find_groups(m: &Model, plan: Option<&QuantPlan>) -> Vec<Group> {
    let g = &m.graph;
    let inits = init_map(g);
    let uses = use_counts(g);
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    let mut order: Vec<String> = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        if !(n.domain.is_empty() && (n.op_type == "MatMul" || n.op_type == "Gemm")) {
            continue;
        }
        let (Some(x), Some(w)) = (n.input(0), n.input(1)) else {
            continue;
        };
        // F32: the activation stays float (weight-only schemes): rows for SeqMSE, no smoothing.
        let act_dtype = match plan {
            Some(p) => p.activations.get(x).copied().unwrap_or(DType::F32),
            None => DType::U8,
        };
        let Some(&wi) = inits.get(w) else { continue };
        let wt = &g.initializers[wi].tensor;
        if wt.dtype() != DType::F32 || wt.rank() != 2 {
            continue;
        }
        if plan.is_some_and(|p| !p.weights.contains_key(w)) {
            continue;
        }
        // The weight is rescaled in place: it must belong to this node alone.
        if uses.get(w).copied().unwrap_or(0) != 1 {
            continue;
        }
        let k_axis = if n.op_type == "Gemm" {
            if n.int_or("transA", 0).unwrap_or(1) != 0 {
                continue;
            }
            if n.int_or("transB", 0).unwrap_or(0) != 0 {
                KAxis::Cols
            } else {
                KAxis::Rows
            }
        } else {
            KAxis::Rows
        };
        let k = match k_axis {
            KAxis::Rows => wt.shape()[0],
            KAxis::Cols => wt.shape()[1],
        };
        let e = groups.entry(x.to_string()).or_insert_with(|| {
            order.push(x.to_string());
            Group {
                input: x.to_string(),
                consumers: vec![],
                act_dtype,
                k,
                exclusive: false,
            }
        });
        if e.k != k {
            // Readers that disagree on K: not one linear input; leave it.
            e.k = 0;
            continue;
        }
        e.consumers.push(Consumer {
            node: i,
            weight: w.to_string(),
            k_axis,
        });
    }
    order
        .into_iter()
        .filter_map(|x| groups.remove(&x))
        .filter(|gr| gr.k > 1 && !gr.consumers.is_empty())
        .map(|mut gr| {
            gr.exclusive = uses.get(&gr.input).copied().unwrap_or(0) == gr.consumers.len();
            gr
        })
        .collect()
}

/// Channel statistics of one group's activation.
struct Stats {
    min: Vec<f32>,
    max: Vec<f32>,
    /// Kept rows, by a deterministic key (the smallest keys win: a uniform sample that does not
    /// depend on the order samples arrive in).
    rows: Vec<(u64, Vec<f32>)>,
    bad_shape: Option<Vec<usize>>,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Stats {
    fn new(k: usize) -> Stats {
        Stats {
            min: vec![f32::INFINITY; k],
            max: vec![f32::NEG_INFINITY; k],
            rows: vec![],
            bad_shape: None,
        }
    }

    fn add(&mut self, sample: usize, t: &Tensor, keep: usize) {
        let k = self.min.len();
        if t.shape().last() != Some(&k) {
            self.bad_shape = Some(t.shape().to_vec());
            return;
        }
        let Ok(xs) = t.as_slice::<f32>() else { return };
        for (r, row) in xs.chunks_exact(k).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                if v.is_finite() {
                    self.min[j] = self.min[j].min(v);
                    self.max[j] = self.max[j].max(v);
                }
            }
            let key = splitmix(((sample as u64) << 32) ^ r as u64);
            if self.rows.len() < keep {
                self.rows.push((key, row.to_vec()));
                if self.rows.len() == keep {
                    self.rows.sort_by_key(|(k, _)| *k);
                }
            } else if key < self.rows[keep - 1].0 {
                let at = self.rows.partition_point(|(k, _)| *k < key);
                self.rows.insert(at, (key, row.to_vec()));
                self.rows.pop();
            }
        }
    }
}

/// The consumer's weight as `[K, N]` data.
fn weight_kn(w: &Tensor, k_axis: KAxis) -> Result<(Vec<f32>, usize)> {
    let d = w.as_slice::<f32>().map_err(|e| anyhow!("{e}"))?;
    let (r, c) = (w.shape()[0], w.shape()[1]);
    Ok(match k_axis {
        KAxis::Rows => (d.to_vec(), c),
        KAxis::Cols => {
            let mut t = vec![0f32; r * c];
            for i in 0..r {
                for j in 0..c {
                    t[j * r + i] = d[i * c + j];
                }
            }
            (t, r)
        }
    })
}

/// `a [m, k] x b [k, n]` through the runtime's GEMM.
fn matmul(a: &[f32], m: usize, k: usize, b: &[f32], n: usize) -> Result<Vec<f32>> {
    let at = Tensor::from_vec(vec![m, k], a.to_vec())?;
    let bt = Tensor::from_vec(vec![k, n], b.to_vec())?;
    let y = npuc_runtime::ops::matmul::matmul_tensors(&at, &bt, 1)
        .map_err(|e| anyhow!("smoothing: {e}"))?;
    Ok(y.as_slice::<f32>().map_err(|e| anyhow!("{e}"))?.to_vec())
}

fn scales(a: &[f32], w: &[f32], alpha: f32) -> Vec<f32> {
    a.iter()
        .zip(w)
        .map(|(&a, &w)| {
            if a > 0.0 && w > 0.0 {
                (a.powf(alpha) / w.powf(1.0 - alpha)).clamp(1e-4, 1e4)
            } else {
                1.0
            }
        })
        .collect()
}

struct Scored {
    alpha: Option<f32>,
    scales: Vec<f32>,
    before: f64,
    after: f64,
}

/// Scores "no smoothing" and each α on the group's kept rows; returns the best.
fn choose(gr: &Group, st: &Stats, g: &Graph, plan: &QuantPlan, alphas: &[f32]) -> Result<Scored> {
    let k = gr.k;
    let inits = init_map(g);
    let rows: Vec<f32> = st
        .rows
        .iter()
        .flat_map(|(_, r)| r.iter().copied())
        .collect();
    let m = st.rows.len();
    let a: Vec<f32> = st
        .min
        .iter()
        .zip(&st.max)
        .map(|(lo, hi)| lo.abs().max(hi.abs()))
        .map(|v| if v.is_finite() { v } else { 0.0 })
        .collect();
    // Per consumer: [K, N] weight, N, its spec, reference output.
    let mut cons = vec![];
    let mut wmax = vec![0f32; k];
    for c in &gr.consumers {
        let wt = &g.initializers[inits[c.weight.as_str()]].tensor;
        let (wkn, n) = weight_kn(wt, c.k_axis)?;
        for (j, row) in wkn.chunks_exact(n).enumerate() {
            wmax[j] = row.iter().fold(wmax[j], |acc, v| acc.max(v.abs()));
        }
        let yref = matmul(&rows, m, k, &wkn, n)?;
        let spec: WeightSpec = plan.weights[&c.weight].clone();
        cons.push((c, wt.shape().to_vec(), wkn, n, spec, yref));
    }
    let score = |s: Option<&[f32]>| -> Result<f64> {
        let one = vec![1f32; k];
        let s = s.unwrap_or(&one);
        let lo = st
            .min
            .iter()
            .zip(s)
            .map(|(v, s)| v / s)
            .fold(0f32, f32::min);
        let hi = st
            .max
            .iter()
            .zip(s)
            .map(|(v, s)| v / s)
            .fold(0f32, f32::max);
        let (scale, zp) = act_scale_zp(lo, hi, gr.act_dtype);
        let xs: Vec<f32> = rows
            .chunks_exact(k)
            .flat_map(|r| r.iter().zip(s).map(|(x, s)| x / s))
            .collect();
        let xq = fake_quantize(&xs, &[m, k], &QEnc::per_tensor(gr.act_dtype, scale, zp));
        let (mut sig, mut noise) = (0f64, 0f64);
        for (c, shape, wkn, n, spec, yref) in &cons {
            // Scale the weight in its stored layout, quantize it as the plan will, then
            // evaluate in [K, N].
            let stored: Vec<f32> = match c.k_axis {
                KAxis::Rows => wkn
                    .chunks_exact(*n)
                    .zip(s)
                    .flat_map(|(row, s)| row.iter().map(move |w| w * s))
                    .collect(),
                KAxis::Cols => {
                    let mut t = vec![0f32; wkn.len()];
                    for j in 0..k {
                        for o in 0..*n {
                            t[o * k + j] = wkn[j * n + o] * s[j];
                        }
                    }
                    t
                }
            };
            let wt = Tensor::from_vec(shape.clone(), stored.clone())?;
            let enc = weight_encoding(&wt, spec, &c.weight)?;
            let wq = fake_quantize(&stored, shape, &enc);
            let (wq_kn, _) = weight_kn(&Tensor::from_vec(shape.clone(), wq)?, c.k_axis)?;
            let y = matmul(&xq, m, k, &wq_kn, *n)?;
            for (a, b) in y.iter().zip(yref) {
                sig += (*b as f64) * (*b as f64);
                noise += ((a - b) as f64).powi(2);
            }
        }
        Ok(10.0 * (sig.max(1e-30) / noise.max(1e-30)).log10())
    };
    let before = score(None)?;
    let mut best = Scored {
        alpha: None,
        scales: vec![],
        before,
        after: before,
    };
    for &al in alphas {
        let s = scales(&a, &wmax, al);
        let v = score(Some(&s))?;
        // A tenth of a dB: below that the change is rounding noise, not worth a rewrite.
        if v > best.after + 0.1 {
            best = Scored {
                alpha: Some(al),
                scales: s,
                before,
                after: v,
            };
        }
    }
    Ok(best)
}

/// Multiplies initializer `slot` of node `node` element-wise by `f(i)`: in place when only that
/// input reads it, else as a new initializer the node is pointed at.
fn rescale_init(
    g: &mut Graph,
    uses: &mut HashMap<String, usize>,
    node: usize,
    slot: usize,
    f: &dyn Fn(usize) -> f32,
) -> Result<()> {
    let name = g.nodes[node].inputs[slot].clone();
    let idx = g
        .initializers
        .iter()
        .position(|i| i.name == name)
        .ok_or_else(|| anyhow!("smoothing: '{name}' is not an initializer"))?;
    let t = &g.initializers[idx].tensor;
    let data: Vec<f32> = t
        .as_slice::<f32>()
        .map_err(|e| anyhow!("{name}: {e}"))?
        .iter()
        .enumerate()
        .map(|(i, v)| v * f(i))
        .collect();
    // The rescaled copy replaces it here: the original's mapped pages need not stay resident
    // next to it (a large model's smoothing would otherwise hold its weights twice).
    t.release_resident();
    // Shared: the calibration and method-choice sessions clone the model, and a session holds
    // its constants; owned values would be copied each time (measured on a synthetic 8-layer
    // ViT-H, 634 MB of weights: 3.3 GB after calibration, 4.7 GB in the method choice).
    let nt = Tensor::from_vec(t.shape().to_vec(), data)?.into_shared();
    if uses.get(&name).copied().unwrap_or(0) <= 1 {
        g.initializers[idx].tensor = nt;
    } else {
        let mut fresh = format!("{name}_smooth");
        let mut c = 1;
        while g.initializers.iter().any(|i| i.name == fresh) {
            c += 1;
            fresh = format!("{name}_smooth{c}");
        }
        *uses.get_mut(&name).expect("counted") -= 1;
        uses.insert(fresh.clone(), 1);
        g.initializers.push(Initializer {
            name: fresh.clone(),
            tensor: nt,
        });
        g.nodes[node].inputs[slot] = fresh;
    }
    Ok(())
}

/// The index of the input of `n` that is a last-axis vector initializer of length `k`.
fn vector_input(g: &Graph, inits: &HashMap<&str, usize>, n: &Node, k: usize) -> Option<usize> {
    (0..n.inputs.len().min(2)).find(|&i| {
        inits
            .get(n.inputs[i].as_str())
            .is_some_and(|&j| last_axis_vector(&g.initializers[j].tensor, k))
    })
}

/// Folds `x / s` (per last-axis channel) into `x`'s producer when exact; returns what it
/// folded into, or `None`.
fn fold_into_producer(
    g: &mut Graph,
    uses: &mut HashMap<String, usize>,
    x: &str,
    inv: &[f32],
) -> Result<Option<String>> {
    let k = inv.len();
    let producer = g
        .nodes
        .iter()
        .position(|n| n.outputs.iter().any(|o| o == x));
    let Some(p) = producer else { return Ok(None) };
    let inits: HashMap<String, usize> = init_map(g)
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let inits_ref: HashMap<&str, usize> = inits.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let n = g.nodes[p].clone();
    if !n.domain.is_empty() {
        return Ok(None);
    }
    let by_channel = |i: usize| inv[i % k];
    match n.op_type.as_str() {
        "LayerNormalization" => {
            let axis = n.int_or("axis", -1).unwrap_or(0);
            if axis != -1 || n.outputs.len() > 1 && n.outputs[1..].iter().any(|o| !o.is_empty()) {
                return Ok(None);
            }
            let vec_ok = |slot: usize| {
                n.input(slot).is_some_and(|s| {
                    inits_ref
                        .get(s)
                        .is_some_and(|&j| last_axis_vector(&g.initializers[j].tensor, k))
                })
            };
            if !vec_ok(1) || (n.input(2).is_some_and(|s| !s.is_empty()) && !vec_ok(2)) {
                return Ok(None);
            }
            rescale_init(g, uses, p, 1, &by_channel)?;
            if n.input(2).is_some_and(|s| !s.is_empty()) {
                rescale_init(g, uses, p, 2, &by_channel)?;
            }
            Ok(Some(format!("LayerNormalization '{}'", n.name)))
        }
        "Mul" => {
            let Some(slot) = vector_input(g, &inits_ref, &n, k) else {
                return Ok(None);
            };
            rescale_init(g, uses, p, slot, &by_channel)?;
            Ok(Some(format!("Mul '{}' (norm scale)", n.name)))
        }
        "Add" => {
            let Some(bslot) = vector_input(g, &inits_ref, &n, k) else {
                return Ok(None);
            };
            let a = n.inputs[1 - bslot].clone();
            if uses.get(&a).copied().unwrap_or(0) != 1 {
                return Ok(None);
            }
            let Some(q) = g.nodes.iter().position(|m| m.outputs.first() == Some(&a)) else {
                return Ok(None);
            };
            let qn = g.nodes[q].clone();
            if !qn.domain.is_empty() {
                return Ok(None);
            }
            match qn.op_type.as_str() {
                // Decomposed LayerNorm / RMSNorm: `norm * gamma + beta`.
                "Mul" => {
                    let Some(gslot) = vector_input(g, &inits_ref, &qn, k) else {
                        return Ok(None);
                    };
                    rescale_init(g, uses, q, gslot, &by_channel)?;
                    rescale_init(g, uses, p, bslot, &by_channel)?;
                    Ok(Some(format!(
                        "Mul '{}' + Add '{}' (norm affine)",
                        qn.name, n.name
                    )))
                }
                // A previous linear with bias: scale its output columns.
                "MatMul" => {
                    let Some(w) = qn.input(1) else {
                        return Ok(None);
                    };
                    let Some(&wi) = inits_ref.get(w) else {
                        return Ok(None);
                    };
                    let wt = &g.initializers[wi].tensor;
                    if wt.dtype() != DType::F32 || wt.rank() != 2 || wt.shape()[1] != k {
                        return Ok(None);
                    }
                    rescale_init(g, uses, q, 1, &by_channel)?;
                    rescale_init(g, uses, p, bslot, &by_channel)?;
                    Ok(Some(format!(
                        "MatMul '{}' + Add '{}' (columns)",
                        qn.name, n.name
                    )))
                }
                _ => Ok(None),
            }
        }
        _ => Ok(None),
    }
}

/// Statistics of the quantized linears' inputs over the first calibration samples (channel
/// extremes and kept rows), gathered once for smoothing and for SeqMSE.
pub struct LinearStats {
    groups: Vec<Group>,
    stats: Vec<Stats>,
    /// Samples they came from.
    pub samples: usize,
}

impl LinearStats {
    /// Runs the float model `m` over the first `opts.max_samples` samples, observing the inputs
    /// of the linears `plan` quantizes.
    pub fn collect(
        m: &Model,
        plan: &QuantPlan,
        opts: &SmoothOptions,
        samples: impl Iterator<Item = Result<Sample>>,
    ) -> Result<LinearStats> {
        // Subgraphs may read outer values by name: rewriting around them is not worth the risk.
        let groups = if m.graph.nodes.iter().any(|n| {
            n.attrs
                .iter()
                .any(|(_, a)| !npuc_ir::subgraphs(a).is_empty())
        }) {
            vec![]
        } else {
            find_groups(m, Some(plan))
        };
        if groups.is_empty() {
            return Ok(LinearStats {
                groups,
                stats: vec![],
                samples: 0,
            });
        }
        let sess = Session::new(
            m,
            SessionOptions {
                threads: opts.threads.max(1),
            },
        )
        .map_err(|e| anyhow!("building the statistics session: {e}"))?;
        let index: HashMap<&str, usize> = groups
            .iter()
            .enumerate()
            .map(|(i, g)| (g.input.as_str(), i))
            .collect();
        let mut stats: Vec<Stats> = groups.iter().map(|g| Stats::new(g.k)).collect();
        let mut n = 0;
        for s in samples.take(opts.max_samples.max(1)) {
            let s = s?;
            for (name, t) in &s.feeds {
                if let Some(&i) = index.get(name.as_str()) {
                    stats[i].add(n, t, opts.rows);
                }
            }
            let feeds = s
                .feeds
                .iter()
                .map(|(k, t)| (k.clone(), Value::tensor(t.clone())))
                .collect();
            let label = s.label.clone();
            sess.run_observed(feeds, &mut |name, v| {
                if let (Some(&i), Some(t)) = (index.get(name), v.as_tensor()) {
                    if t.dtype() == DType::F32 {
                        stats[i].add(n, t, opts.rows);
                    }
                }
            })
            .map_err(|e| anyhow!("linear input statistics, sample {label}: {e}"))?;
            n += 1;
        }
        if n == 0 {
            bail!("the calibration set is empty: no sample was found");
        }
        Ok(LinearStats {
            groups,
            stats,
            samples: n,
        })
    }

    /// Kept input rows per linear weight name, divided by the smoothing scales of their
    /// activation where `scales` has them (the rows the smoothed model's linears see).
    pub fn weight_rows(&self, scales: &Scales) -> crate::seqmse::WeightRows {
        let mut out = crate::seqmse::WeightRows::new();
        for (gr, st) in self.groups.iter().zip(&self.stats) {
            if st.bad_shape.is_some() || st.rows.is_empty() {
                continue;
            }
            let s = scales.get(&gr.input);
            let rows: Vec<f32> = st
                .rows
                .iter()
                .flat_map(|(_, r)| {
                    r.iter()
                        .enumerate()
                        .map(move |(j, v)| s.map_or(*v, |s| v / s[j]))
                })
                .collect();
            for c in &gr.consumers {
                out.insert(c.weight.clone(), (gr.k, rows.clone()));
            }
        }
        out
    }
}

/// Smooths `m` (see the module docs) with the statistics `st` collected on it; `plan` is the
/// quantization plan of `m` (which linears and activations are integer, the weight specs).
/// Returns the smoothed model (to be planned and calibrated again) and what was done.
pub fn smooth(
    m: &Model,
    plan: &QuantPlan,
    opts: &SmoothOptions,
    st: &LinearStats,
) -> Result<(Model, SmoothReport)> {
    let (groups, stats, nsamples) = (&st.groups, &st.stats, st.samples);
    let alphas: Vec<f32> = match opts.alpha {
        Some(a) => vec![a],
        None => ALPHAS.to_vec(),
    };
    let g0 = &m.graph;
    let scored: Vec<Option<Scored>> = groups
        .par_iter()
        .zip(stats.par_iter())
        .map(|(gr, st)| {
            // Float activations (weight-only schemes) have nothing to smooth.
            if st.bad_shape.is_some() || st.rows.is_empty() || gr.act_dtype == DType::F32 {
                return Ok(None);
            }
            choose(gr, st, g0, plan, &alphas).map(Some)
        })
        .collect::<Result<_>>()?;
    let mut report = SmoothReport {
        groups: vec![],
        samples: nsamples,
        scales: Scales::new(),
    };
    for (gr, sc) in groups.iter().zip(scored) {
        let Some(sc) = sc else { continue };
        if sc.alpha.is_some() {
            report.scales.insert(gr.input.clone(), sc.scales.clone());
        }
        report.groups.push(GroupReport {
            input: gr.input.clone(),
            consumers: gr
                .consumers
                .iter()
                .map(|c| g0.nodes[c.node].name.clone())
                .collect(),
            channels: gr.k,
            alpha: sc.alpha,
            sqnr_before: sc.before,
            sqnr_after: sc.after,
            folded: String::new(),
        });
    }
    let (out, folded) = apply_scales(m, &report.scales)?;
    for g in &mut report.groups {
        if let Some(f) = folded.get(&g.input) {
            g.folded = f.clone();
        }
    }
    Ok((out, report))
}

/// Rewrites `m` with the given per-channel scales (activation name -> `s`, one per input
/// channel): the linears reading each activation get `diag(s) W`, the activation `X / s`
/// (folded into its producer where exact, else an explicit Mul). Returns the model and, per
/// activation, where `1/s` went. Deterministic: the same scales on the same model give the same
/// graph, which is how encodings written after smoothing are read back.
pub fn apply_scales(m: &Model, scales: &Scales) -> Result<(Model, BTreeMap<String, String>)> {
    let mut folded_into = BTreeMap::new();
    if scales.is_empty() {
        return Ok((m.clone(), folded_into));
    }
    let groups = find_groups(m, None);
    for (x, s) in scales {
        let Some(gr) = groups.iter().find(|g| &g.input == x) else {
            bail!("smoothing scales name '{x}', but no quantized MatMul/Gemm of this model reads it with a float weight of its own");
        };
        if s.len() != gr.k {
            bail!(
                "smoothing scales of '{x}' have {} entries; the linears reading it have {} input channels",
                s.len(),
                gr.k
            );
        }
        if let Some(v) = s.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
            bail!("smoothing scales of '{x}' hold {v}: every scale must be positive and finite");
        }
    }
    let g0 = &m.graph;
    let inits0 = init_map(g0);
    let mut out = m.clone();
    let g = &mut out.graph;
    let mut uses = use_counts(g);
    let mut inserts: Vec<(usize, Node, Vec<usize>)> = vec![];
    for gr in &groups {
        let Some(s) = scales.get(&gr.input) else {
            continue;
        };
        let inv: Vec<f32> = s.iter().map(|v| 1.0 / v).collect();
        for c in &gr.consumers {
            let n = g0.initializers[inits0[c.weight.as_str()]].tensor.shape()[1];
            let f = |i: usize| match c.k_axis {
                // [K, N]: element i is in row i / N.
                KAxis::Rows => s[i / n],
                KAxis::Cols => s[i % gr.k],
            };
            rescale_init(g, &mut uses, c.node, 1, &f)?;
        }
        let folded = if gr.exclusive {
            fold_into_producer(g, &mut uses, &gr.input, &inv)?
        } else {
            None
        };
        let what = match folded {
            Some(f) => f,
            None => {
                let inv_name = format!("{}_smooth_inv", gr.input);
                let out_name = format!("{}_smoothed", gr.input);
                g.initializers.push(Initializer {
                    name: inv_name.clone(),
                    tensor: Tensor::from_vec(vec![gr.k], inv)?,
                });
                let mut node = Node::new("Mul", &[&gr.input, &inv_name], &[&out_name]);
                node.name = format!("{}_smooth", gr.input);
                let at = gr.consumers.iter().map(|c| c.node).min().unwrap_or(0);
                inserts.push((at, node, gr.consumers.iter().map(|c| c.node).collect()));
                "explicit Mul".to_string()
            }
        };
        folded_into.insert(gr.input.clone(), what);
    }
    // Rewire, then insert the explicit scales (descending positions keep indices valid).
    for (_, node, consumers) in &inserts {
        for &c in consumers {
            g.nodes[c].inputs[0] = node.outputs[0].clone();
        }
    }
    inserts.sort_by_key(|(at, _, _)| std::cmp::Reverse(*at));
    for (at, node, _) in inserts {
        g.nodes.insert(at, node);
    }
    // Initializers replaced by rescaled copies and read by nothing now.
    let now = use_counts(g);
    let before = use_counts(&m.graph);
    g.initializers.retain(|i| {
        now.get(&i.name).copied().unwrap_or(0) > 0 || before.get(&i.name).copied().unwrap_or(0) == 0
    });
    Ok((out, folded_into))
}
