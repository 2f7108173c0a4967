"""Link bytes per rank per step, measured on the wire, beside gradzip's own count.

    sudo .venv/bin/python -m benchmarks.linkbytes            # N = 2, 4, 8; every method (rewrites the JSON)
    sudo .venv/bin/python -m benchmarks.linkbytes --quick    # 2 ranks, 2 methods, 1 step (for a test)

For each world size N, one fresh network namespace holds nothing but ``lo`` (brought up);
N ranks (multiprocessing "spawn") enter it with setns(2) before they create a socket, and
run gloo on 127.0.0.1. Every rank trains the same DDP model (an MLP of 1024-wide layers,
``step_time.build_model``: ~5.2M parameters, DDP's default bucket cap) through each method
in turn: plain DDP (no hook), the gradzip hook with Identity, FP16, every non-summable
codec through both ``AllGather(codec)`` and ``TwoPhase(codec)``, PowerSGD(rank=4) and
Int8(allreduce=True). Each method runs ``--warmup`` steps (the config check, DDP's bucket
rebuild and its index broadcast fall in them), then ``--steps`` measured steps between two
*network-free* barriers (multiprocessing shared-memory semaphores, no sockets). After the
barrier every rank has finished its step (DDP waits on every bucket's future before
backward returns), rank 0 waits ``--settle`` seconds for the last ACKs and reads

* ``/proc/self/net/dev``: the namespace's ``lo`` TX bytes and packets. On loopback each
  byte is counted once on TX (and again on RX); TX over N ranks is the bytes a rank puts on
  its link, IP and TCP headers (52 B a packet here) and pure ACKs included;
* ``ss -tinH``: the TCP payload of every socket (``bytes_sent``, retransmissions apart),
  i.e. gloo's data plus its 3 x 48 B = 144 B of preambles per point-to-point message;

and every rank reads its hook's ``stats()``. A row holds, per rank per step, the measured
lo bytes, gradzip's ``bytes_link`` (averaged over the ranks), the TCP payload and
retransmissions, their ratios, and the measured bytes as a fraction of plain DDP's.
Plain DDP has no gradzip counter; its row gives the ring formula ``2(N-1)/N * 4 * params``.

Needs root (ip netns) and iproute2. Writes benchmarks/results/linkbytes.json (``--out``);
``benchmarks/linkbytes_report.py`` prints its tables (in docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
import traceback

from benchmarks import netns  # the lo-only namespace and its counters
from benchmarks._common import RESULTS, command
from benchmarks.step_time import build_model

DDP = "DDP"  # plain DDP, no hook
CODECS = [
    "TopK(0.01)",
    # tau set each step to the ceil(1% n)-th largest |v|: a density of ~1% (more on ties)
    "Threshold(tau=0.001, policy='target', density=0.01)",
    "SignSGD",
    "QSGD",
    "TernGrad",
    "Int8",
]
METHODS = (
    [DDP, "Identity", "FP16"]
    + [f"{p}({c})" for c in CODECS for p in ("AllGather", "TwoPhase")]
    + [
        "PowerSGD(rank=4)",
        "Int8(allreduce=True)",
    ]
)
QUICK_METHODS = [DDP, "TwoPhase(TopK(0.01))"]


# -- the namespace ---------------------------------------------------------------------------
def check() -> str | None:
    """Why this machine cannot run the benchmark (not root, no iproute2, no netns), or None."""
    why = netns.check()
    if why:
        return why
    name = f"gzlbchk{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode:
        return f"'ip netns add' failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def read_tcp() -> dict:
    """``{(local, peer): (bytes_sent, bytes_retrans)}`` of the namespace's TCP sockets ({} without ss)."""
    try:
        out = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    conns, cur = {}, None
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            f = line.split()
            cur = (f[3], f[4]) if len(f) >= 5 else None
            if cur:
                conns[cur] = (0, 0)
        elif cur is not None:
            sent = re.search(r"\bbytes_sent:(\d+)", line)
            retr = re.search(r"\bbytes_retrans:(\d+)", line)
            conns[cur] = (int(sent.group(1)) if sent else 0, int(retr.group(1)) if retr else 0)
    return conns


def _tcp_delta(a: dict, b: dict) -> tuple[int, int]:
    sent = retr = 0
    for c, (s1, r1) in b.items():
        s0, r0 = a.get(c, (0, 0))
        sent, retr = sent + s1 - s0, retr + r1 - r0
    return sent, retr


# -- one rank ----------------------------------------------------------------------------------
class Marks:
    """Network-free barriers; rank 0 snapshots the namespace's counters between their two halves."""

    def __init__(self, rank: int, barrier, settle: float) -> None:
        self.rank, self.barrier, self.settle = rank, barrier, settle
        self.snaps: dict = {}

    def mark(self, label: str) -> None:
        self.barrier.wait()
        if self.rank == 0:
            time.sleep(self.settle)  # delayed ACKs drain
            self.snaps[label] = {"lo": netns.read_lo(), "tcp": read_tcp()}
        self.barrier.wait()


def _run_method(marks: Marks, spec: str, cfg: dict) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import gradzip as gz
    from gradzip.hooks import register_hook

    rank = marks.rank
    model = build_model(cfg["width"], cfg["depth"])  # seeded: the same on every rank
    ddp = DistributedDataParallel(model)  # DDP's default buckets (25 MB cap, 1 MB first)
    state = None if spec == DDP else register_hook(ddp, gz.parse(spec))
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"])
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = torch.randn(cfg["batch"], 1024, generator=g), torch.randn(cfg["batch"], 1024, generator=g)
    loss = None

    def step():
        nonlocal loss
        opt.zero_grad(set_to_none=True)
        out = F.mse_loss(ddp(x), y)
        out.backward()
        opt.step()
        loss = float(out.detach())

    for _ in range(cfg["warmup"]):
        step()
    marks.mark(f"{spec}:begin")
    s0 = state.stats() if state else None
    t0 = time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    dt = time.perf_counter() - t0
    s1 = state.stats() if state else None
    marks.mark(f"{spec}:end")
    row = {
        "method": spec,
        "step_s": dt / cfg["steps"],
        "loss": loss,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if state is not None:
        row["protocol"] = type(state.engine.protocol).__name__
        row["stats"] = {
            k: s1[k] - s0[k]
            for k in (
                "bytes_link",
                "bytes_link_raw",
                "bytes_sent",
                "bytes_control",
                "bytes_payload",
                "bytes_raw",
                "collectives",
                "steps",
            )
        }
    return row


def _rank(ns, rank, world, port, methods, cfg, barrier, q):
    try:
        netns.enter(ns)  # before any socket or thread exists
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        marks = Marks(rank, barrier, cfg["settle"])
        marks.mark("empty:begin")  # an empty region: should be 0 bytes
        marks.mark("empty:end")
        rows = [_run_method(marks, m, cfg) for m in methods]
        marks.mark("__final__")
        dist.destroy_process_group()
        if rank == 0:  # the driver never imports torch
            from gradzip.machine import machine

            marks.snaps["machine"] = machine()
        q.put((rank, "ok", rows, marks.snaps))
    except BaseException:  # noqa: BLE001 - reported to the driver
        barrier.abort()
        q.put((rank, "error", traceback.format_exc(), None))


# -- the driver --------------------------------------------------------------------------------
def run_world(world: int, methods: list, cfg: dict, timeout: float) -> dict:
    """Every method on ``world`` ranks in one fresh namespace: rows of measured and counted bytes."""
    ns = f"gzlb{os.getpid()}n{world}"
    netns.lo_up(ns)
    sctx = mp.get_context("spawn")
    procs = []
    t0 = time.time()
    try:
        barrier, q = sctx.Barrier(world), sctx.Queue()
        port = 29500  # the namespace is fresh: nothing else listens in it
        procs = [
            sctx.Process(target=_rank, args=(ns, r, world, port, methods, cfg, barrier, q), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got: dict = {}
        snaps = None
        deadline = time.time() + timeout
        while len(got) < world:
            rank, status, rows, sn = q.get(timeout=max(1.0, deadline - time.time()))
            if status != "ok":
                raise RuntimeError(f"N={world}, rank {rank} failed:\n{rows}")
            got[rank] = rows
            if rank == 0:
                snaps = sn
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        netns.lo_down(ns)
    wall = time.time() - t0
    return {
        "world": world,
        "wall_s": wall,
        "rows": _rows(world, methods, cfg, got, snaps),
        "machine": snaps["machine"],
        "empty_region_lo_bytes": _region(snaps, "empty")["lo_bytes"],
    }


def _region(snaps: dict, label: str) -> dict:
    a, b = snaps[f"{label}:begin"], snaps[f"{label}:end"]
    sent, retr = _tcp_delta(a["tcp"], b["tcp"])
    return {
        "lo_bytes": b["lo"]["tx_bytes"] - a["lo"]["tx_bytes"],
        "lo_packets": b["lo"]["tx_packets"] - a["lo"]["tx_packets"],
        "tcp_payload": sent,
        "tcp_retrans": retr,
        "tcp_seen": bool(a["tcp"]),
    }


def _rows(world: int, methods: list, cfg: dict, got: dict, snaps: dict) -> list:
    per = world * cfg["steps"]  # rank-steps in a region
    out = []
    for i, spec in enumerate(methods):
        mine = [got[r][i] for r in range(world)]
        reg = _region(snaps, spec)
        params = mine[0]["params"]
        ring = 2 * (world - 1) / world * 4 * params
        row = {
            "N": world,
            "method": spec,
            "protocol": mine[0].get("protocol", "DDP allreduce"),
            "lo_bytes": reg["lo_bytes"] / per,
            "lo_packets": reg["lo_packets"] / per,
            "tcp_payload": reg["tcp_payload"] / per if reg["tcp_seen"] else None,
            "tcp_retrans": reg["tcp_retrans"] / per if reg["tcp_seen"] else None,
            "step_s": max(m["step_s"] for m in mine),
            "loss": mine[0]["loss"],
            "params": params,
        }
        if spec == DDP:
            row.update(gradzip_bytes_link=None, ring_formula=ring)
        else:
            st = [m["stats"] for m in mine]
            steps = st[0]["steps"]
            if any(s["steps"] != steps for s in st) or steps != cfg["steps"]:
                raise RuntimeError(f"{spec}: the hook counted {[s['steps'] for s in st]} steps, not {cfg['steps']}")
            avg = {k: sum(s[k] for s in st) / per for k in st[0] if k != "steps"}
            row.update(
                gradzip_bytes_link=avg["bytes_link"],
                gradzip_bytes_link_by_rank=[s["bytes_link"] / cfg["steps"] for s in st],
                gradzip_bytes_link_raw=avg["bytes_link_raw"],
                gradzip_bytes_sent=avg["bytes_sent"],
                gradzip_bytes_control=avg["bytes_control"],
                gradzip_bytes_payload=avg["bytes_payload"],
                gradzip_collectives=avg["collectives"],
                ring_formula=ring,
            )
        counted = row["gradzip_bytes_link"] if row["gradzip_bytes_link"] is not None else ring
        row["lo_over_gradzip"] = row["lo_bytes"] / counted if counted else None
        if row["tcp_payload"] is not None:
            # gloo's own framing: 144 B of preambles per point-to-point message
            row["gloo_overhead_bytes"] = row["tcp_payload"] - row["tcp_retrans"] - counted
            row["gloo_messages_est"] = row["gloo_overhead_bytes"] / 144.0
        out.append(row)
    base = next((r for r in out if r["method"] == DDP), None)
    for r in out:
        if base:
            r["lo_fraction_of_ddp"] = r["lo_bytes"] / base["lo_bytes"]
            r["lo_compression_vs_ddp"] = base["lo_bytes"] / r["lo_bytes"] if r["lo_bytes"] else None
        if r.get("gradzip_bytes_link") is not None and r["gradzip_bytes_link_raw"]:
            r["gradzip_fraction_of_ddp"] = r["gradzip_bytes_link"] / r["gradzip_bytes_link_raw"]
    return out


def targets(rows: list) -> dict:
    """The link-byte targets, from the measured lo bytes (where the rows hold them)."""
    lo = {(r["N"], r["method"]): r["lo_bytes"] for r in rows}
    gz = {(r["N"], r["method"]): r.get("gradzip_bytes_link") for r in rows}
    out = {}
    for codec in ("TopK(0.01)", "SignSGD"):
        m = f"TwoPhase({codec})"
        if (2, m) in lo and (8, m) in lo:
            growth = lo[(8, m)] / lo[(2, m)]
            # a ring allreduce itself grows by 2(N-1)/N: 1.75x from 2 to 8 ranks
            out[f"{m}: lo bytes at 8 / at 2 ranks <= 1.3"] = {
                "value": growth,
                "holds": growth <= 1.3,
                "gradzip_bytes_link_8_over_2": gz[(8, m)] / gz[(2, m)],
                "ring_allreduce_8_over_2": (2 * 7 / 8) / (2 * 1 / 2),
                "per_ring_factor": growth / 1.75,
            }
    m = "TwoPhase(TopK(0.01))"
    if (8, m) in lo and (8, DDP) in lo:
        frac = lo[(8, m)] / lo[(8, DDP)]
        out[f"{m}: lo bytes at 8 ranks <= 5% of plain DDP's"] = {"value": frac, "holds": frac <= 0.05}
    return out


def _write(out: str, command: str, a, cfg: dict, runs: list, rows: list, wall: float, machine: dict) -> dict:
    doc = {
        "machine": machine,  # gradzip.machine.machine(), read by rank 0
        "command": command,
        "wall_s": wall,
        "config": {
            **cfg,
            "params": rows[0]["params"] if rows else None,
            "model": f"MLP 1024 -> {a.width} x{a.depth + 1} -> 1024 (step_time.build_model)",
            "ddp": "DistributedDataParallel defaults (bucket_cap_mb 25, first bucket 1 MB)",
            "backend": "gloo on 127.0.0.1, one fresh network namespace per world size",
            "units": "bytes per rank per step; lo = /proc/net/dev TX of the namespace's lo / N / steps",
        },
        "runs": runs,
        "rows": rows,
        "targets": targets(rows),
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4,8", help="world sizes, comma-separated (default 2,4,8)")
    p.add_argument("--methods", default="", help="a subset, separated by ';' (default: every method)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=3, help="hidden width x width layers (default: ~5.2M parameters)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--settle", type=float, default=0.3, help="seconds rank 0 waits at a mark before reading")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per world size (a hang guard)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 ranks, plain DDP and TwoPhase(TopK(0.01)), 1 step, --depth 0 (2.1M parameters)",
    )
    p.add_argument(
        "--out", default=None, help="default: benchmarks/results/linkbytes.json (linkbytes_quick.json with --quick)"
    )
    a = p.parse_args(argv)
    if a.quick:
        a.ranks, a.warmup, a.steps, a.settle, a.depth = "2", 2, 1, 0.2, 0
        methods = QUICK_METHODS
    else:
        methods = [m.strip() for m in a.methods.split(";") if m.strip()] or METHODS
    out = a.out or str(RESULTS / ("linkbytes_quick.json" if a.quick else "linkbytes.json"))
    why = check()
    if why:
        print(f"linkbytes.py: {why}", file=sys.stderr)
        return 2
    if DDP in methods:  # first, as the baseline
        methods = [DDP] + [m for m in methods if m != DDP]
    cfg = {
        "width": a.width,
        "depth": a.depth,
        "batch": a.batch,
        "lr": a.lr,
        "warmup": a.warmup,
        "steps": a.steps,
        "settle": a.settle,
    }
    t0 = time.time()
    runs, rows = [], []
    cmd = command("linkbytes", argv, python="sudo .venv/bin/python")
    for world in [int(n) for n in a.ranks.split(",")]:
        run = run_world(world, methods, cfg, a.timeout)
        rows += run.pop("rows")
        machine = run.pop("machine")
        runs.append(run)
        for r in rows[-len(methods) :]:
            gzb = r["gradzip_bytes_link"]
            print(
                f"N={world} {r['method']:<58} {r['protocol']:<14} lo {r['lo_bytes']:12.0f} B/rank/step  "
                f"gradzip {gzb if gzb is not None else r['ring_formula']:12.0f}{'' if gzb is not None else '*'}  "
                f"lo/gz {r['lo_over_gradzip']:.3f}  of DDP {r.get('lo_fraction_of_ddp', float('nan')):.4f}",
                flush=True,
            )
        print(f"N={world}: {run['wall_s']:.0f} s (empty region {run['empty_region_lo_bytes']} B)", flush=True)
        doc = _write(
            out, cmd, a, cfg, runs, rows, time.time() - t0, machine
        )  # after each N: a partial run keeps its rows
    for k, v in doc["targets"].items():
        print(f"target {k}: {v['value']:.3f} -> {'holds' if v['holds'] else 'FAILS'}")
    print(f"wrote {out} in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
