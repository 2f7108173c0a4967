"""Quantizer codecs in Triton: scaled sign with error feedback, QSGD and TernGrad encode
with on-device Philox draws, and decode-and-accumulate of N peers' quantizer frames.

Block statistics (pass 1, :func:`_block_stats_kernel`): the quantizers' blocks have any
length ``b`` (``block=None`` is the whole tensor), so pass 1 splits every block into
segments of ``COLS`` elements that never straddle two blocks, ``ROWS`` segments per
program, and writes one partial per segment: ``sum |v|`` or ``sum v^2`` in float64
(``v^2`` of a float32 is exact in float64) and ``max |v|`` as float bits (NaN wins, as in
``torch.amax``). The partials (``nb * ceil(b / COLS)`` of them) are summed per block by
torch, and the scales computed from the block totals with the compressors' own
expressions on ``nb`` numbers.

Summation order: float64 sums of float32 values are exact, and so equal to torch's in any
order, whenever a block's values span fewer than ``53 - 24 - ceil(log2 b)`` binades
(``sum v^2``: 5 bits fewer); beyond that the sums may differ in the last bit of the float64
total, and the float32 scale by at most one ulp (a scale is then compared with a
tolerance, and everything downstream of it bit for bit given the same scale). QSGD's
reference norm is torch's *float32* ``vector_norm``, whose own order is unspecified: the
kernel's norm (float64 sum, ``sqrt``, rounded once) is the more accurate one and agrees
to about 1e-6 relative; the codes are compared bit for bit given the same norms.

Pass 2 (one read of ``x``, and of the residual): :func:`_sign_encode_kernel` packs
``v < 0`` 32 to an int32 word and writes ``v - where(v < 0, -S_b, S_b)``;
:func:`_qsgd_encode_kernel` and :func:`_terngrad_encode_kernel` draw
``u_i = tl.rand(seed, i)`` (Philox4x32-10 on the element index, reproduced by
:func:`gradzip.kernels.reference.philox_uniform`) and pack 2, 4 or 8-bit codes into bytes.

:func:`_decode_add_quant_kernel`: every peer's frame body (float32 scales, then codes) in
rank order into one float32 ``out``, loaded and stored once; each element adds each peer's
value with the reference's expression, so the floats are the reference's.

References: ``sign_ef_reference``, ``qsgd_encode_reference``, ``terngrad_encode_reference``,
``decode_add_quant_reference`` in :mod:`gradzip.kernels.reference`.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import KERNEL_DTYPES, Unsupported
from ..reference import QUANT_KINDS, quant_layout
from . import LAUNCH, check, interpreting

__all__ = ["sign_ef_triton", "qsgd_encode_triton", "terngrad_encode_triton", "decode_add_quant_triton", "block_stats_triton"]

NUM_WARPS = 8
TILE_GPU = 4096  # elements per program
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
def _sign_encode_kernel(x_ptr, r_ptr, rout_ptr, scales_ptr, words_ptr, n, b, HAS_R: tl.constexpr, WRITE_R: tl.constexpr, WORDS: tl.constexpr):
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
        s = tl.load(scales_ptr + offs // b, mask=mask, other=0.0)
        tl.store(rout_ptr + offs, v - tl.where(neg, -s, s), mask=mask)


@triton.jit
def _qsgd_encode_kernel(x_ptr, norms_ptr, out_ptr, n, b, seed, s, BITS: tl.constexpr, BYTES: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BYTES + tl.arange(0, BYTES)
    cols = tl.arange(0, PER)
    offs = rows[:, None] * PER + cols[None, :]
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    ne = tl.load(norms_ptr + offs // b, mask=mask, other=0.0)
    # QSGD.compress: where(ne > 0, |v| / ne * s, 0).clamp(0, s), each op rounded in float32.
    # Division is div_rn: Triton's `/` lowers to the approximate div.full.f32 on the GPU.
    r = tl.where(ne > 0, tl.div_rn(tl.abs(v), tl.where(ne > 0, ne, 1.0)) * s, 0.0)
    r = tl.minimum(tl.maximum(r, 0.0), s)
    lo = tl.floor(r)
    u = tl.rand(seed, offs)
    lvl = lo + (u < r - lo).to(tl.float32)
    lvl = tl.minimum(lvl, s)
    code = (s + tl.where(v < 0, -lvl, lvl)).to(tl.int32)
    code = tl.where(mask, code, 0)
    byte = tl.sum(code << (cols * BITS)[None, :], axis=1)
    tl.store(out_ptr + rows, byte.to(tl.uint8), mask=rows < (n + PER - 1) // PER)


@triton.jit
def _terngrad_encode_kernel(x_ptr, scales_ptr, out_ptr, n, b, seed, BYTES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BYTES + tl.arange(0, BYTES)
    cols = tl.arange(0, 4)
    offs = rows[:, None] * 4 + cols[None, :]
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    se = tl.load(scales_ptr + offs // b, mask=mask, other=0.0)
    p = tl.where(se > 0, tl.div_rn(tl.abs(v), tl.where(se > 0, se, 1.0)), 0.0)
    p = tl.minimum(p, 1.0)
    u = tl.rand(seed, offs)
    hit = (u < p) & mask
    code = tl.where(hit, tl.where(v < 0, 2, 1), 0)
    byte = tl.sum(code << (cols * 2)[None, :], axis=1)
    tl.store(out_ptr + rows, byte.to(tl.uint8), mask=rows < (n + 3) // 4)


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
):
    """Triton version of :func:`~gradzip.kernels.reference.sign_ef_reference`:
    ``(scales, words, residual)``. Two passes: block means (skipped when ``scales`` is
    given), then signs and residual."""
    check("x", x, KERNEL_DTYPES)
    if residual is not None:
        check("residual", residual, (torch.float32,), x.device)
        if residual.numel() != x.numel():
            raise ValueError(f"residual has {residual.numel()} elements, x has {x.numel()}")
    want_r = new_residual if new_residual is not None else residual is not None
    n, dev = x.numel(), x.device
    nb, b = quant_layout(n, block)
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
):
    """Triton version of :func:`~gradzip.kernels.reference.qsgd_encode_reference`: ``(norms, packed codes)``."""
    check("x", x, KERNEL_DTYPES)
    seed, s = _check_seed(seed), int(levels)
    bits = bits or (2 if 2 * s + 1 <= 4 else 4 if 2 * s + 1 <= 16 else 8)
    if bits not in (2, 4, 8) or 2 * s + 1 > 1 << bits:
        raise Unsupported(f"levels={s} does not fit {bits}-bit codes")
    n, dev = x.numel(), x.device
    nb, b = quant_layout(n, block)
    if scales is None:
        scales = _qsgd_norms(x, nb, b, tile) if n else torch.empty(0, dtype=torch.float32, device=dev)
    else:
        scales = scales.to(device=dev, dtype=torch.float32).contiguous()
    per = 8 // bits
    out = torch.empty((n + per - 1) // per, dtype=torch.uint8, device=dev)
    if n:
        B = max(1, _tile(tile) // per)
        _qsgd_encode_kernel[(triton.cdiv(out.numel(), B),)](
            x.reshape(-1), scales, out, n, b, seed, float(s), BITS=bits, BYTES=B, num_warps=NUM_WARPS, **LAUNCH
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
):
    """Triton version of :func:`~gradzip.kernels.reference.terngrad_encode_reference`: ``(scales, 2-bit codes)``."""
    check("x", x, KERNEL_DTYPES)
    seed = _check_seed(seed)
    n, dev = x.numel(), x.device
    nb, b = quant_layout(n, block)
    if scales is None:
        scales = _terngrad_scales(x, nb, b, clip, tile) if n else torch.empty(0, dtype=torch.float32, device=dev)
    else:
        scales = scales.to(device=dev, dtype=torch.float32).contiguous()
    out = torch.empty((n + 3) // 4, dtype=torch.uint8, device=dev)
    if n:
        B = max(1, _tile(tile) // 4)
        _terngrad_encode_kernel[(triton.cdiv(out.numel(), B),)](
            x.reshape(-1), scales, out, n, b, seed, BYTES=B, num_warps=NUM_WARPS, **LAUNCH
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


_DEC_SIG = {"out_ptr": "*fp32", "base_ptr": "*u8", "soffs_ptr": "*i64", "coffs_ptr": "*i64", "n": "i32", "b": "i32", "npeers": "i32", "levels": "fp32"}

AOT_SPECS = [
    _spec(_block_stats_kernel, _stats_sig("*fp32"), {"HAS_R": True, "STAT": STAT_SUM_ABS, "ROWS": 1, "COLS": TILE_GPU}),
    _spec(_block_stats_kernel, _stats_sig("*bf16"), {"HAS_R": False, "STAT": STAT_SUM_SQ, "ROWS": 64, "COLS": 64}),
    _spec(_block_stats_kernel, _stats_sig("*fp16"), {"HAS_R": False, "STAT": STAT_MAX_SUM_SQ, "ROWS": 4, "COLS": 1024}, divisible=()),
    _spec(_sign_encode_kernel, _sign_sig("*fp32"), {"HAS_R": True, "WRITE_R": True, "WORDS": TILE_GPU // 32}),
    _spec(_sign_encode_kernel, _sign_sig("*bf16", "i64"), {"HAS_R": True, "WRITE_R": True, "WORDS": TILE_GPU // 32}, divisible=()),
    _spec(_sign_encode_kernel, _sign_sig("*fp16"), {"HAS_R": False, "WRITE_R": False, "WORDS": TILE_GPU // 32}),
    _spec(_qsgd_encode_kernel, _enc_sig("*fp32"), {"BITS": 4, "BYTES": TILE_GPU // 2}),
    _spec(_qsgd_encode_kernel, _enc_sig("*fp16", ni="i64"), {"BITS": 2, "BYTES": TILE_GPU // 4}, divisible=()),
    _spec(_qsgd_encode_kernel, _enc_sig("*bf16"), {"BITS": 8, "BYTES": TILE_GPU}),
    _spec(_terngrad_encode_kernel, _enc_sig("*fp32", qsgd=False), {"BYTES": TILE_GPU // 4}),
    _spec(_terngrad_encode_kernel, _enc_sig("*bf16", qsgd=False, ni="i64"), {"BYTES": TILE_GPU // 4}, divisible=()),
] + [
    _spec(_decode_add_quant_kernel, _DEC_SIG, {"KIND": KIND_CODE[k], "BITS": bits, "BLOCK": TILE_GPU})
    for k, bits in (("sign1", 8), ("qsgd", 4), ("qsgd", 2), ("qsgd", 8), ("tern2", 8), ("int8", 8))
]
