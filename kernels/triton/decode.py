"""Decode-and-accumulate of peers' payloads into one float32 buffer, in Triton.

* :func:`_decode_add_bitmap2_kernel`: N peers' 2-bit bitmaps in one pass. Each
  program loads its slice of ``out`` once, adds every peer's ``+-tau`` in peer
  order (so the floats are the reference's), and stores once: ``8 + N/4`` bytes
  per element, no N-fold intermediate. Bodies that live in one buffer (the
  all-gathered messages) are read in place through byte offsets from its base.
* :func:`_scatter_add_signed_kernel`: one peer's signed index words.
* :func:`_scatter_add_sparse_kernel`: one peer's top-k frame (int32/int64
  indices, float32/16/bf16 values).

The scatters read, add and write each target once. The indices of one frame are
distinct (every encoder here writes them so), so this is exact and needs no
atomics; peers are applied one launch after the other, in order, because two
peers may hit the same element and float addition does not commute bit for bit.

References: ``decode_add_bitmap2_reference``, ``scatter_add_signed_reference``,
``scatter_add_sparse_reference`` in :mod:`gradzip.kernels.reference`.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import KERNEL_DTYPES
from . import LAUNCH, check, interpreting

__all__ = ["decode_add_bitmap2_triton", "scatter_add_signed_triton", "scatter_add_sparse_triton"]

NUM_WARPS = 8
BYTES_GPU = 1024  # bitmap bytes per program (4096 elements)
BYTES_INTERPRETER = 4096
SCATTER_GPU = 1024
SCATTER_INTERPRETER = 8192


@triton.jit
def _decode_add_bitmap2_kernel(out_ptr, base_ptr, offs_ptr, taus_ptr, n, npeers, BYTES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BYTES + tl.arange(0, BYTES)
    cols = tl.arange(0, 4)
    idx = rows[:, None] * 4 + cols[None, :]
    mask = idx < n
    nbytes = (n + 3) // 4
    bmask = rows < nbytes
    acc = tl.load(out_ptr + idx, mask=mask, other=0.0)
    for p in range(npeers):
        off = tl.load(offs_ptr + p)
        tau = tl.load(taus_ptr + p)
        b = tl.load(base_ptr + off + rows, mask=bmask, other=0).to(tl.int32)
        code = (b[:, None] >> (cols * 2)[None, :]) & 3
        # The reference's (code == 1) * tau - (code == 2) * tau, products by 0/1 exact.
        acc = acc + ((code == 1).to(tl.float32) * tau - (code == 2).to(tl.float32) * tau)
    tl.store(out_ptr + idx, acc, mask=mask)


@triton.jit
def _scatter_add_signed_kernel(out_ptr, words_ptr, tau, k, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    w = tl.load(words_ptr + offs, mask=m, other=0)
    idx = (w & 0x7FFFFFFF).to(tl.int64)
    val = tl.where(w < 0, -tau, tau)
    ok = m & (idx < n)
    cur = tl.load(out_ptr + idx, mask=ok, other=0.0)
    tl.store(out_ptr + idx, cur + val, mask=ok)


@triton.jit
def _scatter_add_sparse_kernel(out_ptr, idx_ptr, val_ptr, k, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    idx = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
    val = tl.load(val_ptr + offs, mask=m, other=0.0).to(tl.float32)
    ok = m & (idx >= 0) & (idx < n)
    cur = tl.load(out_ptr + idx, mask=ok, other=0.0)
    tl.store(out_ptr + idx, cur + val, mask=ok)


def _shared_base(bodies: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One uint8 tensor holding every body, and each body's byte offset in it.

    Bodies that are views of one storage (peers' frames in the gathered buffer)
    are addressed in place; otherwise they are concatenated.
    """
    st = bodies[0].untyped_storage()
    if all(b.is_contiguous() and b.untyped_storage().data_ptr() == st.data_ptr() for b in bodies):
        base = torch.empty(0, dtype=torch.uint8, device=bodies[0].device).set_(st, 0, (st.nbytes(),))
        return base, [b.storage_offset() for b in bodies]
    offsets, pos = [], 0
    for b in bodies:
        offsets.append(pos)
        pos += b.numel()
    return torch.cat([b.reshape(-1) for b in bodies]), offsets


def decode_add_bitmap2_triton(
    out: torch.Tensor, bodies: Sequence[torch.Tensor], taus: Sequence[float], *, block_bytes: int | None = None
) -> None:
    check("out", out, (torch.float32,))
    for i, b in enumerate(bodies):
        check(f"body {i}", b, (torch.uint8,), out.device)
    n = out.numel()
    B = block_bytes or (BYTES_INTERPRETER if interpreting() else BYTES_GPU)
    base, offsets = _shared_base(bodies)
    offs = torch.tensor(offsets, dtype=torch.int64).to(out.device)
    taus32 = torch.tensor(list(taus), dtype=torch.float32).to(out.device)
    grid = (triton.cdiv(triton.cdiv(n, 4), B),)
    _decode_add_bitmap2_kernel[grid](out, base, offs, taus32, n, len(bodies), BYTES=B, num_warps=NUM_WARPS, **LAUNCH)


def _scatter_block(block: int | None) -> int:
    return block or (SCATTER_INTERPRETER if interpreting() else SCATTER_GPU)


def scatter_add_signed_triton(out: torch.Tensor, words: torch.Tensor, tau: float, *, block: int | None = None) -> None:
    check("out", out, (torch.float32,))
    check("words", words, (torch.int32,), out.device)
    k = words.numel()
    B = _scatter_block(block)
    tau32 = float(torch.tensor(tau, dtype=torch.float32))
    _scatter_add_signed_kernel[(triton.cdiv(k, B),)](out, words, tau32, k, out.numel(), BLOCK=B, num_warps=4, **LAUNCH)


def scatter_add_sparse_triton(
    out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, *, block: int | None = None
) -> None:
    check("out", out, (torch.float32,))
    check("idx", idx, (torch.int32, torch.int64), out.device)
    check("vals", vals, KERNEL_DTYPES, out.device)
    k = idx.numel()
    B = _scatter_block(block)
    _scatter_add_sparse_kernel[(triton.cdiv(k, B),)](out, idx, vals, k, out.numel(), BLOCK=B, num_warps=4, **LAUNCH)


AOT_SPECS = [
    {
        "kernel": _decode_add_bitmap2_kernel,
        "signature": {"out_ptr": "*fp32", "base_ptr": "*u8", "offs_ptr": "*i64", "taus_ptr": "*fp32", "n": "i32", "npeers": "i32"},
        "constexprs": {"BYTES": BYTES_GPU},
        "num_warps": NUM_WARPS,
        "divisible": ("n",),
    },
    {
        "kernel": _scatter_add_signed_kernel,
        "signature": {"out_ptr": "*fp32", "words_ptr": "*i32", "tau": "fp32", "k": "i32", "n": "i64"},
        "constexprs": {"BLOCK": SCATTER_GPU},
        "num_warps": 4,
    },
] + [
    {
        "kernel": _scatter_add_sparse_kernel,
        "signature": {"out_ptr": "*fp32", "idx_ptr": ip, "val_ptr": vp, "k": "i32", "n": "i64"},
        "constexprs": {"BLOCK": SCATTER_GPU},
        "num_warps": 4,
    }
    for ip, vp in (("*i32", "*fp32"), ("*i32", "*fp16"), ("*i64", "*bf16"))
]
