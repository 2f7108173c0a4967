"""Pure-PyTorch reference bit packing (the CPU path, and the oracle for GPU kernels).

Two layouts, both little-endian in the bit order, and both bit-exact round trips:

* **1 bit into int32 words** (:func:`pack_bits` / :func:`unpack_bits`). Element
  ``i`` is bit ``i % 32`` of word ``i // 32`` (bit 0 = the least significant
  bit). ``ceil(n / 32)`` words; the unused high bits of the last word are zero.
  A word whose bit 31 is set is a negative int32 (two's complement); the words
  travel as their 4 little-endian bytes.
* **n bits into bytes, n in {2, 4, 8}** (:func:`pack_nbit` / :func:`unpack_nbit`).
  Element ``i`` is the ``n``-bit field at bit ``n * (i % (8 // n))`` of byte
  ``i // (8 // n)``. ``ceil(n_elements * n / 8)`` bytes; unused high fields of
  the last byte are zero. For ``n = 2`` this is the layout of
  :func:`gradzip.kernels.reference.pack_2bit`; for ``n = 8`` it is the codes
  themselves.

Index arithmetic is int64; nothing here knows about compressors or communication.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .dispatch import gpu_side

__all__ = ["NBITS", "pack_bits", "unpack_bits", "pack_nbit", "unpack_nbit", "packed_nbytes", "pack_uint", "unpack_uint"]

NBITS = (2, 4, 8)
_WORD = 32
# CPU tensors pack and unpack through numpy's packbits/unpackbits (bit order "little":
# element 8k + j is bit j of byte k, so 4 bytes read little-endian are the int32 word):
# the same words, without the int64 temporaries of the shift-and-sum below.
_NUMPY_BITS = sys.byteorder == "little"


def _check_nbits(bits: int) -> None:
    if isinstance(bits, bool) or bits not in NBITS:
        raise ValueError(f"bits must be one of {list(NBITS)}, got {bits!r}")


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer in [0, inf), got {n!r}")


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` elements occupy packed at ``bits`` (1, 2, 4 or 8) bits each.

    For ``bits = 1`` this counts whole int32 words: ``4 * ceil(n / 32)``.
    """
    _check_n(n)
    if bits == 1:
        return 4 * ((n + _WORD - 1) // _WORD)
    _check_nbits(bits)
    per = 8 // bits
    return (n + per - 1) // per


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack booleans (or 0/1 uint8) 32 to an int32 word; see the module docstring."""
    if bits.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"pack_bits expects bool or uint8 bits, got {bits.dtype}")
    flat = bits.reshape(-1)
    if flat.dtype == torch.uint8 and flat.numel() and int(flat.max()) > 1:
        raise ValueError("pack_bits expects bits of value 0 or 1")
    n = flat.numel()
    nwords = (n + _WORD - 1) // _WORD
    if _NUMPY_BITS and not gpu_side(flat.device):
        packed = np.zeros(4 * nwords, dtype=np.uint8)
        packed[: (n + 7) // 8] = np.packbits(flat.contiguous().numpy(), bitorder="little")
        return torch.from_numpy(packed.view(np.int32))
    padded = torch.zeros(nwords * _WORD, dtype=torch.int64, device=flat.device)
    padded[:n] = flat.to(torch.int64)
    shifts = torch.arange(_WORD, dtype=torch.int64, device=flat.device)
    words = (padded.view(nwords, _WORD) << shifts).sum(dim=1)  # disjoint bits: sum == OR, < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits as a bool tensor."""
    if words.dtype != torch.int32:
        raise TypeError(f"unpack_bits expects int32 words, got {words.dtype}")
    _check_n(n)
    if words.numel() * _WORD < n:
        raise ValueError(f"{words.numel()} words hold fewer than n={n} bits")
    if _NUMPY_BITS and not gpu_side(words.device):
        raw = words.reshape(-1).contiguous().numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(raw, count=n, bitorder="little").view(np.bool_))
    w = words.reshape(-1, 1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(_WORD, dtype=torch.int64, device=words.device)
    return ((w >> shifts) & 1).reshape(-1)[:n].to(torch.bool)


def pack_nbit(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes below ``2**bits`` into bytes, ``8 // bits`` to a byte."""
    _check_nbits(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_nbit expects uint8 codes, got {codes.dtype}")
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.clone()
    if flat.numel() and int(flat.max()) >= 1 << bits:
        raise ValueError(f"pack_nbit: a code is >= 2**{bits}")
    per = 8 // bits
    n = flat.numel()
    nbytes = (n + per - 1) // per
    padded = torch.zeros(nbytes * per, dtype=torch.int32, device=flat.device)
    padded[:n] = flat.to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=flat.device)
    return (padded.view(nbytes, per) << shifts).sum(dim=1).to(torch.uint8)


def unpack_nbit(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_nbit`: the first ``n`` codes as uint8."""
    _check_nbits(bits)
    _check_n(n)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nbit expects uint8, got {packed.dtype}")
    per = 8 // bits
    if packed.numel() * per < n:
        raise ValueError(f"{packed.numel()} bytes hold fewer than n={n} {bits}-bit codes")
    flat = packed.reshape(-1)
    if bits == 8:
        return flat[:n].clone()
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((flat.reshape(-1, 1) >> shifts) & mask).reshape(-1)[:n]


def pack_uint(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers below ``2**bits`` (``bits`` in [1, 63]) into a bit stream:
    value ``i`` holds bits ``[i * bits, (i + 1) * bits)``, least significant first, bytes
    little-endian. ``ceil(len * bits / 8)`` bytes. Sparse frames' index deltas use it. For a
    2-D ``values``, each row packed as a stream of its own: ``(rows, ceil(n * bits / 8))``
    (what :func:`unpack_uint` reads back from 2-D rows)."""
    check_uint_bits(bits)
    if values.dim() == 2:
        return _pack_rows(values.to(torch.int64), bits)
    return _pack_rows(values.reshape(1, -1).to(torch.int64), bits)[0]  # one stream: one row


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_uint` of each row of the 2-D int64 ``v``, padded to a byte each."""
    r, n = v.shape
    nbytes = (n * bits + 7) // 8
    if not r or not n:
        return torch.zeros(r, nbytes, dtype=torch.uint8, device=v.device)
    shifts = torch.arange(bits, dtype=torch.int64, device=v.device)
    stream = ((v.unsqueeze(2) >> shifts) & 1).to(torch.uint8).reshape(r, n * bits)
    if _NUMPY_BITS and not gpu_side(stream.device):
        return torch.from_numpy(np.packbits(stream.numpy(), axis=1, bitorder="little"))
    padded = torch.zeros(r, nbytes * 8, dtype=torch.uint8, device=v.device)
    padded[:, : n * bits] = stream
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=v.device)
    return (padded.view(r, nbytes, 8).to(torch.int32) * weights).sum(dim=2).to(torch.uint8)


def check_uint_bits(bits: int) -> None:
    """:func:`pack_uint`'s and :func:`unpack_uint`'s width: an integer in [1, 63]."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 63:
        raise ValueError(f"bits must be an integer in [1, 63], got {bits!r}")


def check_unpack(packed: torch.Tensor, n: int, bits: int) -> None:
    """:func:`unpack_uint`'s arguments: a width, a count, and uint8 bytes (a row of them, for
    2-D ``packed``) that hold ``n`` values of ``bits`` bits."""
    check_uint_bits(bits)
    _check_n(n)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_uint expects uint8, got {packed.dtype}")
    width = packed.shape[1] if packed.dim() == 2 else packed.numel()
    if width * 8 < n * bits:
        raise ValueError(f"{width} bytes hold fewer than {n} values of {bits} bits")


def unpack_uint(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint`: ``n`` int64 values of ``bits`` bits each; for a 2-D
    ``packed``, each row's first ``n`` values (``(rows, n)``: streams of one layout at once)."""
    check_unpack(packed, n, bits)
    rows = packed.dim() == 2  # each row a stream of its own: (rows, n) values
    lead = (packed.shape[0],) if rows else ()
    if not n:
        return torch.zeros(*lead, 0, dtype=torch.int64, device=packed.device)
    flat = (packed if rows else packed.reshape(-1))[..., : (n * bits + 7) // 8]
    if _NUMPY_BITS and not gpu_side(flat.device):
        got = np.unpackbits(flat.contiguous().numpy(), axis=-1, count=n * bits, bitorder="little")
        stream = torch.from_numpy(got)
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)
        stream = ((flat.unsqueeze(-1) >> shifts) & 1).reshape(*lead, -1)[..., : n * bits]
    shifts = torch.arange(bits, dtype=torch.int64, device=flat.device)
    return (stream.reshape(*lead, n, bits).to(torch.int64) << shifts).sum(dim=-1)
