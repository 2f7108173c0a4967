"""Multi-process tests: DDP + gradzip hook on 2 and 4 gloo ranks (127.0.0.1)."""

import json
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip.codecs.base import TensorContext
from gradzip.hooks import register_hook
from gradzip.wire import ENTRY_BYTES, HEADER_BYTES
from tests.support import ddp_resume_matches_unbroken, make_model, params, reference_run, run_ranks, train_steps

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------
def _identity_vs_plain(rank, world, cap_mb):
    out = {}
    for mode in ("plain", "hook"):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        state = register_hook(ddp, gz.Identity()) if mode == "hook" else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        train_steps(ddp, opt, 6, rank)
        out[mode] = params(model)
        if state is not None:
            out["stats"] = state.stats()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_identity_hook_is_bit_identical_to_plain_ddp(world):
    res = run_ranks(_identity_vs_plain, world, 0.005)
    for r in res:
        for a, b in zip(r["plain"], r["hook"]):
            assert torch.equal(a, b)
        st = r["stats"]
        assert st["bytes_sent"] - st["bytes_control"] == st["bytes_raw"] and st["steps"] == 6
    nparams = sum(p.numel() for p in make_model().parameters())
    assert res[0]["stats"]["bytes_raw"] == 6 * 4 * nparams


# --------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------
CKPT_COMPRESSORS = [
    gz.Threshold(tau=1e-3, policy="adaptive", band=(1e-2, 5e-2), shake_every=3),
    gz.TopK(ratio=0.05, mode="sampled", sample=64),
    gz.RandomK(ratio=0.2, seed=5),
]


def _checkpoint(rank, world, comp, k):
    out = ddp_resume_matches_unbroken(rank, comp, k)
    return {**out, "residuals": len(out.pop("ckpt")["gradzip"]["residuals"])}


@pytest.mark.parametrize("comp", CKPT_COMPRESSORS, ids=lambda c: type(c).__name__)
def test_checkpoint_resume_matches_unbroken_run(comp):
    res = run_ranks(_checkpoint, 2, comp, 5)
    nparams = len(list(make_model().parameters()))
    for r in res:
        assert r["residuals"] == nparams
        for a, b in zip(r["unbroken"], r["resumed"]):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
def rebuild_compressor():
    return gz.Threshold(tau=2e-3, policy="adaptive", band=(0.02, 0.1), decay=0.7)


def _rebuild(rank, world, steps):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = register_hook(ddp, rebuild_compressor())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    collectives = []
    for s in range(steps):
        train_steps(ddp, opt, 1, rank, first=s)
        collectives.append(state.stats()["collectives"])
    return {"params": params(model), "collectives": collectives, "residuals": sorted(state.engine.memory.residuals)}


def test_residuals_survive_ddp_bucket_rebuild():
    steps = 6
    res = run_ranks(_rebuild, 2, steps)
    expected, names = reference_run(steps, 2, rebuild_compressor())
    # DDP rebuilt its buckets after iteration 0: one bucket (config check: 2 collectives,
    # then size with the engine's flag beside it + payload: 2) in the first step, several
    # buckets from then on.
    c = res[0]["collectives"]
    assert c[0] == 2 + 2 and c[1] - c[0] > 2 and c[2] - c[1] == c[1] - c[0]
    for r in res:
        assert r["residuals"] == sorted(names)
        for a, b in zip(r["params"], expected):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
def _stress(rank, world, comp, steps):
    """Tiny buckets, two-round protocols, ranks with different payload sizes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(12)])
    ddp = DDP(model, bucket_cap_mb=0.001)
    state = register_hook(ddp, comp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for s in range(steps):
        g = torch.Generator().manual_seed(s * 31 + rank)
        x = torch.randn(8 * (rank + 1), 24, generator=g)  # rank-dependent sizes and payloads
        opt.zero_grad()
        (ddp(x) ** 2).mean().backward()
        opt.step()
    return {"params": params(model), "stats": state.stats()}


@pytest.mark.parametrize(
    "comp",
    [
        gz.Threshold(tau=1e-3, policy="adaptive", band=(0.01, 0.2)),
        gz.TopK(0.05),
        gz.TopK(0.05, values="sign", scope="call"),
        gz.Threshold(policy="target", density=0.05, scope="call"),
    ],
    ids=["threshold", "topk", "topk-sign-call", "threshold-call"],
)
def test_many_buckets_on_four_ranks_neither_hang_nor_diverge(comp):
    steps = 4  # 24 buckets of two rounds each, ~45 collectives a rank a step: DDP's first, 3 on rebuilt buckets
    res = run_ranks(_stress, 4, comp, steps, timeout=180)
    assert res[0]["stats"]["collectives"] > 2 * steps * 6  # many buckets, two rounds each
    for r in res[1:]:  # replicas stay identical
        for a, b in zip(res[0]["params"], r["params"]):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
def _silent(rank, world):
    model = make_model()
    before = params(model)
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = register_hook(ddp, gz.Threshold(tau=1e6))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    train_steps(ddp, opt, 5, rank)
    check = len(json.dumps(state.engine.describe(), sort_keys=True).encode())
    return {
        "same": all(torch.equal(a, b) for a, b in zip(before, params(model))),
        "stats": state.stats(),
        "check": check,
    }


def test_nothing_above_threshold_sends_headers_only_and_does_not_hang():
    res = run_ranks(_silent, 2, timeout=120)
    ntensors = len(list(make_model().parameters()))
    for r in res:
        st = r["stats"]
        assert r["same"]
        # Per step: each bucket sends an 8-byte size with the engine's 8-byte non-finite flag
        # beside it, and a message of an 8-byte header and a 10-byte entry per tensor (its tau;
        # no body), plus the first step's configuration check.
        nbuckets = (st["collectives"] - 2) // 2
        assert st["bytes_sent"] - st["bytes_control"] == nbuckets * HEADER_BYTES + st["steps"] * ntensors * (
            ENTRY_BYTES + 4
        )
        assert st["bytes_control"] == (8 + r["check"]) + nbuckets * (8 + 8)


# --------------------------------------------------------------------------------------
def _topk_bytes(rank, world):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=25)  # one bucket after the rebuild too
    state = register_hook(ddp, gz.TopK(ratio=0.02))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_steps(ddp, opt, 4, rank)
    return state.stats()


def test_measured_bytes_match_the_topk_formula():
    st = run_ranks(_topk_bytes, 2)[0]
    numels = [p.numel() for p in make_model().parameters()]
    ks = [math.ceil(0.02 * n) for n in numels]
    # per tensor: an entry, the width and count bytes, k packed gaps (at most the bits of n), k fp32 values
    least = HEADER_BYTES + sum(ENTRY_BYTES + 2 + 4 * k for k in ks)
    most = HEADER_BYTES + sum(ENTRY_BYTES + 3 + math.ceil(k * n.bit_length() / 8) + 4 * k for k, n in zip(ks, numels))
    sent = (st["bytes_sent"] - st["bytes_control"]) / 4  # a step (ranks send messages of the longest length)
    assert least <= sent <= most
    assert st["bytes_raw"] == 4 * 4 * sum(numels)
    assert st["ratio_handed"] == pytest.approx(st["bytes_raw"] / st["bytes_sent"])
    assert st["bytes_raw"] / (4 * most) > 20 and st["ratio_handed"] > 15  # control: config check, sizes, flags


# --------------------------------------------------------------------------------------
def _per_rank_tau(rank, world, dtype):
    eng = gz.Engine(gz.Threshold(tau=0.5, policy="adaptive"))
    xs = {
        n: [torch.randn(shape, generator=torch.Generator().manual_seed(17 * r + i)).to(dtype) for r in range(world)]
        for i, (n, shape) in enumerate([("a", (40, 3)), ("b", (7,)), ("c", (1,))])
    }
    eng.tensor_state = {n: {"tau": 0.25 * (rank + 1)} for n in xs}  # ranks disagree on tau
    fut = eng.reduce(list(xs), [xs[n][rank] for n in xs])
    eng.flush()
    got = fut.wait()
    # Expected: every rank's own encode, with its own tau, averaged in float32.
    comp = gz.Threshold(tau=0.5, policy="adaptive")
    parts = []
    for n, per_rank in xs.items():
        acc = torch.zeros(per_rank[0].numel())
        for r in range(world):
            ctx = TensorContext(name=n, dtype=dtype, store={"tau": 0.25 * (r + 1)})
            comp.accumulate(comp.compress(per_rank[r].float(), ctx), acc)
        parts.append(acc / world)
    return {"got": got, "expected": torch.cat(parts).to(dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_each_payload_carries_its_own_tau(dtype):
    for r in run_ranks(_per_rank_tau, 2, dtype):
        assert r["got"].dtype == dtype
        assert torch.equal(r["got"], r["expected"])


# --------------------------------------------------------------------------------------
def _start_iter(rank, world):
    out = {}
    for mode in ("plain", "hook"):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.005)
        state = register_hook(ddp, gz.TopK(0.01), start_iter=3) if mode == "hook" else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        snaps = []
        for s in range(5):
            train_steps(ddp, opt, 1, rank, first=s)
            snaps.append(params(model))
            if state is not None and s == 2:
                out["stats_at_3"] = state.stats()
        out[mode] = snaps
    return out


def test_start_iter_is_plain_allreduce_before_it():
    r = run_ranks(_start_iter, 2)[0]
    for s in range(3):
        assert all(torch.equal(a, b) for a, b in zip(r["plain"][s], r["hook"][s]))
    assert not all(torch.equal(a, b) for a, b in zip(r["plain"][4], r["hook"][4]))
    st = r["stats_at_3"]
    assert st["bytes_sent"] - st["bytes_control"] == st["bytes_raw"]
