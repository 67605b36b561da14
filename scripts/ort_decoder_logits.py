#!/usr/bin/env python3
"""Runs an ONNX LLM decoder (the `npuc export` layout: input_ids, attention_mask, position_ids,
past_key_values.{l}.key|value -> logits, present.{l}.key|value) with onnxruntime: the first
PREFILL tokens in one call with an empty cache, then the rest one token per call feeding each
call's present.* back as past_key_values.*. Writes the logits of every position, f32 [n, vocab].

usage: ort_decoder_logits.py MODEL.onnx TOKENS(comma-separated) PREFILL OUT.npy
"""
import sys

import numpy as np
import onnxruntime as ort


def main():
    model, tokens, prefill, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ids = [int(t) for t in tokens.split(",")]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    past = {}
    for i in s.get_inputs():
        if i.name.startswith("past_key_values."):
            _, kvh, _, d = i.shape
            past[i.name] = np.zeros((1, kvh, 0, d), np.float32)
    outs = [o.name for o in s.get_outputs()]
    logits = []
    pos = 0
    chunks = [ids[:prefill]] + [[t] for t in ids[prefill:]]
    for chunk in chunks:
        n = len(chunk)
        feed = {
            "input_ids": np.array([chunk], np.int64),
            "attention_mask": np.ones((1, pos + n), np.int64),
            "position_ids": np.arange(pos, pos + n, dtype=np.int64)[None, :],
        }
        feed.update(past)
        res = dict(zip(outs, s.run(outs, feed)))
        logits.append(res["logits"][0])
        for name in past:
            past[name] = res[name.replace("past_key_values.", "present.")]
        pos += n
    np.save(out, np.concatenate(logits, 0).astype(np.float32))


if __name__ == "__main__":
    main()
