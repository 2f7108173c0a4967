"""1-bit Adam and 0/1 Adam: Adam optimizers whose ranks exchange 1-bit momenta.

    opt = gradzip.onebit.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
    for x, y in data:                    # a plain model (no DDP) on an initialised process group
        opt.zero_grad()
        loss_fn(model(x), y).backward()  # the gradients stay local
        opt.step()                       # the optimizer communicates: every rank steps alike

Both are optimizers of their own (``torch.optim.Optimizer``, so LR schedulers work) that do
their communication in ``step()``, as Horovod's ``DistributedOptimizer`` does: each rank's
gradients are its own, and every rank issues the same collectives in the same order. They
are front ends (:class:`gradzip.frontend.FrontEnd`: ``stats``, ``routes``, ``log_every``,
``state_dict``, ``save``/``load``) over two :class:`gradzip.engine.Engine`\\ s on one
communicator: a plain allreduce (``Identity()``) for the full-precision rounds, and
``compression`` (default ``TwoPhase(SignSGD())``) for the 1-bit rounds.

**The compressed all-reduce.** DeepSpeed's ``compressed_allreduce``
(``deepspeed/runtime/comm/nccl.py``) is a compressed reduce-scatter and all-gather with error
feedback on both sides: every rank adds its worker error to the tensor, sends the scaled sign
of each server chunk to the chunk's owner (all-to-all), each owner averages its chunk, adds
its server error and sends the scaled sign of that (all-gather). That is gradzip's
``TwoPhase(SignSGD())`` (:mod:`gradzip.protocols.twophase`): every rank owns one piece of
every tensor; the worker residual is the engine's residual of the tensor, the server
residual its owner residual (``name#j/N:owner``); with ``SignSGD(block=None)`` every piece
has one scale. Per rank about ``2(N-1)/N`` of ``n/8`` bytes a step for ``n`` elements, 1/32
of a float32 ring allreduce. Every rank decodes the same floats, so the averaged momentum,
and with it the parameters, are the same on every rank.

**OneBitAdam** (DeepSpeed's ``onebit/adam.py``; Tang et al. 2021). At step ``t = 1, 2, ...``
with the gradient ``g`` of this rank:

* warm-up, ``t <= freeze_step``: ``g`` is averaged in full precision and Adam runs on the
  average: ``m = b1 m + (1 - b1) avg(g)``, ``v = b2 v + (1 - b2) avg(g)^2``, and the AdamW step
  below. It is ``torch.optim.AdamW`` on the averaged gradient, operation for operation.
* after it: ``v`` is frozen; ``m = avg_1bit(b1 m + (1 - b1) g)``: every rank's local momentum
  goes through the compressed all-reduce (with error feedback) and its average replaces ``m``.
* the step, both stages: ``p <- p (1 - lr wd) - lr / c1 * m / (sqrt(v / c2) + eps)``.

**ZeroOneAdam** (0/1 Adam, DeepSpeed's ``onebit/zoadam.py``; Lu et al. 2022), at ``t = 1, 2, ...``:

* ``t <= var_freeze_step``: a step of the variance schedule (``t % var_interval == 0``)
  averages ``g`` in full precision and updates ``m`` and ``v``; any other step averages ``g``
  by the compressed all-reduce and updates ``m`` alone. Every ``var_update_scaler`` (kappa)
  variance updates the interval doubles (1 for the first kappa, then 2, 4, ...). The step as above.
* ``t > var_freeze_step``: ``v`` is frozen and the error-feedback memories are cleared once
  (they held gradient errors; now they hold update errors). Every rank steps on its own:
  ``m = b1 m + (1 - b1) g`` with its own ``g``, the step as above, ``lrs += lr``. At a sync step
  (``t % local_interval == 0``) the ranks average what they moved since the last sync, scaled
  back into momentum units: ``u = avg_1bit((p - a) * (sqrt(v / c2) + eps))`` (``a``: the
  parameters at the last sync, the same on every rank), then ``m = -u / lrs`` (the lr-weighted
  average momentum), ``p = a + u / (sqrt(v / c2) + eps)``, ``a = p``, ``lrs = 0``. The interval
  starts at 1 and doubles every ``local_step_scaler`` (alpha) steps of this stage, up to
  ``local_step_clipper`` (H). :meth:`ZeroOneAdam.schedule` lists what each step does.

**Bias correction** (``bias_correction=True``): ``c1`` and ``c2`` are what the moments' weights
sum to, as in Adam. ``c1 = 1 - b1**t``; 0/1 Adam sets ``c1 = 1`` from its first sync on (``m``
is then an average of corrected momenta). ``c2 = 1 - b2**k``, ``k`` the variance updates so
far, fixed once ``v`` is frozen (``k = freeze_step`` for 1-bit Adam). ``bias_correction=False``
is ``c1 = c2 = 1``: DeepSpeed's arithmetic (it takes the flag but never applies it).

**Differences from DeepSpeed**, all deliberate:

* No "initialization" call: DeepSpeed's first ``step()`` only allocates its buffers (and
  drops the gradient); here the first call is a real step, and 0/1 Adam's local stage begins
  at ``t = var_freeze_step + 1`` (DeepSpeed's one step later).
* The sign scale is ``mean|x|`` of the piece (SignSGD's, the scale that minimises
  ``||x - s sign(x)||``), not DeepSpeed's ``||x|| / sqrt(n)``; the worker side has one scale per
  server piece of each tensor (DeepSpeed: one for the whole tensor), the server side one per
  piece, as DeepSpeed's. No padding: pieces are ``n // N`` or ``n // N + 1`` elements.
* Weight decay is applied as AdamW does, ``p (1 - lr wd)``: DeepSpeed's ``p - lr (u + wd p)``
  up to rounding. As in DeepSpeed, 0/1 Adam's synced momentum includes the averaged decay term.
* 0/1 Adam keeps ``a`` (the parameters at the last sync) where DeepSpeed keeps ``u`` (their
  change since): the same memory, and the parameters after a sync are bit for bit the same on
  every rank (DeepSpeed's ``p - u`` drifts by rounding, rank by rank).
* **The mask is derived.** A coordinate whose variance is exactly 0 when the update is
  applied (its gradient was 0 in every variance update: a byte the corpus never holds, a
  pixel always 0) would step by ``lr · s / eps`` on a 1-bit momentum (the sign code has no 0,
  so it carries ``±s``, the piece's scale) and blow the model up. Its momentum (0/1 Adam's
  synced move too) is set to 0 instead: DeepSpeed's ``exp_avg_mask``, found from ``v`` rather
  than passed in. Where ``v`` is 0, Adam's own ``m`` is 0 too, so the full-precision steps
  are unchanged bit for bit.
* A checkpoint keeps the error-feedback residuals (DeepSpeed drops them on load): a resumed
  run continues bit for bit. No ``exp_avg_mask`` argument, no ``non_freeze`` parameter groups.

**Non-finite values** (``on_nonfinite="skip"``): a step whose average holds a NaN/Inf (any
rank's gradient had one) is skipped on every rank: parameters, moments and residuals stay as
they were and the step does not count (as ``GradScaler`` skips ``optimizer.step()``);
``"raise"`` raises ``FloatingPointError`` on every rank. A 0/1 Adam local step with a
non-finite gradient leaves that rank's parameters and momentum alone and counts.
``skipped_steps`` counts both.

A parameter without a gradient on a rank contributes zeros (its update goes on with its
moments); parameters that do not require a gradient when the optimizer is built are left
alone, the set being fixed from then on. Every rank must hold the same parameters at the
start (``check_parameters``: one small allreduce at the first step checks it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist

import gradzip.args as args

from .codecs.base import Codec
from .codecs.cast import Identity
from .codecs.quant import SignSGD
from .comm import Communicator, ring_allreduce_link
from .engine import Engine, all_finite, check_real, layout_of
from .frontend import FrontEnd
from .optim import _buckets
from .protocols.base import Protocol
from .protocols.twophase import TwoPhase
from .registry import register_frontend
from .stats import Stats, log_line, reach_the_user
from .sync import check_parameters_agree

__all__ = ["OneBitAdam", "ZeroOneAdam", "STATE_VERSION"]

STATE_VERSION = 1  # the "onebit" entry of the state dict
_NONFINITE = ("skip", "raise")


def default_compression() -> Protocol:
    """``TwoPhase(SignSGD())``: DeepSpeed's compressed all-reduce (module docstring)."""
    return TwoPhase(SignSGD())


def _hyper(group: dict, where: str = "") -> None:
    """``ValueError`` for a group's (or the defaults') lr, betas, eps or weight_decay out of range."""
    args.number(f"{where}lr", group["lr"], 0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}betas must be a pair (beta1, beta2) of numbers in [0, 1), got {betas!r}")
    for i, b in enumerate(betas):
        args.number(f"{where}betas[{i}]", b, 0.0, 1.0, hi_open=True)
    args.number(f"{where}eps", group["eps"], 0.0, lo_open=True)
    args.number(f"{where}weight_decay", group["weight_decay"], 0.0)


def _param_groups(params, defaults: dict) -> list[dict]:
    """The parameter groups as ``torch.optim.Optimizer`` takes them (lists, not iterators),
    after checking their hyperparameters, devices and parameters, before anything is built."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of parameter groups (dicts), got a tensor")
    groups = list(params)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out, seen, devices = [], set(), {}
    for gi, g in enumerate(groups):
        if not isinstance(g, dict):
            raise TypeError(f"parameter group {gi} must be a dict, got {type(g).__name__}")
        g = dict(g)
        ps = g.get("params")
        if isinstance(ps, torch.Tensor):
            ps = [ps]
        elif isinstance(ps, set) or ps is None:
            raise TypeError(f"parameter group {gi}'s params must be an ordered iterable of tensors")
        g["params"] = ps = list(ps)
        _hyper({**defaults, **g}, f"param group {gi}: " if len(groups) > 1 else "")
        for p in ps:
            t = p[1] if isinstance(p, tuple) and len(p) == 2 else p
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"parameter group {gi} holds a {type(t).__name__}, not a tensor")
            if id(t) in seen:
                raise ValueError("a parameter appears more than once in the parameter groups")
            seen.add(id(t))
            devices.setdefault(t.device, t)
        out.append(g)
    if len(devices) > 1:
        raise ValueError(
            f"the parameters lie on {len(devices)} devices ({', '.join(str(d) for d in devices)}): the optimizer's "
            "collectives run on one device; move the model to one device"
        )
    return out


def _plan_terms(cls, a: tuple, kw: dict, period) -> dict:
    """``plan_terms`` of a front end below from its spec's arguments (no parameters): the
    constructor's keywords checked as it checks them, ``period(arguments)`` steps a sync."""
    sig = inspect.signature(cls.__init__)
    try:
        bound = sig.bind(None, [], *a, **kw)
    except TypeError as e:
        raise ValueError(f"{cls.__name__}: {e}") from None
    bound.apply_defaults()
    v = bound.arguments
    for name in ("freeze_step", "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
        if name in v:
            args.integer(name, v[name], 1)
    compression = v["compression"]
    if compression is None:
        compression = default_compression()
    elif isinstance(compression, str):
        from .registry import parse

        compression = parse(compression)
    if not isinstance(compression, (Codec, Protocol)):
        raise ValueError(f"{cls.__name__}: compression must be a codec or protocol, got {compression!r}")
    return {"compression": compression, "period": period(v), "fragments": 1, "delay": 0, "error_feedback": True}


class _Bucket(NamedTuple):
    names: list[str]
    members: list[int]  # indices into the optimizer's trainable parameters
    spans: list[tuple[int, int]]  # each member's range in the bucket's flat average
    dtype: torch.dtype


class _OneBitOptimizer(FrontEnd, torch.optim.Optimizer):
    """What :class:`OneBitAdam` and :class:`ZeroOneAdam` share: the checks, the buckets, the two
    engines on one communicator, the averaging of one tensor per parameter, stats, logging
    and state."""

    #: Built from the parameters (an optimizer of its own), where ``LocalSGD`` wraps one: what
    #: ``gradzip bench`` reads to build it from a spec such as ``OneBitAdam(freeze_step=100)``.
    builds_optimizer = True
    _engine_key = "gradzip"  # the compressed engine's state (residuals); gz.checkpoint reads it there
    _own_keys = ("onebit",)

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        bias_correction: bool,
        compression: Codec | Protocol | str | None,
        process_group: dist.ProcessGroup | Communicator | None,
        bucket_mb: float,
        on_nonfinite: str,
        check_parameters: bool,
    ) -> None:
        _hyper(defaults)
        self.bias_correction = args.flag("bias_correction", bias_correction)
        bucket_mb = args.number("bucket_mb", bucket_mb, 0.0, lo_open=True)
        args.choice("on_nonfinite", on_nonfinite, _NONFINITE)
        args.flag("check_parameters", check_parameters)
        compression = default_compression() if compression is None else compression
        if isinstance(compression, str):
            from .registry import parse

            compression = parse(compression)
        if not isinstance(compression, (Codec, Protocol)):
            raise TypeError(f"compression must be a gradzip codec or protocol, got {type(compression).__name__}")
        groups = _param_groups(params, defaults)
        self._built = False
        torch.optim.Optimizer.__init__(self, groups, defaults)
        self._built = True

        # The trainable parameters in group order, named after torch's param_names or their place.
        self._slots: list[tuple[int, torch.Tensor, str]] = []
        for gi, g in enumerate(self.param_groups):
            names = g.get("param_names") or [f"param.{gi}.{i}" for i in range(len(g["params"]))]
            self._slots += [(gi, p, n) for p, n in zip(g["params"], names) if p.requires_grad]
        if not self._slots:
            raise ValueError("the optimizer holds no parameter that requires a gradient")
        named = [(n, p) for _, p, n in self._slots]
        check_real(named)
        if len({n for n, _ in named}) != len(named):
            raise ValueError("the parameters' names (param_names) are not unique")
        index = {id(p): i for i, (_, p, _) in enumerate(self._slots)}
        self._bucket_list: list[_Bucket] = []
        for ps, ns in _buckets(named, bucket_mb * 2**20):
            spans, pos = [], 0
            for p in ps:
                spans.append((pos, pos + p.numel()))
                pos += p.numel()
            self._bucket_list.append(_Bucket(ns, [index[id(p)] for p in ps], spans, ps[0].dtype))

        # One communicator (one order of collectives, one Stats) for both engines.
        comm = process_group if isinstance(process_group, Communicator) else Communicator(process_group)
        layout = layout_of(named)
        self.compression = compression
        self.bucket_mb = float(bucket_mb)
        self._full = Engine(
            Identity(), process_group=comm, error_feedback=False, on_nonfinite=on_nonfinite, layout=layout
        )
        self.engine = Engine(compression, process_group=comm, on_nonfinite=on_nonfinite, layout=layout)
        self._grad_bytes = sum(p.numel() * p.element_size() for _, p, _ in self._slots)
        self._step = 0  # steps counted (a skipped step is not)
        self.skipped_steps = 0
        self._check_parameters = check_parameters
        self._marks: dict[str, int] = {}  # stats intervals: the step each began at
        self._steps_base = 0
        self._log: tuple[int, Callable | None] | None = None

    # -- torch.optim.Optimizer -----------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", True):
            raise RuntimeError(f"{type(self).__name__} cannot take new parameter groups; pass every group at creation")
        super().add_param_group(param_group)

    @property
    def step_count(self) -> int:
        """The steps taken (``t`` of the module docstring; a skipped step does not count)."""
        return self._step

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step: the collectives of the module docstring, on every rank alike."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            grads = self._grads()
            for _, p, _ in self._slots:
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self._check_parameters:  # the first step, before its first collective
                self._check_parameters = False
                check_parameters_agree(self._agreeing(), comm=self.engine.comm, what=self._agree_what)
            if self._apply(self._step + 1, grads):
                self._step += 1
                if self._log is not None and self._step % self._log[0] == 0:
                    d = self._interval("log")
                    (self._log[1] or log_line)(self._step, d)
        return loss

    def _grads(self) -> list[torch.Tensor]:
        """This rank's gradients, zeros where a parameter has none; sparse ones refused, on
        this rank, before any collective."""
        out = []
        for _, p, name in self._slots:
            g = p.grad
            if g is None:
                g = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif g.layout != torch.strided:
                raise ValueError(
                    f"{type(self).__name__} does not support sparse gradients ({name!r} has a {g.layout} one); "
                    "use torch.optim.SparseAdam for sparse embeddings, or sparse=False"
                )
            out.append(g)
        return out

    _agree_what = "parameters"

    def _agreeing(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors every rank must hold alike now (the first step's check)."""
        return [(n, p.detach()) for _, p, n in self._slots]

    def _average(self, engine: Engine, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Average one tensor per trainable parameter over the ranks by ``engine``, bucket by
        bucket in order; views of the averages, or None when they hold a NaN/Inf (every rank
        sees the same averages, so every rank decides alike; the step is skipped)."""
        futures = []
        try:
            for b in self._bucket_list:
                futures.append(engine.reduce(b.names, [tensors[i] for i in b.members], out_dtype=b.dtype))
            engine.flush()
            flats = [f.wait() for f in futures]
        finally:
            engine.end_step()
        if not all_finite(flats):
            self.skipped_steps += 1
            return None
        out: list = [None] * len(tensors)
        for b, flat in zip(self._bucket_list, flats):
            for i, (lo, hi) in zip(b.members, b.spans):
                out[i] = flat[lo:hi].view(self._slots[i][1].shape)
        return out

    def _apply(self, t: int, grads: list[torch.Tensor]) -> bool:
        """Step ``t`` on ``grads``; whether it counts."""
        raise NotImplementedError

    def _hyper_of(self, gi: int) -> tuple[float, float, float, float, float]:
        g = self.param_groups[gi]
        b1, b2 = g["betas"]
        return float(g["lr"]), float(b1), float(b2), float(g["eps"]), float(g["weight_decay"])

    @staticmethod
    def _adam_step(p, m, v, denom, lr: float, wd: float, c1: float) -> None:
        """``p <- p (1 - lr wd) - lr / c1 * m / denom``, in torch's AdamW order of operations,
        after ``m`` is zeroed where ``v`` is 0 (module docstring: the derived mask)."""
        m.masked_fill_(v == 0, 0)
        if wd != 0:
            p.mul_(1 - lr * wd)
        p.addcdiv_(m, denom, value=-(lr / c1))

    @staticmethod
    def _denom(v, eps: float, c2: float) -> torch.Tensor:
        return (v.sqrt() / c2**0.5).add_(eps)

    # -- front-end surface ---------------------------------------------------------------
    def _engines(self) -> dict[str, Engine]:
        return {"full": self._full, "compressed": self.engine}

    def stats(self, reset: bool = False) -> dict:
        """Bytes and times counted at the collectives (:mod:`gradzip.stats`) of both engines:
        ``steps`` counts optimizer steps and ``syncs`` the steps that communicated; ``bytes_raw``
        and ``bytes_link_raw`` are what plain data-parallel Adam (a ring allreduce of every
        gradient every step) would have handed over and sent in those steps, so ``ratio`` is
        the link compression against it. ``reset=True``: the counts since the previous
        ``stats(reset=True)``, and a new interval."""
        return self._interval("reset" if reset else None)

    def _interval(self, mark: str | None) -> dict:
        counts = self.engine.stats_
        if mark is None:
            c, steps = counts.state_dict(), self._step
        else:
            c = counts.since(mark)
            steps = self._step - self._marks.get(mark, self._steps_base)
            self._marks[mark] = self._step
        syncs = c["steps"]
        c["steps"] = steps
        c["bytes_raw"] = self._grad_bytes * steps
        c["bytes_link_raw"] = ring_allreduce_link(self._grad_bytes, self.engine.comm.world_size) * steps
        d = Stats.derive(c)
        d["syncs"] = syncs
        return d

    def log_every(self, every: int | None, fn: Callable[[int, dict], None] | None = None) -> None:
        """Call ``fn(step, stats of the last every steps)`` every ``every`` steps (default: one line
        on the ``"gradzip"`` logger); ``None`` stops it."""
        if every is None:
            self._log = None
            return
        every = args.integer("every", every, 1)
        if fn is not None and not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if fn is None:
            reach_the_user()
        self._interval("log")  # the first interval starts now
        self._log = (every, fn)

    def __repr__(self) -> str:
        d = self.defaults
        shown = [f"lr={d['lr']!r}", f"betas={tuple(d['betas'])!r}", f"eps={d['eps']!r}"]
        if d["weight_decay"]:
            shown.append(f"weight_decay={d['weight_decay']!r}")
        shown += [f"{k}={v!r}" for k, v in self._config().items() if k != "bias_correction"]
        if not self.bias_correction:
            shown.append("bias_correction=False")
        shown.append(f"compression={self.compression!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    # -- state ---------------------------------------------------------------------------
    def _config(self) -> dict:
        """The schedule's settings: a state loads only where they are the same."""
        raise NotImplementedError

    def _schedule_state(self) -> dict:
        return {}

    def _load_schedule_state(self, mine: dict) -> None:
        pass

    def _wrapped_state_dict(self) -> dict:
        return torch.optim.Optimizer.state_dict(self)

    def _load_wrapped_state_dict(self, state_dict: dict) -> None:
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    def _own_state_dict(self) -> dict:
        """``{"onebit": ...}``: the version, the algorithm and its settings, the step count and
        the schedule's state. The moments (and 0/1 Adam's sync point) are the optimizer's own
        state (``"state"``), the residuals the engine's (``"gradzip"``)."""
        return {
            "onebit": {
                "version": STATE_VERSION,
                "algorithm": type(self).__name__,
                "config": self._config(),
                "step": self._step,
                "skipped_steps": self.skipped_steps,
                **self._schedule_state(),
            }
        }

    def _load_own_state_dict(self, state_dict: dict) -> dict:
        """Check ``"onebit"`` and the parameter groups' shape, then load ``"onebit"``: after the
        engine's state was checked, before it and the optimizer's state load."""
        sd = dict(state_dict)
        mine = sd.pop("onebit")
        me = type(self).__name__
        version = mine.get("version") if isinstance(mine, dict) else None
        if version != STATE_VERSION:
            raise ValueError(
                f"{me} state version {version!r} is not supported (expected {STATE_VERSION}): it was saved by another "
                "gradzip; resume with the gradzip that saved it, or start from the model alone"
            )
        if mine["algorithm"] != me:
            raise ValueError(
                f"this state was saved by {mine['algorithm']}, and this is {me}: their moments and schedules differ; "
                f"load it into a {mine['algorithm']}"
            )
        saved, now = dict(mine["config"]), self._config()
        for key in sorted(set(saved) | set(now)):
            if saved.get(key) != now.get(key):
                raise ValueError(
                    f"{me}'s {key} differs from the checkpoint's: saved {saved.get(key)!r}, now {now.get(key)!r} "
                    "(the schedule's state would not fit it); build it with the settings it was saved with"
                )
        groups = sd.get("param_groups")
        sizes = [len(g["params"]) for g in self.param_groups]
        if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != sizes:
            got = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else groups
            raise ValueError(f"the checkpoint's parameter groups hold {got} parameters, this optimizer's {sizes}")
        self._step = int(mine["step"])
        self.skipped_steps = int(mine["skipped_steps"])
        self._load_schedule_state(mine)
        self._steps_base, self._marks = self._step, {}  # stats intervals start at the resume
        return sd


@register_frontend
class OneBitAdam(_OneBitOptimizer):
    """1-bit Adam (DeepSpeed's ``OnebitAdam``): Adam on full-precision averaged gradients for
    ``freeze_step`` steps, then with the variance frozen and the momentum averaged by a 1-bit
    compressed all-reduce with error feedback (module docstring).

    Args:
        params: the parameters, or parameter groups (dicts; ``lr``, ``betas``, ``eps`` and
            ``weight_decay`` may differ per group), as for ``torch.optim.Adam``; named parameters
            (``model.named_parameters()``) name the residuals, else ``"param.{group}.{index}"``.
        lr: learning rate, a number >= 0.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, a number > 0.
        weight_decay: decoupled weight decay (AdamW's), a number >= 0.
        freeze_step: full-precision warm-up steps before the variance freezes, an integer >= 1
            (the variance is estimated in them; DeepSpeed's tutorial: 15-25% of the steps).
        bias_correction: Adam's bias correction (module docstring); False is DeepSpeed's arithmetic.
        compression: the compressed all-reduce (default ``TwoPhase(SignSGD())``); any gradzip
            codec or protocol, or its spec. Error feedback is on for biased methods.
        process_group: the group (default: the global one).
        bucket_mb: tensors per collective, in MiB (as ``DistributedOptimizer``'s buckets).
        on_nonfinite: ``"skip"`` or ``"raise"`` (module docstring).
        check_parameters: check at the first step that every rank holds the same parameters.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: int,
        bias_correction: bool = True,
        compression: Codec | Protocol | str | None = None,
        process_group: dist.ProcessGroup | Communicator | None = None,
        bucket_mb: float = 25.0,
        on_nonfinite: str = "skip",
        check_parameters: bool = True,
    ) -> None:
        self.freeze_step = args.integer("freeze_step", freeze_step, 1)
        super().__init__(
            params,
            {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
            bias_correction=bias_correction,
            compression=compression,
            process_group=process_group,
            bucket_mb=bucket_mb,
            on_nonfinite=on_nonfinite,
            check_parameters=check_parameters,
        )

    def _config(self) -> dict:
        return {"freeze_step": self.freeze_step, "bias_correction": self.bias_correction}

    @classmethod
    def plan_terms(cls, *a, **kw) -> dict:
        """What ``gradzip plan`` costs (the long run, after ``freeze_step``): every step one
        exchange of ``compression`` (1-bit momenta), with its error feedback."""
        return _plan_terms(cls, a, kw, period=lambda v: 1)

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen (the next step sends 1-bit momenta)."""
        return self._step >= self.freeze_step

    def _apply(self, t: int, grads: list[torch.Tensor]) -> bool:
        warm = t <= self.freeze_step
        if warm:
            avg = self._average(self._full, grads)
        else:
            local = []
            for (gi, p, _), g in zip(self._slots, grads):
                b1 = self._hyper_of(gi)[1]
                local.append(torch.lerp(self.state[p]["exp_avg"], g, 1 - b1))
            avg = self._average(self.engine, local)
        if avg is None:
            return False
        for (gi, p, _), a in zip(self._slots, avg):
            lr, b1, b2, eps, wd = self._hyper_of(gi)
            st = self.state[p]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            if warm:  # torch's AdamW, operation for operation
                m.lerp_(a, 1 - b1)
                v.mul_(b2).addcmul_(a, a, value=1 - b2)
            else:
                m.copy_(a)
            c1 = 1 - b1**t if self.bias_correction else 1.0
            c2 = 1 - b2 ** min(t, self.freeze_step) if self.bias_correction else 1.0
            self._adam_step(p, m, v, self._denom(v, eps, c2), lr, wd, c1)
        return True


class _ZeroOneSchedule:
    """0/1 Adam's two interval policies (module docstring), as DeepSpeed's ``zoadam.py`` keeps them."""

    def __init__(self, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int, local_step_clipper: int):
        self.var_freeze_step = var_freeze_step
        self.kappa, self.alpha, self.clipper = var_update_scaler, local_step_scaler, local_step_clipper
        self.var_interval, self.var_counter = 1, 0
        self.local_interval, self.local_counter = 1, 0

    def kind(self, t: int) -> str:
        """What step ``t`` does: ``"full"`` (full-precision gradient, variance update),
        ``"onebit"`` (1-bit gradient), ``"sync"`` (local step, then 1-bit sync), ``"local"``."""
        if t <= self.var_freeze_step:
            return "full" if t % self.var_interval == 0 else "onebit"
        return "sync" if t % self.local_interval == 0 else "local"

    def advance(self, kind: str) -> None:
        """Count a step of ``kind``."""
        if kind == "full":
            self.var_counter += 1
            if self.var_counter == self.kappa:
                self.var_counter, self.var_interval = 0, 2 * self.var_interval
        elif kind in ("sync", "local"):
            self.local_counter += 1
            if self.local_counter == self.alpha:
                self.local_counter = 0
                self.local_interval = min(self.clipper, 2 * self.local_interval)

    def state_dict(self) -> dict:
        keys = ("var_interval", "var_counter", "local_interval", "local_counter")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            setattr(self, k, int(v))


@register_frontend
class ZeroOneAdam(_OneBitOptimizer):
    """0/1 Adam (DeepSpeed's ``ZeroOneAdam``): 1-bit gradients between variance updates at
    exponentially growing intervals, then local steps synchronised by a 1-bit average of the
    lr-weighted update at exponentially growing intervals (module docstring).

    Args:
        params, lr, betas, eps, weight_decay, bias_correction, compression, process_group,
        bucket_mb, on_nonfinite, check_parameters: as :class:`OneBitAdam`'s.
        var_freeze_step: the last step that may update the variance (DeepSpeed: usually the end of
            the learning-rate warm-up), an integer >= 1.
        var_update_scaler: kappa, variance updates per interval before the interval doubles, >= 1.
        local_step_scaler: alpha, local-stage steps per interval before the sync interval
            doubles, >= 1 (DeepSpeed's default 32678; its tutorial uses 1000).
        local_step_clipper: H, the largest sync interval, >= 1.
    """

    _agree_what = "parameters at the last sync"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        var_freeze_step: int,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        bias_correction: bool = True,
        compression: Codec | Protocol | str | None = None,
        process_group: dist.ProcessGroup | Communicator | None = None,
        bucket_mb: float = 25.0,
        on_nonfinite: str = "skip",
        check_parameters: bool = True,
    ) -> None:
        self._sched = _ZeroOneSchedule(
            args.integer("var_freeze_step", var_freeze_step, 1),
            args.integer("var_update_scaler", var_update_scaler, 1),
            args.integer("local_step_scaler", local_step_scaler, 1),
            args.integer("local_step_clipper", local_step_clipper, 1),
        )
        self._var_updates = 0  # k: the variance updates so far
        self._local = False  # in the local stage (the sync point "anchor" kept, errors cleared)
        self._synced = False  # m holds an average of bias-corrected momenta (c1 = 1 from then on)
        super().__init__(
            params,
            {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
            bias_correction=bias_correction,
            compression=compression,
            process_group=process_group,
            bucket_mb=bucket_mb,
            on_nonfinite=on_nonfinite,
            check_parameters=check_parameters,
        )
        self._lrs = [0.0] * len(self.param_groups)  # sum of lr over the local steps since the last sync

    @staticmethod
    def schedule(
        steps: int,
        *,
        var_freeze_step: int,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
    ) -> list[str]:
        """What steps ``1..steps`` do (:meth:`_ZeroOneSchedule.kind`): ``"full"``, ``"onebit"``,
        ``"sync"`` or ``"local"``; the same on every rank, from the settings alone."""
        s = _ZeroOneSchedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
        out = []
        for t in range(1, args.integer("steps", steps, 0) + 1):
            out.append(s.kind(t))
            s.advance(out[-1])
        return out

    @classmethod
    def plan_terms(cls, *a, **kw) -> dict:
        """What ``gradzip plan`` costs (the long run): one exchange of ``compression`` every
        ``local_step_clipper`` steps, the interval the local stage grows to (it doubles every
        ``local_step_scaler`` steps after ``var_freeze_step``)."""
        return _plan_terms(cls, a, kw, period=lambda v: v["local_step_clipper"])

    def _config(self) -> dict:
        s = self._sched
        return {
            "var_freeze_step": s.var_freeze_step,
            "var_update_scaler": s.kappa,
            "local_step_scaler": s.alpha,
            "local_step_clipper": s.clipper,
            "bias_correction": self.bias_correction,
        }

    def _agreeing(self) -> list[tuple[str, torch.Tensor]]:
        if not self._local:
            return super()._agreeing()
        return [(n, self.state[p]["anchor"]) for _, p, n in self._slots]

    def _c(self, t: int, b1: float, b2: float) -> tuple[float, float]:
        if not self.bias_correction:
            return 1.0, 1.0
        return (1.0 if self._synced else 1 - b1**t), 1 - b2**self._var_updates

    def _apply(self, t: int, grads: list[torch.Tensor]) -> bool:
        kind = self._sched.kind(t)
        if kind in ("full", "onebit"):
            avg = self._average(self._full if kind == "full" else self.engine, grads)
            if avg is None:
                return False
            if kind == "full":
                self._var_updates += 1
            for (gi, p, _), a in zip(self._slots, avg):
                lr, b1, b2, eps, wd = self._hyper_of(gi)
                st = self.state[p]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.lerp_(a, 1 - b1)
                if kind == "full":
                    v.mul_(b2).addcmul_(a, a, value=1 - b2)
                c1, c2 = self._c(t, b1, b2)
                self._adam_step(p, m, v, self._denom(v, eps, c2), lr, wd, c1)
            self._sched.advance(kind)
            return True
        if not self._local:  # the local stage begins: v frozen, errors now of updates, not gradients
            if self.engine.memory is not None:
                self.engine.memory.load_state_dict({})
            for _, p, _ in self._slots:
                self.state[p]["anchor"] = p.detach().clone(memory_format=torch.preserve_format)
            self._local = True
        for gi, g in enumerate(self.param_groups):
            self._lrs[gi] += float(g["lr"])
        if all_finite(grads):
            for (gi, p, _), g in zip(self._slots, grads):
                lr, b1, b2, eps, wd = self._hyper_of(gi)
                m, v = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                c1, c2 = self._c(t, b1, b2)
                self._adam_step(p, m, v, self._denom(v, eps, c2), lr, wd, c1)
        else:  # this rank alone: its move waits; the step counts on every rank
            self.skipped_steps += 1
        if kind == "sync":
            self._sync(t)
        self._sched.advance(kind)
        return True

    def _sync(self, t: int) -> None:
        """Average the moves since the last sync in momentum units (1-bit), and restart from it."""
        denoms, moved = [], []
        for gi, p, _ in self._slots:
            _, b1, b2, eps, _ = self._hyper_of(gi)
            st = self.state[p]
            denoms.append(self._denom(st["exp_avg_sq"], eps, self._c(t, b1, b2)[1]))
            moved.append((p - st["anchor"]).mul_(denoms[-1]))
        avg = self._average(self.engine, moved)
        if avg is None:  # skipped on every rank: the moves go with the next sync
            return
        for (gi, p, _), a, denom in zip(self._slots, avg, denoms):
            st = self.state[p]
            a.masked_fill_(st["exp_avg_sq"] == 0, 0)  # the derived mask (module docstring)
            if self._lrs[gi] > 0:
                st["exp_avg"].copy_(a / -self._lrs[gi])
            p.copy_(st["anchor"] + a / denom)
            st["anchor"].copy_(p)
        self._lrs = [0.0] * len(self.param_groups)
        self._synced = True

    def _schedule_state(self) -> dict:
        return {
            "schedule": self._sched.state_dict(),
            "var_updates": self._var_updates,
            "local": self._local,
            "synced": self._synced,
            "lrs": list(self._lrs),
        }

    def _load_schedule_state(self, mine: dict) -> None:
        self._sched.load_state_dict(mine["schedule"])
        self._var_updates = int(mine["var_updates"])
        self._local, self._synced = bool(mine["local"]), bool(mine["synced"])
        self._lrs = [float(x) for x in mine["lrs"]]

    @property
    def local_stage(self) -> bool:
        """Whether the local stage (variance frozen, periodic syncs) has begun."""
        return self._local
