"""memcalc compare on four CNN snapshots with memcalc's conv rule (memcalc.targets.cuda.cudnn) and with the
oracle (the real workspace of each call shape, oracle.py), after the allocator model's driver placement
(VA_GRANULARITY). Run from /tmp/cudnn_work after extract.py, as the other scripts."""
import sys, io, contextlib, re
sys.path.insert(0, '/tmp/cudnn_work')
import memcalc.targets.cuda.cudnn as C
import oracle
from memcalc.cli import main
ORIG = C.conv_workspace_bytes
COMMON = ['--gpu', 'h100-80gb', '--torch-version', '2.11']
CFGS = {
    'resnet18-b64-sgd': ['torch:resnet18', '--batch', '64', '--optim', 'sgd'],
    'resnet50-b32-sgd': ['torch:resnet50', '--batch', '32', '--optim', 'sgd'],
    'vgg16-b16-sgd': ['torch:vgg16', '--batch', '16', '--optim', 'sgd'],
    'resnet50-b64-sgd-momentum-amp-fp16': ['torch:resnet50', '--batch', '64', '--optim', 'sgd-momentum', '--precision', 'amp-fp16'],
}
def oracle_fn(x, w, y, dtype, stride, padding, dilation, groups, direction, cc, **kw):
    return oracle.conv_workspace_bytes(x, w, y, dtype, stride, padding, dilation, groups, direction, cc, **kw)
def run(cfg, fn):
    """memcalc compare on one snapshot with ``fn`` as the conv rule: its two 'peak' lines."""
    C.conv_workspace_bytes = fn
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            main(['compare', f'/tmp/cudnn_work/{cfg}.pickle'] + CFGS[cfg] + COMMON, standalone_mode=False)
        except SystemExit:
            pass
    return [re.sub(r'\s+', ' ', l) for l in buf.getvalue().splitlines() if l.startswith('peak ')]
if __name__ == "__main__":
    for cfg in CFGS:
        for name, fn in (("memcalc", ORIG), ("oracle", oracle_fn)):
            print(f'{cfg:36s} {name:8s} ' + ' | '.join(run(cfg, fn)), 'misses', len(oracle.MISSES), flush=True)
