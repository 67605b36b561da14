//! Tensors: a dtype, a shape and data that is either owned (a typed `Vec`) or borrowed from a
//! byte buffer someone else owns (an mmapped model file, an artifact section).

use crate::dtype::DType;
use crate::error::IrError;
use half::{bf16, f16};
use std::fmt;
use std::sync::Arc;

/// Something that owns bytes which outlive every tensor borrowing them (an mmap, `bytes::Bytes`).
pub trait Backing: Send + Sync {
    fn bytes(&self) -> &[u8];
    /// Gives up this process's resident pages of `bytes()[offset..offset + len]` where the
    /// backing can bring them back unchanged on the next read (a read-only file mapping: the
    /// pages stay in the page cache, so the next read costs a page fault, not I/O). For a
    /// large model's float weights once they are quantized: they no longer count in the
    /// process's resident memory next to the quantized copy. Buffers in memory do nothing.
    fn release(&self, _offset: usize, _len: usize) {}
    /// Whether [`Backing::release`] gives pages back (a file mapping): weights elsewhere (in
    /// memory) are what a large model's compile may move to a file to bound its memory.
    fn releasable(&self) -> bool {
        false
    }
}

impl Backing for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// Values moved out of an owned tensor into a reference-counted buffer (see
/// [`Tensor::into_shared`]): typed, so its bytes are aligned for the element type.
struct SharedValues<T: bytemuck::Pod + Send + Sync>(Vec<T>);

impl<T: bytemuck::Pod + Send + Sync> Backing for SharedValues<T> {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// A window into a [`Backing`]. Always aligned for the tensor's element type (see
/// [`Tensor::from_le_bytes`], which copies when it is not).
#[derive(Clone)]
pub struct Borrowed {
    pub owner: Arc<dyn Backing>,
    pub offset: usize,
    pub len: usize,
}

impl Borrowed {
    pub fn bytes(&self) -> &[u8] {
        &self.owner.bytes()[self.offset..self.offset + self.len]
    }
}

#[derive(Clone)]
pub enum TensorData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I8(Vec<i8>),
    U8(Vec<u8>),
    I16(Vec<i16>),
    U16(Vec<u16>),
    I32(Vec<i32>),
    U32(Vec<u32>),
    I64(Vec<i64>),
    U64(Vec<u64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// 4-bit values unpacked one per byte (sign-extended for I4).
    I4(Vec<i8>),
    U4(Vec<u8>),
    /// Little-endian bytes of a fixed-size dtype, borrowed (zero-copy) from a backing buffer.
    Borrowed(Borrowed),
}

/// A scalar element type with a typed `Vec` representation in [`TensorData`].
pub trait Elem: Copy + Send + Sync + Default + PartialEq + fmt::Debug + 'static {
    const DTYPE: DType;
    fn slice(d: &TensorData) -> Option<&[Self]>;
    fn vec_mut(d: &mut TensorData) -> Option<&mut Vec<Self>>;
    fn into_data(v: Vec<Self>) -> TensorData;
    fn from_data(d: TensorData) -> Result<Vec<Self>, TensorData>;
}

macro_rules! pod_elem {
    ($t:ty, $dt:ident, $var:ident) => {
        pod_elem!($t, $dt, $var, $var);
    };
    ($t:ty, $dt:ident, $var:ident, $alt:ident) => {
        #[allow(unreachable_patterns)]
        impl Elem for $t {
            const DTYPE: DType = DType::$dt;
            fn slice(d: &TensorData) -> Option<&[Self]> {
                match d {
                    TensorData::$var(v) | TensorData::$alt(v) => Some(v),
                    TensorData::Borrowed(b) => bytemuck::try_cast_slice(b.bytes()).ok(),
                    _ => None,
                }
            }
            fn vec_mut(d: &mut TensorData) -> Option<&mut Vec<Self>> {
                match d {
                    TensorData::$var(v) | TensorData::$alt(v) => Some(v),
                    _ => None,
                }
            }
            fn into_data(v: Vec<Self>) -> TensorData {
                TensorData::$var(v)
            }
            fn from_data(d: TensorData) -> Result<Vec<Self>, TensorData> {
                match d {
                    TensorData::$var(v) | TensorData::$alt(v) => Ok(v),
                    TensorData::Borrowed(b) => {
                        match bytemuck::try_cast_slice::<u8, $t>(b.bytes()) {
                            Ok(s) => Ok(s.to_vec()),
                            Err(_) => Err(TensorData::Borrowed(b)),
                        }
                    }
                    other => Err(other),
                }
            }
        }
    };
}

pod_elem!(f32, F32, F32);
pod_elem!(f64, F64, F64);
pod_elem!(f16, F16, F16);
pod_elem!(bf16, BF16, BF16);
pod_elem!(i8, I8, I8, I4);
pod_elem!(u8, U8, U8, U4);
pod_elem!(i16, I16, I16);
pod_elem!(u16, U16, U16);
pod_elem!(i32, I32, I32);
pod_elem!(u32, U32, U32);
pod_elem!(i64, I64, I64);
pod_elem!(u64, U64, U64);

impl Elem for bool {
    const DTYPE: DType = DType::Bool;
    fn slice(d: &TensorData) -> Option<&[Self]> {
        match d {
            TensorData::Bool(v) => Some(v),
            _ => None,
        }
    }
    fn vec_mut(d: &mut TensorData) -> Option<&mut Vec<Self>> {
        match d {
            TensorData::Bool(v) => Some(v),
            _ => None,
        }
    }
    fn into_data(v: Vec<Self>) -> TensorData {
        TensorData::Bool(v)
    }
    fn from_data(d: TensorData) -> Result<Vec<Self>, TensorData> {
        match d {
            TensorData::Bool(v) => Ok(v),
            other => Err(other),
        }
    }
}

#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    data: TensorData,
}

pub use crate::numel::{checked_numel, numel};

/// Bytes of `shape` elements of `size` bytes each, or the overflow error naming the shape.
fn checked_bytes(shape: &[usize], size: usize) -> Result<usize, IrError> {
    checked_numel(shape)
        .and_then(|n| n.checked_mul(size))
        .ok_or_else(|| IrError::ShapeOverflow {
            shape: shape.to_vec(),
        })
}

impl Tensor {
    /// Builds a tensor from typed data; fails when the element count does not match the shape.
    pub fn from_vec<T: Elem>(shape: Vec<usize>, v: Vec<T>) -> Result<Tensor, IrError> {
        if checked_numel(&shape) != Some(v.len()) {
            return Err(IrError::ShapeData {
                shape,
                len: v.len(),
            });
        }
        Ok(Tensor {
            dtype: T::DTYPE,
            shape,
            data: T::into_data(v),
        })
    }

    pub fn from_strings(shape: Vec<usize>, v: Vec<String>) -> Result<Tensor, IrError> {
        if checked_numel(&shape) != Some(v.len()) {
            return Err(IrError::ShapeData {
                shape,
                len: v.len(),
            });
        }
        Ok(Tensor {
            dtype: DType::String,
            shape,
            data: TensorData::String(v),
        })
    }

    /// Packed 4-bit tensors, unpacked one value per byte.
    pub fn from_4bit(dtype: DType, shape: Vec<usize>, v: Vec<u8>) -> Result<Tensor, IrError> {
        Tensor::from_codes(dtype, shape, v)
    }

    /// Sub-byte integers and small floats from one code per byte (4- and 2-bit signed integers
    /// are sign-extended from their low bits).
    pub fn from_codes(dtype: DType, shape: Vec<usize>, v: Vec<u8>) -> Result<Tensor, IrError> {
        if checked_numel(&shape) != Some(v.len()) {
            return Err(IrError::ShapeData {
                shape,
                len: v.len(),
            });
        }
        let data = match dtype {
            DType::U4 => TensorData::U4(v.into_iter().map(|x| x & 15).collect()),
            DType::I4 => TensorData::I4(v.into_iter().map(|x| ((x << 4) as i8) >> 4).collect()),
            DType::U2 => TensorData::U8(v.into_iter().map(|x| x & 3).collect()),
            DType::I2 => TensorData::I8(v.into_iter().map(|x| ((x << 6) as i8) >> 6).collect()),
            DType::F4E2M1 => TensorData::U8(v.into_iter().map(|x| x & 15).collect()),
            d if d.is_small_float() => TensorData::U8(v),
            other => {
                return Err(IrError::DTypeMismatch {
                    expected: DType::I4,
                    found: other,
                })
            }
        };
        Ok(Tensor { dtype, shape, data })
    }

    pub fn scalar<T: Elem>(v: T) -> Tensor {
        Tensor {
            dtype: T::DTYPE,
            shape: vec![],
            data: T::into_data(vec![v]),
        }
    }

    /// A tensor over little-endian bytes of `dtype` owned by `owner`. Zero-copy when the bytes
    /// are aligned for the element type, copied otherwise. Bool and string data are always copied.
    pub fn from_le_bytes(
        dtype: DType,
        shape: Vec<usize>,
        owner: Arc<dyn Backing>,
        offset: usize,
        len: usize,
    ) -> Result<Tensor, IrError> {
        let total = owner.bytes().len();
        if offset.checked_add(len).is_none_or(|end| end > total) {
            return Err(IrError::DataOutOfRange { offset, len, total });
        }
        let need = checked_bytes(&shape, dtype.size())?;
        if dtype == DType::String || dtype.packed_bits() < 8 {
            return Err(IrError::Unsupported(format!(
                "{dtype} tensors cannot be built from raw bytes directly"
            )));
        }
        if len != need {
            return Err(IrError::ByteLength {
                dtype,
                shape,
                expected: need,
                found: len,
            });
        }
        let bytes = &owner.bytes()[offset..offset + len];
        if dtype == DType::Bool {
            let v = bytes.iter().map(|&b| b != 0).collect();
            return Tensor::from_vec(shape, v);
        }
        let aligned = (bytes.as_ptr() as usize).is_multiple_of(dtype.size().max(1));
        if dtype.is_small_float() {
            return Tensor::from_codes(dtype, shape, bytes.to_vec());
        }
        if aligned {
            return Ok(Tensor {
                dtype,
                shape,
                data: TensorData::Borrowed(Borrowed { owner, offset, len }),
            });
        }
        Ok(Tensor {
            dtype,
            shape,
            data: copy_le(dtype, bytes),
        })
    }

    /// A tensor copied from little-endian bytes.
    pub fn from_le_bytes_copy(
        dtype: DType,
        shape: Vec<usize>,
        bytes: &[u8],
    ) -> Result<Tensor, IrError> {
        let need = checked_bytes(&shape, dtype.size())?;
        if dtype == DType::String || dtype.packed_bits() < 8 {
            return Err(IrError::Unsupported(format!(
                "{dtype} tensors cannot be built from raw bytes directly"
            )));
        }
        if bytes.len() != need {
            return Err(IrError::ByteLength {
                dtype,
                shape,
                expected: need,
                found: bytes.len(),
            });
        }
        let data = if dtype == DType::Bool {
            TensorData::Bool(bytes.iter().map(|&b| b != 0).collect())
        } else {
            copy_le(dtype, bytes)
        };
        Ok(Tensor { dtype, shape, data })
    }

    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Tensor {
        let n = numel(&shape);
        let data = match dtype {
            DType::F32 => TensorData::F32(vec![0.0; n]),
            DType::F64 => TensorData::F64(vec![0.0; n]),
            DType::F16 => TensorData::F16(vec![f16::ZERO; n]),
            DType::BF16 => TensorData::BF16(vec![bf16::ZERO; n]),
            DType::I8 => TensorData::I8(vec![0; n]),
            DType::U8 => TensorData::U8(vec![0; n]),
            DType::I16 => TensorData::I16(vec![0; n]),
            DType::U16 => TensorData::U16(vec![0; n]),
            DType::I32 => TensorData::I32(vec![0; n]),
            DType::U32 => TensorData::U32(vec![0; n]),
            DType::I64 => TensorData::I64(vec![0; n]),
            DType::U64 => TensorData::U64(vec![0; n]),
            DType::Bool => TensorData::Bool(vec![false; n]),
            DType::String => TensorData::String(vec![String::new(); n]),
            DType::I4 => TensorData::I4(vec![0; n]),
            DType::U4 => TensorData::U4(vec![0; n]),
            DType::I2 => TensorData::I8(vec![0; n]),
            _ => TensorData::U8(vec![0; n]),
        };
        Tensor { dtype, shape, data }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn len(&self) -> usize {
        numel(&self.shape)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn data(&self) -> &TensorData {
        &self.data
    }
    /// Gives up the resident pages of a tensor borrowed from a file mapping (see
    /// [`Backing::release`]); its values are unchanged. Does nothing for an owned tensor.
    pub fn release_resident(&self) {
        if let TensorData::Borrowed(b) = &self.data {
            b.owner.release(b.offset, b.len);
        }
    }

    /// The same values behind a reference count, so that clones of the tensor (a model cloned
    /// for a calibration or comparison session, a session's own constants) share one buffer
    /// instead of copying it: for weights computed at compile time (SmoothQuant's rescaled
    /// copies), which would otherwise be copied once per session. Owned fixed-size numeric data
    /// moves without a copy; borrowed, boolean, string, sub-byte and small-float tensors are
    /// returned unchanged. Writing through [`Tensor::as_mut_slice`] copies it back out.
    pub fn into_shared(self) -> Tensor {
        fn wrap<T: bytemuck::Pod + Send + Sync>(v: Vec<T>) -> TensorData {
            let len = std::mem::size_of_val(v.as_slice());
            TensorData::Borrowed(Borrowed {
                owner: Arc::new(SharedValues(v)),
                offset: 0,
                len,
            })
        }
        if self.dtype.storage() != self.dtype {
            return self;
        }
        let data = match self.data {
            TensorData::F32(v) => wrap(v),
            TensorData::F64(v) => wrap(v),
            TensorData::F16(v) => wrap(v),
            TensorData::BF16(v) => wrap(v),
            TensorData::I8(v) => wrap(v),
            TensorData::U8(v) => wrap(v),
            TensorData::I16(v) => wrap(v),
            TensorData::U16(v) => wrap(v),
            TensorData::I32(v) => wrap(v),
            TensorData::U32(v) => wrap(v),
            TensorData::I64(v) => wrap(v),
            TensorData::U64(v) => wrap(v),
            other => other,
        };
        Tensor { data, ..self }
    }

    /// Whether the values live in a backing whose pages [`Tensor::release_resident`] gives
    /// back (a file mapping), so they need not count in the process's resident memory.
    pub fn is_releasable(&self) -> bool {
        matches!(&self.data, TensorData::Borrowed(b) if b.owner.releasable())
    }

    pub fn is_borrowed(&self) -> bool {
        matches!(self.data, TensorData::Borrowed(_))
    }

    /// Same data, new shape (element count must match).
    pub fn reshaped(mut self, shape: Vec<usize>) -> Result<Tensor, IrError> {
        if checked_numel(&shape) != Some(self.len()) {
            return Err(IrError::ShapeData {
                shape,
                len: self.len(),
            });
        }
        self.shape = shape;
        Ok(self)
    }

    fn elem_matches<T: Elem>(&self) -> bool {
        T::DTYPE == self.dtype.storage()
    }

    /// Typed view. Fails with a dtype error when `T` is not this tensor's element type.
    pub fn as_slice<T: Elem>(&self) -> Result<&[T], IrError> {
        if !self.elem_matches::<T>() {
            return Err(IrError::DTypeMismatch {
                expected: T::DTYPE,
                found: self.dtype,
            });
        }
        T::slice(&self.data).ok_or(IrError::DTypeMismatch {
            expected: T::DTYPE,
            found: self.dtype,
        })
    }

    pub fn as_strings(&self) -> Result<&[String], IrError> {
        match &self.data {
            TensorData::String(v) => Ok(v),
            _ => Err(IrError::DTypeMismatch {
                expected: DType::String,
                found: self.dtype,
            }),
        }
    }

    /// Mutable typed access; borrowed data is copied into an owned buffer first.
    pub fn as_mut_slice<T: Elem>(&mut self) -> Result<&mut [T], IrError> {
        if !self.elem_matches::<T>() {
            return Err(IrError::DTypeMismatch {
                expected: T::DTYPE,
                found: self.dtype,
            });
        }
        if let TensorData::Borrowed(b) = &self.data {
            self.data = copy_le(self.dtype, b.bytes());
        }
        T::vec_mut(&mut self.data)
            .map(|v| v.as_mut_slice())
            .ok_or(IrError::DTypeMismatch {
                expected: T::DTYPE,
                found: self.dtype,
            })
    }

    /// Takes the data out as a typed `Vec` (copies borrowed data).
    pub fn into_vec<T: Elem>(self) -> Result<Vec<T>, IrError> {
        if !self.elem_matches::<T>() {
            return Err(IrError::DTypeMismatch {
                expected: T::DTYPE,
                found: self.dtype,
            });
        }
        let dtype = self.dtype;
        T::from_data(self.data).map_err(|_| IrError::DTypeMismatch {
            expected: T::DTYPE,
            found: dtype,
        })
    }

    /// Integer-valued tensor as i64 (shape inputs, indices, axes). Floats are rejected.
    pub fn to_i64_vec(&self) -> Result<Vec<i64>, IrError> {
        Ok(match self.dtype {
            DType::I64 => self.as_slice::<i64>()?.to_vec(),
            DType::I32 => self.as_slice::<i32>()?.iter().map(|&x| x as i64).collect(),
            DType::I16 => self.as_slice::<i16>()?.iter().map(|&x| x as i64).collect(),
            DType::I8 | DType::I4 | DType::I2 => {
                self.as_slice::<i8>()?.iter().map(|&x| x as i64).collect()
            }
            DType::U8 | DType::U4 | DType::U2 => {
                self.as_slice::<u8>()?.iter().map(|&x| x as i64).collect()
            }
            DType::U16 => self.as_slice::<u16>()?.iter().map(|&x| x as i64).collect(),
            DType::U32 => self.as_slice::<u32>()?.iter().map(|&x| x as i64).collect(),
            DType::U64 => self.as_slice::<u64>()?.iter().map(|&x| x as i64).collect(),
            DType::Bool => self.as_slice::<bool>()?.iter().map(|&x| x as i64).collect(),
            other => {
                return Err(IrError::DTypeMismatch {
                    expected: DType::I64,
                    found: other,
                })
            }
        })
    }

    /// Any numeric tensor widened to f64 (for references, statistics and constant folding).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>, IrError> {
        Ok(match self.dtype {
            DType::F32 => self.as_slice::<f32>()?.iter().map(|&x| x as f64).collect(),
            DType::F64 => self.as_slice::<f64>()?.to_vec(),
            DType::F16 => self.as_slice::<f16>()?.iter().map(|x| x.to_f64()).collect(),
            DType::BF16 => self
                .as_slice::<bf16>()?
                .iter()
                .map(|x| x.to_f64())
                .collect(),
            d if d.is_small_float() => self
                .as_slice::<u8>()?
                .iter()
                .map(|&c| crate::lowp::to_f32(d, c).unwrap_or(f32::NAN) as f64)
                .collect(),
            DType::String => {
                return Err(IrError::DTypeMismatch {
                    expected: DType::F64,
                    found: DType::String,
                })
            }
            _ => self.to_i64_vec()?.into_iter().map(|x| x as f64).collect(),
        })
    }

    /// Little-endian bytes of the data (4-bit types one value per byte; strings unsupported).
    pub fn to_le_bytes(&self) -> Result<Vec<u8>, IrError> {
        self.le_bytes().map(|b| b.into_owned())
    }

    /// The little-endian bytes of a fixed-size dtype (4-bit: one code a byte; bool: 0/1),
    /// borrowed wherever the data already is in that form (all but bool), so writers stream a
    /// weight without copying it.
    pub fn le_bytes(&self) -> Result<std::borrow::Cow<'_, [u8]>, IrError> {
        use std::borrow::Cow;
        // The host's byte order: npuc targets little-endian hosts only (as every reader of
        // these bytes, `from_le_bytes` included, assumes).
        fn b<T: bytemuck::Pod>(s: &[T]) -> Cow<'_, [u8]> {
            Cow::Borrowed(bytemuck::cast_slice(s))
        }
        if let TensorData::Borrowed(br) = &self.data {
            return Ok(Cow::Borrowed(br.bytes()));
        }
        Ok(match &self.data {
            TensorData::F32(v) => b(v),
            TensorData::F64(v) => b(v),
            TensorData::F16(v) => b(v),
            TensorData::BF16(v) => b(v),
            TensorData::I8(v) | TensorData::I4(v) => b(v),
            TensorData::U8(v) | TensorData::U4(v) => Cow::Borrowed(v.as_slice()),
            TensorData::I16(v) => b(v),
            TensorData::U16(v) => b(v),
            TensorData::I32(v) => b(v),
            TensorData::U32(v) => b(v),
            TensorData::I64(v) => b(v),
            TensorData::U64(v) => b(v),
            TensorData::Bool(v) => Cow::Owned(v.iter().map(|&x| x as u8).collect()),
            TensorData::String(_) => {
                return Err(IrError::Unsupported(
                    "string tensors have no byte form".into(),
                ))
            }
            TensorData::Borrowed(_) => unreachable!("handled above"),
        })
    }
}

fn copy_le(dtype: DType, bytes: &[u8]) -> TensorData {
    fn v<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
        bytemuck::pod_collect_to_vec(bytes)
    }
    match dtype {
        DType::F32 => TensorData::F32(v(bytes)),
        DType::F64 => TensorData::F64(v(bytes)),
        DType::F16 => TensorData::F16(v(bytes)),
        DType::BF16 => TensorData::BF16(v(bytes)),
        DType::I8 => TensorData::I8(v(bytes)),
        DType::U8 => TensorData::U8(bytes.to_vec()),
        DType::I16 => TensorData::I16(v(bytes)),
        DType::U16 => TensorData::U16(v(bytes)),
        DType::I32 => TensorData::I32(v(bytes)),
        DType::U32 => TensorData::U32(v(bytes)),
        DType::I64 => TensorData::I64(v(bytes)),
        DType::U64 => TensorData::U64(v(bytes)),
        DType::Bool => TensorData::Bool(bytes.iter().map(|&b| b != 0).collect()),
        DType::I4 => TensorData::I4(v(bytes)),
        DType::U4 => TensorData::U4(bytes.to_vec()),
        DType::I2 => TensorData::I8(v(bytes)),
        DType::String => TensorData::String(vec![]),
        _ => TensorData::U8(bytes.to_vec()),
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({} {:?}", self.dtype, self.shape)?;
        if let Ok(v) = self.to_f64_vec() {
            let n = v.len().min(8);
            write!(f, " {:?}{}", &v[..n], if v.len() > n { "…" } else { "" })?;
        }
        write!(f, ")")
    }
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Tensor) -> bool {
        if self.dtype != other.dtype || self.shape != other.shape {
            return false;
        }
        if self.dtype == DType::String {
            return self.as_strings().ok() == other.as_strings().ok();
        }
        match (self.to_le_bytes(), other.to_le_bytes()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }
}
