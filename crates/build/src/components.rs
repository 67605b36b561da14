//! Multi-component pipeline files (docs/PIPELINE.md *Components*): `[components.<name>]`
//! entries, each with its own source and precision, and `[[connections]]` saying which
//! component's output feeds which input. Parsed and checked here, strictly and before any step
//! runs (sources exist, image folders decode, LLM components pass the single-model checks);
//! the connection shapes are checked by the caller, which can infer ONNX graphs
//! (`npuc_driver::components`), and so is the build.
//!
//! A file is a component pipeline when it has a `[components]` table; every other pipeline file
//! is the single-model form of [`crate::Pipeline`], unchanged.

use crate::pipeline::{
    GraphsSection, ModelSection, PipelineFile, SplitSection, TargetSection, TestSection,
};
use crate::{pipeline::resolve_path, Pipeline};
use anyhow::{anyhow, bail, Context, Result};
use npuc_quant::ImagePreprocess;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ComponentsFile {
    components: BTreeMap<String, ComponentRaw>,
    #[serde(default)]
    connections: Vec<ConnectionRaw>,
    #[serde(default)]
    target: TargetSection,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ComponentRaw {
    onnx: Option<String>,
    gguf: Option<String>,
    /// LLM components: `decoder` (default) or `embedder`.
    role: Option<String>,
    /// ONNX: w8a8 (and the other `npuc compile --quantize` schemes) or `float`; LLM decoder:
    /// fast, parity or exact.
    precision: Option<String>,
    // ONNX components.
    input_shapes: Option<BTreeMap<String, Vec<usize>>>,
    calibration: Option<CalibrationRaw>,
    min_sqnr_db: Option<f64>,
    // LLM embedder.
    dtype: Option<String>,
    // LLM decoder.
    ar: Option<Vec<usize>>,
    ctx: Option<Vec<usize>>,
    sha: Option<bool>,
    parts: Option<usize>,
    max_part_bytes: Option<u64>,
    prompts: Option<Vec<String>>,
    max_tokens: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CalibrationRaw {
    images: Option<String>,
    synthetic: Option<usize>,
    heldout: Option<usize>,
    resize: [usize; 2],
    mean: Option<Vec<f32>>,
    std: Option<Vec<f32>>,
    scale: Option<f32>,
    layout: Option<String>,
    channel_order: Option<String>,
    unreadable: Option<String>,
    method: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConnectionRaw {
    from: String,
    to: String,
}

/// Where a vision component's calibration images come from.
#[derive(Clone, Debug)]
pub enum ImageSet {
    /// A folder of PNG/JPEG files (sorted by name).
    Folder(PathBuf),
    /// N deterministic synthetic images (`npuc_quant::calib::write_synthetic_images`), written
    /// by the build into its cache.
    Synthetic(usize),
}

/// A calibration spec, checked.
#[derive(Clone, Debug)]
pub struct Calibration {
    pub images: ImageSet,
    /// Preprocessing (also what `npuc run BUNDLE --component NAME --image` applies).
    pub preprocess: ImagePreprocess,
    /// The last `heldout` images are not calibrated on; the SQNR check runs on them.
    pub heldout: usize,
    /// An unreadable image is skipped (named in a warning and the manifest) instead of fatal.
    pub skip_unreadable: bool,
    /// Activation range method (`minmax`, `percentile`, `mse`, `entropy`).
    pub method: String,
}

/// An ONNX component (compiled by the ONNX compile / quantize driver).
#[derive(Clone, Debug)]
pub struct OnnxComponent {
    pub source: PathBuf,
    /// `float` (plain compile) or a quantization scheme (`w8a8`, `fp16`, ...).
    pub precision: String,
    pub input_shapes: BTreeMap<String, Vec<usize>>,
    pub calibration: Option<Calibration>,
    /// The SQNR check's bar: every held-out image's output SQNR (quantized vs float) must
    /// reach it.
    pub min_sqnr_db: f64,
}

/// The role of an LLM component.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Decoder,
    Embedder,
}

/// An LLM component. An embedder and the decoder with the same GGUF are built as one LLM
/// bundle (`split.embedder`): part 1 is the embedder, the other parts the decoder.
#[derive(Clone, Debug)]
pub struct LlmComponent {
    pub role: Role,
    pub source: PathBuf,
    /// The decoder component whose LLM bundle holds this component (itself for a decoder).
    pub bundle: String,
    /// Decoders: the checked single-model pipeline of the bundle.
    pub pipeline: Option<Box<Pipeline>>,
    /// Embedders: `f16` or `gguf`.
    pub dtype: String,
}

#[derive(Clone, Debug)]
pub enum ComponentKind {
    Onnx(OnnxComponent),
    Llm(LlmComponent),
}

#[derive(Clone, Debug)]
pub struct Component {
    pub name: String,
    pub kind: ComponentKind,
}

/// `component.port`, as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub component: String,
    pub port: String,
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.component, self.port)
    }
}

#[derive(Clone, Debug)]
pub struct Connection {
    pub from: Endpoint,
    pub to: Endpoint,
}

/// A checked component pipeline.
#[derive(Clone, Debug)]
pub struct ComponentsPipeline {
    pub file: PathBuf,
    /// In name order.
    pub components: Vec<Component>,
    pub connections: Vec<Connection>,
}

/// The decoder port that takes embeddings (`inputs_embeds` in transformers; the graphs'
/// `hidden_in`).
pub const INPUTS_EMBEDS: &str = "inputs_embeds";

/// Whether `file` is a component pipeline (has a `[components]` table).
pub fn is_components_file(file: &Path) -> Result<bool> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading pipeline file '{}'", file.display()))?;
    let v: toml::Table = toml::from_str(&text).map_err(|e| {
        anyhow!(
            "{}: {}",
            file.display(),
            e.to_string().trim_end().replace('\n', "\n  ")
        )
    })?;
    Ok(v.contains_key("components"))
}

fn endpoint(raw: &str, key: &str, f: &str) -> Result<Endpoint> {
    match raw.split_once('.') {
        Some((c, p)) if !c.is_empty() && !p.is_empty() => Ok(Endpoint {
            component: c.into(),
            port: p.into(),
        }),
        _ => bail!("{f}: {key} = \"{raw}\": expected \"component.port\" (e.g. \"vision.output\")"),
    }
}

fn existing(f: &str, name: &str, key: &str, value: &str, base: &Path) -> Result<PathBuf> {
    let p = resolve_path(value, base);
    if !p.is_file() {
        bail!(
            "{f}: component '{name}': {key} = \"{value}\": no such file '{}'",
            p.display()
        );
    }
    Ok(p)
}

fn three(v: &Option<Vec<f32>>, what: &str, default: f32, ctx: &str) -> Result<[f32; 3]> {
    match v.as_deref() {
        None => Ok([default; 3]),
        Some([a]) => Ok([*a; 3]),
        Some([a, b, c]) => Ok([*a, *b, *c]),
        Some(other) => bail!("{ctx}.{what} has {} values; give 1 or 3", other.len()),
    }
}

impl ComponentsPipeline {
    /// Reads and checks `file`: every component's source exists, keys fit the component's
    /// kind, LLM components pass the single-model pipeline checks, connections name existing
    /// components. Image folders are checked by [`ComponentsPipeline::calibration_images`].
    pub fn load(file: &Path) -> Result<ComponentsPipeline> {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("reading pipeline file '{}'", file.display()))?;
        let f = file.display().to_string();
        let raw: ComponentsFile = toml::from_str(&text)
            .map_err(|e| anyhow!("{f}: {}", e.to_string().trim_end().replace('\n', "\n  ")))?;
        if raw.components.is_empty() {
            bail!("{f}: [components] is empty; give at least one [components.<name>]");
        }
        let base = file.parent().unwrap_or(Path::new("."));
        // The sources of decoders, to pair embedders with them.
        let mut decoders: BTreeMap<PathBuf, String> = BTreeMap::new();
        for (name, c) in &raw.components {
            if let (Some(g), None | Some("decoder")) = (&c.gguf, c.role.as_deref()) {
                let src = existing(&f, name, "gguf", g, base)?;
                if let Some(other) = decoders.insert(src, name.clone()) {
                    bail!("{f}: components '{other}' and '{name}' are both decoders of the same GGUF; give one");
                }
            }
        }
        let mut embedder_of: BTreeMap<String, (String, String)> = BTreeMap::new();
        let mut components = vec![];
        for (name, c) in &raw.components {
            if name.contains('.') {
                bail!(
                    "{f}: component name '{name}' contains '.'; connections write component.port"
                );
            }
            let ctx = format!("components.{name}");
            let not_for = |keys: &[(&str, bool)], kind: &str| -> Result<()> {
                if let Some((k, _)) = keys.iter().find(|(_, set)| *set) {
                    bail!("{f}: {ctx}.{k} does not apply to {kind}");
                }
                Ok(())
            };
            // Keys of a decoder only (an embedder takes its decoder's graphs).
            let decoder_keys = [
                ("ar", c.ar.is_some()),
                ("ctx", c.ctx.is_some()),
                ("sha", c.sha.is_some()),
                ("parts", c.parts.is_some()),
                ("max_part_bytes", c.max_part_bytes.is_some()),
                ("prompts", c.prompts.is_some()),
                ("max_tokens", c.max_tokens.is_some()),
            ];
            let llm_keys = [("role", c.role.is_some()), ("dtype", c.dtype.is_some())];
            let onnx_keys = [
                ("input_shapes", c.input_shapes.is_some()),
                ("calibration", c.calibration.is_some()),
                ("min_sqnr_db", c.min_sqnr_db.is_some()),
            ];
            let kind = match (&c.onnx, &c.gguf) {
                (Some(o), None) => {
                    not_for(&llm_keys, "an ONNX component")?;
                    not_for(&decoder_keys, "an ONNX component")?;
                    let source = existing(&f, name, "onnx", o, base)?;
                    let precision = c.precision.clone().unwrap_or_else(|| "float".into());
                    if precision != "float" {
                        npuc_quant::Scheme::parse(&precision).map_err(|e| {
                            anyhow!("{f}: {ctx}.precision = \"{precision}\": {e} (or float)")
                        })?;
                    }
                    let calibration = c
                        .calibration
                        .as_ref()
                        .map(|cal| calibration(cal, &f, &ctx, base))
                        .transpose()?;
                    if precision != "float" && calibration.is_none() {
                        bail!("{f}: {ctx}.precision = \"{precision}\" needs [{ctx}.calibration] (images = \"DIR\" or synthetic = N, resize = [H, W], mean/std)");
                    }
                    ComponentKind::Onnx(OnnxComponent {
                        source,
                        precision,
                        input_shapes: c.input_shapes.clone().unwrap_or_default(),
                        calibration,
                        min_sqnr_db: c.min_sqnr_db.unwrap_or(DEFAULT_MIN_SQNR_DB),
                    })
                }
                (None, Some(g)) => {
                    not_for(&onnx_keys, "an LLM component")?;
                    let source = existing(&f, name, "gguf", g, base)?;
                    match c.role.as_deref() {
                        None | Some("decoder") => {
                            if c.dtype.is_some() {
                                bail!("{f}: {ctx}.dtype applies to embedders (role = \"embedder\"); a decoder's numerics are its precision");
                            }
                            ComponentKind::Llm(LlmComponent {
                                role: Role::Decoder,
                                source,
                                bundle: name.clone(),
                                pipeline: None,
                                dtype: String::new(),
                            })
                        }
                        Some("embedder") => {
                            let own = [("precision", c.precision.is_some())];
                            let why = "an embedder (it takes the decoder's graphs)";
                            not_for(&own, why)?;
                            not_for(&decoder_keys, why)?;
                            let Some(decoder) = decoders.get(&source) else {
                                bail!("{f}: component '{name}' is an embedder of '{}', but no decoder component has that gguf; add one (role = \"decoder\") with the same source", source.display());
                            };
                            let dtype = c.dtype.clone().unwrap_or_else(|| "gguf".into());
                            if dtype != "f16" && dtype != "gguf" {
                                bail!("{f}: {ctx}.dtype = \"{dtype}\" is not an embedder table type (expected f16 or gguf)");
                            }
                            if let Some((other, _)) =
                                embedder_of.insert(decoder.clone(), (name.clone(), dtype.clone()))
                            {
                                bail!("{f}: components '{other}' and '{name}' are both embedders of '{decoder}'; give one");
                            }
                            ComponentKind::Llm(LlmComponent {
                                role: Role::Embedder,
                                source,
                                bundle: decoder.clone(),
                                pipeline: None,
                                dtype,
                            })
                        }
                        Some(r) => bail!(
                            "{f}: {ctx}.role = \"{r}\": expected decoder or embedder"
                        ),
                    }
                }
                (Some(_), Some(_)) => bail!("{f}: component '{name}': give onnx or gguf, not both"),
                (None, None) => bail!(
                    "{f}: component '{name}' has no source: give onnx = \"MODEL.onnx\" or gguf = \"MODEL.gguf\""
                ),
            };
            components.push(Component {
                name: name.clone(),
                kind,
            });
        }
        // The decoders' single-model pipelines (GGUF header read, split checked).
        for (name, c) in &raw.components {
            let comp = components
                .iter_mut()
                .find(|x| &x.name == name)
                .expect("listed");
            let ComponentKind::Llm(l) = &mut comp.kind else {
                continue;
            };
            if l.role != Role::Decoder {
                continue;
            }
            let embedder = embedder_of.get(name);
            let ar = c.ar.clone().ok_or_else(|| {
                anyhow!(
                    "{f}: components.{name}.ar is missing (AR variants, e.g. ar = [1, 32, 128])"
                )
            })?;
            let ctx = c.ctx.clone().ok_or_else(|| {
                anyhow!("{f}: components.{name}.ctx is missing (contexts, e.g. ctx = [512])")
            })?;
            let pf = PipelineFile {
                model: ModelSection {
                    gguf: c.gguf.clone(),
                    onnx: None,
                    tokenizer: None,
                },
                graphs: GraphsSection {
                    ar,
                    ctx,
                    sha: c.sha.unwrap_or(false),
                },
                split: SplitSection {
                    parts: c.parts,
                    max_part_bytes: c.max_part_bytes,
                    precision: c.precision.clone(),
                    part_precision: None,
                    embedder: embedder.is_some(),
                    embedder_dtype: embedder.map(|(_, d)| d.clone()),
                },
                test: TestSection {
                    prompts: c.prompts.clone().unwrap_or_default(),
                    max_tokens: c.max_tokens,
                },
                target: TargetSection {
                    max_graph_bytes: raw.target.max_graph_bytes,
                    max_context_bytes: raw.target.max_context_bytes,
                },
            };
            let p = Pipeline::from_raw(
                file,
                pf,
                l.source.clone(),
                None,
                &format!("components.{name}"),
            )
            .with_context(|| format!("component '{name}'"))?;
            l.pipeline = Some(Box::new(p));
        }
        let mut connections = vec![];
        for (i, c) in raw.connections.iter().enumerate() {
            let from = endpoint(&c.from, &format!("connections[{i}].from"), &f)?;
            let to = endpoint(&c.to, &format!("connections[{i}].to"), &f)?;
            for (key, e) in [("from", &from), ("to", &to)] {
                if !components.iter().any(|x| x.name == e.component) {
                    bail!(
                        "{f}: connections[{i}].{key} = \"{e}\": no component '{}' (components: {})",
                        e.component,
                        components
                            .iter()
                            .map(|x| x.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
            }
            connections.push(Connection { from, to });
        }
        Ok(ComponentsPipeline {
            file: file.to_path_buf(),
            components,
            connections,
        })
    }

    /// The component named `name`.
    pub fn component(&self, name: &str) -> Option<&Component> {
        self.components.iter().find(|c| c.name == name)
    }
}

/// The default bar of the SQNR check (dB). Why 10: the check is there to catch a broken
/// quantization (wrong ranges, a mis-lowered op: SQNR near or below 0 dB), not to grade a
/// good one; 8-bit activations through a 12-block ViT land at 15-25 dB on real images.
pub const DEFAULT_MIN_SQNR_DB: f64 = 10.0;

fn calibration(cal: &CalibrationRaw, f: &str, ctx: &str, base: &Path) -> Result<Calibration> {
    let ctx = format!("{ctx}.calibration");
    let images = match (&cal.images, cal.synthetic) {
        (Some(d), None) => {
            let p = resolve_path(d, base);
            if !p.is_dir() {
                bail!(
                    "{f}: {ctx}.images = \"{d}\": no such folder '{}'",
                    p.display()
                );
            }
            ImageSet::Folder(p)
        }
        (None, Some(0)) => bail!("{f}: {ctx}.synthetic = 0; give at least 2 images"),
        (None, Some(n)) => ImageSet::Synthetic(n),
        (Some(_), Some(_)) => bail!("{f}: {ctx}: give images = \"DIR\" or synthetic = N, not both"),
        (None, None) => bail!("{f}: {ctx} needs images = \"DIR\" or synthetic = N"),
    };
    let [h, w] = cal.resize;
    if h == 0 || w == 0 {
        bail!("{f}: {ctx}.resize = [{h}, {w}]: give a size of at least [1, 1]");
    }
    let layout = cal.layout.as_deref().unwrap_or("nchw");
    let order = cal.channel_order.as_deref().unwrap_or("rgb");
    let preprocess = ImagePreprocess {
        size: (h, w),
        mean: three(&cal.mean, "mean", 0.0, &format!("{f}: {ctx}"))?,
        std: three(&cal.std, "std", 1.0, &format!("{f}: {ctx}"))?,
        scale: cal.scale.unwrap_or(1.0 / 255.0),
        nchw: match layout {
            "nchw" => true,
            "nhwc" => false,
            l => bail!("{f}: {ctx}.layout = \"{l}\": expected nchw or nhwc"),
        },
        bgr: match order {
            "rgb" => false,
            "bgr" => true,
            o => bail!("{f}: {ctx}.channel_order = \"{o}\": expected rgb or bgr"),
        },
    };
    if preprocess.std.contains(&0.0) {
        bail!("{f}: {ctx}.std contains 0");
    }
    let skip_unreadable = match cal.unreadable.as_deref() {
        None | Some("fail") => false,
        Some("skip") => true,
        Some(o) => bail!("{f}: {ctx}.unreadable = \"{o}\": expected fail or skip"),
    };
    let method = cal.method.clone().unwrap_or_else(|| "minmax".into());
    npuc_quant::CalibMethod::parse(&method, 99.99)
        .map_err(|e| anyhow!("{f}: {ctx}.method = \"{method}\": {e}"))?;
    Ok(Calibration {
        images,
        preprocess,
        heldout: cal.heldout.unwrap_or(2),
        skip_unreadable,
        method,
    })
}

/// Readable images, and skipped ones with the reason.
pub type ImageList = (Vec<PathBuf>, Vec<(PathBuf, String)>);

/// The images of a calibration folder, sorted, each decoded and preprocessed once here (so an
/// unreadable file is found before any step runs): `(readable, skipped with the reason)`.
/// Fails naming the component and the file when a file is unreadable and `skip_unreadable` is
/// off, or when fewer than `heldout + 1` images remain.
pub fn calibration_images(component: &str, dir: &Path, cal: &Calibration) -> Result<ImageList> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("component '{component}': reading '{}'", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let (mut good, mut skipped) = (vec![], vec![]);
    for p in files {
        let is_image = matches!(
            p.extension()
                .and_then(|e| e.to_str())
                .map(|e| e.to_ascii_lowercase())
                .as_deref(),
            Some("png" | "jpg" | "jpeg")
        );
        if !is_image {
            continue;
        }
        match npuc_quant::calib::load_image(&p, &cal.preprocess) {
            Ok(_) => good.push(p),
            Err(e) => {
                let why = format!("{e:#}");
                if !cal.skip_unreadable {
                    bail!(
                        "component '{component}': calibration image '{}' is unreadable ({why}); remove it, or set calibration.unreadable = \"skip\" to skip such files",
                        p.display()
                    );
                }
                skipped.push((p, why));
            }
        }
    }
    if good.len() < cal.heldout + 1 {
        bail!(
            "component '{component}': '{}' has {} readable image(s); calibration needs at least heldout + 1 = {}",
            dir.display(),
            good.len(),
            cal.heldout + 1
        );
    }
    Ok((good, skipped))
}
