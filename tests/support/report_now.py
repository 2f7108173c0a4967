"""A pytest plugin: ``GRADZIP_REPORT_NOW=1`` prints a failed test's report (traceback and
captured output, a multi-rank test's stack dumps among them) as soon as it fails, not only in
the session's summary, so a run killed at its time limit (``benchmarks/gpu_suite.py``'s tests
part on a lent device) keeps it. ``tests/conftest.py`` loads it; ``-p tests.support.report_now``
loads it elsewhere."""

from __future__ import annotations

import os

#: Characters of each captured section printed (the end of it: stack dumps come last).
SECTION_CHARS = 20000


def pytest_runtest_logreport(report) -> None:
    if os.environ.get("GRADZIP_REPORT_NOW", "") in ("", "0") or not report.failed:
        return
    lines = [f"\n===== FAILED NOW: {report.nodeid} ({report.when}, {report.duration:.1f} s)", str(report.longrepr)]
    for name, text in report.sections:
        lines += [f"----- {name}", text[-SECTION_CHARS:]]
    print("\n".join(lines) + f"\n===== end of {report.nodeid}", flush=True)
