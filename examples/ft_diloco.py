"""Fault-tolerant DiLoCo (or DDP) with Int8 compression on torchft: kill a replica mid-run, restart it.

    python examples/ft_diloco.py                      # 3 replicas, replica 2 killed and restarted
    python examples/ft_diloco.py --no-kill --seed 1   # the unbroken run, for comparison
    python examples/ft_diloco.py --json out.json      # the per-replica logs and the summary
    python examples/ft_diloco.py --front ddp          # gradzip.ft.DDP: one torchft step per step

With ``--front ddp`` each replica trains with ``gradzip.ft.DDP(manager, model, Int8())`` and
``gradzip.ft.OptimizerWrapper``: every training step is one torchft step (quorum, the hook's
compressed all-gathers, commit), ``--steps`` counts committed steps (``manager.current_step()``,
which a healed replica adopts) and ``commits``/``lost`` count steps instead of syncs.

One machine: a torchft lighthouse (in this process) and ``--replicas`` replica groups of one rank
each, as subprocesses on 127.0.0.1 over gloo. Each trains the bench language model
(``gradzip.bench.lm``, ``--size micro``) with ``gradzip.ft.DiLoCo(period=..., compression=Int8())``
and prints one JSON line per local step. This process kills replica ``--victim`` (SIGKILL) once it
has logged ``--kill-at`` local steps, restarts it ``--restart-after`` seconds later, and reports,
per replica, the local steps per second over the failure, when the restarted replica rejoined (in
the survivors' syncs), the syncs committed and lost, and the final validation loss of the global
model. Every process ends with rc 0, the killed one apart; none is left behind.

``docs/fault_tolerance.md`` explains what happens at each event.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--front", default="diloco", choices=["diloco", "ddp"], help="gradzip.ft.DiLoCo or gradzip.ft.DDP")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=96, help="local steps of every replica (--front ddp: committed steps)")
    p.add_argument("--period", type=int, default=8, help="local steps between syncs")
    p.add_argument("--method", default="Int8()", help="the pseudo-gradient's compression (gz.parse; default Int8())")
    p.add_argument("--size", default="micro", choices=["micro", "tiny"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--victim", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=36, help="local step of the victim after which it is killed")
    p.add_argument("--restart-after", type=float, default=1.0, help="seconds between the kill and the restart")
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the whole run may take")
    p.add_argument("--json", default=None, help="write the logs and the summary here")
    p.add_argument("--quiet", action="store_true", help="no replica lines on stdout")
    # a replica (started by the driver)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    p.add_argument("--generation", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- a replica ------------------------------------------------------------------------------
def worker(a) -> int:
    import logging
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    import gradzip as gz
    from gradzip.bench import lm
    from gradzip.ft import DiLoCo

    logging.disable(logging.WARNING)  # torchft's per-step INFO/WARNING lines
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=15)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=2,
        use_async_quorum=False,
        replica_id=f"replica_{a.worker}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=a.lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=15),
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=15),
    )
    try:
        if a.front == "ddp":
            return ddp_worker(a, manager)
        model = lm.make_gpt(a.size, a.seed)  # the same start on every replica (a healed one adopts G)
        train, val = lm.corpus()
        ctx = lm.SIZES[a.size].context
        # each life of a replica reads its own stream of batches
        batches = lm.Batches(train, ctx, a.batch, a.seed, rank=a.worker + 1000 * a.generation)
        inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
        opt = DiLoCo(manager, inner, model, period=a.period, compression=gz.parse(a.method), replicas=a.replicas)
        t0 = time.time()
        print(json.dumps({"replica": a.worker, "generation": a.generation, "ready": True, "t": t0}), flush=True)
        while opt.local_step < a.steps:
            x, y = batches.next()
            loss = F.cross_entropy(model(x).reshape(-1, lm.VOCAB), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            line = {
                "replica": a.worker,
                "generation": a.generation,
                "t": time.time(),
                "step": opt.local_step,
                "loss": round(float(loss), 4),
                "commits": opt.commits,
                "lost": opt.stats()["steps_lost"],
                "heals": opt.heals,
                "world": opt.engine.comm.world_size,
            }
            print(json.dumps(line), flush=True)
        st = opt.stats()
        val_loss = lm.val_loss(model, lm.windows(val, ctx, a.val_windows))  # x == G after the last sync
        end = {
            "replica": a.worker,
            "generation": a.generation,
            "done": True,
            "seconds": time.time() - t0,
            "val_loss": val_loss,
            **{k: st[k] for k in ("steps", "syncs", "steps_lost", "commits", "heals", "bytes_sent", "bytes_lost")},
        }
        print(json.dumps(end), flush=True)
    finally:
        manager.shutdown(wait=False)
    return 0


def ddp_worker(a, manager) -> int:
    """A replica of ``--front ddp``: gradzip.ft.DDP and its OptimizerWrapper, one torchft step
    per training step, until ``--steps`` steps are committed."""
    import torch
    import torch.nn.functional as F

    import gradzip as gz
    from gradzip.bench import lm
    from gradzip.ft import DDP, OptimizerWrapper

    model = DDP(manager, lm.make_gpt(a.size, a.seed), gz.parse(a.method), replicas=a.replicas)
    train, val = lm.corpus()
    ctx = lm.SIZES[a.size].context
    batches = lm.Batches(train, ctx, a.batch, a.seed, rank=a.worker + 1000 * a.generation)
    opt = OptimizerWrapper(model, torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0))
    t0 = time.time()
    print(json.dumps({"replica": a.worker, "generation": a.generation, "ready": True, "t": t0}), flush=True)
    while manager.current_step() < a.steps:
        x, y = batches.next()
        opt.zero_grad()  # the quorum: a restarted replica heals here, before its forward pass
        loss = F.cross_entropy(model(x).reshape(-1, lm.VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        st = model.stats()
        line = {
            "replica": a.worker,
            "generation": a.generation,
            "t": time.time(),
            "step": manager.current_step(),
            "loss": round(float(loss), 4),
            "commits": model.commits,
            "lost": st["steps_lost"],
            "heals": model.heals,
            "world": model.engine.comm.world_size,
        }
        print(json.dumps(line), flush=True)
    st = model.stats()
    val_loss = lm.val_loss(model.module, lm.windows(val, ctx, a.val_windows))
    end = {
        "replica": a.worker,
        "generation": a.generation,
        "done": True,
        "seconds": time.time() - t0,
        "val_loss": val_loss,
        "syncs": st["steps"],
        **{k: st[k] for k in ("steps", "steps_lost", "commits", "heals", "bytes_sent", "bytes_lost")},
    }
    print(json.dumps(end), flush=True)
    return 0


# -- the driver -----------------------------------------------------------------------------
class Replica:
    def __init__(self, a, i: int, lighthouse: str, generation: int, sink: list, lock: threading.Lock) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(i), "--lighthouse", lighthouse]
        cmd += ["--generation", str(generation), "--replicas", str(a.replicas), "--steps", str(a.steps)]
        cmd += ["--period", str(a.period), "--size", a.size, "--batch", str(a.batch), "--lr", str(a.lr)]
        cmd += ["--seed", str(a.seed), "--val-windows", str(a.val_windows), "--method", a.method, "--front", a.front]
        env = dict(os.environ, PYTHONUNBUFFERED="1", RUST_LOG="error")
        self.i, self.generation = i, generation
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.last_step = 0
        self.stderr: list[str] = []
        self.reader = threading.Thread(target=self._read, args=(sink, lock, a.quiet), daemon=True)
        self.reader.start()
        self.err_reader = threading.Thread(target=self._read_err, daemon=True)
        self.err_reader.start()

    def _read(self, sink, lock, quiet) -> None:
        for raw in self.proc.stdout:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            with lock:
                sink.append(rec)
            self.last_step = rec.get("step", self.last_step)
            if not quiet and rec.get("step", 0) % 8 == 0 or rec.get("done"):
                print(raw.rstrip(), flush=True)

    def _read_err(self) -> None:
        for raw in self.proc.stderr:
            self.stderr.append(raw)
            del self.stderr[:-200]


def steps_per_second(recs: list, t_from: float, t_to: float) -> float:
    pts = [r for r in recs if "step" in r and t_from <= r["t"] < t_to]
    if len(pts) < 2:
        return 0.0
    return (len(pts) - 1) / (pts[-1]["t"] - pts[0]["t"]) if pts[-1]["t"] > pts[0]["t"] else 0.0


def summarize(a, recs: list, t_kill: float | None, t_restart: float | None) -> dict:
    out: dict = {"replicas": {}, "kill_time": t_kill, "restart_time": t_restart}
    for i in range(a.replicas):
        mine = [r for r in recs if r["replica"] == i and "step" in r]
        done = [r for r in recs if r["replica"] == i and r.get("done")]
        row: dict = {"final": done[-1] if done else None}
        if t_kill is not None and mine:
            row["steps_per_s_before"] = round(steps_per_second(mine, t_kill - 10, t_kill), 2)
            row["steps_per_s_during"] = round(steps_per_second(mine, t_kill, t_kill + 10), 2)
            row["steps_per_s_after"] = round(steps_per_second(mine, t_kill + 10, t_kill + 30), 2)
            gaps = [b["t"] - x["t"] for x, b in zip(mine, mine[1:]) if x["t"] >= t_kill - 5]
            row["longest_pause_s"] = round(max(gaps), 2) if gaps else None
        out["replicas"][i] = row
    if t_restart is not None:
        back = [r for r in recs if r["replica"] == a.victim and r.get("generation", 0) > 0 and "step" in r]
        if back:
            first = back[0]
            ready = next(
                r["t"] for r in recs if r["replica"] == a.victim and r.get("generation", 0) > 0 and r.get("ready")
            )
            # the survivors' syncs between the restart and the first step of the healed replica
            surv = [r for r in recs if r["replica"] != a.victim and "step" in r]
            c0 = max((r["commits"] for r in surv if r["t"] <= t_restart), default=0)
            c1 = max((r["commits"] for r in surv if r["t"] <= first["t"]), default=0)
            cr = max((r["commits"] for r in surv if r["t"] <= ready), default=0)
            out["rejoin"] = {
                "seconds_after_restart": round(first["t"] - t_restart, 2),
                "seconds_starting": round(ready - t_restart, 2),  # interpreter, imports, model: before any quorum
                "survivor_syncs_until_rejoin": c1 - c0,
                "survivor_syncs_from_ready": c1 - cr,  # syncs between its first quorum request and its joining
                # DDP: the step it committed first; DiLoCo: its first step() joins and takes no local step
                "joined_at_step": first["step"] - (1 if a.front == "ddp" else 0),
                "healed": first["heals"],
            }
    finals = [r["final"]["val_loss"] for r in out["replicas"].values() if r["final"]]
    out["val_loss"] = finals
    return out


def driver(a) -> int:
    os.environ.setdefault("RUST_LOG", "error")  # the lighthouse's per-tick lines
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=3000, quorum_tick_ms=50, heartbeat_timeout_ms=2000
    )
    addr = lighthouse.address()
    recs: list = []
    lock = threading.Lock()
    replicas = [Replica(a, i, addr, 0, recs, lock) for i in range(a.replicas)]
    everyone = list(replicas)
    t_kill = t_restart = None
    rc = 0
    deadline = time.time() + a.timeout
    try:
        if not a.no_kill:
            victim = replicas[a.victim]
            while victim.last_step < a.kill_at and victim.proc.poll() is None and time.time() < deadline:
                time.sleep(0.01)
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            t_kill = time.time()
            print(f"# killed replica {a.victim} after its local step {victim.last_step}", flush=True)
            time.sleep(a.restart_after)
            t_restart = time.time()
            replicas[a.victim] = Replica(a, a.victim, addr, 1, recs, lock)
            everyone.append(replicas[a.victim])
            print(f"# restarted replica {a.victim}", flush=True)
        for r in replicas:
            left = max(1.0, deadline - time.time())
            code = r.proc.wait(timeout=left)
            r.reader.join(timeout=5)
            if code != 0:
                rc = 1
                print(
                    f"# replica {r.i} (life {r.generation}) exited with {code}:\n{''.join(r.stderr[-30:])}", flush=True
                )
    except subprocess.TimeoutExpired:
        rc = 1
        print("# timed out", flush=True)
    finally:
        for r in everyone:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        lighthouse.shutdown()
    summary = summarize(a, recs, t_kill, t_restart)
    summary["front"] = a.front
    summary["rc"] = rc
    print(json.dumps(summary, indent=1, default=str), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "summary": summary, "log": recs}, f)
    return rc


def main(argv=None) -> int:
    a = parse(argv)
    return worker(a) if a.worker is not None else driver(a)


if __name__ == "__main__":
    sys.exit(main())
