//! Developer tasks: `cargo xtask conformance` (the ONNX backend test suite), `cargo xtask fetch`.

mod conformance;
mod synth;

use anyhow::{bail, Result};
use std::path::PathBuf;

/// Where downloaded models and suites live: `$NPUC_CACHE` or `~/.cache/npuc`.
pub use npuc_testsupport::cache_dir;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The suite covers ImageDecoder and RegexFullMatch, whose kernels are an op pack.
    npuc_ops_ext::register();
    match args.first().map(|s| s.as_str()) {
        Some("conformance") => conformance::main(&args[1..]),
        Some("synth-model") => synth::main(&args[1..]),
        Some("fetch") => {
            let status = std::process::Command::new("bash")
                .arg(repo_root().join("scripts/fetch-data.sh"))
                .args(&args[1..])
                .status()?;
            if !status.success() {
                bail!("fetch failed");
            }
            Ok(())
        }
        _ => {
            eprintln!(
                "usage: cargo xtask conformance [--suite DIR] [--op NAME] [--test SUBSTR] [--compiled] [--json] [--verbose]\n       cargo xtask fetch [suite|models|all]\n       cargo xtask synth-model OUT.onnx [--megabytes N]"
            );
            std::process::exit(2)
        }
    }
}
