"""Identity and dtype casts. Summable: their payloads go through allreduce."""

from __future__ import annotations

import torch

from ..wire import FMT_DENSE, Payload, from_bytes
from .base import Codec, TensorContext, check_dense, check_format, check_input

__all__ = ["Identity", "FP16", "BF16", "saturating_cast"]


class Identity(Codec):
    """No compression: the gradient itself, in its own dtype (plain DDP's bytes).

    Args: none. The gradient travels in its own dtype; error feedback is off (there is
    nothing to keep).
    """

    summable = True
    biased = False
    exact = True

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        return Payload(body=x.reshape(-1), shape=x.shape, dtype=x.dtype, vdtype=x.dtype)

    def check_frame(self, payload: Payload) -> None:
        """``DENSE`` only: every element in the tensor's own dtype (what the receiver
        expects for it), no scale."""
        check_format(self, payload, (FMT_DENSE,))
        check_dense(self, payload, (payload.dtype,))

    def decompress(self, payload: Payload) -> torch.Tensor:
        self.validated(payload)
        return _values(payload).to(payload.dtype).reshape(payload.shape)


def _values(payload: Payload) -> torch.Tensor:
    """The payload's values: its body, or a framed body's bytes viewed as the value dtype."""
    if payload.body.dtype == torch.uint8 and payload.vdtype not in (None, torch.uint8):
        return from_bytes(payload.body, payload.vdtype)
    return payload.body


_MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _in_range(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a plain cast of ``x`` to ``dtype`` saturates nothing: ``x``'s dtype has no values
    beyond ``dtype``'s range, or every value of ``x`` is finite and within it (one reduction:
    NaN and infinities fail the test, as NaN compares false)."""
    fmax = torch.finfo(dtype).max
    if torch.finfo(x.dtype).max <= fmax or x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    return bool(torch.maximum(lo.neg(), hi).to(wide) <= fmax)


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to a narrower float dtype without turning finite values into infinities.

    A finite ``v`` beyond the target's range is sent as the largest value that is
    representable in ``dtype``, not above ``|v|``, and a multiple of ``ulp(v)`` (in
    ``v``'s own dtype), with ``v``'s sign. So ``v - sent`` is exact and error feedback
    keeps the excess; values so large that no such value exists are sent as 0.
    Infinities and NaNs pass through unchanged.
    """
    fmax = torch.finfo(dtype).max
    if _in_range(x, dtype):
        return x.to(dtype)
    # Compare in a dtype that holds fmax exactly (65504 rounds to 65536 in bfloat16).
    a = x.abs().to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    big = (a > fmax) & torch.isfinite(x)
    if not bool(big.any()):
        return x.to(dtype)
    _, e = torch.frexp(x[big].to(torch.float64))
    # ulp(v) = 2**(e - 1 - mantissa bits), with v = m * 2**e, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e - 1 - _MANTISSA_BITS[x.dtype])
    sat = torch.floor(fmax / ulp) * ulp * torch.sign(x[big].to(torch.float64))
    y = x.clone()
    y[big] = sat.to(x.dtype)
    return y.to(dtype)


class _Cast(Codec):
    summable = True
    rounds_sum = True  # payloads added in the wire dtype round the sum
    fixed_frames = True
    # Round-to-nearest is not systematically biased; error feedback stays opt-in,
    # as in torch's fp16/bf16 hooks. Pass error_feedback=True to keep the rounding error.
    biased = False
    wire_dtype: torch.dtype

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        return Payload(
            body=saturating_cast(x.reshape(-1), self.wire_dtype), shape=x.shape, dtype=x.dtype, vdtype=self.wire_dtype
        )

    def dense_wire(self, dtype: torch.dtype) -> torch.dtype | None:
        return self.wire_dtype

    def compress_into(self, x: torch.Tensor, body: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        flat = x.reshape(-1)
        if body.dtype != self.wire_dtype or body.numel() != flat.numel():
            want = f"{flat.numel()} {self.wire_dtype} elements"
            raise ValueError(f"body must hold {want}, got {body.numel()} {body.dtype}")
        if _in_range(flat, self.wire_dtype):
            body.copy_(flat)  # the cast, written where it goes: no tensor in between
        else:
            body.copy_(saturating_cast(flat, self.wire_dtype))
        return Payload(body=body, shape=x.shape, dtype=x.dtype, vdtype=self.wire_dtype)

    def check_frame(self, payload: Payload) -> None:
        """``DENSE`` only: every element in the wire dtype, no scale."""
        check_format(self, payload, (FMT_DENSE,))
        check_dense(self, payload, (self.wire_dtype,))

    def decompress(self, payload: Payload) -> torch.Tensor:
        self.validated(payload)
        # Saturating: float16 gradients sent as bfloat16 may round up past 65504.
        return saturating_cast(_values(payload).to(torch.float32), payload.dtype).reshape(payload.shape)

    def decompress_into(self, payload: Payload, out: torch.Tensor) -> None:
        # Into float32 or float64 the wire value converts exactly, and saturating to float32
        # or float64 changes nothing: one copy does decompress's work.
        if payload.dtype in _WIDE and out.dtype in _WIDE:
            self.validated(payload)
            v = _values(payload)
            if v.numel() != out.numel():
                raise ValueError(f"out holds {out.numel()} elements, the payload {v.numel()}")
            out.copy_(v)
        else:
            super().decompress_into(payload, out)


_WIDE = (torch.float32, torch.float64)


class FP16(_Cast):
    """IEEE half on the wire (2 bytes/element).

    Finite values beyond ±65504 saturate (see :func:`saturating_cast`) instead of
    becoming ±inf, so error feedback keeps the excess and the residual is never
    poisoned; without error feedback they are clipped.

    Args: none. Error feedback is off by default (``error_feedback=True`` in the front
    end keeps the rounding; the sum then runs in ``TwoPhase``, see ``as_protocol``).
    """

    wire_dtype = torch.float16


class BF16(_Cast):
    """bfloat16 on the wire (2 bytes/element): fp32's range, 8 bits of mantissa.

    Args: none. Error feedback is off by default (``error_feedback=True`` in the front
    end keeps the rounding; the sum then runs in ``TwoPhase``, see ``as_protocol``).
    """

    wire_dtype = torch.bfloat16
