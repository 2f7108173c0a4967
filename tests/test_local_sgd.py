"""LocalSGD and its schedules. The multi-rank checks share one 2-rank spawn."""
import io
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip import bench
from gradzip.local_sgd import LocalSGD
from gradzip.schedules import Constant, Increasing, PostLocal, as_schedule, sync_steps

from .mp_utils import run_ranks


# --------------------------------------------------------------------------------------
# Schedules: which steps sync.
def test_constant():
    assert sync_steps(Constant(3), 10) == [3, 6, 9]
    assert sync_steps(Constant(1), 4) == [1, 2, 3, 4]


def test_post_local_is_synchronous_during_warmup():
    assert sync_steps(PostLocal(4, 3), 14) == [1, 2, 3, 4, 7, 10, 13]
    assert sync_steps(PostLocal(0, 5), 12) == [5, 10]


def test_increasing():
    assert sync_steps(Increasing(2, 2, 10, 8), 40) == [2, 4, 6, 8, 10, 14, 18, 22, 30, 38]
    assert sync_steps(Increasing(3, 1, 5, 10), 13) == [3, 6, 9, 12]  # factor 1: constant


def _increasing_reference(period, factor, every, max_period, n):
    out, s = [], 0
    while True:
        s += min(max_period, int(period * factor ** (s // every)))
        if s > n:
            return out
        out.append(s)


@pytest.mark.parametrize(
    "args", [(1, 2, 4, 16), (2, 1.5, 7, 20), (5, 3, 1, 100), (1, 1.1, 3, 9), (4, 2, 100, 4), (3, 2, 2, 1000)]
)
def test_increasing_matches_the_definition(args):
    sched = Increasing(*args)
    assert sync_steps(sched, 400) == _increasing_reference(*args, 400)
    # Queries in any order give the same answers (the schedule caches segments).
    fresh = Increasing(*args)
    assert [t for t in range(400, 0, -1) if fresh(t)][::-1] == _increasing_reference(*args, 400)


def test_callables_and_ints():
    assert sync_steps(as_schedule("period", 4), 9) == [4, 8]
    f = as_schedule("period", lambda t: t in (2, 5))
    assert sync_steps(f, 9) == [2, 5]


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Constant(0), r"period must be an integer in \[1, inf\)"),
        (lambda: Constant(2.0), "period must be an integer"),
        (lambda: PostLocal(-1, 2), r"warmup_steps must be an integer in \[0, inf\)"),
        (lambda: Increasing(2, 0.5, 10, 8), r"factor must be a finite number in \[1, inf\)"),
        (lambda: Increasing(2, 2, 0, 8), r"every must be an integer in \[1, inf\)"),
        (lambda: Increasing(4, 2, 10, 2), r"max_period must be an integer in \[4, inf\)"),
        (lambda: as_schedule("push_every", 0), "push_every must be an integer in"),
        (lambda: as_schedule("pull_every", "often"), "pull_every must be"),
    ],
)
def test_bad_schedules_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_local_sgd_arguments():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="period must be"):
        LocalSGD(opt, model, period=0)
    with pytest.raises(ValueError, match="overlap must be True or False"):
        LocalSGD(opt, model, overlap=1)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        LocalSGD(opt, "model")


# --------------------------------------------------------------------------------------
# Multi-rank.
def make_model(seed=0, bn=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(20, 32)]
    if bn:
        layers.append(torch.nn.BatchNorm1d(32))
    layers += [torch.nn.ReLU(), torch.nn.Linear(32, 5)]
    return torch.nn.Sequential(*layers)


def batch(step, rank, n=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g)


def local_step(model, opt, s, rank):
    x, y = batch(s, rank)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def tensors(model):
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]


def max_diff(xs, ys):
    return max((a - b).abs().max().item() for a, b in zip(xs, ys))


def _h1_vs_synchronous(rank, world):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(10):
        local_step(ddp, opt, s, rank)
    sync = tensors(model)
    model = make_model()
    opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, period=1)
    for s in range(10):
        local_step(model, opt, s, rank)
    return {"sync": sync, "local": tensors(model), "moved": max_diff(sync, tensors(make_model()))}


def _plain_reference(rank, world, H, steps):
    """Periodic averaging of deltas, written out with dist.all_reduce: a += mean(x - a); x = a."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    anchor = tensors(model)
    for s in range(steps):
        local_step(model, opt, s, rank)
        if (s + 1) % H == 0:
            with torch.no_grad():
                flat = torch.cat([(p - a).reshape(-1) for p, a in zip(model.parameters(), anchor)])
                flat.div_(world)
                dist.all_reduce(flat)
                pos = 0
                for p, a in zip(model.parameters(), anchor):
                    a.add_(flat[pos : pos + p.numel()].view_as(p))
                    pos += p.numel()
                    p.copy_(a)
    return tensors(model)


def _overlap_reference(rank, world, H, steps):
    """The overlap rule in its textbook form: at sync k, x += D_{k-1} - d_{k-1}; then d_k = x - a_k."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    anchor = tensors(model)
    pending = None
    for s in range(steps):
        local_step(model, opt, s, rank)
        if (s + 1) % H == 0:
            with torch.no_grad():
                if pending is not None:
                    D, d = pending
                    for p, a, Di, di in zip(model.parameters(), anchor, D, d):
                        p.add_(Di - di)
                        a.add_(Di)
                d = [p - a for p, a in zip(model.parameters(), anchor)]
                flat = torch.cat([x.reshape(-1) for x in d]).div_(world)
                dist.all_reduce(flat)
                D = list(torch.split(flat, [x.numel() for x in d]))
                D = [Di.view_as(x) for Di, x in zip(D, d)]
                pending = (D, d)
    return tensors(model)


def run_local(rank, steps, **kw):
    model = make_model()
    opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, **kw)
    for s in range(steps):
        local_step(model, opt, s, rank)
    return model, opt


def _against_references(rank, world):
    out = {"plain_ref": _plain_reference(rank, world, 4, 16)}
    out["push_pull_4"] = tensors(run_local(rank, 16, push_every=Constant(4), pull_every=4)[0])
    out["period_4"] = tensors(run_local(rank, 16, period=4)[0])
    out["overlap_ref"] = _overlap_reference(rank, world, 3, 15)
    out["overlap"] = tensors(run_local(rank, 15, period=3, overlap=True)[0])
    model, opt = run_local(rank, 13, push_every=2, pull_every=3, overlap=True)
    out["asym_overlap_in_flight"] = opt.in_flight
    opt.synchronize()
    out["asym_overlap_synced"] = tensors(model)
    return out


class PullProbe(LocalSGD):
    """LocalSGD that keeps the local model as it was just before each pull."""

    def _pull(self):
        self.before_pull = [p.detach().clone() for p in self.model.parameters()]
        return super()._pull()


def _asymmetric(rank, world):
    """push every 3, pull every 5 (no overlap), with the documented invariants checked per step."""
    model = make_model()
    opt = PullProbe(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, push_every=3, pull_every=5)
    log, at_push = [], None
    for s in range(15):
        coll_before = opt.stats()["collectives"]
        local_step(model, opt, s, rank)
        t = s + 1
        entry = {"t": t, "collectives": opt.stats()["collectives"] - coll_before}
        params = [p.detach().clone() for p in model.parameters()]
        G = [opt._global[n].clone() for n, _ in model.named_parameters()]
        if t % 3 == 0:
            # After a push, G is the mean of the local models at that push.
            mean = torch.cat([p.reshape(-1) for p in params]).div(world)
            dist.all_reduce(mean)
            entry["G_minus_mean"] = (torch.cat([g.reshape(-1) for g in G]) - mean).abs().max().item()
        elif t % 5 == 0:
            # A pull without a push: x = G + (x_before_pull - x_at_last_push), i.e. adopt the
            # global model and keep the own progress that was not pushed yet.
            entry["pull_error"] = max_diff(params, [g + (b - a) for g, b, a in zip(G, opt.before_pull, at_push)])
        if t % 3 == 0:
            at_push = params
        entry["params"] = params
        log.append(entry)
    return log


class Recording(LocalSGD):
    """LocalSGD that logs when pushes issue their payload collective and when averages are collected."""

    def __init__(self, *a, events, **kw):
        super().__init__(*a, **kw)
        self.events = events
        comm = self.engine.comm
        real = comm.allreduce

        def allreduce(t, *args, **kwargs):
            if t.numel() > 1:  # the payload, not the one-element flags
                self.events.append(("issued", self.local_step))
            return real(t, *args, **kwargs)

        comm.allreduce = allreduce

    def average_arrived(self) -> bool:
        """Whether the in-flight average is complete, without waiting for it."""
        return all(f.done() for f in self._inflight["futures"])

    def _collect(self):
        if self._inflight is not None:
            done = self._inflight["futures"] is None or self.average_arrived()
            self.events.append(("collect", self.local_step, done))
        super()._collect()


def _overlap_events(rank, world):
    out = {}
    for overlap in (True, False):
        events = []
        model = make_model()
        opt = Recording(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, period=4, overlap=overlap, events=events
        )
        for s in range(32):
            t = s + 1
            if overlap and t % 4 == 2 and opt.in_flight:
                # Two local steps after a push, the loop checks (never waits through LocalSGD) until the
                # average has arrived on its own: the collective progresses while training goes on.
                deadline = time.monotonic() + 60
                while not opt.average_arrived() and time.monotonic() < deadline:
                    time.sleep(0.001)
                events.append(("arrived", opt.local_step, opt.average_arrived()))
            events.append(("compute", t))
            local_step(model, opt, s, rank)
        opt.synchronize()
        out[overlap] = {"events": list(events), "final": tensors(model)}
    return out


def _schedules_in_use(rank, world):
    out = {}
    for label, sched in {
        "callable": lambda t: t in (2, 3, 7),
        "post_local": PostLocal(3, 4),
        "increasing": Increasing(1, 2, 4, 4),
    }.items():
        model = make_model()
        opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, period=sched)
        synced = []
        for s in range(14):
            before = opt.stats()["syncs"]
            local_step(model, opt, s, rank)
            if opt.stats()["syncs"] > before:
                synced.append(s + 1)
        out[label] = synced
    return out


def _checkpoint(rank, world, k):
    def build(seed):
        model = make_model(seed, bn=True)
        opt = LocalSGD(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model,
            period=3,
            compression=gz.TopK(ratio=0.1),
            overlap=True,
        )
        return model, opt

    model, opt = build(0)
    for s in range(2 * k):
        local_step(model, opt, s, rank)
    unbroken = tensors(model)

    model, opt = build(0)
    for s in range(k):
        local_step(model, opt, s, rank)
    in_flight = opt.in_flight
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    del model, opt

    model, opt = build(123)
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    for s in range(k, 2 * k):
        local_step(model, opt, s, rank)
    return {
        "unbroken": unbroken,
        "resumed": tensors(model),
        "in_flight": in_flight,
        "names": sorted(ckpt["opt"]["local_sgd"]["global"]),
        "residuals": len(ckpt["opt"]["gradzip"]["residuals"]),
    }


def _digits(rank, world):
    cfg = bench.BenchConfig(dataset="digits", workers=world, epochs=20)
    data = bench.load_dataset("digits", cfg.seed)
    xtr, ytr, xte, yte = data
    out = {"ddp": bench.train_one(rank, world, None, cfg, data)["accuracy"]}
    shard_x, shard_y = xtr[rank::world], ytr[rank::world]
    n = min(len(shard_x) - len(shard_x) % cfg.batch_size, (len(xtr) // world) // cfg.batch_size * cfg.batch_size)
    for label, kw in {"H1": {"period": 1}, "H8": {"period": 8}, "H8_overlap": {"period": 8, "overlap": True}}.items():
        model = bench.make_mlp(xtr.shape[1], cfg.hidden, int(ytr.max()) + 1, cfg.seed)
        opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum), model, **kw)
        g = torch.Generator().manual_seed(cfg.seed)  # bench.train_one's data order
        for _ in range(cfg.epochs):
            order = torch.randperm(len(shard_x), generator=g)[:n]
            for i in range(0, n, cfg.batch_size):
                b = order[i : i + cfg.batch_size]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(shard_x[b]), shard_y[b]).backward()
                opt.step()
        opt.synchronize()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        out[label] = {"accuracy": acc, "stats": opt.stats()}
    return out


def _two_ranks(rank, world):
    return {
        "h1": _h1_vs_synchronous(rank, world),
        "refs": _against_references(rank, world),
        "asym": _asymmetric(rank, world),
        "events": _overlap_events(rank, world),
        "schedules": _schedules_in_use(rank, world),
        "checkpoint": _checkpoint(rank, world, 7),
        "digits": _digits(rank, world),
    }


@pytest.fixture(scope="module")
def two():
    return run_ranks(_two_ranks, 2, timeout=300)


def test_h1_plain_sgd_equals_synchronous_data_parallel(two):
    """H=1 with plain SGD is synchronous SGD, up to float rounding.

    DDP applies x - lr * mean(g); LocalSGD applies a + mean((a - lr * g_r) - a),
    whose subtraction rounds once more, so the two agree to ~1e-8, not bit for bit.
    """
    for r in two:
        res = r["h1"]
        assert res["moved"] > 1e-2
        assert max_diff(res["sync"], res["local"]) < 1e-6


def test_push_equal_pull_reduces_to_plain_periodic_averaging(two):
    for r in two:
        refs = r["refs"]
        for a, b, c in zip(refs["plain_ref"], refs["push_pull_4"], refs["period_4"]):
            assert torch.equal(a, b) and torch.equal(a, c)
    for a, b in zip(two[0]["refs"]["push_pull_4"], two[1]["refs"]["push_pull_4"]):
        assert torch.equal(a, b)  # step 16 is a sync: the replicas agree


def test_overlap_applies_the_previous_average_one_period_late(two):
    for r in two:
        refs = r["refs"]
        assert max_diff(refs["overlap_ref"], refs["overlap"]) < 1e-6
        assert max_diff(refs["overlap"], refs["period_4"]) > 1e-3  # it is not the plain rule


def test_asymmetric_push_and_pull_with_overlap_drains_to_identical_replicas(two):
    assert two[0]["refs"]["asym_overlap_in_flight"]
    for a, b in zip(two[0]["refs"]["asym_overlap_synced"], two[1]["refs"]["asym_overlap_synced"]):
        assert torch.equal(a, b)


def test_asymmetric_push_and_pull(two):
    for r in two:
        log = r["asym"]
        for e in log:
            pushed, pulled_only = e["t"] % 3 == 0, e["t"] % 5 == 0 and e["t"] % 3 != 0
            # Only pushes communicate; pulls are local.
            assert (e["collectives"] > 0) == pushed, e["t"]
            if pushed:
                assert e["G_minus_mean"] < 1e-6, e
            if pulled_only:
                assert e["pull_error"] < 1e-6, e
    # Step 15 pushes and pulls: every rank holds G.
    for a, b in zip(two[0]["asym"][-1]["params"], two[1]["asym"][-1]["params"]):
        assert torch.equal(a, b)
    # Step 5 pulled without pushing: the ranks still differ (their own unpushed progress).
    assert max_diff(two[0]["asym"][4]["params"], two[1]["asym"][4]["params"]) > 1e-4


def test_overlap_averages_while_the_next_local_steps_compute(two):
    for r in two:
        ev = r["events"][True]["events"]
        issued = [e[1] for e in ev if e[0] == "issued"]
        collects = [e[1] for e in ev if e[0] == "collect"]
        assert issued == [4, 8, 12, 16, 20, 24, 28, 32, 32]  # eight pushes, then synchronize()'s
        # The average of the push at step t is collected at the next push, t + 4 ...
        assert collects == [8, 12, 16, 20, 24, 28, 32, 32, 32]
        for t in range(4, 32, 4):
            i_issue = ev.index(("issued", t))
            i_collect = next(i for i, e in enumerate(ev) if e[0] == "collect" and e[1] == t + 4)
            window = ev[i_issue:i_collect]
            # ... after the local steps t+1 .. t+4 computed while it was in flight,
            assert [e[1] for e in window if e[0] == "compute"] == [t + 1, t + 2, t + 3, t + 4]
            # and it arrived in the middle of them, without anyone waiting for it.
            assert [e[0] for e in window] == ["issued", "compute", "arrived", "compute", "compute", "compute"]
            assert ("arrived", t + 1, True) in window
            assert ev[i_collect][2] is True  # complete when collected: collecting did not wait
        # Without overlap the average is collected at once, before any further compute.
        ev = r["events"][False]["events"]
        assert [e[1] for e in ev if e[0] == "issued"] == list(range(4, 33, 4))
        for t in range(4, 33, 4):
            i_issue = ev.index(("issued", t))
            nxt = next(e for e in ev[i_issue:] if e[0] in ("collect", "compute"))
            assert nxt[0] == "collect" and nxt[1] == t
    # Both drain to identical replicas.
    for overlap in (True, False):
        for a, b in zip(two[0]["events"][overlap]["final"], two[1]["events"][overlap]["final"]):
            assert torch.equal(a, b)


def test_schedules_decide_which_steps_sync(two):
    for r in two:
        s = r["schedules"]
        assert s["callable"] == [2, 3, 7]
        assert s["post_local"] == sync_steps(PostLocal(3, 4), 14) == [1, 2, 3, 7, 11]
        assert s["increasing"] == sync_steps(Increasing(1, 2, 4, 4), 14) == [1, 2, 3, 4, 6, 8, 12]


def test_checkpoint_resume_reproduces_an_unbroken_run(two):
    for r in two:
        c = r["checkpoint"]
        assert c["in_flight"]  # the checkpoint fell between a push and its collect
        assert "1.running_mean" in c["names"] and "1.num_batches_tracked" not in c["names"]
        assert c["residuals"] == len(c["names"])
        for a, b in zip(c["unbroken"], c["resumed"]):
            assert torch.equal(a, b)


def test_h8_cuts_bytes_8x_and_stays_within_2pp_of_synchronous(two):
    d = two[0]["digits"]
    assert d["ddp"] > 0.95, d
    for label in ("H8", "H8_overlap"):
        assert d[label]["accuracy"] >= d["ddp"] - 0.02, (label, d[label]["accuracy"], d["ddp"])
    ratio = d["H1"]["stats"]["bytes_sent_per_step"] / d["H8"]["stats"]["bytes_sent_per_step"]
    assert 7.5 < ratio < 8.5, ratio
    steps = d["H8"]["stats"]["steps"]
    assert steps % 8 == 0 and d["H8"]["stats"]["syncs"] == steps // 8
    assert d["H8_overlap"]["stats"]["syncs"] == steps // 8 + 1  # + synchronize() draining the pipeline
