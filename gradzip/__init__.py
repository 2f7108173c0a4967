"""gradzip: gradient compression and communication reduction for PyTorch.

    import gradzip as gz
    from gradzip.hooks import register_hook

    state = register_hook(ddp_model, gz.Threshold(tau=1e-3, policy="adaptive"))
    state.stats()   # bytes counted at the collectives, ratio, codec/comm time

A method is a codec (``gz.TopK``, ``gz.SignSGD``, ...: a pure tensor <-> payload
transform with error feedback) or a protocol (``gz.PowerSGD``, ``gz.Filter``,
``gz.Policy``, ...: how tensors travel between the ranks); ``gz.parse("TopK(0.01)")``
builds one from its spec. Importing gradzip never imports triton or cupy.
"""

import os as _os

if not _os.path.isdir(_os.path.join(__path__[0], "kernels")):
    # A source checkout imported without the editable install (``python -c`` in the
    # repository root, where ./gradzip shadows an installed wheel): gradzip.kernels and
    # gradzip.hooks live beside the package there, in ./kernels and ./hooks.
    from ._source_tree import install as _install

    _install(_os.path.dirname(__path__[0]))

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"

# The public names load on first use (PEP 562), all at once: ``import gradzip`` alone does
# not import torch, so ``gradzip --help`` answers before torch loads. The first ``gz.<name>``
# imports every module below, as the eager imports did, which also registers every method
# of the grammar (``gz.parse``). Keep this list and the TYPE_CHECKING imports in step.
_EAGER = (
    "checkpoint",
    "momentum",
    "schedules",
    "warmup",
    "codecs",
    "costmodel",
    "engine",
    "local_sgd",
    "optim",
    "policy",
    "protocols",
    "registry",
    "stats",
    "sync",
    "wire",
)
_EXPORTS = {
    "codecs": (
        "BF16",
        "FP16",
        "QSGD",
        "Codec",
        "Identity",
        "Int8",
        "RandomK",
        "SignSGD",
        "TensorContext",
        "TernGrad",
        "Threshold",
        "TopK",
    ),
    "costmodel": ("Link",),
    "engine": ("Engine",),
    "local_sgd": ("DiLoCo", "LocalSGD"),
    "optim": ("DistributedOptimizer",),
    "policy": ("Policy",),
    "protocols": (
        "AllGather",
        "Allreduce",
        "Filter",
        "Hierarchical",
        "Int8Allreduce",
        "PowerSGD",
        "Protocol",
        "TwoPhase",
    ),
    "registry": ("parse",),
    "checkpoint": ("reshard",),
    "stats": ("Stats", "log_every"),
    "sync": ("broadcast_parameters", "check_parameters_agree"),
    "wire": ("Payload",),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # what static tools see; at run time, __getattr__ below
    from . import checkpoint, momentum, schedules, warmup
    from .checkpoint import reshard
    from .codecs import (
        BF16,
        FP16,
        QSGD,
        Codec,
        Identity,
        Int8,
        RandomK,
        SignSGD,
        TensorContext,
        TernGrad,
        Threshold,
        TopK,
    )
    from .costmodel import Link
    from .engine import Engine
    from .local_sgd import DiLoCo, LocalSGD
    from .optim import DistributedOptimizer
    from .policy import Policy
    from .protocols import AllGather, Allreduce, Filter, Hierarchical, Int8Allreduce, PowerSGD, Protocol, TwoPhase
    from .registry import parse
    from .stats import Stats, log_every
    from .sync import broadcast_parameters, check_parameters_agree
    from .wire import Payload


def _load() -> None:
    """Import every module the public names come from (the former eager imports)."""
    for mod in _EAGER:
        importlib.import_module(f".{mod}", __name__)
    for name, mod in _WHERE.items():
        globals()[name] = getattr(importlib.import_module(f".{mod}", __name__), name)


def __getattr__(name: str):
    if name in _WHERE or name in ("checkpoint", "momentum", "schedules", "warmup"):
        _load()
        return globals()[name]
    # gradzip.fsdp on first use: importing torch.distributed.fsdp takes seconds.
    if name == "fsdp":
        return importlib.import_module(".fsdp", __name__)
    raise AttributeError(f"module 'gradzip' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE) | {"checkpoint", "momentum", "schedules", "warmup"})


__all__ = [
    "Codec",
    "Protocol",
    "TensorContext",
    "Payload",
    "Identity",
    "FP16",
    "BF16",
    "Threshold",
    "TopK",
    "RandomK",
    "SignSGD",
    "QSGD",
    "TernGrad",
    "Int8",
    "Allreduce",
    "AllGather",
    "TwoPhase",
    "Int8Allreduce",
    "Filter",
    "Hierarchical",
    "PowerSGD",
    "Policy",
    "Engine",
    "Stats",
    "DistributedOptimizer",
    "LocalSGD",
    "DiLoCo",
    "schedules",
    "warmup",
    "momentum",
    "Link",
    "parse",
    "checkpoint",
    "reshard",
    "broadcast_parameters",
    "check_parameters_agree",
    "log_every",
]
