"""What the tests share: rank pools, the small models and batches they train, a
save-and-resume scaffold, and the plain references gradzip is checked against.

* :mod:`tests.support.ranks`: ``run_ranks(fn, world, *args)`` on gloo ranks forked from a
  preloaded forkserver and kept in a pool per world size.
* :mod:`tests.support.models`: ``make_model``, ``batch``, ``train_steps``, ``params`` and
  :func:`~tests.support.models.resume_matches_unbroken` (train 2k steps unbroken; train k,
  save, rebuild from another seed, load, train k more).
* :mod:`tests.support.refs`: error feedback written the naive way (``RefMemory``).
"""

from pathlib import Path

from .models import (
    batch,
    ddp_resume_matches_unbroken,
    make_model,
    many_buckets_model,
    params,
    resume_matches_unbroken,
    roundtrip,
    train_many_buckets,
    train_steps,
)
from .ranks import run_ranks
from .refs import RefMemory, accum, reference_run

#: The repository root (the checkout the tests run from).
ROOT = Path(__file__).resolve().parents[2]

__all__ = [
    "ROOT",
    "RefMemory",
    "accum",
    "batch",
    "ddp_resume_matches_unbroken",
    "make_model",
    "many_buckets_model",
    "params",
    "reference_run",
    "resume_matches_unbroken",
    "roundtrip",
    "run_ranks",
    "train_many_buckets",
    "train_steps",
]
