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
    prepare_with(model, simulate, npuc_passes::lower_quantized)
}

/// [`prepare`] keeping every layer's output tensor (no lookup-table regions), for `npuc verify`.
pub fn prepare_keep_layers(model: &mut Model, simulate: bool) -> Result<Prepared> {
    prepare_with(
        model,
        simulate,
        npuc_passes::quant_lower::lower_quantized_keep_layers,
    )
}

fn prepare_with(
    model: &mut Model,
    simulate: bool,
    lower: fn(&mut Model) -> std::result::Result<usize, npuc_passes::PassError>,
) -> Result<Prepared> {
    let quantized = npuc_passes::quant_lower::has_qdq(model);
    if !quantized || simulate {
        return Ok(Prepared {
            quantized,
            lowered: 0,
        });
    }
    let lowered = lower(model).context("lowering the quantized graph to integer kernels")?;
    cleanup(model).context("simplifying the lowered quantized graph")?;
    Ok(Prepared { quantized, lowered })
}

/// Runs the value-preserving part of the optimizer on a lowered graph: constant folding (the
/// shape arithmetic of exported graphs, and the DequantizeLinear of constant weights that stay
/// in float, e.g. Conv/ConvTranspose, so they dequantize once instead of every run), identity
/// and layout folding, CSE and dead-code removal, and LayerNorm fusion: a LayerNorm the
/// quantizer left in float (no Q/DQ inside it, as in ViTs) is one kernel instead of nine ops
/// (the same mean and biased variance; results differ from the decomposed form by float
/// rounding only). The other float fusions stay off: Q/DQ pairs sit between their ops and the
/// lowered graph must compute what the QDQ graph does.
fn cleanup(model: &mut Model) -> Result<()> {
    use npuc_passes::passes::{const_fold, cse, dce, identity, norm_fusion, reshape};
    let mut pm = npuc_passes::PassManager::new(8);
    // Folded float weights are 4x their 8-bit source: allow them (a ViT decoder's are ~1 MB
    // each); shape arithmetic is tiny.
    pm.add(Box::new(const_fold::ConstFold {
        max_bytes: 64 << 20,
        keep_dequantize: false,
    }));
    pm.add(Box::new(identity::IdentityElim));
    pm.add(Box::new(reshape::ReshapeFold));
    pm.add(Box::new(cse::Cse));
    pm.add(Box::new(dce::Dce));
    pm.add(Box::new(norm_fusion::LayerNormFusion));
    pm.run(model)?;
    Ok(())
}
