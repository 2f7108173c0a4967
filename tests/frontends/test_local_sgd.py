"""LocalSGD and its schedules. The multi-rank checks share one 2-rank spawn."""

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip import bench, registry
from gradzip.costmodel import CodecFit, CodecProfile, Link, step_cost
from gradzip.costmodel.periodic import periodic_step_cost
from gradzip.local_sgd import DILOCO_OUTER, DiLoCo, LocalSGD, reshard_state
from gradzip.schedules import Constant, Increasing, PostLocal, Streaming, as_schedule, split_fragments, sync_steps
from tests import support
from tests.support import batch, run_ranks


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
    return support.make_model(seed, widths=(32,), bn=bn)


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


def _resume(rank, build, k, total=None, extra=None, snapshot=None):
    """:func:`tests.support.resume_matches_unbroken` for a model and a local SGD optimizer:
    parameters and buffers compared (or ``snapshot(run)``); ``extra(run)`` records what the
    saving run held."""
    seen = {}

    def save(run):
        if extra is not None:
            seen.update(extra(run))
        return {"model": run[0].state_dict(), "opt": run[1].state_dict()}

    def load(run, ckpt):
        run[0].load_state_dict(ckpt["model"])
        run[1].load_state_dict(ckpt["opt"])

    def train(run, first, steps):
        for s in range(first, first + steps):
            local_step(run[0], run[1], s, rank)

    snapshot = snapshot or (lambda run: tensors(run[0]))
    out = support.resume_matches_unbroken(build, train, save, load, k, total, snapshot)
    return {**out, **seen}


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

    out = _resume(rank, build, k, extra=lambda run: {"in_flight": run[1].in_flight})
    ckpt = out.pop("ckpt")
    return {
        **out,
        "names": sorted(ckpt["opt"]["local_sgd"]["global"]),
        "residuals": len(ckpt["opt"]["gradzip"]["residuals"]),
    }


def _digits(rank, world):
    cfg = bench.BenchConfig(dataset="digits", workers=world, epochs=4)  # 88 steps, 11 syncs at H=8
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
        "diloco": _diloco_two(rank, world),
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
            checked = e["t"] == 1  # the first step checks that the replicas agree (one allreduce)
            # Only pushes communicate; pulls are local.
            assert (e["collectives"] > 0) == (pushed or checked), e["t"]
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
        # Eight pushes, then synchronize()'s. The first push (step 4) runs the engine's one-time
        # configuration check first; its later rounds, the payload among them, are deferred (gloo)
        # and go out in the next step() (after the local update of step 5), as every rank does.
        # (The first step's parameter check, one allreduce, is issued before its local update.)
        assert issued == [0, 5, 8, 12, 16, 20, 24, 28, 32, 32]
        assert ev[ev.index(("issued", 5)) - 1] == ("compute", 5)
        # The average of the push at step t is collected at the next push, t + 4 ...
        assert collects == [8, 12, 16, 20, 24, 28, 32, 32, 32]
        for t in range(8, 32, 4):
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
        assert [e[1] for e in ev if e[0] == "issued"] == [0, *range(4, 33, 4)]
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


# ======================================================================================
# DiLoCo: outer optimizer, streaming, state, worker groups, plan.
def test_streaming_schedule_spreads_fragments_evenly():
    for H, nf, tau in [(12, 3, 0), (12, 3, 1), (12, 3, 3), (8, 1, 5), (16, 4, 2)]:
        s = Streaming(H, nf, tau)
        h = H // nf
        synced = {t: s.synced(t) for t in range(1, 4 * H + 1) if s.synced(t) is not None}
        # One sync every h steps, round robin, so each fragment syncs once per period ...
        assert list(synced) == list(range(h, 4 * H + 1, h))
        assert list(synced.values()) == [k % nf for k in range(4 * nf)]
        for f in range(nf):
            assert [t for t, g in synced.items() if g == f] == [(f + 1) * h + k * H for k in range(4)]
        # ... prepared tau steps before, and never two fragments in flight.
        for t in range(1, 4 * H + 1):
            assert s.prepared(t) == s.synced(t + tau)
        preps = [t for t in range(1, 4 * H + 1) if s.prepared(t) is not None]
        events = sorted([(t, 1, "sync") for t in synced] + [(t, 0, "prep") for t in preps])
        kinds = [e[2] for e in events]
        assert kinds == ["prep", "sync"] * (4 * nf), (H, nf, tau)
        assert sync_steps(s, 2 * H) == list(range(h, 2 * H + 1, h))
    assert sync_steps(Streaming(5), 12) == sync_steps(Constant(5), 12)


def _covers_in_order(runs, sizes):
    """The pieces, fragment after fragment, tile every tensor's bytes in order; no fragment is empty."""
    flat = [p for r in runs for p in r]
    assert all(any(b > a for _, a, b in r) for r in runs)
    at = {}
    for i, a, b in flat:
        assert at.get(i, 0) == a and a <= b <= sizes[i], (i, a, b)
        at[i] = b
    assert at == {i: b for i, b in enumerate(sizes)}
    assert [i for i, _, _ in flat] == sorted(i for i, _, _ in flat)


def test_split_fragments_cuts_equal_bytes_inside_tensors():
    g = torch.Generator().manual_seed(0)
    for nf in (2, 3, 4, 8):
        elems = [int(v) for v in torch.randint(0, 1000, (40,), generator=g)]
        item = [int(v) for v in torch.tensor([2, 4, 8])[torch.randint(0, 3, (40,), generator=g)]]
        sizes = [n * e for n, e in zip(elems, item)]
        runs = split_fragments(sizes, nf, granule=item)
        _covers_in_order(runs, sizes)
        for r in runs:
            assert all(a % item[i] == 0 and b % item[i] == 0 for i, a, b in r)  # never inside an element
        per = [sum(b - a for _, a, b in r) for r in runs]
        assert max(abs(p - sum(sizes) / nf) for p in per) <= max(item), (per, nf)  # equal to within an element
    # One tensor holding most of the model (92% of the MNIST CNN) is cut: nf equal runs.
    runs = split_fragments([4 * 100, 4 * 10_000, 4 * 10], 4, granule=[4, 4, 4])
    assert runs == [
        [(0, 0, 400), (1, 0, 9708)],
        [(1, 9708, 19820)],
        [(1, 19820, 29928)],
        [(1, 29928, 40000), (2, 0, 40)],
    ]
    assert [sum(b - a for _, a, b in r) for r in runs] == [10108, 10112, 10108, 10112]  # total / 4 = 10110
    # A tensor whose granule is its size (not contiguous) is never cut inside.
    assert split_fragments([400, 4000, 1000], 2, granule=[4, 4000, 4]) == [[(0, 0, 400), (1, 0, 4000)], [(2, 0, 1000)]]
    # Without granules, whole tensors (the cut at the nearest tensor boundary, the earlier on a tie).
    whole = lambda runs: [[i for i, _, _ in r] for r in runs]  # noqa: E731
    assert whole(split_fragments([1] * 10, 3)) == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert whole(split_fragments([100, 1, 1, 1, 100], 2)) == [[0, 1], [2, 3, 4]]
    assert whole(split_fragments([1, 1, 100], 3)) == [[0], [1], [2]]  # every fragment non-empty
    assert split_fragments([8, 0, 8], 2, granule=[4, 4, 4]) == [[(0, 0, 8)], [(1, 0, 0), (2, 0, 8)]]
    assert split_fragments([8, 8], 1) == [[(0, 0, 8), (1, 0, 8)]]
    with pytest.raises(ValueError, match="at most the number of tensors"):
        split_fragments([1, 2], 3)
    with pytest.raises(ValueError, match=r"at most the number of elements \(3\)"):
        split_fragments([8, 4], 4, granule=[4, 4])
    with pytest.raises(ValueError, match="does not divide"):
        split_fragments([10], 2, granule=[4])


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"fragments": 2, "overlap": True}, ValueError, "replace overlap"),
        ({"delay": 1, "push_every": 2}, ValueError, "replace overlap"),
        ({"fragments": 2, "period": PostLocal(2, 4)}, ValueError, "integer period"),
        ({"fragments": 3, "period": 8}, ValueError, "period must be a multiple of fragments"),
        ({"fragments": 2, "period": 8, "delay": 4}, ValueError, r"delay must be an integer in \[0, 3\]"),
        ({"alpha": 1.5, "period": 4}, ValueError, r"alpha must be a finite number in \[0, 1\]"),
        ({"fragments": 8, "period": 8}, ValueError, r"at most the number of elements \(6\)"),
        ({"outer": "sgd"}, TypeError, "outer must be None, an optimizer class or a factory"),
        ({"outer_kwargs": [0.7]}, TypeError, "outer_kwargs must be a dict"),
    ],
)
def test_bad_diloco_arguments(kw, err, match):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(err, match=match):
        LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, **kw)


def test_outer_must_be_a_factory_not_an_instance():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="not an optimizer instance"):
        DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, 4, outer=torch.optim.SGD(model.parameters(), lr=0.7))
    with pytest.raises(TypeError, match="period"):
        DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model)  # DiLoCo has no default period


def test_diloco_is_a_front_end_spec():
    m = gz.parse("DiLoCo(period=32, compression=Int8())")
    assert isinstance(m, registry.Spec) and m.cls is DiLoCo and m.kwargs == {"period": 32, "compression": gz.Int8()}
    methods = bench.parse_methods("DiLoCo(period=32, compression=Int8()), LocalSGD(period=8, outer_kwargs={'lr': 0.7})")
    assert methods["DiLoCo(period=32, compression=Int8())"].method.cls is DiLoCo
    assert DiLoCo.plan_terms(period=32, compression=gz.Int8(), fragments=4, delay=2) == {
        "compression": gz.Int8(),
        "period": 32,
        "fragments": 4,
        "delay": 2,
        "error_feedback": None,
    }
    assert LocalSGD.plan_terms(period=PostLocal(100, 8), overlap=True)["delay"] == 8  # overlap: a whole period
    with pytest.raises(ValueError, match="multiple of fragments"):
        DiLoCo.plan_terms(period=30, fragments=4)
    with pytest.raises(ValueError, match="long-run period"):
        LocalSGD.plan_terms(period=lambda t: t % 3 == 0)


def test_plan_costs_periodic_averaging_per_period_and_per_fragment():
    link = Link(1e8, 1e-4)
    layers = [(f"l{i}.weight", (64, 64)) for i in range(8)]
    prof = CodecProfile(machine={"cpu": "hand-made"}, measure_missing=False)
    prof.add(gz.Allreduce(gz.Identity()), CodecFit(1e-4, 1e-9), error_feedback=False)
    one = step_cost(gz.Identity(), layers, 4, link, 0.0, prof, bucket_cap_mb=100, first_bucket_mb=100)
    plain = periodic_step_cost(None, layers, 4, link, 0.05, prof, period=8)
    assert plain.bytes_per_rank == one.bytes_per_rank / 8 == 8 * 64 * 64 * 4 / 8
    assert plain.wire_s == pytest.approx(one.wire_s / 8) and plain.codec_s == pytest.approx(one.codec_s / 8)
    assert plain.total_s == pytest.approx(0.05 + plain.codec_s + plain.wire_s)
    stream = periodic_step_cost(None, layers, 4, link, 0.05, prof, period=8, fragments=4)
    assert stream.detail["sync_bytes"] == [2 * 64 * 64 * 4] * 4
    assert stream.detail["peak_bytes_per_step"] == plain.detail["peak_bytes_per_step"] / 4  # 1/F of the peak
    assert stream.bytes_per_rank == plain.bytes_per_rank  # the same bytes over a period
    hidden = periodic_step_cost(None, layers, 4, link, 0.05, prof, period=8, fragments=4, delay=1)
    assert hidden.wire_s == 0.0  # each fragment's sync travels behind one 50 ms step
    slow = periodic_step_cost(None, layers, 4, Link(1e6, 1e-4), 0.05, prof, period=8, fragments=4, delay=1)
    assert slow.wire_s == pytest.approx(sum(max(0.0, w - 0.05) for w in slow.detail["sync_wire_s"]) / 8)
    assert periodic_step_cost(None, layers, 1, link, 0.05, prof, period=8).total_s == 0.05


# -- multi-rank: 2 ranks (in the shared spawn) -----------------------------------------
def run_with(rank, steps, cls=LocalSGD, bn=False, seed=0, **kw):
    model = make_model(seed, bn=bn)
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, **kw)
    for s in range(steps):
        local_step(model, opt, s, rank)
    return model, opt


def _outer_reference(rank, world, H, steps, lr=0.7, m=0.9):
    """DiLoCo written out: every H steps Delta = mean(G - x) (dist.all_reduce), then Nesterov
    momentum on G: b <- m b + Delta (b = Delta at first), G <- G - lr (Delta + m b); x <- G."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    G = [p.detach().clone() for p in params]
    buf = [None] * len(params)
    for s in range(steps):
        local_step(model, opt, s, rank)
        if (s + 1) % H == 0:
            with torch.no_grad():
                flat = torch.cat([(p - g).reshape(-1) for p, g in zip(params, G)]).div_(world)
                dist.all_reduce(flat)
                D = [d.view_as(p) for d, p in zip(torch.split(flat, [p.numel() for p in params]), params)]
                for i, (p, g) in enumerate(zip(params, G)):
                    delta = D[i].neg()
                    if buf[i] is None:
                        buf[i] = delta.clone()
                    else:
                        buf[i].mul_(m).add_(delta)
                    g.add_(delta.add(buf[i], alpha=m), alpha=-lr)
                    p.copy_(g)
    return tensors(model)


def _streaming_reference(rank, world, H, F, steps, lr=0.7, m=0.9):
    """Streaming DiLoCo (delay 0, alpha 0, Identity) written out on the flat parameter vector in
    module order: fragment f is elements [c_f, c_f+1) with c_k the element nearest k*n/F (the earlier
    on a tie), synced at (f+1)H/F + kH: D = mean(x_f - G_f) (dist.all_reduce), Nesterov on G_f
    with the fragment's own momentum, x_f <- G_f."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())  # no buffers: module order is parameter order
    G = torch.cat([p.detach().reshape(-1) for p in params])
    n, h = G.numel(), H // F
    cuts = [0] + [math.ceil(k * n / F - 0.5) for k in range(1, F)] + [n]
    buf = [None] * F
    for s in range(steps):
        local_step(model, opt, s, rank)
        if (s + 1) % h:
            continue
        f = ((s + 1) // h - 1) % F
        a, b = cuts[f], cuts[f + 1]
        with torch.no_grad():
            x = torch.cat([p.detach().reshape(-1) for p in params])
            D = (x[a:b] - G[a:b]).div_(world)
            dist.all_reduce(D)
            delta = D.neg()
            buf[f] = delta.clone() if buf[f] is None else buf[f].mul_(m).add_(delta)
            G[a:b].add_(delta.add(buf[f], alpha=m), alpha=-lr)
            x[a:b] = G[a:b]
            pos = 0
            for p in params:
                p.copy_(x[pos : pos + p.numel()].view_as(p))
                pos += p.numel()
    return tensors(model)


def _fragment_bytes(rank, world):
    """bytes_link of every step of DiLoCo(period=8, fragments=4) with Identity, after its first period
    (whose first push also carries the engine's configuration check), and of DiLoCo(period=8)."""
    out = {}
    for nf in (1, 4):
        model = make_model()
        opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, period=8, fragments=nf)
        per_step = []
        for s in range(16):
            before = opt.stats()["bytes_link"]
            local_step(model, opt, s, rank)
            per_step.append(opt.stats()["bytes_link"] - before)
        out[nf] = per_step[8:]
    return out


class MassProbe(DiLoCo):
    """DiLoCo that sums, per tensor, the deltas it pushes and the averages it applies (float64)."""

    def _push(self, frag, collect_in):
        pieces = self._fragments[frag]
        for p, t in zip(pieces, self._views(pieces)):
            self.pushed[p.key] = self.pushed.get(p.key, 0) + (t - self._base[p.key]).double()
        super()._push(frag, collect_in)

    def _collect(self):
        if self._inflight is not None:
            for n, D in self._average().items():
                self.applied[n] = self.applied.get(n, 0) + D.double()
        super()._collect()


def _error_feedback_mass(rank, world):
    model = make_model()
    opt = MassProbe(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model,
        period=4,
        compression=gz.TopK(0.05),
        fragments=2,
        delay=1,
    )
    opt.pushed, opt.applied = {}, {}
    for s in range(24):
        local_step(model, opt, s, rank)
    assert not opt.in_flight
    return {"pushed": opt.pushed, "applied": opt.applied, "residuals": opt.state_dict()["gradzip"]["residuals"]}


class StreamRecording(DiLoCo):
    """DiLoCo that logs when the payload all-gather of a push goes out and when it is collected."""

    def __init__(self, *a, events, **kw):
        super().__init__(*a, **kw)
        self.events = events
        comm = self.engine.comm
        real = comm.allgather

        def allgather(out, inp, *args, control=False, **kwargs):
            if not control:  # the payload, not the configuration check
                self.events.append(("issued", self.local_step))
            return real(out, inp, *args, control=control, **kwargs)

        comm.allgather = allgather

    def arrived(self) -> bool:
        return self._inflight["futures"] is not None and all(f.done() for f in self._inflight["futures"])

    def _collect(self):
        if self._inflight is not None:
            done = self._inflight.get("avg") is not None or self.arrived()
            self.events.append(("collect", self.local_step, done))
        super()._collect()


def _streaming_events(rank, world):
    """H=8, 2 fragments, delay 3: fragment f is pushed at 4f+1 (+8k), synced at 4f+4."""
    events = []
    model = make_model()
    opt = StreamRecording(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model,
        8,
        gz.TopK(0.1, mode="sampled"),  # a size round first: the payload waits for the next step()'s flush
        fragments=2,
        delay=3,
        events=events,
    )
    for s in range(24):
        t = s + 1
        if t % 4 == 3 and opt.in_flight:
            # Two steps after a push: the payload went out in the last step(); the loop checks
            # (never waits through DiLoCo) until it has arrived on its own.
            deadline = time.monotonic() + 60
            while not opt.arrived() and time.monotonic() < deadline:
                time.sleep(0.001)
            events.append(("arrived", opt.local_step, opt.arrived()))
        events.append(("compute", t))
        local_step(model, opt, s, rank)
    return events


def _checkpoint_case(rank, k, n, bn, **kw):
    def build(seed):
        model = make_model(seed, bn=bn)
        return model, DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, **kw)

    def held(run):
        opt = run[1]
        return {"in_flight": opt.in_flight, "flushed": opt._inflight["flushed"] if opt.in_flight else None}

    def snapshot(run):
        model, opt = run
        return tensors(model) + [opt._global[key].clone() for key in opt._keys]

    out = _resume(rank, build, k, n, extra=held, snapshot=snapshot)
    ckpt = out.pop("ckpt")
    momentum = [v["momentum_buffer"] for v in ckpt["opt"]["local_sgd"]["outer"]["state"].values()]
    return {**out, "momentum": len(momentum)}


def _reshard(rank, world):
    kw = dict(period=4, compression=gz.TopK(0.1))
    model, opt = run_with(rank, 10, DiLoCo, **kw)
    opt.synchronize()
    states = [None] * world
    dist.all_gather_object(states, opt.state_dict())
    again = reshard_state(states, world)
    model2 = make_model(7)
    model2.load_state_dict(model.state_dict())
    opt2 = DiLoCo(torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9), model2, **kw)
    opt2.load_state_dict(again[rank])
    for s in range(10, 16):
        local_step(model2, opt2, s, rank)
    return {"states": states, "final": tensors(model2)}


def _diloco_two(rank, world):
    out = {"outer_ref": _outer_reference(rank, world, 4, 16)}
    out["diloco"] = tensors(run_with(rank, 16, DiLoCo, period=4)[0])
    out["diloco_kwargs"] = tensors(run_with(rank, 16, period=4, outer_kwargs=DILOCO_OUTER)[0])
    # Outer SGD with lr 1 and no momentum is plain averaging, bit for bit, in every form.
    out["plain"] = tensors(run_with(rank, 16, period=4)[0])
    out["lr1"] = [
        tensors(run_with(rank, 16, period=4, outer_kwargs={"lr": 1.0})[0]),
        tensors(run_with(rank, 16, period=4, outer=lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.0))[0]),
        tensors(run_with(rank, 16, DiLoCo, period=4, outer_kwargs={"lr": 1.0, "momentum": 0.0, "nesterov": False})[0]),
        tensors(run_with(rank, 16, period=4, outer=torch.optim.SGD, outer_kwargs={"lr": 1.0})[0]),
    ]
    kw = dict(bn=True, period=3, compression=gz.TopK(0.1), overlap=True)
    out["plain_topk_overlap"] = tensors(run_with(rank, 13, **kw)[0])
    out["lr1_topk_overlap"] = tensors(run_with(rank, 13, outer_kwargs={"lr": 1.0}, **kw)[0])
    out["mass"] = _error_feedback_mass(rank, world)
    out["events"] = _streaming_events(rank, world)
    stream = dict(bn=True, period=8, compression=gz.TopK(0.1), fragments=2, delay=2, alpha=0.5)
    out["ckpt"] = {
        "diloco_mid_period": _checkpoint_case(rank, 6, 12, bn=True, period=4, compression=gz.Int8()),
        "fragment_pushed": _checkpoint_case(rank, 2, 14, **stream),  # its later rounds not issued yet
        "fragment_in_flight": _checkpoint_case(rank, 3, 14, **stream),
        "stream_mid_period": _checkpoint_case(rank, 5, 14, **stream),
    }
    out["stream_ref"] = _streaming_reference(rank, world, 8, 4, 24)
    out["stream_pieces"] = tensors(run_with(rank, 24, DiLoCo, period=8, fragments=4)[0])
    out["stream_bytes"] = _fragment_bytes(rank, world)
    model, opt = run_with(rank, 11, DiLoCo, period=8, fragments=4, delay=1, alpha=0.5)
    out["stream_fragments"] = opt.fragment_names
    opt.synchronize()
    out["stream_synced"] = tensors(model)
    out["reshard"] = _reshard(rank, world)
    data = bench.load_dataset("digits", 0)
    cfg = bench.BenchConfig(dataset="digits", workers=world, epochs=2)
    res = bench.train_one(rank, world, bench.Method("d", gz.parse("DiLoCo(period=8, compression=Int8())")), cfg, data)
    out["bench"] = {k: res[k] for k in ("accuracy", "steps", "ratio", "stats_ratio")}
    return out


def test_outer_step_equals_hand_written_nesterov(two):
    for r in two:
        d = r["diloco"]
        for a, b, c in zip(d["outer_ref"], d["diloco"], d["diloco_kwargs"]):
            assert torch.equal(a, b) and torch.equal(a, c)
        assert max_diff(d["diloco"], d["plain"]) > 1e-3  # the outer step is not plain averaging
    for a, b in zip(two[0]["diloco"]["diloco"], two[1]["diloco"]["diloco"]):
        assert torch.equal(a, b)  # step 16 is a sync


def test_outer_sgd_lr1_without_momentum_is_todays_local_sgd_bit_for_bit(two):
    for r in two:
        d = r["diloco"]
        plain = r["refs"]["period_4"]
        for a, b in zip(plain, d["plain"]):
            assert torch.equal(a, b)
        for form in d["lr1"]:
            for a, b in zip(plain, form):
                assert torch.equal(a, b)
        for a, b in zip(d["plain_topk_overlap"], d["lr1_topk_overlap"]):
            assert torch.equal(a, b)


def test_error_feedback_keeps_the_pseudo_gradient_mass(two):
    """TopK drops most of each pseudo-gradient; what it drops stays in the residuals:
    sum over ranks and syncs of the deltas == W * sum of the applied averages + the residuals."""
    W = len(two)
    m0 = two[0]["diloco"]["mass"]
    for n in m0["pushed"]:
        pushed = sum(r["diloco"]["mass"]["pushed"][n] for r in two)
        applied = m0["applied"][n]
        assert torch.equal(applied, two[1]["diloco"]["mass"]["applied"][n])
        resid = sum(r["diloco"]["mass"]["residuals"][n].double() for r in two)
        assert (pushed - W * applied - resid).abs().max() < 1e-5, n
        assert (pushed - W * applied).abs().max() > 1e-3, n  # compression did drop mass, kept in the residuals


def test_streaming_overlaps_each_fragment_with_delay_inner_steps(two):
    for r in two:
        ev = r["diloco"]["events"]
        issued = [e[1] for e in ev if e[0] == "issued"]
        collects = [(e[1], e[2]) for e in ev if e[0] == "collect"]
        # Pushed at 1, 5, 9, ...: the payload goes out in the next step() (deferred flush, gloo) ...
        assert issued == [2, 6, 10, 14, 18, 22]
        # ... and is collected at the sync step, 3 steps after the push, without waiting for it.
        assert collects == [(t, True) for t in (4, 8, 12, 16, 20, 24)]
        for t in (2, 6, 10, 14, 18, 22):
            i = ev.index(("issued", t))
            window = ev[i : ev.index(("collect", t + 2, True))]
            assert [e[0] for e in window] == ["issued", "arrived", "compute", "compute"]
            assert window[1] == ("arrived", t, True)  # arrived while the loop computed, unasked


def test_checkpoint_resume_is_bit_identical_mid_period_and_with_a_fragment_in_flight(two):
    for r in two:
        c = r["diloco"]["ckpt"]
        assert c["diloco_mid_period"]["momentum"] > 0 and not c["diloco_mid_period"]["in_flight"]
        assert c["fragment_pushed"]["in_flight"] and c["fragment_pushed"]["flushed"] is False
        assert c["fragment_in_flight"]["in_flight"] and c["fragment_in_flight"]["flushed"] is True
        assert not c["stream_mid_period"]["in_flight"]
        for label, case in c.items():
            for a, b in zip(case["unbroken"], case["resumed"]):
                assert torch.equal(a, b), label


def test_streaming_fragments_and_synchronize(two):
    frags = two[0]["diloco"]["stream_fragments"]
    # 837 floats in module order cut into 4 runs of equal bytes: the cuts fall inside 0.weight (640).
    assert frags == [
        ["0.weight[0:209]"],
        ["0.weight[209:418]"],
        ["0.weight[418:628]"],
        ["0.weight[628:640]", "0.bias", "2.weight", "2.bias"],
    ]
    for a, b in zip(two[0]["diloco"]["stream_synced"], two[1]["diloco"]["stream_synced"]):
        assert torch.equal(a, b)


def test_streaming_fragments_are_equal_chunks_with_their_own_outer_step(two):
    for r in two:
        d = r["diloco"]
        # Pieces of one tensor, each with its own momentum: the flat reference, to rounding.
        assert max_diff(d["stream_ref"], d["stream_pieces"]) < 1e-6
        assert max_diff(d["stream_pieces"], d["diloco"]) > 1e-3
        # Per step, one fragment's bytes: 209, 209, 210, 209 of the 837 floats; peak <= 1/F + one float.
        full, stream = d["stream_bytes"][1], d["stream_bytes"][4]
        assert [b for b in full if b] == [837 * 4]
        assert stream == [0, 209 * 4, 0, 209 * 4, 0, 210 * 4, 0, 209 * 4]
        assert max(stream) <= max(full) / 4 + 4 and sum(stream) == sum(full)


def test_reshard_copies_the_global_model_and_outer_momentum(two):
    states = two[0]["diloco"]["reshard"]["states"]
    for a, b in zip(two[0]["diloco"]["reshard"]["final"], two[1]["diloco"]["reshard"]["final"]):
        assert torch.equal(a, b)  # resumed from resharded states, the replicas still agree at step 16
    three = reshard_state(states, 3)
    assert len(three) == 3
    for sd in three:
        assert sd["local_sgd"]["outer"] == states[0]["local_sgd"]["outer"]
        for n, g in states[0]["local_sgd"]["global"].items():
            assert torch.equal(sd["local_sgd"]["global"][n], g)
    for n in states[0]["gradzip"]["residuals"]:
        old = sum(s["gradzip"]["residuals"][n].double() for s in states)
        new = sum(s["gradzip"]["residuals"][n].double() for s in three)
        assert (old - new).abs().max() < 1e-6
    mid = dict(states[0], local_sgd={**states[0]["local_sgd"], "aligned": False})
    with pytest.raises(ValueError, match="saved mid-period"):
        reshard_state([mid, states[1]], 3)


def test_bench_runs_diloco_from_its_spec(two):
    b = two[0]["diloco"]["bench"]
    assert b["steps"] == 44 and b["ratio"] > 8 * 3  # period 8 and int8
    assert b["accuracy"] > 0.8, b


def test_stats_ratio_is_against_plain_ddp_over_the_same_steps(two):
    """DiLoCo's ``stats()["ratio"]`` is what the bench reports (plain DDP's link bytes over the
    same local steps / bytes sent), not the per-sync ratio of deltas against deltas."""
    b = two[0]["diloco"]["bench"]
    assert b["stats_ratio"] == pytest.approx(b["ratio"], rel=1e-9)


# -- multi-rank: 4 ranks ----------------------------------------------------------------
LONG = 60  # steps of the 4-rank streaming run: 15 fragment syncs


def _four_ranks(rank, world):
    out = {}
    # 2 worker groups x 2 DDP ranks: DDP averages gradients in {0, 1} and {2, 3} every step;
    # DiLoCo averages pseudo-gradients in {0, 2} and {1, 3} every 4 steps.
    ddp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    outer_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = make_model()
    ddp = DDP(model, process_group=ddp_groups[rank // 2])
    opt = DiLoCo(
        torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9),
        model,
        4,
        gz.Int8(),
        process_group=outer_groups[rank % 2],
    )
    snaps = {}
    for s in range(10):
        local_step(ddp, opt, s, rank)
        snaps[s + 1] = tensors(model)
    opt.synchronize()
    out["ddp"] = {"snaps": snaps, "final": tensors(model), "world": opt.engine.comm.world_size}
    # No hang with delay > 0: 5 periods of 3 fragments, each overlapping 3 steps, TopK (two rounds).
    model, opt = run_with(rank, LONG, DiLoCo, period=12, compression=gz.TopK(0.1), fragments=3, delay=3, alpha=0.5)
    opt.synchronize()
    out["long"] = {"final": tensors(model), "syncs": opt.stats()["syncs"]}
    return out


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4, timeout=240, pg_timeout=60)


def test_diloco_over_ddp_worker_groups(four):
    assert all(r["ddp"]["world"] == 2 for r in four)
    for t in range(1, 11):
        snap = [r["ddp"]["snaps"][t] for r in four]
        for a, b in zip(snap[0], snap[1]):
            assert torch.equal(a, b)  # the DDP group's ranks agree at every step
        if t % 4 == 0:
            for other in snap[1:]:
                for a, b in zip(snap[0], other):
                    assert torch.equal(a, b)  # after an outer sync all four agree
        else:
            assert max_diff(snap[0], snap[2]) > 1e-4  # between syncs the worker groups differ
    for r in four[1:]:
        for a, b in zip(four[0]["ddp"]["final"], r["ddp"]["final"]):
            assert torch.equal(a, b)


def test_streaming_with_delay_runs_many_steps_on_4_ranks_without_hanging(four):
    for r in four:
        assert r["long"]["syncs"] == LONG // 4 + 3  # one fragment every 4 steps, then synchronize()'s three
        for a, b in zip(four[0]["long"]["final"], r["long"]["final"]):
            assert torch.equal(a, b)
