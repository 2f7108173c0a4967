"""GRADZIP_REPORT_NOW=1 prints a failure's report when it happens (what a killed run keeps)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_failure_is_reported_before_the_session_ends(tmp_path):
    (tmp_path / "test_one.py").write_text(
        "import sys\n\ndef test_fails():\n    print('captured words', file=sys.stderr)\n    assert 1 == 2\n\n"
        "def test_passes():\n    pass\n"
    )
    env = {**os.environ, "GRADZIP_REPORT_NOW": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.support.report_now"]
    run = subprocess.run([*argv, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout
    now, summary = out.find("===== FAILED NOW: test_one.py::test_fails"), out.find("short test summary")
    assert run.returncode == 1 and 0 <= now < summary, out
    block = out[now : out.find("===== end of test_one.py::test_fails")]
    assert "assert 1 == 2" in block and "captured words" in block, block
    assert "FAILED NOW: test_one.py::test_passes" not in out
    env["GRADZIP_REPORT_NOW"] = "0"
    run = subprocess.run([*argv, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "FAILED NOW" not in run.stdout
