"""Argument checks shared by every constructor: one place, one wording.

Numbers may be Python numbers, NumPy scalars (``np.float32(0.1)``) or 0-d torch
tensors; booleans are never numbers. Each check returns the value as a plain
Python ``int``/``float`` and raises ``ValueError`` naming the argument and the
range it must lie in.

Also the unit parsers of link speeds and durations (:func:`bandwidth`,
:func:`duration`). This module does not import torch (``gradzip --help`` parses its
options with it before torch is loaded): a torch tensor can only be a value once torch
is in ``sys.modules``.
"""

from __future__ import annotations

import math
import numbers
import re
import sys

__all__ = [
    "number",
    "integer",
    "ratio",
    "choice",
    "flag",
    "optional",
    "bandwidth",
    "duration",
    "BANDWIDTH_FORMS",
    "DURATION_FORMS",
]


def _plain(value):
    """A Python number for a Python, NumPy or 0-d torch number; ``None`` for anything else."""
    torch = sys.modules.get("torch")  # a tensor cannot exist before torch is imported
    is_tensor = torch is not None and isinstance(value, torch.Tensor)
    if isinstance(value, bool) or (is_tensor and value.dtype == torch.bool):
        return None
    if is_tensor:
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
        raise ValueError(
            f"{e.args[0].split(', got')[0].replace(' must be ', ' must be None or ', 1)}, got {value!r}"
        ) from None


# -- units ------------------------------------------------------------------------------------
_BW_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_DIVISORS = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divide: 50 / 1e6 == 5e-5 exactly
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
#: Accepted forms, for error messages.
BANDWIDTH_FORMS = "'10Gbit', '100Mbit/s', '100mbps', '10G' (bits/s), '1.25GB/s' (bytes/s)"
DURATION_FORMS = "'5us', '1ms', '0.2s', '100ns'"


def bandwidth(name: str, value, *, unit: bool = False) -> float:
    """Bits per second from a number or a string such as ``"1Gbit"``, ``"100mbps"``, ``"10G"``.

    Units are decimal (``k`` = 1e3) and in bits; ``"B"``/``"byte"`` suffixes mean bytes
    (``"125MB/s"`` = 1e9 bit/s). A Python number is bits/s. ``unit=True`` (the command
    line) refuses a string without a unit or prefix, such as ``"10"``: bits/s or Gbit/s?
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of bits/s or a string like '1Gbit', got {value!r}")
    if isinstance(value, (int, float)):
        bps = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(
            r"\s*" + _NUM + r"\s*([kKmMgGtT]?)(bit/s|bits/s|bit|bits|bps|b/s|B/s|B|byte/s|bytes/s|byte|bytes)?\s*",
            value,
        )
        if not m:
            raise ValueError(f"{name} must look like {BANDWIDTH_FORMS}, got {value!r}")
        num, prefix, suffix = m.groups()
        if unit and not prefix and not suffix:
            raise ValueError(f"{name} needs a unit: {value!r} could be bits/s or Gbit/s; write e.g. {BANDWIDTH_FORMS}")
        bps = float(num) * _BW_UNITS[prefix.lower()] * (8.0 if suffix and suffix.startswith(("B", "byte")) else 1.0)
    else:
        raise ValueError(f"{name} must be a number of bits/s or a string like '1Gbit', got {value!r}")
    if not (math.isfinite(bps) and bps > 0):
        raise ValueError(f"{name} must be in (0, inf) bits/s, got {value!r}")
    return bps


def duration(name: str, value, *, unit: bool = False) -> float:
    """Seconds from a number or a string such as ``"50us"``, ``"0.2ms"``, ``"1.5s"``.

    A Python number is seconds. ``unit=True`` (the command line) refuses a string without
    a unit, such as ``"5"`` (seconds or milliseconds?), except ``"0"``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds or a string like '50us', got {value!r}")
    if isinstance(value, (int, float)):
        s = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*" + _NUM + r"\s*(s|ms|us|µs|ns)?\s*", value)
        if not m:
            raise ValueError(f"{name} must look like {DURATION_FORMS}, got {value!r}")
        s = float(m.group(1)) / _TIME_DIVISORS[m.group(2) or ""]
        if unit and not m.group(2) and s != 0:
            raise ValueError(
                f"{name} needs a unit: {value!r} could be seconds or milliseconds; write e.g. {DURATION_FORMS}"
            )
    else:
        raise ValueError(f"{name} must be a number of seconds or a string like '50us', got {value!r}")
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(f"{name} must be in [0, inf) seconds, got {value!r}")
    return s
