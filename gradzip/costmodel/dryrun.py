"""Dry runs: a protocol's real exchange against a loopback communicator.

The bytes of a method are never a formula per codec: :func:`dry_run` runs the
method's protocol on sample tensors against a :class:`LoopbackComm` (``N`` ranks
that all send what this rank sends) and records every tensor the exchange hands
to a collective, exactly what :class:`gradzip.stats.Stats` counts in a real run
(size exchanges, headers and padding included).

A dry run runs the protocol without the engine, so its codec seconds leave the engine's
checks out; ``dry_run(..., flag=True)`` offers the engine's non-finite flag to the protocol
as the engine does (``DryRun.flag_carried``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codecs.base import TensorContext
from ..feedback import ErrorFeedback
from ..protocols.base import Call, as_protocol
from ..stats import Stats
from ..wire import run_view
from .link import Collective, Link, check_world, wire_time

__all__ = ["LoopbackComm", "DryRun", "dry_run"]


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

    def __init__(self, world_size: int, stats: Stats | None = None, *, scope: str = "world", log=None) -> None:
        self.world_size = check_world(world_size)
        self.rank = 0
        self.stats = stats if stats is not None else Stats()
        self.scope = scope
        self.log: list[Collective] = [] if log is None else log
        self._todo: list = []
        self._children: list = []

    def split(self, local_size: int):
        """Loopback stand-ins of ``Communicator.split``: the node's ranks and the ranks of the
        same local rank on every node, logging into this communicator's log."""
        node = LoopbackComm(local_size, self.stats, scope="intra", log=self.log)
        cross = LoopbackComm(self.world_size // local_size, self.stats, scope="cross", log=self.log)
        self._children = [node, cross]
        return node, cross

    def _count(self, kind: str, nbytes: int, control: bool, offrank: float | None = None) -> None:
        group = None if self.scope == "world" else self.world_size
        c = Collective(kind, nbytes, control, offrank, self.scope, group)
        self.stats.add(
            bytes_sent=nbytes,
            collectives=1,
            bytes_control=nbytes if control else 0,
            bytes_link=c.link_bytes(self.world_size),
        )
        self.log.append(c)

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

    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None, *, control: bool = False):
        """Every rank sends what this rank sends, so this rank receives its own message to
        itself from each of them."""
        n = self.world_size
        mine = in_splits[0] if in_splits is not None else inp.numel() // n
        self._count("alltoall", inp.numel() * inp.element_size(), control, (inp.numel() - mine) * inp.element_size())
        want = out_splits if out_splits is not None else [out.numel() // n] * n
        if any(w != mine for w in want):
            raise ValueError(f"loopback all-to-all receives {mine} elements from each rank, the output expects {want}")
        self._todo.append(lambda: out.view(n, -1).copy_(inp[:mine].reshape(1, -1)) if mine else None)
        return _DoneWork()

    def complete(self) -> None:
        todo, self._todo = self._todo, []
        for fn in todo:
            fn()
        for child in self._children:
            child.complete()


@dataclass
class DryRun:
    collectives: list
    codec_seconds: float
    rounds: int
    out: torch.Tensor | None = None
    #: The protocol sums every tensor as it is (``Protocol.plain``): the engine then sends
    #: no non-finite flag for the call.
    plain: bool = False
    #: The protocol carried the engine's non-finite flag in its first round
    #: (``Call.take_flag``): the engine then sends no flag of its own either.
    flag_carried: bool = False
    #: Wall seconds of the whole dry run, and of the loopback's stand-ins for the collectives
    #: in it (``LoopbackComm.complete``: a multiply or a copy per round); with ``sync`` given,
    #: the device is synchronized at the start, the end and around each stand-in.
    wall_seconds: float = 0.0
    loopback_seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.collectives)

    def wire_time(self, world: int, link: Link, **cluster) -> float:
        return wire_time(self.collectives, world, link, **cluster)


def dry_run(
    method,
    tensors: Sequence[torch.Tensor],
    *,
    world_size: int,
    names: Sequence[str] | None = None,
    error_feedback: bool | None = None,
    decode: bool = True,
    stores: dict | None = None,
    step: int = 0,
    sync: Callable[[], None] | None = None,
    flag: bool = True,
    memory: ErrorFeedback | None = None,
    bucket: bool | torch.Tensor = False,
) -> DryRun:
    """Run ``method``'s protocol on ``tensors`` as one call among ``world_size`` identical ranks.

    Returns the collectives it launched (bytes as handed to ``torch.distributed``),
    the codec seconds it spent (``call.codec()`` blocks), and, with ``decode``, its
    flat output. With ``decode=False`` the protocol is stopped once its last round
    is launched, and a nested protocol (``Hierarchical``'s inner one) once its own
    last round is: the bytes are known, no peer is decoded. ``error_feedback=None``
    follows ``method.biased``, as the engine does. ``stores`` maps names to the
    per-tensor state dicts to use (fresh ones by default, so nothing real is touched).
    The input tensors are not modified. ``sync`` (e.g. ``torch.cuda.synchronize``) is
    called before the clocks are read (:attr:`DryRun.wall_seconds`). ``flag``: offer the
    protocol the engine's non-finite flag (``Call.take_flag``), as the engine does for a
    call that is not ``plain``; False for a route that runs in another protocol's sub-call.
    ``memory``: the error-feedback memory to use with error feedback on (default a fresh one);
    the run sets its residuals as a step does, so a caller that times repeated runs can
    ``restore()`` it after each: every run then starts from the same residuals and writes
    into the buffer the run before freed, as a steady-state step does (:mod:`gradzip.feedback`),
    not into a fresh one.
    ``bucket``: lay the tensors out as DDP hands the engine a bucket: copied (before the clock
    starts) into one flat buffer, the call's tensors its views and the buffer its ``dest``. A
    plain protocol (Identity) then sums that buffer as it is, as in a real step, instead of
    copying the tensors into a new one. Needs tensors of one dtype. ``bucket`` a tensor: the
    flat buffer the tensors already are, back to back, as views (a caller timing repeated steps
    lays its buckets out once): used as the bucket as it is, so it receives the result, as
    DDP's bucket does, and the tensors hold it afterwards.
    """
    sync = sync or (lambda: None)
    tensors = list(tensors)
    dest = None
    if isinstance(bucket, torch.Tensor):
        whole = run_view(tensors)
        if (
            whole is None
            or not bucket.is_contiguous()
            or whole.data_ptr() != bucket.data_ptr()
            or whole.numel() != bucket.numel()
            or whole.dtype != bucket.dtype
        ):
            raise ValueError("dry_run(bucket=<tensor>) needs the tensors to be that flat buffer's views, back to back")
        dest = bucket.view(-1)
    elif bucket and tensors:
        if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
            raise ValueError("dry_run(bucket=True) needs tensors of one dtype on one device, as in a DDP bucket")
        dest = torch.cat([t.reshape(-1) for t in tensors])
        views, pos = [], 0
        for t in tensors:
            views.append(dest[pos : pos + t.numel()].view(t.shape))
            pos += t.numel()
        tensors = views
    sync()
    t_start = time.perf_counter()
    loopback = 0.0
    names = [f"t{i}" for i in range(len(tensors))] if names is None else list(names)
    if len(names) != len(tensors):
        raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
    comm = LoopbackComm(world_size)
    ef = method.biased if error_feedback is None else bool(error_feedback)
    protocol = as_protocol(method, world_size, feedback=ef)
    stores = {} if stores is None else stores
    call = Call(
        comm=comm,
        names=names,
        tensors=tensors,
        contexts=[
            TensorContext(
                name=n, step=step, dtype=t.dtype, store=stores.setdefault(n, {}), rank=0, world_size=world_size
            )
            for n, t in zip(names, tensors)
        ],
        memory=(memory if memory is not None else ErrorFeedback()) if ef else None,
        out_dtype=tensors[0].dtype if tensors else torch.float32,
        make_context=lambda k, d: TensorContext(
            name=k, step=step, dtype=d, store=stores.setdefault(k, {}), rank=0, world_size=world_size
        ),
        bytes_only=not decode,
        dest=dest,
    )
    plain = protocol.plain(call)
    if flag and not plain:  # as the engine asks: the protocol may carry the flag (its bytes are counted)
        call.flag_source = lambda: 0
    gen = protocol.exchange(call)
    rounds, out = 0, None
    try:
        while True:
            rnd = next(gen)
            rounds += 1
            if rnd.last and not decode:
                break
            sync()
            t0 = time.perf_counter()
            comm.complete()
            sync()
            loopback += time.perf_counter() - t0
    except StopIteration as stop:
        out = stop.value
    except ValueError as err:
        if not str(err).startswith("corrupt"):
            raise
        raise ValueError(
            f"{err} (dry run: the loopback gives every peer this rank's own messages, which do not "
            "decode where the owners' pieces differ in size; decode=False counts the bytes without decoding)"
        ) from err
    finally:
        gen.close()
    sync()
    wall = time.perf_counter() - t_start
    carried = call.flag_seen is not None
    return DryRun(comm.log, comm.stats.codec_seconds, rounds, out, plain, carried, wall, loopback)
