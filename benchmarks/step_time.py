"""Step time per method on emulated links, against a cost model.

    sudo .venv/bin/python -m benchmarks.step_time [--ranks 4] [--rates 100mbit,1gbit,none]

N ranks run in network namespaces (``benchmarks/netns.py``) whose links are shaped
with tc tbf; each trains a communication-bound MLP (>= 20M parameters) through
the gradzip DDP hook for every method, and reports the median step time. The
cost model predicts

    step = compute + codec + allreduce_bytes * 2(N-1)/N / B + allgather_bytes * (N-1) / B
           + collectives * latency

from quantities measured in the same run: compute (the whole training step of the
same DDP model and optimizer, with a comm hook that returns each bucket untouched:
forward, backward, DDP's bucket handling and the optimizer step, timed on every
rank at the same time, one such step just before each timed step; a step waits for
its slowest rank, so compute is the median over steps of the slowest rank's time;
each row also keeps rank 0's own, ``compute_s``, and the model error with it), codec
seconds and the bytes each rank handed to allreduce and to all-gather (``stats()``).
B is the nominal link rate; for the unshaped run B is the bandwidth measured by a
timed 64 MB allreduce between the namespaces. latency
is the median time of a one-element allreduce between the idle ranks, and
collectives the number per step (stats(); DDP's bucket count for plain allreduce).
Every method, plain allreduce included, runs DDP with gradient_as_bucket_view=True
(no copies between gradients and buckets; --no-bucket-view for DDP's default).
Codec seconds include the engine's non-finite checks (gradzip's own work outside the
collectives). Each row also records CPU time: the process CPU time (all threads) of
each timed step and of its compute step, and the codec blocks' thread CPU time. With
more ranks than cores the ranks share the cores, and these show where the wall time went.
Writes benchmarks/results/step_time.json and step_time.png.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks._common import RESULTS, child_env, module_argv

RATES = {"100mbit": 100e6, "1gbit": 1e9, "none": None}
LATENCY_S = 50e-6  # per message between namespaces (veth + bridge; not shaped)


#: Plain DDP's row (no hook), in the grammar's spelling (``gz.parse("DDP")`` is ``None``): the
#: first method run, and the one every speed-up is against.
DDP = "DDP"


def methods(bps: float | None = None, world: int = 4) -> dict:
    """The methods timed, each under its spelling in gradzip's method grammar: ``gz.parse(label)``
    builds the same method (``DDP``: plain DDP, no hook). ``Policy(..., auto=True)`` needs the
    link, so it exists only once ``bps`` is known; its label leaves the link and the world size
    to the row (``gz.parse(label, {"link": link})``; the world size is the process group's)."""
    import gradzip as gz

    m = {
        DDP: None,  # plain DDP, no hook
        "Identity": gz.Identity(),  # plain allreduce through gradzip's hook: the engine's own cost
        "FP16": gz.FP16(),
        "TopK(0.01)": gz.TopK(ratio=0.01),
        "Threshold(tau=0.001, policy='adaptive')": gz.Threshold(tau=1e-3, policy="adaptive"),
        "SignSGD": gz.SignSGD(),
        "Int8": gz.Int8(),  # the recipe that held on both bench tasks (TwoPhase from 4 ranks)
    }
    m["PowerSGD(rank=1)"] = gz.PowerSGD(rank=1)  # the library's default rank
    m["PowerSGD(rank=4)"] = gz.PowerSGD(rank=4)
    if bps:  # per layer: the default compressor or plain allreduce, whichever the cost model finds faster
        auto = {"auto": True, "link": gz.Link(bps, LATENCY_S), "world_size": world}
        m["Policy(PowerSGD(rank=4), auto=True)"] = gz.Policy(gz.PowerSGD(rank=4), **auto)
        m["Policy(TopK(0.01), auto=True)"] = gz.Policy(gz.TopK(ratio=0.01), **auto)
    return m


def build_model(width: int, depth: int):
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 1024))
    return torch.nn.Sequential(*layers)


# -- one rank ----------------------------------------------------------------------------
def calibrate_bps(world: int) -> float:
    """Link bandwidth in bits/s through the ring formula, from a timed 64 MB allreduce
    (rank 0's figure, broadcast: every rank builds Policy(auto=True) from the same one)."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(16 * 2**20)
    dist.all_reduce(buf)
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(buf)
    dt = time.perf_counter() - t0
    bps = torch.tensor([buf.numel() * 4 * 8 * 2 * (world - 1) / world / dt], dtype=torch.float64)
    dist.broadcast(bps, 0)
    return float(bps.item())


def no_comm(_, bucket):
    """A DDP comm hook that returns each bucket as it is: the step without communication."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def worker(a) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gradzip.hooks import register_hook

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=a.pg_timeout),
    )
    ddp_kw = {"gradient_as_bucket_view": a.bucket_view}
    model = build_model(a.width, a.depth)
    nparams = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(a.rank)
    x, y = torch.randn(a.batch, 1024, generator=g), torch.randn(a.batch, 1024, generator=g)

    def ddp_step(m, o):
        o.zero_grad(set_to_none=True)
        F.mse_loss(m(x), y).backward()
        o.step()

    # "compute": the whole step with communication and codec taken out. The same DDP (its
    # bucket copies) and optimizer, with a hook that returns each bucket as it is, timed on
    # every rank at once (the same CPU contention as in the real steps).
    shadow = torch.nn.parallel.DistributedDataParallel(build_model(a.width, a.depth), **ddp_kw)
    shadow.register_comm_hook(None, no_comm)
    shadow_opt = torch.optim.SGD(shadow.parameters(), lr=1e-3)

    # Per-collective latency: a one-element allreduce, every rank idle (median of 20).
    one = torch.zeros(1)
    dist.barrier()
    lat = []
    for _ in range(20):
        t0 = time.perf_counter()
        dist.all_reduce(one)
        lat.append(time.perf_counter() - t0)
    latency = statistics.median(lat)

    bw = calibrate_bps(a.world) if a.calibrate else None
    comp = methods(a.bps or bw, a.world)[a.method]  # after the calibration: Policy(auto=True) needs the link

    ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_kw)
    state = register_hook(ddp, comp) if comp is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    # Each timed step is paired with a timed step of the shadow model just before it, so
    # compute is measured under the same conditions (caches, the other ranks' load).
    # Process CPU time (all threads) of each step too: with more ranks than cores the step is
    # bound by the CPU the ranks need, not only by the wall time each phase takes.
    times, shadow_times, cpus, shadow_cpus, snap = [], [], [], [], None
    for s in range(a.warmup + a.steps):
        if s == a.warmup and state is not None:
            snap = state.stats()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        ddp_step(shadow, shadow_opt)
        shadow_times.append(time.perf_counter() - t0)
        shadow_cpus.append(time.process_time() - c0)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        ddp_step(ddp, opt)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    times, shadow_times = times[a.warmup :], shadow_times[a.warmup :]
    cpus, shadow_cpus = cpus[a.warmup :], shadow_cpus[a.warmup :]
    compute = statistics.median(shadow_times)
    # Every rank ends a step at the same collectives, so a step waits for its slowest rank's
    # compute: the model's compute is the median over steps of the slowest rank's compute step.
    slowest = torch.tensor(shadow_times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    out = {
        "method": a.method,
        "rank": a.rank,
        "params": nparams,
        "compute_s": compute,
        "compute_slowest_s": statistics.median(slowest.tolist()),
        "compute_slowest_all_s": slowest.tolist(),
        "step_s": statistics.median(times),
        "step_cpu_s": statistics.median(cpus),
        "compute_cpu_s": statistics.median(shadow_cpus),
        "step_all_s": times,
        "compute_all_s": shadow_times,
        "step_cpu_all_s": cpus,
        "compute_cpu_all_s": shadow_cpus,
        "calibrated_bps": bw,
        "collective_latency_s": latency,
    }
    if state is not None:
        end = state.stats()
        k = end["steps"] - snap["steps"]
        for key in ("bytes_sent", "bytes_allgather", "codec_seconds", "codec_cpu_seconds", "collectives"):
            out[key + "_per_step"] = (end[key] - snap[key]) / k
    else:
        from gradzip.costmodel import ddp_buckets

        buckets = ddp_buckets([p.numel() * 4 for p in model.parameters()])
        out.update(
            bytes_sent_per_step=nparams * 4,
            bytes_allgather_per_step=0,
            codec_seconds_per_step=0.0,
            codec_cpu_seconds_per_step=0.0,
            collectives_per_step=len(buckets),
        )
    if a.rank == 0:
        with open(a.result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------
def model_time(r: dict, world: int, bps: float | None) -> dict:
    """compute + codec + wire, the wire costed by gradzip.costmodel's ring formulas (bandwidth terms)."""
    from gradzip.costmodel import Link, allgather_time, allreduce_time

    gather = r["bytes_allgather_per_step"]
    reduce_ = r["bytes_sent_per_step"] - gather
    wire = 0.0
    if bps:
        link = Link(bps, 0.0)
        wire = allreduce_time(reduce_, world, link) + allgather_time(gather, world, link)
    latency = r.get("collectives_per_step", 0) * r.get("collective_latency_s", 0.0)
    compute = r.get("compute_slowest_s", r["compute_s"])  # a row without the slowest rank's: rank 0's
    rest = r["codec_seconds_per_step"] + wire + latency
    return {
        "compute": compute,
        "codec": r["codec_seconds_per_step"],
        "wire": wire,
        "latency": latency,
        "total": compute + rest,
        "total_rank0_compute": r["compute_s"] + rest,
    }


def launch(net, world: int, argv: list, timeout: float, what: str) -> None:
    """Run ``argv`` as ranks 0..world-1 (``--rank i`` appended), each in its namespace; raise
    RuntimeError naming ``what`` if one fails or they are not all done within ``timeout`` s."""
    env = child_env({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    procs = [
        subprocess.Popen(
            net.command(i, argv + ["--rank", str(i)], env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for i in range(world)
    ]
    deadline = time.time() + timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1, deadline - time.time()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{what}: ranks did not finish in {timeout:.0f}s") from None
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{what} failed:\n" + "\n".join(log[-2000:] for log in logs))


def run_method(net, world, method, a, rate_name, calibrate, bps) -> dict:
    port = 29000 + int(time.time() * 1000) % 20000
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    argv = (
        [
            *module_argv("step_time"),
            "--worker",
            "--method",
            method,
            "--world",
            str(world),
            "--master",
            net.address(0),
            "--port",
            str(port),
            "--result",
            result,
            "--width",
            str(a.width),
            "--depth",
            str(a.depth),
            "--batch",
            str(a.batch),
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            "--pg-timeout",
            str(a.pg_timeout),
            "--bps",
            str(bps or 0),
        ]
        + (["--calibrate"] if calibrate else [])
        + ([] if a.bucket_view else ["--no-bucket-view"])
    )
    launch(net, world, argv, a.method_timeout, f"{method} at {rate_name}")
    with open(result) as f:
        out = json.load(f)
    os.unlink(result)
    return out


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """The hidden options the driver passes to each rank (shared with benchmarks/overhead.py)."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--bps", type=float, default=0.0, help=argparse.SUPPRESS)


def add_run_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    """The options of one timed run of a method (shared with benchmarks/overhead.py)."""
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=1, help="hidden width x width layers (default: ~25M parameters)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--no-bucket-view",
        dest="bucket_view",
        action="store_false",
        help="DDP's default gradient copies (default: gradient_as_bucket_view=True for every method)",
    )
    p.add_argument("--pg-timeout", type=float, default=300.0)
    p.add_argument("--method-timeout", type=float, default=900.0)


def split_methods(text: str) -> list[str]:
    """``"A(1, B(2)), C"`` as ``["A(1, B(2))", "C"]``: split at the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [m for m in [*out, cur.strip()] if m]


def _spelling(name: str) -> str:
    """``name`` in Python's spacing (``TopK( 0.01 )`` -> ``TopK(0.01)``), or as given if it is no
    expression."""
    try:
        return ast.unparse(ast.parse(name.strip(), mode="eval"))
    except SyntaxError:
        return name.strip()


def parse_methods(p: argparse.ArgumentParser, text: str, ranks: int) -> list:
    """Labels of :func:`methods` from ``--methods``, plain DDP first (the first calibrates the
    unshaped link). Commas inside brackets belong to the name (``Policy(TopK(0.01), auto=True)``);
    spacing is the grammar's (``Policy(TopK(0.01),auto=True)`` names the same row)."""
    known = list(methods(1e9, ranks))
    by_spelling = {_spelling(k): k for k in known}
    given = split_methods(text)
    unknown = [m for m in given if _spelling(m) not in by_spelling]
    if unknown:
        p.error(f"unknown methods {unknown}; known: {known}")
    names = list(dict.fromkeys(by_spelling[_spelling(m)] for m in given))
    if DDP in names:
        names.remove(DDP)
        names.insert(0, DDP)
    return names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_args(p)
    p.add_argument("--method", default="", help=argparse.SUPPRESS)
    p.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rates", default="100mbit,1gbit,none")
    p.add_argument("--methods", default="", help="comma-separated subset of the labels (plain DDP: DDP)")
    add_run_args(p, steps=5)
    p.add_argument("--out", default=str(RESULTS / "step_time.json"))
    p.add_argument(
        "--update", action="store_true", help="replace the measured (rate, method) rows in --out, keep the rest"
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        default=None,
        help="measure nothing: write the rows of these step_time.py results (a later file's row wins) to --out",
    )
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    if a.merge:
        rows = {}
        for path in a.merge:
            with open(path) as f:
                doc = json.load(f)
            if doc["ranks"] != a.ranks:
                p.error(f"{path} has {doc['ranks']} ranks, not --ranks {a.ranks}")
            rows.update({(r["rate"], r["method"]): r for r in doc["rows"]})
        return write(a, list(rows.values()), list(dict.fromkeys(rate for rate, _ in rows)))

    from benchmarks import netns as net

    why = net.check()
    if why:
        print(f"step_time.py: {why}", file=sys.stderr)
        return 2
    names = parse_methods(p, a.methods, a.ranks) if a.methods else list(methods(1e9, a.ranks))
    rates = a.rates.split(",")
    for r in rates:
        if r not in RATES:
            print(f"unknown rate {r!r}; choose from {list(RATES)}", file=sys.stderr)
            return 2
    rows = []
    net.up(a.ranks)
    try:
        for rate in rates:
            net.set_rate(a.ranks, None if rate == "none" else rate)
            bps = RATES[rate]
            for i, m in enumerate(names):
                r = run_method(net, a.ranks, m, a, rate, calibrate=(bps is None and i == 0), bps=bps)
                if bps is None:
                    bps = r["calibrated_bps"]
                pred = model_time(r, a.ranks, bps)
                row = {
                    "rate": rate,
                    "bps": bps,
                    "steps": a.steps,
                    **r,
                    "model": pred,
                    "model_error": pred["total"] / r["step_s"] - 1,
                    "model_error_rank0_compute": pred["total_rank0_compute"] / r["step_s"] - 1,
                }
                rows.append(row)
                print(
                    f"{rate:>8} {m:<12} step {r['step_s']:8.3f}s  model {pred['total']:8.3f}s "
                    f"(compute {pred['compute']:.3f} codec {pred['codec']:.3f} wire {pred['wire']:.3f} "
                    f"latency {pred['latency']:.3f})  "
                    f"err {100 * row['model_error']:+6.1f}% (rank 0's compute: "
                    f"{100 * row['model_error_rank0_compute']:+6.1f}%)  sent {r['bytes_sent_per_step'] / 1e6:9.3f} MB  "
                    f"cpu: step {r['step_cpu_s']:.3f} compute {r['compute_cpu_s']:.3f} "
                    f"codec {r['codec_cpu_seconds_per_step']:.3f}",
                    flush=True,
                )
    finally:
        net.down()
    return write(a, rows, rates)


def write(a, rows: list, rates: list) -> int:
    """Write ``rows`` (merged into --out's with --update) with their speed-ups to --out and its plot."""
    from gradzip.machine import machine

    if a.update and os.path.exists(a.out):
        with open(a.out) as f:
            old = json.load(f)["rows"]
        fresh = {(r["rate"], r["method"]) for r in rows}
        rows = [r for r in old if (r["rate"], r["method"]) not in fresh] + rows
        rates = list(dict.fromkeys(r["rate"] for r in rows))
        order = {m: i for i, m in enumerate(methods(1e9, a.ranks))}
        rows.sort(key=lambda r: (rates.index(r["rate"]), order.get(r["method"], 99)))
    for rate in rates:
        base = next((r["step_s"] for r in rows if r["rate"] == rate and r["method"] == DDP), None)
        for r in rows:
            if r["rate"] == rate and base:
                r["speedup_vs_allreduce"] = base / r["step_s"]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    doc = {
        "machine": machine(),
        "ranks": a.ranks,
        "width": a.width,
        "depth": a.depth,
        "batch": a.batch,
        "steps": sorted({r.get("steps", a.steps) for r in rows}),
        "warmup": a.warmup,
        "gradient_as_bucket_view": a.bucket_view,
        "rows": rows,
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
    plot(doc, a.out.replace(".json", ".png"))
    print(f"wrote {a.out}")
    return 0


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in doc["rows"]))
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 5.5), squeeze=False)  # room for the labels
    for ax, rate in zip(axes[0], rates):
        rows = [r for r in doc["rows"] if r["rate"] == rate]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["step_s"] for r in rows], width=0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [r["model"]["total"] for r in rows], width=0.4, label="model")
        ax.set_xticks(list(xs), [r["method"] for r in rows], rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_title(f"{doc['ranks']} ranks, link {rate}")
        ax.set_ylabel("step time (s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
