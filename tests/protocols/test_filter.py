"""Model filtering (Filter): the rule, exact mass, agreement across ranks, fewer bytes on the wire."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

from gradzip.bench import free_port
from gradzip.codecs.base import TensorContext
from gradzip.codecs.cast import FP16
from gradzip.codecs.quant import Int8, SignSGD
from gradzip.codecs.threshold import Threshold
from gradzip.codecs.topk import TopK
from gradzip.engine import Engine
from gradzip.protocols.filter import REF, SENT, SKIPPED, Filter
from gradzip.protocols.powersgd import PowerSGD
from tests.support import RefMemory, run_ranks

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- configuration ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"min_change": -0.1}, "min_change"),
        ({"min_change": 1.0}, "min_change"),
        ({"min_change": "0.5"}, "min_change"),
        ({"beta": 1.0}, "beta"),
        ({"beta": -1}, "beta"),
        ({"beta": True}, "beta"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg) as e:
        Filter(TopK(0.1), **kwargs)
    assert "must be" in str(e.value)


def test_inner_must_be_a_codec_or_protocol():
    with pytest.raises(TypeError, match="inner"):
        Filter("topk")
    f = Filter(Int8(block=8), min_change=0.25)
    assert f.biased and f.config() == {
        "name": "Filter",
        "inner": {"name": "Int8", "block": 8, "allreduce": False},
        "min_change": 0.25,
        "beta": 0.9,
    }
    assert Filter(FP16()).biased  # skipping is biased whatever inner is
    assert Filter(PowerSGD(rank=2)).config()["inner"]["name"] == "PowerSGD"


# -- the rule -----------------------------------------------------------------------------
def test_rule_on_a_known_sequence():
    f, store = Filter(SignSGD(), min_change=0.5, beta=0.5), {}
    assert not f.wants(torch.zeros(4), store) and store[REF] == 0.0  # nothing to send
    assert f.wants(torch.full((4,), 2.0), store) and store[REF] == 1.0  # rms 2 > 0.5 * 0
    assert not f.wants(torch.full((4,), 0.5), store) and store[REF] == 0.75  # 0.5 is not > 0.5 * 1.0
    assert f.wants(torch.full((4,), -0.5), store)  # 0.5 > 0.5 * 0.75
    assert not f.wants(torch.zeros(0), {})
    assert store[REF] == 0.625
    assert f.wants(torch.tensor([1.0, float("nan")]), store) and store[REF] == 0.625  # left to the engine


@PROPS
@given(
    rms=st.lists(st.sampled_from([0.0, 1e-6, 0.0137, 0.31, 1.07, 5.3]), min_size=1, max_size=12),
    m=st.sampled_from([0.0, 0.2, 0.5, 0.99]),
    beta=st.sampled_from([0.0, 0.5, 0.9]),
)
def test_rule_follows_the_documented_ema(rms, m, beta):
    f, store, ref = Filter(TopK(0.5), min_change=m, beta=beta), {}, None
    g = torch.Generator().manual_seed(len(rms))
    for r in rms:
        x = torch.randn(17, generator=g, dtype=torch.float64)
        x = (x / x.norm() * r * math.sqrt(17)).float()
        change = float(x.double().norm()) / math.sqrt(17)
        want = change > m * (ref or 0.0)
        ref = change if ref is None else beta * ref + (1 - beta) * change
        assert f.wants(x, store) == want
        assert store[REF] == pytest.approx(ref, rel=1e-6, abs=1e-30)


# -- exact mass through a real (one-rank) engine ------------------------------------------
@pytest.fixture(scope="module")
def solo_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


INNERS = {
    "topk": lambda: TopK(0.3),
    "int8": lambda: Int8(block=4),
    "int8-ar": lambda: Int8(block=4, allreduce=True),
    "threshold": lambda: Threshold(tau=0.05),
}
NAMES = ["a", "b", "c", "d"]


@PROPS
@given(data=st.data())
def test_residual_plus_sent_equals_input_exactly(solo_group, data):
    inner = data.draw(st.sampled_from(sorted(INNERS)))
    m = data.draw(st.sampled_from([0.0, 0.5, 0.9]))
    eng = Engine(Filter(INNERS[inner](), min_change=m))
    shapes = [data.draw(st.sampled_from([(0,), (1,), (7,), (5, 6)])) for _ in NAMES]
    for step in range(4):
        grads = []
        for shape in shapes:
            scale = data.draw(st.sampled_from([0.0, 1e-3, 1.0, 50.0]))
            seed = data.draw(st.integers(0, 2**20))
            grads.append(torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale)
        before = {n: eng.memory.residual(n) for n in NAMES}
        skipped = {n: eng.tensor_state.get(n, {}).get(SKIPPED, 0) for n in NAMES}
        fut = eng.reduce(NAMES, grads)
        eng.flush()
        out = fut.wait()
        eng.end_step()
        pos = 0
        for n, g in zip(NAMES, grads):
            sent = out[pos : pos + g.numel()].reshape(g.shape)
            pos += g.numel()
            c = g.float() if before[n] is None else g.float() + before[n]  # what compensate computes
            r = eng.memory.residual(n)
            assert torch.equal(r.double() + sent.double(), c.double()), (inner, n, step)
            store = eng.tensor_state[n]
            assert store.get(SENT, 0) + store.get(SKIPPED, 0) == step + 1
            if store.get(SKIPPED, 0) > skipped[n]:
                assert not torch.any(sent) and torch.equal(r, c)
            if not torch.any(c):
                assert store.get(SKIPPED, 0) > skipped[n]  # all zeros: never sent


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_gradients(solo_group, dtype):
    eng = Engine(Filter(SignSGD()))
    grads = [torch.randn(9, 4).to(dtype), torch.zeros(5, dtype=dtype)]
    fut = eng.reduce(["w", "z"], grads)
    eng.flush()
    out = fut.wait()
    assert out.dtype == dtype and out.shape == (41,)
    assert out[:36].abs().unique().numel() == 1  # one scale: mean |g|
    assert not torch.any(out[36:]) and eng.tensor_state["z"][SKIPPED] == 1


# -- two ranks: agreement, and fewer bytes ------------------------------------------------
STEPS = 4
AGREE = ["a", "b", "c", "d", "e", "f"]
AGREE_INNER = Int8(block=8)


def agree_grads(step, rank):
    """Ranks differ: a is zero on rank 0, d on rank 1, b on both; e shrinks on rank 1 from
    step 2 on; f shrinks on both ranks at step 2 only."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    out = [torch.randn(6, 5, generator=g) for _ in AGREE]
    out[1].zero_()
    if rank == 0:
        out[0].zero_()
    if rank == 1:
        out[3].zero_()
        if step >= 2:
            out[4].mul_(1e-4)
    if step == 2:
        out[5].mul_(1e-4)
    return out


def make_trunk_model():
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(4)])
    return torch.nn.ModuleDict({"trunk": trunk, "head": torch.nn.Linear(64, 4)})


class Frozen(torch.nn.Module):
    """A trunk frozen by detaching its features: DDP hands the hook zero gradients for it."""

    def __init__(self, parts):
        super().__init__()
        self.parts = parts

    def forward(self, x):
        return self.parts["head"](self.parts["trunk"](x).detach())


def _two_ranks(rank, world):
    out = {"agree": []}
    eng = Engine(Filter(AGREE_INNER, min_change=0.5))
    for step in range(STEPS):
        fut = eng.reduce(AGREE, agree_grads(step, rank))
        eng.flush()
        out["agree"].append(fut.wait())
        eng.end_step()
    out["agree_state"] = {n: dict(s) for n, s in eng.tensor_state.items()}
    out["agree_residuals"] = eng.memory.state_dict()

    for label, comp in (("int8-ar", Int8(allreduce=True)), ("filter", Filter(Int8(allreduce=True)))):
        from gradzip.hooks import register_hook

        parts = make_trunk_model()
        ddp = DDP(Frozen(parts), bucket_cap_mb=0.01, find_unused_parameters=True)
        state = register_hook(ddp, comp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        before = {n: p.detach().clone() for n, p in parts.named_parameters()}
        for s in range(6):
            g = torch.Generator().manual_seed(100 * s + rank)  # ranks see different data
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        out[label] = {
            "stats": state.stats(),
            "params": {n: p.detach().clone() for n, p in parts.named_parameters()},
            "before": before,
            "state": {n: dict(s) for n, s in state.engine.tensor_state.items()},
        }
    return out


def reference_agree(world, inner, m, beta=0.9):
    """The documented algorithm, re-enacted in one process with per-rank residuals."""
    mems = [RefMemory() for _ in range(world)]
    refs = [{} for _ in range(world)]
    outs, counts, split = [], {n: 0 for n in AGREE}, set()
    for step in range(STEPS):
        grads = [agree_grads(step, r) for r in range(world)]
        parts = []
        for i, n in enumerate(AGREE):
            cs = [mems[r].compensate(n, grads[r][i]) for r in range(world)]
            votes = []
            for r in range(world):
                change = float(cs[r].double().norm()) / math.sqrt(cs[r].numel())
                ref = refs[r].get(n)
                votes.append(change > m * (ref or 0.0))
                refs[r][n] = change if ref is None else beta * ref + (1 - beta) * change
            acc = torch.zeros(cs[0].numel())
            if len(set(votes)) > 1:
                split.add((step, n))
            if any(votes):
                counts[n] += 1
                for r in range(world):
                    p = inner.compress(cs[r], TensorContext(name=n, step=step, rank=r, world_size=world))
                    mems[r].update(n, cs[r], inner.decompress(p))
                    inner.accumulate(p, acc)
                acc /= world
            else:
                for r in range(world):
                    mems[r].update(n, cs[r], torch.zeros_like(cs[r]))
            parts.append(acc)
        outs.append(torch.cat(parts))
    return outs, counts, mems, split


@pytest.mark.slow
def test_ranks_agree_mass_is_kept_and_frozen_tensors_cost_no_payload():
    world = 2
    res = run_ranks(_two_ranks, world, timeout=200)

    # Agreement: ranks whose gradients differ send the same tensors and get the same floats.
    outs, counts, mems, split = reference_agree(world, AGREE_INNER, 0.5)
    for rank, r in enumerate(res):
        for step in range(STEPS):
            assert torch.equal(r["agree"][step], outs[step]), (rank, step)
        for n in AGREE:
            assert r["agree_state"][n].get(SENT, 0) == counts[n]
            assert r["agree_state"][n].get(SKIPPED, 0) == STEPS - counts[n]
            assert torch.equal(r["agree_residuals"][n], mems[rank].residual(n))
    assert counts == {"a": STEPS, "b": 0, "c": STEPS, "d": STEPS, "e": STEPS, "f": STEPS - 1}
    # The ranks' own votes differed (one rank's vote suffices) for a, d and the shrunken e.
    assert {(0, "a"), (0, "d"), (2, "e"), (3, "e")} <= split
    assert not torch.any(res[0]["agree"][2][150:180]) and torch.any(res[0]["agree"][3][150:180])  # f
    assert not any(torch.any(o[30:60]) for o in res[0]["agree"])  # b: zeros everywhere

    # A frozen trunk (zero gradients through DDP): its tensors are skipped and cost only their flags.
    plain, filt = res[0]["int8-ar"]["stats"], res[0]["filter"]["stats"]
    print(f"\nfrozen trunk, 6 steps: Int8-AR {plain['bytes_sent']} B, Filter(Int8-AR) {filt['bytes_sent']} B")
    assert plain["bytes_raw"] == filt["bytes_raw"]
    assert filt["bytes_sent"] < 0.2 * plain["bytes_sent"], (plain, filt)
    st = res[0]["filter"]["state"]
    for n, s in st.items():
        if ".trunk." in f".{n}":
            assert s.get(SENT, 0) == 0 and s[SKIPPED] == 6, (n, s)
        else:
            assert s[SENT] >= 1, (n, s)
    for label in ("int8-ar", "filter"):
        a, b = res[0][label], res[1][label]
        assert a["params"].keys() == b["params"].keys()
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), (label, n)  # replicas identical
            if ".trunk." in f".{n}":
                assert torch.equal(a["params"][n], a["before"][n])
        counts_of = [{n: (s.get(SENT), s.get(SKIPPED)) for n, s in r[label]["state"].items()} for r in res]
        assert counts_of[0] == counts_of[1]
