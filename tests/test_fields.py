"""The step's options are listed once (memcalc.fields.FIELDS): the Step's attributes,
estimate()'s keywords, the searches' ``**estimate_options`` and the CLI's shared options all
follow that table, and a user's value is converted into the Step once."""

from __future__ import annotations

import dataclasses
import inspect

import click
import pytest

import memcalc
from memcalc.cli import main
from memcalc.cli.params import CLI_BYTES_FORMS
from memcalc.core.categories import Mode
from memcalc.core.errors import InvalidInputError
from memcalc.core.loop import Loop
from memcalc.core.losses import LossChoice
from memcalc.core.precision import Precision
from memcalc.engine.optimizers import DEFAULT_OPTIMIZER, Optimizer
from memcalc.engine.step_spec import Step, Target
from memcalc.fields import BUDGET_FORMS, DISTRIBUTED, FIELDS, LAUNCH, build_step


def _estimate_keywords() -> dict[str, inspect.Parameter]:
    parameters = inspect.signature(memcalc.estimate).parameters
    return {name: p for name, p in parameters.items() if name not in ("model", DISTRIBUTED, *LAUNCH)}


def test_estimate_takes_every_field_and_nothing_else_with_the_tables_defaults():
    keywords = _estimate_keywords()
    assert set(keywords) == set(FIELDS)
    for name, parameter in keywords.items():
        assert parameter.default == FIELDS[name].default, name


def test_estimate_documents_every_field():
    doc = inspect.getdoc(memcalc.estimate) or ""
    missing = [name for name in FIELDS if f"{name}:" not in doc]
    assert not missing, f"estimate()'s docstring lacks {missing}"


def test_every_attribute_of_the_step_comes_from_exactly_one_field():
    filled = [attribute for field in FIELDS.values() for attribute in field.attributes]
    assert len(filled) == len(set(filled))  # no attribute filled twice
    # the positional model, its resolver (the API's), the notes building the step found, and what
    # an accelerate launch config decides about the prepared model (set from the file, not an option)
    attributes = {f.name for f in dataclasses.fields(Step)} - {"model", "resolver", "notes", "accelerate_prepared"}
    assert set(filled) == attributes


def test_the_cli_offers_every_shared_field_in_every_estimating_command():
    shared = {name for name, field in FIELDS.items() if field.cli is not None and not field.cli.per_command}
    assert shared  # the table drives the shared options: none written out by hand
    for command in ("estimate", "fit", "sweep", "compare"):
        params = {p.name: p for p in main.commands[command].params}
        assert shared <= set(params), command
        for name in shared:
            assert isinstance(params[name], click.Option) and params[name].opts == [FIELDS[name].flag]


#: Each command's form of the per-command fields: field → its parameter in the command.
PER_COMMAND = {
    "estimate": {"batch_size": "batch", "optimizer": "optim", "precision": "precision", "gpu": "gpu"},
    "compare": {"batch_size": "batch", "optimizer": "optim", "precision": "precision", "gpu": "gpu"},
    "fit": {"optimizer": "optim", "precision": "precision"},  # its --gpu is a budget's: BUDGET_FORMS
    "sweep": {"batch_size": "batches", "optimizer": "optims", "precision": "precisions"},  # lists
}


@pytest.mark.parametrize("command", sorted(PER_COMMAND))
def test_per_command_fields_are_made_from_the_table(command):
    """The flag, its short form, its help and its default come from FIELDS: a command adds only
    its form (a list, no default for a search) and a sentence of its own."""
    params = {p.name: p for p in main.commands[command].params}
    assert {n for n, f in FIELDS.items() if f.cli is not None and f.cli.per_command and f.cli.kind != "budget"} == set(
        PER_COMMAND["estimate"])
    for name, param in PER_COMMAND[command].items():
        field, option = FIELDS[name], params[param]
        assert isinstance(option, click.Option)
        assert option.opts == [field.flag, *([field.cli.short] if field.cli.short else [])]
        assert option.help.startswith(field.help)
    assert params[PER_COMMAND[command]["optimizer"]].default == DEFAULT_OPTIMIZER.value  # one default, everywhere
    precision = params["precision" if command != "sweep" else "precisions"].default
    assert precision == ("fp32" if command in ("estimate", "compare") else None)  # a search keeps the step's own




@pytest.mark.parametrize("command", ["fit", "sweep"])
def test_a_searchs_budget_flags_are_made_from_the_table(command):
    """The capacity's ``budget`` flag is ``--gpu``, ``--budget`` and ``--device`` in each search, in
    that order, each spelled and explained by BUDGET_FORMS; the estimate takes a GPU name instead."""
    assert [n for n, f in FIELDS.items() if f.cli is not None and f.cli.kind == "budget"] == ["capacity"]
    options = [p for p in main.commands[command].params if p.name in BUDGET_FORMS]
    assert [p.name for p in options] == list(BUDGET_FORMS)
    for option in options:
        flag, metavar, help_text = BUDGET_FORMS[option.name]
        assert isinstance(option, click.Option) and option.opts == [flag] and option.default is None
        assert option.help == help_text.format(bytes_forms=CLI_BYTES_FORMS)
        assert option.metavar == metavar


def test_a_searchs_unknown_keyword_is_judged_by_the_table():
    with pytest.raises(InvalidInputError) as caught:
        memcalc.max_batch_size("mlp", gpu="t4", acum_steps=2)
    assert "did you mean 'accum_steps'" in str(caught.value)
    takes = [name for name, field in FIELDS.items() if field.searched is None and name != "gpu"]
    assert caught.value.hint == f"The estimate options it takes: {', '.join([*takes, DISTRIBUTED])}."
    with pytest.raises(InvalidInputError, match=r"max_batch_size\(\) does not take time"):
        memcalc.max_batch_size("mlp", gpu="t4", time=True)


def test_strings_become_the_steps_types_once():
    step = build_step("mlp", batch_size=4, optimizer="SGD", mode="train", loss="mean", precision="amp-bf16",
                      gpu="cpu", accum_steps=2, loop="tutorial", time=True)
    assert step.model == "mlp" and step.batch_size == 4
    assert step.optimizer_key is Optimizer.SGD and step.mode is Mode.TRAIN and step.loss is LossChoice.MEAN
    assert step.precision is Precision.AMP_BF16 and step.target is Target.CPU
    assert step.gpu.key == "cpu" and not step.gpu_named and step.capacity is None
    assert step.loop == Loop("tutorial") and step.record_costs and step.accum_steps == 2
    t4 = build_step("mlp", gpu="t4")
    assert t4.gpu_named and t4.capacity == t4.gpu.usable_memory  # a named GPU's memory is the capacity
    # objects pass as they are
    assert build_step(gpu=t4.gpu).gpu == t4.gpu


def test_a_loss_function_is_the_steps_loss_fn():
    def my_loss(output):
        return output.sum()

    step = build_step("mlp", loss=my_loss)
    assert step.loss is None and step.loss_fn is my_loss
