"""``hvd.elastic`` on torchrun's elastic agent, with one worker killed mid-run.

tests/frontends/horovod_elastic_train.py (Horovod's elastic example, gradzip's import; the
method comes from ``GRADZIP_COMPRESSION``) runs under ``torchrun --nnodes=1:2
--nproc-per-node=2 --max-restarts=1``; rank 1 SIGKILLs itself one batch after a commit. The
agent restarts both workers; they resume from the commit on disk. The same script run on 2
ranks without a kill is the reference: the final parameters must be equal bit for bit, which
they are only if the restart brought back every rank's error-feedback residuals (TopK keeps
95% of each gradient in them) along with the model, the momentum and the sampler.

One torchrun launch with a restart: about 20 s on a loaded 2-core machine (marked slow).
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


def _reference(rank, world, out_dir):
    """The script's main() on the ranks of tests/support, no kill, no torchrun: commits in memory."""
    sys.path.insert(0, str(SCRIPT.parent))
    for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "GRADZIP_ELASTIC_DIR"):
        os.environ.pop(k, None)
    os.environ["GRADZIP_COMPRESSION"] = METHOD
    import horovod_elastic_train

    return horovod_elastic_train.main(out_dir)


@pytest.mark.slow
def test_a_worker_killed_mid_run_resumes_with_its_codec_state(tmp_path):
    run_id = f"gz-{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ,
        GRADZIP_COMPRESSION=METHOD,
        GRADZIP_TEST_KILL="1:1:3",  # rank 1, epoch 1, after batch 3 (the last commit: batch 2)
        GRADZIP_ELASTIC_DIR=str(tmp_path / "commits"),
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
        str(tmp_path / "killed"),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    log = p.stdout[-3000:] + p.stderr[-6000:]
    assert p.returncode == 0, log
    got = [torch.load(tmp_path / "killed" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref = run_ranks(_reference, 2, str(tmp_path / "reference"), fresh=True)

    for r in range(2):
        assert got[r]["restart_count"] == 1 and got[r]["resets"] == [2], got[r]  # the reset callback ran once
        assert got[r]["method"] == ref[r]["method"] == "TopK(ratio=0.05)"
        assert all(torch.equal(a, b) for a, b in zip(got[r]["params"], ref[r]["params"])), f"rank {r}: parameters"
        assert got[r]["residuals"].keys() == ref[r]["residuals"].keys()
        assert all(torch.equal(got[r]["residuals"][k], ref[r]["residuals"][k]) for k in ref[r]["residuals"])
        assert any(float(v.abs().sum()) > 0 for v in got[r]["residuals"].values())
    assert ref[0]["resets"] == []
    assert "in place of Compression.none" in p.stderr and "compression ratio" in p.stderr
    assert not any((tmp_path / "commits").glob("commit.*")), "commits left behind after the run"
