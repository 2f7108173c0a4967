"""``hvd.elastic`` on torchrun's elastic agent: ``run``, ``State``, ``ObjectState``, ``TorchState``,
``ElasticSampler``.

    torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:PORT train.py        # train.py as Horovod's elastic examples

``@hvd.elastic.run`` wraps the training function ``train(state, ...)``. On entry (every start
of a worker) it initialises the job if the script has not, loads the newest commit of this
run from disk where there is one (a restart: see :mod:`.state`), calls the reset callbacks
after such a restart, then synchronises the state from rank 0 and runs ``train``.
``state.commit()`` saves to memory and to disk. A failed collective (a peer gone) raises
``HorovodInternalError``: the state is restored to the last commit, and the error ends the
worker, since torchrun's agent restarts the whole group (with ``--max-restarts``) rather
than letting survivors re-form it as Horovod's driver does; the restarted workers resume
from the commit. Under horovodrun's elastic mode (host discovery scripts) this module is not
the driver's counterpart: use torchrun.
"""

from __future__ import annotations

import functools
import os
import warnings

from ..mpi_ops import HorovodInternalError, barrier, init, is_initialized, shutdown
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState, commit_dir

__all__ = ["run", "run_fn", "State", "ObjectState", "TorchState", "ElasticSampler", "init", "shutdown"]


def run_fn(func, reset):
    """``func(state, ...)`` run as described in the module docstring; ``reset`` is what a
    reset calls in Horovod (shutdown, init): kept for the signature, unused under torchrun."""

    @functools.wraps(func)
    def wrapper(state, *a, **kw):
        if not is_initialized():
            init()
        if commit_dir() is None and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
            warnings.warn(
                "gradzip.horovod.elastic: torchrun may restart the workers but commits stay in memory, where a "
                "restart loses them: give torchrun --rdzv-id (or set GRADZIP_ELASTIC_DIR)",
                stacklevel=2,
            )
        restarted = state._load_commit() or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        if restarted:
            state.on_reset()
        state.sync()
        try:
            out = func(state, *a, **kw)
        except HorovodInternalError:
            state.restore()
            raise
        if commit_dir() is not None:
            barrier()  # every rank is done with the commits before they go
            state._clear_commits()
        return out

    return wrapper


def run(func):
    """Decorator for the elastic training function (Horovod's ``hvd.elastic.run``); see the
    module docstring."""
    return run_fn(func, _reset)


def _reset() -> None:
    shutdown()
    init()
