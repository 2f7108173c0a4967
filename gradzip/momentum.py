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

**Both of Adam's moments** (``precondition=True``): a codec that sends one magnitude per block
(``SignSGD``, and ``TwoPhase`` re-signing the sum) hands Adam a gradient whose coordinates all
have the size of the block's mean. Adam then divides each coordinate by the root of its own
second moment, so a coordinate whose gradient was small moves by a large fraction of ``lr``
every step (``benchmarks/adam_steps.py`` measures this). With ``precondition=True`` the hook
also keeps Adam's second moment per rank, from the rank's own gradient, and compresses Adam's
step rather than its first moment (worker-side Adam, as in QAdam, Chen et al. 2021)::

    v = beta2 * v + (1 - beta2) * g * g
    send C(u / (1 - beta1^t) / (sqrt(v / (1 - beta2^t)) + eps) + r)     (r: the residual)

so every coordinate reaches the codec in units of its own scale. The optimizer then applies
the average of what was sent as it is: ``p -= lr * step`` after AdamW's decoupled decay
``p *= 1 - lr * weight_decay`` (Adam's L2 term is added to the gradient in the hook). The hook
does this through the optimizer's step pre- and post-hooks, so the user's ``optimizer.step()``
and LR schedulers work unchanged; the optimizer allocates no state of its own. What differs
from AdamW: the second moment comes from each rank's gradient, not from the average, so it
also holds the rank's sampling noise and steps are somewhat shorter where gradients are noisy.
``amsgrad``, ``maximize`` and a closure are refused. The hook hands the optimizer steps, not
gradients: scaling ``p.grad`` between backward and ``step()`` (``clip_grad_norm_``,
``GradScaler.unscale_``) would scale the step, so use ``register_hook(clip=)`` and bf16;
``step()`` checks on the first steps and now and then that ``p.grad`` is what the engine
averaged, and raises ``ValueError`` if not (:class:`_StepTakeover`).

**The sign of the average** (``update="sign"``): the hook keeps the optimizer's first moment
per rank as momentum correction does (SGD's momentum, Adam's ``beta1``; with ``beta1 = 0`` the
gradient itself) and the codec sends it with error feedback; the optimizer's step is replaced
by ``p -= lr * sign(average)`` after its decoupled weight decay (Adam's L2 term and SGD's
weight decay are added to the gradient in the hook). This is signum on the average of what
was sent (Bernstein et al. 2018), the update DeMo applies to its DCT-domain top-k (Peng et al.
2024): every parameter moves by ``lr`` each step, whatever the codec left in the residual, so
a sparse or low-rank average does not leave Adam's per-coordinate normalization facing
bursts. The optimizer keeps no state for those parameters. With ``lr_weighted=True`` each
step's gradient enters the momentum times the learning rate of that step (``u = m * u + lr * g``,
Adam's ``u = m * u + (1 - m) * lr * g``), as DeMo's reference code accumulates its momentum
(``delta = beta * delta + lr * g``): under a schedule the momentum then weighs each gradient by
its step's rate. Without a schedule the two are the same up to a factor, which the sign drops.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch

import gradzip.args as args

__all__ = ["Momentum", "momentum_key", "variance_key", "count_key", "TAKEN", "taken"]


def momentum_key(name: str) -> str:
    return f"{name}:momentum"


def variance_key(name: str) -> str:
    """Adam's second moment, per rank (``precondition=True``)."""
    return f"{name}:variance"


def count_key(name: str) -> str:
    """Adam's step count for bias correction (``precondition=True``): a float64 tensor of one element."""
    return f"{name}:adam_step"


_ADAMS = (torch.optim.Adam, torch.optim.AdamW)
#: ``update=``: the optimizer steps on the average, or the hook applies ``lr * sign(average)``.
UPDATES = ("optimizer", "sign")
#: The key :meth:`Momentum.adopt` sets in each param group it takes over. It travels with the
#: optimizer's ``state_dict``, so an optimizer loaded from a run whose momentum gradzip held says so
#: (:func:`taken`): its momentum is then 0 and the run's momentum lives in gradzip's own state.
TAKEN = "gradzip_momentum_taken"


def taken(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s momentum is gradzip's (:data:`TAKEN`): taken over by a hook of this
    process, or loaded from the ``state_dict`` of an optimizer that was."""
    return any(g.get(TAKEN, False) for g in optimizer.param_groups)


class Hyper(NamedTuple):
    """One tensor's settings. ``ema``: Adam's first moment ``u = m * u + (1 - m) * g`` rather
    than SGD's ``u = m * u + g``; ``beta2`` (None: off): Adam's second moment kept in the hook
    and the step sent (``precondition=True``), with ``eps``."""

    momentum: float
    nesterov: bool = False
    weight_decay: float = 0.0
    ema: bool = False
    beta2: float | None = None
    eps: float = 0.0


class Momentum:
    """Per tensor name, its :class:`Hyper`."""

    def __init__(self, hyper: dict[str, Hyper | tuple]) -> None:
        self.hyper = {k: Hyper(*v) for k, v in hyper.items()}
        self.takeover: _StepTakeover | None = None  # precondition=True: the optimizer's step hooks
        #: ``lr_weighted=True`` (set by :meth:`adopt`): each tensor's param group, whose ``lr`` scales the gradient
        self.lr_groups: dict = {}

    @staticmethod
    def adoptable(optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`adopt` takes ``optimizer`` over and it has a momentum to take: a
        ``torch.optim.SGD`` with momentum, or an ``Adam``/``AdamW`` with ``beta1 > 0``."""
        if type(optimizer) is torch.optim.SGD:
            return any(g.get("momentum", 0.0) for g in optimizer.param_groups)
        return type(optimizer) in _ADAMS and any(g["betas"][0] for g in optimizer.param_groups)

    @classmethod
    def adopt(
        cls,
        optimizer: torch.optim.Optimizer,
        named_params,
        *,
        precondition: bool = False,
        update: str = "optimizer",
        lr_weighted: bool = False,
    ) -> tuple[Momentum, dict]:
        """Take over ``optimizer``'s momentum and weight decay for ``named_params``
        (``[(name, parameter)]``): returns the :class:`Momentum` and the buffers the optimizer
        held (``{key: tensor}``, keys of :func:`momentum_key` and, with ``precondition``,
        :func:`variance_key` and :func:`count_key`), and leaves the optimizer a plain SGD.
        ``precondition``: an Adam's second moment too (see the module docstring).
        ``update="sign"``: the optimizer's step becomes ``p -= lr * sign(average)`` after its
        decoupled weight decay (signum on the average of what was sent; see the module
        docstring); ``"optimizer"`` (default): the optimizer steps on the average.
        ``lr_weighted`` (``update="sign"`` only): the gradient enters the momentum times the
        group's learning rate at that step (DeMo's ``delta = beta * delta + lr * g``)."""
        args.flag("precondition", precondition)
        args.flag("lr_weighted", lr_weighted)
        update = args.choice("update", update, UPDATES)
        if lr_weighted and update != "sign":
            raise ValueError(
                f"lr_weighted=True weighs the momentum of update='sign' by the learning rate; got update={update!r}"
            )
        out, buffers = cls._adopt(optimizer, named_params, precondition, update)
        if lr_weighted:
            names = {id(p): n for n, p in named_params}
            out.lr_groups = {names[id(p)]: g for g in optimizer.param_groups for p in g["params"] if id(p) in names}
        return out, buffers

    @classmethod
    def _adopt(cls, optimizer, named_params, precondition: bool, update: str) -> tuple[Momentum, dict]:
        if precondition and type(optimizer) not in _ADAMS:
            raise ValueError(
                f"precondition=True takes over the second moment of torch.optim.Adam or AdamW; "
                f"{type(optimizer).__name__} has none"
            )
        if precondition and update == "sign":
            raise ValueError(
                "precondition=True sends Adam's step; update='sign' takes the sign of the average: give one"
            )
        if type(optimizer) in _ADAMS:
            return cls._adopt_adam(optimizer, named_params, precondition, update == "sign")
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
                hyper[names[id(p)]] = Hyper(m, nesterov, wd, False)
                buf = optimizer.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    buffers[momentum_key(names[id(p)])] = buf.detach().clone()
                    optimizer.state[p].pop("momentum_buffer")
            group["momentum"], group["weight_decay"], group["nesterov"] = 0.0, 0.0, False
            group[TAKEN] = True
        missing = sorted(set(names.values()) - set(hyper))
        if missing:
            raise ValueError(
                f"the optimizer does not hold parameters {missing[:5]}: hand the hook the optimizer that steps them"
            )
        out = cls(hyper)
        if update == "sign":
            out.takeover = _StepTakeover(optimizer, [p for g in optimizer.param_groups for p in g["params"]], sign=True)
        return out, buffers

    @classmethod
    def _adopt_adam(cls, optimizer, named_params, precondition: bool, sign: bool = False) -> tuple[Momentum, dict]:
        """Adam/AdamW: take beta1 (and ``exp_avg``) over; the optimizer keeps beta2, eps and weight
        decay. ``precondition``: take beta2, eps, ``exp_avg_sq`` and Adam's L2 weight decay over
        too, and make the optimizer's step a plain one (:class:`_StepTakeover`). Every group is
        checked before anything changes."""
        names = {id(p): n for n, p in named_params}
        checked = []
        for group in optimizer.param_groups:
            if group.get("maximize", False):
                raise ValueError("momentum correction does not support maximize=True")
            if precondition and group.get("amsgrad", False):
                raise ValueError("precondition=True does not support amsgrad=True")
            b1, b2 = group["betas"]
            if isinstance(b1, torch.Tensor) or isinstance(b2, torch.Tensor):
                raise ValueError("momentum correction needs betas as numbers, not tensors")
            m = args.number("beta1", b1, 0.0, 1.0, hi_open=True)
            if sign:  # Adam's L2 term goes into the hook's momentum; AdamW's decay stays with the step
                wd = 0.0 if _decoupled(optimizer, group) else args.number("weight_decay", group["weight_decay"], 0.0)
                checked.append((group, Hyper(m, False, wd, True)))
                continue
            if not precondition:
                checked.append((group, Hyper(m, False, 0.0, True)))
                continue
            b2 = args.number("beta2", b2, 0.0, 1.0, hi_open=True)
            eps = args.number("eps", group["eps"], 0.0)
            wd = (
                0.0
                if _decoupled(optimizer, group)
                else args.number("weight_decay", group.get("weight_decay", 0.0), 0.0)
            )
            checked.append((group, Hyper(m, False, wd, True, b2, eps)))
        taken = [p for group, _ in checked for p in group["params"] if id(p) in names]
        missing = sorted(set(names.values()) - {names[id(p)] for p in taken})
        if missing:
            raise ValueError(
                f"the optimizer does not hold parameters {missing[:5]}: hand the hook the optimizer that steps them"
            )
        hyper, buffers = {}, {}
        for group, h in checked:
            for p in group["params"]:
                if id(p) not in names:
                    continue
                name = names[id(p)]
                hyper[name] = h
                state = optimizer.state.get(p, {})
                if precondition:
                    if "exp_avg_sq" in state:
                        buffers[momentum_key(name)] = state["exp_avg"].detach().clone()
                        buffers[variance_key(name)] = state["exp_avg_sq"].detach().clone()
                        buffers[count_key(name)] = torch.tensor(
                            [float(state["step"])], dtype=torch.float64, device=state["exp_avg_sq"].device
                        )
                    optimizer.state.pop(p, None)
                elif state.get("exp_avg") is not None and h.momentum > 0:
                    buffers[momentum_key(name)] = state["exp_avg"].detach().clone()
            group["betas"] = (0.0, group["betas"][1])
            group[TAKEN] = True
            if (precondition or sign) and h.weight_decay:
                group["weight_decay"] = 0.0  # Adam's L2 term: added to the gradient in the hook
        out = cls(hyper)
        if precondition or sign:
            out.takeover = _StepTakeover(optimizer, taken, sign=sign)
        return out, buffers

    def mode(self) -> str:
        """What the buffers are, which a checkpoint must match: ``"precondition"`` (Adam's
        moments and step count), ``"sign"`` (``update="sign"``) or ``"momentum"``."""
        if any(h.beta2 is not None for h in self.hyper.values()):
            return "precondition"
        if self.takeover is not None and self.takeover.sign:
            return "sign"
        return "momentum"

    def describe(self) -> str:
        """A summary the ranks compare in the configuration check."""
        hypers = repr(sorted({repr(tuple(h)) for h in self.hyper.values()}))
        if self.takeover is not None and self.takeover.sign:
            return hypers + " update=sign" + (" lr_weighted" if self.lr_groups else "")
        return hypers

    def apply(self, memory, names, grads, params=None) -> list:
        """The tensors to compress: per tensor ``u = m * u + g + wd * p`` (Adam:
        ``u = m * u + (1 - m) * g``; stored under ``momentum_key(name)`` in ``memory``), sent
        as ``u`` or, Nesterov, ``g' + m * u``; with ``beta2`` (``precondition=True``), Adam's
        bias-corrected step ``u_hat / (sqrt(v_hat) + eps)`` (``v`` under ``variance_key(name)``,
        the step count under ``count_key(name)``)."""
        out = []
        for i, (name, g) in enumerate(zip(names, grads)):
            m, nesterov, wd, ema, b2, eps = self.hyper.get(name, Hyper(0.0))
            if wd:
                if params is None:
                    raise ValueError("weight decay in the hook needs the parameters")
                g = g.add(params[i].detach(), alpha=wd)
            group = self.lr_groups.get(name)
            if group is not None:  # lr_weighted=True: the step's rate, a number (no host sync)
                g = g * float(group["lr"])
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
            if b2 is not None:
                out.append(self._adam_step(memory, name, g, u, m, b2, eps))
            else:
                out.append(g.to(u.dtype) + m * u if nesterov else u)
        return out

    @staticmethod
    def _adam_step(memory, name, g, u, b1, b2, eps) -> torch.Tensor:
        """Update the second moment and the step count of ``name``; Adam's step from ``u``.
        The count stays a tensor on the gradient's device: no host sync per tensor."""
        vkey, tkey = variance_key(name), count_key(name)
        old_v, old_t = memory.residual(vkey), memory.residual(tkey)
        t = memory.buffer(tkey, torch.empty(1, dtype=torch.float64, device=u.device))
        if old_t is None:
            t.fill_(1.0)
        else:
            torch.add(old_t.to(t.device), 1.0, out=t)
        memory.set(tkey, t)
        g = g.to(u.dtype)
        v = memory.buffer(vkey, u)
        if old_v is None:
            torch.mul(g * g, 1.0 - b2, out=v)
        else:
            torch.addcmul(old_v * b2, g, g, value=1.0 - b2, out=v)
        memory.set(vkey, v)
        bc1 = (1.0 - torch.pow(b1, t)).to(u.dtype)
        bc2 = (1.0 - torch.pow(b2, t)).to(u.dtype)
        return (u / bc1).div_((v / bc2).sqrt_().add_(eps))


def _decoupled(optimizer, group) -> bool:
    """Whether ``group``'s weight decay is AdamW's (``p *= 1 - lr * wd``) rather than Adam's L2 term."""
    return type(optimizer) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))


class _StepTakeover:
    """The optimizer's step, made plain for the parameters whose Adam step the hook computes
    (``precondition=True``), or whose step is the sign of the average (``update="sign"``,
    ``sign``): before ``step()`` their gradients (the averages) are set aside, so the optimizer
    skips them, and after it ``p *= 1 - lr * weight_decay`` (AdamW's decoupled decay) and
    ``p -= lr * step`` (``sign``: ``lr * sign(step)``), with the group's ``lr`` at that moment;
    then the gradients are put back. ``remove()`` detaches the hooks.

    **Guard.** The steps must reach ``step()`` as the engine averaged them: ``GradScaler``'s
    ``unscale_`` or ``clip_grad_norm_`` in between would scale the step silently. On the first
    :data:`CHECKED_STEPS` steps and every :data:`CHECK_EVERY`-th after, the engine hands each
    call's average to :meth:`record` (its L1 norm, kept on the device) and ``step()`` compares
    it with ``p.grad``'s (one host sync), raising ``ValueError`` where they differ."""

    CHECKED_STEPS = 8
    CHECK_EVERY = 64

    def __init__(self, optimizer: torch.optim.Optimizer, params, *, sign: bool = False) -> None:
        self.sign = sign
        self.ids = {id(p) for p in params}
        self._aside: list = []
        self._steps = 0
        self._expected: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _due(self) -> bool:
        return self._steps < self.CHECKED_STEPS or self._steps % self.CHECK_EVERY == 0

    def record(self, out: torch.Tensor) -> None:
        """One call's averaged steps (the engine's output), on checked steps."""
        if not self._due():
            return
        l1 = out.detach().abs().sum(dtype=torch.float64)
        with self._lock:
            self._expected = l1 if self._expected is None else self._expected + l1.to(self._expected.device)

    def forget(self) -> None:
        """Drop what :meth:`record` kept: a non-finite step's averages, whose ``step()`` is
        skipped (``gz.skip_nonfinite``) or finds NaN, are not the next step's."""
        with self._lock:
            self._expected = None

    def _pre(self, optimizer, args_, kwargs) -> None:
        # torch passes step's own arguments, ``self`` first
        if any(a is not None for a in args_[1:]) or kwargs.get("closure") is not None:
            raise ValueError("the hook's own step (precondition=True, update='sign') does not support step(closure)")
        self._aside = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in self.ids and p.grad is not None:
                    self._aside.append((group, p, p.grad))
        with self._lock:
            expected, self._expected = self._expected, None
        due, self._steps = self._due(), self._steps + 1
        if due and expected is not None and self._aside:
            found = torch.stack(
                [g.detach().abs().sum(dtype=torch.float64).to(expected.device) for _, _, g in self._aside]
            ).sum()
            exp, got = float(expected), float(found)
            if math.isfinite(exp) and abs(got - exp) > 1e-4 * max(abs(exp), 1e-30):
                raise ValueError(
                    f"p.grad changed between the gradzip hook and optimizer.step() (L1 norm {exp:.6g} averaged, "
                    f"{got:.6g} found): with precondition=True or update='sign' p.grad holds the averaged steps or "
                    "momentum the hook applies, which GradScaler.unscale_ "
                    "or clip_grad_norm_ would rescale; clip with clip= in the hook and train in bfloat16 or float32"
                )
        for _, p, _ in self._aside:
            p.grad = None

    @torch.no_grad()
    def _post(self, optimizer, args_, kwargs) -> None:
        aside, self._aside = self._aside, []
        for group, p, step in aside:
            lr = float(group["lr"])
            wd = float(group.get("weight_decay", 0.0)) if _decoupled(optimizer, group) else 0.0
            if wd:
                p.mul_(1.0 - lr * wd)
            p.add_(step.sign().to(p.dtype) if self.sign else step.to(p.dtype), alpha=-lr)
            p.grad = step

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
