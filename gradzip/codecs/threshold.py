"""Strom (2015) threshold sparsification, as in Deeplearning4j's gradient sharing.

Each element ``v`` of the compressed input with ``|v| >= tau`` is sent as
``sign(v) * tau``; everything else (and the ``|v| - tau`` left over by the sent
elements) stays in the error-feedback residual. On the wire (format 2, :mod:`gradzip.wire`):

* the positions as a list of gaps, bit-packed at the width the largest gap needs, each
  with the element's sign in one more bit (``FMT_SIGNED_INDEX``, built on
  :func:`gradzip.codecs.positions.pack_gaps`);
* or, when that list would be longer than a 2-bit-per-element bitmap
  (0 / +tau / -tau), the bitmap (``FMT_BITMAP2``). A frame is therefore never
  larger than ``ceil(n / 4)`` bytes plus its 10-byte frame entry (6 bytes, and 4 for
  tau) and a small list header;
* or an empty frame when nothing reaches tau. Nothing hangs: every rank still
  takes part in every collective.

**Each payload carries its own tau** (the f32 ``scale`` of its frame entry). Ranks may
therefore use different thresholds in the same step (the adaptive policy adapts
to each rank's own gradients) and every receiver decodes each peer with that
peer's tau.

**Exact residuals.** Before encoding, tau is rounded down to a multiple of the
float32 ulp of a bound on ``max|v|`` (at least one ulp). Then ``v - sign(v) * tau``
is exactly representable for every selected element, so ``residual + sent ==
input`` holds exactly and no mass is lost to rounding. The bound is the tensor's
``max|v|`` of its previous step (kept in its state), so that the encode is one
fused pass over gradient and residual (``kernels.threshold_ef``); the pass also
returns this step's ``max|v|``, and where tau is not a multiple of its ulp (the
first step, or a gradient that grew past the next power of two) the pass is run
again with it. For ordinary tensors (``max|v| < 2**16 * tau``) the rounding moves
tau by less than 2**-7 of itself. The ``"target"`` policy needs ``v`` whole (its
tau is a top-k of ``|v|``) and encodes in separate passes.

Policies (per tensor, state kept in the front end's ``state_dict``):

* ``"fixed"``: tau never changes.
* ``"adaptive"`` (DL4J's AdaptiveThresholdAlgorithm): after each step, if the
  fraction of elements sent was below ``band[0]`` tau is multiplied by
  ``decay`` (< 1); above ``band[1]`` it is multiplied by ``growth`` (> 1,
  default ``1 / decay``).
* ``"target"``: tau is set each step to the ``ceil(density * n)``-th largest
  ``|v|``, so about that many elements are sent (more on ties).

**Shake-up**: with ``shake_every = K > 0``, every K-th step of a tensor is
encoded with ``tau / shake_factor`` to flush residual mass that sits just under
the threshold. The policy does not adapt on shake-up steps.

**Momentum correction** zeroes a coordinate's momentum where the codec sent only with
``mask=True``: otherwise a coordinate over tau sends ``±tau`` and keeps the rest in its
residual, and zeroing its momentum would stall the coordinates that move most.
"""

from __future__ import annotations

import math

import torch

import gradzip.args as args
import gradzip.kernels as K
import gradzip.warmup as warmup

from ..wire import FMT_EMPTY, FrameError, Payload, accum_dtype, narrow
from .base import (
    Codec,
    TensorContext,
    check_empty,
    check_format,
    check_input,
    check_length,
    check_scale,
    check_vdtype,
)
from .positions import check_codes2, pack_gaps, unpack_gaps
from .topk import call_counts, topk_abs

__all__ = ["Threshold", "exact_tau"]

FMT_SIGNED_INDEX = 2  # body: packed gaps of the positions, each with a sign bit (sparse.pack_gaps); +-scale
FMT_BITMAP2 = 3  # body: 2 bits per element, 0 -> 0, 1 -> +scale, 2 -> -scale

_POLICIES = ("fixed", "adaptive", "target")
_MAX_INDEX = 2**31  # index list words hold 31 bits of index
_F32_MIN_SUBNORMAL = math.ldexp(1.0, -149)
_F32_MAX = 3.4028234663852886e38


def exact_tau(tau: float, amax: float) -> float:
    """Round ``tau`` down to a multiple of the float32 ulp of ``amax`` (at least one ulp).

    For every ``|v| <= amax`` with ``|v| >= result``, ``|v| - result`` is then an
    exactly representable float32 (and float64).
    """
    if not math.isfinite(amax) or amax <= 0.0:
        return tau
    _, e = math.frexp(amax)  # amax = m * 2**e, m in [0.5, 1)
    ulp = max(math.ldexp(1.0, e - 24), _F32_MIN_SUBNORMAL)
    return min(max(math.floor(tau / ulp), 1) * ulp, _F32_MAX)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Threshold(Codec):
    """Strom's threshold sparsification with DL4J's adaptive tau (details in the module docstring).

    Every element ``v`` of gradient plus residual with ``|v| >= tau`` is sent as
    ``sign(v) * tau``; the rest, and the ``|v| - tau`` that a sent element leaves, stays
    in the error-feedback residual. The bytes follow from how many elements reach tau.

    Args:
        tau: the threshold, a finite number in (0, inf), in the gradient's units (the
            ``"fixed"`` policy's threshold, the ``"adaptive"`` policy's start; unused by
            ``"target"``).
        policy: ``"fixed"`` (tau never changes), ``"adaptive"`` (DL4J: tau shrinks by
            ``decay`` while the fraction sent is below ``band[0]`` and grows by
            ``growth`` above ``band[1]``) or ``"target"`` (tau is the
            ``ceil(density * n)``-th largest ``|v|`` each step).
        band: ``(low, high)`` fractions of elements sent that ``"adaptive"`` aims
            between, ``0 <= low <= high <= 1``.
        decay: ``"adaptive"``'s factor for tau when too little is sent, in (0, 1).
        growth: ``"adaptive"``'s factor when too much is sent, > 1 (default ``1 / decay``).
        density: ``"target"``'s fraction of elements sent, in (0, 1], or a warm-up
            schedule (:mod:`gradzip.warmup`).
        shake_every: every this many steps of a tensor (0: never) encode with
            ``tau / shake_factor``, flushing mass that sits just under tau.
        shake_factor: the divisor of those steps, > 1.
        scope: ``"tensor"`` or, with ``policy="target"``, ``"call"``: tau is then the
            ``ceil(density * n)``-th largest ``|v|`` over all the call's tensors together
            (``n`` their elements; :func:`gradzip.codecs.topk.call_counts`), one threshold
            for a DDP bucket; only ``AllGather`` carries it.
        mask: with momentum correction, zero a coordinate's momentum when it is sent (DGC's
            factor masking; the ``|v| - tau`` it keeps stays in the residual). Off by default.

    Tuning. A fixed tau only works at the scale of the gradients it meets:
    ``Threshold(tau=1e-3)`` sends whatever reaches 1e-3, which is most of a unit-scale
    tensor and next to nothing of a small one. To pick one, look at a few steps'
    gradients: ``g.abs().flatten().topk(int(0.001 * g.numel())).values[-1]`` is the tau
    that sends about 0.1% of ``g``. ``policy="target"`` does that every step for every
    tensor, whatever the scale: start there (``density=0.001`` sends about 0.1%, plus
    the 4-byte scale and the positions). Measured with ``benchmarks/accuracy.py``
    (gradzip bench's MNIST CNN, 2 gloo ranks, 4 epochs, SGD lr 0.05, seed 0; 2-core AMD EPYC VM,
    torch 2.13.0+cpu): with SGD momentum 0.9, ``policy="target", density=0.001`` reached 84.7% at 964x
    fewer link bytes, ``tau=1e-3`` fixed 57.1% at 15.9x, and ``"adaptive"`` with
    ``band=(1e-4, 1e-3)`` 29.1% (Identity: 97.3%); with momentum 0.5 the adaptive
    policy reached 93.0% at 34x (Identity: 95.7%). On 4 ranks (CNN, 16 epochs,
    momentum 0.9) the adaptive policy fell to chance on every seed. Threshold is
    momentum-masked only with ``mask=True``. What trains at momentum 0.9 there is one
    threshold for the whole bucket with masked momentum correction and local clipping:
    ``Threshold(policy="target", density=0.0029, scope="call", mask=True)`` with
    ``register_hook(..., optimizer=sgd, clip=2.0)`` moves 305x fewer link bytes at -0.36 pp
    against Identity (4 ranks, 16 epochs, mean of 8 seeds; docs/results.md,
    ``accuracy_mnist_4ranks_sgd_clip2_8seeds_cpu.json``).
    """

    formats = {"SIGNED_INDEX": FMT_SIGNED_INDEX, "BITMAP2": FMT_BITMAP2}

    # Not ``sparse`` in the momentum-masking sense unless ``mask=True``: a coordinate over tau
    # sends +-tau and keeps the rest in its residual. Masking cost digits 3 pp per tensor (the
    # MLP, 2 ranks); with one threshold over the bucket at momentum 0.9 it is what trains.
    @property
    def sparse(self) -> bool:  # type: ignore[override]
        """Momentum correction zeroes the momentum where this codec sent only with ``mask=True``."""
        return self.mask

    def __init__(
        self,
        tau: float = 1e-3,
        policy: str = "fixed",
        *,
        band: tuple[float, float] = (1e-4, 1e-2),
        decay: float = 0.965936,
        growth: float | None = None,
        density: float = 1e-3,
        shake_every: int = 0,
        shake_factor: float = 4.0,
        scope: str = "tensor",
        mask: bool = False,
    ) -> None:
        self.tau = args.number("tau", tau, 0.0, lo_open=True)
        self.policy = args.choice("policy", policy, _POLICIES)
        if not isinstance(band, (tuple, list)) or len(band) != 2:
            raise ValueError(f"band must be (low, high) with 0 <= low < high <= 1, got {band!r}")
        low, high = (args.number("band", b, 0.0, 1.0) for b in band)
        if not low < high:
            raise ValueError(f"band must be (low, high) with 0 <= low < high <= 1, got {band!r}")
        self.band = (low, high)
        self.decay = args.number("decay", decay, 0.0, 1.0, lo_open=True, hi_open=True)
        self.growth = args.optional(args.number, "growth", growth, 1.0, lo_open=True)
        self.density = warmup.check(args.ratio, "density", density)
        self.shake_every = args.integer("shake_every", shake_every, 0)
        self.shake_factor = args.number("shake_factor", shake_factor, 1.0, lo_open=True)
        self.scope = args.choice("scope", scope, ("tensor", "call"))
        if not isinstance(mask, bool):
            raise ValueError(f"mask must be True or False, got {mask!r}")
        self.mask = mask
        if self.scope == "call" and self.policy != "target":
            raise ValueError(
                f'scope="call" needs policy="target" (one threshold from the whole call), got policy={policy!r}'
            )

    def allot(self, xs, ctxs) -> list:
        """``scope="call"``: each tensor's share of the call's ``ceil(density * n)`` largest ``|v|``."""
        return call_counts(xs, warmup.at(self.density, ctxs[0].step if ctxs else 0))

    # -- encode ------------------------------------------------------------------------
    def current_tau(self, ctx: TensorContext) -> float:
        """The policy's tau for this tensor before this step's encode."""
        return float(ctx.store.get("tau", self.tau))

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        return self.encode(x, ctx)[0]

    def encode(self, x, ctx=None, residual=None, *, feedback=False, out=None):
        check_input(x)
        ctx = ctx or TensorContext(dtype=x.dtype)
        if residual is not None and not feedback:
            raise ValueError("a residual without feedback=True would be dropped")
        n = x.numel()
        shake = self.shake_every > 0 and (ctx.step + 1) % self.shake_every == 0
        if self.policy == "target" and n:
            if feedback:  # tau is a top-k of |v|: v is needed whole (Codec.encode compensates)
                return super().encode(x, ctx, residual, feedback=True, out=out)
            k = (
                min(n, max(1, math.ceil(warmup.at(self.density, ctx.step) * n)))
                if ctx.k is None
                else min(n, int(ctx.k))
            )
            if k <= 0:  # scope="call" allotted this tensor nothing
                empty = torch.empty(0, dtype=torch.uint8, device=x.device)
                return Payload(
                    body=empty, shape=x.shape, dtype=x.dtype, fmt=FMT_EMPTY, scale=self.current_tau(ctx)
                ), None
            kth = float(topk_abs(x, k)[1].min())
            base = kth if kth > 0 else self.current_tau(ctx)
        else:
            base = self.current_tau(ctx)
        if shake:
            base = base / self.shake_factor
        # Float16/bfloat16 go to the kernel as they are (it widens them as it loads).
        v = x.reshape(-1) if x.dtype in K.KERNEL_DTYPES or x.dtype == torch.float64 else x.reshape(-1).float()
        r = residual.reshape(-1) if residual is not None else None
        o = out.reshape(-1) if out is not None else None
        tau = exact_tau(base, float(ctx.store.get("amax", 0.0)))
        if o is not None and (_aliases(o, v) or (r is not None and _aliases(o, r))):
            # In place: a second pass would read what the first wrote. Take max|v| first.
            amax = float((v if r is None else v.to(o.dtype) + r).abs().max()) if n else 0.0
            if n and exact_tau(tau, amax) != tau:
                tau = exact_tau(base, amax)
        sel = K.threshold_ef(v, tau, r, new_residual=feedback, out=o)
        if sel.amax > _F32_MAX and math.isfinite(sel.amax):
            raise ValueError(
                f"Threshold frames carry tau as float32; a float64 value of magnitude {sel.amax:.3g} is beyond "
                "float32's range and cannot be sent exactly: scale the gradient, or use another codec (TopK sends it)"
            )
        if n and exact_tau(tau, sel.amax) != tau:  # the bound was too small: encode again with this max
            tau = exact_tau(base, sel.amax)
            sel = K.threshold_ef(v, tau, r, new_residual=feedback, out=o)
        if n and math.isfinite(sel.amax):
            ctx.store["amax"] = sel.amax
        self._adapt(ctx, sel.count, n, tau, shake)
        new = sel.residual.view(x.shape) if feedback else None
        return self._frame(x, sel, tau), new

    def _adapt(self, ctx: TensorContext, count: int, n: int, tau: float, shake: bool) -> None:
        if self.policy == "adaptive" and not shake and n:
            frac = count / n
            t = self.current_tau(ctx)
            if frac < self.band[0]:
                t *= self.decay
            elif frac > self.band[1]:
                t *= self.growth if self.growth is not None else 1.0 / self.decay
            ctx.store["tau"] = min(max(t, _F32_MIN_SUBNORMAL), _F32_MAX)
        elif self.policy == "target":
            ctx.store["tau"] = tau

    @staticmethod
    def _frame(x: torch.Tensor, sel, tau: float) -> Payload:
        n, count = x.numel(), sel.count
        dtype = accum_dtype(x.dtype) if sel.residual is not None else x.dtype
        if count == 0:
            empty = torch.empty(0, dtype=torch.uint8, device=x.device)
            return Payload(body=empty, shape=x.shape, dtype=dtype, fmt=FMT_EMPTY, scale=tau)
        bitmap = (n + 3) // 4
        # Packed gaps take at least one byte a position (with the sign bit, for gaps that fit
        # 7 bits); only where that can beat the bitmap is the index list built at all.
        if n < _MAX_INDEX and count < bitmap:
            idx, neg = K.decode_signed_indices(sel.indices())
            body = pack_gaps(idx, neg, extra_bits=1)
            if body.numel() < bitmap:
                # Built here, so checked: the positions kept as check_frame parses them, and the
                # local decode (error feedback's subtract) does not unpack the gaps again.
                p = Payload(body=body, shape=x.shape, dtype=dtype, fmt=FMT_SIGNED_INDEX, scale=tau)
                p.parsed, p.checked = (idx, neg, tau), True
                return p
        return Payload(body=sel.bitmap(), shape=x.shape, dtype=dtype, fmt=FMT_BITMAP2, scale=tau)

    # -- decode ------------------------------------------------------------------------
    def check_frame(self, payload: Payload) -> None:
        """EMPTY, SIGNED_INDEX or BITMAP2, each with tau (the scale: > 0 and finite in
        float32) and value dtype code 0; an empty body for EMPTY; for SIGNED_INDEX the gaps
        as :func:`~gradzip.codecs.positions.pack_gaps` codes them, at least one position, and
        shorter than the 2-bit map (else the encoder sends the map), on a tensor of fewer
        than 2**31 elements; for BITMAP2 ``ceil(n / 4)`` bytes, codes 0, 1, 2 only, at least
        one set, none after the ``n``-th. The positions parsed are kept for the decode."""
        n = payload.numel
        check_format(self, payload, (FMT_EMPTY, FMT_SIGNED_INDEX, FMT_BITMAP2))
        if payload.fmt == FMT_EMPTY:
            check_empty(self, payload, scale="tau")
            return
        check_vdtype(self, payload, (torch.float32,))
        tau = check_scale(self, payload, "tau")
        bitmap = (n + 3) // 4
        if payload.fmt == FMT_BITMAP2:
            check_length(self, payload, bitmap)
            check_codes2(payload.body, n)
            return
        if n >= _MAX_INDEX:
            raise FrameError("format", f"SIGNED_INDEX frame for a tensor of {n} >= 2**31 elements (always BITMAP2)")
        idx, neg, _ = unpack_gaps(payload.body, n, 0, extra_bits=1)
        if not idx.numel():
            raise FrameError("body.count", "a SIGNED_INDEX frame sends at least one position (else EMPTY)")
        if payload.body.numel() >= bitmap:
            raise FrameError(
                "length", f"{payload.body.numel()} bytes of SIGNED_INDEX, where the 2-bit map takes {bitmap}"
            )
        payload.parsed = (idx, neg.bool(), tau)

    def decompress(self, payload: Payload) -> torch.Tensor:
        out = self.zeros(payload)
        self.accumulate(payload, out.view(-1))
        return narrow(out, payload.dtype)

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        if out.numel() != payload.numel:
            raise ValueError(f"a frame of {payload.numel} elements decoded into {out.numel()}")
        self.validated(payload)
        self._add(payload, out, payload.scale)

    def _add(self, payload: Payload, out: torch.Tensor, tau: float) -> None:
        """``out += decode(payload)`` with ``tau`` for the frame's (checked) scale."""
        if payload.fmt == FMT_EMPTY:
            return
        if payload.fmt == FMT_SIGNED_INDEX:
            if payload.parsed is None:
                self.check_frame(payload)
            idx, neg, _ = payload.parsed
            vals = torch.full(idx.shape, tau, dtype=out.dtype, device=out.device)
            vals[neg] = -tau
            K.scatter_add_sparse(out, idx, vals)
            return
        K.decode_add_bitmap2(out, [payload.body], [tau])

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        """``v -= decompress(payload)`` with no dense tensor in between: ``v`` accumulates the
        frame with ``-tau`` (``v + -tau`` is ``v - tau`` exactly). Where ``v``'s dtype is not the
        payload's float32 or float64 (the decoded values would first round), the dense way."""
        if v.numel() != payload.numel:
            raise ValueError(f"a frame of {payload.numel} elements subtracted from {v.numel()}")
        if v.dtype != payload.dtype or v.dtype not in (torch.float32, torch.float64) or not v.is_contiguous():
            return super().subtract(payload, v)
        self.validated(payload)
        self._add(payload, v.view(-1), -payload.scale)

    def accumulate_many(self, payloads, out: torch.Tensor) -> None:
        """``accumulate`` each payload in order (one tensor, N peers).

        Runs of bitmap frames decode in one pass over ``out`` (no N-fold
        intermediate); the sums per element are taken in the same order, so the
        floats are those of calling :meth:`accumulate` N times.
        """
        payloads = [self.validated(p) for p in payloads]
        run: list[Payload] = []
        for p in payloads + [None]:
            if p is not None and p.fmt == FMT_BITMAP2:
                run.append(p)
                continue
            if run:
                K.decode_add_bitmap2(out, [q.body for q in run], [q.scale for q in run])
                run = []
            if p is not None:
                self.accumulate(p, out)
