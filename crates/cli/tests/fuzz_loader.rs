//! Mutation fuzzing of the ONNX loader and the runtime: thousands of corrupted copies of the
//! conformance suite's models (bit flips, overwritten bytes, truncation, spliced chunks) must
//! each load with an error or load and then run/fail cleanly — never panic.

use npuc_runtime::{Session, SessionOptions, Value};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};

/// xorshift64*: deterministic, so a failure reproduces from the printed seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn suite() -> PathBuf {
    let c = npuc_testsupport::cache_dir();
    let d = c.join("suite/onnx-1.22.0/data/node");
    assert!(
        d.is_dir(),
        "{} is missing: run `scripts/fetch-data.sh suite`",
        d.display()
    );
    d
}

fn mutate(rng: &mut Rng, orig: &[u8]) -> Vec<u8> {
    let mut b = orig.to_vec();
    match rng.below(5) {
        0 => {
            for _ in 0..1 + rng.below(8) {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
        }
        1 => {
            let i = rng.below(b.len());
            b[i] = rng.next() as u8;
        }
        2 => b.truncate(rng.below(b.len())),
        3 => {
            let (i, j) = (rng.below(b.len()), rng.below(b.len()));
            let (lo, hi) = (i.min(j), i.max(j).min(i.min(j) + 64));
            let chunk = b[lo..hi].to_vec();
            let at = rng.below(b.len());
            b.splice(at..at, chunk);
        }
        _ => {
            // Random bytes with a plausible start.
            let n = rng.below(256);
            b.truncate(4.min(b.len()));
            b.extend((0..n).map(|_| rng.next() as u8));
        }
    }
    b
}

fn inputs_of(dir: &Path, m: &npuc_ir::Model) -> Vec<(String, Value)> {
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
fn mutated_suite_models_never_panic() {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(suite())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    dirs.sort();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Every 25th test: about 70 models across the op families.
    let picked: Vec<&PathBuf> = dirs.iter().step_by(25).collect();
    let mut loaded = 0usize;
    let mut ran = 0usize;
    let mut cases = 0usize;
    for dir in picked {
        let orig = std::fs::read(dir.join("model.onnx")).unwrap();
        let Ok(clean) = npuc_onnx::load_model_bytes(orig.clone(), &dir.join("model.onnx")) else {
            continue;
        };
        let feeds = inputs_of(dir, &clean);
        for k in 0..50 {
            cases += 1;
            let bytes = mutate(&mut rng, &orig);
            let name = format!("{} mutation {k}", dir.display());
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                let Ok(m) = npuc_onnx::load_model_bytes(bytes, Path::new(&name)) else {
                    return (false, false);
                };
                let Ok(s) = Session::new(&m, SessionOptions::default()) else {
                    return (true, false);
                };
                let _ = s.run(feeds.clone());
                (true, true)
            }));
            match r {
                Ok((l, r)) => {
                    loaded += l as usize;
                    ran += r as usize;
                }
                Err(_) => panic!("panic on {name}"),
            }
        }
    }
    eprintln!("{cases} mutated models: {loaded} loaded, {ran} planned and run");
    assert!(cases >= 3000, "only {cases} cases");
}
