"""Pure-PyTorch reference ops.

These are the CPU path and the oracle that every GPU kernel is tested against.
They know nothing of compressors or of torch.distributed: they take tensors and
return tensors. Index arithmetic is int64 throughout.
"""
from __future__ import annotations

import torch

__all__ = [
    "pack_2bit",
    "unpack_2bit",
    "encode_signed_indices",
    "decode_signed_indices",
    "threshold_select_reference",
]

_SIGN_BIT = 1 << 31


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack 2-bit codes (uint8 values 0..3) four to a byte.

    Element ``i`` lands in byte ``i // 4`` at bits ``2 * (i % 4)``. The result has
    ``ceil(n / 4)`` bytes; the unused high bits of the last byte are zero.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_2bit expects uint8 codes, got {codes.dtype}")
    flat = codes.reshape(-1)
    n = flat.numel()
    nbytes = (n + 3) // 4
    padded = torch.zeros(nbytes * 4, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat & 3
    q = padded.view(nbytes, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def unpack_2bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: the first ``n`` 2-bit codes as uint8."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_2bit expects uint8, got {packed.dtype}")
    if packed.numel() * 4 < n:
        raise ValueError(f"{packed.numel()} bytes hold fewer than n={n} 2-bit codes")
    p = packed.reshape(-1, 1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((p >> shifts) & 3).reshape(-1)[:n]


def encode_signed_indices(idx: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Strom's message word: the index in the low 31 bits, the sign in bit 31.

    ``idx`` must be < 2**31. Returns int32 (bit-reinterpreted from the uint32 word).
    """
    idx64 = idx.to(torch.int64)
    words = idx64 | (negative.to(torch.int64) << 31)
    # Map [0, 2**32) onto int32 two's complement without overflow.
    words = torch.where(words >= _SIGN_BIT, words - (1 << 32), words)
    return words.to(torch.int32)


def decode_signed_indices(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_signed_indices`: (int64 indices, bool negative)."""
    w = words.to(torch.int64)
    negative = w < 0
    idx = torch.where(negative, w + _SIGN_BIT, w)
    return idx, negative


def threshold_select_reference(v: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of the elements of ``v`` at or above ``+tau`` and at or below ``-tau``."""
    return v >= tau, v <= -tau
