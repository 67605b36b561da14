//! Splitting a decoder into parts that run one after the other: part 1 holds the token
//! embedding and the first layers, the last part the last layers and the output head, each
//! part only its own layers' weights and KV caches.
//!
//! A part's graph takes `input_ids` (first part) or `hidden_in` f32 `[N, n_embd]` (the residual
//! stream after the previous part's last layer) and returns `logits` (last part) or
//! `hidden_out` f32 `[N, n_embd]`; KV inputs/outputs keep the model's layer numbers
//! (`past_key.{l}` ... for the part's `l` only). The hidden state crosses a cut in f32, exactly
//! as it flows inside the unsplit graph, so a split model computes what the whole one does.
//!
//! The unsplit path is the same builder over the part that holds every layer
//! ([`PartSpec::whole`]).

use super::{hparams, Hparams};
use crate::{bail, BuildOptions, Precision, Result, WeightMode};
use npuc_gguf::GgufFile;
use std::ops::Range;

/// Name of a part's hidden-state input (every part but the first).
pub const HIDDEN_IN: &str = "hidden_in";
/// Name of a part's hidden-state output (every part but the last).
pub const HIDDEN_OUT: &str = "hidden_out";

/// One part of a split model: its place (`index` of `count`, from 0) and its layers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PartSpec {
    pub index: usize,
    pub count: usize,
    pub layers: Range<usize>,
    /// An embedder part ([`PartSpec::is_embedder`]) whose table is stored in f16 (each row
    /// dequantized once from the GGUF's blocks and rounded to f16; looked up by `Gather` and
    /// widened to f32) instead of as the GGUF's own blocks. Ignored by other parts.
    pub embedder_f16: bool,
}

impl PartSpec {
    /// The one part holding every layer (the unsplit model).
    pub fn whole(n_layers: usize) -> PartSpec {
        PartSpec {
            index: 0,
            count: 1,
            layers: 0..n_layers,
            embedder_f16: false,
        }
    }
    /// The first part looks tokens up in the embedding table.
    pub fn has_embedding(&self) -> bool {
        self.index == 0
    }
    /// An embedder: the first part of several holding the token embedding and no layer (the
    /// decoder parts after it take embeddings, `hidden_in`, as input: the VLM layout, where
    /// other components' embeddings are spliced in ahead of the prompt's).
    pub fn is_embedder(&self) -> bool {
        self.index == 0 && self.count > 1 && self.layers.is_empty()
    }
    /// The last part computes the logits.
    pub fn has_head(&self) -> bool {
        self.index + 1 == self.count
    }
    /// Whether this part is the whole model.
    pub fn is_whole(&self, n_layers: usize) -> bool {
        self.count == 1 && self.layers == (0..n_layers)
    }
}

/// Weight bytes of a model as stored in its GGUF, by where they go when split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightCensus {
    /// The embedding table (and rope factors), which the first part holds.
    pub embedding: u64,
    /// Each layer's `blk.{l}.*` tensors.
    pub layers: Vec<u64>,
    /// The final norm and output head (the embedding table again when tied), which the last
    /// part holds.
    pub head: u64,
}

impl WeightCensus {
    /// Reads the tensor table of `g` (no weight bytes are touched).
    pub fn of(g: &GgufFile, hp: &Hparams) -> Result<WeightCensus> {
        let size = |name: &str| -> u64 {
            g.tensor(name)
                .map(|t| g.tensor_range(t).1 as u64)
                .unwrap_or(0)
        };
        let mut layers = vec![0u64; hp.n_layers];
        for t in &g.tensors {
            if let Some(rest) = t.name.strip_prefix("blk.") {
                let l = rest.split('.').next().and_then(|n| n.parse::<usize>().ok());
                match l {
                    Some(l) if l < hp.n_layers => layers[l] += g.tensor_range(t).1 as u64,
                    _ => bail!(
                        "{}: tensor '{}' names a layer outside 0..{}",
                        g.name,
                        t.name,
                        hp.n_layers
                    ),
                }
            }
        }
        let embedding = size("token_embd.weight") + size("rope_freqs.weight");
        let head = size("output_norm.weight")
            + if hp.tied {
                size("token_embd.weight")
            } else {
                size("output.weight")
            };
        Ok(WeightCensus {
            embedding,
            layers,
            head,
        })
    }

    /// Weight bytes the part holding `layers` stores (of `count` parts, at `index`).
    pub fn part_bytes(&self, p: &PartSpec) -> u64 {
        let mut b: u64 = self.layers[p.layers.clone()].iter().sum();
        if p.has_embedding() {
            b += self.embedding;
        }
        if p.has_head() {
            b += self.head;
        }
        b
    }
}

/// Cuts `n_layers` into `count` parts of consecutive layers, as even as layer counts allow
/// (the first parts take one more when they do not divide).
pub fn split_by_count(n_layers: usize, count: usize) -> Result<Vec<PartSpec>> {
    if count == 0 {
        bail!("parts = 0: a model needs at least one part");
    }
    if count > n_layers {
        bail!(
            "parts = {count} is more than the model's {n_layers} layers (each part needs at least one layer); use at most {n_layers}"
        );
    }
    let (base, extra) = (n_layers / count, n_layers % count);
    let mut start = 0;
    Ok((0..count)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let p = PartSpec {
                index: i,
                count,
                layers: start..start + len,
                embedder_f16: false,
            };
            start += len;
            p
        })
        .collect())
}

/// Cuts the model into as few parts as keep each part's weights within `budget` bytes: layers
/// fill a part in order until the next would overflow it; the embedding counts towards the
/// first part and the output head towards the last. Fails naming the layer that cannot fit.
pub fn split_by_budget(census: &WeightCensus, budget: u64) -> Result<Vec<PartSpec>> {
    let n = census.layers.len();
    if n == 0 {
        bail!("the model has no layers to split");
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    // Part boundaries as layer ranges; filled greedily.
    let mut ranges: Vec<Range<usize>> = vec![];
    let mut start = 0;
    let mut used = census.embedding;
    for (l, &lb) in census.layers.iter().enumerate() {
        let first = ranges.is_empty() && l == start;
        let alone = lb + if first { census.embedding } else { 0 };
        if alone > budget {
            bail!(
                "max_part_bytes = {budget} ({:.1} MiB) is smaller than layer {l}{} ({alone} bytes, {:.1} MiB); raise max_part_bytes to at least {alone}",
                mib(budget),
                if first { " with the token embedding" } else { "" },
                mib(alone)
            );
        }
        if l > start && used + lb > budget {
            ranges.push(start..l);
            start = l;
            used = 0;
        }
        used += lb;
    }
    // The head goes with the last layers; move layers into a new last part until it fits.
    if used + census.head > budget {
        let last_alone = census.layers[n - 1] + census.head;
        if last_alone > budget || (n == 1) {
            bail!(
                "max_part_bytes = {budget} ({:.1} MiB) is smaller than layer {} with the output head ({last_alone} bytes, {:.1} MiB); raise max_part_bytes to at least {last_alone}",
                mib(budget),
                n - 1,
                mib(last_alone)
            );
        }
        let mut tail_start = n - 1;
        let mut tail = last_alone;
        while tail_start > start + 1 && tail + census.layers[tail_start - 1] <= budget {
            tail_start -= 1;
            tail += census.layers[tail_start];
        }
        if tail_start > start {
            ranges.push(start..tail_start);
        }
        start = tail_start;
    }
    ranges.push(start..n);
    let count = ranges.len();
    Ok(ranges
        .into_iter()
        .enumerate()
        .map(|(index, layers)| PartSpec {
            index,
            count,
            layers,
            embedder_f16: false,
        })
        .collect())
}

/// `decoder` parts (covering every layer) behind an embedder part ([`PartSpec::is_embedder`]).
pub fn with_embedder(decoder: Vec<PartSpec>) -> Vec<PartSpec> {
    with_embedder_table(decoder, false)
}

/// [`with_embedder`], the embedder's table in f16 when `f16` (see [`PartSpec::embedder_f16`]).
pub fn with_embedder_table(decoder: Vec<PartSpec>, f16: bool) -> Vec<PartSpec> {
    let count = decoder.len() + 1;
    std::iter::once(PartSpec {
        index: 0,
        count,
        layers: 0..0,
        embedder_f16: f16,
    })
    .chain(decoder.into_iter().map(|p| PartSpec {
        index: p.index + 1,
        count,
        layers: p.layers,
        embedder_f16: false,
    }))
    .collect()
}

/// Builds the graph of one part for `tokens` per call over `ctx` cache slots; with `sha`, in
/// single-head attention form ([`super::sha::to_sha`]).
pub fn build_part(
    g: &GgufFile,
    hp: &Hparams,
    part: &PartSpec,
    tokens: usize,
    ctx: usize,
    precision: Precision,
    sha: bool,
) -> Result<npuc_ir::Model> {
    build_part_shared(
        g,
        hp,
        part,
        tokens,
        ctx,
        precision,
        sha,
        &Default::default(),
    )
}

/// [`build_part`] sharing repacked weights with the other graphs built with `repacked`.
#[allow(clippy::too_many_arguments)]
pub fn build_part_shared(
    g: &GgufFile,
    hp: &Hparams,
    part: &PartSpec,
    tokens: usize,
    ctx: usize,
    precision: Precision,
    sha: bool,
    repacked: &super::RepackCache,
) -> Result<npuc_ir::Model> {
    let m = super::build_layers(
        g,
        hp,
        &BuildOptions {
            tokens,
            ctx,
            precision,
            weights: WeightMode::Auto,
            weight_quant: Default::default(),
            repacked: repacked.clone(),
        },
        Some(part),
    )?;
    // An embedder has no attention to rewrite.
    if sha && !part.is_embedder() {
        super::sha::to_sha(&m)
    } else {
        Ok(m)
    }
}

/// The name of a part graph in its artifact: `ar{N}_c{C}`.
pub fn graph_name(tokens: usize, ctx: usize) -> String {
    format!("ar{tokens}_c{ctx}")
}

/// Parses [`graph_name`] back into `(tokens, ctx)`.
pub fn parse_graph_name(name: &str) -> Option<(usize, usize)> {
    let (a, c) = name.strip_prefix("ar")?.split_once("_c")?;
    Some((a.parse().ok()?, c.parse().ok()?))
}

/// Reads the hyper-parameters of `g` (for callers that only have the split API in scope).
pub fn model_hparams(g: &GgufFile) -> Result<Hparams> {
    hparams(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn census(layers: &[u64], embedding: u64, head: u64) -> WeightCensus {
        WeightCensus {
            embedding,
            layers: layers.to_vec(),
            head,
        }
    }

    #[test]
    fn by_count_is_even_and_covers_every_layer() {
        let p = split_by_count(30, 4).unwrap();
        let lens: Vec<usize> = p.iter().map(|p| p.layers.len()).collect();
        assert_eq!(lens, vec![8, 8, 7, 7]);
        assert_eq!(p[0].layers.start, 0);
        assert_eq!(p[3].layers.end, 30);
        assert!(p.windows(2).all(|w| w[0].layers.end == w[1].layers.start));
        let e = split_by_count(3, 4).unwrap_err().to_string();
        assert!(e.contains("parts = 4") && e.contains("3 layers"), "{e}");
    }

    #[test]
    fn by_budget_respects_the_budget_and_places_embedding_and_head() {
        let c = census(&[10; 6], 15, 15);
        let parts = split_by_budget(&c, 40).unwrap();
        for p in &parts {
            assert!(c.part_bytes(p) <= 40, "{p:?}: {}", c.part_bytes(p));
        }
        assert_eq!(parts.last().unwrap().layers.end, 6);
        assert_eq!(parts.len(), 3, "{parts:?}");
        // Everything fits one part.
        assert_eq!(split_by_budget(&c, 1000).unwrap().len(), 1);
    }

    #[test]
    fn by_budget_names_the_layer_that_cannot_fit() {
        let c = census(&[10, 50, 10], 5, 5);
        let e = split_by_budget(&c, 40).unwrap_err().to_string();
        assert!(e.contains("layer 1") && e.contains("at least 50"), "{e}");
        let e = split_by_budget(&c, 12).unwrap_err().to_string();
        assert!(e.contains("layer 0 with the token embedding"), "{e}");
        let c = census(&[10, 10, 10], 5, 35);
        let e = split_by_budget(&c, 40).unwrap_err().to_string();
        assert!(e.contains("layer 2 with the output head"), "{e}");
    }
}
