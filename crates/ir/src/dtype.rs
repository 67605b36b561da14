//! Element types. The numbering follows ONNX `TensorProto.DataType` where one exists so that
//! frontends and the artifact format can share it; types ONNX lacks get numbers from 100 up.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    U8,
    I8,
    U16,
    I16,
    I32,
    I64,
    String,
    Bool,
    F16,
    F64,
    U32,
    U64,
    BF16,
    /// Packed signed 4-bit integers, two per byte, low nibble first (ONNX INT4).
    I4,
    /// Packed unsigned 4-bit integers, two per byte, low nibble first (ONNX UINT4).
    U4,
    /// 8-bit floats (ONNX FLOAT8*), one code per byte; see `lowp`.
    F8E4M3FN,
    F8E4M3FNUZ,
    F8E5M2,
    F8E5M2FNUZ,
    /// Power-of-two scales 2^(code-127) (ONNX FLOAT8E8M0).
    F8E8M0,
    /// 4-bit float e2m1, packed two per byte in files, one code per byte in memory.
    F4E2M1,
    /// 2-bit integers, packed four per byte in files, one per byte in memory.
    I2,
    U2,
}

impl DType {
    pub const ALL: [DType; 24] = [
        DType::F32,
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::String,
        DType::Bool,
        DType::F16,
        DType::F64,
        DType::U32,
        DType::U64,
        DType::BF16,
        DType::I4,
        DType::U4,
        DType::F8E4M3FN,
        DType::F8E4M3FNUZ,
        DType::F8E5M2,
        DType::F8E5M2FNUZ,
        DType::F8E8M0,
        DType::F4E2M1,
        DType::I2,
        DType::U2,
    ];

    /// ONNX `TensorProto.DataType` code.
    pub fn onnx_code(self) -> i32 {
        match self {
            DType::F32 => 1,
            DType::U8 => 2,
            DType::I8 => 3,
            DType::U16 => 4,
            DType::I16 => 5,
            DType::I32 => 6,
            DType::I64 => 7,
            DType::String => 8,
            DType::Bool => 9,
            DType::F16 => 10,
            DType::F64 => 11,
            DType::U32 => 12,
            DType::U64 => 13,
            DType::BF16 => 16,
            DType::U4 => 21,
            DType::I4 => 22,
            DType::F8E4M3FN => 17,
            DType::F8E4M3FNUZ => 18,
            DType::F8E5M2 => 19,
            DType::F8E5M2FNUZ => 20,
            DType::F4E2M1 => 23,
            DType::F8E8M0 => 24,
            DType::U2 => 25,
            DType::I2 => 26,
        }
    }

    pub fn from_onnx_code(code: i32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.onnx_code() == code)
    }

    /// Size in bytes of one element in memory. Packed 4-bit types report 1 (they are unpacked
    /// to one byte per element in memory; the packing is a storage concern). Strings report 0.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::U8 | DType::I8 | DType::Bool | DType::I4 | DType::U4 => 1,
            DType::F8E4M3FN
            | DType::F8E4M3FNUZ
            | DType::F8E5M2
            | DType::F8E5M2FNUZ
            | DType::F8E8M0
            | DType::F4E2M1
            | DType::I2
            | DType::U2 => 1,
            DType::String => 0,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16) || self.is_small_float()
    }

    /// 8- and 4-bit float formats (stored one code per byte).
    pub fn is_small_float(self) -> bool {
        matches!(
            self,
            DType::F8E4M3FN
                | DType::F8E4M3FNUZ
                | DType::F8E5M2
                | DType::F8E5M2FNUZ
                | DType::F8E8M0
                | DType::F4E2M1
        )
    }

    /// Bits per element in ONNX files (sub-byte types are packed there).
    pub fn packed_bits(self) -> usize {
        match self {
            DType::I4 | DType::U4 | DType::F4E2M1 => 4,
            DType::I2 | DType::U2 => 2,
            DType::String => 0,
            d => d.size() * 8,
        }
    }

    /// The dtype whose Rust element type stores this one in memory.
    pub fn storage(self) -> DType {
        match self {
            DType::I4 | DType::I2 => DType::I8,
            DType::U4 | DType::U2 => DType::U8,
            d if d.is_small_float() => DType::U8,
            d => d,
        }
    }

    pub fn is_int(self) -> bool {
        matches!(
            self,
            DType::U8
                | DType::I8
                | DType::U16
                | DType::I16
                | DType::I32
                | DType::I64
                | DType::U32
                | DType::U64
                | DType::I4
                | DType::U4
                | DType::I2
                | DType::U2
        )
    }

    pub fn is_signed_int(self) -> bool {
        matches!(
            self,
            DType::I8 | DType::I16 | DType::I32 | DType::I64 | DType::I4
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::U16 => "u16",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::String => "string",
            DType::Bool => "bool",
            DType::F16 => "f16",
            DType::F64 => "f64",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::BF16 => "bf16",
            DType::I4 => "i4",
            DType::U4 => "u4",
            DType::F8E4M3FN => "f8e4m3fn",
            DType::F8E4M3FNUZ => "f8e4m3fnuz",
            DType::F8E5M2 => "f8e5m2",
            DType::F8E5M2FNUZ => "f8e5m2fnuz",
            DType::F8E8M0 => "f8e8m0",
            DType::F4E2M1 => "f4e2m1",
            DType::I2 => "i2",
            DType::U2 => "u2",
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
