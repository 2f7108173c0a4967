"""Training one row on N ranks: :func:`train_one` on every rank, :func:`run` for every row and
seed (the ranks are started once per run and train every method and seed in turn)."""

from __future__ import annotations

import copy
import datetime
import math
import queue as _queue
import socket
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ..hooks import register_hook
from ..registry import Spec
from . import lm
from .config import BenchConfig, Method, as_methods, check_methods, default_methods, hook_options, lr_factor
from .config import make_optimizer as make_optimizer
from .report import aggregate
from .tasks import load_dataset, make_model

#: What the ranks' forkserver imports once (a rank then starts in milliseconds, not seconds).
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "gradzip.bench"]


def process_context():
    """The multiprocessing context the ranks start from: a forkserver that imported torch and
    gradzip once, where the platform has one; else spawn. Either way a rank starts from a clean,
    single-threaded interpreter."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:  # no forkserver (Windows)
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


#: Validation windows of the language model's curve (the final loss scores them all).
CURVE_WINDOWS = 64


def _end_in_sync(opt, model: torch.nn.Module, world: int) -> None:
    """End a front end's run on one model: local SGD's ``synchronize()``; a front end without
    one (0/1 Adam between its syncs) ends on the ranks' average, by a plain allreduce that its
    byte counts leave out (as the peers' runs are scored)."""
    sync = getattr(opt, "synchronize", None)
    if sync is not None:
        sync()
        return
    if world > 1:
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p)
                p.div_(world)


def train_one(rank: int, world: int, method, cfg: BenchConfig, data, on_step=None, on_optimizer=None) -> dict:
    """Train cfg's model on this rank's data with ``method`` (a Method, a codec/protocol, or
    None) and seed ``cfg.seed``. Collective: every rank calls it with the same arguments.

    Image tasks: test accuracy at the end of every epoch (``curve``, rank 0's model; for a front
    end such as local SGD, the ranks' average; the last entry after ``synchronize()``). The
    language model: validation loss every ``cfg.resolved_eval_every()`` steps and at the end on a
    fixed subset of the validation text (``curve``), and at the end on all of it (``val_loss``),
    scored by every rank.
    ``on_step(steps)`` after each step; ``on_optimizer(opt)`` once, with the optimizer that
    steps the model (after the hook has taken its momentum over), to observe it."""
    if not isinstance(method, Method):
        method = Method("", method)
    device = torch.device(cfg.device if cfg.device == "cpu" else f"cuda:{rank}")
    model = make_model(cfg, data).to(device)
    local = isinstance(method.method, Spec)
    state = None
    if local:  # a front end that communicates in the optimizer's step (local SGD, 1-bit Adam): no DDP
        net = model
        spec = method.method
        if getattr(spec.cls, "builds_optimizer", False):  # 1-bit Adam: an Adam of its own
            kw = {"lr": cfg.lr, "betas": (cfg.momentum, 0.999), "weight_decay": cfg.weight_decay, **spec.kwargs}
            opt = inner = spec.cls(model.parameters(), *spec.args, **kw)
        else:
            inner = make_optimizer(cfg, model.parameters())
            opt = spec.cls(inner, model, *spec.args, **spec.kwargs)
        stats_of = opt.stats
    else:
        kw = {"device_ids": [rank]} if device.type == "cuda" else {}
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb, **kw)
        opt = make_optimizer(cfg, net.parameters(), method.momentum, method.lr_scale)
        if method.method is not None:
            state = register_hook(net, method.method, **hook_options(method, opt, cfg))
        stats_of = state.stats if state is not None else None
    if on_optimizer is not None:
        on_optimizer(inner if local else opt)
    total = cfg.total_steps()
    warmup = cfg.resolved_warmup()
    base_lrs = [g["lr"] for g in opt.param_groups]
    clip = cfg.clip if cfg.clip is not None and cfg.clip_mode == "global" else None
    steps = 0
    train_losses: list[float] = []

    def step(x, y, loss_fn) -> None:
        nonlocal steps
        f = lr_factor(steps, total, warmup, cfg.lr_schedule)
        for group, lr in zip(opt.param_groups, base_lrs):
            group["lr"] = lr * f
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        train_losses.append(float(loss.detach()))
        steps += 1
        if on_step is not None:
            on_step(steps)

    evaluating = 0.0
    t0 = time.perf_counter()
    if cfg.is_lm:
        train, val = (t.to(device) for t in data)
        context = lm.SIZES[cfg.lm_size].context
        batches = lm.Batches(train, context, cfg.batch_size, cfg.seed, rank)
        few, every_window = lm.windows(val, context, CURVE_WINDOWS), lm.windows(val, context)

        def lm_loss(logits, y):
            return F.cross_entropy(logits.reshape(-1, lm.VOCAB), y.reshape(-1))

        def score(wins) -> float:
            m = _averaged(model, world) if local and world > 1 else model
            return lm.val_loss(m, wins, world, rank)

        every = cfg.resolved_eval_every()
        curve: list = []
        for s in range(total):
            x, y = batches.next()
            step(x, y, lm_loss)
            if (s + 1) % every == 0 and s + 1 < total:
                te = time.perf_counter()
                curve.append([s + 1, score(few)])
                evaluating += time.perf_counter() - te
        if local:
            _end_in_sync(opt, model, world)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0 - evaluating
        final = lm.val_loss(model, every_window, world, rank)
        curve.append([total, lm.val_loss(model, few, world, rank)])
        result = {
            "val_loss": final,
            "bits_per_byte": final / math.log(2),
            "perplexity": math.exp(final),
            "curve": curve,
            "train_loss_last": float(np.mean(train_losses[-max(1, every) :])),
        }
    else:
        xtr, ytr, xte, yte = (t.to(device) for t in data)
        if cfg.train_limit:
            xtr, ytr = xtr[: cfg.train_limit], ytr[: cfg.train_limit]
        shard_x, shard_y = xtr[rank::world], ytr[rank::world]
        n = (len(xtr) // world) // cfg.batch_size * cfg.batch_size  # equal step counts on every rank
        epochs = cfg.resolved_epochs()
        g = torch.Generator().manual_seed(cfg.seed)
        curve = []
        for epoch in range(epochs):
            order = torch.randperm(len(shard_x), generator=g)[:n].to(device)
            for i in range(0, n, cfg.batch_size):
                b = order[i : i + cfg.batch_size]
                step(shard_x[b], shard_y[b], F.cross_entropy)
            if epoch < epochs - 1:  # the last epoch's accuracy is the final one, below
                te = time.perf_counter()
                if local:
                    avg = _averaged(model, world) if world > 1 else model
                    curve.append(_accuracy(avg, xte, yte))
                elif rank == 0:
                    curve.append(_accuracy(model, xte, yte))
                evaluating += time.perf_counter() - te
        if local:
            _end_in_sync(opt, model, world)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0 - evaluating
        acc = _accuracy(model, xte, yte)
        curve.append(acc)
        result = {
            "accuracy": acc,
            "curve": curve if rank == 0 or local else [],
            "accuracy_last3": float(np.mean(curve[-3:])) if rank == 0 or local else acc,
        }
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
        **result,
        "steps": steps,
        "seconds_per_step": elapsed / max(steps, 1),
        "ratio": raw_link / link if link else 1.0,
        "ratio_handed": raw / sent if sent else 1.0,
        "stats_ratio": st["ratio"] if st is not None else 1.0,  # the front end's own stats()["ratio"]
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


def run(methods=None, cfg: BenchConfig | None = None, progress=None, tick=None) -> list[dict]:
    """Train every method once per seed of ``cfg.seeds`` on ``cfg.workers`` ranks (started
    once); rows aggregated over seeds (:func:`~gradzip.bench.report.aggregate`), in the order
    of ``methods``.

    ``progress(run)`` is called as each (method, seed) finishes (``run["method"]``,
    ``run["seed"]``, ``run["accuracy"]`` or ``run["val_loss"]``, ...), ``tick(method, step)``
    as rank 0 trains.
    """
    methods = as_methods(default_methods() if methods is None else methods)
    cfg = cfg or BenchConfig()
    check_methods(methods, cfg)
    ctx = process_context()
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
    return aggregate(runs, baseline="Identity" if "Identity" in methods else base, metric=cfg.metric)
