"""gradzip: gradient compression and communication reduction for PyTorch.

    import gradzip as gz
    from gradzip.hooks import register_hook

    state = register_hook(ddp_model, gz.Threshold(tau=1e-3, policy="adaptive"))
    state.stats()   # bytes counted at the collectives, ratio, codec/comm time

Importing gradzip never imports triton or cupy.
"""
from . import schedules
from .compressors import (
    BF16,
    FP16,
    QSGD,
    Compressor,
    Filter,
    Identity,
    Int8,
    PowerSGD,
    RandomK,
    SignSGD,
    TensorContext,
    TernGrad,
    Threshold,
    TopK,
)
from .costmodel import Link
from .engine import Engine
from .local_sgd import LocalSGD
from .optim import DistributedOptimizer
from .policy import Policy
from .stats import Stats
from .wire import Payload

__version__ = "0.1.0"

__all__ = [
    "Compressor",
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
    "Filter",
    "PowerSGD",
    "Engine",
    "Stats",
    "DistributedOptimizer",
    "LocalSGD",
    "schedules",
    "Policy",
    "Link",
]
