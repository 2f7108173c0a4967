"""Top-k by a sampled threshold (DGC): the compaction pass, in Triton.

:func:`gradzip.kernels.sampled_topk` estimates the threshold on a sample with
``torch.topk`` (a few thousand elements), then calls :func:`abs_select_triton`:
one pass over ``v`` that selects ``|v| >= thr`` and compacts the indices. Each
program ranks its survivors with a prefix sum and claims its slot range with a
single atomic add, so output order between programs is arbitrary; the survivors
(about ``1.25 k``) are then sorted, which makes the result the reference's
ascending list. The threshold stays on the device (no host sync before the pass).

Reference: :func:`gradzip.kernels.reference.abs_select_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import compact_indices, select_threshold
from ..dispatch import KERNEL_DTYPES
from . import LAUNCH, check, size, spec

__all__ = ["abs_select_triton"]

BLOCK_GPU = 4096
BLOCK_INTERPRETER = 16384
NUM_WARPS = 8


@triton.jit
def _abs_select_kernel(v_ptr, thr_ptr, out_ptr, counter_ptr, n, capacity, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.abs(tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    thr = tl.load(thr_ptr)
    sel = (a >= thr) & mask
    s = sel.to(tl.int32)
    total = tl.sum(s, axis=0)
    start = tl.atomic_add(counter_ptr, total.to(tl.int64), sem="relaxed")
    dst = start + (tl.cumsum(s, axis=0) - 1).to(tl.int64)
    tl.store(out_ptr + dst, offs, mask=sel & (dst < capacity))


def abs_select_triton(v: torch.Tensor, thr, expected: int | None = None, *, block: int | None = None) -> torch.Tensor:
    """Triton version of :func:`~gradzip.kernels.reference.abs_select_reference`; the output
    buffer is sized from ``expected`` (:func:`~gradzip.kernels.device.compact_indices`)."""
    check("v", v, KERNEL_DTYPES)
    n = v.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=v.device)
    thr_t = select_threshold(v, thr)
    B = size("block", block, BLOCK_GPU, BLOCK_INTERPRETER)

    def launch(out, counter, capacity):
        _abs_select_kernel[(triton.cdiv(n, B),)](
            v, thr_t, out, counter, n, capacity, BLOCK=B, num_warps=NUM_WARPS, **LAUNCH
        )

    return compact_indices(launch, n, expected, v.device)


AOT_SPECS = [
    spec(
        _abs_select_kernel,
        {"v_ptr": vp, "thr_ptr": "*fp32", "out_ptr": "*i64", "counter_ptr": "*i64", "n": ni, "capacity": "i64"},
        {"BLOCK": BLOCK_GPU},
        num_warps=NUM_WARPS,
    )
    for vp, ni in (("*fp32", "i32"), ("*fp16", "i32"), ("*bf16", "i64"))
]
