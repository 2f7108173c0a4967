"""Block-wise absmax int8 in Triton: :func:`int8_encode_triton`.

Per block ``S_b`` by :func:`gradzip.kernels.quant.int8_scales` of ``max |v|`` (float32
``amax / 127`` rounded once from float64, one float32 step down where ``127 * S_b`` would pass
``amax``, at least the smallest subnormal, 0 where ``amax`` is 0 or NaN); each code is
``v / S_b`` in float64, rounded to nearest with ties to even, clamped to ``[-127, 127]``, 0
where ``S_b`` is 0 (and where the quotient is NaN: ``inf / inf`` in a block holding an
infinity, where the reference's float-to-int8 cast is undefined).

One pass (:func:`_int8_onepass_kernel`) where a program can own whole blocks (a block of at
most the tile, ``TILE_GPU`` elements): each program loads ``ROWS`` blocks once, reduces their
``max |v|`` as float bits (NaN wins, as in ``torch.amax``), computes the scales on the device,
writes them and the codes from the same registers: ``B + 1 + 4/b`` bytes per element, the
minimum. Elsewhere (a longer block, ``block=None`` on a large tensor, ``scales`` given) two:
:func:`~.blocks.block_stats_triton` for the maxima, the scales by the reference's own
function, then :func:`_int8_codes_kernel`.

:func:`int8_encode_segments_triton`: a tensor's pieces (``TwoPhase``'s owners' pieces), each
encoded as alone, and their error feedback, in one launch of :func:`_int8_segments_kernel`: a
program per ``ROWS`` blocks of one piece (the table of programs built once per layout and kept),
the scales written a byte at a time, the codes, and ``residual = v - q * S_b`` from the same
registers (the subtraction of :func:`~.decode.int8_apply_triton`, exact).

Reference: :func:`gradzip.kernels.quant.int8_encode_reference` (bit for bit), and
:func:`gradzip.kernels.quant.int8_encode_segments_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import KERNEL_DTYPES
from ..quant import int8_scales, int8_segments_by, int8_segments_layout, quant_layout
from . import LAUNCH, check, segment_tables, spec
from .blocks import NUM_WARPS, STAT_MAX_ABS, TILE_GPU, block_stats_triton, tile_size

__all__ = ["int8_encode_triton", "int8_encode_segments_triton"]


@triton.jit
def _int8_codes(v, s):
    """The codes of float32 values ``v`` under float32 scales ``s`` (broadcast to ``v``)."""
    s64 = s.to(tl.float64)
    q = tl.where(s > 0, v.to(tl.float64) / tl.where(s > 0, s64, 1.0), 0.0)
    # Round half to even: |q| < 2^8 here or clamped, so q + 0.5 is exact in float64.
    r = tl.floor(q + 0.5)
    odd = (r.to(tl.int64) & 1) != 0
    r = tl.where((r - q == 0.5) & odd, r - 1.0, r)
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(q == q, r, 0.0)  # NaN (inf / inf): 0
    return r.to(tl.int32).to(tl.int8)


@triton.jit
def _int8_scales(amax_bits):
    """:func:`gradzip.kernels.quant.int8_scales` of ``max |v|`` given as float32 bits (int32)."""
    a = amax_bits.to(tl.float32, bitcast=True).to(tl.float64)
    s = (a / 127.0).to(tl.float32)
    over = s.to(tl.float64) * 127.0 > a
    sb = s.to(tl.int32, bitcast=True)
    sb = tl.where(over & (sb > 0), sb - 1, sb)  # nextafter toward 0 (s >= 0)
    sb = tl.maximum(sb, 1)  # at least the smallest subnormal, in bits (no denormal flush)
    return tl.where(a > 0, sb, 0).to(tl.float32, bitcast=True)


@triton.jit
def _int8_onepass_kernel(x_ptr, scales_ptr, codes_ptr, n, b, nb, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * ROWS + tl.arange(0, ROWS)
    within = tl.arange(0, WIDTH)
    offs = blk[:, None] * b + within[None, :]
    mask = (blk[:, None] < nb) & (within[None, :] < b) & (offs < n)
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    s = _int8_scales(amax)
    tl.store(scales_ptr + blk, s, mask=blk < nb)
    tl.store(codes_ptr + offs, _int8_codes(v, s[:, None]), mask=mask)


@triton.jit
def _int8_codes_kernel(x_ptr, scales_ptr, codes_ptr, n, b, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scales_ptr + offs // b, mask=mask, other=0.0)
    tl.store(codes_ptr + offs, _int8_codes(v, s), mask=mask)


@triton.jit
def _int8_segments_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    prog_seg_ptr,
    prog_first_ptr,
    seg_ptr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    """Program ``pid``: blocks ``first .. first + ROWS`` of segment ``prog_seg[pid]``, whose row
    of ``seg_ptr`` holds its first element in ``x``, its length, its block length, and the byte
    offsets of its scales and of its codes in ``out``."""
    pid = tl.program_id(0)
    sg = tl.load(prog_seg_ptr + pid).to(tl.int64)
    first = tl.load(prog_first_ptr + pid).to(tl.int64)
    row = seg_ptr + sg * 5
    xs, n, b, so, co = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    nb = (n + b - 1) // b
    blk = first + tl.arange(0, ROWS)
    within = tl.arange(0, WIDTH)
    offs = blk[:, None] * b + within[None, :]
    mask = (blk[:, None] < nb) & (within[None, :] < b) & (offs < n)
    v = tl.load(x_ptr + xs + offs, mask=mask, other=0.0)
    amax = tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    s = _int8_scales(amax)
    sbits = s.to(tl.int32, bitcast=True)
    sm = blk < nb
    sp = out_ptr + so + blk * 4
    tl.store(sp, (sbits & 0xFF).to(tl.uint8), mask=sm)
    tl.store(sp + 1, ((sbits >> 8) & 0xFF).to(tl.uint8), mask=sm)
    tl.store(sp + 2, ((sbits >> 16) & 0xFF).to(tl.uint8), mask=sm)
    tl.store(sp + 3, ((sbits >> 24) & 0xFF).to(tl.uint8), mask=sm)
    q = _int8_codes(v, s[:, None])
    tl.store(out_ptr + co + offs, q.to(tl.uint8, bitcast=True), mask=mask)
    if HAS_RES:
        tl.store(res_ptr + xs + offs, v - q.to(tl.float32) * s[:, None], mask=mask)


def int8_segment_tables(segs, block: int, rows: int, device):
    """:func:`_int8_segments_kernel`'s launch tables (kept per layout) for segments ``(first
    element, elements, body's byte)``: ``rows`` blocks a program, a body's scales then codes."""

    def build():
        table, spans = [], []
        for xs, n, at in segs:
            nb, bl = quant_layout(n, block)
            table.append([xs, n, bl, at, at + 4 * nb])
            spans.append(nb)
        return table, spans, rows

    return segment_tables(("int8", tuple(segs), int(block), rows), device, build)


def int8_encode_segments_triton(x: torch.Tensor, bounds, *, block: int | None = 1024, residual=None, tile=None):
    """Triton version of :func:`~gradzip.kernels.quant.int8_encode_segments_reference` (float32
    ``x``): one launch where every piece's block fits a program's tile (``block`` given, at
    most the tile); else each piece by :func:`int8_encode_triton` and its subtraction."""
    check("x", x, (torch.float32,))
    if residual is not None:
        check("residual", residual, (torch.float32,), x.device)
    bounds = [int(v) for v in bounds]
    T = tile_size(tile)
    width = triton.next_power_of_2(int(block)) if block is not None else None
    if width is None or width > T:  # a block longer than a program's tile: piece by piece
        from .decode import int8_apply_triton

        return int8_segments_by(
            lambda v: int8_encode_triton(v, block=block, tile=tile),
            lambda r, body, _scales, _codes: int8_apply_triton(r, [body], block=block, subtract=True),
            x,
            bounds,
            block,
            residual,
        )
    rows = T // width
    offsets, total = int8_segments_layout(bounds, block)
    out = torch.zeros(total, dtype=torch.uint8, device=x.device)
    segs = [(a, b - a, off) for off, a, b in zip(offsets, bounds, bounds[1:])]
    prog_seg, prog_first, seg = int8_segment_tables(segs, block, rows, x.device)
    if prog_seg.numel():
        _int8_segments_kernel[(prog_seg.numel(),)](
            x,
            x if residual is None else residual,
            out,
            prog_seg,
            prog_first,
            seg,
            ROWS=rows,
            WIDTH=width,
            HAS_RES=residual is not None,
            num_warps=NUM_WARPS,
            **LAUNCH,
        )
    return out, offsets


def one_pass_rows(n: int, block: int | None, tile: int | None = None) -> tuple[int, int] | None:
    """``(ROWS, WIDTH)`` of the one-pass tile (``WIDTH`` the block length rounded up to a power
    of two, ``ROWS`` blocks a program), or None where a block is longer than the tile."""
    nb, b = quant_layout(n, block)
    if n == 0:
        return None
    width = triton.next_power_of_2(b)
    T = tile_size(tile)
    if width > T:
        return None
    return max(1, min(T // width, triton.next_power_of_2(nb))), width


def int8_encode_triton(
    x: torch.Tensor,
    *,
    block: int | None = 1024,
    scales: torch.Tensor | None = None,
    tile: int | None = None,
    route: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~gradzip.kernels.quant.int8_encode_reference`: ``(float32
    scales, int8 codes)``. ``route``: ``"auto"``, or ``"one"`` / ``"two"`` to force one (tests,
    benchmarks; ``"one"`` raises ValueError where it does not apply)."""
    check("x", x, KERNEL_DTYPES)
    if route not in ("auto", "one", "two"):
        raise ValueError(f"route must be 'auto', 'one' or 'two', got {route!r}")
    n, dev = x.numel(), x.device
    nb, b = quant_layout(n, block)
    codes = torch.empty(n, dtype=torch.int8, device=dev)
    xf = x.reshape(-1)
    flags = {"num_warps": NUM_WARPS, **LAUNCH}
    shape = None if (route == "two" or scales is not None) else one_pass_rows(n, block, tile)
    if route == "one" and shape is None:
        raise ValueError(f"no one-pass route for n={n}, block={block} (tile {tile_size(tile)})")
    if shape is not None:
        rows, width = shape
        out = torch.empty(nb, dtype=torch.float32, device=dev)
        _int8_onepass_kernel[(triton.cdiv(nb, rows),)](xf, out, codes, n, b, nb, ROWS=rows, WIDTH=width, **flags)
        return out, codes
    if scales is not None:
        out = scales.to(device=dev, dtype=torch.float32).contiguous()
    elif n:
        _, amax = block_stats_triton(x, None, b, STAT_MAX_ABS, tile=tile)
        out = int8_scales(amax)
    else:
        out = torch.empty(0, dtype=torch.float32, device=dev)
    if n:
        T = tile_size(tile)
        _int8_codes_kernel[(triton.cdiv(n, T),)](xf, out, codes, n, b, BLOCK=T, **flags)
    return out, codes


def _segments_sig():
    return {
        "x_ptr": "*fp32",
        "res_ptr": "*fp32",
        "out_ptr": "*u8",
        "prog_seg_ptr": "*i32",
        "prog_first_ptr": "*i64",
        "seg_ptr": "*i64",
    }


def _sig(xp, ni="i32"):
    return {"x_ptr": xp, "scales_ptr": "*fp32", "codes_ptr": "*i8", "n": ni, "b": ni}


AOT_SPECS = [
    # One pass at TILE_GPU: blocks of 1024, four to a program; one block of 4096 (fp16, int64 sizes).
    *(
        spec(
            _int8_onepass_kernel,
            dict(_sig(xp), nb="i32"),
            {"ROWS": TILE_GPU // 1024, "WIDTH": 1024},
            num_warps=NUM_WARPS,
            divisible=("n", "b"),
        )
        for xp in ("*fp32", "*bf16")
    ),
    spec(
        _int8_onepass_kernel,
        dict(_sig("*fp16", "i64"), nb="i64"),
        {"ROWS": 1, "WIDTH": TILE_GPU},
        num_warps=NUM_WARPS,
        divisible=(),
    ),
    spec(_int8_codes_kernel, _sig("*fp32"), {"BLOCK": TILE_GPU}, num_warps=NUM_WARPS),
    # A tensor's pieces with their error feedback (and without: a frozen tensor), blocks of 1024.
    *(
        spec(
            _int8_segments_kernel,
            _segments_sig(),
            {"ROWS": TILE_GPU // 1024, "WIDTH": 1024, "HAS_RES": has},
            num_warps=NUM_WARPS,
            divisible=(),
        )
        for has in (True, False)
    ),
    spec(_int8_codes_kernel, _sig("*bf16", "i64"), {"BLOCK": TILE_GPU}, num_warps=NUM_WARPS, divisible=()),
]
