import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_cli_prints_table_and_writes_results(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "gradzip.cli", "bench", "--epochs", "2", "--methods", "TopK,Threshold", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("method") and "ratio" in line and "Δ acc" in line for line in lines)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["Identity", "TopK", "Threshold"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 20
    for r in rows:
        assert f"{r['method']:<12}" in out.stdout


def test_bench_cli_rejects_unknown_methods():
    out = subprocess.run(
        [sys.executable, "-m", "gradzip.cli", "bench", "--methods", "Nope"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "unknown methods" in out.stderr
