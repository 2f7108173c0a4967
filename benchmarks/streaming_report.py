"""Print the markdown tables of a benchmarks/streaming.py result.

    python -m benchmarks.streaming_report [benchmarks/results/streaming_p32.json]

``benchmarks/report.py`` puts them on docs/results.md.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _ms(v: float) -> str:
    return f"{1e3 * v:.0f}"


def _mb(v: float) -> str:
    return f"{v / 1e6:.3f}"


def report(doc: dict, cpu: bool = True) -> str:
    """The run's tables; ``cpu=False`` leaves out where the CPU went (the results page does)."""
    c, rows, t = doc["config"], doc["rows"], doc["targets"]
    m = doc["machine"]
    lines = [
        f"{doc['params'] / 1e6:.1f}M-parameter MLP (width {c['width']}, batch {c['batch']}, inner AdamW), "
        f"{c['ranks']} ranks, links shaped to {c['rate']}, compression {c['compression']}; "
        f"{rows['compute']['steps']} measured steps per method ({c['rounds']} rounds of {c['block']}, "
        f"interleaved, after a warm-up round). Machine: {m.get('name', '')} ({m['cpu']}, {m['cores']} cores), "
        f"torch {m['torch']}, {m['date']}.",
        f"Command: `{doc['command']}`",
        "",
        "| method | step median (ms) | step mean (ms) | p90 | max | mean vs compute | median vs compute "
        "| CPU/step (ms) | MB/step mean | MB/step peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = {
        "compute": "compute (inner AdamW alone, no communication)",
        "diloco": f"DiLoCo(period={c['period']}, compression={c['compression']})",
        "streaming": f"DiLoCo(period={c['period']}, compression={c['compression']}, fragments={c['fragments']}, "
        f"delay={c['delay']}, alpha={c['alpha']})",
    }
    for name, r in rows.items():
        label = labels[name]
        lines.append(
            f"| {label} | {_ms(r['step_median_s'])} | {_ms(r['step_mean_s'])} | {_ms(r['step_p90_s'])} "
            f"| {_ms(r['step_max_s'])} | {r['vs_compute_mean']:.3f} | {r['vs_compute_median']:.3f} "
            f"| {_ms(r['cpu_mean_s'])} | {_mb(r['bytes_per_step_mean'])} | {_mb(r['bytes_per_step_peak'])} |"
        )
    s = rows["streaming"]
    lines += [
        "",
        f"Peak per-step transfer, streaming / DiLoCo: **{t['peak_ratio']:.6f}** (target <= 1/F = "
        f"{t['peak_ratio_target']:.6f}: {'met' if t['peak_ok'] else 'not met'}; streaming's peak is "
        f"{t['peak_excess_bytes']:+.0f} B from DiLoCo's / F).",
        f"Streaming step time vs compute: mean **{t['step_vs_compute_mean']:.3f}**, median "
        f"**{t['step_vs_compute_median']:.3f}** (target <= 1.15: mean "
        f"{'met' if t['step_ok_mean'] else 'not met'}, median {'met' if t['step_ok_median'] else 'not met'}).",
    ]
    if "transfer_s" in s:
        lines += [
            "",
            "| streaming syncs | median | min | max |",
            "|---|---:|---:|---:|",
        ]
        for key, what in (
            ("transfer_s", "payload issued -> average arrived (ms)"),
            ("arrived_before_sync_s", "arrived before the sync step asked (ms)"),
            ("wait_s", "sync step waited for it (ms)"),
            ("outer_s", "outer step (ms)"),
            ("push_s", "push: delta, encode, first round (ms)"),
        ):
            v = s[key]
            lines.append(f"| {what} | {_ms(v['median'])} | {_ms(v['min'])} | {_ms(v['max'])} |")
        lines.append(
            f"\n{s['syncs']} fragment syncs; payload issued {s['issued_steps_after_push']} step(s) after the push, "
            f"synced {s['sync_steps_after_push']} steps after it. CPU busy on the whole machine during the blocks: "
            + ", ".join(f"{n} {100 * r['machine_busy']:.0f}%" for n, r in rows.items())
            + "; load average "
            + ", ".join(f"{n} {r['loadavg']:.1f}" for n, r in rows.items())
            + "."
        )
    if not cpu:
        return "\n".join(lines)
    comp = rows["compute"]
    lines += [
        "",
        "Where the CPU went, ms per step (rank 0; process CPU time covers every thread: the training "
        "loop's and gloo's, where the payloads are sent, received and decoded):",
        "",
        "| method | CPU/step | over compute | the loop's thread over compute | other threads over compute "
        "| gradzip codec CPU (any thread) | outer step (wall) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        if name == "compute":
            lines.append(f"| compute | {_ms(r['cpu_mean_s'])} | | | | | |")
            continue
        extra = r["cpu_mean_s"] - comp["cpu_mean_s"]
        main, others = "", ""
        if "main_thread_cpu_mean_s" in r:  # results before the loop's thread was timed on its own lack it
            d_main = r["main_thread_cpu_mean_s"] - comp["main_thread_cpu_mean_s"]
            main, others = _ms(d_main), _ms(extra - d_main)
        lines.append(
            f"| {name} | {_ms(r['cpu_mean_s'])} | {_ms(extra)} ({100 * extra / comp['cpu_mean_s']:+.0f}%) "
            f"| {main} | {others} | {_ms(r.get('codec_cpu_s_per_step', 0.0))} "
            f"| {_ms(r.get('outer_s_per_step', 0.0))} |"
        )
    return "\n".join(lines)


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "streaming_p32.json")
    with open(path) as f:
        print(report(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
