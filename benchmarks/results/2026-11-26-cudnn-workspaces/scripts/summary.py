"""Per-call error statistics (memcalc's model vs the proposed rule, since adopted as memcalc's
memcalc.targets.cuda.cudnn.conv_workspace_bytes) and table.csv."""
import csv, statistics, collections
import rules
from evaluate import rows, cview, DT, FIT
MiB = 2**20
recs = []
for r in rows:
    if r['step'] != 1: continue            # one step per config (eval has one)
    x, w, y = cview(r)
    real = r['ws'][0] if r['ws'] else 0
    args = (x, w, y, DT[r['dtype']], tuple(r['stride']), r['dir'])
    recs.append(dict(cfg=r['cfg'], layer=r['layer'], transposed=r['transposed'], C=x[1], K=w[0], k=f"{w[2]}x{w[3]}",
                     stride=r['stride'][0], HW_in=f"{x[2]}x{x[3]}", HW_out=f"{y[2]}x{y[3]}", N=x[0], dtype=r['dtype'],
                     dir=r['dir'], real=real, memcalc=rules.current(*args), rule=rules.final(*args),
                     set='fit' if r['cfg'] in FIT else 'test'))
with open('/tmp/cudnn_work/table.csv', 'w', newline='') as f:
    wr = csv.DictWriter(f, fieldnames=list(recs[0])); wr.writeheader()
    seen = set()
    for d in recs:
        key = tuple(v for k2, v in d.items() if k2 != 'layer')
        if key in seen: continue
        seen.add(key); wr.writerow(d)
def stats(sel, model):
    errs = [abs(d[model] - d['real']) for d in sel]
    errs.sort()
    within = sum(e <= MiB or e <= 0.05 * d['real'] for e, d in zip([abs(d[model] - d['real']) for d in sel], sel))
    tot_r = sum(d['real'] for d in sel); tot_m = sum(d[model] for d in sel)
    return (f"n={len(sel):3d} median|err| {statistics.median(errs)/MiB:6.2f} MiB  p90 {errs[int(0.9*(len(errs)-1))]/MiB:6.2f}  max {errs[-1]/MiB:7.2f}  "
            f"within(1MiB or 5%) {within/len(sel):5.1%}  sum real {tot_r/MiB:8.1f} sum model {tot_m/MiB:8.1f} ({(tot_m-tot_r)/max(tot_r,1):+.1%})")
for group in ('fit', 'test'):
    for direction in ('forward', 'backward_data', 'backward_filter', None):
        sel = [d for d in recs if d['set'] == group and (direction is None or d['dir'] == direction)]
        for model in ('memcalc', 'rule'):
            print(f"{group:4s} {direction or 'all':15s} {model:7s} {stats(sel, model)}")
    print()
