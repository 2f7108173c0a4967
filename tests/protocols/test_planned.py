"""Planned ``Flat(Int8())`` buckets (``gradzip.protocols.planned``): the general path's bytes,
results and residuals bit for bit, every check on the device, a corrupt frame NaN then raised
with the host path's text."""

from __future__ import annotations

import os
import random
import re

import pytest
import torch

import gradzip as gz
import gradzip.engine as engine_mod
import gradzip.kernels as K
from gradzip.engine import Engine
from gradzip.protocols.twophase import owner_key, piece_key
from gradzip.wire import FrameError, host_refusal
from tests.support import run_ranks

#: The CPU's tests run the Triton kernels interpreted (the GPU's test runs them compiled).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")

SIZES = {"a": (37, 11), "b": (300,), "c": (5,)}  # 712 elements: pieces of 178 at 4 ranks, 142/143 at 5
OTHER = {"d": (64, 9), "e": (3,)}  # a second bucket: 579 elements, pieces of 144 and 145 at 4 ranks
EVEN = {"d": (64, 9), "e": (8,)}  # loopback ranks all send this rank's pieces: they must be alike
SPECS = ("Flat(Int8())", "Flat(SignSGD())")


class _Kernels:
    """``GRADZIP_KERNELS`` set for a block (pooled ranks outlive a test), the GPU's side taken."""

    def __init__(self, value: str | None, gpu_side: bool = True) -> None:
        self.value, self.side = value, K.gpu_side_on_cpu() if gpu_side else None

    def __enter__(self):
        self.old = os.environ.get("GRADZIP_KERNELS")
        if self.value is None:
            os.environ.pop("GRADZIP_KERNELS", None)
        else:
            os.environ["GRADZIP_KERNELS"] = self.value
        if self.side is not None:
            self.side.__enter__()
        return self

    def __exit__(self, *exc):
        if self.side is not None:
            self.side.__exit__(*exc)
        if self.old is None:
            os.environ.pop("GRADZIP_KERNELS", None)
        else:
            os.environ["GRADZIP_KERNELS"] = self.old
        return False


def _bucket(sizes: dict, step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    flat = torch.randn(sum(torch.Size(s).numel() for s in sizes.values()), generator=g)
    flat[3] = 0.0
    views = [v.view(s) for v, s in zip(flat.split([torch.Size(s).numel() for s in sizes.values()]), sizes.values())]
    return list(sizes), views, flat


def _steps(engine: Engine, rank: int, steps: int, corrupt=None, buckets=(SIZES, OTHER)) -> list:
    """``steps`` steps of two buckets; per step each bucket's result (or the error raised)."""
    got = []
    for s in range(steps):
        for sizes in buckets:
            names, views, flat = _bucket(sizes, s, rank)
            if corrupt is not None:
                corrupt(engine.step, names)
            try:
                fut = engine.reduce(names, views, dest=flat)
                engine.flush()
                got.append(fut.wait().clone())
            except FrameError as e:
                got.append(str(e))
        engine.end_step()
    return got


def _residuals(e: Engine) -> dict:
    return {k: v.clone() for k, v in e.memory.residuals.items()}


def _against_general(rank, world):
    """Per rank: the planned path and the CPU's reference kernels (the general path on the CPU's
    side), two steps of two buckets; then a corrupt first-round message."""
    out = {}
    real = engine_mod.plan_for
    runs = {}
    for spec in SPECS:
        for label, kernels, side, plan in (("planned", "triton", True, True), ("reference", "reference", False, False)):
            engine_mod.plan_for = real if plan else (lambda protocol, call, plans: None)
            try:
                with _Kernels(kernels, side):
                    e = Engine(gz.parse(spec))
                    got = _steps(e, rank, 2)
                    stats = {k: v for k, v in e.stats().items() if k.startswith("bytes")}
                    runs[spec, label] = (got, _residuals(e), stats, len(e._plans))
            finally:
                engine_mod.plan_for = real
    out["runs"] = runs

    # Step 1: rank 1 finds rank 3's first-round message of bucket SIZES with a code -128.

    def corrupt(step, names):
        if step != 1 or rank != 1 or names != list(SIZES):
            return
        (plan,) = [p for k, p in e._plans.items() if k[0] == tuple(SIZES)]
        check = plan.check1

        def bad(whole, status):
            w1 = plan.out_splits[0]
            whole[3 * w1 + 14 + 4 * 1] = 0x80  # after the table (14 bytes) and one block scale
            check(whole, status)
            plan.check1 = check

        plan.check1 = bad

    with _Kernels("triton"):
        e = Engine(gz.parse("Flat(Int8())"))
        _steps(e, rank, 1)
        before = _residuals(e)
        out["bad"] = _steps(e, rank, 1, corrupt)  # the corrupt step: rolled back
        now = _residuals(e)
        out["restored"] = now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in now)
        out["nonfinite_steps"] = e.nonfinite_steps
        out["error"] = _steps(e, rank, 1)[0]  # its first call raises
    return out


@interpreted
def test_four_ranks_match_the_general_path_and_the_reference_and_refuse_a_corrupt_frame():
    res = run_ranks(_against_general, 4)
    for r, log in enumerate(res):
        for spec in SPECS:
            p_out, p_res, p_bytes, plans = log["runs"][spec, "planned"]
            o, rs, b, _ = log["runs"][spec, "reference"]
            assert plans == 2, spec  # both buckets planned
            assert all(torch.equal(x, y) for x, y in zip(p_out, o)), (r, spec)
            assert p_res.keys() == rs.keys() and all(torch.equal(p_res[k], rs[k]) for k in rs), (r, spec)
            # the same messages; the GPU's side adds each owner's verdict byte after its second one
            assert p_bytes["bytes_sent"] == b["bytes_sent"] + 2 * 2 and p_bytes["bytes_payload"] == b["bytes_payload"]
            assert all(torch.isfinite(x).all() for x in p_out)
            assert all(torch.equal(x, y) for x, y in zip(p_out, res[0]["runs"][spec, "planned"][0]))  # ranks alike
        first, second = log["bad"]
        assert torch.isnan(first).all() and torch.isfinite(second).all()  # only the corrupt bucket
        assert log["restored"] and log["nonfinite_steps"] == 1
        if r == 1:  # the host path's text: the frame, its tensor, the sender, the field
            want = r"corrupt message from rank 3: frame 0 \(tensor 'flat:3:[0-9a-f]+#1/4'\), field body.codes"
            assert re.search(want + r".*code -128", log["error"]), log["error"]
        else:
            assert "field peer: rank(s) [1] refused a corrupt message" in log["error"], log["error"]


@interpreted
def test_the_plan_sends_the_general_paths_bytes_and_gets_its_results_and_stats():
    """Loopback ranks, the GPU's side, the plan on and off: every collective's input, byte for
    byte, the results, the residuals and ``stats()`` alike (Int8 at 4 and 8 ranks, SignSGD at 8)."""
    from benchmarks.host_syncs import EngineLoopback

    real = engine_mod.plan_for
    for spec, world in ((SPECS[0], 4), (SPECS[0], 8), (SPECS[1], 8)):
        runs = []
        for plan in (True, False):
            sent = []
            comm = EngineLoopback(world)
            for op in ("alltoall", "allgather", "allreduce"):
                fn = getattr(comm, op)
                i = 0 if op == "allreduce" else 1  # the input
                setattr(comm, op, lambda *a, fn=fn, name=op, i=i, **k: sent.append((name, a[i].clone())) or fn(*a, **k))
            engine_mod.plan_for = real if plan else (lambda protocol, call, plans: None)
            try:
                with _Kernels("triton"):
                    e = Engine(gz.parse(spec), process_group=comm)
                    got = _steps(e, 0, 2, buckets=(SIZES, EVEN))
            finally:
                engine_mod.plan_for = real
            assert bool(e._plans) == plan
            runs.append((got, _residuals(e), e.stats(), sent))
        (a, ra, sa, wa), (b, rb, sb, wb) = runs
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
        counts = [{k: v for k, v in st.items() if k.startswith(("bytes", "collectives", "steps"))} for st in (sa, sb)]
        assert counts[0] == counts[1] and counts[0]["bytes_sent"] > 0
        assert [op for op, _ in wa] == [op for op, _ in wb] and all(torch.equal(x, y) for (_, x), (_, y) in zip(wa, wb))


def _fuzz_plan(spec):
    from benchmarks.host_syncs import EngineLoopback

    e = Engine(gz.parse(spec), process_group=EngineLoopback(4))
    _steps(e, 0, 1, buckets=(SIZES, EVEN))
    (plan,) = [p for k, p in e._plans.items() if k[0] == tuple(SIZES)]
    return e, plan


def _host_round1(plan, buf, step=0):
    world, w1 = plan.world, plan.out_splits[0]
    rows = buf.view(world, w1)[:, : w1 - 1]
    return host_refusal(
        list(rows.unbind(0)),
        [[torch.Size([plan.lens[plan.me]])]] * world,
        [[torch.float32]] * world,
        [[torch.float32]] * world,
        plan.codec,
        [[piece_key(plan.key, plan.me, world)]] * world,
        list(range(world)),
        step,
        layout=False,
    )


def _host_round2(plan, buf, step=0):
    world = plan.world
    grid = buf.view(world, plan.w2)
    return host_refusal(
        list(grid[:, :-1].unbind(0)),
        [[torch.Size([m])] for m in plan.lens],
        [[torch.float32]] * world,
        [[torch.float32]] * world,
        plan.codec,
        [[owner_key(plan.key, j, world)] for j in range(world)],
        list(range(world)),
        step,
        layout=False,
    )


#: Per codec: fuzzed bytes, and corruptions run through the engine (round 2?, byte, value): a
#: table byte, a code -128 (Int8) or a negative scale (SignSGD's at bytes 14-17), in each round.
FUZZ = {
    "Flat(Int8())": (80, [(False, 3, 7), (False, 20, 0x80), (True, 9, 1), (True, 18, 0x80)]),
    "Flat(SignSGD())": (40, [(False, 3, 7), (False, 17, 0xBF), (True, 9, 1), (True, 17, 0xBF)]),
}


@interpreted
@pytest.mark.parametrize("spec", SPECS)
def test_every_corruption_the_host_refuses_sets_the_status_and_no_other_does(spec):
    """The frame fuzz on a plan's checks: a random byte of a received round set to a random
    value (the flag bytes aside: a non-finite flag, not a frame). The device's check flags the
    round exactly where the host path's parse of the same bytes refuses it; through the engine
    such a round gives a NaN result and, at the next call, the host path's error."""
    rng = random.Random(0)
    with _Kernels("triton"):
        e, plan = _fuzz_plan(spec)
        cases, through = FUZZ[spec]
        good1, good2 = plan.recv1.clone(), plan.recv2.clone()
        w1 = plan.out_splits[0]
        flagged = drawn = 0
        for case in range(cases):
            second = case % 2 == 1
            good, w = (good2, plan.w2) if second else (good1, w1)
            buf = good.clone()
            while True:
                at = rng.randrange(buf.numel())
                if second or at % w != w - 1:  # round 1's last byte of a row is the flag
                    break
            if second and at % w == w - 1:
                continue  # an owner's verdict byte: the peer-refusal path, tested above
            byte = rng.choice([0x80, 0xFF, 0x01, rng.randrange(256)])
            if int(buf[at]) == byte:
                continue
            buf[at] = byte
            drawn += 1
            status = torch.zeros(4, dtype=torch.int64)
            (plan.check2 if second else plan.check1)(buf, status)
            err = (_host_round2 if second else _host_round1)(plan, buf)
            assert bool((status[:3] > 0).any()) == (err is not None), (case, second, at, byte, status, err)
            flagged += err is not None
        assert flagged > 5 and drawn - flagged > 5  # both kinds were drawn

        # Through the engine: the corrupt round is NaN, then the host path's text is raised.
        for case, (second, at, byte) in enumerate(through):

            def corrupt(step, names, second=second, at=at, byte=byte):
                if names != list(SIZES):
                    return
                name = "check2" if second else "check1"
                check = getattr(plan, name)

                def bad(whole, status):
                    whole[at] = byte
                    want = (_host_round2 if second else _host_round1)(plan, whole, e.step)
                    expected.append(str(want))
                    check(whole, status)
                    setattr(plan, name, check)

                setattr(plan, name, bad)

            expected = []
            got = _steps(e, 0, 1, corrupt, (SIZES, EVEN))
            assert torch.isnan(got[0]).all() and torch.isfinite(got[1]).all(), case
            names, views, flat = _bucket(SIZES, 0, 0)
            with pytest.raises(FrameError) as info:
                fut = e.reduce(names, views, dest=flat)
                e.flush()
                fut.wait()
            assert str(info.value) == expected[0], case
            e.end_step()


@interpreted
def test_what_takes_the_general_path():
    """The plan is for Flat(Int8(block=...)) and Flat(SignSGD()) on TwoPhase's world sizes with
    error feedback and Triton; everything else is the general path's."""
    from benchmarks.host_syncs import EngineLoopback

    with _Kernels("triton"):
        for spec, world, ok in (
            ("Flat(Int8())", 4, True),
            ("Flat(Int8())", 2, False),  # AllGather
            ("Flat(Int8(block=None))", 4, False),
            ("Flat(Int8(block=65536))", 4, False),  # a block longer than a program's tile
            ("Flat(SignSGD())", 4, True),
            ("Flat(SignSGD(block=64))", 4, False),
            ("Int8()", 4, False),
        ):
            e = Engine(gz.parse(spec), process_group=EngineLoopback(world))
            _steps(e, 0, 1, buckets=(SIZES,))
            assert bool(e._plans) == ok, spec
    with _Kernels("triton"):  # a new layout of the same tensors (DDP's rebuilt buckets): the old plans go
        e = Engine(gz.parse("Flat(Int8())"), process_group=EngineLoopback(4))
        _steps(e, 0, 1, buckets=(SIZES, EVEN))
        _steps(e, 0, 1, buckets=({**SIZES, **EVEN},))
        assert [k[0] for k in e._plans] == [tuple({**SIZES, **EVEN})]
    with _Kernels("numba"):
        e = Engine(gz.parse("Flat(Int8())"), process_group=EngineLoopback(4))
        _steps(e, 0, 1, buckets=(SIZES,))
        assert not e._plans  # the CPU's kernels: the general path


def _ddp_many_buckets(rank, world):
    from tests.support.models import many_buckets_model, params, train_many_buckets

    got = {}
    for label, kernels, side in (("planned", "triton", True), ("reference", "reference", False)):
        with _Kernels(kernels, side):
            model = many_buckets_model()
            state = train_many_buckets(model, gz.parse("Flat(Int8())"), rank, 8)
            got[label] = (params(model), len(state.engine._plans))
    return got


@interpreted
@pytest.mark.long
def test_ddp_with_one_megabyte_buckets_on_four_ranks_trains_as_the_reference():
    """The collective-order check: DDP with ``bucket_cap_mb=1`` (several buckets), 4 ranks, 8
    steps of each rank's own batch size, the planned buckets against the CPU's reference
    kernels: the same parameters bit for bit on every rank, every bucket planned."""
    res = run_ranks(_ddp_many_buckets, 4)
    for r, got in enumerate(res):
        (mine, plans), (ref, none) = got["planned"], got["reference"]
        assert plans >= 2 and none == 0, (r, plans, none)
        assert all(torch.equal(a, b) for a, b in zip(mine, ref)), r
        assert all(torch.equal(a, b) for a, b in zip(mine, res[0]["planned"][0])), r


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS)
def test_on_cuda_a_planned_bucket_equals_the_cpu_reference(spec):
    """On a device, 8 loopback ranks: the planned bucket's results and residuals over three
    steps equal the CPU's reference kernels' (the general path on the CPU's side) bit for bit,
    and the bucket was planned."""
    from benchmarks.host_syncs import EngineLoopback

    sizes = {"a": (256, 9), "b": (640,)}  # 2,944 elements: 368 a rank
    runs = {}
    for device, kernels in (("cuda", None), ("cpu", "reference")):
        with _Kernels(kernels, gpu_side=False):
            e = Engine(gz.parse(spec), process_group=EngineLoopback(8))
            got = []
            for s in range(3):
                names, views, flat = _bucket(sizes, s, 0)
                flat = flat.to(device)
                views = [v.view(x.shape) for v, x in zip(flat.split([x.numel() for x in views]), views)]
                fut = e.reduce(names, views, dest=flat)
                e.flush()
                got.append(fut.wait().cpu())
                e.end_step()
            runs[device] = (got, {k: v.cpu() for k, v in e.memory.residuals.items()}, len(e._plans))
    (a, ra, plans), (b, rb, _) = runs["cuda"], runs["cpu"]
    assert plans == 1
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
