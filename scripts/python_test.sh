#!/usr/bin/env bash
# The Python package's tests: builds the `npuc` wheel with maturin (release, in the workspace's
# target dir with its release profile, so the npuc crates `cargo test --release` built are
# reused), installs it with pip into the test venv ($NPUC_CACHE/venv, made by scripts/setup.sh)
# and runs pytest on crates/python/tests (which also runs the `npuc` binary).
# Usage: scripts/python_test.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
PY=${NPUC_PYTHON:-$CACHE/venv/bin/python}
if ! "$PY" -c 'import maturin, pytest' 2>/dev/null; then
  echo "the Python test venv ($PY) lacks maturin/pytest: run scripts/setup.sh" >&2
  exit 1
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
wheels="$CARGO_TARGET_DIR/wheels"
t0=$(date +%s)
# The `npuc` binary the tests compare with, built with the workspace's test build (after `cargo test
# --release --workspace`, as in scripts/test.sh, this is a no-op; `cargo build -p npuc-cli` alone
# would resolve features differently and recompile most crates). $NPUC_BIN: use that binary.
if [ -z "${NPUC_BIN:-}" ]; then
  cargo test --release --workspace --no-run
fi
t1=$(date +%s)
rm -f "$wheels"/npuc-*.whl
"$PY" -m maturin build --release --manifest-path crates/python/Cargo.toml --interpreter "$PY" --out "$wheels"
t2=$(date +%s)
echo "python_test: npuc binary $((t1 - t0)) s, wheel $((t2 - t1)) s"
"$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheels"/npuc-*.whl
cd crates/python/tests  # import the installed package, not a source tree
"$PY" -m pytest -ra "$@" .
