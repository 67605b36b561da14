//! Planning, calibration, encoding computation and QDQ insertion.

use crate::observer::{CalibMethod, Observer};
use crate::{act_scale_zp, qrange, QuantOptions, Scheme};
use anyhow::{anyhow, bail, Context, Result};
use npuc_ir::{Attr, DType, Graph, Initializer, Model, Node, Tensor, ValueInfo};
use npuc_runtime::{Session, SessionOptions, Value};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet};

/// Ops whose inputs, outputs, weights and biases get quantized.
pub const QUANTIZED_OPS: &[&str] = &["Conv", "ConvTranspose", "Gemm", "MatMul"];

/// Integer quantization parameters of one tensor (ONNX convention `real = (q - zp) * scale`).
#[derive(Clone, Debug, PartialEq)]
pub struct QEnc {
    /// Stored integer type.
    pub dtype: DType,
    /// Scales, flattened in the layout of `param_shape`.
    pub scale: Vec<f32>,
    /// Zero points, same layout as `scale`.
    pub zero_point: Vec<i64>,
    /// Quantization axis (per-axis and blocked).
    pub axis: Option<usize>,
    /// Block size along `axis` (blocked).
    pub block_size: Option<usize>,
    /// Shape of the scale/zero-point tensors (`[]` per tensor, `[C]` per axis, the input's shape
    /// with `ceil(d/block)` on the axis for blocked).
    pub param_shape: Vec<usize>,
    /// For an LPBQ weight ([`crate::lpbq`]): how the blocked `scale`s are made of integer
    /// block scales and per-channel float scales (what AIMET's `LPBQ` encodings record).
    pub lpbq: Option<LpbqScales>,
}

/// The structure of an LPBQ weight encoding: every effective block scale (`QEnc::scale`, in
/// `param_shape` layout) is `channel_scales[c] * int_scales[p] as f32` (one f32 product, as
/// [`crate::lpbq::LpbqWeight::block_scale`] computes it), `c` the block's output channel.
#[derive(Clone, Debug, PartialEq)]
pub struct LpbqScales {
    /// Bits of each integer block scale (values `1..=2^compressed_bw`).
    pub compressed_bw: u8,
    /// Integer block scales, same layout as `QEnc::scale`.
    pub int_scales: Vec<u16>,
    /// One float scale per output channel.
    pub channel_scales: Vec<f32>,
    /// The weight's output-channel axis (an axis of `param_shape`).
    pub out_axis: usize,
}

impl LpbqScales {
    /// The effective block scales for `param_shape` (`channel_scale * k` per block); errors when
    /// the sizes do not fit the layout or an integer scale is outside `1..=2^compressed_bw`.
    pub fn block_scales(&self, param_shape: &[usize]) -> Result<Vec<f32>> {
        let np: usize = param_shape.iter().product();
        let Some(&channels) = param_shape.get(self.out_axis) else {
            bail!(
                "LPBQ: output axis {} outside the scale shape {param_shape:?}",
                self.out_axis
            );
        };
        if self.int_scales.len() != np || self.channel_scales.len() != channels {
            bail!(
                "LPBQ: {} integer block scales and {} channel scales do not fit the block layout {param_shape:?} (need {np} and {channels})",
                self.int_scales.len(),
                self.channel_scales.len()
            );
        }
        let kmax = 1u32 << self.compressed_bw;
        if let Some(k) = self
            .int_scales
            .iter()
            .find(|&&k| k == 0 || u32::from(k) > kmax)
        {
            bail!(
                "LPBQ: integer block scale {k} outside 1..={kmax} ({} bits)",
                self.compressed_bw
            );
        }
        let inner: usize = param_shape[self.out_axis + 1..].iter().product();
        Ok((0..np)
            .map(|p| self.channel_scales[(p / inner) % channels] * self.int_scales[p] as f32)
            .collect())
    }
}

impl QEnc {
    /// A per-tensor encoding.
    pub fn per_tensor(dtype: DType, scale: f32, zp: i64) -> QEnc {
        QEnc {
            dtype,
            scale: vec![scale],
            zero_point: vec![zp],
            axis: None,
            block_size: None,
            param_shape: vec![],
            lpbq: None,
        }
    }

    /// `[min, max]` real range of parameter `i`.
    pub fn real_range(&self, i: usize) -> (f32, f32) {
        let (qmin, qmax) = qrange(self.dtype);
        let (s, z) = (self.scale[i], self.zero_point[i]);
        ((qmin - z) as f32 * s, (qmax - z) as f32 * s)
    }
}

/// How one tensor is quantized.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorEncoding {
    /// Integer quantize-dequantize.
    Int(QEnc),
    /// Rounded through a reduced float type (F16 or BF16) with a Cast pair.
    Float(DType),
}

/// Encodings of a whole model, keyed by tensor name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Encodings {
    /// Activations (node outputs and graph inputs).
    pub activations: BTreeMap<String, TensorEncoding>,
    /// Parameters (initializers: weights and biases).
    pub params: BTreeMap<String, TensorEncoding>,
    /// Outlier-migration scales applied to the float model before these encodings were made
    /// (activation name -> per-channel `s`, [`crate::smooth::apply_scales`]); the encodings
    /// name tensors of the smoothed model. Empty when not smoothed.
    pub smoothing: BTreeMap<String, Vec<f32>>,
}

/// How a weight initializer is quantized.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightSpec {
    /// Integer type (symmetric).
    pub dtype: DType,
    /// Per-axis / blocked axis.
    pub axis: Option<usize>,
    /// Block size for blocked quantization.
    pub block: Option<usize>,
    /// LPBQ (with `block`): bits of the integer block scales.
    pub lpbq: Option<u8>,
}

/// A bias to quantize as int32 with scale `s_input * s_weight`.
#[derive(Clone, Debug, PartialEq)]
pub struct BiasSpec {
    /// The activation feeding the op.
    pub input: String,
    /// The op's weight initializer.
    pub weight: String,
}

/// What [`plan`] decided.
#[derive(Clone, Debug, Default)]
pub struct QuantPlan {
    /// Quantizable nodes and the scheme each got.
    pub nodes: Vec<(String, Scheme)>,
    /// Activations to calibrate, with their integer type.
    pub activations: BTreeMap<String, DType>,
    /// Activations rounded through F16/BF16.
    pub act_casts: BTreeMap<String, DType>,
    /// Weight initializers to quantize.
    pub weights: BTreeMap<String, WeightSpec>,
    /// Weight initializers stored in F16/BF16.
    pub weight_casts: BTreeMap<String, DType>,
    /// Bias initializers to quantize as int32.
    pub biases: BTreeMap<String, BiasSpec>,
    /// What the plan could not do as asked (e.g. an LPBQ block size that does not divide a
    /// weight's input channels, so that weight is per-channel), one line each, for the user.
    pub notes: Vec<String>,
}

/// Output-channel axis and reduction axis of a quantizable op's weight of the given rank.
pub fn weight_axes(node: &Node, rank: usize) -> Option<(usize, usize)> {
    match node.op_type.as_str() {
        "Conv" if rank >= 2 => Some((0, 1)),
        "ConvTranspose" if rank >= 2 => Some((1, 0)),
        "MatMul" if rank >= 2 => Some((rank - 1, rank - 2)),
        "Gemm" if rank == 2 => {
            if node.int_or("transB", 0).unwrap_or(0) != 0 {
                Some((0, 1))
            } else {
                Some((1, 0))
            }
        }
        _ => None,
    }
}

fn is_quantizable(n: &Node) -> bool {
    (n.domain.is_empty() || n.domain == "ai.onnx") && QUANTIZED_OPS.contains(&n.op_type.as_str())
}

/// Activation precision order used when two nodes want different types for one tensor: the
/// wider wins.
fn act_rank(d: DType) -> u32 {
    crate::bitwidth(d)
}

/// Every tensor name of the graph (node outputs, graph inputs, initializers).
fn tensor_names(g: &Graph) -> HashSet<&str> {
    g.nodes
        .iter()
        .flat_map(|n| n.outputs.iter().map(|s| s.as_str()))
        .chain(g.inputs.iter().map(|v| v.name.as_str()))
        .chain(g.initializers.iter().map(|i| i.name.as_str()))
        .filter(|s| !s.is_empty())
        .collect()
}

/// Decides, per Conv/ConvTranspose/Gemm/MatMul node, its scheme (overrides, `--keep-float`)
/// and what must be quantized. Errors when an override or keep-float pattern matches no node or
/// tensor name.
pub fn plan(m: &Model, opts: &QuantOptions) -> Result<QuantPlan> {
    let g = &m.graph;
    let mut rules = opts.overrides.clone().unwrap_or_default();
    for p in &opts.keep_float {
        rules.rules.push(crate::overrides::Rule {
            pattern: p.clone(),
            scheme: "float".into(),
        });
    }
    let default = match rules.default.as_deref() {
        Some(d) => Scheme::parse(d)?,
        None => opts.scheme,
    };
    let names = tensor_names(g);
    for r in &rules.rules {
        let hit = g
            .nodes
            .iter()
            .any(|n| crate::overrides::glob_match(&r.pattern, &n.name))
            || names
                .iter()
                .any(|t| crate::overrides::glob_match(&r.pattern, t));
        if !hit {
            bail!(
                "override pattern '{}' (scheme {}) matches no node or tensor name of the model",
                r.pattern,
                r.scheme
            );
        }
    }
    let inits: HashMap<&str, &Tensor> = g
        .initializers
        .iter()
        .map(|i| (i.name.as_str(), &i.tensor))
        .collect();
    let float_init = |name: &str| inits.get(name).filter(|t| t.dtype() == DType::F32).copied();
    let mut p = QuantPlan::default();
    let want_act = |p: &mut QuantPlan, t: &str, d: DType| {
        if t.is_empty() || inits.contains_key(t) {
            return;
        }
        let e = p.activations.entry(t.to_string()).or_insert(d);
        if act_rank(d) > act_rank(*e) {
            *e = d;
        }
    };
    for n in &g.nodes {
        if !is_quantizable(n) {
            continue;
        }
        let mut keys: Vec<&str> = vec![n.name.as_str()];
        keys.extend(n.outputs.iter().map(|s| s.as_str()));
        keys.extend(
            n.inputs
                .iter()
                .map(|s| s.as_str())
                .filter(|s| inits.contains_key(s)),
        );
        let scheme = rules
            .lookup(keys.iter().copied())
            .map(|(_, s)| s)
            .unwrap_or(default);
        p.nodes.push((n.name.clone(), scheme));
        if scheme == Scheme::Float {
            continue;
        }
        let x = n.input(0).unwrap_or("");
        let w = n.input(1).unwrap_or("");
        let y = n.outputs.first().map(|s| s.as_str()).unwrap_or("");
        if let Some(cd) = scheme.cast_dtype() {
            for t in [x, y] {
                if !t.is_empty() && !inits.contains_key(t) {
                    p.act_casts.insert(t.to_string(), cd);
                }
            }
            if float_init(w).is_some() {
                p.weight_casts.insert(w.to_string(), cd);
            } else if !w.is_empty() {
                p.act_casts.insert(w.to_string(), cd);
            }
            continue;
        }
        let ad = scheme.act_dtype(opts.symmetric_activations);
        if let Some(ad) = ad {
            want_act(&mut p, x, ad);
            want_act(&mut p, y, ad);
        }
        let wd = scheme
            .weight_dtype()
            .expect("integer schemes have a weight type");
        if let Some(wt) = float_init(w) {
            let conv = n.op_type == "Conv" || n.op_type == "ConvTranspose";
            if opts.profile == crate::Profile::QnnHtp {
                match opts.granularity {
                    crate::Granularity::PerBlock(b) => bail!("--granularity per-block (block {b}) is not in the qnn-htp profile: ONNX Runtime's QNN EP takes per-tensor or per-channel weights; use --quant-profile npuc"),
                    crate::Granularity::Lpbq { block, .. } => bail!("--granularity lpbq (block {block}) is not in the qnn-htp profile: npuc's QNN-EP export does not write LPBQ weights yet; use --quant-profile npuc"),
                    _ => {}
                }
            }
            let mut lpbq = None;
            let (axis, block) = match weight_axes(n, wt.rank()) {
                None => (None, None),
                // QNN HTP: per-channel weights on convolutions only.
                Some(_) if opts.profile == crate::Profile::QnnHtp && !conv => (None, None),
                Some((out, inp)) => match opts.granularity {
                    crate::Granularity::PerTensor => (None, None),
                    crate::Granularity::PerChannel => (Some(out), None),
                    crate::Granularity::PerRow => (Some(0), None),
                    crate::Granularity::PerBlock(b) => (Some(inp), Some(b)),
                    crate::Granularity::Lpbq {
                        block,
                        compressed_bw,
                    } => match lpbq_fallback(n, wt, inp, block, wd) {
                        None => {
                            lpbq = Some(compressed_bw);
                            (Some(inp), Some(block))
                        }
                        Some(why) => {
                            if !conv {
                                p.notes.push(format!(
                                    "weight '{w}' of {} '{}': per-channel instead of LPBQ ({why})",
                                    n.op_type, n.name
                                ));
                            }
                            (Some(out), None)
                        }
                    },
                },
            };
            let spec = WeightSpec {
                dtype: wd,
                axis,
                block,
                lpbq,
            };
            match p.weights.get(w) {
                // Shared weight: the wider type wins.
                Some(old) if crate::bitwidth(old.dtype) >= crate::bitwidth(wd) => {}
                _ => {
                    p.weights.insert(w.to_string(), spec);
                }
            }
            // Bias: only when the activation is integer too (int32 accumulation).
            if let (Some(b), Some(_)) = (n.input(2), ad) {
                if n.op_type != "MatMul" && float_init(b).is_some_and(|t| t.rank() == 1) {
                    p.biases.insert(
                        b.to_string(),
                        BiasSpec {
                            input: x.to_string(),
                            weight: w.to_string(),
                        },
                    );
                }
            }
        } else if let Some(ad) = ad {
            // Second operand computed at run time (attention MatMuls): an activation.
            want_act(&mut p, w, ad);
        }
    }
    Ok(p)
}

/// Why a weight cannot be LPBQ-quantized (`None` when it can): LPBQ applies to the 2-D weight
/// of a MatMul/Gemm whose input channels the block size divides, with 4- or 8-bit values.
fn lpbq_fallback(n: &Node, w: &Tensor, inp: usize, block: usize, wd: DType) -> Option<String> {
    if n.op_type != "MatMul" && n.op_type != "Gemm" {
        return Some("LPBQ applies to MatMul/Gemm weights".into());
    }
    if w.rank() != 2 {
        return Some(format!("a {}-D weight, LPBQ takes 2-D ones", w.rank()));
    }
    let k = w.shape()[inp];
    if !k.is_multiple_of(block) {
        return Some(format!(
            "block size {block} does not divide its {k} input channels"
        ));
    }
    if !matches!(wd, DType::I4 | DType::I8) {
        return Some(format!("{wd} weights; LPBQ takes 4- or 8-bit ones"));
    }
    None
}

/// One calibration sample: a label for messages (e.g. its file) and the input feeds.
pub struct Sample {
    /// Names the sample in errors (file path).
    pub label: String,
    /// `(input name, tensor)` feeds.
    pub feeds: Vec<(String, Tensor)>,
}

/// The graph calibration runs: `m` without the nodes no planned activation depends on
/// ([`prune_to_planned`]).
///
/// It stays the unfused graph `m`: running LayerNorm/GELU fused (measured ~6% less CPU per ViT-S
/// sample) changes activations by ~1e-6 relative, which moves no zero point but shifts the
/// ViT-S w8a8 output SQNR by up to +-1 dB through rounding ties; calibrating on exactly the
/// graph being quantized keeps encodings bit-identical to a plain float run.
fn calibration_model(m: &Model, plan: &QuantPlan) -> Model {
    let mut c = m.clone();
    prune_to_planned(&mut c.graph, plan);
    c
}

/// Drops the nodes no planned activation depends on (e.g. a float head after the last quantized
/// op) and makes the planned activations nobody reads the graph outputs, so a calibration run
/// computes nothing it does not observe. Graphs with subgraph attributes (If/Loop/Scan, which
/// may read enclosing values by name) are left alone.
fn prune_to_planned(g: &mut Graph, plan: &QuantPlan) {
    if g.nodes.iter().any(|n| {
        n.attrs
            .iter()
            .any(|(_, a)| !npuc_ir::subgraphs(a).is_empty())
    }) {
        return;
    }
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for o in n.outputs.iter().filter(|o| !o.is_empty()) {
            producer.insert(o.as_str(), i);
        }
    }
    let mut keep = vec![false; g.nodes.len()];
    let mut stack: Vec<usize> = plan
        .activations
        .keys()
        .filter_map(|t| producer.get(t.as_str()).copied())
        .collect();
    while let Some(i) = stack.pop() {
        if std::mem::replace(&mut keep[i], true) {
            continue;
        }
        stack.extend(
            g.nodes[i]
                .inputs
                .iter()
                .filter_map(|x| producer.get(x.as_str()).copied()),
        );
    }
    let read: HashSet<&str> = g
        .nodes
        .iter()
        .zip(&keep)
        .filter(|(_, &k)| k)
        .flat_map(|(n, _)| n.inputs.iter().map(|s| s.as_str()))
        .collect();
    let sinks: Vec<ValueInfo> = plan
        .activations
        .keys()
        .filter(|t| producer.contains_key(t.as_str()) && !read.contains(t.as_str()))
        .map(|t| ValueInfo::new(t.clone(), None))
        .collect();
    if sinks.is_empty() {
        return;
    }
    let mut k = keep.into_iter();
    g.nodes.retain(|_| k.next().unwrap_or(true));
    g.outputs = sinks;
}

/// A calibration worker's failure: the sample index it happened on and the error.
type SampleError = (usize, anyhow::Error);

/// Receives one observed activation: observer index, tensor name, values.
type Sink<'a> = &'a mut (dyn FnMut(usize, &str, &[f32]) -> Result<()> + Send);

/// Histogram observers fed in sample order by the workers themselves, activation by
/// activation: `fed[k]` samples have been added to (or passed by) observer `k`, and the
/// worker of sample `i` adds its values of activation `k` once `fed[k] == i`, while it still
/// holds them (the runtime's buffer), then makes it `i + 1`. Each observer so sees the
/// samples in order, as a sequential run feeds it, and no sample's activations are copied
/// (copies of whole samples waiting for their turn were several GB for a ViT-H). The worker of
/// sample `i` waits only for the one of `i - 1`, which was handed out earlier and waits only
/// for its own predecessor, so the earliest running sample always proceeds.
struct InOrder {
    observers: Vec<std::sync::Mutex<Observer>>,
    fed: std::sync::Mutex<Vec<usize>>,
    turn: std::sync::Condvar,
}

/// A worker stopped waiting because another one failed.
struct Stopped;

impl InOrder {
    fn new(n: usize) -> InOrder {
        InOrder {
            observers: (0..n)
                .map(|_| std::sync::Mutex::new(Observer::new(true)))
                .collect(),
            fed: std::sync::Mutex::new(vec![0; n]),
            turn: std::sync::Condvar::new(),
        }
    }

    /// Waits until observer `k` has seen every sample before `i`.
    fn wait_turn(
        &self,
        k: usize,
        i: usize,
        stop: &std::sync::atomic::AtomicBool,
    ) -> std::result::Result<(), Stopped> {
        let mut fed = self.fed.lock().unwrap_or_else(|e| e.into_inner());
        while fed[k] < i {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Stopped);
            }
            fed = self.turn.wait(fed).unwrap_or_else(|e| e.into_inner());
        }
        Ok(())
    }

    fn done(&self, k: usize, i: usize) {
        let mut fed = self.fed.lock().unwrap_or_else(|e| e.into_inner());
        fed[k] = fed[k].max(i + 1);
        self.turn.notify_all();
    }

    /// Wakes every waiting worker (after a failure: they see `stop` and return).
    fn wake_all(&self) {
        let _fed = self.fed.lock().unwrap_or_else(|e| e.into_inner());
        self.turn.notify_all();
    }

    fn into_observers(self) -> Vec<Observer> {
        self.observers
            .into_iter()
            .map(|o| o.into_inner().unwrap_or_else(|e| e.into_inner()))
            .collect()
    }
}

/// Runs the float model over `samples` and returns one observer per planned activation.
/// `progress` is called with the number of samples done. Inputs with NaN/Inf are rejected
/// naming the input and the sample.
///
/// `threads` samples run concurrently, each single-threaded (two cores scale better over samples
/// than inside one op), on one shared session of the float graph ([`calibration_model`]); for
/// models whose weights are under [`PREPACK_MAX_WEIGHT_BYTES`] the session keeps its MatMul
/// weights packed, instead of packing every weight again for every sample;
/// activations are observed as each node produces them
/// ([`Session::run_observed`]), so no intermediate is kept alive for calibration. Min/max
/// observers are per worker and merged at the end (exact); histogram observers depend on sample
/// order, so the workers feed them in sample order, each activation as it is produced
/// ([`InOrder`]). Either way the result does not depend on `threads`.
pub fn calibrate(
    m: &Model,
    plan: &QuantPlan,
    method: CalibMethod,
    threads: usize,
    samples: impl Iterator<Item = Result<Sample>> + Send,
    mut progress: impl FnMut(usize),
) -> Result<BTreeMap<String, Observer>> {
    let cm = calibration_model(m, plan);
    let names: Vec<&String> = plan.activations.keys().collect();
    let index: HashMap<&str, usize> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let with_hist = method != CalibMethod::MinMax;
    let workers = threads.max(1);
    let source = std::sync::Mutex::new(samples.enumerate());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let in_order = InOrder::new(if with_hist { names.len() } else { 0 });
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let sess = Session::new(&cm, SessionOptions { threads: 1 })
        .map_err(|e| anyhow!("building the calibration session: {e}"))?;
    sess.set_weight_prepacking(weight_bytes(&cm) <= PREPACK_MAX_WEIGHT_BYTES);
    let sess = &sess;
    let worker =
        |tx: std::sync::mpsc::Sender<()>| -> std::result::Result<Vec<Observer>, SampleError> {
            let mut obs: Vec<Observer> = names.iter().map(|_| Observer::new(false)).collect();
            loop {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    return Ok(obs);
                }
                let next = source.lock().unwrap_or_else(|e| e.into_inner()).next();
                let Some((i, s)) = next else {
                    return Ok(obs);
                };
                let s = s.map_err(|e| (i, e))?;
                let label = s.label.clone();
                if with_hist {
                    let mut seen = vec![false; names.len()];
                    let mut stopped = false;
                    let r = observe_sample(sess, &index, s, &mut |k, name, xs| {
                        if in_order.wait_turn(k, i, &stop).is_err() {
                            stopped = true;
                            return Err(anyhow!("stopped: an earlier sample failed"));
                        }
                        let added = in_order.observers[k]
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .add(xs);
                        seen[k] = true;
                        in_order.done(k, i);
                        added.map_err(|j| non_finite(&label, name, xs, j))
                    });
                    if let Err(e) = r {
                        // Stopped while waiting: the sample that failed reports its own error.
                        return Err((if stopped { usize::MAX } else { i }, e));
                    }
                    // The activations this sample did not produce: passed, in their turn.
                    for k in (0..names.len()).filter(|&k| !seen[k]) {
                        if in_order.wait_turn(k, i, &stop).is_err() {
                            return Ok(obs);
                        }
                        in_order.done(k, i);
                    }
                } else {
                    observe_sample(sess, &index, s, &mut |k, name, xs| {
                        obs[k].add(xs).map_err(|j| non_finite(&label, name, xs, j))
                    })
                    .map_err(|e| (i, e))?;
                }
                if tx.send(()).is_err() {
                    return Ok(obs);
                }
            }
        };
    let mut n = 0usize;
    let results: Vec<std::result::Result<Vec<Observer>, SampleError>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                let tx = tx.clone();
                let (worker, stop, in_order) = (&worker, &stop, &in_order);
                sc.spawn(move || {
                    let r = worker(tx);
                    if r.is_err() {
                        stop.store(true, std::sync::atomic::Ordering::Relaxed);
                        in_order.wake_all();
                    }
                    r
                })
            })
            .collect();
        drop(tx);
        while rx.recv().is_ok() {
            n += 1;
            progress(n);
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err((0, anyhow!("a calibration worker panicked"))))
            })
            .collect()
    });
    let mut errors: Vec<SampleError> = vec![];
    let mut merged: Option<Vec<Observer>> = None;
    for r in results {
        match r {
            Ok(o) => match &mut merged {
                None => merged = Some(o),
                Some(acc) => acc.iter_mut().zip(&o).for_each(|(a, b)| a.merge(b)),
            },
            Err(e) => errors.push(e),
        }
    }
    // The error of the earliest sample wins (what a sequential run reports).
    if let Some((_, e)) = errors.into_iter().min_by_key(|(i, _)| *i) {
        return Err(e);
    }
    if n == 0 {
        bail!("the calibration set is empty: no sample was found");
    }
    let obs = if with_hist {
        in_order.into_observers()
    } else {
        merged.unwrap_or_default()
    };
    Ok(names.into_iter().cloned().zip(obs).collect())
}

/// Models with at most this many bytes of weights are calibrated with their MatMul weights kept
/// packed (a second copy of those weights for the calibration's lifetime; ViT-S calibrates ~13% faster
/// with it); larger ones (a 2.5 GB ViT-H) pack per run and hold one copy.
pub const PREPACK_MAX_WEIGHT_BYTES: usize = 1 << 30;

/// The bytes of `m`'s initializers (weights), as stored.
pub fn weight_bytes(m: &Model) -> usize {
    m.graph
        .initializers
        .iter()
        .map(|i| i.tensor.len() * i.tensor.dtype().size().max(1))
        .sum()
}

/// The error for a NaN/Inf at flat index `j` of an activation.
fn non_finite(label: &str, name: &str, xs: &[f32], j: usize) -> anyhow::Error {
    anyhow!(
        "calibration sample {label}: tensor '{name}' is non-finite ({}) at flat index {j}; the float model overflows on this input",
        xs.get(j).copied().unwrap_or(f32::NAN)
    )
}

/// Runs one sample and hands every planned f32 activation it produces (graph inputs
/// included) to `sink(observer index, name, values)`; the first error `sink` returns is the
/// sample's error.
fn observe_sample(
    sess: &Session,
    index: &HashMap<&str, usize>,
    s: Sample,
    sink: Sink,
) -> Result<()> {
    let label = &s.label;
    let mut err: Option<anyhow::Error> = None;
    let mut see = |name: &str, t: &Tensor, err: &mut Option<anyhow::Error>| {
        let Some(&i) = index.get(name) else { return };
        if err.is_some() || t.dtype() != DType::F32 {
            return;
        }
        let r = t
            .as_slice::<f32>()
            .map_err(|e| anyhow!("{name}: {e}"))
            .and_then(|xs| sink(i, name, xs));
        if let Err(e) = r {
            *err = Some(e);
        }
    };
    for (name, t) in &s.feeds {
        check_finite(t).map_err(|i| {
            anyhow!(
                "calibration sample {label}: input '{name}' has a non-finite value ({}) at flat index {i}",
                t.to_f64_vec().ok().and_then(|v| v.get(i).copied()).unwrap_or(f64::NAN)
            )
        })?;
        see(name, t, &mut err);
    }
    let feeds = s
        .feeds
        .iter()
        .map(|(k, t)| (k.clone(), Value::tensor(t.clone())))
        .collect();
    sess.run_observed(feeds, &mut |name, v| {
        if let Some(t) = v.as_tensor() {
            see(name, t, &mut err);
        }
    })
    .map_err(|e| anyhow!("calibration sample {label}: {e}"))?;
    match err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn check_finite(t: &Tensor) -> std::result::Result<(), usize> {
    match t.dtype() {
        DType::F32 => match t.as_slice::<f32>() {
            Ok(xs) => xs.iter().position(|x| !x.is_finite()).map_or(Ok(()), Err),
            Err(_) => Ok(()),
        },
        DType::F64 | DType::F16 | DType::BF16 => match t.to_f64_vec() {
            Ok(xs) => xs.iter().position(|x| !x.is_finite()).map_or(Ok(()), Err),
            Err(_) => Ok(()),
        },
        _ => Ok(()),
    }
}

/// `[outer, d, inner]` around `axis`.
fn split(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = shape[..axis].iter().product();
    let inner = shape[axis + 1..].iter().product();
    (outer, shape[axis], inner)
}

/// Parameter index of every element for a per-tensor / per-axis / blocked layout, plus the
/// parameter shape.
fn param_layout(shape: &[usize], axis: Option<usize>, block: Option<usize>) -> (Vec<usize>, usize) {
    match (axis, block) {
        (None, _) => (vec![], 1),
        (Some(a), None) => (vec![shape[a]], shape[a]),
        (Some(a), Some(b)) => {
            let mut ps = shape.to_vec();
            ps[a] = shape[a].div_ceil(b);
            let n = ps.iter().product();
            (ps, n)
        }
    }
}

#[inline]
fn param_index(
    e: usize,
    shape_split: (usize, usize, usize),
    axis: Option<usize>,
    block: Option<usize>,
) -> usize {
    let (_, d, inner) = shape_split;
    match (axis, block) {
        (None, _) => 0,
        (Some(_), None) => (e / inner) % d,
        (Some(_), Some(b)) => {
            let o = e / (d * inner);
            let a = (e / inner) % d;
            let i = e % inner;
            (o * d.div_ceil(b) + a / b) * inner + i
        }
    }
}

/// Symmetric weight encoding from the data: scale = absmax / qmax per parameter.
pub fn weight_encoding(w: &Tensor, spec: &WeightSpec, name: &str) -> Result<QEnc> {
    let data = w
        .as_slice::<f32>()
        .map_err(|e| anyhow!("weight '{name}': {e}"))?;
    let shape = w.shape();
    if let Some(a) = spec.axis {
        if a >= shape.len() {
            bail!("weight '{name}': axis {a} out of range for shape {shape:?}");
        }
    }
    let (param_shape, np) = param_layout(shape, spec.axis, spec.block);
    if let Some(cbw) = spec.lpbq {
        return lpbq_encoding(data, shape, spec, cbw, param_shape, name);
    }
    let sp = spec.axis.map(|a| split(shape, a)).unwrap_or((1, 1, 1));
    let mut amax = vec![0f32; np];
    for (e, &x) in data.iter().enumerate() {
        if !x.is_finite() {
            bail!("weight '{name}' has a non-finite value ({x}) at flat index {e}");
        }
        let p = param_index(e, sp, spec.axis, spec.block);
        amax[p] = amax[p].max(x.abs());
    }
    let qmax = qrange(spec.dtype).1 as f32;
    // One channel (e.g. a Conv with a single output map) is per tensor: AIMET encodings cannot
    // tell a one-entry per-channel list from a per-tensor one, so this keeps encodings written
    // and read back (`--encodings`) the same quantization, down to the exported graph.
    let (axis, param_shape) = if spec.block.is_none() && np == 1 {
        (None, vec![])
    } else {
        (spec.axis, param_shape)
    };
    Ok(QEnc {
        dtype: spec.dtype,
        scale: amax
            .iter()
            .map(|&a| if a > 0.0 { a / qmax } else { 1.0 })
            .collect(),
        zero_point: vec![0; np],
        axis,
        block_size: spec.block,
        param_shape,
        lpbq: None,
    })
}

/// An LPBQ weight encoding ([`crate::lpbq::quantize`] chooses the scales) of a 2-D weight
/// blocked along `spec.axis`; the other axis holds the output channels.
fn lpbq_encoding(
    data: &[f32],
    shape: &[usize],
    spec: &WeightSpec,
    cbw: u8,
    param_shape: Vec<usize>,
    name: &str,
) -> Result<QEnc> {
    let (Some(inp), Some(block), 2) = (spec.axis, spec.block, shape.len()) else {
        bail!("weight '{name}': LPBQ needs a 2-D weight blocked along its input axis");
    };
    let bw = match spec.dtype {
        DType::I4 => 4,
        DType::I8 => 8,
        d => bail!("weight '{name}': LPBQ takes 4- or 8-bit weights, not {d}"),
    };
    let out_axis = 1 - inp;
    let (rows, cols) = (shape[out_axis], shape[inp]);
    // lpbq::quantize wants one row per output channel.
    let rowmajor: Vec<f32> = if inp == 1 {
        data.to_vec()
    } else {
        (0..rows * cols)
            .map(|i| data[(i % cols) * rows + i / cols])
            .collect()
    };
    let q = crate::lpbq::quantize(&rowmajor, rows, cols, block, bw, cbw)
        .with_context(|| format!("weight '{name}'"))?;
    let nb = q.blocks_per_row();
    // Back to the weight's own block layout (`param_shape`).
    let at = |p: usize| -> (usize, usize) {
        if inp == 1 {
            (p / nb, p % nb)
        } else {
            (p % rows, p / rows)
        }
    };
    let np = rows * nb;
    let int_scales: Vec<u16> = (0..np)
        .map(|p| {
            let (r, b) = at(p);
            q.int_scales[r * nb + b]
        })
        .collect();
    let scale: Vec<f32> = (0..np)
        .map(|p| {
            let (r, b) = at(p);
            q.block_scale(r, b)
        })
        .collect();
    Ok(QEnc {
        dtype: spec.dtype,
        scale,
        zero_point: vec![0; np],
        axis: Some(inp),
        block_size: Some(block),
        param_shape,
        lpbq: Some(LpbqScales {
            compressed_bw: cbw,
            int_scales,
            channel_scales: q.channel_scales,
            out_axis,
        }),
    })
}

/// Turns observed ranges and the model's weights into encodings.
pub fn encodings_from_ranges(
    m: &Model,
    plan: &QuantPlan,
    observers: &BTreeMap<String, Observer>,
    method: CalibMethod,
) -> Result<Encodings> {
    let mut enc = Encodings::default();
    let ranges: Vec<(String, DType, (f32, f32))> = plan
        .activations
        .par_iter()
        .filter_map(|(name, &d)| {
            let o = observers.get(name)?;
            if o.count == 0 {
                return None;
            }
            let (qmin, qmax) = qrange(d);
            let levels = (qmax - qmin) as u32;
            Some((name.clone(), d, o.range(method, levels, qmin < 0)))
        })
        .collect();
    for (name, d, (lo, hi)) in ranges {
        let (s, zp) = act_scale_zp(lo, hi, d);
        enc.activations
            .insert(name, TensorEncoding::Int(QEnc::per_tensor(d, s, zp)));
    }
    for (name, &d) in &plan.act_casts {
        enc.activations
            .entry(name.clone())
            .or_insert(TensorEncoding::Float(d));
    }
    let g = &m.graph;
    for (name, spec) in &plan.weights {
        let w = g
            .initializer(name)
            .ok_or_else(|| anyhow!("no initializer '{name}'"))?;
        enc.params.insert(
            name.clone(),
            TensorEncoding::Int(weight_encoding(w, spec, name)?),
        );
        // Read again only when quantized (`apply`): not resident in between (see `apply`).
        w.release_resident();
    }
    for (name, &d) in &plan.weight_casts {
        enc.params.insert(name.clone(), TensorEncoding::Float(d));
    }
    for (name, b) in &plan.biases {
        if let Some(e) = bias_encoding(g, &enc, name, b)? {
            enc.params.insert(name.clone(), TensorEncoding::Int(e));
        }
    }
    Ok(enc)
}

/// int32 bias encoding `s_x * s_w` (per channel when the weight is per output channel), or
/// `None` when the input or weight is not integer-quantized or layouts do not line up.
pub fn bias_encoding(g: &Graph, enc: &Encodings, name: &str, b: &BiasSpec) -> Result<Option<QEnc>> {
    let Some(TensorEncoding::Int(xe)) = enc.activations.get(&b.input) else {
        return Ok(None);
    };
    let Some(TensorEncoding::Int(we)) = enc.params.get(&b.weight) else {
        return Ok(None);
    };
    let bias = g
        .initializer(name)
        .ok_or_else(|| anyhow!("no initializer '{name}'"))?;
    let n = bias.len();
    if xe.scale.len() != 1 || we.block_size.is_some() {
        return Ok(None);
    }
    let sx = xe.scale[0];
    let node = g
        .nodes
        .iter()
        .find(|nd| nd.input(1) == Some(b.weight.as_str()) && nd.input(2) == Some(name));
    let scales: Vec<f32> = if we.scale.len() == 1 {
        vec![sx * we.scale[0]]
    } else {
        let w = g
            .initializer(&b.weight)
            .ok_or_else(|| anyhow!("no initializer '{}'", b.weight))?;
        let out_axis = node.and_then(|nd| weight_axes(nd, w.rank())).map(|a| a.0);
        if we.axis != out_axis || we.scale.len() != n {
            return Ok(None);
        }
        we.scale.iter().map(|&s| sx * s).collect()
    };
    // 16-bit inputs times 16-bit weights give scales so small that the bias overflows int32:
    // keep such biases float rather than saturate them.
    let bv = bias
        .as_slice::<f32>()
        .map_err(|e| anyhow!("bias '{name}': {e}"))?;
    let fits = bv.iter().enumerate().all(|(i, &b)| {
        let s = if scales.len() == 1 {
            scales[0]
        } else {
            scales[i]
        };
        ((b as f64) / (s as f64)).abs() < i32::MAX as f64
    });
    if !fits {
        return Ok(None);
    }
    let per = scales.len() > 1;
    Ok(Some(QEnc {
        dtype: DType::I32,
        zero_point: vec![0; scales.len()],
        param_shape: if per { vec![n] } else { vec![] },
        axis: if per { Some(0) } else { None },
        scale: scales,
        block_size: None,
        lpbq: None,
    }))
}

/// Quantizes float data with an encoding into a tensor of the encoding's dtype.
pub fn quantize_tensor(w: &Tensor, e: &QEnc, name: &str) -> Result<Tensor> {
    let data = w
        .as_slice::<f32>()
        .map_err(|err| anyhow!("initializer '{name}': {err}"))?;
    let shape = w.shape().to_vec();
    let (_, np) = param_layout(&shape, e.axis, e.block_size);
    if let Some(a) = e.axis {
        if a >= shape.len() {
            bail!("encoding of '{name}': axis {a} out of range for shape {shape:?}");
        }
    }
    if e.scale.len() != np || e.zero_point.len() != np {
        bail!(
            "encoding of '{name}' has {} scales / {} offsets, the tensor of shape {shape:?} needs {np}",
            e.scale.len(),
            e.zero_point.len()
        );
    }
    let sp = e.axis.map(|a| split(&shape, a)).unwrap_or((1, 1, 1));
    let (qmin, qmax) = qrange(e.dtype);
    // round(x / s) + zp clamped to [qmin, qmax] == round(clamp(x / s, qmin - zp, qmax - zp)) + zp
    // (rounding is monotonic, the bounds are integers); clamped first, the value is small enough
    // for the add-and-subtract 1.5 * 2^52 trick, which rounds half to even like
    // `round_ties_even` without a libm call.
    const MAGIC: f64 = 6_755_399_441_055_744.0;
    let qv = |x: f32, p: usize| -> i64 {
        let zp = e.zero_point[p];
        let v = (x as f64 / e.scale[p] as f64).clamp((qmin - zp) as f64, (qmax - zp) as f64);
        ((v + MAGIC) - MAGIC) as i64 + zp
    };
    // The codes go straight into the target type's vector: an i64 staging vector would be 8
    // bytes per weight, 1.1 GB for a 151936 x 896 LLM head, at the compile's peak.
    Ok(match e.dtype {
        DType::U8 => Tensor::from_vec(shape, quantize_codes(data, e, sp, qv, |x| x as u8))?,
        DType::I8 => Tensor::from_vec(shape, quantize_codes(data, e, sp, qv, |x| x as i8))?,
        DType::U16 => Tensor::from_vec(shape, quantize_codes(data, e, sp, qv, |x| x as u16))?,
        DType::I16 => Tensor::from_vec(shape, quantize_codes(data, e, sp, qv, |x| x as i16))?,
        DType::I32 => Tensor::from_vec(shape, quantize_codes(data, e, sp, qv, |x| x as i32))?,
        DType::I4 | DType::U4 => Tensor::from_4bit(
            e.dtype,
            shape,
            quantize_codes(data, e, sp, qv, |x| (x as u8) & 0xF),
        )?,
        d => bail!("unsupported quantized type {d}"),
    })
}

/// The codes of `data` under `e` (`qv`: one value's code given its parameter index), converted
/// by `conv` as they are made.
fn quantize_codes<T>(
    data: &[f32],
    e: &QEnc,
    sp: (usize, usize, usize),
    qv: impl Fn(f32, usize) -> i64,
    conv: impl Fn(i64) -> T,
) -> Vec<T> {
    let mut q: Vec<T> = Vec::with_capacity(data.len());
    match (e.axis, e.block_size) {
        (None, _) => q.extend(data.iter().map(|&x| conv(qv(x, 0)))),
        (Some(_), None) => {
            // Contiguous runs of `inner` elements share one parameter: no per-element division.
            let (_, d, inner) = sp;
            for (r, run) in data.chunks(inner.max(1)).enumerate() {
                let p = r % d;
                q.extend(run.iter().map(|&x| conv(qv(x, p))));
            }
        }
        _ => q.extend(
            data.iter()
                .enumerate()
                .map(|(i, &x)| conv(qv(x, param_index(i, sp, e.axis, e.block_size)))),
        ),
    }
    q
}

/// Quantize-dequantize of float data of `shape` with an encoding: what a QDQ pair computes.
/// The parameter (scale/zero point) index of each flat element of a tensor of `shape` under `e`.
pub(crate) fn element_param(shape: &[usize], e: &QEnc) -> impl Fn(usize) -> usize {
    let sp = e.axis.map(|a| split(shape, a)).unwrap_or((1, 1, 1));
    let (axis, block) = (e.axis, e.block_size);
    move |i| param_index(i, sp, axis, block)
}

pub fn fake_quantize(data: &[f32], shape: &[usize], e: &QEnc) -> Vec<f32> {
    let sp = e.axis.map(|a| split(shape, a)).unwrap_or((1, 1, 1));
    let (qmin, qmax) = qrange(e.dtype);
    data.iter()
        .enumerate()
        .map(|(i, &x)| {
            let p = param_index(i, sp, e.axis, e.block_size);
            let (s, zp) = (e.scale[p], e.zero_point[p]);
            let q = ((x / s).round_ties_even() as i64 + zp).clamp(qmin, qmax);
            (q - zp) as f32 * s
        })
        .collect()
}

/// Builds an integer tensor of `d` from i64 values already in range.
pub fn int_tensor(d: DType, shape: Vec<usize>, v: &[i64]) -> Result<Tensor> {
    Ok(match d {
        DType::U8 => Tensor::from_vec(shape, v.iter().map(|&x| x as u8).collect())?,
        DType::I8 => Tensor::from_vec(shape, v.iter().map(|&x| x as i8).collect())?,
        DType::U16 => Tensor::from_vec(shape, v.iter().map(|&x| x as u16).collect())?,
        DType::I16 => Tensor::from_vec(shape, v.iter().map(|&x| x as i16).collect())?,
        DType::I32 => Tensor::from_vec(shape, v.iter().map(|&x| x as i32).collect())?,
        DType::I4 | DType::U4 => {
            Tensor::from_4bit(d, shape, v.iter().map(|&x| (x as u8) & 0xF).collect())?
        }
        _ => bail!("unsupported quantized type {d}"),
    })
}

/// Scale and zero-point initializers of an encoding.
pub fn param_tensors(e: &QEnc) -> Result<(Tensor, Tensor)> {
    let s = Tensor::from_vec(e.param_shape.clone(), e.scale.clone())?;
    let z = int_tensor(e.dtype, e.param_shape.clone(), &e.zero_point)?;
    Ok((s, z))
}

fn qdq_attrs(mut n: Node, e: &QEnc) -> Node {
    if let Some(a) = e.axis {
        n = n.with_attr("axis", Attr::Int(a as i64));
    }
    if let Some(b) = e.block_size {
        n = n.with_attr("block_size", Attr::Int(b as i64));
    }
    n
}

fn named(mut n: Node, name: String) -> Node {
    n.name = name;
    n
}

fn onnx_dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 1,
        DType::F16 => 10,
        DType::BF16 => 16,
        _ => 0,
    }
}

/// Checks that every tensor named in `enc` exists in the model; the error lists a few of the
/// missing names.
pub fn check_names(m: &Model, enc: &Encodings) -> Result<()> {
    let names = tensor_names(&m.graph);
    let inits = m.graph.initializer_names();
    let missing: Vec<&str> = enc
        .activations
        .keys()
        .filter(|k| !names.contains(k.as_str()) || inits.contains(k.as_str()))
        .chain(enc.params.keys().filter(|k| !inits.contains(k.as_str())))
        .map(|s| s.as_str())
        .collect();
    if !missing.is_empty() {
        bail!(
            "{} of {} encodings name tensors this model does not have (e.g. {}); the encodings were made for another model",
            missing.len(),
            enc.activations.len() + enc.params.len(),
            missing.iter().take(5).map(|s| format!("'{s}'")).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(())
}

/// Rewrites the model into QDQ form for `enc` (see the crate docs for the naming convention).
/// Nodes are left in topological order.
pub fn apply(m: &Model, enc: &Encodings) -> Result<Model> {
    check_names(m, enc)?;
    let mut out = m.clone();
    let g = &mut out.graph;
    let mut new_nodes: Vec<Node> = vec![];
    let mut new_inits: Vec<Initializer> = vec![];
    // Parameters.
    let mut drop: HashSet<String> = HashSet::new();
    for (name, te) in &enc.params {
        let w = g
            .initializer(name)
            .ok_or_else(|| anyhow!("no initializer '{name}'"))?
            .clone();
        if w.dtype() != DType::F32 {
            bail!(
                "parameter '{name}' is {}, only float32 initializers can be quantized",
                w.dtype()
            );
        }
        match te {
            TensorEncoding::Int(e) => {
                let q = quantize_tensor(&w, e, name)?;
                // The float weight is read again only if it is quantized again: its mapped
                // pages leave the resident set, so a model's float weights and their codes are
                // not resident together (a large model's compile stays near one copy).
                w.release_resident();
                let (s, z) = param_tensors(e)?;
                let (qn, sn, zn) = (
                    format!("{name}_quantized"),
                    format!("{name}_scale"),
                    format!("{name}_zero_point"),
                );
                new_inits.push(Initializer {
                    name: qn.clone(),
                    tensor: q,
                });
                new_inits.push(Initializer {
                    name: sn.clone(),
                    tensor: s,
                });
                new_inits.push(Initializer {
                    name: zn.clone(),
                    tensor: z,
                });
                new_nodes.push(qdq_attrs(
                    named(
                        Node::new("DequantizeLinear", &[&qn, &sn, &zn], &[name]),
                        format!("{name}_DequantizeLinear"),
                    ),
                    e,
                ));
            }
            TensorEncoding::Float(d) => {
                let v = w.as_slice::<f32>().map_err(|e| anyhow!("{name}: {e}"))?;
                let t = match d {
                    DType::F16 => Tensor::from_vec(
                        w.shape().to_vec(),
                        v.iter().map(|&x| half::f16::from_f32(x)).collect(),
                    )?,
                    DType::BF16 => Tensor::from_vec(
                        w.shape().to_vec(),
                        v.iter().map(|&x| half::bf16::from_f32(x)).collect(),
                    )?,
                    _ => bail!("parameter '{name}': float encodings must be 16-bit, got {d}"),
                };
                let cn = format!("{name}_{}", if *d == DType::F16 { "fp16" } else { "bf16" });
                new_inits.push(Initializer {
                    name: cn.clone(),
                    tensor: t,
                });
                new_nodes.push(named(
                    Node::new("Cast", &[&cn], &[name]).with_attr("to", Attr::Int(1)),
                    format!("{name}_Cast"),
                ));
            }
        }
        drop.insert(name.clone());
    }
    g.initializers.retain(|i| !drop.contains(&i.name));
    g.inputs.retain(|i| !drop.contains(&i.name));
    g.initializers.extend(new_inits);
    // Activations.
    let graph_inputs: HashSet<String> = g.inputs.iter().map(|v| v.name.clone()).collect();
    let mut producer: HashMap<String, (usize, usize)> = HashMap::new();
    for (ni, n) in g.nodes.iter().enumerate() {
        for (oi, o) in n.outputs.iter().enumerate() {
            producer.insert(o.clone(), (ni, oi));
        }
    }
    for (name, te) in &enc.activations {
        // Where the float value comes from, and the name the rounded value gets.
        let (src, dst) = if graph_inputs.contains(name) {
            let dst = format!("{name}_dequantized");
            for n in g.nodes.iter_mut() {
                for i in n.inputs.iter_mut().filter(|i| *i == name) {
                    *i = dst.clone();
                }
            }
            for o in g.outputs.iter_mut().filter(|o| &o.name == name) {
                o.name = dst.clone();
            }
            (name.clone(), dst)
        } else {
            let &(ni, oi) = producer
                .get(name)
                .ok_or_else(|| anyhow!("no node produces '{name}'"))?;
            let src = format!("{name}_prequant");
            g.nodes[ni].outputs[oi] = src.clone();
            (src, name.clone())
        };
        match te {
            TensorEncoding::Int(e) => {
                let (s, z) = param_tensors(e)?;
                let (qn, sn, zn) = (
                    format!("{name}_quantized"),
                    format!("{name}_scale"),
                    format!("{name}_zero_point"),
                );
                g.initializers.push(Initializer {
                    name: sn.clone(),
                    tensor: s,
                });
                g.initializers.push(Initializer {
                    name: zn.clone(),
                    tensor: z,
                });
                new_nodes.push(qdq_attrs(
                    named(
                        Node::new("QuantizeLinear", &[&src, &sn, &zn], &[&qn]),
                        format!("{name}_QuantizeLinear"),
                    ),
                    e,
                ));
                new_nodes.push(qdq_attrs(
                    named(
                        Node::new("DequantizeLinear", &[&qn, &sn, &zn], &[&dst]),
                        format!("{name}_DequantizeLinear"),
                    ),
                    e,
                ));
            }
            TensorEncoding::Float(d) => {
                let code = onnx_dtype_code(*d);
                if code == 0 {
                    bail!("activation '{name}': float encodings must be 16-bit, got {d}");
                }
                let mid = format!("{name}_{}", if *d == DType::F16 { "fp16" } else { "bf16" });
                new_nodes.push(named(
                    Node::new("Cast", &[&src], &[&mid]).with_attr("to", Attr::Int(code)),
                    format!("{name}_CastDown"),
                ));
                new_nodes.push(named(
                    Node::new("Cast", &[&mid], &[&dst]).with_attr("to", Attr::Int(1)),
                    format!("{name}_CastUp"),
                ));
            }
        }
    }
    g.nodes.extend(new_nodes);
    let order = g
        .topo_order(&HashSet::new())
        .map_err(|e| anyhow!("the quantized graph is not acyclic: {e}"))?;
    let mut nodes: Vec<Option<Node>> = std::mem::take(&mut g.nodes).into_iter().map(Some).collect();
    g.nodes = order.into_iter().filter_map(|i| nodes[i].take()).collect();
    Ok(out)
}

/// A one-line description of an encoding for `inspect`: `u8 per-tensor scale 0.0123 offset -128`
/// or `i8 per-channel(axis 0, 64) scale 1.2e-3..4.5e-2`.
pub fn describe(e: &QEnc) -> String {
    let d = match e.dtype {
        DType::U8 => "u8",
        DType::I8 => "i8",
        DType::U16 => "u16",
        DType::I16 => "i16",
        DType::I4 => "i4",
        DType::U4 => "u4",
        DType::I32 => "i32",
        _ => "?",
    };
    if e.scale.len() == 1 {
        format!(
            "{d} per-tensor scale {:.6e} offset {}",
            e.scale[0], -e.zero_point[0]
        )
    } else {
        let (lo, hi) = e
            .scale
            .iter()
            .fold((f32::INFINITY, 0f32), |(a, b), &s| (a.min(s), b.max(s)));
        let kind = match (e.axis, e.block_size) {
            (Some(a), Some(b)) => {
                format!("per-block(axis {a}, block {b}, {} scales)", e.scale.len())
            }
            (Some(a), None) => format!("per-channel(axis {a}, {})", e.scale.len()),
            _ => "per-?".into(),
        };
        format!("{d} {kind} scale {lo:.3e}..{hi:.3e}")
    }
}

/// Reads back the QDQ encodings of a quantized model (what [`apply`] inserted): per tensor name
/// (the DequantizeLinear output), its encoding. Used by `inspect`.
pub fn read_qdq(m: &Model) -> Result<Vec<(String, bool, QEnc)>> {
    let g = &m.graph;
    let mut out = vec![];
    for n in g.nodes.iter().filter(|n| n.op_type == "DequantizeLinear") {
        let (Some(x), Some(s)) = (n.input(0), n.input(1)) else {
            continue;
        };
        let Some(st) = g.initializer(s) else { continue };
        let scale: Vec<f32> = st
            .to_f64_vec()
            .context("scale")?
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let is_param = g.initializer(x).is_some();
        let dtype = match g.initializer(x) {
            Some(t) => t.dtype(),
            None => n
                .input(2)
                .and_then(|z| g.initializer(z))
                .map(|t| t.dtype())
                .unwrap_or(DType::U8),
        };
        let zero_point = match n.input(2).and_then(|z| g.initializer(z)) {
            Some(z) => z.to_i64_vec().context("zero point")?,
            None => vec![0; scale.len()],
        };
        let axis = if scale.len() > 1 {
            Some(n.int_or("axis", 1).unwrap_or(1).max(0) as usize)
        } else {
            None
        };
        let block = n.int_or("block_size", 0).unwrap_or(0);
        out.push((
            n.outputs.first().cloned().unwrap_or_default(),
            is_param,
            QEnc {
                dtype,
                param_shape: st.shape().to_vec(),
                scale,
                zero_point,
                axis,
                block_size: (block > 0).then_some(block as usize),
                // The graph holds the effective block scales only.
                lpbq: None,
            },
        ));
    }
    Ok(out)
}
