"""What several test files share: a small Hugging Face Llama config written where an ``hf:``
source can read it, DistributedDataParallel over the fake process group (the fixture is
``fake_process_group`` in tests/conftest.py), and ``benchmarks/replay_suite.py`` loaded as a
module. pytest puts tests/ on the path: ``from support import ...``."""

import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from memcalc.targets.cpu.kernels import CpuCapabilities
from memcalc.targets.cpu.onednn import ONEDNN_BF16_MATMUL_ISA

#: A small Llama (grouped-query attention): no network, a few MB; PEFT's default LoRA targets
#: (q_proj, v_proj) give it 3,584 trainable parameters at r=8.
SMALL_LLAMA: dict[str, object] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    "max_position_embeddings": 256, "tie_word_embeddings": False}
#: The world size of the fake process group.
FAKE_WORLD = 4

#: This CPU's kernels as memcalc's CPU target reads them (oneDNN's bf16 matmul and its ISA).
CPU_HERE = CpuCapabilities.here()
#: Real bf16 CPU comparisons hold where memcalc follows the bf16 matmul: ATen's own GEMM (no
#: AVX512-BF16, as on the AVX2 machines) or oneDNN's avx512_core_bf16 scratchpad. AMX's brgemm
#: buffers are not modelled (memcalc's report says so in a note).
bf16_followed = pytest.mark.skipif(
    CPU_HERE.onednn_bf16 and CPU_HERE.onednn_bf16_isa != ONEDNN_BF16_MATMUL_ISA,
    reason=f"oneDNN's bf16 matmul runs {CPU_HERE.onednn_bf16_isa or 'another implementation'} here")


def skip_module_without(*packages: str) -> None:
    """Skip the calling test module where one of ``packages`` is not installed, as a module-level
    ``pytest.importorskip`` would, without importing them: the import is the test's, when it runs.
    Collection imports every test module in each xdist worker, and PEFT with bitsandbytes costs
    about 2 CPU-s there, for a worker that may run none of the tests needing it (issue 36 item 7)."""
    caller = Path(sys._getframe(1).f_code.co_filename).name  # the skip report names this line, not the module
    for name in packages:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{caller}: could not import {name!r}: No module named {name!r}", allow_module_level=True)


@functools.cache
def replay_suite() -> ModuleType:
    """benchmarks/replay_suite.py, loaded by its path (benchmarks/ is not a package)."""
    path = Path(__file__).parent.parent / "benchmarks" / "replay_suite.py"
    spec = importlib.util.spec_from_file_location("replay_suite", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while it is defined
    spec.loader.exec_module(module)
    return module


def hf_config_source(tmp_path: Path, config: dict[str, object] | None = None) -> str:
    """``config`` (default :data:`SMALL_LLAMA`) written as ``tmp_path/config.json``; returns the
    ``hf:`` source that reads it."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL_LLAMA if config is None else config))
    return f"hf:{path}"


def fake_ddp(model: nn.Module, **ddp_options: Any) -> nn.Module:
    """``DistributedDataParallel(model, **ddp_options)`` whose all-reduce hands each bucket back
    as it is: the fake process group's all-reduce returns no tensor."""
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_options)

    # no postponed annotations in this module: DDP checks that ``bucket`` is annotated as a GradBucket
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, hook)
    return ddp


#: Source of ``peak_rss()`` for a child process's script: the child's own peak resident set, in
#: bytes. Linux keeps ``getrusage(RUSAGE_SELF).ru_maxrss`` across fork and exec, so a child of a
#: large pytest process reports at least the parent's resident set at the fork (2.1 GiB in a full
#: suite run); ``VmHWM`` in /proc/self/status is the high-water mark of the child's own address
#: space, which exec starts afresh. Elsewhere (macOS: no /proc) ru_maxrss, in bytes there.
PEAK_RSS = '''
def peak_rss():
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource, sys
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024
'''
