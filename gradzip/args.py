"""Argument checks shared by every constructor: one place, one wording.

Numbers may be Python numbers, NumPy scalars (``np.float32(0.1)``) or 0-d torch
tensors; booleans are never numbers. Each check returns the value as a plain
Python ``int``/``float`` and raises ``ValueError`` naming the argument and the
range it must lie in.
"""
from __future__ import annotations

import math
import numbers

import torch

__all__ = ["number", "integer", "ratio", "choice", "flag", "optional"]


def _plain(value):
    """A Python number for a Python, NumPy or 0-d torch number; ``None`` for anything else."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex():
            return None
        value = value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _range(lo, hi, lo_open: bool, hi_open: bool) -> str:
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else format(lo, 'g')}, {'inf' if hi is None else format(hi, 'g')}{right}"


def number(name: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite real number in the range (``lo``/``hi`` None: unbounded on that side)."""
    v = _plain(value)
    ok = v is not None and math.isfinite(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        raise ValueError(f"{name} must be a finite number in {_range(lo, hi, lo_open, hi_open)}, got {value!r}")
    return float(v)


def integer(name: str, value, lo=None, hi=None) -> int:
    """An integer in ``[lo, hi]`` (None: unbounded)."""
    v = _plain(value)
    ok = isinstance(v, int) and (lo is None or v >= lo) and (hi is None or v <= hi)
    if not ok:
        raise ValueError(f"{name} must be an integer in {_range(lo, hi, False, False)}, got {value!r}")
    return v


def ratio(name: str, value) -> float:
    """A number in ``(0, 1]``."""
    return number(name, value, 0.0, 1.0, lo_open=True)


def choice(name: str, value, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def optional(check, name: str, value, *a, **kw):
    """``None``, or what ``check(name, value, ...)`` accepts."""
    if value is None:
        return None
    try:
        return check(name, value, *a, **kw)
    except ValueError as e:
        raise ValueError(f"{e.args[0].split(', got')[0].replace(' must be ', ' must be None or ', 1)}, got {value!r}") from None
