"""Elastic state (Horovod's ``State``, ``ObjectState``, ``TorchState``), committed to memory and,
under torchrun's elastic agent, to disk, so that the workers the agent restarts resume from it.

Horovod keeps a commit in the memory of the workers that survive a failure, and brings new
workers up to date by broadcasting it. torchrun's agent restarts every worker of the group
when one fails or the membership changes, so a commit that lived in memory only would be lost:
here each rank also writes its commit to ``<dir>/commit.<n>.rank<r>of<W>.pt`` (``<dir>``:
``GRADZIP_ELASTIC_DIR``, else ``<tmp>/gradzip-elastic/<TORCHELASTIC_RUN_ID>`` when torchrun
was given ``--rdzv-id``; it must be one folder that every node sees), keeping the last two,
and removes them when the training function returns. A restarted job loads the newest commit
that every rank of the old world wrote completely: each rank its own file when the world size
is the same, so gradzip's error-feedback residuals and codec state (PowerSGD's warm start)
come back as they were; on another world size the model, the optimizer and the objects come
from rank 0's file and the gradzip state is resharded (``gradzip.checkpoint.reshard``).
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
import warnings
from pathlib import Path

import torch

from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ..mpi_ops import rank, size
from .sampler import ElasticSampler

__all__ = ["State", "ObjectState", "TorchState", "commit_dir"]


def commit_dir() -> Path | None:
    """Where commits go: ``GRADZIP_ELASTIC_DIR``, else a folder of this torchrun run
    (``TORCHELASTIC_RUN_ID``), else None (commits stay in memory, as in Horovod)."""
    d = os.environ.get("GRADZIP_ELASTIC_DIR")
    if d:
        return Path(d)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":  # torchrun without --rdzv-id says "none": not one run's own
        return Path(tempfile.gettempdir()) / "gradzip-elastic" / re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)
    return None


_FILE = re.compile(r"commit\.(\d+)\.rank(\d+)of(\d+)\.pt$")


class State:
    """Horovod's ``State``: ``commit`` (``save`` to memory, and to disk under torchrun), ``restore``,
    ``sync``, reset callbacks. ``check_host_updates`` has nothing to check here: torchrun's agent
    restarts the workers when the membership changes."""

    def __init__(self, bcast_object, get_rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list = []
        self._commits = 0

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called after a reset event (workers restarted, added or removed), before the
        state is synchronised: e.g. to scale the learning rate with the new ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """Horovod's driver notification; torchrun restarts the workers instead (nothing to do)."""

    def commit(self) -> None:
        """Save the state to memory and, under torchrun (or with ``GRADZIP_ELASTIC_DIR``), to this
        rank's commit file; then ``check_host_updates()``."""
        self.save()
        self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """No-op: a membership change makes torchrun's agent restart every worker."""

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Reset objects and variables after a reset event (before synchronisation)."""

    # -- commits on disk -------------------------------------------------------------------
    def _saved(self) -> dict:
        """What ``save()`` kept, as plain objects (torch.save-able)."""
        return {}

    def _load_saved(self, saved: dict, same_world: bool) -> None:
        """Put a commit read from disk where ``save()`` keeps it (``restore()`` applies it)."""

    def _persist(self) -> None:
        d = commit_dir()
        if d is None:
            return
        d.mkdir(parents=True, exist_ok=True)
        self._commits += 1
        r, w = rank(), size()
        path = d / f"commit.{self._commits}.rank{r}of{w}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"commit": self._commits, "rank": r, "world": w, "saved": self._saved()}, tmp)
        os.replace(tmp, path)
        for old in d.glob(f"commit.*.rank{r}of{w}.pt"):
            m = _FILE.search(old.name)
            if m and int(m[1]) <= self._commits - 2:
                old.unlink(missing_ok=True)

    def _clear_commits(self) -> None:
        """This rank's commit files, removed (the run ended: a new run of the same id starts afresh)."""
        d = commit_dir()
        if d is None or not d.is_dir():
            return
        r = rank()
        for f in d.glob(f"commit.*.rank{r}of*.pt"):
            f.unlink(missing_ok=True)

    def _load_commit(self) -> bool:
        """Every rank: load the newest commit that all ranks of its world wrote (rank 0 picks it
        and tells the others). True when one was loaded (the state is then restored)."""
        d = commit_dir()
        choice = None
        if rank() == 0 and d is not None and d.is_dir():
            found: dict = {}
            for f in d.glob("commit.*.pt"):
                m = _FILE.search(f.name)
                if m:
                    found.setdefault((int(m[1]), int(m[3])), set()).add(int(m[2]))
            done = [key for key, ranks in found.items() if ranks == set(range(key[1]))]
            if done:
                choice = max(done)
        choice = broadcast_object(choice, 0, name="gradzip.elastic.commit")
        if choice is None:
            return False
        n, world = choice
        same = world == size()
        if same:
            data = torch.load(d / f"commit.{n}.rank{rank()}of{world}.pt", weights_only=False)
            self._load_saved(data["saved"], True)
        else:
            every = [
                torch.load(d / f"commit.{n}.rank{r}of{world}.pt", weights_only=False)["saved"] for r in range(world)
            ]
            self._load_saved({**every[0], "_all_ranks": every}, False)
        self._commits = n
        self.restore()
        return True


class ObjectState(State):
    """Plain Python objects, each a keyword argument exposed as an attribute; ``sync()``
    broadcasts rank 0's."""

    def __init__(self, bcast_object, get_rank, **kwargs) -> None:
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _saved(self) -> dict:
        return {"objects": copy.deepcopy(self._saved_state)}

    def _load_saved(self, saved: dict, same_world: bool) -> None:
        self._saved_state = saved["objects"]


class TorchState(ObjectState):
    """Horovod's ``TorchState(model=None, optimizer=None, **kwargs)``: models, optimizers and
    ``ElasticSampler``s among the keyword arguments get handlers (their ``state_dict`` is what
    is saved, restored and, from rank 0, synchronised); the rest are objects.

    A ``gradzip.horovod.DistributedOptimizer``'s ``state_dict`` carries gradzip's engine state
    (residuals, codec state), so a commit keeps the error feedback of every rank, and
    ``restore()`` puts it back; ``sync()`` broadcasts only what Horovod broadcasts (the
    optimizer's state and hyper-parameters), never one rank's residuals to the others."""

    def __init__(self, model=None, optimizer=None, **kwargs) -> None:
        kwargs.update(dict(model=model, optimizer=optimizer))
        self._handlers, kwargs = _get_handlers(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name, value) -> None:
        if hasattr(self, name) and name in self._handlers:
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)

    def _saved(self) -> dict:
        out = super()._saved()
        out["handlers"] = {name: h.saved for name, h in self._handlers.items()}
        return out

    def _load_saved(self, saved: dict, same_world: bool) -> None:
        super()._load_saved(saved, same_world)
        for name, h in self._handlers.items():
            if name not in saved["handlers"]:
                continue
            value = saved["handlers"][name]
            if not same_world and isinstance(h, OptimizerStateHandler) and isinstance(value, dict):
                value = _resharded(name, value, saved["_all_ranks"])
            h.saved = value


def _resharded(name: str, value: dict, every: list[dict]) -> dict:
    """Rank 0's optimizer state with the gradzip state of every old rank resharded to this world
    (dropped, with a warning, where it cannot be)."""
    value = dict(value)
    engines = [e["handlers"][name].get("gradzip") for e in every]
    value.pop("gradzip", None)
    if all(isinstance(e, dict) for e in engines):
        from ...checkpoint import reshard

        try:
            value["gradzip"] = reshard(engines, size())[rank()]
        except Exception as exc:  # noqa: BLE001 - the run goes on without the residuals
            warnings.warn(f"gradzip.elastic: the gradzip state of {name!r} could not be resharded: {exc}", stacklevel=2)
    return value


class StateHandler:
    """What ``TorchState`` saves, restores and synchronises for one value."""

    def __init__(self, value) -> None:
        self.value = value
        self.saved = None

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def set_value(self, value) -> None:
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    def __init__(self, optimizer) -> None:
        super().__init__(optimizer)
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    def __init__(self, sampler) -> None:
        super().__init__(sampler)
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    return _handler_registry


def set_handler_registry(registry) -> None:
    global _handler_registry
    _handler_registry = registry


def _get_handlers(kwargs):
    handlers, rest = {}, {}
    for k, v in kwargs.items():
        for kind, cls in _handler_registry:
            if isinstance(v, kind):
                handlers[k] = cls(v)
                break
        else:
            rest[k] = v
    return handlers, rest
