"""One table of public names (``gradzip/_names.py``): ``__all__``, ``gz.<name>``, the
type-checking imports, the registry's methods and the tests' codec list all agree with it,
and an exported in-tree codec is its own file plus one table entry: the toy codec that
docs/architecture.md shows ("Writing a codec"), which is this file's :data:`TOY`."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
import textwrap

import gradzip as gz
from gradzip import _names, registry
from tests.codecs.test_properties import SETTINGS, all_codecs
from tests.support import ROOT, fresh


def test_all_and_the_lazy_names_are_the_table():
    assert gz.__all__ == _names.public()
    assert len(set(gz.__all__)) == len(gz.__all__)
    for n in _names.PUBLIC:
        obj = getattr(gz, n.name)
        mod = importlib.import_module(f"gradzip.{n.module}")
        assert obj is (mod if n.kind == "module" else getattr(mod, n.name)), n
    assert set(gz.__all__) <= set(dir(gz))
    for name in _names.ON_FIRST_USE:
        assert name not in gz.__all__


def _type_checking_imports() -> set[tuple[str, str]]:
    """``(module, name)`` of every import under ``if TYPE_CHECKING:`` in gradzip/__init__.py."""
    tree = ast.parse((ROOT / "gradzip" / "__init__.py").read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.unparse(imp)
                for alias in imp.names:
                    assert alias.asname == alias.name, f"re-export it: {alias.name} as {alias.name}"
                    found.add((imp.module or alias.name, alias.name))
    return found


def test_the_type_checking_imports_are_the_table():
    """Static tools read ``gz.<name>`` from imports, not from the table: the same names, from
    the modules the table names (a missing line here is printed as it should read)."""
    want = {(n.module, n.name) for n in _names.PUBLIC}
    got = _type_checking_imports()
    missing = sorted(want - got)
    lines = [f"from .{m} import {n} as {n}" if m != n else f"from . import {n} as {n}" for m, n in missing]
    assert not missing, "add under TYPE_CHECKING in gradzip/__init__.py:\n" + "\n".join(lines)
    assert sorted(got - want) == [], "imports under TYPE_CHECKING that the table does not name"


def test_the_registry_knows_every_method_of_the_table_and_no_other_of_gradzips():
    """Every name of the method grammar that gradzip's own modules register has a table entry
    of its kind and module (methods that tests register from their own modules aside)."""
    table = {n.name: n for n in _names.PUBLIC + _names.UNEXPORTED_METHODS if n.kind in _names.METHOD_KINDS}
    for kind in ("codec", "protocol", "frontend", "schedule"):
        for name in registry.names(kind):
            cls = registry.lookup(name)
            if not cls.__module__.startswith("gradzip."):
                continue
            assert name in table, f"{name} ({cls.__module__}) is registered but not in gradzip/_names.py"
            assert (table[name].kind, f"gradzip.{table[name].module}") == (kind, cls.__module__), name
        assert set(_names.methods(kind)) <= set(registry.names(kind))
    for n in _names.PUBLIC + _names.UNEXPORTED_METHODS:
        if n.kind == "value":  # the grammar names the value itself (DDP: None)
            assert gz.parse(n.name) is getattr(importlib.import_module(f"gradzip.{n.module}"), n.name, None)


def test_the_tools_and_the_registry_load_the_tables_method_modules():
    assert set(_names.method_modules()) <= set(fresh.facts()["modules"])  # tests/support/fresh.py
    plan = (ROOT / "gradzip" / "plan.py").read_text()
    assert "load_methods()" in plan


def test_the_tests_codec_list_is_the_tables():
    tested = {type(c).__name__ for c in all_codecs()}
    assert tested == {n for n in _names.methods("codec") if SETTINGS.get(n, True)}
    assert tested >= {"Identity", "Threshold", "TopK", "RandomK"}


TOY = '''
"""Toy: the gradient as float32, a codec in a file of its own."""

from __future__ import annotations

import torch

from ..wire import Payload
from .base import Codec, TensorContext, check_input


class Toy(Codec):
    """Sends the gradient as float32 (exact, summable)."""

    summable = True
    biased = False

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        body = x.reshape(-1).to(torch.float32)
        return Payload(body=body, shape=x.shape, dtype=x.dtype, vdtype=torch.float32)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.body.to(payload.dtype).reshape(payload.shape)
'''

CHECK = """
import gradzip as gz
from gradzip import registry
assert "Toy" not in registry._CLASSES  # nothing imported it yet
assert "Toy" in gz.__all__ and "Toy" in dir(gz)
assert "Toy" in registry.names("codec")
m = gz.parse("Toy()")
assert type(m) is gz.Toy and type(m).__module__ == "gradzip.codecs.toy"
import torch
x = torch.randn(5, dtype=torch.float16)
assert torch.equal(m.decompress(m.compress(x)), x)
from tests.codecs.test_properties import all_codecs
assert any(type(c) is gz.Toy for c in all_codecs())
print("ok")
"""


def test_an_exported_codec_is_its_own_file_and_one_table_entry(tmp_path):
    """In a copy of the package: a new module ``gradzip/codecs/toy.py`` and one line in the
    table make ``gz.Toy``, put it in ``__all__``, the registry, ``gz.parse`` and the tests'
    codec list, in a fresh process that imports nothing by hand."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for folder in ("gradzip", "kernels", "hooks"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=ignore)
    (tmp_path / "tests" / "codecs").mkdir(parents=True)
    for f in ("tests/__init__.py", "tests/codecs/__init__.py", "tests/codecs/test_properties.py"):
        shutil.copy(ROOT / f, tmp_path / f)

    (tmp_path / "gradzip" / "codecs" / "toy.py").write_text(textwrap.dedent(TOY).lstrip())
    table = tmp_path / "gradzip" / "_names.py"
    anchor = '    Name("Int8", "codecs.quant", "codec"),\n'
    text = table.read_text()
    assert text.count(anchor) == 1
    table.write_text(text.replace(anchor, anchor + '    Name("Toy", "codecs.toy", "codec"),\n'))

    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=_env(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"]


def test_the_architecture_pages_toy_codec_is_the_one_tested_here():
    """docs/architecture.md's "Writing a codec" shows :data:`TOY` verbatim, so the page's
    example is the codec the test above builds and runs."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "## Writing a codec" in text
    section = text.split("## Writing a codec", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the section holds one python block: the toy codec"
    assert blocks[0].strip() == textwrap.dedent(TOY).strip(), "docs/architecture.md's toy codec is not TOY"


def _env(root) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root)
    return env
