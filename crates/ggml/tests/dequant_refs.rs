//! Dequantization is bit-identical to gguf-py's independent numpy implementation
//! (references written by scripts/make_ggml_refs.py into tests/fixtures/llm/dequant/).

mod common;

use common::{read_npy_f32, root};
use npuc_ggml::{dequantize_row, gather_rows, GgmlType};
use npuc_gguf::GgufFile;

/// Compares the first rows of one tensor, bit for bit.
fn check(ty_name: &str, file: &str, tensor: &str) -> usize {
    let (shape, want) =
        read_npy_f32(&root().join(format!("tests/fixtures/llm/dequant/{ty_name}.npy")));
    let g = GgufFile::open(root().join(file)).unwrap();
    let t = g
        .tensor(tensor)
        .unwrap_or_else(|| panic!("{file}: no tensor {tensor}"));
    let ty = GgmlType::from_name(ty_name).unwrap();
    assert_eq!(t.ggml_type, ty, "{file} {tensor}");
    let (rows, k) = (shape[0], shape[1]);
    assert_eq!(t.row_len() as usize, k);
    let rb = ty.row_bytes(k).unwrap();
    let bytes = &g.tensor_bytes(t)[..rows * rb];
    let mut got = vec![0f32; rows * k];
    dequantize_row(ty, bytes, &mut got).unwrap();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{ty_name} element {i}: ours {a}, gguf-py {b}"
        );
    }
    // Row by row through the gather path gives the same bits.
    let ids: Vec<i64> = (0..rows as i64).rev().collect();
    let mut g2 = vec![0f32; rows * k];
    gather_rows(ty, &g.tensor_bytes(t)[..rows * rb], k, &ids, &mut g2).unwrap();
    for (r, &id) in ids.iter().enumerate() {
        let id = id as usize;
        assert_eq!(&g2[r * k..(r + 1) * k], &got[id * k..(id + 1) * k]);
    }
    rows * k
}

#[test]
fn every_fixture_type_matches_gguf_py_bit_for_bit() {
    let idx =
        std::fs::read_to_string(root().join("tests/fixtures/llm/dequant/index.json")).unwrap();
    // index.json: {"TYPE": {"file": ..., "k": .., "rows": .., "tensor": ...}, ...}
    let mut checked = Vec::new();
    for part in idx.split("\n \"").skip(1) {
        let ty = part.split('"').next().unwrap();
        let field = |key: &str| {
            part.split(&format!("\"{key}\": \""))
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .to_string()
        };
        let n = check(ty, &field("file"), &field("tensor"));
        checked.push((ty.to_string(), n));
    }
    println!("checked {checked:?}");
    let types: Vec<&str> = checked.iter().map(|(t, _)| t.as_str()).collect();
    for want in [
        "F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K",
    ] {
        assert!(types.contains(&want), "no reference for {want}: {types:?}");
    }
}

#[test]
fn gemma3_token_embd_rows_match_reference() {
    let model = npuc_testsupport::gemma3_gguf();
    let refp = npuc_testsupport::fixture("llm/gemma3/token_embd_rows_0_2_100.npy");
    let (shape, want) = read_npy_f32(&refp);
    let g = GgufFile::open(&model).unwrap();
    let t = g.tensor("token_embd.weight").unwrap();
    let k = t.row_len() as usize;
    assert_eq!(shape, vec![3, k]);
    let mut got = vec![0f32; 3 * k];
    gather_rows(t.ggml_type, g.tensor_bytes(t), k, &[0, 2, 100], &mut got).unwrap();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "element {i}: ours {a}, reference {b}"
        );
    }
}
