"""The cost of one tensor alone: codec (profile) plus wire (dry run), for ``Policy(auto=True)``."""

from __future__ import annotations

import torch

import gradzip.args as args

from .dryrun import dry_run
from .link import Link
from .profile import CodecProfile

__all__ = ["layer_cost"]


def layer_cost(
    comp,
    x: torch.Tensor,
    world: int,
    link: Link,
    profile: CodecProfile,
    *,
    error_feedback: bool | None = None,
    sample_is_compensated: bool = False,
    latency_share: float = 1.0,
) -> float:
    """Seconds to exchange one tensor ``x`` with ``comp`` on ``world`` ranks: codec + wire.

    The bytes come from a dry run of ``comp``'s exchange on ``x`` alone (``x`` is
    not modified). The tensors of a DDP bucket share their collectives, so the
    latency terms are charged in proportion: ``latency_share`` in [0, 1] (the
    tensor's part of its bucket; 1 for a tensor alone) multiplies the link's
    latency. With ``sample_is_compensated`` the tensor already holds gradient plus
    residual (the policy passes the real compensated gradient): the dry run then
    adds no error feedback of its own, while the codec time is still the profile's
    for ``error_feedback``.
    """
    latency_share = args.number("latency_share", latency_share, 0.0, 1.0)
    ef = comp.biased if error_feedback is None else bool(error_feedback)
    run = dry_run(
        comp, [x], world_size=world, error_feedback=False if sample_is_compensated else ef, decode=False, flag=False
    )
    shared = Link(link.bandwidth_bps, link.latency_s * latency_share)
    return profile.fit(comp, ef).seconds(x.numel(), world) + run.wire_time(world, shared)
