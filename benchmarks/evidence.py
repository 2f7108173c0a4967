"""Build ``gradzip/costmodel/profiles/_evidence.json`` (what ``gradzip plan`` ranks by) from
the committed ``gradzip bench`` results (:mod:`gradzip.evidence`).

    python -m benchmarks.evidence            # write it
    python -m benchmarks.evidence --check    # exit 1 if the shipped file differs
"""

from __future__ import annotations

import argparse
import os
import sys

from gradzip import evidence

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    a = p.parse_args(argv)
    doc = evidence.build(RESULTS)
    text = evidence.dumps(doc)
    if a.check:
        with open(evidence.EVIDENCE_PATH) as f:
            same = f.read() == text
        print(f"{evidence.EVIDENCE_PATH}: {'up to date' if same else 'stale: run python -m benchmarks.evidence'}")
        return 0 if same else 1
    with open(evidence.EVIDENCE_PATH, "w") as f:
        f.write(text)
    print(f"wrote {evidence.EVIDENCE_PATH}: {len(doc['entries'])} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
