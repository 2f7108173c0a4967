"""benchmarks/overhead.py's statistics: paired ratios per cycle and the bootstrap interval."""

import pytest


@pytest.fixture(scope="module")
def overhead():
    from benchmarks import overhead

    return overhead


def test_ratios_are_paired_by_cycle(overhead):
    # A method 10% slower than DDP in every cycle, while DDP itself drifts by 2x across cycles:
    # the paired ratio sees exactly 1.1 with a zero-width interval; unpaired medians would not.
    base = [0.2, 0.4, 0.3, 0.25, 0.35]
    times = {"DDP": base, "Identity": [1.1 * b for b in base], overhead.AA: list(base)}
    rows = {r["method"]: r for r in overhead.summarize(times)}
    assert set(rows) == {"Identity", overhead.AA}
    assert rows["Identity"]["median_ratio"] == pytest.approx(1.1)
    assert rows["Identity"]["ci95"] == pytest.approx([1.1, 1.1])
    assert rows[overhead.AA]["median_ratio"] == 1.0
    assert rows["Identity"]["step_s_median"] == pytest.approx(1.1 * 0.3)


def test_bootstrap_interval_brackets_the_median(overhead):
    ratios = [1.0 + 0.01 * k for k in range(-10, 11)]  # median 1.0
    lo, hi = overhead.median_interval(ratios)
    assert lo < 1.0 < hi
    assert 0.9 <= lo and hi <= 1.1
    assert overhead.median_interval(ratios) == (lo, hi)  # seeded: the same interval every time
