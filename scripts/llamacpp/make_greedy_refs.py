# Greedy continuations by llama.cpp (the AVX2 build of scripts/llamacpp/build.sh, its defaults:
# flash attention on) of the four reference prompts of tests/fixtures/llm/gemma3, for another
# GGUF model; writes the same JSON layout as gemma3_270m_greedy.json:
#   scripts/llamacpp/build.sh
#   $NPUC_CACHE/venv/bin/python scripts/llamacpp/make_greedy_refs.py MODEL.gguf OUT.json
# The references of tests/fixtures/llm/{smollm2,qwen2.5}/ were made this way.
import hashlib, json, os, sys
import numpy as np
CACHE = os.path.join(os.environ.get('NPUC_CACHE', os.path.expanduser('~/.cache/npuc')), 'llamacpp/llama_cpp_python-0.3.36')
sys.path.insert(0, CACHE)
os.environ.setdefault('LLAMA_CPP_LIB_PATH', os.path.join(CACHE, 'vendor/llama.cpp/build/bin'))
from llama_cpp import Llama

model, out_path = sys.argv[1], sys.argv[2]
here = os.path.dirname(os.path.abspath(__file__))
gemma = json.load(open(os.path.join(here, '../../tests/fixtures/llm/gemma3/gemma3_270m_greedy.json')))
N = gemma['n_predict']
llm = Llama(model, n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False, flash_attn=True)
sha = hashlib.sha256(open(model, 'rb').read()).hexdigest()
eog = {llm.token_eos()}
prompts = []
for p in gemma['prompts']:
    text = p['prompt']
    bos = llm.tokenize(text.encode(), add_bos=True, special=False)
    nobos = llm.tokenize(text.encode(), add_bos=False, special=False)
    llm.reset()
    llm.eval(bos)
    # Always N ids (argmax after argmax, an end-of-generation token included: the comparison is of
    # the model's arithmetic, not of a stopping rule).
    gen = []
    for _ in range(N):
        lg = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        t = int(lg.argmax())
        gen.append(t)
        if len(gen) < N:
            llm.eval([t])
    stopped = any(t in eog for t in gen)
    pieces = [llm.detokenize([t]).decode('utf-8', 'replace') for t in gen]
    prompts.append(dict(prompt=text, prompt_ids_bos=bos, prompt_ids_nobos=nobos, gen_ids=gen,
                        gen_pieces=pieces, gen_text=llm.detokenize(gen).decode('utf-8', 'replace'),
                        stopped_on_eog=stopped))
    print(f'{len(bos)} prompt tokens -> {len(gen)} generated: {prompts[-1]["gen_text"]!r}')
json.dump(dict(model=os.path.basename(model), model_sha256=sha, engine=gemma['engine'], n_predict=N,
               note='prompt_ids_bos is what llama.cpp feeds (llama_tokenize with add_bos as the GGUF says); '
                    'gen_ids are n_predict argmax steps, past an end-of-generation token if one comes (stopped_on_eog).',
               prompts=prompts), open(out_path, 'w'), indent=1, ensure_ascii=False)
