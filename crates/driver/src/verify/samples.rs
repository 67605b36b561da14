//! Loading the held-out input samples for `npuc verify` from a directory of `.npy` files.
//!
//! Layout (the calibration-set rules): a sub-folder per input name holding that input's samples,
//! or files named `<input>_*.npy`; for a single-input model, every `.npy` in the directory. Files
//! are taken in sorted order, so sample `i` is the `i`-th file of every input.

use anyhow::{anyhow, bail, Context, Result};
use npuc_ir::{DType, Dim, Tensor, TypeInfo, ValueInfo};
use std::path::{Path, PathBuf};

/// One sample: a tensor per model input, in the model's input order.
pub type Sample = Vec<(String, Tensor)>;

fn npy_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).with_context(|| format!("reading '{}'", dir.display()))?;
    let mut v = vec![];
    for e in rd {
        let p = e
            .with_context(|| format!("reading '{}'", dir.display()))?
            .path();
        if p.is_file() && p.extension().and_then(|e| e.to_str()) == Some("npy") {
            v.push(p);
        }
    }
    v.sort();
    Ok(v)
}

/// The files of each input (outer: model input order), by the layout rules above.
fn files_per_input(dir: &Path, inputs: &[&ValueInfo]) -> Result<Vec<Vec<PathBuf>>> {
    if !dir.is_dir() {
        bail!(
            "--inputs '{}' is not a directory of .npy files",
            dir.display()
        );
    }
    let all = npy_files(dir)?;
    let mut per = vec![];
    for vi in inputs {
        let sub = dir.join(&vi.name);
        let files = if sub.is_dir() {
            npy_files(&sub)?
        } else {
            let prefix = format!("{}_", vi.name);
            let pref: Vec<PathBuf> = all
                .iter()
                .filter(|p| {
                    p.file_name()
                        .and_then(|f| f.to_str())
                        .is_some_and(|f| f.starts_with(&prefix))
                })
                .cloned()
                .collect();
            if pref.is_empty() && inputs.len() == 1 {
                all.clone()
            } else {
                pref
            }
        };
        if files.is_empty() {
            bail!(
                "--inputs '{}': no .npy samples for input '{}' (expected a sub-folder '{}/' or files '{}_*.npy'{})",
                dir.display(),
                vi.name,
                vi.name,
                vi.name,
                if inputs.len() == 1 { ", or any .npy in the directory" } else { "" }
            );
        }
        per.push(files);
    }
    if let Some(first) = per.first() {
        for (vi, f) in inputs.iter().zip(&per) {
            if f.len() != first.len() {
                bail!(
                    "--inputs '{}': input '{}' has {} samples but '{}' has {}; every input needs one file per sample",
                    dir.display(),
                    vi.name,
                    f.len(),
                    inputs[0].name,
                    first.len()
                );
            }
        }
    }
    Ok(per)
}

/// Checks a sample file against the input's declared dtype and shape, and rejects NaN/Inf.
fn check(path: &Path, vi: &ValueInfo, t: &Tensor) -> Result<()> {
    if let Some(TypeInfo::Tensor { dtype, shape }) = &vi.ty {
        if let Some(dt) = dtype {
            if *dt != t.dtype() {
                bail!(
                    "'{}': dtype {} but input '{}' expects {}",
                    path.display(),
                    t.dtype(),
                    vi.name,
                    dt
                );
            }
        }
        if let Some(dims) = shape {
            let fits = dims.len() == t.rank()
                && dims.iter().zip(t.shape()).all(|(d, n)| match d {
                    Dim::Fixed(f) => f == n,
                    _ => true,
                });
            if !fits {
                bail!(
                    "'{}': shape {:?} but input '{}' expects {}",
                    path.display(),
                    t.shape(),
                    vi.name,
                    vi.ty.as_ref().map(|t| t.describe()).unwrap_or_default()
                );
            }
        }
    }
    if t.dtype().is_float() {
        let v = t
            .to_f64_vec()
            .map_err(|e| anyhow!("'{}': {e}", path.display()))?;
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            bail!(
                "'{}': element {i} is {} (input '{}'); samples must be finite",
                path.display(),
                v[i],
                vi.name
            );
        }
    }
    Ok(())
}

/// Loads every sample in `dir` for the given model inputs, checked against their declared types.
pub fn load_samples(dir: &Path, inputs: &[&ValueInfo]) -> Result<Vec<Sample>> {
    if inputs.is_empty() {
        bail!("the model has no inputs to feed");
    }
    let per = files_per_input(dir, inputs)?;
    let n = per[0].len();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut s = Vec::with_capacity(inputs.len());
        for (vi, files) in inputs.iter().zip(&per) {
            let p = &files[i];
            let t = npuc_npy::read_npy(p).map_err(|e| anyhow!("'{}': {e}", p.display()))?;
            check(p, vi, &t)?;
            s.push((vi.name.clone(), t));
        }
        out.push(s);
    }
    Ok(out)
}

/// Whether values of this dtype are compared (float tensors only).
pub fn comparable(dt: DType) -> bool {
    dt.is_float()
}
