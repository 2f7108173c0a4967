"""Top-k sparsification: :class:`TopK` (exact, sampled and approximate selection, STC's signs,
a call-wide top-k) and the selection it shares with Threshold (:func:`topk_abs`,
:func:`call_counts`). Positions are coded by :mod:`gradzip.codecs.positions`."""

from __future__ import annotations

import math

import torch

import gradzip.args as args
import gradzip.kernels as K
import gradzip.warmup as warmup

from ..wire import (
    FMT_DENSE,
    FMT_EMPTY,
    FrameError,
    Payload,
    accum_dtype,
    as_bytes,
    from_bytes,
    itemsize,
    narrow,
    row_view,
)
from .base import (
    Codec,
    TensorContext,
    check_dense,
    check_empty,
    check_format,
    check_input,
    check_length,
    check_no_scale,
    check_scale,
    check_vdtype,
    compensate,
    fmt_name,
    tensor_seed,
)
from .cast import saturating_cast
from .positions import (
    _leb128,
    _pack_ef_rows,
    _signs2,
    _unpack_ef_rows,
    ef_low_bits,
    ef_nbytes,
    gaps_nbytes,
    pack_ef,
    pack_gaps,
    unpack_ef,
    unpack_ef_many,
    unpack_gaps,
)

__all__ = [
    "TopK",
    "topk_abs",
    "call_counts",
    "FMT_SPARSE",
    "FMT_SPARSE_MASK",
    "FMT_SPARSE_SIGN",
    "FMT_SPARSE_SIGN2",
    "FMT_SPARSE_EF",
]

FMT_SPARSE = 4  # body: u8 bits, the index gaps packed at that width, then the values in vdtype


FMT_SPARSE_MASK = 5  # body: a 1-bit mask of the sent positions (ceil(n / 8) bytes), then the values


FMT_SPARSE_SIGN = 6  # body: the gaps as FMT_SPARSE, each with a sign bit; every value is +-scale


FMT_SPARSE_SIGN2 = 7  # body: 2 bits per element, 0 -> 0, 1 -> +scale, 2 -> -scale


FMT_SPARSE_EF = 8  # body: LEB128 count, the positions in Elias-Fano code (pack_ef), then the values


_VALUE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


_VALUES = (*_VALUE_DTYPES, "sign")


_SCOPES = ("tensor", "call")


_F32_MAX = 3.4028234663852886e38


#: The value dtypes of a frame of an input of this dtype whose gradient's dtype is not known.
_NARROWER = {
    torch.float16: (torch.float16,),
    torch.bfloat16: (torch.bfloat16,),
    torch.float32: (torch.float32, torch.float16, torch.bfloat16),
}


def _within(count: int, band: tuple[int, int]) -> bool:
    return band[0] <= count <= band[1]


def _k_of(ratio: float, n: int) -> int:
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))


def _empty(x: torch.Tensor) -> Payload:
    """A frame that sends nothing (all zeros) for a tensor like ``x``."""
    return Payload(body=torch.empty(0, dtype=torch.uint8, device=x.device), shape=x.shape, dtype=x.dtype, fmt=FMT_EMPTY)


#: Below this many elements (or above n / 8 selected) the exact top-k runs torch.topk on the whole tensor.
_PREFILTER_FROM = 1 << 16


_PREFILTER_SAMPLE = 1 << 14


def topk_abs(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, |values|)`` of the ``k`` largest ``|v|`` of flat ``v``, in no order: the
    answer of ``torch.topk(v.abs(), k)``, found among fewer candidates.

    A fixed strided sample of ``|v|`` gives a threshold a few standard deviations below its
    estimate of the ``k``-th largest; when at least ``k`` elements reach it, the ``k`` largest all
    do, and ``torch.topk`` runs over those candidates only (about ``1.1 k``). Otherwise, and where
    ``|v|`` holds a NaN (``torch.topk`` ranks NaN first; a comparison would drop it), it runs over
    the whole tensor. Where the threshold is zero (a mostly-zero ``v``) the candidates are the
    nonzeros (and the first zeros, where fewer than ``k`` are nonzero). The values are exact;
    among equal magnitudes at the ``k``-th place the chosen ones are ``torch.topk``'s choice
    among the candidates (the first zeros, where zeros are chosen). The candidates come from
    :func:`~gradzip.kernels.abs_select` (one compiled pass on the CPU, no ``|v|`` tensor); NaN
    is ruled out by one sum (a NaN makes it NaN). On one core, 16.8M elements at k = 1%: 0.065 s
    for ``torch.topk``, about 0.01 s here. On the GPU's side (:func:`gradzip.kernels.gpu_side`)
    the prefilter's test and the sparse candidates would be host reads: ``torch.topk`` runs over
    the whole tensor there."""
    flat = v.reshape(-1)
    n = flat.numel()
    if n < _PREFILTER_FROM or 8 * k > n or K.gpu_side(flat.device):  # a GPU: no host read
        return _topk_abs_all(flat, k)
    sample = flat[:: n // _PREFILTER_SAMPLE].abs()
    s = sample.numel()
    m = k * s / n  # samples expected above the k-th largest
    rank = min(s, int(m + 4 * math.sqrt(m) + 8))
    thr = torch.topk(sample, rank, sorted=False).values.min()
    # one host sync for the three tests (a GPU waits at each)
    nan_thr, nan_sum, positive = torch.stack([torch.isnan(thr), flat.sum().isnan(), thr > 0]).tolist()
    if nan_thr or nan_sum:  # NaN (or inf - inf): the whole tensor
        return _topk_abs_all(flat, k)
    if not positive:  # the sample is mostly zeros: the candidates are the nonzeros
        return _topk_abs_sparse(flat, k)
    cand = K.abs_select(flat, thr, expected=int(rank * n / s))
    if cand.numel() < k:
        return _topk_abs_all(flat, k)
    top = torch.topk(flat[cand].abs(), k, sorted=False)
    return cand[top.indices], top.values


def _topk_abs_all(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.topk(flat.abs(), k, sorted=False)
    return top.indices, top.values


def _topk_abs_sparse(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_abs` where the sample's threshold is zero (no NaN in ``flat``): the top ``k``
    among the nonzeros, or all of them and the first zeros where fewer than ``k`` are nonzero.
    A threshold of zero selected every element, and a top-k over all of them cost several times
    the plain ``torch.topk``: TwoPhase's owner meets such pieces (the sum of the ranks'
    top-k's, 1% dense where they agree)."""
    nz = flat.nonzero().squeeze(1)
    if nz.numel() >= k:
        top = torch.topk(flat[nz].abs(), k, sorted=False)
        return nz[top.indices], top.values
    zeros = (flat == 0).nonzero().squeeze(1)[: k - nz.numel()]
    idx = torch.cat([nz, zeros])
    return idx, flat[idx].abs()


#: Segment starts repeated per position, by layout (:func:`_shifts`).
_SHIFTS: dict = {}
_SHIFTS_MAX = 256


def _shifts(runs, device) -> torch.Tensor:
    """Each of ``runs``' ``(count, start)`` as ``count`` copies of ``start``, on ``device``:
    what TwoPhase's owners' positions are offset by, one addition for any number of owners
    (kept per layout, which recurs every step)."""
    key = (tuple(runs), str(device))
    got = _SHIFTS.get(key)
    if got is None:
        if len(_SHIFTS) >= _SHIFTS_MAX:
            _SHIFTS.clear()
        host = torch.cat([torch.full((c,), st, dtype=torch.int64) for c, st in runs])
        got = _SHIFTS[key] = K.host_to_device(host, device)
    return got


def call_counts(xs, ratio: float) -> list:
    """Per flat tensor of ``xs``, how many of its elements are among the
    ``ceil(ratio * total)`` largest magnitudes of all of them together (ties broken by
    ``torch.topk``): a call-wide top-k, allotted to its tensors. A tensor may get none."""
    sizes = [x.numel() for x in xs]
    total = sum(sizes)
    k = _k_of(ratio, total)
    if not k:
        return [0] * len(xs)
    flat = torch.cat([x.reshape(-1).abs().to(torch.float32) for x in xs])
    top = torch.topk(flat, k, sorted=False).indices
    ends = K.host_to_device(torch.tensor(sizes).cumsum(0), top.device)
    return torch.bincount(torch.bucketize(top, ends, right=True), minlength=len(xs)).tolist()


def _rows_topk(device: torch.device, n: int, k: int) -> bool:
    """Whether :meth:`TopK.encode_pieces` selects pieces of ``n`` elements as the rows of one
    ``torch.topk``: on GPUs always (no host sync a piece), on the CPU where :func:`topk_abs`
    itself runs ``torch.topk`` over the whole piece (its prefilter is faster from there)."""
    return K.gpu_side(device) or n < _PREFILTER_FROM or 8 * k > n


class TopK(Codec):
    """Send the ``k = ceil(ratio * n)`` elements of largest magnitude, with their positions.

    ``mode="exact"`` sends ``torch.topk``'s elements (:func:`topk_abs`: a prefilter, then
    ``torch.topk`` over the candidates). ``mode="sampled"`` is DGC's estimate
    (Lin et al. 2018): the threshold is the top-``ratio`` quantile of ``|x|`` on a
    random sample of ``sample`` elements, aimed 25% below the k-th value; elements
    above it are selected and trimmed to the exact top k among them. It sends at
    most k elements (fewer only when the sample overestimates the threshold) and
    costs one pass over the tensor plus top-k over the sample and the survivors.
    ``mode="auto"`` is exact below ``sampled_above`` elements and sampled from there.
    ``mode="approx"`` skips the exact trim: it sends between ``0.9 k`` and ``1.1 k``
    large elements (``gradzip.kernels.approx_band``; not exactly the largest), chosen by
    the sample's threshold and, when too many survive it, a second threshold placed on
    4096 of the survivors (``gradzip.kernels.sampled_topk(approx=True)``); ties or a
    sample that overestimated the threshold fall back to an exact top-k. Tensors of at
    most ``sample`` elements take the exact route in every mode.

    Wire, ``mode="exact"`` and ``scope="tensor"`` (``fixed_frames``): ``FMT_SPARSE_EF``
    (the positions in Elias-Fano code, :func:`pack_ef`: ``floor(log2(n / k))`` low bits
    each and a bitmap of about ``2k`` bits, a length set by ``n`` and ``k`` alone, then the
    values), or ``FMT_SPARSE_MASK`` (a bit per element, then the values) where that is
    smaller, or ``FMT_DENSE`` (the input as is) when no sparse form is; values travel in
    the gradient's dtype or ``values``', saturating. Other modes and ``scope="call"`` (whose
    counts vary): ``FMT_SPARSE`` (the gaps between the ascending positions, bit-packed at
    the width of the largest: about ``log2(n / k)`` bits each, then the values) in place of
    ``FMT_SPARSE_EF``, with values in the gradient's dtype (or the input's, when a
    compensated value would overflow the gradient's), or in ``values="fp16"``/``"bf16"``:
    finite values saturate, and error feedback keeps what the rounding drops.

    ``values="sign"`` is Sattler et al.'s sparse ternary compression (STC, 2019): every
    kept value is sent as ``+-mu``, ``mu`` the mean magnitude of the kept values (one
    float32 per frame), so a position costs its gap and one sign bit
    (``FMT_SPARSE_SIGN``), or 2 bits per element where that is smaller
    (``FMT_SPARSE_SIGN2``); error feedback keeps each kept value's ``v - sign(v) * mu``.
    On the bench's MNIST CNN at 4 ranks, 0.3% of positions cost 307x against 0.1% at 300x with float32 values.

    ``scope="call"`` chooses the ``ceil(ratio * n)`` largest magnitudes over all tensors of
    a call (a DDP bucket) together, ``n`` the call's elements: a layer with larger
    compensated values gets more of the budget, one with small ones may send nothing
    (:meth:`allot`). Only ``AllGather`` carries it (``as_protocol`` picks it; TwoPhase
    refuses: its owners would re-select per piece). With ``values="sign"``, ``mu`` is
    still per tensor.

    Args:
        ratio: the fraction of elements sent, in (0, 1], or a warm-up schedule
            (:mod:`gradzip.warmup`).
        mode: ``"exact"``, ``"sampled"``, ``"auto"`` or ``"approx"`` (above).
        sample: elements sampled by ``"sampled"``, an integer >= 1.
        sampled_above: ``"auto"`` samples tensors of at least this many elements.
        seed: the sampling seed.
        values: ``None`` (the gradient's dtype), ``"fp16"``, ``"bf16"`` or ``"sign"``
            (``+-mu``, above).
        scope: ``"tensor"`` (each tensor keeps ``ceil(ratio * n)`` of its own) or ``"call"``
            (the call's tensors share one top-k, above).
    """

    formats = {
        "SPARSE": FMT_SPARSE,
        "SPARSE_MASK": FMT_SPARSE_MASK,
        "SPARSE_SIGN": FMT_SPARSE_SIGN,
        "SPARSE_SIGN2": FMT_SPARSE_SIGN2,
        "SPARSE_EF": FMT_SPARSE_EF,
    }
    sparse = True

    def __init__(
        self,
        ratio: float = 0.01,
        *,
        mode: str = "exact",
        sample: int = 65536,
        sampled_above: int = 1 << 20,
        seed: int = 0,
        values: str | None = None,
        scope: str = "tensor",
    ) -> None:
        self.ratio = warmup.check(args.ratio, "ratio", ratio)
        self.mode = args.choice("mode", mode, ("exact", "sampled", "auto", "approx"))
        self.sample = args.integer("sample", sample, 1)
        self.sampled_above = args.integer("sampled_above", sampled_above, 1)
        self.seed = args.integer("seed", seed)
        self.values = None if values is None else args.choice("values", values, _VALUES)
        self.scope = args.choice("scope", scope, _SCOPES)

    @property
    def fixed_frames(self) -> bool:  # type: ignore[override]
        """Every frame's length follows from its tensor's shape (and the step's ratio): exactly
        ``k`` positions per tensor (``mode="exact"``, ``scope="tensor"``), their Elias-Fano code
        (whose length depends on ``n`` and ``k`` alone) or the mask, and values of one dtype.
        Protocols then skip the size exchange (one round for AllGather, two for TwoPhase)."""
        return self.mode == "exact" and self.scope == "tensor" and self.values != "sign"

    @property
    def plans_frames(self) -> bool:  # type: ignore[override]
        return self.fixed_frames and not isinstance(self.ratio, warmup.Ramp)

    def planned_entry(self, n: int, dtype: torch.dtype | None = None) -> tuple[int, torch.dtype, int, float] | None:
        """The Elias-Fano frame :meth:`compress` writes for ``n`` float32 elements at a fixed
        ratio (its length depends on ``n`` and ``k`` alone); None where it would write a mask,
        a dense or an empty frame, for a warm-up schedule, and for other dtypes."""
        if not self.plans_frames or dtype != torch.float32 or not n:
            return None
        k = _k_of(self.ratio, n)
        vdtype = _VALUE_DTYPES[self.values] if self.values is not None else torch.float32
        vsize, dense, ef = itemsize(vdtype), 4 * n, ef_nbytes(n, k)
        if k * vsize >= dense or (n + 7) // 8 < ef or ef + k * vsize >= dense:
            return None
        return FMT_SPARSE_EF, vdtype, ef + k * vsize, 0.0

    def planned_status(self, whole: torch.Tensor, frames) -> torch.Tensor:
        """Nothing before the frames are parsed: :meth:`planned_parse` checks their positions."""
        return torch.zeros((), dtype=torch.bool, device=whole.device)

    def planned_parse(self, payloads) -> torch.Tensor | None:
        """A planned round's Elias-Fano frames parsed on the device, a layout's rows at once
        (:func:`~gradzip.codecs.positions._unpack_ef_rows`: the count, ascending positions in
        range, clean padding), their positions and values kept for the decode; the flag set
        where a frame holds what no encoder writes."""
        groups: dict = {}
        for p in payloads:
            groups.setdefault((p.numel, p.body.numel(), p.vdtype), []).append(p)
        bads = []
        for (n, _, vdtype), ps in groups.items():
            bodies = [p.body for p in ps]
            rows = row_view(bodies) if len(bodies) > 1 else bodies[0].view(1, -1)
            if rows is None:
                rows = torch.stack(bodies)
            k = _k_of(self.ratio, n)
            low = ef_low_bits(n, k)
            upper = k + ((n - 1) >> low) + 1
            plan = (k, len(_leb128(k)), low, upper, (k * low + 7) // 8, (upper + 7) // 8)
            got, good = _unpack_ef_rows(rows, n, plan, vdtype, read=False)
            for p, (idx, r) in zip(ps, got):
                p.parsed = (idx, r if r.dtype == p.vdtype else from_bytes(r, p.vdtype))
            bads.append(~good)
        if not bads:
            return None
        return bads[0] if len(bads) == 1 else torch.stack(bads).any()

    def allot(self, xs, ctxs) -> list:
        """``scope="call"``: each tensor's share of one top-k over the call (:func:`call_counts`)."""
        return call_counts(xs, warmup.at(self.ratio, ctxs[0].step if ctxs else 0))

    def _sampled(self, n: int) -> bool:
        """Whether a tensor of ``n`` elements takes the sampled route (else ``torch.topk``'s)."""
        sampled = self.mode in ("sampled", "approx") or (self.mode == "auto" and n >= self.sampled_above)
        return sampled and n > self.sample

    def select(self, v: torch.Tensor, k: int, ctx: TensorContext) -> torch.Tensor:
        """Indices (int64, ascending) of the elements to send."""
        n = v.numel()
        if not self._sampled(n):
            return topk_abs(v, k)[0].sort().values
        g = torch.Generator(device="cpu").manual_seed(tensor_seed(self.seed, ctx.step, ctx.name))
        probe = torch.randint(n, (self.sample,), generator=g).to(v.device)
        # Aim 25% above k, then trim the survivors to exactly k: the estimate's
        # spread then rarely leaves fewer than k (DGC's hierarchical selection).
        # The compaction pass is dispatched (a one-pass kernel on the GPU).
        return K.sampled_topk(v, k, probe, approx=self.mode == "approx")

    def _count(self, ctx: TensorContext, n: int) -> int:
        """How many of a tensor's ``n`` elements :meth:`compress` sends: the call's allotment
        (``ctx.k``) or the ratio's share at the context's step."""
        return _k_of(warmup.at(self.ratio, ctx.step), n) if ctx.k is None else min(n, max(0, int(ctx.k)))

    def _value_dtype(self, ctx: TensorContext, dtype: torch.dtype) -> torch.dtype:
        """The dtype :meth:`compress` sends the values of an input of ``dtype`` in (``values=``,
        else the gradient's where it is a float, else the input's)."""
        if self.values is not None:
            return _VALUE_DTYPES[self.values]
        return ctx.dtype if ctx.dtype.is_floating_point else dtype

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        ctx = ctx or TensorContext(dtype=x.dtype)
        v = x.reshape(-1)
        n = v.numel()
        if n == 0:
            return _empty(x)
        k = self._count(ctx, n)
        if k == 0:
            return _empty(x)
        if self.values == "sign":
            return self._ternary(v, x, k, ctx)
        vdtype = self._value_dtype(ctx, x.dtype)
        vsize = itemsize(vdtype)
        if k * vsize >= n * v.element_size():  # the values alone are no smaller than the input
            return Payload(body=as_bytes(v), shape=x.shape, dtype=x.dtype, fmt=FMT_DENSE, vdtype=v.dtype)
        idx = self.select(v, k, ctx)
        vals = v[idx]
        fixed = self.fixed_frames
        if self.values is not None or (fixed and vdtype != v.dtype):
            # fixed frames: a compensated value beyond the gradient's dtype saturates too (error
            # feedback keeps the rest), so that every frame of the tensor has one length
            sent = saturating_cast(vals, vdtype)
        else:
            sent = vals.to(vdtype)
            if vdtype != v.dtype and bool((sent.isinf() & vals.isfinite()).any()):
                # A compensated value outgrew the gradient's dtype: send this frame in the input's.
                vdtype, sent = v.dtype, vals
        fmt, positions = (FMT_SPARSE_EF, pack_ef(idx, n)) if fixed else (FMT_SPARSE, pack_gaps(idx))
        if (n + 7) // 8 < positions.numel():  # a bit per element is smaller
            mask = torch.zeros(n, dtype=torch.int64, device=v.device)
            mask[idx] = 1
            fmt, positions = FMT_SPARSE_MASK, K.pack_uint(mask, 1)
        body = torch.cat([positions, as_bytes(sent)])
        if body.numel() >= n * v.element_size():
            return Payload(body=as_bytes(v), shape=x.shape, dtype=x.dtype, fmt=FMT_DENSE, vdtype=v.dtype)
        # what the decoder parses from this body, kept for subtract() and sent_mask()
        return Payload(body=body, shape=x.shape, dtype=x.dtype, fmt=fmt, vdtype=vdtype, parsed=(idx, sent))

    def encode_pieces(self, x, bounds, ctxs, residual=None, *, feedback=False, out=None):
        """Pieces of one length, one ``k`` and one value dtype whose frames are Elias-Fano ones
        (TwoPhase's owner pieces) as the rows of one 2-D tensor: one ``torch.topk`` over the
        rows, one sort, one Elias-Fano packing (:func:`_pack_ef_rows`) and one residual update,
        instead of about 35 operations a piece (and, on a GPU from 65,536 elements, two host
        syncs a piece). TwoPhase cuts ``n`` elements among ``W`` owners at ``j * n // W``, so
        its pieces have two lengths where ``W`` does not divide ``n``: each length is a group
        of rows, a view where its pieces lie back to back, else gathered by one index (and its
        residuals scattered back by one). Where :func:`_rows_topk` allows it: on the CPU only
        where :meth:`encode` itself runs ``torch.topk`` over the whole piece, so the frames and
        residuals are those of :meth:`encode` piece by piece, bit for bit; on a GPU
        ``torch.topk`` over the piece replaces the prefilter's, so where magnitudes tie at the
        ``k``-th place other elements of that magnitude may be sent. Other pieces (a group of
        one, a mask or dense frame, an empty piece): one by one, in place."""
        groups = self._rows_groups(x, bounds, ctxs, feedback)
        if not groups:
            return super().encode_pieces(x, bounds, ctxs, residual, feedback=feedback, out=out)
        bounds = [int(b) for b in bounds]
        lo, hi = bounds[0], bounds[-1]
        if feedback:
            v = compensate(x[lo:hi], None if residual is None else residual[lo:hi], out[lo:hi])
        else:
            v = x[lo:hi]
        payloads: list = [None] * (len(bounds) - 1)
        for js, n, k, vdtype in groups:
            for j, p in zip(js, self._encode_rows(v, [bounds[j] - lo for j in js], n, k, vdtype, feedback)):
                payloads[j] = p
        for j, p in enumerate(payloads):
            if p is None:  # compensated already (with feedback): encoded in place
                piece = v[bounds[j] - lo : bounds[j + 1] - lo]
                payloads[j] = (
                    self.encode(piece, ctxs[j], feedback=True, out=piece)[0]
                    if feedback
                    else self.encode(piece, ctxs[j])[0]
                )
        return payloads

    def _encode_rows(self, v, starts: list, n: int, k: int, vdtype, feedback: bool) -> list:
        """The frames of the pieces ``v[s : s + n]`` (``s`` in ``starts``), each the top ``k`` as
        Elias-Fano positions and values of ``vdtype``; with ``feedback`` their residuals in ``v``."""
        rows = len(starts)
        where = None
        if all(s == starts[0] + i * n for i, s in enumerate(starts)):
            m = (v if starts[0] == 0 and rows * n == v.numel() else v[starts[0] : starts[0] + rows * n]).view(rows, n)
        else:
            at = K.host_to_device(torch.tensor(starts, dtype=torch.int64), v.device)
            where = at[:, None] + torch.arange(n, device=v.device)
            m = v[where]
        idx = torch.topk(m.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
        vals = m.gather(1, idx)
        sent = saturating_cast(vals, vdtype) if self.values is not None or vdtype != m.dtype else vals
        body = torch.cat([_pack_ef_rows(idx, n), sent.contiguous().view(torch.uint8)], dim=1)
        if feedback:
            kept = vals - sent.to(m.dtype)
            if where is None:
                m.scatter_(1, idx, kept)
            else:  # distinct positions: one scatter of every row's
                v.scatter_(0, where.gather(1, idx).view(-1), kept.view(-1))
        payloads = []
        for b, i, s in zip(body.unbind(0), idx.unbind(0), sent.unbind(0)):  # the rows, by three operations
            p = Payload(
                body=b,
                shape=torch.Size([n]),
                dtype=m.dtype,
                fmt=FMT_SPARSE_EF,
                vdtype=vdtype,
                parsed=(i, s),
            )
            p.checked = feedback  # as encode marks what it subtracted
            payloads.append(p)
        return payloads

    def _rows_groups(self, x, bounds, ctxs, feedback: bool) -> list:
        """``[(piece indices, elements a piece, k, value dtype)]``: the groups of at least two
        pieces of one length, one ``k`` and one value dtype that :meth:`encode_pieces` encodes
        as rows, with fixed frames that :meth:`compress` would write as Elias-Fano (not the
        mask, not dense), on a device and size :func:`_rows_topk` allows; empty where none."""
        bounds = [int(b) for b in bounds]
        if not self.fixed_frames or len(bounds) < 3 or x.dim() != 1 or not x.is_contiguous():
            return []
        vtype = accum_dtype(x.dtype) if feedback else x.dtype  # what compress() sees
        found: dict = {}
        for j, (a, b, c) in enumerate(zip(bounds, bounds[1:], ctxs)):
            n = b - a
            if n <= 0:
                continue
            found.setdefault((n, self._count(c, n), self._value_dtype(c, vtype)), []).append(j)
        groups = []
        for (n, k, vdtype), js in found.items():
            vsize, dense = itemsize(vdtype), n * vtype.itemsize
            ef = ef_nbytes(n, k)
            if len(js) < 2 or not k or k * vsize >= dense or (n + 7) // 8 < ef or ef + k * vsize >= dense:
                continue
            if _rows_topk(x.device, n, k):
                groups.append((js, n, k, vdtype))
        return groups

    def _ternary(self, v: torch.Tensor, x: torch.Tensor, k: int, ctx: TensorContext) -> Payload:
        """``values="sign"``: the top ``k`` positions of ``v``, each sent as ``+-mu``."""
        n = v.numel()
        idx = self.select(v, k, ctx)
        vals = v[idx]
        nonzero = vals != 0
        if not bool(nonzero.all()):  # fewer than k nonzero elements: a zero is not sent as +mu
            idx, vals = idx[nonzero], vals[nonzero]
        if not idx.numel():
            return _empty(x)
        amax = float(vals.abs().max())
        if math.isfinite(amax) and amax > _F32_MAX:
            raise ValueError(
                f"TopK(values='sign') frames carry mu as float32; a float64 value of magnitude {amax:.3g} "
                "is beyond float32's range: scale the gradient, or send the values (values=None)"
            )
        mean = float(vals.abs().double().mean())
        mu = float(torch.tensor(mean, dtype=torch.float32))  # the frame's float32 scale
        if not mu > 0.0 or not math.isfinite(mu):
            # Not finite: the engine's non-finite check sees the input. Zero: float64 values below
            # float32's smallest; nothing is sent and error feedback keeps them.
            return _empty(x)
        neg = vals < 0
        bitmap = (n + 3) // 4
        parsed = (idx, torch.full(idx.shape, mu, dtype=torch.float32, device=idx.device).masked_fill_(neg, -mu))
        if idx.numel() < bitmap:
            body = pack_gaps(idx, neg, extra_bits=1)
            if body.numel() < bitmap:
                return Payload(body=body, shape=x.shape, dtype=x.dtype, fmt=FMT_SPARSE_SIGN, scale=mu, parsed=parsed)
        codes = torch.zeros(n, dtype=torch.int64, device=v.device)
        codes[idx] = torch.where(neg, 2, 1)
        return Payload(
            body=K.pack_uint(codes, 2),
            shape=x.shape,
            dtype=x.dtype,
            fmt=FMT_SPARSE_SIGN2,
            scale=mu,
            parsed=parsed,
        )

    # -- decode ------------------------------------------------------------------------
    def _formats(self, n: int) -> tuple:
        """The formats this TopK writes for a tensor of ``n`` elements."""
        if n == 0:
            return (FMT_EMPTY,)
        if self.values == "sign":
            return (FMT_EMPTY, FMT_SPARSE_SIGN, FMT_SPARSE_SIGN2)
        # EMPTY also where a call-wide top-k allotted the tensor nothing
        empty = (FMT_EMPTY,) if self.scope == "call" else ()
        return (*empty, FMT_DENSE, FMT_SPARSE_EF if self.fixed_frames else FMT_SPARSE, FMT_SPARSE_MASK)

    def _value_dtypes(self, payload: Payload) -> tuple:
        """The dtypes a sparse frame's values may travel in: ``values``', else the gradient's
        or (where a compensated value outgrew it) the input's, ``payload.dtype``."""
        if self.values is not None:
            return (_VALUE_DTYPES[self.values],)
        if payload.grad_dtype is not None:
            if self.fixed_frames:  # they saturate instead (one length per tensor)
                return (payload.grad_dtype,)
            return tuple(dict.fromkeys((payload.grad_dtype, payload.dtype)))
        # A frame not from a protocol: the gradient's dtype is unknown, but no wider than the
        # input's (error feedback widens, never narrows), and a half-precision input's is its own.
        return _NARROWER.get(payload.dtype, (torch.float32, torch.float16, torch.bfloat16, torch.float64))

    def _frame_k(self, payload: Payload) -> int | None:
        """``k`` of the payload's tensor at its step, or None where the count is not the codec's
        own (``scope="call"``: the call allots it) or not known (a warm-up schedule's ratio at an
        unknown step)."""
        if self.scope == "call" or (isinstance(self.ratio, warmup.Ramp) and payload.step is None):
            return None
        return _k_of(warmup.at(self.ratio, payload.step or 0), payload.numel)

    def _count_band(self, payload: Payload, k: int | None) -> tuple[int, int]:
        """``(fewest, most)`` positions this configuration sends in a sparse frame of the
        payload's tensor, ``k`` its :meth:`_frame_k`: exact top-k ``k``; sampled 1 to ``k``;
        approximate :func:`~gradzip.kernels.approx_band`; ``values="sign"`` drops zeros (1 at
        least, a tensor that sends none being EMPTY). Where ``k`` is not known, 1 to ``n``."""
        if k is None:
            return 1, payload.numel
        if not self._sampled(payload.numel):
            lo, hi = k, k
        elif self.mode == "approx":
            lo, hi = K.approx_band(k)
        else:
            lo, hi = 1, k
        return (1 if self.values == "sign" else lo), hi

    def _check_count(self, payload: Payload, count: int) -> None:
        """A sparse frame's count of positions against :meth:`_count_band`."""
        lo, hi = band = self._count_band(payload, self._frame_k(payload))
        if not _within(count, band):
            want = f"{lo}" if lo == hi else f"{lo} to {hi}"
            raise FrameError(
                "body.count",
                f"{count} positions in a {fmt_name(payload.fmt)} frame, where {self!r} sends {want} "
                f"of {payload.numel} elements",
            )

    def _check_dense(self, payload: Payload) -> None:
        """DENSE only where the encoder could write it: where ``k`` values alone are no smaller
        than the tensor, or where the longest sparse frame of this configuration would not be
        (fixed frames: ``k`` positions in Elias-Fano code or a mask; other modes: up to the
        band's most positions, gaps of at most the tensor's width, or a mask; values in the
        widest dtype they may travel in)."""
        k = self._frame_k(payload)
        if k is None or self.values == "sign":  # (the sign formats have no DENSE)
            return
        n = payload.numel
        dense = n * payload.dtype.itemsize
        if self.values is not None:
            vsize = vmax = itemsize(_VALUE_DTYPES[self.values])
        else:  # the gradient's dtype where known; values never wider than the input
            known = payload.grad_dtype is not None and payload.grad_dtype.is_floating_point
            vsize = itemsize(payload.grad_dtype) if known else payload.dtype.itemsize
            vmax = vsize if self.fixed_frames else payload.dtype.itemsize
        if k * vsize >= dense:
            return
        hi = self._count_band(payload, k)[1]
        if self.fixed_frames:
            positions = ef_nbytes(n, k)
        else:
            positions = 1 + len(_leb128(hi)) + (hi * max(1, (n - 1).bit_length()) + 7) // 8
        sparse = min(positions, (n + 7) // 8) + hi * vmax
        if sparse < dense:
            raise FrameError(
                "format",
                f"a DENSE frame of {dense} bytes, where {self!r} sends {k} of {n} elements in at most {sparse}",
            )

    def check_frames(self, payloads) -> None:
        """:meth:`check_frame` on a message's frames (or a round's), the Elias-Fano frames'
        positions checked together (:func:`unpack_ef_many`: two host syncs instead of about
        three a frame). Where any check refuses, the frames are checked one by one, so the
        refusal names the same frame as :meth:`check_frame` in order would."""
        payloads = list(payloads)
        ef, rest = [], []
        for p in payloads:
            (ef if p.fmt == FMT_SPARSE_EF and p.fmt in self._formats(p.numel) else rest).append(p)
        parsed = None
        if len(ef) > 1:
            try:
                for p in ef:
                    self._check_sparse_head(p)
            except FrameError:
                parsed = None
            else:
                vbs = [itemsize(p.vdtype) for p in ef]
                vdtypes = {p.vdtype for p in ef}
                one = vdtypes.pop() if len(vdtypes) == 1 else None  # values typed at once
                parsed = unpack_ef_many([p.body for p in ef], [p.numel for p in ef], vbs, one, [p.head for p in ef])
        # (a SPARSE_EF frame only where its positions take no more than a mask would)
        if parsed is not None and all(
            p.body.numel() - r.numel() * r.element_size() <= (p.numel + 7) // 8
            and _within(idx.numel(), self._count_band(p, self._frame_k(p)))
            for p, (idx, r) in zip(ef, parsed)
        ):
            try:
                for p in rest:
                    self.check_frame(p)
            except FrameError:
                pass  # named below, frame by frame
            else:
                for p, (idx, r) in zip(ef, parsed):
                    p.parsed = (idx, r if r.dtype == p.vdtype else from_bytes(r, p.vdtype))
                return
        super().check_frames(payloads)

    def _check_sparse_head(self, payload: Payload) -> None:
        """The entry checks of a SPARSE, SPARSE_EF or SPARSE_MASK frame (before its body)."""
        check_vdtype(self, payload, self._value_dtypes(payload))
        check_no_scale(self, payload)
        nbytes, dense = payload.body.numel(), payload.numel * payload.dtype.itemsize
        if nbytes >= dense:
            raise FrameError(
                "length", f"{nbytes} bytes of {fmt_name(payload.fmt)} for a tensor of {dense} (DENSE is smaller)"
            )

    def check_frame(self, payload: Payload) -> None:
        """The formats this configuration writes (``values="sign"``: EMPTY, SPARSE_SIGN,
        SPARSE_SIGN2; else DENSE, SPARSE, SPARSE_MASK, and EMPTY for a call-wide top-k or an
        empty tensor), each with its value dtype, its scale (``mu`` for the sign formats,
        else none), a body whose length follows from the shape and the positions, positions
        in range and coded as :func:`pack_gaps` codes them, no 2-bit code 3, and the form
        the encoder would have chosen (a sparse form only where it is smaller than the
        tensor, the mask only where it is smaller than the gaps, the gaps only where they are
        smaller than the 2-bit map). The positions parsed are kept for the decode."""
        n = payload.numel
        check_format(self, payload, self._formats(n))
        fmt = payload.fmt
        if fmt == FMT_EMPTY:
            check_empty(self, payload)
            return
        if fmt == FMT_DENSE:
            check_dense(self, payload, (payload.dtype,))
            self._check_dense(payload)
            return
        nbytes = payload.body.numel()
        if fmt in (FMT_SPARSE_SIGN, FMT_SPARSE_SIGN2):
            check_vdtype(self, payload, (torch.float32,))
            mu = check_scale(self, payload, "mu")
            bitmap = (n + 3) // 4
            if fmt == FMT_SPARSE_SIGN:
                idx, neg, _ = unpack_gaps(payload.body, n, 0, extra_bits=1)
                if not idx.numel():
                    raise FrameError("body.count", "a SPARSE_SIGN frame sends at least one position (else EMPTY)")
                if nbytes >= bitmap:
                    raise FrameError("length", f"{nbytes} bytes of SPARSE_SIGN, where the 2-bit map takes {bitmap}")
                neg = neg.bool()
            else:
                check_length(self, payload, bitmap)
                idx, neg = _signs2(payload.body, n)
            self._check_count(payload, idx.numel())
            vals = torch.full(idx.shape, mu, dtype=torch.float32, device=idx.device)
            payload.parsed = (idx, vals.masked_fill_(neg, -mu))
            return
        self._check_sparse_head(payload)
        vsize = itemsize(payload.vdtype)
        mlen = (n + 7) // 8
        if fmt in (FMT_SPARSE, FMT_SPARSE_EF):
            if fmt == FMT_SPARSE:
                idx, _, rest = unpack_gaps(payload.body, n, vsize)
            else:
                idx, rest = unpack_ef(payload.body, n, vsize)
            if nbytes - rest.numel() > mlen:
                raise FrameError(
                    "format",
                    f"{nbytes - rest.numel()} bytes of positions, where a SPARSE_MASK frame's mask takes {mlen}",
                )
        else:
            if nbytes < mlen or (nbytes - mlen) % vsize:
                raise FrameError("length", f"corrupt sparse frame: {nbytes} bytes for a mask of {n} positions")
            if n % 8 and int(payload.body[mlen - 1]) >> (n % 8):
                raise FrameError("body.padding", "corrupt sparse frame: mask bits set beyond the tensor")
            idx = K.unpack_uint(payload.body[:mlen], n, 1).nonzero().reshape(-1)
            if idx.numel() * vsize != nbytes - mlen:
                raise FrameError(
                    "length", f"corrupt sparse frame: {idx.numel()} positions for {nbytes - mlen} value bytes"
                )
            other = ef_nbytes(n, idx.numel()) if self.fixed_frames else gaps_nbytes(idx)
            if other <= mlen:
                raise FrameError("format", f"a mask of {mlen} bytes, where the positions' code takes {other}")
            rest = payload.body[mlen:]
        self._check_count(payload, idx.numel())
        payload.parsed = (idx, from_bytes(rest, payload.vdtype))

    def decompress(self, payload: Payload) -> torch.Tensor:
        out = self.zeros(payload)
        self.accumulate(payload, out.view(-1))
        return narrow(out, payload.dtype)

    def sent_mask(self, payload: Payload, n: int) -> torch.Tensor:
        mask = torch.zeros(n, dtype=torch.bool, device=payload.body.device)
        if payload.fmt == FMT_DENSE:
            mask[:] = True
        elif payload.fmt != FMT_EMPTY:
            mask[self._split(payload, n)[0]] = True
        return mask

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        """``v -= decompress(payload)``, touching only the sent elements."""
        if payload.fmt == FMT_EMPTY:
            return
        if payload.fmt == FMT_DENSE:
            v.sub_(from_bytes(payload.body, payload.vdtype).to(v.dtype).view(v.shape))
            return
        idx, vals = self._split(payload, v.numel())
        flat = v.view(-1)
        flat.index_put_((idx,), flat[idx] - vals.to(v.dtype))

    def accumulate_segments(self, payloads, out: torch.Tensor, starts) -> None:
        """TwoPhase's owners' pieces, disjoint segments of a flat ``out``: the sparse frames'
        positions, each offset by its segment's start, and their values added by one
        ``scatter_add_sparse`` where each frame took one. Every element receives at most one
        value either way, so the sums are :meth:`accumulate`'s frame by frame, bit for bit.
        Dense and empty frames go one by one; frames of several value dtypes all do."""
        payloads, starts = list(payloads), [int(st) for st in starts]
        for p, st in zip(payloads, starts):
            if st < 0 or st + p.numel > out.numel():
                raise ValueError(f"a frame of {p.numel} elements at {st} decoded into {out.numel()}")
            self.validated(p)
        sparse = [(p, st) for p, st in zip(payloads, starts) if p.fmt not in (FMT_EMPTY, FMT_DENSE)]
        if len(sparse) < 2 or len({p.vdtype for p, _ in sparse}) > 1 or out.dim() != 1:
            super().accumulate_segments(payloads, out, starts)
            return
        for p, st in zip(payloads, starts):
            if p.fmt == FMT_DENSE:
                self.accumulate(p, out[st : st + p.numel])
        parts = [(self._split(p, p.numel), st) for p, st in sparse]
        idx = torch.cat([i for (i, _), _ in parts]).add_(_shifts([(i.numel(), st) for (i, _), st in parts], out.device))
        K.scatter_add_sparse(out, idx, torch.cat([v for (_, v), _ in parts]))

    def accumulate_many(self, payloads, out: torch.Tensor) -> None:
        """Every peer's frame of one tensor, in order: the sparse frames' positions and values
        by one ``scatter_add_sparse_many`` (on CUDA one launch after a stable sort, where each
        frame took one), each element's values added in the peers' order, so the sums are
        :meth:`accumulate`'s frame by frame, bit for bit. With a dense frame among them, or
        values of several dtypes, frame by frame."""
        payloads = list(payloads)
        for p in payloads:
            if out.numel() != p.numel:
                raise ValueError(f"a frame of {p.numel} elements decoded into {out.numel()}")
            self.validated(p)
        sparse = [p for p in payloads if p.fmt != FMT_EMPTY]
        if len(sparse) < 2 or any(p.fmt == FMT_DENSE for p in sparse) or len({p.vdtype for p in sparse}) > 1:
            super().accumulate_many(payloads, out)
            return
        parts = [self._split(p, out.numel()) for p in sparse]
        K.scatter_add_sparse_many(out, [i for i, _ in parts], [v for _, v in parts])

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        if out.numel() != payload.numel:
            raise ValueError(f"a frame of {payload.numel} elements decoded into {out.numel()}")
        self.validated(payload)
        if payload.fmt == FMT_EMPTY:
            return
        if payload.fmt == FMT_DENSE:
            out.add_(from_bytes(payload.body, payload.vdtype).to(out.dtype))
            return
        K.scatter_add_sparse(out, *self._split(payload, out.numel()))

    def _split(self, payload: Payload, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 indices, values) of a sparse frame (parsed by :meth:`check_frame`)."""
        if payload.parsed is None:
            self.check_frame(payload)
        return payload.parsed
