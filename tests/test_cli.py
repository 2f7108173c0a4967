import csv
import json
import subprocess
import sys

import pytest

from gradzip import bench

pytestmark = pytest.mark.slow


def test_bench_quick_digits_writes_table_json_csv_and_plot(tmp_path):
    cmd = [sys.executable, "-m", "gradzip.cli", "bench", "--quick", "--dataset", "digits", "--workers", "2"]
    cmd += ["--methods", "TopK,Threshold", "--out", str(tmp_path), "--no-progress"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("method") and "ratio" in line and "Δ acc" in line and "ms/step" in line for line in lines)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert {"machine", "config", "rows"} <= set(doc)
    assert doc["config"]["dataset"] == "digits" and doc["config"]["workers"] == 2
    rows = doc["rows"]
    assert [r["method"] for r in rows] == ["Identity", "TopK", "Threshold"]
    for r in rows:
        assert set(bench.CSV_FIELDS) <= set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["steps"] > 0 and r["bytes_sent_per_step"] > 0
        assert f"{r['method']:<12}" in out.stdout
    assert rows[0]["ratio"] == pytest.approx(1.0, rel=1e-3)  # control bytes (config check, flags) only
    assert rows[0]["delta_accuracy"] == 0.0 and rows[1]["ratio"] > 20
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["method"] for t in table] == ["Identity", "TopK", "Threshold"] and list(table[0]) == bench.CSV_FIELDS
    png = (tmp_path / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_cli_rejects_unknown_methods():
    out = subprocess.run(
        [sys.executable, "-m", "gradzip.cli", "bench", "--methods", "Nope"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "unknown method 'Nope'" in out.stderr


def test_mnist_loader_reads_the_bundled_digits():
    xtr, ytr, xte, yte = bench.load_dataset("mnist", seed=0)
    assert xtr.shape == (4000, 1, 28, 28) and xte.shape == (1000, 1, 28, 28)
    assert sorted(ytr.unique().tolist()) == list(range(10)) and sorted(yte.unique().tolist()) == list(range(10))
    # Shuffled (the file is sorted by label) and standardised on the training set.
    assert len(set(ytr[:50].tolist())) > 5
    assert abs(float(xtr.mean())) < 1e-3 and abs(float(xtr.std()) - 1) < 1e-3
