"""Momentum correction, codec schedules, local clipping, and the lean frames."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip import wire
from gradzip.codecs.base import TensorContext
from gradzip.codecs.positions import pack_gaps, unpack_gaps
from gradzip.hooks import register_hook
from tests import support
from tests.support import run_ranks


def make_model():
    return support.make_model(0, widths=(24,))


def batch(step, rank):
    return support.batch(step, rank, n=8)


def train(model, opt, rank, first, end):
    """Steps ``first`` to ``end - 1`` of this rank's batches: zero_grad, backward, step."""
    support.train_steps(model, opt, end - first, rank, first, n=8)


def reload(fresh, model, opt, state):
    """Save the model, the optimizer and the hook's state, build new ones with ``fresh()`` and
    load the saved states into them, through ``torch.save``/``torch.load(weights_only=True)``."""
    ck = support.roundtrip({"m": model.state_dict(), "o": opt.state_dict(), "g": state.state_dict()})
    model, ddp, opt, state = fresh()
    model.load_state_dict(ck["m"])
    opt.load_state_dict(ck["o"])
    state.load_state_dict(ck["g"])
    return model, ddp, opt, state


def _ddp(rank, world, steps, nesterov, lr=0.1, m=0.9, wd=1e-3, codec=None):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=m, nesterov=nesterov, weight_decay=wd)
    state = register_hook(ddp, codec if codec is not None else gz.TopK(0.1), optimizer=opt)
    assert all(g["momentum"] == 0 and g["weight_decay"] == 0 for g in opt.param_groups)
    train(ddp, opt, rank, 0, steps)
    return [p.detach().clone() for p in model.parameters()], state.state_dict()


def _call_ks(vs, ratio):
    """Per tensor, how many of the ``ceil(ratio * n)`` largest magnitudes of all of ``vs``
    together fall in it: a call-wide top-k written out."""
    flat = torch.cat([v.reshape(-1).abs() for v in vs])
    top = set(torch.topk(flat, math.ceil(ratio * flat.numel())).indices.tolist())
    ks, start = [], 0
    for v in vs:
        ks.append(sum(start <= j < start + v.numel() for j in top))
        start += v.numel()
    return ks


def _assert_matches(res, want, u):
    """Every rank's parameters equal the reference's, and its momentum buffers the reference's."""
    names = [n for n, _ in make_model().named_parameters()]
    for rank, (got, sd) in enumerate(res):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        for i, n in enumerate(names):
            assert torch.equal(sd["momentum"][f"{n}:momentum"], u[rank][i].view_as(sd["momentum"][f"{n}:momentum"]))


def reference(world, steps, nesterov, lr=0.1, m=0.9, wd=1e-3, codec=None):
    """DGC written out: per rank u = m u + g + wd p, v = r + (u, or g' + m u), send top-k(v),
    r = v - sent, u = 0 where sent; a plain SGD step on the average of what was sent. A
    ``scope="call"`` codec's top-k is taken over all parameters together (one DDP bucket),
    written out here as a top-k of their concatenation."""
    model = make_model()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    codec = codec if codec is not None else gz.TopK(0.1)
    u = [[None] * len(params) for _ in range(world)]
    r = [[None] * len(params) for _ in range(world)]
    for s in range(steps):
        grads = []
        for rank in range(world):
            model.zero_grad()
            x, y = batch(s, rank)
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in params])
        vs = [[None] * len(params) for _ in range(world)]
        for i, p in enumerate(params):
            for rank in range(world):
                g = grads[rank][i].add(p.detach(), alpha=wd)
                u[rank][i] = g.clone() if u[rank][i] is None else torch.add(g, u[rank][i], alpha=m)
                send = g + m * u[rank][i] if nesterov else u[rank][i]
                vs[rank][i] = send.clone() if r[rank][i] is None else send + r[rank][i]
        ks = [
            _call_ks(vs[rank], codec.ratio) if codec.scope == "call" else [None] * len(params) for rank in range(world)
        ]
        for i, p in enumerate(params):
            acc = torch.zeros(p.numel())
            for rank in range(world):
                v = vs[rank][i]
                pay = codec.compress(v, TensorContext(name=names[i], step=s, k=ks[rank][i]))
                codec.accumulate(pay, acc)
                sent = codec.decompress(pay)
                r[rank][i] = v - sent
                u[rank][i] = u[rank][i].masked_fill(sent != 0, 0.0)
            with torch.no_grad():
                p.add_(acc.div_(world).view_as(p), alpha=-lr)
    return [p.detach().clone() for p in params], u


@pytest.mark.parametrize(
    "nesterov, codec",
    [
        (False, gz.TopK(0.1)),
        (True, gz.TopK(0.1)),
        (False, gz.TopK(0.1, values="sign", scope="call")),  # STC values, one top-k over the bucket
    ],
    ids=["momentum", "nesterov", "sign-call"],
)
def test_momentum_correction_equals_dgc_written_out(nesterov, codec):
    res = run_ranks(_ddp, 2, 5, nesterov, 0.1, 0.9, 1e-3, codec)
    _assert_matches(res, *reference(2, 5, nesterov, codec=codec))


def _adam(rank, world, steps, lr=0.01, b1=0.9, wd=0.01):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr, betas=(b1, 0.999), weight_decay=wd)
    state = register_hook(ddp, gz.TopK(0.1, values="sign", scope="call"), optimizer=opt)
    assert all(g["betas"] == (0.0, 0.999) and g["weight_decay"] == wd for g in opt.param_groups)
    train(ddp, opt, rank, 0, steps)
    return [p.detach().clone() for p in model.parameters()], state.state_dict()


def adam_reference(world, steps, lr=0.01, b1=0.9, wd=0.01):
    """Adam's first moment before compression, written out: per rank u = b1 u + (1 - b1) g,
    v = r + u, send the call-wide top-k of v as +-mu, r = v - sent, u = 0 where sent; AdamW
    with beta1 = 0 (its beta2, eps and decoupled weight decay kept) steps on the average."""
    model = make_model()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.0, 0.999), weight_decay=wd)
    codec = gz.TopK(0.1, values="sign", scope="call")
    u = [[None] * len(params) for _ in range(world)]
    r = [[None] * len(params) for _ in range(world)]
    for s in range(steps):
        acc = [torch.zeros(p.numel()) for p in params]
        for rank in range(world):
            model.zero_grad()
            x, y = batch(s, rank)
            F.cross_entropy(model(x), y).backward()
            vs = []
            for i, p in enumerate(params):
                g = p.grad.clone()
                u[rank][i] = torch.mul(g, 1 - b1) if u[rank][i] is None else torch.add(u[rank][i] * b1, g, alpha=1 - b1)
                vs.append(u[rank][i].clone() if r[rank][i] is None else u[rank][i] + r[rank][i])
            ks = _call_ks(vs, 0.1)
            for i, v in enumerate(vs):
                pay = codec.compress(v, TensorContext(name=names[i], step=s, k=ks[i]))
                codec.accumulate(pay, acc[i])
                sent = codec.decompress(pay)
                r[rank][i] = v - sent
                u[rank][i] = u[rank][i].masked_fill(sent != 0, 0.0)
        for p, a in zip(params, acc):
            p.grad = a.div_(world).view_as(p)
        opt.step()
    return [p.detach().clone() for p in params], u


def test_adam_momentum_correction_equals_its_reference():
    res = run_ranks(_adam, 2, 5)
    _assert_matches(res, *adam_reference(2, 5))


def test_momentum_correction_refuses_what_it_cannot_take_over():
    model = make_model()
    for opt in (
        torch.optim.RMSprop(model.parameters(), momentum=0.9),
        torch.optim.AdamW(model.parameters(), maximize=True),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1),
    ):
        with pytest.raises(ValueError, match="momentum correction"):
            gz.momentum.Momentum.adopt(opt, list(model.named_parameters()))
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="does not hold parameters"):
        gz.momentum.Momentum.adopt(other, list(model.named_parameters()))


def _checkpoint(rank, world, steps, k):
    method = "TopK(ratio=Exponential(0.5, 0.05, steps=4, stages=3))"

    def fresh():
        model = make_model()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        return model, ddp, opt, register_hook(ddp, gz.parse(method), optimizer=opt, clip=1.0)

    def load(run, ck):
        model, _, opt, state = run
        model.load_state_dict(ck["m"])
        opt.load_state_dict(ck["o"])
        state.load_state_dict(ck["g"])

    out = support.resume_matches_unbroken(
        lambda seed: fresh(),
        lambda run, first, n: train(run[1], run[2], rank, first, first + n),
        lambda run: {"m": run[0].state_dict(), "o": run[2].state_dict(), "g": run[3].state_dict()},
        load,
        k,
        steps,
    )
    return out["unbroken"], out["resumed"]


def test_momentum_and_schedule_resume_bit_identically():
    for unbroken, resumed in run_ranks(_checkpoint, 2, 7, 3):
        assert all(torch.equal(a, b) for a, b in zip(unbroken, resumed))


def test_schedules_follow_the_step_and_check_their_ends():
    sched = gz.warmup.Exponential(0.25, 0.001, steps=400, stages=5)
    assert [sched(s) for s in (0, 99)] == [0.25, 0.25]
    assert sched(100) == pytest.approx(0.25 * (0.004) ** 0.25) and sched(400) == pytest.approx(0.001)
    comp = gz.TopK(ratio=sched)
    x = torch.randn(1000)
    sent = [int((comp.decompress(comp.compress(x, TensorContext(step=s))) != 0).sum()) for s in (0, 150, 500)]
    assert sent == [250, math.ceil(1000 * sched(150)), 1]
    with pytest.raises(ValueError, match="ratio"):
        gz.TopK(ratio=gz.warmup.Linear(0.5, 2.0, steps=10))
    p = gz.PowerSGD(rank=gz.warmup.Linear(4, 1, steps=10))
    assert [p.rank_at(s) for s in (0, 5, 10, 99)] == [4, 2, 1, 1]


def test_local_clipping_scales_by_one_over_sqrt_n():
    eng_sd = run_ranks(_clipped, 4)
    for _, norm in eng_sd:
        assert norm == pytest.approx(2.0 / math.sqrt(4), rel=1e-6)


def _clipped(rank, world):
    eng = gz.Engine(gz.Identity(), clip=2.0)
    g = torch.full((100,), 10.0)  # norm 100, clipped to 2 / sqrt(4) on every rank
    f = eng.reduce(["w"], [g])
    eng.flush()
    eng.end_step()
    out = f.wait()
    return out, float(out.norm())


# -- lean frames -----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), data=st.data())
def test_packed_gaps_round_trip(n, data):
    k = data.draw(st.integers(0, min(n, 300)))
    idx = torch.tensor(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=k, max_size=k))), dtype=torch.int64)
    signs = torch.tensor(data.draw(st.lists(st.integers(0, 1), min_size=k, max_size=k)), dtype=torch.int64)
    vals = torch.randn(k)
    body = torch.cat([pack_gaps(idx, signs, extra_bits=1), vals.view(torch.uint8)])
    got, extra, rest = unpack_gaps(body, n, 4, extra_bits=1)
    assert torch.equal(got, idx) and torch.equal(extra, signs) and torch.equal(rest.clone().view(torch.float32), vals)
    if k:
        with pytest.raises(ValueError, match="corrupt"):
            unpack_gaps(body[:-1], n, 4, extra_bits=1)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_sparse_frames_round_trip_in_messages(data):
    """Frames of every sparse codec, packed into one message with others, decode to what each
    codec sent, whatever the sizes, densities and value dtypes."""
    codecs = [
        gz.TopK(0.01),
        gz.TopK(0.3),
        gz.TopK(0.05, values="bf16"),
        gz.Threshold(tau=1.5),
        gz.Threshold(tau=0.1),
        gz.SignSGD(block=7),
        gz.QSGD(levels=3, block=5),
    ]
    picks = data.draw(st.lists(st.sampled_from(range(len(codecs))), min_size=1, max_size=6))
    xs = [
        torch.randn(data.draw(st.integers(0, 700)), generator=torch.Generator().manual_seed(i))
        for i in range(len(picks))
    ]
    pays = [codecs[c].compress(x, TensorContext(name=f"t{i}")) for i, (c, x) in enumerate(zip(picks, xs))]
    msg = wire.pack_frames(pays)
    assert msg.numel() == wire.message_nbytes(pays)
    got = wire.unpack_frames(
        torch.cat([msg, torch.zeros(5, dtype=torch.uint8)]), [p.shape for p in pays], [p.dtype for p in pays]
    )
    for c, p, q in zip(picks, pays, got):
        assert torch.equal(codecs[c].decompress(p), codecs[c].decompress(q))


def _momentum_states(rank, world, steps, loaded):
    """Train with momentum correction, or load a (resharded) state, and return the hook's state."""
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = register_hook(ddp, gz.TopK(0.1), optimizer=opt)
    if loaded is not None:
        state.load_state_dict(loaded[rank])
        return state.state_dict()
    train(ddp, opt, rank, 0, steps)
    return state.state_dict()


def test_reshard_averages_the_momentum_buffers():
    """4 ranks' momentum buffers become their mean on each of 2 new ranks, which load it."""
    from gradzip.checkpoint import reshard

    old = run_ranks(_momentum_states, 4, 3, None)
    assert old[0]["momentum"] and not all(
        torch.equal(old[0]["momentum"][k], old[1]["momentum"][k]) for k in old[0]["momentum"]
    )  # the velocities are per rank
    new = reshard(old, 2)
    for k, like in old[0]["momentum"].items():
        mean = (sum(s["momentum"][k].to(torch.float64) for s in old) / 4).to(like.dtype)
        assert all(torch.equal(s["momentum"][k], mean) for s in new)
    loaded = run_ranks(_momentum_states, 2, 0, new)
    for s, n in zip(loaded, new):
        assert s["momentum"].keys() == n["momentum"].keys()
        assert all(torch.equal(s["momentum"][k], n["momentum"][k]) for k in n["momentum"])
    bad = [dict(s) for s in old]
    bad[1]["momentum"] = {}
    with pytest.raises(ValueError, match="momentum buffers"):
        reshard(bad, 2)


# -- Adam's two moments before compression (precondition=True) ----------------------------------


def _precond(rank, world, steps, kind, lr=0.01, wd=0.01, codec="SignSGD", resume_at=None):
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam

    def fresh():
        model = make_model()
        ddp = DDP(model)
        opt = cls(ddp.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=wd)
        state = register_hook(ddp, gz.parse(codec), optimizer=opt, precondition=True)
        return model, ddp, opt, state

    model, ddp, opt, state = fresh()
    train(ddp, opt, rank, 0, steps if resume_at is None else resume_at)
    assert not opt.state  # the optimizer keeps no moments of its own
    if resume_at is not None:
        model, ddp, opt, state = reload(fresh, model, opt, state)
        train(ddp, opt, rank, resume_at, steps)
    return [p.detach().clone() for p in model.parameters()], state.state_dict()


def precond_reference(world, steps, kind, lr=0.01, wd=0.01, b1=0.9, b2=0.99, eps=1e-8):
    """Worker-side Adam written out: per rank g (+ wd p for Adam's L2 term), u = b1 u + (1 - b1) g,
    v = b2 v + (1 - b2) g^2, x = u / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + r, sent = mean|x| sign(x)
    (0 as +), r = x - sent; every rank applies the mean of what was sent: AdamW p *= 1 - lr wd, then
    p -= lr mean."""
    model = make_model()
    params = list(model.parameters())
    u = [[None] * len(params) for _ in range(world)]
    v = [[None] * len(params) for _ in range(world)]
    r = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    for s in range(steps):
        t = s + 1
        acc = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            model.zero_grad()
            x, y = batch(s, rank)
            F.cross_entropy(model(x), y).backward()
            for i, p in enumerate(params):
                g = p.grad.clone() if kind == "adamw" else p.grad + wd * p.detach()
                u[rank][i] = g * (1 - b1) if u[rank][i] is None else u[rank][i] * b1 + g * (1 - b1)
                v[rank][i] = g * g * (1 - b2) if v[rank][i] is None else v[rank][i] * b2 + g * g * (1 - b2)
                step = (u[rank][i] / (1 - b1**t)) / ((v[rank][i] / (1 - b2**t)).sqrt() + eps)
                xx = step + r[rank][i]
                sent = xx.abs().mean() * torch.where(xx >= 0, 1.0, -1.0)
                r[rank][i] = xx - sent
                acc[i] += sent
        with torch.no_grad():
            for p, a in zip(params, acc):
                if kind == "adamw":
                    p.mul_(1 - lr * wd)
                p.sub_(lr * a / world)
    return [p.detach().clone() for p in params], u, v


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_adam_precondition_equals_worker_side_adam_written_out(kind):
    res = run_ranks(_precond, 2, 5, kind)
    want, u, v = precond_reference(2, 5, kind)
    names = [n for n, _ in make_model().named_parameters()]
    for rank, (got, sd) in enumerate(res):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for i, n in enumerate(names):
            torch.testing.assert_close(sd["momentum"][f"{n}:momentum"], u[rank][i])
            torch.testing.assert_close(sd["momentum"][f"{n}:variance"], v[rank][i])
            assert sd["momentum"][f"{n}:adam_step"].tolist() == [5.0]
    assert not torch.equal(res[0][1]["momentum"][f"{names[0]}:variance"], res[1][1]["momentum"][f"{names[0]}:variance"])


def test_adam_precondition_on_one_rank_is_adamw():
    """One rank, no compression: the hook's Adam step applied plainly is torch's AdamW."""
    got, _ = run_ranks(_precond, 1, 6, "adamw", 0.01, 0.01, "Identity")[0]
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=0.01)
    train(model, opt, 0, 0, 6)
    for a, b in zip(got, model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-7)


def test_adam_precondition_resumes_bit_identically():
    unbroken = run_ranks(_precond, 2, 7, "adamw")
    resumed = run_ranks(_precond, 2, 7, "adamw", 0.01, 0.01, "SignSGD", 3)
    for (want, sd_want), (got, sd_got) in zip(unbroken, resumed):
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert all(torch.equal(sd_want["momentum"][k], sd_got["momentum"][k]) for k in sd_want["momentum"])


def test_adam_precondition_adopts_the_moments_and_refuses_what_it_cannot_mirror():
    model = make_model()
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 0, 0, 3)
    held = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    mom, buffers = gz.momentum.Momentum.adopt(opt, named, precondition=True)
    for n, p in named:
        assert torch.equal(buffers[f"{n}:variance"], held[p]["exp_avg_sq"])
        assert torch.equal(buffers[f"{n}:momentum"], held[p]["exp_avg"])
        assert buffers[f"{n}:adam_step"].tolist() == [3.0]
    assert not opt.state and mom.takeover is not None
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    mom.takeover.remove()
    for bad, match in (
        (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "second moment"),
        (torch.optim.AdamW(model.parameters(), amsgrad=True), "amsgrad"),
    ):
        with pytest.raises(ValueError, match=match):
            gz.momentum.Momentum.adopt(bad, named, precondition=True)
    with pytest.raises(ValueError, match="needs the Adam or AdamW"):
        register_hook(DDP.__new__(DDP), gz.SignSGD(), precondition=True)


def _precond_optimizer(rank, world, steps):
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=0.01)
    opt = gz.DistributedOptimizer(
        inner,
        named_parameters=model.named_parameters(),
        compression=gz.SignSGD(),
        momentum_correction=True,
        precondition=True,
    )
    train(model, opt, rank, 0, steps)
    return [p.detach().clone() for p in model.parameters()]


def test_distributed_optimizer_preconditions_alike():
    want, _, _ = precond_reference(2, 4, "adamw")
    for got in run_ranks(_precond_optimizer, 2, 4):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="momentum_correction=True"):
        gz.DistributedOptimizer(
            torch.optim.AdamW(make_model().parameters()), compression=gz.SignSGD(), precondition=True
        )


def _rescaled_between(rank, world):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    register_hook(ddp, gz.SignSGD(), optimizer=opt, precondition=True)
    x, y = batch(0, rank)
    F.cross_entropy(ddp(x), y).backward()
    opt.step()  # untouched: fine
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    for p in model.parameters():
        p.grad.div_(1024.0)  # what GradScaler.unscale_ does
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except ValueError as exc:
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert all(p.grad is not None for p in model.parameters())
        return str(exc)
    return None


def test_adam_precondition_refuses_steps_rescaled_after_the_hook():
    for msg in run_ranks(_rescaled_between, 2):
        assert msg is not None and "p.grad changed between the gradzip hook and optimizer.step()" in msg
    with pytest.raises(ValueError, match="op='sum'"):
        gz.DistributedOptimizer(
            torch.optim.AdamW(make_model().parameters()),
            compression=gz.SignSGD(),
            momentum_correction=True,
            precondition=True,
            op="sum",
        )


# -- the sign of the average (update="sign") -----------------------------------------------------


def _signed(rank, world, steps, lr=0.01, wd=0.05, codec="DCT(TopK(0.1))", resume_at=None, sgd=False):
    def fresh():
        model = make_model()
        ddp = DDP(model)
        if sgd:
            opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
        else:
            opt = torch.optim.AdamW(ddp.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=wd)
        state = register_hook(ddp, gz.parse(codec), optimizer=opt, update="sign")
        return model, ddp, opt, state

    model, ddp, opt, state = fresh()
    train(ddp, opt, rank, 0, steps if resume_at is None else resume_at)
    assert not opt.state  # the optimizer keeps no state: the hook holds the momentum, the step is its own
    if resume_at is not None:
        model, ddp, opt, state = reload(fresh, model, opt, state)
        train(ddp, opt, rank, resume_at, steps)
    return [p.detach().clone() for p in model.parameters()], state.state_dict()


def signed_reference(world, steps, codec, lr=0.01, wd=0.05, b1=0.9, sgd=False):
    """Signum on the average, written out: per rank u = b1 u + (1 - b1) g (SGD: u = m u + g + wd p),
    x = u + r, sent = C(x), r = x - sent; every rank applies AdamW's p *= 1 - lr wd (not SGD's: its
    decay is in g), then p -= lr sign(mean of sent)."""
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    u = [[None] * len(params) for _ in range(world)]
    r = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    for s in range(steps):
        acc = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            model.zero_grad()
            x, y = batch(s, rank)
            F.cross_entropy(model(x), y).backward()
            for i, p in enumerate(params):
                g = p.grad.clone()
                if sgd:
                    g = g + wd * p.detach()
                    u[rank][i] = g if u[rank][i] is None else u[rank][i] * b1 + g
                else:
                    u[rank][i] = g * (1 - b1) if u[rank][i] is None else u[rank][i] * b1 + g * (1 - b1)
                xx = u[rank][i] + r[rank][i]
                ctx = TensorContext(name=names[i], step=s, dtype=p.dtype, rank=rank, world_size=world)
                sent = codec.decompress(codec.compress(xx, ctx))
                r[rank][i] = xx - sent
                acc[i] += sent
        with torch.no_grad():
            for p, a in zip(params, acc):
                if not sgd:
                    p.mul_(1 - lr * wd)
                p.sub_(lr * torch.sign(a / world))
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("sgd", [False, True], ids=["adamw", "sgd"])
def test_sign_update_equals_signum_on_the_average_written_out(sgd):
    res = run_ranks(_signed, 2, 4, 0.01, 0.05, "DCT(TopK(0.1))", None, sgd)
    want = signed_reference(2, 4, gz.parse("DCT(TopK(0.1))"), sgd=sgd)
    for got, _ in res:
        for a, b in zip(got, want):
            # a parameter whose average is 0 to rounding may take another sign: allow one step
            assert float((a - b).abs().max()) <= 2 * 0.01 + 1e-6
            assert float((a - b).abs().gt(1e-5).float().mean()) < 0.01
    assert all(torch.equal(a, b) for a, b in zip(res[0][0], res[1][0]))  # replicas agree


def test_sign_update_resumes_bit_identically():
    unbroken = run_ranks(_signed, 2, 6)
    resumed = run_ranks(_signed, 2, 6, 0.01, 0.05, "DCT(TopK(0.1))", 3)
    for (want, sd_want), (got, sd_got) in zip(unbroken, resumed):
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert all(torch.equal(sd_want["residuals"][k], sd_got["residuals"][k]) for k in sd_want["residuals"])


def test_sign_update_refusals():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="give one"):
        gz.momentum.Momentum.adopt(opt, list(model.named_parameters()), precondition=True, update="sign")
    with pytest.raises(ValueError, match="update must be one of"):
        gz.momentum.Momentum.adopt(opt, list(model.named_parameters()), update="adam")
    with pytest.raises(ValueError, match="give the optimizer"):
        register_hook(DDP.__new__(DDP), gz.SignSGD(), update="sign")


def _modes(rank, world):
    """A state saved in each momentum-correction mode, loaded into a hook of each mode."""
    out = {}
    kws = {"momentum": {}, "precondition": {"precondition": True}, "sign": {"update": "sign"}}

    def hook(kw):
        ddp = DDP(make_model())
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        return ddp, opt, register_hook(ddp, gz.SignSGD(), optimizer=opt, **kw)

    for saved, kw in kws.items():
        ddp, opt, state = hook(kw)
        train(ddp, opt, rank, 0, 2)
        sd = state.state_dict()
        assert sd["momentum_mode"] == saved
        for now, kw2 in kws.items():
            try:
                hook(kw2)[2].load_state_dict(sd)
                out[saved, now] = "loaded"
            except ValueError as err:
                out[saved, now] = str(err)
    return out


def test_a_state_loads_only_into_its_own_momentum_correction_mode():
    """precondition=True keeps Adam's both moments and its step count, update='sign' the sign
    step's momentum: a state of one mode loaded into a hook of another would leave buffers missing
    or over, so it is refused, naming both."""
    for got in run_ranks(_modes, 2):
        for (saved, now), what in got.items():
            if saved == now:
                assert what == "loaded"
            else:
                assert what.startswith("momentum correction differs from the checkpoint"), (saved, now, what)
    assert (
        "saved precondition=True" in got["precondition", "momentum"] and "now update='sign'" in got["momentum", "sign"]
    )
