"""Protocols: the only code that yields collective rounds (see :mod:`gradzip.protocols.base`)."""

from .allgather import AllGather
from .allreduce import Allreduce
from .base import Call, Exchange, Protocol, as_protocol, codec_time, finite_flags
from .filter import Filter
from .flat import Flat
from .hierarchical import Hierarchical
from .int8_allreduce import Int8Allreduce
from .parallel import aligned_starts, parallel
from .powersgd import PowerSGD
from .reduce_scatter import ReduceScatter
from .twophase import TwoPhase

__all__ = [
    "Protocol",
    "Call",
    "Exchange",
    "as_protocol",
    "codec_time",
    "finite_flags",
    "Allreduce",
    "AllGather",
    "Filter",
    "Flat",
    "Hierarchical",
    "Int8Allreduce",
    "PowerSGD",
    "ReduceScatter",
    "TwoPhase",
    "parallel",
    "aligned_starts",
]
