"""``on_nonfinite="skip"`` that skips: a NaN loss on one rank, AdamW and no GradScaler.

With the optimizer known (``register_hook(optimizer=)``, ``gz.skip_nonfinite(optimizer, state)``,
``DistributedOptimizer``) the run ends where a run that never saw that batch ends: the same
parameters and optimizer state (``step`` counts included), bit for bit, on every rank. Without
it the parameters turn NaN, and the first such step warns once, naming the fix. A GradScaler
composes with the guard, and so do an LR scheduler and ``step(closure)``.

Every step the engines end between two optimizer steps counts (FSDP's gradient accumulation
sums each micro-batch's reduce-scatter into ``.grad``), and ``optimizer.step()`` while a call
runs is refused.

One gloo spawn per world size runs the DDP scenarios (:func:`_all`); the tests read its results."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
import gradzip.kernels as K
from gradzip.hooks import register_hook
from tests.support import batch, make_model, run_ranks

pytestmark = pytest.mark.slow

STEPS, BAD = 5, 2  # the poisoned batch; the reference run leaves it out
#: With an LR scheduler the first batch is poisoned: the scheduler's first step checks that
#: ``optimizer.step()`` was called before it.
FIRST = ("scheduler_first", "scheduler_after")


def _model():
    return make_model(widths=(12,)).double()


def _data(s, rank):
    x, y = batch(s, rank, n=8)
    return x.double(), y


def _snapshot(model, opt) -> dict:
    state = [opt.state[p] for p in model.parameters()]
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "opt": [{k: v.clone() for k, v in s.items()} for s in state],
    }


def _ddp_run(rank, mode, bad):
    """AdamW on a DDP model with the Int8 hook; batch ``BAD`` (the first with a scheduler)
    poisoned on the last rank (``bad``) or left out (the reference). ``mode``: how the guard is
    set up (``"none"``: no guard, and a second NaN batch)."""
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    sched = None
    if mode == "scheduler_first":  # a scheduler that wraps step() before the guard does
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    if mode == "precondition":  # the optimizer steps by the hook's step pre- and post-hooks
        state = register_hook(ddp, gz.Int8(), optimizer=opt, precondition=True)
    elif mode in ("hook", "closure", *FIRST):
        state = register_hook(ddp, gz.Int8(), optimizer=opt)
    else:
        state = register_hook(ddp, gz.Int8())
    if mode == "call":
        gz.skip_nonfinite(opt, state)
    if mode == "scheduler_after":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    world = torch.distributed.get_world_size()
    at = 0 if mode in FIRST else BAD
    poisoned = (at, at + 1) if mode == "none" else (at,)  # without a guard: a second NaN step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(STEPS):
            if s == at and not bad:
                continue
            x, y = _data(s, rank)
            poison = bad and s in poisoned and rank == world - 1

            def closure(x=x, y=y, poison=poison):
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp(x), y)
                (loss * float("nan") if poison else loss).backward()
                return loss

            if mode == "closure":
                opt.step(closure)
            else:
                closure()
                opt.step()
            if sched is not None:
                sched.step()
    out = _snapshot(model, opt)
    out["warnings"] = [str(w.message) for w in caught if "skip_nonfinite" in str(w.message)]
    out["scheduler_warnings"] = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    # the hook's own state, rolled back: Int8's residuals, the moments it took over (and, with
    # precondition=True, Adam's step counts)
    memories = [state.engine.memory] + ([state.engine.moments] if state.engine.moments is not None else [])
    out["residuals"] = {k: v.clone() for m in memories for k, v in m.residuals.items()}
    return out


def _scaler_run(rank, guard):
    """A GradScaler on the same loop, with and without ``gz.skip_nonfinite``: the scaler skips
    the NaN step itself, and the guard changes nothing."""
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    state = register_hook(ddp, gz.Int8())
    if guard:
        gz.skip_nonfinite(opt, state)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    world = torch.distributed.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unguarded run's warning (the scaler skips the step)
        for s in range(STEPS):
            x, y = _data(s, rank)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            if s == BAD and rank == world - 1:
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return _snapshot(model, opt)


def _optim_run(rank, bad):
    """gz.DistributedOptimizer around AdamW (it owns the optimizer: it skips by itself)."""
    model = _model()
    opt = gz.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), named_parameters=model.named_parameters(), compression=gz.Int8()
    )
    world = torch.distributed.get_world_size()
    for s in range(STEPS):
        if s == BAD and not bad:
            continue
        x, y = _data(s, rank)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if s == BAD and rank == world - 1:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
    return _snapshot(model, opt.optimizer)


GUARDED = ["hook", "call"]
MORE = ["closure", "precondition", *FIRST]


def _all(rank, world, gpu=False):
    if gpu:  # the engine's GPU side: its checks on the device, the step's verdict read at its end
        with K.gpu_side_on_cpu():
            return _all(rank, world)
    modes = GUARDED + (MORE if world == 2 else [])
    out = {mode: {"bad": _ddp_run(rank, mode, True), "ref": _ddp_run(rank, mode, False)} for mode in modes}
    if world == 2:
        out["none"] = {"bad": _ddp_run(rank, "none", True)}
        out["scaler"] = {"guard": _scaler_run(rank, True), "plain": _scaler_run(rank, False)}
        out["optim"] = {"bad": _optim_run(rank, True), "ref": _optim_run(rank, False)}
    return out


@pytest.fixture(scope="module")
def runs():
    """``runs(world, gpu=False)``: every rank's results of :func:`_all` on ``world`` ranks, run once."""
    cache: dict = {}

    def get(world: int, gpu: bool = False) -> list:
        if (world, gpu) not in cache:
            cache[(world, gpu)] = run_ranks(_all, world, gpu)
        return cache[(world, gpu)]

    return get


def _same(a: dict, b: dict) -> bool:
    """Parameters and optimizer state (every tensor, ``step`` included) bit for bit."""
    if len(a["opt"]) != len(b["opt"]) or any(set(x) != set(y) for x, y in zip(a["opt"], b["opt"])):
        return False
    pairs = list(zip(a["params"], b["params"]))
    pairs += [(x[k], y[k]) for x, y in zip(a["opt"], b["opt"]) for k in x]
    return all(torch.equal(x, y) for x, y in pairs)


# 4 ranks: a pool of its own (seconds of start-up), so in `make test-long`
CASES = [pytest.param(2, mode, id=f"2ranks-{mode}") for mode in GUARDED + MORE + ["optim"]] + [
    pytest.param(4, mode, id=f"4ranks-{mode}", marks=pytest.mark.long) for mode in GUARDED
]


@pytest.mark.parametrize(("world", "mode"), CASES)
def test_a_nan_on_one_rank_ends_where_a_run_without_that_batch_ends(runs, world, mode):
    results = runs(world)
    for r in results:
        bad, ref = r[mode]["bad"], r[mode]["ref"]
        assert all(bool(torch.isfinite(p).all()) for p in bad["params"]), mode
        steps = [int(s["step"]) for s in bad["opt"] if s]  # none: the hook's own step (precondition)
        assert steps == [STEPS - 1] * len(steps) and (steps or mode == "precondition"), mode
        assert _same(bad, ref), mode
        if "residuals" in bad:  # the rolled-back residuals too
            assert bad["residuals"].keys() == ref["residuals"].keys()
            assert all(torch.equal(bad["residuals"][k], ref["residuals"][k]) for k in bad["residuals"])
            counts = [float(v) for k, v in bad["residuals"].items() if k.endswith(":adam_step")]
            assert counts == ([STEPS - 1.0] * len(bad["params"]) if mode == "precondition" else []), mode
            assert bad["warnings"] == [] and bad["scheduler_warnings"] == [], mode
    assert all(_same(r[mode]["bad"], results[0][mode]["bad"]) for r in results), mode  # every rank alike


def test_without_the_optimizer_the_parameters_turn_nan_and_the_first_nan_step_warns_once(runs):
    for r in runs(2):
        got = r["none"]["bad"]
        assert any(bool(torch.isnan(p).any()) for p in got["params"])  # what the guard prevents
        assert len(got["warnings"]) == 1, got["warnings"]  # two NaN steps, one warning
        text = got["warnings"][0]
        assert f"at step {BAD}" in text and "GradScaler" in text
        # the remedy is the guard; optimizer= (momentum correction) only as what also installs it
        assert "call gz.skip_nonfinite(optimizer, state)" in text and "pass optimizer=" not in text


def test_on_the_gpu_side_the_verdict_read_when_the_step_ends_skips_alike(runs):
    """The same scenarios with the engine's checks on the device (``gpu_side_on_cpu``): each
    guarded run ends where its run without the batch ends, and an unguarded one warns once."""
    results = runs(2, gpu=True)
    for mode in GUARDED + MORE + ["optim", "scaler"]:
        for r in results:
            a, b = (r[mode]["bad"], r[mode]["ref"]) if mode != "scaler" else (r[mode]["guard"], r[mode]["plain"])
            assert all(bool(torch.isfinite(p).all()) for p in a["params"]) and _same(a, b), mode
    for r in results:
        got = r["none"]["bad"]
        assert any(bool(torch.isnan(p).any()) for p in got["params"])
        assert len(got["warnings"]) == 1 and f"at step {BAD}" in got["warnings"][0], got["warnings"]


def test_a_grad_scaler_skips_first_and_the_guard_changes_nothing(runs):
    for r in runs(2):
        guard, plain = r["scaler"]["guard"], r["scaler"]["plain"]
        assert all(bool(torch.isfinite(p).all()) for p in guard["params"])
        assert [int(s["step"]) for s in guard["opt"]] == [STEPS - 1] * len(guard["opt"])
        assert _same(guard, plain)


def test_skip_nonfinite_refuses_what_it_cannot_guard():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="state must be what register_hook"):
        gz.skip_nonfinite(opt, object())


def _windows(rank, world):
    """An Engine's steps summed into ``.grad`` (as FSDP's gradient accumulation sums each
    micro-batch's reduce-scatter) between the guarded optimizer's steps."""
    eng = gz.Engine(gz.Int8())
    w = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([w], lr=0.5)
    gz.skip_nonfinite(opt, eng)

    def micro(s, nan=False, wait=True):
        g = torch.full((8,), float(s + rank + 1))
        if nan and rank == world - 1:
            g[3] = float("nan")
        fut = eng.reduce(["w"], [g])
        if not wait:
            return fut
        eng.flush()
        eng.end_step()
        out = fut.wait().view(8)
        w.grad = out.clone() if w.grad is None else w.grad + out

    def stepped():
        before = w.detach().clone()
        opt.step()
        return not torch.equal(w.detach(), before)

    log = {}
    micro(0)
    log["finite"] = stepped()
    opt.zero_grad()
    micro(1, nan=True)  # NaN in .grad ...
    micro(2)  # ... and a finite last step
    log["accumulated"] = (eng.last_step_nonfinite, bool(w.grad.isnan().any()), stepped())
    opt.zero_grad()
    micro(3)
    micro(4)
    log["finite window"] = stepped()
    # a step skipped elsewhere (a GradScaler): its window ends at zero_grad()
    opt.zero_grad()
    micro(5, nan=True)
    opt.zero_grad()
    micro(6)
    log["after zero_grad"] = stepped()
    # gradients cleared by hand: the window stays open
    opt.zero_grad()
    micro(7, nan=True)
    w.grad = None
    micro(8)
    log["cleared by hand"] = stepped()
    # optimizer.step() while a call runs: rank 1 joins it only once rank 0 has tried
    opt.zero_grad()
    side = dist.new_group(backend="gloo")
    token = torch.zeros(1)
    if rank == 0:
        fut = micro(9, wait=False)
        eng.end_step()
        try:
            opt.step()
            log["running"] = "stepped"
        except RuntimeError as e:
            log["running"] = str(e)
        dist.send(token, 1, group=side)
        w.grad = fut.wait().view(8).clone()
    else:
        dist.recv(token, 0, group=side)
        micro(9)
    log["after running"] = stepped()
    log["skipped"] = opt.__dict__["_gradzip_skip_nonfinite"].skipped
    # the wrapper keeps zero_grad's signature (Accelerate reads it for set_to_none)
    log["zero_grad signature"] = list(inspect.signature(opt.zero_grad).parameters)
    return log


def test_every_engine_step_between_two_optimizer_steps_counts():
    results = run_ranks(_windows, 2)
    for r in results:
        assert r["finite"] and r["finite window"] and r["after zero_grad"] and r["after running"]
        # the last verdict is finite, .grad holds the first micro-batch's NaN: skipped
        assert r["accumulated"] == (False, True, False)
        assert not r["cleared by hand"]  # as documented: only zero_grad() ends the window
        assert r["skipped"] == 2
        assert r["zero_grad signature"] == ["set_to_none"]
    running = results[0]["running"]
    assert "still running" in running and "Engine.end_step()" in running, running


def _fsdp_accumulation(rank, world):
    """FSDP2, a reduce-scatter every micro-batch, summed into the sharded .grad: a NaN in the
    first of two micro-batches (on rank 1 only) skips the guarded optimizer's step."""
    from tests.frontends.test_fsdp import batch as lm_batch
    from tests.frontends.test_fsdp import build, loss_of

    model, _ = build(world)
    state = gz.fsdp.compress(model, gz.Int8())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gz.skip_nonfinite(opt, state)

    def shards():
        return [p.detach().to_local().clone() for p in model.parameters()]

    def accumulate(step, nan):
        for mb in range(2):
            idx, tgt = lm_batch(rank, 2 * step + mb)
            loss = loss_of(model, idx, tgt)
            if nan and mb == 0 and rank == 1:
                loss = loss * float("nan")
            loss.backward()

    log = {}
    before = shards()
    accumulate(0, nan=True)
    log["last verdict"] = state.engine.last_step_nonfinite
    log["grad nan"] = any(bool(p.grad.to_local().isnan().any()) for p in model.parameters())
    opt.step()
    log["unchanged"] = all(torch.equal(a, b) for a, b in zip(shards(), before))
    log["momentum"] = len(opt.state)
    opt.zero_grad()
    accumulate(1, nan=False)
    opt.step()
    after = shards()
    log["stepped"] = any(not torch.equal(a, b) for a, b in zip(after, before))
    log["finite"] = all(bool(torch.isfinite(a).all()) for a in after)
    return log


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_fsdp_gradient_accumulation_with_a_nan_micro_batch_skips_the_step():
    for r in run_ranks(_fsdp_accumulation, 2):
        assert r["last verdict"] is False and r["grad nan"]  # what the last verdict alone missed
        assert r["unchanged"] and r["momentum"] == 0  # parameters and optimizer state untouched
        assert r["stepped"] and r["finite"]
