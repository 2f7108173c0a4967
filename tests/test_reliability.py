"""Reliability promises (docs/reliability.md): bad gradients, config mismatch, rank loss,
accumulation, DDP modes, world-size change, half-precision sums."""
import io
import os
import queue as _queue
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip.bench import free_port, init_worker
from gradzip.checkpoint import reshard
from gradzip.codecs.base import TensorContext
from gradzip.engine import Engine
from gradzip.hooks import register_hook

from .mp_utils import run_ranks
from .refs import RefMemory
from .test_ddp import batch, make_model, params

pytestmark = pytest.mark.slow


def residuals(state):
    return {k: v.clone() for k, v in state.engine.memory.residuals.items()}


# -- 1. NaN/Inf ------------------------------------------------------------------------
def _nonfinite(rank, world, policy, bad_step):
    """GradScaler semantics: after backward, skip optimizer.step() if any grad is non-finite."""
    torch.manual_seed(0)
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = register_hook(ddp, gz.Threshold(tau=1e-3, policy="adaptive"), on_nonfinite=policy)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    log = {"skipped": [], "error": None}
    for s in range(6):
        if bad_step is None and s == 3:
            continue  # the reference run: the poisoned step never happens
        x, y = batch(s, rank)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        if s == bad_step and rank == 1:
            loss = loss * float("inf")
        before = (residuals(state), {k: dict(v) for k, v in state.engine.tensor_state.items()})
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - the "raise" policy
            log["error"] = f"{type(exc).__name__}: {exc}"
            return log
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        if finite:
            opt.step()
        else:
            log["skipped"].append(s)
            after = residuals(state)
            log["residuals_untouched"] = set(after) == set(before[0]) and all(
                torch.equal(after[k], before[0][k]) for k in after
            )
            log["state_untouched"] = state.engine.tensor_state == before[1]
    log["params"] = params(model)
    return log


def test_nonfinite_gradient_is_skipped_everywhere_and_never_poisons_the_residual():
    bad = run_ranks(_nonfinite, 2, "skip", 3)
    ref = run_ranks(_nonfinite, 2, "skip", None)
    for r in range(2):
        assert bad[r]["skipped"] == [3]  # both ranks see a non-finite average, not only rank 1
        assert bad[r]["residuals_untouched"] and bad[r]["state_untouched"]
        # Skipping the step is the same as never having taken it.
        for a, b in zip(bad[r]["params"], ref[r]["params"]):
            assert torch.equal(a, b)


def test_nonfinite_gradient_raises_on_every_rank_with_raise_policy():
    res = run_ranks(_nonfinite, 2, "raise", 2)
    assert "FloatingPointError" in res[0]["error"] and "on another rank" in res[0]["error"]
    assert "FloatingPointError" in res[1]["error"] and "on rank 1" in res[1]["error"]


def _plain_call(rank, world, policy):
    """Identity sums the gradient as it is: no flag collective, and a NaN still counts."""
    eng = Engine(gz.Identity(), on_nonfinite=policy)
    log = {}

    def step(t):
        fut = eng.reduce(["w"], [t])
        eng.flush()
        eng.end_step()
        return fut.wait()

    step(torch.ones(5))  # the first call also checks the configuration
    before = eng.stats()["collectives"]
    log["out"] = step(torch.full((5,), float(rank + 1)))
    log["collectives"] = eng.stats()["collectives"] - before
    bad = torch.ones(5)
    if rank == 1:
        bad[2] = float("nan")
    try:
        log["bad_out"] = step(bad)
    except FloatingPointError as exc:
        log["error"] = str(exc)
    return log


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_plain_calls_send_no_flag_and_still_catch_nonfinite(policy):
    res = run_ranks(_plain_call, 2, policy)
    for r in range(2):
        assert res[r]["collectives"] == 1  # the gradients' allreduce alone
        assert torch.equal(res[r]["out"], torch.full((5,), 1.5))
        if policy == "skip":
            assert torch.isnan(res[r]["bad_out"]).all()  # all NaN on both ranks, not only element 2
    if policy == "raise":
        assert "on another rank" in res[0]["error"]
        assert "on rank 1" in res[1]["error"] and "'w'" in res[1]["error"]


# -- 2. Config mismatch ----------------------------------------------------------------
def _mismatch(rank, world):
    errors = {}
    # Compressor config differs (DDP hook).
    ddp = DDP(make_model(), bucket_cap_mb=0.005)
    register_hook(ddp, gz.Threshold(tau=1e-3 * (rank + 1)))
    x, y = batch(0, rank)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except ValueError as exc:
        errors["tau"] = str(exc)
    # Parameter layout differs (DDP itself checks shapes at construction, so use the engine).
    layout = [("w", [3, 4 + rank], "float32")]
    eng = Engine(gz.TopK(0.5), layout=layout)
    try:
        eng.reduce(["w"], [torch.randn(3, 4)])
        eng.flush()
    except ValueError as exc:
        errors["layout"] = str(exc)
    # Another compressor altogether.
    eng = Engine(gz.TopK(0.5) if rank else gz.RandomK(0.5))
    try:
        eng.reduce(["w"], [torch.randn(8)])
        eng.flush()
    except ValueError as exc:
        errors["class"] = str(exc)
    return errors


def test_config_mismatch_raises_value_error_naming_the_field_on_every_rank():
    for errs in run_ranks(_mismatch, 2):
        assert "'method.tau'" in errs["tau"] and "rank 0: 0.001" in errs["tau"] and "rank 1: 0.002" in errs["tau"]
        assert "'layout'" in errs["layout"]
        assert "'method.name'" in errs["class"]


# -- 3. Rank loss ----------------------------------------------------------------------
def _doomed(rank, world, port, q):
    init_worker(rank, world, port, threads=1, timeout_s=10.0)
    ddp = DDP(make_model(), bucket_cap_mb=0.005)
    register_hook(ddp, gz.Threshold(tau=1e-3))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(100):
        if rank == 2 and s == 3:
            os._exit(1)  # the machine dies: no goodbye, no cleanup
        x, y = batch(s, rank)
        opt.zero_grad()
        t0 = time.monotonic()
        try:
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        except Exception as exc:  # noqa: BLE001
            q.put((rank, s, type(exc).__name__, str(exc)[:200], time.monotonic() - t0))
            return
    q.put((rank, None, None, None, None))


def test_survivors_raise_when_a_rank_dies():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_doomed, args=(r, 3, port, q)) for r in range(3)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            rank, step, kind, msg, waited = q.get(timeout=90)
            got[rank] = (step, kind, msg, waited)
    except _queue.Empty:
        pytest.fail(f"survivors hung: reports {got}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert set(got) == {0, 1}
    for rank, (step, kind, msg, waited) in got.items():
        assert step == 3 and kind is not None, got
        assert waited < 10.0 + 20.0  # within the process group's timeout (plus slack)
    assert all(not p.is_alive() for p in procs)


# -- 4. Gradient accumulation under no_sync --------------------------------------------
def acc_compressor():
    return gz.Threshold(tau=2e-3, policy="adaptive", band=(0.02, 0.1), decay=0.7)


def _accumulate(rank, world, steps, micro):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = register_hook(ddp, acc_compressor())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            x, y = batch(100 * s + m, rank)
            if m < micro - 1:
                with ddp.no_sync():
                    F.cross_entropy(ddp(x), y).backward()
            else:
                F.cross_entropy(ddp(x), y).backward()
        opt.step()
    # Identity + no_sync against one 3x larger batch.
    big, acc = make_model(), make_model()
    out = {"params": params(model), "steps": state.stats()["steps"]}
    for mode, m_ in (("big", big), ("acc", acc)):
        d = DDP(m_, bucket_cap_mb=0.005)
        register_hook(d, gz.Identity())
        o = torch.optim.SGD(d.parameters(), lr=0.1)
        for s in range(3):
            o.zero_grad(set_to_none=True)
            xs, ys = zip(*(batch(100 * s + m, rank) for m in range(micro)))
            if mode == "big":
                F.cross_entropy(d(torch.cat(xs)), torch.cat(ys), reduction="sum").backward()
            else:
                for m in range(micro):
                    ctx = d.no_sync() if m < micro - 1 else torch.enable_grad()
                    with ctx:
                        F.cross_entropy(d(xs[m]), ys[m], reduction="sum").backward()
            o.step()
        out[mode] = params(m_)
    return out


def reference_accumulated(steps, world, micro):
    ref = make_model()
    names = [n for n, _ in ref.named_parameters()]
    comp = acc_compressor()
    mems = [RefMemory() for _ in range(world)]
    stores = [{n: {} for n in names} for _ in range(world)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mass = []
    for s in range(steps):
        grads = []
        for r in range(world):
            ref.zero_grad(set_to_none=True)
            for m in range(micro):
                x, y = batch(100 * s + m, r)
                F.cross_entropy(ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, (n, p) in enumerate(ref.named_parameters()):
            acc = torch.zeros(p.numel())
            for r in range(world):
                c = mems[r].compensate(n, grads[r][i])
                pay = comp.compress(c, TensorContext(name=n, step=s, dtype=p.dtype, store=stores[r][n]))
                sent = comp.decompress(pay)
                mems[r].update(n, c, sent)
                # Mass: new residual + sent == old residual + accumulated gradient (as computed).
                mass.append(torch.equal(mems[r].residual(n) + sent, c))
                comp.accumulate(pay, acc)
            p.grad = acc.div_(world).view_as(p)
        opt.step()
    return params(ref), all(mass)


def test_no_sync_accumulation_applies_error_feedback_once_per_step():
    steps, micro = 4, 3
    res = run_ranks(_accumulate, 2, steps, micro)
    expected, mass_ok = reference_accumulated(steps, 2, micro)
    assert mass_ok
    for r in res:
        assert r["steps"] == steps  # one compressed exchange per optimizer step, not per micro-batch
        for a, b in zip(r["params"], expected):
            assert torch.equal(a, b)
        for a, b in zip(r["acc"], r["big"]):  # same math, different summation order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- 5. DDP modes ----------------------------------------------------------------------
class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(20, 32)
        self.b = torch.nn.Linear(32, 5)
        self.unused = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _modes(rank, world, mode):
    kw = {}
    model = make_model()
    if mode == "static_graph":
        kw["static_graph"] = True
    elif mode == "gradient_as_bucket_view":
        kw["gradient_as_bucket_view"] = True
    elif mode == "find_unused_parameters":
        kw["find_unused_parameters"] = True
        model = Branchy()
    ddp = DDP(model, bucket_cap_mb=0.005, **kw)
    state = register_hook(ddp, gz.Threshold(tau=1e-3, policy="adaptive"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    nbatches = 6 if mode != "join" else 4 + 2 * rank  # uneven inputs
    if mode == "join":
        with ddp.join():
            for s in range(nbatches):
                x, y = batch(s, rank)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
    else:
        for s in range(nbatches):
            x, y = batch(s, rank)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    return {"params": params(model), "stats": state.stats(), "residuals": sorted(state.engine.memory.residuals)}


@pytest.mark.parametrize("mode", ["static_graph", "find_unused_parameters", "gradient_as_bucket_view", "join"])
def test_ddp_modes_with_error_feedback(mode):
    from .test_ddp import reference_run

    res = run_ranks(_modes, 2, mode, timeout=120)
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)  # replicas agree
    if mode in ("static_graph", "gradient_as_bucket_view"):
        comp = gz.Threshold(tau=1e-3, policy="adaptive")
        expected, _ = reference_run(6, 2, comp)
        # reference_run uses lr=0.1 SGD on make_model(): the same training.
        for a, b in zip(res[0]["params"], expected):
            assert torch.equal(a, b)
    if mode == "join":
        # The rank with more batches kept stepping; the joined rank shadowed its collectives.
        assert res[1]["stats"]["steps"] == res[0]["stats"]["steps"] == 6
    if mode == "find_unused_parameters":
        assert res[0]["stats"]["steps"] == 6


# -- 6. Checkpoint across a world-size change ------------------------------------------
def _save_states(rank, world):
    eng = Engine(gz.Threshold(tau=0.5, policy="adaptive"))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        fut = eng.reduce(["a", "b"], [torch.randn(50, generator=g), torch.randn(3, 4, generator=g)])
        eng.flush()
        eng.end_step()
        fut.wait()
    buf = io.BytesIO()
    torch.save(eng.state_dict(), buf)
    return buf.getvalue()


def _load_states(rank, world, blobs):
    eng = Engine(gz.Threshold(tau=0.5, policy="adaptive"))
    eng.load_state_dict(torch.load(io.BytesIO(blobs[rank]), weights_only=True))
    before = {k: v.clone() for k, v in eng.memory.residuals.items()}
    fut = eng.reduce(["a", "b"], [torch.zeros(50), torch.zeros(3, 4)])
    eng.flush()
    eng.end_step()
    return {"before": before, "avg": fut.wait(), "step": eng.step}


def test_codec_state_moves_from_four_ranks_to_two():
    blobs = run_ranks(_save_states, 4)
    states = [torch.load(io.BytesIO(b), weights_only=True) for b in blobs]
    new = reshard(states, 2)

    def owner(name):  # on 4 ranks Threshold travels in two phases: rank j owns piece j
        return torch.cat([states[j]["residuals"][f"{name}#{j}/4:owner"].double() for j in range(4)])

    for name in ("a", "b"):
        senders = sum(s["residuals"][name].double() for s in states)
        old_sum = (senders + 4 * owner(name).view(senders.shape)).float()  # owners hold average units
        new_sum = sum(s["residuals"][name].double() for s in new)
        assert torch.equal(new_sum.float(), old_sum)  # total mass kept (exactly: 2 is a power of two)
        assert torch.equal(new[0]["residuals"][name], new[1]["residuals"][name])  # spread evenly
        assert not any("#" in k for s in new for k in s["residuals"])  # owners folded in
    pend = reshard(states, 2, preserve="update")
    torch.testing.assert_close(
        sum(s["residuals"]["a"].double() for s in pend) / 2,
        sum(s["residuals"]["a"].double() for s in states) / 4 + owner("a"),
    )
    new_blobs = []
    for s in new:
        buf = io.BytesIO()
        torch.save(s, buf)
        new_blobs.append(buf.getvalue())
    res = run_ranks(_load_states, 2, new_blobs)
    assert res[0]["step"] == 4
    assert torch.equal(res[0]["before"]["a"], new[0]["residuals"]["a"])
    assert torch.equal(res[0]["avg"], res[1]["avg"])


def test_reshard_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size"):
        reshard([{"residuals": {}}], 0)
    with pytest.raises(ValueError, match="preserve"):
        reshard([{"residuals": {}}], 2, preserve="mean")


# -- 7. Half-precision sums ------------------------------------------------------------
HALF_COMPRESSORS = [gz.Identity(), gz.FP16(), gz.BF16(), gz.Threshold(tau=1.0), gz.TopK(0.5), gz.RandomK(0.5)]


def _near_max(rank, world, dtype):
    out = []
    big = torch.finfo(torch.float16).max  # near the float16 maximum, for both half dtypes
    for comp in HALF_COMPRESSORS:
        eng = Engine(comp)
        g = torch.Generator().manual_seed(7)  # the same values on every rank: worst case for a sum
        x = (torch.rand(64, generator=g, dtype=torch.float64) * 0.1 + 0.9) * big
        x[::2] *= -1
        fut = eng.reduce(["w"], [x.to(dtype)])
        eng.flush()
        eng.end_step()
        out.append((repr(comp), x.to(dtype), fut.wait()))
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_gradients_near_max_never_overflow(dtype):
    for name, x, avg in run_ranks(_near_max, 2, dtype)[0]:
        assert avg.dtype == dtype
        assert bool(torch.isfinite(avg).all()), name
        sent = avg != 0
        native = "FP16" if dtype == torch.float16 else "BF16"
        if "Identity" in name or native in name:
            assert bool(sent.all()), name
        # Every rank sent the same values, so the average is what one rank sent.
        if "Identity" in name:
            assert torch.equal(avg, x)
