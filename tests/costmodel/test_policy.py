"""Policy: routing rules, parallel composition of exchanges, and 2 gloo ranks through the engine and DDP."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradzip.codecs import BF16, FP16, Identity, TopK
from gradzip.codecs.base import TensorContext
from gradzip.comm import Round
from gradzip.costmodel import CodecFit, CodecProfile, Link, dry_run
from gradzip.engine import Engine
from gradzip.hooks import register_hook
from gradzip.policy import DECISION, Policy
from gradzip.protocols import AllGather, Allreduce
from gradzip.protocols.filter import Filter
from gradzip.protocols.parallel import parallel
from gradzip.protocols.powersgd import PowerSGD
from tests import support
from tests.support import RefMemory, batch, run_ranks, train_steps


# -- rules -----------------------------------------------------------------------------------
def test_rules_route_by_name_and_size():
    big, pl, fb = TopK(0.01), PowerSGD(rank=1), BF16()
    p = Policy(big, min_numel=100, skip=["bias", "norm"], fallback=fb, per_layer={"attn.": pl, "head": Identity()})
    assert p.rule("layer1.weight", 5000) == (big, "default")
    assert p.rule("layer1.bias", 5000) == (fb, "skip 'bias'")
    assert p.rule("ln.norm.weight", 5000) == (fb, "skip 'norm'")
    assert p.rule("layer1.weight", 99) == (fb, "numel < min_numel=100")
    assert p.rule("layer1.weight", 100)[0] is big
    # per_layer comes first, even for a bias or a small tensor; the first matching pattern wins
    assert p.rule("attn.bias", 3) == (pl, "per_layer 'attn.'")
    assert p.rule("attn.head", 3)[0] is pl
    assert p.rule("head.weight", 10**6)[0] is p.per_layer["head"]
    assert p.candidates == [pl, p.per_layer["head"], big, fb]
    rows = p.explain([("a.weight", (50, 50)), ("a.bias", (50,)), ("attn.q", (2, 2))])
    assert [r["method"] for r in rows] == [repr(big), repr(fb), repr(pl)]
    assert [r["numel"] for r in rows] == [2500, 50, 4]
    # a single string is one pattern
    assert Policy(big, skip="bias").skip == ("bias",)


def test_config_bias_and_errors():
    p = Policy(PowerSGD(rank=2), min_numel=4096, skip=["bias", "norm"], fallback=BF16(), per_layer={"emb": TopK(0.1)})
    cfg = p.config()
    assert cfg["default"] == PowerSGD(rank=2).config() and cfg["fallback"] == {"name": "BF16"}
    assert cfg["per_layer"] == [["emb", TopK(0.1).config()]] and cfg["skip"] == ["bias", "norm"]
    assert json.loads(json.dumps(cfg)) == cfg  # plain values (compared across ranks, saved with state)
    assert p.biased
    assert not Policy(Identity(), fallback=FP16()).biased
    assert Policy(Identity(), per_layer={"x": TopK(0.1)}).biased
    with pytest.raises(TypeError, match="default must be a gradzip codec or protocol"):
        Policy("topk")
    with pytest.raises(TypeError, match=r"per_layer\['x'\] must be a gradzip codec or protocol"):
        Policy(Identity(), per_layer={"x": 3})
    with pytest.raises(ValueError, match="must not be a Policy"):
        Policy(Identity(), fallback=Policy(Identity()))
    with pytest.raises(ValueError, match=r"min_numel must be an integer in \[0, inf\)"):
        Policy(Identity(), min_numel=-1)
    with pytest.raises(ValueError, match=r"min_numel must be an integer in \[0, inf\)"):
        Policy(Identity(), min_numel=True)
    with pytest.raises(ValueError, match="skip must hold non-empty strings"):
        Policy(Identity(), skip=["bias", ""])
    with pytest.raises(ValueError, match="skip must be a string or a list of strings"):
        Policy(Identity(), skip=5)
    with pytest.raises(ValueError, match="per_layer must be a dict"):
        Policy(Identity(), per_layer=[("x", TopK())])
    with pytest.raises(ValueError, match="auto=True needs link"):
        Policy(TopK(), auto=True)
    with pytest.raises(ValueError, match="link is only used with auto=True"):
        Policy(TopK(), link=Link(1e9))
    with pytest.raises(ValueError, match="profile is only used with auto=True"):
        Policy(TopK(), profile={})
    with pytest.raises(ValueError, match=r"world_size must be None or an integer in \[1, inf\)"):
        Policy(TopK(), auto=True, link=Link(1e9), world_size=0)
    with pytest.raises(ValueError, match="auto must be True or False"):
        Policy(TopK(), auto="yes")
    assert Allreduce(Identity()).rounds == 1 and AllGather(TopK(mode="sampled")).rounds == 2
    assert AllGather(TopK()).rounds == 1  # exact: fixed frames, no size exchange
    assert PowerSGD().rounds is None and Filter(TopK()).rounds is None


# -- parallel composition ----------------------------------------------------------------------
def proto(name, rounds, log, result=None):
    """A fake protocol: yields Round([name.k], last=...) for each flag in ``rounds``; logs resumes."""

    def gen():
        for k, last in enumerate(rounds):
            log.append(f"{name} sends {k}")
            yield Round([f"{name}.{k}"], last=last)
        log.append(f"{name} done")
        return result if result is not None else name

    return gen()


def drive(p):
    """Run a composed protocol as the communicator would; returns (rounds, result)."""
    out = []
    try:
        while True:
            r = next(p)
            out.append((r.works, r.last))
    except StopIteration as stop:
        return out, stop.value


def test_parallel_merges_rounds_left_aligned():
    log = []
    rounds, res = drive(parallel([proto("A", [False, True], log), proto("B", [True], log)]))
    assert rounds == [(["A.0", "B.0"], False), (["A.1"], True)]
    assert res == ["A", "B"]
    # B finished (decoded) after the first merged round, before A's second round went out
    assert log == ["A sends 0", "B sends 0", "A sends 1", "B done", "A done"]


def test_parallel_start_offsets_right_align():
    log = []
    rounds, res = drive(parallel([proto("A", [False, True], log), proto("B", [True], log)], start=[0, 1]))
    assert rounds == [(["A.0"], False), (["A.1", "B.0"], True)]
    assert log == ["A sends 0", "A sends 1", "B sends 0", "A done", "B done"] and res == ["A", "B"]
    # a round is not the last while a protocol has yet to start
    rounds, _ = drive(parallel([proto("A", [True], log), proto("B", [True], log)], start=[0, 1]))
    assert rounds == [(["A.0"], False), (["B.0"], True)]


def test_parallel_early_returns_and_late_starters():
    log = []

    def silent():
        log.append("S done")
        return "S"
        yield  # unreachable: makes this function a generator

    # C ends after a non-last round (a filter that sent nothing); S never talks;
    # D waits for round 5 but starts as soon as nothing else runs
    ps = [proto("C", [False], log), silent(), proto("D", [False, True], log)]
    rounds, res = drive(parallel(ps, start=[0, 0, 5]))
    assert rounds == [(["C.0"], False), (["D.0"], False), (["D.1"], True)]
    assert res == ["C", "S", "D"]
    assert drive(parallel([])) == ([], [])


def test_parallel_errors():
    log = []

    def rude():
        yield Round(["R.0"], last=True)
        yield Round(["R.1"], last=True)

    p = parallel([proto("A", [False, False, True], log), rude()])
    next(p)
    with pytest.raises(RuntimeError, match="protocol 1 yielded after its last round"):
        next(p)
    with pytest.raises(ValueError, match=r"start must be 2 integers in \[0, inf\)"):
        next(parallel([proto("A", [True], log), proto("B", [True], log)], start=[0]))
    with pytest.raises(ValueError, match="start must be"):
        next(parallel([proto("A", [True], log)], start=[-1]))


def test_policy_exchange_equals_its_parts_in_a_dry_run():
    """On loopback ranks: the policy's output and residuals are its candidates' on their subsets."""
    g = torch.Generator().manual_seed(3)
    shapes = {"emb.weight": (30, 40), "l1.weight": (20, 20), "l1.bias": (20,), "tiny": (5, 5), "l2.weight": (16, 16)}
    names = list(shapes)
    xs = [torch.randn(s, generator=g) for s in shapes.values()]
    pol = Policy(TopK(0.1, mode="sampled"), min_numel=50, skip=["bias"], per_layer={"emb": PowerSGD(rank=1)})
    stores = {}
    whole = dry_run(pol, xs, names=names, world_size=3, stores=stores)
    # PowerSGD (2 rounds, unknown to the policy: starts first, and takes the engine's flag: one
    # float32 after its P), TopK (2 rounds), Identity (1: starts late)
    kinds = [(c.kind, c.nbytes) for c in whole.collectives]
    assert whole.flag_carried
    assert kinds == [
        ("allreduce", 4 * 30 + 4),
        ("allreduce", 8),
        ("allreduce", 4 * 40),
        ("allgather", kinds[3][1]),
        ("allreduce", 4 * 45),
    ]
    assert whole.rounds == 2
    for comp, group in (
        (PowerSGD(rank=1), ["emb.weight"]),
        (TopK(0.1, mode="sampled"), ["l1.weight", "l2.weight"]),
        (Identity(), ["l1.bias", "tiny"]),
    ):
        idx = [names.index(n) for n in group]
        sub = dry_run(comp, [xs[i] for i in idx], names=group, world_size=3, error_feedback=True)
        for j, i in enumerate(idx):
            n = sum(x.numel() for x in xs[:i])
            k = sum(x.numel() for x in xs[: i + 1])
            m = sum(xs[ii].numel() for ii in idx[:j])
            assert torch.equal(whole.out[n:k], sub.out[m : m + xs[i].numel()]), group[j]
    assert "q" in stores["emb.weight"]  # per-tensor state went through the sub-call


def test_results_buffer_is_held_by_one_call_at_a_time():
    """A second call with the same tensors, while the first holds the buffer, gets none (its
    routes allocate), and finishing it leaves the first call's hold in place."""
    from types import SimpleNamespace

    pol = Policy(TopK(0.1), min_numel=50)
    call = SimpleNamespace(numel=10, out_dtype=torch.float32, device=torch.device("cpu"))
    key = (("a", "b"), torch.float32, torch.device("cpu"))
    first = pol._scratch_for(key, call)
    assert first is not None and first.numel() == 10 and key in pol._scratch_busy
    assert pol._scratch_for(key, call) is None and key in pol._scratch_busy
    pol._scratch_busy.discard(key)
    again = pol._scratch_for(key, call)
    assert again.data_ptr() == first.data_ptr()  # reused
    bigger = SimpleNamespace(numel=12, out_dtype=torch.float32, device=torch.device("cpu"))
    pol._scratch_busy.discard(key)
    assert pol._scratch_for(key, bigger).numel() == 12


# -- 2 gloo ranks: the engine -----------------------------------------------------------------
SHAPES = {
    "emb.weight": (24, 32),
    "a.weight": (40, 30),
    "a.bias": (40,),
    "tiny.weight": (3, 4),
    "b.weight": (64, 16),
    "b.bias": (64,),
}
BUCKETS = [["b.bias", "b.weight"], ["tiny.weight", "a.bias", "a.weight"], ["emb.weight"]]


def make_policy():
    return Policy(TopK(0.05), min_numel=50, skip=["bias"], fallback=Identity(), per_layer={"emb": PowerSGD(rank=2)})


def grads(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _engine_mix(rank, world, steps):
    pol = make_policy()
    eng = Engine(pol)
    parts = {"PowerSGD": Engine(PowerSGD(rank=2)), "TopK": Engine(TopK(0.05)), "Identity": Engine(Identity())}
    got, ref, scratch = [], [], []
    for s in range(steps):
        gr = grads(rank, s)
        futs = [eng.reduce(b, [gr[n] for n in b]) for b in BUCKETS]  # three calls in flight
        eng.flush()
        eng.end_step()
        got.append([f.wait() for f in futs])
        scratch.append(({k[0]: v.data_ptr() for k, v in pol._scratch.items()}, set(pol._scratch_busy)))
        # the same tensors through one engine per compressor, call by call
        outs = []
        for b in BUCKETS:
            pieces = {}
            for key, e in parts.items():
                sub = [n for n in b if type(pol.rule(n, gr[n].numel())[0]).__name__ == key]
                if sub:
                    f = e.reduce(sub, [gr[n] for n in sub])
                    e.flush()
                    pieces.update(zip(sub, f.wait().split([gr[n].numel() for n in sub])))
            outs.append(torch.cat([pieces[n] for n in b]))
        for e in parts.values():
            e.end_step()
        ref.append(outs)
    residuals = {n: eng.memory.residual(n) for n in SHAPES}
    part_res = {n: None for n in SHAPES}
    part_res.update(
        {
            n: e.memory.residual(n)
            for e in parts.values()
            if e.memory is not None
            for n in SHAPES
            if e.memory.residual(n) is not None
        }
    )
    # auto: rank 1's profile says TopK's codec is far too slow, rank 0's that it is cheap
    slow_codec = CodecFit(10.0 if rank else 1e-6, 0.0)
    prof = CodecProfile(measure_missing=False)
    prof.add(TopK(0.01), slow_codec, error_feedback=True)
    prof.add(Identity(), CodecFit(1e-6, 0.0), error_feedback=False)
    auto = Engine(Policy(TopK(0.01), auto=True, link=Link(1e8, 1e-4), profile=prof))
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(rank))
    auto_out, collectives = [], []
    for _ in range(2):
        f = auto.reduce(["w"], [x])
        auto.flush()
        auto.end_step()
        auto_out.append(f.wait())
        collectives.append(auto.stats()["collectives"])
    return {
        "got": got,
        "ref": ref,
        "scratch": scratch,
        "residuals": residuals,
        "part_residuals": part_res,
        "x": x,
        "auto": auto_out,
        "auto_collectives": collectives,
        "auto_decision": auto.tensor_state["w"].get(DECISION),
        "auto_vote_local": auto.method.prefers_fallback(x, 2),
    }


def local_average(comp, xs, world):
    """What every rank should get for one tensor on the first step (zero residuals)."""
    if comp.summable:
        return sum((x.reshape(-1) / world for x in xs), torch.zeros(xs[0].numel()))
    acc = torch.zeros(xs[0].numel())
    for r in range(world):  # rank order, as the engine decodes
        ctx = TensorContext(name="t", dtype=xs[r].dtype, store={})
        comp.accumulate(comp.compress(xs[r], ctx), acc)
    return acc.div_(world)


def test_engine_policy_equals_its_parts_on_two_ranks():
    steps = 3
    res = run_ranks(_engine_mix, 2, steps)
    pol = make_policy()
    for r in res:
        for s in range(steps):
            for a, b in zip(r["got"][s], r["ref"][s]):
                assert torch.equal(a, b)
        for n, v in r["residuals"].items():
            if r["part_residuals"][n] is None:  # routed to the unbiased fallback: no residual at all
                assert v is None, n
            else:
                assert torch.equal(v, r["part_residuals"][n]), n
    assert all(torch.equal(a, b) for a, b in zip(res[0]["got"][-1], res[1]["got"][-1]))
    # calls split across routes keep one results buffer each, reused every step, released after
    for r in res:
        ptrs = [p for p, _ in r["scratch"]]
        assert set(ptrs[0]) == {tuple(BUCKETS[0]), tuple(BUCKETS[1])}  # emb.weight alone: one route
        assert all(p == ptrs[0] for p in ptrs) and all(not busy for _, busy in r["scratch"])
    # first step, computed here from what each rank sends
    g = [grads(r, 0) for r in range(2)]
    for b, out in zip(BUCKETS, res[0]["got"][0]):
        pos = 0
        for n in b:
            k = g[0][n].numel()
            comp = pol.rule(n, k)[0]
            if not isinstance(comp, PowerSGD):
                assert torch.equal(out[pos : pos + k], local_average(comp, [g[0][n], g[1][n]], 2)), n
            pos += k
    # auto: the ranks disagreed, the vote sent the tensor plain on both, and remembered it
    assert [r["auto_vote_local"] for r in res] == [False, True]
    assert [r["auto_decision"] for r in res] == [1, 1]
    expected = (res[0]["x"].reshape(-1) / 2) + (res[1]["x"].reshape(-1) / 2)
    for r in res:
        assert all(torch.equal(o, expected) for o in r["auto"])
        # step 1: config check (2) + vote (the engine's flag riding in it: the route is not known
        # when the flag goes out) + payload; step 2: the payload alone (a call summed as it is
        # sends no flag)
        assert r["auto_collectives"] == [4, 5]


# -- 2 gloo ranks: the DDP hook, many small buckets ----------------------------------------------
def make_model():
    return support.make_model(0, widths=(40, 40, 6))


def ddp_policy():
    return Policy(TopK(0.1), min_numel=100, skip=["bias"])  # TopK for 3 weights, Identity for the rest


def _ddp(rank, world, steps):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    state = register_hook(ddp, ddp_policy())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_steps(ddp, opt, steps, rank, n=8)
    # a second mix: PowerSGD, a filter and plain allreduce in flight together
    model2 = make_model()
    ddp2 = DDP(model2, bucket_cap_mb=0.001)
    pol2 = Policy(PowerSGD(rank=2), skip=["bias"], per_layer={"4.": Filter(TopK(0.2), min_change=0.5)})
    state2 = register_hook(ddp2, pol2)
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.1)
    train_steps(ddp2, opt2, steps, rank, n=8)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "params2": [p.detach().clone() for p in model2.parameters()],
        "stats": state.stats(),
        "stats2": state2.stats(),
    }


def reference(steps, world):
    """The run re-enacted in one process: each rank's gradients, residuals and routing."""
    model = make_model()
    pol = ddp_policy()
    names = [n for n, _ in model.named_parameters()]
    mems = [RefMemory() for _ in range(world)]  # the policy is biased: error feedback for all
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        per_rank = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            x, y = batch(s, r, n=8)
            F.cross_entropy(model(x), y).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for i, (n, p) in enumerate(model.named_parameters()):
            comp = pol.rule(n, p.numel())[0]
            xs = [mems[r].compensate(n, per_rank[r][i]) for r in range(world)]
            if comp.summable:  # Identity: pre-divided, summed
                avg = sum((x.reshape(-1) / world for x in xs), torch.zeros(p.numel()))
                for r in range(world):
                    mems[r].update(n, xs[r], xs[r])
            else:
                avg = torch.zeros(p.numel())
                for r in range(world):
                    pay = comp.compress(xs[r], TensorContext(name=n, step=s, dtype=p.dtype, store={}))
                    mems[r].update(n, xs[r], comp.decompress(pay))
                    comp.accumulate(pay, avg)
                avg.div_(world)
            p.grad = avg.view_as(p)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], names


def test_ddp_hook_with_a_policy_many_buckets_matches_reference():
    steps = 10
    res = run_ranks(_ddp, 2, steps, timeout=180)
    expected, names = reference(steps, 2)
    routed = [type(ddp_policy().rule(n, p.numel())[0]).__name__ for n, p in make_model().named_parameters()]
    assert routed.count("TopK") == 3 and routed.count("Identity") == 5
    for r in res:
        for n, a, b in zip(names, r["params"], expected):
            assert torch.equal(a, b), n
        # tiny buckets: several calls per step, each with a flag and its sub-exchanges' collectives
        assert r["stats"]["collectives"] > 3 * steps
        assert r["stats"]["ratio"] > 1.0
    for a, b in zip(res[0]["params2"], res[1]["params2"]):  # the second mix: replicas agree, finite
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    assert res[0]["stats2"]["steps"] == steps


def test_auto_profiles_through_the_largest_tensor_it_costs():
    """A policy's own profile reaches the largest tensor costed so far (a power of two, 1M to
    16M elements): a line through 1M elements reads an out-of-cache tensor's codec short. A
    profile the user gave is kept as it is."""
    pol = Policy(TopK(0.01), auto=True, link=Link(1e9))
    first = pol.profile()
    assert first.sizes == (4096, 1 << 20) and pol.profile(1000) is first and pol.profile(1 << 20) is first
    assert pol.profile(3_000_000).sizes == (4096, 1 << 22)
    bigger = pol.profile(5_000_000)
    assert bigger.sizes == (4096, 1 << 23) and pol.profile(3_000_000) is bigger
    assert pol.profile(1 << 30).sizes == (4096, 1 << 24) and pol.profile(1 << 31).sizes == (4096, 1 << 24)
    mine = CodecProfile(sizes=(256, 4096))
    given = Policy(TopK(0.01), auto=True, link=Link(1e9), profile=mine)
    assert given.profile(1 << 24) is mine


@pytest.mark.parametrize("layout", ["together", "interleaved"])
def test_routes_write_into_the_bucket_where_their_tensors_sit_together(layout):
    """A route whose tensors lie back to back in the call's destination (DDP's bucket) writes its
    result there; only routes whose tensors are interleaved with another route's go through the
    policy's scratch buffer. The result is the same either way, and the same as on loose tensors."""
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(16, 12, generator=g), torch.randn(8, 12, generator=g)
    b1, b2 = torch.randn(12, generator=g), torch.randn(8, generator=g)
    xs = [b1, b2, w1, w2] if layout == "together" else [w1, b1, w2, b2]
    names = [f"t{i}" for i in range(4)]

    def run(bucket):
        pol = Policy(PowerSGD(rank=1), min_numel=20)  # the biases go to the fallback, Identity
        return pol, dry_run(pol, xs, world_size=2, names=names, bucket=bucket).out

    pol, inplace = run(True)
    assert (len(pol._scratch) == 0) == (layout == "together")
    _, loose = run(False)
    assert torch.equal(inplace, loose)
