#!/usr/bin/env python3
"""Test tooling for `npuc verify` (npuc itself never runs Python).

Two sub-commands:

  make_ort_qdq.py make MODEL.onnx OUT_DIR [--calib N] [--heldout M] [--width W] [--seed S]
      Writes OUT_DIR/float.onnx (MODEL with the input width fixed), OUT_DIR/calib/x_NNN.npy,
      OUT_DIR/heldout/x_NNN.npy (text-line crops of tests/fixtures/ocr/line.png with brightness,
      contrast, shift and noise jitter, preprocessed as PaddleOCR does) and OUT_DIR/q.onnx:
      onnxruntime `quantize_static` (QDQ, per-channel, MinMax, uint8 activations / int8 weights)
      calibrated on the first N calib samples. N=1 is the deliberately broken calibration.

  make_ort_qdq.py sqnr FLOAT.onnx Q.onnx INPUT_DIR
      Independent reference for `npuc verify`: runs both models in onnxruntime with every
      intermediate tensor exposed, maps ORT's `T_DequantizeLinear_Output` names back to `T`, and
      prints JSON {"layers": {name: {"sqnr_db", "cosine", "max_abs_err"}}, "output": {...}} with
      SQNR accumulated over all samples in numpy (float64).
"""
import argparse, json, os, struct, sys, zlib
import numpy as np
import onnx
import onnxruntime as ort

HERE = os.path.dirname(os.path.abspath(__file__))
LINE_PNG = os.path.join(HERE, "..", "tests", "fixtures", "ocr", "line.png")


def read_png_rgb8(path):
    """Minimal decoder for 8-bit RGB, non-interlaced PNGs (what line.png is)."""
    b = open(path, "rb").read()
    assert b[:8] == b"\x89PNG\r\n\x1a\n", path
    pos, idat, w = 8, b"", None
    while pos < len(b):
        n, typ = struct.unpack(">I4s", b[pos:pos + 8])
        data = b[pos + 8:pos + 8 + n]
        if typ == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", data)
            assert depth == 8 and ctype == 2 and interlace == 0, "only 8-bit RGB PNGs"
        elif typ == b"IDAT":
            idat += data
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = w * 3
    out = np.zeros((h, stride), np.uint8)
    prev = np.zeros(stride, np.int32)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        cur = np.zeros(stride, np.int32)
        for x in range(stride):
            a = cur[x - 3] if x >= 3 else 0
            c = prev[x - 3] if x >= 3 else 0
            bb = prev[x]
            if f == 0:
                p = 0
            elif f == 1:
                p = a
            elif f == 2:
                p = bb
            elif f == 3:
                p = (a + bb) // 2
            else:
                pa, pb, pc = abs(bb - c), abs(a - c), abs(a + bb - 2 * c)
                p = a if pa <= pb and pa <= pc else (bb if pb <= pc else c)
            cur[x] = (line[x] + p) & 255
        out[y] = cur
        prev = cur
    return out.reshape(h, w, 3)


def samples(n, width, rng):
    img = read_png_rgb8(LINE_PNG).astype(np.float32)  # 48 x 299 x 3
    h, w, _ = img.shape
    res = []
    for _ in range(n):
        x0 = int(rng.integers(0, max(1, w - width)))
        crop = img[:, x0:x0 + width, :]
        if crop.shape[1] < width:
            crop = np.pad(crop, ((0, 0), (0, width - crop.shape[1]), (0, 0)), constant_values=255)
        contrast = rng.uniform(0.5, 1.3)
        bright = rng.uniform(-60, 40)
        crop = (crop - 128) * contrast + 128 + bright + rng.normal(0, 6, crop.shape)
        crop = np.clip(crop, 0, 255)
        x = (crop[:, :, ::-1] / 255.0 - 0.5) / 0.5  # BGR, [-1, 1] as PaddleOCR does
        res.append(np.ascontiguousarray(x.transpose(2, 0, 1)[None]).astype(np.float32))
    return res


def cmd_make(a):
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    m = onnx.load(a.model)
    inp = m.graph.input[0]
    dims = inp.type.tensor_type.shape.dim
    for d, v in zip(dims, [1, 3, 48, a.width]):
        d.Clear()
        d.dim_value = v
    for o in m.graph.output:  # declared output shapes are symbolic; let shape inference redo them
        o.type.tensor_type.ClearField("shape")
    if m.opset_import[0].version < 13:  # per-channel Q/DQ (the axis attribute) needs opset 13
        from onnx import version_converter
        m = version_converter.convert_version(m, 13)
    fp = os.path.join(a.out, "float.onnx")
    onnx.save(m, fp)
    calib = samples(a.calib, a.width, rng)
    held = samples(a.heldout, a.width, rng)
    for sub, xs in (("calib", calib), ("heldout", held)):
        os.makedirs(os.path.join(a.out, sub), exist_ok=True)
        for i, x in enumerate(xs):
            np.save(os.path.join(a.out, sub, f"x_{i:03d}.npy"), x)

    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static, CalibrationMethod)

    class Reader(CalibrationDataReader):
        def __init__(self, xs):
            self.it = iter([{inp.name: x} for x in xs])

        def get_next(self):
            return next(self.it, None)

    quantize_static(fp, os.path.join(a.out, "q.onnx"), Reader(calib),
                    quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax)
    print(f"wrote {a.out}/float.onnx, q.onnx ({a.calib} calibration samples), "
          f"{a.heldout} held-out samples")


def expose_all(path):
    m = onnx.load(path)
    have = {o.name for o in m.graph.output}
    for n in m.graph.node:
        for o in n.output:
            if o and o not in have:
                m.graph.output.append(onnx.ValueInfoProto(name=o))
                have.add(o)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]), m


def canonical(name):
    for suf in ("_DequantizeLinear_Output", "_QuantizeLinear_Output"):
        if name.endswith(suf):
            return name[: -len(suf)]
    return name


def cmd_sqnr(a):
    fs, fm = expose_all(a.float)
    qs, qm = expose_all(a.q)
    files = sorted(f for f in os.listdir(a.inputs) if f.endswith(".npy"))
    inp = fs.get_inputs()[0].name
    fnames = [o.name for o in fs.get_outputs()]
    qnames = [o.name for o in qs.get_outputs()]
    # The quantized value of T: its DequantizeLinear output when ORT renamed it, else T itself.
    qmap = {}
    for n in qnames:
        c = canonical(n)
        if n.endswith("_DequantizeLinear_Output") or c not in qmap:
            qmap[c] = n
    acc = {}
    for f in files:
        x = np.load(os.path.join(a.inputs, f))
        fo = dict(zip(fnames, fs.run(None, {inp: x})))
        qo = dict(zip(qnames, qs.run(None, {inp: x})))
        for name, r in fo.items():
            if name not in qmap or not np.issubdtype(r.dtype, np.floating):
                continue
            q = qo[qmap[name]]
            if q.shape != r.shape or not np.issubdtype(q.dtype, np.floating):
                continue
            r64, q64 = r.astype(np.float64).ravel(), q.astype(np.float64).ravel()
            s = acc.setdefault(name, [0.0, 0.0, 0.0, 0.0, 0.0])
            s[0] += float(r64 @ r64)
            s[1] += float((r64 - q64) @ (r64 - q64))
            s[2] += float(r64 @ q64)
            s[3] += float(q64 @ q64)
            s[4] = max(s[4], float(np.abs(r64 - q64).max(initial=0.0)))

    def metrics(s):
        sq = None if s[1] == 0 else (10 * np.log10(s[0] / s[1]) if s[0] > 0 else -np.inf)
        cos = 1.0 if s[0] == 0 and s[3] == 0 else s[2] / (np.sqrt(s[0]) * np.sqrt(s[3]) + 1e-300)
        return {"sqnr_db": sq, "cosine": cos, "max_abs_err": s[4]}

    outs = [o.name for o in fm.graph.output][: len(onnx.load(a.float).graph.output)]
    print(json.dumps({"layers": {k: metrics(v) for k, v in acc.items()},
                      "output": {k: metrics(acc[k]) for k in outs if k in acc}}))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("model")
    mk.add_argument("out")
    mk.add_argument("--calib", type=int, default=16)
    mk.add_argument("--heldout", type=int, default=8)
    mk.add_argument("--width", type=int, default=160)
    mk.add_argument("--seed", type=int, default=0)
    sq = sub.add_parser("sqnr")
    sq.add_argument("float")
    sq.add_argument("q")
    sq.add_argument("inputs")
    a = p.parse_args()
    {"make": cmd_make, "sqnr": cmd_sqnr}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
