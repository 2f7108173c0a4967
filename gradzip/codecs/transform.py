"""Compressing in another basis: ``DCT(codec)`` runs a codec on a tensor's discrete cosine
transform (DeMo, Peng, Quesnelle and Kingma 2024).

A gradient's energy in the DCT basis of small blocks is concentrated in fewer coefficients
than in the parameter basis, and a coefficient stands for a whole block: a top-k of
coefficients moves every parameter of the block, where a top-k of parameters leaves most of
them waiting in the residual. The transform is orthonormal, so error feedback keeps what the
codec drops exactly (up to rounding) whichever basis it is computed in.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

import gradzip.args as args

from ..wire import Payload, accum_dtype
from .base import Codec, TensorContext, check_input

__all__ = ["DCT", "dct_matrix", "block_shape"]


@functools.lru_cache(maxsize=64)
def _dct64(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size ``n`` (row ``k`` is the ``k``-th basis vector):
    ``D @ D.T == I``."""
    return _dct64(n).to(dtype=dtype, device=device)


def _divisor(n: int, most: int) -> int:
    """The largest divisor of ``n`` that is at most ``most``."""
    for d in range(min(n, most), 0, -1):
        if n % d == 0:
            return d
    return 1


def block_shape(shape, chunk: int) -> tuple[int, int, int, int]:
    """``(rows, cols, block rows, block cols)``: a tensor of ``shape`` seen as a matrix
    (``shape[0]`` by the rest; a vector as one row) and the blocks its DCT runs on, each side
    the largest divisor of the matrix's side that is at most ``chunk`` (no padding, so the
    coefficients fill a tensor of the input's shape)."""
    n = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    cols = n // rows if rows else 0
    if n == 0:
        return rows, cols, 1, 1
    return rows, cols, _divisor(rows, chunk), _divisor(cols, chunk)


def _transform(x: torch.Tensor, shape, chunk: int, inverse: bool) -> torch.Tensor:
    rows, cols, br, bc = block_shape(shape, chunk)
    if x.numel() == 0 or (br == 1 and bc == 1):
        return x.reshape(shape).clone()
    dr = dct_matrix(br, x.dtype, x.device)
    dc = dct_matrix(bc, x.dtype, x.device)
    blocks = x.reshape(rows // br, br, cols // bc, bc).transpose(1, 2)  # [row blocks, col blocks, br, bc]
    if inverse:  # X = D_r^T Y D_c per block
        out = dr.T @ blocks @ dc
    else:  # Y = D_r X D_c^T per block
        out = dr @ blocks @ dc.T
    return out.transpose(1, 2).reshape(shape)


class DCT(Codec):
    """Run ``codec`` on the tensor's blockwise DCT: its coefficients, in a tensor of the
    input's shape, are what ``codec`` compresses and sends; the receiver decodes them and
    transforms back.

    The tensor is seen as a matrix (its first dimension by the rest; a vector as one row) and
    cut into blocks whose sides are the largest divisors of the matrix's sides that are at
    most ``chunk`` (DeMo's 64 by 64); each block gets an orthonormal 2-D DCT-II. A side with
    no divisor above 1 up to ``chunk`` (a prime length) is left untransformed.
    ``DCT(TopK(0.01))`` sends 1% of the coefficients; since each stands for a block, every
    parameter of a block moves when one of its coefficients is sent.

    Error feedback is kept in the parameter basis (``input - inverse(sent coefficients)``):
    the transform is orthonormal, so nothing is lost but rounding. It is not a sparse codec
    in the parameter basis, so momentum correction keeps its momentum (no masking). A
    receiver sums the peers' coefficients, then transforms once.

    Args:
        codec: the codec that compresses the coefficients (any gradzip codec that chooses
            tensor by tensor).
        chunk: the largest block side, an integer >= 1 (default 64).
    """

    keeps_zeros = False  # a coefficient mixes a block's elements (under Flat: neighbouring tensors')

    def __init__(self, codec: Codec, *, chunk: int = 64) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"DCT() takes a gradzip codec, got {codec!r}")
        if isinstance(codec, DCT):
            raise ValueError("DCT(DCT(...)) transforms twice; give it the codec once")
        if codec.scope != "tensor":
            raise ValueError(
                f"DCT() needs a codec that chooses tensor by tensor, got {codec!r} (scope={codec.scope!r})"
            )
        if not codec.framable:
            raise ValueError(f"DCT() needs a codec whose payloads decode from their frames alone, got {codec!r}")
        self.codec = codec
        self.chunk = args.integer("chunk", chunk, 1)

    # The coefficients travel as the inner codec's payloads.
    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.codec.summable

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.codec.biased

    @property
    def rounds_sum(self) -> bool:  # type: ignore[override]
        return self.codec.rounds_sum

    @property
    def protocol(self) -> str | None:  # type: ignore[override]
        return self.codec.protocol

    @property
    def average(self) -> str:  # type: ignore[override]
        return self.codec.average

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The coefficients of ``x`` (in the accumulation dtype, ``x``'s shape)."""
        return _transform(x.to(accum_dtype(x.dtype)), x.shape, self.chunk, inverse=False)

    def inverse(self, y: torch.Tensor, shape) -> torch.Tensor:
        """The tensor whose coefficients are ``y``, in ``shape``."""
        return _transform(y, shape, self.chunk, inverse=True)

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        return self.codec.compress(self.forward(x), ctx)

    def check_frame(self, payload: Payload) -> None:
        self.codec.check_frame(payload)

    def check_frames(self, payloads) -> None:
        self.codec.check_frames(payloads)

    def decompress(self, payload: Payload) -> torch.Tensor:
        coef = self.codec.decompress(payload)
        return self.inverse(coef.to(accum_dtype(coef.dtype)), payload.shape).to(payload.dtype)

    def accumulate_many(self, payloads, out: torch.Tensor) -> None:
        """Every peer's coefficients summed first, then one inverse transform."""
        payloads = list(payloads)
        if not payloads:
            return
        shape = payloads[0].shape
        coef = torch.zeros(out.numel(), dtype=accum_dtype(out.dtype), device=out.device)
        self.codec.accumulate_many(payloads, coef)
        out.add_(self.inverse(coef, shape).reshape(-1).to(out.dtype))

    def average_senders(self, payloads, out: torch.Tensor) -> None:
        """Every coefficient averaged over the peers that sent it, then one inverse transform."""
        payloads = list(payloads)
        if not payloads:
            return
        coef = torch.zeros(out.numel(), dtype=accum_dtype(out.dtype), device=out.device)
        self.codec.average_senders(payloads, coef)
        out.add_(self.inverse(coef, payloads[0].shape).reshape(-1).to(out.dtype))

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        self.accumulate_many([payload], out)

    def zeros(self, payload: Payload) -> torch.Tensor:
        return self.codec.zeros(replace(payload))
