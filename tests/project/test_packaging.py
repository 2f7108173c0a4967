"""Packaging: the wheel installs gradzip.kernels and gradzip.hooks; import stays light."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import fresh

ROOT = Path(__file__).resolve().parents[2]


def test_import_gradzip_does_not_import_triton_or_cupy():
    got = fresh.facts()  # a fresh interpreter's imports (tests/support/fresh.py)
    assert got["heavy_after_methods"] == [] and got["heavy_after_import"] == []
    assert got["reshard_reachable"]


@pytest.mark.slow
def test_wheel_contains_and_imports_kernels_and_hooks(tmp_path):
    wheels = tmp_path / "wheels"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    (whl,) = wheels.glob("gradzip-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "gradzip/kernels/__init__.py" in names and "gradzip/hooks/__init__.py" in names
    assert "gradzip/py.typed" in names and "gradzip/__main__.py" in names
    # the data the library reads at run time: the LM text, the plan's profiles, the CuPy kernels' source
    data = {"gradzip/bench/data/tinyshakespeare.txt.gz", "gradzip/costmodel/profiles/h200.json"}
    data |= {f"gradzip/kernels/cuda/{p.name}" for p in (ROOT / "kernels" / "cuda").glob("*.cu")}
    assert data <= set(names), sorted(data - set(names))
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    assert not any(n.startswith(("kernels/", "hooks/")) for n in names), "must not claim top-level names"
    target = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(whl)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    code = (
        "import gradzip, gradzip.kernels, gradzip.hooks\n"
        f"assert gradzip.__file__.startswith({str(target)!r}), gradzip.__file__\n"
        f"assert gradzip.kernels.__file__.startswith({str(target)!r}), gradzip.kernels.__file__\n"
        f"assert gradzip.hooks.__file__.startswith({str(target)!r}), gradzip.hooks.__file__\n"
        "from gradzip.hooks import register_hook\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_checkout_imports_without_the_editable_install_and_runs_as_a_module():
    """In the repository root ``./gradzip`` shadows an installed wheel, and
    gradzip.kernels and gradzip.hooks (``kernels/``, ``hooks/`` there) must still import.
    ``-S`` leaves out site's .pth files, so the editable install's finder is not there;
    the same process runs ``python -m gradzip --version``."""
    import sysconfig

    code = (
        "import runpy, sys, gradzip, gradzip.kernels, gradzip.hooks\n"
        "from gradzip.hooks import register_hook\n"
        f"assert gradzip.hooks.__file__.startswith({str(ROOT)!r}), gradzip.hooks.__file__\n"
        "assert not any('Editable' in repr(f) for f in sys.meta_path), sys.meta_path\n"
        "sys.argv = ['gradzip', '--version']\n"
        "try:\n"
        "    runpy.run_module('gradzip', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
    )
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"])
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=str(ROOT), env=env)
    assert out.returncode == 0, out.stderr
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert out.stdout.strip() == f"gradzip {version}"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_every_exported_class_documents_its_arguments():
    """Every public class says what its arguments are; Threshold says how to tune tau."""
    import inspect

    import gradzip

    classes = [n for n in gradzip.__all__ if inspect.isclass(getattr(gradzip, n))]
    assert len(classes) >= 25
    missing = [n for n in classes if "Args" not in (inspect.getdoc(getattr(gradzip, n)) or "")]
    assert missing == []
    doc = inspect.getdoc(gradzip.Threshold)
    assert "Args:" in doc and "Tuning." in doc and 'policy="target"' in doc
