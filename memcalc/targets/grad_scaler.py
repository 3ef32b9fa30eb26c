"""``torch.amp.GradScaler`` on meta: the device work of fp16 mixed precision without the
host synchronisation a symbolic step cannot do."""

from __future__ import annotations

import torch

__all__ = ("EmulatedGradScaler",)


class EmulatedGradScaler:
    """``torch.amp.GradScaler``'s device work without its host syncs: a 1-element scale, the
    scaled loss, ``_amp_foreach_non_finite_check_and_unscale_`` on the gradients (in place)
    and ``_amp_update_scale_``. The real ``step`` reads ``found_inf.item()``, which has no value
    on meta; a finite step is assumed."""

    def __init__(self, device: torch.device):
        self._scale = torch.full((1,), 65536.0, device=device)
        self._growth = torch.zeros((1,), dtype=torch.int32, device=device)
        self._found_inf = torch.zeros((1,), device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        inv_scale = self._scale.double().reciprocal().float()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, self._found_inf, inv_scale)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        torch._amp_update_scale_(self._scale, self._growth, self._found_inf, 2.0, 0.5, 2000)
