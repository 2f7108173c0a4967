"""Local SGD: each rank steps on its own and the models are averaged now and then.

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = LocalSGD(opt, model, period=schedules.PostLocal(warmup_steps=500, period=8),
                   compression=gradzip.TopK(0.01), overlap=True)
    for x, y in data:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.synchronize()          # drain the pipeline: every rank now holds the same model

What is averaged is the model *delta* since the last push (parameters and
floating-point buffers such as BatchNorm's running statistics; integer buffers
are left alone), through any gradzip codec or protocol with error feedback, by the
:class:`gradzip.engine.Engine` that the DDP hook and the DistributedOptimizer
use. The exact update rules (plain, ``overlap=True``, ``push_every`` /
``pull_every``) are in ``docs/local_sgd.md``; in short, each rank keeps

* ``G``, the global model: identical on every rank; it changes only by adding
  an averaged delta ``D`` when a push is *collected*;
* ``B``, the base: the local model minus the progress not yet pushed;
* ``x``, the local model (the module's own tensors).

At a **push** (``push_every``, default ``period``): ``d = x - B`` is handed to the
engine, ``B <- x``. Its average ``D`` is *collected* (``G <- G + D``) at once, or
with ``overlap=True`` at the next push, so that it travels while the next local
steps compute. At a **pull** (``pull_every``, default ``period``) after a collect:
``e = x - B; B <- G + d_inflight; x <- B + e``: the local model adopts the global
one and keeps its own unpushed progress ``e`` (and, with overlap, its own delta
still in flight, until the average that replaces it arrives). Pulls are local;
only pushes communicate.

With ``push_every == pull_every`` this is plain periodic averaging: at a sync,
``x <- G + D`` (bit for bit ``G``, since ``e = 0``), and with overlap
``x <- x + (D_prev - d_prev)``: the previous average replaces the own delta it
was computed from, one period late (staleness at most one period).

All ranks must start from the same parameters and buffers (same seed, or
broadcast them before wrapping).
"""
from __future__ import annotations

import torch

import gradzip.args as args

from .codecs.base import Codec
from .codecs.cast import Identity
from .engine import Engine, check_real, layout_of
from .protocols.base import Protocol
from .registry import register_frontend
from .schedules import as_schedule

__all__ = ["LocalSGD"]

STATE_VERSION = 1


@register_frontend
class LocalSGD(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` steps locally and averages ``model`` on a schedule.

    Args:
        optimizer: the local optimizer (any ``torch.optim.Optimizer``).
        model: the module whose parameters and floating-point buffers are averaged.
        period: when to synchronize: an integer in [1, inf) (``Constant``), a
            :mod:`gradzip.schedules` schedule, or any callable ``step -> bool``
            (``step`` counts local steps from 1). Every rank must give the same answers.
        compression: a gradzip codec or protocol for the deltas (default ``Identity()``).
        overlap: collect each average at the next push instead of at once, so it
            travels while the next local steps compute.
        process_group: the process group (default: the global one).
        push_every: when to push deltas (default: ``period``); same forms as ``period``.
        pull_every: when to pull the global model (default: ``period``); same forms.
        error_feedback: ``None`` turns it on for biased methods.

    ``param_groups`` and ``state`` are the wrapped optimizer's, so LR schedulers work.
    A NaN/Inf in any rank's delta raises ``FloatingPointError`` on every rank
    (averaging it would poison every model).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        period=1,
        compression: Codec | Protocol | None = None,
        overlap: bool = False,
        process_group=None,
        *,
        push_every=None,
        pull_every=None,
        error_feedback: bool | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        compression = Identity() if compression is None else compression
        if not isinstance(compression, (Codec, Protocol)):
            raise TypeError(f"compression must be a gradzip codec or protocol, got {type(compression).__name__}")
        args.flag("overlap", overlap)
        schedule = as_schedule("period", period)
        self.push_at = schedule if push_every is None else as_schedule("push_every", push_every)
        self.pull_at = schedule if pull_every is None else as_schedule("pull_every", pull_every)

        check_real((n, p) for n, p in model.named_parameters() if p.is_complex())
        entries = self._named_tensors(model)
        if not entries:
            raise ValueError("model has no floating-point parameters or buffers to average")
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.model = model
        self.overlap = overlap
        self.compression = compression
        self._names = [n for n, _ in entries]
        groups: dict = {}
        for i, (_, t) in enumerate(entries):
            groups.setdefault((t.device, t.dtype), []).append(i)
        self._groups = [(idx, dtype) for (_, dtype), idx in groups.items()]
        self.engine = Engine(
            compression,
            process_group=process_group,
            error_feedback=error_feedback,
            on_nonfinite="raise",
            layout=layout_of(entries),
        )
        with torch.no_grad():
            self._global = {n: t.detach().clone() for n, t in entries}
            self._base = {n: t.detach().clone() for n, t in entries}
        self._inflight: dict | None = None  # {"futures": [...], "delta": {n: d}, "avg": {n: D} once waited}
        self._pull_pending = False
        self._aligned = True  # every rank holds x == G and nothing is in flight
        self.local_step = 0

    # -- delegation --------------------------------------------------------------------
    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    def __repr__(self) -> str:
        return f"LocalSGD({self.optimizer!r}, push_at={self.push_at!r}, pull_at={self.pull_at!r}, overlap={self.overlap})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    # -- tensors -----------------------------------------------------------------------
    @staticmethod
    def _named_tensors(model: torch.nn.Module) -> list:
        out = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
        out += [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        return out

    def _tensors(self) -> list:
        """The model's current tensors, by name (a module may have replaced a buffer object)."""
        now = dict(self._named_tensors(self.model))
        try:
            return [now[n].detach() for n in self._names]
        except KeyError as e:
            raise RuntimeError(f"model tensor {e.args[0]!r} is gone since LocalSGD was created") from None

    @property
    def in_flight(self) -> bool:
        """Whether a pushed average has not been collected yet (``overlap=True``)."""
        return self._inflight is not None

    # -- the step ----------------------------------------------------------------------
    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.local_step += 1
        t = self.local_step
        pushed = bool(self.push_at(t))
        if pushed:
            self._push(blocking=False)
        pulled = bool(self.pull_at(t)) and self._pull()
        self._aligned = pushed and pulled and self._inflight is None
        return loss

    @torch.no_grad()
    def synchronize(self) -> None:
        """Collect what is in flight, push what is left, pull: every rank then holds ``x == G``.

        A collective: every rank must call it at the same point.
        """
        if self._aligned:
            return
        self._push(blocking=True)
        self._pull()
        self._aligned = True

    @torch.no_grad()
    def _push(self, blocking: bool) -> None:
        self._collect()
        tensors = self._tensors()
        deltas = [t - self._base[n] for n, t in zip(self._names, tensors)]
        futures = [
            self.engine.reduce([self._names[i] for i in idx], [deltas[i] for i in idx], out_dtype=dtype)
            for idx, dtype in self._groups
        ]
        self.engine.flush()
        self.engine.end_step()
        for n, t in zip(self._names, tensors):
            self._base[n].copy_(t)
        self._inflight = {"futures": futures, "delta": dict(zip(self._names, deltas))}
        if blocking or not self.overlap:
            self._collect()

    def _average(self) -> dict:
        """The in-flight push's average per tensor (waits for it; issues no collective)."""
        inf = self._inflight
        if "avg" not in inf:
            avg = {}
            for fut, (idx, _) in zip(inf["futures"], self._groups):
                flat, pos = fut.wait(), 0
                for i in idx:
                    d = inf["delta"][self._names[i]]
                    avg[self._names[i]] = flat[pos : pos + d.numel()].view(d.shape)
                    pos += d.numel()
            inf["avg"] = avg
            inf["futures"] = None
        return inf["avg"]

    @torch.no_grad()
    def _collect(self) -> None:
        if self._inflight is None:
            return
        avg = self._average()
        for n in self._names:
            self._global[n].add_(avg[n])
        self._inflight = None
        self._pull_pending = True

    @torch.no_grad()
    def _pull(self) -> bool:
        if not self._pull_pending:
            return False  # G and the own in-flight delta are as at the last pull: nothing to adopt
        inflight = self._inflight["delta"] if self._inflight is not None else None
        for n, t in zip(self._names, self._tensors()):
            base = self._base[n]
            e = t - base  # local progress not pushed yet
            base.copy_(self._global[n])
            if inflight is not None:
                base.add_(inflight[n])
            t.copy_(base + e)
        self._pull_pending = False
        return True

    # -- state -------------------------------------------------------------------------
    def stats(self) -> dict:
        """The engine's stats with ``steps`` = local steps and ``syncs`` = pushes."""
        d = self.engine.stats()
        d["syncs"] = d["steps"]
        d["steps"] = self.local_step
        d["bytes_sent_per_step"] = d["bytes_sent"] / self.local_step if self.local_step else 0.0
        return d

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict plus ``"local_sgd"`` and ``"gradzip"`` (the engine).

        An average still in flight is waited for (no collective is issued) and
        saved uncollected, so a resumed run collects it where the unbroken run
        would. Tensors and plain values only: ``torch.load(weights_only=True)``.
        The model's own tensors are not included: save ``model.state_dict()`` too.
        """
        sd = dict(self.optimizer.state_dict())
        inflight_delta, inflight_avg = {}, {}
        if self._inflight is not None:
            inflight_avg = {n: v.clone() for n, v in self._average().items()}
            inflight_delta = {n: v.clone() for n, v in self._inflight["delta"].items()}
        sd["local_sgd"] = {
            "version": STATE_VERSION,
            "local_step": self.local_step,
            "overlap": self.overlap,
            "global": {n: v.clone() for n, v in self._global.items()},
            "base": {n: v.clone() for n, v in self._base.items()},
            "inflight_delta": inflight_delta,
            "inflight_avg": inflight_avg,
            "pull_pending": self._pull_pending,
            "aligned": self._aligned,
        }
        sd["gradzip"] = self.engine.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        if "local_sgd" not in state_dict or "gradzip" not in state_dict:
            raise ValueError("state_dict was not saved by LocalSGD.state_dict() (no 'local_sgd'/'gradzip' entries)")
        sd = dict(state_dict)
        mine = sd.pop("local_sgd")
        if mine.get("version") != STATE_VERSION:
            raise ValueError(f"local_sgd state version {mine.get('version')!r} is not supported (expected {STATE_VERSION})")
        if bool(mine["overlap"]) != self.overlap:
            raise ValueError(f"overlap differs from the checkpoint: saved {mine['overlap']}, now {self.overlap}")
        if sorted(mine["global"]) != sorted(self._names):
            missing = sorted(set(self._names) - set(mine["global"]))
            extra = sorted(set(mine["global"]) - set(self._names))
            raise ValueError(f"checkpoint tensors differ from the model's: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for n in self._names:
                for key, dst in (("global", self._global), ("base", self._base)):
                    src = mine[key][n]
                    if src.shape != dst[n].shape:
                        raise ValueError(f"{key} tensor {n!r} has shape {tuple(src.shape)}, model has {tuple(dst[n].shape)}")
                    dst[n].copy_(src)
        if mine["inflight_avg"]:
            self._inflight = {
                "futures": None,
                "delta": {n: mine["inflight_delta"][n].to(self._global[n].device).clone() for n in self._names},
                "avg": {n: mine["inflight_avg"][n].to(self._global[n].device).clone() for n in self._names},
            }
        else:
            self._inflight = None
        self._pull_pending = bool(mine["pull_pending"])
        self._aligned = bool(mine["aligned"])
        self.local_step = int(mine["local_step"])
        self.engine.load_state_dict(sd.pop("gradzip"))
        self.optimizer.load_state_dict(sd)
