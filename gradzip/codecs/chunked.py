"""ChunkTopK: the top-k of every tile of a tensor, SparseLoCo's and DeMo's compressor.

The tensor is seen as a matrix (its first dimension by the rest; a vector as one row) and cut
into tiles whose sides are the largest divisors of the matrix's sides that are at most ``chunk``
(:func:`gradzip.codecs.transform.block_shape`, the tiles of ``DCT(chunk=...)``). Every tile of
``t`` elements keeps its ``max(1, round(k * t / chunk**2))`` elements of largest magnitude
(``k`` of a full ``chunk`` by ``chunk`` tile: SparseLoCo's and DeMo's 32 of 64 by 64, 0.78%),
so every tile moves, where one top-k over the tensor may leave whole regions waiting in the
residual. The count of a tensor is a function of its shape, so every rank's frame of it has
one length (``fixed_frames``): ``AllGather`` sends it in one round.

Wire (one frame a tensor):

* ``CHUNK``: the positions in Elias-Fano code (:func:`~gradzip.codecs.positions.pack_ef`, about
  ``log2(n / K) + 2`` bits each, ``K`` the tensor's count), then the ``K`` values in the
  gradient's dtype or ``values=`` (``"fp16"``, ``"bf16"``: finite values saturate).
* ``CHUNK_Q2`` (``values="q2"``): the positions, then 2 bits a value, then four float32
  centroids. The codes split the kept values at ``-tau``, 0 and ``tau`` (``tau`` the mean
  magnitude of the kept values), and each code decodes to the mean of the values that took it,
  so a frame's decoded values sum to the kept values' sum. SparseLoCo's 2-bit values quantize
  the kept values in four bins as well; these bins and centroids are gradzip's own. Error
  feedback keeps what the rounding drops.
* ``DENSE``: a tensor whose sparse frame would be no smaller than itself.

Receivers average the peers' frames (``sum / N``), as every gradzip protocol does; with
``average="senders"`` they average each element over the ranks that sent it, as SparseLoCo's
reference code does (an element one rank of four sent moves by that rank's whole value, not a
quarter of it; error feedback is the same: each rank keeps what it did not send). Under
``DCT`` the coefficients are averaged so before the one inverse transform, as DeMo's reference
code does.

A decoder distrusts the frame: the count must be the shape's, every tile must hold its own
number of positions, positions strictly ascending below ``n``, the 2-bit padding zero, the
centroids finite and on the sides of zero their codes stand for, values finite.
"""

from __future__ import annotations

import torch

import gradzip.args as args

from .. import kernels as K
from ..wire import FMT_DENSE, FrameError, Payload, as_bytes, itemsize
from .base import Codec, TensorContext, check_input
from .cast import saturating_cast
from .positions import ef_nbytes, pack_ef, unpack_ef
from .transform import block_shape

__all__ = ["ChunkTopK", "chunk_plan", "FMT_CHUNK", "FMT_CHUNK_Q2"]

FMT_CHUNK = 24  # body: Elias-Fano positions, then the K values in vdtype
FMT_CHUNK_Q2 = 25  # body: Elias-Fano positions, 2-bit codes (K/4 bytes, padded), 4 float32 centroids
_VALUE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_VALUES = (*_VALUE_DTYPES, "q2")
_CENTROIDS = 4
#: How receivers average a ChunkTopK's frames (:attr:`gradzip.codecs.base.Codec.average`).
AVERAGES = ("ranks", "senders")


def chunk_plan(shape, k: int, chunk: int) -> tuple[int, int, int, int, int]:
    """``(rows, cols, tile rows, tile cols, kept per tile)`` of a tensor of ``shape``."""
    rows, cols, tr, tc = block_shape(tuple(shape), chunk)
    t = tr * tc
    per = min(t, max(1, round(k * t / (chunk * chunk)))) if rows * cols else 0
    return rows, cols, tr, tc, per


class ChunkTopK(Codec):
    """Keep the ``k`` largest magnitudes of every ``chunk`` by ``chunk`` tile (module docstring).

    ``DiLoCo(..., compression=ChunkTopK(32, chunk=64, values="q2"), error_decay=0.95,
    outer_kwargs={"lr": 1.0, "momentum": 0.0, "nesterov": False})`` is SparseLoCo;
    ``DCT(ChunkTopK(32, chunk=64))`` under the DDP hook with ``update="sign"`` and
    ``error_decay=0.999`` is DeMo (``docs/lm.md``).

    Args:
        k: elements kept in a full tile (``chunk * chunk`` elements), an integer >= 1; a smaller
            tile keeps ``max(1, round(k * its size / chunk**2))``.
        chunk: the largest tile side, an integer >= 1 (default 64).
        values: ``None`` (the gradient's dtype), ``"fp16"``, ``"bf16"`` or ``"q2"`` (2 bits a
            value and four float32 centroids a frame).
        average: ``"ranks"`` (the sum of the frames over the world size) or ``"senders"`` (each
            element over the ranks that sent it, SparseLoCo's reference rule; ``AllGather``
            only, which carries ChunkTopK).
    """

    formats = {"CHUNK": FMT_CHUNK, "CHUNK_Q2": FMT_CHUNK_Q2}
    sparse = True
    fixed_frames = True
    protocol = "AllGather"  # one selection per tensor: owners re-selecting pieces would select twice

    def __init__(self, k: int = 32, *, chunk: int = 64, values: str | None = None, average: str = "ranks") -> None:
        self.k = args.integer("k", k, 1)
        self.chunk = args.integer("chunk", chunk, 1)
        self.values = None if values is None else args.choice("values", values, _VALUES)
        self.average = args.choice("average", average, AVERAGES)

    # -- layout ------------------------------------------------------------------------------
    def count(self, shape) -> int:
        """The positions a tensor of ``shape`` sends (every tile's count, summed)."""
        rows, cols, tr, tc, per = chunk_plan(shape, self.k, self.chunk)
        return (rows // tr) * (cols // tc) * per if rows * cols else 0

    def _value_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        if self.values == "q2":
            return torch.float32  # the centroids
        if self.values is not None:
            return _VALUE_DTYPES[self.values]
        return grad_dtype

    def _sparse_nbytes(self, n: int, count: int, vdtype: torch.dtype) -> int:
        if self.values == "q2":
            return ef_nbytes(n, count) + (2 * count + 7) // 8 + 4 * _CENTROIDS
        return ef_nbytes(n, count) + count * itemsize(vdtype)

    def _dense(self, n: int, count: int, grad_dtype: torch.dtype) -> bool:
        """Whether a tensor's frame is DENSE: nothing to drop, or no smaller sparse form."""
        return count >= n or self._sparse_nbytes(n, count, self._value_dtype(grad_dtype)) >= n * itemsize(grad_dtype)

    def select(self, v: torch.Tensor, shape) -> torch.Tensor:
        """The ascending flat positions (int64) of every tile's largest magnitudes."""
        rows, cols, tr, tc, per = chunk_plan(shape, self.k, self.chunk)
        tiles = v.reshape(rows // tr, tr, cols // tc, tc).transpose(1, 2).reshape(-1, tr * tc)
        local = tiles.abs().topk(per, dim=1, sorted=False).indices  # [tiles, per]
        across = cols // tc
        tile = torch.arange(tiles.shape[0], device=v.device)[:, None]
        row = (tile // across) * tr + local // tc
        col = (tile % across) * tc + local % tc
        return (row * cols + col).reshape(-1).sort().values

    # -- encode --------------------------------------------------------------------------------
    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        ctx = ctx or TensorContext(dtype=x.dtype)
        gdtype = ctx.dtype if ctx.dtype.is_floating_point else x.dtype
        v = x.reshape(-1)
        n = v.numel()
        count = self.count(x.shape)
        if n == 0 or self._dense(n, count, gdtype):
            sent = saturating_cast(v, gdtype) if v.dtype != gdtype else v
            return Payload(body=as_bytes(sent), shape=x.shape, dtype=x.dtype, fmt=FMT_DENSE, vdtype=gdtype)
        idx = self.select(v, x.shape)
        vals = v[idx]
        positions = pack_ef(idx, n)
        if self.values == "q2":
            codes, centroids = quantize2(vals)
            sent = centroids[codes]
            body = torch.cat([positions, K.pack_uint(codes, 2), as_bytes(centroids)])
            return Payload(
                body=body,
                shape=x.shape,
                dtype=x.dtype,
                fmt=FMT_CHUNK_Q2,
                vdtype=torch.float32,
                parsed=(idx, sent),
            )
        vdtype = self._value_dtype(gdtype)
        sent = saturating_cast(vals, vdtype) if vdtype != vals.dtype else vals
        if itemsize(vdtype) == itemsize(gdtype) and vdtype != gdtype:  # bf16 values of a float16 gradient
            sent = _within_range(sent, gdtype)
        body = torch.cat([positions, as_bytes(sent)])
        return Payload(body=body, shape=x.shape, dtype=x.dtype, fmt=FMT_CHUNK, vdtype=vdtype, parsed=(idx, sent))

    # -- decode --------------------------------------------------------------------------------
    def check_frame(self, payload: Payload) -> None:
        self._parse(payload)

    def _parse(self, payload: Payload):
        """``(positions, values)`` of a sparse frame (None for DENSE), after every check."""
        if payload.checked:
            return payload.parsed
        n = payload.numel
        count = self.count(payload.shape)
        gdtype = payload.grad_dtype or self._sender_dtype(payload, n, count)
        body = payload.body
        if n == 0 or self._dense(n, count, gdtype):
            if payload.fmt != FMT_DENSE:
                raise FrameError("format", f"ChunkTopK sends a tensor of {n} elements DENSE, got format {payload.fmt}")
            if payload.vdtype != gdtype or body.numel() != n * itemsize(gdtype):
                raise FrameError("length", f"DENSE frame of {body.numel()} bytes for {n} elements of {gdtype}")
            if payload.scale:
                raise FrameError("scale", "ChunkTopK's frames carry no scale")
            return None
        want = FMT_CHUNK_Q2 if self.values == "q2" else FMT_CHUNK
        if payload.fmt != want:
            raise FrameError("format", f"ChunkTopK({self.values=}) writes format {want}, got {payload.fmt}")
        vdtype = self._value_dtype(gdtype)
        if payload.vdtype != vdtype:
            raise FrameError("value dtype", f"ChunkTopK writes values in {vdtype}, got {payload.vdtype}")
        if payload.scale:
            raise FrameError("scale", "ChunkTopK's frames carry no scale")
        if body.numel() != self._sparse_nbytes(n, count, vdtype):
            raise FrameError("length", f"a ChunkTopK frame of {count} positions in {n} is not {body.numel()} bytes")
        ef = ef_nbytes(n, count)
        idx, _ = unpack_ef(body[:ef], n, 0)
        if idx.numel() != count:
            raise FrameError("body.count", f"{idx.numel()} positions where the shape sends {count}")
        rows, cols, tr, tc, per = chunk_plan(payload.shape, self.k, self.chunk)
        tile = (idx // cols // tr) * (cols // tc) + (idx % cols) // tc
        per_tile = torch.bincount(tile, minlength=(rows // tr) * (cols // tc))
        rest = body[ef:]
        if self.values == "q2":
            clen = (2 * count + 7) // 8
            codes = K.unpack_uint(rest[:clen], count, 2)
            cent = rest[clen:].clone().view(torch.float32)
            pad = (rest[clen - 1] >> ((2 * count) % 8)).long() if (2 * count) % 8 else per_tile.new_zeros(())
            neg, pos = cent[:2], cent[2:]
            stats = torch.stack(
                [
                    (per_tile != per).any().long(),
                    pad,
                    (~torch.isfinite(cent)).any().long(),
                    ((neg > 0).any() | (pos < 0).any()).long(),
                ]
            ).tolist()
            values = cent[codes]
        else:
            values = rest.clone().view(vdtype)
            cent = None
            stats = torch.stack(
                [(per_tile != per).any().long(), per_tile.new_zeros(()), (~torch.isfinite(values)).any().long()]
            ).tolist() + [0]
        bad_tiles, bad_pad, bad_values, bad_sides = stats
        if bad_tiles:
            raise FrameError("body.indices", f"a tile holds other than its {per} positions")
        if bad_pad:
            raise FrameError("body.padding", "nonzero padding bits after the 2-bit codes")
        if bad_values:
            raise FrameError("body.values", "a value or centroid is not finite")
        if bad_sides:
            raise FrameError("body.values", "a centroid lies on the other side of zero than its codes")
        payload.parsed = (idx, values)
        payload.checked = True
        return payload.parsed

    def _sender_dtype(self, payload: Payload, n: int, count: int) -> torch.dtype:
        """The gradient dtype of a frame whose receiver does not know it (no protocol checked it):
        the tensor's, or, for a compensated input wider than its gradient, a narrower float the
        frame's values are in, whichever makes the frame one this codec writes (DENSE frames
        carry the gradient's dtype)."""
        v = payload.vdtype
        if payload.fmt == FMT_DENSE and v is not None and v.is_floating_point:
            return v
        narrower = v is not None and v.is_floating_point and itemsize(v) < itemsize(payload.dtype)
        if self.values is None and narrower:
            return v  # values travel in the gradient's dtype
        if narrower and not self._dense(n, count, v) and self._dense(n, count, payload.dtype):
            return v
        return payload.dtype

    def decompress(self, payload: Payload) -> torch.Tensor:
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=payload.body.device)
        self.accumulate(payload, out)
        return out.reshape(payload.shape)

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        parsed = self._parse(payload)
        if parsed is None:
            out.add_(payload.body.clone().view(payload.vdtype).to(out.dtype))
            return
        idx, values = parsed
        out.index_add_(0, idx, values.to(out.dtype))

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        parsed = self._parse(payload)
        flat = v.view(-1)
        if parsed is None:
            flat.sub_(payload.body.clone().view(payload.vdtype).to(flat.dtype))
            return
        idx, values = parsed
        flat.index_add_(0, idx, values.to(flat.dtype), alpha=-1)

    def sent_mask(self, payload: Payload, n: int) -> torch.Tensor:
        parsed = self._parse(payload)
        mask = torch.ones(n, dtype=torch.bool, device=payload.body.device)
        if parsed is not None:
            mask.zero_()
            mask[parsed[0]] = True
        return mask


def _within_range(sent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sent`` with every magnitude above ``dtype``'s largest finite value lowered to the largest
    value of ``sent``'s dtype that is not (bfloat16 rounds float16's 65504 up to 65536, which a
    float16 gradient cannot hold): error feedback keeps the difference."""
    top = torch.tensor(torch.finfo(dtype).max, dtype=torch.float64)
    lim = top.to(sent.dtype)
    if float(lim) > float(top):
        lim = torch.nextafter(lim, torch.zeros_like(lim))
    lim = lim.to(sent.device)
    return torch.where(sent.abs() > lim, torch.copysign(lim, sent), sent)


def quantize2(vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, centroids)`` of the kept values: code 0 below ``-tau``, 1 in ``[-tau, 0)``, 2 in
    ``[0, tau)``, 3 from ``tau`` (``tau`` the mean magnitude), each centroid the mean of its
    values (float32; 0 for a code no value took)."""
    v = vals.to(torch.float64)
    tau = v.abs().mean()
    codes = torch.where(v < 0, (v >= -tau).long(), 2 + (v >= tau).long())
    sums = torch.zeros(_CENTROIDS, dtype=torch.float64, device=v.device).index_add_(0, codes, v)
    counts = torch.bincount(codes, minlength=_CENTROIDS).to(torch.float64)
    cent = torch.where(counts > 0, sums / counts.clamp_min(1), torch.zeros_like(sums)).to(torch.float32)
    # a centroid rounded to float32 stays on its side of zero (the checks hold the encoder to it)
    cent[:2] = cent[:2].clamp_max(0)
    cent[2:] = cent[2:].clamp_min(0)
    return codes, cent
