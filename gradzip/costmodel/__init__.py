"""The cost model: link formulas, dry runs, codec profiles, layer and step costs.

Bottom to top: :mod:`.link` (formulas), :mod:`.dryrun` (a protocol's real exchange
against a loopback communicator), :mod:`.profile` (codec seconds), :mod:`.layer`
(one tensor, for ``Policy(auto=True)``), :mod:`.step` (one training step, for
``gradzip plan``), :mod:`.periodic` (local SGD, DiLoCo) and :mod:`.fsdp` (an FSDP2 step: its
three collectives per ``fully_shard`` unit). Derivations: ``docs/costmodel.md``.
"""

from .dryrun import DryRun, LoopbackComm, dry_run
from .fsdp import FSDPMethod, fsdp_groups, fsdp_step_cost
from .layer import layer_cost
from .link import Collective, Link, allgather_time, allreduce_time, parse_bandwidth, parse_duration, wire_time
from .profile import CodecFit, CodecProfile, as_profile, measure_codec, sample, sample_shape
from .step import StepCost, WireCache, ddp_buckets, step_cost

__all__ = [
    "Link",
    "parse_bandwidth",
    "parse_duration",
    "allreduce_time",
    "allgather_time",
    "Collective",
    "wire_time",
    "LoopbackComm",
    "DryRun",
    "dry_run",
    "CodecFit",
    "CodecProfile",
    "measure_codec",
    "as_profile",
    "sample",
    "sample_shape",
    "layer_cost",
    "ddp_buckets",
    "StepCost",
    "WireCache",
    "step_cost",
    "FSDPMethod",
    "fsdp_groups",
    "fsdp_step_cost",
]
