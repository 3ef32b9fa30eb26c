import sys, io, contextlib, re
sys.path.insert(0, '/work/main'); sys.path.insert(0, '/tmp/cudnn_work')
import memcalc.targets.cuda.workspaces as W
from memcalc.cli import main
import oracle
from memcalc.targets.cuda.cudnn import conv_workspace_bytes as rule
from compare_all import CFGS, COMMON, run
def make(pred):
    def fn(x, w, y, dtype, stride, padding, dilation, groups, direction, cc, **kw):
        if pred(x, w, y, direction):
            return oracle.conv_workspace_bytes(x, w, y, dtype, stride, padding, dilation, groups, direction, cc)
        return rule(x, w, y, dtype, stride, padding, dilation, groups, direction, cc)
    return fn
preds = {
 'oracle-stem': lambda x, w, y, d: w[1] < 8,
 'oracle-wgrad': lambda x, w, y, d: d == 'backward_filter',
 'oracle-fwd': lambda x, w, y, d: d == 'forward',
 'oracle-dgrad': lambda x, w, y, d: d == 'backward_data',
 'oracle-1x1': lambda x, w, y, d: w[2] * w[3] == 1,
}
for cfg in sys.argv[1:]:
    for name, p in preds.items():
        out = run(cfg, make(p))
        lines = [l for l in out.splitlines() if l.startswith('peak ')]
        print(f'{cfg:20s} {name:14s} ' + ' | '.join(re.sub(r'\s+', ' ', l) for l in lines), flush=True)
