//! Calibration sources: a directory of `.npy` files, a QNN `input_list.txt` of `.raw` files, or a
//! folder of images with a preprocessing spec. Samples are listed up front (cheap) and loaded one
//! at a time, so a calibration set never has to fit in memory.

use crate::qdq::Sample;
use anyhow::{anyhow, bail, Context, Result};
use npuc_ir::{DType, Dim, Tensor, TypeInfo, ValueInfo};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Image preprocessing: resize to `size` (H, W), `x * scale`, then `(x - mean) / std` per
/// channel, in `rgb`/`bgr` order and `nchw`/`nhwc` layout, with a leading batch dimension of 1.
#[derive(Clone, Debug, PartialEq)]
pub struct ImagePreprocess {
    /// Output height and width.
    pub size: (usize, usize),
    /// Per-channel mean (after `scale`), in output channel order.
    pub mean: [f32; 3],
    /// Per-channel standard deviation, in output channel order.
    pub std: [f32; 3],
    /// Multiplier applied to the 0..255 pixel values first (default 1/255).
    pub scale: f32,
    /// `true` = NCHW, `false` = NHWC.
    pub nchw: bool,
    /// `true` = channels in BGR order.
    pub bgr: bool,
}

impl Default for ImagePreprocess {
    fn default() -> Self {
        ImagePreprocess {
            size: (224, 224),
            mean: [0.0; 3],
            std: [1.0; 3],
            scale: 1.0 / 255.0,
            nchw: true,
            bgr: false,
        }
    }
}

/// Where calibration samples come from.
#[derive(Clone, Debug)]
pub enum CalibSource {
    /// `.npy` files: `DIR/<input>/*.npy`, `DIR/<input>_*.npy`, `DIR/<input>.N.npy`, or (one-input
    /// models) any `DIR/*.npy`.
    NpyDir(PathBuf),
    /// QNN input list: one sample per line, `name:=path name2:=path2` or plain paths in input
    /// order; `.raw` files hold the input's bound shape in its dtype, little-endian.
    InputList(PathBuf),
    /// A folder of PNG/JPEG images for a single image input.
    Images(PathBuf, ImagePreprocess),
}

/// A listed sample: per input, its file.
#[derive(Clone, Debug)]
pub struct SampleFiles {
    /// Label (first file).
    pub label: String,
    /// `(input name, file)`.
    pub files: Vec<(String, PathBuf)>,
}

fn is_image(p: &Path) -> bool {
    matches!(
        p.extension()
            .and_then(|e| e.to_str())
            .map(|e| e.to_ascii_lowercase())
            .as_deref(),
        Some("png" | "jpg" | "jpeg")
    )
}

impl CalibSource {
    /// Picks the source kind for `path`: a `.txt` file is an input list; a directory holding
    /// images (and no `.npy`) is an image folder when `pre` is given; otherwise `.npy` files.
    pub fn detect(path: &Path, pre: Option<ImagePreprocess>) -> Result<CalibSource> {
        if path.is_file() {
            return Ok(CalibSource::InputList(path.to_path_buf()));
        }
        if !path.is_dir() {
            bail!("calibration source {} does not exist", path.display());
        }
        let files = list_dir(path)?;
        let has_npy = files
            .iter()
            .any(|f| f.extension().is_some_and(|e| e == "npy"))
            || files.iter().any(|f| f.is_dir());
        let has_img = files.iter().any(|f| is_image(f));
        match pre {
            Some(p) if has_img && !has_npy => Ok(CalibSource::Images(path.to_path_buf(), p)),
            _ if has_img && !has_npy => bail!(
                "{} holds images: give the preprocessing with --image-size H,W (and --mean/--std/--layout/--channel-order as the model expects)",
                path.display()
            ),
            _ => Ok(CalibSource::NpyDir(path.to_path_buf())),
        }
    }

    /// Lists the samples for a model with `inputs` (the inputs to feed), at most `max`.
    pub fn list(&self, inputs: &[ValueInfo], max: Option<usize>) -> Result<Vec<SampleFiles>> {
        let mut out = match self {
            CalibSource::NpyDir(d) => list_npy(d, inputs)?,
            CalibSource::InputList(f) => list_input_list(f, inputs)?,
            CalibSource::Images(d, _) => {
                if inputs.len() != 1 {
                    bail!(
                        "image calibration needs a model with one input, this one has {}",
                        inputs.len()
                    );
                }
                list_dir(d)?
                    .into_iter()
                    .filter(|p| is_image(p))
                    .map(|p| SampleFiles {
                        label: p.display().to_string(),
                        files: vec![(inputs[0].name.clone(), p)],
                    })
                    .collect()
            }
        };
        if out.is_empty() {
            bail!(
                "the calibration set is empty: no sample found in {}",
                self.path().display()
            );
        }
        if let Some(m) = max {
            out.truncate(m.max(1));
        }
        Ok(out)
    }

    /// The file or folder given.
    pub fn path(&self) -> &Path {
        match self {
            CalibSource::NpyDir(p) | CalibSource::InputList(p) | CalibSource::Images(p, _) => p,
        }
    }

    /// Loads one listed sample and checks every tensor against its input's declared type.
    pub fn load(&self, s: &SampleFiles, inputs: &[ValueInfo]) -> Result<Sample> {
        let mut feeds = vec![];
        for (name, file) in &s.files {
            let vi = inputs
                .iter()
                .find(|v| &v.name == name)
                .ok_or_else(|| anyhow!("the model has no input '{name}'"))?;
            let t = match self {
                CalibSource::NpyDir(_) => npuc_npy::read_npy(file)?,
                CalibSource::InputList(_) => read_raw(file, vi)?,
                CalibSource::Images(_, pre) => load_image(file, pre)?,
            };
            check_type(&t, vi, file)?;
            feeds.push((name.clone(), t));
        }
        Ok(Sample {
            label: s.label.clone(),
            feeds,
        })
    }
}

fn list_dir(d: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(d)
        .with_context(|| format!("reading {}", d.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    v.sort();
    Ok(v)
}

fn list_npy(d: &Path, inputs: &[ValueInfo]) -> Result<Vec<SampleFiles>> {
    let entries = list_dir(d)?;
    let npys: Vec<&PathBuf> = entries
        .iter()
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "npy"))
        .collect();
    let mut per: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for vi in inputs {
        let sub = d.join(&vi.name);
        let mut files: Vec<PathBuf> = if sub.is_dir() {
            list_dir(&sub)?
                .into_iter()
                .filter(|p| p.extension().is_some_and(|e| e == "npy"))
                .collect()
        } else {
            npys.iter()
                .filter(|p| {
                    let f = p.file_name().and_then(|f| f.to_str()).unwrap_or("");
                    f.starts_with(&format!("{}_", vi.name))
                        || f.starts_with(&format!("{}.", vi.name))
                })
                .map(|p| p.to_path_buf())
                .collect()
        };
        if files.is_empty() && inputs.len() == 1 {
            files = npys.iter().map(|p| p.to_path_buf()).collect();
        }
        files.sort();
        per.insert(vi.name.clone(), files);
    }
    let counts: Vec<(String, usize)> = per.iter().map(|(k, v)| (k.clone(), v.len())).collect();
    let n = counts.iter().map(|c| c.1).min().unwrap_or(0);
    if counts.iter().any(|c| c.1 != n) {
        bail!(
            "{}: inputs have different numbers of calibration files ({}); give each input the same number",
            d.display(),
            counts.iter().map(|(k, c)| format!("{k}: {c}")).collect::<Vec<_>>().join(", ")
        );
    }
    Ok((0..n)
        .map(|i| SampleFiles {
            label: per
                .values()
                .next()
                .map(|v| v[i].display().to_string())
                .unwrap_or_default(),
            files: per.iter().map(|(k, v)| (k.clone(), v[i].clone())).collect(),
        })
        .collect())
}

fn list_input_list(f: &Path, inputs: &[ValueInfo]) -> Result<Vec<SampleFiles>> {
    let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
    let base = f.parent().unwrap_or(Path::new("."));
    let mut out = vec![];
    for (ln, line) in text.lines().enumerate() {
        let line = line.trim();
        // QNN lists may start with a `#` line naming outputs to keep.
        if line.is_empty() || line.starts_with('#') || line.starts_with('%') {
            continue;
        }
        let parts: Vec<&str> = line.split_whitespace().collect();
        let mut files = vec![];
        for (i, p) in parts.iter().enumerate() {
            let (name, path) = match p.split_once(":=") {
                Some((n, path)) => (n.to_string(), path),
                None => (
                    inputs.get(i).map(|v| v.name.clone()).ok_or_else(|| {
                        anyhow!(
                            "{}:{}: {} files given, the model has {} inputs",
                            f.display(),
                            ln + 1,
                            parts.len(),
                            inputs.len()
                        )
                    })?,
                    *p,
                ),
            };
            if !inputs.iter().any(|v| v.name == name) {
                bail!(
                    "{}:{}: the model has no input '{name}'",
                    f.display(),
                    ln + 1
                );
            }
            let pb = PathBuf::from(path);
            files.push((name, if pb.is_absolute() { pb } else { base.join(pb) }));
        }
        if files.len() != inputs.len() {
            bail!(
                "{}:{}: {} inputs given, the model needs {}",
                f.display(),
                ln + 1,
                files.len(),
                inputs.len()
            );
        }
        out.push(SampleFiles {
            label: format!("{}:{} ({})", f.display(), ln + 1, files[0].1.display()),
            files,
        });
    }
    Ok(out)
}

fn fixed_shape(vi: &ValueInfo) -> Option<Vec<usize>> {
    vi.dims()?
        .iter()
        .map(|d| {
            if let Dim::Fixed(n) = d {
                Some(*n)
            } else {
                None
            }
        })
        .collect()
}

fn read_raw(file: &Path, vi: &ValueInfo) -> Result<Tensor> {
    let shape = fixed_shape(vi).ok_or_else(|| {
        anyhow!(
            "{}: .raw inputs need the static shape of input '{}'; bind it with --input-shape",
            file.display(),
            vi.name
        )
    })?;
    let dt = vi.dtype().unwrap_or(DType::F32);
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let want = npuc_ir::checked_numel(&shape)
        .and_then(|n| n.checked_mul(dt.size()))
        .with_context(|| {
            format!(
                "{}: input '{}' shape {shape:?} overflows (more elements than addressable)",
                file.display(),
                vi.name
            )
        })?;
    if bytes.len() != want {
        bail!(
            "{}: {} bytes, but input '{}' ({} {:?}) needs {want}; wrong shape or dtype",
            file.display(),
            bytes.len(),
            vi.name,
            dt,
            shape
        );
    }
    Tensor::from_le_bytes_copy(dt, shape, &bytes).map_err(|e| anyhow!("{}: {e}", file.display()))
}

fn check_type(t: &Tensor, vi: &ValueInfo, file: &Path) -> Result<()> {
    if let Some(TypeInfo::Tensor { dtype, shape }) = &vi.ty {
        let expect = vi.ty.as_ref().map(|t| t.describe()).unwrap_or_default();
        if let Some(d) = dtype {
            if *d != t.dtype() {
                bail!(
                    "{}: dtype {} but input '{}' expects {expect}",
                    file.display(),
                    t.dtype(),
                    vi.name
                );
            }
        }
        if let Some(dims) = shape {
            let ok = dims.len() == t.rank()
                && dims
                    .iter()
                    .zip(t.shape())
                    .all(|(d, &n)| !matches!(d, Dim::Fixed(f) if *f != n));
            if !ok {
                bail!(
                    "{}: shape {:?} but input '{}' expects {expect}",
                    file.display(),
                    t.shape(),
                    vi.name
                );
            }
        }
    }
    Ok(())
}

/// Decodes and preprocesses one image (bilinear resize with half-pixel centres).
pub fn load_image(file: &Path, pre: &ImagePreprocess) -> Result<Tensor> {
    let img = image::open(file)
        .with_context(|| format!("decoding image {}", file.display()))?
        .to_rgb8();
    let (w, h) = (img.width() as usize, img.height() as usize);
    if w == 0 || h == 0 {
        bail!("{}: empty image", file.display());
    }
    let rgb = img.as_raw();
    let (oh, ow) = pre.size;
    let mut out = vec![0f32; 3 * oh * ow];
    let (sx, sy) = (w as f32 / ow as f32, h as f32 / oh as f32);
    for oy in 0..oh {
        let fy = ((oy as f32 + 0.5) * sy - 0.5).max(0.0);
        let y0 = (fy as usize).min(h - 1);
        let y1 = (y0 + 1).min(h - 1);
        let wy = fy - y0 as f32;
        for ox in 0..ow {
            let fx = ((ox as f32 + 0.5) * sx - 0.5).max(0.0);
            let x0 = (fx as usize).min(w - 1);
            let x1 = (x0 + 1).min(w - 1);
            let wx = fx - x0 as f32;
            for c in 0..3 {
                let p = |yy: usize, xx: usize| rgb[(yy * w + xx) * 3 + c] as f32;
                let v = p(y0, x0) * (1.0 - wx) * (1.0 - wy)
                    + p(y0, x1) * wx * (1.0 - wy)
                    + p(y1, x0) * (1.0 - wx) * wy
                    + p(y1, x1) * wx * wy;
                let oc = if pre.bgr { 2 - c } else { c };
                let v = (v * pre.scale - pre.mean[oc]) / pre.std[oc];
                let idx = if pre.nchw {
                    (oc * oh + oy) * ow + ox
                } else {
                    (oy * ow + ox) * 3 + oc
                };
                out[idx] = v;
            }
        }
    }
    let shape = if pre.nchw {
        vec![1, 3, oh, ow]
    } else {
        vec![1, oh, ow, 3]
    };
    Ok(Tensor::from_vec(shape, out)?)
}

/// Writes `count` deterministic synthetic RGB images (`synthetic-NNN.png`, `size` = (H, W)) into
/// `dir`: smooth colour gradients, a filled disc and stripes at places drawn from `seed`, plus
/// pixel noise, so that a calibration set covers a range of colours, edges and textures without
/// any download. The same arguments give the same bytes. Returns the files, in order.
pub fn write_synthetic_images(
    dir: &Path,
    count: usize,
    size: (usize, usize),
    seed: u64,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (h, w) = size;
    if h == 0 || w == 0 {
        bail!("synthetic images need a size of at least 1 x 1");
    }
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        // xorshift64*: a fixed sequence for a fixed seed.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut files = vec![];
    for i in 0..count {
        let c0: [f64; 3] = [next() * 255.0, next() * 255.0, next() * 255.0];
        let c1: [f64; 3] = [next() * 255.0, next() * 255.0, next() * 255.0];
        let disc: [f64; 3] = [next() * 255.0, next() * 255.0, next() * 255.0];
        let (cx, cy, r) = (
            next() * w as f64,
            next() * h as f64,
            (0.1 + 0.3 * next()) * w.min(h) as f64,
        );
        let (angle, period) = (next() * std::f64::consts::PI, 4.0 + 28.0 * next());
        let noise = 4.0 + 24.0 * next();
        let mut img = image::RgbImage::new(w as u32, h as u32);
        for y in 0..h {
            for x in 0..w {
                let t = (x + y) as f64 / (w + h) as f64;
                let stripe = ((x as f64 * angle.cos() + y as f64 * angle.sin()) / period).sin();
                let inside = (x as f64 - cx).powi(2) + (y as f64 - cy).powi(2) < r * r;
                let mut px = [0u8; 3];
                for c in 0..3 {
                    let base = if inside {
                        disc[c]
                    } else {
                        c0[c] * (1.0 - t) + c1[c] * t + 24.0 * stripe
                    };
                    px[c] = (base + (next() - 0.5) * noise).clamp(0.0, 255.0) as u8;
                }
                img.put_pixel(x as u32, y as u32, image::Rgb(px));
            }
        }
        let path = dir.join(format!("synthetic-{i:03}.png"));
        img.save_with_format(&path, image::ImageFormat::Png)
            .with_context(|| format!("writing {}", path.display()))?;
        files.push(path);
    }
    Ok(files)
}
