//! Dimension arithmetic and shape helpers shared by the inference rules.

use super::ctx::R;
use crate::dtype::DType;
use crate::graph::{Dim, TypeInfo};

pub type Shape = Option<Vec<Dim>>;

pub fn tt(dtype: Option<DType>, shape: Shape) -> TypeInfo {
    TypeInfo::Tensor { dtype, shape }
}

pub fn fixed(v: &[usize]) -> Vec<Dim> {
    v.iter().map(|&d| Dim::Fixed(d)).collect()
}

/// All dims fixed: their values.
pub fn all_fixed(s: &[Dim]) -> Option<Vec<usize>> {
    s.iter()
        .map(|d| match d {
            Dim::Fixed(n) => Some(*n),
            _ => None,
        })
        .collect()
}

/// Largest rank inference will materialise from a value (a shape input's length). Real ranks
/// are tiny; a malformed model could otherwise ask for a vector of billions of dims.
pub const MAX_RANK: usize = 1024;

/// The rank implied by the length of a 1-D shape tensor, when known and plausible.
pub fn rank_from_len(shape: Option<&[Dim]>) -> Option<usize> {
    match shape?.first()? {
        Dim::Fixed(n) if *n <= MAX_RANK => Some(*n),
        _ => None,
    }
}

pub fn fx(d: &Dim) -> Option<usize> {
    match d {
        Dim::Fixed(n) => Some(*n),
        _ => None,
    }
}

/// Normalises a possibly negative axis against `rank` (`extra` widens the accepted range,
/// for ops like Unsqueeze whose axes index the output).
pub fn axis(a: i64, rank: usize) -> R<usize> {
    let r = rank as i64;
    let v = if a < 0 { a + r } else { a };
    if v < 0 || v >= r {
        return Err(format!("axis {a} is out of range for rank {rank}"));
    }
    Ok(v as usize)
}

/// Broadcasts two dims (numpy rules). `Err` when two fixed dims disagree.
pub fn bcast_dim(a: &Dim, b: &Dim) -> R<Dim> {
    use Dim::*;
    Ok(match (a, b) {
        (Fixed(x), Fixed(y)) => {
            if x == y {
                Fixed(*x)
            } else if *x == 1 {
                Fixed(*y)
            } else if *y == 1 {
                Fixed(*x)
            } else {
                return Err(format!("dimensions {x} and {y} cannot be broadcast"));
            }
        }
        (Fixed(1), o) | (o, Fixed(1)) => o.clone(),
        // A symbolic or unknown dim meeting n != 1 must be 1 or n; the result is n either way.
        (Fixed(x), _) | (_, Fixed(x)) => Fixed(*x),
        (Symbolic(x), Symbolic(y)) if x == y => Symbolic(x.clone()),
        _ => Unknown,
    })
}

pub fn bcast(a: &[Dim], b: &[Dim]) -> R<Vec<Dim>> {
    let r = a.len().max(b.len());
    let one = Dim::Fixed(1);
    (0..r)
        .map(|i| {
            let da = if i + a.len() >= r {
                &a[i + a.len() - r]
            } else {
                &one
            };
            let db = if i + b.len() >= r {
                &b[i + b.len() - r]
            } else {
                &one
            };
            bcast_dim(da, db)
        })
        .collect()
}

/// Broadcast over several optional shapes; unknown rank anywhere gives unknown rank.
pub fn bcast_all(shapes: &[Option<&[Dim]>]) -> R<Shape> {
    let mut out: Vec<Dim> = vec![];
    for s in shapes {
        match s {
            Some(s) => out = bcast(&out, s)?,
            None => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// Two descriptions of the same dim (e.g. Concat's non-axis dims): the more specific one, or
/// an error when both are fixed and differ.
pub fn unify_dim(a: &Dim, b: &Dim) -> R<Dim> {
    use Dim::*;
    Ok(match (a, b) {
        (Fixed(x), Fixed(y)) if x != y => {
            return Err(format!("dimensions {x} and {y} should be equal"))
        }
        (Fixed(x), _) | (_, Fixed(x)) => Fixed(*x),
        (Symbolic(x), _) => Symbolic(x.clone()),
        (_, Symbolic(y)) => Symbolic(y.clone()),
        _ => Unknown,
    })
}

/// Merge of two possible types of one value (If branches, loop iterations): what both agree on.
pub fn merge_dim(a: &Dim, b: &Dim) -> Dim {
    if a == b {
        a.clone()
    } else {
        Dim::Unknown
    }
}

pub fn merge_type(a: &TypeInfo, b: &TypeInfo) -> TypeInfo {
    match (a, b) {
        (
            TypeInfo::Tensor {
                dtype: da,
                shape: sa,
            },
            TypeInfo::Tensor {
                dtype: db,
                shape: sb,
            },
        ) => {
            let dtype = if da == db { *da } else { None };
            let shape = match (sa, sb) {
                (Some(x), Some(y)) if x.len() == y.len() => {
                    Some(x.iter().zip(y).map(|(p, q)| merge_dim(p, q)).collect())
                }
                _ => None,
            };
            tt(dtype, shape)
        }
        (TypeInfo::Sequence(x), TypeInfo::Sequence(y)) => TypeInfo::Sequence(match (x, y) {
            (Some(x), Some(y)) => Some(Box::new(merge_type(x, y))),
            _ => None,
        }),
        (TypeInfo::Optional(x), TypeInfo::Optional(y)) => TypeInfo::Optional(match (x, y) {
            (Some(x), Some(y)) => Some(Box::new(merge_type(x, y))),
            _ => None,
        }),
        _ if a == b => a.clone(),
        _ => tt(None, None),
    }
}

pub fn dim_add(a: &Dim, b: i64) -> Dim {
    match a {
        Dim::Fixed(x) => i64::try_from(*x)
            .ok()
            .and_then(|x| x.checked_add(b))
            .and_then(|v| usize::try_from(v).ok())
            .map_or(Dim::Unknown, Dim::Fixed),
        Dim::Symbolic(_) if b == 0 => a.clone(),
        _ => Dim::Unknown,
    }
}

pub fn dim_sum(a: &Dim, b: &Dim) -> Dim {
    match (a, b) {
        (Dim::Fixed(x), Dim::Fixed(y)) => x.checked_add(*y).map_or(Dim::Unknown, Dim::Fixed),
        (Dim::Fixed(0), o) | (o, Dim::Fixed(0)) => o.clone(),
        _ => Dim::Unknown,
    }
}

pub fn dim_mul(a: &Dim, b: &Dim) -> Dim {
    match (a, b) {
        (Dim::Fixed(x), Dim::Fixed(y)) => x.checked_mul(*y).map_or(Dim::Unknown, Dim::Fixed),
        (Dim::Fixed(0), _) | (_, Dim::Fixed(0)) => Dim::Fixed(0),
        (Dim::Fixed(1), o) | (o, Dim::Fixed(1)) => o.clone(),
        _ => Dim::Unknown,
    }
}

pub fn dim_prod(ds: &[Dim]) -> Dim {
    ds.iter().fold(Dim::Fixed(1), |a, d| dim_mul(&a, d))
}

/// Exact division of a dim by a positive integer; `Err` when a fixed dim is not divisible.
pub fn dim_div_exact(a: &Dim, b: usize, what: &str) -> R<Dim> {
    match a {
        Dim::Fixed(x) => {
            if b == 0 || x % b != 0 {
                Err(format!("{what}: {x} is not divisible by {b}"))
            } else {
                Ok(Dim::Fixed(x / b))
            }
        }
        _ if b == 1 => Ok(a.clone()),
        _ => Ok(Dim::Unknown),
    }
}

/// Converts a list of i64 (from an attribute) into usizes, rejecting negatives.
pub fn non_neg(v: &[i64], what: &str) -> R<Vec<usize>> {
    v.iter()
        .map(|&x| usize::try_from(x).map_err(|_| format!("{what} has negative value {x}")))
        .collect()
}

/// Normalises and validates a list of axes (no duplicates).
pub fn axes(list: &[i64], rank: usize) -> R<Vec<usize>> {
    let mut out = Vec::with_capacity(list.len());
    for &a in list {
        let v = axis(a, rank)?;
        if out.contains(&v) {
            return Err(format!("axis {a} is repeated"));
        }
        out.push(v);
    }
    Ok(out)
}
