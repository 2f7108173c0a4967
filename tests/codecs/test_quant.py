"""Quantizers (SignSGD, QSGD, TernGrad, Int8) and their bit packing.

Bit-exact packing, hypothesis properties, seeded unbiasedness, wire bytes
measured at the collectives on 2 gloo ranks, and convergence through the DDP hook.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradzip.codecs.base import TensorContext
from gradzip.codecs.quant import (
    FMT_INT8,
    FMT_QSGD,
    FMT_SIGN1,
    FMT_TERN2,
    QSGD,
    Int8,
    SignSGD,
    TernGrad,
    _spanned,
    qsgd_bits,
)
from gradzip.engine import Engine
from gradzip.kernels import quant_layout
from gradzip.kernels.bitpack import pack_bits, pack_nbit, packed_nbytes, unpack_bits, unpack_nbit
from gradzip.kernels.reference import pack_2bit
from gradzip.protocols.int8_allreduce import int8_lanes
from gradzip.wire import ENTRY_BYTES, HEADER_BYTES, Payload, narrow, pack_frames, unpack_frames
from tests.support import RefMemory, run_ranks

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 31, 32, 33, 1009, 1823 * 781]


# -- bit packing --------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
def test_1bit_roundtrip_is_bit_exact(n):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
    words = pack_bits(bits)
    assert words.dtype == torch.int32 and words.numel() == math.ceil(n / 32)
    assert words.numel() * 4 == packed_nbytes(n, 1)
    assert torch.equal(unpack_bits(words, n), bits)
    assert torch.equal(pack_bits(bits.to(torch.uint8)), words)


@pytest.mark.parametrize("nbits", [2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_nbit_roundtrip_is_bit_exact(n, nbits):
    codes = torch.randint(0, 1 << nbits, (n,), generator=torch.Generator().manual_seed(n + nbits), dtype=torch.uint8)
    packed = pack_nbit(codes, nbits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * nbits / 8) == packed_nbytes(n, nbits)
    assert torch.equal(unpack_nbit(packed, n, nbits), codes)
    if nbits == 2:
        assert torch.equal(packed, pack_2bit(codes))


@pytest.mark.parametrize("n", SIZES)
def test_numpy_bit_packing_writes_the_torch_words(monkeypatch, n):
    """CPU tensors pack through numpy's packbits; the words and bits are the shift-and-sum ones."""
    import gradzip.kernels.bitpack as bp

    bits = torch.rand(n, generator=torch.Generator().manual_seed(n + 1)) < 0.5
    fast = bp.pack_bits(bits)
    monkeypatch.setattr(bp, "_NUMPY_BITS", False)
    slow = bp.pack_bits(bits)
    assert torch.equal(fast, slow)
    assert torch.equal(bp.unpack_bits(slow, n), bits)


@pytest.mark.parametrize("bits", [1, 3, 6, 17])
@pytest.mark.parametrize("numpy_route", [True, False])
def test_unpack_uint_reads_rows_as_it_reads_each_row(bits, numpy_route, monkeypatch):
    """A 2-D ``packed`` (streams of one layout, e.g. a round's Elias-Fano frames, strided rows
    of one buffer) unpacks row by row as the 1-D call unpacks each, on the numpy route (CPU)
    and the torch one (GPUs); zero values give ``(rows, 0)``."""
    import gradzip.kernels.bitpack as bp

    monkeypatch.setattr(bp, "_NUMPY_BITS", bp._NUMPY_BITS and numpy_route)
    g = torch.Generator().manual_seed(bits)
    n = 37
    streams = [bp.pack_uint(torch.randint(0, 1 << bits, (n,), generator=g), bits) for _ in range(4)]
    width = streams[0].numel()
    buf = torch.zeros(4, width + 3, dtype=torch.uint8)  # rows 3 bytes apart
    for j, stream in enumerate(streams):
        buf[j, :width] = stream
    rows = buf[:, :width]
    got = bp.unpack_uint(rows, n, bits)
    assert got.shape == (4, n)
    assert all(torch.equal(got[j], bp.unpack_uint(streams[j], n, bits)) for j in range(4))
    assert bp.unpack_uint(rows, 0, bits).shape == (4, 0)
    with pytest.raises(ValueError, match="hold fewer"):
        bp.unpack_uint(rows, n + 8 * 3 // bits + 1, bits)


@pytest.mark.parametrize("block", [None, 7, 100])
@pytest.mark.parametrize("n", [1, 7, 33, 1009, (1 << 16) * 2 + 13])
@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
def test_signsgd_cpu_table_decode_is_the_where_decode(n, block, acc):
    """The CPU decode (byte table lookup, chunked accumulate) adds exactly +-S_b per element,
    peer by peer in order: the floats of ``out += where(neg, -s, s)``, signed zeros included."""
    comp = SignSGD(block=block)
    g = torch.Generator().manual_seed(n)
    frames = [comp.compress(torch.randn(n, generator=g, dtype=acc)) for _ in range(3)]
    out0 = torch.randn(n, generator=g, dtype=acc) * 1e-3
    out0[0] = -0.0

    def where_decode(p):
        nb = math.ceil(n / (block or n))
        b = block or n
        scales = p.body[: 4 * nb].view(torch.float32).to(acc)
        neg = unpack_bits(p.body[4 * nb :].view(torch.int32), n)
        s = scales.repeat_interleave(b)[:n]
        return torch.where(neg, -s, s)

    want = out0.clone()
    for p in frames:
        want.add_(where_decode(p))
    got = out0.clone()
    comp.accumulate_many(frames, got)
    assert torch.equal(
        got.view(torch.int64 if acc == torch.float64 else torch.int32),
        want.view(torch.int64 if acc == torch.float64 else torch.int32),
    )
    assert torch.equal(comp.decompress(frames[1]).to(acc), where_decode(frames[1]))


def test_bit_layouts_are_little_endian():
    bits = torch.zeros(40, dtype=torch.bool)
    bits[[0, 2, 31, 33]] = True
    words = pack_bits(bits)
    assert words.tolist() == [1 + 4 - 2**31, 2]  # bit 31 set: a negative int32
    assert pack_nbit(torch.tensor([1, 2, 3], dtype=torch.uint8), 4).tolist() == [0x21, 0x03]
    assert pack_nbit(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4, 3]
    assert pack_bits(torch.zeros(0, dtype=torch.bool)).numel() == 0
    assert unpack_nbit(pack_nbit(torch.zeros(0, dtype=torch.uint8), 4), 0, 4).numel() == 0


def test_bitpack_rejects_bad_input():
    with pytest.raises(TypeError):
        pack_bits(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="0 or 1"):
        pack_bits(torch.tensor([0, 2], dtype=torch.uint8))
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_nbit(torch.zeros(3, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match=r">= 2\*\*4"):
        pack_nbit(torch.tensor([16], dtype=torch.uint8), 4)
    with pytest.raises(TypeError):
        pack_nbit(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="fewer than"):
        unpack_bits(torch.zeros(1, dtype=torch.int32), 33)
    with pytest.raises(ValueError, match="fewer than"):
        unpack_nbit(torch.zeros(2, dtype=torch.uint8), 5, 4)


# -- properties ---------------------------------------------------------------------------
def quantizers():
    return [
        SignSGD(),
        SignSGD(block=7),
        QSGD(),
        QSGD(1, block=5),
        QSGD(3, block=None, seed=4),
        QSGD(100, block=64),
        TernGrad(),
        TernGrad(block=9, clip=1.5),
        Int8(),
        Int8(block=5),
    ]


QUANTIZERS = quantizers()
IDS = [repr(c) for c in QUANTIZERS]

shapes = st.one_of(st.just(()), st.lists(st.integers(0, 40), min_size=1, max_size=3).map(tuple))


@st.composite
def tensors(draw, dtype=torch.float32, max_abs=6e4):
    shape = draw(shapes)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-6, 1e-3, 1.0, 100.0]))
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    if n and draw(st.booleans()):  # exact zeros and a wide dynamic range
        x[:: max(1, n // 3)] = 0.0
        x[1 :: max(1, n // 2)] *= 1e4
    return x.clamp(-max_abs, max_abs).to(dtype).reshape(shape)


def ctx(x, step=0, name="w", rank=0):
    return TensorContext(name=name, step=step, dtype=x.dtype, store={}, rank=rank, world_size=2)


def blocks_of(c, n):
    b = n if c.block is None else min(c.block, max(n, 1))
    return (n + b - 1) // b if n else 0, b


def body_bytes(c, n):
    nb, _ = blocks_of(c, n)
    bits = {SignSGD: 1, QSGD: getattr(c, "bits", 0), TernGrad: 2, Int8: 8}[type(c)]
    return 4 * nb + packed_nbytes(n, bits)


# The dtype is drawn with the tensor (each of the 40 cases a quantizer runs, not a
# parametrization each): every dtype occurs (one missing from 40 draws: about 1e-7).
@pytest.mark.parametrize("comp", QUANTIZERS, ids=IDS)
@PROPS
@given(data=st.data())
def test_shape_dtype_and_frame_size(comp, data):
    dtype = data.draw(st.sampled_from(DTYPES))
    x = data.draw(tensors(dtype=dtype))
    p = comp.compress(x, ctx(x))
    y = comp.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert p.body.dtype == torch.uint8 and p.body.numel() == body_bytes(comp, x.numel())
    # Through a real frame: what a receiver decodes is what the sender decoded.
    msg = pack_frames([p])
    (q,) = unpack_frames(msg, [x.shape], [x.dtype])
    acc = torch.zeros(x.numel())
    comp.accumulate(q, acc)
    # Narrowing saturates as decompress does: QSGD's top level (the norm) may exceed float16's range.
    assert torch.equal(narrow(acc, dtype), y.reshape(-1))
    assert torch.equal(comp.decompress(q), y)


@pytest.mark.parametrize("comp", QUANTIZERS, ids=IDS)
@PROPS
@given(data=st.data())
def test_error_feedback_keeps_everything(comp, data):
    """residual + decoded == compensated: exactly for Int8 and wherever d = 0 or d/c in [1/2, 2];
    elsewhere the residual is c - d correctly rounded to float32 (see gradzip.codecs.quant)."""
    dtype = data.draw(st.sampled_from(DTYPES))
    mem = RefMemory()
    first = data.draw(tensors(dtype=dtype))
    for step in range(3):
        g = first if step == 0 else torch.randn(first.shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        c = mem.compensate("w", g)
        keep = c.double()
        d = comp.decompress(comp.compress(c, ctx(c, step=step)))
        mem.update("w", c, d)
        r = mem.residual("w")
        assert r.dtype == torch.float32
        err = (r.double() + d.double() - keep).abs()
        ratio = d.double() / keep
        sterbenz = (d == 0) | ((ratio >= 0.5) & (ratio <= 2))
        if isinstance(comp, Int8):
            assert bool(sterbenz.all())
        assert torch.all(err[sterbenz] == 0)
        ulp = torch.nextafter(r.abs(), torch.tensor(math.inf)).double() - r.abs().double()
        assert torch.all(err <= ulp / 2)


def by_block(comp, x, y):
    """x and the decoded y as zero-padded (blocks, block) float64 views, and the mask of real elements."""
    n = x.numel()
    nb, b = blocks_of(comp, n)
    b, pad = max(b, 1), nb * max(b, 1) - n
    rows = [torch.nn.functional.pad(t.reshape(-1).double(), (0, pad)).reshape(nb, b) for t in (x, y)]
    mask = torch.nn.functional.pad(torch.ones(n, dtype=torch.bool), (0, pad)).reshape(nb, b)
    return rows[0], rows[1], mask


@PROPS
@given(data=st.data(), block=st.sampled_from([None, 1, 7, 64]))
def test_signsgd_sends_block_mean_with_the_sign(data, block):
    x = data.draw(tensors())
    comp = SignSGD(block=block)
    p = comp.compress(x)
    assert p.fmt == FMT_SIGN1
    v, out, mask = by_block(comp, x, comp.decompress(p))
    s = (v.abs().sum(1, keepdim=True) / mask.sum(1, keepdim=True)).float().double().expand_as(v)
    assert torch.allclose(out.abs()[mask], s[mask], rtol=1e-5, atol=0)
    assert torch.equal((out < 0)[mask], (v < 0)[mask])


@PROPS
@given(data=st.data(), levels=st.sampled_from([1, 2, 7, 8, 127]), block=st.sampled_from([None, 3, 512]))
def test_qsgd_rounds_to_a_neighbouring_level(data, levels, block):
    x = data.draw(tensors())
    comp = QSGD(levels, block=block)
    p = comp.compress(x, ctx(x))
    assert p.fmt == FMT_QSGD and p.scale == levels and comp.bits == {1: 2, 2: 4, 7: 4, 8: 8, 127: 8}[levels]
    v, out, mask = by_block(comp, x, comp.decompress(p))
    # the codec sums squares in float64 (a float32 sum of many tiny values is off by ~1e-5, which
    # at level 127 moves the level by more than the tolerance below)
    step = (torch.linalg.vector_norm(v.double(), dim=1, keepdim=True) / levels).expand_as(v)
    pos = step > 0
    r = torch.where(pos, v.abs() / step, 0.0)
    lvl = torch.where(pos, out.abs() / step, out.abs())
    assert torch.all((lvl - r.floor() > -1e-3) & (lvl - r.ceil() < 1e-3))  # floor(r) or ceil(r)
    assert torch.all((out == 0) | (torch.sign(out) == torch.sign(v)))


@PROPS
@given(data=st.data(), clip=st.sampled_from([None, 0.5, 2.5]), block=st.sampled_from([None, 4, 100]))
def test_terngrad_sends_zero_or_signed_scale(data, clip, block):
    x = data.draw(tensors())
    comp = TernGrad(block=block, clip=clip)
    p = comp.compress(x, ctx(x))
    assert p.fmt == FMT_TERN2
    v, out, mask = by_block(comp, x, comp.decompress(p))
    s = v.abs().amax(1, keepdim=True)
    if clip is not None:
        s = torch.minimum(s, clip * (v.pow(2).sum(1, keepdim=True) / mask.sum(1, keepdim=True)).sqrt())
    s = s.float().double().expand_as(v)
    assert torch.all((out == 0) | torch.isclose(out.abs(), s, rtol=1e-5, atol=0))
    assert torch.all((out == 0) | (torch.sign(out) == torch.sign(v)))


@PROPS
@given(data=st.data(), block=st.sampled_from([None, 1, 5, 1024]))
def test_int8_rounds_to_nearest_within_half_a_step(data, block):
    x = data.draw(tensors())
    comp = Int8(block=block)
    p = comp.compress(x)
    assert p.fmt == FMT_INT8
    v, out, mask = by_block(comp, x, comp.decompress(p))
    step = (v.abs().amax(1, keepdim=True) / 127).float().double()
    # S may be one ulp below amax/127: the largest element can then be off by 127 ulps of S.
    assert torch.all((out - v).abs() <= step / 2 * (1 + 1e-6) + 128 * step * 2**-23)


def _flat(x):
    return x.reshape(-1).double()


def test_draws_are_seeded_per_step_name_and_rank():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    for comp in (QSGD(3), TernGrad()):
        base = comp.compress(x, ctx(x, step=3, name="a", rank=0)).body
        assert torch.equal(base, comp.compress(x, ctx(x, step=3, name="a", rank=0)).body)
        for other in (ctx(x, step=4, name="a"), ctx(x, step=3, name="b"), ctx(x, step=3, name="a", rank=1)):
            assert not torch.equal(base, comp.compress(x, other).body)
    assert not torch.equal(QSGD(seed=1).compress(x, ctx(x)).body, QSGD(seed=2).compress(x, ctx(x)).body)


# -- unbiasedness -------------------------------------------------------------------------
DRAWS = 2000


def _draw_mean(comp, x):
    total = torch.zeros(x.numel(), dtype=torch.float64)
    outcomes = set()
    for step in range(DRAWS):
        y = _flat(comp.decompress(comp.compress(x, ctx(x, step=step, name="u"))))
        total += y
        outcomes.add(float(y[5]))
    return total / DRAWS, outcomes


def test_qsgd_is_unbiased():
    """Mean of 2,000 seeded draws within 5 standard errors of x, for every element."""
    x = torch.randn(40, generator=torch.Generator().manual_seed(11)) * torch.logspace(-2, 1, 40)
    levels = 3
    comp = QSGD(levels, block=16)
    mean, outcomes = _draw_mean(comp, x)
    v = _flat(x)
    se = torch.empty_like(v)
    for k in range(0, 40, 16):
        blk = v[k : k + 16]
        q = float(torch.linalg.vector_norm(x[k : k + 16]).float()) / levels
        f = blk.abs() / q - (blk.abs() / q).floor()
        se[k : k + 16] = q * (f * (1 - f) / DRAWS).sqrt() + 1e-5 * q
    z = (mean - v).abs() / se
    assert float(z.max()) < 5, z
    assert len(outcomes) == 2  # the rounding really is random
    # Rounding always down (a biased QSGD) fails the same bound: the test can fail.
    down = torch.empty_like(v)
    for k in range(0, 40, 16):
        q = float(torch.linalg.vector_norm(x[k : k + 16]).float()) / levels
        down[k : k + 16] = v[k : k + 16].sign() * (v[k : k + 16].abs() / q).floor() * q
    assert float(((down - v).abs() / se).max()) > 5


@pytest.mark.parametrize("clip", [None, 1.0], ids=["plain", "clip"])
def test_terngrad_is_unbiased_for_the_clipped_tensor(clip):
    x = torch.randn(40, generator=torch.Generator().manual_seed(12))
    x[3] = 6.0  # an outlier that clipping cuts
    comp = TernGrad(clip=clip, block=None)
    mean, outcomes = _draw_mean(comp, x)
    v = _flat(x)
    s = v.abs().max() if clip is None else torch.minimum(v.abs().max(), clip * v.pow(2).mean().sqrt())
    s = float(s.float())
    target = v.clamp(-s, s)
    p = target.abs() / s
    se = s * (p * (1 - p) / DRAWS).sqrt() + 1e-6 * s
    z = (mean - target).abs() / se
    assert float(z.max()) < 5, z
    assert len(outcomes) == 2
    assert comp.biased == (clip is not None)
    if clip is not None:
        assert float((mean[3] - v[3]).abs()) > 1.0  # clipping is biased for x itself


# -- configuration errors -----------------------------------------------------------------
@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: SignSGD(block=0), "block"),
        (lambda: SignSGD(block=2.5), "block"),
        (lambda: QSGD(0), "levels"),
        (lambda: QSGD(128), "levels"),
        (lambda: QSGD(True), "levels"),
        (lambda: QSGD(block=-1), "block"),
        (lambda: QSGD(seed=0.5), "seed"),
        (lambda: TernGrad(clip=0), "clip"),
        (lambda: TernGrad(clip=math.inf), "clip"),
        (lambda: TernGrad(block=2**31), "block"),
        (lambda: Int8(block=0), "block"),
        (lambda: Int8(allreduce=1), "allreduce"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg) as e:
        make()
    assert "must be" in str(e.value)


@pytest.mark.parametrize("comp", QUANTIZERS, ids=IDS)
def test_non_floating_input_raises_type_error(comp):
    with pytest.raises(TypeError, match="floating point"):
        comp.compress(torch.arange(10), TensorContext())


@pytest.mark.parametrize("comp", [SignSGD(), QSGD(), TernGrad(), Int8()], ids=lambda c: type(c).__name__)
def test_corrupt_frames_raise(comp):
    x = torch.randn(100)
    p = comp.compress(x, ctx(x))
    short = Payload(body=p.body[:-1], shape=p.shape, dtype=p.dtype, fmt=p.fmt, vdtype=p.vdtype, scale=p.scale)
    with pytest.raises(ValueError, match="corrupt"):
        comp.decompress(short)
    other = Payload(body=p.body, shape=p.shape, dtype=p.dtype, fmt=1, vdtype=p.vdtype, scale=p.scale)
    with pytest.raises(ValueError, match="cannot decode"):
        comp.decompress(other)


def test_qsgd_bits_and_int8_lanes():
    assert [qsgd_bits(s) for s in (1, 2, 7, 8, 127)] == [2, 4, 4, 8, 8]
    assert [int8_lanes(w) for w in (1, 2, 4, 16, 64, 258)] == [(8, 7), (9, 7), (10, 6), (12, 5), (14, 4), (16, 3)]
    for w in (1, 2, 3, 100, 258, 5000):
        bits, lanes = int8_lanes(w)
        assert w * 254 < 2**bits and lanes * bits <= 63


# -- multi-process: wire bytes, fp16/bf16 through the engine and the DDP hook -------------
N_BIG = 1 << 18  # the ratios below hold from 2**16 up; 2**20 cost twice the time


def wire_cases():
    return {
        "SignSGD": SignSGD(),
        "SignSGD-b4096": SignSGD(block=4096),
        "TernGrad": TernGrad(),
        "QSGD4": QSGD(7),
        "Int8": Int8(),
        "Int8-AR": Int8(allreduce=True),
    }


FLAG_BYTES = 4  # the engine's non-finite flag, one int32 per call


def expected_step_bytes(label, comp, n, world):
    """Bytes one call of one n-element tensor hands to the collectives after the first step."""
    if label == "Int8-AR":
        nb = math.ceil(n / comp.block)
        _, lanes = int8_lanes(world)
        return FLAG_BYTES + 4 * nb + 8 * math.ceil(n / lanes)  # scales, then lane-packed words
    body = body_bytes(comp, n)
    scale = 4 if label.startswith("QSGD") else 0  # QSGD's entry carries its levels
    # No size exchange (a quantizer's frame length follows from n): the message header, room for the
    # checksum (every rank pads to it, on or off), the entry, the body, and one byte more: the
    # engine's non-finite flag, which rides after the message.
    return HEADER_BYTES + 4 + ENTRY_BYTES + scale + body + 1


SMALL = [("a", (40, 3)), ("b", (7,)), ("c", (1,)), ("d", (0,)), ("e", (1823,))]


def small_grads(rank, dtype):
    return [
        (torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + i)) * 10 ** (i - 2)).to(dtype)
        for i, (_, shape) in enumerate(SMALL)
    ]


def _multi(rank, world):
    out = {"wire": {}, "small": {}, "ddp": {}}
    x = torch.randn(N_BIG, generator=torch.Generator().manual_seed(rank))
    for label, comp in wire_cases().items():
        eng = Engine(comp)
        snaps = []
        for _ in range(2):  # the first step also carries the engine's one-time config check
            fut = eng.reduce(["big"], [x])
            eng.flush()
            y = fut.wait()
            eng.end_step()
            snaps.append(eng.stats())
        err = float((y - x).norm() / x.norm())
        out["wire"][label] = {"stats": snaps, "finite": bool(y.isfinite().all()), "err": err}
    for dtype in (torch.float16, torch.bfloat16):
        for label, comp in wire_cases().items():
            eng = Engine(comp, error_feedback=True)
            fut = eng.reduce([n for n, _ in SMALL], small_grads(rank, dtype))
            eng.flush()
            out["small"][(label, str(dtype))] = {"got": fut.wait(), "residuals": eng.memory.state_dict()}
    # Through DDP's hook with a bf16 model and small buckets: replicas stay identical.
    for label, comp in wire_cases().items():
        if label == "SignSGD-b4096":
            continue
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).to(torch.bfloat16)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
        from gradzip.hooks import register_hook

        state = register_hook(ddp, comp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for s in range(4):
            g = torch.Generator().manual_seed(10 * s + rank)
            xb = torch.randn(8, 12, generator=g).to(torch.bfloat16)
            opt.zero_grad()
            ddp(xb).float().pow(2).mean().backward()
            opt.step()
        out["ddp"][label] = {"params": [p.detach().clone() for p in model.parameters()], "stats": state.stats()}
    return out


def expected_small(label, comp, dtype, world):
    """Every rank's encode, decoded in rank order into float32, averaged: what the engine must return."""
    grads = [small_grads(r, dtype) for r in range(world)]
    parts, residuals = [], [{} for _ in range(world)]
    for i, (name, shape) in enumerate(SMALL):
        n = math.prod(shape)
        acc = torch.zeros(n)
        if label == "Int8-AR":
            b = min(comp.block, max(n, 1))
            nb = math.ceil(n / b)
            cs = [g[i].float().reshape(-1) for g in grads]
            padded = [torch.nn.functional.pad(c.abs(), (0, nb * b - n)).reshape(nb, b) for c in cs]
            amax = torch.stack([p.amax(1) for p in padded]).amax(0)
            scale = (amax / 127).clamp(min=2.0**-149)
            # Rounded down where 127 * S would exceed amax (so it never overflows near the max).
            scale = torch.where(
                scale.double() * 127 > amax.double(), torch.nextafter(scale, torch.zeros_like(scale)), scale
            )
            scale = torch.where(amax > 0, scale.clamp(min=2.0**-149), torch.zeros_like(amax))
            se = scale.repeat_interleave(b)[:n]
            zero = torch.zeros(n, dtype=torch.float64)
            qs = [torch.where(se > 0, c.double() / se.double(), zero).round().clamp(-127, 127) for c in cs]
            for r in range(world):
                residuals[r][name] = cs[r] - qs[r].float() * se
            acc = (sum(q.long() for q in qs).float() * se) / world
        else:
            for r in range(world):
                c = grads[r][i].float()
                p = comp.compress(c, TensorContext(name=name, step=0, dtype=dtype, store={}, rank=r, world_size=world))
                comp.accumulate(p, acc)
                residuals[r][name] = c - comp.decompress(p)
            acc /= world
        parts.append(acc)
    return torch.cat(parts).to(dtype), residuals


@pytest.mark.slow
def test_wire_bytes_dtypes_and_ddp_hook_on_two_ranks():
    world = 2
    res = run_ranks(_multi, world, timeout=300)
    raw = 4 * N_BIG
    for label, comp in wire_cases().items():
        for r in res:
            first, second = r["wire"][label]["stats"]
            assert r["wire"][label]["finite"], label
            assert second["bytes_raw"] == 2 * raw
            step = second["bytes_sent"] - first["bytes_sent"]
            assert step == expected_step_bytes(label, comp, N_BIG, world), (label, step, second)
    ratio = {k: res[0]["wire"][k]["stats"][1]["ratio"] for k in wire_cases()}  # config check included
    print("\nratios over 2 steps of 2**18 fp32 elements:", {k: round(v, 2) for k, v in ratio.items()})
    assert ratio["SignSGD"] >= 30 and ratio["SignSGD-b4096"] >= 30, ratio
    assert ratio["TernGrad"] >= 15, ratio
    assert ratio["QSGD4"] >= 7, ratio
    assert ratio["Int8"] >= 3.9 and ratio["Int8-AR"] >= 3.4, ratio
    # Int8 decodes close to the average; the others are coarse, but not garbage.
    assert res[0]["wire"]["Int8"]["err"] < 0.75 and res[0]["wire"]["Int8-AR"]["err"] < 0.75

    for (label, dt), _ in res[0]["small"].items():
        dtype = getattr(torch, dt.split(".")[1])
        want, residuals = expected_small(label, wire_cases()[label], dtype, world)
        for rank, r in enumerate(res):
            got = r["small"][(label, dt)]
            assert got["got"].dtype == dtype
            assert torch.equal(got["got"], want), (label, dt)
            for name, _ in SMALL:
                mine = got["residuals"][name].reshape(-1)
                assert torch.equal(mine, residuals[rank][name].reshape(-1)), (label, dt, name)

    for label, _ in res[0]["ddp"].items():
        a, b = res[0]["ddp"][label], res[1]["ddp"][label]
        for p, q in zip(a["params"], b["params"]):
            assert p.dtype == torch.bfloat16 and torch.equal(p, q) and bool(p.isfinite().all()), label
        assert a["stats"]["steps"] == 4 and a["stats"]["ratio"] > 1.0, (label, a["stats"])


# -- the message-wide frame check (_Quantizer._clean) ------------------------------------------


def _message(codec, sizes, seed=0):
    """A message of one frame per size, packed as a protocol sends it, and its unpacked frames."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g) for n in sizes]
    msg = pack_frames([codec.compress(x) for x in xs])
    return msg, xs


@pytest.mark.parametrize(
    "codec",
    [SignSGD(block=7), QSGD(1, block=5), QSGD(7, block=5), QSGD(100, block=5), TernGrad(block=6), Int8(block=5)],
    ids=repr,
)
def test_a_message_is_checked_in_one_pass_and_a_bad_frame_is_still_named(codec):
    """Every frame of a message in one pass (its bodies are views of the message: no copy) and
    one host sync; a negative scale or a code no encoder writes in any frame, found there, is
    then named by the frame-by-frame pass as before; set padding bits are not codes."""
    from gradzip.wire import FrameError

    sizes = [13, 1, 30, 7, 22]
    msg, xs = _message(codec, sizes)
    shapes, dtypes = [x.shape for x in xs], [x.dtype for x in xs]

    def frames(m):
        return unpack_frames(m, shapes, dtypes)

    good = [(p, quant_layout(p.numel, codec.block)[0]) for p in frames(msg)]
    assert codec._clean(good)
    # consecutive views of the message: the bodies' span is a view, not a copy
    joined, offsets = _spanned([p.body for p, _ in good])
    assert joined.data_ptr() == good[0][0].body.data_ptr()
    assert offsets == [p.body.data_ptr() - joined.data_ptr() for p, _ in good]
    codec.check_frames(frames(msg))
    bits = codec._bits
    for frame in (0, 3, 4):
        p, nb = good[frame]
        start = p.body.data_ptr() - msg.data_ptr()
        # a negative scale
        bad = msg.clone()
        bad[start + 3] |= 0x80
        with pytest.raises(FrameError, match="negative block scale") as e:
            codec.check_frames(frames(bad))
        assert e.value.frame == frame
        if codec._kind == "sign1":
            continue
        # a code no encoder writes, in the frame's first code byte
        bad = msg.clone()
        top = {"int8": 0x80, "tern2": 0x3, "qsgd": (1 << bits) - 1}[codec._kind]
        if codec._kind == "qsgd" and top <= 2 * codec.levels:
            continue  # every code of this width is one an encoder writes
        bad[start + 4 * nb] = (bad[start + 4 * nb] & ~((1 << bits) - 1) & 0xFF) | top
        with pytest.raises(FrameError, match="corrupt") as e:
            codec.check_frames(frames(bad))
        assert e.value.frame == frame
    # padding bits of a frame's last code byte are not codes: the message stays clean
    per = 8 // bits if bits <= 8 else 1
    for p, _ in good:
        if p.numel % per:
            start = p.body.data_ptr() - msg.data_ptr()
            pad = msg.clone()
            pad[start + p.body.numel() - 1] |= (0xFF << ((p.numel % per) * bits)) & 0xFF
            codec.check_frames(frames(pad))
            assert codec._clean([(q, n) for q, (_, n) in zip(frames(pad), good)])


def test_frames_in_one_buffer_are_read_in_place_and_others_joined_by_a_copy():
    a, b = torch.arange(5, dtype=torch.uint8), torch.arange(3, dtype=torch.uint8)
    got, offsets = _spanned([a, b])
    assert torch.equal(got, torch.cat([a, b])) and got.data_ptr() not in (a.data_ptr(), b.data_ptr())
    assert offsets == [0, 5]
    buf = torch.arange(20, dtype=torch.uint8)
    got, offsets = _spanned([buf[2:6], buf[9:12], buf[12:12], buf[15:19]])  # apart, as gathered messages lie
    assert got.data_ptr() == buf[2:].data_ptr() and got.numel() == 17 and offsets == [0, 7, 10, 13]
    got, offsets = _spanned([buf[9:12], buf[2:6]])  # out of order: a copy
    assert torch.equal(got, torch.cat([buf[9:12], buf[2:6]])) and offsets == [0, 3]
    codec = Int8(block=4)
    ps = [codec.compress(torch.randn(9)), codec.compress(torch.randn(4))]
    assert codec._clean([(p, quant_layout(p.numel, 4)[0]) for p in ps])


def _force_kernels(kernels, monkeypatch) -> None:
    """The kernels a test runs: None (the default choice), ``"reference"``, or ``"triton"``
    (on the CPU under the interpreter only: skipped elsewhere)."""
    import os

    import gradzip.kernels as K

    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("forced Triton on the CPU needs the interpreter")
    if kernels is None:
        monkeypatch.delenv(K.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(K.ENV_VAR, kernels)


def _pieces_as_one_by_one(codec, x, r, bounds, ctxs, acc) -> None:
    """``codec.encode_pieces`` against ``Codec.encode_pieces`` (an encode a piece), bit for bit:
    the frames as sent, the residuals (apart, and compensated in place as TwoPhase hands it),
    without feedback too; the payloads' shapes, dtypes and checked marks."""
    from gradzip.codecs.base import Codec

    def same(got, want):
        assert torch.equal(pack_frames(got), pack_frames(want))
        assert [(p.shape, p.dtype, p.checked) for p in got] == [(p.shape, p.dtype, p.checked) for p in want]

    n = x.numel()
    for residual in (r, None):
        outs = [torch.full((n,), 9.0, dtype=acc) for _ in range(2)]
        same(
            codec.encode_pieces(x, bounds, ctxs, residual, feedback=True, out=outs[0]),
            Codec.encode_pieces(codec, x, bounds, ctxs, residual, feedback=True, out=outs[1]),
        )
        assert torch.equal(outs[0], outs[1])
    a, b = x.to(acc) + r, x.to(acc) + r  # compensated already: encoded in place
    same(
        codec.encode_pieces(a, bounds, ctxs, None, feedback=True, out=a),
        Codec.encode_pieces(codec, b, bounds, ctxs, None, feedback=True, out=b),
    )
    assert torch.equal(a, b)
    same(codec.encode_pieces(x, bounds, ctxs), Codec.encode_pieces(codec, x, bounds, ctxs))


@pytest.mark.parametrize("kernels", [None, "reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_int8_encodes_a_tensors_pieces_together_as_piece_by_piece(dtype, kernels, monkeypatch):
    """Int8.encode_pieces (one kernels.int8_encode_segments) against Codec.encode_pieces (an
    encode, a frame and a subtraction a piece), bit for bit: the frames as sent, the residuals
    (apart, and compensated in place as TwoPhase hands it), without feedback too, under every
    backend (Numba on the CPU, the reference, Triton under the interpreter)."""
    _force_kernels(kernels, monkeypatch)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(5)
    n = 4 * 1031 + 2
    bounds = [0, 1031, 2062, 2062, 4126]
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    r = torch.randn(n, generator=g, dtype=acc) * 0.1
    ctxs = [TensorContext(name=f"t#{j}/4", step=0) for j in range(4)]
    # (under the interpreter, where every launch costs, 1024 would take 64's route again)
    for block in (64, None) if kernels == "triton" else (64, 1024, None):
        _pieces_as_one_by_one(Int8(block=block), x, r, bounds, ctxs, acc)


TRITON_PIECES = [
    (64, [0, 1024, 2048, 3072, 4096]),
    (None, [0, 1024, 2048, 2048, 4096]),
    (None, [5, 37, 38, 1100, 3001]),
]


@pytest.mark.parametrize("kernels", [None, "reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_signsgd_encodes_a_tensors_pieces_together_as_piece_by_piece(dtype, kernels, monkeypatch):
    """SignSGD.encode_pieces against Codec.encode_pieces (an encode a piece), bit for bit: the
    frames as sent, the residuals (apart, and compensated in place as TwoPhase hands it),
    without feedback too, under every backend. Pieces of one length, a multiple of 32 and of the
    block (block=None: the piece), by one kernels.sign_ef; else with one scale a piece
    (``block=None``) pieces of any lengths (not multiples of 32, empty, not from element 0) by
    one kernels.sign_ef_segments; other layouts one by one, with the same result."""
    import gradzip.kernels as K

    _force_kernels(kernels, monkeypatch)
    calls = []
    for op in ("sign_ef", "sign_ef_segments"):
        real = getattr(K, op)
        monkeypatch.setattr(
            K, op, lambda x, *a, _op=op, _real=real, **kw: calls.append((_op, x.numel())) or _real(x, *a, **kw)
        )
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(7)
    cases = [  # (block, bounds, the one call expected, or None: piece by piece)
        (None, [0, 1024, 2048, 3072, 4096], "sign_ef"),
        (None, [0, 1000, 2000, 3000, 4000], "sign_ef_segments"),  # not a multiple of 32
        (None, [0, 1024, 2048, 2048, 4096], "sign_ef_segments"),  # unequal, one empty
        (None, [5, 37, 38, 1100, 3001], "sign_ef_segments"),  # from element 5, one of one element
        (64, [0, 1024, 2048, 3072, 4096], "sign_ef"),
        (4096, [0, 1024, 2048, 3072, 4096], "sign_ef"),  # a block beyond the piece: the piece is one
        (96, [0, 1024, 2048, 3072, 4096], None),  # not a multiple of the block
        (64, [0, 1024, 2048, 2048, 4096], None),  # unequal
    ]
    for block, bounds, together in cases:
        n = bounds[-1]
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        r = torch.randn(n, generator=g, dtype=acc) * 0.1
        ctxs = [TensorContext(name=f"t#{j}/4", step=0) for j in range(len(bounds) - 1)]
        codec = SignSGD(block=block)
        del calls[:]
        codec.encode_pieces(x, bounds, ctxs, r, feedback=True, out=torch.empty(n, dtype=acc))
        want = (
            [(together, bounds[-1] - bounds[0])]
            if together
            else [("sign_ef", b - a) for a, b in zip(bounds, bounds[1:])]
        )
        assert calls == want, (block, bounds, calls)
        # Under the interpreter every launch costs: the routes' choice is checked in every case
        # above; the frames of one case a kernel (the equal pieces of a block, and the two awkward
        # layouts of sign_ef_segments), as the other backends check every case.
        if kernels != "triton" or (block, bounds) in TRITON_PIECES:
            _pieces_as_one_by_one(codec, x, r, bounds, ctxs, acc)
