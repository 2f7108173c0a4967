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

from .. import KERNEL_DTYPES
from . import LAUNCH, check, interpreting

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
    """Triton version of :func:`~gradzip.kernels.reference.abs_select_reference`.

    The output buffer holds ``2 * expected + 1024`` indices (all ``n`` without a
    guess); if more elements pass, the pass runs again with the exact count.
    """
    check("v", v, KERNEL_DTYPES)
    n = v.numel()
    dev = v.device
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    if isinstance(thr, torch.Tensor):
        # thr is a value of v's dtype (or any float): exact in float32 for the kernel's dtypes.
        thr_t = thr.detach().reshape(1).to(device=dev, dtype=torch.float32)
    else:
        thr_t = torch.tensor([float(thr)], dtype=v.dtype).to(device=dev, dtype=torch.float32)
    B = block or (BLOCK_INTERPRETER if interpreting() else BLOCK_GPU)
    grid = (triton.cdiv(n, B),)
    capacity = n if expected is None else min(n, 2 * int(expected) + 1024)
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    for _ in range(2):
        out = torch.empty(capacity, dtype=torch.int64, device=dev)
        _abs_select_kernel[grid](v, thr_t, out, counter, n, capacity, BLOCK=B, num_warps=NUM_WARPS, **LAUNCH)
        count = int(counter.item())
        if count <= capacity:
            break
        capacity = count
        counter.zero_()
    return out[:count].sort().values


AOT_SPECS = [
    {
        "kernel": _abs_select_kernel,
        "signature": {"v_ptr": vp, "thr_ptr": "*fp32", "out_ptr": "*i64", "counter_ptr": "*i64", "n": ni, "capacity": "i64"},
        "constexprs": {"BLOCK": BLOCK_GPU},
        "num_warps": NUM_WARPS,
        "divisible": ("n",),
    }
    for vp, ni in (("*fp32", "i32"), ("*fp16", "i32"), ("*bf16", "i64"))
]
