//! Quantized compile (`npuc compile --quantize`): import, bind, optimize with standard-ONNX
//! passes only (so the QDQ export stays loadable by onnxruntime), calibrate or read encodings,
//! insert QDQ, write the artifact, and optionally the QNN-EP QDQ ONNX and the AIMET encodings.

use crate::compile::{
    add_source, check_pass_names, load_verified, plan_arena, target_of, CompileOptions,
};
use crate::Progress;
use anyhow::{anyhow, bail, Context, Result};
use npuc_format::{ArtifactWriter, GraphInfo};
use npuc_ir::{DType, Model};
use npuc_quant::qdq::{read_qdq, QEnc};
use npuc_quant::{
    encodings, CalibMethod, CalibSource, Granularity, ImagePreprocess, Overrides, QuantOptions,
    Scheme,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Quantization flags of `npuc compile` (all optional; `--quantize` turns quantization on).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct QuantizeArgs {
    /// Quantize: w8a8, w8a16, w4a16, w4a8, w16a16, fp16, bf16, w8, w4 (weights only).
    #[arg(long = "quantize", value_name = "SCHEME")]
    pub scheme: Option<String>,
    /// Calibration data: a dir of .npy (sub-folder or `<input>_*.npy` per input), a QNN
    /// input_list.txt of .raw files, or an image folder (with --image-size).
    #[arg(long = "calib", value_name = "SRC")]
    pub calib: Option<PathBuf>,
    /// Activation range method: auto (default: with 8 or more samples, every fourth is held
    /// out and the one of minmax, percentile and mse that gives the best output SQNR on them
    /// wins; the held-out SQNR is printed), minmax, percentile, mse, entropy.
    #[arg(long = "calib-method", default_value = "auto")]
    pub calib_method: String,
    /// Percentile for --calib-method percentile.
    #[arg(long, default_value_t = 99.99)]
    pub percentile: f64,
    /// Weight granularity: per-tensor, per-channel, per-row, per-block, or lpbq (MatMul/Gemm
    /// weights in blocks whose scales are small integers times one float scale per output
    /// channel, QNN's LPBQ; other weights per-channel).
    #[arg(long, default_value = "per-channel")]
    pub granularity: String,
    /// Input channels per block for --granularity per-block (default 32) or lpbq (default 64).
    #[arg(long = "block-size", value_name = "N")]
    pub block_size: Option<usize>,
    /// Bits of LPBQ's integer block scales (--granularity lpbq; default 4).
    #[arg(long = "compressed-bw", value_name = "BITS")]
    pub compressed_bw: Option<u8>,
    /// Signed symmetric activations (int8/int16, zero point 0) instead of unsigned asymmetric.
    #[arg(long = "symmetric-activations")]
    pub symmetric_activations: bool,
    /// Mixed-precision overrides file (JSON, or TOML by extension).
    #[arg(long, value_name = "FILE")]
    pub overrides: Option<PathBuf>,
    /// Keep nodes/tensors matching this glob float (repeatable).
    #[arg(long = "keep-float", value_name = "PATTERN")]
    pub keep_float: Vec<String>,
    /// Quantize with these AIMET encodings (0.6.1 or 1.0.0) instead of calibrating.
    #[arg(long, value_name = "ENC.json")]
    pub encodings: Option<PathBuf>,
    /// The target's quantization rules: `npuc` (default: per-channel weights on every op) or
    /// `qnn-htp` (ONNX Runtime's QNN EP: per-channel weights only on Conv/ConvTranspose,
    /// unsigned activations). Honoured from planning on; exports never change the artifact.
    #[arg(
        long = "quant-profile",
        default_value = "npuc",
        value_name = "npuc|qnn-htp"
    )]
    pub quant_profile: String,
    /// Also write the artifact's quantization as a QDQ ONNX model (onnxruntime loads it; for its
    /// QNN EP quantize with --quant-profile qnn-htp).
    #[arg(long = "emit-qdq", value_name = "Q.onnx")]
    pub emit_qdq: Option<PathBuf>,
    /// Also write AIMET/QNN encodings JSON.
    #[arg(long = "emit-encodings", value_name = "ENC.json")]
    pub emit_encodings: Option<PathBuf>,
    /// Encodings format for --emit-encodings: 0.6.1 or 1.0.0.
    #[arg(long = "encodings-version", default_value = "0.6.1")]
    pub encodings_version: String,
    /// Use at most N calibration samples.
    #[arg(long = "max-samples", value_name = "N")]
    pub max_samples: Option<usize>,
    /// Image calibration: resize to H,W.
    #[arg(long = "image-size", value_name = "H,W")]
    pub image_size: Option<String>,
    /// Image calibration: per-channel mean (after --scale), 1 or 3 values.
    #[arg(long)]
    pub mean: Option<String>,
    /// Image calibration: per-channel std, 1 or 3 values.
    #[arg(long)]
    pub std: Option<String>,
    /// Image calibration: nchw or nhwc.
    #[arg(long, default_value = "nchw")]
    pub layout: String,
    /// Image calibration: rgb or bgr.
    #[arg(long = "channel-order", default_value = "rgb")]
    pub channel_order: String,
    /// Image calibration: pixel multiplier applied first.
    #[arg(long, default_value = "1/255")]
    pub scale: String,
    /// Outlier migration before calibration (SmoothQuant): `auto` (default: where activations
    /// are 8-bit, each linear input gets the α from 0.3-0.8 that minimizes its layer's
    /// quantization error on the calibration data, or is left alone when none helps), `off`,
    /// or a fixed α in (0, 1) (still only where it helps).
    #[arg(long, default_value = "auto", value_name = "auto|off|ALPHA")]
    pub smooth: String,
    /// Keep the fewest 8-bit tensors at 16 bits that bring the output SQNR on a held-out
    /// quarter of the calibration samples to DB, with at most --max-16bit-fraction of the 8-bit
    /// activations promoted (weights do not count); prints what was promoted, each promotion's
    /// measured effect and the latency cost.
    #[arg(long = "target-sqnr", value_name = "DB")]
    pub target_sqnr: Option<f64>,
    /// With --target-sqnr: the most of the 8-bit activations that may go to 16 bits, as a
    /// fraction in [0, 1] (default 0.25). A target it cannot reach is reported with the best
    /// SQNR reached and the fraction that would reach it.
    #[arg(
        long = "max-16bit-fraction",
        value_name = "F",
        requires = "target_sqnr"
    )]
    pub max_16bit_fraction: Option<f64>,
    /// Weight clipping searched against each layer's output error on calibration rows
    /// (SeqMSE): `on`, or `off`/`auto` (default: off; it gains on all-MiniLM-L6-v2 w4a16
    /// per-channel but lost on ViT-S w4a16).
    #[arg(long, default_value = "auto", value_name = "auto|on|off")]
    pub seqmse: String,
    /// Learned up/down rounding of each MatMul/Gemm weight against its layer's output error on
    /// calibration rows (AdaRound, 300 Adam steps per layer, layers in parallel), under the
    /// weight scales the other flags chose: `on`, or `off` (default: it gains where 4-bit
    /// rounding noise dominates, ViT-S w4a16 minmax 18.52 -> 19.62 dB, but only 0.05 dB on
    /// all-MiniLM-L6-v2 w4a16 per-channel, 0.26 dB after SeqMSE, lost 0.27 dB at w8a8, and takes
    /// 10-30x the calibration time).
    #[arg(long, default_value = "off", value_name = "on|off")]
    pub adaround: String,
    /// Adam steps per layer for `--adaround on` (default 300; fewer is faster and gains less).
    #[arg(long = "adaround-iterations", value_name = "N")]
    pub adaround_iterations: Option<usize>,
    /// Threads for calibration runs.
    #[arg(long = "calib-threads", default_value_t = 2)]
    pub threads: usize,
    /// Hide the calibration progress bar.
    #[arg(long = "no-progress")]
    pub no_progress: bool,
}

/// Quantization flags that only matter when calibrating (not with `--encodings`), by clap id.
pub const CALIBRATION_FLAGS: &[&str] = &[
    "calib",
    "calib_method",
    "percentile",
    "granularity",
    "block_size",
    "compressed_bw",
    "symmetric_activations",
    "overrides",
    "keep_float",
    "smooth",
    "seqmse",
    "adaround",
    "adaround_iterations",
    "target_sqnr",
    "max_16bit_fraction",
    "max_samples",
    "image_size",
    "mean",
    "std",
    "layout",
    "channel_order",
    "scale",
    "threads",
    "no_progress",
];

/// Image-preprocessing flags, which apply only with `--image-size`, by clap id.
pub const IMAGE_FLAGS: &[&str] = &["mean", "std", "layout", "channel_order", "scale"];

/// What a quantized compile did.
#[derive(Debug)]
pub struct QuantSummary {
    /// Every optimization pass run that changed the graph before quantizing (what
    /// `--print-passes` prints).
    pub pass_records: Vec<npuc_passes::PassRecord>,
    /// Activations quantized (integer or cast).
    pub activations: usize,
    /// Weights and biases quantized.
    pub params: usize,
    /// Calibration samples used (0 with `--encodings`).
    pub samples: usize,
    /// Scheme name.
    pub scheme: String,
    /// Method (or "encodings FILE").
    pub method: String,
    /// Artifact size.
    pub file_bytes: u64,
    /// Wall time.
    pub seconds: f64,
}

fn floats3(s: &str, what: &str) -> Result<[f32; 3]> {
    let v: Vec<f32> = s
        .split(',')
        .map(|x| {
            x.trim()
                .parse::<f32>()
                .map_err(|_| anyhow!("{what}: '{x}' is not a number"))
        })
        .collect::<Result<_>>()?;
    match v.len() {
        1 => Ok([v[0]; 3]),
        3 => Ok([v[0], v[1], v[2]]),
        _ => bail!("{what} takes 1 or 3 comma-separated numbers, got '{s}'"),
    }
}

fn parse_scale(s: &str) -> Result<f32> {
    let v = match s.split_once('/') {
        Some((a, b)) => a
            .trim()
            .parse::<f32>()
            .ok()
            .zip(b.trim().parse::<f32>().ok())
            .map(|(a, b)| a / b),
        None => s.trim().parse::<f32>().ok(),
    };
    v.filter(|x| x.is_finite())
        .ok_or_else(|| anyhow!("--scale: '{s}' is not a number or fraction"))
}

impl QuantizeArgs {
    fn preprocess(&self) -> Result<Option<ImagePreprocess>> {
        let Some(size) = &self.image_size else {
            return Ok(None);
        };
        let (h, w) = size
            .split_once([',', 'x'])
            .and_then(|(h, w)| {
                Some((
                    h.trim().parse::<usize>().ok()?,
                    w.trim().parse::<usize>().ok()?,
                ))
            })
            .filter(|&(h, w)| h > 0 && w > 0)
            .ok_or_else(|| anyhow!("--image-size expects H,W, got '{size}'"))?;
        Ok(Some(ImagePreprocess {
            size: (h, w),
            mean: self
                .mean
                .as_deref()
                .map(|m| floats3(m, "--mean"))
                .transpose()?
                .unwrap_or([0.0; 3]),
            std: self
                .std
                .as_deref()
                .map(|m| floats3(m, "--std"))
                .transpose()?
                .unwrap_or([1.0; 3]),
            scale: parse_scale(&self.scale)?,
            nchw: match self.layout.as_str() {
                "nchw" => true,
                "nhwc" => false,
                l => bail!("--layout must be nchw or nhwc, got '{l}'"),
            },
            bgr: match self.channel_order.as_str() {
                "rgb" => false,
                "bgr" => true,
                c => bail!("--channel-order must be rgb or bgr, got '{c}'"),
            },
        }))
    }

    /// `--calib-method auto` (also the value of a `QuantizeArgs::default()` built in code).
    pub fn auto_method(&self) -> bool {
        matches!(self.calib_method.as_str(), "auto" | "")
    }

    /// The quantizer options these flags describe.
    pub fn options(&self) -> Result<QuantOptions> {
        let overrides = self.overrides.as_deref().map(Overrides::load).transpose()?;
        Ok(QuantOptions {
            scheme: Scheme::parse(self.scheme.as_deref().unwrap_or("w8a8"))?,
            // `auto` calibrates with histograms (every method can be read off them).
            method: if self.auto_method() {
                CalibMethod::Mse
            } else {
                CalibMethod::parse(&self.calib_method, self.percentile)?
            },
            granularity: match self.granularity.as_str() {
                "lpbq" => Granularity::lpbq(
                    self.block_size.unwrap_or(64),
                    self.compressed_bw.unwrap_or(4),
                )?,
                g => Granularity::parse(g, self.block_size.unwrap_or(32))?,
            },
            symmetric_activations: self.symmetric_activations,
            overrides,
            keep_float: self.keep_float.clone(),
            threads: self.threads.max(1),
            profile: npuc_quant::Profile::parse(&self.quant_profile)?,
        })
    }
}

/// Loads, binds, inlines, verifies and optimizes a model with the passes that keep it standard
/// ONNX (no `npuc`-domain fusions), ready to quantize. Returns the model and the pass runs
/// that changed it.
pub fn prepare(
    path: &Path,
    opts: &CompileOptions,
) -> Result<(Model, Vec<npuc_passes::PassRecord>)> {
    if !opts.enable_passes.is_empty() {
        bail!(
            "--enable-pass {}: a quantized compile runs only passes that keep the model standard ONNX; opt-in passes cannot be enabled with --quantize",
            opts.enable_passes.join(", ")
        );
    }
    check_pass_names(&opts.disable_passes, &[])?;
    let mut m = load_verified(path, opts)?;
    let mut records = vec![];
    if opts.optimize {
        let mut disable = opts.disable_passes.clone();
        // These may emit npuc-domain ops at old opsets, which onnxruntime cannot load.
        disable.extend(["gelu-fusion", "layernorm-fusion", "rmsnorm-fusion"].map(String::from));
        let o = npuc_passes::OptimizeOptions {
            fuse: false,
            disable,
            ..Default::default()
        };
        records = npuc_passes::optimize(&mut m, &o)?.records;
    }
    Ok((m, records))
}

/// Quantizes `m` per `q`: returns the QDQ model, the encodings, and the number of samples.
/// Appends the wall time of each step (`calibration`, `encodings`, `qdq`) to `timings`.
pub fn quantize_model(
    m: &Model,
    q: &QuantizeArgs,
    timings: &mut Vec<(&'static str, f64)>,
    progress: &mut dyn Progress,
) -> Result<(Model, npuc_quant::Encodings, usize, String)> {
    let opts = q.options()?;
    let mut t = Instant::now();
    if q.target_sqnr.is_some() && q.encodings.is_some() {
        bail!("--target-sqnr measures and promotes on calibration samples; it cannot be combined with --encodings");
    }
    let (smoothed, enc, samples, method, held, ranges, rounded) = if let Some(e) = &q.encodings {
        let (sm, enc) = encodings::read(e, m)?;
        (
            (!enc.smoothing.is_empty()).then_some(sm),
            enc,
            0,
            format!("encodings {}", e.display()),
            vec![],
            HashMap::new(),
            None,
        )
    } else {
        let plan0 = npuc_quant::plan(m, &opts)?;
        let src_path = q.calib.as_ref().ok_or_else(|| {
            anyhow!("--quantize {} needs calibration data: --calib DIR|input_list.txt (or --encodings ENC.json)", q.scheme.as_deref().unwrap_or(""))
        })?;
        let src = CalibSource::detect(src_path, q.preprocess()?)?;
        let inputs: Vec<npuc_ir::ValueInfo> = m.graph.real_inputs().into_iter().cloned().collect();
        let files = src.list(&inputs, q.max_samples)?;
        let n = files.len();
        // Statistics of the linears' inputs (first samples) for smoothing and SeqMSE, then
        // outlier migration: it changes the graph that is then planned and calibrated.
        let alpha = smooth_alpha(&q.smooth, &plan0)?;
        let seqmse = seqmse_on(&q.seqmse, &plan0)?;
        let adaround = match q.adaround.as_str() {
            "on" => true,
            "off" | "" => false,
            f => bail!("--adaround takes on or off, got '{f}'"),
        };
        let ada_opts = match q.adaround_iterations {
            None => npuc_quant::adaround::AdaRoundOptions::default(),
            Some(_) if !adaround => bail!("--adaround-iterations needs --adaround on"),
            Some(0) => bail!("--adaround-iterations must be at least 1"),
            Some(iterations) => npuc_quant::adaround::AdaRoundOptions {
                iterations,
                ..Default::default()
            },
        };
        let so = npuc_quant::SmoothOptions {
            alpha: alpha.flatten(),
            threads: opts.threads,
            ..Default::default()
        };
        let stats = if alpha.is_some() || seqmse || adaround {
            let st = npuc_quant::LinearStats::collect(
                m,
                &plan0,
                &so,
                files.iter().map(|f| src.load(f, &inputs)),
            )?;
            mark(timings, "linear statistics", t.elapsed().as_secs_f64());
            t = Instant::now();
            Some(st)
        } else {
            None
        };
        let mut scales = Default::default();
        let (smoothed, plan) = match (&alpha, &stats) {
            (Some(_), Some(st)) => {
                let (mut sm, report) = npuc_quant::smooth::smooth(m, &plan0, &so, st)?;
                // A large model's rescaled weights go to a mapped temporary file, whose pages
                // each later step gives back after use as it does the model file's (without it
                // a 2.5 GB ViT-H held them all resident next to the method choice's quantized
                // candidates). Smaller ones stay in memory, shared: the calibration,
                // method-choice and comparison sessions clone this model and borrow them
                // instead of copying each one.
                if npuc_quant::qdq::weight_bytes(&sm) >= SPILL_SMOOTHED_BYTES {
                    npuc_onnx::spill::spill_initializers(&mut sm.graph, None, 1 << 20).map_err(
                        |e| anyhow!("moving the smoothed weights to a temporary file: {e}"),
                    )?;
                }
                sm.graph.share_initializers();
                progress.note(&report.summary());
                mark(timings, "smoothing", t.elapsed().as_secs_f64());
                t = Instant::now();
                let p = npuc_quant::plan(&sm, &opts)?;
                scales = report.scales;
                (Some(sm), p)
            }
            _ => (None, plan0),
        };
        for note in &plan.notes {
            progress.note(note);
        }
        let m = smoothed.as_ref().unwrap_or(m);
        // `auto`: every fourth sample is held out to choose the range method on (spread over
        // the set, in case it is ordered).
        let auto = q.auto_method() && !plan.activations.is_empty();
        if q.target_sqnr.is_some() && n < 8 {
            bail!("--target-sqnr holds out a quarter of the calibration samples to measure the output SQNR on: it needs 8 samples or more, {n} given");
        }
        let hold = (auto || q.target_sqnr.is_some()) && n >= 8;
        let (cal, held): (Vec<_>, Vec<_>) = files
            .iter()
            .enumerate()
            .partition(|(i, _)| !hold || i % 4 != 3);
        let ncal = cal.len();
        let calib_method = if auto && !hold {
            progress.note(&format!("--calib-method auto needs 8 samples or more to hold out a quarter; {n} given: using minmax"));
            CalibMethod::MinMax
        } else {
            opts.method
        };
        progress.calibrated(0, ncal);
        let obs = if plan.activations.is_empty() {
            Default::default()
        } else {
            npuc_quant::calibrate(
                m,
                &plan,
                calib_method,
                opts.threads,
                cal.iter().map(|(_, f)| src.load(f, &inputs)),
                |i| progress.calibrated(i, ncal),
            )?
        };
        progress.calibration_done();
        mark(timings, "calibration", t.elapsed().as_secs_f64());
        t = Instant::now();
        // SeqMSE: weight scales searched against each layer's output error (they do not depend
        // on the activation ranges, so one search serves every method candidate).
        let refined = match &stats {
            Some(st) if seqmse => {
                let base = npuc_quant::encodings_from_ranges(m, &plan, &obs, calib_method)?;
                let (rep, refined) =
                    npuc_quant::seqmse::search_weights(m, &plan, &st.weight_rows(&scales), &base)?;
                progress.note(&rep.summary());
                mark(timings, "seqmse", t.elapsed().as_secs_f64());
                t = Instant::now();
                refined
            }
            _ => Default::default(),
        };
        // AdaRound: the weights' rounding learned under their final scales (which do not depend
        // on the activation ranges either); the rounded weights replace the float ones only in
        // the model that is quantized, never in the float reference.
        let mut refined = refined;
        let rounded = match &stats {
            Some(st) if adaround => {
                let mut base = npuc_quant::encodings_from_ranges(m, &plan, &obs, calib_method)?;
                npuc_quant::seqmse::overlay(m, &plan, &mut base, &refined)?;
                let (rep, rm, used) = npuc_quant::adaround::round_weights(
                    m,
                    &plan,
                    &st.weight_rows(&scales),
                    &base,
                    &ada_opts,
                )?;
                progress.note(&rep.summary());
                mark(timings, "adaround", t.elapsed().as_secs_f64());
                t = Instant::now();
                refined.extend(used);
                Some(rm)
            }
            _ => None,
        };
        let held: Vec<npuc_quant::qdq::Sample> = held
            .iter()
            .map(|(_, f)| src.load(f, &inputs))
            .collect::<Result<_>>()?;
        let method = if hold && auto {
            let (best, scores) =
                choose_method(m, rounded.as_ref(), &plan, &obs, &refined, &held, &opts)?;
            let best_db = scores
                .iter()
                .find(|(c, _)| *c == best)
                .map_or(f64::NAN, |(_, v)| *v);
            progress.note(&format!(
                "calibration method auto: output SQNR on {} held-out samples: {} -> {} ({best_db:.2} dB held out; calibrated on the other {ncal})",
                held.len(),
                scores
                    .iter()
                    .map(|(c, v)| format!("{} {:.2} dB", c.name(), v))
                    .collect::<Vec<_>>()
                    .join(", "),
                best.name(),
            ));
            mark(timings, "method choice", t.elapsed().as_secs_f64());
            t = Instant::now();
            best
        } else {
            calib_method
        };
        let mut enc = npuc_quant::encodings_from_ranges(m, &plan, &obs, method)?;
        npuc_quant::seqmse::overlay(m, &plan, &mut enc, &refined)?;
        enc.smoothing = scales;
        let label = if hold && auto {
            format!("auto: {}", method.name())
        } else {
            method.name()
        };
        let ranges: HashMap<String, (f32, f32)> = obs
            .iter()
            .filter(|(_, o)| o.count > 0)
            .map(|(k, o)| (k.clone(), (o.min, o.max)))
            .collect();
        (smoothed, enc, ncal, label, held, ranges, rounded)
    };
    let m = smoothed.as_ref().unwrap_or(m);
    // The QNN HTP profile: unsigned activations (signed symmetric ones become the same grid with
    // the mid-range zero point) and biases re-derived; the plan already made MatMul/Gemm weights
    // per tensor. Encodings read from a file are brought to the same rules.
    let enc = if opts.profile == npuc_quant::Profile::QnnHtp {
        npuc_quant::export::qnn_encodings(m, &enc)?
    } else {
        enc
    };
    mark(timings, "encodings", t.elapsed().as_secs_f64());
    t = Instant::now();
    let mut qm = npuc_quant::apply(rounded.as_ref().unwrap_or(m), &enc)?;
    let mut enc = enc;
    mark(timings, "qdq", t.elapsed().as_secs_f64());
    if let Some(target) = q.target_sqnr {
        t = Instant::now();
        let fraction = q.max_16bit_fraction.unwrap_or(DEFAULT_MAX_16BIT_FRACTION);
        qm = promote_to_target(m, qm, &held, &ranges, (target, fraction), &opts, progress)?;
        // The encodings the model now holds (exports write these).
        let float_casts = enc.clone();
        enc.activations.clear();
        enc.params.clear();
        for (name, is_param, e) in npuc_quant::qdq::read_qdq(&qm)? {
            let map = if is_param {
                &mut enc.params
            } else {
                &mut enc.activations
            };
            map.insert(name, npuc_quant::TensorEncoding::Int(e));
        }
        for (k, v) in float_casts.activations {
            if matches!(v, npuc_quant::TensorEncoding::Float(_)) {
                enc.activations.entry(k).or_insert(v);
            }
        }
        for (k, v) in float_casts.params {
            if matches!(v, npuc_quant::TensorEncoding::Float(_)) {
                enc.params.entry(k).or_insert(v);
            }
        }
        mark(timings, "target sqnr", t.elapsed().as_secs_f64());
    }
    Ok((qm, enc, samples, method))
}

/// Records a step's wall time, and with `NPUC_MEM_TRACE` set prints the memory at its end and
/// its peak ([`npuc_runtime::limits::trace_memory`]).
fn mark(timings: &mut Vec<(&'static str, f64)>, step: &'static str, secs: f64) {
    npuc_runtime::limits::trace_memory(step);
    timings.push((step, secs));
}

/// `--max-16bit-fraction` when only `--target-sqnr` is given (issue 20's bar: a quarter of the
/// 8-bit activations).
pub const DEFAULT_MAX_16BIT_FRACTION: f64 = 0.25;

/// `--target-sqnr`: the fewest 8-bit tensors kept at 16 bits (re-calibrated: an activation's
/// 16-bit range is its whole observed range) that reach `target` dB output SQNR on the held-out
/// samples with at most `fraction` of the 8-bit activations promoted
/// (`verify::budget::suggest_within_budget`: each candidate's noise share measured both ways,
/// weights first, activations by share, then pruned); prints what was promoted with each one's
/// measured effect, the share of activations now 16-bit, the SQNR reached, and the latency on
/// this CPU (median of 5 runs of one held-out sample, integer kernels) as calibrated, with the
/// chosen weights promoted, and with everything chosen.
fn promote_to_target(
    m: &Model,
    qm: Model,
    held: &[npuc_quant::qdq::Sample],
    ranges: &HashMap<String, (f32, f32)>,
    (target, fraction): (f64, f64),
    opts: &QuantOptions,
    progress: &mut dyn Progress,
) -> Result<Model> {
    use crate::verify::{budget, promote};
    if !target.is_finite() {
        bail!("--target-sqnr must be a number of dB, got {target}");
    }
    if !(0.0..=1.0).contains(&fraction) {
        bail!("--max-16bit-fraction must be a fraction in [0, 1], got {fraction}");
    }
    let samples: Vec<crate::verify::Sample> = held.iter().map(|s| s.feeds.clone()).collect();
    let acts_before = count_acts(&qm, 8);
    // Rounded down: the budget is a ceiling.
    let max_acts = (fraction * acts_before as f64 + 1e-9).floor() as usize;
    let inp = budget::BudgetInput {
        suggest: promote::SuggestInput {
            reference: m,
            quantized: &qm,
            samples: &samples,
            target_db: target,
            headroom: 1.0,
            ranges: Some(ranges),
            threads: opts.threads.max(1),
            simulate: false,
            prune_evals: 24,
            sensitivity_evals: 0,
        },
        max_acts,
    };
    let r = budget::suggest_within_budget(&inp, &mut |l| progress.note(l))?;
    let s = &r.suggestion;
    let acts16 = s.schemes.iter().filter(|k| *k == "w8a16").count();
    let latency = |model: &Model| -> Result<f64> {
        let mut lm = model.clone();
        crate::quantized::prepare(&mut lm, false)?;
        let sess = npuc_runtime::Session::new(
            &lm,
            npuc_runtime::SessionOptions {
                threads: opts.threads.max(1),
            },
        )
        .map_err(|e| anyhow!("{e}"))?;
        let feeds: Vec<(String, npuc_runtime::Value)> = samples[0]
            .iter()
            .map(|(k, t)| (k.clone(), npuc_runtime::Value::tensor(t.clone())))
            .collect();
        let mut ts = vec![];
        for _ in 0..6 {
            let t0 = Instant::now();
            sess.run(feeds.clone()).map_err(|e| anyhow!("{e}"))?;
            ts.push(t0.elapsed().as_secs_f64());
        }
        ts.remove(0);
        ts.sort_by(f64::total_cmp);
        Ok(ts[ts.len() / 2])
    };
    let (t8, tw, t16) = (
        latency(&qm)?,
        latency(&r.weights_model)?,
        latency(&r.model)?,
    );
    let pct = |n: usize| 100.0 * n as f64 / acts_before.max(1) as f64;
    for c in &r.chosen {
        progress.note(&format!(
            "  16-bit {}: alone from all 8-bit {:+.2} dB; alone left 8-bit in all 16-bit {:+.2} dB",
            c.tensor, c.promote_alone_gain_db, -c.demote_alone_loss_db
        ));
    }
    progress.note(&format!(
        "target SQNR {target} dB: {} on {} held-out samples ({:.2} dB as calibrated, {:.2} dB with every candidate at 16 bits; {} evaluations); {} tensors kept at 16 bits ({} of {} 8-bit activations, {:.0}%, budget {} = --max-16bit-fraction {fraction}, and {} weights): {}; latency {:.2} ms as calibrated, {:.2} ms with the weights promoted ({:+.1}%), {:.2} ms with the activations too ({:+.1}%)",
        if s.reached {
            format!("reached {:.2} dB", s.sqnr_db)
        } else {
            format!("NOT reached within the budget, best {:.2} dB", s.sqnr_db)
        },
        samples.len(),
        s.baseline_db,
        s.all_promoted_db,
        s.evaluations,
        s.tensors.len(),
        acts16,
        acts_before,
        pct(acts16),
        r.max_acts,
        s.tensors.len() - acts16,
        if s.tensors.is_empty() {
            "none".to_string()
        } else {
            s.tensors.join(", ")
        },
        t8 * 1e3,
        tw * 1e3,
        100.0 * (tw / t8 - 1.0),
        t16 * 1e3,
        100.0 * (t16 / tw - 1.0)
    ));
    if !s.reached {
        progress.note(&match r.needed {
            Some((n, db)) => format!(
                "target SQNR {target} dB cannot be met within --max-16bit-fraction {fraction}: {n} of {acts_before} activations ({:.0}%) with the weights at 16 bits reach {db:.2} dB (--max-16bit-fraction {:.2} would)",
                pct(n),
                (n as f64 / acts_before.max(1) as f64 * 100.0).ceil() / 100.0
            ),
            None => format!(
                "target SQNR {target} dB cannot be met even with every candidate at 16 bits ({:.2} dB)",
                s.all_promoted_db
            ),
        });
    }
    Ok(r.model)
}

/// Activation quantize nodes of at most `bits` bits in a QDQ model.
fn count_acts(m: &Model, bits: u32) -> usize {
    npuc_quant::qdq::read_qdq(m)
        .map(|v| {
            v.iter()
                .filter(|(_, p, e)| !p && npuc_quant::bitwidth(e.dtype) <= bits)
                .count()
        })
        .unwrap_or(0)
}

/// `--calib-method auto`'s candidates: QNN's "tf" (minmax), a percentile clip and QNN's
/// "enhanced" (MSE) ranges. Entropy is left out: symmetric by construction, it rarely beats
/// MSE on unsigned activations and costs the most.
const AUTO_METHODS: [CalibMethod; 3] = [
    CalibMethod::MinMax,
    CalibMethod::Percentile(99.99),
    CalibMethod::Mse,
];

/// Output SQNR (dB, all float outputs together) of each [`AUTO_METHODS`] candidate on the
/// held-out samples, the quantized model run as the artifact runs (lowered to integer
/// kernels); returns the best method and every score.
fn choose_method(
    m: &Model,
    rounded: Option<&Model>,
    plan: &npuc_quant::QuantPlan,
    obs: &std::collections::BTreeMap<String, npuc_quant::observer::Observer>,
    refined: &std::collections::BTreeMap<String, npuc_quant::qdq::QEnc>,
    held: &[npuc_quant::qdq::Sample],
    opts: &QuantOptions,
) -> Result<(CalibMethod, Vec<(CalibMethod, f64)>)> {
    use npuc_runtime::{Session, SessionOptions, Value};
    let so = SessionOptions {
        threads: opts.threads.max(1),
    };
    let feeds = |s: &npuc_quant::qdq::Sample| -> Vec<(String, Value)> {
        s.feeds
            .iter()
            .map(|(k, t)| (k.clone(), Value::tensor(t.clone())))
            .collect()
    };
    let run = |sess: &Session, s: &npuc_quant::qdq::Sample| -> Result<Vec<Vec<f32>>> {
        let out = sess
            .run(feeds(s))
            .map_err(|e| anyhow!("held-out sample {}: {e}", s.label))?;
        Ok(out
            .iter()
            .filter_map(|(_, v)| v.as_tensor())
            .filter(|t| t.dtype() == DType::F32)
            .filter_map(|t| t.as_slice::<f32>().ok().map(|x| x.to_vec()))
            .collect())
    };
    let fs = Session::new(m, so.clone()).map_err(|e| anyhow!("float session: {e}"))?;
    let reference: Vec<Vec<Vec<f32>>> = held.iter().map(|s| run(&fs, s)).collect::<Result<_>>()?;
    npuc_runtime::limits::trace_memory("method choice: float reference");
    let mut scores = vec![];
    for c in AUTO_METHODS {
        let mut enc = npuc_quant::encodings_from_ranges(m, plan, obs, c)?;
        npuc_quant::seqmse::overlay(m, plan, &mut enc, refined)?;
        if opts.profile == npuc_quant::Profile::QnnHtp {
            enc = npuc_quant::export::qnn_encodings(m, &enc)?;
        }
        let mut qm = npuc_quant::apply(rounded.unwrap_or(m), &enc)?;
        crate::quantized::prepare(&mut qm, false)?;
        // Shared, so that the session's constants are the model's weights, not a copy of them.
        qm.graph.share_initializers();
        npuc_runtime::limits::trace_memory("method choice: candidate model");
        let qs = Session::new(&qm, so.clone()).map_err(|e| anyhow!("quantized session: {e}"))?;
        drop(qm);
        npuc_runtime::limits::trace_memory("method choice: candidate session");
        let (mut sig, mut noise) = (0f64, 0f64);
        for (s, r) in held.iter().zip(&reference) {
            for (a, b) in run(&qs, s)?.iter().zip(r) {
                for (x, y) in a.iter().zip(b) {
                    sig += (*y as f64).powi(2);
                    noise += (*x as f64 - *y as f64).powi(2);
                }
            }
        }
        scores.push((c, 10.0 * (sig.max(1e-30) / noise.max(1e-30)).log10()));
        npuc_runtime::limits::trace_memory("method choice: candidate runs");
    }
    let best = scores
        .iter()
        .fold(None::<(CalibMethod, f64)>, |b, &(c, v)| match b {
            Some((_, bv)) if bv >= v => b,
            _ => Some((c, v)),
        })
        .map(|(c, _)| c)
        .unwrap_or(CalibMethod::MinMax);
    Ok((best, scores))
}

/// Whether `--seqmse` asks for the weight-clipping search: `on`, or `off` (the default, also for
/// `auto` and the empty value of code-built args). Off by default because it has not paid for
/// itself on every model: ViT-S w4a16 per-channel measured 21.06 dB without and 20.52 dB with it
/// (output SQNR on 8 real held-out images), all-MiniLM-L6-v2 w4a16 per-channel (minmax) 3.60 ->
/// 6.44 dB (32 held-out sentences); the layer error it minimizes is measured on float inputs.
fn seqmse_on(flag: &str, _plan: &npuc_quant::QuantPlan) -> Result<bool> {
    match flag {
        "on" => Ok(true),
        "off" | "auto" | "" => Ok(false),
        f => bail!("--seqmse takes auto, on or off, got '{f}'"),
    }
}

/// The α setting `--smooth` asks for: `None` when smoothing is off (or nothing is 8-bit under
/// `auto`), `Some(None)` for a per-layer search, `Some(Some(α))` for a fixed α.
fn smooth_alpha(flag: &str, plan: &npuc_quant::QuantPlan) -> Result<Option<Option<f32>>> {
    let eight_bit = plan
        .activations
        .values()
        .any(|d| npuc_quant::bitwidth(*d) == 8);
    match flag {
        "off" => Ok(None),
        // Empty: a `QuantizeArgs::default()` built in code (the build pipeline) means the default.
        "auto" | "" => Ok(eight_bit.then_some(None)),
        a => match a.parse::<f32>() {
            Ok(v) if v > 0.0 && v < 1.0 => Ok(Some(Some(v))),
            _ => {
                bail!("--smooth takes auto, off or an alpha between 0 and 1 (exclusive), got '{a}'")
            }
        },
    }
}

/// `npuc compile MODEL --quantize ...`: one quantized graph into `out`.
pub fn compile_quantized(
    name: &str,
    path: &Path,
    opts: &CompileOptions,
    q: &QuantizeArgs,
    out: &Path,
    progress: &mut dyn Progress,
) -> Result<QuantSummary> {
    let t0 = Instant::now();
    let target = target_of(&opts.target)?;
    let (mut m, pass_records) = prepare(path, opts)?;
    // Weights the optimizer computed (folded transposes, fused constants) are owned: shared,
    // the calibration and comparison sessions over clones of this model borrow them.
    m.graph.share_initializers();
    let mut timings = vec![];
    mark(&mut timings, "load+prepare", t0.elapsed().as_secs_f64());
    let nodes_before = m.graph.nodes.len();
    let (mut qm, enc, samples, method) = quantize_model(&m, q, &mut timings, progress)?;
    // The float weights are no longer needed: unmapping them now keeps them out of the peak
    // while the artifact's (quantized) weights are written. The quantized model still borrows
    // the weights it keeps in float (norms, biases, an embedding table) from the same mapping,
    // whose every page calibration made resident: they move to a fresh mapping of the same
    // file first (no page of it resident yet), so the old one goes with the float model.
    let float_weight_bytes = npuc_quant::qdq::weight_bytes(&m);
    remap_borrowed(&mut qm, &m, path)?;
    drop(m);
    if q.emit_qdq.is_some() && q.options()?.profile == npuc_quant::Profile::Npuc {
        progress.note("--emit-qdq: the export holds the artifact's quantization (profile npuc: per-channel MatMul/Gemm weights); for ONNX Runtime's QNN EP quantize with --quant-profile qnn-htp");
    }
    let mut t = Instant::now();
    if let Some(p) = &q.emit_encodings {
        let made = serde_json::json!({
            "activation_bitwidth": enc.activations.values().find_map(|e| match e { npuc_quant::TensorEncoding::Int(q) => Some(npuc_quant::bitwidth(q.dtype)), _ => None }).unwrap_or(32),
            "param_bitwidth": enc.params.values().find_map(|e| match e { npuc_quant::TensorEncoding::Int(q) if q.dtype != DType::I32 => Some(npuc_quant::bitwidth(q.dtype)), _ => None }).unwrap_or(32),
            "dtype": "int",
            "is_symmetric": if q.symmetric_activations { "True" } else { "False" },
            "per_channel_quantization": q.granularity != "per-tensor",
            "quant_scheme": if method.starts_with("mse") { "post_training_tf_enhanced" } else { "post_training_tf" },
            "npuc_scheme": q.scheme.as_deref().unwrap_or(""),
            "npuc_calib_method": method,
        });
        // Encodings read with --encodings keep the record of how they were made, so writing
        // them again gives the file that was read (the AIMET round trip is byte for byte).
        let args = match &q.encodings {
            Some(src) => std::fs::read_to_string(src)
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| v.get("quantizer_args").cloned())
                .unwrap_or(made),
            None => made,
        };
        encodings::write(
            p,
            &enc,
            encodings::EncodingsVersion::parse(&q.encodings_version)?,
            args,
        )?;
        progress.note(&format!(
            "wrote encodings {} ({})",
            p.display(),
            q.encodings_version
        ));
    }
    if let Some(p) = &q.emit_qdq {
        // The export is the artifact's QDQ graph, with the com.microsoft domain where the
        // opset needs it.
        // The graph is copied without its weights, which move over and back (no second copy
        // of them). A large model goes out as it came in: with its initializers as external
        // data (`<Q.onnx>.data`), as any model over the protobuf limit must.
        let order: Vec<String> = qm
            .graph
            .initializers
            .iter()
            .map(|i| i.name.clone())
            .collect();
        let inits = std::mem::take(&mut qm.graph.initializers);
        let mut em = qm.clone();
        em.graph.initializers = inits;
        let expanded = npuc_quant::export::expand_blocked_weights(&mut em);
        npuc_quant::export::qnn_domains(&mut em);
        let external = float_weight_bytes > crate::llm::ONNX_INLINE_LIMIT;
        let opts = npuc_onnx::ExportOptions {
            external_threshold: external.then_some(1024),
        };
        let (saved, removed) = match expanded {
            Ok((_, removed)) => (
                npuc_onnx::save_model(&em, p, &opts).map_err(anyhow::Error::from),
                removed,
            ),
            Err(e) => (Err(e), vec![]),
        };
        // Back to the artifact's model, in its order: its own initializers (the export's
        // additions dropped, what the export did not need put back).
        let mut by_name: HashMap<String, npuc_ir::Initializer> =
            std::mem::take(&mut em.graph.initializers)
                .into_iter()
                .chain(removed)
                .map(|i| (i.name.clone(), i))
                .collect();
        qm.graph.initializers = order.iter().filter_map(|n| by_name.remove(n)).collect();
        saved.with_context(|| format!("writing {}", p.display()))?;
        progress.note(&format!(
            "wrote QDQ ONNX {}{}",
            p.display(),
            if external {
                format!(" (initializers in {}.data)", p.display())
            } else {
                String::new()
            }
        ));
    }
    if q.emit_qdq.is_some() || q.emit_encodings.is_some() {
        mark(&mut timings, "exports", t.elapsed().as_secs_f64());
        t = Instant::now();
    }
    let options = serde_json::json!({
        "input_shapes": opts.input_shapes.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "dims": opts.dims.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "optimize": opts.optimize,
        "target": target.name,
        "quantize": { "scheme": q.scheme.as_deref().unwrap_or(""), "method": method, "granularity": q.granularity, "samples": samples, "profile": q.options()?.profile.name(), "smoothed_inputs": enc.smoothing.len() },
    });
    let mut w = ArtifactWriter::new(target, options);
    add_source(&mut w, path)?;
    let inferred = npuc_ir::infer::infer_model(&qm, &HashMap::new());
    let (arena_bytes, _) = plan_arena(&qm, &inferred.types);
    w.add_graph(
        name,
        &qm,
        GraphInfo {
            nodes_before,
            nodes_after: qm.graph.nodes.len(),
            arena_bytes,
            source: path.display().to_string(),
        },
    )?;
    let file_bytes = w.write(out)?;
    mark(&mut timings, "compile+write", t.elapsed().as_secs_f64());
    progress.note(&format!(
        "timings: {}",
        timings
            .iter()
            .map(|(k, v)| format!("{k} {v:.2} s"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(QuantSummary {
        pass_records,
        activations: enc.activations.len(),
        params: enc.params.len(),
        samples,
        scheme: q.scheme.clone().unwrap_or_default(),
        method,
        file_bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Points the initializers of `qm` that borrow the mapping of `source` (the model file or its
/// external data) at a fresh mapping of the same bytes: the same name, dtype, shape and window
/// (offset, length) in a new load of `source`, which maps its files without reading them.
/// Returns the bytes re-pointed; a tensor without its twin keeps its window.
///
/// Only windows of `float`'s own mappings move: a tensor computed at compile time and shared
/// ([`npuc_ir::Tensor::into_shared`], e.g. a SmoothQuant-rescaled weight under its old name) is
/// also "borrowed", at offset 0, and must keep its values.
fn remap_borrowed(qm: &mut Model, float: &Model, source: &Path) -> Result<usize> {
    use npuc_ir::TensorData;
    let owner = |t: &npuc_ir::Tensor| match t.data() {
        TensorData::Borrowed(b) => Some(std::sync::Arc::as_ptr(&b.owner) as *const u8 as usize),
        _ => None,
    };
    let mappings: std::collections::HashSet<usize> = float
        .graph
        .initializers
        .iter()
        .filter_map(|i| owner(&i.tensor))
        .collect();
    let window = |t: &npuc_ir::Tensor| match t.data() {
        TensorData::Borrowed(b) => Some((b.offset, b.len)),
        _ => None,
    };
    if !qm.graph.initializers.iter().any(|i| i.tensor.is_borrowed()) {
        return Ok(0);
    }
    let fresh = npuc_onnx::load_model(source)?;
    let twins: HashMap<&str, &npuc_ir::Tensor> = fresh
        .graph
        .initializers
        .iter()
        .map(|i| (i.name.as_str(), &i.tensor))
        .collect();
    let mut moved = 0;
    for i in qm.graph.initializers.iter_mut() {
        let Some(w) = window(&i.tensor) else {
            continue;
        };
        if !owner(&i.tensor).is_some_and(|o| mappings.contains(&o)) {
            continue;
        }
        if let Some(t) = twins.get(i.name.as_str()).filter(|t| {
            window(t) == Some(w) && t.dtype() == i.tensor.dtype() && t.shape() == i.tensor.shape()
        }) {
            i.tensor = (*t).clone();
            moved += w.1;
        }
    }
    Ok(moved)
}

/// Models with at least this many bytes of weights keep their SmoothQuant-rescaled weights in
/// a mapped temporary file instead of memory (see [`npuc_onnx::spill`]).
const SPILL_SMOOTHED_BYTES: usize = 512 << 20;

fn short(e: &QEnc) -> String {
    npuc_quant::qdq::describe(e)
}

/// Lines describing every quantized tensor of a model (empty when it has none): name, kind
/// (activation/weight), type, granularity and scale/offset or a per-channel summary.
pub fn quant_report(m: &Model) -> Result<Vec<String>> {
    let mut lines = vec![];
    for (name, is_param, e) in read_qdq(m)? {
        lines.push(format!(
            "  {:<8} {name}: {}",
            if is_param { "param" } else { "act" },
            short(&e)
        ));
    }
    let casts = m
        .graph
        .nodes
        .iter()
        .filter(|n| n.op_type == "Cast" && n.name.ends_with("_CastDown"))
        .count();
    if casts > 0 {
        lines.push(format!(
            "  {casts} activations rounded through float16/bfloat16 (Cast pairs)"
        ));
    }
    Ok(lines)
}

/// The quantizer's scale and zero point for an activation range `[lo, hi]` in a dtype.
pub use npuc_quant::act_scale_zp;

/// Quantizes a float weight symmetrically to `dtype` (zero point 0), per tensor or per `axis`,
/// with the quantizer's scales (`max |w| / qmax`) and rounding (half to even). Returns the
/// quantized values, the scale and the zero point as initializer tensors (per-axis parameters
/// have shape `[C]`, per-tensor ones are scalars).
pub fn quantize_weight_symmetric(
    w: &npuc_ir::Tensor,
    dtype: DType,
    axis: Option<usize>,
    name: &str,
) -> Result<(npuc_ir::Tensor, npuc_ir::Tensor, npuc_ir::Tensor)> {
    let w32 = if w.dtype() == DType::F32 {
        w.clone()
    } else {
        let v: Vec<f32> = w.to_f64_vec()?.iter().map(|&x| x as f32).collect();
        npuc_ir::Tensor::from_vec(w.shape().to_vec(), v)?
    };
    let spec = npuc_quant::qdq::WeightSpec {
        dtype,
        axis,
        block: None,
        lpbq: None,
    };
    let e = npuc_quant::qdq::weight_encoding(&w32, &spec, name)?;
    let q = npuc_quant::qdq::quantize_tensor(&w32, &e, name)?;
    let (scale, zero_point) = npuc_quant::qdq::param_tensors(&e)?;
    Ok((q, scale, zero_point))
}
