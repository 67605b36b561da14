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


def build(out, name, op, feeds, consts, order, outputs, attrs=None, domain="com.microsoft",
          graph_outputs=None, out_types=None):
    """order: the op's input names in position ('' for omitted), each in feeds or consts.
    graph_outputs: the outputs compared (default: every named output); out_types: their
    element types where not float."""
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    node = helper.make_node(op, order, outputs, domain=domain, **(attrs or {}))
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a in feeds]
    names = graph_outputs or [o for o in outputs if o]
    g_out = [helper.make_tensor_value_info(o, (out_types or {}).get(o, TensorProto.FLOAT), None)
             for o in names]
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
    attention_cases(out)


def repack(out, name, op, feeds, order, attrs):
    """Replaces case `name`'s graph and inputs (its outputs stay: onnxruntime's on the unpacked
    inputs) by `op` on `feeds`: for layouts onnxruntime's CPU kernels do not take (packed
    MultiHeadAttention inputs), whose reference is the same attention on the inputs unpacked."""
    d = os.path.join(out, name)
    meta = json.load(open(os.path.join(d, "meta.json")))
    for f in os.listdir(d):
        if f.startswith("in_"):
            os.remove(os.path.join(d, f))
    node = helper.make_node(op, order, ["y"], domain="com.microsoft", **attrs)
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a in feeds]
    g_out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    m = helper.make_model(helper.make_graph([node], name, g_in, g_out),
                          opset_imports=[helper.make_opsetid("", 17),
                                         helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    onnx.save(m, os.path.join(d, "model.onnx"))
    for i, (n, a) in enumerate(feeds):
        np.save(os.path.join(d, f"in_{i}.npy"), a)
    meta["inputs"] = [n for n, _ in feeds]
    json.dump(meta, open(os.path.join(d, "meta.json"), "w"))


def i32(a):
    return np.array(a, np.int32)


def attention_cases(out):
    """Attention, MultiHeadAttention, GroupQueryAttention, EmbedLayerNormalization: the mask
    and input layouts onnxruntime's CPU kernels take, one graph each."""
    # Attention: input [B, S, 16] packed through weights [16, 48] into 2 heads of 8.
    x = f32(2, 4, 16)
    w, bias = f32(16, 48, scale=0.4), f32(48)
    base = [("w", w), ("bias", bias)]
    at = lambda name, feeds, order, attrs, consts=(), outputs=("y",): build(
        out, name, "Attention", [("x", x)] + feeds, base + list(consts), ["x", "w", "bias"] + order,
        list(outputs), {"num_heads": 2, **attrs})
    at("attention", [], [], {})
    at("attention_mask1d", [("m", i32([4, 2]))], ["m"], {})
    at("attention_mask1d_start", [("m", i32([4, 3, 0, 1]))], ["m"], {})
    at("attention_mask2d_causal", [("m", i32([[1, 1, 1, 0], [0, 1, 1, 1]]))], ["m"],
       {"unidirectional": 1})
    at("attention_mask3d", [("m", rng.integers(0, 2, (2, 4, 4)).astype(np.int32))], ["m"],
       {"mask_filter_value": -1000.0})
    at("attention_bias_scale", [("ab", f32(1, 2, 4, 4))], ["", "", "ab"], {"scale": 0.3})
    build(out, "attention_qkv_sizes", "Attention", [("x", x)],
          [("w", f32(16, 40, scale=0.4)), ("bias", f32(40))], ["x", "w", "bias"], ["y"],
          {"num_heads": 2, "qkv_hidden_sizes": [16, 16, 8]})
    past = f32(2, 2, 2, 3, 8)
    build(out, "attention_past_causal", "Attention", [("x", f32(2, 2, 16)), ("past", past),
                                                      ("m", i32([[1] * 5, [0, 1, 1, 1, 1]]))],
          base, ["x", "w", "bias", "m", "past"], ["y", "present"],
          {"num_heads": 2, "unidirectional": 1})

    # MultiHeadAttention: 2 heads of 8; query length 3, key length 5.
    q, k, v = f32(2, 3, 16), f32(2, 5, 16), f32(2, 5, 16)
    mha = lambda name, feeds, order, outputs=("y",), attrs=None, consts=(), **kw: build(
        out, name, "MultiHeadAttention", feeds, list(consts), order, list(outputs),
        {"num_heads": 2, **(attrs or {})}, **kw)
    mha("mha", [("q", q), ("k", k), ("v", v)], ["q", "k", "v"])
    mha("mha_bias_mask1d", [("q", q), ("k", k), ("v", v), ("m", i32([5, 3]))],
        ["q", "k", "v", "bias", "m"], consts=[("bias", f32(48))])
    mha("mha_mask2d_attnbias", [("q", q), ("k", k), ("v", v),
                                ("m", i32([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]])),
                                ("ab", f32(2, 1, 3, 5))],
        ["q", "k", "v", "", "m", "ab"], attrs={"mask_filter_value": -500.0})
    # Packed KV [B, L, N, 2, H] and packed QKV [B, S, N, 3, H] (no CPU kernel in onnxruntime:
    # the reference is its result on the same values unpacked).
    kvp = np.stack([k.reshape(2, 5, 2, 8), v.reshape(2, 5, 2, 8)], axis=3)
    m2 = i32([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    mha("mha_packed_kv", [("q", q), ("k", k), ("v", v), ("m", m2)], ["q", "k", "v", "", "m"])
    repack(out, "mha_packed_kv", "MultiHeadAttention", [("q", q), ("kv", kvp), ("m", m2)],
           ["q", "kv", "", "", "m"], {"num_heads": 2})
    qkv = f32(2, 5, 2, 3, 8)
    unp = [qkv[:, :, :, j, :].reshape(2, 5, 16).copy() for j in range(3)]
    mha("mha_packed_qkv", [("q", unp[0]), ("k", unp[1]), ("v", unp[2])], ["q", "k", "v"],
        attrs={"scale": 0.5})
    repack(out, "mha_packed_qkv", "MultiHeadAttention", [("qkv", qkv)], ["qkv"],
           {"num_heads": 2, "scale": 0.5})
    qs, ks, vs = f32(2, 2, 16), f32(2, 2, 16), f32(2, 2, 16)
    mha("mha_past_causal", [("q", qs), ("k", ks), ("v", vs), ("pk", f32(2, 2, 3, 8)),
                            ("pv", f32(2, 2, 3, 8))],
        ["q", "k", "v", "bias", "", "", "pk", "pv"], ["y", "present_k", "present_v"],
        {"unidirectional": 1, "scale": 0.2}, consts=[("bias", f32(48))])
    mha("mha_kv_bnsh", [("q", q), ("k", f32(2, 2, 5, 8)), ("v", f32(2, 2, 5, 8))],
        ["q", "k", "v", "bias"], consts=[("bias", np.concatenate([f32(16), np.zeros(32, np.float32)]))])

    # GroupQueryAttention: 4 query heads, 2 kv heads, head size 16 (onnxruntime's CPU rotary
    # needs a multiple of 16).
    gqa = lambda name, feeds, order, attrs=None, outputs=("y", "pk_out", "pv_out"), consts=(), **kw: build(
        out, name, "GroupQueryAttention", feeds, list(consts), order, list(outputs),
        {"num_heads": 4, "kv_num_heads": 2, **(attrs or {})}, **kw)
    order = ["q", "k", "v", "pk", "pv", "seqlens", "total"]
    def gfeeds(b, s, past, seqlens, total):
        return [("q", f32(b, s, 64)), ("k", f32(b, s, 32)), ("v", f32(b, s, 32)),
                ("pk", f32(b, 2, past, 16)), ("pv", f32(b, 2, past, 16)),
                ("seqlens", i32(seqlens)), ("total", i32(total))]
    gqa("gqa_prompt", gfeeds(2, 4, 0, [3, 3], 4), order)
    gqa("gqa_decode", gfeeds(2, 1, 5, [5, 5], 6), order, {"scale": 0.25})
    gqa("gqa_decode_varlen", gfeeds(2, 1, 6, [6, 3], 7), order, graph_outputs=["y"])
    gqa("gqa_continue", gfeeds(1, 3, 4, [6], 7), order)
    ang = np.arange(16)[:, None] * (10000.0 ** (-np.arange(8) / 8))[None, :]
    rc = [("cos", np.cos(ang).astype(np.float32)), ("sin", np.sin(ang).astype(np.float32))]
    gqa("gqa_rotary_prompt", gfeeds(2, 4, 0, [3, 3], 4), order + ["cos", "sin"],
        {"do_rotary": 1}, consts=rc)
    gqa("gqa_rotary_interleaved_decode", gfeeds(2, 1, 5, [5, 5], 6), order + ["cos", "sin"],
        {"do_rotary": 1, "rotary_interleaved": 1}, consts=rc)
    big = gfeeds(1, 6, 0, [5], 6)
    big[0] = ("q", f32(1, 6, 64, scale=3.0))
    gqa("gqa_window_softcap", big, order, {"local_window_size": 2, "softcap": 4.0})
    dec = gfeeds(2, 1, 5, [5, 5], 6)
    gqa("gqa_window_attnbias_decode", dec + [("ab", f32(2, 1, 1, 6))],
        order + ["", "", "", "ab"], {"local_window_size": 3})
    gqa("gqa_packed", [("qkv", f32(1, 3, 128)), ("pk", f32(1, 2, 2, 16)), ("pv", f32(1, 2, 2, 16)),
                       ("seqlens", i32([4])), ("total", i32(5))],
        ["qkv", "", "", "pk", "pv", "seqlens", "total"])

    # EmbedLayerNormalization: vocabulary 20, 16 positions, 2 segments, hidden 8.
    ids = i32([[1, 5, 19, 0], [7, 7, 3, 2]])
    seg = i32([[0, 0, 1, 1], [0, 1, 1, 1]])
    emb = [("word", f32(20, 8)), ("pos", f32(16, 8)), ("segemb", f32(2, 8)),
           ("gamma", f32(8)), ("beta", f32(8))]
    i32t = {"mask_index": TensorProto.INT32}
    build(out, "embedlayernorm", "EmbedLayerNormalization",
          [("ids", ids), ("seg", seg), ("mask", i32([[1, 1, 1, 0], [1, 1, 0, 0]]))], emb,
          ["ids", "seg", "word", "pos", "segemb", "gamma", "beta", "mask"],
          ["y", "mask_index", "sum"], {"epsilon": 1e-5}, out_types=i32t)
    build(out, "embedlayernorm_nosegment", "EmbedLayerNormalization", [("ids", ids)],
          [e for e in emb if e[0] != "segemb"], ["ids", "", "word", "pos", "", "gamma", "beta"],
          ["y", "mask_index"], out_types=i32t)
    build(out, "embedlayernorm_position_ids", "EmbedLayerNormalization",
          [("ids", ids), ("seg", seg), ("pid", i32([[3, 2, 9, 15]]))], emb,
          ["ids", "seg", "word", "pos", "segemb", "gamma", "beta", "", "pid"],
          ["y", "mask_index"], out_types=i32t)


if __name__ == "__main__":
    main()
