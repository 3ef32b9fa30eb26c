import json, math, collections, sys, torch
import rules
rows = json.load(open('/tmp/cudnn_work/ws_rows.json'))
DT = {'float32': torch.float32, 'float16': torch.float16}
def cview(r):
    x, w, y = r['x'], r['w'], r['y']
    if r['transposed']: x, y = y, x
    return tuple(x), tuple(w), tuple(y)
FIT = {'resnet18-b64-sgd', 'resnet50-b32-sgd', 'vgg16-b16-sgd'}
MiB = 2**20
def evaluate(fn, only_step=1, verbose=False):
    per_cfg = collections.defaultdict(lambda: dict(real=0, model=0, abserr=0, n=0, maxreal=0, maxmodel=0, within10=0, within1mib=0))
    for r in rows:
        if r['step'] != only_step and not (r['cfg'] == 'resnet50-b64-eval'):
            continue
        x, w, y = cview(r)
        real = r['ws'][0] if r['ws'] else 0
        m = fn(x, w, y, DT[r['dtype']], tuple(r['stride']), r['dir'])
        d = per_cfg[r['cfg']]
        d['real'] += real; d['model'] += m; d['abserr'] += abs(m - real); d['n'] += 1
        d['maxreal'] = max(d['maxreal'], real); d['maxmodel'] = max(d['maxmodel'], m)
        d['within10'] += abs(m - real) <= 0.10 * max(real, 1) or abs(m - real) < 65536
        d['within1mib'] += abs(m - real) <= MiB
    tot = dict(real=0, model=0, abserr=0, n=0, within10=0, within1mib=0)
    print(f"{'config':36s} {'calls':>5s} {'sum real MiB':>12s} {'sum model':>10s} {'sum|err|':>9s} {'max real':>9s} {'max model':>9s} {'<=10%':>6s} {'<=1MiB':>6s}")
    for cfg, d in per_cfg.items():
        tag = 'fit ' if cfg in FIT else 'test'
        print(f"{tag} {cfg:31s} {d['n']:5d} {d['real']/MiB:12.1f} {d['model']/MiB:10.1f} {d['abserr']/MiB:9.1f} {d['maxreal']/MiB:9.1f} {d['maxmodel']/MiB:9.1f} {d['within10']:6d} {d['within1mib']:6d}")
        for k in tot: tot[k] += d[k]
    print(f"{'TOTAL':36s} {tot['n']:5d} {tot['real']/MiB:12.1f} {tot['model']/MiB:10.1f} {tot['abserr']/MiB:9.1f} {'':9s} {'':9s} {tot['within10']:6d} {tot['within1mib']:6d}")
if __name__ == '__main__':
    for name in sys.argv[1:] or ['current', 'simple', 'proposed_nosplit', 'proposed']:
        print('==', name); evaluate(getattr(rules, name)); print()
