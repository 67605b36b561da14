//! Reads the synthetic llama/qwen2 GGUFs written by llama.cpp's converter and checks their
//! metadata and tensor tables against the values recorded beside them (`refs.json`), then
//! round-trips every file through the writer byte-for-byte.

use npuc_gguf::{write, GgufFile, MetaValue};
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llm")
}

fn gguf_files() -> Vec<PathBuf> {
    let mut v = Vec::new();
    for model in ["tiny-llama3", "tiny-llama-spm", "tiny-qwen2"] {
        for e in std::fs::read_dir(fixtures().join(model)).expect("fixture dir") {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "gguf") {
                v.push(p);
            }
        }
    }
    v.sort();
    assert!(
        v.len() >= 20,
        "expected the 20 synthetic GGUFs, found {}",
        v.len()
    );
    v
}

#[test]
fn metadata_and_tensor_tables_match_the_recorded_ones() {
    for model in ["tiny-llama3", "tiny-llama-spm", "tiny-qwen2"] {
        let dir = fixtures().join(model);
        let refs: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("refs.json")).unwrap()).unwrap();
        let files = refs["gguf"].as_object().expect("gguf");
        for (ty, info) in files {
            let path = dir.join(info["file"].as_str().unwrap());
            if !path.exists() {
                assert_ne!(ty, "F32", "the F32 file is always kept");
                continue;
            }
            let g = GgufFile::open(&path).unwrap();
            let want = info["tensor_types"].as_object().unwrap();
            assert_eq!(g.tensors.len(), want.len(), "{}", path.display());
            for t in &g.tensors {
                assert_eq!(
                    Some(t.ggml_type.name()),
                    want[&t.name].as_str(),
                    "{} {}",
                    path.display(),
                    t.name
                );
            }
            assert_eq!(g.architecture().unwrap(), refs["arch"].as_str().unwrap());
            let n_vocab = g
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_str_array())
                .unwrap()
                .len();
            assert_eq!(n_vocab, 512);
            if ty == "F32" {
                let m = refs["gguf_metadata"].as_object().unwrap();
                assert_eq!(g.version as u64, m["GGUF.version"].as_u64().unwrap());
                assert_eq!(
                    g.metadata.len() as u64,
                    m["GGUF.kv_count"].as_u64().unwrap()
                );
                for (k, v) in m.iter().filter(|(k, _)| !k.starts_with("GGUF.")) {
                    let ours = g.get(k).unwrap_or_else(|| panic!("{k} missing"));
                    match v {
                        serde_json::Value::String(s) => {
                            assert_eq!(ours.as_str(), Some(s.as_str()), "{k}")
                        }
                        serde_json::Value::Bool(b) => assert_eq!(ours.as_bool(), Some(*b), "{k}"),
                        serde_json::Value::Number(n) => {
                            let x = ours.as_f64().unwrap();
                            assert!(
                                (x - n.as_f64().unwrap()).abs() <= 1e-12 * x.abs().max(1.0),
                                "{k}"
                            )
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

#[test]
fn writer_round_trips_every_file_byte_for_byte() {
    for path in gguf_files() {
        let bytes = std::fs::read(&path).unwrap();
        let g = GgufFile::open(&path).unwrap();
        let tensors: Vec<write::WriteTensor> = g
            .tensors
            .iter()
            .map(|t| write::WriteTensor {
                name: t.name.clone(),
                ggml_type: t.ggml_type,
                dims: t.dims.clone(),
                data: g.tensor_bytes(t),
            })
            .collect();
        let out = write::to_bytes(&g.metadata, &tensors).unwrap();
        assert_eq!(out.len(), bytes.len(), "{}", path.display());
        assert!(out == bytes, "{} differs after re-writing", path.display());
        let again = GgufFile::from_bytes("again", out).unwrap();
        assert_eq!(again.metadata, g.metadata);
        assert_eq!(again.tensors, g.tensors);
    }
}

#[test]
fn truncations_and_mutations_give_errors_not_panics() {
    let path = fixtures().join("tiny-qwen2/tiny-qwen2-Q4_K.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    let header_end = g.data_offset as usize;
    // Every truncation point inside the header, and a sample through the data.
    let mut cuts: Vec<usize> = (0..header_end.min(4096)).collect();
    cuts.extend((header_end..bytes.len()).step_by(9973));
    for cut in cuts {
        let r = GgufFile::from_bytes("cut", bytes[..cut].to_vec());
        assert!(r.is_err(), "truncation at {cut} was accepted");
    }
    // Random byte mutations in the header (xorshift, fixed seed): never a panic.
    let mut s = 0x9e3779b97f4a7c15u64;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut rejected = 0;
    for _ in 0..3000 {
        let mut b = bytes[..header_end].to_vec();
        b.resize(bytes.len(), 0);
        for _ in 0..1 + rnd() % 4 {
            let i = (rnd() as usize) % header_end;
            b[i] = match rnd() % 3 {
                0 => rnd() as u8,
                1 => 0xff,
                _ => b[i] ^ (1 << (rnd() % 8)),
            };
        }
        if GgufFile::from_bytes("mutated", b).is_err() {
            rejected += 1;
        }
    }
    assert!(
        rejected > 100,
        "only {rejected} of 3000 mutations were rejected"
    );
}

#[test]
fn errors_name_the_problem() {
    let err = GgufFile::from_bytes("x.gguf", b"GGML\x03\0\0\0".to_vec()).unwrap_err();
    assert!(err.to_string().contains("not a GGUF file"), "{err}");
    let err = GgufFile::from_bytes("x.gguf", b"GGUF\x01\0\0\0".to_vec()).unwrap_err();
    assert!(err.to_string().contains("version 1"), "{err}");
    let err = GgufFile::open("/nonexistent/m.gguf").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/m.gguf"), "{err}");
    // A tensor pointing past the end of the file.
    let meta = vec![(
        "general.architecture".to_string(),
        MetaValue::String("llama".into()),
    )];
    let data = vec![0u8; 64];
    let t = write::WriteTensor {
        name: "w".into(),
        ggml_type: npuc_ir::GgmlType::F32,
        dims: vec![16],
        data: &data,
    };
    let mut bytes = write::to_bytes(&meta, &[t]).unwrap();
    bytes.truncate(bytes.len() - 8);
    let err = GgufFile::from_bytes("short.gguf", bytes).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("tensor 'w'") && msg.contains("past the end"),
        "{msg}"
    );
}

#[test]
fn gguf_is_detected_by_magic_or_name() {
    let dir = tempfile::tempdir().unwrap();
    let renamed = dir.path().join("model.bin");
    std::fs::write(&renamed, b"GGUF\x03\x00\x00\x00rest").unwrap();
    assert!(
        npuc_gguf::is_gguf(&renamed),
        "GGUF magic under another name"
    );
    let onnx = dir.path().join("model.onnx");
    std::fs::write(&onnx, b"\x08\x07\x12\x04onnx").unwrap();
    assert!(!npuc_gguf::is_gguf(&onnx));
    assert!(
        npuc_gguf::is_gguf(&dir.path().join("missing.GGUF")),
        "a .gguf name goes to the GGUF loader, whose error names the file"
    );
    assert!(!npuc_gguf::is_gguf(&dir.path().join("missing.onnx")));
}
