"""docs/results.md and the README's headline are printed from benchmarks/results/, so neither
can go stale: the committed page equals what ``python -m benchmarks.report --page`` writes now,
the README holds ``report.headline()`` verbatim, and no heading names an issue."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
REGENERATE = "python -m benchmarks.report --page docs/results.md"


def test_the_committed_results_page_is_what_the_report_writes(tmp_path):
    out = tmp_path / "results.md"
    assert report.main(["--page", str(out)]) == 0
    want, got = out.read_text(), PAGE.read_text()
    if got != want:
        diff = "".join(
            list(difflib.unified_diff(got.splitlines(True), want.splitlines(True), "docs/results.md", "regenerated"))[
                :60
            ]
        )
        pytest.fail(f"docs/results.md is stale: edit benchmarks/report_page.md, then run `{REGENERATE}`\n{diff}")


def test_the_page_holds_every_top_level_accuracy_run_and_no_template_line():
    text = PAGE.read_text()
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        if path.name.startswith(("accuracy_", "diloco_")):
            assert f"[`{path.name}`]" in text, path.name
    assert "{{" not in text and "}}" not in text


def test_the_readme_shows_the_headline_read_from_the_results():
    """Every number of the README's results section is :func:`report.headline`'s."""
    head = report.headline()
    assert head in README.read_text(), "the README's headline differs from `python -m benchmarks.report --headline`"
    for name in report.HEADLINE_RUNS:
        assert f"`{name}`" in head


def test_an_unknown_table_kind_is_refused():
    with pytest.raises(ValueError, match="unknown table kind 'nope'"):
        report.page("{{ nope results.json }}\n")


def _headings(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.append(line)
    return out


@pytest.mark.parametrize(
    "path", ["README.md", "docs/results.md", "benchmarks/README.md", "benchmarks/report_page.md"], ids=str
)
def test_no_heading_names_an_issue_or_a_wave(path):
    for heading in _headings((ROOT / path).read_text()):
        assert not re.search(r"\bissues?\b|#\d|first[- ]wave", heading, re.I), f"{path}: {heading!r}"
