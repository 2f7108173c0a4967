"""What the benchmark scripts share: where the repository and its results are, how a run
records its command line and writes its result, how a script starts its own ranks again, and a
free port."""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from pathlib import Path

#: The repository root and the committed results (``benchmarks/results``).
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def command(name: str, argv: list[str] | None = None, *, python: str = "python") -> str:
    """The command line to record beside a result: ``python -m benchmarks.NAME ARGS``
    (``argv``: this process's arguments unless given; ``python``: e.g. ``sudo .venv/bin/python``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join([*python.split(), "-m", f"benchmarks.{name}", *args])


def module_argv(name: str) -> list[str]:
    """argv that runs ``benchmarks.NAME`` in a child process (e.g. a rank in a network namespace)."""
    return [sys.executable, "-m", f"benchmarks.{name}"]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` plus ``PYTHONPATH`` holding the repository root, so that ``module_argv`` runs
    from any working directory."""
    out = dict(env or {})
    out["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]
    )
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_result(path, doc: dict, *, indent: int = 1) -> None:
    """Write a result document as JSON (its folder made if need be) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=indent)
        f.write("\n")
    print(f"wrote {path}")
