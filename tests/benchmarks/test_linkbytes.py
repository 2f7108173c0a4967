"""python -m benchmarks.linkbytes --quick: bytes on a namespace's lo against gradzip's own count.

Runs only as root where ``ip netns`` works (2 ranks, plain DDP and TwoPhase(TopK(0.01)),
one measured step).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
@pytest.mark.timeout(180)
def test_quick_measures_lo_beside_bytes_link(tmp_path):
    from benchmarks import linkbytes

    why = linkbytes.check()
    if why:
        pytest.skip(f"needs network namespaces: {why}")
    out = tmp_path / "quick.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.linkbytes", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["machine"]["torch"] and "--quick" in doc["command"]
    assert [run["empty_region_lo_bytes"] for run in doc["runs"]] == [0]  # the marks use no network
    rows = {row["method"]: row for row in doc["rows"]}
    assert set(rows) == {"DDP", "TwoPhase(TopK(0.01))"} and all(row["N"] == 2 for row in rows.values())

    ddp = rows["DDP"]
    # A 2-rank ring allreduce sends 4 B x params per rank; lo adds headers, ACKs and gloo's preambles.
    assert ddp["ring_formula"] == 4 * ddp["params"]
    assert 1.0 <= ddp["lo_over_gradzip"] < 1.06
    assert ddp["lo_fraction_of_ddp"] == 1.0

    tp = rows["TwoPhase(TopK(0.01))"]
    assert tp["protocol"] == "TwoPhase"
    # gradzip counts the bytes gloo puts on the link: lo sees them plus per-message/per-packet overhead
    assert tp["gradzip_bytes_link"] > 0
    assert 1.0 <= tp["lo_over_gradzip"] < 1.2, tp
    assert tp["lo_fraction_of_ddp"] < 0.05
    if tp["tcp_payload"] is not None:  # ss present: TCP payload = data + gloo's framing, below lo
        assert tp["gradzip_bytes_link"] <= tp["tcp_payload"] - tp["tcp_retrans"] <= tp["lo_bytes"]
