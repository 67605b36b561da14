//! `npuc compile` reporting: the step lines (stderr is not a terminal here, so no progress
//! bars), the summary line, and `--print-passes`, whose per-pass op deltas must add up to the
//! difference between the imported model and the op histogram `npuc inspect` reads back from
//! the written artifact.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

fn cache() -> PathBuf {
    npuc_testsupport::cache_dir()
}

fn rec_model() -> PathBuf {
    let p = cache().join("models/ppocrv5/ppocrv5_rec.onnx");
    assert!(
        p.is_file(),
        "{} is missing: run `scripts/fetch-data.sh models` first",
        p.display()
    );
    p
}

/// Parses `  PASS (iteration I): N change(s), nodes A -> B [+x Op, -y Op]`.
fn parse_record(line: &str) -> (String, usize, usize, Vec<(String, i64)>) {
    let line = line.trim();
    let (pass, rest) = line
        .split_once(" (iteration ")
        .expect("record has a pass name");
    let (_, rest) = rest.split_once(", nodes ").expect("record has node counts");
    let (counts, ops) = match rest.split_once(" [") {
        Some((c, o)) => (c, o.trim_end_matches(']')),
        None => (rest, ""),
    };
    let (a, b) = counts.split_once(" -> ").expect("nodes A -> B");
    let ops = ops
        .split(", ")
        .filter(|s| !s.is_empty())
        .map(|s| {
            let (d, op) = s.split_once(' ').expect("delta and op");
            (op.to_string(), d.parse::<i64>().expect("signed delta"))
        })
        .collect();
    (
        pass.to_string(),
        a.parse().expect("node count"),
        b.parse().expect("node count"),
        ops,
    )
}

#[test]
fn print_passes_adds_up_to_the_artifact() {
    let model = rec_model();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("rec.npuc");
    let o = Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args(["compile"])
        .arg(&model)
        .args(["-o"])
        .arg(&out)
        .args(["--input-shape", "x=1x3x48x320", "--print-passes"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "compile failed: {stderr}");

    // Step lines, in order, each with its duration.
    let steps = [
        "imported",
        "optimized",
        "planned memory",
        "serialized",
        "wrote",
    ];
    let mut at = 0;
    for s in steps {
        let i = stderr[at..]
            .find(s)
            .unwrap_or_else(|| panic!("no '{s}' step line after byte {at} in:\n{stderr}"));
        at += i + s.len();
        let line_end = stderr[at..]
            .find('\n')
            .map(|e| at + e)
            .unwrap_or(stderr.len());
        assert!(
            stderr[at..line_end].ends_with(" ms)"),
            "step line '{s}' has no duration: {}",
            &stderr[at..line_end]
        );
    }

    // The imported model's op histogram.
    let m = npuc_onnx::load_model(&model).unwrap();
    let mut hist: BTreeMap<String, i64> = BTreeMap::new();
    for n in &m.graph.nodes {
        *hist.entry(n.op_type.clone()).or_insert(0) += 1;
    }
    let mut nodes = m.graph.nodes.len();
    let records: Vec<_> = stdout
        .lines()
        .filter(|l| l.contains(" (iteration "))
        .map(parse_record)
        .collect();
    assert!(records.len() >= 5, "too few pass records:\n{stdout}");
    for (pass, a, b, ops) in &records {
        assert_eq!(*a, nodes, "{pass}: node count does not chain:\n{stdout}");
        let sum: i64 = ops.iter().map(|o| o.1).sum();
        assert_eq!(
            sum,
            *b as i64 - *a as i64,
            "{pass}: op deltas do not add up"
        );
        for (op, d) in ops {
            *hist.entry(op.clone()).or_insert(0) += d;
        }
        nodes = *b;
    }
    for p in ["conv-bn-fold", "layernorm-fusion", "activation-fusion"] {
        assert!(
            records.iter().any(|r| r.0 == p),
            "{p} did not report:\n{stdout}"
        );
    }
    hist.retain(|_, v| *v != 0);

    // The summary line.
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("compiled 1 graph into "))
        .expect("summary line");
    assert!(summary.contains(&format!("nodes {} -> {nodes},", m.graph.nodes.len())));
    for key in ["MB unique", "MB referenced", "arena ", " s"] {
        assert!(summary.contains(key), "summary lacks '{key}': {summary}");
    }

    // What the artifact holds.
    let o = Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args(["inspect"])
        .arg(&out)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success());
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let g = &j["graphs"][0];
    assert_eq!(g["nodes"].as_u64().unwrap() as usize, nodes);
    let art: BTreeMap<String, i64> = g["op_histogram"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_i64().unwrap()))
        .collect();
    assert_eq!(hist, art, "per-pass deltas disagree with the artifact");
    assert!(g["arena_bytes"].as_u64().unwrap() > 1_000_000);
}

#[test]
fn unknown_disabled_pass_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("rec.npuc");
    let o = Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args(["compile"])
        .arg(rec_model())
        .args(["-o"])
        .arg(&out)
        .args(["--disable-pass", "const-folding"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("--disable-pass const-folding: no such pass")
            && stderr.contains("const-fold"),
        "{stderr}"
    );
    assert!(!out.exists());
}
