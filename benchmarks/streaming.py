"""Streaming DiLoCo against DiLoCo and against compute alone, on an emulated 100 Mbit/s link.

    sudo .venv/bin/python -m benchmarks.streaming                 # the committed run
    sudo .venv/bin/python -m benchmarks.streaming --quick         # a smoke run (small model, few steps)

N ranks (default 2) run in network namespaces joined by veth links through a bridge
(``benchmarks/netns.py``, under names of its own: ``gzs*``), every link shaped with tc tbf to
``--rate`` both ways. Each rank trains the same MLP (``--width``/``--depth``: 8.4M
parameters by default, 33.6 MB in float32) with an inner AdamW on its own random data
(one thread per rank), three ways, in interleaved blocks of ``--block`` steps (a multiple
of the period, so that nothing is in flight between blocks), ``--rounds`` rounds after one
warm-up round that is dropped:

* ``compute``: the inner optimizer alone, no communication: the compute step;
* ``diloco``: ``DiLoCo(period=H, compression=C)``: every H steps, one blocking sync of the
  whole model;
* ``streaming``: ``DiLoCo(period=H, compression=C, fragments=F, delay=tau, alpha)``: one
  fragment (1/F of the bytes) every H/F steps, each overlapping tau inner steps.

Every method's model starts from the same weights. Per step, each rank records the wall time
of ``zero_grad``, forward, backward and ``step()``, the process CPU time (all threads:
gloo's included) and gradzip's ``stats()["bytes_link"]`` (the bytes this rank puts on its
link, booked when a collective is issued). Per fragment sync, the streaming run records
when its push returned, when its payload round was issued (gloo: the deferred rounds go out
at the next ``step()``), when its average had arrived (the future's callback) and how long
the sync step waited for it. Rank 0 also reads /proc/stat around each block: the share of
the machine's CPUs busy, ours and other processes' alike.

Reported per method: step time (median, mean = wall time per step over whole periods,
p90, max) against the compute step, CPU time per step, bytes per step (mean and peak over
steps), and its two targets: streaming's peak per-step transfer <= 1/F of
DiLoCo's, and its step time within 15% of the compute step.

Writes benchmarks/results/streaming.json (``--out``); ``benchmarks/streaming_report.py`` prints
the tables. Needs root (ip netns, tc) and iproute2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks._common import RESULTS, command, module_argv

METHODS = ("compute", "diloco", "streaming")


# -- the emulated network: benchmarks/netns.py under names of our own -------------------------
def netns_module():
    """benchmarks/netns.py with its namespaces renamed ``gzs*`` (10.79.0.0/24), so that this
    benchmark neither sees nor tears down the ``gzn*`` namespaces of a step_time.py run."""
    from benchmarks import netns as net

    net.PREFIX, net.BRIDGE_NS, net.BRIDGE = "10.79.0", "gzsbr", "gzsbr0"
    net.node = lambda i: f"gzs{i}"
    net.address = lambda i: f"{net.PREFIX}.{i + 1}"

    def namespaces() -> list:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        return [n for n in out if n.startswith("gzs")]

    net.namespaces = namespaces
    return net


# -- one rank ---------------------------------------------------------------------------------
def build_model(width: int, depth: int, io: int = 1024):
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(io, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, io))
    return torch.nn.Sequential(*layers)


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (every process on the machine)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


def timed_diloco():
    """gradzip.DiLoCo that records, per fragment sync, when its rounds went out and arrived."""
    import torch

    import gradzip as gz

    class Timed(gz.DiLoCo):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.syncs: list = []

        def _push(self, frag, collect_in):
            t0 = time.perf_counter()
            super()._push(frag, collect_in)
            inf = self._inflight
            inf.update(t_push=t0, t_pushed=time.perf_counter(), step_push=self.local_step, arrived=[])
            if inf["flushed"]:
                inf["t_issued"] = inf["t_pushed"]
            for fut in inf["futures"]:
                fut.then(lambda _f, inf=inf: inf["arrived"].append(time.perf_counter()))

        def _progress(self):
            inf = self._inflight
            if inf is not None and not inf["flushed"]:
                super()._progress()
                inf["t_issued"] = time.perf_counter()
                inf["step_issued"] = self.local_step
            else:
                super()._progress()

        def _collect(self):
            inf = self._inflight
            if inf is None:
                return super()._collect()
            t0 = time.perf_counter()
            self._average()
            t1 = time.perf_counter()
            super()._collect()
            t2 = time.perf_counter()
            done = max(inf["arrived"]) if len(inf["arrived"]) == len(self._groups[inf["frag"]]) else t1
            self.syncs.append(
                {
                    "fragment": inf["frag"],
                    "step_push": inf["step_push"],
                    "step_sync": self.local_step,
                    "step_issued": inf.get("step_issued", inf["step_push"]),
                    "push_s": inf["t_pushed"] - inf["t_push"],
                    "issued_after_push_s": inf["t_issued"] - inf["t_push"],
                    "transfer_s": done - inf["t_issued"],  # payload round issued -> average arrived
                    "arrived_before_sync_s": t0 - done,  # > 0: it was there before the sync step asked
                    "wait_s": t1 - t0,
                    "outer_s": t2 - t1,
                }
            )

    return Timed, torch


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import gradzip as gz

    Timed, _ = timed_diloco()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=a.pg_timeout),
    )
    g = torch.Generator().manual_seed(1000 + a.rank)
    data = [(torch.randn(a.batch, 1024, generator=g), torch.randn(a.batch, 1024, generator=g)) for _ in range(4)]
    compression = gz.parse(a.compression)
    runs = {}
    for m in METHODS:
        model = build_model(a.width, a.depth)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if m == "compute":
            opt = inner
        elif m == "diloco":
            opt = Timed(inner, model, period=a.period, compression=compression)
        else:
            opt = Timed(
                inner,
                model,
                period=a.period,
                compression=compression,
                fragments=a.fragments,
                delay=a.delay,
                alpha=a.alpha,
            )
        runs[m] = {"model": model, "opt": opt, "wall": [], "cpu": [], "main_cpu": [], "bytes": [], "blocks": []}
    nparams = sum(p.numel() for p in runs["compute"]["model"].parameters())

    def link_bytes(opt) -> float:
        return opt.stats()["bytes_link"] if isinstance(opt, gz.LocalSGD) else 0.0

    step_no = 0
    for rnd in range(1 + a.rounds):
        for m in METHODS:
            r = runs[m]
            model, opt = r["model"], r["opt"]
            if isinstance(opt, Timed):
                opt.syncs.clear()
            dist.barrier()
            st0 = opt.stats() if isinstance(opt, gz.LocalSGD) else {}
            busy0, tot0, cpu0, t0 = *machine_busy(), time.process_time(), time.perf_counter()
            walls, cpus, mains, nbytes = [], [], [], []
            for s in range(a.block):
                x, y = data[(step_no + s) % len(data)]
                b0, c0, m0, w0 = link_bytes(opt), time.process_time(), time.thread_time(), time.perf_counter()
                opt.zero_grad(set_to_none=True)
                F.mse_loss(model(x), y).backward()
                opt.step()
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
                mains.append(time.thread_time() - m0)
                nbytes.append(link_bytes(opt) - b0)
            t1, cpu1, (busy1, tot1) = time.perf_counter(), time.process_time(), machine_busy()
            st1 = opt.stats() if isinstance(opt, gz.LocalSGD) else {}
            step_no += a.block
            if rnd == 0:
                continue  # warm-up: the engines' configuration checks, first allocations
            r["wall"] += walls
            r["cpu"] += cpus
            r["main_cpu"] += mains
            r["bytes"] += nbytes
            r["blocks"].append(
                {
                    "round": rnd,
                    "wall_s": t1 - t0,
                    "cpu_s": cpu1 - cpu0,
                    "machine_busy": (busy1 - busy0) / max(1, tot1 - tot0),
                    "loadavg": os.getloadavg()[0],
                    "syncs": list(opt.syncs) if isinstance(opt, Timed) else [],
                    # gradzip's own work (encode, decode, checks): wall and CPU time of its threads
                    **{k: st1[k] - st0[k] for k in ("codec_seconds", "codec_cpu_seconds", "comm_seconds") if k in st0},
                }
            )
    out = {
        "rank": a.rank,
        "params": nparams,
        "methods": {m: {k: v for k, v in runs[m].items() if k not in ("model", "opt")} for m in METHODS},
    }
    for m in ("diloco", "streaming"):
        opt = runs[m]["opt"]
        out["methods"][m]["repr"] = repr(opt)
        out["methods"][m]["fragments"] = [[k for k in f] for f in opt.fragment_names]
        out["methods"][m]["stats"] = {k: v for k, v in opt.stats().items() if isinstance(v, (int, float))}
    gathered = [None] * a.world
    dist.all_gather_object(gathered, out)
    if a.rank == 0:
        with open(a.result, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------
def pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize(ranks: list, a) -> dict:
    """Per method: step times (rank 0's steps; the mean is wall time per step over whole blocks),
    CPU per step, bytes per step, and the streaming syncs' timings."""
    rows = {}
    for m in METHODS:
        r0 = ranks[0]["methods"][m]
        walls, cpus = r0["wall"], r0["cpu"]
        steps = len(walls)
        block_wall = sum(b["wall_s"] for b in r0["blocks"])
        row = {
            "steps": steps,
            "step_median_s": statistics.median(walls),
            "step_mean_s": block_wall / steps,
            "step_p90_s": pct(walls, 0.9),
            "step_p99_s": pct(walls, 0.99),
            "step_max_s": max(walls),
            "step_mean_s_per_rank": [sum(b["wall_s"] for b in rk["methods"][m]["blocks"]) / steps for rk in ranks],
            "cpu_median_s": statistics.median(cpus),
            "cpu_mean_s": sum(cpus) / steps,
            "main_thread_cpu_mean_s": sum(r0["main_cpu"]) / steps,  # the training loop's thread alone
            "cpu_mean_s_per_rank": [sum(rk["methods"][m]["cpu"]) / steps for rk in ranks],
            "machine_busy": statistics.mean(b["machine_busy"] for b in r0["blocks"]),
            "loadavg": statistics.mean(b["loadavg"] for b in r0["blocks"]),
            "block_step_mean_s": [b["wall_s"] / a.block for b in r0["blocks"]],
        }
        if m != "compute":
            row["codec_s_per_step"] = sum(b["codec_seconds"] for b in r0["blocks"]) / steps
            row["codec_cpu_s_per_step"] = sum(b["codec_cpu_seconds"] for b in r0["blocks"]) / steps
        per_rank_bytes = [rk["methods"][m]["bytes"] for rk in ranks]
        row["bytes_per_step_mean"] = statistics.mean(sum(b) / steps for b in per_rank_bytes)
        row["bytes_per_step_peak"] = max(max(b) for b in per_rank_bytes)
        row["bytes_per_step_nonzero"] = sorted({round(v) for v in per_rank_bytes[0] if v})
        if m != "compute":
            row["repr"] = r0["repr"]
            row["fragments"] = r0["fragments"]
            syncs = [s for b in r0["blocks"] for s in b["syncs"]]
            row["syncs"] = len(syncs)
            if syncs:
                for key in (
                    "transfer_s",
                    "wait_s",
                    "outer_s",
                    "push_s",
                    "arrived_before_sync_s",
                    "issued_after_push_s",
                ):
                    vals = [s[key] for s in syncs]
                    row[key] = {"median": statistics.median(vals), "max": max(vals), "min": min(vals)}
                row["issued_steps_after_push"] = sorted({s["step_issued"] - s["step_push"] for s in syncs})
                row["sync_steps_after_push"] = sorted({s["step_sync"] - s["step_push"] for s in syncs})
                row["outer_s_per_step"] = sum(s["outer_s"] for s in syncs) / steps
        rows[m] = row
    comp = rows["compute"]
    for m in METHODS:
        rows[m]["vs_compute_mean"] = rows[m]["step_mean_s"] / comp["step_mean_s"]
        rows[m]["vs_compute_median"] = rows[m]["step_median_s"] / comp["step_median_s"]
        rows[m]["cpu_vs_compute_mean"] = rows[m]["cpu_mean_s"] / comp["cpu_mean_s"]
    peak_ratio = rows["streaming"]["bytes_per_step_peak"] / rows["diloco"]["bytes_per_step_peak"]
    targets = {
        "peak_ratio": peak_ratio,
        "peak_ratio_target": 1 / a.fragments,
        "peak_ok": peak_ratio <= 1 / a.fragments,
        "peak_excess_bytes": rows["streaming"]["bytes_per_step_peak"]
        - rows["diloco"]["bytes_per_step_peak"] / a.fragments,
        "step_vs_compute_mean": rows["streaming"]["vs_compute_mean"],
        "step_vs_compute_median": rows["streaming"]["vs_compute_median"],
        "step_ok_mean": rows["streaming"]["vs_compute_mean"] <= 1.15,
        "step_ok_median": rows["streaming"]["vs_compute_median"] <= 1.15,
    }
    return {"rows": rows, "targets": targets}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="ranks (default 2: one per core of the 2-core machine; 4 would share each core between two)",
    )
    p.add_argument("--rate", default="100mbit", help="tc tbf rate of every link, both ways ('none': unshaped)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=1, help="hidden width x width layers (default: 8.4M parameters)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--compression", default="Int8()", help="a gradzip method spec for the pseudo-gradients")
    p.add_argument("--period", type=int, default=16, help="H: inner steps between two syncs of a fragment")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--delay", type=int, default=3)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--block", type=int, default=0, help="steps per method per round (default: 2 periods)")
    p.add_argument("--rounds", type=int, default=4, help="measured rounds (after one warm-up round)")
    p.add_argument("--pg-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=3600.0, help="the whole run (s)")
    p.add_argument("--quick", action="store_true", help="a smoke run: width 256, period 8, 1 round")
    p.add_argument("--out", default=str(RESULTS / "streaming.json"))
    a = p.parse_args()
    if a.quick:
        a.width, a.period, a.fragments, a.delay, a.rounds, a.batch = 256, 8, 4, 1, 1, 8
    a.block = a.block or 2 * a.period
    if a.block % a.period:
        p.error(f"--block must be a multiple of --period ({a.period}): nothing may be in flight between blocks")
    if a.worker:
        worker(a)
        return 0

    net = netns_module()
    why = net.check()
    if why:
        print(f"streaming.py: {why}", file=sys.stderr)
        return 2
    from benchmarks.step_time import launch
    from gradzip.machine import machine

    port = 29000 + int(time.time() * 1000) % 20000
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    argv = [
        *module_argv("streaming"),
        "--worker",
        "--world",
        str(a.ranks),
        "--master",
        net.address(0),
        "--port",
        str(port),
        "--result",
        result,
        "--width",
        str(a.width),
        "--depth",
        str(a.depth),
        "--batch",
        str(a.batch),
        "--compression",
        a.compression,
        "--period",
        str(a.period),
        "--fragments",
        str(a.fragments),
        "--delay",
        str(a.delay),
        "--alpha",
        str(a.alpha),
        "--block",
        str(a.block),
        "--rounds",
        str(a.rounds),
        "--pg-timeout",
        str(a.pg_timeout),
    ]
    net.up(a.ranks)
    try:
        net.set_rate(a.ranks, None if a.rate == "none" else a.rate)
        t0 = time.time()
        launch(net, a.ranks, argv, a.timeout, "streaming benchmark")
        elapsed = time.time() - t0
    finally:
        net.down()
    with open(result) as f:
        ranks = json.load(f)
    os.unlink(result)
    summary = summarize(ranks, a)
    cfg = {
        k: getattr(a, k)
        for k in (
            "ranks",
            "rate",
            "width",
            "depth",
            "batch",
            "compression",
            "period",
            "fragments",
            "delay",
            "alpha",
            "block",
            "rounds",
        )
    }
    doc = {
        "machine": {**machine(), "name": "the 2-core development VM"},
        "command": command("streaming", python="sudo .venv/bin/python"),
        "config": cfg,
        "params": ranks[0]["params"],
        "elapsed_s": elapsed,
        **summary,
        "raw": [
            {m: {k: r["methods"][m][k] for k in ("wall", "cpu", "main_cpu", "bytes", "blocks")} for m in METHODS}
            for r in ranks
        ],
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    from benchmarks.streaming_report import report

    print(report(doc))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
