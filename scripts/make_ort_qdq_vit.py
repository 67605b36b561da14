#!/usr/bin/env python3
"""Makes ORT-style QDQ models for npuc's integer-kernel tests and benchmarks (test tooling only).

Runs onnxruntime.quantization.quantize_static(QuantFormat.QDQ, per_channel=True, activations QUInt8,
weights QInt8) on a float ONNX model with a few calibration samples drawn from a fixed-seed normal
distribution (calibration quality is not the point here: the lowered integer graph must agree with
the same QDQ graph run in float "simulate" mode, whatever the scales are).

usage: make_ort_qdq_vit.py MODEL.onnx OUT.onnx [--samples N] [--shape name=1,3,224,224 ...]
       [--activation uint8|uint16] [--weight int8|int4]
"""
import argparse
import sys

import numpy as np
import onnx
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                      quantize_static)


class RandomReader(CalibrationDataReader):
    def __init__(self, inputs, n, seed):
        rng = np.random.default_rng(seed)
        self.samples = [{name: rng.standard_normal(shape).astype(np.float32)
                         for name, shape in inputs} for _ in range(n)]
        self.i = 0

    def get_next(self):
        if self.i >= len(self.samples):
            return None
        self.i += 1
        return self.samples[self.i - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", action="append", default=[],
                    help="name=d0,d1,... for inputs with symbolic dims")
    ap.add_argument("--activation", default="uint8", choices=["uint8", "uint16"])
    ap.add_argument("--weight", default="int8", choices=["int8", "int4"])
    a = ap.parse_args()
    fixed = dict(s.split("=", 1) for s in a.shape)
    m = onnx.load(a.model, load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    inputs = []
    for i in m.graph.input:
        if i.name in inits:
            continue
        if i.name in fixed:
            shape = [int(d) for d in fixed[i.name].split(",")]
        else:
            shape = [d.dim_value if d.dim_value > 0 else 1 for d in i.type.tensor_type.shape.dim]
        inputs.append((i.name, shape))
    act = {"uint8": QuantType.QUInt8, "uint16": QuantType.QUInt16}[a.activation]
    wt = {"int8": QuantType.QInt8, "int4": QuantType.QInt4}[a.weight]
    quantize_static(a.model, a.out, RandomReader(inputs, a.samples, a.seed),
                    quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=act, weight_type=wt)
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
