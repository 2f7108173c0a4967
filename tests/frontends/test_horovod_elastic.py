"""``hvd.elastic`` on torchrun's elastic agent, with one worker killed mid-run.

tests/frontends/horovod_elastic_train.py (Horovod's elastic example, gradzip's import; the
method comes from ``GRADZIP_COMPRESSION``) runs under ``torchrun --nnodes=1:2
--nproc-per-node=2 --max-restarts=1``; rank 1 SIGKILLs itself one batch after a commit. The
agent restarts both workers; they resume from the commit on disk. The same script run on 2
ranks without a kill is the reference: the final parameters must be equal bit for bit, which
they are only if the restart brought back every rank's error-feedback residuals (TopK keeps
95% of each gradient in them) along with the model, the momentum and the sampler.

One torchrun launch with a restart is three rounds of interpreters importing torch one after
the other (the agent, the workers, the restarted workers): 12-20 s on a loaded 2-core machine,
so it is marked ``long``. The default run has its in-process stand-in: the same script on the
ranks of tests/support, every rank stopped at the same batch (``GRADZIP_TEST_STOP``), then its
``main`` run again as a restarted worker's (``TORCHELASTIC_RESTART_COUNT=1``): the commit on disk,
the reset callbacks and the residuals give the uninterrupted run's parameters bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.support import run_ranks
from tests.support.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "frontends" / "horovod_elastic_train.py"
METHOD = "TopK(0.05)"


def _script():
    """The script, imported with a clean environment and METHOD from GRADZIP_COMPRESSION."""
    sys.path.insert(0, str(SCRIPT.parent))
    for k in (
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "GRADZIP_ELASTIC_DIR",
        "GRADZIP_TEST_KILL",
        "GRADZIP_TEST_STOP",
    ):
        os.environ.pop(k, None)
    os.environ["GRADZIP_COMPRESSION"] = METHOD
    import horovod_elastic_train

    return horovod_elastic_train


def _reference(rank, world, out_dir):
    """The script's main() on the ranks of tests/support, no kill, no torchrun: commits in memory."""
    return _script().main(out_dir)


def _check_resumed(got: list, ref: list) -> None:
    """The resumed ranks' results against the uninterrupted run's, rank by rank."""
    for r in range(2):
        assert got[r]["restart_count"] == 1 and got[r]["resets"] == [2], got[r]  # the reset callback ran once
        assert got[r]["method"] == ref[r]["method"] == "TopK(ratio=0.05)"
        assert all(torch.equal(a, b) for a, b in zip(got[r]["params"], ref[r]["params"])), f"rank {r}: parameters"
        assert got[r]["residuals"].keys() == ref[r]["residuals"].keys()
        assert all(torch.equal(got[r]["residuals"][k], ref[r]["residuals"][k]) for k in ref[r]["residuals"])
        assert any(float(v.abs().sum()) > 0 for v in got[r]["residuals"].values())
    assert ref[0]["resets"] == []


def _stopped_and_restarted(rank, world, root):
    """The uninterrupted run; then a run every rank leaves after batch 3 of epoch 1 (the last
    commit on disk: batch 2), and main() again as the restarted workers run it. The codecs run
    their torch reference path (what is tested is the restart; a fresh process need not import
    numba for the CPU kernels first)."""
    import gradzip.kernels as K

    os.environ[K.ENV_VAR] = "reference"
    script = _script()
    ref = script.main(os.path.join(root, "reference"))
    commits = os.path.join(root, "commits")
    os.environ["GRADZIP_ELASTIC_DIR"] = commits
    os.environ["GRADZIP_TEST_STOP"] = "1:3"
    try:
        script.main(os.path.join(root, "stopped"))
    except script.Stopped:
        stopped = True
    else:
        stopped = False
    left = sorted(os.listdir(commits))
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # what the agent gives the restarted workers
    got = script.main(os.path.join(root, "restarted"))
    return {"reference": ref, "got": got, "stopped": stopped, "left": left, "after": sorted(os.listdir(commits))}


def test_a_job_stopped_mid_run_resumes_from_its_commit_with_its_codec_state(tmp_path):
    """The default run's stand-in for the torchrun test below (the module docstring): fresh
    processes, as the script leaves its environment and gradzip.horovod's reports behind."""
    outs = run_ranks(_stopped_and_restarted, 2, str(tmp_path), fresh=True)
    for rank, o in enumerate(outs):
        assert o["stopped"], "GRADZIP_TEST_STOP did not stop the run"
        assert any(f.endswith(f"rank{rank}of2.pt") for f in o["left"]), o["left"]  # the commit the restart loads
        assert o["after"] == [], "commits left behind after the run"
    _check_resumed([o["got"] for o in outs], [o["reference"] for o in outs])


def run_killed_job(root: Path) -> subprocess.CompletedProcess:
    """The script under torchrun's elastic agent, rank 1 killed after batch 3 of epoch 1 and
    both workers restarted; each writes ``root/killed/rank<r>.pt`` (commits in ``root/commits``).
    tests/frontends/test_clean_exit.py runs it again and again."""
    run_id = f"gz-{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ,
        GRADZIP_COMPRESSION=METHOD,
        GRADZIP_TEST_KILL="1:1:3",  # rank 1, epoch 1, after batch 3 (the last commit: batch 2)
        GRADZIP_ELASTIC_DIR=str(root / "commits"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=last_call_timeout=1",
        "--monitor-interval=0.5",
        str(SCRIPT),
        str(root / "killed"),
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.long
def test_a_worker_killed_mid_run_resumes_with_its_codec_state(tmp_path):
    p = run_killed_job(tmp_path)
    log = p.stdout[-3000:] + p.stderr[-6000:]
    assert p.returncode == 0, log
    got = [torch.load(tmp_path / "killed" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref = run_ranks(_reference, 2, str(tmp_path / "reference"), fresh=True)
    _check_resumed(got, ref)
    assert "in place of Compression.none" in p.stderr and "compression ratio" in p.stderr
    assert not any((tmp_path / "commits").glob("commit.*")), "commits left behind after the run"


def _commit_on(rank, world, directory, steps):
    """A TorchState with a gradzip optimizer (TopK), ``steps`` steps, committed to ``directory``;
    with steps=0, the newest commit there is loaded instead. Returns what the state holds."""
    import gradzip.horovod as hvd

    os.environ["GRADZIP_ELASTIC_DIR"] = directory
    try:
        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(),
            compression="TopK(0.25)",
        )
        state = hvd.elastic.TorchState(model, opt, epoch=0)
        if steps:
            for s in range(steps):
                opt.zero_grad()
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + s))
                model(x).square().mean().backward()
                opt.step()
            state.epoch = 5
            state.commit()
            loaded = False
        else:
            loaded = state._load_commit()
        res = opt.engine.state_dict()["residuals"]
        return {
            "loaded": loaded,
            "epoch": state.epoch,
            "params": [p.detach().clone() for p in model.parameters()],
            "momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters() if p in opt.state],
            "residual_sum": sum(v.double().sum() for v in res.values()) if res else None,
        }
    finally:
        del os.environ["GRADZIP_ELASTIC_DIR"]


def test_a_commit_of_two_ranks_loads_on_one_with_the_residuals_resharded(tmp_path):
    """A restart on another world size: the model, the optimizer and the objects come from rank
    0's commit, every rank's residuals are resharded (their sum is kept)."""
    d = str(tmp_path / "commits")
    two = run_ranks(_commit_on, 2, d, 3)
    (one,) = run_ranks(_commit_on, 1, d, 0)
    assert one["loaded"] and one["epoch"] == 5
    assert all(torch.equal(a, b) for a, b in zip(one["params"], two[0]["params"]))
    assert all(torch.equal(a, b) for a, b in zip(one["momentum"], two[0]["momentum"]))
    total = two[0]["residual_sum"] + two[1]["residual_sum"]
    assert one["residual_sum"] is not None and abs(float(one["residual_sum"] - total)) < 1e-6 * (
        1 + abs(float(total))
    )  # float32 sums
