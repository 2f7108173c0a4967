"""Plain references the tests check gradzip against."""

from __future__ import annotations

import torch


def accum(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class RefMemory:
    """Error feedback written the naive way: ``c = g + r``, then ``r = c - sent``."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def residual(self, name: str):
        return self.residuals.get(name)

    def compensate(self, name: str, g: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(name)
        return g.to(accum(g.dtype), copy=True) if r is None else g.to(accum(g.dtype)) + r

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        self.residuals[name] = compensated - sent.reshape(compensated.shape)
