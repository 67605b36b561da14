//! Recurrent layers: RNN, GRU, LSTM and com.microsoft::DynamicQuantizeLSTM.
//!
//! All four share one driver: the input projection `X·Wᵀ + biases` is computed for every
//! timestep at once with one GEMM, then each step adds `H·Rᵀ` (one small GEMM for the whole
//! batch) and applies the cell's gate math. Directions (forward, reverse, bidirectional),
//! `sequence_lens`, `layout` 0/1, initial states, activations with alpha/beta and `clip` follow
//! the ONNX spec. Computation is in f32; f16/bf16/f64 inputs are converted and the outputs are
//! returned in the input's type.

use crate::bail;
use crate::error::{Result, RtError};
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::kernels::igemm::{igemm, PackBuf, PackedA, PackedB};
use crate::kernels::qgemv::{gemv_codes_fast as qgemv_codes, PackedI8};
use crate::kernels::sgemm::{self, View};
use crate::kernels::{act, fmap};
use crate::ops::quant::{dynamic_qparams_u8, quantize_u8};
use crate::value::Value;
use npuc_ir::{bf16, f16, DType, Node, Tensor};
use npuc_isa::Isa;

pub fn register(r: &mut Registry) {
    r.add("RNN", 1, rnn_op);
    r.add("GRU", 1, gru_op);
    r.add("LSTM", 1, lstm_op);
    r.add_range("com.microsoft", "DynamicQuantizeLSTM", 1, 1, dq_lstm_op);
}

// ---------------------------------------------------------------------------------------------
// Activations
// ---------------------------------------------------------------------------------------------

/// An RNN activation function with its alpha/beta parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    Relu,
    Tanh,
    Sigmoid,
    Affine(f32, f32),
    LeakyRelu(f32),
    ThresholdedRelu(f32),
    ScaledTanh(f32, f32),
    HardSigmoid(f32, f32),
    Elu(f32),
    Softsign,
    Softplus,
}

impl Act {
    #[inline]
    fn apply(self, x: f32) -> f32 {
        match self {
            Act::Relu => x.max(0.0),
            Act::Tanh => act::tanh_f32(x),
            Act::Sigmoid => act::sigmoid_f32(x),
            Act::Affine(a, b) => a * x + b,
            Act::LeakyRelu(a) => {
                if x >= 0.0 {
                    x
                } else {
                    a * x
                }
            }
            Act::ThresholdedRelu(a) => {
                if x > a {
                    x
                } else {
                    0.0
                }
            }
            Act::ScaledTanh(a, b) => a * (b * x).tanh(),
            Act::HardSigmoid(a, b) => (a * x + b).clamp(0.0, 1.0),
            Act::Elu(a) => {
                if x >= 0.0 {
                    x
                } else {
                    a * (x.exp() - 1.0)
                }
            }
            Act::Softsign => x / (1.0 + x.abs()),
            Act::Softplus => (x.exp() + 1.0).ln(),
        }
    }

    /// [`Act::apply`] over a slice in place; tanh and sigmoid (the usual gate functions) run
    /// the vectorized loops of [`act`], which compute exactly what `apply` does per element.
    fn apply_slice(self, v: &mut [f32]) {
        match self {
            Act::Tanh => act::tanh(v),
            Act::Sigmoid => act::sigmoid(v),
            _ => v.iter_mut().for_each(|x| *x = self.apply(*x)),
        }
    }
}

/// Parses the `activations` attribute (defaults per direction when absent). `activation_alpha`
/// and `activation_beta` are consumed in order by the functions that take them.
fn parse_activations(node: &Node, defaults: &[&str], dirs: usize) -> Result<Vec<Act>> {
    let given: Vec<String> = match node.attr_strings("activations")? {
        Some(v) => v.to_vec(),
        None => defaults.iter().map(|s| s.to_string()).collect(),
    };
    let names: Vec<String> = if given.len() == defaults.len() * dirs {
        given
    } else if given.len() == defaults.len() {
        // One set given for a bidirectional layer: both directions use it.
        given
            .iter()
            .cycle()
            .take(defaults.len() * dirs)
            .cloned()
            .collect()
    } else {
        bail!(
            "activations has {} entries, expected {} per direction",
            given.len(),
            defaults.len()
        );
    };
    let alphas = node.attr_floats("activation_alpha")?.unwrap_or(&[]);
    let betas = node.attr_floats("activation_beta")?.unwrap_or(&[]);
    let (mut ai, mut bi) = (0usize, 0usize);
    let next = |list: &[f32], i: &mut usize, default: f32| {
        let v = list.get(*i).copied().unwrap_or(default);
        *i += 1;
        v
    };
    names
        .iter()
        .map(|n| {
            Ok(match n.to_ascii_lowercase().as_str() {
                "relu" => Act::Relu,
                "tanh" => Act::Tanh,
                "sigmoid" => Act::Sigmoid,
                "affine" => {
                    let a = next(alphas, &mut ai, 1.0);
                    Act::Affine(a, next(betas, &mut bi, 0.0))
                }
                "leakyrelu" => Act::LeakyRelu(next(alphas, &mut ai, 0.01)),
                "thresholdedrelu" => Act::ThresholdedRelu(next(alphas, &mut ai, 1.0)),
                "scaledtanh" => {
                    let a = next(alphas, &mut ai, 1.0);
                    Act::ScaledTanh(a, next(betas, &mut bi, 1.0))
                }
                "hardsigmoid" => {
                    let a = next(alphas, &mut ai, 0.2);
                    Act::HardSigmoid(a, next(betas, &mut bi, 0.5))
                }
                "elu" => Act::Elu(next(alphas, &mut ai, 1.0)),
                "softsign" => Act::Softsign,
                "softplus" => Act::Softplus,
                other => bail!("unknown activation '{other}'"),
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Projections (float GEMM or dynamically quantized integer GEMM)
// ---------------------------------------------------------------------------------------------

/// `dst[i, j] (+)= Σ_p a[i, p] · w[j, p]` for `i < m`, `j < n`, `p < k`: `a` is row-major with
/// row stride `k`, `w` is row-major `[n, k]` (the ONNX `W`/`R` layout), `dst` has row stride
/// `dst_rs`.
#[allow(clippy::too_many_arguments)] // GEMM-style signature: dims, operands, strides.
fn gemm_wt(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    w: &[f32],
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() >= m * k && w.len() >= n * k && dst_rs >= n);
    assert!(dst.len() >= (m - 1) * dst_rs + n);
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst[i * dst_rs..i * dst_rs + n].fill(0.0);
            }
        }
        return;
    }
    if m == 1 {
        // One row (batch 1 recurrences): dot products against W's rows, no packing.
        let ok = crate::kernels::sgemv::dot_rows(a, w, k, &mut dst[..n], accumulate);
        assert!(ok, "gemm_wt operands checked above");
        return;
    }
    let par = if threads > 1 && m * n * k >= 1 << 20 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above check that the last element read from `a` ((m-1)*k + k-1),
    // from `w` ((n-1)*k + k-1) and the last element written to `dst` ((m-1)*dst_rs + n-1) lie
    // inside their slices; rows of `dst` do not overlap (dst_rs >= n) and `dst` is borrowed
    // mutably, so nothing aliases it. f32 is supported by `gemm`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        );
    }
}

/// Quantized weights of one projection (DynamicQuantizeLSTM), zero points subtracted, converted
/// once per plan (see [`dq_lstm_op`]).
enum QWeights {
    /// Int8 panels for the one-row-at-a-time recurrent product ([`qgemv_codes`]: onnxruntime's
    /// saturating u8 x s8 arithmetic at the AVX2 level, see `kernels::qgemv`); used when every
    /// corrected value fits i8 (int8 weights with zero point 0, as quantizers write them).
    Narrow(PackedI8),
    /// I16 panels for the many-row input projection, and for weights that do not fit i8.
    Wide(PackedB),
}

/// Scratch buffers of the quantized products, kept across timesteps so a step allocates
/// nothing.
#[derive(Default)]
struct QScratch {
    /// Quantized, zero-point-corrected rows (one row for [`QWeights::Narrow`]).
    a: Vec<i16>,
    /// Packed rows for [`QWeights::Wide`].
    packed_a: PackBuf,
    /// Integer sums.
    acc: Vec<i32>,
    /// One quantized row.
    bytes: Vec<u8>,
}

/// A weight matrix applied as `a · Wᵀ`.
enum Proj<'a> {
    /// f32 weights `[n, k]`.
    Float(&'a [f32]),
    /// f32 weights packed once per plan for [`sgemm`] (`Wᵀ`, `k x n`): the many-row input
    /// projection at the AVX-512 level.
    Packed(&'a sgemm::PackedB),
    /// Quantized weights (DynamicQuantizeLSTM, `[k, n]` in the ONNX layout) with one scale per
    /// output column. Inputs are quantized to u8 per call (DynamicQuantizeLinear) like
    /// onnxruntime does.
    Quant {
        w: &'a QWeights,
        scale: &'a [f32],
        per_row: bool,
    },
}

/// `q - zp` of DynamicQuantizeLinear(`xs`) with the given scale and zero point, into `dst`
/// (`bytes` is scratch of `xs.len()`).
fn quantize_centered(xs: &[f32], scale: f32, zp: u8, bytes: &mut [u8], dst: &mut [i16]) {
    quantize_u8(xs, scale, zp, bytes);
    for (d, &q) in dst.iter_mut().zip(bytes.iter()) {
        *d = q as i16 - zp as i16;
    }
}

impl Proj<'_> {
    /// The recurrent product quantizes each batch row's hidden state on its own (what
    /// onnxruntime does when it runs batch rows in parallel, and independent of the batch's
    /// other rows); the input projection quantizes all timesteps together.
    fn quantize_rows_separately(&self) -> bool {
        matches!(self, Proj::Quant { per_row: true, .. })
    }

    /// `dst = a · Wᵀ` with `a` `[m, k]` contiguous and `dst` `[m, n]` with row stride n.
    /// Inlined so that inside [`Layer::run_direction`]'s level-compiled step loop the
    /// rescaling of the integer sums runs as wide as the CPU allows.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn apply(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        dst: &mut [f32],
        threads: usize,
        scratch: &mut QScratch,
    ) -> Result<()> {
        match self {
            Proj::Float(w) => gemm_wt(m, n, k, a, w, dst, n, false, threads),
            Proj::Packed(pb) => {
                if pb.k() != k || pb.n() != n {
                    bail!(
                        "recurrent weight packed as {}x{}, used as {k}x{n}",
                        pb.k(),
                        pb.n()
                    );
                }
                sgemm::sgemm_packed(Isa::detect(), m, 1.0, View::rows(a, k), pb, dst, n, threads)?;
            }
            Proj::Quant { w, scale, .. } => {
                // Rows are quantized all together or one at a time (see `quantize_rows_separately`).
                let chunk_rows = if self.quantize_rows_separately() {
                    1
                } else {
                    m
                };
                for r0 in (0..m).step_by(chunk_rows.max(1)) {
                    let a = &a[r0 * k..(r0 + chunk_rows) * k];
                    let (a_scale, a_zp) = dynamic_qparams_u8(a);
                    // Sums of the chunk's rows, row stride `stride`.
                    let stride = match w {
                        QWeights::Narrow(b) => {
                            let olen = b.out_len();
                            scratch.acc.resize(chunk_rows * olen, 0);
                            scratch.bytes.resize(k, 0);
                            for (row, acc) in a.chunks(k).zip(scratch.acc.chunks_mut(olen)) {
                                quantize_u8(row, a_scale, a_zp, &mut scratch.bytes);
                                qgemv_codes(&scratch.bytes, a_zp, b, acc, &mut scratch.a)?;
                            }
                            olen
                        }
                        QWeights::Wide(b) => {
                            let buf = std::mem::take(&mut scratch.packed_a);
                            let bytes = &mut scratch.bytes;
                            bytes.resize(k, 0);
                            let pa = PackedA::pack_with(buf, chunk_rows, k, |r, dst| {
                                let row = &a[r * k..(r + 1) * k];
                                quantize_centered(row, a_scale, a_zp, bytes, dst)
                            });
                            scratch.acc.resize(chunk_rows * n, 0);
                            igemm(&pa, b, &mut scratch.acc, threads)?;
                            scratch.packed_a = pa.into_buffer();
                            n
                        }
                    };
                    let dst = &mut dst[r0 * n..(r0 + chunk_rows) * n];
                    for (drow, arow) in dst.chunks_mut(n).zip(scratch.acc.chunks(stride)) {
                        for ((d, &v), &s) in drow.iter_mut().zip(arow).zip(scale.iter()) {
                            *d = v as f32 * (a_scale * s);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Shared driver
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Debug)]
enum CellKind {
    Rnn,
    Gru { linear_before_reset: bool },
    Lstm { input_forget: bool },
}

impl CellKind {
    fn gates(self) -> usize {
        match self {
            CellKind::Rnn => 1,
            CellKind::Gru { .. } => 3,
            CellKind::Lstm { .. } => 4,
        }
    }
    fn default_acts(self) -> &'static [&'static str] {
        match self {
            CellKind::Rnn => &["Tanh"],
            CellKind::Gru { .. } => &["Sigmoid", "Tanh"],
            CellKind::Lstm { .. } => &["Sigmoid", "Tanh", "Tanh"],
        }
    }
}

/// Everything a recurrent layer needs, validated, with data in f32.
struct Layer<'a> {
    kind: CellKind,
    seq: usize,
    batch: usize,
    input: usize,
    hidden: usize,
    dirs: usize,
    /// Reverse-only layer (direction = "reverse").
    reverse_only: bool,
    layout: usize,
    x: &'a [f32],
    /// Per direction: input and recurrent projections.
    w: Vec<Proj<'a>>,
    r: Vec<Proj<'a>>,
    /// Per direction `[2 * gates * hidden]` (Wb then Rb), zeros when absent.
    b: Vec<f32>,
    /// Per direction `[3 * hidden]` peepholes (i, o, f), zeros when absent.
    p: Vec<f32>,
    lens: Vec<usize>,
    h0: Option<&'a [f32]>,
    c0: Option<&'a [f32]>,
    acts: Vec<Act>,
    clip: Option<f32>,
    threads: usize,
}

/// One direction's results: Y `[seq, batch, hidden]`, final H and C `[batch, hidden]`.
struct DirOut {
    y: Vec<f32>,
    h: Vec<f32>,
    c: Vec<f32>,
}

/// Outputs in layout order: Y, Y_h, Y_c (Y_c only meaningful for LSTM).
struct LayerOut {
    y: Vec<f32>,
    y_h: Vec<f32>,
    y_c: Vec<f32>,
}

impl Layer<'_> {
    fn y_index(&self, t: usize, d: usize, b: usize) -> usize {
        if self.layout == 0 {
            ((t * self.dirs + d) * self.batch + b) * self.hidden
        } else {
            ((b * self.seq + t) * self.dirs + d) * self.hidden
        }
    }
    /// Index of (direction, batch row) in Y_h / Y_c / initial_h / initial_c.
    fn state_index(&self, d: usize, b: usize) -> usize {
        if self.layout == 0 {
            (d * self.batch + b) * self.hidden
        } else {
            (b * self.dirs + d) * self.hidden
        }
    }
    /// Row of the projected inputs holding timestep `t` of batch row `b`.
    fn x_row(&self, t: usize, b: usize) -> usize {
        if self.layout == 0 {
            t * self.batch + b
        } else {
            b * self.seq + t
        }
    }

    fn run(&self) -> Result<LayerOut> {
        let (seq, batch, hsz) = (self.seq, self.batch, self.hidden);
        // A bidirectional layer runs its two directions on two threads when it has them: each
        // step's product is too small to split, but the directions are independent.
        let per_dir: Vec<DirOut> = if self.dirs == 2 && self.threads > 1 {
            let half = self.threads / 2;
            let (a, b) = rayon::join(
                || self.run_direction(0, half),
                || self.run_direction(1, self.threads - half),
            );
            vec![a?, b?]
        } else {
            (0..self.dirs)
                .map(|d| self.run_direction(d, self.threads))
                .collect::<Result<_>>()?
        };
        let mut out = LayerOut {
            // Every value of Y is copied from a direction's output below.
            y: crate::buffers::for_overwrite::<f32>(seq * self.dirs * batch * hsz),
            y_h: vec![0.0; self.dirs * batch * hsz],
            y_c: vec![0.0; self.dirs * batch * hsz],
        };
        for (d, dir) in per_dir.iter().enumerate() {
            for t in 0..seq {
                for b in 0..batch {
                    let (yi, di) = (self.y_index(t, d, b), (t * batch + b) * hsz);
                    out.y[yi..yi + hsz].copy_from_slice(&dir.y[di..di + hsz]);
                }
            }
            for b in 0..batch {
                let si = self.state_index(d, b);
                out.y_h[si..si + hsz].copy_from_slice(&dir.h[b * hsz..(b + 1) * hsz]);
                out.y_c[si..si + hsz].copy_from_slice(&dir.c[b * hsz..(b + 1) * hsz]);
            }
        }
        for dir in per_dir {
            crate::buffers::release(dir.y);
        }
        Ok(out)
    }

    /// Direction `d` of the layer: Y in `[seq, batch, hidden]` order (zeros past each row's
    /// length) and the final states `[batch, hidden]`.
    ///
    /// The step loop's element-wise work (the gate math, the rescaling of the integer sums,
    /// the bias rows) is plain Rust, compiled here inside the CPU's level ([`fmap::vectorized`]):
    /// 16 or 8 lanes instead of the baseline target's 4, the same values. On text2tashkeel's
    /// rawi (hidden 256) that work was 16% of the run at SSE2 (perf), half the recurrent
    /// product's share; 8.7% here.
    fn run_direction(&self, d: usize, threads: usize) -> Result<DirOut> {
        fmap::vectorized(DirectionRun {
            layer: self,
            d,
            threads,
        })
    }

    #[inline(always)]
    fn run_direction_body(&self, d: usize, threads: usize) -> Result<DirOut> {
        let (seq, batch, hsz) = (self.seq, self.batch, self.hidden);
        let g = self.kind.gates();
        let gh = g * hsz;
        let n_acts = self.kind.default_acts().len();
        let clip = |v: f32| match self.clip {
            Some(c) => v.clamp(-c, c),
            None => v,
        };
        // Clipping as a separate pass over a gate slice, so the gate loops stay branch-free
        // and vectorize (the same values as `clip` per element).
        let clip_slice = |v: &mut [f32]| {
            if let Some(c) = self.clip {
                for x in v {
                    *x = x.clamp(-c, c);
                }
            }
        };
        let mut qs = QScratch::default();
        // Zeros stay past each row's length; pooled buffers, so a run allocates no pages.
        let mut ydir = crate::buffers::zeroed::<f32>(seq * batch * hsz);
        {
            let reverse = self.reverse_only || d == 1;
            let acts = &self.acts[d * n_acts..(d + 1) * n_acts];
            let wb = &self.b[d * 2 * gh..d * 2 * gh + gh];
            let rb = &self.b[d * 2 * gh + gh..(d + 1) * 2 * gh];
            let pd = &self.p[d * 3 * hsz..(d + 1) * 3 * hsz];
            // Input projection for all timesteps, with the biases that can be folded in.
            let rows = seq * batch;
            // Every value is written by the projection below.
            let mut xw = crate::buffers::for_overwrite::<f32>(rows * gh);
            let lbr = matches!(
                self.kind,
                CellKind::Gru {
                    linear_before_reset: true
                }
            );
            self.w[d].apply(rows, gh, self.input, self.x, &mut xw, threads, &mut qs)?;
            // GRU with linear_before_reset keeps Rb_h inside the reset product.
            let bias: Vec<f32> = (0..gh)
                .map(|j| wb[j] + if lbr && j >= 2 * hsz { 0.0 } else { rb[j] })
                .collect();
            for row in xw.chunks_mut(gh) {
                for (v, &b) in row.iter_mut().zip(&bias) {
                    *v += b;
                }
            }
            // States.
            let mut h = vec![0f32; batch * hsz];
            let mut c = vec![0f32; batch * hsz];
            for b in 0..batch {
                let si = self.state_index(d, b);
                if let Some(h0) = self.h0 {
                    h[b * hsz..(b + 1) * hsz].copy_from_slice(&h0[si..si + hsz]);
                }
                if let Some(c0) = self.c0 {
                    c[b * hsz..(b + 1) * hsz].copy_from_slice(&c0[si..si + hsz]);
                }
            }
            let mut hr = vec![0f32; batch * gh];
            let mut rh = vec![0f32; batch * hsz];
            let mut scratch = vec![0f32; batch * hsz];
            let mut gates = vec![0f32; gh];
            for s in 0..seq {
                let t = if reverse { seq - 1 - s } else { s };
                if !(0..batch).any(|b| t < self.lens[b]) {
                    continue;
                }
                match self.kind {
                    CellKind::Gru {
                        linear_before_reset: false,
                    } => {
                        // Only the z and r gates use H·Rᵀ directly; h uses (r ⊙ H)·R_hᵀ.
                        match &self.r[d] {
                            Proj::Float(rw) => {
                                gemm_wt(batch, 2 * hsz, hsz, &h, rw, &mut hr, gh, false, 1)
                            }
                            q => q.apply(batch, gh, hsz, &h, &mut hr, 1, &mut qs)?,
                        }
                    }
                    _ => self.r[d].apply(batch, gh, hsz, &h, &mut hr, 1, &mut qs)?,
                }
                if let CellKind::Gru {
                    linear_before_reset: false,
                } = self.kind
                {
                    // r = f(xW_r + H R_r + biases), then (r ⊙ H) · R_hᵀ.
                    for b in 0..batch {
                        let xr = &xw[self.x_row(t, b) * gh..][..gh];
                        for j in 0..hsz {
                            let r = acts[0].apply(clip(xr[hsz + j] + hr[b * gh + hsz + j]));
                            scratch[b * hsz + j] = r * h[b * hsz + j];
                        }
                    }
                    match &self.r[d] {
                        Proj::Float(rw) => gemm_wt(
                            batch,
                            hsz,
                            hsz,
                            &scratch,
                            &rw[2 * hsz * hsz..],
                            &mut rh,
                            hsz,
                            false,
                            1,
                        ),
                        q => {
                            // Quantized weights cannot be sliced by rows: project all gates
                            // and keep the h block.
                            let mut full = vec![0f32; batch * gh];
                            q.apply(batch, gh, hsz, &scratch, &mut full, 1, &mut qs)?;
                            for b in 0..batch {
                                rh[b * hsz..(b + 1) * hsz]
                                    .copy_from_slice(&full[b * gh + 2 * hsz..(b + 1) * gh]);
                            }
                        }
                    }
                }
                for b in 0..batch {
                    if t >= self.lens[b] {
                        continue;
                    }
                    let xr = &xw[self.x_row(t, b) * gh..][..gh];
                    let hrr = &hr[b * gh..(b + 1) * gh];
                    let hb = &mut h[b * hsz..(b + 1) * hsz];
                    let cb = &mut c[b * hsz..(b + 1) * hsz];
                    match self.kind {
                        CellKind::Rnn => {
                            for j in 0..hsz {
                                hb[j] = clip(xr[j] + hrr[j]);
                            }
                            acts[0].apply_slice(hb);
                        }
                        CellKind::Gru {
                            linear_before_reset,
                        } => {
                            // Gate by gate over whole slices, so the activations run
                            // vectorized (the same values as `Act::apply` per element).
                            // Slices cut to exactly `hsz` values, clipping as its own pass:
                            // the loops have no bounds checks or branches and vectorize.
                            let (gz, rest) = gates.split_at_mut(hsz);
                            let (gr, rest) = rest.split_at_mut(hsz);
                            let gn = &mut rest[..hsz];
                            let hb = &mut hb[..hsz];
                            let part = |g: usize| (&xr[g * hsz..][..hsz], &hrr[g * hsz..][..hsz]);
                            let ((xz, hz), (xrr, hrg), (xn, hn)) = (part(0), part(1), part(2));
                            for j in 0..hsz {
                                gz[j] = xz[j] + hz[j];
                            }
                            clip_slice(gz);
                            acts[0].apply_slice(gz);
                            if linear_before_reset {
                                for j in 0..hsz {
                                    gr[j] = xrr[j] + hrg[j];
                                }
                                clip_slice(gr);
                                acts[0].apply_slice(gr);
                                let rbn = &rb[2 * hsz..][..hsz];
                                for j in 0..hsz {
                                    gn[j] = xn[j] + gr[j] * (hn[j] + rbn[j]);
                                }
                            } else {
                                let rhb = &rh[b * hsz..][..hsz];
                                for j in 0..hsz {
                                    gn[j] = xn[j] + rhb[j];
                                }
                            }
                            clip_slice(gn);
                            acts[1].apply_slice(gn);
                            for j in 0..hsz {
                                hb[j] = (1.0 - gz[j]) * gn[j] + gz[j] * hb[j];
                            }
                        }
                        CellKind::Lstm { input_forget } => {
                            // Gate by gate over whole slices, so the activations run vectorized.
                            // Every slice cut to exactly `hsz` values: the loops below have
                            // no bounds checks and vectorize.
                            let (pi, po, pf) =
                                (&pd[..hsz], &pd[hsz..2 * hsz], &pd[2 * hsz..][..hsz]);
                            let (gi, rest) = gates.split_at_mut(hsz);
                            let (go, rest) = rest.split_at_mut(hsz);
                            let (gf, gc) = rest.split_at_mut(hsz);
                            let gc = &mut gc[..hsz];
                            let cb = &mut cb[..hsz];
                            let part = |g: usize| (&xr[g * hsz..][..hsz], &hrr[g * hsz..][..hsz]);
                            let ((xi, hi), (xo, ho)) = (part(0), part(1));
                            let ((xf, hf), (xc, hc)) = (part(2), part(3));
                            for j in 0..hsz {
                                let cp = cb[j];
                                gi[j] = xi[j] + hi[j] + pi[j] * cp;
                                gf[j] = xf[j] + hf[j] + pf[j] * cp;
                                gc[j] = xc[j] + hc[j];
                            }
                            clip_slice(gi);
                            clip_slice(gf);
                            clip_slice(gc);
                            acts[0].apply_slice(gi);
                            if !input_forget {
                                acts[0].apply_slice(gf);
                            }
                            acts[1].apply_slice(gc);
                            for j in 0..hsz {
                                let f = if input_forget { 1.0 - gi[j] } else { gf[j] };
                                let cn = f * cb[j] + gi[j] * gc[j];
                                cb[j] = cn;
                                go[j] = xo[j] + ho[j] + po[j] * cn;
                            }
                            clip_slice(go);
                            acts[0].apply_slice(go);
                            hb.copy_from_slice(cb);
                            acts[2].apply_slice(hb);
                            for (hv, &o) in hb.iter_mut().zip(go.iter()) {
                                *hv *= o;
                            }
                        }
                    }
                    let yi = (t * batch + b) * hsz;
                    ydir[yi..yi + hsz].copy_from_slice(hb);
                }
            }
            crate::buffers::release(xw);
            Ok(DirOut { y: ydir, h, c })
        }
    }
}

/// One direction of a layer as a [`fmap::LevelBody`].
struct DirectionRun<'l, 'a> {
    layer: &'l Layer<'a>,
    d: usize,
    threads: usize,
}

impl fmap::LevelBody for DirectionRun<'_, '_> {
    type Output = Result<DirOut>;
    #[inline(always)]
    fn run(self) -> Result<DirOut> {
        self.layer.run_direction_body(self.d, self.threads)
    }
}

/// Any float tensor as f32 (copied only when it is not f32 already).
fn f32_data(t: &Tensor) -> Result<std::borrow::Cow<'_, [f32]>> {
    Ok(match t.dtype() {
        DType::F32 => std::borrow::Cow::Borrowed(t.as_slice::<f32>()?),
        DType::F16 | DType::BF16 | DType::F64 => {
            std::borrow::Cow::Owned(t.to_f64_vec()?.into_iter().map(|v| v as f32).collect())
        }
        other => bail!("expected a float tensor, got {other}"),
    })
}

/// Builds an output of `dtype` from f32 values.
fn out_tensor(dtype: DType, shape: Vec<usize>, v: Vec<f32>) -> Result<Tensor> {
    Ok(match dtype {
        DType::F32 => Tensor::from_vec(shape, v)?,
        DType::F64 => Tensor::from_vec(shape, v.into_iter().map(|x| x as f64).collect())?,
        DType::F16 => Tensor::from_vec(shape, v.into_iter().map(f16::from_f32).collect())?,
        DType::BF16 => Tensor::from_vec(shape, v.into_iter().map(bf16::from_f32).collect())?,
        other => bail!("unsupported output type {other}"),
    })
}

/// Number of directions from the `direction` attribute, and whether it is reverse-only.
fn directions(node: &Node) -> Result<(usize, bool)> {
    Ok(match node.str_or("direction", "forward")? {
        "forward" => (1, false),
        "reverse" => (1, true),
        "bidirectional" => (2, false),
        other => bail!("unknown direction '{other}'"),
    })
}

fn expect_shape(t: &Tensor, want: &[usize], what: &str) -> Result<()> {
    if t.shape() != want {
        bail!("{what} has shape {:?}, expected {want:?}", t.shape());
    }
    Ok(())
}

/// The inputs common to all recurrent ops, with owned f32 copies where needed.
struct Prepared<'a> {
    x: std::borrow::Cow<'a, [f32]>,
    b: Vec<f32>,
    p: Vec<f32>,
    lens: Vec<usize>,
    h0: Option<std::borrow::Cow<'a, [f32]>>,
    c0: Option<std::borrow::Cow<'a, [f32]>>,
    seq: usize,
    batch: usize,
    input: usize,
    layout: usize,
}

/// Validates X, B, sequence_lens, initial_h, initial_c and P (at the given input indices).
#[allow(clippy::too_many_arguments)]
fn prepare<'a>(
    ins: &'a Inputs,
    node: &Node,
    kind: CellKind,
    hidden: usize,
    dirs: usize,
    layout: usize,
    idx_c0: Option<usize>,
    idx_p: Option<usize>,
) -> Result<Prepared<'a>> {
    if hidden == 0 {
        bail!("hidden size is 0 (from R's shape and the hidden_size attribute): a recurrent op needs at least one hidden unit");
    }
    let x = ins.tensor(0)?;
    if x.rank() != 3 {
        bail!("X must be rank 3, got shape {:?}", x.shape());
    }
    let (seq, batch) = if layout == 0 {
        (x.shape()[0], x.shape()[1])
    } else {
        (x.shape()[1], x.shape()[0])
    };
    let input = x.shape()[2];
    let gh = kind.gates() * hidden;
    let b = match ins.opt_tensor(3) {
        Some(t) => {
            expect_shape(t, &[dirs, 2 * gh], "B")?;
            f32_data(t)?.into_owned()
        }
        None => vec![0.0; dirs * 2 * gh],
    };
    let lens = match ins.opt_tensor(4) {
        Some(t) => {
            let v = t.to_i64_vec()?;
            if v.len() != batch || v.iter().any(|&l| l < 0 || l as usize > seq) {
                bail!("sequence_lens {v:?} must hold {batch} lengths in 0..={seq}");
            }
            v.into_iter().map(|l| l as usize).collect()
        }
        None => vec![seq; batch],
    };
    let state_shape = if layout == 0 {
        [dirs, batch, hidden]
    } else {
        [batch, dirs, hidden]
    };
    let h0 = match ins.opt_tensor(5) {
        Some(t) => {
            expect_shape(t, &state_shape, "initial_h")?;
            Some(f32_data(t)?)
        }
        None => None,
    };
    let c0 = match idx_c0.and_then(|i| ins.opt_tensor(i)) {
        Some(t) => {
            expect_shape(t, &state_shape, "initial_c")?;
            Some(f32_data(t)?)
        }
        None => None,
    };
    let p = match idx_p.and_then(|i| ins.opt_tensor(i)) {
        Some(t) => {
            expect_shape(t, &[dirs, 3 * hidden], "P")?;
            f32_data(t)?.into_owned()
        }
        None => vec![0.0; dirs * 3 * hidden],
    };
    if let Some(hs) = node.attr_int("hidden_size")? {
        if hs as usize != hidden {
            bail!("hidden_size {hs} does not match R's hidden size {hidden}");
        }
    }
    Ok(Prepared {
        x: f32_data(x)?,
        b,
        p,
        lens,
        h0,
        c0,
        seq,
        batch,
        input,
        layout,
    })
}

/// Runs a float RNN/GRU/LSTM node and packages its outputs.
fn run_float(ctx: &OpCtx, ins: Inputs, kind: CellKind) -> Result<Vec<Value>> {
    let node = ctx.node;
    let (dirs, reverse_only) = directions(node)?;
    let layout = match node.int_or("layout", 0)? {
        0 => 0,
        1 => 1,
        other => bail!("layout must be 0 or 1, got {other}"),
    };
    let w_t = ins.tensor(1)?;
    let r_t = ins.tensor(2)?;
    if r_t.rank() != 3 || r_t.shape()[0] != dirs {
        bail!(
            "R must be [{dirs}, gates*hidden, hidden], got {:?}",
            r_t.shape()
        );
    }
    let hidden = r_t.shape()[2];
    let g = kind.gates();
    expect_shape(r_t, &[dirs, g * hidden, hidden], "R")?;
    let is_lstm = matches!(kind, CellKind::Lstm { .. });
    let p = prepare(
        &ins,
        node,
        kind,
        hidden,
        dirs,
        layout,
        is_lstm.then_some(6),
        is_lstm.then_some(7),
    )?;
    expect_shape(w_t, &[dirs, g * hidden, p.input], "W")?;
    let w = f32_data(w_t)?;
    let r = f32_data(r_t)?;
    let (wsz, rsz) = (g * hidden * p.input, g * hidden * hidden);
    // Constant W and R run on sgemm's panels, packed on the first run: the input projection
    // covers every timestep at once, and a batch-1 step's `h · Rᵀ` streams R's panels with
    // no horizontal sums. (GRU without linear_before_reset uses R's rows in two parts.)
    let (input, gh) = (p.input, g * hidden);
    let pack_r = !matches!(
        kind,
        CellKind::Gru {
            linear_before_reset: false
        }
    );
    let packed = if ctx.input_is_const(1)
        && ctx.input_is_const(2)
        && ctx.prepack_weights()
        && sgemm::available(Isa::detect())
    {
        let pk = ctx.cached(|| {
            // W (R) is [gh, k] row-major per direction: Wᵀ is the k x gh view (1, k).
            let pack = |m: &[f32], size: usize, k: usize| {
                (0..dirs)
                    .map(|d| {
                        let data = &m[d * size..(d + 1) * size];
                        sgemm::PackedB::new(k, gh, View { data, rs: 1, cs: k })
                    })
                    .collect::<Result<Vec<_>>>()
            };
            let r = if pack_r {
                pack(&r, rsz, hidden)?
            } else {
                Vec::new()
            };
            Ok((pack(&w, wsz, input)?, r))
        })?;
        let shaped = |v: &[sgemm::PackedB], k: usize| {
            v.len() == dirs && v.iter().all(|b| b.k() == k && b.n() == gh)
        };
        if !shaped(&pk.0, input) || (pack_r && !shaped(&pk.1, hidden)) {
            bail!("recurrent weights packed for another shape than {dirs}x{gh}x{input}");
        }
        Some(pk)
    } else {
        None
    };
    let layer = Layer {
        kind,
        seq: p.seq,
        batch: p.batch,
        input: p.input,
        hidden,
        dirs,
        reverse_only,
        layout: p.layout,
        x: &p.x,
        w: (0..dirs)
            .map(|d| match &packed {
                Some(pk) => Proj::Packed(&pk.0[d]),
                None => Proj::Float(&w[d * wsz..(d + 1) * wsz]),
            })
            .collect(),
        r: (0..dirs)
            .map(|d| match &packed {
                Some(pk) if pack_r => Proj::Packed(&pk.1[d]),
                _ => Proj::Float(&r[d * rsz..(d + 1) * rsz]),
            })
            .collect(),
        b: p.b.clone(),
        p: p.p.clone(),
        lens: p.lens.clone(),
        h0: p.h0.as_deref(),
        c0: p.c0.as_deref(),
        acts: parse_activations(node, kind.default_acts(), dirs)?,
        clip: node.attr_float("clip")?,
        threads: ctx.threads,
    };
    finish(&layer, ins.tensor(0)?.dtype(), is_lstm)
}

/// Packages Y, Y_h (and Y_c for LSTM) in the layer's layout and the input's dtype.
fn finish(layer: &Layer, dtype: DType, with_c: bool) -> Result<Vec<Value>> {
    let out = layer.run()?;
    let (seq, batch, dirs, h) = (layer.seq, layer.batch, layer.dirs, layer.hidden);
    let (y_shape, s_shape) = if layer.layout == 0 {
        (vec![seq, dirs, batch, h], vec![dirs, batch, h])
    } else {
        (vec![batch, seq, dirs, h], vec![batch, dirs, h])
    };
    let mut res = vec![
        Value::tensor(out_tensor(dtype, y_shape, out.y)?),
        Value::tensor(out_tensor(dtype, s_shape.clone(), out.y_h)?),
    ];
    if with_c {
        res.push(Value::tensor(out_tensor(dtype, s_shape, out.y_c)?));
    }
    Ok(res)
}

/// RNN (opsets 1..): `H = f(X·Wᵀ + H·Rᵀ + Wb + Rb)`.
fn rnn_op(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    run_float(ctx, ins, CellKind::Rnn)
}

/// GRU (opsets 1..): update/reset/hidden gates (z, r, h) with `linear_before_reset`.
fn gru_op(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let lbr = ctx.node.int_or("linear_before_reset", 0)? != 0;
    run_float(
        ctx,
        ins,
        CellKind::Gru {
            linear_before_reset: lbr,
        },
    )
}

/// LSTM (opsets 1..): gates i, o, f, c with optional peepholes and coupled input/forget gate.
fn lstm_op(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let input_forget = ctx.node.int_or("input_forget", 0)? != 0;
    run_float(ctx, ins, CellKind::Lstm { input_forget })
}

/// Converts direction `d` of `[dirs, k, n]` int8/uint8 weights with per-direction (`[dirs]`)
/// or per-column (`[dirs, n]`) scales and zero points: the zero-point-corrected values, packed
/// as i8 panels when `narrow` is asked and they all fit i8, as i16 panels otherwise, and one
/// scale per column.
fn quant_weights(
    w: &Tensor,
    scale: &Tensor,
    zp: &Tensor,
    d: usize,
    k: usize,
    n: usize,
    narrow: bool,
) -> Result<(QWeights, Vec<f32>)> {
    if !matches!(w.dtype(), DType::I8 | DType::U8) || zp.dtype() != w.dtype() {
        bail!(
            "quantized weights and zero points must be int8 or uint8 of one type, got {} and {}",
            w.dtype(),
            zp.dtype()
        );
    }
    let dirs = w.shape()[0];
    let per_col = if scale.shape() == [dirs] {
        false
    } else if scale.shape() == [dirs, n] {
        true
    } else {
        bail!(
            "scale shape {:?} must be [{dirs}] or [{dirs}, {n}]",
            scale.shape()
        );
    };
    if zp.shape() != scale.shape() {
        bail!(
            "zero point shape {:?} differs from scale shape {:?}",
            zp.shape(),
            scale.shape()
        );
    }
    let sv = f32_data(scale)?;
    let zv = zp.to_i64_vec()?;
    let (s, z): (Vec<f32>, Vec<i64>) = if per_col {
        (
            sv[d * n..(d + 1) * n].to_vec(),
            zv[d * n..(d + 1) * n].to_vec(),
        )
    } else {
        (vec![sv[d]; n], vec![zv[d]; n])
    };
    // Direction d's values minus their column's zero point (8-bit minus 8-bit: within
    // [-255, 255], exact in i16), read straight from the 8-bit data: converting the whole
    // tensor to i64 once per direction and matrix was a tenth of a model's first run.
    let range = d * k * n..(d + 1) * k * n;
    let raw: Vec<i16> = match w.dtype() {
        DType::I8 => w.as_slice::<i8>()?[range]
            .iter()
            .map(|&v| v as i16)
            .collect(),
        _ => w.as_slice::<u8>()?[range]
            .iter()
            .map(|&v| v as i16)
            .collect(),
    };
    let z16: Vec<i16> = z.iter().map(|&v| v as i16).collect();
    let wd: Vec<i16> = raw
        .chunks_exact(n.max(1))
        .flat_map(|row| row.iter().zip(&z16).map(|(&v, &zp)| v - zp))
        .collect();
    let q = |p: usize, j: usize| wd[p * n + j];
    let fits_i8 = wd.iter().all(|&v| i8::try_from(v).is_ok());
    let packed = if narrow && fits_i8 {
        QWeights::Narrow(PackedI8::pack(k, n, |p, j| q(p, j) as i8))
    } else {
        QWeights::Wide(PackedB::pack(k, n, q))
    };
    Ok((packed, s))
}

/// One direction's DynamicQuantizeLSTM weights, converted once: W (input projection, many
/// rows per product) and R (recurrent, one row per product), each with its column scales.
struct DqLstmWeights {
    w: (QWeights, Vec<f32>),
    r: (QWeights, Vec<f32>),
}

/// com.microsoft::DynamicQuantizeLSTM: an LSTM whose W (`[dirs, input, 4*hidden]`) and R
/// (`[dirs, hidden, 4*hidden]`) are int8/uint8 with per-direction or per-column scales and zero
/// points. X and H are quantized to u8 on the fly for the integer GEMMs, as onnxruntime does.
fn dq_lstm_op(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let node = ctx.node;
    let (dirs, reverse_only) = directions(node)?;
    let w_t = ins.tensor(1)?;
    let r_t = ins.tensor(2)?;
    if r_t.rank() != 3 || r_t.shape()[0] != dirs || r_t.shape()[2] % 4 != 0 {
        bail!(
            "R must be [{dirs}, hidden, 4*hidden], got {:?}",
            r_t.shape()
        );
    }
    let hidden = r_t.shape()[1];
    expect_shape(r_t, &[dirs, hidden, 4 * hidden], "R")?;
    let input_forget = node.int_or("input_forget", 0)? != 0;
    let kind = CellKind::Lstm { input_forget };
    let p = prepare(&ins, node, kind, hidden, dirs, 0, Some(6), Some(7))?;
    expect_shape(w_t, &[dirs, p.input, 4 * hidden], "W")?;
    let (ws, wz, rs, rz) = (
        ins.tensor(8)?,
        ins.tensor(9)?,
        ins.tensor(10)?,
        ins.tensor(11)?,
    );
    let gh = 4 * hidden;
    let convert = || {
        (0..dirs)
            .map(|d| {
                Ok(DqLstmWeights {
                    w: quant_weights(w_t, ws, wz, d, p.input, gh, false)?,
                    r: quant_weights(r_t, rs, rz, d, hidden, gh, true)?,
                })
            })
            .collect::<Result<Vec<_>>>()
    };
    // Constant weights (the usual case) are converted and packed on the first run only.
    let weights = if [1, 2, 8, 9, 10, 11].iter().all(|&i| ctx.input_is_const(i)) {
        ctx.cached(convert)?
    } else {
        std::sync::Arc::new(convert()?)
    };
    fn proj((w, scale): &(QWeights, Vec<f32>), per_row: bool) -> Proj<'_> {
        Proj::Quant { w, scale, per_row }
    }
    let w = weights.iter().map(|dw| proj(&dw.w, false)).collect();
    let r = weights.iter().map(|dw| proj(&dw.r, true)).collect();
    let layer = Layer {
        kind,
        seq: p.seq,
        batch: p.batch,
        input: p.input,
        hidden,
        dirs,
        reverse_only,
        layout: 0,
        x: &p.x,
        w,
        r,
        b: p.b.clone(),
        p: p.p.clone(),
        lens: p.lens.clone(),
        h0: p.h0.as_deref(),
        c0: p.c0.as_deref(),
        acts: parse_activations(node, kind.default_acts(), dirs)?,
        clip: node.attr_float("clip")?,
        threads: ctx.threads,
    };
    let dtype = ins.tensor(0)?.dtype();
    if dtype != DType::F32 {
        return Err(RtError::msg(format!(
            "DynamicQuantizeLSTM expects f32 X, got {dtype}"
        )));
    }
    finish(&layer, dtype, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 1-unit RNN layer with identity activation (Affine 1, 0) so outputs are hand-computable.
    fn linear_rnn<'a>(x: &'a [f32], w: &'a [f32], r: &'a [f32], lens: Vec<usize>) -> Layer<'a> {
        Layer {
            kind: CellKind::Rnn,
            seq: 3,
            batch: 2,
            input: 1,
            hidden: 1,
            dirs: 2,
            reverse_only: false,
            layout: 0,
            x,
            w: vec![Proj::Float(&w[..1]), Proj::Float(&w[1..])],
            r: vec![Proj::Float(&r[..1]), Proj::Float(&r[1..])],
            // Wb = 0.1, Rb = 0 for both directions.
            b: vec![0.1, 0.0, 0.1, 0.0],
            p: vec![0.0; 6],
            lens,
            h0: None,
            c0: None,
            acts: vec![Act::Affine(1.0, 0.0); 2],
            clip: None,
            threads: 1,
        }
    }

    #[test]
    fn bidirectional_rnn_with_sequence_lens() {
        // X[t, b]: row 0 = 1, 2, 3; row 1 = 10, 20, (30 beyond its length 2).
        let x = [1.0, 10.0, 2.0, 20.0, 3.0, 30.0];
        let (w, r) = ([0.5, 0.5], [1.0, 1.0]);
        let out = linear_rnn(&x, &w, &r, vec![3, 2]).run().unwrap();
        let y = |t: usize, d: usize, b: usize| out.y[(t * 2 + d) * 2 + b];
        let close = |a: f32, b: f32| (a - b).abs() < 1e-5;
        // Forward: h = 0.5 x + 0.1 + h_prev.
        assert!(close(y(0, 0, 0), 0.6) && close(y(1, 0, 0), 1.7) && close(y(2, 0, 0), 3.3));
        assert!(close(y(0, 0, 1), 5.1) && close(y(1, 0, 1), 15.2) && y(2, 0, 1) == 0.0);
        // Reverse starts at each row's last valid step.
        assert!(close(y(2, 1, 0), 1.6) && close(y(1, 1, 0), 2.7) && close(y(0, 1, 0), 3.3));
        assert!(close(y(1, 1, 1), 10.1) && close(y(0, 1, 1), 15.2) && y(2, 1, 1) == 0.0);
        // Y_h [dirs, batch, 1]: last valid step of each direction.
        assert!(close(out.y_h[0], 3.3) && close(out.y_h[1], 15.2));
        assert!(close(out.y_h[2], 3.3) && close(out.y_h[3], 15.2));
    }

    #[test]
    fn activation_params_are_consumed_in_order() {
        let mut n = Node::new("RNN", &[], &[]);
        n = n
            .with_attr(
                "activations",
                npuc_ir::Attr::Strings(vec!["LeakyRelu".into(), "HardSigmoid".into()]),
            )
            .with_attr("activation_alpha", npuc_ir::Attr::Floats(vec![0.1, 0.3]))
            .with_attr("activation_beta", npuc_ir::Attr::Floats(vec![0.7]));
        let acts = parse_activations(&n, &["Tanh"], 2).unwrap();
        assert_eq!(acts, vec![Act::LeakyRelu(0.1), Act::HardSigmoid(0.3, 0.7)]);
    }

    #[test]
    fn quantized_projection_tracks_float() {
        // W (float) = Wq * 0.01 with Wq [k=3, n=2] in the DynamicQuantizeLSTM layout.
        let wq: Vec<i16> = vec![10, -20, 30, 40, -50, 60];
        let narrow = QWeights::Narrow(PackedI8::pack(3, 2, |p, j| wq[p * 2 + j] as i8));
        let wide = QWeights::Wide(PackedB::pack(3, 2, |p, j| wq[p * 2 + j]));
        let scale = [0.01, 0.01];
        let a = [0.3f32, -0.7, 1.1, 0.05, 0.4, -0.2];
        let mut first = None;
        for w in [&narrow, &wide] {
            for per_row in [false, true] {
                let proj = Proj::Quant {
                    w,
                    scale: &scale,
                    per_row,
                };
                let mut got = vec![0f32; 4];
                proj.apply(2, 2, 3, &a, &mut got, 1, &mut QScratch::default())
                    .unwrap();
                for i in 0..2 {
                    for j in 0..2 {
                        let want: f32 = (0..3)
                            .map(|p| a[i * 3 + p] * wq[p * 2 + j] as f32 * 0.01)
                            .sum();
                        assert!((got[i * 2 + j] - want).abs() < 0.01, "{got:?}");
                    }
                }
                // Both weight layouts run the same integer sums (exact: with |w| <= 60 no pair
                // sum of the AVX2 saturating step reaches i16's ends, 2 * 255 * 60 < 32768).
                if !per_row {
                    let f = first.get_or_insert_with(|| got.clone());
                    assert_eq!(*f, got);
                }
            }
        }
    }
}
