import json, itertools, math, collections
rows=json.load(open('ws_rows.json'))
ES={'float32':4,'float16':2}
def cview(r):
    x,w,y=r['x'],r['w'],r['y']
    if r['transposed']: x,y=y,x
    return x,w,y
def parts(r):
    x,w,y=cview(r); e=ES[r['dtype']]
    return {'x':math.prod(x)*e,'w':math.prod(w)*e,'y':math.prod(y)*e}
seen=set(); out=[]
for r in rows:
    x,w,y=cview(r)
    key=(r['cfg'],tuple(x),tuple(w),tuple(y),tuple(r['stride']),r['dir'])
    if key in seen: continue
    seen.add(key)
    ws=r['ws'][0] if r['ws'] else 0
    p=parts(r)
    best=None
    for n in range(4):
        for sub in itertools.combinations('xwy',n):
            s=sum(p[k] for k in sub)
            res=ws-s
            if res>=0 and (best is None or res<best[1]): best=(''.join(sub),res)
    sub,res=best
    MiB=1<<20
    out.append((r['cfg'][:14],r['layer'][:24],'T' if r['transposed'] else ' ',x[1],w[0],w[2],r['stride'][0],x[2],y[2],x[0],r['dtype'][:4],r['dir'],ws,sub,res))
    print(f"{r['cfg'][:14]:14s} {r['layer'][:24]:24s} {'T' if r['transposed'] else ' '} C{x[1]:>4} K{w[0]:>4} k{w[2]} s{r['stride'][0]} HW{x[2]:>3}->{y[2]:>3} N{x[0]:>3} {r['dtype'][:4]} {r['dir'][:12]:12s} real {ws:>11,} = {sub:3s} + {res:>10,} ({res/MiB:8.3f} MiB; w={p['w']:,}, res/w={res/p['w']:.3f})")
json.dump(out,open('decomp.json','w'))
