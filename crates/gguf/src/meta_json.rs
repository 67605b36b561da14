//! GGUF metadata entries and their lossless JSON form: the one JSON form of GGUF metadata
//! (an LLM artifact stores the tokenizer's keys this way, and the tokenizer is rebuilt from it
//! without the GGUF). Every value keeps its GGUF type.

use crate::{MetaValue, ValueType};
use serde_json::{json, Value as Json};

/// Why JSON does not hold valid metadata (the message names the key).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct MetaJsonError(String);

type Result<T> = std::result::Result<T, MetaJsonError>;

macro_rules! bail {
    ($($t:tt)*) => {
        return Err(MetaJsonError(format!($($t)*)))
    };
}

/// GGUF metadata entries (key order kept) with a typed JSON round-trip: every value keeps its
/// GGUF type, so `Tokenizer::from_metadata` sees the same values from a `.npuc` as from the GGUF.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GgufMetaJson {
    /// The entries, in file order.
    pub entries: Vec<(String, MetaValue)>,
}

fn type_name(t: ValueType) -> &'static str {
    match t {
        ValueType::U8 => "u8",
        ValueType::I8 => "i8",
        ValueType::U16 => "u16",
        ValueType::I16 => "i16",
        ValueType::U32 => "u32",
        ValueType::I32 => "i32",
        ValueType::F32 => "f32",
        ValueType::Bool => "bool",
        ValueType::String => "str",
        ValueType::Array => "array",
        ValueType::U64 => "u64",
        ValueType::I64 => "i64",
        ValueType::F64 => "f64",
    }
}

fn type_of(s: &str) -> Option<ValueType> {
    Some(match s {
        "u8" => ValueType::U8,
        "i8" => ValueType::I8,
        "u16" => ValueType::U16,
        "i16" => ValueType::I16,
        "u32" => ValueType::U32,
        "i32" => ValueType::I32,
        "f32" => ValueType::F32,
        "bool" => ValueType::Bool,
        "str" => ValueType::String,
        "array" => ValueType::Array,
        "u64" => ValueType::U64,
        "i64" => ValueType::I64,
        "f64" => ValueType::F64,
        _ => return None,
    })
}

/// A scalar's JSON value (arrays of scalars are written as plain JSON arrays of these).
fn scalar_json(v: &MetaValue) -> Json {
    match v {
        MetaValue::Array(t, items) => json!({
            "type": type_name(*t),
            "value": items.iter().map(scalar_json).collect::<Vec<_>>(),
        }),
        // f32 -> f64 is exact, and serde_json prints the shortest round-tripping f64.
        other => serde_json::to_value(other).unwrap_or(Json::Null),
    }
}

fn scalar_from(t: ValueType, v: &Json, key: &str) -> Result<MetaValue> {
    let bad = || {
        MetaJsonError(format!(
            "metadata '{key}': {v} is not a valid {}",
            type_name(t)
        ))
    };
    let u = || v.as_u64().ok_or_else(bad);
    let i = || v.as_i64().ok_or_else(bad);
    Ok(match t {
        ValueType::U8 => MetaValue::U8(u()?.try_into().map_err(|_| bad())?),
        ValueType::I8 => MetaValue::I8(i()?.try_into().map_err(|_| bad())?),
        ValueType::U16 => MetaValue::U16(u()?.try_into().map_err(|_| bad())?),
        ValueType::I16 => MetaValue::I16(i()?.try_into().map_err(|_| bad())?),
        ValueType::U32 => MetaValue::U32(u()?.try_into().map_err(|_| bad())?),
        ValueType::I32 => MetaValue::I32(i()?.try_into().map_err(|_| bad())?),
        ValueType::U64 => MetaValue::U64(u()?),
        ValueType::I64 => MetaValue::I64(i()?),
        ValueType::F32 => MetaValue::F32(v.as_f64().ok_or_else(bad)? as f32),
        ValueType::F64 => MetaValue::F64(v.as_f64().ok_or_else(bad)?),
        ValueType::Bool => MetaValue::Bool(v.as_bool().ok_or_else(bad)?),
        ValueType::String => MetaValue::String(v.as_str().ok_or_else(bad)?.to_string()),
        ValueType::Array => {
            let et = v
                .get("type")
                .and_then(|t| t.as_str())
                .and_then(type_of)
                .ok_or_else(bad)?;
            let items = v.get("value").and_then(|x| x.as_array()).ok_or_else(bad)?;
            MetaValue::Array(
                et,
                items
                    .iter()
                    .map(|x| scalar_from(et, x, key))
                    .collect::<Result<_>>()?,
            )
        }
    })
}

impl GgufMetaJson {
    /// The entries of `all` whose key starts with one of `prefixes`.
    pub fn filtered(all: &[(String, MetaValue)], prefixes: &[&str]) -> GgufMetaJson {
        GgufMetaJson {
            entries: all
                .iter()
                .filter(|(k, _)| prefixes.iter().any(|p| k.starts_with(p)))
                .cloned()
                .collect(),
        }
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// JSON: `[[key, {"type": T, "value": V}], ...]` (a list keeps the key order).
    pub fn to_json(&self) -> Json {
        Json::Array(
            self.entries
                .iter()
                .map(|(k, v)| {
                    json!([k, {"type": type_name(v.value_type()), "value": scalar_json(v)}])
                })
                .collect(),
        )
    }

    /// Parses what [`GgufMetaJson::to_json`] wrote.
    pub fn from_json(j: &Json) -> Result<GgufMetaJson> {
        let Some(list) = j.as_array() else {
            bail!("GGUF metadata must be a JSON list of [key, {{type, value}}] pairs");
        };
        let mut entries = Vec::with_capacity(list.len());
        for e in list {
            let (Some(k), Some(tv)) = (e.get(0).and_then(|k| k.as_str()), e.get(1)) else {
                bail!("GGUF metadata entry {e} is not [key, {{type, value}}]");
            };
            let t = tv.get("type").and_then(|t| t.as_str()).and_then(type_of);
            let (Some(t), Some(v)) = (t, tv.get("value")) else {
                bail!("GGUF metadata '{k}' has no valid type/value");
            };
            entries.push((k.to_string(), scalar_from(t, v, k)?));
        }
        Ok(GgufMetaJson { entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_keeps_types() {
        let m = GgufMetaJson {
            entries: vec![
                ("a".into(), MetaValue::U32(7)),
                ("b".into(), MetaValue::F32(0.1)),
                ("c".into(), MetaValue::String("x\"y".into())),
                (
                    "d".into(),
                    MetaValue::Array(ValueType::I32, vec![MetaValue::I32(-1), MetaValue::I32(3)]),
                ),
                ("e".into(), MetaValue::Array(ValueType::String, vec![])),
                ("f".into(), MetaValue::Bool(true)),
            ],
        };
        let s = serde_json::to_string(&m.to_json()).unwrap();
        let back = GgufMetaJson::from_json(&serde_json::from_str(&s).unwrap()).unwrap();
        assert_eq!(back, m);
        assert!(GgufMetaJson::from_json(&json!([["k", {"type": "u8", "value": 300}]])).is_err());
    }
}
