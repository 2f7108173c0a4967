"""Quantizer references: the block layout, the SignSGD / QSGD / TernGrad / Int8 encoders,
and the decode of their frame bodies. They are the CPU path and the oracle of the kernels.

Layout: ``nb = ceil(n / b)`` blocks of ``b`` elements (``block=None``: one block), the last
one possibly short; one float32 scale per block; codes packed by
:mod:`gradzip.kernels.bitpack`. A frame body is the ``nb`` scales (little-endian float32),
then the codes:

=======  =========================================  ======================================
kind     codes after the scales                     element ``i`` of block ``k``
=======  =========================================  ======================================
sign1    1 bit, 32 to an int32 word (``pack_bits``)  bit 1 -> ``-S_k``, 0 -> ``+S_k``
qsgd     ``2s + 1`` codes in 2, 4 or 8 bits          ``(c - s) * (N_k / s)``, at most ``N_k``
                                                    in magnitude
tern2    2 bits                                     0 -> 0, 1 -> ``+S_k``, 2 -> ``-S_k``
int8     one int8 ``q``                             ``q * S_k``
=======  =========================================  ======================================

Arithmetic: float32, float16 and bfloat16 inputs are computed in float32, float64 inputs in
float64 (:func:`~gradzip.kernels.reference.accum_dtype`); scales are rounded to float32 once.
Block statistics are float64: ``sum |v|`` (SignSGD's mean), ``sum v^2`` (QSGD's norm,
TernGrad's ``clip``), and ``max |v|`` (TernGrad, Int8) in the input's accumulation dtype.

Scales beyond float32: a block whose scale would exceed float32's range while its values
are finite (float64 inputs beyond float32's range; the norm of float32 values near the
maximum) is sent with scale 0, so it decodes to zeros and error feedback keeps it whole
(:func:`fit_f32`). Non-finite values give non-finite scales, as they come.

Draws (QSGD, TernGrad): ``u = philox_uniform(seed, n)`` on every backend (float32 values,
compared in float64 for float64 inputs). An element rounds up iff ``u_i`` is below its
fractional level: unbiased up to the float32 grid of the draws (about 2**-24).

Bit for bit: each Triton kernel evaluates these expressions with the same roundings
(``tl.div_rn``, correctly rounded float64 division and square root, no fused multiply-add),
so a kernel's frame is the reference's, given the same float64 block sums. Their order is
the one freedom. A float64 sum of float32 ``|v|`` is exact, and so the same in any order,
when the block's values span fewer than about ``29 - log2(b)`` binades; sums of squares
(48-bit terms) seldom are, and two orders may then differ in the last bits of the float64
sum. That moves the float32 scale by one ulp only when the exact scale lies that close to
a float32 rounding boundary: for a block of ``b`` elements, a chance of the order of
``b * 2**-29`` at worst. Every encoder takes ``scales=`` so that what follows the scales
can be compared bit for bit given the same scales.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .bitpack import pack_bits, pack_nbit, unpack_bits, unpack_nbit
from .philox import philox_uniform
from .reference import accum_dtype, store_residual, wants_residual

__all__ = [
    "QUANT_KINDS",
    "quant_layout",
    "quant_pad",
    "quant_per_element",
    "quant_counts",
    "quant_code_bytes",
    "qsgd_bits",
    "fit_f32",
    "sign_scales",
    "qsgd_norms",
    "terngrad_scales",
    "int8_scales",
    "sign_ef_reference",
    "sign_segments_layout",
    "sign_ef_segments_reference",
    "qsgd_encode_reference",
    "terngrad_encode_reference",
    "int8_encode_reference",
    "int8_segments_layout",
    "int8_encode_segments_reference",
    "decode_quant_reference",
    "decode_add_quant_reference",
    "quant_body_stats_reference",
]

QUANT_KINDS = ("sign1", "qsgd", "tern2", "int8")
F32_MAX = 3.4028234663852886e38
F32_TINY = 2.0**-149  # the smallest float32 subnormal


# -- block layout ----------------------------------------------------------------------------


def quant_layout(n: int, block: int | None) -> tuple[int, int]:
    """(number of blocks, block length) for ``n`` elements (``block=None``: one block)."""
    if n == 0:
        return 0, 1
    b = n if block is None else min(int(block), n)
    return (n + b - 1) // b, b


def quant_pad(v: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """``v`` zero-padded to ``nb * b`` elements, viewed as (nb, b)."""
    n = v.numel()
    if n == nb * b:
        return v.reshape(nb, b)
    return torch.cat([v, v.new_zeros(nb * b - n)]).reshape(nb, b)


def quant_per_element(per_block: torch.Tensor, nb: int, b: int, n: int) -> torch.Tensor:
    """Each block's value repeated over its elements (the first ``n``)."""
    return per_block.reshape(nb, 1).expand(nb, b).reshape(-1)[:n]


def quant_counts(n: int, nb: int, b: int, device) -> torch.Tensor:
    """float64 element count of each block (the last one possibly short)."""
    c = torch.full((nb,), float(b), dtype=torch.float64, device=device)
    if nb:
        c[-1] = n - (nb - 1) * b
    return c


def quant_code_bytes(kind: str, n: int, bits: int | None = None) -> int:
    """Bytes of packed codes after the scales in a ``kind`` frame body of ``n`` elements."""
    if kind == "sign1":
        return 4 * ((n + 31) // 32)
    if kind == "qsgd":
        per = 8 // int(bits)
        return (n + per - 1) // per
    if kind == "tern2":
        return (n + 3) // 4
    if kind == "int8":
        return n
    raise ValueError(f"kind must be one of {list(QUANT_KINDS)}, got {kind!r}")


def qsgd_bits(levels: int) -> int:
    """The fewest bits (2, 4 or 8) that hold QSGD's ``2 * levels + 1`` codes."""
    codes = 2 * int(levels) + 1
    return 2 if codes <= 4 else 4 if codes <= 16 else 8


# -- block statistics and scales --------------------------------------------------------------


def fit_f32(wide: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """float32 scales from float64 ``wide``: 0 where ``wide`` exceeds float32's range while
    the block's values are ``finite`` (the block is then sent as zeros), else rounded once."""
    return torch.where((wide > F32_MAX) & finite, 0.0, wide).to(torch.float32)


def sign_scales(abs_sums: torch.Tensor, counts: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """SignSGD's ``S_b = mean |v|``: ``float64 sum |v| / count``, then :func:`fit_f32`."""
    return fit_f32(abs_sums / counts, finite)


def qsgd_norms(sq_sums: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """QSGD's ``N_b = sqrt(float64 sum v^2)``, then :func:`fit_f32`."""
    return fit_f32(sq_sums.sqrt(), finite)


def terngrad_scales(
    amax: torch.Tensor, sq_sums: torch.Tensor | None, counts: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """TernGrad's ``S_b = max |v|`` (``amax`` in the accumulation dtype), with ``clip``
    ``min(max |v|, clip * sqrt(sum v^2 / count))`` (the product rounded to ``amax``'s dtype,
    NaN propagating), then :func:`fit_f32` (``amax`` is finite exactly when the block is)."""
    scale = amax
    if clip is not None:
        sigma = (sq_sums / counts).sqrt()
        scale = torch.minimum(scale, (clip * sigma).to(scale.dtype))
    return fit_f32(scale.to(torch.float64), torch.isfinite(amax))


def int8_scales(amax: torch.Tensor) -> torch.Tensor:
    """Int8's float32 ``S_b = amax / 127``, rounded down where needed so that ``127 * S_b <=
    amax`` (no code overflows the block's range); at least the smallest subnormal where
    ``amax > 0``; 0 where ``amax`` is 0 or NaN, and where ``amax / 127`` exceeds float32's
    range (finite ``amax`` of a float64 block). The quotient is taken in float64 and rounded
    once: for float32 ``amax`` that is float32's own correctly rounded division."""
    a = amax.to(torch.float64)
    s = (a / 127).to(torch.float32)
    over = s.to(torch.float64) * 127 > a
    s = torch.where(over, torch.nextafter(s, torch.zeros_like(s)), s).clamp_(min=F32_TINY)
    s = torch.where(a > 0, s, torch.zeros_like(s))
    return torch.where((a / 127 > F32_MAX) & torch.isfinite(a), torch.zeros_like(s), s)


def _abs_sums(v: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """Per block, the float64 sum of ``|v|`` (the last block zero-padded). CPU tensors sum
    in numpy (pairwise, float64 accumulation), several times faster than torch's float64
    sum of a float32 tensor on the CPU."""
    if v.device.type != "cpu" or v.requires_grad:
        return quant_pad(v.abs(), nb, b).sum(dim=1, dtype=torch.float64)
    a = np.abs(v.contiguous().numpy())
    if a.size != nb * b:
        a = np.concatenate([a, np.zeros(nb * b - a.size, dtype=a.dtype)])
    with np.errstate(over="ignore"):  # a float64 block's sum may overflow: _finite_blocks looks at it
        return torch.from_numpy(np.add.reduce(a.reshape(nb, b), axis=1, dtype=np.float64))


def _sq_sums(vp: torch.Tensor) -> torch.Tensor:
    w = vp.to(torch.float64)
    return (w * w).sum(dim=1)


def _finite_blocks(total: torch.Tensor, v: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """Whether each block of ``v`` is finite, from its float64 sum ``total`` (of ``|v|`` or
    ``v^2``). Sums of float32 values cannot overflow float64, so a finite sum says it; a
    float64 block with an infinite sum is looked at."""
    finite = torch.isfinite(total)
    if v.dtype == torch.float64:
        inf = torch.isinf(total)
        if bool(inf.any()):
            finite = finite | (inf & torch.isfinite(quant_pad(v, nb, b)).all(dim=1))
    return finite


# -- encoders -------------------------------------------------------------------------------


def _compensated(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    v = x.reshape(-1).to(accum_dtype(x.dtype))
    if residual is not None:
        v = v + residual.reshape(-1).to(v.dtype)
    return v


def sign_ef_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    block: int | None = None,
    new_residual: bool | None = None,
    out: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Scaled sign with error feedback: ``(scales, words, residual)``.

    ``v = x.to(acc) + residual``; ``S_b = mean |v|`` over block ``b`` (:func:`sign_scales`);
    ``words`` packs ``v < 0`` 32 to an int32 word (``bitpack.pack_bits``); the new residual
    (see :func:`~gradzip.kernels.reference.wants_residual`; written into ``out`` when given)
    is ``v - where(v < 0, -S_b, S_b)``, which is ``v`` minus the decoded frame.
    ``scales`` given: used instead of the block means.
    """
    v = _compensated(x, residual)
    n = v.numel()
    nb, b = quant_layout(n, block)
    if scales is None:
        total = _abs_sums(v, nb, b)
        scales = sign_scales(total, quant_counts(n, nb, b, v.device), _finite_blocks(total, v, nb, b))
    else:
        scales = scales.to(device=v.device, dtype=torch.float32)
    neg = v < 0
    words = pack_bits(neg)
    r = None
    if wants_residual(residual, new_residual, out):
        s = quant_per_element(scales.to(v.dtype), nb, b, n)
        r = store_residual(v, torch.where(neg, -s, s), out)
    return scales, words, r


def sign_segments_layout(bounds: Sequence[int]) -> tuple[list[int], int]:
    """Where :func:`sign_ef_segments_reference` puts segment ``j``'s SIGN1 body (its
    ``[bounds[j], bounds[j+1])`` with one scale: 4 bytes of scale, then ``4 * ceil(n_j / 32)``
    bytes of sign words; none for an empty segment): the body offsets, each a multiple of 4,
    and the buffer's length."""
    offsets, pos = [], 0
    for a, b in zip(bounds, bounds[1:]):
        offsets.append(pos)
        n = b - a
        pos += 4 * (1 + (n + 31) // 32) if n else 0
    return offsets, pos


def sign_ef_segments_reference(
    x: torch.Tensor, bounds: Sequence[int], *, residual: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Segment ``j`` of a flat ``x`` (elements ``[bounds[j], bounds[j+1])``) encoded as
    :func:`sign_ef_reference` encodes it alone with one scale (``block=None``), compensated by
    ``residual``'s elements when given: every SIGN1 body (scale, then words) in one uint8 buffer
    at the offsets of :func:`sign_segments_layout`. With ``out`` (flat, the accumulation dtype;
    ``x`` or ``residual`` allowed), each segment's new residual is written over its elements;
    elements outside the segments are not written."""
    return sign_segments_by(
        lambda v, r, o: sign_ef_reference(v, r, new_residual=o is not None, out=o), x, bounds, residual, out
    )


def sign_segments_by(encode, x: torch.Tensor, bounds, residual, out) -> tuple[torch.Tensor, list[int]]:
    """:func:`sign_ef_segments_reference` piece by piece with a backend's own
    ``encode(x piece, residual piece or None, out piece or None) -> (scales, words, _)``."""
    offsets, total = sign_segments_layout(bounds)
    buf = torch.zeros(total // 4, dtype=torch.int32, device=x.device)
    for off, a, b in zip(offsets, bounds, bounds[1:]):
        if b == a:
            continue
        piece = lambda t: None if t is None else t[a:b]  # noqa: E731
        scales, words, _ = encode(x[a:b], piece(residual), piece(out))
        buf[off // 4] = scales.view(torch.int32)[0]
        buf[off // 4 + 1 : off // 4 + 1 + words.numel()] = words
    return buf.view(torch.uint8), offsets


def qsgd_encode_reference(
    x: torch.Tensor,
    levels: int,
    seed: int,
    *,
    block: int | None = 64,
    bits: int | None = None,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QSGD encode: ``(norms, packed codes)``.

    ``N_b`` by :func:`qsgd_norms`; ``r = |v| / N_b * s`` (in ``acc``, each operation rounded;
    0 where ``N_b`` is 0), clamped to ``[0, s]``; level ``l = floor(r) + [u_i < r - floor(r)]``
    with ``u = philox_uniform(seed, n)``, at most ``s``; code ``s + sign(v) * l`` in ``bits``
    (2, 4 or 8; default :func:`qsgd_bits`) per element, packed by ``bitpack.pack_nbit``.
    """
    v = x.reshape(-1).to(accum_dtype(x.dtype))
    n, s = v.numel(), int(levels)
    bits = bits or qsgd_bits(s)
    nb, b = quant_layout(n, block)
    if scales is None:
        sq = _sq_sums(quant_pad(v, nb, b))
        norms = qsgd_norms(sq, _finite_blocks(sq, v, nb, b))
    else:
        norms = scales.to(device=v.device, dtype=torch.float32)
    ne = quant_per_element(norms.to(v.dtype), nb, b, n)
    r = torch.where(ne > 0, v.abs() / ne * s, torch.zeros_like(v)).clamp_(0, s)
    lo = r.floor()
    lvl = lo + (philox_uniform(seed, n, v.device).to(v.dtype) < r - lo).to(v.dtype)
    lvl.clamp_(max=s)
    code = (s + torch.where(v < 0, -lvl, lvl)).to(torch.uint8)
    return norms, pack_nbit(code, bits)


def terngrad_encode_reference(
    x: torch.Tensor,
    seed: int,
    *,
    block: int | None = None,
    clip: float | None = None,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TernGrad encode: ``(scales, 2-bit codes)``.

    ``S_b`` by :func:`terngrad_scales`; ``p = min(|v| / S_b, 1)`` (0 where ``S_b`` is 0);
    code 1 (``+S_b``) or 2 (``-S_b``) where ``u_i < p`` with ``u = philox_uniform(seed, n)``,
    else 0.
    """
    v = x.reshape(-1).to(accum_dtype(x.dtype))
    n = v.numel()
    nb, b = quant_layout(n, block)
    if scales is None:
        vp = quant_pad(v, nb, b)
        amax = vp.abs().amax(dim=1) if nb else v.new_zeros(0)
        sq = _sq_sums(vp) if clip is not None else None
        scales = terngrad_scales(amax, sq, quant_counts(n, nb, b, v.device), clip)
    else:
        scales = scales.to(device=v.device, dtype=torch.float32)
    se = quant_per_element(scales.to(v.dtype), nb, b, n)
    p = torch.where(se > 0, v.abs() / se, torch.zeros_like(v)).clamp_(max=1)
    hit = philox_uniform(seed, n, v.device).to(v.dtype) < p
    code = torch.where(hit, torch.where(v < 0, 2, 1), 0).to(torch.uint8)
    return scales, pack_nbit(code, 2)


def int8_encode_reference(
    x: torch.Tensor, *, block: int | None = 1024, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise absmax int8: ``(float32 scales, int8 codes)``.

    ``S_b`` by :func:`int8_scales` of ``max |v|``; ``q = v / S_b`` computed in float64,
    rounded to nearest (ties to even), clamped to ``[-127, 127]`` (0 where ``S_b`` is 0).
    ``scales`` given (e.g. agreed between ranks): used instead.
    """
    v = x.reshape(-1).to(accum_dtype(x.dtype))
    n = v.numel()
    nb, b = quant_layout(n, block)
    if scales is None:
        amax = quant_pad(v.abs(), nb, b).amax(dim=1) if nb else v.new_zeros(0)
        scales = int8_scales(amax)
    else:
        scales = scales.to(device=v.device, dtype=torch.float32)
    se = quant_per_element(scales.to(torch.float64), nb, b, n)
    q = torch.where(se > 0, v.to(torch.float64) / se, torch.zeros(n, dtype=torch.float64, device=v.device))
    return scales, q.round_().clamp_(-127, 127).to(torch.int8)


def int8_segments_layout(bounds: Sequence[int], block: int | None) -> tuple[list[int], int]:
    """Where :func:`int8_encode_segments_reference` puts segment ``j``'s frame body (its
    ``[bounds[j], bounds[j+1])``: ``4 * nb_j`` bytes of scales, then ``n_j`` codes): the body
    offsets, each a multiple of 4 (the scales' float32 view needs no copy), and the buffer's
    length. Zero bytes pad each body to the next offset."""
    offsets, pos = [], 0
    for a, b in zip(bounds, bounds[1:]):
        offsets.append(pos)
        nb, _ = quant_layout(b - a, block)
        pos += (4 * nb + (b - a) + 3) // 4 * 4
    return offsets, pos


def int8_encode_segments_reference(
    x: torch.Tensor, bounds: Sequence[int], *, block: int | None = 1024, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Segment ``j`` of a flat ``x`` (elements ``[bounds[j], bounds[j+1])``) encoded as
    :func:`int8_encode_reference` encodes it alone, its blocks counted from its start: every
    frame body in one uint8 buffer at the offsets of :func:`int8_segments_layout`. With
    ``residual`` (flat, ``x``'s length and dtype; ``x`` itself allowed): ``residual = x -
    decode`` over every segment's elements, as :func:`int8_apply_` subtracts the frame
    (exact: see ``gradzip.codecs.quant``); elements outside the segments are not written."""
    return int8_segments_by(
        lambda v: int8_encode_reference(v, block=block),
        lambda r, body, _scales, _codes: int8_apply_(r, [body], block=block, subtract=True),
        x,
        bounds,
        block,
        residual,
    )


def int8_segments_by(encode, subtract, x: torch.Tensor, bounds, block, residual) -> tuple[torch.Tensor, list[int]]:
    """:func:`int8_encode_segments_reference` piece by piece with a backend's own ops:
    ``encode(piece) -> (scales, codes)``, ``subtract(residual piece, body, scales, codes)`` its
    ``int8_apply_(..., subtract=True)`` of the piece's frame."""
    offsets, total = int8_segments_layout(bounds, block)
    out = torch.zeros(total, dtype=torch.uint8, device=x.device)
    v = x.reshape(-1)
    rv = residual.reshape(-1) if residual is not None else None
    for off, a, b in zip(offsets, bounds, bounds[1:]):
        if b == a:
            continue
        scales, codes = encode(v[a:b])
        body = out[off : off + 4 * scales.numel() + (b - a)]
        body[: 4 * scales.numel()] = scales.view(torch.uint8)
        body[4 * scales.numel() :] = codes.view(torch.uint8)
        if rv is not None:
            r = rv[a:b]
            if r.data_ptr() != v[a:b].data_ptr():
                r.copy_(v[a:b])
            subtract(r, body, scales, codes)
    return out, offsets


# -- decode ---------------------------------------------------------------------------------

# Byte value -> its 8 signs (+1 for a 0 bit, -1 for a 1 bit, least significant bit first).
_SIGN_LUT = torch.tensor(
    [[1.0 - 2.0 * ((byte >> j) & 1) for j in range(8)] for byte in range(256)], dtype=torch.float64
)
_SIGN_CHUNK = 1 << 16  # elements decoded per step of a CPU accumulate (a 256 KB scratch)


def _sign_values(
    code: torch.Tensor,
    scales: torch.Tensor,
    nb: int,
    b: int,
    n: int,
    acc: torch.dtype,
    out: torch.Tensor | None = None,
    start: int = 0,
    count: int | None = None,
) -> torch.Tensor:
    """Elements ``start .. start + count`` (``start`` a multiple of 8; default: to ``n``) of a
    sign1 frame as ``+-S_b`` in ``acc``, by table lookup of the code bytes (CPU), written into
    ``out`` (at least ``count`` rounded up to 8 elements) when given. ``+-1 * S_b`` is
    exact: the values of ``torch.where(neg, -s, s)``."""
    stop = n if count is None else min(n, start + count)
    lut = _SIGN_LUT.to(acc)
    if nb == 1:
        lut = lut * scales[0].to(acc)
    idx = code[start // 8 : (stop + 7) // 8].to(torch.int32)
    if out is None:
        vals = torch.index_select(lut, 0, idx).view(-1)
    else:
        vals = torch.index_select(lut, 0, idx, out=out[: 8 * idx.numel()].view(-1, 8)).view(-1)
    vals = vals[: stop - start]
    if nb > 1:
        vals.mul_(quant_per_element(scales.to(acc), nb, b, n)[start:stop])
    return vals


def _split_body(body: torch.Tensor, n: int, kind: str, block: int | None, bits: int | None):
    """(nb, b, float32 scales, code bytes) of a frame body: the scales a view of its bytes, or
    a copy of them where the body does not start 4-byte aligned (frames lie back to back in a
    message)."""
    nb, b = quant_layout(n, block)
    head = body[: 4 * nb]
    if head.storage_offset() % 4:
        head = head.clone()
    scales = head.view(torch.float32) if nb else torch.empty(0, dtype=torch.float32, device=body.device)
    return nb, b, scales, body[4 * nb : 4 * nb + quant_code_bytes(kind, n, bits)]


def _lut_decodes(kind: str, acc: torch.dtype, *tensors: torch.Tensor) -> bool:
    return kind == "sign1" and acc in (torch.float32, torch.float64) and all(t.device.type == "cpu" for t in tensors)


def decode_quant_reference(
    body: torch.Tensor,
    n: int,
    kind: str,
    *,
    acc: torch.dtype = torch.float32,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
) -> torch.Tensor:
    """One frame body (``nb`` float32 scales, then the codes) decoded to ``n`` values of ``acc``
    (float32 or float64), by the table of the module docstring. Codes are not validated here
    (callers check frames): QSGD codes above ``2s``, TernGrad code 3 and int8 -128 decode by
    the same formulas."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {list(QUANT_KINDS)}, got {kind!r}")
    nb, b, scales, code = _split_body(body, n, kind, block, bits)
    if n == 0:
        return torch.zeros(0, dtype=acc, device=body.device)
    if _lut_decodes(kind, acc, body):
        return _sign_values(code, scales, nb, b, n, acc)
    se = quant_per_element(scales.to(acc), nb, b, n)
    if kind == "sign1":
        neg = unpack_bits(code.view(torch.int32), n)
        return torch.where(neg, -se, se)
    if kind == "qsgd":
        c = unpack_nbit(code, n, int(bits))
        val = (c.to(acc) - levels) * quant_per_element(scales.to(acc) / levels, nb, b, n)
        # |c - s| <= s, yet the rounded step N_b / s times s can exceed N_b (and overflow
        # near float32's maximum): the magnitude is capped at N_b.
        return torch.where(val.abs() > se, torch.copysign(se, val), val)
    if kind == "tern2":
        c = unpack_nbit(code, n, 2)
        return (c == 1).to(acc) * se - (c == 2).to(acc) * se
    return code.view(torch.int8).to(acc) * se


def decode_add_quant_segments_reference(
    out: torch.Tensor,
    bodies: Sequence[torch.Tensor],
    starts: Sequence[int],
    numels: Sequence[int],
    kind: str,
    *,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
) -> None:
    """``out[starts[s] : starts[s] + numels[s]] += decode(bodies[s])`` for every segment ``s``
    (flat contiguous float32 or float64 ``out``, disjoint ranges): one frame per range, as
    TwoPhase's owners' pieces of a call decode into it."""
    each_segment(decode_add_quant_reference, out, bodies, starts, numels, kind, block=block, levels=levels, bits=bits)


def each_segment(decode, out, bodies, starts, numels, kind, **kw) -> None:
    """``decode(range of out, [body], kind, **kw)`` (a decode-add of one frame) for every
    segment of a segments decode."""
    flat = out.view(-1)
    for body, st, n in zip(bodies, starts, numels):
        if n:
            decode(flat[st : st + n], [body], kind, **kw)


def decode_add_quant_reference(
    out: torch.Tensor,
    bodies: Sequence[torch.Tensor],
    kind: str,
    *,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
) -> None:
    """``out += decode(body_p)`` for every peer ``p`` in rank order (``out`` float32 or
    float64, of any shape of ``n`` elements, taken in row-major order: the frames decode in
    its dtype). On the CPU, sign1 frames decode by table lookup a chunk at a time into a
    small scratch, with the same additions."""
    n = out.numel()
    if not (_lut_decodes(kind, out.dtype, out, *bodies) and out.is_contiguous()) or n == 0:
        for body in bodies:
            out.add_(
                decode_quant_reference(body, n, kind, acc=out.dtype, block=block, levels=levels, bits=bits).view(
                    out.shape
                )
            )
        return
    frames = [_split_body(body, n, kind, block, bits) for body in bodies]
    flat = out.view(-1)
    scratch = torch.empty(min(_SIGN_CHUNK, n + 7) // 8 * 8 + 8, dtype=out.dtype)
    for start in range(0, n, _SIGN_CHUNK):
        stop = min(n, start + _SIGN_CHUNK)
        for nb, b, scales, code in frames:
            flat[start:stop].add_(
                _sign_values(code, scales, nb, b, n, out.dtype, out=scratch, start=start, count=stop - start)
            )


def int8_apply_(out: torch.Tensor, bodies: Sequence[torch.Tensor], *, block: int | None, subtract: bool = False):
    """``out += decode(body_p)`` (``subtract``: ``-=``) for every int8 frame body in order, ``out``
    flat, float32 or float64: Int8's decode-add and its error feedback's subtraction."""
    n = out.numel()
    for body in bodies:
        d = decode_quant_reference(body, n, "int8", acc=out.dtype, block=block)
        if subtract:
            out.sub_(d)
        else:
            out.add_(d)


# -- frame body checks ------------------------------------------------------------------------

#: The byte layouts of the messages checked so far: the scales' byte positions and, per byte,
#: what the code checks read (Int8: a code byte?; 2- and 4-bit codes: how many codes it holds).
_LAYOUTS: dict = {}
_LAYOUTS_MAX = 256


def _body_layout(frames, size: int, kind: str, bits: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For frame bodies at ``frames`` (``(offset, number of scales, elements)`` each) in ``size``
    bytes: the int64 positions of their float32 scales' bytes, and per byte Int8's code-byte
    mask or (2-, 4- and 8-bit codes) its count of codes (0 for a scale byte or a byte between
    bodies, fewer for a frame's last byte); ``None`` for sign frames, whose codes are all
    valid. Cached per layout."""
    key = (kind, bits, str(device), size, frames)
    got = _LAYOUTS.get(key)
    if got is not None:
        return got
    per = 8 // bits if bits <= 8 else 1
    scale_at = []
    count = torch.zeros(size, dtype=torch.uint8)
    for off, nb, n in frames:
        scale_at.append(torch.arange(off, off + 4 * nb))
        c0 = off + 4 * nb
        full, tail = divmod(n, per)
        count[c0 : c0 + full] = per
        if tail:
            count[c0 + full] = tail
    at = torch.cat(scale_at) if scale_at else torch.zeros(0, dtype=torch.int64)
    codes = None if kind == "sign1" else (count > 0) if kind == "int8" else count
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        _LAYOUTS.clear()
    got = _LAYOUTS[key] = (at.to(device), None if codes is None else codes.to(device))
    return got


def quant_body_stats_reference(whole: torch.Tensor, frames, kind: str, bits: int) -> torch.Tensor:
    """:func:`gradzip.kernels.quant_body_stats` in torch ops: a few passes over the bytes and
    byte masks cached per layout (:func:`_body_layout`)."""
    dev = whole.device
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    if whole.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=dev)
    scale_at, codes = _body_layout(frames, whole.numel(), kind, bits, dev)
    neg = (whole.index_select(0, scale_at).view(torch.float32) < 0).any() if scale_at.numel() else zero
    if kind == "int8":  # code -128 anywhere
        top = ((whole == 0x80) & codes).any()
    elif kind == "sign1":
        top = zero
    else:  # the largest code, the padding bits of each frame's last byte left out
        mask, top = (1 << bits) - 1, None
        for k in range(8 // bits):
            c = ((whole >> (k * bits)) & mask) * (codes > k)
            top = c if top is None else torch.maximum(top, c)
        top = top.amax()
    return torch.stack([neg.to(torch.int64), top.to(torch.int64)])
