//! npuc's post-training quantizer.
//!
//! The quantized model is an ordinary IR graph in ONNX QDQ form, onnxruntime style: every
//! quantized activation `T` becomes `producer -> T_prequant -> QuantizeLinear -> T_quantized ->
//! DequantizeLinear -> T` (consumers and graph outputs keep reading `T`), every quantized weight
//! `W` becomes an integer initializer `W_quantized -> DequantizeLinear -> W`, and biases become
//! int32 initializers with scale `s_x * s_w`. Running that graph as is = QuantSim (float math
//! with quantize-dequantize at every quantized tensor); the runtime's lowering pass may turn the
//! patterns into integer kernels.
//!
//! Flow: [`plan`] decides per node which scheme applies (overrides, `--keep-float`) and which
//! tensors need calibration; [`calibrate`] runs the float model over calibration samples with
//! those tensors exposed and feeds streaming [`observer::Observer`]s; [`encodings_from_ranges`]
//! turns ranges and weights into [`Encodings`] (scale/zero point per tensor); [`apply`] rewrites
//! the graph. Encodings can also be written/read as AIMET/QNN JSON ([`encodings`]) and the
//! result exported with onnxruntime QNN-EP conventions ([`export`]).
//!
//! First version: only Conv, ConvTranspose, Gemm and MatMul are quantized (their activation
//! inputs, outputs, weights and biases). Outputs of Add/Mul/Concat/pooling/Softmax/LayerNorm
//! stay float unless they feed or leave one of those ops.
#![forbid(unsafe_code)]

pub mod adaround;
pub mod calib;
pub mod encodings;
pub mod export;
pub mod gptq;
pub mod lpbq;
pub mod observer;
pub mod overrides;
pub mod qdq;
pub mod seqmse;
pub mod smooth;

pub use calib::{CalibSource, ImagePreprocess};
pub use encodings::{EncodingsVersion, TensorEncoding};
pub use observer::CalibMethod;
pub use overrides::Overrides;
pub use qdq::{apply, calibrate, encodings_from_ranges, plan, Encodings, QuantPlan};
pub use seqmse::SeqMseReport;
pub use smooth::{LinearStats, SmoothOptions, SmoothReport};

use anyhow::{bail, Result};
use npuc_ir::DType;

/// A quantization scheme: weight and activation precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// int8 weights, 8-bit activations.
    W8A8,
    /// int8 weights, 16-bit activations.
    W8A16,
    /// int4 weights, 16-bit activations.
    W4A16,
    /// int4 weights, 8-bit activations.
    W4A8,
    /// int16 weights, 16-bit activations.
    W16A16,
    /// Weights and activations rounded through IEEE half precision (Cast pairs).
    Fp16,
    /// Weights and activations rounded through bfloat16 (Cast pairs).
    Bf16,
    /// int8 weights only; activations stay float.
    W8,
    /// int4 weights only; activations stay float.
    W4,
    /// Not quantized.
    Float,
}

impl Scheme {
    /// Every scheme name accepted by `--quantize` and override files.
    pub const NAMES: &'static [&'static str] = &[
        "w8a8", "w8a16", "w4a16", "w4a8", "w16a16", "fp16", "bf16", "w8", "w4", "float",
    ];

    /// Parses a scheme name (case-insensitive).
    pub fn parse(s: &str) -> Result<Scheme> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "w8a8" => Scheme::W8A8,
            "w8a16" => Scheme::W8A16,
            "w4a16" => Scheme::W4A16,
            "w4a8" => Scheme::W4A8,
            "w16a16" => Scheme::W16A16,
            "fp16" => Scheme::Fp16,
            "bf16" => Scheme::Bf16,
            "w8" => Scheme::W8,
            "w4" => Scheme::W4,
            "float" | "fp32" => Scheme::Float,
            _ => bail!(
                "unknown quantization scheme '{s}'; expected one of: {}",
                Scheme::NAMES.join(", ")
            ),
        })
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Scheme::W8A8 => "w8a8",
            Scheme::W8A16 => "w8a16",
            Scheme::W4A16 => "w4a16",
            Scheme::W4A8 => "w4a8",
            Scheme::W16A16 => "w16a16",
            Scheme::Fp16 => "fp16",
            Scheme::Bf16 => "bf16",
            Scheme::W8 => "w8",
            Scheme::W4 => "w4",
            Scheme::Float => "float",
        }
    }

    /// Integer weight type (always symmetric), if weights are integer-quantized.
    pub fn weight_dtype(self) -> Option<DType> {
        match self {
            Scheme::W8A8 | Scheme::W8A16 | Scheme::W8 => Some(DType::I8),
            Scheme::W4A16 | Scheme::W4A8 | Scheme::W4 => Some(DType::I4),
            Scheme::W16A16 => Some(DType::I16),
            _ => None,
        }
    }

    /// Integer activation type: unsigned asymmetric by default, signed symmetric when
    /// `symmetric` is set. `None` when activations stay float (or are cast, see [`Self::cast_dtype`]).
    pub fn act_dtype(self, symmetric: bool) -> Option<DType> {
        let bits16 = match self {
            Scheme::W8A8 | Scheme::W4A8 => false,
            Scheme::W8A16 | Scheme::W4A16 | Scheme::W16A16 => true,
            _ => return None,
        };
        Some(match (bits16, symmetric) {
            (false, false) => DType::U8,
            (false, true) => DType::I8,
            (true, false) => DType::U16,
            (true, true) => DType::I16,
        })
    }

    /// The reduced float type for the Cast-pair schemes.
    pub fn cast_dtype(self) -> Option<DType> {
        match self {
            Scheme::Fp16 => Some(DType::F16),
            Scheme::Bf16 => Some(DType::BF16),
            _ => None,
        }
    }
}

/// How weights share scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    /// One scale per weight tensor.
    PerTensor,
    /// One scale per output channel (Conv axis 0, ConvTranspose axis 1, MatMul `W[K,N]` axis 1,
    /// Gemm axis 0 with `transB=1`, else 1).
    PerChannel,
    /// One scale per row of the stored weight (axis 0), whatever the op.
    PerRow,
    /// One scale per block of `n` consecutive elements along the reduction (input) axis, per
    /// output channel (ONNX opset-21 `block_size`).
    PerBlock(usize),
    /// LPBQ on linear-layer (MatMul/Gemm, 2-D) weights: blocks of `block` input channels whose
    /// scales are `compressed_bw`-bit unsigned integers times one float scale per output
    /// channel ([`lpbq`]); other weights, and linear weights whose input channels `block` does
    /// not divide, are per-channel (the plan says which, [`QuantPlan::notes`]).
    Lpbq {
        /// Input channels per block.
        block: usize,
        /// Bits of each per-block integer scale.
        compressed_bw: u8,
    },
}

impl Granularity {
    /// Parses `per-tensor|per-channel|per-row|per-block|lpbq` (`block` used for per-block;
    /// LPBQ takes [`Granularity::lpbq`]).
    pub fn parse(s: &str, block: usize) -> Result<Granularity> {
        Ok(match s {
            "per-tensor" => Granularity::PerTensor,
            "per-channel" => Granularity::PerChannel,
            "per-row" => Granularity::PerRow,
            "per-block" => {
                if block == 0 {
                    bail!("--block-size must be at least 1");
                }
                Granularity::PerBlock(block)
            }
            "lpbq" => Granularity::lpbq(block, 4)?,
            _ => bail!(
                "unknown granularity '{s}'; expected per-tensor, per-channel, per-row, per-block or lpbq"
            ),
        })
    }

    /// LPBQ with `block` input channels per block and `compressed_bw`-bit block scales.
    pub fn lpbq(block: usize, compressed_bw: u8) -> Result<Granularity> {
        if block == 0 {
            bail!("--block-size must be at least 1");
        }
        if !(1..=15).contains(&compressed_bw) {
            bail!("--compressed-bw must be 1..=15 bits, got {compressed_bw}");
        }
        Ok(Granularity::Lpbq {
            block,
            compressed_bw,
        })
    }
}

/// The constraint set a quantization must satisfy: which encodings the runtime that will
/// execute the model can take. The quantizer honours it from the start (planning, smoothing,
/// calibration), so the same flags give the same artifact whether or not files are exported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Profile {
    /// npuc's own integer kernels: per-channel (or per-row/per-block) weights on every
    /// quantized op, signed or unsigned activations.
    #[default]
    Npuc,
    /// ONNX Runtime's QNN execution provider on a Hexagon HTP (the rules of its QDQ
    /// converter): weights symmetric, per-channel only on Conv/ConvTranspose (MatMul/Gemm per
    /// tensor), no blocked weights; activations unsigned asymmetric (u8/u16; a signed symmetric
    /// request becomes the same grid with the mid-range zero point); biases int32 at
    /// `s_x * s_w`.
    QnnHtp,
}

impl Profile {
    /// Every profile name accepted by `--quant-profile`.
    pub const NAMES: &'static [&'static str] = &["npuc", "qnn-htp"];

    /// Parses a profile name.
    pub fn parse(s: &str) -> Result<Profile> {
        Ok(match s {
            "npuc" | "" => Profile::Npuc,
            "qnn-htp" | "qnn" => Profile::QnnHtp,
            _ => bail!(
                "unknown quantization profile '{s}'; expected one of: {}",
                Profile::NAMES.join(", ")
            ),
        })
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Npuc => "npuc",
            Profile::QnnHtp => "qnn-htp",
        }
    }
}

/// Everything that decides how a model is quantized.
#[derive(Clone, Debug)]
pub struct QuantOptions {
    /// Default scheme for quantizable nodes.
    pub scheme: Scheme,
    /// Activation range estimation.
    pub method: CalibMethod,
    /// Weight granularity.
    pub granularity: Granularity,
    /// Signed symmetric activations (int8/int16, zero point 0) instead of unsigned asymmetric.
    pub symmetric_activations: bool,
    /// Mixed-precision rules (default scheme taken from here when it sets one).
    pub overrides: Option<Overrides>,
    /// Patterns of nodes/tensors to keep float (`--keep-float`).
    pub keep_float: Vec<String>,
    /// Threads for the calibration runs.
    pub threads: usize,
    /// The target's constraint set.
    pub profile: Profile,
}

impl Default for QuantOptions {
    fn default() -> Self {
        QuantOptions {
            scheme: Scheme::W8A8,
            method: CalibMethod::MinMax,
            granularity: Granularity::PerChannel,
            symmetric_activations: false,
            overrides: None,
            keep_float: vec![],
            threads: 1,
            profile: Profile::Npuc,
        }
    }
}

/// Inclusive integer range of a quantized dtype.
pub fn qrange(d: DType) -> (i64, i64) {
    match d {
        DType::U8 => (0, 255),
        DType::I8 => (-128, 127),
        DType::U16 => (0, 65535),
        DType::I16 => (-32768, 32767),
        DType::I4 => (-8, 7),
        DType::U4 => (0, 15),
        DType::I32 => (i32::MIN as i64, i32::MAX as i64),
        _ => (0, 0),
    }
}

/// Bit width of a quantized dtype.
pub fn bitwidth(d: DType) -> u32 {
    match d {
        DType::U8 | DType::I8 => 8,
        DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 16,
        DType::I4 | DType::U4 => 4,
        DType::I32 | DType::F32 => 32,
        _ => 0,
    }
}

/// Scale and zero point for an activation range `[lo, hi]` in dtype `d`. The range is widened
/// to contain 0 (so zero is exact, as ONNX requires of padding); symmetric types use zero point 0.
pub fn act_scale_zp(lo: f32, hi: f32, d: DType) -> (f32, i64) {
    let lo = lo.min(0.0);
    let hi = hi.max(0.0);
    let (qmin, qmax) = qrange(d);
    let signed = qmin < 0;
    if signed {
        // Symmetric: [-127, 127] style (one level unused) like onnxruntime.
        let amax = lo.abs().max(hi.abs());
        let s = amax / qmax as f32;
        (if s > 0.0 && s.is_finite() { s } else { 1.0 }, 0)
    } else {
        let s = (hi - lo) / (qmax - qmin) as f32;
        let s = if s > 0.0 && s.is_finite() { s } else { 1.0 };
        let zp = (qmin as f32 - lo / s).round_ties_even() as i64;
        (s, zp.clamp(qmin, qmax))
    }
}
