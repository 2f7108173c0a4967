"""The small models, batches and save-and-resume scaffold that multi-rank tests share."""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.nn.functional as F


def make_model(
    seed: int = 0, widths=(48, 48, 48), inputs: int = 20, classes: int = 5, bn: bool = False
) -> torch.nn.Module:
    """An MLP ``inputs -> widths... -> classes`` with ReLUs (a BatchNorm after the first layer
    with ``bn``), initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    d = inputs
    for i, w in enumerate(widths):
        layers.append(torch.nn.Linear(d, w))
        if bn and i == 0:
            layers.append(torch.nn.BatchNorm1d(w))
        layers.append(torch.nn.ReLU())
        d = w
    layers.append(torch.nn.Linear(d, classes))
    return torch.nn.Sequential(*layers)


def batch(step: int, rank: int, n: int = 16, inputs: int = 20, classes: int = 5):
    """A random classification batch, different for every (step, rank) and the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, inputs, generator=g), torch.randint(0, classes, (n,), generator=g)


def train_steps(model, opt, steps: int, rank: int, first: int = 0, n: int = 16, record: list | None = None) -> list:
    """``steps`` cross-entropy steps on :func:`batch` ``first, first + 1, ...``; the losses.
    ``record``: a list that gets each step's gradients (after backward, before the step)."""
    losses = []
    for s in range(first, first + steps):
        x, y = batch(s, rank, n)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if record is not None:
            record.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def many_buckets_model() -> torch.nn.Module:
    """Six 300x300 linear layers (0.36 MB each): several DDP buckets at ``bucket_cap_mb=1``."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(300, 300) for _ in range(6)])


def train_many_buckets(model: torch.nn.Module, method, rank: int, steps: int, optimizer=None, **hook):
    """``steps`` SGD steps of ``model`` under DDP with ``bucket_cap_mb=1`` and gradzip's hook
    running ``method`` (each rank its own batch size): the collective-order check every new
    protocol gets. ``optimizer(params)`` builds the optimizer (default SGD at lr 1e-3), handed
    to the hook with ``hook``'s options when they are given. Returns the hook's state."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.hooks import register_hook

    ddp = DDP(model, bucket_cap_mb=1)
    opt = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=1e-3)))(ddp.parameters())
    state = register_hook(ddp, method, **({"optimizer": opt, **hook} if hook else {}))
    for s in range(steps):
        g = torch.Generator().manual_seed(s * 31 + rank)
        x = torch.randn(4 * (rank + 1), 300, generator=g)
        opt.zero_grad()
        (ddp(x) ** 2).mean().backward()
        opt.step()
    return state


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def roundtrip(obj):
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint file would take it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def resume_matches_unbroken(
    build: Callable[[int], tuple],
    train: Callable[[tuple, int, int], None],
    save: Callable[[tuple], dict],
    load: Callable[[tuple, dict], None],
    k: int,
    total: int | None = None,
    snapshot: Callable[[tuple], list] | None = None,
) -> dict:
    """The save-and-resume check every front end makes.

    ``build(seed)`` returns a run (model first, then whatever ``train``/``save``/``load``
    need); ``train(run, first, steps)`` trains it; ``save(run)`` returns a checkpoint dict;
    ``load(run, ckpt)`` restores one. Trains ``total`` (default ``2k``) steps unbroken; then
    ``k`` steps, saves (through ``torch.save``/``torch.load``), rebuilds from another seed (so
    only the checkpoint can make it match), loads and trains the rest. Returns both runs'
    ``snapshot(run)`` (default: the model's parameters) as ``unbroken`` and ``resumed``, and
    the checkpoint as ``ckpt``."""
    total = 2 * k if total is None else total
    snapshot = snapshot or (lambda run: params(run[0]))
    run = build(0)
    train(run, 0, total)
    unbroken = snapshot(run)
    run = build(0)
    train(run, 0, k)
    ckpt = roundtrip(save(run))
    del run
    run = build(123)
    load(run, ckpt)
    train(run, k, total - k)
    return {"unbroken": unbroken, "resumed": snapshot(run), "ckpt": ckpt}


def ddp_resume_matches_unbroken(
    rank: int, method, k: int, make: Callable[[int], torch.nn.Module] = make_model, bucket_cap_mb: float = 0.005
) -> dict:
    """:func:`resume_matches_unbroken` for a DDP model (``make(seed)``, several buckets) with
    gradzip's hook running ``method`` and SGD with momentum 0.9: the model, the optimizer and
    the hook's state are saved and loaded."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.hooks import register_hook

    def build(seed):
        model = make(seed)
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        state = register_hook(ddp, method)
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    def load(run, ckpt):
        model, _, state, opt = run
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        state.load_state_dict(ckpt["gradzip"])
        assert state.step == k

    return resume_matches_unbroken(
        build,
        lambda run, first, steps: train_steps(run[1], run[3], steps, rank, first),
        lambda run: {"model": run[0].state_dict(), "opt": run[3].state_dict(), "gradzip": run[2].state_dict()},
        load,
        k,
    )


def forget_dtensor_caches() -> None:
    """Clear torch's DTensor caches (sharding propagation, redistribute planners) in this process.

    A pooled rank (:mod:`tests.support.ranks`) runs each call in a new process group, but
    ``DeviceMesh`` equality ignores the mesh's process groups, so a sharding result cached in
    an earlier call can hand a DTensor the earlier call's mesh, whose group names the new
    process group does not know ("Could not resolve the process group registered under the
    name 7") or, worse, knows as other groups. Call it before building meshes in a pooled
    rank; a fresh process starts with these caches empty anyway."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:  # the C++ dispatch's own cache (torch 2.13)
        clear_fast_path()
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    except ImportError:  # older torch: no planner cache
        return
    clear_redistribute_planner_cache()
