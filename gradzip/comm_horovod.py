"""A :class:`~gradzip.comm.Communicator` on Horovod's collectives instead of torch.distributed.

When a job runs under ``horovodrun`` with Horovod initialised (``horovod.torch.init()``),
gradzip's protocols can run on Horovod's own allreduce, allgather and alltoall: every
codec and protocol, error feedback, the engine's checks and the byte accounting work as
on torch.distributed, and nothing above the communicator changes::

    comm = HorovodCommunicator()
    engine = Engine(gz.TopK(0.01), process_group=comm)   # or DistributedOptimizer(process_group=comm)

The interface is :class:`Communicator`'s: ``allreduce`` (SUM or MAX), ``allgather``,
``alltoall``, ``submit``/``flush`` and the same link-byte formulas, booked from the
tensors handed to Horovod. Horovod returns handles, not torch works: each collective is
given a unique name (``gradzip.<communicator>.<n>``: the same sequence on every rank,
since every rank issues the same collectives in the same order) and a torch future that a
single waiter thread per communicator completes, in issue order, once Horovod reports the
handle done (``poll``, then ``synchronize``). Completing a future runs its callbacks on that
thread, as gloo runs them on its own threads; callbacks decode and never communicate.

Horovod's torch binding has no bfloat16 collectives: handing it one raises ``TypeError``
(so ``BF16`` runs only on torch.distributed). ``split`` (``Hierarchical``) would need Horovod
process sets made by every rank at init; it raises ``NotImplementedError`` naming that.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import torch
import torch.distributed as dist

from .comm import Communicator, ring_allreduce_link
from .stats import Stats

__all__ = ["HorovodCommunicator"]

_IDS = itertools.count()  # communicators made in this process, in order (the same on every rank)


class _Work:
    """What a protocol's round holds: ``wait()``, ``get_future()`` and ``is_completed()``, as a
    torch ``Work``. Completed once the waiter thread has set the future and its callbacks have
    returned (as gloo's works: what gradzip's exit handler waits for, gradzip.comm)."""

    __slots__ = ("future", "completed")

    def __init__(self) -> None:
        self.future = torch.futures.Future()
        self.completed = False

    def wait(self) -> bool:
        self.future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.completed


class HorovodCommunicator(Communicator):
    """Runs gradzip's protocols on ``horovod.torch``'s collectives (global process set).

    Horovod must be initialised (``horovod.torch.init()``) before. ``defer`` is True, as on
    gloo: waiting on a round blocks the host, so later rounds are issued at ``flush()``.
    """

    def __init__(self, stats: Stats | None = None, *, poll_s: float = 2e-4) -> None:
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialized; call horovod.torch.init() first")
        self.hvd = hvd
        self.group = None
        self.world_size = hvd.size()
        self.rank = hvd.rank()
        self._start(stats, defer=True)
        self._ops = {dist.ReduceOp.SUM: hvd.Sum, dist.ReduceOp.MAX: hvd.Max}
        self._name = f"gradzip.{next(_IDS)}"
        self._count = itertools.count()
        self._poll_s = poll_s
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def split(self, local_size: int):
        raise NotImplementedError(
            "Hierarchical needs node and cross process groups; on Horovod they would be process sets "
            "that every rank registers at horovod.torch.init(process_sets=...). Run Hierarchical on "
            "torch.distributed (gradzip.horovod.init(transport='torch'))"
        )

    # -- Horovod handles -> futures ---------------------------------------------------
    def _next_name(self) -> str:
        return f"{self._name}.{next(self._count)}"

    def _check(self, t: torch.Tensor) -> None:
        if t.dtype == torch.bfloat16:
            raise TypeError(
                "Horovod's torch binding has no bfloat16 collectives; run BF16 on torch.distributed "
                "(gradzip.horovod.init(transport='torch')) or use FP16"
            )
        if not t.is_contiguous():
            raise ValueError("Horovod collectives need contiguous tensors")

    def _watch(self, handle, finish) -> _Work:
        """A work completed by the waiter thread when ``handle`` is done; ``finish(output)``
        runs first (it copies Horovod's output where the protocol expects it)."""
        work = _Work()
        if self._thread is None:
            self._thread = threading.Thread(target=self._wait_loop, name=f"{self._name}.waiter", daemon=True)
            self._thread.start()
        self._queue.put((handle, finish, work))
        return work

    def _wait_loop(self) -> None:
        hvd = self.hvd
        while True:
            handle, finish, work = self._queue.get()
            try:
                while not hvd.poll(handle):  # sleeping releases the GIL for the issuing thread
                    time.sleep(self._poll_s)
                out = hvd.synchronize(handle)
                if finish is not None:
                    finish(out)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter of the future
                work.future.set_exception(exc)
            else:
                work.future.set_result(None)
            work.completed = True

    # -- the collectives (async; each returns a work) ---------------------------------
    def allreduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, *, control: bool = False):
        """Allreduce in place (``hvd.allreduce_async_``)."""
        self._check(t)
        if op not in self._ops:
            raise ValueError(f"HorovodCommunicator.allreduce supports SUM and MAX, got {op}")
        h = self.hvd.allreduce_async_(t, name=self._next_name(), op=self._ops[op])
        nbytes = t.numel() * t.element_size()
        return self._timed(
            self._watch(h, None), nbytes, control, ring_allreduce_link(nbytes, self.world_size), kind="allreduce"
        )

    def allgather(self, out: torch.Tensor, inp: torch.Tensor, *, control: bool = False):
        """All-gather equal-sized ``inp`` from every rank into ``out`` (``hvd.allgather_async``)."""
        self._check(inp)
        if out.numel() != self.world_size * inp.numel():
            raise ValueError(f"allgather: out has {out.numel()} elements, expected {self.world_size} x {inp.numel()}")
        h = self.hvd.allgather_async(inp.reshape(-1), name=self._next_name())

        def finish(got: torch.Tensor) -> None:
            out.view(-1).copy_(got.view(-1))

        nbytes = inp.numel() * inp.element_size()
        return self._timed(
            self._watch(h, finish), nbytes, control, (self.world_size - 1) * nbytes, gather=True, kind="allgather"
        )

    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None, *, control: bool = False):
        """Send ``inp``'s ``in_splits[j]`` elements to rank ``j``, receive into ``out`` at
        ``out_splits`` (``hvd.alltoall_async``; equal splits when None). 1-D tensors."""
        self._check(inp)
        splits = None if in_splits is None else torch.tensor(list(in_splits), dtype=torch.int32)
        h = self.hvd.alltoall_async(inp, splits=splits, name=self._next_name())
        expect = out.numel() if out_splits is None else sum(out_splits)

        def finish(got) -> None:
            got = got[0] if isinstance(got, (tuple, list)) else got
            if got.numel() != expect:
                raise RuntimeError(f"alltoall received {got.numel()} elements, expected {expect}")
            out.view(-1)[:expect].copy_(got.view(-1))

        el = inp.element_size()
        nbytes = inp.numel() * el
        mine = (in_splits[self.rank] if in_splits is not None else inp.numel() // self.world_size) * el
        return self._timed(self._watch(h, finish), nbytes, control, nbytes - mine, kind="alltoall")
