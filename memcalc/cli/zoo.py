"""``memcalc zoo``: the model zoo's list, read from :mod:`memcalc.cli.zoo_listing`, the zoo's
entries written down as plain data, so that listing them imports neither torch nor a model
definition (a list answers at once; the zoo itself is imported to build a model)."""

from __future__ import annotations

import importlib.util
from typing import Any, NamedTuple

import click
from tabulate import tabulate

from memcalc.cli.options import handle_errors, output_options
from memcalc.cli.zoo_listing import ZOO_LISTING
from memcalc.report.formats import render_json

__all__ = ("ZooListed", "listed_in_registry", "listing_source", "zoo_command", "zoo_row")


class ZooListed(NamedTuple):
    """What ``memcalc zoo`` shows of one zoo entry (:class:`models_zoo.ZooEntry`), as plain data."""

    name: str
    family: str
    reference_parameters: int | None  # the plain-torch definition's
    hf_parameters: int | None  # transformers' model's; None: no released config
    default_input: str
    hf_architecture: str | None  # the class the released config's ``architectures`` names
    plain_torch: bool  # the zoo defines the model in plain torch (else transformers' model only)


@click.command("zoo")
@output_options
@handle_errors
def zoo_command(fmt: str, units: str, debug: bool) -> None:
    """List the model zoo: name, family, parameters, default input, and the model the name builds
    (transformers' class from the released config, or memcalc's plain-torch definition)."""
    transformers = importlib.util.find_spec("transformers") is not None
    rows = [zoo_row(ZooListed(*listed), transformers_installed=transformers) for listed in ZOO_LISTING]
    if fmt == "json":
        click.echo(render_json(rows))
        return
    table = [[r["name"], r["family"], f"{r['parameters']:,}" if r["parameters"] else "-", r["default_input"],
              r["model"]] for r in rows]
    click.echo(tabulate(table, headers=["name", "family", "parameters", "default input", "model"], tablefmt=fmt,
                        colalign=("left", "left", "right", "left", "left"), disable_numparse=True))


def zoo_row(listed: ZooListed, *, transformers_installed: bool) -> dict[str, Any]:
    """One entry of ``memcalc zoo``: the parameters of the model its name builds here, which is
    transformers' where the entry has a released config and transformers is installed
    (:func:`memcalc.sources.resolve.builds_transformers`, which tests/test_startup.py holds this to),
    or where the zoo has no plain-torch definition of it."""
    if listed.hf_architecture is not None and (transformers_installed or not listed.plain_torch):
        return {"name": listed.name, "family": listed.family, "parameters": listed.hf_parameters,
                "default_input": listed.default_input, "model": f"transformers {listed.hf_architecture}"}
    return {"name": listed.name, "family": listed.family, "parameters": listed.reference_parameters,
            "default_input": listed.default_input, "model": "plain torch"}


def listed_in_registry() -> list[ZooListed]:
    """The listing as the zoo's registry gives it today (imports torch and every model definition):
    what :data:`~memcalc.cli.zoo_listing.ZOO_LISTING` must equal."""
    import models_zoo  # deferred: the point of the written listing is not to import it

    return [ZooListed(e.name, e.family, e.reference_parameters, e.hf_parameters, e.default_input_text,
                      None if e.hf is None else e.hf.architecture, e.builder is not None)
            for e in models_zoo.entries()]


def listing_source() -> str:
    """The text of memcalc/cli/zoo_listing.py, from the registry (scripts/write_zoo_listing.py writes it)."""
    rows = "".join(f"    {tuple(listed)!r},\n" for listed in listed_in_registry())
    return ('"""The model zoo\'s entries as plain data, for ``memcalc zoo`` (:class:`memcalc.cli.zoo.ZooListed`\n'
            "fields, in registration order). Written by scripts/write_zoo_listing.py from models_zoo\'s registry:\n"
            'do not edit; tests/test_startup.py checks it against the registry."""\n\n'
            "# ruff: noqa: E501  (one row per entry, as long as its names)\n\n"
            "from __future__ import annotations\n\n"
            '__all__ = ("ZOO_LISTING",)\n\n'
            "ZOO_LISTING: tuple[tuple[str, str, int | None, int | None, str, str | None, bool], ...] = (\n"
            f"{rows})\n")
