#!/usr/bin/env bash
# Issue 34's GPU checks, for a session that has a CUDA machine: compiled steps, selective
# checkpointing and Float8 estimated and measured on the same GPU (`--device auto --measure`:
# the real step, torch.cuda.max_memory_allocated), raw output to a folder:
#   bash benchmarks/gpu_issue34.sh OUTDIR
# Float8 needs torchao, which the device image lacks: carry its wheel (device README, ".whl"):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl torchao==0.18.0
# and start the device command with the README's `pip install --target /tmp/site .whl/*.whl` line.
# Without torchao the Float8 rows print torchao's import error and the rest still runs.
# Each row is bounded (timeout) so the whole script fits one 10-minute device call; it runs from
# the repository root without installing memcalc (PYTHONPATH).
set -uo pipefail
out=${1:?usage: gpu_issue34.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import platform, torch; print('python', platform.python_version(), '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| cuDNN', torch.backends.cudnn.version())"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  git rev-parse --short HEAD 2>/dev/null || true
} 2>&1 | tee "$out/env.txt"

row() {  # row SECONDS NAME memcalc-arguments...: one estimate and its real step
  local limit=$1 name=$2; shift 2
  echo "== $name: memcalc $*"
  timeout "$limit" python3 -m memcalc "$@" --device auto --measure --depth 0 > "$out/$name.txt" 2>&1
  echo "exit $?" >> "$out/$name.txt"
  grep -E "^(peak allocated:|measured on|note: (compile|torch.compile|float8|Float8)|error)|Error|^exit" "$out/$name.txt" | head -8
}

gpt2=(gpt2 --batch 4 --seq-len 512 --precision amp-bf16 --optim adamw)
row 60  gpt2-eager                 "${gpt2[@]}"
row 60  gpt2-selective-op          "${gpt2[@]}" --checkpoint selective-op
row 60  gpt2-every-2               "${gpt2[@]}" --checkpoint every:2
row 150 gpt2-compile               "${gpt2[@]}" --compile
row 150 gpt2-compile-selective-op  "${gpt2[@]}" --compile --checkpoint selective-op
llama=(llama-tiny --batch 2 --seq-len 256 --precision bf16 --optim sgd)
row 60  llama-tiny-bf16            "${llama[@]}"
row 120 llama-tiny-compile         "${llama[@]}" --compile
row 60  llama-tiny-float8-tensorwise "${llama[@]}" --float8 tensorwise
row 60  llama-tiny-float8-rowwise  "${llama[@]}" --float8 rowwise
cnn=(resnet18 --batch 32 --precision amp-bf16 --optim sgd)
row 60  resnet18-eager             "${cnn[@]}"
row 120 resnet18-compile           "${cnn[@]}" --compile
echo "raw output: $out"
