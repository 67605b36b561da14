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
//!
//! Re-hashing every cached file on every run costs a second per ~500 MB of parts, so an entry
//! also keeps `stamp.json`: each file's metadata (size, mtime, ctime, device, inode) when its
//! hash last matched. A lookup re-hashes only the files whose metadata differ from their stamp.
//! Any write through the filesystem (an edit, a truncation, a copy over it, `touch`) changes
//! the ctime, which no user-space call can set back, so it is always re-hashed; what the stamp
//! cannot see is corruption below the filesystem (a bit flipped on the disk): a full re-hash
//! ([`Verify::Full`], `npuc build --verify-cache`) catches that too.

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

/// How much of an entry a lookup checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// Sizes only (`--dry-run`).
    Sizes,
    /// Hashes the files whose metadata changed since their hash last matched (`stamp.json`).
    Changed,
    /// Hashes every file.
    Full,
}

/// The result of looking an entry up.
pub enum Lookup {
    /// Complete, and every file hashes to its record; with the number of files hashed now (the
    /// others were unchanged since they last were, or `Verify::Sizes`).
    Hit(Record, usize),
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

    /// Looks an entry up, checking its files as `verify` says.
    pub fn lookup(&self, kind: &str, key: &str, verify: Verify) -> Result<Lookup> {
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
        let stamps = match verify {
            Verify::Changed => read_stamps(&dir),
            Verify::Sizes | Verify::Full => Stamps::new(),
        };
        let mut fresh = Stamps::new();
        let mut hashed = 0;
        for (name, f) in &rec.files {
            let p = dir.join(name);
            let meta = std::fs::metadata(&p).ok();
            let len = meta.as_ref().map(|m| m.len());
            if len != Some(f.bytes) {
                return bad(format!(
                    "{}: {} bytes, the record says {}",
                    p.display(),
                    len.map_or("missing".into(), |l| l.to_string()),
                    f.bytes
                ));
            }
            let stamp = meta.as_ref().and_then(FileStamp::of);
            let unchanged = stamp.is_some() && stamps.get(name) == stamp.as_ref();
            if verify == Verify::Sizes || unchanged {
                continue;
            }
            let h = sha256_file(&p)?;
            hashed += 1;
            if h != f.sha256 {
                return bad(format!(
                    "{}: sha256 {h}, the record says {}",
                    p.display(),
                    f.sha256
                ));
            }
            // Stamped with the metadata read before hashing: a write during the hash leaves a
            // newer ctime, so the next lookup hashes again.
            if let Some(s) = stamp {
                fresh.insert(name.clone(), s);
            }
        }
        if !fresh.is_empty() {
            let mut all = read_stamps(&dir);
            all.extend(fresh);
            write_stamps(&dir, &all)?;
        }
        Ok(Lookup::Hit(rec, hashed))
    }

    /// Runs `f`, which gives the entry's file `name` another hard link (that changes only its
    /// ctime), and re-stamps the file if its stamp was current before: the link does not make
    /// the next lookup re-hash it.
    pub fn keeping_stamp<T>(
        &self,
        kind: &str,
        key: &str,
        name: &str,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let dir = self.entry_dir(kind, key);
        let path = dir.join(name);
        let stat = || {
            std::fs::metadata(&path)
                .ok()
                .as_ref()
                .and_then(FileStamp::of)
        };
        let before = stat();
        let r = f()?;
        let mut stamps = read_stamps(&dir);
        if let (Some(b), Some(a)) = (before, stat()) {
            if b != a && stamps.get(name) == Some(&b) {
                stamps.insert(name.to_string(), a);
                write_stamps(&dir, &stamps)?;
            }
        }
        Ok(r)
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
        let mut stamps = Stamps::new();
        for name in names {
            let p = scratch.path().join(name);
            let meta = std::fs::metadata(&p)
                .with_context(|| format!("step {step} did not write '{name}'"))?;
            // On the disk before the entry appears: a stamp must never vouch for bytes that a
            // power loss could still take back.
            std::fs::File::open(&p)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("syncing '{}'", p.display()))?;
            files.insert(
                name.to_string(),
                FileRecord {
                    bytes: meta.len(),
                    sha256: sha256_file(&p)?,
                },
            );
            if let Some(s) = FileStamp::of(&meta) {
                stamps.insert(name.to_string(), s);
            }
        }
        let rec = Record {
            step: step.to_string(),
            key: key.to_string(),
            files,
        };
        let json = serde_json::to_vec_pretty(&rec)?;
        write_synced(&scratch.path().join("record.json"), &json)?;
        // Renaming the directory leaves its files' metadata as they are: the stamps stay valid.
        write_stamps(scratch.path(), &stamps)?;
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

/// A file's metadata as far as a write through the filesystem changes it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileStamp {
    bytes: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    dev: u64,
    ino: u64,
}

impl FileStamp {
    /// `None` where the platform has no ctime/inode (every lookup then hashes).
    fn of(m: &std::fs::Metadata) -> Option<FileStamp> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            let ns = |s: i64, n: i64| s as i128 * 1_000_000_000 + n as i128;
            Some(FileStamp {
                bytes: m.len(),
                mtime_ns: ns(m.mtime(), m.mtime_nsec()),
                ctime_ns: ns(m.ctime(), m.ctime_nsec()),
                dev: m.dev(),
                ino: m.ino(),
            })
        }
        #[cfg(not(unix))]
        {
            let _ = m;
            None
        }
    }
}

type Stamps = BTreeMap<String, FileStamp>;

/// The stamp file of an entry (not one of its outputs; not in `record.json`).
pub const STAMPS: &str = "stamp.json";

/// An entry's stamps; none if the file is missing or unreadable (then every file is hashed).
fn read_stamps(dir: &Path) -> Stamps {
    std::fs::read(dir.join(STAMPS))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Replaces an entry's stamps (a temporary file renamed over it: a kill leaves the old or the
/// new stamps, and a damaged stamp file only costs a re-hash).
fn write_stamps(dir: &Path, stamps: &Stamps) -> Result<()> {
    let tmp = dir.join(format!(".{STAMPS}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec(stamps)?)
        .with_context(|| format!("writing '{}'", tmp.display()))?;
    let dest = dir.join(STAMPS);
    std::fs::rename(&tmp, &dest)
        .with_context(|| format!("moving '{}' to '{}'", tmp.display(), dest.display()))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache with one committed entry `k/key` holding `a.bin` (64 KiB) and `b.json`.
    fn one_entry() -> (tempfile::TempDir, Cache) {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(tmp.path()).unwrap();
        let scratch = cache.scratch().unwrap();
        let bytes: Vec<u8> = (0..65536u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(scratch.path().join("a.bin"), &bytes).unwrap();
        std::fs::write(scratch.path().join("b.json"), b"{}").unwrap();
        cache
            .commit("s", "k", "key", scratch, &["a.bin", "b.json"])
            .unwrap();
        (tmp, cache)
    }

    fn hashed(c: &Cache, verify: Verify) -> usize {
        match c.lookup("k", "key", verify).unwrap() {
            Lookup::Hit(_, n) => n,
            Lookup::Miss => panic!("miss"),
            Lookup::Corrupt(why) => panic!("corrupt: {why}"),
        }
    }

    fn corrupt(c: &Cache) -> String {
        match c.lookup("k", "key", Verify::Changed).unwrap() {
            Lookup::Corrupt(why) => why,
            _ => panic!("a damaged entry passed its lookup"),
        }
    }

    fn flip_in_place(path: &Path, at: u64) {
        use std::io::{Seek, SeekFrom, Write};
        let mut b = [0u8];
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        f.read_exact(&mut b).unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&[b[0] ^ 0x55]).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn unchanged_files_are_not_rehashed_until_their_metadata_change() {
        let (_tmp, c) = one_entry();
        // Stamped at commit: nothing to hash.
        assert_eq!(hashed(&c, Verify::Changed), 0);
        assert_eq!(hashed(&c, Verify::Full), 2);
        // A hard link (as into OUTDIR) changes the ctime: hashed once, then stamped again...
        let entry = c.entry_dir("k", "key");
        let out = entry.parent().unwrap().join("linked.bin");
        std::fs::hard_link(entry.join("a.bin"), &out).unwrap();
        assert_eq!(hashed(&c, Verify::Changed), 1);
        assert_eq!(hashed(&c, Verify::Changed), 0);
        // ...unless the link is made through `keeping_stamp`.
        let out2 = entry.parent().unwrap().join("linked2.bin");
        c.keeping_stamp("k", "key", "a.bin", || {
            std::fs::hard_link(entry.join("a.bin"), &out2)?;
            Ok(())
        })
        .unwrap();
        assert_eq!(hashed(&c, Verify::Changed), 0);
        // A damaged stamp file costs a re-hash, nothing else.
        std::fs::write(entry.join(STAMPS), b"garbage").unwrap();
        assert_eq!(hashed(&c, Verify::Changed), 2);
        assert_eq!(hashed(&c, Verify::Changed), 0);
    }

    #[test]
    fn a_changed_byte_is_found_even_with_the_mtime_put_back() {
        let (_tmp, c) = one_entry();
        let p = c.entry_dir("k", "key").join("a.bin");
        let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
        // Let the clock move on (the kernel's file times are coarse), then edit in place and
        // put the mtime back, as `touch -r` would: same size, same mtime, new ctime.
        std::thread::sleep(std::time::Duration::from_millis(20));
        flip_in_place(&p, 40_000);
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().modified().unwrap(), mtime);
        let why = corrupt(&c);
        assert!(why.contains("a.bin: sha256"), "{why}");
    }

    #[test]
    fn a_truncated_or_missing_file_is_found() {
        let (_tmp, c) = one_entry();
        let p = c.entry_dir("k", "key").join("a.bin");
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(1000)
            .unwrap();
        let why = corrupt(&c);
        assert!(
            why.contains("a.bin: 1000 bytes, the record says 65536"),
            "{why}"
        );
        std::fs::remove_file(&p).unwrap();
        let why = corrupt(&c);
        assert!(why.contains("a.bin: missing bytes"), "{why}");
    }

    #[test]
    fn full_verification_rehashes_every_file() {
        let (_tmp, c) = one_entry();
        assert_eq!(hashed(&c, Verify::Full), 2);
        assert_eq!(hashed(&c, Verify::Sizes), 0);
    }
}
