//! Shared test helpers: fixture paths and the reference arrays (`.npy`,
//! through `npuc-npy`).

#![allow(dead_code)]

use std::path::PathBuf;

/// `tests/fixtures/llm` of the repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llm")
}

/// Reads a `.npy` array (any numeric dtype, converted) as (shape, f32 values).
pub fn read_npy(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
    let t = npuc_npy::read_npy(path).unwrap_or_else(|e| panic!("{e}"));
    let vals = t
        .to_f64_vec()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .map(|v| v as f32)
        .collect();
    (t.shape().to_vec(), vals)
}

/// Max |a - b|.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
