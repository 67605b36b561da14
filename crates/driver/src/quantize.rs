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
    /// Activation range method: minmax, percentile, mse, entropy.
    #[arg(long = "calib-method", default_value = "minmax")]
    pub calib_method: String,
    /// Percentile for --calib-method percentile.
    #[arg(long, default_value_t = 99.99)]
    pub percentile: f64,
    /// Weight granularity: per-tensor, per-channel, per-row, per-block.
    #[arg(long, default_value = "per-channel")]
    pub granularity: String,
    /// Block size for --granularity per-block.
    #[arg(long = "block-size", default_value_t = 32)]
    pub block_size: usize,
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
    /// Also write a QDQ ONNX model following onnxruntime QNN-EP conventions; the artifact (and
    /// --emit-encodings) then use the same quantization (per-tensor MatMul/Gemm weights).
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
    "symmetric_activations",
    "overrides",
    "keep_float",
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

    /// The quantizer options these flags describe.
    pub fn options(&self) -> Result<QuantOptions> {
        let overrides = self.overrides.as_deref().map(Overrides::load).transpose()?;
        Ok(QuantOptions {
            scheme: Scheme::parse(self.scheme.as_deref().unwrap_or("w8a8"))?,
            method: CalibMethod::parse(&self.calib_method, self.percentile)?,
            granularity: Granularity::parse(&self.granularity, self.block_size)?,
            symmetric_activations: self.symmetric_activations,
            overrides,
            keep_float: self.keep_float.clone(),
            threads: self.threads.max(1),
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
    let (enc, samples, method) = if let Some(e) = &q.encodings {
        (
            encodings::read(e, m)?,
            0,
            format!("encodings {}", e.display()),
        )
    } else {
        let plan = npuc_quant::plan(m, &opts)?;
        let src_path = q.calib.as_ref().ok_or_else(|| {
            anyhow!("--quantize {} needs calibration data: --calib DIR|input_list.txt (or --encodings ENC.json)", q.scheme.as_deref().unwrap_or(""))
        })?;
        let src = CalibSource::detect(src_path, q.preprocess()?)?;
        let inputs: Vec<npuc_ir::ValueInfo> = m.graph.real_inputs().into_iter().cloned().collect();
        let files = src.list(&inputs, q.max_samples)?;
        let n = files.len();
        progress.calibrated(0, n);
        let obs = if plan.activations.is_empty() {
            Default::default()
        } else {
            npuc_quant::calibrate(
                m,
                &plan,
                opts.method,
                opts.threads,
                files.iter().map(|f| src.load(f, &inputs)),
                |i| progress.calibrated(i, n),
            )?
        };
        progress.calibration_done();
        timings.push(("calibration", t.elapsed().as_secs_f64()));
        t = Instant::now();
        (
            npuc_quant::encodings_from_ranges(m, &plan, &obs, opts.method)?,
            n,
            opts.method.name(),
        )
    };
    // With --emit-qdq the artifact runs the exported quantization (QNN-EP rules: per-tensor
    // MatMul/Gemm weights, unsigned activations), so the export matches what npuc runs.
    let enc = if q.emit_qdq.is_some() {
        npuc_quant::export::qnn_encodings(m, &enc)?
    } else {
        enc
    };
    timings.push(("encodings", t.elapsed().as_secs_f64()));
    t = Instant::now();
    let qm = npuc_quant::apply(m, &enc)?;
    timings.push(("qdq", t.elapsed().as_secs_f64()));
    Ok((qm, enc, samples, method))
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
    let (m, pass_records) = prepare(path, opts)?;
    let mut timings = vec![("load+prepare", t0.elapsed().as_secs_f64())];
    let nodes_before = m.graph.nodes.len();
    let (qm, enc, samples, method) = quantize_model(&m, q, &mut timings, progress)?;
    if q.emit_qdq.is_some() {
        progress.note("--emit-qdq: the artifact holds the exported (QNN-EP) quantization: per-channel weights only on Conv/ConvTranspose");
    }
    let mut t = Instant::now();
    if let Some(p) = &q.emit_encodings {
        let args = serde_json::json!({
            "activation_bitwidth": enc.activations.values().find_map(|e| match e { npuc_quant::TensorEncoding::Int(q) => Some(npuc_quant::bitwidth(q.dtype)), _ => None }).unwrap_or(32),
            "param_bitwidth": enc.params.values().find_map(|e| match e { npuc_quant::TensorEncoding::Int(q) if q.dtype != DType::I32 => Some(npuc_quant::bitwidth(q.dtype)), _ => None }).unwrap_or(32),
            "dtype": "int",
            "is_symmetric": if q.symmetric_activations { "True" } else { "False" },
            "per_channel_quantization": q.granularity != "per-tensor",
            "quant_scheme": if method.starts_with("mse") { "post_training_tf_enhanced" } else { "post_training_tf" },
            "npuc_scheme": q.scheme.as_deref().unwrap_or(""),
            "npuc_calib_method": method,
        });
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
        // `enc` is already in QNN-EP form (see quantize_model): the export is the artifact's
        // QDQ graph with the com.microsoft domain where the opset needs it.
        let mut em = qm.clone();
        npuc_quant::export::qnn_domains(&mut em);
        npuc_onnx::save_model(&em, p, &Default::default())
            .with_context(|| format!("writing {}", p.display()))?;
        progress.note(&format!("wrote QDQ ONNX {}", p.display()));
    }
    if q.emit_qdq.is_some() || q.emit_encodings.is_some() {
        timings.push(("exports", t.elapsed().as_secs_f64()));
        t = Instant::now();
    }
    let options = serde_json::json!({
        "input_shapes": opts.input_shapes.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "dims": opts.dims.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "optimize": opts.optimize,
        "target": target.name,
        "quantize": { "scheme": q.scheme.as_deref().unwrap_or(""), "method": method, "granularity": q.granularity, "samples": samples },
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
    timings.push(("compile+write", t.elapsed().as_secs_f64()));
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
    };
    let e = npuc_quant::qdq::weight_encoding(&w32, &spec, name)?;
    let q = npuc_quant::qdq::quantize_tensor(&w32, &e, name)?;
    let (scale, zero_point) = npuc_quant::qdq::param_tensors(&e)?;
    Ok((q, scale, zero_point))
}
