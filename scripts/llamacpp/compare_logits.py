import numpy as np, sys, json
V=262144
a=np.fromfile(sys.argv[1],dtype=np.float32).reshape(-1,V); b=np.fromfile(sys.argv[2],dtype=np.float32).reshape(-1,V)
for i,(x,y) in enumerate(zip(a,b)):
    t=np.argsort(-x)[:2]; 
    print(i, 'maxdiff %.4f'%np.abs(x-y).max(), 'meandiff %.4f'%np.abs(x-y).mean(), 'argmax', x.argmax(), y.argmax(), 'margin_a %.4f'%(x[t[0]]-x[t[1]]), 'top-diff %.4f'%(x[t[0]]-y[t[0]]))
