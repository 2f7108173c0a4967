"""Elias-Fano positions (``sparse.pack_ef``) and TopK's fixed frames.

TopK in exact mode (scope per tensor, values not "sign") sends its positions in Elias-Fano code,
whose length follows from ``n`` and ``k`` alone: every rank's frame for a tensor has one length,
which is what lets AllGather and TwoPhase skip their size exchanges (``Codec.fixed_frames``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip as gz
from gradzip.codecs.base import TensorContext
from gradzip.codecs.positions import ef_low_bits, ef_nbytes, pack_ef, pack_gaps, unpack_ef
from gradzip.codecs.topk import FMT_SPARSE_EF, FMT_SPARSE_MASK
from gradzip.wire import FMT_DENSE, FrameError


@st.composite
def positions(draw):
    n = draw(st.integers(1, 5000))
    k = draw(st.integers(1, n))
    seed = draw(st.integers(0, 2**31 - 1))
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values
    return n, idx


@settings(max_examples=300, deadline=None)
@given(positions(), st.integers(0, 4))
def test_pack_ef_round_trips_at_the_length_n_and_k_set(case, vsize):
    n, idx = case
    k = idx.numel()
    body = pack_ef(idx, n)
    assert body.numel() == ef_nbytes(n, k)  # the same for every k-subset of [0, n)
    vals = torch.arange(k * vsize, dtype=torch.int64).to(torch.uint8)
    got, rest = unpack_ef(torch.cat([body, vals]), n, vsize)
    assert torch.equal(got, idx) and torch.equal(rest, vals)
    low = ef_low_bits(n, k)
    assert 2**low * k <= n < 2 ** (low + 1) * k  # L = floor(log2(n / k))
    # L low bits and fewer than 3 bitmap bits a position (n >> L < 2k), the bitmap's one more,
    # a byte of padding for each part at most, and the count
    leb = (k.bit_length() + 6) // 7
    assert 8 * body.numel() < k * (low + 3) + 1 + 14 + 8 * leb


def test_elias_fano_is_shorter_than_the_gaps_on_uniform_positions():
    """The figure docs/architecture.md quotes: 160,000 uniform positions of 16M."""
    n, k = 16_000_000, 160_000
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:k].sort().values
    ef, gaps = 8 * pack_ef(idx, n).numel() / k, 8 * pack_gaps(idx).numel() / k
    assert round(ef, 1) == 8.6 and round(gaps, 1) == 11.0


def _refuse(body, n, vsize, field):
    with pytest.raises(FrameError, match=f"field {field}"):
        unpack_ef(body, n, vsize)


def test_unpack_ef_refuses_what_pack_ef_never_writes():
    n = 1000
    idx = torch.tensor([3, 17, 18, 400, 999])
    body = pack_ef(idx, n)  # count 5: L = 7, 5 * 7 = 35 low bits (5 bytes), 5 + 7 + 1 = 13 upper bits (2 bytes)
    assert body.numel() == 1 + 5 + 2
    _refuse(body[:-1], n, 0, "length")
    _refuse(torch.cat([body, body.new_zeros(1)]), n, 0, "length")
    bad = body.clone()
    bad[0] = 0
    _refuse(bad, n, 0, "body.count")  # no positions: an encoder writes EMPTY
    _refuse(torch.tensor([0x85, 0x00], dtype=torch.uint8), n, 0, "body.count")  # 5 in two LEB128 bytes
    _refuse(pack_ef(torch.arange(3), 3)[:1], 2, 0, "body.count")  # 3 positions in a tensor of 2
    bad = body.clone()
    bad[5] |= 0x80  # a low-bits padding bit (35 of 40 used)
    _refuse(bad, n, 0, "body.padding")
    bad = body.clone()
    bad[7] |= 0x80  # a bitmap padding bit (13 of 16 used)
    _refuse(bad, n, 0, "body.padding")
    bad = body.clone()
    bad[6] ^= 0x01  # one bitmap bit more or less: the count disagrees
    _refuse(bad, n, 0, "body.upper")
    # two equal positions (the same high part twice, the same low bits): not strictly ascending
    _refuse(pack_ef(torch.tensor([5, 5, 9]), 100), 100, 0, "body.indices")
    # a position at n: the high part one past the last
    _refuse(pack_ef(torch.tensor([2, 1000]), 1001), 1000, 0, "body.indices")


def _frames(codec, xs, dtype, feedback):
    ctxs = [TensorContext(name="w", step=3, dtype=dtype, store={}) for _ in xs]
    return [codec.encode(x, ctx, feedback=feedback)[0] for x, ctx in zip(xs, ctxs)]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3000),
    st.sampled_from([0.001, 0.01, 0.1, 0.3, 0.5]),
    st.sampled_from([None, "fp16", "bf16"]),
    st.sampled_from([(torch.float32, False), (torch.float16, True), (torch.bfloat16, True)]),
    st.integers(0, 2**31 - 1),
)
def test_topk_exact_frames_have_one_length_whatever_the_values(n, ratio, values, grad, seed):
    """The fixed_frames contract: any two inputs of a shape give frames of one format, value dtype
    and length, overflowing compensated values included (they saturate)."""
    dtype, feedback = grad
    codec = gz.TopK(ratio, values=values)
    assert codec.fixed_frames
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g)
    b = torch.randn(n, generator=g) * 1e6  # beyond float16's range: saturates, never changes dtype
    b[: n // 3] = 0.0  # and zeros among the largest when k is large
    if not feedback:
        a, b = a.to(dtype), b.to(dtype)
    pa, pb = _frames(codec, [a, b], dtype, feedback)
    assert (pa.fmt, pa.vdtype, pa.body.numel()) == (pb.fmt, pb.vdtype, pb.body.numel())
    assert pa.fmt in (FMT_SPARSE_EF, FMT_SPARSE_MASK, FMT_DENSE)
    for p in (pa, pb):  # and they decode as the codec checks them
        codec.check_frame(p)


def test_only_exact_per_tensor_value_frames_are_fixed():
    assert gz.TopK(0.01).fixed_frames and gz.TopK(0.01, values="fp16").fixed_frames
    for c in (
        gz.TopK(0.01, mode="sampled"),
        gz.TopK(0.01, mode="approx"),
        gz.TopK(0.01, mode="auto"),
        gz.TopK(0.01, scope="call"),
        gz.TopK(0.01, values="sign"),
    ):
        assert not c.fixed_frames, c
    assert gz.AllGather(gz.TopK(0.01)).rounds == 1 and gz.TwoPhase(gz.TopK(0.01)).rounds == 2
