//! Comparisons, boolean logic, bitwise ops and Where.

use super::unary::unary_same;
use super::{binary_map, binary_same, same_dtype, Bcast};
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::value::Value;
use crate::{bail, dispatch_numeric, dispatch_pod};
use npuc_ir::{DType, Elem, Tensor};

const EQ: u8 = 0;
const LT: u8 = 1;
const LE: u8 = 2;
const GT: u8 = 3;
const GE: u8 = 4;

#[inline(always)]
fn cmp<T: PartialOrd, const OP: u8>(a: T, b: T) -> bool {
    match OP {
        EQ => a == b,
        LT => a < b,
        LE => a <= b,
        GT => a > b,
        _ => a >= b,
    }
}

/// Broadcasting map over string tensors (not `Copy`, so outside [`binary_map`]).
fn string_binary<O: Elem>(a: &Tensor, b: &Tensor, f: impl Fn(&str, &str) -> O) -> Result<Tensor> {
    let plan = Bcast::new(&[a.shape(), b.shape()])?;
    let (xa, xb) = (a.as_strings()?, b.as_strings()?);
    let mut out = Vec::with_capacity(plan.len());
    plan.for_each_row(|offs, _, n, st| {
        for i in 0..n {
            out.push(f(&xa[offs[0] + i * st[0]], &xb[offs[1] + i * st[1]]));
        }
    });
    Ok(Tensor::from_vec(plan.out_shape, out)?)
}

/// Comparison ops: numeric (and bool/string for Equal) inputs, bool output.
fn compare<const OP: u8>(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let dt = same_dtype(&ins)?;
    let (a, b) = (ins.tensor(0)?, ins.tensor(1)?);
    let t = match dt {
        DType::String => string_binary(a, b, |x, y| cmp::<&str, OP>(x, y))?,
        _ => dispatch_pod!(dt, T => binary_map::<T, T, bool>(a, b, cmp::<T, OP>)?),
    };
    Ok(vec![Value::tensor(t)])
}

/// Equal: `A == B` (numeric, bool, string).
fn equal(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    compare::<EQ>(ctx, ins)
}
/// Less: `A < B`.
fn less(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    compare::<LT>(ctx, ins)
}
/// LessOrEqual: `A <= B`.
fn less_or_equal(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    compare::<LE>(ctx, ins)
}
/// Greater: `A > B`.
fn greater(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    compare::<GT>(ctx, ins)
}
/// GreaterOrEqual: `A >= B`.
fn greater_or_equal(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    compare::<GE>(ctx, ins)
}

fn bool_binary(ctx: &OpCtx, mut ins: Inputs, f: fn(bool, bool) -> bool) -> Result<Vec<Value>> {
    if same_dtype(&ins)? != DType::Bool {
        bail!("{} needs bool inputs", ctx.node.op_type);
    }
    Ok(vec![Value::tensor(binary_same::<bool>(
        &mut ins,
        ctx.threads,
        f,
    )?)])
}

/// And: logical and of bool tensors.
fn and(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    bool_binary(ctx, ins, |a, b| a & b)
}
/// Or: logical or of bool tensors.
fn or(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    bool_binary(ctx, ins, |a, b| a | b)
}
/// Xor: logical exclusive or of bool tensors.
fn xor(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    bool_binary(ctx, ins, |a, b| a ^ b)
}

/// Not: logical negation of a bool tensor.
fn not(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    if ins.tensor(0)?.dtype() != DType::Bool {
        bail!("Not needs a bool input");
    }
    Ok(vec![Value::tensor(unary_same::<bool>(
        &mut ins,
        ctx.threads,
        |x| !x,
    )?)])
}

/// Integer element types with bitwise operations.
trait Bits: Elem + std::ops::BitAnd<Output = Self> + std::ops::BitOr<Output = Self> {
    fn xor(a: Self, b: Self) -> Self;
    fn not(a: Self) -> Self;
    /// Shifts that give 0 once the amount reaches the bit width (as numpy does).
    fn shl(a: Self, b: Self) -> Self;
    fn shr(a: Self, b: Self) -> Self;
}

macro_rules! bits {
    ($($t:ty),*) => {$(
        impl Bits for $t {
            #[inline(always)]
            fn xor(a: $t, b: $t) -> $t { a ^ b }
            #[inline(always)]
            fn not(a: $t) -> $t { !a }
            #[inline(always)]
            fn shl(a: $t, b: $t) -> $t {
                u32::try_from(b).ok().and_then(|s| a.checked_shl(s)).unwrap_or(0)
            }
            #[inline(always)]
            fn shr(a: $t, b: $t) -> $t {
                u32::try_from(b).ok().and_then(|s| a.checked_shr(s)).unwrap_or(0)
            }
        }
    )*};
}
bits!(i8, i16, i32, i64, u8, u16, u32, u64);

/// Dispatches on integer dtypes only.
macro_rules! dispatch_int {
    ($dt:expr, $T:ident => $body:expr) => {{
        match $dt {
            DType::I8 => {
                type $T = i8;
                $body
            }
            DType::I16 => {
                type $T = i16;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::U16 => {
                type $T = u16;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::U64 => {
                type $T = u64;
                $body
            }
            other => bail!("expected an integer tensor, got {other}"),
        }
    }};
}

/// BitwiseAnd: `A & B` on integers.
fn bitwise_and(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let dt = same_dtype(&ins)?;
    let t = dispatch_int!(dt, T => binary_same::<T>(&mut ins, ctx.threads, |a, b| a & b)?);
    Ok(vec![Value::tensor(t)])
}
/// BitwiseOr: `A | B` on integers.
fn bitwise_or(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let dt = same_dtype(&ins)?;
    let t = dispatch_int!(dt, T => binary_same::<T>(&mut ins, ctx.threads, |a, b| a | b)?);
    Ok(vec![Value::tensor(t)])
}
/// BitwiseXor: `A ^ B` on integers.
fn bitwise_xor(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let dt = same_dtype(&ins)?;
    let t = dispatch_int!(dt, T => binary_same::<T>(&mut ins, ctx.threads, <T as Bits>::xor)?);
    Ok(vec![Value::tensor(t)])
}
/// BitwiseNot: `!A` on integers.
fn bitwise_not(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let dt = ins.tensor(0)?.dtype();
    let t = dispatch_int!(dt, T => unary_same::<T>(&mut ins, ctx.threads, <T as Bits>::not)?);
    Ok(vec![Value::tensor(t)])
}

/// BitShift: `X << Y` or `X >> Y` (attribute `direction`) on unsigned integers.
fn bit_shift(ctx: &OpCtx, mut ins: Inputs) -> Result<Vec<Value>> {
    let dt = same_dtype(&ins)?;
    if !matches!(dt, DType::U8 | DType::U16 | DType::U32 | DType::U64) {
        bail!("BitShift needs unsigned integer inputs, got {dt}");
    }
    let left = match ctx.node.str_or("direction", "")? {
        "LEFT" => true,
        "RIGHT" => false,
        other => bail!("BitShift direction '{other}' is not LEFT or RIGHT"),
    };
    let t = dispatch_int!(dt, T => if left {
        binary_same::<T>(&mut ins, ctx.threads, <T as Bits>::shl)?
    } else {
        binary_same::<T>(&mut ins, ctx.threads, <T as Bits>::shr)?
    });
    Ok(vec![Value::tensor(t)])
}

/// `out = cond ? x : y` over a three-input broadcast plan.
fn select<T: Clone>(plan: &Bcast, c: &[bool], x: &[T], y: &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(plan.len());
    plan.for_each_row(|o, _, n, st| {
        let (ic, ix, iy) = (o[0], o[1], o[2]);
        if st == [1, 1, 1] {
            let rows = c[ic..ic + n].iter().zip(&x[ix..ix + n]).zip(&y[iy..iy + n]);
            out.extend(rows.map(|((&c, x), y)| if c { x.clone() } else { y.clone() }));
        } else {
            for i in 0..n {
                out.push(if c[ic + i * st[0]] {
                    x[ix + i * st[1]].clone()
                } else {
                    y[iy + i * st[2]].clone()
                });
            }
        }
    });
    out
}

/// Where: elementwise `condition ? X : Y` with three-way broadcasting (any element type).
fn where_op(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let (c, x, y) = (ins.tensor(0)?, ins.tensor(1)?, ins.tensor(2)?);
    if x.dtype() != y.dtype() {
        bail!("Where: X is {} but Y is {}", x.dtype(), y.dtype());
    }
    let plan = Bcast::new(&[c.shape(), x.shape(), y.shape()])?;
    let cv = c.as_slice::<bool>()?;
    let shape = plan.out_shape.clone();
    let t = match x.dtype() {
        DType::String => {
            Tensor::from_strings(shape, select(&plan, cv, x.as_strings()?, y.as_strings()?))?
        }
        DType::Bool => Tensor::from_vec(
            shape,
            select(&plan, cv, x.as_slice::<bool>()?, y.as_slice::<bool>()?),
        )?,
        DType::I4 | DType::U4 => bail!("Where does not support {} tensors", x.dtype()),
        dt => dispatch_numeric!(dt, T => Tensor::from_vec(
            shape,
            select(&plan, cv, x.as_slice::<T>()?, y.as_slice::<T>()?),
        )?),
    };
    Ok(vec![Value::tensor(t)])
}

pub fn register(r: &mut Registry) {
    r.add("Equal", 1, equal);
    r.add("Less", 1, less);
    r.add("LessOrEqual", 12, less_or_equal);
    r.add("Greater", 1, greater);
    r.add("GreaterOrEqual", 12, greater_or_equal);
    r.add("And", 1, and);
    r.add("Or", 1, or);
    r.add("Xor", 1, xor);
    r.add("Not", 1, not);
    r.add("BitwiseAnd", 18, bitwise_and);
    r.add("BitwiseOr", 18, bitwise_or);
    r.add("BitwiseXor", 18, bitwise_xor);
    r.add("BitwiseNot", 18, bitwise_not);
    r.add("BitShift", 11, bit_shift);
    r.add("Where", 9, where_op);
}
