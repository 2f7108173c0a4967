"""When local SGD synchronizes: schedules are functions ``step -> bool``.

``step`` counts the local optimizer steps taken so far, from 1: the schedule
is asked right after the ``step``-th local update whether to synchronize now.
A schedule must give the same answer on every rank (the answer decides whether
a collective is issued), so it depends on ``step`` alone. Any callable
``step -> bool`` works; these are the usual ones:

* :class:`Constant` ``(period)``: every ``period`` steps (``H`` in the papers).
* :class:`PostLocal` ``(warmup_steps, period)``: every step during the first
  ``warmup_steps`` steps (synchronous SGD), then every ``period`` steps, as in
  post-local SGD (Lin et al. 2020, "Don't use large mini-batches, use local SGD").
* :class:`Increasing` ``(period, factor, every, max_period)``: the interval
  grows by ``factor`` every ``every`` steps, up to ``max_period``.

``sync_steps(schedule, n)`` lists the steps in ``1..n`` at which a schedule
synchronizes.

Streaming DiLoCo syncs the model by fragments: :func:`split_fragments` cuts the
tensors (in model order, laid end to end) into fragments of equal bytes, cutting
inside tensors where needed, and
:class:`Streaming` ``(period, fragments, delay)`` says which fragment is
pushed (*prepared*) and which is collected (*synced*) at each step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import gradzip.args as args

__all__ = [
    "Schedule",
    "Constant",
    "PostLocal",
    "Increasing",
    "Streaming",
    "as_schedule",
    "sync_steps",
    "split_fragments",
    "long_run_period",
]


def _check_int(name: str, value, low: int) -> int:
    return args.integer(name, value, low)


class Schedule:
    """Base class: ``schedule(step) -> bool`` for ``step >= 1``."""

    def __call__(self, step: int) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def config(self) -> dict:
        return {"name": type(self).__name__}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"


class Constant(Schedule):
    """Synchronize at steps ``period, 2*period, ...``. ``Constant(1)`` is every step."""

    def __init__(self, period: int) -> None:
        self.period = _check_int("period", period, 1)

    def __call__(self, step: int) -> bool:
        return step >= 1 and step % self.period == 0

    def config(self) -> dict:
        return {"name": "Constant", "period": self.period}


class PostLocal(Schedule):
    """Every step up to and including ``warmup_steps``, then every ``period`` steps after it.

    Synchronizes at ``1, 2, ..., warmup_steps`` and then at
    ``warmup_steps + period, warmup_steps + 2*period, ...``.
    """

    def __init__(self, warmup_steps: int, period: int) -> None:
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.period = _check_int("period", period, 1)

    def __call__(self, step: int) -> bool:
        if step < 1:
            return False
        if step <= self.warmup_steps:
            return True
        return (step - self.warmup_steps) % self.period == 0

    def config(self) -> dict:
        return {"name": "PostLocal", "warmup_steps": self.warmup_steps, "period": self.period}


class Increasing(Schedule):
    """An interval that grows with training.

    The interval that starts at a sync point ``s`` (``s = 0`` at the start) is

        ``H(s) = min(max_period, floor(period * factor ** (s // every)))``

    so the sync points are ``s_0 = 0`` and ``s_{i+1} = s_i + H(s_i)``. With
    ``Increasing(2, 2, 10, 8)``: 2, 4, 6, 8, 10, then 14, 18, 22, then 30, 38, ...
    """

    def __init__(self, period: int, factor: float, every: int, max_period: int) -> None:
        self.period = _check_int("period", period, 1)
        self.factor = args.number("factor", factor, 1.0)
        self.every = _check_int("every", every, 1)
        self.max_period = _check_int("max_period", max_period, period)
        # Segments (start, h, end): sync points start+h, start+2h, ..., end (inclusive).
        self._starts: list[int] = []
        self._segments: list[tuple[int, int, int]] = []
        self._tail: tuple[int, int] | None = None  # (start, h): from there on, every h steps forever

    def period_at(self, s: int) -> int:
        """The interval that starts at sync point ``s``."""
        level = s // self.every
        h = self.period * self.factor**level if level < 2048 else math.inf
        return int(min(self.max_period, math.floor(h)))

    def _extend_to(self, step: int) -> None:
        s = self._segments[-1][2] if self._segments else 0
        while self._tail is None and s < step:
            h = self.period_at(s)
            if h >= self.max_period or self.factor == 1.0:
                self._tail = (s, h)
                break
            # Constant h until the first sync point that lands in the next level.
            boundary = (s // self.every + 1) * self.every
            end = s + max(1, -(-(boundary - s) // h)) * h
            self._starts.append(s)
            self._segments.append((s, h, end))
            s = end

    def __call__(self, step: int) -> bool:
        if step < 1:
            return False
        self._extend_to(step)
        if self._tail is not None and step > self._tail[0]:
            start, h = self._tail
            return (step - start) % h == 0
        i = bisect.bisect_left(self._starts, step) - 1  # the segment with start < step
        start, h, end = self._segments[i]
        return step <= end and (step - start) % h == 0

    def config(self) -> dict:
        return {
            "name": "Increasing",
            "period": self.period,
            "factor": self.factor,
            "every": self.every,
            "max_period": self.max_period,
        }


def as_schedule(name: str, value) -> Callable[[int], bool]:
    """An int becomes :class:`Constant`; a callable is used as is; anything else is a ``ValueError``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer in [1, inf) or a callable step -> bool, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{name} must be an integer in [1, inf) or a callable step -> bool, got {value!r}")
        return Constant(value)
    if callable(value):
        return value
    raise ValueError(f"{name} must be an integer in [1, inf) or a callable step -> bool, got {value!r}")


def sync_steps(schedule: Callable[[int], bool], n: int) -> list[int]:
    """The steps in ``1..n`` at which ``schedule`` synchronizes."""
    return [t for t in range(1, n + 1) if schedule(t)]


class Streaming(Schedule):
    """Round-robin fragment syncs (Streaming DiLoCo; torchft's ``DiLoCo`` schedule).

    With ``H = period``, ``F = fragments`` and ``h = H / F`` (``H`` must be a multiple of
    ``F``), fragment ``f`` is *synced* (its average collected, the outer step taken and
    merged) at steps ``(f + 1) * h + k * H`` for ``k = 0, 1, ...``, and *prepared* (its
    pseudo-gradient taken and its reduce started) ``delay`` steps earlier, at
    ``(f + 1) * h - delay + k * H``. So one fragment syncs every ``h`` steps, each fragment
    every ``H`` steps, and with ``0 <= delay < h`` at most one fragment is in flight at a
    time. ``Streaming(H)`` (one fragment, no delay) is :class:`Constant` ``(H)``.

    Calling the schedule answers whether a fragment is synced at ``step``.
    """

    def __init__(self, period: int, fragments: int = 1, delay: int = 0) -> None:
        self.period = _check_int("period", period, 1)
        self.fragments = _check_int("fragments", fragments, 1)
        if self.period % self.fragments:
            raise ValueError(
                f"period must be a multiple of fragments (each fragment syncs every period steps, one every "
                f"period/fragments), got period={self.period}, fragments={self.fragments}"
            )
        self.interval = self.period // self.fragments
        self.delay = args.integer("delay", delay, 0, self.interval - 1)

    def synced(self, step: int) -> int | None:
        """The fragment whose sync completes at ``step``, or ``None``."""
        if step < self.interval or step % self.interval:
            return None
        return (step // self.interval - 1) % self.fragments

    def prepared(self, step: int) -> int | None:
        """The fragment whose pseudo-gradient is taken and sent at ``step``, or ``None``."""
        return self.synced(step + self.delay) if step >= 1 else None

    def __call__(self, step: int) -> bool:
        return self.synced(step) is not None

    def config(self) -> dict:
        return {"name": "Streaming", "period": self.period, "fragments": self.fragments, "delay": self.delay}


def split_fragments(nbytes, fragments: int, granule=None) -> list[list[tuple[int, int, int]]]:
    """Cut tensors of ``nbytes`` (in order, concatenated) into ``fragments`` runs of about equal bytes.

    The tensors are laid end to end as one run of ``total = sum(nbytes)`` bytes, and cut
    ``k`` (``k = 1 .. fragments - 1``) lies at the boundary nearest to ``k * total /
    fragments`` (the earlier one on a tie), *inside* a tensor where that point falls inside
    one. Tensor ``i`` may be cut at multiples of ``granule[i]`` bytes (its element size:
    a cut never splits an element; ``granule[i] == nbytes[i]``: never cut inside it).
    ``granule=None`` never cuts inside a tensor (whole tensors only). A cut that would
    leave a fragment empty moves to the next boundary (or the previous, near the end).
    An empty tensor goes with the fragment where it lies (the later one at a cut).

    Returns each fragment's pieces ``(i, start, stop)``: the byte range ``[start, stop)``
    of tensor ``i`` (``(i, 0, nbytes[i])`` for a whole tensor), in order. Each fragment
    holds ``total / fragments`` bytes to within the granule at either cut.
    """
    sizes = [int(b) for b in nbytes]
    fragments = _check_int("fragments", fragments, 1)
    n = len(sizes)
    if any(b < 0 for b in sizes):
        raise ValueError(f"nbytes must be >= 0, got {sizes}")
    grains = list(sizes) if granule is None else [int(g) for g in granule]
    if len(grains) != n:
        raise ValueError(f"granule has {len(grains)} entries for {n} tensors")
    for i, (b, g) in enumerate(zip(sizes, grains)):
        if b and (g < 1 or b % g):
            raise ValueError(f"granule[{i}] = {g} does not divide tensor {i}'s {b} bytes")
    if fragments == 1:
        return [[(i, 0, b) for i, b in enumerate(sizes)]]
    prefix = [0]
    for b in sizes:
        prefix.append(prefix[-1] + b)
    total = prefix[-1]
    places = sum(b // g for b, g in zip(sizes, grains) if b)  # the pieces the tensors can be cut into
    if fragments > places:
        what = "tensors" if granule is None else "elements"
        raise ValueError(f"fragments must be at most the number of {what} ({places}), got {fragments}")

    def holder(p: int) -> int:
        """The tensor holding byte ``p`` (``p < total``); empty tensors hold nothing."""
        return bisect.bisect_right(prefix, p) - 1

    def after(p: int) -> int:  # the first boundary > p
        i = holder(p)
        return prefix[i] + ((p - prefix[i]) // grains[i] + 1) * grains[i]

    def before(p: int) -> int:  # the last boundary < p
        i = holder(p - 1)
        return prefix[i] + ((p - 1 - prefix[i]) // grains[i]) * grains[i]

    cuts = [0]
    highest = [total]  # highest[j]: the latest cut k = fragments - j may take
    for _ in range(fragments - 1):
        highest.append(before(highest[-1]))
    for k in range(1, fragments):
        target = total * k / fragments
        i = holder(min(int(target), total - 1))
        lo = prefix[i] + int((target - prefix[i]) // grains[i]) * grains[i]
        c = lo if target - lo <= lo + grains[i] - target else lo + grains[i]
        c = min(max(c, after(cuts[-1])), highest[fragments - k])
        cuts.append(c)
    cuts.append(total)
    out = []
    for k in range(fragments):
        a, b = cuts[k], cuts[k + 1]
        pieces = []
        for i in range(n):
            lo, hi = max(a, prefix[i]), min(b, prefix[i + 1])
            if lo < hi or (sizes[i] == 0 and a <= prefix[i] and (prefix[i] < b or b == total)):
                pieces.append((i, lo - prefix[i], hi - prefix[i]))
        out.append(pieces)
    return out


def long_run_period(schedule) -> int:
    """The interval between syncs in the long run: an int, :class:`Constant`, :class:`PostLocal`
    (after its warm-up), :class:`Increasing` (its ``max_period``) or :class:`Streaming` (each
    fragment's). ``ValueError`` for any other callable (its rate is unknown)."""
    if isinstance(schedule, bool):
        raise ValueError(f"not a schedule: {schedule!r}")
    if isinstance(schedule, int):
        return _check_int("period", schedule, 1)
    if isinstance(schedule, (Constant, PostLocal, Streaming)):
        return schedule.period
    if isinstance(schedule, Increasing):
        return schedule.max_period
    raise ValueError(f"the long-run period of {schedule!r} is unknown (use an int or a gradzip.schedules schedule)")
