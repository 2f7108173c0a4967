"""What a fresh interpreter loads when it imports gradzip: one subprocess answers every test.

Four tests (tests/engine/test_registry.py, tests/project/test_names.py,
tests/project/test_packaging.py, tests/kernels/test_sparse_ops.py) each asked a new Python
what an import loads; each start costs about 2 s of CPU (torch's import). :func:`facts` runs
:data:`PROBE` once per test worker, in the order the questions need: the registry alone
first, then the method table, then the package's front doors, then the CPU codecs; last, a
fork while another thread holds :mod:`gradzip.comm`'s tracker lock (tests/frontends/
test_clean_exit.py; a fork from a test worker, with numba's and scipy's threads about, is not
the question asked).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

PROBE = r"""
import json, sys
out = {}
heavy = lambda: [m for m in ("triton", "cupy") if m in sys.modules]
# 1. only the registry imported: gradzip's own methods parse (its modules load lazily)
from gradzip.registry import load_methods, names, parse
out["parsed"] = [type(parse("TopK(0.01)")).__name__, "Threshold" in names()]
# 2. what the tools' load_methods() imports
load_methods()
out["modules"] = sorted(m[len("gradzip."):] for m in sys.modules if m.startswith("gradzip."))
out["heavy_after_methods"] = heavy()
# 3. the package, its hooks and kernels
import gradzip, gradzip.hooks, gradzip.kernels
out["reshard_reachable"] = gradzip.checkpoint.reshard is gradzip.reshard
out["heavy_after_import"] = heavy()
# 4. CPU codecs compress and decompress without Triton or CuPy
import torch
from gradzip.codecs.base import TensorContext
x = torch.randn(5000)
for c in (gradzip.Threshold(tau=0.5), gradzip.Threshold(tau=3.0), gradzip.TopK(0.01, mode="sampled", sample=100)):
    c.decompress(c.compress(x, TensorContext(name="w")))
out["heavy_after_cpu_codecs"] = heavy()
# 5. a fork while another thread holds comm's tracker lock: the child gets a lock of its own
import os, threading, time
from gradzip import comm
held, done = threading.Event(), threading.Event()
def hold():
    with comm._LIVE.lock:
        held.set()
        done.wait(10)
threading.Thread(target=hold, daemon=True).start()
held.wait()
comm._LIVE.entries[0] = "the parent's"
pid = os.fork()
if pid == 0:  # the child: exit at once with the verdict
    os._exit(0 if comm._LIVE.lock.acquire(timeout=2) and not comm._LIVE.entries else 1)
t0 = time.monotonic()
_, status = os.waitpid(pid, 0)
out["fork_child"] = [os.waitstatus_to_exitcode(status), time.monotonic() - t0 < 2]
done.set()
del comm._LIVE.entries[0]
print(json.dumps(out))
"""


@functools.cache
def facts() -> dict:
    """:data:`PROBE`'s answers, from a new interpreter started in ``/`` (the installed
    package, not the current directory's)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])
