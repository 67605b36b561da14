//! `cargo xtask synth-model OUT.onnx --megabytes N`: writes a synthetic f32 MLP (a chain of
//! MatMul+Relu over 1024x1024 weights) with about N MB of weights in external data, for
//! load-time scaling benchmarks next to real models.
//!
//! `cargo xtask synth-model vit-h -o DIR [--layers N]`: writes `DIR/vit_h_synthetic.onnx` (+
//! `.data`), a SYNTHETIC ViT-H/14-shaped encoder with deterministic random weights (2.53 GB
//! of f32 weights at the full 32 layers: over the 2 GiB protobuf limit), see
//! `npuc_driver::synth`.

use anyhow::{anyhow, bail, Result};
use npuc_ir::{Dim, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo};
use std::path::PathBuf;

pub fn main(args: &[String]) -> Result<()> {
    if args.first().map(String::as_str) == Some("vit-h") {
        return vit_h(&args[1..]);
    }
    let mut out = None;
    let mut mb = 380usize;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--megabytes" => {
                mb = it
                    .next()
                    .ok_or_else(|| anyhow!("--megabytes needs N"))?
                    .parse()?
            }
            // An option-looking word is never an output path (`--help` would become a file).
            s if out.is_none() && !s.starts_with('-') => out = Some(PathBuf::from(s)),
            other => bail!(
                "unexpected argument '{other}'; usage: cargo xtask synth-model OUT.onnx [--megabytes N] | vit-h -o DIR [--layers N]"
            ),
        }
    }
    let out =
        out.ok_or_else(|| anyhow!("usage: cargo xtask synth-model OUT.onnx [--megabytes N]"))?;
    let d = 1024usize;
    let layers = (mb * 1_000_000 / (d * d * 4)).max(1);
    let mut nodes = vec![];
    let mut inits = vec![];
    let mut x = "x".to_string();
    for l in 0..layers {
        // Small deterministic values so activations stay finite.
        let w: Vec<f32> = (0..d * d)
            .map(|i| (((i * 7 + l * 13) % 97) as f32 - 48.0) * 1e-4)
            .collect();
        inits.push(Initializer {
            name: format!("w{l}"),
            tensor: Tensor::from_vec(vec![d, d], w)?,
        });
        let y = format!("h{l}");
        nodes.push(Node::new(
            "MatMul",
            &[&x, &format!("w{l}")],
            &[&format!("{y}_mm")],
        ));
        nodes.push(Node::new("Relu", &[&format!("{y}_mm")], &[&y]));
        x = y;
    }
    let m = Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: 17,
        }],
        producer_name: "npuc-xtask-synth".into(),
        graph: Graph {
            name: "synth_mlp".into(),
            nodes,
            inputs: vec![ValueInfo::new(
                "x",
                Some(TypeInfo::Tensor {
                    dtype: Some(npuc_ir::DType::F32),
                    shape: Some(vec![Dim::Fixed(1), Dim::Fixed(d)]),
                }),
            )],
            outputs: vec![ValueInfo::new(x, None)],
            initializers: inits,
            ..Default::default()
        },
        ..Default::default()
    };
    npuc_onnx::save_model(
        &m,
        &out,
        &npuc_onnx::ExportOptions {
            external_threshold: Some(1024),
        },
    )?;
    println!(
        "wrote {} ({layers} layers, {:.0} MB of weights)",
        out.display(),
        (layers * d * d * 4) as f64 / 1e6
    );
    Ok(())
}

fn vit_h(args: &[String]) -> Result<()> {
    let usage = "usage: cargo xtask synth-model vit-h -o DIR [--layers N]";
    let mut dir = None;
    let mut shape = npuc_driver::synth::VitShape::VIT_H;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-o" => dir = Some(PathBuf::from(it.next().ok_or_else(|| anyhow!("{usage}"))?)),
            "--layers" => {
                shape.layers = it
                    .next()
                    .ok_or_else(|| anyhow!("--layers needs N"))?
                    .parse()?
            }
            other => bail!("unexpected argument '{other}'; {usage}"),
        }
    }
    let dir = dir.ok_or_else(|| anyhow!("{usage}"))?;
    std::fs::create_dir_all(&dir)?;
    let out = dir.join("vit_h_synthetic.onnx");
    let t0 = std::time::Instant::now();
    let bytes = npuc_driver::synth::write_vit(shape, &out)?;
    println!(
        "wrote {} (SYNTHETIC ViT-H-shaped encoder, deterministic random weights: {} layers, {:.0} MB of f32 weights in {}.data) in {:.1} s",
        out.display(),
        shape.layers,
        bytes as f64 / 1e6,
        out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
