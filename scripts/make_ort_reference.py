#!/usr/bin/env python3
"""Regenerates onnxruntime outputs for a model's stored reference inputs on THIS machine.

Dynamic-int8 models (text2tashkeel's DynamicQuantizeLSTM/MatMulInteger) give CPU-dependent
results in onnxruntime itself: the shared references (made on another CPU) differ from
onnxruntime 1.32.0 on this AVX2 machine by up to 0.1 (rawi) and 0.33 (bilstm). This script records
the local onnxruntime outputs next to the stored ones as `<output file stem>.ort-local.npy`.
Test tooling only (npuc never runs Python). Usage:
  pip install onnxruntime==1.32.0 numpy
  scripts/make_ort_reference.py MODEL.onnx tests/fixtures/models/<dir>/<stem>.ref
"""
import json, sys
import numpy as np, onnxruntime as ort

model, ref = sys.argv[1], sys.argv[2]
meta = json.load(open(f"{ref}/meta.json"))
feeds = {i["name"]: np.load(f"{ref}/{i['file']}") for i in meta["inputs"]}
so = ort.SessionOptions()
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
so.intra_op_num_threads = 1
sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
for out, info in zip(sess.run(None, feeds), meta["outputs"]):
    path = f"{ref}/{info['file'][:-4]}.ort-local.npy"
    np.save(path, out)
    stored = np.load(f"{ref}/{info['file']}")
    print(f"{path}: max |local - stored| = {float(np.abs(out.astype(np.float64) - stored).max()):.4g}")
