#!/usr/bin/env bash
# The test venv and the generated test data (test tooling only; npuc itself never runs Python):
#   $NPUC_CACHE/venv          pinned scripts/requirements-test.txt (numpy, onnx, onnxruntime, pillow, openai,
#                             tokenizers, maturin, pytest); recreated when that file changes
#   $NPUC_CACHE/qdq/          onnxruntime quantize_static QDQ model of ViT-S and onnxruntime's outputs
#                             for its committed test input on this CPU (crates/cli/tests/quantized.rs)
#   $NPUC_CACHE/quant-data/   real calibration / held-out samples for ViT-S and PP-OCRv5 rec
#                             (crates/cli/tests/quantize.rs, scripts/quant_compare.py), and in minilm/
#                             tokenized English sentences for all-MiniLM-L6-v2 (scripts/quant_compare.py)
#   $NPUC_CACHE/models/minilm-l6/model.onnx   the all-MiniLM-L6-v2 ONNX encoder built from its
#                             safetensors (scripts/make_minilm_onnx.py; crates/cli/tests/minilm.rs builds
#                             its own copy to test the builder)
# Needs the models (scripts/fetch-data.sh models). Safe to re-run: finished outputs are kept.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
VENV="$CACHE/venv"
req="$here/requirements-test.txt"
stamp=$(sha256sum "$req" | cut -d' ' -f1)
if [ "$(cat "$VENV/.requirements" 2>/dev/null)" != "$stamp" ]; then
  echo "test venv: creating $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
  echo "$stamp" > "$VENV/.requirements"
else
  echo "test venv: $VENV"
fi
PY="$VENV/bin/python"

if [ ! -f "$CACHE/qdq/vit_s_w8a8/.complete" ]; then
  echo "fixtures: onnxruntime QDQ model of ViT-S -> $CACHE/qdq/"
  NPUC_CACHE="$CACHE" "$PY" "$here/make_qdq_fixtures.py" --real-model-only
else
  echo "fixtures: $CACHE/qdq/vit_s_w8a8.onnx"
fi

if [ ! -f "$CACHE/quant-data/.complete" ]; then
  echo "fixtures: calibration samples -> $CACHE/quant-data/"
  rm -rf "$CACHE/quant-data.tmp"
  "$PY" "$here/make_calib_data.py" "$CACHE/quant-data.tmp" vit,ocr
  rm -rf "$CACHE/quant-data"
  mv "$CACHE/quant-data.tmp" "$CACHE/quant-data"
  touch "$CACHE/quant-data/.complete"
else
  echo "fixtures: $CACHE/quant-data"
fi

if [ ! -f "$CACHE/models/minilm-l6/model.onnx" ]; then
  echo "fixtures: all-MiniLM-L6-v2 ONNX -> $CACHE/models/minilm-l6/model.onnx"
  "$PY" "$here/make_minilm_onnx.py" "$CACHE/models/minilm-l6" "$CACHE/models/minilm-l6/model.onnx"
else
  echo "fixtures: $CACHE/models/minilm-l6/model.onnx"
fi

if [ ! -f "$CACHE/quant-data/minilm/.complete" ]; then
  echo "fixtures: all-MiniLM-L6-v2 calibration samples -> $CACHE/quant-data/minilm/"
  rm -rf "$CACHE/quant-data/minilm.tmp" "$CACHE/quant-data/minilm"
  NPUC_CACHE="$CACHE" "$PY" "$here/make_calib_data.py" "$CACHE/quant-data/minilm.tmp" minilm
  mv "$CACHE/quant-data/minilm.tmp/minilm" "$CACHE/quant-data/minilm"
  rm -rf "$CACHE/quant-data/minilm.tmp"
  touch "$CACHE/quant-data/minilm/.complete"
else
  echo "fixtures: $CACHE/quant-data/minilm"
fi
