#!/usr/bin/env python3
"""How often onnxruntime's AVX2 u8s8 integer kernels would saturate on a DynamicQuantizeLSTM model.

Without VNNI, onnxruntime multiplies u8 activations by s8 weights with `vpmaddubsw`, whose i16 sum
of two adjacent products (k, k+1) saturates beyond 32767; npuc's AVX2 kernels are exact (i16
`vpmaddwd`, about twice the vector operations). This counts the pair sums that would saturate
for the recurrent products (each step's hidden state quantized to u8 as DynamicQuantizeLSTM does)
and the input projections, on the text2tashkeel BiLSTM and its test input. Usage:
  python scripts/u8s8_saturation.py
Test tooling only (numpy, onnx, onnxruntime from the test venv); the model comes from
scripts/fetch-data.sh into $NPUC_CACHE (default ~/.cache/npuc).
"""
import os
import onnx, numpy as np, onnxruntime as ort
from onnx import numpy_helper, helper
cache = os.path.expanduser(os.environ.get('NPUC_CACHE', '~/.cache/npuc'))
model = os.path.join(cache, 'models/text2tashkeel/bilstm.int8.onnx')
if not os.path.exists(model):
    raise SystemExit(f'{model} is missing: run scripts/fetch-data.sh first')
m = onnx.load(model)
inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
lstms = [n for n in m.graph.node if n.op_type == 'DynamicQuantizeLSTM']
for n in lstms:
    m.graph.output.append(helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, None))
    m.graph.output.append(helper.make_tensor_value_info(n.input[0], onnx.TensorProto.FLOAT, None))
s = ort.InferenceSession(m.SerializeToString(), providers=['CPUExecutionProvider'])
here = os.path.dirname(os.path.abspath(__file__))
x = np.load(os.path.join(here, '../tests/fixtures/models/text2tashkeel/bilstm.int8.ref/input_0_input_ids.npy'))
outs = s.run(None, {'input_ids': x})
names = [o.name for o in s.get_outputs()]
res = dict(zip(names, outs))
def qu8(v):
    lo, hi = min(v.min(), 0.0), max(v.max(), 0.0)
    sc = (hi - lo) / 255 if hi > lo else 1.0
    zp = np.clip(np.round(-lo / sc), 0, 255)
    return np.clip(np.round(v / sc) + zp, 0, 255).astype(np.int32)
tot = sat = 0; worst = 0
for n in lstms:
    Y = res[n.output[0]]  # [seq, dirs, batch, hidden]
    R = inits[n.input[2]].astype(np.int32)  # [dirs, hidden, 4*hidden]
    Rzp = inits[n.input[11]]
    Wq = inits[n.input[1]].astype(np.int32); X = res[n.input[0]]
    for d in range(Y.shape[1]):
        for t in range(Y.shape[0]):
            u = qu8(Y[t, d, 0])          # state used by the next step
            p = u[0::2, None] * R[d, 0::2, :] + u[1::2, None] * R[d, 1::2, :]
            tot += p.size; sat += (np.abs(p) > 32767).sum(); worst = max(worst, np.abs(p).max())
        # input projection: X rows quantized together
        Xd = X.reshape(X.shape[0], -1)
        u = qu8(Xd)
        k = u.shape[1] - u.shape[1] % 2
        p = u[:, 0:k:2, None] * Wq[d, 0:k:2, :][None] + u[:, 1:k:2, None] * Wq[d, 1:k:2, :][None]
        tot += p.size; sat += (np.abs(p) > 32767).sum(); worst = max(worst, np.abs(p).max())
    print(n.name, 'R zp', np.unique(Rzp)[:4], 'W range', Wq.min(), Wq.max(), 'R range', R.min(), R.max())
print('pair sums', tot, 'saturating', sat, 'fraction %.2e' % (sat / tot), 'max |pair|', worst)
