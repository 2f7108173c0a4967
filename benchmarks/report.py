"""Print the README's results tables (markdown) from the committed result files.

    python benchmarks/report.py

Reads benchmarks/results/accuracy_*.json and diloco_*.json (``gradzip bench`` results, any schema), step_time.json,
step_time_2ranks.json, plan_check.json, powersgd_cpu_gloo.json,
overhead_2ranks.json, overhead_4ranks.json and kernels_nvidia-h100-80gb-hbm3.json,
whichever exist; every number in the README's results section comes from here.
"""

from __future__ import annotations

import json
import os
import statistics

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _load(name: str):
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _machine(m: dict) -> str:
    extra = f", {m['gpu']}" if "gpu" in m else ""
    return f"{m['cpu']}, {m['cores']} cores{extra}, torch {m['torch']}, {m['date']}"


def _pm(r: dict, key: str, signed: bool = False) -> str:
    """``mean ± std [min..max]`` in percent (points) of ``r[key]``, ``r[key + "_std"]``, ..."""
    f = (lambda v: f"{100 * v:+.2f}") if signed else (lambda v: f"{100 * v:.2f}")  # noqa: E731
    std = r.get(f"{key}_std")
    if std is None:  # one seed: no spread
        return f(r[key])
    return f"{f(r[key])} ± {100 * std:.2f} [{f(r[f'{key}_min'])}..{f(r[f'{key}_max'])}]"


def accuracy(doc: dict) -> str:
    """The table of ``gradzip bench`` / ``benchmarks/accuracy.py``: results.json, schema 2
    (per-method rows aggregated over seeds), or the first one-seed layout."""
    if doc.get("schema", 1) < 2:
        return _accuracy_v1(doc)
    cfg = doc["config"]
    n = len(cfg["seeds"])
    lines = [
        f"`{doc['command']}`" if doc.get("command") else "`gradzip bench`",
        "",
        f"({cfg['dataset']}, {cfg['workers']} {'nccl' if cfg['device'] == 'cuda' else 'gloo'} ranks, {cfg['epochs']} "
        f"epochs of {cfg['steps_per_epoch']} steps, batch {cfg['batch_size']}/rank, {cfg['optimizer']} lr {cfg['lr']:g} "
        f"momentum {cfg['momentum']:g} weight decay {cfg['weight_decay']:g}, {cfg['lr_schedule']} schedule"
        f"{', warm-up ' + format(cfg['warmup_epochs'], 'g') + ' epochs' if cfg.get('warmup_epochs') else ''}"
        f"{', local clipping ' + format(cfg['clip'], 'g') if cfg.get('clip') is not None else ''}"
        f"{', Adam moments per rank before compression (--precondition)' if cfg.get('precondition') else ''}; "
        f"seeds {', '.join(map(str, cfg['seeds']))}; machine: {_machine(doc['machine'])})",
        "",
        f"Link ratio: plain DDP's ring-allreduce bytes on a rank's link / gradzip's (`stats()[\"ratio\"]`); "
        f"handed: the same over bytes handed to `torch.distributed`. Accuracy: final test accuracy (%), mean ± "
        f"sample std [min..max] over {n} seed{'s' if n > 1 else ''}; last 3: the mean of the test accuracies after "
        f"each of the last 3 epochs; Δ: against Identity on the same seed, in points.",
        "",
        "| method | link ratio | handed ratio | link MB/step | test acc (%) | last 3 (%) | Δ acc (pp) | ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        delta = _pm({**r, "delta": r["delta_accuracy"]}, "delta", signed=True) if "delta_accuracy" in r else ""
        lines.append(
            f"| {r['method']} | {r['ratio']:.1f}× | {r['ratio_handed']:.1f}× | {r['bytes_link_per_step'] / 1e6:.4f} "
            f"| {_pm(r, 'accuracy')} | {100 * r['accuracy_last3']:.2f} | {delta} | {1000 * r['seconds_per_step']:.1f} |"
        )
    if n >= PER_SEED_FROM:
        lines += ["", *_per_seed_deltas(doc)]
    return "\n".join(lines)


#: From this many seeds on, an accuracy table is followed by each seed's Δ and their median.
PER_SEED_FROM = 5


def _per_seed_deltas(doc: dict) -> list[str]:
    """Each method's Δ against Identity seed by seed, with the median and the count below
    zero: one seed where the baseline itself lands low moves a mean of few seeds a lot."""
    rows = doc["rows"]
    base = next((r for r in rows if r["method"] == "Identity"), None)
    if base is None:
        return []
    ref = {s["seed"]: s["accuracy"] for s in base["per_seed"]}
    seeds = sorted(ref)
    out = [
        "| method | " + " | ".join(f"Δ seed {s}" for s in seeds) + " | median Δ | seeds below Identity |",
        "|---|" + "---:|" * (len(seeds) + 2),
    ]
    for r in rows:
        if r is base:
            continue
        got = {s["seed"]: 100 * (s["accuracy"] - ref[s["seed"]]) for s in r["per_seed"] if s["seed"] in ref}
        ds = [got[s] for s in seeds if s in got]
        out.append(
            f"| {r['method']} | "
            + " | ".join(f"{got[s]:+.1f}" if s in got else "" for s in seeds)
            + f" | {statistics.median(ds):+.2f} | {sum(d < 0 for d in ds)} of {len(ds)} |"
        )
    return out


def _accuracy_v1(doc: dict) -> str:
    cfg = doc["config"]
    lines = [
        f"`gradzip bench` ({cfg['dataset']}, {cfg['workers']} gloo ranks, "
        f"{cfg.get('epochs') or {'mnist': 4, 'digits': 20}[cfg['dataset']]} epochs, batch {cfg['batch_size']}/rank, "
        f"SGD lr {cfg['lr']} momentum {cfg['momentum']}; "
        f"machine: {_machine(doc['machine'])})",
        "",
        "| method | ratio | wire MB/step | test acc | Δ acc (pp) | ms/step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['method']} | {r['ratio']:.1f}× | {r['bytes_sent_per_step'] / 1e6:.4f} | {100 * r['accuracy']:.2f}% "
            f"| {100 * r['delta_accuracy']:+.2f} | {1000 * r['seconds_per_step']:.1f} |"
        )
    return "\n".join(lines)


def step_time(doc: dict) -> str:
    lines = [
        f"`benchmarks/step_time.py` ({doc['ranks']} ranks in network namespaces, MLP of "
        f"{doc['rows'][0]['params'] / 1e6:.1f}M parameters, batch {doc['batch']}/rank, median of {'/'.join(map(str, doc['steps'])) if isinstance(doc['steps'], list) else doc['steps']} steps"
        f"{' after ' + str(doc['warmup']) + ' warm-up' if 'warmup' in doc else ''}"
        f"{', DDP gradient_as_bucket_view' if doc.get('gradient_as_bucket_view') else ''}; "
        f"machine: {_machine(doc['machine'])})",
        "",
        "| link | method | step (s) | model (s) | model error | MB sent/step/rank | speed-up vs allreduce "
        "| CPU s/step: step / compute / codec |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        cpu = (
            f"{r['step_cpu_s']:.3f} / {r['compute_cpu_s']:.3f} / {r['codec_cpu_seconds_per_step']:.3f}"
            if "step_cpu_s" in r
            else ""
        )
        lines.append(
            f"| {r['rate']} | {r['method']} | {r['step_s']:.3f} | {r['model']['total']:.3f} | {100 * r['model_error']:+.1f}% "
            f"| {r['bytes_sent_per_step'] / 1e6:.3f} | {r.get('speedup_vs_allreduce', float('nan')):.2f}× | {cpu} |"
        )
    return "\n".join(lines)


def plan_check(doc: dict) -> str:
    lines = [
        f"`benchmarks/plan_check.py` (the `gradzip plan` cost model with codec throughputs profiled here, one "
        f"thread; codec scaled by max(1, ranks / {doc['cores']} cores); machine: {_machine(doc['machine'])})",
        "",
        "| ranks | link | method | measured (s) | plan (s) | plan error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['ranks']} | {r['rate']} | {r['method']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} "
            f"| {100 * r['error']:+.1f}% |"
        )
    lines.append("")
    for world, s in doc["summary"].items():
        lines.append(
            f"N={world}: median |error| {100 * s['median_abs_error']:.1f}%, max {100 * s['max_abs_error']:.1f}%, "
            f"{s['within_15pct']} of {s['rows']} rows within 15%."
        )
    return "\n".join(lines)


def powersgd(doc: dict) -> str:
    lines = [
        f"`benchmarks/powersgd_step.py` (2 gloo ranks, rank {doc['config'].get('rank', 2)}, one bucket, methods "
        f"alternating in one run; machine: {_machine(doc['machine'])})",
        "",
        "| width (params) | plain DDP ms | torch powerSGD_hook ms | gradzip PowerSGD ms | gradzip / torch |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['width']} ({r['params']:,}) | {r['ddp']['median_ms']:.2f} | {r['torch_powersgd']['median_ms']:.2f} "
            f"| {r['gradzip_powersgd']['median_ms']:.2f} | {r['ratio_gradzip_over_torch']:.3f} |"
        )
    return "\n".join(lines)


def overhead(doc: dict) -> str:
    """Hook overhead against plain DDP, step by step in pairs (benchmarks/overhead.py)."""
    lines = [
        f"`sudo python benchmarks/overhead.py --ranks {doc['ranks']} --steps {doc['cycles']}` "
        f"({doc['ranks']} ranks, link {doc['rate']}, {doc['cycles']} cycles of one step per model in random order "
        f"after {doc['warmup']} warm-up, MLP width {doc['width']}; machine: {_machine(doc['machine'])})",
        "",
        "| method | median step (s) | vs plain DDP in the same cycle, median | 95% interval |",
        "|---|---:|---:|---:|",
        f"| plain DDP | {statistics.median(doc['allreduce_step_s']):.3f} | | |",
    ]
    for r in doc["rows"]:
        lo, hi = r["ci95"]
        lines.append(
            f"| {r['method']} | {r['step_s_median']:.3f} | {100 * (r['median_ratio'] - 1):+.1f}% "
            f"| {100 * (lo - 1):+.1f}% .. {100 * (hi - 1):+.1f}% |"
        )
    return "\n".join(lines)


def kernels(doc: dict) -> str:
    """The GPU kernel benchmark at its largest size: time, GB/s over minimal bytes, share of copy."""
    n = max(r["n"] for r in doc["results"])
    lines = [
        f"`python benchmarks/kernels.py` on {doc['device']} (torch {doc['torch']}, triton {doc['triton']}, "
        f"cupy {doc['cupy']}; {doc['date'][:10]}); copy bandwidth {doc['copy_bandwidth_gbps']:.0f} GB/s "
        f"(read + write); n = {n:,} float32 elements, GB/s over the minimal bytes of each op",
        "",
        "| kernel | backend | route | ms | GB/s | % of copy | × torch eager |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in doc["results"]:
        if r["n"] != n:
            continue
        lines.append(
            f"| {r['kernel']} | {r['backend']} | {r.get('route', '')} | {r['kernel_ms']:.3f} | {r['gbps']:.0f} "
            f"| {100 * r['fraction_of_copy']:.1f}% | {r['speedup_vs_reference']:.1f} |"
        )
    lines += [
        "",
        "Goals (issue 5): "
        + ", ".join(f"{k} {'met' if v else 'not met'}" for k, v in doc["goals"].items() if v is not None),
    ]
    return "\n".join(lines)


def hierarchy(doc: dict) -> str:
    """benchmarks/hierarchy.py: step time per method on 2 emulated nodes of 2 ranks, beside the cost model."""
    lines = [
        f"`{doc['command']}` ({doc['world']} ranks as {doc['world'] // doc['local_size']} nodes of "
        f"{doc['local_size']}, inter-node link {doc['rate']}, MLP width {doc['width']} depth {doc['depth']}, batch "
        f"{doc['batch']}/rank, median of {doc['steps']} steps after {doc['warmup']}; machine: {_machine(doc['machine'])})",
        "",
        "| method | step (s) | model (s) | model error | compute (s) | codec (s) | wire (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        m = r["model"]
        lines.append(
            f"| {r['method']} | {r['step_s']:.3f} | {m['total']:.3f} | {100 * r['model_error']:+.1f}% "
            f"| {r['compute_s']:.3f} | {m['codec']:.3f} | {m['wire']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    accuracy_files = (
        sorted(f for f in os.listdir(HERE) if f.startswith(("accuracy_", "diloco_")) and f.endswith(".json"))
        if os.path.isdir(HERE)
        else []
    )
    for name, fn in (
        *((f, accuracy) for f in accuracy_files),
        ("hierarchy.json", hierarchy),
        ("step_time.json", step_time),
        ("step_time_2ranks.json", step_time),
        ("plan_check.json", plan_check),
        ("powersgd_cpu_gloo.json", powersgd),
        ("overhead_2ranks.json", overhead),
        ("overhead_4ranks.json", overhead),
        ("kernels_nvidia-h100-80gb-hbm3.json", kernels),
    ):
        doc = _load(name)
        if doc is not None:
            print(fn(doc))
            print()


if __name__ == "__main__":
    main()
