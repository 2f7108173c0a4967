"""Cost model and `gradzip plan`: hand-computed cases, dry runs, profiles, the auto policy's choices."""

import json
import math

import pytest
import torch

from gradzip import plan
from gradzip.codecs import FP16, Identity, TopK
from gradzip.codecs.positions import ef_nbytes
from gradzip.codecs.quant import Int8, SignSGD
from gradzip.codecs.topk import FMT_SPARSE_EF
from gradzip.costmodel import (
    CodecFit,
    CodecProfile,
    Collective,
    Link,
    WireCache,
    allgather_time,
    allreduce_time,
    ddp_buckets,
    dry_run,
    layer_cost,
    measure_codec,
    parse_bandwidth,
    parse_duration,
    sample,
    step_cost,
    wire_time,
)
from gradzip.policy import Policy
from gradzip.protocols import AllGather, Allreduce, TwoPhase
from gradzip.protocols.powersgd import PowerSGD
from gradzip.wire import ENTRY_BYTES, HEADER_BYTES, message_capacity, message_nbytes

MiB = 2**20


# -- ring formulas ---------------------------------------------------------------------------
def test_ring_formulas_hand_computed():
    link = Link(1e9, 1e-4)  # 1 Gbit/s, 100 us
    # allreduce of 1 MB on 4 ranks: 2*3/4 * 8e6 bit / 1e9 bit/s = 12 ms, plus 2*3 latencies = 0.6 ms
    assert allreduce_time(1e6, 4, link) == pytest.approx(0.0126, rel=1e-12)
    # allgather of 1 MB per rank on 4 ranks: 3 * 8 ms = 24 ms, plus 3 latencies = 0.3 ms
    assert allgather_time(1e6, 4, link) == pytest.approx(0.0243, rel=1e-12)
    # 2 ranks, 1000 bytes: 1 * 8e3 / 1e9 = 8 us, plus 2 latencies
    assert allreduce_time(1000, 2, link) == pytest.approx(8e-6 + 2e-4, rel=1e-12)
    assert allgather_time(1000, 2, link) == pytest.approx(8e-6 + 1e-4, rel=1e-12)
    # one rank talks to nobody
    assert allreduce_time(1e9, 1, link) == 0.0 == allgather_time(1e9, 1, link)
    # large N: the allreduce's bandwidth term tends to 2 S/B, the allgather's grows with N
    assert allreduce_time(1e6, 1024, Link(1e9)) == pytest.approx(2 * 1023 / 1024 * 8e-3)
    assert allgather_time(1e6, 1024, Link(1e9)) == pytest.approx(1023 * 8e-3)
    colls = [Collective("allreduce", 8, control=True), Collective("allgather", 1000)]
    assert wire_time(colls, 4, link) == pytest.approx(allreduce_time(8, 4, link) + allgather_time(1000, 4, link))
    with pytest.raises(ValueError, match="kind"):
        Collective("broadcast", 8).time(2, link)
    with pytest.raises(ValueError, match=r"world_size must be an integer in \[1, inf\)"):
        allreduce_time(8, 0, link)


def test_link_and_unit_parsing():
    assert parse_bandwidth("1Gbit") == 1e9
    assert parse_bandwidth("100Mbit") == 1e8
    assert parse_bandwidth("100 mbps") == 1e8
    assert parse_bandwidth("10G") == 1e10
    assert parse_bandwidth("125MB/s") == 1e9  # bytes
    assert parse_bandwidth("2.5e9") == 2.5e9
    assert parse_bandwidth(3e8) == 3e8
    assert parse_duration("50us") == pytest.approx(5e-5)
    assert parse_duration("0.2ms") == pytest.approx(2e-4)
    assert parse_duration("1.5s") == 1.5
    assert parse_duration(0.1) == 0.1
    assert Link.parse("1Gbit", "50us") == Link(1e9, 5e-5)
    for bad in ("fast", "-1Gbit", 0, float("nan"), True, None):
        with pytest.raises(ValueError, match="bandwidth"):
            parse_bandwidth(bad)
    for bad in ("soon", -1e-3, float("inf"), False):
        with pytest.raises(ValueError, match="latency"):
            parse_duration(bad, "latency")
    with pytest.raises(ValueError, match=r"bandwidth_bps must be a finite number in \(0, inf\)"):
        Link(0)
    with pytest.raises(ValueError, match=r"latency_s must be a finite number in \[0, inf\)"):
        Link(1e9, -1.0)


# -- dry runs --------------------------------------------------------------------------------
def test_dry_run_bytes_are_the_real_exchange():
    x = torch.randn(100, 100, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    sampled = TopK(0.01, mode="sampled")  # counts that vary: frames of varying length
    d = dry_run(AllGather(sampled), [x], world_size=4)
    # size exchange (one int64, and the engine's flag beside it), then one frame: header + 100
    # gap-coded positions + 100 fp32 values
    assert d.collectives == [
        Collective("allreduce", 16, control=True),
        Collective("allgather", message_nbytes([sampled.compress(x)])),
    ]
    assert d.rounds == 2 and d.flag_carried
    no_flag = dry_run(AllGather(sampled), [x], world_size=4, flag=False)  # as a route of a sub-call runs
    assert no_flag.collectives[0] == Collective("allreduce", 8, control=True) and not no_flag.flag_carried
    # exact top-k: fixed frames (Elias-Fano positions), one all-gather of the message padded to
    # room for the checksum, the engine's flag one byte after it
    e = dry_run(AllGather(TopK(0.01)), [x], world_size=4)
    frame = TopK(0.01).compress(x)
    assert frame.fmt == FMT_SPARSE_EF and frame.body.numel() == ef_nbytes(10000, 100) + 400
    assert e.collectives == [Collective("allgather", message_capacity([frame]) + 1)] and e.rounds == 1
    assert e.flag_carried
    comp = TopK(0.01)
    # from 4 ranks a codec that is not summable travels in two phases: lengths, the pieces to
    # their owners (the engine's flag beside each length), the owners' message length, then the
    # owners' re-encoded pieces
    t = dry_run(sampled, [x], world_size=4)
    pieces = [message_nbytes([sampled.compress(p)]) for p in x.reshape(-1).split(2500)]  # 25 of 2,500 each
    assert t.collectives == [
        Collective("alltoall", 64, control=True, offrank=48),
        Collective("alltoall", sum(pieces), offrank=sum(pieces[1:])),
        Collective("allreduce", 8, control=True),
        Collective("allgather", pieces[0]),
    ]
    # exact: the pieces, each padded to its capacity and a flag byte, then the owners' pieces
    f = dry_run(comp, [x], world_size=4)
    cap = [message_capacity([comp.compress(p)]) for p in x.reshape(-1).split(2500)]
    assert f.collectives == [
        Collective("alltoall", sum(cap) + 4, offrank=sum(cap[1:]) + 3),
        Collective("allgather", max(cap)),
    ]
    t = f
    own = x.reshape(-1)[:2500]  # rank 0's piece: the top-k of the piece, then of its average
    assert torch.allclose(t.out[:2500], comp.decompress(comp.compress(own)))
    # four identical ranks: the average is what one rank sends
    assert torch.allclose(d.out, comp.decompress(comp.compress(x)).reshape(-1))
    assert [c.nbytes for c in dry_run(Identity(), [x], world_size=4).collectives] == [40000]
    assert [c.nbytes for c in dry_run(FP16(), [x], world_size=4).collectives] == [20002]  # the flag: one fp16 more
    assert [c.nbytes for c in dry_run(FP16(), [x], world_size=4, flag=False).collectives] == [20000]
    # the engine's flag rule: only a call that sums its tensors as they are goes without one
    assert dry_run(Identity(), [x], world_size=4).plain and dry_run(Identity(), [x], world_size=4, decode=False).plain
    assert not dry_run(FP16(), [x], world_size=4).plain and not dry_run(TopK(0.01), [x], world_size=4).plain
    d = e
    assert not dry_run(Identity(), [x], world_size=4, error_feedback=True).plain
    # PowerSGD rank 2 of a 100x100 matrix: P (100x2) and the engine's flag (one float32 it
    # carries), then Q (100x2), fp32; the engine then sends no flag of its own
    p = dry_run(PowerSGD(rank=2), [x], world_size=4)
    assert [c.nbytes for c in p.collectives] == [804, 800] and p.rounds == 2
    assert p.flag_carried and not p.plain
    assert dry_run(FP16(), [x], world_size=4).flag_carried  # one float16 after the bodies
    assert not dry_run(Identity(), [x], world_size=4).flag_carried  # plain: no flag at all
    assert torch.allclose(dry_run(Identity(), [x], world_size=3).out, x.reshape(-1))
    # bytes only: stops after launching the last round, decodes nothing
    q = dry_run(AllGather(TopK(0.01)), [x], world_size=1024, decode=False)
    assert q.collectives == d.collectives and q.out is None
    assert torch.equal(x, before)


def test_dry_run_of_hierarchical_with_uneven_pieces_counts_bytes_without_decoding():
    """A node's piece smaller than the number of nodes leaves some owners of the inner
    two-phase exchange an empty piece: the loopback cannot fabricate their frames, so a
    bytes-only dry run must stop the inner exchange after its last round instead of
    decoding (it raised "corrupt SignSGD frame" before)."""
    from gradzip.protocols import Hierarchical

    x = torch.randn(10, generator=torch.Generator().manual_seed(0))
    h = dry_run(
        Hierarchical(SignSGD(), local_size=2), [x], world_size=16, names=["t"], error_feedback=True, decode=False
    )
    assert h.out is None
    # the cross-node part is exactly the inner protocol on the node's piece among 8 nodes (in a
    # sub-call, which is offered no engine flag: the engine sends its own)
    inner = dry_run(SignSGD(), [x[:5]], world_size=8, names=["t@0/2"], error_feedback=True, decode=False, flag=False)
    assert not h.flag_carried
    assert [c for c in h.collectives if c.scope == "cross"] == [
        Collective(c.kind, c.nbytes, c.control, c.offrank, "cross", 8) for c in inner.collectives
    ]
    intra = [(c.kind, c.nbytes) for c in h.collectives if c.scope == "intra"]
    assert intra == [("allreduce", 40), ("allgather", 20)]  # 10 fp32 summed, this rank's 5 gathered
    # a full dry run still refuses to decode peers the loopback cannot fabricate
    with pytest.raises(ValueError, match="corrupt SignSGD frame"):
        dry_run(Hierarchical(SignSGD(), local_size=2), [x], world_size=16, names=["t"], error_feedback=True)


def test_wire_cache_reuses_world_invariant_logs_only():
    cache = WireCache(probe_worlds=(2, 64))
    shapes = [(64, 64)]
    a = cache.collectives(AllGather(TopK(0.01)), shapes, 8)
    assert cache.dry_runs == 2 and a == cache.collectives(AllGather(TopK(0.01)), shapes, 32) and cache.dry_runs == 2
    # Int8's summed lanes widen with the world size: 7 lanes of 9 bits per int64 word on 2 ranks
    # (2 * 254 < 2**9), 4 lanes of 14 bits on 64 ranks (64 * 254 < 2**14)
    i2 = cache.collectives(Int8(allreduce=True), shapes, 2)
    i64 = cache.collectives(Int8(allreduce=True), shapes, 64)
    assert i2[-1].nbytes == 8 * math.ceil(4096 / 7) and i64[-1].nbytes == 8 * 4096 // 4
    n = cache.dry_runs
    cache.collectives(Int8(allreduce=True), shapes, 16)
    assert cache.dry_runs == n + 1


def test_ddp_buckets_follow_ddps_rule():
    sizes = [10 * MiB, 10 * MiB, 10 * MiB, MiB // 2, 6 * MiB // 10]
    # reverse order; the first bucket closes at >= 1 MiB, the next ones at >= 25 MiB
    assert ddp_buckets(sizes) == [[4, 3], [2, 1, 0]]
    assert ddp_buckets(sizes, bucket_cap_mb=5) == [[4, 3], [2], [1], [0]]
    assert ddp_buckets([100, 100]) == [[1, 0]]
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a finite number in \(0, inf\)"):
        ddp_buckets(sizes, bucket_cap_mb=0)


# -- codec profiles ---------------------------------------------------------------------------
def test_codec_fit_and_profile_round_trip(tmp_path):
    fit = CodecFit(1e-4, 2e-9, 3e-5, 4e-10)
    assert fit.seconds(1000, 1) == pytest.approx(1e-4 + 2e-6)
    assert fit.seconds(1000, 5) == pytest.approx(1e-4 + 2e-6 + 4 * (3e-5 + 4e-7))
    with pytest.raises(ValueError, match=r"encode_s_per_elem must be a finite number in \[0, inf\)"):
        CodecFit(0.0, -1.0)
    prof = CodecProfile(machine={"cpu": "test"}, measure_missing=False)
    prof.add(TopK(0.01), fit)
    path = tmp_path / "codec.json"
    prof.save(str(path))
    back = CodecProfile.load(str(path))
    assert back.fit(TopK(0.01)) == fit
    assert back.machine == {"cpu": "test"}
    with pytest.raises(KeyError, match="no entry for TopK"):
        back.fit(TopK(0.02))
    with pytest.raises(KeyError, match="no entry"):
        back.fit(TopK(0.01), error_feedback=False)  # error feedback is part of the key
    d = json.loads(path.read_text())
    with pytest.raises(ValueError, match="not a gradzip codec profile"):
        CodecProfile.from_dict({**d, "kind": "other"})
    with pytest.raises(ValueError, match="version"):
        CodecProfile.from_dict({**d, "version": 99})
    broken = json.loads(path.read_text())
    next(iter(broken["entries"].values())).pop("encode_s")
    with pytest.raises(ValueError, match="incomplete"):
        CodecProfile.from_dict(broken)


def test_measure_codec_times_this_machine():
    threads = torch.get_num_threads()
    fit, raw = measure_codec(TopK(0.05), sizes=(256, 4096), worlds=(1, 3), repeats=2, threads=1)
    assert set(raw) == {"n=256,W=1", "n=256,W=3", "n=4096,W=1", "n=4096,W=3"}
    assert all(v > 0 for v in raw.values())
    assert fit.seconds(4096, 3) > 0
    assert torch.get_num_threads() == threads  # restored
    # an allreduce-only exchange decodes once, whatever the world size
    fit_id, _ = measure_codec(Identity(), sizes=(256, 4096), worlds=(1, 3), repeats=1)
    assert fit_id.peer_s == 0.0 and fit_id.peer_s_per_elem == 0.0
    prof = CodecProfile(sizes=(256, 4096), worlds=(1, 3), repeats=1)  # measures what it lacks
    assert prof.fit(SignSGD()) == CodecProfile.from_dict(prof.to_dict()).fit(SignSGD())
    with pytest.raises(ValueError, match="sizes must be two integers"):
        measure_codec(TopK(0.05), sizes=(4096, 256))


def test_fit_in_n_separates_own_peer_and_owned_work():
    from gradzip.costmodel.profile import _fit_worlds

    worlds = (2, 4, 8)
    exact = [0.05 + 0.01 * (w - 1) + 0.4 / w for w in worlds]
    assert _fit_worlds(worlds, exact, True) == pytest.approx((0.05, 0.01, 0.4))
    assert _fit_worlds(worlds, exact, False)[1] == 0.0  # no peers decoded: no peer term
    # TwoPhase-like: falling with N and no peer work; the peer term would come out negative
    falling = [0.24, 0.16, 0.105]
    a, b, c = _fit_worlds(worlds, falling, True)
    assert b == 0.0 and a >= 0 and c > 0
    assert a + c / 4 == pytest.approx(0.16, rel=0.05)  # 4 ranks: not the 2 ranks' 0.24
    # two worlds: the line in N - 1 (no owned term can be told apart)
    assert _fit_worlds((2, 8), [0.1, 0.16], True) == pytest.approx((0.09, 0.01, 0.0))
    assert _fit_worlds((2, 8), [0.2, 0.1], True) == pytest.approx((0.15, 0.0, 0.0))  # falling: the mean
    fit = CodecFit(1e-4, 0.0, 0.0, 0.0, 2e-4, 1e-8)
    assert fit.seconds(1000, 4) == pytest.approx(1e-4 + (2e-4 + 1e-5) / 4)
    # profiles written before the owned terms load with them at 0
    entry = {"encode_s": 1e-4, "encode_s_per_elem": 2e-9, "peer_s": 3e-5, "peer_s_per_elem": 4e-10}
    assert CodecFit.of(entry) == CodecFit(1e-4, 2e-9, 3e-5, 4e-10, 0.0, 0.0)
    assert CodecFit.of({**entry, "owner_s_per_elem": 1e-9}, elem_scale=2.0).owner_s_per_elem == 2e-9


def test_timed_dry_runs_reuse_the_residual_buffers_of_a_steady_step():
    """A memory rolled back after each run (as measure_codec times them) hands the run the
    buffers of the run before: no fresh residual is paged in, and every run starts from the
    same residual."""
    from gradzip.feedback import ErrorFeedback

    x = torch.randn(64, 64)
    memory = ErrorFeedback()
    dry_run(TopK(0.05), [x], world_size=2, names=["w"], memory=memory)
    memory.release()
    start = memory.residual("w").clone()
    buffers = set()
    for _ in range(3):
        dry_run(TopK(0.05), [x], world_size=2, names=["w"], memory=memory)
        buffers.add(memory.residual("w").data_ptr())
        memory.restore()
        assert torch.equal(memory.residual("w"), start)
    assert len(buffers) == 1  # the spare, each time


def test_measure_codec_times_every_run_from_one_rolled_back_memory(monkeypatch):
    """The timed runs of a size and world share one memory, and each starts with its residuals
    rolled back: no run pages in a residual buffer of its own (a steady-state step does not)."""
    import gradzip.costmodel.profile as profile_mod

    real, seen = profile_mod.dry_run, []

    def spy(comp, xs, **kw):
        memory = kw.get("memory")
        if memory is not None:
            assert memory.residual("sample") is None  # rolled back after the run before
            seen.append((xs[0].numel(), kw["world_size"], id(memory)))
        return real(comp, xs, **kw)

    monkeypatch.setattr(profile_mod, "dry_run", spy)
    measure_codec(TopK(0.05), sizes=(256, 4096), worlds=(2, 3), repeats=2, threads=1)
    assert len(seen) == 2 * 2 * 3  # sizes x worlds x (warm-up + repeats)
    for key in {s[:2] for s in seen}:
        assert len({m for *k, m in seen if tuple(k) == key}) == 1


def test_profile_without_a_fit_measures_raises_or_omits():
    fit = CodecFit(1e-4, 2e-9)
    prof = CodecProfile(machine={"cpu": "elsewhere"}, missing="omit")
    prof.add(FP16(), fit)
    assert prof.fit(FP16()) == fit and prof.fallbacks == []
    assert prof.fit(TopK(0.01)) == CodecFit(0.0, 0.0) and prof.fit(TopK(0.01)).seconds(1 << 20, 8) == 0.0
    top = repr(TopK(0.01))
    assert prof.fallbacks == [top, top] and prof.not_measured == [top]  # every lookup; each once
    assert prof.measured_here == [] and len(prof.entries) == 1  # nothing stored as if measured
    assert CodecProfile(missing="raise").measure_missing is False and CodecProfile().missing == "measure"
    with pytest.raises(ValueError, match="missing must be one of"):
        CodecProfile(missing="guess")
    here = CodecProfile(sizes=(256, 4096), worlds=(1, 3), repeats=1)
    here.add(FP16(), fit)
    here.fit(FP16())
    here.fit(SignSGD())
    here.fit(SignSGD())
    sign = repr(SignSGD())
    assert here.fallbacks == [sign, sign] and here.measured_here == [sign]
    back = CodecProfile.from_dict(here.to_dict(), missing="omit")
    assert back.missing == "omit" and back.fit(Int8()) == CodecFit(0.0, 0.0)


def test_dry_run_wall_time_and_whole_call_timing():
    calls = []
    run = dry_run(TopK(0.05), [sample((64, 64))], world_size=3, sync=lambda: calls.append(1))
    assert run.wall_seconds >= run.loopback_seconds > 0 and run.wall_seconds >= run.codec_seconds > 0
    assert len(calls) == 2 + 2 * run.rounds  # start, end, and around each round's stand-in collectives
    fit, raw = measure_codec(TopK(0.05), sizes=(256, 4096), worlds=(1, 3), repeats=1, whole_call=True, device="cpu")
    assert all(v > 0 for v in raw.values()) and fit.seconds(4096, 3) > 0


# -- a step ----------------------------------------------------------------------------------
def _profile(fits: dict) -> CodecProfile:
    prof = CodecProfile(machine={"cpu": "hand-made"}, measure_missing=False)
    for (comp, ef), fit in fits.items():
        prof.add(comp, fit, error_feedback=ef)
    return prof


def test_step_cost_hand_computed():
    link = Link(1e9, 1e-4)
    layers = [("a.weight", (256, 256)), ("a.bias", (256,))]  # 263,168 bytes: one bucket
    topk_fit = CodecFit(1e-4, 1e-8, 2e-5, 1e-9)
    prof = _profile({(AllGather(TopK(0.01)), True): topk_fit})

    ddp = step_cost(None, layers, 4, link, 0.05, prof)
    nbytes = 4 * (65536 + 256)
    assert ddp.buckets == 1 and ddp.collectives == 1 and ddp.bytes_per_rank == nbytes
    assert ddp.codec_s == 0.0
    assert ddp.wire_s == pytest.approx(2 * 3 / 4 * 8 * nbytes / 1e9 + 6e-4, rel=1e-12)
    assert ddp.total_s == pytest.approx(0.05 + ddp.wire_s)
    assert ddp.efficiency == pytest.approx(0.05 / ddp.total_s)

    topk = step_cost(AllGather(TopK(0.01)), layers, 4, link, 0.05, prof)
    # one message of two frames: a.bias (k = ceil(2.56) = 3) and a.weight (k = ceil(655.36) = 656),
    # each its Elias-Fano positions and fp32 values; the bucket's samples are seeded by its first
    # index. Fixed frames: one all-gather of the message padded to room for the checksum, and
    # the engine's flag one byte after it
    frames = [TopK(0.01).compress(sample(s, seed=1 + j)) for j, s in enumerate([(256,), (256, 256)])]
    msg = message_capacity(frames) + 1
    bodies = ef_nbytes(256, 3) + 3 * 4 + ef_nbytes(65536, 656) + 656 * 4
    assert msg == HEADER_BYTES + 4 + 2 * ENTRY_BYTES + bodies + 1 and msg < 8 + 12 + 659 * 6
    assert topk.bytes_per_rank == msg and topk.collectives == 1
    wire = 3 * 8 * msg / 1e9 + 3e-4
    assert topk.wire_s == pytest.approx(wire, rel=1e-12)
    codec = (1e-4 + 1e-8 * 65536 + 3 * (2e-5 + 1e-9 * 65536)) + (1e-4 + 1e-8 * 256 + 3 * (2e-5 + 1e-9 * 256))
    assert topk.codec_s == pytest.approx(codec, rel=1e-12)
    assert topk.total_s == pytest.approx(0.05 + codec + wire, rel=1e-12)

    # Identity sums the bucket as it is: DDP's bytes and collectives, no engine flag
    prof.add(Allreduce(Identity()), CodecFit(1e-6, 0.0), error_feedback=False)
    ident = step_cost(Identity(), layers, 4, link, 0.05, prof)
    assert ident.bytes_per_rank == nbytes and ident.collectives == 1 and ident.wire_s == ddp.wire_s
    assert ident.codec_s == pytest.approx(2e-6)

    # PowerSGD carries the engine's flag in its first allreduce: two collectives, no third;
    # routed by a Policy (a sub-call that starts in the call's first round) it carries it too,
    # and so does the first of two routes that start together; Hierarchical's inner protocol
    # runs in a sub-call that is offered none, so the engine sends its own
    prof.add(PowerSGD(rank=2), CodecFit(1e-6, 0.0), error_feedback=True)
    psgd = step_cost(PowerSGD(rank=2), layers, 4, link, 0.05, prof)
    assert psgd.collectives == 2 and psgd.bytes_per_rank == 4 * (256 + 256 * 2 + 1) + 4 * 256 * 2
    routed = step_cost(Policy(PowerSGD(rank=2)), layers, 4, link, 0.05, prof)
    assert (routed.collectives, routed.bytes_per_rank) == (psgd.collectives, psgd.bytes_per_rank)
    two = step_cost(Policy(PowerSGD(rank=2), min_numel=1000), layers, 4, link, 0.05, prof)
    assert two.collectives == 3  # PowerSGD's two rounds (the flag in its first), the bias's allreduce in the second
    assert two.bytes_per_rank == 4 * (256 * 2 + 1) + 4 * 256 * 2 + 4 * 256

    one = step_cost(TopK(0.01), layers, 1, link, 0.05, prof)
    assert one.total_s == 0.05 and one.efficiency == 1.0
    with pytest.raises(KeyError, match=r"no entry for Allreduce\(FP16\(\)\)"):
        step_cost(FP16(), layers, 4, link, 0.05, prof)
    with pytest.raises(ValueError, match=r"compute_s must be a finite number in \[0, inf\)"):
        step_cost(None, layers, 4, link, -1.0, prof)


# -- the auto policy's choices ------------------------------------------------------------------
AUTO_FITS = {  # by the protocol that carries each method on 4 ranks
    (TwoPhase(TopK(0.01)), True): CodecFit(50e-6, 5e-9),
    (AllGather(TopK(0.01)), True): CodecFit(50e-6, 5e-9, 1e-6, 1e-10),  # below 4 ranks
    (Allreduce(Identity()), False): CodecFit(5e-6, 1e-10),  # the policy runs exact routes without residuals
}


def test_auto_policy_compresses_big_layers_on_slow_links_only():
    prof = _profile(AUTO_FITS)
    slow, fast = Link(1e8, 1e-4), Link(1e11, 1e-6)
    big, tiny = (1024, 1024), (100,)
    p_slow = Policy(TopK(0.01), auto=True, link=slow, world_size=4, profile=prof)
    p_fast = Policy(TopK(0.01), auto=True, link=fast, world_size=4, profile=prof)
    # slow link, 1M elements: Identity moves 4 MB (about 0.48 s), TopK 80 kB in 5 ms of codec
    assert p_slow.choose("big.weight", big) is p_slow.default
    # a tiny layer costs latency only: TopK pays a size exchange and codec on top
    assert p_slow.choose("tiny", tiny) is p_slow.fallback
    # 100 Gbit/s: 4 MB in 0.5 ms beats 5 ms of TopK codec
    assert p_fast.choose("big.weight", big) is p_fast.fallback
    x = torch.randn(big)  # one sample for both: TopK's gap-coded positions make its bytes data-dependent
    c_default, c_fallback = p_slow.costs(x, 4)
    assert c_default == pytest.approx(layer_cost(TwoPhase(TopK(0.01)), x, 4, slow, prof, error_feedback=True), rel=1e-9)
    rows = p_slow.explain([("big.weight", big), ("tiny", tiny)])
    assert [r["reason"] for r in rows] == ["auto: default is cheaper", "auto: fallback is cheaper"]

    # per step: big layers compressed, tiny ones sent plain, cheaper than sending everything plain
    layers = [("l0.weight", big), ("l0.bias", tiny), ("l1.weight", big), ("l1.bias", tiny)]
    auto = step_cost(p_slow, layers, 4, slow, 0.1, prof)
    plain = step_cost(Policy(TopK(0.01), min_numel=10**9), layers, 4, slow, 0.1, prof)
    assert auto.detail["tensors_per_method"] == {repr(TwoPhase(TopK(0.01))): 2, repr(Allreduce(Identity())): 2}
    assert plain.detail == {}  # one method only
    assert auto.codec_s + auto.wire_s < (plain.codec_s + plain.wire_s) / 10


# -- gradzip plan --------------------------------------------------------------------------------
def test_parse_methods():
    link = Link(1e9, 5e-5)
    ms = plan.parse_methods(
        "DDP, TopK(ratio=0.01), PowerSGD(rank=2), Policy(default=TopK(ratio=0.1), auto=True)", link=link
    )
    assert list(ms) == ["DDP", "TopK(ratio=0.01)", "PowerSGD(rank=2)", "Policy(default=TopK(ratio=0.1), auto=True)"]
    assert ms["DDP"] is None and ms["TopK(ratio=0.01)"].ratio == 0.01 and ms["PowerSGD(rank=2)"].rank == 2
    pol = ms["Policy(default=TopK(ratio=0.1), auto=True)"]
    assert pol.auto and pol.link == link and pol.default.ratio == 0.1
    with pytest.raises(ValueError, match="unknown method 'Zip'"):
        plan.parse_methods("Zip")
    with pytest.raises(ValueError, match="cannot read"):  # nothing is evaluated
        plan.parse_methods("TopK(ratio=__import__('os').getpid())")
    with pytest.raises(ValueError, match="literals and method calls only"):
        plan.parse_methods("TopK(ratio=0.01 * x)")
    with pytest.raises(ValueError, match="listed twice"):
        plan.parse_methods("FP16, FP16")
    with pytest.raises(ValueError, match=r"ratio must be a finite number in \(0, 1\]"):
        plan.parse_methods("TopK(ratio=2)")


def test_plan_models(tmp_path):
    layers = plan.layers_from_params(2_100_000, (1024, 1024))
    # 2 full matrices, then 2,848 left: a 2 x 1024 matrix and 800 more
    assert layers == [
        ("layer0.weight", (1024, 1024)),
        ("layer1.weight", (1024, 1024)),
        ("rest.weight", (2, 1024)),
        ("rest.bias", (800,)),
    ]
    assert sum(math.prod(s) for _, s in layers) == 2_100_000
    bn = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    path = tmp_path / "sd.pt"
    torch.save({"model": bn.state_dict()}, path)
    assert plan.layers_from_state_dict(str(path)) == [
        ("0.weight", (3, 4)),
        ("0.bias", (3,)),
        ("1.weight", (3,)),
        ("1.bias", (3,)),
    ]
    with pytest.raises(ValueError, match=r"params must be an integer in \[1, inf\)"):
        plan.layers_from_params(0)


def test_plan_command_end_to_end(tmp_path, capsys):
    methods = "DDP, TopK(ratio=0.01), Policy(default=TopK(ratio=0.01), auto=True)"
    prof = _profile(AUTO_FITS)
    prof_path = tmp_path / "codec.json"
    prof.save(str(prof_path))
    out_png, out_json = tmp_path / "plan.png", tmp_path / "plan.json"
    common = [
        "--params",
        "3e6",
        "--compute",
        "100ms",
        "--latency",
        "100us",
        "--worlds",
        "2,8,32",
        "--methods",
        methods,
        "--profile",
        str(prof_path),
        "--task",
        "none",  # the time model alone: TopK did not hold on the language model
    ]
    assert plan.main(common + ["--bandwidth", "100Mbit", "--plot", str(out_png), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "step time in ms" in text and "measured on hand-made" in text
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads(out_json.read_text())
    assert len(res["rows"]) == 3 * 3 and res["inputs"]["params"] == 3_000_000
    layers = plan.layers_from_params(3_000_000)
    for r in res["rows"]:
        m = plan.parse_methods(r["label"], link=Link(1e8, 1e-4), profile=prof)[r["label"]]
        assert r["total_s"] == pytest.approx(
            step_cost(m, layers, r["world"], Link(1e8, 1e-4), 0.1, prof).total_s, rel=1e-9
        )
        assert r["efficiency"] == pytest.approx(0.1 / r["total_s"])
    # 100 Mbit/s: 12 MB of gradients per step; compression wins at every world size
    assert all(v != "DDP" for v in res["best"].values())
    # 100 Gbit/s: the plain allreduce wins
    assert plan.main(common + ["--bandwidth", "100Gbit", "--plot", "", "--json", str(out_json)]) == 0
    assert set(json.loads(out_json.read_text())["best"].values()) == {"DDP"}
    # bad input: a message and exit status 2, no traceback
    assert plan.main(common[:-2] + ["--profile", str(tmp_path / "none.json"), "--bandwidth", "1G", "--plot", ""]) == 2
    assert (
        plan.main(["--params", "1e6", "--compute", "1ms", "--bandwidth", "1G", "--latency", "0", "--methods", "Zip"])
        == 2
    )
    assert "unknown method 'Zip'" in capsys.readouterr().err


def test_a_stateful_codec_is_costed_in_its_settled_state():
    """Adaptive Threshold starts at a tau that sends nearly all of a unit-scale sample; the plan
    takes its bytes after SETTLE_STEPS steps (on small stand-ins), within its band; a codec
    without state is dry-run once, as it is."""
    from gradzip.codecs import Threshold
    from gradzip.costmodel.profile import settled_stores
    from gradzip.costmodel.step import WireCache

    comp, shapes = Threshold(tau=1e-3, policy="adaptive"), [(1024, 1024)]
    first = dry_run(comp, [sample(s, seed=0) for s in shapes], world_size=4, names=["p0"], decode=False).nbytes
    settled = sum(c.nbytes for c in WireCache().collectives(comp, shapes, 4))
    # the band's top (1% of the elements) against a 2-bit code for every element (1 MiB / 4)
    assert settled < first / 10
    x = [sample((4096,), seed=0)]
    stores, step = settled_stores(comp, x, names=["p0"], world=4, error_feedback=True)
    assert step > 0 and any(stores.values())  # tau per piece: TwoPhase at 4 ranks
    assert settled_stores(TopK(0.01), x, names=["p0"], world=4, error_feedback=True) == (None, 0)


def test_the_cache_dry_runs_a_stateless_call_once_and_settles_a_stateful_one(monkeypatch):
    """A call that keeps no state costs one dry run at its world size (not a settling run on
    stand-ins and then the run), with the same bytes as the settled route would give; a call
    that keeps state is settled, and at a second world size settled without the bare run."""
    from gradzip.codecs import Threshold
    from gradzip.costmodel import profile as profile_mod
    from gradzip.costmodel import step as step_mod
    from gradzip.costmodel.profile import SETTLE_STEPS, settled_stores
    from gradzip.costmodel.step import WireCache

    runs = []
    real = step_mod.dry_run

    def counted(*a, **kw):  # every dry run, the settling's included
        runs.append((kw.get("world_size"), kw.get("step", 0)))
        return real(*a, **kw)

    monkeypatch.setattr(step_mod, "dry_run", counted)
    monkeypatch.setattr(profile_mod, "dry_run", counted)
    shapes = [(64, 33), (70,)]
    for comp in (TopK(0.01), SignSGD(), TwoPhase(Int8())):
        runs.clear()
        got = WireCache().collectives(comp, shapes, 8)
        assert runs == [(8, 0)], comp
        runs.clear()
        xs = [sample(s, seed=j) for j, s in enumerate(shapes)]
        names = ["p0", "p1"]
        assert settled_stores(comp, xs, names=names, world=8, error_feedback=comp.biased, decode=False) == (None, 0)
        assert got == real(comp, xs, world_size=8, names=names, decode=False).collectives

    comp = Threshold(tau=1e-3, policy="adaptive")
    cache = WireCache()
    runs.clear()
    settled = cache.collectives(comp, [(1024, 1024)], 4)
    bare = real(comp, [sample((1024, 1024), seed=0)], world_size=4, names=["p0"], decode=False).collectives
    assert sum(c.nbytes for c in settled) < sum(c.nbytes for c in bare) / 10
    settle = [(4, s) for s in range(SETTLE_STEPS)]
    assert runs == [(4, 0), *settle, (4, SETTLE_STEPS)]  # the bare run, the settling, the settled run
    runs.clear()
    cache.collectives(comp, [(1024, 1024)], 8)
    assert runs == [(8, s) for s in range(SETTLE_STEPS + 1)]  # no bare run at a second world size


def test_dry_run_bucket_layout_sums_a_plain_call_in_place(monkeypatch):
    """``bucket=True`` lays the tensors out as DDP's bucket: Identity then sums that buffer as it is
    (no copy into a new one), the inputs are untouched, and the result is the same as with loose
    tensors."""
    import gradzip.protocols.allreduce as allreduce_mod

    real, used = allreduce_mod.back_to_back, []
    monkeypatch.setattr(allreduce_mod, "back_to_back", lambda b, d: used.append(real(b, d)) or used[-1])
    xs = [sample((3, 5), seed=1), sample((7,), seed=2)]
    before = [x.clone() for x in xs]
    loose = dry_run(Identity(), xs, world_size=4)
    assert used.pop() is None  # loose tensors: concatenated into a new buffer
    inplace = dry_run(Identity(), xs, world_size=4, bucket=True)
    assert used.pop().data_ptr() == inplace.out.data_ptr()  # the bucket, summed as it is
    assert inplace.plain and loose.plain
    assert all(torch.equal(x, b) for x, b in zip(xs, before))
    assert torch.equal(inplace.out, loose.out)
    assert [c.nbytes for c in inplace.collectives] == [c.nbytes for c in loose.collectives]
    cast = dry_run(FP16(), xs, world_size=4, bucket=True)
    assert not cast.plain and torch.equal(cast.out, dry_run(FP16(), xs, world_size=4).out)
    with pytest.raises(ValueError, match="one dtype"):
        dry_run(Identity(), [xs[0], xs[1].double()], world_size=2, bucket=True)


def test_dry_run_on_a_given_bucket_writes_the_result_into_it():
    """``bucket=<flat tensor>``: the tensors are its views, it is the bucket as it is (no copy)
    and receives the result, as DDP's bucket does; the same result as loose tensors. Tensors
    that are not that buffer's views, back to back, are refused."""
    xs = [sample((3, 5), seed=1), sample((7,), seed=2)]
    for method in (Identity(), FP16()):
        flat = torch.cat([x.reshape(-1) for x in xs])
        views = [flat[:15].view(3, 5), flat[15:]]
        loose = dry_run(method, xs, world_size=4)
        given = dry_run(method, views, world_size=4, bucket=flat)
        assert given.out.data_ptr() == flat.data_ptr() and torch.equal(given.out, loose.out)
        assert torch.equal(flat, loose.out)  # the bucket holds the result
    flat = torch.cat([x.reshape(-1) for x in xs])
    with pytest.raises(ValueError, match="views, back to back"):
        dry_run(Identity(), xs, world_size=2, bucket=flat)
    with pytest.raises(ValueError, match="views, back to back"):
        dry_run(Identity(), [flat[:15], flat[16:]], world_size=2, bucket=flat)


def test_a_plain_call_on_ddps_bucket_encodes_nothing(monkeypatch):
    """Identity on DDP's bucket (the tensors its views from its start): the bucket is divided
    and summed as it is, no payload a tensor and no decode; loose tensors take the payload
    path; the result and the bytes are the same."""
    calls = []
    real = Identity.compress
    monkeypatch.setattr(Identity, "compress", lambda self, x, ctx=None: calls.append(1) or real(self, x, ctx))
    xs = [sample((3, 5), seed=1), sample((7,), seed=2)]
    flat = torch.cat([x.reshape(-1) for x in xs])
    got = dry_run(Identity(), [flat[:15].view(3, 5), flat[15:]], world_size=4, bucket=flat)
    assert not calls and got.out.data_ptr() == flat.data_ptr()
    loose = dry_run(Identity(), xs, world_size=4)
    assert len(calls) == 2 and torch.equal(got.out, loose.out)
    assert [c.nbytes for c in got.collectives] == [c.nbytes for c in loose.collectives]
    calls.clear()
    dry_run(Identity(), xs, world_size=4, bucket=True)  # copied into a bucket of their own
    assert not calls


def test_measure_codec_times_a_plain_protocol_on_a_bucket(monkeypatch):
    """The warm-up says whether the protocol is plain; then (and only then) the timed runs get the
    bucket layout, so Identity is not charged a copy that no step makes."""
    import gradzip.costmodel.profile as profile_mod

    real, seen = profile_mod.dry_run, []

    def spy(comp, xs, **kw):
        if kw.get("memory") is not None:
            seen.append((type(comp).__name__, kw.get("bucket", False)))
        return real(comp, xs, **kw)

    monkeypatch.setattr(profile_mod, "dry_run", spy)
    measure_codec(Identity(), sizes=(256, 4096), worlds=(2, 3), repeats=2, threads=1)
    measure_codec(TopK(0.05), sizes=(256, 4096), worlds=(2, 3), repeats=2, threads=1)
    ident = [b for n, b in seen if n == "Identity"]
    assert ident == [False, True, True] * 4  # per size and world: warm-up loose, timed on a bucket
    assert not any(b for n, b in seen if n == "TopK")


def test_the_table_aligns_world_sizes_of_any_width(capsys):
    """World sizes wider than the column's five characters widen it: every row's cells start
    where the header's do."""
    argv = ["--params", "1e5", "--compute", "10ms", "--bandwidth", "10Gbit/s", "--latency", "20us"]
    assert plan.main(argv + ["--worlds", "2,100000", "--methods", "DDP, FP16"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if " | " in line]
    assert len(table) == 3 and len({line.index(" | ") for line in table}) == 1
    assert len({line.rindex(" | ") for line in table}) == 1
