"""gradzip codecs behind Horovod's ``Compression`` interface.

Horovod (not a dependency of gradzip) compresses each gradient with a class
that has two static methods::

    tensor_compressed, ctx = compression.compress(tensor)
    # ... allreduce(tensor_compressed) (sum or average) across the ranks ...
    tensor = compression.decompress(tensor_compressed, ctx)

:func:`adapt` turns a gradzip codec into such a class, and
:class:`Compression` offers the ready ones::

    import horovod.torch as hvd
    from gradzip.horovod import Compression, adapt
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=Compression.bf16)   # or adapt(gradzip.FP16())

Only codecs whose payloads are *summable* and that need no state can go
this way: ``Identity``, ``FP16``, ``BF16``. Sparsifiers and quantizers (top-k,
threshold, random-k, sign, QSGD, ...) cannot, for two reasons:

* Horovod's allreduce adds the compressed tensors element by element. That
  equals the compressed sum only when ``decompress(a + b) == decompress(a) +
  decompress(b)`` and every rank sends a tensor of the same shape. A top-k or
  threshold payload is a list of (index, value) pairs whose indices differ from
  rank to rank, and whose length can differ too: the allreduce would add rank
  0's indices to rank 1's and the result would decode to garbage (or the ranks
  would disagree on the size). Such payloads need an all-gather and a decode of
  every peer's payload, which is what gradzip's framed exchange does.
* ``compress(tensor)`` is static and gets neither the parameter's name nor the
  step. Biased codecs need a residual per parameter (error feedback) to
  converge, and random-k needs indices every rank derives from the same
  (seed, step, name) to be summable; neither can be kept behind this interface.
  Horovod also calls ``compress`` in the order gradients arrive, which differs
  between ranks.

For those, use :class:`gradzip.optim.DistributedOptimizer`, which has the same
call shape as Horovod's and runs any gradzip codec.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .codecs.base import Codec, TensorContext
from .codecs.cast import BF16, FP16, Identity
from .wire import Payload

__all__ = ["HorovodCompressor", "adapt", "Compression"]


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

    Raises ``ValueError`` for compressors that cannot go through an allreduce
    of their payloads without per-tensor state (see the module docstring):
    ``compressor.summable`` must be true, ``compressor.biased`` false, and the
    compressor must use the default one-allreduce exchange.

    Non-floating-point tensors pass through unchanged, as Horovod's own
    ``Compression.fp16`` does.
    """
    if not isinstance(compressor, Codec):
        raise TypeError(f"compressor must be a gradzip codec, got {type(compressor).__name__}")
    name = type(compressor).__name__
    if not compressor.summable:
        raise ValueError(
            f"{name} cannot go through Horovod's allreduce: its payloads are not summable "
            "(index/value lists differ across ranks); use gradzip.optim.DistributedOptimizer"
        )
    if compressor.biased:
        raise ValueError(
            f"{name} cannot go through Horovod's Compression interface: it is biased and needs per-parameter "
            "error feedback (and per-tensor state), which the static compress(tensor) cannot keep; "
            "use gradzip.optim.DistributedOptimizer"
        )
    if compressor.protocol is not None:
        raise ValueError(
            f"{name} travels by its own protocol ({compressor.protocol}), which Horovod's single allreduce "
            "cannot carry; use gradzip.optim.DistributedOptimizer"
        )

    def compress(tensor: torch.Tensor):
        if not tensor.is_floating_point():
            return tensor, None
        p = compressor.compress(tensor, TensorContext(dtype=tensor.dtype))
        body = p.body
        if body.numel() == tensor.numel():
            body = body.reshape(tensor.shape)
        return body, _Ctx(p.shape, p.dtype, p.vdtype, p.fmt, p.scale)

    def decompress(tensor: torch.Tensor, ctx):
        if ctx is None:
            return tensor
        payload = Payload(
            body=tensor.reshape(-1), shape=ctx.shape, dtype=ctx.dtype, fmt=ctx.fmt, vdtype=ctx.vdtype, scale=ctx.scale
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


class Compression:
    """Ready-made adapters, named as in ``horovod.torch.Compression``."""

    none = adapt(Identity())
    fp16 = adapt(FP16())
    bf16 = adapt(BF16())
