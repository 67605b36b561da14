//! Mutation fuzzing, one target per loader and per CLI entry (issue 19 item 5), seeded with the
//! real models in the data cache. The harness is `npuc_testsupport::fuzz` (stable toolchain,
//! deterministic seeds); each target runs for `NPUC_FUZZ_SECONDS` (default 3 s), so CI runs all
//! of them in about a minute and a long local run is
//! `NPUC_FUZZ_SECONDS=600 cargo test --release -p npuc-cli --test fuzz -- --nocapture`.
//!
//! Library targets run in this process (a panic is a failure; sizes are judged against a 2 GiB
//! `--max-memory` so a mutated size is refused, not allocated). CLI targets run the real binary
//! on garbled flag values and argument combinations, each call bounded in wall-clock time: an exit
//! by a signal, code 101, "panicked at" or a run past the bound is a failure. Each failure prints
//! the target, the case's seed and a saved reproducer (the input file, or the command line).

use npuc_gguf::{GgufFile, MetaValue};
use npuc_ir::{Attr, Dim, Model, Tensor, TypeInfo};
use npuc_runtime::{Session, SessionOptions, Value};
use npuc_testsupport::fuzz::{
    check_exit, fuzz, mutate_bytes, mutate_text, run_bounded, shell_line, Case, Rng, Verdict,
    HOSTILE_VALUES, INTERESTING,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Once, OnceLock};
use std::time::Duration;

/// Cases every target runs at least, whatever the budget.
const MIN_CASES: u64 = 4;

/// In-process work is judged against this budget (mutated sizes are refused, not allocated).
fn init() {
    static I: Once = Once::new();
    I.call_once(|| {
        npuc_cli::register_ops();
        npuc_runtime::limits::set_max_memory(Some(2 << 30));
    });
}

fn verdict<T, E>(r: &Result<T, E>) -> Verdict {
    if r.is_ok() {
        Verdict::Accepted
    } else {
        Verdict::Rejected
    }
}

// ---------------------------------------------------------------------------------------------
// Seeds: the real models of the cache (each fails naming `scripts/fetch-data.sh NAME` if absent).

fn onnx_seeds() -> Vec<PathBuf> {
    vec![
        npuc_testsupport::model("tinyocr-ppocrv6", "PP-OCRv6_rec_tiny.onnx"),
        npuc_testsupport::model("tinyocr-ppocrv6", "PP-OCRv6_det_tiny.onnx"),
        npuc_testsupport::model("ppocrv5", "ppocrv5_cls.onnx"),
        npuc_testsupport::model("arabic-name-romanizer", "encoder.onnx"),
        npuc_testsupport::model("text2tashkeel", "bilstm.int8.onnx"),
    ]
}

fn rec_tiny() -> PathBuf {
    npuc_testsupport::model("tinyocr-ppocrv6", "PP-OCRv6_rec_tiny.onnx")
}

fn gguf_seeds() -> Vec<PathBuf> {
    vec![
        npuc_testsupport::smollm2_gguf(),
        npuc_testsupport::gemma3_gguf(),
    ]
}

fn quant_data(rel: &str) -> PathBuf {
    npuc_testsupport::cached(
        &format!("quant-data/{rel}"),
        "scripts/fetch-data.sh quant-data",
    )
}

/// Zero inputs for `m`, symbolic dims bound small (batch 1, others 32); `None` when an input
/// has no usable type or would be large.
fn zero_feeds(m: &Model) -> Option<Vec<(String, Value)>> {
    let inits: std::collections::HashSet<&str> = m
        .graph
        .initializers
        .iter()
        .map(|i| i.name.as_str())
        .collect();
    let mut feeds = vec![];
    for vi in m
        .graph
        .inputs
        .iter()
        .filter(|v| !inits.contains(v.name.as_str()))
    {
        let Some(TypeInfo::Tensor {
            dtype: Some(dt),
            shape: Some(shape),
        }) = &vi.ty
        else {
            return None;
        };
        let dims: Vec<usize> = shape
            .iter()
            .enumerate()
            .map(|(i, d)| match d {
                Dim::Fixed(n) => *n,
                _ if i == 0 => 1,
                _ => 32,
            })
            .collect();
        if dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))? > 1 << 20 {
            return None;
        }
        feeds.push((vi.name.clone(), Value::tensor(Tensor::zeros(*dt, dims))));
    }
    Some(feeds)
}

/// Infers shapes, plans and runs `m` on zero inputs: every step may fail, none may panic.
fn exercise(m: &Model) -> Verdict {
    let _ = npuc_ir::infer::infer_model(m, &HashMap::new());
    let Ok(s) = Session::new(m, SessionOptions { threads: 1 }) else {
        return Verdict::Rejected;
    };
    match zero_feeds(m) {
        Some(f) => verdict(&s.run(f)),
        None => Verdict::Rejected,
    }
}

/// A region of a file to mutate: mostly its head (where formats keep their structure), else
/// its tail or anywhere.
fn region(rng: &mut Rng, len: usize, head: usize) -> std::ops::Range<usize> {
    match rng.below(10) {
        0..=5 => 0..head.min(len),
        6..=7 => len.saturating_sub(head)..len,
        _ => 0..len,
    }
}

fn mutated(rng: &mut Rng, orig: &[u8], head: usize) -> Vec<u8> {
    let mut b = orig.to_vec();
    for _ in 0..1 + rng.below(3) {
        let r = region(rng, b.len(), head);
        let grow = rng.one_in(3);
        mutate_bytes(rng, &mut b, r, grow);
    }
    b
}

// ---------------------------------------------------------------------------------------------
// ONNX: the protobuf, a graph's attributes and wiring, external data.

/// One structural mutation of a graph: an attribute set to a hostile value, an initializer's
/// shape changed, an input renamed or dropped, a node removed or its op renamed.
fn mutate_graph(rng: &mut Rng, m: &mut Model) {
    let g = &mut m.graph;
    if g.nodes.is_empty() {
        return;
    }
    let k = rng.below(g.nodes.len());
    let hostile_int = |rng: &mut Rng| {
        let v = *rng.pick(INTERESTING) as i64;
        if rng.one_in(3) {
            v.wrapping_neg()
        } else {
            v
        }
    };
    match rng.below(7) {
        0..=2 => {
            let n = &mut g.nodes[k];
            if n.attrs.is_empty() {
                n.attrs.push(("axis".into(), Attr::Int(hostile_int(rng))));
                return;
            }
            let j = rng.below(n.attrs.len());
            let a = &mut n.attrs[j].1;
            match a {
                Attr::Int(v) => *v = hostile_int(rng),
                Attr::Float(f) => *f = *rng.pick(&[f32::NAN, f32::INFINITY, -1.0, 0.0, 1e30]),
                Attr::Ints(v) => match rng.below(3) {
                    0 if !v.is_empty() => {
                        let i = rng.below(v.len());
                        v[i] = hostile_int(rng);
                    }
                    1 => v.truncate(rng.below(v.len() + 1)),
                    _ => v.push(hostile_int(rng)),
                },
                Attr::String(s) => *s = rng.pick(&["", "nope", "\u{fffd}"]).to_string(),
                _ => *a = Attr::Int(hostile_int(rng)),
            }
        }
        3 => {
            if g.initializers.is_empty() {
                return;
            }
            let i = rng.below(g.initializers.len());
            let t = &g.initializers[i].tensor;
            let mut shape = t.shape().to_vec();
            match rng.below(3) {
                0 => shape.push(1),
                1 => {
                    shape.pop();
                }
                _ => shape.reverse(),
            }
            // Same element count (a reshape) or an empty tensor of the new rank.
            let n: usize = shape.iter().product();
            let nt = if n == t.len() {
                t.clone().reshaped(shape)
            } else {
                Ok(Tensor::zeros(t.dtype(), vec![0; shape.len()]))
            };
            if let Ok(nt) = nt {
                g.initializers[i].tensor = nt;
            }
        }
        4 => {
            let n = &mut g.nodes[k];
            if !n.inputs.is_empty() {
                let i = rng.below(n.inputs.len());
                if rng.one_in(2) {
                    n.inputs[i] = String::new();
                } else {
                    n.inputs.truncate(i);
                }
            }
        }
        5 => {
            g.nodes.remove(k);
        }
        _ => {
            let n = &mut g.nodes[k];
            n.op_type = rng
                .pick(&[
                    "Reshape", "Gather", "Concat", "Slice", "Expand", "Tile", "Resize",
                ])
                .to_string();
        }
    }
}

#[test]
fn fuzz_onnx_protobuf() {
    init();
    let seeds: Vec<(PathBuf, Vec<u8>)> = onnx_seeds()
        .into_iter()
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    fuzz(
        "onnx-protobuf",
        MIN_CASES,
        |rng, _| {
            let (_, orig) = rng.pick(&seeds);
            Case {
                input: mutated(rng, orig, 64 << 10),
                ext: "onnx",
                data: (),
            }
        },
        |c| {
            let Ok(m) = npuc_onnx::load_model_bytes(c.input.clone(), Path::new("fuzz.onnx")) else {
                return Ok(Verdict::Rejected);
            };
            Ok(exercise(&m))
        },
    )
    .assert_clean("onnx-protobuf");
}

#[test]
fn fuzz_onnx_graph() {
    init();
    let seeds: Vec<Model> = onnx_seeds()
        .iter()
        .map(|p| npuc_onnx::load_model(p).unwrap())
        .collect();
    fuzz(
        "onnx-graph",
        MIN_CASES,
        |rng, _| {
            let mut m = rng.pick(&seeds).clone();
            for _ in 0..1 + rng.below(3) {
                mutate_graph(rng, &mut m);
            }
            // The reproducer is the mutated model as ONNX (weights inline).
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("m.onnx");
            let input = npuc_onnx::save_model(&m, &p, &Default::default())
                .ok()
                .and_then(|_| std::fs::read(&p).ok())
                .unwrap_or_default();
            Case {
                input,
                ext: "onnx",
                data: m,
            }
        },
        |c| Ok(exercise(&c.data)),
    )
    .assert_clean("onnx-graph");
}

/// The inputs of a suite test's first data set, as the model declares them.
fn suite_feeds(dir: &Path, m: &Model) -> Vec<(String, Value)> {
    let mut feeds = vec![];
    for (i, vi) in m.graph.inputs.iter().enumerate() {
        let p = dir.join(format!("test_data_set_0/input_{i}.pb"));
        if let Ok(npuc_onnx::PbValue::Tensor(t)) = npuc_onnx::load_value_pb(&p, vi.ty.as_ref()) {
            feeds.push((vi.name.clone(), Value::tensor(t)));
        }
    }
    feeds
}

#[test]
fn fuzz_onnx_graph_suite_ops() {
    init();
    // Every 8th node test of the ONNX backend suite (about 200 ops and attribute sets) with its
    // own inputs: attribute values reach each kernel's checks.
    let root = npuc_testsupport::onnx_suite().join("node");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    dirs.sort();
    let seeds: Vec<(Model, Vec<(String, Value)>)> = dirs
        .iter()
        .step_by(8)
        .filter_map(|d| {
            let m = npuc_onnx::load_model(&d.join("model.onnx")).ok()?;
            let f = suite_feeds(d, &m);
            Some((m, f))
        })
        .collect();
    assert!(seeds.len() > 100, "only {} suite models", seeds.len());
    fuzz(
        "onnx-graph-suite",
        MIN_CASES,
        |rng, _| {
            let k = rng.below(seeds.len());
            let mut m = seeds[k].0.clone();
            for _ in 0..1 + rng.below(2) {
                mutate_graph(rng, &mut m);
            }
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("m.onnx");
            let input = npuc_onnx::save_model(&m, &p, &Default::default())
                .ok()
                .and_then(|_| std::fs::read(&p).ok())
                .unwrap_or_default();
            Case {
                input,
                ext: "onnx",
                data: (m, k),
            }
        },
        |c| {
            let (m, k) = &c.data;
            let _ = npuc_ir::infer::infer_model(m, &HashMap::new());
            let Ok(s) = Session::new(m, SessionOptions { threads: 1 }) else {
                return Ok(Verdict::Rejected);
            };
            Ok(verdict(&s.run(seeds[*k].1.clone())))
        },
    )
    .assert_clean("onnx-graph-suite");
}

#[test]
fn fuzz_onnx_external_data() {
    init();
    let dir = tempfile::tempdir().unwrap();
    let m = npuc_onnx::load_model(&rec_tiny()).unwrap();
    let p = dir.path().join("m.onnx");
    npuc_onnx::save_model(
        &m,
        &p,
        &npuc_onnx::ExportOptions {
            external_threshold: Some(1024),
        },
    )
    .unwrap();
    let proto = std::fs::read(&p).unwrap();
    let data = std::fs::read(dir.path().join("m.onnx.data")).unwrap();
    fuzz(
        "onnx-external-data",
        MIN_CASES,
        |rng, _| {
            // The protobuf (locations, offsets, lengths), the data file, or both.
            let which = rng.below(3);
            let pb = if which != 1 {
                mutated(rng, &proto, proto.len())
            } else {
                proto.clone()
            };
            let mut d = data.clone();
            if which != 0 {
                let len = d.len();
                mutate_bytes(rng, &mut d, 0..len, true);
                if rng.one_in(2) {
                    d.truncate(rng.below(len));
                }
            }
            Case {
                input: pb,
                ext: "onnx",
                data: d,
            }
        },
        |c| {
            let case = tempfile::tempdir().unwrap();
            let p = case.path().join("m.onnx");
            std::fs::write(&p, &c.input).unwrap();
            std::fs::write(case.path().join("m.onnx.data"), &c.data).unwrap();
            let Ok(m) = npuc_onnx::load_model(&p) else {
                return Ok(Verdict::Rejected);
            };
            Ok(exercise(&m))
        },
    )
    .assert_clean("onnx-external-data");
}

// ---------------------------------------------------------------------------------------------
// GGUF: header, metadata and tensor table of the real SmolLM2 / Gemma 3 files.

struct GgufSeed {
    name: String,
    /// The file's length: the case's buffer has it, zero-filled past the header.
    len: usize,
    /// The header (metadata and tensor table) and the first 4 KiB of tensor data.
    head: Vec<u8>,
}

fn gguf_seed(p: &Path) -> GgufSeed {
    let g = GgufFile::open(p).unwrap();
    let len = std::fs::metadata(p).unwrap().len() as usize;
    let n = (g.data_offset as usize + 4096).min(len);
    let mut head = vec![0u8; n];
    use std::io::Read;
    std::fs::File::open(p)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    GgufSeed {
        name: p.display().to_string(),
        len,
        head,
    }
}

/// Everything read from a GGUF's metadata: the tokenizer (and a round trip through it) and the
/// LLM hyper-parameters.
fn exercise_gguf(g: &GgufFile) -> Verdict {
    let hp = npuc_llm::build::hparams(g);
    let tok = npuc_tokenizer::Tokenizer::from_gguf(g);
    if let Ok(t) = &tok {
        exercise_tokenizer(t);
    }
    if hp.is_ok() && tok.is_ok() {
        Verdict::Accepted
    } else {
        Verdict::Rejected
    }
}

fn exercise_tokenizer(t: &npuc_tokenizer::Tokenizer) {
    for text in ["Hello, world! 123", "  ü✓ <s></s>\n\t", ""] {
        if let Ok(ids) = t.encode(text, true) {
            let _ = t.decode(&ids);
        }
    }
    let n = t.vocab_size() as u32;
    let _ = t.decode(&[0, n.saturating_sub(1), n, u32::MAX]);
    let _ = t.token_bytes(u32::MAX);
    let msgs = [npuc_tokenizer::ChatMessage {
        role: "user".into(),
        content: "Hi".into(),
    }];
    let _ = t.apply_chat_template(&msgs, true);
}

#[test]
fn fuzz_gguf_header() {
    init();
    let seeds: Vec<GgufSeed> = gguf_seeds().iter().map(|p| gguf_seed(p)).collect();
    fuzz(
        "gguf-header",
        MIN_CASES,
        |rng, _| {
            let s = rng.pick(&seeds);
            let mut head = s.head.clone();
            // Mostly the first 64 KiB (magic, counts, the first keys and their lengths).
            for _ in 0..1 + rng.below(4) {
                let r = if rng.one_in(3) {
                    0..head.len()
                } else {
                    0..(64 << 10).min(head.len())
                };
                let grow = rng.one_in(4);
                mutate_bytes(rng, &mut head, r, grow);
            }
            let total = (s.len as isize + head.len() as isize - s.head.len() as isize).max(0);
            Case {
                input: head,
                ext: "gguf-head",
                data: (s.name.clone(), total as usize),
            }
        },
        |c| {
            // Zero-filled to the file's length: the untouched tensor data costs no memory.
            let mut b = vec![0u8; c.data.1.max(c.input.len())];
            b[..c.input.len()].copy_from_slice(&c.input);
            match GgufFile::from_bytes(c.data.0.clone(), b) {
                Ok(g) => Ok(exercise_gguf(&g)),
                Err(_) => Ok(Verdict::Rejected),
            }
        },
    )
    .assert_clean("gguf-header");
}

/// One mutation of a metadata list: a `tokenizer.*` or hyper-parameter key removed, retyped,
/// set to a hostile number, its array truncated or an element replaced, its string garbled.
fn mutate_meta(
    rng: &mut Rng,
    meta: &mut Vec<(String, MetaValue)>,
    which: impl Fn(&str) -> bool,
) -> String {
    let keys: Vec<usize> = (0..meta.len()).filter(|&i| which(&meta[i].0)).collect();
    if keys.is_empty() {
        return String::new();
    }
    let i = *rng.pick(&keys);
    let key = meta[i].0.clone();
    let int = |rng: &mut Rng| *rng.pick(INTERESTING);
    let v = &mut meta[i].1;
    let what = rng.below(6);
    match what {
        0 => {
            meta.remove(i);
        }
        1 => {
            *v = match rng.below(5) {
                0 => MetaValue::U32(int(rng) as u32),
                1 => MetaValue::I32(int(rng) as i32),
                2 => MetaValue::U64(int(rng)),
                3 => MetaValue::F32(*rng.pick(&[f32::NAN, -1.0, 1e30])),
                _ => MetaValue::String(rng.pick(HOSTILE_VALUES).to_string()),
            }
        }
        2 => {
            if let MetaValue::Array(_, a) = v {
                let n = rng.below(a.len() + 1);
                a.truncate(n);
            } else {
                *v = MetaValue::Array(npuc_gguf::ValueType::U32, vec![]);
            }
        }
        3 => {
            if let MetaValue::Array(_, a) = v {
                if !a.is_empty() {
                    let j = rng.below(a.len());
                    a[j] = match &a[j] {
                        MetaValue::String(s) => MetaValue::String(mutate_text(rng, s)),
                        MetaValue::F32(_) => MetaValue::F32(f32::NAN),
                        _ => MetaValue::I32(-(int(rng) as i32).abs().max(1)),
                    };
                }
            }
        }
        4 => {
            if let MetaValue::String(s) = v {
                *s = mutate_text(rng, s);
            } else if let Some(x) = v.as_u64() {
                *v = MetaValue::U64(x.wrapping_mul(int(rng)).wrapping_add(int(rng)));
            }
        }
        _ => {
            let j = *rng.pick(&keys);
            let other = meta[j].1.clone();
            meta[i].1 = other;
        }
    }
    // What the reproducer records: the key, the kind of change and the new value (short).
    let now = meta
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| match v {
            MetaValue::Array(t, a) => format!("array of {} {t:?}", a.len()),
            v => format!("{v:?}").chars().take(200).collect(),
        })
        .unwrap_or_else(|| "removed".into());
    format!("{key}: change {what} -> {now}\n")
}

#[test]
fn fuzz_tokenizer_from_gguf_metadata() {
    init();
    let seeds: Vec<Vec<(String, MetaValue)>> = gguf_seeds()
        .iter()
        .chain([npuc_testsupport::qwen25_coder_gguf()].iter())
        .map(|p| GgufFile::open(p).unwrap().metadata)
        .collect();
    fuzz(
        "tokenizer-gguf",
        MIN_CASES,
        |rng, _| {
            let k = rng.below(seeds.len());
            let mut m = seeds[k].clone();
            // The reproducer: which seed and what changed (the case replays from its seed).
            let mut input = format!("seed model {k}\n");
            for _ in 0..1 + rng.below(3) {
                input += &mutate_meta(rng, &mut m, |k| {
                    k.starts_with("tokenizer.") || k.contains("count") || k.contains("length")
                });
            }
            Case {
                input: input.into_bytes(),
                ext: "txt",
                data: m,
            }
        },
        |c| match npuc_tokenizer::Tokenizer::from_metadata(&c.data) {
            Ok(t) => {
                exercise_tokenizer(&t);
                Ok(Verdict::Accepted)
            }
            Err(_) => Ok(Verdict::Rejected),
        },
    )
    .assert_clean("tokenizer-gguf");
}

/// One mutation of a GGUF's tensor table: a tensor's dims swapped, grown or shrunk, or one
/// dropped (its data stays as it was: the loader must notice the mismatch).
/// A tensor of a GGUF held in memory: name, type, GGML dims, bytes.
type TensorRow = (String, npuc_ir::GgmlType, Vec<u64>, Vec<u8>);

/// A GGUF's metadata, in file order.
type Meta = Vec<(String, MetaValue)>;

fn mutate_tensors(rng: &mut Rng, t: &mut Vec<TensorRow>) -> String {
    if t.is_empty() {
        return String::new();
    }
    let i = rng.below(t.len());
    let name = t[i].0.clone();
    match rng.below(4) {
        0 => {
            t[i].2.reverse();
        }
        1 => {
            let d = rng.below(t[i].2.len().max(1));
            if let Some(x) = t[i].2.get_mut(d) {
                *x = *rng.pick(&[0, 1, 2, *x * 2, 1 << 32]);
            }
        }
        2 => t[i].2.push(1),
        _ => {
            t.remove(i);
        }
    }
    format!("tensor {name}: change\n")
}

#[test]
fn fuzz_llm_engine_from_gguf() {
    init();
    // The committed tiny llama / qwen2 models (real GGUF layouts, a few hundred KB): each case
    // builds the LLM graphs and runs a forward step, so hyper-parameters reach the kernels.
    let seeds: Vec<(Meta, Vec<TensorRow>)> = [
        "llm/tiny-llama3/tiny-llama3-Q4_0.gguf",
        "llm/tiny-qwen2/tiny-qwen2-Q4_K.gguf",
    ]
    .iter()
    .map(|f| {
        let g = GgufFile::open(npuc_testsupport::fixture(f)).unwrap();
        let t = g
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.ggml_type,
                    t.dims.clone(),
                    g.tensor_bytes(t).to_vec(),
                )
            })
            .collect();
        (g.metadata.clone(), t)
    })
    .collect();
    let work = tempfile::tempdir().unwrap();
    fuzz(
        "llm-engine",
        MIN_CASES,
        |rng, _| {
            let k = rng.below(seeds.len());
            let (mut meta, mut tensors) = seeds[k].clone();
            let mut what = format!("seed model {k}\n");
            for _ in 0..1 + rng.below(2) {
                if rng.one_in(4) {
                    what += &mutate_tensors(rng, &mut tensors);
                } else {
                    what += &mutate_meta(rng, &mut meta, |k| !k.starts_with("general.name"));
                }
            }
            let wt: Vec<npuc_gguf::write::WriteTensor> = tensors
                .iter()
                .map(|(n, ty, d, b)| npuc_gguf::write::WriteTensor {
                    name: n.clone(),
                    ggml_type: *ty,
                    dims: d.clone(),
                    data: b,
                })
                .collect();
            // A file the writer refuses is still a case: the mutated metadata with no tensors.
            let bytes = npuc_gguf::write::to_bytes(&meta, &wt)
                .or_else(|_| npuc_gguf::write::to_bytes(&meta, &[]))
                .unwrap_or_default();
            Case {
                input: bytes,
                ext: "gguf",
                data: what,
            }
        },
        |c| {
            let p = work.path().join("m.gguf");
            std::fs::write(&p, &c.input).unwrap();
            let opts = npuc_llm::EngineOptions {
                threads: 1,
                ctx: Some(64),
                variants: vec![npuc_llm::Variant::Ar(1), npuc_llm::Variant::Ar(4)],
                precision: npuc_llm::Precision::Fast,
                weight_quant: Default::default(),
            };
            let Ok(mut e) = npuc_llm::Engine::from_gguf(&p, &opts) else {
                return Ok(Verdict::Rejected);
            };
            let v = e.vocab() as u32;
            let r = e.forward(&[1, 2, v.saturating_sub(1)], false);
            // An id past the vocabulary is an error, never an out-of-bounds read.
            let _ = e.forward(&[v], false);
            Ok(verdict(&r))
        },
    )
    .assert_clean("llm-engine");
}

// ---------------------------------------------------------------------------------------------
// .npuc artifacts, .npy files, calibration images.

fn compiled_rec() -> &'static Vec<u8> {
    static A: OnceLock<Vec<u8>> = OnceLock::new();
    A.get_or_init(|| {
        init();
        let opts = npuc_driver::compile::CompileOptions {
            input_shapes: [("x".to_string(), vec![1, 3, 48, 64])].into(),
            ..Default::default()
        };
        npuc_driver::compile::compile_to_bytes(
            &[("rec".into(), rec_tiny())],
            &opts,
            &mut |_: &str| {},
        )
        .unwrap()
        .0
    })
}

#[test]
fn fuzz_artifact() {
    let orig = compiled_rec();
    fuzz(
        "npuc-artifact",
        MIN_CASES,
        |rng, _| Case {
            input: mutated(rng, orig, 8 << 10),
            ext: "npuc",
            data: (),
        },
        |c| {
            let Ok(a) = npuc_format::Artifact::from_bytes(Path::new("fuzz.npuc"), c.input.clone())
            else {
                return Ok(Verdict::Rejected);
            };
            let Ok(mut m) = a.model(None) else {
                return Ok(Verdict::Rejected);
            };
            if npuc_driver::quantized::prepare(&mut m, false).is_err() {
                return Ok(Verdict::Rejected);
            }
            Ok(exercise(&m))
        },
    )
    .assert_clean("npuc-artifact");
}

#[test]
fn fuzz_npy() {
    let mut seeds = vec![
        quant_data("ocr/calib/x_000.npy"),
        quant_data("vit/calib/input_image_000.npy"),
    ];
    for f in ["mlp_w8a8/input_0.npy", "mlp_w8a8/ort_0.npy"] {
        seeds.push(npuc_testsupport::fixture(&format!("quant/{f}")));
    }
    let seeds: Vec<Vec<u8>> = seeds.iter().map(|p| std::fs::read(p).unwrap()).collect();
    fuzz(
        "npy",
        MIN_CASES,
        |rng, _| Case {
            input: {
                let o = rng.pick(&seeds);
                mutated(rng, o, 256)
            },
            ext: "npy",
            data: (),
        },
        |c| Ok(verdict(&npuc_npy::parse_npy(&c.input, "fuzz.npy"))),
    )
    .assert_clean("npy");
}

#[test]
fn fuzz_calibration_images() {
    let dir = quant_data("photos");
    let mut seeds: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "png" || e == "jpg"))
        .map(|p| {
            let ext = p.extension().unwrap().to_string_lossy().into_owned();
            (ext, std::fs::read(&p).unwrap())
        })
        .collect();
    seeds.sort();
    assert!(seeds.len() >= 4, "too few images in {}", dir.display());
    let work = tempfile::tempdir().unwrap();
    let pre = npuc_quant::ImagePreprocess {
        size: (32, 32),
        ..Default::default()
    };
    fuzz(
        "calibration-images",
        MIN_CASES,
        |rng, _| {
            let (ext, orig) = rng.pick(&seeds);
            Case {
                input: mutated(rng, orig, 512),
                ext: if ext == "png" { "png" } else { "jpg" },
                data: (),
            }
        },
        |c| {
            let p = work.path().join(format!("img.{}", c.ext));
            std::fs::write(&p, &c.input).unwrap();
            Ok(verdict(&npuc_quant::calib::load_image(&p, &pre)))
        },
    )
    .assert_clean("calibration-images");
}

// ---------------------------------------------------------------------------------------------
// Text formats: the `npuc build` pipeline TOML, quantization overrides, AIMET encodings.

fn text_fuzz(target: &str, seeds: &[(String, &'static str)], load: impl Fn(&Path) -> Verdict) {
    let work = tempfile::tempdir().unwrap();
    fuzz(
        target,
        MIN_CASES,
        |rng, _| {
            let (text, ext) = rng.pick(seeds);
            let mut t = text.clone();
            for _ in 0..1 + rng.below(3) {
                t = mutate_text(rng, &t);
            }
            Case {
                input: t.into_bytes(),
                ext,
                data: (),
            }
        },
        |c| {
            let p = work.path().join(format!("case.{}", c.ext));
            std::fs::write(&p, &c.input).unwrap();
            Ok(load(&p))
        },
    )
    .assert_clean(target);
}

#[test]
fn fuzz_pipeline_toml() {
    let root = npuc_testsupport::workspace_root().join("examples");
    let mut seeds = vec![];
    for e in std::fs::read_dir(&root).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|e| e == "toml") {
            seeds.push((std::fs::read_to_string(&p).unwrap(), "toml"));
        }
    }
    seeds.sort();
    // The models the examples name must be there (the loaders read their headers).
    gguf_seeds();
    text_fuzz(
        "pipeline-toml",
        &seeds,
        |p| match npuc_build::components::is_components_file(p) {
            Ok(true) => verdict(&npuc_build::components::ComponentsPipeline::load(p)),
            Ok(false) => verdict(&npuc_build::Pipeline::load(p)),
            Err(_) => Verdict::Rejected,
        },
    );
}

#[test]
fn fuzz_quantization_overrides() {
    let m = npuc_onnx::load_model(&rec_tiny()).unwrap();
    let names: Vec<String> = m.graph.nodes.iter().map(|n| n.name.clone()).collect();
    let a = &names[names.len() / 3];
    let seeds = vec![
        (
            format!(
                r#"{{"default": "w8a8", "rules": [{{"pattern": "{a}", "scheme": "w8a16"}}, {{"pattern": "*conv*", "scheme": "float"}}, {{"pattern": "/b?/*", "scheme": "w4a16"}}]}}"#
            ),
            "json",
        ),
        (
            format!("default = \"w8a16\"\n\n[[rules]]\npattern = \"{a}\"\nscheme = \"fp16\"\n\n[[rules]]\npattern = \"*\"\nscheme = \"w8a8\"\n"),
            "toml",
        ),
    ];
    text_fuzz(
        "quant-overrides",
        &seeds,
        |p| match npuc_quant::Overrides::load(p) {
            Ok(o) => {
                let _ = o.validate();
                for n in &names {
                    let _ = o.lookup([n.as_str()]);
                }
                let _ = o.lookup(["", "********************************a"]);
                Verdict::Accepted
            }
            Err(_) => Verdict::Rejected,
        },
    );
}

#[test]
fn fuzz_aimet_encodings() {
    let s = cli_setup();
    // The graph the encodings name: the model as `npuc compile --quantize` prepares it.
    let opts = npuc_driver::compile::CompileOptions {
        input_shapes: [("x".to_string(), vec![1, 3, 48, 320])].into(),
        optimize: true,
        ..Default::default()
    };
    let (m, _) = npuc_driver::quantize::prepare(&rec_tiny(), &opts).unwrap();
    assert!(npuc_quant::encodings::read(&s.enc, &m).is_ok());
    let seeds = vec![
        (std::fs::read_to_string(&s.enc).unwrap(), "json"),
        (std::fs::read_to_string(&s.enc_v1).unwrap(), "json"),
    ];
    text_fuzz("aimet-encodings", &seeds, |p| {
        verdict(&npuc_quant::encodings::read(p, &m))
    });
}

// ---------------------------------------------------------------------------------------------
// CLI entries: the real binary on garbled flag values and argument combinations.

/// Files the CLI targets start from, made once with the real binary.
struct CliSetup {
    dir: PathBuf,
    rec: PathBuf,
    /// `rec` compiled for 1x3x48x64.
    npuc: PathBuf,
    /// A 1x3x48x64 input for it.
    x: PathBuf,
    calib: PathBuf,
    heldout: PathBuf,
    /// `rec` quantized w8a8 as QDQ ONNX, and its encodings (0.6.1 and 1.0.0).
    qdq: PathBuf,
    enc: PathBuf,
    enc_v1: PathBuf,
    pipeline: PathBuf,
    overrides: PathBuf,
    png: PathBuf,
}

fn npuc_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_npuc"))
}

fn must(args: &[&str]) {
    let o = Command::new(npuc_bin()).args(args).output().unwrap();
    assert!(
        o.status.success(),
        "setup: npuc {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn ps(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Removes the setup directories (`$TMPDIR/npuc-fuzz-PID`) of earlier runs whose process is
/// gone; a run's own stays until the next run, as no test runs last.
fn remove_stale_setups() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("npuc-fuzz-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn cli_setup() -> &'static CliSetup {
    static S: OnceLock<CliSetup> = OnceLock::new();
    S.get_or_init(|| {
        remove_stale_setups();
        let dir = std::env::temp_dir().join(format!("npuc-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let rec = rec_tiny();
        let npuc = dir.join("rec.npuc");
        std::fs::write(&npuc, compiled_rec()).unwrap();
        let x = dir.join("x.npy");
        let t = Tensor::from_vec(
            vec![1, 3, 48, 64],
            (0..3 * 48 * 64).map(|i| (i % 13) as f32 / 13.0).collect(),
        )
        .unwrap();
        std::fs::write(&x, npuc_cli::npy::npy_bytes(&t).unwrap()).unwrap();
        let (calib, heldout) = (dir.join("calib"), dir.join("heldout"));
        for (d, files) in [
            (&calib, ["x_000.npy", "x_001.npy"]),
            (&heldout, ["x_002.npy", "x_003.npy"]),
        ] {
            std::fs::create_dir_all(d).unwrap();
            for f in files {
                std::fs::copy(quant_data(&format!("ocr/calib/{f}")), d.join(f)).unwrap();
            }
        }
        let (qdq, enc, enc_v1) = (
            dir.join("q.onnx"),
            dir.join("enc.json"),
            dir.join("enc1.json"),
        );
        let q = dir.join("q.npuc");
        must(&[
            "compile",
            ps(&rec),
            "--input-shape",
            "x=1x3x48x320",
            "--quantize",
            "w8a8",
            "--no-progress",
            "--calib",
            ps(&calib),
            "--emit-qdq",
            ps(&qdq),
            "--emit-encodings",
            ps(&enc),
            "-o",
            ps(&q),
        ]);
        must(&[
            "compile",
            ps(&rec),
            "--input-shape",
            "x=1x3x48x320",
            "--quantize",
            "w8a8",
            "--encodings",
            ps(&enc),
            "--encodings-version",
            "1.0.0",
            "--emit-encodings",
            ps(&enc_v1),
            "-o",
            ps(&q),
        ]);
        let pipeline = dir.join("smollm2.toml");
        let text = std::fs::read_to_string(
            npuc_testsupport::workspace_root().join("examples/smollm2-135m.toml"),
        )
        .unwrap()
        .replace(
            "$NPUC_CACHE/models/smollm2-135m/smollm2-135m-instruct-q4_1.gguf",
            ps(&npuc_testsupport::smollm2_gguf()),
        );
        std::fs::write(&pipeline, text).unwrap();
        let overrides = dir.join("overrides.json");
        std::fs::write(
            &overrides,
            r#"{"default": "w8a8", "rules": [{"pattern": "*conv*", "scheme": "w8a16"}]}"#,
        )
        .unwrap();
        CliSetup {
            png: quant_data("photos/logo.png"),
            dir,
            rec,
            npuc,
            x,
            calib,
            heldout,
            qdq,
            enc,
            enc_v1,
            pipeline,
            overrides,
        }
    })
}

/// What a flag takes, for picking hostile values.
#[derive(Clone, Copy)]
enum Kind {
    /// A count whose large values mean long legitimate work (`--runs`, `--threads`): only
    /// zero, negative, malformed and overflowing values.
    Count,
    /// A size that must be refused clearly when too large (`--ctx`, `--max-tokens`).
    Size,
    Float,
    /// An input file.
    Path,
    /// An output path.
    Out,
    /// `NAME=SHAPE` (`--input-shape`).
    Shape,
    /// `SYM=N` (`--dim`).
    Dim,
    /// `NAME=FILE` (`-i`, `--name`).
    Input,
    Text,
    Switch,
    Choice(&'static [&'static str]),
}

const COUNTS: &[&str] = &[
    "0",
    "-1",
    "",
    "x",
    "1.5",
    "18446744073709551616",
    "1",
    "2",
    "3",
];
const SIZES: &[&str] = &[
    "0",
    "-1",
    "1",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "99999999999",
    "1e9",
    "",
];
const FLOATS: &[&str] = &[
    "NaN", "inf", "-inf", "-1", "0", "1e309", "1e-45", "x", "-0", "1e38",
];
const TEXTS: &[&str] = &[
    "", "ü✓", "{{ x }}", "\n", "-", "--", "ar1,ar0", "x,,y", "%s%n",
];

struct Spec {
    name: &'static str,
    base: Vec<String>,
    flags: Vec<(&'static str, Kind)>,
    /// Flags that must stay as the base has them (`--dry-run`: without it a build runs).
    pinned: &'static [&'static str],
    /// Flags of long legitimate work that may not both change in one case.
    exclusive: &'static [&'static str],
    /// Files that may replace the model argument.
    models: Vec<PathBuf>,
}

fn value_for(rng: &mut Rng, kind: Kind, s: &CliSetup, case: &Path) -> Option<String> {
    let paths = |rng: &mut Rng| -> String {
        let pool: Vec<PathBuf> = vec![
            s.rec.clone(),
            s.npuc.clone(),
            s.x.clone(),
            s.dir.clone(),
            s.calib.clone(),
            s.enc.clone(),
            s.png.clone(),
            s.overrides.clone(),
            PathBuf::from("/dev/null"),
            PathBuf::from("/nonexistent/file"),
            s.dir.join("empty"),
            case.join("mutated.bin"),
        ];
        rng.pick(&pool).display().to_string()
    };
    Some(match kind {
        Kind::Count => rng.pick(COUNTS).to_string(),
        Kind::Size => rng.pick(SIZES).to_string(),
        Kind::Float => rng.pick(FLOATS).to_string(),
        Kind::Path => paths(rng),
        Kind::Out => match rng.below(4) {
            // An existing directory (of this case, so that what a failed write leaves is seen).
            0 => case.join("adir").display().to_string(),
            // Under a regular file: cannot be created (never a path outside the test's dirs).
            1 => s.dir.join("empty/out").display().to_string(),
            2 => "".into(),
            _ => case.join("out/deeper/f").display().to_string(),
        },
        Kind::Shape | Kind::Dim | Kind::Input => {
            let name = if rng.one_in(2) {
                match kind {
                    Kind::Dim => "DynamicDimension.1",
                    _ => "x",
                }
                .to_string()
            } else {
                rng.pick(&["nope", "", "DynamicDimension.0", "x", "x=x"])
                    .to_string()
            };
            let val = match kind {
                Kind::Shape if rng.one_in(2) => rng
                    .pick(&[
                        "1x3x48x18446744073709551615",
                        "1x3x48x100000000000",
                        "1x3x48x32",
                        "2x3x48x320",
                        "1x3x0x64",
                        "1x3x48",
                        "1x3x48x64x1",
                        "x",
                        "1xx3",
                    ])
                    .to_string(),
                Kind::Shape | Kind::Dim => rng.pick(SIZES).to_string(),
                _ => paths(rng),
            };
            format!("{name}={val}")
        }
        Kind::Text => rng.pick(TEXTS).to_string(),
        Kind::Switch => return None,
        Kind::Choice(c) => {
            if rng.one_in(3) {
                rng.pick(TEXTS).to_string()
            } else {
                rng.pick(c).to_string()
            }
        }
    })
}

fn is_flag(a: &str) -> bool {
    a.starts_with('-') && a.len() > 1 && a.parse::<f64>().is_err()
}

/// One to three changes to the base command line: a flag's value replaced by a hostile one, a
/// flag added, an argument dropped, a flag repeated, the model swapped for another file.
fn garble(rng: &mut Rng, spec: &Spec, s: &CliSetup, case: &Path) -> Vec<String> {
    // The command line as (flag, value) pairs after the subcommand and model, so that changes
    // keep it parseable often enough to reach the command itself.
    let mut pairs: Vec<(String, Option<String>)> = vec![];
    let mut i = 2;
    while i < spec.base.len() {
        let f = spec.base[i].clone();
        if i + 1 < spec.base.len() && !is_flag(&spec.base[i + 1]) {
            pairs.push((f, Some(spec.base[i + 1].clone())));
            i += 2;
        } else {
            pairs.push((f, None));
            i += 1;
        }
    }
    let mut model = spec.base[1].clone();
    let mut changed: Vec<String> = vec![];
    let kind_of = |f: &str| {
        spec.flags
            .iter()
            .find(|x| x.0 == f)
            .map(|x| x.1)
            .unwrap_or(Kind::Text)
    };
    let n = match rng.below(10) {
        0..=5 => 1,
        6..=8 => 2,
        _ => 3,
    };
    for _ in 0..n {
        match rng.below(20) {
            0..=8 => {
                let with_value: Vec<usize> = (0..pairs.len())
                    .filter(|&k| {
                        pairs[k].1.is_some() && !spec.pinned.contains(&pairs[k].0.as_str())
                    })
                    .collect();
                if with_value.is_empty() {
                    continue;
                }
                let k = *rng.pick(&with_value);
                if let Some(v) = value_for(rng, kind_of(&pairs[k].0), s, case) {
                    changed.push(pairs[k].0.clone());
                    pairs[k].1 = Some(v);
                }
            }
            9..=14 => {
                let (f, kind) = *rng.pick(&spec.flags);
                changed.push(f.to_string());
                pairs.push((f.to_string(), value_for(rng, kind, s, case)));
            }
            15 => {
                if !pairs.is_empty() {
                    let k = rng.below(pairs.len());
                    if !spec.pinned.contains(&pairs[k].0.as_str()) {
                        pairs.remove(k);
                    }
                }
            }
            16 => {
                if !pairs.is_empty() {
                    let k = rng.below(pairs.len());
                    pairs.push(pairs[k].clone());
                }
            }
            _ => {
                if !spec.models.is_empty() {
                    model = rng.pick(&spec.models).display().to_string();
                }
            }
        }
    }
    // Two long-work flags changed at once could ask for legitimately long work: keep the base.
    let touched = spec
        .exclusive
        .iter()
        .filter(|f| changed.iter().any(|c| c == **f))
        .count();
    if touched > 1 {
        return spec.base.clone();
    }
    let mut a = vec![spec.base[0].clone(), model];
    for (f, v) in pairs {
        match v {
            // A value that looks like a flag goes in `--flag=VALUE` form.
            Some(v) if v.starts_with('-') && f.starts_with("--") => a.push(format!("{f}={v}")),
            Some(v) => {
                a.push(f);
                a.push(v);
            }
            None => a.push(f),
        }
    }
    a
}

/// Seconds one CLI call may take before it counts as a hang: `NPUC_FUZZ_CALL_SECONDS`, else 60.
fn call_limit() -> Duration {
    Duration::from_secs_f64(
        std::env::var("NPUC_FUZZ_CALL_SECONDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60.0),
    )
}

fn cli_fuzz(spec: Spec, mutate_file: Option<(Vec<u8>, &'static str)>) {
    let s = cli_setup();
    std::fs::write(s.dir.join("empty"), b"").unwrap();
    let limit = call_limit();
    let target = format!("cli-{}", spec.name);
    fuzz(
        &target,
        2,
        |rng, i| {
            let case = s.dir.join(format!("{}-{i}", spec.name));
            std::fs::create_dir_all(case.join("adir")).unwrap();
            // A mutated copy of the command's own input kind, for the path pool.
            if let Some((orig, _)) = &mutate_file {
                let b = if let Ok(t) = std::str::from_utf8(orig) {
                    mutate_text(rng, t).into_bytes()
                } else {
                    mutated(rng, orig, 64 << 10)
                };
                std::fs::write(case.join("mutated.bin"), b).unwrap();
            }
            let argv = garble(rng, &spec, s, &case);
            Case {
                input: shell_line(&npuc_bin(), &argv).into_bytes(),
                ext: "sh",
                data: (case, argv),
            }
        },
        |c| {
            let (case, argv) = &c.data;
            let mut cmd = Command::new(npuc_bin());
            cmd.args(argv).current_dir(case);
            let b = run_bounded(cmd, limit).map_err(|e| format!("spawn: {e}"))?;
            let mut r = check_exit(&b, &String::from_utf8_lossy(&c.input), limit);
            // Outputs land in the case's directory: a temp file left there is a failed write
            // that did not clean up.
            if let Some(t) = temp_files(case).first() {
                r = Err(format!(
                    "left a temp file behind: {}\n    command: {}",
                    t.display(),
                    String::from_utf8_lossy(&c.input)
                ));
            }
            if std::env::var_os("NPUC_FUZZ_VERBOSE").is_some() {
                let first = b
                    .stderr
                    .lines()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                eprintln!(
                    "{target}: {} -> {:?}: {first}",
                    String::from_utf8_lossy(&c.input),
                    b.status
                );
            }
            if r.is_ok() {
                let _ = std::fs::remove_dir_all(case);
            }
            r
        },
    )
    .assert_clean(&target);
}

/// Files under `dir` whose name says they are a writer's temporary (`.tmp`).
fn temp_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if e.file_name().to_string_lossy().contains(".tmp") {
                out.push(p);
            }
        }
    }
    out
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn model_pool(s: &CliSetup, gguf: bool) -> Vec<PathBuf> {
    let mut v = vec![
        s.rec.clone(),
        s.npuc.clone(),
        s.qdq.clone(),
        s.dir.clone(),
        s.x.clone(),
        s.png.clone(),
        PathBuf::from("/dev/null"),
        s.dir.join("empty"),
        PathBuf::from("mutated.bin"),
    ];
    if gguf {
        v.push(npuc_testsupport::smollm2_gguf());
    }
    v
}

const SHAPE_FLAGS: [(&str, Kind); 3] = [
    ("--input-shape", Kind::Shape),
    ("--dim", Kind::Dim),
    (
        "--max-memory",
        Kind::Choice(&["64M", "1", "0", "lots", "18446744073709551615", "1T"]),
    ),
];

#[test]
fn fuzz_cli_inspect() {
    let s = cli_setup();
    let mut flags = vec![
        ("--json", Kind::Switch),
        ("--verify", Kind::Switch),
        ("--trust", Kind::Switch),
    ];
    flags.extend(SHAPE_FLAGS);
    let spec = Spec {
        name: "inspect",
        base: strs(&["inspect", ps(&s.rec), "--input-shape", "x=1x3x48x64"]),
        flags,
        pinned: &[],
        exclusive: &[],
        models: model_pool(s, true),
    };
    cli_fuzz(spec, Some((compiled_rec().clone(), "npuc")));
}

#[test]
fn fuzz_cli_run() {
    let s = cli_setup();
    let out = s.dir.join("run-out");
    let x = format!("x={}", ps(&s.x));
    let mut flags = vec![
        ("-i", Kind::Input),
        ("--input", Kind::Input),
        ("-o", Kind::Out),
        ("--threads", Kind::Count),
        ("--graph", Kind::Text),
        ("--simulate", Kind::Switch),
        ("--component", Kind::Text),
        ("--image", Kind::Path),
        ("--trust", Kind::Switch),
    ];
    flags.extend(SHAPE_FLAGS);
    let spec = Spec {
        name: "run",
        base: strs(&["run", ps(&s.npuc), "-i", &x, "-o", ps(&out)]),
        flags,
        pinned: &[],
        exclusive: &[],
        models: model_pool(s, true),
    };
    cli_fuzz(spec, Some((std::fs::read(&s.x).unwrap(), "npy")));
}

#[test]
fn fuzz_cli_compile() {
    let s = cli_setup();
    let mut flags = vec![
        ("-o", Kind::Out),
        ("--name", Kind::Input),
        (
            "--target",
            Kind::Choice(&["cpu-x86_64-avx2", "cpu-x86_64", "npu-9000", "cpu-aarch64"]),
        ),
        ("--no-optimize", Kind::Switch),
        ("--print-passes", Kind::Switch),
        (
            "--disable-pass",
            Kind::Choice(&["cse", "dce", "fold-constants", "all"]),
        ),
        ("--enable-pass", Kind::Choice(&["cse", "dce"])),
        ("--variants", Kind::Text),
        ("--ctx", Kind::Size),
        ("--precision", Kind::Choice(&["fast", "parity", "exact"])),
    ];
    flags.extend(SHAPE_FLAGS);
    let spec = Spec {
        name: "compile",
        base: strs(&[
            "compile",
            ps(&s.rec),
            "-o",
            "out.npuc",
            "--input-shape",
            "x=1x3x48x64",
        ]),
        flags,
        pinned: &[],
        exclusive: &[],
        models: model_pool(s, false),
    };
    cli_fuzz(spec, Some((std::fs::read(&s.rec).unwrap(), "onnx")));
}

#[test]
fn fuzz_cli_quantize() {
    let s = cli_setup();
    let mut flags = vec![
        (
            "--quantize",
            Kind::Choice(&[
                "w8a8", "w8a16", "w4a16", "w4a8", "w16a16", "fp16", "bf16", "w8", "w4", "w3a5",
            ]),
        ),
        ("--calib", Kind::Path),
        (
            "--calib-method",
            Kind::Choice(&["minmax", "percentile", "mse", "entropy"]),
        ),
        ("--percentile", Kind::Float),
        (
            "--granularity",
            Kind::Choice(&["per-tensor", "per-channel", "per-row", "per-block", "lpbq"]),
        ),
        ("--block-size", Kind::Size),
        ("--compressed-bw", Kind::Size),
        ("--symmetric-activations", Kind::Switch),
        ("--overrides", Kind::Path),
        ("--keep-float", Kind::Text),
        ("--encodings", Kind::Path),
        ("--emit-qdq", Kind::Out),
        ("--emit-encodings", Kind::Out),
        (
            "--encodings-version",
            Kind::Choice(&["0.6.1", "1.0.0", "2.0"]),
        ),
        ("--max-samples", Kind::Count),
        (
            "--image-size",
            Kind::Choice(&["48,320", "0,0", "4294967295,1", "48"]),
        ),
        ("--mean", Kind::Choice(&["0.5,0.5,0.5", "1", "nan,0,0"])),
        ("--std", Kind::Choice(&["0.5,0.5,0.5", "0,0,0", "-1,1,1"])),
        ("--layout", Kind::Choice(&["nchw", "nhwc"])),
        ("--channel-order", Kind::Choice(&["rgb", "bgr"])),
        ("--scale", Kind::Choice(&["1/255", "1/0", "0", "x/y"])),
        ("--calib-threads", Kind::Count),
        ("-o", Kind::Out),
    ];
    flags.extend(SHAPE_FLAGS);
    let spec = Spec {
        name: "quantize",
        base: strs(&[
            "compile",
            ps(&s.rec),
            "--input-shape",
            "x=1x3x48x320",
            "--quantize",
            "w8a8",
            "--no-progress",
            "--calib",
            ps(&s.calib),
            "--overrides",
            ps(&s.overrides),
            "-o",
            "q.npuc",
        ]),
        flags,
        pinned: &[],
        exclusive: &[],
        models: model_pool(s, false),
    };
    cli_fuzz(spec, Some((std::fs::read(&s.overrides).unwrap(), "json")));
}

#[test]
fn fuzz_cli_bench() {
    let s = cli_setup();
    let mut flags = vec![
        ("--threads", Kind::Count),
        ("--runs", Kind::Count),
        ("--json", Kind::Switch),
        ("--profile", Kind::Switch),
        ("--simulate", Kind::Switch),
        ("--trace", Kind::Out),
        ("--graph", Kind::Text),
        ("-i", Kind::Input),
        ("--gen", Kind::Count),
        ("--ctx", Kind::Size),
        ("--prompt-len", Kind::Count),
        ("--precision", Kind::Choice(&["fast", "exact"])),
        ("--variants", Kind::Text),
    ];
    flags.extend(SHAPE_FLAGS);
    let spec = Spec {
        name: "bench",
        base: strs(&[
            "bench",
            ps(&s.rec),
            "--runs",
            "1",
            "--input-shape",
            "x=1x3x48x64",
        ]),
        flags,
        pinned: &[],
        exclusive: &[],
        models: model_pool(s, false),
    };
    cli_fuzz(spec, Some((compiled_rec().clone(), "npuc")));
}

#[test]
fn fuzz_cli_generate() {
    let s = cli_setup();
    let gguf = npuc_testsupport::smollm2_gguf();
    let flags = vec![
        ("--prompt", Kind::Text),
        (
            "--prompt-tokens",
            Kind::Choice(&["1,2,3", "4294967295", "-1", "1,,2", "49151,49152"]),
        ),
        ("--max-tokens", Kind::Size),
        ("--ctx", Kind::Size),
        ("--temperature", Kind::Float),
        ("--top-k", Kind::Size),
        ("--top-p", Kind::Float),
        ("--min-p", Kind::Float),
        ("--repeat-penalty", Kind::Float),
        ("--seed", Kind::Size),
        ("--stop", Kind::Text),
        ("--threads", Kind::Count),
        ("--json", Kind::Switch),
        ("--chat", Kind::Switch),
        ("--no-bos", Kind::Switch),
        ("--logits-out", Kind::Out),
        ("--prefix-embeddings", Kind::Path),
        ("--precision", Kind::Choice(&["fast", "parity", "exact"])),
        (
            "--variants",
            Kind::Choice(&["ar1", "ar1,ar32", "ar0", "ar4294967296", "full"]),
        ),
        ("--chat-template", Kind::Text),
        ("--max-memory", Kind::Choice(&["64M", "1", "lots"])),
    ];
    let spec = Spec {
        name: "generate",
        base: strs(&[
            "generate",
            ps(&gguf),
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "4",
            "--ctx",
            "128",
            "--temperature",
            "0",
        ]),
        flags,
        pinned: &[],
        exclusive: &["--max-tokens", "--ctx"],
        models: vec![
            gguf.clone(),
            s.npuc.clone(),
            s.rec.clone(),
            s.dir.clone(),
            PathBuf::from("mutated.bin"),
        ],
    };
    // The mutated file: SmolLM2's header, truncated after the first tensor bytes.
    let head = gguf_seed(&gguf).head;
    cli_fuzz(spec, Some((head, "gguf")));
}

#[test]
fn fuzz_cli_build_dry_run() {
    let s = cli_setup();
    let spec = Spec {
        name: "build",
        base: strs(&["build", "mutated.bin", "-o", "bundle", "--dry-run"]),
        flags: vec![
            ("--jobs", Kind::Count),
            (
                "--force",
                Kind::Choice(&["split", "compile", "all", "check"]),
            ),
            ("--verify-cache", Kind::Switch),
            ("-o", Kind::Out),
        ],
        pinned: &["--dry-run"],
        exclusive: &[],
        models: vec![
            PathBuf::from("mutated.bin"),
            s.pipeline.clone(),
            s.rec.clone(),
            s.dir.clone(),
        ],
    };
    let toml = std::fs::read(&s.pipeline).unwrap();
    cli_fuzz(spec, Some((toml, "toml")));
}

#[test]
fn fuzz_cli_verify() {
    let s = cli_setup();
    let spec = Spec {
        name: "verify",
        base: strs(&[
            "verify",
            ps(&s.qdq),
            "--reference",
            ps(&s.rec),
            "--inputs",
            ps(&s.heldout),
            "--json",
        ]),
        flags: vec![
            ("--reference", Kind::Path),
            ("--inputs", Kind::Path),
            ("--threshold-db", Kind::Float),
            ("--report", Kind::Out),
            ("--simulate", Kind::Switch),
            ("--suggest", Kind::Switch),
            ("--target-sqnr", Kind::Float),
            ("--headroom", Kind::Float),
            ("--prune-evals", Kind::Count),
            ("--sensitivity-evals", Kind::Count),
            ("--apply", Kind::Out),
            ("--apply-model", Kind::Out),
            ("--threads", Kind::Count),
        ],
        pinned: &[],
        exclusive: &[],
        models: model_pool(s, false),
    };
    cli_fuzz(spec, None);
}
