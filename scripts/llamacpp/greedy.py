# Greedy continuations of the reference prompts with the llama.cpp built by build.sh, compared
# with tests/fixtures/llm/gemma3's llama.cpp reference (identical prefix per prompt):
#   python3 scripts/llamacpp/greedy.py MODEL.gguf ['{"flash_attn": false}']
# With build.sh's AVX2 build and llama.cpp's defaults (flash attention on) it reproduces all
# four reference continuations (48/48 each).
import sys, os, json, numpy as np
CACHE = os.path.join(os.environ.get('NPUC_CACHE', os.path.expanduser('~/.cache/npuc')), 'llamacpp/llama_cpp_python-0.3.36')
sys.path.insert(0, CACHE)
os.environ.setdefault('LLAMA_CPP_LIB_PATH', os.path.join(CACHE, 'vendor/llama.cpp/build/bin'))
from llama_cpp import Llama
here = os.path.dirname(os.path.abspath(__file__))
ref = json.load(open(os.path.join(here, '../../tests/fixtures/llm/gemma3/gemma3_270m_greedy.json')))
kw = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
llm = Llama(sys.argv[1], **{**dict(n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False, flash_attn=True), **kw})
for p in ref['prompts']:
    llm.reset()
    llm.eval(p['prompt_ids_bos'])
    out = []
    for _ in range(len(p['gen_ids'])):
        lg = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        t = int(lg.argmax())
        out.append(t)
        llm.eval([t])
    same = next((i for i, (a, b) in enumerate(zip(out, p['gen_ids'])) if a != b), len(out))
    print(f"prompt of {len(p['prompt_ids_bos'])} tokens: identical prefix {same}/{len(out)}")
