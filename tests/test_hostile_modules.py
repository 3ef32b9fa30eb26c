"""Hostile models a user may bring (issue 32, items 8-11): each one either estimates within 1% of
a real CPU step (the profiler's allocation events, :func:`memcalc.measure.step.measure_cpu`), or
is refused with a :class:`MemcalcError` that names the module and what to do; and the user's
objects come back as they were."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import memcalc
from memcalc.core.errors import ModelSourceError

#: How far an estimate for the CPU may be from the real CPU step's peak.
TOLERANCE = 0.01


# ---- user_frame: a user's file under a folder named memcalc ---------------------------------
def test_a_users_file_under_a_folder_named_memcalc_keeps_its_line(tmp_path: Path) -> None:
    # git clone puts memcalc in a folder named memcalc; a user's model may live in one too:
    # the frame is the user's by the package its file is in, not by the words in its path
    folder = tmp_path / "memcalc"
    folder.mkdir()
    model = folder / "model.py"
    model.write_text(textwrap.dedent("""\
        from torch import nn

        def make():
            raise ValueError("no such layer")
        """))
    with pytest.raises(ModelSourceError) as caught:
        memcalc.estimate(f"{model}:make", batch_size=2, input_shape=(8,))
    assert f"(at {model}, line 4)" in str(caught.value)
