//! The pipeline file (`docs/PIPELINE.md`): TOML, strict (an unknown key is an error naming
//! it), checked against the model before any step runs.

use anyhow::{anyhow, bail, Context, Result};
use npuc_gguf::GgufFile;
use npuc_llm::build::split::{self, PartSpec, WeightCensus};
use npuc_llm::{Hparams, Precision};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PipelineFile {
    pub(crate) model: ModelSection,
    pub(crate) graphs: GraphsSection,
    #[serde(default)]
    pub(crate) split: SplitSection,
    #[serde(default)]
    pub(crate) test: TestSection,
    #[serde(default)]
    pub(crate) target: TargetSection,
}

/// The deployment target's memory limits (pre-flight check; HTP-like defaults).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TargetSection {
    /// Bytes one graph may hold: its part's weights plus its KV cache inputs and outputs.
    pub(crate) max_graph_bytes: Option<u64>,
    /// Bytes one context binary (a part: its graphs share the weights) may hold.
    pub(crate) max_context_bytes: Option<u64>,
}

/// Default per-graph limit (QNN HTP: about 2 GB per graph).
pub const DEFAULT_MAX_GRAPH_BYTES: u64 = 2 << 30;
/// Default per-context limit (QNN HTP: about 4 GB per context binary).
pub const DEFAULT_MAX_CONTEXT_BYTES: u64 = 4 << 30;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ModelSection {
    /// The GGUF: relative to the pipeline file; `~` and `$NPUC_CACHE` expanded.
    pub(crate) gguf: Option<String>,
    /// Or an ONNX LLM decoder (`npuc export` / Optimum layout), imported first.
    pub(crate) onnx: Option<String>,
    /// With `onnx`: a GGUF whose tokenizer to use when the ONNX file carries none.
    pub(crate) tokenizer: Option<String>,
}

/// Where the model comes from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    Gguf(PathBuf),
    Onnx {
        onnx: PathBuf,
        tokenizer: Option<PathBuf>,
        /// The text the import's check runs (the first test prompt).
        probe: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GraphsSection {
    /// Tokens per call of each AR variant.
    pub(crate) ar: Vec<usize>,
    /// Context lengths (one graph per AR x context).
    pub(crate) ctx: Vec<usize>,
    /// Single-head attention graphs (MHA to SHA): per-head projections and KV tensors.
    #[serde(default)]
    pub(crate) sha: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SplitSection {
    pub(crate) parts: Option<usize>,
    pub(crate) max_part_bytes: Option<u64>,
    /// Precision of every part.
    pub(crate) precision: Option<String>,
    /// Precision per part (as many as there are parts); overrides `precision`.
    pub(crate) part_precision: Option<Vec<String>>,
    /// The token embedding as a part of its own (the embedder) ahead of the decoder parts,
    /// which then take embeddings as input (the VLM layout).
    #[serde(default)]
    pub(crate) embedder: bool,
    /// How the embedder stores its table: `gguf` (the GGUF's own blocks, the default: its rows
    /// are bit for bit what the decoder's own lookup gives) or `f16`.
    pub(crate) embedder_dtype: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TestSection {
    #[serde(default)]
    pub(crate) prompts: Vec<String>,
    /// Greedy tokens generated per prompt by the `check` step.
    pub(crate) max_tokens: Option<usize>,
}

/// A checked pipeline: paths resolved, the split chosen.
#[derive(Clone, Debug)]
pub struct Pipeline {
    /// The pipeline file.
    pub file: PathBuf,
    /// The GGUF, resolved (for an ONNX source: the imported one).
    pub gguf: PathBuf,
    /// The ONNX file an imported GGUF came from.
    pub imported_from: Option<PathBuf>,
    pub arch: String,
    pub n_layers: usize,
    pub n_embd: usize,
    pub vocab: usize,
    /// AR variants (tokens per call), ascending.
    pub ar: Vec<usize>,
    /// Contexts, ascending.
    pub ctx: Vec<usize>,
    /// Single-head attention graphs (`graphs.sha`).
    pub sha: bool,
    /// The parts and their precision.
    pub parts: Vec<(PartSpec, Precision)>,
    /// Weight bytes each part stores.
    pub part_bytes: Vec<u64>,
    pub max_part_bytes: Option<u64>,
    pub test_prompts: Vec<String>,
    pub test_max_tokens: usize,
    /// Target limits (`[target]`).
    pub max_graph_bytes: u64,
    pub max_context_bytes: u64,
    /// KV cache bytes (keys and values, inputs and this call's outputs) per layer at the
    /// largest context, per precision's KV dtype.
    pub kv_bytes_per_layer: Vec<u64>,
    /// The model's weight census (for proposing a split).
    pub census: WeightCensus,
}

/// Expands `~/`, `$NPUC_CACHE` (default `~/.cache/npuc`) and `$HOME`, then resolves a relative
/// path against `base`.
pub fn resolve_path(raw: &str, base: &Path) -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    let cache = std::env::var("NPUC_CACHE")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| format!("{home}/.cache/npuc"));
    let mut s = raw.to_string();
    for (var, val) in [
        ("${NPUC_CACHE}", &cache),
        ("$NPUC_CACHE", &cache),
        ("${HOME}", &home),
        ("$HOME", &home),
    ] {
        s = s.replace(var, val);
    }
    if s == "~" {
        s = home.clone();
    } else if let Some(rest) = s.strip_prefix("~/") {
        s = format!("{home}/{rest}");
    }
    let p = PathBuf::from(s);
    if p.is_absolute() {
        p
    } else {
        base.join(p)
    }
}

fn precision(value: &str, key: &str, file: &Path) -> Result<Precision> {
    Precision::parse(value).map_err(|_| {
        anyhow!(
            "{}: {key} = \"{value}\" is not a precision (expected fast, parity or exact)",
            file.display()
        )
    })
}

impl Pipeline {
    /// The precision of every part, when they share one.
    pub fn uniform_precision(&self) -> Option<Precision> {
        let first = self.parts[0].1;
        self.parts.iter().all(|(_, q)| *q == first).then_some(first)
    }

    pub(crate) fn read(file: &Path) -> Result<PipelineFile> {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("reading pipeline file '{}'", file.display()))?;
        toml::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: {}",
                file.display(),
                e.to_string().trim_end().replace('\n', "\n  ")
            )
        })
    }

    /// The `[model]` section of `file`, paths resolved and checked to exist.
    pub fn model_source(file: &Path) -> Result<ModelSource> {
        let raw = Self::read(file)?;
        let f = file.display();
        let base = file.parent().unwrap_or(Path::new("."));
        let existing = |key: &str, value: &str| -> Result<PathBuf> {
            let p = resolve_path(value, base);
            if !p.is_file() {
                let hint = if value.contains("NPUC_CACHE") || value.contains(".cache/npuc") {
                    " (models in the npuc cache are fetched by `scripts/fetch-data.sh llms`)"
                } else {
                    ""
                };
                bail!(
                    "{f}: model.{key} = \"{value}\": no such file '{}'{hint}",
                    p.display()
                );
            }
            Ok(p)
        };
        let m = &raw.model;
        match (&m.gguf, &m.onnx) {
            (Some(g), None) => {
                if m.tokenizer.is_some() {
                    bail!("{f}: model.tokenizer applies only with model.onnx (a GGUF carries its own tokenizer)");
                }
                Ok(ModelSource::Gguf(existing("gguf", g)?))
            }
            (None, Some(o)) => Ok(ModelSource::Onnx {
                onnx: existing("onnx", o)?,
                tokenizer: m
                    .tokenizer
                    .as_deref()
                    .map(|t| existing("tokenizer", t))
                    .transpose()?,
                probe: raw
                    .test
                    .prompts
                    .first()
                    .cloned()
                    .unwrap_or_else(|| crate::verify::FALLBACK_PROBE.to_string()),
            }),
            (Some(_), Some(_)) => bail!("{f}: give model.gguf or model.onnx, not both"),
            (None, None) => {
                bail!("{f}: [model] needs gguf = \"MODEL.gguf\" or onnx = \"MODEL.onnx\"")
            }
        }
    }

    /// Reads and checks `file` (a GGUF source): the TOML, the model's header (no weights are
    /// read), and the split. Every error names the key (or layer) and what to do. An ONNX
    /// source is imported first ([`crate::import`]) and loaded with [`Pipeline::load_imported`].
    pub fn load(file: &Path) -> Result<Pipeline> {
        match Self::model_source(file)? {
            ModelSource::Gguf(g) => Self::load_from(file, g, None),
            ModelSource::Onnx { onnx, .. } => bail!(
                "{}: model.onnx = '{}' is imported by `npuc build` before the pipeline is checked (npuc_build::import)",
                file.display(),
                onnx.display()
            ),
        }
    }

    /// [`Pipeline::load`] for an ONNX source imported as `gguf`.
    pub fn load_imported(file: &Path, gguf: PathBuf, onnx: PathBuf) -> Result<Pipeline> {
        Self::load_from(file, gguf, Some(onnx))
    }

    fn load_from(file: &Path, gguf: PathBuf, imported_from: Option<PathBuf>) -> Result<Pipeline> {
        Self::from_raw(file, Self::read(file)?, gguf, imported_from, "model")
    }

    /// Checks `raw` (read from `file`, or made from a component of a multi-component file, whose
    /// keys are then prefixed `components.<name>`: `key_prefix`) against the model `gguf`.
    pub(crate) fn from_raw(
        file: &Path,
        raw: PipelineFile,
        gguf: PathBuf,
        imported_from: Option<PathBuf>,
        key_prefix: &str,
    ) -> Result<Pipeline> {
        let f = file.display();
        let key = if imported_from.is_some() {
            "onnx"
        } else {
            "gguf"
        };
        let g = GgufFile::open(&gguf)
            .with_context(|| format!("{f}: {key_prefix}.{key} = '{}'", gguf.display()))?;
        let hp: Hparams = split::model_hparams(&g)
            .with_context(|| format!("{f}: {key_prefix}.{key} = '{}'", gguf.display()))?;

        let mut ar = raw.graphs.ar.clone();
        let mut ctx = raw.graphs.ctx.clone();
        if ar.is_empty() {
            bail!("{f}: graphs.ar is empty; give at least one AR variant, e.g. ar = [1, 32]");
        }
        if ctx.is_empty() {
            bail!("{f}: graphs.ctx is empty; give at least one context, e.g. ctx = [512]");
        }
        if let Some(a) = ar.iter().find(|&&a| a == 0) {
            bail!("{f}: graphs.ar contains {a}; an AR variant takes at least 1 token per call");
        }
        if ctx.contains(&0) {
            bail!("{f}: graphs.ctx contains 0; a context holds at least 1 token");
        }
        ar.sort_unstable();
        ar.dedup();
        ctx.sort_unstable();
        ctx.dedup();
        let (max_ar, min_ctx) = (*ar.last().expect("non-empty"), ctx[0]);
        if max_ar > min_ctx {
            bail!(
                "{f}: graphs.ar = {max_ar} is longer than graphs.ctx = {min_ctx} (every AR variant is built for every context); drop ar {max_ar} or raise the smallest ctx to at least {max_ar}"
            );
        }
        let census = WeightCensus::of(&g, &hp)?;
        let s = &raw.split;
        // With an embedder, the decoder parts hold no embedding (the budget split too).
        let decoder_census = WeightCensus {
            embedding: if s.embedder { 0 } else { census.embedding },
            ..census.clone()
        };
        let specs = match (s.parts, s.max_part_bytes) {
            (Some(n), _) => {
                split::split_by_count(hp.n_layers, n).map_err(|e| anyhow!("{f}: split.{e}"))?
            }
            (None, Some(budget)) => split::split_by_budget(&decoder_census, budget)
                .map_err(|e| anyhow!("{f}: split.{e}"))?,
            (None, None) => split::split_by_count(hp.n_layers, 1)?,
        };
        let embedder_f16 = match s.embedder_dtype.as_deref() {
            None | Some("gguf") => false,
            Some("f16") => true,
            Some(other) => bail!(
                "{f}: split.embedder_dtype = \"{other}\" is not an embedder table type (expected gguf or f16)"
            ),
        };
        if s.embedder_dtype.is_some() && !s.embedder {
            bail!("{f}: split.embedder_dtype applies only with split.embedder = true");
        }
        let specs = if s.embedder {
            split::with_embedder_table(specs, embedder_f16)
        } else {
            specs
        };
        let all = match &s.precision {
            Some(p) => precision(p, "split.precision", file)?,
            None => Precision::Fast,
        };
        let precisions = match &s.part_precision {
            None => vec![all; specs.len()],
            Some(list) => {
                if list.len() != specs.len() {
                    bail!(
                        "{f}: split.part_precision lists {} precisions for {} parts; give one per part",
                        list.len(),
                        specs.len()
                    );
                }
                list.iter()
                    .enumerate()
                    .map(|(i, p)| precision(p, &format!("split.part_precision[{i}]"), file))
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let part_bytes: Vec<u64> = specs
            .iter()
            .map(|p| {
                if p.is_embedder() && p.embedder_f16 {
                    (hp.vocab * hp.n_embd * 2) as u64
                } else {
                    census.part_bytes(p)
                }
            })
            .collect();
        let test_max_tokens = raw.test.max_tokens.unwrap_or(16);
        if !raw.test.prompts.is_empty() && test_max_tokens == 0 {
            bail!("{f}: test.max_tokens = 0; give at least 1 (or no test.prompts)");
        }
        if let Some(p) = raw.test.prompts.iter().position(|p| p.is_empty()) {
            bail!("{f}: test.prompts[{p}] is empty");
        }
        let kv_bytes_per_layer = {
            let c = *ctx.last().expect("non-empty") as u64;
            let n = *ar.last().expect("non-empty") as u64;
            let per = (hp.n_kv_head * hp.head_dim) as u64;
            // The largest KV dtype the parts use (f16 in fast/parity, f32 in exact); the
            // cache inputs hold c slots, the outputs this call's n rows.
            let el = precisions
                .iter()
                .map(|p| p.kv_dtype().size() as u64)
                .max()
                .unwrap_or(2);
            vec![2 * (c + n) * per * el; hp.n_layers]
        };
        Ok(Pipeline {
            file: file.to_path_buf(),
            gguf,
            imported_from,
            arch: hp.arch.clone(),
            n_layers: hp.n_layers,
            n_embd: hp.n_embd,
            vocab: hp.vocab,
            ar,
            ctx,
            sha: raw.graphs.sha,
            parts: specs.into_iter().zip(precisions).collect(),
            part_bytes,
            max_part_bytes: s.max_part_bytes,
            test_prompts: raw.test.prompts,
            test_max_tokens,
            max_graph_bytes: raw
                .target
                .max_graph_bytes
                .unwrap_or(DEFAULT_MAX_GRAPH_BYTES),
            max_context_bytes: raw
                .target
                .max_context_bytes
                .unwrap_or(DEFAULT_MAX_CONTEXT_BYTES),
            kv_bytes_per_layer,
            census: census.clone(),
        })
    }
}
