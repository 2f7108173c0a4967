"""``gradzip plan``: predict step time and scaling efficiency per method and world size.

    gradzip plan --params 25e6 --compute 120ms --bandwidth 1Gbit --latency 50us
    gradzip plan --state-dict model.pt --compute 300ms --bandwidth 10Gbit --latency 20us \\
        --worlds 2,4,8,16 --methods "DDP, TopK(ratio=0.001), PowerSGD(rank=4)" --plot plan.png

For every method and world size ``N`` the step is ``compute + codec + wire``
(:mod:`gradzip.costmodel`, ``docs/costmodel.md``): the bytes from dry runs of
each method's real exchange on the model's DDP buckets, the codec seconds from
a :class:`~gradzip.costmodel.CodecProfile` measured on this machine (or read
with ``--profile``), the wire from the ring formulas. Scaling efficiency is
``compute / step`` (weak scaling: the per-rank batch stays fixed, so one rank's
step is ``compute`` alone). It prints the step time and efficiency per method,
the fastest method per world size, a one-line recommendation, how to check its accuracy and
the plan's measured error band, and with ``--plot FILE`` draws both curves. ``--device h100``
reads the shipped H100 codec profile (``gradzip/costmodel/profiles/``); a method it has no
figure for is never costed with this CPU's codec times: its codec time is left out, its row
is marked ``*`` (dashed in the plot) and it is not ranked. ``--arch resnet50`` costs a named
architecture's real tensors (:data:`ARCHS`), ``--dtype`` sets the gradients'
dtype, ``--overlap`` hides the wire under the backward pass as DDP does.

FSDP2 steps (``FSDP2``, ``FSDP2(all_gather=Int8(block=256), reduce_scatter=Hierarchical(Int8()),
reshard_after_forward=2)``: plain FSDP2 and ``gradzip.fsdp.compress``) are costed by
:func:`gradzip.costmodel.fsdp.fsdp_step_cost`: per ``fully_shard`` unit of the model (a block),
the forward all-gather, the backward all-gather (over every rank, inside a node with
``reshard_after_forward=L``, or none) and the reduce-scatter.

Front ends that average now and then (``LocalSGD(period=8)``, ``DiLoCo(period=32,
compression=Int8(), fragments=4, delay=2)``) are costed by
:func:`gradzip.costmodel.periodic.periodic_step_cost` from the plain numbers their
``plan_terms`` gives (the sync's collectives every period, divided by the period;
per fragment when streaming; the wire hidden behind ``delay`` steps of compute).

Methods are ranked by accuracy first: ``--task`` (``lm``, ``image`` or ``any``; by default read
from ``--arch`` or the state dict's tensor names) picks the bench task class, and only methods
that held there (:mod:`gradzip.evidence`: the committed bench results, shipped as
``gradzip/costmodel/profiles/_evidence.json``) are ranked and recommended; the others are shown
with their measured gap. Where the bench measured a method's DDP-equivalent steps (the
language model), it is ranked by predicted time to DDP's quality, its step time over that
fraction of DDP's steps.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pickle
import sys
import time

import torch

import gradzip.args as args

from . import evidence, options
from .costmodel import CodecProfile, FSDPMethod, Link, WireCache, fsdp_step_cost, step_cost
from .costmodel.periodic import periodic_step_cost
from .hook_row import Hook
from .machine import machine
from .registry import Spec, load_methods, parse_list, register_value

load_methods()  # registering is defining: every module of gradzip's table that defines a method

DEFAULT_METHODS = options.PLAN_METHODS
DEFAULT_WORLDS = options.DEFAULT_WORLDS
BN_BUFFERS = ("running_mean", "running_var")


# -- methods -----------------------------------------------------------------------------
register_value("FSDP2", FSDPMethod)  # an FSDP2 step, plain (bare FSDP2) or through gradzip.fsdp


def parse_methods(
    spec: str, *, link: Link | None = None, profile=None, local_size: int | None = None, keys: dict | None = None
) -> dict:
    """``"DDP, TopK(ratio=0.01), PowerSGD(rank=2)"`` to ``{label: method}`` (``DDP``: ``None``).
    ``keys``, a dict, receives each label's spelling in the accuracy evidence
    (:func:`gradzip.evidence.key`: ``"DDP"`` for plain DDP and plain FSDP2).

    The method grammar of :mod:`gradzip.registry`: every registered codec and protocol,
    with arguments; a bench row's ``Hook(method, ...)`` is costed as its ``method``.
    ``Policy(..., auto=True)`` gets the plan's link and profile unless given,
    ``Hierarchical(...)`` the plan's ``local_size``.
    """
    methods = parse_list(spec, {"link": link, "profile": profile, "local_size": local_size})
    for label, m in methods.items():
        if keys is not None:
            plain_fsdp = m is FSDPMethod or (isinstance(m, FSDPMethod) and m.plain)
            keys[label] = "DDP" if plain_fsdp else evidence.canonical(m)
        if m is FSDPMethod:  # a bare FSDP2: plain FSDP2
            methods[label] = FSDPMethod()
        elif isinstance(m, Hook):  # a bench row's hook: its options change no byte of a step
            methods[label] = m.method
        frontend_terms(methods[label])  # a front end the plan cannot cost fails here, before any dry run
    return methods


def frontend_terms(method) -> dict | None:
    """``None`` for a codec or protocol; for a front end (a :class:`~gradzip.registry.Spec`),
    the plain numbers its ``plan_terms`` gives (``ValueError`` if it has none)."""
    if not isinstance(method, Spec):
        return None
    terms = getattr(method.cls, "plan_terms", None)
    if terms is None:
        raise ValueError(f"gradzip plan cannot cost the front end {method.cls.__name__} (it has no plan_terms)")
    return terms(*method.args, **method.kwargs)


def import_plugins(modules) -> None:
    """Import modules that define more methods (``--import``): registering is defining."""
    for name in modules or ():
        importlib.import_module(name)


# -- models ------------------------------------------------------------------------------
#: Stand-in matrices ``--params`` may make (a model of 10^11 parameters at 1024x1024).
MAX_STAND_INS = 100_000


def layers_from_params(count: int, layer_shape: tuple[int, int] = (1024, 1024)) -> list[tuple[str, tuple]]:
    """A stand-in model of ``count`` parameters: ``layer_shape`` matrices, then the rest as one
    ``(rows, layer_shape[1])`` matrix and a vector of what is left."""
    count = args.integer("params", count, 1)
    r, c = layer_shape
    if r < 1 or c < 1:
        raise ValueError(f"layer_shape must be two positive integers, got {layer_shape!r}")
    full, rest = divmod(count, r * c)
    if full > MAX_STAND_INS:
        raise ValueError(
            f"--params {count:,} makes {full:,} stand-in {r}x{c} matrices (at most {MAX_STAND_INS:,}): "
            "give a larger --layer-shape"
        )
    layers = [(f"layer{i}.weight", (r, c)) for i in range(full)]
    if rest // c:
        layers.append(("rest.weight", (rest // c, c)))
    if rest % c:
        layers.append(("rest.bias", (rest % c,)))
    return layers


def layers_from_state_dict(path: str) -> list[tuple[str, tuple]]:
    """``[(name, shape)]`` of the floating-point tensors of a saved ``state_dict``
    (or of its ``"state_dict"``/``"model"`` entry), minus BatchNorm running statistics."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise ValueError(
            f"{path}: not a file torch.load(weights_only=True) reads ({type(exc).__name__}); save the model's "
            "state_dict (torch.save(model.state_dict(), path)), not the model or another object"
        ) from None
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict):
        raise ValueError(f"{path}: expected a state_dict (a dict of tensors), got {type(sd).__name__}")
    layers = [
        (k, tuple(v.shape))
        for k, v in sd.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not k.endswith(BN_BUFFERS)
    ]
    if not layers:
        raise ValueError(f"{path}: no floating-point tensors in the state_dict")
    return layers


#: ``--arch`` names -> (family, blocks per stage or (layers, width)). ``gradzip plan`` costs each
#: DDP bucket of the real gradients, and a stand-in of equal matrices (``--params``) can choose
#: another method than the real tensors (PowerSGD's cost depends on each matrix's shape, DDP's
#: buckets on the tensors' sizes). These give the real parameter tensors, in parameter order
#: (DDP fills buckets from the last), without torchvision or transformers: torchvision's names
#: for the ResNets, Hugging Face's names and Conv1D shapes for GPT-2; BatchNorm's running
#: statistics are buffers, not gradients.
#:
#: =========== ================================================ ======= =============
#: name        layout                                           tensors parameters
#: =========== ================================================ ======= =============
#: resnet18    basic blocks 2-2-2-2, 1000 classes               62      11,689,512
#: resnet34    basic blocks 3-4-6-3                             110     21,797,672
#: resnet50    bottleneck blocks 3-4-6-3                        161     25,557,032
#: resnet101   bottleneck blocks 3-4-23-3                       314     44,549,160
#: resnet152   bottleneck blocks 3-8-36-3                       467     60,192,808
#: gpt2-small  12 layers, width 768, vocabulary 50257, ctx 1024 148     124,439,808
#: gpt2-medium 24 layers, width 1024                            292     354,823,168
#: gpt2-large  36 layers, width 1280                            436     774,030,080
#: gpt2-xl     48 layers, width 1600                            580     1,557,611,200
#: =========== ================================================ ======= =============
ARCHS: dict[str, tuple[str, tuple[int, ...]]] = {
    "resnet18": ("resnet-basic", (2, 2, 2, 2)),
    "resnet34": ("resnet-basic", (3, 4, 6, 3)),
    "resnet50": ("resnet-bottleneck", (3, 4, 6, 3)),
    "resnet101": ("resnet-bottleneck", (3, 4, 23, 3)),
    "resnet152": ("resnet-bottleneck", (3, 8, 36, 3)),
    "gpt2-small": ("gpt2", (12, 768)),
    "gpt2-medium": ("gpt2", (24, 1024)),
    "gpt2-large": ("gpt2", (36, 1280)),
    "gpt2-xl": ("gpt2", (48, 1600)),
}


def _bn(name: str, c: int) -> list[tuple[str, tuple]]:
    return [(f"{name}.weight", (c,)), (f"{name}.bias", (c,))]


def _resnet(blocks: tuple[int, ...], bottleneck: bool, classes: int = 1000) -> list[tuple[str, tuple]]:
    layers = [("conv1.weight", (64, 3, 7, 7)), *_bn("bn1", 64)]
    cin, expansion = 64, 4 if bottleneck else 1
    for stage, n in enumerate(blocks):
        width = 64 * 2**stage
        cout = expansion * width
        for j in range(n):
            p = f"layer{stage + 1}.{j}"
            if bottleneck:
                layers += [(f"{p}.conv1.weight", (width, cin, 1, 1)), *_bn(f"{p}.bn1", width)]
                layers += [(f"{p}.conv2.weight", (width, width, 3, 3)), *_bn(f"{p}.bn2", width)]
                layers += [(f"{p}.conv3.weight", (cout, width, 1, 1)), *_bn(f"{p}.bn3", cout)]
            else:
                layers += [(f"{p}.conv1.weight", (width, cin, 3, 3)), *_bn(f"{p}.bn1", width)]
                layers += [(f"{p}.conv2.weight", (width, width, 3, 3)), *_bn(f"{p}.bn2", width)]
            if j == 0 and (stage > 0 or cin != cout):  # a stride-2 or widening block projects its input
                layers += [(f"{p}.downsample.0.weight", (cout, cin, 1, 1)), *_bn(f"{p}.downsample.1", cout)]
            cin = cout
    return layers + [("fc.weight", (classes, cin)), ("fc.bias", (classes,))]


def _gpt2(n_layer: int, d: int, vocab: int = 50257, ctx: int = 1024) -> list[tuple[str, tuple]]:
    layers = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(n_layer):
        h = f"h.{i}"
        layers += [
            *_bn(f"{h}.ln_1", d),
            (f"{h}.attn.c_attn.weight", (d, 3 * d)),
            (f"{h}.attn.c_attn.bias", (3 * d,)),
            (f"{h}.attn.c_proj.weight", (d, d)),
            (f"{h}.attn.c_proj.bias", (d,)),
            *_bn(f"{h}.ln_2", d),
            (f"{h}.mlp.c_fc.weight", (d, 4 * d)),
            (f"{h}.mlp.c_fc.bias", (4 * d,)),
            (f"{h}.mlp.c_proj.weight", (4 * d, d)),
            (f"{h}.mlp.c_proj.bias", (d,)),
        ]
    return layers + _bn("ln_f", d)  # the output layer is the token embedding (tied)


def layers_from_arch(name: str) -> list[tuple[str, tuple]]:
    """``[(name, shape)]`` of the parameters of the architecture ``name`` (:data:`ARCHS`), for ``--arch``."""
    try:
        family, shape = ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown architecture {name!r}; choose from {', '.join(ARCHS)}") from None
    if family == "gpt2":
        return _gpt2(*shape)
    return _resnet(shape, bottleneck=family == "resnet-bottleneck")


# -- projection ----------------------------------------------------------------------------
def project(
    layers,
    compute_s: float,
    link: Link,
    worlds,
    methods: dict,
    profile: CodecProfile,
    *,
    bucket_cap_mb: float = 25.0,
    progress=None,
    local_size: int = 1,
    intra: Link | None = None,
    dtype: torch.dtype = torch.float32,
    overlap: bool = False,
    mark: bool = False,
) -> list[dict]:
    """One row per (method, world size): ``StepCost.as_dict()`` plus ``label``, ``speedup`` and
    ``codec_not_measured``. ``overlap`` applies to DDP-style methods
    (:func:`~gradzip.costmodel.step_cost`); a front end that averages now and then has its own
    (``delay``). ``mark``: the profile is another device's; a method any of whose codec seconds
    the profile's own figures did not give (``CodecProfile.fallbacks``: measured on this machine,
    or left out) lists those compressors in ``codec_not_measured`` in all its rows."""
    worlds = sorted(set(worlds))
    probe = (min(w for w in worlds if w > 1), max(worlds)) if any(w > 1 for w in worlds) else None
    cache = WireCache(probe_worlds=probe)
    rows = []
    for label, method in methods.items():
        t0 = time.perf_counter()
        seen = len(profile.fallbacks)
        first = len(rows)
        terms = frontend_terms(method)
        for n in worlds:
            if isinstance(method, FSDPMethod):
                sc = fsdp_step_cost(
                    method,
                    layers,
                    n,
                    link,
                    compute_s,
                    profile,
                    dtype=dtype,
                    cache=cache,
                    label=label,
                    local_size=local_size,
                    intra=intra,
                    overlap=overlap,
                )
            elif terms is not None:
                sc = periodic_step_cost(
                    terms["compression"],
                    layers,
                    n,
                    link,
                    compute_s,
                    profile,
                    period=terms["period"],
                    fragments=terms["fragments"],
                    delay=terms["delay"],
                    cache=cache,
                    label=label,
                    dtype=dtype,
                )
            else:
                sc = step_cost(
                    method,
                    layers,
                    n,
                    link,
                    compute_s,
                    profile,
                    bucket_cap_mb=bucket_cap_mb,
                    cache=cache,
                    label=label,
                    local_size=local_size,
                    intra=intra,
                    dtype=dtype,
                    overlap=overlap,
                )
            d = sc.as_dict()
            d.update(label=label, speedup=n * sc.efficiency)
            rows.append(d)
        missing = sorted(set(profile.fallbacks[seen:])) if mark else []
        for d in rows[first:]:
            d["codec_not_measured"] = missing
        if progress is not None:
            progress(label, time.perf_counter() - t0)
    return rows


def ranked(row: dict) -> bool:
    """A row whose codec seconds all come from the profile's device (``codec_not_measured`` empty)."""
    return not row.get("codec_not_measured")


def held(row: dict) -> bool:
    """A row whose method held on the plan's task (``accuracy["held"]`` True); a row without
    an accuracy verdict (a plan made without one) counts as held."""
    acc = row.get("accuracy")
    return acc is None or acc["held"] is True


def quality_s(row: dict) -> float:
    """What a row is ranked by: its step time, over its DDP-equivalent steps where the bench
    measured them (a method that reaches in 90 steps the loss DDP reaches in 81 needs
    ``1 / 0.9`` of its steps per DDP step: predicted time to DDP's quality)."""
    return row.get("quality_s", row["total_s"])


def best_per_world(rows: list[dict]) -> dict[int, str]:
    """Per world size, the ranked method (:func:`ranked`) that held (:func:`held`) with the
    least :func:`quality_s` (a world where none qualifies has none)."""
    best: dict[int, dict] = {}
    for r in rows:
        if not ranked(r) or not held(r):
            continue
        b = best.get(r["world"])
        if b is None or quality_s(r) < quality_s(b):
            best[r["world"]] = r
    return {n: r["label"] for n, r in sorted(best.items())}


def attach_accuracy(rows: list[dict], keys: dict, task: str, evid: dict) -> list[str]:
    """Each row's ``accuracy`` (the evidence's :func:`~gradzip.evidence.verdict` for its method on
    ``task``, with ``note``, its one-line description) and ``quality_s`` (:func:`quality_s`:
    the step time over the DDP-equivalent steps, where every method that held has them
    measured; else the step time). Returns the methods that held without that figure."""
    verdicts = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        v = evidence.verdict(keys.get(label, label), task, evid)
        v = {**v, "note": evidence.describe(v, task)}
        verdicts[label] = v
    # Time to DDP's quality only where every method that held has its DDP-equivalent steps
    # measured: a method without them must not win for lack of a figure.
    uncounted = [lab for lab, v in verdicts.items() if v["held"] and v["ddp_steps_pct"] is None]
    for r in rows:
        v = verdicts[r["label"]]
        r["accuracy"] = {k: v[k] for k in ("held", "ddp_steps_pct", "note")}
        eff = v["ddp_steps_pct"] if v["held"] and not uncounted else None
        r["quality_s"] = r["total_s"] * 100 / min(100.0, eff) if eff else r["total_s"]
    return uncounted


def format_table(rows: list[dict], unmeasured: str = "") -> str:
    """The table; a row that is not ranked (:func:`ranked`) carries ``*`` and the line
    ``unmeasured`` (what its figures are) follows the table."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    worlds = sorted({r["world"] for r in rows})
    at = {(r["label"], r["world"]): r for r in rows}
    best = best_per_world(rows)
    marked = {r["label"] for r in rows if not ranked(r)}
    unheld = {r["label"] for r in rows if not held(r)}
    short = {
        lab: f"[{i + 1}]{'*' if lab in marked else ''}{'!' if lab in unheld else ''}" for i, lab in enumerate(labels)
    }
    width, nw = 16, max([5, *(len(str(n)) for n in worlds)])
    lines = ["methods: " + "; ".join(f"{short[lab]} {lab}" for lab in labels), ""]
    head = f"{'N':>{nw}} | " + " | ".join(f"{short[lab]:>{width}}" for lab in labels) + " | best"
    lines += [
        "step time in ms (scaling efficiency = compute / step)",
        head,
        "-" * len(head),
    ]
    for n in worlds:
        cells = []
        for lab in labels:
            r = at[(lab, n)]
            mark = " " if ranked(r) and held(r) else ("*" if not ranked(r) else "!")
            cells.append(f"{1e3 * r['total_s']:>8.1f} ({100 * r['efficiency']:>3.0f}%){mark}".rjust(width))
        pick = f"{short[best[n]]} {best[n]}" if n in best else "none qualifies"
        lines.append(f"{n:>{nw}} | " + " | ".join(cells) + f" | {pick}")
    if marked:
        missing = sorted({c for r in rows for c in r.get("codec_not_measured", ())})
        lines.append(
            f"* not ranked ({unmeasured or 'codec seconds not from the profile'}): no figure for {', '.join(missing)}"
        )
    if unheld:
        lines.append("! not ranked: did not hold on the task, or not measured there (accuracy below)")
    if any("accuracy" in r for r in rows):
        first = {r["label"]: r for r in reversed(rows)}
        lines += ["", "accuracy (the bench's measured gap to DDP; the best column ranks only methods that held):"]
        lines += [f"  {short[lab]} {lab}: {first[lab]['accuracy']['note']}" for lab in labels]
    return "\n".join(lines)


def plot_lines(rows: list[dict], unmeasured: str = "codec not measured") -> list[tuple[str, str, list[dict]]]:
    """``(legend label, line style, rows by world size)`` per method, as :func:`plot` draws
    them: a method that is not ranked (:func:`ranked`) dashed, its label saying ``unmeasured``."""
    lines = []
    for lab in dict.fromkeys(r["label"] for r in rows):
        rs = sorted((r for r in rows if r["label"] == lab), key=lambda r: r["world"])
        ok = all(ranked(r) for r in rs)
        lines.append((lab if ok else f"{lab} ({unmeasured})", "-" if ok else "--", rs))
    return lines


def plot(rows: list[dict], path: str, title: str = "", unmeasured: str = "codec not measured") -> str:
    """Step time and efficiency per method (:func:`plot_lines`)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, ls, rs in plot_lines(rows, unmeasured):
        ns = [r["world"] for r in rs]
        ax1.plot(ns, [1e3 * r["total_s"] for r in rs], marker="o", ms=3, ls=ls, label=label)
        ax2.plot(ns, [100 * r["efficiency"] for r in rs], marker="o", ms=3, ls=ls, label=label)
    ax1.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="predicted step time (ms)")
    ax2.set(xscale="log", xlabel="ranks N", ylabel="scaling efficiency (%) = compute / step", ylim=(0, 105))
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    handles, names = ax1.get_legend_handles_labels()
    ncol = min(3, len(names))
    fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    rows_of_legend = math.ceil(len(names) / ncol)
    fig.tight_layout(rect=(0, 0.04 + 0.045 * rows_of_legend, 1, 0.96))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- command line ----------------------------------------------------------------------------
#: The options (checked while parsing, before torch loads) live in gradzip.options.
add_arguments = options.add_plan_arguments


TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def error_band() -> dict:
    """The plan's measured error (``gradzip/costmodel/profiles/_plan_check.json``, built by
    ``benchmarks/h100_profile.py`` from ``benchmarks/results/plan_check.json``)."""
    with open(os.path.join(options.PROFILE_DIR, "_plan_check.json")) as f:
        return json.load(f)


def format_band(b: dict) -> str:
    m = b["machine"]
    ranks = [str(r) for r in b["ranks"]]
    said = ", ".join(ranks[:-1]) + " and " + ranks[-1] if len(ranks) > 1 else "".join(ranks)
    return (
        f"error band: on {b['rows']} measured steps ({said} gloo ranks, "
        f"{m['cores']}-core {m['cpu']} CPU, torch {m['torch']}; {b['source']}) the plan was off by a median "
        f"{100 * b['median_abs_error']:.0f}%, 8 in 10 steps within {100 * b['p10']:+.0f}%..{100 * b['p90']:+.0f}% "
        f"(negative: the plan too fast; worst {100 * b['min']:+.0f}% and {100 * b['max']:+.0f}%); "
        f"not validated on GPUs nor beyond {max(b['ranks'])} ranks"
    )


def recommend(rows: list[dict], band: float, unmeasured: str = "", lower_bound: bool = False) -> str:
    """One line: per range of world sizes the method :func:`best_per_world` picks (ranked and held
    on the task, least :func:`quality_s`) and its predicted gain over plain DDP (in time to DDP's
    quality where the bench measured its step efficiency); a gain smaller than ``band`` (the
    median error) is called within the band. Methods predicted faster that did not hold are
    named as not recommended; methods that are not ranked (:func:`ranked`) are named, with
    ``unmeasured`` (why); with ``lower_bound`` (their rows leave the codec out), those whose row
    is below the best say so."""
    at = {(r["label"], r["world"]): r for r in rows}
    best = best_per_world(rows)
    runs: list[list] = []
    for n, lab in best.items():
        if runs and runs[-1][0] == lab:
            runs[-1][2] = n
        else:
            runs.append([lab, n, n])
    parts = []
    for lab, lo, hi in runs:
        where = f"{lo} ranks" if lo == hi else f"{lo}-{hi} ranks"
        span_n = [n for n in best if lo <= n <= hi]
        gains = [quality_s(at[("DDP", n)]) / quality_s(at[(lab, n)]) for n in span_n if ("DDP", n) in at]
        steps = {at[(lab, n)].get("accuracy", {}).get("ddp_steps_pct") for n in span_n}
        counted = " to DDP's quality" if any(p is not None and p < 100 for p in steps) else ""
        if lab == "DDP" or not gains:
            parts.append(f"{lab} at {where}")
        elif max(gains) < 1 + band:
            parts.append(
                f"DDP at {where} ({lab} is predicted at most {max(gains):.2f}x faster{counted}, within the error band)"
            )
        else:
            span = (
                f"{min(gains):.2g}x"
                if f"{min(gains):.2g}" == f"{max(gains):.2g}"
                else f"{min(gains):.2g}x-{max(gains):.2g}x"
            )
            parts.append(f"{lab} at {where} ({span} DDP's predicted speed{counted})")
    faster_unheld = list(
        dict.fromkeys(
            r["label"]
            for r in rows
            if not held(r) and r["world"] in best and r["total_s"] < at[(best[r["world"]], r["world"])]["total_s"]
        )
    )
    if faster_unheld:
        parts.append(
            f"not recommended although predicted faster: {', '.join(faster_unheld)} (did not hold on the task or "
            "not measured there: see accuracy)"
        )
    unranked = list(dict.fromkeys(r["label"] for r in rows if not ranked(r)))
    if unranked:
        parts.append(f"not ranked: {', '.join(unranked)} ({unmeasured or 'codec seconds not from the profile'})")
    if lower_bound:
        unheld = {r["label"] for r in rows if not held(r)}
        for lab in (lab for lab in unranked if lab not in unheld):
            below = [n for n, b in best.items() if (lab, n) in at and at[(lab, n)]["total_s"] < at[(b, n)]["total_s"]]
            if below:
                parts.append(
                    f"{lab} could be faster: without its codec time it is below the best at "
                    f"{', '.join(map(str, below))} ranks (measure it there before choosing)"
                )
    return "recommendation: " + ("; ".join(parts) or "none")


def advice(rows: list[dict], methods: dict) -> str:
    """How to check what the recommended methods cost in accuracy on the user's own model (the
    bench's evidence comes from small models: a user's model may differ)."""
    picks = [lab for lab in dict.fromkeys(best_per_world(rows).values()) if lab != "DDP"]
    if not picks:
        return "accuracy: plain DDP is the pick; it trains as before."
    lab = picks[0]
    spec = lab.replace('"', "'")
    m = methods.get(lab)
    likewise = f" (likewise for {', '.join(picks[1:])})" if len(picks) > 1 else ""
    if isinstance(m, FSDPMethod):
        if m.plain:
            return "accuracy: plain FSDP2 trains as plain FSDP2 does: nothing to check." + likewise
        given = (("reduce_scatter", m.reduce_scatter), ("all_gather", m.all_gather))
        kw = ", ".join(f"{k}=gz.parse({repr(v)!r})" for k, v in given if v is not None)
        return (
            f"accuracy: the bench measured it on small models only. Before switching to {lab}, "
            f"compare it with plain FSDP2 on your own model: shard with `fully_shard(..., "
            f"reshard_after_forward={m.reshard_after_forward!r})`, train with `gz.fsdp.compress(model, {kw})` for "
            "the same steps and seeds as a plain FSDP2 run and compare the validation loss (benchmarks/"
            f"fsdp_zeropp_loss.py does so for a byte-level GPT){likewise}."
        )
    if isinstance(m, Spec):
        own = (
            f"wrap your optimizer in `{spec}` as the README's local SGD section shows, for the same steps and "
            "seeds as a plain run"
        )
    else:
        own = (
            f'train with `register_hook(ddp_model, gz.parse("{spec}"))` (from gradzip.hooks) for the same steps '
            "and seeds as a plain DDP run"
        )
    return (
        f"accuracy: the bench measured it on small models (the accuracy lines above). Before switching to {lab}, "
        f"compare it with plain DDP on your own model: {own}, then compare the validation loss"
        + likewise
        + f'; `gradzip bench --dataset shakespeare --methods "{spec}"` repeats the language-model measurement.'
    )


def run(args) -> int:
    notes_compute = []
    if args.latency is None:
        args.latency = options.DEFAULT_LATENCY_S
        notes_compute.append(f"no --latency given: {1e6 * args.latency:g} us assumed (a TCP link inside a data centre)")
    link = Link(args.bandwidth, args.latency)
    if args.compute is None:
        args.compute = options.DEFAULT_COMPUTE_S
        notes_compute.append(
            f"no --compute given: {1e3 * args.compute:g} ms of forward+backward per step assumed (time one step of "
            "your model on one device and give it: the gain of every method depends on it)"
        )
    dtype_name = TORCH_DTYPES[args.dtype]
    dtype = getattr(torch, dtype_name)
    notes = notes_compute
    try:
        if args.plot:
            missing = options.missing_bench_extras("digits", True)
            if "matplotlib" in missing:
                raise ImportError(
                    "--plot needs matplotlib, which is not installed (pip install matplotlib, "
                    "or 'gradzip[bench]'); leave --plot out for the table alone"
                )
        import_plugins(args.plugins)
        if args.device not in (None, "cpu") and args.profile:
            raise ValueError("give --device or --profile, not both")
        options.check_local_size(args.local_size, args.worlds)
        device = args.device or "cpu"
        mark, unmeasured = False, ""
        if args.profile:
            profile = CodecProfile.load(args.profile, measure_missing=True)
            pm, here = profile.machine or {}, machine()
            where = pm.get("device") or pm.get("cpu", "an unnamed machine")
            mark = bool(pm.get("device") or pm.get("gpu")) or pm.get("cpu") != here["cpu"]
            unmeasured = f"codec seconds partly measured on this machine's CPU, not on {where}"
            source = f"read from {args.profile} (measured on {where}); missing entries measured here"
        elif device != "cpu":  # a shipped profile: what it lacks stays unknown, never this CPU's figure
            path = os.path.join(options.PROFILE_DIR, f"{device}.json")
            with open(path) as f:
                timing = json.load(f).get("timing")
            profile = CodecProfile.load(path, missing="omit")
            mark = True
            unmeasured = f"codec time not measured on {device}, left out: a lower bound"
            source = f"shipped for {device} ({path}, from {(profile.machine or {}).get('source', '?')}): " + (
                timing
                or "kernel times only, without Python and launch overhead, so a lower bound; "
                "FP16/BF16 from the measured copy bandwidth"
            )
        else:
            profile = CodecProfile(
                sizes=args.profile_sizes, repeats=args.repeats, threads=args.threads, dtype=dtype_name
            )
            source = (
                f"measured on this machine's CPU (sizes {args.profile_sizes[0]} and {args.profile_sizes[1]}, "
                f"{dtype_name}, fastest of {args.repeats}, {args.threads} thread(s))"
            )
        if (args.profile or device != "cpu") and profile.dtype != dtype_name:
            profile.elem_scale = dtype.itemsize / getattr(torch, profile.dtype).itemsize
            notes.append(
                f"the codec profile was measured at {profile.dtype}: its per-element seconds are scaled "
                f"by {profile.elem_scale:g} for {dtype_name} gradients (an assumption: codecs bound by "
                "memory traffic)"
            )
        intra = None
        if args.intra_bandwidth is not None or args.intra_latency is not None:
            intra = Link(
                args.intra_bandwidth or args.bandwidth,
                args.latency if args.intra_latency is None else args.intra_latency,
            )
        keys: dict = {}
        methods = parse_methods(args.methods, link=link, profile=profile, local_size=args.local_size, keys=keys)
        if args.overlap and any(isinstance(m, Spec) for m in methods.values()):
            notes.append(
                "--overlap applies to DDP-style methods only; LocalSGD/DiLoCo rows hide their wire by their own delay="
            )
        if args.state_dict:
            layers = layers_from_state_dict(args.state_dict)
            what = args.state_dict
        elif getattr(args, "arch", None):
            layers = layers_from_arch(args.arch)
            what = f"{args.arch} (its real tensors)"
        else:
            layers = layers_from_params(args.params, args.layer_shape)
            shape = f"{args.layer_shape[0]}x{args.layer_shape[1]}"
            what = f"{args.params:,} parameters as {shape} matrices (stand-ins)"
            notes.append(
                f"--params models the gradients as {shape} stand-in matrices: a model's real tensors can change "
                "the choice (PowerSGD's cost follows each matrix's shape, DDP's buckets the tensors' sizes); "
                f"--arch ({', '.join(options.ARCHS)}) or --state-dict FILE costs the real ones"
            )
        band = error_band()
        evid = evidence.load()
        task, task_why = args.task, "--task"
        if task is None:
            if getattr(args, "arch", None):
                task, task_why = ("lm" if args.arch.startswith("gpt") else "image"), f"--arch {args.arch}"
            elif args.state_dict:
                task = evidence.task_of_layers([n for n, _ in layers])
                task_why = "the state dict's tensor names"
            task = task or "any"
            if task == "any":
                task_why = "the model's kind is unknown (give --task lm or --task image)"
    except (OSError, ValueError, TypeError, ImportError, json.JSONDecodeError) as exc:
        print(f"gradzip plan: {exc}", file=sys.stderr)
        return 2
    nparams = sum(math.prod(s) for _, s in layers)
    print(
        f"gradzip plan: {what}: {nparams:,} {args.dtype} gradients in {len(layers)} tensors "
        f"({dtype.itemsize * nparams / 2**20:.1f} MiB); compute {1e3 * args.compute:g} ms/step; link {link}"
        + (f" per node of {args.local_size} ranks, {intra or link} inside a node" if args.local_size > 1 else "")
        + ("; backward overlapped with the wire" if args.overlap else ""),
        flush=True,
    )
    print(f"codec profile: {source}", flush=True)

    if task == "none":
        print("ranking: by predicted step time alone (--task none: accuracy not considered)", flush=True)
    else:
        what_task = {"lm": "a transformer language model", "image": "a CNN", "any": "every bench task"}[task]
        print(f"ranking: only the methods that held on {what_task} ({task_why})", flush=True)

    def progress(label, secs):
        print(f"  (costed {label} in {secs:.1f} s)", flush=True)

    rows = project(
        layers,
        args.compute,
        link,
        args.worlds,
        methods,
        profile,
        bucket_cap_mb=args.bucket_cap_mb,
        progress=progress,
        local_size=args.local_size,
        intra=intra,
        dtype=dtype,
        overlap=args.overlap,
        mark=mark,
    )
    if task != "none":
        uncounted = attach_accuracy(rows, keys, task, evid)
        if uncounted:
            notes.append(
                f"ranked by step time, not time to DDP's quality: the bench has no DDP-equivalent steps for "
                f"{', '.join(uncounted)}"
            )
    if profile.measured_here and args.profile:
        notes.append(
            f"no fit in the profile for {', '.join(dict.fromkeys(profile.measured_here))}: "
            "codec seconds measured on this machine's CPU instead" + (" (rows marked *, not ranked)" if mark else "")
        )
    if profile.not_measured:
        notes.append(
            f"no {device} figure for {', '.join(profile.not_measured)}: left out, not taken from this CPU; "
            "python -m benchmarks.gpu_suite measures every method on a device (or give --profile FILE measured there)"
        )
    recommendation = recommend(rows, band["median_abs_error"], unmeasured, lower_bound=not args.profile)
    print()
    print(format_table(rows, unmeasured))
    print()
    print(recommendation)
    print(advice(rows, methods))
    print(format_band(band))
    for note in notes:
        print(f"note: {note}")
    if args.save_profile:
        profile.save(args.save_profile)
        print(f"wrote {args.save_profile}")
    if args.plot:
        plot(
            rows,
            args.plot,
            title=f"{what}; compute {1e3 * args.compute:g} ms; {link}",
            unmeasured=f"codec not measured on {device}" if device != "cpu" else "codec partly measured here",
        )
        print(f"wrote {args.plot}")
    if args.json:
        out = {
            "inputs": {
                "model": what,
                "params": nparams,
                "tensors": len(layers),
                "dtype": args.dtype,
                "compute_s": args.compute,
                "link": link.to_dict(),
                "local_size": args.local_size,
                "intra_link": intra.to_dict() if intra is not None else None,
                "worlds": sorted(set(args.worlds)),
                "bucket_cap_mb": args.bucket_cap_mb,
                "overlap": args.overlap,
                "device": args.device,
                "arch": getattr(args, "arch", None),
                "methods": list(methods),
                "task": task,
            },
            "profile": {"source": source, "measured_here": profile.measured_here, **profile.to_dict()},
            "best": {str(k): v for k, v in best_per_world(rows).items()},
            "recommendation": recommendation,
            "advice": advice(rows, methods),
            "not_ranked": {"why": unmeasured, "methods": sorted({r["label"] for r in rows if not ranked(r)})},
            "error_band": band,
            "notes": notes,
            "rows": rows,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gradzip plan", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
