//! Parsing a GGUF file from a byte buffer (an mmap or an owned `Vec`).

use crate::value::{MetaValue, ValueType};
use crate::{GgufError, Result, DEFAULT_ALIGNMENT, MAGIC};
use npuc_ir::{Backing, GgmlType};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// GGML tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays nest at most this deep (real files use depth 1).
const MAX_DEPTH: usize = 4;

struct MmapBacking(memmap2::Mmap);
impl Backing for MmapBacking {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// One tensor's description. `dims` are in GGML order: `dims[0]` is the innermost (contiguous)
/// dimension, so a weight `[out, in]` in row-major terms has `dims = [in, out]`.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ggml_type: GgmlType,
    pub dims: Vec<u64>,
    /// Offset of the data relative to the start of the tensor-data section.
    pub offset: u64,
    /// Bytes of data.
    pub nbytes: u64,
}

impl TensorInfo {
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in row-major order (outermost first), as the IR uses it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Length of one row (the innermost dimension).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of every dimension but the innermost).
    pub fn rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
}

/// A parsed GGUF file. Metadata keys keep their file order; tensor data stays in the buffer.
pub struct GgufFile {
    /// What the file is called in error messages.
    pub name: String,
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the tensor-data section.
    pub data_offset: u64,
    meta_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
    backing: Arc<dyn Backing>,
    /// The mapped file (when opened from a path), for [`GgufFile::read_at`].
    file: Option<Arc<std::fs::File>>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("name", &self.name)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps `path` and parses it.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only and private to this process. Like every mmap-based
        // model loader we rely on the file not being truncated while mapped; all reads are
        // bounds-checked against the mapped length taken at open time.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let mut g = GgufFile::parse(path.display().to_string(), Arc::new(MmapBacking(map)))?;
        g.file = Some(Arc::new(file));
        Ok(g)
    }

    /// Copies the file's bytes `off .. off + buf.len()` (absolute offsets, e.g. from
    /// [`GgufFile::tensor_range`]) into `buf`. A mapped file is read with `pread`, not through
    /// the mapping, so bytes that are only copied (weights repacked into another layout) never
    /// become resident pages of this process.
    pub fn read_at(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        let len = self.backing.bytes().len();
        if off.checked_add(buf.len()).is_none_or(|end| end > len) {
            return Err(GgufError::Truncated {
                file: self.name.clone(),
                offset: off as u64,
                what: "a read".into(),
                need: buf.len() as u64,
                have: len as u64,
            });
        }
        #[cfg(unix)]
        if let Some(f) = &self.file {
            use std::os::unix::fs::FileExt;
            return f
                .read_exact_at(buf, off as u64)
                .map_err(|source| GgufError::Io {
                    path: self.name.clone().into(),
                    source,
                });
        }
        buf.copy_from_slice(&self.backing.bytes()[off..off + buf.len()]);
        Ok(())
    }

    /// Parses a file held in memory.
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Result<GgufFile> {
        GgufFile::parse(name.into(), Arc::new(bytes))
    }

    /// Parses the bytes of `backing`; tensor data stays there.
    pub fn parse(name: String, backing: Arc<dyn Backing>) -> Result<GgufFile> {
        let bytes = backing.bytes();
        let mut r = Reader {
            buf: bytes,
            pos: 0,
            file: &name,
        };
        let magic: [u8; 4] = r.take(4, "magic")?.try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(GgufError::BadMagic {
                file: name,
                found: magic,
            });
        }
        let version = r.u32("version")?;
        match version {
            2 | 3 => {}
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(GgufError::Version {
                    file: name,
                    version: v.swap_bytes(),
                    hint: ": this file is big-endian; convert it to little-endian GGUF",
                })
            }
            1 => {
                return Err(GgufError::Version {
                    file: name,
                    version,
                    hint: ": re-save it with a current llama.cpp (convert or gguf-py)",
                })
            }
            _ => {
                return Err(GgufError::Version {
                    file: name,
                    version,
                    hint: "",
                })
            }
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // Each KV pair takes at least 8 (key len) + 4 (type) + 1 bytes, each tensor info at least 8 + 4 + 4 + 8.
        r.check_count(n_kv, 13, "metadata count")?;
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let at = r.pos;
            let key = r.string("metadata key")?;
            let tid = r.u32("metadata value type")?;
            let vt = ValueType::from_id(tid).ok_or_else(|| GgufError::Meta {
                file: name.clone(),
                key: key.clone(),
                msg: format!("unknown value type {tid} (at byte offset {at})"),
            })?;
            let value = r.value(vt, 0, &key)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::Meta {
                    file: name,
                    key,
                    msg: "appears twice".into(),
                });
            }
            metadata.push((key, value));
        }
        let alignment = match meta_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = metadata[i].1.as_u64().unwrap_or(0);
                if v == 0 || !v.is_power_of_two() {
                    return Err(GgufError::Meta {
                        file: name,
                        key: "general.alignment".into(),
                        msg: format!("{} is not a power of two", metadata[i].1),
                    });
                }
                v
            }
        };
        r.check_count(n_tensors, 24, "tensor count")?;
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let t = r.tensor_info()?;
            if tensor_index.insert(t.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Tensor {
                    file: name,
                    tensor: t.name,
                    msg: "appears twice in the tensor table".into(),
                });
            }
            tensors.push(t);
        }
        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = bytes.len() as u64;
        for t in &tensors {
            let terr = |msg: String| GgufError::Tensor {
                file: name.clone(),
                tensor: t.name.clone(),
                msg,
            };
            if t.offset % alignment != 0 {
                return Err(terr(format!(
                    "data offset {} is not a multiple of the alignment {alignment}",
                    t.offset
                )));
            }
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.nbytes));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(terr(format!(
                        "data [{}, +{}) lies past the end of the file ({file_len} bytes, data section at {data_offset}); \
                         the file is truncated or corrupt",
                        data_offset.saturating_add(t.offset),
                        t.nbytes
                    )))
                }
            }
        }
        Ok(GgufFile {
            name,
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            meta_index,
            tensor_index,
            backing,
            file: None,
        })
    }

    /// The metadata value of `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A required string value (a clear error when missing or of another type).
    pub fn req_str(&self, key: &str) -> Result<&str> {
        self.get(key)
            .ok_or_else(|| self.meta_err(key, "is missing"))?
            .as_str()
            .ok_or_else(|| self.meta_err(key, "is not a string"))
    }

    /// A required non-negative integer value.
    pub fn req_u64(&self, key: &str) -> Result<u64> {
        self.get(key)
            .ok_or_else(|| self.meta_err(key, "is missing"))?
            .as_u64()
            .ok_or_else(|| self.meta_err(key, "is not a non-negative integer"))
    }

    /// A required number.
    pub fn req_f64(&self, key: &str) -> Result<f64> {
        self.get(key)
            .ok_or_else(|| self.meta_err(key, "is missing"))?
            .as_f64()
            .ok_or_else(|| self.meta_err(key, "is not a number"))
    }

    /// An error about metadata key `key` of this file.
    pub fn meta_err(&self, key: &str, msg: impl Into<String>) -> GgufError {
        GgufError::Meta {
            file: self.name.clone(),
            key: key.to_string(),
            msg: msg.into(),
        }
    }

    /// An error about tensor `tensor` of this file.
    pub fn tensor_err(&self, tensor: &str, msg: impl Into<String>) -> GgufError {
        GgufError::Tensor {
            file: self.name.clone(),
            tensor: tensor.to_string(),
            msg: msg.into(),
        }
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.req_str("general.architecture")
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were checked at parse time).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let (start, len) = self.tensor_range(t);
        &self.backing.bytes()[start..start + len]
    }

    /// Absolute `(offset, len)` of a tensor's bytes in the backing buffer.
    pub fn tensor_range(&self, t: &TensorInfo) -> (usize, usize) {
        ((self.data_offset + t.offset) as usize, t.nbytes as usize)
    }

    /// The buffer the tensors live in (to build zero-copy IR tensors over it).
    pub fn backing(&self) -> Arc<dyn Backing> {
        self.backing.clone()
    }
}

/// A bounds-checked cursor.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                file: self.file.to_string(),
                offset: self.pos as u64,
                what: what.to_string(),
                need: n as u64,
                have: self.remaining() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    /// Lengths and counts are u64 since GGUF v2.
    fn len(&mut self, what: &str) -> Result<u64> {
        self.u64(what)
    }

    fn malformed(&self, at: usize, msg: String) -> GgufError {
        GgufError::Malformed {
            file: self.file.to_string(),
            offset: at as u64,
            msg,
        }
    }

    /// Rejects counts that cannot fit in the rest of the file before allocating for them.
    fn check_count(&self, n: u64, min_each: usize, what: &str) -> Result<()> {
        if n.saturating_mul(min_each as u64) > self.remaining() as u64 {
            return Err(self.malformed(
                self.pos,
                format!(
                    "{what} {n} cannot fit in the {} bytes that remain",
                    self.remaining()
                ),
            ));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let n = self.len(what)?;
        if n > self.remaining() as u64 {
            return Err(GgufError::Truncated {
                file: self.file.to_string(),
                offset: at as u64,
                what: format!("{what} (string of {n} bytes)"),
                need: n,
                have: self.remaining() as u64,
            });
        }
        let b = self.take(n as usize, what)?;
        // Tokenizer vocabularies of some converters carry invalid UTF-8 pieces; keep them lossy
        // rather than refusing the file.
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    fn value(&mut self, vt: ValueType, depth: usize, key: &str) -> Result<MetaValue> {
        Ok(match vt {
            ValueType::U8 => MetaValue::U8(self.arr::<1>(key)?[0]),
            ValueType::I8 => MetaValue::I8(self.arr::<1>(key)?[0] as i8),
            ValueType::U16 => MetaValue::U16(u16::from_le_bytes(self.arr(key)?)),
            ValueType::I16 => MetaValue::I16(i16::from_le_bytes(self.arr(key)?)),
            ValueType::U32 => MetaValue::U32(u32::from_le_bytes(self.arr(key)?)),
            ValueType::I32 => MetaValue::I32(i32::from_le_bytes(self.arr(key)?)),
            ValueType::F32 => MetaValue::F32(f32::from_le_bytes(self.arr(key)?)),
            ValueType::U64 => MetaValue::U64(u64::from_le_bytes(self.arr(key)?)),
            ValueType::I64 => MetaValue::I64(i64::from_le_bytes(self.arr(key)?)),
            ValueType::F64 => MetaValue::F64(f64::from_le_bytes(self.arr(key)?)),
            ValueType::Bool => {
                let at = self.pos;
                match self.arr::<1>(key)?[0] {
                    0 => MetaValue::Bool(false),
                    1 => MetaValue::Bool(true),
                    b => {
                        return Err(self
                            .malformed(at, format!("key '{key}': bool value {b} is not 0 or 1")))
                    }
                }
            }
            ValueType::String => MetaValue::String(self.string(key)?),
            ValueType::Array => {
                let at = self.pos;
                if depth >= MAX_DEPTH {
                    return Err(self.malformed(
                        at,
                        format!("key '{key}': arrays nested deeper than {MAX_DEPTH}"),
                    ));
                }
                let tid = self.u32(key)?;
                let et = ValueType::from_id(tid).ok_or_else(|| {
                    self.malformed(at, format!("key '{key}': unknown array element type {tid}"))
                })?;
                let n = self.len(key)?;
                self.check_count(n, et.min_size(), &format!("key '{key}': array length"))?;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(et, depth + 1, key)?);
                }
                MetaValue::Array(et, v)
            }
        })
    }

    fn tensor_info(&mut self) -> Result<TensorInfo> {
        let at = self.pos;
        let name = self.string("tensor name")?;
        let terr = |msg: String| GgufError::Tensor {
            file: self.file.to_string(),
            tensor: name.clone(),
            msg: format!("{msg} (tensor info at byte offset {at})"),
        };
        let n_dims = self.u32("tensor rank")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(terr(format!("rank {n_dims} is outside 1..={MAX_DIMS}")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64("tensor dimension")?);
        }
        let tid = self.u32("tensor type")?;
        let offset = self.u64("tensor offset")?;
        let ggml_type = GgmlType::from_id(tid).ok_or_else(|| {
            terr(format!(
                "unknown GGML tensor type id {tid}; this file needs a newer npuc"
            ))
        })?;
        let numel = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| terr(format!("dimensions {dims:?} overflow")))?;
        let bs = ggml_type.block_size() as u64;
        if dims[0] % bs != 0 {
            return Err(terr(format!(
                "row length {} is not a multiple of the {ggml_type} block size {bs}",
                dims[0]
            )));
        }
        let nbytes = (numel / bs)
            .checked_mul(ggml_type.type_size() as u64)
            .ok_or_else(|| terr(format!("dimensions {dims:?} overflow")))?;
        Ok(TensorInfo {
            name,
            ggml_type,
            dims,
            offset,
            nbytes,
        })
    }
}
