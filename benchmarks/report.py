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
import shlex
import statistics
import sys
from pathlib import Path

from benchmarks import fsdp_zeropp as fsdp_zeropp_tables
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
    """``AMD EPYC, 2 cores, torch 2.13.0+cpu, 2026-11-27`` from a ``machine()`` record."""
    extra = f", {m['gpu']}" if "gpu" in m else ""
    return f"{_short_machine(m)}{extra}, torch {m['torch']}, {m['date']}"


def _short_machine(m: dict) -> str:
    """``Intel Xeon, 2 cores`` from a ``machine()`` record."""
    cpu = re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b", "", m["cpu"])
    return f"{' '.join(cpu.split())}, {m['cores']} cores"


def _cmd(command: str) -> str:
    """A recorded command line in the form the scripts run in today: ``python -m benchmarks.X``
    for ``python benchmarks/X.py`` (the result files keep the form that was typed)."""
    # an output path as typed, absolute in the checkout it ran in: relative to the repository
    command = re.sub(r"(?<![\w.])/\S*?/(benchmarks/results/)", r"\1", command.replace(f"{ROOT}/", ""))
    command = _requote(command)
    return re.sub(r"(\S*python3?) benchmarks/(\w+)\.py\b", r"\1 -m benchmarks.\2", command).rstrip()


def _requote(command: str) -> str:
    """``--methods "TopK(0.01, mode='approx')"`` for the ``'TopK(0.01, mode='"'"'approx'"'"')'`` that
    ``shlex.join`` records: the same arguments, quoted for a reader."""
    if "'\"'\"'" not in command or re.search(r"[|&;<>]", command.replace("'\"'\"'", "")):
        return command
    try:
        args = shlex.split(command)
    except ValueError:
        return command
    out = []
    for a in args:
        if re.fullmatch(r"[\w@%+=:,./-]+", a):
            out.append(a)
        elif not re.search(r'["$`\\!]', a):
            out.append(f'"{a}"')
        else:
            out.append(shlex.quote(a))
    return " ".join(out)


def _pm(r: dict, key: str, signed: bool = False) -> str:
    """``mean ± std [min..max]`` in percent (points) of ``r[key]``, ``r[key + "_std"]``, ..."""
    f = (lambda v: f"{100 * v:+.2f}") if signed else (lambda v: f"{100 * v:.2f}")
    std = r.get(f"{key}_std")
    if std is None:  # one seed: no spread
        return f(r[key])
    return f"{f(r[key])} ± {100 * std:.2f} [{f(r[f'{key}_min'])}..{f(r[f'{key}_max'])}]"


# -- accuracy runs (gradzip bench, benchmarks/accuracy.py) -----------------------------------------
#: From this many seeds on, an accuracy table is followed by each seed's Δ and their median.
PER_SEED_FROM = 5


def _seeds(seeds: list) -> str:
    """``0–7`` for a run of consecutive seeds, else ``0, 2, 5``."""
    if len(seeds) > 2 and list(seeds) == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


def _split_methods(text: str) -> list[str]:
    """``"A(1, 2), B"`` as ``["A(1, 2)", "B"]``: split at the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{" and 1 or ch in ")]}" and -1 or 0
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


#: What a command's ``--methods`` shows when it lists exactly its table's rows, in order.
ROWS = "<rows>"


def _run_cmd(doc: dict) -> str:
    """``doc``'s command (:func:`_cmd`) with a ``--methods`` list that names exactly the table's rows,
    in order, shown as :data:`ROWS` (the table lists them)."""
    cmd = _cmd(doc["command"])
    rows = [r["method"] for r in doc.get("rows", [])]
    try:
        args = shlex.split(cmd)
    except ValueError:
        return cmd
    if "--methods" in args[:-1] and _split_methods(args[args.index("--methods") + 1]) == rows:
        value = args[args.index("--methods") + 1]
        for quoted in (f'"{value}"', f"'{value}'", shlex.quote(value)):
            if f"--methods {quoted}" in cmd:
                return cmd.replace(f"--methods {quoted}", f'--methods "{ROWS}"', 1)
    return cmd


def _accuracy_run(doc: dict) -> str:
    """An accuracy run's command in backticks, then what it trained on: ``(mnist, 4 gloo ranks, ...)``."""
    cfg = doc["config"]
    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    warmup = f", warm-up {cfg['warmup_epochs']:g} epochs" if cfg.get("warmup_epochs") else ""
    clip = f", local clipping {cfg['clip']:g}" if cfg.get("clip") is not None else ""
    pre = ", --precondition" if cfg.get("precondition") else ""
    cmd = f"`{_run_cmd(doc)}`" if doc.get("command") else "`gradzip bench`"
    return (
        f"{cmd} ({cfg['dataset']}, {cfg['workers']} {backend} ranks, {cfg['epochs']} epochs of "
        f"{cfg['steps_per_epoch']} steps, batch {cfg['batch_size']}/rank, {cfg['optimizer']} lr {cfg['lr']:g}"
        f"{warmup}{clip}{pre}; seeds {_seeds(cfg['seeds'])}; {_machine(doc['machine'])})"
    )


def accuracy(doc: dict) -> str:
    """The table of ``gradzip bench`` / ``benchmarks/accuracy.py`` (results.json, schema 2: per-method
    rows aggregated over seeds): its command and configuration, then one row per method. The
    columns are explained once on the page (``ACCURACY_COLUMNS``)."""
    lines = [
        _accuracy_run(doc),
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
    if len(doc["config"]["seeds"]) >= PER_SEED_FROM:
        lines += ["", *_per_seed_deltas(doc)]
    return "\n".join(lines)


#: What an accuracy table's columns mean, said once on the page (``{{ accuracy_columns }}``).
ACCURACY_COLUMNS = (
    "Link ratio: plain DDP's ring-allreduce bytes on a rank's link / gradzip's (`stats()[\"ratio\"]`); handed: "
    "the same over the bytes handed to `torch.distributed`. Test accuracy: mean ± sample std [min..max] over the "
    "seeds; last 3: the mean over the last 3 epochs; Δ: against Identity on the same seed, in points."
)


def lm(doc: dict) -> str:
    """The language model's table (``gradzip bench --dataset shakespeare``, ``--preset lm``):
    validation loss and its gap to Identity's on the same seeds, against the link ratio."""
    cfg = doc["config"]
    clip = f", clipping {cfg['clip']:g} ({cfg['clip_mode']})" if cfg.get("clip") is not None else ", no clipping"
    warmup = f", warm-up {cfg['warmup_steps']} steps" if cfg.get("warmup_steps") else ""
    lines = [
        f"`{_run_cmd(doc)}` ({cfg['dataset']}, the {cfg['lm_size']} GPT, {cfg['workers']} gloo ranks, "
        f"{cfg['total_steps']} steps, batch {cfg['batch_size']}/rank, {cfg['optimizer']} lr {cfg['lr']:g}{warmup}"
        f"{clip}; seeds {_seeds(cfg['seeds'])}; {_machine(doc['machine'])})",
        "",
        "| method | link ratio | link MB/step | val loss (nats/byte) | bits/byte | gap to DDP (%) "
        "| DDP-equivalent steps | ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        loss = f"{r['val_loss']:.4f}"
        gap = f"{r['gap_pct']:+.2f}" if "gap_pct" in r else ""
        if r.get("val_loss_std") is not None:
            loss += f" ± {r['val_loss_std']:.4f}"
            if gap:
                gap += f" ± {r['gap_pct_std']:.2f} [{r['gap_pct_min']:+.2f}..{r['gap_pct_max']:+.2f}]"
        eq = _ddp_steps(r, doc["rows"])
        lines.append(
            f"| {r['method']} | {r['ratio']:.1f}× | {r['bytes_link_per_step'] / 1e6:.4f} | {loss} "
            f"| {r['bits_per_byte']:.4f} | {gap} | {eq} | {1000 * r['seconds_per_step']:.1f} |"
        )
    return "\n".join(lines)


def _ddp_steps(row: dict, rows: list) -> str:
    """A row's DDP-equivalent steps (``ddp_steps_pct``, else from its seeds' curves and the
    baseline's: :func:`gradzip.bench.report.ddp_equivalent_pct`), as a percentage."""
    from gradzip.bench.report import ddp_equivalent_pct

    pct = row.get("ddp_steps_pct")
    base = next((r for r in rows if r["method"] in ("Identity", "DDP")), None)
    if pct is None and base is not None and row is not base:
        by_seed = {s["seed"]: s for s in base.get("per_seed", [])}
        eq = [ddp_equivalent_pct(s.get("curve"), by_seed.get(s["seed"], {}).get("curve")) for s in row["per_seed"]]
        pct = statistics.fmean(eq) if eq and all(e is not None for e in eq) else None
    if row is base:
        return "100%"
    return f"{pct:.0f}%" if pct is not None else ""


#: What a language-model table's columns mean, said once on the page (``{{ lm_columns }}``).
LM_COLUMNS = (
    "Validation loss: nats per byte on the whole validation text after the last step, mean ± sample std over "
    "the seeds; gap: 100 × (loss − Identity's) / Identity's on the same seed, in percent, mean ± sample std "
    "[min..max]; DDP-equivalent steps: the step, in percent of the run, at which DDP's validation curve reached "
    "the method's final loss (on the curve's fixed subset of the validation text); link ratio: plain DDP's "
    "ring-allreduce bytes on a rank's link / gradzip's."
)


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
    base = [next(r for r in d["rows"] if r["method"] == "Identity") for d in docs]
    lines.append("| Identity: test accuracy | " + " | ".join(f"{100 * b['accuracy']:.2f}%" for b in base) + " |")
    for m in methods:
        lines.append(f"| `{m}` | " + " | ".join(_cell(d, m, (0, 1, 2)) for d in docs) + " |")
    lines.append("")
    for i, (head, n, d) in enumerate(zip(heads, names, docs)):
        run = f"`{_run_cmd(d)}`"
        if i and d.get("command") and docs[0].get("command"):
            run = f"the first command {_flags_changed(_run_cmd(docs[0]), _run_cmd(d))}"
        lines.append(f"* {head}: {run} ({_machine(d['machine'])}). {_named(n)}")
    return "\n".join(lines)


def _options(command: str) -> dict:
    """``{"--seeds": "0-7", "--no-progress": None, ...}``: a command's options and their values."""
    out, key = {}, None
    for tok in shlex.split(command):
        if tok.startswith("--"):
            key, out[tok] = tok, None
        elif key is not None and out[key] is None:
            out[key] = tok
    return out


def _flags_changed(first: str, cmd: str) -> str:
    """``with `--optimizer adamw --stem ...` `` / ``without `--clip` ``: how ``cmd`` differs from ``first``."""
    a, b = _options(first), _options(cmd)
    changed = [k if b[k] is None else f"{k} {shlex.quote(b[k])}" for k in b if a.get(k, "") != b[k] or k not in a]
    dropped = [k for k in a if k not in b]
    return ", ".join(
        x
        for x in (f"with `{' '.join(changed)}`" if changed else "", f"without `{' '.join(dropped)}`" if dropped else "")
        if x
    )


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

    lines += ["", *_lm_headline(), "", *_lm_peer_headline()]
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


#: gradzip's version of each peer's method beside the peer, run as it ships, on the same seeds.
LM_PEERS_RUN = "lm_peers_4ranks_adamw_cpu.json"
#: DeMo as gradzip's DDP hook, as the authors' optimizer steps (tests/frontends/test_demo_reference.py):
#: a vector's 64-element tiles keep 32 coefficients, and the momentum gathers lr * g.
DEMO_ROW = (
    "Hook(Policy(DCT(ChunkTopK(32, chunk=64, average='senders')), per_layer={"
    "'ln': DCT(ChunkTopK(2048, chunk=64, average='senders')), "
    "'bias': DCT(ChunkTopK(2048, chunk=64, average='senders'))}), "
    "update='sign', error_decay=0.999, momentum=0.0, lr_scale=0.3, lr_weighted=True)"
)
LM_PEER_PAIRS = (
    ("DiLoCo(period=32)", "peer: torchft 0.2.0 DiLoCo(sync_every=32)"),
    (
        "DiLoCo(period=32, fragments=4, delay=2)",
        "peer: torchft 0.2.0 streaming DiLoCo(4 fragments, sync_every=32, delay=2, alpha=0)",
    ),
    ("Hook(PowerSGD(rank=1), start_iter=100)", "peer: torch powerSGD_hook(rank=1, start_powerSGD_iter=100)"),
    ("Hook(PowerSGD(rank=4), start_iter=100)", "peer: torch powerSGD_hook(rank=4, start_powerSGD_iter=100)"),
    (
        "SparseLoCo(period=30, compression=ChunkTopK(32, chunk=64, values='q2', average='senders'))",
        "peer: SparseLoCo (CCLoco, H=30, top-32/64x64, 2-bit)",
    ),
    (DEMO_ROW, "peer: DeMo (bloc97/DeMo, lr x0.3)"),
)


def _lm_peer_headline() -> list[str]:
    """gradzip beside the peers' own code on the language model: link ratio and loss gap of each,
    and the paired difference by seed."""
    doc = _load(LM_PEERS_RUN)
    rows = {r["method"]: r for r in doc["rows"]}
    ddp = rows["Identity"]
    lines = [
        f"Beside the peers' own code on the same GPT, {len(doc['config']['seeds'])} seeds "
        f"(`{LM_PEERS_RUN}`; paired: gradzip's loss minus the peer's on each seed, in % of DDP's):",
        "",
        "| gradzip | peer, as it ships | link bytes, fewer (gradzip / peer) | loss against DDP's (gradzip / peer) "
        "| paired |",
        "|---|---|---:|---:|---:|",
    ]
    base = {r["seed"]: r["val_loss"] for r in ddp["per_seed"]}
    for ours, peer in LM_PEER_PAIRS:
        a, b = rows[ours], rows[peer]
        diffs = [100 * (x["val_loss"] - y["val_loss"]) / base[x["seed"]] for x, y in _by_seed(a, b)]
        paired = ", ".join(f"{d:+.1f}%" for d in diffs).replace("-", "−")
        gaps = f"{a['gap_pct']:+.1f}% / {b['gap_pct']:+.1f}%".replace("-", "−")
        ratios = f"{a['ratio']:.1f}× / {b['ratio']:.1f}×"
        lines.append(f"| `{ours}` | {peer.removeprefix('peer: ')} | {ratios} | {gaps} | {paired} |")
    return lines


def _by_seed(a: dict, b: dict) -> list[tuple[dict, dict]]:
    """The per-seed runs of two rows, paired by seed (the seeds both ran)."""
    theirs = {r["seed"]: r for r in b["per_seed"]}
    return [(r, theirs[r["seed"]]) for r in sorted(a["per_seed"], key=lambda r: r["seed"]) if r["seed"] in theirs]


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
def adam_steps(*names: str) -> str:
    """AdamW's step per coordinate over its learning rate in the last epoch (benchmarks/adam_steps.py),
    one block of rows per run; a later run's rows are labelled by its flags, an Identity row that
    repeats the first run's left out."""
    docs = [_load(n) for n in names]
    c = docs[0]["config"]
    lines = [
        "; ".join(f"`{_cmd(d['command'])}`" for d in docs)
        + f" ({c['workers']} gloo ranks, {c['optimizer']}, momentum correction {c['momentum_correction']}, seed "
        f"{c['seed']}, {c['epochs']} epochs; the last epoch's steps; {_machine(docs[0]['machine'])})",
        "",
        "| method | link ratio | test acc (%) | mean step / lr | median step / lr | coordinates > 0.1·lr | > 0.5·lr |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    seen = set()
    for d in docs:
        flag = ", `--precondition`" if d["config"].get("precondition") else ""
        for r in d["rows"]:
            row = (
                f"{r['ratio']:.1f}× | {100 * r['accuracy']:.2f} | {r['mean_normalized_step']:.3f} "
                f"| {r['median_normalized_step']:.3f} | {100 * r['fraction_above_0.1']:.1f}% "
                f"| {100 * r['fraction_above_0.5']:.1f}% |"
            )
            if (r["method"], row) in seen:
                continue
            seen.add((r["method"], row))
            lines.append(f"| {r['method']}{flag} | {row}")
    return _cite("\n".join(lines), _named(*names))


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
    """``benchmarks/step_time.py``: one row per method, one column per link: the median step, its
    speed-up over plain allreduce, the exposed share and the step-time model's error."""
    steps = "/".join(map(str, doc["steps"])) if isinstance(doc["steps"], list) else doc["steps"]
    rates = list(dict.fromkeys(r["rate"] for r in doc["rows"]))
    methods = list(dict.fromkeys(r["method"] for r in doc["rows"]))
    by = {(r["method"], r["rate"]): r for r in doc["rows"]}
    lines = [
        f"`benchmarks/step_time.py` ({doc['ranks']} ranks in network namespaces, MLP of "
        f"{doc['rows'][0]['params'] / 1e6:.1f}M parameters, batch {doc['batch']}/rank, median of {steps} steps"
        f"{' after ' + str(doc['warmup']) if 'warmup' in doc else ''}; {_machine(doc['machine'])})",
        "",
        "| method | MB sent/step/rank | " + " | ".join(f"link {r}" for r in rates) + " |",
        "|---|---:|" + "---:|" * len(rates),
    ]
    for m in methods:
        rows = [by.get((m, rate)) for rate in rates]
        mb = sorted({f"{r['bytes_sent_per_step'] / 1e6:.3f}" for r in rows if r})
        cells = [
            ""
            if r is None
            else f"{r['step_s']:.3f} ({r.get('speedup_vs_allreduce', float('nan')):.2f}×, {_exposed(r)}; "
            f"{100 * r['model_error']:+.0f}%)"
            for r in rows
        ]
        lines.append(f"| {m} | {' / '.join(mb)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _exposed(row: dict) -> str:
    """Exposed communication: the step over the no-communication step (the slowest rank's
    compute, measured beside it), less one: what communication and codec add that compute
    did not hide."""
    c = row.get("compute_slowest_s") or row.get("compute_s")
    return f"{100 * (row['step_s'] / c - 1):+.0f}%" if c else ""


def plan_check(*names: str) -> str:
    """``benchmarks/plan_check.py``'s runs side by side: each method's plan error at every ranks and
    link of the step-time rows (one figure per run in a cell), then each run's summary per world size."""
    docs = [_load(n) for n in names]
    cols = list(dict.fromkeys((r["ranks"], r["rate"]) for r in docs[0]["rows"]))
    methods = list(dict.fromkeys(r["method"] for r in docs[0]["rows"]))
    err = [{(r["method"], r["ranks"], r["rate"]): r["error"] for r in d["rows"]} for d in docs]
    d0 = docs[0]
    lines = [
        f"`python -m benchmarks.plan_check` ({len(docs)} run{'s' if len(docs) > 1 else ''}; codec seconds "
        f"scaled by max(1, ranks / {d0['cores']} cores); {_machine(d0['machine'])}). Each cell: the plan's error "
        "against the measured step, " + " / ".join(f"run {i + 1}" for i in range(len(docs))) + ".",
        "",
        "| method | " + " | ".join(f"{n} ranks, {rate}" for n, rate in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for m in methods:
        cells = []
        for n, rate in cols:
            got = [e.get((m, n, rate)) for e in err]
            cells.append("" if got[0] is None else " / ".join(f"{100 * g:+.0f}%" for g in got if g is not None))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    for world in d0["summary"]:
        runs = [d["summary"][world] for d in docs]
        lines.append(
            f"N={world}: "
            + " / ".join(f"{s['within_15pct']} of {s['rows']}" for s in runs)
            + " rows within 15%, median |error| "
            + " / ".join(f"{100 * s['median_abs_error']:.1f}%" for s in runs)
            + "."
        )
    return _cite("\n".join(lines), _named(*names))


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


def overlap(*names: str) -> str:
    """How much of each method's communication is in flight during the backward pass
    (benchmarks/overlap.py), from the first run; the exposed share from every run."""
    docs = [_load(n) for n in names]
    doc = docs[0]
    exposed = [{r["method"]: r["exposed"] for r in d["rows"]} for d in docs]
    runs = " / ".join(str(i + 1) for i in range(len(docs)))
    lines = [
        f"`{_cmd(doc['command'])}` ({doc['ranks']} ranks, {doc['link']}; {doc['model']}; median of "
        f"{doc['steps']} steps of rank 0; {len(docs)} runs; {_machine(doc['machine'])})",
        "",
        "| method | collectives / step | in flight s | in flight during backward | bytes issued during backward "
        f"| step s | exposed, runs {runs} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        ex = " / ".join(f"{100 * e[r['method']]:+.0f}%" for e in exposed)
        lines.append(
            f"| {r['method']} | {r['collectives_per_step']:.0f} | {r['busy_s']:.3f} "
            f"| {100 * r['busy_in_backward']:.0f}% | {100 * r['bytes_issued_in_backward']:.0f}% "
            f"| {r['step_s']:.3f} | {ex} |"
        )
    return _cite("\n".join(lines), _named(*names))


def collectives(doc: dict) -> str:
    """gloo's collectives per link byte (benchmarks/collectives.py)."""
    lines = [
        f"`{_cmd(doc['command'])}` (unshaped, one torch thread a rank; fastest of the repeats on rank 0; "
        f"{_machine(doc['machine'])})",
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
        f"{what} step time in {len(docs)} runs of `{_powersgd_cmd(docs[0])}` ({_machine(docs[0]['machine'])})",
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
    return _cite("\n".join(lines), _named(*names))


def _powersgd_cmd(doc: dict) -> str:
    """The ``powersgd_step.py`` command of a run that did not record one, from its configuration."""
    c = doc["config"]
    buckets = " --default-buckets" if "ratio_default_buckets_over_one" in doc["rows"][0] else ""
    return f"python -m benchmarks.powersgd_step --widths {' '.join(map(str, c['widths']))}{buckets}"


def overhead(*names: str) -> str:
    """Hook overhead against plain DDP, step by step in the same cycle (benchmarks/overhead.py): one
    column pair per run (world size), each method's median ratio and its bootstrap 95% interval."""
    docs = [_load(n) for n in names]
    d0 = docs[0]
    lines = [
        "; ".join(
            f"`sudo .venv/bin/python -m benchmarks.overhead --ranks {d['ranks']} --steps {d['cycles']}`" for d in docs
        )
        + f" (link {d0['rate']}, {d0['cycles']} cycles after {d0['warmup']} warm-up, MLP width {d0['width']}; "
        f"{_machine(d0['machine'])})",
        "",
        "| method | "
        + " | ".join(f"{d['ranks']} ranks: median step (s) | vs plain DDP, median [95% interval]" for d in docs)
        + " |",
        "|---|" + "---:|---:|" * len(docs),
        "| plain DDP | " + " | ".join(f"{statistics.median(d['allreduce_step_s']):.3f} | " for d in docs) + " |",
    ]
    for r0 in d0["rows"]:
        cells = []
        for d in docs:
            r = next((x for x in d["rows"] if x["method"] == r0["method"]), None)
            if r is None:
                cells += ["", ""]
                continue
            lo, hi = r["ci95"]
            cells += [
                f"{r['step_s_median']:.3f}",
                f"{100 * (r['median_ratio'] - 1):+.1f}% [{100 * (lo - 1):+.1f}%..{100 * (hi - 1):+.1f}%]",
            ]
        lines.append(f"| {r0['method']} | " + " | ".join(cells) + " |")
    return _cite("\n".join(lines), _named(*names))


#: The sizes the GPU goals are read at (``benchmarks/gpu_suite.py``): 64M float32 elements, the
#: top-k at 0.1% of 100M.
GOAL_N = 67_108_864
TOPK_N = 104_857_600


def kernels(doc: dict) -> str:
    """The GPU kernel benchmark at the goals' size (64M float32 elements; the top-k rows at their own
    size): time, GB/s over the minimal bytes, share of the copy bandwidth, speed-up over torch eager."""
    fp32 = [r for r in doc["results"] if r.get("dtype", "float32") == "float32"]
    n = GOAL_N if any(r["n"] == GOAL_N for r in fp32) else max(r["n"] for r in fp32)
    sizes = {r["n"] for r in fp32 if "topk" in r["kernel"]}
    topk_n = TOPK_N if TOPK_N in sizes else max(sizes, default=n)
    lines = [
        f"`python -m benchmarks.kernels` on {doc['device']} (torch {doc['torch']}, triton {doc['triton']}, "
        f"cupy {doc['cupy']}; {doc['date'][:10]}): float32, n = {n:,} (the top-k rows: {topk_n:,}); GB/s over "
        f"each op's minimal bytes; copy bandwidth {doc['copy_bandwidth_gbps']:.0f} GB/s (read + write)",
        "",
        "| kernel | backend | route | ms | GB/s | % of copy | × torch eager |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in fp32:
        if r["backend"] == "cupy" or r["n"] != (topk_n if "topk" in r["kernel"] else n):
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


def gpu_suite(doc: dict) -> str:
    """``benchmarks/gpu_suite.py``'s summary: every GPU goal, what was measured and the verdict."""
    lines = [
        f"`{_cmd(doc['command'])}` on {doc['device']} (torch {doc['torch']}; {doc['date'][:10]})",
        "",
        "| goal | item | measured | target | verdict |",
        "|---|---|---|---|---|",
    ]
    for r in doc["summary"]:
        lines.append(f"| {r['goal']} | {r['item']} | {r['measured']} | {r['target']} | {r['verdict']} |")
    return "\n".join(lines)


def gpu_step(doc: dict) -> str:
    """``benchmarks/gpu_step.py``: each method's codec time per step on each model (DDP's buckets
    through the protocol's dry run among ``world`` ranks), against the model's compute step."""
    models = doc["models"]
    names = list(models)
    methods = list(dict.fromkeys(m for v in models.values() for m in v["methods"]))
    lines = [
        f"`python -m benchmarks.gpu_step` on {doc['device']} (torch {doc['torch']}, triton {doc['triton']}; "
        f"{doc['date'][:10]}): {doc['world']} ranks, median of {doc['steps']} timed steps after {doc['warmup']}. "
        "Codec ms per step (× the compute step); break-even: the link speed below which the method beats plain "
        "allreduce.",
        "",
        "| method | "
        + " | ".join(
            f"{k}: {v['description']}, compute {v['compute_ms_per_step']:.1f} ms | {k} break-even"
            for k, v in models.items()
        )
        + " |",
        "|---|" + "---:|---:|" * len(names),
    ]
    for m in methods:
        cells = []
        for k in names:
            r = models[k]["methods"].get(m)
            if r is None:
                cells += ["not reached", ""]
                continue
            be = r.get("breakeven_gbps")
            cells += [
                f"{r['codec_ms_per_step']:,.1f} ({r['fraction_of_compute']:.2f}×)",
                "—" if be is None else f"{be:.1f} Gbit/s",
            ]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def hierarchy(*names: str) -> str:
    """benchmarks/hierarchy.py: step time per method on 2 emulated nodes, beside the cost model, one
    column group per run (world size); ``Hierarchical``'s ``local_size`` is each run's node size."""
    docs = [_load(n) for n in names]
    d0 = docs[0]

    def key(method: str) -> str:
        return re.sub(r", local_size=\d+", "", method)

    lines = [
        "; ".join(f"`{_cmd(d['command'])}`" for d in docs)
        + f" (2 nodes, inter-node link {d0['rate']}, MLP width {d0['width']} depth {d0['depth']}, batch "
        f"{d0['batch']}/rank, median of {d0['steps']} steps after {d0['warmup']}; {_machine(d0['machine'])}). "
        "Each cell: step (s), the model's error; the model's codec and wire seconds.",
        "",
        "| method | " + " | ".join(f"{d['world']} ranks: step, error | codec, wire (s)" for d in docs) + " |",
        "|---|" + "---:|---:|" * len(docs),
    ]
    for r0 in d0["rows"]:
        cells = []
        for d in docs:
            r = next((x for x in d["rows"] if key(x["method"]) == key(r0["method"])), None)
            if r is None:
                cells += ["", ""]
                continue
            m = r["model"]
            cells += [f"{r['step_s']:.3f}, {100 * r['model_error']:+.0f}%", f"{m['codec']:.3f}, {m['wire']:.3f}"]
        lines.append(f"| {key(r0['method'])} | " + " | ".join(cells) + " |")
    return _cite("\n".join(lines), _named(*names))


def plan(doc: dict) -> str:
    """A ``gradzip plan --json`` result: predicted step time (scaling efficiency) per method and world."""
    inp = doc["inputs"]
    worlds, methods = inp["worlds"], inp["methods"]
    cell = {(r["method"], r["world"]): r for r in doc["rows"]}
    link, intra = inp["link"], inp.get("intra_link")
    lines = [
        f"{inp['model']} ({inp['tensors']} tensors, {inp['dtype']}), {1e3 * inp['compute_s']:g} ms of compute "
        f"a step; link {link['bandwidth_bps'] / 1e9:g} Gbit/s, {1e6 * link['latency_s']:g} µs"
        + (
            f" per node of {inp['local_size']} ranks, {intra['bandwidth_bps'] / 1e9:g} Gbit/s, "
            f"{1e6 * intra['latency_s']:g} µs inside a node"
            if intra and inp.get("local_size")
            else ""
        )
        + f"; codec profile {doc['profile']['source']}, {doc['profile']['machine']['date']}. Each cell: predicted "
        "step in ms (compute / step).",
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
    lines += ["", f"{doc['recommendation'][:1].upper()}{doc['recommendation'][1:]}."]
    lines += [f"Note: {note}." for note in doc.get("notes", [])]
    return "\n".join(lines)


# -- FSDP2 (benchmarks/fsdp_bytes.py, benchmarks/fsdp_acceptance.py) -------------------------------
def fsdp_bytes(doc: dict) -> str:
    """Reduction bytes per rank per step on ``lo``, plain FSDP2 against gradzip.fsdp."""
    by = {}
    for s in doc["summary"]:
        by.setdefault((s["model"], s["layout"] == "fsdp", s["world"]), []).append(s)
    lines = [
        f"`{_cmd(doc['command'])}` ({doc['machine']['description']}, torch {doc['machine']['torch']}). "
        "kB per rank and step.",
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


def fsdp_zeropp(doc: dict) -> str:
    """``benchmarks/fsdp_zeropp.py``: whole FSDP2 steps' bytes on ``lo`` and, on 2 emulated nodes,
    inter- and intra-node bytes and step time (the script's own ``--table``)."""
    text = fsdp_zeropp_tables.table(doc)
    if not doc.get("loopback"):  # a --nodes-only run: the nodes' table alone
        text = text.split("\n\n", 1)[1]
    return f"`{_cmd(doc['command'])}` ({_machine(_as_machine(doc))})\n\n" + text


def fsdp_zeropp_runs(*names: str) -> str:
    """Several ``--nodes-only`` runs of ``fsdp_zeropp.py`` with the same options: each row's inter-node
    bytes, and its step time and speed-up over plain FSDP2 run by run."""
    docs = [_load(n) for n in names]
    runs = " / ".join(str(i + 1) for i in range(len(docs)))
    lines = [
        f"`{_cmd(docs[0]['command'])}`, {len(docs)} runs ({_machine(_as_machine(docs[0]))})",
        "",
        f"| 2 nodes x 2 ranks | inter-node bytes / step | vs plain | s / step (median), runs {runs} "
        f"| speed-up, runs {runs} | CPU s / rank / step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(docs[0]["nodes_2x2"]):
        rs = [d["nodes_2x2"][i] for d in docs]
        cpu = [statistics.median(x["cpu_seconds_per_step_by_rank"]) for x in rs]
        steps = " / ".join(f"{x['step_seconds_median']:.2f}" for x in rs)
        speedups = " / ".join(f"{x['speedup_vs_plain']:.2f}×" for x in rs)
        lines.append(
            f"| {r['label']} | {r['inter_node_bytes_per_step'] / 1e6:.1f} MB "
            f"| {r['inter_node_bytes_per_step_vs_plain']:.3f} "
            f"| {steps} | {speedups} | {min(cpu):.2f}–{max(cpu):.2f} |"
        )
    return _cite("\n".join(lines), _named(*names))


def fsdp_zeropp_loss(*names: str) -> str:
    """``benchmarks/fsdp_zeropp_loss.py``: final validation loss of each run, its mean over the seeds
    and each seed's against plain FSDP2's, one block of rows per file (per schedule)."""
    docs = [_load(n) for n in names]
    lines = [
        "; ".join(f"`{_cmd(d['command'])}` (`{n}`)" for n, d in zip(names, docs))
        + f" ({docs[0]['model']}; seeds {', '.join(map(str, docs[0]['seeds']))}; machine: "
        f"{_machine(docs[0]['machine'])})",
        "",
        "| run | file | mean validation loss | per seed, against plain FSDP2 |",
        "|---|---|---:|---|",
    ]
    for n, d in zip(names, docs):
        for run, v in d["summary"].items():
            rel = ", ".join(f"{100 * x:+.2f}%".replace("-", "−") for x in v["val_loss_rel_to_plain_per_seed"])
            lines.append(f"| {run} | `{n}` | {v['val_loss_mean']:.4f} | {'—' if run == 'plain FSDP2' else rel} |")
    return _cite("\n".join(lines), _named(*names))


def cpu_codec_cost_runs(*names: str) -> str:
    """Several runs of ``cpu_codec_cost.py`` with the same options: each codec's CPU time over the wire
    time its bytes save, run by run, with the median and the spread."""
    docs = [_load(n) for n in names]
    share = [{r["method"]: r["codec_over_saved"] for r in d["rows"]} for d in docs]
    lines = [
        f"Codec / saved in {len(docs)} runs of `{_cmd(docs[0]['command'])}`, one `--out` per file "
        f"({_machine(docs[0]['machine'])})",
        "",
        "| method | " + " | ".join(f"run {i + 1}" for i in range(len(docs))) + " | median | spread |",
        "|---|" + "---:|" * (len(docs) + 2),
    ]
    for r in docs[0]["rows"]:
        xs = [s.get(r["method"]) for s in share]
        if any(x is None for x in xs):
            continue
        lines.append(
            f"| `{r['method']}` | "
            + " | ".join(f"{100 * x:.0f}%" for x in xs)
            + f" | {100 * statistics.median(xs):.0f}% | {100 * min(xs):.0f}–{100 * max(xs):.0f}% |"
        )
    return _cite("\n".join(lines), _named(*names))


# -- the page --------------------------------------------------------------------------------------
#: The result files linked so far, in order: ``[`NAME`][i]`` links to the i-th, defined at the
#: page's end (a file name's inline link would be wider than a line).
_LINKED: list[str] = []


def _link(name: str) -> str:
    if name not in _LINKED:
        _LINKED.append(name)
    return f"[`{name}`][{_LINKED.index(name) + 1}]"


def _link_definitions() -> list[str]:
    return [f"[{i + 1}]: {LINK}{name}" for i, name in enumerate(_LINKED)]


def _named(*names: str) -> str:
    """``Files: ...`` linking the first of ``names`` (the run a table is printed from), naming the
    others and the CSV/PNG written beside each."""
    out = []
    for i, n in enumerate(names):
        stem = n[: -len(".json")] if n.endswith(".json") else None
        extra = [e for e in ("csv", "png") if stem and (RESULTS / f"{stem}.{e}").exists()]
        beside = "" if not extra else f" (`{stem}.{extra[0]}`)" if len(extra) == 1 else f" (`{stem}.{{csv,png}}`)"
        out.append((f"`{n}`" if i else _link(n)) + beside)
    return "Files: " + ", ".join(out) + "."


def _files(name: str) -> str:
    """``Files: ...`` naming the JSON and the CSV/PNG written beside it."""
    return _named(name)


def _cite(text: str, files: str) -> str:
    """``text`` with the sentence ``files`` at the end of its first paragraph (its command line), or
    as a paragraph of its own above it where ``text`` starts with a table."""
    if text.startswith("|"):
        return f"{files}\n\n{text}"
    first, sep, rest = text.partition("\n\n")
    stop = "" if first.endswith((".", ":")) else "."
    return f"{first}{stop} {files}{sep}{rest}"


def _with_files(render):
    def run(name: str) -> str:
        return _cite(render(_load(name)), _files(name))

    return run


#: Prose on the page is wrapped at this many characters (tables are not).
WIDTH = 110
#: A token that would start a block (heading, list item, quote, fence, table row, HTML) if a
#: wrapped line began with it.
_BLOCK_START = re.compile(r"#|[-+*]$|>|=+$|-+$|\d+[.)]$|```|~~~|\||<[a-zA-Z/!]")


def _wrap(line: str, width: int = WIDTH) -> list[str]:
    """``line`` (one paragraph or list item) as lines of at most ``width`` characters where its words
    allow, no continuation starting a markdown block; a list item's continuations indented."""
    if len(line) <= width:
        return [line]
    m = re.match(r"(\s*(?:[-*+]|\d+[.)])\s+)", line)
    indent = " " * len(m[1]) if m else ""
    words = line[len(m[1]) if m else 0 :].split()
    if m:
        words[0] = m[1] + words[0]
    out, cur = [], [words[0]]
    for w in words[1:]:
        if len(" ".join(cur)) + 1 + len(w) <= width:
            cur.append(w)
            continue
        nxt = [w]
        if _BLOCK_START.match(w) and len(cur) > 1:
            nxt = [cur.pop(), w]
        out.append(" ".join(cur))
        cur = nxt
    out.append(" ".join(cur))
    return [out[0], *(indent + x for x in out[1:])]


def _wrap_page(text: str) -> str:
    """Every prose line of ``text`` wrapped (:func:`_wrap`); tables, headings, fences, comments and
    link definitions left as they are."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.startswith(("```", "~~~")):
            fenced = not fenced
        if fenced or line.startswith(("|", "#", "<!--", "```", "~~~")) or re.match(r"\[[^\]]+\]: ", line):
            out.append(line)
        else:
            out.extend(_wrap(line))
    return "\n".join(out)


def _linkbytes(name: str) -> str:
    """``linkbytes.py``'s run: its command and machine, each method's measured bytes per world size
    with their growth, how far gradzip's own count is from them, and the targets."""
    doc = _load(name)
    cfg = doc["config"]
    gap = {}
    for r in doc["rows"]:
        if r.get("gradzip_bytes_link") is not None:
            gap.setdefault(r["method"], []).append(r["lo_over_gradzip"])
    lines = [
        f"`{_cmd(doc['command'])}` ({cfg['backend']}; MLP of {cfg['params'] / 1e6:.2f}M parameters, "
        "DDP default buckets, "
        f"batch {cfg['batch']}/rank; {cfg['steps']} steps after {cfg['warmup']}; {_machine(doc['machine'])})",
        "",
        linkbytes_report.scaling(doc).split("\n\n", 1)[-1],
        "",
        "`lo` over gradzip's own `stats()['bytes_link']`: "
        + f"{min(min(v) for v in gap.values()):.3f}–{max(max(v) for v in gap.values()):.3f} over the methods and "
        + "world sizes.",
    ]
    return _cite("\n".join(lines), _files(name))


def _streaming(name: str) -> str:
    """``streaming_report``'s first table and its targets (not how each sync went)."""
    doc = _load(name)
    doc["command"] = _cmd(doc["command"])
    text = "\n\n".join(streaming_report.report(doc, cpu=False).split("\n\n")[:3])
    return _cite(text, _files(name))


def _horovod(*names: str) -> str:
    return _cite(horovod(*names), _named(*names))


RENDERERS = {
    "accuracy": _with_files(accuracy),
    "lm": _with_files(lm),
    "adam_steps": adam_steps,
    "verdicts": verdicts,
    "headline": lambda: headline(),
    "horovod": _horovod,
    "streaming": _streaming,
    "linkbytes": _linkbytes,
    "hierarchy": hierarchy,
    "plan": _with_files(plan),
    "fsdp_bytes": _with_files(fsdp_bytes),
    "fsdp_acceptance": _with_files(fsdp_acceptance),
    "step_time": _with_files(step_time),
    "overhead": overhead,
    "plan_check": plan_check,
    "powersgd": _with_files(powersgd),
    "powersgd_runs": powersgd_runs,
    "powersgd_bucket_runs": lambda *names: powersgd_runs(
        *names,
        key="ratio_default_buckets_over_one",
        what="DDP's default buckets / one bucket,",
    ),
    "cpu_codec_cost": _with_files(cpu_codec_cost),
    "collectives": _with_files(collectives),
    "overlap": overlap,
    "kernels": _with_files(kernels),
    "gpu_suite": _with_files(gpu_suite),
    "gpu_step": _with_files(gpu_step),
    "fsdp_zeropp": _with_files(fsdp_zeropp),
    "fsdp_zeropp_runs": fsdp_zeropp_runs,
    "fsdp_zeropp_loss": fsdp_zeropp_loss,
    "cpu_codec_cost_runs": cpu_codec_cost_runs,
    "accuracy_columns": lambda: ACCURACY_COLUMNS,
    "lm_columns": lambda: LM_COLUMNS,
}

_DIRECTIVE = re.compile(r"^\{\{\s*(\w+)((?:\s+\S+)*)\s*\}\}$")


def page(template: str | None = None) -> str:
    """The results page: the template with every ``{{ KIND ARGS }}`` line rendered, its prose
    wrapped at :data:`WIDTH`, the result files' link definitions at the end."""
    text = TEMPLATE.read_text() if template is None else template
    _LINKED.clear()
    out = [
        "<!-- Written by `python -m benchmarks.report --page docs/results.md` from benchmarks/report_page.md",
        "     and the files under benchmarks/results/: edit those, then rerun it. -->",
        "",
    ]
    lines = [line for line in text.splitlines() if not (line.startswith("<!--") and line.endswith("-->"))]
    for line in lines:
        m = _DIRECTIVE.match(line.strip())
        if m is None:
            out.append(line)
            continue
        kind, args = m[1], m[2].split()
        if kind not in RENDERERS:
            raise ValueError(f"unknown table kind {kind!r} in {line!r}; known: {sorted(RENDERERS)}")
        out.append(RENDERERS[kind](*args))
    out += ["", *_link_definitions()]
    return _wrap_page("\n".join(out).strip()) + "\n"


def tables() -> str:
    """Every table of the top-level result files this script knows, in a fixed order."""
    names = sorted(p.name for p in RESULTS.glob("*.json") if p.name.startswith(("accuracy_", "diloco_")))
    _LINKED.clear()
    out = []
    for kind, name in (
        *(("accuracy", n) for n in names),
        ("hierarchy", "hierarchy.json"),
        ("step_time", "step_time.json"),
        ("step_time", "step_time_2ranks.json"),
        ("plan_check", "plan_check.json"),
        ("powersgd", "powersgd_cpu_gloo.json"),
        ("overhead", "overhead_2ranks.json"),
        ("kernels", "kernels_nvidia-h200.json"),
    ):
        if (RESULTS / name).exists():
            out += [RENDERERS[kind](name), ""]
    return "\n".join([*out, *_link_definitions()])


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
