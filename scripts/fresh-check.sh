#!/usr/bin/env bash
# Runs the README's test command as on a fresh machine: an empty data cache (so a new download
# of every model and suite, a new Python test venv and newly generated fixtures) in a temporary
# directory, removed afterwards. The build directory is kept (it holds no test data).
# Usage: scripts/fresh-check.sh [KEEP_DIR]   (KEEP_DIR: use and keep this cache directory instead)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${1:-}" ]; then
  export NPUC_CACHE=$1
  [ -z "$(ls -A "$NPUC_CACHE" 2>/dev/null)" ] || { echo "$NPUC_CACHE is not empty" >&2; exit 2; }
else
  NPUC_CACHE=$(mktemp -d /tmp/npuc-fresh-XXXXXX); export NPUC_CACHE
  trap 'rm -rf "$NPUC_CACHE"' EXIT
fi
unset NPUC_PYTHON NPUC_QUANT_DATA
echo "fresh-check: empty cache $NPUC_CACHE"
start=$(date +%s)
scripts/test.sh
echo "fresh-check: scripts/test.sh passed from an empty cache in $(( $(date +%s) - start )) s"
