#!/usr/bin/env bash
# Issue 32's models measured on the local GPU: each `memcalc ... --measure --format json` (the
# estimate for this machine's GPU beside the real step's torch.cuda.max_memory_allocated), one
# line of JSON per config, a fresh process each:
#   bash benchmarks/gpu_hostile.sh OUTDIR
# The rebinding buffers (EMA, torch.cat-grown, RoPE cache rebuilt), and a
# transformers model's own StaticCache (--kv-cache, llama-tiny) beside memcalc's static cache for
# the plain-torch one (torch:llama-tiny).
set -uo pipefail
out=${1:?usage: gpu_hostile.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
F=tests/fixtures/rebinding_buffers.py
while read -r name args; do
  [ -z "$name" ] && continue
  timeout 60 python3 -m memcalc $args --depth 0 --measure --format json > "$out/$name.json" 2> "$out/$name.err" \
    || echo "$name: failed (see $name.err)"
  python3 - "$out/$name.json" "$name" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:  # the .err file says why
    print(f"{sys.argv[2]}: no JSON ({exc})"); sys.exit(0)
m = d.get("measured") or {}
print(f"{sys.argv[2]}: estimate {m.get('compared_with', 0):,} B, measured {m.get('peak_allocated', 0):,} B, "
      f"error {m.get('relative_error', float('nan')):+.2%} on {m.get('device')}")
PY
done <<CONFIGS
ema-adam $F:ema --batch 32 --input-shape 256 --optim adam
grown-adam $F:grown --batch 32 --input-shape 256 --optim adam
rope-adamw $F:rope --batch 16 --input-shape 128,64 --optim adamw
nested-ema-adam $F:nested_ema --batch 32 --input-shape 256 --optim adam
hf-llama-tiny-kv512-bf16 llama-tiny --batch 8 --seq-len 512 --mode inference --optim none --precision bf16 --kv-cache 512
torch-llama-tiny-kv512-bf16 torch:llama-tiny --batch 8 --seq-len 512 --mode inference --optim none --precision bf16 --kv-cache 512
CONFIGS
