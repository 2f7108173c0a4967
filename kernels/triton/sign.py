"""Scaled sign with error feedback (SignSGD) in Triton: :func:`sign_ef_triton`.

``v = x + r`` (float32); ``S_b = mean |v|`` per block (float64 sum, divided and rounded
once; 0 where it exceeds float32's range); bit ``i`` of the int32 words is ``v_i < 0``; the
new residual is ``v - where(v < 0, -S_b, S_b)``. One pass (:func:`_sign_onepass_kernel`)
where a program can own whole blocks, else two (the block chunks' sums by
:func:`~.blocks.block_stats_triton`, every block's scale by :func:`_sign_scales_kernel`, then
:func:`_sign_encode_kernel`): see :mod:`.blocks`.

The residual may be written over the residual read (``out`` is ``residual``) or over ``x``:
each element is loaded before it is stored, by the same program, in both routes.

:func:`sign_ef_segments_triton`: a tensor's pieces (``TwoPhase``'s owners' pieces), each with
one scale as :func:`sign_ef_triton` encodes it alone, in three launches for any number of
pieces: every tile's float64 sum of ``|v|`` (:func:`_sign_seg_sums_kernel`), every piece's
scale from its tiles' sums (:func:`_sign_seg_scales_kernel`), then every piece's words and
residual (:func:`_sign_seg_encode_kernel`); a program per tile of one piece, by a table built
once per layout and kept (:func:`~gradzip.kernels.triton.segment_tables`).

Reference: :func:`gradzip.kernels.quant.sign_ef_reference`,
:func:`gradzip.kernels.quant.sign_ef_segments_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import KERNEL_DTYPES
from ..quant import quant_layout, sign_segments_layout
from ..reference import wants_residual
from . import LAUNCH, check, load_compensated, row_tile, segment_tables, spec
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

__all__ = ["sign_ef_triton", "sign_ef_segments_triton"]


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


@triton.jit
def _sign_seg_sums_kernel(
    x_ptr, r_ptr, part_ptr, prog_seg_ptr, prog_first_ptr, seg_ptr, TILE: tl.constexpr, HAS_R: tl.constexpr
):
    """Program ``pid``: the float64 sum of ``|x + r|`` over elements ``first .. first + TILE`` of
    segment ``prog_seg[pid]`` (its row of ``seg_ptr``: start in ``x``, length, first program,
    programs, body offset in words), into ``part[pid]``."""
    pid = tl.program_id(0)
    row = seg_ptr + tl.load(prog_seg_ptr + pid).to(tl.int64) * 5
    xs, n = tl.load(row), tl.load(row + 1)
    offs = tl.load(prog_first_ptr + pid) + tl.arange(0, TILE)
    v = load_compensated(x_ptr + xs, r_ptr + xs, offs, offs < n, HAS_R)
    tl.store(part_ptr + pid, tl.sum(tl.abs(v).to(tl.float64), axis=0))


@triton.jit
def _seg_scale(part_ptr, n, p0, count, CHUNK: tl.constexpr):
    """A segment's scale, ``mean |v|`` from its programs' sums ``part[p0 .. p0 + count]`` as
    :func:`_sign_scales_kernel` computes a block's (one order of additions, wherever it runs)."""
    acc = tl.zeros([CHUNK], dtype=tl.float64)
    for c in range(0, count, CHUNK):
        j = c + tl.arange(0, CHUNK)
        acc += tl.load(part_ptr + p0 + j, mask=j < count, other=0.0)
    total = tl.sum(acc, axis=0)
    return _fit_f32(total / tl.maximum(n, 1).to(tl.float64), total)


@triton.jit
def _sign_seg_scales_kernel(part_ptr, seg_ptr, body_ptr, CHUNK: tl.constexpr):
    """Program ``sg``: segment ``sg``'s scale (:func:`_seg_scale`), as float32 bits at its body's
    first word."""
    row = seg_ptr + tl.program_id(0).to(tl.int64) * 5
    n, p0, count, off = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    scale = _seg_scale(part_ptr, n, p0, count, CHUNK)
    tl.store(body_ptr + off, scale.to(tl.int32, bitcast=True), mask=n > 0)


@triton.jit
def _seg_words(x_ptr, r_ptr, xs, n, first, WORDS: tl.constexpr, HAS_R: tl.constexpr):
    """``WORDS * 32`` elements of a segment from ``first`` (a multiple of 32): their offsets,
    mask, compensated values ``v`` and signs, each row's sign word and the words' indices."""
    w = tl.arange(0, WORDS)
    cols = tl.arange(0, 32)
    offs = first + w[:, None] * 32 + cols[None, :]
    mask = offs < n
    v = load_compensated(x_ptr + xs, r_ptr + xs, offs, mask, HAS_R)
    neg = (v < 0) & mask
    word = tl.sum(neg.to(tl.int32) << cols[None, :], axis=1)  # disjoint bits: sum == OR
    return offs, mask, v, neg, word, first // 32 + w


@triton.jit
def _sign_seg_encode_kernel(
    x_ptr,
    r_ptr,
    rout_ptr,
    body_ptr,
    prog_seg_ptr,
    prog_first_ptr,
    seg_ptr,
    WORDS: tl.constexpr,
    HAS_R: tl.constexpr,
    WRITE_R: tl.constexpr,
):
    """Program ``pid``: the sign words of ``WORDS * 32`` elements of its segment (from ``first``,
    a multiple of 32) after the segment's scale in its body, and their residual ``v - (+-S)``."""
    pid = tl.program_id(0)
    row = seg_ptr + tl.load(prog_seg_ptr + pid).to(tl.int64) * 5
    xs, n, off = tl.load(row), tl.load(row + 1), tl.load(row + 4)
    first = tl.load(prog_first_ptr + pid)
    offs, mask, v, neg, word, widx = _seg_words(x_ptr, r_ptr, xs, n, first, WORDS, HAS_R)
    tl.store(body_ptr + off + 1 + widx, word, mask=widx < (n + 31) // 32)
    if WRITE_R:
        s = tl.load(body_ptr + off).to(tl.float32, bitcast=True)
        tl.store(rout_ptr + xs + offs, v - tl.where(neg, -s, s), mask=mask)


@triton.jit
def _sign_seg_encode_into_kernel(
    x_ptr,
    r_ptr,
    rout_ptr,
    out_ptr,
    part_ptr,
    prog_seg_ptr,
    prog_first_ptr,
    seg_ptr,
    WORDS: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_R: tl.constexpr,
):
    """:func:`_sign_seg_scales_kernel` and :func:`_sign_seg_encode_kernel` in one launch, each
    body written a byte at a time from byte ``off`` of ``out_ptr`` (a message's body, at any
    alignment): every program computes its segment's scale from the programs' sums (the same
    additions in the same order), the first one writes it, and the residual is written over
    ``rout``. A segment's row: start in ``x``, length, first program, programs, body's byte."""
    pid = tl.program_id(0)
    row = seg_ptr + tl.load(prog_seg_ptr + pid).to(tl.int64) * 5
    xs, n, p0, count, off = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    first = tl.load(prog_first_ptr + pid)
    s = _seg_scale(part_ptr, n, p0, count, CHUNK)
    sbits = s.to(tl.int32, bitcast=True)
    k = tl.arange(0, 4)
    tl.store(out_ptr + off + k, ((sbits >> (k * 8)) & 0xFF).to(tl.uint8), mask=(k + first) < 4)  # first == 0
    offs, mask, v, neg, word, widx = _seg_words(x_ptr, r_ptr, xs, n, first, WORDS, HAS_R)
    at = off + 4 + widx[:, None] * 4 + k[None, :]
    byte = ((word[:, None] >> (k[None, :] * 8)) & 0xFF).to(tl.uint8)
    tl.store(out_ptr + at, byte, mask=(widx < (n + 31) // 32)[:, None] & (k < 4)[None, :])
    tl.store(rout_ptr + xs + offs, v - tl.where(neg, -s, s), mask=mask)


SEG_CHUNK = 128  # programs' sums a step of _seg_scale


def sign_segment_tables(segs, T: int, device):
    """The segmented sign kernels' launch tables (kept per layout) for segments ``(first
    element, elements, body's place in the kernel's unit)``: a program per ``T`` elements."""

    def build():
        table, spans, p0 = [], [], 0
        for xs, n, at in segs:
            count = -(-n // T)
            table.append([xs, n, p0, count, at])
            spans.append(n)
            p0 += count
        return table, spans, T

    return segment_tables(("sign", tuple(segs), T), device, build)


def sign_ef_segments_triton(x: torch.Tensor, bounds, *, residual=None, out=None, tile: int | None = None):
    """Triton version of :func:`~gradzip.kernels.quant.sign_ef_segments_reference`: three
    launches for every piece (sums, scales, then words and residual), the bodies in one buffer."""
    check("x", x, KERNEL_DTYPES)
    if residual is not None:
        check("residual", residual, (torch.float32,), x.device)
    if out is not None:
        check("out", out, (torch.float32,), x.device)
    bounds = [int(v) for v in bounds]
    T = tile_size(tile)
    offsets, total = sign_segments_layout(bounds)
    body = torch.zeros(total // 4, dtype=torch.int32, device=x.device)

    segs = [(a, b - a, off // 4) for off, a, b in zip(offsets, bounds, bounds[1:])]  # the body's word
    prog_seg, prog_first, seg = sign_segment_tables(segs, T, x.device)
    if prog_seg.numel():
        xf = x.reshape(-1)
        r = xf if residual is None else residual.reshape(-1)
        part = torch.empty(prog_seg.numel(), dtype=torch.float64, device=x.device)
        has = {"HAS_R": residual is not None, "num_warps": NUM_WARPS, **LAUNCH}
        _sign_seg_sums_kernel[(prog_seg.numel(),)](xf, r, part, prog_seg, prog_first, seg, TILE=T, **has)
        _sign_seg_scales_kernel[(seg.shape[0],)](part, seg, body, CHUNK=SEG_CHUNK, num_warps=4, **LAUNCH)
        _sign_seg_encode_kernel[(prog_seg.numel(),)](
            xf,
            r,
            xf if out is None else out.reshape(-1),
            body,
            prog_seg,
            prog_first,
            seg,
            WORDS=T // 32,
            WRITE_R=out is not None,
            **has,
        )
    return body.view(torch.uint8), offsets


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


_SEG_TABLES = {"prog_seg_ptr": "*i32", "prog_first_ptr": "*i64", "seg_ptr": "*i64"}


AOT_SPECS = [
    # A tensor's pieces, one scale each: float32 with its residual (compensated in place, or
    # from the memory), bf16 with one.
    *(
        spec(
            _sign_seg_sums_kernel,
            {"x_ptr": xp, "r_ptr": "*fp32", "part_ptr": "*fp64", **_SEG_TABLES},
            {"TILE": TILE_GPU, "HAS_R": has},
            num_warps=NUM_WARPS,
            divisible=(),
        )
        for xp, has in (("*fp32", False), ("*fp32", True), ("*bf16", True))
    ),
    spec(
        _sign_seg_scales_kernel,
        {"part_ptr": "*fp64", "seg_ptr": "*i64", "body_ptr": "*i32"},
        {"CHUNK": SEG_CHUNK},
        num_warps=4,
        divisible=(),
    ),
    *(
        spec(
            _sign_seg_encode_kernel,
            {"x_ptr": xp, "r_ptr": "*fp32", "rout_ptr": "*fp32", "body_ptr": "*i32", **_SEG_TABLES},
            {"WORDS": TILE_GPU // 32, "HAS_R": has, "WRITE_R": True},
            num_warps=NUM_WARPS,
            divisible=(),
        )
        for xp, has in (("*fp32", False), ("*fp32", True), ("*bf16", True))
    ),
    spec(
        _sign_seg_encode_into_kernel,
        {
            "x_ptr": "*fp32",
            "r_ptr": "*fp32",
            "rout_ptr": "*fp32",
            "out_ptr": "*u8",
            "part_ptr": "*fp64",
            **_SEG_TABLES,
        },
        {"WORDS": TILE_GPU // 32, "CHUNK": SEG_CHUNK, "HAS_R": False},
        num_warps=NUM_WARPS,
        divisible=(),
    ),
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
