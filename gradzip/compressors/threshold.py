"""Strom (2015) threshold sparsification, as in Deeplearning4j's gradient sharing.

Each element ``v`` of the compressed input with ``|v| >= tau`` is sent as
``sign(v) * tau``; everything else (and the ``|v| - tau`` left over by the sent
elements) stays in the error-feedback residual. On the wire:

* an index list, one int32 word per element: index in bits 0..30, sign in bit 31
  (``FMT_SIGNED_INDEX``);
* or, when that list would be longer than a 2-bit-per-element bitmap
  (0 / +tau / -tau), the bitmap (``FMT_BITMAP2``). A frame is therefore never
  larger than ``ceil(n / 4)`` bytes plus the 16-byte header and at most 7 bytes
  of alignment padding. Tensors of 2**31 or more elements always use the bitmap;
* or an empty frame when nothing reaches tau. Nothing hangs: every rank still
  takes part in every collective.

**Each payload carries its own tau** (the header's f32 ``scale``). Ranks may
therefore use different thresholds in the same step (the adaptive policy adapts
to each rank's own gradients) and every receiver decodes each peer with that
peer's tau.

**Exact residuals.** Before encoding, tau is rounded down to a multiple of the
float32 ulp of ``max|v|`` (at least one ulp). Then ``v - sign(v) * tau`` is
exactly representable for every selected element, so ``residual + sent ==
input`` holds exactly and no mass is lost to rounding. For ordinary tensors
(``max|v| < 2**16 * tau``) this moves tau by less than 2**-8 of itself.

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
"""
from __future__ import annotations

import math

import torch

from .. import kernels as K
from ..wire import FMT_BITMAP2, FMT_EMPTY, FMT_SIGNED_INDEX, Payload, accum_dtype, as_bytes, from_bytes
from .base import Compressor, TensorContext, check_choice, check_positive, check_ratio

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


class Threshold(Compressor):
    summable = False
    biased = True

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
    ) -> None:
        check_positive("tau", tau)
        check_choice("policy", policy, _POLICIES)
        if (
            not isinstance(band, (tuple, list))
            or len(band) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in band)
            or not (0.0 <= band[0] < band[1] <= 1.0)
        ):
            raise ValueError(f"band must be (low, high) with 0 <= low < high <= 1, got {band!r}")
        if not isinstance(decay, (int, float)) or not (0.0 < decay < 1.0):
            raise ValueError(f"decay must be a number in (0, 1), got {decay!r}")
        growth = 1.0 / decay if growth is None else growth
        if not isinstance(growth, (int, float)) or not (1.0 < growth < math.inf):
            raise ValueError(f"growth must be a number in (1, inf), got {growth!r}")
        check_ratio("density", density)
        check_positive("shake_every", shake_every, integer=True, allow_zero=True)
        if not isinstance(shake_factor, (int, float)) or not (1.0 < shake_factor < math.inf):
            raise ValueError(f"shake_factor must be a number in (1, inf), got {shake_factor!r}")
        self.tau = float(tau)
        self.policy = policy
        self.band = (float(band[0]), float(band[1]))
        self.decay = float(decay)
        self.growth = float(growth)
        self.density = float(density)
        self.shake_every = int(shake_every)
        self.shake_factor = float(shake_factor)

    def config(self) -> dict:
        return {
            "name": "Threshold",
            "tau": self.tau,
            "policy": self.policy,
            "band": list(self.band),
            "decay": self.decay,
            "growth": self.growth,
            "density": self.density,
            "shake_every": self.shake_every,
            "shake_factor": self.shake_factor,
        }

    # -- encode ------------------------------------------------------------------------
    def current_tau(self, ctx: TensorContext) -> float:
        """The policy's tau for this tensor before this step's encode."""
        return float(ctx.store.get("tau", self.tau))

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        self._check_input(x)
        ctx = self._ctx(x, ctx)
        # Float16/bfloat16 go to the kernel as they are (it widens to float32 as it
        # loads); |v|, its max and its top-k are exact in the input's dtype.
        v = x.reshape(-1) if x.dtype in K.KERNEL_DTYPES else x.reshape(-1).to(accum_dtype(x.dtype))
        n = v.numel()
        tau = self.current_tau(ctx)
        amax = float(v.abs().max()) if n else 0.0
        if self.policy == "target" and n:
            k = min(n, max(1, math.ceil(self.density * n)))
            kth = float(torch.topk(v.abs(), k, sorted=False).values.min())
            tau = kth if kth > 0 else tau
        shake = self.shake_every > 0 and (ctx.step + 1) % self.shake_every == 0
        if shake:
            tau = tau / self.shake_factor
        tau = exact_tau(tau, amax)

        # One pass: select, count, pack the bitmap (dispatched: reference on the CPU).
        sel = K.threshold_ef(v, tau)
        count = sel.count
        if self.policy == "adaptive" and not shake and n:
            frac = count / n
            t = self.current_tau(ctx)
            if frac < self.band[0]:
                t *= self.decay
            elif frac > self.band[1]:
                t *= self.growth
            ctx.store["tau"] = min(max(t, _F32_MIN_SUBNORMAL), _F32_MAX)
        elif self.policy == "target":
            ctx.store["tau"] = tau

        empty = torch.empty(0, dtype=torch.uint8, device=x.device)
        if count == 0:
            return Payload(body=empty, shape=x.shape, dtype=x.dtype, fmt=FMT_EMPTY, scale=tau)
        bitmap_bytes = (n + 3) // 4
        if n < _MAX_INDEX and 4 * count <= bitmap_bytes:
            return Payload(body=as_bytes(sel.indices()), shape=x.shape, dtype=x.dtype, fmt=FMT_SIGNED_INDEX, scale=tau)
        return Payload(body=sel.bitmap(), shape=x.shape, dtype=x.dtype, fmt=FMT_BITMAP2, scale=tau)

    # -- decode ------------------------------------------------------------------------
    def decompress(self, payload: Payload) -> torch.Tensor:
        out = self._zeros(payload)
        self.accumulate(payload, out.view(-1))
        return out.to(payload.dtype)

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        tau = payload.scale
        if payload.fmt == FMT_EMPTY:
            return
        if payload.fmt == FMT_SIGNED_INDEX:
            words = from_bytes(payload.body, torch.int32)
            if words.numel():
                top = int((words & 0x7FFFFFFF).max())
                if top >= out.numel():
                    raise ValueError(f"corrupt threshold frame: index {top} >= numel {out.numel()}")
            K.scatter_add_signed(out, words, tau)
            return
        if payload.fmt == FMT_BITMAP2:
            K.decode_add_bitmap2(out, [payload.body], [tau])
            return
        raise ValueError(f"Threshold cannot decode frame format {payload.fmt}")

    def accumulate_many(self, payloads, out: torch.Tensor) -> None:
        """``accumulate`` each payload in order (one tensor, N peers).

        Runs of bitmap frames decode in one pass over ``out`` (no N-fold
        intermediate); the sums per element are taken in the same order, so the
        floats are those of calling :meth:`accumulate` N times.
        """
        run: list[Payload] = []
        for p in list(payloads) + [None]:
            if p is not None and p.fmt == FMT_BITMAP2:
                run.append(p)
                continue
            if run:
                K.decode_add_bitmap2(out, [q.body for q in run], [q.scale for q in run])
                run = []
            if p is not None:
                self.accumulate(p, out)
