"""How much of each method's communication runs while the backward pass is still computing.

    python -m benchmarks.overlap                         # 2 ranks, loopback, step_time's MLP
    python -m benchmarks.overlap --ranks 2 --methods "Int8,PowerSGD(rank=1)" --steps 8

Every rank trains step_time.py's MLP (25.2M float32 parameters in 6 tensors; DDP's default
25 MB buckets: several calls a step) through the gradzip DDP hook, and traces every collective
gradzip issues (``Communicator.trace``: issued, completed) and the hook's flush (the last
bucket's call: the backward pass has computed every gradient by then). Per method, over the
timed steps of rank 0:

* **busy**: the seconds a step's collectives were in flight (the union of their intervals);
* **in backward**: the share of ``busy`` that lies before the flush, while gradients are still
  being computed (the rest is exposed after the backward pass, unless other work hides it);
* **issued in backward**: the share of the bytes whose collective was issued before the flush
  (a protocol's later rounds wait for the flush on gloo);
* **step** and **no-comm step** (a comm hook that returns each bucket as it is), and **exposed**:
  ``step / no-comm step - 1``, the share the communication adds to the step.

Unshaped loopback on this machine, ranks one per core: the collectives take little wall time
here, and the codec's CPU work competes with the backward pass for the cores. The figures say
when collectives are issued and how long they are in flight; on a slow link the same schedule
decides what the link's time can hide. Writes ``--out`` (default
``benchmarks/results/overlap.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks import step_time
from benchmarks._common import RESULTS, command, free_port, write_result

DEFAULT_METHODS = "Identity,FP16,TopK(0.01),SignSGD,Int8,PowerSGD(rank=1),PowerSGD(rank=4)"


def _union(intervals: list) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _clip(intervals: list, lo: float, hi: float) -> list:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def _rank(rank: int, world: int, port: int, a, q) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.step_time import build_model, methods, no_comm
    from gradzip.hooks import register_hook

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    table = methods(None, world)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(a.batch, 1024, generator=g), torch.randn(a.batch, 1024, generator=g)
    rows = []
    for name in ["no-comm", *a.methods]:
        model = build_model(a.width, a.depth)
        ddp = DDP(model, gradient_as_bucket_view=True)
        comm, flushes = None, []
        if name == "no-comm":
            ddp.register_comm_hook(None, no_comm)
        else:
            state = register_hook(ddp, table[name])
            comm = state.engine.comm
            inner = comm.flush

            def flush(inner=inner, flushes=flushes):
                flushes.append(time.perf_counter())
                inner()

            comm.flush = flush
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

        def step(ddp=ddp, opt=opt):
            opt.zero_grad(set_to_none=False)
            loss = F.mse_loss(ddp(x), y)
            t_bw = time.perf_counter()
            loss.backward()
            opt.step()
            return t_bw

        for _ in range(a.warmup):
            step()
        steps = []
        for _ in range(a.steps):
            dist.barrier()
            if comm is not None:
                comm.trace = []
            flushes.clear()
            t0 = time.perf_counter()
            t_bw = step()
            t1 = time.perf_counter()
            trace = comm.trace if comm is not None else []
            if comm is not None:
                comm.trace = None
            steps.append({"t0": t0, "t_bw": t_bw, "t1": t1, "flush": flushes[0] if flushes else None, "trace": trace})
        rows.append({"method": name, "steps": steps})
    dist.destroy_process_group()
    q.put((rank, rows))


def summarize(rows: list) -> list:
    """Per method: the medians over steps of the figures of the module docstring."""
    base = statistics.median(s["t1"] - s["t0"] for s in rows[0]["steps"])
    out = []
    for r in rows[1:]:
        busy, inside, issued, step = [], [], [], []
        for s in r["steps"]:
            done = [(c[2], c[3] if c[3] is not None else s["t1"]) for c in s["trace"]]
            cut = s["flush"] if s["flush"] is not None else s["t1"]
            u = _union(done)
            busy.append(u)
            inside.append(_union(_clip(done, s["t_bw"], cut)) / u if u else 0.0)
            total = sum(c[1] for c in s["trace"])
            issued.append(sum(c[1] for c in s["trace"] if c[2] < cut) / total if total else 0.0)
            step.append(s["t1"] - s["t0"])
        st = statistics.median(step)
        out.append(
            {
                "method": r["method"],
                "collectives_per_step": statistics.median(len(s["trace"]) for s in r["steps"]),
                "busy_s": statistics.median(busy),
                "busy_in_backward": statistics.median(inside),
                "bytes_issued_in_backward": statistics.median(issued),
                "step_s": st,
                "no_comm_step_s": base,
                "exposed": st / base - 1.0,
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated labels of step_time.py's methods")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS / "overlap.json"))
    a = p.parse_args(argv)
    a.methods = step_time.parse_methods(p, a.methods, a.ranks)
    untraced = [m for m in a.methods if step_time.methods(None, a.ranks).get(m) is None]
    if untraced:
        p.error(f"--methods: no hook to trace in {untraced} (plain DDP has none; Policy(auto=True) needs a link)")

    import torch.multiprocessing as mp

    from gradzip.machine import machine

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, a.ranks, port, a, q)) for r in range(a.ranks)]
    for pr in procs:
        pr.start()
    got = dict(q.get(timeout=3600) for _ in procs)
    for pr in procs:
        pr.join()
    table = summarize(got[0])
    print(f"{'method':12s} {'coll':>5s} {'busy s':>8s} {'in bw':>6s} {'issued':>7s} {'step s':>7s} {'exposed':>8s}")
    for r in table:
        print(
            f"{r['method']:12s} {r['collectives_per_step']:5.0f} {r['busy_s']:8.3f} {r['busy_in_backward']:6.0%} "
            f"{r['bytes_issued_in_backward']:7.0%} {r['step_s']:7.3f} {r['exposed']:+8.0%}"
        )
    print(f"no-comm step {statistics.median(s['t1'] - s['t0'] for s in got[0][0]['steps']):.3f} s")
    doc = {
        "benchmark": "benchmarks/overlap.py",
        "command": command("overlap"),
        "machine": machine(),
        "ranks": a.ranks,
        "link": "unshaped loopback",
        "model": f"step_time.py's MLP, width {a.width}, depth {a.depth}, batch {a.batch}; DDP default buckets",
        "warmup": a.warmup,
        "steps": a.steps,
        "rows": table,
    }
    write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
