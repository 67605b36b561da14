//! Cast, CastLike and BitCast.
//!
//! Numeric casts follow numpy's `astype`: floats convert with round-to-nearest, float to
//! integer truncates toward zero (saturating where numpy's result is undefined), integer to
//! integer wraps, anything to bool is `x != 0`. Strings parse and print like numpy.

use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::value::Value;
use crate::{bail, dispatch_pod};
use npuc_ir::{bf16, f16, DType, Elem, Tensor};

/// How an element type widens losslessly: floats to f64, signed integers to i64, unsigned
/// integers and bool to u64.
#[derive(PartialEq, Eq)]
enum Kind {
    Float,
    Signed,
    Unsigned,
}

trait Castable: Elem {
    const KIND: Kind;
    fn as_f64(self) -> f64;
    fn as_i64(self) -> i64;
    fn as_u64(self) -> u64;
    fn from_f64(v: f64) -> Self;
    fn from_i64(v: i64) -> Self;
    fn from_u64(v: u64) -> Self;
}

macro_rules! castable_prim {
    ($kind:ident: $($t:ty),*) => {$(
        impl Castable for $t {
            const KIND: Kind = Kind::$kind;
            #[inline(always)]
            fn as_f64(self) -> f64 { self as f64 }
            #[inline(always)]
            fn as_i64(self) -> i64 { self as i64 }
            #[inline(always)]
            fn as_u64(self) -> u64 { self as u64 }
            #[inline(always)]
            fn from_f64(v: f64) -> $t { v as $t }
            #[inline(always)]
            fn from_i64(v: i64) -> $t { v as $t }
            #[inline(always)]
            fn from_u64(v: u64) -> $t { v as $t }
        }
    )*};
}
castable_prim!(Float: f32, f64);
castable_prim!(Signed: i8, i16, i32, i64);
castable_prim!(Unsigned: u8, u16, u32, u64);

macro_rules! castable_half {
    ($($t:ty),*) => {$(
        impl Castable for $t {
            const KIND: Kind = Kind::Float;
            #[inline(always)]
            fn as_f64(self) -> f64 { self.to_f64() }
            #[inline(always)]
            fn as_i64(self) -> i64 { self.to_f64() as i64 }
            #[inline(always)]
            fn as_u64(self) -> u64 { self.to_f64() as u64 }
            #[inline(always)]
            fn from_f64(v: f64) -> $t { <$t>::from_f64(v) }
            #[inline(always)]
            fn from_i64(v: i64) -> $t { <$t>::from_f64(v as f64) }
            #[inline(always)]
            fn from_u64(v: u64) -> $t { <$t>::from_f64(v as f64) }
        }
    )*};
}
castable_half!(f16, bf16);

impl Castable for bool {
    const KIND: Kind = Kind::Unsigned;
    fn as_f64(self) -> f64 {
        self as u8 as f64
    }
    fn as_i64(self) -> i64 {
        self as i64
    }
    fn as_u64(self) -> u64 {
        self as u64
    }
    fn from_f64(v: f64) -> bool {
        v != 0.0
    }
    fn from_i64(v: i64) -> bool {
        v != 0
    }
    fn from_u64(v: u64) -> bool {
        v != 0
    }
}

#[inline(always)]
fn convert<S: Castable, D: Castable>(x: S) -> D {
    match S::KIND {
        Kind::Float => D::from_f64(x.as_f64()),
        Kind::Signed => D::from_i64(x.as_i64()),
        Kind::Unsigned => D::from_u64(x.as_u64()),
    }
}

fn convert_slice<S: Castable, D: Castable>(s: &[S]) -> Vec<D> {
    s.iter().map(|&x| convert::<S, D>(x)).collect()
}

/// Formats a float like numpy's `str` (Python `repr`): shortest round-trip digits,
/// positional for exponents in [-4, 16), scientific (`1e-05`, `1.5e+16`) otherwise.
fn format_float(v: f64, sci: String) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    // `sci` is Rust's shortest `{:e}` form of the value in its own precision: "d.ddde-5".
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if neg { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let s = if exp < 0 {
            format!("0.{}{}", "0".repeat((-exp - 1) as usize), digits)
        } else if exp + 1 >= n {
            format!("{}{}.0", digits, "0".repeat((exp + 1 - n) as usize))
        } else {
            let (a, b) = digits.split_at((exp + 1) as usize);
            format!("{a}.{b}")
        };
        format!("{sign}{s}")
    } else {
        let (a, b) = digits.split_at(1.min(digits.len()));
        let m = if b.is_empty() {
            a.to_string()
        } else {
            format!("{a}.{b}")
        };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

fn to_strings(t: &Tensor) -> Result<Vec<String>> {
    Ok(match t.dtype() {
        DType::String => t.as_strings()?.to_vec(),
        DType::F32 => t
            .as_slice::<f32>()?
            .iter()
            .map(|&v| format_float(v as f64, format!("{v:e}")))
            .collect(),
        DType::F64 => t
            .as_slice::<f64>()?
            .iter()
            .map(|&v| format_float(v, format!("{v:e}")))
            .collect(),
        DType::F16 => t
            .as_slice::<f16>()?
            .iter()
            .map(|&v| format_float(v.to_f64(), format!("{:e}", v.to_f32())))
            .collect(),
        DType::BF16 => t
            .as_slice::<bf16>()?
            .iter()
            .map(|&v| format_float(v.to_f64(), format!("{:e}", v.to_f32())))
            .collect(),
        DType::Bool => t
            .as_slice::<bool>()?
            .iter()
            .map(|&b| if b { "True" } else { "False" }.to_string())
            .collect(),
        DType::U64 => t.as_slice::<u64>()?.iter().map(|v| v.to_string()).collect(),
        _ => t.to_i64_vec()?.iter().map(|v| v.to_string()).collect(),
    })
}

/// Parses numbers the way numpy's `astype` does from strings ("1.5", "-inf", "NaN", "7").
fn from_strings<D: Castable>(s: &[String]) -> Result<Vec<D>> {
    s.iter()
        .map(|x| {
            let x = x.trim();
            if D::KIND != Kind::Float {
                if let Ok(i) = x.parse::<i64>() {
                    return Ok(D::from_i64(i));
                }
                if let Ok(u) = x.parse::<u64>() {
                    return Ok(D::from_u64(u));
                }
            }
            match x.parse::<f64>() {
                Ok(v) => Ok(D::from_f64(v)),
                Err(_) => bail!("cannot cast string '{x}' to a number"),
            }
        })
        .collect()
}

fn cast_to<D: Castable>(t: &Tensor) -> Result<Vec<D>> {
    Ok(match t.dtype() {
        DType::String => from_strings::<D>(t.as_strings()?)?,
        dt => dispatch_pod!(dt, S => convert_slice::<S, D>(t.as_slice::<S>()?)),
    })
}

/// Converts `t` to dtype `to` (numpy `astype` semantics; see the module docs).
pub fn cast_tensor(t: &Tensor, to: DType) -> Result<Tensor> {
    cast_tensor_with(t, to, true, npuc_ir::lowp::E8m0Round::Up)
}

/// [`cast_tensor`] with the float8 options: `saturate` (out-of-range values clamp to the largest
/// finite value instead of becoming inf/NaN) and the rounding of FLOAT8E8M0.
pub fn cast_tensor_with(
    t: &Tensor,
    to: DType,
    saturate: bool,
    e8m0_round: npuc_ir::lowp::E8m0Round,
) -> Result<Tensor> {
    use npuc_ir::lowp;
    let shape = t.shape().to_vec();
    if t.dtype() == to {
        return Ok(t.clone());
    }
    // Small floats and 2-bit integers go through a wider type of the same family.
    if t.dtype().is_small_float() {
        let wide = Tensor::from_vec(
            shape,
            t.to_f64_vec()?.into_iter().map(|x| x as f32).collect(),
        )?;
        return cast_tensor_with(&wide, to, saturate, e8m0_round);
    }
    if matches!(t.dtype(), DType::I2 | DType::U2) {
        let wide = match t.dtype() {
            DType::I2 => Tensor::from_vec(shape, t.as_slice::<i8>()?.to_vec())?,
            _ => Tensor::from_vec(shape, t.as_slice::<u8>()?.to_vec())?,
        };
        return cast_tensor_with(&wide, to, saturate, e8m0_round);
    }
    if to.is_small_float() {
        let xs = cast_to::<f32>(t)?;
        let codes: Vec<u8> = if to == DType::F8E8M0 {
            xs.iter()
                .map(|&x| lowp::e8m0_from_f32(x, e8m0_round, saturate))
                .collect()
        } else {
            xs.iter()
                .map(|&x| lowp::from_f32(to, x, saturate).unwrap_or(0))
                .collect()
        };
        return Ok(Tensor::from_codes(to, shape, codes)?);
    }
    if matches!(to, DType::I2 | DType::U2) {
        let wide = cast_to::<i64>(t)?;
        return Ok(Tensor::from_codes(
            to,
            shape,
            wide.iter().map(|&v| (v & 3) as u8).collect(),
        )?);
    }
    Ok(match to {
        DType::String => Tensor::from_strings(shape, to_strings(t)?)?,
        DType::I4 | DType::U4 => {
            // Convert through i64 and keep the low nibble (two's complement for I4).
            let wide = cast_to::<i64>(t)?;
            Tensor::from_4bit(to, shape, wide.iter().map(|&v| (v & 0xF) as u8).collect())?
        }
        dt => dispatch_pod!(dt, D => Tensor::from_vec(shape, cast_to::<D>(t)?)?),
    })
}

fn dtype_attr(ctx: &OpCtx, name: &str) -> Result<DType> {
    let code = ctx.node.int_req(name)?;
    match i32::try_from(code).ok().and_then(DType::from_onnx_code) {
        Some(d) => Ok(d),
        None => bail!("{name}={code} is not a supported data type"),
    }
}

/// The float8 options of Cast/CastLike: `saturate` (default 1) and `round_mode` for E8M0
/// ("up" by default, "down", "nearest").
fn small_float_opts(ctx: &OpCtx) -> Result<(bool, npuc_ir::lowp::E8m0Round)> {
    use npuc_ir::lowp::E8m0Round;
    let saturate = ctx.node.int_or("saturate", 1)? != 0;
    let round = match ctx.node.str_or("round_mode", "up")? {
        "up" => E8m0Round::Up,
        "down" => E8m0Round::Down,
        "nearest" => E8m0Round::Nearest,
        other => bail!("round_mode '{other}' is not one of up, down, nearest"),
    };
    Ok((saturate, round))
}

/// Cast: converts input 0 to the dtype in attribute `to`; `saturate`/`round_mode` apply to
/// float8 targets.
fn cast(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let to = dtype_attr(ctx, "to")?;
    if ins.tensor(0)?.dtype() == to {
        return Ok(vec![Value::tensor(ins.take_tensor(0)?)]);
    }
    let (sat, round) = small_float_opts(ctx)?;
    Ok(vec![Value::tensor(cast_tensor_with(
        ins.tensor(0)?,
        to,
        sat,
        round,
    )?)])
}

/// CastLike: converts input 0 to the dtype of input 1.
fn cast_like(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let to = ins.tensor(1)?.dtype();
    if ins.tensor(0)?.dtype() == to {
        return Ok(vec![Value::tensor(ins.take_tensor(0)?)]);
    }
    let (sat, round) = small_float_opts(ctx)?;
    Ok(vec![Value::tensor(cast_tensor_with(
        ins.tensor(0)?,
        to,
        sat,
        round,
    )?)])
}

/// BitCast: reinterprets the bytes of each element as dtype `to` (same element size).
fn bit_cast(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let to = dtype_attr(ctx, "to")?;
    let x = ins.tensor(0)?;
    let from = x.dtype();
    let sized = |d: DType| !matches!(d, DType::String | DType::I4 | DType::U4);
    if !sized(from) || !sized(to) || from.size() != to.size() {
        bail!("BitCast from {from} to {to} needs fixed-size types of equal width");
    }
    let bytes = x.to_le_bytes()?;
    Ok(vec![Value::tensor(Tensor::from_le_bytes_copy(
        to,
        x.shape().to_vec(),
        &bytes,
    )?)])
}

pub fn register(r: &mut Registry) {
    r.add("Cast", 1, cast);
    r.add("CastLike", 15, cast_like);
    r.add("BitCast", 26, bit_cast);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numpy_like_float_strings() {
        let f = |v: f32| format_float(v as f64, format!("{v:e}"));
        assert_eq!(f(0.5), "0.5");
        assert_eq!(f(1.0), "1.0");
        assert_eq!(f(-123.25), "-123.25");
        assert_eq!(f(1e-5), "1e-05");
        assert_eq!(f(0.0001), "0.0001");
        assert_eq!(f(1.5e20), "1.5e+20");
        assert_eq!(f(f32::NEG_INFINITY), "-inf");
    }

    #[test]
    fn casts() {
        let t = Tensor::from_vec(vec![4], vec![-1.7f32, 0.0, 2.5, 300.0]).unwrap();
        let i = cast_tensor(&t, DType::I32).unwrap();
        assert_eq!(i.as_slice::<i32>().unwrap(), &[-1, 0, 2, 300]);
        let u = cast_tensor(&i, DType::U8).unwrap();
        assert_eq!(u.as_slice::<u8>().unwrap(), &[255, 0, 2, 44]);
        let b = cast_tensor(&t, DType::Bool).unwrap();
        assert_eq!(b.as_slice::<bool>().unwrap(), &[true, false, true, true]);
        let s = Tensor::from_strings(vec![2], vec!["1.5".into(), "-INF".into()]).unwrap();
        let f = cast_tensor(&s, DType::F64).unwrap();
        assert_eq!(f.as_slice::<f64>().unwrap(), &[1.5, f64::NEG_INFINITY]);
    }
}
