"""One results table from several ``gradzip bench`` runs of the same configuration.

    python -m benchmarks.merge_runs --stem lm_shakespeare_4ranks_adamw_cpu \\
        --command "gradzip bench --preset lm" RUN.json [RUN.json ...]

Each RUN is a ``results.json`` that ``gradzip bench --out DIR`` (or ``benchmarks/accuracy.py``)
wrote, one or more methods on one or more seeds. The runs must agree on every option but the
methods and seeds (else ``ValueError`` naming the option); their per-seed runs are pooled and
aggregated as one bench run would (``gradzip.bench.report.aggregate``: the baseline, Identity,
must have run on every seed a method ran on), so a table whose rows took hours each can be run
a row or a seed at a time. The output records ``--command`` (the one command that reruns the
whole table) and, under ``merged_from``, each input's own command (for an input that was
merged itself, the commands it was merged from). Writes
``benchmarks/results/STEM.{json,csv,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from benchmarks._common import RESULTS
from gradzip.bench import BenchConfig, aggregate, write_outputs

#: Options that may differ between the runs of one table.
FREE = {"seed", "seeds"}
#: Written by write_outputs from the configuration, not options of it.
DERIVED = {"epochs", "steps_per_epoch", "total_steps", "metric"}


def merge(docs: list[dict]) -> tuple[list[dict], dict]:
    """The pooled per-seed runs of ``docs`` and their common configuration."""
    first = docs[0]["config"]
    for d in docs[1:]:
        for k in sorted(set(first) | set(d["config"])):
            if k in FREE:
                continue
            if first.get(k) != d["config"].get(k):
                raise ValueError(f"runs differ in {k!r}: {first.get(k)!r} and {d['config'].get(k)!r}")
    runs = []
    for d in docs:
        for row in d["rows"]:
            for r in row["per_seed"]:
                runs.append({**r, "method": row["method"], "config": row["config"]})
    return runs, first


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="results.json files")
    p.add_argument("--stem", required=True, help="output file name without extension")
    p.add_argument("--command", required=True, help="the command that reruns the whole table")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    docs = []
    for path in a.runs:
        with open(path) as f:
            docs.append(json.load(f))
    runs, config = merge(docs)
    metric = config["metric"]
    rows = aggregate(runs, metric=metric)
    seeds = sorted({r["seed"] for r in runs})
    fields = {k: v for k, v in config.items() if k not in DERIVED}
    fields.update(seeds=tuple(seeds), seed=seeds[0], hidden=tuple(fields["hidden"]))
    cfg = BenchConfig(**fields)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_outputs(rows, cfg, tmp, command=a.command)
        with open(paths["json"]) as f:
            doc = json.load(f)
        # each input's own command, or the commands it was merged from (a table merged again)
        doc["merged_from"] = [c for d in docs for c in (d.get("merged_from") or [d.get("command", "")])]
        with open(paths["json"], "w") as f:
            json.dump(doc, f, indent=2, default=str)
        os.makedirs(a.out, exist_ok=True)
        for kind, ext in (("json", "json"), ("csv", "csv"), ("plot", "png")):
            shutil.copyfile(paths[kind], os.path.join(a.out, f"{a.stem}.{ext}"))
    print(f"wrote {a.out}/{a.stem}.{{json,csv,png}}: {len(rows)} methods, seeds {seeds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
