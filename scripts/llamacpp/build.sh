#!/usr/bin/env bash
# Builds the llama.cpp that produced tests/fixtures/llm/gemma3's references (vendored in the
# llama-cpp-python 0.3.36 sdist on PyPI) as shared libraries, for numeric parity work only:
#   scripts/llamacpp/build.sh            # -> $NPUC_CACHE/llamacpp/.../build/bin/libllama.so
#   LLAMA_CPP_LIB_PATH=<that bin dir> python3 scripts/llamacpp/forced_logits.py MODEL.gguf 2,818 506 out.f32
#   cargo run --release -p npuc-llm --example forced_logits MODEL.gguf fast 2,818 506 ours.f32
#   python3 scripts/llamacpp/compare_logits.py out.f32 ours.f32
# capture.py dumps llama.cpp's intermediate tensors (layer names like attn_norm-0) through the
# eval callback. Both run llama.cpp's defaults as the references did: flash attention on (its CPU
# default, 'auto'), tiled K-quant batch kernel on. Nothing in npuc or its tests depends on this.
set -euo pipefail
CACHE="${NPUC_CACHE:-$HOME/.cache/npuc}/llamacpp"
mkdir -p "$CACHE" && cd "$CACHE"
python3 -m pip install -q cmake diskcache
if [ ! -d llama_cpp_python-0.3.36 ]; then
  python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d . llama-cpp-python==0.3.36 || true
  tar xzf llama_cpp_python-0.3.36.tar.gz
fi
cd llama_cpp_python-0.3.36/vendor/llama.cpp
# AVX2 + FMA + F16C only, never AVX-512: the references were produced on an AVX2 machine, and a
# -march=native build on an AVX-512 host takes other kernels (softmax, f16 dots, the tiled
# K-quant VNNI microkernel) that round differently.
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
cmake --build build -j"$(nproc)" --target llama
echo "libraries in $PWD/build/bin; python package in $CACHE/llama_cpp_python-0.3.36"
