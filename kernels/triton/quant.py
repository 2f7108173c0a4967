"""Quantizer codecs in Triton: scaled sign with error feedback, QSGD and TernGrad encode
with on-device Philox draws, and decode-and-accumulate of N peers' quantizer frames.

Two routes for each encoder, chosen by the launcher (:func:`one_pass_shape`); both give the
same floats and bytes, so the choice is invisible to callers.

* **One pass** (:func:`_sign_onepass_kernel`, :func:`_qsgd_onepass_kernel`,
  :func:`_terngrad_onepass_kernel`), taken when a program can own whole blocks: the block
  length ``b``, rounded up to a power of two ``P``, fits the program tile (``TILE_GPU`` =
  4096 elements, ``TILE_INTERPRETER`` under the interpreter; QSGD and TernGrad use 2048-element
  tiles of 4 warps where their blocks fit, see ``CODES_TILE_GPU``), and no packed word straddles
  two blocks: ``b % 32 == 0`` for sign words, ``b % (8 // bits)`` == 0 for code bytes, or the
  tensor is one block. A program loads ``ROWS = TILE / P`` blocks (fewer when the tensor
  has fewer) as a ``[ROWS, P / per, per]`` tile, masked to each block's length, reduces the
  block statistic along the block, computes the float32 scale on the device with the
  host expression of the two-pass route, writes it, and encodes from the same registers.
  ``x`` (and the residual) are read once. The usual cases: QSGD's default block 64,
  SignSGD or TernGrad with ``block`` 1024 or 4096.
* **Two passes**, everywhere else (a block longer than the tile, e.g. ``block=None`` on a
  tensor of more than 4096 elements; blocks whose length is not a multiple of the packing;
  precomputed ``scales``): pass 1 (:func:`_block_stats_kernel`) writes per-segment
  partials, torch turns them into scales, pass 2 encodes. ``x`` is read twice.

Minimal bytes per element (what any implementation must move; ``B`` the bytes of an ``x``
element: 4 for fp32, 2 for fp16/bf16; ``b`` the block length; the two-pass route moves
another ``B`` per element, and for sign with a residual another 4):

=================================  ==============================  ===========================
encoder                            one pass (the minimum)           two passes
=================================  ==============================  ===========================
sign_ef, residual in and out       ``B + 4 + 4 + 1/8 + 4/b``        ``2B + 8 + 4 + 1/8 + 4/b``
sign_ef, no residual (compressor)  ``B + 1/8 + 4/b``                ``2B + 1/8 + 4/b``
qsgd_encode (``bits`` per code)    ``B + bits/8 + 4/b``             ``2B + bits/8 + 4/b``
terngrad_encode                    ``B + 1/4 + 4/b``                ``2B + 1/4 + 4/b``
=================================  ==============================  ===========================

(fp32, sign with residual, block 1024: 12.13 bytes per element; QSGD s = 7, block 64: 4.56;
TernGrad, block 1024: 4.25. The two-pass route's ceiling is about the ratio of the two columns
of copy bandwidth: 60% for sign, 53% for QSGD, 52% for TernGrad.)

Block statistics and scales (both routes): ``sum |v|`` (sign) and ``sum v^2`` (QSGD; TernGrad
with ``clip``) in float64 (``v^2`` of a float32 is exact in float64), ``max |v|`` as float
bits (NaN wins, as in ``torch.amax``). Scales: sign ``float32(sum / count)``; QSGD
``float32(sqrt(sum))``, and 0 where that finite norm exceeds float32's range (the
compressor's rule: error feedback keeps the block); TernGrad ``max|v|``, with ``clip``
``min(max|v|, float32(clip * sqrt(sum / count)))`` (``clip`` in float64). On the GPU the
float64 divide and square root are ``div.rn.f64`` / ``sqrt.rn.f64`` and the conversion
``cvt.rn.f32.f64``: the host's correctly rounded operations.

Summation order: float64 sums of float32 values are exact, and so equal to torch's in any
order, whenever a block's values span fewer than ``53 - 24 - ceil(log2 b)`` binades
(``sum v^2``: 5 bits fewer); beyond that the sums may differ in the last bit of the float64
total, and the float32 scale by at most one ulp (a scale is then compared with a
tolerance, and everything downstream of it bit for bit given the same scale). QSGD's
reference norm is torch's *float32* ``vector_norm``, whose own order is unspecified: the
kernel's norm (float64 sum, ``sqrt``, rounded once) is the more accurate one and agrees
to about 1e-6 relative; the codes are compared bit for bit given the same norms.

Encoding (both routes): sign packs ``v < 0`` 32 to an int32 word and writes
``v - where(v < 0, -S_b, S_b)``; QSGD and TernGrad draw ``u_i`` = word ``i % 4`` of
``tl.rand4x(seed, i // 4)`` (Philox4x32-10 on the int64 counter ``i // 4``, reproduced by
:func:`gradzip.kernels.reference.philox_uniform`; the same draws on either route) and pack
2, 4 or 8-bit codes into bytes. One Philox evaluation serves four consecutive elements
(:func:`_uniform_quads`) wherever a tile's rows start on a multiple of 4; elsewhere each
element evaluates its own counter and keeps its word (:func:`_uniform_each`, same draws).

:func:`_decode_add_quant_kernel`: every peer's frame body (float32 scales, then codes) in
rank order into one float32 ``out``, loaded and stored once; each element adds each peer's
value with the reference's expression, so the floats are the reference's. Code values are
not checked (the compressors validate frames first).

References: ``sign_ef_reference``, ``qsgd_encode_reference``, ``terngrad_encode_reference``,
``decode_add_quant_reference`` in :mod:`gradzip.kernels.reference`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import KERNEL_DTYPES, Unsupported
from ..reference import QUANT_KINDS, quant_layout
from . import LAUNCH, check, interpreting

__all__ = [
    "block_stats_triton",
    "decode_add_quant_triton",
    "one_pass_shape",
    "qsgd_encode_triton",
    "sign_ef_triton",
    "terngrad_encode_triton",
]

NUM_WARPS = 8
TILE_GPU = 4096  # elements per program
# QSGD's and TernGrad's one-pass encoders on the GPU: 2048-element tiles of 4 warps (blocks of
# up to 2048; longer ones up to TILE_GPU keep the 8-warp tile). They issue far more
# instructions per element than the sign encoder (Philox draws, correctly rounded divides)
# and hold about 100 registers a thread; the smaller tile measured faster on an H100
# (benchmarks/kernel_tune.py; docs/kernels_h100.md).
CODES_TILE_GPU = 2048
CODES_WARPS_GPU = 4
TILE_INTERPRETER = 16384
_F32_MAX = 3.4028234663852886e38

STAT_SUM_ABS = 0
STAT_SUM_SQ = 1
STAT_MAX_ABS = 2
STAT_MAX_SUM_SQ = 3  # TernGrad with clip: both
KIND_CODE = {k: i for i, k in enumerate(QUANT_KINDS)}  # sign1 0, qsgd 1, tern2 2, int8 3


@triton.jit
def _block_stats_kernel(
    x_ptr, r_ptr, sum_ptr, max_ptr, n, b, cb, nseg, HAS_R: tl.constexpr, STAT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    seg = pid * ROWS + tl.arange(0, ROWS)
    blk = seg // cb
    within = (seg % cb)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    offs = blk[:, None] * b + within
    mask = (seg[:, None] < nseg) & (within < b) & (offs < n)
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        v = v + tl.load(r_ptr + offs, mask=mask, other=0.0)
    smask = seg < nseg
    if STAT == 0:
        tl.store(sum_ptr + seg, tl.sum(tl.abs(v).to(tl.float64), axis=1), mask=smask)
    if STAT == 1 or STAT == 3:
        w = v.to(tl.float64)
        tl.store(sum_ptr + seg, tl.sum(w * w, axis=1), mask=smask)
    if STAT == 2 or STAT == 3:
        bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        tl.store(max_ptr + seg, tl.max(bits, axis=1), mask=smask)


@triton.jit
def _block_of(offs, first, b, WIDE: tl.constexpr):
    """``offs // b`` for a two-pass tile whose first element is ``first``. ``WIDE``: blocks are
    at least as long as the tile, so it meets at most one boundary and one division per
    program does (an int64 division per element costs tens of instructions)."""
    if WIDE:
        blk0 = first // b
        return blk0 + (offs >= (blk0 + 1) * b).to(tl.int64)
    else:
        return offs // b


@triton.jit
def _sign_encode_kernel(
    x_ptr, r_ptr, rout_ptr, scales_ptr, words_ptr, n, b, HAS_R: tl.constexpr, WRITE_R: tl.constexpr, WORDS: tl.constexpr, WIDE: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    w = pid * WORDS + tl.arange(0, WORDS)
    cols = tl.arange(0, 32)
    offs = w[:, None] * 32 + cols[None, :]
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        v = v + tl.load(r_ptr + offs, mask=mask, other=0.0)
    neg = (v < 0) & mask
    # Disjoint bits: the sum is the OR (bit 31 makes it negative, as pack_bits' int32).
    word = tl.sum(neg.to(tl.int32) << cols[None, :], axis=1)
    tl.store(words_ptr + w, word, mask=w < (n + 31) // 32)
    if WRITE_R:
        s = tl.load(scales_ptr + _block_of(offs, pid * WORDS * 32, b, WIDE), mask=mask, other=0.0)
        tl.store(rout_ptr + offs, v - tl.where(neg, -s, s), mask=mask)


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
    """QSGD.compress's codes of ``v`` (float32) against its block norm ``ne`` with the draws
    ``u``, zero where masked; shared by the two-pass and one-pass encoders (any broadcastable
    shapes)."""
    # where(ne > 0, |v| / ne * s, 0).clamp(0, s), each op rounded in float32. Division is
    # div_rn: Triton's `/` lowers to the approximate div.full.f32 on the GPU.
    r = tl.where(ne > 0, tl.div_rn(tl.abs(v), tl.where(ne > 0, ne, 1.0)) * s, 0.0)
    r = tl.minimum(tl.maximum(r, 0.0), s)
    lo = tl.floor(r)
    lvl = lo + (u < r - lo).to(tl.float32)
    lvl = tl.minimum(lvl, s)
    code = (s + tl.where(v < 0, -lvl, lvl)).to(tl.int32)
    return tl.where(mask, code, 0)


@triton.jit
def _tern_codes(v, se, mask, u):
    """TernGrad.compress's 2-bit codes of ``v`` against its block scale ``se`` (0, 1 = +, 2 = -)
    with the draws ``u``, zero where masked; shared by the two-pass and one-pass encoders."""
    p = tl.where(se > 0, tl.div_rn(tl.abs(v), tl.where(se > 0, se, 1.0)), 0.0)
    p = tl.minimum(p, 1.0)
    hit = (u < p) & mask
    return tl.where(hit, tl.where(v < 0, 2, 1), 0)


@triton.jit
def _tile_uniforms(seed, pid, BYTES: tl.constexpr, PER: tl.constexpr):
    """The draws of the two-pass encoders' tile ``[BYTES, PER]`` (elements ``pid * BYTES * PER``
    onward, contiguous; ``BYTES * PER`` a multiple of 4)."""
    Q: tl.constexpr = BYTES * PER // 4
    q = pid * Q + tl.arange(0, Q)
    return tl.reshape(_uniform_quads(seed, q), [BYTES, PER])


@triton.jit
def _qsgd_encode_kernel(x_ptr, norms_ptr, out_ptr, n, b, seed, s, BITS: tl.constexpr, BYTES: tl.constexpr, WIDE: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BYTES + tl.arange(0, BYTES)
    cols = tl.arange(0, PER)
    offs = rows[:, None] * PER + cols[None, :]
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    ne = tl.load(norms_ptr + _block_of(offs, pid * BYTES * PER, b, WIDE), mask=mask, other=0.0)
    code = _qsgd_codes(v, ne, mask, _tile_uniforms(seed, pid, BYTES, PER), s)
    byte = tl.sum(code << (cols * BITS)[None, :], axis=1)
    tl.store(out_ptr + rows, byte.to(tl.uint8), mask=rows < (n + PER - 1) // PER)


@triton.jit
def _terngrad_encode_kernel(x_ptr, scales_ptr, out_ptr, n, b, seed, BYTES: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BYTES + tl.arange(0, BYTES)
    cols = tl.arange(0, 4)
    offs = rows[:, None] * 4 + cols[None, :]
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    se = tl.load(scales_ptr + _block_of(offs, pid * BYTES * 4, b, WIDE), mask=mask, other=0.0)
    code = _tern_codes(v, se, mask, _tile_uniforms(seed, pid, BYTES, 4))
    byte = tl.sum(code << (cols * 2)[None, :], axis=1)
    tl.store(out_ptr + rows, byte.to(tl.uint8), mask=rows < (n + 3) // 4)


# -- one-pass encoders: a program owns whole blocks ------------------------------------------
#
# The tile is [ROWS, CHUNKS, PER]: ROWS blocks (row ``i`` is block ``pid * ROWS + i``) of
# ``CHUNKS * PER`` (a power of two >= b) elements, masked to the block's own length. A chunk of
# PER elements is one packed word (sign: 32 bits) or one byte of codes (qsgd/tern: 8 // bits).
# The block statistic is a reduction over axes 2 then 1 of the same registers the codes are
# computed from, so x (and the residual) are read once. Chunk ``j`` of block ``k`` is word /
# byte ``k * b // PER + j``: the launcher takes this route only when ``b % PER == 0`` (no word
# straddles two blocks) or the tensor is one block.


@triton.jit
def _onepass_tile(n, b, nb, ROWS: tl.constexpr, CHUNKS: tl.constexpr, PER: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * ROWS + tl.arange(0, ROWS)  # [ROWS]
    chunk = tl.arange(0, CHUNKS)
    col = tl.arange(0, PER)
    within = chunk[None, :, None] * PER + col[None, None, :]  # [1, CHUNKS, PER]
    offs = blk[:, None, None] * b + within  # [ROWS, CHUNKS, PER], int64
    mask = (blk[:, None, None] < nb) & (within < b) & (offs < n)
    first = blk[:, None] * b + chunk[None, :] * PER  # [ROWS, CHUNKS]: first element of each chunk
    cmask = (blk[:, None] < nb) & (chunk[None, :] * PER < b) & (first < n)
    cidx = blk[:, None] * b // PER + chunk[None, :]  # word / byte index of each chunk
    count = tl.maximum(tl.minimum(n - blk * b, b), 1).to(tl.float64)  # elements in each block
    return blk, offs, mask, cidx, cmask, count


@triton.jit
def _onepass_uniforms(seed, blk, b, offs, ROWS: tl.constexpr, CHUNKS: tl.constexpr, PER: tl.constexpr, QUAD: tl.constexpr):
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
def _isnan(v):
    """NaN test on float32 bits (exponent all ones, mantissa not zero)."""
    return (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000


@triton.jit
def _sign_onepass_kernel(
    x_ptr, r_ptr, rout_ptr, scales_ptr, words_ptr, n, b, nb,
    HAS_R: tl.constexpr, WRITE_R: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr,
):
    blk, offs, mask, widx, wmask, count = _onepass_tile(n, b, nb, ROWS, CHUNKS, 32)
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        v = v + tl.load(r_ptr + offs, mask=mask, other=0.0)
    # S_b = (float64 sum |v|) / count, rounded once to float32: sign_ef_triton's expression.
    total = tl.sum(tl.sum(tl.abs(v).to(tl.float64), axis=2), axis=1)
    scale = (total / count).to(tl.float32)  # f64 `/` is div.rn.f64
    tl.store(scales_ptr + blk, scale, mask=blk < nb)
    neg = (v < 0) & mask
    cols = tl.arange(0, 32)
    word = tl.sum(neg.to(tl.int32) << cols[None, None, :], axis=2)  # disjoint bits: sum == OR
    tl.store(words_ptr + widx, word, mask=wmask)
    if WRITE_R:
        s = scale[:, None, None]
        tl.store(rout_ptr + offs, v - tl.where(neg, -s, s), mask=mask)


@triton.jit
def _qsgd_onepass_kernel(
    x_ptr, norms_ptr, out_ptr, n, b, nb, seed, s, BITS: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr, QUAD: tl.constexpr
):
    PER: tl.constexpr = 8 // BITS
    blk, offs, mask, cidx, cmask, _count = _onepass_tile(n, b, nb, ROWS, CHUNKS, PER)
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = v.to(tl.float64)
    wide = tl.sqrt(tl.sum(tl.sum(w * w, axis=2), axis=1))  # f64 sqrt is sqrt.rn.f64
    # _qsgd_norms: a finite norm beyond float32's range is sent as 0 (error feedback keeps it).
    # 1.7976931348623157e308 is float64's max: NaN and inf fail `<=`.
    over = (wide > 3.4028234663852886e38) & (wide <= 1.7976931348623157e308)
    norm = tl.where(over, 0.0, wide).to(tl.float32)
    tl.store(norms_ptr + blk, norm, mask=blk < nb)
    u = _onepass_uniforms(seed, blk, b, offs, ROWS, CHUNKS, PER, QUAD)
    code = _qsgd_codes(v, norm[:, None, None], mask, u, s)
    cols = tl.arange(0, PER)
    byte = tl.sum(code << (cols * BITS)[None, None, :], axis=2)
    tl.store(out_ptr + cidx, byte.to(tl.uint8), mask=cmask)


@triton.jit
def _terngrad_onepass_kernel(
    x_ptr, clip_ptr, scales_ptr, out_ptr, n, b, nb, seed,
    CLIP: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr, QUAD: tl.constexpr,
):
    blk, offs, mask, cidx, cmask, count = _onepass_tile(n, b, nb, ROWS, CHUNKS, 4)
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |v| as bits: NaN wins, as torch.amax
    scale = tl.max(tl.max(bits, axis=2), axis=1).to(tl.float32, bitcast=True)
    if CLIP:
        # min(max|v|, float32(clip * sqrt(float64 sum v^2 / count))), NaN propagating.
        w = v.to(tl.float64)
        sigma = tl.sqrt(tl.sum(tl.sum(w * w, axis=2), axis=1) / count)
        c = (tl.load(clip_ptr) * sigma).to(tl.float32)
        scale = tl.where(_isnan(scale), scale, tl.where(_isnan(c) | (c < scale), c, scale))
    tl.store(scales_ptr + blk, scale, mask=blk < nb)
    u = _onepass_uniforms(seed, blk, b, offs, ROWS, CHUNKS, 4, QUAD)
    code = _tern_codes(v, scale[:, None, None], mask, u)
    cols = tl.arange(0, 4)
    byte = tl.sum(code << (cols * 2)[None, None, :], axis=2)
    tl.store(out_ptr + cidx, byte.to(tl.uint8), mask=cmask)


@triton.jit
def _decode_add_quant_kernel(
    out_ptr, base_ptr, soffs_ptr, coffs_ptr, n, b, npeers, levels, KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    blk = offs // b
    acc = tl.load(out_ptr + offs, mask=mask, other=0.0)
    for p in range(npeers):
        so = tl.load(soffs_ptr + p)
        co = tl.load(coffs_ptr + p)
        sc = tl.load((base_ptr + so).to(tl.pointer_type(tl.float32)) + blk, mask=mask, other=0.0)
        if KIND == 0:  # sign1: bit i % 8 of byte i // 8 (the int32 words' little-endian bytes)
            byte = tl.load(base_ptr + co + offs // 8, mask=mask, other=0).to(tl.int32)
            bit = (byte >> (offs % 8).to(tl.int32)) & 1
            val = tl.where(bit != 0, -sc, sc)
        elif KIND == 1:  # qsgd: (c - s) * (N_b / s)
            PER: tl.constexpr = 8 // BITS
            byte = tl.load(base_ptr + co + offs // PER, mask=mask, other=0).to(tl.int32)
            c = (byte >> ((offs % PER).to(tl.int32) * BITS)) & ((1 << BITS) - 1)
            val = (c.to(tl.float32) - levels) * tl.div_rn(sc, levels)
        elif KIND == 2:  # tern2: (c == 1) * S - (c == 2) * S
            byte = tl.load(base_ptr + co + offs // 4, mask=mask, other=0).to(tl.int32)
            c = (byte >> ((offs % 4).to(tl.int32) * 2)) & 3
            val = (c == 1).to(tl.float32) * sc - (c == 2).to(tl.float32) * sc
        else:  # int8: q * S
            byte = tl.load(base_ptr + co + offs, mask=mask, other=0).to(tl.int32)
            q = tl.where(byte >= 128, byte - 256, byte)
            val = q.to(tl.float32) * sc
        acc = acc + val
    tl.store(out_ptr + offs, acc, mask=mask)


# -- launchers --------------------------------------------------------------------------------


def _tile(tile: int | None) -> int:
    if tile is not None:
        if tile < 32 or tile & (tile - 1):
            raise ValueError(f"tile must be a power of two >= 32, got {tile}")
        return tile
    return TILE_INTERPRETER if interpreting() else TILE_GPU


def _check_seed(seed) -> int:
    seed = int(seed)
    if not (0 <= seed < 2**63):
        raise Unsupported(f"seed must be in [0, 2**63), got {seed}")
    return seed


def block_stats_triton(
    x: torch.Tensor, residual: torch.Tensor | None, b: int, stat: int, *, tile: int | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-block ``(float64 sum, float32 max|v|)`` of ``v = x + residual`` for blocks of ``b``
    (either None where ``stat`` does not ask for it). Pass 1 of every encoder here."""
    n = x.numel()
    T = _tile(tile)
    nb = (n + b - 1) // b
    cols = min(T, triton.next_power_of_2(b))
    rows = max(1, T // cols)
    cb = triton.cdiv(b, cols)
    nseg = nb * cb
    dev = x.device
    sums = torch.empty(nseg, dtype=torch.float64, device=dev) if stat != STAT_MAX_ABS else None
    maxb = torch.empty(nseg, dtype=torch.int32, device=dev) if stat in (STAT_MAX_ABS, STAT_MAX_SUM_SQ) else None
    xf = x.reshape(-1)
    _block_stats_kernel[(triton.cdiv(nseg, rows),)](
        xf,
        residual.reshape(-1) if residual is not None else xf,
        sums if sums is not None else maxb,
        maxb if maxb is not None else sums,
        n,
        b,
        cb,
        nseg,
        HAS_R=residual is not None,
        STAT=stat,
        ROWS=rows,
        COLS=cols,
        num_warps=NUM_WARPS,
        **LAUNCH,
    )
    total = None if sums is None else (sums if cb == 1 else sums.view(nb, cb).sum(dim=1))
    amax = None
    if maxb is not None:
        amax = (maxb if cb == 1 else maxb.view(nb, cb).amax(dim=1)).view(torch.float32)
    return total, amax


ROUTES = ("auto", "one", "two")


def one_pass_shape(n: int, block: int | None, per: int, tile: int | None = None) -> tuple[int, int] | None:
    """``(ROWS, CHUNKS)`` of the one-pass tile for ``n`` elements in blocks of ``block``, or
    None where the one-pass route does not apply: a block longer than the tile, or one whose
    length is not a multiple of ``per`` (elements per packed word or byte: 32 for sign, 8 // bits
    for the codes) while the tensor has more than one block. ``CHUNKS * per`` is the block
    length rounded up to a power of two; ``ROWS`` blocks share a program."""
    T = _tile(tile)
    nb, b = quant_layout(n, block)
    if n == 0:
        return None
    width = max(triton.next_power_of_2(b), per)
    if width > T or (nb > 1 and b % per):
        return None
    rows = max(1, min(T // width, triton.next_power_of_2(nb)))
    return rows, width // per


def _route(route: str, n: int, block, per: int, tile, scales) -> tuple[int, int] | None:
    """The one-pass tile shape if this call takes the one-pass route, else None (two passes)."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {list(ROUTES)}, got {route!r}")
    if route == "two" or scales is not None or n == 0:
        return None
    shape = one_pass_shape(n, block, per, tile)
    if shape is None and route == "one":
        raise Unsupported(f"no one-pass route for n={n}, block={block} (tile {_tile(tile)}, {per} per word)")
    return shape


def _quad(nb: int, b: int, width: int) -> bool:
    """Whether the one-pass tile draws whole Philox quads (see :func:`_onepass_uniforms`)."""
    return (nb == 1 or b % 4 == 0) and width >= 4


def _codes_tile(tile: int | None, block: int | None, n: int) -> tuple[int | None, int]:
    """``(tile, num_warps)`` for QSGD's and TernGrad's one-pass route: the caller's tile with
    NUM_WARPS, or on the GPU the smallest of CODES_TILE_GPU .. TILE_GPU that holds a block."""
    if tile is not None or interpreting():
        return tile, NUM_WARPS
    b = quant_layout(n, block)[1]
    t = min(TILE_GPU, max(CODES_TILE_GPU, triton.next_power_of_2(b)))
    return t, CODES_WARPS_GPU if t <= CODES_TILE_GPU else NUM_WARPS


def _counts(n: int, nb: int, b: int, device) -> torch.Tensor:
    c = torch.full((nb,), float(b), dtype=torch.float64, device=device)
    if nb:
        c[-1] = n - (nb - 1) * b
    return c


def sign_ef_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    block: int | None = None,
    new_residual: bool | None = None,
    scales: torch.Tensor | None = None,
    tile: int | None = None,
    route: str = "auto",
):
    """Triton version of :func:`~gradzip.kernels.reference.sign_ef_reference`:
    ``(scales, words, residual)``. One pass where a program can own whole blocks (see
    :func:`one_pass_shape`, ``per`` = 32), else two: block means (skipped when ``scales``
    is given), then signs and residual. ``route`` ``"one"``/``"two"`` forces one (tests,
    benchmarks); ``"one"`` raises Unsupported where it does not apply."""
    check("x", x, KERNEL_DTYPES)
    if residual is not None:
        check("residual", residual, (torch.float32,), x.device)
        if residual.numel() != x.numel():
            raise ValueError(f"residual has {residual.numel()} elements, x has {x.numel()}")
    want_r = new_residual if new_residual is not None else residual is not None
    n, dev = x.numel(), x.device
    nb, b = quant_layout(n, block)
    shape = _route(route, n, block, 32, tile, scales)
    if shape is not None:
        rows, chunks = shape
        scales = torch.empty(nb, dtype=torch.float32, device=dev)
        words = torch.empty((n + 31) // 32, dtype=torch.int32, device=dev)
        rout = torch.empty(n, dtype=torch.float32, device=dev) if want_r else None
        xf = x.reshape(-1)
        _sign_onepass_kernel[(triton.cdiv(nb, rows),)](
            xf,
            residual.reshape(-1) if residual is not None else xf,
            rout if rout is not None else xf,
            scales,
            words,
            n,
            b,
            nb,
            HAS_R=residual is not None,
            WRITE_R=want_r,
            ROWS=rows,
            CHUNKS=chunks,
            num_warps=NUM_WARPS,
            **LAUNCH,
        )
        return scales, words, rout
    if scales is None:
        if n:
            total, _ = block_stats_triton(x, residual, b, STAT_SUM_ABS, tile=tile)
            scales = (total / _counts(n, nb, b, dev)).to(torch.float32)
        else:
            scales = torch.empty(0, dtype=torch.float32, device=dev)
    else:
        scales = scales.to(device=dev, dtype=torch.float32).contiguous()
    words = torch.empty((n + 31) // 32, dtype=torch.int32, device=dev)
    rout = torch.empty(n, dtype=torch.float32, device=dev) if want_r else None
    if n:
        W = _tile(tile) // 32
        xf = x.reshape(-1)
        _sign_encode_kernel[(triton.cdiv(n, W * 32),)](
            xf,
            residual.reshape(-1) if residual is not None else xf,
            rout if rout is not None else xf,
            scales,
            words,
            n,
            b,
            HAS_R=residual is not None,
            WRITE_R=want_r,
            WORDS=W,
            WIDE=b >= W * 32,
            num_warps=NUM_WARPS,
            **LAUNCH,
        )
    return scales, words, rout


def _qsgd_norms(x: torch.Tensor, nb: int, b: int, tile) -> torch.Tensor:
    total, _ = block_stats_triton(x, None, b, STAT_SUM_SQ, tile=tile)
    wide = total.sqrt()
    # QSGD.compress: a block norm beyond float32's range is sent as 0 (error feedback keeps it).
    return torch.where(torch.isfinite(wide) & (wide > _F32_MAX), 0.0, wide).to(torch.float32)


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
    """Triton version of :func:`~gradzip.kernels.reference.qsgd_encode_reference`: ``(norms, packed codes)``.
    One pass where a program can own whole blocks (:func:`one_pass_shape`, ``per`` = 8 // bits),
    else two (norms, then codes); ``route`` as :func:`sign_ef_triton`."""
    check("x", x, KERNEL_DTYPES)
    seed, s = _check_seed(seed), int(levels)
    bits = bits or (2 if 2 * s + 1 <= 4 else 4 if 2 * s + 1 <= 16 else 8)
    if bits not in (2, 4, 8) or 2 * s + 1 > 1 << bits:
        raise Unsupported(f"levels={s} does not fit {bits}-bit codes")
    n, dev = x.numel(), x.device
    nb, b = quant_layout(n, block)
    per = 8 // bits
    one_tile, warps = _codes_tile(tile, block, n)
    shape = _route(route, n, block, per, one_tile, scales)
    if shape is not None:
        rows, chunks = shape
        norms = torch.empty(nb, dtype=torch.float32, device=dev)
        out = torch.empty((n + per - 1) // per, dtype=torch.uint8, device=dev)
        _qsgd_onepass_kernel[(triton.cdiv(nb, rows),)](
            x.reshape(-1), norms, out, n, b, nb, seed, float(s), BITS=bits, ROWS=rows, CHUNKS=chunks,
            QUAD=_quad(nb, b, chunks * per), num_warps=warps, **LAUNCH,
        )
        return norms, out
    if scales is None:
        scales = _qsgd_norms(x, nb, b, tile) if n else torch.empty(0, dtype=torch.float32, device=dev)
    else:
        scales = scales.to(device=dev, dtype=torch.float32).contiguous()
    out = torch.empty((n + per - 1) // per, dtype=torch.uint8, device=dev)
    if n:
        B = max(1, _tile(tile) // per)
        _qsgd_encode_kernel[(triton.cdiv(out.numel(), B),)](
            x.reshape(-1), scales, out, n, b, seed, float(s), BITS=bits, BYTES=B, WIDE=b >= B * per,
            num_warps=NUM_WARPS, **LAUNCH,
        )
    return scales, out


def _terngrad_scales(x: torch.Tensor, nb: int, b: int, clip, tile) -> torch.Tensor:
    stat = STAT_MAX_ABS if clip is None else STAT_MAX_SUM_SQ
    total, amax = block_stats_triton(x, None, b, stat, tile=tile)
    scale = amax
    if clip is not None:
        sigma = (total / _counts(x.numel(), nb, b, x.device)).sqrt()
        scale = torch.minimum(scale, (clip * sigma).to(scale.dtype))
    return scale.to(torch.float32)


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
    """Triton version of :func:`~gradzip.kernels.reference.terngrad_encode_reference`: ``(scales, 2-bit codes)``.
    One pass where a program can own whole blocks (:func:`one_pass_shape`, ``per`` = 4), else
    two (scales, then codes); ``route`` as :func:`sign_ef_triton`."""
    check("x", x, KERNEL_DTYPES)
    seed = _check_seed(seed)
    n, dev = x.numel(), x.device
    nb, b = quant_layout(n, block)
    one_tile, warps = _codes_tile(tile, block, n)
    shape = _route(route, n, block, 4, one_tile, scales)
    if shape is not None:
        rows, chunks = shape
        scales = torch.empty(nb, dtype=torch.float32, device=dev)
        out = torch.empty((n + 3) // 4, dtype=torch.uint8, device=dev)
        # clip travels as a float64 tensor: a Python float argument would be passed as float32.
        # (torch.full fills on the device: no host-to-device copy; without clip it is not read.)
        clip_t = scales if clip is None else torch.full((1,), float(clip), dtype=torch.float64, device=dev)
        _terngrad_onepass_kernel[(triton.cdiv(nb, rows),)](
            x.reshape(-1), clip_t, scales, out, n, b, nb, seed, CLIP=clip is not None, ROWS=rows, CHUNKS=chunks,
            QUAD=_quad(nb, b, chunks * 4), num_warps=warps, **LAUNCH,
        )
        return scales, out
    if scales is None:
        scales = _terngrad_scales(x, nb, b, clip, tile) if n else torch.empty(0, dtype=torch.float32, device=dev)
    else:
        scales = scales.to(device=dev, dtype=torch.float32).contiguous()
    out = torch.empty((n + 3) // 4, dtype=torch.uint8, device=dev)
    if n:
        B = max(1, _tile(tile) // 4)
        _terngrad_encode_kernel[(triton.cdiv(out.numel(), B),)](
            x.reshape(-1), scales, out, n, b, seed, BYTES=B, WIDE=b >= B * 4, num_warps=NUM_WARPS, **LAUNCH
        )
    return scales, out


def _bodies_base(bodies: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One uint8 tensor holding every body and each body's byte offset, every offset a
    multiple of 4 (the float32 scales are loaded in place). Bodies that are views of one
    storage at such offsets (the gathered messages: bodies are 8-byte aligned) are read in
    place; otherwise they are copied into one buffer, each padded to 8 bytes."""
    st = bodies[0].untyped_storage()
    if all(
        b.is_contiguous() and b.untyped_storage().data_ptr() == st.data_ptr() and b.storage_offset() % 4 == 0 for b in bodies
    ):
        base = torch.empty(0, dtype=torch.uint8, device=bodies[0].device).set_(st, 0, (st.nbytes(),))
        return base, [b.storage_offset() for b in bodies]
    offsets, pos = [], 0
    for b in bodies:
        offsets.append(pos)
        pos += (b.numel() + 7) // 8 * 8
    base = torch.zeros(max(pos, 8), dtype=torch.uint8, device=bodies[0].device)
    for off, b in zip(offsets, bodies):
        base[off : off + b.numel()] = b.reshape(-1)
    return base, offsets


def decode_add_quant_triton(
    out: torch.Tensor,
    bodies: Sequence[torch.Tensor],
    kind: str,
    *,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
    tile: int | None = None,
) -> None:
    """Triton version of :func:`~gradzip.kernels.reference.decode_add_quant_reference`."""
    check("out", out, (torch.float32,))
    if kind not in KIND_CODE:
        raise ValueError(f"kind must be one of {list(QUANT_KINDS)}, got {kind!r}")
    for i, body in enumerate(bodies):
        check(f"body {i}", body, (torch.uint8,), out.device)
    n = out.numel()
    if not bodies or n == 0:
        return
    nb, b = quant_layout(n, block)
    base, offsets = _bodies_base(bodies)
    soffs = torch.tensor(offsets, dtype=torch.int64).to(out.device)
    coffs = soffs + 4 * nb
    B = _tile(tile)
    _decode_add_quant_kernel[(triton.cdiv(n, B),)](
        out, base, soffs, coffs, n, b, len(bodies), float(levels), KIND=KIND_CODE[kind], BITS=int(bits or 8),
        BLOCK=B, num_warps=NUM_WARPS, **LAUNCH,
    )


# -- ahead-of-time specs --------------------------------------------------------------------------


def _spec(kernel, sig, constexprs, divisible=("n",)):
    return {"kernel": kernel, "signature": sig, "constexprs": constexprs, "num_warps": NUM_WARPS, "divisible": divisible}


def _stats_sig(xp):
    return {"x_ptr": xp, "r_ptr": "*fp32", "sum_ptr": "*fp64", "max_ptr": "*i32", "n": "i32", "b": "i32", "cb": "i32", "nseg": "i32"}


def _sign_sig(xp, ni="i32"):
    return {"x_ptr": xp, "r_ptr": "*fp32", "rout_ptr": "*fp32", "scales_ptr": "*fp32", "words_ptr": "*i32", "n": ni, "b": ni}


def _enc_sig(xp, qsgd=True, ni="i32"):
    sig = {"x_ptr": xp, ("norms_ptr" if qsgd else "scales_ptr"): "*fp32", "out_ptr": "*u8", "n": ni, "b": ni, "seed": "i64"}
    if qsgd:
        sig["s"] = "fp32"
    return sig


def _onepass_sig(kind, xp, ni="i32"):
    if kind == "sign":
        sig = {"x_ptr": xp, "r_ptr": "*fp32", "rout_ptr": "*fp32", "scales_ptr": "*fp32", "words_ptr": "*i32"}
    elif kind == "qsgd":
        sig = {"x_ptr": xp, "norms_ptr": "*fp32", "out_ptr": "*u8"}
    else:
        sig = {"x_ptr": xp, "clip_ptr": "*fp64", "scales_ptr": "*fp32", "out_ptr": "*u8"}
    sig.update(n=ni, b=ni, nb=ni)
    if kind != "sign":
        sig["seed"] = "i64"
    if kind == "qsgd":
        sig["s"] = "fp32"
    return sig


_DEC_SIG = {"out_ptr": "*fp32", "base_ptr": "*u8", "soffs_ptr": "*i64", "coffs_ptr": "*i64", "n": "i32", "b": "i32", "npeers": "i32", "levels": "fp32"}

AOT_SPECS = [
    _spec(_block_stats_kernel, _stats_sig("*fp32"), {"HAS_R": True, "STAT": STAT_SUM_ABS, "ROWS": 1, "COLS": TILE_GPU}),
    _spec(_block_stats_kernel, _stats_sig("*bf16"), {"HAS_R": False, "STAT": STAT_SUM_SQ, "ROWS": 64, "COLS": 64}),
    _spec(_block_stats_kernel, _stats_sig("*fp16"), {"HAS_R": False, "STAT": STAT_MAX_SUM_SQ, "ROWS": 4, "COLS": 1024}, divisible=()),
    _spec(_sign_encode_kernel, _sign_sig("*fp32"), {"HAS_R": True, "WRITE_R": True, "WORDS": TILE_GPU // 32, "WIDE": False}),
    _spec(_sign_encode_kernel, _sign_sig("*bf16", "i64"), {"HAS_R": True, "WRITE_R": True, "WORDS": TILE_GPU // 32, "WIDE": True}, divisible=()),
    _spec(_sign_encode_kernel, _sign_sig("*fp16"), {"HAS_R": False, "WRITE_R": False, "WORDS": TILE_GPU // 32, "WIDE": True}),
    _spec(_qsgd_encode_kernel, _enc_sig("*fp32"), {"BITS": 4, "BYTES": TILE_GPU // 2, "WIDE": True}),
    _spec(_qsgd_encode_kernel, _enc_sig("*fp16", ni="i64"), {"BITS": 2, "BYTES": TILE_GPU // 4, "WIDE": False}, divisible=()),
    _spec(_qsgd_encode_kernel, _enc_sig("*bf16"), {"BITS": 8, "BYTES": TILE_GPU, "WIDE": True}),
    _spec(_terngrad_encode_kernel, _enc_sig("*fp32", qsgd=False), {"BYTES": TILE_GPU // 4, "WIDE": True}),
    _spec(_terngrad_encode_kernel, _enc_sig("*bf16", qsgd=False, ni="i64"), {"BYTES": TILE_GPU // 4, "WIDE": False}, divisible=()),
    # one-pass routes at TILE_GPU: sign with block 1024 and 4096, QSGD's default block 64 in
    # 4, 2 and 8 bits, TernGrad with block 1024 (with and without clip).
    _spec(_sign_onepass_kernel, _onepass_sig("sign", "*fp32"), {"HAS_R": True, "WRITE_R": True, "ROWS": 4, "CHUNKS": 32}, ("n", "b")),
    _spec(_sign_onepass_kernel, _onepass_sig("sign", "*bf16"), {"HAS_R": False, "WRITE_R": False, "ROWS": 4, "CHUNKS": 32}, ("n", "b")),
    _spec(
        _sign_onepass_kernel, _onepass_sig("sign", "*fp16", "i64"), {"HAS_R": True, "WRITE_R": True, "ROWS": 1, "CHUNKS": 128}, ()
    ),
    _spec(_qsgd_onepass_kernel, _onepass_sig("qsgd", "*fp32"), {"BITS": 4, "ROWS": 64, "CHUNKS": 32, "QUAD": True}, ("n", "b")),
    _spec(_qsgd_onepass_kernel, _onepass_sig("qsgd", "*bf16", "i64"), {"BITS": 2, "ROWS": 64, "CHUNKS": 16, "QUAD": False}, ()),
    _spec(_qsgd_onepass_kernel, _onepass_sig("qsgd", "*fp16"), {"BITS": 8, "ROWS": 64, "CHUNKS": 64, "QUAD": True}, ("n", "b")),
    _spec(_terngrad_onepass_kernel, _onepass_sig("tern", "*fp32"), {"CLIP": False, "ROWS": 4, "CHUNKS": 256, "QUAD": True}, ("n", "b")),
    _spec(_terngrad_onepass_kernel, _onepass_sig("tern", "*bf16", "i64"), {"CLIP": True, "ROWS": 4, "CHUNKS": 256, "QUAD": False}, ()),
] + [
    _spec(_decode_add_quant_kernel, _DEC_SIG, {"KIND": KIND_CODE[k], "BITS": bits, "BLOCK": TILE_GPU})
    for k, bits in (("sign1", 8), ("qsgd", 4), ("qsgd", 2), ("qsgd", 8), ("tern2", 8), ("int8", 8))
]
