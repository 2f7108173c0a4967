"""Host-side pieces shared by the GPU backends (Triton and CuPy).

Nothing here imports triton or cupy: each backend passes in its own launch.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch

from .reference import ThresholdResult

__all__ = ["DeviceThresholdResult", "select_threshold", "compact_indices"]


class DeviceThresholdResult(ThresholdResult):
    """What the GPU backends' threshold pass leaves: the 2-bit bitmap as int32 words
    (16 codes each, ``FMT_BITMAP2``'s byte layout), per-program counts, and per-program
    ``max |v|`` as float32 bits. Backends add :meth:`indices` (their compaction pass)."""

    def __init__(self, n, tau, residual, words, counts, amax_bits) -> None:
        super().__init__(n, tau, residual)
        self._words, self._counts, self._amax_bits = words, counts, amax_bits

    def _fetch_stats(self) -> tuple[int, float]:
        if self.n == 0:
            return 0, 0.0
        count, bits = torch.stack([self._counts.sum(dtype=torch.int64), self._amax_bits.max().to(torch.int64)]).tolist()
        return int(count), struct.unpack("<f", struct.pack("<i", int(bits)))[0]

    def bitmap(self) -> torch.Tensor:
        return self._words.view(torch.uint8)[: (self.n + 3) // 4]


def select_threshold(v: torch.Tensor, thr) -> torch.Tensor:
    """``thr`` as a one-element float32 tensor on ``v``'s device, for a compaction kernel.

    A number is first rounded to ``v``'s dtype (the reference compares ``|v| >= thr`` in
    that dtype); a tensor (a value of ``v``'s dtype) stays on the device, with no host
    sync. Either is exact in float32 for the kernels' dtypes.
    """
    if isinstance(thr, torch.Tensor):
        return thr.detach().reshape(1).to(device=v.device, dtype=torch.float32)
    return torch.tensor([float(thr)], dtype=v.dtype).to(device=v.device, dtype=torch.float32)


def compact_indices(
    launch: Callable[[torch.Tensor, torch.Tensor, int], None], n: int, expected: int | None, device
) -> torch.Tensor:
    """Ascending int64 indices from a compaction kernel whose blocks claim output slots
    in any order: ``launch(out, counter, capacity)`` writes the selected indices below
    ``capacity`` into ``out`` and counts all of them (past capacity too) in ``counter``.

    The buffer holds ``2 * expected + 1024`` indices (all ``n`` without a guess); if more
    are selected, the pass runs again with the exact count. The survivors are sorted.
    """
    capacity = n if expected is None else min(n, 2 * int(expected) + 1024)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    for _ in range(2):
        out = torch.empty(capacity, dtype=torch.int64, device=device)
        launch(out, counter, capacity)
        count = int(counter.item())
        if count <= capacity:
            break
        capacity = count
        counter.zero_()
    return out[:count].sort().values
