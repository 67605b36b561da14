//! Per-layer accuracy (`npuc verify`, `npuc compile --target-sqnr`) of a quantized model against its float reference.
//!
//! Both models run side by side on every held-out sample with every comparable intermediate
//! tensor exposed as an extra graph output. A tensor is comparable when it is produced by a node
//! of the float model and the quantized model holds a float tensor of the same name and shape.
//! Quantized models are QDQ graphs: the DequantizeLinear output keeps the float tensor's name
//! (npuc's convention), or is named `T_DequantizeLinear_Output` (onnxruntime's `quantize_static`),
//! which maps back to `T`. Metrics are accumulated over all samples (not averaged per sample):
//! SQNR dB = 10 log10(Σ ref² / Σ (ref - q)²), cosine similarity, max abs error.

pub mod budget;
pub mod html;
pub mod promote;
pub mod samples;

use anyhow::{anyhow, bail, Context, Result};
use npuc_ir::{Model, Tensor, ValueInfo};
use npuc_runtime::{Session, SessionOptions, Value};
use std::collections::{HashMap, HashSet};
use std::path::Path;

pub use npuc_runtime::compare::{tensors_by_name, with_outputs, Acc};
pub use samples::{load_samples, Sample};

/// onnxruntime's `quantize_static` suffixes; a tensor carrying one maps back to the float name.
const ORT_SUFFIXES: [&str; 2] = ["_DequantizeLinear_Output", "_QuantizeLinear_Output"];

/// The float-model name a quantized-model tensor stands for.
pub fn canonical_name(name: &str) -> &str {
    for s in ORT_SUFFIXES {
        if let Some(b) = name.strip_suffix(s) {
            return b;
        }
    }
    name
}

/// Prepares a quantized model for execution: lowered to integer kernels
/// keeping every layer output (`quantized::prepare_keep_layers`), or run as is (QuantSim:
/// quantize-dequantize in float) with `simulate`.
pub fn prepare_quantized(mut m: Model, simulate: bool) -> Result<Model> {
    crate::quantized::prepare_keep_layers(&mut m, simulate)?;
    Ok(m)
}

/// Metrics of one compared tensor.
#[derive(Clone, Debug)]
pub struct LayerStat {
    /// Tensor name in the float model.
    pub name: String,
    /// Op type of the float-model node producing it.
    pub op: String,
    /// Name of that node.
    pub node: String,
    /// SQNR in dB (+inf: exact).
    pub sqnr_db: f64,
    /// Cosine similarity.
    pub cosine: f64,
    /// Max absolute error.
    pub max_abs_err: f64,
    /// Elements compared over all samples.
    pub elements: u64,
}

impl LayerStat {
    fn from_acc(name: &str, op: &str, node: &str, a: &Acc) -> LayerStat {
        LayerStat {
            name: name.to_string(),
            op: op.to_string(),
            node: node.to_string(),
            sqnr_db: a.sqnr_db(),
            cosine: a.cosine(),
            max_abs_err: a.max_abs,
            elements: a.n,
        }
    }
}

/// A float-model tensor compared with the quantized model's tensor `q_name`.
#[derive(Clone, Debug)]
struct Pair {
    name: String,
    q_name: String,
    op: String,
    node: String,
}

/// The result of a verification run.
#[derive(Clone, Debug)]
pub struct VerifyReport {
    /// Compared intermediate tensors, in the float model's topological order.
    pub layers: Vec<LayerStat>,
    /// The graph outputs.
    pub outputs: Vec<LayerStat>,
    /// Index into `layers` of the first layer below the threshold.
    pub first_bad: Option<usize>,
    /// The threshold used.
    pub threshold_db: f64,
    /// Samples evaluated.
    pub samples: usize,
    /// Float-model tensors present in the quantized model by name but not compared (dtype or
    /// shape differ), with the reason.
    pub skipped: Vec<(String, String)>,
}

impl VerifyReport {
    /// The worst graph output (lowest SQNR).
    pub fn worst_output(&self) -> Option<&LayerStat> {
        self.outputs
            .iter()
            .min_by(|a, b| a.sqnr_db.total_cmp(&b.sqnr_db))
    }
}

/// Model names of the quantized model: canonical float name -> the tensor holding its quantized
/// value (the DequantizeLinear output when onnxruntime renamed it).
fn q_names(q: &Model) -> HashMap<String, String> {
    let mut map: HashMap<String, String> = HashMap::new();
    let mut all: Vec<&str> = q.graph.inputs.iter().map(|i| i.name.as_str()).collect();
    for n in &q.graph.nodes {
        all.extend(
            n.outputs
                .iter()
                .filter(|o| !o.is_empty())
                .map(|o| o.as_str()),
        );
    }
    // The integer Q output never holds a float value.
    for name in all.into_iter().filter(|n| !n.ends_with(ORT_SUFFIXES[1])) {
        let c = canonical_name(name);
        let is_dq = name.ends_with(ORT_SUFFIXES[0]);
        match map.get(c) {
            Some(existing) if existing.ends_with(ORT_SUFFIXES[0]) => {}
            Some(_) if !is_dq => {}
            _ => {
                map.insert(c.to_string(), name.to_string());
            }
        }
    }
    map
}

/// Runs a session on one sample and returns its outputs by name (tensors only).
pub fn run_named(sess: &Session, s: &Sample) -> Result<HashMap<String, std::sync::Arc<Tensor>>> {
    let feeds = s
        .iter()
        .map(|(n, t)| (n.clone(), Value::tensor(t.clone())))
        .collect();
    Ok(tensors_by_name(sess.run(feeds)?))
}

/// Float-model graph outputs paired with the quantized model's: by (canonical) name, else by
/// position.
fn output_pairs(reference: &Model, q: &Model) -> Result<Vec<(String, String)>> {
    let qo: Vec<&str> = q.graph.outputs.iter().map(|o| o.name.as_str()).collect();
    let mut v = vec![];
    for (i, o) in reference.graph.outputs.iter().enumerate() {
        let by_name = qo
            .iter()
            .find(|n| **n == o.name || canonical_name(n) == o.name);
        let qn = match by_name.or_else(|| qo.get(i)) {
            Some(n) => n.to_string(),
            None => bail!(
                "the quantized model has {} outputs; reference output '{}' has no counterpart",
                qo.len(),
                o.name
            ),
        };
        v.push((o.name.clone(), qn));
    }
    Ok(v)
}

/// Both models prepared for side-by-side runs.
pub struct Verifier {
    reference: Session,
    /// The quantized model with every layer output exposed (per-layer rows).
    quantized: Session,
    /// The quantized model as `npuc run` executes it, for the output rows; `None` when that
    /// is the exposed graph itself (QuantSim).
    deployed: Option<Session>,
    pairs: Vec<Pair>,
    outputs: Vec<(String, String)>,
}

impl Verifier {
    /// Pairs the tensors of `reference` (float) and `q` (quantized QDQ graph, unprepared) and
    /// builds sessions exposing all of them.
    ///
    /// With integer kernels (`!simulate`) the quantized model is prepared twice. The per-layer
    /// rows come from the lowering that keeps every layer's output ([`prepare_quantized`]);
    /// the output rows come from the graph `npuc run` executes ([`crate::quantized::prepare`]:
    /// lookup tables, `QSoftmax`, fused bias). The two compute the same function but round a
    /// few elements differently (an exactly rounded exp table against the float kernel's), and
    /// in a deep 8-bit network one code flipped at a rounding boundary spreads: on a ViT-S,
    /// one of 400k softmax codes moved the output SQNR of a sample by 1.4 dB. The output
    /// SQNR reported is that of the model the user deploys.
    pub fn new(reference: &Model, q: &Model, simulate: bool, threads: usize) -> Result<Verifier> {
        let layered = prepare_quantized(q.clone(), simulate)?;
        let deployed = if simulate {
            None
        } else {
            let mut m = q.clone();
            crate::quantized::prepare(&mut m, false)?;
            Some(m)
        };
        let q = &layered;
        let qmap = q_names(q);
        let outer: HashSet<String> = HashSet::new();
        let order = reference
            .graph
            .topo_order(&outer)
            .map_err(|e| anyhow!("reference model: {e}"))?;
        let mut pairs = vec![];
        let mut seen = HashSet::new();
        for i in order {
            let n = &reference.graph.nodes[i];
            for o in n.outputs.iter().filter(|o| !o.is_empty()) {
                if let Some(qn) = qmap.get(o.as_str()) {
                    if seen.insert(o.clone()) {
                        pairs.push(Pair {
                            name: o.clone(),
                            q_name: qn.clone(),
                            op: n.op_type.clone(),
                            node: n.display_name(),
                        });
                    }
                }
            }
        }
        let outputs = output_pairs(reference, q)?;
        let r_extra: Vec<String> = pairs.iter().map(|p| p.name.clone()).collect();
        let q_extra: Vec<String> = pairs.iter().map(|p| p.q_name.clone()).collect();
        let opts = SessionOptions { threads };
        let rs = Session::new(&with_outputs(reference, &r_extra), opts.clone())
            .context("preparing the reference model")?;
        let qs = Session::new(&with_outputs(q, &q_extra), opts.clone())
            .context("preparing the quantized model")?;
        let deployed = match deployed {
            Some(m) => {
                if output_pairs(reference, &m)? != outputs {
                    bail!("the quantized model's outputs changed names in its integer lowering");
                }
                let d = Session::new(&m, opts).context("preparing the quantized model")?;
                // As `session::open` (`npuc run`) executes it.
                d.set_weight_prepacking(true);
                Some(d)
            }
            None => None,
        };
        Ok(Verifier {
            reference: rs,
            quantized: qs,
            deployed,
            pairs,
            outputs,
        })
    }

    /// The reference session's feedable inputs (used to load samples).
    pub fn inputs(&self) -> &[ValueInfo] {
        self.reference.inputs()
    }

    /// Runs every sample and computes the report.
    pub fn run(&self, samples: &[Sample], threshold_db: f64) -> Result<VerifyReport> {
        if samples.is_empty() {
            bail!("no samples to verify on");
        }
        let mut acc = vec![Acc::default(); self.pairs.len()];
        let mut ok = vec![true; self.pairs.len()];
        let mut why: Vec<Option<String>> = vec![None; self.pairs.len()];
        let mut out_acc = vec![Acc::default(); self.outputs.len()];
        for (si, s) in samples.iter().enumerate() {
            let r = run_named(&self.reference, s)
                .with_context(|| format!("reference model, sample {si}"))?;
            let q = run_named(&self.quantized, s)
                .with_context(|| format!("quantized model, sample {si}"))?;
            let deployed = match &self.deployed {
                Some(d) => {
                    Some(run_named(d, s).with_context(|| format!("quantized model, sample {si}"))?)
                }
                None => None,
            };
            let q_out = deployed.as_ref().unwrap_or(&q);
            for (k, p) in self.pairs.iter().enumerate() {
                if !ok[k] {
                    continue;
                }
                match (r.get(&p.name), q.get(&p.q_name)) {
                    // Integer tensors (shapes, indices) are not layers to compare.
                    (Some(a), Some(b)) if !a.dtype().is_float() && !b.dtype().is_float() => {
                        ok[k] = false;
                    }
                    (Some(a), Some(b)) => {
                        if !acc[k].add(a, b) {
                            ok[k] = false;
                            why[k] = Some(format!(
                                "reference {}{:?} vs quantized {}{:?}",
                                a.dtype(),
                                a.shape(),
                                b.dtype(),
                                b.shape()
                            ));
                        }
                    }
                    _ => {
                        ok[k] = false;
                        why[k] = Some("not a tensor in both runs".into());
                    }
                }
            }
            for (k, (rn, qn)) in self.outputs.iter().enumerate() {
                let a = r
                    .get(rn)
                    .ok_or_else(|| anyhow!("reference output '{rn}' is not a tensor"))?;
                let b = q_out
                    .get(qn)
                    .ok_or_else(|| anyhow!("quantized output '{qn}' is not a tensor"))?;
                if !out_acc[k].add(a, b) {
                    bail!(
                        "output '{rn}': reference {}{:?} and quantized '{qn}' {}{:?} cannot be compared (float tensors of equal shape needed)",
                        a.dtype(),
                        a.shape(),
                        b.dtype(),
                        b.shape()
                    );
                }
            }
        }
        let mut layers = vec![];
        let mut skipped = vec![];
        for (k, p) in self.pairs.iter().enumerate() {
            if ok[k] {
                layers.push(LayerStat::from_acc(&p.name, &p.op, &p.node, &acc[k]));
            } else if let Some(w) = &why[k] {
                skipped.push((p.name.clone(), w.clone()));
            }
        }
        // Exact (integer, shape) tensors get infinite SQNR and can never be "bad"; NaN SQNR is bad.
        let first_bad = layers
            .iter()
            .position(|l| l.sqnr_db < threshold_db || l.sqnr_db.is_nan());
        let outputs = self
            .outputs
            .iter()
            .zip(&out_acc)
            .map(|((rn, _), a)| LayerStat::from_acc(rn, "output", "", a))
            .collect();
        Ok(VerifyReport {
            layers,
            outputs,
            first_bad,
            threshold_db,
            samples: samples.len(),
            skipped,
        })
    }
}

/// Formats a dB value (`inf` for exact).
pub fn fmt_db(x: f64) -> String {
    if x.is_infinite() && x > 0.0 {
        "inf".into()
    } else {
        format!("{x:.2}")
    }
}

/// JSON number, or null when not finite (JSON has no infinity; null SQNR means exact).
pub fn json_num(x: f64) -> serde_json::Value {
    if x.is_finite() {
        serde_json::json!(x)
    } else {
        serde_json::Value::Null
    }
}

fn stat_json(l: &LayerStat) -> serde_json::Value {
    serde_json::json!({
        "name": l.name, "op": l.op, "node": l.node,
        "sqnr_db": json_num(l.sqnr_db), "cosine": json_num(l.cosine),
        "max_abs_err": json_num(l.max_abs_err), "elements": l.elements,
    })
}

/// The report as one JSON object (`sqnr_db: null` = exact).
pub fn report_json(r: &VerifyReport) -> serde_json::Value {
    let worst = r.worst_output();
    serde_json::json!({
        "samples": r.samples,
        "threshold_db": r.threshold_db,
        "layers": r.layers.iter().map(stat_json).collect::<Vec<_>>(),
        "first_bad_layer": r.first_bad.map(|i| stat_json(&r.layers[i])),
        "outputs": r.outputs.iter().map(stat_json).collect::<Vec<_>>(),
        "output": worst.map(stat_json),
        "skipped": r.skipped.iter().map(|(n, w)| serde_json::json!({"name": n, "reason": w})).collect::<Vec<_>>(),
    })
}

/// The human-readable table, first-bad-layer line and final `output SQNR` line.
pub fn report_text(r: &VerifyReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let w = r
        .layers
        .iter()
        .map(|l| l.name.chars().count())
        .max()
        .unwrap_or(5)
        .clamp(5, 48);
    let _ = writeln!(
        s,
        "{:<w$}  {:<20} {:>9} {:>10} {:>12}",
        "layer", "op", "SQNR dB", "cosine", "max abs err"
    );
    for (i, l) in r.layers.iter().enumerate() {
        let mark = if Some(i) == r.first_bad {
            "  <- first bad"
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "{:<w$}  {:<20} {:>9} {:>10.6} {:>12.4e}{mark}",
            l.name,
            l.op,
            fmt_db(l.sqnr_db),
            l.cosine,
            l.max_abs_err
        );
    }
    for (n, why) in &r.skipped {
        let _ = writeln!(s, "not compared: {n} ({why})");
    }
    let _ = writeln!(
        s,
        "{} layers compared over {} sample{}",
        r.layers.len(),
        r.samples,
        if r.samples == 1 { "" } else { "s" }
    );
    match r.first_bad {
        Some(i) => {
            let l = &r.layers[i];
            let _ = writeln!(
                s,
                "first bad layer: {} (op {}, node {}): SQNR {} dB < {} dB",
                l.name,
                l.op,
                l.node,
                fmt_db(l.sqnr_db),
                r.threshold_db
            );
        }
        None => {
            let _ = writeln!(s, "no layer below {} dB", r.threshold_db);
        }
    }
    if r.outputs.len() > 1 {
        for o in &r.outputs {
            let _ = writeln!(
                s,
                "output {}: SQNR {} dB, cosine {:.6}",
                o.name,
                fmt_db(o.sqnr_db),
                o.cosine
            );
        }
        if let Some(wo) = r.worst_output() {
            let _ = writeln!(s, "worst output: {}", wo.name);
        }
    }
    if let Some(wo) = r.worst_output() {
        let _ = writeln!(
            s,
            "output SQNR: {} dB, cosine: {:.6}",
            fmt_db(wo.sqnr_db),
            wo.cosine
        );
    }
    s
}

/// Options of `npuc verify`.
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    /// Layers below this SQNR are bad.
    pub threshold_db: f64,
    /// QuantSim instead of integer kernels (see [`prepare_quantized`]).
    pub simulate: bool,
    /// Threads per session.
    pub threads: usize,
}

/// Loads both models and the samples, and runs the comparison. Returns the report together with
/// the loaded quantized model (unprepared), reference model and samples, for `--suggest`.
pub fn verify_files(
    q_path: &Path,
    ref_path: &Path,
    inputs: &Path,
    opts: &VerifyOptions,
) -> Result<(VerifyReport, Model, Model, Vec<Sample>)> {
    let reference = npuc_onnx::load_model(ref_path)
        .with_context(|| format!("loading reference '{}'", ref_path.display()))?;
    let q = crate::load_any(q_path, None)
        .with_context(|| format!("loading quantized model '{}'", q_path.display()))?;
    let real: Vec<&ValueInfo> = reference.graph.real_inputs();
    let samples = load_samples(inputs, &real)?;
    let v = Verifier::new(&reference, &q, opts.simulate, opts.threads)?;
    let r = v.run(&samples, opts.threshold_db)?;
    Ok((r, q, reference, samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ort_names_map_back() {
        assert_eq!(canonical_name("conv1_DequantizeLinear_Output"), "conv1");
        assert_eq!(canonical_name("conv1_QuantizeLinear_Output"), "conv1");
        assert_eq!(canonical_name("conv1"), "conv1");
    }

    #[test]
    fn metrics_accumulate_over_samples() {
        // Two samples; the SQNR is of the sums, not the mean of per-sample SQNRs.
        let mut a = Acc::default();
        a.add_f32(&[1.0, 2.0], &[1.0, 2.5]);
        a.add_f32(&[3.0], &[2.0]);
        let (r2, e2): (f64, f64) = (1.0 + 4.0 + 9.0, 0.25 + 1.0);
        assert!((a.sqnr_db() - 10.0 * (r2 / e2).log10()).abs() < 1e-12);
        let dot = 1.0 + 5.0 + 6.0;
        let q2: f64 = 1.0 + 6.25 + 4.0;
        assert!((a.cosine() - dot / (r2.sqrt() * q2.sqrt())).abs() < 1e-12);
        assert_eq!(a.max_abs, 1.0);
        assert_eq!(a.n, 3);
        let mut exact = Acc::default();
        exact.add_f32(&[1.0, -2.0], &[1.0, -2.0]);
        assert!(exact.sqnr_db().is_infinite() && (exact.cosine() - 1.0).abs() < 1e-12);
        let mut nan = Acc::default();
        nan.add_f32(&[1.0], &[f32::NAN]);
        assert!(nan.sqnr_db().is_nan() && nan.max_abs.is_nan());
    }
}
