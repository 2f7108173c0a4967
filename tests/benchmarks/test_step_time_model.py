"""benchmarks/step_time.py: its model on hand-computed rows, and --merge."""

import json
import sys

import pytest


@pytest.fixture(scope="module")
def st():
    from benchmarks import step_time

    return step_time


def _row(**kw):
    r = {
        "compute_s": 0.2,
        "compute_slowest_s": 0.25,
        "codec_seconds_per_step": 0.1,
        "bytes_sent_per_step": 1e6,
        "bytes_allgather_per_step": 0.25e6,
        "collectives_per_step": 3,
        "collective_latency_s": 1e-3,
    }
    r.update(kw)
    return r


def test_model_takes_the_slowest_ranks_compute_and_keeps_rank0s(st):
    m = st.model_time(_row(), 4, 1e9)
    # allreduce of 0.75 MB: 2*3/4 * 8*0.75e6/1e9 = 0.009 s; all-gather of 0.25 MB: 3 * 8*0.25e6/1e9 = 0.006 s
    assert m["wire"] == pytest.approx(0.015)
    assert m["latency"] == pytest.approx(0.003)
    assert m["compute"] == 0.25
    assert m["total"] == pytest.approx(0.25 + 0.1 + 0.015 + 0.003)
    assert m["total_rank0_compute"] == pytest.approx(0.2 + 0.1 + 0.015 + 0.003)
    old = _row()
    del old["compute_slowest_s"]  # rows written before the slowest rank's compute was recorded
    assert st.model_time(old, 4, 1e9)["total"] == pytest.approx(0.318)
    assert st.model_time(_row(), 4, None)["wire"] == 0.0  # no bandwidth given: no wire term


def test_merge_combines_runs_and_recomputes_speedups(st, tmp_path, monkeypatch):
    def doc(rate, rows):
        return {"ranks": 4, "rows": [{"rate": rate, "method": m, "step_s": t, "steps": 5} for m, t in rows]}

    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps(doc("1gbit", [("allreduce", 2.0), ("PowerSGD-1", 0.5)])))
    b.write_text(json.dumps(doc("none", [("allreduce", 0.4), ("PowerSGD-1", 0.5)])))
    monkeypatch.setattr(st, "plot", lambda d, path: None)
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--ranks", "4", "--merge", str(a), str(b), "--out", str(out)])
    assert st.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rate"], r["method"]) for r in rows] == [
        ("1gbit", "allreduce"),
        ("1gbit", "PowerSGD-1"),
        ("none", "allreduce"),
        ("none", "PowerSGD-1"),
    ]
    assert [r["speedup_vs_allreduce"] for r in rows] == pytest.approx([1.0, 4.0, 1.0, 0.8])
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--ranks", "2", "--merge", str(a), "--out", str(out)])
    with pytest.raises(SystemExit):  # a file of another rank count is refused
        st.main()
