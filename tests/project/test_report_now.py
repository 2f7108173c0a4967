"""GRADZIP_REPORT_NOW=1 prints a failure's report when it happens (what a killed run keeps)."""

pytest_plugins = ["pytester"]

TESTS = """
import sys

def test_fails():
    print('captured words', file=sys.stderr)
    assert 1 == 2

def test_passes():
    pass
"""


def test_a_failure_is_reported_before_the_session_ends(pytester, monkeypatch):
    pytester.makepyfile(test_one=TESTS)
    argv = ["-q", "-p", "no:cacheprovider", "-p", "tests.support.report_now"]
    monkeypatch.setenv("GRADZIP_REPORT_NOW", "1")
    run = pytester.runpytest_inprocess(*argv)
    out = str(run.stdout)
    assert run.ret == 1, out
    now, summary = out.find("===== FAILED NOW: test_one.py::test_fails"), out.find("short test summary")
    assert 0 <= now < summary, out
    block = out[now : out.find("===== end of test_one.py::test_fails")]
    assert "assert 1 == 2" in block and "captured words" in block, block
    assert "FAILED NOW: test_one.py::test_passes" not in out
    monkeypatch.setenv("GRADZIP_REPORT_NOW", "0")
    run = pytester.runpytest_inprocess(*argv)
    run.assert_outcomes(failed=1, passed=1)
    assert "FAILED NOW" not in str(run.stdout)
