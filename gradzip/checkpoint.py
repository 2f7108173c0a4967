"""Checkpoint helpers: move codec state between world sizes.

Each rank's ``state_dict()`` holds its own residuals. When a job restarts on a
different number of ranks (torchrun elastic), :func:`reshard` turns the N saved
states into M new ones:

* ``preserve="sum"`` (default): the total residual mass, the sum over ranks, is
  kept and spread evenly: every new rank gets ``sum / M``.
* ``preserve="update"``: the update that the residuals still owe the model,
  ``sum / N`` (gradients are averaged over ranks), is kept: every new rank gets
  ``sum / N``, so the M new ranks average to the same pending update.

Sums are taken in float64 and rounded once to the residual's dtype; with M a
power of two, ``preserve="sum"`` is then exact with respect to that rounded sum.
Codec state that must match across ranks (PowerSGD's Q, shared seeds) and
per-rank state (adaptive thresholds) are taken from old rank 0; the step counter
is the old ranks' common step.
"""
from __future__ import annotations

import torch

import gradzip.args as args


def reshard(states: list[dict], world_size: int, *, preserve: str = "sum") -> list[dict]:
    if not states:
        raise ValueError("states must hold at least one state_dict")
    world_size = args.integer("world_size", world_size, 1)
    args.choice("preserve", preserve, ("sum", "update"))
    first = states[0]
    for r, s in enumerate(states[1:], 1):
        for key in ("version", "method", "error_feedback", "step"):
            if s.get(key) != first.get(key):
                raise ValueError(f"state of rank {r} differs from rank 0 in {key!r}: {s.get(key)!r} vs {first.get(key)!r}")
        if set(s["residuals"]) != set(first["residuals"]):
            raise ValueError(f"rank {r} holds residuals for other tensors than rank 0")
    divisor = world_size if preserve == "sum" else len(states)
    residuals = {}
    for name, r0 in first["residuals"].items():
        total = sum(s["residuals"][name].to(torch.float64) for s in states)
        residuals[name] = (total / divisor).to(r0.dtype)
    out = []
    for _ in range(world_size):
        out.append(
            {
                "version": first["version"],
                "method": dict(first["method"]),
                "error_feedback": first["error_feedback"],
                "step": first["step"],
                "residuals": {k: v.clone() for k, v in residuals.items()},
                "tensor_state": {k: dict(v) for k, v in first["tensor_state"].items()},
                "stats": dict(first["stats"]),
            }
        )
    return out
