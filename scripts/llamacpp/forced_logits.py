# llama.cpp logits for a forced continuation (prompt in one batch, then token by token), as raw f32.
import sys, os, json, numpy as np
sys.path.insert(0, os.path.join(os.environ.get('NPUC_CACHE', os.path.expanduser('~/.cache/npuc')), 'llamacpp/llama_cpp_python-0.3.36'))
os.environ.setdefault('LLAMA_CPP_LIB_PATH', os.path.join(os.environ.get('NPUC_CACHE', os.path.expanduser('~/.cache/npuc')), 'llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin'))
import llama_cpp
from llama_cpp import Llama
model, prompt, forced, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
# llama.cpp's CLI default (flash_attn 'auto') is flash attention on the CPU; 'nofa' turns it off.
fa = not (len(sys.argv) > 5 and sys.argv[5] == 'nofa')
llm = Llama(model, n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=False, verbose=False, flash_attn=fa)
p = [int(x) for x in prompt.split(',')]
f = [int(x) for x in forced.split(',') if x]
rows = []
llm.reset()
llm.eval(p)
rows.append(np.array(llm.scores[llm.n_tokens-1], dtype=np.float32).copy() if llm._logits_all else np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
for t in f:
    llm.eval([t])
    rows.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
np.stack(rows).astype(np.float32).tofile(out)
print('greedy over forced steps:', [int(r.argmax()) for r in rows])
