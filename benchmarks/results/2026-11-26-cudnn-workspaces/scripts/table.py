import json, collections, sys, math
sys.path.insert(0,'/work/main')
import torch
from memcalc.targets.cuda.cudnn import conv_workspace_bytes
rows=json.load(open('ws_rows.json'))
DT={'float32':torch.float32,'float16':torch.float16}
def cview(r):
    x,w,y=r['x'],r['w'],r['y']
    if r['transposed']: x,y=y,x
    return x,w,y
def memcalc(r):
    x,w,y=r['x'],r['w'],r['y']  # memcalc passes layer view
    d=r['dir']
    if r['transposed']:
        d={'backward_data':'backward_data','forward':'backward_data','backward_filter':'backward_filter'}[d]
    return conv_workspace_bytes(x,w,y,DT[r['dtype']],r['stride'],r['padding'],r['dilation'],r['groups'],d,(9,0))
# step consistency
agg=collections.defaultdict(list)
for r in rows:
    agg[(r['cfg'],r['layer'],r['dir'])].append((r['step'],tuple(r['ws']),tuple(r['tried'])))
incons=[(k,v) for k,v in agg.items() if len(set(s[1] for s in v))>1]
print('inconsistent between steps:',len(incons))
for k,v in incons: print(' ',k,v)
if __name__=='__main__':
    seen=set()
    for r in rows:
        x,w,y=cview(r)
        key=(r['cfg'],tuple(x),tuple(w),tuple(y),tuple(r['stride']),r['dir'])
        if key in seen: continue
        seen.add(key)
        ws=r['ws'][0] if r['ws'] else 0
        print(f"{r['cfg'][:22]:22s} {r['layer'][:22]:22s} {'T' if r['transposed'] else ' '} C{x[1]:>4}->K{w[0]:>4} k{w[2]} s{r['stride'][0]} HW{x[2]:>3}->{y[2]:>3} N{x[0]:>3} {r['dtype'][:4]} {r['dir']:15s} real {ws:>11,} memcalc {memcalc(r):>11,}  steps {[s[1] for s in agg[(r['cfg'],r['layer'],r['dir'])]]}")
