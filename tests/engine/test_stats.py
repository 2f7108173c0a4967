"""Stats: codec blocks book wall-clock and CPU time (the engine's checks included); old state dicts still load."""

import time

import torch

from gradzip.protocols.base import codec_time
from gradzip.stats import Stats
from tests.support import run_ranks


def test_codec_blocks_book_wall_and_thread_cpu_time():
    stats = Stats()
    x = torch.randn(1 << 20)
    with codec_time(stats):
        for _ in range(20):
            x = x * 1.0001
    assert stats.codec_cpu_seconds > 0
    assert stats.codec_cpu_seconds <= stats.codec_seconds + 1e-3  # one thread: CPU time never exceeds wall time
    wall, cpu = stats.codec_seconds, stats.codec_cpu_seconds
    with codec_time(stats):
        time.sleep(0.05)  # waiting is wall time, not CPU time
    assert stats.codec_seconds - wall >= 0.045
    assert stats.codec_cpu_seconds - cpu < 0.02


def test_codec_time_is_booked_when_the_block_raises():
    stats = Stats()
    try:
        with codec_time(stats):
            time.sleep(0.02)
            raise ValueError("boom")
    except ValueError:
        pass
    assert stats.codec_seconds >= 0.015


def _engine_checks(rank, world):
    import gradzip as gz
    import gradzip.engine as engine_mod
    from gradzip.engine import Engine

    real, calls = engine_mod.all_finite, []

    def slow_check(tensors):  # each of the engine's non-finite checks takes 30 ms more
        calls.append(1)
        time.sleep(0.03)
        return real(tensors)

    engine_mod.all_finite = slow_check
    try:
        eng = Engine(gz.TopK(ratio=0.1))
        fut = eng.reduce(["w"], [torch.randn(1000)])
        eng.flush()
        eng.end_step()
        fut.wait()
    finally:
        engine_mod.all_finite = real
    return len(calls), eng.stats()["codec_seconds"]


def test_engine_non_finite_checks_are_booked_as_codec_time():
    ((calls, codec),) = run_ranks(_engine_checks, 1)
    assert calls == 3  # the gradients (before the protocol), the new residuals (first round), the average
    assert codec >= 0.9 * 0.03 * calls


def test_state_dict_round_trip_and_old_state_without_cpu_field():
    stats = Stats()
    stats.add(steps=2, codec_seconds=0.5, codec_cpu_seconds=0.25)
    again = Stats()
    again.load_state_dict(stats.state_dict())
    assert again.as_dict()["codec_cpu_seconds"] == 0.25
    old = {k: v for k, v in stats.state_dict().items() if k != "codec_cpu_seconds"}  # saved before the field existed
    fresh = Stats()
    fresh.load_state_dict(old)
    assert fresh.codec_cpu_seconds == 0.0 and fresh.codec_seconds == 0.5 and fresh.steps == 2
