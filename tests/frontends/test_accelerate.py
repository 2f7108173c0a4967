"""Hugging Face Accelerate: an Accelerator-prepared model trains with TopK(0.01) and with
PowerSGD(rank=2) on 2 CPU ranks with gradient accumulation (``accelerator.accumulate``: no_sync
steps), resumes from its own ``save_state`` bit for bit (gradzip's per-rank files beside
Accelerate's), and logs gradzip's scalars to the Accelerator's tracker.

The ranks are started as torchrun starts them (its environment, the process group already up), and
each runs ``examples/accelerate_ddp.py``'s ``main``: the example is what is tested."""

from __future__ import annotations

import csv
import os
import sys

import pytest
import torch

from tests.support import ROOT, run_ranks

pytest.importorskip("accelerate", reason="the [accelerate] extra is not installed (pip install 'gradzip[accelerate]')")

pytestmark = pytest.mark.slow

METHODS = ["TopK(0.01)", "PowerSGD(rank=2)"]
#: TopK as DGC runs it: gradzip takes the optimizer's momentum over (momentum correction).
EXTRA = {"TopK(0.01)": ["--momentum-correction"], "PowerSGD(rank=2)": []}


def torchrun_env(rank: int, world: int) -> None:
    """The environment torchrun gives a rank (the process group is already up: Accelerate uses it)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )


def _train(rank, world, root):
    sys.path.insert(0, str(ROOT / "examples"))
    torchrun_env(rank, world)
    import accelerate_ddp

    out = {}
    for i, method in enumerate(METHODS):
        common = [
            "--method",
            method,
            "--steps",
            "6",
            "--accum",
            "2",
            "--batch",
            "16",
            "--log-every",
            "1",
            *EXTRA[method],
        ]
        unbroken = accelerate_ddp.main([*common, "--save-at", "3", "--out", os.path.join(root, f"{i}a")])
        saved = os.path.join(unbroken["dir"], "step3")
        resumed = accelerate_ddp.main([*common, "--resume", saved, "--out", os.path.join(root, f"{i}b")])
        out[method] = {"unbroken": unbroken, "resumed": resumed}
    return out


def test_an_accelerator_trains_accumulates_resumes_and_logs_with_gradzip(tmp_path):
    res = run_ranks(_train, 2, str(tmp_path), fresh=True)
    for method in METHODS:
        runs = [r[method] for r in res]
        for r in runs:
            a, b = r["unbroken"], r["resumed"]
            assert {"gradzip_rank0_of_2.pt", "gradzip_rank1_of_2.pt", "random_states_0.pkl"} <= set(a["saved"])
            # 12 backward passes, 6 through the hook: accumulate's no_sync passes never reach it
            assert a["stats"]["steps"] == 6 and b["stats"]["steps"] == 6, (a["stats"], b["stats"])
            assert a["stats"]["ratio"] > 2, a["stats"]
            assert (
                a["momentum_buffers"] == b["momentum_buffers"] == (4 if EXTRA[method] else 0)
            )  # 2 layers x (weight, bias)
            assert {row["method"] for row in a["routes"]} == {method.replace("TopK(0.01)", "TopK(ratio=0.01)")}
            assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), method  # bit for bit
        assert all(torch.equal(p, q) for p, q in zip(runs[0]["unbroken"]["params"], runs[1]["unbroken"]["params"]))
        for run, steps in (("unbroken", range(1, 7)), ("resumed", range(4, 7))):
            with open(runs[0][run]["metrics"]) as f:
                rows = list(csv.DictReader(f))
            assert [int(row["step"]) for row in rows] == list(steps)  # gradzip's step, every step
            assert all(float(row["gradzip/link_ratio"]) > 2 for row in rows)
            assert all(float(row["gradzip/link_bytes_per_step"]) > 0 for row in rows)
            assert "gradzip/codec_ms_per_step" in rows[0]
