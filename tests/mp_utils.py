"""Run a function on N gloo ranks (127.0.0.1, a free port) and collect what each returns."""
from __future__ import annotations

import io
import queue as _queue
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradzip.bench import free_port, init_worker


def _entry(fn, rank, world, port, args, q, timeout_s):
    try:
        init_worker(rank, world, port, threads=1, timeout_s=timeout_s)
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        q.put((rank, "ok", buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 240.0, pg_timeout: float = 120.0) -> list:
    """Spawn ``world`` ranks running ``fn(rank, world, *args)``; return their results by rank.

    ``fn`` must be a module-level function. Results travel through torch.save.
    A rank that raises fails the call with its traceback; a hang fails it after
    ``timeout`` seconds and kills the ranks.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, q, pg_timeout)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        while len(results) < world:
            try:
                rank, status, payload = q.get(timeout=timeout)
            except _queue.Empty:
                raise TimeoutError(f"ranks did not finish within {timeout}s (hang?)") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]
