"""Philox4x32-10, the counter-based RNG of ``tl.rand`` / ``tl.rand4x``, in torch.

``tl.randint4x(seed, offset)`` (triton/language/random.py) runs Philox4x32 for 10 rounds on
the counter (offset_lo, offset_hi, 0, 0) with the key (seed_lo, seed_hi) (the seed as uint64,
split into 32-bit halves; offset as uint64 likewise) and returns the four output words;
``tl.randint`` keeps the first. ``tl.rand`` / ``tl.rand4x`` bitcast each uint32 to int32, map
x -> ~x where negative (so into [0, 2**31)), convert to float32 (round to nearest even) and
multiply in float32 by 4.6566127342e-10 (float32), the largest scale with
(2**31 - 1) * scale < 1.

The quantizers draw element ``i``'s uniform from word ``i % 4`` of the counter ``i // 4``
(``tl.rand4x(seed, i // 4)``): one Philox evaluation serves four elements, a quarter of the
integer work of ``tl.rand(seed, i)``. :func:`philox_uniform` computes the same floats bit for
bit with int64 tensors holding uint32 values, on any device: it is the draw of every
quantizer on every backend.
"""

from __future__ import annotations

import torch

__all__ = ["philox4x32", "philox_randint", "philox_uniform"]

_M32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_ROUNDS = 10
_UNIFORM_SCALE = 4.6566127342e-10  # rounded to float32 where it is used


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` (``a`` a uint32 constant, ``b`` int64 holding uint32),
    without overflowing int64: ``b`` is split into 16-bit halves."""
    p_lo = (b & 0xFFFF) * a  # < 2**48
    t = (b >> 16) * a + (p_lo >> 16)  # a * b == t * 2**16 + (p_lo & 0xFFFF), t < 2**49
    return t >> 16, ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def philox4x32(
    seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, rounds: int = _PHILOX_ROUNDS
):
    """Philox4x32-``rounds`` on counters (int64 tensors holding uint32) under the key ``seed`` (uint64).

    Returns the four output words, as Triton's ``philox_impl`` computes them.
    """
    seed = int(seed) & ((1 << 64) - 1)
    k0, k1 = seed & _M32, seed >> 32
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def philox_randint(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """``tl.randint(seed, offsets)`` as int64 values in [0, 2**32) (offsets int64, >= 0)."""
    off = offsets.to(torch.int64)
    zero = torch.zeros_like(off)
    return philox4x32(seed, off & _M32, (off >> 32) & _M32, zero, zero)[0]


def philox_uniform(seed: int, n: int, device=None, *, offset: int = 0) -> torch.Tensor:
    """``n`` float32 draws in [0, 1) for the elements ``offset .. offset + n - 1``: element ``i``
    takes word ``i % 4`` of ``tl.rand4x(seed, i // 4)``, bit for bit.

    The draws take the values ``k * 4.6566127342e-10`` (float32, rounded) for an integer
    ``k`` in [0, 2**31), so ``P(u < p) = p`` up to float32 rounding (about 2**-24).
    """
    first = offset // 4
    q = torch.arange(first, (offset + n + 3) // 4, dtype=torch.int64, device=device)
    zero = torch.zeros_like(q)
    words = philox4x32(seed, q & _M32, (q >> 32) & _M32, zero, zero)
    start = offset - 4 * first
    x = torch.stack(words, dim=1).reshape(-1)[start : start + n]
    x = torch.where(x >= 1 << 31, _M32 - x, x)  # int32 bitcast, then ~x where negative
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=device)
