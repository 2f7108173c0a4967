"""The shape of the package: layers import downwards only, and no module imports itself round about.

Every ``import`` statement of every module under gradzip/, kernels/ (gradzip.kernels) and
hooks/ (gradzip.hooks) is read with ``ast``, those inside functions included. An import
of a package is an edge to its ``__init__``; ``from pkg import sub`` of a submodule is an
edge to the submodule. The tools (cli, plan, bench) sit on top: nothing else imports them.

Modules loaded by name (``importlib.import_module``) are seen too: the package's lazy
``gz.<name>`` and the registry's load of gradzip's methods import the modules of the table
in ``gradzip/_names.py``, which this test reads; no other module of the library loads
modules by name, except the kernels, inside their own floor.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"gradzip": ROOT / "gradzip", "gradzip.kernels": ROOT / "kernels", "gradzip.hooks": ROOT / "hooks"}
TOOLS = {"gradzip.cli", "gradzip.plan", "gradzip.bench", "gradzip.__main__"}


def _is_tool(mod: str) -> bool:
    return any(mod == t or mod.startswith(t + ".") for t in TOOLS)


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

    bad = sorted((m, t) for m, ts in edges.items() for t in ts if _is_tool(t) and not _is_tool(m))
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


# -- loads by name --------------------------------------------------------------------------


def _loaders(mods: dict[str, Path]) -> set[str]:
    """The modules that call ``importlib.import_module`` (or ``__import__``)."""
    out = set()
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in ("import_module", "__import__"):
                    out.add(mod)
    return out


def _table_loads() -> dict[str, set[str]]:
    """What the package loads by name, from the table: every ``gz.<name>``'s module (and the
    modules of the methods, which the registry has it load), and ``gradzip.fsdp`` on first use."""
    from gradzip import _names

    mods = _names.modules() + _names.method_modules() + list(_names.ON_FIRST_USE)
    return {"gradzip": {f"gradzip.{m}" for m in mods}}


def test_only_the_package_the_tools_and_the_kernels_load_modules_by_name():
    mods = _modules()
    loaders = {m for m in _loaders(mods) if not _is_tool(m) and not m.startswith("gradzip.kernels")}
    assert loaders == set(_table_loads()), (
        f"modules that load others by name, out of the architecture test's sight: {sorted(loaders)}"
    )


def test_the_registry_loads_methods_through_the_table():
    """The registry sits on the ground floor and never imports the floors above it: it asks
    the table, whose loader the package installs, to import the methods' modules."""
    from gradzip import _names

    edges = _edges(_modules())
    assert "gradzip._names" in edges["gradzip.registry"]
    assert edges["gradzip._names"] == set()  # the table imports nothing of gradzip's
    registry = (ROOT / "gradzip" / "registry.py").read_text()
    assert "_names.load(_names.method_modules())" in registry
    assert set(_names.method_modules()) <= set(_names.modules())


def test_the_loads_by_name_land_on_floors_below_the_tools():
    floors, mods = _floors(), _modules()
    for loader, targets in _table_loads().items():
        missing = sorted(t for t in targets if t not in mods)
        assert missing == [], f"{loader} loads modules that do not exist: {missing}"
        tools = sorted(t for t in targets if _is_tool(t))
        assert tools == [], f"{loader} loads tools: {tools}"
        packages = {m for m, p in mods.items() if _is_package(p)}
        off = sorted(t for t in targets if t not in packages and floors.get(t) is None)
        assert off == [], f"{loader} loads modules on no floor of docs/architecture.md: {off}"


def test_the_table_loads_close_no_import_cycle():
    """With the package's loads by name as edges too, there is still no cycle: nothing below
    imports the package itself."""
    edges = _edges(_modules())
    for loader, targets in _table_loads().items():
        edges[loader] = edges[loader] | targets
    assert _cycles(edges) == []
