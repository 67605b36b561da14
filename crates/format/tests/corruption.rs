//! Damaged, truncated, foreign, future and mis-targeted artifacts: every one must be refused
//! by `Artifact::open`/`from_bytes` with the right error kind and a precise message (never a
//! panic), and damaged weights must be caught by `verify_weights`.

mod common;

use common::{sample_writer, Rng};
use npuc_format::{
    Artifact, ArtifactWriter, FormatError, GraphInfo, Target, FORMAT_MAJOR, HEADER_LEN, MAGIC,
    PAGE, SECTION_ENTRY_LEN, SECTION_META, SECTION_WEIGHTS,
};
use std::path::Path;
use xxhash_rust::xxh3::xxh3_64;

const P: &str = "t.npuc";

fn load(bytes: &[u8]) -> Result<Artifact, FormatError> {
    Artifact::from_bytes(Path::new(P), bytes.to_vec())
}

fn corrupt_what(r: Result<Artifact, FormatError>, case: &str) -> (String, u64) {
    match r {
        Err(FormatError::Corrupt { path, what, offset }) => {
            assert_eq!(path, Path::new(P), "{case}");
            (what, offset)
        }
        Err(e) => panic!("{case}: expected Corrupt, got {e:?}"),
        Ok(_) => panic!("{case}: a damaged artifact was accepted"),
    }
}

/// The byte ranges of a writer's output: (meta_off, meta_len, weights_off, len).
struct Layout {
    table_end: usize,
    meta: (usize, usize),
    weights: usize,
    len: usize,
}

fn le64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

fn layout(b: &[u8]) -> Layout {
    let n = u32::from_le_bytes(b[16..20].try_into().unwrap()) as usize;
    let table = le64(b, 24) as usize;
    let (mut meta, mut weights) = ((0, 0), 0);
    for i in 0..n {
        let e = table + i * SECTION_ENTRY_LEN;
        let kind = u32::from_le_bytes(b[e..e + 4].try_into().unwrap());
        let (off, len) = (le64(b, e + 8) as usize, le64(b, e + 16) as usize);
        match kind {
            SECTION_META => meta = (off, len),
            SECTION_WEIGHTS => weights = off,
            _ => {}
        }
    }
    Layout {
        table_end: table + n * SECTION_ENTRY_LEN,
        meta,
        weights,
        len: b.len(),
    }
}

/// Builds an artifact by hand from the layout in docs/FORMAT.md, so tests can produce files
/// a writer never would (other versions, extra sections, edited META) with valid checksums.
fn assemble(
    major: u16,
    minor: u16,
    meta: &[u8],
    weights: &[u8],
    extra: &[(u32, &[u8])],
) -> Vec<u8> {
    let n = 2 + extra.len();
    let table = HEADER_LEN;
    let mut out = vec![0u8; table + n * SECTION_ENTRY_LEN];
    let mut sections = vec![];
    let mut push = |out: &mut Vec<u8>, kind: u32, align: usize, data: &[u8]| {
        let off = out.len().next_multiple_of(align);
        out.resize(off, 0);
        out.extend_from_slice(data);
        sections.push((kind, align as u32, off, data.len()));
    };
    push(&mut out, SECTION_META, 1, meta);
    for (k, d) in extra {
        push(&mut out, *k, 8, d);
    }
    push(&mut out, SECTION_WEIGHTS, PAGE, weights);
    for (i, (kind, align, off, len)) in sections.iter().enumerate() {
        let e = table + i * SECTION_ENTRY_LEN;
        let sum = if *kind == SECTION_META {
            xxh3_64(meta)
        } else {
            0
        };
        out[e..e + 4].copy_from_slice(&kind.to_le_bytes());
        out[e + 4..e + 8].copy_from_slice(&align.to_le_bytes());
        out[e + 8..e + 16].copy_from_slice(&(*off as u64).to_le_bytes());
        out[e + 16..e + 24].copy_from_slice(&(*len as u64).to_le_bytes());
        out[e + 24..e + 32].copy_from_slice(&sum.to_le_bytes());
    }
    out[0..8].copy_from_slice(&MAGIC);
    out[8..10].copy_from_slice(&major.to_le_bytes());
    out[10..12].copy_from_slice(&minor.to_le_bytes());
    out[16..20].copy_from_slice(&(n as u32).to_le_bytes());
    out[24..32].copy_from_slice(&(table as u64).to_le_bytes());
    let total = out.len() as u64;
    out[32..40].copy_from_slice(&total.to_le_bytes());
    fix_header_checksum(&mut out);
    out
}

fn fix_header_checksum(out: &mut [u8]) {
    let n = u32::from_le_bytes(out[16..20].try_into().unwrap()) as usize;
    let table = le64(out, 24) as usize;
    let mut h = out[..HEADER_LEN].to_vec();
    h[40..48].fill(0);
    h.extend_from_slice(&out[table..table + n * SECTION_ENTRY_LEN]);
    let sum = xxh3_64(&h);
    out[40..48].copy_from_slice(&sum.to_le_bytes());
}

/// The sample artifact's META (as JSON) and weights blob.
fn parts() -> (serde_json::Value, Vec<u8>) {
    let w = sample_writer();
    let bytes = w.to_bytes().unwrap();
    let l = layout(&bytes);
    let meta = serde_json::to_value(w.meta()).unwrap();
    (meta, bytes[l.weights..].to_vec())
}

fn with_meta(meta: &serde_json::Value, weights: &[u8]) -> Vec<u8> {
    assemble(
        FORMAT_MAJOR,
        0,
        &serde_json::to_vec(meta).unwrap(),
        weights,
        &[],
    )
}

#[test]
fn hand_assembled_artifact_matches_the_writer() {
    // The documented layout is enough to produce the writer's exact bytes.
    let w = sample_writer();
    let bytes = w.to_bytes().unwrap();
    let (_, weights) = parts();
    let meta = serde_json::to_vec(w.meta()).unwrap();
    assert!(assemble(FORMAT_MAJOR, 0, &meta, &weights, &[]) == bytes);
}

#[test]
fn every_header_and_table_bit_flip_is_refused() {
    let good = sample_writer().to_bytes().unwrap();
    let l = layout(&good);
    let mut n = 0;
    for p in 0..l.table_end {
        for bit in 0..8 {
            let mut b = good.clone();
            b[p] ^= 1 << bit;
            let case = format!("bit {bit} of byte {p}");
            n += 1;
            match p {
                0..8 => match load(&b) {
                    Err(FormatError::Magic { found, .. }) => assert_eq!(found, &b[..8], "{case}"),
                    other => panic!("{case}: expected Magic, got {:?}", other.err()),
                },
                8..10 => {
                    let major = u16::from_le_bytes([b[8], b[9]]);
                    match load(&b) {
                        Err(e @ FormatError::Version { .. }) => {
                            assert!(major > FORMAT_MAJOR, "{case}");
                            assert_eq!(
                                e.to_string(),
                                format!("'{P}' uses format version {major}.0, newer than this npuc reads (1.x); upgrade npuc or recompile the model with this version"),
                            );
                        }
                        r => {
                            assert_eq!(major, 0, "{case}");
                            let (what, off) = corrupt_what(r, &case);
                            assert_eq!(
                                (what.as_str(), off),
                                ("format major version 0 is invalid", 8)
                            );
                        }
                    }
                }
                32..40 => {
                    let (what, off) = corrupt_what(load(&b), &case);
                    let claimed = le64(&b, 32);
                    assert_eq!(
                        what,
                        format!("header says the file is {claimed} bytes, it is {} (truncated or appended to)", l.len),
                        "{case}"
                    );
                    assert_eq!(off, 32);
                }
                16..20 | 24..32 => {
                    let (what, off) = corrupt_what(load(&b), &case);
                    assert!(
                        (what == "the section table lies outside the file" && off == 24)
                            || (what == "header checksum mismatch" && off == 40),
                        "{case}: {what} at {off}"
                    );
                }
                _ => {
                    let r = load(&b);
                    let e = r.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
                    let (what, off) = corrupt_what(r, &case);
                    assert_eq!(
                        (what.as_str(), off),
                        ("header checksum mismatch", 40),
                        "{case}"
                    );
                    assert_eq!(
                        e,
                        format!("'{P}' is corrupt: header checksum mismatch (offset 40); recompile it or restore the file")
                    );
                }
            }
        }
    }
    assert!(n >= 1000, "{n}");
}

#[test]
fn meta_bit_flips_fail_the_meta_checksum() {
    let good = sample_writer().to_bytes().unwrap();
    let l = layout(&good);
    let (moff, mlen) = l.meta;
    assert!(mlen > 1000, "META is only {mlen} bytes");
    let mut rng = Rng(1);
    for p in moff..moff + mlen {
        let mut b = good.clone();
        b[p] ^= 1 << rng.range(0, 8);
        let (what, off) = corrupt_what(load(&b), &format!("META byte {p}"));
        assert_eq!(
            (what.as_str(), off),
            ("META checksum mismatch", moff as u64)
        );
    }
}

#[test]
fn weight_bit_flips_are_caught_by_verify_weights() {
    let w = sample_writer();
    let good = w.to_bytes().unwrap();
    let l = layout(&good);
    // Which weight (if any) each byte of the weights section belongs to.
    let owner = |p: usize| -> Option<usize> {
        let rel = (p - l.weights) as u64;
        w.meta()
            .weights
            .iter()
            .position(|d| d.strings.is_none() && rel >= d.offset && rel < d.offset + d.len)
    };
    let mut rng = Rng(2);
    let mut positions: Vec<usize> = (0..2000).map(|_| rng.range(l.weights, l.len)).collect();
    for d in &w.meta().weights {
        if d.strings.is_none() && d.len > 0 {
            positions.push(l.weights + d.offset as usize);
            positions.push(l.weights + (d.offset + d.len) as usize - 1);
        }
    }
    // Padding between META and the page-aligned weights is not covered: flips there are harmless.
    positions.extend(l.meta.0 + l.meta.1..l.weights);
    let mut caught = 0;
    for p in positions {
        let mut b = good.clone();
        b[p] ^= 1 << rng.range(0, 8);
        let a = load(&b).unwrap_or_else(|e| panic!("byte {p}: {e}"));
        let bad = a.verify_weights();
        let want: Vec<usize> = if p >= l.weights {
            owner(p).into_iter().collect()
        } else {
            vec![]
        };
        assert_eq!(bad, want, "flip at byte {p}");
        caught += bad.len();
        // The model still loads: weights are checked lazily, on request.
        a.model(None).unwrap();
    }
    assert!(caught > 1000, "{caught}");
}

#[test]
fn random_multi_byte_damage_never_panics_and_is_reported() {
    let good = sample_writer().to_bytes().unwrap();
    let l = layout(&good);
    let mut rng = Rng(3);
    for case in 0..3000 {
        let mut b = good.clone();
        // Anywhere before the weights (whose damage verify_weights reports instead).
        let start = rng.range(0, l.weights - 8);
        let n = rng.range(1, 9);
        for p in start..(start + n).min(b.len()) {
            b[p] = rng.next() as u8;
        }
        if b == good {
            continue;
        }
        let changed_covered =
            (start..start + n).any(|p| p < l.meta.0 + l.meta.1 && b[p] != good[p]);
        match load(&b) {
            Ok(a) => {
                assert!(
                    !changed_covered,
                    "case {case}: damage at {start}..+{n} accepted"
                );
                assert!(a.verify_weights().is_empty());
            }
            Err(e) => {
                assert!(changed_covered, "case {case}: {e}");
                assert!(
                    matches!(
                        e,
                        FormatError::Magic { .. }
                            | FormatError::Version { .. }
                            | FormatError::Corrupt { .. }
                    ),
                    "case {case}: {e:?}"
                );
                assert!(e.to_string().starts_with(&format!("'{P}'")), "{e}");
            }
        }
    }
}

#[test]
fn truncation_anywhere_is_refused() {
    let w = sample_writer();
    let good = w.to_bytes().unwrap();
    let l = layout(&good);
    let mut cuts = vec![
        0,
        1,
        7,
        8,
        9,
        HEADER_LEN - 1,
        HEADER_LEN,
        HEADER_LEN + 1,
        l.table_end - 1,
        l.table_end,
        l.meta.0 + l.meta.1 - 1,
        l.meta.0 + l.meta.1,
        l.weights - 1,
        l.weights,
        l.len - 1,
    ];
    for d in &w.meta().weights {
        if d.strings.is_none() {
            cuts.push(l.weights + d.offset as usize);
            cuts.push(l.weights + (d.offset + d.len) as usize);
        }
    }
    let mut rng = Rng(4);
    cuts.extend((0..500).map(|_| rng.range(0, l.len)));
    for cut in cuts.into_iter().filter(|&c| c < l.len) {
        let case = format!("cut at {cut}");
        let r = load(&good[..cut]);
        if cut < 8 {
            match r {
                Err(FormatError::Magic { found, .. }) => assert_eq!(found, &good[..cut]),
                other => panic!("{case}: {:?}", other.err()),
            }
            continue;
        }
        let (what, off) = corrupt_what(r, &case);
        if cut < HEADER_LEN {
            assert_eq!(
                what, "the file is shorter than its header (truncated)",
                "{case}"
            );
            assert_eq!(off, cut as u64);
        } else {
            assert_eq!(
                what,
                format!(
                    "header says the file is {} bytes, it is {cut} (truncated or appended to)",
                    l.len
                ),
                "{case}"
            );
        }
    }
    // Appended bytes too.
    let mut b = good.clone();
    b.extend_from_slice(&[0; 3]);
    let (what, _) = corrupt_what(load(&b), "appended");
    assert!(what.contains("truncated or appended to"), "{what}");
}

#[test]
fn truncated_and_empty_files_are_refused_by_open() {
    let dir = tempfile::tempdir().unwrap();
    let good = sample_writer().to_bytes().unwrap();
    for cut in [0, 5, 40, 100, good.len() / 2, good.len() - 1] {
        let p = dir.path().join(format!("{cut}.npuc"));
        std::fs::write(&p, &good[..cut]).unwrap();
        let e = Artifact::open(&p)
            .err()
            .unwrap_or_else(|| panic!("cut {cut} opened"));
        match (&e, cut < 8) {
            (FormatError::Magic { .. }, true) | (FormatError::Corrupt { .. }, false) => {}
            _ => panic!("cut {cut}: {e:?}"),
        }
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
    }
    let e = Artifact::open(&dir.path().join("absent.npuc"))
        .err()
        .unwrap();
    assert!(matches!(e, FormatError::Io { .. }), "{e:?}");
    assert!(e.to_string().starts_with("cannot access '"), "{e}");
}

#[test]
fn foreign_files_are_not_artifacts() {
    for (what, bytes) in [
        ("onnx", b"\x08\x07\x12\x07pytorch:\x0bsome graph".to_vec()),
        ("old magic", b"NPUCBIN\x01rest of a header".to_vec()),
        ("text", b"hello".to_vec()),
        ("zeros", vec![0u8; 4096]),
    ] {
        let e = load(&bytes)
            .err()
            .unwrap_or_else(|| panic!("{what} accepted"));
        let FormatError::Magic { found, .. } = &e else {
            panic!("{what}: {e:?}")
        };
        assert_eq!(found, &bytes[..bytes.len().min(8)]);
        assert!(
            e.to_string()
                .starts_with(&format!("'{P}' is not an npuc artifact (bad magic")),
            "{e}"
        );
    }
}

#[test]
fn a_future_major_version_is_refused_before_anything_else() {
    let (meta, weights) = parts();
    let meta = serde_json::to_vec(&meta).unwrap();
    let future = assemble(FORMAT_MAJOR + 1, 5, &meta, &weights, &[]);
    let e = load(&future).err().unwrap();
    assert!(
        matches!(e, FormatError::Version { major, minor: 5, .. } if major == FORMAT_MAJOR + 1),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        format!("'{P}' uses format version {}.5, newer than this npuc reads (1.x); upgrade npuc or recompile the model with this version", FORMAT_MAJOR + 1)
    );
    // A newer major may change everything after the version field: refused on the version
    // alone, even when the rest does not parse as this version's layout.
    let mut b = future.clone();
    b[16..64].fill(0xa5);
    assert!(matches!(load(&b), Err(FormatError::Version { .. })));
}

#[test]
fn newer_minor_versions_unknown_sections_and_meta_fields_are_accepted() {
    let (mut meta, weights) = parts();
    meta["added_in_1_9"] = serde_json::json!({"anything": [1, 2, 3]});
    meta["graphs"][0]["future_field"] = serde_json::json!("x");
    meta["weights"][0]["future_field"] = serde_json::json!(7);
    let meta = serde_json::to_vec(&meta).unwrap();
    let b = assemble(
        FORMAT_MAJOR,
        9,
        &meta,
        &weights,
        &[
            (77, b"an unknown section".as_slice()),
            (0xffff_ffff, b"".as_slice()),
        ],
    );
    let a = load(&b).unwrap();
    assert_eq!(
        a.meta.format_minor, 0,
        "META's own version fields are informational"
    );
    let want = load(&sample_writer().to_bytes().unwrap()).unwrap();
    assert_eq!(a.model(None).unwrap(), want.model(None).unwrap());
    assert!(a.verify_weights().is_empty());
}

#[test]
fn structurally_bad_but_checksummed_files_are_refused() {
    let (meta, weights) = parts();
    let m = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = meta.clone();
        f(&mut v);
        with_meta(&v, &weights)
    };
    let wlen = weights.len() as u64;
    // (case, file, expected message of `from_bytes` or, when it loads, of `model`)
    let cases: Vec<(&str, Vec<u8>, String)> = vec![
        (
            "weight past the section",
            m(&|v| v["weights"][1]["offset"] = wlen.into()),
            "weight 1 lies outside the weights section".into(),
        ),
        (
            "weight length overflows",
            m(&|v| v["weights"][0]["len"] = u64::MAX.into()),
            "weight 0 lies outside the weights section".into(),
        ),
        (
            "META not JSON",
            assemble(1, 0, b"{not json", &weights, &[]),
            "META is not valid".into(),
        ),
        (
            "META wrong shape",
            assemble(1, 0, b"[]", &weights, &[]),
            "META is not valid".into(),
        ),
        (
            "unknown dtype",
            m(&|v| v["weights"][0]["dtype"] = "complex512".into()),
            "weight 0 has unknown dtype 'complex512'".into(),
        ),
        (
            "dangling weight index",
            m(&|v| v["graphs"][0]["body"]["initializers"][0][1] = 100000.into()),
            "reference to weight 100000, which does not exist".into(),
        ),
        (
            "overflowing shape",
            m(&|v| v["weights"][0]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40])),
            "weight 0 has an impossible shape".into(),
        ),
        (
            "shape disagrees with length",
            m(&|v| v["weights"][0]["shape"] = serde_json::json!([3, 5])),
            "weight 0: ".into(),
        ),
    ];
    for (case, bytes, want) in cases {
        let err = match load(&bytes) {
            Err(e) => e,
            Ok(a) => a
                .model(None)
                .err()
                .unwrap_or_else(|| panic!("{case}: accepted")),
        };
        let FormatError::Corrupt { what, .. } = &err else {
            panic!("{case}: {err:?}")
        };
        assert!(what.starts_with(&want), "{case}: {what}");
    }
    // No META section at all (only weights), and a section outside the file.
    let mut b = assemble(1, 0, b"{}", &weights, &[]);
    b[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&99u32.to_le_bytes());
    fix_header_checksum(&mut b);
    assert_eq!(corrupt_what(load(&b), "no META").0, "no META section");
    let mut b = with_meta(&meta, &weights);
    let e = HEADER_LEN + SECTION_ENTRY_LEN;
    b[e + 16..e + 24].copy_from_slice(&(wlen + 1).to_le_bytes());
    fix_header_checksum(&mut b);
    assert_eq!(
        corrupt_what(load(&b), "section past EOF").0,
        "section 1 (kind 2) lies outside the file"
    );
}

#[test]
fn checksummed_meta_number_fuzz_never_panics() {
    // Checksums only detect accidents. Rewrite numbers in META (offsets, lengths, shapes,
    // weight indices, dims) and re-checksum: loading must still fail cleanly or succeed.
    let (meta, weights) = parts();
    let text = serde_json::to_string(&meta).unwrap();
    let digits: Vec<usize> = text
        .bytes()
        .enumerate()
        .filter(|(_, c)| c.is_ascii_digit())
        .map(|(i, _)| i)
        .collect();
    let mut rng = Rng(5);
    let (mut loaded, mut refused) = (0, 0);
    for case in 0..3000 {
        let mut t = text.clone().into_bytes();
        for _ in 0..rng.range(1, 4) {
            let p = digits[rng.range(0, digits.len())];
            match rng.range(0, 3) {
                0 => t[p] = b'0' + rng.range(0, 10) as u8,
                1 => t
                    .splice(p..p, std::iter::repeat_n(b'9', rng.range(1, 20)))
                    .for_each(drop),
                _ => t[p] = b'0',
            }
            if t.len() != text.len() {
                break; // later positions moved
            }
        }
        let b = assemble(1, 0, &t, &weights, &[]);
        let r = std::panic::catch_unwind(|| match load(&b) {
            Ok(a) => {
                let _ = a.verify_weights();
                for g in a.graph_names() {
                    let _ = a.model(Some(g));
                }
                true
            }
            Err(e) => {
                assert!(matches!(e, FormatError::Corrupt { .. }), "{e:?}");
                false
            }
        });
        match r {
            Ok(true) => loaded += 1,
            Ok(false) => refused += 1,
            Err(_) => panic!(
                "case {case} panicked; META: {}",
                String::from_utf8_lossy(&t)
            ),
        }
    }
    assert!(
        loaded > 0 && refused > 0,
        "{loaded} loaded, {refused} refused"
    );
}

fn foreign_target() -> &'static str {
    if std::env::consts::ARCH == "aarch64" {
        "cpu-x86_64"
    } else {
        "cpu-aarch64"
    }
}

#[test]
fn an_artifact_for_another_architecture_is_refused_by_open() {
    let target = Target::parse(foreign_target()).unwrap();
    let mut w = ArtifactWriter::new(target.clone(), serde_json::Value::Null);
    w.add_graph("g", &common::sample_model(), GraphInfo::default())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("other.npuc");
    w.write(&p).unwrap();
    let e = Artifact::open(&p).err().expect("foreign artifact opened");
    let host = Target::host().name;
    let FormatError::Target {
        found, expected, ..
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(
        (found.as_str(), expected.as_str()),
        (target.name.as_str(), host.as_str())
    );
    assert_eq!(
        e.to_string(),
        format!(
            "'{}' was compiled for target '{}', this machine is '{host}' (architecture {} vs {}); recompile with `npuc compile --target {host}`",
            p.display(),
            target.name,
            target.arch,
            std::env::consts::ARCH
        )
    );
    // In-memory parsing does not check the target (see docs/FORMAT.md): tools may inspect
    // artifacts for other machines.
    let a = Artifact::from_bytes(&p, std::fs::read(&p).unwrap()).unwrap();
    assert_eq!(a.meta.target, target);
}

#[test]
fn an_artifact_needing_missing_cpu_features_is_refused_by_open() {
    let (mut meta, weights) = parts();
    meta["target"] = serde_json::json!({
        "name": "cpu-future",
        "arch": std::env::consts::ARCH,
        "features": ["no-such-feature"],
    });
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("f.npuc");
    std::fs::write(&p, with_meta(&meta, &weights)).unwrap();
    let e = Artifact::open(&p).err().expect("opened");
    assert!(matches!(e, FormatError::Target { .. }), "{e:?}");
    assert!(e.to_string().contains("'cpu-future'"), "{e}");
    assert!(
        e.to_string().contains("(the CPU lacks no-such-feature)"),
        "{e}"
    );
}

#[test]
fn targets_parse_and_round_trip() {
    for (s, arch, feats) in [
        ("cpu-x86_64", "x86_64", vec![]),
        ("cpu-x86_64-avx2", "x86_64", vec!["avx2", "fma"]),
        ("cpu-aarch64", "aarch64", vec![]),
    ] {
        let t = Target::parse(s).unwrap();
        assert_eq!((t.name.as_str(), t.arch.as_str()), (s, arch));
        assert_eq!(t.features, feats);
    }
    let host = Target::host();
    assert!(host.runnable_here().is_ok());
    assert_eq!(Target::parse(&host.name).unwrap(), host);
    for bad in ["x86_64", "cpu-riscv64", "cpu-x86_64-avx512", ""] {
        let e = Target::parse(bad).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("unknown target '{bad}'; known: cpu-x86_64, cpu-x86_64-avx2, cpu-aarch64")
        );
    }
}
