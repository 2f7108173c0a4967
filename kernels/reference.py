"""Pure-PyTorch reference ops.

These are the CPU path and the oracle that every GPU kernel is tested against.
They know nothing of compressors or of torch.distributed: they take tensors and
return tensors. Index arithmetic is int64 throughout.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import struct

import torch

__all__ = [
    "pack_2bit",
    "unpack_2bit",
    "encode_signed_indices",
    "decode_signed_indices",
    "threshold_select_reference",
    "ThresholdResult",
    "threshold_ef_reference",
    "decode_add_bitmap2_reference",
    "scatter_add_signed_reference",
    "scatter_add_sparse_reference",
    "abs_select_reference",
    "sampled_topk_reference",
    "sampled_topk_threshold",
]

_SIGN_BIT = 1 << 31


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack 2-bit codes (uint8 values 0..3) four to a byte.

    Element ``i`` lands in byte ``i // 4`` at bits ``2 * (i % 4)``. The result has
    ``ceil(n / 4)`` bytes; the unused high bits of the last byte are zero.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_2bit expects uint8 codes, got {codes.dtype}")
    flat = codes.reshape(-1)
    n = flat.numel()
    nbytes = (n + 3) // 4
    padded = torch.zeros(nbytes * 4, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat & 3
    q = padded.view(nbytes, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def unpack_2bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: the first ``n`` 2-bit codes as uint8."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_2bit expects uint8, got {packed.dtype}")
    if packed.numel() * 4 < n:
        raise ValueError(f"{packed.numel()} bytes hold fewer than n={n} 2-bit codes")
    p = packed.reshape(-1, 1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((p >> shifts) & 3).reshape(-1)[:n]


def encode_signed_indices(idx: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Strom's message word: the index in the low 31 bits, the sign in bit 31.

    ``idx`` must be < 2**31. Returns int32 (bit-reinterpreted from the uint32 word).
    """
    idx64 = idx.to(torch.int64)
    words = idx64 | (negative.to(torch.int64) << 31)
    # Map [0, 2**32) onto int32 two's complement without overflow.
    words = torch.where(words >= _SIGN_BIT, words - (1 << 32), words)
    return words.to(torch.int32)


def decode_signed_indices(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_signed_indices`: (int64 indices, bool negative)."""
    w = words.to(torch.int64)
    negative = w < 0
    idx = torch.where(negative, w + _SIGN_BIT, w)
    return idx, negative


def threshold_select_reference(v: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of the elements of ``v`` at or above ``+tau`` and at or below ``-tau``."""
    return v >= tau, v <= -tau


def _accum(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- threshold + error feedback -------------------------------------------------------------


class ThresholdResult:
    """What one threshold pass over ``v = x (+ residual)`` produced.

    ``count`` (elements with ``|v| >= tau``) and ``amax`` (``max |v|``, NaN if any
    ``v`` is NaN) are host numbers, fetched once on first use. ``residual`` is
    ``v - sent`` (``sent = +tau, -tau or 0``) in the accumulation dtype, or None
    when it was not asked for. :meth:`bitmap` is the ``FMT_BITMAP2`` body
    (``ceil(n / 4)`` bytes); :meth:`indices` the ``FMT_SIGNED_INDEX`` words in
    ascending index order (n must be < 2**31). Backends subclass this.
    """

    backend = "reference"

    def __init__(self, n: int, tau: float, residual: torch.Tensor | None) -> None:
        self.n = n
        self.tau = tau
        self.residual = residual
        self._stats: tuple[int, float] | None = None

    def _fetch_stats(self) -> tuple[int, float]:
        raise NotImplementedError

    @property
    def count(self) -> int:
        if self._stats is None:
            self._stats = self._fetch_stats()
        return self._stats[0]

    @property
    def amax(self) -> float:
        if self._stats is None:
            self._stats = self._fetch_stats()
        return self._stats[1]

    def bitmap(self) -> torch.Tensor:
        raise NotImplementedError

    def indices(self) -> torch.Tensor:
        raise NotImplementedError


class DeviceThresholdResult(ThresholdResult):
    """What the GPU backends' threshold pass leaves: the 2-bit bitmap as int32 words
    (16 codes each, ``FMT_BITMAP2``'s byte layout), per-program counts, and per-program
    ``max |v|`` as float32 bits. Backends add :meth:`indices` (their compaction pass)."""

    def __init__(self, n, tau, residual, words, counts, amax_bits) -> None:
        super().__init__(n, tau, residual)
        self._words, self._counts, self._amax_bits = words, counts, amax_bits

    def _fetch_stats(self) -> tuple[int, float]:
        if self.n == 0:
            return 0, 0.0
        count, bits = torch.stack([self._counts.sum(dtype=torch.int64), self._amax_bits.max().to(torch.int64)]).tolist()
        return int(count), struct.unpack("<f", struct.pack("<i", int(bits)))[0]

    def bitmap(self) -> torch.Tensor:
        return self._words.view(torch.uint8)[: (self.n + 3) // 4]

    def _check_indexable(self) -> None:
        if self.n >= 2**31:
            raise ValueError(f"index words hold 31 bits; n={self.n} needs the bitmap")


class _ReferenceThresholdResult(ThresholdResult):
    def __init__(self, v, pos, neg, tau, residual):
        super().__init__(v.numel(), tau, residual)
        self._v, self._pos, self._neg = v, pos, neg

    def _fetch_stats(self):
        if self.n == 0:
            return 0, 0.0
        count = int((self._pos | self._neg).sum())
        return count, float(self._v.abs().max())

    def bitmap(self):
        return pack_2bit(self._pos.to(torch.uint8) | (self._neg.to(torch.uint8) << 1))

    def indices(self):
        if self.n >= 2**31:
            raise ValueError(f"index words hold 31 bits; n={self.n} needs the bitmap")
        idx = (self._pos | self._neg).nonzero().reshape(-1)
        return encode_signed_indices(idx, self._neg[idx])


def threshold_ef_reference(
    x: torch.Tensor, tau: float, residual: torch.Tensor | None = None, *, new_residual: bool | None = None
) -> ThresholdResult:
    """Fused threshold + error feedback, eagerly.

    ``v = x.to(acc) + residual`` (``acc`` = float32, float64 for float64 ``x``);
    element ``i`` is sent as ``+tau`` where ``v >= tau``, ``-tau`` where
    ``v <= -tau``. The new residual is ``v - (pos * tau - neg * tau)``: exactly
    what ``v - decompress(payload)`` gives. ``tau`` is compared in ``acc``.
    """
    acc = _accum(x.dtype)
    v = x.reshape(-1).to(acc)
    if residual is not None:
        v = v + residual.reshape(-1).to(acc)
    pos, neg = threshold_select_reference(v, tau)
    r = None
    if new_residual if new_residual is not None else residual is not None:
        r = v - (pos.to(acc) * tau - neg.to(acc) * tau)
    return _ReferenceThresholdResult(v, pos, neg, tau, r)


# -- decode and accumulate ------------------------------------------------------------------


def decode_add_bitmap2_reference(out: torch.Tensor, bodies: Sequence[torch.Tensor], taus: Sequence[float]) -> None:
    """``out += decode(body_p)`` for each peer ``p`` in order (0 -> 0, 1 -> +tau, 2 -> -tau)."""
    n = out.numel()
    for body, tau in zip(bodies, taus):
        codes = unpack_2bit(body, n)
        out.add_((codes == 1).to(out.dtype) * tau - (codes == 2).to(out.dtype) * tau)


def scatter_add_signed_reference(out: torch.Tensor, words: torch.Tensor, tau: float) -> None:
    """``out[idx] += +-tau`` for the signed index words of one peer."""
    idx, negative = decode_signed_indices(words)
    vals = torch.full(idx.shape, tau, dtype=out.dtype, device=out.device)
    vals[negative] = -tau
    out.index_add_(0, idx, vals)


def scatter_add_sparse_reference(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """``out[idx] += vals`` (one peer's top-k frame; indices int32 or int64)."""
    out.index_add_(0, idx.to(torch.int64), vals.to(out.dtype))


# -- top-k by a sampled threshold ----------------------------------------------------------


def abs_select_reference(v: torch.Tensor, thr, expected: int | None = None) -> torch.Tensor:
    """Ascending int64 indices of the elements with ``|v| >= thr`` (``thr`` in v's dtype).

    ``expected`` (a guess at the count, for kernels that size a buffer) is unused here.
    """
    return (v.reshape(-1).abs() >= thr).nonzero().reshape(-1)


def sampled_topk_threshold(v: torch.Tensor, k: int, probe: torch.Tensor) -> torch.Tensor:
    """DGC's threshold estimate: a 0-d tensor (v's dtype) aimed 25% below the k-th largest |v|.

    The top ``ceil(1.25 * k * s / n)`` of ``|v[probe]|`` (``s`` samples), so about
    ``1.25 k`` elements of ``v`` reach it.
    """
    ks = _sample_k(k, probe.numel(), v.numel())
    return torch.topk(v.reshape(-1)[probe].abs(), ks, sorted=False).values.min()


def _sample_k(k: int, s: int, n: int) -> int:
    return min(s, max(1, math.ceil(1.25 * k * s / n)))


def sampled_topk_reference(
    v: torch.Tensor,
    k: int,
    probe: torch.Tensor,
    *,
    select: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Indices (int64, ascending) of at most ``k`` large elements of ``|v|`` (DGC).

    The threshold is estimated on ``v[probe]`` (:func:`sampled_topk_threshold`); the
    elements that reach it are selected (``select(v, thr, expected)``, by default
    :func:`abs_select_reference`) and, when more than ``k`` do, trimmed to the
    exact top ``k`` among them.
    """
    v = v.reshape(-1)
    select = select or abs_select_reference
    n, s = v.numel(), probe.numel()
    thr = sampled_topk_threshold(v, k, probe)
    idx = select(v, thr, math.ceil(_sample_k(k, s, n) * n / s))
    if idx.numel() > k:
        idx = idx[torch.topk(v[idx].abs(), k, sorted=False).indices].sort().values
    return idx


# -- Philox4x32-10: the counter-based RNG of ``tl.rand`` / ``tl.rand4x``, in torch ----------------
#
# ``tl.randint4x(seed, offset)`` (triton/language/random.py) runs Philox4x32 for 10 rounds on
# the counter (offset_lo, offset_hi, 0, 0) with the key (seed_lo, seed_hi) (the seed as uint64,
# split into 32-bit halves; offset as uint64 likewise) and returns the four output words;
# ``tl.randint`` keeps the first. ``tl.rand`` / ``tl.rand4x`` bitcast each uint32 to int32, map
# x -> ~x where negative (so into [0, 2**31)), convert to float32 (round to nearest even) and
# multiply in float32 by 4.6566127342e-10 (float32), the largest scale with
# (2**31 - 1) * scale < 1.
#
# gradzip's quantizer kernels draw element ``i``'s uniform from word ``i % 4`` of the counter
# ``i // 4`` (``tl.rand4x(seed, i // 4)``): one Philox evaluation serves four elements, a
# quarter of the integer work of ``tl.rand(seed, i)`` (TernGrad's one-pass encoder on an H100:
# 0.319 -> 0.167 ms at 64M elements; docs/kernels_h100.md). :func:`philox_uniform` computes
# the same floats bit for bit with int64 tensors holding uint32 values.

_M32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_ROUNDS = 10
_UNIFORM_SCALE = 4.6566127342e-10  # rounded to float32 where it is used


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` (``a`` a uint32 constant, ``b`` int64 holding uint32),
    without overflowing int64: ``b`` is split into 16-bit halves."""
    p_lo = (b & 0xFFFF) * a  # < 2**48
    t = (b >> 16) * a + (p_lo >> 16)  # a * b == t * 2**16 + (p_lo & 0xFFFF), t < 2**49
    return t >> 16, ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def philox4x32(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, rounds: int = _PHILOX_ROUNDS):
    """Philox4x32-``rounds`` on counters (int64 tensors holding uint32) under the key ``seed`` (uint64).

    Returns the four output words, as Triton's ``philox_impl`` computes them.
    """
    seed = int(seed) & ((1 << 64) - 1)
    k0, k1 = seed & _M32, seed >> 32
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def philox_randint(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """``tl.randint(seed, offsets)`` as int64 values in [0, 2**32) (offsets int64, >= 0)."""
    off = offsets.to(torch.int64)
    zero = torch.zeros_like(off)
    return philox4x32(seed, off & _M32, (off >> 32) & _M32, zero, zero)[0]


def philox_uniform(seed: int, n: int, device=None, *, offset: int = 0) -> torch.Tensor:
    """``n`` float32 draws in [0, 1) for the elements ``offset .. offset + n - 1``: element ``i``
    takes word ``i % 4`` of ``tl.rand4x(seed, i // 4)``, bit for bit.

    The draws take the values ``k * 4.6566127342e-10`` (float32, rounded) for an integer
    ``k`` in [0, 2**31), so ``P(u < p) = p`` up to float32 rounding (about 2**-24).
    """
    first = offset // 4
    q = torch.arange(first, (offset + n + 3) // 4, dtype=torch.int64, device=device)
    zero = torch.zeros_like(q)
    words = philox4x32(seed, q & _M32, (q >> 32) & _M32, zero, zero)
    start = offset - 4 * first
    x = torch.stack(words, dim=1).reshape(-1)[start : start + n]
    x = torch.where(x >= 1 << 31, _M32 - x, x)  # int32 bitcast, then ~x where negative
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=device)


# -- quantizer codecs (SignSGD, QSGD, TernGrad; decode of their frames and Int8's) -------------
#
# Block layout as gradzip.compressors.quant: ``nb = ceil(n / b)`` blocks of ``b`` elements
# (``block=None``: one block), the last one possibly short; scales are float32; codes are
# packed as gradzip.kernels.bitpack packs them. Each encode reference computes exactly what the
# compressor computes, and takes optional precomputed ``scales`` so that a kernel, whose block
# reduction sums in another order, can be checked bit for bit downstream of its scales.

_F32_MAX = 3.4028234663852886e38


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


def _qcounts(n: int, nb: int, b: int, device) -> torch.Tensor:
    c = torch.full((nb,), float(b), dtype=torch.float64, device=device)
    if nb:
        c[-1] = n - (nb - 1) * b
    return c


def _pack_sign_words(neg: torch.Tensor) -> torch.Tensor:
    from .bitpack import pack_bits

    return pack_bits(neg)


def sign_ef_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    block: int | None = None,
    new_residual: bool | None = None,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Scaled sign with error feedback: ``(scales, words, residual)``.

    ``v = x.to(float32) + residual``; ``S_b = mean |v|`` over block ``b`` (summed in
    float64, then rounded to float32: ``SignSGD``'s scale); ``words`` packs ``v < 0``
    32 to an int32 word (``bitpack.pack_bits``); the new residual (when ``residual`` is
    given, or ``new_residual=True``) is ``v - where(v < 0, -S_b, S_b)``, which is
    ``v - SignSGD.decompress(frame)``. ``scales`` given: used instead of the block means.
    """
    v = x.reshape(-1).to(torch.float32)
    if residual is not None:
        v = v + residual.reshape(-1).to(torch.float32)
    n = v.numel()
    nb, b = quant_layout(n, block)
    if scales is None:
        total = quant_pad(v.abs(), nb, b).sum(dim=1, dtype=torch.float64)
        scales = (total / _qcounts(n, nb, b, v.device)).to(torch.float32)
    neg = v < 0
    r = None
    if new_residual if new_residual is not None else residual is not None:
        s = quant_per_element(scales.to(torch.float32), nb, b, n)
        r = v - torch.where(neg, -s, s)
    return scales, _pack_sign_words(neg), r


def qsgd_norms_reference(v: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """QSGD's float32 block norms of float32 ``v`` (as ``QSGD.compress``: float32
    ``vector_norm``; if a norm overflows while ``v`` is finite, float64 norms with the
    blocks beyond float32's range set to 0)."""
    norms = torch.linalg.vector_norm(quant_pad(v, nb, b), dim=1).to(torch.float32)
    if not bool(torch.isfinite(norms).all()) and bool(torch.isfinite(v).all()):
        wide = torch.linalg.vector_norm(quant_pad(v, nb, b).to(torch.float64), dim=1)
        norms = torch.where(wide <= _F32_MAX, wide, 0.0).to(torch.float32)
    return norms


def qsgd_encode_reference(
    x: torch.Tensor,
    levels: int,
    seed: int,
    *,
    block: int | None = 64,
    bits: int | None = None,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QSGD encode with Philox draws: ``(norms, packed codes)``.

    ``r = |v| / N_b * s`` (float32), ``l = floor(r) + [u_i < r - floor(r)]`` with
    ``u_i = philox_uniform(seed, n)[i]``, code ``s + sign(v) * l`` in ``bits`` (2, 4 or 8;
    default the fewest that hold ``2s + 1`` codes) per element, packed as ``bitpack.pack_nbit``.
    The arithmetic is ``QSGD.compress``'s, expression for expression.
    """
    from .bitpack import pack_nbit

    v = x.reshape(-1).to(torch.float32)
    n, s = v.numel(), int(levels)
    bits = bits or (2 if 2 * s + 1 <= 4 else 4 if 2 * s + 1 <= 16 else 8)
    nb, b = quant_layout(n, block)
    norms = qsgd_norms_reference(v, nb, b) if scales is None else scales.to(torch.float32)
    ne = quant_per_element(norms, nb, b, n)
    r = torch.where(ne > 0, v.abs() / ne * s, torch.zeros_like(v)).clamp_(0, s)
    lo = r.floor()
    lvl = lo + (philox_uniform(seed, n, v.device) < r - lo).to(v.dtype)
    lvl.clamp_(max=s)
    code = (s + torch.where(v < 0, -lvl, lvl)).to(torch.uint8)
    return norms, pack_nbit(code, bits)


def terngrad_scales_reference(v: torch.Tensor, nb: int, b: int, clip: float | None = None) -> torch.Tensor:
    """TernGrad's float32 block scales of float32 ``v``: ``max|v|``, or with ``clip``
    ``min(max|v|, clip * sqrt(mean(v^2)))`` (the mean in float64)."""
    vp = quant_pad(v, nb, b)
    scale = vp.abs().amax(dim=1) if nb else v.new_zeros(0)
    if clip is not None:
        sq = (vp.to(torch.float64) ** 2).sum(dim=1)
        sigma = (sq / _qcounts(v.numel(), nb, b, v.device)).sqrt()
        scale = torch.minimum(scale, (clip * sigma).to(scale.dtype))
    return scale.to(torch.float32)


def terngrad_encode_reference(
    x: torch.Tensor,
    seed: int,
    *,
    block: int | None = None,
    clip: float | None = None,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TernGrad encode with Philox draws: ``(scales, 2-bit codes)``.

    ``p = min(|v| / S_b, 1)``; code 1 (``+S_b``) or 2 (``-S_b``) where
    ``u_i < p``, else 0; as ``TernGrad.compress``, with ``u = philox_uniform(seed, n)``.
    """
    from .bitpack import pack_nbit

    v = x.reshape(-1).to(torch.float32)
    n = v.numel()
    nb, b = quant_layout(n, block)
    scale = terngrad_scales_reference(v, nb, b, clip) if scales is None else scales.to(torch.float32)
    se = quant_per_element(scale, nb, b, n)
    p = torch.where(se > 0, v.abs() / se, torch.zeros_like(v)).clamp_(max=1)
    hit = philox_uniform(seed, n, v.device) < p
    code = torch.where(hit, torch.where(v < 0, 2, 1), 0).to(torch.uint8)
    return scale, pack_nbit(code, 2)


QUANT_KINDS = ("sign1", "qsgd", "tern2", "int8")


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


def decode_quant_reference(
    body: torch.Tensor, n: int, kind: str, *, block: int | None = None, levels: int = 0, bits: int | None = None
) -> torch.Tensor:
    """One frame body (``nb`` float32 scales, then the codes) decoded to float32, as the
    quantizer's ``_decode(payload, float32)`` computes it. Codes are not validated here
    (callers check frames): QSGD codes above ``2s``, TernGrad code 3 and int8 -128
    decode by the same formulas."""
    from .bitpack import unpack_bits, unpack_nbit

    nb, b = quant_layout(n, block)
    scales = body[: 4 * nb].view(torch.float32) if nb else torch.empty(0, dtype=torch.float32, device=body.device)
    code = body[4 * nb : 4 * nb + quant_code_bytes(kind, n, bits)]
    s = quant_per_element(scales, nb, b, n)
    if kind == "sign1":
        neg = unpack_bits(code.view(torch.int32) if code.numel() else code.new_empty(0, dtype=torch.int32), n)
        return torch.where(neg, -s, s)
    if kind == "qsgd":
        c = unpack_nbit(code, n, int(bits))
        step = quant_per_element(scales / levels, nb, b, n)
        return (c.to(torch.float32) - levels) * step
    if kind == "tern2":
        c = unpack_nbit(code, n, 2)
        return (c == 1).to(torch.float32) * s - (c == 2).to(torch.float32) * s
    if kind == "int8":
        return code.view(torch.int8).to(torch.float32) * s
    raise ValueError(f"kind must be one of {list(QUANT_KINDS)}, got {kind!r}")


def decode_add_quant_reference(
    out: torch.Tensor,
    bodies: Sequence[torch.Tensor],
    kind: str,
    *,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
) -> None:
    """``out += decode(body_p)`` for every peer ``p`` in rank order (float32 ``out``, flat)."""
    n = out.numel()
    for body in bodies:
        out.add_(decode_quant_reference(body, n, kind, block=block, levels=levels, bits=bits))
