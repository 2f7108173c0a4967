"""``horovod.torch.compression``: Horovod's ``Compression`` interface, gradzip's adapters behind
it, and the choice of a gradzip method from the environment.

**Adapters** (:func:`adapt`, :class:`Compression`) put gradzip's summable casts behind Horovod's
own static ``compress``/``decompress`` interface, for scripts that keep ``horovod.torch``'s
optimizer or call ``allreduce(compression=...)``. ``Compression.fp16`` keeps Horovod's overflow
semantics: a value beyond ±65504 becomes ±inf, as with ``horovod.torch.Compression.fp16``, so
``GradScaler`` sees the overflow (no saturation: that interface has no residual to keep the
excess). ``BF16`` is refused at construction: Horovod's torch binding has no bfloat16
allreduce. Sparsifiers and quantizers are refused too: Horovod's allreduce adds payloads
element by element, which is no sum of index/value lists, and its static ``compress(tensor)``
has no name, step or residual for error feedback; give them to ``DistributedOptimizer``.

**A method from the environment.** ``GRADZIP_COMPRESSION`` names a gradzip method in the
grammar of ``gradzip.parse`` (``"TopK(0.01)"``, ``"PowerSGD(rank=4)"``), or ``@FILE``, a file
whose first non-blank, non-``#`` line is one. ``DistributedOptimizer`` then runs that method
where the script passes ``Compression.none`` or ``Compression.fp16`` (this module's or
``horovod.torch``'s, the default included), so an unchanged Horovod script trains with it; a
gradzip codec, protocol or method string passed in the script is kept. Rank 0 reports the
choice once on stderr, and the ratio reached at exit (see ``optimizer.py``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..codecs.base import Codec
from ..codecs.cast import BF16, FP16, Identity
from ..protocols.base import Protocol
from ..registry import parse
from ..wire import Payload

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression", "HorovodCompressor", "adapt", "method_of"]

ENV = "GRADZIP_COMPRESSION"


class HorovodCompressor:
    """Horovod's interface: static ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    gradzip_compressor: Codec

    @staticmethod
    def compress(tensor: torch.Tensor):  # pragma: no cover - overridden by adapt()
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):  # pragma: no cover - overridden by adapt()
        raise NotImplementedError


class _Ctx(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    vdtype: torch.dtype | None
    fmt: int
    scale: float


def adapt(compressor: Codec) -> type:
    """A Horovod ``Compression`` class (static ``compress``/``decompress``) that runs ``compressor``.

    Raises ``ValueError`` at construction for what Horovod's allreduce cannot carry: payloads
    that are not summable, biased codecs (they need per-parameter error feedback), codecs with a
    protocol of their own, and ``BF16`` (Horovod's torch binding has no bfloat16 allreduce).
    ``FP16`` casts as Horovod's ``Compression.fp16`` does (beyond ±65504 becomes ±inf: the
    overflow stays visible). Non-floating-point tensors pass through unchanged, as in Horovod.
    """
    if not isinstance(compressor, Codec):
        raise TypeError(f"compressor must be a gradzip codec, got {type(compressor).__name__}")
    name = type(compressor).__name__
    if isinstance(compressor, BF16):
        raise ValueError(
            "BF16 cannot go through Horovod: its torch binding has no bfloat16 allreduce "
            "(ValueError 'Tensor type torch.BFloat16Tensor is not supported'); use "
            "gradzip.horovod.DistributedOptimizer(compression=gz.BF16()) on transport='torch', or FP16"
        )
    if not compressor.summable:
        raise ValueError(
            f"{name} cannot go through Horovod's allreduce: its payloads are not summable "
            "(index/value lists differ across ranks); use gradzip.horovod.DistributedOptimizer"
        )
    if compressor.biased:
        raise ValueError(
            f"{name} cannot go through Horovod's Compression interface: it is biased and needs per-parameter "
            "error feedback (and per-tensor state), which the static compress(tensor) cannot keep; "
            "use gradzip.horovod.DistributedOptimizer"
        )
    if compressor.protocol is not None:
        raise ValueError(
            f"{name} travels by its own protocol ({compressor.protocol}), which Horovod's single allreduce "
            "cannot carry; use gradzip.horovod.DistributedOptimizer"
        )
    if isinstance(compressor, Identity):  # Horovod's NoneCompressor: the tensor itself, no context

        def compress(tensor: torch.Tensor):
            return tensor, None

        def decompress(tensor: torch.Tensor, ctx):
            return tensor

    elif isinstance(compressor, FP16):

        def compress(tensor: torch.Tensor):
            if not tensor.is_floating_point():
                return tensor, None
            return tensor.to(torch.float16), tensor.dtype  # IEEE rounding: overflow is ±inf, as Horovod

        def decompress(tensor: torch.Tensor, ctx):
            return tensor if ctx is None else tensor.to(ctx)

    else:

        def compress(tensor: torch.Tensor):
            if not tensor.is_floating_point():
                return tensor, None
            p = compressor.compress(tensor)
            body = p.body
            if body.numel() == tensor.numel():
                body = body.reshape(tensor.shape)
            return body, _Ctx(p.shape, p.dtype, p.vdtype, p.fmt, p.scale)

        def decompress(tensor: torch.Tensor, ctx):
            if ctx is None:
                return tensor
            payload = Payload(
                body=tensor.reshape(-1),
                shape=ctx.shape,
                dtype=ctx.dtype,
                fmt=ctx.fmt,
                vdtype=ctx.vdtype,
                scale=ctx.scale,
            )
            return compressor.decompress(payload)

    return type(
        f"Horovod{name}",
        (HorovodCompressor,),
        {
            "__doc__": f"Horovod Compression running gradzip's {compressor!r}.",
            "gradzip_compressor": compressor,
            "compress": staticmethod(compress),
            "decompress": staticmethod(decompress),
        },
    )


class _CompressionMeta(type):
    def __getattr__(cls, name):
        if name == "bf16":
            raise AttributeError(
                "Compression.bf16 does not exist: Horovod's torch binding has no bfloat16 allreduce. Use "
                "gradzip.horovod.DistributedOptimizer(compression=gz.BF16()) (transport 'torch') instead"
            )
        raise AttributeError(f"type object 'Compression' has no attribute {name!r}")


class Compression(metaclass=_CompressionMeta):
    """Ready-made adapters, named as in ``horovod.torch.Compression``."""

    none = adapt(Identity())
    fp16 = adapt(FP16())


Compressor = HorovodCompressor  # horovod.torch.compression's names
NoneCompressor = Compression.none
FP16Compressor = Compression.fp16


def from_env() -> Codec | Protocol | None:
    """The method ``GRADZIP_COMPRESSION`` names (None when unset or empty); ``@FILE`` reads it
    from a file. ValueError naming the variable for a string gradzip cannot parse."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return None
    where = ENV
    if spec.startswith("@"):
        path = spec[1:]
        with open(path) as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        if not lines:
            raise ValueError(f"{ENV}={spec!r}: {path} names no method")
        spec, where = lines[0], f"{ENV} ({path})"
    try:
        return parse(spec)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{where}={spec!r} is not a gradzip method: {exc}") from exc


def _horovod_kind(compression) -> str | None:
    """``"none"``/``"fp16"`` for Horovod's two compressions (this module's or horovod.torch's)."""
    if not isinstance(compression, type):
        return None
    if compression is Compression.none:
        return "none"
    if compression is Compression.fp16:
        return "fp16"
    if compression.__module__.startswith("horovod."):
        return {"NoneCompressor": "none", "FP16Compressor": "fp16"}.get(compression.__name__)
    return None


def method_of(compression):
    """(gradzip method, error feedback default, where it came from) for a ``compression=``
    argument; ``where`` is ``"environment"`` when ``GRADZIP_COMPRESSION`` replaced
    ``Compression.none``/``fp16``, else ``"script"``."""
    if compression is None:
        compression = Compression.none
    kind = _horovod_kind(compression)
    if kind is not None:
        env = from_env()
        if env is not None:
            return env, None, "environment"
        if kind == "fp16":
            # FP16 saturates beyond ±65504; error feedback keeps the excess (never a silent clip).
            return FP16(), True, "script"
        return Identity(), None, "script"
    if isinstance(compression, str):
        compression = parse(compression)
    if isinstance(compression, (Codec, Protocol)):
        return compression, None, "script"
    if isinstance(compression, type):
        codec = getattr(compression, "gradzip_compressor", None)
        if codec is not None:
            return codec, (True if isinstance(codec, FP16) else None), "script"
    raise TypeError(
        f"compression must be a gradzip codec, protocol or method string, or Compression.none/fp16; got {compression!r}"
    )
