"""Step time of gradzip's PowerSGD against torch's ``powerSGD_hook``, same model, same run.

    python -m benchmarks.powersgd_step                    # gloo/CPU, 2 ranks
    python -m benchmarks.powersgd_step --device cuda      # NCCL, one rank per GPU

Every rank builds three DDP replicas of one MLP from the same weights: plain DDP
(no hook, for reference), torch's ``powerSGD_hook`` and gradzip's ``PowerSGD``
through ``register_hook``, all with the same rank, ``start_iter`` and one DDP
bucket (torch's hook hangs on gloo with several; see DESIGN.md section 2).
After warm-up, the methods take turns: ``--rounds`` rounds of ``--steps`` steps
each, the order rotating every round, all on the same batches. A step is
``zero_grad, forward, backward (DDP's hook runs and completes inside it),
optimizer.step``, timed on rank 0 (after ``torch.cuda.synchronize`` on CUDA);
the ranks meet at a barrier before each turn. Reported: the median, mean and
10th/90th percentiles of step time per method and size, the median CPU time
of rank 0's process per step (all its threads; steadier than wall time on a
shared machine), and ``ratio = median(gradzip) / median(torch)`` for both. Before the models,
the round trip of one small allreduce between the idle ranks (``allreduce_roundtrip``): the
latency of one collective that a protocol's next round must wait for.

Wire bytes per step: gradzip's from ``stats()`` (counted at the collectives,
including its 4-byte non-finite flag); torch's from its own element counts
(``compression_stats``) at 4 bytes per element.

Writes ``benchmarks/results/powersgd_<device>_<backend>.json`` with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tph
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks._common import RESULTS, free_port
from gradzip import PowerSGD
from gradzip.hooks import register_hook
from gradzip.machine import machine as bench_machine

METHODS = ("ddp", "torch_powersgd", "gradzip_powersgd")
#: With --default-buckets: gradzip's PowerSGD again, on a DDP with torch's default bucket caps
#: (25 MB, the first 1 MB): P3's "no slower with default buckets than with one".
BUCKETS = "gradzip_powersgd_default_buckets"


def machine(device: str) -> dict:
    info = bench_machine()
    info["device"] = device
    if hasattr(os, "getloadavg"):
        info["load_avg_1_5_15_min_at_start"] = [round(x, 2) for x in os.getloadavg()]
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def make_mlp(width: int, depth: int, inp: int, classes: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers, d = [], inp
    for _ in range(depth):
        layers += [torch.nn.Linear(d, width), torch.nn.ReLU()]
        d = width
    layers.append(torch.nn.Linear(d, classes))
    return torch.nn.Sequential(*layers)


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    try:
        import datetime as _dt

        torch.set_num_threads(args.threads)
        if args.device == "cuda":
            torch.cuda.set_device(rank)
            dev = torch.device("cuda", rank)
            backend = "nccl"
        else:
            dev = torch.device("cpu")
            backend = "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=_dt.timedelta(seconds=600),
        )
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        roundtrip = _roundtrip_ms(dev, sync)
        rows = []
        methods = (*METHODS, BUCKETS) if args.default_buckets else METHODS
        for width in args.widths:
            replicas, torch_state, ours_state = {}, None, None
            for method in methods:
                model = make_mlp(width, args.depth, args.inputs, args.classes, args.seed).to(dev)
                kw = {"device_ids": [rank]} if dev.type == "cuda" else {}
                cap = {} if method == BUCKETS else {"bucket_cap_mb": args.bucket_cap_mb}
                ddp = DDP(model, **cap, **kw)
                if method == "torch_powersgd":
                    torch_state = tph.PowerSGDState(
                        process_group=None,
                        matrix_approximation_rank=args.rank,
                        start_powerSGD_iter=args.start_iter,
                        min_compression_rate=2,
                        use_error_feedback=True,
                        warm_start=True,
                        random_seed=args.seed,
                    )
                    ddp.register_comm_hook(torch_state, tph.powerSGD_hook)
                elif method == "gradzip_powersgd":
                    ours_state = register_hook(
                        ddp, PowerSGD(rank=args.rank, seed=args.seed), start_iter=args.start_iter
                    )
                elif method == BUCKETS:
                    register_hook(ddp, PowerSGD(rank=args.rank, seed=args.seed), start_iter=args.start_iter)
                opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
                replicas[method] = (ddp, opt)
            g = torch.Generator().manual_seed(1000 + rank)
            batches = [
                (
                    torch.randn(args.batch, args.inputs, generator=g).to(dev),
                    torch.randint(0, args.classes, (args.batch,), generator=g).to(dev),
                )
                for _ in range(8)
            ]
            counter = {m: 0 for m in methods}

            def run(method, n, times=None, cpu=None):
                ddp, opt = replicas[method]
                dist.barrier()
                for _ in range(n):
                    x, y = batches[counter[method] % len(batches)]
                    counter[method] += 1
                    sync()
                    c0, t0 = time.process_time(), time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(ddp(x), y).backward()
                    opt.step()
                    sync()
                    if times is not None:
                        times.append(time.perf_counter() - t0)
                        cpu.append(time.process_time() - c0)

            for method in methods:  # warm-up: start_iter plain steps, then compressed ones
                run(method, args.start_iter + args.warmup)
            times = {m: [] for m in methods}
            cpu = {m: [] for m in methods}
            steps_before = ours_state.stats()["steps"]
            sent_before = ours_state.stats()["bytes_sent"]
            t_before = torch_state.compression_stats()
            for r in range(args.rounds):
                order = methods[r % len(methods) :] + methods[: r % len(methods)]
                for method in order:
                    run(method, args.steps, times[method], cpu[method])
            st = ours_state.stats()
            t_after = torch_state.compression_stats()
            timed_steps = st["steps"] - steps_before
            nparams = sum(p.numel() for p in replicas["ddp"][0].module.parameters())
            row = {"width": width, "depth": args.depth, "params": nparams, "timed_steps_per_method": timed_steps}
            for m in methods:
                ms = sorted(1000 * t for t in times[m])
                row[m] = {
                    "median_ms": statistics.median(ms),
                    "mean_ms": statistics.fmean(ms),
                    "p10_ms": ms[len(ms) // 10],
                    "p90_ms": ms[(9 * len(ms)) // 10],
                    "cpu_median_ms": 1000 * statistics.median(cpu[m]),
                }
            row["ratio_gradzip_over_torch"] = row["gradzip_powersgd"]["median_ms"] / row["torch_powersgd"]["median_ms"]
            row["cpu_ratio_gradzip_over_torch"] = (
                row["gradzip_powersgd"]["cpu_median_ms"] / row["torch_powersgd"]["cpu_median_ms"]
            )
            if args.default_buckets:
                row["ratio_default_buckets_over_one"] = row[BUCKETS]["median_ms"] / row["gradzip_powersgd"]["median_ms"]
                # DDP's own count, after its rebuild at the first step (not a model of its bucketing)
                sizes = replicas[BUCKETS][0]._get_ddp_logging_data()["rebuilt_bucket_sizes"]
                row["default_buckets"] = len(str(sizes).split(","))
            row["gradzip_bytes_per_step"] = (st["bytes_sent"] - sent_before) / timed_steps
            row["torch_bytes_per_step"] = 4 * (t_after[2] - t_before[2]) / timed_steps
            row["raw_bytes_per_step"] = 4 * nparams
            rows.append(row)
            for m in methods:
                replicas[m][0].module.zero_grad(set_to_none=True)
            replicas = None  # free the models before the next width
        if rank == 0:
            queue.put(("ok", (rows, roundtrip)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report, then fail
        queue.put(("error", f"rank {rank}: {exc!r}"))
        raise


def _roundtrip_ms(dev, sync, n: int = 200) -> dict:
    """Milliseconds of one allreduce of a small tensor (1024 float32, about a PowerSGD factor's
    size), launched and waited for, ``n`` times after a barrier with every rank idle: the
    median and the 10th and 90th percentiles."""
    t = torch.zeros(1024, device=dev)
    for _ in range(20):
        dist.all_reduce(t)
    sync()
    dist.barrier()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        sync()
        times.append(time.perf_counter() - t0)
    ms = sorted(1000 * x for x in times)
    return {"median_ms": statistics.median(ms), "p10_ms": ms[len(ms) // 10], "p90_ms": ms[(9 * len(ms)) // 10]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world", type=int, default=None, help="ranks (default: 2 on CPU, one per GPU on CUDA)")
    p.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    p.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--start-iter", type=int, default=2, help="torch requires >= 2")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=10, help="steps per turn")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--bucket-cap-mb", type=float, default=1024.0, help="large: one bucket")
    p.add_argument(
        "--default-buckets",
        action="store_true",
        help="also time gradzip's PowerSGD on a DDP with torch's default bucket caps (25 MB, the first 1 MB)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and world > torch.cuda.device_count():
        print(f"--world {world}: NCCL needs one GPU per rank, {torch.cuda.device_count()} here", file=sys.stderr)
        return 2
    backend = "nccl" if args.device == "cuda" else "gloo"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    t0 = time.time()
    info = machine(args.device)  # before the run: the load average says how busy the machine was
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        kind, got = queue.get(timeout=3600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    if kind != "ok":
        print(got, file=sys.stderr)
        return 1
    rows, roundtrip = got
    print(
        f"{world} {backend} ranks, PowerSGD rank {args.rank}, depth {args.depth}, batch {args.batch}/rank, "
        f"{args.rounds} rounds x {args.steps} steps per method ({time.time() - t0:.0f} s)"
    )
    print("median step time (wall) and, in brackets, median CPU time of rank 0's process per step")
    print(
        f"{'width':>6}{'params':>11}{'ddp ms':>16}{'torch ms':>16}{'gradzip ms':>16}{'ratio':>14}"
        f"{'torch B':>9}{'gradzip B':>11}"
    )
    for r in rows:
        cells = [f"{r[m]['median_ms']:.2f} ({r[m]['cpu_median_ms']:.2f})" for m in METHODS]
        ratio = f"{r['ratio_gradzip_over_torch']:.3f} ({r['cpu_ratio_gradzip_over_torch']:.3f})"
        print(
            f"{r['width']:>6}{r['params']:>11,}{cells[0]:>16}{cells[1]:>16}{cells[2]:>16}{ratio:>14}"
            f"{r['torch_bytes_per_step']:>9,.0f}{r['gradzip_bytes_per_step']:>11,.0f}"
        )
    for r in rows:
        if "ratio_default_buckets_over_one" in r:
            print(
                f"width {r['width']}: gradzip with DDP's default buckets ({r['default_buckets']}) "
                f"{r[BUCKETS]['median_ms']:.2f} ms, {r['ratio_default_buckets_over_one']:.3f}x one bucket"
            )
    print(
        f"one allreduce of 1024 float32, launched and waited for, every rank idle: median "
        f"{roundtrip['median_ms']:.3f} ms (p10 {roundtrip['p10_ms']:.3f}, p90 {roundtrip['p90_ms']:.3f})"
    )
    out = args.out or str(RESULTS / f"powersgd_{args.device}_{backend}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cfg = {k: v for k, v in vars(args).items() if k != "out"}
    cfg.update(world=world, backend=backend)
    with open(out, "w") as f:
        if hasattr(os, "getloadavg"):
            info["load_avg_1_5_15_min_at_end"] = [round(x, 2) for x in os.getloadavg()]
        doc = {"machine": info, "config": cfg, "seconds": round(time.time() - t0, 1), "allreduce_roundtrip": roundtrip}
        json.dump({**doc, "rows": rows}, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
