import math

import pytest
import torch

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
