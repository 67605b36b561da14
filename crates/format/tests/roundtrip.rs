//! Round trip, zero-copy loading, determinism, deduplication and atomic writes.

mod common;

use common::{f32_tensor, sample_model, sample_writer};
use npuc_format::{
    Artifact, ArtifactWriter, FormatError, GraphInfo, Target, PAGE, SECTION_ENTRY_LEN,
    SECTION_WEIGHTS, WEIGHT_ALIGN,
};
use npuc_ir::{Attr, DType, Model, TensorData};
use std::path::Path;

fn weights_section(bytes: &[u8]) -> (usize, usize) {
    let n = u32::from_le_bytes(bytes[16..20].try_into().unwrap()) as usize;
    let table = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize;
    for i in 0..n {
        let e = table + i * SECTION_ENTRY_LEN;
        let kind = u32::from_le_bytes(bytes[e..e + 4].try_into().unwrap());
        if kind == SECTION_WEIGHTS {
            let off = u64::from_le_bytes(bytes[e + 8..e + 16].try_into().unwrap());
            let len = u64::from_le_bytes(bytes[e + 16..e + 24].try_into().unwrap());
            return (off as usize, len as usize);
        }
    }
    panic!("no weights section");
}

/// The model as the artifact returns it (what is not stored takes its default).
fn expected(m: &Model) -> Model {
    Model {
        ir_version: 10,
        producer_name: "npuc".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        domain: String::new(),
        model_version: 0,
        doc: String::new(),
        ..m.clone()
    }
}

#[test]
fn round_trip_through_a_file_equals_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.npuc");
    let w = sample_writer();
    let n = w.write(&path).unwrap();
    assert_eq!(n, std::fs::metadata(&path).unwrap().len());
    let a = Artifact::open(&path).unwrap();
    assert_eq!(a.graph_names(), ["main"]);
    assert_eq!(a.file_len, n);
    let got = a.model(None).unwrap();
    assert_eq!(got, expected(&sample_model()));
    assert_eq!(a.model(Some("main")).unwrap(), got);
    assert!(a.verify_weights().is_empty());
}

#[test]
fn round_trip_from_memory_equals_the_model() {
    let bytes = sample_writer().to_bytes().unwrap();
    let a = Artifact::from_bytes(Path::new("mem.npuc"), bytes).unwrap();
    assert_eq!(a.model(None).unwrap(), expected(&sample_model()));
}

#[test]
fn float_attributes_survive_bit_exactly_including_nan() {
    let mut m = sample_model();
    let specials = [f32::NAN, 1.0e-45, -0.0, f32::MIN_POSITIVE, 0.1, -3.4e38];
    m.graph.nodes[0].attrs = vec![("fs".into(), Attr::Floats(specials.to_vec()))];
    let mut w = ArtifactWriter::new(Target::host(), serde_json::Value::Null);
    w.add_graph("g", &m, GraphInfo::default()).unwrap();
    let a = Artifact::from_bytes(Path::new("mem"), w.to_bytes().unwrap()).unwrap();
    let got = a.model(None).unwrap();
    let Attr::Floats(v) = &got.graph.nodes[0].attrs[0].1 else {
        panic!("not floats: {:?}", got.graph.nodes[0].attrs[0]);
    };
    assert!(v[0].is_nan());
    for (g, want) in v.iter().zip(&specials).skip(1) {
        assert_eq!(g.to_bits(), want.to_bits(), "{g} vs {want}");
    }
}

#[test]
fn numeric_weights_are_borrowed_from_the_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.npuc");
    let n = sample_writer().write(&path).unwrap();
    let a = Artifact::open(&path).unwrap();
    let m = a.model(None).unwrap();
    // Types whose in-memory form is their little-endian bytes are zero-copy; bool, strings,
    // sub-byte and 8-bit float codes are decoded into owned buffers.
    let copied = [
        DType::Bool,
        DType::String,
        DType::U4,
        DType::I4,
        DType::U2,
        DType::I2,
        DType::F8E4M3FN,
        DType::F4E2M1,
    ];
    let mut borrowed = 0;
    for i in &m.graph.initializers {
        let t = &i.tensor;
        if copied.contains(&t.dtype()) {
            assert!(!t.is_borrowed(), "{} ({})", i.name, t.dtype());
            continue;
        }
        assert!(t.is_borrowed(), "{} ({}) was copied", i.name, t.dtype());
        let TensorData::Borrowed(b) = t.data() else {
            unreachable!()
        };
        // It borrows the whole mapped file, at a WEIGHT_ALIGN-aligned address.
        assert_eq!(b.owner.bytes().len() as u64, n);
        assert_eq!(b.bytes().as_ptr() as usize % WEIGHT_ALIGN, 0, "{}", i.name);
        borrowed += 1;
    }
    assert!(borrowed >= 12, "only {borrowed} borrowed");
    // Identical weights are one blob: the duplicate initializer points at the same bytes.
    let ptr = |name: &str| {
        let t = &m
            .graph
            .initializers
            .iter()
            .find(|i| i.name == name)
            .unwrap()
            .tensor;
        t.as_slice::<f32>().unwrap().as_ptr()
    };
    assert_eq!(ptr("w"), ptr("w_dup"));
    // Same bytes under another shape is a different weight (the key includes the shape).
    assert_ne!(ptr("w"), ptr("w_flat"));
}

#[test]
fn layout_alignment() {
    let w = sample_writer();
    let bytes = w.to_bytes().unwrap();
    let (off, len) = weights_section(&bytes);
    assert_eq!(off % PAGE, 0);
    assert_eq!(off + len, bytes.len());
    for wd in &w.meta().weights {
        assert_eq!(wd.offset % WEIGHT_ALIGN as u64, 0, "{wd:?}");
    }
}

#[test]
fn writes_are_deterministic() {
    let a = sample_writer().to_bytes().unwrap();
    let b = sample_writer().to_bytes().unwrap();
    assert!(a == b, "two writes of the same model differ");
    let dir = tempfile::tempdir().unwrap();
    let (p1, p2) = (dir.path().join("1.npuc"), dir.path().join("2.npuc"));
    sample_writer().write(&p1).unwrap();
    sample_writer().write(&p2).unwrap();
    assert!(std::fs::read(&p1).unwrap() == a);
    assert!(std::fs::read(&p2).unwrap() == a);
}

#[test]
fn rewriting_a_loaded_model_reproduces_the_file() {
    // Writing the model read back from an artifact (weights borrowed from the mapping) must give
    // the same bytes: nothing is lost or reordered by a round trip.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.npuc");
    let first = sample_writer();
    first.write(&path).unwrap();
    let a = Artifact::open(&path).unwrap();
    let mut again = ArtifactWriter::new(a.meta.target.clone(), a.meta.options.clone());
    again.add_source("sample.onnx", b"not really onnx");
    again
        .add_graph("main", &a.model(None).unwrap(), GraphInfo::default())
        .unwrap();
    assert!(again.to_bytes().unwrap() == std::fs::read(&path).unwrap());
}

#[test]
fn a_model_added_twice_stores_its_weights_once() {
    let m = sample_model();
    let mut one = ArtifactWriter::new(Target::host(), serde_json::Value::Null);
    one.add_graph("a", &m, GraphInfo::default()).unwrap();
    let mut two = ArtifactWriter::new(Target::host(), serde_json::Value::Null);
    two.add_graph("a", &m, GraphInfo::default()).unwrap();
    two.add_graph("b", &m, GraphInfo::default()).unwrap();
    // String tensors live in META (not deduplicated); every blob-backed weight is shared.
    let blobs = |w: &ArtifactWriter| {
        w.meta()
            .weights
            .iter()
            .filter(|d| d.strings.is_none())
            .count()
    };
    assert_eq!(blobs(&one), blobs(&two));
    let strings = |w: &ArtifactWriter| w.meta().weights.len() - blobs(w);
    assert_eq!(strings(&two), 2 * strings(&one));
    let (b1, b2) = (one.to_bytes().unwrap(), two.to_bytes().unwrap());
    let (_, wlen1) = weights_section(&b1);
    let (_, wlen2) = weights_section(&b2);
    assert_eq!(
        wlen1, wlen2,
        "the weights section grew with the second graph"
    );
    // The second graph costs META only: far less than another copy of the weights.
    let weight_bytes: u64 = one.meta().weights.iter().map(|d| d.len).sum();
    assert!(weight_bytes > 1024);
    assert!(
        ((b2.len() - b1.len()) as u64) < weight_bytes + PAGE as u64,
        "{} -> {} bytes",
        b1.len(),
        b2.len()
    );
    // Both graphs load, borrow the same bytes, and equal the model.
    let a = Artifact::from_bytes(Path::new("mem"), b2).unwrap();
    let (ga, gb) = (a.model(Some("a")).unwrap(), a.model(Some("b")).unwrap());
    assert_eq!(ga.graph, gb.graph);
    assert_eq!(ga.graph, expected(&m).graph);
    let p = |m: &Model| {
        m.graph.initializers[0]
            .tensor
            .as_slice::<f32>()
            .unwrap()
            .as_ptr()
    };
    assert_eq!(p(&ga), p(&gb));
}

#[test]
fn distinct_weights_are_not_merged() {
    let mut m1 = sample_model();
    let mut m2 = sample_model();
    m1.graph.initializers.truncate(1);
    m2.graph.initializers.truncate(1);
    m2.graph.initializers[0].tensor = f32_tensor(vec![16, 16], 0.25);
    let mut w = ArtifactWriter::new(Target::host(), serde_json::Value::Null);
    w.add_graph("a", &m1, GraphInfo::default()).unwrap();
    let blobs = |w: &ArtifactWriter| {
        w.meta()
            .weights
            .iter()
            .filter(|d| d.strings.is_none())
            .count()
    };
    let before = blobs(&w);
    w.add_graph("b", &m2, GraphInfo::default()).unwrap();
    // Only the changed matrix is new; every other blob (attribute tensors, subgraph
    // initializers) matches graph "a"'s.
    assert_eq!(blobs(&w), before + 1);
}

#[test]
fn duplicate_graph_names_are_refused() {
    let mut w = sample_writer();
    let e = w
        .add_graph("main", &sample_model(), GraphInfo::default())
        .unwrap_err();
    assert!(e.to_string().contains("two graphs are named 'main'"), "{e}");
}

#[test]
fn unknown_graph_name_lists_the_graphs() {
    let mut w = sample_writer();
    w.add_graph("second", &sample_model(), GraphInfo::default())
        .unwrap();
    let a = Artifact::from_bytes(Path::new("x.npuc"), w.to_bytes().unwrap()).unwrap();
    let e = a.model(Some("nope")).unwrap_err();
    assert!(matches!(e, FormatError::NoGraph { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "'x.npuc' has no graph named 'nope'; it has: main, second"
    );
}

#[test]
fn unexpanded_functions_are_refused() {
    let mut m = sample_model();
    m.functions.push(npuc_ir::Function {
        name: "f".into(),
        domain: "local".into(),
        inputs: vec![],
        outputs: vec![],
        attributes: vec![],
        attribute_defaults: vec![],
        nodes: vec![],
        opset_imports: vec![],
        doc: String::new(),
    });
    let mut w = ArtifactWriter::new(Target::host(), serde_json::Value::Null);
    let e = w.add_graph("g", &m, GraphInfo::default()).unwrap_err();
    assert!(e.to_string().contains("inlined"), "{e}");
    let mut m = sample_model();
    m.graph.nodes[0]
        .attrs
        .push(("r".into(), Attr::Ref("alpha".into())));
    let e = w.add_graph("g", &m, GraphInfo::default()).unwrap_err();
    assert!(e.to_string().contains("attribute reference 'alpha'"), "{e}");
}

#[test]
fn a_write_into_a_missing_directory_fails_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing").join("m.npuc");
    let e = sample_writer().write(&path).unwrap_err();
    assert!(matches!(e, FormatError::Io { .. }), "{e:?}");
    assert!(e.to_string().contains("missing"), "{e}");
    assert!(!dir.path().join("missing").exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn a_failed_rename_removes_the_temp_file() {
    // The destination is a non-empty directory: the temp file is written, the rename fails,
    // and the temp file must be cleaned up.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.npuc");
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("keep"), b"x").unwrap();
    let e = sample_writer().write(&path).unwrap_err();
    assert!(matches!(e, FormatError::Io { .. }), "{e:?}");
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["m.npuc"]);
}

#[test]
fn a_write_replaces_an_existing_artifact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.npuc");
    std::fs::write(&path, b"old contents").unwrap();
    let bytes = sample_writer().to_bytes().unwrap();
    sample_writer().write(&path).unwrap();
    assert!(std::fs::read(&path).unwrap() == bytes);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}
