"""Orthonormal rows (PowerSGD's Gram-Schmidt) in Triton: every matrix of a call in one launch.

One program per matrix (the table's row ``(offset, k, n)``), so a matrix's result cannot
depend on the others of the call. The program follows :mod:`gradzip.kernels.orth` step for
step: each sum runs in ``LANES`` float64 lanes, a ``LANES``-wide vector that every iteration
over the row adds to in order, then folds by halves (``tl.reshape`` to ``(2, h)`` and a sum
over the axis of two: one addition, commutative, so the compiler's reduction order cannot
change it); square root and the float64 to float32 conversion are ``sqrt.rn.f64`` and
``cvt.rn.f32.f64``, the divide ``tl.div_rn``, and no multiply-add is fused (``LAUNCH``).
So the kernel gives the reference's floats bit for bit.

Per column ``i``: a sweep for its norm (the first column of a pass; later ones get it from the
previous column's update sweep), a sweep that normalizes it, and, for the later rows in chunks
of ``KC``, a sweep for their dot products with it and one that subtracts the projections and
adds the next row's squares. A barrier orders a sweep's stores before the next sweep's loads,
which other threads of the program may make.

Reference: :func:`gradzip.kernels.orth.orthonormalize_rows_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..orth import LANES
from . import LAUNCH, check, spec

__all__ = ["orthonormalize_rows_triton"]

KC = 4  # later rows per chunk of the dot-product and update sweeps
NUM_WARPS = 4
_TINY = float(torch.finfo(torch.float32).tiny)
_TABLES: dict = {}  # (rows, device) -> the table on the device; kept for a call's layout
if LANES != 512:  # _total and _total_rows fold 512 lanes
    raise ImportError(f"kernels/triton/orth.py folds 512 lanes, gradzip.kernels.orth.LANES is {LANES}")


@triton.jit
def _fold(acc, H: tl.constexpr):
    """``acc[i] + acc[H + i]`` for ``i < H``: a ``(2H,)`` vector to ``(H,)``."""
    return tl.sum(tl.reshape(acc, (2, H)), axis=0)


@triton.jit
def _fold_rows(acc, R: tl.constexpr, H: tl.constexpr):
    """:func:`_fold` of every row of an ``(R, 2H)`` tile."""
    return tl.sum(tl.reshape(acc, (R, 2, H)), axis=1)


@triton.jit
def _total(acc):
    """The lane sum of a ``(512,)`` float64 vector of lanes (``LANES`` = 512)."""
    acc = _fold(acc, 256)
    acc = _fold(acc, 128)
    acc = _fold(acc, 64)
    acc = _fold(acc, 32)
    acc = _fold(acc, 16)
    acc = _fold(acc, 8)
    acc = _fold(acc, 4)
    acc = _fold(acc, 2)
    acc = _fold(acc, 1)
    return tl.sum(acc, axis=0)


@triton.jit
def _total_rows(acc, R: tl.constexpr):
    """:func:`_total` of every row of an ``(R, 512)`` tile: ``(R,)``."""
    acc = _fold_rows(acc, R, 256)
    acc = _fold_rows(acc, R, 128)
    acc = _fold_rows(acc, R, 64)
    acc = _fold_rows(acc, R, 32)
    acc = _fold_rows(acc, R, 16)
    acc = _fold_rows(acc, R, 8)
    acc = _fold_rows(acc, R, 4)
    acc = _fold_rows(acc, R, 2)
    acc = _fold_rows(acc, R, 1)
    return tl.sum(acc, axis=1)


@triton.jit
def _norm(s, eps, tiny, HAS_EPS: tl.constexpr):
    """A row's float32 norm from its float64 lane sum of squares, ``eps`` added or ``tiny`` as a floor."""
    norm = tl.sqrt(s).to(tl.float32)
    if HAS_EPS:
        norm = norm + eps
    else:
        norm = tl.where(norm < tiny, tiny, norm)
    return norm


@triton.jit
def _orth_kernel(buf_ptr, table_ptr, eps, tiny, HAS_EPS: tl.constexpr, L: tl.constexpr, KC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    off = tl.load(table_ptr + 3 * pid)
    k = tl.load(table_ptr + 3 * pid + 1)
    n = tl.load(table_ptr + 3 * pid + 2)
    base = buf_ptr + off
    lanes = tl.arange(0, L)
    chunk = tl.arange(0, KC)
    passes = tl.where(k > 2, 2, 1)
    for _p in range(passes):
        acc = tl.zeros((L,), tl.float64)  # the first row's squares
        for b in range(0, n, L):
            idx = b + lanes
            x = tl.load(base + idx, mask=idx < n, other=0.0).to(tl.float64)
            acc += x * x
        s = _total(acc)
        for i in range(k):
            row = base + i * n
            norm = _norm(s, eps, tiny, HAS_EPS)
            for b in range(0, n, L):
                idx = b + lanes
                m = idx < n
                x = tl.load(row + idx, mask=m, other=0.0)
                tl.store(row + idx, tl.div_rn(x, norm), mask=m)
            tl.debug_barrier()
            for j0 in range(i + 1, k, KC):
                rows = j0 + chunk
                rmask = rows < k
                dots = tl.zeros((KC, L), tl.float64)
                for b in range(0, n, L):
                    idx = b + lanes
                    m = idx < n
                    x = tl.load(row + idx, mask=m, other=0.0).to(tl.float64)
                    r = tl.load(base + rows[:, None] * n + idx[None, :], mask=rmask[:, None] & m[None, :], other=0.0)
                    dots += x[None, :] * r.to(tl.float64)
                d = _total_rows(dots, KC).to(tl.float32)
                sq = tl.zeros((KC, L), tl.float64)  # squares of the updated rows (row i + 1's is used)
                for b in range(0, n, L):
                    idx = b + lanes
                    m = idx < n
                    tm = rmask[:, None] & m[None, :]
                    x = tl.load(row + idx, mask=m, other=0.0)
                    ptrs = base + rows[:, None] * n + idx[None, :]
                    r = tl.load(ptrs, mask=tm, other=0.0)
                    r = r - d[:, None] * x[None, :]
                    tl.store(ptrs, r, mask=tm)
                    w = r.to(tl.float64)
                    sq += tl.where(rows[:, None] == i + 1, w * w, 0.0)
                if j0 == i + 1:
                    s = tl.sum(_total_rows(sq, KC), axis=0)  # only row i + 1 is not zero
                tl.debug_barrier()


def _device_table(rows: tuple, device: torch.device) -> torch.Tensor:
    key = (rows, device)
    t = _TABLES.get(key)
    if t is None:
        if len(_TABLES) >= 256:
            _TABLES.clear()
        t = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(device)
        _TABLES[key] = t
    return t


def orthonormalize_rows_triton(buf: torch.Tensor, table, eps: float = 0.0) -> None:
    """Triton version of :func:`~gradzip.kernels.orth.orthonormalize_rows_reference` on a
    float32 buffer; ``table`` the checked rows of :func:`~gradzip.kernels.orth.orth_table`."""
    check("buf", buf, (torch.float32,))
    rows = tuple(table)
    if not rows:
        return
    t = _device_table(rows, buf.device)
    eps = float(eps)
    _orth_kernel[(len(rows),)](buf, t, eps, _TINY, HAS_EPS=eps > 0, L=LANES, KC=KC, num_warps=NUM_WARPS, **LAUNCH)


AOT_SPECS = [
    spec(
        _orth_kernel,
        {"buf_ptr": "*fp32", "table_ptr": "*i64", "eps": "fp32", "tiny": "fp32"},
        {"HAS_EPS": has_eps, "L": LANES, "KC": KC},
        num_warps=NUM_WARPS,
        divisible=(),
    )
    for has_eps in (False, True)
]
