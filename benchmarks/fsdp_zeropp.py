"""FSDP2 with ZeRO++'s savings: the bytes of whole training steps on the wire, and step time on a 1 Gbit/s link.

A whole FSDP2 step moves the parameters twice (the forward's all-gather, and the backward's
where parameters were resharded) and the gradients once (the reduce-scatter). This script
trains the byte-level GPT of ``gradzip.bench.lm`` (``fully_shard`` per block and on the root)
plain and through ``gz.fsdp.compress`` with Int8 weights (``all_gather=Int8(block=256)``) and
Int8 gradients, and counts what really goes on the wire:

* **loopback, 2 and 4 ranks**: the ranks in a fresh network namespace holding only ``lo``
  (``benchmarks/netns.py``); its counters (``/proc/net/dev``: IP and TCP headers, gloo's
  preambles and every ACK included) hold exactly these ranks' traffic. Marks are
  network-free barriers (multiprocessing semaphores) after which the counters are read, so a
  region between two marks holds only the ``--steps`` whole steps inside it (warm-up steps,
  FSDP's lazy init and gradzip's configuration check fall before).
* **2 emulated nodes x 2 ranks**: two namespaces joined by veth links shaped with tc tbf to
  ``--rate`` (1 Gbit/s, each node's transmit and receive: a NIC behind a switch); the two
  ranks of a node talk over the node's ``lo`` (unshaped). Inter-node bytes are the veth
  counters of both nodes, intra-node bytes their ``lo`` counters. Plain FSDP2 runs with
  ``reshard_after_forward=True`` (its default) and ``=2`` (the node size: its backward
  all-gather stays inside the node); gradzip with ``reshard_after_forward=2`` (hpZ), Int8
  weights (qwZ) and the reduce-scatter flat or ``Hierarchical(Int8(), local_size=2)`` (qgZ).
  The step time is the median of the timed steps (rank 0's; a step waits for its slowest
  rank).

Beside the counters, gradzip's own ``stats()`` per collective. The model is small and the
batch tiny (``--batch`` windows of ``--context`` bytes per rank) so that a step is
communication-bound on the shaped link, as the ones ZeRO++ targets are; this VM has 2 cores
for 4 ranks, and other jobs ran beside it.

    sudo .venv/bin/python -m benchmarks.fsdp_zeropp                 # writes benchmarks/results/fsdp_zeropp.json
    sudo .venv/bin/python -m benchmarks.fsdp_zeropp --quick         # 2 ranks on lo only
    sudo .venv/bin/python -m benchmarks.fsdp_zeropp --nodes-only --layers 4 --width 768 --heads 12 --steps 10 \
        --out benchmarks/results/fsdp_zeropp_wide.json                # a wider model (28.9M), 2 x 2 nodes

Needs root (``ip netns``, ``tc``) and iproute2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

from benchmarks import netns
from benchmarks._common import RESULTS, command

_count = itertools.count()
GATHER = "Int8(block=256)"

#: (label, all_gather, reduce_scatter, reshard_after_forward) on loopback
LO_RUNS = [
    ("plain FSDP2", None, None, True),
    ("gradzip Int8 gradients", None, "Int8()", True),
    ("gradzip Int8 weights + Int8 gradients", GATHER, "Int8()", True),
]
#: on 2 nodes of 2 ranks
NODE_RUNS = [
    ("plain FSDP2", None, None, True),
    ("plain FSDP2, reshard_after_forward=2", None, None, 2),
    ("gradzip Int8 weights + Int8 gradients, reshard 2", GATHER, "Int8()", 2),
    ("gradzip ZeRO++: Int8 weights + Hierarchical(Int8()), reshard 2", GATHER, "Hierarchical(Int8(), local_size=2)", 2),
    ("gradzip BF16 weights + Hierarchical(Int8()), reshard 2", "BF16()", "Hierarchical(Int8(), local_size=2)", 2),
]


def read_counters() -> dict:
    """This namespace's TX bytes and packets per interface (``/proc/self/net/dev``)."""
    out = {}
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, rest = line.split(":", 1)
            v = [int(x) for x in rest.split()]
            out[name.strip()] = {"tx_bytes": v[8], "tx_packets": v[9]}
    return out


class Ctx:
    """Network-free marks: every rank waits; the readers (one rank per namespace) read counters."""

    def __init__(self, rank, reader, barrier, settle=0.3):
        self.rank, self.reader, self._barrier, self._settle = rank, reader, barrier, settle
        self.marks = []

    def mark(self, label: str) -> None:
        self._barrier.wait()
        if self.reader:
            time.sleep(self._settle)  # delayed ACKs drain
            self.marks.append((label, read_counters()))
        self._barrier.wait()


def _child(ns, rank, n, port, master, ifname, reader, cfg, barrier, q):
    try:
        netns.enter(ns)  # before any socket exists
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}:{port}",
            rank=rank,
            world_size=n,
            timeout=datetime.timedelta(seconds=600),
        )
        ctx = Ctx(rank, reader, barrier)
        ret = work(ctx, cfg)
        dist.destroy_process_group()
        q.put((rank, "ok", ret, ctx.marks))
    except BaseException:  # noqa: BLE001
        barrier.abort()
        q.put((rank, "error", traceback.format_exc(), None))


def measure(cfg: dict, nodes: bool, timeout: float = 1800) -> tuple[list, dict]:
    """Run ``work`` on ``cfg['world']`` ranks: in a fresh lo-only namespace, or rank r in node
    r // 2 of the emulated network (up already). Returns (per-rank returns, {reader rank: marks})."""
    n = cfg["world"]
    lo_ns = None
    if nodes:
        where = [(netns.node(r // 2), netns.address(0), netns.DEV, r % 2 == 0) for r in range(n)]
    else:
        lo_ns = f"gzzpp{os.getpid()}x{next(_count)}"
        netns.lo_up(lo_ns)
        where = [(lo_ns, "127.0.0.1", "lo", r == 0) for r in range(n)]
    try:
        sctx = mp.get_context("spawn")
        barrier, q = sctx.Barrier(n), sctx.Queue()
        port = 29500 + next(_count) % 100
        procs = [
            sctx.Process(target=_child, args=(ns, r, n, port, m, dev, rd, cfg, barrier, q), daemon=True)
            for r, (ns, m, dev, rd) in enumerate(where)
        ]
        for p in procs:
            p.start()
        rets, marks, errors = [None] * n, {}, []
        deadline = time.time() + timeout
        for _ in range(n):
            rank, status, ret, mk = q.get(timeout=max(1.0, deadline - time.time()))
            if status != "ok":
                errors.append(f"rank {rank}:\n{ret}")
            else:
                rets[rank] = ret
                if mk:
                    marks[rank] = dict(mk)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if errors:
            raise RuntimeError("\n".join(errors))
        return rets, marks
    finally:
        if lo_ns is not None:
            netns.lo_down(lo_ns)


def work(ctx, cfg):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradzip as gz
    from gradzip.bench import lm

    world = cfg["world"]
    model = lm.make_gpt(lm.GPTSize(**cfg["size"]), 0)
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=cfg["raf"])
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg["raf"])
    state = None
    if cfg["ag"] or cfg["rs"]:
        state = gz.fsdp.compress(
            model, gz.parse(cfg["rs"]) if cfg["rs"] else None, all_gather=gz.parse(cfg["ag"]) if cfg["ag"] else None
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, _ = lm.corpus()
    batches = lm.Batches(train, cfg["context"], cfg["batch"], 0, ctx.rank)

    def step():
        x, y = batches.next()
        loss = F.cross_entropy(model(x).reshape(-1, lm.VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for _ in range(cfg["warmup"]):
        step()
    before = {k: state.stats(which=k) for k in state._engines()} if state else {}
    ctx.mark("begin")
    times, cpu = [], []
    for _ in range(cfg["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    ctx.mark("end")
    K = cfg["steps"]
    fields = ("bytes_raw", "bytes_sent", "bytes_link", "bytes_link_intra", "bytes_link_raw", "codec_seconds")
    counted = {}
    if state:
        for k, b in before.items():
            a = state.stats(which=k)
            counted[k] = {f: (a[f] - b[f]) / K for f in fields}
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "seconds_per_step": times,
        "cpu_seconds_per_step": cpu,
        "counted_per_rank_step": counted,
    }


def run(label, ag, rs, raf, world, nodes, a) -> dict:
    size = lm_size(a.size, a)
    cfg = dict(
        ag=ag, rs=rs, raf=raf, world=world, size=size, batch=a.batch, context=a.context, steps=a.steps, warmup=a.warmup
    )
    t0, load0 = time.time(), os.getloadavg()[0]
    rets, marks = measure(cfg, nodes)
    K = a.steps

    def delta(rank, dev):
        m = marks[rank]
        return (m["end"][dev]["tx_bytes"] - m["begin"][dev]["tx_bytes"]) / K

    row = {"label": label, "all_gather": ag, "reduce_scatter": rs, "reshard_after_forward": raf, "world": world}
    if nodes:
        row["inter_node_bytes_per_step"] = sum(delta(r, netns.DEV) for r in marks)
        row["intra_node_bytes_per_step"] = sum(delta(r, "lo") for r in marks)
    else:
        row["lo_bytes_per_step"] = delta(0, "lo")
    times = rets[0]["seconds_per_step"]
    row.update(
        params=rets[0]["params"],
        step_seconds_median=statistics.median(times),
        step_seconds=times,
        # CPU seconds of each rank's process per step (all threads; the ranks share the VM's cores)
        cpu_seconds_per_step_by_rank=[statistics.median(r["cpu_seconds_per_step"]) for r in rets],
        gradzip_counted_per_rank_step=rets[0]["counted_per_rank_step"],
        wall_seconds=time.time() - t0,
        load_average_1min=[load0, os.getloadavg()[0]],  # before and after: other jobs share the VM
    )
    return row


def lm_size(name: str, a=None) -> dict:
    """The GPT's shape: ``gradzip.bench.lm.SIZES[name]``, with ``--layers``, ``--width`` and
    ``--heads`` where given."""
    from gradzip.bench import lm

    s = lm.SIZES[name]
    size = {"layers": s.layers, "width": s.width, "heads": s.heads, "context": s.context}
    for k in ("layers", "width", "heads"):
        if a is not None and getattr(a, k, None):
            size[k] = getattr(a, k)
    return size


def ratios(rows: list, key: str, base_label: str = "plain FSDP2") -> None:
    base = {r["world"]: r[key] for r in rows if r["label"] == base_label}
    for r in rows:
        r[f"{key}_vs_plain"] = r[key] / base[r["world"]] if base.get(r["world"]) else None


def table(doc: dict) -> str:
    """The result file's two tables in Markdown (``--table FILE``): loopback bytes of whole steps,
    and the 2 x 2 emulated nodes' inter-node bytes and step time."""
    out = [
        "| ranks | run | lo bytes / step | vs plain | gradzip's link bytes / rank / step | s / step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in doc["loopback"]:
        c = r["gradzip_counted_per_rank_step"]
        counted = f"{sum(v['bytes_link'] for v in c.values()) / 1e6:.2f} MB" if c else "—"
        out.append(
            f"| {r['world']} | {r['label']} | {r['lo_bytes_per_step'] / 1e6:.2f} MB | "
            f"**{r['lo_bytes_per_step_vs_plain']:.2f}** | {counted} | {r['step_seconds_median']:.2f} |"
        )
    out += [
        "",
        "| 2 nodes x 2 ranks | inter-node bytes / step | vs plain | intra-node | s / step (median) | speed-up | "
        "CPU s / rank / step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["nodes_2x2"]:
        cpu = statistics.median(r["cpu_seconds_per_step_by_rank"])
        out.append(
            f"| {r['label']} | {r['inter_node_bytes_per_step'] / 1e6:.2f} MB | "
            f"**{r['inter_node_bytes_per_step_vs_plain']:.3f}** | {r['intra_node_bytes_per_step'] / 1e6:.1f} MB | "
            f"{r['step_seconds_median']:.2f} | {r['speedup_vs_plain']:.2f}x | {cpu:.2f} |"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small"], help="gradzip.bench.lm GPT size")
    ap.add_argument("--layers", type=int, default=None, help="override the size's number of blocks")
    ap.add_argument("--width", type=int, default=None, help="override the size's width")
    ap.add_argument("--heads", type=int, default=None, help="override the size's attention heads")
    ap.add_argument("--batch", type=int, default=1, help="windows per rank per step")
    ap.add_argument("--context", type=int, default=64, help="bytes per window (at most the model's context)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="the inter-node link (tc tbf rate)")
    ap.add_argument("--quick", action="store_true", help="2 ranks on lo, plain and ZeRO++ only")
    ap.add_argument("--nodes-only", action="store_true", help="the 2 x 2 emulated nodes only")
    ap.add_argument("--out", default=str(RESULTS / "fsdp_zeropp.json"))
    ap.add_argument("--table", metavar="FILE", help="print the tables of a result file and exit (no root)")
    a = ap.parse_args()
    if a.table:
        with open(a.table) as f:
            print(table(json.load(f)))
        return 0
    why = netns.check()
    if why:
        print(f"fsdp_zeropp.py: {why}", file=sys.stderr)
        return 2
    lo_rows, node_rows = [], []
    worlds = () if a.nodes_only else (2,) if a.quick else (2, 4)
    for world in worlds:
        for label, ag, rs, raf in LO_RUNS if not a.quick else (LO_RUNS[0], LO_RUNS[2]):
            row = run(label, ag, rs, raf, world, False, a)
            lo_rows.append(row)
            print(
                f"lo  N={world} {label:60s} {row['lo_bytes_per_step'] / 1e6:8.2f} MB/step  "
                f"{row['step_seconds_median']:.3f} s/step ({row['wall_seconds']:.0f} s)",
                flush=True,
            )
    ratios(lo_rows, "lo_bytes_per_step")
    if not a.quick:
        netns.up(2, a.rate)
        try:
            for label, ag, rs, raf in NODE_RUNS:
                row = run(label, ag, rs, raf, 4, True, a)
                node_rows.append(row)
                print(
                    f"2x2 {label:60s} inter {row['inter_node_bytes_per_step'] / 1e6:8.2f} MB/step  intra "
                    f"{row['intra_node_bytes_per_step'] / 1e6:8.2f} MB/step  {row['step_seconds_median']:.3f} s/step "
                    f"({row['wall_seconds']:.0f} s)",
                    flush=True,
                )
        finally:
            netns.down()
        ratios(node_rows, "inter_node_bytes_per_step")
        ratios(node_rows, "step_seconds_median")
        for r in node_rows:
            r["speedup_vs_plain"] = 1 / r["step_seconds_median_vs_plain"]
    from gradzip.machine import machine

    doc = {
        "benchmark": "benchmarks/fsdp_zeropp.py",
        "command": command("fsdp_zeropp", python="sudo .venv/bin/python"),
        "machine": {
            **machine(),
            "description": f"this shared {os.cpu_count()}-core VM (other jobs ran beside it), CPU only, gloo; "
            f"{max(worlds, default=4)} ranks on {os.cpu_count()} cores",
        },
        "model": f"gradzip.bench.lm GPT {a.size} {lm_size(a.size, a)}, fully_shard per block and on the root; "
        f"AdamW; batch {a.batch} x {a.context} bytes per rank",
        "steps": a.steps,
        "warmup": a.warmup,
        "rate": a.rate,
        "loopback": lo_rows,
        "nodes_2x2": node_rows,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
