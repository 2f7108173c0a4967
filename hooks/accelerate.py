"""Hugging Face Accelerate: any gradzip method on the model that ``Accelerator.prepare`` returns.

    from accelerate import Accelerator
    from gradzip.hooks.accelerate import compress

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = compress(accelerator, model, "PowerSGD(rank=2)", log_every=50)
    ...
    with accelerator.accumulate(model):      # no_sync steps never reach the hook
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(dir)              # carries every rank's gradzip state; load_state(dir) restores it

Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)`` offers torch's fp16, bf16 and
PowerSGD hooks only. :func:`compress` registers gradzip's hook on the prepared
``DistributedDataParallel`` model (:func:`gradzip.hooks.register_hook`, the same engine, checks
and stats) and two of the Accelerator's state hooks: ``save_state(dir)`` writes each rank's
gradzip state to its own file in ``dir`` (``gradzip_rank{r}_of_{N}.pt``, beside Accelerate's own
per-process RNG files) and ``load_state(dir)`` loads it back, so a resumed run goes on bit for
bit. Several models of one Accelerator (a GAN's two) each keep their own files: the first model
``prepare`` returned in ``dir`` itself, the ``i``-th (from 0) in ``dir/gradzip_model_{i}/``, as
Accelerate numbers its own ``model_{i}`` files. Call :func:`compress` before ``load_state``:
the load hook exists from then on (an optimizer loaded before it, whose momentum gradzip had
taken over, is refused). ``log_every=n`` sends :func:`gradzip.stats.scalars` of every ``n`` steps to the
Accelerator's trackers (``accelerator.log``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from gradzip.codecs.base import Codec
from gradzip.frontend import NONFINITE_HINT
from gradzip.momentum import taken
from gradzip.protocols.base import Protocol
from gradzip.stats import scalars

from .ddp import HookState, as_method, register_hook

__all__ = ["compress"]

#: The remedy the first non-finite step's warning names.
ACCELERATE_FIX = (
    "call gz.skip_nonfinite(optimizer, state) with the optimizer accelerator.prepare returned and the state "
    "compress returned (compress(..., optimizer=...) also installs it, with momentum correction)"
)


def compress(
    accelerator: Accelerator,
    model: DistributedDataParallel,
    method: Codec | Protocol | str,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    log_every: int | None = None,
    **options: Any,
) -> HookState:
    """Compress ``model``'s gradient averaging with ``method``; returns the hook's
    :class:`~gradzip.hooks.ddp.HookState` (``stats()``, ``routes()``, ``state_dict()``, ...).

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: what ``accelerator.prepare`` returned for the model: a ``DistributedDataParallel``
            when the run has several processes (``accelerate launch``, ``torchrun``).
        method: a gradzip codec or protocol, or its spec (``"TopK(0.01)"``).
        optimizer: momentum correction (``register_hook(optimizer=...)``): the prepared optimizer
            (or the one it wraps) whose momentum the hook takes over.
        log_every: every this many steps, ``accelerator.log`` the interval's
            :func:`gradzip.stats.scalars` (at gradzip's step); ``None``: no logging.
        **options: the rest of :func:`gradzip.hooks.register_hook`'s options (``start_iter``,
            ``error_feedback``, ``on_nonfinite``, ``clip``, ``precondition``).
    """
    method = as_method(method)
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"compress needs the DistributedDataParallel model that accelerator.prepare returns in a run of "
            f"several processes (accelerate launch or torchrun); got {type(model).__name__} "
            f"({accelerator.num_processes} process(es), {accelerator.distributed_type})"
        )
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch optimizer
    if inner is not None and taken(inner):
        raise RuntimeError(
            "the optimizer's momentum is gradzip's already: it was loaded (accelerator.load_state) from a run "
            "whose hook had taken it over, before this compress registered the hook that loads gradzip's own "
            "state (the momentum and residuals), or another hook took it over; call compress(...) first, then "
            "accelerator.load_state(dir)"
        )
    state = register_hook(model, method, optimizer=inner, **options)
    state.engine.nonfinite_hint = NONFINITE_HINT.format(fix=ACCELERATE_FIX)
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: state.save(_folder(models, model, output_dir))
    )
    accelerator.register_load_state_pre_hook(lambda models, input_dir: state.load(_folder(models, model, input_dir)))
    if log_every is not None:
        state.log_every(log_every, lambda step, s: accelerator.log(scalars(s), step=step))
    return state


def _folder(models: list, model, directory) -> str:
    """Where ``model``'s gradzip files go in a checkpoint ``directory``: the directory itself for
    the Accelerator's first model, ``gradzip_model_{i}`` in it for its ``i``-th."""
    for i, m in enumerate(models):
        if m is model or m is model.module:  # the Accelerator lists the module DDP wraps, or DDP itself
            return str(directory) if i == 0 else os.path.join(directory, f"gradzip_model_{i}")
    raise RuntimeError(
        f"the Accelerator no longer holds the model compress() was given ({len(models)} model(s) prepared): "
        "its gradzip state has no place in the checkpoint"
    )
