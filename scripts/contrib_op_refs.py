#!/usr/bin/env python3
"""onnxruntime references for npuc's import of onnxruntime contrib ops (com.microsoft):
one small graph per op and attribute combination, random inputs (fixed seed), onnxruntime's
outputs. Writes OUT/<case>/{model.onnx, in_<i>.npy, out_<i>.npy, meta.json}. Test tooling only.

usage: contrib_op_refs.py OUT
"""
import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

rng = np.random.default_rng(7)


def f32(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def build(out, name, op, feeds, consts, order, outputs, attrs=None, domain="com.microsoft"):
    """order: the op's input names in position ('' for omitted), each in feeds or consts."""
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    node = helper.make_node(op, order, outputs, domain=domain, **(attrs or {}))
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a in feeds]
    g_out = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs if o]
    g = helper.make_graph([node], name, g_in, g_out,
                          [numpy_helper.from_array(a, n) for n, a in consts])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    path = os.path.join(d, "model.onnx")
    onnx.save(m, path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    res = s.run(None, dict(feeds))
    for i, (n, a) in enumerate(feeds):
        np.save(os.path.join(d, f"in_{i}.npy"), a)
    names = [o for o in outputs if o]
    for i, r in enumerate(res):
        np.save(os.path.join(d, f"out_{i}.npy"), r.astype(np.float32))
    json.dump({"inputs": [n for n, _ in feeds], "outputs": names}, open(os.path.join(d, "meta.json"), "w"))


def main():
    out = sys.argv[1]
    x = f32(2, 3, 8, scale=2.0)
    b8 = f32(8)
    build(out, "fastgelu_bias", "FastGelu", [("x", x)], [("b", b8)], ["x", "b"], ["y"])
    build(out, "fastgelu", "FastGelu", [("x", x)], [], ["x"], ["y"])
    build(out, "biasgelu", "BiasGelu", [("x", x)], [("b", b8)], ["x", "b"], ["y"])
    build(out, "gelu_ms", "Gelu", [("x", x)], [], ["x"], ["y"])
    build(out, "quickgelu", "QuickGelu", [("x", x)], [], ["x"], ["y"])
    build(out, "quickgelu_alpha1", "QuickGelu", [("x", x)], [], ["x"], ["y"], {"alpha": 1.0})
    skip = f32(2, 3, 8)
    gamma, beta, bias = f32(8), f32(8), f32(8)
    build(out, "skiplayernorm_full", "SkipLayerNormalization", [("x", x), ("skip", skip)],
          [("gamma", gamma), ("beta", beta), ("bias", bias)], ["x", "skip", "gamma", "beta", "bias"],
          ["y", "mean", "inv_std", "sum"], {"epsilon": 1e-5})
    build(out, "skiplayernorm", "SkipLayerNormalization", [("x", x), ("skip", skip)],
          [("gamma", gamma)], ["x", "skip", "gamma"], ["y"], {"epsilon": 1e-5})
    build(out, "skipsimplified", "SkipSimplifiedLayerNormalization", [("x", x), ("skip", skip)],
          [("gamma", gamma), ("bias", bias)], ["x", "skip", "gamma", "bias"], ["y", "", "", "sum"],
          {"epsilon": 1e-6})
    build(out, "simplified", "SimplifiedLayerNormalization", [("x", x)], [("scale", gamma)],
          ["x", "scale"], ["y"], {"epsilon": 1e-6, "axis": -1}, domain="")
    a, bt = f32(2, 4, 5), f32(2, 6, 5)
    build(out, "fusedmatmul_transb", "FusedMatMul", [("a", a), ("b", bt)], [], ["a", "b"], ["y"],
          {"alpha": 0.5, "transB": 1})
    at = f32(2, 5, 4)
    b2 = f32(5, 6)
    build(out, "fusedmatmul_transa", "FusedMatMul", [("a", at)], [("b", b2)], ["a", "b"], ["y"],
          {"transA": 1})

    # MatMulNBits: 4-bit with packed zero points and a bias, 4-bit default zero point, 8-bit.
    for name, bits, bs, k, n, zp, bias in [("matmulnbits4_zp_bias", 4, 16, 40, 8, True, True),
                                          ("matmulnbits4", 4, 32, 64, 6, False, False),
                                          ("matmulnbits8", 8, 16, 32, 5, True, False)]:
        blocks = -(-k // bs)
        q = rng.integers(0, 1 << bits, size=(n, blocks, bs), dtype=np.uint8)
        per_byte = 8 // bits
        packed = np.zeros((n, blocks, bs // per_byte), np.uint8)
        for j in range(per_byte):
            packed |= (q[:, :, j::per_byte] << (j * bits)).astype(np.uint8)
        scales = (rng.random(n * blocks) * 0.1 + 0.01).astype(np.float32)
        consts = [("B", packed), ("scales", scales)]
        order = ["a", "B", "scales"]
        if zp:
            zq = rng.integers(0, 1 << bits, size=(n, blocks), dtype=np.uint8)
            per_col = -(-blocks * bits // 8)
            zpk = np.zeros((n, per_col), np.uint8)
            for j in range(blocks):
                zpk[:, (j * bits) // 8] |= (zq[:, j] << ((j * bits) % 8)).astype(np.uint8)
            consts.append(("zp", zpk.reshape(-1)))
            order.append("zp")
        if bias:
            order += [""] if zp else ["", ""]
            consts.append(("bias", f32(n)))
            order.append("bias")
        build(out, name, "MatMulNBits", [("a", f32(3, k))], consts, order, ["y"],
              {"K": k, "N": n, "bits": bits, "block_size": bs})
    # RotaryEmbedding: 3-D input with position ids, 4-D interleaved with an offset, partial.
    cache_pos, half = 16, 4
    ang = np.arange(cache_pos)[:, None] * (10000.0 ** (-np.arange(half) / half))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    ids = np.array([[0, 3, 5], [7, 8, 2]], np.int64)
    build(out, "rotary_3d", "RotaryEmbedding", [("x", f32(2, 3, 16)), ("pos", ids)],
          [("cos", cos), ("sin", sin)], ["x", "pos", "cos", "sin"], ["y"], {"num_heads": 2})
    build(out, "rotary_4d_interleaved", "RotaryEmbedding",
          [("x", f32(1, 2, 3, 8)), ("pos", np.array([4], np.int64))],
          [("cos", cos), ("sin", sin)], ["x", "pos", "cos", "sin"], ["y"], {"interleaved": 1})
    build(out, "rotary_partial", "RotaryEmbedding", [("x", f32(2, 3, 24)), ("pos", ids)],
          [("cos", cos), ("sin", sin)], ["x", "pos", "cos", "sin"], ["y"],
          {"num_heads": 2, "rotary_embedding_dim": 8})


if __name__ == "__main__":
    main()
