//! Sub-byte and 8-bit float formats (ONNX FLOAT8E4M3FN/FNUZ, FLOAT8E5M2/FNUZ, FLOAT8E8M0,
//! FLOAT4E2M1) and 2-bit integers: bit-exact conversions to and from f32. Tensors of these
//! types store one code per byte (`u8`; `i8` sign-extended for INT2).

use crate::dtype::DType;

/// Layout of a small float: exponent bits, mantissa bits, bias, and how specials are encoded.
#[derive(Clone, Copy)]
struct Fmt {
    mant: u32,
    bias: i32,
    /// Largest finite code (sign bit clear).
    max_code: u8,
    /// `Some(code)` when the format has an infinity.
    inf: Option<u8>,
    /// NaN code with sign clear (`None`: no NaN).
    nan: Option<u8>,
    /// FNUZ formats: no negative zero, NaN is 0x80.
    uz: bool,
    bits: u32,
}

fn fmt(d: DType) -> Option<Fmt> {
    Some(match d {
        DType::F8E4M3FN => Fmt {
            mant: 3,
            bias: 7,
            max_code: 0x7e,
            inf: None,
            nan: Some(0x7f),
            uz: false,
            bits: 8,
        },
        DType::F8E4M3FNUZ => Fmt {
            mant: 3,
            bias: 8,
            max_code: 0x7f,
            inf: None,
            nan: Some(0x80),
            uz: true,
            bits: 8,
        },
        DType::F8E5M2 => Fmt {
            mant: 2,
            bias: 15,
            max_code: 0x7b,
            inf: Some(0x7c),
            nan: Some(0x7f),
            uz: false,
            bits: 8,
        },
        DType::F8E5M2FNUZ => Fmt {
            mant: 2,
            bias: 16,
            max_code: 0x7f,
            inf: None,
            nan: Some(0x80),
            uz: true,
            bits: 8,
        },
        DType::F4E2M1 => Fmt {
            mant: 1,
            bias: 1,
            max_code: 0x7,
            inf: None,
            nan: None,
            uz: false,
            bits: 4,
        },
        _ => return None,
    })
}

/// Decodes one code of a small-float type to f32 (`None` for other dtypes).
pub fn to_f32(d: DType, code: u8) -> Option<f32> {
    if d == DType::F8E8M0 {
        return Some(if code == 0xff {
            f32::NAN
        } else {
            (code as f32 - 127.0).exp2()
        });
    }
    let f = fmt(d)?;
    let sign_bit = 1u8 << (f.bits - 1);
    if f.uz && code == 0x80 {
        return Some(f32::NAN);
    }
    let mag = code & (sign_bit - 1);
    let neg = code & sign_bit != 0;
    if !f.uz {
        if let Some(n) = f.nan {
            if mag == n || (f.inf.is_some() && mag > f.inf.unwrap_or(0xff)) {
                return Some(f32::NAN);
            }
        }
        if Some(mag) == f.inf {
            return Some(if neg {
                f32::NEG_INFINITY
            } else {
                f32::INFINITY
            });
        }
    }
    let e = (mag >> f.mant) as i32;
    let m = (mag & ((1 << f.mant) - 1)) as f32;
    let scale = (1u32 << f.mant) as f32;
    let v = if e == 0 {
        m / scale * (1.0 - f.bias as f32).exp2()
    } else {
        (1.0 + m / scale) * ((e - f.bias) as f32).exp2()
    };
    Some(if neg { -v } else { v })
}

/// Encodes an f32 with round-to-nearest-even. With `saturate`, out-of-range values (and
/// infinities, for formats without one) become the largest finite value; without it they become
/// infinity or NaN as the format allows.
pub fn from_f32(d: DType, x: f32, saturate: bool) -> Option<u8> {
    if d == DType::F8E8M0 {
        return Some(e8m0_from_f32(x, E8m0Round::Up, saturate));
    }
    let f = fmt(d)?;
    let sign_bit = 1u8 << (f.bits - 1);
    let bits = x.to_bits();
    let neg = bits >> 31 == 1;
    let sgn = |c: u8| {
        if neg && !(f.uz && c == 0) {
            c | sign_bit
        } else {
            c
        }
    };
    let nan_code = || match f.nan {
        Some(n) if f.uz => n,
        Some(n) => n | if neg { sign_bit } else { 0 },
        // FLOAT4E2M1 has no NaN; ONNX maps NaN to the negative-zero code.
        None => sign_bit,
    };
    if x.is_nan() {
        return Some(nan_code());
    }
    let overflow = || {
        if saturate {
            sgn(f.max_code)
        } else if let Some(i) = f.inf {
            sgn(i)
        } else {
            nan_code()
        }
    };
    if x.is_infinite() {
        return Some(if saturate || f.nan.is_none() {
            sgn(f.max_code)
        } else {
            overflow()
        });
    }
    let abs = bits & 0x7fff_ffff;
    if abs == 0 {
        return Some(sgn(0));
    }
    let ef = (abs >> 23) as i32;
    let mf = abs & 0x7f_ffff;
    // Full significand with the implicit bit, and the unbiased exponent of its lsb scale.
    let (full, e_unb) = if ef == 0 {
        (mf, -126)
    } else {
        (mf | 0x80_0000, ef - 127)
    };
    let et = e_unb + f.bias; // target biased exponent if normal
    let shift = if et >= 1 {
        23 - f.mant as i32
    } else {
        23 - f.mant as i32 + (1 - et)
    };
    let code: u64 = if shift >= 32 {
        0
    } else {
        let sh = shift as u32;
        let r = (full >> sh) as u64;
        let rem = full & ((1u32 << sh) - 1);
        let half = 1u32 << (sh - 1);
        let r = if rem > half || (rem == half && r & 1 == 1) {
            r + 1
        } else {
            r
        };
        if et >= 1 {
            // r includes the implicit bit (1 << mant); the exponent field absorbs it (and any
            // carry from rounding).
            ((et as u64 - 1) << f.mant) + r
        } else {
            r
        }
    };
    if code > f.max_code as u64 {
        return Some(if f.nan.is_none() {
            sgn(f.max_code)
        } else {
            overflow()
        });
    }
    Some(sgn(code as u8))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum E8m0Round {
    Up,
    Down,
    Nearest,
}

/// f32 to FLOAT8E8M0 (a power-of-two scale): 2^(code-127), 0xFF is NaN.
pub fn e8m0_from_f32(x: f32, mode: E8m0Round, saturate: bool) -> u8 {
    if x.is_nan() {
        return 0xff;
    }
    if x.is_infinite() {
        return if saturate { 0xfe } else { 0xff };
    }
    let bits = x.to_bits() & 0x7fff_ffff;
    let e = (bits >> 23) as i32;
    let m = bits & 0x7f_ffff;
    if e == 0 && m == 0 {
        return 0;
    }
    let mut code = e;
    match mode {
        // Code 0 is 2^-127, which f32 holds as a subnormal with mantissa 0x40_0000.
        E8m0Round::Up if e == 0 => code = (m > 0x40_0000) as i32,
        E8m0Round::Up => code += (m != 0) as i32,
        E8m0Round::Down => {}
        E8m0Round::Nearest => code += (m >= 0x40_0000) as i32,
    }
    if code > 254 {
        return if saturate { 0xfe } else { 0xff };
    }
    code as u8
}

/// Range of the 2-bit integer types.
pub fn int2_range(d: DType) -> Option<(i64, i64)> {
    match d {
        DType::I2 => Some((-2, 1)),
        DType::U2 => Some((0, 3)),
        DType::I4 => Some((-8, 7)),
        DType::U4 => Some((0, 15)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3fn_round_trips_every_code() {
        for c in 0u8..=255 {
            let v = to_f32(DType::F8E4M3FN, c).unwrap();
            if v.is_nan() {
                continue;
            }
            assert_eq!(
                from_f32(DType::F8E4M3FN, v, true),
                Some(c),
                "code {c:#x} value {v}"
            );
        }
        assert_eq!(to_f32(DType::F8E4M3FN, 0x7e), Some(448.0));
        assert_eq!(from_f32(DType::F8E4M3FN, 1e6, true), Some(0x7e));
        assert_eq!(from_f32(DType::F8E4M3FN, 1e6, false), Some(0x7f));
    }

    #[test]
    fn every_format_round_trips() {
        for d in [DType::F8E4M3FNUZ, DType::F8E5M2, DType::F8E5M2FNUZ] {
            for c in 0u8..=255 {
                let v = to_f32(d, c).unwrap();
                if v.is_nan() || v.is_infinite() || (v == 0.0 && c != 0 && d != DType::F8E5M2) {
                    continue;
                }
                assert_eq!(from_f32(d, v, true), Some(c), "{d} code {c:#x} value {v}");
            }
        }
        for c in 0u8..16 {
            let v = to_f32(DType::F4E2M1, c).unwrap();
            assert_eq!(from_f32(DType::F4E2M1, v, true), Some(c), "fp4 code {c}");
        }
        assert_eq!(to_f32(DType::F4E2M1, 0x7), Some(6.0));
        assert_eq!(to_f32(DType::F8E5M2, 0x7b), Some(57344.0));
    }
}
