//! Comparing two runs tensor by tensor (`npuc verify`'s per-layer metrics, `npuc build`'s
//! sanity checks): running sums giving SQNR, cosine and max abs error, and a model copy that
//! exposes intermediate tensors as outputs.

use crate::Value;
use npuc_ir::{Model, Tensor, ValueInfo};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Running sums for one compared tensor.
#[derive(Clone, Copy, Debug, Default)]
pub struct Acc {
    /// Σ ref².
    pub ref2: f64,
    /// Σ (ref - q)².
    pub err2: f64,
    /// Σ ref·q.
    pub dot: f64,
    /// Σ q².
    pub q2: f64,
    /// max |ref - q|.
    pub max_abs: f64,
    /// Elements compared.
    pub n: u64,
}

impl Acc {
    /// Adds one pair of equally long value runs.
    pub fn add_f32(&mut self, r: &[f32], q: &[f32]) {
        let (mut a, mut b, mut c, mut d, mut m) = (0f64, 0f64, 0f64, 0f64, self.max_abs);
        for (&x, &y) in r.iter().zip(q) {
            let (x, y) = (x as f64, y as f64);
            let e = x - y;
            a += x * x;
            b += e * e;
            c += x * y;
            d += y * y;
            // NaN errors must surface as a NaN maximum, not be skipped by f64::max.
            if e.abs() > m || e.is_nan() {
                m = e.abs();
            }
        }
        self.ref2 += a;
        self.err2 += b;
        self.dot += c;
        self.q2 += d;
        self.max_abs = m;
        self.n += r.len() as u64;
    }

    /// Adds one pair of equally long f64 runs.
    pub fn add_f64(&mut self, r: &[f64], q: &[f64]) {
        for (&x, &y) in r.iter().zip(q) {
            let e = x - y;
            self.ref2 += x * x;
            self.err2 += e * e;
            self.dot += x * y;
            self.q2 += y * y;
            if e.abs() > self.max_abs || e.is_nan() {
                self.max_abs = e.abs();
            }
        }
        self.n += r.len() as u64;
    }

    /// Adds a pair of tensors (any float dtypes); `false` when they are not comparable.
    pub fn add(&mut self, r: &Tensor, q: &Tensor) -> bool {
        if r.shape() != q.shape() || !r.dtype().is_float() || !q.dtype().is_float() {
            return false;
        }
        if let (Ok(a), Ok(b)) = (r.as_slice::<f32>(), q.as_slice::<f32>()) {
            self.add_f32(a, b);
            return true;
        }
        match (r.to_f64_vec(), q.to_f64_vec()) {
            (Ok(a), Ok(b)) => {
                self.add_f64(&a, &b);
                true
            }
            _ => false,
        }
    }

    /// SQNR in dB; +inf when the values are identical.
    pub fn sqnr_db(&self) -> f64 {
        if self.err2 == 0.0 {
            return f64::INFINITY;
        }
        10.0 * (self.ref2 / self.err2).log10()
    }

    /// Cosine similarity; 1 when both are all zeros.
    pub fn cosine(&self) -> f64 {
        if self.ref2 == 0.0 && self.q2 == 0.0 {
            return 1.0;
        }
        let den = self.ref2.sqrt() * self.q2.sqrt();
        if den == 0.0 {
            0.0
        } else {
            self.dot / den
        }
    }
}

/// A copy of `m` whose graph outputs are its own outputs followed by `extra` (deduplicated).
pub fn with_outputs(m: &Model, extra: &[String]) -> Model {
    let mut c = m.clone();
    let mut have: HashSet<String> = c.graph.outputs.iter().map(|o| o.name.clone()).collect();
    for e in extra {
        if have.insert(e.clone()) {
            c.graph.outputs.push(ValueInfo::new(e.clone(), None));
        }
    }
    c
}

/// The tensor outputs of a run by name (other values dropped).
pub fn tensors_by_name(outs: Vec<(String, Value)>) -> HashMap<String, Arc<Tensor>> {
    outs.into_iter()
        .filter_map(|(n, v)| match v {
            Value::Tensor(t) => Some((n, t)),
            _ => None,
        })
        .collect()
}
