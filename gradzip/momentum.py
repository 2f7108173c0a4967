"""Momentum correction (Deep Gradient Compression, Lin et al. 2018): SGD momentum before compression.

With error feedback, a sparsifier sends each coordinate now and then; an optimizer
that applies momentum to the *averaged sparse* update then amplifies stale bursts,
and at momentum 0.9 such runs diverge or crawl. DGC moves the momentum in front of
the compressor, on every rank:

    g' = g + wd * p                       weight decay, as SGD adds it
    u  = m * u + g'                       local momentum (Nesterov: the sent value is g' + m * u)
    v  = v + u                            error feedback accumulates the momentum (the residual)
    send C(v); v -= sent                  as error feedback always does
    u[sent] = 0                           momentum factor masking, for sparse codecs

and the optimizer then takes a plain SGD step (no momentum, no weight decay) on the
average of what was sent. :meth:`Momentum.adopt` takes an ``torch.optim.SGD`` over:
it reads each parameter's momentum, Nesterov flag and weight decay, sets them to zero
in the optimizer, and moves any momentum buffer it already holds into ``u``. The
momentum buffers ``u`` are kept beside the residuals, in an error-feedback memory of
their own (``Engine.moments``, key ``name:momentum``): saved in ``state_dict()["momentum"]``,
rolled back with a non-finite step, averaged over the old ranks by ``checkpoint.reshard``. Masking applies to codecs that send some coordinates whole and the rest not at all
(``Codec.sparse``: TopK, RandomK). Threshold sends +-tau and keeps the remainder in the
residual, so it is not masked; for it and for dense codecs (quantizers, PowerSGD, plain
allreduce) the local momentum is kept as it is.

Optimizers other than SGD (AdamW, Adam, ...) are refused: with them, leave momentum
correction out and let error feedback work on the gradient (AdamW keeps its moments).
"""
from __future__ import annotations

import torch

import gradzip.args as args

__all__ = ["Momentum", "momentum_key"]


def momentum_key(name: str) -> str:
    return f"{name}:momentum"


class Momentum:
    """Per tensor name: ``(momentum, nesterov, weight_decay)``."""

    def __init__(self, hyper: dict[str, tuple[float, bool, float]]) -> None:
        self.hyper = dict(hyper)

    @classmethod
    def adopt(cls, optimizer: torch.optim.Optimizer, named_params) -> tuple["Momentum", dict]:
        """Take over ``optimizer``'s momentum and weight decay for ``named_params``
        (``[(name, parameter)]``): returns the :class:`Momentum` and the momentum buffers the
        optimizer held (``{name: tensor}``), and leaves the optimizer a plain SGD."""
        if type(optimizer) is not torch.optim.SGD:
            raise ValueError(
                f"momentum correction takes over torch.optim.SGD's momentum; {type(optimizer).__name__} keeps "
                "moments of its own: leave the optimizer argument out and let error feedback work on the gradient"
            )
        names = {id(p): n for n, p in named_params}
        hyper, buffers = {}, {}
        for group in optimizer.param_groups:
            if group.get("dampening", 0):
                raise ValueError(f"momentum correction needs dampening=0, got {group['dampening']}")
            if group.get("maximize", False):
                raise ValueError("momentum correction does not support maximize=True")
            m = args.number("momentum", group.get("momentum", 0.0), 0.0, 1.0, hi_open=True)
            wd = args.number("weight_decay", group.get("weight_decay", 0.0), 0.0)
            nesterov = bool(group.get("nesterov", False))
            for p in group["params"]:
                if id(p) not in names:
                    continue
                hyper[names[id(p)]] = (m, nesterov, wd)
                buf = optimizer.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    buffers[names[id(p)]] = buf.detach().clone()
                    optimizer.state[p].pop("momentum_buffer")
            group["momentum"], group["weight_decay"], group["nesterov"] = 0.0, 0.0, False
        missing = sorted(set(names.values()) - set(hyper))
        if missing:
            raise ValueError(f"the optimizer does not hold parameters {missing[:5]}: hand the hook the optimizer that steps them")
        return cls(hyper), buffers

    def describe(self) -> str:
        """A summary the ranks compare in the configuration check."""
        return repr(sorted({h for h in self.hyper.values()}))

    def apply(self, memory, names, grads, params=None) -> list:
        """The tensors to compress: per tensor ``u = m * u + g + wd * p`` (stored under
        ``momentum_key(name)`` in ``memory``), sent as ``u`` or, Nesterov, ``g' + m * u``."""
        out = []
        for i, (name, g) in enumerate(zip(names, grads)):
            m, nesterov, wd = self.hyper.get(name, (0.0, False, 0.0))
            if wd:
                if params is None:
                    raise ValueError("weight decay in the hook needs the parameters")
                g = g.add(params[i].detach(), alpha=wd)
            key = momentum_key(name)
            old = memory.residual(key)
            u = memory.buffer(key, g)
            if old is None:
                u.copy_(g)
            else:
                torch.add(g.to(u.dtype), old, alpha=m, out=u)
            memory.set(key, u)
            out.append(g.to(u.dtype) + m * u if nesterov else u)
        return out
