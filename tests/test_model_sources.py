"""Every way to name a model resolves through one resolver, with the same names in the CLI
and the Python API; bad sources give their message and exit code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import memcalc
from memcalc.cli import main
from memcalc.core.errors import MissingPackageError, ModelSourceError, UnknownModelError
from memcalc.sources.resolve import resolve

FIXTURES = Path(__file__).parent / "fixtures"
USER_FILE = FIXTURES / "user_models.py"


def run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("name", ["resnet50", "ResNet50", "RESNET_50", "resnet-50", "vit_b_16", "vit-b-16",
                                  "GPT2-XL", "gpt2_xl", "llama_2_7b", "Llama-2-7B"])
def test_zoo_names_are_forgiving(name):
    assert resolve(name, batch_size=1).name in {"resnet50", "vit_b_16", "gpt2-xl", "llama-2-7b"}


def test_user_file_factory_with_example_inputs():
    resolved = resolve(f"{USER_FILE}:make_mlp", batch_size=3)
    assert resolved.inputs[0].shape == (3, 20)  # from example_inputs(batch_size)
    assert all(p.device.type == "meta" for p in resolved.module.parameters())
    result = run(f"{USER_FILE}:make_mlp", "--batch", "3", "--format", "json")
    assert result.exit_code == 0, result.output


def test_package_module_factory(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    report = memcalc.estimate("pkg_models.nets:small_cnn", batch_size=2, input_shape=(3, 32, 32))
    assert report.parameters == 3 * 8 * 9 + 8 + 8 * 10 + 10
    assert report.model == "pkg_models.nets:small_cnn"


def test_cli_and_api_resolve_the_same_names(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    api = memcalc.estimate("pkg_models.nets:small_cnn", batch_size=2, input_shape=(3, 32, 32)).to_dict()
    result = run("pkg_models.nets:small_cnn", "--batch", "2", "--input-shape", "3,32,32", "--format", "json")
    import json

    assert json.loads(result.output) == api


@pytest.mark.parametrize("spec, fragment", [
    (f"{FIXTURES}/missing.py:make", "model file not found"),
    (f"{FIXTURES}/broken_syntax.py:make", "syntax error in"),
    (f"{FIXTURES}/import_fails.py:make", "this model file imports something missing"),
    (f"{USER_FILE}:make_raises", "boom from the factory"),
    (f"{USER_FILE}:make_not_a_module", "not an nn.Module"),
    (f"{USER_FILE}:no_such_factory", "has no attribute 'no_such_factory'"),
])
def test_bad_user_sources_exit_1_with_message(spec, fragment):
    result = run(spec, "--batch", "2", "--input-shape", "20")
    assert result.exit_code == 1, result.output
    assert fragment in result.output
    assert "Traceback" not in result.output


def test_syntax_error_names_file_and_line():
    result = run(f"{FIXTURES}/broken_syntax.py:make", "--batch", "2")
    assert "broken_syntax.py" in result.output and "line 5" in result.output


def test_factory_error_names_the_line():
    result = run(f"{USER_FILE}:make_raises", "--batch", "2", "--input-shape", "20")
    assert "user_models.py, line" in result.output


def test_unknown_module_source_is_unknown_model():
    with pytest.raises(UnknownModelError):
        resolve("no_such_package_xyz:make", batch_size=1)


@pytest.mark.parametrize("prefix, package", [("torchvision", "torchvision"), ("timm", "timm"),
                                             ("hf", "transformers")])
def test_optional_sources_name_the_missing_package(prefix, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(MissingPackageError) as info:
        resolve(f"{prefix}:resnet50", batch_size=1)
    assert f"pip install {package}" in str(info.value)
    result = run(f"{prefix}:something", "--batch", "1")
    assert result.exit_code == 1 and f"pip install {package}" in result.output


def test_user_module_requires_an_input_description():
    from torch import nn

    with pytest.raises(memcalc.InvalidInputError) as info:
        memcalc.estimate(nn.Linear(4, 4), batch_size=2)
    assert "--input-shape" in str(info.value)


def test_token_models_take_seq_len():
    r = memcalc.estimate("gpt2", batch_size=1, seq_len=32, optimizer="sgd")
    assert "(1, 32) int64" in r.input_description
    result = run("gpt2", "--input-shape", "3,224,224")
    assert result.exit_code == 2 and "--seq-len" in result.output


def test_vision_input_shape_sizes_position_embeddings():
    r = memcalc.estimate("vit_b_16", batch_size=1, input_shape=(3, 384, 384), mode="eval")
    # 577 position tokens of width 768 instead of 197: +380·768 parameters
    assert r.parameters == 86_567_656 + (577 - 197) * 768


def test_model_files_are_not_left_in_sys_modules_under_a_colliding_name():
    resolve(f"{USER_FILE}:make_mlp", batch_size=1)
    assert "user_models" not in sys.modules or sys.modules["user_models"].__file__ != str(USER_FILE)


def test_model_source_error_is_a_memcalc_error():
    assert issubclass(ModelSourceError, memcalc.MemcalcError)
