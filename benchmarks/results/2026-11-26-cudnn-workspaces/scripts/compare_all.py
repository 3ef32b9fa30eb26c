"""memcalc compare on every CNN snapshot with memcalc's conv workspace model, the proposed rule (since
adopted: it is memcalc's own, memcalc.targets.cuda.cudnn) and the oracle (monkeypatched into
memcalc.targets.cuda.workspaces; nothing under /work/main is edited)."""
import sys, io, contextlib, re
sys.path.insert(0, '/work/main'); sys.path.insert(0, '/tmp/cudnn_work')
import memcalc.targets.cuda.workspaces as W
import rules
from memcalc.cli import main
from memcalc.targets.cuda.cudnn import conv_workspace_bytes as rule_fn
import oracle
ORIG = W.conv_workspace_bytes
COMMON = ['--gpu', 'h100-80gb', '--torch-version', '2.11', '--cuda-version', '13.0']
CFGS = {
    'resnet18-b1-sgd': ['torch:resnet18', '--batch', '1', '--optim', 'sgd'],
    'resnet18-b64-sgd': ['torch:resnet18', '--batch', '64', '--optim', 'sgd'],
    'resnet50-b32-sgd': ['torch:resnet50', '--batch', '32', '--optim', 'sgd'],
    'resnet50-b64-eval': ['torch:resnet50', '--batch', '64', '--mode', 'eval', '--optim', 'none'],
    'resnet50-b64-sgd-momentum-amp-fp16': ['torch:resnet50', '--batch', '64', '--optim', 'sgd-momentum', '--precision', 'amp-fp16'],
    'vgg16-b16-sgd': ['torch:vgg16', '--batch', '16', '--optim', 'sgd'],
    'unet-b2-sgd': ['torch:unet', '--batch', '2', '--optim', 'sgd'],
}
def run(cfg, fn):
    W.conv_workspace_bytes = fn
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            main(['compare', f'/tmp/cudnn_work/{cfg}.pickle'] + CFGS[cfg] + COMMON, standalone_mode=False)
        except SystemExit:
            pass
    return buf.getvalue()
if __name__ == "__main__":
  for cfg in (sys.argv[1:] or CFGS):
      for name, fn in (("memcalc", ORIG), ("rule", rule_fn), ("oracle", oracle.conv_workspace_bytes)):
          out = run(cfg, fn)
          open(f'/tmp/cudnn_work/compare_{cfg}_{name}.txt', 'w').write(out)
          lines = [l for l in out.splitlines() if l.startswith('peak ')]
          print(f'{cfg:36s} {name:8s} ' + ' | '.join(re.sub(r'\s+', ' ', l) for l in lines), flush=True)
