"""The README cannot drift from the tool, nor can the docs its sections moved to (issue 37).

The README and the documents in ``MOVED_DOCS`` are read alike:

* Every line of a ``bash``/``sh``/``console`` code block that starts with ``memcalc `` (or
  ``$ memcalc ``) is run with click's CliRunner, in an empty working directory, and must
  exit 0 — or with the code its trailing ``# exits N`` comment documents. A line ending in
  ``# needs a GPU`` runs only where CUDA is available.
* In ``console`` blocks, the lines after a ``$ memcalc ...`` line (up to the next ``$``
  line) are that command's output and must match it exactly. After a change to the tool,
  refresh them with ``MEMCALC_REGEN_README=1 python -m pytest tests/test_readme.py`` and
  review the diff.
* Every ``python`` code block runs without an error.
* The command-line reference (the ``text`` blocks of "## Command line") names exactly the
  options each command has: a new option must be documented, a removed one must go.

The two set-up commands at the top (new virtual environment, installs) are not run here:
``.ci/run`` runs the second one on a clean clone.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from memcalc.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"
ROOT = README.parent
#: The docs the README's sections moved to (issue 37): their commands, outputs, Python blocks and
#: links are checked as the README's are. A doc with a ``memcalc`` command must be listed here.
MOVED_DOCS = ("docs/options.md", "docs/loops.md", "docs/training-args.md", "docs/timeline.md",
              "docs/compare.md", "docs/fit.md", "docs/exit-codes.md", "docs/checkpointing.md",
              "docs/torch-compile.md", "docs/float8.md", "docs/throughput.md", "docs/many-gpus.md",
              "docs/json-output.md", "docs/notebooks.md", "docs/how-it-works.md", "docs/accuracy.md",
              "docs/speed.md", "docs/limitations.md", "docs/recipes.md")
DOCUMENTS = (README, *(ROOT / doc for doc in MOVED_DOCS))
REGEN = bool(os.environ.get("MEMCALC_REGEN_README"))

_FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_SHELL = {"bash", "sh", "shell", "console"}
_EXITS = re.compile(r"#\s*exits\s+(\d+)\s*$")
_NEEDS_GPU = re.compile(r"#\s*needs a GPU\s*$")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# A fixed terminal width: click wraps some text to the terminal.
_ENV = {"COLUMNS": "100"}


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    start: int  # offsets of the body in the README text
    end: int


@dataclass(frozen=True)
class Command:
    line: str  # as written in the README, without "$ "
    args: tuple[str, ...]  # after "memcalc"
    exit_code: int
    needs_gpu: bool
    output: str | None  # documented output (console blocks), else None


def blocks(text: str) -> list[Block]:
    return [Block(m["lang"], m["body"], m.start("body"), m.end("body")) for m in _FENCE.finditer(text)]


def _command(line: str, output: str | None) -> Command:
    exits = _EXITS.search(line)
    args = shlex.split(line, comments=True)
    assert args and args[0] == "memcalc", line
    return Command(line=line, args=tuple(args[1:]), exit_code=int(exits[1]) if exits else 0,
                   needs_gpu=bool(_NEEDS_GPU.search(line)), output=output)


def _console_commands(body: str) -> list[Command]:
    commands: list[Command] = []
    line: str | None = None
    output: list[str] = []
    for raw in [*body.splitlines(), "$ "]:
        if raw.startswith("$ "):
            if line is not None:
                commands.append(_command(line, _normalise("\n".join(output))))
            line = raw[2:].strip() if raw[2:].strip().startswith("memcalc ") else None
            output = []
        else:
            output.append(raw)
    return commands


def commands(text: str) -> list[Command]:
    found: list[Command] = []
    for block in blocks(text):
        if block.lang == "console":
            found += _console_commands(block.body)
        elif block.lang in _SHELL:
            for raw in block.body.splitlines():
                line = raw.strip().removeprefix("$ ")
                if line.startswith("memcalc "):
                    found.append(_command(line, None))
    return found


def _normalise(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.strip("\n").splitlines())


def run(command: Command):
    return CliRunner().invoke(main, list(command.args), env=_ENV, catch_exceptions=True)


def _regenerate(document: Path) -> None:
    """Rewrite the output under every ``$ memcalc`` line of the console blocks."""
    text = document.read_text()
    for block in reversed(blocks(text)):
        if block.lang != "console":
            continue
        lines: list[str] = []
        keep = True
        for raw in block.body.splitlines():
            if raw.startswith("$ "):
                lines.append(raw)
                keep = not raw[2:].strip().startswith("memcalc ")
                if not keep:
                    result = run(_command(raw[2:].strip(), None))
                    lines.extend(_normalise(result.output).splitlines())
            elif keep:
                lines.append(raw)
        text = text[: block.start] + "\n".join(lines) + "\n" + text[block.end:]
    document.write_text(text)



if REGEN:
    for _document in DOCUMENTS:
        _regenerate(_document)
README_TEXT = README.read_text()
TEXTS = {document: document.read_text() for document in DOCUMENTS}
# the README's recipes repeat docs/recipes.md's commands, one each: the same command and output run once
COMMANDS = list(dict.fromkeys(command for text in TEXTS.values() for command in commands(text)))
#: The files the README's commands read, with the contents its text gives them (TRL's configs).
README_FILES = {
    "sft.json": '{"per_device_train_batch_size": 4, "max_length": 2048, "completion_only_loss": true}',
    "dpo.json": '{"per_device_train_batch_size": 2, "beta": 0.1}',
    "reward.json": '{"per_device_train_batch_size": 2}',
    "fsdp.yaml": "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: bf16\n"
                 "num_machines: 1\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n"
                 "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_reshard_after_forward: true\n"
                 "  fsdp_activation_checkpointing: true\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n",
    "ds_zero2.json": '{"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", '
                     '"gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}, '
                     '"zero_optimization": {"stage": 2, "overlap_comm": true, "contiguous_gradients": true, '
                     '"reduce_bucket_size": "auto", "offload_optimizer": {"device": "cpu", "pin_memory": true}}}',
    "grpo.json": ('{"per_device_train_batch_size": 8, "num_generations": 8, "max_completion_length": 64, '
                  '"gradient_checkpointing": false}'),
}
PYTHON_BLOCKS = [b.body for text in TEXTS.values() for b in blocks(text) if b.lang == "python"]


def test_the_readme_documents_commands_to_run() -> None:
    # The parametrised tests below must not pass vacuously.
    assert len(COMMANDS) >= 10
    assert sum(c.output is not None for c in COMMANDS) >= 3
    assert PYTHON_BLOCKS


def test_the_readme_starts_with_the_two_commands() -> None:
    first, second = blocks(README_TEXT)[:2]
    assert first.body.strip().endswith("memcalc resnet50 --batch 64 --optim adam")
    assert 'pip install -e ".[test,plot,hf,quant,trl,float8]"' in second.body
    assert second.body.strip().endswith("python -m pytest -q -n 2 --dist loadgroup")


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.line[:70])
def test_readme_command(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if command.needs_gpu and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.chdir(tmp_path)  # --plot files and the like land here
    for name, content in README_FILES.items():  # the files the README's commands read, as it describes them
        (tmp_path / name).write_text(content)
    result = run(command)
    assert result.exit_code == command.exit_code, (
        f"`{command.line}` exited {result.exit_code}, the README says {command.exit_code}:\n{result.output}"
        + (f"\n{result.exception!r}" if result.exception and not isinstance(result.exception, SystemExit) else ""))
    if command.output is not None and not REGEN:
        assert _normalise(result.output) == command.output, (
            f"the output of `{command.line}` changed; refresh the README with "
            f"MEMCALC_REGEN_README=1 python -m pytest tests/test_readme.py and review the diff")


@pytest.mark.slow
@pytest.mark.parametrize("source", PYTHON_BLOCKS, ids=lambda s: s.strip().splitlines()[-1][:60])
def test_readme_python_block(source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(source, str(README), "exec"), {"__name__": "__readme__"})


def test_readme_links_to_files_that_exist() -> None:
    # Figures (docs/figures/*.png, from scripts/make_figures.py), notebooks, scripts; a moved doc's
    # links are relative to docs/.
    every: list[str] = []
    for document, text in TEXTS.items():
        targets = [t.split("#", 1)[0] for t in re.findall(r"\]\(((?!https?:|#)[^)\s]+)\)", text)]
        every += targets
        missing = [t for t in targets if not (document.parent / t).exists()]
        assert not missing, f"{document.relative_to(ROOT)} links to missing files: {missing}"
    assert any(t.endswith(".png") for t in every) and any(t.endswith(".ipynb") for t in every)
    assert all(f"]({doc})" in README_TEXT for doc in MOVED_DOCS), "a moved doc the README does not link"


def test_every_doc_with_a_command_is_checked() -> None:
    # a new doc holding `memcalc` commands is run like the README, not left to drift
    for path in sorted((ROOT / "docs").glob("*.md")):
        if path not in DOCUMENTS:
            found = commands(path.read_text())
            assert not found, f"{path.relative_to(ROOT)} has memcalc commands: add it to MOVED_DOCS"


def _reference_synopses(text: str) -> dict[str, str]:
    """Command name → its synopsis in the "## Command line" section's ``text`` blocks."""
    section = text.split("\n## Command line", 1)[1].split("\n## ", 1)[0]
    synopses: dict[str, str] = {}
    for block in blocks(section):
        if block.lang != "text":
            continue
        current = None
        for line in block.body.splitlines():
            if line.startswith("memcalc "):
                word = line.split()[1]
                current = word if word in main.commands else "estimate"
                assert current not in synopses, f"two synopses for memcalc {current}"
                synopses[current] = line
            elif current is not None and line.startswith(" "):
                synopses[current] += "\n" + line
    return synopses


def _options(command: click.Command) -> set[str]:
    names = {n for p in command.params if isinstance(p, click.Option) for n in (*p.opts, *p.secondary_opts)}
    return {n for n in names if n.startswith("--")}


SYNOPSES = _reference_synopses(README_TEXT)


@pytest.mark.parametrize("name", sorted(main.commands))
def test_cli_reference_lists_every_option(name: str) -> None:
    assert name in SYNOPSES, f"the README's command-line reference has no synopsis for memcalc {name}"
    documented = set(_OPTION.findall(SYNOPSES[name]))
    actual = _options(main.commands[name])
    assert documented - actual == set(), f"memcalc {name} has no option {sorted(documented - actual)}"
    assert actual - documented == set(), f"the README does not document memcalc {name} {sorted(actual - documented)}"


# ---- the ResNet-50 figure: its caption and its dots are what `memcalc fit` answers today ------
# scripts/make_figures.py is the single source of the figure's fit options; the answers are
# computed here, never typed in, so a change to the margins (memcalc/search/margins.py) fails
# this test until the figure and its caption are redrawn and rewritten.
FIGURE = "docs/figures/resnet50_batch.png"
_FIT_ANSWER = re.compile(r"([\d,]+) with `--gpu ([\w-]+)` \(margin (\d+\.\d)%\)")
_RAW_ANSWER = re.compile(r"([\d,]+) with `--gpu ([\w-]+) --margin 0`")


def _figure_script():
    spec = importlib.util.spec_from_file_location("make_figures", README.parent / "scripts" / "make_figures.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def figure_caption(text: str, target: str) -> str:
    """The italic paragraph under the image that links ``target``."""
    after = text.split(f"]({target})", 1)[1].lstrip("\n")
    assert after.startswith("*"), f"no caption under {target}"
    return after.split("\n\n", 1)[0].replace("\n", " ")


@pytest.fixture(scope="module")
def resnet50_fits():
    script = _figure_script()
    return script, script.resnet50_fits()


@pytest.mark.slow  # two fits of resnet50 (the module's resnet50_fits)
def test_resnet50_figure_caption_states_what_fit_answers(resnet50_fits) -> None:
    _, fits = resnet50_fits
    caption = figure_caption(README_TEXT, FIGURE)
    stated = {gpu: (int(n.replace(",", "")), float(margin)) for n, gpu, margin in _FIT_ANSWER.findall(caption)}
    raw = {gpu: int(n.replace(",", "")) for n, gpu in _RAW_ANSWER.findall(caption)}
    answers = {key: (fit.batch_size, round(fit.margin * 100, 1)) for key, fit in fits}
    boundaries = {key: fit.raw_batch_size for key, fit in fits}
    assert stated == answers, f"the README's caption under {FIGURE} says {stated}; memcalc fit answers {answers}"
    assert raw == boundaries, f"the caption's raw boundaries {raw}; with --margin 0, fit answers {boundaries}"
    assert len(answers) == 2 and all(a < boundaries[k] for k, (a, _) in answers.items())  # a margin held back


@pytest.mark.slow  # shares resnet50_fits (two fits of resnet50) with the caption's test
def test_resnet50_figure_dots_are_what_fit_answers(resnet50_fits) -> None:
    # the figure carries its dots' answers in the PNG's Description, written by the script
    from PIL import Image

    script, fits = resnet50_fits
    with Image.open(README.parent / FIGURE) as png:
        drawn = png.text.get("Description")
    assert drawn == script.resnet50_fit_metadata(fits), (
        f"{FIGURE} was drawn for {drawn!r}; redraw it with python scripts/make_figures.py resnet50_batch")
