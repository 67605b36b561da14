#!/usr/bin/env python3
"""Perplexity of an ONNX LLM decoder compiled for one static prefill shape (`npuc compile
MODEL.onnx --dim sequence_length=S --dim past_sequence_length=0 ...`, float or quantized), or
of the float ONNX itself, run by `npuc run` on consecutive windows of S tokens with an empty KV
cache; llama.cpp's method within each window (the second half of its positions scored), so
figures compare across artifacts of the same S, not with `npuc perplexity --ctx 512`.

usage: onnx_llm_window_ppl.py NPUC_BIN MODEL(.npuc|.onnx) IDS.json WINDOWS SEQ KV_DIR
IDS.json: `npuc generate GGUF --prompt "$(cat TEXT)" --max-tokens 1 --json` (its prompt_tokens);
KV_DIR: a directory with the empty `past_key_values.*.npy` inputs (shape [1, heads, 0, d]).
Prints `windows W, tokens scored N, PPL = X`.
"""
import glob, json, math, os, subprocess, sys, tempfile

import numpy as np


def main():
    npuc, model, ids_path, windows, seq, kv_dir = sys.argv[1:7]
    windows, seq = int(windows), int(seq)
    ids = json.load(open(ids_path))["prompt_tokens"]
    if len(ids) < windows * seq:
        sys.exit(f"{ids_path}: {len(ids)} tokens, {windows} windows of {seq} need {windows * seq}")
    past = sorted(glob.glob(os.path.join(kv_dir, "past_key_values.*.npy")))
    nll, scored = 0.0, 0
    with tempfile.TemporaryDirectory(prefix="big-ppl-") as tmp:
        for w in range(windows):
            win = ids[w * seq:(w + 1) * seq]
            np.save(f"{tmp}/input_ids.npy", np.array([win], np.int64))
            np.save(f"{tmp}/attention_mask.npy", np.ones((1, seq), np.int64))
            np.save(f"{tmp}/position_ids.npy", np.arange(seq, dtype=np.int64)[None])
            args = [npuc, "run", model]
            for n in ("input_ids", "attention_mask", "position_ids"):
                args += ["--input", f"{n}={tmp}/{n}.npy"]
            for p in past:
                args += ["--input", f"{os.path.basename(p)[:-4]}={p}"]
            args += ["--output-dir", f"{tmp}/out"]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
            logits = np.load(f"{tmp}/out/logits.npy")[0].astype(np.float64)
            for i in range(seq // 2, seq - 1):
                row = logits[i]
                m = row.max()
                lse = m + math.log(np.exp(row - m).sum())
                nll += lse - row[win[i + 1]]
                scored += 1
    print(f"windows {windows}, tokens scored {scored}, PPL = {math.exp(nll / scored):.4f}")


if __name__ == "__main__":
    main()
