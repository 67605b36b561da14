//! Matrix products: MatMul, Gemm, Einsum and the attention family.
//!
//! f32 products run the runtime's AVX-512 kernel (`kernels::sgemm`) when the active level has
//! AVX-512, with a constant right operand packed once per plan ([`matmul_const_b`], which also
//! takes products of few rows at AVX2); otherwise,
//! and for f64, they go through the `gemm` crate ([`gemm_into`]). f16/bf16 are widened to f32
//! (which is also what numpy-based references effectively accumulate in); integer products use
//! a plain wrapping triple loop.

pub(crate) mod attention;
mod einsum;
mod linear;

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::kernels::sgemm::{self, PackedB, View};
use crate::ops::common::{broadcast_shapes, broadcast_strides};
use crate::value::Value;
use npuc_ir::{bf16, f16, DType, Elem, Tensor};
use npuc_isa::Isa;
use rayon::prelude::*;
use std::borrow::Cow;

pub fn register(r: &mut Registry) {
    r.add("MatMul", 1, matmul);
    r.add("Gemm", 1, gemm_op);
    r.add("Einsum", 12, einsum::einsum);
    attention::register(r);
    linear::register(r);
}

/// Products with at least this many multiply-adds may use several threads.
const PAR_WORK: usize = 1 << 17;

/// A float type the `gemm` crate multiplies natively, plus the conversions kernels need to
/// load any float tensor into it and store results back in the tensor's own dtype.
pub trait GemmFloat:
    Elem + num_traits::Float + std::ops::AddAssign + std::ops::MulAssign + std::iter::Sum + Send + Sync
{
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    /// The tensor's data as `Self` (borrowed when the dtype already matches).
    fn load(t: &Tensor) -> Result<Cow<'_, [Self]>>;
    /// Builds a tensor of `dtype` (the compute type itself, or a narrower float) from `v`.
    fn store(dtype: DType, shape: Vec<usize>, v: Vec<Self>) -> Result<Tensor>;
    /// e^x for softmax-style loops: the runtime's vectorizable f32 exp for f32, libm otherwise.
    #[inline(always)]
    fn fast_exp(self) -> Self {
        self.exp()
    }
    /// `dst = scale * a * b` with the runtime's own kernel when it has one for this type at
    /// the active level (bounds already checked by [`gemm_into`]); `None`: use the `gemm`
    /// crate.
    #[allow(clippy::too_many_arguments)]
    fn own_gemm(
        _m: usize,
        _n: usize,
        _k: usize,
        _scale: Self,
        _a: Mat<Self>,
        _b: Mat<Self>,
        _dst: &mut [Self],
        _dst_rs: usize,
        _threads: usize,
    ) -> Option<Result<()>> {
        None
    }
}

impl GemmFloat for f32 {
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        crate::ops::elementwise::exp_f32(self)
    }
    fn own_gemm(
        m: usize,
        n: usize,
        k: usize,
        scale: f32,
        a: Mat<f32>,
        b: Mat<f32>,
        dst: &mut [f32],
        dst_rs: usize,
        threads: usize,
    ) -> Option<Result<()>> {
        let isa = Isa::detect();
        if !sgemm::preferred_for_matmul(isa) {
            return None;
        }
        fn view(x: Mat<'_, f32>) -> View<'_> {
            View {
                data: x.data,
                rs: x.rs,
                cs: x.cs,
            }
        }
        Some(sgemm::sgemm(
            isa,
            m,
            n,
            k,
            scale,
            view(a),
            view(b),
            dst,
            dst_rs,
            threads,
        ))
    }
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn load(t: &Tensor) -> Result<Cow<'_, [f32]>> {
        Ok(match t.dtype() {
            DType::F32 => Cow::Borrowed(t.as_slice::<f32>()?),
            DType::F16 => Cow::Owned(t.as_slice::<f16>()?.iter().map(|x| x.to_f32()).collect()),
            DType::BF16 => Cow::Owned(t.as_slice::<bf16>()?.iter().map(|x| x.to_f32()).collect()),
            other => bail!("expected a float tensor, found {other}"),
        })
    }
    fn store(dtype: DType, shape: Vec<usize>, v: Vec<f32>) -> Result<Tensor> {
        Ok(match dtype {
            DType::F32 => Tensor::from_vec(shape, v)?,
            DType::F16 => Tensor::from_vec(shape, v.into_iter().map(f16::from_f32).collect())?,
            DType::BF16 => Tensor::from_vec(shape, v.into_iter().map(bf16::from_f32).collect())?,
            other => bail!("cannot store f32 results as {other}"),
        })
    }
}

impl GemmFloat for f64 {
    fn from_f64(v: f64) -> f64 {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn load(t: &Tensor) -> Result<Cow<'_, [f64]>> {
        Ok(match t.dtype() {
            DType::F64 => Cow::Borrowed(t.as_slice::<f64>()?),
            _ => Cow::Owned(t.to_f64_vec()?),
        })
    }
    fn store(dtype: DType, shape: Vec<usize>, v: Vec<f64>) -> Result<Tensor> {
        if dtype != DType::F64 {
            bail!("cannot store f64 results as {dtype}");
        }
        Ok(Tensor::from_vec(shape, v)?)
    }
}

/// A strided read-only matrix view: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// Row-major contiguous `rows x cols` matrix.
    pub fn rows(data: &'a [T], cols: usize) -> Self {
        Mat {
            data,
            rs: cols,
            cs: 1,
        }
    }
    /// The transpose of a row-major `rows x cols` matrix (a column-major `cols x rows` view).
    pub fn cols(data: &'a [T], cols: usize) -> Self {
        Mat {
            data,
            rs: 1,
            cs: cols,
        }
    }
    fn fits(&self, r: usize, c: usize) -> bool {
        r == 0 || c == 0 || (r - 1) * self.rs + (c - 1) * self.cs < self.data.len()
    }
}

/// `dst[m x n] (row stride dst_rs, unit column stride) = scale * a[m x k] * b[k x n]`, plus
/// `acc * dst` when `acc` is given. Bounds are validated before the product. f32 without
/// `acc` runs `kernels::sgemm` at the AVX-512 level ([`GemmFloat::own_gemm`]), everything
/// else the `gemm` crate.
#[allow(clippy::too_many_arguments)]
pub fn gemm_into<T: GemmFloat>(
    m: usize,
    n: usize,
    k: usize,
    scale: T,
    a: Mat<T>,
    b: Mat<T>,
    acc: Option<T>,
    dst: &mut [T],
    dst_rs: usize,
    threads: usize,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    if !a.fits(m, k) || !b.fits(k, n) || (m - 1) * dst_rs + n > dst.len() || dst_rs < n {
        bail!("matrix product operands are smaller than their shapes ({m}x{k} by {k}x{n})");
    }
    if k == 0 {
        for row in 0..m {
            for v in &mut dst[row * dst_rs..row * dst_rs + n] {
                *v = match acc {
                    Some(s) => *v * s,
                    None => T::zero(),
                };
            }
        }
        return Ok(());
    }
    if acc.is_none() {
        if let Some(done) = T::own_gemm(m, n, k, scale, a, b, dst, dst_rs, threads) {
            return done;
        }
    }
    let par = if threads > 1 && m * n * k >= PAR_WORK {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: `fits` checked that every element the product reads, (m-1,k-1) of `a`,
    // (k-1,n-1) of `b`, lies inside its slice, and the check above that row m-1 of `dst` ends
    // inside `dst` with rows not overlapping (dst_rs >= n); `dst` is borrowed mutably so
    // nothing aliases it. `T` is f32 or f64, both supported by `gemm`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            acc.is_some(),
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            acc.unwrap_or(T::zero()),
            scale,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

/// Integer element types for the plain matrix product (wrapping arithmetic, as numpy does).
pub trait IntElem: Elem {
    fn wmul_add(self, a: Self, b: Self) -> Self;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl IntElem for $t {
            #[inline]
            fn wmul_add(self, a: Self, b: Self) -> Self {
                self.wrapping_add(a.wrapping_mul(b))
            }
        }
    )*};
}
int_elem!(i8, u8, i16, u16, i32, u32, i64, u64);

/// `dst[m x n] = a[m x k] * b[k x n]` for integers, contiguous row-major operands.
fn int_mm<T: IntElem>(m: usize, n: usize, k: usize, a: &[T], b: &[T], dst: &mut [T]) {
    for i in 0..m {
        let row = &mut dst[i * n..(i + 1) * n];
        row.fill(T::default());
        for p in 0..k {
            let av = a[i * k + p];
            let brow = &b[p * n..(p + 1) * n];
            for (d, &bv) in row.iter_mut().zip(brow) {
                *d = d.wmul_add(av, bv);
            }
        }
    }
}

/// Shapes of a numpy-style batched matrix product.
pub struct MatMulPlan {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub out_shape: Vec<usize>,
    /// Per output matrix: offsets (in elements) of the a and b operand matrices.
    pub offsets: Vec<(usize, usize)>,
    /// b is one matrix shared by every batch and a's batches are contiguous: the whole product
    /// is a single (batch*m) x k by k x n product.
    pub fold_batch: bool,
}

impl MatMulPlan {
    pub fn new(a: &[usize], b: &[usize]) -> Result<MatMulPlan> {
        if a.is_empty() || b.is_empty() {
            bail!("MatMul operands must have rank >= 1 (got {a:?} and {b:?})");
        }
        let a2: Vec<usize> = if a.len() == 1 {
            vec![1, a[0]]
        } else {
            a.to_vec()
        };
        let b2: Vec<usize> = if b.len() == 1 {
            vec![b[0], 1]
        } else {
            b.to_vec()
        };
        let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
        let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
        if k != k2 {
            bail!("MatMul inner dimensions differ: {a:?} x {b:?}");
        }
        let ab = &a2[..a2.len() - 2];
        let bb = &b2[..b2.len() - 2];
        let batch = broadcast_shapes(ab, bb)?;
        let mut out_shape = batch.clone();
        if a.len() > 1 {
            out_shape.push(m);
        }
        if b.len() > 1 {
            out_shape.push(n);
        }
        let nb: usize = batch.iter().product();
        let b_single = bb.iter().product::<usize>() == 1;
        let a_full = ab.iter().product::<usize>() == nb;
        let fold_batch = b_single && a_full;
        let mut offsets = Vec::with_capacity(if fold_batch { 0 } else { nb });
        if !fold_batch {
            let sa = broadcast_strides(ab, &batch);
            let sb = broadcast_strides(bb, &batch);
            let mut idx = vec![0usize; batch.len()];
            for _ in 0..nb {
                let oa: usize = idx.iter().zip(&sa).map(|(i, s)| i * s).sum();
                let ob: usize = idx.iter().zip(&sb).map(|(i, s)| i * s).sum();
                offsets.push((oa * m * k, ob * k * n));
                for d in (0..batch.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < batch[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
        }
        Ok(MatMulPlan {
            m,
            n,
            k,
            out_shape,
            offsets,
            fold_batch,
        })
    }

    fn batches(&self) -> usize {
        self.out_shape
            .iter()
            .product::<usize>()
            .checked_div(self.m * self.n)
            .unwrap_or(0)
    }
}

/// Runs a planned batched float product.
pub fn matmul_float<T: GemmFloat>(
    p: &MatMulPlan,
    a: &[T],
    b: &[T],
    threads: usize,
) -> Result<Vec<T>> {
    let (m, n, k) = (p.m, p.n, p.k);
    let total: usize = p.out_shape.iter().product();
    let mut out = crate::buffers::filled(total, T::zero());
    if total == 0 {
        return Ok(out);
    }
    if p.fold_batch {
        let rows = p.batches() * m;
        gemm_into(
            rows,
            n,
            k,
            T::one(),
            Mat::rows(a, k),
            Mat::rows(b, n),
            None,
            &mut out,
            n,
            threads,
        )?;
        return Ok(out);
    }
    let one = |(dst, &(oa, ob)): (&mut [T], &(usize, usize)), th: usize| -> Result<()> {
        let (Some(aa), Some(bb)) = (a.get(oa..), b.get(ob..)) else {
            bail!("MatMul operand offsets out of range");
        };
        gemm_into(
            m,
            n,
            k,
            T::one(),
            Mat::rows(aa, k),
            Mat::rows(bb, n),
            None,
            dst,
            n,
            th,
        )
    };
    let per = m * n * k;
    let count = p.offsets.len();
    // Whole products per thread when they are small, or when they divide evenly over the
    // threads (attention heads: 6 or 12 of them), which saves the per-product fork and join:
    // ViT-S's 24 attention products took 18.9 ms at 2 threads split one by one against
    // 12.1 ms at 1 thread. (Each output is computed the same way either way.)
    let spread =
        count > 1 && (per < PAR_WORK * 4 || count.is_multiple_of(threads) || count >= 4 * threads);
    if threads > 1 && spread {
        // Many products: spread whole matrices over threads.
        out.par_chunks_mut(m * n)
            .zip(p.offsets.par_iter())
            .try_for_each(|x| one(x, 1))?;
    } else {
        for x in out.chunks_mut(m * n).zip(p.offsets.iter()) {
            one(x, threads)?;
        }
    }
    Ok(out)
}

fn matmul_int<T: IntElem>(p: &MatMulPlan, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (a, b) = (a.as_slice::<T>()?, b.as_slice::<T>()?);
    let (m, n, k) = (p.m, p.n, p.k);
    let total: usize = p.out_shape.iter().product();
    let mut out = crate::buffers::filled(total, T::default());
    if total > 0 {
        if p.fold_batch {
            let rows = p.batches() * m;
            if a.len() < rows * k || b.len() < k * n {
                bail!("MatMul operands are smaller than their shapes");
            }
            int_mm(rows, n, k, a, b, &mut out);
        } else {
            for (dst, &(oa, ob)) in out.chunks_mut(m * n).zip(&p.offsets) {
                let (Some(aa), Some(bb)) = (a.get(oa..oa + m * k), b.get(ob..ob + k * n)) else {
                    bail!("MatMul operand offsets out of range");
                };
                int_mm(m, n, k, aa, bb, dst);
            }
        }
    }
    Ok(Tensor::from_vec(p.out_shape.clone(), out)?)
}

/// Product of float tensors of the same dtype, computed in `T`.
pub fn matmul_tensors(a: &Tensor, b: &Tensor, threads: usize) -> Result<Tensor> {
    if a.dtype() != b.dtype() {
        bail!(
            "MatMul operands differ in dtype: {} vs {}",
            a.dtype(),
            b.dtype()
        );
    }
    let p = MatMulPlan::new(a.shape(), b.shape())?;
    fn fl<T: GemmFloat>(p: &MatMulPlan, a: &Tensor, b: &Tensor, th: usize) -> Result<Tensor> {
        let v = matmul_float::<T>(p, &T::load(a)?, &T::load(b)?, th)?;
        T::store(a.dtype(), p.out_shape.clone(), v)
    }
    match a.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => fl::<f32>(&p, a, b, threads),
        DType::F64 => fl::<f64>(&p, a, b, threads),
        DType::I32 => matmul_int::<i32>(&p, a, b),
        DType::I64 => matmul_int::<i64>(&p, a, b),
        DType::U32 => matmul_int::<u32>(&p, a, b),
        DType::U64 => matmul_int::<u64>(&p, a, b),
        DType::I8 => matmul_int::<i8>(&p, a, b),
        DType::U8 => matmul_int::<u8>(&p, a, b),
        DType::I16 => matmul_int::<i16>(&p, a, b),
        DType::U16 => matmul_int::<u16>(&p, a, b),
        other => bail!("MatMul does not support {other}"),
    }
}

/// MatMul: numpy `matmul` semantics (batch broadcasting, 1-D operands promoted then squeezed).
fn matmul(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let (a, b) = (ins.tensor(0)?, ins.tensor(1)?);
    let t = match matmul_const_b(ctx, a, b, None)? {
        Some(t) => t,
        None => matmul_tensors(a, b, ctx.threads)?,
    };
    Ok(vec![Value::tensor(t)])
}

/// f32 `a [..., m, k] x b [k, n]` with `b` a constant of the plan (a weight), at the AVX-512
/// level (at AVX2 for few rows, [`sgemm::prepacked_preferred`]), in a session that keeps weights packed ([`OpCtx::prepack_weights`]): `b` is packed
/// for `kernels::sgemm` once per plan (the node's cache) instead of on every call. `None` when
/// that does not apply (other dtypes or levels, a computed or batched `b`, prepacking off);
/// the caller then runs [`matmul_tensors`]. `finish` runs on each finished stretch of the
/// output inside the product ([`sgemm::Finish`]; only when the result is `Some`).
pub(crate) fn matmul_const_b(
    ctx: &OpCtx,
    a: &Tensor,
    b: &Tensor,
    finish: Option<sgemm::Finish>,
) -> Result<Option<Tensor>> {
    let isa = Isa::detect();
    if a.dtype() != DType::F32
        || b.dtype() != DType::F32
        || b.rank() != 2
        || !ctx.input_is_const(1)
        || !ctx.prepack_weights()
    {
        return Ok(None);
    }
    let p = MatMulPlan::new(a.shape(), b.shape())?;
    if !p.fold_batch || !sgemm::prepacked_preferred(isa, p.batches() * p.m) {
        return Ok(None);
    }
    let (k, n) = (p.k, p.n);
    let packed = ctx.cached(|| PackedB::new(k, n, View::rows(b.as_slice::<f32>()?, n)))?;
    if packed.k() != k || packed.n() != n {
        bail!(
            "MatMul weight packed as {}x{}, now {k}x{n}",
            packed.k(),
            packed.n()
        );
    }
    let rows = p.batches() * p.m;
    let mut out = crate::buffers::for_overwrite::<f32>(rows * n);
    sgemm::sgemm_packed_then(
        isa,
        rows,
        1.0,
        View::rows(a.as_slice::<f32>()?, k),
        &packed,
        &mut out,
        n,
        ctx.threads,
        finish,
    )?;
    Ok(Some(Tensor::from_vec(p.out_shape, out)?))
}

/// Gemm: `Y = alpha * op(A) * op(B) + beta * C`, with op = optional transpose and C
/// (optional since opset 11) broadcast to `[M, N]`.
fn gemm_op(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let a = ins.tensor(0)?;
    let b = ins.tensor(1)?;
    let c = ins.opt_tensor(2);
    let n = ctx.node;
    let ta = n.int_or("transA", 0)? != 0;
    let tb = n.int_or("transB", 0)? != 0;
    let alpha = n.float_or("alpha", 1.0)? as f64;
    let beta = n.float_or("beta", 1.0)? as f64;
    if a.rank() != 2 || b.rank() != 2 {
        bail!(
            "Gemm needs 2-D A and B, got {:?} and {:?}",
            a.shape(),
            b.shape()
        );
    }
    if a.dtype() != b.dtype() || c.is_some_and(|c| c.dtype() != a.dtype()) {
        bail!("Gemm operands must share one dtype");
    }
    let (m, k) = if ta {
        (a.shape()[1], a.shape()[0])
    } else {
        (a.shape()[0], a.shape()[1])
    };
    let (k2, nn) = if tb {
        (b.shape()[1], b.shape()[0])
    } else {
        (b.shape()[0], b.shape()[1])
    };
    if k != k2 {
        bail!(
            "Gemm inner dimensions differ: {:?} x {:?}",
            a.shape(),
            b.shape()
        );
    }
    fn run<T: GemmFloat>(
        a: &Tensor,
        b: &Tensor,
        c: Option<&Tensor>,
        (m, n, k, ta, tb, alpha, beta): (usize, usize, usize, bool, bool, f64, f64),
        threads: usize,
    ) -> Result<Tensor> {
        let av = T::load(a)?;
        let bv = T::load(b)?;
        let mut out = crate::buffers::filled(m * n, T::zero());
        let mut acc = None;
        if let Some(c) = c {
            let cs = c.shape();
            if cs.len() > 2 {
                bail!("Gemm C must have rank <= 2, got {cs:?}");
            }
            let bshape = broadcast_shapes(cs, &[m, n])?;
            if bshape != [m, n] {
                bail!("Gemm C {cs:?} does not broadcast to [{m}, {n}]");
            }
            let st = broadcast_strides(cs, &[m, n]);
            let cv = T::load(c)?;
            let bt = T::from_f64(beta);
            for i in 0..m {
                for j in 0..n {
                    out[i * n + j] = bt * cv[i * st[0] + j * st[1]];
                }
            }
            acc = Some(T::one());
        }
        let am = if ta {
            Mat::cols(&av, m)
        } else {
            Mat::rows(&av, k)
        };
        let bm = if tb {
            Mat::cols(&bv, k)
        } else {
            Mat::rows(&bv, n)
        };
        gemm_into(
            m,
            n,
            k,
            T::from_f64(alpha),
            am,
            bm,
            acc,
            &mut out,
            n,
            threads,
        )?;
        T::store(a.dtype(), vec![m, n], out)
    }
    let dims = (m, nn, k, ta, tb, alpha, beta);
    let t = match a.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => run::<f32>(a, b, c, dims, ctx.threads)?,
        DType::F64 => run::<f64>(a, b, c, dims, ctx.threads)?,
        other => bail!("Gemm does not support {other}"),
    };
    Ok(vec![Value::tensor(t)])
}
