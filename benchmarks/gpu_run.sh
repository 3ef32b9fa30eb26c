#!/usr/bin/env bash
# The GPU checks one session runs when it has a CUDA machine, writing raw output to a folder:
#   bash benchmarks/gpu_run.sh OUTDIR
# 1. the environment (GPU, driver, torch/CUDA/cuDNN, transformers, peft);
# 2. benchmarks/accuracy.py --suite gpu: every config's estimate and measured bytes (.jsonl/.json/.md);
# 3. issue 22's crash: grouped-query-attention LLMs estimated on the installed torch (2.11 crashed
#    in the FLOP recorder), one of them measured;
# 4. the quick test suite on the installed torch and transformers (pytest-xdist when present);
#    GPU_RUN_TESTS=0 leaves it out, for a session whose device time fits the two scripts only.
# Then, as a second call (each call of the device tool is limited to 10 minutes):
#   bash benchmarks/gpu_snapshots.sh OUTDIR
# and issue 34's compiled, selective and Float8 steps (a third call; torchao carried as a wheel):
#   bash benchmarks/gpu_issue34.sh OUTDIR
# Runs from the repository root, without installing memcalc (PYTHONPATH).
set -uo pipefail
out=${1:?usage: gpu_run.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import platform, torch, transformers, peft; print('python', platform.python_version(), '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| cuDNN', torch.backends.cudnn.version(), '| transformers', transformers.__version__, '| peft', peft.__version__)"
  git rev-parse --short HEAD 2>/dev/null || true
} 2>&1 | tee "$out/env.txt"

echo "== accuracy suite (gpu)"
timeout 300 python3 benchmarks/accuracy.py --suite gpu --out "$out" 2>&1 | tee "$out/accuracy.log" | grep -E "^\[|wrote|configs:|Error|error" | tail -70

echo "== grouped-query attention LLMs on the installed torch"
for model in llama-3-8b mistral-7b qwen2.5-7b; do
  timeout 45 python3 -m memcalc "$model" --seq-len 1024 --mode inference --precision bf16 --optim none --batch 1 \
    --device auto --depth 0 --time 2>&1 | grep -E "^(memcalc|assumed|peak allocated|error|note: FLOPs)|step time" | head -6
done 2>&1 | tee "$out/gqa.txt"
timeout 90 python3 -m memcalc llama-3-8b --seq-len 1024 --mode inference --precision bf16 --optim none --batch 1 \
  --depth 0 --measure 2>&1 | tail -12 | tee -a "$out/gqa.txt"

if [ "${GPU_RUN_TESTS:-1}" = 0 ]; then echo "== quick test suite: left out (GPU_RUN_TESTS=0)"; exit 0; fi
echo "== quick test suite"
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 16")
timeout 150 python3 -m pytest -q -m "not slow" -p no:cacheprovider $xdist -rf > "$out/pytest-quick.txt" 2>&1
tail -40 "$out/pytest-quick.txt"
