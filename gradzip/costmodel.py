"""A cost model of one data-parallel training step: ``compute + codec + wire``.

The terms (the full derivation is in ``docs/costmodel.md``):

* **compute**: the forward and backward pass of one step on one rank, in seconds.
  An input (measured by the user); the model does not estimate it.
* **codec**: gradzip's CPU/GPU time outside the collectives (error feedback,
  compress, framing, decode), from a :class:`CodecProfile`: per compressor an
  affine fit ``a + b*n`` per tensor of ``n`` elements, plus ``(N-1)*(c + d*n)``
  for exchanges that all-gather (every rank decodes every peer). The fit is
  *measured* (:func:`measure_codec`, on this machine) or read from a JSON file.
* **wire**: the sum over the step's collectives of the ring-algorithm times, with
  ``S`` the bytes one rank hands to the collective, ``B`` the link bandwidth in
  bits/s and ``alpha`` the one-way latency of one message between neighbours::

      allreduce(S)  = 2(N-1)/N * 8S/B + 2(N-1) * alpha
      allgather(S)  =   (N-1)   * 8S/B +  (N-1) * alpha

  A ring allreduce is a reduce-scatter then an all-gather, ``N-1`` steps each;
  every step sends one message of ``S/N`` bytes to the next rank, so each step
  costs one latency: ``2(N-1)`` latencies. A ring all-gather of ``S`` bytes per
  rank is ``N-1`` steps of ``S`` bytes: ``N-1`` latencies. Collectives of one
  step are added up: gloo runs one process group's collectives one after the
  other, and the model assumes no overlap with compute (the issue's form).

The bytes are never a formula per compressor: :func:`dry_run` runs the
compressor's real exchange on a sample tensor against a :class:`LoopbackComm`
(``N`` ranks that all send what this rank sends) and records every tensor the
exchange hands to a collective, exactly what :class:`gradzip.stats.Stats`
counts in a real run (size exchanges, headers and padding included).

Plain DDP (``method=None``) is one allreduce of each bucket's gradients and no
codec. gradzip methods add the engine's 4-byte non-finite flag allreduce per
bucket (:data:`ENGINE_FLAG_BYTES`; none where the bucket is summed as it is);
the first step's configuration check is left out (it happens once).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from .compressors.base import Compressor, TensorContext
from .exchange import Call
from .feedback import ErrorFeedback
from .stats import Stats

__all__ = [
    "Link",
    "parse_bandwidth",
    "parse_duration",
    "allreduce_time",
    "allgather_time",
    "Collective",
    "wire_time",
    "LoopbackComm",
    "DryRun",
    "dry_run",
    "CodecFit",
    "CodecProfile",
    "measure_codec",
    "layer_cost",
    "ddp_buckets",
    "StepCost",
    "WireCache",
    "step_cost",
    "ENGINE_FLAG_BYTES",
]

#: Bytes of the engine's per-call non-finite flag (one int32, allreduce MAX; see gradzip.engine).
ENGINE_FLAG_BYTES = 4


# -- the link ------------------------------------------------------------------------------
_BW_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_DIVISORS = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divide: 50 / 1e6 == 5e-5 exactly


def parse_bandwidth(value) -> float:
    """Bits per second from a number or a string such as ``"1Gbit"``, ``"100mbps"``, ``"10G"``, ``"2.5e9"``.

    Units are decimal (``k`` = 1e3) and in bits; ``"B"``/``"byte"`` suffixes mean bytes
    (``"125MB/s"`` = 1e9 bit/s).
    """
    if isinstance(value, bool):
        raise ValueError(f"bandwidth must be a number of bits/s or a string like '1Gbit', got {value!r}")
    if isinstance(value, (int, float)):
        bps = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(
            r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]?)(bit/s|bits/s|bit|bits|bps|b/s|B/s|B|byte/s|bytes/s|byte|bytes)?\s*",
            value,
        )
        if not m:
            raise ValueError(f"bandwidth must look like '1Gbit', '100Mbps' or '1e9', got {value!r}")
        num, prefix, unit = m.groups()
        bps = float(num) * _BW_UNITS[prefix.lower()] * (8.0 if unit and unit.startswith(("B", "byte")) else 1.0)
    else:
        raise ValueError(f"bandwidth must be a number of bits/s or a string like '1Gbit', got {value!r}")
    if not (math.isfinite(bps) and bps > 0):
        raise ValueError(f"bandwidth must be in (0, inf) bits/s, got {value!r}")
    return bps


def parse_duration(value, name: str = "duration") -> float:
    """Seconds from a number or a string such as ``"50us"``, ``"0.2ms"``, ``"1.5s"``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds or a string like '50us', got {value!r}")
    if isinstance(value, (int, float)):
        s = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*", value)
        if not m:
            raise ValueError(f"{name} must look like '50us', '2ms' or '0.1', got {value!r}")
        s = float(m.group(1)) / _TIME_DIVISORS[m.group(2) or ""]
    else:
        raise ValueError(f"{name} must be a number of seconds or a string like '50us', got {value!r}")
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(f"{name} must be in [0, inf) seconds, got {value!r}")
    return s


@dataclass(frozen=True)
class Link:
    """A network link: ``bandwidth_bps`` in bits/s, ``latency_s`` per message (one hop, one way)."""

    bandwidth_bps: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        bw, lat = self.bandwidth_bps, self.latency_s
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not (math.isfinite(bw) and bw > 0):
            raise ValueError(f"bandwidth_bps must be a number in (0, inf) bits/s, got {bw!r}")
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not (math.isfinite(lat) and lat >= 0):
            raise ValueError(f"latency_s must be a number in [0, inf) seconds, got {lat!r}")
        object.__setattr__(self, "bandwidth_bps", float(bw))
        object.__setattr__(self, "latency_s", float(lat))

    @classmethod
    def parse(cls, bandwidth, latency=0.0) -> "Link":
        """``Link.parse("1Gbit", "50us")``."""
        return cls(parse_bandwidth(bandwidth), parse_duration(latency, "latency"))

    def to_dict(self) -> dict:
        return {"bandwidth_bps": self.bandwidth_bps, "latency_s": self.latency_s}

    def __str__(self) -> str:
        return f"{_fmt_bw(self.bandwidth_bps)}, {self.latency_s * 1e6:g} us"


def _fmt_bw(bps: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def _check_world(world: int) -> int:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world_size must be an integer in [1, inf), got {world!r}")
    return world


def allreduce_time(nbytes: float, world: int, link: Link) -> float:
    """Ring allreduce of ``nbytes`` per rank: ``2(N-1)/N * 8S/B + 2(N-1) * latency``."""
    n = _check_world(world)
    if n == 1:
        return 0.0
    return 2.0 * (n - 1) / n * 8.0 * nbytes / link.bandwidth_bps + 2.0 * (n - 1) * link.latency_s


def allgather_time(nbytes: float, world: int, link: Link) -> float:
    """Ring all-gather of ``nbytes`` from every rank: ``(N-1) * 8S/B + (N-1) * latency``."""
    n = _check_world(world)
    if n == 1:
        return 0.0
    return (n - 1) * 8.0 * nbytes / link.bandwidth_bps + (n - 1) * link.latency_s


@dataclass(frozen=True)
class Collective:
    """One collective of a protocol: ``kind`` is ``"allreduce"`` or ``"allgather"``;
    ``nbytes`` the bytes this rank hands to it (for an all-gather: its own part)."""

    kind: str
    nbytes: int
    control: bool = False

    def time(self, world: int, link: Link) -> float:
        if self.kind == "allreduce":
            return allreduce_time(self.nbytes, world, link)
        if self.kind == "allgather":
            return allgather_time(self.nbytes, world, link)
        raise ValueError(f"unknown collective kind {self.kind!r}")


def wire_time(collectives: Iterable[Collective], world: int, link: Link) -> float:
    """Seconds on the wire: the collectives one after the other."""
    return sum(c.time(world, link) for c in collectives)


# -- dry runs: the real exchange against a loopback communicator ------------------------------
class _DoneWork:
    """A finished collective (what ``LoopbackComm`` returns in place of a ``dist.Work``)."""

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        f = torch.futures.Future()
        f.set_result(None)
        return f


class LoopbackComm:
    """Stands in for :class:`gradzip.comm.Communicator` with ``world_size`` ranks that all
    send exactly what this rank sends. Nothing leaves the process.

    Every collective is logged as a :class:`Collective` and counted in ``stats``
    like the real communicator counts it. Results are filled in by
    :meth:`complete` (the driver calls it before resuming the protocol): an
    allreduce-SUM multiplies by ``world_size``, MAX/MIN leave the tensor as is,
    an all-gather repeats this rank's part ``world_size`` times. A driver that
    only wants the bytes never completes the last round, so a dry run at
    ``world_size = 1024`` allocates the gathered buffer but never fills or decodes it.
    """

    def __init__(self, world_size: int, stats: Stats | None = None) -> None:
        self.world_size = _check_world(world_size)
        self.rank = 0
        self.stats = stats if stats is not None else Stats()
        self.log: list[Collective] = []
        self._todo: list = []

    def _count(self, kind: str, nbytes: int, control: bool) -> None:
        self.stats.add(bytes_sent=nbytes, collectives=1, bytes_control=nbytes if control else 0)
        self.log.append(Collective(kind, nbytes, control))

    def allreduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, *, control: bool = False):
        self._count("allreduce", t.numel() * t.element_size(), control)
        if op == dist.ReduceOp.SUM and self.world_size > 1:
            self._todo.append(lambda: t.mul_(self.world_size))
        elif op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            raise ValueError(f"LoopbackComm supports SUM, MAX and MIN, got {op}")
        return _DoneWork()

    def allgather(self, out: torch.Tensor, inp: torch.Tensor, *, control: bool = False):
        self._count("allgather", inp.numel() * inp.element_size(), control)
        if out.numel() != self.world_size * inp.numel():
            raise ValueError(f"allgather output has {out.numel()} elements, expected {self.world_size} x {inp.numel()}")
        self._todo.append(lambda: out.view(self.world_size, -1).copy_(inp.reshape(1, -1)))
        return _DoneWork()

    def complete(self) -> None:
        todo, self._todo = self._todo, []
        for fn in todo:
            fn()


@dataclass
class DryRun:
    collectives: list
    codec_seconds: float
    rounds: int
    out: torch.Tensor | None = None
    #: Every tensor was summed as it is (``Call.plain``, known after the first round): the
    #: engine then sends no non-finite flag for the call.
    plain: bool = False

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.collectives)

    def wire_time(self, world: int, link: Link) -> float:
        return wire_time(self.collectives, world, link)


def dry_run(
    comp: Compressor,
    tensors: Sequence[torch.Tensor],
    *,
    world_size: int,
    names: Sequence[str] | None = None,
    error_feedback: bool | None = None,
    decode: bool = True,
    stores: dict | None = None,
    step: int = 0,
) -> DryRun:
    """Run ``comp``'s exchange on ``tensors`` as one call among ``world_size`` identical ranks.

    Returns the collectives it launched (bytes as handed to ``torch.distributed``),
    the codec seconds it spent (``call.codec()`` blocks), and, with ``decode``, its
    flat output. With ``decode=False`` the protocol is stopped once its last round
    is launched: the bytes are known, no peer is decoded. ``error_feedback=None``
    follows ``comp.biased``, as the engine does. ``stores`` maps names to the
    per-tensor state dicts to use (fresh ones by default, so nothing real is touched).
    The input tensors are not modified.
    """
    tensors = list(tensors)
    names = [f"t{i}" for i in range(len(tensors))] if names is None else list(names)
    if len(names) != len(tensors):
        raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
    comm = LoopbackComm(world_size)
    ef = comp.biased if error_feedback is None else bool(error_feedback)
    stores = {} if stores is None else stores
    call = Call(
        comm=comm,
        names=names,
        tensors=tensors,
        contexts=[
            TensorContext(name=n, step=step, dtype=t.dtype, store=stores.setdefault(n, {}), rank=0, world_size=world_size)
            for n, t in zip(names, tensors)
        ],
        memory=ErrorFeedback() if ef else None,
        out_dtype=tensors[0].dtype if tensors else torch.float32,
    )
    gen = comp.exchange(call)
    rounds, out, plain = 0, None, None
    try:
        while True:
            rnd = next(gen)
            rounds += 1
            plain = call.all_plain if plain is None else plain  # as the engine decides: after round 1
            if rnd.last and not decode:
                break
            comm.complete()
    except StopIteration as stop:
        out = stop.value
    finally:
        gen.close()
    return DryRun(comm.log, comm.stats.codec_seconds, rounds, out, call.all_plain if plain is None else plain)


# -- codec profile -------------------------------------------------------------------------
@dataclass
class CodecFit:
    """Codec seconds for one tensor of ``n`` elements on ``N`` ranks:
    ``encode_s + encode_s_per_elem * n + (N - 1) * (peer_s + peer_s_per_elem * n)``."""

    encode_s: float
    encode_s_per_elem: float
    peer_s: float = 0.0
    peer_s_per_elem: float = 0.0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{k} must be a number in [0, inf) seconds, got {v!r}")

    def seconds(self, numel: int, world: int) -> float:
        return (
            self.encode_s
            + self.encode_s_per_elem * numel
            + max(world - 1, 0) * (self.peer_s + self.peer_s_per_elem * numel)
        )


def _sample(shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(dtype)


def sample_shape(numel: int) -> tuple[int, int]:
    """The 2-D shape a profile measures ``numel`` elements in: ``(numel // m, m)`` with
    ``m`` the largest power of two not above ``sqrt(numel)`` (square for powers of 4)."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 4:
        raise ValueError(f"profile sizes must be integers in [4, inf), got {numel!r}")
    m = 1 << (int(math.isqrt(numel)).bit_length() - 1)
    return (numel // m, m)


def _fit_line(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 - slope * x0, 0.0), slope


def measure_codec(
    comp: Compressor,
    *,
    error_feedback: bool | None = None,
    sizes: tuple[int, int] = (4096, 1 << 20),
    worlds: tuple[int, int] = (1, 8),
    repeats: int = 5,
    threads: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[CodecFit, dict]:
    """Time ``comp``'s codec on this machine; returns the fit and the raw timings.

    For each size ``n`` in ``sizes`` (a ``sample_shape(n)`` Gaussian tensor) and each
    world size ``W`` in ``worlds``, runs :func:`dry_run` once to warm up, then
    ``repeats`` times, and keeps the fastest codec seconds (the least disturbed by
    other processes; a shared machine inflates the mean, not the minimum). The
    line through the two sizes at ``worlds[0]`` gives ``encode_s`` and
    ``encode_s_per_elem``. If the exchange all-gathers, the extra seconds at
    ``worlds[1]`` per extra peer give ``peer_s`` and ``peer_s_per_elem``; an
    exchange that only allreduces decodes once (0 per peer). Negative intercepts or
    slopes (timing noise) are clipped to 0. ``threads`` sets torch's intra-op
    threads while timing (``None``: leave them as they are); CPU codecs run one
    rank per core or so, and more threads than free cores makes timings erratic.
    """
    n0, n1 = sizes
    w0, w1 = worlds
    if not (4 <= n0 < n1):
        raise ValueError(f"sizes must be two integers 4 <= n0 < n1, got {sizes!r}")
    if not (1 <= w0 < w1):
        raise ValueError(f"worlds must be two integers 1 <= w0 < w1, got {worlds!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer in [1, inf), got {repeats!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be None or an integer in [1, inf), got {threads!r}")
    raw: dict[str, float] = {}
    gathers = False
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for n in (n0, n1):
            x = _sample(sample_shape(n), dtype, seed=n)
            for w in (w0, w1):
                times = []
                for r in range(repeats + 1):
                    d = dry_run(comp, [x], world_size=w, names=["sample"], error_feedback=error_feedback)
                    gathers = gathers or any(c.kind == "allgather" for c in d.collectives)
                    if r:
                        times.append(d.codec_seconds)
                raw[f"n={n},W={w}"] = min(times)
    finally:
        torch.set_num_threads(saved)
    a, b = _fit_line(n0, raw[f"n={n0},W={w0}"], n1, raw[f"n={n1},W={w0}"])
    c = d_ = 0.0
    if gathers:
        p0 = (raw[f"n={n0},W={w1}"] - raw[f"n={n0},W={w0}"]) / (w1 - w0)
        p1 = (raw[f"n={n1},W={w1}"] - raw[f"n={n1},W={w0}"]) / (w1 - w0)
        c, d_ = _fit_line(n0, p0, n1, p1)
    return CodecFit(a, b, c, d_), raw


PROFILE_KIND = "gradzip-codec-profile"
PROFILE_VERSION = 1


def _machine() -> dict:
    from .bench import machine  # noqa: PLC0415 - heavy module, only when writing a profile

    return machine()


class CodecProfile:
    """Codec fits per (compressor config, error feedback), measured or loaded.

    ``fit(comp)`` returns the stored fit, or measures it on this machine when
    ``measure_missing`` (the default) and stores it; otherwise it raises
    ``KeyError`` naming the compressor. ``save(path)``/``load(path)`` use the JSON
    schema in ``docs/costmodel.md``; a file records the machine it was measured on.
    """

    def __init__(
        self,
        entries: dict | None = None,
        *,
        machine: dict | None = None,
        measure_missing: bool = True,
        sizes: tuple[int, int] = (4096, 1 << 20),
        worlds: tuple[int, int] = (1, 8),
        repeats: int = 5,
        threads: int | None = None,
    ) -> None:
        self.entries: dict[str, dict] = dict(entries or {})
        self.machine = machine
        self.measure_missing = measure_missing
        self.sizes = tuple(sizes)
        self.worlds = tuple(worlds)
        self.repeats = repeats
        self.threads = threads

    @staticmethod
    def key(comp: Compressor, error_feedback: bool | None = None) -> str:
        ef = comp.biased if error_feedback is None else bool(error_feedback)
        return json.dumps({"config": comp.config(), "error_feedback": ef}, sort_keys=True, default=str)

    def add(self, comp: Compressor, fit: CodecFit, *, error_feedback: bool | None = None, raw: dict | None = None) -> None:
        ef = comp.biased if error_feedback is None else bool(error_feedback)
        self.entries[self.key(comp, ef)] = {
            "method": repr(comp),
            "config": comp.config(),
            "error_feedback": ef,
            **asdict(fit),
            "best_s": dict(raw or {}),
        }

    def fit(self, comp: Compressor, error_feedback: bool | None = None) -> CodecFit:
        k = self.key(comp, error_feedback)
        e = self.entries.get(k)
        if e is None:
            if not self.measure_missing:
                raise KeyError(f"the codec profile has no entry for {comp!r} (error_feedback={error_feedback})")
            fit, raw = measure_codec(
                comp,
                error_feedback=error_feedback,
                sizes=self.sizes,
                worlds=self.worlds,
                repeats=self.repeats,
                threads=self.threads,
            )
            self.add(comp, fit, error_feedback=error_feedback, raw=raw)
            return fit
        return CodecFit(e["encode_s"], e["encode_s_per_elem"], e.get("peer_s", 0.0), e.get("peer_s_per_elem", 0.0))

    def to_dict(self) -> dict:
        return {
            "kind": PROFILE_KIND,
            "version": PROFILE_VERSION,
            "machine": self.machine if self.machine is not None else _machine(),
            "sizes": list(self.sizes),
            "worlds": list(self.worlds),
            "repeats": self.repeats,
            "statistic": "min",
            "threads": self.threads if self.threads is not None else torch.get_num_threads(),
            "entries": self.entries,
        }

    def save(self, path: str) -> None:
        d = self.to_dict()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(d, f, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict, *, measure_missing: bool = False) -> "CodecProfile":
        if not isinstance(d, dict) or d.get("kind") != PROFILE_KIND:
            raise ValueError(f"not a gradzip codec profile (expected kind {PROFILE_KIND!r})")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"codec profile version {d.get('version')!r} is not supported (expected {PROFILE_VERSION})")
        prof = cls(
            d.get("entries", {}),
            machine=d.get("machine"),
            measure_missing=measure_missing,
            sizes=tuple(d.get("sizes", (4096, 1 << 20))),
            worlds=tuple(d.get("worlds", (1, 8))),
            repeats=int(d.get("repeats", 5)),
            threads=d.get("threads"),
        )
        for k, e in prof.entries.items():  # validate every fit now, not deep inside a step
            try:
                CodecFit(e["encode_s"], e["encode_s_per_elem"], e.get("peer_s", 0.0), e.get("peer_s_per_elem", 0.0))
            except (KeyError, TypeError) as exc:
                raise ValueError(f"codec profile entry {e.get('method', k)!r} is incomplete: {exc}") from None
        return prof

    @classmethod
    def load(cls, path: str, *, measure_missing: bool = False) -> "CodecProfile":
        with open(path) as f:
            return cls.from_dict(json.load(f), measure_missing=measure_missing)


def as_profile(profile) -> CodecProfile:
    """``None`` (measure on demand), a :class:`CodecProfile`, a dict or a JSON path."""
    if profile is None:
        return CodecProfile()
    if isinstance(profile, CodecProfile):
        return profile
    if isinstance(profile, dict):
        return CodecProfile.from_dict(profile)
    if isinstance(profile, (str, os.PathLike)):
        return CodecProfile.load(os.fspath(profile))
    raise ValueError(f"profile must be None, a CodecProfile, a dict or a JSON path, got {type(profile).__name__}")


# -- one layer -----------------------------------------------------------------------------
def layer_cost(
    comp: Compressor,
    x: torch.Tensor,
    world: int,
    link: Link,
    profile: CodecProfile,
    *,
    error_feedback: bool | None = None,
    sample_is_compensated: bool = False,
    latency_share: float = 1.0,
) -> float:
    """Seconds to exchange one tensor ``x`` with ``comp`` on ``world`` ranks: codec + wire.

    The bytes come from a dry run of ``comp``'s exchange on ``x`` alone (``x`` is
    not modified). The tensors of a DDP bucket share their collectives, so the
    latency terms are charged in proportion: ``latency_share`` in [0, 1] (the
    tensor's part of its bucket; 1 for a tensor alone) multiplies the link's
    latency. With ``sample_is_compensated`` the tensor already holds gradient plus
    residual (the policy passes the real compensated gradient): the dry run then
    adds no error feedback of its own, while the codec time is still the profile's
    for ``error_feedback``.
    """
    if isinstance(latency_share, bool) or not isinstance(latency_share, (int, float)) or not (0.0 <= latency_share <= 1.0):
        raise ValueError(f"latency_share must be a number in [0, 1], got {latency_share!r}")
    ef = comp.biased if error_feedback is None else bool(error_feedback)
    run = dry_run(comp, [x], world_size=world, error_feedback=False if sample_is_compensated else ef, decode=False)
    shared = Link(link.bandwidth_bps, link.latency_s * latency_share)
    return profile.fit(comp, ef).seconds(x.numel(), world) + run.wire_time(world, shared)


# -- one step --------------------------------------------------------------------------------
def ddp_buckets(nbytes: Sequence[int], bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0) -> list[list[int]]:
    """DDP's bucket assignment by size: indices grouped in reverse parameter order.

    Gradients are ready roughly in reverse order of the parameters, so DDP fills
    buckets from the last parameter. A tensor joins the open bucket; the bucket
    closes once it holds at least its cap (the first bucket's cap is
    ``first_bucket_mb``, torch's ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB).
    """
    for name, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a number in (0, inf), got {v!r}")
    caps = [first_bucket_mb * 2**20, bucket_cap_mb * 2**20]
    buckets, cur, size = [], [], 0
    for i in reversed(range(len(nbytes))):
        cur.append(i)
        size += nbytes[i]
        if size >= caps[min(len(buckets), 1)]:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


@dataclass
class StepCost:
    method: str
    world: int
    compute_s: float
    codec_s: float
    wire_s: float
    bytes_per_rank: int
    collectives: int
    buckets: int
    detail: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.codec_s + self.wire_s

    @property
    def efficiency(self) -> float:
        """Weak-scaling efficiency: one rank's step (compute only) over this step."""
        return self.compute_s / self.total_s if self.total_s > 0 else 1.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(total_s=self.total_s, efficiency=self.efficiency)
        return d


class WireCache:
    """Collective logs of dry runs, keyed by (compressor, error feedback, shapes, dtype, world).

    With ``probe_worlds=(a, b)``, a bucket is dry-run at both ``a`` and ``b`` first;
    if the two logs are equal, the bytes are taken not to depend on the world size
    and the log is reused for every world size (a method whose bytes do depend on
    it, such as ``Int8(allreduce=True)``, gets a dry run per world size).
    """

    def __init__(self, probe_worlds: tuple[int, int] | None = None) -> None:
        self.probe_worlds = probe_worlds
        self._logs: dict = {}
        self._invariant: dict = {}
        self.dry_runs = 0

    def _run(self, comp, shapes, dtype, world, ef, seed) -> tuple:
        key = (CodecProfile.key(comp, ef), shapes, str(dtype), world)
        if key not in self._logs:
            xs = [_sample(s, dtype, seed=seed + j) for j, s in enumerate(shapes)]
            names = [f"p{seed + j}" for j in range(len(shapes))]
            run = dry_run(comp, xs, world_size=world, names=names, error_feedback=ef, decode=False)
            self._logs[key] = (run.collectives, run.plain)
            self.dry_runs += 1
        return self._logs[key]

    def collectives(self, comp, shapes, world, *, error_feedback=None, dtype=torch.float32, seed: int = 0) -> list:
        """The collectives of a call of ``comp`` on ``shapes`` among ``world`` ranks."""
        return self.call(comp, shapes, world, error_feedback=error_feedback, dtype=dtype, seed=seed)[0]

    def call(self, comp, shapes, world, *, error_feedback=None, dtype=torch.float32, seed: int = 0) -> tuple:
        """``(collectives, plain)`` of a call of ``comp`` on ``shapes`` among ``world`` ranks;
        ``plain``: every tensor summed as it is (``DryRun.plain``: the engine sends no flag)."""
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        ef = comp.biased if error_feedback is None else bool(error_feedback)
        if self.probe_worlds is None or world == 1:
            return self._run(comp, shapes, dtype, world, ef, seed)
        base = (CodecProfile.key(comp, ef), shapes, str(dtype))
        if base not in self._invariant:
            a, b = self.probe_worlds
            self._invariant[base] = self._run(comp, shapes, dtype, a, ef, seed) == self._run(comp, shapes, dtype, b, ef, seed)
        if self._invariant[base]:
            return self._run(comp, shapes, dtype, self.probe_worlds[0], ef, seed)
        return self._run(comp, shapes, dtype, world, ef, seed)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def step_cost(
    method: Compressor | None,
    layers: Sequence[tuple[str, tuple]],
    world: int,
    link: Link,
    compute_s: float,
    profile: CodecProfile | None = None,
    *,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    dtype: torch.dtype = torch.float32,
    cache: WireCache | None = None,
    label: str | None = None,
) -> StepCost:
    """Predict one step of data-parallel training of ``layers`` (``[(name, shape)]``).

    ``method=None`` is plain DDP. A :class:`gradzip.policy.Policy` is costed per
    bucket by its partition: each group's collectives come from a dry run of the
    sub-compressor on the group, each tensor's codec from the sub-compressor's fit
    (with error feedback on for the biased sub-compressors of a biased policy: the
    policy runs its unbiased routes, such as plain allreduce, without residuals). A
    bucket whose call sums every tensor as it is (``DryRun.plain``) sends no engine
    flag. On one rank the step is ``compute_s`` alone.
    """
    from .policy import Policy  # noqa: PLC0415 - policy imports this module

    _check_world(world)
    if isinstance(compute_s, bool) or not isinstance(compute_s, (int, float)) or not (math.isfinite(compute_s) and compute_s >= 0):
        raise ValueError(f"compute_s must be a number in [0, inf) seconds, got {compute_s!r}")
    name = label or ("DDP" if method is None else repr(method))
    layers = [(n, tuple(int(d) for d in s)) for n, s in layers]
    buckets = ddp_buckets([_nbytes(s, dtype) for _, s in layers], bucket_cap_mb, first_bucket_mb)
    if world == 1:
        return StepCost(name, 1, float(compute_s), 0.0, 0.0, 0, 0, len(buckets))
    cache = cache if cache is not None else WireCache()
    profile = profile if profile is not None else CodecProfile()
    colls: list[Collective] = []
    codec = 0.0
    groups_used: dict[str, int] = {}
    for b in buckets:
        if method is None:
            colls.append(Collective("allreduce", sum(_nbytes(layers[i][1], dtype) for i in b)))
            continue
        if isinstance(method, Policy):
            parts: dict[int, list[int]] = {}
            bucket_numel = sum(math.prod(layers[i][1]) for i in b)
            for i in b:
                lname, shape = layers[i]
                share = math.prod(shape) / bucket_numel if bucket_numel else 1.0
                comp = method.choose(lname, shape, world_size=world, latency_share=share)
                parts.setdefault(method.index_of(comp), []).append(i)
            groups = [(method.candidates[g], parts[g]) for g in sorted(parts)]
        else:
            groups = [(method, b)]
        plain = True
        for comp, idx in groups:
            groups_used[repr(comp)] = groups_used.get(repr(comp), 0) + len(idx)
            # Error feedback as the engine runs it: for biased compressors, and within a policy
            # for its biased routes only (its unbiased routes run without residuals).
            ef = comp.biased
            got, alone = cache.call(comp, [layers[i][1] for i in idx], world, error_feedback=ef, dtype=dtype, seed=idx[0])
            colls += got
            plain = plain and alone
            fit = profile.fit(comp, ef)
            codec += sum(fit.seconds(math.prod(layers[i][1]), world) for i in idx)
        if not plain:  # the engine's flag (a bucket summed as it is needs none; see gradzip.engine)
            colls.append(Collective("allreduce", ENGINE_FLAG_BYTES, control=True))
    wire = wire_time(colls, world, link)
    detail = {"tensors_per_compressor": groups_used} if isinstance(method, Policy) else {}
    return StepCost(
        name, world, float(compute_s), codec, wire, sum(c.nbytes for c in colls), len(colls), len(buckets), detail
    )

