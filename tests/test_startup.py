"""What a command imports: ``memcalc --help``, ``--version``, ``zoo`` and ``gpus`` (without a GPU
driver) import no torch, and an estimate imports only what its request uses. These are
correctness checks on ``sys.modules`` in a fresh interpreter, not timings
(benchmarks/startup.py times them)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memcalc.cli.commands import SUBCOMMANDS
from memcalc.cli.zoo import ZooListed, listed_in_registry, zoo_row
from memcalc.cli.zoo_listing import ZOO_LISTING
from memcalc.targets.cuda.gpus.local import nvidia_driver_loaded

ROOT = Path(__file__).resolve().parent.parent

#: Runs each command line given in argv (JSON) through the CLI in this one interpreter and prints,
#: per command, the heavy modules loaded so far: one interpreter start for all four commands.
_RUN_COMMANDS = """
import contextlib, io, json, sys
from memcalc.cli import main
HEAVY = ("torch", "transformers", "peft", "models_zoo", "sympy", "memcalc.engine", "memcalc.timing.flops",
         "torch.utils.flop_counter")
seen = {}
for args in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args, prog_name="memcalc")
        except SystemExit as exc:
            assert not exc.code, (args, exc.code)
    seen[" ".join(args)] = sorted(m for m in HEAVY if m in sys.modules)
print(json.dumps(seen))
"""


def _heavy_modules_after(commands: list[list[str]]) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", _RUN_COMMANDS, json.dumps(commands)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_help_version_zoo_and_gpus_import_no_torch():
    """The four commands that answer from plain data: none of torch, transformers, the zoo's model
    definitions or the engine is imported (each listed after the commands run so far). ``gpus``
    asks torch.cuda only where a GPU driver is loaded, so it is held to this only without one."""
    commands = [["--help"], ["--version"], ["zoo"], ["zoo", "--format", "json"]]
    if not nvidia_driver_loaded():
        commands.append(["gpus"])
    seen = _heavy_modules_after(commands)
    assert seen == {" ".join(args): [] for args in commands}


@pytest.mark.slow  # a fresh interpreter that imports torch and traces: seconds
def test_an_estimate_imports_what_its_request_uses():
    """A zoo model's plain-torch definition (``torch:llama-tiny``) without ``--time`` imports neither
    transformers and PEFT (the model is memcalc's own) nor the FLOP recorder and torch's FLOP
    formulas (no time asked); ``--time`` then imports the recorder, which shows the check sees it."""
    plain = ["torch:llama-tiny", "--batch", "1", "--seq-len", "8"]
    timed = ["mlp", "--batch", "1", "--time", "--gpu", "h100-80gb"]
    seen = _heavy_modules_after([plain, timed])
    untouched = {"transformers", "peft", "memcalc.timing.flops", "torch.utils.flop_counter"}
    assert untouched.isdisjoint(seen[" ".join(plain)]), seen
    assert {"torch", "memcalc.engine", "models_zoo"} <= set(seen[" ".join(plain)]), seen
    assert {"memcalc.timing.flops", "torch.utils.flop_counter"} <= set(seen[" ".join(timed)]), seen


#: In a fresh interpreter: the modules of ``NOT_IMPORTED`` loaded after importing ``memcalc.api``,
#: after inference estimates of mlp and resnet50, and after a tensor-parallel plan is made.
_RUN_INFERENCE = """
import json, sys
NOT_IMPORTED = json.loads(sys.argv[1])
loaded = lambda: sorted(m for m in NOT_IMPORTED if m in sys.modules)
seen = {}
import memcalc.api
seen["import"] = loaded()
memcalc.api.estimate("mlp", batch_size=2, mode="inference")
memcalc.api.estimate("resnet50", batch_size=2, mode="inference")
seen["inference"] = loaded()
from memcalc.distributed.tp_plans import user_plan
user_plan({"fc": "colwise"})
seen["tp plan"] = loaded()
print(json.dumps(seen))
"""


@pytest.mark.slow  # a fresh interpreter that imports torch and traces: seconds
def test_an_inference_estimate_imports_no_distributed_tensor():
    """``memcalc.api`` imports the strategy catalogue (to read launch configurations), whose
    tensor-parallel files make torch's ``ParallelStyle``s; ``torch.distributed.tensor`` (and sympy
    under it) is imported where a plan is made, so an inference estimate of a plain model imports
    neither it nor transformers, PEFT or the FLOP recorder. sympy is held off only until the
    trace: torch's own Python meta kernels call ``torch._check``, which imports
    ``torch.fx.experimental.symbolic_shapes`` (and sympy). Making a plan then imports DTensor,
    which shows the check sees it."""
    not_imported = ["torch.distributed.tensor", "torch.distributed.tensor.parallel", "sympy", "transformers",
                    "peft", "memcalc.timing.flops", "torch.utils.flop_counter", "torch._dynamo"]
    done = subprocess.run([sys.executable, "-c", _RUN_INFERENCE, json.dumps(not_imported)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["import"] == [], seen
    assert seen["inference"] == ["sympy"], seen  # torch._check's import, inside torch's meta kernels
    assert {"torch.distributed.tensor", "torch.distributed.tensor.parallel"} <= set(seen["tp plan"]), seen


#: Runs each command line of argv[2] (JSON) through the CLI in one interpreter and prints, per
#: command, which of the modules listed in argv[1] (JSON) are loaded so far.
_RUN_WATCHING = """
import contextlib, io, json, sys
from memcalc.cli import main
watched = json.loads(sys.argv[1])
seen = {}
for args in json.loads(sys.argv[2]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args, prog_name="memcalc")
        except SystemExit as exc:
            assert not exc.code, (args, exc.code)
    seen[" ".join(args)] = sorted(m for m in watched if m in sys.modules)
print(json.dumps(seen))
"""

#: What only a multi-GPU request, a launch configuration, ``plan`` or a TRL loop reads (issue 36):
#: every strategy file (the catalogue imports them on first read) and what they alone import, the
#: launch readers (imported by ``read_launch`` when a file is given), the plan search (by
#: ``memcalc.api.plan``) and memcalc's TRL step (where a TRL loop is estimated).
_MULTI_GPU_ONLY = ["memcalc.distributed.strategy.dp_shard", "memcalc.distributed.strategy.dp_replicate",
                   "memcalc.distributed.strategy.pp", "memcalc.distributed.strategy.tp",
                   "memcalc.distributed.strategy.ep", "memcalc.distributed.strategy.context_parallel",
                   "memcalc.distributed.strategy.deepspeed_zero", "memcalc.distributed.strategy.data_parallel",
                   "memcalc.distributed.fsdp", "memcalc.distributed.zero", "memcalc.distributed.ep_stages",
                   "memcalc.distributed.expert_parallel", "memcalc.distributed.ring_attention",
                   "memcalc.distributed.launch.accelerate_config", "memcalc.distributed.launch.deepspeed_config",
                   "memcalc.search.plan", "memcalc.distributed.pipeline", "memcalc.stacks.trl.step"]


@pytest.mark.slow  # a fresh interpreter that imports torch and traces three steps: seconds
def test_a_single_gpu_request_imports_no_strategy_or_launch_reader(tmp_path):
    """A single-GPU training estimate of a plain-torch CNN (``resnet50``, no ``--strategy``,
    ``--mesh`` or launch file) imports none of the strategy files, launch readers, the plan search
    or the TRL step; a DDP estimate
    then imports the strategy files, and a DeepSpeed file its reader, which shows the check sees
    them (and that the catalogue still finds every strategy when asked)."""
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                     "train_batch_size": 2, "zero_optimization": {"stage": 1}}))
    single = ["resnet50", "--batch", "2", "--optim", "adam"]
    ddp = ["mlp", "--batch", "2", "--strategy", "ddp", "--world-size", "2"]
    launched = ["mlp", "--batch", "1", "--deepspeed", str(deepspeed)]
    done = subprocess.run([sys.executable, "-c", _RUN_WATCHING, json.dumps(_MULTI_GPU_ONLY),
                           json.dumps([single, ddp, launched])], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen[" ".join(single)] == [], seen
    strategies = {m for m in _MULTI_GPU_ONLY if ".strategy." in m}
    assert strategies <= set(seen[" ".join(ddp)]), seen
    assert "memcalc.distributed.launch.deepspeed_config" in seen[" ".join(launched)], seen


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_help_summaries_are_the_commands_own(name):
    """``memcalc --help`` shows each command's summary from the group's table, without loading the
    command: the table says what the loaded command would (click's own shortening, no limit)."""
    command = SUBCOMMANDS[name].load()
    assert command.name == name
    assert SUBCOMMANDS[name].summary == command.get_short_help_str(limit=10**6)


def test_zoo_listing_is_the_registry():
    """``memcalc zoo`` lists plain data written from the zoo's registry; a new or changed entry
    fails here until ``python scripts/write_zoo_listing.py`` writes it again."""
    assert [ZooListed(*row) for row in ZOO_LISTING] == listed_in_registry(), \
        "the zoo changed: run `python scripts/write_zoo_listing.py` and commit memcalc/cli/zoo_listing.py"


@pytest.mark.parametrize("installed", [True, False], ids=["transformers", "no-transformers"])
def test_zoo_rows_name_the_model_resolution_builds(installed, monkeypatch):
    """The listing's "model" column is transformers' class exactly where resolving the name builds
    transformers' model (:func:`memcalc.sources.resolve.builds_transformers`), or where the zoo has
    no plain-torch definition (then the name is transformers' model or nothing)."""
    import models_zoo
    from memcalc.sources import resolve

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(resolve.importlib.util, "find_spec",
                        lambda name, *a: (real_find_spec(name, *a) if installed else None)
                        if name == "transformers" else real_find_spec(name, *a))
    for row in ZOO_LISTING:
        listed = ZooListed(*row)
        entry = models_zoo.get(listed.name)
        assert entry is not None
        builds = zoo_row(listed, transformers_installed=installed)["model"].startswith("transformers ")
        assert builds == (resolve.builds_transformers(entry) or entry.builder is None), listed.name
