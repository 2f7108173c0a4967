"""The link and the collectives' wire times: formulas only, no gradzip imports beyond the registry.

With ``S`` the bytes one rank hands to the collective, ``B`` the link bandwidth
in bits/s and ``alpha`` the one-way latency of one message between neighbours::

    allreduce(S)      = 2(N-1)/N * 8S/B + 2(N-1) * alpha
    allgather(S)      =   (N-1)   * 8S/B +  (N-1) * alpha
    reducescatter(S)  =  (N-1)/N  * 8S/B +  (N-1) * alpha    (FSDP2's gradients)

A ring allreduce is a reduce-scatter then an all-gather, ``N-1`` steps each;
every step sends one message of ``S/N`` bytes to the next rank, so each step
costs one latency: ``2(N-1)`` latencies. A ring all-gather of ``S`` bytes per
rank is ``N-1`` steps of ``S`` bytes: ``N-1`` latencies. Collectives of one
step are added up: gloo runs one process group's collectives one after the
other (``docs/costmodel.md``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import gradzip.args as args

from ..registry import register_value

__all__ = [
    "Link",
    "parse_bandwidth",
    "parse_duration",
    "allreduce_time",
    "allgather_time",
    "reducescatter_time",
    "alltoall_time",
    "link_bytes",
    "Collective",
    "wire_time",
    "check_world",
]


def parse_bandwidth(value, *, unit: bool = False) -> float:
    """Bits per second from a number or a string such as ``"1Gbit"``, ``"100mbps"``, ``"10G"``, ``"2.5e9"``.

    Units are decimal (``k`` = 1e3) and in bits; ``"B"``/``"byte"`` suffixes mean bytes
    (``"125MB/s"`` = 1e9 bit/s). ``unit=True`` refuses a bare number in a string
    (:func:`gradzip.args.bandwidth`; ``gradzip plan`` does).
    """
    return args.bandwidth("bandwidth", value, unit=unit)


def parse_duration(value, name: str = "duration", *, unit: bool = False) -> float:
    """Seconds from a number or a string such as ``"50us"``, ``"0.2ms"``, ``"1.5s"``
    (``unit=True``: a string needs its unit, :func:`gradzip.args.duration`)."""
    return args.duration(name, value, unit=unit)


@dataclass(frozen=True)
class Link:
    """A network link: ``bandwidth_bps`` in bits/s, ``latency_s`` per message (one hop, one way).

    Args:
        bandwidth_bps: bits per second, a number > 0 (``Link.parse("10Gbit", "20us")``
            reads units).
        latency_s: seconds per message, >= 0.
    """

    bandwidth_bps: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth_bps", args.number("bandwidth_bps", self.bandwidth_bps, 0.0, lo_open=True))
        object.__setattr__(self, "latency_s", args.number("latency_s", self.latency_s, 0.0))

    @classmethod
    def parse(cls, bandwidth, latency=0.0) -> Link:
        """``Link.parse("1Gbit", "50us")``."""
        return cls(parse_bandwidth(bandwidth), parse_duration(latency, "latency"))

    def to_dict(self) -> dict:
        return {"bandwidth_bps": self.bandwidth_bps, "latency_s": self.latency_s}

    def __str__(self) -> str:
        return f"{_fmt_bw(self.bandwidth_bps)}, {self.latency_s * 1e6:g} us"

    def __repr__(self) -> str:
        return f"Link({self.bandwidth_bps!r}, {self.latency_s!r})"


def _fmt_bw(bps: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def check_world(world: int) -> int:
    return args.integer("world_size", world, 1)


def allreduce_time(nbytes: float, world: int, link: Link) -> float:
    """Ring allreduce of ``nbytes`` per rank: ``2(N-1)/N * 8S/B + 2(N-1) * latency``."""
    n = check_world(world)
    if n == 1:
        return 0.0
    return 2.0 * (n - 1) / n * 8.0 * nbytes / link.bandwidth_bps + 2.0 * (n - 1) * link.latency_s


def allgather_time(nbytes: float, world: int, link: Link) -> float:
    """Ring all-gather of ``nbytes`` from every rank: ``(N-1) * 8S/B + (N-1) * latency``."""
    n = check_world(world)
    if n == 1:
        return 0.0
    return (n - 1) * 8.0 * nbytes / link.bandwidth_bps + (n - 1) * link.latency_s


def reducescatter_time(nbytes: float, world: int, link: Link) -> float:
    """Ring reduce-scatter of ``nbytes`` per rank (the first half of a ring allreduce):
    ``(N-1)/N * 8S/B + (N-1) * latency``."""
    n = check_world(world)
    if n == 1:
        return 0.0
    return (n - 1) / n * 8.0 * nbytes / link.bandwidth_bps + (n - 1) * link.latency_s


def alltoall_time(nbytes: float, world: int, link: Link, offrank: float | None = None) -> float:
    """Pairwise all-to-all: ``offrank`` bytes (default ``(N-1)/N * S``, even splits) leave
    this rank, one message to each of the ``N-1`` others: ``8 * offrank / B + (N-1) * latency``."""
    n = check_world(world)
    if n == 1:
        return 0.0
    sent = (n - 1) / n * nbytes if offrank is None else offrank
    return 8.0 * sent / link.bandwidth_bps + (n - 1) * link.latency_s


def link_bytes(kind: str, nbytes: float, world: int, offrank: float | None = None) -> float:
    """Bytes one rank sends on its link in one collective (the algorithms of the times above)."""
    n = check_world(world)
    if kind == "allreduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind == "allgather":
        return (n - 1) * nbytes
    if kind == "reducescatter":
        return (n - 1) / n * nbytes
    if kind == "alltoall":
        return (n - 1) / n * nbytes if offrank is None else offrank
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass(frozen=True)
class Collective:
    """One collective of a protocol: ``kind`` is ``"allreduce"``, ``"allgather"``,
    ``"reducescatter"`` (FSDP2's own, :mod:`gradzip.costmodel.fsdp`) or ``"alltoall"``;
    ``nbytes`` the bytes this rank hands to it (for an all-gather: its own part); ``offrank``
    for an all-to-all, the part addressed to other ranks (None: even).
    ``scope``: ``"world"`` (the whole process group), ``"intra"`` (the ranks of one node)
    or ``"cross"`` (one rank per node, as a hierarchical protocol's inter-node step), on a
    group of ``group`` ranks (None: the world)."""

    kind: str
    nbytes: int
    control: bool = False
    offrank: float | None = None
    scope: str = "world"
    group: int | None = None

    def time(self, world: int, link: Link) -> float:
        n = self.group or world
        if self.kind == "allreduce":
            return allreduce_time(self.nbytes, n, link)
        if self.kind == "allgather":
            return allgather_time(self.nbytes, n, link)
        if self.kind == "reducescatter":
            return reducescatter_time(self.nbytes, n, link)
        if self.kind == "alltoall":
            return alltoall_time(self.nbytes, n, link, self.offrank)
        raise ValueError(f"unknown collective kind {self.kind!r}")

    def link_bytes(self, world: int) -> float:
        return link_bytes(self.kind, self.nbytes, self.group or world, self.offrank)


def wire_time(
    collectives: Iterable[Collective], world: int, link: Link, *, local_size: int = 1, intra: Link | None = None
) -> float:
    """Seconds on the wire: the collectives one after the other.

    On one node (``local_size`` 1, or the whole world on one node) every collective runs
    on ``link``. On nodes of ``local_size`` ranks that share one ``link`` each (their NIC):

    * ``intra`` collectives run on the node's own ``intra`` link (default: ``link``);
    * ``cross`` collectives (one rank per node; the ``local_size`` such groups run at once
      and share the NIC) run at ``1 / local_size`` of ``link``'s bandwidth;
    * ``world`` rings (allreduce, all-gather, reduce-scatter over ranks numbered node by node) cross each
      node boundary once, so the NIC carries one rank's ring traffic: ``link`` as it is;
    * a ``world`` all-to-all sends every rank's messages to the other nodes' ranks through
      the NIC at once: ``local_size * (N - local_size) / N`` of a rank's bytes, on ``link``.
    """
    local_size = check_world(local_size)
    if local_size == 1 or local_size >= world:
        return sum(c.time(world, intra if (c.scope == "intra" and intra) else link) for c in collectives)
    shared = Link(link.bandwidth_bps / local_size, link.latency_s)
    total = 0.0
    for c in collectives:
        if c.scope == "intra":
            total += c.time(world, intra or link)
        elif c.scope == "cross":
            total += c.time(world, shared)
        elif c.kind == "alltoall":
            n = c.group or world
            remote = local_size * (n - local_size) / n * (c.nbytes if c.offrank is None else c.offrank * n / (n - 1))
            total += 8.0 * remote / link.bandwidth_bps + (n - 1) * link.latency_s
        else:
            total += c.time(world, link)
    return total


register_value("Link", Link)
