import json, sys, torch, rules
from evaluate import rows, cview, DT
fn = getattr(rules, sys.argv[1] if len(sys.argv) > 1 else 'proposed')
out = []
seen = set()
for r in rows:
    x, w, y = cview(r)
    key = (r['cfg'], x, w, y, tuple(r['stride']), r['dir'])
    if key in seen: continue
    seen.add(key)
    real = r['ws'][0] if r['ws'] else 0
    m = fn(x, w, y, DT[r['dtype']], tuple(r['stride']), r['dir'])
    out.append((m - real, r['cfg'], r['layer'], x, w[0], w[2], r['stride'][0], r['dir'], real, m))
out.sort(key=lambda t: -abs(t[0]))
for t in out[:int(sys.argv[2]) if len(sys.argv) > 2 else 30]:
    d, cfg, layer, x, k, ks, st, dr, real, m = t
    print(f"{d/2**20:+8.2f} MiB {cfg[:20]:20s} {layer[:24]:24s} x{list(x)} K{k} k{ks} s{st} {dr:15s} real {real/2**20:8.2f} model {m/2**20:8.2f}")
