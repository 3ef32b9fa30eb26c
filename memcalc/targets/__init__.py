"""The devices a step is estimated for, plugged into the engine as its step backend.

Two targets, side by side: :mod:`memcalc.targets.cuda`, what a CUDA GPU runs and allocates
(its autocast and kernel choices, library workspaces, the GPU catalogue), and
:mod:`memcalc.targets.cpu`, what this machine's CPU runs, the figure a real CPU step is
compared with. The CPU target extends the CUDA emulation's function mode with CUDA's kernel
choices off, so it imports the CUDA target and never the reverse. What both read lives here:
the backend that picks a target for a step (:mod:`~memcalc.targets.backend`), the software
stack and release facts (:mod:`~memcalc.targets.resolved_stack`, :mod:`~memcalc.targets.versions`),
autocast's op lists of both devices (:mod:`~memcalc.targets.autocast`) and the emulated
gradient scaler (:mod:`~memcalc.targets.grad_scaler`).
"""
