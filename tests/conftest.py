import os

# Triton decides at decoration time whether a kernel is compiled or interpreted, so
# TRITON_INTERPRET must be set before anything imports gradzip's Triton kernels. With no
# GPU, the kernels run in the interpreter on CPU tensors (tests/kernels/test_triton.py);
# with one, they are compiled and the @pytest.mark.gpu tests run them. An explicit
# TRITON_INTERPRET in the environment wins.
if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _threads():
    # Deterministic CPU math, and leave the second core to the other rank.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# GRADZIP_REPORT_NOW=1: a failed test's report printed as it fails (tests/support/report_now.py).
from tests.support.report_now import pytest_runtest_logreport  # noqa: E402, F401
