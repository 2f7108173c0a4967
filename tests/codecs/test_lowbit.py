"""Low-bit quantizers (Int4, Int2, FP8, FP4): grids, error feedback, frames, and 2 gloo ranks.

Hypothesis properties (a message's round trip, error feedback, the grids' error bounds, zeros),
awkward shapes and every dtype, the grids against brute force, every corrupt field refused
with a FrameError naming it, and one multi-rank run: the engine's average and wire bytes, the
DDP hook, and DiLoCo with ``compression=Int4()``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradzip as gz
from gradzip import wire
from gradzip.codecs.base import TensorContext
from gradzip.codecs.lowbit import FMT_FP4, FMT_FP8, FMT_INT2, FMT_INT4, FP4, FP8, Int2, Int4, block_scales, pack_codes
from gradzip.kernels import pack_uint, quant_layout
from gradzip.kernels.bitpack import pack_nbit
from gradzip.protocols import as_protocol
from gradzip.wire import ENTRY_BYTES, HEADER_BYTES, FrameError, Payload, pack_frames, unpack_frames
from tests.support import run_ranks

PROPS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BITS = {Int4: 4, Int2: 2, FP8: 8, FP4: 4}
TOP = {Int4: 7.0, Int2: 3.0, FP8: 448.0, FP4: 1.0}
CODECS = [Int4(), Int4(block=5), Int4(block=None), Int2(), Int2(block=7), FP8(), FP8(block=3), FP4(), FP4(block=9)]
IDS = [repr(c) for c in CODECS]
EXACT = (Int4, FP8, FP4)  # r + d == c bit for bit


def body_bytes(c, n):
    nb, _ = quant_layout(n, c.block)
    return 4 * nb + math.ceil(n * BITS[type(c)] / 8)


def scales_of(c, p):
    """Each element's block scale, float64, read from the frame."""
    n = p.numel
    nb, b = quant_layout(n, c.block)
    s = p.body[: 4 * nb].clone().view(torch.float32).double()
    return s.repeat_interleave(b)[:n]


@st.composite
def tensors(draw, dtype=None):
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 20), min_size=0, max_size=3)))
    n = math.prod(shape)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(n, generator=g, dtype=torch.float64) * draw(st.sampled_from([1e-4, 1.0, 300.0]))
    if n and draw(st.booleans()):  # exact zeros, and a wide range inside a block
        x[:: max(1, n // 3)] = 0.0
        x[1 :: max(1, n // 2)] *= 50
    return x.to(dtype).reshape(shape)


def ctx(x, step=0):
    return TensorContext(name="w", step=step, dtype=x.dtype, store={})


# -- properties ----------------------------------------------------------------------------
@pytest.mark.parametrize("comp", CODECS, ids=IDS)
@PROPS
@given(xs=st.lists(tensors(), min_size=1, max_size=3))
def test_a_message_decodes_to_what_compress_sent(comp, xs):
    ps = [comp.compress(x, ctx(x)) for x in xs]
    msg = pack_frames(ps)
    assert msg.numel() >= HEADER_BYTES + len(xs) * ENTRY_BYTES + sum(body_bytes(comp, x.numel()) for x in xs)
    got = unpack_frames(msg, [x.shape for x in xs], [x.dtype for x in xs], check=comp)
    for x, p, q in zip(xs, ps, got):
        assert q.checked and p.body.numel() == body_bytes(comp, x.numel()) and torch.equal(q.body, p.body)
        y = comp.decompress(q)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.equal(y, comp.decompress(p))
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        one, out = torch.zeros(x.numel(), dtype=acc), torch.zeros(x.numel(), dtype=acc)
        comp.accumulate(p, one)  # the values before the cast to the gradient's dtype
        comp.accumulate_many([q, q], out)
        assert torch.equal(out, 2 * one) and torch.equal(one.to(x.dtype).reshape(x.shape), y)


@pytest.mark.parametrize("comp", CODECS, ids=IDS)
@PROPS
@given(data=st.data())
def test_error_feedback_keeps_everything(comp, data):
    """``r + d == c`` exactly for Int4, FP8 and FP4 (Sterbenz); Int2's residual is ``c - d``
    correctly rounded (exact wherever ``d / c`` lies in [1/2, 2])."""
    dtype = data.draw(st.sampled_from(DTYPES))
    r = None
    x0 = data.draw(tensors(dtype))
    for step in range(3):  # later steps: smaller gradients, where the residual dominates
        g = torch.Generator().manual_seed(step)
        x = x0 if step == 0 else (torch.randn(x0.shape, generator=g, dtype=torch.float64) * 10**-step).to(dtype)
        c = x.to(torch.float64 if dtype == torch.float64 else torch.float32) + (r if r is not None else 0)
        p, r = comp.encode(x, ctx(x, step), r, feedback=True)
        d = comp.decompress(p)
        assert r.dtype == c.dtype and d.dtype == c.dtype
        err = (r.double() + d.double() - c.double()).abs()
        if isinstance(comp, EXACT):
            assert torch.equal(r + d, c) and not bool(err.any())
        else:
            ratio = d.double() / c.double()
            sterbenz = (d == 0) | ((ratio >= 0.5) & (ratio <= 2))
            assert not bool(err[sterbenz].any())
            ulp = torch.nextafter(r.abs(), torch.tensor(math.inf, dtype=r.dtype)).double() - r.abs().double()
            assert bool((err <= ulp / 2).all())


@pytest.mark.parametrize("comp", CODECS, ids=IDS)
@PROPS
@given(x=tensors())
def test_decoded_error_within_the_grids_bound(comp, x):
    p = comp.compress(x, ctx(x))
    v = x.double().reshape(-1)
    d = comp.decompress(p).double().reshape(-1) if x.dtype in (torch.float32, torch.float64) else None
    if d is None:  # half gradients: the float32 values before the cast back
        out = torch.zeros(v.numel())
        comp.accumulate(p, out)
        d = out.double()
    s = scales_of(comp, p)
    top = TOP[type(comp)]
    amax = v.abs()
    if v.numel():  # the scale: max|x| / top rounded down, never above the block's max
        nb, b = quant_layout(v.numel(), comp.block)
        pad = torch.nn.functional.pad(v.abs(), (0, nb * b - v.numel())).view(nb, b).amax(1)
        assert torch.equal(p.body[: 4 * nb].clone().view(torch.float32), block_scales(pad, top))
        amax = pad.repeat_interleave(b)[: v.numel()]
    assert bool((s * top <= amax).all())
    slack = 2.0**-20 * s + 2.0**-20 * v.abs()  # the roundings of t = x / S and of the product
    err = (d - v).abs()
    if isinstance(comp, Int4):
        assert bool((err <= s / 2 + slack).all())
        q = d / torch.where(s > 0, s, 1)  # integers in [-7, 7], up to the product's rounding
        assert bool(((q - q.round()).abs() <= 1e-6).all()) and bool((q.abs() <= 7 + 1e-6).all())
    elif isinstance(comp, Int2):
        assert bool((err <= s + slack).all())  # half of the step 2 S_b
        assert bool(((d.abs() - s).abs() <= slack).logical_or((d.abs() - 3 * s).abs() <= 4 * slack).all())
    elif isinstance(comp, FP8):
        assert bool((err <= torch.maximum(v.abs() * 2.0**-4, s * 2.0**-10) + slack).all())
    else:
        big = (v.abs() >= s * 2.0**-6) & (s > 0)
        ratio = d[big] / v[big]
        assert bool(((ratio >= 2 / 3 - 1e-6) & (ratio <= 4 / 3 + 1e-6)).all())
        assert bool((err[~big] <= s[~big] * 2.0**-7 + slack[~big]).all())
        m = d[d != 0].abs() / s[d != 0]  # powers of two
        assert torch.equal(torch.frexp(m).mantissa, torch.full_like(m, 0.5))


@pytest.mark.parametrize("comp", CODECS, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_awkward_shapes_and_zeros(comp, dtype):
    b = comp.block or 8
    shapes = [(0,), (0, 3), (), (1,), (b - 1,) if b > 1 else (2,), (b,), (b + 1,), (3, 2, b + 1)]
    for shape in shapes:
        n = math.prod(shape)
        x = torch.linspace(-3, 2, n, dtype=torch.float64).to(dtype).reshape(shape)
        p = comp.compress(x, ctx(x))
        assert p.body.numel() == body_bytes(comp, n) and p.fmt == next(iter(comp.formats.values()))
        y = comp.decompress(p)
        assert y.shape == x.shape and y.dtype == x.dtype and bool(torch.isfinite(y).all())
        z = comp.decompress(comp.compress(torch.zeros(shape, dtype=dtype)))
        assert not bool(z.any())  # an all-zero block decodes to zeros
    # a zero element of a nonzero block: zero, except Int2's (sent as +S_b)
    x = torch.tensor([0.0, 1.0, -0.5, 0.0, 0.25], dtype=dtype)
    y = comp.decompress(comp.compress(x))
    assert comp.keeps_zeros == (not isinstance(comp, Int2))
    assert bool((y[x == 0] == 0).all()) == comp.keeps_zeros


# -- the grids against brute force ---------------------------------------------------------
def _nearest(t, levels):
    """Per element the nearest of ``levels`` (sorted), and the distance to it."""
    i = torch.searchsorted(levels, t).clamp(1, len(levels) - 1)
    lo, hi = levels[i - 1], levels[i]
    return torch.minimum((t - lo).abs(), (hi - t).abs())


def test_grids_round_to_the_nearest_level():
    g = torch.Generator().manual_seed(0)
    n = 20000
    cases = {
        Int4(block=None): torch.arange(-7.0, 8.0),
        Int2(block=None): torch.tensor([-3.0, -1.0, 1.0, 3.0]),
        FP4(block=None): torch.tensor([0.0] + [s * 2.0**k for s in (-1, 1) for k in range(-6, 1)]).sort().values,
        FP8(block=None): torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float(),
    }
    for comp, levels in cases.items():
        levels = levels[torch.isfinite(levels)].double().unique()
        top = TOP[type(comp)]
        x = torch.cat([torch.tensor([top, -top]), (torch.rand(n, generator=g) * 2 - 1) * top])
        x[2:200] *= torch.exp2(-torch.arange(198.0) / 10)  # down to 2**-20: FP4's zero, e4m3's subnormals
        p = comp.compress(x)
        s = scales_of(comp, p)
        assert float(s[0]) == 1.0  # max|x| = top: the scale is one, the levels are the grid
        d = comp.decompress(p).double()
        dist = _nearest(x.double(), levels)
        assert torch.equal((d - x.double()).abs(), dist), type(comp).__name__
        assert bool(torch.isin(d, levels).all())


def test_ties():
    cases = [
        (Int4(block=None), [7.0, 2.5, 3.5, -2.5, 0.5], [7.0, 2.0, 4.0, -2.0, 0.0]),  # to even
        (Int2(block=None), [3.0, 2.0, -2.0, 0.0, -0.0], [3.0, 3.0, -3.0, 1.0, 1.0]),  # away from zero; zero +
        (FP4(block=None), [1.0, 0.75, 0.375, 2.0**-7, -(2.0**-7)], [1.0, 0.5, 0.25, 0.0, 0.0]),  # to the smaller
    ]
    for comp, x, want in cases:
        assert comp.decompress(comp.compress(torch.tensor(x))).tolist() == want
    p = FP8(block=None).compress(torch.tensor([448.0, -1e-30, 0.0, -0.0]))
    assert p.body[4:].tolist() == [0x7E, 0, 0, 0]  # zeros of either sign as +0, never 0x80


def test_codes_pack_as_bitpack_packs_them():
    g = torch.Generator().manual_seed(1)
    for bits in (2, 4, 8):
        for n in (0, 1, 3, 5, 8, 33):
            codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
            assert torch.equal(pack_codes(codes, bits), pack_nbit(codes, bits))
            assert torch.equal(pack_codes(codes, bits), pack_uint(codes, bits))
    # the nibbles of Int4 and FP4 as the docstring's table says
    assert Int4(block=None).compress(torch.tensor([7.0, -7.0, 1.0])).body[4:].tolist() == [0x7 | 0x9 << 4, 0x1]
    assert FP4(block=None).compress(torch.tensor([1.0, -0.5, 2.0**-6])).body[4:].tolist() == [0x7 | 0xE << 4, 0x1]


def test_non_finite_and_huge_blocks_are_sent_with_scale_zero():
    x = torch.tensor([1.0, -2.0, 3.0, 4.0, math.inf, math.nan, 5.0, 6.0, 1e300, 1.0, 2.0, 3.0], dtype=torch.float64)
    for comp in (Int4(block=4), Int2(block=4), FP8(block=4), FP4(block=4)):
        p = comp.compress(x)
        s = p.body[:12].clone().view(torch.float32).tolist()
        assert s[1] == 0.0 and s[2] == 0.0 and s[0] > 0  # NaN/inf block, float64 beyond float32: zeros
        comp.check_frame(p)
        d = comp.decompress(p)
        assert bool(torch.isfinite(d).all()) and not bool(d[4:].any())


def test_arguments_and_declarations():
    assert (Int4().block, Int2().block, FP8().block, FP4().block) == (64, 64, 128, 64)
    assert gz.parse("Int4(block=32)") == Int4(block=32) and repr(FP8(block=None)) == "FP8(block=None)"
    for c in (Int4(), Int2(), FP8(), FP4()):
        assert c.biased and c.fixed_frames and not c.summable
    assert (Int4.formats, Int2.formats, FP8.formats, FP4.formats) == (
        {"INT4": FMT_INT4},
        {"INT2": FMT_INT2},
        {"FP8": FMT_FP8},
        {"FP4": FMT_FP4},
    )
    assert wire.formats()[26] == "Int4.INT4" and wire.formats()[29] == "FP4.FP4"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="block must be"):
            Int4(block=bad)
    with pytest.raises(TypeError, match="floating point"):
        FP4().compress(torch.arange(4))
    # the protocols that carry them: AllGather below 4 ranks, TwoPhase from 4 on
    assert type(as_protocol(Int4(), 2)).__name__ == "AllGather"
    assert type(as_protocol(Int4(), 4)).__name__ == "TwoPhase"


# -- corrupt frames ------------------------------------------------------------------------
def _frame(comp, n=13):
    x = torch.linspace(-1, 1, n)
    x[n // 2] = 0.0
    return comp.compress(x)


def _with(p, body=None, **kw):
    fields = dict(body=p.body if body is None else body, shape=p.shape, dtype=p.dtype, fmt=p.fmt)
    fields.update(vdtype=p.vdtype, scale=p.scale)
    fields.update(kw)
    return Payload(**fields)


def _refused(comp, p, field):
    with pytest.raises(FrameError) as e:
        comp.check_frame(p)
    assert e.value.field == field, e.value
    with pytest.raises(FrameError) as e:
        comp.decompress(p)
    assert e.value.field == field
    # in a message, after a good frame: named with its index
    good = _frame(comp, 6)
    with pytest.raises(FrameError) as e:
        comp.check_frames([good, p])
    assert e.value.field == field and e.value.frame == 1


@pytest.mark.parametrize("comp", [Int4(block=4), Int2(block=4), FP8(block=4), FP4(block=4)], ids=repr)
def test_corrupt_frames_raise_naming_the_field(comp):
    p = _frame(comp)
    comp.check_frame(p)
    nb, _ = quant_layout(13, 4)
    _refused(comp, _with(p, body=p.body[:-1]), "length")
    _refused(comp, _with(p, body=torch.cat([p.body, p.body[:1]])), "length")
    _refused(comp, _with(p, shape=torch.Size([40])), "length")
    _refused(comp, _with(p, fmt=FMT_FP4 if p.fmt != FMT_FP4 else FMT_INT4), "format")
    _refused(comp, _with(p, fmt=19), "format")
    _refused(comp, _with(p, vdtype=torch.float16), "value dtype")
    _refused(comp, _with(p, scale=2.0), "scale")
    for value in (math.nan, math.inf, -math.inf, -1.0, -0.0):
        body = p.body.clone()
        body[4:8] = torch.tensor([value], dtype=torch.float32).view(torch.uint8)
        _refused(comp, _with(p, body=body), "body.scales")
    bits = BITS[type(comp)]
    codes = p.body[4 * nb :]
    if 13 * bits % 8:  # dirty padding in the last code byte
        body = p.body.clone()
        body[-1] |= 0x80
        _refused(comp, _with(p, body=body), "body.padding")
    refused = {Int4: [0x08, 0x80], FP4: [0x08, 0x80], FP8: [0x7F, 0xFF, 0x80], Int2: []}[type(comp)]
    for i, code in enumerate(refused):
        body = p.body.clone()
        at = 4 * nb + (i % 2)
        if bits == 4:  # the refused nibble in one field, the other field kept
            keep = 0xF0 if code == 0x08 else 0x0F
            body[at] = (body[at] & keep) | code
        else:
            body[at] = code
        _refused(comp, _with(p, body=body), "body.codes")
    if isinstance(comp, Int2):  # every 2-bit code is one the encoder writes
        body = p.body.clone()
        body[4 * nb : -1] = torch.arange(codes.numel() - 1, dtype=torch.uint8) * 37
        comp.check_frame(_with(p, body=body))


def test_a_message_is_checked_with_one_host_sync(monkeypatch):
    import gradzip.codecs.lowbit as lowbit

    comp = Int4(block=5)
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (13, 1, 30, 7, 22)]
    msg = pack_frames([comp.compress(x) for x in xs])
    reads = []
    real = lowbit.host_values
    monkeypatch.setattr(lowbit, "host_values", lambda t: reads.append(t.numel()) or real(t))
    unpack_frames(msg, [x.shape for x in xs], [x.dtype for x in xs], check=comp)
    assert len(reads) == 1
    # a bad code in frame 3: refused with its index (the second read names the frame)
    start = msg.numel() - sum(body_bytes(comp, x.numel()) for x in xs[3:])
    bad = msg.clone()
    bad[start + 4 * 2] = 0x88
    with pytest.raises(FrameError, match="frame 3") as e:
        unpack_frames(bad, [x.shape for x in xs], [x.dtype for x in xs], check=comp, rank=1)
    assert e.value.field == "body.codes" and e.value.rank == 1


# -- two ranks: the engine, the DDP hook, DiLoCo -------------------------------------------
N_BIG = 1 << 16


def ranked():
    return {"Int4": Int4(), "Int2": Int2(), "FP8": FP8(), "FP4": FP4()}


def _multi(rank, world):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.engine import Engine
    from gradzip.hooks import register_hook
    from gradzip.local_sgd import DiLoCo
    from tests.support import batch, make_model

    out = {"engine": {}, "ddp": {}}
    x = torch.randn(N_BIG, generator=torch.Generator().manual_seed(rank))
    for label, comp in ranked().items():
        eng = Engine(comp)
        got, snaps = [], []
        for _ in range(2):  # the first step also carries the configuration check
            fut = eng.reduce(["big"], [x])
            eng.flush()
            got.append(fut.wait().clone())
            eng.end_step()
            snaps.append(eng.stats())
        out["engine"][label] = {"first": got[0], "snaps": snaps}
    for label, comp in ranked().items():
        model = make_model(0, widths=(64,))
        ddp = DDP(model)
        state = register_hook(ddp, comp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for s in range(3):
            xb, yb = batch(s, rank)
            opt.zero_grad()
            F.cross_entropy(ddp(xb), yb).backward()
            opt.step()
        out["ddp"][label] = {"params": [p.detach().clone() for p in model.parameters()], "stats": state.stats()}
    model = make_model(0, widths=(64,))
    start = [p.detach().clone() for p in model.parameters()]
    opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, period=2, compression=gz.Int4())
    for s in range(6):  # three syncs
        xb, yb = batch(s, rank)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    opt.synchronize()
    out["diloco"] = {"start": start, "params": [p.detach().clone() for p in model.parameters()], "stats": opt.stats()}
    return out


@pytest.mark.slow
def test_two_ranks_engine_ddp_hook_and_diloco():
    world = 2
    res = run_ranks(_multi, world, timeout=240)
    xs = [torch.randn(N_BIG, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ratios = {}
    for label, comp in ranked().items():
        # the average: every rank's frame decoded in rank order into float32, on both ranks alike
        want = torch.zeros(N_BIG)
        for r in range(world):
            comp.accumulate(comp.compress(xs[r], TensorContext(name="big", rank=r, world_size=world)), want)
        want /= world
        a, b = res[0]["engine"][label], res[1]["engine"][label]
        assert torch.equal(a["first"], b["first"]) and torch.equal(a["first"], want), label
        # one step's bytes: header, checksum room, entry, body, the non-finite flag's byte
        first, second = a["snaps"]
        step = second["bytes_sent"] - first["bytes_sent"]
        assert step == HEADER_BYTES + 4 + ENTRY_BYTES + body_bytes(comp, N_BIG) + 1, (label, step)
        ratios[label] = (second["bytes_link_raw"] - first["bytes_link_raw"]) / (
            second["bytes_link"] - first["bytes_link"]
        )
        bits = BITS[type(comp)] + 32 / (comp.block or N_BIG)
        assert 0.99 * 32 / bits <= ratios[label] <= 32 / bits, (label, ratios[label])
    print("\nlink ratios at 2 ranks (AllGather), 2**16 float32 elements:", {k: round(v, 2) for k, v in ratios.items()})
    for label in ranked():
        a, b = res[0]["ddp"][label], res[1]["ddp"][label]
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q) and bool(p.isfinite().all()), label
        comp = ranked()[label]
        bits = BITS[type(comp)] + 32 / comp.block  # codes and scales, per element
        assert a["stats"]["steps"] == 3 and a["stats"]["ratio"] > 0.8 * 32 / bits, (label, a["stats"])
    print(
        "DDP hook ratios (3 steps, config check included):",
        {k: round(v["stats"]["ratio"], 2) for k, v in res[0]["ddp"].items()},
    )
    print("DiLoCo Int4:", {k: round(res[0]["diloco"]["stats"][k], 2) for k in ("ratio", "ratio_per_sync")})
    a, b = res[0]["diloco"], res[1]["diloco"]
    for p, q, p0 in zip(a["params"], b["params"], a["start"]):
        assert torch.equal(p, q) and bool(p.isfinite().all()) and not torch.equal(p, p0)
    assert a["stats"]["ratio_per_sync"] > 0.8 * 32 / 4.5, a["stats"]  # Int4: 4.5 bits an element
