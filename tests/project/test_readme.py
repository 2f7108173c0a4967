"""README.md is a short guide whose examples run and whose command lines name real flags.

* It stays a guide a newcomer reads in one sitting: at most :data:`MAX_LINES` lines (the
  results tables live on docs/results.md, written by ``python -m benchmarks.report``).

* Every ```python block of README.md runs. The blocks form one script (later blocks use what
  earlier ones define, as the README says), so they run in order, in one namespace, on 2 gloo
  ranks started as torchrun starts them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
  ``LOCAL_WORLD_SIZE`` in the environment), in a scratch working directory. One process pair
  runs all blocks (a block's ``dist.init_process_group("gloo")`` runs once, as written); each
  block is then reported by its own test.
* Every ``gradzip ...`` line of a ```bash block parses with the real ``gradzip`` argument
  parser (the command is not run), and every ``torchrun ... examples/X.py --flag`` in the
  README names flags that the example's argparse defines.

Run this file as a script (``python tests/project/test_readme.py RESULT.json``) to be one rank.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
WORLD = 2
TIMEOUT_S = 240
MAX_LINES = 500


def fenced_blocks(text: str, lang: str) -> list[tuple[int, str]]:
    """``(first line number, code)`` of every ```lang block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == f"```{lang}":
            start, body = i + 2, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            out.append((start, "\n".join(body) + "\n"))
        i += 1
    return out


def python_blocks() -> list[tuple[int, str]]:
    return fenced_blocks(README.read_text(), "python")


def shell_commands() -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined, comments dropped."""
    cmds = []
    for _, code in fenced_blocks(README.read_text(), "bash"):
        for line in code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                cmds.append(words)
    return cmds


# -- one rank (run as a script) ---------------------------------------------------------
def _rank_main(result_path: str) -> int:
    results, namespace = [], {"__name__": "__readme__"}
    code = 0
    for start, block in python_blocks():
        t0 = time.perf_counter()
        try:
            exec(compile(block, f"README.md:{start}", "exec"), namespace)
            results.append({"line": start, "ok": True, "seconds": time.perf_counter() - t0})
        except BaseException:  # noqa: BLE001
            results.append({"line": start, "ok": False, "error": traceback.format_exc()})
            code = 1
            break
    Path(result_path).write_text(json.dumps(results))
    sys.stdout.flush()
    if code:
        os._exit(code)  # the other rank may be waiting in a collective: do not linger in atexit
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# -- the tests --------------------------------------------------------------------------
import pytest  # noqa: E402

BLOCKS = python_blocks()


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("readme")
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, outs = [], []
    for r in range(WORLD):
        env = dict(os.environ)
        env.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(WORLD),
            LOCAL_WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]),
        )
        out = work / f"rank{r}.json"
        log = open(work / f"rank{r}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(out)],
                cwd=work,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        outs.append(out)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                break
            if any(p.poll() not in (None, 0) for p in procs):  # one rank failed: give the other 10 s
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r, out in enumerate(outs):
        log = (work / f"rank{r}.log").read_text()
        results.append((json.loads(out.read_text()) if out.exists() else None, log))
    return results


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 10


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; results tables belong on docs/results.md"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"line{line}" for line, _ in BLOCKS])
def test_python_block_runs(readme_run, index):
    line = BLOCKS[index][0]
    for rank, (results, log) in enumerate(readme_run):
        if results is None:
            pytest.fail(f"rank {rank} wrote no results (killed after {TIMEOUT_S} s, or crashed):\n{log[-4000:]}")
        done = {r["line"]: r for r in results}
        if line not in done:
            failed = [r for r in results if not r["ok"]]
            why = f"block at line {failed[0]['line']} failed first" if failed else "the run stopped early"
            pytest.fail(f"rank {rank}: the block at README.md:{line} did not run ({why})\n{log[-2000:]}")
        if not done[line]["ok"]:
            pytest.fail(f"rank {rank}: the block at README.md:{line} raised:\n{done[line]['error']}")


def _gradzip_parser():
    """The ``gradzip`` command's parser: ``cli.main`` with the sub-commands' actions replaced."""
    import gradzip.cli as cli

    def parse(argv):
        seen = {}
        saved = cli._bench, cli._plan
        cli._bench = cli._plan = lambda a: seen.setdefault("args", a) and 0
        try:
            cli.main(argv)
        finally:
            cli._bench, cli._plan = saved
        return seen["args"]

    return parse


def test_gradzip_command_lines_parse():
    parse = _gradzip_parser()
    cmds = [w for w in shell_commands() if w[0] == "gradzip"]
    assert {w[1] for w in cmds} >= {"bench", "plan"}
    for words in cmds:
        try:
            args = parse(words[1:])
        except SystemExit as exc:  # argparse refuses a flag or a value
            pytest.fail(f"{shlex.join(words)!r} does not parse (exit {exc.code})")
        if words[1] == "bench" and args.methods:
            from gradzip import bench

            bench.parse_methods(args.methods)
        if words[1] == "plan":
            from gradzip import options
            from gradzip.costmodel import Link
            from gradzip.plan import parse_methods

            latency = options.DEFAULT_LATENCY_S if args.latency is None else args.latency  # plan's default
            parse_methods(args.methods, link=Link(args.bandwidth, latency), local_size=args.local_size)


def test_make_targets_exist():
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    for words in shell_commands():
        if words[0] == "make":
            assert words[1] in targets, words


def test_example_flags_are_real():
    text = README.read_text()
    found = re.findall(r"torchrun[^`]*?(examples/\w+\.py)([^`]*)`", text)
    assert found
    for script, rest in found:
        source = (ROOT / script).read_text()
        defined = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source))
        for flag in re.findall(r"(--[\w-]+)", rest):
            assert flag in defined, f"{script} has no {flag}"


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))
