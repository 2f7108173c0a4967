"""benchmarks/merge_runs.py pools runs of one configuration into the table one bench run would
write, and refuses runs whose options differ."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks import merge_runs
from gradzip.bench import BenchConfig, aggregate


def _doc(method: str, losses: dict[int, float], cfg: BenchConfig, bytes_link: float) -> dict:
    runs = [
        {
            "method": method,
            "config": method,
            "seed": s,
            "val_loss": v,
            "bits_per_byte": v / 0.693,
            "perplexity": 2.0,
            "curve": [[10, v]],
            "steps": 10,
            "seconds_per_step": 0.1,
            "ratio": 1000.0 / bytes_link,
            "ratio_handed": 1.0,
            "stats_ratio": 1.0,
            "bytes_link_per_step": bytes_link,
            "bytes_link_raw_per_step": 1000.0,
            "bytes_sent_per_step": bytes_link,
            "bytes_raw_per_step": 1000.0,
        }
        for s, v in losses.items()
    ]
    return {
        "command": f"gradzip bench --methods {method}",
        "config": {**asdict(cfg), "metric": "val_loss"},
        "rows": aggregate(runs, baseline="none", metric="val_loss"),
    }


def test_pooled_rows_equal_one_runs_and_the_gap_is_per_seed(tmp_path):
    cfg = BenchConfig(dataset="shakespeare", workers=2, steps=10, seeds=(0,))
    docs = [
        _doc("Identity", {0: 2.0}, cfg, 1000.0),
        _doc("Identity", {1: 4.0}, BenchConfig(dataset="shakespeare", workers=2, steps=10, seeds=(1,), seed=1), 1000.0),
        _doc("TopK(0.01)", {0: 2.2, 1: 4.0}, cfg, 10.0),
    ]
    paths = []
    for i, d in enumerate(docs):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(d))
    assert (
        merge_runs.main(
            [*map(str, paths), "--stem", "t", "--command", "gradzip bench --preset x", "--out", str(tmp_path)]
        )
        == 0
    )
    out = json.loads((tmp_path / "t.json").read_text())
    assert out["command"] == "gradzip bench --preset x" and len(out["merged_from"]) == 3
    assert out["config"]["seeds"] == [0, 1]
    topk = next(r for r in out["rows"] if r["method"] == "TopK(0.01)")
    assert topk["gap_pct"] == pytest.approx((10.0 + 0.0) / 2) and topk["gap_pct_max"] == pytest.approx(10.0)
    assert topk["ratio"] == pytest.approx(100.0) and (tmp_path / "t.png").exists()


def test_runs_of_other_options_are_refused(tmp_path):
    a = _doc("Identity", {0: 2.0}, BenchConfig(dataset="shakespeare", workers=2, steps=10), 1000.0)
    b = _doc("TopK(0.01)", {0: 2.0}, BenchConfig(dataset="shakespeare", workers=2, steps=10, lr=0.1), 10.0)
    with pytest.raises(ValueError, match="'lr'"):
        merge_runs.merge([a, b])
