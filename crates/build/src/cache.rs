//! The content-addressed step cache: `CACHE/<step kind>/<key>/` holds a step's output files
//! and `record.json` (each file's size and sha256). The key is the sha256 of everything the
//! step depends on (kind, npuc version, parameters, the digests of its inputs), so an entry is
//! valid forever and a changed input simply misses.
//!
//! Crash safety: a step writes into a fresh directory under `CACHE/tmp/`, and the finished
//! directory is renamed to its key (one atomic rename), so an entry is either complete or
//! absent; a build killed at any moment leaves only `tmp/` debris, removed on the next run.
//! An entry whose files do not hash to its record (disk corruption, an edited file) is
//! reported, removed and rebuilt, never used.

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hex sha256 of a file's contents (streamed).
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f =
        std::fs::File::open(path).with_context(|| format!("reading '{}'", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading '{}'", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// Builds a step key: every field is length-prefixed, so no two field lists collide.
pub struct KeyHasher(Sha256);

impl KeyHasher {
    pub fn new(kind: &str) -> KeyHasher {
        let mut k = KeyHasher(Sha256::new());
        k.field("kind", kind);
        // Outputs of another npuc version may differ: they never share entries.
        k.field("npuc", env!("CARGO_PKG_VERSION"));
        k.field("step-schema", crate::STEP_SCHEMA);
        k
    }
    pub fn field(&mut self, name: &str, value: &str) -> &mut KeyHasher {
        for s in [name, value] {
            self.0.update((s.len() as u64).to_le_bytes());
            self.0.update(s.as_bytes());
        }
        self
    }
    pub fn finish(self) -> String {
        hex(&self.0.finalize())
    }
}

/// One output file of an entry.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileRecord {
    pub bytes: u64,
    pub sha256: String,
}

/// `record.json` of an entry.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    pub step: String,
    pub key: String,
    pub files: BTreeMap<String, FileRecord>,
}

impl Record {
    /// What downstream steps key on: the hash of every output file's hash.
    pub fn digest(&self) -> String {
        let mut k = KeyHasher(Sha256::new());
        for (name, f) in &self.files {
            k.field(name, &f.sha256);
        }
        k.finish()
    }
}

/// The result of looking an entry up.
pub enum Lookup {
    /// Complete, and every file hashes to its record.
    Hit(Record),
    /// No entry.
    Miss,
    /// An entry whose files fail their hashes (still there: [`Cache::remove`] it before
    /// rebuilding); says which file.
    Corrupt(String),
}

/// The cache directory.
#[derive(Clone, Debug)]
pub struct Cache {
    root: PathBuf,
}

impl Cache {
    /// The cache at `root` as it is, without creating or clearing anything (for `--dry-run`).
    pub fn at(root: &Path) -> Cache {
        Cache {
            root: root.to_path_buf(),
        }
    }

    /// Opens (creates) the cache at `root` and clears what interrupted builds left in `tmp/`.
    pub fn open(root: &Path) -> Result<Cache> {
        let tmp = root.join("tmp");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)
                .with_context(|| format!("clearing '{}'", tmp.display()))?;
        }
        std::fs::create_dir_all(&tmp)
            .with_context(|| format!("creating the build cache '{}'", root.display()))?;
        Ok(Cache {
            root: root.to_path_buf(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of an entry.
    pub fn entry_dir(&self, kind: &str, key: &str) -> PathBuf {
        self.root.join(kind).join(key)
    }

    /// Looks an entry up; `verify` hashes every file against the record (else sizes only).
    pub fn lookup(&self, kind: &str, key: &str, verify: bool) -> Result<Lookup> {
        let dir = self.entry_dir(kind, key);
        let rec_path = dir.join("record.json");
        if !rec_path.is_file() {
            return Ok(Lookup::Miss);
        }
        let bad = |why: String| -> Result<Lookup> { Ok(Lookup::Corrupt(why)) };
        let rec: Record = match std::fs::read(&rec_path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        {
            Ok(r) => r,
            Err(e) => return bad(format!("{}: {e}", rec_path.display())),
        };
        if rec.key != key {
            return bad(format!("{}: records key {}", rec_path.display(), rec.key));
        }
        for (name, f) in &rec.files {
            let p = dir.join(name);
            let len = std::fs::metadata(&p).map(|m| m.len()).ok();
            if len != Some(f.bytes) {
                return bad(format!(
                    "{}: {} bytes, the record says {}",
                    p.display(),
                    len.map_or("missing".into(), |l| l.to_string()),
                    f.bytes
                ));
            }
            if verify {
                let h = sha256_file(&p)?;
                if h != f.sha256 {
                    return bad(format!(
                        "{}: sha256 {h}, the record says {}",
                        p.display(),
                        f.sha256
                    ));
                }
            }
        }
        Ok(Lookup::Hit(rec))
    }

    /// A fresh directory for a step to write its outputs into.
    pub fn scratch(&self) -> Result<tempfile::TempDir> {
        tempfile::Builder::new()
            .prefix("step-")
            .tempdir_in(self.root.join("tmp"))
            .with_context(|| format!("creating a directory in '{}'", self.root.display()))
    }

    /// Records the files `names` in `scratch`, then moves it into place as the entry
    /// `kind/key` (atomic rename). Returns the record.
    pub fn commit(
        &self,
        step: &str,
        kind: &str,
        key: &str,
        scratch: tempfile::TempDir,
        names: &[&str],
    ) -> Result<Record> {
        let mut files = BTreeMap::new();
        for name in names {
            let p = scratch.path().join(name);
            let bytes = std::fs::metadata(&p)
                .with_context(|| format!("step {step} did not write '{name}'"))?
                .len();
            files.insert(
                name.to_string(),
                FileRecord {
                    bytes,
                    sha256: sha256_file(&p)?,
                },
            );
        }
        let rec = Record {
            step: step.to_string(),
            key: key.to_string(),
            files,
        };
        let json = serde_json::to_vec_pretty(&rec)?;
        write_synced(&scratch.path().join("record.json"), &json)?;
        let dest = self.entry_dir(kind, key);
        std::fs::create_dir_all(dest.parent().expect("kind dir"))?;
        if dest.exists() {
            // A stale entry that failed verification between lookup and now, or a concurrent
            // build of the same key: replace it.
            std::fs::remove_dir_all(&dest)?;
        }
        let src = scratch.keep();
        std::fs::rename(&src, &dest)
            .map_err(|e| anyhow!("moving '{}' to '{}': {e}", src.display(), dest.display()))?;
        sync_dir(dest.parent().expect("kind dir"));
        Ok(rec)
    }

    /// Removes an entry (`--force`).
    pub fn remove(&self, kind: &str, key: &str) -> Result<()> {
        let dir = self.entry_dir(kind, key);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("removing '{}'", dir.display()))?;
        }
        Ok(())
    }
}

/// Writes `bytes` to `path` and fsyncs it (inside a scratch directory: not yet visible).
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f =
        std::fs::File::create(path).with_context(|| format!("creating '{}'", path.display()))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .with_context(|| format!("writing '{}'", path.display()))?;
    Ok(())
}

/// Makes a rename in `dir` durable (best effort: not every filesystem syncs directories).
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Checks that a file name is a plain name (no separators) before it is joined to a path.
pub fn plain_name(name: &str) -> Result<&str> {
    if name.is_empty() || name.contains(['/', '\\']) || name == "." || name == ".." {
        bail!("'{name}' is not a plain file name");
    }
    Ok(name)
}
