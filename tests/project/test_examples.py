"""Every torchrun example under examples/ runs: each script's ``main`` is called on 2 gloo ranks
(the process group already up, as torchrun's environment would have it) for a few steps, and
what it returns is checked (``lightning_ddp.py`` and ``accelerate_ddp.py``: tests/frontends).
Every example answers ``--help`` before torch loads and names its method ``--method``."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from tests.support import run_ranks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: Horovod's own MNIST example keeps Horovod's flags (``--compression``): it is a drop-in port.
OURS = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("horovod"))


def _run_all(rank, world, workdir):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    out = {}
    run = lambda name, argv: importlib.import_module(name).main(argv)  # noqa: E731
    out["ddp"] = run(
        "ddp_torchrun", ["--method", "Policy(TopK(0.05), min_numel=1000)", "--steps", "6", "--log-every", "3"]
    )
    out["optimizer"] = run("optimizer_torchrun", ["--method", "PowerSGD(rank=2)", "--steps", "4"])
    out["local_sgd"] = run("local_sgd_torchrun", ["--period", "2", "--steps", "6"])
    out["diloco"] = run("diloco_torchrun", ["--method", "TopK(0.1)", "--period", "2", "--steps", "4"])
    out["resume"] = run(
        "resume_torchrun", ["--checkpoint", str(Path(workdir) / "ckpt"), "--steps", "6", "--save-at", "3"]
    )
    cwd = sorted(os.listdir("."))
    out["resume_default"] = run("resume_torchrun", ["--steps", "2", "--save-at", "1"])
    out["cwd_untouched"] = sorted(os.listdir(".")) == cwd
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["fsdp"] = run("fsdp_torchrun", ["--steps", "2"])
    out["fsdp_warnings"] = [str(w.message) for w in caught]
    return out


@pytest.mark.slow
def test_the_torchrun_examples_run_on_two_ranks(tmp_path):
    scripts = sorted(p.name for p in EXAMPLES.glob("*_torchrun.py"))
    assert {"ddp_torchrun.py", "optimizer_torchrun.py", "local_sgd_torchrun.py", "resume_torchrun.py"} <= set(scripts)
    for out in run_ranks(_run_all, 2, str(tmp_path)):
        ddp = out["ddp"]
        assert ddp["stats"]["steps"] == 6 and ddp["stats"]["ratio"] > 1
        assert {r["method"] for r in ddp["routes"]} == {"TopK(ratio=0.05)", "Identity()"}
        assert out["optimizer"]["identical"] and out["optimizer"]["stats"]["steps"] == 4
        assert out["local_sgd"]["stats"]["syncs"] >= 2
        assert out["diloco"]["identical"] and out["diloco"]["stats"]["syncs"] == 2
        res = out["resume"]
        assert res["diff"] == 0.0 and res["step"] == 6  # resumed exactly where the unbroken run went
        assert res["files"] == ["gradzip_rank0_of_2.pt", "gradzip_rank1_of_2.pt", "model.pt"]
        # was: ckpt/ in the working directory (the repository root, run from there)
        default = out["resume_default"]
        assert default["diff"] == 0.0 and Path(default["dir"]).parent == Path(tempfile.gettempdir())
        assert out["cwd_untouched"]
        # was: "FSDP2-wrapped module (Net) returned a view tensor" on every rank
        assert out["fsdp"]["step"] == 2 and out["fsdp"]["stats"]["ratio"] > 1
        assert not [w for w in out["fsdp_warnings"] if "view tensor" in w], out["fsdp_warnings"]
        shutil.rmtree(default["dir"], ignore_errors=True)


def test_every_example_answers_help_before_torch_loads_and_names_its_method_flag():
    """``--help`` took 10-24 s (torch imported first); now it parses first. One flag name."""
    code = (
        "import sys, contextlib, io\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        f"for name in {OURS!r}:\n"
        "    m = __import__(name)\n"
        "    out = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            m.main(['--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (name, e.code)\n"
        "    text = out.getvalue()\n"
        "    assert '--method' in text and '--compression' not in text, (name, text)\n"
        "    bad = [k for k in ('torch', 'lightning', 'accelerate', 'gradzip') if k in sys.modules]\n"
        "    assert not bad, (name, bad)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert {"ddp_torchrun", "fsdp_torchrun", "diloco_torchrun", "lightning_ddp", "accelerate_ddp"} <= set(OURS)
