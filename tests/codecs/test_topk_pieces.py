"""TopK.encode_pieces: a tensor's pieces of one length as the rows of one view (TwoPhase's
owner pieces of a Flat bucket) against Codec.encode_pieces (an encode a piece)."""

import pytest
import torch

import gradzip.codecs.positions as positions
import gradzip.codecs.topk as topk
import gradzip.kernels as K
from gradzip.codecs.base import Codec, TensorContext
from gradzip.codecs.topk import FMT_SPARSE_EF, TopK
from gradzip.kernels import bitpack
from gradzip.wire import pack_frames, unpack_frames


def _ctxs(pieces, dtype, step=0):
    return [TensorContext(name=f"t#{j}/{pieces}", step=step, dtype=dtype) for j in range(pieces)]


def _inputs(n, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    r = torch.randn(n, generator=g, dtype=acc) * 0.1
    return x, r, acc


def _same(a, b):
    """Equal, NaN where the other has NaN (the piece with a NaN keeps it in its residual)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _spy(monkeypatch):
    calls = []
    real = positions._pack_ef_rows

    def spy(idx, n):
        calls.append(idx.shape)
        return real(idx, n)

    monkeypatch.setattr(topk, "_pack_ef_rows", spy)
    return calls


@pytest.mark.parametrize(
    "dtype, values",
    [(torch.float32, None), (torch.float16, None), (torch.float64, None), (torch.float32, "bf16")],
    ids=str,
)
def test_rows_match_piece_by_piece_bit_for_bit(dtype, values, monkeypatch):
    """Pieces below the prefilter's size (on the CPU the rows path runs only there, where encode
    runs torch.topk over the whole piece): the frames as sent, the residuals (apart, and
    compensated in place as TwoPhase hands it), without feedback too, a NaN in one piece and,
    for float16, values beyond its range (saturated, the rest kept by error feedback)."""
    calls = _spy(monkeypatch)
    pieces, n = 4, 1000
    x, r, acc = _inputs(pieces * n, dtype)
    x[1234] = float("nan")
    if dtype == torch.float16:
        r[17] = 1e6  # compensated beyond float16's range
    bounds = [j * n for j in range(pieces + 1)]
    ctxs = _ctxs(pieces, dtype)
    codec = TopK(0.01, values=values)
    for residual in (r, None):
        outs = [torch.full((pieces * n,), 9.0, dtype=acc) for _ in range(2)]
        got = codec.encode_pieces(x, bounds, ctxs, residual, feedback=True, out=outs[0])
        want = Codec.encode_pieces(codec, x, bounds, ctxs, residual, feedback=True, out=outs[1])
        assert torch.equal(pack_frames(got), pack_frames(want))
        assert _same(outs[0], outs[1]) and all(p.checked for p in got)
        assert [(p.shape, p.dtype, p.fmt, p.vdtype) for p in got] == [(p.shape, p.dtype, p.fmt, p.vdtype) for p in want]
        assert all(p.fmt == FMT_SPARSE_EF for p in got)
        for p, q in zip(got, want):
            assert torch.equal(p.parsed[0], q.parsed[0]) and _same(p.parsed[1], q.parsed[1])
    v = x.to(acc) + r  # compensated already: encoded in place
    a, b = v.clone(), v.clone()
    got = codec.encode_pieces(a, bounds, ctxs, None, feedback=True, out=a)
    want = Codec.encode_pieces(codec, b, bounds, ctxs, None, feedback=True, out=b)
    assert torch.equal(pack_frames(got), pack_frames(want)) and _same(a, b)
    got = codec.encode_pieces(x, bounds, ctxs)
    assert torch.equal(pack_frames(got), pack_frames(Codec.encode_pieces(codec, x, bounds, ctxs)))
    assert not any(p.checked for p in got)
    assert calls == [(pieces, 10)] * 4


def test_the_frames_decode_as_any_frame_does():
    """Frames from the rows path, sent and parsed back by a receiver (which distrusts them):
    every check passes and each decodes to its piece's sent values, where they were."""
    pieces, n = 3, 700
    x, r, _ = _inputs(pieces * n, torch.float32, seed=1)
    bounds = [j * n for j in range(pieces + 1)]
    codec = TopK(0.02)
    out = torch.empty(pieces * n)
    got = codec.encode_pieces(x, bounds, _ctxs(pieces, torch.float32), r, feedback=True, out=out)
    frames = unpack_frames(pack_frames(got), [p.shape for p in got], [p.dtype for p in got])
    codec.check_frames(frames)
    v = x + r
    for j, (sent, frame) in enumerate(zip(got, frames)):
        dense = codec.decompress(frame)
        idx = sent.parsed[0]
        assert torch.equal(dense[idx], v[j * n : (j + 1) * n][idx])
        assert int((dense != 0).sum()) == 14 and torch.equal(out[j * n : (j + 1) * n][idx], torch.zeros(14))


@pytest.mark.parametrize("world", [3, 7, 8, 64])
@pytest.mark.parametrize("n", [1000, 4099, 20011])
def test_twophase_pieces_of_two_lengths_are_two_groups_of_rows(n, world, monkeypatch):
    """TwoPhase's owner pieces ``j * n // W``: where ``W`` does not divide ``n`` they have two
    lengths, interleaved; each length is a group of rows (gathered, its residuals scattered back),
    bit for bit the frames and residuals of an encode a piece, with feedback (apart and in place)
    and without; pieces too small for a sparse frame (dense, at 64 owners of 1000) one by one
    among them (pieces of 15 and 16 at 64 owners of 1000 send the mask: no group); on the GPU's
    side (gathered on the device) the same frames."""
    calls = _spy(monkeypatch)
    x, r, acc = _inputs(n, torch.float32, seed=n + world)
    x[n // 3] = float("nan")
    bounds = [j * n // world for j in range(world + 1)]
    lengths = {b - a for a, b in zip(bounds, bounds[1:])}
    ctxs = _ctxs(world, torch.float32)
    codec = TopK(0.01)
    for residual in (r, None):
        outs = [torch.full((n,), 9.0, dtype=acc) for _ in range(2)]
        got = codec.encode_pieces(x, bounds, ctxs, residual, feedback=True, out=outs[0])
        want = Codec.encode_pieces(codec, x, bounds, ctxs, residual, feedback=True, out=outs[1])
        assert torch.equal(pack_frames(got), pack_frames(want)) and _same(outs[0], outs[1])
        assert [(p.shape, p.fmt, p.vdtype, p.checked) for p in got] == [
            (p.shape, p.fmt, p.vdtype, p.checked) for p in want
        ]
        for p, q in zip(got, want):
            if q.parsed is not None:
                assert torch.equal(p.parsed[0], q.parsed[0]) and _same(p.parsed[1], q.parsed[1])
    v = x + r
    a, b = v.clone(), v.clone()
    got = codec.encode_pieces(a, bounds, ctxs, None, feedback=True, out=a)
    assert torch.equal(
        pack_frames(got), pack_frames(Codec.encode_pieces(codec, b, bounds, ctxs, None, feedback=True, out=b))
    )
    assert _same(a, b)
    got = codec.encode_pieces(x, bounds, ctxs)
    assert torch.equal(pack_frames(got), pack_frames(Codec.encode_pieces(codec, x, bounds, ctxs)))
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    rows = sorted(  # the groups: a length of two pieces or more whose frames are Elias-Fano ones
        sizes.count(m) for m in lengths if sizes.count(m) > 1 and want[sizes.index(m)].fmt == FMT_SPARSE_EF
    )
    assert sorted(c[0] for c in calls[: len(rows)]) == rows and len(calls) == 4 * len(rows)
    assert rows or n // world < 20  # pieces of 15 or 16 send the mask
    calls.clear()
    with K.gpu_side_on_cpu():
        out = torch.empty(n)
        gpu = codec.encode_pieces(x, bounds, ctxs, r, feedback=True, out=out)
    want = Codec.encode_pieces(codec, x, bounds, ctxs, r, feedback=True, out=outs[1])
    assert torch.equal(pack_frames(gpu), pack_frames(want)) and _same(out, outs[1])


@pytest.mark.parametrize(
    "case",
    [
        "unequal pieces",
        "one piece",
        "mask smaller",
        "dense smaller",
        "a k a piece",
        "sampled",
        "call scope",
        "sign",
        "strided",
    ],
)
def test_other_pieces_go_one_by_one(case, monkeypatch):
    """Where the rows path does not apply, the pieces are encoded one by one: the same frames
    as Codec.encode_pieces, and no rows packed."""
    calls = _spy(monkeypatch)
    n, pieces, kw = 400, 4, {}
    bounds = [j * n for j in range(pieces + 1)]
    ctxs = _ctxs(pieces, torch.float32)
    ratio = 0.01
    if case == "unequal pieces":  # every length once: no group of two
        bounds = [0, 300, 650, 1100, 1600]
    elif case == "one piece":
        bounds, ctxs = [0, 1600], ctxs[:1]
    elif case == "mask smaller":
        ratio = 0.3
    elif case == "dense smaller":
        ratio = 0.9
    elif case == "a k a piece":
        for j, c in enumerate(ctxs):
            c.k = 4 + j
    elif case == "sampled":
        kw = {"mode": "sampled"}
    elif case == "call scope":
        kw = {"scope": "call"}
    elif case == "sign":
        kw = {"values": "sign"}
    x, r, _ = _inputs(1600, torch.float32)
    if case == "strided":  # every other element of a buffer: not viewable as rows
        x = torch.stack([x, x]).t().reshape(-1)[::2]
        assert not x.is_contiguous()
    codec = TopK(ratio, **kw)
    outs = [torch.empty(1600) for _ in range(2)]
    got = codec.encode_pieces(x, bounds, ctxs, r, feedback=True, out=outs[0])
    want = Codec.encode_pieces(codec, x, bounds, ctxs, r, feedback=True, out=outs[1])
    assert torch.equal(pack_frames(got), pack_frames(want)) and torch.equal(outs[0], outs[1])
    assert calls == []


def test_large_pieces_take_the_rows_path_on_a_gpu_only(monkeypatch):
    """From the prefilter's size the CPU encodes piece by piece (its prefilter is faster than a
    torch.topk over the piece); the GPU's side (gpu_side_on_cpu) gives the same frames where
    no magnitudes tie at the k-th place (here: random normal values)."""
    calls = _spy(monkeypatch)
    n, pieces = topk._PREFILTER_FROM + 8, 2
    x, r, _ = _inputs(n * pieces, torch.float32, seed=3)
    bounds = [0, n, 2 * n]
    ctxs = _ctxs(pieces, torch.float32)
    codec = TopK(0.01)
    outs = [torch.empty(n * pieces) for _ in range(3)]
    cpu = codec.encode_pieces(x, bounds, ctxs, r, feedback=True, out=outs[0])
    assert calls == []
    with K.gpu_side_on_cpu():
        rows = codec.encode_pieces(x, bounds, ctxs, r, feedback=True, out=outs[1])
    assert len(calls) == 1
    want = Codec.encode_pieces(codec, x, bounds, ctxs, r, feedback=True, out=outs[2])
    assert torch.equal(pack_frames(cpu), pack_frames(want)) and torch.equal(pack_frames(rows), pack_frames(want))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("numpy_route", [True, False])
@pytest.mark.parametrize("bits", [1, 3, 7, 8, 13])
@pytest.mark.parametrize("n", [0, 1, 5, 8, 37])
def test_pack_uint_packs_each_row_as_its_own_stream(n, bits, numpy_route, monkeypatch):
    monkeypatch.setattr(bitpack, "_NUMPY_BITS", numpy_route and bitpack._NUMPY_BITS)
    g = torch.Generator().manual_seed(n * 100 + bits)
    v = torch.randint(0, 1 << bits, (4, n), generator=g)
    got = bitpack.pack_uint(v, bits)
    assert got.shape == (4, (n * bits + 7) // 8) and got.dtype == torch.uint8
    for j in range(4):
        assert torch.equal(got[j], bitpack.pack_uint(v[j], bits))
    if n:
        assert torch.equal(bitpack.unpack_uint(got, n, bits), v)


@pytest.mark.parametrize("kw", [{}, {"values": "sign"}, {"mode": "sampled", "sample": 64}, {"scope": "call"}], ids=str)
def test_segments_decode_together_as_frame_by_frame(kw, monkeypatch):
    """TopK.accumulate_segments (TwoPhase's owners' pieces into disjoint ranges: one
    scatter_add_sparse for all sparse frames) against Codec.accumulate_segments (an accumulate
    a frame), bit for bit, frames as received (parsed by the checks), a dense frame among them;
    a range beyond the output is refused."""
    from gradzip.kernels import scatter_add_sparse

    launches = []
    monkeypatch.setattr(topk.K, "scatter_add_sparse", lambda *a: launches.append(1) or scatter_add_sparse(*a))
    g = torch.Generator().manual_seed(2)
    codec = TopK(0.05, **kw)
    sizes = [300, 257, 1, 300]  # one element: a DENSE frame (its value takes what it would)
    xs = [torch.randn(n, generator=g) for n in sizes]
    k = 9 if kw.get("scope") == "call" else None
    sent = [
        codec.compress(x, TensorContext(name=f"p{j}", k=k if n > 1 else 1)) for j, (n, x) in enumerate(zip(sizes, xs))
    ]
    assert (sent[2].fmt == topk.FMT_DENSE) == ("values" not in kw)
    starts = [0, 300, 557, 558]

    def received():
        return unpack_frames(pack_frames(sent), [p.shape for p in sent], [p.dtype for p in sent])

    outs = [torch.randn(858, generator=torch.Generator().manual_seed(9)) for _ in range(2)]
    outs[1] = outs[0].clone()
    codec.accumulate_segments(received(), outs[0], starts)
    assert len(launches) == 1
    Codec.accumulate_segments(codec, received(), outs[1], starts)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="decoded into"):
        codec.accumulate_segments(received(), torch.zeros(857), starts)


def test_the_dispatched_bit_packing_is_bitpacks_and_refuses_as_it_does():
    """K.pack_uint/K.unpack_uint on the CPU: bitpack's bytes and values (1-D, 2-D rows, other
    shapes flattened, other integer dtypes widened), and bitpack's refusals."""
    import gradzip.kernels as K

    v = torch.randint(0, 1 << 11, (3, 50), generator=torch.Generator().manual_seed(1))
    for x in (v, v[1], v.reshape(3, 5, 10), v.to(torch.int32)):
        want = bitpack.pack_uint(x.reshape(-1) if x.dim() != 2 else x, 11)
        assert torch.equal(K.pack_uint(x, 11), want)
    packed = K.pack_uint(v, 11)
    assert torch.equal(K.unpack_uint(packed, 50, 11), v) and torch.equal(K.unpack_uint(packed[2], 50, 11), v[2])
    assert K.unpack_uint(packed[0], 0, 11).shape == (0,) and K.unpack_uint(packed, 0, 11).shape == (3, 0)
    with pytest.raises(ValueError, match="fewer than 51 values"):
        K.unpack_uint(packed, 51, 11)
    for bad in (0, 64, True):
        with pytest.raises(ValueError, match="bits must be"):
            K.pack_uint(v, bad)
        with pytest.raises(ValueError, match="bits must be"):
            K.unpack_uint(packed, 5, bad)
    with pytest.raises(TypeError, match="uint8"):
        K.unpack_uint(packed.to(torch.int32), 5, 11)
    with pytest.raises(ValueError, match="n must be"):
        K.unpack_uint(packed, -1, 11)


@pytest.mark.parametrize(
    "spec", ["TopK(0.3)", "TopK(0.01)", "TopK(0.05, values='sign')", "TopK(0.05, values='fp16')", "TopK(1.0)"]
)
def test_accumulate_many_adds_every_peer_at_once_as_frame_by_frame(spec, monkeypatch):
    """TopK.accumulate_many (one kernels.scatter_add_sparse_many for the sparse frames) against
    Codec.accumulate_many (an accumulate a frame), bit for bit: 4 peers' frames of one tensor,
    bitmap, Elias-Fano, sign and fp16-value frames, positions shared between peers, an output
    holding -0.0; dense frames (TopK(1.0)) go frame by frame. Under the interpreter the Triton
    kernel (forced) too."""
    import os

    import gradzip as gz

    calls = []
    real = K.scatter_add_sparse_many
    monkeypatch.setattr(K, "scatter_add_sparse_many", lambda *a: calls.append(len(a[1])) or real(*a))
    codec = gz.parse(spec)
    g = torch.Generator().manual_seed(11)
    n = 1000
    frames = [
        codec.compress(torch.randn(n, generator=g) * 10.0**p, TensorContext(name="x", dtype=torch.float32))
        for p in range(-1, 3)
    ]
    out0 = torch.randn(n, generator=g)
    out0[::5] = -0.0
    got, want = out0.clone(), out0.clone()
    codec.accumulate_many(frames, got)
    Codec.accumulate_many(codec, frames, want)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert calls == ([] if spec == "TopK(1.0)" else [4])
    if os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setenv(K.ENV_VAR, "triton")
        got = out0.clone()
        codec.accumulate_many(frames, got)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    with pytest.raises(ValueError, match="decoded into"):
        codec.accumulate_many(frames, torch.zeros(n + 1))
