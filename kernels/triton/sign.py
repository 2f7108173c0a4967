"""Scaled sign with error feedback (SignSGD) in Triton: :func:`sign_ef_triton`.

``v = x + r`` (float32); ``S_b = mean |v|`` per block (float64 sum, divided and rounded
once; 0 where it exceeds float32's range); bit ``i`` of the int32 words is ``v_i < 0``; the
new residual is ``v - where(v < 0, -S_b, S_b)``. One pass (:func:`_sign_onepass_kernel`)
where a program can own whole blocks, else two (the block chunks' sums by
:func:`~.blocks.block_stats_triton`, every block's scale by :func:`_sign_scales_kernel`, then
:func:`_sign_encode_kernel`): see :mod:`.blocks`.

The residual may be written over the residual read (``out`` is ``residual``) or over ``x``:
each element is loaded before it is stored, by the same program, in both routes.

Reference: :func:`gradzip.kernels.quant.sign_ef_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import KERNEL_DTYPES
from ..quant import quant_layout
from ..reference import wants_residual
from . import LAUNCH, check, load_compensated, row_tile, spec
from .blocks import (
    NUM_WARPS,
    STAT_SUM_ABS,
    TILE_GPU,
    _block_of,
    _fit_f32,
    _onepass_tile,
    block_stats_triton,
    choose_route,
    tile_size,
)

__all__ = ["sign_ef_triton"]


@triton.jit
def _sign_encode_kernel(
    x_ptr,
    r_ptr,
    rout_ptr,
    scales_ptr,
    words_ptr,
    n,
    b,
    HAS_R: tl.constexpr,
    WRITE_R: tl.constexpr,
    WORDS: tl.constexpr,
    WIDE: tl.constexpr,
):
    pid, w, cols, offs, mask = row_tile(n, WORDS, 32)
    v = load_compensated(x_ptr, r_ptr, offs, mask, HAS_R)
    neg = (v < 0) & mask
    # Disjoint bits: the sum is the OR (bit 31 makes it negative, as pack_bits' int32).
    word = tl.sum(neg.to(tl.int32) << cols[None, :], axis=1)
    tl.store(words_ptr + w, word, mask=w < (n + 31) // 32)
    if WRITE_R:
        s = tl.load(scales_ptr + _block_of(offs, pid * WORDS * 32, b, WIDE), mask=mask, other=0.0)
        tl.store(rout_ptr + offs, v - tl.where(neg, -s, s), mask=mask)


@triton.jit
def _sign_onepass_kernel(
    x_ptr,
    r_ptr,
    rout_ptr,
    scales_ptr,
    words_ptr,
    n,
    b,
    nb,
    HAS_R: tl.constexpr,
    WRITE_R: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    blk, offs, mask, widx, wmask, count = _onepass_tile(n, b, nb, ROWS, CHUNKS, 32)
    v = load_compensated(x_ptr, r_ptr, offs, mask, HAS_R)
    # sign_scales: (float64 sum |v|) / count, rounded once (f64 `/` is div.rn.f64).
    total = tl.sum(tl.sum(tl.abs(v).to(tl.float64), axis=2), axis=1)
    scale = _fit_f32(total / count, total)
    tl.store(scales_ptr + blk, scale, mask=blk < nb)
    neg = (v < 0) & mask
    cols = tl.arange(0, 32)
    word = tl.sum(neg.to(tl.int32) << cols[None, None, :], axis=2)  # disjoint bits: sum == OR
    tl.store(words_ptr + widx, word, mask=wmask)
    if WRITE_R:
        s = scale[:, None, None]
        tl.store(rout_ptr + offs, v - tl.where(neg, -s, s), mask=mask)


@triton.jit
def _sign_scales_kernel(sums_ptr, scales_ptr, n, b, nb, cb, ROWS: tl.constexpr):
    """Two passes' scales from the block chunks' float64 sums (``cb`` a block, in order):
    :func:`~gradzip.kernels.quant.sign_scales`, as the one-pass kernel computes it."""
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * ROWS + tl.arange(0, ROWS)
    m = blk < nb
    total = tl.zeros([ROWS], dtype=tl.float64)
    for c in range(cb):
        total += tl.load(sums_ptr + blk * cb + c, mask=m, other=0.0)
    count = tl.maximum(tl.minimum(n - blk * b, b), 1).to(tl.float64)
    tl.store(scales_ptr + blk, _fit_f32(total / count, total), mask=m)


SCALE_ROWS = 256  # blocks a program of _sign_scales_kernel


def sign_ef_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    block: int | None = None,
    new_residual: bool | None = None,
    out: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    tile: int | None = None,
    route: str = "auto",
):
    """Triton version of :func:`~gradzip.kernels.quant.sign_ef_reference`:
    ``(scales, words, residual)``, the residual written into ``out`` when given. One pass
    where a program can own whole blocks (:func:`~.blocks.one_pass_shape`, ``per`` = 32),
    else two: block means (skipped when ``scales`` is given), then signs and residual.
    ``route``: see :func:`~.blocks.choose_route`."""
    check("x", x, KERNEL_DTYPES)
    if residual is not None:
        check("residual", residual, (torch.float32,), x.device)
        if residual.numel() != x.numel():
            raise ValueError(f"residual has {residual.numel()} elements, x has {x.numel()}")
    if out is not None:
        check("out", out, (torch.float32,), x.device)
    n, dev = x.numel(), x.device
    nb, b = quant_layout(n, block)
    words = torch.empty((n + 31) // 32, dtype=torch.int32, device=dev)
    rout = None
    if wants_residual(residual, new_residual, out):
        rout = out.view(-1) if out is not None else torch.empty(n, dtype=torch.float32, device=dev)
    xf = x.reshape(-1)
    ptrs = (xf, residual.reshape(-1) if residual is not None else xf, rout if rout is not None else xf)
    flags = {"HAS_R": residual is not None, "WRITE_R": rout is not None, "num_warps": NUM_WARPS, **LAUNCH}
    shape = choose_route(route, n, block, 32, tile, scales)
    if shape is not None:
        rows, chunks = shape
        scales = torch.empty(nb, dtype=torch.float32, device=dev)
        _sign_onepass_kernel[(triton.cdiv(nb, rows),)](
            *ptrs, scales, words, n, b, nb, ROWS=rows, CHUNKS=chunks, **flags
        )
    else:
        if scales is not None:
            scales = scales.to(device=dev, dtype=torch.float32).contiguous()
        elif n:  # the chunks' sums, then every block's scale by one small launch
            sums, cb = block_stats_triton(x, residual, b, STAT_SUM_ABS, tile=tile, partials=True)
            scales = torch.empty(nb, dtype=torch.float32, device=dev)
            _sign_scales_kernel[(triton.cdiv(nb, SCALE_ROWS),)](
                sums, scales, n, b, nb, cb, ROWS=SCALE_ROWS, num_warps=4, **LAUNCH
            )
        else:
            scales = torch.empty(0, dtype=torch.float32, device=dev)
        if n:
            W = tile_size(tile) // 32
            _sign_encode_kernel[(triton.cdiv(n, W * 32),)](
                *ptrs, scales, words, n, b, WORDS=W, WIDE=b >= W * 32, **flags
            )
    return scales, words, (out if out is not None else rout)


def _sign_sig(xp, ni="i32"):
    return {
        "x_ptr": xp,
        "r_ptr": "*fp32",
        "rout_ptr": "*fp32",
        "scales_ptr": "*fp32",
        "words_ptr": "*i32",
        "n": ni,
        "b": ni,
    }


def _onepass_sig(xp, ni="i32"):
    return dict(_sign_sig(xp, ni), nb=ni)


AOT_SPECS = [
    spec(
        _sign_scales_kernel,
        {"sums_ptr": "*fp64", "scales_ptr": "*fp32", "n": "i64", "b": "i64", "nb": "i32", "cb": "i32"},
        {"ROWS": SCALE_ROWS},
        num_warps=4,
        divisible=(),
    ),
    spec(
        _sign_encode_kernel,
        _sign_sig("*fp32"),
        {"HAS_R": True, "WRITE_R": True, "WORDS": TILE_GPU // 32, "WIDE": False},
        num_warps=NUM_WARPS,
    ),
    spec(
        _sign_encode_kernel,
        _sign_sig("*bf16", "i64"),
        {"HAS_R": True, "WRITE_R": True, "WORDS": TILE_GPU // 32, "WIDE": True},
        num_warps=NUM_WARPS,
        divisible=(),
    ),
    spec(
        _sign_encode_kernel,
        _sign_sig("*fp16"),
        {"HAS_R": False, "WRITE_R": False, "WORDS": TILE_GPU // 32, "WIDE": True},
        num_warps=NUM_WARPS,
    ),
    # One pass at TILE_GPU: blocks of 1024 (four to a program) and 4096.
    spec(
        _sign_onepass_kernel,
        _onepass_sig("*fp32"),
        {"HAS_R": True, "WRITE_R": True, "ROWS": 4, "CHUNKS": 32},
        num_warps=NUM_WARPS,
        divisible=("n", "b"),
    ),
    spec(
        _sign_onepass_kernel,
        _onepass_sig("*bf16"),
        {"HAS_R": False, "WRITE_R": False, "ROWS": 4, "CHUNKS": 32},
        num_warps=NUM_WARPS,
        divisible=("n", "b"),
    ),
    spec(
        _sign_onepass_kernel,
        _onepass_sig("*fp16", "i64"),
        {"HAS_R": True, "WRITE_R": True, "ROWS": 1, "CHUNKS": 128},
        num_warps=NUM_WARPS,
        divisible=(),
    ),
]
