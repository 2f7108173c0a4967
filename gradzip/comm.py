"""Collectives, run asynchronously, in one deterministic order on every rank.

gloo and NCCL match collectives by the order in which they are issued on a
process group. A protocol that talks more than once (size exchange, then the
payload) must therefore never issue its second round from a future callback:
callbacks run on other threads, and two ranks could then interleave bucket 2's
first round with bucket 1's second round differently (this is how torch's own
``powerSGD_hook`` hangs on gloo with several buckets).

Here a protocol is a generator. Each ``yield Round(works, last)`` hands over the
collectives it has just launched. The :class:`Communicator` issues every round
from the thread that calls :meth:`Communicator.submit` / :meth:`flush`, in
submission order:

* ``submit(p)`` starts ``p`` (its first round). On NCCL it first drives every
  earlier protocol up to its last round (waiting on their earlier rounds: a
  device-side wait, which does not hold up the host). On gloo that wait would
  block the backward pass on the host until every rank had reached the same
  bucket, so later rounds are deferred to ``flush()`` instead (``defer``);
* ``flush()`` drives all pending protocols to their last round, in submission
  order; front ends call it after the last bucket of a step;
* only the *last* round completes through a future callback, which decodes but
  never communicates.

So on every rank the collectives go out in the same order, and each protocol's
result arrives as a ``torch.futures.Future`` with no ``.wait()`` in a callback.

On CUDA the last round's callback runs on a stream from torch's pool (the one NCCL's
and gloo's CUDA futures hand their callbacks), so the decode it launches is ordered
after the collective but not before the caller's stream. The protocol's future is
therefore made CUDA-aware on the call's device (``submit(..., device=)``): setting its
result records an event on the callback's stream, and ``wait()`` or ``then()`` on it
makes the caller's current stream wait for that event (DDP's reducer, the
DistributedOptimizer and LocalSGD read the result on their own streams).

A :class:`Communicator` also counts the bytes of every collective (:mod:`gradzip.stats`),
``split(L)`` gives the node and cross communicators of ``Hierarchical``, and where ``trace``
is a list each collective's kind, bytes, issue and completion times are appended to it
(``benchmarks/overlap.py``).

Leaving the process. gloo completes a collective on its worker thread and runs the future's
callbacks there: the last round's decode (``finish``) and the byte accounting are Python, so
that thread takes the GIL. Setting the protocol's future releases the GIL and wakes the front
end (DDP's backward), whose script can then end and the interpreter start finalizing while the
worker has still to take the GIL back to return from the callback. The worker takes it once
more when it frees the work, if it holds the last reference to a tensor whose Python object
Python had let go first. CPython before 3.14 answers a thread that takes the GIL during
finalization with ``pthread_exit``, whose unwinding through torch's C++ frames ends in
``std::terminate``: "terminate called without an active exception", SIGABRT, with the job's
work done. So every collective gradzip issues (a communicator's, and through :func:`track`
gradzip.sync's and gradzip.horovod's) is tracked, with the CPU tensors handed to it, until
it is completed (torch marks a gloo work completed only after its future's callbacks have
returned) and let go by the thread that ran it; and, once the first is issued, an ``atexit``
handler waits for the rest while the interpreter is whole (:func:`wait_for_collectives`).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import gradzip.kernels as K

from .stats import Stats
from .wire import pad_message

#: The engine's per-call non-finite flag: one int32, allreduce MAX.
FLAG_DTYPE = torch.int32
FLAG_BYTES = 4


@dataclass
class Round:
    works: list
    last: bool = False


Protocol = Generator[Round, None, Any]


class _Pending:
    __slots__ = ("gen", "round", "future")

    def __init__(self, gen: Protocol, future: torch.futures.Future) -> None:
        self.gen = gen
        self.future = future
        self.round: Round | None = None


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> Any:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


_SPLITS: dict = {}  # (group, world, local size) -> (node groups, cross groups)


# -- leaving the process (the module docstring) ---------------------------------------------
#: Seconds the exit handler waits for collectives whose callbacks are running (their results
#: arrived; decoding takes milliseconds, longer on a loaded machine).
EXIT_CALLBACKS_S = 60.0
#: Seconds it waits for collectives still in flight at exit (not a clean exit: a step left
#: midway by an exception, a peer gone). Their callbacks, if they ever run, may still abort.
EXIT_IN_FLIGHT_S = 5.0
#: Seconds it waits for the worker threads to let go of completed collectives (microseconds
#: normally; a descheduled thread on a loaded machine takes longer).
EXIT_RELEASE_S = 10.0


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work that cannot say is not waited for
        return True


def _arrived(work) -> bool:
    """The collective's result is there (its future's callbacks may still be running)."""
    try:
        return bool(work.get_future().done())
    except Exception:  # noqa: BLE001
        return True


def _holds(tensors: tuple) -> int:
    """References to ``tensors`` and to their storages: fewer once a work that held them is freed."""
    return sum(t._use_count() + torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors)


def _held(tensors) -> tuple:
    """The tensors of a collective that the exit handler keeps with it: the CPU ones (a CUDA
    collective's buffers are not held past its completion)."""
    try:
        return tuple(t for t in tensors if t.device.type == "cpu" and _holds((t,)) >= 0)
    except Exception:  # noqa: BLE001 - a tensor whose references cannot be counted is not held
        return ()


class _Live:
    """The collectives of this process that a backend's thread may still be finishing, oldest
    first, each ``[work, tensors, references, weak reference to the work]``. A collective is
    settled when its work is completed (its future's callbacks returned) and freed: the tensors
    handed to it are held here until then, so that the worker thread's last reference to them
    never frees a Python object (that takes the GIL too). Once the work is completed its
    ``references`` are counted (:func:`_holds`) with the work held here, and the work is let
    go; the count drops once whoever held it last frees it. Settled collectives are dropped as
    later ones are issued and as their first callbacks run: between steps the last of a step
    (their CPU buffers with them) stay until the next step's first collective."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[int, list] = {}  # key -> [work or None, tensors, references, weakref]
        self.count = 0
        self.exit_handler = False
        self.pid = os.getpid()

    @staticmethod
    def _settled(e: list) -> bool:
        if e[0] is not None:
            if not _completed(e[0]):
                return False
            if not e[1]:
                return True
            e[2] = _holds(e[1])
            try:
                e[3] = weakref.ref(e[0])
            except TypeError:
                pass
            e[0] = None  # freed here unless another thread (or a caller) still holds the work
        if e[3] is not None and e[3]() is not None:
            return False  # Python still holds the work (a round, a handle): not freed yet
        return _holds(e[1]) < e[2]

    def _prune_locked(self, full: bool = False) -> None:
        """Drop the settled collectives, oldest first; unless ``full``, up to the first one in
        flight (they complete about in the order issued)."""
        for key, e in list(self.entries.items()):
            if self._settled(e):
                del self.entries[key]
            elif e[0] is not None and not full:
                break

    def add(self, work, tensors=()) -> int:
        """Track ``work`` and the ``tensors`` handed to it; its key for :meth:`arrive`."""
        with self.lock:
            if not self.exit_handler:
                # Registered after torch's own handlers (and after init_process_group), so it
                # runs before them, and before an hvd.shutdown()/destroy_process_group handler.
                atexit.register(_wait_at_exit)
                self.exit_handler = True
            if self.pid != os.getpid():  # a forked child: its parent's works are not its own
                self.entries, self.pid = {}, os.getpid()
            self._prune_locked()
            self.count += 1
            self.entries[self.count] = [work, _held(tensors), None, None]
            return self.count

    def arrive(self) -> None:
        """A collective's first callback runs (on the thread that completes it): prune."""
        with self.lock:
            self._prune_locked()

    def left(self) -> tuple[list, int]:
        """Prune them all. The works not completed, and how many completed works only a backend
        thread may still hold (a work that Python still holds elsewhere, a caller's or an
        unsynchronized handle's, is freed by Python, with the GIL: it is not waited for)."""
        with self.lock:
            if self.pid != os.getpid():
                return [], 0
            self._prune_locked(full=True)
            flying = [e[0] for e in self.entries.values() if e[0] is not None]
            held = sum(1 for e in self.entries.values() if e[0] is None and (e[3] is None or e[3]() is None))
            return flying, held

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held by another of its
        threads, which the child does not have) and none of the parent's collectives."""
        self.lock = threading.Lock()
        self.entries, self.pid = {}, os.getpid()


_LIVE = _Live()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_LIVE.after_fork)


def track(work, *tensors: torch.Tensor):
    """Track a collective issued outside a :class:`Communicator` (``async_op=True``), with the
    tensors handed to it, for the exit handler (the module docstring); returns ``work``.
    A blocking call becomes ``track(dist.all_reduce(t, async_op=True), t).wait()``."""
    if work is not None:  # None: this rank is not in the collective's group
        _LIVE.add(work, tensors)
    return work


def wait_for_collectives(
    callbacks_s: float = EXIT_CALLBACKS_S, in_flight_s: float = EXIT_IN_FLIGHT_S, release_s: float = EXIT_RELEASE_S
) -> bool:
    """Wait until every collective gradzip issued in this process is settled: completed, its
    future's callbacks returned, and let go by the thread that ran it. Gives up after
    ``callbacks_s`` seconds while callbacks are running, ``in_flight_s`` while a result has not
    even arrived, ``release_s`` while a completed work is still held. True when none is left.

    Registered with ``atexit`` at the first collective (the module docstring); a script that
    ends its process another way (``os._exit``) can call it first."""
    start = time.monotonic()
    while True:
        flying, held = _LIVE.left()
        if not flying and not held:
            return True
        if any(_arrived(w) for w in flying):
            limit = callbacks_s
        else:
            limit = in_flight_s if flying else release_s
        if time.monotonic() - start > limit:
            return False
        del flying
        time.sleep(0.001)  # releases the GIL: the worker needs it to return from the callback


def _wait_at_exit() -> None:
    try:
        wait_for_collectives()
    except Exception:  # noqa: BLE001 - never fail an exit over the wait
        pass


def ring_allreduce_link(nbytes: float, world: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``nbytes``: ``2(N-1)/N * S``."""
    return 2.0 * (world - 1) / world * nbytes if world > 1 else 0.0


class Communicator:
    """Runs collectives on one process group and counts what it hands them, and what they send.

    Link bytes (what this rank sends on its link) follow each collective's algorithm,
    as gloo and NCCL run them for large messages (docs/costmodel.md): ring allreduce
    ``2(N-1)/N * S``, ring all-gather ``(N-1) * S``, pairwise all-to-all the bytes
    addressed to the other ranks.
    """

    def __init__(
        self, process_group=None, stats: Stats | None = None, *, defer: bool | None = None, intra: bool = False
    ) -> None:
        """``defer``: issue protocols' later rounds only at :meth:`flush` (the order is
        still the same on every rank: all first rounds as submitted, then the rest in
        submission order). ``None``: defer on gloo, where waiting on a round blocks the host.
        ``intra``: the group lies inside one node (its link bytes are also booked as
        ``bytes_link_intra``)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if defer is None:
            defer = dist.get_backend(process_group) == "gloo"
        self._start(stats, defer=defer, intra=intra)

    def _start(self, stats: Stats | None, *, defer: bool, intra: bool = False) -> None:
        """The bookkeeping every communicator keeps, whatever carries its collectives (a
        subclass without a torch.distributed group calls this in place of ``__init__``)."""
        self.defer = bool(defer)
        self.intra = intra
        self.stats = stats if stats is not None else Stats()
        self._pending: list[_Pending] = []
        #: a list to trace collectives into (``benchmarks/overlap.py``): each one appends
        #: ``[kind, bytes, issued, done]`` (``time.perf_counter()``; ``done`` set when it completes)
        self.trace: list | None = None

    def split(self, local_size: int) -> tuple[Communicator, Communicator]:
        """Communicators on this rank's node (its ``local_size`` ranks, numbered node by node
        as torchrun does) and on the ranks with its local rank on every node. The process
        groups are made once per process and size, by every rank in the same order."""
        key = (id(self.group), self.world_size, local_size)
        if key not in _SPLITS:
            ranks = list(range(self.world_size)) if self.group is None else dist.get_process_group_ranks(self.group)
            nodes = [
                dist.new_group(ranks[m * local_size : (m + 1) * local_size])
                for m in range(self.world_size // local_size)
            ]
            cross = [dist.new_group(ranks[i::local_size]) for i in range(local_size)]
            _SPLITS[key] = (nodes, cross)
        nodes, cross = _SPLITS[key]
        return (
            Communicator(nodes[self.rank // local_size], self.stats, defer=self.defer, intra=True),
            Communicator(cross[self.rank % local_size], self.stats, defer=self.defer),
        )

    # -- single collectives (async; each returns a Work) ------------------------------
    def _timed(
        self, work, nbytes: int, control: bool, link: float, gather: bool = False, kind: str = "", tensors: tuple = ()
    ):
        """Book the collective ``work`` (its bytes; its time once done) and track it, with the
        ``tensors`` handed to it, for the exit handler (the module docstring)."""
        t0 = time.perf_counter()
        self.stats.add(
            bytes_sent=nbytes,
            collectives=1,
            bytes_control=nbytes if control else 0,
            bytes_allgather=nbytes if gather else 0,
            bytes_link=link,
            bytes_link_intra=link if self.intra else 0.0,
        )
        stats, rec = self.stats, None
        if self.trace is not None:
            rec = [kind, nbytes, t0, None]
            self.trace.append(rec)

        def done(fut):
            t1 = time.perf_counter()
            stats.add(comm_seconds=t1 - t0)
            if rec is not None:
                rec[3] = t1
            _LIVE.arrive()
            return None

        _LIVE.add(work, tensors)
        work.get_future().then(done)
        return work

    def allreduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, *, control: bool = False):
        """Allreduce in place. ``control=True`` books the bytes as protocol overhead too."""
        w = dist.all_reduce(t, op=op, group=self.group, async_op=True)
        nbytes = t.numel() * t.element_size()
        link = ring_allreduce_link(nbytes, self.world_size)
        return self._timed(w, nbytes, control, link, kind="allreduce", tensors=(t,))

    def allgather(self, out: torch.Tensor, inp: torch.Tensor, *, control: bool = False):
        """All-gather equal-sized ``inp`` from every rank into ``out`` (world * inp.numel())."""
        w = _all_gather_single(out, inp, self.group)
        nbytes = inp.numel() * inp.element_size()
        link = (self.world_size - 1) * nbytes
        return self._timed(w, nbytes, control, link, gather=True, kind="allgather", tensors=(out, inp))

    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None, *, control: bool = False):
        """Send ``inp``'s ``in_splits[j]`` elements (in order) to rank ``j`` and receive rank
        ``j``'s into ``out`` at ``out_splits`` (equal splits when None). 1-D tensors."""
        w = dist.all_to_all_single(
            out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group, async_op=True
        )
        el = inp.element_size()
        nbytes = inp.numel() * el
        mine = (in_splits[self.rank] if in_splits is not None else inp.numel() // self.world_size) * el
        return self._timed(w, nbytes, control, nbytes - mine, kind="alltoall", tensors=(out, inp))

    # -- protocols ---------------------------------------------------------------------
    def submit(self, protocol: Protocol, device: torch.device | None = None) -> torch.futures.Future:
        """Start a protocol; unless ``defer``, first drive all earlier ones to their last round.

        ``device``: where the protocol's tensors live; a CUDA device makes the returned
        future CUDA-aware there (see the module docstring)."""
        if not self.defer:
            self.flush()
        job = _Pending(protocol, torch.futures.Future(devices=future_devices(device)))
        self._advance(job)
        if job.round is not None and not job.round.last:
            self._pending.append(job)
        return job.future

    def flush(self) -> None:
        """Issue every pending protocol's remaining rounds (blocking on their earlier rounds)."""
        pending, self._pending = self._pending, []
        for job in pending:
            while job.round is not None and not job.round.last:
                for w in job.round.works:
                    w.wait()
                self._advance(job)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _advance(self, job: _Pending) -> None:
        try:
            job.round = next(job.gen)
        except StopIteration as stop:  # finished without a last round (nothing to send)
            job.round = None
            job.future.set_result(stop.value)
            return
        except BaseException as exc:
            job.round = None
            job.future.set_exception(exc)
            raise
        if job.round.last:
            self._finish_when_done(job)

    def _fail(self, job: _Pending, exc: BaseException) -> None:
        """End ``job`` with ``exc`` (a subclass may report it first: gradzip.ft)."""
        job.future.set_exception(exc)

    def _finish_when_done(self, job: _Pending) -> None:
        futs = [w.get_future() for w in job.round.works]
        fail = self._fail

        def finish(all_done):
            try:
                for f in all_done.value():
                    f.value()  # re-raise a failed collective
                next(job.gen)
            except StopIteration as stop:
                job.future.set_result(stop.value)
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fail(job, exc)
                return
            fail(job, RuntimeError("protocol yielded after its last round"))

        if futs:
            torch.futures.collect_all(futs).then(finish)
        else:
            done = torch.futures.Future()
            done.set_result([])
            finish(done)


def future_devices(device) -> list[torch.device]:
    """The devices a protocol's future must be CUDA-aware on: ``[device]`` for a CUDA
    device, none for the CPU (or None)."""
    if device is None:
        return []
    device = torch.device(device)
    if device.type != "cuda":
        return []
    return [device if device.index is not None else torch.device("cuda", torch.cuda.current_device())]


def allgather_bytes(
    comm: Communicator, msg: torch.Tensor, *, last: bool = True, control: bool = False, call=None
) -> Generator[Round, None, torch.Tensor]:
    """Protocol: all-gather variable-length uint8 messages.

    Round 1 agrees on the longest message (allreduce MAX of one int64: gloo
    rejects uneven all-gathers); round 2 all-gathers every message padded to it.
    Returns a ``(world_size, max_len)`` uint8 tensor. The padding is counted in
    the bytes sent, because it is sent. Pass ``last=False`` when more rounds follow.
    The size exchange is booked as control bytes; so is the payload if ``control``.
    ``call``: a call whose engine wants its non-finite flag (``Call.wants_flag``), when
    round 1 is the call's first: the flag then rides in it, a second int64.
    """
    flag = call is not None and call.wants_flag
    size = K.host_to_device(torch.tensor([msg.numel(), 0] if flag else [msg.numel()], dtype=torch.int64), msg.device)
    if flag:
        size[1] = call.take_flag(size[1:])
    yield Round([comm.allreduce(size, op=dist.ReduceOp.MAX, control=True)])
    return (yield from allgather_fixed(comm, msg, int(size[0].item()), last=last, control=control))


def allgather_fixed(
    comm: Communicator, msg: torch.Tensor, size: int, *, last: bool = True, control: bool = False, call=None
) -> Generator[Round, None, torch.Tensor]:
    """Protocol: all-gather uint8 messages of one length, ``size``, that every rank knows without
    asking: ``msg`` is padded to it (:func:`~gradzip.wire.pad_message`), one round. Returns a
    ``(world_size, size)`` uint8 tensor. ``call``: as for :func:`allgather_bytes`, when this
    round is the call's first: the flag then rides as one more byte after every message
    (booked as control), not returned."""
    flag = call is not None and call.wants_flag
    msg = pad_message(msg, size + 1 if flag else size)  # one copy: the padding and the flag's byte
    out = msg.new_empty(comm.world_size * msg.numel())
    if flag:
        msg[size] = call.take_flag(out.view(comm.world_size, size + 1)[:, size])
        comm.stats.add(bytes_control=1)
    yield Round([comm.allgather(out, msg, control=control)], last=last)
    return out.view(comm.world_size, msg.numel())[:, :size]
