#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-perplexity natively (-march=native: its best on this CPU)
# from the llama-cpp-python 0.3.36 sdist on PyPI, for speed comparisons only (parity references use
# scripts/llamacpp/build.sh, an AVX2-only build). Prints the bin directory on its last line.
#   benches/llamacpp_native.sh   # -> $NPUC_CACHE/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build-native[-noamx]/bin
set -euo pipefail
CACHE="${NPUC_CACHE:-$HOME/.cache/npuc}/llamacpp"
mkdir -p "$CACHE" && cd "$CACHE"
if [ ! -d llama_cpp_python-0.3.36 ]; then
  command -v cmake >/dev/null || python3 -m pip install -q cmake
  # The sdist straight from PyPI's simple index (pip download would try to build its metadata).
  python3 - <<'PY'
import hashlib, re, urllib.request
page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
url = next(u for u in re.findall(r'href="([^"]+)"', page) if "/llama_cpp_python-0.3.36.tar.gz" in u)
url, _, want = url.partition("#sha256=")
data = urllib.request.urlopen(url).read()
if hashlib.sha256(data).hexdigest() != want:
    raise SystemExit("sha256 mismatch for " + url)
open("llama_cpp_python-0.3.36.tar.gz.part", "wb").write(data)
PY
  mv llama_cpp_python-0.3.36.tar.gz.part llama_cpp_python-0.3.36.tar.gz
  tar xzf llama_cpp_python-0.3.36.tar.gz
fi
cd llama_cpp_python-0.3.36/vendor/llama.cpp
# Hosts whose CPU flags advertise AMX but whose hypervisor does not enable it (the AVX-512 hosts
# here): a -march=native build compiles ggml's AMX kernels and dies with "Illegal instruction" in
# them. GCC lets explicit -mno-* flags override what -march=native turns on, so those builds drop
# AMX only (AVX-512, VNNI, BF16 and ggml's repacked kernels stay), in their own build directory.
DIR=build-native
FLAGS=""
if grep -qw amx_tile /proc/cpuinfo; then
  DIR=build-native-noamx
  FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
BIN="$PWD/$DIR/bin"
if [ ! -x "$BIN/llama-bench" ] || [ ! -x "$BIN/llama-perplexity" ]; then
  command -v cmake >/dev/null || python3 -m pip install -q cmake
  cmake -B "$DIR" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON >/dev/null
  cmake --build "$DIR" -j"$(nproc)" --target llama-bench llama-perplexity >/dev/null
fi
echo "$BIN"
