//! Statically known values of small tensors (shape vectors, scalars, axes) for constant
//! propagation. Elements may be partially known: `Shape` of a tensor with a symbolic batch
//! dimension yields `[Sym("batch"), Int(3), ...]`, and `Gather`/`Concat`/`Slice` move such
//! elements around without needing them to be numbers.

use crate::dtype::DType;
use crate::graph::Dim;
use crate::tensor::Tensor;
use half::{bf16, f16};

/// Largest element count folded or read from an initializer. Shape computations work on
/// vectors of a handful of elements; anything bigger is real data that inference never needs.
pub const MAX_FOLD: usize = 4096;

/// One element of a known value.
#[derive(Clone, Debug, PartialEq)]
pub enum Scalar {
    /// Any integer or bool dtype (bools are 0/1).
    Int(i64),
    /// Any float dtype, rounded to that dtype's precision after every operation.
    Float(f64),
    /// A symbolic dimension (an integer whose value is named but not known).
    Sym(String),
    /// Nothing is known about this element.
    Unknown,
}

impl Scalar {
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Scalar::Int(i) => Some(*i),
            // Floats are exact integers only when they say so; callers that want truncation
            // cast explicitly.
            Scalar::Float(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Some(*f as i64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Scalar::Int(i) => Some(*i as f64),
            Scalar::Float(f) => Some(*f),
            _ => None,
        }
    }
    /// The element as a dimension: non-negative ints are fixed, symbols stay symbolic.
    pub fn to_dim(&self) -> Dim {
        match self {
            Scalar::Int(i) if *i >= 0 => Dim::Fixed(*i as usize),
            Scalar::Sym(s) => Dim::Symbolic(s.clone()),
            _ => Dim::Unknown,
        }
    }
    pub fn from_dim(d: &Dim) -> Scalar {
        match d {
            Dim::Fixed(n) => i64::try_from(*n).map_or(Scalar::Unknown, Scalar::Int),
            Dim::Symbolic(s) => Scalar::Sym(s.clone()),
            Dim::Unknown => Scalar::Unknown,
        }
    }
    fn is_known_number(&self) -> bool {
        matches!(self, Scalar::Int(_) | Scalar::Float(_))
    }
}

/// A tensor whose shape is fixed and whose elements are (at least partly) known.
#[derive(Clone, Debug, PartialEq)]
pub struct Known {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Row-major elements; `data.len()` is the product of `shape`.
    pub data: Vec<Scalar>,
}

impl Known {
    /// Builds a value, or `None` when the data does not fill the shape or is too large to keep.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<Scalar>) -> Option<Known> {
        let n = checked_numel(&shape)?;
        if n != data.len() || n > MAX_FOLD {
            return None;
        }
        // With a zero dim the element count says nothing about the other dims; bound them too
        // so that every partial product of the shape stays small.
        let nonzero = shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1usize, |a, &d| a.checked_mul(d))?;
        if nonzero > MAX_FOLD || shape.len() > MAX_FOLD {
            return None;
        }
        Some(Known { dtype, shape, data })
    }

    pub fn ints(dtype: DType, shape: Vec<usize>, v: &[i64]) -> Option<Known> {
        Known::new(dtype, shape, v.iter().map(|&x| Scalar::Int(x)).collect())
    }

    /// A 1-D int64 vector (what `Shape` produces).
    pub fn i64_vec(v: Vec<Scalar>) -> Option<Known> {
        let n = v.len();
        Known::new(DType::I64, vec![n], v)
    }

    /// Reads a small numeric tensor; strings and large tensors give `None`.
    pub fn from_tensor(t: &Tensor) -> Option<Known> {
        if t.len() > MAX_FOLD || t.dtype() == DType::String {
            return None;
        }
        let data: Vec<Scalar> = if t.dtype().is_float() {
            t.to_f64_vec()
                .ok()?
                .into_iter()
                .map(Scalar::Float)
                .collect()
        } else if t.dtype() == DType::U64 {
            // Values past i64::MAX are not shape arithmetic; keep them unknown.
            t.as_slice::<u64>()
                .ok()?
                .iter()
                .map(|&x| i64::try_from(x).map_or(Scalar::Unknown, Scalar::Int))
                .collect()
        } else {
            t.to_i64_vec().ok()?.into_iter().map(Scalar::Int).collect()
        };
        Known::new(t.dtype(), t.shape().to_vec(), data)
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// All elements as integers, when every one is a known integer.
    pub fn as_ints(&self) -> Option<Vec<i64>> {
        self.data.iter().map(|s| s.as_i64()).collect()
    }
    /// All elements as floats, when every one is a known number.
    pub fn as_floats(&self) -> Option<Vec<f64>> {
        self.data.iter().map(|s| s.as_f64()).collect()
    }
    /// Every element is a number (no symbols or unknowns).
    pub fn is_full(&self) -> bool {
        self.data.iter().all(Scalar::is_known_number)
    }
    /// The only element of a one-element value.
    pub fn single(&self) -> Option<&Scalar> {
        if self.data.len() == 1 {
            self.data.first()
        } else {
            None
        }
    }

    /// Same elements converted to `dtype` with ONNX `Cast` semantics (float to int truncates).
    pub fn cast(&self, dtype: DType) -> Option<Known> {
        if dtype == DType::String {
            return None;
        }
        let data = self.data.iter().map(|s| cast_scalar(s, dtype)).collect();
        Known::new(dtype, self.shape.clone(), data)
    }

    /// Same elements, new shape.
    pub fn reshaped(&self, shape: Vec<usize>) -> Option<Known> {
        Known::new(self.dtype, shape, self.data.clone())
    }
}

pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// Rounds a float to the precision of `dtype` so that folded float arithmetic matches what a
/// runtime computing in that dtype would produce.
pub fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::F16 => f16::from_f64(x).to_f64(),
        DType::BF16 => bf16::from_f64(x).to_f64(),
        _ => x,
    }
}

/// Wraps an integer into the range of an integer dtype (two's complement, as casts do).
pub fn wrap_int(dtype: DType, x: i64) -> Scalar {
    Scalar::Int(match dtype {
        DType::Bool => (x != 0) as i64,
        DType::I8 => x as i8 as i64,
        DType::U8 => x as u8 as i64,
        DType::I16 => x as i16 as i64,
        DType::U16 => x as u16 as i64,
        DType::I32 => x as i32 as i64,
        DType::U32 => x as u32 as i64,
        DType::I4 => (x << 60) >> 60,
        DType::U4 => x & 0xf,
        DType::U64 if x < 0 => return Scalar::Unknown,
        _ => x,
    })
}

pub fn cast_scalar(s: &Scalar, dtype: DType) -> Scalar {
    match s {
        Scalar::Unknown => Scalar::Unknown,
        // A dimension cast to another integer type is still that dimension; to float or bool it
        // is a number we do not know.
        Scalar::Sym(n) => {
            if dtype.is_int() && dtype != DType::Bool {
                Scalar::Sym(n.clone())
            } else {
                Scalar::Unknown
            }
        }
        Scalar::Int(i) => {
            if dtype.is_float() {
                Scalar::Float(round_to(dtype, *i as f64))
            } else {
                wrap_int(dtype, *i)
            }
        }
        Scalar::Float(f) => {
            if dtype.is_float() {
                Scalar::Float(round_to(dtype, *f))
            } else if dtype == DType::Bool {
                Scalar::Int((*f != 0.0) as i64)
            } else if f.is_finite() && f.abs() < 9.2e18 {
                wrap_int(dtype, f.trunc() as i64)
            } else {
                Scalar::Unknown
            }
        }
    }
}

/// Row-major strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1].saturating_mul(shape[i + 1]);
    }
    s
}

/// Numpy broadcast of two fixed shapes; `None` when incompatible.
pub fn broadcast_fixed(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = Vec::with_capacity(r);
    for i in 0..r {
        let da = if i + a.len() >= r {
            a[i + a.len() - r]
        } else {
            1
        };
        let db = if i + b.len() >= r {
            b[i + b.len() - r]
        } else {
            1
        };
        out.push(match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        });
    }
    Some(out)
}

/// The element of `k` that broadcasts to flat position `flat` of `out_shape`.
pub fn broadcast_index(
    k: &Known,
    out_shape: &[usize],
    out_strides: &[usize],
    flat: usize,
) -> usize {
    let r = out_shape.len();
    let kr = k.shape.len();
    let ks = strides(&k.shape);
    let mut idx = 0;
    for (i, &st) in out_strides.iter().enumerate() {
        if i + kr < r {
            continue;
        }
        let ki = i + kr - r;
        let coord = (flat / st) % out_shape[i].max(1);
        if k.shape[ki] != 1 {
            idx += coord * ks[ki];
        }
    }
    idx
}

/// Elementwise n-ary fold with numpy broadcasting.
pub fn broadcast_map(
    ins: &[&Known],
    dtype: DType,
    f: impl Fn(&[&Scalar]) -> Scalar,
) -> Option<Known> {
    let mut shape: Vec<usize> = vec![];
    for k in ins {
        shape = broadcast_fixed(&shape, &k.shape)?;
    }
    let n = checked_numel(&shape)?;
    if n > MAX_FOLD {
        return None;
    }
    let st = strides(&shape);
    let mut data = Vec::with_capacity(n);
    let mut args: Vec<&Scalar> = Vec::with_capacity(ins.len());
    for flat in 0..n {
        args.clear();
        for k in ins {
            args.push(k.data.get(broadcast_index(k, &shape, &st, flat))?);
        }
        data.push(f(&args));
    }
    Known::new(dtype, shape, data)
}

/// Binary arithmetic on two scalars of `dtype` (the inputs' common type). Integer overflow and
/// division by zero give `Unknown` rather than a wrong number.
pub fn arith(op: &str, dtype: DType, a: &Scalar, b: &Scalar, fmod: bool) -> Scalar {
    use Scalar::*;
    // Identities that hold for symbolic dims too.
    match (op, a, b) {
        ("Mul", Sym(s), Int(1)) | ("Mul", Int(1), Sym(s)) => return Sym(s.clone()),
        ("Add" | "Sub", Sym(s), Int(0)) | ("Add", Int(0), Sym(s)) => return Sym(s.clone()),
        ("Div", Sym(s), Int(1)) => return Sym(s.clone()),
        ("Max" | "Min", Sym(x), Sym(y)) if x == y => return Sym(x.clone()),
        _ => {}
    }
    if dtype.is_float() {
        let (Some(x), Some(y)) = (a.as_f64(), b.as_f64()) else {
            return Unknown;
        };
        let r = match op {
            "Add" => x + y,
            "Sub" => x - y,
            "Mul" => x * y,
            "Div" => x / y,
            "Pow" => x.powf(y),
            "Max" => x.max(y),
            "Min" => x.min(y),
            "Mod" => {
                if fmod {
                    x % y
                } else {
                    let m = x % y;
                    if m != 0.0 && ((m < 0.0) != (y < 0.0)) {
                        m + y
                    } else {
                        m
                    }
                }
            }
            _ => return Unknown,
        };
        return Float(round_to(dtype, r));
    }
    let (Int(x), Int(y)) = (a, b) else {
        return Unknown;
    };
    let (x, y) = (*x, *y);
    let r = match op {
        "Add" => x.checked_add(y),
        "Sub" => x.checked_sub(y),
        "Mul" => x.checked_mul(y),
        // ONNX integer Div truncates toward zero (the reference casts the float quotient).
        "Div" => x.checked_div(y),
        "Max" => Some(x.max(y)),
        "Min" => Some(x.min(y)),
        "Pow" => u32::try_from(y).ok().and_then(|e| x.checked_pow(e)),
        "Mod" => {
            if fmod {
                x.checked_rem(y)
            } else {
                x.checked_rem(y).map(|m| {
                    if m != 0 && ((m < 0) != (y < 0)) {
                        m + y
                    } else {
                        m
                    }
                })
            }
        }
        "BitwiseAnd" => Some(x & y),
        "BitwiseOr" => Some(x | y),
        "BitwiseXor" => Some(x ^ y),
        _ => None,
    };
    match r {
        Some(v) => {
            let w = wrap_int(dtype, v);
            // Wrapping changed the value: the runtime would overflow; do not pretend to know.
            if w == Int(v) {
                w
            } else {
                Unknown
            }
        }
        None => Unknown,
    }
}

/// Comparison of two scalars; symbols compare equal to themselves only.
pub fn compare(op: &str, a: &Scalar, b: &Scalar) -> Scalar {
    if let (Scalar::Sym(x), Scalar::Sym(y)) = (a, b) {
        if x == y {
            return match op {
                "Equal" | "GreaterOrEqual" | "LessOrEqual" => Scalar::Int(1),
                _ => Scalar::Int(0),
            };
        }
        return Scalar::Unknown;
    }
    let r = match (a, b) {
        (Scalar::Int(x), Scalar::Int(y)) => match op {
            "Equal" => x == y,
            "Less" => x < y,
            "Greater" => x > y,
            "LessOrEqual" => x <= y,
            "GreaterOrEqual" => x >= y,
            _ => return Scalar::Unknown,
        },
        _ => {
            let (Some(x), Some(y)) = (a.as_f64(), b.as_f64()) else {
                return Scalar::Unknown;
            };
            match op {
                "Equal" => x == y,
                "Less" => x < y,
                "Greater" => x > y,
                "LessOrEqual" => x <= y,
                "GreaterOrEqual" => x >= y,
                _ => return Scalar::Unknown,
            }
        }
    };
    Scalar::Int(r as i64)
}

/// Unary elementwise fold.
pub fn unary(op: &str, dtype: DType, a: &Scalar) -> Scalar {
    use Scalar::*;
    match (op, a) {
        ("Identity", x) => x.clone(),
        ("Neg", Int(x)) => x.checked_neg().map_or(Unknown, |v| wrap_int(dtype, v)),
        ("Abs", Int(x)) => x.checked_abs().map_or(Unknown, Int),
        ("Sign", Int(x)) => Int(x.signum()),
        ("Relu", Int(x)) => Int((*x).max(0)),
        ("Not", Int(x)) => Int((*x == 0) as i64),
        ("Floor" | "Ceil" | "Round", Int(x)) => Int(*x),
        ("Abs" | "Relu" | "Floor" | "Ceil" | "Round", Sym(s)) => {
            // Dimensions are non-negative integers: these leave them unchanged.
            Sym(s.clone())
        }
        (_, Float(x)) => {
            let r = match op {
                "Neg" => -x,
                "Abs" => x.abs(),
                "Sign" => x.signum() * (*x != 0.0) as i64 as f64,
                "Relu" => x.max(0.0),
                "Floor" => x.floor(),
                "Ceil" => x.ceil(),
                // ONNX rounds half to even.
                "Round" => x.round_ties_even(),
                "Sqrt" => x.sqrt(),
                "Reciprocal" => 1.0 / x,
                "Exp" => x.exp(),
                "Log" => x.ln(),
                _ => return Unknown,
            };
            Float(round_to(dtype, r))
        }
        _ => Unknown,
    }
}

/// Converts a value's elements to dims (for Reshape/Expand/ConstantOfShape targets).
pub fn to_dims(k: &Known) -> Vec<Dim> {
    k.data.iter().map(Scalar::to_dim).collect()
}
