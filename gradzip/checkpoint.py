"""Checkpoint helpers: move codec state between world sizes.

Each rank's ``state_dict()`` holds its own residuals. When a job restarts on a
different number of ranks (torchrun elastic), :func:`reshard` turns the N saved
states into M new ones:

* ``preserve="sum"`` (default): the total residual mass, the sum over ranks, is
  kept and spread evenly: every new rank gets ``sum / M``.
* ``preserve="update"``: the update that the residuals still owe the model,
  ``sum / N`` (gradients are averaged over ranks), is kept: every new rank gets
  ``sum / N``, so the M new ranks average to the same pending update.

The owners' memories of the two-phase protocol (``TwoPhase``: one piece of each
tensor per rank, kept in the units of the average) are folded into the tensors'
residuals: the pieces of all old ranks make up the tensor's owner residual ``E``,
which is ``N * E`` in the units of a sum, so ``preserve="sum"`` spreads
``(sum + N * E) / M`` and ``preserve="update"`` gives every rank ``sum / N + E``.
The new ranks start with empty owner memories and send that mass in the first
phase of their next step; nothing is lost whichever protocol the new world size
picks.

Sums are taken in float64 and rounded once to the residual's dtype; with M a
power of two, ``preserve="sum"`` is then exact with respect to that rounded sum.
Codec state that must match across ranks (PowerSGD's Q, shared seeds) and
per-rank state (adaptive thresholds) are taken from old rank 0, except the state of
a protocol's pieces of a tensor, which belongs to an old world size and is dropped;
the step counter is the old ranks' common step. Momentum correction's buffers
(``state_dict()["momentum"]``) are averaged over the old ranks: every new rank
carries on with the old ranks' mean velocity.
"""
from __future__ import annotations

import re

import torch

import gradzip.args as args

__all__ = ["reshard"]

_PIECE = re.compile(r"^(?P<name>.*)#(?P<j>\d+)/(?P<n>\d+)(?P<owner>:owner)?$")


def reshard(states: list[dict], world_size: int, *, preserve: str = "sum") -> list[dict]:
    if not states:
        raise ValueError("states must hold at least one state_dict")
    world_size = args.integer("world_size", world_size, 1)
    args.choice("preserve", preserve, ("sum", "update"))
    first = states[0]
    old = len(states)
    for r, s in enumerate(states[1:], 1):
        for key in ("version", "method", "error_feedback", "step"):
            if s.get(key) != first.get(key):
                raise ValueError(f"state of rank {r} differs from rank 0 in {key!r}: {s.get(key)!r} vs {first.get(key)!r}")
        if set(_tensors(s["residuals"])) != set(_tensors(first["residuals"])):
            raise ValueError(f"rank {r} holds residuals for other tensors than rank 0")
    owners = _owner_residuals(states)
    residuals = {}
    for name in _tensors(first["residuals"]) | set(owners):
        like = first["residuals"].get(name)
        total = sum(s["residuals"][name].to(torch.float64) for s in states) if like is not None else 0.0
        e = owners.get(name)
        if preserve == "sum":
            value = (total + (old * e if e is not None else 0.0)) / world_size
        else:
            value = total / old + (e if e is not None else 0.0)
        dtype = like.dtype if like is not None else e.dtype
        shape = like.shape if like is not None else e.shape
        residuals[name] = torch.as_tensor(value, dtype=torch.float64).reshape(shape).to(dtype)
    tensor_state = {k: dict(v) for k, v in first["tensor_state"].items() if not _PIECE.match(k)}
    momentum = _momentum(states)
    return [
        {
            "version": first["version"],
            "method": dict(first["method"]),
            "error_feedback": first["error_feedback"],
            "step": first["step"],
            "residuals": {k: v.clone() for k, v in residuals.items()},
            "tensor_state": {k: dict(v) for k, v in tensor_state.items()},
            "stats": dict(first["stats"]),
            "momentum": {k: v.clone() for k, v in momentum.items()},
        }
        for _ in range(world_size)
    ]


def _momentum(states: list[dict]) -> dict:
    """Momentum correction's buffers (``state_dict()["momentum"]``), averaged over the old
    ranks (float64, rounded once): each rank's buffer is its own velocity, and the average
    velocity is what the applied update carries on with, whatever the new world size."""
    first = states[0].get("momentum") or {}
    for r, s in enumerate(states[1:], 1):
        if set(s.get("momentum") or {}) != set(first):
            raise ValueError(f"rank {r} holds momentum buffers for other tensors than rank 0")
    return {
        name: (sum(s["momentum"][name].to(torch.float64) for s in states) / len(states)).to(like.dtype)
        for name, like in first.items()
    }


def _tensors(residuals: dict) -> set:
    """The names of whole tensors' residuals (not a protocol's pieces)."""
    return {k for k in residuals if not _PIECE.match(k)}


def _owner_residuals(states: list[dict]) -> dict:
    """Every tensor's owner residual (float64, flat), assembled from the old ranks' pieces."""
    pieces: dict = {}
    for s in states:
        for key, t in s["residuals"].items():
            m = _PIECE.match(key)
            if m and m["owner"]:
                n = int(m["n"])
                if n != len(states):
                    raise ValueError(f"residual {key!r} belongs to {n} ranks, the states are of {len(states)}")
                pieces.setdefault(m["name"], {})[int(m["j"])] = t
    out = {}
    for name, parts in pieces.items():
        missing = sorted(set(range(len(states))) - set(parts))
        if missing:
            raise ValueError(f"the owner pieces {missing} of {name!r} are missing")
        out[name] = torch.cat([parts[j].reshape(-1).to(torch.float64) for j in range(len(states))])
    for s in states:  # the whole tensor's shape, where a rank holds its residual
        for name in out:
            like = s["residuals"].get(name)
            if like is not None:
                out[name] = out[name].view(like.shape)
    return out
