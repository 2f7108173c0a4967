"""Rows over seeds (:func:`aggregate`), the console table, and the result files of
``gradzip bench``: results.json, results.csv, pareto.png."""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import statistics
import sys
from dataclasses import asdict

from ..machine import machine
from .config import BenchConfig
from .plot import plot_pareto

#: The version of results.json's layout (2: rows aggregated over seeds, ``per_seed`` runs;
#: the language model's rows carry ``val_loss`` where the image tasks' carry ``accuracy``).
SCHEMA = 2
#: The figure of merit of each kind of task, and whether higher is better.
METRICS = {"accuracy": True, "val_loss": False}


def spread(values) -> dict:
    """``{"mean", "std", "min", "max", "n"}`` of ``values``; ``std`` is the sample standard
    deviation (n - 1), None for a single value."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("spread of no values")
    return {
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else None,
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


def aggregate(runs: list[dict], baseline: str = "Identity", metric: str = "accuracy") -> list[dict]:
    """One row per method (in order of first appearance) from per-(method, seed) runs.

    A run is ``{"method", "seed", metric, "ratio", ...}`` as :func:`~gradzip.bench.train.train_one`
    returns it; ``metric`` is ``accuracy`` (image tasks, also ``accuracy_last3``) or ``val_loss``
    (the language model, also ``bits_per_byte``). ``delta_*`` compare each seed with
    ``baseline``'s run on the same seed (a method must have run on every seed the baseline ran
    on, and only those); for the language model ``gap_pct`` is the mean over seeds of
    ``100 * (loss - baseline loss) / baseline loss``. Byte ratios are over all the method's
    runs: total baseline bytes / total bytes sent.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
    by_method: dict[str, dict[int, dict]] = {}
    for r in runs:
        seeds = by_method.setdefault(r["method"], {})
        if r["seed"] in seeds:
            raise ValueError(f"{r['method']!r} ran twice with seed {r['seed']}")
        seeds[r["seed"]] = r
    base = by_method.get(baseline)
    rows = []
    for label, seeds in by_method.items():
        order = sorted(seeds)
        rs = [seeds[s] for s in order]
        if base is not None and set(order) != set(base):
            raise ValueError(f"{label!r} ran on seeds {order}, the baseline on {sorted(base)}")
        steps = sum(r["steps"] for r in rs)

        def tot(key):  # bytes over the runs
            return sum(r[key] * r["steps"] for r in rs)

        link, sent = tot("bytes_link_per_step"), tot("bytes_sent_per_step")
        row = {
            "method": label,
            "config": rs[0].get("config", ""),
            "seeds": order,
            "n_seeds": len(order),
            "ratio": tot("bytes_link_raw_per_step") / link if link else 1.0,
            "ratio_handed": tot("bytes_raw_per_step") / sent if sent else 1.0,
            "bytes_link_per_step": link / steps,
            "bytes_sent_per_step": sent / steps,
            "bytes_raw_per_step": tot("bytes_raw_per_step") / steps,
        }
        m = spread(r[metric] for r in rs)
        row.update({metric: m["mean"], f"{metric}_std": m["std"], f"{metric}_min": m["min"], f"{metric}_max": m["max"]})
        if metric == "accuracy":
            last3 = spread(r.get("accuracy_last3", r["accuracy"]) for r in rs)
            row.update(accuracy_last3=last3["mean"], accuracy_last3_std=last3["std"])
        else:
            row["bits_per_byte"] = m["mean"] / math.log(2)
            row["perplexity"] = math.exp(m["mean"])
        row["seconds_per_step"] = statistics.fmean(r["seconds_per_step"] for r in rs)
        row["steps"] = rs[0]["steps"]
        if base is not None:
            d = spread(seeds[s][metric] - base[s][metric] for s in order)
            row.update(
                {f"delta_{metric}": d["mean"], "delta_std": d["std"], "delta_min": d["min"], "delta_max": d["max"]}
            )
            if metric == "accuracy":
                d3 = spread(
                    seeds[s].get("accuracy_last3", seeds[s]["accuracy"])
                    - base[s].get("accuracy_last3", base[s]["accuracy"])
                    for s in order
                )
                row["delta_last3"] = d3["mean"]
            else:
                g = spread(100 * (seeds[s][metric] - base[s][metric]) / base[s][metric] for s in order)
                row.update(gap_pct=g["mean"], gap_pct_std=g["std"], gap_pct_min=g["min"], gap_pct_max=g["max"])
                eq = [ddp_equivalent_pct(seeds[s].get("curve"), base[s].get("curve")) for s in order]
                if all(e is not None for e in eq):
                    row["ddp_steps_pct"] = statistics.fmean(eq)
        row["per_seed"] = [{k: v for k, v in r.items() if k not in ("method", "config")} for r in rs]
        rows.append(row)
    return rows


def ddp_equivalent_pct(curve, base_curve, start: float = math.log(256)) -> float | None:
    """DDP-equivalent steps, in percent of the run: the step at which the baseline's curve
    (``[[step, loss], ...]`` on the fixed validation subset, from ``start`` at step 0: an untrained
    byte model's ``ln 256``) first reaches the method's last loss on that subset, linearly
    interpolated, over the run's steps. 100 or more: the method's last loss is at or below the
    baseline's (the baseline's last loss is where it ends). None without curves."""
    if not curve or not base_curve:
        return None
    total, target = curve[-1][0], curve[-1][1]
    prev_step, prev_loss = 0, start
    for step, loss in base_curve:
        if loss <= target:
            if prev_loss == loss:
                return 100.0 * step / total
            frac = (prev_loss - target) / (prev_loss - loss)
            return 100.0 * (prev_step + frac * (step - prev_step)) / total
        prev_step, prev_loss = step, loss
    return 100.0 * base_curve[-1][0] / total  # not reached: the baseline ends above the method


def _pp(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def format_table(rows: list[dict]) -> str:
    """Accuracies in %, Δ in percentage points against Identity on the same seeds; ``±`` the
    sample std over seeds, ``[..]`` the min..max (the language model's rows: :func:`format_lm_table`)."""
    if rows and "val_loss" in rows[0]:
        return format_lm_table(rows)
    w = max(12, *(len(r["method"]) + 2 for r in rows))
    n = max(r.get("n_seeds", 1) for r in rows)
    acc_h, d_h = f"test acc % ({n} seed{'s' if n > 1 else ''})", "Δ acc pp"
    head = (
        f"{'method':<{w}}{'link ratio':>11}{'handed':>9}{'link MB/step':>14}{acc_h:>29}{'last-3 ep':>11}"
        f"{d_h:>27}{'ms/step':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        acc, delta = f"{100 * r['accuracy']:.2f}", ""
        if "delta_accuracy" in r:
            delta = f"{100 * r['delta_accuracy']:+.2f}"
        if r.get("accuracy_std") is not None:  # a spread from 2 seeds or more
            acc += f"±{_pp(r['accuracy_std'])} [{_pp(r['accuracy_min'])}..{_pp(r['accuracy_max'])}]"
            if delta:
                delta += f"±{_pp(r['delta_std'])} [{100 * r['delta_min']:+.2f}..{100 * r['delta_max']:+.2f}]"
        lines.append(
            f"{r['method']:<{w}}{r['ratio']:>10.1f}×{r['ratio_handed']:>8.1f}×{r['bytes_link_per_step'] / 1e6:>14.4f}"
            f"{acc:>29}{100 * r['accuracy_last3']:>11.2f}{delta:>27}{1000 * r['seconds_per_step']:>9.2f}"
        )
    return "\n".join(lines)


CSV_FIELDS = [
    "method",
    "ratio",
    "ratio_handed",
    "bytes_link_per_step",
    "bytes_sent_per_step",
    "bytes_raw_per_step",
    "accuracy",
    "accuracy_std",
    "accuracy_min",
    "accuracy_max",
    "accuracy_last3",
    "delta_accuracy",
    "delta_std",
    "delta_min",
    "delta_max",
    "delta_last3",
    "seconds_per_step",
    "steps",
    "n_seeds",
    "config",
]
#: The language model's columns (its rows have no accuracy).
LM_CSV_FIELDS = [
    "method",
    "ratio",
    "ratio_handed",
    "bytes_link_per_step",
    "bytes_sent_per_step",
    "bytes_raw_per_step",
    "val_loss",
    "val_loss_std",
    "val_loss_min",
    "val_loss_max",
    "bits_per_byte",
    "perplexity",
    "delta_val_loss",
    "delta_std",
    "delta_min",
    "delta_max",
    "gap_pct",
    "gap_pct_std",
    "gap_pct_min",
    "gap_pct_max",
    "ddp_steps_pct",
    "seconds_per_step",
    "steps",
    "n_seeds",
    "config",
]

#: What each row's fields mean (written into results.json).
FIELDS_DOC = {
    "ratio": "link-byte ratio: plain DDP's ring-allreduce bytes on a rank's link over the same steps / bytes sent "
    "on the link (stats()['bytes_link']), over all seeds",
    "ratio_handed": "plain DDP's bytes handed to allreduce / bytes handed to torch.distributed (stats()['bytes_sent'])",
    "bytes_link_per_step": "bytes one rank sends on its link per step (mean over seeds)",
    "accuracy": "final test accuracy (fraction), mean over seeds; _std sample std (null for 1 seed), _min/_max",
    "accuracy_last3": "test accuracy at the end of each of the last 3 epochs, averaged, then mean over seeds",
    "delta_accuracy": "mean over seeds of (accuracy - the baseline's accuracy on the same seed); delta_std/min/max "
    "its spread; delta_last3 the same on accuracy_last3",
    "val_loss": "the language model: final validation loss in nats per byte over all the validation text, mean "
    "over seeds; bits_per_byte = val_loss / ln 2, perplexity = exp(val_loss)",
    "gap_pct": "the language model: mean over seeds of 100 * (val_loss - the baseline's on the same seed) / the "
    "baseline's; gap_pct_std/min/max its spread",
    "ddp_steps_pct": "the language model: DDP-equivalent steps, the step at which the baseline's validation curve "
    "reached the method's last loss on the curve's subset, in percent of the run's steps (interpolated; 100: at or "
    "below the baseline's last), mean over seeds",
    "per_seed": "each seed's run: accuracy or val_loss, curve (test accuracy after each epoch, or [step, validation "
    "loss on a fixed subset] pairs, the last on all of it), bytes, ratio, stats_ratio (the front end's own "
    "stats()['ratio'])",
}


def _csv_value(v):
    return "" if v is None else v


def format_lm_table(rows: list[dict]) -> str:
    """The language model's rows: validation loss in nats per byte (bits per byte beside it),
    the gap to Identity in percent of its loss on the same seeds; ``±`` the sample std over
    seeds, ``[..]`` the min..max."""
    w = max(12, *(len(r["method"]) + 2 for r in rows))
    n = max(r.get("n_seeds", 1) for r in rows)
    loss_h = f"val loss ({n} seed{'s' if n > 1 else ''})"
    head = (
        f"{'method':<{w}}{'link ratio':>11}{'handed':>9}{'link MB/step':>14}{loss_h:>32}{'bits/byte':>10}"
        f"{'gap %':>26}{'DDP steps':>10}{'ms/step':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        loss, gap = f"{r['val_loss']:.4f}", ""
        if "gap_pct" in r:
            gap = f"{r['gap_pct']:+.2f}"
        if r.get("val_loss_std") is not None:
            loss += f"±{r['val_loss_std']:.4f} [{r['val_loss_min']:.3f}..{r['val_loss_max']:.3f}]"
            if gap:
                gap += f"±{r['gap_pct_std']:.2f} [{r['gap_pct_min']:+.2f}..{r['gap_pct_max']:+.2f}]"
        eq = f"{r['ddp_steps_pct']:.0f}%" if "ddp_steps_pct" in r else ""
        lines.append(
            f"{r['method']:<{w}}{r['ratio']:>10.1f}×{r['ratio_handed']:>8.1f}×{r['bytes_link_per_step'] / 1e6:>14.4f}"
            f"{loss:>32}{r['bits_per_byte']:>10.4f}{gap:>26}{eq:>10}{1000 * r['seconds_per_step']:>9.2f}"
        )
    return "\n".join(lines)


def write_outputs(rows: list[dict], cfg: BenchConfig, out: str, command: str | None = None) -> dict[str, str]:
    """results.json, results.csv and pareto.png in ``out``; returns their paths. ``command``:
    the command line to record (default: this process's)."""
    os.makedirs(out, exist_ok=True)
    paths = {
        k: os.path.join(out, f) for k, f in (("json", "results.json"), ("csv", "results.csv"), ("plot", "pareto.png"))
    }
    config = {
        **asdict(cfg),
        "epochs": cfg.resolved_epochs(),
        "steps_per_epoch": cfg.steps_per_epoch(),
        "total_steps": cfg.total_steps(),
        "metric": cfg.metric,
    }
    if command is None:
        command = shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    doc = {
        "schema": SCHEMA,
        "command": command,
        "machine": machine(),
        "config": config,
        "fields": FIELDS_DOC,
        "rows": rows,
    }
    with open(paths["json"], "w") as f:
        json.dump(doc, f, indent=2, default=str)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=LM_CSV_FIELDS if cfg.is_lm else CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: _csv_value(v) for k, v in r.items()} for r in rows)
    plot_pareto(rows, cfg, paths["plot"])
    return paths
