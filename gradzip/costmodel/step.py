"""The cost of one data-parallel training step: ``compute + codec + wire``.

* **compute**: the forward and backward pass of one step on one rank, in seconds.
  An input (measured by the user); the model does not estimate it.
* **codec**: gradzip's own seconds outside the collectives, from a
  :class:`~gradzip.costmodel.profile.CodecProfile`.
* **wire**: the step's collectives from dry runs of the method on the model's DDP
  buckets, each costed by :mod:`gradzip.costmodel.link`.

Plain DDP (``method=None``) is one allreduce of each bucket's gradients and no
codec. gradzip methods add the engine's non-finite flag allreduce per bucket
(:data:`gradzip.comm.FLAG_BYTES`; none where the protocol sums every tensor as it
is, or carries the flag in its own first round, as PowerSGD does); the first step's
configuration check is left out (it happens once).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

import gradzip.args as args

from ..comm import FLAG_BYTES
from ..protocols.base import Protocol, as_protocol
from ..protocols.parallel import aligned_starts
from .dryrun import dry_run
from .link import Collective, Link, check_world, wire_time
from .profile import CodecProfile, sample, settled_stores

__all__ = ["ddp_buckets", "StepCost", "WireCache", "step_cost"]


def ddp_buckets(nbytes: Sequence[int], bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0) -> list[list[int]]:
    """DDP's bucket assignment by size: indices grouped in reverse parameter order.

    Gradients are ready roughly in reverse order of the parameters, so DDP fills
    buckets from the last parameter. A tensor joins the open bucket; the bucket
    closes once it holds at least its cap (the first bucket's cap is
    ``first_bucket_mb``, torch's ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB).
    """
    for name, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        args.number(name, v, 0.0, lo_open=True)
    caps = [first_bucket_mb * 2**20, bucket_cap_mb * 2**20]
    buckets, cur, size = [], [], 0
    for i in reversed(range(len(nbytes))):
        cur.append(i)
        size += nbytes[i]
        if size >= caps[min(len(buckets), 1)]:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


@dataclass
class StepCost:
    method: str
    world: int
    compute_s: float
    codec_s: float
    wire_s: float
    bytes_per_rank: int
    collectives: int
    buckets: int
    detail: dict = field(default_factory=dict)
    #: Backward overlapped with the wire, as DDP does: ``max(compute, wire) + codec``
    #: (the codec part, gradzip's own work around the collectives, is not hidden).
    overlap: bool = False

    @property
    def total_s(self) -> float:
        if self.overlap:
            return max(self.compute_s, self.wire_s) + self.codec_s
        return self.compute_s + self.codec_s + self.wire_s

    @property
    def efficiency(self) -> float:
        """Weak-scaling efficiency: one rank's step (compute only) over this step."""
        return self.compute_s / self.total_s if self.total_s > 0 else 1.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(total_s=self.total_s, efficiency=self.efficiency)
        return d


#: Elements of each stand-in tensor a stateful codec settles on before a bucket's dry run.
_SETTLE_NUMEL = 4096


class WireCache:
    """Collective logs of dry runs, keyed by (compressor, error feedback, shapes, dtype, world,
    whether the engine's flag is offered to the protocol).

    With ``probe_worlds=(a, b)``, a bucket is dry-run at both ``a`` and ``b`` first;
    if the two logs are equal, the bytes are taken not to depend on the world size
    and the log is reused for every world size (a method whose bytes do depend on
    it, such as ``Int8(allreduce=True)``, gets a dry run per world size).
    """

    def __init__(self, probe_worlds: tuple[int, int] | None = None) -> None:
        self.probe_worlds = probe_worlds
        self._logs: dict = {}
        self._invariant: dict = {}
        self._stateful: set = set()
        self.dry_runs = 0

    def _run(self, comp, shapes, dtype, world, ef, seed, flag) -> tuple:
        key = (CodecProfile.key(comp, ef), shapes, str(dtype), world, flag)
        if key not in self._logs:
            xs = [sample(s, dtype, seed=seed + j) for j, s in enumerate(shapes)]
            names = [f"p{seed + j}" for j in range(len(shapes))]
            kw = dict(world_size=world, names=names, error_feedback=ef, decode=False, flag=flag)
            # Dry-run as it is first: a codec that keeps no per-tensor state (most of them) is then
            # done, with the run a settling would have ended in (no state, step 0), at the cost of
            # one run instead of two (at 1024 ranks a run is a few seconds of pieces, settled or not).
            # Once a call kept state at one world size it is settled at the others without that run.
            stateful = key[:3] + (flag,)  # the key less its world size: call()'s `base`
            run = None
            if stateful not in self._stateful:
                stores: dict = {}
                run = dry_run(comp, xs, stores=stores, **kw)
                if any(stores.values()):
                    self._stateful.add(stateful)
            if stateful in self._stateful:
                # A stateful codec (adaptive Threshold's tau) is dry-run in its settled state: the
                # same names first run on small stand-ins (its first step's tau sends nearly everything).
                small = [
                    sample((min(math.prod(s), _SETTLE_NUMEL),), dtype, seed=seed + j) for j, s in enumerate(shapes)
                ]
                settled, step = settled_stores(
                    comp, small, names=names, world=world, error_feedback=ef, decode=False, flag=flag
                )
                if settled is not None or run is None:
                    run = dry_run(comp, xs, stores=settled, step=step, **kw)
            self._logs[key] = (run.collectives, run.plain, run.flag_carried)
            self.dry_runs += 1
        return self._logs[key]

    def collectives(
        self, comp, shapes, world, *, error_feedback=None, dtype=torch.float32, seed: int = 0, flag: bool = True
    ) -> list:
        """The collectives of a call of ``comp`` on ``shapes`` among ``world`` ranks."""
        return self.call(comp, shapes, world, error_feedback=error_feedback, dtype=dtype, seed=seed, flag=flag)[0]

    def call(
        self, comp, shapes, world, *, error_feedback=None, dtype=torch.float32, seed: int = 0, flag: bool = True
    ) -> tuple:
        """``(collectives, plain, carried)`` of a call of ``comp`` on ``shapes`` among ``world``
        ranks; ``plain``: every tensor summed as it is (``DryRun.plain``: the engine sends no
        flag); ``carried``: the protocol carried the engine's flag in its first round
        (``DryRun.flag_carried``). ``flag``: the flag is offered to it (as the engine offers it
        to its call's protocol, and a ``Policy`` to the routes that start in its first round)."""
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        ef = comp.biased if error_feedback is None else bool(error_feedback)
        if self.probe_worlds is None or world == 1:
            return self._run(comp, shapes, dtype, world, ef, seed, flag)
        base = (CodecProfile.key(comp, ef), shapes, str(dtype), flag)
        if base not in self._invariant:
            a, b = self.probe_worlds
            self._invariant[base] = self._run(comp, shapes, dtype, a, ef, seed, flag) == self._run(
                comp, shapes, dtype, b, ef, seed, flag
            )
        if self._invariant[base]:
            return self._run(comp, shapes, dtype, self.probe_worlds[0], ef, seed, flag)
        return self._run(comp, shapes, dtype, world, ef, seed, flag)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def step_cost(
    method,
    layers: Sequence[tuple[str, tuple]],
    world: int,
    link: Link,
    compute_s: float,
    profile: CodecProfile | None = None,
    *,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    dtype: torch.dtype = torch.float32,
    cache: WireCache | None = None,
    label: str | None = None,
    local_size: int = 1,
    intra: Link | None = None,
    overlap: bool = False,
) -> StepCost:
    """Predict one step of data-parallel training of ``layers`` (``[(name, shape)]``).

    ``method=None`` is plain DDP. A protocol that routes tensors to other methods (a
    ``Policy``) is costed per bucket by its partition (``Protocol.routes``): each
    route's collectives come from a dry run of the route on its tensors, each tensor's
    codec from the route's fit, with error feedback as the route runs. A bucket whose
    protocol sums every tensor as it is (``DryRun.plain``), or whose protocol carries the
    flag in its own first round (``DryRun.flag_carried``), sends no engine flag. On one
    rank the step is ``compute_s`` alone.

    ``local_size``: ranks per node, which share one ``link`` (their NIC); ``intra``: the
    link between the ranks of a node (see :func:`~gradzip.costmodel.link.wire_time`).
    ``overlap``: the wire runs under the backward pass (:attr:`StepCost.overlap`).
    """
    check_world(world)
    compute_s = args.number("compute_s", compute_s, 0.0)
    name = label or ("DDP" if method is None else repr(method))
    layers = [(n, tuple(int(d) for d in s)) for n, s in layers]
    buckets = ddp_buckets([_nbytes(s, dtype) for _, s in layers], bucket_cap_mb, first_bucket_mb)
    if world == 1:
        return StepCost(name, 1, float(compute_s), 0.0, 0.0, 0, 0, len(buckets), overlap=overlap)
    cache = cache if cache is not None else WireCache()
    profile = profile if profile is not None else CodecProfile()
    colls: list[Collective] = []
    codec = 0.0
    groups_used: dict[str, int] = {}
    for b in buckets:
        if method is None:
            colls.append(Collective("allreduce", sum(_nbytes(layers[i][1], dtype) for i in b)))
            continue
        if isinstance(method, Protocol):
            groups = [(m, [b[j] for j in idx], ef) for m, idx, ef in method.routes([layers[i] for i in b], world)]
        else:
            groups = [(method, b, method.biased)]
        plain, carried = True, False
        protocols = [as_protocol(comp, world, feedback=ef) for comp, _, ef in groups]  # at this world size
        # The routes run side by side, aligned to end together (gradzip.protocols.parallel): the
        # first of those that start at once to take the engine's flag carries it for the call.
        starts = aligned_starts(protocols) if len(protocols) > 1 else [0]
        for comp, (_, idx, ef), start in zip(protocols, groups, starts):
            groups_used[repr(comp)] = groups_used.get(repr(comp), 0) + len(idx)
            got, alone, took = cache.call(
                comp,
                [layers[i][1] for i in idx],
                world,
                error_feedback=ef,
                dtype=dtype,
                seed=idx[0],
                flag=not carried and start == 0,
            )
            colls += got
            plain = plain and alone
            carried = carried or took
            fit = profile.fit(comp, ef)
            sizes = [math.prod(layers[i][1]) for i in idx]
            codec += fit.seconds(sum(sizes), world) if comp.flat else sum(fit.seconds(n, world) for n in sizes)
        if not (plain or carried):  # the engine's flag (none for a bucket summed as it is; see gradzip.engine)
            colls.append(Collective("allreduce", FLAG_BYTES, control=True))
    wire = wire_time(colls, world, link, local_size=min(local_size, world), intra=intra)
    detail = {"tensors_per_method": groups_used} if len(groups_used) > 1 else {}
    return StepCost(
        name,
        world,
        float(compute_s),
        codec,
        wire,
        sum(c.nbytes for c in colls),
        len(colls),
        len(buckets),
        detail,
        overlap=bool(overlap),
    )
