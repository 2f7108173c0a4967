import os

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
