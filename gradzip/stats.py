"""Byte and time accounting.

Bytes are counted by :mod:`gradzip.comm` from the tensors it hands to
``torch.distributed``, never from formulas:

* ``bytes_sent``: bytes of the input tensors this rank handed to collectives,
  padding and size exchanges included.
* ``bytes_raw``: bytes of the gradients those collectives replaced, i.e. what a
  plain allreduce of the same tensors would have been handed.
* ``bytes_link``: bytes this rank sends on its network link, by each collective's
  algorithm (``gradzip.comm``: ring allreduce ``2(N-1)/N * S``, ring all-gather
  ``(N-1) * S``, pairwise all-to-all the bytes addressed to other ranks);
  ``bytes_link_intra``: the part of it inside a node (hierarchical protocols).
* ``bytes_link_raw``: what plain DDP's ring allreduce of the same gradients sends,
  ``2(N-1)/N * bytes_raw``.
* ``ratio = bytes_link_raw / bytes_link``: the compression on the link, against
  plain DDP; ``ratio_handed = bytes_raw / bytes_sent``, against the bytes handed to
  collectives (which flatters all-gathers: they hand over ``S`` and send ``(N-1) * S``).
* ``bytes_control``: the part of ``bytes_sent`` that is protocol, not payload:
  size exchanges, non-finite flags, the first step's configuration check.
* ``bytes_allgather``: the part of ``bytes_sent`` handed to all-gathers (the rest
  went to allreduces); a cost model needs both, since they scale differently.
* ``bytes_payload``: message bytes before padding.

Times are wall-clock seconds: ``codec_seconds`` in gradzip's own work outside the
collectives (error feedback, compress, framing, decode, the engine's checks),
``comm_seconds`` summed over collectives from launch to completion (collectives
run asynchronously, so this can overlap compute and each other).
``codec_cpu_seconds`` is the CPU time of the threads in those codec blocks: below
``codec_seconds`` when a codec thread waits for a core (more busy threads than cores).

**Logging.** ``stats()`` is a flat dict of numbers (``str -> int | float``). The counts are
cumulative (and checkpointed); ``stats(reset=True)`` gives the counts since the previous
``stats(reset=True)`` instead (the derived ratios computed on that interval) and starts a
new interval, leaving the totals alone. :func:`scalars` turns such an interval into
per-step scalars, one a key with its unit in the name (``gradzip/link_bytes_per_step``,
``gradzip/codec_ms_per_step``, ...), what TensorBoard's ``add_scalar``, ``wandb.log``,
Lightning's ``log_dict`` and Accelerate's ``log`` take::

    state.log_every(50, lambda step, s: wandb.log(scalars(s), step=step))
    state.log_every(50, lambda step, s: [writer.add_scalar(k, v, step) for k, v in scalars(s).items()])

:func:`log_every` calls a function every ``n`` steps with the last ``n`` steps' counts; by
default one line on the ``"gradzip"`` logger, which reaches stderr without any ``logging``
setup (and logging's default WARNING threshold does not hide it; a level set on the
``"gradzip"`` logger is kept, and once a handler is configured the lines go there alone).
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field, fields

__all__ = ["Stats", "log_every", "logger", "scalars", "SCALARS"]

logger = logging.getLogger("gradzip")


@dataclass
class Stats:
    """Bytes and times of one front end, counted at the collectives (module docstring).

    Args:
        steps, bytes_raw, bytes_sent, bytes_control, bytes_allgather, bytes_payload,
        bytes_link, bytes_link_intra, bytes_link_raw, collectives, codec_seconds,
        codec_cpu_seconds, comm_seconds: the counters (all 0 at the start; see the
            module docstring for each).
    """

    steps: int = 0
    bytes_raw: int = 0
    bytes_sent: int = 0
    bytes_control: int = 0
    bytes_allgather: int = 0
    bytes_payload: int = 0
    bytes_link: float = 0.0
    bytes_link_intra: float = 0.0
    bytes_link_raw: float = 0.0
    collectives: int = 0
    codec_seconds: float = 0.0
    codec_cpu_seconds: float = 0.0
    comm_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _marks: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    #: The totals a ``load_state_dict`` brought in: every interval starts there after a resume.
    _base: dict | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls) if not f.name.startswith("_")]

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def reset(self) -> None:
        with self._lock:
            for f in fields(self):
                if not f.name.startswith("_"):
                    setattr(self, f.name, f.default)
            self._marks.clear()
            self._base = None

    def state_dict(self) -> dict:
        with self._lock:
            return {k: getattr(self, k) for k in self.names()}

    def since(self, mark: str = "reset") -> dict:
        """The counts since the last ``since(mark)`` (since the start or the last
        ``load_state_dict``, the first time), and a new interval from now; each ``mark``
        keeps its own interval."""
        with self._lock:
            now = {k: getattr(self, k) for k in self.names()}
            before = self._marks.get(mark, self._base)
            self._marks[mark] = now
        return now if before is None else {k: now[k] - before[k] for k in now}

    def as_dict(self, reset: bool = False) -> dict:
        """A flat dict of numbers: the counts and ``ratio``, ``ratio_handed``,
        ``bytes_sent_per_step``. ``reset=True``: the counts since the previous
        ``as_dict(reset=True)``, and a new interval (the totals are kept)."""
        d = self.since("reset") if reset else self.state_dict()
        return self.derive(d)

    @staticmethod
    def derive(d: dict) -> dict:
        """``d`` (counts) with the derived ratios added."""
        d = dict(d)
        d["ratio"] = d["bytes_link_raw"] / d["bytes_link"] if d["bytes_link"] else 1.0
        d["ratio_handed"] = d["bytes_raw"] / d["bytes_sent"] if d["bytes_sent"] else 1.0
        d["bytes_sent_per_step"] = d["bytes_sent"] / d["steps"] if d["steps"] else 0.0
        return d

    def load_state_dict(self, sd: dict) -> None:
        """Fields missing from ``sd`` (a state saved before they existed) keep their values."""
        with self._lock:
            for f in fields(self):
                if not f.name.startswith("_") and f.name in sd:
                    setattr(self, f.name, type(f.default)(sd[f.name]))
            # every interval starts afresh at the loaded totals (not at zero: a delta after a
            # resume must not report the whole run)
            self._base = {k: getattr(self, k) for k in self.names()}
            self._marks.clear()


#: :func:`scalars`' keys (without the prefix): ``(key, what it is)``, every one per step of the interval.
SCALARS: tuple[tuple[str, str], ...] = (
    ("link_ratio", "plain DDP's link bytes over gradzip's (ratio; above 1: gradzip sends less)"),
    ("link_bytes_per_step", "bytes this rank sent on its link (bytes_link)"),
    ("link_intra_bytes_per_step", "the part of them inside the node (bytes_link_intra; Hierarchical)"),
    ("ddp_link_bytes_per_step", "what plain DDP's ring allreduce would have sent (bytes_link_raw)"),
    ("sent_bytes_per_step", "bytes handed to collectives (bytes_sent)"),
    ("collectives_per_step", "collectives issued"),
    ("codec_ms_per_step", "wall milliseconds in gradzip's own work (codec_seconds)"),
    ("comm_ms_per_step", "milliseconds of collectives, launch to completion, summed (comm_seconds)"),
)


def scalars(stats: dict, prefix: str = "gradzip/") -> dict[str, float]:
    """Per-step scalars of an interval's stats (``stats(reset=True)``, or what ``log_every``'s
    ``fn`` receives), one a key with its unit in the name (:data:`SCALARS`), prefixed with
    ``prefix``: ready for TensorBoard's ``add_scalar`` (one chart each), ``wandb.log``,
    Lightning's ``log_dict`` and Accelerate's ``log``. ``{}`` for an interval without a step.
    Cumulative stats (``stats()``) give the run's averages per step."""
    n = stats["steps"]
    if not n:
        return {}
    d = Stats.derive({k: stats[k] for k in Stats.names()})
    values = {
        "link_ratio": d["ratio"],
        "link_bytes_per_step": d["bytes_link"] / n,
        "link_intra_bytes_per_step": d["bytes_link_intra"] / n,
        "ddp_link_bytes_per_step": d["bytes_link_raw"] / n,
        "sent_bytes_per_step": d["bytes_sent"] / n,
        "collectives_per_step": d["collectives"] / n,
        "codec_ms_per_step": 1e3 * d["codec_seconds"] / n,
        "comm_ms_per_step": 1e3 * d["comm_seconds"] / n,
    }
    return {f"{prefix}{k}": float(values[k]) for k, _ in SCALARS}


class _Fallback(logging.StreamHandler):
    """The ``"gradzip"`` logger's lines on stderr while no other handler would take them
    (``logging`` not configured): once one exists on the logger or above it, this one is quiet."""

    def emit(self, record: logging.LogRecord) -> None:
        if any(h is not self for h in logger.handlers):
            return
        c = logger.parent if logger.propagate else None
        while c is not None:
            if c.handlers:
                return
            c = c.parent if c.propagate else None
        self.stream = sys.stderr  # the current one (a test may have swapped it)
        super().emit(record)


def reach_the_user() -> None:
    """Make the default :func:`log_every` lines visible without any ``logging`` setup: the
    ``"gradzip"`` logger gets level INFO unless a level was set on it, and a stderr handler
    that speaks only while no other handler is configured."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, _Fallback) for h in logger.handlers):
        h = _Fallback(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(h)


def log_every(obj, every: int, fn=None) -> None:
    """Call ``fn(step, stats)`` every ``every`` steps of a front end, ``stats`` being the
    flat dict of the last ``every`` steps' counts (as ``stats(reset=True)`` computes them,
    on an interval of its own).

    Args:
        obj: a front end (what ``register_hook`` returns, ``DistributedOptimizer``,
            ``LocalSGD``/``DiLoCo``, whose steps are its syncs here) or an ``Engine``.
        every: steps between calls, an integer in [1, inf); ``None`` stops the calls.
        fn: ``None`` logs one line at INFO on the ``"gradzip"`` logger (with a
            ``Policy``, the per-tensor routes are logged once, after the first step), which
            reaches stderr without any ``logging`` setup (:func:`reach_the_user`); or any
            callable, e.g. ``lambda step, s: wandb.log(scalars(s), step=step)`` (:func:`scalars`).

    It is called where the front end ends its step (the DDP hook: after the last
    bucket's collectives are issued, inside backward). Bytes are counted when a
    collective is issued, so they are complete; ``comm_seconds`` of collectives still
    running then count in the next interval.
    """
    if callable(getattr(obj, "log_every", None)):  # a front end: it knows its engines
        obj.log_every(every, fn)
        return
    engine = getattr(obj, "engine", obj)
    if not hasattr(engine, "set_log"):
        raise TypeError(f"{type(obj).__name__} is not a gradzip front end (no engine)")
    engine.set_log(every, fn)
    if fn is None and every is not None:
        reach_the_user()


def log_line(step: int, stats: dict) -> None:
    """The default :func:`log_every` function: one INFO line on the ``"gradzip"`` logger."""
    logger.info(
        "gradzip step %d: %d steps, ratio %.1fx, %.0f link bytes/step, codec %.3f s, comm %.3f s",
        step,
        stats["steps"],
        stats["ratio"],
        stats["bytes_link"] / max(1, stats["steps"]),
        stats["codec_seconds"],
        stats["comm_seconds"],
    )
