"""``ReduceScatter(codec)``: a compressed reduce-scatter; each rank gets only its own pieces.

Every tensor of the call is split into ``N`` pieces (``N`` the world size; piece ``j``
holds elements ``[j * n // N, (j + 1) * n // N)``, as in :class:`TwoPhase`), and rank
``j`` receives the average over the ranks of piece ``j`` of every tensor. This is phase 1
of :class:`~gradzip.protocols.twophase.TwoPhase` (:func:`reduce_scatter_pieces`): each
rank encodes every piece of ``gradient + residual`` with the codec, keeps what was not
sent in its residual (keyed by the tensor's name: one residual per tensor, shaped like
it, holding this rank's error towards every owner), and sends owner ``j`` the frames of
its pieces ``j`` by a pairwise all-to-all (message lengths first). The owner decodes
every sender's frames in rank order into float32 (float64 for float64 gradients) and
divides by ``N``. No second phase: nothing is re-encoded and nothing is gathered.

The result is **not** the average of the whole call: it is this rank's pieces, back to
back in tensor order (``sum_i (b_i[r+1] - b_i[r])`` elements), written into ``dest``
when it fits. Front ends that shard their results (``gradzip.fsdp``, FSDP2's
reduce-scatter) use it; DDP-style front ends must not.

Link bytes per rank: the compressed pieces addressed to the other ranks, about
``(N-1)/N`` of the compressed size of the call, against ``(N-1)/N`` of the raw bytes for
a plain reduce-scatter (:meth:`link_raw`).

Mass: with sender residuals ``r`` (gradient units), every step keeps
``N * owned' + sum_ranks r' == sum_ranks (g + r)`` piece by piece, up to float rounding:
the pending update of owner ``j``'s piece is ``sum_ranks r[piece j] / N``.
"""

from __future__ import annotations

import torch

from ..codecs.base import Codec
from ..wire import accum_dtype, narrow
from .base import Call, Exchange, Protocol
from .twophase import piece_bounds, reduce_scatter_pieces

__all__ = ["ReduceScatter"]


def _framable(codec: Codec) -> bool:
    """Whether the codec's payloads decode from their frames alone (random-k's indices are
    never sent: only an allreduce of its values carries it)."""
    framable = getattr(codec, "framable", None)
    if framable is not None:
        return bool(framable)
    return type(codec).__name__ != "RandomK"


class ReduceScatter(Protocol):
    @property
    def rounds(self) -> int:  # type: ignore[override]
        return 1 if self.codec.fixed_frames else 2

    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec) or not _framable(codec):
            raise ValueError(
                f"ReduceScatter needs a gradzip codec whose payloads travel in frames (Int8(), TopK(0.01), "
                f"Identity(), ...), got {codec!r}"
            )
        if codec.average != "ranks":
            raise ValueError(f"ReduceScatter averages over the world size: {codec!r} needs AllGather")
        if codec.scope == "call":
            raise ValueError(
                f"ReduceScatter cuts every tensor into pieces that their owners encode again, so {codec!r} cannot "
                f"choose over the whole call: use AllGather({codec!r}), or scope='tensor'"
            )
        self.codec = codec

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.codec.biased

    def link_raw(self, nbytes: int, world: int) -> float:
        """A plain reduce-scatter sends ``(N-1)/N`` of its input (pairwise or ring)."""
        return (world - 1) / world * nbytes if world > 1 else 0.0

    def routes(self, layers, world: int) -> list:
        raise NotImplementedError("ReduceScatter returns one rank's pieces; the cost model prices full averages")

    def exchange(self, call: Call) -> Exchange:
        world = call.world_size
        bounds = [piece_bounds(t.numel(), world) for t in call.tensors]
        owned = yield from reduce_scatter_pieces(call, self.codec, bounds)
        with call.codec():
            total = sum(o.numel() for o in owned)
            d = call.dest
            if d is not None and d.dtype == call.out_dtype and d.numel() == total and d.is_contiguous():
                out = d.view(-1)
            else:
                out = torch.empty(total, dtype=call.out_dtype, device=call.device)
            acc_dtype = accum_dtype(call.out_dtype)
            pos = 0
            for o in owned:
                piece = out[pos : pos + o.numel()]
                piece.copy_(o if acc_dtype == call.out_dtype else narrow(o, out.dtype))
                pos += o.numel()
        return out
