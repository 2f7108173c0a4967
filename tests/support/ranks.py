"""Run a function on N gloo ranks (127.0.0.1, a free port) and collect what each returns.

Starting a rank as a fresh interpreter importing torch and gradzip costs about 2 s of CPU,
more than most multi-rank tests themselves on the CI's two cores. So ranks are forked from a
forkserver that imported torch, torch.distributed (FSDP included) and gradzip once
(:func:`_context`: about 10 ms a rank), and the ranks of a world size are started once and
kept (:class:`_Pool`): every call sends the function to the
same N processes, which join a *new* process group on a fresh port, run it, destroy the
group and wait for the next. Between calls each rank resets torch's default generator to
the seed a fresh process starts with, so a test sees what it would see in new processes.
A rank that raises, or a call that times out, kills the whole pool (its other ranks may be
blocked in a collective with the failed one); the next call starts a new one.
``run_ranks(..., fresh=True)`` runs in processes of its own, as before the pool, for a
test whose function leaves state behind in a process (or must see a pristine one).
"""

from __future__ import annotations

import atexit
import faulthandler
import io
import os
import queue as _queue
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradzip.bench import free_port, init_worker

from .models import forget_dtensor_caches

#: What the forkserver imports once, so that a rank forked from it starts in milliseconds.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch._dynamo",  # the first torch.optim optimizer imports it (about 1 s)
    "gradzip",
    "gradzip.kernels.numba_ops",
    "gradzip.bench",
    "gradzip.hooks",
    "tests.support",
]


def _context():
    """The multiprocessing context ranks start from: a forkserver with :data:`PRELOAD`
    imported (its children inherit a clean, single-threaded interpreter, as spawn's do)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


#: Seconds after which every rank prints its threads' stacks to stderr (and runs on), for a
#: hang that only a device shows: ``GRADZIP_RANK_STACKS_AFTER=60`` (unset: never).
STACKS_ENV = "GRADZIP_RANK_STACKS_AFTER"


def _stacks_after() -> float | None:
    value = os.environ.get(STACKS_ENV, "").strip()
    return float(value) if value else None


def _run(fn, rank, world, port, args, q, timeout_s):
    after = _stacks_after()
    if after is not None:
        faulthandler.dump_traceback_later(after, exit=False)
    try:
        init_worker(rank, world, port, threads=1, timeout_s=timeout_s)
        out = fn(rank, world, *args)
        if after is not None:
            faulthandler.cancel_dump_traceback_later()
        buf = io.BytesIO()
        torch.save(out, buf)
        q.put((rank, "ok", buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
        raise


def _entry(fn, rank, world, port, args, q, timeout_s):
    try:
        _run(fn, rank, world, port, args, q, timeout_s)
    except BaseException:  # noqa: BLE001  (reported through the queue)
        pass


def _serve(rank, world, inbox, q):
    """A pooled rank: run the tasks of ``inbox`` until a ``None`` arrives."""
    seed = torch.initial_seed()  # what a fresh process's default generator starts from
    threads = torch.get_num_threads()
    while True:
        task = inbox.get()
        if task is None:
            return
        fn, port, args, timeout_s = task
        forget_dtensor_caches()  # a DeviceMesh of an earlier call's process group must not be reused
        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        try:
            _run(fn, rank, world, port, args, q, timeout_s)
        except BaseException:  # noqa: BLE001  (reported; the parent kills the pool)
            return


class _Pool:
    def __init__(self, world: int) -> None:
        ctx = _context()
        self.world = world
        self.results = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, self.inboxes[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def submit(self, fn, port, args, timeout_s) -> None:
        for box in self.inboxes:
            box.put((fn, port, args, timeout_s))

    def close(self, kill: bool = False) -> None:
        if not kill:
            for box in self.inboxes:
                box.put(None)
        for p in self.procs:
            if not kill:
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _collect(q, world: int, timeout: float) -> list:
    results: dict[int, object] = {}
    while len(results) < world:
        try:
            rank, status, payload = q.get(timeout=timeout)
        except _queue.Empty:
            raise TimeoutError(f"ranks did not finish within {timeout}s (hang?)") from None
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [results[r] for r in range(world)]


def run_ranks(fn, world: int, *args, timeout: float = 240.0, pg_timeout: float = 120.0, fresh: bool = False) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return their results by rank.

    ``fn`` must be a module-level function. Results travel through torch.save.
    A rank that raises fails the call with its traceback; a hang fails it after
    ``timeout`` seconds and kills the ranks. ``fresh``: new processes for this call only.
    """
    port = free_port()
    if fresh:
        ctx = _context()
        q = ctx.Queue()
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, q, pg_timeout)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            return _collect(q, world, timeout)
        finally:
            for p in procs:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
                    p.join()
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = _POOLS[world] = _Pool(world)
    pool.submit(fn, port, args, pg_timeout)
    try:
        return _collect(pool.results, world, timeout)
    except BaseException:
        pool.close(kill=True)
        _POOLS.pop(world, None)
        raise
