"""benchmarks/README.md indexes every script and every result file; benchmarks/results/ holds only
files that the results page, the README or a benchmark's documentation (a page of docs/) names,
and no superseded ``*_before`` run; the scripts import as modules of the ``benchmarks`` package
(no ``sys.path`` patches), and every ``python -m benchmarks.NAME`` command the docs show names a
script and flags it defines."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
INDEX = BENCH / "README.md"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.name != "__init__.py")
DOCS = [ROOT / "README.md", ROOT / "docs" / "results.md", INDEX]


def _expand(text: str) -> str:
    """``name.{json,csv,png}`` written out as ``name.json name.csv name.png``."""
    return re.sub(r"([\w./-]+)\.\{([\w,]+)\}", lambda m: " ".join(f"{m[1]}.{e}" for e in m[2].split(",")), text)


def _named(rel: str, text: str) -> bool:
    return re.search(rf"(?<![\w.-]){re.escape(rel)}(?![\w-])", text) is not None


def _result_files() -> list[str]:
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())


def test_every_script_is_indexed():
    index = INDEX.read_text()
    missing = [s for s in SCRIPTS if f"`{s}.py`" not in index]
    assert not missing, f"benchmarks/README.md does not index {missing}"


def test_benchmarks_readme_names_every_result_file():
    index = _expand(INDEX.read_text())
    missing = [rel for rel in _result_files() if not _named(rel, index)]
    assert not missing, f"benchmarks/README.md does not name {missing}"


def _citing_text() -> str:
    """What may keep a result file: the README and the pages of docs/ (the results page and the
    pages that document a benchmark). Not the index, benchmarks/README.md, nor a script's
    docstring (which names its default output whatever that holds): naming a file there alone
    does not keep it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(_expand(p.read_text()) for p in pages)


def test_no_result_file_is_unreferenced():
    text = _citing_text()
    missing = [rel for rel in _result_files() if not _named(rel, text)]
    assert not missing, (
        f"nothing names {missing}: cite each on the results page (benchmarks/report_page.md), in the README "
        "or in the page of docs/ that documents its benchmark, or `git rm` it"
    )


def test_the_index_alone_keeps_no_result_file():
    """The rule reads the README and docs/ only, not the index (whose "The results" section
    names every file by construction)."""
    assert "## The results" in INDEX.read_text() and "## The results" not in _citing_text()


def test_no_superseded_before_run_is_kept():
    kept = [rel for rel in _result_files() if Path(rel).stem.endswith("_before") or "_before_" in Path(rel).stem]
    assert not kept, f"superseded runs stay in git history, not in benchmarks/results/: {kept}"


def test_exploratory_runs_live_in_explore():
    assert not list(RESULTS.glob("explore_*")), "exploratory runs go under benchmarks/results/explore/"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_as_a_module_without_path_patches(name):
    source = (BENCH / f"{name}.py").read_text()
    assert "sys.path.insert" not in source and "sys.path.append" not in source, name
    importlib.import_module(f"benchmarks.{name}")


def _commands(text: str) -> list[tuple[str, str]]:
    """``(script, rest of the line)`` of every ``-m benchmarks.NAME ...`` in inline code or a code block."""
    spans = re.findall(r"```\w*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]*-m benchmarks\.[^`]*)`", text)
    return [(m[1], m[2]) for span in spans for m in re.finditer(r"-m benchmarks\.([a-z_0-9]+)\b([^\n`]*)", span)]


def test_documented_commands_name_scripts_and_flags_that_exist():
    # The flags a script defines: its own, the shared step_time run options, and gradzip bench's
    # (accuracy.py takes every option of `gradzip bench`).
    defined = set()
    for path in [*BENCH.glob("*.py"), *(ROOT / "gradzip").rglob("*.py")]:
        defined |= set(re.findall(r"[\"'](--[\w-]+)[\"']", path.read_text()))
    docs = [*DOCS, ROOT / "docs" / "results.md", *(ROOT / "docs").glob("*.md")]
    seen = 0
    for doc in dict.fromkeys(docs):
        for script, rest in _commands(doc.read_text()):
            seen += 1
            assert script in SCRIPTS, f"{doc.name}: no benchmarks/{script}.py"
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                assert flag in defined, f"{doc.name}: `-m benchmarks.{script}` has no {flag}"
    assert seen > 20
