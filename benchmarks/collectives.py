"""gloo's collectives on this machine, per link byte: allreduce, all-gather and all-to-all.

    python -m benchmarks.collectives [--ranks 2 4] [--mb 25] [--repeats 5]

The cost model (``gradzip.costmodel.link``) times every collective from one link rate
and the bytes each rank sends (``link_bytes``: ring allreduce ``2(N-1)/N * S``, ring
all-gather ``(N-1) * S``, all-to-all the bytes addressed to the others). ``step_time.py``
calibrates an unshaped link's rate from an allreduce. This script measures how fast gloo
moves each collective's link bytes between ranks on ``127.0.0.1`` (no namespaces, no
shaping, one torch thread per rank): where the rates differ by kind, a method whose bytes
go by all-gather or all-to-all is costed at the allreduce's rate and read short.

It also times the all-gather as an all-to-all of the rank's part repeated once per rank (the
same link bytes). ``gradzip.comm``'s all-gather on gloo does not take that form: it is faster
unshaped and at 4 ranks, but about a fifth slower for Int8's 25 MB all-gather at 2 ranks on a
shaped 1 Gbit/s link (``step_time.py``, two runs each way).

Per world size, each collective of ``--mb`` MB per rank (float32; the all-gather also as
uint8, the dtype Int8's codes travel in) runs once to warm up, then ``--repeats`` times
after a barrier; rank 0's fastest time is kept. Writes
``benchmarks/results/collectives_cpu_gloo.json`` with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._common import RESULTS, command, free_port
from gradzip.comm import _all_gather_single
from gradzip.costmodel.link import link_bytes
from gradzip.machine import machine


def _time(fn, repeats: int) -> float:
    fn()
    dist.barrier()
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _worker(rank: int, world: int, port: int, nbytes: int, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    x = torch.ones(nbytes // 4)
    rows.append(("allreduce", "float32", nbytes, _time(lambda: dist.all_reduce(x), repeats)))
    for dtype in (torch.float32, torch.uint8):
        inp = torch.ones(nbytes // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
        out = torch.empty(world * inp.numel(), dtype=dtype)
        rows.append(
            (
                "allgather",
                str(dtype).split(".")[1],
                nbytes,
                _time(lambda: _all_gather_single(out, inp, None).wait(), repeats),  # gradzip.comm's all-gather
            )
        )
        # the same gather as an all-to-all of this rank's part repeated once per rank: the same
        # link bytes, (N-1) * S (tried as gradzip.comm's all-gather on gloo; not kept, see below)
        rep = torch.empty(world * inp.numel(), dtype=dtype)
        rows.append(
            (
                "allgather as alltoall",
                str(dtype).split(".")[1],
                nbytes,
                _time(
                    lambda: dist.all_to_all_single(out, rep.view(world, -1).copy_(inp.view(1, -1)).view(-1)), repeats
                ),
            )
        )
    a2a_in, a2a_out = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    rows.append(("alltoall", "float32", nbytes, _time(lambda: dist.all_to_all_single(a2a_out, a2a_in), repeats)))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mb", type=float, default=25.0, help="MB each rank hands each collective")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "collectives_cpu_gloo.json"))
    a = p.parse_args(argv)
    nbytes = int(a.mb * 2**20) // 4 * 4
    info = machine()
    out_rows = []
    ctx = mp.get_context("spawn")
    for world in a.ranks:
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, nbytes, a.repeats, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        rows = queue.get(timeout=900)
        for proc in procs:
            proc.join(timeout=60)
        base = None
        for kind, dtype, size, secs in rows:
            link = link_bytes(kind.split()[0], size, world)
            gbps = 8 * link / secs / 1e9
            base = gbps if kind == "allreduce" else base
            out_rows.append(
                {
                    "ranks": world,
                    "collective": kind,
                    "dtype": dtype,
                    "bytes_per_rank": size,
                    "link_bytes_per_rank": link,
                    "seconds": secs,
                    "link_gbit_s": gbps,
                    "rate_over_allreduce": gbps / base,
                }
            )
            print(
                f"{world} ranks  {kind:<21} {dtype:<7} {size / 2**20:6.1f} MB/rank  {1e3 * secs:8.1f} ms  "
                f"{gbps:6.2f} Gbit/s of link bytes  ({gbps / base:.2f}x allreduce's)",
                flush=True,
            )
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"command": command("collectives", argv), "machine": info, "rows": out_rows}, f, indent=2)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
