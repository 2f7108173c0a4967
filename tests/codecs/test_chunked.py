"""ChunkTopK (SparseLoCo's and DeMo's compressor) and the decaying error buffer."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip as gz
from gradzip import wire
from gradzip.codecs.base import TensorContext
from gradzip.codecs.chunked import FMT_CHUNK_Q2, chunk_plan, quantize2
from gradzip.feedback import ErrorFeedback
from gradzip.protocols import ReduceScatter, as_protocol
from gradzip.wire import FrameError

SHAPES = [(128, 64), (130, 65), (100,), (3, 4, 64), (7, 13), (1,), (64, 4096)]


def brute(x: torch.Tensor, k: int, chunk: int) -> set:
    rows, cols, tr, tc, per = chunk_plan(x.shape, k, chunk)
    m = x.reshape(rows, cols)
    out = set()
    for a in range(0, rows, tr):
        for b in range(0, cols, tc):
            tile = m[a : a + tr, b : b + tc].abs().reshape(-1)
            for i in tile.topk(per).indices.tolist():
                out.add((a + i // tc) * cols + b + i % tc)
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_every_tile_sends_its_own_largest(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    c = gz.ChunkTopK(32, chunk=64)
    idx = c.select(x.reshape(-1), x.shape)
    assert set(idx.tolist()) == brute(x, 32, 64) and idx.numel() == c.count(shape)
    assert bool((idx[1:] > idx[:-1]).all())


def test_counts_follow_the_papers_rule():
    c = gz.ChunkTopK(32, chunk=64)
    assert c.count((128, 128)) == 4 * 32  # 0.78% of every full tile
    assert c.count((128,)) == 2  # a vector's tiles of 64 keep max(1, round(0.5)) = 1 each
    assert c.count((130, 65)) == 25 * 3  # 25 tiles of 26 by 13: round(32 * 338 / 4096) = 3 each
    assert chunk_plan((130, 65), 32, 64)[2:] == (26, 13, 3)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from(SHAPES[:-1]),
    values=st.sampled_from([None, "bf16", "fp16", "q2"]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 1 << 16),
)
def test_error_feedback_keeps_what_was_not_sent_and_frames_round_trip(shape, values, dtype, seed):
    c = gz.ChunkTopK(8, chunk=16, values=values)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 10 ** torch.randint(-3, 3, (1,), generator=g)).to(dtype)
    r0 = torch.randn(shape, generator=g, dtype=torch.float64).to(wire.accum_dtype(dtype)) * 0.1
    p, r = c.encode(x, TensorContext(name="w", dtype=dtype), r0.clone(), feedback=True, out=torch.empty_like(r0))
    sent = c.decompress(p).to(r.dtype)
    v = x.to(r.dtype) + r0
    assert torch.allclose(sent + r, v, rtol=0, atol=1e-6 * float(v.abs().max()) + 1e-30)
    if values is None or values == "bf16":  # the residual is v - sent exactly
        assert torch.equal(sent + r, v) or dtype != r.dtype
    msg = wire.pack_frames([p])
    (q,) = wire.unpack_frames(msg, [p.shape], [p.dtype], grad_dtypes=[dtype], check=c)
    assert torch.equal(c.decompress(q), c.decompress(p))


def test_two_bit_values_keep_each_codes_mass_and_side():
    v = torch.tensor([-5.0, -4.0, -0.5, -0.1, 0.0, 0.2, 3.0, 7.0])
    codes, cent = quantize2(v)
    assert codes.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert cent.tolist() == pytest.approx([-4.5, -0.3, 0.1, 5.0])
    assert float(cent[codes].sum()) == pytest.approx(float(v.sum()), abs=1e-5)


def _frame(values=None, shape=(128, 64)):
    c = gz.ChunkTopK(32, chunk=64, values=values)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return c, c.compress(x, TensorContext(name="w", dtype=x.dtype))


def _received(p, body=None, **kw):
    return wire.Payload(
        body=p.body.clone() if body is None else body, shape=p.shape, dtype=p.dtype, fmt=p.fmt, vdtype=p.vdtype, **kw
    )


def test_a_corrupt_frame_is_refused_naming_the_field():
    c, p = _frame("q2")
    assert p.fmt == FMT_CHUNK_Q2
    c.check_frame(_received(p))
    with pytest.raises(FrameError, match="length"):
        c.check_frame(_received(p, p.body[:-1]))
    ef = p.body.numel() - 16 - (2 * c.count(p.shape) + 7) // 8
    cent = p.body.clone()
    cent[-16:] = torch.tensor([1.0, -1.0, 1.0, 1.0]).view(torch.uint8)  # a negative code's centroid above 0
    with pytest.raises(FrameError, match="other side of zero"):
        c.check_frame(_received(p, cent))
    nan = p.body.clone()
    nan[-4:] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(FrameError, match="not finite"):
        c.check_frame(_received(p, nan))
    moved = p.body.clone()
    moved[:ef] = gz.codecs.positions.pack_ef(torch.arange(c.count(p.shape)), p.shape.numel())  # all in the first tile
    with pytest.raises(FrameError, match="tile"):
        c.check_frame(_received(p, moved))
    with pytest.raises(FrameError, match="format"):
        gz.ChunkTopK(32, chunk=64).check_frame(_received(p))
    c, p = _frame("q2", shape=(100,))  # 2 codes: 4 padding bits
    dirty = p.body.clone()
    ef = p.body.numel() - 16 - 1
    dirty[ef] |= 0x80
    with pytest.raises(FrameError, match="padding"):
        c.check_frame(_received(p, dirty))


def test_decay_reads_the_residual_as_beta_r_and_keeps_what_is_not_sent():
    mem = ErrorFeedback(decay=0.5)
    g = torch.ones(4)
    mem.set("w", torch.full((4,), 2.0))
    assert torch.equal(mem.check_shape("w", g), torch.full((4,), 1.0))
    assert torch.equal(mem.compensate("w", g), torch.full((4,), 2.0))
    assert torch.equal(mem.residual("w"), torch.full((4,), 2.0))  # the stored residual is left as it was


def test_average_over_senders_is_allgathers_alone():
    c = gz.ChunkTopK(8, chunk=16, average="senders")
    assert repr(c) == "ChunkTopK(k=8, chunk=16, average='senders')" and gz.parse(repr(c)) == c
    assert type(as_protocol(c, 8)).__name__ == "AllGather"
    for wrap in (gz.TwoPhase, ReduceScatter):
        with pytest.raises(ValueError, match="senders"):
            wrap(c)
    with pytest.raises(ValueError, match="average must be one of"):
        gz.ChunkTopK(average="mean")
    # DCT averages each coefficient over its senders, then transforms back once (DeMo's rule)
    dct = gz.DCT(c)
    assert dct.average == "senders"
    xs = [torch.randn(32, 48, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    payloads = [dct.compress(x) for x in xs]
    coefs = [c.decompress(p).reshape(-1) for p in payloads]
    count = sum((v != 0).double() for v in coefs)
    assert int((count == 1).sum()) and int((count > 1).sum())
    want = dct.inverse(sum(coefs).double().div(count.clamp(min=1)).view(32, 48), (32, 48)).reshape(-1)
    out = torch.zeros(32 * 48, dtype=torch.float64)
    dct.average_senders(payloads, out)
    assert torch.allclose(out, want, atol=1e-10)
