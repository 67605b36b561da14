#!/usr/bin/env python3
"""Quality of npuc's AVX2 saturating u8 x s8 recurrent step (DynamicQuantizeLSTM, `kernels/qgemv.rs`)
against its exact kernel, both measured against onnxruntime on this CPU, on the two text2tashkeel
models: the committed test input and N random character-id sequences (seeded). Prints, per model, the
largest |npuc - onnxruntime| of the logits and the share of positions whose argmax agrees with
onnxruntime, for the default build (saturating at the AVX2 level) and with NPUC_INT8_EXACT=1.
Usage:
  python scripts/u8s8_quality.py NPUC_BIN [N=20]
Test tooling only (numpy, onnxruntime from the test venv); the models come from scripts/fetch-data.sh
into $NPUC_CACHE (default ~/.cache/npuc).
"""
import os, sys, subprocess, tempfile
import numpy as np, onnxruntime as ort

npuc = sys.argv[1]
count = int(sys.argv[2]) if len(sys.argv) > 2 else 20
cache = os.path.expanduser(os.environ.get('NPUC_CACHE', '~/.cache/npuc'))
here = os.path.dirname(os.path.abspath(__file__))
fixtures = os.path.join(here, '../tests/fixtures/models/text2tashkeel')
# (model, input name, fixture input, vocabulary size: rows of the embedding)
models = [('bilstm', 'input_ids', 'bilstm.int8.ref/input_0_input_ids.npy', 54),
          ('rawi', 'input', 'rawi.int8.ref/input_0_input.npy', 302)]
rng = np.random.default_rng(0)
with tempfile.TemporaryDirectory() as tmp:
    for name, inp, fixture, vocab in models:
        path = os.path.join(cache, f'models/text2tashkeel/{name}.int8.onnx')
        if not os.path.exists(path):
            raise SystemExit(f'{path} is missing: run scripts/fetch-data.sh models first')
        sess = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
        x0 = np.load(os.path.join(fixtures, fixture))
        xs = [x0] + [rng.integers(1, vocab, size=x0.shape).astype(x0.dtype) for _ in range(count)]
        stats = {'default': [0.0, 0, 0], 'NPUC_INT8_EXACT=1': [0.0, 0, 0]}
        for i, x in enumerate(xs):
            xf = os.path.join(tmp, f'{name}_{i}.npy')
            np.save(xf, x)
            want = sess.run(None, {inp: x})[0]
            for mode, st in stats.items():
                env = dict(os.environ)
                env.pop('NPUC_INT8_EXACT', None)
                if mode != 'default':
                    env['NPUC_INT8_EXACT'] = '1'
                od = os.path.join(tmp, f'out_{name}_{i}_{mode[:3]}')
                subprocess.run([npuc, 'run', path, '--input', f'{inp}={xf}', '-o', od],
                               check=True, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                got = np.load(os.path.join(od, os.listdir(od)[0]))
                st[0] = max(st[0], float(np.abs(got - want).max()))
                st[1] += int((got.argmax(-1) == want.argmax(-1)).sum())
                st[2] += want.argmax(-1).size
        for mode, (diff, agree, total) in stats.items():
            print(f'{name} {mode:18s} inputs {len(xs)}: max |npuc - onnxruntime| {diff:.4f}, '
                  f'argmax agreement {agree}/{total} ({100.0 * agree / total:.2f}%)')
