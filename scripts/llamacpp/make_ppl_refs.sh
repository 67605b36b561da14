#!/usr/bin/env bash
# llama.cpp's perplexity of a GGUF over the repo's perplexity text, as the JSON the tests compare
# `npuc perplexity --ctx 512` with (crates/cli/tests/llm_cli.rs, *_perplexity_within_half_a_percent*):
#   scripts/llamacpp/make_ppl_refs.sh MODEL.gguf OUT.json [CTX] [BIN]
# BIN: a llama.cpp bin directory with llama-perplexity (default: the AVX2 build of
# benches/llamacpp_native.sh avx2, the same kernels as the greedy and top-1 references).
set -euo pipefail
MODEL=$1; OUT=$2; CTX=${3:-512}
cd "$(dirname "$0")/../.."
BIN=${4:-$(benches/llamacpp_native.sh avx2 | tail -1)}
TEXT=tests/fixtures/llm/gemma3/ppl_text.txt
LOG=$(mktemp); trap 'rm -f "$LOG"' EXIT
LD_LIBRARY_PATH="$BIN" "$BIN/llama-perplexity" -m "$MODEL" -f "$TEXT" -c "$CTX" -t 2 >"$LOG" 2>&1 || {
  tail -20 "$LOG" >&2; exit 1; }
python3 - "$LOG" "$MODEL" "$OUT" "$CTX" "$BIN" <<'PY'
import hashlib, json, re, sys
log, model, out, ctx, binary = sys.argv[1:]
text = open(log, encoding="utf-8", errors="replace").read()
m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text)
c = re.search(r"calculating perplexity over (\d+) chunks", text)
if not m or not c:
    sys.exit(f"no final estimate in llama-perplexity's output:\n{text[-2000:]}")
h = hashlib.sha256()
with open(model, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
build = binary.rstrip("/").split("/")[-2]
ref = {"ppl": float(m.group(1)), "stderr": float(m.group(2)), "ctx": int(ctx), "chunks": int(c.group(1)),
       "engine": f"llama.cpp (llama-cpp-python 0.3.36 vendor, commit 0c1e570, {build}), llama-perplexity -c {ctx} -t 2",
       "model_sha256": h.hexdigest()}
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(ref, f)
    f.write("\n")
import os
os.replace(tmp, out)
print(json.dumps(ref))
PY
