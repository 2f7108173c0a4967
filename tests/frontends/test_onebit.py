"""1-bit Adam and 0/1 Adam (gradzip.onebit): AdamW on the average in warm-up; after it the
momentum's mass kept by both error-feedback memories, ~1/32 of the link bytes; bit-exact resume
and clear refusals; 0/1 Adam's schedule; non-finite steps skipped on every rank; argument
checks. The multi-rank checks share one 2-rank and one 4-rank call."""

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradzip as gz
from gradzip.codecs.cast import Identity
from gradzip.codecs.quant import SignSGD
from gradzip.onebit import OneBitAdam, ZeroOneAdam
from gradzip.protocols.twophase import TwoPhase, owner_key, piece_bounds
from tests.support import batch, make_model, params, resume_matches_unbroken, run_ranks, train_steps

# 0/1 Adam with var_freeze_step=10, kappa=2, alpha=3, H=4, worked out by hand from DeepSpeed's
# zoadam.py: variance updates at intervals 1, 1 | 2, 2 | 4, 4 ..., then syncs every 1 (3 steps),
# 2 (3 steps), then 4 steps.
ZO = {"var_freeze_step": 10, "var_update_scaler": 2, "local_step_scaler": 3, "local_step_clipper": 4}
ZO_KINDS = ["full", "full", "onebit", "full", "onebit", "full", "onebit", "full", "onebit", "onebit"]
ZO_KINDS += ["sync"] * 4 + ["local", "sync"] + (["local"] * 3 + ["sync"]) * 2  # steps 11 to 24


def _mlp(seed=0):
    """20 -> 16 -> 5 (421 parameters), for :func:`tests.support.batch`'s classification batches."""
    return make_model(seed, widths=(16,))


def _moments(opt, model, keys=("exp_avg", "exp_avg_sq")):
    return [opt.state[p][k].clone() for p in model.parameters() for k in keys]


def _average_grads(model, world):
    for p in model.parameters():
        p.grad.div_(world)
        dist.all_reduce(p.grad)


# -- a tiny regression (8 -> 16 -> 1) ----------------------------------------------------------
def _reg_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _reg_batch(step, rank, n=32):
    g = torch.Generator().manual_seed(10_000 + 1000 * step + rank)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.3 * torch.sin(2 * x[:, :1])


def _reg_loss(model):
    x, y = _reg_batch(-5, 99, 512)
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def _fit(model, opt, steps, rank, average=None):
    for s in range(steps):
        x, y = _reg_batch(s, rank)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        if average is not None:
            _average_grads(model, average)
        opt.step()


# -- 2 ranks -------------------------------------------------------------------------------------
def _warmup_vs_adamw(rank, world):
    hyper = {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.1}
    model = _mlp()
    opt = OneBitAdam(model.named_parameters(), **hyper, freeze_step=100, bucket_mb=0.0002)
    train_steps(model, opt, 6, rank)
    ref = _mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper, foreach=False)
    for s in range(6):
        x, y = batch(s, rank)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        _average_grads(ref, world)
        ref_opt.step()
    return {
        "onebit": params(model) + _moments(opt, model),
        "adamw": params(ref) + _moments(ref_opt, ref),
        "repr": repr(opt),
        "stats": opt.stats(),
    }


def _exact_vs_formula(rank, world, steps=7, freeze=3):
    """With Identity() for the 1-bit average, 1-bit Adam is Adam whose v freezes after ``freeze``
    steps: the update of the module docstring written out (DeepSpeed's form, ``p - lr (u + wd
    p)``), with and without bias correction, against the optimizer."""
    lr, (b1, b2), eps, wd = 0.01, (0.9, 0.99), 1e-8, 0.1
    out = {}
    for bias_correction in (True, False):
        model = _mlp()
        opt = OneBitAdam(
            model.parameters(),
            lr,
            (b1, b2),
            eps,
            wd,
            freeze_step=freeze,
            compression=Identity(),
            bias_correction=bias_correction,
        )
        train_steps(model, opt, steps, rank)
        ref = _mlp()
        ms = [torch.zeros_like(p) for p in ref.parameters()]
        vs = [torch.zeros_like(p) for p in ref.parameters()]
        for t in range(1, steps + 1):
            x, y = batch(t - 1, rank)
            ref.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            _average_grads(ref, world)
            c1 = 1 - b1**t if bias_correction else 1.0
            c2 = 1 - b2 ** min(t, freeze) if bias_correction else 1.0
            with torch.no_grad():
                for p, m, v in zip(ref.parameters(), ms, vs):
                    m.mul_(b1).add_(p.grad, alpha=1 - b1)
                    if t <= freeze:
                        v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    p.sub_(lr * (m / c1 / ((v / c2).sqrt() + eps) + wd * p))
        out[bias_correction] = (params(model), params(ref))
    return out


def _build_onebit(seed, **kw):
    model = _mlp(seed)
    kw = {"lr": 0.01, "weight_decay": 0.01, "freeze_step": 3, "bucket_mb": 0.0002, **kw}
    return model, OneBitAdam(model.named_parameters(), **kw)


def _build_zero_one(seed, **kw):
    model = _mlp(seed)
    kw = {"lr": 0.01, "weight_decay": 0.01, "bucket_mb": 0.0002, **ZO, "var_freeze_step": 4, **kw}
    return model, ZeroOneAdam(model.named_parameters(), **kw)


def _resume(rank, build, k, total, keys):
    def load(run, ckpt):
        run[0].load_state_dict(ckpt["model"])
        run[1].load_state_dict(ckpt["opt"])
        assert run[1].step_count == k

    return resume_matches_unbroken(
        build,
        lambda run, first, steps: train_steps(run[0], run[1], steps, rank, first),
        lambda run: {"model": run[0].state_dict(), "opt": run[1].state_dict()},
        load,
        k,
        total,
        snapshot=lambda run: params(run[0]) + _moments(run[1], run[0], keys),
    )


def _refusals(ckpt):
    """What loading a state that does not fit says; and that a refused load changed nothing."""
    tries = {
        "version": (lambda: _build_onebit(0), {**ckpt, "onebit": {**ckpt["onebit"], "version": 0}}),
        "world": (lambda: _build_onebit(0), {**ckpt, "gradzip": {**ckpt["gradzip"], "world_size": 4}}),
        "method": (lambda: _build_onebit(0, compression=TwoPhase(SignSGD(block=64))), ckpt),
        "algorithm": (lambda: _build_zero_one(0), ckpt),
        "freeze_step": (lambda: _build_onebit(0, freeze_step=4), ckpt),
        "not_mine": (lambda: _build_onebit(0), ckpt["gradzip"]),
    }
    out = {}
    for key, (build, sd) in tries.items():
        model, opt = build()
        before = params(model)
        try:
            opt.load_state_dict(sd)
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
        unchanged = opt.step_count == 0 and len(opt.state) == 0 and opt.engine.step == 0
        out[key + ".unchanged"] = unchanged and all(torch.equal(a, b) for a, b in zip(before, params(model)))
    return out


def _zero_one_run(rank, world):
    """24 steps of 0/1 Adam on the regression: what each step sent (by which engine counted a
    step), the parameters after a local and after a sync step, the loss, the stats."""
    model = _reg_model()
    opt = ZeroOneAdam(model.parameters(), lr=0.05, **ZO)
    engines = opt._engines()  # {"full": plain allreduce, "compressed": 1-bit}
    logged = []
    opt.log_every(8, lambda step, s: logged.append((step, s["steps"], s["syncs"])))
    kinds, at, first = [], {}, _reg_loss(model)
    for s in range(24):
        before = {k: e.step for k, e in engines.items()}
        _fit_one(model, opt, s, rank)
        moved = [k for k, e in engines.items() if e.step != before[k]]
        t = s + 1
        kinds.append(
            "local"
            if not moved
            else moved[0]
            if moved == ["full"]
            else "onebit"
            if t <= ZO["var_freeze_step"]
            else "sync"
        )
        if t in (23, 24):
            at[t] = params(model)
    return {"kinds": kinds, "at": at, "loss": (first, _reg_loss(model)), "logged": logged, "stats": opt.stats()}


def _fit_one(model, opt, s, rank):
    x, y = _reg_batch(s, rank)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    opt.step()


def _convergence(rank, world, steps=80):
    out = {}
    model = _reg_model()
    out["initial"] = _reg_loss(model)
    _fit(model, torch.optim.Adam(model.parameters(), lr=0.02, foreach=False), steps, rank, average=world)
    out["adam"] = _reg_loss(model)
    model = _reg_model()
    _fit(model, OneBitAdam(model.parameters(), lr=0.02, freeze_step=15), steps, rank)
    out["onebit"] = _reg_loss(model)
    model = _reg_model()
    zo = {"var_freeze_step": 15, "var_update_scaler": 4, "local_step_scaler": 10, "local_step_clipper": 4}
    _fit(model, ZeroOneAdam(model.parameters(), lr=0.02, **zo), steps, rank)  # step 80 syncs
    out["zero_one"] = _reg_loss(model)
    return out


def _nonfinite(rank):
    """A NaN on one rank (in warm-up on rank 0, after it on rank 1) skips the step on both."""
    model, opt = _build_onebit(0, freeze_step=2)
    mem = opt.engine.memory

    def snapshot():
        return params(model) + _moments(opt, model) + [r.clone() for _, r in sorted(mem.residuals.items())]

    def poisoned(s, bad_rank):
        x, y = batch(s, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if rank == bad_rank:
            next(model.parameters()).grad[0, 0] = float("nan")
        before = snapshot()
        opt.step()
        after = snapshot()
        return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))

    out = {}
    train_steps(model, opt, 1, rank)
    out["warm_kept"] = poisoned(1, 0)
    out["warm_count"] = (opt.step_count, opt.skipped_steps)
    train_steps(model, opt, 3, rank, first=2)  # t = 2 (full precision), 3 and 4 (1-bit)
    out["residuals"] = len(mem.residuals)
    out["onebit_kept"] = poisoned(5, 1)
    out["onebit_count"] = (opt.step_count, opt.skipped_steps)
    train_steps(model, opt, 1, rank, first=6)
    out["after"] = (opt.step_count, all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    return out


def _sparse():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = OneBitAdam(emb.parameters(), freeze_step=1)
    emb(torch.tensor([1, 2])).sum().backward()
    try:
        opt.step()  # refused on every rank before any collective
    except ValueError as e:
        return str(e)
    return None


def _two_ranks(rank, world, root):
    out = {"warmup": _warmup_vs_adamw(rank, world), "formula": _exact_vs_formula(rank, world)}
    out["resume_onebit"] = _resume(rank, _build_onebit, 5, 10, ("exp_avg", "exp_avg_sq"))
    out["refusals"] = _refusals(out["resume_onebit"]["ckpt"]["opt"])
    out["resume_zero_one"] = _resume(rank, _build_zero_one, 11, 14, ("exp_avg", "exp_avg_sq", "anchor"))
    out["zero_one"] = _zero_one_run(rank, world)
    out["convergence"] = _convergence(rank, world)
    out["nonfinite"] = _nonfinite(rank)
    out["sparse"] = _sparse()
    out["bench"] = _bench(rank, world)
    return out


def _bench(rank, world):
    """``gradzip bench``'s training of a spec (``bench.train_one``): the optimizer built from the
    parameters with the bench's lr, betas and weight decay, no DDP."""
    from gradzip import bench

    data = bench.load_dataset("digits", 0)
    cfg = bench.BenchConfig(dataset="digits", workers=world, epochs=1, optimizer="adamw", lr=3e-3)
    res = bench.train_one(rank, world, bench.Method("o", gz.parse("OneBitAdam(freeze_step=5)")), cfg, data)
    return {k: res[k] for k in ("accuracy", "steps", "ratio", "stats_ratio", "params")}


@pytest.fixture(scope="module")
def two():
    with tempfile.TemporaryDirectory() as root:
        yield run_ranks(_two_ranks, 2, root, timeout=300)


@pytest.mark.slow
def test_warmup_is_adamw_on_the_average_gradient_bit_for_bit(two):
    for r in two:
        w = r["warmup"]
        assert len(w["onebit"]) == len(w["adamw"]) == 12  # 4 parameters, 2 moments each
        for a, b in zip(w["onebit"], w["adamw"]):
            assert torch.equal(a, b)
        assert w["stats"]["syncs"] == w["stats"]["steps"] == 6
    for a, b in zip(two[0]["warmup"]["onebit"], two[1]["warmup"]["onebit"]):
        assert torch.equal(a, b)
    assert two[0]["warmup"]["repr"] == (
        "OneBitAdam(lr=0.01, betas=(0.8, 0.99), eps=1e-08, weight_decay=0.1, freeze_step=100, "
        "compression=TwoPhase(SignSGD()))"
    )


@pytest.mark.slow
def test_after_the_freeze_the_update_is_adam_with_v_frozen(two):
    for r in two:
        f = r["formula"]
        for bias_correction, (got, want) in f.items():
            for a, b in zip(got, want):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), bias_correction
            moved = max(float((a - b).abs().max()) for a, b in zip(got, params(_mlp())))
            assert moved > 1e-2  # 7 steps of lr 0.01: the check is not of a model that stood still
        assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(f[True][0], f[False][0]))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["resume_onebit", "resume_zero_one"])
def test_resume_is_bit_exact(two, which):
    for r in two:
        res = r[which]
        assert len(res["unbroken"]) == len(res["resumed"])
        for a, b in zip(res["unbroken"], res["resumed"]):
            assert torch.equal(a, b)
        ckpt = res["ckpt"]["opt"]
        residuals = ckpt["gradzip"]["residuals"]
        assert any(k.endswith(":owner") for k in residuals) and any("#" not in k for k in residuals)
        assert any(bool(v.abs().sum() > 0) for v in residuals.values())
    # 0/1 Adam saved between syncs: the ranks' parameters differ, and the resumed run still matches
    zo = [r["resume_zero_one"]["ckpt"]["model"] for r in two]
    assert any(not torch.equal(zo[0][k], zo[1][k]) for k in zo[0])


@pytest.mark.slow
def test_a_state_that_does_not_fit_is_refused_before_anything_changes(two):
    ref = two[0]["refusals"]
    expect = {
        "version": "state version 0 is not supported",
        "world": "of 4 ranks",
        "method": "holds the state of TwoPhase(SignSGD())",
        "algorithm": "saved by OneBitAdam, and this is ZeroOneAdam",
        "freeze_step": "freeze_step differs from the checkpoint's: saved 3, now 4",
        "not_mine": "it was not saved by OneBitAdam.state_dict()",
    }
    for key, words in expect.items():
        assert ref[key] is not None and words in ref[key], (key, ref[key])
        assert ref[key + ".unchanged"], key


@pytest.mark.slow
def test_zero_one_adam_communicates_on_its_schedule_on_every_rank(two):
    runs = [r["zero_one"] for r in two]
    for run in runs:
        assert run["kinds"] == ZO_KINDS
        first, last = run["loss"]
        assert last < 0.3 * first, run["loss"]
        assert run["stats"]["steps"] == 24 and run["stats"]["syncs"] == 24 - ZO_KINDS.count("local")
        assert run["stats"]["ratio"] > 1
        assert run["logged"] == [(8, 8, 8), (16, 8, 7), (24, 8, 2)]
    # after a local step the ranks differ; a sync makes them equal, bit for bit
    assert any(not torch.equal(a, b) for a, b in zip(runs[0]["at"][23], runs[1]["at"][23]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["at"][24], runs[1]["at"][24]))


@pytest.mark.slow
def test_final_loss_is_close_to_adams(two):
    c = two[0]["convergence"]
    assert c["adam"] < 0.05 * c["initial"], c
    assert c["onebit"] < 1.5 * c["adam"] + 0.01 * c["initial"], c
    assert c["zero_one"] < 1.5 * c["adam"] + 0.02 * c["initial"], c


@pytest.mark.slow
def test_a_nonfinite_gradient_skips_the_step_on_every_rank(two):
    for r in two:
        n = r["nonfinite"]
        assert n["warm_kept"] and n["onebit_kept"]
        assert n["warm_count"] == (1, 1) and n["onebit_count"] == (4, 2)
        assert n["residuals"] > 0  # the 1-bit step had residuals to roll back
        assert n["after"] == (5, True)


@pytest.mark.slow
def test_the_bench_trains_it_from_a_spec(two):
    a, b = two[0]["bench"], two[1]["bench"]
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))  # 1-bit Adam: one model
    steps = a["steps"]
    # 5 full-precision steps, then 1/32 of a float32 ring allreduce (and SignSGD's scales)
    assert 0.8 * steps / (5 + (steps - 5) / 32) < a["ratio"] <= steps / (5 + (steps - 5) / 32), a
    assert a["accuracy"] > 0.5, a
    with pytest.raises(ValueError, match="is an Adam"):
        from gradzip import bench

        bench.check_methods(bench.parse_methods("OneBitAdam(freeze_step=5)"), bench.BenchConfig(optimizer="sgd"))


@pytest.mark.slow
def test_sparse_gradients_are_refused(two):
    for r in two:
        assert r["sparse"] is not None and "does not support sparse gradients" in r["sparse"]


# -- 4 ranks -------------------------------------------------------------------------------------
def _mass(rank, world, steps=20, freeze=2):
    """1-bit Adam after warm-up: what each compressed call was handed and returned, and both
    error-feedback memories (the worker residual r, this rank's owner residual e) around it."""
    model = _mlp()
    named = dict(model.named_parameters())
    opt = OneBitAdam(model.named_parameters(), lr=0.01, weight_decay=0.01, freeze_step=freeze, bucket_mb=0.0002)
    mem = opt.engine.memory
    calls = []
    real = opt.engine.reduce

    def spy(names, tensors, *a, **kw):
        handed = [t.detach().clone() for t in tensors]
        fut = real(names, tensors, *a, **kw)
        calls.append((list(names), handed, fut))
        return fut

    opt.engine.reduce = spy

    def worker():
        return {
            n: mem.residual(n).double().reshape(-1) if mem.residual(n) is not None else torch.zeros(p.numel()).double()
            for n, p in named.items()
        }

    def owner():
        out = {}
        for n, p in named.items():
            full = torch.zeros(p.numel(), dtype=torch.float64)
            b = piece_bounds(p.numel(), world)
            e = mem.residual(owner_key(n, rank, world))
            if e is not None:
                full[b[rank] : b[rank + 1]] = e.double().reshape(-1)
            out[n] = full
        return out

    train_steps(model, opt, freeze, rank)
    warm_calls = len(calls)
    v_frozen = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in named.items()}
    rows = []
    for s in range(freeze, steps):
        r0, e0 = worker(), owner()
        calls.clear()
        train_steps(model, opt, 1, rank, first=s)
        handed, applied, m_is_applied = {}, {}, True
        for names, tensors, fut in calls:
            flat, pos = fut.wait(), 0
            for n, t in zip(names, tensors):
                got = flat[pos : pos + t.numel()]
                pos += t.numel()
                handed[n], applied[n] = t.double().reshape(-1), got.double()
                m_is_applied &= torch.equal(opt.state[named[n]]["exp_avg"].reshape(-1), got)
        rows.append(
            {
                "in": {n: handed[n] + r0[n] for n in named},
                "owner_in": e0,
                "left": worker(),
                "owner_left": owner(),
                "applied": applied,
                "m_is_applied": m_is_applied,
                "calls": len(calls),
            }
        )
    v_kept = all(torch.equal(opt.state[p]["exp_avg_sq"], v_frozen[n]) for n, p in named.items())
    return {"rows": rows, "warm_calls": warm_calls, "v_kept": v_kept, "params": params(model)}


def _bytes(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=3)

    def step(s):
        x = torch.randn(8, 128, generator=torch.Generator().manual_seed(100 * s + rank))
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()

    step(0)  # the parameter and configuration checks
    opt.stats(reset=True)
    step(1)
    step(2)
    warm = opt.stats(reset=True)
    step(3)  # the compressed engine's first call: its configuration check
    opt.stats(reset=True)
    for s in range(4, 8):
        step(s)
    return {"warm": warm, "compressed": opt.stats(reset=True), "total": opt.stats()}


def _four_ranks(rank, world):
    return {"mass": _mass(rank, world), "bytes": _bytes(rank, world)}


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4, timeout=300)


@pytest.mark.slow
def test_the_1bit_momentum_keeps_its_mass_in_both_error_feedback_memories(four):
    """N * applied + sum_r r' + N * sum_j e'_j == sum_r (m_r + r) + N * sum_j e_j at every step,
    the applied average is the new momentum on every rank, and v stays frozen."""
    W = len(four)
    runs = [r["mass"] for r in four]
    assert all(run["warm_calls"] == 0 and run["v_kept"] for run in runs)  # warm-up went by the plain engine
    for s in range(len(runs[0]["rows"])):
        rows = [run["rows"][s] for run in runs]
        assert all(row["m_is_applied"] and row["calls"] == 3 for row in rows)  # 3 buckets a step
        for n in rows[0]["applied"]:
            for row in rows[1:]:
                assert torch.equal(row["applied"][n], rows[0]["applied"][n])
            lhs = (
                W * rows[0]["applied"][n] + sum(r["left"][n] for r in rows) + W * sum(r["owner_left"][n] for r in rows)
            )
            rhs = sum(r["in"][n] for r in rows) + W * sum(r["owner_in"][n] for r in rows)
            scale = max(1.0, float(rhs.abs().max()))
            assert float((lhs - rhs).abs().max()) <= 1e-5 * scale, (s, n)
    last = [run["rows"][-1] for run in runs]
    assert sum(float(r["left"][n].abs().sum()) for r in last for n in r["left"]) > 0
    assert sum(float(r["owner_left"][n].abs().sum()) for r in last for n in r["owner_left"]) > 0
    for a, b in zip(runs[0]["params"], runs[3]["params"]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_after_the_freeze_a_step_sends_about_1_32_of_the_warmup_bytes(four):
    for r in four:
        warm, comp = r["bytes"]["warm"], r["bytes"]["compressed"]
        assert warm["steps"] == warm["syncs"] == 2 and comp["steps"] == comp["syncs"] == 4
        assert abs(warm["ratio"] - 1.0) < 1e-12  # the warm-up is a plain ring allreduce
        per_warm, per_comp = warm["bytes_link"] / warm["steps"], comp["bytes_link"] / comp["steps"]
        assert per_warm / per_comp > 20, (per_warm, per_comp)
        assert comp["ratio"] > 20
        assert r["bytes"]["total"]["steps"] == 8


# -- no ranks ------------------------------------------------------------------------------------
def test_zero_one_schedule_is_deepspeeds():
    assert ZeroOneAdam.schedule(24, **ZO) == ZO_KINDS
    # H = 1: every step of the local stage syncs; kappa large: every warm step updates the variance
    kinds = ZeroOneAdam.schedule(12, var_freeze_step=5, var_update_scaler=100, local_step_clipper=1)
    assert kinds == ["full"] * 5 + ["sync"] * 7


def _p():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: OneBitAdam(_p(), freeze_step=-1), ValueError, r"freeze_step must be an integer in \[1, inf\)"),
        (lambda: OneBitAdam(_p(), freeze_step=0), ValueError, r"freeze_step must be an integer in \[1, inf\)"),
        (lambda: OneBitAdam(_p(), freeze_step=2.5), ValueError, "freeze_step must be an integer"),
        (lambda: OneBitAdam(_p()), TypeError, "freeze_step"),
        (lambda: OneBitAdam(_p(), betas=(1.0, 0.999), freeze_step=1), ValueError, r"betas\[0\] must be .* \[0, 1\)"),
        (lambda: OneBitAdam(_p(), betas=(0.9, -0.1), freeze_step=1), ValueError, r"betas\[1\] must be"),
        (lambda: OneBitAdam(_p(), betas=(0.9,), freeze_step=1), ValueError, "betas must be a pair"),
        (lambda: OneBitAdam(_p(), lr=-1e-3, freeze_step=1), ValueError, r"lr must be a finite number in \[0, inf\)"),
        (lambda: OneBitAdam(_p(), eps=0.0, freeze_step=1), ValueError, r"eps must be a finite number in \(0, inf\)"),
        (lambda: OneBitAdam(_p(), weight_decay=-0.1, freeze_step=1), ValueError, "weight_decay must be"),
        (lambda: OneBitAdam(_p(), freeze_step=1, bucket_mb=0), ValueError, "bucket_mb must be"),
        (lambda: OneBitAdam(_p(), freeze_step=1, on_nonfinite="ignore"), ValueError, "on_nonfinite must be one of"),
        (lambda: OneBitAdam(_p(), freeze_step=1, bias_correction=1), ValueError, "bias_correction must be True"),
        (lambda: OneBitAdam(_p(), freeze_step=1, compression=3), TypeError, "compression must be a gradzip codec"),
        (lambda: OneBitAdam([], freeze_step=1), ValueError, "empty parameter list"),
        (
            lambda: OneBitAdam([{"params": _p()}, {"params": _p(), "betas": (0.9, 1.5)}], freeze_step=1),
            ValueError,
            r"param group 1: betas\[1\] must be",
        ),
        (
            lambda: OneBitAdam(_p() + [torch.nn.Parameter(torch.zeros(2, device="meta"))], freeze_step=1),
            ValueError,
            "the parameters lie on 2 devices",
        ),
        (lambda: OneBitAdam(_p() * 2, freeze_step=1), ValueError, "more than once"),
        (lambda: ZeroOneAdam(_p(), var_freeze_step=0), ValueError, r"var_freeze_step must be an integer in \[1"),
        (lambda: ZeroOneAdam(_p(), var_freeze_step=5, var_update_scaler=0), ValueError, "var_update_scaler must be"),
        (lambda: ZeroOneAdam(_p(), var_freeze_step=5, local_step_scaler=0), ValueError, "local_step_scaler must be"),
        (lambda: ZeroOneAdam(_p(), var_freeze_step=5, local_step_clipper=0), ValueError, "local_step_clipper must"),
        (lambda: ZeroOneAdam.schedule(-1, var_freeze_step=1), ValueError, "steps must be an integer"),
    ],
)
def test_bad_arguments_are_refused_with_a_clear_message(build, error, match):
    with pytest.raises(error, match=match):
        build()
