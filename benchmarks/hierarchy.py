"""Hierarchical against flat protocols on emulated nodes, and the cost model's prediction.

    sudo .venv/bin/python -m benchmarks.hierarchy [--rate 1gbit] [--steps 8]

``--world`` ranks (4) as "nodes" of ``--local`` (2): each node is a network namespace
(``benchmarks/netns.py``) holding ``--local`` ranks, which talk to each other over the
namespace's loopback (fast, not shaped); the nodes are joined by veth links shaped with tc
tbf to ``--rate`` (1 Gbit/s), one per node, which the node's ranks share, as GPUs share a
NIC. ``--world 8 --local 4`` is 8 ranks as 2 nodes of 4 (``hierarchy_8ranks.json``). Every method
trains the same MLP through the gradzip DDP hook; per method the median step time after
warm-up is compared with the cost model:

    step = compute + codec + wire(collectives of a dry run on the model's DDP buckets,
                                  world, local_size, inter link --rate, intra link measured)

``compute`` is the whole step with a hook that does not communicate (timed on every rank
just before each timed step; the slowest rank's), ``codec`` gradzip's own seconds per step
(stats), and the wire from :func:`gradzip.costmodel.link.wire_time`, with the latency of a
one-element allreduce measured between the nodes and inside a node. Writes
benchmarks/results/hierarchy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks import netns
from benchmarks._common import RESULTS, command, module_argv
from benchmarks.step_time import build_model, launch, no_comm

METHODS = [
    "DDP",
    "TopK(0.01)",
    "AllGather(TopK(0.01))",
    "Hierarchical(TopK(0.01), local_size={local})",
    "SignSGD()",
    "Hierarchical(SignSGD(), local_size={local})",
    "PowerSGD(rank=4)",
    "Hierarchical(PowerSGD(rank=4), local_size={local})",
]


def worker(a) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import gradzip as gz
    from gradzip.hooks import register_hook

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=300),
    )
    nodes = [dist.new_group(list(range(i, i + a.local))) for i in range(0, a.world, a.local)]
    node = nodes[a.rank // a.local]
    model = build_model(a.width, a.depth)
    g = torch.Generator().manual_seed(a.rank)
    x, y = torch.randn(a.batch, 1024, generator=g), torch.randn(a.batch, 1024, generator=g)

    def step(m, o):
        o.zero_grad(set_to_none=True)
        F.mse_loss(m(x), y).backward()
        o.step()

    shadow = torch.nn.parallel.DistributedDataParallel(build_model(a.width, a.depth), gradient_as_bucket_view=True)
    shadow.register_comm_hook(None, no_comm)
    shadow_opt = torch.optim.SGD(shadow.parameters(), lr=1e-3)

    def latency(group):
        one = torch.zeros(1)
        dist.barrier()
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            dist.all_reduce(one, group=group)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    lat_world, lat_node = latency(None), latency(node)
    buf = torch.ones(8 * 2**20)  # 32 MB inside the node: its link's bandwidth through the ring formula
    dist.all_reduce(buf, group=node)
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(buf, group=node)
    dt = time.perf_counter() - t0
    intra_bps = buf.numel() * 4 * 8 * 2 * (a.local - 1) / a.local / dt

    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    state = register_hook(ddp, gz.parse(a.method)) if a.method != "DDP" else None
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    times, shadow_times, snap = [], [], None
    for s in range(a.warmup + a.steps):
        if s == a.warmup and state is not None:
            snap = state.stats()
        dist.barrier()
        t0 = time.perf_counter()
        step(shadow, shadow_opt)
        shadow_times.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        step(ddp, opt)
        times.append(time.perf_counter() - t0)
    times, shadow_times = times[a.warmup :], shadow_times[a.warmup :]
    slowest = torch.tensor(shadow_times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    out = {
        "method": a.method,
        "step_s": statistics.median(times),
        "step_all_s": times,
        "compute_s": statistics.median(slowest.tolist()),
        "latency_world_s": lat_world,
        "latency_node_s": lat_node,
        "intra_bps": intra_bps,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if state is not None:
        end = state.stats()
        k = end["steps"] - snap["steps"]
        for key in ("codec_seconds", "bytes_link", "bytes_link_intra", "bytes_link_raw", "collectives"):
            out[key + "_per_step"] = (end[key] - snap[key]) / k
    if a.rank == 0:
        with open(a.result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def predicted(r: dict, a) -> dict:
    """compute + codec + wire of the dry-run collectives on the model's buckets."""
    import math

    import gradzip as gz
    from gradzip.comm import FLAG_BYTES
    from gradzip.costmodel import Collective, Link, ddp_buckets, dry_run, sample
    from gradzip.costmodel.link import wire_time

    shapes = [tuple(p.shape) for p in build_model(a.width, a.depth).parameters()]
    buckets = ddp_buckets([math.prod(s) * 4 for s in shapes])
    inter = Link(netns_rate(a.rate), r["latency_world_s"] / (2 * (a.world - 1)))  # a ring allreduce: 2(N-1) hops
    intra = Link(r["intra_bps"], r["latency_node_s"] / (2 * (a.local - 1)))
    colls = []
    for b in buckets:
        if r["method"] == "DDP":
            colls.append(Collective("allreduce", sum(math.prod(shapes[i]) * 4 for i in b)))
            continue
        d = dry_run(gz.parse(r["method"]), [sample(shapes[i], seed=i) for i in b], world_size=a.world, decode=False)
        colls += d.collectives
        if not (d.plain or d.flag_carried):  # the engine's own flag
            colls.append(Collective("allreduce", FLAG_BYTES, control=True))
    wire = wire_time(colls, a.world, inter, local_size=a.local, intra=intra)
    codec = r.get("codec_seconds_per_step", 0.0)
    return {"compute": r["compute_s"], "codec": codec, "wire": wire, "total": r["compute_s"] + codec + wire}


def netns_rate(rate: str) -> float:
    from gradzip.costmodel import parse_bandwidth

    return parse_bandwidth(rate.replace("mbit", "Mbit").replace("gbit", "Gbit"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--method", default="DDP", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="1gbit", help="the inter-node link (tc tbf rate), default 1gbit")
    p.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--local", type=int, default=2, help="ranks per emulated node (default 2)")
    p.add_argument("--methods", default=None, help="';'-separated method specs (default: the list above, at --local)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "hierarchy.json"))
    a = p.parse_args()
    if a.world < 2 or a.local < 2 or a.world % a.local or a.world == a.local:
        p.error(f"--world {a.world} must be two or more nodes of --local {a.local} (at least 2) ranks")
    if a.methods is None:
        a.methods = ";".join(m.format(local=a.local) for m in METHODS)
    if a.worker:
        worker(a)
        return 0
    why = netns.check()
    if why:
        print(f"hierarchy.py: {why}", file=sys.stderr)
        return 2
    netns.up(a.world // a.local, a.rate)
    rows = []
    try:
        for method in a.methods.split(";"):
            port = 29000 + int(time.time() * 1000) % 20000
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                result = f.name
            argv = [
                *module_argv("hierarchy"),
                "--worker",
                "--method",
                method,
                "--master",
                netns.address(0),
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
                "--steps",
                str(a.steps),
                "--warmup",
                str(a.warmup),
                "--world",
                str(a.world),
                "--local",
                str(a.local),
            ]
            launch(_Nodes(a.local), a.world, argv, 1800, method)
            with open(result) as f:
                r = json.load(f)
            os.unlink(result)
            r["model"] = predicted(r, a)
            r["model_error"] = r["model"]["total"] / r["step_s"] - 1
            rows.append(r)
            print(
                f"{method:45s} step {r['step_s']:.3f} s  model {r['model']['total']:.3f} s "
                f"({100 * r['model_error']:+.1f}%)"
                f"  compute {r['compute_s']:.3f}  codec {r['model']['codec']:.3f}  wire {r['model']['wire']:.3f}",
                flush=True,
            )
    finally:
        netns.down()
    from gradzip.machine import machine

    doc = {
        "command": command("hierarchy", python="sudo .venv/bin/python"),
        "machine": machine(),
        "rate": a.rate,
        "world": a.world,
        "local_size": a.local,
        "width": a.width,
        "depth": a.depth,
        "batch": a.batch,
        "steps": a.steps,
        "warmup": a.warmup,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {a.out}")
    return 0


class _Nodes:
    """Rank i runs in node i // local (``local`` ranks a namespace), with gloo on the node's veth."""

    def __init__(self, local: int) -> None:
        self.local = local

    def command(self, i: int, argv: list, env: dict) -> list:
        return netns.command(i // self.local, argv, {**env, "LOCAL_WORLD_SIZE": str(self.local)})


if __name__ == "__main__":
    sys.exit(main())
