import sys, os, ctypes, numpy as np
sys.path.insert(0, os.path.join(os.environ.get('NPUC_CACHE', os.path.expanduser('~/.cache/npuc')), 'llamacpp/llama_cpp_python-0.3.36'))
os.environ.setdefault('LLAMA_CPP_LIB_PATH', os.path.join(os.environ.get('NPUC_CACHE', os.path.expanduser('~/.cache/npuc')), 'llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin'))
import llama_cpp
from llama_cpp import Llama
class T(ctypes.Structure):
    _fields_=[('type',ctypes.c_int),('buffer',ctypes.c_void_p),('ne',ctypes.c_int64*4),('nb',ctypes.c_size_t*4),('op',ctypes.c_int),
              ('op_params',ctypes.c_int32*16),('flags',ctypes.c_int32),('src',ctypes.c_void_p*10),('view_src',ctypes.c_void_p),('view_offs',ctypes.c_size_t),
              ('data',ctypes.c_void_p),('name',ctypes.c_char*64),('extra',ctypes.c_void_p),('padding',ctypes.c_char*8)]
want=sys.argv[2].split(',')
got=[]
active=[True]
@llama_cpp.ggml_backend_sched_eval_callback
def cb(t, ask, ud):
    tt=T.from_address(t); nm=tt.name.decode()
    if ask: return True
    if not active[0]: return True
    if any(nm==w or nm.endswith(w) for w in want) or nm in want:
        ne=list(tt.ne); nb=list(tt.nb)
        if tt.type==0:
            # gather as float32 with strides
            arr=np.zeros(ne[::-1],dtype=np.float32)
            buf=(ctypes.c_char*(nb[3]*ne[3])).from_address(tt.data)
            a=np.lib.stride_tricks.as_strided(np.frombuffer(buf,dtype=np.uint8), shape=ne[::-1]+[4], strides=nb[::-1]+[1])
            arr=np.ascontiguousarray(a).view(np.float32).reshape(ne[::-1])
            got.append((nm,tt.op,ne,arr.copy()))
        else:
            got.append((nm,tt.op,ne,None))
    return True
model=sys.argv[1]
import llama_cpp.llama_cpp as LL
_orig=LL.llama_context_default_params
def _p():
    p=_orig(); p.cb_eval=cb; p.cb_eval_user_data=None; return p
LL.llama_context_default_params=_p
llm=Llama(model, n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False, flash_attn=True)
p=[int(x) for x in sys.argv[3].split(',')]
forced=[int(x) for x in sys.argv[5].split(',')] if len(sys.argv)>5 and sys.argv[5] else []
if forced:
    active[0]=False
    llm.eval(p)
    for t in forced[:-1]: llm.eval([t])
    active[0]=True
    llm.eval([forced[-1]])
else:
    llm.eval(p)
import pickle
pickle.dump(got, open(sys.argv[4],'wb'))
for nm,op,ne,a in got: print(nm,op,ne, None if a is None else float(np.abs(a).sum()))
