//! Preparing quantized (ONNX QDQ) models for execution: by default the quantized matrix
//! products run as integer kernels (`npuc.QMatMul`, lowered by `npuc_passes::quant_lower`);
//! `simulate` keeps the QDQ graph as written, so every quantized tensor is quantized and
//! dequantized around float ops (QuantSim).

use anyhow::{Context, Result};
use npuc_ir::Model;

/// What [`prepare`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prepared {
    /// The model held QuantizeLinear/DequantizeLinear nodes.
    pub quantized: bool,
    /// Products rewritten to integer ops (0 in simulate mode).
    pub lowered: usize,
}

/// Lowers the quantized products of a QDQ model to integer ops unless `simulate`; a model
/// without Q/DQ nodes is left untouched. Lowering happens at load time: artifacts and exports
/// keep the QDQ graph.
pub fn prepare(model: &mut Model, simulate: bool) -> Result<Prepared> {
    let quantized = npuc_passes::quant_lower::has_qdq(model);
    if !quantized || simulate {
        return Ok(Prepared {
            quantized,
            lowered: 0,
        });
    }
    let lowered = npuc_passes::lower_quantized(model)
        .context("lowering the quantized graph to integer kernels")?;
    Ok(Prepared { quantized, lowered })
}
