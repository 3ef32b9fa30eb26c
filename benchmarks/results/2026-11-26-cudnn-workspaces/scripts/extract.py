"""Extract cuDNN convolution workspace allocations from torch.cuda.memory._snapshot() pickles and
attribute each to a conv layer of the zoo model.

Identification:
  * a *call* starts with the output allocation made inside at::native::cudnn_convolution,
    cudnn_convolution_transpose, cudnn_convolution_backward_input / _weight (or the transpose
    variants) — i.e. an alloc whose C++ frames contain one of those and NOT run_conv_plan;
  * a *workspace* is an alloc whose C++ frames contain at::native::run_conv_plan; the direction
    comes from the raw_cudnn_convolution_{forward,backward_input,backward_weight}_out frame;
    'try_configs' in the frames means the plan cache missed (first call of that shape).
  * a call with no workspace alloc used 0 bytes (the allocator records nothing for size 0).
"""
import pickle, re, sys, json, math, collections
sys.path.insert(0, '/work/main')
import torch
import models_zoo

def short(n): return re.sub(r'\(.*', '', n)

def calls_from_trace(path):
    s = pickle.load(open(path, 'rb'))
    t = s['device_traces'][0]
    calls = []; others = collections.Counter(); ws_live = {}
    for i, e in enumerate(t):
        a = e['action']
        if a == 'alloc':
            names = [short(f['name']) for f in e['frames']]
            if any(n == 'at::native::run_conv_plan' for n in names):
                raw = [n for n in names if n.startswith('at::native::raw_cudnn_convolution')]
                d = raw[0].split('raw_cudnn_convolution_')[1].replace('_out', '')
                d = {'forward': 'forward', 'backward_input': 'backward_data', 'backward_weight': 'backward_filter'}[d]
                tried = any('try_configs' in n or 'try_plans' in n for n in names)
                ws = dict(size=e['size'], dir=d, tried=tried, idx=i)
                calls[-1]['ws'].append(ws)
                ws_live[e['addr']] = ws
                continue
            ops = [n for n in names if re.fullmatch(r'at::native::cudnn_convolution\w*', n)]
            if ops:
                pri = ['at::native::cudnn_convolution_transpose_backward_input', 'at::native::cudnn_convolution_transpose_backward_weight',
                       'at::native::cudnn_convolution_transpose']
                op = next((p for p in pri if p in ops), ops[0]).split('::')[-1]
                calls.append(dict(op=op, out=e['size'], ws=[], idx=i,
                                  py=[f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in e['frames'] if f['filename'].endswith('.py')][:6]))
                continue
            cud = [n for n in names if 'cudnn' in n.lower()]
            if cud:
                others[short(cud[0])] += 1
        elif a == 'free_requested' and e['addr'] in ws_live:
            ws_live.pop(e['addr'])['freed'] = i
    return calls, others

def conv_layers(model_name, batch, shape=None, dtype=torch.float32):
    entry = models_zoo.get(model_name)
    with torch.device('meta'):
        m = entry.build(shape)
        x = torch.empty((batch,) + tuple(shape or entry.default_shape))
    layers = []
    def hook(mod, inp, out):
        layers.append(dict(name=mod._name, transposed=isinstance(mod, torch.nn.ConvTranspose2d),
                           x=tuple(inp[0].shape), w=tuple(mod.weight.shape), y=tuple(out.shape),
                           stride=mod.stride, padding=mod.padding, dilation=mod.dilation, groups=mod.groups,
                           k=mod.kernel_size))
    for n, mod in m.named_modules():
        if isinstance(mod, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
            mod._name = n; mod.register_forward_hook(hook)
    with torch.no_grad():
        m(x)
    for i, L in enumerate(layers):
        L['i'] = i
    return layers

def nbytes(shape, es): return math.prod(shape) * es

def attribute(calls, layers, es):
    """-> list of rows: (layer, direction, op, ws list)"""
    rows = []
    # split into phases: runs of calls with Python frames (forward) / without (autograd thread)
    phases = []
    for c in calls:
        kind = 'fwd' if c['py'] else 'bwd'
        if not phases or phases[-1][0] != kind:
            phases.append((kind, []))
        phases[-1][1].append(c)
    step = 0
    for kind, cs in phases:
        if kind == 'fwd':
            step += 1
            sub = attribute_fwd(cs, layers, es)
        else:
            sub = attribute_bwd(cs, layers, es)
        for r in sub: r['step'] = step
        rows += sub
    for r in rows:
        for w in r['call']['ws']:
            assert w['dir'] == r['call_dir'], (r['layer']['name'], w, r['call_dir'], r['call']['op'])
    return rows

def attribute_fwd(fwd, layers, es):
    rows = []
    assert len(fwd) == len(layers), (len(fwd), len(layers))
    for c, L in zip(fwd, layers):
        assert c['out'] == nbytes(L['y'], es), (c, L)
        d = 'backward_data' if L['transposed'] else 'forward'
        rows.append(dict(layer=L, call_dir=d, phase='fwd', call=c))
    return rows

def attribute_bwd(bwd, layers, es):
    rows = []
    # backward: group input+weight pairs
    used_in = set(); used_w = set()
    j = 0
    while j < len(bwd):
        c = bwd[j]
        if c['op'].endswith('backward_input'):
            nxt = bwd[j+1] if j+1 < len(bwd) and bwd[j+1]['op'].endswith('backward_weight') else None
            cand = [L for L in reversed(layers) if L['i'] not in used_in and nbytes(L['x'], es) == c['out']
                    and (nxt is None or (L['i'] not in used_w and nbytes(L['w'], es) == nxt['out']))]
            L = cand[0]; used_in.add(L['i'])
            rows.append(dict(layer=L, call_dir='forward' if L['transposed'] else 'backward_data', phase='bwd', call=c))
            if nxt:
                used_w.add(L['i']); rows.append(dict(layer=L, call_dir='backward_filter', phase='bwd', call=nxt)); j += 1
        else:
            cand = [L for L in reversed(layers) if L['i'] not in used_w and nbytes(L['w'], es) == c['out']]
            L = cand[0]; used_w.add(L['i'])
            rows.append(dict(layer=L, call_dir='backward_filter', phase='bwd', call=c))
        j += 1
    return rows

CONFIGS = {
    'resnet18-b1-sgd': ('resnet18', 1, None, torch.float32),
    'resnet18-b64-sgd': ('resnet18', 64, None, torch.float32),
    'resnet50-b32-sgd': ('resnet50', 32, None, torch.float32),
    'resnet50-b64-eval': ('resnet50', 64, None, torch.float32),
    'resnet50-b64-sgd-momentum-amp-fp16': ('resnet50', 64, None, torch.float16),
    'vgg16-b16-sgd': ('vgg16', 16, None, torch.float32),
    'unet-b2-sgd': ('unet', 2, None, torch.float32),
}

def all_rows():
    out = []
    for cfg, (model, b, shape, dt) in CONFIGS.items():
        calls, others = calls_from_trace(f'/tmp/cudnn_work/{cfg}.pickle')
        layers = conv_layers(model, b, shape, dt)
        es = torch.tensor([], dtype=dt).element_size()
        rows = attribute(calls, layers, es)
        for r in rows:
            L = r['layer']; c = r['call']
            out.append(dict(cfg=cfg, model=model, batch=b, dtype=str(dt).split('.')[-1], layer=L['name'], li=L['i'],
                            transposed=L['transposed'], x=L['x'], w=L['w'], y=L['y'], stride=L['stride'],
                            padding=L['padding'], dilation=L['dilation'], groups=L['groups'], k=L['k'],
                            dir=r['call_dir'], phase=r['phase'], step=r['step'], op=c['op'],
                            ws=[w['size'] for w in c['ws']], tried=[w['tried'] for w in c['ws']],
                            freed_ok=all('freed' in w for w in c['ws'])))
        print(cfg, 'calls', len(calls), 'layers', len(layers), 'other cudnn allocs', dict(others), file=sys.stderr)
    return out

if __name__ == '__main__':
    rows = all_rows()
    json.dump(rows, open('/tmp/cudnn_work/ws_rows.json', 'w'), indent=0)
    print(len(rows), 'rows; multi-ws calls:', sum(len(r['ws']) > 1 for r in rows))
