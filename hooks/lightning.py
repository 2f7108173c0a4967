"""PyTorch Lightning: train a ``LightningModule`` with any gradzip method under a DDP strategy.

    import lightning as L
    from gradzip.hooks.lightning import GradzipCallback

    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2,
                        callbacks=[GradzipCallback("TopK(0.01)")])
    trainer.fit(model)                       # and trainer.fit(model, ckpt_path=...) resumes gradzip too

The callback registers gradzip's hook (:func:`gradzip.hooks.register_hook`) on the
``DistributedDataParallel`` model that the strategy built, when fitting starts. Lightning's own
``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` cannot carry it: Lightning registers those
only on CUDA, and gradzip's state must be built from the wrapped model (its parameter names) and,
for momentum correction, the optimizer, which Lightning creates after the wrapper.

**Checkpoints.** gradzip's state is per rank (error-feedback residuals differ between ranks),
and Lightning writes one file from rank 0: the callback's ``state_dict()`` gathers every rank's
state into rank 0's checkpoint, and on resume each rank loads its own (a checkpoint of another
world size is resharded, :func:`gradzip.checkpoint.reshard`). Resuming from a checkpoint is
bit-identical to the unbroken run where Lightning's own resume is (at epoch boundaries).

**Stats.** Every training batch that stepped the hook logs :func:`gradzip.stats.scalars` of that
step through ``LightningModule.log_dict`` (``gradzip/link_ratio``, ``gradzip/link_bytes_per_step``,
...), so they reach every logger of the ``Trainer`` at its ``log_every_n_steps``. ``state``
is the :class:`~gradzip.hooks.ddp.HookState` while fitting (``stats()``, ``routes()``, ...).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel

from gradzip.checkpoint import reshard
from gradzip.codecs.base import Codec
from gradzip.frontend import NONFINITE_HINT
from gradzip.protocols.base import Protocol
from gradzip.stats import Stats, scalars

from .ddp import HookState, as_method, register_hook

__all__ = ["GradzipCallback"]

#: The remedy the first non-finite step's warning names: the guard on Lightning's optimizers
#: (the module's ``on_fit_start`` runs after the callbacks', so the state exists by then).
LIGHTNING_FIX = (
    "call gz.skip_nonfinite(optimizer, callback.state) for each optimizer in trainer.optimizers, "
    "e.g. in the LightningModule's on_fit_start (it runs after the GradzipCallback's)"
)


def _cpu(value):
    """A state with every tensor on the CPU (gathered through pickling, loaded anywhere)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


class GradzipCallback(Callback):
    """Compress the gradient averaging of a Lightning DDP run with ``method``.

    Args:
        method: a gradzip codec or protocol (``gz.TopK(0.01)``), or its spec (``"TopK(0.01)"``).
        momentum_correction: hand the hook the (single) optimizer's momentum
            (``register_hook(optimizer=...)``): an ``SGD``'s momentum, an ``Adam``'s beta1
            (with ``on_nonfinite="skip"`` that also installs :func:`gradzip.skip_nonfinite`
            on it; without it, call that from the module's ``on_fit_start`` to skip
            non-finite steps without a ``GradScaler``).
        log: log :func:`gradzip.stats.scalars` through ``LightningModule.log_dict`` every
            training batch that stepped the hook.
        **options: the rest of :func:`gradzip.hooks.register_hook`'s options (``start_iter``,
            ``error_feedback``, ``on_nonfinite``, ``clip``, ``precondition``).
    """

    def __init__(
        self,
        method: Codec | Protocol | str,
        *,
        momentum_correction: bool = False,
        log: bool = True,
        **options: Any,
    ) -> None:
        self.method = as_method(method)  # a bad method is refused here, before any process starts
        self.momentum_correction = bool(momentum_correction)
        self.log = bool(log)
        self.options = options
        self.state: HookState | None = None
        self._pending: dict | None = None  # a checkpoint's part, loaded when the hook exists
        self._logged: dict | None = None  # the totals at the last log

    @property
    def state_key(self) -> str:
        return "GradzipCallback"

    # -- fitting -------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            raise RuntimeError(
                f"GradzipCallback needs a DistributedDataParallel model: Trainer(strategy='ddp') (or DDPStrategy), "
                f"got {type(trainer.strategy).__name__} wrapping {type(ddp).__name__}"
            )
        optimizer = None
        if self.momentum_correction:
            if len(trainer.optimizers) != 1:
                raise ValueError(
                    f"momentum_correction=True takes one optimizer's momentum, the module has {len(trainer.optimizers)}"
                )
            optimizer = trainer.optimizers[0]
        previous = self.state.state_dict() if self.state is not None and self._pending is None else None
        self.state = register_hook(ddp, self.method, optimizer=optimizer, **self.options)
        self.state.engine.nonfinite_hint = NONFINITE_HINT.format(fix=LIGHTNING_FIX)
        if self._pending is not None:
            self.state.load_state_dict(self._own(self._pending))
            self._pending = None
        elif previous is not None:  # another fit() with this callback carries on
            self.state.load_state_dict(previous)
        self._logged = self.state.engine.stats_.state_dict()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if not self.log or self.state is None:
            return
        now = self.state.engine.stats_.state_dict()
        delta = {k: now[k] - self._logged[k] for k in Stats.names()}
        if delta["steps"]:
            self._logged = now
            pl_module.log_dict(scalars(delta), on_step=True, on_epoch=False)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every rank's gradzip state, gathered into rank 0's (the rank whose checkpoint Lightning
        writes); other ranks return their own only. Collective: Lightning calls it on every rank."""
        if self.state is None:
            return {}
        mine = _cpu(self.state.state_dict())
        rank, world = self.state.engine.comm.rank, self.state.engine.comm.world_size
        if world == 1:
            return {"world_size": 1, "ranks": [mine]}
        group = self.state.engine.comm.group
        gathered: list | None = [None] * world if rank == 0 else None
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        dist.gather_object(mine, gathered, dst=dst, group=group)
        return {"world_size": world, "ranks": gathered if rank == 0 else [mine]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep the checkpoint's part until the hook exists (Lightning restores callbacks before it
        wraps the model); ``on_fit_start`` loads this rank's state."""
        self._pending = state_dict

    def _own(self, sd: dict) -> dict:
        states, world = sd["ranks"], self.state.engine.comm.world_size
        rank = self.state.engine.comm.rank
        if len(states) != sd["world_size"]:
            raise ValueError(
                f"the checkpoint holds {len(states)} gradzip states of {sd['world_size']} ranks: it was not "
                "written by rank 0's GradzipCallback.state_dict()"
            )
        if sd["world_size"] != world:
            warnings.warn(
                f"gradzip: the checkpoint's states are of {sd['world_size']} ranks, this run has {world}: "
                "resharded (gradzip.checkpoint.reshard)",
                stacklevel=2,
            )
            states = reshard(states, world)
        return states[rank]
