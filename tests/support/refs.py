"""Plain references the tests check gradzip against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gradzip.codecs.base import TensorContext

from .models import batch, make_model, params


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


def reference_run(steps, world, comp):
    """The algorithm re-enacted in one process: each rank's gradients with its own residuals."""
    ref = make_model()
    names = [n for n, _ in ref.named_parameters()]
    mems = [RefMemory() for _ in range(world)]
    stores = [{n: {} for n in names} for _ in range(world)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(steps):
        grads = []
        for r in range(world):
            ref.zero_grad(set_to_none=True)
            x, y = batch(s, r)
            F.cross_entropy(ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, (n, p) in enumerate(ref.named_parameters()):
            acc = torch.zeros(p.numel())
            for r in range(world):  # rank order, as the engine decodes
                c = mems[r].compensate(n, grads[r][i])
                pay = comp.compress(c, TensorContext(name=n, step=s, dtype=p.dtype, store=stores[r][n]))
                mems[r].update(n, c, comp.decompress(pay))
                comp.accumulate(pay, acc)
            p.grad = acc.div_(world).view_as(p)
        opt.step()
    return params(ref), names
