"""memcalc compare with the oracle for one class of conv call at a time (kernel size, stride, direction)
and memcalc's rule for the rest: which class carries the reserved gap. Run as oracle_now.py."""
import sys
sys.path.insert(0, '/tmp/cudnn_work')
import oracle
from oracle_now import CFGS, ORIG, run
def cls(x, w, stride, direction):
    one = w[2] * (w[3] if len(w) > 3 else 1) == 1
    strided = any(s > 1 for s in stride)
    k = ('1x1' if one else 'kxk') + ('s2' if strided else 's1')
    return f'{k}-{direction}'
CLASSES = ['1x1s1-backward_filter', '1x1s2-backward_filter', '1x1s2-forward', '1x1s2-backward_data', 'kxks1-forward', 'kxks2-forward', 'kxks1-backward_filter', 'kxks2-backward_filter', 'kxks1-backward_data', 'kxks2-backward_data']
def make(target):
    def fn(x, w, y, dtype, stride, padding, dilation, groups, direction, cc, **kw):
        d = direction.value if hasattr(direction, 'value') else direction
        if cls(x, w, stride, d) == target:
            return oracle.conv_workspace_bytes(x, w, y, dtype, stride, padding, dilation, groups, d, cc, **kw)
        return ORIG(x, w, y, dtype, stride, padding, dilation, groups, direction, cc, **kw)
    return fn
for cfg in ('resnet50-b32-sgd', 'vgg16-b16-sgd', 'resnet18-b64-sgd'):
    for target in CLASSES:
        print(f'{cfg:20s} oracle for {target:24s} ' + ' | '.join(l for l in run(cfg, make(target)) if l.startswith('peak reserved')), flush=True)
