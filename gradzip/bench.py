"""Compression ratio against accuracy: train one small model per method on N gloo ranks.

Used by ``gradzip bench`` (and ``make demo``) and by the multi-process tests.
Every method starts from the same weights, sees the same data order, and runs
the same number of epochs. Ratios and bytes come from the hook's ``stats()``,
i.e. from the tensors handed to ``torch.distributed``.
"""
from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from .compressors import BF16, FP16, Compressor, Identity, RandomK, Threshold, TopK


def default_methods() -> dict[str, Compressor]:
    """The demo's methods. The uncompressed baseline must come first."""
    return {
        "Identity": Identity(),
        "FP16": FP16(),
        "BF16": BF16(),
        "Threshold": Threshold(tau=1e-3, policy="adaptive"),  # DL4J's adaptive defaults
        "TopK": TopK(ratio=0.01),
        "RandomK": RandomK(ratio=0.1),
    }


@dataclass
class BenchConfig:
    dataset: str = "digits"
    workers: int = 2
    epochs: int = 20
    batch_size: int = 32  # per rank
    lr: float = 0.05
    momentum: float = 0.9
    hidden: tuple = (256, 256)
    seed: int = 0
    bucket_cap_mb: float = 25.0
    threads: int = 1  # torch threads per rank
    timeout_s: float = 300.0
    extra: dict = field(default_factory=dict)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_dataset(name: str, seed: int = 0):
    """(x_train, y_train, x_test, y_test) as float32/int64 tensors, standardised on train."""
    if name != "digits":
        raise ValueError(f"dataset must be one of ['digits'], got {name!r}")
    from sklearn.datasets import load_digits

    d = load_digits()
    x = d.data.astype(np.float32)
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    xtr, ytr, xte, yte = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    return torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), torch.from_numpy(yte)


def make_mlp(in_dim: int, hidden, classes: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers, d = [], in_dim
    for h in hidden:
        layers += [torch.nn.Linear(d, h), torch.nn.ReLU()]
        d = h
    layers.append(torch.nn.Linear(d, classes))
    return torch.nn.Sequential(*layers)


def init_worker(rank: int, world: int, port: int, threads: int = 1, timeout_s: float = 300.0) -> None:
    import datetime

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def train_one(rank: int, world: int, compressor: Compressor | None, cfg: BenchConfig, data, on_step=None) -> dict:
    """Train cfg's MLP under DDP with ``compressor`` (None: plain DDP, no hook)."""
    from gradzip.hooks import register_hook

    xtr, ytr, xte, yte = data
    model = make_mlp(xtr.shape[1], cfg.hidden, int(ytr.max()) + 1, cfg.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)
    state = register_hook(ddp, compressor) if compressor is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    shard_x, shard_y = xtr[rank::world], ytr[rank::world]
    n = len(shard_x) - len(shard_x) % cfg.batch_size  # equal step counts on every rank
    n = min(n, (len(xtr) // world) // cfg.batch_size * cfg.batch_size)
    g = torch.Generator().manual_seed(cfg.seed)
    steps = 0
    t0 = time.perf_counter()
    for _ in range(cfg.epochs):
        order = torch.randperm(len(shard_x), generator=g)[:n]
        for i in range(0, n, cfg.batch_size):
            b = order[i : i + cfg.batch_size]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(shard_x[b]), shard_y[b]).backward()
            opt.step()
            steps += 1
            if on_step is not None:
                on_step(steps)
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    raw = sum(p.numel() * p.element_size() for p in model.parameters()) * steps
    st = state.stats() if state is not None else {"bytes_raw": raw, "bytes_sent": raw, "ratio": 1.0}
    return {
        "accuracy": acc,
        "steps": steps,
        "seconds_per_step": elapsed / max(steps, 1),
        "ratio": st["ratio"],
        "bytes_sent_per_step": st["bytes_sent"] / max(steps, 1),
        "bytes_raw_per_step": st["bytes_raw"] / max(steps, 1),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _worker(rank: int, world: int, port: int, methods: dict, cfg: BenchConfig, queue) -> None:
    try:
        init_worker(rank, world, port, cfg.threads, cfg.timeout_s)
        data = load_dataset(cfg.dataset, cfg.seed)
        for label, comp in methods.items():
            res = train_one(rank, world, comp, cfg, data)
            res.pop("params")
            if rank == 0:
                queue.put(("row", label, res))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report, then let the parent fail
        queue.put(("error", rank, repr(exc)))
        raise


def run(methods: dict[str, Compressor] | None = None, cfg: BenchConfig | None = None, progress=None) -> list[dict]:
    """Train every method on ``cfg.workers`` gloo ranks; rows in the order of ``methods``."""
    methods = default_methods() if methods is None else methods
    cfg = cfg or BenchConfig()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg.workers, port, methods, cfg, queue)) for r in range(cfg.workers)]
    for p in procs:
        p.start()
    rows = []
    try:
        while len(rows) < len(methods):
            kind, a, b = queue.get(timeout=cfg.timeout_s)
            if kind == "error":
                raise RuntimeError(f"rank {a} failed: {b}")
            rows.append({"method": a, **b})
            if progress is not None:
                progress(rows[-1])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    base = rows[0]["accuracy"]
    for r in rows:
        r["delta_accuracy"] = r["accuracy"] - base
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'method':<12}{'ratio':>10}{'wire B/step':>14}{'raw B/step':>13}{'test acc':>10}{'Δ acc (pp)':>12}{'ms/step':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['method']:<12}{r['ratio']:>9.1f}x{r['bytes_sent_per_step']:>14,.0f}{r['bytes_raw_per_step']:>13,.0f}"
            f"{100 * r['accuracy']:>9.2f}%{100 * r['delta_accuracy']:>+12.2f}{1000 * r['seconds_per_step']:>9.2f}"
        )
    return "\n".join(lines)
