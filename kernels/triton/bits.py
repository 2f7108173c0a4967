"""Bit packing of unsigned integers of any width (the dispatched :func:`gradzip.kernels.pack_uint`
and :func:`~gradzip.kernels.unpack_uint`, whose reference is ``bitpack``'s), in Triton.

* :func:`_pack_uint_kernel`: a program writes ``BLOCK`` output bytes of one row, each the OR
  of the bits of the at most ``MAXV`` values that reach into it.
* :func:`_unpack_uint_kernel`: a program reads ``BLOCK`` values of one row, each from the at
  most ``NB`` bytes its bits lie in.

Both take 2-D rows (each a stream of its own, padded to a byte), a row a program column; a 1-D
stream is one row. The torch route (``bitpack``'s shifts and sums, about ten operations a call)
is the reference: the same bytes and values (``tests/kernels/test_triton.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LAUNCH, size, spec

__all__ = ["pack_uint_triton", "unpack_uint_triton"]

BLOCK_GPU = 1024
BLOCK_INTERPRETER = 4096


@triton.jit
def _pack_uint_kernel(
    v_ptr, out_ptr, n, nbytes, v_row, out_row, BITS: tl.constexpr, MAXV: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    m = j < nbytes
    first_bit = j * 8
    i0 = first_bit // BITS
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for t in tl.static_range(MAXV):
        i = i0 + t
        ok = m & (i < n) & (i * BITS < first_bit + 8)
        v = tl.load(v_ptr + row * v_row + i, mask=ok, other=0).to(tl.int64)
        sh = i * BITS - first_bit  # where the value's bit 0 lands in this byte (may be below it)
        part = tl.where(sh >= 0, v << tl.maximum(sh, 0), v >> tl.maximum(-sh, 0))
        acc = acc | (part & 0xFF)
    tl.store(out_ptr + row * out_row + j, acc.to(tl.uint8), mask=m)


@triton.jit
def _unpack_uint_kernel(
    p_ptr, out_ptr, n, p_row, out_row, BITS: tl.constexpr, MASK: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = i * BITS
    b0 = s // 8
    off = s - b0 * 8
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for t in tl.static_range(NB):
        ok = m & (t * 8 < off + BITS)  # byte b0 + t holds some of the value's bits
        byte = tl.load(p_ptr + row * p_row + b0 + t, mask=ok, other=0).to(tl.int64)
        sh = t * 8 - off
        part = tl.where(sh >= 0, byte << tl.minimum(tl.maximum(sh, 0), 63), byte >> tl.maximum(-sh, 0))
        acc = acc | part
    tl.store(out_ptr + row * out_row + i, acc & MASK, mask=m)


def _rows(t: torch.Tensor):
    """``(t as rows, rows, row stride)``: a 1-D stream is one row; rows apart (a view of a
    round's frames) are read where they lie, a copy only where their elements are apart."""
    t2 = t if t.dim() == 2 else t.reshape(1, -1)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2, t2.shape[0], (t2.stride(0) if t2.shape[0] > 1 else t2.shape[1])


def pack_uint_triton(values: torch.Tensor, bits: int, *, block: int | None = None) -> torch.Tensor:
    """:func:`~gradzip.kernels.bitpack.pack_uint` of int64 ``values`` (1-D, or 2-D rows): one launch."""
    if values.dtype != torch.int64:
        raise TypeError(f"values must be int64, got {values.dtype}")
    v, rows, vrow = _rows(values)
    n = v.shape[1]
    nbytes = (n * bits + 7) // 8
    out = torch.empty(rows, nbytes, dtype=torch.uint8, device=values.device)
    if rows and nbytes:
        B = size("block", block, BLOCK_GPU, BLOCK_INTERPRETER)
        _pack_uint_kernel[(triton.cdiv(nbytes, B), rows)](
            v, out, n, nbytes, vrow, nbytes, BITS=bits, MAXV=-(-8 // bits) + 1, BLOCK=B, num_warps=4, **LAUNCH
        )
    return out if values.dim() == 2 else out.reshape(-1)


def unpack_uint_triton(packed: torch.Tensor, n: int, bits: int, *, block: int | None = None) -> torch.Tensor:
    """:func:`~gradzip.kernels.bitpack.unpack_uint` of uint8 ``packed`` (1-D, or 2-D rows), holding
    at least ``ceil(n * bits / 8)`` bytes a row: one launch."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    p, rows, prow = _rows(packed)
    out = torch.empty(rows, n, dtype=torch.int64, device=packed.device)
    if rows and n:
        B = size("block", block, BLOCK_GPU, BLOCK_INTERPRETER)
        _unpack_uint_kernel[(triton.cdiv(n, B), rows)](
            p, out, n, prow, n, BITS=bits, MASK=(1 << bits) - 1, NB=(bits + 14) // 8, BLOCK=B, num_warps=4, **LAUNCH
        )
    return out if packed.dim() == 2 else out.reshape(-1)


AOT_SPECS = [
    *(
        spec(
            _pack_uint_kernel,
            {"v_ptr": "*i64", "out_ptr": "*u8", "n": "i64", "nbytes": "i64", "v_row": "i64", "out_row": "i64"},
            {"BITS": bits, "MAXV": -(-8 // bits) + 1, "BLOCK": BLOCK_GPU},
            num_warps=4,
            divisible=(),
        )
        for bits in (1, 6, 7, 13)
    ),
    *(
        spec(
            _unpack_uint_kernel,
            {"p_ptr": "*u8", "out_ptr": "*i64", "n": "i64", "p_row": "i64", "out_row": "i64"},
            {"BITS": bits, "MASK": (1 << bits) - 1, "NB": (bits + 14) // 8, "BLOCK": BLOCK_GPU},
            num_warps=4,
            divisible=(),
        )
        for bits in (1, 6, 7, 13, 63)
    ),
]
