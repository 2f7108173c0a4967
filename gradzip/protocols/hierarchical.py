"""``Hierarchical(inner, local_size=L)``: reduce inside a node uncompressed, compress across nodes.

With ``N`` ranks on ``N / L`` nodes of ``L`` ranks each (rank ``r`` on node ``r // L`` as
local rank ``r % L``, as torchrun numbers them), one call runs:

1. **Inside the node**, an allreduce (SUM) of the call's gradients over the node's ``L``
   ranks, uncompressed: the node's sum ``S``.
2. **Across nodes**, local rank ``l`` of every node takes piece ``l`` of each tensor of
   ``S / L`` (the node's mean; pieces as ``TwoPhase`` cuts them) and runs ``inner``'s
   protocol on it with the local rank ``l`` of the other nodes: ``L`` groups of ``N / L``
   ranks, each on ``1 / L`` of the bytes, compressed, with error feedback keyed by the
   piece (``name@l/L``). Their average over the nodes is piece ``l`` of the average
   over all ranks.
3. **Inside the node**, an all-gather of the pieces: every rank holds the whole average.

Only step 2 crosses nodes, so the slow inter-node links carry ``1 / L`` of the
compressed call per rank; steps 1 and 3 use the fast links inside a node (booked as
``bytes_link_intra``). The process groups (one per node and one per local rank) are
created on the first call, identically on every rank. ``local_size`` defaults to the
``LOCAL_WORLD_SIZE`` that torchrun sets.
"""

from __future__ import annotations

import os
import weakref

import torch

import gradzip.args as args

from ..codecs.base import Codec
from ..comm import Round
from ..wire import accum_dtype, narrow
from .base import Call, Exchange, Protocol, as_protocol, nested
from .twophase import piece_bounds

__all__ = ["Hierarchical", "shard_key"]


def node_size_arg(local_size: int | None) -> int | None:
    """A node-size argument: ``local_size`` as given, else ``$LOCAL_WORLD_SIZE`` (torchrun
    sets it), else None; an integer >= 1 (``ValueError`` otherwise)."""
    if local_size is None and os.environ.get("LOCAL_WORLD_SIZE"):
        local_size = int(os.environ["LOCAL_WORLD_SIZE"])
    return args.optional(args.integer, "local_size", local_size, 1)


def whole_nodes(who: str, local_size: int | None, world: int) -> int:
    """Ranks per node at ``world`` ranks: ``local_size`` capped at ``world`` (fewer ranks than a
    node holds: one node); ``ValueError`` naming ``who`` without one, or where ``world`` is not
    whole nodes."""
    if local_size is None:
        raise ValueError(f"{who} needs local_size (or LOCAL_WORLD_SIZE, as torchrun sets it)")
    L = min(local_size, world)
    if world % L:
        raise ValueError(f"{who}: {world} ranks are not whole nodes of local_size={L}")
    return L


def node_groups(cache: weakref.WeakKeyDictionary, comm, L: int):
    """``(node, across)``: ``comm`` split into nodes of ``L`` ranks, once per communicator."""
    if comm not in cache:
        cache[comm] = comm.split(L)
    return cache[comm]


def shard_key(name: str, local: int, local_size: int) -> str:
    return f"{name}@{local}/{local_size}"


class Hierarchical(Protocol):
    """An uncompressed allreduce inside each node, ``inner`` across the nodes on
    ``1/local_size`` of the call per rank, then an all-gather inside the node.

    Args:
        inner: the codec or protocol across nodes (not ``Hierarchical``).
        local_size: ranks per node; default ``$LOCAL_WORLD_SIZE`` (torchrun sets it),
            capped at the world size.
    """

    def __init__(self, inner, *, local_size: int | None = None) -> None:
        if not isinstance(inner, (Codec, Protocol)) or isinstance(inner, Hierarchical):
            raise TypeError(f"inner must be a gradzip codec or protocol (not Hierarchical), got {type(inner).__name__}")
        self.inner = inner
        self.local_size = node_size_arg(local_size)
        self._comms = weakref.WeakKeyDictionary()  # the call's communicator -> (node, cross)

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.inner.biased

    @classmethod
    def spec_defaults(cls, kwargs: dict, context: dict) -> dict:
        """In a method spec, the tool's node size (``gradzip plan --local-size``) unless given."""
        return {"local_size": context["local_size"]} if context.get("local_size") else {}

    def check_names(self, names) -> None:
        as_protocol(self.inner).check_names(names)

    def _setup(self, call: Call):
        L = whole_nodes("Hierarchical", self.local_size, call.world_size)
        node, across = node_groups(self._comms, call.comm, L)
        return L, call.rank % L, node, across

    @staticmethod
    def _frozen(call: Call, pieces: list, local: int, L: int) -> frozenset:
        """The shards the inner call leaves the error feedback of alone: those of a tensor this
        rank found unused (``Call.frozen``) whose piece of the node's mean is all zeros (no rank
        of the node used it). The inner protocol then sends them as zeros and keeps their
        residuals, as a flat call keeps an unused tensor's: spent on a step where no rank used
        the parameter, they would be lost with the average DDP drops. One host read."""
        idx = [i for i, n in enumerate(call.names) if n in call.frozen] if call.memory is not None else []
        if not idx:
            return frozenset()
        used = torch.stack([pieces[i].any() for i in idx]).tolist()
        return frozenset(shard_key(call.names[i], local, L) for i, u in zip(idx, used) if not u)

    def exchange(self, call: Call) -> Exchange:
        L, local, node, across = self._setup(call)
        count = len(call.tensors)
        acc_dtype = accum_dtype(call.out_dtype)
        with call.codec():
            flat = (
                torch.cat([t.reshape(-1).to(acc_dtype) for t in call.tensors])
                if count
                else torch.empty(0, dtype=acc_dtype, device=call.device)
            )
            call.comm.stats.add(bytes_payload=flat.numel() * flat.element_size())
        yield Round([node.allreduce(flat)])  # the node's sum, uncompressed
        with call.codec():
            flat.div_(L)  # the node's mean
            bounds = [piece_bounds(t.numel(), L) for t in call.tensors]
            pieces = [
                flat[call.offsets[i] + bounds[i][local] : call.offsets[i] + bounds[i][local + 1]] for i in range(count)
            ]
            sub = Call(
                comm=across,
                names=[shard_key(n, local, L) for n in call.names],
                tensors=pieces,
                contexts=[call.context(shard_key(n, local, L), t.dtype) for n, t in zip(call.names, call.tensors)],
                memory=call.memory,
                out_dtype=acc_dtype,
                make_context=call.make_context,
            )
            sub.updated = call.updated
            sub.bytes_only = call.bytes_only
            sub.frozen = self._frozen(call, pieces, local, L)
        inner = as_protocol(self.inner, across.world_size, feedback=call.memory is not None)
        got = yield from nested(inner.exchange(sub), sub)
        with call.codec():
            widths = [max((b[j + 1] - b[j]) for j in range(L)) for b in bounds]  # the widest piece of each tensor
            mine = torch.zeros(sum(widths), dtype=acc_dtype, device=call.device)
            pos = 0
            for i in range(count):
                k = bounds[i][local + 1] - bounds[i][local]
                mine[pos : pos + k] = got[sub.slice(i)]
                pos += widths[i]
            gathered = torch.empty(L * mine.numel(), dtype=acc_dtype, device=call.device)
        yield Round([node.allgather(gathered, mine)], last=True)
        with call.codec():
            out = call.output()
            rows = gathered.view(L, -1)
            for i in range(count):
                start = sum(widths[:i])
                for j in range(L):
                    a, b = bounds[i][j], bounds[i][j + 1]
                    out[call.offsets[i] + a : call.offsets[i] + b] = narrow(
                        rows[j, start : start + b - a], call.out_dtype
                    )
        return out
