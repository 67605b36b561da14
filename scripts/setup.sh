#!/usr/bin/env bash
# Installs what npuc's build, demo and tests need on a fresh Debian/Ubuntu machine: a C linker,
# unzip, Python's venv and pip (test tooling only), fonts for the rendered OCR samples, a Rust
# toolchain if none is present; then the data (models, ONNX suite) into the cache ($NPUC_CACHE,
# default ~/.cache/npuc), the pinned Python test venv ($NPUC_CACHE/venv) and every generated
# fixture the tests read. Safe to re-run: finished steps are kept.
# Usage: scripts/setup.sh [--data-only]   (--data-only: models and suite, no venv or fixtures: the demo)
set -euo pipefail
mode=${1:-}
need=()
command -v cc >/dev/null || need+=(build-essential)
command -v unzip >/dev/null || need+=(unzip)
command -v curl >/dev/null || need+=(curl)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
[ -d /usr/share/fonts/truetype/dejavu ] || need+=(fonts-dejavu-core)
# GNU time: the large-model tests read a compile's peak RSS from `/usr/bin/time -v`.
[ -x /usr/bin/time ] || need+=(time)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need[@]}"
fi
if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null; then
  # Debian's toolchain package; npuc needs Rust 1.87 or newer.
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq cargo rustc
fi
ver=$(rustc --version | sed -E 's/^rustc ([0-9]+)\.([0-9]+).*/\1 \2/')
set -- $ver
if [ "${1:-0}" -lt 1 ] || { [ "${1:-0}" -eq 1 ] && [ "${2:-0}" -lt 87 ]; }; then
  echo "rustc $(rustc --version) is too old: npuc needs Rust 1.87 or newer (rustup.rs)" >&2; exit 1
fi
here="$(cd "$(dirname "$0")" && pwd)"
"$here/fetch-data.sh" all
[ "$mode" = "--data-only" ] && exit 0
"$here/make-fixtures.sh"
