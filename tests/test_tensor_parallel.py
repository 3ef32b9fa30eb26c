"""Tensor parallelism (:mod:`memcalc.distributed.tensor_parallel`): torch's own
``parallelize_module`` over a fake process group, one rank traced. Per-rank bytes worked out by
hand, the three sources of a plan, what is refused, and the global state left as it was. The
comparison with real two-process gloo runs is tests/test_gloo_tp.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_tp import SMALL_LLAMA, small_llama
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.parallel import SequenceParallel

import memcalc
from memcalc.core.categories import Category, Phase
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.tensor_parallel import TensorParallel
from memcalc.distributed.tp_plans import hf_plan, llama_plan, resolve_plan, user_plan
from memcalc.engine.optimizers import resolve_impl
from memcalc.engine.run import build_report
from memcalc.fields import build_step
from memcalc.targets.backend import trace_step

FOREACH = memcalc.Loop(optimizer_impl="foreach")
FOR_LOOP = memcalc.Loop(optimizer_impl="for-loop")
BATCH = 8
#: A colwise/rowwise Linear pair (Megatron's MLP): 1024 → 4096 → 1024, with biases.
PAIR_PLAN = {"0": "colwise", "2": "rowwise"}


def pair() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))


def _trace(factory, degree, plan, *, loop=FOREACH, rank=0, **step_kw):
    step_kw.setdefault("input_shape", (1024,))
    step_kw.setdefault("batch_size", BATCH)
    step = build_step(factory, optimizer="adam", loss="mean", gpu="cpu", loop=loop, **step_kw)
    resolved = step.resolved(batch_size=step.batch_size)
    impl = resolve_impl(step.optimizer, step.loop.optimizer_impl, cuda=step.emulate_cuda)
    program = TensorParallel(degree, plan, rank=rank, model_name=resolved.name, optimizer_impl=impl)
    traced = trace_step(resolved, step, hooks=program)
    return build_report(resolved, traced, step, role=f"tp rank {rank}"), traced, program, resolved


@pytest.mark.parametrize("degree", [2, 4])
def test_colwise_rowwise_pair_holds_its_shards(degree):
    report, traced, program, _ = _trace(pair, degree, PAIR_PLAN)
    # colwise fc1: weight rows and bias split, 4096/t × 1024 + 4096/t; rowwise fc2: weight columns
    # split, 1024 × 4096/t, its bias (added after the all-reduce) whole, 1024; 4 B each.
    # t=2: (2048·1024 + 2048 + 1024·2048 + 1024)·4 = 16,789,504 B;
    # t=4: (1024·1024 + 1024 + 1024·1024 + 1024)·4 = 8,396,800 B
    expected = (4096 // degree * 1024 + 4096 // degree + 1024 * 4096 // degree + 1024) * 4
    assert report.bytes.parameters == expected
    assert expected == {2: 16_789_504, 4: 8_396_800}[degree]
    # Adam: two moments of each local shard; the gradients: one per local shard
    nbytes = traced.trace.nbytes
    by_category = {c: sum(n for n, k in zip(nbytes, traced.categories, strict=True) if k is c)
                   for c in (Category.OPTIMIZER_STATE, Category.GRADIENTS)}
    assert by_category == {Category.OPTIMIZER_STATE: 2 * expected, Category.GRADIENTS: expected}
    # the rowwise layer's partial sums are all-reduced into a fresh (8, 1024) fp32 output per forward
    assert sorted({nbytes[u] for u in program.communication}) == [BATCH * 1024 * 4]


def test_every_rank_of_an_uneven_split():
    # 4098 outputs over 4 ranks: torch.chunk gives 1025, 1025, 1025, 1023 rows of 1024 fp32 weights
    def uneven() -> nn.Module:
        return nn.Sequential(nn.Linear(1024, 4098, bias=False))

    rows = [_trace(uneven, 4, {"0": "colwise_gather_output"}, rank=r)[0].bytes.parameters // (1024 * 4)
            for r in range(4)]
    assert rows == [1025, 1025, 1025, 1023]


def test_torchtitans_plan_on_the_zoo_llama():
    plan = llama_plan(small_llama())
    assert plan is not None and "torchtitan" in plan.source
    assert isinstance(plan.styles["model.layers.*.input_layernorm"], SequenceParallel)
    inputs = torch.zeros((2, 32), dtype=torch.long)
    report, _, program, _ = _trace(small_llama, 2, None, inputs=inputs, input_shape=None, batch_size=None)
    c = SMALL_LLAMA
    kv = c.num_kv_heads * c.head_dim
    # every weight halved but the norms' (sequence parallel: replicated): vocab rows of the
    # embedding and the head, q/k/v/gate/up rows, o/down columns
    split = (2 * c.vocab_size * c.hidden_size
             + c.num_layers * (2 * c.hidden_size**2 + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size))
    norms = (2 * c.num_layers + 1) * c.hidden_size
    assert report.bytes.parameters == (split // 2 + norms) * 4
    assert "torchtitan" in " ".join(program.notes)


def _hf_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.slow  # a transformers model: about 13 s
def test_a_hugging_face_models_own_plan():
    model = _hf_llama()
    plan = hf_plan(model)
    assert plan is not None and "transformers" in plan.source
    assert set(plan.styles) >= {"lm_head", "model.embed_tokens", "model.layers.*.self_attn.q_proj"}
    # its norms stay plain tensors: torch's foreach Adam refuses the mix, the for-loop one steps it
    with pytest.raises(InapplicableOptionError, match="input_layernorm"):
        _trace(_hf_llama, 2, None, inputs=torch.zeros((1, 16), dtype=torch.long), input_shape=None, batch_size=None)
    assert not dist.is_initialized()
    report, *_ = _trace(_hf_llama, 2, None, loop=FOR_LOOP, inputs=torch.zeros((1, 16), dtype=torch.long),
                        input_shape=None, batch_size=None)
    # embed_tokens, lm_head: 256 × 64, vocab halved; per layer q, o 64 × 64, k, v 32 × 64, gate,
    # up, down 128 × 64, halved; norms (2 per layer + 1) × 64 whole
    split = 2 * 256 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
    assert report.bytes.parameters == (split // 2 + 5 * 64) * 4


def test_user_strings_map_to_torch_styles():
    plan = user_plan({"a": "colwise", "b": "rowwise", "c": "colwise_gather_output", "d": "replicate"})
    assert set(plan.styles) == {"a", "b", "c"}  # "replicate": left whole
    assert plan.styles["a"].output_layouts == (Shard(-1),)
    assert plan.styles["b"].input_layouts == (Shard(-1),) and plan.styles["b"].output_layouts == (Replicate(),)
    assert plan.styles["c"].output_layouts == (Replicate(),)


@pytest.mark.parametrize("style", ["packed_colwise", "colwize"])
def test_unknown_styles_are_refused_by_name(style):
    with pytest.raises(InvalidInputError, match=style):
        user_plan({"0": style})


def test_a_pattern_that_names_no_module_is_refused():
    with pytest.raises(InvalidInputError, match=r"'blocks\.\*\.fc9'"):
        resolve_plan(pair(), {"blocks.*.fc9": "colwise"}, "pair")


def test_a_model_without_a_plan_is_refused():
    with pytest.raises(InapplicableOptionError, match="no tensor-parallel plan"):
        resolve_plan(pair(), None, "pair")


def test_a_style_on_the_wrong_module_is_refused_and_cleaned_up():
    with pytest.raises(InvalidInputError, match="parallelize_module refused"):
        _trace(pair, 2, {"1": "colwise"})  # the ReLU
    assert not dist.is_initialized()


def test_a_mix_of_plain_and_sharded_parameters_under_foreach_is_refused():
    with pytest.raises(InapplicableOptionError, match=r"plain tensors beside DTensors.*2\.weight"):
        _trace(pair, 2, {"0": "colwise"})


def test_the_model_and_torch_are_left_as_they_were():
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached
    _, _, program, resolved = _trace(pair, 2, PAIR_PLAN)
    module = resolved.module
    assert not dist.is_initialized()
    assert ShardingPropagator._propagate_tensor_meta_non_cached is propagate
    assert program.tracer is not None and program.tracer.defer_to == ()
    assert not any(isinstance(p, DTensor) for p in module.parameters())
    assert [tuple(p.shape) for p in module.parameters()] == [(4096, 1024), (4096,), (1024, 4096), (1024,)]
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in module.modules())


def test_a_process_group_already_there_is_refused(fake_process_group):
    with pytest.raises(InapplicableOptionError, match="default process group already"):
        _trace(pair, 2, PAIR_PLAN)
    assert dist.is_initialized()  # the caller's, left alone


def test_loss_parallel_keeps_the_logits_sharded():
    # gathered: every rank holds (2, 32, 1000) fp32 logits = 256,000 B; under loss_parallel its
    # (2, 32, 500) shard only. The cross-entropy's own buffers differ too: compare the logits' op.
    inputs = torch.zeros((2, 32), dtype=torch.long)
    kw = {"inputs": inputs, "input_shape": None, "batch_size": None, "loss": "lm-cross-entropy"}
    plan = llama_plan(small_llama(), loss_parallel=True)
    assert plan is not None and plan.styles["lm_head"].output_layouts == (Shard(-1),)
    gathered = _trace_lp(False, **kw)
    sharded = _trace_lp(True, **kw)
    assert max(_head_outputs(gathered)) == 2 * 32 * 1000 * 4
    assert max(_head_outputs(sharded)) == 2 * 32 * 500 * 4
    assert not dist.is_initialized()


def _trace_lp(loss_parallel: bool, **kw):
    step = build_step(small_llama, optimizer="adam", gpu="cpu", loop=FOREACH, **{
        k: v for k, v in kw.items() if v is not None})
    resolved = step.resolved(batch_size=None)
    return trace_step(resolved, step, hooks=TensorParallel(2, None, loss_parallel=loss_parallel))


def _head_outputs(traced) -> list[int]:
    trace = traced.trace
    return [trace.nbytes[u] for u in range(trace.num_storages) if trace.module[u] == "lm_head"
            and trace.phase[u] is Phase.FORWARD]


def test_loss_parallel_needs_torchtitans_plan():
    with pytest.raises(InapplicableOptionError, match="loss_parallel"):
        resolve_plan(pair(), PAIR_PLAN, "pair", loss_parallel=True)
