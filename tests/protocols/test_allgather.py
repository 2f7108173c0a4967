"""AllGather of a ``fixed_frames`` codec: one round (no size exchange), the same average as the
two-round path, ranks whose checksum settings differ still agree, and many buckets on 4 ranks
with ranks of different batch sizes neither hang nor diverge."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip import wire
from gradzip.engine import Engine
from gradzip.hooks import register_hook
from gradzip.protocols.allgather import AllGather
from tests.support import run_ranks


class _Variable(gz.SignSGD):
    """SignSGD through the two-round path (frames of unknown length), for comparison."""

    fixed_frames = False


def _average(rank, world, crc_on_rank):
    wire.set_checksum(rank == crc_on_rank)
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + n)) for n in (1000, 7, 1, 4097)]
    names = [f"t{i}" for i in range(len(xs))]
    out = {}
    for label, codec in (("fixed", gz.SignSGD(block=64)), ("variable", _Variable(block=64))):
        eng = Engine(AllGather(codec), error_feedback=False)
        avgs, traces = [], []
        for _ in range(2):  # the first call also runs the configuration check
            eng.comm.trace = []
            fut = eng.reduce(names, [x.clone() for x in xs], torch.float32)
            first = [c[0] for c in eng.comm.trace]  # issued as the call was submitted
            eng.flush()  # gloo defers later rounds to the flush
            avgs.append(fut.wait())
            eng.end_step()
            traces.append((first, [c[0] for c in eng.comm.trace], all(c[3] is not None for c in eng.comm.trace)))
        out[label] = (avgs, traces)
    wire.set_checksum(False)
    return out


def test_fixed_frames_take_one_round_and_average_as_the_two_round_path():
    for crc_on_rank in (-1, 1):  # checksum nowhere, or on rank 1 only
        res = run_ranks(_average, 3, crc_on_rank)
        for r in res:
            for step in range(2):
                assert torch.equal(r["fixed"][0][step], res[0]["fixed"][0][step])
                assert torch.equal(r["fixed"][0][step], r["variable"][0][step])
        # the second call: the payload's all-gather, the engine's flag riding in it, issued at submission,
        # nothing left for the flush; the two-round path issues its size exchange (the flag riding in it)
        # first and the payload at the flush
        first, whole, done = res[0]["fixed"][1][1]
        assert first == whole == ["allgather"] and done
        first, whole, done = res[0]["variable"][1][1]
        assert first == ["allreduce"] and whole == ["allreduce", "allgather"]


def _many_buckets(rank, world, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(300, 300) for _ in range(6)])
    out = {}
    for comp in (gz.AllGather(gz.Int8()), gz.AllGather(gz.QSGD()), gz.AllGather(gz.SignSGD())):
        ddp = DDP(model, bucket_cap_mb=1)
        register_hook(ddp, comp)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        for s in range(steps):
            x = torch.randn(4 * (rank + 1), 300, generator=torch.Generator().manual_seed(s * 31 + rank))
            opt.zero_grad()
            (ddp(x) ** 2).mean().backward()
            opt.step()
        out[repr(comp)] = [p.detach().clone() for p in model.parameters()]
    return out


def test_bucket_cap_1mb_on_four_ranks_never_hangs():
    res = run_ranks(_many_buckets, 4, 12, timeout=600)
    for key, params in res[0].items():
        assert all(bool(torch.isfinite(p).all()) for p in params), key
        for r in res[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r[key], params)), key


def test_pad_message_pads_with_zeros_and_refuses_a_longer_message():
    msg = torch.arange(1, 6, dtype=torch.uint8)
    assert wire.pad_message(msg, 5) is msg
    assert wire.pad_message(msg, 8).tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    with pytest.raises(RuntimeError, match="5 bytes exceeds the 4"):
        wire.pad_message(msg, 4)


@pytest.mark.parametrize("checksum", [False, True])
def test_pack_frames_pads_in_the_same_copy(checksum):
    """``pack_frames(size=)`` and ``pack_frames(out=)`` give ``pad_message(pack_frames(...))``
    byte for byte (the checksum covers the message, not its padding), write nothing past
    ``out``, and refuse a message longer than the agreed size."""
    import gradzip as gz

    before = wire.checksum_enabled()
    wire.set_checksum(checksum)
    try:
        codec = gz.Int8(block=4)
        payloads = [codec.compress(torch.randn(9)), codec.compress(torch.randn(5))]
        plain = wire.pack_frames(payloads)
        assert plain.numel() == wire.message_nbytes(payloads)
        size = wire.message_capacity(payloads) + 3
        want = wire.pad_message(plain, size)
        assert torch.equal(wire.pack_frames(payloads, size=size), want)
        buf = torch.full((size + 4,), 0xAB, dtype=torch.uint8)
        got = wire.pack_frames(payloads, out=buf[2 : 2 + size])
        assert torch.equal(got, want) and got.data_ptr() == buf[2:].data_ptr()
        assert buf[:2].tolist() == [0xAB] * 2 and buf[2 + size :].tolist() == [0xAB] * 2
        frames = wire.unpack_frames(got, [p.shape for p in payloads], [p.dtype for p in payloads])
        assert all(torch.equal(a.body, b.body) for a, b in zip(frames, payloads))
        with pytest.raises(RuntimeError, match=f"{plain.numel()} bytes exceeds the {plain.numel() - 1}"):
            wire.pack_frames(payloads, size=plain.numel() - 1)
    finally:
        wire.set_checksum(before)


@pytest.mark.parametrize("checksum", [False, True])
def test_pack_round_writes_bodies_that_are_rows_by_one_copy(checksum, monkeypatch):
    """A round of one frame a message whose bodies are the rows of one view (a codec's pieces
    encoded together, TwoPhase's first round of a Flat bucket): every body by one strided copy,
    the same bytes as pack_frames message by message; bodies that are not rows (apart at
    unequal strides, or messages of unequal size) go one by one, with the same bytes."""
    import gradzip as gz

    before = wire.checksum_enabled()
    wire.set_checksum(checksum)
    one_by_one = []
    real = wire._put_bodies
    monkeypatch.setattr(wire, "_put_bodies", lambda *a: one_by_one.append(1) or real(*a))
    try:
        g = torch.Generator().manual_seed(4)
        x = torch.randn(4 * 1024, generator=g)
        bounds = [0, 1024, 2048, 3072, 4096]
        ctxs = [gz.TensorContext(name=f"t#{j}/4", step=0) for j in range(4)]
        pieces = gz.SignSGD().encode_pieces(x, bounds, ctxs)
        assert wire.row_view([p.body for p in pieces]) is not None
        loose = [gz.SignSGD().compress(x[a:b]) for a, b in zip(bounds, bounds[1:])]
        for groups, extra, rows in (
            ([[p] for p in pieces], (3, 3, 3, 3), True),
            ([[p] for p in pieces], (3, 0, 3, 3), False),
            ([[p] for p in loose], (3, 3, 3, 3), False),
        ):
            sizes = [wire.message_capacity(grp) + e for grp, e in zip(groups, extra)]
            want = torch.cat([wire.pack_frames(grp, size=n) for grp, n in zip(groups, sizes)])
            out = torch.full((sum(sizes),), 0xAB, dtype=torch.uint8)
            del one_by_one[:]
            wire.pack_round(groups, out, sizes)
            assert torch.equal(out, want)
            assert (not one_by_one) == (rows and not checksum)
    finally:
        wire.set_checksum(before)


@pytest.mark.parametrize("checksum", [False, True])
def test_pack_round_is_pack_frames_per_message(checksum):
    """``pack_round`` writes each message as ``pack_frames(out=its slice)`` does, byte for byte
    (frames of several codecs and scales, messages of unequal length and padding, an empty
    one; a layout packed twice, its table positions kept), returns the slices, and refuses a
    message longer than its size or sizes that do not fill ``out``."""
    import gradzip as gz

    before = wire.checksum_enabled()
    wire.set_checksum(checksum)
    try:
        g = torch.Generator().manual_seed(3)
        groups = [
            [gz.Int8(block=4).compress(torch.randn(9, generator=g)), gz.QSGD(7).compress(torch.randn(5, generator=g))],
            [],
            [gz.TopK(0.5).compress(torch.randn(7, generator=g))],
            [gz.Int8(block=4).compress(torch.randn(10, generator=g))],
        ]
        sizes = [wire.message_capacity(grp) + extra for grp, extra in zip(groups, (0, 5, 3, 1))]
        want = torch.cat([wire.pack_frames(grp, size=n) for grp, n in zip(groups, sizes)])
        for _ in range(2):
            out = torch.full((sum(sizes),), 0xAB, dtype=torch.uint8)
            msgs = wire.pack_round(groups, out, sizes)
            assert torch.equal(out, want)
            assert [m.numel() for m in msgs] == sizes and msgs[2].data_ptr() == out[sizes[0] + sizes[1] :].data_ptr()
        short = [wire.message_nbytes(groups[0]) - 1, *sizes[1:]]
        with pytest.raises(RuntimeError, match="exceeds"):
            wire.pack_round(groups, torch.empty(sum(short), dtype=torch.uint8), short)
        with pytest.raises(ValueError, match="into"):
            wire.pack_round(groups, torch.empty(sum(sizes) + 1, dtype=torch.uint8), sizes)
    finally:
        wire.set_checksum(before)
