# llama.cpp's top-1 (argmax) at every position llama-perplexity scores, for teacher-forced
# agreement checks (`npuc perplexity --top1-ref OUT.npy`):
#   scripts/llamacpp/build.sh
#   $NPUC_CACHE/venv/bin/python scripts/llamacpp/make_top1_refs.py MODEL.gguf TEXT OUT.npy [CTX]
# Variants of llama.cpp itself (to measure how far its own code paths agree with each other):
#   FA=0 (flash attention off), NB=N (batch of N tokens: NB=1 runs token by token through the
#   decode path), LIB=DIR (another build's bin/, e.g. build-native); COMPARE=REF.npy prints the
#   agreement of these ids with REF at the end.
# Same chunking as llama-perplexity (and npuc perplexity): the text tokenized with
# add_special=true, cut into len/CTX chunks of CTX tokens, each chunk's first token replaced by
# BOS when the model adds one, evaluated from an empty cache in one batch; positions
# CTX/2 .. CTX-2 of each chunk scored. Writes int32 ids, chunk after chunk.
import os, sys
import numpy as np
CACHE = os.path.join(os.environ.get('NPUC_CACHE', os.path.expanduser('~/.cache/npuc')), 'llamacpp/llama_cpp_python-0.3.36')
sys.path.insert(0, CACHE)
os.environ.setdefault('LLAMA_CPP_LIB_PATH', os.environ.get('LIB', os.path.join(CACHE, 'vendor/llama.cpp/build/bin')))
from llama_cpp import Llama

model, text_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
ctx = int(sys.argv[4]) if len(sys.argv) > 4 else 512
batch = int(os.environ.get('NB', ctx))
llm = Llama(model, n_ctx=ctx, n_batch=batch, n_ubatch=batch, n_threads=2, n_threads_batch=2,
            logits_all=True, verbose=False, flash_attn=os.environ.get('FA', '1') != '0')
tokens = llm.tokenize(open(text_path, encoding='utf-8').read().encode(), add_bos=True, special=False)
add_bos = tokens[:1] == [llm.token_bos()] and llm.token_bos() >= 0
first, n_chunk = ctx // 2, len(tokens) // ctx
top1 = []
for k in range(n_chunk):
    chunk = list(tokens[k * ctx:(k + 1) * ctx])
    if add_bos:
        chunk[0] = llm.token_bos()
    llm.reset()
    llm.eval(chunk)
    for p in range(first, ctx - 1):
        top1.append(int(np.argmax(llm.scores[p])))
    print(f'[{k + 1}/{n_chunk}]', end=' ', flush=True)
np.save(out, np.array(top1, dtype=np.int32))
print(f'\n{len(tokens)} tokens, {n_chunk} chunks of {ctx}: {len(top1)} top-1 ids -> {out}')
if os.environ.get('COMPARE'):
    want = np.load(os.environ['COMPARE'])[:len(top1)]
    same = int((np.array(top1) == want).sum())
    print(f'agreement with {os.environ["COMPARE"]}: {same}/{len(top1)} ({100 * same / len(top1):.2f}%)')
