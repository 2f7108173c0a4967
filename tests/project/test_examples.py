"""Every torchrun example under examples/ runs: each script's ``main``
is called on 2 gloo ranks (the process group already up, as torchrun's environment would
have it) for a few steps, and what it returns is checked."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.support import run_ranks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
    out["resume"] = run(
        "resume_torchrun", ["--checkpoint", str(Path(workdir) / "ckpt"), "--steps", "6", "--save-at", "3"]
    )
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
        res = out["resume"]
        assert res["diff"] == 0.0 and res["step"] == 6  # resumed exactly where the unbroken run went
        assert res["files"] == ["gradzip_rank0_of_2.pt", "gradzip_rank1_of_2.pt", "model.pt"]
