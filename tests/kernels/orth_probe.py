"""A Triton probe of the orthonormalization kernel's lane sums (``tests/kernels/test_orth.py``):
``_total`` and ``_total_rows`` of :mod:`gradzip.kernels.triton.orth` on float64 rows, the
float64 results written out (the kernel itself writes only float32 rows)."""

import torch
import triton
import triton.language as tl

from gradzip.kernels.orth import LANES
from gradzip.kernels.triton.orth import _total, _total_rows


@triton.jit
def _lane_sums_kernel(x_ptr, out_ptr, n, L: tl.constexpr, R: tl.constexpr):
    lanes = tl.arange(0, L)
    rows = tl.arange(0, R)
    acc = tl.zeros((R, L), tl.float64)
    one = tl.zeros((L,), tl.float64)
    for b in range(0, n, L):
        idx = b + lanes
        m = idx < n
        acc += tl.load(x_ptr + rows[:, None] * n + idx[None, :], mask=m[None, :], other=0.0)
        one += tl.load(x_ptr + idx, mask=m, other=0.0)
    tl.store(out_ptr + rows, _total_rows(acc, R))
    tl.store(out_ptr + R, _total(one))


def lane_sums(x: torch.Tensor) -> torch.Tensor:
    """The lane sum of each of the 4 float64 rows of ``x`` (``_total_rows``), then of row 0 (``_total``)."""
    assert x.dtype == torch.float64 and x.shape[0] == 4 and x.is_contiguous()
    out = torch.empty(5, dtype=torch.float64)
    _lane_sums_kernel[(1,)](x, out, x.shape[1], L=LANES, R=4)
    return out
