"""Fewer copies: the engine writes into the caller's buffer (DDP's bucket), Identity
reduces that buffer in place, and residuals alternate between two buffers per tensor."""

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradzip.codecs import Identity, SignSGD, TopK
from gradzip.costmodel import Link
from gradzip.engine import Engine
from gradzip.feedback import ErrorFeedback
from gradzip.hooks import register_hook
from gradzip.policy import Policy
from gradzip.protocols.powersgd import PowerSGD
from tests.support import run_ranks

BIG = 300_000  # float32 elements: 1.2 MB, where a fresh buffer costs page faults on the CPU


# -- two buffers per residual --------------------------------------------------------------------
def _cycle(mem: ErrorFeedback, name: str, g: torch.Tensor, sent_frac: float = 0.5) -> torch.Tensor:
    """One step as a codec runs it: compensate into the spare buffer, subtract what was sent."""
    c = mem.compensate(name, g)
    mem.set(name, c.sub_(c * sent_frac))
    mem.release()
    return mem.residual(name)


def test_residuals_alternate_between_two_buffers_and_values_are_unchanged():
    gen = torch.Generator().manual_seed(0)
    mem, prev = ErrorFeedback(), None
    ptrs = []
    for _ in range(6):
        g = torch.randn(BIG, generator=gen)
        r = _cycle(mem, "w", g)
        ptrs.append(r.data_ptr())
        # the same algorithm without reuse: bit-identical residuals
        c = g.clone() if prev is None else g + prev
        prev = c - c * 0.5
        assert torch.equal(r, prev)
    assert len(set(ptrs[1:])) == 2 and ptrs[1:] == ptrs[1:3] * 2 + ptrs[1:2]  # steady state: two, in turn


def test_the_residual_a_step_started_from_is_kept_until_the_step_ends():
    """Rollback: the residual replaced in a step is never handed out again while the step is
    open (a second write of the same name in the step gets a fresh buffer), and restore() puts
    it back."""
    mem = ErrorFeedback()
    gen = torch.Generator().manual_seed(1)
    _cycle(mem, "w", torch.randn(BIG, generator=gen))
    _cycle(mem, "w", torch.randn(BIG, generator=gen))
    start = mem.residual("w")
    kept = start.clone()
    for _ in range(3):  # without release(): all in one step
        c = mem.compensate("w", torch.randn(BIG, generator=gen))
        assert c.data_ptr() != start.data_ptr()
        mem.set("w", c)
    assert torch.equal(start, kept)
    mem.restore()
    assert mem.residual("w") is start and torch.equal(start, kept)


def test_restore_forgets_a_residual_that_did_not_exist():
    mem = ErrorFeedback()
    mem.set("new", torch.ones(3))
    mem.restore()
    assert mem.residual("new") is None


# -- in place on the caller's buffer -----------------------------------------------------------
def _dest_run(rank, world, comp_name):
    comp = {
        "identity": Identity(),
        "policy": Policy(TopK(0.01), auto=True, link=Link(1e15, 0.0), world_size=world),  # all plain allreduce
        "powersgd": PowerSGD(rank=2),
        "sign": SignSGD(),
    }[comp_name]
    eng = Engine(comp)
    out = {}
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        buf = torch.randn(6 * 50 + 40, generator=gen)
        a, b = buf[: 6 * 50].view(6, 50), buf[6 * 50 :]
        want = buf.clone()
        fut = eng.reduce(["a", "b"], [a, b], dest=buf)
        eng.flush()
        got = fut.wait()
        eng.end_step()
        out[step] = {"same_storage": got.data_ptr() == buf.data_ptr(), "got": got.clone(), "input": want}
    return out


def test_identity_reduces_the_destination_in_place():
    res = run_ranks(_dest_run, 2, "identity", timeout=90)
    for step in range(3):
        mean = (res[0][step]["input"] + res[1][step]["input"]) / 2
        for r in res:
            assert r[step]["same_storage"]
            assert torch.allclose(r[step]["got"], mean, rtol=0, atol=1e-6)
        assert torch.equal(res[0][step]["got"], res[1][step]["got"])


def test_policy_whole_plain_route_and_powersgd_write_the_destination():
    for name in ("policy", "powersgd", "sign"):
        res = run_ranks(_dest_run, 2, name, timeout=90)
        for step in range(3):
            assert all(r[step]["same_storage"] for r in res), name
            assert torch.equal(res[0][step]["got"], res[1][step]["got"]), name
        if name == "policy":
            mean = (res[0][2]["input"] + res[1][2]["input"]) / 2
            assert torch.allclose(res[0][2]["got"], mean, rtol=0, atol=1e-6)


def _nan_in_place(rank, world, policy="raise"):
    eng = Engine(Identity(), on_nonfinite=policy)
    buf = torch.ones(30)
    if rank == 1:
        buf[17] = float("nan")
    try:
        fut = eng.reduce(["a", "b"], [buf[:10], buf[10:]], dest=buf)
        eng.flush()
        got = fut.wait()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)
    return got.clone()


def test_in_place_identity_names_the_rank_and_tensor_with_the_nan():
    res = run_ranks(_nan_in_place, 2, timeout=90)
    assert "on another rank" in res[0]
    assert "['b'] on rank 1" in res[1]


def test_in_place_identity_leaves_a_nan_step_as_plain_ddp_does_on_every_rank():
    """Identity has no state to roll back: with "skip" its average is DDP's, NaN where it arose
    on any rank (GradScaler skips the step on it), read by no extra pass."""
    res = run_ranks(_nan_in_place, 2, "skip", timeout=90)
    for got in res:
        assert got.shape == (30,) and bool(got[17].isnan())
        assert torch.equal(torch.cat([got[:17], got[18:]]), torch.ones(29))


def _ddp_bucket(rank, world, use_hook):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    ddp = DDP(model, bucket_cap_mb=1)
    if use_hook:
        register_hook(ddp, Identity())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_identity_hook_in_place_is_bit_identical_to_ddp():
    plain = run_ranks(_ddp_bucket, 2, False)
    hooked = run_ranks(_ddp_bucket, 2, True)
    for a, b in zip(plain[0], hooked[0]):
        assert torch.equal(a, b)


def test_cat_target_uses_dest_only_when_it_fits_and_holds_no_body():
    from types import SimpleNamespace

    from gradzip.protocols.allreduce import _cat_target

    a, b = torch.randn(3), torch.randn(4)
    dest = torch.empty(7)
    assert _cat_target([a, b], SimpleNamespace(dest=dest)).data_ptr() == dest.data_ptr()
    assert _cat_target([a, b], SimpleNamespace(dest=None)) is None
    assert _cat_target([a, b], SimpleNamespace(dest=torch.empty(8))) is None  # not exactly their length
    assert _cat_target([a.half(), b.half()], SimpleNamespace(dest=dest)) is None  # another dtype
    assert _cat_target([dest[4:], dest[:3]], SimpleNamespace(dest=dest)) is None  # bodies lie in it
    assert _cat_target([a, b], SimpleNamespace(dest=torch.empty(14)[::2])) is None  # not contiguous


def test_the_device_nonfinite_flag_is_exact():
    """Hypothesis: engine.device_nonfinite (``(x * 0).sum()`` is NaN) says what ``isfinite``
    says, for values at the edge of every dtype's range, one or several tensors."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from gradzip.engine import device_nonfinite

    special = [0.0, -0.0, 1e-45, 1.0, -3.0e38, 3.0e38, 6.5e4, float("inf"), float("-inf"), float("nan")]

    @settings(max_examples=80, deadline=None)
    @given(
        st.lists(
            st.tuples(
                st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
                st.lists(st.sampled_from(special), max_size=40),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def check(parts):
        ts = [torch.tensor(v, dtype=torch.float64).to(d) for d, v in parts]  # out of range: inf
        want = any(not bool(torch.isfinite(t).all()) for t in ts)
        assert bool(device_nonfinite(ts, "cpu")) == want

    check()
