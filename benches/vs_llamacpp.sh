#!/usr/bin/env bash
# npuc vs llama.cpp on the three LLMs of issue 15, alternating runs on the same machine:
#   benches/vs_llamacpp.sh [THREADS...]        (default: 1 2)
# Builds llama.cpp natively and for AVX2 if missing (benches/llamacpp_native.sh; each figure takes
# the faster of the two builds as llama.cpp's best on this CPU, named in the table), fetches the models
# (scripts/fetch-data.sh llms), builds npuc (release), then for each model and thread count runs
# `llama-bench -p 128,512 -n 64` and `npuc bench --prompt-len 128|512 --gen 64`, alternating, ROUNDS
# times (env, default 3), and prints median tokens/s, the ratios npuc / llama.cpp, peak RSS of both,
# and npuc's decode share of the weight-read roofline (bytes per token / read bandwidth measured in
# the same run by `npuc bench`). Env: NPUC_CACHE, ROUNDS, MODELS (space-separated subset).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${*:-1 2}
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
NATIVE=$(benches/llamacpp_native.sh native | tail -1)
AVX2=$(benches/llamacpp_native.sh avx2 | tail -1)
scripts/fetch-data.sh llms >/dev/null
cargo build --release -q -p npuc-cli
python3 benches/vs_llamacpp.py --llama-bin "native=$NATIVE" --llama-bin "avx2=$AVX2" --npuc target/release/npuc --cache "$CACHE" \
  --rounds "${ROUNDS:-3}" --threads $THREADS ${MODELS:+--models $MODELS}
