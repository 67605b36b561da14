#!/usr/bin/env python3
"""Loads a QDQ ONNX model written by `npuc compile --quantize ... --emit-qdq` (external data
allowed: a model over 2 GB keeps its initializers in Q.onnx.data) in onnxruntime, runs it on one
sample and compares one output with what npuc computed for the same sample.

usage: qdq_ort_logits.py Q.onnx INPUT_DIR OUTPUT_NAME NPUC_OUTPUT.npy

INPUT_DIR holds one `<input name>.npy` per graph input (names sanitised as `npuc run` writes
them). Prints one JSON object: the output's shape, max |ort - npuc|, the largest |npuc| value,
the max difference relative to it, the SQNR (dB) of ort against npuc, and the share of rows
whose argmax agrees (for logits: the greedy next token at every position). The caller judges.
"""
import json
import os
import re
import sys

import numpy as np
import onnxruntime as ort


def sanitize(n):
    return re.sub(r"[^A-Za-z0-9._-]", "_", n)


def main():
    model, inputs, output, npuc_out = sys.argv[1:5]
    so = ort.SessionOptions()
    # As written (DequantizeLinear -> float op -> QuantizeLinear): onnxruntime's QDQ fusions
    # pick integer kernels by CPU, which would make the figure depend on the host.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    feed = {}
    for i in s.get_inputs():
        feed[i.name] = np.load(os.path.join(inputs, sanitize(i.name) + ".npy"))
    (got,) = s.run([output], feed)
    ref = np.load(npuc_out)
    if got.shape != ref.shape:
        sys.exit(f"{output}: onnxruntime gives shape {got.shape}, npuc {ref.shape}")
    got64, ref64 = got.astype(np.float64), ref.astype(np.float64)
    diff = np.abs(got64 - ref64)
    noise = float(np.sum(diff**2))
    sqnr = 10 * np.log10(float(np.sum(ref64**2)) / max(noise, 1e-30))
    rows_g = got.reshape(-1, got.shape[-1]).argmax(-1)
    rows_r = ref.reshape(-1, ref.shape[-1]).argmax(-1)
    print(
        json.dumps(
            {
                "shape": list(got.shape),
                "max_abs_diff": float(diff.max()),
                "max_abs_npuc": float(np.abs(ref64).max()),
                "max_rel_diff": float(diff.max() / max(np.abs(ref64).max(), 1e-30)),
                "sqnr_db": float(sqnr),
                "argmax_agree": float(np.mean(rows_g == rows_r)),
            }
        )
    )


if __name__ == "__main__":
    main()
