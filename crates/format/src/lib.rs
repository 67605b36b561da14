//! The `.npuc` artifact ("context binary"): one file holding several named graphs that share
//! one copy of their weights, loaded by mmap. Layout and compatibility rules: docs/FORMAT.md.
//!
//! ```text
//! [header 64 B][section table: count x 40 B][META json][pad to 4096][WEIGHTS: 64-B aligned blobs]
//! ```

mod desc;

pub use desc::*;

use npuc_ir::{Backing, DType, Model, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

pub const MAGIC: [u8; 8] = *b"NPUCBIN\0";
/// Readers refuse a higher major version; any minor version of a known major is readable
/// (newer minors only add optional META fields and section kinds, which readers skip).
pub const FORMAT_MAJOR: u16 = 1;
pub const FORMAT_MINOR: u16 = 0;
pub const HEADER_LEN: usize = 64;
pub const SECTION_ENTRY_LEN: usize = 40;
pub const WEIGHT_ALIGN: usize = 64;
pub const PAGE: usize = 4096;

pub const SECTION_META: u32 = 1;
pub const SECTION_WEIGHTS: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("cannot access '{path}': {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("'{path}' is not an npuc artifact (bad magic {found:?}); compile a model with `npuc compile`")]
    Magic { path: PathBuf, found: Vec<u8> },
    #[error("'{path}' uses format version {major}.{minor}, newer than this npuc reads ({FORMAT_MAJOR}.x); upgrade npuc or recompile the model with this version")]
    Version {
        path: PathBuf,
        major: u16,
        minor: u16,
    },
    #[error("'{path}' is corrupt: {what} (offset {offset}); recompile it or restore the file")]
    Corrupt {
        path: PathBuf,
        what: String,
        offset: u64,
    },
    #[error("'{path}' was compiled for target '{found}', this machine is '{expected}'{detail}; recompile with `npuc compile --target {expected}`")]
    Target {
        path: PathBuf,
        found: String,
        expected: String,
        detail: String,
    },
    #[error("'{path}' has no graph named '{name}'; it has: {available}")]
    NoGraph {
        path: PathBuf,
        name: String,
        available: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Ir(#[from] npuc_ir::IrError),
}

/// A compilation target: the CPU architecture and the features its pre-packed weights assume.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Target {
    pub name: String,
    pub arch: String,
    pub features: Vec<String>,
}

impl Target {
    /// The target for this machine's architecture with the features npuc's kernels use.
    pub fn host() -> Target {
        let arch = std::env::consts::ARCH.to_string();
        // The kernels' pre-packed layouts assume AVX2+FMA at most (no AVX-512 layout yet).
        let features = if npuc_isa::Isa::host().has_avx2() {
            vec!["avx2".into(), "fma".into()]
        } else {
            vec![]
        };
        Target::from_parts(arch, features)
    }

    fn from_parts(arch: String, features: Vec<String>) -> Target {
        let name = if features.is_empty() {
            format!("cpu-{arch}")
        } else {
            format!("cpu-{arch}-{}", features[0])
        };
        Target {
            name,
            arch,
            features,
        }
    }

    /// Parses `cpu-x86_64`, `cpu-x86_64-avx2`, `cpu-aarch64`.
    pub fn parse(s: &str) -> Result<Target, FormatError> {
        let known = "cpu-x86_64, cpu-x86_64-avx2, cpu-aarch64";
        let rest = s
            .strip_prefix("cpu-")
            .ok_or_else(|| FormatError::Invalid(format!("unknown target '{s}'; known: {known}")))?;
        let (arch, feat) = match rest {
            "x86_64" => ("x86_64", vec![]),
            "x86_64-avx2" => ("x86_64", vec!["avx2".to_string(), "fma".to_string()]),
            "aarch64" => ("aarch64", vec![]),
            _ => {
                return Err(FormatError::Invalid(format!(
                    "unknown target '{s}'; known: {known}"
                )))
            }
        };
        Ok(Target::from_parts(arch.into(), feat))
    }

    /// Whether this machine can run weights packed for `self`; an explanation if not.
    pub fn runnable_here(&self) -> Result<(), String> {
        if self.arch != std::env::consts::ARCH {
            return Err(format!(
                " (architecture {} vs {})",
                self.arch,
                std::env::consts::ARCH
            ));
        }
        let host = Target::host();
        let missing: Vec<&String> = self
            .features
            .iter()
            .filter(|f| !host.features.contains(f))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                " (the CPU lacks {})",
                missing
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Ok(())
    }
}

/// Builds an artifact: add graphs, then `write`. Weights with identical bytes, dtype and shape
/// are stored once, whichever graph they come from.
pub struct ArtifactWriter {
    meta: Meta,
    blob: Vec<u8>,
    by_hash: HashMap<(u128, DType, Vec<usize>), usize>,
}

impl ArtifactWriter {
    pub fn new(target: Target, options: serde_json::Value) -> ArtifactWriter {
        ArtifactWriter {
            meta: Meta {
                format_major: FORMAT_MAJOR,
                format_minor: FORMAT_MINOR,
                producer: "npuc".into(),
                producer_version: env!("CARGO_PKG_VERSION").into(),
                target,
                options,
                sources: vec![],
                graphs: vec![],
                weights: vec![],
            },
            blob: vec![],
            by_hash: HashMap::new(),
        }
    }

    /// Records a source model (its name and a content hash) for provenance.
    pub fn add_source(&mut self, name: &str, bytes: &[u8]) {
        self.meta.sources.push(SourceDesc {
            name: name.into(),
            xxh3_128: format!("{:032x}", xxh3_128(bytes)),
            bytes: bytes.len() as u64,
        });
    }

    /// [`ArtifactWriter::add_source`] for a file, read in chunks (not mapped: hashing a
    /// large model does not add its pages to the caller's resident memory).
    pub fn add_source_file(
        &mut self,
        name: &str,
        path: &std::path::Path,
    ) -> Result<(), FormatError> {
        use std::io::Read;
        let io = |source| FormatError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = f.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            total += n as u64;
        }
        self.meta.sources.push(SourceDesc {
            name: name.into(),
            xxh3_128: format!("{:032x}", h.digest128()),
            bytes: total,
        });
        Ok(())
    }

    pub(crate) fn intern(&mut self, t: &Tensor) -> Result<usize, FormatError> {
        if t.dtype() == DType::String {
            let strings = t.as_strings()?.to_vec();
            self.meta.weights.push(WeightDesc {
                dtype: t.dtype().name().into(),
                shape: t.shape().to_vec(),
                offset: 0,
                len: 0,
                xxh3: 0,
                strings: Some(strings),
            });
            return Ok(self.meta.weights.len() - 1);
        }
        // Borrowed where the tensor's data already is bytes (no transient copy of a weight).
        let bytes = t.le_bytes()?;
        let key = (xxh3_128(&bytes), t.dtype(), t.shape().to_vec());
        if let Some(&i) = self.by_hash.get(&key) {
            let w = &self.meta.weights[i];
            if self.blob[w.offset as usize..(w.offset + w.len) as usize] == bytes[..] {
                return Ok(i);
            }
        }
        let offset = self.blob.len().next_multiple_of(WEIGHT_ALIGN);
        self.blob.resize(offset, 0);
        self.blob.extend_from_slice(&bytes);
        self.meta.weights.push(WeightDesc {
            dtype: t.dtype().name().into(),
            shape: t.shape().to_vec(),
            offset: offset as u64,
            len: bytes.len() as u64,
            xxh3: xxh3_64(&bytes),
            strings: None,
        });
        let i = self.meta.weights.len() - 1;
        self.by_hash.insert(key, i);
        Ok(i)
    }

    /// Adds a model's main graph under `name`, with extra per-graph facts in `info`.
    pub fn add_graph(&mut self, name: &str, m: &Model, info: GraphInfo) -> Result<(), FormatError> {
        if self.meta.graphs.iter().any(|g| g.name == name) {
            return Err(FormatError::Invalid(format!(
                "two graphs are named '{name}'; name them with --name"
            )));
        }
        let g = desc::graph_desc(self, name, m, info)?;
        self.meta.graphs.push(g);
        Ok(())
    }

    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// Serialises the artifact. Deterministic: equal inputs give identical bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, FormatError> {
        let mut out = self.head()?;
        out.extend_from_slice(&self.blob);
        Ok(out)
    }

    /// The artifact's bytes before its weights (header, section table, META, padding): the
    /// weights follow as they are in `blob`.
    fn head(&self) -> Result<Vec<u8>, FormatError> {
        let meta =
            serde_json::to_vec(&self.meta).map_err(|e| FormatError::Invalid(e.to_string()))?;
        let n_sections = 2usize;
        let table_off = HEADER_LEN;
        let meta_off = table_off + n_sections * SECTION_ENTRY_LEN;
        let weights_off = (meta_off + meta.len()).next_multiple_of(PAGE);
        let total = weights_off + self.blob.len();
        let mut out = vec![0u8; weights_off];
        out[meta_off..meta_off + meta.len()].copy_from_slice(&meta);
        let sections = [
            (SECTION_META, meta_off, meta.len(), 1u32),
            (SECTION_WEIGHTS, weights_off, self.blob.len(), PAGE as u32),
        ];
        for (i, (kind, off, len, align)) in sections.iter().enumerate() {
            let e = table_off + i * SECTION_ENTRY_LEN;
            // Weights are checksummed per tensor (verified lazily); the section entry's checksum
            // covers META only, which every load verifies.
            let sum = if *kind == SECTION_META {
                xxh3_64(&out[*off..*off + *len])
            } else {
                0
            };
            out[e..e + 4].copy_from_slice(&kind.to_le_bytes());
            out[e + 4..e + 8].copy_from_slice(&align.to_le_bytes());
            out[e + 8..e + 16].copy_from_slice(&(*off as u64).to_le_bytes());
            out[e + 16..e + 24].copy_from_slice(&(*len as u64).to_le_bytes());
            out[e + 24..e + 32].copy_from_slice(&sum.to_le_bytes());
        }
        out[0..8].copy_from_slice(&MAGIC);
        out[8..10].copy_from_slice(&FORMAT_MAJOR.to_le_bytes());
        out[10..12].copy_from_slice(&FORMAT_MINOR.to_le_bytes());
        out[16..20].copy_from_slice(&(n_sections as u32).to_le_bytes());
        out[24..32].copy_from_slice(&(table_off as u64).to_le_bytes());
        out[32..40].copy_from_slice(&(total as u64).to_le_bytes());
        let hsum = header_checksum(&out[..HEADER_LEN], &out[table_off..meta_off]);
        out[40..48].copy_from_slice(&hsum.to_le_bytes());
        Ok(out)
    }

    /// Writes atomically: a temp file next to `path`, fsync, rename. An interrupted write
    /// never leaves a partial artifact at `path`. Streams the weights from `blob` (no second
    /// copy of them in memory: for an LLM part, hundreds of MB less at its peak).
    pub fn write(&self, path: &Path) -> Result<u64, FormatError> {
        let head = self.head()?;
        persist_atomic_parts(path, &[&head, &self.blob]).map_err(|e| FormatError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        Ok((head.len() + self.blob.len()) as u64)
    }
}

/// Checksum of the header (with its checksum field zeroed) and the section table.
fn header_checksum(header: &[u8], table: &[u8]) -> u64 {
    let mut h = header.to_vec();
    h[40..48].fill(0);
    h.extend_from_slice(table);
    xxh3_64(&h)
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory, fsync, rename. A
/// crash or Ctrl-C leaves either the old file or the new one, never a half-written artifact.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FormatError> {
    persist_atomic(path, bytes).map_err(|e| FormatError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// [`write_atomic`] with a plain I/O error: the one atomic writer, shared by every npuc output
/// (artifacts here, ONNX and `.npy` files through `npuc_onnx::export::write_atomic`).
pub fn persist_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    persist_atomic_parts(path, &[bytes])
}

/// [`persist_atomic`] of the concatenation of `parts`.
pub fn persist_atomic_parts(path: &Path, parts: &[&[u8]]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let fname = path.file_name().and_then(|f| f.to_str()).unwrap_or("out");
    remove_stale_temps(dir, fname);
    // A hidden temp file beside the target (same filesystem, so the rename is atomic); the
    // tempfile crate removes it on any error before the rename. Its name carries this process's
    // id, so a later write can tell the leftovers of a killed writer from a live one's file.
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{fname}.tmp-{}-", std::process::id()))
        .tempfile_in(dir)?;
    for bytes in parts {
        tmp.write_all(bytes)?;
    }
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// A file written in pieces (a large model's external data, streamed tensor by tensor) that
/// appears at its path only when [`AtomicFile::commit`] succeeds: a hidden temp file beside the
/// target (named as [`persist_atomic`]'s), fsynced and renamed; dropped before the commit (an
/// error on the way) it is removed.
pub struct AtomicFile {
    path: std::path::PathBuf,
    out: std::io::BufWriter<tempfile::NamedTempFile>,
    len: u64,
}

impl AtomicFile {
    pub fn create(path: &Path) -> std::io::Result<AtomicFile> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let fname = path.file_name().and_then(|f| f.to_str()).unwrap_or("out");
        remove_stale_temps(dir, fname);
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".{fname}.tmp-{}-", std::process::id()))
            .tempfile_in(dir)?;
        Ok(AtomicFile {
            path: path.to_path_buf(),
            out: std::io::BufWriter::with_capacity(1 << 20, tmp),
            len: 0,
        })
    }

    /// Bytes written so far (the offset the next write lands at).
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        self.out.write_all(bytes)?;
        self.len += bytes.len() as u64;
        Ok(())
    }

    /// Zero bytes up to the next multiple of `align`; returns the new length.
    pub fn pad_to(&mut self, align: u64) -> std::io::Result<u64> {
        let pad = self.len.next_multiple_of(align) - self.len;
        self.write_all(&vec![0u8; pad as usize])?;
        Ok(self.len)
    }

    /// Flushes, fsyncs and renames the temp file to the path.
    pub fn commit(self) -> std::io::Result<u64> {
        let tmp = self.out.into_inner().map_err(|e| e.into_error())?;
        tmp.as_file().sync_all()?;
        tmp.persist(&self.path).map_err(|e| e.error)?;
        Ok(self.len)
    }
}

/// Removes the temp files `.{fname}.tmp-PID-*` in `dir` left by writers of the same target that
/// were killed (`kill -9`, power loss) before they could clean up: those whose process no longer
/// exists. Best effort: on systems without `/proc` nothing is removed.
fn remove_stale_temps(dir: &Path, fname: &str) {
    let proc_root = Path::new("/proc/self");
    if !proc_root.exists() {
        return;
    }
    let prefix = format!(".{fname}.tmp-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

struct MmapBacking(memmap2::Mmap);
impl Backing for MmapBacking {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}
struct VecBacking(Vec<u8>);
impl Backing for VecBacking {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// A loaded artifact: META parsed and checked, weights still in the mapping.
pub struct Artifact {
    pub path: PathBuf,
    pub meta: Meta,
    pub file_len: u64,
    data: Arc<dyn Backing>,
    weights_off: usize,
    weights_len: usize,
}

/// Whether [`Artifact::open`] checks the weights' checksums (on by default).
static VERIFY_WEIGHTS_ON_OPEN: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

/// Turns the weight checksums of [`Artifact::open`] on or off for this process (`npuc --trust`
/// turns them off when load time matters more than catching a corrupt file).
pub fn set_verify_weights_on_open(on: bool) {
    VERIFY_WEIGHTS_ON_OPEN.store(on, std::sync::atomic::Ordering::Relaxed);
}

impl Artifact {
    /// Maps and checks an artifact (header, version, section bounds, META checksum, target) and,
    /// unless the process trusts artifacts ([`set_verify_weights_on_open`]: `npuc --trust`), every
    /// weight's checksum, so a flipped bit in the weights is an error naming the tensor instead
    /// of silently different outputs.
    pub fn open(path: &Path) -> Result<Artifact, FormatError> {
        let a = Artifact::open_unverified(path)?;
        if VERIFY_WEIGHTS_ON_OPEN.load(std::sync::atomic::Ordering::Relaxed) {
            a.check_weights()?;
        }
        Ok(a)
    }

    /// [`Artifact::open`] without the weight checksums (read them with
    /// [`Artifact::verify_weights`] / [`Artifact::check_weights`]).
    pub fn open_unverified(path: &Path) -> Result<Artifact, FormatError> {
        let file = std::fs::File::open(path).map_err(|e| FormatError::Io {
            path: path.into(),
            source: e,
        })?;
        let len = file
            .metadata()
            .map_err(|e| FormatError::Io {
                path: path.into(),
                source: e,
            })?
            .len();
        let data: Arc<dyn Backing> = if len == 0 {
            Arc::new(VecBacking(vec![]))
        } else {
            // SAFETY: read-only mapping; artifacts are written by rename, never modified in place.
            let m = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| FormatError::Io {
                path: path.into(),
                source: e,
            })?;
            Arc::new(MmapBacking(m))
        };
        Artifact::from_backing(path, data, true)
    }

    /// Parses an artifact held in memory.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Artifact, FormatError> {
        Artifact::from_backing(path, Arc::new(VecBacking(bytes)), false)
    }

    fn from_backing(
        path: &Path,
        data: Arc<dyn Backing>,
        check_target: bool,
    ) -> Result<Artifact, FormatError> {
        let b = data.bytes();
        let corrupt = |what: &str, offset: u64| FormatError::Corrupt {
            path: path.into(),
            what: what.into(),
            offset,
        };
        if b.len() < 8 || b[..8] != MAGIC {
            return Err(FormatError::Magic {
                path: path.into(),
                found: b[..b.len().min(8)].to_vec(),
            });
        }
        if b.len() < HEADER_LEN {
            return Err(corrupt(
                "the file is shorter than its header (truncated)",
                b.len() as u64,
            ));
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let (major, minor) = (u16_at(8), u16_at(10));
        if major == 0 {
            // No release ever wrote major 0: this is damage, not a newer format.
            return Err(corrupt("format major version 0 is invalid", 8));
        }
        if major > FORMAT_MAJOR {
            return Err(FormatError::Version {
                path: path.into(),
                major,
                minor,
            });
        }
        let n_sections = u32_at(16) as usize;
        let table_off = u64_at(24) as usize;
        let file_len = u64_at(32);
        if file_len != b.len() as u64 {
            return Err(corrupt(
                &format!(
                    "header says the file is {file_len} bytes, it is {} (truncated or appended to)",
                    b.len()
                ),
                32,
            ));
        }
        let table_end = n_sections
            .checked_mul(SECTION_ENTRY_LEN)
            .and_then(|n| n.checked_add(table_off))
            .filter(|&e| e <= b.len() && n_sections <= 1024)
            .ok_or_else(|| corrupt("the section table lies outside the file", 24))?;
        if header_checksum(&b[..HEADER_LEN], &b[table_off..table_end]) != u64_at(40) {
            return Err(corrupt("header checksum mismatch", 40));
        }
        let mut meta_sec = None;
        let mut weights_sec = None;
        for i in 0..n_sections {
            let e = table_off + i * SECTION_ENTRY_LEN;
            let (kind, off, len, sum) = (
                u32_at(e),
                u64_at(e + 8) as usize,
                u64_at(e + 16) as usize,
                u64_at(e + 24),
            );
            if off.checked_add(len).is_none_or(|end| end > b.len()) {
                return Err(corrupt(
                    &format!("section {i} (kind {kind}) lies outside the file"),
                    e as u64,
                ));
            }
            match kind {
                SECTION_META => meta_sec = Some((off, len, sum)),
                SECTION_WEIGHTS => weights_sec = Some((off, len)),
                _ => {} // unknown kinds come from newer minor versions: skip
            }
        }
        let (moff, mlen, msum) =
            meta_sec.ok_or_else(|| corrupt("no META section", table_off as u64))?;
        let meta_bytes = &b[moff..moff + mlen];
        if xxh3_64(meta_bytes) != msum {
            return Err(corrupt("META checksum mismatch", moff as u64));
        }
        let meta: Meta = serde_json::from_slice(meta_bytes)
            .map_err(|e| corrupt(&format!("META is not valid ({e})"), moff as u64))?;
        let (woff, wlen) = weights_sec.unwrap_or((b.len(), 0));
        for (i, w) in meta.weights.iter().enumerate() {
            if w.strings.is_none() && w.offset.checked_add(w.len).is_none_or(|e| e > wlen as u64) {
                return Err(corrupt(
                    &format!("weight {i} lies outside the weights section"),
                    woff as u64 + w.offset,
                ));
            }
        }
        if check_target {
            if let Err(detail) = meta.target.runnable_here() {
                return Err(FormatError::Target {
                    path: path.into(),
                    found: meta.target.name.clone(),
                    expected: Target::host().name,
                    detail,
                });
            }
        }
        Ok(Artifact {
            path: path.into(),
            meta,
            file_len,
            data,
            weights_off: woff,
            weights_len: wlen,
        })
    }

    pub fn graph_names(&self) -> Vec<&str> {
        self.meta.graphs.iter().map(|g| g.name.as_str()).collect()
    }

    /// The graph `name` (or the only/first graph when `None`) as an IR model whose weights
    /// borrow from the mapping.
    pub fn model(&self, name: Option<&str>) -> Result<Model, FormatError> {
        let g = match name {
            Some(n) => self
                .meta
                .graphs
                .iter()
                .find(|g| g.name == n)
                .ok_or_else(|| FormatError::NoGraph {
                    path: self.path.clone(),
                    name: n.into(),
                    available: self.graph_names().join(", "),
                })?,
            None => self.meta.graphs.first().ok_or_else(|| {
                FormatError::Invalid(format!("'{}' holds no graphs", self.path.display()))
            })?,
        };
        desc::model_from_desc(self, g)
    }

    pub(crate) fn weight(&self, i: usize) -> Result<Tensor, FormatError> {
        let w = self
            .meta
            .weights
            .get(i)
            .ok_or_else(|| FormatError::Corrupt {
                path: self.path.clone(),
                what: format!("reference to weight {i}, which does not exist"),
                offset: 0,
            })?;
        let dtype = DType::from_name(&w.dtype).ok_or_else(|| FormatError::Corrupt {
            path: self.path.clone(),
            what: format!("weight {i} has unknown dtype '{}'", w.dtype),
            offset: 0,
        })?;
        // META is checksummed, not trusted: an element count that overflows would wrap (or
        // panic) in the IR's shape arithmetic, so refuse it here.
        if w.shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.size().max(1)))
            .is_none()
        {
            return Err(FormatError::Corrupt {
                path: self.path.clone(),
                what: format!("weight {i} has an impossible shape {:?}", w.shape),
                offset: 0,
            });
        }
        if let Some(s) = &w.strings {
            return Tensor::from_strings(w.shape.clone(), s.clone()).map_err(|e| {
                FormatError::Corrupt {
                    path: self.path.clone(),
                    what: format!("weight {i}: {e}"),
                    offset: 0,
                }
            });
        }
        let off = self.weights_off + w.offset as usize;
        if dtype.packed_bits() < 8 {
            // Sub-byte types (4- and 2-bit integers, 4-bit floats) are stored one code per byte.
            let bytes = self.data.bytes()[off..off + w.len as usize].to_vec();
            return Tensor::from_codes(dtype, w.shape.clone(), bytes).map_err(|e| {
                FormatError::Corrupt {
                    path: self.path.clone(),
                    what: format!("weight {i}: {e}"),
                    offset: off as u64,
                }
            });
        }
        Tensor::from_le_bytes(
            dtype,
            w.shape.clone(),
            self.data.clone(),
            off,
            w.len as usize,
        )
        .map_err(|e| FormatError::Corrupt {
            path: self.path.clone(),
            what: format!("weight {i}: {e}"),
            offset: off as u64,
        })
    }

    /// Checks every weight's checksum; returns the indices of corrupt ones.
    pub fn verify_weights(&self) -> Vec<usize> {
        let b = self.data.bytes();
        self.meta
            .weights
            .iter()
            .enumerate()
            .filter(|(_, w)| w.strings.is_none())
            .filter(|(_, w)| {
                let off = self.weights_off + w.offset as usize;
                xxh3_64(&b[off..off + w.len as usize]) != w.xxh3
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// Fails when any weight fails its checksum, naming the first corrupt ones by the graph
    /// initializers stored in them and their offsets.
    pub fn check_weights(&self) -> Result<(), FormatError> {
        let bad = self.verify_weights();
        let Some(&first) = bad.first() else {
            return Ok(());
        };
        let named: Vec<String> = bad
            .iter()
            .take(3)
            .map(|&i| {
                let names = self.weight_names(i);
                if names.is_empty() {
                    format!("weight #{i}")
                } else {
                    format!("weight #{i} ({})", names.join(", "))
                }
            })
            .collect();
        let more = if bad.len() > 3 {
            format!(" and {} more", bad.len() - 3)
        } else {
            String::new()
        };
        Err(FormatError::Corrupt {
            path: self.path.clone(),
            what: format!(
                "{}{more} fail their checksum (pass --trust to skip this check)",
                named.join("; ")
            ),
            offset: (self.weights_off as u64) + self.meta.weights[first].offset,
        })
    }

    /// The graph initializers (`graph/name`) stored in weight `i`, top-level graphs only.
    pub fn weight_names(&self, i: usize) -> Vec<String> {
        self.meta
            .graphs
            .iter()
            .flat_map(|g| {
                g.body
                    .initializers
                    .iter()
                    .filter(move |(_, w)| *w == i)
                    .map(move |(n, _)| format!("{}/{n}", g.name))
            })
            .collect()
    }

    pub fn weights_bytes(&self) -> usize {
        self.weights_len
    }
}
