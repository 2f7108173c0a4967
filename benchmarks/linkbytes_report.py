"""Print the link-bytes tables (markdown, in docs/results.md) from benchmarks/results/linkbytes.json.

    python -m benchmarks.linkbytes_report [path/to/linkbytes.json]

First table: N x method x protocol. Columns, per rank per step: the bytes measured on the
namespace's ``lo`` (benchmarks/linkbytes.py), gradzip's own ``bytes_link``, their ratio,
and the measured bytes as a fraction of plain DDP's at the same N; then the targets.
Second table: method x N, and each method's growth from the smallest to the largest N.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "results", "linkbytes.json")


def _machine(m: dict) -> str:
    extra = f", {m['gpu']}" if "gpu" in m else ""
    return f"{m['cpu']}, {m['cores']} cores{extra}, torch {m['torch']}, {m['date']}"


def _mb(x) -> str:
    return "—" if x is None else f"{x / 1e6:,.3f}"


def _kb(x) -> str:
    return "—" if x is None else f"{x / 1e3:.1f}"


def table(doc: dict) -> str:
    cfg = doc["config"]
    lines = [
        f"`{doc['command']}` ({cfg['backend']}; MLP of {cfg['params'] / 1e6:.2f}M parameters, DDP default buckets, "
        f"batch {cfg['batch']}/rank; {cfg['warmup']} warm-up steps, then {cfg['steps']} measured; "
        f"{doc['wall_s'] / 60:.0f} min; machine: {_machine(doc['machine'])}).",
        "MB per rank per step. *lo*: the namespace's `lo` TX bytes (IP/TCP headers, ACKs and gloo's 144 B per "
        "message included) / N / steps. *gradzip*: `stats()['bytes_link']`, averaged over the ranks "
        "(plain DDP: the ring formula 2(N-1)/N·4·params, in italics). *of DDP*: lo bytes / plain DDP's lo bytes "
        "(gradzip: bytes_link / bytes_link_raw). *retrans*: TCP retransmissions inside the lo bytes (`ss`), "
        "KB per rank per step.",
        "",
        "| N | method | protocol | lo MB | gradzip MB | lo / gradzip | of DDP (lo) | of DDP (gradzip) | retrans KB |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        gz = r.get("gradzip_bytes_link")
        gz_s = f"*{_mb(r['ring_formula'])}*" if gz is None else _mb(gz)
        frac = r.get("lo_fraction_of_ddp")
        gfrac = r.get("gradzip_fraction_of_ddp")
        lines.append(
            f"| {r['N']} | {r['method']} | {r['protocol']} | {_mb(r['lo_bytes'])} | {gz_s} "
            f"| {r['lo_over_gradzip']:.3f} "
            f"| {'—' if frac is None else f'{100 * frac:.2f}%'} | {'—' if gfrac is None else f'{100 * gfrac:.2f}%'} "
            f"| {_kb(r.get('tcp_retrans'))} |"
        )
    t = doc.get("targets") or {}
    if t:
        lines += ["", "Targets (measured lo bytes):", ""]
        for k, v in t.items():
            extra = ""
            if "gradzip_bytes_link_8_over_2" in v:
                extra = (
                    f" (gradzip's count: {v['gradzip_bytes_link_8_over_2']:.3f}×; a ring allreduce grows "
                    f"{v['ring_allreduce_8_over_2']:.2f}×, so {v['per_ring_factor']:.3f}× of the ring's growth)"
                )
                val = f"{v['value']:.3f}×"
            else:
                val = f"{100 * v['value']:.2f}%"
            lines.append(f"- {k}: **{val}**, {'holds' if v['holds'] else 'does not hold'}{extra}")
    return "\n".join(lines)


def scaling(doc: dict) -> str:
    """Method x N: measured lo MB per rank per step (% of plain DDP), and the growth from the
    smallest to the largest N, also divided by a ring allreduce's own growth 2(N-1)/N."""
    worlds = sorted({r["N"] for r in doc["rows"]})
    by = {(r["method"], r["N"]): r for r in doc["rows"]}
    methods = list(dict.fromkeys(r["method"] for r in doc["rows"]))
    lo, hi = worlds[0], worlds[-1]
    ring = (2 * (hi - 1) / hi) / (2 * (lo - 1) / lo)
    lines = [
        f"Measured `lo` MB per rank per step (% of plain DDP's at the same N); growth from {lo} to {hi} ranks, "
        f"and that growth divided by a ring allreduce's own ({ring:.2f}×).",
        "",
        "| method | " + " | ".join(f"N={n}" for n in worlds) + f" | {hi}/{lo} | ÷ ring |",
        "|---|" + "---:|" * (len(worlds) + 2),
    ]
    for m in methods:
        cells = []
        for n in worlds:
            r = by.get((m, n))
            frac = r.get("lo_fraction_of_ddp") if r else None
            cells.append(
                "—" if r is None else f"{_mb(r['lo_bytes'])} ({'—' if frac is None else f'{100 * frac:.2f}%'})"
            )
        a, b = by.get((m, lo)), by.get((m, hi))
        g = b["lo_bytes"] / a["lo_bytes"] if a and b and len(worlds) > 1 else None
        lines.append(f"| {m} | " + " | ".join(cells) + (f" | {g:.3f}× | {g / ring:.3f}× |" if g else " | — | — |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else DEFAULT
    with open(path) as f:
        doc = json.load(f)
    print(table(doc))
    print()
    print(scaling(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
