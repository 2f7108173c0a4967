"""An elastic training script in the style of Horovod's examples/elastic/pytorch (MNIST): only
the import names gradzip. tests/frontends/test_horovod_elastic.py runs it under torchrun's
elastic agent, with one worker killed mid-run, and in-process without the kill.

    GRADZIP_COMPRESSION="TopK(0.05)" torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=1 \\
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-conf=last_call_timeout=1 \\
        tests/frontends/horovod_elastic_train.py OUT_DIR

The script's own parts (Horovod's API only): ``hvd.init()``; a model, ``SGD`` with momentum and
an ``ElasticSampler``; ``hvd.DistributedOptimizer(compression=hvd.Compression.none)`` (the
environment picks the gradzip method); ``hvd.elastic.TorchState(model, optimizer,
sampler=..., epoch=0, batch=0)`` with a reset callback that scales the learning rate by
``hvd.size()``; ``@hvd.elastic.run`` around the loop, which records each batch in the sampler
and commits every ``COMMIT_EVERY`` batches.

``GRADZIP_TEST_KILL=RANK:EPOCH:BATCH`` makes that rank SIGKILL itself after that batch of that
epoch on the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0). ``GRADZIP_TEST_STOP=EPOCH:BATCH``
makes every rank raise :class:`Stopped` there instead (on the first attempt): the in-process
stand-in for a killed job, whose test calls ``main`` again as torchrun's agent restarts the
workers. Each rank writes ``OUT_DIR/rank<r>.pt``: the final parameters, its gradzip residuals,
how many resets it saw, and the optimizer's stats.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn.functional as F

import gradzip.horovod as hvd

EPOCHS, BATCH, SAMPLES, COMMIT_EVERY, LR = 2, 8, 96, 2, 0.05


class Stopped(Exception):
    """Raised on every rank at ``GRADZIP_TEST_STOP`` (the module docstring)."""


def main(out_dir: str) -> dict:
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 12, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)
    )
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=hvd.Compression.none
    )
    resets = []

    def on_state_reset():
        resets.append(hvd.size())
        for group in optimizer.param_groups:
            group["lr"] = LR * hvd.size()

    kill = os.environ.get("GRADZIP_TEST_KILL", "")
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0
    kill_rank, kill_epoch, kill_at = (int(x) for x in kill.split(":")) if kill and first_attempt else (-1, -1, -1)
    stop = os.environ.get("GRADZIP_TEST_STOP", "")
    stop_epoch, stop_at = (int(x) for x in stop.split(":")) if stop and first_attempt else (-1, -1)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, EPOCHS):  # noqa: B020 - Horovod's examples loop so
            loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=state.sampler)
            for data, target in loader:
                state.optimizer.zero_grad()
                F.cross_entropy(state.model(data), target).backward()
                state.optimizer.step()
                state.sampler.record_batch(state.batch, BATCH)
                state.batch += 1
                if state.batch % COMMIT_EVERY == 0:
                    state.commit()
                if (hvd.rank(), state.epoch, state.batch) == (kill_rank, kill_epoch, kill_at):
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-run, a batch after a commit
                if (state.epoch, state.batch) == (stop_epoch, stop_at):
                    raise Stopped(f"every rank stops after batch {stop_at} of epoch {stop_epoch}")
            state.sampler.set_epoch(state.epoch + 1)
            state.batch = 0
            state.commit()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)
    with torch.no_grad():
        loss = hvd.allreduce(F.cross_entropy(model(dataset.tensors[0]), dataset.tensors[1]))
    out = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "params": [p.detach().clone() for p in model.parameters()],
        "residuals": {k: v.clone() for k, v in optimizer.engine.state_dict()["residuals"].items()},
        "resets": resets,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "method": repr(optimizer.engine.method),
        "ratio": optimizer.stats()["ratio"],
        "loss": float(loss),
    }
    os.makedirs(out_dir, exist_ok=True)
    torch.save(out, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))
    return out


if __name__ == "__main__":
    main(sys.argv[1])  # and exits as a user's script does (tests/frontends/test_clean_exit.py)
