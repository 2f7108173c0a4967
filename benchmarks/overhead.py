"""Hook overhead against plain DDP, with its run-to-run spread (needs root, as step_time.py).

    sudo python benchmarks/overhead.py --ranks 4 --rounds 3

step_time.py times each method once (a median over ``--steps`` steps). On a small, shared
machine, two runs of the *same* method differ by several percent, which is the size of the
"<= 5% slower than DDP" goal. This script runs the methods in interleaved rounds on one link
(default: unshaped), with the same runner as step_time.py. For each method and round it
records the step time. It compares each with plain DDP's in the same round, and reports
the median, smallest and largest of those ratios. For plain DDP ("allreduce") it reports the
spread of its own rounds, which is the noise floor for the others.

Writes ``--out`` (default ``benchmarks/results/overhead_<ranks>ranks.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import step_time as st  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="none", choices=list(st.RATES))
    p.add_argument("--methods", default="allreduce,Identity,Policy(auto,TopK),Policy(auto)")
    p.add_argument("--rounds", type=int, default=3)
    st.add_run_args(p, steps=20)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    names = st.parse_methods(p, a.methods, a.ranks)
    if names[0] != "allreduce":
        p.error("--methods must include allreduce: the others are compared with it")

    import netns as net

    why = net.check()
    if why:
        print(f"overhead.py: {why}", file=sys.stderr)
        return 2
    times: dict[str, list[float]] = {m: [] for m in names}
    bps = st.RATES[a.rate]
    net.up(a.ranks)
    try:
        net.set_rate(a.ranks, None if a.rate == "none" else a.rate)
        for k in range(a.rounds):
            for m in names:
                r = st.run_method(net, a.ranks, m, a, a.rate, calibrate=(bps is None and m == "allreduce"), bps=bps)
                if bps is None:
                    bps = r["calibrated_bps"]
                times[m].append(r["step_s"])
                print(f"round {k + 1} {m:<18} step {r['step_s']:.3f}s", flush=True)
    finally:
        net.down()
    from gradzip.bench import machine

    base = times["allreduce"]
    rows = []
    for m in names:
        ratios = [t / b for t, b in zip(times[m], base)] if m != "allreduce" else [t / statistics.median(base) for t in base]
        rows.append({"method": m, "step_s": times[m], "ratio_to_ddp": ratios, "median_ratio": statistics.median(ratios),
                     "min_ratio": min(ratios), "max_ratio": max(ratios)})
        print(f"{m:<18} vs DDP: median {100 * (statistics.median(ratios) - 1):+5.1f}%  "
              f"range {100 * (min(ratios) - 1):+5.1f}% .. {100 * (max(ratios) - 1):+5.1f}%")
    doc = {"machine": machine(), "ranks": a.ranks, "rate": a.rate, "bps": bps, "rounds": a.rounds, "steps": a.steps,
           "warmup": a.warmup, "width": a.width, "depth": a.depth, "batch": a.batch, "gradient_as_bucket_view": a.bucket_view,
           "note": "allreduce's ratios are its rounds over their own median: the noise floor", "rows": rows}
    out = a.out or os.path.join(HERE, "results", f"overhead_{a.ranks}ranks.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
