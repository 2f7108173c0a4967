"""Error feedback: per-tensor residual memory.

``compensate(name, g)`` returns ``g + residual`` in the accumulation dtype
(float32, or float64 for float64 gradients). After compression,
``update(name, compensated, sent)`` stores ``compensated - sent``. Nothing is
dropped: what was not sent stays in the residual.

Residuals are keyed by parameter *name*, not by DDP bucket, so they survive
DDP's bucket rebuild after the first iteration and can be saved and restored.
"""
from __future__ import annotations

import torch

from .wire import accum_dtype


class ErrorFeedback:
    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        acc = accum_dtype(grad.dtype)
        r = self.residuals.get(name)
        if r is None:
            return grad.to(acc, copy=True)
        if r.shape != grad.shape:
            raise ValueError(
                f"residual for {name!r} has shape {tuple(r.shape)}, gradient has {tuple(grad.shape)}"
            )
        if r.device != grad.device or r.dtype != acc:
            r = r.to(device=grad.device, dtype=acc)
        return grad.to(acc) + r

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        # A new tensor, not compensated.sub_(): a payload body may alias ``compensated``.
        self.residuals[name] = compensated - sent.reshape(compensated.shape)

    def residual(self, name: str) -> torch.Tensor | None:
        return self.residuals.get(name)

    def state_dict(self) -> dict:
        return {k: v.detach().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.residuals = {k: v.detach().clone() for k, v in sd.items()}
