"""Bytes FSDP2's gradient reduction really puts on the wire, plain and through gradzip.fsdp.

Every configuration runs its ranks in a fresh network namespace (only ``lo`` in it), so the
namespace's ``lo`` counters (``/proc/net/dev``: IP and TCP headers, gloo's per-message
preambles and every ACK included) count exactly the traffic of these ranks. The method is
the one of ``benchmarks/linkbytes.py``: ranks
``setns()`` into the namespace before any socket exists, and marks are *network-free*
barriers (multiprocessing semaphores) after which rank 0 snapshots the counters, so a
region between two marks holds only the collectives issued inside it.

A training step also all-gathers the parameters (forward, and backward with
``reshard_after_forward=True``). To isolate the gradient reduction, each configuration
measures ``K`` synchronized steps and then ``K`` steps under
``set_requires_gradient_sync(False)`` (the same all-gathers, no reduce-scatter, no hook);
the difference is the reduction's traffic. Warm-up steps (FSDP's lazy init, gradzip's
configuration check) fall before the first mark.

    sudo .venv/bin/python -m benchmarks.fsdp_bytes                 # writes benchmarks/results/fsdp_bytes.json
    sudo .venv/bin/python -m benchmarks.fsdp_bytes --quick         # 2 ranks, the tiny model only

Needs root (``ip netns``) and iproute2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback

from benchmarks import netns  # the lo-only namespace
from benchmarks._common import RESULTS, command

_count = itertools.count()


# -- namespace and counters (after /tmp/linkbytes/lobytes.py) ------------------------------


class Ctx:
    def __init__(self, rank, world, barrier, settle=0.3):
        self.rank, self.world, self._barrier, self._settle = rank, world, barrier, settle
        self.marks = []

    def mark(self, label: str) -> None:
        """Network-free barrier; rank 0 snapshots the namespace's lo counters in between."""
        self._barrier.wait()
        if self.rank == 0:
            time.sleep(self._settle)  # delayed ACKs drain
            self.marks.append((label, netns.read_lo()))
        self._barrier.wait()


def _child(ns, rank, n, port, cfg, barrier, q):
    try:
        netns.enter(ns)  # before any socket exists
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
        ctx = Ctx(rank, n, barrier)
        ret = work(ctx, cfg)
        dist.destroy_process_group()
        q.put((rank, "ok", ret, ctx.marks))
    except BaseException:  # noqa: BLE001
        barrier.abort()
        q.put((rank, "error", traceback.format_exc(), None))


def measure(cfg: dict, timeout: float = 1800) -> tuple[list, dict]:
    """Run ``work(ctx, cfg)`` on cfg['world'] ranks in a fresh namespace: (returns, marks)."""
    n = cfg["world"]
    ns = f"gzfsdp{os.getpid()}x{next(_count)}"
    netns.lo_up(ns)
    try:
        sctx = mp.get_context("spawn")
        barrier, q = sctx.Barrier(n), sctx.Queue()
        procs = [sctx.Process(target=_child, args=(ns, r, n, 29400, cfg, barrier, q), daemon=True) for r in range(n)]
        for p in procs:
            p.start()
        rets, marks, errors = [None] * n, None, []
        deadline = time.time() + timeout
        for _ in range(n):
            rank, status, ret, mk = q.get(timeout=max(1.0, deadline - time.time()))
            if status != "ok":
                errors.append(f"rank {rank}:\n{ret}")
            else:
                rets[rank] = ret
                if rank == 0:
                    marks = dict(mk)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if errors:
            raise RuntimeError("\n".join(errors))
        return rets, marks
    finally:
        netns.lo_down(ns)


# -- the model and one configuration ----------------------------------------------------------
def make_model(vocab: int, dim: int):
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, 3 * dim)
            self.fc2 = nn.Linear(3 * dim, dim)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = b(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return Net()


def work(ctx, cfg):
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradzip as gz

    world, vocab, dim = cfg["world"], cfg["vocab"], cfg["dim"]
    model = make_model(vocab, dim)
    if cfg["layout"] == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        fmesh = mesh
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fmesh = mesh if cfg["layout"] == "hsdp" else mesh["shard"]
    for b in model.blocks:
        fully_shard(b, mesh=fmesh)
    fully_shard(model, mesh=fmesh)
    state = None
    rs = gz.parse(cfg["rs"]) if cfg.get("rs") else None
    rep = gz.parse(cfg["replicate"]) if cfg.get("replicate") else None
    if rs is not None or rep is not None:
        state = gz.fsdp.compress(
            model, rs, replicate=rep, replicate_group=mesh["replicate"] if rep is not None else None
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(ctx.rank)
    idx = torch.randint(0, vocab, (8, 32), generator=g)
    tgt = torch.randint(0, vocab, (8, 32), generator=g)

    def step(sync: bool):
        model.set_requires_gradient_sync(sync)
        loss = nn.functional.cross_entropy(model(idx).reshape(-1, vocab), tgt.reshape(-1))
        loss.backward()
        if sync:
            opt.step()
            opt.zero_grad()
        return loss.item()

    for sync in (True, False, True):  # warm-up: lazy init, gradzip's configuration check
        step(sync)
    before = {k: state.stats(k) for k in ("reduce_scatter", "replicate") if _has(state, k)} if state else {}
    K = cfg["steps"]
    ctx.mark("sync:begin")
    t0 = time.perf_counter()
    for _ in range(K):
        step(True)
    t_sync = (time.perf_counter() - t0) / K
    ctx.mark("sync:end")
    after = {k: state.stats(k) for k in before} if state else {}
    t0 = time.perf_counter()
    for _ in range(K):
        step(False)
    t_nosync = (time.perf_counter() - t0) / K
    ctx.mark("nosync:end")
    counted = {
        k: {f: (after[k][f] - before[k][f]) / K for f in ("bytes_sent", "bytes_link", "bytes_link_raw", "bytes_raw")}
        for k in after
    }
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "grad_bytes": 4 * sum(p.numel() for p in model.parameters()),
        "counted_per_step": counted,
        "seconds_per_step": {"sync": t_sync, "nosync": t_nosync},
    }


def _has(state, which):
    return (state.engine if which == "reduce_scatter" else state.replicate_engine) is not None


def run(cfg: dict) -> dict:
    rets, marks = measure(cfg)
    n, K = cfg["world"], cfg["steps"]

    def per_rank_step(a, b, key="tx_bytes"):
        return (marks[b][key] - marks[a][key]) / n / K

    sync = per_rank_step("sync:begin", "sync:end")
    nosync = per_rank_step("sync:end", "nosync:end")
    row = dict(cfg)
    row.update(
        lo_bytes_per_rank_step_sync=sync,
        lo_bytes_per_rank_step_nosync=nosync,
        lo_bytes_per_rank_step_reduction=sync - nosync,
        lo_packets_per_rank_step_reduction=per_rank_step("sync:begin", "sync:end", "tx_packets")
        - per_rank_step("sync:end", "nosync:end", "tx_packets"),
        params=rets[0]["params"],
        grad_bytes=rets[0]["grad_bytes"],
        gradzip_counted_per_rank_step=rets[0]["counted_per_step"],
        seconds_per_step=rets[0]["seconds_per_step"],
    )
    return row


def machine() -> dict:
    import torch

    return {
        "description": f"this {os.cpu_count()}-core VM, CPU only, gloo over lo in a fresh netns",
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 ranks, the tiny model, plain and Int8 only")
    ap.add_argument("--out", default=str(RESULTS / "fsdp_bytes.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: ip netns")
    models = {"tiny": (37, 22), "small": (2048, 128)}
    runs = []
    if a.quick:
        plan = [("tiny", "fsdp", 2, None, None), ("tiny", "fsdp", 2, "Int8()", None)]
    else:
        plan = []
        for model in ("small", "tiny"):
            for world in (2, 4):
                for rs in (None, "Identity()", "Int8()"):
                    plan.append((model, "fsdp", world, rs, None))
        plan += [
            ("small", "hsdp", 4, None, None),
            ("small", "hsdp_shard", 4, "Int8()", "Int8()"),
            ("small", "hsdp", 4, "Int8()", None),
        ]
    for model, layout, world, rs, rep in plan:
        v, d = models[model]
        cfg = dict(model=model, vocab=v, dim=d, layout=layout, world=world, rs=rs, replicate=rep, steps=a.steps)
        t0 = time.time()
        row = run(cfg)
        runs.append(row)
        print(
            f"{model:5s} {layout:10s} N={world} rs={rs!s:11s} rep={rep!s:7s} lo/rank/step: "
            f"sync {row['lo_bytes_per_rank_step_sync']:10.0f} nosync {row['lo_bytes_per_rank_step_nosync']:10.0f} "
            f"reduction {row['lo_bytes_per_rank_step_reduction']:10.0f} "
            f"({time.time() - t0:.0f} s)",
            flush=True,
        )
    # ratios against plain FSDP2 of the same model, layout family and world size
    summary = []
    for row in runs:
        base = next(
            (
                r
                for r in runs
                if r["model"] == row["model"]
                and r["world"] == row["world"]
                and r["rs"] is None
                and r["replicate"] is None
                and (r["layout"] == "hsdp") == (row["layout"] != "fsdp")
            ),
            None,
        )
        if base is None or base is row:
            continue
        ratio = row["lo_bytes_per_rank_step_reduction"] / base["lo_bytes_per_rank_step_reduction"]
        n, g = row["world"], row["grad_bytes"]
        row["ratio_vs_plain_fsdp2"] = ratio
        summary.append(
            {
                "model": row["model"],
                "layout": row["layout"],
                "world": n,
                "rs": row["rs"],
                "replicate": row["replicate"],
                "params": row["params"],
                "plain_lo_bytes_per_rank_step": base["lo_bytes_per_rank_step_reduction"],
                "gradzip_lo_bytes_per_rank_step": row["lo_bytes_per_rank_step_reduction"],
                "ratio_vs_plain_fsdp2": ratio,
                # gloo runs reduce_scatter as a full ring allreduce (2(N-1)/N of the input), twice a
                # textbook reduce-scatter ((N-1)/N, what NCCL's ring sends): the ratio against that
                "ratio_vs_textbook_reduce_scatter": row["lo_bytes_per_rank_step_reduction"] / ((n - 1) / n * g)
                if row["layout"] == "fsdp"
                else None,
            }
        )
    out = {
        "benchmark": "benchmarks/fsdp_bytes.py",
        "command": command("fsdp_bytes", python="sudo .venv/bin/python"),
        "machine": machine(),
        "method": "lo TX bytes of a fresh network namespace per rank per step; reduction = synchronized steps minus "
        "set_requires_gradient_sync(False) steps (same all-gathers)",
        "summary": summary,
        "runs": runs,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    for s in summary:
        print(json.dumps(s))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
