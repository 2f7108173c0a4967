"""The results tables (markdown), from the committed files under ``benchmarks/results/``.

    python -m benchmarks.report --page docs/results.md   # write the results page
    python -m benchmarks.report --headline               # print the README's headline tables
    python -m benchmarks.report                          # print every table of the top-level results

The page is ``benchmarks/report_page.md`` with each ``{{ KIND FILE ... }}`` line replaced by
the table of that result file (``KIND`` names a renderer of :data:`RENDERERS`); every
number on it comes from a file under ``benchmarks/results/``. ``tests/benchmarks`` checks
that the committed ``docs/results.md`` is what this writes, and that the README's headline
tables are :func:`headline`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

from benchmarks import linkbytes_report, streaming_report
from benchmarks._common import RESULTS, ROOT

TEMPLATE = ROOT / "benchmarks" / "report_page.md"
#: Where the page's links to result files point from: the page lives in docs/.
LINK = "../benchmarks/results/"


def _load(name: str):
    path = RESULTS / name
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _machine(m: dict) -> str:
    extra = f", {m['gpu']}" if "gpu" in m else ""
    return f"{m['cpu']}, {m['cores']} cores{extra}, torch {m['torch']}, {m['date']}"


def _short_machine(m: dict) -> str:
    """``Intel Xeon, 2 cores`` from a ``machine()`` record."""
    cpu = re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b", "", m["cpu"])
    return f"{' '.join(cpu.split())}, {m['cores']} cores"


def _cmd(command: str) -> str:
    """A recorded command line in the form the scripts run in today: ``python -m benchmarks.X``
    for ``python benchmarks/X.py`` (the result files keep the form that was typed)."""
    return re.sub(r"(\S*python3?) benchmarks/(\w+)\.py\b", r"\1 -m benchmarks.\2", command).rstrip()


def _pm(r: dict, key: str, signed: bool = False) -> str:
    """``mean ± std [min..max]`` in percent (points) of ``r[key]``, ``r[key + "_std"]``, ..."""
    f = (lambda v: f"{100 * v:+.2f}") if signed else (lambda v: f"{100 * v:.2f}")
    std = r.get(f"{key}_std")
    if std is None:  # one seed: no spread
        return f(r[key])
    return f"{f(r[key])} ± {100 * std:.2f} [{f(r[f'{key}_min'])}..{f(r[f'{key}_max'])}]"


# -- accuracy runs (gradzip bench, benchmarks/accuracy.py) -----------------------------------------
def accuracy(doc: dict) -> str:
    """The table of ``gradzip bench`` / ``benchmarks/accuracy.py``: results.json, schema 2
    (per-method rows aggregated over seeds), or the first one-seed layout."""
    if doc.get("schema", 1) < 2:
        return _accuracy_v1(doc)
    cfg = doc["config"]
    n = len(cfg["seeds"])
    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    warmup = f", warm-up {cfg['warmup_epochs']:g} epochs" if cfg.get("warmup_epochs") else ""
    clip = f", local clipping {cfg['clip']:g}" if cfg.get("clip") is not None else ""
    pre = ", Adam moments per rank before compression (--precondition)" if cfg.get("precondition") else ""
    lines = [
        f"`{_cmd(doc['command'])}`" if doc.get("command") else "`gradzip bench`",
        "",
        f"({cfg['dataset']}, {cfg['workers']} {backend} ranks, {cfg['epochs']} epochs of {cfg['steps_per_epoch']} "
        f"steps, batch {cfg['batch_size']}/rank, {cfg['optimizer']} lr {cfg['lr']:g} momentum {cfg['momentum']:g} "
        f"weight decay {cfg['weight_decay']:g}, {cfg['lr_schedule']} schedule{warmup}{clip}{pre}; "
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


def lm(doc: dict) -> str:
    """The language model's table (``gradzip bench --dataset shakespeare``, ``--preset lm``):
    validation loss and its gap to Identity's on the same seeds, against the link ratio."""
    cfg = doc["config"]
    n = len(cfg["seeds"])
    clip = f", clipping {cfg['clip']:g} ({cfg['clip_mode']})" if cfg.get("clip") is not None else ", no clipping"
    lines = [
        f"`{_cmd(doc['command'])}`",
        "",
        f"({cfg['dataset']}, the {cfg['lm_size']} GPT, {cfg['workers']} gloo ranks, {cfg['total_steps']} steps, "
        f"batch {cfg['batch_size']}/rank, {cfg['optimizer']} lr {cfg['lr']:g} beta1 {cfg['momentum']:g} weight decay "
        f"{cfg['weight_decay']:g}, warm-up {cfg['warmup_steps']} steps then {cfg['lr_schedule']}{clip}; "
        f"seeds {', '.join(map(str, cfg['seeds']))}; machine: {_machine(doc['machine'])})",
        "",
        "Validation loss: nats per byte on the whole validation text after the last step, mean ± sample std "
        f"over {n} seed{'s' if n > 1 else ''}; gap: 100 × (loss − Identity's) / Identity's on the same seed, in "
        "percent, mean ± sample std [min..max]; link ratio: plain DDP's ring-allreduce bytes on a rank's link / "
        "gradzip's; ms/step: wall time on a shared machine, not a speed figure.",
        "",
        "| method | link ratio | link MB/step | val loss (nats/byte) | bits/byte | gap to DDP (%) | ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        loss = f"{r['val_loss']:.4f}"
        gap = f"{r['gap_pct']:+.2f}" if "gap_pct" in r else ""
        if r.get("val_loss_std") is not None:
            loss += f" ± {r['val_loss_std']:.4f}"
            if gap:
                gap += f" ± {r['gap_pct_std']:.2f} [{r['gap_pct_min']:+.2f}..{r['gap_pct_max']:+.2f}]"
        lines.append(
            f"| {r['method']} | {r['ratio']:.1f}× | {r['bytes_link_per_step'] / 1e6:.4f} | {loss} "
            f"| {r['bits_per_byte']:.4f} | {gap} | {1000 * r['seconds_per_step']:.1f} |"
        )
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
    epochs = cfg.get("epochs") or {"mnist": 4, "digits": 20}[cfg["dataset"]]
    lines = [
        f"`gradzip bench` ({cfg['dataset']}, {cfg['workers']} gloo ranks, {epochs} epochs, batch "
        f"{cfg['batch_size']}/rank, SGD lr {cfg['lr']} momentum {cfg['momentum']}; "
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


def _seed_means(doc: dict, seeds) -> dict:
    """Each method's mean Δ against Identity over ``seeds`` (points), from the per-seed rows."""
    rows = doc["rows"]
    ref = {s["seed"]: s["accuracy"] for s in next(r for r in rows if r["method"] == "Identity")["per_seed"]}
    out = {}
    for r in rows:
        ds = [100 * (s["accuracy"] - ref[s["seed"]]) for s in r["per_seed"] if s["seed"] in seeds]
        out[r["method"]] = statistics.mean(ds)
    return out


def _cell(doc: dict, method: str, first: tuple) -> str:
    """``309×, −0.24 pp (median −0.35; seeds 0–2 −0.53)`` for one method of a many-seed run."""
    r = next(r for r in doc["rows"] if r["method"] == method)
    ref = {s["seed"]: s["accuracy"] for s in next(x for x in doc["rows"] if x["method"] == "Identity")["per_seed"]}
    ds = [100 * (s["accuracy"] - ref[s["seed"]]) for s in r["per_seed"]]
    few = _seed_means(doc, first)[method]
    below = sum(d < 0 for d in ds)
    note = f"; {below} of {len(ds)} seeds below Identity" if below == len(ds) else ""
    return (
        f"{r['ratio']:.0f}×, {_pp(100 * r['delta_accuracy'])} (median {_pp(statistics.median(ds))}; "
        f"seeds {first[0]}–{first[-1]} {_pp(few)}{note})"
    )


def _pp(v: float) -> str:
    return f"{v:+.2f} pp".replace("-", "−")


_OPTIMIZERS = {"sgd": "SGD", "adamw": "AdamW"}


def verdicts(*names: str) -> str:
    """One row per compressing method of the many-seed runs ``names`` (one column each):
    link ratio, mean Δ against Identity, its median and the mean over the first three seeds."""
    docs = [_load(n) for n in names]
    methods = [r["method"] for r in docs[0]["rows"] if r["method"] != "Identity"]
    heads = []
    for d in docs:
        c = d["config"]
        extra = (f", `--clip {c['clip']:g}`" if c.get("clip") is not None else "") + (
            ", `--precondition`" if c.get("precondition") else ""
        )
        heads.append(f"{_OPTIMIZERS.get(c['optimizer'], c['optimizer'])}{extra}, {len(c['seeds'])} seeds")
    lines = [
        "| method | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(docs),
    ]
    for m in methods:
        lines.append(f"| `{m}` | " + " | ".join(_cell(d, m, (0, 1, 2)) for d in docs) + " |")
    lines += ["", "Result files: " + ", ".join(_link(n) for n in names) + "."]
    return "\n".join(lines)


# -- the README's headline ------------------------------------------------------------------------
#: The README's headline: the 8-seed accuracy runs with clipping (SGD, AdamW, AdamW preconditioned).
HEADLINE_RUNS = (
    "accuracy_mnist_4ranks_sgd_clip2_8seeds_cpu.json",
    "accuracy_mnist_4ranks_adamw_clip2_8seeds_cpu.json",
    "accuracy_mnist_4ranks_adamw_clip2_precondition_8seeds_cpu.json",
)


def headline() -> str:
    """The README's two short tables: the DDP hook's accuracy against link bytes (8 seeds), then
    one line per other front end. Every number is read here from the file named beside it."""
    sgd, adamw, pre = (_load(n) for n in HEADLINE_RUNS)

    def row(doc, method):
        return next(r for r in doc["rows"] if r["method"] == method)

    c = sgd["config"]
    lines = [
        f"The DDP hook on the bench's MNIST CNN, {c['workers']} gloo ranks, {c['epochs']} epochs, mean of "
        f"{len(c['seeds'])} seeds, local clipping {c['clip']:g}; Δ: test accuracy against uncompressed DDP "
        f"(Identity) on the same seed ({_short_machine(sgd['machine'])}; "
        + ", ".join(f"`{n}`" for n in HEADLINE_RUNS)
        + "):",
        "",
        "| method | link bytes, fewer than DDP (SGD / AdamW) | Δ, SGD momentum 0.9 | Δ, AdamW |",
        "|---|---:|---:|---:|",
    ]
    for r in sgd["rows"]:
        m = r["method"]
        if m == "Identity":
            continue
        a = row(adamw, m)
        ad = _pp(100 * a["delta_accuracy"])
        if m == "SignSGD":
            p = row(pre, m)
            ad = f"{_pp(100 * p['delta_accuracy'])} with `precondition=True` ({_pp(100 * a['delta_accuracy'])} without)"
        lines.append(f"| `{m}` | {r['ratio']:.0f}× / {a['ratio']:.0f}× | {_pp(100 * r['delta_accuracy'])} | {ad} |")

    lines += ["", *_lm_headline()]
    lines += ["", "| front end | method | result | file (machine) |", "|---|---|---|---|"]
    for name, text in _other_front_ends():
        doc = _load(name)
        lines.append(f"| {text} | `{name}` ({_short_machine(_as_machine(doc))}) |")
    return "\n".join(lines)


#: The language-model table the README quotes (``gradzip bench --preset lm``).
LM_RUN = "lm_shakespeare_4ranks_adamw_cpu.json"


def _lm_params(size: str) -> str:
    """The parameters of the bench's GPT at ``size``, in millions (``tiny``: 875,264, 0.88M)."""
    from gradzip.bench.lm import SIZES

    return f"{SIZES[size].params() / 1e6:.2f}M"


def _lm_headline() -> list[str]:
    """The language model: each row's link ratio and validation-loss gap to DDP."""
    doc = _load(LM_RUN)
    c = doc["config"]
    base = next(r for r in doc["rows"] if r["method"] == "Identity")
    lines = [
        f"The byte-level GPT ({c['lm_size']}, {_lm_params(c['lm_size'])} parameters) on the bundled Shakespeare, "
        f"{c['workers']} gloo "
        f"ranks, {c['total_steps']} AdamW steps (lr {c['lr']:g}, the best of a sweep for DDP), mean of "
        f"{len(c['seeds'])} seeds; DDP's validation loss {base['val_loss']:.3f} nats/byte "
        f"({_short_machine(doc['machine'])}; `{LM_RUN}`):",
        "",
        "| method | link bytes, fewer than DDP | validation loss against DDP's |",
        "|---|---:|---:|",
    ]
    for r in doc["rows"]:
        if r["method"] == "Identity":
            continue
        gap = f"{r['gap_pct']:+.1f}%".replace("-", "−")
        if r.get("gap_pct_std") is not None:
            gap += f" ± {r['gap_pct_std']:.1f}"
        lines.append(f"| `{r['method']}` | {r['ratio']:.1f}× | {gap} |")
    return lines


def _as_machine(doc: dict) -> dict:
    """A ``machine()`` record, also from the FSDP files (``description``, ``cpus``)."""
    m = doc["machine"]
    if "cores" in m:
        return m
    return {"cpu": m.get("cpu", "CPU"), "cores": m.get("cpus") or int(re.search(r"(\d+)-core", m["description"])[1])}


def _other_front_ends() -> list[tuple[str, str]]:
    out = []
    d = _load("diloco_mnist_4ranks_sgd_cpu.json")
    m = "DiLoCo(period=32, compression=Int8(), outer_kwargs={'momentum': 0.5})"
    r = next(x for x in d["rows"] if x["method"] == m)
    out.append(
        (
            "diloco_mnist_4ranks_sgd_cpu.json",
            f"`gz.DiLoCo`, MNIST CNN, {d['config']['workers']} ranks, {len(d['config']['seeds'])} seeds | `{m}` "
            f"| {r['ratio']:.0f}× fewer link bytes than DDP, {_pp(100 * r['delta_accuracy'])}",
        )
    )
    h = _load("horovod_mnist_2ranks_30ep_cpu.json")
    s = h["summary"]["TopK(0.01)"]
    out.append(
        (
            "horovod_mnist_2ranks_30ep_cpu.json",
            '`gradzip.horovod`, Horovod\'s MNIST example, 2 ranks, 30 epochs, 3 seeds | `compression="TopK(0.01)"` '
            f"| {s['link_ratio']:.0f}× fewer link bytes, {_pp(s['delta_pp'])} against Horovod",
        )
    )
    f = _load("fsdp_bytes.json")
    r = next(x for x in f["summary"] if x["model"] == "small" and x["layout"] == "fsdp" and x["rs"] == "Int8()")
    out.append(
        (
            "fsdp_bytes.json",
            f"`gz.fsdp`, FSDP2 reduce-scatter, {r['params'] / 1e3:.0f}k parameters, {r['world']} ranks | "
            f"`reduce_scatter=gz.Int8()` | {r['ratio_vs_plain_fsdp2']:.2f} of plain FSDP2's bytes on the wire",
        )
    )
    lb = _load("linkbytes_topk_ef.json")  # the TopK rows re-measured with Elias-Fano positions
    r = next(x for x in lb["rows"] if x["N"] == 8 and x["method"] == "TwoPhase(TopK(0.01))")
    out.append(
        (
            "linkbytes_topk_ef.json",
            f"DDP hook, bytes read on the wire at {r['N']} ranks | `TwoPhase(TopK(0.01))` "
            f"| {100 * r['lo_fraction_of_ddp']:.2f}% of plain DDP's bytes",
        )
    )
    return out


# -- AdamW's step sizes (benchmarks/adam_steps.py) -------------------------------------------------
def adam_steps(doc: dict) -> str:
    c = doc["config"]
    lines = [
        f"`{_cmd(doc['command'])}` ({c['workers']} gloo ranks, {c['optimizer']}, momentum correction "
        f"{c['momentum_correction']}{', --precondition' if c.get('precondition') else ''}, seed {c['seed']}, "
        f"{c['epochs']} epochs; the last epoch's steps; machine: {_machine(doc['machine'])})",
        "",
        "| method | link ratio | test acc (%) | mean step / lr | median step / lr | coordinates > 0.1·lr | > 0.5·lr |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['method']} | {r['ratio']:.1f}× | {100 * r['accuracy']:.2f} | {r['mean_normalized_step']:.3f} "
            f"| {r['median_normalized_step']:.3f} | {100 * r['fraction_above_0.1']:.1f}% "
            f"| {100 * r['fraction_above_0.5']:.1f}% |"
        )
    return "\n".join(lines)


# -- the Horovod example (benchmarks/horovod_mnist.py) ---------------------------------------------
def horovod(*names: str) -> str:
    """Mean test accuracy of Horovod's MNIST example, Horovod against gradzip.horovod, per file."""
    docs = [_load(n) for n in names]
    methods = [m for m in docs[0]["summary"] if isinstance(docs[0]["summary"][m], dict) and m != "Identity()"]
    lines = [
        "| epochs | Horovod | " + " | ".join(methods) + " | command |",
        "|---:|---:|" + "---:|" * len(methods) + "---|",
    ]
    for d in docs:
        s = d["summary"]
        base = s[methods[0]]["horovod_mean_test_accuracy"]
        cells = [
            f"{100 * s[m]['mean_test_accuracy']:.2f}% ({_pp(s[m]['delta_pp'])}), {s[m]['link_ratio']:.1f}×"
            for m in methods
        ]
        epochs = d["runs"][0]["epochs"]
        lines.append(f"| {epochs} | {100 * base:.2f}% | " + " | ".join(cells) + f" | `{_cmd(d['command'])}` |")
    d = docs[-1]
    hv = [r["test_accuracy"] for r in d["runs"] if r["hvd"] == "horovod"]
    under_hvd = [f for x in docs for f in x["summary"]["Identity()"]["params_equal_horovod"]]
    under_torchrun = [f for x in docs for f in x["summary"]["torchrun_identity_params_equal_horovod"]]
    lines += [
        "",
        f"Each cell: mean test accuracy over the seeds (Δ against Horovod's mean), then the link ratio gradzip "
        f"counted. Identity (seed 0) ends with Horovod's parameters bit for bit in {_yes(under_hvd)} under "
        f"horovodrun and {_yes(under_torchrun)} under torchrun. Horovod's own seeds span "
        f"{100 * min(hv):.1f}–{100 * max(hv):.1f}% at {d['runs'][0]['epochs']} epochs. "
        f"Machine: {', '.join(sorted({_machine(x['machine']) for x in docs}))}.",
    ]
    return "\n".join(lines)


def _yes(flags: list) -> str:
    return f"{sum(bool(f) for f in flags)} of {len(flags)} runs"


# -- step time, overhead, plan, PowerSGD, kernels --------------------------------------------------
def step_time(doc: dict) -> str:
    steps = "/".join(map(str, doc["steps"])) if isinstance(doc["steps"], list) else doc["steps"]
    lines = [
        f"`benchmarks/step_time.py` ({doc['ranks']} ranks in network namespaces, MLP of "
        f"{doc['rows'][0]['params'] / 1e6:.1f}M parameters, batch {doc['batch']}/rank, median of {steps} steps"
        f"{' after ' + str(doc['warmup']) + ' warm-up' if 'warmup' in doc else ''}"
        f"{', DDP gradient_as_bucket_view' if doc.get('gradient_as_bucket_view') else ''}; "
        f"machine: {_machine(doc['machine'])})",
        "",
        "| link | method | step (s) | model (s) | model error | MB sent/step/rank | speed-up vs allreduce "
        "| exposed | CPU s/step: step / compute / codec |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        cpu = (
            f"{r['step_cpu_s']:.3f} / {r['compute_cpu_s']:.3f} / {r['codec_cpu_seconds_per_step']:.3f}"
            if "step_cpu_s" in r
            else ""
        )
        lines.append(
            f"| {r['rate']} | {r['method']} | {r['step_s']:.3f} | {r['model']['total']:.3f} "
            f"| {100 * r['model_error']:+.1f}% | {r['bytes_sent_per_step'] / 1e6:.3f} "
            f"| {r.get('speedup_vs_allreduce', float('nan')):.2f}× | {_exposed(r)} | {cpu} |"
        )
    return "\n".join(lines)


def _exposed(row: dict) -> str:
    """Exposed communication: the step over the no-communication step (the slowest rank's
    compute, measured beside it), less one: what communication and codec add that compute
    did not hide."""
    c = row.get("compute_slowest_s") or row.get("compute_s")
    return f"{100 * (row['step_s'] / c - 1):+.0f}%" if c else ""


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
        f"`benchmarks/powersgd_step.py` ({doc['config']['world']} gloo ranks, rank {doc['config'].get('rank', 2)}, one "
        f"bucket, methods alternating in one run; median wall time per step; machine: {_machine(doc['machine'])})",
        "",
        "| width (params) | plain DDP ms | torch powerSGD_hook ms | gradzip PowerSGD ms | gradzip / torch "
        "| bytes/step: torch, gradzip |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['width']} ({r['params']:,}) | {r['ddp']['median_ms']:.2f} | {r['torch_powersgd']['median_ms']:.2f} "
            f"| {r['gradzip_powersgd']['median_ms']:.2f} | {r['ratio_gradzip_over_torch']:.3f} "
            f"| {r['torch_bytes_per_step']:,.0f}, {r['gradzip_bytes_per_step']:,.0f} |"
        )
    return "\n".join(lines)


def cpu_codec_cost(doc: dict) -> str:
    """Each codec's CPU time against the wire time its bytes save (benchmarks/cpu_codec_cost.py)."""
    lines = [
        f"`{_cmd(doc['command'])}` ({doc['params'] / 1e6:.1f}M float32 parameters in {len(doc['tensors'])} tensors, "
        f"one rank of {doc['ranks']}, {doc['threads']} thread, median of {doc['repeats']} calls; wire saved on a "
        f"{doc['rate']} link against plain allreduce's {doc['allreduce_wire_s']:.3f} s; machine: "
        f"{_machine(doc['machine'])})",
        "",
        "| method | codec s/step | ns per element | wire s | wire saved s | codec / saved |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        share = r["codec_over_saved"]
        lines.append(
            f"| `{r['method']}` | {r['codec_s']:.3f} | {r['codec_s_per_million'] * 1e3:.2f} | {r['wire_s']:.3f} "
            f"| {r['wire_saved_s']:.3f} | {'—' if share is None else f'{100 * share:.0f}%'} |"
        )
    return "\n".join(lines)


def overlap(doc: dict) -> str:
    """How much of each method's communication is in flight during the backward pass (benchmarks/overlap.py)."""
    lines = [
        f"`{_cmd(doc['command'])}` ({doc['ranks']} ranks, {doc['link']}; {doc['model']}; median of "
        f"{doc['steps']} steps of rank 0; machine: {_machine(doc['machine'])})",
        "",
        "| method | collectives / step | in flight s | in flight during backward | bytes issued during backward "
        "| step s | exposed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['method']} | {r['collectives_per_step']:.0f} | {r['busy_s']:.3f} "
            f"| {100 * r['busy_in_backward']:.0f}% | {100 * r['bytes_issued_in_backward']:.0f}% "
            f"| {r['step_s']:.3f} | {100 * r['exposed']:+.0f}% |"
        )
    lines.append(f"\nNo-communication step: {doc['rows'][0]['no_comm_step_s']:.3f} s." if doc["rows"] else "")
    return "\n".join(lines)


def collectives(doc: dict) -> str:
    """gloo's collectives per link byte (benchmarks/collectives.py)."""
    lines = [
        f"`{_cmd(doc['command'])}` (ranks on 127.0.0.1, unshaped, one torch thread each; fastest of the "
        f"repeats on rank 0; machine: {_machine(doc['machine'])})",
        "",
        "| ranks | collective | dtype | MB per rank | ms | Gbit/s of link bytes | × allreduce's rate |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['ranks']} | {r['collective']} | {r['dtype']} | {r['bytes_per_rank'] / 2**20:.1f} "
            f"| {1e3 * r['seconds']:.1f} | {r['link_gbit_s']:.2f} | {r['rate_over_allreduce']:.2f} |"
        )
    return "\n".join(lines)


def powersgd_runs(*names: str, key: str = "ratio_gradzip_over_torch", what: str = "gradzip / torch") -> str:
    """gradzip PowerSGD over torch's powerSGD_hook (or another ratio of each row, ``key``) in
    several runs of ``powersgd_step.py``: each run's ratio per width, their median and spread."""
    docs = [_load(n) for n in names]
    widths = [r["width"] for r in docs[0]["rows"]]
    lines = [
        f"{what} step time in {len(docs)} runs of `benchmarks/powersgd_step.py` (same options; machine: "
        f"{_machine(docs[0]['machine'])})",
        "",
        "| width | " + " | ".join(f"run {i + 1}" for i in range(len(docs))) + " | median | spread |",
        "|---|" + "---:|" * (len(docs) + 2),
    ]
    for w in widths:
        ratios = [next(r[key] for r in d["rows"] if r["width"] == w) for d in docs]
        lines.append(
            f"| {w} | "
            + " | ".join(f"{x:.3f}" for x in ratios)
            + f" | {statistics.median(ratios):.3f} | {min(ratios):.3f}..{max(ratios):.3f} |"
        )
    return "\n".join(lines) + "\n\nResult files: " + ", ".join(_link(n) for n in names) + "."


def overhead(doc: dict) -> str:
    """Hook overhead against plain DDP, step by step in pairs (benchmarks/overhead.py)."""
    lines = [
        f"`sudo .venv/bin/python -m benchmarks.overhead --ranks {doc['ranks']} --steps {doc['cycles']}` "
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
        f"`python -m benchmarks.kernels` on {doc['device']} (torch {doc['torch']}, triton {doc['triton']}, "
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
        "Goals: " + ", ".join(f"{k} {'met' if v else 'not met'}" for k, v in doc["goals"].items() if v is not None),
    ]
    return "\n".join(lines)


def hierarchy(doc: dict) -> str:
    """benchmarks/hierarchy.py: step time per method on 2 emulated nodes of 2 ranks, beside the cost model."""
    lines = [
        f"`{_cmd(doc['command'])}` ({doc['world']} ranks as {doc['world'] // doc['local_size']} nodes of "
        f"{doc['local_size']}, inter-node link {doc['rate']}, MLP width {doc['width']} depth {doc['depth']}, batch "
        f"{doc['batch']}/rank, median of {doc['steps']} steps after {doc['warmup']}; "
        f"machine: {_machine(doc['machine'])})",
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


def plan(doc: dict) -> str:
    """A ``gradzip plan --json`` result: predicted step time (scaling efficiency) per method and world."""
    inp = doc["inputs"]
    worlds, methods = inp["worlds"], inp["methods"]
    cell = {(r["method"], r["world"]): r for r in doc["rows"]}
    link, intra = inp["link"], inp.get("intra_link")
    lines = [
        f"Model: {inp['model']} ({inp['tensors']} tensors, {inp['dtype']}), {1e3 * inp['compute_s']:g} ms of compute "
        f"a step; link {link['bandwidth_bps'] / 1e9:g} Gbit/s, {1e6 * link['latency_s']:g} µs"
        + (
            f" per node of {inp['local_size']} ranks, {intra['bandwidth_bps'] / 1e9:g} Gbit/s, "
            f"{1e6 * intra['latency_s']:g} µs inside a node"
            if intra and inp.get("local_size")
            else ""
        )
        + f". Codec profile: {doc['profile']['source']}; profiled {doc['profile']['machine']['date']}.",
        "",
        "Predicted step time in ms (scaling efficiency = compute / step):",
        "",
        "| method | " + " | ".join(f"N = {n}" for n in worlds) + " |",
        "|---|" + "---:|" * len(worlds),
    ]
    for m in methods:
        cells = []
        for n in worlds:
            r = cell.get((m, n))
            cells.append("—" if r is None else f"{1e3 * r['total_s']:.1f} ({100 * r['efficiency']:.0f}%)")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", f"Best per world size: {', '.join(f'N = {n}: {m}' for n, m in doc['best'].items())}."]
    lines += ["", doc["recommendation"]]
    for note in doc.get("notes", []):
        lines += ["", f"Note: {note}."]
    return "\n".join(lines)


# -- FSDP2 (benchmarks/fsdp_bytes.py, benchmarks/fsdp_acceptance.py) -------------------------------
def fsdp_bytes(doc: dict) -> str:
    """Reduction bytes per rank per step on ``lo``, plain FSDP2 against gradzip.fsdp."""
    by = {}
    for s in doc["summary"]:
        by.setdefault((s["model"], s["layout"] == "fsdp", s["world"]), []).append(s)
    lines = [
        f"`{_cmd(doc['command'])}` ({doc['machine']['description']}, torch {doc['machine']['torch']}). "
        f"{doc['method']}. Per rank per step, kB.",
        "",
        "| model | layout | ranks | plain | gradzip Identity | gradzip Int8 | Int8 / plain | Int8 / textbook RS |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    layouts = {
        "fsdp": "FSDP2",
        "hsdp": "HSDP 2×2: Int8 reduce-scatter, FSDP2's own replica all-reduce",
        "hsdp_shard": "HSDP 2×2: Int8 reduce-scatter and Int8 replica average",
    }
    for s in doc["summary"]:
        if s["rs"] != "Int8()":
            continue
        ident = next((x for x in by[(s["model"], s["layout"] == "fsdp", s["world"])] if x["rs"] == "Identity()"), None)
        ident_kb = "" if ident is None else f"{ident['gradzip_lo_bytes_per_rank_step'] / 1e3:,.0f}"
        textbook = s["ratio_vs_textbook_reduce_scatter"]
        lines.append(
            f"| {s['model']}, {s['params']:,} params | {layouts[s['layout']]} | {s['world']} "
            f"| {s['plain_lo_bytes_per_rank_step'] / 1e3:,.0f} | {ident_kb} "
            f"| {s['gradzip_lo_bytes_per_rank_step'] / 1e3:,.0f} | {s['ratio_vs_plain_fsdp2']:.2f} "
            f"| {'' if textbook is None else f'{textbook:.2f}'} |"
        )
    lines += [
        "",
        "*Textbook RS*: a reduce-scatter sending `(N-1)/N` of the gradient, as NCCL's ring does; gloo runs "
        "`reduce_scatter` as a full ring allreduce.",
    ]
    return "\n".join(lines)


def fsdp_acceptance(doc: dict) -> str:
    lines = [
        f"`{_cmd(doc['command'])}` ({doc['machine']['description']}, torch {doc['machine']['torch']}); model: "
        f"{doc['model']}.",
        "",
        "| layout | ranks | steps | Identity = plain, bit for bit | Identity's largest parameter difference "
        "| Int8's largest loss difference | plain's loss std, last 20 steps | Int8's link ratio |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['layout']} | {r['world']} | {r['steps']} | {'yes' if r['identity_bit_identical'] else 'no'} "
            f"| {r['identity_max_param_diff']:.1e} | {r['int8_max_loss_diff']:.1e} | {r['plain_loss_std_last20']:.3f} "
            f"| {r['int8_stats']['ratio']:.2f}× |"
        )
    return "\n".join(lines)


# -- the page --------------------------------------------------------------------------------------
def _link(name: str) -> str:
    return f"[`{name}`]({LINK}{name})"


def _files(name: str) -> str:
    """``Result files: ...`` naming the JSON and the CSV/PNG written beside it."""
    stem = name[: -len(".json")] if name.endswith(".json") else name
    names = [name] + [f"{stem}.{ext}" for ext in ("csv", "png") if (RESULTS / f"{stem}.{ext}").exists()]
    return "Result files: " + ", ".join(_link(n) for n in names) + "."


def _with_files(render):
    def run(name: str) -> str:
        out = render(_load(name)) + "\n\n" + _files(name)
        png = RESULTS / (name[: -len(".json")] + ".png")
        if render is accuracy and png.exists():
            out += f"\n\n![Pareto plot: {name[: -len('.json')]}]({LINK}{png.relative_to(RESULTS)})"
        return out

    return run


def _linkbytes(name: str) -> str:
    doc = _load(name)
    doc["command"] = _cmd(doc["command"])
    return linkbytes_report.table(doc) + "\n\n" + linkbytes_report.scaling(doc) + "\n\n" + _files(name)


def _streaming(name: str) -> str:
    doc = _load(name)
    doc["command"] = _cmd(doc["command"])
    return streaming_report.report(doc) + "\n\n" + _files(name)


def _explore(*, shown: frozenset = frozenset()) -> str:
    """Every exploratory run under ``explore/`` but those ``shown`` elsewhere on the page, one table each."""
    out = []
    for path in sorted((RESULTS / "explore").glob("*.json")):
        name = str(path.relative_to(RESULTS))
        if name in shown:
            out += [f"### `{path.stem}`", "", f"Shown above; {_files(name)[0].lower()}{_files(name)[1:]}", ""]
            continue
        render = lm if _load(name).get("config", {}).get("metric") == "val_loss" else accuracy
        out += [f"### `{path.stem}`", "", _with_files(render)(name), ""]
    return "\n".join(out).rstrip()


def _horovod(*names: str) -> str:
    return horovod(*names) + "\n\nResult files: " + ", ".join(_link(n) for n in names) + "."


RENDERERS = {
    "accuracy": _with_files(accuracy),
    "lm": _with_files(lm),
    "adam_steps": _with_files(adam_steps),
    "verdicts": verdicts,
    "headline": lambda: headline(),
    "horovod": _horovod,
    "streaming": _streaming,
    "linkbytes": _linkbytes,
    "hierarchy": _with_files(hierarchy),
    "plan": _with_files(plan),
    "fsdp_bytes": _with_files(fsdp_bytes),
    "fsdp_acceptance": _with_files(fsdp_acceptance),
    "step_time": _with_files(step_time),
    "overhead": _with_files(overhead),
    "plan_check": _with_files(plan_check),
    "powersgd": _with_files(powersgd),
    "powersgd_runs": powersgd_runs,
    "powersgd_bucket_runs": lambda *names: powersgd_runs(
        *names,
        key="ratio_default_buckets_over_one",
        what="gradzip PowerSGD with DDP's default buckets / with one bucket,",
    ),
    "cpu_codec_cost": _with_files(cpu_codec_cost),
    "collectives": _with_files(collectives),
    "overlap": _with_files(overlap),
    "kernels": _with_files(kernels),
    "explore": _explore,
}

_DIRECTIVE = re.compile(r"^\{\{\s*(\w+)((?:\s+\S+)*)\s*\}\}$")


def page(template: str | None = None) -> str:
    """The results page: the template with every ``{{ KIND ARGS }}`` line rendered."""
    text = TEMPLATE.read_text() if template is None else template
    out = [
        "<!-- Written by `python -m benchmarks.report --page docs/results.md` from benchmarks/report_page.md and "
        "the files under benchmarks/results/: edit those, then rerun it. -->",
        "",
    ]
    lines = [line for line in text.splitlines() if not (line.startswith("<!--") and line.endswith("-->"))]
    directives = [(i, _DIRECTIVE.match(line.strip())) for i, line in enumerate(lines)]
    shown = frozenset(arg for _, m in directives if m for arg in m[2].split())
    for line, (_, m) in zip(lines, directives):
        if m is None:
            out.append(line)
            continue
        kind, args = m[1], m[2].split()
        if kind not in RENDERERS:
            raise ValueError(f"unknown table kind {kind!r} in {line!r}; known: {sorted(RENDERERS)}")
        out.append(_explore(shown=shown) if kind == "explore" else RENDERERS[kind](*args))
    return "\n".join(out).strip() + "\n"


def tables() -> str:
    """Every table of the top-level result files this script knows, in a fixed order."""
    names = sorted(p.name for p in RESULTS.glob("*.json") if p.name.startswith(("accuracy_", "diloco_")))
    out = []
    for name, fn in (
        *((n, accuracy) for n in names),
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
            out += [fn(doc), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--page", metavar="PATH", help="write the results page (docs/results.md) to PATH")
    p.add_argument("--headline", action="store_true", help="print the README's headline tables")
    a = p.parse_args(argv)
    if a.page:
        os.makedirs(os.path.dirname(os.path.abspath(a.page)), exist_ok=True)
        Path(a.page).write_text(page())
        print(f"wrote {a.page}")
    elif a.headline:
        print(headline())
    else:
        print(tables())
    return 0


if __name__ == "__main__":
    sys.exit(main())
