"""Validate ``gradzip plan`` against measured step times.

    python -m benchmarks.plan_check benchmarks/results/step_time.json benchmarks/results/step_time_2ranks.json

For every (rate, method) row of each ``benchmarks/step_time.py`` result, the plan's
cost model (:func:`gradzip.costmodel.step_cost`, the function behind ``gradzip plan``)
predicts the step from what a user would give it: the model's layer shapes, the
measured compute time of the row, the link (the row's bandwidth and step_time's
per-message latency) and the world size, with codec throughputs profiled on this
machine by :class:`gradzip.costmodel.CodecProfile` (one thread, one process). It
prints the predicted and measured step and the error, and writes
``benchmarks/results/plan_check.json``.

Oversubscription: ``step_time.py`` runs N ranks on this machine's cores. With more
ranks than cores each rank's codec runs at ``cores / N`` of the profiled speed; the
plan knows nothing of that. ``--cpu-share auto`` (the default) scales the profiled
codec seconds by ``max(1, N / cores)`` and reports it; ``--cpu-share 1`` reports the
plain plan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks._common import RESULTS


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="step_time.py JSON files")
    p.add_argument("--cpu-share", default="auto", help="'auto' (max(1, ranks / cores)) or a number")
    p.add_argument("--cores", type=int, default=os.cpu_count())
    p.add_argument(
        "--repeats", type=int, default=5, help="profile: fastest of this many timings (measure_codec's default)"
    )
    p.add_argument(
        "--sizes",
        type=int,
        nargs=2,
        default=(4096, 1 << 24),
        metavar=("N0", "N1"),
        help="profile: the two tensor sizes each codec's line is fitted through (default: 4096 and the largest "
        "tensor of step_time.py's model, 16M; gradzip plan's --profile-sizes)",
    )
    p.add_argument("--out", default=str(RESULTS / "plan_check.json"))
    a = p.parse_args()

    import torch

    from benchmarks.step_time import LATENCY_S, build_model, methods
    from gradzip.costmodel import CodecProfile, Link, step_cost
    from gradzip.machine import machine

    torch.set_num_threads(1)
    profile = CodecProfile(repeats=a.repeats, threads=1, sizes=tuple(a.sizes))
    out_rows = []
    for path in a.results:
        with open(path) as f:
            doc = json.load(f)
        world = doc["ranks"]
        model = build_model(doc["width"], doc["depth"])
        layers = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        share = max(1.0, world / a.cores) if a.cpu_share == "auto" else float(a.cpu_share)
        for r in doc["rows"]:
            link = Link(r["bps"], LATENCY_S)
            comp = methods(r["bps"], world)[r["method"]]
            if comp is not None and hasattr(comp, "profile") and callable(comp.profile):
                comp._profile, comp._profile_given = profile, True  # Policy(auto=True): cost with the same profile
            # the compute the step waited for (the slowest rank's; rank 0's in rows that predate it)
            sc = step_cost(comp, layers, world, link, r.get("compute_slowest_s", r["compute_s"]), profile)
            pred = sc.compute_s + share * sc.codec_s + sc.wire_s
            row = {
                "ranks": world,
                "rate": r["rate"],
                "method": r["method"],
                "measured_s": r["step_s"],
                "compute_s": sc.compute_s,
                "codec_s": sc.codec_s,
                "cpu_share": share,
                "wire_s": sc.wire_s,
                "predicted_s": pred,
                "error": pred / r["step_s"] - 1,
            }
            out_rows.append(row)
            print(
                f"N={world} {r['rate']:>8} {r['method']:<13} measured {r['step_s']:7.3f}s  plan {pred:7.3f}s "
                f"(compute {sc.compute_s:.3f} + {share:g} x codec {sc.codec_s:.3f} + wire {sc.wire_s:.3f})  "
                f"err {100 * row['error']:+6.1f}%",
                flush=True,
            )
    summary = {}
    for world in sorted({r["ranks"] for r in out_rows}):
        errs = [abs(r["error"]) for r in out_rows if r["ranks"] == world]
        summary[str(world)] = {
            "rows": len(errs),
            "median_abs_error": statistics.median(errs),
            "max_abs_error": max(errs),
            "within_15pct": sum(e <= 0.15 for e in errs),
        }
        s = summary[str(world)]
        print(
            f"N={world}: median |error| {100 * s['median_abs_error']:.1f}%, max {100 * s['max_abs_error']:.1f}%, "
            f"{s['within_15pct']}/{s['rows']} rows within 15%"
        )
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(
            {
                "machine": machine(),
                "sources": a.results,
                "cores": a.cores,
                "cpu_share": a.cpu_share,
                "profile": profile.to_dict(),
                "summary": summary,
                "rows": out_rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
