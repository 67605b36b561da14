//! `cargo xtask synth-model OUT.onnx --megabytes N`: writes a synthetic f32 MLP (a chain of
//! MatMul+Relu over 1024x1024 weights) with about N MB of weights in external data, for
//! load-time scaling benchmarks next to real models.

use anyhow::{anyhow, bail, Result};
use npuc_ir::{Dim, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo};
use std::path::PathBuf;

pub fn main(args: &[String]) -> Result<()> {
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
            s if out.is_none() => out = Some(PathBuf::from(s)),
            other => bail!("unexpected argument '{other}'"),
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
