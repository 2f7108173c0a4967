"""DCT(codec): a codec run on a tensor's blockwise DCT; orthonormal, so error feedback keeps
what the codec drops up to rounding, and the coefficients travel as the codec's own frames."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip as gz
from gradzip.codecs.base import TensorContext
from gradzip.codecs.transform import DCT, block_shape, dct_matrix
from gradzip.wire import pack_frames, unpack_frames


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_the_dct_matrix_is_orthonormal(n):
    d = dct_matrix(n, torch.float64)
    torch.testing.assert_close(d @ d.T, torch.eye(n, dtype=torch.float64))


def test_blocks_are_the_largest_divisors_up_to_the_chunk():
    assert block_shape((128, 384), 64) == (128, 384, 64, 64)
    assert block_shape((37, 10), 64) == (37, 10, 37, 10)
    assert block_shape((8, 1, 5, 5), 64) == (8, 25, 8, 25)
    assert block_shape((97,), 64) == (1, 97, 1, 1)  # a prime length above the chunk: untransformed
    assert block_shape((0, 5), 64)[:2] == (0, 0)


# Shapes of at most 5,000 elements, filtered before a tensor is drawn (70**4 would be 24M).
shapes = st.one_of(st.just(()), st.lists(st.integers(0, 70), min_size=1, max_size=4).map(tuple)).filter(
    lambda s: math.prod(s) <= 5000
)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, chunk=st.sampled_from([1, 4, 64]), seed=st.integers(0, 2**31 - 1))
def test_transform_round_trips_and_keeps_the_norm(shape, chunk, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    c = DCT(gz.TopK(0.1), chunk=chunk)
    y = c.forward(x)
    assert y.shape == x.shape and y.dtype == torch.float64
    torch.testing.assert_close(c.inverse(y, x.shape), x)
    assert math.isclose(float(y.norm()), float(x.norm()), rel_tol=1e-12, abs_tol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_error_feedback_keeps_what_was_not_sent(shape, dtype, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if x.numel() == 0:
        return
    c = DCT(gz.TopK(0.1))
    r0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.1
    payload, r = c.encode(x, TensorContext(name="w", dtype=dtype), r0, feedback=True)
    sent = c.decompress(payload)
    assert sent.shape == x.shape and r.shape == x.shape and r.dtype == torch.float32
    want = x.float() + r0
    torch.testing.assert_close(sent.float() + r, want, rtol=0, atol=1e-5 * max(1.0, float(want.abs().max())))


def test_top_k_of_coefficients_moves_every_parameter_of_a_block():
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
    c = DCT(gz.TopK(0.01))
    sent = c.decompress(c.compress(x, TensorContext(name="w")))
    assert float((sent != 0).float().mean()) > 0.99  # 1% of the coefficients, all parameters
    plain = gz.TopK(0.01)
    assert float((plain.decompress(plain.compress(x)) != 0).float().mean()) == pytest.approx(0.01, abs=1e-3)


def test_frames_travel_as_the_codecs_own_and_peers_sum_before_one_inverse():
    c = DCT(gz.TopK(0.05, values="bf16"))
    shapes = [(64, 96), (33,), (3, 5, 7)]
    peers = []
    for r in range(3):
        g = torch.Generator().manual_seed(10 + r)
        xs = [torch.randn(s, generator=g) for s in shapes]
        payloads = [c.compress(x, TensorContext(name=f"t{i}", rank=r)) for i, x in enumerate(xs)]
        msg = pack_frames(payloads)
        peers.append(unpack_frames(msg, [p.shape for p in payloads], [p.dtype for p in payloads], check=c, rank=r))
    for i, s in enumerate(shapes):
        n = math.prod(s)
        out = torch.zeros(n)
        c.accumulate_many([peers[r][i] for r in range(3)], out)
        want = sum(c.decompress(peers[r][i]).reshape(-1) for r in range(3))
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)


def test_a_summable_codec_sums_coefficients():
    c = DCT(gz.Identity())
    assert c.summable and not c.biased
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    pa, pb = c.compress(a), c.compress(b)
    pa.body = pa.body + pb.body  # what an allreduce of the bodies does
    torch.testing.assert_close(c.decompress(pa), a + b, rtol=0, atol=1e-5)


def test_grammar_and_refusals():
    c = gz.parse("DCT(TopK(0.01), chunk=32)")
    assert isinstance(c, DCT) and c.chunk == 32 and repr(c) == "DCT(TopK(ratio=0.01), chunk=32)"
    assert gz.parse(repr(c)).config() == c.config()
    with pytest.raises(TypeError, match="gradzip codec"):
        DCT(gz.PowerSGD())
    with pytest.raises(ValueError, match="transforms twice"):
        DCT(DCT(gz.TopK(0.01)))
    with pytest.raises(ValueError, match="tensor by tensor"):
        DCT(gz.TopK(0.01, scope="call"))
    with pytest.raises(ValueError, match="decode from their frames"):
        DCT(gz.RandomK(0.1))
    with pytest.raises(ValueError, match="chunk"):
        DCT(gz.TopK(0.01), chunk=0)
