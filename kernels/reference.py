"""Pure-PyTorch references of the sparsifying ops: threshold + error feedback, the
bitmap and signed-index formats, scatter-adds, and top-k by a sampled threshold.

These are the CPU path and the oracle that every GPU kernel is tested against.
They know nothing of compressors or of torch.distributed: they take tensors and
return tensors. Index arithmetic is int64 throughout. The quantizers' references
are in :mod:`gradzip.kernels.quant`, the Philox draws in :mod:`gradzip.kernels.philox`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "accum_dtype",
    "wants_residual",
    "store_residual",
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
    "scatter_add_sparse_many_reference",
    "abs_select_reference",
    "sampled_topk_reference",
    "sampled_topk_threshold",
    "sampled_topk_approx_reference",
    "approx_band",
    "APPROX_TOL",
]

_SIGN_BIT = 1 << 31


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an op computes in for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- error-feedback outputs ------------------------------------------------------------------


def wants_residual(residual: torch.Tensor | None, new_residual: bool | None, out: torch.Tensor | None) -> bool:
    """Whether an error-feedback encoder returns a new residual: always when ``out`` is
    given, else as ``new_residual`` says, by default when a residual was passed in."""
    if out is not None:
        return True
    return new_residual if new_residual is not None else residual is not None


def store_residual(v: torch.Tensor, sent: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``v - sent``: into ``out`` (returned as it is) when given, else a new flat tensor.

    ``out`` may be the memory ``v`` was computed from (the residual passed in, or ``x``):
    every element is read before it is written."""
    if out is None:
        return v - sent
    torch.sub(v, sent, out=out.view(-1))
    return out


def _apart_from(v: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``v``, copied if it is ``out``'s memory (``x`` given as ``out`` with nothing to add),
    so that what is read after the residual is written still sees ``v``."""
    if out is not None and v.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        return v.clone()
    return v


# -- the 2-bit bitmap and the signed index words ---------------------------------------------


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


# -- threshold + error feedback -------------------------------------------------------------


def threshold_select_reference(v: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of the elements of ``v`` at or above ``+tau`` and at or below ``-tau``."""
    return v >= tau, v <= -tau


class ThresholdResult:
    """What one threshold pass over ``v = x (+ residual)`` produced.

    ``count`` (elements with ``|v| >= tau``) and ``amax`` (``max |v|``, NaN if any
    ``v`` is NaN) are host numbers, fetched once on first use. ``residual`` is
    ``v - sent`` (``sent = +tau, -tau or 0``) in the accumulation dtype, or None
    when it was not asked for; it is the caller's ``out`` tensor itself when one was
    given, else a new flat tensor. :meth:`bitmap` is the ``FMT_BITMAP2`` body
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
        self._check_indexable()
        idx = (self._pos | self._neg).nonzero().reshape(-1)
        return encode_signed_indices(idx, self._neg[idx])


def threshold_ef_reference(
    x: torch.Tensor,
    tau: float,
    residual: torch.Tensor | None = None,
    *,
    new_residual: bool | None = None,
    out: torch.Tensor | None = None,
) -> ThresholdResult:
    """Fused threshold + error feedback, eagerly.

    ``v = x.to(acc) + residual`` (``acc`` = float32, float64 for float64 ``x``);
    element ``i`` is sent as ``+tau`` where ``v >= tau``, ``-tau`` where
    ``v <= -tau``. The new residual is ``v - (pos * tau - neg * tau)``: exactly
    what ``v - decompress(payload)`` gives, written into ``out`` when given (see
    :func:`wants_residual`, :func:`store_residual`). ``tau`` is compared in ``acc``.
    """
    acc = accum_dtype(x.dtype)
    v = x.reshape(-1).to(acc)
    if residual is not None:
        v = v + residual.reshape(-1).to(acc)
    v = _apart_from(v, out)
    pos, neg = threshold_select_reference(v, tau)
    r = None
    if wants_residual(residual, new_residual, out):
        r = store_residual(v, pos.to(acc) * tau - neg.to(acc) * tau, out)
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


def scatter_add_sparse_many_reference(
    out: torch.Tensor, idxs: Sequence[torch.Tensor], vals: Sequence[torch.Tensor]
) -> None:
    """:func:`scatter_add_sparse_reference` of every peer's frame, in order: each element's sum
    takes its peers' values in the frames' order."""
    for i, v in zip(idxs, vals):
        scatter_add_sparse_reference(out, i, v)


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
    exact top ``k`` among them. At least one: where none reaches it (a NaN in the sample
    makes the threshold NaN, which nothing reaches), the exact top ``k``, as ``torch.topk``
    ranks them (NaN highest).
    """
    v = v.reshape(-1)
    select = select or abs_select_reference
    n, s = v.numel(), probe.numel()
    thr = sampled_topk_threshold(v, k, probe)
    idx = select(v, thr, math.ceil(_sample_k(k, s, n) * n / s))
    if idx.numel() > k:
        idx = idx[torch.topk(v[idx].abs(), k, sorted=False).indices].sort().values
    elif idx.numel() == 0:
        idx = torch.topk(v.abs(), k, sorted=False).indices.sort().values
    return idx


# -- approximate top-k -------------------------------------------------------------------------

APPROX_TOL = 0.1  # the approximate top-k's count stays within k * (1 -+ APPROX_TOL)
_SUB = 4096  # survivors sampled to place the second threshold


def approx_band(k: int, tol: float = APPROX_TOL) -> tuple[int, int]:
    """The counts the approximate top-k may return for ``k``: ``[ceil((1-tol) k), floor((1+tol) k)]``
    (``k`` itself always inside)."""
    return min(k, math.ceil((1 - tol) * k - 1e-9)), max(k, math.floor((1 + tol) * k + 1e-9))


def _approx_sample_k(k: int, s: int, n: int) -> int:
    """The sample rank of the first threshold: ``m = k s / n`` samples are expected above the
    k-th largest; aiming ``3 sqrt(m) + 1`` above it leaves fewer than ``k`` survivors in about
    one draw in a few hundred (a binomial count 3 standard deviations short)."""
    m = k * s / n
    return min(s, max(1, math.ceil(m + 3 * math.sqrt(m) + 1)))


def sampled_topk_approx_reference(
    v: torch.Tensor,
    k: int,
    probe: torch.Tensor,
    *,
    select: Callable[..., torch.Tensor] | None = None,
    tol: float = APPROX_TOL,
    route: list | None = None,
) -> torch.Tensor:
    """Indices (int64, ascending) of about ``k`` large elements of ``|v|``, without an exact
    top-k over the survivors: their count ``c`` is in :func:`approx_band` (within ``tol`` of
    ``k``), always.

    1. ``thr``: the :func:`_approx_sample_k`-th largest of ``|v[probe]|``, aimed a few standard
       deviations of the sample's count below the k-th largest value; ``select`` (one pass
       over ``v``, by default :func:`abs_select_reference`) keeps ``|v| >= thr``. A count in
       the band is the answer (route ``"survivors"``: large samples, ``k s / n`` in the
       thousands, land there).
    2. More survivors than the band: a second threshold, the quantile ``k / c`` of the
       survivors' ``|v|`` at up to 4096 positions taken from the probe (``probe % c``), and
       ``select`` again over the survivors' values (route ``"resampled"``). The count of a
       quantile of 4096 draws is off by about ``0.7%`` of ``c``, so this lands in the band but
       for ties (many equal values at the threshold).
    3. Otherwise (ties, or fewer survivors than the band: the sample overestimated the
       threshold) the exact answer: a top-k over the survivors, or over ``v`` when they are
       too few (routes ``"trim"``, ``"exact"``). Exactly ``k``: inside the band.

    ``route``, a list, receives the route taken. Elements with a NaN ``|v|`` are never
    selected by the thresholds (they may be by the exact fallbacks, as ``torch.topk`` ranks
    NaN highest).
    """
    v = v.reshape(-1)
    select = select or abs_select_reference
    n, s = v.numel(), probe.numel()
    lo, hi = approx_band(k, tol)
    ks = _approx_sample_k(k, s, n)
    thr = torch.topk(v[probe].abs(), ks, sorted=False).values.min()
    idx = select(v, thr, math.ceil(ks * n / s))
    c = idx.numel()
    taken = "survivors"
    if c > hi:
        a = v[idx].abs()
        sub = a[probe[:_SUB] % c]
        r = min(sub.numel(), max(1, round(k * sub.numel() / c)))
        thr2 = torch.topk(sub, r, sorted=False).values.min()
        keep = select(a, thr2, k)
        if lo <= keep.numel() <= hi:
            idx, taken = idx[keep], "resampled"
        else:
            idx, taken = idx[torch.topk(a, k, sorted=False).indices].sort().values, "trim"
    elif c < lo:
        idx, taken = torch.topk(v.abs(), k, sorted=False).indices.sort().values, "exact"
    if route is not None:
        route.append(taken)
    return idx
