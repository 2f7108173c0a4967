"""The shape of the package: layers import downwards only, and no module imports itself round about.

Every ``import`` statement of every module under gradzip/, kernels/ (gradzip.kernels) and
hooks/ (gradzip.hooks) is read with ``ast``, those inside functions included. An import
of a package is an edge to its ``__init__``; ``from pkg import sub`` of a submodule is an
edge to the submodule. The tools (cli, plan, bench) sit on top: nothing else imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"gradzip": ROOT / "gradzip", "gradzip.kernels": ROOT / "kernels", "gradzip.hooks": ROOT / "hooks"}
TOOLS = {"gradzip.cli", "gradzip.plan", "gradzip.bench", "gradzip.__main__"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts]) if parts else pkg
            mods[name] = path
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        pkg = mod if _is_package(path) else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                subs = [f"{origin}.{a.name}" for a in node.names if f"{origin}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else subs + [origin]
            for t in targets:
                while t and t not in mods:  # "import gradzip.kernels.bitpack as x" -> that module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges[mod].add(t)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    edges = _edges(_modules())
    assert _cycles(edges) == []


def test_the_library_never_imports_the_tools():
    edges = _edges(_modules())
    bad = sorted((m, t) for m, ts in edges.items() for t in ts if t in TOOLS and m not in TOOLS)
    assert bad == []


def test_the_walker_sees_function_level_imports_and_cycles(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from . import b\n")
    (tmp_path / "b.py").write_text("from .a import f\n")
    (tmp_path / "__init__.py").write_text("")
    mods = {"p": tmp_path / "__init__.py", "p.a": a, "p.b": tmp_path / "b.py"}
    assert _cycles(_edges(mods)) == [["p.a", "p.b"]]


def test_every_module_is_seen():
    mods = _modules()
    for name in (
        "gradzip.engine",
        "gradzip.codecs.threshold",
        "gradzip.protocols.powersgd",
        "gradzip.kernels",
        "gradzip.hooks.ddp",
    ):
        assert name in mods


def _floors() -> dict[str, int]:
    """Module -> floor (0 = ground) from the diagram in docs/architecture.md."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```", 2)[1]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    rows: list[str] = []
    for ln in lines:  # continuation lines (no "floor") belong to the row above
        if ln.startswith("floor"):
            rows.append(ln)
        else:
            rows[-1] += " " + ln.strip()
    floors: dict[str, int] = {}
    for level, row in enumerate(reversed(rows)):
        paths = re.sub(r"\(.*?\)", "", row.split(None, 2)[2])  # drop the remarks in parentheses
        paths = re.sub(r"\{([^}]*)\}", lambda m: "{" + m[1].replace(" ", "") + "}", paths)
        folder = ""
        for item in re.split(r"[,\s]+(?![^{]*\})", paths):
            if not item.endswith((".py", "/", "}.py")):
                continue
            if "/" in item:
                folder, _, item = item.rpartition("/")
            names = re.match(r"\{(.*)\}\.py$", item)
            for stem in names[1].split(",") if names else [item[:-3]] if item else [""]:
                rel = f"{folder}/{stem}" if stem else folder
                mod = {"gradzip": "gradzip", "hooks": "gradzip.hooks", "kernels": "gradzip.kernels"}[rel.split("/")[0]]
                mod = ".".join([mod, *rel.split("/")[1:]])
                floors[mod] = level
    return floors


def test_the_floors_diagram_matches_the_imports():
    floors = _floors()
    mods = _modules()
    edges = _edges(mods)

    def floor(m):
        if m.startswith("gradzip.kernels"):
            return floors["gradzip.kernels"]
        return floors.get(m)

    packages = {m for m, p in mods.items() if _is_package(p)}
    missing = sorted(m for m in mods if floor(m) is None and m not in packages)
    assert missing == [], f"modules on no floor of docs/architecture.md: {missing}"
    up = sorted(
        (m, t) for m, ts in edges.items() for t in ts if m not in packages and t not in packages and floor(t) > floor(m)
    )
    assert up == [], f"imports of a higher floor: {up}"
