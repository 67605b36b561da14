#!/usr/bin/env bash
# Runs npuc's tests: unit and integration tests (real models against onnxruntime references),
# then the ONNX backend conformance suite. Fetches the data it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo test --release --workspace --no-fail-fast
cargo xtask conformance
cargo xtask conformance --compiled
