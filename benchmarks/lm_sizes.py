"""The language model's gap to DDP across model sizes: one markdown table from the bench's
results at each ``--lm-size``.

    python -m benchmarks.lm_sizes benchmarks/results/lm_sizes/*.json \
        benchmarks/results/lm_shakespeare_4ranks_adamw_cpu.json \
        benchmarks/results/explore/explore_lm_shakespeare_4ranks_adamw_seed0_cpu.json

Each file is a ``gradzip bench`` result (``--dataset shakespeare``, any ``--lm-size``); files
of the same size are read together (a row of one, the baseline of its own file; a method in
two files of one size: the file of more seeds). A cell is the mean gap in percent of DDP's
validation loss over the file's seeds, its sample standard deviation, the seeds, and the
link-byte ratio. Rows are the methods measured at two sizes or more, in the order first seen;
columns the sizes, smallest first.
"""

from __future__ import annotations

import argparse
import json
import sys

from gradzip.bench import lm


def cells(paths: list[str]) -> tuple[list[str], list[str], dict]:
    """``(methods, sizes, {(method, size): row})`` of the bench results in ``paths``."""
    methods: list[str] = []
    sizes: set[str] = set()
    at: dict = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        cfg = doc["config"]
        if cfg.get("dataset") != "shakespeare":
            raise ValueError(f"{path}: not a language-model result (dataset {cfg.get('dataset')!r})")
        size = cfg.get("lm_size", "tiny")
        sizes.add(size)
        for r in doc["rows"]:
            if r["method"] == "Identity" or r["method"].startswith("peer:"):
                continue
            if r["method"] not in methods:
                methods.append(r["method"])
            old = at.get((r["method"], size))
            if old is None or r["n_seeds"] > old["n_seeds"]:  # the file of more seeds speaks for the size
                at[(r["method"], size)] = r
    order = sorted(sizes, key=lambda s: lm.SIZES[s].params())
    if len(order) > 1:  # a method measured at one size only says nothing of the trend
        methods = [m for m in methods if sum((m, s) in at for s in order) > 1]
    return methods, order, at


def table(paths: list[str]) -> str:
    methods, sizes, at = cells(paths)
    head = "| method | " + " | ".join(f"{s} ({lm.SIZES[s].params() / 1e6:.2f}M)" for s in sizes) + " |"
    lines = [head, "|---|" + "---|" * len(sizes)]
    for m in methods:
        row = []
        for s in sizes:
            r = at.get((m, s))
            if r is None:
                row.append("")
                continue
            n = r["n_seeds"]
            spread = f" ±{r['gap_pct_std']:.2f}" if n > 1 and r.get("gap_pct_std") is not None else ""
            row.append(f"{r['gap_pct']:+.2f}%{spread} ({n} seed{'s' if n > 1 else ''}), {r['ratio']:.0f}×")
        lines.append(f"| `{m}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="gradzip bench results.json files of the language model")
    a = p.parse_args(argv)
    print(table(a.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
