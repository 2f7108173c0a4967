"""benchmarks/step_time.py: its model on hand-computed rows, --merge, and its methods' labels."""

import argparse
import json
import sys

import pytest

import gradzip as gz


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
    a.write_text(json.dumps(doc("1gbit", [("DDP", 2.0), ("PowerSGD(rank=1)", 0.5)])))
    b.write_text(json.dumps(doc("none", [("DDP", 0.4), ("PowerSGD(rank=1)", 0.5)])))
    monkeypatch.setattr(st, "plot", lambda d, path: None)
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--ranks", "4", "--merge", str(a), str(b), "--out", str(out)])
    assert st.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rate"], r["method"]) for r in rows] == [
        ("1gbit", "DDP"),
        ("1gbit", "PowerSGD(rank=1)"),
        ("none", "DDP"),
        ("none", "PowerSGD(rank=1)"),
    ]
    assert [r["speedup_vs_allreduce"] for r in rows] == pytest.approx([1.0, 4.0, 1.0, 0.8])
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--ranks", "2", "--merge", str(a), "--out", str(out)])
    with pytest.raises(SystemExit):  # a file of another rank count is refused
        st.main()


def test_each_label_is_the_grammars_spelling_of_the_method_timed(st):
    link = gz.Link(1e9, st.LATENCY_S)
    table = st.methods(1e9, 4)
    assert list(table)[0] == st.DDP and table[st.DDP] is None
    for label, method in table.items():
        got = gz.parse(label, {"link": link})  # Policy(auto=True) takes the row's link
        if isinstance(got, gz.Policy):
            got.world_size = 4  # the world size is the process group's
        assert got == method, label


def test_methods_arguments_split_outside_brackets_and_put_ddp_first(st):
    p = argparse.ArgumentParser()
    text = "Threshold(tau=0.001, policy='adaptive'), Policy(TopK(0.01),auto=True),DDP"
    assert st.parse_methods(p, text, 4) == [
        "DDP",
        "Threshold(tau=0.001, policy='adaptive')",
        "Policy(TopK(0.01), auto=True)",
    ]
    assert st.split_methods("A(1, B(2, 3)), C") == ["A(1, B(2, 3))", "C"]
    with pytest.raises(SystemExit):
        st.parse_methods(p, "TopK-1%", 4)  # the old short labels are gone
