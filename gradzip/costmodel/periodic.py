"""The cost of a step of periodic averaging (local SGD, DiLoCo, Streaming DiLoCo).

Plain numbers in, no front end imported: ``gradzip plan`` reads them from the
method's spec (``LocalSGD.plan_terms``) and calls :func:`periodic_step_cost`.

The model's tensors, laid end to end in the order given, are cut into ``fragments``
runs of equal bytes, inside a tensor where a cut falls in it
(:func:`gradzip.schedules.split_fragments` at element granularity, as the front end
cuts them; a piece of a tensor is costed as a flat tensor of its elements). Each
fragment is one engine call per sync, every ``period`` steps: its collectives come
from a dry run of the method on the fragment's pieces as one call (not DDP
buckets), its codec seconds from the profile, as :func:`.step.step_cost` costs one
bucket. Per step, on average::

    codec = sum_f codec_f / period
    wire  = sum_f max(0, wire_f - delay * compute) / period
    step  = compute + codec + wire

A sync's wire time overlaps the ``delay`` inner steps it travels behind (``delay``
for streaming, ``period`` for ``overlap=True``, 0 for a blocking sync); the codec
runs on the host and is not hidden. The outer optimizer's step (a few elementwise
passes over the fragment every ``period`` steps) is left out. ``detail`` gives the
bytes of one sync of each fragment and the peak: the most bytes a rank sends in
one step (one fragment's, since fragments sync at different steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

import gradzip.args as args

from ..codecs.cast import Identity
from ..schedules import split_fragments
from .link import Link, check_world
from .profile import CodecProfile
from .step import StepCost, WireCache, step_cost

__all__ = ["periodic_step_cost", "fragment_layers"]


def fragment_layers(layers, fragments: int, elem: int = 4) -> list:
    """``layers`` (``[(name, shape)]``, in order) cut into ``fragments`` runs of equal bytes as
    the front end cuts them: per fragment ``[(name, shape)]``, a piece of a tensor as
    ``("name[start:stop]", (stop - start,))`` (elements of the flattened tensor)."""
    nbytes = [math.prod(s) * elem for _, s in layers]
    out = []
    for run in split_fragments(nbytes, fragments, granule=[elem] * len(layers)):
        pieces = []
        for i, a, b in run:
            name, shape = layers[i]
            whole = a == 0 and b == nbytes[i]
            pieces.append((name, shape) if whole else (f"{name}[{a // elem}:{b // elem}]", ((b - a) // elem,)))
        out.append(pieces)
    return out


def periodic_step_cost(
    method,
    layers: Sequence[tuple[str, tuple]],
    world: int,
    link: Link,
    compute_s: float,
    profile: CodecProfile | None = None,
    *,
    period: int,
    fragments: int = 1,
    delay: int = 0,
    dtype: torch.dtype = torch.float32,
    cache: WireCache | None = None,
    label: str | None = None,
) -> StepCost:
    """Predict one step (averaged over a period) of periodic averaging of ``layers``.

    ``method``: the codec or protocol the syncs run (``None``: ``Identity()``).
    ``period``: steps between two syncs of a fragment; ``fragments``: how many
    fragments sync in turn; ``delay``: steps of compute a sync's wire time may hide
    behind. ``bytes_per_rank`` and ``collectives`` are per step on average.
    """
    check_world(world)
    compute_s = args.number("compute_s", compute_s, 0.0)
    period = args.integer("period", period, 1)
    delay = args.integer("delay", delay, 0)
    method = Identity() if method is None else method
    name = label or repr(method)
    layers = [(n, tuple(int(d) for d in s)) for n, s in layers]
    elem = torch.empty(0, dtype=dtype).element_size()
    nbytes = [math.prod(s) * elem for _, s in layers]
    runs = fragment_layers(layers, fragments, elem)
    detail = {"period": period, "fragments": fragments, "delay": delay}
    if world == 1:
        return StepCost(name, 1, float(compute_s), 0.0, 0.0, 0, 0, fragments, detail)
    cache = cache if cache is not None else WireCache()
    one_call_mb = (sum(nbytes) + 1) / 2**20  # a cap no fragment reaches: the fragment is one call
    codec = wire = sent = colls = 0.0
    sync_bytes, sync_wire = [], []
    for run in runs:
        sc = step_cost(
            method,
            run,
            world,
            link,
            0.0,
            profile,
            bucket_cap_mb=one_call_mb,
            first_bucket_mb=one_call_mb,
            dtype=dtype,
            cache=cache,
            label=name,
        )
        codec += sc.codec_s
        wire += max(0.0, sc.wire_s - delay * compute_s)
        sent += sc.bytes_per_rank
        colls += sc.collectives
        sync_bytes.append(sc.bytes_per_rank)
        sync_wire.append(sc.wire_s)
    detail.update(sync_bytes=sync_bytes, sync_wire_s=sync_wire, peak_bytes_per_step=max(sync_bytes))
    return StepCost(
        name, world, float(compute_s), codec / period, wire / period, sent / period, colls / period, fragments, detail
    )
