"""What ``Adaptive`` measured and chose, and what its statistics and solves cost (one seed).

    python -m benchmarks.adaptive_profile --dataset mnist --workers 4 --seeds 0 --momentum-correction on --clip 2 \\
        --methods "Adaptive(TopK(0.01), menu=[...], period=50)" --out benchmarks/results/adaptive_profile_mnist.json

Takes ``gradzip bench``'s options (``gradzip bench --help``; the first seed of ``--seeds``) and
trains each method of ``--methods`` (each an ``Adaptive``) on the bench's task and ranks. Rank 0
records every choice its ``Adaptive`` made (``Adaptive.history``): per tensor and setting the
error ``||x - C(x)||^2`` and the bytes the ranks measured, the budget (the reference's total
error) and the values chosen, and ``Adaptive.timing``: the seconds of the statistics (the
measurement of every setting and the stores after the allreduce) and of the solves. From those
it reports the cost per choice and what it comes to at the default ``period`` (100 steps)
against the run's mean step time (rank 0's, evaluation left out); and the training's accuracy
and link ratio. Writes one JSON file (``--out``) and prints each choice's per-layer table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch.multiprocessing as mp

from benchmarks._common import RESULTS, command
from gradzip import bench, cli
from gradzip.machine import machine
from gradzip.protocols.adaptive import Adaptive

DEFAULT_PERIOD = 100


def _worker(rank: int, world: int, port: int, methods: dict, cfg, queue) -> None:
    bench.init_worker(rank, world, port, cfg.threads, cfg.timeout_s)
    try:
        for label, method in methods.items():
            res = bench.train_one(rank, world, method, cfg, bench.load_dataset(cfg.dataset, cfg.seed))
            if rank == 0:
                res.pop("params")
                a = method.method
                queue.put({"method": label, "result": res, "history": a.history, "timing": dict(a.timing)})
    except BaseException as exc:  # noqa: BLE001 - report, then let the parent fail
        queue.put({"error": repr(exc), "rank": rank})
        raise


def explain(choice: dict, values: list, reference) -> dict:
    """Why a choice saved what it saved: the tensor with the most bytes at the reference, its
    shares of the reference's bytes and error, the error it adds at the largest setting that
    sends at most half its bytes, and the error every other tensor holds at the reference (all
    they could give back, by being sent whole)."""
    j = values.index(reference)
    err, nb = choice["err"], choice["nbytes"]
    big = max(range(len(nb)), key=lambda t: nb[t][j])
    total_b = sum(r[j] for r in nb) or 1.0
    total_e = sum(r[j] for r in err) or 1.0
    half = [k for k in range(len(values)) if nb[big][k] <= nb[big][j] / 2]
    k = max(half, key=lambda k: nb[big][k]) if half else None
    return {
        "tensor": choice["names"][big],
        "bytes_share": nb[big][j] / total_b,
        "error_share": err[big][j] / total_e,
        "half": values[k] if k is not None else None,
        "half_adds": (err[big][k] - err[big][j]) if k is not None else None,
        "others_hold": total_e - err[big][j],
        "saved": 1.0 - choice["bytes"] / choice["reference_bytes"] if choice["reference_bytes"] else 0.0,
    }


def report(doc: dict) -> str:
    """The results page's tables of an ``adaptive_profile`` file: per run, one row per choice."""
    c = doc["config"]
    m = doc["machine"]
    out = [
        f"`{doc['command']}`",
        "",
        f"({c['dataset']}, {c['workers']} gloo ranks, {c['steps']} steps, {c['optimizer']} lr {c['lr']:g} momentum "
        f"{c['momentum']:g}, momentum correction {c['momentum_correction']}, clipping {c['clip']}; seed {c['seed']}; "
        f"machine: {m['cpu']}, {m['cores']} cores (shared with other jobs), torch {m['torch']}, {m['date']})",
    ]
    for run in doc["runs"]:
        ref = run["reference"]
        cost = run["cost"]
        at100 = cost["share_of_a_step_at_period"][str(DEFAULT_PERIOD)]
        out += [
            "",
            f"`{run['method']}`: {100 * run['accuracy']:.2f}%, link ratio {run['ratio']:.1f}x; statistics and solve "
            f"{1e3 * cost['seconds_per_choice']:.1f} ms a choice against {1e3 * cost['seconds_per_step']:.1f} ms a "
            f"step: {100 * at100:.2f}% of a step at period {DEFAULT_PERIOD}.",
            "",
            f"| step | error budget ({run['parameter']}={ref}'s) | bytes saved | largest tensor | its bytes / error "
            f"share | error it adds at half its bytes | error the others hold | settings chosen |",
            "|---:|---:|---:|---|---:|---:|---:|---|",
        ]
        for ch in run["choices"]:
            e = explain(ch, run["values"], ref)
            adds = "—" if e["half_adds"] is None else f"{e['half_adds']:.3g} ({run['parameter']}={e['half']})"
            chosen = ", ".join(f"{n}={v}" for n, v in zip(ch["names"], ch["values"]))
            out.append(
                f"| {ch['step']} | {ch['budget']:.4g} | {100 * e['saved']:.0f}% | {e['tensor']} | "
                f"{100 * e['bytes_share']:.0f}% / {100 * e['error_share']:.0f}% | {adds} | {e['others_hold']:.3g} | "
                f"{chosen} |"
            )
    return "\n".join(out)


def layer_table(choice: dict, values: list) -> list[str]:
    """One line per tensor: its error and bytes per setting, the reference's and the choice."""
    lines = [f"  {'tensor':<12}" + "".join(f" {str(v):>19}" for v in values) + "  chosen"]
    for name, errs, nbs, v in zip(choice["names"], choice["err"], choice["nbytes"], choice["values"]):
        cells = "".join(f" {e:>10.3g} {b:>7.0f}B" for e, b in zip(errs, nbs))
        lines.append(f"  {name:<12}{cells}  {v}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_bench_arguments(p)
    p.add_argument("--out", default=str(RESULTS / "adaptive_profile.json"), help="the JSON file to write")
    a = p.parse_args(argv)
    cfg = cli.config_from_args(a)
    cfg = replace(cfg, seeds=(cfg.seeds[0],), seed=cfg.seeds[0])
    methods = bench.parse_methods(a.methods)
    methods.pop("Identity")
    for label, m in methods.items():
        if not isinstance(m.method, Adaptive):
            raise SystemExit(f"adaptive_profile: {label} is not an Adaptive method")
    bench.check_methods(methods, cfg)
    ctx = bench.process_context()
    queue = ctx.Queue()
    port = bench.free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg.workers, port, methods, cfg, queue)) for r in range(cfg.workers)]
    for proc in procs:
        proc.start()
    runs = []
    try:
        while len(runs) < len(methods):
            got = queue.get(timeout=cfg.timeout_s * 4)
            if "error" in got:
                raise RuntimeError(f"rank {got['rank']} failed: {got['error']}")
            runs.append(got)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    out_runs = []
    for run in runs:
        m = methods[run["method"]].method
        res, t, hist = run["result"], run["timing"], run["history"]
        step_s = res["seconds_per_step"]
        per_choice = (t["stats_s"] + t["solve_s"]) / max(t["solves"], 1)
        print(
            f"\n{run['method']}: {len(hist)} choices, accuracy {100 * res['accuracy']:.2f}%, "
            f"link ratio {res['ratio']:.1f}x"
        )
        for c in hist:
            share = c["bytes"] / c["reference_bytes"] if c["reference_bytes"] else 1.0
            print(
                f" step {c['step']} (statistics of step {c['from']}, {c['how']}"
                f"{', critical' if c['critical'] else ''}): "
                f"{c['bytes']:,.0f} B against the reference's {c['reference_bytes']:,.0f} B ({share:.2f}), "
                f"error {c['error']:.4g} within {c['budget']:.4g}"
            )
            for line in layer_table(c, m.values):
                print(line)
            e = explain(c, m.values, m.reference_value)
            if e["half"] is not None:
                print(
                    f"  {e['tensor']}: {100 * e['bytes_share']:.0f}% of the reference's bytes, "
                    f"{100 * e['error_share']:.0f}% of its error; at {m.param}={e['half']} (half its bytes or less) it "
                    f"adds {e['half_adds']:.4g}, the other tensors hold {e['others_hold']:.4g} in all"
                )
        cost = {
            "stats_s": t["stats_s"],
            "solve_s": t["solve_s"],
            "solves": t["solves"],
            "stats_calls": t["stats_calls"],
            "seconds_per_choice": per_choice,
            "seconds_per_step": step_s,
            "share_of_a_step_at_period": {
                str(m.period): per_choice / (m.period * step_s),
                str(DEFAULT_PERIOD): per_choice / (DEFAULT_PERIOD * step_s),
            },
        }
        print(
            f" cost: {1e3 * per_choice:.1f} ms a choice (statistics {1e3 * t['stats_s'] / max(t['solves'], 1):.1f} ms, "
            f"solve {1e3 * t['solve_s'] / max(t['solves'], 1):.1f} ms), {1e3 * step_s:.1f} ms a step: "
            f"{100 * cost['share_of_a_step_at_period'][str(DEFAULT_PERIOD)]:.2f}% of a step at period {DEFAULT_PERIOD}"
        )
        out_runs.append(
            {
                "method": run["method"],
                "values": m.values,
                "parameter": m.param,
                "reference": m.reference_value,
                "accuracy": res["accuracy"],
                "ratio": res["ratio"],
                "steps": res["steps"],
                "bytes_link_per_step": res["bytes_link_per_step"],
                "cost": cost,
                "choices": hist,
            }
        )
    doc = {
        "command": command("adaptive_profile", argv),
        "machine": machine(),
        "config": {
            "dataset": cfg.dataset,
            "workers": cfg.workers,
            "epochs": cfg.resolved_epochs(),
            "steps": cfg.total_steps(),
            "optimizer": cfg.optimizer,
            "lr": cfg.lr,
            "momentum": cfg.momentum,
            "momentum_correction": cfg.momentum_correction,
            "clip": cfg.clip,
            "seed": cfg.seed,
        },
        "runs": out_runs,
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    mp.freeze_support()
    sys.exit(main())
