#!/usr/bin/env python3
"""Writes dequantization references for npuc-ggml's tests (tooling only, never used by npuc).

For every GGML tensor type found in tests/fixtures/llm/*/*.gguf, takes the first 2-D tensor of
that type, dequantizes its first 4 rows with gguf-py (`gguf.quants.dequantize`, an independent
numpy implementation of ggml's layouts) and writes
tests/fixtures/llm/dequant/<TYPE>.npy (f32 [rows, k]) plus index.json naming the source file
and tensor; also quant_input.npy and quant_roundtrip_<TYPE>.npy (gguf-py's reference quantizers,
dequantized) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0. Usage: pip install gguf; python3 scripts/make_ggml_refs.py
"""
import glob, json, os, sys
import numpy as np
from gguf import GGUFReader
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "llm", "dequant")
ROWS = 4


def main():
    os.makedirs(OUT, exist_ok=True)
    index = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "fixtures", "llm", "*", "*.gguf"))):
        r = GGUFReader(path)
        for t in r.tensors:
            name = t.tensor_type.name
            if name in index or len(t.shape) != 2:
                continue
            # t.data is [rows, row_bytes] (quantized) or [rows, k] (float); take the first rows.
            raw = np.asarray(t.data)[:ROWS]
            deq = dequantize(raw, t.tensor_type).astype(np.float32)
            rel = os.path.relpath(path, ROOT)
            np.save(os.path.join(OUT, f"{name}.npy"), deq)
            index[name] = {"file": rel, "tensor": t.name, "rows": int(deq.shape[0]), "k": int(deq.shape[1])}
            print(f"{name:6} {rel} {t.name} {deq.shape}")
    # Quantizer references: gguf-py's quantizers follow ggml's reference ones bit for bit; store
    # dequantize(quantize(x)) so scales and quants are both checked.
    x = (np.sin(np.arange(4 * 256, dtype=np.float64) * 0.37) * np.linspace(0.01, 3.0, 4 * 256)).astype(np.float32)
    x[100:132] = 0.0  # an all-zero block
    x[200] = 7.5  # a block whose largest magnitude is positive
    np.save(os.path.join(OUT, "quant_input.npy"), x.reshape(4, 256))
    for q in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        qt = GGMLQuantizationType[q]
        rt = dequantize(quantize(x.reshape(4, 256), qt), qt).astype(np.float32)
        np.save(os.path.join(OUT, f"quant_roundtrip_{q}.npy"), rt)
        print(f"quantizer reference {q}")
    with open(os.path.join(OUT, "index.json"), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
