#!/usr/bin/env python3
"""Builds the ONNX encoder of all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 12 heads) from its safetensors.

The graph is the one Hugging Face / optimum export for `BertModel` at opset 17 (eager attention):
  embeddings  Gather(word, input_ids) + Gather(token_type, token_type_ids) + Gather(position, Slice(position_ids
              buffer, 0..seq)), LayerNormalization (eps 1e-12)
  mask        attention_mask [B,S] -> Unsqueeze [B,1,1,S] -> Cast f32 -> (1 - m) * MASK  (MASK = finfo(f32).min,
              transformers' get_extended_attention_mask; --mask-value -10000 gives the older exports' value)
  per layer   q/k/v MatMul+Add, Reshape [B,S,12,32], Transpose to heads (k to [B,12,32,S]), MatMul, Div sqrt(32),
              Add mask, Softmax, MatMul v, Transpose/Reshape [B,S,384], MatMul+Add, residual Add, LayerNormalization,
              FFN MatMul+Add, GELU (Div sqrt2, Erf, Add 1, Mul x, Mul 0.5), MatMul+Add, residual Add,
              LayerNormalization
Inputs input_ids / attention_mask / token_type_ids [batch, sequence] int64; outputs `last_hidden_state`
[batch, sequence, 384] and `sentence_embedding` [batch, 384]: sentence-transformers' mean pooling over the
attention mask (1_Pooling: pooling_mode_mean_tokens) followed by its Normalize module (L2, eps 1e-12).
Weights are read from model.safetensors with numpy (the header is parsed here; no torch).

Usage: scripts/make_minilm_onnx.py MODEL_DIR OUT.onnx [--mask-value V]
  MODEL_DIR: scripts/fetch-data.sh minilm-l6 ($NPUC_CACHE/models/minilm-l6). Test tooling only.
"""
import argparse, json, os, struct, sys
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def read_safetensors(path):
    """{name: ndarray} from a .safetensors file: u64 LE header length, JSON header, raw little-endian data."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = np.dtype(ST_DTYPES[info["dtype"]]).newbyteorder("<")
        out[name] = np.frombuffer(data[a:b], dtype=dt).reshape(info["shape"]).astype(dt.newbyteorder("="))
    return out


class G:
    def __init__(self):
        self.nodes, self.inits = [], []
        self.n = 0

    def init(self, name, arr):
        self.inits.append(numpy_helper.from_array(np.array(arr, order="C"), name))
        return name

    def const(self, name, arr):
        return self.init(name, np.asarray(arr))

    def op(self, op, ins, name, outs=1, **attrs):
        names = [f"{name}_output_{i}" for i in range(outs)]
        self.nodes.append(helper.make_node(op, ins, names, name=name, **attrs))
        return names[0] if outs == 1 else names


def build(model_dir, mask_value):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    pool = json.load(open(os.path.join(model_dir, "1_Pooling", "config.json")))
    assert cfg["model_type"] == "bert" and cfg["hidden_act"] == "gelu", cfg
    assert cfg["position_embedding_type"] == "absolute", cfg
    assert pool["pooling_mode_mean_tokens"] and not (pool["pooling_mode_cls_token"] or pool["pooling_mode_max_tokens"]), pool
    w = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    H, NH, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    D, eps = H // NH, cfg["layer_norm_eps"]
    g = G()

    # Shared constants (as in the exports, one initializer each).
    one = g.const("one_f32", np.array(1.0, np.float32))
    maskv = g.const("mask_value", np.array(mask_value, np.float32))
    sqrt_d = g.const("sqrt_head_dim", np.array(np.sqrt(D), np.float32))
    sqrt2 = g.const("sqrt2", np.array(np.sqrt(2.0), np.float32))
    half = g.const("half", np.array(0.5, np.float32))
    heads_shape = g.const("heads_shape", np.array([0, 0, NH, D], np.int64))
    hidden_shape = g.const("hidden_shape", np.array([0, 0, H], np.int64))

    # Embeddings.
    e = "embeddings."
    word = g.init(e + "word_embeddings.weight", w[e + "word_embeddings.weight"])
    ttype = g.init(e + "token_type_embeddings.weight", w[e + "token_type_embeddings.weight"])
    posw = g.init(e + "position_embeddings.weight", w[e + "position_embeddings.weight"])
    pos_ids = g.init(e + "position_ids", w[e + "position_ids"].astype(np.int64))
    shape = g.op("Shape", ["input_ids"], "/embeddings/Shape")
    seq = g.op("Gather", [shape, g.const("idx1", np.array(1, np.int64))], "/embeddings/Gather", axis=0)
    seq1 = g.op("Unsqueeze", [seq, g.const("axes0", np.array([0], np.int64))], "/embeddings/Unsqueeze")
    pids = g.op("Slice", [pos_ids, g.const("zero1", np.array([0], np.int64)), seq1,
                          g.const("axes1", np.array([1], np.int64))], "/embeddings/Slice")
    x = g.op("Gather", [word, "input_ids"], "/embeddings/word_embeddings/Gather")
    t = g.op("Gather", [ttype, "token_type_ids"], "/embeddings/token_type_embeddings/Gather")
    x = g.op("Add", [x, t], "/embeddings/Add")
    p = g.op("Gather", [posw, pids], "/embeddings/position_embeddings/Gather")
    x = g.op("Add", [x, p], "/embeddings/Add_1")
    x = g.op("LayerNormalization", [x, g.init(e + "LayerNorm.weight", w[e + "LayerNorm.weight"]),
                                    g.init(e + "LayerNorm.bias", w[e + "LayerNorm.bias"])],
             "/embeddings/LayerNorm/LayerNormalization", axis=-1, epsilon=eps)

    # Extended additive attention mask [B,1,1,S].
    m = g.op("Unsqueeze", ["attention_mask", g.const("axes12", np.array([1, 2], np.int64))], "/Unsqueeze")
    m = g.op("Cast", [m], "/Cast", to=TensorProto.FLOAT)
    m = g.op("Sub", [one, m], "/Sub")
    mask = g.op("Mul", [m, maskv], "/Mul")

    def linear(x, prefix, node):
        wt = g.init(prefix + ".weight.T", w[prefix + ".weight"].T.copy())
        b = g.init(prefix + ".bias", w[prefix + ".bias"])
        y = g.op("MatMul", [x, wt], node + "/MatMul")
        return g.op("Add", [b, y], node + "/Add")

    def layernorm(x, prefix, node):
        return g.op("LayerNormalization", [x, g.init(prefix + ".weight", w[prefix + ".weight"]),
                                           g.init(prefix + ".bias", w[prefix + ".bias"])],
                    node, axis=-1, epsilon=eps)

    for i in range(L):
        pre, nd = f"encoder.layer.{i}.", f"/encoder/layer.{i}"
        a = nd + "/attention/self"
        q = linear(x, pre + "attention.self.query", a + "/query")
        k = linear(x, pre + "attention.self.key", a + "/key")
        v = linear(x, pre + "attention.self.value", a + "/value")
        k = g.op("Reshape", [k, heads_shape], a + "/Reshape")
        k = g.op("Transpose", [k], a + "/Transpose", perm=[0, 2, 3, 1])
        v = g.op("Reshape", [v, heads_shape], a + "/Reshape_1")
        v = g.op("Transpose", [v], a + "/Transpose_1", perm=[0, 2, 1, 3])
        q = g.op("Reshape", [q, heads_shape], a + "/Reshape_2")
        q = g.op("Transpose", [q], a + "/Transpose_2", perm=[0, 2, 1, 3])
        s = g.op("MatMul", [q, k], a + "/MatMul")
        s = g.op("Div", [s, sqrt_d], a + "/Div")
        s = g.op("Add", [s, mask], a + "/Add")
        s = g.op("Softmax", [s], a + "/Softmax", axis=-1)
        c = g.op("MatMul", [s, v], a + "/MatMul_1")
        c = g.op("Transpose", [c], a + "/Transpose_3", perm=[0, 2, 1, 3])
        c = g.op("Reshape", [c, hidden_shape], a + "/Reshape_3")
        o = linear(c, pre + "attention.output.dense", nd + "/attention/output/dense")
        o = g.op("Add", [o, x], nd + "/attention/output/Add")
        x = layernorm(o, pre + "attention.output.LayerNorm", nd + "/attention/output/LayerNorm/LayerNormalization")
        f = linear(x, pre + "intermediate.dense", nd + "/intermediate/dense")
        ga = nd + "/intermediate/intermediate_act_fn"
        e1 = g.op("Div", [f, sqrt2], ga + "/Div")
        e1 = g.op("Erf", [e1], ga + "/Erf")
        e1 = g.op("Add", [e1, one], ga + "/Add")
        e1 = g.op("Mul", [f, e1], ga + "/Mul")
        f = g.op("Mul", [e1, half], ga + "/Mul_1")
        o = linear(f, pre + "output.dense", nd + "/output/dense")
        o = g.op("Add", [o, x], nd + "/output/Add")
        x = layernorm(o, pre + "output.LayerNorm", nd + "/output/LayerNorm/LayerNormalization")
    g.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"], name="/Identity_last_hidden_state"))

    # sentence-transformers: mean pooling over the mask, then L2 normalize (torch.nn.functional.normalize).
    mk = g.op("Unsqueeze", ["attention_mask", g.const("axes_m1", np.array([-1], np.int64))], "/pooling/Unsqueeze")
    mk = g.op("Cast", [mk], "/pooling/Cast", to=TensorProto.FLOAT)
    summed = g.op("ReduceSum", [g.op("Mul", [x, mk], "/pooling/Mul"), g.const("axes_pool", np.array([1], np.int64))],
                  "/pooling/ReduceSum", keepdims=0)
    count = g.op("ReduceSum", [mk, g.const("axes_pool2", np.array([1], np.int64))], "/pooling/ReduceSum_1", keepdims=0)
    count = g.op("Clip", [count, g.const("min_count", np.array(1e-9, np.float32))], "/pooling/Clip")
    mean = g.op("Div", [summed, count], "/pooling/Div")
    norm = g.op("ReduceL2", [mean], "/normalize/ReduceL2", axes=[-1], keepdims=1)
    norm = g.op("Clip", [norm, g.const("min_norm", np.array(1e-12, np.float32))], "/normalize/Clip")
    g.nodes.append(helper.make_node("Div", [mean, norm], ["sentence_embedding"], name="/normalize/Div"))

    ins = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch_size", "sequence_length"])
           for n in ("input_ids", "attention_mask", "token_type_ids")]
    outs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch_size", "sequence_length", H]),
            helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch_size", H])]
    graph = helper.make_graph(g.nodes, "main_graph", ins, outs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="npuc-scripts",
                              producer_version="make_minilm_onnx.py", ir_version=8)
    model.doc_string = "sentence-transformers/all-MiniLM-L6-v2 (BertModel + mean pooling + L2 normalize)"
    onnx.checker.check_model(model, full_check=True)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--mask-value", type=float, default=float(np.finfo(np.float32).min))
    a = ap.parse_args()
    model = build(a.model_dir, a.mask_value)
    tmp = a.out + ".tmp"
    onnx.save(model, tmp)
    os.replace(tmp, a.out)
    print(f"wrote {a.out}: {len(model.graph.node)} nodes, "
          f"{sum(int(np.prod(t.dims)) for t in model.graph.initializer)} initializer values")


if __name__ == "__main__":
    sys.exit(main())
