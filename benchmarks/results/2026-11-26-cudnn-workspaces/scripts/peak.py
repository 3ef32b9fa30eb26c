import pickle, sys, re
s = pickle.load(open(sys.argv[1], 'rb'))
t = s['device_traces'][0]
# allocated at trace start = sum of active blocks in segments minus those allocated in trace... approximate: track relative
cur = 0; best = (0, None); live = {}
for i, e in enumerate(t):
    if e['action'] == 'alloc':
        cur += e['size']; live[e['addr']] = (e['size'], i)
        if cur > best[0]: best = (cur, i, dict(live))
    elif e['action'] == 'free_completed' and e['addr'] in live:
        cur -= live.pop(e['addr'])[0]
c, i, lv = best
e = t[i]
names = [re.sub(r'\(.*', '', f['name']) for f in e['frames']]
print('peak (relative to trace start)', c / 2**20, 'MiB at event', i, 'size', e['size'], [n for n in names if 'conv' in n.lower() or 'cudnn' in n.lower()][:3])
print([f"{f['filename'].split('/')[-1]}:{f['line']}" for f in e['frames'] if f['filename'].endswith('.py')][:4])
big = sorted(lv.values(), reverse=True)[:8]
print('largest live at peak:', [(round(sz / 2**20, 2), j) for sz, j in big])
