"""The cost of one FSDP2 training step: three collectives per ``fully_shard`` unit.

FSDP2 shards every parameter over the ``N`` ranks (dim 0 padded to a multiple of ``N``), and
per parameter group (one ``fully_shard`` call: a transformer block, say) and step it runs

1. the **forward all-gather** of the group's shards over the ``N`` ranks;
2. the **backward all-gather**: over the ``N`` ranks again with ``reshard_after_forward=True``,
   none with ``False``, and over the ``L`` ranks of a node with ``reshard_after_forward=L`` (a
   node-local secondary shard, ZeRO++'s hpZ: each rank keeps ``1/L`` of the group after the
   forward);
3. the **reduce-scatter** of the group's gradients over the ``N`` ranks.

Plain FSDP2 (``FSDP2``) costs them with the ring formulas (:mod:`.link`: all-gather ``(N-1)``
times the shard, reduce-scatter ``(N-1)/N`` of the gradient). Through ``gradzip.fsdp``
(``FSDP2(all_gather=Int8(block=256), reduce_scatter=Int8(), reshard_after_forward=2)``) the
compressed collectives are dry runs of the protocols ``gradzip.fsdp`` runs
(:class:`~gradzip.protocols.weight_gather.WeightGather` on the group's shards,
:class:`~gradzip.protocols.reduce_scatter.ReduceScatter` or, for ``Hierarchical(codec)``,
:class:`~gradzip.protocols.hierarchical_rs.HierarchicalReduceScatter` on its ``[N, padded]``
gradients), plus the engine's non-finite flag per reduce-scatter where the protocol does
not carry it in its first round (``ReduceScatter`` does); the backward all-gather of a
secondary shard is always plain (the forward's decoded weights). Codec seconds come from the
profile, per tensor, as for DDP buckets.

Which tensors form a group (:func:`fsdp_groups`): those whose names share the prefix up to the
first all-digit part (``h.3`` of ``h.3.attn.c_attn.weight``: a block of a ``ModuleList``), or
whose first part is ``layer<k>`` (``gradzip plan --params``' stand-in matrices, ResNet's
stages); every other tensor is the root's. ``overlap``: plain FSDP2 prefetches all-gathers and
overlaps the reduce-scatter with the backward (``max(compute, wire)``); gradzip's compressed
collectives run to completion inside FSDP's call (they wait on the host), so a method that
compresses any collective is costed ``compute + codec + wire``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import gradzip.args as args

from ..codecs.base import Codec
from ..comm import FLAG_BYTES
from ..protocols.hierarchical import Hierarchical
from ..protocols.hierarchical_rs import HierarchicalReduceScatter
from ..protocols.reduce_scatter import ReduceScatter
from ..protocols.weight_gather import WeightGather
from .link import Collective, Link, check_world, wire_time
from .profile import CodecProfile
from .step import StepCost, WireCache

__all__ = ["FSDPMethod", "fsdp_groups", "fsdp_step_cost"]

_BLOCK = re.compile(r"^\d+$")
_STAGE = re.compile(r"^layer\d+$")


@dataclass(frozen=True)
class FSDPMethod:
    """An FSDP2 step, plain or through ``gradzip.fsdp.compress`` (``FSDP2(...)`` in ``gradzip plan``).

    Args:
        reduce_scatter: a codec (``Int8()``), ``Hierarchical(codec, local_size=L)``, or None
            (FSDP2's own reduce-scatter).
        all_gather: ``Int8(block=...)``, ``FP16()``, ``BF16()``, ``Identity()`` or None (FSDP2's own).
        reshard_after_forward: ``True`` (FSDP2's default: the backward all-gathers again over
            every rank), ``False`` (no backward all-gather), or ``L`` (the node size: the
            backward all-gather runs inside the node).
    """

    reduce_scatter: object = None
    all_gather: object = None
    reshard_after_forward: bool | int = True

    def __post_init__(self) -> None:
        rs = self.reduce_scatter
        if (
            rs is not None
            and not isinstance(rs, Codec)
            and not (isinstance(rs, Hierarchical) and isinstance(rs.inner, Codec))
        ):
            raise ValueError(f"FSDP2: reduce_scatter takes a codec or Hierarchical(codec), got {rs!r}")
        if self.all_gather is not None:
            WeightGather(self.all_gather)  # refuses what the all-gather cannot carry
        raf = self.reshard_after_forward
        if not isinstance(raf, bool):
            args.integer("reshard_after_forward", raf, 1)

    @property
    def plain(self) -> bool:
        return self.reduce_scatter is None and self.all_gather is None

    def __repr__(self) -> str:
        parts = []
        if self.reduce_scatter is not None:
            parts.append(f"reduce_scatter={self.reduce_scatter!r}")
        if self.all_gather is not None:
            parts.append(f"all_gather={self.all_gather!r}")
        if self.reshard_after_forward is not True:
            parts.append(f"reshard_after_forward={self.reshard_after_forward!r}")
        return f"FSDP2({', '.join(parts)})"

    def rs_protocol(self, world: int):
        rs = self.reduce_scatter
        if rs is None:
            return None
        if isinstance(rs, Hierarchical):
            return HierarchicalReduceScatter(rs.inner, local_size=rs.local_size or 1)
        return ReduceScatter(rs)


def fsdp_groups(layers: Sequence[tuple[str, tuple]]) -> list[list[int]]:
    """The ``fully_shard`` units of ``layers`` (``[(name, shape)]``), as indices, in order of
    first appearance, the root's (the tensors of no block) last (module docstring)."""
    order: dict[str, list[int]] = {}
    root: list[int] = []
    for i, (name, _) in enumerate(layers):
        parts = name.split(".")
        key = None
        for k, part in enumerate(parts[:-1]):
            if _BLOCK.match(part):
                key = ".".join(parts[: k + 1])
                break
        if key is None and len(parts) > 1 and _STAGE.match(parts[0]):
            key = parts[0]
        if key is None:
            root.append(i)
        else:
            order.setdefault(key, []).append(i)
    return list(order.values()) + ([root] if root else [])


def _shard(shape: tuple, world: int) -> int:
    """Elements of one rank's dim-0 padded shard."""
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def fsdp_step_cost(
    method: FSDPMethod,
    layers: Sequence[tuple[str, tuple]],
    world: int,
    link: Link,
    compute_s: float,
    profile: CodecProfile | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    cache: WireCache | None = None,
    label: str | None = None,
    local_size: int = 1,
    intra: Link | None = None,
    overlap: bool = False,
) -> StepCost:
    """Predict one FSDP2 step of ``layers`` on ``world`` ranks (module docstring):
    ``compute + codec + wire`` (``max(compute, wire) + codec`` for plain FSDP2 with
    ``overlap``). ``local_size``, ``intra``: nodes of ``local_size`` ranks sharing ``link``, and
    the link inside a node (:func:`~gradzip.costmodel.link.wire_time`). ``detail`` gives the
    groups and, per collective kind, the bytes one rank hands over in a step."""
    check_world(world)
    compute_s = args.number("compute_s", compute_s, 0.0)
    name = label or repr(method)
    layers = [(n, tuple(int(d) for d in s)) for n, s in layers]
    groups = fsdp_groups(layers)
    if world == 1:
        return StepCost(name, 1, float(compute_s), 0.0, 0.0, 0, 0, len(groups), {"fsdp_groups": len(groups)})
    cache = cache if cache is not None else WireCache()
    profile = profile if profile is not None else CodecProfile()
    elem = torch.empty(0, dtype=dtype).element_size()
    raf = method.reshard_after_forward
    L = world if raf is True else (0 if raf is False else min(int(raf), world))
    if L and world % L:
        raise ValueError(f"FSDP2: reshard_after_forward={raf} does not divide {world} ranks")
    gather = WeightGather(method.all_gather) if method.all_gather is not None else None
    rs = method.rs_protocol(world)
    rs_ef = rs.biased if rs is not None else False
    colls: list[Collective] = []
    codec = 0.0
    by_kind = {"forward_all_gather": 0, "backward_all_gather": 0, "reduce_scatter": 0}
    node_scope = "intra" if local_size > 1 and L and L < world and local_size % L == 0 else "world"

    def add(kind: str, got: list) -> None:
        colls.extend(got)
        by_kind[kind] += sum(c.nbytes for c in got)

    for idx in groups:
        shards = [_shard(layers[i][1], world) for i in idx]
        seed = idx[0]
        # 1. the forward all-gather (and 2. the backward one over every rank)
        if gather is None:
            fwd = [Collective("allgather", sum(shards) * elem)]
        else:
            fwd = cache.collectives(gather, [(p,) for p in shards], world, error_feedback=False, dtype=dtype, seed=seed)
            codec += sum(profile.fit(gather, False).seconds(p, world) for p in shards)
        add("forward_all_gather", fwd)
        if L == world:
            add("backward_all_gather", fwd)
            if gather is not None:
                codec += sum(profile.fit(gather, False).seconds(p, world) for p in shards)
        elif L:  # the secondary shard (1/L of the group) gathered inside the node, as it is
            nbytes = sum(p * world // L for p in shards) * elem
            add("backward_all_gather", [Collective("allgather", nbytes, scope=node_scope, group=L)])
        # 3. the reduce-scatter
        if rs is None:
            add("reduce_scatter", [Collective("reducescatter", sum(world * p for p in shards) * elem)])
        else:
            got, alone, carried = cache.call(
                rs, [(world, p) for p in shards], world, error_feedback=rs_ef, dtype=dtype, seed=seed
            )
            flag = [] if alone or carried else [Collective("allreduce", FLAG_BYTES, control=True)]
            add("reduce_scatter", got + flag)
            codec += sum(profile.fit(rs, rs_ef).seconds(world * p, world) for p in shards)
    wire = wire_time(colls, world, link, local_size=min(local_size, world), intra=intra)
    detail = {"fsdp_groups": len(groups), "bytes_per_rank_by_collective": by_kind}
    return StepCost(
        name,
        world,
        float(compute_s),
        codec,
        wire,
        sum(c.nbytes for c in colls),
        len(colls),
        len(groups),
        detail,
        overlap=bool(overlap) and method.plain,
    )
