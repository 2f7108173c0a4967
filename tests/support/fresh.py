"""What a fresh interpreter loads when it imports gradzip: one subprocess answers every test.

Four tests (tests/engine/test_registry.py, tests/project/test_names.py,
tests/project/test_packaging.py, tests/kernels/test_sparse_ops.py) each asked a new Python
what an import loads; each start costs about 2 s of CPU (torch's import). :func:`facts` runs
:data:`PROBE` once per test worker, in the order the questions need: the registry alone
first, then the method table, then the package's front doors, then the CPU codecs.
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
print(json.dumps(out))
"""


@functools.cache
def facts() -> dict:
    """:data:`PROBE`'s answers, from a new interpreter started in ``/`` (the installed
    package, not the current directory's)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])
