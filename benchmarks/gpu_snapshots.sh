#!/usr/bin/env bash
# Real snapshots of memcalc's step on the local GPU, a fresh process each (memcalc --measure-snapshot),
# for memcalc compare and tests/test_gpu_snapshots.py: the configs whose peak reserved the CPU
# replay of the 2026-11-25 H100 data cannot close (the snapshot tests' strict xfails, measured in a
# process a warm-up had left workspaces in; EfficientNet-B0's -7% and ResNet-50's -4%, the cuDNN
# workspaces of a few shapes):
#   bash benchmarks/gpu_snapshots.sh OUTDIR
# Writes OUTDIR/snapshots/NAME.pickle.xz (the allocator history of the step alone), NAME.json
# (memcalc's estimate with the measurement, --format json) and NAME.err. About 15 s a config on
# an H100; each is cut at 60 s.
set -uo pipefail
out=${1:?usage: gpu_snapshots.sh OUTDIR}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== real snapshots, a fresh process each"
mkdir -p "$out/snapshots"
while read -r name args; do
  timeout 60 python3 -m memcalc $args --depth 0 --format json --force --measure-snapshot "$out/snapshots/$name.pickle" \
    > "$out/snapshots/$name.json" 2> "$out/snapshots/$name.err" || echo "$name: failed (see $name.err)"
  xz -T0 -f "$out/snapshots/$name.pickle" 2>/dev/null
done <<'CONFIGS'
efficientnet_b0-b32-sgd efficientnet_b0 --batch 32 --optim sgd
resnet50-b128-adam resnet50 --batch 128 --optim adam
gpt2-b8-s1024-adamw-amp-bf16 torch:gpt2 --batch 8 --seq-len 1024 --optim adamw --precision amp-bf16
llama-tiny-b8-s512-adamw-amp-bf16-ckpt torch:llama-tiny --batch 8 --seq-len 512 --optim adamw --precision amp-bf16 --checkpoint
llama-tiny-b8-s512-inference-bf16 torch:llama-tiny --batch 8 --seq-len 512 --mode inference --optim none --precision bf16
gpt2-b8-s1024-eval torch:gpt2 --batch 8 --seq-len 1024 --mode eval --optim none
CONFIGS
ls -la "$out/snapshots"

