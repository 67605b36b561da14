//! ONNX reading/writing: round trips, external data (including offsets past 2 GiB), and clear
//! errors on malformed files.

use npuc_ir::{DType, Graph, Initializer, Model, Node, OpsetImport, Tensor, TypeInfo, ValueInfo};
use npuc_onnx::{load_model, load_model_bytes, save_model, to_model_proto, ExportOptions};
use prost::Message;
use std::path::{Path, PathBuf};

fn suite() -> PathBuf {
    npuc_testsupport::onnx_suite()
}

fn tiny_model(init: Tensor) -> Model {
    Model {
        ir_version: 8,
        opset_imports: vec![OpsetImport {
            domain: String::new(),
            version: 17,
        }],
        producer_name: "npuc-test".into(),
        graph: Graph {
            name: "g".into(),
            nodes: vec![Node::new("Identity", &["w"], &["y"])],
            outputs: vec![ValueInfo::new(
                "y",
                Some(TypeInfo::tensor(init.dtype(), init.shape())),
            )],
            initializers: vec![Initializer {
                name: "w".into(),
                tensor: init,
            }],
            ..Default::default()
        },
        ..Default::default()
    }
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Every model of the conformance suite reads, writes and reads back equal.
#[test]
fn suite_models_round_trip() {
    let root = suite();
    let mut n = 0;
    for sub in ["node", "pytorch-converted", "pytorch-operator", "simple"] {
        for e in std::fs::read_dir(root.join(sub)).unwrap() {
            let p = e.unwrap().path().join("model.onnx");
            if !p.is_file() {
                continue;
            }
            let m = load_model(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let bytes = to_model_proto(&m).unwrap().encode_to_vec();
            let back = load_model_bytes(bytes, &p).unwrap();
            assert_eq!(m, back, "{} does not round-trip", p.display());
            n += 1;
        }
    }
    assert!(n > 1800, "only {n} models found");
}

#[test]
fn external_data_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let w = Tensor::from_vec(vec![64, 64], (0..4096).map(|i| i as f32 * 0.5).collect()).unwrap();
    let m = tiny_model(w.clone());
    let path = dir.path().join("m.onnx");
    save_model(
        &m,
        &path,
        &ExportOptions {
            external_threshold: Some(1024),
        },
    )
    .unwrap();
    assert!(dir.path().join("m.onnx.data").is_file());
    let back = load_model(&path).unwrap();
    let t = back.graph.initializer("w").unwrap();
    assert_eq!(t, &w);
    assert!(
        t.is_borrowed(),
        "aligned external data is mapped, not copied"
    );
}

/// A model whose external data file is larger than 2 GiB (sparse, so it costs no disk), with a
/// tensor stored at an offset past 2^31.
#[test]
fn external_data_past_2gib() {
    use std::io::{Seek, SeekFrom, Write};
    let dir = tempfile::tempdir().unwrap();
    let data_path = dir.path().join("big.bin");
    let offset: u64 = (1u64 << 31) + 4096 * 3;
    let vals: Vec<f32> = (0..1000).map(|i| (i as f32).sin()).collect();
    {
        let mut f = std::fs::File::create(&data_path).unwrap();
        f.set_len(offset + 4096 * 16).unwrap();
        f.seek(SeekFrom::Start(offset)).unwrap();
        f.write_all(&le_bytes(&vals)).unwrap();
    }
    assert!(std::fs::metadata(&data_path).unwrap().len() > (1 << 31));
    let m = tiny_model(Tensor::from_vec(vec![1000], vals.clone()).unwrap());
    let mut p = to_model_proto(&m).unwrap();
    let kv = |k: &str, v: String| npuc_onnx::proto::StringStringEntryProto {
        key: Some(k.into()),
        value: Some(v),
    };
    {
        let t = &mut p.graph.as_mut().unwrap().initializer[0];
        t.raw_data = None;
        t.data_location = Some(1);
        t.external_data = vec![
            kv("location", "big.bin".into()),
            kv("offset", offset.to_string()),
            kv("length", (vals.len() * 4).to_string()),
        ];
    }
    let path = dir.path().join("big.onnx");
    std::fs::write(&path, p.encode_to_vec()).unwrap();
    let back = load_model(&path).unwrap();
    let t = back.graph.initializer("w").unwrap();
    assert!(t.is_borrowed());
    assert_eq!(t.as_slice::<f32>().unwrap(), &vals[..]);

    // An offset past the end of the file is a clear error naming the tensor.
    p.graph.as_mut().unwrap().initializer[0].external_data[1] =
        kv("offset", (offset + 4096 * 16).to_string());
    std::fs::write(&path, p.encode_to_vec()).unwrap();
    let e = load_model(&path).unwrap_err().to_string();
    assert!(e.contains("'w'") && e.contains("past the end"), "{e}");
}

#[test]
fn missing_external_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_model(Tensor::from_vec(vec![512], vec![1.0f32; 512]).unwrap());
    let path = dir.path().join("m.onnx");
    save_model(
        &m,
        &path,
        &ExportOptions {
            external_threshold: Some(16),
        },
    )
    .unwrap();
    std::fs::remove_file(dir.path().join("m.onnx.data")).unwrap();
    let e = load_model(&path).unwrap_err().to_string();
    assert!(e.contains("m.onnx.data") && e.contains("'w'"), "{e}");
}

/// A data file cut short (a copy interrupted, a download truncated) is refused at load, naming
/// the tensor and the file, for a cut anywhere in the tensor's bytes.
#[test]
fn short_external_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_model(Tensor::from_vec(vec![512], vec![1.0f32; 512]).unwrap());
    let path = dir.path().join("m.onnx");
    save_model(
        &m,
        &path,
        &ExportOptions {
            external_threshold: Some(16),
        },
    )
    .unwrap();
    let data = dir.path().join("m.onnx.data");
    let full = std::fs::metadata(&data).unwrap().len();
    assert_eq!(full, 2048, "one tensor of 512 f32 at offset 0");
    for keep in [0, 1, 1024, full - 1] {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&data)
            .unwrap()
            .set_len(keep)
            .unwrap();
        let e = load_model(&path).unwrap_err().to_string();
        assert!(
            e.contains("'w'") && e.contains("m.onnx.data") && e.contains("truncated"),
            "{keep} bytes kept: {e}"
        );
    }
}

#[test]
fn malformed_files_give_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.onnx");
    std::fs::write(&p, b"").unwrap();
    assert!(load_model(&p).unwrap_err().to_string().contains("empty"));
    std::fs::write(&p, b"this is not a protobuf at all \xff\xff\xff").unwrap();
    assert!(load_model(&p)
        .unwrap_err()
        .to_string()
        .contains("not a valid ONNX"));
    let e = load_model(Path::new("/nonexistent/model.onnx"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/model.onnx"), "{e}");
    // Every truncation of a model is an error or a (smaller) valid model, never a panic.
    let m = tiny_model(Tensor::from_vec(vec![8], vec![2i64; 8]).unwrap());
    let bytes = to_model_proto(&m).unwrap().encode_to_vec();
    for cut in 0..bytes.len() {
        let _ = load_model_bytes(bytes[..cut].to_vec(), &p);
    }
}

#[test]
fn four_bit_and_dtypes_round_trip() {
    let t4 = Tensor::from_4bit(DType::I4, vec![5], vec![1, 15, 7, 8, 0]).unwrap();
    assert_eq!(t4.as_slice::<i8>().unwrap(), &[1, -1, 7, -8, 0]);
    for t in [
        t4,
        Tensor::from_4bit(DType::U4, vec![3], vec![1, 15, 7]).unwrap(),
        Tensor::from_vec(vec![2], vec![true, false]).unwrap(),
        Tensor::from_vec(
            vec![2],
            vec![npuc_ir::f16::from_f32(1.5), npuc_ir::f16::from_f32(-2.0)],
        )
        .unwrap(),
        Tensor::from_strings(vec![2], vec!["a".into(), "bc".into()]).unwrap(),
    ] {
        let m = tiny_model(t.clone());
        let back =
            load_model_bytes(to_model_proto(&m).unwrap().encode_to_vec(), Path::new("m")).unwrap();
        assert_eq!(back.graph.initializer("w").unwrap(), &t);
    }
}
