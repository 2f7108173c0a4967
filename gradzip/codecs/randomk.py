"""Random-k sparsification: :class:`RandomK` sends the values at positions every rank draws from a
shared seed (:func:`distinct_positions`), so only the values travel, summed by an allreduce."""

from __future__ import annotations

import torch

import gradzip.args as args
import gradzip.warmup as warmup

from ..wire import (
    Payload,
)
from .base import (
    Codec,
    TensorContext,
    check_input,
    tensor_seed,
)
from .topk import _k_of

__all__ = ["RandomK", "distinct_positions"]


def distinct_positions(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """``k`` distinct positions in ``[0, n)``, ascending, uniform among the ``k``-subsets, from the
    CPU generator ``g`` (the same on every rank for the same seed).

    The first ``k`` distinct values of a sequence of uniform draws (``torch.randint``, topped
    up while duplicates leave fewer than ``k``): by symmetry every ``k``-subset is as likely.
    ``O(k log k)``, where ``torch.randperm(n)[:k]`` costs ``O(n)`` (0.13 s for 16.8M positions
    on one core); above ``n / 2`` positions a permutation is as cheap and is used."""
    if 2 * k > n:
        return torch.randperm(n, generator=g)[:k].sort().values
    got = torch.empty(0, dtype=torch.int64)
    while got.numel() < k:
        need = k - got.numel()
        draws = torch.cat([got, torch.randint(n, (need + need * k // n + 64,), generator=g)])
        values, where = torch.sort(draws, stable=True)
        first = torch.ones_like(values, dtype=torch.bool)
        first[1:] = values[1:] != values[:-1]
        got = draws[where[first].sort().values]  # first occurrences, in draw order
    return got[:k].sort().values


class RandomK(Codec):
    """Send ``k = ceil(ratio * n)`` elements at indices drawn from a seed all ranks share.

    The indices depend only on ``(seed, step, tensor name)``, so every rank picks
    the same ones and only the k values travel: the payload is summable and goes
    through allreduce. Values travel in the input's dtype (float32 when error
    feedback has promoted a half-precision gradient), the same on every rank. Values are
    not rescaled by n/k; with error feedback (the default) the unsent mass waits in the
    residual.

    Args:
        ratio: the fraction of elements sent, in (0, 1], or a warm-up schedule.
        seed: the seed of the shared index draws; the same on every rank.
    """

    summable = True
    framable = False  # the indices are never sent: only an allreduce of the values carries it
    sparse = True

    def __init__(self, ratio: float = 0.01, *, seed: int = 0) -> None:
        self.ratio = warmup.check(args.ratio, "ratio", ratio)
        self.seed = args.integer("seed", seed)

    def indices(self, n: int, ctx: TensorContext, device) -> torch.Tensor:
        k = _k_of(warmup.at(self.ratio, ctx.step), n)
        if k == n:
            return torch.arange(n, device=device)
        g = torch.Generator(device="cpu").manual_seed(tensor_seed(self.seed, ctx.step, ctx.name))
        return distinct_positions(n, k, g).to(device)

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        ctx = ctx or TensorContext(dtype=x.dtype)
        v = x.reshape(-1)
        idx = self.indices(v.numel(), ctx, x.device)
        return Payload(body=v[idx], shape=x.shape, dtype=x.dtype, vdtype=x.dtype, local=idx)

    def decompress(self, payload: Payload) -> torch.Tensor:
        out = torch.zeros(payload.shape, dtype=payload.dtype, device=payload.body.device)
        out.view(-1)[payload.local] = payload.body.to(out.dtype)
        return out

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        flat = v.view(-1)
        flat[payload.local] -= payload.body.to(v.dtype)

    def sent_mask(self, payload: Payload, n: int) -> torch.Tensor:
        mask = torch.zeros(n, dtype=torch.bool, device=payload.body.device)
        mask[payload.local] = True
        return mask
