"""gradzip's public names and the modules that define its methods: the one table.

Every list of them is read from here: ``gradzip.__all__``, the lazy ``gz.<name>`` and
``dir(gradzip)`` (``gradzip/__init__.py``), the registry's load of gradzip's own methods
(:func:`gradzip.registry.load_methods`, which ``gradzip plan`` and ``gradzip bench`` call),
and the tests' codec list (``tests/codecs/test_properties.py``). Static type checkers cannot
read a table: ``gradzip/__init__.py`` spells the same names as imports under
``TYPE_CHECKING``, and ``tests/project/test_names.py`` checks that they agree.

A new in-tree method is its own module plus one :class:`Name` here: ``Name("Toy",
"codecs.toy", "codec")`` makes ``gz.Toy``, puts it in ``__all__``, lets the registry (and so
``gz.parse``, ``gradzip plan --methods`` and ``gradzip bench --methods``) load its module, and
puts it in the tests' codec list.

This module imports nothing of gradzip's and not torch: ``import gradzip`` reads it before
torch loads, and the registry on the ground floor reads it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

__all__ = [
    "Name",
    "PUBLIC",
    "UNEXPORTED_METHODS",
    "ON_FIRST_USE",
    "METHOD_KINDS",
    "public",
    "exports",
    "submodules",
    "methods",
    "method_modules",
    "modules",
    "install_loader",
    "load",
]

#: The kinds of names the method grammar reads (``gradzip.registry``): registered classes
#: (``codec``, ``protocol``, ``schedule``), optimizer wrappers that parse to a ``Spec``
#: (``frontend``), and values (``value``, e.g. ``Link``).
METHOD_KINDS = ("codec", "protocol", "frontend", "schedule", "value")


class Name(NamedTuple):
    """One name: ``name`` is defined in ``gradzip.<module>``.

    ``kind``: one of :data:`METHOD_KINDS` for a name of the method grammar (its module must be
    imported for the registry to know it), ``"module"`` when ``gz.<name>`` is the module
    ``gradzip.<module>`` itself, ``""`` for any other public object.
    """

    name: str
    module: str
    kind: str = ""


#: Every ``gz.<name>``, in the order of ``gradzip.__all__``.
PUBLIC: tuple[Name, ...] = (
    # what a method is made of
    Name("Codec", "codecs.base"),
    Name("Protocol", "protocols.base"),
    Name("TensorContext", "codecs.base"),
    Name("Payload", "wire"),
    # codecs
    Name("Identity", "codecs.cast", "codec"),
    Name("FP16", "codecs.cast", "codec"),
    Name("BF16", "codecs.cast", "codec"),
    Name("Threshold", "codecs.threshold", "codec"),
    Name("TopK", "codecs.topk", "codec"),
    Name("RandomK", "codecs.randomk", "codec"),
    Name("SignSGD", "codecs.quant", "codec"),
    Name("QSGD", "codecs.quant", "codec"),
    Name("TernGrad", "codecs.quant", "codec"),
    Name("Int8", "codecs.quant", "codec"),
    Name("Int4", "codecs.lowbit", "codec"),
    Name("Int2", "codecs.lowbit", "codec"),
    Name("FP8", "codecs.lowbit", "codec"),
    Name("FP4", "codecs.lowbit", "codec"),
    Name("DCT", "codecs.transform", "codec"),
    Name("ChunkTopK", "codecs.chunked", "codec"),
    # protocols
    Name("Allreduce", "protocols.allreduce", "protocol"),
    Name("AllGather", "protocols.allgather", "protocol"),
    Name("TwoPhase", "protocols.twophase", "protocol"),
    Name("Int8Allreduce", "protocols.int8_allreduce", "protocol"),
    Name("Filter", "protocols.filter", "protocol"),
    Name("Flat", "protocols.flat", "protocol"),
    Name("Hierarchical", "protocols.hierarchical", "protocol"),
    Name("PowerSGD", "protocols.powersgd", "protocol"),
    Name("Policy", "policy", "protocol"),
    Name("Adaptive", "protocols.adaptive", "protocol"),
    # the engine and the front ends
    Name("Engine", "engine"),
    Name("Stats", "stats"),
    Name("DistributedOptimizer", "optim"),
    Name("OneBitAdam", "onebit", "frontend"),
    Name("ZeroOneAdam", "onebit", "frontend"),
    Name("LocalSGD", "local_sgd", "frontend"),
    Name("DiLoCo", "local_sgd", "frontend"),
    Name("SparseLoCo", "local_sgd", "frontend"),
    # helpers
    Name("schedules", "schedules", "module"),
    Name("warmup", "warmup", "module"),
    Name("momentum", "momentum", "module"),
    Name("Link", "costmodel.link", "value"),
    Name("parse", "registry"),
    Name("checkpoint", "checkpoint", "module"),
    Name("reshard", "checkpoint"),
    Name("broadcast_parameters", "sync"),
    Name("check_parameters_agree", "sync"),
    Name("log_every", "stats"),
    Name("skip_nonfinite", "frontend"),
)

#: Names of the method grammar that have no ``gz.<name>``.
UNEXPORTED_METHODS: tuple[Name, ...] = (
    Name("ReduceScatter", "protocols.reduce_scatter", "protocol"),  # gradzip.fsdp's protocol
    Name("Exponential", "warmup", "schedule"),  # gz.warmup.Exponential
    Name("Linear", "warmup", "schedule"),
    Name("DDP", "hook_row", "value"),  # plain DDP: None
    Name("Hook", "hook_row", "value"),  # a bench row's hook: its method and options
)

#: Modules that ``gz.<name>`` imports on their own first use, not with the rest, and that
#: ``__all__`` leaves out: importing ``torch.distributed.fsdp`` takes seconds; ``gz.ft`` is for
#: torchft's users only (``gradzip[ft]``).
ON_FIRST_USE: tuple[str, ...] = ("fsdp", "ft")


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def public() -> list[str]:
    """``gradzip.__all__``: every ``gz.<name>``, in table order."""
    return [n.name for n in PUBLIC]


def exports() -> dict[str, str]:
    """``{name: module}`` of the public objects that are not modules."""
    return {n.name: n.module for n in PUBLIC if n.kind != "module"}


def submodules() -> dict[str, str]:
    """``{name: module}`` of the public names that are modules themselves (``gz.checkpoint``, ...)."""
    return {n.name: n.module for n in PUBLIC if n.kind == "module"}


def methods(kind: str | None = None) -> list[str]:
    """The names of the method grammar (of one of :data:`METHOD_KINDS`), exported first, in table order."""
    if kind is not None and kind not in METHOD_KINDS:
        raise ValueError(f"kind must be one of {list(METHOD_KINDS)}, got {kind!r}")
    return [n.name for n in PUBLIC + UNEXPORTED_METHODS if n.kind in METHOD_KINDS and kind in (None, n.kind)]


def method_modules() -> list[str]:
    """The modules (under ``gradzip``) that define a name of the method grammar: importing
    them registers every method gradzip ships."""
    return _unique(n.module for n in PUBLIC + UNEXPORTED_METHODS if n.kind in METHOD_KINDS)


def modules() -> list[str]:
    """Every module the table names, in table order: what the first ``gz.<name>`` imports."""
    return _unique(n.module for n in PUBLIC + UNEXPORTED_METHODS)


# -- loading -------------------------------------------------------------------------------
# The package (gradzip/__init__.py, above every floor) installs the function that imports
# modules, so that the registry, on the ground floor, can have gradzip's methods loaded
# without importing the floors above it.
_loader: Callable[[list[str]], None] | None = None


def install_loader(fn: Callable[[list[str]], None]) -> None:
    """Set the function :func:`load` calls: ``fn(modules)`` imports ``gradzip.<module>`` for
    each (``gradzip/__init__.py`` installs it when the package is imported)."""
    global _loader
    _loader = fn


def load(which: Iterable[str] | None = None) -> None:
    """Import the modules ``which`` (default: :func:`method_modules`) through the installed loader."""
    if _loader is None:
        raise RuntimeError("gradzip's module loader is not installed: import gradzip first")
    _loader(method_modules() if which is None else list(which))
