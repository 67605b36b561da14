//! The tokenizer's GGUF metadata as JSON, so that a `.npuc` artifact can carry the tokenizer
//! (`tokenizer.*` keys and `general.name`) in its JSON META and rebuild it without the GGUF.
//!
//! Plain JSON types keep it readable with `jq`: strings, booleans, integers (JSON numbers
//! without a fraction) and floats (numbers that serde_json writes with a fraction or exponent).
//! Non-finite floats, which JSON cannot hold, are the strings `"inf"`, `"-inf"` and `"nan"`.

use crate::{Result, TokenizerError};
use npuc_gguf::{MetaValue, ValueType};
use serde_json::{Map, Number, Value};

/// Whether a GGUF metadata key belongs to the tokenizer (what [`metadata_to_json`] keeps).
pub fn is_tokenizer_key(key: &str) -> bool {
    key.starts_with("tokenizer.") || key == "general.name"
}

fn to_json(v: &MetaValue) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The tokenizer keys of `meta` as one JSON object (key order kept).
pub fn metadata_to_json(meta: &[(String, MetaValue)]) -> Value {
    let mut m = Map::new();
    for (k, v) in meta {
        if is_tokenizer_key(k) {
            m.insert(k.clone(), to_json(v));
        }
    }
    Value::Object(m)
}

fn special_float(v: &Value) -> Option<f64> {
    match v.as_str()? {
        "inf" => Some(f64::INFINITY),
        "-inf" => Some(f64::NEG_INFINITY),
        "nan" => Some(f64::NAN),
        _ => None,
    }
}

fn scalar(key: &str, v: &Value) -> std::result::Result<MetaValue, String> {
    Ok(match v {
        Value::Bool(b) => MetaValue::Bool(*b),
        Value::String(s) => MetaValue::String(s.clone()),
        Value::Number(n) if n.is_f64() => MetaValue::F32(n.as_f64().unwrap_or(f64::NAN) as f32),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) if u <= u32::MAX as u64 => MetaValue::U32(u as u32),
            (Some(u), _) => MetaValue::U64(u),
            (None, Some(i)) if i >= i32::MIN as i64 => MetaValue::I32(i as i32),
            (None, Some(i)) => MetaValue::I64(i),
            _ => return Err(format!("{key}: number {n} out of range")),
        },
        other => return Err(format!("{key}: unsupported JSON value {other}")),
    })
}

fn value(key: &str, v: &Value) -> std::result::Result<MetaValue, String> {
    let Value::Array(items) = v else {
        return scalar(key, v);
    };
    // All strings: a string array, even if some read "inf" (vocabularies have such tokens); a
    // float array has at least one number (an all-non-finite float array is not representable).
    if items.iter().all(Value::is_string) {
        return Ok(MetaValue::Array(
            ValueType::String,
            items
                .iter()
                .map(|x| MetaValue::String(x.as_str().unwrap_or("").to_string()))
                .collect(),
        ));
    }
    if items.iter().all(Value::is_boolean) {
        return Ok(MetaValue::Array(
            ValueType::Bool,
            items
                .iter()
                .map(|x| MetaValue::Bool(x.as_bool() == Some(true)))
                .collect(),
        ));
    }
    let floats = items
        .iter()
        .any(|x| x.as_number().is_some_and(Number::is_f64))
        || (items.iter().any(Value::is_number) && items.iter().any(|x| special_float(x).is_some()));
    if floats {
        let mut out = Vec::with_capacity(items.len());
        for (i, x) in items.iter().enumerate() {
            let f = x
                .as_f64()
                .or_else(|| special_float(x))
                .ok_or_else(|| format!("{key}[{i}]: expected a number, found {x}"))?;
            out.push(MetaValue::F32(f as f32));
        }
        return Ok(MetaValue::Array(ValueType::F32, out));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, x) in items.iter().enumerate() {
        let n = x
            .as_i64()
            .ok_or_else(|| format!("{key}[{i}]: expected an integer, found {x}"))?;
        out.push(MetaValue::I32(
            i32::try_from(n).map_err(|_| format!("{key}[{i}]: {n} out of i32 range"))?,
        ));
    }
    Ok(MetaValue::Array(ValueType::I32, out))
}

/// Inverse of [`metadata_to_json`]: the key/value pairs for [`crate::Tokenizer::from_metadata`].
pub fn metadata_from_json(json: &Value) -> Result<Vec<(String, MetaValue)>> {
    let err = |msg: String| TokenizerError::Metadata {
        model: "artifact metadata".into(),
        key: "tokenizer JSON".into(),
        msg,
    };
    let obj = json
        .as_object()
        .ok_or_else(|| err(format!("expected a JSON object, found {}", kind(json))))?;
    obj.iter()
        .map(|(k, v)| Ok((k.clone(), value(k, v).map_err(err)?)))
        .collect()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a bool",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
