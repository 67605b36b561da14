//! Writing GGUF v3 files.

use crate::value::MetaValue;
use crate::{GgufError, Result, DEFAULT_ALIGNMENT, MAGIC};
use npuc_ir::GgmlType;
use std::io::Write;
use std::path::Path;

/// A tensor to write: raw bytes already in the layout of `ggml_type`.
pub struct WriteTensor<'a> {
    pub name: String,
    pub ggml_type: GgmlType,
    /// GGML order: `dims[0]` innermost.
    pub dims: Vec<u64>,
    pub data: &'a [u8],
}

/// Serializes metadata and tensors as a GGUF v3 byte vector. The alignment is taken from
/// `general.alignment` when present (it must be a power of two), else 32.
pub fn to_bytes(metadata: &[(String, MetaValue)], tensors: &[WriteTensor]) -> Result<Vec<u8>> {
    let bad = |tensor: &str, msg: String| GgufError::Tensor {
        file: "<writer>".into(),
        tensor: tensor.to_string(),
        msg,
    };
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a.is_power_of_two() => a,
            _ => {
                return Err(GgufError::Meta {
                    file: "<writer>".into(),
                    key: "general.alignment".into(),
                    msg: format!("{v} is not a power of two"),
                })
            }
        },
    };
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut out, k);
        out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(tensors.len());
    for t in tensors {
        let numel: u64 = t.dims.iter().product();
        let expect = t
            .ggml_type
            .row_bytes(t.dims.first().copied().unwrap_or(1) as usize)
            .map(|rb| rb as u64 * (numel / t.dims.first().copied().unwrap_or(1).max(1)));
        if t.dims.is_empty() || t.dims.len() > 4 || expect != Some(t.data.len() as u64) {
            return Err(bad(
                &t.name,
                format!(
                    "{} bytes do not hold a {} tensor of dims {:?}",
                    t.data.len(),
                    t.ggml_type,
                    t.dims
                ),
            ));
        }
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.data.len() as u64).div_ceil(alignment) * alignment;
    }
    pad_to(&mut out, alignment);
    let base = out.len() as u64;
    for (t, off) in tensors.iter().zip(offsets) {
        out.resize((base + off) as usize, 0);
        out.extend_from_slice(t.data);
    }
    pad_to(&mut out, alignment);
    Ok(out)
}

/// Writes a GGUF file atomically: a temp file in the same directory, then a rename.
pub fn write_file(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[WriteTensor],
) -> Result<()> {
    let bytes = to_bytes(metadata, tensors)?;
    let io = |source| GgufError::Io {
        path: path.to_path_buf(),
        source,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path.file_name().map(|f| f.to_string_lossy().into_owned());
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        file_name.unwrap_or_else(|| "out.gguf".into()),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(())
}

fn pad_to(out: &mut Vec<u8>, alignment: u64) {
    let len = (out.len() as u64).div_ceil(alignment) * alignment;
    out.resize(len as usize, 0);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::Array(et, items) => {
            out.extend_from_slice(&(*et as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for x in items {
                put_value(out, x);
            }
        }
    }
}
