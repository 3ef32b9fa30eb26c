"""Multi-GPU strategies (issue 6): per-rank numbers worked out by hand, ZeRO model states
against DeepSpeed's published formulas, the orderings between strategies, real FSDP2 and DDP
on the CPU (a fake process group: the collectives move nothing, every buffer is allocated
for real and recorded by the profiler), bad input, the JSON contract and the CLI.

No CUDA GPU was available where these tests were written: every number below is the
simulation's or a CPU run's; nothing here has been checked against NCCL on real GPUs.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from support import fake_ddp
from torch import nn

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Phase
from memcalc.core.errors import InvalidInputError
from memcalc.distributed import deepspeed_formulas as ds
from memcalc.distributed.ddp import DdpProgram
from memcalc.distributed.fsdp import ShardedProgram, fsdp_units, module_units
from memcalc.distributed.setting import Distributed, dp_chunks

MiB = 2**20
# two_layers: two 1024×1024 weights without bias: Ψ = 2,097,152 parameters, each weight
# 4 MiB in fp32 (8 MiB in all); batch 1 of 1024 features; loss = output.mean().
PSI = 2 * 1024 * 1024
WEIGHT = 4 * MiB
INPUT = 1024 * 4  # one sample, fp32


def two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))


_DISTRIBUTED = ("world_size", "device_ids", "batch_is_global", "bucket_cap_mb", "gradient_as_bucket_view", "sharding",
                "reduce_bucket_size")


#: The real runs below step Adam(foreach=True); the estimates step the same implementation.
FOREACH = memcalc.Loop(optimizer_impl="foreach")


#: A Python float wrapped as a CPU tensor (8 B) and cast to float32 (4 B) while foreach Adam's
#: _foreach_div_ runs on the CPU (memcalc.targets.cpu.scalars).
WRAPPED = 8 + 4


def _two(strategy: str, **kw):
    # gpu="cpu": no cuBLAS workspace, so every byte below is the model's. The step is the one a
    # GPU runs, foreach (the CPU's own default is the for-loop), as in _real_peak below.
    kw.setdefault("optimizer", "adam")
    kw.setdefault("loop", FOREACH)
    dist = {k: kw.pop(k) for k in _DISTRIBUTED if k in kw}
    return memcalc.estimate(two_layers, input_shape=(1024,), batch_size=1, loss="mean", gpu="cpu",
                            distributed=memcalc.Distributed(strategy, **dist), **kw)


def _zero_bucket(strategy: str) -> dict:
    # a small reduce bucket, given only where it applies (other strategies refuse it)
    return {"reduce_bucket_size": 1024} if strategy.startswith("zero") else {}


def _only_role(report):
    assert len(report.roles) == 1
    return report.roles[0]


# ============================================================================================
# Hand-worked per-rank numbers (two_layers, Adam, fp32, 4 GPUs)
# ============================================================================================


def test_single_gpu_baseline_by_hand():
    # Peak in optimizer.step(): parameters 8 MiB + gradients 8 MiB + Adam's two moments
    # 16 MiB + foreach Adam's sqrt(exp_avg_sq) for all parameters 8 MiB + the input 4 KiB, while
    # _foreach_div_ divides them by a list of floats: the CPU wraps each (WRAPPED).
    r = _two("single")
    assert r.roles == () and r.strategy == "single"
    assert r.peak_requested == 8 * MiB + 8 * MiB + 16 * MiB + 8 * MiB + INPUT + WRAPPED == 41_947_148


def test_ddp_adds_one_copy_of_the_gradients_in_buckets():
    # DDP: the single-GPU step + the Reducer's buckets (8 MiB, one bucket under 25 MiB).
    r = _two("ddp", world_size=4)
    role = _only_role(r)
    assert role.name == "every rank" and role.ranks == (0, 1, 2, 3) and role.batch_size == 1
    assert r.peak_requested == 41_947_148 + 8 * MiB
    assert role.bytes.workspace == 8 * MiB + 8 * MiB + WRAPPED  # the Adam temporaries + the buckets
    assert role.communication == 8 * MiB
    assert role.model_states == 8 * MiB + 8 * MiB + 16 * MiB  # params + grads + Adam


def test_ddp_gradient_as_bucket_view_costs_nothing_extra():
    # The gradients are views into the buckets: the same bytes as one GPU, no collective buffer.
    r = _two("ddp", world_size=4, gradient_as_bucket_view=True)
    role = _only_role(r)
    assert r.peak_requested == 41_947_148
    assert role.communication == 0
    assert role.bytes.gradients == 8 * MiB


def test_dataparallel_output_device_by_hand():
    # Per-device batch 1 on 4 devices: the model sees a global batch of 4.
    # Output device, peak at the end of backward of the 2nd iteration (Adam state present):
    #   parameters 8 + Adam 16 + replica 0's gradients 8 + their flat copy 8 + the summed
    #   gradients 8 MiB (reduce_add_coalesced: one ≤10 MiB chunk) = 48 MiB
    #   + the input 4 KiB + gathered output 4·1024·4 = 16 KiB + the loss 4 B + its gradient 4 B.
    r = _two("dp", world_size=4)
    output, others = r.roles
    assert output.name == "output device (cuda:0)" and output.ranks == (0,)
    assert output.report.peak_requested == 48 * MiB + INPUT + 4 * 1024 * 4 + 4 + 4 == 50_352_136
    assert output.bytes.gradients == 16 * MiB and output.bytes.optimizer_state == 16 * MiB
    assert output.communication == 8 * MiB  # the flat copy of replica 0's gradients
    assert output.model_states == 8 * MiB + 8 * MiB + 16 * MiB
    # Other devices: replica parameters 8 + replica gradients 8 + their flat copy 8 MiB,
    # the input 4 KiB, the scalar standing for the output sent away 4 B (+ its gradient 4 B).
    assert others.name == "other devices" and others.ranks == (1, 2, 3)
    assert others.report.peak_requested == 24 * MiB + INPUT + 4 + 4 == 25_169_928
    assert others.bytes.optimizer_state == 0
    assert others.model_states == 16 * MiB
    assert r.bytes == output.bytes  # the report's own fields describe the busiest GPU


def test_fsdp_full_shard_by_hand(without_gloo_copies):
    # FSDP's own buffers (gloo's copies, which the CPU target adds: the test after next).
    # FULL_SHARD, units = the two Linear layers (+ an empty root). Per rank: shards 2 MiB,
    # Adam 4 MiB. Peak in the 2nd iteration's backward, at unit 1's reduce-scatter (unit 1
    # resharded, unit 0's all-gather prefetched, its copy-out not yet done):
    #   parameters: the shards 2 MiB
    #   gradients: unit 1's unsharded gradient 4 (freed once the reduce-scatter output exists)
    #              + that output, unit 1's sharded gradient, 1 MiB
    #   workspace: unit 0's prefetched all-gather output 4 + unit 1's reduce-scatter input 4 MiB
    #              + the activation gradient 4 KiB + 4 B
    #   optimizer state 4 MiB; input 4 KiB; activations 4 KiB + the loss 4 B.
    # (Unit 0's copy-out, next, reaches the same 19 MiB: shards 2 + unsharded 4 + all-gather
    # output 4 + reduce-scatter input 4 + sharded gradient 1 + Adam 4.)
    r = _two("fsdp", world_size=4)
    role = _only_role(r)
    b = role.bytes
    assert (b.parameters, b.gradients, b.optimizer_state) == (2 * MiB, 5 * MiB, 4 * MiB)
    assert b.workspace == 8 * MiB + INPUT + 4
    assert r.peak_requested == 19 * MiB + INPUT + (INPUT + 4) + (INPUT + 4) == 19_935_240
    assert role.communication == 4 * MiB * 2  # all-gather output + reduce-scatter input
    assert role.model_states == 16 * PSI // 4  # fp32 shards 4 + gradients 4 + Adam 8 bytes, over 4


def test_fsdp_shard_grad_op_keeps_parameters_gathered_until_backward(without_gloo_copies):
    # FSDP's own buffers, as above. SHARD_GRAD_OP: forward of the 2nd iteration gathers unit 1 (all-gather output 4 +
    # unsharded 4 MiB) while unit 0's output (4) and parameters (4) are still there:
    #   shards 2 + 16 MiB of gathered parameters and outputs + Adam 4 = 22 MiB (+ input,
    #   activations). FULL_SHARD peaks at 19 MiB.
    r = _two("fsdp", world_size=4, sharding="shard_grad_op")
    role = _only_role(r)
    assert r.peak_requested == 22 * MiB + INPUT + INPUT == 23_076_864
    assert r.peak_phase is Phase.FORWARD
    assert (role.bytes.parameters, role.bytes.workspace) == (2 * MiB + 8 * MiB, 8 * MiB)
    assert role.communication == 16 * MiB
    assert role.model_states == 16 * PSI // 4


def test_fsdp_on_the_cpu_target_adds_gloos_copies_by_hand():
    # The CPU target's process group is gloo's (tests/test_gloo_runs.py runs it), which
    # reduce-scatters by all-reducing a clone of the reduce-scatter input: the FULL_SHARD peak
    # worked out above (unit 1's reduce-scatter) + that clone, 4 MiB, which gloo divides in place
    # for FSDP2's ReduceOp.AVG: the group's size wrapped as a CPU tensor (8 B) and cast to
    # float32 (4 B) beside it. gloo's copy of an all-gather output (4 MiB) comes while less is
    # alive: the peak stays where it was.
    r = _two("fsdp", world_size=4)
    role = _only_role(r)
    divisor = 8 + 4
    assert r.peak_requested == 19_935_240 + 4 * MiB + divisor
    assert role.bytes.workspace == 8 * MiB + 4 * MiB + INPUT + 4 + divisor
    # all-gather output, reduce-scatter input, its clone (and its divisor)
    assert role.communication == 4 * MiB * 3 + divisor


@pytest.mark.parametrize("stage, peak, states", [
    # reduce bucket 2^20 elements in fp32 = 4 MiB (allocated for backward in stages 1-2,
    # for good in stage 3); Adam on the fp32 master partition 2 MiB: moments 4 MiB.
    #   zero1: params 8 + full gradients 8 + master 2 + Adam 4 + bucket 4 = 26 MiB
    #   zero2: params 8 + gradient partition 2 + unit 1's gradient before it is dropped 4
    #          + master 2 + Adam 4 + bucket 4 = 24 MiB
    #   zero3: the second step (DeepSpeed's coordinator has the module trace): the root's fetch
    #          prefetches both weights in one coalesced all-gather, an 8 MiB flat output; module 0's
    #          wait copies both weights out of it (8 MiB), and it is freed at module 1's wait.
    #          Module 0's forward: shards 2 + flat 8 + weights 8 + partition 2 + master 2 + Adam 4
    #          + bucket 4 = 30 MiB, with the input and module 0's output
    (1, 26 * MiB + INPUT + 2 * (INPUT + 4), 8 * MiB + 8 * MiB + 2 * MiB + 4 * MiB + 2 * MiB),
    (2, 24 * MiB + INPUT + 2 * (2 * INPUT + 4), 8 * MiB + 2 * MiB + 2 * MiB + 4 * MiB + 2 * MiB),
    (3, 30 * MiB + INPUT + INPUT, 2 * MiB + 2 * MiB + 2 * MiB + 4 * MiB + 2 * MiB),
])
def test_zero_stages_by_hand(stage, peak, states):
    # model states = parameters + gradients + master + Adam + the fp32 gradient partition
    # made for the step (the last 2 MiB in each line)
    r = _two(f"zero{stage}", world_size=4, reduce_bucket_size=2**20)
    role = _only_role(r)
    assert r.peak_requested == peak
    assert role.model_states == states


# ============================================================================================
# ZeRO model states against DeepSpeed's estimators
# ============================================================================================


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("precision", ["amp-fp16", "amp-bf16"])
def test_zero_model_states_match_deepspeed(world_size, precision):
    states = {s: _only_role(_two(s, world_size=world_size, precision=precision, reduce_bucket_size=1024)).model_states
              for s in ("zero1", "zero2", "zero3")}
    largest = 1024 * 1024  # DeepSpeed's largest_layer_params: one Linear
    # ZeRO-2: exactly estimate_zero2_model_states_mem_needs: 2Ψ + 18Ψ/N.
    assert states["zero2"] == ds.zero2_model_states(PSI, world_size).gpu_bytes == 2 * PSI + 18 * PSI // world_size
    # ZeRO-1: the paper's P_os (4Ψ + 12Ψ/N) + the fp32 gradient partition 4Ψ/N — DeepSpeed's
    # stage-2 estimator before PR #5099 (4Ψ + 16Ψ/N).
    assert states["zero1"] == ds.zero_paper_model_states(1, PSI, world_size) + 4 * PSI // world_size
    # ZeRO-3: estimate_zero3_model_states_mem_needs is 4·largest_layer + 18Ψ/N. memcalc's
    # model states exclude the gathered layer (a collective buffer, simulated separately)
    # and hold 2Ψ/N more: both the 16-bit gradient partition and its fp32 copy for the step.
    z3 = ds.zero3_model_states(PSI, largest, world_size)
    assert z3.largest_layer_bytes == 4 * largest
    assert states["zero3"] == z3.gpu_bytes - z3.largest_layer_bytes + 2 * PSI // world_size == 20 * PSI // world_size


def test_zero2_on_gpt2_matches_deepspeed_with_tied_weights_counted_once():
    # GPT-2 small: Ψ = 124,439,808 (lm_head shares wte), divisible by 2·8: no padding.
    r = memcalc.estimate("gpt2", seq_len=32, batch_size=1,
                         distributed=memcalc.Distributed("zero2", world_size=8, reduce_bucket_size=1024),
                         precision="amp-fp16")
    total, _largest = ds.model_to_params(_gpt2())
    assert total == 124_439_808
    assert _only_role(r).model_states == ds.zero2_model_states(total, 8).gpu_bytes


def test_zero3_on_gpt2_matches_deepspeed_up_to_per_parameter_padding():
    r = memcalc.estimate("gpt2", seq_len=32, batch_size=1,
                         distributed=memcalc.Distributed("zero3", world_size=8, reduce_bucket_size=1024),
                         precision="amp-fp16")
    model = _gpt2()
    total, largest = ds.model_to_params(model)
    assert largest == 50257 * 768  # wte
    z3 = ds.zero3_model_states(total, largest, 8)
    expected = z3.gpu_bytes - z3.largest_layer_bytes + 2 * total // 8
    # each parameter tensor's partition rounds up to whole elements: < 20 B per tensor
    tensors = len(list(model.parameters()))
    assert 0 <= _only_role(r).model_states - expected < 20 * tensors


def _gpt2() -> nn.Module:
    import models_zoo

    with torch.device("meta"):
        return models_zoo.get("gpt2").build((32,))


def test_deepspeed_formulas_by_hand():
    # 1e9 parameters on 8 GPUs of one node.
    z2 = ds.zero2_model_states(10**9, 8)
    assert z2.gpu_bytes == 2 * 10**9 + 18 * 10**9 // 8  # 4.25e9
    assert z2.cpu_bytes == int(10**9 * 4 * 8 * 1.5)
    offload = ds.zero2_model_states(10**9, 8, cpu_offload=True)
    assert offload.gpu_bytes == 2 * 10**9 and offload.cpu_bytes == int(10**9 * 32 * 1.5)
    z3 = ds.zero3_model_states(10**9, 10**7, 8)
    assert z3.gpu_bytes == 4 * 10**7 + 18 * 10**9 // 8
    assert ds.zero3_model_states(10**9, 10**7, 8, cpu_offload=True, cpu_offload_params=True).gpu_bytes == 4 * 10**7
    assert ds.zero3_model_states(10**9, 10**7, 8, cpu_offload=True).gpu_bytes == 4 * 10**7 + 2 * 10**9 // 8
    assert [ds.zero_paper_model_states(s, 8, 2) for s in range(4)] == [128, 80, 72, 64]
    with pytest.raises(ValueError):
        ds.zero2_model_states(10, 0)


# ============================================================================================
# Orderings
# ============================================================================================


@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("precision", ["fp32", "amp-fp16"])
def test_model_states_order_zero3_zero2_zero1_ddp(world_size, precision):
    states = {s: _only_role(memcalc.estimate("mlp", batch_size=4,
                                             distributed=memcalc.Distributed(s, world_size=world_size,
                                                                             **_zero_bucket(s)),
                                             precision=precision)).model_states
              for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")}
    # zero1 keeps fp32 parameters and gradients whole in fp32 (8Ψ + 16Ψ/N): at N = 2 it equals
    # DDP's 16Ψ, plus ZeRO's padding of the partition to 2N elements (16 B per padded element).
    padding = 16 * (2 * world_size - 1)
    assert states["zero3"] < states["zero2"] < states["zero1"] <= states["ddp"] + padding
    if precision != "fp32" or world_size > 2:
        assert states["zero1"] < states["ddp"]
    assert states["fsdp"] < states["ddp"]


def test_more_gpus_fewer_model_states_per_gpu():
    states = [_only_role(_two("fsdp", world_size=n)).model_states for n in (1, 2, 4, 8)]
    assert states == [16 * PSI // n for n in (1, 2, 4, 8)]


# ============================================================================================
# DataParallel: scatter, gather and the output device
# ============================================================================================


def test_dp_chunks_like_torch_chunk():
    assert dp_chunks(10, 4) == [3, 3, 3, 1] == [len(c) for c in torch.arange(10).chunk(4)]
    assert dp_chunks(8, 4) == [2, 2, 2, 2]
    assert dp_chunks(2, 4) == [1, 1]


def test_dp_global_batch_is_chunked_and_idle_devices_are_said():
    r = memcalc.estimate("mlp", batch_size=10,
                         distributed=memcalc.Distributed("dp", device_ids=[2, 5, 6, 7], batch_is_global=True))
    output, others = r.roles
    assert (output.name, output.ranks, output.batch_size) == ("output device (cuda:2)", (2,), 3)
    assert (others.ranks, others.batch_size) == ((5, 6, 7), 3)
    assert r.global_batch_size == 10 and r.world_size == 4
    small = memcalc.estimate("mlp", batch_size=2,
                             distributed=memcalc.Distributed("dp", world_size=4, batch_is_global=True))
    assert [role.ranks for role in small.roles] == [(0,), (1,)]
    assert any("cuda:2, cuda:3 get no chunk" in n for n in small.notes)


def test_dp_output_device_holds_the_gathered_logits():
    # GPT-2, 4 devices × 2 sequences of 32 tokens: device 0 gathers the logits of all
    # 8 sequences (8·32·50257·4 B) and computes the loss there; the others send theirs away.
    r = memcalc.estimate("gpt2", seq_len=32, batch_size=2, distributed=memcalc.Distributed("dp", world_size=4),
                         optimizer="sgd")
    output, others = r.roles
    gathered_logits = 8 * 32 * 50257 * 4
    assert output.peak_allocated - others.peak_allocated > gathered_logits
    assert output.bytes.optimizer_state == 0 and others.bytes.optimizer_state == 0  # SGD: no state
    assert r.busiest_role is output


# ============================================================================================
# DDP and FSDP details
# ============================================================================================


def test_ddp_batch_global_or_per_rank():
    per_rank = memcalc.estimate("mlp", batch_size=8, distributed=memcalc.Distributed("ddp", world_size=4))
    global_ = memcalc.estimate("mlp", batch_size=32,
                               distributed=memcalc.Distributed("ddp", world_size=4, batch_is_global=True))
    assert per_rank.batch_size == global_.batch_size == 8
    assert per_rank.global_batch_size == global_.global_batch_size == 32
    assert per_rank.bytes == global_.bytes
    with pytest.raises(InvalidInputError, match="does not split evenly"):
        memcalc.estimate("mlp", batch_size=30,
                         distributed=memcalc.Distributed("ddp", world_size=4, batch_is_global=True))


def test_ddp_bucket_cap_sets_the_number_of_buckets_not_their_bytes():
    from memcalc.engine.trace import StorageTracer

    def buckets(cap_mb: float) -> list[int]:
        with torch.device("meta"):
            model = two_layers()
        program = DdpProgram(int(cap_mb * MiB), gradient_as_bucket_view=False, training=True)
        program.install(StorageTracer("meta"), model)
        program.remove()
        return program.bucket_bytes

    assert buckets(25) == [8 * MiB]
    assert buckets(4) == [4 * MiB, 4 * MiB]


def test_fsdp_units_are_blocks_and_root():
    with torch.device("meta"):
        gpt2 = _gpt2()
    units = fsdp_units(gpt2, ("transformer.h",))
    assert [u.name for u in units] == [f"transformer.h.{i}" for i in range(12)] + ["(root)"]
    # a user model: the items of its ModuleList
    with torch.device("meta"):
        net = _BlockNet()
    assert [u.name for u in fsdp_units(net, ())] == ["blocks.0", "blocks.1", "blocks.2", "(root)"]
    # ZeRO-3 hooks every module (_register_deepspeed_module), those without parameters too
    assert len(module_units(net)) == len(list(net.modules()))
    assert len([u for u in module_units(net) if next(u.module.parameters(recurse=False), None) is not None]) \
        == 2 + 3 * 3  # inp, head; norm, fc1, fc2 per block


def test_sharded_program_puts_the_model_back():
    from memcalc.engine.step_spec import Step
    from memcalc.sources.resolve import resolve
    from memcalc.targets.backend import trace_step

    resolved = resolve("mlp", batch_size=2)
    before = [id(p) for p in resolved.module.parameters()]
    program = ShardedProgram(fsdp_units(resolved.module, ()), 4, style="fsdp2", reshard_after_forward=True,
                             sharded_dtype=None, gather_dtype=None, reduce_dtype=None, training=True)
    trace_step(resolved, Step(), hooks=program)
    assert [id(p) for p in resolved.module.parameters()] == before
    assert all(p.grad is None for p in resolved.module.parameters())
    assert not dist.is_initialized()  # memcalc never creates a process group


def test_fsdp_mixed_precision_gathers_16_bit_and_keeps_fp32_states():
    r = _two("fsdp", world_size=4, precision="amp-bf16")
    role = _only_role(r)
    assert role.model_states == 16 * PSI // 4  # fp32 shards, fp32 gradients, fp32 Adam
    # the gathered parameters and their gradients are bf16: half the bytes of fp32 FSDP's
    assert r.peak_requested < _two("fsdp", world_size=4).peak_requested


@pytest.mark.slow
def test_checkpointing_and_accumulation_run_under_every_strategy():
    for strategy in ("dp", "ddp", "fsdp", "zero1", "zero2", "zero3"):
        r = memcalc.estimate("gpt2", seq_len=32, batch_size=1,
                             distributed=memcalc.Distributed(strategy, world_size=2, **_zero_bucket(strategy)),
                             checkpoint=True,
                             accum_steps=2, precision="amp-bf16")
        assert r.bytes.peak_allocated > 0 and r.roles


# ============================================================================================
# Against real FSDP2 and DDP on the CPU
# ============================================================================================


class _Block(nn.Module):
    def __init__(self, d: int = 256):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class _BlockNet(nn.Module):
    def __init__(self, d: int = 256, blocks: int = 3):
        super().__init__()
        self.inp = nn.Linear(64, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _real_peak(model: nn.Module, x: torch.Tensor, before: list[torch.Tensor], setup=None) -> int:
    """Two real training iterations (Adam, loss = mean) under the CPU profiler."""
    from torch.profiler import ProfilerActivity, profile

    from memcalc.measure.step import _profiler_peak, storage_bytes

    start = storage_bytes([*before, x])
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if setup is not None:
            model = setup(model)
        opt = torch.optim.Adam(model.parameters(), foreach=True)
        for _ in range(2):
            out = model(x)
            loss = out.mean()
            loss.backward()
            del out, loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    return start + _profiler_peak(prof)


# The CPU step counters of Adam (4 B per parameter tensor) are real CPU memory that a GPU
# would not hold; nothing else differs.
def _step_counters(model_factory) -> int:
    return 4 * len(list(model_factory().parameters()))


@pytest.mark.parametrize("factory, shape, batch", [(two_layers, (1024,), 1), (_BlockNet, (64,), 16)])
@pytest.mark.parametrize("sharding", ["full_shard", "shard_grad_op"])
@pytest.mark.quick_cases("full_shard-two_layers-shape0-1")
def test_fsdp_against_real_fully_shard(fake_process_group, factory, shape, batch, sharding):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = factory()
    mesh = init_device_mesh("cpu", (fake_process_group,))
    reshard = sharding == "full_shard"
    blocks = model.blocks if hasattr(model, "blocks") else list(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    real = _real_peak(model, torch.randn(batch, *shape), [p.to_local() for p in model.parameters()])
    setting = memcalc.Distributed("fsdp", world_size=fake_process_group, sharding=sharding)
    estimate = memcalc.estimate(factory, input_shape=shape, batch_size=batch, distributed=setting, optimizer="adam",
                                loss="mean", gpu="cpu", loop=FOREACH)
    assert estimate.peak_requested == real - _step_counters(factory)


@pytest.mark.slow  # a real fully_shard step under the profiler
def test_fsdp_mixed_precision_against_real_fully_shard(fake_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = two_layers()
    mesh = init_device_mesh("cpu", (fake_process_group,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    real = _real_peak(model, torch.randn(1, 1024), [p.to_local() for p in model.parameters()])
    estimate = _two("fsdp", world_size=fake_process_group, precision="amp-bf16")
    assert estimate.peak_requested == real - _step_counters(two_layers)


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.5])
@pytest.mark.slow  # a real DDP step under the profiler per case; the quick run keeps one real FSDP step
def test_ddp_against_real_distributed_data_parallel(fake_process_group, view, bucket_cap_mb):
    def wrap(model: nn.Module) -> nn.Module:
        return fake_ddp(model, gradient_as_bucket_view=view, bucket_cap_mb=bucket_cap_mb)

    torch.manual_seed(0)
    model = _BlockNet()
    real = _real_peak(model, torch.randn(16, 64), list(model.parameters()), setup=wrap)
    setting = memcalc.Distributed("ddp", world_size=fake_process_group, gradient_as_bucket_view=view,
                                  bucket_cap_mb=bucket_cap_mb)
    estimate = memcalc.estimate(_BlockNet, input_shape=(64,), batch_size=16, distributed=setting, optimizer="adam",
                                loss="mean", gpu="cpu", loop=FOREACH)
    # + 12 B: DDP's own CPU scalars
    assert 0 <= real - _step_counters(_BlockNet) - estimate.peak_requested <= 16


# ============================================================================================
# Bad input
# ============================================================================================


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="ddp", world_size=0), "at least 1"),
    (dict(strategy="dp", device_ids=[0, 1, 1]), "device ids repeat"),
    (dict(strategy="ddp"), "needs the number of GPUs"),
    (dict(strategy="zero3"), "needs the number of GPUs"),
    (dict(strategy="dp"), "needs the GPUs"),
    (dict(strategy="single", world_size=4), "needs a multi-GPU strategy"),
    (dict(strategy="ddp", world_size=2, device_ids=[0, 1]), "device ids go with --strategy dp"),
    (dict(strategy="dp", world_size=3, device_ids=[0, 1]), "disagrees"),
    (dict(strategy="tp", world_size=2), "unknown strategy"),
    (dict(strategy="fsdp", world_size=2, sharding="hybrid"), "unknown FSDP sharding"),
    (dict(strategy="ddp", world_size=2, bucket_cap_mb=0), "bucket_cap_mb"),
])
def test_bad_input_is_refused(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        Distributed(**kwargs)


def test_distributed_must_be_the_options_object():
    with pytest.raises(InvalidInputError, match=r"memcalc\.Distributed"):
        memcalc.estimate("mlp", batch_size=2, distributed="ddp")


@pytest.mark.parametrize("args", [
    pytest.param(["--strategy", "ddp", "--world-size", "0"], id="world_size_0"),
    pytest.param(["--strategy", "dp", "--device-ids", "0,1,1"], id="device_ids_repeat"),
    pytest.param(["--strategy", "ddp"], id="ddp_without_world_size"),
    pytest.param(["--strategy", "fsdp"], id="fsdp_without_world_size"),
    pytest.param(["--strategy", "dp"], id="dp_without_device_ids"),
    pytest.param(["--world-size", "2"], id="world_size_without_strategy"),
    pytest.param(["--strategy", "ddp", "--world-size", "2", "--measure"], id="measure_under_ddp"),
])
def test_cli_strategy_usage_error(args, golden):
    result = CliRunner().invoke(main, ["mlp", *args])
    assert result.exit_code == 2, result.output
    golden(result.output)


# ============================================================================================
# JSON, CLI, fit
# ============================================================================================


_SINGLE_KEYS = {"model", "batch_size", "optimizer", "mode", "precision", "gpu", "parameters", "peak_phase",
                "peak_module", "attention_backend", "fits", "loop", "keep_grads", "optimizer_impl", "torch_version",
                "cuda_version", "trainable_parameters", "paged_optimizer_state", "bytes"}


def test_json_single_unchanged_and_strategy_section_added():
    assert set(memcalc.estimate("mlp", batch_size=2).to_dict()) == _SINGLE_KEYS
    data = memcalc.estimate("mlp", batch_size=2, distributed=memcalc.Distributed("dp", world_size=2)).to_dict()
    assert set(data) == _SINGLE_KEYS | {"strategy", "world_size", "global_batch_size", "roles"}
    assert (data["strategy"], data["world_size"], data["global_batch_size"]) == ("dp", 2, 4)
    assert [r["name"] for r in data["roles"]] == ["output device (cuda:0)", "other devices"]
    role = data["roles"][0]
    assert set(role) == {"name", "ranks", "batch_size", "peak_allocated", "peak_reserved", "peak_phase",
                         "peak_module", "fits", "model_states", "communication", "bytes"}
    assert {k: data["bytes"][k] for k in role["bytes"]} == role["bytes"]  # the top level is the busiest GPU
    json.dumps(data)


def test_cli_table_has_one_row_per_role(golden):
    result = CliRunner().invoke(main, ["gpt2", "--seq-len", "32", "--strategy", "dp", "--device-ids", "0,1,2",
                                       "--depth", "0", "--gpu", "a100-40gb"])
    assert result.exit_code == 0, result.output
    golden(result.output)  # dp over 3 GPUs, global batch 3: the output device (cuda:0) is the busiest
    result = CliRunner().invoke(main, ["mlp", "--strategy", "zero2", "--world-size", "4", "--global-batch", "-b", "8",
                                       "--reduce-bucket-size", "1000", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["batch_size"] == 2 and data["global_batch_size"] == 8 and data["roles"][0]["ranks"] == [0, 1, 2, 3]


@pytest.mark.slow
def test_fit_with_a_strategy_answers_per_gpu():
    # the search varies batch_size, which is per GPU: sharding the model states leaves room
    # for a larger batch on every GPU
    common = dict(budget="2GiB", seq_len=32)
    ddp = memcalc.max_batch_size("llama-tiny", distributed=memcalc.Distributed("ddp", world_size=8), **common)
    fsdp = memcalc.max_batch_size("llama-tiny", distributed=memcalc.Distributed("fsdp", world_size=8), **common)
    assert fsdp.batch_size > ddp.batch_size >= 1
    assert fsdp.report.strategy == "fsdp" and fsdp.report.roles[0].batch_size == fsdp.batch_size
    assert fsdp.report.fits
