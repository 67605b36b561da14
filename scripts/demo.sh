#!/usr/bin/env bash
# The main job: read a rendered line of text with the PP-OCRv6 tiny recogniser (a real ONNX model
# from PyPI), running entirely in npuc, and print the text and timings.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
cargo build --release -q -p npuc-cli
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
MODEL="$CACHE/models/tinyocr-ppocrv6/PP-OCRv6_rec_tiny.onnx"
./target/release/npuc inspect "$MODEL" --input-shape x=1x3x48x320 | sed -n '1,8p'
echo "== run the ONNX model"
./target/release/npuc ocr tests/fixtures/ocr/line.png --model "$MODEL" --threads 1 --runs 10
echo "== compile it into a .npuc artifact and run that"
OUT=$(mktemp -d)/ocr_rec.npuc
./target/release/npuc compile "$MODEL" -o "$OUT" --input-shape x=1x3x48x320 2>/dev/null
./target/release/npuc ocr tests/fixtures/ocr/line.png --model "$OUT" --threads 1 --runs 10
rm -rf "$(dirname "$OUT")"
