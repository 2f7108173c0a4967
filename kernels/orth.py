"""Orthonormal rows by modified Gram-Schmidt, many matrices in one call: the reference.

PowerSGD orthonormalizes the columns of every ``P`` and ``Q`` of a call (stored transposed:
the rows of a ``k x n`` matrix). As torch ops that is some twenty operations a column, for
every batch of one shape: 26 ms of a ResNet-50 step under cProfile on an H200, the step
42.7 ms without it (``benchmarks/results/dryrun_profile_nvidia-h200.txt``).
:func:`orthonormalize_rows_` takes every matrix of a call in one
buffer and a table of where each lies; its kernels (:mod:`.numba_ops`, :mod:`.triton.orth`)
run them all in one call, one matrix a program on a GPU.

The result of a matrix depends on that matrix alone: not on the other matrices of the call,
its place in the buffer, the number of threads or the device. So every implementation gives
the reference's floats bit for bit, and a resumed run (DDP groups its tensors differently
after a bucket rebuild) equals the unbroken one. What makes that possible is one definition
of each sum, used everywhere:

* **Lane sums.** A sum over a row's ``n`` products runs in :data:`LANES` lanes: lane ``l``
  adds, in order and in float64, the products at ``l, l + LANES, l + 2 LANES, ...`` to a
  ``+0.0``; then the lanes are folded by halves (``lane[i] += lane[i + h]`` for ``h =
  LANES/2, ..., 1``). Every addition is one IEEE operation in a fixed order, and each fold
  adds two numbers (commutative), so a GPU's reduction tree cannot reorder it. The products
  of two float32 values are exact in float64.
* **Per column** ``i`` (rows ``r``, working dtype ``W``: float32, or float64 for float64
  matrices)::

      norm  = W(sqrt(lanesum(r_i * r_i)))         sqrt correctly rounded, then one rounding to W
      norm  = W(norm + W(eps))   if eps > 0, else tiny where norm < tiny (a NaN stays NaN)
      r_i   = W(r_i / norm)
      d_j   = W(lanesum(r_i * r_j))               for every later row j
      r_j   = W(r_j - W(d_j * r_i))

  the whole pass twice when ``k > 2`` (re-orthogonalization: one pass loses orthogonality on
  ill-conditioned input). Every step is one correctly rounded operation (no fused
  multiply-add), so float64 arithmetic rounded to float32 gives the float32 result.

A zero row stays zero with ``eps == 0`` (``0 / tiny``), as a zero gradient must give ``P = 0``.
This is torch's ``_orthogonalize_gram_schmidt`` (its ``k <= 2`` path) with float64 sums in
place of float32 ones: within rounding of torch's result, more accurate, and the same on
every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["LANES", "orth_table", "orthonormalize_rows_reference", "lanesum_reference", "orth_passes"]

#: Lanes of every sum (a power of two): part of the definition, so every backend uses it.
LANES = 512


def orth_passes(k: int) -> int:
    """Gram-Schmidt passes for ``k`` rows: two above 2 (re-orthogonalization), else one."""
    return 2 if k > 2 else 1


def orth_table(buf: torch.Tensor, table) -> tuple[tuple[int, int, int], ...]:
    """``table`` (rows ``(offset, k, n)``: a sequence, or an int tensor of shape ``(M, 3)``) as a
    tuple of int triples, checked against ``buf``: every matrix inside it, ``1 <= k <= n``,
    no two overlapping (a ``ValueError`` otherwise)."""
    if isinstance(table, torch.Tensor):
        table = table.reshape(-1, 3).tolist()
    rows = tuple((int(o), int(k), int(n)) for o, k, n in table)
    end = 0
    for o, k, n in sorted(rows):
        if not 1 <= k <= n:
            raise ValueError(f"orthonormalize_rows_: a matrix needs 1 <= k <= n rows, got k={k}, n={n}")
        if o < 0:
            raise ValueError(f"orthonormalize_rows_: negative offset {o}")
        if o < end:
            raise ValueError(f"orthonormalize_rows_: the matrix at offset {o} overlaps the one before it")
        end = o + k * n
        if end > buf.numel():
            raise ValueError(
                f"orthonormalize_rows_: the {k} x {n} matrix at offset {o} lies outside the buffer of "
                f"{buf.numel()} elements"
            )
    return rows


def lanesum_reference(p: torch.Tensor) -> torch.Tensor:
    """The lane sum (module docstring) of the last dimension of float64 ``p``: shape ``p.shape[:-1]``."""
    n = p.shape[-1]
    nb = max(1, -(-n // LANES))
    q = F.pad(p, (0, nb * LANES - n)).reshape(*p.shape[:-1], nb, LANES)
    acc = torch.zeros(*p.shape[:-1], LANES, dtype=torch.float64, device=p.device)
    for b in range(nb):
        acc = acc + q[..., b, :]
    h = LANES // 2
    while h >= 1:
        acc = acc[..., :h] + acc[..., h : 2 * h]
        h //= 2
    return acc[..., 0]


def _gram_schmidt_pass(a: torch.Tensor, eps: float) -> None:
    """One pass over the rows of ``a`` (``k x n``, working dtype), in place."""
    w = a.dtype
    tiny = torch.finfo(w).tiny
    for i in range(a.shape[0]):
        ri = a[i]
        wide = ri.to(torch.float64)
        norm = torch.sqrt(lanesum_reference(wide * wide)).to(w)
        if eps > 0:
            norm = norm + torch.tensor(eps, dtype=w)
        else:
            norm = torch.where(norm < tiny, torch.tensor(tiny, dtype=w), norm)
        ri.copy_(ri / norm)
        if i + 1 < a.shape[0]:
            rest = a[i + 1 :]
            d = lanesum_reference(ri.to(torch.float64) * rest.to(torch.float64)).to(w)
            rest.sub_(d[:, None] * ri[None, :])


def orthonormalize_rows_reference(buf: torch.Tensor, table, eps: float = 0.0) -> None:
    """:func:`gradzip.kernels.orthonormalize_rows_` in torch ops, matrix by matrix."""
    for off, k, n in orth_table(buf, table):
        a = buf[off : off + k * n].view(k, n)
        for _ in range(orth_passes(k)):
            _gram_schmidt_pass(a, eps)
