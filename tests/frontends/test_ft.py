"""gradzip.ft: DiLoCo with compression on torchft's fault-tolerant manager.

The fast tests run two replica groups as threads of this process (each its own TCPStore, torchft
Manager and reconfigurable gloo group, one lighthouse), as torchft's own tests do: DiLoCo
(``gz.ft.DiLoCo``) and the DDP hook (``gz.ft.DDP`` with ``gz.ft.OptimizerWrapper``). A heal is
made by one replica failing a step alone: its peer commits, so torchft heals it at the next
quorum (its step is behind). The long ones
run ``examples/ft_diloco.py`` (``--front ddp`` for the hook): three replica processes, one killed
mid-run and restarted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install gradzip[ft])")

import gradzip as gz  # noqa: E402
from gradzip.ft import DiLoCo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: The replicas run as threads of one process: the global RNG they seed is shared, so each
#: builds its model under this lock (else their draws interleave and the models differ).
_INIT = threading.Lock()


def _manager(i: int, lighthouse: str):
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=2,
        use_async_quorum=False,
        replica_id=f"test_{i}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=20),
    )
    return manager, store


class _FailAt(DiLoCo):
    """Reports an error to the manager after the push of sync number ``fail_at`` (counting the
    joining sync as 0): the sync is then not committed on this replica (on every replica, when
    each fails it)."""

    fail_at = -1
    syncs = 0
    snapshot = None

    def _sync(self) -> bool:
        if self.syncs == self.fail_at and self.engine.memory is not None:
            eng = self.engine
            self.snapshot = {
                "residuals": {k: v.clone() for k, v in eng.memory.residuals.items()},
                "tensor_state": {k: dict(v) for k, v in eng.tensor_state.items()},
                "global": {k: v.clone() for k, v in self._global.items()},
                "stats": eng.stats_.state_dict(),
                "step": eng.step,
                "outer": [s["momentum_buffer"].clone() for s in self.outer.state.values()],
            }
        self.syncs += 1
        return super()._sync()

    def _average(self):
        avg = super()._average()
        if self.syncs - 1 == self.fail_at:
            self.manager.report_error(RuntimeError("injected: this sync must not commit"))
        return avg


def _replica(i: int, lighthouse: str, fail_at: int, steps: int = 10, period: int = 3):
    manager, _store = _manager(i, lighthouse)
    try:
        with _INIT:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = _FailAt(
            manager,
            torch.optim.SGD(model.parameters(), lr=0.05),
            model,
            period=period,
            compression=gz.Int8(),
            replicas=2,
        )
        opt.fail_at = fail_at
        gen = torch.Generator().manual_seed(100 + i)
        after = None
        for _ in range(steps):
            x = torch.randn(8, 16, generator=gen)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            syncs = opt.syncs
            opt.step()
            if opt.syncs != syncs and syncs == fail_at:  # the failed sync just ran
                eng = opt.engine
                after = {
                    "residuals": {k: v.clone() for k, v in eng.memory.residuals.items()},
                    "tensor_state": {k: dict(v) for k, v in eng.tensor_state.items()},
                    "global": {k: v.clone() for k, v in opt._global.items()},
                    "stats": eng.stats_.state_dict(),
                    "step": eng.step,
                    "outer": [s["momentum_buffer"].clone() for s in opt.outer.state.values()],
                    "x": [p.detach().clone() for p in model.parameters()],
                }
        return {
            "before": opt.snapshot,
            "after": after,
            "stats": opt.stats(),
            "final": [p.detach().clone() for p in model.parameters()],
        }
    finally:
        manager.shutdown(wait=False)


def _run_pair(fail_at: int, **kw):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=5000)
    try:
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(_replica, i, lighthouse.address(), fail_at, **kw) for i in range(2)]
            return [f.result(timeout=120) for f in futs]
    finally:
        lighthouse.shutdown()


def test_uncommitted_sync_puts_residuals_codec_state_and_stats_back():
    """The mass test: a sync that is not committed leaves, on every replica, the residuals, the
    codec state, the global model, the outer momentum and the engine's step as they were before
    it; ``stats()`` counts only committed syncs, and the lost one in ``steps_lost``."""
    out = _run_pair(fail_at=2)  # syncs: 0 (joining, the first call), 1 at local step 3, 2 at 6 (fails), 3 at 9
    for r in out:
        b, a = r["before"], r["after"]
        assert b is not None and a is not None
        assert b["residuals"], "Int8 keeps residuals (error feedback)"
        assert sorted(a["residuals"]) == sorted(b["residuals"])
        for k in b["residuals"]:
            assert torch.equal(a["residuals"][k], b["residuals"][k]), k
        assert a["tensor_state"] == b["tensor_state"]
        for k in b["global"]:
            assert torch.equal(a["global"][k], b["global"][k]), k
        for m0, m1 in zip(b["outer"], a["outer"]):
            assert torch.equal(m0, m1)
        assert a["step"] == b["step"]
        assert a["stats"]["bytes_sent"] == b["stats"]["bytes_sent"]
        assert a["stats"]["steps"] == b["stats"]["steps"]
        # the local model went back to the global one
        assert all(
            torch.equal(x, g)
            for x, g in zip(a["x"], [a["global"][k] for k in ("0.weight", "0.bias", "2.weight", "2.bias")])
        )
        st = r["stats"]
        assert st["steps_lost"] == 1 and st["bytes_lost"] > 0
        assert st["commits"] == 3 and st["syncs"] == 3
    # the replicas agree after the next, committed, sync
    for p0, p1 in zip(out[0]["final"], out[1]["final"]):
        assert torch.equal(p0, p1)
    assert out[0]["stats"]["bytes_sent"] == out[1]["stats"]["bytes_sent"]


def test_committed_run_counts_every_sync():
    out = _run_pair(fail_at=-1, steps=7)
    for r in out:
        st = r["stats"]
        assert st["steps_lost"] == 0 and st["bytes_lost"] == 0
        assert st["commits"] == st["syncs"] == 3  # the joining sync and two periods
        assert st["steps"] == 6  # the joining call takes no local step
    for p0, p1 in zip(out[0]["final"], out[1]["final"]):
        assert torch.equal(p0, p1)


def _heal_replica(i: int, lighthouse: str, compression, steps: int = 13, period: int = 3, fail_at: int = 2):
    """Replica 1 fails sync ``fail_at`` alone (replica 0 commits it) and is healed from replica 0
    at the next sync; each replica records its engine's step, commits and heals after every step."""
    manager, _store = _manager(i, lighthouse)
    try:
        with _INIT:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = _FailAt(
            manager, torch.optim.SGD(model.parameters(), lr=0.05), model, period=period, compression=compression
        )
        opt.fail_at = fail_at if i == 1 else -1
        gen = torch.Generator().manual_seed(100 + i)
        log, joined = [], None
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
            before = [p.detach().clone() for p in model.parameters()]
            got = opt.step()
            if joined is None:  # the joining call: a sync, no local step
                same = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
                joined = (opt.commits, opt.local_step, got, same)
            log.append((opt.engine.step, opt.commits, opt.heals))
        return {
            "log": log,
            "joined": joined,
            "stats": opt.stats(),
            "tensor_state": {k: dict(v) for k, v in opt.engine.tensor_state.items()},
            "final": [p.detach().clone() for p in model.parameters()],
        }
    finally:
        manager.shutdown(wait=False)


def _run_heal_pair(compression, **kw):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=5000)
    try:
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(_heal_replica, i, lighthouse.address(), compression, **kw) for i in range(2)]
            return [f.result(timeout=120) for f in futs]
    finally:
        lighthouse.shutdown()


def test_heal_carries_the_engine_step():
    """Replica 1 fails sync 2 alone: replica 0 commits it and torchft heals replica 1 at sync 3.
    The heal carries the engine's step, so RandomK draws the same positions on both replicas
    (tensor_seed(seed, step, name)) and they end with one model, at one step. The first step()
    is the joining sync alone: its gradient, taken before the join, is not applied."""
    # calls of step(): 1 joins (sync 0); local steps 3, 6 (replica 1 fails it alone), 9, 12 sync
    # at calls 4, 7, 10, 13 (log indices 3, 6, 9, 12)
    out = _run_heal_pair(gz.RandomK(0.1))
    r0, r1 = out
    assert r0["joined"] == r1["joined"] == (1, 0, None, True)
    assert r0["stats"]["steps_lost"] == 0 and r0["stats"]["commits"] == 5
    assert r1["stats"]["steps_lost"] == 1 and r1["stats"]["commits"] == 4
    assert r0["log"][9][2] == r0["log"][6][2], "the live replica is not healed"
    assert r1["log"][9][2] == r1["log"][6][2] + 1, "replica 1 is healed at sync 3"
    assert r1["log"][6][0] == r0["log"][6][0] - 1  # its sync 2 rolled back, before the heal
    assert [e[0] for e in r1["log"][9:]] == [e[0] for e in r0["log"][9:]]  # one step from the heal on
    assert r1["log"][-1][0] == 5
    for p0, p1 in zip(r0["final"], r1["final"]):
        assert torch.equal(p0, p1)


def test_async_quorum_is_refused():
    class M:
        _use_async_quorum = True

    with pytest.raises(ValueError, match="use_async_quorum=False"):
        DiLoCo(M(), torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), torch.nn.Linear(2, 2), period=2)


@pytest.mark.long
def test_replica_killed_and_restarted(tmp_path):
    """examples/ft_diloco.py: 3 replicas, replica 2 killed mid-run (SIGKILL) and restarted; the
    survivors go on stepping, the restarted one heals from a peer and every replica ends with the
    same global model, every process with rc 0."""
    out = tmp_path / "ft.json"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "ft_diloco.py"), "--quiet", "--json", str(out)]
    cmd += ["--steps", "120", "--period", "6", "--kill-at", "20", "--val-windows", "16", "--timeout", "400"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    finals = [summary["replicas"][str(i)]["final"] for i in range(3)]
    assert all(f is not None for f in finals)
    assert len({f["val_loss"] for f in finals}) == 1  # one global model
    assert summary["rejoin"]["healed"] >= 1
    for i in (0, 1):  # the survivors never stopped
        row = summary["replicas"][str(i)]
        assert row["steps_per_s_during"] > 0
        assert row["final"]["steps"] == 120


# -- the DDP hook on torchft ------------------------------------------------------------------
def _ddp_snapshot(model) -> dict:
    eng = model.engine
    return {
        "residuals": {k: v.clone() for k, v in eng.memory.residuals.items()},
        "tensor_state": {k: dict(v) for k, v in eng.tensor_state.items()},
        "stats": eng.stats_.state_dict(),
        "step": eng.step,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _ddp_replica(i: int, lighthouse: str, fail_at: int, steps: int = 6):
    """One replica group of gradzip.ft.DDP; at step ``fail_at`` the collective of the second
    bucket's call raises on this replica (the replicas run the same script, so on both): the
    communicator reports it, the later calls are dropped, and the step is not committed."""
    from gradzip.ft import DDP, OptimizerWrapper

    manager, _store = _manager(i, lighthouse)
    try:
        with _INIT:
            torch.manual_seed(0)
            module = torch.nn.Sequential(
                torch.nn.Linear(16, 32),
                torch.nn.Tanh(),
                torch.nn.Linear(32, 32),
                torch.nn.Tanh(),
                torch.nn.Linear(32, 4),
            )
        model = DDP(manager, module, "Int8()", replicas=2, bucket_cap_mb=0.002)  # ~2 KB: several buckets
        opt = OptimizerWrapper(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        comm = model.engine.comm
        calls = {"n": 0, "step": -1}
        allgather = comm.allgather

        def failing_allgather(out, inp, **kw):
            calls["n"] += 1
            if calls["step"] == fail_at and calls["n"] == 2:
                raise RuntimeError("injected: a peer is gone")
            return allgather(out, inp, **kw)

        comm.allgather = failing_allgather
        gen = torch.Generator().manual_seed(100 + i)
        before = after = None
        commits, buckets = [], 0
        for step in range(steps):
            x = torch.randn(8, 16, generator=gen)
            opt.zero_grad()
            calls["n"], calls["step"] = 0, step
            if step == fail_at:
                before = _ddp_snapshot(model)
                before["momentum"] = [s["momentum_buffer"].clone() for s in opt.state.values()]
            model(x).pow(2).mean().backward()
            buckets = max(buckets, len(model.engine._layout_now))
            commits.append(opt.step())
            if step == fail_at:
                after = _ddp_snapshot(model)
                after["momentum"] = [s["momentum_buffer"].clone() for s in opt.state.values()]
        return {
            "before": before,
            "after": after,
            "commits": commits,
            "buckets": buckets,
            "stats": model.stats(),
            "final": [p.detach().clone() for p in model.parameters()],
        }
    finally:
        manager.shutdown(wait=False)


def _run_ddp_pair(fail_at: int, **kw):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=5000)
    try:
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(_ddp_replica, i, lighthouse.address(), fail_at, **kw) for i in range(2)]
            return [f.result(timeout=120) for f in futs]
    finally:
        lighthouse.shutdown()


def test_ddp_uncommitted_step_puts_residuals_codec_state_and_stats_back():
    """gz.ft.DDP: a step whose collective fails (in its second bucket's call) is not committed; on
    every replica its residuals, codec state, counts, engine step, parameters and optimizer
    momentum are then as they were before it, ``stats()`` counts it in ``steps_lost`` only, and
    the next committed steps bring the replicas to one model."""
    out = _run_ddp_pair(fail_at=3)
    for r in out:
        assert r["buckets"] >= 3, "several DDP buckets, each its own call"
        assert r["commits"] == [True, True, True, False, True, True]
        b, a = r["before"], r["after"]
        assert b["residuals"], "Int8 keeps residuals (error feedback)"
        assert sorted(a["residuals"]) == sorted(b["residuals"])
        for k in b["residuals"]:
            assert torch.equal(a["residuals"][k], b["residuals"][k]), k
        assert a["tensor_state"] == b["tensor_state"]
        assert a["stats"] == b["stats"]
        assert a["step"] == b["step"] == 3
        for p0, p1 in zip(b["params"] + b["momentum"], a["params"] + a["momentum"]):
            assert torch.equal(p0, p1)
        st = r["stats"]
        assert st["steps_lost"] == 1 and st["bytes_lost"] > 0
        assert st["steps"] == st["commits"] == 5
    for p0, p1 in zip(out[0]["final"], out[1]["final"]):
        assert torch.equal(p0, p1)
    assert out[0]["stats"]["bytes_sent"] == out[1]["stats"]["bytes_sent"]


def test_ddp_committed_run_counts_every_step():
    out = _run_ddp_pair(fail_at=-1, steps=4)
    for r in out:
        st = r["stats"]
        assert r["commits"] == [True] * 4
        assert st["steps_lost"] == 0 and st["bytes_lost"] == 0
        assert st["steps"] == st["commits"] == 4 and st["bytes_sent"] > 0
        assert 0 < st["bytes_sent"] < st["bytes_raw"]  # Int8: about a quarter of float32
    for p0, p1 in zip(out[0]["final"], out[1]["final"]):
        assert torch.equal(p0, p1)


def _ddp_heal_replica(i: int, lighthouse: str, method: str, steps: int = 6, alone_at: int = -1, nan_at: int = -1):
    """One replica group of gradzip.ft.DDP; replica 1 alone fails step ``alone_at`` (its peer commits
    it, so torchft heals replica 1 at the next step's quorum) and has a NaN loss at step ``nan_at``.
    Records the engine's step and codec state after every quorum (and heal)."""
    from gradzip.ft import DDP, OptimizerWrapper

    manager, _store = _manager(i, lighthouse)
    try:
        with _INIT:
            torch.manual_seed(0)
            module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        model = DDP(manager, module, method, replicas=2)
        opt = OptimizerWrapper(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        gen = torch.Generator().manual_seed(100 + i)
        states, commits, heals, nan = [], [], [], None
        for step in range(steps):
            x = torch.randn(8, 16, generator=gen)
            opt.zero_grad()
            eng = model.engine
            states.append((eng.step, {k: dict(v) for k, v in eng.tensor_state.items()}))
            heals.append(model.heals)
            before = [p.detach().clone() for p in model.parameters()]
            loss = model(x).pow(2).mean()
            if i == 1 and step == nan_at:
                loss = loss * float("nan")
            loss.backward()
            if i == 1 and step == alone_at:
                manager.report_error(RuntimeError("injected: this replica's step fails alone"))
            commits.append(opt.step())
            if step == nan_at:
                nan = {"before": before, "after": [p.detach().clone() for p in model.parameters()]}
                nan["skipped"] = eng.last_step_nonfinite
        return {
            "states": states,
            "commits": commits,
            "heals": heals,
            "nan": nan,
            "stats": model.stats(),
            "final": [p.detach().clone() for p in model.parameters()],
        }
    finally:
        manager.shutdown(wait=False)


def _run_ddp_heal_pair(method: str, **kw):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=5000)
    try:
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(_ddp_heal_replica, i, lighthouse.address(), method, **kw) for i in range(2)]
            return [f.result(timeout=120) for f in futs]
    finally:
        lighthouse.shutdown()


def _same_state(a: dict, b: dict) -> bool:
    """Two engines' ``tensor_state`` alike (tensors compared exactly)."""
    if sorted(a) != sorted(b):
        return False
    for k in a:
        if sorted(a[k]) != sorted(b[k]):
            return False
        for key, v in a[k].items():
            w = b[k][key]
            same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
            if not same:
                return False
    return True


def test_ddp_heal_carries_powersgd_state():
    """gz.ft.DDP with PowerSGD(rank=1): replica 1 fails step 2 alone and heals at step 3's quorum. The
    heal carries the engine's step and codec state (the averaged warm-start Q every replica holds
    alike), so after it both replicas start step 3 with the same step and Q, their collectives
    match, every later step commits and they end with one model."""
    r0, r1 = _run_ddp_heal_pair("PowerSGD(rank=1)", alone_at=2)
    assert r0["commits"] == [True] * 6
    assert r1["commits"] == [True, True, False, True, True, True]
    assert r1["heals"][3] == r1["heals"][2] + 1 and r0["heals"][3] == r0["heals"][2]
    step0, ts0 = r0["states"][3]
    step1, ts1 = r1["states"][3]
    assert step0 == step1 == 3
    assert any("q" in st for st in ts0.values()), "PowerSGD keeps its warm-start Q"
    assert _same_state(ts0, ts1)
    assert r1["stats"]["steps_lost"] == 1 and r0["stats"]["steps_lost"] == 0
    assert r0["states"][-1][0] == r1["states"][-1][0]
    for p0, p1 in zip(r0["final"], r1["final"]):
        assert torch.equal(p0, p1)


def test_ddp_stateless_nonfinite_step_is_skipped():
    """gz.ft.DDP("Identity()") (no error feedback: a stateless engine) with a NaN loss on replica 1:
    the engine reads the average (skip_guard), so OptimizerWrapper skips the step on both replicas;
    the parameters stay finite, as they were, and alike."""
    r0, r1 = _run_ddp_heal_pair("Identity()", steps=4, nan_at=2)
    for r in (r0, r1):
        assert r["commits"] == [True] * 4
        assert r["nan"]["skipped"]
        for b, a in zip(r["nan"]["before"], r["nan"]["after"]):
            assert torch.equal(a, b)
        assert all(bool(torch.isfinite(p).all()) for p in r["final"])
    for p0, p1 in zip(r0["final"], r1["final"]):
        assert torch.equal(p0, p1)


def test_ddp_refuses_async_quorum_and_a_process_group():
    from gradzip.ft import DDP

    class M:
        _use_async_quorum = True

    with pytest.raises(ValueError, match="use_async_quorum=False"):
        DDP(M(), torch.nn.Linear(2, 2))
    M._use_async_quorum = False
    with pytest.raises(TypeError, match="process group"):
        DDP(M(), torch.nn.Linear(2, 2), process_group=None)


@pytest.mark.long
def test_ddp_replica_killed_and_restarted(tmp_path):
    """examples/ft_diloco.py --front ddp: 3 replicas of gz.ft.DDP(Int8()), replica 2 killed mid-run
    (SIGKILL) and restarted; the survivors commit steps throughout, the restarted one heals from a
    peer, and every replica ends with the same model after the same committed steps."""
    out = tmp_path / "ft_ddp.json"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "ft_diloco.py"), "--front", "ddp", "--quiet"]
    # 160 steps: the survivors must still be running when the restarted replica is ready (its start
    # took up to 10 s here under load; a replica that comes back after the others finished waits
    # alone for a quorum of 2 until its quorum timeout)
    cmd += ["--json", str(out), "--steps", "160", "--kill-at", "15", "--val-windows", "8", "--timeout", "400"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    summary = data["summary"]
    finals = [summary["replicas"][str(i)]["final"] for i in range(3)]
    assert all(f is not None for f in finals)
    assert len({f["val_loss"] for f in finals}) == 1  # one model
    assert summary["rejoin"]["healed"] >= 1 and summary["rejoin"]["joined_at_step"] < 160
    log = [r for r in data["log"] if "step" in r]
    t_kill = summary["kill_time"]
    t_back = min(r["t"] for r in log if r["replica"] == 2 and r["generation"] == 1)  # its first step back
    for i in (0, 1):  # the survivors went on committing while replica 2 was down
        assert finals[i]["steps"] == finals[i]["commits"] == 160
        down = [r["commits"] for r in log if r["replica"] == i and t_kill < r["t"] < t_back]
        assert down and max(down) > min(down)
