"""gradzip: gradient compression and communication reduction for PyTorch.

    import gradzip as gz
    from gradzip.hooks import register_hook

    state = register_hook(ddp_model, gz.Threshold(tau=1e-3, policy="adaptive"))
    state.stats()   # bytes counted at the collectives, ratio, codec/comm time

A method is a codec (``gz.TopK``, ``gz.SignSGD``, ...: a pure tensor <-> payload
transform with error feedback) or a protocol (``gz.PowerSGD``, ``gz.Filter``,
``gz.Policy``, ...: how tensors travel between the ranks); ``gz.parse("TopK(0.01)")``
builds one from its spec. Importing gradzip never imports triton or cupy.

The public names load on first use, all at once, from the table in ``gradzip/_names.py``:
``import gradzip`` alone does not import torch (``gradzip --help`` answers before torch
loads), and ``gradzip.fsdp`` loads only when first used (``torch.distributed.fsdp`` takes
seconds to import). Outside the tools, and the kernels within their own floor, only this
package loads modules by name: the table's modules, on the first ``gz.<name>``, and the
methods' modules when the registry asks (``_names.install_loader``: the registry, on the
ground floor, never imports the floors above it).
"""

import os as _os

if not _os.path.isdir(_os.path.join(__path__[0], "kernels")):
    # A source checkout imported without the editable install (``python -c`` in the
    # repository root, where ./gradzip shadows an installed wheel): gradzip.kernels and
    # gradzip.hooks live beside the package there, in ./kernels and ./hooks.
    from ._source_tree import install as _install

    _install(_os.path.dirname(__path__[0]))

import importlib
from typing import TYPE_CHECKING, Any

from . import _names

__version__ = "0.2.0"

# The public names load on first use (PEP 562), all at once: ``import gradzip`` alone does
# not import torch, so ``gradzip --help`` answers before torch loads. The first ``gz.<name>``
# imports every module of the table (gradzip/_names.py), which also registers every method
# of the grammar (``gz.parse``). The names, their modules and ``__all__`` come from that table.
__all__ = _names.public()
_PUBLIC = frozenset(__all__)
_SUBMODULES = _names.submodules()

if TYPE_CHECKING:  # what static tools see: the table's names, re-exported (tests/project/test_names.py checks them)
    from . import checkpoint as checkpoint
    from . import momentum as momentum
    from . import schedules as schedules
    from . import warmup as warmup
    from .checkpoint import reshard as reshard
    from .codecs.base import Codec as Codec
    from .codecs.base import TensorContext as TensorContext
    from .codecs.cast import BF16 as BF16
    from .codecs.cast import FP16 as FP16
    from .codecs.cast import Identity as Identity
    from .codecs.chunked import ChunkTopK as ChunkTopK
    from .codecs.lowbit import FP4 as FP4
    from .codecs.lowbit import FP8 as FP8
    from .codecs.lowbit import Int2 as Int2
    from .codecs.lowbit import Int4 as Int4
    from .codecs.quant import QSGD as QSGD
    from .codecs.quant import Int8 as Int8
    from .codecs.quant import SignSGD as SignSGD
    from .codecs.quant import TernGrad as TernGrad
    from .codecs.randomk import RandomK as RandomK
    from .codecs.threshold import Threshold as Threshold
    from .codecs.topk import TopK as TopK
    from .codecs.transform import DCT as DCT
    from .costmodel.link import Link as Link
    from .engine import Engine as Engine
    from .frontend import skip_nonfinite as skip_nonfinite
    from .local_sgd import DiLoCo as DiLoCo
    from .local_sgd import LocalSGD as LocalSGD
    from .local_sgd import SparseLoCo as SparseLoCo
    from .onebit import OneBitAdam as OneBitAdam
    from .onebit import ZeroOneAdam as ZeroOneAdam
    from .optim import DistributedOptimizer as DistributedOptimizer
    from .policy import Policy as Policy
    from .protocols.adaptive import Adaptive as Adaptive
    from .protocols.allgather import AllGather as AllGather
    from .protocols.allreduce import Allreduce as Allreduce
    from .protocols.base import Protocol as Protocol
    from .protocols.filter import Filter as Filter
    from .protocols.flat import Flat as Flat
    from .protocols.hierarchical import Hierarchical as Hierarchical
    from .protocols.int8_allreduce import Int8Allreduce as Int8Allreduce
    from .protocols.powersgd import PowerSGD as PowerSGD
    from .protocols.twophase import TwoPhase as TwoPhase
    from .registry import parse as parse
    from .stats import Stats as Stats
    from .stats import log_every as log_every
    from .sync import broadcast_parameters as broadcast_parameters
    from .sync import check_parameters_agree as check_parameters_agree
    from .wire import Payload as Payload


def _import(modules: list[str]) -> None:
    """Import ``gradzip.<module>`` for each of ``modules`` (the loader of the table)."""
    for mod in modules:
        importlib.import_module(f".{mod}", __name__)


_names.install_loader(_import)


def _load() -> None:
    """Import every module of the table and bind its public names here."""
    _import(_names.modules())
    for name, mod in _names.exports().items():
        globals()[name] = getattr(importlib.import_module(f".{mod}", __name__), name)


def __getattr__(name: str) -> Any:
    # A module (gz.checkpoint, gradzip.fsdp on first use: importing torch.distributed.fsdp
    # takes seconds) loads alone, so that ``from . import checkpoint`` inside the package,
    # which asks the package first, imports that module and nothing else.
    if name in _SUBMODULES or name in _names.ON_FIRST_USE:
        return importlib.import_module(f".{_SUBMODULES.get(name, name)}", __name__)
    if name in _PUBLIC:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'gradzip' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _PUBLIC)
