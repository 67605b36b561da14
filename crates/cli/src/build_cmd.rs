//! `npuc build PIPELINE.toml` (a GGUF to a bundle of split part artifacts through cached
//! steps, see `npuc_build`) and `npuc inspect BUNDLE_DIR`.

use anyhow::{bail, Context, Result};
use clap::Args;
use npuc_driver::build::BuildRequest;
use npuc_llm::bundle::{BundleManifest, MANIFEST};
use std::path::{Path, PathBuf};

/// `npuc build` arguments.
#[derive(Args, Debug, Clone)]
pub struct BuildArgs {
    /// The pipeline file (TOML, see docs/PIPELINE.md).
    pub pipeline: PathBuf,
    /// Output directory (default: `<pipeline name>.bundle` in the current directory); its
    /// `.cache` holds the step cache.
    #[arg(long, short = 'o')]
    pub out: Option<PathBuf>,
    /// Steps run at once (default: the number of cores).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Print the plan with its cache hits; run nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Run a step again even if cached: a step id (`compile:p1`) or a kind (`compile`);
    /// repeatable.
    #[arg(long, value_name = "STEP")]
    pub force: Vec<String>,
    /// Re-hash every cached file (by default a file is re-hashed only when its size, times or
    /// inode changed since its hash last matched): also finds corruption below the
    /// filesystem, such as a bit flipped on the disk.
    #[arg(long)]
    pub verify_cache: bool,
}

/// glibc's environment variable that pins malloc's mmap threshold (read at process start).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD_VAR: &str = "MALLOC_MMAP_THRESHOLD_";

/// Re-executes this process once with glibc's mmap threshold pinned at 256 KiB (unless the
/// environment already sets it). Why: glibc raises the threshold (up to 32 MiB) each time a
/// large block is freed, then serves blocks under it from its arenas, which keep them resident
/// after they are freed; a build's steps each allocate and free hundreds of MB (weights,
/// activations, artifact buffers), and on the Qwen2.5 example that left 300-600 MB of freed
/// memory resident between steps. Pinned, every block of 256 KiB or more goes back to the
/// system when freed. Measured on the Qwen2.5 example (2 vCPUs): peak RSS 1.13-1.24 GB
/// unpinned, 0.98-1.03 GB at 1 MiB, 0.82-0.85 GB at 256 KiB, for 25-30% more CPU time (page
/// faults of the activations the sanity checks allocate per run). Returns only if the exec
/// fails (then the build runs as it is).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn pin_malloc_threshold() {
    use std::os::unix::process::CommandExt;
    if std::env::var_os(MMAP_THRESHOLD_VAR).is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let err = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(MMAP_THRESHOLD_VAR, "262144")
        .exec();
    eprintln!("note: could not re-execute with {MMAP_THRESHOLD_VAR} set ({err}); building with the default allocator settings");
}

/// Runs `npuc build`: progress lines on stderr, the summary table on stdout.
pub fn cmd(a: &BuildArgs) -> Result<()> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if !a.dry_run {
        pin_malloc_threshold();
    }
    let jobs = match a.jobs {
        Some(0) => bail!("--jobs must be at least 1"),
        Some(j) => j,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let out = match &a.out {
        Some(o) => o.clone(),
        None => {
            let stem = a
                .pipeline
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "pipeline".into());
            PathBuf::from(format!("{stem}.bundle"))
        }
    };
    let req = BuildRequest {
        out_dir: out.clone(),
        jobs,
        dry_run: a.dry_run,
        force: a.force.clone(),
        verify_cache: a.verify_cache,
    };
    let mut progress = |line: &str| eprintln!("{line}");
    if npuc_build::components::is_components_file(&a.pipeline)? {
        return components(&req, a, &mut progress);
    }
    let report = npuc_driver::build::build_pipeline(&a.pipeline, &req, &mut progress)?;
    print!("{}", report.table());
    if !report.sanity.is_empty() {
        println!("sanity checks (each transform step's input vs output on the test vector):");
        print!("{}", report.sanity_table());
    }
    for (file, layers, bytes, over) in &report.parts {
        println!(
            "{file}: layers {}..{}, {bytes} weight bytes ({:.1} MiB){}",
            layers[0],
            layers[1],
            *bytes as f64 / (1 << 20) as f64,
            if *over { "  OVER max_part_bytes" } else { "" }
        );
    }
    if a.dry_run {
        println!(
            "dry run: {} of {} steps would run",
            report
                .steps
                .iter()
                .filter(|s| !matches!(s.status, npuc_driver::build::Status::Cached))
                .count(),
            report.steps.len()
        );
    } else {
        println!(
            "{} in {:.2} s: {} step(s) ran, {} cached",
            out.display(),
            report.seconds,
            report.ran(),
            report.steps.len() - report.ran()
        );
    }
    Ok(())
}

/// `npuc build` of a component pipeline (`[components.<name>]`): per LLM bundle its step
/// table and sanity table, then the component lines (also on stderr as they happen).
fn components(
    req: &BuildRequest,
    a: &BuildArgs,
    progress: &mut dyn npuc_driver::Progress,
) -> Result<()> {
    let r = npuc_driver::components::build_components(&a.pipeline, req, progress)?;
    for (name, report) in &r.llm {
        println!(
            "component {name} (LLM bundle {}):",
            report.out_dir.display()
        );
        print!("{}", report.table());
        if !report.sanity.is_empty() {
            println!("sanity checks (each transform step's input vs output on the test vector):");
            print!("{}", report.sanity_table());
        }
    }
    for l in &r.lines {
        println!("{l}");
    }
    if a.dry_run {
        println!("dry run: nothing built");
    } else {
        let llm_ran: usize = r.llm.iter().map(|(_, b)| b.ran()).sum();
        println!(
            "{} in {:.2} s: {} step(s) ran; manifest {}",
            req.out_dir.display(),
            r.seconds,
            r.ran + llm_ran,
            r.manifest.display()
        );
    }
    Ok(())
}

/// `npuc inspect BUNDLE_DIR`: parts, graphs (AR, ctx), weight bytes per part (flagged over the
/// budget), KV tensors; `verify` also checks each part's sha256 against the manifest.
pub fn inspect_bundle(dir: &Path, json: bool, verify: bool) -> Result<()> {
    let m = BundleManifest::read(dir)?;
    let mut parts = vec![];
    for (i, p) in m.parts.iter().enumerate() {
        let path = dir.join(&p.file);
        let art = npuc_format::Artifact::open(&path)
            .with_context(|| format!("part {} of '{}'", i + 1, dir.display()))?;
        let graphs: Vec<String> = art.graph_names().iter().map(|s| s.to_string()).collect();
        let first = art.model(graphs.first().map(|s| s.as_str()))?;
        // The KV inputs of the first graph (every graph of a part has the same, at its ctx).
        let kv: Vec<String> = first
            .graph
            .inputs
            .iter()
            .filter(|v| v.name.starts_with("past_"))
            .map(|v| match &v.ty {
                Some(t) => format!("{} {}", v.name, crate::artifact::ir_ty(t)),
                None => v.name.clone(),
            })
            .collect();
        let kv_line = match (kv.first(), kv.last()) {
            (Some(a), Some(b)) if kv.len() > 2 => format!(
                "{} tensors in {} (graph {}): {a} ... {b}",
                kv.len(),
                p.file,
                graphs.first().map_or("", |s| s.as_str())
            ),
            _ => kv.join(", "),
        };
        let sha_ok = if verify {
            let got = npuc_build::cache::sha256_file(&path)?;
            Some(got == p.sha256)
        } else {
            None
        };
        let over = m.max_part_bytes.is_some_and(|b| p.weight_bytes > b);
        parts.push((p, graphs, kv, kv_line, sha_ok, over));
    }
    if json {
        let j = serde_json::json!({
            "manifest": m,
            "parts": parts.iter().map(|(p, g, kv, _, sha, over)| serde_json::json!({
                "file": p.file, "layers": p.layers, "weight_bytes": p.weight_bytes,
                "graphs": g, "kv": kv, "sha256_ok": sha, "over_budget": over,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!(
            "bundle {}: {} ({} layers, vocab {}) from {} (sha256 {}), {} part(s)",
            dir.display(),
            m.arch,
            m.n_layers,
            m.vocab,
            match &m.source.imported_from {
                Some(onnx) => format!("{} (imported from {onnx})", m.source.file),
                None => m.source.file.clone(),
            },
            &m.source.sha256[..m.source.sha256.len().min(16)],
            m.parts.len()
        );
        println!(
            "AR variants {:?} x contexts {:?}{}",
            m.ar,
            m.ctx,
            if m.sha {
                ", single-head attention (KV tensors per KV head)"
            } else {
                ""
            }
        );
        if let Some(b) = m.max_part_bytes {
            println!("max_part_bytes {b}");
        }
        for (i, (p, graphs, _, kv_line, sha, over)) in parts.iter().enumerate() {
            println!(
                "part {} ({}): layers {}..{}, {} precision, {} weight bytes ({:.1} MiB){}{}",
                i + 1,
                p.file,
                p.layers[0],
                p.layers[1],
                p.precision,
                p.weight_bytes,
                p.weight_bytes as f64 / (1 << 20) as f64,
                if *over { "  OVER max_part_bytes" } else { "" },
                match sha {
                    Some(true) => ", sha256 ok",
                    Some(false) => ", SHA256 MISMATCH (rebuild with `npuc build`)",
                    None => "",
                }
            );
            println!("  graphs: {}", graphs.join(", "));
            println!("  KV: {kv_line}");
        }
    }
    if parts.iter().any(|(_, _, _, _, sha, _)| *sha == Some(false)) {
        bail!(
            "'{}': a part does not match the sha256 in {MANIFEST}",
            dir.display()
        );
    }
    Ok(())
}
