"""QSGD and TernGrad encoders in Triton, with on-device Philox draws:
:func:`qsgd_encode_triton`, :func:`terngrad_encode_triton`.

One kernel per route serves both quantizers (``QSGD`` picks the statistic and the codes at
compile time): :func:`_codes_onepass_kernel` where a program can own whole blocks, else
block statistics (:func:`~.blocks.block_stats_triton`) then :func:`_codes_encode_kernel`;
see :mod:`.blocks` for the routes.

Draws: ``u_i`` is word ``i % 4`` of ``tl.rand4x(seed, i // 4)`` (Philox4x32-10 on the int64
counter ``i // 4``; :func:`gradzip.kernels.philox.philox_uniform` computes the same floats),
the same on either route. One Philox evaluation serves four consecutive elements
(:func:`_uniform_quads`) wherever a tile's rows start on a multiple of 4; elsewhere each
element evaluates its own counter and keeps its word (:func:`_uniform_each`, same draws).

Codes: each float32 operation of the reference, rounded as there (``tl.div_rn``: Triton's
``/`` lowers to the approximate ``div.full.f32`` on the GPU), packed 2, 4 or 8 bits to a byte.

References: :func:`gradzip.kernels.quant.qsgd_encode_reference`,
:func:`gradzip.kernels.quant.terngrad_encode_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import KERNEL_DTYPES, Unsupported
from ..quant import qsgd_bits, qsgd_norms, quant_counts, quant_layout, terngrad_scales
from . import LAUNCH, check, interpreting, row_tile, spec
from .blocks import (
    NUM_WARPS,
    STAT_MAX_ABS,
    STAT_MAX_SUM_SQ,
    STAT_SUM_SQ,
    TILE_GPU,
    _block_of,
    _fit_f32,
    _isnan,
    _onepass_tile,
    block_stats_triton,
    check_seed,
    choose_route,
    tile_size,
)

__all__ = ["qsgd_encode_triton", "terngrad_encode_triton"]

# One-pass tiles on the GPU: 2048 elements of 4 warps (blocks of up to 2048; longer ones up to
# TILE_GPU keep the 8-warp tile). These encoders issue far more instructions per element than
# the sign encoder (Philox draws, correctly rounded divides) and hold about 100 registers a
# thread; the smaller tile measured faster on an H100 (benchmarks/kernel_tune.py;
# docs/kernels.md).
CODES_TILE_GPU = 2048
CODES_WARPS_GPU = 4


@triton.jit
def _uniform_quads(seed, q):
    """The draws of elements ``4q .. 4q + 3``: shape ``q.shape + [2, 2]``, which flattens to
    element order (word ``i % 4`` of ``tl.rand4x(seed, i // 4)``)."""
    u0, u1, u2, u3 = tl.rand4x(seed, q)
    return tl.join(tl.join(u0, u2), tl.join(u1, u3))


@triton.jit
def _uniform_each(seed, offs):
    """The same draws for any ``offs``, one Philox evaluation per element (rows that do not
    start on a multiple of 4)."""
    u0, u1, u2, u3 = tl.rand4x(seed, offs // 4)
    lane = offs % 4
    return tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))


@triton.jit
def _qsgd_codes(v, ne, mask, u, s):
    """QSGD's codes of ``v`` (float32) against its block norm ``ne`` with the draws ``u``, zero
    where masked (any broadcastable shapes)."""
    # where(ne > 0, |v| / ne * s, 0).clamp(0, s), each op rounded in float32.
    r = tl.where(ne > 0, tl.div_rn(tl.abs(v), tl.where(ne > 0, ne, 1.0)) * s, 0.0)
    r = tl.minimum(tl.maximum(r, 0.0), s)
    lo = tl.floor(r)
    lvl = lo + (u < r - lo).to(tl.float32)
    lvl = tl.minimum(lvl, s)
    code = (s + tl.where(v < 0, -lvl, lvl)).to(tl.int32)
    return tl.where(mask, code, 0)


@triton.jit
def _tern_codes(v, se, mask, u):
    """TernGrad's 2-bit codes of ``v`` against its block scale ``se`` (0, 1 = +, 2 = -) with the
    draws ``u``, zero where masked."""
    p = tl.where(se > 0, tl.div_rn(tl.abs(v), tl.where(se > 0, se, 1.0)), 0.0)
    p = tl.minimum(p, 1.0)
    hit = (u < p) & mask
    return tl.where(hit, tl.where(v < 0, 2, 1), 0)


@triton.jit
def _codes(v, scale, mask, u, s, QSGD: tl.constexpr):
    if QSGD:
        code = _qsgd_codes(v, scale, mask, u, s)
    else:
        code = _tern_codes(v, scale, mask, u)
    return code


@triton.jit
def _codes_encode_kernel(
    x_ptr,
    scales_ptr,
    out_ptr,
    n,
    b,
    seed,
    s,
    QSGD: tl.constexpr,
    BITS: tl.constexpr,
    BYTES: tl.constexpr,
    WIDE: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    pid, rows, cols, offs, mask = row_tile(n, BYTES, PER)
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scales_ptr + _block_of(offs, pid * BYTES * PER, b, WIDE), mask=mask, other=0.0)
    # The tile's elements are contiguous from pid * BYTES * PER (a multiple of 4): whole quads.
    Q: tl.constexpr = BYTES * PER // 4
    u = tl.reshape(_uniform_quads(seed, pid * Q + tl.arange(0, Q)), [BYTES, PER])
    code = _codes(v, scale, mask, u, s, QSGD)
    byte = tl.sum(code << (cols * BITS)[None, :], axis=1)
    tl.store(out_ptr + rows, byte.to(tl.uint8), mask=rows < (n + PER - 1) // PER)


@triton.jit
def _onepass_uniforms(
    seed, blk, b, offs, ROWS: tl.constexpr, CHUNKS: tl.constexpr, PER: tl.constexpr, QUAD: tl.constexpr
):
    """The draws of the one-pass tile ``[ROWS, CHUNKS, PER]``. ``QUAD``: every row starts on a
    multiple of 4 (``b % 4 == 0``, or one block) and ``CHUNKS * PER >= 4``, so each row's
    draws are whole quads of Philox words; else one evaluation per element."""
    if QUAD:
        W: tl.constexpr = CHUNKS * PER // 4
        q = (blk * b // 4)[:, None] + tl.arange(0, W)[None, :]  # [ROWS, W]
        u = tl.reshape(_uniform_quads(seed, q), [ROWS, CHUNKS, PER])
    else:
        u = _uniform_each(seed, offs)
    return u


@triton.jit
def _codes_onepass_kernel(
    x_ptr,
    clip_ptr,
    scales_ptr,
    out_ptr,
    n,
    b,
    nb,
    seed,
    s,
    QSGD: tl.constexpr,
    CLIP: tl.constexpr,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    QUAD: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    blk, offs, mask, cidx, cmask, count = _onepass_tile(n, b, nb, ROWS, CHUNKS, PER)
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if QSGD:
        # qsgd_norms: sqrt(float64 sum v^2) (f64 sqrt is sqrt.rn.f64), rounded once.
        w = v.to(tl.float64)
        total = tl.sum(tl.sum(w * w, axis=2), axis=1)
        scale = _fit_f32(tl.sqrt(total), total)
    else:
        # terngrad_scales: max |v| (as bits: NaN wins, as torch.amax), and with clip
        # min(max|v|, float32(clip * sqrt(float64 sum v^2 / count))), NaN propagating.
        bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        scale = tl.max(tl.max(bits, axis=2), axis=1).to(tl.float32, bitcast=True)
        if CLIP:
            w = v.to(tl.float64)
            sigma = tl.sqrt(tl.sum(tl.sum(w * w, axis=2), axis=1) / count)
            c = (tl.load(clip_ptr) * sigma).to(tl.float32)
            scale = tl.where(_isnan(scale), scale, tl.where(_isnan(c) | (c < scale), c, scale))
    tl.store(scales_ptr + blk, scale, mask=blk < nb)
    u = _onepass_uniforms(seed, blk, b, offs, ROWS, CHUNKS, PER, QUAD)
    code = _codes(v, scale[:, None, None], mask, u, s, QSGD)
    cols = tl.arange(0, PER)
    byte = tl.sum(code << (cols * BITS)[None, None, :], axis=2)
    tl.store(out_ptr + cidx, byte.to(tl.uint8), mask=cmask)


# -- launchers --------------------------------------------------------------------------------


def _quad(nb: int, b: int, width: int) -> bool:
    """Whether the one-pass tile draws whole Philox quads (see :func:`_onepass_uniforms`)."""
    return (nb == 1 or b % 4 == 0) and width >= 4


def _codes_tile(tile: int | None, block: int | None, n: int) -> tuple[int | None, int]:
    """``(tile, num_warps)`` for the one-pass route: the caller's tile with NUM_WARPS, or on
    the GPU the smallest of CODES_TILE_GPU .. TILE_GPU that holds a block."""
    if tile is not None or interpreting():
        return tile, NUM_WARPS
    b = quant_layout(n, block)[1]
    t = min(TILE_GPU, max(CODES_TILE_GPU, triton.next_power_of_2(b)))
    return t, CODES_WARPS_GPU if t <= CODES_TILE_GPU else NUM_WARPS


def _block_scales(x: torch.Tensor, qsgd: bool, nb: int, b: int, clip, tile) -> torch.Tensor:
    """The two-pass route's scales: block statistics on the device, then the reference's
    expressions (a float32 block's sum is finite exactly when the block is)."""
    if qsgd:
        total, _ = block_stats_triton(x, None, b, STAT_SUM_SQ, tile=tile)
        return qsgd_norms(total, torch.isfinite(total))
    total, amax = block_stats_triton(x, None, b, STAT_MAX_ABS if clip is None else STAT_MAX_SUM_SQ, tile=tile)
    return terngrad_scales(amax, total, quant_counts(x.numel(), nb, b, x.device), clip)


def _encode(x, seed, *, qsgd: bool, levels: int, bits: int, block, clip, scales, tile, route):
    check("x", x, KERNEL_DTYPES)
    seed = check_seed(seed)
    n, dev = x.numel(), x.device
    nb, b = quant_layout(n, block)
    per = 8 // bits
    out = torch.empty((n + per - 1) // per, dtype=torch.uint8, device=dev)
    xf = x.reshape(-1)
    consts = {"QSGD": qsgd, "BITS": bits, **LAUNCH}
    one_tile, warps = _codes_tile(tile, block, n)
    shape = choose_route(route, n, block, per, one_tile, scales)
    if shape is not None:
        rows, chunks = shape
        scales = torch.empty(nb, dtype=torch.float32, device=dev)
        # clip travels as a float64 tensor: a Python float argument would be passed as float32.
        # (torch.full fills on the device: no host-to-device copy; without clip it is not read.)
        clip_t = scales if clip is None else torch.full((1,), float(clip), dtype=torch.float64, device=dev)
        _codes_onepass_kernel[(triton.cdiv(nb, rows),)](
            xf,
            clip_t,
            scales,
            out,
            n,
            b,
            nb,
            seed,
            float(levels),
            CLIP=clip is not None,
            ROWS=rows,
            CHUNKS=chunks,
            QUAD=_quad(nb, b, chunks * per),
            num_warps=warps,
            **consts,
        )
        return scales, out
    if scales is not None:
        scales = scales.to(device=dev, dtype=torch.float32).contiguous()
    elif n:
        scales = _block_scales(x, qsgd, nb, b, clip, tile)
    else:
        scales = torch.empty(0, dtype=torch.float32, device=dev)
    if n:
        B = max(1, tile_size(tile) // per)
        _codes_encode_kernel[(triton.cdiv(out.numel(), B),)](
            xf, scales, out, n, b, seed, float(levels), BYTES=B, WIDE=b >= B * per, num_warps=NUM_WARPS, **consts
        )
    return scales, out


def qsgd_encode_triton(
    x: torch.Tensor,
    levels: int,
    seed: int,
    *,
    block: int | None = 64,
    bits: int | None = None,
    scales: torch.Tensor | None = None,
    tile: int | None = None,
    route: str = "auto",
):
    """Triton version of :func:`~gradzip.kernels.quant.qsgd_encode_reference`: ``(norms, packed
    codes)``. One pass where a program can own whole blocks (``per`` = 8 // bits), else two
    (norms, then codes); ``route``: see :func:`~.blocks.choose_route`."""
    s = int(levels)
    bits = bits or qsgd_bits(s)
    if bits not in (2, 4, 8) or 2 * s + 1 > 1 << bits:
        raise Unsupported(f"levels={s} does not fit {bits}-bit codes")
    return _encode(
        x, seed, qsgd=True, levels=s, bits=bits, block=block, clip=None, scales=scales, tile=tile, route=route
    )


def terngrad_encode_triton(
    x: torch.Tensor,
    seed: int,
    *,
    block: int | None = None,
    clip: float | None = None,
    scales: torch.Tensor | None = None,
    tile: int | None = None,
    route: str = "auto",
):
    """Triton version of :func:`~gradzip.kernels.quant.terngrad_encode_reference`: ``(scales,
    2-bit codes)``. One pass where a program can own whole blocks (``per`` = 4), else two
    (scales, then codes); ``route``: see :func:`~.blocks.choose_route`."""
    return _encode(x, seed, qsgd=False, levels=0, bits=2, block=block, clip=clip, scales=scales, tile=tile, route=route)


# -- ahead-of-time specs --------------------------------------------------------------------------


def _enc_sig(xp, ni="i32"):
    return {"x_ptr": xp, "scales_ptr": "*fp32", "out_ptr": "*u8", "n": ni, "b": ni, "seed": "i64", "s": "fp32"}


def _onepass_sig(xp, ni="i32"):
    return {
        "x_ptr": xp,
        "clip_ptr": "*fp64",
        "scales_ptr": "*fp32",
        "out_ptr": "*u8",
        "n": ni,
        "b": ni,
        "nb": ni,
        "seed": "i64",
        "s": "fp32",
    }


def _qsgd(bits, **kw):
    return {"QSGD": True, "BITS": bits, **kw}


def _tern(**kw):
    return {"QSGD": False, "BITS": 2, **kw}


_W = {"num_warps": NUM_WARPS}
AOT_SPECS = [
    spec(_codes_encode_kernel, _enc_sig("*fp32"), _qsgd(4, BYTES=TILE_GPU // 2, WIDE=True), **_W),
    spec(_codes_encode_kernel, _enc_sig("*fp16", "i64"), _qsgd(2, BYTES=TILE_GPU // 4, WIDE=False), **_W, divisible=()),
    spec(_codes_encode_kernel, _enc_sig("*bf16"), _qsgd(8, BYTES=TILE_GPU, WIDE=True), **_W),
    spec(_codes_encode_kernel, _enc_sig("*fp32"), _tern(BYTES=TILE_GPU // 4, WIDE=True), **_W),
    spec(_codes_encode_kernel, _enc_sig("*bf16", "i64"), _tern(BYTES=TILE_GPU // 4, WIDE=False), **_W, divisible=()),
    # One pass: QSGD's default block 64 in 4, 2 and 8 bits (64 blocks to a TILE_GPU program),
    # TernGrad with block 1024 (with and without clip) in CODES_TILE_GPU tiles of 4 warps.
    spec(
        _codes_onepass_kernel,
        _onepass_sig("*fp32"),
        _qsgd(4, CLIP=False, ROWS=64, CHUNKS=32, QUAD=True),
        **_W,
        divisible=("n", "b"),
    ),
    spec(
        _codes_onepass_kernel,
        _onepass_sig("*bf16", "i64"),
        _qsgd(2, CLIP=False, ROWS=64, CHUNKS=16, QUAD=False),
        **_W,
        divisible=(),
    ),
    spec(
        _codes_onepass_kernel,
        _onepass_sig("*fp16"),
        _qsgd(8, CLIP=False, ROWS=64, CHUNKS=64, QUAD=True),
        **_W,
        divisible=("n", "b"),
    ),
    spec(
        _codes_onepass_kernel,
        _onepass_sig("*fp32"),
        _tern(CLIP=False, ROWS=2, CHUNKS=256, QUAD=True),
        num_warps=CODES_WARPS_GPU,
        divisible=("n", "b"),
    ),
    spec(
        _codes_onepass_kernel,
        _onepass_sig("*bf16", "i64"),
        _tern(CLIP=True, ROWS=4, CHUNKS=256, QUAD=False),
        **_W,
        divisible=(),
    ),
]
