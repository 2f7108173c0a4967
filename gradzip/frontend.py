"""The surface every front end offers around its engine: stats, routes, logging, state, checkpoints.

Every front end derives from :class:`FrontEnd`: the DDP hook's state
(:class:`gradzip.hooks.ddp.HookState`), :class:`gradzip.optim.DistributedOptimizer`,
:class:`gradzip.local_sgd.LocalSGD` and ``DiLoCo``, :class:`gradzip.fsdp.FSDPState` and the
optimizer that :func:`gradzip.horovod.DistributedOptimizer` returns (the base is mixed into a
subclass of the wrapped optimizer's class there). So each offers, with the same signatures:

* ``stats(reset=False)``: bytes and times counted at the collectives, a flat dict of numbers
  (:mod:`gradzip.stats`); ``reset=True``: those since the previous ``stats(reset=True)``, and a
  new interval (the totals are kept).
* ``routes()``: per tensor, the method and protocol it travels by, and why (``Engine.routes``).
* ``log_every(every, fn=None)``: call ``fn(step, stats of the last every steps)`` every
  ``every`` steps (default: one line on the ``"gradzip"`` logger, shown on stderr without any
  ``logging`` setup; :func:`gradzip.stats.scalars` makes per-step scalars for TensorBoard, W&B,
  Lightning or Accelerate); ``None`` stops it.
* ``state_dict()`` / ``load_state_dict(state_dict)``: this rank's state; a state saved by
  another rank or on another number of ranks, or by another method, is refused with
  ``ValueError`` before anything changes (``check_owner``, ``Engine.check_state``).
* ``save(directory)`` / ``load(directory)``: ``state_dict()`` to this rank's own file, and back
  (:func:`gradzip.checkpoint.save`, :func:`gradzip.checkpoint.load`).
* ``check_owner(state_dict)``: ``ValueError`` for a state of another rank or world size.

A front end with several engines (``FSDPState`` with HSDP: the reduce-scatter's and the replica
all-reduce's) reports them together: ``stats()`` sums their counts (``steps`` is the front
end's, which every engine counts alike) and derives the ratios from the sums, ``routes()``
lists every engine's rows, each with ``"collective"`` naming its engine, and ``log_every``
calls ``fn`` once per step with the summed interval.

**Skipping a non-finite step.** With ``on_nonfinite="skip"`` a step whose gradient held a
NaN/Inf on any rank averages to NaN on every rank and its residuals are rolled back (the
engine). :func:`skip_nonfinite` makes the optimizer skip that step too: ``optimizer.step()``
then leaves the parameters and the optimizer's state (moments, ``step`` counts, momentum
buffers) as they were, on every rank, with or without a ``GradScaler``; every step the
engines ended since the optimizer's last ``step()`` or ``zero_grad()`` counts (FSDP's
gradient accumulation sums several into ``.grad``).
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

import gradzip.checkpoint as checkpoint

from .engine import STATE_VERSION, Engine, check_owner, route_summary
from .stats import Stats, log_line, logger, reach_the_user

__all__ = ["FrontEnd", "combine", "skip_nonfinite", "NONFINITE_HINT"]

#: What ``log_every``'s ``fn`` is called with: the front end's step and the interval's stats.
LogFn = Callable[[int, dict], None]


def combine(counts: list[dict]) -> dict:
    """The counts of one front end's engines (``Stats`` fields) as one: summed, except
    ``steps``, which each engine counts per step of the front end (their largest)."""
    out = {k: sum(c[k] for c in counts) for k in Stats.names()}
    out["steps"] = max(c["steps"] for c in counts)
    return out


class FrontEnd:
    """Base of every front end: the surface of the module docstring around ``self.engine``.

    A front end sets ``engine`` (or overrides :meth:`_engines` when it has several) and says
    where its state lies: ``_engine_key`` is ``None`` when ``state_dict()`` is the engine's own
    (the DDP hook), or the key of the engine's state beside the wrapped optimizer's state
    (``"gradzip"``); ``_own_keys`` names the entries of its own (LocalSGD's ``"local_sgd"``).
    The hooks below fill in the rest: the wrapped optimizer's state, the front end's own, and
    whether a state may be loaded now.
    """

    engine: Engine
    _engine_key: ClassVar[str | None] = None
    _own_keys: ClassVar[tuple[str, ...]] = ()
    #: A state without the engine's part loads the rest and leaves the engine as it is (the
    #: Horovod optimizer takes a plain optimizer state).
    _engine_optional: ClassVar[bool] = False
    #: Each step's average holds the gradients accumulated before it (DDP reduces ``.grad``
    #: as accumulated), so :func:`skip_nonfinite` reads the last step's verdict; else (FSDP
    #: sums each reduce-scatter into ``.grad``) every step since the optimizer's last
    #: ``step()`` or ``zero_grad()`` counts.
    _verdict_covers_grad: ClassVar[bool] = False

    # -- the engines ---------------------------------------------------------------------------
    def _engines(self) -> dict[str, Engine]:
        """The engines by label, in the order their steps end (``""``: the only one)."""
        return {"": self.engine}

    # -- stats ---------------------------------------------------------------------------------
    def stats(self, reset: bool = False) -> dict:
        """Bytes and times counted at the collectives, a flat dict of numbers (:mod:`gradzip.stats`);
        ``reset=True``: those since the previous ``stats(reset=True)``, and a new interval."""
        return self._stats_of(list(self._engines().values()), reset)

    @staticmethod
    def _stats_of(engines: list[Engine], reset: bool) -> dict:
        if len(engines) == 1:
            return engines[0].stats(reset=reset)
        counts = [e.stats_.since("reset") if reset else e.stats_.state_dict() for e in engines]
        return Stats.derive(combine(counts))

    def routes(self) -> list[dict]:
        """Per tensor: the method and protocol it travels by, and why (:meth:`Engine.routes`);
        with several engines each row names its engine under ``"collective"``."""
        rows = []
        for label, e in self._engines().items():
            rows += [{**r, "collective": label} if label else r for r in e.routes()]
        return rows

    def log_every(self, every: int | None, fn: LogFn | None = None) -> None:
        """Call ``fn(step, stats)`` every ``every`` steps, ``stats`` being the last ``every`` steps'
        counts and ratios (:func:`gradzip.stats.log_every`); ``every=None`` stops the calls."""
        engines = list(self._engines().values())
        if fn is None and every is not None:
            reach_the_user()  # the default lines show without any logging setup
        if len(engines) == 1:
            engines[0].set_log(every, fn)
            return
        *others, last = engines  # the last to end its step logs for all
        for e in others:
            e.set_log(None)
        if every is None:
            last.set_log(None)
            return
        if fn is not None and not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        for e in others:
            e.stats_.since("log")  # their intervals start now, as set_log starts the last one's
        routes_logged = [False]

        def combined(step: int, stats: dict) -> None:
            counts = combine([{k: stats[k] for k in Stats.names()}] + [e.stats_.since("log") for e in others])
            d = Stats.derive(counts)
            if fn is not None:
                fn(step, d)
                return
            if not routes_logged[0]:
                for label, e in self._engines().items():
                    if hasattr(e.protocol, "decision"):
                        for line in route_summary(e.routes()):
                            logger.info("gradzip routes (%s): %s", label, line)
                routes_logged[0] = True
            log_line(step, d)

        last.set_log(every, combined)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state: the engine's (it records the rank, the world size and the method),
        beside the wrapped optimizer's state and the front end's own where it has them. Tensors
        and plain values only: ``torch.load(weights_only=True)`` reads it."""
        if self._engine_key is None:
            return self.engine.state_dict()
        sd = dict(self._wrapped_state_dict())
        sd.update(self._own_state_dict())
        sd[self._engine_key] = self.engine.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` saved. A state of another rank or world size, of another
        method or error feedback, or one this front end did not save is refused with
        ``ValueError`` before anything changes."""
        if self._engine_key is None:
            engine_sd, rest = state_dict, {}
        else:
            need = self._own_keys + (() if self._engine_optional else (self._engine_key,))
            missing = [k for k in need if k not in state_dict]
            if missing:
                raise ValueError(
                    f"state_dict has no {' or '.join(repr(k) for k in missing)} entry: it was not saved by "
                    f"{type(self).__name__}.state_dict()"
                )
            engine_sd = state_dict.get(self._engine_key)
            rest = {k: v for k, v in state_dict.items() if k != self._engine_key}
        self._check_loadable()
        if engine_sd is not None:
            self._check_method(engine_sd)
            self.engine.check_state(engine_sd)
        rest = self._load_own_state_dict(rest)
        if engine_sd is not None:
            self.engine.load_state_dict(engine_sd, checked=True)
        if self._engine_key is not None:
            self._load_wrapped_state_dict(rest)

    def _check_method(self, engine_sd: dict) -> None:
        """``ValueError`` naming both methods when ``engine_sd`` was saved by another method (a
        TopK state offered to an Int8 hook), before the engine's field-by-field check."""
        saved = engine_sd.get("method")
        if engine_sd.get("version") != STATE_VERSION or not isinstance(saved, dict):
            return  # the engine's check names what is wrong
        mine = self.engine.method.config()
        if saved == mine:
            return
        key = next(
            k for k in sorted(set(saved) | set(mine), key=lambda k: (k != "name", k)) if saved.get(k) != mine.get(k)
        )
        raise ValueError(
            f"the checkpoint holds the state of {engine_sd.get('method_repr') or saved.get('name')}, and this "
            f"{type(self).__name__} runs {self.engine.method!r}: a method's state loads into the same method only "
            f"(config differs in {key!r}: saved {saved.get(key)!r}, now {mine.get(key)!r})"
        )

    def check_owner(self, state_dict: dict) -> None:
        """``ValueError`` when ``state_dict`` (this front end's kind) was saved by another rank
        or on another number of ranks (:func:`gradzip.engine.check_owner`): error-feedback
        state is per rank, and :func:`gradzip.checkpoint.reshard` moves it between world sizes."""
        sd = state_dict if self._engine_key is None else state_dict.get(self._engine_key)
        if sd is not None:
            check_owner(sd, self.engine.comm.rank, self.engine.comm.world_size)

    def save(self, directory: str | Path) -> Path:
        """``state_dict()`` to this rank's own file in ``directory``; returns its path
        (:func:`gradzip.checkpoint.save`). Call it on every rank."""
        return checkpoint.save(self, directory)

    def load(self, directory: str | Path) -> None:
        """Load this rank's own file from ``directory`` (:func:`gradzip.checkpoint.load`)."""
        checkpoint.load(self, directory)

    # -- hooks ---------------------------------------------------------------------------------
    def _wrapped_state_dict(self) -> dict:
        """The wrapped optimizer's state dict (none here)."""
        return {}

    def _load_wrapped_state_dict(self, state_dict: dict) -> None:
        """Load the wrapped optimizer's state (what is left of the state after the front end's own)."""

    def _own_state_dict(self) -> dict:
        """The front end's own entries (``_own_keys``) of its state dict."""
        return {}

    def _load_own_state_dict(self, state_dict: dict) -> dict:
        """Check and load the front end's own entries; returns the rest of ``state_dict``."""
        return state_dict

    def _check_loadable(self) -> None:
        """Raise where a state must not be loaded now (in the middle of a step)."""


# -- skipping a non-finite step --------------------------------------------------------------------
#: The warning of a front end's first non-finite step without a guard (``Engine.nonfinite_hint``):
#: ``{fix}`` is the front end's remedy, ``{step}`` the engine's step (filled when it warns).
NONFINITE_HINT = (
    "gradzip: a gradient held a NaN/Inf on some rank at step {{step}}: every rank's average of that step is "
    "NaN (residuals and codec state were rolled back). A GradScaler skips that optimizer.step(); without one, "
    "optimizer.step() turns the parameters NaN. To skip the step without a GradScaler, {fix} (shown once)"
)
_GUARD = "_gradzip_skip_nonfinite"  # the optimizer's __dict__ entry that holds its _SkipGuard


class _SkipGuard:
    """What :func:`skip_nonfinite` installs on an optimizer: its ``step`` and ``zero_grad`` in
    wrappers. A window opens at each ``step()`` and ``zero_grad()``; ``step()`` returns without
    stepping where an engine ended a non-finite step in the window (``Engine.nonfinite_steps``
    rose; alike on every rank). An engine whose front end's step sees the gradients accumulated
    before it (``FrontEnd._verdict_covers_grad``: DDP) skips only where its last step, ended in
    the window, was non-finite."""

    def __init__(self) -> None:
        # per engine: [weak reference (a dropped front end stops counting), its
        # nonfinite_steps at the window's start, its last verdict covers the gradients]
        self.engines: list[list] = []
        self.skipped = 0  # steps skipped

    def add(self, engine: Engine, covers: bool = False) -> None:
        for entry in self.engines:
            if entry[0]() is engine:
                entry[2] = entry[2] and covers
                break
        else:
            self.engines.append([weakref.ref(engine), engine.nonfinite_steps, covers])
        engine.skip_guard = True

    def restart(self) -> None:
        """A new window, from now on."""
        for entry in self.engines:
            e = entry[0]()
            if e is not None:
                entry[1] = e.nonfinite_steps

    def nonfinite(self) -> bool:
        """Whether the window saw a non-finite step; a new window starts. ``RuntimeError``
        where an engine's calls are still running (their verdict is not in)."""
        live = [(e, entry) for entry in self.engines if (e := entry[0]()) is not None]
        for e, _ in live:
            running = e.calls_running
            if running:
                raise RuntimeError(
                    f"gradzip: optimizer.step() was called while {running} call(s) of a gradzip engine "
                    f"(step {e.step}) are still running, so whether their gradients held a NaN/Inf is not "
                    "known yet: wait for the futures Engine.reduce returned (and call Engine.end_step()) "
                    "before optimizer.step()"
                )
        bad = any(e.nonfinite_steps > entry[1] and (e.last_step_nonfinite or not entry[2]) for e, entry in live)
        self.restart()
        return bad

    def skip(self, optimizer) -> None:
        self.skipped += 1
        optimizer._opt_called = True  # an LR scheduler's check: step() was called, in order

    def step(self, optimizer, inner: Callable, args: tuple, kwargs: dict):
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):
            if self.nonfinite():
                self.skip(optimizer)
                return None
            return inner(*args, **kwargs)
        # step(closure) (Lightning): the closure runs the backward whose verdict decides, so it
        # runs first; the optimizer's own first call of it gets that loss back.
        with torch.enable_grad():
            loss = closure()
        if self.nonfinite():
            self.skip(optimizer)
            return loss
        first = [True]

        def again():
            if first[0]:
                first[0] = False
                return loss
            return closure()

        if "closure" in kwargs:
            kwargs = {**kwargs, "closure": again}
        else:
            args = (again, *args[1:])
        return inner(*args, **kwargs)


def skip_nonfinite(optimizer: torch.optim.Optimizer, state: FrontEnd | Engine) -> None:
    """Skip ``optimizer.step()`` after a step whose gradient held a NaN/Inf on any rank.

    ``state`` is what compresses the gradients: the ``HookState`` that ``register_hook``
    returns, ``gz.fsdp.compress``'s state, or an :class:`~gradzip.engine.Engine`. With
    ``on_nonfinite="skip"`` such a step averages to NaN on every rank and its residuals and
    codec state are rolled back; from this call on, ``optimizer.step()`` after it returns
    without stepping (``None``, or the closure's loss), so the parameters and the optimizer's
    state (Adam's moments and ``step`` counts, SGD's momentum buffers) stay as they were, on
    every rank alike: the run goes on as if that batch had never come. An LR scheduler still
    steps, as with a ``GradScaler``. Any optimizer may be given (``register_hook(ddp, method,
    optimizer=opt)`` also installs this, along with the momentum correction it is for). With a
    ``GradScaler`` the scaler skips first (``scaler.step(opt)`` calls ``opt.step`` only on
    finite steps), and nothing changes.

    Every step the engines ended since the optimizer's last ``step()`` or ``zero_grad()``
    counts: under FSDP with gradient accumulation each micro-batch's reduce-scatter is summed
    into the sharded gradients, so a NaN micro-batch followed by finite ones still skips. DDP
    averages the gradients as accumulated, so there the last step's verdict decides (a step in
    that window). A step skipped elsewhere (a ``GradScaler``, the loop's own check) ends its
    window at ``optimizer.zero_grad()``; under FSDP or with an ``Engine``, gradients cleared
    another way (``model.zero_grad()``) leave it open, and the next ``step()`` is skipped too.
    ``optimizer.step()`` while an engine's calls are still running (their futures not waited
    for, or held until ``flush()``) is a ``RuntimeError``: their verdict is not in yet.

    ``optimizer.step`` and ``optimizer.zero_grad`` become wrappers on this instance (an LR
    scheduler wraps ``step`` as it wraps the class's); a finite step calls the optimizer's own
    step, unchanged. ``step(closure)`` runs the closure first (it computes the gradients being
    judged) and hands its loss to the optimizer's own first call of it. Calling this again, for
    the same or another state, adds that state's engines to the same wrapper. The wrappers live
    on this instance only: an optimizer rebuilt, copied (``copy.deepcopy``) or unpickled has
    none, so call this again on it. A gradzip optimizer that averages the gradients itself
    (``DistributedOptimizer``, ``OneBitAdam``, the Horovod optimizer) skips such steps on its
    own: given one, this does nothing.
    """
    if isinstance(state, FrontEnd):
        engines = list(state._engines().values())
        covers = state._verdict_covers_grad
    elif isinstance(state, Engine):
        engines, covers = [state], False
    else:
        raise TypeError(
            f"state must be what register_hook (or gz.fsdp.compress) returned, or an Engine; got {type(state).__name__}"
        )
    if isinstance(optimizer, FrontEnd):
        return  # a gradzip optimizer: it skips by itself
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    guard = optimizer.__dict__.get(_GUARD)
    if guard is None:
        guard = _SkipGuard()
        inner = optimizer.step
        # Bound as the optimizer's own step is, so that an LR scheduler made later can wrap it
        # (it rebinds ``step.__func__``); the optimizer's step, or an earlier wrapper's, inside.
        func = inner.__func__ if getattr(inner, "__self__", None) is optimizer else None

        @functools.wraps(func if func is not None else inner)
        def step(opt, *args, **kwargs):
            own = func.__get__(opt, type(opt)) if func is not None else inner
            return guard.step(opt, own, args, kwargs)

        optimizer.step = types.MethodType(step, optimizer)
        clear = optimizer.zero_grad
        # wrapped as the unbound function, so that its signature is the optimizer's own
        # (Accelerate reads it for ``set_to_none``)
        zfunc = clear.__func__ if getattr(clear, "__self__", None) is optimizer else None

        @functools.wraps(zfunc if zfunc is not None else clear)
        def zero_grad(opt, *args, **kwargs):
            guard.restart()  # the gradients are cleared: a new window
            return clear(*args, **kwargs)

        optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
        optimizer.__dict__[_GUARD] = guard
    for e in engines:
        guard.add(e, covers)
