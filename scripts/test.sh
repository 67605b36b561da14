#!/usr/bin/env bash
# Runs npuc's tests: unit and integration tests (real models against onnxruntime references),
# the Python package's tests (scripts/python_test.sh: wheel built and pip-installed, pytest),
# then the ONNX backend conformance suite. Fetches the data it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Check the graph after every optimization pass (names, order, types, op contracts) in the
# release-built tests too; a broken pass fails with its name.
export NPUC_VERIFY_PASSES=1
cargo test --release --workspace --no-fail-fast
scripts/python_test.sh
# The conformance runner as `cargo test --workspace` built it (xtask/tests/conformance_cli.rs);
# `cargo xtask` would rebuild ~40 crates with a single-package feature set.
"${CARGO_TARGET_DIR:-target}/release/xtask" conformance
"${CARGO_TARGET_DIR:-target}/release/xtask" conformance --compiled
