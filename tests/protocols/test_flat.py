"""Flat(codec): a call's tensors as one tensor. Equal to the codec on the concatenation, exact
mass with the owner memory handed back, residuals per tensor as views of one buffer, layout
changes, frozen tensors, rollback, momentum correction, DDP with small buckets on 4 ranks."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip.engine import Engine
from gradzip.hooks import register_hook
from gradzip.protocols.flat import Flat, flat_key
from gradzip.wire import run_view
from tests.support import ddp_resume_matches_unbroken, make_model, many_buckets_model, run_ranks, train_many_buckets

SHAPES = {"w1": (40, 9), "b1": (40,), "w2": (3, 40), "tiny": (2,)}
CODECS = [gz.Int8(block=8), gz.TopK(0.05), gz.SignSGD(block=16), gz.TernGrad(block=32), gz.QSGD(block=16)]


def _grads(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {n: torch.randn(s, generator=g) * (1 + rank) for n, s in SHAPES.items()}


# -- configuration -------------------------------------------------------------------------
def test_flat_is_in_the_grammar_and_carries_codecs_only():
    m = gz.parse("Flat(Int8(block=64))")
    assert isinstance(m, Flat) and m == Flat(gz.Int8(block=64)) and repr(m) == "Flat(Int8(block=64))"
    with pytest.raises(TypeError, match="carries a codec"):
        Flat(gz.TwoPhase(gz.Int8()))
    with pytest.raises(TypeError, match="carries a codec"):
        Flat(Flat(gz.Int8()))


def test_run_view_finds_back_to_back_views_only():
    base = torch.arange(10.0)
    parts = [base[0:3].view(3, 1), base[3:3], base[3:10]]
    v = run_view(parts)
    assert v is not None and v.data_ptr() == base.data_ptr() and torch.equal(v, base)
    assert run_view([base[0:3], base[4:10]]) is None  # a gap
    assert run_view([base[3:6], base[0:3]]) is None  # out of order
    assert run_view([base[0:4], torch.arange(3.0)]) is None  # another storage
    assert run_view([base.view(2, 5).t()]) is None  # not contiguous
    assert run_view([base[0:3], None]) is None
    assert run_view([base[0:3], base[3:6].double()]) is None


def test_key_names_the_tensors_and_sizes():
    a, b = torch.zeros(3), torch.zeros(4)
    assert flat_key(["x", "y"], [a, b]) == flat_key(["x", "y"], [a.clone(), b.clone()])
    assert flat_key(["x", "y"], [a, b]) != flat_key(["y", "x"], [a, b])
    assert flat_key(["x", "y"], [a, b]) != flat_key(["x", "y"], [a, torch.zeros(5)])


# -- on gloo ranks -----------------------------------------------------------------------------
def _against_concatenation(rank, world, codec, feedback, steps):
    """Per step: Flat(codec) on two calls, and codec's own protocol on each call's concatenation."""
    flat = Engine(Flat(codec), error_feedback=feedback)
    whole = Engine(codec, error_feedback=feedback)
    rows = []
    for s in range(steps):
        g = _grads(s, rank)
        a = [flat.reduce(["w1", "b1"], [g["w1"], g["b1"]]), flat.reduce(["w2", "tiny"], [g["w2"], g["tiny"]])]
        flat.flush()
        flat.end_step()
        b = [  # named by the flat key: a stochastic codec draws by name
            whole.reduce([flat_key(c, [g[n] for n in c])], [torch.cat([g[n].reshape(-1) for n in c])])
            for c in (["w1", "b1"], ["w2", "tiny"])
        ]
        whole.flush()
        whole.end_step()
        rows.append(([f.wait() for f in a], [f.wait() for f in b]))
    return rows


def _against_concatenation_both(rank, world, codec):
    """Without error feedback for 3 steps, then with it for 1: one start of the ranks."""
    return [(fb, _against_concatenation(rank, world, codec, fb, steps)) for fb, steps in ((False, 3), (True, 1))]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_flat_is_the_codec_on_the_concatenation(codec):
    """Bit for bit: every step without error feedback; the first step with it (from the second,
    TwoPhase keeps its owner memory where Flat hands it back)."""
    for runs in run_ranks(_against_concatenation_both, 4, codec):
        for feedback, rows in runs:
            for a, b in rows:
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (codec, feedback)


LAYOUTS = [  # the calls of each step: the second layout is a bucket rebuild
    [["w1", "b1"], ["w2", "tiny"]],
    [["w1", "b1"], ["w2", "tiny"]],
    [["w1"], ["b1", "w2", "tiny"]],
    [["w1"], ["b1", "w2", "tiny"]],
]


def _mass(rank, world, codec):
    eng = Engine(Flat(codec), error_feedback=True)
    rows = []
    for s, calls in enumerate(LAYOUTS):
        g = _grads(s, rank)
        if s == 3 and rank in (0, 1):
            # unused on ranks 0 and 1, frozen there; rank 0 owns b1's piece: its owner error of
            # the average (the others used b1) goes to b1's residual, rank 1's is left alone
            g["b1"] = torch.zeros_like(g["b1"])
        before = {n: eng.memory.residual(n) for n in SHAPES}
        futs = [eng.reduce(c, [g[n] for n in c], zero_is_unused=True) for c in calls]
        eng.flush()
        eng.end_step()
        flat = torch.cat([f.wait() for f in futs])
        order = [n for c in calls for n in c]
        applied, pos = {}, 0
        for n in order:
            k = g[n].numel()
            applied[n] = flat[pos : pos + k].view(g[n].shape).double()
            pos += k
        rows.append(
            {
                "in": {n: g[n].double() + (before[n].double() if before[n] is not None else 0) for n in SHAPES},
                "left": {n: eng.memory.residual(n).double() for n in SHAPES},
                "applied": applied,
                "keys": sorted(eng.memory.residuals),
                "views": [run_view([eng.memory.residual(n) for n in c]) is not None for c in calls],
                "frozen_kept": s != 3 or rank != 1 or torch.equal(eng.memory.residual("b1"), before["b1"]),
            }
        )
    return rows


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_mass_is_exact_across_a_layout_change_and_a_frozen_tensor(codec):
    """N * applied + sum_ranks r' == sum_ranks (g + r) every step, per tensor: the owner's
    error is back in the residuals the same step, and nothing is kept under a layout's key."""
    world = 4
    res = run_ranks(_mass, world, codec)
    for s in range(len(LAYOUTS)):
        rows = [r[s] for r in res]
        for n in SHAPES:
            for r in rows[1:]:
                assert torch.equal(r["applied"][n], rows[0]["applied"][n])
            lhs = world * rows[0]["applied"][n] + sum(r["left"][n] for r in rows)
            rhs = sum(r["in"][n] for r in rows)
            assert float((lhs - rhs).abs().max()) <= 1e-5 * max(1.0, float(rhs.abs().max())), (s, n)
        for r in rows:
            assert r["keys"] == sorted(SHAPES)  # per tensor only
            assert r["frozen_kept"]
    # In a steady layout the residuals are views of one buffer (read back with no copy).
    assert all(all(r[s]["views"]) for r in res for s in (0, 1))
    assert all(res[0][2]["views"])


def _rollback(rank, world):
    eng = Engine(Flat(gz.Int8(block=8)), error_feedback=True)
    for s in range(2):
        g = _grads(s, rank)
        futs = [eng.reduce(["w1", "b1"], [g["w1"], g["b1"]])]
        eng.flush()
        eng.end_step()
        [f.wait() for f in futs]
    before = {n: eng.memory.residual(n).clone() for n in ("w1", "b1")}
    g = _grads(2, rank)
    if rank == 2:
        g["b1"][3] = float("nan")
    fut = eng.reduce(["w1", "b1"], [g["w1"], g["b1"]])
    eng.flush()
    eng.end_step()
    out = fut.wait()
    return bool(out.isnan().all()), all(torch.equal(eng.memory.residual(n), before[n]) for n in before)


def test_a_nonfinite_step_restores_every_residual():
    for all_nan, restored in run_ranks(_rollback, 4):
        assert all_nan and restored


def _dgc(rank, world, steps, codec):
    from tests.engine.test_momentum import _ddp

    return _ddp(rank, world, steps, False, codec=codec)


def test_momentum_correction_masks_where_the_flat_topk_sent():
    """Flat(TopK) over one bucket is a top-k of the concatenation: DGC written out with a
    call-wide top-k, parameters and momentum buffers bit for bit."""
    from tests.engine.test_momentum import _assert_matches, reference

    res = run_ranks(_dgc, 2, 5, Flat(gz.TopK(0.1)))
    _assert_matches(res, *reference(2, 5, False, codec=gz.TopK(0.1, scope="call")))


def _train(rank, world, comps, steps, cap_mb):
    out = []
    for comp in comps:
        model = make_model(0, widths=(48, 48))
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        if comp is not None:
            register_hook(ddp, comp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.5)
        losses = []
        for s in range(steps):
            g = torch.Generator().manual_seed(1000 * s + rank)
            x = torch.randn(16, 20, generator=g)
            y = (x[:, :5].argmax(1) + (x[:, 5] > 1).long()) % 5
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        out.append({"params": [p.detach().clone() for p in model.parameters()], "losses": losses})
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_on_4_ranks_trains_like_plain_ddp():
    """DDP with several buckets on 4 ranks, 30 steps: every rank the same parameters, the last
    losses within 0.25 of plain DDP's (as TwoPhase's own test)."""
    comps = [None, Flat(gz.Int8()), Flat(gz.TopK(0.05)), Flat(gz.SignSGD(block=64))]
    res = run_ranks(_train, 4, comps, 30, 0.005, timeout=600)
    base = sum(res[0][0]["losses"][-8:]) / 8
    for j in range(1, len(comps)):
        for r in res[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r[j]["params"], res[0][j]["params"]))
        last = sum(res[0][j]["losses"][-8:]) / 8
        assert last < base + 0.25, (repr(comps[j]), last, base)


def _many_buckets(rank, world, steps):
    model = many_buckets_model()
    out = {}
    for comp in (Flat(gz.Int8()), Flat(gz.TopK(0.01))):
        state = train_many_buckets(model, comp, rank, steps)
        keys = sorted(k for k in state.engine.tensor_state if k.startswith("flat:"))
        out[repr(comp)] = (keys, [p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.slow
def test_bucket_cap_1mb_on_four_ranks_never_hangs():
    res = run_ranks(_many_buckets, 4, 15, timeout=600)
    for key, (keys, params) in res[0].items():
        assert len(keys) >= 3, keys  # several buckets, each one flat call (and the rebuild's)
        for r in res[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r[key][1], params))
        assert all(bool(torch.isfinite(a).all()) for a in params)


def _resume(rank, world):
    return ddp_resume_matches_unbroken(rank, Flat(gz.Int8(block=8)), 3)


def test_a_checkpoint_resumes_bit_for_bit():
    for r in run_ranks(_resume, 2):
        assert all(torch.equal(a, b) for a, b in zip(r["unbroken"], r["resumed"]))


def test_mixed_dtypes_in_a_call_are_refused():
    from gradzip.costmodel.dryrun import LoopbackComm
    from gradzip.protocols.base import Call

    comm = LoopbackComm(world_size=4)
    ts = [torch.zeros(8), torch.zeros(8, dtype=torch.float64)]
    call = Call(comm=comm, names=["a", "b"], tensors=ts, contexts=[None, None], memory=None, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        next(Flat(gz.Int8()).exchange(call))


def _front_ends(rank, world):
    from tests.support.models import train_steps

    out = {}
    m = make_model(0)
    opt = gz.LocalSGD(torch.optim.SGD(m.parameters(), lr=0.1), m, period=2, compression=Flat(gz.Int8()))
    train_steps(m, opt, 6, rank)
    out["LocalSGD"] = [p.detach().clone() for p in m.parameters()]
    m = make_model(0)
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    opt = gz.DiLoCo(inner, m, 2, Flat(gz.TopK(0.1)), outer_kwargs={"lr": 0.5, "momentum": 0.5})
    train_steps(m, opt, 6, rank)
    out["DiLoCo"] = [p.detach().clone() for p in m.parameters()]
    m = make_model(0)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    opt = gz.DistributedOptimizer(sgd, m.named_parameters(), compression=Flat(gz.SignSGD()))
    train_steps(m, opt, 4, rank)
    out["DistributedOptimizer"] = [p.detach().clone() for p in m.parameters()]
    return out


def test_the_other_front_ends_carry_flat_on_4_ranks():
    """LocalSGD, DiLoCo and DistributedOptimizer with a Flat method: every rank the same finite
    parameters (their deltas and gradients are loose tensors: Flat concatenates them)."""
    res = run_ranks(_front_ends, 4)
    for name, params in res[0].items():
        for r in res[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r[name], params)), name
        assert all(bool(torch.isfinite(p).all()) for p in params), name


STEADY = {"w1": (40, 8), "b1": (40,), "w2": (4, 40), "tiny": (4,)}  # 524 elements: 4 equal pieces


def _steady_steps(codec, steps, reuse, monkeypatch):
    """Dry runs of Flat(codec) on one call, memory kept and released each step as the engine
    does; with ``reuse`` off the spares' views are never reused (the flat residual is cut
    into new views every step)."""
    from gradzip.costmodel import dry_run
    from gradzip.feedback import ErrorFeedback
    from gradzip.protocols import flat as flat_mod

    if not reuse:
        real = flat_mod._Spread.set

        def cut(self, name, new):
            self.views = None
            return real(self, name, new)

        monkeypatch.setattr(flat_mod._Spread, "set", cut)
    mem, stores, rows = ErrorFeedback(), {}, []
    names = list(STEADY)
    for s in range(steps):
        gen = torch.Generator().manual_seed(s)
        g = {n: torch.randn(shape, generator=gen) for n, shape in STEADY.items()}
        d = dry_run(Flat(codec), [g[n] for n in names], world_size=4, names=names, stores=stores, step=s, memory=mem)
        mem.release()
        rows.append((d.out.clone(), {n: mem.residual(n) for n in names}))
    monkeypatch.undo()
    return rows


@pytest.mark.parametrize("codec", [gz.Int8(block=8), gz.TopK(0.05)], ids=repr)
def test_a_steady_call_stores_the_spares_views_as_they_are(codec, monkeypatch):
    """From the third step of a steady call the flat residual is the buffer the step before last
    left, and its per-tensor residuals are that step's view objects (no new views a step);
    results and residuals equal, bit for bit, cutting new views every step."""
    kept = _steady_steps(codec, 5, True, monkeypatch)
    cut = _steady_steps(codec, 5, False, monkeypatch)
    for (out_a, res_a), (out_b, res_b) in zip(kept, cut):
        assert torch.equal(out_a, out_b)
        assert all(torch.equal(res_a[n], res_b[n]) for n in STEADY)
    for s in range(2, 5):
        assert all(kept[s][1][n] is kept[s - 2][1][n] for n in STEADY), s
        assert not any(cut[s][1][n] is cut[s - 2][1][n] for n in STEADY), s
