#!/usr/bin/env python3
"""Checks the ONNX all-MiniLM-L6-v2 encoder (scripts/make_minilm_onnx.py) independently of its builder.

1. A plain-numpy forward pass of Hugging Face's BertModel equations (float64; written here from the
   transformers modeling code, not from the graph) on the same safetensors, plus sentence-transformers'
   mean pooling and L2 normalisation, agrees with onnxruntime's run of the ONNX within --tol (default 1e-4,
   max abs) on `last_hidden_state` (every position, padding included) and `sentence_embedding`.
2. Semantics (all-MiniLM-L6-v2's known behaviour): cosine similarity > 0.6 for paraphrase pairs and < 0.3
   for unrelated pairs.
3. Padding: a sentence's embedding in a padded batch equals its embedding alone (max abs < 1e-5).
Sentences are tokenized with the model's tokenizer.json (the `tokenizers` library).

Usage: scripts/check_minilm_onnx.py MODEL_DIR MODEL.onnx [--tol 1e-4] [--dump DIR]
  --dump DIR: writes the batch's inputs (input_ids.npy, attention_mask.npy, token_type_ids.npy, int64 [B,S])
  and onnxruntime's outputs (ort_last_hidden_state.npy, ort_sentence_embedding.npy) for other engines.
Prints one JSON line with the measurements; exits 1 when a check fails. Test tooling only.
"""
import argparse, json, math, os, sys
import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

PARAPHRASES = [
    ("A man is playing a guitar.", "Someone plays a guitar."),
    ("A woman is slicing an onion.", "A woman is cutting an onion."),
    ("The cat is sleeping on the sofa.", "A cat naps on the couch."),
    ("How do I reset my password?", "What is the way to change my password?"),
]
UNRELATED = [
    ("A man is playing a guitar.", "The stock market fell sharply today."),
    ("The cat is sleeping on the sofa.", "Quantum computers store information in qubits."),
    ("A woman is slicing an onion.", "The train to Paris leaves at noon."),
    ("How do I reset my password?", "Elephants live in large family groups."),
]


def load_weights(path):
    """safetensors: 8-byte little-endian header size, a JSON table of dtype/shape/data_offsets, then the data."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    hlen = int(raw[:8].view("<u8")[0])
    table = json.loads(bytes(raw[8:8 + hlen]).decode("utf-8"))
    base = 8 + hlen
    kinds = {"F32": "<f4", "I64": "<i8"}
    w = {}
    for k, v in table.items():
        if k != "__metadata__":
            lo, hi = v["data_offsets"]
            w[k] = np.asarray(raw[base + lo:base + hi]).view(kinds[v["dtype"]]).reshape(v["shape"]).astype(np.float64)
    return w


def layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def bert_forward(w, cfg, ids, mask, tt):
    """transformers' BertModel (absolute positions, eager attention) -> last_hidden_state [B,S,H]."""
    B, S = ids.shape
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    hd, eps = H // nh, cfg["layer_norm_eps"]
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][tt]
         + w["embeddings.position_embeddings.weight"][np.arange(S)][None])
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    ext = (1.0 - mask[:, None, None, :].astype(np.float64)) * float(np.finfo(np.float32).min)

    def dense(h, name):
        return h @ w[name + ".weight"].T + w[name + ".bias"]

    def heads(h):
        return h.reshape(B, S, nh, hd).transpose(0, 2, 1, 3)

    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (heads(dense(x, p + "attention.self." + n)) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + ext
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(B, S, H)
        x = layer_norm(dense(ctx, p + "attention.output.dense") + x,
                       w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], eps)
        inter = dense(x, p + "intermediate.dense")
        inter = 0.5 * inter * (1.0 + erf(inter / math.sqrt(2.0)))
        x = layer_norm(dense(inter, p + "output.dense") + x,
                       w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    return x


def mean_pool_normalize(h, mask):
    m = mask[..., None].astype(np.float64)
    e = (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)


def tokenize(tok, sentences):
    encs = [tok.encode(s) for s in sentences]
    S = max(len(e.ids) for e in encs)
    ids = np.zeros((len(encs), S), np.int64)
    mask = np.zeros_like(ids)
    tt = np.zeros_like(ids)
    for i, e in enumerate(encs):
        n = len(e.ids)
        ids[i, :n], mask[i, :n], tt[i, :n] = e.ids, e.attention_mask, e.type_ids
    return ids, mask, tt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("onnx")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--dump")
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.model_dir, "config.json")))
    tok = Tokenizer.from_file(os.path.join(a.model_dir, "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    sentences = sorted({s for pair in PARAPHRASES + UNRELATED for s in pair})
    ids, mask, tt = tokenize(tok, sentences)
    assert ids[0, 0] == tok.token_to_id("[CLS]"), ids[0]

    sess = ort.InferenceSession(a.onnx, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": tt}
    o_hidden, o_emb = sess.run(["last_hidden_state", "sentence_embedding"], feeds)
    w = load_weights(os.path.join(a.model_dir, "model.safetensors"))
    r_hidden = bert_forward(w, cfg, ids, mask, tt)
    r_emb = mean_pool_normalize(r_hidden, mask)
    failures = []
    d_hidden = float(np.abs(o_hidden - r_hidden).max())
    d_emb = float(np.abs(o_emb - r_emb).max())
    if not d_hidden <= a.tol:
        failures.append(f"last_hidden_state: onnxruntime vs numpy max abs diff {d_hidden:.3g} > {a.tol}")
    if not d_emb <= a.tol:
        failures.append(f"sentence_embedding: onnxruntime vs numpy max abs diff {d_emb:.3g} > {a.tol}")

    # A sentence alone (no padding) gives the embedding it has in the padded batch.
    d_pad = 0.0
    for i, s in enumerate(sentences):
        f1 = dict(zip(("input_ids", "attention_mask", "token_type_ids"), tokenize(tok, [s])))
        d_pad = max(d_pad, float(np.abs(sess.run(["sentence_embedding"], f1)[0][0] - o_emb[i]).max()))
    if not d_pad < 1e-5:
        failures.append(f"padding changes the embedding: max abs diff {d_pad:.3g}")

    idx = {s: i for i, s in enumerate(sentences)}
    cos = lambda p: float(o_emb[idx[p[0]]] @ o_emb[idx[p[1]]])
    para = {f"{p[0]} | {p[1]}": cos(p) for p in PARAPHRASES}
    unrel = {f"{p[0]} | {p[1]}": cos(p) for p in UNRELATED}
    failures += [f"paraphrase cosine {c:.3f} <= 0.6: {k}" for k, c in para.items() if not c > 0.6]
    failures += [f"unrelated cosine {c:.3f} >= 0.3: {k}" for k, c in unrel.items() if not c < 0.3]

    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for k, v in feeds.items():
            np.save(os.path.join(a.dump, k + ".npy"), v)
        np.save(os.path.join(a.dump, "ort_last_hidden_state.npy"), o_hidden)
        np.save(os.path.join(a.dump, "ort_sentence_embedding.npy"), o_emb)
    print(json.dumps({"batch": list(ids.shape), "max_abs_diff_last_hidden_state": d_hidden,
                      "max_abs_diff_sentence_embedding": d_emb, "max_abs_diff_padding": d_pad,
                      "paraphrase_cosine": para, "unrelated_cosine": unrel, "failures": failures}))
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
