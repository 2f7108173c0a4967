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

Every engine state records the rank that saved it, the world size and the method
(``"rank"``, ``"world_size"``, ``"method_repr"``), and loading refuses another rank's
state, naming both ranks. :func:`save` and :func:`load` write and read one file per
rank (``gradzip_rank{r}_of_{N}.pt``, what every front end's ``save(dir)`` and
``load(dir)`` do); :func:`read_states` and :func:`write_states` move a whole
directory's states, e.g. through :func:`reshard`. :class:`PerRank` makes a front end's
state ``Stateful`` for ``torch.distributed.checkpoint`` (DCP), one entry per rank.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import torch

import gradzip.args as args

from .engine import STATE_VERSION

__all__ = ["reshard", "save", "load", "read_states", "write_states", "PerRank", "state_path"]

_PIECE = re.compile(r"^(?P<name>.*)#(?P<j>\d+)/(?P<n>\d+)(?P<owner>:owner)?$")


def reshard(states: list[dict], world_size: int, *, preserve: str = "sum") -> list[dict]:
    """``N`` ranks' engine states (``state_dict()`` of the DDP hook, or the ``"gradzip"``
    entry of an optimizer's), in rank order, to ``world_size`` new ones, new rank ``r``'s
    at index ``r``; see the module docstring for what is kept. A ``DistributedOptimizer``'s
    whole states are taken too (their engine states resharded, the wrapped optimizer's rank 0's);
    LocalSGD/DiLoCo states are refused, naming ``gradzip.local_sgd.reshard_state``.

    Args:
        states: every old rank's engine state, rank 0 first.
        world_size: the new number of ranks, an integer in [1, inf).
        preserve: ``"sum"`` (the residuals' total mass) or ``"update"`` (the update they
            still owe the model).
    """
    if not states:
        raise ValueError("states must hold at least one state_dict")
    world_size = args.integer("world_size", world_size, 1)
    args.choice("preserve", preserve, ("sum", "update"))
    if all(isinstance(s, dict) and "residuals" not in s and "gradzip" in s for s in states):
        if any("local_sgd" in s for s in states):
            raise ValueError(
                "these are LocalSGD/DiLoCo states (their global model and per-rank parts beside the engine's): "
                f"reshard them with gradzip.local_sgd.reshard_state(states, {world_size})"
            )
        # A DistributedOptimizer's: the wrapped optimizer's state is the same on every rank (it steps
        # on the average), so every new rank takes rank 0's, beside its own resharded engine state.
        engines = reshard([s["gradzip"] for s in states], world_size, preserve=preserve)
        return [{**{k: v for k, v in states[0].items() if k != "gradzip"}, "gradzip": e} for e in engines]
    if any("residuals" not in s for s in states):
        raise ValueError(
            "states must be engine states (a DDP hook's state_dict(), or the 'gradzip' entry of a front end's); "
            f"states[0] has the keys {sorted(states[0])[:8]}"
        )
    first = states[0]
    old = len(states)
    for r, s in enumerate(states):
        if s.get("version") != STATE_VERSION:
            raise ValueError(
                f"states[{r}] has gradzip state version {s.get('version')!r}, and this gradzip reads "
                f"{STATE_VERSION}: reshard it with the gradzip that saved it"
            )
        if int(s["rank"]) != r or int(s["world_size"]) != old:
            raise ValueError(
                f"states[{r}] was saved by rank {s['rank']} of {s.get('world_size')}: pass the {old} ranks' states "
                "in rank order, one per rank"
            )
    for r, s in enumerate(states[1:], 1):
        for key in ("version", "method", "error_feedback", "step"):
            if s.get(key) != first.get(key):
                raise ValueError(
                    f"state of rank {r} differs from rank 0 in {key!r}: {s.get(key)!r} vs {first.get(key)!r}"
                )
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
            "rank": r,
            "world_size": world_size,
            "method_repr": first.get("method_repr"),
            "method": dict(first["method"]),
            "error_feedback": first["error_feedback"],
            "error_decay": first["error_decay"],
            "step": first["step"],
            "residuals": {k: v.clone() for k, v in residuals.items()},
            "tensor_state": {k: dict(v) for k, v in tensor_state.items()},
            "stats": dict(first["stats"]),
            "momentum": {k: v.clone() for k, v in momentum.items()},
            "momentum_mode": first["momentum_mode"],
        }
        for r in range(world_size)
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


# -- one file per rank ----------------------------------------------------------------------
def _owner(obj) -> tuple[int, int]:
    """``(rank, world size)`` of a front end (anything with an ``engine``) or an engine."""
    engine = getattr(obj, "engine", obj)
    comm = getattr(engine, "comm", None)
    if comm is None:
        raise TypeError(f"{type(obj).__name__} is not a gradzip front end (no engine)")
    return comm.rank, comm.world_size


def state_path(directory, rank: int, world_size: int) -> Path:
    """The file of rank ``rank`` of ``world_size`` in ``directory``."""
    return Path(directory) / f"gradzip_rank{rank}_of_{world_size}.pt"


_FILE = re.compile(r"^gradzip_rank(\d+)_of_(\d+)\.pt$")


def _worlds(directory) -> dict[int, set[int]]:
    """``{world size: {ranks}}`` of the state files in ``directory``."""
    found: dict[int, set[int]] = {}
    for p in Path(directory).iterdir() if Path(directory).is_dir() else ():
        m = _FILE.match(p.name)
        if m:
            found.setdefault(int(m[2]), set()).add(int(m[1]))
    return found


def save(obj, directory) -> Path:
    """Write this rank's ``obj.state_dict()`` to its own file in ``directory`` (created if
    needed); returns the path. Call it on every rank (a ``LocalSGD`` with a push in flight
    issues that push's deferred rounds, as its ``state_dict()`` does).

    Args:
        obj: a front end: what ``register_hook`` returns, a ``DistributedOptimizer``, a
            ``LocalSGD``/``DiLoCo``, or an ``Engine``.
        directory: the checkpoint directory, shared by the ranks or not.
    """
    rank, world = _owner(obj)
    path = state_path(directory, rank, world)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj.state_dict(), tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous file whole
    return path


def load(obj, directory) -> None:
    """Load this rank's own file from ``directory`` into ``obj`` (see :func:`save`).

    Raises ``FileNotFoundError`` naming what the directory holds when this rank's file is
    missing (states of another world size: :func:`reshard` them first)."""
    rank, world = _owner(obj)
    path = state_path(directory, rank, world)
    if not path.exists():
        found = _worlds(directory)
        held = ", ".join(f"{len(r)} of {w} ranks" for w, r in sorted(found.items())) or "no gradzip states"
        periodic = any(c.__module__ == "gradzip.local_sgd" for c in type(obj).__mro__)  # LocalSGD, DiLoCo
        fn = "gradzip.local_sgd.reshard_state" if periodic else "gz.reshard"
        hint = (
            f"; turn them into {world} with gradzip.checkpoint.write_states({fn}(read_states(dir), {world}), dir)"
            if found and world not in found
            else ""
        )
        raise FileNotFoundError(f"{path} does not exist: {directory} holds {held}{hint}")
    obj.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))


def read_states(directory) -> list[dict]:
    """Every rank's state in ``directory``, in rank order (one world size only)."""
    found = _worlds(directory)
    if len(found) != 1:
        raise ValueError(f"{directory} holds gradzip states of world sizes {sorted(found)}; expected exactly one")
    ((world, ranks),) = found.items()
    missing = sorted(set(range(world)) - ranks)
    if missing:
        raise ValueError(f"{directory} lacks the states of ranks {missing} of {world}")
    return [torch.load(state_path(directory, r, world), weights_only=True, map_location="cpu") for r in range(world)]


def write_states(states: list[dict], directory) -> list[Path]:
    """Write ``states`` (new rank ``r``'s at index ``r``, as :func:`reshard` returns them)
    one file per rank, for :func:`load` on ``len(states)`` ranks."""
    paths = []
    for r, sd in enumerate(states):
        path = state_path(directory, r, len(states))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(sd, path)
        paths.append(path)
    return paths


class PerRank:
    """A front end's per-rank state as a ``Stateful`` for ``torch.distributed.checkpoint``.

        dcp.save({"model": model.state_dict(), "gradzip": PerRank(state)}, checkpoint_id=path)
        dcp.load({"model": model.state_dict(), "gradzip": PerRank(state)}, checkpoint_id=path)

    DCP writes a plain (non-DTensor) entry once, from one rank, as if every rank held the
    same: an engine state under one key would keep rank 0's residuals only. ``PerRank``
    files each rank's state under a key of its own (``rank{r}_of_{N}``), serialized as
    bytes, so every rank's is saved and every rank loads its own; a checkpoint of another
    world size has no key for this rank and DCP refuses it (:func:`reshard` the states).

    Args:
        obj: a front end (``register_hook``'s state, ``DistributedOptimizer``,
            ``LocalSGD``/``DiLoCo``) or an ``Engine``.
    """

    def __init__(self, obj) -> None:
        self.obj = obj
        rank, world = _owner(obj)
        self.key = f"rank{rank}_of_{world}"

    def state_dict(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.obj.state_dict(), buf)
        return {self.key: buf.getvalue()}

    def load_state_dict(self, sd: dict) -> None:
        if self.key not in sd:
            raise ValueError(f"the checkpoint holds no gradzip state for {self.key} (it has {sorted(sd)})")
        value = sd[self.key]
        if isinstance(value, (bytes, bytearray)):
            value = io.BytesIO(value)
        if isinstance(value, io.BytesIO):
            value.seek(0)
            value = torch.load(value, weights_only=True, map_location="cpu")
        self.obj.load_state_dict(value)
