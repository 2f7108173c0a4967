"""Packaging: the wheel installs gradzip.kernels and gradzip.hooks; import stays light."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_gradzip_does_not_import_triton_or_cupy():
    code = (
        "import sys, gradzip, gradzip.hooks, gradzip.kernels\n"
        "bad = [m for m in ('triton', 'cupy') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert gradzip.checkpoint.reshard is gradzip.reshard\n"  # issue 23: both reachable
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


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
