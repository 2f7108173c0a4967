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
rolled back with a non-finite step, averaged over the old ranks by ``checkpoint.reshard``.
Masking applies to codecs that declare ``Codec.sparse``: TopK and RandomK (a kept coordinate
is sent whole, or as ``+-mu`` with ``values="sign"``), and Threshold when built with
``mask=True``. Threshold sends +-tau and keeps the remainder in the residual, so by default it
is not masked; for it and for dense codecs (quantizers, PowerSGD, plain allreduce) the local
momentum is kept as it is.

``torch.optim.Adam`` and ``AdamW`` are taken over the same way for their first moment: the
hook keeps ``u = beta1 * u + (1 - beta1) * g`` per rank before compression (masked alike) and
sets the optimizer's ``beta1`` to 0, so that Adam's second moment and its step see the average
of what was sent; weight decay stays with the optimizer (AdamW's is decoupled; Adam's L2 term
is added to the averaged gradient). With error feedback alone, Adam normalizes each rarely
sent, accumulated coordinate into a full-size step; moving the first moment before the
compressor is DGC's idea applied to Adam's first moment. Other optimizers are refused: with
them, leave momentum correction out and let error feedback work on the gradient.
"""
from __future__ import annotations

import torch

import gradzip.args as args

__all__ = ["Momentum", "momentum_key"]


def momentum_key(name: str) -> str:
    return f"{name}:momentum"


_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


class Momentum:
    """Per tensor name: ``(momentum, nesterov, weight_decay, ema)``; ``ema``: Adam's first
    moment ``u = m * u + (1 - m) * g`` rather than SGD's ``u = m * u + g``."""

    def __init__(self, hyper: dict[str, tuple[float, bool, float]]) -> None:
        self.hyper = dict(hyper)

    @staticmethod
    def adoptable(optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`adopt` takes ``optimizer`` over and it has a momentum to take: a
        ``torch.optim.SGD`` with momentum, or an ``Adam``/``AdamW`` with ``beta1 > 0``."""
        if type(optimizer) is torch.optim.SGD:
            return any(g.get("momentum", 0.0) for g in optimizer.param_groups)
        return type(optimizer) in _ADAMS and any(g["betas"][0] for g in optimizer.param_groups)

    @classmethod
    def adopt(cls, optimizer: torch.optim.Optimizer, named_params) -> tuple["Momentum", dict]:
        """Take over ``optimizer``'s momentum and weight decay for ``named_params``
        (``[(name, parameter)]``): returns the :class:`Momentum` and the momentum buffers the
        optimizer held (``{name: tensor}``), and leaves the optimizer a plain SGD."""
        if type(optimizer) in _ADAMS:
            return cls._adopt_adam(optimizer, named_params)
        if type(optimizer) is not torch.optim.SGD:
            raise ValueError(
                f"momentum correction takes over the momentum of torch.optim.SGD, Adam or AdamW; "
                f"{type(optimizer).__name__} keeps moments of its own: leave the optimizer argument out and let "
                "error feedback work on the gradient"
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
                hyper[names[id(p)]] = (m, nesterov, wd, False)
                buf = optimizer.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    buffers[names[id(p)]] = buf.detach().clone()
                    optimizer.state[p].pop("momentum_buffer")
            group["momentum"], group["weight_decay"], group["nesterov"] = 0.0, 0.0, False
        missing = sorted(set(names.values()) - set(hyper))
        if missing:
            raise ValueError(f"the optimizer does not hold parameters {missing[:5]}: hand the hook the optimizer that steps them")
        return cls(hyper), buffers

    @classmethod
    def _adopt_adam(cls, optimizer, named_params) -> tuple["Momentum", dict]:
        """Adam/AdamW: take beta1 (and ``exp_avg``) over; the optimizer keeps beta2, eps and weight decay."""
        names = {id(p): n for n, p in named_params}
        hyper, buffers = {}, {}
        for group in optimizer.param_groups:
            if group.get("maximize", False):
                raise ValueError("momentum correction does not support maximize=True")
            b1, b2 = group["betas"]
            if isinstance(b1, torch.Tensor) or isinstance(b2, torch.Tensor):
                raise ValueError("momentum correction needs betas as numbers, not tensors")
            m = args.number("beta1", b1, 0.0, 1.0, hi_open=True)
            for p in group["params"]:
                if id(p) not in names:
                    continue
                hyper[names[id(p)]] = (m, False, 0.0, True)
                buf = optimizer.state.get(p, {}).get("exp_avg")
                if buf is not None and m > 0:
                    buffers[names[id(p)]] = buf.detach().clone()
            group["betas"] = (0.0, b2)
        missing = sorted(set(names.values()) - set(hyper))
        if missing:
            raise ValueError(f"the optimizer does not hold parameters {missing[:5]}: hand the hook the optimizer that steps them")
        return cls(hyper), buffers

    def describe(self) -> str:
        """A summary the ranks compare in the configuration check."""
        return repr(sorted({h for h in self.hyper.values()}))

    def apply(self, memory, names, grads, params=None) -> list:
        """The tensors to compress: per tensor ``u = m * u + g + wd * p`` (Adam:
        ``u = m * u + (1 - m) * g``; stored under ``momentum_key(name)`` in ``memory``), sent
        as ``u`` or, Nesterov, ``g' + m * u``."""
        out = []
        for i, (name, g) in enumerate(zip(names, grads)):
            m, nesterov, wd, ema = self.hyper.get(name, (0.0, False, 0.0, False))
            if wd:
                if params is None:
                    raise ValueError("weight decay in the hook needs the parameters")
                g = g.add(params[i].detach(), alpha=wd)
            key = momentum_key(name)
            old = memory.residual(key)
            u = memory.buffer(key, g)
            if ema:  # Adam's first moment, from zero as Adam's exp_avg starts
                if old is None:
                    torch.mul(g.to(u.dtype), 1.0 - m, out=u)
                else:
                    torch.add(old * m, g.to(u.dtype), alpha=1.0 - m, out=u)
            elif old is None:
                u.copy_(g)
            else:
                torch.add(g.to(u.dtype), old, alpha=m, out=u)
            memory.set(key, u)
            out.append(g.to(u.dtype) + m * u if nesterov else u)
        return out
