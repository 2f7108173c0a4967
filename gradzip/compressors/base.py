"""The Compressor role: turn a tensor into a Payload and back. No communication."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch

from ..wire import Payload, accum_dtype

__all__ = ["Compressor", "TensorContext", "check_ratio", "check_positive", "check_choice", "tensor_seed"]


@dataclass
class TensorContext:
    """What a compressor may know about the tensor it is compressing.

    ``store`` is this tensor's own state (adaptive thresholds, counters). It is
    owned by the front end, saved in its ``state_dict()``, and holds only
    tensors and plain Python values. ``dtype`` is the gradient's dtype (the
    input may have been promoted to float32 by error feedback). ``rank`` and
    ``world_size`` let stochastic compressors draw independent randomness per
    rank (shared-randomness ones must not use ``rank``).
    """

    name: str = ""
    step: int = 0
    dtype: torch.dtype = torch.float32
    store: dict = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1


class Compressor:
    """Base class.

    Subclasses set ``summable`` (payload bodies may be added up by allreduce:
    ``decompress(a + b) == decompress(a) + decompress(b)``) and ``biased``
    (error feedback defaults to on for biased compressors).
    """

    summable: bool = False
    biased: bool = True

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        raise NotImplementedError

    def decompress(self, payload: Payload) -> torch.Tensor:
        """Dense tensor of ``payload.shape`` and ``payload.dtype`` (the compressed input's)."""
        raise NotImplementedError

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        """``out += decompress(payload)`` for a flat ``out``; override to skip the dense copy."""
        out.add_(self.decompress(payload).reshape(-1))

    def accumulate_many(self, payloads, out: torch.Tensor) -> None:
        """``accumulate`` every peer's payload of one tensor, in order; override to fuse the peers."""
        for p in payloads:
            self.accumulate(p, out)

    def exchange(self, call):
        """The protocol that carries this compressor's payloads (see :mod:`gradzip.exchange`).

        Summable compressors use one allreduce; the others frame their payloads and
        all-gather them. Multi-round methods override this.
        """
        from ..exchange import framed_exchange, summable_exchange

        if self.summable:
            return (yield from summable_exchange(self, call))
        return (yield from framed_exchange(self, call))

    def config(self) -> dict:
        """Plain-value description of the configuration (saved with state, compared on load)."""
        return {"name": type(self).__name__}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"

    # -- helpers for subclasses ----------------------------------------------------------
    @staticmethod
    def _check_input(x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"gradients must be floating point, got {x.dtype}")

    @staticmethod
    def _ctx(x: torch.Tensor, ctx: TensorContext | None) -> TensorContext:
        return ctx if ctx is not None else TensorContext(dtype=x.dtype)

    @staticmethod
    def _zeros(payload: Payload) -> torch.Tensor:
        return torch.zeros(payload.shape, dtype=accum_dtype(payload.dtype), device=payload.body.device)


def check_ratio(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def check_positive(name: str, value: float, *, integer: bool = False, allow_zero: bool = False) -> float:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        rng = "[0, inf)" if allow_zero else "(0, inf)"
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} in {rng}, got {value!r}")
    return value


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")


def tensor_seed(seed: int, step: int, name: str) -> int:
    """A 63-bit seed that every rank derives identically for (seed, step, tensor name)."""
    h = zlib.crc32(name.encode()) & 0xFFFFFFFF
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + h * 0x94D049BB133111EB)
    x &= (1 << 64) - 1
    x ^= x >> 31
    return x & ((1 << 63) - 1)
