//! Reading and writing NumPy `.npy` files (format versions 1-3, little-endian, C order): the
//! one implementation the CLI (inputs, outputs, verify samples), the calibration loader and the
//! tests share. Errors name the file and what is wrong with it; a header or shape that does not
//! match the bytes is an error, never a panic.
#![forbid(unsafe_code)]

use npuc_ir::{DType, Tensor};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    // The reason is part of the message, not a chained source (printed once, not twice).
    #[error("cannot read '{path}': {err}")]
    Io { path: String, err: std::io::Error },
    #[error("'{path}' is not a valid .npy file: {msg}")]
    Format { path: String, msg: String },
}

fn dtype_of(descr: &str) -> Option<DType> {
    let d = descr.trim_start_matches(['<', '|', '=']);
    Some(match d {
        "f4" => DType::F32,
        "f8" => DType::F64,
        "f2" => DType::F16,
        "i1" => DType::I8,
        "u1" => DType::U8,
        "i2" => DType::I16,
        "u2" => DType::U16,
        "i4" => DType::I32,
        "u4" => DType::U32,
        "i8" => DType::I64,
        "u8" => DType::U64,
        "b1" => DType::Bool,
        _ => return None,
    })
}

fn descr_of(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::F16 => "<f2",
        DType::I8 => "|i1",
        DType::U8 => "|u1",
        DType::I16 => "<i2",
        DType::U16 => "<u2",
        DType::I32 => "<i4",
        DType::U32 => "<u4",
        DType::I64 => "<i8",
        DType::U64 => "<u8",
        DType::Bool => "|b1",
        _ => return None,
    })
}

/// Parses .npy bytes. `name` is used in error messages.
pub fn parse_npy(bytes: &[u8], name: &str) -> Result<Tensor, NpyError> {
    let err = |msg: String| NpyError::Format {
        path: name.to_string(),
        msg,
    };
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(err("missing the \\x93NUMPY magic".into()));
    }
    let major = bytes[6];
    let (hlen, hstart) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(err("truncated header".into()));
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(err(format!("unsupported format version {v}"))),
    };
    let header = bytes
        .get(hstart..hstart + hlen)
        .ok_or_else(|| err("truncated header".into()))?;
    let header = std::str::from_utf8(header).map_err(|_| err("header is not text".into()))?;
    let field = |key: &str| -> Option<&str> {
        let i = header.find(&format!("'{key}'"))?;
        let rest = &header[i + key.len() + 2..];
        let rest = rest.trim_start().strip_prefix(':')?.trim_start();
        Some(rest)
    };
    let descr = field("descr")
        .and_then(|r| r.strip_prefix('\''))
        .and_then(|r| r.split('\'').next())
        .ok_or_else(|| err("header has no descr".into()))?;
    if descr.starts_with('>') {
        return Err(err(format!("big-endian data ({descr}) is not supported")));
    }
    let dtype = dtype_of(descr).ok_or_else(|| err(format!("unsupported dtype '{descr}'")))?;
    let fortran = field("fortran_order").is_some_and(|r| r.starts_with("True"));
    if fortran {
        return Err(err(
            "Fortran-ordered arrays are not supported; save with np.ascontiguousarray".into(),
        ));
    }
    let shape_s = field("shape")
        .and_then(|r| r.strip_prefix('('))
        .and_then(|r| r.split(')').next())
        .ok_or_else(|| err("header has no shape".into()))?;
    let shape: Vec<usize> = shape_s
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| err(format!("bad dimension '{s}'")))
        })
        .collect::<Result<_, _>>()?;
    let data = &bytes[hstart + hlen..];
    let need = npuc_ir::checked_numel(&shape)
        .and_then(|n| n.checked_mul(dtype.size()))
        .ok_or_else(|| {
            err(format!(
                "shape {shape:?} overflows (more elements than addressable)"
            ))
        })?;
    if data.len() < need {
        return Err(err(format!(
            "data holds {} bytes but {dtype} {shape:?} needs {need} (truncated file?)",
            data.len()
        )));
    }
    Tensor::from_le_bytes_copy(dtype, shape, &data[..need]).map_err(|e| err(e.to_string()))
}

/// Reads a `.npy` file.
pub fn read_npy(path: &Path) -> Result<Tensor, NpyError> {
    let bytes = std::fs::read(path).map_err(|e| NpyError::Io {
        path: path.display().to_string(),
        err: e,
    })?;
    parse_npy(&bytes, &path.display().to_string())
}

/// Reads a `.npy` file of f32 values as (shape, values); another dtype is an error naming the
/// file (reference arrays in tests are compared as f32).
pub fn read_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>), NpyError> {
    let t = read_npy(path)?;
    let vals = t.as_slice::<f32>().map_err(|e| NpyError::Format {
        path: path.display().to_string(),
        msg: format!("expected f32 values: {e}"),
    })?;
    Ok((t.shape().to_vec(), vals.to_vec()))
}

/// Serialises a tensor as .npy (version 1.0). bf16 is widened to f32 (NumPy has no bf16).
pub fn npy_bytes(t: &Tensor) -> Result<Vec<u8>, String> {
    let (descr, data) = match t.dtype() {
        DType::BF16 => (
            "<f4",
            t.to_f64_vec()
                .map_err(|e| e.to_string())?
                .iter()
                .flat_map(|&x| (x as f32).to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
        DType::I4 => ("|i1", t.to_le_bytes().map_err(|e| e.to_string())?),
        DType::U4 => ("|u1", t.to_le_bytes().map_err(|e| e.to_string())?),
        d => (
            descr_of(d).ok_or_else(|| format!("{d} tensors cannot be saved as .npy"))?,
            t.to_le_bytes().map_err(|e| e.to_string())?,
        ),
    };
    let shape = match t.shape() {
        [] => "()".to_string(),
        [n] => format!("({n},)"),
        s => format!(
            "({})",
            s.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat(total.next_multiple_of(64) - total));
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        let t = Tensor::from_vec(vec![2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, -6.5]).unwrap();
        let b = npy_bytes(&t).unwrap();
        assert_eq!(parse_npy(&b, "x").unwrap(), t);
        let s = Tensor::scalar(7i64);
        assert_eq!(parse_npy(&npy_bytes(&s).unwrap(), "s").unwrap(), s);
    }

    #[test]
    fn truncated_is_an_error() {
        let t = Tensor::from_vec(vec![4], vec![1i32, 2, 3, 4]).unwrap();
        let b = npy_bytes(&t).unwrap();
        for cut in [0, 5, 9, 20, b.len() - 1] {
            assert!(parse_npy(&b[..cut], "x").is_err(), "cut at {cut}");
        }
    }

    proptest::proptest! {
        /// Any bytes, and any mutation of a valid file, give a tensor or an error, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let _ = parse_npy(&bytes, "fuzz");
            let mut valid = npy_bytes(&Tensor::from_vec(vec![2, 2], vec![1.0f32, 2.0, 3.0, 4.0]).unwrap()).unwrap();
            for (i, b) in bytes.iter().enumerate() {
                let at = (i * 7 + *b as usize) % valid.len();
                valid[at] = *b;
            }
            let _ = parse_npy(&valid, "fuzz");
        }

        #[test]
        fn round_trip_any_shape(dims in proptest::collection::vec(0usize..5, 0..4), seed in 0i32..1000) {
            let n: usize = dims.iter().product();
            let t = Tensor::from_vec(dims.clone(), (0..n as i32).map(|v| v * seed).collect::<Vec<i32>>()).unwrap();
            proptest::prop_assert_eq!(parse_npy(&npy_bytes(&t).unwrap(), "t").unwrap(), t);
        }
    }
}
