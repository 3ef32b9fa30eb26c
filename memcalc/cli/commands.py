"""The ``memcalc`` group: its subcommands by name, each imported only when it runs.

A command's module imports what its work needs (torch, transformers, the engine: seconds);
``memcalc --help``, ``--version``, ``zoo`` and ``gpus`` need none of it, so the group knows its
commands as import paths (:data:`SUBCOMMANDS`) and shows each one's summary from that table, not
from the loaded command (tests/test_startup.py holds the two equal).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from typing import Any

import click
from click.formatting import HelpFormatter

__all__ = ("SUBCOMMANDS", "Subcommand", "main")


class Subcommand:
    """A subcommand known by where it lives (``module:attribute``) and its one-line summary."""

    def __init__(self, path: str, summary: str) -> None:
        self.path = path
        self.summary = summary

    def load(self) -> click.Command:
        """Import the command's module, and return the command."""
        module, _, attribute = self.path.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command), self.path
        return command

    def short_help(self, limit: int) -> str:
        """The summary shortened to ``limit`` characters, as click shortens a loaded command's help."""
        return click.Command(None, help=self.summary).get_short_help_str(limit)


#: Every subcommand: where it lives, and its help's first sentence as click shortens it
#: (``Command.get_short_help_str`` with no limit), for ``memcalc --help``.
SUBCOMMANDS: dict[str, Subcommand] = {
    "estimate": Subcommand("memcalc.cli.app:estimate_command", "Estimate the GPU memory of one step of MODEL."),
    "zoo": Subcommand("memcalc.cli.zoo:zoo_command",
                      "List the model zoo: name, family, parameters, default input, and the model the name builds "
                      "(transformers' class from the released config, or memcalc's plain-torch definition)."),
    "fit": Subcommand("memcalc.cli.fit:fit_command",
                      "The largest batch of MODEL whose step fits a GPU, a budget or a local GPU (per GPU, with a "
                      "multi-GPU --strategy)."),
    "compare": Subcommand("memcalc.cli.compare:compare_command",
                          "Compare SNAPSHOT, a torch.cuda.memory._snapshot() pickle of a real run, with memcalc's "
                          "estimate of MODEL's step in the same configuration (the options of memcalc estimate): "
                          "peaks, the reserved difference, allocations by phase, and the blocks each side lacks."),
    "sweep": Subcommand("memcalc.cli.sweep:sweep_command",
                        "Estimate MODEL for every batch size × optimizer × precision: one row each."),
    "plan": Subcommand("memcalc.cli.plan:plan_command",
                       "The fastest meshes (dp_replicate, dp_shard, tp, pp, cp; ep for a mixture of experts), pipeline "
                       "schedules, micro-batches and "
                       "activation checkpointing to train MODEL on --gpus GPUs that fit --gpu, ranked by estimated "
                       "step time (the roofline of the traced step, the pipeline bubble, and a collective cost model "
                       "with NVLink within a node and the network between nodes)."),
    "gpus": Subcommand("memcalc.cli.gpus:gpus_command",
                       "List the GPUs this process can see (after CUDA_VISIBLE_DEVICES), in torch's order."),
}


class LazyCommands(MutableMapping[str, click.Command]):
    """The group's ``commands``: the names are known at once, a command is imported on first
    look-up and kept. ``name in commands`` and iteration import nothing."""

    def __init__(self, table: dict[str, Subcommand]) -> None:
        self._table = table
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            self._loaded[name] = self._table[name].load()
        return self._loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        self._loaded.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._table or name in self._loaded

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._table, *self._loaded]))

    def __len__(self) -> int:
        return len(dict.fromkeys([*self._table, *self._loaded]))


class ModelFirstGroup(click.Group):
    """A group whose first positional argument may be a model instead of a subcommand:
    ``memcalc resnet50 ...`` runs ``memcalc estimate resnet50 ...``. Its subcommands are loaded
    when they run (:class:`LazyCommands`)."""

    default_command = "estimate"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("commands", LazyCommands(SUBCOMMANDS))
        super().__init__(*args, **kwargs)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Prepend ``estimate`` when the first positional argument is not a subcommand."""
        first = next((a for a in args if not a.startswith("-")), None)
        wants_group_help = not args or args[0] in ("--help", "-h", "--version")
        if not wants_group_help and first is not None and first not in self.commands:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; an unknown option that other tools spell for one of ours (``--json``)
        is answered with ours (``--format json``), where click's close matches find none."""
        try:
            return super().invoke(ctx)
        except click.NoSuchOption as exc:
            ours = SPELLED_ELSEWHERE.get(exc.option_name)
            if ours is None or exc.possibilities:
                raise
            raise click.NoSuchOption(exc.option_name, f"No such option {exc.option_name!r}. Did you mean {ours}?",
                                     ctx=exc.ctx) from None

    def format_commands(self, ctx: click.Context, formatter: HelpFormatter) -> None:
        """The "Commands" section from :data:`SUBCOMMANDS`' summaries, shortened as click shortens a
        loaded command's help, without importing any command."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, SUBCOMMANDS[name].short_help(limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


#: Options other tools have, as memcalc spells them (click's close matches cannot find these).
SPELLED_ELSEWHERE = {"--json": "--format json", "--csv": "--format tsv", "--markdown": "--format github"}


@click.group(cls=ModelFirstGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memcalc")
def main() -> None:
    """GPU memory of a PyTorch training step, estimated on a CPU.

    \b
    memcalc MODEL [options]      estimate one step (MODEL: a zoo name, file.py:factory, ...)
                                 on a catalogue GPU (--gpu) or this machine's (--device)
    memcalc zoo                  list the model zoo
    memcalc fit MODEL --gpu G    the largest batch that fits a GPU (or --budget, --device)
    memcalc sweep MODEL -b 1,64  memory over batch sizes, optimizers, precisions (--plot)
    memcalc plan MODEL --gpus N --gpu G --global-batch B
                                 which mesh, micro-batch and checkpointing on N GPUs
    memcalc gpus                 list this machine's GPUs
    memcalc compare RUN.pickle MODEL [options]
                                 a real torch.cuda.memory._snapshot() beside the estimate

    Example: memcalc resnet50 --batch 64 --optim adam
    """
