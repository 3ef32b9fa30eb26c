"""The model's inputs and what the model can take: dict / keyword inputs (model(**batch)), model
files that import their neighbours, an explicit --input-shape / --seq-len over a file's
example_inputs, data-dependent ops named as such, and sequence lengths / KV caches the model
cannot take."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import memcalc
import models_zoo
from memcalc.cli import main
from memcalc.core.errors import (
    DataDependentError,
    InvalidInputError,
    RejectedShapesError,
    SymbolicExecutionError,
)
from memcalc.engine.model import ModelInputs, bind_inputs
from memcalc.fields import build_step
from memcalc.measure.step import measure
from memcalc.sources.resolve import resolve

FIXTURES = Path(__file__).parent / "fixtures"
HF_STYLE = FIXTURES / "hf_style.py"
TWO_MODELS = FIXTURES / "two_models.py"
DICT_MODELS = FIXTURES / "dict_models.py"
NEIGHBOURS = FIXTURES / "neighbours" / "net.py"
NEIGHBOURS_WIDE = FIXTURES / "neighbours_wide" / "net.py"
META = torch.device("meta")


def run(*args: str):
    return CliRunner().invoke(main, list(args))


class Scaled(nn.Module):
    """forward(x, scale=None): the same model called positionally or by keyword."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x, scale=None):
        out = self.fc(x)
        return out * scale if scale is not None else out


# ---- 7. dict / keyword inputs -----------------------------------------------------------------
def test_example_inputs_may_return_a_dict_of_keyword_arguments():
    resolved = resolve(f"{HF_STYLE}:make", batch_size=3)
    assert list(resolved.inputs.kwargs) == ["input_ids", "attention_mask", "labels"]
    assert resolved.inputs.args == ()
    assert resolved.batch_size == 3
    assert [tuple(t.shape) for t in resolved.inputs] == [(3, 32)] * 3  # every input tensor, in call order
    assert resolved.input_description == "input_ids=(3, 32) int64, attention_mask=(3, 32) int64, labels=(3, 32) int64"


def test_api_takes_a_dict_of_inputs_and_the_model_trains_on_its_own_loss():
    ids = torch.zeros(4, 16, dtype=torch.long, device=META)
    batch = {"input_ids": ids, "attention_mask": torch.ones(4, 16, dtype=torch.long, device=META),
             "labels": torch.zeros(4, 16, dtype=torch.long, device=META)}
    report = memcalc.estimate(resolve(f"{HF_STYLE}:make", batch_size=1).module, inputs=batch)
    assert report.batch_size == 4
    assert report.input_description == "input_ids=(4, 16) int64, attention_mask=(4, 16) int64, labels=(4, 16) int64"
    assert report.bytes.inputs == 3 * 4 * 16 * 8  # the three int64 tensors, no targets of memcalc's
    assert report.loss == "the model's own (output.loss)"  # labels given: output["loss"], as HF's ModelOutput
    # a loss asked for explicitly still wins over the model's own
    chosen = memcalc.estimate(resolve(f"{HF_STYLE}:make", batch_size=1).module, inputs=batch, loss="lm-cross-entropy")
    assert chosen.loss == "lm-cross-entropy"


def test_keyword_and_positional_inputs_give_the_same_estimate():
    x = torch.empty(8, 64, device=META)
    by_keyword = memcalc.estimate(Scaled(), inputs={"x": x})
    positional = memcalc.estimate(Scaled(), inputs=(x,))
    assert by_keyword.bytes == positional.bytes
    assert by_keyword.input_description == "x=(8, 64) float32"
    assert positional.input_description == "(8, 64) float32"
    both = memcalc.estimate(Scaled(), inputs={"x": x, "scale": torch.empty(64, device=META)})
    assert both.bytes.inputs == positional.bytes.inputs + 64 * 4


def test_keyword_inputs_are_cast_under_pure_half_precision():
    x = torch.empty(8, 64, device=META)
    report = memcalc.estimate(Scaled(), inputs={"x": x}, precision="bf16")
    fp32 = memcalc.estimate(Scaled(), inputs={"x": x})
    assert report.bytes.inputs == fp32.bytes.inputs - 8 * 64 * 2  # x in 2 bytes, not 4 (targets unchanged)
    assert "x=(8, 64) bfloat16" in report.input_description


def test_dict_inputs_under_a_strategy():
    x = torch.empty(8, 64, device=META)
    strategy = memcalc.Distributed("ddp", world_size=2)
    assert (memcalc.estimate(Scaled(), inputs={"x": x}, distributed=strategy).bytes
            == memcalc.estimate(Scaled(), inputs=(x,), distributed=strategy).bytes)


@pytest.mark.slow  # a real CPU step under the profiler
def test_dict_inputs_are_measured_for_real():
    ids = torch.randint(0, 1000, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.long), "labels": ids}
    measured = measure(build_step(f"{HF_STYLE}:make", inputs=batch), device="cpu")
    estimated = memcalc.estimate(f"{HF_STYLE}:make", inputs=batch, gpu="cpu").peak_requested
    assert measured.peak_allocated is not None
    assert abs(measured.peak_allocated - estimated) <= 0.01 * estimated


@pytest.mark.parametrize("inputs, fragment", [
    ({1: torch.zeros(2, 3)}, "keys of a dict of inputs"),
    ({"x": object()}, "hold a value of type object"),
    ({"mask": None}, "hold no tensor"),
    ({3, 4}, "not a set"),
])
def test_inputs_that_are_no_inputs_are_refused(inputs, fragment):
    with pytest.raises(InvalidInputError, match=fragment):
        resolve(Scaled(), inputs=inputs)


def test_model_inputs_map_keeps_the_call_structure():
    call = ModelInputs((torch.zeros(2, 3), [torch.zeros(2)]), {"mask": torch.ones(2, 3), "flag": True})
    assert len(call) == 3 and call.batch_size == 2
    moved = call.map(lambda t: t.to(META))
    assert isinstance(moved.args[1], list) and moved.kwargs["flag"] is True
    assert all(t.device.type == "meta" for t in moved)
    assert moved.description == "(2, 3) float32, [(2,) float32], mask=(2, 3) float32, flag=True"


def test_cli_names_the_keys_and_where_the_inputs_came_from(golden):
    # the header's input names each key; a note names the example_inputs(2) they came from
    result = run(f"{HF_STYLE}:make", "--batch", "2", "--depth", "0")
    assert result.exit_code == 0, result.output
    golden(result.output)


# ---- 8. a model file that imports its neighbours --------------------------------------------
def test_a_model_file_imports_its_neighbours_and_leaves_no_trace():
    path_before = list(sys.path)
    report = memcalc.estimate(f"{NEIGHBOURS}:make", batch_size=2, input_shape=(32,))
    assert report.parameters == 2 * (32 * 32 + 32)
    assert sys.path == path_before
    assert "layers" not in sys.modules  # python would keep it; the next file may have its own
    lazy = memcalc.estimate(f"{NEIGHBOURS}:make_lazy", batch_size=2, input_shape=(32,))  # import inside the factory
    assert lazy.parameters == 32 * 32 + 32


def test_each_model_file_gets_its_own_neighbours():
    narrow = memcalc.estimate(f"{NEIGHBOURS}:make", batch_size=1, input_shape=(32,))
    wide = memcalc.estimate(f"{NEIGHBOURS_WIDE}:make", batch_size=1, input_shape=(32,))
    assert wide.parameters == (32 * 64 + 64) + (64 * 32 + 32) != narrow.parameters


def test_a_neighbour_importing_model_file_is_measured():
    result = run(f"{NEIGHBOURS}:make_lazy", "--input-shape", "32", "--measure", "--gpu", "cpu", "--depth", "0")
    assert result.exit_code == 0, result.output
    assert "measured on cpu" in result.output


# ---- 9. an explicit --input-shape / --seq-len wins over example_inputs ------------------------
def test_input_shape_wins_over_a_file_example_inputs(golden):
    # the header's input is (1, 1024); a note says the file's example_inputs were ignored
    result = run(f"{TWO_MODELS}:mlp", "--input-shape", "1024", "--depth", "0")
    assert result.exit_code == 0, result.output
    golden(result.output)


def test_another_factorys_example_inputs_are_named_when_the_forward_refuses_them():
    with pytest.raises(SymbolicExecutionError) as caught:
        memcalc.estimate(f"{TWO_MODELS}:mlp", batch_size=1)  # example_inputs is the conv net's
    assert caught.value.hint == (f"The inputs, (1, 3, 64, 64) float32, came from example_inputs(1) in {TWO_MODELS}; "
                                 "if they are not this model's, give its input with --input-shape or --seq-len, "
                                 "which win over example_inputs.")


def test_example_inputs_are_used_without_a_flag_and_the_report_says_so():
    report = memcalc.estimate(f"{TWO_MODELS}:conv", batch_size=2)
    assert report.input_description == "(2, 3, 64, 64) float32"
    assert f"inputs from example_inputs(2) in {TWO_MODELS}" in report.notes


def test_seq_len_wins_with_token_ids():
    report = memcalc.estimate(f"{TWO_MODELS}:embedder", batch_size=2, seq_len=16)
    assert report.input_description == "(2, 16) int64"
    assert any(n.startswith(f"example_inputs in {TWO_MODELS} ignored: the sequence length given, 16,")
               for n in report.notes)


def test_seq_len_is_handed_to_an_example_inputs_that_takes_it():
    report = memcalc.estimate(f"{HF_STYLE}:make", batch_size=2, seq_len=64)
    assert report.input_description == "input_ids=(2, 64) int64, attention_mask=(2, 64) int64, labels=(2, 64) int64"
    assert f"inputs from example_inputs(2, seq_len=64) in {HF_STYLE}" in report.notes


def test_a_module_given_seq_len_gets_token_ids():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(8 * 12, 4))
    assert memcalc.estimate(model, batch_size=3, seq_len=12).input_description == "(3, 12) int64"


# ---- 10. data-dependent ops ---------------------------------------------------------------------
class _Reads(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.how = how

    def forward(self, x):
        return self.how(self.fc(x))


_READS = {
    "boolean mask": (lambda h: h[h > 0].sum(), "boolean-mask indexing", "aten.index.Tensor"),
    "nonzero": (lambda h: h.sum() + torch.nonzero(h).sum(), "nonzero", "aten.nonzero"),
    "unique": (lambda h: torch.unique(h).sum(), "torch.unique", "aten._unique2"),
    "masked_select": (lambda h: torch.masked_select(h, h > 0).sum(), "masked_select", "aten.masked_select"),
    "item": (lambda h: h * h.sum().item(), ".item()", "aten._local_scalar_dense"),
    "tolist": (lambda h: h * len(h.tolist()), ".tolist()", "aten._to_copy"),
}


@pytest.mark.parametrize("case", sorted(_READS))
def test_data_dependent_ops_are_named_as_such_with_their_module(case):
    how, what, op = _READS[case]
    model = nn.Sequential(_Reads(how))
    with pytest.raises(DataDependentError) as caught:
        memcalc.estimate(model, batch_size=4, input_shape=(16,))
    message = str(caught.value)
    assert message.startswith("the model reads tensor values during forward in module '0': ")
    assert what in message and op in message
    assert "please report" not in message
    assert caught.value.module == "0" and caught.value.phase == "forward"
    assert isinstance(caught.value, SymbolicExecutionError)  # catching the parent still works


def test_data_dependent_error_exits_1_on_the_command_line():
    result = run(f"{FIXTURES / 'user_models.py'}:make_branching", "--input-shape", "20")
    assert result.exit_code == 1
    assert result.output.startswith("error: the model reads tensor values during forward in the model's own code")
    assert "an `if` on one" in result.output and "(op aten._local_scalar_dense.default)" in result.output


@torch.library.custom_op("memcalc_test_inputs::cpu_only", mutates_args=())
def _cpu_only(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class _CpuOnly(nn.Module):
    """Calls a custom op that has a CPU kernel and no meta (fake) one."""

    def forward(self, x):
        return _cpu_only(x)


def test_an_op_without_a_meta_kernel_is_still_reported_as_such():
    model = nn.Sequential(nn.Linear(16, 16), _CpuOnly())
    with pytest.raises(SymbolicExecutionError) as caught:
        memcalc.estimate(model, batch_size=2, input_shape=(16,))
    assert not isinstance(caught.value, (DataDependentError, RejectedShapesError))
    assert caught.value.exit_code == 1  # memcalc's limit, not the user's input
    assert "please report the op" in str(caught.value)


# ---- 11. shapes the model refuses are bad input (exit 2), and say what the input was ---------------
def test_shapes_an_op_refuses_are_bad_input_naming_the_input():
    model = nn.Sequential(nn.Flatten(), nn.Linear(20, 5))
    with pytest.raises(RejectedShapesError) as caught:
        memcalc.estimate(model, batch_size=2, input_shape=(3, 224))
    error = caught.value
    assert isinstance(error, InvalidInputError) and isinstance(error, SymbolicExecutionError)
    assert error.exit_code == 2 and error.rejected_shapes
    assert str(error).startswith("op aten.addmm.default failed during forward in module '1': ")
    assert error.hint is not None and error.hint.startswith("The input was (2, 3, 224) float32. The op rejected")


@pytest.mark.parametrize("shape, count", [((3, 224), 2), ((8, 3, 224, 224), 4), ((224,), 1)])
def test_a_zoo_image_model_refuses_a_shape_of_another_rank_before_tracing(shape, count):
    with pytest.raises(InvalidInputError) as caught:
        resolve("resnet50", batch_size=1, input_shape=shape)
    message = str(caught.value)
    assert message.startswith(f"resnet50 takes images of shape C,H,W (3 numbers: channels, height, width); "
                              f"the input shape given, {','.join(map(str, shape))}, has {count}")
    assert caught.value.hint == ("Give one image's shape without the batch dimension: --input-shape 3,224,224 "
                                 "(input_shape=(3, 224, 224) in Python).")


def test_a_wrong_rank_image_shape_exits_2_on_the_command_line():
    result = run("resnet50", "--input-shape", "3,224")  # the case a new user met: it exited 1
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: resnet50 takes images of shape C,H,W")
    assert "--input-shape 3,224,224" in result.output and "Traceback" not in result.output


def test_a_read_attention_mask_gets_a_hint():
    with pytest.raises(DataDependentError, match="leave attention_mask out of the inputs"):
        memcalc.estimate(f"{HF_STYLE}:make_reads_mask", batch_size=2)
    without_mask = memcalc.estimate(f"{HF_STYLE}:make_reads_mask", inputs={
        "input_ids": torch.zeros(2, 32, dtype=torch.long, device=META)})
    assert without_mask.batch_size == 2


# ---- 6. sequences beyond the context, KV caches on encoders -----------------------------------
def test_zoo_entries_know_their_context_and_whether_they_decode():
    facts = {e.name: (e.context_length, e.decoder) for e in models_zoo.entries()}
    assert facts["gpt2"] == (1024, True)
    assert facts["bert-base"] == (512, False)
    assert facts["llama-2-7b"] == (4096, True)
    assert facts["lstm-lm"] == (None, False)
    assert facts["resnet50"] == (None, False)


def test_gpt2_beyond_its_context_says_the_model_grew():
    report = memcalc.estimate("gpt2", batch_size=1, seq_len=2048, mode="inference")
    assert report.parameters == 124_439_808 + 1024 * 768  # the position table grown by 1,024 rows
    assert ("2,048 tokens exceed gpt2's context of 1,024: its position table is grown to 2,048 rows, so this model "
            "has 125,226,240 parameters, not the released 124,439,808 (which cannot take more than 1,024 tokens)"
            in report.notes)
    within = memcalc.estimate("gpt2", batch_size=1, seq_len=1024, mode="inference")
    assert within.parameters == 124_439_808
    assert not any("context" in n for n in within.notes)


def test_rotary_models_beyond_their_context_keep_their_parameters():
    report = memcalc.estimate("llama-tiny", batch_size=1, seq_len=1024, mode="inference")
    assert any(n.startswith("1,024 tokens exceed llama-tiny's context of 512") and "same" in n for n in report.notes)


@pytest.mark.parametrize("model", ["bert-base", "lstm-lm", "resnet18"])
def test_kv_cache_needs_a_decoder(model):
    with pytest.raises(InvalidInputError, match=f"a KV cache needs a decoder language model .*; {model} is not one"):
        memcalc.estimate(model, batch_size=1, mode="inference", kv_cache=16)


def test_kv_cache_on_an_encoder_exits_2_on_the_command_line():
    result = run("bert-base", "--mode", "inference", "--kv-cache", "16")
    assert result.exit_code == 2
    assert "bert-base is not one" in result.output and "Drop --kv-cache" in result.output


def test_kv_cache_on_a_decoder_still_works():
    report = memcalc.estimate("gpt2", batch_size=2, seq_len=64, mode="inference", kv_cache=16)
    assert report.bytes.kv_cache == 2 * 12 * 768 * 2 * (64 + 16) * 4  # K and V, 12 layers, fp32


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def test_hf_model_past_its_position_table_is_refused(transformers):
    with pytest.raises(InvalidInputError, match="hf:gpt2 takes at most 1,024 tokens") as caught:
        memcalc.estimate("hf:gpt2", batch_size=1, seq_len=2048)
    assert "max_position_embeddings" in str(caught.value)
    assert memcalc.estimate("hf:gpt2", batch_size=1, seq_len=1024, mode="inference").parameters == 124_439_808


def test_hf_rotary_model_past_its_context_gets_a_note(transformers, tmp_path):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=128)
    path = tmp_path / "tiny_llama.json"
    config.to_json_file(str(path))
    report = memcalc.estimate(f"hf:{path}", batch_size=1, seq_len=256, mode="inference")
    assert any("256 tokens exceed" in n and "max_position_embeddings of 128" in n for n in report.notes)


def test_hf_encoder_refuses_a_kv_cache(transformers):
    with pytest.raises(InvalidInputError, match="hf:bert is not one"):
        memcalc.estimate("hf:bert", batch_size=1, seq_len=32, mode="inference", kv_cache=8)



# ---- 12. a dict of inputs is bound as Python would call the forward ------------------------------
WHOLE = ("the dict of inputs is the forward's one argument, model(inputs): its keys are not the forward's "
         "keyword arguments")


def _dict_batch(batch_size: int, device: torch.device = META) -> dict[str, torch.Tensor]:
    """What dict_models.example_inputs returns, on ``device``."""
    return {"features": torch.zeros(batch_size, 20, device=device), "mask": torch.ones(batch_size, 5, device=device)}


def _batch_forward(batch): ...
def _keyword_forward(features, mask): ...
def _any_keywords(**inputs): ...
def _dict_and_options(batch, scale=1.0, **options): ...
def _keys_a_subset(features, mask=None, scale=1.0): ...
def _named_batch(batch): ...  # the dict {"batch": ...} binds both ways: keywords come first


@pytest.mark.parametrize("forward, keys, whole", [
    (_batch_forward, ("features", "mask"), True),
    (_keyword_forward, ("features", "mask"), False),
    (_any_keywords, ("features", "mask"), False),
    (_dict_and_options, ("features", "mask"), True),  # **options, but batch is left unbound by the keys
    (_keys_a_subset, ("features",), False),
    (_named_batch, ("batch",), False),
])
def test_bind_inputs_binds_as_python_would(forward, keys, whole):
    given = ModelInputs((), {k: torch.zeros(2, 3) for k in keys})
    bound = bind_inputs(forward, given)
    if whole:
        assert bound.args == (given.kwargs,) and bound.kwargs == {}
    else:
        assert bound is given
    assert bind_inputs(forward, ModelInputs((torch.zeros(2, 3),))).kwargs == {}  # positional: as given


@pytest.mark.parametrize("name, whole", [("DictForward", True), ("Keywords", False), ("AnyKeywords", False),
                                         ("DictAndOptions", True)])
def test_a_dict_of_inputs_binds_alike_in_the_api_and_the_cli(name, whole):
    # API: the module with inputs={...}; CLI: the file's example_inputs returning the same dict
    module = resolve(f"{DICT_MODELS}:{name}", batch_size=1).module
    report = memcalc.estimate(module, inputs=_dict_batch(4))
    described = ("{features: (4, 20) float32, mask: (4, 5) float32}" if whole
                 else "features=(4, 20) float32, mask=(4, 5) float32")
    assert report.input_description == described
    assert (WHOLE in report.notes) is whole
    table = run(f"{DICT_MODELS}:{name}", "--batch", "4", "--depth", "0")
    assert table.exit_code == 0, table.output
    assert f"input {described};" in table.output and (f"note: {WHOLE}" in table.output) is whole
    as_json = run(f"{DICT_MODELS}:{name}", "--batch", "4", "--format", "json")
    assert json.loads(as_json.output)["bytes"] == report.to_dict()["bytes"]
    # both tensors (fp32) once, however they are bound, and the loss's 4 int64 class targets
    assert report.bytes.inputs == 4 * (20 + 5) * 4 + 4 * 8


def test_a_dict_the_forward_takes_neither_way_is_refused_naming_both():
    with pytest.raises(InvalidInputError) as caught:
        resolve(f"{DICT_MODELS}:NeedsMore", batch_size=2)
    message = str(caught.value)
    assert message.startswith(f"the forward(features, mask, extra) of {DICT_MODELS}:NeedsMore takes its dict of "
                              f"inputs (keys features, mask) neither as keyword arguments (")
    assert "'extra'" in message and "nor as its one argument (" in message
    result = run(f"{DICT_MODELS}:NeedsMore", "--batch", "2")
    assert result.exit_code == 2 and "neither as keyword arguments" in result.output


@pytest.mark.parametrize("name", ["DictForward", "DictAndOptions"])
@pytest.mark.slow  # a real CPU step under the profiler per case
def test_a_dict_forward_is_measured_as_it_is_estimated(name):
    measured = measure(build_step(f"{DICT_MODELS}:{name}", inputs=_dict_batch(2, torch.device("cpu"))), device="cpu")
    assert measured.peak_allocated is not None and measured.peak_allocated > 0
    result = run(f"{DICT_MODELS}:{name}", "--batch", "2", "--measure", "--gpu", "cpu", "--depth", "0")
    assert result.exit_code == 0, result.output
    assert "measured on cpu" in result.output


def _loop_over_dicts(model, optimizer, batches):
    """A loop as written for a DataLoader of dicts: model(batch)."""
    for batch in batches:
        assert isinstance(batch, dict), type(batch)
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_users_loop_gets_the_dict_a_dict_forward_takes():
    module = resolve(f"{DICT_MODELS}:DictForward", batch_size=1).module
    report = memcalc.estimate(module, inputs=_dict_batch(4), loop=_loop_over_dicts)
    assert report.loop == "_loop_over_dicts"
