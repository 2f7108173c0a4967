"""Build the shipped codec profile of ``gradzip plan --device h100`` and the plan's error band.

    python -m benchmarks.h100_profile

Reads two committed measurements and writes two small files inside the package:

* ``benchmarks/results/kernels_nvidia-h100-80gb-hbm3.json`` (``benchmarks/kernels.py`` on a lent
  NVIDIA H100 80GB HBM3, 1M to 256M float32 elements) -> ``gradzip/costmodel/profiles/h100.json``:
  per codec class, the line through the smallest and the largest size of its encode kernel
  (``encode_s``, ``encode_s_per_elem``) and of its decode kernel divided by the peers it decoded
  (``peer_s``, ``peer_s_per_elem``), Triton backend, clipped at 0 as ``measure_codec`` clips.
  These are **kernel times only**: the torch glue, Python and launch overheads of a codec call
  are not in them, so the codec seconds they give are a lower bound. FP16 and BF16 have no
  kernel row; their fit is the copy bound: 12 bytes per element (read 4, write 2 to encode; read
  2, write 4 to decode) over the copy bandwidth measured in the same run. Classes the JSON has
  no figure for (PowerSGD, Int8, TernGrad's decode, RandomK, Identity) are left out:
  ``gradzip plan`` then measures them on its own machine and prints that it did.
* ``benchmarks/results/plan_check.json`` (``benchmarks/plan_check.py``: predictions of
  ``step_cost`` against measured steps) -> ``gradzip/costmodel/profiles/_plan_check.json``: the
  signed relative errors' median of absolute values and percentiles, which ``gradzip plan``
  prints under its table as the plan's measured error band.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "benchmarks/results/kernels_nvidia-h100-80gb-hbm3.json"
PLAN_CHECK = "benchmarks/results/plan_check.json"
OUT = ROOT / "gradzip" / "costmodel" / "profiles"


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
    add(
        "TopK",
        True,
        _fit(res, "sampled_topk", "scatter_add_sparse"),
        note=f", at density {k['density']} (the scatter part grows with the ratio)",
    )
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
        "missing": "PowerSGD, Int8, TernGrad, RandomK, Identity: no figure in the kernel benchmark",
        "entries": {},
        "classes": classes,
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


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    k = json.loads((ROOT / KERNELS).read_text())
    pc = json.loads((ROOT / PLAN_CHECK).read_text())
    for name, doc in (("h100.json", h100_profile(k)), ("_plan_check.json", error_band(pc))):
        (OUT / name).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
