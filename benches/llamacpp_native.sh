#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-perplexity from the llama-cpp-python 0.3.36 sdist on PyPI,
# for speed comparisons (parity references use scripts/llamacpp/build.sh's library build). Prints the
# bin directory on its last line.
#   benches/llamacpp_native.sh [native|avx2]
#     native (default): -march=native, in build-native (build-native-noamx on AMX-flagged hosts)
#     avx2: AVX2+FMA+F16C+BMI2 only (GGML_NATIVE=OFF), in build-avx2-tools. On the AVX-512 VMs here
#       llama.cpp's native build decodes slower than its AVX2 build did on an AVX2 host, so
#       benches/vs_llamacpp.sh runs both and takes the faster figure as llama.cpp's best.
#   -> $NPUC_CACHE/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/<dir>/bin
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
VARIANT=${1:-native}
FLAGS=""
case "$VARIANT" in
  native)
    DIR=build-native
    ISA=(-DGGML_NATIVE=ON)
    if grep -qw amx_tile /proc/cpuinfo; then
      DIR=build-native-noamx
      FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi ;;
  avx2)
    DIR=build-avx2-tools
    ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF) ;;
  *) echo "usage: $0 [native|avx2] (got '$VARIANT')" >&2; exit 2 ;;
esac
BIN="$PWD/$DIR/bin"
if [ ! -x "$BIN/llama-bench" ] || [ ! -x "$BIN/llama-perplexity" ]; then
  command -v cmake >/dev/null || python3 -m pip install -q cmake
  cmake -B "$DIR" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "${ISA[@]}" \
    -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON >/dev/null
  cmake --build "$DIR" -j"$(nproc)" --target llama-bench llama-perplexity >/dev/null
fi
echo "$BIN"
