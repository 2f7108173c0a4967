import math

import pytest
import torch

import gradzip.kernels as K
from gradzip import wire
from gradzip.kernels import decode_signed_indices, encode_signed_indices, pack_2bit, unpack_2bit

SIZES = [1, 2, 3, 4, 5, 7, 31, 33, 1009, 1823 * 781]


@pytest.mark.parametrize("n", SIZES)
def test_2bit_roundtrip_is_bit_exact(n):
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 4, (n,), generator=g, dtype=torch.uint8)
    packed = pack_2bit(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 4)
    assert torch.equal(unpack_2bit(packed, n), codes)


def test_2bit_layout_is_little_endian_within_a_byte():
    codes = torch.tensor([1, 2, 3, 0, 2], dtype=torch.uint8)
    assert pack_2bit(codes).tolist() == [1 | (2 << 2) | (3 << 4), 2]


def test_unpack_2bit_rejects_short_input():
    with pytest.raises(ValueError, match="fewer than n"):
        unpack_2bit(torch.zeros(2, dtype=torch.uint8), 9)


def test_signed_indices_roundtrip_extremes():
    idx = torch.tensor([0, 1, 2**31 - 1, 12345, 2**31 - 1, 0], dtype=torch.int64)
    neg = torch.tensor([False, True, True, False, False, True])
    words = encode_signed_indices(idx, neg)
    assert words.dtype == torch.int32
    i2, n2 = decode_signed_indices(words)
    assert torch.equal(i2, idx) and torch.equal(n2, neg)
    # Bit 31 carries the sign, the rest is the index.
    assert words[1].item() == -(2**31) + 1


def test_frames_roundtrip_and_alignment():
    bodies = [torch.arange(5, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8), torch.randn(3).view(torch.uint8)]
    ps = [
        wire.Payload(body=bodies[0], shape=torch.Size([20]), dtype=torch.float32, fmt=3, scale=0.5),
        wire.Payload(body=bodies[1], shape=torch.Size([7]), dtype=torch.float16, fmt=wire.FMT_EMPTY),
        wire.Payload(
            body=bodies[2], shape=torch.Size([3]), dtype=torch.float32, fmt=wire.FMT_DENSE, vdtype=torch.float32
        ),
    ]
    msg = wire.pack_frames(ps)
    # one 8-byte header, three 6-byte entries (the first with a 4-byte scale), the bodies back to back
    assert msg.numel() == 8 + 3 * 6 + 4 + 5 + 0 + 12
    assert (
        msg.numel()
        == wire.message_nbytes(ps)
        == 8 + sum(wire.frame_nbytes(b.numel(), bool(p.scale)) for b, p in zip(bodies, ps))
    )
    # Trailing zero padding (from a padded all-gather) is ignored; anything else after the
    # last body is no message gradzip writes.
    padded = torch.cat([msg, torch.zeros(13, dtype=torch.uint8)])
    out = wire.unpack_frames(padded, [p.shape for p in ps], [p.dtype for p in ps])
    with pytest.raises(wire.FrameError, match="field padding: nonzero bytes after the last body"):
        wire.unpack_frames(
            torch.cat([padded, torch.ones(1, dtype=torch.uint8)]), [p.shape for p in ps], [p.dtype for p in ps]
        )
    for a, b in zip(ps, out):
        assert (a.fmt, a.scale, a.shape, a.dtype) == (b.fmt, b.scale, b.shape, b.dtype)
        assert torch.equal(a.body, b.body)
    assert torch.equal(wire.from_bytes(out[2].body, torch.float32), bodies[2].view(torch.float32))


def test_unpack_frames_rejects_truncated_messages():
    p = wire.Payload(body=torch.ones(40, dtype=torch.uint8), shape=torch.Size([160]), dtype=torch.float32, fmt=3)
    msg = wire.pack_frames([p])
    with pytest.raises(ValueError, match="corrupt"):
        wire.unpack_frames(msg[:30], [p.shape], [p.dtype])
    with pytest.raises(ValueError, match="corrupt"):
        wire.unpack_frames(msg[:10], [p.shape], [p.dtype])
    bad = msg.clone()
    bad[0] = 1  # gradzip 0.1's frames
    with pytest.raises(ValueError, match="wire version 1"):
        wire.unpack_frames(bad, [p.shape], [p.dtype])


def test_dtype_codes():
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert wire.code_dtype(wire.dtype_code(dt)) == dt
    with pytest.raises(TypeError):
        wire.dtype_code(torch.int32)


def test_itemsize_is_the_element_size_without_a_tensor():
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int64, torch.bool):
        assert wire.itemsize(dt) == torch.empty(0, dtype=dt).element_size()
    assert wire.itemsize(None) == torch.empty(0, dtype=None).element_size()  # torch's default dtype


# -- planned rounds (unpack_many's defer) ----------------------------------------------------
PLANNED_CODECS = ["Int8()", "Int8(block=None)", "SignSGD()", "SignSGD(block=32)", "QSGD(levels=3)", "TernGrad()"]


def test_a_planned_entry_is_what_every_encoder_writes():
    """Hypothesis: for every planned quantizer, size and dtype, planned_entry(n) is the entry
    compress writes, whatever the values."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    import gradzip as gz

    @settings(max_examples=60, deadline=None)
    @given(
        spec=st.sampled_from(PLANNED_CODECS),
        n=st.integers(0, 300),
        dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
        scale=st.sampled_from([0.0, 1e-30, 1.0, 3e4]),
    )
    def check(spec, n, dtype, scale):
        codec = gz.parse(spec)
        p = codec.compress((torch.randn(n) * scale).to(dtype))
        fmt, vdtype, nb, sc = codec.planned_entry(n)
        assert (p.fmt, p.vdtype, p.body.numel() * p.body.element_size(), float(p.scale)) == (fmt, vdtype, nb, sc)

    check()


def _planned_round(codec, sizes, world=3, seed=0):
    """``world`` messages of ``codec``'s frames of tensors of ``sizes``, packed as a round's rows."""
    g = torch.Generator().manual_seed(seed)
    groups = [[codec.compress(torch.randn(n, generator=g)) for n in sizes] for _ in range(world)]
    cap = wire.message_capacity(groups[0])
    buf = torch.empty(world * cap, dtype=torch.uint8)
    msgs = wire.pack_round(groups, buf, [cap] * world)
    shapes = [[torch.Size([n]) for n in sizes]] * world
    return msgs, shapes, [[torch.float32] * len(sizes)] * world


def _deferred(msgs, shapes, dtypes, codec):
    defer = []
    out = wire.unpack_many(msgs, shapes, dtypes, check=codec, ranks=list(range(len(msgs))), defer=defer)
    ((flag, refuse),) = defer
    return out, bool(flag), refuse


@pytest.mark.parametrize("spec", ["Int8()", "QSGD(levels=3)"])
def test_a_planned_round_parses_as_the_host_does_and_defers_every_refusal(spec):
    import gradzip as gz

    codec = gz.parse(spec)
    sizes = [70, 1, 129]
    msgs, shapes, dtypes = _planned_round(codec, sizes)
    host = wire.unpack_many(msgs, shapes, dtypes, check=codec)
    out, bad, _ = _deferred(msgs, shapes, dtypes, codec)
    assert not bad
    for a, b in zip(host, out):
        for p, q in zip(a, b):
            assert (p.fmt, p.vdtype, p.scale, p.shape) == (q.fmt, q.vdtype, q.scale, q.shape) and q.checked
            assert torch.equal(p.body, q.body)
    entries = [codec.planned_entry(n) for n in sizes]
    table = 8 + sum(10 if e[3] else 6 for e in entries)
    end = table + sum(e[2] for e in entries)
    cases = {  # byte of message 1 -> the host path's refusal
        0: "from rank 1, field version",
        8: "from rank 1: frame 0, field format",
        end: "from rank 1, field padding",
        table + 3: "from rank 1: frame 0, field body.scales: corrupt",  # the first scale's sign
    }
    if entries[0][3]:  # QSGD: the entry's scale (its levels)
        cases[17] = "from rank 1: frame 0, field scale"
    for at, text in cases.items():
        msgs, shapes, dtypes = _planned_round(codec, sizes)
        msgs[1][at] ^= 0x80
        _, bad, refuse = _deferred(msgs, shapes, dtypes, codec)
        err = refuse()
        assert bad and isinstance(err, wire.FrameError) and text in str(err), (at, str(err))
    if spec == "Int8()":  # a code no encoder writes
        msgs, shapes, dtypes = _planned_round(codec, sizes)
        msgs[2][table + 4 * K.quant_layout(70, codec.block)[0]] = 0x80
        _, bad, refuse = _deferred(msgs, shapes, dtypes, codec)
        assert bad and "from rank 2: frame 0, field body.codes: corrupt Int8 frame: code -128" in str(refuse())


def test_a_peer_with_the_checksum_on_is_refused_as_off_plan():
    import gradzip as gz

    codec = gz.parse("Int8()")
    old = wire.set_checksum(True)
    try:
        msgs, shapes, dtypes = _planned_round(codec, [50, 3])
    finally:
        wire.set_checksum(old)
    _, bad, refuse = _deferred(msgs, shapes, dtypes, codec)
    assert bad and "field layout" in str(refuse())
