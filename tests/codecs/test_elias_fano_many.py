"""unpack_ef_many: several Elias-Fano frames checked together accept exactly what unpack_ef
accepts one by one, with the same positions; any frame unpack_ef refuses makes it return None."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradzip.codecs.positions import pack_ef, unpack_ef, unpack_ef_many
from gradzip.wire import FrameError

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _frame(n, k, seed, vb):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    vals = torch.randint(0, 256, (k * vb,), generator=g, dtype=torch.uint8)
    return torch.cat([pack_ef(idx, n), vals]), idx


@PROPS
@given(
    st.lists(st.tuples(st.integers(1, 3000), st.floats(0.0005, 1.0), st.integers(0, 10**6)), min_size=1, max_size=5),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 10**6),
    st.booleans(),
)
def test_many_accepts_what_one_by_one_accepts(specs, vb, where, corrupt):
    frames = []
    for n, frac, seed in specs:
        k = max(1, min(n, round(frac * n)))
        frames.append(_frame(n, k, seed, vb))
    bodies = [f[0].clone() for f in frames]
    ns = [n for n, _, _ in specs]
    if corrupt:  # one byte of one frame: its count, positions, padding or values
        j = where % len(bodies)
        b = bodies[j]
        pos = (where // len(bodies)) % b.numel()
        b[pos] ^= 1 << ((where // 7) % 8)
    want = []
    for b, n in zip(bodies, ns):
        try:
            want.append(unpack_ef(b, n, vb))
        except FrameError:
            want.append(None)
    got = unpack_ef_many(bodies, ns, [vb] * len(bodies))
    if any(w is None for w in want):
        assert got is None
        return
    assert got is not None
    for (gi, gr), (wi, wr) in zip(got, want):
        assert torch.equal(gi, wi) and torch.equal(gr, wr)
    if not corrupt:
        assert all(torch.equal(g[0], f[1]) for g, f in zip(got, frames))


def test_a_bitmap_with_extra_bits_is_refused_together():
    body, _ = _frame(1000, 10, 0, 4)
    k_bytes, low = 1, 6  # k = 10 in one LEB128 byte; floor(log2(1000 / 10)) low bits
    upper_start = k_bytes + (10 * low + 7) // 8
    bad = body.clone()
    bad[upper_start + 1] |= 0xFF  # more set bits than positions
    with pytest.raises(FrameError):
        unpack_ef(bad, 1000, 4)
    assert unpack_ef_many([body, bad], [1000, 1000], [4, 4]) is None
    assert unpack_ef_many([body, body], [1000, 1000], [4, 4]) is not None


def test_a_position_past_the_tensor_is_refused_together():
    """The last position's low bits raised past n - 1: ascending, the right count, refused
    only by the range check."""
    n, k, low = 1000, 10, 6
    idx = torch.tensor([3, 90, 200, 333, 480, 512, 640, 777, 901, 999])
    body = torch.cat([pack_ef(idx, n), torch.zeros(4 * k, dtype=torch.uint8)])
    bad = body.clone()
    for bit in range((k - 1) * low, k * low):  # the last position's low bits: 999 -> 1023
        bad[1 + bit // 8] |= 1 << (bit % 8)
    with pytest.raises(FrameError, match="outside"):
        unpack_ef(bad, n, 4)
    assert unpack_ef_many([body, bad], [n, n], [4, 4]) is None
    assert torch.equal(unpack_ef_many([body, body], [n, n], [4, 4])[1][0], idx)


def test_a_bitmap_with_one_bit_too_many_is_refused_together():
    """One more bitmap bit after the last position's: ascending and in range, refused only by
    the count."""
    n, k, low = 1000, 10, 6
    idx = torch.tensor([3, 90, 200, 333, 480, 512, 640, 700, 800, 900])
    body = torch.cat([pack_ef(idx, n), torch.zeros(4 * k, dtype=torch.uint8)])
    upper_at = 1 + (k * low + 7) // 8
    last = (900 >> low) + k - 1  # the last set bit of the bitmap
    bad = body.clone()
    bad[upper_at + (last + 1) // 8] |= 1 << ((last + 1) % 8)
    with pytest.raises(FrameError, match="bitmap bits set"):
        unpack_ef(bad, n, 4)
    assert unpack_ef_many([body, bad], [n, n], [4, 4]) is None


@PROPS
@given(
    st.integers(1, 3000),
    st.floats(0.0005, 1.0),
    st.integers(1, 5),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 10**6),
    st.booleans(),
    st.integers(0, 3),
)
def test_a_strided_round_of_one_layout_is_unpacked_at_once_as_one_by_one(n, frac, frames, vb, where, corrupt, gap):
    """Frames of one (n, k) at one stride in one buffer (a round of Flat(TopK)'s frames): read
    as the rows of one view (one pass for all; ``wire.row_view``), with the same acceptance,
    positions and value bytes as unpack_ef one by one (the values in place where 8-byte aligned,
    else in one aligned copy of all rows)."""
    from gradzip import wire

    k = max(1, min(n, round(frac * n)))
    made = [_frame(n, k, where + j, vb) for j in range(frames)]
    size = made[0][0].numel()
    buf = torch.full((frames * (size + gap),), 0x5A, dtype=torch.uint8)  # 0x5A between frames
    bodies = [buf[j * (size + gap) : j * (size + gap) + size] for j in range(frames)]
    for b, (body, _) in zip(bodies, made):
        b.copy_(body)
    if corrupt:
        b = bodies[where % frames]
        b[(where // frames) % size] ^= 1 << ((where // 7) % 8)
    assert frames == 1 or wire.row_view(bodies) is not None
    want = []
    for b in bodies:
        try:
            want.append(unpack_ef(b, n, vb))
        except FrameError:
            want.append(None)
    got = unpack_ef_many(bodies, [n] * frames, [vb] * frames)
    if any(w is None for w in want):
        assert got is None
        return
    assert got is not None
    rows = frames > 1
    for (gi, gr), (wi, wr) in zip(got, want):
        assert torch.equal(gi, wi) and torch.equal(gr, wr)
        # the values: where they lie (one by one, or 8-byte aligned rows), else one aligned copy
        aligned = wr.data_ptr() % 8 == 0 and (size + gap) % 8 == 0
        assert gr.data_ptr() == wr.data_ptr() if not rows or aligned or not gr.numel() else gr.data_ptr() % vb == 0
    # with a value dtype: the values typed (one view of all rows), as wire.from_bytes types each
    vdtype = {1: torch.uint8, 2: torch.float16, 4: torch.float32}[vb]
    typed = unpack_ef_many(bodies, [n] * frames, [vb] * frames, vdtype)
    for (ti, tv), (wi, wr) in zip(typed, want):
        assert torch.equal(ti, wi) and tv.dtype == vdtype
        assert torch.equal(tv.view(torch.uint8) if vb > 1 else tv, wr)
