"""Adaptive: per-tensor settings chosen under the reference's error (L-GreCo) on gloo ranks.

The solvers against brute force; the statistics against their definitions; on 4 ranks with
different data per rank, every rank chooses alike; mass is kept across a change of setting;
a resume across a change is bit for bit; states reshard; many buckets do not hang; every front
end that takes a method runs it; the plan prices it at its reference."""

import io
import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip.checkpoint import reshard
from gradzip.codecs.base import TensorContext
from gradzip.engine import Engine
from gradzip.hooks import register_hook
from gradzip.protocols.adaptive import (
    AT,
    BYTES,
    ERR,
    SINCE,
    VALUE,
    default_menu,
    solve,
    solve_dp,
    solve_exact,
)
from gradzip.protocols.twophase import owner_key, piece_bounds
from gradzip.wire import frame_nbytes
from tests.support import (
    make_model,
    many_buckets_model,
    params,
    resume_matches_unbroken,
    run_ranks,
    train_many_buckets,
    train_steps,
)

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOPK = "Adaptive(TopK(0.05), menu=[0.01, 0.02, 0.1, 0.3, 1.0], period=2)"
POWER = "Adaptive(PowerSGD(rank=2), menu=[1, 4], period=2)"


# -- configuration ------------------------------------------------------------------------------
def test_grammar_settings_and_refusals():
    a = gz.parse("Adaptive(TopK(0.01, values='fp16'), menu=[0.003, 0.03], reference=0.003, period=50)")
    assert a == gz.parse(repr(a)) and repr(a).startswith("Adaptive(TopK(ratio=0.01, values='fp16'), menu=")
    assert a.values == [0.003, 0.03] and a.reference_value == 0.003 and a.initial() == 0.003
    assert repr(a.setting(0.03)) == "TopK(ratio=0.03, values='fp16')"
    assert a.codec == gz.TopK(0.01, values="fp16") and a.biased and a.config()["method"]["name"] == "TopK"
    b = gz.Adaptive(gz.PowerSGD(rank=2, factors="bf16"), accordion=8)
    assert b.values == [1, 2, 4, 8] and b.initial() == 8 and b.codec is None
    assert repr(b.setting(4)) == "PowerSGD(rank=4, factors='bf16')"
    assert gz.Adaptive(gz.TopK(0.01), reference=gz.TopK(0.003)).reference_value == 0.003
    assert default_menu("ratio", 0.01) == [0.001, 0.003, 0.01, 0.03, 0.1]
    assert default_menu("ratio", 0.3) == [0.03, 0.09, 0.3, 0.9, 1.0]
    assert gz.Adaptive(gz.QSGD(7), menu=[3, 15]).values == [3, 7, 15]
    assert gz.Adaptive(gz.Threshold(policy="target", density=0.01)).param == "density"
    assert gz.Adaptive(gz.TopK(0.01)).key != gz.Adaptive(gz.TopK(0.02)).key  # its own state key
    for bad, word in [
        (lambda: gz.Adaptive(gz.SignSGD()), "families"),
        (lambda: gz.Adaptive(gz.TopK(gz.warmup.Linear(0.1, 0.01, steps=10))), "schedule"),
        (lambda: gz.Adaptive(gz.TopK(0.01, scope="call")), "per tensor"),
        (lambda: gz.Adaptive(gz.Threshold(tau=0.1)), "target"),
        (lambda: gz.Adaptive(gz.PowerSGD(rank=1, accordion_rank=2)), "accordion_rank"),
        (lambda: gz.Adaptive(gz.TopK(0.01), menu=[]), "menu"),
        (lambda: gz.Adaptive(gz.TopK(0.01), menu=[2.0]), "ratio"),
        (lambda: gz.Adaptive(gz.PowerSGD(rank=1), menu=[1.5]), "menu"),
        (lambda: gz.Adaptive(gz.TopK(0.01), reference=gz.RandomK(0.01)), "reference"),
        (lambda: gz.Adaptive(gz.TopK(0.01), reference=gz.TopK(0.01, values="fp16")), "more than its ratio"),
        (lambda: gz.Adaptive(gz.TopK(0.01), budget=0), "budget"),
        (lambda: gz.Adaptive(gz.TopK(0.01), period=0), "period"),
        (lambda: gz.Adaptive(gz.TopK(0.01), solver="greedy"), "solver"),
    ]:
        with pytest.raises(ValueError, match=word):
            bad()


# -- the solvers ----------------------------------------------------------------------------------
def _brute(err, nbytes, budget):
    """The fewest bytes of every choice within the budget (None if none is)."""
    best = None
    for c in itertools.product(*[range(len(r)) for r in err]):
        e = sum(err[t][j] for t, j in enumerate(c))
        if e <= budget:
            b = sum(nbytes[t][j] for t, j in enumerate(c))
            best = b if best is None else min(best, b)
    return best


def _totals(choice, err, nbytes):
    return sum(err[t][j] for t, j in enumerate(choice)), sum(nbytes[t][j] for t, j in enumerate(choice))


@PROPS
@given(
    table=st.integers(1, 5).flatmap(
        lambda e: st.lists(
            st.lists(
                st.tuples(st.sampled_from([0.0, 0.5, 1.0, 1.7, 3.0, 10.0]), st.integers(0, 50)), min_size=e, max_size=e
            ),
            min_size=1,
            max_size=6,
        )
    ),
    ref=st.integers(0, 4),
    scale=st.sampled_from([0.5, 1.0, 1.3]),
    bins=st.sampled_from([7, 100, 1000]),
)
def test_the_solvers_against_brute_force_on_small_menus(table, ref, scale, bins):
    err = [[float(e) for e, _ in row] for row in table]
    nbytes = [[float(b) for _, b in row] for row in table]
    T, E = len(err), len(err[0])
    refs = [min(ref, E - 1)] * T
    budget = scale * sum(err[t][refs[t]] for t in range(T))
    best = _brute(err, nbytes, budget)
    exact = solve_exact(err, nbytes, budget)
    if best is None:
        assert exact is None
    else:  # exact: the optimum, within the budget
        e, b = _totals(exact, err, nbytes)
        assert e <= budget and b == best
    dp = solve_dp(err, nbytes, budget, bins=bins, ref=refs)
    if budget > 0 and dp is not None:
        u = budget / bins
        cap = max(bins, sum(math.ceil(err[t][refs[t]] / u) for t in range(T)))
        e, b = _totals(dp, err, nbytes)
        assert e <= cap * u * (1 + 1e-12)  # within the rounding of the budget
        tighter = _brute(err, nbytes, budget - T * u)
        assert tighter is None or b <= tighter  # as good as the optimum of a budget T units tighter
        looser = _brute(err, nbytes, cap * u * (1 + 1e-12))
        assert b >= looser
    if scale >= 1.0:  # the reference meets the budget: every solver finds a choice
        for how in ("auto", "dp", "exact"):
            choice, _ = solve(err, nbytes, budget, solver=how, bins=bins, ref=refs)
            assert choice is not None and len(choice) == T


def test_the_dp_takes_over_from_a_frontier_too_large_and_ties_go_to_the_first_setting():
    g = torch.Generator().manual_seed(0)
    err = torch.rand(40, 6, generator=g, dtype=torch.float64).tolist()
    nb = torch.randint(1, 10**6, (40, 6), generator=g).double().tolist()
    budget = sum(r[2] for r in err)
    assert solve_exact(err, nb, budget, cap=100) is None  # the frontier outgrows 100 points
    exact = solve_exact(err, nb, budget)
    choice, how = solve(err, nb, budget, solver="dp", ref=[2] * 40)
    assert how == "dp" and _totals(choice, err, nb)[0] <= budget * (1 + 40 / 1000)
    if exact is not None:  # the DP's rounding costs little against the optimum
        assert _totals(choice, err, nb)[1] <= 1.05 * _totals(exact, err, nb)[1]
    assert solve([[1.0, 1.0]], [[5.0, 5.0]], 1.0)[0] == [0]
    assert solve_exact([[2.0]], [[1.0]], 1.0) is None and solve_dp([[2.0]], [[1.0]], 1.0) is None
    assert solve([[2.0]], [[1.0]], 1.0, ref=[0])[0] == [0]  # nothing fits: the reference
    assert solve_exact([[0.0, 1.0], [3.0, 0.0]], [[9.0, 1.0], [1.0, 9.0]], 0.0) == [0, 1]


# -- the statistics -------------------------------------------------------------------------------
def test_statistics_are_the_codecs_own_error_and_bytes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, generator=g) * torch.linspace(0.01, 3, 300)
    a = gz.Adaptive(gz.TopK(0.05), menu=[0.01, 0.2, 1.0])
    ctx = TensorContext(name="w", step=3, dtype=torch.float32)
    errs, nb = a.measure(x, ctx)
    mags = x.double().square().sort(descending=True).values
    for v, e, b in zip(a.values, errs, nb):
        k = math.ceil(v * 300)
        assert e == pytest.approx(float(mags[k:].sum()), rel=1e-9, abs=1e-12)
        p = gz.TopK(v).compress(x, TensorContext(name="w", step=3))
        assert b == frame_nbytes(p.body.numel(), False)
    assert errs[-1] == 0.0 and ctx.store == {}  # the tensor's own state is left alone

    low = torch.randn(120, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 90, generator=g, dtype=torch.float64)
    m = (low + 1e-3 * torch.randn(120, 90, generator=g, dtype=torch.float64)).float()
    p = gz.Adaptive(gz.PowerSGD(rank=2), menu=[1, 3, 8])
    errs, nb = p.measure(m, ctx)
    sig = torch.linalg.svdvals(m.double()).square()
    for k, e, b in zip(p.values, errs, nb):
        assert e == pytest.approx(float(sig[k:].sum()), rel=1e-4)
        assert b == (120 + 90) * k * 4
    big = torch.randn(400, 6, generator=g) @ torch.randn(6, 500, generator=g)  # the randomized range finder
    errs, _ = p.measure(big + 0.01 * torch.randn(400, 500, generator=g), ctx)
    sig = torch.linalg.svdvals((big + 0.0).double()).square()
    assert errs[-1] < 0.01 * float(sig.sum())  # rank 8 > 6: only the noise is left
    assert errs[0] == pytest.approx(float(sig[1:].sum()), rel=0.05)
    assert p.measure(torch.randn(7), ctx) == ([0.0] * 4, [28.0] * 4)  # a vector PowerSGD sends whole


# -- on gloo ranks -------------------------------------------------------------------------------
def _choices(state) -> dict:
    """Each tensor's setting (TwoPhase's pieces and the protocol's own key left out)."""
    return {n: s.get(VALUE) for n, s in state.engine.tensor_state.items() if "#" not in n and ":" not in n}


def _agree(rank, world, specs, steps):
    """DDP with several buckets, each rank its own data: every step's choices and statistics."""
    out = {}
    for spec in specs:
        model = make_model(0, widths=(64, 64))
        ddp = DDP(model, bucket_cap_mb=0.005)
        state = register_hook(ddp, gz.parse(spec))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        seen = []
        for s in range(steps):
            train_steps(ddp, opt, 1, rank, first=s)
            ts = state.engine.tensor_state
            seen.append(
                {
                    "choices": _choices(state),
                    "stats": {n: (ts[n].get(ERR), ts[n].get(BYTES), ts[n].get(AT)) for n in _choices(state)},
                }
            )
        out[spec] = {"steps": seen, "params": params(model), "routes": state.routes()}
    return out


@pytest.mark.slow
def test_every_rank_chooses_the_same_settings_from_its_own_data():
    res = run_ranks(_agree, 4, [TOPK, POWER], 7, timeout=300)
    for spec, family in ((TOPK, "TopK"), (POWER, "PowerSGD")):
        runs = [r[spec] for r in res]
        for other in runs[1:]:
            assert other["steps"] == runs[0]["steps"]  # the same statistics and choices, every step
            assert all(torch.equal(a, b) for a, b in zip(other["params"], runs[0]["params"]))
        steps = runs[0]["steps"]
        assert all(v is None for v in steps[1]["choices"].values())  # the reference until step 2
        assert steps[1]["stats"]["0.weight"][2] == 1  # measured at step 1
        changed = [
            n for n, v in steps[-1]["choices"].items() if v is not None and v != (0.05 if family == "TopK" else 2)
        ]
        if family == "TopK":
            assert changed, steps[-1]["choices"]  # the error budget moved bytes between layers
        for row in runs[0]["routes"]:
            assert row["reason"].startswith("adaptive: ") and row["method"].startswith(family)


# mass: N * applied + sum_ranks r' + N * e' == sum_ranks (g + r) + N * e (TwoPhase's owners at 4)
SHAPES = {"w1": (40, 9), "b1": (40,), "w2": (12, 40), "tiny": (2,)}


def _owner_mass(eng, world, rank):
    out = {}
    for n, shape in SHAPES.items():
        full = torch.zeros(torch.Size(shape).numel(), dtype=torch.float64)
        b = piece_bounds(full.numel(), world)
        r = eng.memory.residual(owner_key(n, rank, world))
        if r is not None:
            full[b[rank] : b[rank + 1]] = r.double()
        out[n] = full.view(shape)
    return out


def _rank_now(eng, n):
    """The rank PowerSGD compressed ``n`` at in the last step (0: sent whole, or not PowerSGD)."""
    a = eng.method
    if a.family != "PowerSGD":
        return 0
    v = a.current(eng.tensor_state[n])
    return a.setting(v).compressed_rank(SHAPES[n], v)


def _mass(rank, world, steps):
    res = {}
    for spec in (
        "Adaptive(TopK(0.1), menu=[0.02, 0.5, 1.0], period=1)",
        "Adaptive(PowerSGD(rank=2), menu=[1, 5], period=1, budget=1.01)",
    ):
        eng = Engine(gz.parse(spec), error_feedback=True)
        rows = []
        for s in range(steps):
            g = torch.Generator().manual_seed(1000 * s + rank)
            grads = {n: torch.randn(shape, generator=g) * (1 + rank) for n, shape in SHAPES.items()}
            # w1 of rank 1 on even steps and 2 on odd ones (the same directions on every rank):
            # PowerSGD's rank follows it, truncating and extending the warm-started Q
            uv = torch.Generator().manual_seed(7)
            u, v = torch.randn(40, 2, generator=uv), torch.randn(2, 9, generator=uv)
            grads["w1"] = (1 + rank) * u[:, : 1 + s % 2] @ v[: 1 + s % 2]
            before = {n: eng.memory.residual(n) for n in SHAPES}
            owner_before = _owner_mass(eng, world, rank)
            futs = [
                eng.reduce(["w1", "b1"], [grads["w1"], grads["b1"]]),
                eng.reduce(["w2", "tiny"], [grads["w2"], grads["tiny"]]),
            ]
            eng.flush()
            eng.end_step()
            flat = torch.cat([f.wait() for f in futs])
            applied, pos = {}, 0
            for n in SHAPES:
                k = torch.Size(SHAPES[n]).numel()
                applied[n] = flat[pos : pos + k].view(SHAPES[n]).double()
                pos += k
            rows.append(
                {
                    "in": {n: grads[n].double() + (before[n].double() if before[n] is not None else 0) for n in SHAPES},
                    "owner_in": owner_before,
                    "left": {n: eng.memory.residual(n).double() for n in SHAPES},
                    "owner_left": _owner_mass(eng, world, rank),
                    "applied": applied,
                    "values": {n: eng.tensor_state[n].get(VALUE) for n in SHAPES},
                    "q": {n: tuple(eng.tensor_state[n]["q"].shape) for n in SHAPES if "q" in eng.tensor_state[n]},
                    "k": {n: _rank_now(eng, n) for n in SHAPES},
                }
            )
        res[spec] = rows
    return res


@pytest.mark.slow
def test_mass_is_kept_across_a_change_of_setting():
    world, steps = 4, 5
    res = run_ranks(_mass, world, steps, timeout=300)
    for spec in res[0]:
        rows0 = res[0][spec]
        changes = sum(rows0[s]["values"] != rows0[s - 1]["values"] for s in range(2, steps))
        assert changes or any(v not in (None, 0.1, 2) for v in rows0[-1]["values"].values()), [
            r["values"] for r in rows0
        ]
        for s in range(steps):
            for n in SHAPES:
                rows = [r[spec][s] for r in res]
                lhs = world * rows[0]["applied"][n] + sum(r["left"][n] for r in rows)
                lhs = lhs + world * sum(r["owner_left"][n] for r in rows)
                rhs = sum(r["in"][n] for r in rows) + world * sum(r["owner_in"][n] for r in rows)
                for r in rows[1:]:
                    assert torch.equal(r["applied"][n], rows[0]["applied"][n])
                scale = max(1.0, float(rhs.abs().max()))
                assert float((lhs - rhs).abs().max()) <= 1e-5 * scale, (spec, s, n)
        if "PowerSGD" in spec:  # the warm-started Q follows the rank (truncated or extended)
            ks = {(n, row["k"][n]) for row in rows0 for n in SHAPES if row["k"][n]}
            assert len({k for n, k in ks if n == "w1"}) > 1, ks  # w1 changed rank
            for row in rows0:
                for n, k in row["k"].items():
                    if k:
                        assert row["q"][n] == (SHAPES[n][1], k), (n, row["q"][n], k)


def _resume(rank, world, spec, k, total):
    def build(seed):
        model = make_model(seed, widths=(48, 48))
        ddp = DDP(model, bucket_cap_mb=0.003)
        state = register_hook(ddp, gz.parse(spec))
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    def load(run, ckpt):
        run[0].load_state_dict(ckpt["model"])
        run[3].load_state_dict(ckpt["opt"])
        run[2].load_state_dict(ckpt["gradzip"])

    out = resume_matches_unbroken(
        build,
        lambda run, first, steps: train_steps(run[1], run[3], steps, rank, first),
        lambda run: {"model": run[0].state_dict(), "opt": run[3].state_dict(), "gradzip": run[2].state_dict()},
        load,
        k,
        total,
        snapshot=lambda run: params(run[0]) + [_choices(run[2])],
    )
    g = out["ckpt"]["gradzip"]["tensor_state"]
    out["pending"] = next(v.get("pending") for n, v in g.items() if n.startswith("adaptive:"))
    del out["ckpt"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, start",
    [
        ("Adaptive(TopK(0.05), menu=[0.01, 0.02, 0.1, 0.3, 1.0], period=3)", 0.05),
        ("Adaptive(PowerSGD(rank=2), menu=[1, 4], period=3, budget=2.0)", 2),
    ],
)
def test_resume_across_a_change_is_bit_identical(spec, start):
    """Saved at step 3 with step 2's statistics waiting for their choice: the resumed run makes
    it at step 3, as the unbroken run does, and both change again from step 6."""
    res = run_ranks(_resume, 2, spec, 3, 8, timeout=300)
    for r in res:
        assert r["pending"] == 2
        *pu, cu = r["unbroken"]
        *pr, cr = r["resumed"]
        assert cu == cr and any(v not in (None, start) for n, v in cu.items() if n.endswith("weight")), cu
        assert all(torch.equal(a, b) for a, b in zip(pu, pr))


def _train_save(rank, world, spec, steps):
    model = make_model(0, widths=(48, 48))
    ddp = DDP(model, bucket_cap_mb=0.003)
    state = register_hook(ddp, gz.parse(spec))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_steps(ddp, opt, steps, rank)
    buf = io.BytesIO()
    torch.save({"gradzip": state.state_dict(), "model": model.state_dict()}, buf)
    return buf.getvalue()


def _load_train(rank, world, spec, blobs, steps):
    model = make_model(0, widths=(48, 48))
    ddp = DDP(model, bucket_cap_mb=0.003)
    state = register_hook(ddp, gz.parse(spec))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ck = torch.load(io.BytesIO(blobs[rank]), weights_only=True)
    model.load_state_dict(ck["model"])
    state.load_state_dict(ck["gradzip"])
    before = _choices(state)
    train_steps(ddp, opt, steps, rank, first=100)
    return {"before": before, "after": _choices(state), "params": params(model), "routes": state.routes()}


@pytest.mark.slow
def test_reshard_carries_the_choice_and_the_mass_to_another_world_size():
    spec = TOPK
    blobs = run_ranks(_train_save, 4, spec, 5, timeout=300)
    states = [torch.load(io.BytesIO(b), weights_only=True) for b in blobs]
    old = [s["gradzip"] for s in states]
    new = reshard(old, 2)
    for name in old[0]["residuals"]:
        if "#" in name:
            continue
        owner = sum(
            (s["residuals"].get(owner_key(name, j, 4)) is not None) for j, s in enumerate(old)
        )  # TwoPhase's owners at 4 ranks, folded in
        total = sum(s["residuals"][name].double() for s in old)
        if owner:
            full = torch.cat([old[j]["residuals"][owner_key(name, j, 4)].double() for j in range(4)])
            total = total + 4 * full.view(total.shape)
        torch.testing.assert_close(sum(s["residuals"][name].double() for s in new), total, rtol=1e-6, atol=1e-6)
    blobs2 = []
    for s in new:
        buf = io.BytesIO()
        torch.save({"gradzip": s, "model": states[0]["model"]}, buf)
        blobs2.append(buf.getvalue())
    res = run_ranks(_load_train, 2, spec, blobs2, 3, timeout=300)
    saved = {
        n: v.get(VALUE) for n, v in old[0]["tensor_state"].items() if not n.startswith("adaptive:") and "#" not in n
    }
    for r in res:
        assert r["before"] == saved and any(v is not None for v in saved.values())
        assert r["after"] == res[0]["after"]
        assert all(torch.equal(a, b) for a, b in zip(r["params"], res[0]["params"]))


def _many_buckets(rank, world, steps):
    model = many_buckets_model()
    out = {}
    for spec in (
        "Adaptive(TopK(0.01), menu=[0.003, 0.03], period=3)",
        "Adaptive(PowerSGD(rank=2), menu=[1, 4], period=3)",
    ):
        state = train_many_buckets(model, gz.parse(spec), rank, steps)
        out[spec] = (_choices(state), params(model), len(state.engine._layout_last))
    return out


@pytest.mark.slow
def test_bucket_cap_1mb_on_four_ranks_many_steps_never_hangs():
    res = run_ranks(_many_buckets, 4, 13, timeout=600)
    for spec, (choices, ps, calls) in res[0].items():
        assert calls >= 2 and all(v is not None for v in choices.values()), spec
        for r in res[1:]:
            assert r[spec][0] == choices
            assert all(torch.equal(a, b) for a, b in zip(r[spec][1], ps))
        assert all(bool(torch.isfinite(p).all()) for p in ps)


def _frontends(rank, world):
    import gradzip.horovod as gh

    spec = "Adaptive(TopK(0.05), menu=[0.01, 0.3, 1.0], period=2)"
    out = {}
    torch.manual_seed(0)
    model = make_model(0, widths=(32,))
    opt = gz.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=gz.parse(spec),
    )
    train_steps(model, opt, 5, rank)
    out["optim"] = ([r["reason"] for r in opt.routes()], params(model))
    gh.init()
    model = make_model(0, widths=(32,))
    opt = gh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), compression=spec
    )
    train_steps(model, opt, 5, rank)
    out["horovod"] = ([r["reason"] for r in opt.routes()], params(model))
    model = make_model(0, widths=(32,))
    opt = gz.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, period=2, compression=gz.parse(spec))
    train_steps(model, opt, 12, rank)  # 6 outer steps: statistics at the 2nd and 4th
    opt.synchronize()
    out["diloco"] = ([r["reason"] for r in opt.routes()], params(model))
    return out


@pytest.mark.slow
def test_the_front_ends_that_take_a_method_run_it():
    res = run_ranks(_frontends, 2, timeout=300)
    for key in ("optim", "horovod", "diloco"):
        reasons, ps = res[0][key]
        assert reasons and all(r.startswith("adaptive: ratio=") for r in reasons), (key, reasons)
        assert any("since step" in r for r in reasons), (key, reasons)
        assert res[1][key][0] == reasons and all(torch.equal(a, b) for a, b in zip(res[1][key][1], ps))


def test_the_plan_prices_it_at_its_reference():
    from gradzip.costmodel import CodecProfile, Link, step_cost
    from gradzip.costmodel.profile import CodecFit

    prof = CodecProfile(measure_missing=False)
    prof.add(gz.TopK(0.01), CodecFit(1e-9, 1e-5), error_feedback=True)
    layers = [("a.weight", (256, 64)), ("a.bias", (256,)), ("b.weight", (10, 256))]
    link = Link(1e9, 5e-5)
    ref = step_cost(gz.TopK(0.01), layers, 4, link, 0.1, prof)
    ada = step_cost(gz.Adaptive(gz.TopK(0.01), menu=[0.001, 0.1]), layers, 4, link, 0.1, prof)
    assert (ada.bytes_per_rank, ada.wire_s, ada.codec_s) == (ref.bytes_per_rank, ref.wire_s, ref.codec_s)


def _accordion(rank, world):
    eng = Engine(gz.parse("Adaptive(TopK(0.05), menu=[0.01, 0.3], accordion=0.3, period=2)"))
    a, seen = eng.method, []
    for s in range(7):
        g = torch.Generator().manual_seed(100 * s + rank)
        scale = 10.0 if s in (4, 5) else 1.0  # the gradient norm jumps in the third window
        f = eng.reduce(["w", "b"], [scale * torch.randn(30, 20, generator=g), scale * torch.randn(30, generator=g)])
        eng.flush()
        eng.end_step()
        f.wait()
        choice = eng.tensor_state[a.key].get("choice")
        seen.append((choice or {}).get("critical"))
    return {"seen": seen, "start": a.initial()}


def test_accordion_takes_the_lighter_budget_in_critical_regimes():
    """Windows of 2 steps: the first choice is critical (no earlier norm), the second not (the
    same norm), the third critical again (the norm grew tenfold)."""
    res = run_ranks(_accordion, 2)
    assert res[0] == res[1]
    assert res[0]["start"] == 0.3
    assert res[0]["seen"] == [None, None, True, True, False, False, True]


def _nonfinite(rank, world, method="Adaptive(TopK(0.05), menu=[0.01, 1.0], period=2)"):
    eng = Engine(gz.parse(method))
    key, since = eng.method.key, []
    for s in range(6):
        g = torch.Generator().manual_seed(100 * s + rank)
        w = torch.randn(30, 20, generator=g)
        if s == 1 and rank == 1:
            w[3, 4] = float("nan")  # the statistics step of the first window is skipped
        f = eng.reduce(["w"], [w])
        eng.flush()
        eng.end_step()
        f.wait()
        since.append((eng.tensor_state["w"].get(SINCE), eng.tensor_state[key].get("pending")))
    return since


@pytest.mark.parametrize(
    "method",
    [
        "Adaptive(TopK(0.05), menu=[0.01, 1.0], period=2)",
        # (its statistics take singular values: on a NaN input they raised on that rank alone,
        # and the other rank waited in the statistics' allreduce)
        "Adaptive(PowerSGD(rank=2), menu=[1, 4], period=2)",
    ],
)
def test_a_non_finite_statistics_step_is_rolled_back_with_its_statistics(method):
    res = run_ranks(_nonfinite, 2, method)
    assert res[0] == res[1] == [(None, None), (None, None), (None, None), (None, 3), (4, None), (4, 5)]
