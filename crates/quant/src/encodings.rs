//! AIMET / QNN quantization encodings JSON, versions 0.6.1 (dict of lists, what
//! `qnn-onnx-converter --quantization_overrides` reads) and 1.0.0 (list of dicts).
//!
//! Sign convention: QNN writes `real = (q + offset) * scale`, so `offset = -zero_point`. Symmetric
//! encodings are written as AIMET does, in the unsigned container: `offset = -2^(bw-1)`, which is
//! the same real grid as a signed type with zero point 0. Reading accepts both that and
//! `offset = 0` for symmetric entries.

use crate::qdq::{weight_axes, Encodings, QEnc};
use anyhow::{anyhow, bail, Context, Result};
use npuc_ir::{DType, Model};
use serde_json::{json, Map, Value as J};
use std::collections::BTreeMap;
use std::path::Path;

pub use crate::qdq::TensorEncoding;

/// Encodings file format version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncodingsVersion {
    /// `0.6.1`: `{tensor: [ {bitwidth, dtype, is_symmetric, max, min, offset, scale}, ...]}`.
    V0_6_1,
    /// `1.0.0`: `[ {name, enc_type, dtype, bw, is_sym, scale[], offset[], block_size?}, ...]`;
    /// `LPBQ` entries add `compressed_bw` and `per_block_int_scale[]` (`scale`/`offset` then
    /// per output channel).
    V1_0_0,
}

impl EncodingsVersion {
    /// Parses `0.6.1` or `1.0.0`.
    pub fn parse(s: &str) -> Result<EncodingsVersion> {
        match s {
            "0.6.1" => Ok(EncodingsVersion::V0_6_1),
            "1.0.0" => Ok(EncodingsVersion::V1_0_0),
            _ => bail!("unsupported encodings version '{s}'; expected 0.6.1 or 1.0.0"),
        }
    }
}

fn signed(d: DType) -> bool {
    matches!(d, DType::I8 | DType::I16 | DType::I4 | DType::I32)
}

/// The QNN offset of parameter `i` (unsigned-container convention for signed types).
fn qnn_offset(e: &QEnc, i: usize) -> i64 {
    if signed(e.dtype) {
        -(1i64 << (crate::bitwidth(e.dtype) - 1)) - e.zero_point[i]
    } else {
        -e.zero_point[i]
    }
}

fn entry_061(e: &QEnc, i: usize) -> J {
    let (min, max) = e.real_range(i);
    json!({
        "bitwidth": crate::bitwidth(e.dtype),
        "dtype": "int",
        "is_symmetric": if signed(e.dtype) { "True" } else { "False" },
        "max": max,
        "min": min,
        "offset": qnn_offset(e, i),
        "scale": e.scale[i],
    })
}

fn float_bits(name: &str, d: DType) -> Result<u32> {
    match d {
        DType::F16 => Ok(16),
        _ => bail!("'{name}': {d} has no AIMET float encoding (only float16 does)"),
    }
}

/// Serializes encodings; `quantizer_args` is informational (scheme, method).
pub fn to_json(enc: &Encodings, version: EncodingsVersion, quantizer_args: J) -> Result<String> {
    let v = match version {
        EncodingsVersion::V0_6_1 => {
            let mut top = Map::new();
            for (key, map) in [
                ("activation_encodings", &enc.activations),
                ("param_encodings", &enc.params),
            ] {
                let mut m = Map::new();
                for (name, te) in map {
                    let list = match te {
                        TensorEncoding::Float(d) => {
                            vec![json!({"bitwidth": float_bits(name, *d)?, "dtype": "float"})]
                        }
                        TensorEncoding::Int(e) => {
                            if e.block_size.is_some() {
                                bail!("'{name}' is block-quantized, which encodings 0.6.1 cannot express; use --encodings-version 1.0.0");
                            }
                            (0..e.scale.len()).map(|i| entry_061(e, i)).collect()
                        }
                    };
                    m.insert(name.clone(), J::Array(list));
                }
                top.insert(key.into(), J::Object(m));
            }
            top.insert("quantizer_args".into(), quantizer_args);
            smoothing_json(enc, &mut top);
            top.insert("version".into(), json!("0.6.1"));
            J::Object(top)
        }
        EncodingsVersion::V1_0_0 => {
            let mut top = Map::new();
            for (key, map) in [
                ("activation_encodings", &enc.activations),
                ("param_encodings", &enc.params),
            ] {
                let mut list = vec![];
                for (name, te) in map {
                    list.push(match te {
                        TensorEncoding::Float(d) => json!({"name": name, "dtype": "FP", "bw": float_bits(name, *d)?, "enc_type": "PER_TENSOR"}),
                        TensorEncoding::Int(e) if e.lpbq.is_some() => lpbq_entry(name, e)?,
                        TensorEncoding::Int(e) => {
                            let kind = match (e.scale.len(), e.block_size) {
                                (_, Some(_)) => "PER_BLOCK",
                                (1, None) => "PER_TENSOR",
                                _ => "PER_CHANNEL",
                            };
                            let mut o = json!({
                                "name": name,
                                "enc_type": kind,
                                "dtype": "INT",
                                "bw": crate::bitwidth(e.dtype),
                                "is_sym": signed(e.dtype),
                                "scale": e.scale,
                                "offset": (0..e.scale.len()).map(|i| qnn_offset(e, i)).collect::<Vec<_>>(),
                            });
                            if let Some(b) = e.block_size {
                                o["block_size"] = json!(b);
                            }
                            o
                        }
                    });
                }
                top.insert(key.into(), J::Array(list));
            }
            top.insert("excluded_layers".into(), json!([]));
            top.insert("quantizer_args".into(), quantizer_args);
            smoothing_json(enc, &mut top);
            top.insert("version".into(), json!("1.0.0"));
            J::Object(top)
        }
    };
    Ok(serde_json::to_string_pretty(&v)?)
}

/// A 1.0.0 `LPBQ` entry: `scale`/`offset` per output channel, `per_block_int_scale` in the
/// layout of the weight's block scales (the weight's own axis order with the input axis cut
/// into blocks, as `PER_BLOCK` entries write their scales), `compressed_bw`, `block_size`.
fn lpbq_entry(name: &str, e: &QEnc) -> Result<J> {
    let (Some(l), Some(b)) = (&e.lpbq, e.block_size) else {
        bail!("'{name}': an LPBQ encoding needs block scales");
    };
    let channels = l.channel_scales.len();
    let off = qnn_offset(e, 0);
    Ok(json!({
        "name": name,
        "enc_type": "LPBQ",
        "dtype": "INT",
        "bw": crate::bitwidth(e.dtype),
        "is_sym": signed(e.dtype),
        "scale": l.channel_scales,
        "offset": vec![off; channels],
        "block_size": b,
        "compressed_bw": l.compressed_bw,
        "per_block_int_scale": l.int_scales,
    }))
}

/// The key holding npuc's outlier-migration scales. AIMET has no such field; tools that read
/// AIMET encodings ignore unknown top-level keys, and the QDQ export (`--emit-qdq`) carries the
/// smoothed weights itself, so only a read back into npuc (`--encodings`) needs it.
pub const SMOOTHING_KEY: &str = "npuc_smoothing";

fn smoothing_json(enc: &Encodings, top: &mut Map<String, J>) {
    if !enc.smoothing.is_empty() {
        top.insert(SMOOTHING_KEY.into(), json!(enc.smoothing));
    }
}

/// The smoothing scales an encodings file records (empty when none).
pub fn smoothing_from_json(text: &str, origin: &str) -> Result<BTreeMap<String, Vec<f32>>> {
    let v: J = serde_json::from_str(text).map_err(|e| anyhow!("{origin}: not valid JSON: {e}"))?;
    let mut out = BTreeMap::new();
    match v.get(SMOOTHING_KEY) {
        None | Some(J::Null) => {}
        Some(J::Object(map)) => {
            for (name, list) in map {
                let what = format!("{origin}: {SMOOTHING_KEY}['{name}']");
                out.insert(name.clone(), as_f32s(list, &what)?);
            }
        }
        Some(_) => bail!(
            "{origin}: '{SMOOTHING_KEY}' must be an object of activation name -> list of scales"
        ),
    }
    Ok(out)
}

/// Writes encodings atomically through npuc's one atomic writer (a hidden temp file beside
/// `path`, removed on any error: a failed rename, e.g. onto a directory, leaves nothing behind).
pub fn write(
    path: &Path,
    enc: &Encodings,
    version: EncodingsVersion,
    quantizer_args: J,
) -> Result<()> {
    let text = to_json(enc, version, quantizer_args)?;
    npuc_format::persist_atomic(path, text.as_bytes())
        .with_context(|| format!("writing encodings {}", path.display()))?;
    Ok(())
}

/// Integer type for a bit width and symmetry/offset, plus the ONNX zero point.
fn int_type(bw: u32, sym: bool, offset: i64, what: &str) -> Result<(DType, i64)> {
    let half = 1i64 << (bw.clamp(1, 32) - 1);
    if sym && (offset == 0 || offset == -half) {
        let d = match bw {
            4 => DType::I4,
            8 => DType::I8,
            16 => DType::I16,
            32 => DType::I32,
            _ => bail!("{what}: unsupported symmetric bitwidth {bw}"),
        };
        return Ok((d, 0));
    }
    let d = match bw {
        4 => DType::U4,
        8 => DType::U8,
        16 => DType::U16,
        _ => bail!("{what}: unsupported asymmetric bitwidth {bw}"),
    };
    let zp = -offset;
    let (qmin, qmax) = crate::qrange(d);
    if zp < qmin || zp > qmax {
        bail!("{what}: offset {offset} is outside the {bw}-bit range");
    }
    Ok((d, zp))
}

fn get<'a>(o: &'a J, k: &str, what: &str) -> Result<&'a J> {
    o.get(k)
        .ok_or_else(|| anyhow!("{what}: missing field '{k}'"))
}

fn as_bool(v: &J) -> bool {
    match v {
        J::Bool(b) => *b,
        J::String(s) => s.eq_ignore_ascii_case("true"),
        _ => false,
    }
}

fn as_f32s(v: &J, what: &str) -> Result<Vec<f32>> {
    match v {
        J::Array(a) => a
            .iter()
            .map(|x| {
                x.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| anyhow!("{what}: scale is not a number"))
            })
            .collect(),
        J::Number(n) => Ok(vec![n.as_f64().unwrap_or(0.0) as f32]),
        _ => bail!("{what}: scale must be a number or a list"),
    }
}

fn as_i64s(v: &J, what: &str) -> Result<Vec<i64>> {
    match v {
        J::Array(a) => a
            .iter()
            .map(|x| {
                x.as_f64()
                    .map(|f| f as i64)
                    .ok_or_else(|| anyhow!("{what}: offset is not a number"))
            })
            .collect(),
        J::Number(n) => Ok(vec![n.as_f64().unwrap_or(0.0) as i64]),
        _ => bail!("{what}: offset must be a number or a list"),
    }
}

/// Picks the axis (and block) of a multi-scale parameter from its consumer op and shape.
fn layout_for(
    m: &Model,
    name: &str,
    n: usize,
    block: Option<usize>,
) -> Result<(Option<usize>, Vec<usize>)> {
    let g = &m.graph;
    let t = g
        .initializer(name)
        .ok_or_else(|| anyhow!("'{name}' is not an initializer of the model"))?;
    let shape = t.shape();
    if n == 1 && block.is_none() {
        return Ok((None, vec![]));
    }
    let consumer = g.nodes.iter().find(|nd| nd.input(1) == Some(name));
    let is_bias = g
        .nodes
        .iter()
        .any(|nd| nd.input(2) == Some(name) && nd.op_type != "MatMul");
    if let Some(b) = block {
        let (_, inp) = consumer
            .and_then(|nd| weight_axes(nd, shape.len()))
            .ok_or_else(|| {
                anyhow!("'{name}': a per-block encoding needs a Conv/Gemm/MatMul weight")
            })?;
        let mut ps = shape.to_vec();
        ps[inp] = shape[inp].div_ceil(b);
        if ps.iter().product::<usize>() != n {
            bail!("'{name}': {n} block scales do not fit shape {shape:?} with block size {b}");
        }
        return Ok((Some(inp), ps));
    }
    if is_bias && shape.len() == 1 && shape[0] == n {
        return Ok((Some(0), vec![n]));
    }
    if let Some((out, _)) = consumer.and_then(|nd| weight_axes(nd, shape.len())) {
        if shape[out] == n {
            return Ok((Some(out), vec![n]));
        }
    }
    if shape.first() == Some(&n) {
        return Ok((Some(0), vec![n]));
    }
    bail!("'{name}': {n} per-channel encodings match no axis of its shape {shape:?}")
}

#[allow(clippy::too_many_arguments)]
fn build(
    m: &Model,
    name: &str,
    is_param: bool,
    bw: u32,
    sym: bool,
    scale: Vec<f32>,
    offset: Vec<i64>,
    block: Option<usize>,
) -> Result<QEnc> {
    let what = format!("encoding of '{name}'");
    if scale.is_empty() || scale.len() != offset.len() {
        bail!(
            "{what}: {} scales and {} offsets",
            scale.len(),
            offset.len()
        );
    }
    if let Some(s) = scale.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
        bail!("{what}: scale {s} must be positive and finite");
    }
    let mut dtype = None;
    let mut zps = vec![];
    for &o in &offset {
        let (d, z) = int_type(bw, sym, o, &what)?;
        if dtype.is_some_and(|x| x != d) {
            bail!("{what}: mixed offsets across channels");
        }
        dtype = Some(d);
        zps.push(z);
    }
    let (axis, param_shape) = if is_param {
        layout_for(m, name, scale.len(), block)?
    } else if scale.len() == 1 {
        (None, vec![])
    } else {
        bail!("{what}: activations take one encoding, got {}", scale.len())
    };
    Ok(QEnc {
        dtype: dtype.unwrap_or(DType::U8),
        scale,
        zero_point: zps,
        axis,
        block_size: block,
        param_shape,
        lpbq: None,
    })
}

fn float_enc(bw: u32, what: &str) -> Result<TensorEncoding> {
    match bw {
        16 => Ok(TensorEncoding::Float(DType::F16)),
        _ => bail!("{what}: float encodings of {bw} bits are not supported (only 16)"),
    }
}

/// Parses an encodings file of either version; multi-scale layouts are resolved against `m`,
/// and every name must exist in `m`.
pub fn from_json(text: &str, m: &Model, origin: &str) -> Result<Encodings> {
    let v: J = serde_json::from_str(text).map_err(|e| anyhow!("{origin}: not valid JSON: {e}"))?;
    let mut enc = Encodings::default();
    let mut missing: Vec<String> = vec![];
    for (key, is_param) in [("activation_encodings", false), ("param_encodings", true)] {
        let target: &mut BTreeMap<String, TensorEncoding> = if is_param {
            &mut enc.params
        } else {
            &mut enc.activations
        };
        match v.get(key) {
            None | Some(J::Null) => {}
            Some(J::Object(map)) => {
                for (name, list) in map {
                    let what = format!("{origin}: {key}['{name}']");
                    // Names that are not in the model are reported all together below.
                    let list = list
                        .as_array()
                        .ok_or_else(|| anyhow!("{what}: expected a list"))?;
                    let first = list.first().ok_or_else(|| anyhow!("{what}: empty list"))?;
                    let bw = get(first, "bitwidth", &what)?.as_u64().unwrap_or(0) as u32;
                    if !names_exist(m, name, is_param) {
                        missing.push(name.clone());
                        continue;
                    }
                    if first.get("dtype").and_then(|d| d.as_str()) == Some("float") {
                        target.insert(name.clone(), float_enc(bw, &what)?);
                        continue;
                    }
                    let sym = first.get("is_symmetric").map(as_bool).unwrap_or(false);
                    let mut scale = vec![];
                    let mut offset = vec![];
                    for e in list {
                        scale.push(
                            get(e, "scale", &what)?
                                .as_f64()
                                .ok_or_else(|| anyhow!("{what}: scale is not a number"))?
                                as f32,
                        );
                        offset.push(
                            get(e, "offset", &what)?
                                .as_f64()
                                .ok_or_else(|| anyhow!("{what}: offset is not a number"))?
                                as i64,
                        );
                    }
                    target.insert(
                        name.clone(),
                        TensorEncoding::Int(
                            build(m, name, is_param, bw, sym, scale, offset, None)
                                .with_context(|| what.clone())?,
                        ),
                    );
                }
            }
            Some(J::Array(list)) => {
                for e in list {
                    let name = get(e, "name", &format!("{origin}: {key}"))?
                        .as_str()
                        .unwrap_or("")
                        .to_string();
                    let what = format!("{origin}: {key}['{name}']");
                    let bw = get(e, "bw", &what)?.as_u64().unwrap_or(0) as u32;
                    if !names_exist(m, &name, is_param) {
                        missing.push(name.clone());
                        continue;
                    }
                    if e.get("dtype").and_then(|d| d.as_str()).is_some_and(|d| {
                        d.eq_ignore_ascii_case("FP") || d.eq_ignore_ascii_case("float")
                    }) {
                        target.insert(name, float_enc(bw, &what)?);
                        continue;
                    }
                    let sym = e.get("is_sym").map(as_bool).unwrap_or(false);
                    let scale = as_f32s(get(e, "scale", &what)?, &what)?;
                    let offset = as_i64s(get(e, "offset", &what)?, &what)?;
                    let block = e
                        .get("block_size")
                        .and_then(|b| b.as_u64())
                        .map(|b| b as usize);
                    if e.get("enc_type").and_then(|t| t.as_str()) == Some("LPBQ") {
                        if !is_param {
                            bail!("{what}: LPBQ encodings are for weights, not activations");
                        }
                        let q = lpbq_from(m, &name, e, bw, sym, scale, offset, block)
                            .with_context(|| what.clone())?;
                        target.insert(name.clone(), TensorEncoding::Int(q));
                        continue;
                    }
                    target.insert(
                        name.clone(),
                        TensorEncoding::Int(
                            build(m, &name, is_param, bw, sym, scale, offset, block)
                                .with_context(|| what.clone())?,
                        ),
                    );
                }
            }
            Some(_) => bail!("{origin}: '{key}' must be an object (0.6.1) or a list (1.0.0)"),
        }
    }
    if !missing.is_empty() {
        bail!(
            "{origin}: {} encodings name tensors this model does not have (e.g. {}); the encodings were made for another model",
            missing.len(),
            missing.iter().take(5).map(|s| format!("'{s}'")).collect::<Vec<_>>().join(", ")
        );
    }
    crate::qdq::check_names(m, &enc).with_context(|| origin.to_string())?;
    Ok(enc)
}

/// An `LPBQ` entry back into a blocked encoding whose scales are `scale[c] * k` per block.
#[allow(clippy::too_many_arguments)]
fn lpbq_from(
    m: &Model,
    name: &str,
    e: &J,
    bw: u32,
    sym: bool,
    channel_scales: Vec<f32>,
    offset: Vec<i64>,
    block: Option<usize>,
) -> Result<QEnc> {
    let block = block.ok_or_else(|| anyhow!("an LPBQ encoding needs 'block_size'"))?;
    let cbw = get(e, "compressed_bw", "LPBQ")?
        .as_u64()
        .filter(|b| (1..=15).contains(b))
        .ok_or_else(|| anyhow!("'compressed_bw' must be an integer 1..=15"))? as u8;
    let int_scales: Vec<u16> = match get(e, "per_block_int_scale", "LPBQ")? {
        J::Array(a) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|k| u16::try_from(k).ok())
                    .ok_or_else(|| {
                        anyhow!("'per_block_int_scale' holds {x}, not a small unsigned integer")
                    })
            })
            .collect::<Result<_>>()?,
        _ => bail!("'per_block_int_scale' must be a list"),
    };
    if !sym {
        bail!("LPBQ encodings are symmetric (is_sym true)");
    }
    if channel_scales.len() != offset.len() {
        bail!(
            "{} scales and {} offsets",
            channel_scales.len(),
            offset.len()
        );
    }
    if let Some(s) = channel_scales
        .iter()
        .find(|s| !(s.is_finite() && **s > 0.0))
    {
        bail!("channel scale {s} must be positive and finite");
    }
    let mut dtype = None;
    for &o in &offset {
        let (d, _) = int_type(bw, true, o, "LPBQ")?;
        if dtype.is_some_and(|x| x != d) {
            bail!("mixed offsets across channels");
        }
        dtype = Some(d);
    }
    let dtype = dtype.ok_or_else(|| anyhow!("no channel scales"))?;
    let (axis, param_shape) = layout_for(m, name, int_scales.len(), Some(block))?;
    if param_shape.len() != 2 {
        bail!(
            "LPBQ takes 2-D weights; '{name}' has shape rank {}",
            param_shape.len()
        );
    }
    let inp = axis.unwrap_or(0);
    let lpbq = crate::qdq::LpbqScales {
        compressed_bw: cbw,
        int_scales,
        channel_scales,
        out_axis: 1 - inp,
    };
    let scale = lpbq.block_scales(&param_shape)?;
    Ok(QEnc {
        dtype,
        zero_point: vec![0; scale.len()],
        scale,
        axis,
        block_size: Some(block),
        param_shape,
        lpbq: Some(lpbq),
    })
}

fn names_exist(m: &Model, name: &str, is_param: bool) -> bool {
    let g = &m.graph;
    if is_param {
        g.initializer(name).is_some()
    } else {
        g.inputs.iter().any(|v| v.name == name)
            || g.nodes.iter().any(|n| n.outputs.iter().any(|o| o == name))
    }
}

/// Reads an encodings file (either version) for model `m`.
///
/// When the file records smoothing scales ([`SMOOTHING_KEY`]), they are applied to `m` first and
/// the encodings are checked against (and belong to) the smoothed model: the returned model is
/// the one to quantize.
pub fn read(path: &Path, m: &Model) -> Result<(Model, Encodings)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading encodings {}", path.display()))?;
    let origin = path.display().to_string();
    let smoothing = smoothing_from_json(&text, &origin)?;
    let sm = crate::smooth::apply_scales(m, &smoothing)
        .with_context(|| origin.clone())?
        .0;
    let mut enc = from_json(&text, &sm, &origin)?;
    enc.smoothing = smoothing;
    Ok((sm, enc))
}
