"""``HierarchicalReduceScatter(codec, local_size=L)``: plain inside a node, compressed across nodes (qgZ).

A reduce-scatter for ``gradzip.fsdp`` (``gz.fsdp.compress(model,
reduce_scatter=gz.Hierarchical(gz.Int8(), local_size=L))``): as
:class:`~gradzip.protocols.reduce_scatter.ReduceScatter`, every tensor of the call is cut
into ``N`` pieces (``N`` the world size, piece ``j`` the elements ``[j * n // N, (j + 1) * n
// N)``: for FSDP's ``[N, padded]`` tensors, row ``j``) and rank ``j`` gets the average over
the ranks of piece ``j`` of every tensor, back to back. The ranks are numbered node by node
(torchrun's order): rank ``j`` is local rank ``j % L`` of node ``j // L``.

1. **Inside the node, uncompressed.** Local rank ``l'`` of the node receives from every
   local rank of its node the pieces ``m * L + l'`` (for every node ``m``) of every tensor
   (a pairwise all-to-all of the gradients in their own dtype: a textbook reduce-scatter,
   ``(L - 1) / L`` of the call per rank on the node's links, booked as
   ``bytes_link_intra``), and sums them in float32 in local-rank order, then divides by
   ``L``: the node's mean of the pieces its owners across the nodes will need.
2. **Across nodes, compressed.** Local rank ``l`` of every node runs ReduceScatter's
   exchange (:func:`~gradzip.protocols.twophase.reduce_scatter_pieces`) with the local
   ranks ``l`` of the other nodes on those node means: every tensor's ``N / L`` pieces
   ``m * L + l`` are one tensor (keyed ``name@l/L``, with its own error feedback), piece
   ``m`` of it goes to node ``m``. Rank ``j`` decodes the ``N / L`` nodes' frames in node
   order and divides by ``N / L``: the average over all ranks of its piece ``j``.

Only step 2 crosses nodes: about ``(N/L - 1) / (N/L)`` of ``1 / L`` of the compressed call
per rank, against ``(N - 1) / N`` of the whole call, uncompressed, for FSDP's reduce-scatter.

Mass: with residuals ``r`` of the node means (keyed ``name@l/L``, one row per node), owner
``j = m * L + l`` is still owed ``sum over nodes of r[row m] / (N / L)`` of the average.
"""

from __future__ import annotations

import weakref

import torch

from ..codecs.base import Codec
from ..comm import Round
from ..wire import accum_dtype, narrow
from .base import Call, Exchange, Protocol
from .hierarchical import node_groups, node_size_arg, shard_key, whole_nodes
from .reduce_scatter import ReduceScatter
from .twophase import piece_bounds, reduce_scatter_pieces

__all__ = ["HierarchicalReduceScatter"]


class HierarchicalReduceScatter(Protocol, register=False):
    """A reduce-scatter whose pieces are summed plainly inside each node and averaged
    across the nodes with ``codec`` (module docstring). The result is this rank's pieces,
    back to back, as :class:`~gradzip.protocols.reduce_scatter.ReduceScatter`'s.

    Args:
        codec: a framable codec (``Int8()``, ``TopK(0.01)``, ...), as ``ReduceScatter`` takes.
        local_size: ranks per node; default ``$LOCAL_WORLD_SIZE`` (torchrun sets it),
            capped at the world size.
    """

    @property
    def rounds(self) -> int:  # type: ignore[override]
        return 2 if self.codec.fixed_frames else 3

    def __init__(self, codec: Codec, *, local_size: int | None = None) -> None:
        ReduceScatter(codec)  # the same refusals (frames, scope="call")
        self.codec = codec
        self.local_size = node_size_arg(local_size)
        self._comms = weakref.WeakKeyDictionary()  # the call's communicator -> (node, cross)

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.codec.biased

    def link_raw(self, nbytes: int, world: int) -> float:
        """A plain reduce-scatter sends ``(N-1)/N`` of its input."""
        return (world - 1) / world * nbytes if world > 1 else 0.0

    def nodes(self, world: int) -> int:
        """Ranks per node at ``world`` ranks (``local_size`` capped at ``world``); raises where
        ``world`` is not whole nodes."""
        return whole_nodes("HierarchicalReduceScatter", self.local_size, world)

    def exchange(self, call: Call) -> Exchange:
        world, rank = call.world_size, call.rank
        L = self.nodes(world)
        nodes, local, me_node = world // L, rank % L, rank // L
        node, across = node_groups(self._comms, call.comm, L)
        count = len(call.tensors)
        acc_dtype = accum_dtype(call.out_dtype)
        bounds = [piece_bounds(t.numel(), world) for t in call.tensors]

        def size(i: int, j: int) -> int:
            return bounds[i][j + 1] - bounds[i][j]

        # What local rank l' of this node owns across the nodes: per tensor, pieces m * L + l'.
        owned_by = [[size(i, m * L + lp) for i in range(count) for m in range(nodes)] for lp in range(L)]
        with call.codec():
            same = count and all(t.dtype == call.tensors[0].dtype for t in call.tensors)
            wire = call.tensors[0].dtype if same else acc_dtype  # the gradients' own dtype inside the node
            flats = [t.reshape(-1) for t in call.tensors]
            send = (
                torch.cat(
                    [
                        flats[i][bounds[i][m * L + lp] : bounds[i][m * L + lp + 1]].to(wire)
                        for lp in range(L)
                        for i in range(count)
                        for m in range(nodes)
                    ]
                )
                if count
                else torch.empty(0, dtype=wire, device=call.device)
            )
            mine = sum(owned_by[local])
            call.comm.stats.add(bytes_payload=send.numel() * send.element_size())
        if L > 1:
            in_splits = [sum(sizes) for sizes in owned_by]
            recv = torch.empty(L * mine, dtype=wire, device=call.device)
            yield Round([node.alltoall(recv, send, [mine] * L, in_splits)])
        else:
            recv = send
        with call.codec():
            rows = recv.view(L, mine)
            sums = torch.zeros(mine, dtype=acc_dtype, device=call.device)
            for s in range(L):  # the node's ranks in local-rank order
                sums += rows[s]
            sums.div_(L)  # the node's mean
            keys = [shard_key(n, local, L) for n in call.names]
            cross, pos = [], 0
            for i in range(count):
                k = sum(size(i, m * L + local) for m in range(nodes))
                cross.append(sums[pos : pos + k])
                pos += k
            cross_bounds = [[0] for _ in range(count)]
            for i in range(count):
                for m in range(nodes):
                    cross_bounds[i].append(cross_bounds[i][-1] + size(i, m * L + local))
            sub = Call(
                comm=across,
                names=keys,
                tensors=cross,
                contexts=[call.context(k, t.dtype) for k, t in zip(keys, call.tensors)],
                memory=call.memory,
                out_dtype=acc_dtype,
                make_context=call.make_context,
            )
            sub.updated = call.updated
            sub.bytes_only = call.bytes_only
        owned = yield from reduce_scatter_pieces(sub, self.codec, cross_bounds)
        with call.codec():
            total = sum(size(i, rank) for i in range(count))
            d = call.dest
            if d is not None and d.dtype == call.out_dtype and d.numel() == total and d.is_contiguous():
                out = d.view(-1)
            else:
                out = torch.empty(total, dtype=call.out_dtype, device=call.device)
            pos = 0
            for i, o in enumerate(owned):
                if o.numel() != size(i, me_node * L + local):
                    raise RuntimeError(f"{call.names[i]}: {o.numel()} elements owned, expected {size(i, rank)}")
                out[pos : pos + o.numel()].copy_(o if acc_dtype == call.out_dtype else narrow(o, out.dtype))
                pos += o.numel()
        return out
