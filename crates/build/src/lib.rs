//! `npuc build PIPELINE.toml`: a GGUF LLM to a *bundle* (a directory of part artifacts and
//! `bundle.json`, run by [`npuc_llm::Bundle`]) through a DAG of steps, each a pure function of
//! its inputs whose outputs live in a content-addressed cache ([`cache`]):
//!
//! ```text
//! source ──► graph:p{i}:ar{N}:c{C} (one per part x AR x context) ──► compile:p{i} ──► bundle
//! ```
//! - `source`: the GGUF's sha256 (keyed by the file's identity: path, size, mtime, inode, so
//!   an unchanged file is not read again);
//! - `graph:…`: builds one part graph, checks it can be planned by the runtime, records its
//!   signature and a fingerprint of its structure;
//! - `compile:p{i}`: the part's artifact (all its graphs, its weights once); the graphs are
//!   rebuilt from the GGUF (cheap: weights are borrowed from the mapping, storing them per
//!   graph would copy the model once per graph) and must match the `graph` steps' fingerprints;
//! - `bundle`: `bundle.json` (parts, layers, weight bytes, sha256 of each part);
//! - `check` (when the pipeline has test prompts): runs the bundle greedily on each prompt and,
//!   when every part has one precision, the unsplit model in that precision; records tokens,
//!   max |logit difference|, cosine and top-1 agreement, and fails when the tokens differ.
//!
//! Finished outputs are hard-linked into the output directory. Independent steps run in
//! parallel (`jobs`). The library prints nothing: lines go to the caller's callback.

pub mod cache;
mod check;
pub mod components;
pub mod handoff;
pub mod import;
pub mod pipeline;
pub mod verify;

pub use pipeline::Pipeline;

use anyhow::{anyhow, bail, Context, Result};
use cache::{Cache, KeyHasher, Lookup, Record, Verify};
use npuc_llm::build::split::{self, PartSpec};
use npuc_llm::bundle::{BundleManifest, PartRecord, SourceRecord, MANIFEST};
use npuc_llm::Precision;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Bumped when a step's code changes what it writes, so old cache entries stop matching.
pub const STEP_SCHEMA: &str = "2";

/// The cache directory inside the output directory.
pub const CACHE_DIR: &str = ".cache";

/// How to run a pipeline.
#[derive(Clone, Debug)]
pub struct BuildRequest {
    /// Where the bundle goes (its cache in `OUT/.cache`).
    pub out_dir: PathBuf,
    /// Steps run at once.
    pub jobs: usize,
    /// Print the plan (with cache hits) and run nothing.
    pub dry_run: bool,
    /// Steps to run again even when cached: a step id (`compile:p1`) or kind (`compile`).
    pub force: Vec<String>,
    /// Re-hash every cached file, also those whose metadata are unchanged since their hash
    /// last matched (see [`cache`]): finds corruption below the filesystem too.
    pub verify_cache: bool,
}

/// What happened to a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// Found in the cache, verified.
    Cached,
    /// Ran (its inputs were new).
    Ran,
    /// Ran because `--force` named it.
    Forced,
    /// Its cache entry failed its hash; rebuilt (the reason).
    Rebuilt(String),
    /// Dry run: would run.
    WouldRun,
}

impl Status {
    pub fn label(&self) -> &'static str {
        match self {
            Status::Cached => "cached",
            Status::Ran => "ran",
            Status::Forced => "forced",
            Status::Rebuilt(_) => "rebuilt (corrupt cache entry)",
            Status::WouldRun => "would run",
        }
    }
    /// Whether the step did work.
    pub fn ran(&self) -> bool {
        matches!(self, Status::Ran | Status::Forced | Status::Rebuilt(_))
    }
}

/// One step's line in the summary.
#[derive(Clone, Debug)]
pub struct StepReport {
    pub id: String,
    pub status: Status,
    pub seconds: f64,
    /// What it produced (sizes, counts).
    pub detail: String,
}

/// The result of a build.
#[derive(Clone, Debug)]
pub struct BuildReport {
    pub steps: Vec<StepReport>,
    pub seconds: f64,
    pub out_dir: PathBuf,
    /// Per part: file, layers, weight bytes, over the budget.
    pub parts: Vec<(String, [usize; 2], u64, bool)>,
    /// Whether the output directory changed.
    pub outputs_updated: bool,
    /// The sanity checks after each transform step (also in `check.json`).
    pub sanity: Vec<verify::CheckRow>,
}

impl BuildReport {
    /// Steps that did work.
    pub fn ran(&self) -> usize {
        self.steps.iter().filter(|s| s.status.ran()).count()
    }
    /// The sanity table: per check step and graph, max abs error, cosine and top-1 agreement.
    pub fn sanity_table(&self) -> String {
        verify::table(&self.sanity)
    }
    /// The summary table.
    pub fn table(&self) -> String {
        let w = self
            .steps
            .iter()
            .map(|s| s.id.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let mut t = format!("{:w$}  {:30}  {:>8}  output\n", "step", "status", "time");
        for s in &self.steps {
            t += &format!(
                "{:w$}  {:30}  {:>7.2}s  {}\n",
                s.id,
                s.status.label(),
                s.seconds,
                s.detail
            );
        }
        t
    }
}

#[derive(Clone, Debug)]
enum Kind {
    Source,
    Graph {
        part: usize,
        tokens: usize,
        ctx: usize,
    },
    Compile {
        part: usize,
    },
    Bundle,
    /// A sanity check after a transform step (see [`verify`]).
    Verify {
        stage: Stage,
        part: Option<usize>,
    },
    Check,
}

/// The transform steps a `verify` step checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Variant,
    Split,
    Sha,
    Compile,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Variant => "variant",
            Stage::Split => "split",
            Stage::Sha => "sha",
            Stage::Compile => "compile",
        }
    }
}

impl Kind {
    /// Steps that hold a part's weights in memory or run models (one at a time).
    fn heavy(&self) -> bool {
        matches!(
            self,
            Kind::Compile { .. } | Kind::Verify { .. } | Kind::Check
        )
    }
    /// The cache subdirectory (and the `--force` kind name).
    fn name(&self) -> &'static str {
        match self {
            Kind::Source => "source",
            Kind::Graph { .. } => "graph",
            Kind::Compile { .. } => "compile",
            Kind::Bundle => "bundle",
            Kind::Verify { .. } => "verify",
            Kind::Check => "check",
        }
    }
}

#[derive(Clone, Debug)]
struct Step {
    id: String,
    kind: Kind,
    deps: Vec<usize>,
}

/// The DAG of a pipeline, in a topological order.
fn plan(p: &Pipeline) -> Vec<Step> {
    let mut steps = vec![Step {
        id: "source".into(),
        kind: Kind::Source,
        deps: vec![],
    }];
    let mut compiles = vec![];
    for (i, _) in p.parts.iter().enumerate() {
        let mut graphs = vec![];
        for &tokens in &p.ar {
            for &ctx in &p.ctx {
                steps.push(Step {
                    id: format!("graph:p{}:ar{tokens}:c{ctx}", i + 1),
                    kind: Kind::Graph {
                        part: i,
                        tokens,
                        ctx,
                    },
                    deps: vec![0],
                });
                graphs.push(steps.len() - 1);
            }
        }
        let mut deps = vec![0];
        deps.extend(graphs);
        steps.push(Step {
            id: format!("compile:p{}", i + 1),
            kind: Kind::Compile { part: i },
            deps,
        });
        compiles.push(steps.len() - 1);
    }
    let mut deps = vec![0];
    deps.extend(compiles.iter().copied());
    steps.push(Step {
        id: "bundle".into(),
        kind: Kind::Bundle,
        deps,
    });
    let bundle = steps.len() - 1;
    // Sanity checks after each transform step.
    let mut verifies = vec![];
    let mut verify =
        |steps: &mut Vec<Step>, stage: Stage, part: Option<usize>, deps: Vec<usize>| {
            steps.push(Step {
                id: match part {
                    Some(i) => format!("verify:{}:p{}", stage.name(), i + 1),
                    None => format!("verify:{}", stage.name()),
                },
                kind: Kind::Verify { stage, part },
                deps,
            });
            verifies.push(steps.len() - 1);
        };
    verify(&mut steps, Stage::Variant, None, vec![0]);
    if p.parts.len() > 1 && p.uniform_precision().is_some() {
        verify(&mut steps, Stage::Split, None, vec![0]);
    }
    for (i, &c) in compiles.iter().enumerate() {
        // An embedder has no attention: its graphs are the same with or without SHA.
        if p.sha && !p.parts[i].0.is_embedder() {
            verify(&mut steps, Stage::Sha, Some(i), vec![0]);
        }
        verify(&mut steps, Stage::Compile, Some(i), vec![0, c]);
    }
    // source, bundle, the parts (to assemble the bundle directory it runs), the checks.
    let mut deps = vec![0, bundle];
    deps.extend(compiles);
    deps.extend(verifies);
    steps.push(Step {
        id: "check".into(),
        kind: Kind::Check,
        deps,
    });
    steps
}

fn part_key(k: &mut KeyHasher, spec: &PartSpec, precision: Precision) {
    k.field("part", &spec.index.to_string())
        .field("parts", &spec.count.to_string())
        .field(
            "layers",
            &format!("{}..{}", spec.layers.start, spec.layers.end),
        )
        .field("precision", precision.name());
    // Only when set, so that the keys of pipelines without it stay what they were.
    if spec.is_embedder() && spec.embedder_f16 {
        k.field("embedder_dtype", "f16");
    }
}

/// The identity of the source file: what the `source` step is keyed on.
pub fn source_identity(path: &Path) -> Result<String> {
    let canon = path
        .canonicalize()
        .with_context(|| format!("'{}'", path.display()))?;
    let m = std::fs::metadata(&canon).with_context(|| format!("'{}'", canon.display()))?;
    let mtime = m
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    #[cfg(unix)]
    let inode = {
        use std::os::unix::fs::MetadataExt;
        format!("{}:{}", m.dev(), m.ino())
    };
    #[cfg(not(unix))]
    let inode = String::new();
    Ok(format!("{}|{}|{mtime}|{inode}", canon.display(), m.len()))
}

/// The key of step `s` given its dependencies' records.
fn step_key(p: &Pipeline, s: &Step, deps: &[&Record]) -> Result<String> {
    let mut k = KeyHasher::new(s.kind.name());
    for (i, d) in deps.iter().enumerate() {
        k.field(&format!("dep{i}"), &d.digest());
    }
    match &s.kind {
        Kind::Source => {
            k.field("identity", &source_identity(&p.gguf)?);
        }
        Kind::Graph { part, tokens, ctx } => {
            let (spec, prec) = &p.parts[*part];
            part_key(&mut k, spec, *prec);
            k.field("sha", &p.sha.to_string())
                .field("tokens", &tokens.to_string())
                .field("ctx", &ctx.to_string());
        }
        Kind::Compile { part } => {
            let (spec, prec) = &p.parts[*part];
            part_key(&mut k, spec, *prec);
            k.field("sha", &p.sha.to_string())
                .field("graphs", &format!("{:?}x{:?}", p.ar, p.ctx));
        }
        Kind::Bundle => {
            // Everything the manifest says that no dependency carries.
            k.field("source-file", &source_file_name(p))
                .field("imported-from", &format!("{:?}", p.imported_from))
                .field("max_part_bytes", &format!("{:?}", p.max_part_bytes))
                .field("prompts", &serde_json::to_string(&p.test_prompts)?)
                .field("ar", &format!("{:?}", p.ar))
                .field("ctx", &format!("{:?}", p.ctx));
        }
        Kind::Verify { stage, part } => {
            k.field("stage", stage.name())
                .field("sha", &p.sha.to_string())
                .field("graphs", &format!("{:?}x{:?}", p.ar, p.ctx))
                .field("probe", &serde_json::to_string(&p.test_prompts.first())?);
            match part {
                Some(i) => {
                    let (spec, prec) = &p.parts[*i];
                    part_key(&mut k, spec, *prec);
                }
                None => {
                    for (spec, prec) in &p.parts {
                        part_key(&mut k, spec, *prec);
                    }
                }
            }
        }
        Kind::Check => {
            k.field("prompts", &serde_json::to_string(&p.test_prompts)?)
                .field("max_tokens", &p.test_max_tokens.to_string());
        }
    }
    Ok(k.finish())
}

fn source_file_name(p: &Pipeline) -> String {
    p.gguf
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The AIMET encodings of a part, in its compile entry.
const ENCODINGS: &str = "encodings.json";
/// The GENIE config of a bundle.
pub const GENIE_CONFIG: &str = "genie_config.json";

/// The file name of part `i`'s AIMET encodings in a bundle.
pub fn encodings_file(i: usize) -> String {
    format!("part-{}.encodings.json", i + 1)
}

/// `genie_config.json` of the bundle `m` (see [`handoff`]).
fn genie_config(p: &Pipeline, m: &BundleManifest) -> Result<Vec<u8>> {
    let g = npuc_gguf::GgufFile::open(&p.gguf)?;
    let hp = split::model_hparams(&g)?;
    let id = |k: &str| g.get(k).and_then(|v| v.as_u64());
    let mut eos: Vec<u64> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
    if let Some(e) = id("tokenizer.ggml.eot_token_id") {
        if !eos.contains(&e) {
            eos.push(e);
        }
    }
    let parts = m
        .parts
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let kv = if p.sha {
                format!(
                    "past_key.{{l}}.h{{g}} / past_value.{{l}}.h{{g}} [1, ctx, {}] for l in {}..{}, g in 0..{}",
                    hp.head_dim, r.layers[0], r.layers[1], hp.n_kv_head
                )
            } else {
                format!(
                    "past_key.{{l}} / past_value.{{l}} [{}, ctx, {}] for l in {}..{}",
                    hp.n_kv_head, hp.head_dim, r.layers[0], r.layers[1]
                )
            };
            serde_json::json!({
                "bin": format!("{}_part_{}_of_{}.bin", p.arch, i + 1, m.parts.len()),
                "npuc": r.file,
                "encodings": encodings_file(i),
                "layers": r.layers,
                "graphs": p.ar.iter().flat_map(|&a| p.ctx.iter().map(move |&c| split::graph_name(a, c))).collect::<Vec<_>>(),
                "input": if i == 0 { "input_ids" } else { split::HIDDEN_IN },
                "output": if i + 1 == m.parts.len() { "logits" } else { split::HIDDEN_OUT },
                "kv": kv,
            })
        })
        .collect();
    handoff::genie_config(&handoff::GenieFacts {
        arch: &p.arch,
        vocab: p.vocab,
        n_embd: p.n_embd,
        head_dim: hp.head_dim,
        n_kv_heads: hp.n_kv_head,
        ctx: *p.ctx.last().expect("non-empty"),
        bos: id("tokenizer.ggml.bos_token_id"),
        eos,
        rope_theta: hp.rope_base,
        rope_dim: hp.rope_dims,
        parts,
        ar: &p.ar,
        ctxs: &p.ctx,
        sha: p.sha,
    })
}

/// The file name of part `i` (0-based) in a bundle.
pub fn part_file(i: usize) -> String {
    format!("part-{}.npuc", i + 1)
}

fn read_json(cache: &Cache, kind: &str, rec: &Record, file: &str) -> Result<serde_json::Value> {
    read_json_as(cache, kind, rec, file)
}

/// A JSON output of a cached step, parsed as `T`.
fn read_json_as<T: serde::de::DeserializeOwned>(
    cache: &Cache,
    kind: &str,
    rec: &Record,
    file: &str,
) -> Result<T> {
    let path = cache.entry_dir(kind, &rec.key).join(file);
    let bytes = std::fs::read(&path).with_context(|| format!("reading '{}'", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing '{}'", path.display()))
}

/// A fingerprint of a graph's structure: nodes, inputs, outputs, and the initializers' names,
/// types and shapes (their bytes are the source's, keyed by its hash).
fn graph_fingerprint(m: &npuc_ir::Model) -> String {
    let g = &m.graph;
    let mut k = KeyHasher::new("graph-fingerprint");
    k.field("nodes", &format!("{:?}", g.nodes))
        .field("inputs", &format!("{:?}", g.inputs))
        .field("outputs", &format!("{:?}", g.outputs))
        .field("metadata", &format!("{:?}", m.metadata));
    for i in &g.initializers {
        k.field(
            &i.name,
            &format!("{} {:?}", i.tensor.dtype().name(), i.tensor.shape()),
        );
    }
    k.finish()
}

/// Runs step `s` into a scratch directory and commits it; returns its record and a summary.
fn execute(
    p: &Pipeline,
    cache: &Cache,
    s: &Step,
    key: &str,
    deps: &[Record],
    threads: usize,
) -> Result<(Record, String)> {
    let scratch = cache.scratch()?;
    let dir = scratch.path().to_path_buf();
    let kind = s.kind.name();
    let (names, detail): (Vec<&str>, String) = match &s.kind {
        Kind::Source => {
            let bytes = std::fs::metadata(&p.gguf)?.len();
            let sha = cache::sha256_file(&p.gguf)?;
            let j = serde_json::json!({ "bytes": bytes, "sha256": sha });
            cache::write_synced(&dir.join("source.json"), &serde_json::to_vec_pretty(&j)?)?;
            (
                vec!["source.json"],
                format!(
                    "{} ({:.1} MiB) sha256 {}",
                    source_file_name(p),
                    mib(bytes),
                    &sha[..12]
                ),
            )
        }
        Kind::Graph { part, tokens, ctx } => {
            let (spec, prec) = &p.parts[*part];
            let g = npuc_gguf::GgufFile::open(&p.gguf)?;
            let hp = split::model_hparams(&g)?;
            // The structure only: the interleaved weights' bytes are the compile step's work
            // (repacked there once for all the part's graphs; see `RepackCache::layout_only`).
            let layout = npuc_llm::build::RepackCache::layout_only();
            let m = split::build_part_shared(&g, &hp, spec, *tokens, *ctx, *prec, p.sha, &layout)?;
            // What the runtime will refuse (an op without a kernel) fails here, per graph.
            npuc_runtime::Plan::for_model(&m).map_err(|e| anyhow!("{}: {e}", s.id))?;
            let weight_bytes: u64 = m
                .graph
                .initializers
                .iter()
                .map(|i| (i.tensor.len() * i.tensor.dtype().size()) as u64)
                .sum();
            let io = |v: &[npuc_ir::ValueInfo]| -> Vec<String> {
                v.iter().map(|v| v.name.clone()).collect()
            };
            let j = serde_json::json!({
                "graph": split::graph_name(*tokens, *ctx),
                "part": part + 1,
                "nodes": m.graph.nodes.len(),
                "inputs": io(&m.graph.inputs),
                "outputs": io(&m.graph.outputs),
                "weights": m.graph.initializers.len(),
                "weight_bytes": weight_bytes,
                "fingerprint": graph_fingerprint(&m),
            });
            cache::write_synced(&dir.join("graph.json"), &serde_json::to_vec_pretty(&j)?)?;
            (
                vec!["graph.json"],
                format!(
                    "{} nodes, {} inputs, {:.1} MiB weights",
                    m.graph.nodes.len(),
                    m.graph.inputs.len(),
                    mib(weight_bytes)
                ),
            )
        }
        Kind::Compile { part } => {
            let (spec, prec) = &p.parts[*part];
            // Fingerprints the graph steps recorded, by graph name.
            let mut expected = std::collections::BTreeMap::new();
            for rec in &deps[1..] {
                let j = read_json(cache, "graph", rec, "graph.json")?;
                let name = j["graph"].as_str().unwrap_or_default().to_string();
                let fp = j["fingerprint"].as_str().unwrap_or_default().to_string();
                expected.insert(name, fp);
            }
            let g = npuc_gguf::GgufFile::open(&p.gguf)?;
            let graphs: Vec<(usize, usize)> =
                p.ar.iter()
                    .flat_map(|&a| p.ctx.iter().map(move |&c| (a, c)))
                    .collect();
            // The QNN hand-off: AIMET encodings of the part's weights, taken from its first
            // graph as the compile builds it (every graph of a part holds the same weights).
            let mut encodings = None;
            let mut check = |name: &str, m: &npuc_ir::Model| -> Result<(), String> {
                match expected.get(name) {
                    Some(fp) if *fp == graph_fingerprint(m) => {}
                    Some(_) => return Err("differs from what its graph step built (the GGUF changed during the build?); run the build again".into()),
                    None => return Err("has no graph step".into()),
                }
                if encodings.is_none() {
                    encodings =
                        Some(handoff::part_encodings(m).map_err(|e| format!("encodings: {e}"))?);
                }
                Ok(())
            };
            let out = dir.join("part.npuc");
            let sum =
                npuc_llm::compile::compile_part(&g, spec, &graphs, *prec, p.sha, &out, &mut check)?;
            let j = serde_json::json!({
                "weight_bytes": sum.weight_bytes,
                "file_bytes": sum.file_bytes,
                "graphs": sum.graphs.iter().map(|(n, c)| serde_json::json!({"name": n, "nodes": c})).collect::<Vec<_>>(),
            });
            cache::write_synced(&dir.join("part.json"), &serde_json::to_vec_pretty(&j)?)?;
            let enc = encodings.ok_or_else(|| anyhow!("{}: internal: no graph compiled", s.id))?;
            cache::write_synced(&dir.join(ENCODINGS), enc.as_bytes())?;
            (
                vec!["part.npuc", "part.json", ENCODINGS],
                format!(
                    "layers {}..{}, {} graphs, {:.1} MiB weights, {} precision",
                    spec.layers.start,
                    spec.layers.end,
                    sum.graphs.len(),
                    mib(sum.weight_bytes),
                    prec.name()
                ),
            )
        }
        Kind::Bundle => {
            let src = read_json(cache, "source", &deps[0], "source.json")?;
            let mut parts = vec![];
            for (i, rec) in deps[1..].iter().enumerate() {
                let j = read_json(cache, "compile", rec, "part.json")?;
                let (spec, prec) = &p.parts[i];
                let f = &rec.files["part.npuc"];
                parts.push(PartRecord {
                    file: part_file(i),
                    layers: [spec.layers.start, spec.layers.end],
                    precision: prec.name().into(),
                    weight_bytes: j["weight_bytes"].as_u64().unwrap_or(0),
                    file_bytes: f.bytes,
                    sha256: f.sha256.clone(),
                });
            }
            let m = BundleManifest {
                format: npuc_llm::bundle::FORMAT.into(),
                version: npuc_llm::bundle::VERSION,
                npuc_version: env!("CARGO_PKG_VERSION").into(),
                arch: p.arch.clone(),
                n_layers: p.n_layers,
                n_embd: p.n_embd,
                vocab: p.vocab,
                ar: p.ar.clone(),
                ctx: p.ctx.clone(),
                sha: p.sha,
                max_part_bytes: p.max_part_bytes,
                source: SourceRecord {
                    file: source_file_name(p),
                    bytes: src["bytes"].as_u64().unwrap_or(0),
                    sha256: src["sha256"].as_str().unwrap_or_default().into(),
                    imported_from: p.imported_from.as_ref().map(|o| {
                        o.file_name()
                            .map(|f| f.to_string_lossy().into_owned())
                            .unwrap_or_default()
                    }),
                },
                parts,
                test_prompts: p.test_prompts.clone(),
            };
            let mut json = serde_json::to_vec_pretty(&m)?;
            json.push(b'\n');
            cache::write_synced(&dir.join(MANIFEST), &json)?;
            let genie = genie_config(p, &m)?;
            cache::write_synced(&dir.join(GENIE_CONFIG), &genie)?;
            (
                vec![MANIFEST, GENIE_CONFIG],
                format!("{} parts", m.parts.len()),
            )
        }
        Kind::Verify { stage, part } => {
            let g = npuc_gguf::GgufFile::open(&p.gguf)?;
            let hp = split::model_hparams(&g)?;
            let probe = verify::probe_tokens(&p.gguf, &p.test_prompts)?;
            let graphs = verify::probe_graphs(&p.ar, &p.ctx);
            let c = verify::Ctx {
                g: &g,
                hp: &hp,
                probe: &probe,
                graphs: &graphs,
                threads,
            };
            let rows = match (stage, part) {
                (Stage::Variant, _) => {
                    let mut precisions: Vec<Precision> = p.parts.iter().map(|(_, q)| *q).collect();
                    precisions.dedup();
                    let mut rows = vec![];
                    for q in precisions {
                        rows.extend(verify::check_variant(&c, q)?);
                    }
                    rows
                }
                (Stage::Split, _) => verify::check_split(&c, &p.parts)?,
                (Stage::Sha, Some(i)) => verify::check_sha(&c, &p.parts, *i)?,
                (Stage::Compile, Some(i)) => {
                    let art = cache.entry_dir("compile", &deps[1].key).join("part.npuc");
                    verify::check_compile(&c, &p.parts, *i, p.sha, &art)?
                }
                _ => bail!("{}: internal: a per-part check without a part", s.id),
            };
            verify::enforce(&s.id, &rows)?;
            let f = verify::CheckFile {
                step: s.id.clone(),
                probe_tokens: probe,
                rows,
            };
            cache::write_synced(&dir.join("verify.json"), &serde_json::to_vec_pretty(&f)?)?;
            let worst = f.rows.iter().map(|r| r.max_abs).fold(0f64, f64::max);
            let cos = f.rows.iter().map(|r| r.cosine).fold(1f64, f64::min);
            (
                vec!["verify.json"],
                format!(
                    "{} graph(s) within tolerance: max |diff| {worst:.3e}, min cosine {cos:.6}",
                    f.rows.len()
                ),
            )
        }
        Kind::Check => {
            let n_parts = p.parts.len();
            let detail = check::run(
                p,
                cache,
                &deps[1],
                &deps[2..2 + n_parts],
                &deps[2 + n_parts..],
                &dir.join("check.json"),
            )?;
            (vec!["check.json"], detail)
        }
    };
    let rec = cache.commit(&s.id, kind, key, scratch, &names)?;
    Ok((rec, detail))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// Checks `--force` names against the plan.
fn forced_steps(steps: &[Step], force: &[String]) -> Result<BTreeSet<usize>> {
    let mut set = BTreeSet::new();
    for f in force {
        let hits: Vec<usize> = steps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.id == *f || s.kind.name() == f)
            .map(|(i, _)| i)
            .collect();
        if hits.is_empty() {
            let kinds = "source, graph, compile, bundle, verify, check";
            bail!(
                "--force {f}: no such step; give a kind ({kinds}) or a step id from `npuc build --dry-run` (e.g. {})",
                steps.last().map_or("bundle", |s| s.id.as_str())
            );
        }
        set.extend(hits);
    }
    Ok(set)
}

/// What a step's thread tells the scheduler.
enum Msg {
    /// Step `i` missed the cache (or was forced) and starts its work.
    Started(usize, Status),
    /// Step `i` ended: its record, status, seconds and summary.
    Done(usize, Result<(Record, Status, f64, String)>),
}

/// A part's bytes on the target: (weights = the context binary, weights + KV I/O of its
/// largest graph).
fn part_target_bytes(p: &Pipeline, spec: &PartSpec, weights: u64) -> (u64, u64) {
    let kv: u64 = p.kv_bytes_per_layer[spec.layers.clone()].iter().sum();
    (weights, weights + kv)
}

/// The pre-flight report: each part against the target's per-graph and per-context limits
/// (`[target]`), and, when one is over, the smallest even split by layer count that fits.
pub fn preflight(p: &Pipeline) -> Vec<String> {
    let mut lines = vec![];
    let mut over = false;
    for (i, (spec, _)) in p.parts.iter().enumerate() {
        let (ctx_b, graph_b) = part_target_bytes(p, spec, p.part_bytes[i]);
        let (og, oc) = (graph_b > p.max_graph_bytes, ctx_b > p.max_context_bytes);
        over |= og || oc;
        lines.push(format!(
            "pre-flight part {}: largest graph {:.1} MiB (weights + KV at ctx {}) of max_graph_bytes {:.1} MiB{}; context {:.1} MiB of max_context_bytes {:.1} MiB{}",
            i + 1,
            mib(graph_b),
            p.ctx.last().copied().unwrap_or(0),
            mib(p.max_graph_bytes),
            if og { "  OVER" } else { "" },
            mib(ctx_b),
            mib(p.max_context_bytes),
            if oc { "  OVER" } else { "" },
        ));
    }
    if !over {
        return lines;
    }
    let embedder = p.parts[0].0.is_embedder();
    let decoder_parts = p.parts.len() - usize::from(embedder);
    let proposal = (decoder_parts + 1..=p.n_layers).find_map(|count| {
        let specs = split::split_by_count(p.n_layers, count).ok()?;
        let specs = if embedder {
            split::with_embedder(specs)
        } else {
            specs
        };
        let census = if embedder {
            split::WeightCensus {
                embedding: 0,
                ..p.census.clone()
            }
        } else {
            p.census.clone()
        };
        let fits = specs.iter().all(|s| {
            let w = if s.is_embedder() {
                p.census.embedding
            } else {
                census.part_bytes(s)
            };
            let (c, g) = part_target_bytes(p, s, w);
            c <= p.max_context_bytes && g <= p.max_graph_bytes
        });
        fits.then_some((count, specs))
    });
    match proposal {
        Some((count, specs)) => lines.push(format!(
            "pre-flight: proposed split: split.parts = {count} (layers {})",
            specs
                .iter()
                .filter(|s| !s.is_embedder())
                .map(|s| format!("{}..{}", s.layers.start, s.layers.end))
                .collect::<Vec<_>>()
                .join(", ")
        )),
        None => lines.push(
            "pre-flight: no split by layer count fits the limits (a layer with its KV cache, or the embedding/head, is larger than a graph may be): lower graphs.ctx or raise [target] limits".into(),
        ),
    }
    lines
}

/// Reads and checks the pipeline `file` for `req`, importing an ONNX source first (see
/// [`import`]: cached in `OUT/.cache/import`; a dry run imports into a temporary directory,
/// held by the returned guard until the plan is printed).
pub fn load_pipeline(
    file: &Path,
    req: &BuildRequest,
    line: &mut dyn FnMut(&str),
) -> Result<(Pipeline, Option<tempfile::TempDir>)> {
    let mut keep = None;
    let p = match Pipeline::model_source(file)? {
        pipeline::ModelSource::Gguf(_) => Pipeline::load(file)?,
        pipeline::ModelSource::Onnx {
            onnx,
            tokenizer,
            probe,
        } => {
            let imp = import::import(
                &onnx,
                tokenizer.as_deref(),
                &probe,
                &req.out_dir.join(CACHE_DIR),
                req.dry_run,
                &mut keep,
                line,
            )?;
            Pipeline::load_imported(file, imp.gguf, onnx)?
        }
    };
    Ok((p, keep))
}

/// Runs (or with `dry_run`, plans) the pipeline `p`. `line` gets the progress lines.
pub fn build(p: &Pipeline, req: &BuildRequest, line: &mut dyn FnMut(&str)) -> Result<BuildReport> {
    let t0 = Instant::now();
    let steps = plan(p);
    let forced = forced_steps(&steps, &req.force)?;
    // A dry run only reads the cache: it creates nothing and leaves a running build's scratch
    // directories alone.
    // One build at a time per output directory: a second one fails here, before it touches
    // the cache (whose scratch directories the first one is writing). Held until this
    // function returns; the kernel drops it when a build dies, even by `kill -9`.
    let _lock = if req.dry_run {
        None
    } else {
        Some(lock_out_dir(&req.out_dir)?)
    };
    let cache = if req.dry_run {
        Cache::at(&req.out_dir.join(CACHE_DIR))
    } else {
        Cache::open(&req.out_dir.join(CACHE_DIR))?
    };
    let total = steps.len();
    let mut records: Vec<Option<Record>> = vec![None; total];
    let mut reports: Vec<Option<StepReport>> = vec![None; total];
    for (i, (spec, prec)) in p.parts.iter().enumerate() {
        let over = p.max_part_bytes.is_some_and(|b| p.part_bytes[i] > b);
        line(&format!(
            "part {}/{}: layers {}..{}{}{}, {:.1} MiB of weights, {}{}",
            i + 1,
            p.parts.len(),
            spec.layers.start,
            spec.layers.end,
            if spec.has_embedding() {
                " + embedding"
            } else {
                ""
            },
            if spec.has_head() {
                " + output head"
            } else {
                ""
            },
            mib(p.part_bytes[i]),
            prec.name(),
            if over { "  OVER max_part_bytes" } else { "" }
        ));
    }

    for l in preflight(p) {
        line(&l);
    }

    if req.dry_run {
        // Keys are known as far as the cache reaches; past a step that would run, its
        // dependents' keys depend on what it will produce.
        for (i, s) in steps.iter().enumerate() {
            let deps: Option<Vec<&Record>> = s.deps.iter().map(|&d| records[d].as_ref()).collect();
            let status = match deps {
                Some(deps) => {
                    let key = step_key(p, s, &deps)?;
                    match cache.lookup(s.kind.name(), &key, Verify::Sizes)? {
                        Lookup::Hit(r, _) if !forced.contains(&i) => {
                            records[i] = Some(r);
                            Status::Cached
                        }
                        _ => Status::WouldRun,
                    }
                }
                None => Status::WouldRun,
            };
            let detail = if forced.contains(&i) { "--force" } else { "" };
            line(&format!(
                "[{}/{total}] {:40} {}",
                i + 1,
                s.id,
                status.label()
            ));
            reports[i] = Some(StepReport {
                id: s.id.clone(),
                status,
                seconds: 0.0,
                detail: detail.into(),
            });
        }
        return Ok(BuildReport {
            steps: reports.into_iter().flatten().collect(),
            seconds: t0.elapsed().as_secs_f64(),
            out_dir: req.out_dir.clone(),
            parts: part_summary(p),
            outputs_updated: false,
            sanity: vec![],
        });
    }

    let jobs = req.jobs.max(1);
    // Kernel threads of the steps that run models (the checks).
    let threads = (std::thread::available_parallelism().map_or(1, |n| n.get()) / jobs).max(1);
    let heavy = std::sync::Mutex::new(());
    let verify = if req.verify_cache {
        Verify::Full
    } else {
        Verify::Changed
    };
    let mut started = vec![false; total];
    let mut finished = 0usize;
    let mut failure: Option<anyhow::Error> = None;
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel::<Msg>();
        let mut running = 0usize;
        loop {
            // Start every ready step, up to `jobs` at once (none after a failure).
            while failure.is_none() && running < jobs {
                let Some(i) = (0..total)
                    .find(|&i| !started[i] && steps[i].deps.iter().all(|&d| records[d].is_some()))
                else {
                    break;
                };
                started[i] = true;
                running += 1;
                let deps: Vec<Record> = steps[i]
                    .deps
                    .iter()
                    .map(|&d| records[d].clone().expect("ready"))
                    .collect();
                let (s, cache, tx, force) = (&steps[i], &cache, tx.clone(), forced.contains(&i));
                let heavy = &heavy;
                scope.spawn(move || {
                    let t = Instant::now();
                    // A panicking step reports as a failed one: the loop below waits for every
                    // started step's message, so a thread that died silently would hang the build.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let dep_refs: Vec<&Record> = deps.iter().collect();
                        let key = step_key(p, s, &dep_refs)?;
                        let kind = s.kind.name();
                        let status = if force {
                            cache.remove(kind, &key)?;
                            Status::Forced
                        } else {
                            match cache.lookup(kind, &key, verify)? {
                                Lookup::Hit(r, hashed) => {
                                    let detail = format!(
                                        "{} file(s) verified ({hashed} hashed, {} unchanged since hashed)",
                                        r.files.len(),
                                        r.files.len() - hashed
                                    );
                                    return Ok((
                                        r,
                                        Status::Cached,
                                        t.elapsed().as_secs_f64(),
                                        detail,
                                    ));
                                }
                                Lookup::Miss => Status::Ran,
                                Lookup::Corrupt(why) => {
                                    cache.remove(kind, &key)?;
                                    Status::Rebuilt(why)
                                }
                            }
                        };
                        // Steps that hold a part's weights or run models take turns (peak
                        // memory: one of them at a time, plus the light graph steps).
                        let _turn = s
                            .kind
                            .heavy()
                            .then(|| heavy.lock().unwrap_or_else(|e| e.into_inner()));
                        let _ = tx.send(Msg::Started(i, status.clone()));
                        let (r, detail) = execute(p, cache, s, &key, &deps, threads)
                            .with_context(|| format!("step {}", s.id))?;
                        Ok((r, status, t.elapsed().as_secs_f64(), detail))
                    }))
                    .unwrap_or_else(|_| {
                        Err(anyhow!("step {}: internal error (the step panicked)", s.id))
                    });
                    let _ = tx.send(Msg::Done(i, r));
                });
            }
            if running == 0 {
                break;
            }
            let (i, r) = match rx.recv().expect("a running step reports") {
                Msg::Started(i, status) => {
                    if let Status::Rebuilt(why) = &status {
                        line(&format!(
                            "{}: cache entry corrupt ({why}); rebuilding",
                            steps[i].id
                        ));
                    }
                    line(&format!(
                        "  {:40} started  at {:6.2}s{}",
                        steps[i].id,
                        t0.elapsed().as_secs_f64(),
                        if status == Status::Forced {
                            " (--force)"
                        } else {
                            ""
                        }
                    ));
                    continue;
                }
                Msg::Done(i, r) => (i, r),
            };
            running -= 1;
            finished += 1;
            match r {
                Ok((rec, status, secs, detail)) => {
                    line(&format!(
                        "[{finished}/{total}] {:40} {:8} {secs:7.2}s  (at {:6.2}s)  {detail}",
                        steps[i].id,
                        status.label().split(' ').next().unwrap_or(""),
                        t0.elapsed().as_secs_f64(),
                    ));
                    records[i] = Some(rec);
                    reports[i] = Some(StepReport {
                        id: steps[i].id.clone(),
                        status,
                        seconds: secs,
                        detail,
                    });
                }
                Err(e) => {
                    line(&format!("[{finished}/{total}] {:40} FAILED", steps[i].id));
                    failure.get_or_insert(e);
                }
            }
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    let bundle_rec = steps
        .iter()
        .zip(&records)
        .find(|(s, _)| matches!(s.kind, Kind::Bundle))
        .and_then(|(_, r)| r.clone())
        .expect("bundle step done");
    let compile_recs: Vec<Record> = steps
        .iter()
        .zip(&records)
        .filter(|(s, _)| matches!(s.kind, Kind::Compile { .. }))
        .map(|(_, r)| r.clone().expect("done"))
        .collect();
    let check_rec = steps
        .iter()
        .zip(&records)
        .find(|(s, _)| matches!(s.kind, Kind::Check))
        .and_then(|(_, r)| r.clone());
    let updated = materialize(
        &cache,
        &req.out_dir,
        &compile_recs,
        &bundle_rec,
        check_rec.as_ref(),
    )?;
    let mut sanity = vec![];
    for (s, r) in steps.iter().zip(&records) {
        if let (Kind::Verify { .. }, Some(r)) = (&s.kind, r) {
            let f: verify::CheckFile = read_json_as(&cache, "verify", r, "verify.json")?;
            sanity.extend(f.rows);
        }
    }
    let report = BuildReport {
        steps: reports.into_iter().flatten().collect(),
        seconds: t0.elapsed().as_secs_f64(),
        out_dir: req.out_dir.clone(),
        parts: part_summary(p),
        outputs_updated: updated,
        sanity,
    };
    if report.ran() == 0 {
        line(&format!(
            "nothing to do: all {total} steps cached{}",
            if updated {
                " (output directory refreshed)"
            } else {
                ""
            }
        ));
    }
    Ok(report)
}

/// The lock file of an output directory.
pub const LOCK_FILE: &str = ".npuc-build.lock";

/// Takes the exclusive lock of `out` (creating the directory), or fails saying another build
/// holds it.
pub fn lock_out_dir(out: &Path) -> Result<std::fs::File> {
    std::fs::create_dir_all(out)
        .with_context(|| format!("creating the output directory '{}'", out.display()))?;
    let path = out.join(LOCK_FILE);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening the lock file '{}'", path.display()))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "'{}' is in use by another `npuc build` (it holds '{}'); wait for it to finish or build into another directory (-o)",
            out.display(),
            path.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking '{}'", path.display()))
        }
    }
}

fn part_summary(p: &Pipeline) -> Vec<(String, [usize; 2], u64, bool)> {
    p.parts
        .iter()
        .enumerate()
        .map(|(i, (s, _))| {
            (
                part_file(i),
                [s.layers.start, s.layers.end],
                p.part_bytes[i],
                p.max_part_bytes.is_some_and(|b| p.part_bytes[i] > b),
            )
        })
        .collect()
}

/// Links the finished outputs into `out` (`part-{i}.npuc`, `bundle.json`, `check.json`); each
/// replaces its
/// destination atomically. Stale part files of an earlier build with more parts are removed.
/// Returns whether anything changed.
fn materialize(
    cache: &Cache,
    out: &Path,
    parts: &[Record],
    bundle: &Record,
    check: Option<&Record>,
) -> Result<bool> {
    let mut changed = false;
    let mut wanted = vec![];
    // Links an entry's file into `out`, keeping the entry's stamp current (a new link
    // changes the file's ctime).
    let link = |kind: &str, key: &str, name: &str, dest: &Path| -> Result<bool> {
        let src = cache.entry_dir(kind, key).join(name);
        cache.keeping_stamp(kind, key, name, || link_into(&src, dest))
    };
    for (i, rec) in parts.iter().enumerate() {
        changed |= link("compile", &rec.key, "part.npuc", &out.join(part_file(i)))?;
        wanted.push(part_file(i));
        changed |= link("compile", &rec.key, ENCODINGS, &out.join(encodings_file(i)))?;
        wanted.push(encodings_file(i));
    }
    for f in [MANIFEST, GENIE_CONFIG] {
        changed |= link("bundle", &bundle.key, f, &out.join(f))?;
    }
    let check_file = out.join("check.json");
    match check {
        Some(rec) => {
            changed |= link("check", &rec.key, "check.json", &check_file)?;
        }
        None if check_file.exists() => {
            std::fs::remove_file(&check_file)?;
            changed = true;
        }
        None => {}
    }
    for e in std::fs::read_dir(out)? {
        let name = e?.file_name().to_string_lossy().into_owned();
        let ours = name.ends_with(".npuc") || name.ends_with(".encodings.json");
        if name.starts_with("part-") && ours && !wanted.contains(&name) {
            std::fs::remove_file(out.join(&name))?;
            changed = true;
        }
    }
    if changed {
        cache::sync_dir(out);
    }
    Ok(changed)
}

/// Makes `dest` the file `src` (a hard link, else a copy), unless it already is.
pub fn link_into(src: &Path, dest: &Path) -> Result<bool> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(a), Ok(b)) = (std::fs::metadata(src), std::fs::metadata(dest)) {
            if a.dev() == b.dev() && a.ino() == b.ino() {
                return Ok(false);
            }
        }
    }
    let dir = dest.parent().expect("inside the output directory");
    let name = dest.file_name().expect("a file").to_string_lossy();
    let tmp = dir.join(format!(".{name}.tmp-link"));
    let _ = std::fs::remove_file(&tmp);
    if std::fs::hard_link(src, &tmp).is_err() {
        std::fs::copy(src, &tmp)
            .with_context(|| format!("copying '{}' to '{}'", src.display(), tmp.display()))?;
    }
    std::fs::rename(&tmp, dest)
        .with_context(|| format!("moving '{}' to '{}'", tmp.display(), dest.display()))?;
    Ok(true)
}
