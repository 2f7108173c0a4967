"""Peers beside gradzip on the language-model bench: the same training, other people's communication.

    python -m benchmarks.lm_peers \\
        --peers "powersgd1,powersgd4,fp16,bf16,torchft_diloco,torchft_streaming,demo,sparseloco" \\
        --seeds 0,1,2 --out FILE.json --demo-src /tmp/peers/src/demo --ccloco-src /tmp/peers/src/ccloco \\
        [--like benchmarks/results/lm_shakespeare_4ranks_adamw_cpu.json]

Every peer trains what ``gradzip bench --preset lm`` trains: the tiny byte-level GPT
(:func:`gradzip.bench.lm.make_gpt`, seeded by the seed), each rank's windows from
:class:`gradzip.bench.lm.Batches` seeded by (seed, rank), 4 gloo ranks, AdamW (the bench's
:func:`~gradzip.bench.config.make_optimizer`: lr 6e-3, betas (0.9, 0.999), weight decay 0.01),
the bench's cosine schedule with 50 warm-up steps (:func:`~gradzip.bench.config.lr_factor`, set
before every step), 1,000 steps, the validation loss every 100 steps on 64 windows (the curve)
and at the end on every validation window (:func:`gradzip.bench.lm.val_loss`). Only the
communication is the peers' own code, run as they ship it:

* ``ddp``: plain DDP, no hook (row "peer: plain DDP (runner check)"): proves this loop is the
  bench's training (its val_loss equals the bench's Identity row, tests/benchmarks/test_lm_peers.py).
* ``powersgd1``, ``powersgd4``: ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` with
  ``PowerSGDState(matrix_approximation_rank=1 or 4)``, error feedback and warm start on (torch's
  defaults), ``start_powerSGD_iter`` = torch's advice (10% of the steps, at least the warm-up):
  100 of 1,000 steps (``--powersgd-start``). DDP with ONE bucket (``bucket_cap_mb`` above the
  model's size; checked every step): with several buckets (``bucket_cap_mb=1``: 4 buckets) the
  ranks die on gloo: ``gloo::EnforceNotMet ... pair.cc:456] op.preamble.length <= op.nbytes.
  1088 vs 768. Received data size doesn't match expected size.`` (the buckets' P allreduces are
  issued in a different order on different ranks).
* ``fp16``, ``bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook`` (DDP's
  bucket_cap_mb as the bench's, 25: one bucket). Both allreduce on gloo in torch 2.13 CPU.
* ``torchft_diloco``, ``torchft_streaming``: torchft 0.2.0 ``torchft.local_sgd.DiLoCo``, one
  process per replica (a replica group of world size 1, ``ProcessGroupGloo``), a
  ``LighthouseServer`` in the launcher (min_replicas 4), ``Manager(use_async_quorum=False,
  init_sync=False)``, ``should_quantize=False``; outer optimizer DiLoCo's usual
  ``SGD(lr=0.7, momentum=0.9, nesterov=True)`` (one per fragment); ``sync_every=32``. Streaming:
  ``model_fragments`` = 4 groups of consecutive modules of the GPT ([tok, pos, block 0],
  [block 1], [block 2], [block 3, ln, head]), ``fragment_sync_delay=2`` and
  ``fragment_update_alpha=0.0``: what torchft's own example ``train_diloco.py`` does (a delay,
  there 5 of 10 steps between fragment syncs; alpha left at its default 0.0).
  1,000 is not a multiple of 32, and torchft has no final sync: the replicas' models differ
  at the end, and the loss (curve too) is scored on their average (a plain allreduce outside
  the peer, not counted), as the bench scores local SGD's curve.
* ``demo``: ``DeMo`` (bloc97/DeMo ``demo.py``, loaded from ``--demo-src``) replaces the optimizer
  and DDP (the model is not wrapped; DeMo all-gathers). Its defaults (decay 0.999, top-32 of
  every 64x64 DCT chunk), weight decay 0.01 (decoupled, as AdamW's), lr = the bench's lr x
  ``--demo-lr-factor`` on the bench's schedule (DeMo's sign update needs its own rate; the
  factor, 0.3, was chosen once by the sweep in :data:`DEMO_LR_SWEEP`).
* ``sparseloco``: ``CCLoco`` (tplr-y/CCLoco ``src/tplr/ccloco.py``, loaded from ``--ccloco-src``)
  as the outer optimizer of a DiLoCo loop written here after CCLoco's ``strategies.Diloco``:
  the bench's AdamW for H = 30 inner steps (``--sparseloco-h``; Templar's production value),
  then ``p.grad = global - local``, ``p <- global``, ``outer.step()``. CCLoco's SparseLoCo
  settings: lr 1, error_decay 0.95, top_k 32, chunk 64 (square chunks; 1-D tensors
  ``oned_chunk_strat="rate_2d"``, its train.py default), ``use_quantization=True`` with 4 bins
  (2-bit codes) and range 6, momentum 0, weight decay 0. At the end the inner steps left over
  (1,000 = 33 x 30 + 10) get one last outer step, as gradzip's ``synchronize()`` does.

Bytes, per rank, as ``gradzip bench`` reports them (``bytes_*_per_step`` over all the run's
steps; ``ratio`` = plain DDP's ring-allreduce bytes on a link / the peer's link bytes, over
the same steps):

* plain DDP (``bytes_raw``): the gradient bytes G = 4 x 875,264 every step, handed to
  allreduce; on the link ``2(N-1)/N x G`` (ring allreduce). ``ddp`` sends exactly that.
* allreduce peers: link = ``2(N-1)/N`` x the bytes they allreduce, sent = those bytes.
  fp16/bf16: the bucket's elements x 2 bytes, counted in a wrapper around the hook (2x).
  PowerSGD: for steps before ``start_powerSGD_iter`` the whole bucket in fp32 (its vanilla
  allreduce); after, the growth of ``PowerSGDState.total_numel_after_compression`` in that
  hook call (the P and Q matrices plus the tensors it leaves uncompressed, what it allreduces)
  x 4 bytes. torchft: every tensor handed to ``Manager.allreduce`` (counted in a wrapper
  around it), fp32 pseudo-gradients: the whole model once every 32 steps; streaming one
  fragment every 8 steps. The quorum and commit RPCs (lighthouse, manager servers) are not
  counted.
* all-gather peers: link = ``(N-1)`` x the bytes each rank hands to ``all_gather`` (ring
  all-gather), sent = those bytes. DeMo: its own ``data_transmit`` counter after every step
  (int64 indices + fp32 values of every tensor). SparseLoCo: every tensor handed to CCLoco's
  ``_all_gather_tensor`` (counted in a wrapper): int64 indices, uint8 codes (one byte per
  2-bit code, not packed, as the code ships them) and the quantization parameters
  ([shift, 4 centroids] fp32) of every tensor, once per outer step.

The bench's evaluation allreduces (scoring and averaging for the score) are not counted,
as in the bench. ``seconds_per_step``: training wall time over steps, evaluation left out.

The output is a results.json of ``gradzip bench``'s schema (:data:`gradzip.bench.SCHEMA`;
rows from :func:`gradzip.bench.aggregate`, methods labelled "peer: ...") with the same
``config`` as the bench run it sits beside (``--like RESULTS.json`` copies one), so that
``benchmarks/merge_runs.py`` pools it with gradzip's rows; what the peers ran with (sources,
their SHA-256, settings, the DeMo sweep) is under ``peers``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import hashlib
import importlib.util
import json
import math
import os
import queue as _queue
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradzip.bench import (
    FIELDS_DOC,
    SCHEMA,
    BenchConfig,
    aggregate,
    free_port,
    init_worker,
    lm,
    lr_factor,
    machine,
    make_optimizer,
    parse_seeds,
    process_context,
)
from gradzip.bench.train import CURVE_WINDOWS

#: DiLoCo's usual outer optimizer (Douillard et al.; torchft's train_diloco.py).
DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
#: CCLoco's SparseLoCo settings (hparams/500M/sweeps/ccloco.yaml, train.py defaults, Templar's 2-bit).
SPARSELOCO = {
    "lr": 1.0,
    "error_decay": 0.95,
    "top_k": 32,
    "chunk_size": 64,
    "chunk_strat": "square",
    "oned_chunk_strat": "rate_2d",
    "momentum": 0.0,
    "weight_decay": 0.0,
    "use_dct": False,
    "use_sign": False,
    "use_quantization": True,
    "quantization_bins": 4,
    "quantization_range": 6,
}
#: DeMo's lr = the bench's lr (6e-3) x this factor, chosen once from :data:`DEMO_LR_SWEEP`.
DEMO_LR_FACTOR = 0.3
#: The sweep that chose :data:`DEMO_LR_FACTOR` (2-core VM, 2026-12-07): seed 0, 4 ranks, 150 steps
#: (cosine over 150, 50 warm-up, DeMo's defaults, weight decay 0.01), the final validation loss
#: (nats per byte, every window) by factor; the best, 0.3 (lr 1.8e-3), is bracketed.
DEMO_LR_SWEEP = {
    "command": "python -m benchmarks.lm_peers --peers demo --seeds 0 --steps 150 --eval-every 50 "
    "--demo-lr-factor F --demo-src DIR --out FILE",
    "val_loss": {"0.03": 3.8778, "0.1": 2.9732, "0.3": 2.6060, "1.0": 2.9507},
}
#: The peers a run may name: (kind, options).
KINDS = {
    "ddp": ("ddp", {}),
    "powersgd1": ("ddp", {"hook": "powersgd", "rank": 1}),
    "powersgd4": ("ddp", {"hook": "powersgd", "rank": 4}),
    "fp16": ("ddp", {"hook": "fp16"}),
    "bf16": ("ddp", {"hook": "bf16"}),
    "torchft_diloco": ("torchft", {"fragments": 1}),
    "torchft_streaming": ("torchft", {"fragments": "streaming_fragments"}),
    "demo": ("demo", {}),
    "sparseloco": ("sparseloco", {}),
}
ALL_PEERS = [k for k in KINDS if k != "ddp"]


@dataclass
class PeerOptions:
    """What the peers run with besides the bench's configuration."""

    powersgd_start: int | None = None  # None: torch's advice, max(2, warm-up, 10% of the steps)
    diloco_sync_every: int = 32
    streaming_fragments: int = 4
    streaming_delay: int = 2
    streaming_alpha: float = 0.0
    demo_lr_factor: float = DEMO_LR_FACTOR
    sparseloco_h: int = 30
    demo_src: str | None = None
    ccloco_src: str | None = None
    torchft_timeout_s: float = 300.0

    def start_iter(self, cfg: BenchConfig) -> int:
        if self.powersgd_start is not None:
            return max(2, self.powersgd_start)
        return max(2, cfg.resolved_warmup(), round(0.1 * cfg.total_steps()))


def label(name: str, cfg: BenchConfig, o: PeerOptions) -> str:
    """The row's method: "peer: <what>"."""
    kind, k = KINDS[name]
    if name == "ddp":
        return "peer: plain DDP (runner check)"
    if k.get("hook") == "powersgd":
        return f"peer: torch powerSGD_hook(rank={k['rank']}, start_powerSGD_iter={o.start_iter(cfg)})"
    if k.get("hook") in ("fp16", "bf16"):
        return f"peer: torch {k['hook']}_compress_hook"
    if name == "torchft_diloco":
        return f"peer: torchft 0.2.0 DiLoCo(sync_every={o.diloco_sync_every})"
    if name == "torchft_streaming":
        return (
            f"peer: torchft 0.2.0 streaming DiLoCo({o.streaming_fragments} fragments, sync_every="
            f"{o.diloco_sync_every}, delay={o.streaming_delay}, alpha={o.streaming_alpha:g})"
        )
    if name == "demo":
        return f"peer: DeMo (bloc97/DeMo, lr x{o.demo_lr_factor:g})"
    return f"peer: SparseLoCo (CCLoco, H={o.sparseloco_h}, top-32/64x64, 2-bit)"


def describe(name: str, cfg: BenchConfig, o: PeerOptions) -> str:
    """The row's ``config``: the peer's settings."""
    kind, k = KINDS[name]
    if name == "ddp":
        return "DistributedDataParallel(bucket_cap_mb=25), no hook"
    if k.get("hook") == "powersgd":
        return (
            f"PowerSGDState(matrix_approximation_rank={k['rank']}, start_powerSGD_iter={o.start_iter(cfg)}, "
            "use_error_feedback=True, warm_start=True), DDP one bucket"
        )
    if kind == "ddp":
        return f"default_hooks.{k['hook']}_compress_hook, DDP bucket_cap_mb=25"
    if kind == "torchft":
        frag = 1 if k["fragments"] == 1 else o.streaming_fragments
        extra = (
            f", fragment_sync_delay={o.streaming_delay}, fragment_update_alpha={o.streaming_alpha:g}"
            if frag > 1
            else ""
        )
        return (
            f"torchft.local_sgd.DiLoCo({frag} fragment{'s' * (frag > 1)}, sync_every={o.diloco_sync_every}"
            f"{extra}, should_quantize=False), outer SGD{DILOCO_OUTER}"
        )
    if kind == "demo":
        return f"DeMo(lr={cfg.lr * o.demo_lr_factor:g}, weight_decay={cfg.weight_decay:g}, defaults otherwise)"
    return f"CCLoco({SPARSELOCO}) outer, H={o.sparseloco_h}"


# -- the peers' code, loaded from outside the repository --------------------------------------


def load_source(src: str | None, filename: str, what: str):
    """The module in ``src`` (a folder holding ``filename``, or the file itself)."""
    if not src:
        raise ValueError(f"{what} needs its authors' {filename}: pass its folder with --{what}-src")
    path = src if os.path.isfile(src) else os.path.join(src, filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: no {filename} in {src}")
    spec = importlib.util.spec_from_file_location(f"_peer_{what}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sha256(path: str | None, filename: str) -> str | None:
    if not path:
        return None
    p = path if os.path.isfile(path) else os.path.join(path, filename)
    if not os.path.isfile(p):
        return None
    with open(p, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# -- one run on one rank ----------------------------------------------------------------------


class Counter:
    """Bytes handed to collectives on this rank, and bytes on its link."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.link = 0.0

    def allreduce(self, nbytes: float, world: int) -> None:
        self.sent += nbytes
        self.link += 2 * (world - 1) / world * nbytes

    def all_gather(self, nbytes: float, world: int) -> None:
        self.sent += nbytes
        self.link += (world - 1) * nbytes


def gpt_fragments(model: lm.GPT, n: int) -> list[torch.nn.Module]:
    """``n`` groups of consecutive modules of the GPT (in forward order), cut where the running
    parameter count is nearest to k/n of the total."""
    mods = [model.tok, model.pos, *model.blocks, model.ln, model.head]
    sizes = [sum(p.numel() for p in m.parameters()) for m in mods]
    total, cuts = sum(sizes), []
    cum = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    for k in range(1, n):
        target = k * total / n
        i = min(range(len(cum) - 1), key=lambda j: abs(cum[j] - target))
        cuts.append(max(i + 1, (cuts[-1] + 1) if cuts else 1))
    bounds = [0, *cuts, len(mods)]
    groups = [mods[a:b] for a, b in zip(bounds, bounds[1:])]
    if any(not g for g in groups):
        raise ValueError(f"cannot cut {len(mods)} modules into {n} fragments")
    return [torch.nn.ModuleList(g) for g in groups]


class Trainer:
    """How one peer trains: the module to call, the optimizer the schedule drives, what runs
    after each step and at the end, and the model that is scored."""

    def __init__(self, model, net, opt, counter):
        self.model, self.net, self.opt, self.counter = model, net, opt, counter
        self.info: dict = {}
        self.local = False  # ranks' models differ: score their average

    def context(self):
        return contextlib.nullcontext()

    def after_step(self, steps: int) -> None:
        pass

    def finish(self, steps: int) -> None:
        pass

    def close(self) -> None:
        pass


def _ddp_trainer(model, cfg, o, kw, world, counter) -> Trainer:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hook = kw.get("hook")
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    cap = cfg.bucket_cap_mb if hook != "powersgd" else max(cfg.bucket_cap_mb, 2 * model_mb)
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    t = Trainer(model, net, make_optimizer(cfg, net.parameters()), counter)
    t.info["bucket_cap_mb"] = cap
    if hook is None:
        return t
    buckets: set[int] = set()
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=kw["rank"], start_powerSGD_iter=o.start_iter(cfg)
        )
        t.info["powersgd_state"] = state

        def counted(st, bucket):
            buf = bucket.buffer()
            buckets.add(bucket.index())
            if st.iter < st.start_powerSGD_iter:  # the hook's vanilla allreduce
                counter.allreduce(buf.numel() * buf.element_size(), world)
                return powerSGD_hook.powerSGD_hook(st, bucket)
            before = st.total_numel_after_compression
            fut = powerSGD_hook.powerSGD_hook(st, bucket)
            counter.allreduce((st.total_numel_after_compression - before) * buf.element_size(), world)
            return fut

    else:
        state = None
        fn = default_hooks.fp16_compress_hook if hook == "fp16" else default_hooks.bf16_compress_hook

        def counted(st, bucket):
            buckets.add(bucket.index())
            counter.allreduce(bucket.buffer().numel() * 2, world)  # cast to 16 bits, then allreduced
            return fn(st, bucket)

    net.register_comm_hook(state, counted)
    t.info["buckets"] = buckets

    def after(steps, t=t):
        if hook == "powersgd" and len(buckets) != 1:
            raise RuntimeError(f"PowerSGD needs one DDP bucket on gloo, got buckets {sorted(buckets)}")

    t.after_step = after
    return t


def _demo_trainer(model, cfg, o, world, counter) -> Trainer:
    demo = load_source(o.demo_src, "demo.py", "demo")
    opt = demo.DeMo(model.parameters(), lr=cfg.lr * o.demo_lr_factor, weight_decay=cfg.weight_decay)
    t = Trainer(model, model, opt, counter)

    def after(steps):
        counter.all_gather(opt.data_transmit, world)  # DeMo's own count: idx + val bytes of this step

    t.after_step = after
    return t


def _sparseloco_trainer(model, cfg, o, world, counter) -> Trainer:
    ccloco = load_source(o.ccloco_src, "ccloco.py", "ccloco")
    inner = make_optimizer(cfg, model.parameters())
    outer = ccloco.CCLoco(model.parameters(), process_group=dist.group.WORLD, **SPARSELOCO)
    gather = outer._all_gather_tensor

    def counted_gather(tensor):
        counter.all_gather(tensor.nbytes, world)
        return gather(tensor)

    outer._all_gather_tensor = counted_gather
    t = Trainer(model, model, inner, counter)
    t.local = True
    state = {"global": None, "since": 0, "outer_steps": 0}

    def offload():  # strategies.Diloco._get_offloaded_param
        state["global"] = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def outer_step():  # strategies.Diloco.outer_step, compressive optimizer: no allreduce
        for g, p in zip(state["global"], model.parameters()):
            p.grad = g - p.data
            p.data.copy_(g)
        outer.step()
        outer.zero_grad(set_to_none=True)
        state["since"] = 0
        state["outer_steps"] += 1
        offload()

    offload()

    def after(steps):
        state["since"] += 1
        if state["since"] == o.sparseloco_h:
            outer_step()

    def finish(steps):
        if state["since"]:
            outer_step()
        t.local = False  # every rank now holds the same global model
        t.info["outer_steps"] = state["outer_steps"]

    t.after_step, t.finish = after, finish
    return t


def _torchft_trainer(model, cfg, o, kw, rank, world, counter, lighthouse) -> Trainer:
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    timeout = datetime.timedelta(seconds=o.torchft_timeout_s)
    inner = make_optimizer(cfg, model.parameters())
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=world,
        use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"lm_peers_{rank}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        port=0,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        init_sync=False,
    )
    allreduce = manager.allreduce

    def counted_allreduce(tensor, *a, **k):
        counter.allreduce(tensor.nbytes, world)
        return allreduce(tensor, *a, **k)

    manager.allreduce = counted_allreduce
    n = 1 if kw["fragments"] == 1 else o.streaming_fragments
    frags = [model] if n == 1 else gpt_fragments(model, n)
    outers = [torch.optim.SGD(f.parameters(), **DILOCO_OUTER) for f in frags]
    extra = {"fragment_sync_delay": o.streaming_delay, "fragment_update_alpha": o.streaming_alpha} if n > 1 else {}
    diloco = DiLoCo(
        manager,
        frags,
        inner,
        outers,
        sync_every=o.diloco_sync_every,
        backup_device=torch.device("cpu"),
        should_quantize=False,
        **extra,
    )
    t = Trainer(model, model, inner, counter)
    t.local = True
    t.context = lambda: diloco
    t.info["fragment_params"] = [sum(p.numel() for p in f.parameters()) for f in frags]

    def finish(steps):
        t.info["commits"] = manager.current_step()

    def close():
        manager.shutdown(wait=False)
        store  # noqa: B018 (kept alive until the manager is down)

    t.finish, t.close = finish, close
    return t


def _averaged(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """The ranks' average model, by a plain allreduce outside the peer (not counted)."""
    avg = copy.deepcopy(model)
    with torch.no_grad():
        for p in avg.parameters():
            dist.all_reduce(p)
            p.div_(world)
    return avg


def train_peer(rank: int, world: int, name: str, cfg: BenchConfig, o: PeerOptions, lighthouse=None, on_step=None):
    """One (peer, seed) on this rank: the bench's training loop (gradzip.bench.train.train_one,
    language model) with the peer's communication. Collective."""
    kind, kw = KINDS[name]
    model = lm.make_gpt(cfg.lm_size, cfg.seed)
    counter = Counter()
    if kind == "ddp":
        t = _ddp_trainer(model, cfg, o, kw, world, counter)
    elif kind == "demo":
        t = _demo_trainer(model, cfg, o, world, counter)
    elif kind == "sparseloco":
        t = _sparseloco_trainer(model, cfg, o, world, counter)
    else:
        t = _torchft_trainer(model, cfg, o, kw, rank, world, counter, lighthouse)
    opt, net = t.opt, t.net
    total, warmup = cfg.total_steps(), cfg.resolved_warmup()
    base_lrs = [g["lr"] for g in opt.param_groups]
    train, val = lm.corpus()
    context = lm.SIZES[cfg.lm_size].context
    batches = lm.Batches(train, context, cfg.batch_size, cfg.seed, rank)
    few, every_window = lm.windows(val, context, CURVE_WINDOWS), lm.windows(val, context)
    every = cfg.resolved_eval_every()

    def score(wins) -> float:
        m = _averaged(model, world) if t.local and world > 1 else model
        return lm.val_loss(m, wins, world, rank)

    curve: list = []
    train_losses: list[float] = []
    evaluating = 0.0
    steps = 0
    t0 = time.perf_counter()
    try:
        with t.context():
            for s in range(total):
                x, y = batches.next()
                f = lr_factor(steps, total, warmup, cfg.lr_schedule)
                for group, lr in zip(opt.param_groups, base_lrs):
                    group["lr"] = lr * f
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(net(x).reshape(-1, lm.VOCAB), y.reshape(-1))
                loss.backward()
                opt.step()
                t.after_step(s + 1)
                train_losses.append(float(loss.detach()))
                steps += 1
                if on_step is not None:
                    on_step(steps)
                if (s + 1) % every == 0 and s + 1 < total:
                    te = time.perf_counter()
                    curve.append([s + 1, score(few)])
                    evaluating += time.perf_counter() - te
            t.finish(steps)
        elapsed = time.perf_counter() - t0 - evaluating
        scored = _averaged(model, world) if t.local and world > 1 else model
        final = lm.val_loss(scored, every_window, world, rank)
        curve.append([total, lm.val_loss(scored, few, world, rank)])
    finally:
        t.close()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    raw = grad_bytes * steps
    raw_link = 2 * (world - 1) / world * raw
    sent, link = (raw, raw_link) if name == "ddp" else (counter.sent, counter.link)
    stats_ratio = raw_link / link if link else 1.0
    info = {k: v for k, v in t.info.items() if k not in ("powersgd_state", "buckets")}
    if "powersgd_state" in t.info:
        rate, before, after = t.info["powersgd_state"].compression_stats()
        if after:  # PowerSGDState.compression_stats(): its own numel ratio, once it has compressed
            stats_ratio = float(rate)
        info.update(powersgd_numel_before=int(before), powersgd_numel_after=int(after))
    if "buckets" in t.info:
        info["ddp_buckets"] = sorted(t.info["buckets"])
    return {
        "val_loss": final,
        "bits_per_byte": final / math.log(2),
        "perplexity": math.exp(final),
        "curve": curve,
        "train_loss_last": float(np.mean(train_losses[-max(1, every) :])),
        "steps": steps,
        "seconds_per_step": elapsed / max(steps, 1),
        "ratio": raw_link / link if link else 1.0,
        "ratio_handed": raw / sent if sent else 1.0,
        "stats_ratio": stats_ratio,
        "bytes_link_per_step": link / max(steps, 1),
        "bytes_link_raw_per_step": raw_link / max(steps, 1),
        "bytes_sent_per_step": sent / max(steps, 1),
        "bytes_raw_per_step": raw / max(steps, 1),
        "peer": name,
        "peer_info": info,
    }


# -- launching ranks --------------------------------------------------------------------------


def _tick(queue, name):
    return lambda s: queue.put(("tick", name, s)) if s % 100 == 0 else None


def _worker(rank, world, port, jobs, cfg, o, queue) -> None:
    """The ranks of the peers that need only torch (and the fetched sources): every (peer, seed)
    in turn on one default process group."""
    try:
        init_worker(rank, world, port, cfg.threads, cfg.timeout_s)
        for name, seed in jobs:
            res = train_peer(
                rank, world, name, replace(cfg, seed=seed), o, on_step=_tick(queue, name) if rank == 0 else None
            )
            if rank == 0:
                queue.put(("run", name, {"seed": seed, **res}))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report, then let the parent fail
        queue.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise


def _torchft_worker(rank, world, port, lighthouse, name, cfg, o, queue) -> None:
    """One torchft replica (a replica group of one process); the default group is only for
    scoring the model (not counted)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    try:
        init_worker(rank, world, port, cfg.threads, cfg.timeout_s)
        res = train_peer(
            rank, world, name, cfg, o, lighthouse=lighthouse, on_step=_tick(queue, name) if rank == 0 else None
        )
        if rank == 0:
            queue.put(("run", name, {"seed": cfg.seed, **res}))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        queue.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise


def _collect(procs, queue, expected, timeout_s, progress) -> list[dict]:
    runs = []
    try:
        while len(runs) < expected:
            try:
                kind, a, b = queue.get(timeout=timeout_s)
            except _queue.Empty:
                raise TimeoutError(f"no progress from the ranks in {timeout_s}s") from None
            if kind == "error":
                raise RuntimeError(f"rank {a} failed: {b}")
            if kind == "tick":
                if progress is not None and b % 100 == 0:
                    progress(f"  {a}: step {b}")
                continue
            runs.append((a, b))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return runs


def run(peers: list[str], cfg: BenchConfig, o: PeerOptions, progress=print) -> list[dict]:
    """Every peer once per seed of ``cfg.seeds``; the per-(peer, seed) runs, in order."""
    ctx = process_context()
    world = cfg.workers
    out: list[dict] = []

    def add(name, res):
        out.append({"method": label(name, cfg, o), "config": describe(name, cfg, o), **res})
        if progress is not None:
            r = out[-1]
            progress(
                f"{r['method']} seed {r['seed']}: val_loss {r['val_loss']:.4f}, link ratio {r['ratio']:.1f}x, "
                f"{r['seconds_per_step']:.3f} s/step"
            )

    plain = [(n, s) for n in peers if KINDS[n][0] != "torchft" for s in cfg.seeds]
    if plain:
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, plain, cfg, o, queue)) for r in range(world)]
        for p in procs:
            p.start()
        for name, res in _collect(procs, queue, len(plain), cfg.timeout_s, progress):
            add(name, res)
    for name in [n for n in peers if KINDS[n][0] == "torchft"]:
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft.coordination import LighthouseServer

        for seed in cfg.seeds:
            lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=world, join_timeout_ms=10_000)
            try:
                queue = ctx.Queue()
                port = free_port()
                args = (world, port, lh.address(), name, replace(cfg, seed=seed), o, queue)
                procs = [ctx.Process(target=_torchft_worker, args=(r, *args)) for r in range(world)]
                for p in procs:
                    p.start()
                for n, res in _collect(procs, queue, 1, cfg.timeout_s, progress):
                    add(n, res)
            finally:
                lh.shutdown()
    order = {n: i for i, n in enumerate(peers)}
    out.sort(key=lambda r: (order[r["peer"]], r["seed"]))
    return out


# -- the command line -------------------------------------------------------------------------


def config_from(a) -> BenchConfig:
    """The bench configuration: ``--like``'s (a gradzip results.json), else the options given
    (left at None when not given, as ``gradzip bench`` records them)."""
    if a.like:
        with open(a.like) as f:
            c = dict(json.load(f)["config"])
        for k in ("epochs", "steps_per_epoch", "total_steps", "metric"):
            c.pop(k, None)
        c["hidden"] = tuple(c["hidden"])
        cfg = BenchConfig(**{**c, "seeds": a.seeds, "seed": a.seeds[0]})
    else:
        cfg = BenchConfig(
            dataset="shakespeare",
            workers=a.workers,
            steps=a.steps,
            warmup_steps=a.warmup_steps,
            lr=a.lr,
            eval_every=a.eval_every,
            lm_size=a.lm_size,
            seeds=a.seeds,
            seed=a.seeds[0],
        )
    if not cfg.is_lm or cfg.optimizer != "adamw" or cfg.clip is not None or cfg.precondition or cfg.device != "cpu":
        raise ValueError(
            "the peers train the language model with AdamW on CPU, without clipping or preconditioning; "
            f"got dataset={cfg.dataset!r} optimizer={cfg.optimizer!r} clip={cfg.clip!r} "
            f"precondition={cfg.precondition!r} device={cfg.device!r}"
        )
    return cfg


def document(rows: list[dict], cfg: BenchConfig, o: PeerOptions, command: str) -> dict:
    """results.json of gradzip bench's schema, with what the peers ran with under ``peers``."""
    config = {
        **asdict(cfg),
        "epochs": cfg.resolved_epochs(),
        "steps_per_epoch": cfg.steps_per_epoch(),
        "total_steps": cfg.total_steps(),
        "metric": cfg.metric,
    }
    try:
        from importlib.metadata import version

        torchft_version = version("torchft")
    except Exception:  # noqa: BLE001
        torchft_version = None
    return {
        "schema": SCHEMA,
        "command": command,
        "machine": machine(),
        "config": config,
        "fields": {
            **FIELDS_DOC,
            "peer_info": "per seed: what the peer reported (DDP buckets seen, PowerSGD's compression_stats "
            "numel, torchft commits, SparseLoCo outer steps); bytes as benchmarks/lm_peers.py's docstring says",
        },
        "peers": {
            "options": asdict(o),
            "powersgd_start_iter": o.start_iter(cfg),
            "diloco_outer": DILOCO_OUTER,
            "sparseloco": SPARSELOCO,
            "demo_lr": cfg.lr * o.demo_lr_factor,
            "demo_lr_sweep": DEMO_LR_SWEEP,
            "sources": {
                "demo.py": {"repo": "bloc97/DeMo", "sha256": sha256(o.demo_src, "demo.py")},
                "ccloco.py": {
                    "repo": "tplr-y/CCLoco (src/tplr/ccloco.py)",
                    "sha256": sha256(o.ccloco_src, "ccloco.py"),
                },
                "torchft": torchft_version,
                "torch": torch.__version__,
            },
        },
        "rows": rows,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", default=",".join(ALL_PEERS), help=f"comma-separated, of: {', '.join(KINDS)}")
    p.add_argument("--seeds", type=parse_seeds, default=(0, 1, 2))
    p.add_argument("--steps", type=int, default=None, help="default: the bench's (1000); recorded as given")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: the bench's (50); recorded as given")
    p.add_argument("--lr", type=float, default=None, help="default: the bench's (6e-3 for AdamW)")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--lm-size", default="tiny")
    p.add_argument("--like", help="copy the configuration of this gradzip results.json (for merge_runs)")
    p.add_argument("--out", required=True, help="the results .json to write")
    p.add_argument("--demo-src", help="folder holding bloc97/DeMo's demo.py (kept outside the repository)")
    p.add_argument("--ccloco-src", help="folder holding tplr-y/CCLoco's src/tplr/ccloco.py")
    p.add_argument("--demo-lr-factor", type=float, default=DEMO_LR_FACTOR)
    p.add_argument("--sparseloco-h", type=int, default=30)
    p.add_argument("--diloco-sync-every", type=int, default=32)
    p.add_argument("--streaming-delay", type=int, default=2)
    p.add_argument("--streaming-alpha", type=float, default=0.0)
    p.add_argument("--powersgd-start", type=int, default=None, help="default: max(warm-up, 10%% of the steps)")
    a = p.parse_args(argv)
    peers = [s.strip() for s in a.peers.split(",") if s.strip()]
    bad = [n for n in peers if n not in KINDS]
    if bad or not peers:
        p.error(f"unknown peers {bad}; choose from {list(KINDS)}")
    cfg = config_from(a)
    o = PeerOptions(
        powersgd_start=a.powersgd_start,
        diloco_sync_every=a.diloco_sync_every,
        streaming_delay=a.streaming_delay,
        streaming_alpha=a.streaming_alpha,
        demo_lr_factor=a.demo_lr_factor,
        sparseloco_h=a.sparseloco_h,
        demo_src=os.path.abspath(a.demo_src) if a.demo_src else None,
        ccloco_src=os.path.abspath(a.ccloco_src) if a.ccloco_src else None,
    )
    if "demo" in peers:
        load_source(o.demo_src, "demo.py", "demo")  # fail before any rank starts
    if "sparseloco" in peers:
        load_source(o.ccloco_src, "ccloco.py", "ccloco")
    runs = run(peers, cfg, o, progress=lambda s: print(s, file=sys.stderr, flush=True))
    rows = aggregate(runs, baseline="Identity", metric=cfg.metric)  # no Identity here: no gaps
    command = shlex.join(["python", "-m", "benchmarks.lm_peers", *(sys.argv[1:] if argv is None else argv)])
    doc = document(rows, cfg, o, command)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    for r in rows:
        print(
            f"{r['method']:<75} ratio {r['ratio']:8.1f}x  val_loss {r['val_loss']:.4f}  "
            f"{r['seconds_per_step']:.3f} s/step"
        )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
