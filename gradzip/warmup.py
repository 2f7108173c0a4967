"""Schedules for a codec's parameters: a ratio, density, rank or level count that changes with the step.

DGC warms sparsity up: the density falls exponentially over the first epochs (25%,
6.25%, 1.56%, 0.4%, 0.1%), so that error feedback starts from small residuals. Any
codec argument documented as accepting a schedule takes one of these in place of a
number; it is evaluated at the tensor's step (``TensorContext.step``, the engine's step
counter), so it needs no state of its own: the engine's step, saved in ``state_dict()``,
puts it back where it was::

    gz.TopK(ratio=gz.warmup.Exponential(0.25, 0.001, steps=4 * steps_per_epoch, stages=5))
    gz.PowerSGD(rank=gz.warmup.Linear(8, 1, steps=1000))

Both parse in the method grammar (``TopK(ratio=Exponential(0.25, 0.001, steps=500, stages=5))``).
"""

from __future__ import annotations

import math

import gradzip.args as args

from .registry import Registered

__all__ = ["Ramp", "Exponential", "Linear", "at", "check"]


class Ramp(Registered, register=False):
    """A value that moves from ``start`` (step 0) to ``end`` (from step ``steps`` on)."""

    kind = "schedule"

    def __init__(self, start: float, end: float, steps: int, stages: int = 0) -> None:
        self.start = args.number("start", start)
        self.end = args.number("end", end)
        self.steps = args.integer("steps", steps, 1)
        self.stages = args.integer("stages", stages, 0)
        if self.stages == 1:
            raise ValueError("stages must be 0 (continuous) or an integer in [2, inf), got 1")

    def fraction(self, step: int) -> float:
        """How far along at ``step``: 0 at the start, 1 from ``steps`` on; with ``stages``,
        held at ``stages`` levels ``0, 1/(stages-1), ..., 1``, each for ``steps/(stages-1)`` steps."""
        f = min(max(step, 0) / self.steps, 1.0)
        if self.stages:
            f = math.floor(f * (self.stages - 1)) / (self.stages - 1)
        return f

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def bounds(self) -> tuple[float, float]:
        return min(self.start, self.end), max(self.start, self.end)


class Exponential(Ramp):
    """Geometric interpolation: ``start * (end / start) ** fraction`` (``start``, ``end`` > 0)."""

    def __init__(self, start: float, end: float, steps: int, stages: int = 0) -> None:
        super().__init__(start, end, steps, stages)
        if self.start <= 0 or self.end <= 0:
            raise ValueError(f"Exponential needs start and end in (0, inf), got {start!r} and {end!r}")

    def __call__(self, step: int) -> float:
        return self.start * (self.end / self.start) ** self.fraction(step)


class Linear(Ramp):
    """Linear interpolation: ``start + (end - start) * fraction``."""

    def __call__(self, step: int) -> float:
        return self.start + (self.end - self.start) * self.fraction(step)


def at(value, step: int):
    """``value`` at ``step``: a schedule's value there, or the number itself."""
    return value(step) if isinstance(value, Ramp) else value


def check(check_fn, name: str, value, *a, integer: bool = False, **kw):
    """A number checked by ``check_fn`` (e.g. ``args.ratio``), or a schedule whose ``start`` and
    ``end`` pass it (rounded, for an integer argument)."""
    if isinstance(value, Ramp):
        for v in (value.start, value.end):
            check_fn(name, round(v) if integer else v, *a, **kw)
        return value
    return check_fn(name, value, *a, **kw)
