//! `npuc build` of a component pipeline (`[components.<name>]` + `[[connections]]`,
//! docs/PIPELINE.md *Components*): every check first (sources, image folders, each component's
//! input/output ports, the connections' shapes and dtypes), then per component its cached
//! steps: ONNX components through the ONNX compile / quantize driver (`compile:<name>`, image
//! calibration) and a sanity check (`check:<name>`: SQNR of the artifact against the float
//! model on held-out images), LLM components through the LLM pipeline of [`npuc_build`] (an
//! embedder and its decoder as one LLM bundle); then the bundle manifest (`manifest.json`).
//! [`run_image`] runs a vision component of a built bundle on an image (`npuc run BUNDLE
//! --component NAME --image IMG`).

use crate::compile::{load_verified, CompileOptions};
use crate::quantize::{compile_quantized, QuantizeArgs};
use crate::Progress;
use anyhow::{anyhow, bail, Context, Result};
use npuc_build::cache::{self, Cache, KeyHasher, Lookup, Record, Verify};
use npuc_build::components::{
    calibration_images, Calibration, ComponentKind, ComponentsPipeline, ImageSet, OnnxComponent,
    Role, INPUTS_EMBEDS,
};
use npuc_build::{BuildReport, BuildRequest};
use npuc_ir::{DType, Dim, Tensor, TypeInfo};
use npuc_quant::ImagePreprocess;
use npuc_runtime::Value;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The manifest of a component bundle.
pub const MANIFEST: &str = "manifest.json";
/// Its `format` field.
pub const FORMAT: &str = "npuc-components";
/// Its schema version.
pub const VERSION: u32 = 1;

/// One dimension of a port: fixed, or the tokens of a call (`N`, any).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortDim {
    Fixed(usize),
    Any(String),
}

impl std::fmt::Display for PortDim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PortDim::Fixed(n) => write!(f, "{n}"),
            PortDim::Any(s) => write!(f, "{s}"),
        }
    }
}

/// An input or output of a component.
#[derive(Clone, Debug)]
pub struct Port {
    pub name: String,
    /// The graph value it is (`hidden_in` for a decoder's `inputs_embeds`).
    pub graph_name: String,
    pub dtype: DType,
    pub shape: Vec<PortDim>,
}

impl Port {
    fn describe(&self) -> String {
        format!(
            "[{}] {}",
            self.shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            self.dtype.name()
        )
    }
    fn json(&self) -> serde_json::Value {
        json!({
            "name": self.name,
            "graph_name": self.graph_name,
            "dtype": self.dtype.name(),
            "shape": self.shape.iter().map(|d| match d {
                PortDim::Fixed(n) => json!(n),
                PortDim::Any(s) => json!(s),
            }).collect::<Vec<_>>(),
        })
    }
}

/// A component's inputs and outputs.
#[derive(Clone, Debug, Default)]
pub struct Ports {
    pub inputs: Vec<Port>,
    pub outputs: Vec<Port>,
}

fn port_of(name: &str, ty: Option<&TypeInfo>, what: &str) -> Result<Port> {
    let Some(TypeInfo::Tensor {
        dtype: Some(dtype),
        shape: Some(shape),
    }) = ty
    else {
        bail!("{what} '{name}' has no static tensor type (bind its shape with input_shapes)");
    };
    Ok(Port {
        name: name.into(),
        graph_name: name.into(),
        dtype: *dtype,
        shape: shape
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => PortDim::Fixed(*n),
                Dim::Symbolic(s) => PortDim::Any(s.clone()),
                Dim::Unknown => PortDim::Any("?".into()),
            })
            .collect(),
    })
}

fn compile_options(c: &OnnxComponent) -> CompileOptions {
    CompileOptions {
        input_shapes: c
            .input_shapes
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        dims: HashMap::new(),
        target: None,
        optimize: true,
        disable_passes: vec![],
        enable_passes: vec![],
    }
}

/// The ports of an ONNX component: its graph loaded with the bound input shapes and inferred.
fn onnx_ports(name: &str, c: &OnnxComponent) -> Result<Ports> {
    let m = load_verified(&c.source, &compile_options(c))
        .with_context(|| format!("component '{name}': '{}'", c.source.display()))?;
    let inferred = npuc_ir::infer::infer_model(&m, &HashMap::new());
    let ctx = |what: &str| format!("component '{name}' ('{}'): {what}", c.source.display());
    let mut ports = Ports::default();
    for i in m.graph.real_inputs() {
        ports
            .inputs
            .push(port_of(&i.name, i.ty.as_ref(), "input").with_context(|| ctx("input"))?);
    }
    for o in &m.graph.outputs {
        let ty = inferred.types.get(&o.name).or(o.ty.as_ref());
        ports
            .outputs
            .push(port_of(&o.name, ty, "output").with_context(|| ctx("output"))?);
    }
    Ok(ports)
}

/// The ports of an LLM component (its graphs' first input and output, `N` rows per call).
fn llm_ports(role: Role, embedded: bool, n_embd: usize, vocab: usize) -> Ports {
    let n = || PortDim::Any("N".into());
    let ids = Port {
        name: "input_ids".into(),
        graph_name: "input_ids".into(),
        dtype: DType::I64,
        shape: vec![n()],
    };
    let hidden = |name: &str, graph: &str| Port {
        name: name.into(),
        graph_name: graph.into(),
        dtype: DType::F32,
        shape: vec![n(), PortDim::Fixed(n_embd)],
    };
    match role {
        Role::Embedder => Ports {
            inputs: vec![ids],
            outputs: vec![hidden(
                npuc_llm::build::split::HIDDEN_OUT,
                npuc_llm::build::split::HIDDEN_OUT,
            )],
        },
        Role::Decoder => Ports {
            inputs: vec![if embedded {
                hidden(INPUTS_EMBEDS, npuc_llm::build::split::HIDDEN_IN)
            } else {
                ids
            }],
            outputs: vec![Port {
                name: "logits".into(),
                graph_name: "logits".into(),
                dtype: DType::F32,
                shape: vec![n(), PortDim::Fixed(vocab)],
            }],
        },
    }
}

/// Whether an output of shape `from` can feed an input of shape `to`: the same rank after
/// leading 1s (a batch of one) are dropped from the longer, and every dimension equal or a
/// free one (`N`) on either side.
fn shapes_fit(from: &[PortDim], to: &[PortDim]) -> bool {
    let strip = |s: &[PortDim], keep: usize| -> Vec<PortDim> {
        let mut v = s.to_vec();
        while v.len() > keep && v[0] == PortDim::Fixed(1) {
            v.remove(0);
        }
        v
    };
    let rank = from.len().min(to.len());
    let (a, b) = (strip(from, rank), strip(to, rank));
    a.len() == b.len()
        && a.iter()
            .zip(&b)
            .all(|(x, y)| matches!(x, PortDim::Any(_)) || matches!(y, PortDim::Any(_)) || x == y)
}

/// The checks made before any step runs: every component's ports, the connections, the
/// calibration images.
struct Checked {
    ports: BTreeMap<String, Ports>,
    /// Per ONNX component with a folder: (readable images, skipped with why).
    images: BTreeMap<String, npuc_build::components::ImageList>,
}

fn check(cp: &ComponentsPipeline) -> Result<Checked> {
    let f = cp.file.display();
    let mut ports = BTreeMap::new();
    let mut images = BTreeMap::new();
    for c in &cp.components {
        let p = match &c.kind {
            ComponentKind::Onnx(o) => {
                let p = onnx_ports(&c.name, o)?;
                if let Some(cal) = &o.calibration {
                    check_image_input(&c.name, &p, cal)?;
                    if let ImageSet::Folder(dir) = &cal.images {
                        images.insert(c.name.clone(), calibration_images(&c.name, dir, cal)?);
                    } else if let ImageSet::Synthetic(n) = cal.images {
                        if n < cal.heldout + 1 {
                            bail!("{f}: components.{}.calibration: synthetic = {n} leaves no image to calibrate on after heldout = {}", c.name, cal.heldout);
                        }
                    }
                }
                p
            }
            ComponentKind::Llm(l) => {
                let dec = cp
                    .component(&l.bundle)
                    .and_then(|d| match &d.kind {
                        ComponentKind::Llm(d) => d.pipeline.as_ref(),
                        _ => None,
                    })
                    .expect("an LLM component's bundle is a checked decoder");
                let embedded = dec.parts[0].0.is_embedder();
                llm_ports(l.role, embedded, dec.n_embd, dec.vocab)
            }
        };
        ports.insert(c.name.clone(), p);
    }
    for (i, conn) in cp.connections.iter().enumerate() {
        let find = |e: &npuc_build::components::Endpoint, out: bool| -> Result<Port> {
            let p = &ports[&e.component];
            let list = if out { &p.outputs } else { &p.inputs };
            list.iter()
                .find(|x| x.name == e.port || x.graph_name == e.port)
                .cloned()
                .ok_or_else(|| {
                    anyhow!(
                        "{f}: connections[{i}]: component '{}' has no {} '{}' ({}: {})",
                        e.component,
                        if out { "output" } else { "input" },
                        e.port,
                        if out { "outputs" } else { "inputs" },
                        list.iter()
                            .map(|x| x.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })
        };
        let (a, b) = (find(&conn.from, true)?, find(&conn.to, false)?);
        if a.dtype != b.dtype || !shapes_fit(&a.shape, &b.shape) {
            bail!(
                "{f}: connections[{i}]: {} is {} but {} takes {}: component '{}' output '{}' does not fit component '{}' input '{}'",
                conn.from,
                a.describe(),
                conn.to,
                b.describe(),
                conn.from.component,
                a.name,
                conn.to.component,
                b.name
            );
        }
    }
    Ok(Checked { ports, images })
}

/// A calibrated component must have one image input of the preprocessing's shape.
fn check_image_input(name: &str, p: &Ports, cal: &Calibration) -> Result<()> {
    if p.inputs.len() != 1 {
        bail!(
            "component '{name}': image calibration needs a model with one input, this one has {}",
            p.inputs.len()
        );
    }
    let pre = &cal.preprocess;
    let (h, w) = pre.size;
    let want = if pre.nchw { [1, 3, h, w] } else { [1, h, w, 3] };
    let inp = &p.inputs[0];
    let fits = inp.dtype == DType::F32
        && inp.shape.len() == 4
        && inp
            .shape
            .iter()
            .zip(want)
            .all(|(d, n)| matches!(d, PortDim::Any(_)) || *d == PortDim::Fixed(n));
    if !fits {
        bail!(
            "component '{name}': calibration.resize/layout give images of [{}] f32, but input '{}' is {}",
            want.map(|n| n.to_string()).join(", "),
            inp.name,
            inp.describe()
        );
    }
    Ok(())
}

/// What a component build did.
pub struct ComponentsReport {
    /// Progress and summary lines, in order (also sent to the progress callback).
    pub lines: Vec<String>,
    /// Per LLM bundle (decoder component name): its build report.
    pub llm: Vec<(String, BuildReport)>,
    pub manifest: PathBuf,
    pub seconds: f64,
    /// Steps of the ONNX components that ran (not cached).
    pub ran: usize,
}

fn sha_of(path: &Path) -> Result<String> {
    cache::sha256_file(path)
}

fn preprocess_json(p: &ImagePreprocess) -> serde_json::Value {
    json!({
        "resize": [p.size.0, p.size.1],
        "scale": p.scale,
        "mean": p.mean,
        "std": p.std,
        "layout": if p.nchw { "nchw" } else { "nhwc" },
        "channel_order": if p.bgr { "bgr" } else { "rgb" },
        "resample": "bilinear, half-pixel centres",
    })
}

/// The preprocessing a manifest records for a component (`npuc run --component --image`).
pub fn preprocess_from_json(j: &serde_json::Value) -> Result<ImagePreprocess> {
    let f = |v: &serde_json::Value| -> Option<[f32; 3]> {
        let a = v.as_array()?;
        (a.len() == 3).then(|| {
            [
                a[0].as_f64().unwrap_or(0.0) as f32,
                a[1].as_f64().unwrap_or(0.0) as f32,
                a[2].as_f64().unwrap_or(0.0) as f32,
            ]
        })
    };
    let bad = || anyhow!("the manifest's preprocess record is malformed: {j}");
    let size = j["resize"].as_array().ok_or_else(bad)?;
    Ok(ImagePreprocess {
        size: (
            size.first().and_then(|v| v.as_u64()).ok_or_else(bad)? as usize,
            size.get(1).and_then(|v| v.as_u64()).ok_or_else(bad)? as usize,
        ),
        mean: f(&j["mean"]).ok_or_else(bad)?,
        std: f(&j["std"]).ok_or_else(bad)?,
        scale: j["scale"].as_f64().ok_or_else(bad)? as f32,
        nchw: j["layout"] == "nchw",
        bgr: j["channel_order"] == "bgr",
    })
}

/// SQNR in dB of `test` against `reference`: 10 log10(sum ref^2 / sum (ref - test)^2);
/// infinite when they are equal.
pub fn sqnr_db(reference: &[f32], test: &[f32]) -> f64 {
    let (mut s, mut n) = (0f64, 0f64);
    for (&r, &t) in reference.iter().zip(test) {
        s += f64::from(r) * f64::from(r);
        n += (f64::from(r) - f64::from(t)).powi(2);
    }
    if n == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (s / n).log10()
    }
}

/// Runs a model (ONNX or artifact) on one preprocessed image.
fn run_on(
    sess: &npuc_runtime::Session,
    input: &str,
    image: &Path,
    pre: &ImagePreprocess,
) -> Result<Vec<(String, Tensor)>> {
    let x = npuc_quant::calib::load_image(image, pre)?;
    let outs = sess.run(vec![(input.to_string(), Value::tensor(x))])?;
    outs.into_iter()
        .map(|(n, v)| match v {
            Value::Tensor(t) => Ok((n, (*t).clone())),
            other => bail!("output '{n}' is a {}, not a tensor", other.kind()),
        })
        .collect()
}

fn f32s(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_f64_vec()?.into_iter().map(|x| x as f32).collect())
}

/// Seed of the synthetic calibration images (fixed: the same images on every machine).
const SYNTHETIC_SEED: u64 = 2026;

/// Builds the component pipeline `file` into `req.out_dir`.
pub fn build_components(
    file: &Path,
    req: &BuildRequest,
    progress: &mut dyn Progress,
) -> Result<ComponentsReport> {
    let t0 = Instant::now();
    let mut lines = vec![];
    let mut say = |l: String, progress: &mut dyn Progress| {
        progress.note(&l);
        lines.push(l);
    };
    let cp = ComponentsPipeline::load(file)?;
    let checked = check(&cp)?;
    for c in &cp.components {
        let p = &checked.ports[&c.name];
        let io = |v: &[Port]| {
            v.iter()
                .map(|p| format!("{} {}", p.name, p.describe()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let what = match &c.kind {
            ComponentKind::Onnx(o) => format!("onnx {}", o.precision),
            ComponentKind::Llm(l) => match l.role {
                Role::Embedder => format!("llm embedder ({}) of '{}'", l.dtype, l.bundle),
                Role::Decoder => "llm decoder".into(),
            },
        };
        say(
            format!(
                "component {}: {what}; in: {}; out: {}",
                c.name,
                io(&p.inputs),
                io(&p.outputs)
            ),
            progress,
        );
    }
    for conn in &cp.connections {
        say(
            format!(
                "connection {} -> {}: shapes and dtypes fit",
                conn.from, conn.to
            ),
            progress,
        );
    }
    for (name, (_, skipped)) in &checked.images {
        for (p, why) in skipped {
            say(
                format!(
                    "component {name}: skipping unreadable calibration image '{}' ({why})",
                    p.display()
                ),
                progress,
            );
        }
    }
    let _lock = if req.dry_run {
        None
    } else {
        Some(npuc_build::lock_out_dir(&req.out_dir)?)
    };
    let cache = if req.dry_run {
        Cache::at(&req.out_dir.join(npuc_build::CACHE_DIR))
    } else {
        Cache::open(&req.out_dir.join(npuc_build::CACHE_DIR))?
    };
    let mut ran = 0;
    let mut components_json = serde_json::Map::new();
    // ONNX components.
    for c in &cp.components {
        let ComponentKind::Onnx(o) = &c.kind else {
            continue;
        };
        let forced = |id: &str| req.force.iter().any(|f| f == id || f == "component");
        let (calib_files, heldout, skipped): (Vec<PathBuf>, Vec<PathBuf>, Vec<(PathBuf, String)>) =
            match &o.calibration {
                None => (vec![], vec![], vec![]),
                Some(cal) => {
                    let (all, skipped) = match &cal.images {
                        ImageSet::Folder(_) => checked.images[&c.name].clone(),
                        ImageSet::Synthetic(n) => {
                            if req.dry_run {
                                say(
                                    format!(
                                        "component {}: would write {n} synthetic images",
                                        c.name
                                    ),
                                    progress,
                                );
                                (vec![], vec![])
                            } else {
                                (
                                    synthetic_images(&cache, *n, &cal.preprocess, &mut ran)?,
                                    vec![],
                                )
                            }
                        }
                    };
                    let split = all.len().saturating_sub(cal.heldout);
                    (all[..split].to_vec(), all[split..].to_vec(), skipped)
                }
            };
        if req.dry_run {
            say(
                format!(
                    "component {}: compile:{} and check:{} would run unless cached ({} calibration image(s), {} held out)",
                    c.name,
                    c.name,
                    c.name,
                    calib_files.len(),
                    heldout.len()
                ),
                progress,
            );
            continue;
        }
        // compile:<name>
        let id = format!("compile:{}", c.name);
        let mut k = KeyHasher::new("component-compile");
        k.field("identity", &npuc_build::source_identity(&o.source)?)
            .field("precision", &o.precision)
            .field("input_shapes", &format!("{:?}", o.input_shapes));
        if let Some(cal) = &o.calibration {
            k.field("preprocess", &format!("{:?}", cal.preprocess))
                .field("method", &cal.method);
            for f in &calib_files {
                k.field("image", &sha_of(f)?);
            }
        }
        let key = k.finish();
        let t = Instant::now();
        let (rec, status) = cached_step(&cache, "component-compile", &key, forced(&id), |dir| {
            compile_onnx(&c.name, o, &calib_files, dir)
        })?;
        ran += usize::from(status != "cached");
        say(
            format!(
                "{id:30} {status:8} {:7.2}s  {} ({:.1} MiB)",
                t.elapsed().as_secs_f64(),
                ARTIFACT,
                rec.files[ARTIFACT].bytes as f64 / (1 << 20) as f64
            ),
            progress,
        );
        let artifact = cache.entry_dir("component-compile", &key).join(ARTIFACT);
        // check:<name>
        let check_json = if let Some(cal) =
            o.calibration.as_ref().filter(|_| o.precision != "float")
        {
            let id = format!("check:{}", c.name);
            let mut k = KeyHasher::new("component-check");
            k.field("compile", &rec.digest())
                .field("identity", &npuc_build::source_identity(&o.source)?)
                .field("preprocess", &format!("{:?}", cal.preprocess))
                .field("min_sqnr_db", &o.min_sqnr_db.to_string());
            for f in &heldout {
                k.field("image", &sha_of(f)?);
            }
            let key = k.finish();
            let t = Instant::now();
            let (crec, status) =
                cached_step(&cache, "component-check", &key, forced(&id), |dir| {
                    sqnr_check(&c.name, o, cal, &artifact, &heldout, dir)
                })?;
            ran += usize::from(status != "cached");
            let path = cache.entry_dir("component-check", &crec.key).join(CHECK);
            let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
            say(
                format!(
                    "{id:30} {status:8} {:7.2}s  SQNR vs float on {} held-out image(s): min {:.2} dB, mean {:.2} dB (bar {:.1} dB)",
                    t.elapsed().as_secs_f64(),
                    heldout.len(),
                    j["min_sqnr_db"].as_f64().unwrap_or(f64::NAN),
                    j["mean_sqnr_db"].as_f64().unwrap_or(f64::NAN),
                    o.min_sqnr_db
                ),
                progress,
            );
            Some(j)
        } else {
            None
        };
        let file_name = format!("{}.npuc", c.name);
        let key_c = rec.key.clone();
        cache.keeping_stamp("component-compile", &key_c, ARTIFACT, || {
            npuc_build::link_into(&artifact, &req.out_dir.join(&file_name))
        })?;
        let ports = &checked.ports[&c.name];
        let mut j = json!({
            "kind": "onnx",
            "source": {
                "file": o.source.file_name().map(|f| f.to_string_lossy().into_owned()),
                "sha256": sha_of(&o.source)?,
            },
            "precision": o.precision,
            "artifacts": [{
                "file": file_name,
                "bytes": rec.files[ARTIFACT].bytes,
                "sha256": rec.files[ARTIFACT].sha256,
            }],
            "graphs": [{
                "file": file_name,
                "name": c.name,
                "inputs": ports.inputs.iter().map(Port::json).collect::<Vec<_>>(),
                "outputs": ports.outputs.iter().map(Port::json).collect::<Vec<_>>(),
            }],
        });
        if let Some(cal) = &o.calibration {
            j["preprocess"] = preprocess_json(&cal.preprocess);
            j["calibration"] = json!({
                "images": match &cal.images {
                    ImageSet::Folder(d) => json!(d.display().to_string()),
                    ImageSet::Synthetic(n) => json!(format!("{n} synthetic (seed {SYNTHETIC_SEED})")),
                },
                "method": cal.method,
                "calibrated_on": calib_files.iter().map(|p| p.file_name().map(|f| f.to_string_lossy().into_owned())).collect::<Vec<_>>(),
                "held_out": heldout.iter().map(|p| p.file_name().map(|f| f.to_string_lossy().into_owned())).collect::<Vec<_>>(),
                "skipped_unreadable": skipped.iter().map(|(p, why)| json!({"file": p.display().to_string(), "reason": why})).collect::<Vec<_>>(),
            });
        }
        if let Some(chk) = check_json {
            j["check"] = chk;
        }
        components_json.insert(c.name.clone(), j);
    }
    // LLM bundles (one per decoder, its embedder as part 1).
    let mut llm = vec![];
    let mut tokenizer = serde_json::Value::Null;
    for c in &cp.components {
        let ComponentKind::Llm(l) = &c.kind else {
            continue;
        };
        if l.role != Role::Decoder {
            continue;
        }
        let p = l
            .pipeline
            .as_ref()
            .expect("a checked decoder has its pipeline");
        // `--force` names of the ONNX components' steps are not the LLM bundle's.
        let onnx_step = |f: &str| {
            f == "component"
                || cp.components.iter().any(|x| {
                    matches!(x.kind, ComponentKind::Onnx(_))
                        && (f == format!("compile:{}", x.name) || f == format!("check:{}", x.name))
                })
        };
        let sub = BuildRequest {
            out_dir: req.out_dir.join(&c.name),
            force: req
                .force
                .iter()
                .filter(|f| !onnx_step(f))
                .cloned()
                .collect(),
            ..req.clone()
        };
        let mut line = |s: &str| progress.note(&format!("[{}] {s}", c.name));
        let report = npuc_build::build(p, &sub, &mut line)
            .with_context(|| format!("component '{}'", c.name))?;
        llm.push((c.name.clone(), report));
        if req.dry_run {
            continue;
        }
        let m = npuc_llm::bundle::BundleManifest::read(&sub.out_dir)?;
        let embedded = p.parts[0].0.is_embedder();
        let graphs_of = |parts: &[usize]| -> Result<Vec<serde_json::Value>> {
            let mut v = vec![];
            for &i in parts {
                let file = format!("{}/{}", c.name, m.parts[i].file);
                let art = npuc_format::Artifact::open(&sub.out_dir.join(&m.parts[i].file))?;
                for g in art.graph_names() {
                    let model = art.model(Some(g))?;
                    let io = |vs: &[npuc_ir::ValueInfo]| -> Result<Vec<serde_json::Value>> {
                        vs.iter()
                            .map(|v| port_of(&v.name, v.ty.as_ref(), "value").map(|p| p.json()))
                            .collect()
                    };
                    v.push(json!({
                        "file": file, "name": g,
                        "inputs": io(&model.graph.inputs)?, "outputs": io(&model.graph.outputs)?,
                    }));
                }
            }
            Ok(v)
        };
        let artifacts = |parts: &[usize]| -> Vec<serde_json::Value> {
            parts
                .iter()
                .map(|&i| {
                    json!({
                        "file": format!("{}/{}", c.name, m.parts[i].file),
                        "bytes": m.parts[i].file_bytes,
                        "sha256": m.parts[i].sha256,
                        "layers": m.parts[i].layers,
                        "precision": m.parts[i].precision,
                    })
                })
                .collect()
        };
        let decoder_parts: Vec<usize> = (usize::from(embedded)..m.parts.len()).collect();
        let ports = &checked.ports[&c.name];
        components_json.insert(
            c.name.clone(),
            json!({
                "kind": "llm",
                "role": "decoder",
                "bundle": c.name,
                "source": {"file": m.source.file, "sha256": m.source.sha256},
                "arch": m.arch, "n_layers": m.n_layers, "n_embd": m.n_embd, "vocab": m.vocab,
                "ar": m.ar, "ctx": m.ctx, "sha": m.sha,
                "inputs": ports.inputs.iter().map(Port::json).collect::<Vec<_>>(),
                "outputs": ports.outputs.iter().map(Port::json).collect::<Vec<_>>(),
                "artifacts": artifacts(&decoder_parts),
                "graphs": graphs_of(&decoder_parts)?,
            }),
        );
        if embedded {
            let (ename, e) = cp
                .components
                .iter()
                .find_map(|x| match &x.kind {
                    ComponentKind::Llm(e) if e.role == Role::Embedder && e.bundle == c.name => {
                        Some((x.name.clone(), e))
                    }
                    _ => None,
                })
                .expect("an embedded decoder has its embedder component");
            let ports = &checked.ports[&ename];
            components_json.insert(
                ename.clone(),
                json!({
                    "kind": "llm",
                    "role": "embedder",
                    "bundle": c.name,
                    "dtype": e.dtype,
                    "source": {"file": m.source.file, "sha256": m.source.sha256},
                    "inputs": ports.inputs.iter().map(Port::json).collect::<Vec<_>>(),
                    "outputs": ports.outputs.iter().map(Port::json).collect::<Vec<_>>(),
                    "artifacts": artifacts(&[0]),
                    "graphs": graphs_of(&[0])?,
                }),
            );
        }
        if tokenizer.is_null() {
            tokenizer = json!({
                "component": c.name,
                "source": m.source.file,
                "stored_in": format!("{}/{}", c.name, m.parts[0].file),
                "metadata_key": npuc_llm::engine::TOKENIZER_KEY,
            });
        }
    }
    let manifest_path = req.out_dir.join(MANIFEST);
    if !req.dry_run {
        let conns: Vec<serde_json::Value> = cp
            .connections
            .iter()
            .map(|c| {
                let out = checked.ports[&c.from.component]
                    .outputs
                    .iter()
                    .find(|p| p.name == c.from.port || p.graph_name == c.from.port)
                    .expect("checked");
                json!({"from": c.from.to_string(), "to": c.to.to_string(), "dtype": out.dtype.name(),
                       "shape": out.json()["shape"]})
            })
            .collect();
        let manifest = json!({
            "format": FORMAT,
            "version": VERSION,
            "npuc_version": env!("CARGO_PKG_VERSION"),
            "pipeline": cp.file.file_name().map(|f| f.to_string_lossy().into_owned()),
            "components": components_json,
            "connections": conns,
            "tokenizer": tokenizer,
        });
        let mut bytes = serde_json::to_vec_pretty(&manifest)?;
        bytes.push(b'\n');
        if std::fs::read(&manifest_path).ok().as_deref() != Some(&bytes[..]) {
            npuc_onnx::export::write_atomic(&manifest_path, &bytes)?;
            say(format!("wrote {}", manifest_path.display()), progress);
        } else {
            say(
                format!("{} is up to date", manifest_path.display()),
                progress,
            );
        }
    }
    Ok(ComponentsReport {
        lines,
        llm,
        manifest: manifest_path,
        seconds: t0.elapsed().as_secs_f64(),
        ran,
    })
}

/// An ONNX component's artifact in its compile entry.
const ARTIFACT: &str = "model.npuc";
/// The SQNR check's record in its entry.
const CHECK: &str = "check.json";

/// Looks `kind/key` up (verifying it) or runs `work` into a scratch directory and commits the
/// files it names. Returns the record and "cached", "ran", "forced" or "rebuilt".
fn cached_step(
    cache: &Cache,
    kind: &str,
    key: &str,
    force: bool,
    work: impl FnOnce(&Path) -> Result<Vec<String>>,
) -> Result<(Record, &'static str)> {
    let status = if force {
        cache.remove(kind, key)?;
        "forced"
    } else {
        match cache.lookup(kind, key, Verify::Changed)? {
            Lookup::Hit(r, _) => return Ok((r, "cached")),
            Lookup::Miss => "ran",
            Lookup::Corrupt(_) => {
                cache.remove(kind, key)?;
                "rebuilt"
            }
        }
    };
    let scratch = cache.scratch()?;
    let names = work(scratch.path())?;
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let rec = cache.commit(kind, kind, key, scratch, &names)?;
    Ok((rec, status))
}

/// The synthetic calibration images (a cached step: the same images for the same count and
/// size), sorted.
fn synthetic_images(
    cache: &Cache,
    n: usize,
    pre: &ImagePreprocess,
    ran: &mut usize,
) -> Result<Vec<PathBuf>> {
    // Larger than the model's input, and of another aspect, so the resize does work.
    let size = (pre.size.0 + pre.size.0 / 4, pre.size.1 + pre.size.1 / 2);
    let mut k = KeyHasher::new("images");
    k.field("count", &n.to_string())
        .field("size", &format!("{size:?}"))
        .field("seed", &SYNTHETIC_SEED.to_string());
    let key = k.finish();
    let (rec, status) = cached_step(cache, "images", &key, false, |dir| {
        let files = npuc_quant::calib::write_synthetic_images(dir, n, size, SYNTHETIC_SEED)?;
        Ok(files
            .iter()
            .map(|f| {
                f.file_name()
                    .expect("a file")
                    .to_string_lossy()
                    .into_owned()
            })
            .collect())
    })?;
    *ran += usize::from(status != "cached");
    let dir = cache.entry_dir("images", &key);
    Ok(rec.files.keys().map(|f| dir.join(f)).collect())
}

/// `compile:<name>`: the ONNX compile (float) or quantized compile (calibrated on `calib`).
fn compile_onnx(
    name: &str,
    o: &OnnxComponent,
    calib: &[PathBuf],
    dir: &Path,
) -> Result<Vec<String>> {
    let opts = compile_options(o);
    let out = dir.join(ARTIFACT);
    let mut quiet = |_: &str| {};
    if o.precision == "float" {
        crate::compile::compile(
            &[(name.to_string(), o.source.clone())],
            &opts,
            &out,
            &mut quiet,
        )
        .with_context(|| format!("component '{name}'"))?;
    } else {
        let cal = o
            .calibration
            .as_ref()
            .expect("checked: quantized needs calibration");
        // The calibration subset as a folder of links (held-out and skipped images left out).
        let cdir = dir.join("calibration");
        std::fs::create_dir_all(&cdir)?;
        for (i, f) in calib.iter().enumerate() {
            let ext = f.extension().and_then(|e| e.to_str()).unwrap_or("png");
            let dest = cdir.join(format!("{i:05}.{ext}"));
            if std::fs::hard_link(f, &dest).is_err() {
                std::fs::copy(f, &dest).with_context(|| format!("copying '{}'", f.display()))?;
            }
        }
        let pre = &cal.preprocess;
        let q = QuantizeArgs {
            scheme: Some(o.precision.clone()),
            calib: Some(cdir.clone()),
            calib_method: cal.method.clone(),
            percentile: 99.99,
            granularity: "per-channel".into(),
            image_size: Some(format!("{},{}", pre.size.0, pre.size.1)),
            mean: Some(pre.mean.map(|x| x.to_string()).join(",")),
            std: Some(pre.std.map(|x| x.to_string()).join(",")),
            layout: if pre.nchw { "nchw" } else { "nhwc" }.into(),
            channel_order: if pre.bgr { "bgr" } else { "rgb" }.into(),
            scale: pre.scale.to_string(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            no_progress: true,
            ..Default::default()
        };
        compile_quantized(name, &o.source, &opts, &q, &out, &mut quiet)
            .with_context(|| format!("component '{name}'"))?;
        std::fs::remove_dir_all(&cdir)?;
    }
    Ok(vec![ARTIFACT.into()])
}

/// `check:<name>`: the artifact against the float model (the ONNX file run by npuc) on each
/// held-out image: SQNR per output; fails naming the component and image below the bar.
fn sqnr_check(
    name: &str,
    o: &OnnxComponent,
    cal: &Calibration,
    artifact: &Path,
    heldout: &[PathBuf],
    dir: &Path,
) -> Result<Vec<String>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let float = crate::open(
        &o.source,
        &crate::OpenOptions {
            input_shapes: compile_options(o).input_shapes,
            threads,
            ..Default::default()
        },
    )?
    .session;
    let quant = crate::open(
        artifact,
        &crate::OpenOptions {
            threads,
            ..Default::default()
        },
    )?
    .session;
    let input = float.inputs()[0].name.clone();
    let mut rows = vec![];
    let mut all = vec![];
    for img in heldout {
        let a = run_on(&float, &input, img, &cal.preprocess)?;
        let b = run_on(&quant, &input, img, &cal.preprocess)?;
        let mut per = serde_json::Map::new();
        for ((n, ta), (_, tb)) in a.iter().zip(&b) {
            let s = sqnr_db(&f32s(ta)?, &f32s(tb)?);
            if s < o.min_sqnr_db {
                bail!(
                    "component '{name}': output '{n}' on held-out image '{}': SQNR {s:.2} dB of the {} artifact against the float model is below min_sqnr_db = {}",
                    img.display(),
                    o.precision,
                    o.min_sqnr_db
                );
            }
            all.push(s);
            per.insert(n.clone(), json!(s));
        }
        rows.push(json!({
            "image": img.file_name().map(|f| f.to_string_lossy().into_owned()),
            "sqnr_db": per,
        }));
    }
    let min = all.iter().copied().fold(f64::INFINITY, f64::min);
    let mean = all.iter().sum::<f64>() / all.len().max(1) as f64;
    let j = json!({
        "what": "SQNR of the quantized artifact's outputs against the float ONNX model run by npuc, per held-out image",
        "reference": "float",
        "min_sqnr_db_bar": o.min_sqnr_db,
        "images": rows,
        "min_sqnr_db": min,
        "mean_sqnr_db": mean,
    });
    cache::write_synced(&dir.join(CHECK), &serde_json::to_vec_pretty(&j)?)?;
    Ok(vec![CHECK.into()])
}

/// `npuc run BUNDLE --component NAME --image IMG`: the component's artifact on the image,
/// preprocessed as the manifest records. Returns the outputs in graph order.
pub fn run_image(
    bundle: &Path,
    component: &str,
    image: &Path,
    threads: usize,
) -> Result<Vec<(String, Tensor)>> {
    let path = bundle.join(MANIFEST);
    let bytes = std::fs::read(&path).with_context(|| {
        format!(
            "'{}' is not a component bundle (no {MANIFEST}; build one with `npuc build` from a pipeline with [components])",
            bundle.display()
        )
    })?;
    let m: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("parsing '{}'", path.display()))?;
    if m["format"] != FORMAT {
        bail!("'{}' is not a {FORMAT} manifest", path.display());
    }
    let comps = m["components"]
        .as_object()
        .ok_or_else(|| anyhow!("'{}' has no components", path.display()))?;
    let c = comps.get(component).ok_or_else(|| {
        anyhow!(
            "'{}' has no component '{component}' (components: {})",
            bundle.display(),
            comps.keys().cloned().collect::<Vec<_>>().join(", ")
        )
    })?;
    if c["kind"] != "onnx" {
        bail!(
            "component '{component}' is an LLM {}; run it with `npuc generate {}` (--prefix-embeddings for embeddings)",
            c["role"].as_str().unwrap_or(""),
            bundle.join(c["bundle"].as_str().unwrap_or("")).display()
        );
    }
    if c["preprocess"].is_null() {
        bail!("component '{component}' records no image preprocessing (it was not calibrated on images); run its artifact with `npuc run {} -i NAME=FILE.npy`", bundle.join(c["artifacts"][0]["file"].as_str().unwrap_or("")).display());
    }
    let pre = preprocess_from_json(&c["preprocess"])?;
    let file = c["artifacts"][0]["file"]
        .as_str()
        .ok_or_else(|| anyhow!("component '{component}': no artifact in the manifest"))?;
    let input = c["graphs"][0]["inputs"][0]["name"]
        .as_str()
        .ok_or_else(|| anyhow!("component '{component}': no input in the manifest"))?;
    let sess = crate::open(
        &bundle.join(file),
        &crate::OpenOptions {
            threads,
            ..Default::default()
        },
    )?
    .session;
    run_on(&sess, input, image, &pre).with_context(|| format!("component '{component}'"))
}

/// The image preprocessing and the synthetic calibration images, for callers of this module.
pub use npuc_quant::calib::{load_image, write_synthetic_images};

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(v: &[&str]) -> Vec<PortDim> {
        v.iter()
            .map(|d| match d.parse::<usize>() {
                Ok(n) => PortDim::Fixed(n),
                Err(_) => PortDim::Any(d.to_string()),
            })
            .collect()
    }

    #[test]
    fn shapes_fit_up_to_a_batch_of_one_and_free_dims() {
        assert!(shapes_fit(&dims(&["N", "576"]), &dims(&["N", "576"])));
        assert!(shapes_fit(&dims(&["1", "7", "576"]), &dims(&["N", "576"])));
        assert!(shapes_fit(&dims(&["7", "576"]), &dims(&["N", "576"])));
        assert!(!shapes_fit(&dims(&["1", "7", "384"]), &dims(&["N", "576"])));
        assert!(!shapes_fit(&dims(&["2", "7", "576"]), &dims(&["N", "576"])));
        assert!(!shapes_fit(
            &dims(&["1", "1", "224", "224"]),
            &dims(&["N", "576"])
        ));
    }

    #[test]
    fn sqnr_is_infinite_for_equal_and_20_db_for_a_tenth() {
        assert_eq!(sqnr_db(&[1.0, -2.0], &[1.0, -2.0]), f64::INFINITY);
        let r = [1.0f32, -1.0, 1.0, -1.0];
        let t: Vec<f32> = r.iter().map(|x| x * 1.1).collect();
        assert!((sqnr_db(&r, &t) - 20.0).abs() < 1e-4);
    }
}
