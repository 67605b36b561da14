//! AIMET encodings (1.0.0 JSON) of an LLM's re-quantized linear layers
//! ([`super::WeightQuantOptions`]): what a QAIRT user hands to the vendor converter, and what
//! `--encodings` reads back so the same deployment is rebuilt without calibration text.
//!
//! Names: parameters are the GGUF weight names (`blk.0.attn_q.weight`, `output.weight` or the
//! tied `token_embd.weight` as head), in the GGUF's own `[out, in]` layout, so an `LPBQ` entry's
//! `per_block_int_scale` is `[out][in / block_size]` row-major, AIMET's order. Activations are
//! the inputs of those products, named `<weight>.input` (the q/k/v projections read one input,
//! so their three entries hold the same scale).
//!
//! Written through [`npuc_quant::encodings::to_json`] (the ONNX quantizer's writer, so both
//! paths print the same format); read here, as the names are a GGUF's, not an ONNX graph's.

use super::WeightQuant;
use crate::{LlmError, Result};
use npuc_ir::DType;
use npuc_quant::qdq::{Encodings, LpbqScales, QEnc};
use npuc_quant::{EncodingsVersion, TensorEncoding};
use serde_json::Value as J;
use std::collections::BTreeMap;

/// The suffix naming a product's input among the activation encodings.
pub const INPUT_SUFFIX: &str = ".input";

/// How one linear weight was quantized.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightEncoding {
    /// LPBQ blocks: `int_scales` is `rows x (cols / block)` row-major.
    Lpbq {
        bw: u8,
        block: usize,
        compressed_bw: u8,
        int_scales: Vec<u16>,
        channel_scales: Vec<f32>,
    },
    /// Symmetric, one scale per output channel.
    PerChannel { bw: u8, scales: Vec<f32> },
}

impl WeightEncoding {
    /// The scheme these numbers belong to.
    pub fn scheme(&self) -> WeightQuant {
        match *self {
            WeightEncoding::Lpbq { bw, block, .. } => WeightQuant::Lpbq { bits: bw, block },
            WeightEncoding::PerChannel { bw, .. } => WeightQuant::PerChannel { bits: bw },
        }
    }

    /// Output channels (rows) the encoding is for.
    pub fn rows(&self) -> usize {
        match self {
            WeightEncoding::Lpbq { channel_scales, .. } => channel_scales.len(),
            WeightEncoding::PerChannel { scales, .. } => scales.len(),
        }
    }

    /// `w` (`rows x cols`) on this grid, dequantized (the values the graph computes with).
    pub fn fake_quantize(&self, w: &[f32], rows: usize, cols: usize) -> Result<Vec<f32>> {
        if self.rows() != rows {
            return Err(LlmError::msg(format!(
                "the encoding has {} output channels, the weight {rows}",
                self.rows()
            )));
        }
        match self {
            WeightEncoding::Lpbq {
                bw,
                block,
                compressed_bw,
                int_scales,
                channel_scales,
            } => Ok(npuc_quant::lpbq::quantize_with_scales(
                w,
                rows,
                cols,
                *block,
                *bw,
                *compressed_bw,
                int_scales.clone(),
                channel_scales.clone(),
            )
            .map_err(|e| LlmError::msg(e.to_string()))?
            .dequantize()),
            WeightEncoding::PerChannel { bw, scales } => {
                let qmax = ((1i32 << (bw - 1)) - 1) as f32;
                Ok(w.chunks_exact(cols)
                    .zip(scales)
                    .flat_map(|(row, &s)| {
                        row.iter()
                            .map(move |&x| (x / s).round().clamp(-qmax - 1.0, qmax) * s)
                    })
                    .collect())
            }
        }
    }
}

/// One activation's static symmetric scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActEncoding {
    pub bits: u8,
    pub scale: f32,
}

/// The encodings of one re-quantized LLM.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LlmEncodings {
    /// GGUF weight name -> its grid.
    pub weights: BTreeMap<String, WeightEncoding>,
    /// GGUF weight name -> the static scale of that product's input.
    pub inputs: BTreeMap<String, ActEncoding>,
    /// Informational (`quantizer_args` of the file), kept as read so a re-export is identical.
    pub quantizer_args: J,
}

fn int_dtype(bits: u8) -> Result<DType> {
    Ok(match bits {
        4 => DType::I4,
        8 => DType::I8,
        16 => DType::I16,
        b => {
            return Err(LlmError::msg(format!(
                "{b}-bit encodings cannot be written (4, 8 or 16)"
            )))
        }
    })
}

impl LlmEncodings {
    /// AIMET 1.0.0 JSON.
    pub fn to_json(&self) -> Result<String> {
        let mut enc = Encodings::default();
        for (name, w) in &self.weights {
            let q = match w {
                WeightEncoding::Lpbq {
                    bw,
                    block,
                    compressed_bw,
                    int_scales,
                    channel_scales,
                } => {
                    let rows = channel_scales.len();
                    let nb = int_scales.len() / rows.max(1);
                    let lpbq = LpbqScales {
                        compressed_bw: *compressed_bw,
                        int_scales: int_scales.clone(),
                        channel_scales: channel_scales.clone(),
                        out_axis: 0,
                    };
                    let scale = lpbq
                        .block_scales(&[rows, nb])
                        .map_err(|e| LlmError::msg(format!("'{name}': {e}")))?;
                    QEnc {
                        dtype: int_dtype(*bw)?,
                        zero_point: vec![0; scale.len()],
                        scale,
                        axis: Some(1),
                        block_size: Some(*block),
                        param_shape: vec![rows, nb],
                        lpbq: Some(lpbq),
                    }
                }
                WeightEncoding::PerChannel { bw, scales } => QEnc {
                    dtype: int_dtype(*bw)?,
                    zero_point: vec![0; scales.len()],
                    scale: scales.clone(),
                    axis: Some(0),
                    block_size: None,
                    param_shape: vec![scales.len()],
                    lpbq: None,
                },
            };
            enc.params.insert(name.clone(), TensorEncoding::Int(q));
        }
        for (weight, a) in &self.inputs {
            enc.activations.insert(
                format!("{weight}{INPUT_SUFFIX}"),
                TensorEncoding::Int(QEnc::per_tensor(int_dtype(a.bits)?, a.scale, 0)),
            );
        }
        npuc_quant::encodings::to_json(&enc, EncodingsVersion::V1_0_0, self.quantizer_args.clone())
            .map_err(|e| LlmError::msg(e.to_string()))
    }

    /// Reads what [`LlmEncodings::to_json`] writes (AIMET 1.0.0: `LPBQ` and `PER_CHANNEL`
    /// symmetric weights, `PER_TENSOR` symmetric activations named `<weight>.input`).
    /// `origin` names the file in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<LlmEncodings> {
        let err = |m: String| LlmError::msg(format!("{origin}: {m}"));
        let v: J = serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        match v.get("version").and_then(|x| x.as_str()) {
            Some("1.0.0") => {}
            other => {
                return Err(err(format!(
                    "encodings version {} is not 1.0.0 (LLM weight encodings are written as 1.0.0)",
                    other.map_or("(missing)".to_string(), |s| format!("'{s}'"))
                )))
            }
        }
        let mut out = LlmEncodings {
            quantizer_args: v.get("quantizer_args").cloned().unwrap_or(J::Null),
            ..Default::default()
        };
        let list = |key: &str| -> Result<Vec<J>> {
            match v.get(key) {
                None | Some(J::Null) => Ok(vec![]),
                Some(J::Array(a)) => Ok(a.clone()),
                Some(_) => Err(err(format!("'{key}' must be a list"))),
            }
        };
        for e in list("param_encodings")? {
            let (name, what) = entry_name(&e, origin, "param_encodings")?;
            let bw = entry_bits(&e, &what)?;
            if e.get("is_sym").and_then(|s| s.as_bool()) != Some(true) {
                return Err(LlmError::msg(format!(
                    "{what}: only symmetric weight encodings (is_sym true) are supported"
                )));
            }
            let scales = f32s(&e, "scale", &what)?;
            if let Some(s) = scales.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
                return Err(LlmError::msg(format!(
                    "{what}: scale {s} must be positive and finite"
                )));
            }
            let enc = match e.get("enc_type").and_then(|t| t.as_str()) {
                Some("LPBQ") => {
                    let block = uint(&e, "block_size", &what)? as usize;
                    let compressed_bw = uint(&e, "compressed_bw", &what)?;
                    if !(1..=15).contains(&compressed_bw) || block == 0 {
                        return Err(LlmError::msg(format!(
                            "{what}: compressed_bw {compressed_bw} / block_size {block} out of range"
                        )));
                    }
                    let int_scales = match e.get("per_block_int_scale") {
                        Some(J::Array(a)) => a
                            .iter()
                            .map(|x| x.as_u64().and_then(|k| u16::try_from(k).ok()))
                            .collect::<Option<Vec<u16>>>()
                            .ok_or_else(|| {
                                LlmError::msg(format!(
                                    "{what}: 'per_block_int_scale' must hold small unsigned integers"
                                ))
                            })?,
                        _ => {
                            return Err(LlmError::msg(format!(
                                "{what}: an LPBQ entry needs the list 'per_block_int_scale'"
                            )))
                        }
                    };
                    if scales.is_empty() || !int_scales.len().is_multiple_of(scales.len()) {
                        return Err(LlmError::msg(format!(
                            "{what}: {} block scales do not divide into {} channels",
                            int_scales.len(),
                            scales.len()
                        )));
                    }
                    WeightEncoding::Lpbq {
                        bw,
                        block,
                        compressed_bw: compressed_bw as u8,
                        int_scales,
                        channel_scales: scales,
                    }
                }
                Some("PER_CHANNEL") => WeightEncoding::PerChannel { bw, scales },
                other => {
                    return Err(LlmError::msg(format!(
                        "{what}: enc_type {other:?} is not one an LLM weight takes here (LPBQ or PER_CHANNEL)"
                    )))
                }
            };
            out.weights.insert(name, enc);
        }
        for e in list("activation_encodings")? {
            let (name, what) = entry_name(&e, origin, "activation_encodings")?;
            let Some(weight) = name.strip_suffix(INPUT_SUFFIX) else {
                return Err(LlmError::msg(format!(
                    "{what}: activation names here are '<weight>{INPUT_SUFFIX}' (a product's input)"
                )));
            };
            let bits = entry_bits(&e, &what)?;
            if !matches!(bits, 8 | 16) {
                return Err(LlmError::msg(format!(
                    "{what}: {bits}-bit activations are not supported (8 or 16)"
                )));
            }
            let s = f32s(&e, "scale", &what)?;
            let [scale] = s[..] else {
                return Err(LlmError::msg(format!(
                    "{what}: an activation takes one scale, not {}",
                    s.len()
                )));
            };
            if !(scale.is_finite() && scale > 0.0) {
                return Err(LlmError::msg(format!(
                    "{what}: scale {scale} must be positive and finite"
                )));
            }
            out.inputs
                .insert(weight.to_string(), ActEncoding { bits, scale });
        }
        if out.weights.is_empty() {
            return Err(err(
                "holds no weight encodings (param_encodings is empty)".into()
            ));
        }
        Ok(out)
    }

    /// The schemes the file's weights use: the one every non-head weight shares and the
    /// head's (`head` names the head weight) when it differs; the activation bits.
    pub fn schemes(&self, head: &str) -> Result<(WeightQuant, Option<WeightQuant>, Option<u8>)> {
        let mut body: Option<(WeightQuant, &str)> = None;
        for (name, w) in self.weights.iter().filter(|(n, _)| n.as_str() != head) {
            match body {
                Some((s, first)) if s != w.scheme() => {
                    return Err(LlmError::msg(format!(
                        "the encodings mix weight schemes ('{first}' is {}, '{name}' is {}); one scheme for every layer but the head is supported",
                        s.name(),
                        w.scheme().name()
                    )))
                }
                Some(_) => {}
                None => body = Some((w.scheme(), name)),
            }
        }
        let head_scheme = self.weights.get(head).map(|w| w.scheme());
        let scheme = match (body, head_scheme) {
            (Some((s, _)), _) => s,
            (None, Some(h)) => h,
            (None, None) => return Err(LlmError::msg("the encodings hold no weights".to_string())),
        };
        let mut bits = self.inputs.values().map(|a| a.bits);
        let first = bits.next();
        if bits.any(|b| Some(b) != first) {
            return Err(LlmError::msg(
                "the encodings mix activation bit widths; one width is supported".to_string(),
            ));
        }
        Ok((scheme, head_scheme.filter(|h| *h != scheme), first))
    }
}

fn entry_name(e: &J, origin: &str, key: &str) -> Result<(String, String)> {
    let name = e
        .get("name")
        .and_then(|n| n.as_str())
        .ok_or_else(|| LlmError::msg(format!("{origin}: an entry of {key} has no 'name'")))?;
    Ok((name.to_string(), format!("{origin}: {key}['{name}']")))
}

fn uint(e: &J, key: &str, what: &str) -> Result<u64> {
    e.get(key)
        .and_then(|x| x.as_u64())
        .ok_or_else(|| LlmError::msg(format!("{what}: '{key}' must be an unsigned integer")))
}

fn entry_bits(e: &J, what: &str) -> Result<u8> {
    match uint(e, "bw", what)? {
        b @ (4 | 8 | 16) => Ok(b as u8),
        b => Err(LlmError::msg(format!(
            "{what}: bw {b} is not supported (4, 8 or 16)"
        ))),
    }
}

fn f32s(e: &J, key: &str, what: &str) -> Result<Vec<f32>> {
    match e.get(key) {
        Some(J::Array(a)) => a
            .iter()
            .map(|x| x.as_f64().map(|f| f as f32))
            .collect::<Option<Vec<f32>>>()
            .ok_or_else(|| LlmError::msg(format!("{what}: '{key}' must hold numbers"))),
        _ => Err(LlmError::msg(format!("{what}: '{key}' must be a list"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LlmEncodings {
        let mut e = LlmEncodings {
            quantizer_args: serde_json::json!({"param_bitwidth": 4}),
            ..Default::default()
        };
        e.weights.insert(
            "blk.0.attn_q.weight".into(),
            WeightEncoding::Lpbq {
                bw: 4,
                block: 2,
                compressed_bw: 4,
                int_scales: vec![16, 3, 7, 16],
                channel_scales: vec![0.0123, 1.5e-4],
            },
        );
        e.weights.insert(
            "output.weight".into(),
            WeightEncoding::PerChannel {
                bw: 8,
                scales: vec![0.25, 0.1],
            },
        );
        e.inputs.insert(
            "blk.0.attn_q.weight".into(),
            ActEncoding {
                bits: 16,
                scale: 3.0e-4,
            },
        );
        e
    }

    #[test]
    fn json_round_trip_is_identical() {
        let e = sample();
        let text = e.to_json().unwrap();
        let back = LlmEncodings::from_json(&text, "t.json").unwrap();
        assert_eq!(back, e);
        assert_eq!(back.to_json().unwrap(), text);
        let v: J = serde_json::from_str(&text).unwrap();
        let q = &v["param_encodings"][0];
        assert_eq!(q["enc_type"], "LPBQ");
        assert_eq!(q["per_block_int_scale"], serde_json::json!([16, 3, 7, 16]));
        assert_eq!(q["offset"], serde_json::json!([-8, -8]));
        assert_eq!(
            v["activation_encodings"][0]["name"],
            "blk.0.attn_q.weight.input"
        );
        let (s, h, a) = back.schemes("output.weight").unwrap();
        assert_eq!(
            (s, h, a),
            (
                WeightQuant::Lpbq { bits: 4, block: 2 },
                Some(WeightQuant::PerChannel { bits: 8 }),
                Some(16)
            )
        );
    }

    #[test]
    fn bad_files_are_named() {
        let text = sample().to_json().unwrap();
        let bad = text.replace("\"version\": \"1.0.0\"", "\"version\": \"0.6.1\"");
        let e = LlmEncodings::from_json(&bad, "x.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.json") && e.contains("0.6.1"), "{e}");
        let bad = text.replace("\"bw\": 16", "\"bw\": 12");
        let e = LlmEncodings::from_json(&bad, "x.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.0.attn_q.weight.input") && e.contains("12"),
            "{e}"
        );
        let e = LlmEncodings::from_json("{", "x.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not valid JSON"), "{e}");
    }
}
