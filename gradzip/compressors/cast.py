"""Identity and dtype casts. Summable: their payloads go through allreduce."""
from __future__ import annotations

import torch

from ..wire import Payload
from .base import Compressor, TensorContext


class Identity(Compressor):
    """No compression: the gradient itself, in its own dtype (plain DDP's bytes)."""

    summable = True
    biased = False

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        self._check_input(x)
        return Payload(body=x.reshape(-1), shape=x.shape, dtype=x.dtype, vdtype=x.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.body.to(payload.dtype).reshape(payload.shape)


class _Cast(Compressor):
    summable = True
    # Round-to-nearest is not systematically biased; error feedback stays opt-in,
    # as in torch's fp16/bf16 hooks. Pass error_feedback=True to keep the rounding error.
    biased = False
    wire_dtype: torch.dtype

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        self._check_input(x)
        return Payload(
            body=x.reshape(-1).to(self.wire_dtype), shape=x.shape, dtype=x.dtype, vdtype=self.wire_dtype
        )

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.body.to(payload.dtype).reshape(payload.shape)


class FP16(_Cast):
    """IEEE half on the wire (2 bytes/element). Values beyond ±65504 become ±inf."""

    wire_dtype = torch.float16


class BF16(_Cast):
    """bfloat16 on the wire (2 bytes/element): fp32's range, 8 bits of mantissa."""

    wire_dtype = torch.bfloat16
