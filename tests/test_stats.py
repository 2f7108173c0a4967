"""Stats: codec blocks book wall-clock and CPU time; old state dicts still load."""
import time

import torch

from gradzip.exchange import codec_time
from gradzip.stats import Stats


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
            raise ValueError("boom")
    except ValueError:
        pass
    assert stats.codec_seconds > 0 and stats.as_dict()["codec_cpu_seconds"] >= 0


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
