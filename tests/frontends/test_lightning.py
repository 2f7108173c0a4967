"""PyTorch Lightning: a LightningModule trains with TopK(0.01) and with PowerSGD(rank=2) under
``Trainer(strategy="ddp")`` on 2 CPU ranks, resumes from its own checkpoint bit for bit, and logs
gradzip's scalars to Lightning's CSV logger.

The ranks are started as torchrun starts them (its environment, the process group already up), and
each runs ``examples/lightning_ddp.py``'s ``main``: the example is what is tested."""

from __future__ import annotations

import csv
import importlib.util
import os
import sys

import pytest
import torch

from tests.support import ROOT, run_ranks

# find_spec, not importorskip: importing lightning takes 2.5 s, paid by every test worker's collection.
if importlib.util.find_spec("lightning") is None:
    pytest.skip("the [lightning] extra is not installed (pip install 'gradzip[lightning]')", allow_module_level=True)

pytestmark = pytest.mark.slow

METHODS = ["TopK(0.01)", "PowerSGD(rank=2)"]
#: TopK as DGC runs it: gradzip takes the optimizer's momentum over (momentum correction).
EXTRA = {"TopK(0.01)": ["--momentum-correction"], "PowerSGD(rank=2)": []}


def torchrun_env(rank: int, world: int) -> None:
    """The environment torchrun gives a rank (the process group is already up: frameworks use it)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )


def _fit(rank, world, root):
    sys.path.insert(0, str(ROOT / "examples"))
    torchrun_env(rank, world)
    import lightning_ddp

    out = {}
    for i, method in enumerate(METHODS):
        # 256 samples, 32 a batch on each of 2 ranks: 4 steps an epoch; a checkpoint each epoch
        common = ["--method", method, "--samples", "256", "--batch", "32", "--log-every", "1", *EXTRA[method]]
        unbroken = lightning_ddp.main([*common, "--epochs", "2", "--out", os.path.join(root, f"{i}a")])
        ckpt = os.path.join(unbroken["dir"], "checkpoints", "epoch=0-step=4.ckpt")
        resumed = lightning_ddp.main([*common, "--epochs", "2", "--resume", ckpt, "--out", os.path.join(root, f"{i}b")])
        out[method] = {"unbroken": unbroken, "resumed": resumed}
    return out


def test_a_lightning_trainer_trains_resumes_and_logs_with_gradzip(tmp_path):
    res = run_ranks(_fit, 2, str(tmp_path), fresh=True)
    for method in METHODS:
        runs = [r[method] for r in res]
        for r in runs:
            a, b = r["unbroken"], r["resumed"]
            assert a["checkpoints"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
            assert a["stats"]["steps"] == 8 and b["stats"]["steps"] == 8  # the resumed hook carries on at 4
            assert a["stats"]["ratio"] > 2, a["stats"]
            assert (
                a["momentum_buffers"] == b["momentum_buffers"] == (4 if EXTRA[method] else 0)
            )  # 2 layers x (weight, bias)
            assert {row["method"] for row in a["routes"]} == {method.replace("TopK(0.01)", "TopK(ratio=0.01)")}
            assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), method  # bit for bit
        # the ranks hold one model
        assert all(torch.equal(p, q) for p, q in zip(runs[0]["unbroken"]["params"], runs[1]["unbroken"]["params"]))
        with open(runs[0]["unbroken"]["metrics"]) as f:
            rows = [row for row in csv.DictReader(f) if row.get("gradzip/link_ratio")]
        assert [int(row["step"]) for row in rows] == list(range(8))  # every step, log_every_n_steps=1
        assert all(float(row["gradzip/link_ratio"]) > 2 for row in rows)
        assert all(float(row["gradzip/link_bytes_per_step"]) > 0 for row in rows)
        assert {"gradzip/codec_ms_per_step", "gradzip/comm_ms_per_step", "train_loss"} <= set(rows[0])
