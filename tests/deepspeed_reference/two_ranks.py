"""What every reference script here shares: run ``main`` on two CPU ranks (``torch.distributed.run``
relaunches the script itself when ``RANK`` is unset) and write rank 0's record as one JSON line.
The scripts import it as a sibling (Python puts a script's folder first on ``sys.path``)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch


def write_record(out: dict[str, Any]) -> None:
    """Rank 0 writes ``out`` to the path given on the command line, as one line of JSON."""
    if torch.distributed.get_rank() == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as file:
            json.dump(out, file, indent=None)
            file.write("\n")


def run_on_two_ranks(script: str, main: Callable[[], None], port: str) -> None:
    """Relaunch ``script`` as two ranks (``PORT`` overrides ``port``), or, inside a rank, run ``main``
    in a temporary working folder."""
    if "RANK" not in os.environ:
        from torch.distributed.run import main as run

        run(["--nproc_per_node", "2", "--master_port", os.environ.get("PORT", port), script,
             os.path.abspath(sys.argv[1])])
    else:
        with tempfile.TemporaryDirectory():
            main()
