//! `npuc verify`: the command line over `npuc_driver::verify` (per-layer accuracy of a
//! quantized model against its float reference, `--suggest` for 16-bit promotions).

use anyhow::{anyhow, bail, Context, Result};
use npuc_driver::verify::*;

/// Arguments of `npuc verify`.
#[derive(clap::Args, Debug, Clone)]
pub struct VerifyArgs {
    /// The quantized model (.npuc or QDQ .onnx).
    pub quantized: std::path::PathBuf,
    /// The float model it was quantized from.
    #[arg(long)]
    pub reference: std::path::PathBuf,
    /// Directory of held-out .npy samples (sub-folder per input, `<input>_*.npy`, or, for a
    /// single-input model, every .npy in it).
    #[arg(long)]
    pub inputs: std::path::PathBuf,
    /// Layers below this SQNR are bad; the first one is named.
    #[arg(long = "threshold-db", default_value_t = 20.0)]
    pub threshold_db: f64,
    /// Write a self-contained HTML report here.
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
    /// Run the quantized model as QuantSim (float math with quantize-dequantize).
    #[arg(long)]
    pub simulate: bool,
    /// Propose the tensors (activations, weights) to keep at 16 bits to reach --target-sqnr.
    #[arg(long, requires = "target_sqnr")]
    pub suggest: bool,
    /// Target output SQNR (dB) for --suggest.
    #[arg(long = "target-sqnr")]
    pub target_sqnr: Option<f64>,
    /// Range multiplier for promoted tensors (1: the same real range as the 8-bit pair; larger
    /// values also cut clipping, still at a finer step than 8 bits while below 256).
    #[arg(long, default_value_t = 1.0)]
    pub headroom: f64,
    /// With --suggest: most model evaluations spent pruning the chosen set (each runs every
    /// sample).
    #[arg(long = "prune-evals", default_value_t = 24)]
    pub prune_evals: usize,
    /// `--suggest`: how many of the worst-ranked tensors get a sensitivity run each (the model
    /// with only that tensor at 16 bits); the search adds them most-helpful first.
    #[arg(long = "sensitivity-evals", default_value_t = 64)]
    pub sensitivity_evals: usize,
    /// With --suggest: write the overrides file (JSON) here.
    #[arg(long, requires = "suggest")]
    pub apply: Option<std::path::PathBuf>,
    /// With --suggest: write the promoted QDQ model (.onnx) here.
    #[arg(long = "apply-model", requires = "suggest")]
    pub apply_model: Option<std::path::PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Threads per session (at least 1, as for run and bench).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub threads: usize,
}

/// What `npuc verify` found: the report, and the `--suggest` result when asked for.
pub struct Verified {
    pub report: VerifyReport,
    pub suggestion: Option<promote::Suggestion>,
}

impl Verified {
    /// The JSON object `npuc verify --json` prints.
    pub fn json(&self) -> serde_json::Value {
        let mut j = report_json(&self.report);
        if let Some(s) = &self.suggestion {
            j["suggest"] = serde_json::json!({
                "tensors": s.tensors, "schemes": s.schemes,
                "local_sqnr_db": s.local_sqnr_db.iter().map(|x| json_num(*x)).collect::<Vec<_>>(),
                "sqnr_db": json_num(s.sqnr_db), "cosine": json_num(s.cosine),
                "baseline_db": json_num(s.baseline_db), "all_promoted_db": json_num(s.all_promoted_db),
                "candidates": s.candidates, "reached": s.reached, "target_db": s.target_db,
                "evaluations": s.evaluations,
            });
        }
        j
    }
}

/// `npuc verify` without printing the report (the Python package's `npuc.verify` runs this
/// too): compares, writes `--report`, `--apply` and `--apply-model`; `note` receives the
/// search's progress lines.
pub fn verify(a: &VerifyArgs, note: &mut dyn FnMut(&str)) -> Result<Verified> {
    if !a.threshold_db.is_finite() {
        bail!("--threshold-db must be a number");
    }
    let opts = VerifyOptions {
        threshold_db: a.threshold_db,
        simulate: a.simulate,
        threads: a.threads,
    };
    let (r, q, reference, samples) = verify_files(&a.quantized, &a.reference, &a.inputs, &opts)?;
    if let Some(p) = &a.report {
        let title = a
            .quantized
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        npuc_onnx::export::write_atomic(p, html::render(&r, &title).as_bytes())
            .with_context(|| format!("writing report '{}'", p.display()))?;
    }
    let mut suggestion = None;
    if a.suggest {
        let target = a
            .target_sqnr
            .filter(|t| t.is_finite())
            .ok_or_else(|| anyhow!("--suggest needs --target-sqnr DB"))?;
        let inp = promote::SuggestInput {
            reference: &reference,
            quantized: &q,
            samples: &samples,
            target_db: target,
            headroom: a.headroom,
            ranges: None,
            threads: a.threads,
            simulate: a.simulate,
            prune_evals: a.prune_evals,
            sensitivity_evals: a.sensitivity_evals,
        };
        let (s, promoted) = promote::suggest(&inp, note)?;
        if let Some(p) = &a.apply {
            let default = promote::model_scheme(&q).unwrap_or_else(|| "w8a8".into());
            promote::write_overrides(p, &default, &s)?;
        }
        if let Some(p) = &a.apply_model {
            promote::write_model(p, &promoted)?;
        }
        suggestion = Some(s);
    }
    Ok(Verified {
        report: r,
        suggestion,
    })
}

/// `npuc verify`.
pub fn cmd(a: &VerifyArgs) -> Result<()> {
    let v = verify(a, &mut |m| eprintln!("{m}"))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v.json())?);
        return Ok(());
    }
    let (r, suggestion) = (&v.report, &v.suggestion);
    let text = report_text(r);
    let (body, last) = match text.trim_end().rsplit_once('\n') {
        Some((b, l)) => (b.to_string(), l.to_string()),
        None => (String::new(), text.trim_end().to_string()),
    };
    println!("{body}");
    if let Some(p) = &a.report {
        println!("report written to {}", p.display());
    }
    if let Some(s) = &suggestion {
        if s.reached {
            println!(
                "suggest: keep {} of {} tensors at 16 bits to reach {} dB: {} dB (as given {} dB)",
                s.tensors.len(),
                s.candidates,
                s.target_db,
                fmt_db(s.sqnr_db),
                fmt_db(s.baseline_db)
            );
        } else {
            println!(
                "suggest: target {} dB not reachable at 16 bits: all {} promoted give {} dB (try --headroom)",
                s.target_db,
                s.candidates,
                fmt_db(s.all_promoted_db)
            );
        }
        for ((t, sc), l) in s.tensors.iter().zip(&s.schemes).zip(&s.local_sqnr_db) {
            println!("  {sc} {t}  (local SQNR {} dB)", fmt_db(*l));
        }
        if let Some(p) = &a.apply {
            println!("overrides written to {}", p.display());
        }
        if let Some(p) = &a.apply_model {
            println!("promoted model written to {}", p.display());
        }
    }
    // The final line, exactly `output SQNR: X dB, cosine: Y`.
    println!("{last}");
    Ok(())
}
