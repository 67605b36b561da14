//! Synthetic models for scale tests: real graph shapes with deterministic random weights (no
//! trained weights of these sizes ship in any package reachable here). Every model written
//! here says so in its producer name, graph name and doc string.
//!
//! - [`vit_h`]: a ViT-H/14-shaped image encoder (32 pre-LN blocks of width 1280, 16 heads of
//!   80, MLP 5120, 224x224 input in 14x14 patches plus a class token: 257 tokens; 632 M
//!   parameters, 2.53 GB of f32 weights, so over the 2 GiB protobuf limit), standard opset-17
//!   ops only, the layout of Hugging Face's `ViTModel` exports (separate q/k/v projections,
//!   exact GELU, `last_hidden_state` out).

use anyhow::{bail, Result};
use npuc_ir::{
    Attr, DType, Dim, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo,
};
use std::path::Path;

/// The hyper-parameters of a ViT-shaped encoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VitShape {
    pub layers: usize,
    pub width: usize,
    pub heads: usize,
    pub mlp: usize,
    pub image: usize,
    pub patch: usize,
}

impl VitShape {
    /// ViT-H/14 at 224x224 (Dosovitskiy et al.; timm's `vit_huge_patch14_224`).
    pub const VIT_H: VitShape = VitShape {
        layers: 32,
        width: 1280,
        heads: 16,
        mlp: 5120,
        image: 224,
        patch: 14,
    };

    /// Tokens: the patches plus the class token.
    pub fn tokens(&self) -> usize {
        (self.image / self.patch).pow(2) + 1
    }

    /// Parameter count (what [`vit`] writes).
    pub fn params(&self) -> usize {
        let (w, m, p) = (self.width, self.mlp, self.patch);
        let embed = w * 3 * p * p + w + w + self.tokens() * w;
        let block = 4 * (w * w + w) + (w * m + m) + (m * w + w) + 4 * w;
        embed + self.layers * block + 2 * w
    }
}

/// The input name (as the ViT-S fixture's, so its calibration images serve).
pub const VIT_INPUT: &str = "input_image";

/// A deterministic uniform generator (splitmix64): the same weights on every machine.
struct Rng(u64);

impl Rng {
    fn for_name(name: &str) -> Rng {
        // FNV-1a of the tensor's name: each tensor's values depend on its name only.
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        Rng(h)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

/// `n` values of standard deviation `std` around `mean` (uniform: bounded, so no outlier
/// makes an activation blow up).
fn values(name: &str, n: usize, mean: f32, std: f32) -> Vec<f32> {
    let mut r = Rng::for_name(name);
    // A uniform on [-a, a] has standard deviation a / sqrt(3).
    let a = std * 3f32.sqrt();
    (0..n).map(|_| mean + a * r.unit()).collect()
}

struct Builder {
    nodes: Vec<Node>,
    inits: Vec<Initializer>,
    n: usize,
}

impl Builder {
    fn weight(&mut self, name: &str, shape: Vec<usize>, mean: f32, std: f32) -> Result<String> {
        let n = shape.iter().product();
        self.inits.push(Initializer {
            name: name.into(),
            tensor: Tensor::from_vec(shape, values(name, n, mean, std))?,
        });
        Ok(name.into())
    }

    fn i64s(&mut self, name: &str, v: &[i64]) -> Result<String> {
        if !self.inits.iter().any(|i| i.name == name) {
            self.inits.push(Initializer {
                name: name.into(),
                tensor: Tensor::from_vec(vec![v.len()], v.to_vec())?,
            });
        }
        Ok(name.into())
    }

    fn scalar(&mut self, name: &str, v: f32) -> String {
        if !self.inits.iter().any(|i| i.name == name) {
            self.inits.push(Initializer {
                name: name.into(),
                tensor: Tensor::scalar(v),
            });
        }
        name.into()
    }

    fn op(&mut self, op: &str, ins: &[&str], attrs: Vec<(&str, Attr)>) -> String {
        self.n += 1;
        let out = format!("{}_{}", op.to_lowercase(), self.n);
        let mut nd = Node::new(op, ins, &[&out]);
        nd.name = format!("{op}_{}", self.n);
        for (k, v) in attrs {
            nd = nd.with_attr(k, v);
        }
        self.nodes.push(nd);
        out
    }

    /// `x @ W + b` with W `[k, n]` of standard deviation `1/sqrt(k)` (variance-preserving).
    fn linear(&mut self, x: &str, name: &str, k: usize, n: usize) -> Result<String> {
        let w = self.weight(
            &format!("{name}.weight"),
            vec![k, n],
            0.0,
            1.0 / (k as f32).sqrt(),
        )?;
        let b = self.weight(&format!("{name}.bias"), vec![n], 0.0, 0.02)?;
        let y = self.op("MatMul", &[x, &w], vec![]);
        Ok(self.op("Add", &[&y, &b], vec![]))
    }

    fn layer_norm(&mut self, x: &str, name: &str, w: usize) -> Result<String> {
        let s = self.weight(&format!("{name}.weight"), vec![w], 1.0, 0.05)?;
        let b = self.weight(&format!("{name}.bias"), vec![w], 0.0, 0.02)?;
        Ok(self.op(
            "LayerNormalization",
            &[x, &s, &b],
            vec![("axis", Attr::Int(-1)), ("epsilon", Attr::Float(1e-6))],
        ))
    }
}

/// A ViT-shaped encoder of `shape` with deterministic random weights (see the module docs).
pub fn vit(shape: VitShape) -> Result<Model> {
    let VitShape {
        layers,
        width: w,
        heads,
        mlp,
        image,
        patch,
    } = shape;
    if heads == 0 || w % heads != 0 || patch == 0 || image % patch != 0 {
        bail!("synthetic ViT: width {w} must split into {heads} heads and image {image} into patches of {patch}");
    }
    let (t, d, g) = (shape.tokens(), w / heads, image / patch);
    let mut b = Builder {
        nodes: vec![],
        inits: vec![],
        n: 0,
    };
    // Patch embedding: Conv with stride = kernel = patch, flattened to tokens.
    let pw = b.weight(
        "patch_embed.weight",
        vec![w, 3, patch, patch],
        0.0,
        1.0 / ((3 * patch * patch) as f32).sqrt(),
    )?;
    let pb = b.weight("patch_embed.bias", vec![w], 0.0, 0.02)?;
    let conv = b.op(
        "Conv",
        &[VIT_INPUT, &pw, &pb],
        vec![
            ("kernel_shape", Attr::Ints(vec![patch as i64; 2])),
            ("strides", Attr::Ints(vec![patch as i64; 2])),
        ],
    );
    let s = b.i64s("const.shape.patches", &[1, w as i64, (g * g) as i64])?;
    let x = b.op("Reshape", &[&conv, &s], vec![]);
    let x = b.op(
        "Transpose",
        &[&x],
        vec![("perm", Attr::Ints(vec![0, 2, 1]))],
    );
    let cls = b.weight("cls_token", vec![1, 1, w], 0.0, 0.02)?;
    let x = b.op("Concat", &[&cls, &x], vec![("axis", Attr::Int(1))]);
    let pos = b.weight("pos_embed", vec![1, t, w], 0.0, 0.02)?;
    let mut x = b.op("Add", &[&x, &pos], vec![]);
    let heads_shape = b.i64s("const.shape.heads", &[1, t as i64, heads as i64, d as i64])?;
    let tokens_shape = b.i64s("const.shape.tokens", &[1, t as i64, w as i64])?;
    let scale = b.scalar("const.attn_scale", 1.0 / (d as f32).sqrt());
    let (half, one, rsqrt2) = (
        b.scalar("const.half", 0.5),
        b.scalar("const.one", 1.0),
        b.scalar("const.rsqrt2", std::f32::consts::FRAC_1_SQRT_2),
    );
    for l in 0..layers {
        let p = |s: &str| format!("blocks.{l}.{s}");
        let h = b.layer_norm(&x, &p("norm1"), w)?;
        let split = |b: &mut Builder, name: &str, perm: Vec<i64>| -> Result<String> {
            let y = b.linear(&h, &p(name), w, w)?;
            let y = b.op("Reshape", &[&y, &heads_shape], vec![]);
            Ok(b.op("Transpose", &[&y], vec![("perm", Attr::Ints(perm))]))
        };
        let q = split(&mut b, "attn.q", vec![0, 2, 1, 3])?;
        let k = split(&mut b, "attn.k", vec![0, 2, 3, 1])?;
        let v = split(&mut b, "attn.v", vec![0, 2, 1, 3])?;
        let sc = b.op("MatMul", &[&q, &k], vec![]);
        let sc = b.op("Mul", &[&sc, &scale], vec![]);
        let pr = b.op("Softmax", &[&sc], vec![("axis", Attr::Int(-1))]);
        let a = b.op("MatMul", &[&pr, &v], vec![]);
        let a = b.op(
            "Transpose",
            &[&a],
            vec![("perm", Attr::Ints(vec![0, 2, 1, 3]))],
        );
        let a = b.op("Reshape", &[&a, &tokens_shape], vec![]);
        let a = b.linear(&a, &p("attn.proj"), w, w)?;
        x = b.op("Add", &[&x, &a], vec![]);
        let h = b.layer_norm(&x, &p("norm2"), w)?;
        let f = b.linear(&h, &p("mlp.fc1"), w, mlp)?;
        // Exact GELU: 0.5 x (1 + erf(x / sqrt 2)).
        let e = b.op("Mul", &[&f, &rsqrt2], vec![]);
        let e = b.op("Erf", &[&e], vec![]);
        let e = b.op("Add", &[&e, &one], vec![]);
        let e = b.op("Mul", &[&f, &e], vec![]);
        let e = b.op("Mul", &[&e, &half], vec![]);
        let f = b.linear(&e, &p("mlp.fc2"), mlp, w)?;
        x = b.op("Add", &[&x, &f], vec![]);
    }
    let y = b.layer_norm(&x, "norm", w)?;
    let out = "last_hidden_state";
    b.nodes.push(Node::new("Identity", &[&y], &[out]));
    let f32_shape = |dims: Vec<usize>| {
        Some(TypeInfo::Tensor {
            dtype: Some(DType::F32),
            shape: Some(dims.into_iter().map(Dim::Fixed).collect()),
        })
    };
    Ok(Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: 17,
        }],
        producer_name: "npuc-synthetic".into(),
        doc: format!(
            "SYNTHETIC: a ViT-shaped encoder ({layers} layers, width {w}, {heads} heads, MLP {mlp}, {image}x{image} in {patch}x{patch} patches) with deterministic random weights, not a trained model; written by npuc_driver::synth for scale tests"
        ),
        graph: Graph {
            name: "synthetic_vit".into(),
            nodes: b.nodes,
            inputs: vec![ValueInfo::new(
                VIT_INPUT,
                f32_shape(vec![1, 3, image, image]),
            )],
            outputs: vec![ValueInfo::new(out, f32_shape(vec![1, t, w]))],
            initializers: b.inits,
            ..Default::default()
        },
        ..Default::default()
    })
}

/// Writes the synthetic ViT of `shape` to `out` (`.onnx`) with every initializer of 1 KiB or
/// more in `<out>.data` (external data, streamed). Returns the weight bytes.
pub fn write_vit(shape: VitShape, out: &Path) -> Result<usize> {
    let m = vit(shape)?;
    let bytes = m
        .graph
        .initializers
        .iter()
        .map(|i| i.tensor.len() * i.tensor.dtype().size())
        .sum();
    npuc_onnx::save_model(
        &m,
        out,
        &npuc_onnx::ExportOptions {
            external_threshold: Some(1024),
        },
    )?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parameter count of the graph matches the formula (ViT-H/14: 632 M, as published).
    #[test]
    fn vit_params_match_the_shape() {
        let small = VitShape {
            layers: 2,
            width: 64,
            heads: 4,
            mlp: 256,
            image: 28,
            patch: 14,
        };
        let m = vit(small).unwrap();
        let n: usize = m
            .graph
            .initializers
            .iter()
            .filter(|i| !i.name.starts_with("const."))
            .map(|i| i.tensor.len())
            .sum();
        assert_eq!(n, small.params());
        let h = VitShape::VIT_H.params();
        assert!((630_000_000..635_000_000).contains(&h), "{h}");
        // Deterministic: the same name gives the same values.
        assert_eq!(values("a", 8, 0.0, 1.0), values("a", 8, 0.0, 1.0));
        assert_ne!(values("a", 8, 0.0, 1.0), values("b", 8, 0.0, 1.0));
    }
}
