"""Build the shipped codec profiles of ``gradzip plan --device NAME`` and the plan's error band.

    python -m benchmarks.h100_profile

Reads committed measurements and writes small files inside the package
(``gradzip/costmodel/profiles/``):

* ``benchmarks/results/codec_profile_<device>.json`` (the ``profile`` part of
  ``benchmarks/gpu_suite.py``: every codec and protocol of the grammar timed as whole calls on
  that device) -> ``<name>.json``, ``name`` the device's short name (``h100``, ``h200``:
  :func:`device_key`). Its entries as measured, and per class a fit for every measured config
  (:func:`derive_classes`), so that a config that was not measured (``TopK(ratio=0.001)``) takes
  the fit of the measured one of its class that agrees on the arguments that differ among the
  measured ones (``TopK``'s ``mode``) and on every nested method. Nothing else is filled in:
  ``gradzip plan`` leaves out the codec time of what no fit covers and marks the row.
* ``benchmarks/results/kernels_nvidia-h100-80gb-hbm3.json`` (``benchmarks/kernels.py`` on a lent
  NVIDIA H100 80GB HBM3, 1M to 256M float32 elements) -> ``h100.json``, unless a measured
  ``codec_profile_`` file of an H100 exists: per codec class, the line through the smallest and
  the largest size of its encode kernel (``encode_s``, ``encode_s_per_elem``) and of its decode
  kernel divided by the peers it decoded (``peer_s``, ``peer_s_per_elem``), Triton backend,
  clipped at 0 as ``measure_codec`` clips. These are **kernel times only**: the torch glue,
  Python and launch overheads of a codec call are not in them, so the codec seconds they give
  are a lower bound. ``TopK`` by its mode: ``exact`` (the default) from ``torch.topk``'s time in
  the same run, ``sampled`` from the sampled kernel (``approx`` where the file has its rows).
  FP16 and BF16 have no kernel row; their fit is the copy bound: 12 bytes per element (read 4,
  write 2 to encode; read 2, write 4 to decode) over the copy bandwidth measured in the same
  run. Classes the JSON has no figure for (PowerSGD, Int8, TernGrad, RandomK, Identity, ...)
  are left out, and ``gradzip plan --device h100`` marks their rows.
* ``benchmarks/results/plan_check.json`` (``benchmarks/plan_check.py``: predictions of
  ``step_cost`` against measured steps) -> ``_plan_check.json``: the signed relative errors'
  median of absolute values and percentiles, which ``gradzip plan`` prints under its table as
  the plan's measured error band.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "benchmarks/results/kernels_nvidia-h100-80gb-hbm3.json"
PLAN_CHECK = "benchmarks/results/plan_check.json"
CODEC_PROFILES = "benchmarks/results/codec_profile_*.json"
OUT = ROOT / "gradzip" / "costmodel" / "profiles"
FIT_TERMS = ("encode_s", "encode_s_per_elem", "peer_s", "peer_s_per_elem")


def device_key(name: str) -> str:
    """The short name ``gradzip plan --device`` takes for a device: its model number
    (``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA H200`` -> ``h200``), else its name in
    lower case with dashes."""
    words = re.split(r"[^a-z0-9]+", name.lower())
    for w in words:
        if re.fullmatch(r"[a-z]{1,2}\d{2,4}[a-z]?", w):
            return w
    return "-".join(w for w in words if w)


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Intercept and slope (seconds, seconds per element) through the smallest and largest n."""
    (n0, t0), (n1, t1) = min(points), max(points)
    slope = max((t1 - t0) / (n1 - n0), 0.0)
    return max(t0 - slope * n0, 0.0), slope


def _rows(results, kernel, route=None):
    rows = [
        r
        for r in results
        if r["kernel"] == kernel and r["backend"] == "triton" and (route is None or r.get("route") == route)
    ]
    if not rows:
        raise ValueError(f"{KERNELS} has no triton row for {kernel} {route or ''}")
    return rows


def _fit(results, encode, decode=None, *, route=None) -> dict:
    enc = [(r["n"], r["kernel_ms"] / 1e3) for r in _rows(results, encode, route)]
    a, b = _line(enc)
    fit = {"encode_s": a, "encode_s_per_elem": b, "peer_s": 0.0, "peer_s_per_elem": 0.0}
    what = f"{encode}{f' ({route})' if route else ''}"
    if decode:
        dec = [(r["n"], r["kernel_ms"] / 1e3 / r["peers"]) for r in _rows(results, decode)]
        fit["peer_s"], fit["peer_s_per_elem"] = _line(dec)
        what += f" + {decode} / peers"
    return fit, what


def _fit_torch_topk(results) -> tuple[dict, str]:
    """TopK's exact mode: ``torch.topk(|x|, k)``, which ``kernels.py`` times beside the sampled
    kernel (``torch_topk_ms`` of its Triton rows), and the sparse scatter per peer."""
    enc = [(r["n"], r["torch_topk_ms"] / 1e3) for r in _rows(results, "sampled_topk") if r.get("torch_topk_ms")]
    if not enc:
        raise ValueError(f"{KERNELS} has no torch.topk time beside sampled_topk")
    a, b = _line(enc)
    fit = {"encode_s": a, "encode_s_per_elem": b}
    dec = [(r["n"], r["kernel_ms"] / 1e3 / r["peers"]) for r in _rows(results, "scatter_add_sparse")]
    fit["peer_s"], fit["peer_s_per_elem"] = _line(dec)
    return fit, "torch.topk(|x|, k) (timed beside sampled_topk) + scatter_add_sparse / peers"


def h100_profile(k: dict) -> dict:
    res = k["results"]
    sizes = sorted({r["n"] for r in res})
    src = f"{KERNELS} ({k['device']}, {k['date'][:10]}, torch {k['torch']}, triton {k['triton']})"
    classes = []

    def add(cls, ef, fit_what, when=None, note=""):
        fit, what = fit_what
        classes.append(
            {
                "class": cls,
                "error_feedback": ef,
                **({"when": when} if when else {}),
                **fit,
                "basis": f"kernel times of {what} from {src}{note}; excludes Python and launch overhead",
            }
        )

    add("Threshold", True, _fit(res, "threshold_ef", "decode_add_bitmap2"))
    add("SignSGD", True, _fit(res, "sign_ef", "decode_add_sign1", route="two-pass"), when={"block": None})
    add("SignSGD", True, _fit(res, "sign_ef", "decode_add_sign1", route="one-pass"), when={"block": 1024})
    add("QSGD", False, _fit(res, "qsgd_encode", "decode_add_qsgd", route="one-pass"), when={"block": 64, "levels": 7})
    # TopK by the mode the method asks for: exact (the default) runs torch.topk, timed in the
    # same run as the sampled kernel's baseline; sampled and approx their own kernels.
    density = f", at density {k['density']} (the scatter part grows with the ratio)"
    add("TopK", True, _fit_torch_topk(res), when={"mode": "exact"}, note=density)
    add("TopK", True, _fit(res, "sampled_topk", "scatter_add_sparse"), when={"mode": "sampled"}, note=density)
    if any(r["kernel"] == "sampled_topk_approx" for r in res):
        add("TopK", True, _fit(res, "sampled_topk_approx", "scatter_add_sparse"), when={"mode": "approx"}, note=density)
    copy_bps = k["copy_bandwidth_gbps"] * 1e9
    for cls in ("FP16", "BF16"):
        classes.append(
            {
                "class": cls,
                "error_feedback": False,
                "encode_s": 0.0,
                "encode_s_per_elem": 12.0 / copy_bps,
                "peer_s": 0.0,
                "peer_s_per_elem": 0.0,
                "basis": f"copy bound: 12 bytes per element over the copy bandwidth "
                f"{k['copy_bandwidth_gbps']:.0f} GB/s measured by {src}; no kernel of its own timed",
            }
        )
    return {
        "kind": "gradzip-codec-profile",
        "version": 1,
        "machine": {
            "device": k["device"],
            "cpu": f"{k['device']} (kernel timings)",
            "date": k["date"][:10],
            "torch": k["torch"],
            "source": KERNELS,
            "built_by": "benchmarks/h100_profile.py",
        },
        "sizes": [sizes[0], sizes[-1]],
        "worlds": [1, 1 + max(r.get("peers", 1) for r in res)],
        "repeats": 0,
        "statistic": k["timer"],
        "threads": 1,
        "dtype": "float32",
        "missing": "PowerSGD, Int8, TernGrad, RandomK, Identity, Hierarchical, Filter, Int8Allreduce, "
        + ("" if any(r["kernel"] == "sampled_topk_approx" for r in res) else "TopK(mode='approx'), ")
        + "TopK(mode='auto') and the configs no class names in 'when': no figure in the kernel benchmark; "
        "gradzip plan leaves their codec time out and marks their rows",
        "entries": {},
        "classes": classes,
    }


def derive_classes(entries: dict, device: str) -> list[dict]:
    """A class fit per measured entry: ``when`` names the config items that differ among the
    measured entries of its class (and error feedback) and every nested method's config, so a
    config that was not measured takes the fit of the one that agrees on those."""
    groups: dict[tuple, list[dict]] = {}
    for e in entries.values():
        groups.setdefault((e["config"]["name"], bool(e["error_feedback"])), []).append(e)
    classes = []
    for (cls, ef), es in sorted(groups.items()):
        items = sorted({k for e in es for k in e["config"]} - {"name"})
        differ = [k for k in items if len({json.dumps(e["config"].get(k), sort_keys=True) for e in es}) > 1]
        nested = [k for k in items if any(isinstance(e["config"].get(k), dict) for e in es)]
        keys = sorted(set(differ) | set(nested))
        for e in es:
            classes.append(
                {
                    "class": cls,
                    "error_feedback": ef,
                    "when": {k: e["config"].get(k) for k in keys},
                    **{t: e.get(t, 0.0) for t in FIT_TERMS},
                    "basis": f"whole calls of {e['method']} measured on {device}; other values of "
                    f"{', '.join(k for k in items if k not in keys) or 'no other argument'} take this fit",
                }
            )
    return classes


def device_profile(doc: dict) -> dict:
    """The shipped profile of a measured ``codec_profile_<device>.json``: its entries, and
    :func:`derive_classes` of them."""
    device = doc["device"]
    machine = {**doc["machine"], "device": device, "cpu": f"{device} (whole codec calls)"}
    machine.update(source=doc["source"], built_by="benchmarks/h100_profile.py")
    return {
        "kind": doc["kind"],
        "version": doc["version"],
        "machine": machine,
        "sizes": doc["sizes"],
        "worlds": doc["worlds"],
        "repeats": doc["repeats"],
        "statistic": doc["statistic"],
        "threads": doc["threads"],
        "dtype": doc["dtype"],
        "timing": doc["timing"],
        "missing": "what no entry or class fit covers: gradzip plan leaves its codec time out and marks the row"
        + (f"; not measured in the run: {', '.join(doc['errors'])}" if doc.get("errors") else ""),
        "entries": doc["entries"],
        "classes": derive_classes(doc["entries"], device),
    }


def error_band(pc: dict) -> dict:
    errs = sorted(r["error"] for r in pc["rows"])
    q = statistics.quantiles(errs, n=10)
    return {
        "source": PLAN_CHECK,
        "built_by": "benchmarks/h100_profile.py",
        "machine": pc["machine"],
        "ranks": sorted({r["ranks"] for r in pc["rows"]}),
        "rows": len(errs),
        "median_abs_error": statistics.median(abs(e) for e in errs),
        "p10": q[0],
        "p90": q[-1],
        "min": errs[0],
        "max": errs[-1],
        "error": "(predicted - measured) / measured step time",
    }


def shipped(root: Path = ROOT) -> dict[str, dict]:
    """``{file name: document}`` of every profile this script writes, from the committed results."""
    docs = {}
    for path in sorted(root.glob(CODEC_PROFILES)):
        measured = json.loads(path.read_text())
        measured["source"] = str(path.relative_to(root))
        docs[f"{device_key(measured['device'])}.json"] = device_profile(measured)
    if "h100.json" not in docs:  # no whole-call profile of an H100 yet: its kernel timings
        docs["h100.json"] = h100_profile(json.loads((root / KERNELS).read_text()))
    docs["_plan_check.json"] = error_band(json.loads((root / PLAN_CHECK).read_text()))
    return docs


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, doc in shipped().items():
        (OUT / name).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
