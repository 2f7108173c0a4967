"""Hugging Face Accelerate: an Accelerator-prepared model trains with TopK(0.01) and with
PowerSGD(rank=2) on 2 CPU ranks with gradient accumulation (``accelerator.accumulate``: no_sync
steps), resumes from its own ``save_state`` bit for bit (gradzip's per-rank files beside
Accelerate's), and logs gradzip's scalars to the Accelerator's tracker.

The ranks are started as torchrun starts them (its environment, the process group already up), and
each runs ``examples/accelerate_ddp.py``'s ``main``: the example is what is tested. Both tests read
one run in fresh processes (Accelerate's state and torchrun's environment stay in a process)."""

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


def _both(rank, world, root):
    return {"train": _train(rank, world, root), "two_models": _two_models(rank, world, root)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_both, 2, str(tmp_path_factory.mktemp("accelerate")), fresh=True)


def test_an_accelerator_trains_accumulates_resumes_and_logs_with_gradzip(results):
    res = [r["train"] for r in results]
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


def _two_models(rank, world, root):
    """Two compressed models of one Accelerator, saved and loaded; then a load_state before compress."""
    import torch.nn.functional as F
    from accelerate import Accelerator

    from gradzip.hooks.accelerate import compress

    torchrun_env(rank, world)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    m1, m2 = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    m1, o1, m2, o2 = acc.prepare(m1, o1, m2, o2)
    s1 = compress(acc, m1, "TopK(0.1)", optimizer=o1)
    s2 = compress(acc, m2, "Int8()")
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        for m, o in ((m1, o1), (m2, o2)):
            acc.backward(F.cross_entropy(m(x), y))
            o.step()
            o.zero_grad()
    saved = [s.state_dict() for s in (s1, s2)]
    folder = os.path.join(root, "two")
    acc.save_state(folder)
    acc.wait_for_everyone()  # rank 0 writes the model file; no rank loads before it is there
    for s in (s1, s2):  # train on: the states move away from the saved ones
        for r in s.engine.memory.residuals.values():
            r.add_(1.0)
    acc.load_state(folder)
    out = {
        "files": sorted(os.listdir(folder)),
        "second": sorted(os.listdir(os.path.join(folder, "gradzip_model_1"))),
        "same": [
            all(torch.equal(a, b) for a, b in zip(s.state_dict()["residuals"].values(), sd["residuals"].values()))
            and s.state_dict()["residuals"].keys() == sd["residuals"].keys()
            for s, sd in zip((s1, s2), saved)
        ],
    }
    # A fresh run that loads the checkpoint before compress: gradzip's files are not read then, and
    # the optimizer comes back with the momentum gradzip held (0): refused, not run on without it.
    torch.manual_seed(0)
    m3 = torch.nn.Linear(16, 4)
    o3 = torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9)
    m3, o3 = acc.prepare(m3, o3)
    o3.load_state_dict(o1.state_dict())  # what load_state hands the optimizer of that run
    try:
        compress(acc, m3, "TopK(0.1)", optimizer=o3)
    except RuntimeError as err:
        out["refused"] = str(err)
    return out


def test_two_models_keep_their_own_state_and_a_load_before_compress_is_refused(results):
    """A GAN's two models on one Accelerator: save_state writes each model's gradzip files (the
    first model's beside Accelerate's, the second's in gradzip_model_1/) and load_state gives each
    its own back; an optimizer loaded before compress, whose momentum gradzip held, is refused."""
    for r in (r["two_models"] for r in results):
        assert {"gradzip_rank0_of_2.pt", "gradzip_rank1_of_2.pt", "gradzip_model_1"} <= set(r["files"])
        assert r["second"] == ["gradzip_rank0_of_2.pt", "gradzip_rank1_of_2.pt"]
        assert r["same"] == [True, True]
        assert "call compress(...) first, then accelerator.load_state(dir)" in r["refused"]
