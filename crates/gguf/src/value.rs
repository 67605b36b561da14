//! GGUF metadata values.

use std::fmt;

/// The `gguf_type` of a metadata value (ids as stored on disk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes of one value on disk; `None` for strings and arrays (variable length).
    pub fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The smallest number of bytes one value of this type can take on disk (bounds array counts).
    pub fn min_size(self) -> usize {
        self.fixed_size().unwrap_or(8)
    }
}

/// One metadata value. Arrays keep their element type even when empty.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(ValueType, Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    pub fn value_type(&self) -> ValueType {
        match self {
            MetaValue::U8(_) => ValueType::U8,
            MetaValue::I8(_) => ValueType::I8,
            MetaValue::U16(_) => ValueType::U16,
            MetaValue::I16(_) => ValueType::I16,
            MetaValue::U32(_) => ValueType::U32,
            MetaValue::I32(_) => ValueType::I32,
            MetaValue::F32(_) => ValueType::F32,
            MetaValue::Bool(_) => ValueType::Bool,
            MetaValue::String(_) => ValueType::String,
            MetaValue::Array(..) => ValueType::Array,
            MetaValue::U64(_) => ValueType::U64,
            MetaValue::I64(_) => ValueType::I64,
            MetaValue::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value that is non-negative, as u64 (writers differ in the width they use).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value as i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U8(v) => Some(v as i64),
            MetaValue::U16(v) => Some(v as i64),
            MetaValue::U32(v) => Some(v as i64),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// A float or integer value as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(_, v) => Some(v),
            _ => None,
        }
    }

    /// An array of strings (`tokenizer.ggml.tokens`, `.merges`).
    pub fn as_str_array(&self) -> Option<Vec<&str>> {
        self.as_array()?.iter().map(|v| v.as_str()).collect()
    }

    /// An array of numbers as f32 (`tokenizer.ggml.scores`).
    pub fn as_f32_array(&self) -> Option<Vec<f32>> {
        self.as_array()?
            .iter()
            .map(|v| v.as_f64().map(|x| x as f32))
            .collect()
    }

    /// An array of integers as i64 (`tokenizer.ggml.token_type`, per-layer head counts).
    pub fn as_i64_array(&self) -> Option<Vec<i64>> {
        self.as_array()?.iter().map(|v| v.as_i64()).collect()
    }
}

impl fmt::Display for MetaValue {
    /// Short human form; long arrays are summarised.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::String(s) if s.chars().count() > 80 => {
                let head: String = s.chars().take(77).collect();
                write!(f, "{head:?}...")
            }
            MetaValue::String(s) => write!(f, "{s:?}"),
            MetaValue::Array(t, v) if v.len() > 8 => {
                write!(f, "[{t:?} x {}: ", v.len())?;
                for x in &v[..3] {
                    write!(f, "{x}, ")?;
                }
                write!(f, "...]")
            }
            MetaValue::Array(_, v) => {
                write!(f, "[")?;
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{x}")?;
                }
                write!(f, "]")
            }
            MetaValue::U8(v) => write!(f, "{v}"),
            MetaValue::I8(v) => write!(f, "{v}"),
            MetaValue::U16(v) => write!(f, "{v}"),
            MetaValue::I16(v) => write!(f, "{v}"),
            MetaValue::U32(v) => write!(f, "{v}"),
            MetaValue::I32(v) => write!(f, "{v}"),
            MetaValue::U64(v) => write!(f, "{v}"),
            MetaValue::I64(v) => write!(f, "{v}"),
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
            MetaValue::Bool(v) => write!(f, "{v}"),
        }
    }
}

/// Plain JSON form: numbers, booleans, strings and arrays as themselves (f32 widened exactly to
/// f64, printed shortest); non-finite floats as the strings `"inf"`, `"-inf"`, `"nan"`, since JSON
/// has no such numbers. The element type of an array is not recorded: writers that must round
/// trip types add it themselves.
impl serde::Serialize for MetaValue {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        fn float<S: serde::Serializer>(f: f64, s: S) -> Result<S::Ok, S::Error> {
            if f.is_finite() {
                s.serialize_f64(f)
            } else if f.is_nan() {
                s.serialize_str("nan")
            } else if f > 0.0 {
                s.serialize_str("inf")
            } else {
                s.serialize_str("-inf")
            }
        }
        match self {
            MetaValue::U8(x) => s.serialize_u8(*x),
            MetaValue::I8(x) => s.serialize_i8(*x),
            MetaValue::U16(x) => s.serialize_u16(*x),
            MetaValue::I16(x) => s.serialize_i16(*x),
            MetaValue::U32(x) => s.serialize_u32(*x),
            MetaValue::I32(x) => s.serialize_i32(*x),
            MetaValue::U64(x) => s.serialize_u64(*x),
            MetaValue::I64(x) => s.serialize_i64(*x),
            MetaValue::F32(x) => float(*x as f64, s),
            MetaValue::F64(x) => float(*x, s),
            MetaValue::Bool(x) => s.serialize_bool(*x),
            MetaValue::String(x) => s.serialize_str(x),
            MetaValue::Array(_, items) => s.collect_seq(items),
        }
    }
}
