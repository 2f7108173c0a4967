"""The Codec role: a tensor to a Payload and back, with error feedback. No communication.

A codec is pure: it never talks to other ranks. How its payloads travel is a
protocol's business (:mod:`gradzip.protocols`); a codec only says whether its
payload bodies may be added up by an allreduce (``summable``) and, where it needs
one, which protocol carries it (``protocol``, a registered protocol name).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..registry import Registered
from ..wire import Payload, accum_dtype

__all__ = ["Codec", "TensorContext", "tensor_seed", "check_input"]


@dataclass
class TensorContext:
    """What a codec may know about the tensor it is compressing.

    ``store`` is this tensor's own state (adaptive thresholds, counters). It is
    owned by the front end, saved in its ``state_dict()``, and holds only
    tensors and plain Python values. ``dtype`` is the gradient's dtype (the
    input may have been promoted to float32 by error feedback). ``rank`` and
    ``world_size`` let stochastic codecs draw independent randomness per
    rank (shared-randomness ones must not use ``rank``).

    Args:
        name: the tensor's name (its parameter's, or a protocol's key for a piece).
        step: the engine's step counter.
        dtype: the gradient's dtype.
        store: the tensor's state (a dict of tensors and plain values).
        rank: this rank in the process group.
        world_size: the process group's size.
        k: how many elements the protocol allotted this tensor (``scope="call"`` codecs,
            :meth:`Codec.allot`), or None: the codec's own count.
    """

    name: str = ""
    step: int = 0
    dtype: torch.dtype = torch.float32
    store: dict = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    k: int | None = None


def check_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"gradients must be real floating point, got {x.dtype}")


class Codec(Registered, register=False):
    """Base class of the codecs.

    Subclasses set ``summable`` (payload bodies may be added by allreduce:
    ``decompress(a + b) == decompress(a) + decompress(b)``), ``biased`` (error
    feedback defaults to on for biased codecs), ``exact`` (the payload is the input
    itself: summing payloads sums the inputs bit for bit), ``rounds_sum`` (summing
    payloads in their wire dtype rounds the sum: float16), and ``formats`` (the wire
    format codes they write). ``protocol`` names the protocol that carries
    the payloads when it is not the default one for ``summable``.

    Args: none here; each codec documents its own. Subclasses take their arguments as
    keywords that ``config()`` reads back from attributes of the same names.
    """

    kind = "codec"
    summable: ClassVar[bool] = False
    biased: ClassVar[bool] = True
    exact: ClassVar[bool] = False
    rounds_sum: ClassVar[bool] = False
    framable: ClassVar[bool] = True  # a payload decodes from its frame alone (no local data)
    sparse: ClassVar[bool] = False  # sends some coordinates whole, the rest not at all (momentum masking)
    protocol: str | None = None
    #: ``"call"``: the codec chooses what to send over all tensors of a call at once
    #: (:meth:`allot`), and only ``AllGather`` carries it; ``"tensor"``: tensor by tensor.
    scope: str = "tensor"

    def allot(self, xs, ctxs) -> list:
        """Per tensor, how many elements to send when the call's flat inputs ``xs`` are
        chosen from together (``scope="call"``); only such codecs implement it."""
        raise NotImplementedError(f"{type(self).__name__} chooses tensor by tensor")

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

    def sent_mask(self, payload: Payload, n: int) -> torch.Tensor:
        """Bool mask of the ``n`` elements the payload sends (for momentum factor masking)."""
        return self.decompress(payload).reshape(-1) != 0

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        """``v -= decompress(payload)`` in place (``v`` is what was compressed); override to
        subtract only what a sparse payload holds."""
        v.sub_(self.decompress(payload).reshape(v.shape))

    def encode(
        self,
        x: torch.Tensor,
        ctx: TensorContext | None = None,
        residual: torch.Tensor | None = None,
        *,
        feedback: bool = False,
        out: torch.Tensor | None = None,
    ) -> tuple[Payload, torch.Tensor | None]:
        """Compress ``x`` with error feedback: ``(payload, new residual)``.

        With ``feedback`` the codec compresses ``v = x + residual`` (``residual`` None:
        zero) in the accumulation dtype and returns ``v - decompress(payload)`` as the new
        residual, written into ``out`` when given (``out`` may be ``x`` itself, or hold
        anything: it is overwritten). Without ``feedback`` it compresses ``x`` and returns
        ``None``. This default compensates into ``out``, compresses and subtracts in place;
        codecs with a one-pass kernel (Threshold, SignSGD) override it.
        """
        check_input(x)
        if not feedback:
            if residual is not None:
                raise ValueError("a residual without feedback=True would be dropped")
            return self.compress(x, ctx), None
        v = compensate(x, residual, out)
        payload = self.compress(v, ctx)
        if payload.body.numel() and _shares_memory(payload.body, v):
            payload.body = payload.body.clone()  # v becomes the residual below
        self.subtract(payload, v)
        return payload, v

    def zeros(self, payload: Payload) -> torch.Tensor:
        return torch.zeros(payload.shape, dtype=accum_dtype(payload.dtype), device=payload.body.device)


def compensate(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x + residual`` (``residual`` None: zero) in the accumulation dtype, in ``out`` when
    given (``out`` may be ``x``). The values of ``x.to(acc) + residual``."""
    acc = accum_dtype(x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=acc, device=x.device)
    elif out.dtype != acc or out.shape != x.shape:
        raise ValueError(f"out must be a {acc} tensor of shape {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    if residual is None:
        return out if out is x else out.copy_(x)
    return torch.add(x.to(acc), residual.reshape(x.shape), out=out)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def tensor_seed(seed: int, step: int, name: str) -> int:
    """A 63-bit seed that every rank derives identically for (seed, step, tensor name)."""
    h = zlib.crc32(name.encode()) & 0xFFFFFFFF
    x = int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + h * 0x94D049BB133111EB
    x &= (1 << 64) - 1
    x ^= x >> 31
    return x & ((1 << 63) - 1)
