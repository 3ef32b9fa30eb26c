"""memcalc.engine.dynamo_deferred: a trace runs torch's ``_disable_dynamo`` functions without
importing Dynamo while it is not loaded, and leaves them as torch made them. Each check runs in a
fresh interpreter (pytest's own process may have imported Dynamo already)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


#: An inference estimate with Dynamo not loaded, then the same with it loaded first (torch's own
#: wrappers in place): the reports, and what is left on torch's functions after the first.
_SAME_REPORT = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
import memcalc
from memcalc.engine.dynamo_deferred import _wrapped_functions
def report():
    return memcalc.estimate("resnet18", batch_size=2, mode="inference", precision="amp-bf16").to_dict()
deferred = report()
loaded_by_trace = "torch._dynamo" in sys.modules
left = [fn.__qualname__ for fn, _ in _wrapped_functions() if getattr(fn, "__dynamo_disable", None) is not None]
import torch._dynamo
print(json.dumps({"loaded_by_trace": loaded_by_trace, "left": left, "same": report() == deferred,
                  "found": len(_wrapped_functions())}))
"""


@pytest.mark.slow  # a fresh interpreter that imports torch and traces twice: seconds
def test_an_inference_trace_imports_no_dynamo_and_reports_the_same():
    """The trace's meta kernels (torch's elementwise references) run without importing Dynamo;
    no stand-in is left on torch's functions afterwards; and the report is the one made with
    Dynamo loaded beforehand, which runs torch's own ``disable`` wrappers."""
    seen = _run(_SAME_REPORT)
    assert seen["loaded_by_trace"] is False, seen
    assert seen["left"] == [], seen
    assert seen["same"] is True, seen
    assert isinstance(seen["found"], int) and seen["found"] > 50, seen  # the references, the optimizer's methods


#: Dynamo imported inside the block: the stand-in hands over to torch's own wrapper, which stays.
_LOADED_INSIDE = """
import json, sys
import torch
from torch._refs import add
from memcalc.engine.dynamo_deferred import dynamo_deferred
aten = torch.ops.aten
x = torch.empty(2, 3, device="meta")
fn = next(f for f, _ in __import__("memcalc.engine.dynamo_deferred", fromlist=["_"])._wrapped_functions()
          if f.__qualname__ == "add" and f.__module__ == "torch._refs")
with dynamo_deferred():
    stand_in = getattr(fn, "__dynamo_disable", None)
    before = aten.add.Tensor(x, x).shape
    loaded_before = "torch._dynamo" in sys.modules
    import torch._dynamo
    after = aten.add.Tensor(x, x).shape
    handed_over = getattr(fn, "__dynamo_disable", None)
kept = getattr(fn, "__dynamo_disable", None)
print(json.dumps({"stand_in": stand_in is not None, "loaded_before": loaded_before,
                  "shapes": [list(before), list(after)],
                  "handed_over": handed_over is not stand_in and handed_over is not None, "kept": kept is handed_over}))
"""


@pytest.mark.slow  # a fresh interpreter that imports torch and Dynamo: seconds
def test_dynamo_loaded_inside_the_block_gets_torchs_own_wrapper():
    """Once Dynamo is imported inside the block, a stand-in builds torch's ``disable`` wrapper,
    puts it where torch keeps it and calls it; the block's exit leaves that wrapper in place."""
    seen = _run(_LOADED_INSIDE)
    assert seen == {"stand_in": True, "loaded_before": False, "shapes": [[2, 3], [2, 3]], "handed_over": True,
                    "kept": True}, seen
