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
bit. ``log_every=n`` sends :func:`gradzip.stats.scalars` of every ``n`` steps to the
Accelerator's trackers (``accelerator.log``).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from gradzip.codecs.base import Codec
from gradzip.protocols.base import Protocol
from gradzip.stats import scalars

from .ddp import HookState, as_method, register_hook

__all__ = ["compress"]


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
    state = register_hook(model, method, optimizer=inner, **options)
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: state.save(output_dir))
    accelerator.register_load_state_pre_hook(lambda models, input_dir: state.load(input_dir))
    if log_every is not None:
        state.log_every(log_every, lambda step, s: accelerator.log(scalars(s), step=step))
    return state
