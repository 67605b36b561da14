//! The GGML tensor type table: ids as they appear in GGUF files, block sizes and bytes per block.
//!
//! Block-quantized weights enter the IR as `u8` tensors of shape `[rows, row_bytes]` holding the raw
//! blocks exactly as GGUF stores them (so the artifact format, weight dedup and mmap all work on them
//! unchanged); the ops that read them (`npuc.GgmlMatMul`, `npuc.GgmlGather`) carry the [`GgmlType`]
//! name and the logical row length as attributes. The layouts themselves follow ggml's
//! `ggml-common.h`; dequantization and dot kernels live in the `npuc-ggml` crate.

use std::fmt;

/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

/// A GGML tensor type (the `ggml_type` enum of ggml.h; ids are stable on disk).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

impl GgmlType {
    /// Every type this table knows, in id order.
    pub const ALL: [GgmlType; 32] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
    ];

    /// `(id, name, elements per block, bytes per block)`.
    const fn info(self) -> (u32, &'static str, usize, usize) {
        match self {
            GgmlType::F32 => (0, "F32", 1, 4),
            GgmlType::F16 => (1, "F16", 1, 2),
            GgmlType::Q4_0 => (2, "Q4_0", 32, 18),
            GgmlType::Q4_1 => (3, "Q4_1", 32, 20),
            GgmlType::Q5_0 => (6, "Q5_0", 32, 22),
            GgmlType::Q5_1 => (7, "Q5_1", 32, 24),
            GgmlType::Q8_0 => (8, "Q8_0", 32, 34),
            GgmlType::Q8_1 => (9, "Q8_1", 32, 36),
            GgmlType::Q2_K => (10, "Q2_K", QK_K, 84),
            GgmlType::Q3_K => (11, "Q3_K", QK_K, 110),
            GgmlType::Q4_K => (12, "Q4_K", QK_K, 144),
            GgmlType::Q5_K => (13, "Q5_K", QK_K, 176),
            GgmlType::Q6_K => (14, "Q6_K", QK_K, 210),
            GgmlType::Q8_K => (15, "Q8_K", QK_K, 292),
            GgmlType::IQ2_XXS => (16, "IQ2_XXS", QK_K, 66),
            GgmlType::IQ2_XS => (17, "IQ2_XS", QK_K, 74),
            GgmlType::IQ3_XXS => (18, "IQ3_XXS", QK_K, 98),
            GgmlType::IQ1_S => (19, "IQ1_S", QK_K, 50),
            GgmlType::IQ4_NL => (20, "IQ4_NL", 32, 18),
            GgmlType::IQ3_S => (21, "IQ3_S", QK_K, 110),
            GgmlType::IQ2_S => (22, "IQ2_S", QK_K, 82),
            GgmlType::IQ4_XS => (23, "IQ4_XS", QK_K, 136),
            GgmlType::I8 => (24, "I8", 1, 1),
            GgmlType::I16 => (25, "I16", 1, 2),
            GgmlType::I32 => (26, "I32", 1, 4),
            GgmlType::I64 => (27, "I64", 1, 8),
            GgmlType::F64 => (28, "F64", 1, 8),
            GgmlType::IQ1_M => (29, "IQ1_M", QK_K, 56),
            GgmlType::BF16 => (30, "BF16", 1, 2),
            GgmlType::TQ1_0 => (34, "TQ1_0", QK_K, 54),
            GgmlType::TQ2_0 => (35, "TQ2_0", QK_K, 66),
            GgmlType::MXFP4 => (39, "MXFP4", 32, 17),
        }
    }

    /// The on-disk id.
    pub fn id(self) -> u32 {
        self.info().0
    }

    /// The name ggml prints (`Q4_K`, `F16`, ...).
    pub fn name(self) -> &'static str {
        self.info().1
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> usize {
        self.info().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.info().3
    }

    /// Whether this is a block-quantized type (not a plain scalar type).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// Case-insensitive lookup by name (`q4_k`, `Q8_0`).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Bytes of one row of `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        let (_, _, bs, ts) = self.info();
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(ts)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_are_unique_and_round_trip() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(&t.name().to_lowercase()), Some(t));
        }
        assert_eq!(
            GgmlType::from_id(4),
            None,
            "4 and 5 (Q4_2/Q4_3) were removed from ggml"
        );
        assert_eq!(GgmlType::Q4_K.row_bytes(640), None);
        assert_eq!(GgmlType::Q4_K.row_bytes(2048), Some(8 * 144));
        assert_eq!(GgmlType::Q8_0.row_bytes(640), Some(20 * 34));
    }
}
