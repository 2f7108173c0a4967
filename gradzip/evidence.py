"""What the project has measured of each method's accuracy: its gap to plain DDP on the bench's
tasks, for ``gradzip plan`` to rank by.

``python -m benchmarks.evidence`` reads every committed ``gradzip bench`` result
(``benchmarks/results/**/*.json`` with a ``config`` and ``rows``) and writes
``gradzip/costmodel/profiles/_evidence.json``, which ships with the package. Each row becomes
one entry: the method's canonical spelling (``repr(gz.parse(label))``, with the file's own hook
options folded in as a ``Hook(...)``), the task class (``lm``: the byte-level transformer;
``image``: MNIST or digits), the gap, the link-byte ratio, the seeds, the DDP-equivalent steps
(language model) and the file. Peer rows (``peer: ...``) are not gradzip's methods and are
left out.

A method **held** on a task class when every committed file of that class that measured it
puts it within :data:`HOLD` of DDP (mean over the file's seeds) and one of them ran at least
:data:`MIN_SEEDS` seeds: at most 2% above DDP's
validation loss on the language model, at most 0.5 points below DDP's test accuracy on the
image tasks. ``DDP`` and ``Identity`` are the baseline and hold everywhere.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from . import options

__all__ = [
    "HOLD",
    "TASKS",
    "EVIDENCE_PATH",
    "MIN_SEEDS",
    "key",
    "canonical",
    "entries_of",
    "build",
    "dumps",
    "load",
    "verdict",
    "describe",
    "task_of_layers",
]

#: Task classes, and the largest gap that still holds on each: the language model's in percent
#: of DDP's validation loss (higher is worse), the image tasks' in accuracy points (lower is worse).
HOLD = {"lm": 2.0, "image": 0.5}
TASKS = tuple(HOLD)
#: Seeds a file needs for its rows to make a method hold (a row of fewer seeds can still show
#: that it lost: a single seed's +48% is no noise).
MIN_SEEDS = 3
#: The shipped evidence (built by ``python -m benchmarks.evidence``).
EVIDENCE_PATH = os.path.join(options.PROFILE_DIR, "_evidence.json")
_DATASET_TASK = {"shakespeare": "lm", "mnist": "image", "digits": "image"}
_BASELINES = ("DDP", "Identity()")


def key(label: str, config: dict | None = None) -> str:
    """The canonical spelling of a method named ``label`` (``repr`` of what ``gz.parse`` builds;
    ``"DDP"`` for plain DDP). With a bench file's ``config``, the hook options it gave every
    row that change what is trained (``momentum_correction='off'``, ``precondition``) are
    folded in as a ``Hook(...)``, so that a row trained with them is not taken for the plain
    method. Momentum correction ``'on'`` and ``'auto'`` are the plain method: the bench's
    default applies it to the sparse codecs, as ``register_hook(optimizer=...)`` does (the
    README's recipes); a ``Hook`` left with no option is its method. Clipping is the file's,
    for the baseline and every row alike, and is not part of the key."""
    from .hook_row import Hook  # noqa: PLC0415 (the grammar's modules load torch)
    from .registry import Spec, parse  # noqa: PLC0415

    m = parse(label)
    if m is None:
        return "DDP"
    if isinstance(m, Spec):
        return repr(m)
    if config:
        extra = {}
        if config.get("momentum_correction") == "off":
            extra["momentum_correction"] = "off"
        if config.get("precondition"):
            extra["precondition"] = True
        if isinstance(m, Hook):
            extra = {k: v for k, v in extra.items() if getattr(m, k) is None}
            m = Hook(m.method, **{**m.options(), **extra})
        elif extra:
            m = Hook(m, **extra)
    return canonical(m)


def canonical(m) -> str:
    """The evidence's spelling of a parsed method ``m`` (what ``gz.parse`` or ``gradzip plan``
    built): ``"DDP"`` for plain DDP (``None``); a ``Hook`` without the options that do not
    change what is trained (momentum correction ``'on'``/``'auto'``), and without any option
    its method; else ``repr(m)``."""
    from .hook_row import Hook  # noqa: PLC0415

    if m is None:
        return "DDP"
    if isinstance(m, Hook):
        opts = m.options()
        if opts.get("momentum_correction") in ("auto", "on"):
            del opts["momentum_correction"]  # the bench's default for the codecs it matters to
        m = Hook(m.method, **opts) if opts else m.method
    return repr(m)


def entries_of(path: str, root: str) -> list[dict]:
    """The evidence one bench result file gives: one entry per row that is not a peer's
    (``[]`` for a file that is not a bench result)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError):
        return []
    cfg = doc.get("config") if isinstance(doc, dict) else None
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(cfg, dict) or not isinstance(rows, list) or cfg.get("dataset") not in _DATASET_TASK:
        return []
    task = _DATASET_TASK[cfg["dataset"]]
    out = []
    for r in rows:
        label = r.get("method", "")
        if label.startswith("peer:") or label in ("Identity", "Identity()", "DDP"):
            continue  # a peer's row, or the baseline itself
        if task == "lm":
            gap = r.get("gap_pct")
        else:
            gap = None if r.get("delta_accuracy") is None else 100 * r["delta_accuracy"]
        if gap is None:
            continue
        e = {
            "key": key(label, cfg),
            "label": label,
            "task": task,
            "dataset": cfg["dataset"],
            "optimizer": cfg.get("optimizer"),
            "workers": cfg.get("workers"),
            "lm_size": cfg.get("lm_size", "tiny") if task == "lm" else None,
            "seeds": len(cfg.get("seeds") or [cfg.get("seed")]),
            "gap": round(gap, 4),
            "ratio": round(r["ratio"], 3),
            "file": os.path.relpath(path, root),
        }
        if r.get("ddp_steps_pct") is not None:
            e["ddp_steps_pct"] = round(r["ddp_steps_pct"], 2)
        out.append(e)
    return out


def build(results_dir: str) -> dict:
    """The evidence of every bench result under ``results_dir`` (files in sorted order)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(results_dir)))  # the repository
    files = sorted(glob.glob(os.path.join(results_dir, "**", "*.json"), recursive=True))
    entries = [e for p in files for e in entries_of(p, root)]
    return {
        "hold": HOLD,
        "units": {"lm": "% of DDP's validation loss (+: worse)", "image": "accuracy points (-: worse)"},
        "entries": entries,
    }


def dumps(doc: dict) -> str:
    """The file's text: one entry a line."""
    head = {k: v for k, v in doc.items() if k != "entries"}
    lines = [json.dumps(e) for e in doc["entries"]]
    return json.dumps(head)[:-1] + ', "entries": [\n' + ",\n".join(lines) + "\n]}\n"


def load(path: str = EVIDENCE_PATH) -> dict:
    """The shipped evidence (``{"hold", "units", "entries"}``)."""
    with open(path) as f:
        return json.load(f)


def _held(task: str, gap: float) -> bool:
    return gap <= HOLD[task] if task == "lm" else gap >= -HOLD[task]


def _severity(e: dict) -> float:
    """How far an entry is from DDP, in units of its class's :data:`HOLD` (1: at the limit)."""
    return e["gap"] / HOLD["lm"] if e["task"] == "lm" else -e["gap"] / HOLD["image"]


def verdict(method_key: str, task: str, evidence: dict) -> dict[str, Any]:
    """What the evidence says of ``method_key`` (:func:`key`) on ``task`` (``lm``, ``image`` or
    ``any``: every class). ``held``: True (held in every file of every class asked that measured
    it, and measured on each class by a file of at least :data:`MIN_SEEDS` seeds), False (lost
    in one), None (otherwise: not measured, or on fewer seeds).
    ``worst``: the entry furthest from DDP (of those lost, if any); ``ddp_steps_pct``: the
    lowest DDP-equivalent steps measured (the language model), None without one."""
    if method_key in _BASELINES:
        return {"held": True, "worst": None, "ddp_steps_pct": 100.0, "baseline": True, "missing": []}
    classes = TASKS if task == "any" else (task,)
    found = [e for e in evidence["entries"] if e["key"] == method_key and e["task"] in classes]
    bad = [e for e in found if not _held(e["task"], e["gap"])]
    enough = {e["task"] for e in found if e["seeds"] >= MIN_SEEDS}
    if bad:
        held = False
    elif enough != set(classes):
        held = None
    else:
        held = True
    pool = bad or found
    steps = [e["ddp_steps_pct"] for e in found if "ddp_steps_pct" in e]
    return {
        "held": held,
        "worst": max(pool, key=_severity) if pool else None,
        "ddp_steps_pct": min(steps) if steps else None,
        "baseline": False,
        "missing": [c for c in classes if c not in enough],
    }


def describe(v: dict, task: str) -> str:
    """One line: ``held on lm: +0.73% val loss (shakespeare, adamw, 3 seeds, 4.0x; lm_...json)``."""
    if v["baseline"]:
        return "the baseline"
    e = v["worst"]
    if e is None:
        return f"no accuracy measured on {'any bench task' if task == 'any' else 'the ' + task + ' task'}"
    what = "val loss" if e["task"] == "lm" else "accuracy"
    unit = "%" if e["task"] == "lm" else " pp"
    seeds = f"{e['seeds']} seed{'s' if e['seeds'] != 1 else ''}"
    line = (
        f"{e['gap']:+.2f}{unit} {what} ({e['dataset']}, {e['optimizer']}, {seeds}, "
        f"{e['ratio']:.3g}x fewer link bytes; {e['file']})"
    )
    if v["held"] is None:
        return f"not measured on {' or '.join(v['missing'])} ({MIN_SEEDS}+ seeds); on {e['task']}: {line}"
    return f"{'held' if v['held'] else 'lost'} on {e['task']}: {line}"


def task_of_layers(names: list[str]) -> str | None:
    """``lm`` for a model whose tensor names show embeddings and attention (``wte``/``embed``/
    ``tok`` and ``attn``/``attention``/``qkv``/``q_proj``), ``image`` for convolutions
    (``conv``), else None."""
    low = [n.lower() for n in names]
    emb = any(t in n for n in low for t in ("wte", "embed", "tok"))
    att = any(t in n for n in low for t in ("attn", "attention", "qkv", "q_proj"))
    if emb and att:
        return "lm"
    if any("conv" in n for n in low):
        return "image"
    return None
